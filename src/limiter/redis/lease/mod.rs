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
//!
//! # Layout
//!
//! - this file: the settings ([`LeaseConfig`]), the store and its figures, and the two paths a
//!   request takes (from leases, or the exact path in Redis);
//! - `ledger`: one counter's lease as plain bookkeeping, and every change a reply, a refund or
//!   an age makes to it;
//! - `heat`: the fixed table that tells which counters are hot on this node;
//! - `decide`: the local decision, all of a request or none of it;
//! - `takes`: the calls that fill a lease (takes, share renewals) and give tokens back;
//! - `lifecycle`: starting the store, ending slices as they age, and closing it.

mod decide;
mod heat;
mod ledger;
mod lifecycle;
mod takes;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use dashmap::DashMap;

use crate::limiter::batch::{Batch, Op, Source};
use crate::limiter::clock::Clock;
use crate::limiter::error::BackendError;
use crate::limiter::figures::LeaseFigures;
use crate::limiter::gcra::{NANOS_PER_SEC, Quota};
use crate::limiter::key::{Key, KeyHash};
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::lease::heat::HeatTable;
use crate::limiter::redis::lease::ledger::Lease;
use crate::limiter::share::ShareBook;

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
///   reports spend ([`Charge::Spent`](crate::limiter::batch::Charge::Spent)) or checks at cost
///   0. An empty lease whose last take was granted nothing refuses locally, with the wait Redis
///   reported, until that instant.
///
/// Locally reported `remaining` is this node's view (the tokens its lease still holds), a lower
/// bound of the fleet's.
pub struct LeasedStore {
    redis: Arc<RedisStore>,
    config: LeaseConfig,
    clock: Arc<dyn Clock>,
    leases: DashMap<Key, Arc<Mutex<Lease>>, KeyHash>,
    /// Which counters are hot on this node.
    heat: HeatTable,
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

    /// Drops this node's lease of `key` (its shared counter is being reset), unused tokens
    /// and all, so that it cannot go on refusing from a lease taken before the reset. A take
    /// in flight may start a new lease, from the counter as Redis then holds it.
    pub fn forget(&self, key: Key) {
        self.leases.remove(&key);
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
            lock(&lease).learn_debt(op, out);
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
