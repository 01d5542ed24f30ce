//! Operating sluice: hot reload (file rewrite, broken file, removal, ConfigMap symlink swap,
//! SIGHUP), state kept across reloads, Prometheus counters, the admin endpoints, graceful
//! shutdown and the key limit.

use std::path::Path;
use std::time::Duration;

use sluice::pb::rate_limit_response::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::helpers::{TestServer, descriptor, eventually, http, http_get, metric, request, single};

const RELOAD_WITHIN: Duration = Duration::from_secs(2);

fn policy(domain: &str, rules: &[(&str, u32)]) -> String {
    let mut s = format!("domain: {domain}\ndescriptors:\n");
    for (key, rpu) in rules {
        s.push_str(&format!(
            "  - key: {key}\n    rate_limit: {{unit: hour, requests_per_unit: {rpu}}}\n"
        ));
    }
    s
}

/// Writes `text` to `path` atomically (write + rename), as editors and deploy tools do.
fn write(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

async fn rpu(s: &TestServer, domain: &str, key: &str) -> Option<u32> {
    let r = s.ok(single(domain, key, "v")).await;
    r.statuses[0]
        .current_limit
        .as_ref()
        .map(|l| l.requests_per_unit)
}

#[tokio::test]
async fn a_rewritten_file_answers_within_two_seconds() {
    let s = TestServer::start(&[("r.yaml", &policy("reload-rewrite", &[("a", 1)]))]).await;
    assert_eq!(rpu(&s, "reload-rewrite", "a").await, Some(1));
    write(
        &s.dir.path().join("r.yaml"),
        &policy("reload-rewrite", &[("a", 5)]),
    );
    assert!(
        eventually(RELOAD_WITHIN, || async {
            rpu(&s, "reload-rewrite", "a").await == Some(5)
        })
        .await
    );
}

#[tokio::test]
async fn a_broken_file_keeps_the_running_policies_and_counts_the_error() {
    let s = TestServer::start(&[("b.yaml", &policy("reload-broken", &[("a", 3)]))]).await;
    let errors = || async {
        metric(s.admin, "ratelimit_service_config_load_error")
            .await
            .unwrap_or(0.0)
    };
    let before = errors().await;
    write(
        &s.dir.path().join("b.yaml"),
        "domain: reload-broken\ndescriptors: [{key: a, rate_limit: {unit: minutes}}]\n",
    );
    assert!(eventually(RELOAD_WITHIN, || async { errors().await > before }).await);
    assert_eq!(
        rpu(&s, "reload-broken", "a").await,
        Some(3),
        "old policies keep answering"
    );
    let failures = metric(s.admin, "sluice_policy_reloads_total{result=\"failure\"}").await;
    assert!(failures.unwrap_or(0.0) >= 1.0);
    // Fixing the file recovers.
    write(
        &s.dir.path().join("b.yaml"),
        &policy("reload-broken", &[("a", 4)]),
    );
    assert!(
        eventually(RELOAD_WITHIN, || async {
            rpu(&s, "reload-broken", "a").await == Some(4)
        })
        .await
    );
}

#[tokio::test]
async fn a_removed_file_makes_its_domain_unknown() {
    let s = TestServer::start(&[
        ("keep.yaml", &policy("reload-keep", &[("a", 3)])),
        ("gone.yaml", &policy("reload-gone", &[("a", 3)])),
    ])
    .await;
    assert_eq!(rpu(&s, "reload-gone", "a").await, Some(3));
    std::fs::remove_file(s.dir.path().join("gone.yaml")).unwrap();
    assert!(
        eventually(RELOAD_WITHIN, || async {
            rpu(&s, "reload-gone", "a").await.is_none()
        })
        .await
    );
    assert_eq!(rpu(&s, "reload-keep", "a").await, Some(3));
}

/// Long enough for a reload to have happened, had one been accepted (debounce 250 ms).
const NO_RELOAD_FOR: Duration = Duration::from_millis(1500);

#[cfg(unix)]
#[tokio::test]
async fn an_entry_that_cannot_be_read_fails_the_reload_instead_of_vanishing() {
    let s = TestServer::start(&[("u.yaml", &policy("reload-unreadable", &[("a", 3)]))]).await;
    let dir = s.dir.path();
    let failures = || async {
        metric(s.admin, "sluice_policy_reloads_total{result=\"failure\"}")
            .await
            .unwrap_or(0.0)
    };
    let before = failures().await;
    // The file becomes a dangling symlink (atomically) and another file changes, so an accepted
    // reload would show: the new rate of other.yaml, and no more reload-unreadable.
    std::os::unix::fs::symlink("gone.yaml", dir.join("u.tmp")).unwrap();
    std::fs::rename(dir.join("u.tmp"), dir.join("u.yaml")).unwrap();
    write(
        &dir.join("other.yaml"),
        &policy("reload-other", &[("a", 5)]),
    );
    assert!(
        !eventually(NO_RELOAD_FOR, || async {
            rpu(&s, "reload-other", "a").await.is_some()
        })
        .await,
        "a load with a dangling symlink was accepted"
    );
    assert_eq!(rpu(&s, "reload-unreadable", "a").await, Some(3));
    assert!(failures().await > before);
    // A FIFO of that name is refused as well, and never opened (the reloader would hang).
    let status = std::process::Command::new("mkfifo")
        .arg(dir.join("u.fifo"))
        .status()
        .unwrap();
    assert!(status.success());
    std::fs::rename(dir.join("u.fifo"), dir.join("u.yaml")).unwrap();
    assert!(
        !eventually(NO_RELOAD_FOR, || async {
            rpu(&s, "reload-other", "a").await.is_some()
        })
        .await,
        "a load with a FIFO was accepted"
    );
    // Once the entry is a file again, the next load goes through.
    std::fs::remove_file(dir.join("u.yaml")).unwrap();
    write(
        &dir.join("u.yaml"),
        &policy("reload-unreadable", &[("a", 4)]),
    );
    assert!(
        eventually(RELOAD_WITHIN, || async {
            rpu(&s, "reload-unreadable", "a").await == Some(4)
                && rpu(&s, "reload-other", "a").await == Some(5)
        })
        .await
    );
}

#[tokio::test]
async fn a_reload_to_no_policies_at_all_is_refused() {
    let s = TestServer::start(&[("e.yaml", &policy("reload-empty", &[("a", 3)]))]).await;
    std::fs::remove_file(s.dir.path().join("e.yaml")).unwrap();
    assert!(
        !eventually(NO_RELOAD_FOR, || async {
            rpu(&s, "reload-empty", "a").await.is_none()
        })
        .await,
        "an empty policy set was swapped in"
    );
    write(
        &s.dir.path().join("e2.yaml"),
        &policy("reload-empty-2", &[("a", 2)]),
    );
    assert!(
        eventually(RELOAD_WITHIN, || async {
            rpu(&s, "reload-empty-2", "a").await == Some(2)
        })
        .await
    );
    assert_eq!(rpu(&s, "reload-empty", "a").await, None);
}

#[tokio::test]
async fn an_empty_policy_directory_does_not_start_unless_allowed() {
    use sluice::app::{App, AppError};
    use sluice::policy::PolicyError;
    let dir = tempfile::tempdir().unwrap();
    let settings = sluice::settings::Settings {
        grpc_addr: "127.0.0.1:0".parse().unwrap(),
        admin_addr: "127.0.0.1:0".parse().unwrap(),
        policies: dir.path().to_path_buf(),
        ..sluice::settings::Settings::default()
    };
    let err = App::bind(settings.clone()).await.unwrap_err();
    assert!(
        matches!(err, AppError::Policy(PolicyError::Empty { .. })),
        "{err:?}"
    );
    let app = App::bind(sluice::settings::Settings {
        allow_empty_policies: true,
        ..settings
    })
    .await
    .unwrap();
    assert_eq!(app.policies().load().summary().domains, 0);
}

#[cfg(unix)]
#[tokio::test]
async fn a_configmap_symlink_swap_reloads() {
    use std::os::unix::fs::symlink;
    // The kubelet's layout: files are symlinks through `..data`, itself a symlink to a
    // timestamped directory that is replaced atomically on update.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let v1 = root.join("..2026_11_29_00_00_00.1");
    std::fs::create_dir(&v1).unwrap();
    std::fs::write(
        v1.join("edge.yaml"),
        policy("reload-configmap", &[("a", 1)]),
    )
    .unwrap();
    symlink("..2026_11_29_00_00_00.1", root.join("..data")).unwrap();
    symlink("..data/edge.yaml", root.join("edge.yaml")).unwrap();
    let s = TestServer::start_in(dir, |_| {}).await;
    assert_eq!(rpu(&s, "reload-configmap", "a").await, Some(1));

    let root = s.dir.path();
    let v2 = root.join("..2026_11_29_00_01_00.2");
    std::fs::create_dir(&v2).unwrap();
    std::fs::write(
        v2.join("edge.yaml"),
        policy("reload-configmap", &[("a", 7)]),
    )
    .unwrap();
    symlink("..2026_11_29_00_01_00.2", root.join("..data_tmp")).unwrap();
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
    std::fs::remove_dir_all(&v1).unwrap();
    assert!(
        eventually(RELOAD_WITHIN, || async {
            rpu(&s, "reload-configmap", "a").await == Some(7)
        })
        .await
    );
}

/// A replaced directory is found by the watch on its parent, else by the re-scan (2 s).
const REPLACED_WITHIN: Duration = Duration::from_secs(6);

/// `dir` with `suffix` added to its name: a sibling on the same filesystem.
fn sibling(dir: &Path, suffix: &str) -> std::path::PathBuf {
    let mut name = dir.file_name().unwrap().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}

#[tokio::test]
async fn a_directory_replaced_by_rename_keeps_being_watched() {
    let s = TestServer::start(&[("r.yaml", &policy("replace-rename", &[("a", 1)]))]).await;
    let dir = s.dir.path();
    for round in 2..=3 {
        // A new directory renamed over the old one (which is first moved aside: rename(2)
        // replaces only an empty directory).
        let new = sibling(dir, ".new");
        let old = sibling(dir, ".old");
        std::fs::create_dir(&new).unwrap();
        std::fs::write(
            new.join("r.yaml"),
            policy("replace-rename", &[("a", round)]),
        )
        .unwrap();
        std::fs::rename(dir, &old).unwrap();
        std::fs::rename(&new, dir).unwrap();
        std::fs::remove_dir_all(&old).unwrap();
        assert!(
            eventually(REPLACED_WITHIN, || async {
                rpu(&s, "replace-rename", "a").await == Some(round)
            })
            .await,
            "round {round}: replaced directory not loaded"
        );
        // Edits inside the new directory reload too.
        write(
            &dir.join("r.yaml"),
            &policy("replace-rename", &[("a", round * 10)]),
        );
        assert!(
            eventually(REPLACED_WITHIN, || async {
                rpu(&s, "replace-rename", "a").await == Some(round * 10)
            })
            .await,
            "round {round}: edit in the replaced directory not loaded"
        );
    }
}

#[tokio::test]
async fn a_directory_removed_and_recreated_keeps_being_watched() {
    let s = TestServer::start(&[("r.yaml", &policy("replace-rmrf", &[("a", 1)]))]).await;
    let dir = s.dir.path();
    std::fs::remove_dir_all(dir).unwrap();
    // While it is gone, loads fail and the running policies answer.
    assert!(
        !eventually(NO_RELOAD_FOR, || async {
            rpu(&s, "replace-rmrf", "a").await != Some(1)
        })
        .await
    );
    std::fs::create_dir(dir).unwrap();
    write(&dir.join("r.yaml"), &policy("replace-rmrf", &[("a", 2)]));
    assert!(
        eventually(REPLACED_WITHIN, || async {
            rpu(&s, "replace-rmrf", "a").await == Some(2)
        })
        .await,
        "recreated directory not loaded"
    );
    write(&dir.join("r.yaml"), &policy("replace-rmrf", &[("a", 3)]));
    assert!(
        eventually(REPLACED_WITHIN, || async {
            rpu(&s, "replace-rmrf", "a").await == Some(3)
        })
        .await,
        "edit in the recreated directory not loaded"
    );
}

#[cfg(unix)]
#[tokio::test]
async fn a_change_no_watch_event_reports_is_found_by_the_rescan() {
    // The policy file is a symlink to a file elsewhere, rewritten there: nothing happens in
    // the policy directory, but a load would read something new.
    let elsewhere = tempfile::tempdir().unwrap();
    let target = elsewhere.path().join("t.yaml");
    std::fs::write(&target, policy("rescan", &[("a", 1)])).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&target, dir.path().join("s.yaml")).unwrap();
    let s = TestServer::start_in(dir, |_| {}).await;
    assert_eq!(rpu(&s, "rescan", "a").await, Some(1));
    write(&target, &policy("rescan", &[("a", 2)]));
    assert!(
        eventually(REPLACED_WITHIN, || async {
            rpu(&s, "rescan", "a").await == Some(2)
        })
        .await
    );
}

/// SIGHUP reloads: sent to a real `sluice serve` process (so the signal reaches only it), with
/// watching off so that nothing else could have reloaded. A server watching the same directory
/// shows when a watcher would have reloaded; by then this one has not, and in the end it has
/// reloaded once, for the signal.
#[cfg(unix)]
#[tokio::test]
async fn sighup_reloads() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    let policies = dir.path().join("policies");
    std::fs::create_dir(&policies).unwrap();
    write(
        &policies.join("h.yaml"),
        &policy("reload-sighup", &[("a", 1)]),
    );
    let config = dir.path().join("sluice.yaml");
    write(
        &config,
        &format!(
            "grpc_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\nwatch_policies: false\npolicies: {}\n",
            policies.display()
        ),
    );
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["serve", "--config"])
        .arg(&config)
        .args(["--log-format", "json"])
        .env_remove("RUST_LOG")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The admin address from the "serving" line of the log.
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let admin: std::net::SocketAddr = loop {
        let line = lines.next().expect("sluice exited before serving").unwrap();
        let event: serde_json::Value = serde_json::from_str(&line).unwrap();
        if event["message"] == "serving" {
            break event["admin"].as_str().unwrap().parse().unwrap();
        }
    };
    let rlconfig = || async move { crate::helpers::http_get(admin, "/rlconfig").await.1 };
    assert!(
        rlconfig().await.contains("requests_per_unit=1 "),
        "{}",
        rlconfig().await
    );
    let watching = TestServer::start_with(&[], |s| s.policies.clone_from(&policies)).await;
    assert_eq!(rpu(&watching, "reload-sighup", "a").await, Some(1));
    write(
        &policies.join("h.yaml"),
        &policy("reload-sighup", &[("a", 6)]),
    );
    assert!(
        eventually(RELOAD_WITHIN, || async {
            rpu(&watching, "reload-sighup", "a").await == Some(6)
        })
        .await,
        "the watching server reloads the change"
    );
    assert!(
        rlconfig().await.contains("requests_per_unit=1 "),
        "not watching: no reload yet"
    );
    let status = Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let reloaded = eventually(RELOAD_WITHIN, || async {
        rlconfig().await.contains("requests_per_unit=6 ")
    })
    .await;
    let reloads = metric(admin, "sluice_policy_reloads_total{result=\"success\"}").await;
    let _ = child.kill();
    let _ = child.wait();
    assert!(reloaded, "SIGHUP reloaded the policies");
    assert_eq!(reloads, Some(1.0), "one reload, the signal's");
}

#[tokio::test]
async fn unchanged_rules_keep_their_counts_and_changed_rates_get_no_fresh_burst() {
    let s = TestServer::start(&[("k.yaml", &policy("reload-state", &[("a", 2), ("b", 10)]))]).await;
    for _ in 0..2 {
        s.ok(single("reload-state", "a", "v")).await;
    }
    for _ in 0..10 {
        s.ok(single("reload-state", "b", "v")).await;
    }
    assert_eq!(
        s.ok(single("reload-state", "a", "v")).await.overall_code,
        Code::OverLimit as i32
    );
    // a is unchanged; b drops from 10 to 2 per hour.
    write(
        &s.dir.path().join("k.yaml"),
        &policy("reload-state", &[("a", 2), ("b", 2)]),
    );
    assert!(
        eventually(RELOAD_WITHIN, || async {
            rpu(&s, "reload-state", "b").await == Some(2)
        })
        .await
    );
    let a = s.ok(single("reload-state", "a", "v")).await;
    assert_eq!(a.overall_code, Code::OverLimit as i32, "a kept its count");
    let b = s.ok(single("reload-state", "b", "v")).await;
    assert_eq!(
        b.overall_code,
        Code::OverLimit as i32,
        "b got no fresh burst"
    );
    // Its debt was capped to the new bucket: the next request fits one new interval later.
    assert_eq!(
        b.statuses[0].duration_until_reset.as_ref().unwrap().seconds,
        1800
    );
}

/// `metrics.near_limit_ratio` moves the near-limit threshold: at 0.5 of a bucket of 20, hits
/// 11 to 20 are near the limit.
#[tokio::test]
async fn the_near_limit_ratio_is_configurable() {
    let s = TestServer::start_with(
        &[(
            "m.yaml",
            "domain: metrics-near\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 20}\n",
        )],
        |settings| settings.metrics.near_limit_ratio = 0.5,
    )
    .await;
    for _ in 0..25 {
        s.ok(single("metrics-near", "k", "v")).await;
    }
    let series =
        "ratelimit_service_rate_limit_near_limit{domain=\"metrics-near\",key1=\"k\",key2=\"\"}";
    assert_eq!(metric(s.admin, series).await, Some(10.0), "{series}");
}

#[tokio::test]
async fn each_of_several_limits_and_a_cost_node_count_their_own_series() {
    let s = TestServer::start(&[(
        "m.yaml",
        "domain: metrics-layered\ndescriptors:\n  - key: user\n    rate_limits:\n      - {name: short, unit: minute, requests_per_unit: 3}\n      - {name: long, unit: day, requests_per_unit: 100}\n    descriptors:\n      - key: route\n        value: search\n        cost: 2\n",
    )])
    .await;
    s.ok(single("metrics-layered", "user", "u")).await;
    s.ok(single("metrics-layered", "user", "u")).await;
    // One left on `short`, and a search draws 2 from both: refused by `short`.
    let r = s
        .ok(request(
            "metrics-layered",
            vec![descriptor(&[("user", "u"), ("route", "search")])],
        ))
        .await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    // Each entry has its own series (its name on its last label); a cost node's hits are the
    // tokens it drew, on its ancestor's rules. `long` had room, so its 2 are within its limit.
    for (entry, name, value) in [
        ("short", "total_hits", 4.0),
        ("short", "within_limit", 2.0),
        ("short", "over_limit", 2.0),
        ("long", "total_hits", 4.0),
        ("long", "within_limit", 4.0),
        ("long", "over_limit", 0.0),
    ] {
        let series = format!(
            "ratelimit_service_rate_limit_{name}{{domain=\"metrics-layered\",key1=\"user[{entry}]\",key2=\"\"}}"
        );
        assert_eq!(metric(s.admin, &series).await, Some(value), "{series}");
    }
}

#[tokio::test]
async fn counters_after_known_traffic() {
    let s = TestServer::start(&[(
        "m.yaml",
        "domain: metrics-exact\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 20}\n",
    )])
    .await;
    for _ in 0..25 {
        s.ok(single("metrics-exact", "k", "v")).await;
    }
    let labels = "{domain=\"metrics-exact\",key1=\"k\",key2=\"\"}";
    for (name, value) in [
        ("total_hits", 25.0),
        ("over_limit", 5.0),
        ("within_limit", 20.0),
        ("near_limit", 4.0),
        ("shadow_mode", 0.0),
    ] {
        let series = format!("ratelimit_service_rate_limit_{name}{labels}");
        assert_eq!(metric(s.admin, &series).await, Some(value), "{series}");
    }
    s.ok(single("metrics-unknown-domain", "k", "v")).await;
    assert_eq!(
        metric(
            s.admin,
            "ratelimit_service_rate_limit_domain_not_found{domain=\"metrics-unknown-domain\"}"
        )
        .await,
        Some(1.0)
    );
    let (_, body) = http_get(s.admin, "/metrics").await;
    for name in [
        "sluice_decisions_total{result=\"ok\"}",
        "sluice_decisions_total{result=\"over_limit\"}",
        "sluice_decision_duration_seconds_bucket{le=\"0.000001\"}",
        "sluice_decision_duration_seconds_bucket{le=\"0.1\"}",
        "sluice_store_keys",
        "sluice_store_evictions_total",
        "sluice_build_info{version=",
        "ratelimit_service_config_load_success",
    ] {
        assert!(body.contains(name), "{name} missing from /metrics");
    }
    // Every decision is one latency observation, in this server's own histogram (the
    // recorder's counters are process-wide and shared with the other tests' servers).
    let decided = Some(26.0);
    assert_eq!(
        metric(s.admin, "sluice_decision_duration_seconds_count").await,
        decided
    );
    assert_eq!(
        metric(
            s.admin,
            "sluice_decision_duration_seconds_bucket{le=\"+Inf\"}"
        )
        .await,
        decided
    );
}

/// envoyproxy/ratelimit's two listeners beside its HTTP port: the Prometheus text alone at its
/// path, and `/rlconfig` alone; the admin port keeps serving both.
#[tokio::test]
async fn the_metrics_and_debug_listeners_serve_their_one_thing() {
    let policy = [(
        "l.yaml",
        "domain: listeners\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    )];
    let s = TestServer::start_with(&policy, |settings| {
        settings.metrics.addr = Some("127.0.0.1:0".parse().unwrap());
        settings.metrics.path = "/prom".into();
        settings.admin.debug_addr = Some("127.0.0.1:0".parse().unwrap());
    })
    .await;
    let (metrics, debug) = (s.metrics.unwrap(), s.debug.unwrap());
    s.ok(single("listeners", "k", "v")).await;
    let (status, text) = http_get(metrics, "/prom").await;
    assert_eq!(status, 200);
    assert!(
        text.contains(
            "ratelimit_service_rate_limit_within_limit{domain=\"listeners\",key1=\"k\",key2=\"\"} 1"
        ),
        "{text}"
    );
    assert!(text.contains("ratelimit_service_total_requests{grpc_method=\"ShouldRateLimit\"}"));
    for (addr, path) in [
        (metrics, "/metrics"),
        (metrics, "/rlconfig"),
        (debug, "/metrics"),
        (debug, "/healthcheck"),
    ] {
        assert_eq!(http_get(addr, path).await.0, 404, "{addr}{path}");
    }
    let (status, listed) = http_get(debug, "/rlconfig").await;
    assert_eq!(status, 200);
    assert_eq!(listed, http_get(s.admin, "/rlconfig").await.1);
    assert!(listed.starts_with("listeners.k: unit=MINUTE"), "{listed}");
    assert_eq!(http_get(s.admin, "/metrics").await.0, 200);
    // Off by default.
    let plain = TestServer::start(&policy).await;
    assert_eq!((plain.metrics, plain.debug), (None, None));
}

#[tokio::test]
async fn request_valued_series_are_capped() {
    let s = TestServer::start_with(
        &[(
            "d.yaml",
            "domain: metrics-detailed\ndescriptors:\n  - key: ip\n    detailed_metric: true\n    rate_limit: {unit: minute, requests_per_unit: 20}\n",
        )],
        |settings| settings.metrics.max_detailed_series = 2,
    )
    .await;
    for ip in ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.1"] {
        s.ok(single("metrics-detailed", "ip", ip)).await;
    }
    let series = |key1: &str| {
        format!(
            "ratelimit_service_rate_limit_total_hits{{domain=\"metrics-detailed\",key1=\"{key1}\",key2=\"\"}}"
        )
    };
    assert_eq!(metric(s.admin, &series("ip_10_0_0_1")).await, Some(2.0));
    assert_eq!(metric(s.admin, &series("ip_10_0_0_2")).await, Some(1.0));
    assert_eq!(
        metric(s.admin, &series("ip_10_0_0_3")).await,
        None,
        "past the cap"
    );
    assert_eq!(metric(s.admin, &series("_other")).await, Some(2.0));
}

#[tokio::test]
async fn json_endpoint() {
    let s = TestServer::start(&[(
        "j.yaml",
        "domain: json\ndescriptors:\n  - key: k\n    rate_limit: {name: one, unit: minute, requests_per_unit: 1}\n",
    )])
    .await;
    let body = r#"{"domain":"json","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#;
    let (status, text) = http(s.admin, "POST", "/json", body).await;
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"overallCode": "OK", "statuses": [{"code": "OK",
            "currentLimit": {"name": "one", "requestsPerUnit": 1, "unit": "MINUTE"},
            "durationUntilReset": "60s"}]})
    );
    let (status, text) = http(s.admin, "POST", "/json", body).await;
    assert_eq!(status, 429, "{text}");
    assert!(text.contains("\"overallCode\":\"OVER_LIMIT\""), "{text}");
    for (bad, reason) in [
        ("{not json", "invalid request body"),
        (
            r#"{"domain":"json","descriptors":[{"entries":[{"key":"k"}]}],"extra":1}"#,
            "unknown field",
        ),
        (
            r#"{"domain":"","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#,
            "domain must not be empty",
        ),
        (
            r#"{"domain":"json","descriptors":[]}"#,
            "descriptor list must not be empty",
        ),
    ] {
        let (status, text) = http(s.admin, "POST", "/json", bad).await;
        assert_eq!(status, 400, "{bad}: {text}");
        assert!(text.contains(reason), "{reason:?} not in {text:?}");
    }
}

#[tokio::test]
async fn rlconfig_lists_limits_sorted() {
    let s = TestServer::start(&[(
        "c.yaml",
        "domain: cfg\ndescriptors:\n  - key: z\n    rate_limit: {unlimited: true}\n  - key: a\n    value: x\n    shadow_mode: true\n    rate_limit: {name: ax, unit: second, requests_per_unit: 5, burst: 9}\n",
    )])
    .await;
    let (status, body) = http_get(s.admin, "/rlconfig").await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        "cfg.a_x: unit=SECOND unit_multiplier=1 requests_per_unit=5 burst=9 name=ax, shadow_mode: true, quota_mode: false\n\
         cfg.z: unlimited, shadow_mode: false, quota_mode: false\n"
    );
}

#[tokio::test]
async fn shutdown_turns_health_off_first_and_lets_in_flight_calls_finish() {
    let mut s = TestServer::start_with(
        &[("s.yaml", &policy("shutdown", &[("a", 100)]))],
        |settings| {
            settings.drain_delay_ms = 1_000;
        },
    )
    .await;
    // A call in flight: its headers are sent, its body not yet.
    let tcp = tokio::net::TcpStream::connect(s.grpc).await.unwrap();
    let (h2, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut h2 = h2.ready().await.unwrap();
    let req = http::Request::post(format!(
        "http://{}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        s.grpc
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    let (response, mut body) = h2.send_request(req, false).unwrap();

    let mut health = s.health().await;
    let check = HealthCheckRequest {
        service: "ratelimit".into(),
    };
    assert_eq!(
        health
            .check(check.clone())
            .await
            .unwrap()
            .into_inner()
            .status,
        ServingStatus::Serving as i32
    );

    s.begin_stop();
    // Health flips while calls are still answered.
    let admin = s.admin;
    assert!(
        eventually(Duration::from_millis(800), || async {
            http_get(admin, "/healthcheck").await.0 == 500
        })
        .await
    );
    assert_eq!(
        health.check(check).await.unwrap().into_inner().status,
        ServingStatus::NotServing as i32
    );
    assert_eq!(
        s.ok(single("shutdown", "a", "v")).await.overall_code,
        Code::Ok as i32
    );

    // Finish the in-flight call after the stop began: it is answered.
    let msg = prost::Message::encode_to_vec(&single("shutdown", "a", "v"));
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(&msg);
    body.send_data(frame.into(), true).unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    let mut recv = response.into_body();
    let mut data = Vec::new();
    while let Some(chunk) = recv.data().await {
        data.extend_from_slice(&chunk.unwrap());
    }
    let trailers = recv.trailers().await.unwrap().unwrap();
    assert_eq!(trailers.get("grpc-status").unwrap(), "0");
    let answer: sluice::pb::RateLimitResponse = prost::Message::decode(&data[5..]).unwrap();
    assert_eq!(answer.overall_code, Code::Ok as i32);
    assert_eq!(answer.statuses[0].limit_remaining, 98);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn the_store_never_exceeds_max_keys() {
    let s = TestServer::start_with(
        &[("m.yaml", &policy("max-keys", &[("ip", 1)]))],
        |settings| {
            settings.store.max_keys = 100;
        },
    )
    .await;
    for i in 0..300 {
        s.ok(single(
            "max-keys",
            "ip",
            &format!("10.0.{}.{}", i / 256, i % 256),
        ))
        .await;
        assert!(s.store.len() <= 100);
    }
    assert_eq!(s.store.len(), 100);
    assert_eq!(metric(s.admin, "sluice_store_keys").await, Some(100.0));
    assert_eq!(
        metric(s.admin, "sluice_store_evictions_total").await,
        Some(200.0)
    );
    // The most recent key survived and still decides correctly.
    assert_eq!(
        s.ok(single("max-keys", "ip", "10.0.1.43"))
            .await
            .overall_code,
        Code::OverLimit as i32
    );
}

/// Why the probes use gRPC health: slow clients holding every admin connection make
/// `/healthcheck` unreachable (a liveness probe there would restart a healthy pod), while the
/// gRPC health service, on the port and under the cap Envoy's own calls use, still answers.
#[tokio::test]
async fn grpc_health_answers_while_slow_clients_hold_the_admin_port() {
    let s = TestServer::start_with(&[("h.yaml", &policy("health-starved", &[("a", 1)]))], |s| {
        s.admin.max_connections = 2;
        s.admin.header_read_timeout_ms = 60_000;
    })
    .await;
    // The probe as a kubelet sends it: refused (reset or closed) while the cap is held.
    let probe = |admin| async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut answer = Vec::new();
        if let Ok(mut c) = tokio::net::TcpStream::connect(admin).await {
            let _ = c
                .write_all(
                    b"GET /healthcheck HTTP/1.1\r\nhost: sluice\r\nconnection: close\r\n\r\n",
                )
                .await;
            let read = c.read_to_end(&mut answer);
            let _ = tokio::time::timeout(Duration::from_millis(500), read).await;
        }
        answer.starts_with(b"HTTP/1.1 200")
    };
    assert!(probe(s.admin).await, "answered while the cap is free");
    // Two clients that connect and never send a request head hold the admin port's cap.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(tokio::net::TcpStream::connect(s.admin).await.unwrap());
    }
    let admin = s.admin;
    let starved = eventually(
        Duration::from_secs(5),
        || async move { !probe(admin).await },
    )
    .await;
    assert!(starved, "the admin port's cap is held");
    let mut health = s.health().await;
    let status = health
        .check(HealthCheckRequest {
            service: "ratelimit".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    assert_eq!(status, ServingStatus::Serving as i32);
    drop(held);
}
