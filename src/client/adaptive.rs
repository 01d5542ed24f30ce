//! An adaptive concurrency limit ([`AdaptiveLimit`]) for the calls a service makes to its own
//! downstream (the database, the GPU endpoint): the in-flight budget shrinks as the downstream's
//! round-trip time climbs, so the service backs off before sluice (or the downstream) has to
//! refuse it. The algorithms are those of the `tower-resilience-adaptive` crate (Netflix
//! concurrency-limits' family; maintained, and its algorithms take a measured latency rather
//! than reading a clock, so they can be driven by scripted latencies). This module adds what a
//! downstream call needs that is not a tower service: a [`Permit`] per call, the in-flight
//! count, and an injected [`Clock`] that measures each call's round trip.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub use tower_resilience_adaptive::{Aimd, ConcurrencyAlgorithm, Gradient2, Vegas};

/// A monotonic clock: the time since some fixed origin.
pub trait Clock: Send + Sync {
    /// Now, since the clock's origin.
    fn now(&self) -> Duration;
}

impl<F: Fn() -> Duration + Send + Sync> Clock for F {
    fn now(&self) -> Duration {
        self()
    }
}

/// The process's monotonic clock, from when it was made.
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock(Instant);

impl Default for MonotonicClock {
    fn default() -> Self {
        Self(Instant::now())
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// An adaptive limit on concurrent calls to one downstream. Cheap to clone; clones share it.
///
/// Which algorithm, as concurrency-limits recommends:
/// - [`Vegas`] (delay-based, for a service protecting a downstream it alone loads): keeps the
///   minimum RTT seen as the no-load baseline and a smoothed RTT (EMA, factor ½); after 10
///   samples, `queue = (rtt_smoothed − rtt_min) / rtt_min · limit`; the limit grows by 1 while
///   `queue < α` (3), shrinks by 1 while `queue > β` (6), and halves on a failure. The minimum
///   is never forgotten (Netflix's Vegas probes it again now and then): after a lasting
///   slowdown of the downstream itself, make a new limit.
/// - [`Gradient2`]: compares the latest RTT with a long-term average (EMA over 600 samples):
///   `limit ← (1 − s)·limit + s·(clamp(1.5 · rtt_long / rtt, ½, 1) · limit + ⌈log₁₀ limit⌉)`
///   with smoothing `s` = 0.2, only while at least half the limit is in flight.
/// - [`Aimd`] (loss-based, for a client of a shared downstream, where latency is noisy): +1 per
///   success, × 0.5 on a failure or a round trip above a threshold.
///
/// All keep the limit within the bounds their builder sets.
#[derive(Clone)]
pub struct AdaptiveLimit {
    inner: Arc<Inner>,
}

struct Inner {
    algorithm: Box<dyn ConcurrencyAlgorithm>,
    clock: Box<dyn Clock>,
    /// Calls holding a permit. Relaxed: it is the only value the admission check reads, and
    /// read-modify-writes of one atomic are totally ordered whatever the ordering.
    in_flight: AtomicUsize,
}

impl std::fmt::Debug for AdaptiveLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdaptiveLimit")
            .field("limit", &self.limit())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

impl AdaptiveLimit {
    /// A limit adapted by `algorithm`, timing calls with the monotonic clock.
    pub fn new(algorithm: impl ConcurrencyAlgorithm + 'static) -> Self {
        Self::with_clock(algorithm, MonotonicClock::default())
    }

    /// A limit adapted by `algorithm`, timing calls with `clock`.
    pub fn with_clock(
        algorithm: impl ConcurrencyAlgorithm + 'static,
        clock: impl Clock + 'static,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                algorithm: Box::new(algorithm),
                clock: Box::new(clock),
                in_flight: AtomicUsize::new(0),
            }),
        }
    }

    /// The current limit on calls in flight.
    pub fn limit(&self) -> usize {
        self.inner.algorithm.limit()
    }

    /// Calls in flight now.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::Relaxed)
    }

    /// A permit for one call, or `None` when the limit is reached: the call should not be made
    /// now (shed it, or queue it in the caller).
    pub fn try_acquire(&self) -> Option<Permit> {
        let limit = self.limit();
        self.inner
            .in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()?;
        Some(Permit {
            inner: Arc::clone(&self.inner),
            started: self.inner.clock.now(),
        })
    }
}

/// One call in flight. Report how it ended: [`Permit::success`] (the RTT is a sample),
/// [`Permit::failure`] (the downstream failed or timed out: a congestion signal), or dropping
/// the permit unreported (cancelled: no sample).
#[must_use = "report the call's outcome with success() or failure()"]
pub struct Permit {
    inner: Arc<Inner>,
    started: Duration,
}

impl Permit {
    /// The call succeeded: its round trip is a sample.
    pub fn success(self) {
        let rtt = self.inner.clock.now().saturating_sub(self.started);
        // The completing call still counts as in flight: the load its RTT was measured under.
        let in_flight = self.inner.in_flight.load(Ordering::Relaxed);
        self.inner
            .algorithm
            .record_success_with_load(rtt, in_flight);
    }

    /// The call failed or timed out in a way that means the downstream is overloaded.
    pub fn failure(self) {
        self.inner.algorithm.record_failure();
    }

    /// How long the call has been in flight.
    pub fn elapsed(&self) -> Duration {
        self.inner.clock.now().saturating_sub(self.started)
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.inner.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    /// A clock the test moves by hand, in microseconds.
    #[derive(Clone, Default)]
    struct TestClock(Arc<AtomicU64>);

    impl TestClock {
        fn advance(&self, by: Duration) {
            let micros = u64::try_from(by.as_micros()).expect("small");
            self.0.fetch_add(micros, Ordering::Relaxed);
        }
        fn as_clock(&self) -> impl Clock + 'static {
            let t = Arc::clone(&self.0);
            move || Duration::from_micros(t.load(Ordering::Relaxed))
        }
    }

    /// Runs `rounds` rounds of calls, each round as many calls as the limit allows, all
    /// started together and finished after `rtt(round)`; returns the limit after each round.
    fn drive(
        limit: &AdaptiveLimit,
        clock: &TestClock,
        rounds: usize,
        rtt: impl Fn(usize) -> Duration,
    ) -> Vec<usize> {
        (0..rounds)
            .map(|round| {
                let permits: Vec<Permit> = std::iter::from_fn(|| limit.try_acquire())
                    .take(1_000)
                    .collect();
                clock.advance(rtt(round));
                permits.into_iter().for_each(Permit::success);
                limit.limit()
            })
            .collect()
    }

    fn vegas(clock: &TestClock) -> AdaptiveLimit {
        let algorithm = Vegas::builder()
            .initial_limit(10)
            .min_limit(2)
            .max_limit(50)
            .build()
            .expect("valid");
        AdaptiveLimit::with_clock(algorithm, clock.as_clock())
    }

    #[test]
    fn permits_stop_at_the_limit_and_come_back_when_dropped() {
        let clock = TestClock::default();
        let limit = vegas(&clock);
        let permits: Vec<Permit> = std::iter::from_fn(|| limit.try_acquire())
            .take(100)
            .collect();
        assert_eq!(permits.len(), 10);
        assert_eq!(limit.in_flight(), 10);
        assert!(limit.try_acquire().is_none());
        drop(permits);
        assert_eq!(limit.in_flight(), 0);
        // Dropped unreported: cancelled, no sample, the limit unchanged.
        assert_eq!(limit.limit(), 10);
        assert!(limit.try_acquire().is_some());
    }

    #[test]
    fn vegas_grows_at_the_minimum_rtt_and_shrinks_when_it_climbs() {
        let clock = TestClock::default();
        let limit = vegas(&clock);
        // Latency stays at its minimum: the limit grows, to the maximum.
        let grown = drive(&limit, &clock, 40, |_| Duration::from_millis(10));
        assert!(grown.windows(2).all(|w| w[1] >= w[0]), "{grown:?}");
        assert_eq!(*grown.last().unwrap(), 50, "{grown:?}");
        // Latency climbs (queueing downstream): the limit falls, to the minimum.
        let shrunk = drive(&limit, &clock, 40, |round| {
            Duration::from_millis(10 + 5 * round as u64)
        });
        assert!(shrunk.windows(2).all(|w| w[1] <= w[0]), "{shrunk:?}");
        assert!(*shrunk.last().unwrap() < 50 / 2, "{shrunk:?}");
        let bottom = drive(&limit, &clock, 200, |_| Duration::from_millis(500));
        assert_eq!(*bottom.last().unwrap(), 2, "bounded below: {bottom:?}");
    }

    #[test]
    fn gradient2_grows_at_its_baseline_and_shrinks_when_latency_climbs() {
        let clock = TestClock::default();
        let algorithm = Gradient2::builder()
            .initial_limit(10)
            .min_limit(2)
            .max_limit(100)
            .build()
            .expect("valid");
        let limit = AdaptiveLimit::with_clock(algorithm, clock.as_clock());
        let grown = drive(&limit, &clock, 30, |_| Duration::from_millis(10));
        assert!(*grown.last().unwrap() > 10, "{grown:?}");
        let top = *grown.last().unwrap();
        let shrunk = drive(&limit, &clock, 30, |round| {
            Duration::from_millis(10 * (2 + round as u64))
        });
        assert!(*shrunk.last().unwrap() < top / 2, "{shrunk:?}");
        assert!(shrunk.iter().all(|&l| l >= 2));
    }

    #[test]
    fn aimd_grows_per_success_and_halves_on_slow_or_failed_calls() {
        let clock = TestClock::default();
        let algorithm = Aimd::builder()
            .initial_limit(10)
            .min_limit(1)
            .max_limit(40)
            .latency_threshold(Duration::from_millis(50))
            .build()
            .expect("valid");
        let limit = AdaptiveLimit::with_clock(algorithm, clock.as_clock());
        let permit = limit.try_acquire().expect("room");
        clock.advance(Duration::from_millis(5));
        permit.success();
        assert_eq!(limit.limit(), 11);
        let permit = limit.try_acquire().expect("room");
        clock.advance(Duration::from_millis(80));
        permit.success();
        assert_eq!(
            limit.limit(),
            5,
            "a round trip over the threshold halves it"
        );
        limit.try_acquire().expect("room").failure();
        assert_eq!(limit.limit(), 2);
        let grown = drive(&limit, &clock, 20, |_| Duration::from_millis(5));
        assert_eq!(*grown.last().unwrap(), 40, "bounded above: {grown:?}");
    }
}
