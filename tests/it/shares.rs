//! Shares of contended counters: `LeasedStore` nodes over one real `redis-server`, at one
//! hand-driven clock, offered more than a counter's rate. The bound `B + floor((W + L) / T)` in
//! every window across slices, shares and the switches between them; at least 95 % of what the
//! exact path admits; shares that follow uneven demand; a node that dies holding a share; Redis
//! dying with the local fallback keeping the shares. Skips without `redis-server` unless `CI` is
//! set (`helpers::redis_missing`).

use std::sync::Arc;
use std::time::Duration;

use sluice::limiter::gcra::{self, NANOS_PER_SEC};
use sluice::limiter::{
    Clock, LeaseConfig, LeasedStore, LocalFallback, ManualClock, MemoryStore, Purpose, Quota,
    RedisConfig,
};

use crate::helpers::redis::{RedisCluster, RedisProcess};
use crate::helpers::{Lcg, redis_missing, seeds};
use crate::lease::{config, node_with, op};

const MS: u64 = 1_000_000;

/// The rule and settings of the two-node trial: 200 a second with a burst of 200 (T = 5 ms),
/// L = 500 ms, slices of at most a quarter of the burst, leased from 5 hits a second.
fn trial() -> (Quota, LeaseConfig) {
    (
        Quota::new(NANOS_PER_SEC, 200, 200).unwrap(),
        LeaseConfig {
            max_age: Duration::from_millis(500),
            min_rate: 5,
            max_burst_share: 0.25,
            low_water: 0.5,
        },
    )
}

/// One hit offered: when, on which node, its cost, whether it was admitted, and whether the
/// local fallback answered it.
#[derive(Clone, Copy, Debug)]
struct Hit {
    at: u64,
    node: usize,
    cost: u64,
    admitted: bool,
    local: bool,
}

/// Nodes sharing one counter, each with a local fallback that keeps its shares (as the server
/// wires them), at one clock.
struct Fleet {
    clock: Arc<ManualClock>,
    nodes: Vec<Arc<LeasedStore>>,
    local: Vec<LocalFallback>,
    alive: Vec<bool>,
    quota: Quota,
    lease: LeaseConfig,
    key: u128,
    hits: Vec<Hit>,
}

impl Fleet {
    async fn start(url: &str, n: usize, key: u128, rule: (Quota, LeaseConfig)) -> Self {
        // A failing Redis is given up on after three calls, for 100 ms of the clock.
        let config = RedisConfig {
            breaker_failures: 3,
            breaker_cooldown: Duration::from_millis(100),
            timeout: Duration::from_millis(100),
            connect_timeout: Duration::from_millis(100),
            ..config(url)
        };
        Self::start_with(config, n, key, rule).await
    }

    async fn start_with(
        config: RedisConfig,
        n: usize,
        key: u128,
        (quota, lease): (Quota, LeaseConfig),
    ) -> Self {
        let clock = Arc::new(ManualClock::new(1_700_000_000 * NANOS_PER_SEC));
        let mut nodes = Vec::new();
        let mut local = Vec::new();
        for _ in 0..n {
            let node = node_with(config.clone(), &clock, lease).await;
            let c: Arc<dyn Clock> = clock.clone();
            local.push(
                LocalFallback::new(MemoryStore::new(), c, Some(n as u64))
                    .with_shares(Arc::clone(node.shares())),
            );
            nodes.push(node);
        }
        Self {
            clock,
            nodes,
            local,
            alive: vec![true; n],
            quota,
            lease,
            key,
            hits: Vec::new(),
        }
    }

    /// Offers each node `rates[i]` hits a second for `span` ns, gaps uniform around the mean,
    /// one hit in ten of cost 2. Each decision waits for the calls it started, so a seed
    /// replays exactly; the maintenance loop's work runs every L / 4, as it does in a server.
    /// A node whose Redis call fails is answered by its local fallback, as the decision layer
    /// does under `on_backend_error: local`.
    async fn offer(&mut self, rng: &mut Lcg, rates: &[f64], span: u64) {
        let start = self.clock.now();
        let gap = |rng: &mut Lcg, rate: f64| {
            let mean = NANOS_PER_SEC as f64 / rate;
            1 + rng.next((2.0 * mean) as u64 + 1)
        };
        let mut next: Vec<u64> = rates
            .iter()
            .map(|&r| {
                if r > 0.0 {
                    start + gap(rng, r)
                } else {
                    u64::MAX
                }
            })
            .collect();
        let maintain = self.lease.renewal_period();
        let mut maintained = start;
        loop {
            let (i, &at) = next.iter().enumerate().min_by_key(|(_, t)| **t).unwrap();
            if at >= start + span {
                break;
            }
            next[i] = at + gap(rng, rates[i]);
            if !self.alive[i] {
                continue;
            }
            self.clock.advance(at - self.clock.now());
            if at - maintained >= maintain {
                maintained = at;
                for (n, alive) in self.nodes.iter().zip(&self.alive) {
                    if *alive {
                        n.expire().await;
                    }
                }
            }
            let cost = if rng.next(10) == 0 { 2 } else { 1 };
            let ops = [op(self.key, self.quota, cost)];
            let (batch, local) = match self.nodes[i].count_batch(&ops).await {
                Ok(b) => (b, false),
                Err(_) => (self.local[i].count(&ops), true),
            };
            self.nodes[i].settle(Duration::from_secs(2)).await;
            self.hits.push(Hit {
                at,
                node: i,
                cost,
                admitted: !batch.blocked,
                local,
            });
        }
        self.clock
            .advance((start + span).saturating_sub(self.clock.now()));
    }

    /// The admitted hits' instants, one per token.
    fn admitted(&self, from: u64, to: u64) -> Vec<u64> {
        self.hits
            .iter()
            .filter(|h| h.admitted && h.at >= from && h.at < to)
            .flat_map(|h| std::iter::repeat_n(h.at, h.cost as usize))
            .collect()
    }

    /// What the exact path would have admitted of the same hits, in the same order: one GCRA
    /// bucket.
    fn exact(&self, from: u64, to: u64) -> u64 {
        let mut tat = 0;
        let mut admitted = 0;
        for h in self.hits.iter().filter(|h| h.at >= from && h.at < to) {
            let o = gcra::decide(&self.quota, tat, h.at, h.cost);
            if o.admitted {
                tat = o.tat;
                admitted += h.cost;
            }
        }
        admitted
    }

    /// Tokens offered and admitted on node `i` in `[from, to)`.
    fn on(&self, i: usize, from: u64, to: u64) -> (u64, u64) {
        let mine = || {
            self.hits
                .iter()
                .filter(move |h| h.node == i && h.at >= from && h.at < to)
        };
        (
            mine().map(|h| h.cost).sum(),
            mine().filter(|h| h.admitted).map(|h| h.cost).sum(),
        )
    }

    /// Every window of each length in `windows` within `B + floor((W + L) / T)`.
    fn check_bound(&self, windows: &[u64], context: &str) {
        let admitted = self.admitted(0, u64::MAX);
        crate::lease::check_windows(
            &admitted,
            (&self.quota, self.lease.max_age_nanos()),
            windows,
            context,
        );
    }

    /// Round trips of each purpose over the fleet.
    fn trips(&self, purpose: Purpose) -> u64 {
        self.nodes
            .iter()
            .map(|n| {
                n.redis()
                    .figures()
                    .round_trips_by_purpose
                    .iter()
                    .find(|(p, _)| *p == purpose)
                    .map_or(0, |(_, n)| *n)
            })
            .sum()
    }

    fn renewals(&self) -> u64 {
        self.nodes.iter().map(|n| n.figures().share_renewals).sum()
    }

    async fn close(&self) {
        for (n, alive) in self.nodes.iter().zip(&self.alive) {
            if *alive {
                n.close().await;
            }
        }
    }
}

/// A trial's set-up: a Redis, a seed (`SHARE_SEED` to replay one) and its generator, and `n`
/// nodes on counter `key` under the trial's rule; `None`, after a notice, without
/// `redis-server`.
async fn trial_fleet(test: &str, n: usize, key: u128) -> Option<(RedisProcess, u64, Lcg, Fleet)> {
    if redis_missing(test) {
        return None;
    }
    let redis = RedisProcess::start();
    // A fixed seed, so that CI runs the same schedule every time; `SHARE_SEED=N` runs another.
    let seed = match std::env::var("SHARE_SEED") {
        Ok(_) => seeds("SHARE_SEED")[0],
        Err(_) => 33,
    };
    let fleet = Fleet::start(&redis.url(), n, key, trial()).await;
    Some((redis, seed, Lcg(seed), fleet))
}

/// The model: three nodes on one counter through phases of random load, from under the rate
/// to ten times over it, split unevenly among the nodes, so the counter switches between the
/// exact path, slices and shares. In every window the fleet stays within the bound; over the
/// run it admits at least 95 % of what one exact bucket would have admitted of the same hits;
/// while overloaded, shares hold it to a few round trips a second.
#[tokio::test]
async fn shares_keep_the_bound_and_the_floor_across_switches() {
    if redis_missing("shares_keep_the_bound_and_the_floor_across_switches") {
        return;
    }
    let redis = RedisProcess::start();
    // Fixed seeds, so that CI runs the same schedules every time (a schedule replays exactly);
    // `SHARE_SEED=N` runs another. With shares proportional to demand alone, seed
    // 1796260178164796715 fell under the floor (94.1 % of the exact count); water-filled, it holds.
    let fixed = std::env::var("SHARE_SEED").is_err();
    let seeds = if fixed {
        vec![11, 22, 33, 44]
    } else {
        seeds("SHARE_SEED")
    };
    for (run, seed) in seeds.into_iter().enumerate() {
        let mut rng = Lcg(seed);
        let mut fleet = Fleet::start(&redis.url(), 3, 0x5eed_0000 + run as u128, trial()).await;
        let start = fleet.clock.now();
        let r = 200.0;
        for _ in 0..8 {
            let level = [0.3, 0.8, 2.0, 5.0, 10.0][rng.next(5) as usize];
            let weights: Vec<f64> = (0..3).map(|_| (1 + rng.next(6)) as f64).collect();
            let sum: f64 = weights.iter().sum();
            let rates: Vec<f64> = weights.iter().map(|w| r * level * w / sum).collect();
            let span = (500 + rng.next(1_000)) * MS;
            fleet.offer(&mut rng, &rates, span).await;
        }
        let end = fleet.clock.now();
        let context = format!("SHARE_SEED={seed}");
        fleet.check_bound(
            &[5 * MS, 50 * MS, 250 * MS, NANOS_PER_SEC, 3 * NANOS_PER_SEC],
            &context,
        );
        let got = fleet.admitted(start, end).len() as u64;
        let exact = fleet.exact(start, end);
        assert!(
            got * 100 >= exact * 95,
            "{context}: {got} admitted, under 95 % of the exact path's {exact}"
        );
        assert!(
            fleet.renewals() > 0,
            "{context}: no counter was ever shared"
        );
        fleet.close().await;
    }
}

/// The trial of the issue in the model: two nodes, each offered about 900 hits a second (four
/// times its half of the rate) for 8 s. Shares hold each node to a few round trips a second,
/// and the fleet admits at least 95 % of `R × span` within the bound.
#[tokio::test]
async fn two_overloaded_nodes_pay_a_few_round_trips_a_second() {
    let Some((_redis, seed, mut rng, mut fleet)) = trial_fleet(
        "two_overloaded_nodes_pay_a_few_round_trips_a_second",
        2,
        0x5eed_1000,
    )
    .await
    else {
        return;
    };
    let start = fleet.clock.now();
    let span = 8 * NANOS_PER_SEC;
    fleet.offer(&mut rng, &[900.0, 900.0], span).await;
    let context = format!("SHARE_SEED={seed}");
    fleet.check_bound(
        &[50 * MS, 250 * MS, NANOS_PER_SEC, 3 * NANOS_PER_SEC],
        &context,
    );
    let admitted = fleet.admitted(start, start + span).len() as f64;
    let r_span = 200.0 * 8.0;
    assert!(
        admitted >= 0.95 * r_span,
        "{context}: {admitted} admitted, under 95 % of R × span = {r_span}"
    );
    let decisions = fleet.hits.len() as f64;
    let trips: u64 = Purpose::ALL.iter().map(|&p| fleet.trips(p)).sum();
    let per_node_second = trips as f64 / 2.0 / 8.0;
    assert!(
        per_node_second <= 16.0,
        "{context}: {per_node_second:.1} round trips a second per node (at most 16)"
    );
    assert!(
        trips as f64 / decisions <= 0.02,
        "{context}: {trips} round trips for {decisions} decisions (at most 0.02 each)"
    );
    assert!(fleet.trips(Purpose::Renew) > fleet.trips(Purpose::Take));
    for n in &fleet.nodes {
        assert_eq!(
            n.figures().shares,
            1,
            "each node holds a share of the hot counter"
        );
    }
    fleet.close().await;
    for n in &fleet.nodes {
        assert_eq!(n.figures().shares, 0, "shares are given up at shutdown");
    }
}

/// One node offered three times what the other is, both above their share: each admits about
/// the same fraction of what it is offered.
#[tokio::test]
async fn shares_follow_uneven_demand() {
    let Some((_redis, seed, mut rng, mut fleet)) =
        trial_fleet("shares_follow_uneven_demand", 2, 0x5eed_2000).await
    else {
        return;
    };
    fleet
        .offer(&mut rng, &[1_200.0, 400.0], 2 * NANOS_PER_SEC)
        .await;
    let from = fleet.clock.now();
    fleet
        .offer(&mut rng, &[1_200.0, 400.0], 4 * NANOS_PER_SEC)
        .await;
    let to = fleet.clock.now();
    let fraction = |i| {
        let (offered, admitted) = fleet.on(i, from, to);
        admitted as f64 / offered as f64
    };
    let (a, b) = (fraction(0), fraction(1));
    assert!(
        (a - b).abs() <= 0.25 * a.max(b),
        "SHARE_SEED={seed}: admitted {:.1} % on the busy node, {:.1} % on the other",
        a * 100.0,
        b * 100.0
    );
    fleet.check_bound(&[50 * MS, NANOS_PER_SEC], &format!("SHARE_SEED={seed}"));
    fleet.close().await;
}

/// A node dies holding a share (no shutdown, no leave): its entry lapses within L, and the
/// survivor, offered more than the rate, admits at least 85 % of it from then on.
#[tokio::test]
async fn a_node_that_dies_holding_a_share_frees_it_within_l() {
    let Some((_redis, seed, mut rng, mut fleet)) = trial_fleet(
        "a_node_that_dies_holding_a_share_frees_it_within_l",
        2,
        0x5eed_3000,
    )
    .await
    else {
        return;
    };
    fleet
        .offer(&mut rng, &[600.0, 600.0], 2 * NANOS_PER_SEC)
        .await;
    assert_eq!(fleet.nodes[0].figures().shares, 1);
    fleet.alive[0] = false;
    let died = fleet.clock.now();
    fleet
        .offer(&mut rng, &[0.0, 900.0], 3 * NANOS_PER_SEC)
        .await;
    let lease = trial().1;
    let from = died + lease.max_age_nanos() + lease.renewal_period();
    let to = died + 3 * NANOS_PER_SEC;
    let (_, admitted) = fleet.on(1, from, to);
    let due = 200.0 * (to - from) as f64 / NANOS_PER_SEC as f64;
    assert!(
        admitted as f64 >= 0.85 * due,
        "SHARE_SEED={seed}: the survivor admitted {admitted} of the {due} the rate allows, \
         from L plus one renewal after the death"
    );
    fleet.check_bound(&[50 * MS, NANOS_PER_SEC], &format!("SHARE_SEED={seed}"));
    fleet.close().await;
}

/// Redis dies while two nodes share an overloaded counter unevenly. Each counts locally at the
/// share it held, not at rate/2, and in the next 5 s the fleet admits at most
/// `B + R × (5 s + L)`.
#[tokio::test]
async fn redis_dying_leaves_each_node_its_share() {
    let Some((mut redis, seed, mut rng, mut fleet)) =
        trial_fleet("redis_dying_leaves_each_node_its_share", 2, 0x5eed_4000).await
    else {
        return;
    };
    let (quota, lease) = trial();
    fleet
        .offer(&mut rng, &[1_200.0, 400.0], 3 * NANOS_PER_SEC)
        .await;
    let shares: Vec<Quota> = fleet
        .nodes
        .iter()
        .map(|n| n.shares().share(fleet.key, &quota).expect("a share held"))
        .collect();
    redis.kill();
    let died = fleet.clock.now();
    fleet
        .offer(&mut rng, &[1_200.0, 400.0], 5 * NANOS_PER_SEC)
        .await;
    let after = fleet.admitted(died, died + 5 * NANOS_PER_SEC).len() as u64;
    let bound = quota.burst() + (5 * NANOS_PER_SEC + lease.max_age_nanos()) / quota.interval();
    assert!(
        after <= bound,
        "SHARE_SEED={seed}: {after} admitted in the 5 s after Redis died, over B + R × (5 s + L) \
         = {bound}"
    );
    let local: u64 = fleet.hits.iter().filter(|h| h.local).count() as u64;
    assert!(local > 0, "the local fallback answered");
    // The busy node's share is more than rate/2, and it counts at it: over the last 4 s it
    // admits about its share's rate, more than rate/2 would allow.
    let (from, to) = (died + NANOS_PER_SEC, died + 5 * NANOS_PER_SEC);
    let (_, busy) = fleet.on(0, from, to);
    let rate = |q: &Quota| NANOS_PER_SEC as f64 / q.interval() as f64;
    assert!(
        rate(&shares[0]) > 1.2 * 100.0,
        "the busy node's share ({:.0}/s) follows its demand",
        rate(&shares[0])
    );
    let expected = rate(&shares[0]) * 4.0;
    assert!(
        (busy as f64) <= expected + 2.0 && (busy as f64) >= 0.9 * expected,
        "SHARE_SEED={seed}: the busy node admitted {busy} locally in 4 s; its share allows \
         {expected:.0}"
    );
    // Redis comes back, and demand falls under the rate: once Redis answers, a share no lease
    // holds any more is forgotten, so that a later outage does not count at a stale grant.
    let _back = RedisProcess::start_on(redis.port);
    fleet
        .offer(&mut rng, &[30.0, 30.0], 3 * NANOS_PER_SEC)
        .await;
    assert!(
        fleet.hits.iter().rev().take(20).all(|h| !h.local),
        "Redis answers again"
    );
    for (i, n) in fleet.nodes.iter().enumerate() {
        assert_eq!(n.figures().shares, 0, "node {i} forgot its share");
        assert_eq!(n.shares().share(fleet.key, &quota), None, "node {i}");
    }
    for n in &fleet.nodes {
        n.settle(Duration::from_secs(1)).await;
    }
}

/// On a Redis Cluster the share table lives in its counter's slot: two overloaded nodes share
/// the counter there as on one Redis, every call answered, within the bound.
#[tokio::test]
async fn shares_work_on_a_cluster() {
    if redis_missing("shares_work_on_a_cluster") {
        return;
    }
    let cluster = RedisCluster::start();
    let config = RedisConfig {
        urls: cluster.urls(),
        cluster: true,
        timeout: Duration::from_secs(2),
        ..config("")
    };
    let seed = match std::env::var("SHARE_SEED") {
        Ok(_) => seeds("SHARE_SEED")[0],
        Err(_) => 33,
    };
    let mut rng = Lcg(seed);
    let mut fleet = Fleet::start_with(config, 2, 0x5eed_5000, trial()).await;
    fleet
        .offer(&mut rng, &[900.0, 900.0], 3 * NANOS_PER_SEC)
        .await;
    assert!(
        fleet.hits.iter().all(|h| !h.local),
        "every call answered by Redis or a share"
    );
    assert!(fleet.trips(Purpose::Renew) > 0, "renewals on the cluster");
    assert_eq!(fleet.nodes[0].figures().shares, 1);
    fleet.check_bound(&[50 * MS, NANOS_PER_SEC], &format!("SHARE_SEED={seed}"));
    fleet.close().await;
}

/// A share table that holds no table (a key of another type), or entries no renewal could have
/// written (an expiry far ahead holding the whole rate, a value that does not parse), is
/// repaired, counted, and never stops the counter from being shared.
#[tokio::test]
async fn a_corrupt_share_table_is_repaired_not_obeyed() {
    let Some((redis, seed, mut rng, mut fleet)) = trial_fleet(
        "a_corrupt_share_table_is_repaired_not_obeyed",
        2,
        0x5eed_6000,
    )
    .await
    else {
        return;
    };
    let table = format!("{{sluice-lease:{:032x}}}:shares", fleet.key);
    let repairs = |fleet: &Fleet| -> u64 {
        fleet
            .nodes
            .iter()
            .map(|n| n.redis().figures().counter_repairs)
            .sum()
    };
    redis.cli(&["SET", &table, "not a hash"]);
    fleet.offer(&mut rng, &[900.0, 900.0], NANOS_PER_SEC).await;
    assert!(
        repairs(&fleet) >= 1,
        "the table of another type was repaired"
    );
    redis.cli(&["HSET", &table, "squatter", "0 1000000 200 99999999999999"]);
    redis.cli(&["HSET", &table, "garbage", "not four numbers"]);
    let before = repairs(&fleet);
    let from = fleet.clock.now();
    fleet
        .offer(&mut rng, &[900.0, 900.0], 2 * NANOS_PER_SEC)
        .await;
    assert!(repairs(&fleet) > before, "the entries were repaired");
    for entry in ["squatter", "garbage"] {
        assert_eq!(
            redis.cli(&["HEXISTS", &table, entry]).trim(),
            "0",
            "{entry}"
        );
    }
    let admitted = fleet.admitted(from, fleet.clock.now()).len() as f64;
    assert!(
        admitted >= 0.9 * 200.0 * 2.0,
        "SHARE_SEED={seed}: {admitted} admitted in 2 s of a rate of 200: the squatter held nothing"
    );
    fleet.check_bound(&[50 * MS, NANOS_PER_SEC], &format!("SHARE_SEED={seed}"));
    fleet.close().await;
}

/// A node new to a shared counter gets a share at its first renewal, not at the others' next
/// one: two nodes overload the counter, then a third joins as busy as they are. Its first
/// demand is measured over the time its hits were counted, part of a second: seeds 11 and 22
/// once starved it for two renewal periods, asking at the rate of that partial count.
#[tokio::test]
async fn a_node_new_to_a_shared_counter_is_not_starved() {
    if redis_missing("a_node_new_to_a_shared_counter_is_not_starved") {
        return;
    }
    let redis = RedisProcess::start();
    // Fixed seeds, so that CI runs the same schedules every time; `SHARE_SEED=N` runs another.
    let seeds = match std::env::var("SHARE_SEED") {
        Ok(_) => seeds("SHARE_SEED"),
        Err(_) => vec![11, 22, 33],
    };
    for (run, seed) in seeds.into_iter().enumerate() {
        let mut rng = Lcg(seed);
        let mut fleet = Fleet::start(&redis.url(), 3, 0x5eed_7000 + run as u128, trial()).await;
        fleet
            .offer(&mut rng, &[900.0, 900.0, 0.0], 2 * NANOS_PER_SEC)
            .await;
        let joined = fleet.clock.now();
        fleet
            .offer(&mut rng, &[900.0, 900.0, 900.0], 2 * NANOS_PER_SEC)
            .await;
        let period = trial().1.renewal_period();
        // Its first two renewal periods, then a second: what it admits against the others' mean.
        let spans = [
            (joined, joined + 2 * period, 0.25),
            (joined + NANOS_PER_SEC, joined + 2 * NANOS_PER_SEC, 0.75),
        ];
        for (from, to, least) in spans {
            let admitted: Vec<f64> = (0..3).map(|i| fleet.on(i, from, to).1 as f64).collect();
            let others = (admitted[0] + admitted[1]) / 2.0;
            assert!(
                admitted[2] >= least * others,
                "SHARE_SEED={seed}: in the {} ms from {} ms after it joined, the new node \
                 admitted {} against the others' {others} (at least {least} of it)",
                (to - from) / MS,
                (from - joined) / MS,
                admitted[2]
            );
        }
        fleet.check_bound(&[50 * MS, NANOS_PER_SEC], &format!("SHARE_SEED={seed}"));
        fleet.close().await;
    }
}
