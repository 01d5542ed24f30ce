//! Counters of the Redis backend, kept as plain atomics and read into [`RedisFigures`] at scrape
//! time (so the limiter needs no metrics library).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::BreakerState;
use crate::histogram::{LatencyHistogram, LatencySnapshot};
use crate::limiter::ErrorKind;

/// Relaxed everywhere: independent statistics, read at scrape time.
#[derive(Debug, Default)]
pub(super) struct RedisStats {
    round_trips: AtomicU64,
    requests: AtomicU64,
    cache_hits: AtomicU64,
    errors: [AtomicU64; ErrorKind::ALL.len()],
    latency: LatencyHistogram,
}

/// The Redis backend's figures at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct RedisFigures {
    /// Script calls sent.
    pub round_trips: u64,
    /// Requests those calls decided (more than one per call when coalesced).
    pub requests: u64,
    /// Requests refused from the local over-limit cache.
    pub cache_hits: u64,
    /// Failed calls of each kind.
    pub errors: [(ErrorKind, u64); ErrorKind::ALL.len()],
    /// Whether a connection is established.
    pub connected: bool,
    /// The circuit breaker's state.
    pub breaker: BreakerState,
    /// Round-trip latency.
    pub latency: LatencySnapshot,
}

impl RedisStats {
    pub(super) fn round_trip(&self) {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
    }

    /// A request sent to Redis (alone or coalesced with others in one call).
    pub(super) fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn cache_hit(&self) {
        self.cache_hits.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn error(&self, kind: ErrorKind) {
        self.errors[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn record_latency(&self, d: Duration) {
        self.latency.record(d);
    }

    pub(super) fn figures(&self, connected: bool, breaker: BreakerState) -> RedisFigures {
        RedisFigures {
            round_trips: self.round_trips.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            errors: ErrorKind::ALL.map(|k| (k, self.errors[k.index()].load(Ordering::Relaxed))),
            connected,
            breaker,
            latency: self.latency.snapshot(),
        }
    }
}
