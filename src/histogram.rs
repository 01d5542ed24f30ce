//! A latency histogram of plain atomics with fixed buckets: recording is one bucket increment
//! and one sum increment, memory is constant, and nothing needs draining between scrapes. Used
//! for the decision latency and for Redis round trips, and rendered in the Prometheus text
//! format by [`crate::metrics`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in seconds (1 µs to 100 ms); a last bucket takes the rest.
pub const BUCKETS: [f64; 16] = [
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

/// The same bounds in nanoseconds, for recording without floating point.
const BUCKET_NANOS: [u64; BUCKETS.len()] = {
    let mut nanos = [0; BUCKETS.len()];
    let mut i = 0;
    while i < BUCKETS.len() {
        // Rounded to the nearest nanosecond; every bound is a whole number of them.
        nanos[i] = (BUCKETS[i] * 1e9 + 0.5) as u64;
        i += 1;
    }
    nanos
};

/// Relaxed everywhere: independent statistics, read at scrape time.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// Per-bucket counts, not cumulative; `+Inf` last.
    buckets: [AtomicU64; BUCKETS.len() + 1],
    sum_ns: AtomicU64,
}

impl LatencyHistogram {
    /// Counts one observation of `d`.
    pub fn record(&self, d: Duration) {
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let i = BUCKET_NANOS.partition_point(|&bound| bound < nanos);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(nanos, Ordering::Relaxed);
    }

    /// The counts and sum now.
    #[must_use]
    pub fn snapshot(&self) -> LatencySnapshot {
        LatencySnapshot {
            counts: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
            // Precision loss is irrelevant for a latency sum.
            sum_seconds: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        }
    }
}

/// A histogram's figures at one instant.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatencySnapshot {
    /// Per-bucket counts, not cumulative, one per bound of the histogram's buckets (1 µs to 100 ms) and `+Inf` last.
    pub counts: [u64; BUCKETS.len() + 1],
    /// The sum of every observation, in seconds.
    pub sum_seconds: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nanosecond_bounds_are_the_second_bounds() {
        assert_eq!(
            BUCKET_NANOS,
            [
                1_000,
                2_500,
                5_000,
                10_000,
                25_000,
                50_000,
                100_000,
                250_000,
                500_000,
                1_000_000,
                2_500_000,
                5_000_000,
                10_000_000,
                25_000_000,
                50_000_000,
                100_000_000,
            ]
        );
    }

    #[test]
    fn observations_land_in_the_first_bucket_that_holds_them() {
        let h = LatencyHistogram::default();
        h.record(Duration::from_nanos(1_000)); // on the bound: le="0.000001"
        h.record(Duration::from_nanos(1_001));
        h.record(Duration::from_micros(900));
        h.record(Duration::from_secs(1)); // past the last bound: +Inf
        let LatencySnapshot {
            counts,
            sum_seconds: sum,
        } = h.snapshot();
        assert_eq!(counts[0], 1);
        assert_eq!(counts[1], 1);
        assert_eq!(counts[9], 1);
        assert_eq!(counts[16], 1);
        assert_eq!(counts.iter().sum::<u64>(), 4);
        assert!((sum - 1.000_902_001).abs() < 1e-9);
    }
}
