//! Degraded local mode (`on_backend_error: local`) against real `redis-server` processes: the
//! fleet size learned from heartbeats, each node counting at rate/N while Redis is dead, and the
//! return to the shared counter when Redis is back, without restarting sluice.
//!
//! Needs `redis-server` and `redis-cli` (skipped with a notice without them, except on CI).

use std::process::Command;
use std::time::Duration;

use sluice::decision::OnBackendError;
use sluice::pb::rate_limit_response::Code;
use sluice::settings::BackendKind;

use crate::helpers::redis::RedisProcess;
use crate::helpers::{TestServer, eventually, metric, redis_missing, single};

/// `k`: 60 a minute (T = 1 s) with a burst of 10, for the measured span; `j`: 10 an hour, for
/// the shared budget.
const POLICY: &str = "domain: shared\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 60, burst: 10}\n  - key: j\n    rate_limit: {unit: hour, requests_per_unit: 10}\n";

const MS: u64 = 1_000_000;

async fn local_server(url: &str, heartbeat_ms: u64, fleet_size: Option<u64>) -> TestServer {
    let url = url.to_string();
    let s = TestServer::start_with(&[("r.yaml", POLICY)], move |settings| {
        settings.backend = BackendKind::Redis;
        settings.redis.url = url;
        settings.redis.timeout_ms = 50;
        settings.redis.connect_timeout_ms = 100;
        settings.redis.breaker_failures = 3;
        settings.redis.breaker_cooldown_ms = 200;
        settings.redis.heartbeat_interval_ms = heartbeat_ms;
        settings.redis.fleet_size = fleet_size;
        settings.on_backend_error = OnBackendError::Local;
    })
    .await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            // The breaker's cool-down runs on the server's clock, driven here.
            s.clock.advance(200 * MS);
            s.ok(single("shared", "j", "warmup")).await;
            in_mode(&s, "shared").await
        })
        .await,
        "server never counted in redis"
    );
    s
}

async fn in_mode(s: &TestServer, mode: &str) -> bool {
    metric(s.admin, &format!("sluice_backend_mode{{mode=\"{mode}\"}}")).await == Some(1.0)
}

async fn by(s: &TestServer, who: &str) -> f64 {
    metric(
        s.admin,
        &format!("sluice_backend_decisions_total{{by=\"{who}\"}}"),
    )
    .await
    .unwrap_or(-1.0)
}

async fn fleet(s: &TestServer) -> f64 {
    metric(s.admin, "sluice_backend_fleet_size")
        .await
        .unwrap_or(-1.0)
}

fn zcard(port: u16) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "ZCARD", "sluice:nodes"])
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[tokio::test]
async fn redis_killed_under_load_each_node_admits_its_share_then_shares_again() {
    if redis_missing("redis_killed_under_load_each_node_admits_its_share_then_shares_again") {
        return;
    }
    let mut redis = RedisProcess::start();
    let port = redis.port;
    let a = local_server(&redis.url(), 100, None).await;
    let b = local_server(&redis.url(), 100, None).await;
    // Each node learns N = 2 from the heartbeats.
    assert!(
        eventually(Duration::from_secs(10), || async {
            fleet(&a).await == 2.0 && fleet(&b).await == 2.0
        })
        .await,
        "fleet sizes {} and {}",
        fleet(&a).await,
        fleet(&b).await
    );
    // Kill Redis under load: 4 clients on each node keep calling; every call is answered.
    let load: Vec<_> = [&a, &b]
        .iter()
        .flat_map(|s| (0..4).map(|c| (s.client.clone(), c)))
        .map(|(mut client, c)| {
            tokio::spawn(async move {
                for i in 0..60 {
                    client
                        .should_rate_limit(single("shared", "j", &format!("load-{c}-{i}")))
                        .await
                        .expect("answered while redis dies");
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(20)).await;
    redis.kill();
    for task in load {
        task.await.unwrap();
    }
    for s in [&a, &b] {
        assert!(
            eventually(Duration::from_secs(5), || async {
                s.ok(single("shared", "j", "after-kill")).await;
                in_mode(s, "local").await
            })
            .await,
            "the node did not switch to local counting"
        );
        assert!(!in_mode(s, "shared").await);
        assert_eq!(fleet(s).await, 2.0, "N is the fleet seen before the outage");
    }
    // The measured span: W = 20 s of each server's clock in steps of 250 ms, three calls per
    // step (12 a second, far above the rate). Each node counts at rate/N = 1 per 2 s with
    // burst ceil(10 / 2) = 5, so the GCRA bound is ceil(B/N) + floor(W·rate/N) = 5 + 10 = 15.
    // The clock is driven by hand and Redis is dead, so every call is decided locally and the
    // bound is reached exactly: the tolerance is zero. Shared counting would admit 10 + 20 for
    // the whole fleet; admitting everything would be 243 per node.
    let local_before = by(&a, "local").await;
    for s in [&a, &b] {
        let mut admitted = 0;
        for step in 0..=80 {
            for _ in 0..3 {
                let r = s.ok(single("shared", "k", "measured")).await;
                if r.overall_code == Code::Ok as i32 {
                    admitted += 1;
                }
            }
            if step < 80 {
                s.clock.advance(250 * MS);
            }
        }
        assert_eq!(admitted, 15, "one node's share over 20 s");
        assert!(in_mode(s, "local").await);
    }
    assert!(by(&a, "local").await >= local_before + 243.0);
    // Redis back on the same port: each node returns to the shared counter by itself once the
    // breaker's probe (its cool-down driven here) is answered.
    let _redis = RedisProcess::start_on(port);
    for s in [&a, &b] {
        assert!(
            eventually(Duration::from_secs(15), || async {
                s.clock.advance(200 * MS);
                s.ok(single("shared", "j", "probe")).await;
                in_mode(s, "shared").await
            })
            .await,
            "the node did not return to shared counting"
        );
    }
    // The shared counter is used again: a budget of 10 used up through one node is refused on
    // the other (which, counting locally, would still have ceil(10 / 2) = 5 of its own).
    let redis_before = by(&b, "redis").await;
    for i in 0..10 {
        let r = a.ok(single("shared", "j", "after")).await;
        assert_eq!(r.overall_code, Code::Ok as i32, "call {i} on a");
    }
    let r = b.ok(single("shared", "j", "after")).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32, "b sees a's charges");
    assert!(in_mode(&b, "shared").await);
    assert_eq!(by(&b, "redis").await, redis_before + 1.0);
}

#[tokio::test]
async fn heartbeats_count_the_live_nodes_and_a_stopped_node_leaves_at_once() {
    if redis_missing("heartbeats_count_the_live_nodes_and_a_stopped_node_leaves_at_once") {
        return;
    }
    let redis = RedisProcess::start();
    // A node with a fixed fleet size divides by it and does not beat.
    let fixed = local_server(&redis.url(), 1_000, Some(5)).await;
    assert_eq!(fleet(&fixed).await, 5.0);
    let a = local_server(&redis.url(), 1_000, None).await;
    let b = local_server(&redis.url(), 1_000, None).await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            fleet(&a).await == 2.0 && fleet(&b).await == 2.0
        })
        .await,
        "fleet sizes {} and {}",
        fleet(&a).await,
        fleet(&b).await
    );
    assert_eq!(
        zcard(redis.port),
        "2",
        "the fixed-size node is not recorded"
    );
    assert_eq!(fleet(&fixed).await, 5.0);
    // A node that stops removes itself at once (its entry would otherwise live 3 s).
    b.stop().await.unwrap();
    assert_eq!(zcard(redis.port), "1");
    assert!(
        eventually(Duration::from_secs(5), || async { fleet(&a).await == 1.0 }).await,
        "a still counts {} nodes",
        fleet(&a).await
    );
}
