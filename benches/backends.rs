//! Decisions per second of the two backends, store level (no gRPC): the in-memory store and the
//! Redis script against a `redis-server` this benchmark starts on a free loopback port. Each
//! decision is one request of one descriptor over 100,000 keys, from 64 concurrent tasks on a
//! 2-thread runtime, for 5 seconds each. Run with `cargo bench --bench backends` (needs
//! `redis-server` on the PATH for the Redis figure); numbers go in BENCHMARKS.md.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sluice::limiter::gcra::NANOS_PER_SEC;
use sluice::limiter::redis::{RedisAuth, RedisTls};
use sluice::limiter::{
    Backend, Charge, KeyBuilder, MemoryStore, Mode, MonotonicClock, Op, Quota, RedisConfig,
    RedisStore, RedisTime,
};

const TASKS: u64 = 64;
const KEYS: u64 = 100_000;
const RUN: Duration = Duration::from_secs(5);

fn op(i: u64) -> Op {
    Op {
        key: KeyBuilder::new(3).part(&i.to_le_bytes()).finish(),
        quota: Quota::new(NANOS_PER_SEC, 1_000, 1_000).expect("valid quota"),
        cost: 1,
        charge: Charge::Ask,
        mode: Mode::Enforce,
    }
}

/// Runs `decide` from `TASKS` tasks for `RUN`; returns decisions per second and the mean latency.
async fn drive<F, Fut>(decide: F) -> (f64, Duration)
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let decide = Arc::new(decide);
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let (decide, stop, done, failed) =
                (decide.clone(), stop.clone(), done.clone(), failed.clone());
            tokio::spawn(async move {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    i = (i + 7_919) % KEYS;
                    if decide(i).await {
                        done.fetch_add(1, Ordering::Relaxed);
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                    // The memory backend never waits: yield so the timer and others get run.
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let elapsed = started.elapsed();
    let n = done.load(Ordering::Relaxed);
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "backend errors during the run"
    );
    let rate = n as f64 / elapsed.as_secs_f64();
    (rate, elapsed.mul_f64(TASKS as f64 / n.max(1) as f64))
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let memory = Backend::memory(MemoryStore::new(), Arc::new(MonotonicClock::new()));
        let (rate, latency) = drive(move |i| {
            let memory = memory.clone();
            async move { memory.count(&[op(i)]).await.is_ok() }
        })
        .await;
        println!("backends: memory: {rate:.0} decisions/s, mean latency {latency:?} with {TASKS} in flight");

        let port = TcpListener::bind("127.0.0.1:0").expect("free port").local_addr().expect("addr").port();
        let dir = std::env::temp_dir().join(format!("sluice-bench-redis-{port}"));
        let _ = std::fs::create_dir_all(&dir);
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let Ok(mut child) = child else {
            println!("backends: redis: redis-server not found; nothing measured");
            return;
        };
        let store = RedisStore::new(RedisConfig {
            urls: vec![format!("redis://127.0.0.1:{port}")],
            cluster: false,
            key_prefix: "bench:".into(),
            timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(1),
            breaker_failures: 0,
            breaker_cooldown: Duration::from_secs(1),
            deny_cache_keys: 0,
            sentinel: None,
            tls: RedisTls::default(),
            auth: RedisAuth::default(),
        }, Arc::new(MonotonicClock::new()), RedisTime::Server)
        .expect("valid url");
        let connecting = tokio::spawn({
            let store = Arc::clone(&store);
            async move { store.connect().await }
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        while !store.is_connected() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        connecting.abort();
        let redis = Backend::Redis(Arc::clone(&store));
        let (rate, latency) = drive(move |i| {
            let redis = redis.clone();
            async move { redis.count(&[op(i)]).await.is_ok() }
        })
        .await;
        println!(
            "backends: redis: {rate:.0} decisions/s, mean latency {latency:?} with {TASKS} in flight, {} round trips",
            store.figures().round_trips
        );
        let _ = child.kill();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(&dir);
    });
}
