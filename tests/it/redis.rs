//! The Redis backend against real `redis-server`s: decisions identical to the in-memory
//! store's (P17 of `docs/gcra-properties.md`), one budget shared by two servers, one round trip
//! per request, and fast, configured answers while Redis is down.
//! Skips without `redis-server` unless `CI` is set (`helpers::redis_missing`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::decision::OnBackendError;
use sluice::limiter::gcra::NANOS_PER_SEC;
use sluice::limiter::redis::fits_lean;
use sluice::limiter::redis::fleet::{FleetAsk, RULES_PER_CALL, RuleRenewal};
use sluice::limiter::{
    Batch, Charge, Clock, LeaseConfig, LeasedStore, ManualClock, MemoryStore, Mode, MonotonicClock,
    Op, Quota, RedisConfig, RedisStore, RedisTime,
};
use sluice::pb::rate_limit_response::Code;
use sluice::settings::BackendKind;

use crate::helpers::redis::{RedisCluster, RedisProcess, config};
use crate::helpers::{
    Lcg, TestServer, descriptor, eventually, metric, redis_missing, request, single,
};

const SEC: u64 = NANOS_PER_SEC;

/// A store deciding at Redis `TIME`, connecting in the background.
fn open(config: RedisConfig) -> Arc<RedisStore> {
    let store = RedisStore::new(config, Arc::new(ManualClock::new(0)), RedisTime::Server).unwrap();
    spawn_connect(&store);
    store
}

/// A store deciding at `clock`'s time (set by the test before each call).
fn open_at(config: RedisConfig, clock: &Arc<ManualClock>) -> Arc<RedisStore> {
    let store = RedisStore::new(config, clock.clone(), RedisTime::Clock).unwrap();
    spawn_connect(&store);
    store
}

/// A connected store on a redis-server of its own, its keys under `prefix`, deciding at the
/// returned clock's time (starting at `start`). Its calls may take 5 s, not 200 ms: these tests
/// compare answers, and a request of thousands of counters on a busy test machine can take
/// longer than 200 ms to decide.
async fn store_at(prefix: &str, start: u64) -> (RedisProcess, Arc<ManualClock>, Arc<RedisStore>) {
    let redis = RedisProcess::start();
    let clock = Arc::new(ManualClock::new(start));
    let mut config = config(&redis.url());
    config.key_prefix = prefix.into();
    config.timeout = Duration::from_secs(5);
    let store = open_at(config, &clock);
    connected(&store).await;
    (redis, clock, store)
}

/// A connected store on a three-master cluster of its own, deciding at the returned clock's
/// time (starting at 0).
async fn cluster_store() -> (RedisCluster, Arc<ManualClock>, Arc<RedisStore>) {
    let cluster = RedisCluster::start();
    let mut config = config("");
    config.urls = cluster.urls();
    config.cluster = true;
    config.timeout = Duration::from_secs(2);
    let clock = Arc::new(ManualClock::new(0));
    let store = open_at(config, &clock);
    connected(&store).await;
    (cluster, clock, store)
}

fn spawn_connect(store: &Arc<RedisStore>) {
    let store = Arc::clone(store);
    tokio::spawn(async move { store.connect().await });
}

async fn connected(store: &Arc<RedisStore>) {
    let s = Arc::clone(store);
    assert!(
        eventually(Duration::from_secs(5), || {
            let s = Arc::clone(&s);
            async move { s.is_connected() }
        })
        .await
    );
}

/// P17: the same (time, keys, costs, modes) schedule gives the same decisions, remaining counts
/// and waits from the memory store and from the script in Redis, including costs above the
/// burst, check-only costs, refunds, spend recorded past the bucket, bans, shadow and quota
/// modes, repeated keys in one request, and periods long enough that nanosecond times exceed a
/// double's exact range.
#[tokio::test]
async fn same_schedule_same_decisions_as_memory() {
    if redis_missing("same_schedule_same_decisions_as_memory") {
        return;
    }
    let redis = RedisProcess::start();
    let clock = Arc::new(ManualClock::new(0));
    let store = open_at(config(&redis.url()), &clock);
    connected(&store).await;
    same_decisions(&store, &clock, 400).await;
    assert_eq!(
        store.figures().round_trips,
        400,
        "one round trip per request"
    );
}

/// The same against a 3-master Redis Cluster: requests whose counters sit in different hash
/// slots (on different masters) are decided per slot and compensated, and still end exactly as
/// the memory store's all-or-nothing decisions.
#[tokio::test]
async fn cluster_same_schedule_same_decisions_as_memory() {
    if redis_missing("cluster_same_schedule_same_decisions_as_memory") {
        return;
    }
    let (_cluster, clock, store) = cluster_store().await;
    same_decisions(&store, &clock, 300).await;
}

/// The same against the lean script alone: every quota's tolerance is under its bound (the year
/// long one is replaced by a week-long one), so every call goes to `gcra_lean.lua`.
#[tokio::test]
async fn the_lean_script_gives_the_same_decisions_as_memory() {
    if redis_missing("the_lean_script_gives_the_same_decisions_as_memory") {
        return;
    }
    let (_redis, clock, store) = store_at("lean:", 0).await;
    let lean = run_schedule(&store, &clock, 400, lean_quotas()).await;
    assert_eq!(lean, 400, "every request fits the lean script");
}

/// Requests of hundreds of descriptors, on both sides of the lean script's 256-op switch from
/// one unpack of its arguments to one per op, and one of 9,000, more counters than one unpack
/// can hand `MGET` (about 8,000), with a reply of 27,001 values: plain charges, then a mix of
/// refunds, spend recorded, shadow and quota ops and repeated counters (the general path), each
/// answer the memory store's.
#[tokio::test]
async fn requests_of_hundreds_of_descriptors_decide_as_in_memory() {
    if redis_missing("requests_of_hundreds_of_descriptors_decide_as_in_memory") {
        return;
    }
    let (_redis, clock, store) = store_at("wide:", 0).await;
    let quotas = lean_quotas();
    let memory = MemoryStore::new();
    let mut rng = Lcg(0x31de);
    let mut now = 1_800_000_000 * SEC;
    for (round, n) in [256_usize, 300, 9_000, 256, 300, 300, 300]
        .into_iter()
        .enumerate()
    {
        let mixed = round >= 3;
        let ops: Vec<Op> = (0..n)
            .map(|i| {
                let q = if mixed { rng.next(4) as usize } else { i % 2 };
                Op {
                    key: if mixed {
                        1 + u128::from(rng.next(200))
                    } else {
                        i as u128 + 1
                    },
                    quota: quotas[q],
                    cost: if mixed { rng.next(3) } else { 1 },
                    charge: match (mixed, rng.next(5)) {
                        (true, 0) => Charge::Refund,
                        (true, 1) => Charge::Spent,
                        _ => Charge::Ask,
                    },
                    mode: match (mixed, rng.next(4)) {
                        (true, 0) => Mode::Shadow,
                        (true, 1) => Mode::Quota,
                        _ => Mode::Enforce,
                    },
                }
            })
            .collect();
        assert!(fits_lean(&ops));
        now += SEC / 2;
        clock.set(now);
        let expected = memory.count_batch(&ops, now);
        let got = store.count_batch(&ops).await.unwrap();
        assert_eq!(got.blocked, expected.blocked, "round {round}");
        let triples = |b: &sluice::limiter::Batch| -> Vec<(bool, u64, u64)> {
            b.outcomes
                .iter()
                .map(|o| (o.admitted, o.remaining, o.wait))
                .collect()
        };
        let (g, e) = (triples(&got), triples(&expected));
        if let Some(i) = (0..n).find(|&i| g[i] != e[i]) {
            panic!(
                "round {round}, op {i} of {n}: {:?} against {:?}",
                g[i], e[i]
            );
        }
    }
}

/// Parity over the coalesced path: 32 clients each run their own random schedule on their own
/// counters, all at once, one step per round at a shared instant, so their requests queue and
/// leave Redis together; every answer is the memory store's for that client's schedule, and
/// calls carry several requests each.
#[tokio::test]
async fn coalesced_requests_give_the_same_decisions_as_memory() {
    if redis_missing("coalesced_requests_give_the_same_decisions_as_memory") {
        return;
    }
    const CLIENTS: u128 = 32;
    let (_redis, clock, store) = store_at("coalesce:", 0).await;
    let quotas = lean_quotas();
    let memories: Vec<MemoryStore> = (0..CLIENTS).map(|_| MemoryStore::new()).collect();
    let mut rngs: Vec<Lcg> = (0..CLIENTS).map(|c| Lcg(0x5eed + c as u64)).collect();
    let mut now = 1_800_000_000 * SEC;
    for step in 0..60 {
        now += [0, 999, SEC / 3, 7 * SEC][step % 4];
        clock.set(now);
        let schedules: Vec<Vec<Op>> = rngs
            .iter_mut()
            .enumerate()
            .map(|(c, rng)| random_ops(rng, &quotas, c as u128 * 100))
            .collect();
        clients_as_in_memory(
            &store,
            &memories,
            &schedules,
            now,
            true,
            &format!("step {step}"),
        )
        .await;
    }
    let figures = store.figures();
    assert_eq!(figures.requests, 60 * CLIENTS as u64);
    assert!(
        figures.round_trips * 2 < figures.requests,
        "{} round trips for {} requests: coalesced",
        figures.round_trips,
        figures.requests
    );
}

/// Coalesced requests on one counter see each other's charges: 64 at one instant on a bucket of
/// 10 admit exactly 10, which report 9, 8, ..., 0 remaining, and refuse the rest.
#[tokio::test]
async fn coalesced_requests_on_one_counter_admit_exactly_the_burst() {
    if redis_missing("coalesced_requests_on_one_counter_admit_exactly_the_burst") {
        return;
    }
    let (_redis, _clock, store) = store_at("coalesce-one:", 1_800_000_000 * SEC).await;
    let op = [Op {
        key: 42,
        quota: Quota::new(3_600 * SEC, 10, 10).unwrap(),
        cost: 1,
        charge: Charge::Ask,
        mode: Mode::Enforce,
    }];
    let answers = futures_util::future::join_all((0..64).map(|_| store.count_batch(&op))).await;
    let mut remaining: Vec<u64> = answers
        .iter()
        .map(|a| a.as_ref().unwrap())
        .filter(|b| !b.blocked)
        .map(|b| b.outcomes[0].remaining)
        .collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..10).collect::<Vec<u64>>());
    assert!(store.figures().round_trips < 64, "{:?}", store.figures());
}

/// Decisions on the edge of a bucket: after each step the clock moves to the end of the longest
/// wait one client was told, or 1 ns before it, and that client sends its refused request again:
/// it is decided at the instant it fits and at the instant before. Four clients, each on counters
/// of its own, send requests of one to three plain charges, on distinct counters or not, at once
/// (coalesced into one call) or one after the other (each alone): every path of the lean script.
/// Every answer is the memory store's: a decision one nanosecond off in any of those paths fails
/// here.
#[tokio::test]
async fn decisions_at_the_end_of_a_wait_and_1_ns_before_are_the_memory_stores() {
    if redis_missing("decisions_at_the_end_of_a_wait_and_1_ns_before_are_the_memory_stores") {
        return;
    }
    const CLIENTS: usize = 4;
    let (_redis, clock, store) = store_at("edge:", 0).await;
    // Bursts of 3, 4 and 7 (T = 333,333,334 ns, 6 s and a day) against costs of 1 to 3: many
    // requests are refused, with waits from nanoseconds to days.
    let quotas = &lean_quotas()[..3];
    let memories: Vec<MemoryStore> = (0..CLIENTS).map(|_| MemoryStore::new()).collect();
    let mut rng = Lcg(0xed9e);
    let mut now = 1_800_000_000 * SEC + 987_654_321;
    let (mut edges, mut lone_plain) = (0, 0);
    let mut again: Option<(usize, Vec<Op>)> = None;
    for step in 0..400 {
        clock.set(now);
        let requests: Vec<Vec<Op>> = (0..CLIENTS)
            .map(|c| match &again {
                Some((a, ops)) if *a == c => ops.clone(),
                _ => (0..1 + rng.next(3))
                    .map(|_| {
                        let k = rng.next(3) as usize;
                        Op {
                            key: (c * 10 + k + 1) as u128,
                            quota: quotas[k],
                            cost: 1 + rng.next(3),
                            charge: Charge::Ask,
                            mode: Mode::Enforce,
                        }
                    })
                    .collect(),
            })
            .collect();
        // Every other step the requests go one after the other, each alone in its call.
        let at_once = step % 2 == 0;
        let expected = clients_as_in_memory(
            &store,
            &memories,
            &requests,
            now,
            at_once,
            &format!("step {step}"),
        )
        .await;
        let mut waits = Vec::new();
        for (ops, expected) in requests.iter().zip(expected) {
            let distinct = ops
                .iter()
                .all(|o| ops.iter().filter(|p| p.key == o.key).count() == 1);
            lone_plain += usize::from(ops.len() > 1 && distinct);
            waits.push(
                expected
                    .outcomes
                    .iter()
                    .filter(|o| !o.admitted)
                    .map(|o| o.wait)
                    .max(),
            );
        }
        let c = step % CLIENTS;
        again = None;
        now += match waits[c] {
            Some(wait) if wait > 0 => {
                edges += 1;
                again = Some((c, requests[c].clone()));
                wait - rng.next(2)
            }
            _ => rng.next(SEC),
        };
    }
    assert!(edges > 100, "{edges} steps moved to the edge of a wait");
    assert!(
        lone_plain > 400,
        "{lone_plain} requests of several plain charges"
    );
    let figures = store.figures();
    assert!(
        figures.round_trips < figures.requests,
        "some requests coalesced: {figures:?}"
    );
}

/// One to three ops of the random schedules, on counters `base + 1 ..= base + 5`.
fn random_ops(rng: &mut Lcg, quotas: &[Quota; 5], base: u128) -> Vec<Op> {
    let n = 1 + rng.next(3) as usize;
    (0..n)
        .map(|_| {
            let k = rng.next(5) as usize;
            Op {
                key: base + k as u128 + 1,
                quota: quotas[k],
                cost: match rng.next(6) {
                    0 => 0,
                    1 => 1 + rng.next(10),
                    2 => u64::from(u32::MAX),
                    _ => 1,
                },
                charge: match rng.next(8) {
                    0 => Charge::Refund,
                    1 => Charge::Spent,
                    _ => Charge::Ask,
                },
                mode: match rng.next(6) {
                    0 => Mode::Shadow,
                    1 => Mode::Quota,
                    _ => Mode::Enforce,
                },
            }
        })
        .collect()
}

/// The quotas of the parity schedules.
/// [`quotas`] with the year-long one replaced by a week-long one: every op fits the lean script
/// (a week's bucket and four weeks of debt stay below 2^52 ns), the delaying one included.
fn lean_quotas() -> [Quota; 5] {
    let mut quotas = quotas();
    quotas[2] = Quota::new(7 * 86_400 * SEC, 7, 7).unwrap();
    quotas
}

fn quotas() -> [Quota; 5] {
    [
        Quota::new(SEC, 3, 3).unwrap(), // T = 333,333,334 ns
        // T = 6 s, B = 4, admitted at a slot up to 15 s ahead.
        Quota::new(60 * SEC, 10, 4)
            .unwrap()
            .with_max_delay(15 * SEC),
        Quota::new(365 * 86_400 * SEC, 7, 7).unwrap(), // a year: beyond 2^53 ns, exact script
        Quota::new(3_600 * SEC, 1_000_000, 500_000).unwrap(), // T = 3.6 ms
        Quota::ban(SEC),
    ]
}

async fn same_decisions(store: &RedisStore, clock: &ManualClock, steps: usize) {
    let lean = run_schedule(store, clock, steps, quotas()).await;
    assert!(
        lean > 0 && lean < steps,
        "both scripts are exercised: {lean} of {steps} requests were lean"
    );
}

/// Runs the random schedule against `store` and the memory store, comparing every answer;
/// returns how many requests fitted the lean script.
async fn run_schedule(
    store: &RedisStore,
    clock: &ManualClock,
    steps: usize,
    quotas: [Quota; 5],
) -> usize {
    let mut lean = 0;
    let memory = MemoryStore::new();
    let mut rng = Lcg(0x5eed);
    // Start far from zero, as Redis TIME would be (about 1.8e18 ns).
    let mut now = 1_800_000_000 * SEC + 123_456_789;
    for step in 0..steps {
        now += match rng.next(4) {
            0 => 0,
            1 => rng.next(1_000),
            2 => rng.next(2 * SEC),
            _ => rng.next(3 * 86_400 * SEC),
        };
        let ops = random_ops(&mut rng, &quotas, 0);
        lean += usize::from(fits_lean(&ops));
        let expected = memory.count_batch(&ops, now);
        clock.set(now);
        let got = store.count_batch(&ops).await.unwrap();
        assert_same(&got, &expected, &ops, &format!("step {step}"));
    }
    lean
}

/// Sends each client's request to `store`, all at once (coalesced into one call) or one after
/// the other (each alone), and asserts that every answer is the one that client's memory store
/// gives at `now`; returns the memory stores' answers, in the clients' order.
async fn clients_as_in_memory(
    store: &RedisStore,
    memories: &[MemoryStore],
    requests: &[Vec<Op>],
    now: u64,
    at_once: bool,
    at: &str,
) -> Vec<Batch> {
    let answers = if at_once {
        futures_util::future::join_all(requests.iter().map(|ops| store.count_batch(ops))).await
    } else {
        let mut answers = Vec::new();
        for ops in requests {
            answers.push(store.count_batch(ops).await);
        }
        answers
    };
    let mut expected = Vec::with_capacity(requests.len());
    for (c, (ops, got)) in requests.iter().zip(answers).enumerate() {
        let e = memories[c].count_batch(ops, now);
        assert_same(&got.unwrap(), &e, ops, &format!("client {c}, {at}"));
        expected.push(e);
    }
    expected
}

/// Asserts that Redis's answer `got` to `ops` is the memory store's, `expected`, op by op;
/// `at` names the step in a failure.
fn assert_same(got: &Batch, expected: &Batch, ops: &[Op], at: &str) {
    assert_eq!(got.blocked, expected.blocked, "{at}: {ops:?}");
    assert_eq!(got.outcomes.len(), ops.len(), "{at}: an outcome per op");
    for (i, (g, e)) in got.outcomes.iter().zip(&expected.outcomes).enumerate() {
        assert_eq!(
            (g.admitted, g.remaining, g.wait, g.hold),
            (e.admitted, e.remaining, e.wait, e.hold),
            "{at}, op {i}: {:?}",
            ops[i]
        );
    }
}

async fn redis_server(url: &str, on_error: OnBackendError) -> TestServer {
    redis_server_with(url, false, on_error).await
}

async fn redis_server_with(url: &str, cluster: bool, on_error: OnBackendError) -> TestServer {
    let url = url.to_string();
    let s = TestServer::start_with(
        &[("r.yaml", "domain: shared\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 10}\n  - key: j\n    rate_limit: {unit: hour, requests_per_unit: 100}\n")],
        move |settings| {
            settings.backend = BackendKind::Redis;
            settings.redis.url = url;
            settings.redis.cluster = cluster;
            settings.redis.timeout_ms = if cluster { 2_000 } else { 50 };
            settings.redis.connect_timeout_ms = 100;
            settings.redis.breaker_failures = 3;
            settings.redis.breaker_cooldown_ms = 200;
            settings.on_backend_error = on_error;
        },
    )
    .await;
    assert!(
        eventually(Duration::from_secs(5), || async {
            // Calls that time out on a busy machine may open the breaker; its cool-down runs on
            // the server's clock, driven here.
            s.clock.advance(200_000_000);
            s.call(single("shared", "j", "warmup")).await.is_ok()
        })
        .await,
        "server never reached redis"
    );
    s
}

#[tokio::test]
async fn two_servers_share_one_budget() {
    if redis_missing("two_servers_share_one_budget") {
        return;
    }
    let redis = RedisProcess::start();
    let a = redis_server(&redis.url(), OnBackendError::Error).await;
    let b = redis_server(&redis.url(), OnBackendError::Error).await;
    let mut admitted = 0;
    for i in 0..30 {
        let s = if i % 2 == 0 { &a } else { &b };
        let r = s.ok(single("shared", "k", "client-1")).await;
        if r.overall_code == Code::Ok as i32 {
            admitted += 1;
        }
    }
    assert_eq!(
        admitted, 10,
        "a burst split across two servers admits B in total"
    );
}

#[tokio::test]
async fn one_round_trip_per_request() {
    if redis_missing("one_round_trip_per_request") {
        return;
    }
    let redis = RedisProcess::start();
    let mut config = config(&redis.url());
    config.key_prefix = "rt:".into();
    let store = open(config);
    connected(&store).await;
    let q = Quota::new(3_600 * SEC, 100, 100).unwrap();
    let ops: Vec<Op> = (1..=10u128)
        .map(|key| Op {
            key,
            quota: q,
            cost: 1,
            charge: Charge::Ask,
            mode: Mode::Enforce,
        })
        .collect();
    for i in 1..=5 {
        let b = store.count_batch(&ops).await.unwrap();
        assert!(!b.blocked);
        assert_eq!(
            store.figures().round_trips,
            i,
            "ten descriptors, one round trip"
        );
    }
    // And through the server: one ShouldRateLimit with three descriptors, one round trip.
    let s = redis_server(&redis.url(), OnBackendError::Error).await;
    let trips = || async {
        metric(s.admin, "sluice_redis_round_trips_total")
            .await
            .unwrap_or(-1.0)
    };
    let before = trips().await;
    let r = s
        .ok(request(
            "shared",
            vec![
                descriptor(&[("k", "x")]),
                descriptor(&[("j", "y")]),
                descriptor(&[("k", "z")]),
            ],
        ))
        .await;
    assert_eq!(r.statuses.len(), 3);
    assert_eq!(trips().await, before + 1.0);
}

/// Every counter written at Redis time expires at its TAT's millisecond (floor): Redis deletes a
/// key only once its clock has passed that millisecond, so a key is never gone while its TAT is
/// ahead, and it outlives its TAT by less than a millisecond. Covers the lean script's
/// one-charge path, a multi-descriptor request and a coalesced batch, the exact script, and a
/// lease's take and give-back.
#[tokio::test]
async fn stored_counters_expire_at_their_tat() {
    if redis_missing("stored_counters_expire_at_their_tat") {
        return;
    }
    let redis = RedisProcess::start();
    let settings = || {
        let mut c = config(&redis.url());
        c.key_prefix = "ttl:".into();
        c
    };
    let store = open(settings());
    connected(&store).await;
    let op = |key: u128, quota: Quota, cost: u64| Op {
        key,
        quota,
        cost,
        charge: Charge::Ask,
        mode: Mode::Enforce,
    };
    // Every debt is a minute or more, so no key expires while the test reads them.
    let sixty = Quota::new(3_600 * SEC, 60, 60).unwrap(); // T = 60 s
    let seven = Quota::new(3_600 * SEC, 7, 7).unwrap(); // T = 514 s
    store.count_batch(&[op(1, sixty, 1)]).await.unwrap();
    store
        .count_batch(&[op(2, sixty, 3), op(3, seven, 2)])
        .await
        .unwrap();
    let batch: Vec<Vec<Op>> = (4..20u128)
        .map(|k| vec![op(k, sixty, 1 + (k % 5) as u64), op(100 + k, seven, 1)])
        .collect();
    for b in futures_util::future::join_all(batch.iter().map(|ops| store.count_batch(ops))).await {
        assert!(!b.unwrap().blocked);
    }
    // A bucket beyond 2^52 ns goes to the exact script.
    let year = Quota::new(365 * 86_400 * SEC, 7, 7).unwrap(); // T = 52 days
    assert!(!fits_lean(&[op(200, year, 1)]));
    store.count_batch(&[op(200, year, 1)]).await.unwrap();
    // A node that leases a counter from its first hit: its take, then the give-back at close,
    // are the last writes of counters 300 to 307 (eight, as a TTL counted from the script's
    // start lands on the TAT's millisecond about half the time).
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let shared = RedisStore::new(settings(), Arc::clone(&clock), RedisTime::Server).unwrap();
    spawn_connect(&shared);
    connected(&shared).await;
    let leasing = LeaseConfig {
        min_rate: 1,
        ..LeaseConfig::default()
    };
    let node = LeasedStore::new(shared, leasing, clock);
    for key in 300..308 {
        node.count_batch(&[op(key, sixty, 1)]).await.unwrap();
    }
    node.settle(Duration::from_secs(2)).await;
    assert!(node.figures().slices > 0, "{:?}", node.figures());
    node.close().await;
    assert!(node.figures().tokens_returned > 0, "{:?}", node.figures());
    let cli = |args: &[&str]| redis.cli(args);
    let keys: Vec<String> = cli(&["--scan", "--pattern", "ttl:*"])
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(keys.len(), 3 + 2 * 16 + 1 + 8, "{keys:?}");
    for key in &keys {
        let (tat, at) = (cli(&["GET", key]), cli(&["PEXPIRETIME", key]));
        let (tat, at): (u128, u128) = match (tat.trim().parse(), at.trim().parse()) {
            (Ok(tat), Ok(at)) => (tat, at),
            _ => panic!("{key}: GET {tat:?}, PEXPIRETIME {at:?}"),
        };
        assert_expires_after(tat, at, key);
    }
}

#[tokio::test]
async fn redis_down_answers_fast_with_the_configured_answer_and_recovers() {
    if redis_missing("redis_down_answers_fast_with_the_configured_answer_and_recovers") {
        return;
    }
    let mut redis = RedisProcess::start();
    let port = redis.port;
    let allow = redis_server(&redis.url(), OnBackendError::Allow).await;
    let error = redis_server(&redis.url(), OnBackendError::Error).await;
    let deny = redis_server(&redis.url(), OnBackendError::Deny).await;
    assert_eq!(
        allow.ok(single("shared", "j", "a")).await.overall_code,
        Code::Ok as i32
    );
    // Kill Redis under load: 8 clients keep calling the fail-open server meanwhile.
    let load: Vec<_> = (0..8)
        .map(|c| {
            let mut client = allow.client.clone();
            tokio::spawn(async move {
                let mut slowest = Duration::ZERO;
                for i in 0..100 {
                    let started = Instant::now();
                    let r = client
                        .should_rate_limit(single("shared", "j", &format!("load-{c}-{i}")))
                        .await
                        .expect("answered")
                        .into_inner();
                    assert_eq!(r.overall_code, Code::Ok as i32);
                    slowest = slowest.max(started.elapsed());
                }
                slowest
            })
        })
        .collect();
    redis.kill();
    for task in load {
        let slowest = task.await.unwrap();
        // The deadline is 50 ms; allow scheduling slack on a shared 2-core machine.
        assert!(
            slowest < Duration::from_millis(500),
            "a call took {slowest:?}"
        );
    }
    for _ in 0..50 {
        let started = Instant::now();
        let r = allow.ok(single("shared", "j", "a")).await;
        assert_eq!(r.overall_code, Code::Ok as i32, "fail open");
        let e = error.call(single("shared", "j", "a")).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        let d = deny.ok(single("shared", "j", "a")).await;
        assert_eq!(d.overall_code, Code::OverLimit as i32, "fail closed");
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "three answers took {:?}",
            started.elapsed()
        );
    }
    // The failures were counted by kind, and the breaker opened.
    let mut failures = 0.0;
    for kind in ["timeout", "connection", "breaker_open"] {
        let series = format!("sluice_redis_errors_total{{kind=\"{kind}\"}}");
        failures += metric(error.admin, &series).await.unwrap_or(0.0);
    }
    assert!(failures >= 50.0, "{failures} failures counted");
    let breaker_open = "sluice_redis_errors_total{kind=\"breaker_open\"}";
    assert!(
        metric(error.admin, breaker_open).await.unwrap_or(0.0) > 0.0,
        "the breaker opened"
    );
    // Redis back on the same port: decisions resume without restarting sluice, once the
    // breaker's cool-down (200 ms of the server's clock, driven here by hand) has passed.
    let _redis = RedisProcess::start_on(port);
    assert!(
        eventually(Duration::from_secs(10), || async {
            error.clock.advance(200_000_000);
            error
                .call(single("shared", "j", "b"))
                .await
                .is_ok_and(|r| r.statuses[0].current_limit.is_some())
        })
        .await,
        "decisions did not resume"
    );
}

#[tokio::test]
async fn two_servers_share_one_cluster_budget_across_slots() {
    if redis_missing("two_servers_share_one_cluster_budget_across_slots") {
        return;
    }
    let cluster = RedisCluster::start();
    let urls = cluster.urls().join(",");
    let a = redis_server_with(&urls, true, OnBackendError::Error).await;
    let b = redis_server_with(&urls, true, OnBackendError::Error).await;
    // Two descriptors whose counters hash to different slots; `k` allows 10, `j` 100.
    let both = || {
        request(
            "shared",
            vec![descriptor(&[("k", "cross")]), descriptor(&[("j", "cross")])],
        )
    };
    let mut admitted = 0;
    for i in 0..30 {
        let s = if i % 2 == 0 { &a } else { &b };
        if s.ok(both()).await.overall_code == Code::Ok as i32 {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 10, "B of the narrower limit, across both servers");
    // All or nothing across slots: the 20 refused requests charged nothing on `j`.
    let r = a.ok(single("shared", "j", "cross")).await;
    assert_eq!(r.statuses[0].limit_remaining, 100 - 10 - 1);
}

/// The local over-limit cache answers a counter Redis found out of tokens without a round trip,
/// with the answer Redis itself would give, and lets requests through to Redis once the counter
/// can fit again.
#[tokio::test]
async fn local_cache_answers_repeat_offenders_exactly() {
    if redis_missing("local_cache_answers_repeat_offenders_exactly") {
        return;
    }
    let redis = RedisProcess::start();
    let mut cached = config(&redis.url());
    cached.deny_cache_keys = 100;
    let clock = Arc::new(ManualClock::new(0));
    let store = open_at(cached, &clock);
    let plain = open_at(config(&redis.url()), &clock);
    connected(&store).await;
    connected(&plain).await;
    let q = Quota::new(3_600 * SEC, 1, 1).unwrap();
    let ops = [Op {
        key: 77,
        quota: q,
        cost: 1,
        charge: Charge::Ask,
        mode: Mode::Enforce,
    }];
    let t0 = 1_800_000_000 * SEC;
    clock.set(t0);
    assert!(!store.count_batch(&ops).await.unwrap().blocked);
    assert!(store.count_batch(&ops).await.unwrap().blocked);
    assert_eq!(store.figures().round_trips, 2);
    for later in [SEC, 1_800 * SEC, 3_600 * SEC - 1] {
        clock.set(t0 + later);
        let from_cache = store.count_batch(&ops).await.unwrap();
        let from_redis = plain.count_batch(&ops).await.unwrap();
        assert_eq!(from_cache, from_redis, "at t0 + {later} ns");
    }
    assert_eq!(store.figures().round_trips, 2, "answered locally");
    assert_eq!(store.figures().cache_hits, 3);
    // Once a token is back, the request goes to Redis and is admitted.
    clock.set(t0 + 3_600 * SEC);
    assert!(!store.count_batch(&ops).await.unwrap().blocked);
    assert_eq!(store.figures().round_trips, 3);
}

/// A refund made through a node drops that node's cached denial: the refunded tokens are
/// admitted at once, exactly as with the cache off.
#[tokio::test]
async fn a_refund_is_not_hidden_by_the_local_cache() {
    if redis_missing("a_refund_is_not_hidden_by_the_local_cache") {
        return;
    }
    let redis = RedisProcess::start();
    let clock = Arc::new(ManualClock::new(1_800_000_000 * SEC));
    let admitted_after_refund = |deny_cache_keys: usize, key: u128| {
        let mut config = config(&redis.url());
        config.deny_cache_keys = deny_cache_keys;
        let store = open_at(config, &clock);
        async move {
            connected(&store).await;
            let q = Quota::new(3_600 * SEC, 10, 10).unwrap();
            let charge = |refund: bool, cost: u64| Op {
                key,
                quota: q,
                cost,
                charge: if refund { Charge::Refund } else { Charge::Ask },
                mode: Mode::Enforce,
            };
            for _ in 0..10 {
                assert!(
                    !store
                        .count_batch(&[charge(false, 1)])
                        .await
                        .unwrap()
                        .blocked
                );
            }
            assert!(
                store
                    .count_batch(&[charge(false, 1)])
                    .await
                    .unwrap()
                    .blocked
            );
            store.count_batch(&[charge(true, 10)]).await.unwrap();
            let mut admitted = 0;
            for _ in 0..12 {
                if !store
                    .count_batch(&[charge(false, 1)])
                    .await
                    .unwrap()
                    .blocked
                {
                    admitted += 1;
                }
            }
            admitted
        }
    };
    assert_eq!(admitted_after_refund(0, 901).await, 10, "without the cache");
    assert_eq!(admitted_after_refund(100, 902).await, 10, "with the cache");
}

const LAYERED: &str = r"
domain: layered
descriptors:
  - key: user
    rate_limits:
      - {name: per_minute, unit: minute, requests_per_unit: 4}
      - {name: per_day, unit: day, requests_per_unit: 6}
  - key: acct
    rate_limit: {name: budget, unit: hour, requests_per_unit: 100, burst: 20}
    descriptors:
      - key: route
        value: search
        cost: 10
      - key: route
        value: item
        cost: 1
";

#[tokio::test]
async fn rate_limits_and_cost_nodes_decide_alike_in_memory_and_redis() {
    if redis_missing("rate_limits_and_cost_nodes_decide_alike_in_memory_and_redis") {
        return;
    }
    let redis = RedisProcess::start();
    let url = redis.url();
    let on_redis = TestServer::start_with(&[("l.yaml", LAYERED)], move |settings| {
        settings.backend = BackendKind::Redis;
        settings.redis.url = url;
        settings.redis.timeout_ms = 2_000;
        settings.redis.connect_timeout_ms = 500;
    })
    .await;
    assert!(
        eventually(Duration::from_secs(5), || async {
            on_redis.clock.advance(200_000_000);
            on_redis
                .call(single("layered", "acct", "warmup"))
                .await
                .is_ok()
        })
        .await,
        "server never reached redis"
    );
    let in_memory = TestServer::start(&[("l.yaml", LAYERED)]).await;
    in_memory.ok(single("layered", "acct", "warmup")).await;
    // A fixed schedule mixing several limits on one node, cost nodes at two costs, the
    // request's hits_addend, refunds and two-descriptor requests. The limits are per minute and
    // longer, so the real time Redis counts in moves nothing across a whole token here.
    let mut denied_by = std::collections::BTreeSet::new();
    for i in 0..60usize {
        let user = format!("u{}", i % 3);
        let acct = format!("a{}", i % 2);
        let route = if i % 3 == 0 { "search" } else { "item" };
        let mut descs = vec![match i % 4 {
            0 => descriptor(&[("user", &user)]),
            _ => descriptor(&[("acct", &acct), ("route", route)]),
        }];
        if i % 5 == 0 {
            descs.push(descriptor(&[("user", &user)]));
        }
        if i % 7 == 6 {
            descs[0].is_negative_hits = true;
        }
        let mut req = request("layered", descs);
        req.hits_addend = u32::try_from(i % 3).unwrap();
        let (a, b) = (
            in_memory.ok(req.clone()).await,
            on_redis.ok(req.clone()).await,
        );
        assert_eq!(a.overall_code, b.overall_code, "step {i}: {req:?}");
        for st in a
            .statuses
            .iter()
            .filter(|s| s.code == Code::OverLimit as i32)
        {
            denied_by.insert(st.current_limit.as_ref().map(|l| l.name.clone()));
        }
        assert_eq!(a.statuses.len(), b.statuses.len());
        for (x, y) in a.statuses.iter().zip(&b.statuses) {
            assert_eq!(
                (x.code, &x.current_limit, x.limit_remaining),
                (y.code, &y.current_limit, y.limit_remaining),
                "step {i}: {req:?}"
            );
            let secs = |s: &sluice::pb::rate_limit_response::DescriptorStatus| {
                s.duration_until_reset.as_ref().map_or(0, |d| d.seconds)
            };
            assert!(
                (secs(x) - secs(y)).abs() <= 3,
                "step {i}: reset {} vs {}",
                secs(x),
                secs(y)
            );
        }
    }
    // The schedule reaches refusals by one of several limits and by a cost node's draw.
    let names: Vec<_> = denied_by.into_iter().flatten().collect();
    assert_eq!(names, ["budget", "per_minute"]);
}

/// Values no sluice node writes: not a number, not finite, empty, further ahead than any
/// bucket, and keys of other types (set by `redis-cli` arguments).
const CORRUPTIONS: [&[&str]; 8] = [
    &["SET", "garbage"],
    &["SET", "nan"],
    &["SET", "inf"],
    &["SET", ""],
    &["SET", "12abc456789012345"],
    &["SET", "99999999999999999999999999"],
    &["HSET", "f", "1"],
    &["RPUSH", "1"],
];

/// One corrupt counter is a fact about that counter, not an outage: on every script path (the
/// lean script's lone op, its multi-descriptor path and its batch path, the exact script for long
/// buckets, and a lease's take), a counter that holds no TAT is read as absent, the request is
/// decided, the key is left holding a TAT with its expiry (or gone), the repair is counted, and
/// the breaker stays closed for every other key.
#[tokio::test]
async fn a_corrupt_counter_is_repaired_and_other_keys_are_answered() {
    if redis_missing("a_corrupt_counter_is_repaired_and_other_keys_are_answered") {
        return;
    }
    let redis = RedisProcess::start();
    let mut settings = config(&redis.url());
    settings.key_prefix = "bad:".into();
    settings.timeout = Duration::from_secs(2);
    let store = open(settings.clone());
    connected(&store).await;
    let cli = |args: &[&str]| redis.cli(args).trim().to_string();
    let name = |key: u128| format!("bad:{key:032x}");
    let corrupt = |key: u128, how: &[&str]| {
        let key = name(key);
        cli(&["DEL", &key]);
        let mut args = vec![how[0], key.as_str()];
        args.extend_from_slice(&how[1..]);
        cli(&args);
    };
    let op = |key: u128, quota: Quota, cost: u64, mode: Mode, refund: bool| Op {
        key,
        quota,
        cost,
        charge: if refund { Charge::Refund } else { Charge::Ask },
        mode,
    };
    let ten = Quota::new(3_600 * SEC, 10, 10).unwrap();
    let year = Quota::new(365 * 86_400 * SEC, 7, 7).unwrap();
    assert!(!fits_lean(&[op(1, year, 1, Mode::Enforce, false)]));
    let mut repairs = 0;
    let mut key = 1_000u128;
    for how in CORRUPTIONS {
        // (what, the ops with the corrupt counter first, remaining expected of it)
        let paths: [(&str, Vec<Op>, u64); 4] = [
            ("one op", vec![op(key, ten, 2, Mode::Enforce, false)], 8),
            (
                "several plain ops",
                vec![
                    op(key + 1, ten, 3, Mode::Enforce, false),
                    op(key + 2, ten, 1, Mode::Enforce, false),
                ],
                7,
            ),
            (
                "the batch path",
                vec![
                    op(key + 3, ten, 1, Mode::Enforce, false),
                    op(key + 4, ten, 1, Mode::Shadow, false),
                ],
                9,
            ),
            (
                "the exact script",
                vec![op(key + 5, year, 1, Mode::Enforce, false)],
                6,
            ),
        ];
        for (what, ops, remaining) in paths {
            corrupt(ops[0].key, how);
            let batch = store
                .count_batch(&ops)
                .await
                .unwrap_or_else(|e| panic!("{how:?}, {what}: {}", e.detail()));
            assert!(!batch.blocked, "{how:?}, {what}");
            assert!(batch.outcomes[0].admitted, "{how:?}, {what}");
            assert_eq!(batch.outcomes[0].remaining, remaining, "{how:?}, {what}");
            // The key now holds a TAT that expires at its millisecond.
            let k = name(ops[0].key);
            let (tat, at) = (cli(&["GET", &k]), cli(&["PEXPIRETIME", &k]));
            let tat: u128 = tat
                .parse()
                .unwrap_or_else(|_| panic!("{how:?}, {what}: {tat:?}"));
            assert_expires_after(tat, at.parse().unwrap(), &format!("{how:?}, {what}"));
            repairs += 1;
            assert_eq!(store.figures().counter_repairs, repairs, "{how:?}, {what}");
        }
        key += 10;
    }
    // A denied or refunding request repairs too (it reads as absent and deletes the value).
    corrupt(key, &["SET", "garbage"]);
    let refund = [op(key, ten, 1, Mode::Enforce, true)];
    assert!(store.count_batch(&refund).await.unwrap().outcomes[0].admitted);
    assert_eq!(cli(&["EXISTS", &name(key)]), "0");
    repairs += 1;
    // A lease's take reads the counter as absent too.
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let shared = RedisStore::new(settings, Arc::clone(&clock), RedisTime::Server).unwrap();
    spawn_connect(&shared);
    connected(&shared).await;
    let leasing = LeaseConfig {
        min_rate: 1,
        ..LeaseConfig::default()
    };
    let node = LeasedStore::new(Arc::clone(&shared), leasing, clock);
    let leased = key + 1;
    corrupt(leased, &["HSET", "f", "1"]);
    for _ in 0..3 {
        let batch = node
            .count_batch(&[op(leased, ten, 1, Mode::Enforce, false)])
            .await
            .unwrap();
        assert!(batch.outcomes[0].admitted);
    }
    node.settle(Duration::from_secs(2)).await;
    assert!(node.figures().slices > 0, "{:?}", node.figures());
    assert_eq!(shared.figures().counter_repairs, 1);
    assert!(cli(&["GET", &name(leased)]).parse::<u128>().is_ok());
    node.close().await;
    // No call failed, and the breaker never opened.
    let figures = store.figures();
    assert_eq!(figures.counter_repairs, repairs);
    assert!(figures.errors.iter().all(|(_, n)| *n == 0), "{figures:?}");
    assert_eq!(figures.breaker, sluice::limiter::BreakerState::Closed);
}

/// The same through a whole server: with one counter corrupt, that counter and every other key
/// are answered, nothing reaches a client as an error, and the repair shows in the metrics.
#[tokio::test]
async fn a_server_answers_every_key_while_one_counter_is_corrupt() {
    if redis_missing("a_server_answers_every_key_while_one_counter_is_corrupt") {
        return;
    }
    let redis = RedisProcess::start();
    let s = redis_server(&redis.url(), OnBackendError::Error).await;
    let cli = |args: &[&str]| redis.cli(args).trim().to_string();
    let before = cli(&["--scan"]);
    s.call(single("shared", "k", "victim")).await.unwrap();
    // The key that call wrote (its counter), made garbage before each round.
    let after = cli(&["--scan"]);
    let victim: Vec<&str> = after.lines().filter(|k| !before.contains(k)).collect();
    assert_eq!(victim.len(), 1, "{before:?} then {after:?}");
    for round in 0..20 {
        for k in &victim {
            cli(&["SET", k, "garbage"]);
        }
        let r = s.call(single("shared", "k", "victim")).await;
        assert!(r.is_ok(), "round {round}: {r:?}");
        for other in 0..3 {
            let r = s
                .call(single("shared", "j", &format!("other-{other}")))
                .await;
            assert!(r.is_ok(), "round {round}, other {other}: {r:?}");
        }
    }
    assert_eq!(
        metric(s.admin, "sluice_redis_counter_repairs_total").await,
        Some(20.0 * victim.len() as f64)
    );
    assert_eq!(
        metric(s.admin, "sluice_redis_errors_total{kind=\"redis\"}").await,
        Some(0.0)
    );
}

/// What reaches a client when Redis refuses a call is in the product's words: no Redis error
/// text (which can quote script lines), only what failed; the log has Redis's own.
#[tokio::test]
async fn a_refused_call_reaches_the_client_in_the_products_words() {
    if redis_missing("a_refused_call_reaches_the_client_in_the_products_words") {
        return;
    }
    let redis = RedisProcess::start();
    let s = redis_server(&redis.url(), OnBackendError::Error).await;
    // Every write refused: "OOM command not allowed when used memory > 'maxmemory'".
    redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    redis.cli(&["CONFIG", "SET", "maxmemory", "1"]);
    let status = s
        .call(single("shared", "k", "refused"))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert_eq!(status.message(), "redis refused the rate-limit call");
    redis.cli(&["CONFIG", "SET", "maxmemory", "0"]);
    assert!(s.call(single("shared", "k", "refused")).await.is_ok());
}

/// This node's part of rule 7 under `q`, renewed with `demand` (or given up) in its fleet table.
async fn part_of(store: &RedisStore, q: Quota, demand: f64, ask: FleetAsk) -> u32 {
    let rule = RuleRenewal {
        counter: 7,
        quota: q,
        demand,
    };
    let mut answers = store.parts_call(&[rule], ask).await;
    assert_eq!(answers.len(), 1);
    answers.pop().unwrap().expect("answered")
}

const RENEW: FleetAsk = FleetAsk::Renew {
    lifetime: Duration::from_secs(10),
};

/// `fleet.lua` divides a rule among three holders as `limiter::share::divide` does: the small
/// demand met with its headroom, the two large ones splitting the rest by demand; a holder that
/// leaves frees its part, and a corrupt table is repaired, not obeyed.
#[tokio::test]
async fn the_quota_table_water_fills_as_divide_does() {
    if redis_missing("the_quota_table_water_fills_as_divide_does") {
        return;
    }
    let redis = RedisProcess::start();
    let q = Quota::new(SEC, 100, 100).unwrap();
    let mut holders = Vec::new();
    for _ in 0..3 {
        let store = open(config(&redis.url()));
        connected(&store).await;
        holders.push(store);
    }
    let demands = [300.0, 100.0, 20.0];
    let renew = |store: &Arc<RedisStore>, demand: f64, ask: FleetAsk| {
        let store = Arc::clone(store);
        async move { part_of(&store, q, demand, ask).await }
    };
    // Two rounds: in the first each is granted only what the ones before it left.
    let mut parts = [0.0; 3];
    for _ in 0..2 {
        for (i, store) in holders.iter().enumerate() {
            parts[i] = f64::from(renew(store, demands[i], RENEW).await) / 1e6;
        }
    }
    let expected = sluice::limiter::share::divide(&demands, 100.0);
    for (part, want) in parts.iter().zip(&expected) {
        assert!(
            (part * 100.0 - want).abs() < 0.01,
            "{parts:?} against {expected:?}"
        );
    }
    assert!(parts.iter().sum::<f64>() <= 1.0, "{parts:?}");
    // A holder that leaves frees its part for the others' next renewal.
    let left = renew(&holders[0], 0.0, FleetAsk::Leave).await;
    assert_eq!(left, 0);
    let grown = f64::from(renew(&holders[1], demands[1], RENEW).await) / 1e6;
    assert!((grown - 0.75).abs() < 1e-4, "{grown}");
    // A corrupt table is repaired, never obeyed: an entry claiming the whole rule until far
    // ahead, one that does not parse, then a key of another type.
    let table = format!("{{sluice-test:{:032x}}}:quotas", 7);
    redis.cli(&["HSET", &table, "squatter", "0 1000000 100 99999999999999"]);
    redis.cli(&["HSET", &table, "garbage", "not four numbers"]);
    let before = holders[1].figures().counter_repairs;
    let part = f64::from(renew(&holders[1], demands[1], RENEW).await) / 1e6;
    assert!(
        (part - 0.75).abs() < 1e-4,
        "the squatter is not obeyed: {part}"
    );
    assert!(
        holders[1].figures().counter_repairs > before,
        "the entries are repaired"
    );
    assert_eq!(redis.cli(&["HEXISTS", &table, "squatter"]).trim(), "0");
    redis.cli(&["DEL", &table]);
    redis.cli(&["SET", &table, "not a hash"]);
    let part = f64::from(renew(&holders[1], demands[1], RENEW).await) / 1e6;
    assert!(
        (part - 1.0).abs() < 1e-4,
        "a table of another type is replaced: {part}"
    );
}

/// A fleet of old and new nodes divides one rule during a rolling upgrade: an entry as an older
/// node wrote it (`share.lua`'s quota mode: demand, rate, burst and expiry) is read and divided
/// with, and the entry written is one the older node reads (four numbers, the same key).
#[tokio::test]
async fn an_entry_an_older_node_wrote_is_divided_with() {
    if redis_missing("an_entry_an_older_node_wrote_is_divided_with") {
        return;
    }
    let redis = RedisProcess::start();
    let store = open(config(&redis.url()));
    connected(&store).await;
    let q = Quota::new(SEC, 100, 100).unwrap();
    let time = redis.cli(&["TIME"]);
    let mut time = time.split_whitespace().map(|v| v.parse::<u64>().unwrap());
    let now_ms = time.next().unwrap() * 1_000 + time.next().unwrap() / 1_000;
    let table = format!("{{sluice-test:{:032x}}}:quotas", 7);
    // The older node asks 300/s and holds 90 % of the rule, its burst 75, for ten seconds.
    let expiry = (now_ms + 10_000).to_string();
    redis.cli(&[
        "HSET",
        &table,
        "older",
        &format!("300000 900000 75 {expiry}"),
    ]);
    // Asking 100/s of 400/s, this node is due a quarter: granted only the tenth left.
    assert_eq!(part_of(&store, q, 100.0, RENEW).await, 100_000);
    assert_eq!(
        redis.cli(&["HGET", &table, "older"]).trim(),
        format!("300000 900000 75 {expiry}"),
        "the older entry is kept as it was"
    );
    // The entry written: "demand rate burst expiry", four numbers, as the older node parses.
    let all = redis.cli(&["HGETALL", &table]);
    let lines: Vec<&str> = all.lines().map(str::trim).collect();
    let at = lines
        .iter()
        .position(|l| *l != "older" && !l.contains(' '))
        .expect("this node's entry");
    let fields: Vec<u64> = lines[at + 1]
        .split(' ')
        .map(|f| f.parse().expect("a number"))
        .collect();
    assert_eq!(fields.len(), 4, "{:?}", lines[at + 1]);
    assert_eq!(&fields[..2], &[100_000, 100_000]);
    assert!(
        fields[3] > now_ms && fields[3] <= now_ms + 11_000,
        "{fields:?}"
    );
    // Once the older entry lapses (its node upgraded and gone), the rest is this node's.
    redis.cli(&[
        "HSET",
        &table,
        "older",
        &format!("300000 900000 75 {now_ms}"),
    ]);
    assert_eq!(part_of(&store, q, 100.0, RENEW).await, 1_000_000);
}

/// A tick's renewals go in a few script calls, not one per rule: 450 rules in three calls of at
/// most `RULES_PER_CALL`, each rule's part in its place; two nodes asking alike halve each rule.
#[tokio::test]
async fn a_ticks_renewals_go_in_a_few_calls() {
    if redis_missing("a_ticks_renewals_go_in_a_few_calls") {
        return;
    }
    let redis = RedisProcess::start();
    let mut stores = Vec::new();
    for _ in 0..2 {
        let mut c = config(&redis.url());
        c.timeout = Duration::from_secs(5);
        let store = open(c);
        connected(&store).await;
        stores.push(store);
    }
    let q = Quota::new(SEC, 100, 100).unwrap();
    let rules: Vec<RuleRenewal> = (0..450)
        .map(|i| RuleRenewal {
            counter: 1_000 + i,
            quota: q,
            demand: 80.0,
        })
        .collect();
    let calls = || {
        let stats = redis.cli(&["INFO", "commandstats"]);
        stats
            .lines()
            .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
            .map(|l| {
                let n = l.split("calls=").nth(1).unwrap().split(',').next().unwrap();
                n.parse::<u64>().unwrap()
            })
            .sum::<u64>()
    };
    // The script loaded first.
    part_of(&stores[0], q, 1.0, FleetAsk::Leave).await;
    let before = calls();
    let parts = stores[0].parts_call(&rules, RENEW).await;
    assert_eq!(calls() - before, 450_u64.div_ceil(RULES_PER_CALL as u64));
    assert!(
        parts.iter().all(|p| matches!(p, Ok(1_000_000))),
        "alone, all of each rule"
    );
    for _ in 0..2 {
        for store in &stores {
            store.parts_call(&rules, RENEW).await;
        }
    }
    let a = stores[0].parts_call(&rules, RENEW).await;
    let b = stores[1].parts_call(&rules, RENEW).await;
    for (a, b) in a.iter().zip(&b) {
        let (a, b) = (*a.as_ref().unwrap(), *b.as_ref().unwrap());
        assert!(
            a + b <= 1_000_000 && a >= 499_000 && b >= 499_000,
            "{a} {b}"
        );
    }
    let before = calls();
    let left = stores[0].parts_call(&rules, FleetAsk::Leave).await;
    assert!(left.iter().all(|p| matches!(p, Ok(0))));
    assert_eq!(
        calls() - before,
        450_u64.div_ceil(RULES_PER_CALL as u64),
        "leaves batched alike"
    );
}

/// On Redis Cluster a call's tables share a hash slot: rules spread over many slots (and three
/// nodes) are grouped by slot, and every rule is answered in its place.
#[tokio::test]
async fn on_a_cluster_a_ticks_renewals_are_grouped_by_slot() {
    if redis_missing("on_a_cluster_a_ticks_renewals_are_grouped_by_slot") {
        return;
    }
    let (_cluster, _clock, store) = cluster_store().await;
    let q = Quota::new(SEC, 100, 100).unwrap();
    let rules: Vec<RuleRenewal> = (0..300)
        .map(|i| RuleRenewal {
            counter: i,
            quota: q,
            demand: 80.0,
        })
        .collect();
    let parts = store.parts_call(&rules, RENEW).await;
    assert_eq!(parts.len(), 300);
    for p in &parts {
        assert!(matches!(p, Ok(1_000_000)), "{p:?}");
    }
    let left = store.parts_call(&rules, FleetAsk::Leave).await;
    assert!(left.iter().all(Result::is_ok), "{left:?}");
}

/// An op of `charge` on counter `key`, enforced.
fn charged(key: u128, quota: Quota, cost: u64, charge: Charge) -> Op {
    Op {
        key,
        quota,
        cost,
        charge,
        mode: Mode::Enforce,
    }
}

/// Sends `ops` to Redis and to `memory` at `now`, asserts the two answers are one, and returns
/// it.
async fn both(store: &RedisStore, memory: &MemoryStore, ops: &[Op], now: u64) -> Batch {
    let expected = memory.count_batch(ops, now);
    let got = store.count_batch(ops).await.unwrap();
    assert_same(&got, &expected, ops, &format!("at {now}"));
    got
}

/// Spend reported after the work, in Redis as in memory, with Envoy Gateway's usage limit and an
/// AI gateway's token budget: a check of cost 0, then the spend; the spend is recorded when it
/// passes the budget, and the next check is refused until the debt is repaid.
async fn spend_after_the_work(store: &RedisStore, clock: &ManualClock) {
    let memory = MemoryStore::new();
    let start = 1_800_000_000 * SEC;
    clock.set(start);
    let check = |key, q| charged(key, q, 0, Charge::Ask);
    // 21 per hour, each call costing 10 after it: OK, OK, OK, then the check is refused.
    let hourly = Quota::new(3_600 * SEC, 21, 21).unwrap();
    let mut verdicts = Vec::new();
    for _ in 0..4 {
        let b = both(store, &memory, &[check(1, hourly)], start).await;
        verdicts.push(!b.blocked);
        if !b.blocked {
            both(
                store,
                &memory,
                &[charged(1, hourly, 10, Charge::Spent)],
                start,
            )
            .await;
        }
    }
    assert_eq!(verdicts, [true, true, true, false]);
    // 1,000 per minute against 800 spent per call: two calls, then the next waits until the
    // debt of 1,600 is back within the bucket, 36 s.
    let tokens = Quota::new(60 * SEC, 1_000, 1_000).unwrap(); // T = 60 ms
    let mut admitted = 0;
    let mut wait = 0;
    for _ in 0..3 {
        let b = both(store, &memory, &[check(2, tokens)], start).await;
        if b.blocked {
            wait = b.outcomes[0].wait;
            break;
        }
        admitted += 1;
        let s = both(
            store,
            &memory,
            &[charged(2, tokens, 800, Charge::Spent)],
            start,
        )
        .await;
        assert_eq!(
            s.outcomes[0].admitted,
            admitted == 1,
            "the second spend passes the budget"
        );
    }
    assert_eq!((admitted, wait), (2, 36 * SEC));
    clock.set(start + wait - 1);
    assert!(
        both(store, &memory, &[check(2, tokens)], start + wait - 1)
            .await
            .blocked
    );
    clock.set(start + wait);
    assert!(
        !both(store, &memory, &[check(2, tokens)], start + wait)
            .await
            .blocked
    );
    // One report of five budgets: recorded up to the debt cap (the bucket and four periods, 5
    // minutes here), so the key is refused for 4 minutes; other keys are untouched.
    let minute = Quota::new(60 * SEC, 10, 10).unwrap(); // T = 6 s
    // The store's time only moves forward: each scenario starts after the last.
    let start = start + wait;
    let b = both(
        store,
        &memory,
        &[charged(3, minute, 50, Charge::Spent)],
        start,
    )
    .await;
    assert!(b.blocked && !b.outcomes[0].admitted);
    assert_eq!(
        (b.outcomes[0].remaining, b.outcomes[0].wait),
        (0, 240 * SEC)
    );
    let b = both(store, &memory, &[check(3, minute), check(4, minute)], start).await;
    assert!(b.blocked && !b.outcomes[0].admitted && b.outcomes[1].admitted);
    assert_eq!(
        (b.outcomes[0].wait, b.outcomes[1].remaining),
        (240 * SEC, 10)
    );
    clock.set(start + 240 * SEC - 1);
    assert!(
        both(store, &memory, &[check(3, minute)], start + 240 * SEC - 1)
            .await
            .blocked
    );
    clock.set(start + 240 * SEC);
    let b = both(
        store,
        &memory,
        &[charged(3, minute, 1, Charge::Ask)],
        start + 240 * SEC,
    )
    .await;
    assert!(b.blocked, "a request of one fits a T later");
    clock.set(start + 246 * SEC);
    let b = both(
        store,
        &memory,
        &[charged(3, minute, 1, Charge::Ask)],
        start + 246 * SEC,
    )
    .await;
    assert!(!b.blocked && b.outcomes[0].remaining == 0);
    // A request charged before the work, refused, charges nothing; spend in the same request is
    // recorded all the same, and no charge of the refused request is.
    let start = start + 246 * SEC;
    for _ in 0..10 {
        both(store, &memory, &[charged(5, minute, 1, Charge::Ask)], start).await;
    }
    let b = both(
        store,
        &memory,
        &[
            charged(6, minute, 3, Charge::Ask),
            charged(5, minute, 1, Charge::Ask),
        ],
        start,
    )
    .await;
    assert!(b.blocked);
    let b = both(store, &memory, &[check(6, minute), check(5, minute)], start).await;
    assert_eq!((b.outcomes[0].remaining, b.outcomes[1].remaining), (10, 0));
    let b = both(
        store,
        &memory,
        &[
            charged(6, minute, 2, Charge::Spent),
            charged(5, minute, 1, Charge::Ask),
        ],
        start,
    )
    .await;
    assert!(b.blocked && b.outcomes[0].admitted);
    let b = both(store, &memory, &[check(6, minute)], start).await;
    assert_eq!(
        b.outcomes[0].remaining, 8,
        "the spend, not the refused charge"
    );
}

/// Spend after the work on one Redis: the scenarios of issue 39 give the memory store's answers.
#[tokio::test]
async fn spend_after_the_work_is_recorded_as_in_memory() {
    if redis_missing("spend_after_the_work_is_recorded_as_in_memory") {
        return;
    }
    let (_redis, clock, store) = store_at("spend:", 0).await;
    spend_after_the_work(&store, &clock).await;
}

/// The same on a Redis Cluster, where a request's counters sit in several hash slots: spend in
/// one slot is kept when a charge in another refuses the request (only charges made before the
/// work are given back).
#[tokio::test]
async fn cluster_spend_after_the_work_is_recorded_as_in_memory() {
    if redis_missing("cluster_spend_after_the_work_is_recorded_as_in_memory") {
        return;
    }
    let (_cluster, clock, store) = cluster_store().await;
    spend_after_the_work(&store, &clock).await;
}

/// Spend past the bucket at Redis `TIME`: the key lives as long as its debt (its TAT, the
/// bucket and the spend past it), and the exact script, for a bucket the lean one cannot hold,
/// records it the same way.
#[tokio::test]
async fn a_key_in_debt_expires_at_its_tat() {
    if redis_missing("a_key_in_debt_expires_at_its_tat") {
        return;
    }
    let redis = RedisProcess::start();
    let mut settings = config(&redis.url());
    settings.key_prefix = "debt:".into();
    let store = open(settings);
    connected(&store).await;
    let minute = Quota::new(60 * SEC, 10, 10).unwrap(); // T = 6 s, debt cap 300 s
    let month = Quota::new(30 * 86_400 * SEC, 10, 10).unwrap(); // T = 3 days: the exact script
    assert!(!fits_lean(&[charged(2, month, 1, Charge::Ask)]));
    for (key, q, cost) in [(1, minute, 25), (2, month, 15)] {
        let b = store
            .count_batch(&[charged(key, q, cost, Charge::Spent)])
            .await
            .unwrap();
        assert!(b.blocked && !b.outcomes[0].admitted);
        let debt = cost * q.interval();
        // At most the time the call took short of the debt past the bucket.
        let past = b.outcomes[0].wait;
        assert!(
            past <= debt - q.tolerance() && past + 2 * SEC > debt - q.tolerance(),
            "{past}"
        );
    }
    let cli = |args: &[&str]| redis.cli(args);
    for key in [
        "debt:00000000000000000000000000000001",
        "debt:00000000000000000000000000000002",
    ] {
        let (tat, at) = (cli(&["GET", key]), cli(&["PEXPIRETIME", key]));
        let (tat, at): (u128, u128) = (tat.trim().parse().unwrap(), at.trim().parse().unwrap());
        assert_expires_after(tat, at, key);
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis();
        assert!(at > now_ms + 140_000, "{key}: in debt past the bucket");
    }
}

/// A key holding TAT `tat` (ns) that expires at `at` (ms, `PEXPIRETIME`) is never gone while its
/// TAT is ahead: it expires at the TAT's millisecond or after, and within a second of it (its TTL
/// is the debt's whole milliseconds + 2, counted from the script's clock).
fn assert_expires_after(tat: u128, at: u128, what: &str) {
    let floor = tat / 1_000_000;
    assert!(
        (floor..=floor + 1_000).contains(&at),
        "{what}: TAT {tat} ns, expires at {at} ms"
    );
}
