//! Who is being limited, on the admin port: `GET /limited` names each limited rule with its
//! heaviest refused and hit keys, their counts and the error bound, and the keys nearest their
//! limit with their counter's state now; `/metrics` has the top keys as bounded series; `GET
//! /limited/page` serves the live page, which sets every value as text. `metrics.top_keys: 0`
//! tracks nothing.

use sluice::settings::Written;

use crate::helpers::{TestServer, http_get, metric, single};

const POLICY: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 3, name: per_user}\n";
const HOSTILE: &str = "<img src=x onerror=alert(1)>";

/// Calls `value`'s counter `n` times.
async fn calls(s: &TestServer, value: &str, n: usize) {
    for _ in 0..n {
        s.call(single("api", "user", value)).await.expect("decided");
    }
}

async fn limited(s: &TestServer) -> serde_json::Value {
    let (status, body) = http_get(s.admin, "/limited").await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

#[tokio::test]
async fn the_heaviest_refused_keys_and_the_nearest_their_limit_are_shown() {
    let s = TestServer::start(&[("api.yaml", POLICY)]).await;
    calls(&s, "alice", 10).await;
    calls(&s, "bob", 2).await;
    calls(&s, HOSTILE, 5).await;
    let j = limited(&s).await;
    assert_eq!(j["backend"], "memory", "{j}");
    assert_eq!(j["top_keys"], 10, "{j}");
    assert_eq!(j["capacity_per_rule"], 100, "{j}");
    assert_eq!(j["policy"]["version"], 1, "{j}");
    let rules = j["rules"].as_array().expect("rules");
    assert_eq!(rules.len(), 1, "{j}");
    let r = &rules[0];
    assert_eq!(
        (r["domain"].as_str(), r["rule"].as_str()),
        (Some("api"), Some("api.user"))
    );
    assert_eq!(r["name"], "per_user");
    assert_eq!(r["limit"]["requests_per_unit"], 3);
    assert_eq!(
        (r["admitted_total"].as_u64(), r["refused_total"].as_u64()),
        (Some(8), Some(9))
    );
    assert_eq!(
        (
            r["window"]["hits"].as_u64(),
            r["window"]["refused"].as_u64()
        ),
        (Some(17), Some(9))
    );
    assert_eq!(
        r["error_bound"]["refused"], 0,
        "9 refusals over 100 slots: exact"
    );
    let refused: Vec<(&str, u64)> = r["top_refused"]
        .as_array()
        .expect("top_refused")
        .iter()
        .map(|k| {
            (
                k["entries"][0]["value"].as_str().unwrap_or(""),
                k["count"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(refused, [("alice", 7), (HOSTILE, 2)]);
    assert_eq!(r["top_hits"][0]["entries"][0]["value"], "alice");
    assert_eq!(r["top_hits"][0]["count"], 10);
    // Nearest the limit: the two exhausted keys, read from their counters now (an hour's
    // bucket of 3: 20 minutes until one more), then bob with one left.
    let near = r["nearest_limit"].as_array().expect("nearest_limit");
    assert_eq!(near.len(), 3, "{j}");
    assert_eq!(near[0]["remaining"], 0);
    assert_eq!(near[0]["now"], true);
    assert_eq!(near[0]["wait_ms"], 1_200_000, "{j}");
    assert_eq!(near[2]["entries"][0]["value"], "bob");
    assert_eq!(near[2]["remaining"], 1);

    let series =
        "sluice_rule_top_refused{domain=\"api\",rule=\"api.user\",rank=\"1\",key=\"user=alice\"}";
    assert_eq!(metric(s.admin, series).await, Some(7.0));
    let (_, text) = http_get(s.admin, "/metrics").await;
    let top_hits = text
        .lines()
        .filter(|l| l.starts_with("sluice_rule_top_hits{"))
        .count();
    assert_eq!(top_hits, 3, "one series per key shown");
}

#[tokio::test]
async fn the_page_is_self_contained_and_sets_values_as_text() {
    let s = TestServer::start(&[("api.yaml", POLICY)]).await;
    let raw = crate::helpers::http_raw(s.admin, "GET", "/limited/page", "").await;
    let (head, body) = raw.split_once("\r\n\r\n").expect("a response");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/html"),
        "{head}"
    );
    assert!(
        head.to_ascii_lowercase()
            .contains("content-security-policy: default-src 'none'"),
        "{head}"
    );
    assert!(body.contains("fetch(\"/limited\""), "polls the JSON");
    assert!(!body.contains("innerHTML") && !body.contains("insertAdjacentHTML"));
    assert!(
        !body.contains("src=\"http") && !body.contains("href=\"http"),
        "no external asset"
    );
}

#[tokio::test]
async fn top_keys_zero_tracks_nothing() {
    let s = TestServer::start_with(&[("api.yaml", POLICY)], |w: &mut Written| {
        w.metrics.top_keys = 0;
    })
    .await;
    calls(&s, "alice", 5).await;
    let j = limited(&s).await;
    assert_eq!(j["rules"], serde_json::json!([]), "{j}");
    let (_, text) = http_get(s.admin, "/metrics").await;
    assert!(!text.contains("sluice_rule_top_refused"));
}

#[tokio::test]
async fn in_redis_mode_a_node_shows_its_own_decisions_and_the_fleets_counters() {
    use crate::helpers::redis::RedisProcess;
    use crate::helpers::{eventually, redis_missing};
    use sluice::settings::BackendKind;
    if redis_missing("in_redis_mode_a_node_shows_its_own_decisions_and_the_fleets_counters") {
        return;
    }
    let redis = RedisProcess::start();
    let url = redis.url();
    let s = TestServer::start_with(&[("api.yaml", POLICY)], move |w: &mut Written| {
        w.backend = BackendKind::Redis;
        w.redis.url = url;
        w.redis.key_prefix = "sluice-limited:".into();
        w.redis.timeout_ms = 2_000;
    })
    .await;
    assert!(
        eventually(std::time::Duration::from_secs(10), || async {
            s.call(single("api", "user", "warmup")).await.is_ok()
        })
        .await,
        "redis answers"
    );
    calls(&s, "alice", 5).await;
    let j = limited(&s).await;
    assert_eq!(j["backend"], "redis", "{j}");
    assert!(
        j["view"]
            .as_str()
            .unwrap_or("")
            .starts_with("this node's decisions only"),
        "{j}"
    );
    let r = &j["rules"][0];
    assert_eq!(r["top_refused"][0]["entries"][0]["value"], "alice", "{j}");
    assert_eq!(r["top_refused"][0]["count"], 2, "{j}");
    let near = &r["nearest_limit"][0];
    assert_eq!(near["entries"][0]["value"], "alice", "{j}");
    assert_eq!(
        (near["remaining"].as_u64(), near["now"].as_bool()),
        (Some(0), Some(true)),
        "{j}"
    );
}

#[tokio::test]
async fn sluice_top_prints_the_rule_and_its_heaviest_refused_key() {
    let s = TestServer::start(&[("api.yaml", POLICY)]).await;
    calls(&s, "alice", 6).await;
    let admin = s.admin.to_string();
    // A blocking child, on the blocking pool: the server answers it from this runtime.
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["top", &admin, "--once"])
            .output()
    })
    .await
    .expect("joined")
    .expect("sluice top runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("api / api.user (per_user)"), "{text}");
    assert!(text.contains("(3 total) · refused - (3 total)"), "{text}");
    let row = text
        .lines()
        .skip_while(|l| !l.contains("top refused"))
        .nth(1)
        .unwrap_or("");
    assert!(row.trim_start().starts_with("user=alice"), "{text}");
}
