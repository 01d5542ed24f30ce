//! Leased counting: a node takes a slice of a hot counter's tokens from the shared bucket in one
//! `lease.lua` call and answers that counter's requests from it locally, within a stated bound
//! (see [`LeasedStore`]), instead of paying a Redis round trip per decision. Only counters hot on
//! this node are leased; every other request takes the exact path, `RedisStore::count_batch`,
//! which stays correct beside leases. The lease calls are assembled in `call` and, on a single
//! node, ride in the coalesced round trips, where a stalled connection (`stall`) answers them
//! with the timeout, unsent; on a cluster each goes alone.
//!
//! Spend reported after the work, and checks of cost 0, always take the exact path, leased or
//! shared counter or not: spend is recorded on the shared counter whole, past any lease or share,
//! and a check must see the debt spend left there, which no lease knows (another node may have
//! recorded it). So the fleet's spend is the shared counter's, within the bound of one store.

mod ledger;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use dashmap::DashMap;
use redis::{Script, Value};
use smallvec::{SmallVec, smallvec};

use crate::limiter::batch::{Batch, Charge, Op, Source};
use crate::limiter::clock::Clock;
use crate::limiter::error::{BackendError, ErrorKind};
use crate::limiter::figures::{LeaseFigures, Purpose};
use crate::limiter::gcra::{CounterOutcome, NANOS_PER_SEC, Quota};
use crate::limiter::key::{Key, KeyHash};
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::call::{
    Call, LeaseAsk, LeaseCall, classify, evalsha, fits_lean, lease_args, parse_lease,
};
use crate::limiter::redis::config::RedisTime;
use crate::limiter::redis::connect::RedisConn;
use crate::limiter::redis::heartbeat::random_id;
use crate::limiter::redis::lease::ledger::{Lease, Share, Slice, signed};
use crate::limiter::redis::share::{ShareRenewal, ShareReply};
use crate::limiter::share::{Demand, Grant, ShareBook};

/// `lease.lua`, loaded once per process.
static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(super::scripts::LEASE));

/// Slots of the hotness table: a power of two, fixed, so tracking never grows with the keys.
const HEAT_SLOTS: usize = 4_096;

/// How leasing behaves (`redis.lease`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LeaseConfig {
    /// L: the longest a slice is used before its unused tokens go back.
    pub max_age: Duration,
    /// Hits per second on this node before a counter is leased.
    pub min_rate: u64,
    /// The most of a counter's burst one slice may take (0 to 1).
    pub max_burst_share: f64,
    /// The fraction of the last slice left when the next one is taken (0 to 1).
    pub low_water: f64,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        Self {
            max_age: Duration::from_secs(1),
            min_rate: 20,
            max_burst_share: 0.1,
            low_water: 0.5,
        }
    }
}

impl LeaseConfig {
    /// L in nanoseconds (at least 1).
    #[must_use]
    pub fn max_age_nanos(&self) -> u64 {
        u64::try_from(self.max_age.as_nanos())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// P: how often a share is renewed, L / 4 (at least 1 ns). A share's tokens for one period
    /// are all due within H + P of its renewal, so within L.
    #[must_use]
    pub fn renewal_period(&self) -> u64 {
        (self.max_age_nanos() / 4).max(1)
    }

    /// H: how far past a counter's tolerance a take may reserve, L / 2, so every reserved
    /// token is due well within its slice's life. Each node reserves no more than its own
    /// slices, so H binds only when many hot nodes queue on one counter at once.
    #[must_use]
    pub fn horizon(&self) -> u64 {
        self.max_age_nanos() / 2
    }

    /// The slice asked for a counter of `quota` used at `rate` hits per second on this node:
    /// `clamp(ceil(rate × L), 1, max(1, floor(B × max_burst_share)))`.
    #[must_use]
    pub fn slice(&self, quota: &Quota, rate: u64) -> u64 {
        let want = (u128::from(rate) * u128::from(self.max_age_nanos()))
            .div_ceil(u128::from(NANOS_PER_SEC));
        // Truncation intended: the floor of that share of the burst.
        let cap = ((quota.burst() as f64 * self.max_burst_share) as u64).max(1);
        u64::try_from(want).unwrap_or(u64::MAX).clamp(1, cap)
    }
}

/// Relaxed everywhere: independent statistics, read at scrape time.
#[derive(Debug, Default)]
struct LeaseStats {
    slices: AtomicU64,
    tokens_taken: AtomicU64,
    tokens_returned: AtomicU64,
    by_lease: AtomicU64,
    by_redis: AtomicU64,
    share_renewals: AtomicU64,
}

/// One distinct counter of a request: its key, its rate on this node, its lease if any.
type RequestCounter = (Key, u64, Option<Arc<Mutex<Lease>>>);

/// One slot of the hotness table.
#[derive(Debug, Default)]
struct Heat {
    key: Key,
    /// The second (of the local clock) `count` is for.
    second: u64,
    /// Hits counted this second.
    count: u64,
    /// When `count` began: the second's start, or the instant the key took the slot.
    from: u64,
    /// Hits in the second before.
    prev: u64,
    /// When `prev` began.
    prev_from: u64,
}

impl Heat {
    /// Moves the count on to the second of `now`.
    fn roll(&mut self, now: u64) {
        let second = now / NANOS_PER_SEC;
        if self.second != second {
            self.prev = if self.second + 1 == second {
                self.count
            } else {
                0
            };
            self.prev_from = self.from;
            self.count = 0;
            self.second = second;
            self.from = second.saturating_mul(NANOS_PER_SEC);
        }
    }

    /// The hits counted for the slot's key and when their count began: this second's, with
    /// the second before's when it counted any.
    fn seen(&self) -> (u64, u64) {
        if self.prev > 0 {
            (self.prev.saturating_add(self.count), self.prev_from)
        } else {
            (self.count, self.from)
        }
    }
}

/// The leased backend: a [`RedisStore`] and this node's leases of hot counters.
///
/// - A take of `k` charges `k` tokens on the shared TAT at once, so the shared bucket never
///   promises more than it holds: the tokens the bucket holds now, and when it holds fewer,
///   tokens reserved ahead of its refill, up to H = L / 2 past its tolerance
///   ([`LeaseConfig::horizon`]; fewer than `k` when that is full). Each token is due at the
///   instant the exact path would have admitted it (at once for those the bucket held, then one
///   T apart), dated from the take's reply, and none is used before it is due. A lease is a FIFO
///   of slices; requests use the oldest due tokens first. A slice lives at most `max_age` (L)
///   from the instant its take was sent; then its unused tokens go back to the shared bucket
///   (`TAT' = max(TAT − n·T, now)`), and all of them go back at shutdown. Every token admitted is
///   used no earlier than its instant on the shared schedule and less than L after it, so in any
///   span W the fleet admits at most `B + floor((W + L) / T)` of a counter (exact: `B + floor(W /
///   T)`).
/// - Slice size: `k = clamp(ceil(rate × L), 1, max(1, floor(B × max_burst_share)))`, with `rate`
///   this node's recent hits per second on the counter. The next slice is taken in the background
///   when the lease falls below `low_water` of the last one, or below all of it while the last
///   take had to reserve (demand above the rate: one slice stays queued ahead). One take is in
///   flight per counter.
/// - Only hot counters are leased (at least `min_rate` hits per second on this node), tracked in
///   a fixed table of slots, so cold keys cost a slot probe each and allocate nothing.
/// - A request is answered locally only when every op of it is on a live lease that can answer
///   it: charges that fit, check-only ops, refunds of tokens this lease handed out. All or nothing
///   across descriptors, with shadow and quota modes through [`Batch::blocked_by`] as in the
///   stores. A charge whose tokens the lease holds but are not due yet is refused locally with the
///   wait until they are. Anything else goes the exact path whole, and so does every request that
///   reports spend ([`Charge::Spent`]) or checks at cost 0. An empty lease whose last take was
///   granted nothing refuses locally, with the wait Redis reported, until that instant.
///
/// Locally reported `remaining` is this node's view (the tokens its lease still holds), a lower
/// bound of the fleet's.
pub struct LeasedStore {
    redis: Arc<RedisStore>,
    config: LeaseConfig,
    clock: Arc<dyn Clock>,
    leases: DashMap<Key, Arc<Mutex<Lease>>, KeyHash>,
    heat: Box<[Mutex<Heat>]>,
    /// Set at shutdown: no more local answers or takes.
    closed: AtomicBool,
    /// Takes in flight (SeqCst: shutdown waits for it to reach 0 after setting `closed`).
    in_flight: AtomicUsize,
    stats: LeaseStats,
    /// This node's id in share tables.
    node: String,
    /// The shares this node holds, for the local fallback.
    book: Arc<ShareBook>,
}

impl std::fmt::Debug for LeasedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeasedStore")
            .field("redis", &self.redis)
            .field("config", &self.config)
            .field("leases", &self.leases.len())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LeasedStore {
    /// Leases over `redis`, aged by `clock` (the same clock the store was given).
    #[must_use]
    pub fn new(redis: Arc<RedisStore>, config: LeaseConfig, clock: Arc<dyn Clock>) -> Arc<Self> {
        Arc::new(Self {
            redis,
            config,
            clock,
            leases: DashMap::default(),
            heat: (0..HEAT_SLOTS).map(|_| Mutex::default()).collect(),
            closed: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            stats: LeaseStats::default(),
            node: random_id(),
            book: Arc::new(ShareBook::new()),
        })
    }

    /// The shares of contended counters this node holds, which the local fallback counts at
    /// while Redis cannot decide.
    #[must_use]
    pub fn shares(&self) -> &Arc<ShareBook> {
        &self.book
    }

    /// The Redis store underneath.
    #[must_use]
    pub fn redis(&self) -> &Arc<RedisStore> {
        &self.redis
    }

    /// The leasing settings.
    #[must_use]
    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// Leasing's figures, read now.
    #[must_use]
    pub fn figures(&self) -> LeaseFigures {
        let s = &self.stats;
        LeaseFigures {
            slices: s.slices.load(Ordering::Relaxed),
            tokens_taken: s.tokens_taken.load(Ordering::Relaxed),
            tokens_returned: s.tokens_returned.load(Ordering::Relaxed),
            by_lease: s.by_lease.load(Ordering::Relaxed),
            by_redis: s.by_redis.load(Ordering::Relaxed),
            leases: self.leases.len(),
            shares: self.book.len(),
            share_renewals: s.share_renewals.load(Ordering::Relaxed),
        }
    }

    /// Tokens this node holds unused for `key` now (0 without a lease).
    #[must_use]
    pub fn held(&self, key: Key) -> u64 {
        let now = self.clock.now();
        self.leases.get(&key).map_or(0, |l| {
            let mut l = lock(&l);
            l.expire(now, self.config.max_age_nanos());
            l.unused()
        })
    }

    /// Decides a request's ops, from leases when they can answer all of it, else in Redis.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when the request goes to Redis and Redis cannot decide.
    pub async fn count_batch(self: &Arc<Self>, ops: &[Op]) -> Result<Batch, BackendError> {
        match self.answer_from_leases(ops) {
            Some(batch) => Ok(batch),
            None => self.count_in_redis(ops).await.map(|(batch, _)| batch),
        }
    }

    /// The answer from leases alone, when they can give all of it; `None` when the request
    /// must go to Redis ([`LeasedStore::count_in_redis`]), after starting takes for its hot
    /// counters that need one. [`LeasedStore::count_batch`] is the two in one.
    pub fn answer_from_leases(self: &Arc<Self>, ops: &[Op]) -> Option<Batch> {
        let batch = self.decide_from_leases(ops, self.clock.now())?;
        self.stats.by_lease.fetch_add(1, Ordering::Relaxed);
        Some(batch)
    }

    /// The exact path: the request decided in Redis (or its over-limit cache, as the source
    /// says).
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot decide.
    pub async fn count_in_redis(&self, ops: &[Op]) -> Result<(Batch, Source), BackendError> {
        self.stats.by_redis.fetch_add(1, Ordering::Relaxed);
        let answer = self.redis.count_batch_from(ops).await?;
        if !self.leases.is_empty() {
            self.learn_debts(ops, &answer.0);
        }
        Ok(answer)
    }

    /// Notes, on the shared counters among `ops`, the debt Redis reported, so that their
    /// requests overflow to the exact path only while the bucket has room.
    fn learn_debts(&self, ops: &[Op], batch: &Batch) {
        for (op, out) in ops.iter().zip(&batch.outcomes) {
            if op.is_refund() {
                continue;
            }
            let Some(lease) = self.leases.get(&op.key).map(|l| Arc::clone(&l)) else {
                continue;
            };
            let mut l = lock(&lease);
            if l.quota != op.quota {
                continue;
            }
            let Some(share) = l.share.as_mut() else {
                continue;
            };
            // Admitted: `wait` is the debt after; refused: the debt plus the cost past B·T, or,
            // for a cost past the burst (never admitted), the debt itself; spend recorded past
            // the bucket: the debt past B·T.
            share.debt = if op.charge == Charge::Spent && !out.admitted {
                out.wait.saturating_add(op.quota.tolerance())
            } else if out.admitted || op.cost > op.quota.burst() {
                out.wait
            } else {
                out.wait
                    .saturating_add(op.quota.tolerance())
                    .saturating_sub(op.cost.saturating_mul(op.quota.interval()))
            };
        }
    }

    /// Whether this counter's quota can be leased: not a ban, and exact in `lease.lua`'s plain
    /// numbers.
    fn leasable(op: &Op) -> bool {
        !op.quota.is_ban() && fits_lean([op])
    }

    /// Counts `cost` hits on `key` and returns its rate: the larger of this second's hits and
    /// the last second's. A slot belongs to one key at a time; another key's hits wear its
    /// count down and take the slot over once it reaches 0, so the slot keeps whichever key is
    /// hotter.
    fn heat(&self, key: Key, cost: u64, now: u64) -> u64 {
        let mut h = lock(self.heat_slot(key));
        h.roll(now);
        if h.key != key {
            if h.count > cost || h.prev >= self.config.min_rate {
                h.count -= cost.min(h.count);
                return 0;
            }
            *h = Heat {
                key,
                second: h.second,
                count: 0,
                from: now,
                prev: 0,
                prev_from: now,
            };
        }
        h.count += cost;
        h.count.max(h.prev)
    }

    /// The hits counted on `key` as of `now` and when their count began, if it holds its slot.
    fn seen(&self, key: Key, now: u64) -> Option<(u64, u64)> {
        let mut h = lock(self.heat_slot(key));
        h.roll(now);
        (h.key == key).then(|| h.seen())
    }

    fn heat_slot(&self, key: Key) -> &Mutex<Heat> {
        // Truncation intended: the key is a hash, its low bits pick the slot.
        &self.heat[(key as usize) & (HEAT_SLOTS - 1)]
    }

    /// The answer from leases, or `None` when the request must go to Redis (then takes are
    /// started for the hot counters that need one).
    fn decide_from_leases(self: &Arc<Self>, ops: &[Op], now: u64) -> Option<Batch> {
        if ops.is_empty() || self.closed.load(Ordering::Relaxed) {
            return None;
        }
        // Spend is recorded in Redis whole, and a check reads the debt there (module header).
        if ops
            .iter()
            .any(|op| op.charge == Charge::Spent || (op.charge == Charge::Ask && op.cost == 0))
        {
            return None;
        }
        let max_age = self.config.max_age_nanos();
        // The request's distinct counters: (key, rate, its lease).
        let mut counters: SmallVec<[RequestCounter; 4]> = SmallVec::with_capacity(ops.len());
        let mut answerable = true;
        for op in ops {
            if !Self::leasable(op) {
                answerable = false;
                continue;
            }
            let hits = if op.is_refund() { 0 } else { op.cost };
            let rate = self.heat(op.key, hits, now);
            if let Some(c) = counters.iter_mut().find(|c| c.0 == op.key) {
                c.1 = c.1.max(rate);
                continue;
            }
            let lease = self.leases.get(&op.key).map(|l| Arc::clone(&l));
            if lease.is_none() {
                answerable = false;
            }
            counters.push((op.key, rate, lease));
        }
        if !answerable {
            self.start_takes(ops, &counters, (now, false));
            return None;
        }
        counters.sort_unstable_by_key(|c| c.0);
        let leases: SmallVec<[&Arc<Mutex<Lease>>; 4]> =
            counters.iter().filter_map(|c| c.2.as_ref()).collect();
        // Locked in key order, so two requests never wait on each other in a cycle.
        let mut guards: SmallVec<[MutexGuard<'_, Lease>; 4]> =
            leases.iter().map(|l| lock(l)).collect();
        for g in &mut guards {
            g.expire(now, max_age);
        }
        let at = |key: Key| counters.iter().position(|c| c.0 == key).unwrap_or(0);
        // A shared counter's demand: every hit offered here, whatever the answer.
        for op in ops.iter().filter(|op| !op.is_refund()) {
            if let Some(share) = guards[at(op.key)].share.as_mut() {
                share.demand.hit(op.cost);
            }
        }
        let mut refunded: SmallVec<[u64; 4]> = smallvec![0; guards.len()];
        let mut charged: SmallVec<[u64; 4]> = smallvec![0; guards.len()];
        let mut outcomes = vec![CounterOutcome::NONE; ops.len()];
        let mut found: SmallVec<[u64; 4]> = smallvec![0; ops.len()];
        let mut fits = true;
        // Refunds first, as the stores apply them, whatever the outcome.
        for (op, out) in ops.iter().zip(outcomes.iter_mut()) {
            let i = at(op.key);
            let l = &mut guards[i];
            if l.quota != op.quota {
                // The rule changed (a reload): this lease is of the old rate.
                l.expire(now, 0);
                l.quota = op.quota;
                fits = false;
                break;
            }
            if !op.is_refund() {
                continue;
            }
            if op.cost > l.used() - refunded[i] {
                fits = false;
                break;
            }
            refunded[i] += op.cost;
            let remaining = (l.available(now) + refunded[i]).min(op.quota.burst());
            *out = CounterOutcome {
                admitted: true,
                remaining,
                wait: wait(l, &op.quota, remaining, now),
                ..CounterOutcome::NONE
            };
        }
        if fits {
            for (k, (op, out)) in ops.iter().zip(outcomes.iter_mut()).enumerate() {
                if op.is_refund() {
                    continue;
                }
                let i = at(op.key);
                let l = &guards[i];
                let avail = l.available(now) + refunded[i] - charged[i];
                found[k] = avail;
                if op.cost > op.quota.burst() {
                    fits = false;
                    break;
                }
                if op.cost <= avail {
                    charged[i] += op.cost;
                    let remaining = avail - op.cost;
                    *out = CounterOutcome {
                        admitted: true,
                        remaining,
                        wait: wait(l, &op.quota, remaining, now),
                        ..CounterOutcome::NONE
                    };
                } else if let Some(at) =
                    l.due_at((charged[i] + op.cost).saturating_sub(refunded[i]), now)
                {
                    // Reserved tokens not due yet: the shared bucket has none before them.
                    *out = CounterOutcome {
                        wait: at - now,
                        ..CounterOutcome::NONE
                    };
                } else if avail == 0 && l.denied_until > now {
                    let extra = (op.cost - 1).saturating_mul(op.quota.interval());
                    *out = CounterOutcome {
                        wait: (l.denied_until - now).saturating_add(extra),
                        ..CounterOutcome::NONE
                    };
                } else if let Some(wait) = l.share_wait(op.cost, now) {
                    // This node's share is spent until its next renewal, and the bucket holds
                    // nothing past the shares (else the request takes the exact path).
                    *out = CounterOutcome {
                        wait,
                        ..CounterOutcome::NONE
                    };
                } else {
                    fits = false;
                    break;
                }
            }
        }
        if !fits {
            drop(guards);
            // The shared counters' demand was counted above.
            self.start_takes(ops, &counters, (now, true));
            return None;
        }
        let blocked = Batch::blocked_by(ops, &outcomes);
        for (i, g) in guards.iter_mut().enumerate() {
            g.unconsume(refunded[i]);
            if !blocked {
                g.consume(charged[i], now);
            }
        }
        if blocked {
            // Nothing is charged: an op that fit reports the state it found.
            for ((op, out), avail) in ops.iter().zip(outcomes.iter_mut()).zip(&found) {
                if !op.is_refund() && out.admitted {
                    out.remaining = *avail;
                    out.wait = wait(&guards[at(op.key)], &op.quota, *avail, now);
                }
            }
        }
        // Low water: the next slice before this one runs out; a share, when its renewal is due.
        for (i, g) in guards.iter_mut().enumerate() {
            let (key, rate, _) = &counters[i];
            if g.share.is_some() {
                self.start_renewal(*key, g, now);
                continue;
            }
            let low = g.low_water(self.config.low_water);
            if g.unused() <= low && *rate >= self.config.min_rate {
                // Sized only when a take is due: the size is a 128-bit division.
                let ask = self.config.slice(&g.quota, *rate);
                self.start_take(*key, g, (ask, *rate), now);
            }
        }
        Some(Batch { blocked, outcomes })
    }

    /// Starts a take for every hot counter of `ops` that has no lease, or one running low, and
    /// a renewal for a shared one that is due; counts a shared counter's hits as demand unless
    /// the caller did (`counted`).
    fn start_takes(
        self: &Arc<Self>,
        ops: &[Op],
        counters: &[RequestCounter],
        (now, counted): (u64, bool),
    ) {
        for (key, rate, lease) in counters {
            if *rate < self.config.min_rate {
                continue;
            }
            let Some(op) = ops.iter().find(|op| op.key == *key) else {
                continue;
            };
            let lease = match lease {
                Some(l) => Arc::clone(l),
                None => Arc::clone(
                    &self
                        .leases
                        .entry(*key)
                        .or_insert_with(|| Arc::new(Mutex::new(Lease::new(op.quota)))),
                ),
            };
            let mut l = lock(&lease);
            if l.quota != op.quota {
                l.expire(now, 0);
                l.quota = op.quota;
            }
            l.expire(now, self.config.max_age_nanos());
            if let Some(share) = l.share.as_mut() {
                if !counted {
                    let hits = ops.iter().filter(|o| o.key == *key && !o.is_refund());
                    share.demand.hit(hits.map(|o| o.cost).sum());
                }
                self.start_renewal(*key, &mut l, now);
                continue;
            }
            let low = l.low_water(self.config.low_water);
            if l.unused() <= low {
                let ask = self.config.slice(&op.quota, *rate);
                self.start_take(*key, &mut l, (ask, *rate), now);
            }
        }
    }

    /// Sends a take of `ask` tokens for `key`, used at `rate` hits a second here, in the
    /// background, unless one is in flight, the shared bucket is known empty, or a failed take
    /// is being backed off.
    fn start_take(
        self: &Arc<Self>,
        key: Key,
        lease: &mut Lease,
        (ask, rate): (u64, u64),
        now: u64,
    ) {
        if lease.taking
            || now < lease.retry_at
            || now < lease.denied_until
            || self.closed.load(Ordering::SeqCst)
        {
            return;
        }
        lease.taking = true;
        lease.last_ask = ask;
        let quota = lease.quota;
        self.spawn_call(move |this| async move { this.take(key, quota, (ask, rate), now).await });
    }

    /// Runs the call `call` makes of this store in the background, counted in `in_flight`
    /// until it ends (so that closing waits for it).
    fn spawn_call<F>(self: &Arc<Self>, call: impl FnOnce(Arc<Self>) -> F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let this = Arc::clone(self);
        let call = call(Arc::clone(self));
        tokio::spawn(async move {
            call.await;
            this.in_flight.fetch_sub(1, Ordering::SeqCst);
        });
    }

    /// Sends the renewal of `key`'s share in the background when it is due, unless a call is
    /// in flight or a failed one is being backed off.
    fn start_renewal(self: &Arc<Self>, key: Key, lease: &mut Lease, now: u64) {
        let Some(share) = lease.share.as_mut() else {
            return;
        };
        if lease.taking
            || now < share.next
            || now < lease.retry_at
            || self.closed.load(Ordering::SeqCst)
        {
            return;
        }
        lease.taking = true;
        let demand = share.demand.renew(now);
        let (quota, held) = (lease.quota, lease.available(now));
        self.spawn_call(move |this| async move {
            this.renew(key, quota, (demand, held), now).await;
        });
    }

    /// The renewal of one share, as a [`ShareRenewal`] of this node.
    fn renewal(&self, demand: f64, held: u64, leave: bool) -> ShareRenewal<'_> {
        ShareRenewal {
            holder: &self.node,
            demand,
            held,
            period: Duration::from_nanos(self.config.renewal_period()),
            lifetime: self.config.max_age,
            horizon: self.config.horizon(),
            leave,
        }
    }

    /// One renewal: this node's demand sent, its share and the share's tokens for the next
    /// period received. A counter no longer contended goes back to slices; a failed renewal
    /// drops the share too, so that the next request meets the failure on the exact path (and
    /// the local fallback, which keeps the share in the book).
    async fn renew(&self, key: Key, quota: Quota, (demand, held): (f64, u64), sent: u64) {
        let renewal = self.renewal(demand, held, false);
        let result = self.redis.share_call(key, &quota, &renewal, sent).await;
        let Some(lease) = self.leases.get(&key).map(|l| Arc::clone(&l)) else {
            if let Ok(r) = result {
                self.give_back(key, &quota, r.granted).await;
            }
            return;
        };
        let received = self.clock.now();
        let mut l = lock(&lease);
        l.taking = false;
        let r: ShareReply = match result {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(error = %e, "share renewal failed");
                l.share = None;
                l.retry_at = received.saturating_add(self.config.max_age_nanos());
                return;
            }
        };
        self.stats.share_renewals.fetch_add(1, Ordering::Relaxed);
        match (r.shared && l.quota == quota, l.share.as_mut()) {
            (true, Some(share)) => {
                share.next = sent.saturating_add(self.config.renewal_period());
                share.millionths = r.millionths;
                share.debt = r.debt;
                if r.millionths == 0 {
                    // Nothing granted yet (the others hold the rate until they renew): local
                    // mode counts this node at rate/N, not at a ban.
                    self.book.release(key);
                } else {
                    self.book.hold(
                        key,
                        Grant {
                            quota,
                            share: quota.portion(r.millionths, r.burst),
                        },
                    );
                }
            }
            _ => {
                l.share = None;
                self.book.release(key);
            }
        }
        self.received(&mut l, quota, (r.granted, r.debt), (sent, received));
    }

    /// Records what a take or renewal of a counter of `quota`, sent at `sent`, granted: a slice
    /// of `granted` tokens (to go back at once when the rule changed meanwhile), and the
    /// bucket's debt after the call.
    fn received(
        &self,
        l: &mut Lease,
        quota: Quota,
        (granted, debt): (u64, u64),
        (sent, received): (u64, u64),
    ) {
        if granted > 0 {
            self.stats.slices.fetch_add(1, Ordering::Relaxed);
            self.stats
                .tokens_taken
                .fetch_add(granted, Ordering::Relaxed);
        }
        if l.quota != quota {
            l.to_return += granted;
        } else if granted > 0 {
            let before = debt.saturating_sub(granted.saturating_mul(quota.interval()));
            let slice = Slice {
                size: granted,
                used: 0,
                taken_at: sent,
                received,
                lead: signed(quota.tolerance()) - signed(before),
            };
            l.ahead = slice.due_by(received, quota.interval()) < granted;
            l.slices.push_back(slice);
        }
        l.full_at = sent.saturating_add(debt);
    }

    /// One take: charges up to `ask` tokens in Redis and adds what was granted to the lease.
    async fn take(&self, key: Key, quota: Quota, (ask, rate): (u64, u64), sent: u64) {
        let result = self
            .redis
            .lease_call(
                key,
                &quota,
                LeaseAsk::Take(self.config.horizon()),
                ask,
                sent,
            )
            .await;
        let Some(lease) = self.leases.get(&key).map(|l| Arc::clone(&l)) else {
            // The lease was dropped meanwhile (never while a take is in flight); give back.
            if let Ok((granted, _, _)) = result {
                self.give_back(key, &quota, granted).await;
            }
            return;
        };
        let received = self.clock.now();
        let mut l = lock(&lease);
        l.taking = false;
        match result {
            Ok((granted, debt, wait)) => {
                self.received(&mut l, quota, (granted, debt), (sent, received));
                if granted > 0 {
                    l.denied_until = 0;
                } else {
                    // Dated from when the take was sent: never later than Redis's instant.
                    l.denied_until = sent.saturating_add(wait);
                }
                // Demand above the rate: the take had to reserve past the bucket, or got less
                // than it asked for even so. The counter is contended, and this node asks for a
                // share.
                if (l.ahead || granted < ask) && l.share.is_none() && l.quota == quota {
                    // Its demand measured over the time its hits were counted, which may be
                    // part of a second: never that count taken for a rate.
                    let demand = match self.seen(key, received) {
                        Some((hits, since)) => Demand::counted(hits, since),
                        // Precision intended: a rate.
                        None => Demand::new(rate as f64, received),
                    };
                    l.share = Some(Share {
                        demand,
                        next: received,
                        millionths: 0,
                        debt,
                    });
                    l.denied_until = 0;
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "lease take failed");
                l.retry_at = self.clock.now().saturating_add(self.config.max_age_nanos());
            }
        }
    }

    async fn give_back(&self, key: Key, quota: &Quota, n: u64) {
        if n == 0 {
            return;
        }
        let now = self.clock.now();
        match self
            .redis
            .lease_call(key, quota, LeaseAsk::Give, n, now)
            .await
        {
            Ok(_) => {
                self.stats.tokens_returned.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                // Lost, not over-admitted: the shared bucket refills them at its own pace.
                tracing::debug!(error = %e, tokens = n, "lease give-back failed");
            }
        }
    }

    /// Ends the slices older than L and gives their unused tokens back; drops idle leases.
    /// The maintenance loop calls it; tests driving a manual clock call it by hand.
    pub async fn expire(&self) {
        self.give_back_where(self.config.max_age_nanos()).await;
    }

    /// Gives back the unused tokens of slices at least `max_age` old (all for 0).
    async fn give_back_where(&self, max_age: u64) {
        let now = self.clock.now();
        let mut back: Vec<(Key, Quota, u64)> = Vec::new();
        for entry in &self.leases {
            let mut l = lock(entry.value());
            l.expire(now, max_age);
            if l.to_return > 0 {
                back.push((*entry.key(), l.quota, std::mem::take(&mut l.to_return)));
            }
        }
        // Held by a request right now (another reference) or busy: kept.
        let lifetime = self.config.max_age_nanos();
        self.leases
            .retain(|_, l| Arc::strong_count(l) > 1 || !lock(l).idle(now, lifetime));
        // A share outlives its lease, or a failed renewal, only while Redis is away, for the
        // local fallback. The keys are read first: a renewal takes a lease's lock, then the
        // book's, so the book's is never held while a lease's is taken.
        if self.redis.answering() {
            let shared: std::collections::HashSet<Key> = self
                .leases
                .iter()
                .filter(|e| lock(e.value()).share.is_some())
                .map(|e| *e.key())
                .collect();
            self.book.retain(|key| shared.contains(key));
        }
        for (key, quota, n) in back {
            self.give_back(key, &quota, n).await;
        }
    }

    /// Waits until no take is in flight, at most `limit`.
    pub async fn settle(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while self.in_flight.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Stops leasing: no more local answers or takes; waits for takes in flight, then gives
    /// every unused token back.
    pub async fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.settle(self.redis.config.timeout * 2 + Duration::from_millis(50))
            .await;
        // Shares are given up at once, so that their rate goes to the others now, not in L.
        let shared: Vec<(Key, Quota)> = self
            .leases
            .iter()
            .filter_map(|e| {
                let mut l = lock(e.value());
                l.share.take().map(|_| (*e.key(), l.quota))
            })
            .collect();
        for (key, quota) in shared {
            let leave = self.renewal(0.0, 0, true);
            let now = self.clock.now();
            if let Err(e) = self.redis.share_call(key, &quota, &leave, now).await {
                tracing::debug!(error = %e, "share not given up; it ends within L");
            }
            self.book.release(key);
        }
        self.give_back_where(0).await;
    }

    /// Ends slices as they age, every quarter of L (at least every 5 ms), until `stop`; then
    /// [`LeasedStore::close`]. The caller owns this future.
    pub async fn maintain(self: Arc<Self>, stop: impl Future<Output = ()>) {
        let period = (self.config.max_age / 4).max(Duration::from_millis(5));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                () = &mut stop => break,
                _ = tick.tick() => self.expire().await,
            }
        }
        self.close().await;
        tracing::info!(
            returned = self.stats.tokens_returned.load(Ordering::Relaxed),
            "leases given back"
        );
    }
}

/// The wait reported for an admitted local op: until the shared bucket is full again as of
/// this node's last call, and no less than the tokens missing from this node's view.
fn wait(lease: &Lease, quota: &Quota, remaining: u64, now: u64) -> u64 {
    let missing = quota
        .burst()
        .saturating_sub(remaining)
        .saturating_mul(quota.interval());
    lease.full_at.saturating_sub(now).max(missing)
}

impl RedisStore {
    /// One `lease.lua` call on `key`: take up to `n` tokens (some of them reserved ahead, see
    /// `lease.lua`), or give `n` back. `now` is the decision time with [`RedisTime::Clock`].
    /// Returns (granted, debt after, wait until one token can be reserved when none was
    /// granted), in tokens and nanoseconds.
    async fn lease_call(
        &self,
        key: Key,
        quota: &Quota,
        ask: LeaseAsk,
        n: u64,
        now: u64,
    ) -> Result<(u64, u64, u64), BackendError> {
        let args = lease_args(quota, ask, n, self.time_arg(now));
        let purpose = match ask {
            LeaseAsk::Take(_) => Purpose::Take,
            LeaseAsk::Give => Purpose::Give,
        };
        let r = self
            .script_call(&SCRIPT, &[self.key(key)], &args, purpose, |v| {
                parse_lease(v).map(|r| (r, r.repaired))
            })
            .await?;
        Ok((r.granted, r.debt, r.wait))
    }

    /// The time a leasing script is given: `now` with [`RedisTime::Clock`], else none (Redis
    /// `TIME`).
    pub(super) fn time_arg(&self, now: u64) -> Option<u64> {
        match self.time {
            RedisTime::Server => None,
            RedisTime::Clock => Some(now),
        }
    }

    /// One call of a leasing script (`lease.lua`, `share.lua`) on `keys` with `args`, its reply
    /// read by `parse` into a value and whether a key was repaired: on a single node beside the
    /// next coalesced call, in its round trip; on a cluster alone. The breaker, the deadline,
    /// the stall gate (on a single node) and the failure counts apply as to every call.
    pub(super) async fn script_call<A, R>(
        &self,
        script: &'static Script,
        keys: &[String],
        args: &A,
        purpose: Purpose,
        parse: impl FnOnce(&[Value]) -> Result<(R, bool), BackendError>,
    ) -> Result<R, BackendError>
    where
        A: redis::ToRedisArgs,
    {
        if !self.breaker.allow() {
            self.stats.error(ErrorKind::BreakerOpen);
            return Err(BackendError::BreakerOpen);
        }
        let Some(conn) = self.conn.load_full() else {
            return Err(BackendError::NotConnected);
        };
        let timeout = self.config.timeout;
        let sent = async {
            match &*conn {
                RedisConn::Single(_) => {
                    // Beside the next coalesced call, in its round trip (`coalesce`).
                    let (reply, answer) = tokio::sync::oneshot::channel();
                    let call = LeaseCall {
                        cmd: evalsha(script, keys, args),
                        script,
                        purpose,
                        reply,
                    };
                    self.enqueue(Call::Lease(call))?;
                    match answer.await.map_err(|_| BackendError::NotConnected)?? {
                        Value::Array(values) => Ok(values),
                        other => Err(BackendError::Reply(format!("{other:?}"))),
                    }
                }
                RedisConn::Cluster(c) => {
                    let _trip = self.stats.round_trip(purpose);
                    let mut invocation = script.prepare_invoke();
                    for k in keys {
                        invocation.key(k);
                    }
                    invocation
                        .arg(args)
                        .invoke_async(&mut c.clone())
                        .await
                        .map_err(|e| classify(e, timeout))
                }
            }
        };
        let reply: Result<Vec<Value>, BackendError> =
            match tokio::time::timeout(timeout, sent).await {
                Ok(r) => r,
                Err(_) => Err(BackendError::Timeout(timeout)),
            };
        match reply.and_then(|r| parse(&r)) {
            Ok((r, repaired)) => {
                self.stats.repaired(u64::from(repaired));
                self.breaker.success();
                self.set_answering(true);
                Ok(r)
            }
            Err(e) => {
                self.set_answering(false);
                self.failed(&e, self.clock.now());
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_follow_the_rate_and_never_pass_the_burst_share() {
        let q = Quota::new(NANOS_PER_SEC, 1_000, 1_000).unwrap();
        let c = LeaseConfig::default(); // L = 1 s, share 0.1
        assert_eq!(c.slice(&q, 30), 30, "what the node uses within L");
        assert_eq!(c.slice(&q, 5_000), 100, "at most a tenth of the burst");
        assert_eq!(c.slice(&q, 0), 1);
        let tiny = Quota::new(NANOS_PER_SEC, 5, 5).unwrap();
        assert_eq!(c.slice(&tiny, 100), 1, "at least one token");
        let short = LeaseConfig {
            max_age: Duration::from_millis(100),
            ..c
        };
        assert_eq!(short.slice(&q, 25), 3, "ceil(25 × 0.1)");
        assert_eq!(short.horizon(), 50_000_000, "L / 2");
    }
}
