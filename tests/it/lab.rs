//! The stampede lab: `sluice check`'s guarantees, `sluice replay`'s built-in scenarios and
//! traces against numbers worked out by hand, replay against the running server, and `sluice
//! probe` against a server started here.

use std::process::{Command, Output};

use serde_json::Value;
use sluice::lab::{Algorithm, Lab, TraceReader};
use sluice::policy::load_str;

use crate::helpers::{TestServer, descriptor, request};

const BIN: &str = env!("CARGO_BIN_EXE_sluice");

fn sluice(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("RUST_LOG")
        .output()
        .expect("run sluice")
}

fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON document")
}

/// `(admitted, denied, worst_second, worst_period)` of one algorithm of one rule.
fn numbers(report: &Value, path: &str, algorithm: &str) -> (u64, u64, u64, u64) {
    let rule = report["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["path"] == path)
        .unwrap_or_else(|| panic!("no rule {path} in {report}"));
    let a = &rule["algorithms"][algorithm];
    let n = |f: &str| {
        a[f].as_u64()
            .unwrap_or_else(|| panic!("{path} {algorithm} {f}: {a}"))
    };
    (
        n("admitted"),
        n("denied"),
        n("worst_second"),
        n("worst_period"),
    )
}

const TWO_RULES: &str = "\
domain: db
descriptors:
  - key: tenant
    rate_limit: {name: inherited, unit: minute, requests_per_unit: 5000}
  - key: batch
    rate_limit: {name: chosen, unit: minute, requests_per_unit: 5000, burst: 100}
";

#[test]
fn check_rates_an_inherited_and_a_chosen_burst() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("db.yaml"), TWO_RULES).unwrap();
    let d = dir.path().to_str().unwrap();
    let out = sluice(&["check", d]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "warnings do not fail without --strict"
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    // T = 60 s / 5000 = 12 ms. Inherited: B = 5000, worst second 5000 + floor(1 s / 12 ms) =
    // 5083, worst minute 5000 + 5000 = 10000. Chosen: 100 + 83 = 183 and 100 + 5000 = 5100.
    // A fixed window of 5000 per minute: 2 × 5000 = 10000 in its worst second.
    for expected in [
        "db.tenant (inherited)\n  rate 5000 per minute, burst 5000 (inherited)\n",
        "at most 5000 at once after idling, then one every 12ms; at most 5083 in any second, 10000 in any minute",
        "the burst is inherited (B = L): the worst minute is 10000 (2·L)",
        "db.batch (chosen)\n  rate 5000 per minute, burst 100 (set)\n",
        "at most 100 at once after idling, then one every 12ms; at most 183 in any second, 5100 in any minute",
        "a fixed window of 5000 per minute lets 10000 through in its worst second",
    ] {
        assert!(stdout.contains(expected), "{expected:?} not in:\n{stdout}");
    }
    assert_eq!(
        stdout.matches("only a chosen burst bounds").count(),
        1,
        "{stdout}"
    );
    let last = stdout.lines().last().unwrap();
    assert!(
        last.starts_with(d)
            && last.ends_with(": 1 files, 1 domains, 2 rules (2 limited, 0 bans, 0 unlimited): ok"),
        "{last}"
    );
    assert_eq!(stderr.matches("warning:").count(), 1, "{stderr}");
    assert!(
        stderr.contains("warning: db.tenant (inherited): burst inherited"),
        "{stderr}"
    );

    let strict = sluice(&["check", "--strict", d]);
    assert_eq!(strict.status.code(), Some(1));

    let doc = json(&sluice(&["check", "--json", d]));
    let rules = doc["rules"].as_array().unwrap();
    assert_eq!(rules.len(), 2);
    let by = |name: &str| rules.iter().find(|r| r["name"] == name).unwrap();
    let (inh, cho) = (by("inherited"), by("chosen"));
    assert_eq!(inh["domain"], "db");
    assert_eq!(inh["path"], "db.tenant");
    assert_eq!(
        (inh["burst"].as_u64(), inh["burst_set"].as_bool()),
        (Some(5000), Some(false))
    );
    assert_eq!(inh["worst_second"], 5083);
    assert_eq!(inh["worst_period"], 10_000);
    assert_eq!(inh["fixed_window_worst_second"], 10_000);
    assert_eq!(cho["path"], "db.batch");
    assert_eq!(
        (cho["burst"].as_u64(), cho["burst_set"].as_bool()),
        (Some(100), Some(true))
    );
    assert_eq!(cho["worst_second"], 183);
    assert_eq!(cho["worst_period"], 5100);
    assert_eq!(doc["warnings"].as_array().unwrap().len(), 1);
    assert_eq!(
        doc["summary"],
        "1 files, 1 domains, 2 rules (2 limited, 0 bans, 0 unlimited)"
    );
}

#[test]
fn boundary_scenario_matches_the_hand_count() {
    let r = json(&sluice(&["replay", "--scenario", "boundary", "--json"]));
    let p = "boundary.client";
    // Fixed window: window [0, 60 s) takes the 100 at 59.9 s, window [60 s, 120 s) the 100
    // at 60.1 s: 200 admitted within 0.2 s.
    assert_eq!(numbers(&r, p, "fixed_window"), (200, 0, 200, 200));
    // GCRA, B = L = 100, T = 600 ms: the fresh bucket takes 100 at 59.9 s; 0.2 s later
    // floor(0.2 / 0.6) = 0 more have accrued.
    assert_eq!(numbers(&r, p, "gcra"), (100, 100, 100, 100));
    // Sliding log: at 60.1 s the 100 from 59.9 s are within the last 60 s.
    assert_eq!(numbers(&r, p, "sliding_log"), (100, 100, 100, 100));
    // Sliding counter at 60.1 s (e = 0.1 s): 100 · (60 − 0.1) / 60 + 0 + 1 = 100.83 > 100.
    assert_eq!(numbers(&r, p, "sliding_window"), (100, 100, 100, 100));
}

#[test]
fn stampede_scenario_matches_the_hand_count() {
    let r = json(&sluice(&["replay", "--scenario", "stampede", "--json"]));
    // 2500 arrivals at 59 s + i/2500 s, then 2300 at 60 s + j/2300 s: 4800 in two seconds.
    // The busiest closed second is [59 s, 60 s]: all 2500 of the first second and the one at
    // exactly 60 s, 2501. Every minute holds at most 4800 < 5000, so with the inherited burst
    // every algorithm admits everything (sliding counter at 60 s + e: 2500 · (60 − e)/60 +
    // 2300 ≤ 4800 ≤ 5000).
    for a in ["gcra", "fixed_window", "sliding_log", "sliding_window"] {
        assert_eq!(
            numbers(&r, "stampede.burst_inherited", a),
            (4800, 0, 2501, 4800),
            "{a}"
        );
    }
    // The chosen burst of 100, T = 12 ms: 100 at once, then one per 12 ms while requests keep
    // coming (every 0.4 ms or so): 100 + floor((60.999565 − 59) / 0.012) = 100 + 166 = 266 in
    // all, 4800 − 266 = 4534 refused; in [59 s, 60 s] 100 + floor(1 / 0.012) = 183.
    assert_eq!(
        numbers(&r, "stampede.burst_chosen", "gcra"),
        (266, 4534, 183, 266)
    );
    // The other three know no burst: the same 4800 as before.
    for a in ["fixed_window", "sliding_log", "sliding_window"] {
        assert_eq!(
            numbers(&r, "stampede.burst_chosen", a),
            (4800, 0, 2501, 4800),
            "{a}"
        );
    }
}

/// A directory `name` in `dir` holding one policy file, `file`, of `yaml`.
fn policy_dir(dir: &tempfile::TempDir, name: &str, file: &str, yaml: &str) -> std::path::PathBuf {
    let policies = dir.path().join(name);
    std::fs::create_dir(&policies).unwrap();
    std::fs::write(policies.join(file), yaml).unwrap();
    policies
}

#[test]
fn token_bucket_example_as_a_gzipped_trace() {
    let dir = tempfile::tempdir().unwrap();
    // Capacity 10, refill 2 per second: B = 10, T = 500 ms.
    let policies = policy_dir(
        &dir,
        "policies",
        "tb.yaml",
        "domain: tb\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 2, burst: 10}\n",
    );
    let body = r#""domain":"tb","descriptors":[{"entries":[{"key":"user","value":"u"}]}]"#;
    let mut lines = String::new();
    for _ in 0..15 {
        lines.push_str(&format!("{{\"t\":100,{body}}}\n"));
    }
    for i in 0..10 {
        lines.push_str(&format!(
            "{{\"t\":{},{body}}}\n",
            103.0 + f64::from(i) * 0.001
        ));
    }
    let trace = dir.path().join("trace.jsonl.gz");
    {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&trace).unwrap(),
            flate2::Compression::default(),
        );
        gz.write_all(lines.as_bytes()).unwrap();
        gz.finish().unwrap();
    }
    let r = json(&sluice(&[
        "replay",
        "--policies",
        policies.to_str().unwrap(),
        trace.to_str().unwrap(),
        "--json",
    ]));
    // 15 at once: the full bucket admits 10. 3 s later floor(3 / 0.5) = 6 tokens are back:
    // 6 of the 10 quick requests (spread over 9 ms, less than T). 16 of 25; the worst second
    // holds the first 10, the worst period (1 s) the same.
    assert_eq!(numbers(&r, "tb.user", "gcra"), (16, 9, 10, 10));
}

/// 1,000 tokens a minute and an 800-token answer a second, each reported 0.5 s after its check
/// of cost 0, for 70 s, replayed as a token trace (the AI Gateway recipe).
#[test]
fn a_token_trace_gcra_stays_in_debt_where_the_fixed_window_forgets_it() {
    let dir = tempfile::tempdir().unwrap();
    let policies = policy_dir(
        &dir,
        "policies",
        "ai.yaml",
        "domain: ai\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 1000}\n",
    );
    let body = r#""domain":"ai","descriptors":[{"entries":[{"key":"tenant","value":"a"}]}]"#;
    let mut lines = String::from("# t, then tokens reported duration seconds later\n");
    for t in 0..70 {
        lines.push_str(&format!(
            "{{\"t\":{t},\"tokens\":800,\"duration\":0.5,{body}}}\n"
        ));
    }
    let trace = dir.path().join("tokens.jsonl");
    std::fs::write(&trace, &lines).unwrap();
    let r = json(&sluice(&[
        "replay",
        "--policies",
        policies.to_str().unwrap(),
        trace.to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(r["tokens"], true);
    let rule = &r["rules"][0];
    assert_eq!(rule["path"], "ai.tenant");
    assert!(
        rule["algorithms"].get("sliding_log").is_none(),
        "a token trace runs GCRA and the fixed window only: {rule}"
    );
    let calls = |a: &str| {
        let c = &rule["algorithms"][a]["calls"];
        (
            c["admitted"].as_u64().unwrap(),
            c["denied"].as_u64().unwrap(),
        )
    };
    // GCRA, T = 60 ms: the checks at 0 s and 1 s pass, and their reports leave a debt of
    // 48 s + 48 s − 1 s = 95 s at 1.5 s, past the bucket's 60 s: checks are refused until
    // 36.5 s. The check at 37 s passes (debt 59.5 s) and its report takes the debt to 107 s,
    // back within the bucket only at 84.5 s, after the trace. Three calls, 2,400 tokens.
    assert_eq!(calls("gcra"), (3, 67));
    assert_eq!(
        numbers(&r, "ai.tenant", "gcra"),
        (2_400, 67 * 800, 1_600, 2_400)
    );
    // The fixed window: the checks at 0 s and 1 s pass, the count is then 1,600 > 1,000 and
    // checks are refused until the window ends at 60 s, which forgets the 600 over; 60 s and
    // 61 s pass again. Four calls, 3,200 tokens; three reports (1.5 s, 60.5 s and 61.5 s) in
    // one closed minute.
    assert_eq!(calls("fixed_window"), (4, 66));
    assert_eq!(
        numbers(&r, "ai.tenant", "fixed_window"),
        (3_200, 66 * 800, 1_600, 2_400)
    );
    // The same calls through the lab's own API, one verdict per check: GCRA refuses at 60 s,
    // still in debt, where the fixed window's new window admits.
    let set = load_str(&[(
        "ai.yaml",
        &std::fs::read_to_string(policies.join("ai.yaml")).unwrap(),
    )])
    .unwrap();
    let mut lab = Lab::new(set, &Algorithm::TOKENS);
    let req = sluice::decision::Request::from_entries("ai", &[&[("tenant", "a")]]);
    let usage = sluice::lab::Usage {
        tokens: 800,
        duration: 500_000_000,
    };
    let (mut gcra, mut fixed) = (Vec::new(), Vec::new());
    for t in 0..70u64 {
        let v = lab.offer_usage(t * 1_000_000_000, &req, usage).unwrap();
        if v[0].admitted {
            gcra.push(t);
        }
        if v[1].admitted {
            fixed.push(t);
        }
        if t == 2 {
            assert_eq!(
                v[0].retry_after, 35,
                "the debt is back in the bucket at 36.5 s"
            );
        }
    }
    assert_eq!(gcra, [0, 1, 37]);
    assert_eq!(fixed, [0, 1, 60, 61]);
    assert_eq!(lab.finish().unwrap().requests, 70);
}

/// The built-in token scenario: GCRA holds every minute to the bucket, the rate and what was in
/// flight; the fixed window admits more, at the start of each window.
#[test]
fn token_scenario_matches_the_bound() {
    let r = json(&sluice(&["replay", "--scenario", "tokens", "--json"]));
    let p = "ai.tenant";
    let a = |alg: &str| &r["rules"][0]["algorithms"][alg];
    let calls = |alg: &str| {
        (
            a(alg)["calls"]["admitted"].as_u64().unwrap(),
            a(alg)["calls"]["denied"].as_u64().unwrap(),
        )
    };
    assert_eq!(calls("gcra"), (24, 156));
    assert_eq!(calls("fixed_window"), (34, 146));
    let (gcra, _, _, gcra_minute) = numbers(&r, p, "gcra");
    let (fixed, _, _, fixed_minute) = numbers(&r, p, "fixed_window");
    assert_eq!((gcra, fixed), (24_340, 33_466));
    // B + P / T = 12,000 in any minute, plus at most one call in flight (≤ 1,500 tokens).
    assert!((12_000..=13_500).contains(&gcra_minute), "{gcra_minute}");
    assert_eq!(gcra_minute, 12_798);
    assert_eq!(fixed_minute, 14_593);
}

#[test]
fn a_bad_trace_line_is_named_and_nothing_panics() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"t\":1,\"domain\":\"boundary\",\"descriptors\":[{\"entries\":[{\"key\":\"client\",\"value\":\"a\"}]}]}\n{\"t\":2,\"domain\":\"boundary\",\"descriptors\":[]}\n",
    )
    .unwrap();
    let policies = policy_dir(&dir, "p", "b.yaml", sluice::lab::scenario::BOUNDARY_POLICY);
    let out = sluice(&[
        "replay",
        "--policies",
        policies.to_str().unwrap(),
        trace.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("t.jsonl:2: rate limit descriptor list must not be empty"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn retry_storm_lockstep_retries_stampede_and_jitter_spreads_them() {
    let r = json(&sluice(&["replay", "--scenario", "retry-storm", "--json"]));
    let offered = |path: &str, a: &str| {
        let rule = r["rules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["path"] == path)
            .unwrap();
        rule["algorithms"][a]["offered_worst_second"]
            .as_u64()
            .unwrap()
    };
    // 3000 clients over [50 s, 60 s): 300 a second. A fixed window admits the first 1000
    // (to 53.33 s) and tells the other 2000 to come back at the next window, 60 s: in lockstep
    // they all return within [60 s, 61 s), a second wave far above the first one's 300/s.
    assert!(offered("retry.clients_lockstep", "fixed_window") >= 2000);
    // Each refused client retries within 30 s of jitter: the wave is spread thin, never
    // above the first one's 300 a second by much.
    for a in ["gcra", "fixed_window", "sliding_log", "sliding_window"] {
        let (lockstep, jittered) = (
            offered("retry.clients_lockstep", a),
            offered("retry.clients_jittered", a),
        );
        assert!(jittered < 400, "{a}: {jittered}");
        assert!(
            lockstep > 3 * jittered,
            "{a}: lockstep {lockstep}, jittered {jittered}"
        );
    }
}

const SAME_PATH: &str = "\
domain: same
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5, burst: 3}
  - key: ip
    rate_limit: {unit: second, requests_per_unit: 2}
";

/// A request of the schedule: (milliseconds, descriptors of one entry each, `hits_addend`).
type Scheduled = (u64, Vec<(&'static str, &'static str)>, u32);

#[tokio::test]
async fn replay_answers_as_the_running_server_does() {
    // Requests at relative times (ms), some with two descriptors and a cost.
    let schedule: Vec<Scheduled> = vec![
        (0, vec![("user", "a")], 0),
        (0, vec![("user", "a"), ("ip", "1")], 0),
        (5, vec![("user", "a")], 0),
        (5, vec![("user", "a")], 0),
        (10, vec![("ip", "1")], 2),
        (400, vec![("ip", "1")], 0),
        (600, vec![("ip", "1")], 0),
        (12_000, vec![("user", "a")], 0),
        (12_001, vec![("user", "a"), ("ip", "2")], 3),
        (24_000, vec![("user", "b"), ("ip", "2")], 0),
        (60_000, vec![("user", "a")], 2),
        (60_000, vec![("user", "a")], 2),
    ];
    let server = TestServer::start(&[("same.yaml", SAME_PATH)]).await;
    let base = sluice::limiter::Clock::now(server.clock.as_ref());
    let mut lab = Lab::new(
        load_str(&[("same.yaml", SAME_PATH)]).unwrap(),
        &[Algorithm::Gcra],
    );
    // The same requests, as the server gets them over gRPC and as a trace file has them.
    let mut from_server = Vec::new();
    let mut trace = String::new();
    for (ms, entries, hits) in &schedule {
        let t = ms * 1_000_000;
        server.clock.set(base + t);
        let descs = entries
            .iter()
            .map(|&(k, v)| descriptor(&[(k, v)]))
            .collect();
        let mut req = request("same", descs);
        req.hits_addend = *hits;
        let resp = server.ok(req).await;
        let over = resp.overall_code == sluice::pb::rate_limit_response::Code::OverLimit as i32;
        let retry = resp
            .statuses
            .iter()
            .filter(|s| s.code == sluice::pb::rate_limit_response::Code::OverLimit as i32)
            .filter_map(|s| s.duration_until_reset.map(|d| d.seconds as u64))
            .max()
            .unwrap_or(0);
        from_server.push((!over, retry));

        let descriptors: Vec<Value> = entries
            .iter()
            .map(|(k, v)| serde_json::json!({"entries": [{"key": k, "value": v}]}))
            .collect();
        let line = serde_json::json!({
            "t": *ms as f64 / 1000.0,
            "domain": "same",
            "descriptors": descriptors,
            "hitsAddend": hits,
        });
        trace.push_str(&format!("{line}\n"));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("same.jsonl");
    std::fs::write(&path, trace).unwrap();
    let mut from_lab = Vec::new();
    for event in TraceReader::open(&path).unwrap() {
        let event = event.unwrap();
        let v = lab.offer(event.t, &event.request).unwrap();
        from_lab.push((v[0].admitted, v[0].retry_after));
    }
    assert_eq!(from_lab, from_server);
    // And the answers are not trivial: some of each.
    assert!(from_server.iter().any(|(ok, _)| *ok));
    assert!(from_server.iter().any(|(ok, r)| !*ok && *r > 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_drives_a_server_and_reports_what_it_saw() {
    let policy = "domain: p\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
    let server = TestServer::start_with(&[("p.yaml", policy)], |s| {
        s.response_headers = sluice::decision::HeaderMode::Legacy;
    })
    .await;
    // The server's clock stands still: the bucket of 5 never refills, so of 40 calls exactly
    // 5 are OK and 35 OVER_LIMIT.
    let addr = server.grpc.to_string();
    let out = tokio::task::spawn_blocking(move || {
        sluice(&[
            "probe",
            &addr,
            "--domain",
            "p",
            "--descriptor",
            "k=v",
            "--rate",
            "400",
            "--concurrency",
            "4",
            "--duration",
            "5",
            "--requests",
            "40",
            "--json",
        ])
    })
    .await
    .unwrap();
    let r = json(&out);
    assert_eq!(r["calls"], 40);
    assert_eq!(r["ok"], 5);
    assert_eq!(r["over_limit"], 35);
    assert_eq!(r["errors"], 0);
    let timeline = r["timeline"].as_array().unwrap();
    let sum = |f: &str| timeline.iter().map(|s| s[f].as_u64().unwrap()).sum::<u64>();
    assert_eq!((sum("ok"), sum("over_limit")), (5, 35));
    assert!(r["latency"]["max_us"].as_u64().unwrap() >= r["latency"]["p50_us"].as_u64().unwrap());
    assert!(r["latency"]["max_us"].as_u64().unwrap() > 0);
    // The legacy headers, on every answer.
    assert_eq!(
        r["headers"]["RateLimit-Limit"]["count"], 40,
        "{}",
        r["headers"]
    );
    // Four workers race, so which call the server decided first is not fixed; every value
    // is one of the bucket's 4..0 left.
    let first: u64 = r["headers"]["RateLimit-Remaining"]["first"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(first <= 4, "{first}");

    // The text form: the timeline, the latency line, the headers.
    let addr = server.grpc.to_string();
    let out = tokio::task::spawn_blocking(move || {
        sluice(&[
            "probe",
            &addr,
            "--domain",
            "p",
            "--descriptor",
            "k=v",
            "--rate",
            "100",
            "--duration",
            "0.2",
        ])
    })
    .await
    .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with("utc "), "{text}");
    assert!(text.contains("over_limit 20"), "{text}");
    assert!(text.contains("latency: p50 "), "{text}");
    assert!(text.contains("RateLimit-Remaining: 0"), "{text}");
}

/// Whether the numbers written can be counted: the period fits `u64` nanoseconds and the bucket
/// `B·T` stays within 2^62 ns. Exact arithmetic, independent of the loader's.
fn representable(unit_seconds: u64, multiplier: u64, requests: u64, burst: u64) -> bool {
    let period = u128::from(unit_seconds) * u128::from(multiplier) * 1_000_000_000;
    period <= u128::from(u64::MAX)
        && (requests == 0 || period.div_ceil(u128::from(requests)) * u128::from(burst) <= 1 << 62)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    /// For any rule the loader accepts, what `sluice check` promises and what the limiter does
    /// on a schedule agree with the numbers written: the period and `T = ceil(P / L)` computed
    /// exactly; `B` admitted at once and the next one denied; one more after `T`, not before;
    /// `floor(P / T)` more across a span of the period and no further one. A rule refused is one
    /// whose period or bucket cannot be represented.
    #[test]
    fn what_check_promises_is_what_the_limiter_does(
        unit in 0usize..7,
        multiplier in proptest::prop_oneof![1u64..=10, 1u64..=1_000_000],
        requests in proptest::prop_oneof![0u64..=10, 0u64..=u64::from(u32::MAX)],
        burst in proptest::option::of(proptest::prop_oneof![1u64..=10, 1u64..=u64::from(u32::MAX)]),
        t0 in 0u64..(1 << 50),
    ) {
        use sluice::lab::guarantees;
        use sluice::limiter::MemoryStore;
        use sluice::policy::Limit;

        let (name, seconds) = [
            ("second", 1u64), ("minute", 60), ("hour", 3_600), ("day", 86_400),
            ("week", 604_800), ("month", 2_592_000), ("year", 31_536_000),
        ][unit];
        let burst_field = burst.map_or(String::new(), |b| format!(", burst: {b}"));
        let yaml = format!(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: {name}, \
             unit_multiplier: {multiplier}, requests_per_unit: {requests}{burst_field}}}\n"
        );
        let b = burst.unwrap_or(requests);
        let Ok(set) = load_str(&[("p.yaml", &yaml)]) else {
            proptest::prop_assert!(!representable(seconds, multiplier, requests, b), "{yaml}");
            return Ok(());
        };
        proptest::prop_assert!(representable(seconds, multiplier, requests, b), "{yaml}");
        let rule = set.domain("d").unwrap().rules().next().unwrap().clone();
        let Limit::Limited(rate) = rule.limit else { panic!("{yaml}: not limited") };
        let q = rate.quota;
        let period = u128::from(seconds) * u128::from(multiplier) * 1_000_000_000;
        proptest::prop_assert_eq!(u128::from(q.period()), period);
        let promised = guarantees(&set);
        if requests == 0 {
            proptest::prop_assert!(q.is_ban() && promised.is_empty());
            return Ok(());
        }
        let g = &promised[0];
        let t = period.div_ceil(u128::from(requests));
        proptest::prop_assert_eq!(u128::from(g.interval_ns), t);
        proptest::prop_assert_eq!(u128::from(g.period_seconds), period / 1_000_000_000);
        proptest::prop_assert_eq!(u64::from(g.burst), b);
        let t = g.interval_ns;

        let store = MemoryStore::new();
        // First denial: B at once (one by one while that is cheap), then nothing more.
        if b <= 64 {
            for i in 0..b {
                proptest::prop_assert!(store.count(1, &q, t0, 1).admitted, "request {} of {b}", i + 1);
            }
        } else {
            proptest::prop_assert!(store.count(1, &q, t0, b).admitted);
        }
        proptest::prop_assert!(!store.count(1, &q, t0, 1).admitted, "request {} passed", b + 1);
        // Refill: the next one T later, and not a nanosecond before.
        proptest::prop_assert!(!store.count(1, &q, t0 + t - 1, 1).admitted);
        proptest::prop_assert!(store.count(1, &q, t0 + t, 1).admitted);
        // Worst window: `worst_period` is B + floor(P / T), exactly; across a span W the
        // greedy schedule (B at its start, then each token as it refills, taken in draws of at
        // most B) gets B + floor(W / T) through, and no further one at its end. W is the
        // period, cut to 4,096 buckets' refill and to the clock's first 2^62 ns (where the
        // limiter's arithmetic is stated to hold).
        proptest::prop_assert_eq!(
            u128::from(g.worst_period),
            u128::from(b) + period / u128::from(t)
        );
        let span = q
            .period()
            .min(4_096u64.saturating_mul(q.tolerance()))
            .min((1 << 62) - t0);
        let fresh = MemoryStore::new();
        proptest::prop_assert!(fresh.count(2, &q, t0, b).admitted);
        let (mut more, mut at) = (span / t, t0);
        while more > 0 {
            let draw = more.min(b);
            at += draw * t;
            proptest::prop_assert!(fresh.count(2, &q, at, draw).admitted, "{draw} at {at}");
            more -= draw;
        }
        proptest::prop_assert!(!fresh.count(2, &q, t0 + span, 1).admitted);
    }
}

/// The delay scenario: the stampede's arrivals against a rule that refuses and one that delays
/// up to 2 s, both 5,000 per minute with a burst of 100. The refusing one lets through what the
/// stampede's chosen burst does; the delaying one admits 2 s of slots more, each at its slot,
/// never waiting past its delay, and no more in any second: the bound holds on admission times.
#[test]
fn the_delay_scenario_admits_at_slots_within_the_delay_and_keeps_the_bound() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["replay", "--scenario", "delay", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rule = |name: &str| {
        doc["rules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap()["algorithms"]["gcra_delay"]
            .clone()
    };
    let (refusing, delaying) = (rule("refusing"), rule("delaying"));
    // 100 + floor(2 s / 12 ms): as `--scenario stampede`'s chosen burst.
    assert_eq!(refusing["admitted"], 266);
    assert!(refusing.get("waits").is_none());
    // 100 + floor((2 s + 2 s) / 12 ms): the stampede's two seconds and the delay.
    assert_eq!(delaying["admitted"], 433);
    assert_eq!(delaying["denied"], 4800 - 433);
    // B + floor(1 s / T) = 100 + 83 in any second, with or without delay.
    assert_eq!(refusing["worst_second"], 183);
    assert_eq!(delaying["worst_second"], 183);
    let waits = &delaying["waits"];
    assert_eq!(waits["longest_ns"], 2_000_000_000_u64);
    assert!(waits["delayed"].as_u64().unwrap() > 300, "{waits}");
    assert!(
        waits["mean_ns"].as_u64().unwrap() < 2_000_000_000,
        "{waits}"
    );
    let text = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["replay", "--scenario", "delay"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(
            "delay.rule_delaying (delaying): 5000 per minute, burst 100 (set), delay 2s\n"
        ),
        "{text}"
    );
}
