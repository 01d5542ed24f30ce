//! The in-memory store: counter key → TAT in a sharded map of atomics, bounded in size, and the
//! batch count that decides all of a request's counters together, all or nothing. It knows nothing
//! of policies, protobuf or async runtimes.

use std::alloc::System;
use std::hash::Hasher;
use std::sync::RwLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::limiter::batch::{Batch, Charge, Op};
use crate::limiter::gcra::{self, CounterOutcome, Quota};
use crate::limiter::key::{Key, KeyHash};

/// How often a batch is re-planned when concurrent requests keep changing its keys between the
/// plan and the commit. Past this the request is answered as over the limit, which can only
/// under-admit.
const MAX_ATTEMPTS: usize = 16;

/// Entries examined to choose an eviction victim.
const EVICTION_SAMPLE: usize = 16;

type Map = hashbrown::HashMap<PackedKey, AtomicU64, KeyHash, System>;

/// A [`Key`] as the tables hold it: its two halves, 8-byte aligned, so that an entry with its TAT
/// takes 24 bytes instead of the 32 a `u128` key pads it to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PackedKey([u64; 2]);

impl PackedKey {
    fn of(key: Key) -> Self {
        // Truncation intended: the low and the high half.
        Self([key as u64, (key >> 64) as u64])
    }
}

impl std::hash::Hash for PackedKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // The key's own hash, as for a `u128` key: `KeyHasher` folds it.
        state.write_u128(u128::from(self.0[0]) | (u128::from(self.0[1]) << 64));
    }
}

/// One shard, on its own cache lines so shards do not contend through false sharing.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard {
    /// Key → TAT in nanoseconds of the limiter's clock. A key whose TAT ≤ now is
    /// indistinguishable from an absent one, so absent keys read as TAT 0.
    map: RwLock<Map>,
}

/// The in-memory counter store.
///
/// Each entry is one `AtomicU64` updated by compare-and-swap under its shard's *read* lock, so
/// deciding never takes a write lock; a shard's write lock is taken only to insert a key seen for
/// the first time, to evict, or to sweep, and no lock outlives one of these calls. The number of
/// keys never exceeds `max_keys`: a new key first evicts, from a sample, the key closest to expiry
/// (one whose bucket is already full when there is one, which loses nothing).
///
/// An entry is a 16-byte key hash, held as two 8-byte halves so that it is not padded to a
/// `u128`'s 16-byte alignment, and an 8-byte TAT. The tables live on the system allocator, not the
/// global one: a table that doubles frees the old one, and glibc's malloc returns a freed block of
/// that size to the kernel at once, while mimalloc, the binaries' allocator (`crate::allocator`),
/// keeps freed memory resident until a delayed purge (BENCHMARKS.md, *Memory per key*). The tables
/// allocate only when they grow, so the hot path does not notice whose allocator it is.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Shard]>,
    /// `shards.len() - 1`; the length is a power of two.
    mask: usize,
    /// Most keys held at once.
    max_keys: usize,
    /// Keys held. Reserved before an insert, so it never exceeds `max_keys`.
    keys: AtomicUsize,
    /// Keys evicted while their bucket was not yet full.
    evictions: AtomicU64,
    /// Rotates eviction over shards.
    next_victim: AtomicUsize,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store without a key limit.
    #[must_use]
    pub fn new() -> Self {
        Self::with_max_keys(usize::MAX)
    }

    /// An empty store holding at most `max_keys` keys (at least 1).
    #[must_use]
    pub fn with_max_keys(max_keys: usize) -> Self {
        let parallelism = std::thread::available_parallelism().map_or(4, usize::from);
        let shards = (parallelism * 8).next_power_of_two().max(16);
        Self {
            shards: (0..shards).map(|_| Shard::default()).collect(),
            mask: shards - 1,
            max_keys: max_keys.max(1),
            keys: AtomicUsize::new(0),
            evictions: AtomicU64::new(0),
            next_victim: AtomicUsize::new(0),
        }
    }

    /// The most keys this store holds.
    #[must_use]
    pub fn max_keys(&self) -> usize {
        self.max_keys
    }

    /// Number of keys held (live or expired but not yet swept).
    #[must_use]
    pub fn len(&self) -> usize {
        // Relaxed: a statistic; exact under quiescence.
        self.keys.load(Ordering::Relaxed)
    }

    /// Whether the store holds no keys.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keys evicted before their bucket was full (each may forget some debt).
    #[must_use]
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    fn shard(&self, key: Key) -> &Shard {
        // The map hashes the folded key; pick the shard from other bits. Truncation intended.
        &self.shards[(key >> 100) as usize & self.mask]
    }

    /// The TAT stored for `key`, 0 when absent.
    #[must_use]
    pub fn tat(&self, key: Key) -> u64 {
        let map = read(&self.shard(key).map);
        // Acquire: see `cas`; a clock read after this load is no older than the TAT's writer's.
        map.get(&PackedKey::of(key))
            .map_or(0, |v| v.load(Ordering::Acquire))
    }

    /// Forgets `key` (an operator's reset): its bucket is full again. Returns whether it was
    /// held.
    pub fn remove(&self, key: Key) -> bool {
        let removed = write(&self.shard(key).map)
            .remove(&PackedKey::of(key))
            .is_some();
        if removed {
            // Relaxed: a statistic and the cap's count, as in `sweep`.
            self.keys.fetch_sub(1, Ordering::Relaxed);
        }
        removed
    }

    /// Removes every key whose TAT ≤ `now` (a full bucket, the same as no entry) and returns how
    /// many were removed. Never changes a future decision.
    pub fn sweep(&self, now: u64) -> usize {
        let mut removed = 0;
        for shard in &*self.shards {
            let mut map = write(&shard.map);
            let before = map.len();
            map.retain(|_, tat| tat.load(Ordering::Relaxed) > now);
            removed += before - map.len();
        }
        self.keys.fetch_sub(removed, Ordering::Relaxed);
        removed
    }

    /// Decides one request of `cost` on one key at `now`, charging it when admitted.
    #[inline]
    pub fn count(&self, key: Key, quota: &Quota, now: u64, cost: u64) -> CounterOutcome {
        self.update(key, &|| now, |tat, now| gcra::decide(quota, tat, now, cost))
            .0
    }

    /// Decides every op of a request together at `now` (see [`Batch`] for the rules), charging
    /// the admitted ops only when the request as a whole is admitted.
    pub fn count_batch(&self, ops: &[Op], now: u64) -> Batch {
        self.count_batch_with(ops, &|| now)
    }

    /// As [`MemoryStore::count_batch`], reading the time from `clock` *after* loading each TAT
    /// it decides on. A TAT written by a request that read the clock earlier is then never
    /// judged with an older time than its writer's, so concurrent requests cannot reach the
    /// store out of time order.
    pub fn count_batch_with(&self, ops: &[Op], clock: &dyn Fn() -> u64) -> Batch {
        if let [op] = ops
            && !op.unconditional()
        {
            // One charge (Envoy's usual request): deciding it is the whole plan, and a denial
            // writes nothing, so one CAS gives exactly what plan-then-commit would.
            let (outcome, _) = self.update(op.key, clock, |tat, now| {
                gcra::decide(&op.quota, tat, now, op.cost)
            });
            return Batch {
                blocked: Batch::blocked_by(ops, &[outcome]),
                outcomes: vec![outcome],
            };
        }
        // Refunds and recorded spend first, exactly once, whatever the request's outcome.
        let mut outcomes: Vec<CounterOutcome> = ops
            .iter()
            .map(|op| match op.charge {
                Charge::Ask => CounterOutcome::NONE,
                Charge::Spent => {
                    self.update(op.key, clock, |tat, now| {
                        gcra::record(&op.quota, tat, now, op.cost)
                    })
                    .0
                }
                Charge::Refund => {
                    self.update(op.key, clock, |tat, now| {
                        gcra::refund(&op.quota, tat, now, op.cost)
                    })
                    .0
                }
            })
            .collect();
        for _ in 0..MAX_ATTEMPTS {
            if self.plan(ops, clock, &mut outcomes) {
                return Batch {
                    blocked: true,
                    outcomes,
                };
            }
            if self.commit(ops, clock, &mut outcomes) {
                return Batch {
                    blocked: false,
                    outcomes,
                };
            }
        }
        // Persistent contention: refuse rather than risk admitting more than a bucket holds.
        for (op, o) in ops.iter().zip(outcomes.iter_mut()) {
            if !op.unconditional() {
                o.admitted = false;
            }
        }
        Batch {
            blocked: true,
            outcomes,
        }
    }

    /// Evaluates the charges of a batch against the current state without writing, in order, as
    /// if each admitted charge had been applied (so two ops on one key both count). Returns
    /// whether the request is blocked.
    fn plan(&self, ops: &[Op], clock: &dyn Fn() -> u64, outcomes: &mut [CounterOutcome]) -> bool {
        let loaded: Vec<u64> = ops
            .iter()
            .zip(outcomes.iter())
            .map(|(op, out)| {
                if op.unconditional() {
                    out.tat
                } else {
                    self.tat(op.key)
                }
            })
            .collect();
        // After the loads: never older than the time of any TAT just read.
        let now = clock();
        // TATs this plan has tentatively moved; requests carry few descriptors, so a linear scan.
        let mut overlay: Vec<(Key, u64)> = Vec::new();
        let mut before: Vec<u64> = Vec::with_capacity(ops.len());
        for ((op, out), tat) in ops.iter().zip(outcomes.iter_mut()).zip(loaded) {
            if op.unconditional() {
                before.push(tat);
                continue;
            }
            let tat = overlay
                .iter()
                .rev()
                .find(|(k, _)| *k == op.key)
                .map_or(tat, |(_, t)| *t);
            before.push(tat);
            *out = gcra::decide(&op.quota, tat, now, op.cost);
            if out.admitted {
                overlay.push((op.key, out.tat));
            }
        }
        let blocked = Batch::blocked_by(ops, outcomes);
        if blocked {
            // Nothing is charged: an op that fitted reports the state it found, uncharged.
            for ((op, out), tat) in ops.iter().zip(outcomes.iter_mut()).zip(before) {
                if !op.unconditional() && out.admitted {
                    *out = gcra::decide(&op.quota, tat, now, 0);
                }
            }
        }
        blocked
    }

    /// Applies the planned charges. Returns false (with this attempt's charges undone) when a
    /// concurrent request took the room a charge needed; the caller then plans again.
    ///
    /// Charges are made in key order, whatever the request's order, as locks are taken in one
    /// global order: a charge on a key can then fail only against requests that already hold
    /// all their smaller keys, and the request holding the largest key in contention always
    /// completes. In request order, two requests naming two full keys in opposite orders could
    /// each take one key, fail on the other and undo, round after round, and admit nobody.
    fn commit(&self, ops: &[Op], clock: &dyn Fn() -> u64, outcomes: &mut [CounterOutcome]) -> bool {
        // A stable sort: two ops on one key keep their request order, which the plan followed.
        let mut order: Vec<usize> = (0..ops.len()).collect();
        order.sort_by_key(|&i| ops[i].key);
        // (key, TAT before, TAT written, charge in ns) of each charge this attempt made.
        let mut written: Vec<(Key, u64, u64, u64)> = Vec::new();
        for i in order {
            let (op, out) = (&ops[i], &mut outcomes[i]);
            if op.unconditional() || !out.admitted || op.cost == 0 {
                continue;
            }
            let (o, before) = self.update(op.key, clock, |tat, now| {
                gcra::decide(&op.quota, tat, now, op.cost)
            });
            if o.admitted {
                *out = o;
                written.push((
                    op.key,
                    before,
                    o.tat,
                    op.cost.saturating_mul(op.quota.interval()),
                ));
                continue;
            }
            // Undo in reverse order (see `undo`).
            for (key, before, ours, charge) in written.into_iter().rev() {
                self.undo(key, before, ours, charge, clock);
            }
            return false;
        }
        true
    }

    /// Takes back a charge of `charge` ns that moved `key` from `before` to `ours`, without ever
    /// taking back anything another request charged:
    /// - the key still holds `ours`: put `before` back, exactly;
    /// - the key has moved, and the time (read after its last write) is still before `ours`:
    ///   our debt has not run out, so every later write built on it. A charge added its whole
    ///   cost on top of ours, and an undo below ours (another request's, whose charge sat
    ///   under or over ours) took back its own cost only: ours is still in the TAT, and
    ///   subtracting it is exact. Leaving it there instead would refuse its cost for nothing;
    ///   two requests undoing on one key in the wrong order would do exactly that;
    /// - otherwise our debt may have run out before someone else's charge, which then did not
    ///   build on ours: leave it. That can only refuse a little more than necessary.
    fn undo(&self, key: Key, before: u64, ours: u64, charge: u64, clock: &dyn Fn() -> u64) {
        let map = read(&self.shard(key).map);
        let Some(cell) = map.get(&PackedKey::of(key)) else {
            return;
        };
        let mut current = cell.load(Ordering::Acquire);
        loop {
            let now = clock();
            let target = if current == ours {
                before
            } else if now < ours && current > now {
                current.saturating_sub(charge).max(now)
            } else {
                return;
            };
            match cell.compare_exchange_weak(current, target, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(actual) => current = actual,
            }
        }
    }

    /// Runs `f(TAT, now)` on `key` and stores the TAT it returns when that moved (an admitted
    /// charge, a refund, spend recorded whether or not it fitted; a denial returns the TAT it
    /// found), by compare-and-swap, reading `now` after each load of the TAT. Returns the
    /// outcome and the TAT it replaced. A key is inserted only when a TAT ahead of now must be
    /// written.
    #[inline]
    fn update(
        &self,
        key: Key,
        clock: &(impl Fn() -> u64 + ?Sized),
        f: impl Fn(u64, u64) -> CounterOutcome,
    ) -> (CounterOutcome, u64) {
        let shard = self.shard(key);
        if let Some(cell) = read(&shard.map).get(&PackedKey::of(key)) {
            return cas(cell, clock, f);
        }
        let now = clock();
        let o = f(0, now);
        if o.tat <= now {
            // Nothing to remember: a denial leaves the TAT it found (none) and a full bucket is
            // the default.
            return (o, 0);
        }
        self.reserve(now);
        let mut map = write(&shard.map);
        if let Some(cell) = map.get(&PackedKey::of(key)) {
            // Inserted meanwhile by another request: give the reservation back.
            self.keys.fetch_sub(1, Ordering::Relaxed);
            return cas(cell, clock, f);
        }
        let cell = map
            .entry(PackedKey::of(key))
            .or_insert_with(|| AtomicU64::new(0));
        cas(cell, clock, f)
    }

    /// Reserves room for one more key, evicting when the store is full.
    fn reserve(&self, now: u64) {
        let mut current = self.keys.load(Ordering::Relaxed);
        loop {
            if current < self.max_keys {
                match self.keys.compare_exchange_weak(
                    current,
                    current + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => return,
                    Err(actual) => current = actual,
                }
            } else if self.evict_one(now) {
                current = self.keys.load(Ordering::Relaxed);
            } else {
                // Every shard is empty although the count says full, which the count's
                // bookkeeping rules out; take the slot rather than spin.
                self.keys.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
    }

    /// Removes the key closest to expiry among a sample of one shard's keys; false when every
    /// shard is empty.
    fn evict_one(&self, now: u64) -> bool {
        for _ in 0..self.shards.len() {
            let i = self.next_victim.fetch_add(1, Ordering::Relaxed) & self.mask;
            let mut map = write(&self.shards[i].map);
            let victim = map
                .iter()
                .take(EVICTION_SAMPLE)
                .map(|(k, tat)| (*k, tat.load(Ordering::Relaxed)))
                .min_by_key(|(_, tat)| *tat);
            if let Some((key, tat)) = victim {
                map.remove(&key);
                self.keys.fetch_sub(1, Ordering::Relaxed);
                if tat > now {
                    self.evictions.fetch_add(1, Ordering::Relaxed);
                }
                return true;
            }
        }
        false
    }
}

/// A read guard, recovering from poisoning: the map holds plain atomics, never torn state.
fn read(lock: &RwLock<Map>) -> std::sync::RwLockReadGuard<'_, Map> {
    lock.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A write guard, recovering from poisoning.
fn write(lock: &RwLock<Map>) -> std::sync::RwLockWriteGuard<'_, Map> {
    lock.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The compare-and-swap loop on one TAT; returns the outcome and the TAT it replaced.
#[inline]
fn cas(
    cell: &AtomicU64,
    clock: &(impl Fn() -> u64 + ?Sized),
    f: impl Fn(u64, u64) -> CounterOutcome,
) -> (CounterOutcome, u64) {
    // Acquire on loads and Release on writes: a TAT's writer read its clock before writing, so
    // a reader that sees the TAT and then reads the clock gets a time no older than the
    // writer's. (Free on x86; the CAS alone would order the TAT values themselves.)
    let mut current = cell.load(Ordering::Acquire);
    loop {
        // A denial returns the TAT it found; spend recorded past the bucket, denied, a new one.
        let o = f(current, clock());
        if o.tat == current {
            return (o, current);
        }
        match cell.compare_exchange_weak(current, o.tat, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return (o, current),
            Err(actual) => current = actual,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::batch::Mode;
    use crate::limiter::gcra::NANOS_PER_SEC as SEC;

    fn op(key: Key, quota: Quota, cost: u64) -> Op {
        Op {
            key,
            quota,
            cost,
            charge: Charge::Ask,
            mode: Mode::Enforce,
        }
    }

    #[test]
    fn spend_past_the_bucket_is_recorded_and_refuses_the_next_check() {
        let store = MemoryStore::new();
        let q = Quota::new(60 * SEC, 10, 10).unwrap(); // T = 6 s
        let spent = Op {
            charge: Charge::Spent,
            ..op(1, q, 15)
        };
        // On a new key and on a key in debt: recorded, denied, the debt past the bucket its wait.
        let b = store.count_batch(&[spent, op(2, q, 0)], 0);
        assert!(b.blocked && !b.outcomes[0].admitted);
        assert_eq!((b.outcomes[0].remaining, b.outcomes[0].wait), (0, 30 * SEC));
        assert_eq!(store.tat(1), 90 * SEC);
        let b = store.count_batch(&[spent, op(2, q, 0)], 0);
        assert_eq!(b.outcomes[0].wait, 120 * SEC);
        assert_eq!(store.tat(1), 180 * SEC);
        let check = store.count_batch(&[op(1, q, 0), op(2, q, 0)], 0);
        assert!(check.blocked && !check.outcomes[0].admitted);
        assert_eq!(check.outcomes[0].wait, 120 * SEC);
        assert!(store.count(1, &q, 120 * SEC, 0).admitted);
    }

    #[test]
    fn denials_do_not_insert_keys() {
        let store = MemoryStore::new();
        let q = Quota::new(SEC, 2, 2).unwrap();
        assert!(!store.count(1, &q, 0, 3).admitted);
        assert!(store.is_empty());
        assert!(store.count(1, &q, 0, 2).admitted);
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn a_rejected_batch_charges_nothing() {
        let store = MemoryStore::new();
        let wide = Quota::new(60 * SEC, 10, 10).unwrap();
        let narrow = Quota::new(60 * SEC, 1, 1).unwrap();
        assert!(store.count(2, &narrow, 0, 1).admitted);
        let b = store.count_batch(&[op(1, wide, 1), op(2, narrow, 1)], 0);
        assert!(b.blocked);
        assert!(b.outcomes[0].admitted);
        assert_eq!(b.outcomes[0].remaining, 10);
        assert!(!b.outcomes[1].admitted);
        assert_eq!(store.tat(1), 0);
    }

    /// Two half-committed requests undo their charges on one key in either order, the one
    /// charged first undoing first included: the key ends exactly where it began.
    #[test]
    fn undos_in_either_order_take_back_exactly_their_charges() {
        let q = Quota::new(SEC, 10, 10).unwrap();
        let (now, i) = (5 * SEC, q.interval());
        for first_undoes_first in [false, true] {
            let store = MemoryStore::new();
            assert!(store.count(1, &q, now, 1).admitted);
            let base = store.tat(1);
            let (a, a_before) = store.update(1, &|| now, |t, n| gcra::decide(&q, t, n, 2));
            let (b, b_before) = store.update(1, &|| now, |t, n| gcra::decide(&q, t, n, 3));
            assert_eq!((a_before, b_before), (base, a.tat));
            let a = (a_before, a.tat, 2 * i);
            let b = (b_before, b.tat, 3 * i);
            let order = if first_undoes_first { [a, b] } else { [b, a] };
            for (before, ours, charge) in order {
                store.undo(1, before, ours, charge, &|| now);
            }
            assert_eq!(
                store.tat(1),
                base,
                "first undoes first: {first_undoes_first}"
            );
        }
    }

    /// Commits run in key order: a request naming its keys in the opposite order charges the
    /// smaller key first, so two such requests cannot each hold one key and undo each other.
    #[test]
    fn commits_charge_keys_in_key_order() {
        let store = MemoryStore::new();
        let q = Quota::new(SEC, 2, 2).unwrap();
        let i = q.interval();
        // Both keys exist, so the commit reads the clock under read locks only, and the clock
        // below can look at the store.
        assert!(store.count(4, &q, 0, 1).admitted && store.count(9, &q, 0, 1).admitted);
        let seen = std::cell::RefCell::new(Vec::new());
        let ops = [op(9, q, 1), op(4, q, 1)];
        let mut outcomes = vec![CounterOutcome::NONE; 2];
        assert!(!store.plan(&ops, &|| 0, &mut outcomes));
        let clock = || {
            seen.borrow_mut().push((store.tat(4), store.tat(9)));
            0
        };
        assert!(store.commit(&ops, &clock, &mut outcomes));
        // Key 4 is charged first: the clock read for key 9 already sees key 4 charged.
        let seen = seen.borrow();
        assert_eq!(seen.first(), Some(&(i, i)));
        assert_eq!(seen.last(), Some(&(2 * i, i)));
        assert_eq!((store.tat(4), store.tat(9)), (2 * i, 2 * i));
    }

    #[test]
    fn two_ops_on_one_key_both_count() {
        let store = MemoryStore::new();
        let q = Quota::new(60 * SEC, 3, 3).unwrap();
        let b = store.count_batch(&[op(7, q, 2), op(7, q, 1)], 0);
        assert!(!b.blocked);
        assert_eq!(b.outcomes[1].remaining, 0);
        let b = store.count_batch(&[op(7, q, 1)], 0);
        assert!(b.blocked);
    }

    #[test]
    fn shadow_denial_does_not_block_and_is_not_charged() {
        let store = MemoryStore::new();
        let q = Quota::new(60 * SEC, 1, 1).unwrap();
        let shadow = Op {
            mode: Mode::Shadow,
            ..op(1, q, 2)
        };
        let b = store.count_batch(&[shadow, op(2, q, 1)], 0);
        assert!(!b.blocked);
        assert!(!b.outcomes[0].admitted);
        assert_eq!(store.tat(1), 0);
        assert_eq!(store.tat(2), 60 * SEC);
    }

    #[test]
    fn quota_mode_blocks_only_when_all_quota_ops_are_over() {
        let store = MemoryStore::new();
        let q = Quota::new(60 * SEC, 1, 1).unwrap();
        let quota = |key| Op {
            mode: Mode::Quota,
            ..op(key, q, 1)
        };
        assert!(store.count(1, &q, 0, 1).admitted);
        assert!(!store.count_batch(&[quota(1), quota(2)], 0).blocked);
        assert!(store.count_batch(&[quota(1), quota(2)], 0).blocked);
    }

    #[test]
    fn refunds_apply_even_when_the_request_is_refused() {
        let store = MemoryStore::new();
        let q = Quota::new(60 * SEC, 2, 2).unwrap();
        assert!(store.count(1, &q, 0, 2).admitted);
        let refund = Op {
            charge: Charge::Refund,
            ..op(1, q, 1)
        };
        let b = store.count_batch(&[refund, op(2, Quota::ban(SEC), 1)], 0);
        assert!(b.blocked);
        assert_eq!(b.outcomes[0].remaining, 1);
        assert_eq!(store.tat(1), 30 * SEC);
    }

    #[test]
    fn the_key_limit_holds_and_evicts_the_closest_to_expiry() {
        let store = MemoryStore::with_max_keys(4);
        let q = Quota::new(SEC, 1, 1).unwrap();
        for key in 0..4u128 {
            assert!(store.count(key << 100, &q, 1, 1).admitted);
        }
        assert_eq!(store.len(), 4);
        // Full of live keys: the next key evicts one, counted.
        assert!(store.count(9 << 100, &q, 10, 1).admitted);
        assert_eq!(store.len(), 4);
        assert_eq!(store.evictions(), 1);
        // Once buckets are full again, evicting them is free and uncounted.
        assert!(store.count(10 << 100, &q, 10 * SEC, 1).admitted);
        assert_eq!((store.len(), store.evictions()), (4, 1));
    }

    #[test]
    fn an_entry_takes_24_bytes() {
        // A `u128` key would pad the entry to 32 (its 16-byte alignment on x86-64 and AArch64).
        assert_eq!(std::mem::size_of::<(PackedKey, AtomicU64)>(), 24);
    }

    #[test]
    fn sweep_removes_only_full_buckets() {
        let store = MemoryStore::new();
        let q = Quota::new(SEC, 1, 1).unwrap();
        assert!(store.count(1, &q, 0, 1).admitted);
        assert!(store.count(2, &q, SEC / 2, 1).admitted);
        assert_eq!(store.sweep(SEC), 1);
        assert_eq!(store.len(), 1);
        assert_eq!(store.tat(2), SEC + SEC / 2);
    }
}
