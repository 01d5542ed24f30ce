//! The leased store's life: its start, the maintenance that ends slices as they age and gives
//! their unused tokens back (and drops idle leases and stale shares), and its close, which
//! waits for the calls in flight, gives shares up and returns every unused token. Nothing here
//! decides a request.

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;

use super::{LeaseConfig, LeaseStats, LeasedStore, lock};
use crate::limiter::clock::Clock;
use crate::limiter::gcra::Quota;
use crate::limiter::key::Key;
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::heartbeat::random_id;
use crate::limiter::redis::lease::heat::HeatTable;
use crate::limiter::share::ShareBook;

impl LeasedStore {
    /// Leases over `redis`, aged by `clock` (the same clock the store was given).
    #[must_use]
    pub fn new(redis: Arc<RedisStore>, config: LeaseConfig, clock: Arc<dyn Clock>) -> Arc<Self> {
        Arc::new(Self {
            redis,
            config,
            clock,
            leases: DashMap::default(),
            heat: HeatTable::new(config.min_rate),
            closed: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            stats: LeaseStats::default(),
            node: random_id(),
            book: Arc::new(ShareBook::new()),
        })
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
            let n = l.give_back(now, max_age);
            if n > 0 {
                back.push((*entry.key(), l.quota, n));
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
            let shared: HashSet<Key> = self
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
