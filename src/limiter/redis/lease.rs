//! Leased counting: a node takes a slice of a hot counter's tokens from the shared bucket in
//! one script call (`lease.lua`) and answers that counter's requests from it locally, within a
//! stated bound, instead of paying a Redis round trip per decision.
//!
//! - A take of `k` charges `k` tokens on the shared TAT at once, so the shared bucket never
//!   promises more than it holds: the tokens the bucket holds now, and when it holds fewer,
//!   tokens reserved ahead of its refill, up to H = L / 2 past its tolerance
//!   ([`LeaseConfig::horizon`]; fewer than `k` when that is full). Each token is due at the
//!   instant the exact path would have admitted it (at once for those the bucket held, then one
//!   T apart), dated from the take's reply, and none is used before it is due. So when demand
//!   is above the rate the refill is handed out a slice at a time instead of a round trip per
//!   admission. A lease is a FIFO of slices; requests use the oldest due tokens first. A slice
//!   lives at most `max_age` (L) from the instant its take was sent; then its unused tokens go
//!   back to the shared bucket (`TAT' = max(TAT − n·T, now)`), and all of them go back at
//!   shutdown. Every token admitted is used no earlier than its instant on the shared schedule
//!   and less than L after it, so in any span W the fleet admits at most what that schedule
//!   gives out in W + L: `B + floor((W + L) / T)` of a counter (exact: `B + floor(W / T)`).
//! - Slice size: `k = clamp(ceil(rate × L), 1, max(1, floor(B × max_burst_share)))`, with `rate`
//!   this node's recent hits per second on the counter: never more than the node would use
//!   within L, never a share of the burst that starves the other nodes. The next slice is taken
//!   in the background when the lease falls below `low_water` of the last one, or below all of
//!   it while the last take had to reserve (demand above the rate: one slice stays queued ahead,
//!   so the lease does not run dry while a take waits for its reply on a busy node). One take
//!   is in flight per counter. On a single node takes and give-backs queue with the coalesced
//!   requests and share their round trip (`super::coalesce`).
//! - Only hot counters are leased (at least `min_rate` hits per second on this node), tracked
//!   in a fixed table of slots, so a hundred thousand cold keys cost a slot probe each and
//!   allocate nothing; they stay on the exact path (`RedisStore::check_batch`), which charges
//!   the shared TAT directly and stays correct beside leases.
//! - A request is answered locally only when every op of it is on a live lease that can answer
//!   it: charges that fit, check-only ops, refunds of tokens this lease handed out (they go back
//!   to the lease). All or nothing across descriptors, with shadow and quota modes through
//!   [`Batch::blocked_by`] as in the stores. A charge whose tokens the lease holds but are not
//!   due yet is refused locally with the wait until they are (the shared bucket has none
//!   before them). Anything else goes the exact path whole. An empty lease whose last take was
//!   granted nothing refuses locally, with the wait Redis reported, until that instant (as the
//!   over-limit cache does).
//!
//! Locally reported `remaining` is this node's view (the tokens its lease still holds), a lower
//! bound of the fleet's.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use dashmap::DashMap;
use redis::{Script, Value};
use smallvec::{SmallVec, smallvec};

use super::super::gcra::{NANOS_PER_SEC, Outcome, Quota};
use super::super::store::KeyHash;
use super::super::{Backend, BackendError, Batch, Clock, Key, Op};
use super::{Conn, RedisStore, RedisTime, classify, fits_lean, int};

/// `lease.lua`, loaded once per process.
static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(super::scripts::LEASE));

/// `lease.lua`, for the coalescing loop to load when Redis lost it.
pub(super) fn script() -> &'static Script {
    &SCRIPT
}

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

/// Leasing's figures at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseFigures {
    /// Slices taken (takes granted at least one token).
    pub slices: u64,
    /// Tokens those slices took from the shared buckets.
    pub tokens_taken: u64,
    /// Unused tokens given back to the shared buckets.
    pub tokens_returned: u64,
    /// Requests answered from leases, without Redis.
    pub by_lease: u64,
    /// Requests sent the exact path, to Redis.
    pub by_redis: u64,
    /// Counters with a lease now.
    pub leases: usize,
}

/// Relaxed everywhere: independent statistics, read at scrape time.
#[derive(Debug, Default)]
struct LeaseStats {
    slices: AtomicU64,
    tokens_taken: AtomicU64,
    tokens_returned: AtomicU64,
    by_lease: AtomicU64,
    by_redis: AtomicU64,
}

/// Tokens taken in one call.
#[derive(Debug)]
struct Slice {
    size: u64,
    used: u64,
    /// Local instant the take was sent (no later than Redis charged it).
    taken_at: u64,
    /// Local instant its reply came (no earlier than Redis charged it).
    received: u64,
    /// `B·T − d` for the debt d the shared bucket had before the take: the slice's i-th token
    /// (from 1) is due at `received + i·T − lead`, when the exact path would have admitted it
    /// (the tokens the bucket held are due at once; those reserved past it, one T apart).
    /// Below 2^53 either way: a debt of a leased counter is, and so is B·T.
    lead: i64,
}

impl Slice {
    /// How many of this slice's tokens are due at `now`, for an emission interval `t`.
    /// In 64 bits: a 128-bit division here cost a leased decision more than the rest of the
    /// lease's bookkeeping.
    fn due_by(&self, now: u64, t: u64) -> u64 {
        let elapsed = now.saturating_sub(self.received);
        let ahead = if self.lead >= 0 {
            elapsed.saturating_add(self.lead.unsigned_abs())
        } else {
            elapsed.saturating_sub(self.lead.unsigned_abs())
        };
        (ahead / t.max(1)).min(self.size)
    }

    /// Whether every token of the slice is used: it has none to hand out, whatever the time,
    /// until a refund gives some back. Over the rate a lease holds about one slice per take
    /// of the last L (fifty and more), nearly all of them spent: the walks of a decision start
    /// past the spent ones at the front ([`Lease::spent`]) and skip the others without a
    /// division.
    fn spent(&self) -> bool {
        self.used >= self.size
    }

    /// The instant its `i`-th token (from 1) is due.
    fn due_at(&self, i: u64, t: u64) -> u64 {
        let at = i128::from(self.received) + i128::from(i) * i128::from(t) - i128::from(self.lead);
        u64::try_from(at.max(0)).unwrap_or(u64::MAX)
    }
}

/// One counter's lease on this node.
#[derive(Debug)]
struct Lease {
    quota: Quota,
    /// Oldest first.
    slices: VecDeque<Slice>,
    /// Every slice before this index is spent: `consume` moves it on, `unconsume` back to the
    /// oldest slice a refund reached, `expire` with the front.
    spent: usize,
    /// Unused tokens of ended slices, not yet given back.
    to_return: u64,
    /// Until this local instant the shared bucket has no token (the last take got none).
    denied_until: u64,
    /// When the shared bucket is full again, as of this node's last call (a hint for waits).
    full_at: u64,
    /// A take is in flight.
    taking: bool,
    /// The size of the last slice asked for.
    last_ask: u64,
    /// The last take reserved tokens past the bucket: demand is above the rate, so one slice
    /// is kept queued ahead (the next take starts once the lease holds no more than the last
    /// ask), and the lease does not run dry while a take waits for its reply.
    ahead: bool,
    /// No take before this instant (after a failed one).
    retry_at: u64,
}

impl Lease {
    fn new(quota: Quota) -> Self {
        Self {
            quota,
            slices: VecDeque::new(),
            spent: 0,
            to_return: 0,
            denied_until: 0,
            full_at: 0,
            taking: false,
            last_ask: 1,
            ahead: false,
            retry_at: 0,
        }
    }

    /// Ends the slices taken `max_age` or more before `now` (all of them for 0).
    fn expire(&mut self, now: u64, max_age: u64) {
        while let Some(s) = self.slices.front() {
            if s.taken_at.saturating_add(max_age) > now {
                break;
            }
            self.to_return += s.size - s.used;
            self.slices.pop_front();
            self.spent = self.spent.saturating_sub(1);
        }
    }

    /// Where the slices that may still have a token to hand out begin (oldest first).
    fn first_live(&self) -> usize {
        self.spent.min(self.slices.len())
    }

    /// The slices that may still have a token to hand out, oldest first.
    fn live(&self) -> std::collections::vec_deque::Iter<'_, Slice> {
        self.slices.range(self.first_live()..)
    }

    /// Tokens held unused, due or not.
    fn unused(&self) -> u64 {
        self.live().map(|s| s.size - s.used).sum()
    }

    /// Tokens held unused and due at `now`: what the lease can hand out now.
    fn available(&self, now: u64) -> u64 {
        let t = self.quota.interval();
        self.live()
            .filter(|s| !s.spent())
            .map(|s| s.due_by(now, t).saturating_sub(s.used))
            .sum()
    }

    /// The instant by which `n` unused tokens are due (oldest slices first), or `None` when
    /// the lease holds fewer than `n`.
    fn due_at(&self, n: u64, now: u64) -> Option<u64> {
        let t = self.quota.interval();
        let mut need = n;
        if need == 0 {
            // Ready at once, as the first slice would answer; `None` without a slice.
            return (!self.slices.is_empty()).then_some(now);
        }
        for s in self.live() {
            if s.spent() {
                // Nothing ready, nothing to come: `need` passes it unchanged.
                continue;
            }
            let due = s.due_by(now, t).max(s.used);
            let ready = due - s.used;
            if need <= ready {
                return Some(now);
            }
            need -= ready;
            if need <= s.size - due {
                return Some(s.due_at(due + need, t).max(now));
            }
            need -= s.size - due;
        }
        None
    }

    fn used(&self) -> u64 {
        self.slices.iter().map(|s| s.used).sum()
    }

    /// Uses `n` due tokens, oldest first; the caller checked they are there.
    fn consume(&mut self, mut n: u64, now: u64) {
        let t = self.quota.interval();
        if n == 0 {
            return;
        }
        let from = self.first_live();
        for s in self.slices.range_mut(from..).filter(|s| !s.spent()) {
            let k = n.min(s.due_by(now, t).saturating_sub(s.used));
            s.used += k;
            n -= k;
            if n == 0 {
                break;
            }
        }
        while self.slices.get(self.spent).is_some_and(Slice::spent) {
            self.spent += 1;
        }
    }

    /// Gives `n` used tokens back to their slices, newest first; the caller checked they were
    /// used.
    fn unconsume(&mut self, mut n: u64) {
        for (i, s) in self.slices.iter_mut().enumerate().rev() {
            if n == 0 {
                break;
            }
            let k = n.min(s.used);
            if k > 0 {
                s.used -= k;
                n -= k;
                self.spent = self.spent.min(i);
            }
        }
    }

    /// The tokens held at or below which the next slice is taken: `fraction` of the last ask,
    /// or all of it while demand is above the rate.
    fn low_water(&self, fraction: f64) -> u64 {
        if self.ahead {
            return self.last_ask;
        }
        // Truncation intended: the floor of that fraction of the last slice.
        (self.last_ask as f64 * fraction) as u64
    }

    fn idle(&self, now: u64) -> bool {
        self.slices.is_empty() && !self.taking && self.to_return == 0 && self.denied_until <= now
    }
}

/// One distinct counter of a request: its key, its rate on this node, its lease if any.
type Counter = (Key, u64, Option<Arc<Mutex<Lease>>>);

/// One slot of the hotness table.
#[derive(Debug, Default)]
struct Heat {
    key: Key,
    /// The second (of the local clock) `count` is for.
    second: u64,
    /// Hits counted this second.
    count: u64,
    /// Hits in the second before.
    prev: u64,
}

/// The leased backend: a [`RedisStore`] and this node's leases of hot counters.
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
        })
    }

    /// This store as the process's backend.
    #[must_use]
    pub fn backend(self: &Arc<Self>) -> Backend {
        Backend::Leased(Arc::clone(self))
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
    pub async fn check_batch(self: &Arc<Self>, ops: &[Op]) -> Result<Batch, BackendError> {
        match self.answer_from_leases(ops) {
            Some(batch) => Ok(batch),
            None => self.check_in_redis(ops).await,
        }
    }

    /// The answer from leases alone, when they can give all of it; `None` when the request
    /// must go to Redis ([`LeasedStore::check_in_redis`]), after starting takes for its hot
    /// counters that need one. [`LeasedStore::check_batch`] is the two in one.
    pub fn answer_from_leases(self: &Arc<Self>, ops: &[Op]) -> Option<Batch> {
        let batch = self.local(ops, self.clock.now())?;
        self.stats.by_lease.fetch_add(1, Ordering::Relaxed);
        Some(batch)
    }

    /// The exact path: the request decided in Redis.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot decide.
    pub async fn check_in_redis(&self, ops: &[Op]) -> Result<Batch, BackendError> {
        self.stats.by_redis.fetch_add(1, Ordering::Relaxed);
        self.redis.check_batch(ops).await
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
        // Truncation intended: the key is a hash, its low bits pick the slot.
        let slot = &self.heat[(key as usize) & (HEAT_SLOTS - 1)];
        let mut h = lock(slot);
        let second = now / NANOS_PER_SEC;
        if h.second != second {
            h.prev = if h.second + 1 == second { h.count } else { 0 };
            h.count = 0;
            h.second = second;
        }
        if h.key != key {
            if h.count > cost || h.prev >= self.config.min_rate {
                h.count -= cost.min(h.count);
                return 0;
            }
            *h = Heat {
                key,
                second,
                count: 0,
                prev: 0,
            };
        }
        h.count += cost;
        h.count.max(h.prev)
    }

    /// The answer from leases, or `None` when the request must go to Redis (then takes are
    /// started for the hot counters that need one).
    fn local(self: &Arc<Self>, ops: &[Op], now: u64) -> Option<Batch> {
        if ops.is_empty() || self.closed.load(Ordering::Relaxed) {
            return None;
        }
        let max_age = self.config.max_age_nanos();
        // The request's distinct counters: (key, rate, its lease).
        let mut counters: SmallVec<[Counter; 4]> = SmallVec::with_capacity(ops.len());
        let mut answerable = true;
        for op in ops {
            if !Self::leasable(op) {
                answerable = false;
                continue;
            }
            let hits = if op.refund { 0 } else { op.cost };
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
            self.start_takes(ops, &counters, now);
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
        let mut refunded: SmallVec<[u64; 4]> = smallvec![0; guards.len()];
        let mut charged: SmallVec<[u64; 4]> = smallvec![0; guards.len()];
        let mut outcomes = vec![Outcome::NONE; ops.len()];
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
            if !op.refund {
                continue;
            }
            if op.cost > l.used() - refunded[i] {
                fits = false;
                break;
            }
            refunded[i] += op.cost;
            let remaining = (l.available(now) + refunded[i]).min(op.quota.burst());
            *out = Outcome {
                admitted: true,
                remaining,
                wait: wait(l, &op.quota, remaining, now),
                ..Outcome::NONE
            };
        }
        if fits {
            for (k, (op, out)) in ops.iter().zip(outcomes.iter_mut()).enumerate() {
                if op.refund {
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
                    *out = Outcome {
                        admitted: true,
                        remaining,
                        wait: wait(l, &op.quota, remaining, now),
                        ..Outcome::NONE
                    };
                } else if let Some(at) =
                    l.due_at((charged[i] + op.cost).saturating_sub(refunded[i]), now)
                {
                    // Reserved tokens not due yet: the shared bucket has none before them.
                    *out = Outcome {
                        wait: at - now,
                        ..Outcome::NONE
                    };
                } else if avail == 0 && l.denied_until > now {
                    let extra = (op.cost - 1).saturating_mul(op.quota.interval());
                    *out = Outcome {
                        wait: (l.denied_until - now).saturating_add(extra),
                        ..Outcome::NONE
                    };
                } else {
                    fits = false;
                    break;
                }
            }
        }
        if !fits {
            drop(guards);
            self.start_takes(ops, &counters, now);
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
                if !op.refund && out.admitted {
                    out.remaining = *avail;
                    out.wait = wait(&guards[at(op.key)], &op.quota, *avail, now);
                }
            }
        }
        // Low water: the next slice before this one runs out.
        for (i, g) in guards.iter_mut().enumerate() {
            let (key, rate, _) = &counters[i];
            let low = g.low_water(self.config.low_water);
            if g.unused() <= low && *rate >= self.config.min_rate {
                // Sized only when a take is due: the size is a 128-bit division.
                let ask = self.config.slice(&g.quota, *rate);
                self.start_take(*key, g, ask, now);
            }
        }
        Some(Batch { blocked, outcomes })
    }

    /// Starts a take for every hot counter of `ops` that has no lease, or one running low.
    fn start_takes(self: &Arc<Self>, ops: &[Op], counters: &[Counter], now: u64) {
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
            let low = l.low_water(self.config.low_water);
            if l.unused() <= low {
                let ask = self.config.slice(&op.quota, *rate);
                self.start_take(*key, &mut l, ask, now);
            }
        }
    }

    /// Sends a take of `ask` tokens for `key` in the background, unless one is in flight, the
    /// shared bucket is known empty, or a failed take is being backed off.
    fn start_take(self: &Arc<Self>, key: Key, lease: &mut Lease, ask: u64, now: u64) {
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
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let this = Arc::clone(self);
        tokio::spawn(async move {
            this.take(key, quota, ask, now).await;
            this.in_flight.fetch_sub(1, Ordering::SeqCst);
        });
    }

    /// One take: charges up to `ask` tokens in Redis and adds what was granted to the lease.
    async fn take(&self, key: Key, quota: Quota, ask: u64, sent: u64) {
        let result = self
            .redis
            .lease_call(key, &quota, Call::Take(self.config.horizon()), ask, sent)
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
                if granted > 0 {
                    self.stats.slices.fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .tokens_taken
                        .fetch_add(granted, Ordering::Relaxed);
                    if l.quota == quota {
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
                    } else {
                        l.to_return += granted;
                    }
                    l.denied_until = 0;
                } else {
                    // Dated from when the take was sent: never later than Redis's instant.
                    l.denied_until = sent.saturating_add(wait);
                }
                l.full_at = sent.saturating_add(debt);
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
        match self.redis.lease_call(key, quota, Call::Give, n, now).await {
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
        self.leases
            .retain(|_, l| Arc::strong_count(l) > 1 || !lock(l).idle(now));
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

/// A leased quantity (below 2^53 ns) as a signed one.
fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// What `lease.lua` is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Call {
    /// Take, reserving at most this far (ns) past the tolerance.
    Take(u64),
    Give,
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
        call: Call,
        n: u64,
        now: u64,
    ) -> Result<(u64, u64, u64), BackendError> {
        if !self.breaker.allow() {
            self.stats.error(super::ErrorKind::BreakerOpen);
            return Err(BackendError::BreakerOpen);
        }
        let Some(conn) = self.conn.load_full() else {
            return Err(BackendError::NotConnected);
        };
        let time = match self.time {
            RedisTime::Server => String::new(),
            RedisTime::Clock => now.to_string(),
        };
        let (verb, horizon) = match call {
            Call::Take(h) => ("take", h),
            Call::Give => ("give", 0),
        };
        let args = (time, verb, quota.interval(), quota.tolerance(), n, horizon);
        let timeout = self.config.timeout;
        let sent = async {
            match &*conn {
                Conn::Single(_) => {
                    // Beside the next coalesced call, in its round trip (`coalesce`).
                    let mut cmd = redis::cmd("EVALSHA");
                    cmd.arg(SCRIPT.get_hash())
                        .arg(1)
                        .arg(self.key(key))
                        .arg(&args);
                    let (reply, answer) = tokio::sync::oneshot::channel();
                    let call = super::coalesce::LeaseCall { cmd, reply };
                    self.queue
                        .send(super::coalesce::Job::Lease(call))
                        .map_err(|_| BackendError::NotConnected)?;
                    match answer.await.map_err(|_| BackendError::NotConnected)?? {
                        Value::Array(values) => Ok(values),
                        other => Err(BackendError::Reply(format!("{other:?}"))),
                    }
                }
                Conn::Cluster(c) => {
                    self.stats.round_trip();
                    SCRIPT
                        .key(self.key(key))
                        .arg(&args)
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
        let parsed = reply.and_then(|r| {
            // A fourth value: the counter held no TAT and was repaired.
            let (values, repaired) = match r.as_slice() {
                [g, d, w] => ([g, d, w], false),
                [g, d, w, one] if int(one) == Some(1) => ([g, d, w], true),
                _ => return Err(BackendError::Reply(format!("{r:?}"))),
            };
            match values.map(int) {
                [Some(g), Some(d), Some(w)] => {
                    self.stats.repaired(u64::from(repaired));
                    Ok((g, d, w))
                }
                _ => Err(BackendError::Reply(format!("{r:?}"))),
            }
        });
        match &parsed {
            Ok(_) => self.breaker.success(),
            Err(e) => {
                self.failed(e, self.clock.now());
            }
        }
        parsed
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

    /// A slice whose tokens were all in the bucket at its take (`lead` of at least size·T).
    fn held(size: u64, taken_at: u64, t: u64) -> Slice {
        Slice {
            size,
            used: 0,
            taken_at,
            received: taken_at,
            lead: signed(size * t),
        }
    }

    /// `available` and `due_at` as walks over every slice, spent ones included.
    fn walked(l: &Lease, n: u64, now: u64) -> (u64, Option<u64>) {
        let t = l.quota.interval();
        let available = l
            .slices
            .iter()
            .map(|s| s.due_by(now, t).saturating_sub(s.used))
            .sum();
        let mut need = n;
        for s in &l.slices {
            let due = s.due_by(now, t).max(s.used);
            let ready = due - s.used;
            if need <= ready {
                return (available, Some(now));
            }
            need -= ready;
            if need <= s.size - due {
                return (available, Some(s.due_at(due + need, t).max(now)));
            }
            need -= s.size - due;
        }
        (available, None)
    }

    proptest::proptest! {
        /// Starting past the spent slices and skipping the others changes no answer:
        /// `available`, `due_at` and `consume` give what walks over every slice give, before
        /// and after tokens are used and refunded, and every slice before the index is spent.
        #[test]
        fn spent_slices_are_skipped_without_changing_an_answer(
            slices in proptest::collection::vec(
                (1u64..20, 0u64..=20, 0u64..2_000, -30_000i64..30_000),
                0..8,
            ),
            now in 0u64..4_000,
            n in 0u64..60,
            refund in 0u64..60,
        ) {
            let q = Quota::new(NANOS_PER_SEC, 10_000, 100).unwrap();
            let t = q.interval();
            let now = now * 1_000;
            let mut l = Lease::new(q);
            for &(size, used, received, lead) in &slices {
                l.slices.push_back(Slice {
                    size,
                    used: used.min(size),
                    taken_at: received * 1_000,
                    received: received * 1_000,
                    lead: lead * 10,
                });
            }
            let (available, due_at) = walked(&l, n, now);
            proptest::prop_assert_eq!((l.available(now), l.due_at(n, now)), (available, due_at));
            // `consume` as a walk over every slice.
            let take = n.min(available);
            let mut expected: Vec<u64> = l.slices.iter().map(|s| s.used).collect();
            let mut left = take;
            for (s, used) in l.slices.iter().zip(expected.iter_mut()) {
                let k = left.min(s.due_by(now, t).saturating_sub(s.used));
                *used += k;
                left -= k;
            }
            l.consume(take, now);
            let used: Vec<u64> = l.slices.iter().map(|s| s.used).collect();
            proptest::prop_assert_eq!(used, expected);
            proptest::prop_assert!(l.slices.iter().take(l.spent).all(Slice::spent));
            proptest::prop_assert_eq!((l.available(now), l.due_at(n, now)), walked(&l, n, now));
            l.unconsume(refund.min(l.used()));
            proptest::prop_assert!(l.slices.iter().take(l.spent).all(Slice::spent));
            proptest::prop_assert_eq!((l.available(now), l.due_at(n, now)), walked(&l, n, now));
            proptest::prop_assert_eq!(
                l.unused(),
                l.slices.iter().map(|s| s.size - s.used).sum::<u64>()
            );
        }
    }

    #[test]
    fn a_lease_uses_oldest_tokens_first_and_ends_slices_at_their_age() {
        let q = Quota::new(NANOS_PER_SEC, 100, 100).unwrap();
        let t = q.interval();
        let mut l = Lease::new(q);
        l.slices.push_back(held(5, 0, t));
        l.slices.push_back(held(5, 10, t));
        l.consume(7, 10);
        assert_eq!((l.slices[0].used, l.slices[1].used), (5, 2));
        l.unconsume(3);
        assert_eq!((l.slices[0].used, l.slices[1].used), (4, 0));
        l.expire(99, 100);
        assert_eq!((l.slices.len(), l.to_return), (2, 0));
        l.expire(100, 100);
        assert_eq!((l.slices.len(), l.to_return, l.available(100)), (1, 1, 5));
        l.expire(100, 0);
        assert_eq!(
            (l.slices.len(), l.to_return),
            (0, 6),
            "an age of 0 ends them all"
        );
    }

    #[test]
    fn reserved_tokens_come_due_one_interval_apart_when_the_exact_path_would_admit_them() {
        // T = 10 ms, B = 10: tolerance 100 ms. A take of 5 on a debt of 80 ms finds two tokens
        // in the bucket (due at once) and reserves three, due 10, 20 and 30 ms later.
        let q = Quota::new(NANOS_PER_SEC, 100, 10).unwrap();
        let (t, ms) = (q.interval(), 1_000_000);
        let mut l = Lease::new(q);
        let at = 1_000 * ms;
        l.slices.push_back(Slice {
            size: 5,
            used: 0,
            taken_at: at - ms,
            received: at,
            lead: signed(q.tolerance()) - signed(80 * ms),
        });
        assert_eq!((l.available(at), l.unused()), (2, 5));
        assert_eq!(l.due_at(2, at), Some(at), "held: now");
        assert_eq!(l.due_at(3, at), Some(at + t), "the first reserved one");
        assert_eq!(l.due_at(5, at), Some(at + 3 * t));
        assert_eq!(l.due_at(6, at), None, "more than the lease holds");
        l.consume(2, at);
        assert_eq!(l.available(at + t - 1), 0, "not a nanosecond early");
        assert_eq!(l.available(at + t), 1);
        l.consume(5, at + t);
        assert_eq!(l.slices[0].used, 3, "only what is due is used");
        assert_eq!(l.due_at(1, at + t), Some(at + 2 * t));
        assert_eq!(l.available(at + 10 * t), 2, "never more than the slice");
    }

    #[test]
    fn above_the_rate_one_slice_is_kept_queued_ahead() {
        let q = Quota::new(NANOS_PER_SEC, 100, 10).unwrap();
        let mut l = Lease::new(q);
        l.last_ask = 10;
        assert_eq!(l.low_water(0.5), 5, "half the last ask");
        l.ahead = true;
        assert_eq!(l.low_water(0.5), 10, "the whole last ask");
    }
}
