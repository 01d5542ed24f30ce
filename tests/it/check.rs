//! `sluice check`: every broken fixture (one per kind of error) is reported with its file, line
//! and descriptor path, and exits 2; files that would cost unbounded time or memory are refused
//! quickly; the shipped `config/` passes with 0.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_sluice");
const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/broken");

fn check(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("check")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("RUST_LOG")
        .output()
        .expect("run sluice check")
}

/// Runs `check` with `args`, killing it if it has not exited within `limit`: (exit status,
/// stderr), or `None` when it had to be killed.
fn check_within(args: &[&str], limit: Duration) -> Option<(i32, String)> {
    let mut child = Command::new(BIN)
        .arg("check")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run sluice check");
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("wait for sluice check") {
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
            return Some((status.code().unwrap_or(-1), stderr));
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs `check` on a directory holding only `files` (copied from the fixtures).
fn check_fixtures(files: &[&str]) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    for f in files {
        std::fs::copy(Path::new(FIXTURES).join(f), dir.path().join(f)).unwrap();
    }
    let out = check(&[dir.path().to_str().unwrap()]);
    assert!(out.stdout.is_empty(), "nothing on stdout for a failure");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn each_broken_fixture_is_named_with_its_path_and_exits_2() {
    let cases = [
        ("syntax.yaml", ":5:1: invalid YAML"),
        (
            "unknown_field.yaml",
            ":4:5: descriptors[0].ratelimit: unknown field `ratelimit`",
        ),
        (
            "duplicate_descriptor.yaml",
            ":5:5: descriptors[1]: duplicate descriptor `remote_address`",
        ),
        ("missing_domain.yaml", ":1:1: domain: missing domain"),
        (
            "empty_domain.yaml",
            ":1:9: domain: config file cannot have empty domain",
        ),
        (
            "empty_key.yaml",
            ":3:5: descriptors[0]: descriptor has empty key",
        ),
        (
            "bad_unit.yaml",
            ":7:28: descriptors[0].descriptors[0].rate_limit.unit: invalid rate limit unit \"minutes\"",
        ),
        (
            "unlimited_with_unit.yaml",
            "descriptors[0].rate_limit.unit: should not specify rate limit unit when unlimited",
        ),
        (
            "replaces_self.yaml",
            "descriptors[0].rate_limit.replaces[0].name: replaces should not contain name of same descriptor",
        ),
        (
            "replaces_empty.yaml",
            "descriptors[0].rate_limit.replaces[0].name: should not have an empty replaces entry",
        ),
        (
            "zero_burst.yaml",
            "descriptors[0].rate_limit.burst: must be between 1 and 4294967295, found 0",
        ),
        (
            "zero_multiplier.yaml",
            "descriptors[0].rate_limit.unit_multiplier: must be between 1 and 1000000, found 0",
        ),
        (
            "bad_number.yaml",
            "descriptors[0].rate_limit.requests_per_unit: expected a whole number ≥ 0, found \"ten\"",
        ),
        (
            "share_threshold_without_wildcard.yaml",
            "descriptors[0].share_threshold: share_threshold needs a value with a `*` wildcard",
        ),
        (
            "bad_name.yaml",
            "descriptors[0].rate_limit.name: name must not contain '\"'",
        ),
        (
            "too_long.yaml",
            "descriptors[0].rate_limit: burst × period / requests_per_unit is longer than 146 years",
        ),
        (
            "period_wraps.yaml",
            ":5:46: descriptors[0].rate_limit.unit_multiplier: 213504 × day is 18446745600 \
             seconds, longer than the longest period sluice can count (2^64 nanoseconds, about \
             584 years)",
        ),
        (
            "period_wraps_years.yaml",
            "descriptors[0].rate_limit.unit_multiplier: 585 × year is 18448560000 seconds",
        ),
    ];
    for (file, expected) in cases {
        let (code, stderr) = check_fixtures(&[file]);
        assert_eq!(code, 2, "{file}: {stderr}");
        let line = stderr
            .lines()
            .find(|l| l.contains(file))
            .unwrap_or_else(|| panic!("{file} not named: {stderr}"));
        assert!(
            line.contains(expected),
            "{file}: expected {expected:?} in:\n{stderr}"
        );
    }
}

#[test]
fn an_alias_bomb_is_refused_quickly_at_its_alias() {
    let dir = tempfile::tempdir().unwrap();
    let bomb = dir.path().join("bomb.yaml");
    std::fs::copy(Path::new(FIXTURES).join("alias_bomb.yaml"), &bomb).unwrap();
    let (code, stderr) = check_within(&[dir.path().to_str().unwrap()], Duration::from_secs(20))
        .expect("sluice check on an alias bomb did not finish");
    assert_eq!(code, 2, "{stderr}");
    let expected = format!(
        "{}:11:10: YAML aliases expand to more than 1000000 nodes",
        bomb.display()
    );
    assert!(stderr.contains(&expected), "{expected:?} not in:\n{stderr}");
}

#[test]
fn aliases_of_a_long_scalar_are_refused_quickly() {
    // A 4 MB scalar and a thousand aliases of it: 4 GB of text once expanded.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("text.yaml");
    let text = format!(
        "domain: text\ndescriptors: []\nmetadata:\n  a: &a {}\n  b: [{}]\n",
        "x".repeat(4 << 20),
        vec!["*a"; 1000].join(", ")
    );
    std::fs::write(&file, text).unwrap();
    let (code, stderr) = check_within(&[dir.path().to_str().unwrap()], Duration::from_secs(20))
        .expect("sluice check on aliases of a long scalar did not finish");
    assert_eq!(code, 2, "{stderr}");
    // The fifth alias passes 16 MB.
    let expected = format!(
        "{}:5:{}: YAML aliases expand to more than 16777216 bytes of text",
        file.display(),
        7 + 4 * 4
    );
    assert!(stderr.contains(&expected), "{expected:?} not in:\n{stderr}");
}

#[test]
fn deep_nesting_is_refused_not_a_stack_overflow() {
    let dir = tempfile::tempdir().unwrap();
    let deep = dir.path().join("deep.yaml");
    std::fs::copy(Path::new(FIXTURES).join("deep_nesting.yaml"), &deep).unwrap();
    let (code, stderr) = check_within(&[dir.path().to_str().unwrap()], Duration::from_secs(20))
        .expect("sluice check on deep nesting did not finish");
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains(&format!("{}:6:", deep.display()))
            && stderr.contains("YAML nests more than 128 levels deep"),
        "{stderr}"
    );
}

#[cfg(unix)]
#[test]
fn entries_that_are_not_readable_files_are_named_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("good.yaml"), "domain: good\n").unwrap();
    std::os::unix::fs::symlink("missing.yaml", d.join("dangling.yaml")).unwrap();
    std::fs::create_dir(d.join("dir.yaml")).unwrap();
    let status = Command::new("mkfifo")
        .arg(d.join("fifo.yaml"))
        .status()
        .unwrap();
    assert!(status.success());
    let (code, stderr) = check_within(&[d.to_str().unwrap()], Duration::from_secs(20))
        .expect("sluice check blocked (on the FIFO?)");
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("3 problems in policies"), "{stderr}");
    for (file, says) in [
        (
            "dangling.yaml",
            "cannot read: dangling symlink (to missing.yaml",
        ),
        ("dir.yaml", "not a regular file (a directory)"),
        ("fifo.yaml", "not a regular file (a FIFO)"),
    ] {
        let line = format!("{}: {says}", d.join(file).display());
        assert!(stderr.contains(&line), "{line:?} not in:\n{stderr}");
    }
}

#[test]
fn an_empty_directory_exits_2_unless_allowed() {
    let dir = tempfile::tempdir().unwrap();
    let policies = dir.path().join("policies");
    std::fs::create_dir(&policies).unwrap();
    std::fs::write(policies.join("README.md"), "nothing yet\n").unwrap();
    let out = check(&[policies.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("no policies in {}", policies.display()))
            && stderr.contains("allow_empty_policies: true"),
        "{stderr}"
    );
    let settings = dir.path().join("s.yaml");
    std::fs::write(&settings, "allow_empty_policies: true\n").unwrap();
    let out = check(&[
        "--config",
        settings.to_str().unwrap(),
        policies.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(": 0 files, 0 domains"), "{stdout}");
}

#[test]
fn all_errors_of_a_load_are_reported_together() {
    let files = [
        "bad_unit.yaml",
        "zero_burst.yaml",
        "syntax.yaml",
        "empty_key.yaml",
    ];
    let (code, stderr) = check_fixtures(&files);
    assert_eq!(code, 2);
    assert!(stderr.contains("4 problems in policies"), "{stderr}");
    for f in files {
        assert!(stderr.contains(f), "{f} missing from:\n{stderr}");
    }
}

#[test]
fn duplicate_domains_across_files() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), "domain: edge\n").unwrap();
    std::fs::write(dir.path().join("b.yaml"), "domain: edge\n").unwrap();
    let out = check(&["--policies", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("b.yaml: domain: duplicate domain \"edge\""),
        "{stderr}"
    );
}

#[test]
fn missing_directory_and_bad_settings_exit_2() {
    let out = check(&["/nonexistent/policies"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read policy directory"));
    let dir = tempfile::tempdir().unwrap();
    let settings = dir.path().join("s.yaml");
    std::fs::write(&settings, "polices: x\n").unwrap();
    let out = check(&["--config", settings.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("polices"));
}

#[test]
fn with_policies_from_xds_the_settings_are_checked_and_a_directory_if_given() {
    let dir = tempfile::tempdir().unwrap();
    let settings = dir.path().join("s.yaml");
    let written = |url: &str| {
        std::fs::write(
            &settings,
            format!("policy_source: xds\npolicies: /nonexistent\nxds:\n  url: {url}\n"),
        )
        .unwrap();
    };
    written("envoy-gateway:18001");
    let out = check(&["--config", settings.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("policies come from the xDS server envoy-gateway:18001"),
        "{stderr}"
    );
    // A directory given is checked as ever.
    let out = check(&[
        "--config",
        settings.to_str().unwrap(),
        "/nonexistent/policies",
    ]);
    assert_eq!(out.status.code(), Some(2));
    written("envoy-gateway");
    let out = check(&["--config", settings.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("xds.url"));
}

#[test]
fn shipped_config_is_valid() {
    let out = check(&["--config", "config/sluice.yaml"]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Each limited rule's guarantee, then the one-line summary: each entry of a rate_limits is a
    // rule, and cost nodes are counted apart. docs/src/lab/check.md shows this.
    let summary = stdout.lines().last().unwrap_or_default();
    assert_eq!(
        summary,
        "config/policies: 1 files, 1 domains, 9 rules (7 limited, 1 bans, 1 unlimited), 2 cost nodes: ok",
        "{stdout}"
    );
    assert!(
        stdout.contains("edge.remote_address (per_ip)\n"),
        "{stdout}"
    );
}

/// `sluice check`'s output, which must succeed, for a policy of one rule (`rate_limit: {rule}` on
/// key `k` of domain `d`), once per run: with a settings file of `settings` after its
/// `policies:` line, or with no settings file (`None`), and `args` after.
fn check_rule(rule: &str, runs: &[(Option<&str>, &[&str])]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let policies = dir.path().join("policies");
    std::fs::create_dir(&policies).unwrap();
    std::fs::write(
        policies.join("p.yaml"),
        format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {rule}\n"),
    )
    .unwrap();
    let policies = policies.to_str().unwrap();
    runs.iter()
        .enumerate()
        .map(|(i, (settings, args))| {
            let out = match settings {
                Some(body) => {
                    let path = dir.path().join(format!("s{i}.yaml"));
                    std::fs::write(&path, format!("policies: {policies}\n{body}")).unwrap();
                    let mut all = vec!["--config", path.to_str().unwrap()];
                    all.extend_from_slice(args);
                    check(&all)
                }
                None => {
                    let mut all = vec![policies];
                    all.extend_from_slice(args);
                    check(&all)
                }
            };
            assert_eq!(out.status.code(), Some(0), "{out:?}");
            String::from_utf8(out.stdout).unwrap()
        })
        .collect()
}

/// With leased counting on, each rule shows its bound under the configured L next to the exact
/// one; without it, only the exact one.
#[test]
fn check_shows_the_leased_bound_under_the_configured_l() {
    let leased = "backend: redis\nredis:\n  lease:\n    enabled: true\n    max_age_ms: 250\n";
    let out = check_rule(
        "{unit: second, requests_per_unit: 100, burst: 20}",
        &[(Some(leased), &[]), (None, &[])],
    );
    assert!(
        out[0].contains(
            "  leased, in slices or shares (L = 250ms): at most 145 in any second (exact 120)\n"
        ),
        "{}",
        out[0]
    );
    assert!(!out[1].contains("leased"), "{}", out[1]);
}

/// With the quota service on (the default), each rule shows the bound Envoy's quota filter keeps
/// under the configured TTL, `B + R × (W + TTL)`; with it off, no such line.
#[test]
fn check_shows_the_quota_bound_under_the_configured_ttl() {
    let off = "rlqs:\n  enabled: false\n";
    let out = check_rule(
        "{unit: minute, requests_per_unit: 600, burst: 20}",
        &[
            (Some("rlqs:\n  assignment_ttl_ms: 2500\n"), &[]),
            (None, &[]),
            (Some(off), &["--json"]),
            (Some(off), &[]),
        ],
    );
    // R = 10/s, B = 20: 20 + 10 × 3.5 s = 55; 20 + 10 × 62.5 s = 645.
    assert!(
        out[0].contains(
            "  quota streams (TTL = 2.5s): at most 55 in any second (exact 30), 645 in any minute (exact 620)\n"
        ),
        "{}",
        out[0]
    );
    assert!(
        out[1].contains("quota streams (TTL = 10s): at most 130 in any second"),
        "the default TTL: {}",
        out[1]
    );
    assert!(!out[2].contains("rlqs"), "{}", out[2]);
    assert!(!out[3].contains("quota streams"), "{}", out[3]);
}

/// Each limited rule shows the bound on spend reported after the work, `B + W / T` plus what
/// was in flight, `(W + D) / T` whatever the clients, and the debt cap D; a ban has no such line.
#[test]
fn check_shows_the_bound_on_spend_reported_after_the_work() {
    let out = check_rule(
        "{unit: second, requests_per_unit: 100, burst: 20}",
        &[(None, &[]), (None, &["--json"])],
    );
    // T = 10 ms, B·T = 200 ms, D = 200 ms + 4 s: (1 s + D) / T = 520.
    assert!(
        out[0].contains(
            "  spend reported after the work: at most 120 + F in any second (F: the spend in \
             flight when the budget ran out); whatever the clients, at most 520 in any second\n  \
             debt cap: 4.2s (the bucket and 4 periods): one report, however large, refuses a key \
             for at most 4s\n"
        ),
        "{}",
        out[0]
    );
    let doc: serde_json::Value = serde_json::from_str(&out[1]).unwrap();
    let spend = &doc["rules"][0]["spend"];
    assert_eq!(spend["debt_cap_ns"], 4_200_000_000_u64);
    assert_eq!(spend["locked_ns"], 4_000_000_000_u64);
    assert_eq!(
        (&spend["worst_second"], &spend["cap_worst_second"]),
        (&serde_json::json!(120), &serde_json::json!(520))
    );
    let ban = check_rule("{unit: second, requests_per_unit: 0}", &[(None, &[])]);
    assert!(!ban[0].contains("spend"), "{}", ban[0]);
}

/// A delaying rule shows the smoothed rate the downstream sees, the longest wait, what a burst
/// gets, and the filter timeout it needs; against Envoy's default 20 ms (or a `--filter-timeout`
/// too short) it warns on stderr, and `--strict` then exits 1.
#[test]
fn check_states_a_delaying_rule_and_warns_when_the_filter_timeout_is_too_short() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("p.yaml"),
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 5, delay: 250ms}\n",
    )
    .unwrap();
    let policies = dir.path().to_str().unwrap();
    let out = check(&[policies]);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stdout.contains(
            "  delay: up to 250ms for a slot; the downstream sees one every 100ms (10 per second)"
        ) && stdout.contains("of a burst at once: 7 answered OK within 250ms (5 at once, 2 held"),
        "{stdout}"
    );
    assert!(
        stderr.contains(
            "sluice: warning: d.k: delay 250ms does not fit Envoy's rate-limit filter timeout of \
             20ms (Envoy's default): set the filter's `timeout` above 255ms"
        ),
        "{stderr}"
    );
    let strict = check(&["--strict", policies]);
    assert_eq!(strict.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&strict.stderr)
            .contains("--strict: 1 delaying rule(s) do not fit the filter timeout"),
        "{strict:?}"
    );
    // A timeout above the delay and the margin: no warning, and --strict passes.
    let fits = check(&["--strict", "--filter-timeout", "300ms", policies]);
    let stderr = String::from_utf8_lossy(&fits.stderr);
    assert_eq!(fits.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
    assert!(
        String::from_utf8_lossy(&fits.stdout)
            .contains("checked against 300ms (--filter-timeout): ok"),
        "{fits:?}"
    );
    let json = check(&["--json", "--filter-timeout", "0.2s", policies]);
    let doc: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(
        doc["rules"][0]["delay"]["filter_timeout"]["ns"],
        200_000_000
    );
    assert_eq!(doc["rules"][0]["delay"]["filter_timeout_too_short"], true);
    assert_eq!(doc["timeout_warnings"].as_array().unwrap().len(), 1);
    let bad = check(&["--filter-timeout", "20", policies]);
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    // The hold margin is the server's setting: 50 ms asks for a timeout above 300 ms.
    let elsewhere = tempfile::tempdir().unwrap();
    let settings = elsewhere.path().join("settings.yaml");
    std::fs::write(&settings, "grpc:\n  hold_deadline_margin_ms: 50\n").unwrap();
    let wide = check(&[
        "--config",
        settings.to_str().unwrap(),
        "--filter-timeout",
        "300ms",
        policies,
    ]);
    assert_eq!(wide.status.code(), Some(0), "{wide:?}");
    assert!(
        String::from_utf8_lossy(&wide.stderr)
            .contains("set the filter's `timeout` above 300ms (the delay and sluice's 50ms hold"),
        "{wide:?}"
    );
}
