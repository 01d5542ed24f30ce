//! Degraded local mode (`on_backend_error: local`): while Redis cannot decide, this node counts in
//! its own memory, each quota scaled to its share of the fleet ([`Quota::scaled`]: rate/N, burst
//! ceil(B/N)), N being the configured fleet size or else the live nodes last seen through Redis
//! heartbeats. [`LocalFallback`] also keeps the node's backend mode and counts who answered each
//! decision. It holds no policy and knows nothing of Redis, the runtime or metrics: the decision
//! layer tells it when Redis failed or answered again, the heartbeat how many nodes are live.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::limiter::batch::{Batch, Op};
use crate::limiter::clock::Clock;
use crate::limiter::gcra::Quota;
use crate::limiter::share::ShareBook;
use crate::limiter::store::MemoryStore;

/// Which counter answers this node's decisions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendMode {
    /// The shared counter in Redis, exact.
    Shared,
    /// Tokens leased from the shared counter and spent locally.
    Leased,
    /// This node's own memory at rate/N, because Redis cannot decide.
    Local,
}

impl BackendMode {
    /// Every mode, in the order metrics list them.
    pub const ALL: [Self; 3] = [Self::Shared, Self::Leased, Self::Local];

    /// The metric label.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Shared => "shared",
            Self::Leased => "leased",
            Self::Local => "local",
        }
    }
}

/// The local fallback's figures at one instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalFigures {
    /// The current mode.
    pub mode: BackendMode,
    /// Decisions answered by the Redis backend (its over-limit cache included).
    pub by_redis: u64,
    /// Decisions answered by the local store while Redis could not decide.
    pub by_local: u64,
    /// N, the number of nodes a budget is divided among in local mode.
    pub fleet_size: u64,
    /// Counters held by the local store.
    pub keys: usize,
}

/// The local store, the fleet size, the current mode and the decision counts of one node.
///
/// This is the "local buckets at limit/N" way of sharing a budget, used only while the shared
/// counter is out of reach: some waste (the fleet may admit up to N·ceil(B/N) ≥ B at the switch,
/// and a wrong N scales the fleet's rate by N_actual/N) instead of admitting everyone or no one.
/// Entering local mode starts from the local store as it is: full buckets, except for counters it
/// counted in an outage moments before (they keep that debt until swept).
#[derive(Debug)]
pub struct LocalFallback {
    store: MemoryStore,
    clock: Arc<dyn Clock>,
    /// `redis.fleet_size`: when set, N, whatever the heartbeats see.
    fixed: Option<u64>,
    /// Live nodes in the last heartbeat answered (0 before the first).
    seen: AtomicU64,
    /// Whether the node counts locally now.
    local: AtomicBool,
    by_redis: AtomicU64,
    by_local: AtomicU64,
    /// The shares this node held of contended counters, counted at instead of rate/N.
    shares: Option<Arc<ShareBook>>,
}

impl LocalFallback {
    /// A fallback counting in `store` at `clock`'s time; `fleet_size` fixes N, `None` leaves it
    /// to [`LocalFallback::see_fleet`]. It starts in shared mode.
    #[must_use]
    pub fn new(store: MemoryStore, clock: Arc<dyn Clock>, fleet_size: Option<u64>) -> Self {
        Self {
            store,
            clock,
            fixed: fleet_size,
            seen: AtomicU64::new(0),
            local: AtomicBool::new(false),
            by_redis: AtomicU64::new(0),
            by_local: AtomicU64::new(0),
            shares: None,
        }
    }

    /// This fallback, counting a counter this node held a share of at that share (rate r_i,
    /// burst b_i) instead of at rate/N. The shares of a counter were consistent when Redis
    /// went away (their rates add up to at most R), so the fleet stays within R for it.
    #[must_use]
    pub fn with_shares(mut self, shares: Arc<ShareBook>) -> Self {
        self.shares = Some(shares);
        self
    }

    /// N: the configured fleet size, else the live nodes last seen, at least 1.
    #[must_use]
    pub fn fleet_size(&self) -> u64 {
        // Relaxed: an independent figure; a decision made with the previous N is as good.
        self.fixed
            .unwrap_or_else(|| self.seen.load(Ordering::Relaxed))
            .max(1)
    }

    /// Records the live nodes a heartbeat saw (this one included).
    pub fn see_fleet(&self, live: u64) {
        self.seen.store(live, Ordering::Relaxed);
    }

    /// Whether the node counts locally now.
    #[must_use]
    pub fn is_local(&self) -> bool {
        // Relaxed: the flag guards no other data; the store is safe to use in either mode.
        self.local.load(Ordering::Relaxed)
    }

    /// Switches to local counting; `Some(N)` when this call made the switch (so the caller logs
    /// it once), `None` when the node already counted locally.
    pub fn enter(&self) -> Option<u64> {
        // Relaxed: see `is_local`; the exchange alone makes one caller the switcher.
        self.local
            .compare_exchange(false, true, Ordering::Relaxed, Ordering::Relaxed)
            .ok()
            .map(|_| self.fleet_size())
    }

    /// Switches back to shared counting; true when this call made the switch.
    pub fn leave(&self) -> bool {
        self.local
            .compare_exchange(true, false, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// Counts a decision the Redis backend answered.
    pub fn answered_by_redis(&self) {
        self.by_redis.fetch_add(1, Ordering::Relaxed);
    }

    /// Decides a request's ops in the local store, all or nothing, each quota scaled to rate/N
    /// with burst ceil(B/N), and counts it as answered locally.
    pub fn count(&self, ops: &[Op]) -> Batch {
        self.by_local.fetch_add(1, Ordering::Relaxed);
        if ops.is_empty() {
            return Batch::empty();
        }
        let n = self.fleet_size();
        let scaled: Vec<Op> = ops
            .iter()
            .map(|op| Op {
                quota: self.quota_of(op, n),
                ..*op
            })
            .collect();
        self.store.count_batch_with(&scaled, &|| self.clock.now())
    }

    /// Drops local counters whose bucket is full again; how many were dropped.
    pub fn sweep(&self) -> usize {
        self.store.sweep(self.clock.now())
    }

    /// The figures, read now.
    #[must_use]
    pub fn figures(&self) -> LocalFigures {
        LocalFigures {
            mode: if self.is_local() {
                BackendMode::Local
            } else {
                BackendMode::Shared
            },
            by_redis: self.by_redis.load(Ordering::Relaxed),
            by_local: self.by_local.load(Ordering::Relaxed),
            fleet_size: self.fleet_size(),
            keys: self.store.len(),
        }
    }

    /// The quota a counter of `quota` is decided with in local mode now, when it holds no
    /// share.
    #[must_use]
    pub fn local_quota(&self, quota: &Quota) -> Quota {
        quota.scaled(self.fleet_size())
    }

    /// The quota `op`'s counter is decided with in local mode: its share when this node held
    /// one, else rate/`n`.
    fn quota_of(&self, op: &Op, n: u64) -> Quota {
        self.shares
            .as_ref()
            .and_then(|book| book.share(op.key, &op.quota))
            .unwrap_or_else(|| op.quota.scaled(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::batch::{Charge, Mode};
    use crate::limiter::clock::ManualClock;
    use crate::limiter::gcra::NANOS_PER_SEC as SEC;

    fn op(key: u128, quota: Quota) -> Op {
        Op {
            key,
            quota,
            cost: 1,
            charge: Charge::Ask,
            mode: Mode::Enforce,
        }
    }

    #[test]
    fn n_is_the_fixed_size_else_the_last_seen_at_least_one() {
        let clock = Arc::new(ManualClock::new(SEC));
        let learned = LocalFallback::new(MemoryStore::new(), clock.clone(), None);
        assert_eq!(learned.fleet_size(), 1, "nothing seen yet");
        learned.see_fleet(3);
        assert_eq!(learned.fleet_size(), 3);
        learned.see_fleet(0);
        assert_eq!(learned.fleet_size(), 1);
        let fixed = LocalFallback::new(MemoryStore::new(), clock, Some(5));
        fixed.see_fleet(2);
        assert_eq!(fixed.fleet_size(), 5, "the setting wins over heartbeats");
    }

    #[test]
    fn switching_happens_once_each_way() {
        let f = LocalFallback::new(MemoryStore::new(), Arc::new(ManualClock::new(SEC)), None);
        f.see_fleet(2);
        assert_eq!(f.figures().mode, BackendMode::Shared);
        assert!(!f.leave(), "already shared");
        assert_eq!(f.enter(), Some(2));
        assert_eq!(f.enter(), None, "already local: no second switch to log");
        assert_eq!(f.figures().mode, BackendMode::Local);
        assert!(f.leave());
        assert!(!f.leave());
        assert_eq!(f.figures().mode, BackendMode::Shared);
    }

    #[test]
    fn local_counting_admits_the_nodes_share() {
        let clock = Arc::new(ManualClock::new(1_000 * SEC));
        let f = LocalFallback::new(MemoryStore::new(), clock.clone(), Some(2));
        let q = Quota::new(SEC, 10, 5).unwrap(); // 10/s, burst 5: here 5/s, burst 3
        assert_eq!(f.local_quota(&q), q.scaled(2));
        let admitted = |n: usize| (0..n).filter(|_| !f.count(&[op(1, q)]).blocked).count();
        assert_eq!(admitted(10), 3, "ceil(5 / 2) at once");
        clock.advance(SEC / 5 - 1);
        assert_eq!(admitted(1), 0, "one more only after T·N = 200 ms");
        clock.advance(1);
        assert_eq!(admitted(5), 1);
        // All or nothing across a request's ops, as in the memory backend.
        let both = f.count(&[op(2, q), op(1, q)]);
        assert!(both.blocked);
        assert_eq!(admitted(0), 0);
        let figures = f.figures();
        assert_eq!(
            (figures.by_local, figures.by_redis, figures.keys),
            (17, 0, 1)
        );
        clock.advance(10 * SEC);
        assert_eq!(f.sweep(), 1, "a full bucket is swept");
    }

    #[test]
    fn a_counter_this_node_held_a_share_of_is_counted_at_that_share() {
        let clock = Arc::new(ManualClock::new(1_000 * SEC));
        let q = Quota::new(SEC, 100, 20).unwrap();
        let book = Arc::new(ShareBook::new());
        // Three quarters of the rate and of the burst, where rate/2 would give half.
        let share = q.portion(750_000, 15);
        book.hold(1, crate::limiter::share::Grant { quota: q, share });
        let f = LocalFallback::new(MemoryStore::new(), clock.clone(), Some(2))
            .with_shares(Arc::clone(&book));
        let admitted = |key: u128| (0..40).filter(|_| !f.count(&[op(key, q)]).blocked).count();
        assert_eq!(admitted(1), 15, "the share's burst");
        assert_eq!(admitted(2), 10, "no share: ceil(20 / 2)");
        clock.advance(SEC / 10);
        assert_eq!(
            admitted(1),
            7,
            "75 a second at the share's rate: 7.5 in 100 ms"
        );
        assert_eq!(admitted(2), 5, "50 a second at rate/2");
        let other_rule = Quota::new(SEC, 50, 20).unwrap();
        assert_eq!(
            f.count(&[op(3, other_rule)]).outcomes[0].remaining,
            9,
            "a share is for the rule it was granted under"
        );
    }
}
