//! One counter, looked at and reset on the admin port: `POST /counters/lookup` shows an
//! exhausted counter's rule, remaining, wait and debt without charging it; `POST
//! /counters/reset` with the write token admits the next request, in memory and in Redis; a
//! reset without the token, with a wrong one, or while writes are off is refused and changes
//! nothing.

use std::time::Duration;

use sluice::pb::rate_limit_response::Code;
use sluice::settings::{BackendKind, Written};

use crate::helpers::redis::{RedisCluster, RedisProcess};
use crate::helpers::{TestServer, eventually, http, http_raw_with, redis_missing, single};

const POLICY: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 3, name: per_user}\n";
const ALICE: &str =
    r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"alice"}]}]}"#;
const TOKEN: &str = "t0ken-for-tests";

/// A directory holding the write token's file, and its path.
fn token_file() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("write-token");
    std::fs::write(&path, format!("{TOKEN}\n")).expect("write token");
    (dir, path)
}

/// Whether a request for alice is admitted now.
async fn admitted(s: &TestServer) -> bool {
    s.call(single("api", "user", "alice"))
        .await
        .expect("decided")
        .overall_code
        == Code::Ok as i32
}

/// Charges alice until she is refused.
async fn exhaust(s: &TestServer) {
    for _ in 0..3 {
        assert!(admitted(s).await);
    }
    assert!(!admitted(s).await, "the fourth request is refused");
}

/// `POST /counters/reset` with `headers`: (status, body).
async fn reset(s: &TestServer, headers: &[(&str, &str)]) -> (u16, String) {
    let raw = http_raw_with(s.admin, "POST", "/counters/reset", headers, ALICE).await;
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned());
    (status, body.unwrap_or_default())
}

async fn lookup(s: &TestServer, body: &str) -> (u16, serde_json::Value) {
    let (status, body) = http(s.admin, "POST", "/counters/lookup", body).await;
    let json = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    (status, json)
}

#[tokio::test]
async fn an_exhausted_counter_shows_no_room_and_its_wait_and_a_reset_admits() {
    let (_dir, path) = token_file();
    let s = TestServer::start_with(&[("api.yaml", POLICY)], |w: &mut Written| {
        w.admin.write_token_file = Some(path);
    })
    .await;
    let (status, fresh) = lookup(&s, ALICE).await;
    assert_eq!(status, 200, "{fresh}");
    assert_eq!(fresh["counters"][0]["remaining"], 3, "{fresh}");
    assert_eq!(fresh["counters"][0]["wait_ms"], 0, "{fresh}");
    exhaust(&s).await;
    let (status, seen) = lookup(&s, ALICE).await;
    assert_eq!(status, 200, "{seen}");
    let c = &seen["counters"][0];
    assert_eq!(c["rule"]["name"], "per_user", "{seen}");
    assert_eq!(c["rule"]["requests_per_unit"], 3, "{seen}");
    assert_eq!(c["rule"]["unit"], "hour", "{seen}");
    assert_eq!(c["rule"]["burst"], 3, "{seen}");
    assert_eq!(c["remaining"], 0, "{seen}");
    // 3 per hour: one token every 20 minutes; the bucket is an hour ahead of now.
    assert_eq!(c["wait_ms"], 20 * 60 * 1000, "{seen}");
    assert_eq!(c["debt_ms"], 60 * 60 * 1000, "{seen}");
    assert_eq!(c["key"].as_str().map(str::len), Some(32), "{seen}");
    assert_eq!(seen["backend"], "memory");
    // Looking charged nothing.
    assert_eq!(lookup(&s, ALICE).await.1, seen);

    let (status, body) = reset(&s, &[("Authorization", &format!("Bearer {TOKEN}"))]).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(c["key"].as_str().unwrap()), "{body}");
    assert!(
        admitted(&s).await,
        "the reset counter admits the next request"
    );
    assert_eq!(lookup(&s, ALICE).await.1["counters"][0]["remaining"], 2);
}

#[tokio::test]
async fn a_reset_without_the_right_token_is_refused_and_changes_nothing() {
    let (_dir, path) = token_file();
    let s = TestServer::start_with(&[("api.yaml", POLICY)], |w: &mut Written| {
        w.admin.write_token_file = Some(path);
    })
    .await;
    exhaust(&s).await;
    for headers in [
        &[][..],
        &[("Authorization", "Bearer wrong-token")][..],
        &[("Authorization", "Basic dDBrZW4tZm9yLXRlc3Rz")][..],
        &[("Authorization", &*format!("Bearer {TOKEN}x"))][..],
    ] {
        let (status, body) = reset(&s, headers).await;
        assert_eq!(status, 401, "{headers:?}: {body}");
        assert!(body.contains("Bearer"), "{body}");
        assert!(
            !admitted(&s).await,
            "{headers:?}: the counter still refuses"
        );
    }
    assert_eq!(lookup(&s, ALICE).await.1["counters"][0]["remaining"], 0);
}

#[tokio::test]
async fn a_reset_while_writes_are_off_is_forbidden() {
    let s = TestServer::start(&[("api.yaml", POLICY)]).await;
    exhaust(&s).await;
    let (status, body) = reset(&s, &[("Authorization", &format!("Bearer {TOKEN}"))]).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("admin.write_token_file"), "{body}");
    assert!(!admitted(&s).await, "the counter still refuses");
}

#[tokio::test]
async fn a_lookup_of_no_counter_is_404_and_bad_input_400() {
    let s = TestServer::start(&[("api.yaml", POLICY)]).await;
    for (missing, reason) in [
        (
            r#"{"domain":"nope","descriptors":[{"entries":[{"key":"user","value":"a"}]}]}"#,
            "unknown domain",
        ),
        (
            r#"{"domain":"api","descriptors":[{"entries":[{"key":"other","value":"a"}]}]}"#,
            "descriptors[0]",
        ),
    ] {
        let (status, body) = lookup(&s, missing).await;
        assert_eq!(status, 404, "{body}");
        assert!(body["error"].as_str().unwrap().contains(reason), "{body}");
        // A reset of no counter is refused the same way, with or without writes on.
        let (status, _) = http(s.admin, "POST", "/counters/reset", missing).await;
        assert_eq!(status, 403);
    }
    for bad in [
        "{",
        r#"{"domain":"api","bogus":1}"#,
        r#"{"domain":"api","descriptors":[]}"#,
    ] {
        let (status, body) = lookup(&s, bad).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body["error"].is_string(), "{body}");
    }
}

#[test]
fn a_missing_or_empty_token_file_is_a_settings_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut w = Written::default();
    w.admin.write_token_file = Some(dir.path().join("absent"));
    let e = w.clone().validate().unwrap_err().to_string();
    assert!(e.contains("admin.write_token_file"), "{e}");
    std::fs::write(dir.path().join("empty"), "\n").unwrap();
    w.admin.write_token_file = Some(dir.path().join("empty"));
    let e = w.validate().unwrap_err().to_string();
    assert!(e.contains("is empty"), "{e}");
}

#[tokio::test]
async fn a_reset_in_redis_admits_the_next_request() {
    if redis_missing("a_reset_in_redis_admits_the_next_request") {
        return;
    }
    let redis = RedisProcess::start();
    reset_in_redis(redis.url(), Some(&redis)).await;
}

/// The same on a Redis Cluster: the lookup's `TIME` and `GET` and the reset's `DEL` of the
/// counter with its share table (one slot) go where the counter lives.
#[tokio::test]
async fn a_reset_in_a_redis_cluster_admits_the_next_request() {
    if redis_missing("a_reset_in_a_redis_cluster_admits_the_next_request") {
        return;
    }
    let cluster = RedisCluster::start();
    reset_in_redis(cluster.urls().join(","), None).await;
}

/// A server counting in Redis (as `tune` says where) under `policy`, with writes on, once Redis
/// answers; and the directory of its token file.
async fn on_redis(
    policy: &str,
    tune: impl FnOnce(&mut Written) + Send + 'static,
) -> (tempfile::TempDir, TestServer) {
    let (dir, path) = token_file();
    let s = TestServer::start_with(&[("api.yaml", policy)], move |w: &mut Written| {
        w.backend = BackendKind::Redis;
        w.redis.key_prefix = "sluice-test:".into();
        w.redis.timeout_ms = 2_000;
        w.redis.connect_timeout_ms = 500;
        w.admin.write_token_file = Some(path);
        tune(w);
    })
    .await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            s.call(single("api", "user", "warmup")).await.is_ok()
        })
        .await,
        "redis answers"
    );
    (dir, s)
}

/// Exhausts alice on a server counting in Redis at `url` (a cluster unless `single` is the
/// one Redis there, whose keys are then checked), looks her up, refuses a reset with a wrong
/// token, and resets her.
async fn reset_in_redis(url: String, one: Option<&RedisProcess>) {
    let cluster = one.is_none();
    let (_dir, s) = on_redis(POLICY, move |w| {
        w.redis.url = url;
        w.redis.cluster = cluster;
    })
    .await;
    exhaust(&s).await;
    let (status, seen) = lookup(&s, ALICE).await;
    assert_eq!(status, 200, "{seen}");
    assert_eq!(seen["backend"], "redis", "{seen}");
    let c = &seen["counters"][0];
    assert_eq!(c["remaining"], 0, "{seen}");
    let wait = c["wait_ms"].as_u64().unwrap();
    assert!(wait > 19 * 60 * 1000 && wait <= 20 * 60 * 1000, "{seen}");
    let key = format!("sluice-test:{}", c["key"].as_str().unwrap());
    // On the one Redis, whether the counter's key is there ("1") or not ("0").
    let exists = || one.map(|r| r.cli(&["EXISTS", &key]).trim().to_owned());

    let (status, body) = reset(&s, &[("Authorization", "Bearer nope")]).await;
    assert_eq!(status, 401, "{body}");
    assert!(!admitted(&s).await, "a refused write changes nothing");
    assert!(
        cluster || exists().as_deref() == Some("1"),
        "the counter is in Redis"
    );

    let (status, body) = reset(&s, &[("Authorization", &format!("Bearer {TOKEN}"))]).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        cluster || exists().as_deref() == Some("0"),
        "the counter is gone"
    );
    assert!(
        admitted(&s).await,
        "the reset counter admits the next request"
    );
    let (_, after) = lookup(&s, ALICE).await;
    assert_eq!(after["counters"][0]["remaining"], 2, "{after}");
}

/// With leasing, the node's own lease of the counter is dropped with it: an exhausted lease that
/// refuses locally would otherwise go on refusing after the reset.
#[tokio::test]
async fn a_reset_with_leases_drops_the_lease_and_admits() {
    if redis_missing("a_reset_with_leases_drops_the_lease_and_admits") {
        return;
    }
    let redis = RedisProcess::start();
    let url = redis.url();
    let policy = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 50}\n";
    let (_dir, s) = on_redis(policy, move |w| {
        w.redis.url = url;
        w.redis.lease.enabled = true;
        w.redis.lease.min_rate = 1;
        w.redis.lease.max_burst_share = 1.0;
        w.redis.lease.max_age_ms = 60_000;
    })
    .await;
    let mut admitted_before = 0;
    for _ in 0..150 {
        admitted_before += u32::from(admitted(&s).await);
    }
    assert!(admitted_before <= 50, "{admitted_before}");
    assert!(!admitted(&s).await, "alice is out of tokens");
    let (status, seen) = lookup(&s, ALICE).await;
    assert_eq!(status, 200, "{seen}");
    assert!(seen["counters"][0]["held_here"].is_u64(), "{seen}");
    assert_eq!(seen["counters"][0]["remaining"], 0, "{seen}");

    let (status, body) = reset(&s, &[("Authorization", &format!("Bearer {TOKEN}"))]).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        admitted(&s).await,
        "the reset counter admits the next request"
    );
}
