//! Redis Sentinel against real processes (a master, a replica, three sentinels): the master
//! killed under load, answered by the backend-error policy meanwhile and followed to the promoted
//! replica with nothing charged twice; shares of a contended counter held to their bound through
//! the failover; unreachable sentinels and a wrong master name logged.
//! Skips without `redis-sentinel` unless `CI` is set (`helpers::sentinel_missing`).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice::decision::OnBackendError;
use sluice::limiter::Clock;
use sluice::pb::rate_limit_response::Code;
use sluice::pb::rate_limit_service_client::RateLimitServiceClient;
use sluice::pb::{RateLimitDescriptor, RateLimitRequest, RateLimitResponse};
use sluice::settings::BackendKind;

use crate::helpers::redis::RedisProcess;
use crate::helpers::{
    TestServer, descriptor, eventually, free_port, metric, sentinel_missing, single,
};

const MASTER: &str = "mymaster";
const POLICY: &str = "domain: shared\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 10}\n  - key: j\n    rate_limit: {unit: year, requests_per_unit: 1000000}\n";

/// `redis-cli -p port args...`, its output.
fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli must be installed (Debian package redis-tools)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A field of a `redis-cli` reply printed as alternating name and value lines.
fn field(reply: &str, name: &str) -> Option<String> {
    let lines: Vec<&str> = reply.lines().collect();
    lines
        .iter()
        .position(|l| l.trim() == name)
        .and_then(|i| lines.get(i + 1))
        .map(|v| v.trim().to_string())
}

/// Polls `check` (blocking) every 50 ms until it holds or `timeout` passes.
fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "{what} within {timeout:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `redis-sentinel` watching `master` on a free port, killed on drop.
struct SentinelProcess {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl SentinelProcess {
    /// With `password`, the sentinel requires it (`requirepass`).
    fn start(master_port: u16, quorum: u32, password: Option<&str>) -> Self {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        // Sentinel rewrites its config file, so it lives in the temporary directory.
        let conf = dir.path().join("sentinel.conf");
        let auth = password.map_or(String::new(), |p| format!("requirepass {p}\n"));
        std::fs::write(
            &conf,
            format!(
                "{auth}port {port}\nbind 127.0.0.1\ndaemonize no\nlogfile \"\"\ndir {dir}\n\
                 sentinel monitor {MASTER} 127.0.0.1 {master_port} {quorum}\n\
                 sentinel down-after-milliseconds {MASTER} 600\n\
                 sentinel failover-timeout {MASTER} 3000\n\
                 sentinel parallel-syncs {MASTER} 1\n",
                dir = dir.path().display()
            ),
        )
        .unwrap();
        let child = Command::new("redis-sentinel")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-sentinel must be installed (Debian package redis-sentinel)");
        wait_for("redis-sentinel listening", Duration::from_secs(5), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        Self {
            port,
            child,
            _dir: dir,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The master's port as this sentinel names it.
    fn master_port(&self) -> Option<u16> {
        let reply = cli(self.port, &["SENTINEL", "get-master-addr-by-name", MASTER]);
        reply.lines().nth(1)?.trim().parse().ok()
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A master, its replica and three sentinels that know each other and the replica.
struct Deployment {
    master: RedisProcess,
    replica: RedisProcess,
    sentinels: Vec<SentinelProcess>,
}

impl Deployment {
    fn start() -> Self {
        let master = RedisProcess::start();
        let mp = master.port.to_string();
        let replica = RedisProcess::spawn(free_port(), &["--replicaof", "127.0.0.1", &mp]);
        wait_for("the replica in sync", Duration::from_secs(10), || {
            cli(replica.port, &["INFO", "replication"]).contains("master_link_status:up")
        });
        let sentinels: Vec<SentinelProcess> = (0..3)
            .map(|_| SentinelProcess::start(master.port, 2, None))
            .collect();
        // A failover needs a quorum of sentinels that found each other (hello messages every
        // 2 s) and the replica (from the master's INFO).
        for s in &sentinels {
            wait_for(
                "each sentinel knowing the replica and two other sentinels",
                Duration::from_secs(20),
                || {
                    let reply = cli(s.port, &["SENTINEL", "master", MASTER]);
                    field(&reply, "num-slaves").as_deref() == Some("1")
                        && field(&reply, "num-other-sentinels").as_deref() == Some("2")
                },
            );
        }
        Self {
            master,
            replica,
            sentinels,
        }
    }

    fn sentinel_urls(&self) -> String {
        self.sentinels
            .iter()
            .map(SentinelProcess::url)
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn check_only(domain: &str, key: &str, value: &str) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: vec![RateLimitDescriptor {
            hits_addend: Some(0),
            ..descriptor(&[(key, value)])
        }],
        hits_addend: 0,
    }
}

/// Answered by Redis: a limited status (the backend-error policy here is `error`, so an answer
/// at all means Redis decided).
fn from_redis(r: &RateLimitResponse) -> bool {
    r.statuses
        .first()
        .is_some_and(|s| s.current_limit.is_some())
}

#[derive(Default)]
struct Load {
    sent: u64,
    admitted: u64,
    unavailable: u64,
    slowest: Duration,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_is_followed_to_the_promoted_replica_without_a_restart() {
    if sentinel_missing("a_killed_master_is_followed_to_the_promoted_replica_without_a_restart") {
        return;
    }
    let mut d = Deployment::start();
    let urls = d.sentinel_urls();
    let s = TestServer::start_with(&[("r.yaml", POLICY)], move |settings| {
        settings.backend = BackendKind::Redis;
        settings.redis.sentinel.master_name = MASTER.into();
        settings.redis.sentinel.urls = urls;
        settings.redis.timeout_ms = 250;
        settings.redis.connect_timeout_ms = 200;
        settings.redis.breaker_failures = 3;
        settings.redis.breaker_cooldown_ms = 200;
        // Every refusal must come from Redis, not from this node's memory of one.
        settings.redis.deny_cache_keys = 0;
        settings.on_backend_error = OnBackendError::Error;
    })
    .await;
    // The server's clock (breaker cool-downs) is never advanced here: only following the new
    // master can bring decisions back.
    assert!(
        eventually(Duration::from_secs(10), || async {
            s.call(single("shared", "j", "warmup"))
                .await
                .is_ok_and(|r| from_redis(&r))
        })
        .await,
        "server never reached the master"
    );
    // Four charges on one counter, and another counter used up, replicated before the kill.
    for remaining in (6..10).rev() {
        let r = s.ok(single("shared", "k", "count")).await;
        assert_eq!(r.statuses[0].limit_remaining, remaining);
    }
    for _ in 0..10 {
        assert_eq!(
            s.ok(single("shared", "k", "used")).await.overall_code,
            Code::Ok as i32
        );
    }
    assert_eq!(
        s.ok(single("shared", "k", "used")).await.overall_code,
        Code::OverLimit as i32
    );
    assert_eq!(
        cli(d.master.port, &["WAIT", "1", "2000"]).trim(),
        "1",
        "the replica acknowledged every write"
    );

    // Load: four clients on one counter, each call bounded, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let load: Vec<_> = (0..4)
        .map(|_| {
            let mut client: RateLimitServiceClient<_> = s.client.clone();
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let mut l = Load::default();
                for _ in 0..20_000 {
                    // Relaxed: a flag polled in a loop; nothing else is published through it.
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let started = Instant::now();
                    let answer = tokio::time::timeout(
                        Duration::from_secs(3),
                        client.should_rate_limit(single("shared", "j", "load")),
                    )
                    .await
                    .expect("every call is answered within 3 s");
                    l.slowest = l.slowest.max(started.elapsed());
                    l.sent += 1;
                    match answer {
                        Ok(r) => {
                            let r = r.into_inner();
                            assert!(from_redis(&r), "{r:?}");
                            assert_eq!(r.overall_code, Code::Ok as i32);
                            l.admitted += 1;
                        }
                        Err(e) => {
                            assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                            l.unavailable += 1;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                l
            })
        })
        .collect();
    assert!(
        eventually(Duration::from_secs(5), || async {
            s.call(check_only("shared", "j", "load"))
                .await
                .is_ok_and(|r| r.statuses[0].limit_remaining < 1_000_000 - 20)
        })
        .await,
        "the load is running"
    );

    // SIGKILL: no goodbye, no last replication.
    let old_port = d.master.port;
    d.master.kill();
    let killed = Instant::now();
    // Decisions come back from Redis, with no restart: the used-up counter is refused again,
    // which only the shared store (the promoted replica, holding the replicated state) can do.
    let promoted = Mutex::new(None);
    let resumed = eventually(Duration::from_secs(30), || async {
        if promoted.lock().unwrap().is_none()
            && d.sentinels[0].master_port() == Some(d.replica.port)
        {
            *promoted.lock().unwrap() = Some(killed.elapsed());
        }
        s.call(single("shared", "k", "used"))
            .await
            .is_ok_and(|r| from_redis(&r) && r.overall_code == Code::OverLimit as i32)
    })
    .await;
    let took = killed.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut total = Load::default();
    for task in load {
        let l = task.await.expect("load task");
        total.sent += l.sent;
        total.admitted += l.admitted;
        total.unavailable += l.unavailable;
        total.slowest = total.slowest.max(l.slowest);
    }
    eprintln!(
        "sentinel failover: the sentinels promoted the replica {:?} and decisions came from redis \
         again {took:?} after the kill; load {} sent, {} admitted, {} unavailable, slowest {:?}",
        promoted.lock().unwrap(),
        total.sent,
        total.admitted,
        total.unavailable,
        total.slowest
    );
    assert!(resumed, "decisions did not resume after the failover");
    assert_eq!(
        d.sentinels[0].master_port(),
        Some(d.replica.port),
        "the sentinels promoted the replica"
    );
    assert_ne!(d.replica.port, old_port);
    // While the master was down the policy answered (UNAVAILABLE), promptly.
    assert!(total.unavailable > 0, "the outage was seen");
    assert!(total.admitted > 0);
    assert!(
        total.slowest < Duration::from_secs(2),
        "a call took {:?}",
        total.slowest
    );
    // Nothing charged twice: the replicated charges are all there, once each ...
    let r = s.ok(check_only("shared", "k", "count")).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 6,
        "four charges survive, once each"
    );
    let r = s.ok(single("shared", "k", "count")).await;
    assert_eq!(r.statuses[0].limit_remaining, 5, "a new charge counts once");
    // ... and the load counter holds no charge beyond an admitted answer, except for calls
    // whose answer was lost: those in flight at the kill (one per client) and those that
    // timed out. Charges the old master had not replicated may be lost (over-admission).
    let r = s.ok(check_only("shared", "j", "load")).await;
    let charged = 1_000_000 - r.statuses[0].limit_remaining;
    let timeouts = metric(s.admin, "sluice_redis_errors_total{kind=\"timeout\"}")
        .await
        .unwrap_or(0.0) as u64;
    assert!(
        u64::from(charged) <= total.admitted + 4 + timeouts,
        "charged {charged}, admitted {}, timeouts {timeouts}",
        total.admitted
    );
    eprintln!(
        "sentinel failover: load counter charged {charged} for {} admitted ({} lost in the \
         failover)",
        total.admitted,
        total.admitted.saturating_sub(u64::from(charged))
    );
}

/// A counter of 200 a second with a burst of 200, for two leasing nodes to contend for.
const CONTENDED: &str = "domain: fleet\ndescriptors:\n  - key: hot\n    rate_limit: {unit: second, requests_per_unit: 200, burst: 200}\n";

/// Shares through a failover: two nodes leasing one counter (L = 500 ms), offered far more than
/// its rate, the master killed under them, `on_backend_error: local` with the shares kept. In
/// every window of a second the fleet admits at most `B + R × (1 s + L)` = 500, before, during
/// and after the failover, and both nodes leave local mode once the replica is promoted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_hold_their_bound_through_a_failover() {
    if sentinel_missing("shares_hold_their_bound_through_a_failover") {
        return;
    }
    let mut d = Deployment::start();
    let node = || {
        let urls = d.sentinel_urls();
        TestServer::start_with(&[("f.yaml", CONTENDED)], move |w| {
            w.backend = BackendKind::Redis;
            w.redis.sentinel.master_name = MASTER.into();
            w.redis.sentinel.urls = urls;
            w.redis.timeout_ms = 250;
            w.redis.connect_timeout_ms = 200;
            w.redis.breaker_failures = 3;
            w.redis.breaker_cooldown_ms = 200;
            w.redis.fleet_size = Some(2);
            w.redis.lease.enabled = true;
            w.redis.lease.max_age_ms = 500;
            w.redis.lease.min_rate = 5;
            w.on_backend_error = OnBackendError::Local;
        })
    };
    let nodes = [node().await, node().await];
    // The nodes' clocks follow real time, as leases, shares and breakers need.
    let stop = Arc::new(AtomicBool::new(false));
    let clocks: Vec<_> = nodes.iter().map(|n| Arc::clone(&n.clock)).collect();
    let ticking = {
        let stop = Arc::clone(&stop);
        let (base, real) = (clocks[0].now(), Instant::now());
        tokio::spawn(async move {
            // Relaxed: a flag polled in a loop; nothing else is published through it.
            while !stop.load(Ordering::Relaxed) {
                let now = base + u64::try_from(real.elapsed().as_nanos()).unwrap_or(u64::MAX);
                for c in &clocks {
                    c.set(now);
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    for n in &nodes {
        assert!(
            eventually(Duration::from_secs(10), || async {
                metric(n.admin, "sluice_redis_connected").await == Some(1.0)
            })
            .await,
            "a node never reached the master"
        );
    }
    let mode = |n: &TestServer, mode: &str| {
        let (admin, series) = (n.admin, format!("sluice_backend_mode{{mode=\"{mode}\"}}"));
        async move { metric(admin, &series).await == Some(1.0) }
    };
    let started = Instant::now();
    let admitted = Arc::new(Mutex::new(Vec::<Duration>::new()));
    let load: Vec<_> = (0..6)
        .map(|i| {
            let mut client: RateLimitServiceClient<_> = nodes[i % 2].client.clone();
            let (stop, admitted) = (Arc::clone(&stop), Arc::clone(&admitted));
            tokio::spawn(async move {
                // Relaxed: a flag polled in a loop; nothing else is published through it.
                while !stop.load(Ordering::Relaxed) {
                    let answer = tokio::time::timeout(
                        Duration::from_secs(3),
                        client.should_rate_limit(single("fleet", "hot", "x")),
                    )
                    .await
                    .expect("every call is answered within 3 s")
                    .expect("answered, by Redis or locally");
                    if answer.into_inner().overall_code == Code::Ok as i32 {
                        admitted.lock().unwrap().push(started.elapsed());
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    d.master.kill();
    let killed = Instant::now();
    let local = eventually(Duration::from_secs(10), || mode(&nodes[0], "local")).await;
    let back = eventually(Duration::from_secs(30), || async {
        d.sentinels[0].master_port() == Some(d.replica.port)
            && !mode(&nodes[0], "local").await
            && !mode(&nodes[1], "local").await
    })
    .await;
    let took = killed.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.expect("load task");
    }
    ticking.await.expect("the clocks' task");
    let times = admitted.lock().unwrap().clone();
    let end = started.elapsed();
    let (window, bound) = (Duration::from_secs(1), 500);
    let mut worst = (0, Duration::ZERO);
    let mut from = Duration::ZERO;
    while from + window <= end {
        let n = times
            .iter()
            .filter(|t| **t >= from && **t < from + window)
            .count();
        worst = worst.max((n, from));
        from += Duration::from_millis(50);
    }
    eprintln!(
        "shares through a failover: {} admitted in {end:?}; at most {} in a second (from {:?}); \
         local mode seen: {local}; out of it {took:?} after the kill",
        times.len(),
        worst.0,
        worst.1
    );
    assert!(local, "the outage was answered locally");
    assert!(back, "the nodes never left local mode after the failover");
    assert!(
        worst.0 <= bound,
        "{} admitted in the second from {:?}, over B + R × (1 s + L) = {bound}",
        worst.0,
        worst.1
    );
    assert!(
        times.len() > 200,
        "the load was admitted at all: {}",
        times.len()
    );
}

/// A `sluice serve` process with the given `SLUICE_*` variables, its log collected, killed on
/// drop.
struct Sluice {
    child: Child,
    grpc: std::net::SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
}

impl Sluice {
    fn start(env: &[(&str, String)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("r.yaml"), POLICY).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([
                "serve",
                "--grpc-addr",
                "127.0.0.1:0",
                "--admin-addr",
                "127.0.0.1:0",
            ])
            .arg("--policies")
            .arg(dir.path())
            .args(["--log-format", "json"])
            .env_remove("RUST_LOG")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let collected = Arc::clone(&log);
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Ok(event) = serde_json::from_str::<serde_json::Value>(&line)
                    && event["message"] == "serving"
                {
                    let _ = tx.send(event["grpc"].as_str().unwrap_or_default().to_string());
                }
                collected.lock().unwrap().push(line);
            }
        });
        let grpc = rx
            .recv_timeout(Duration::from_secs(20))
            .unwrap_or_else(|_| panic!("sluice did not serve: {:?}", log.lock().unwrap()))
            .parse()
            .unwrap();
        Self {
            child,
            grpc,
            log,
            _dir: dir,
        }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// Whether a log line contains `text` within `timeout`.
    async fn logs(&self, text: &str, timeout: Duration) -> bool {
        eventually(timeout, || async { self.log().contains(text) }).await
    }

    /// Decisions are answered by the policy (`error`: UNAVAILABLE), promptly.
    async fn answers_by_policy(&self) {
        let mut client = RateLimitServiceClient::connect(format!("http://{}", self.grpc))
            .await
            .unwrap();
        for i in 0..20 {
            let started = Instant::now();
            let e = client
                .should_rate_limit(single("shared", "k", &format!("v{i}")))
                .await
                .expect_err("answered by the policy");
            assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
            assert!(started.elapsed() < Duration::from_millis(500));
        }
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sentinel_env(master: &str, urls: String) -> Vec<(&'static str, String)> {
    vec![
        ("SLUICE_BACKEND", "redis".into()),
        ("SLUICE_ON_BACKEND_ERROR", "error".into()),
        ("SLUICE_REDIS__CONNECT_TIMEOUT_MS", "200".into()),
        ("SLUICE_REDIS__SENTINEL__MASTER_NAME", master.into()),
        ("SLUICE_REDIS__SENTINEL__URLS", urls),
        (
            "SLUICE_REDIS__SENTINEL__PASSWORD",
            "sentinel-topsecret".into(),
        ),
    ]
}

#[tokio::test]
async fn unreachable_sentinels_are_named_and_decisions_answered_by_the_policy() {
    if sentinel_missing("unreachable_sentinels_are_named_and_decisions_answered_by_the_policy") {
        return;
    }
    // Ports nobody listens on; one URL carries credentials, which must never be logged.
    let (a, b) = (free_port(), free_port());
    let urls = format!("redis://admin:url-topsecret@127.0.0.1:{a},redis://127.0.0.1:{b}");
    let sluice = Sluice::start(&sentinel_env(MASTER, urls));
    assert!(
        sluice
            .logs("no sentinel answered for master", Duration::from_secs(10))
            .await,
        "{}",
        sluice.log()
    );
    sluice.answers_by_policy().await;
    let log = sluice.log();
    let line = log
        .lines()
        .find(|l| l.contains("no sentinel answered"))
        .unwrap();
    assert!(line.contains(&format!("127.0.0.1:{a}")), "{line}");
    assert!(line.contains(&format!("127.0.0.1:{b}")), "{line}");
    assert!(line.contains("mymaster"), "{line}");
    assert!(!log.contains("topsecret"), "a secret in the log:\n{log}");
    // Retried with back-off, not in a busy loop: a handful of attempts in a second or so.
    let attempts = log.matches("no sentinel answered").count();
    assert!((1..=10).contains(&attempts), "{attempts} attempts:\n{log}");
}

#[tokio::test]
async fn a_wrong_master_name_is_named_and_decisions_answered_by_the_policy() {
    if sentinel_missing("a_wrong_master_name_is_named_and_decisions_answered_by_the_policy") {
        return;
    }
    let master = RedisProcess::start();
    // The sentinel requires the password sluice is given (SLUICE_REDIS__SENTINEL__PASSWORD).
    let sentinel = SentinelProcess::start(master.port, 1, Some("sentinel-topsecret"));
    let sluice = Sluice::start(&sentinel_env("no-such-master", sentinel.url()));
    assert!(
        sluice
            .logs(
                "the sentinels know no master named \\\"no-such-master\\\"",
                Duration::from_secs(10)
            )
            .await,
        "{}",
        sluice.log()
    );
    sluice.answers_by_policy().await;
    assert!(!sluice.log().contains("topsecret"));
    // The same sentinel, asked for the right name, leads to the master.
    let right = Sluice::start(&sentinel_env(MASTER, sentinel.url()));
    assert!(
        right
            .logs("redis sentinel: master found", Duration::from_secs(10))
            .await,
        "{}",
        right.log()
    );
    assert!(right.log().contains(&format!("127.0.0.1:{}", master.port)));
}
