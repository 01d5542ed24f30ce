//! The only place sluice reads time for decisions: monotonic nanoseconds since the clock was
//! made, behind a [`Clock`] trait so tests and benchmarks can drive time by hand.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A monotonic source of nanoseconds. Never goes backwards.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Nanoseconds since an arbitrary fixed origin.
    fn now(&self) -> u64;
}

/// The process's monotonic clock.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    origin: Instant,
}

impl MonotonicClock {
    /// A clock whose origin is now.
    #[must_use]
    pub fn new() -> Self {
        Self {
            origin: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> u64 {
        // Truncation is fine: u64 nanoseconds last 584 years of uptime.
        self.origin.elapsed().as_nanos() as u64
    }
}

/// A clock that moves only when told to, for tests and benchmarks.
#[derive(Debug, Default)]
pub struct ManualClock {
    /// Nanoseconds; Relaxed suffices, it publishes no other data.
    nanos: AtomicU64,
}

impl ManualClock {
    /// A clock reading `nanos`.
    #[must_use]
    pub fn new(nanos: u64) -> Self {
        Self {
            nanos: AtomicU64::new(nanos),
        }
    }

    /// Moves the clock forward by `nanos`.
    pub fn advance(&self, nanos: u64) {
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Sets the clock to `nanos`; ignored if that would move it backwards.
    pub fn set(&self, nanos: u64) {
        self.nanos.fetch_max(nanos, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> u64 {
        self.nanos.load(Ordering::Relaxed)
    }
}
