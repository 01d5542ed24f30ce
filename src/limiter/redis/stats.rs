//! Counters of the Redis backend, kept as plain atomics and rendered by `metrics` at scrape
//! time (so the limiter needs no metrics library).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the round-trip latency buckets, in seconds (1 µs to 100 ms).
pub const LATENCY_BUCKETS: [f64; 16] = [
    0.000_001,
    0.000_002_5,
    0.000_005,
    0.000_01,
    0.000_025,
    0.000_05,
    0.000_1,
    0.000_25,
    0.000_5,
    0.001,
    0.002_5,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
];

/// Error kinds counted separately.
pub const ERROR_KINDS: [&str; 4] = ["timeout", "connection", "breaker_open", "redis"];

/// Relaxed everywhere: independent statistics, read at scrape time.
#[derive(Debug, Default)]
pub struct RedisStats {
    round_trips: AtomicU64,
    cache_hits: AtomicU64,
    errors: [AtomicU64; 4],
    /// Cumulative-free bucket counts (one per bound, plus +Inf last).
    buckets: [AtomicU64; 17],
    latency_sum_ns: AtomicU64,
}

impl RedisStats {
    pub(super) fn round_trip(&self) {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn cache_hit(&self) {
        self.cache_hits.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn error(&self, kind: &str) {
        if let Some(i) = ERROR_KINDS.iter().position(|k| *k == kind) {
            self.errors[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(super) fn latency(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = LATENCY_BUCKETS
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.latency_sum_ns.fetch_add(
            u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Script calls sent to Redis.
    #[must_use]
    pub fn round_trips(&self) -> u64 {
        self.round_trips.load(Ordering::Relaxed)
    }

    /// Requests answered from the local over-limit cache.
    #[must_use]
    pub fn cache_hits(&self) -> u64 {
        self.cache_hits.load(Ordering::Relaxed)
    }

    /// Failed calls of each kind: timeout, connection, breaker_open, redis.
    #[must_use]
    pub fn errors(&self) -> [(&'static str, u64); 4] {
        std::array::from_fn(|i| (ERROR_KINDS[i], self.errors[i].load(Ordering::Relaxed)))
    }

    /// Latency histogram: per-bucket counts (not cumulative, +Inf last) and the sum in seconds.
    #[must_use]
    pub fn latency_histogram(&self) -> ([u64; 17], f64) {
        let counts = std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed));
        // Precision loss is irrelevant for a latency sum.
        let sum = self.latency_sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        (counts, sum)
    }
}
