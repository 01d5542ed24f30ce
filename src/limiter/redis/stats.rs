//! Counters of the Redis backend, kept as plain atomics and rendered by `metrics` at scrape
//! time (so the limiter needs no metrics library).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::histogram::LatencyHistogram;

/// Error kinds counted separately.
pub const ERROR_KINDS: [&str; 4] = ["timeout", "connection", "breaker_open", "redis"];

/// Relaxed everywhere: independent statistics, read at scrape time.
#[derive(Debug, Default)]
pub struct RedisStats {
    round_trips: AtomicU64,
    cache_hits: AtomicU64,
    errors: [AtomicU64; 4],
    latency: LatencyHistogram,
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

    pub(super) fn record_latency(&self, d: Duration) {
        self.latency.record(d);
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

    /// Round-trip latency.
    #[must_use]
    pub fn latency(&self) -> &LatencyHistogram {
        &self.latency
    }
}
