//! Leased counting: several `LeasedStore` nodes over one real `redis-server`, at one hand-driven
//! clock: the bound `B + floor((W + L) / T)` in every window of a random schedule, no
//! starvation, give-backs, a node dying with a lease, and every op kind answered from a lease.
//! Skips without `redis-server` unless `CI` is set (`helpers::redis_missing`).

use std::sync::Arc;
use std::time::Duration;

use sluice::limiter::gcra::NANOS_PER_SEC;
use sluice::limiter::{
    Charge, Clock, LeaseConfig, LeasedStore, ManualClock, Mode, Op, Quota, RedisConfig, RedisStore,
    RedisTime,
};
use sluice::pb::rate_limit_response::Code;
use sluice::settings::BackendKind;

use crate::helpers::redis::RedisProcess;
use crate::helpers::{Lcg, seeds};
use crate::helpers::{TestServer, descriptor, eventually, metric, redis_missing, request};

const MS: u64 = 1_000_000;

pub(crate) fn config(url: &str) -> RedisConfig {
    RedisConfig {
        key_prefix: "sluice-lease:".into(),
        timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_millis(500),
        breaker_failures: 0,
        breaker_cooldown: Duration::from_millis(100),
        ..crate::helpers::redis::config(url)
    }
}

/// A node: its own Redis store and leases, deciding at the shared `clock`.
pub(crate) async fn node(
    url: &str,
    clock: &Arc<ManualClock>,
    lease: LeaseConfig,
) -> Arc<LeasedStore> {
    node_with(config(url), clock, lease).await
}

/// A node of Redis settings `config`.
pub(crate) async fn node_with(
    config: RedisConfig,
    clock: &Arc<ManualClock>,
    lease: LeaseConfig,
) -> Arc<LeasedStore> {
    let clock: Arc<dyn Clock> = clock.clone();
    let redis = RedisStore::new(config, Arc::clone(&clock), RedisTime::Clock).unwrap();
    let connecting = Arc::clone(&redis);
    tokio::spawn(async move { connecting.connect().await });
    let r = Arc::clone(&redis);
    assert!(
        eventually(Duration::from_secs(5), || {
            let r = Arc::clone(&r);
            async move { r.is_connected() }
        })
        .await,
        "redis never connected"
    );
    LeasedStore::new(redis, lease, clock)
}

pub(crate) fn op(key: u128, quota: Quota, cost: u64) -> Op {
    Op {
        key,
        quota,
        cost,
        charge: Charge::Ask,
        mode: Mode::Enforce,
    }
}

/// One decision, then every take it started is waited for (so a schedule replays exactly).
async fn decide(node: &Arc<LeasedStore>, ops: &[Op]) -> sluice::limiter::Batch {
    let batch = node.count_batch(ops).await.expect("redis decides");
    node.settle(Duration::from_secs(2)).await;
    batch
}

/// What the shared bucket holds now, asked through a node with no lease of the counter (a
/// check-only op on the exact path).
async fn shared_remaining(probe: &Arc<LeasedStore>, key: u128, quota: Quota) -> u64 {
    let b = probe
        .redis()
        .count_batch(&[op(key, quota, 0)])
        .await
        .unwrap();
    b.outcomes[0].remaining
}

/// The model: three nodes share one hot counter (100 per second, burst 20, so T = 10 ms) under
/// leases of L = 200 ms, on a random schedule. In every window of W (one T, 100 ms, 500 ms,
/// 1 s) the fleet admits at most `B + floor((W + L) / T)`. With demand five times the rate it
/// admits at least 95 % of the exact `B + floor(W / T)` over the run (leasing does not starve);
/// under the rate and over it, most decisions never reach Redis.
#[tokio::test]
async fn leased_nodes_keep_the_stated_bound_and_do_not_starve() {
    if redis_missing("leased_nodes_keep_the_stated_bound_and_do_not_starve") {
        return;
    }
    let redis = RedisProcess::start();
    for (run, seed) in seeds("LEASE_SEED").into_iter().enumerate() {
        // Mean gap 2 ms: 500 per second against a rate of 100.
        let over = schedule(&redis.url(), seed, 2 * run as u128, 4 * MS).await;
        over.check_bound(seed);
        let got = over.admitted.len() as u64;
        let exact = over.exact();
        assert!(
            got * 100 >= exact * 95,
            "seed {seed} (LEASE_SEED={seed} to replay): {got} admitted over the run, under 95 % \
             of the exact {exact}"
        );
        // Reserved slices hand the refill out ahead, so over the rate too the hot key is
        // mostly answered from leases (denials included), not a round trip per admission.
        assert!(
            over.by_lease > 4 * over.by_redis,
            "seed {seed}: over the rate the hot key is mostly answered from leases ({} from \
             leases, {} by Redis)",
            over.by_lease,
            over.by_redis
        );
        // Mean gap 17 ms: 60 per second.
        let under = schedule(&redis.url(), seed, 2 * run as u128 + 1, 34 * MS).await;
        under.check_bound(seed);
        assert!(
            under.by_lease > 4 * under.by_redis,
            "seed {seed}: under the rate the hot key is mostly answered from leases ({} from \
             leases, {} by Redis)",
            under.by_lease,
            under.by_redis
        );
    }
}

/// A rule that delays, on leased nodes over the rate (100 a second, burst 20, delay 50 ms):
/// requests are held from the tokens their lease has due within the delay, for no longer than
/// it, mostly without a round trip; admitted at their slots, the fleet keeps the leased bound
/// in every window and admits at least 95 % of the exact count.
#[tokio::test]
async fn leased_nodes_hold_a_delaying_rule_from_their_leases_within_the_bound() {
    if redis_missing("leased_nodes_hold_a_delaying_rule_from_their_leases_within_the_bound") {
        return;
    }
    let redis = RedisProcess::start();
    let delay = 50 * MS;
    let quota = Quota::new(NANOS_PER_SEC, 100, 20)
        .unwrap()
        .with_max_delay(delay);
    for (run, seed) in seeds("LEASE_SEED").into_iter().enumerate() {
        let over = schedule_of(&redis.url(), seed, 0xde1a + run as u128, 4 * MS, quota).await;
        over.check_bound(seed);
        let (got, exact) = (over.admitted.len() as u64, over.exact());
        assert!(
            got * 100 >= exact * 95,
            "seed {seed}: {got} admitted, under 95 % of the exact {exact}"
        );
        let longest = over.held_by_lease.iter().max().copied().unwrap_or(0);
        assert!(
            over.held_by_lease.len() > 100 && longest <= delay,
            "seed {seed}: {} answers held from a lease, the longest {longest} ns",
            over.held_by_lease.len()
        );
        assert!(
            over.by_lease > 4 * over.by_redis,
            "seed {seed}: mostly answered from leases ({} from leases, {} by Redis)",
            over.by_lease,
            over.by_redis
        );
    }
}

/// What one schedule admitted.
struct Run {
    quota: Quota,
    lease: LeaseConfig,
    /// One instant per token, sorted: a held answer's at its slot.
    admitted: Vec<u64>,
    /// The hold of each answer held from a lease.
    held_by_lease: Vec<u64>,
    start: u64,
    end: u64,
    by_lease: u64,
    by_redis: u64,
}

impl Run {
    fn exact(&self) -> u64 {
        self.quota.burst() + (self.end - self.start) / self.quota.interval()
    }

    fn check_bound(&self, seed: u64) {
        let t = self.quota.interval();
        check_windows(
            &self.admitted,
            (&self.quota, self.lease.max_age_nanos()),
            &[t, 100 * MS, 500 * MS, NANOS_PER_SEC],
            &format!("seed {seed} (LEASE_SEED={seed} to replay)"),
        );
    }
}

/// Every window of each length in `windows` (ns) holds at most `B + floor((W + L) / T)` of the
/// `admitted` instants (sorted, one per token), for `quota` and L = `max_age`.
pub(crate) fn check_windows(
    admitted: &[u64],
    (quota, max_age): (&Quota, u64),
    windows: &[u64],
    context: &str,
) {
    let (b, t) = (quota.burst(), quota.interval());
    for &w in windows {
        let bound = b + (w + max_age) / t;
        let mut end = 0;
        for (i, &from) in admitted.iter().enumerate() {
            // The end of the window from `from` only moves on as `from` does.
            end = end.max(i);
            while end < admitted.len() && admitted[end] <= from + w {
                end += 1;
            }
            let within = (end - i) as u64;
            assert!(
                within <= bound,
                "{context}: {within} admitted in the {w} ns from {from}, over the stated bound \
                 {bound} (B {b} + floor((W + L) / T))"
            );
        }
    }
}

/// Five seconds of requests on counter `key` from three nodes, gaps uniform in 0..=`max_gap`,
/// mostly of cost 1, some of cost 2 (as one descriptor or two).
async fn schedule(url: &str, seed: u64, key: u128, max_gap: u64) -> Run {
    schedule_of(
        url,
        seed,
        key,
        max_gap,
        Quota::new(NANOS_PER_SEC, 100, 20).unwrap(),
    )
    .await
}

/// [`schedule`] for a counter of `quota`.
async fn schedule_of(url: &str, seed: u64, key: u128, max_gap: u64, quota: Quota) -> Run {
    let lease = LeaseConfig {
        max_age: Duration::from_millis(200),
        min_rate: 5,
        max_burst_share: 0.25,
        low_water: 0.5,
    };
    let key = 0xfeed_0000 + key;
    let clock = Arc::new(ManualClock::new(1_700_000_000 * NANOS_PER_SEC));
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(node(url, &clock, lease).await);
    }
    let mut rng = Lcg(seed ^ key as u64);
    let start = clock.now();
    let mut admitted: Vec<u64> = Vec::new();
    let mut held_by_lease = Vec::new();
    while clock.now() - start < 5 * NANOS_PER_SEC {
        clock.advance(rng.next(max_gap + 1));
        let n = &nodes[rng.next(3) as usize];
        let cost = if rng.next(10) == 0 { 2 } else { 1 };
        // Half the requests of cost 2 are two descriptors on the counter, one token each.
        let ops = if cost == 2 && rng.next(2) == 0 {
            vec![op(key, quota, 1); 2]
        } else {
            vec![op(key, quota, cost)]
        };
        let from_leases = n.figures().by_lease;
        let b = decide(n, &ops).await;
        if !b.blocked {
            let hold = b.outcomes.iter().map(|o| o.hold).max().unwrap_or(0);
            admitted.extend(std::iter::repeat_n(clock.now() + hold, cost as usize));
            if hold > 0 && n.figures().by_lease > from_leases {
                held_by_lease.push(hold);
            }
        }
        // The maintenance loop's work, about as often as it runs (every L / 4).
        if rng.next(10) == 0 {
            for n in &nodes {
                n.expire().await;
            }
        }
    }
    let end = clock.now();
    let by_lease = nodes.iter().map(|n| n.figures().by_lease).sum();
    let by_redis = nodes.iter().map(|n| n.figures().by_redis).sum();
    for n in &nodes {
        n.close().await;
    }
    admitted.sort_unstable();
    Run {
        quota,
        lease,
        admitted,
        held_by_lease,
        start,
        end,
        by_lease,
        by_redis,
    }
}

/// Unused tokens go back when their slice reaches L, and all of them at shutdown: the shared
/// bucket is then exactly what was used.
/// A node leasing with L = 1 s, leasing at 30 hits a second and up to half the burst, no low
/// water; a probe node beside it; a counter of 1000 per second with a burst of 100 (T = 1 ms,
/// slices of up to 50); their clock.
async fn one_hot_counter(
    redis: &RedisProcess,
) -> (Arc<ManualClock>, Quota, Arc<LeasedStore>, Arc<LeasedStore>) {
    let clock = Arc::new(ManualClock::new(1_700_000_000 * NANOS_PER_SEC));
    let lease = LeaseConfig {
        max_age: Duration::from_secs(1),
        min_rate: 30,
        max_burst_share: 0.5,
        low_water: 0.0,
    };
    let quota = Quota::new(NANOS_PER_SEC, 1_000, 100).unwrap();
    let a = node(&redis.url(), &clock, lease).await;
    let probe = node(&redis.url(), &clock, lease).await;
    (clock, quota, a, probe)
}

#[tokio::test]
async fn unused_tokens_go_back_at_expiry_and_at_shutdown() {
    if redis_missing("unused_tokens_go_back_at_expiry_and_at_shutdown") {
        return;
    }
    let redis = RedisProcess::start();
    let (clock, quota, a, probe) = one_hot_counter(&redis).await;
    let key = 0xabc;
    // Cold, then hot at the 30th hit: 30 round trips, and a slice of rate × L = 30.
    for _ in 0..30 {
        assert!(!decide(&a, &[op(key, quota, 1)]).await.blocked);
    }
    assert_eq!(a.figures().by_redis, 30);
    assert_eq!(a.held(key), 30, "a slice of ceil(30/s × 1 s)");
    for _ in 0..2 {
        assert!(!decide(&a, &[op(key, quota, 1)]).await.blocked);
    }
    assert_eq!((a.held(key), a.figures().by_lease), (28, 2));
    // 30 charged by Redis directly, the whole slice charged by the take.
    assert_eq!(shared_remaining(&probe, key, quota).await, 100 - 30 - 30);
    // Not yet L old: nothing goes back.
    clock.advance(999 * MS);
    a.expire().await;
    assert_eq!(a.figures().tokens_returned, 0);
    assert_eq!(a.held(key), 28);
    clock.advance(MS);
    a.expire().await;
    assert_eq!(a.figures().tokens_returned, 28, "the unused tokens at L");
    assert_eq!(a.held(key), 0);
    // A second at T = 1 ms refilled the bucket fully: nothing is owed any more.
    assert_eq!(shared_remaining(&probe, key, quota).await, 100);
    // The give-back is what lets others use them: right after a fresh slice of 32 (this
    // node's rate is now 32 per second) the bucket holds 100 - 1 - 32; giving those back
    // restores them at once.
    decide(&a, &[op(key, quota, 1)]).await;
    assert_eq!(a.held(key), 32);
    assert_eq!(shared_remaining(&probe, key, quota).await, 100 - 1 - 32);

    // At shutdown: use three tokens of the slice, close.
    for _ in 0..3 {
        decide(&a, &[op(key, quota, 1)]).await;
    }
    let held = a.held(key);
    assert_eq!(held, 29);
    let before = shared_remaining(&probe, key, quota).await;
    let returned = a.figures().tokens_returned;
    a.close().await;
    assert_eq!(a.figures().tokens_returned - returned, held);
    assert_eq!(shared_remaining(&probe, key, quota).await, before + held);
    assert_eq!(
        before + held,
        100 - 1 - 3,
        "what was used stays charged, nothing more"
    );
    // Closed: it answers only through Redis now.
    let by_lease = a.figures().by_lease;
    decide(&a, &[op(key, quota, 1)]).await;
    assert_eq!(a.figures().by_lease, by_lease);
}

/// Over the rate, on an empty bucket: a take reserves tokens ahead of the refill, and the node
/// admits each one no earlier than the exact path would have (the bucket, emptied at `t0`,
/// gives out one token every T: at most `floor((t - t0) / T)` by any instant t), uses nearly
/// all of them, and refuses in between locally, with the wait until the next one is due. The
/// exact path sees the bucket empty while the reservations stand.
#[tokio::test]
async fn reserved_tokens_are_admitted_when_the_exact_path_would_admit_them() {
    if redis_missing("reserved_tokens_are_admitted_when_the_exact_path_would_admit_them") {
        return;
    }
    let redis = RedisProcess::start();
    let clock = Arc::new(ManualClock::new(1_700_000_000 * NANOS_PER_SEC));
    let lease = LeaseConfig {
        max_age: Duration::from_secs(1),
        min_rate: 1,
        max_burst_share: 0.5,
        low_water: 0.5,
    };
    // T = 10 ms, B = 20: slices of up to 10.
    let quota = Quota::new(NANOS_PER_SEC, 100, 20).unwrap();
    let t = quota.interval();
    let key = 0x5e7e;
    let n = node(&redis.url(), &clock, lease).await;
    let probe = node(&redis.url(), &clock, lease).await;
    for _ in 0..20 {
        let b = probe
            .redis()
            .count_batch(&[op(key, quota, 1)])
            .await
            .unwrap();
        assert!(!b.blocked);
    }
    let t0 = clock.now();
    let mut admitted = 0;
    let mut refused_with_wait = 0;
    // Two seconds, a request every millisecond: ten times the rate.
    for _ in 0..2_000 {
        let b = decide(&n, &[op(key, quota, 1)]).await;
        let now = clock.now();
        if b.blocked {
            let wait = b.outcomes[0].wait;
            assert!(
                wait > 0 && wait <= t,
                "a refusal waits at most one T, got {wait}"
            );
            refused_with_wait += 1;
        } else {
            admitted += 1;
            assert!(
                admitted <= (now - t0) / t,
                "{admitted} admitted by {} ms, before the bucket gave them out",
                (now - t0) / MS
            );
        }
        if admitted > 0 && (now - t0).is_multiple_of(100 * MS) {
            // The reservations stand past the bucket: the exact path finds nothing.
            let b = probe
                .redis()
                .count_batch(&[op(key, quota, 1)])
                .await
                .unwrap();
            assert!(b.blocked, "the exact path admitted beside reservations");
        }
        clock.advance(MS);
    }
    let elapsed = (clock.now() - t0) / t;
    assert!(
        admitted * 100 >= elapsed * 95,
        "{admitted} admitted of the {elapsed} the bucket gave out"
    );
    let f = n.figures();
    assert!(
        f.by_lease > 20 * f.by_redis,
        "answered from the lease, refusals included: {f:?}"
    );
    assert!(refused_with_wait > 1_500, "{refused_with_wait} refused");
    n.close().await;
}

/// A node that dies holding a lease (dropped without giving back) takes at most its slice
/// from the others, and only until the bucket refills it: k·T, which is within L when the node
/// used the counter at no more than its rate.
#[tokio::test]
async fn a_node_that_dies_holding_a_lease_costs_its_slice_for_at_most_l() {
    if redis_missing("a_node_that_dies_holding_a_lease_costs_its_slice_for_at_most_l") {
        return;
    }
    let redis = RedisProcess::start();
    let clock = Arc::new(ManualClock::new(1_700_000_000 * NANOS_PER_SEC));
    let lease = LeaseConfig {
        max_age: Duration::from_millis(200),
        min_rate: 5,
        max_burst_share: 0.5,
        low_water: 0.0,
    };
    // 100 per second (T = 10 ms), burst 100.
    let quota = Quota::new(NANOS_PER_SEC, 100, 100).unwrap();
    let (t, l) = (quota.interval(), lease.max_age_nanos());
    let key = 0xdead;
    let dying = node(&redis.url(), &clock, lease).await;
    let other = node(&redis.url(), &clock, lease).await;
    // The dying node uses the counter at its rate (one per T) for 0.6 s, until it holds a
    // slice.
    let mut used = 0;
    while used < 60 || dying.held(key) == 0 {
        assert!(!decide(&dying, &[op(key, quota, 1)]).await.blocked);
        used += 1;
        clock.advance(t);
        assert!(used < 100, "never leased");
    }
    let k = dying.held(key);
    assert!(
        k * t <= l + t,
        "a slice at the node's rate is what it uses within L: k = {k}"
    );
    let died = clock.now();
    drop(dying);
    // The other nodes see the slice gone, no more: used tokens were charged as used.
    let missing = 100 - shared_remaining(&other, key, quota).await;
    assert!(
        missing >= k,
        "the held tokens are not available to the others"
    );
    // Within L of the death, the bucket has refilled everything (the used ones and the
    // slice): the lost tokens are back.
    clock.set(died + l);
    assert_eq!(
        shared_remaining(&other, key, quota).await,
        100,
        "the dead node's slice is back within L"
    );
}

/// A counter seen below `min_rate` on a node is never leased: every decision is one exact
/// round trip, and no lease state is kept for it.
#[tokio::test]
async fn cold_counters_stay_exact() {
    if redis_missing("cold_counters_stay_exact") {
        return;
    }
    let redis = RedisProcess::start();
    let clock = Arc::new(ManualClock::new(1_700_000_000 * NANOS_PER_SEC));
    let lease = LeaseConfig {
        min_rate: 10,
        ..LeaseConfig::default()
    };
    let quota = Quota::new(NANOS_PER_SEC, 100, 100).unwrap();
    let n = node(&redis.url(), &clock, lease).await;
    // Fifty keys, each hit 9 times a second for 3 seconds.
    for _second in 0..3 {
        for _hit in 0..9 {
            for key in 0..50u128 {
                decide(&n, &[op(key, quota, 1)]).await;
            }
            clock.advance(NANOS_PER_SEC / 10);
        }
        clock.advance(NANOS_PER_SEC / 10);
    }
    let f = n.figures();
    assert_eq!((f.by_lease, f.slices, f.leases), (0, 0, 0), "{f:?}");
    assert_eq!(f.by_redis, 3 * 9 * 50);
    assert_eq!(n.redis().figures().round_trips, 3 * 9 * 50);
}

/// Shadow and quota modes and refunds keep their meaning when answered from a lease: the same
/// verdicts the stores give, and the lease's tokens moving as the bucket's would. A check-only
/// op goes to Redis, which alone knows what spend the fleet recorded.
#[tokio::test]
async fn modes_checks_and_refunds_keep_their_meaning_on_a_lease() {
    if redis_missing("modes_checks_and_refunds_keep_their_meaning_on_a_lease") {
        return;
    }
    let redis = RedisProcess::start();
    let clock = Arc::new(ManualClock::new(1_700_000_000 * NANOS_PER_SEC));
    let lease = LeaseConfig {
        max_age: Duration::from_secs(10),
        min_rate: 2,
        max_burst_share: 1.0,
        low_water: 0.0,
    };
    // 10 per minute, burst 10: nothing refills within the test.
    let quota = Quota::new(60 * NANOS_PER_SEC, 10, 10).unwrap();
    let n = node(&redis.url(), &clock, lease).await;
    let key = 0x5ad0;
    decide(&n, &[op(key, quota, 1)]).await;
    decide(&n, &[op(key, quota, 1)]).await; // hot now: a slice of the 8 left is taken
    let held = n.held(key);
    assert_eq!(held, 8, "rate × L covers the whole share");
    let local = |n: &Arc<LeasedStore>| n.figures().by_lease;

    // Check-only: answered by Redis, nothing consumed; the shared bucket's tokens are all
    // leased.
    let before = local(&n);
    let b = decide(&n, &[op(key, quota, 0)]).await;
    assert!(!b.blocked && b.outcomes[0].admitted);
    assert_eq!(b.outcomes[0].remaining, 0);
    assert_eq!((n.held(key), local(&n)), (8, before));

    // Charges from the lease; then a refund of two of them goes back to the lease.
    let b = decide(&n, &[op(key, quota, 3)]).await;
    assert!(!b.blocked);
    assert_eq!(b.outcomes[0].remaining, 5);
    let refund = Op {
        charge: Charge::Refund,
        ..op(key, quota, 2)
    };
    let b = decide(&n, &[refund]).await;
    assert!(!b.blocked && b.outcomes[0].admitted);
    assert_eq!((n.held(key), local(&n)), (7, before + 2));
    // A refund of more than this lease handed out goes to Redis (which caps it at a full
    // bucket).
    let big = Op {
        charge: Charge::Refund,
        ..op(key, quota, 50)
    };
    decide(&n, &[big]).await;
    assert_eq!(local(&n), before + 2, "answered by Redis");

    // Two ops on the counter in one request: all or nothing. 7 held: 4 + 4 does not fit. The
    // counter is contended (2 hits a second against 10 a minute: the take got less than it
    // asked), so the lease holds a share; with the bucket empty past it, the request is refused
    // from the lease, neither op charged.
    let b = decide(&n, &[op(key, quota, 4), op(key, quota, 4)]).await;
    assert!(b.blocked);
    assert!(b.outcomes[0].admitted && !b.outcomes[1].admitted);
    assert_eq!((n.held(key), local(&n)), (7, before + 3));
    assert_eq!(n.figures().shares, 1);
    // Use up the lease and the shared bucket, so the lease knows Redis has none. (The counter
    // is contended by then, and shared: any token the lease still holds is reserved ahead, not
    // due.)
    while !decide(&n, &[op(key, quota, 1)]).await.blocked {}
    // An enforced op refused locally, with a wait; charges nothing.
    let before = local(&n);
    let b = decide(&n, &[op(key, quota, 1)]).await;
    assert!(b.blocked && !b.outcomes[0].admitted && b.outcomes[0].wait > 0);
    assert_eq!(local(&n), before + 1, "refused from the lease");
    // Shadow mode: the would-be denial never refuses the request.
    let shadow = Op {
        mode: Mode::Shadow,
        ..op(key, quota, 1)
    };
    let b = decide(&n, &[shadow]).await;
    assert!(!b.blocked && !b.outcomes[0].admitted);
    assert_eq!(local(&n), before + 2);
    // Quota mode: refused only when every quota op is denied.
    let quota_op = Op {
        mode: Mode::Quota,
        ..op(key, quota, 1)
    };
    let b = decide(&n, &[quota_op]).await;
    assert!(b.blocked);
    assert_eq!(local(&n), before + 3);
}

/// A server with `redis.lease.enabled` answers a hot key mostly without Redis and says so in
/// its metrics.
#[tokio::test]
async fn a_leased_server_reports_its_leases_in_metrics() {
    if redis_missing("a_leased_server_reports_its_leases_in_metrics") {
        return;
    }
    let redis = RedisProcess::start();
    let url = redis.url();
    let server = TestServer::start_with(
        &[(
            "hot.yaml",
            "domain: hot\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 100000, burst: 10000}\n",
        )],
        |s| {
            s.backend = BackendKind::Redis;
            s.redis.url = url;
            s.redis.lease.enabled = true;
            // Slices of what this node uses in 3 s: few takes, however slowly a loaded machine
            // runs the calls.
            s.redis.lease.max_age_ms = 3_000;
        },
    )
    .await;
    let req = || request("hot", vec![descriptor(&[("k", "v")])]);
    assert!(
        eventually(Duration::from_secs(5), || {
            let call = server.call(req());
            async move { call.await.is_ok() }
        })
        .await,
        "redis never connected"
    );
    let mut ok = 0;
    for _ in 0..300 {
        if let Ok(r) = server.call(req()).await {
            ok += u32::from(r.overall_code == Code::Ok as i32);
        }
    }
    assert!(ok > 250, "answered once Redis is connected: {ok}");
    let by_lease = metric(server.admin, "sluice_backend_decisions_total{by=\"lease\"}")
        .await
        .unwrap_or(0.0);
    let by_redis = metric(server.admin, "sluice_backend_decisions_total{by=\"redis\"}")
        .await
        .unwrap_or(0.0);
    assert!(by_lease > 200.0, "lease {by_lease}, redis {by_redis}");
    assert_eq!(
        metric(server.admin, "sluice_backend_mode{mode=\"leased\"}").await,
        Some(1.0)
    );
    let slices = metric(server.admin, "sluice_lease_slices_total")
        .await
        .unwrap();
    let taken = metric(server.admin, "sluice_lease_tokens_taken_total")
        .await
        .unwrap();
    assert!(
        slices >= 1.0 && taken >= by_lease,
        "slices {slices}, tokens {taken}"
    );
    // Every round trip, lease calls among them, is observed in the round-trip histogram (a
    // round trip is counted when it starts and observed when it ends, so they may differ while
    // one is in flight).
    let admin = server.admin;
    assert!(
        eventually(Duration::from_secs(5), || async move {
            let trips = metric(admin, "sluice_redis_round_trips_total").await;
            let observed = metric(admin, "sluice_redis_round_trip_duration_seconds_count").await;
            trips.is_some_and(|t| t > 0.0) && trips == observed
        })
        .await,
        "round trips {:?}, observed {:?}",
        metric(admin, "sluice_redis_round_trips_total").await,
        metric(admin, "sluice_redis_round_trip_duration_seconds_count").await
    );
    server.stop().await.unwrap();
}

/// Takes and give-backs ride in the coalesced round trips as a pipeline of `EVALSHA`s, which
/// do not load a script Redis has lost: after a `SCRIPT FLUSH` (as after a restart) each is
/// sent again with its script loaded, and nothing is lost or charged twice.
#[tokio::test]
async fn takes_and_give_backs_survive_a_script_flush() {
    if redis_missing("takes_and_give_backs_survive_a_script_flush") {
        return;
    }
    let redis = RedisProcess::start();
    let flush = || async {
        let client = ::redis::Client::open(redis.url()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = ::redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut c)
            .await
            .unwrap();
    };
    let (clock, quota, a, probe) = one_hot_counter(&redis).await;
    let key = 0xf1;
    // Hot at the 30th hit; its take, the first lease call, finds no script.
    flush().await;
    for _ in 0..30 {
        assert!(!decide(&a, &[op(key, quota, 1)]).await.blocked);
    }
    assert_eq!(a.held(key), 30, "the take was sent again and granted");
    assert_eq!(shared_remaining(&probe, key, quota).await, 100 - 30 - 30);
    // The give-back at L finds no script either.
    flush().await;
    clock.advance(NANOS_PER_SEC);
    a.expire().await;
    assert_eq!(a.figures().tokens_returned, 30);
    assert_eq!(shared_remaining(&probe, key, quota).await, 100);
}

/// Two leased nodes on one counter (100 per second, burst 20, L = 200 ms), each sent charges
/// made before the work (which keep the counter hot and leased) and checks of cost 0 each
/// followed by the spend of the call it admitted (1 to 5), seven times the rate in all. Spend
/// goes to Redis whole, so in every window W the fleet's charges and spend stay within
/// `B + floor((W + L) / T) + F`, F the largest spend of one call in flight (5); checks are
/// refused once spend passes the budget, and the leases still answer charges.
#[tokio::test]
async fn two_leased_nodes_reporting_spend_stay_within_the_bound() {
    if redis_missing("two_leased_nodes_reporting_spend_stay_within_the_bound") {
        return;
    }
    const MAX_SPEND: u64 = 5;
    let redis = RedisProcess::start();
    let start = 1_700_000_000 * NANOS_PER_SEC;
    let clock = Arc::new(ManualClock::new(start));
    let lease = LeaseConfig {
        max_age: Duration::from_millis(200),
        min_rate: 5,
        max_burst_share: 0.25,
        low_water: 0.5,
    };
    let quota = Quota::new(NANOS_PER_SEC, 100, 20).unwrap(); // T = 10 ms
    let nodes = [
        node(&redis.url(), &clock, lease).await,
        node(&redis.url(), &clock, lease).await,
    ];
    let key = 0x5e4d;
    let mut rng = Lcg(0x39);
    // One instant per unit charged or spent.
    let mut units = Vec::new();
    let (mut refused_checks, mut spent) = (0, 0);
    let mut now = start;
    while now < start + 3 * NANOS_PER_SEC {
        now += rng.next(4 * 1_000_000);
        clock.set(now);
        let n = &nodes[rng.next(2) as usize];
        if rng.next(2) == 0 {
            if !decide(n, &[op(key, quota, 1)]).await.blocked {
                units.push(now);
            }
            continue;
        }
        if decide(n, &[op(key, quota, 0)]).await.blocked {
            refused_checks += 1;
            continue;
        }
        let cost = 1 + rng.next(MAX_SPEND);
        let report = Op {
            charge: Charge::Spent,
            ..op(key, quota, cost)
        };
        decide(n, &[report]).await;
        spent += cost;
        units.extend(std::iter::repeat_n(now, cost as usize));
    }
    // The bound's B + F as the burst of a quota of the same T.
    let with_flight = Quota::new(NANOS_PER_SEC, 100, 20 + MAX_SPEND).unwrap();
    check_windows(
        &units,
        (&with_flight, lease.max_age_nanos()),
        &[quota.interval(), 100 * MS, 500 * MS, NANOS_PER_SEC],
        "two leased nodes with spend",
    );
    let by_lease: u64 = nodes.iter().map(|n| n.figures().by_lease).sum();
    assert!(
        spent > 0 && refused_checks > 0,
        "{spent} spent, {refused_checks} checks refused"
    );
    assert!(by_lease > 0, "the counter was leased");
    for n in &nodes {
        n.close().await;
    }
}
