//! `compat: envoy-ratelimit`: the binary started with envoyproxy/ratelimit's variables and
//! runtime layout (extensionless files, a dot file, the root a symlink, swapped) decides exactly
//! as one started with the equivalent sluice settings, both counting in memory.
//! `tests/interop/test_compat.py` runs the same in Redis through Envoy's generated client.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sluice::pb::rate_limit_service_client::RateLimitServiceClient;
use sluice::pb::{RateLimitRequest, RateLimitResponse};

use crate::helpers::{descriptor, eventually, http_get, request, single};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/envoy-ratelimit"
);

/// A re-scan every 2 s, a debounce, and a slow 2-core machine.
const SWAP_WITHIN: Duration = Duration::from_secs(10);

/// A sluice process, killed when dropped.
pub(crate) struct Process {
    child: Child,
    pub(crate) grpc: SocketAddr,
    pub(crate) admin: SocketAddr,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The reference's environment for a server on free loopback ports, in JSON logs, counting in
/// memory, its policies in `current`'s `ratelimit` directory.
pub(crate) fn reference_env(current: &Path) -> Vec<(&'static str, &str)> {
    vec![
        ("SLUICE_COMPAT", "envoy-ratelimit"),
        ("HOST", "127.0.0.1"),
        ("PORT", "0"),
        ("GRPC_HOST", "127.0.0.1"),
        ("GRPC_PORT", "0"),
        ("DEBUG_HOST", "127.0.0.1"),
        ("DEBUG_PORT", "0"),
        ("LOG_FORMAT", "json"),
        ("RUNTIME_ROOT", current.to_str().expect("a UTF-8 path")),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("USE_STATSD", "false"),
        ("SLUICE_BACKEND", "memory"),
    ]
}

/// Starts `sluice serve` with exactly `vars` as its environment; the addresses come from its
/// "serving" log line (JSON, as `LOG_FORMAT=json` or `SLUICE_LOG_FORMAT=json` asks).
pub(crate) fn spawn(vars: &[(&str, &str)]) -> Process {
    spawn_as(Path::new(env!("CARGO_BIN_EXE_sluice")), &["serve"], vars).0
}

/// Starts `program` with `args` and exactly `vars` as its environment, as [`spawn`]; also the
/// log lines before "serving".
pub(crate) fn spawn_as(
    program: &Path,
    args: &[&str],
    vars: &[(&str, &str)],
) -> (Process, Vec<String>) {
    let mut child = Command::new(program)
        .args(args)
        .env_clear()
        .envs(vars.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sluice");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let mut seen = Vec::new();
    let (grpc, admin) = loop {
        let Some(Ok(line)) = lines.next() else {
            let _ = child.kill();
            panic!("sluice exited before serving: {seen:#?}");
        };
        let event: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        if event["message"] == "serving" {
            let addr = |k: &str| event[k].as_str().unwrap().parse::<SocketAddr>().unwrap();
            break (addr("grpc"), addr("admin"));
        }
        seen.push(line);
    };
    // Keep draining the log so the process never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    (Process { child, grpc, admin }, seen)
}

/// The reference's runtime layout in `root`: `v1` and `v2` from the fixture, `current` a
/// symlink to `v1`.
fn runtime(root: &Path) {
    for version in ["v1", "v2"] {
        let config = root.join(version).join("ratelimit").join("config");
        std::fs::create_dir_all(&config).unwrap();
        let from = Path::new(FIXTURE)
            .join(version)
            .join("ratelimit")
            .join("config");
        for entry in std::fs::read_dir(from).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), config.join(entry.file_name())).unwrap();
        }
    }
    std::os::unix::fs::symlink("v1", root.join("current")).unwrap();
}

/// Swaps `current` to `v2` atomically, as the reference's deployments do (`ln -s` then
/// `rename`).
fn swap(root: &Path) {
    std::os::unix::fs::symlink("v2", root.join("next")).unwrap();
    std::fs::rename(root.join("next"), root.join("current")).unwrap();
}

/// The requests both servers answer: nested, key-only, exact, whitelisted, unlimited, named,
/// unknown domain, too deep, and a limit run past its end.
fn requests() -> Vec<RateLimitRequest> {
    let mut all = vec![
        request(
            "test-domain",
            vec![descriptor(&[("key1", "value1"), ("subkey1", "x")])],
        ),
        request(
            "test-domain",
            vec![descriptor(&[("key1", "value1"), ("subkey1", "subvalue1")])],
        ),
        single("test-domain", "key2", "any"),
        single("test-domain", "key2", "value2"),
        single("test-domain", "key2", "value3"),
        single("test-domain", "key6", "x"),
        single("nowhere", "key1", "value1"),
        request(
            "test-domain",
            vec![descriptor(&[("key2", "value2"), ("deeper", "x")])],
        ),
        request(
            "test-domain",
            vec![descriptor(&[("key4", "a")]), descriptor(&[("key3", "b")])],
        ),
    ];
    for _ in 0..2 {
        all.push(single("test-domain", "key3", "b"));
        all.push(single("test-domain", "key4", "a"));
    }
    all.push(single("mongo_cps", "database", "users"));
    all
}

/// `Retry-After` is spread by a random jitter on every denial; everything else must match.
fn without_retry_after(mut r: RateLimitResponse) -> RateLimitResponse {
    r.response_headers_to_add.retain(|h| h.key != "Retry-After");
    r
}

async fn client(grpc: SocketAddr) -> RateLimitServiceClient<tonic::transport::Channel> {
    RateLimitServiceClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect")
}

#[tokio::test]
async fn the_reference_environment_decides_as_sluice_settings_do_and_follows_a_root_swap() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("runtime");
    runtime(&root);
    let current = root.join("current");
    let mut vars = reference_env(&current);
    vars.extend([
        ("LOG_LEVEL", "info"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("RUNTIME_WATCH_ROOT", "true"),
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", "127.0.0.1:0"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
        ("LIMIT_REMAINING_HEADER", "X-RateLimit-Left"),
        ("NEAR_LIMIT_RATIO", "0.5"),
        ("SHADOW_MODE", "false"),
    ]);
    let reference = spawn(&vars);
    let policies = current.join("ratelimit").join("config");
    let native = spawn(&[
        ("SLUICE_GRPC_ADDR", "127.0.0.1:0"),
        ("SLUICE_ADMIN_ADDR", "127.0.0.1:0"),
        ("SLUICE_LOG_FORMAT", "json"),
        ("SLUICE_POLICIES", policies.to_str().unwrap()),
        ("SLUICE_POLICY_FILES", "visible"),
        ("SLUICE_RESPONSE_HEADERS", "legacy"),
        ("SLUICE_LEGACY_HEADERS__REMAINING", "X-RateLimit-Left"),
        ("SLUICE_METRICS__NEAR_LIMIT_RATIO", "0.5"),
    ]);
    let (mut a, mut b) = (client(reference.grpc).await, client(native.grpc).await);
    let mut limited = 0;
    for req in requests() {
        let ra = without_retry_after(a.should_rate_limit(req.clone()).await.unwrap().into_inner());
        let rb = without_retry_after(b.should_rate_limit(req.clone()).await.unwrap().into_inner());
        assert_eq!(ra, rb, "{req:?}");
        if let Some(h) = ra.response_headers_to_add.get(1) {
            assert_eq!(h.key, "X-RateLimit-Left");
        }
        limited += ra
            .statuses
            .iter()
            .filter(|s| s.current_limit.is_some())
            .count();
    }
    assert!(
        limited >= 10,
        "the fixture's limits were applied: {limited}"
    );
    let users = || {
        let mut a = a.clone();
        async move {
            a.should_rate_limit(single("mongo_cps", "database", "users"))
                .await
                .unwrap()
                .into_inner()
                .statuses[0]
                .current_limit
                .clone()
                .unwrap()
                .requests_per_unit
        }
    };
    assert_eq!(users().await, 500);
    // Both files without a .yaml extension were read (the dot file, not YAML, was skipped,
    // or nothing would have started).
    let (_, rlconfig) = http_get(reference.admin, "/rlconfig").await;
    assert!(
        rlconfig.contains("mongo_cps") && rlconfig.contains("test-domain"),
        "{rlconfig}"
    );
    // The root swapped to v2 underneath the running server.
    swap(&root);
    assert!(
        eventually(SWAP_WITHIN, || async { users().await == 2 }).await,
        "the swap of RUNTIME_ROOT was followed"
    );
}

/// Envoy Gateway's Deployment runs `/bin/ratelimit` with the reference's variables and no
/// `SLUICE_COMPAT`; AI Gateway adds an argument the reference ignores. Invoked under that name the
/// binary reads the reference's environment, logs the argument as ignored, and serves.
#[tokio::test]
async fn invoked_as_ratelimit_it_serves_the_references_environment_and_ignores_arguments() {
    let dir = tempfile::tempdir().unwrap();
    runtime(dir.path());
    let ratelimit = dir.path().join("ratelimit");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_sluice"), &ratelimit).unwrap();
    let current = dir.path().join("current");
    let mut vars: Vec<_> = reference_env(&current)
        .into_iter()
        .filter(|(k, _)| *k != "SLUICE_COMPAT")
        .collect();
    vars.push(("RUNTIME_IGNOREDOTFILES", "true"));
    let junk = "--quotaRateLimitServiceAddr=x";
    let (server, log) = spawn_as(&ratelimit, &[junk], &vars);
    assert!(
        log.iter()
            .any(|l| l.contains("arguments are ignored") && l.contains(junk)),
        "{log:#?}"
    );
    let (status, body) = http_get(server.admin, "/healthcheck").await;
    assert_eq!((status, body.as_str()), (200, "OK"));
    // The reference's runtime layout was read: its policies decide.
    let answer = client(server.grpc)
        .await
        .should_rate_limit(single("mongo_cps", "database", "users"))
        .await
        .unwrap()
        .into_inner();
    let limit = answer.statuses[0]
        .current_limit
        .as_ref()
        .map(|l| l.requests_per_unit);
    assert_eq!(limit, Some(500), "{answer:?}");
    // The same binary under its own name still wants its command line.
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg(junk)
        .env_clear()
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

#[test]
fn a_reference_variable_that_cannot_be_read_stops_the_start_naming_it() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("serve")
        .env_clear()
        .envs([
            ("SLUICE_COMPAT", "envoy-ratelimit"),
            ("GRPC_PORT", "eighty"),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("GRPC_PORT") && stderr.contains("eighty"),
        "{stderr}"
    );
    // Without compat the same variable is nobody's business.
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "check",
            concat!(env!("CARGO_MANIFEST_DIR"), "/config/policies"),
        ])
        .env_clear()
        .envs([("GRPC_PORT", "eighty")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
}

/// One domain in two files of the reference's layout (no `.yaml` extension), with metadata.
fn split_domain(root: &Path) -> std::path::PathBuf {
    let config = root.join("current").join("ratelimit").join("config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(
        config.join("services"),
        "domain: rl\ndescriptors:\n  - key: service\n    value: service_1\n    rate_limit: {unit: minute, requests_per_unit: 1}\n    metadata: {service_with_quota: {name: \"service_1\"}}\n",
    )
    .unwrap();
    std::fs::write(
        config.join("users"),
        "domain: rl\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 3}\n    metadata: {service_with_quota: {name: \"users\"}, plan: free}\n",
    )
    .unwrap();
    root.join("current")
}

#[tokio::test]
async fn merge_domain_config_and_response_dynamic_metadata_from_the_reference_environment() {
    let dir = tempfile::tempdir().unwrap();
    let current = split_domain(dir.path());
    let mut vars = reference_env(&current);
    // Without MERGE_DOMAIN_CONFIG the second file is refused, by `sluice check` and `serve`.
    for command in ["check", "serve"] {
        let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg(command)
            .env_clear()
            .envs(vars.iter().copied())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{command}: {stderr}");
        assert!(
            stderr.contains("users: domain: duplicate domain \"rl\"")
                && stderr.contains("services"),
            "{command}: {stderr}"
        );
    }
    vars.push(("MERGE_DOMAIN_CONFIG", "true"));
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("check")
        .env_clear()
        .envs(vars.iter().copied())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    vars.push(("RESPONSE_DYNAMIC_METADATA", "true"));
    let server = spawn(&vars);
    let mut c = client(server.grpc).await;
    let both = request(
        "rl",
        vec![
            descriptor(&[("service", "service_1")]),
            descriptor(&[("user", "u")]),
        ],
    );
    let first = c
        .should_rate_limit(both.clone())
        .await
        .unwrap()
        .into_inner();
    let limits: Vec<u32> = first
        .statuses
        .iter()
        .map(|s| s.current_limit.as_ref().map_or(0, |l| l.requests_per_unit))
        .collect();
    assert_eq!(limits, [1, 3], "both files' rules apply");
    let name = |r: &RateLimitResponse| {
        use prost_types::value::Kind;
        let meta = &r
            .dynamic_metadata
            .as_ref()
            .expect("dynamic_metadata")
            .fields["metadata"];
        let Some(Kind::StructValue(meta)) = &meta.kind else {
            panic!("metadata is a struct: {meta:?}")
        };
        let Some(Kind::StructValue(quota)) = &meta.fields["service_with_quota"].kind else {
            panic!("service_with_quota is a struct")
        };
        let Some(Kind::StringValue(name)) = &quota.fields["name"].kind else {
            panic!("a name")
        };
        name.clone()
    };
    // The first passed descriptor's value wins.
    assert_eq!(name(&first), "service_1");
    // service_1 is spent: only the users rule passed, so its value is the one returned.
    let second = c.should_rate_limit(both).await.unwrap().into_inner();
    assert_eq!(name(&second), "users");
}
