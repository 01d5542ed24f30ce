//! Counters of the Redis backend, kept as plain atomics and read into [`RedisFigures`] at scrape
//! time (so the limiter needs no metrics library).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::histogram::LatencyHistogram;
use crate::limiter::error::ErrorKind;
use crate::limiter::figures::{BreakerState, Purpose, RedisFigures};

/// Relaxed everywhere: independent statistics, read at scrape time.
#[derive(Debug, Default)]
pub(super) struct RedisStats {
    round_trips: AtomicU64,
    by_purpose: [AtomicU64; Purpose::ALL.len()],
    requests: AtomicU64,
    cache_hits: AtomicU64,
    repairs: AtomicU64,
    /// Clock nanoseconds of the last failure logged, plus one (0: none yet).
    logged_at: AtomicU64,
    errors: [AtomicU64; ErrorKind::ALL.len()],
    latency: LatencyHistogram,
}

impl RedisStats {
    /// A round trip for `purpose` begins: counted now, its duration observed when the guard
    /// drops (when the reply is read, or when the call is given up at its deadline).
    pub(super) fn round_trip(&self, purpose: Purpose) -> RoundTrip<'_> {
        self.round_trips.fetch_add(1, Ordering::Relaxed);
        self.by_purpose[purpose.index()].fetch_add(1, Ordering::Relaxed);
        RoundTrip {
            stats: self,
            started: Instant::now(),
        }
    }

    /// A request sent to Redis (alone or coalesced with others in one call).
    pub(super) fn request(&self) {
        self.requests.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn cache_hit(&self) {
        self.cache_hits.fetch_add(1, Ordering::Relaxed);
    }

    /// Counters a script call found holding no TAT and repaired: a fact about those keys (a
    /// shared Redis, a key-prefix collision, a hand-made write), logged, never an error.
    pub(super) fn repaired(&self, n: u64) {
        if n > 0 {
            self.repairs.fetch_add(n, Ordering::Relaxed);
            tracing::warn!(
                counters = n,
                "redis counters held no valid TAT; read as absent (a full bucket) and rewritten"
            );
        }
    }

    /// Whether a failed call at `now` (clock nanoseconds) may be logged: one a second at most,
    /// so that a failing Redis cannot flood the log from the request path.
    pub(super) fn may_log(&self, now: u64) -> bool {
        let last = self.logged_at.load(Ordering::Relaxed);
        (last == 0 || now.saturating_add(1).saturating_sub(last) >= 1_000_000_000)
            && self
                .logged_at
                .compare_exchange(
                    last,
                    now.saturating_add(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
    }

    pub(super) fn error(&self, kind: ErrorKind) {
        self.errors[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn figures(&self, connected: bool, breaker: BreakerState) -> RedisFigures {
        RedisFigures {
            round_trips: self.round_trips.load(Ordering::Relaxed),
            round_trips_by_purpose: Purpose::ALL
                .map(|p| (p, self.by_purpose[p.index()].load(Ordering::Relaxed))),
            requests: self.requests.load(Ordering::Relaxed),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            counter_repairs: self.repairs.load(Ordering::Relaxed),
            errors: ErrorKind::ALL.map(|k| (k, self.errors[k.index()].load(Ordering::Relaxed))),
            connected,
            breaker,
            latency: self.latency.snapshot(),
        }
    }
}

/// One round trip in flight; its duration goes into the latency histogram when it drops.
#[must_use = "the round trip is observed when the guard drops"]
pub(super) struct RoundTrip<'a> {
    stats: &'a RedisStats,
    started: Instant,
}

impl Drop for RoundTrip<'_> {
    fn drop(&mut self) {
        self.stats.latency.record(self.started.elapsed());
    }
}
