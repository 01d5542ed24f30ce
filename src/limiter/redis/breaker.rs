//! A circuit breaker: after `threshold` consecutive failures it opens, and for `cooldown` every
//! call is refused at once instead of waiting on a dead Redis; then one probe call goes through
//! (half-open), and its result closes or re-opens the breaker. Time comes from the backend's
//! injected clock.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::limiter::clock::Clock;
use crate::limiter::figures::BreakerState;

#[derive(Debug)]
struct Inner {
    failures: u32,
    /// Clock nanoseconds when it opened.
    opened_at: Option<u64>,
    probing: bool,
}

/// The breaker. A mutex is fine here: it is held for a few instructions, never across an await.
#[derive(Debug)]
pub(super) struct Breaker {
    threshold: u32,
    cooldown: u64,
    clock: Arc<dyn Clock>,
    inner: Mutex<Inner>,
}

impl Breaker {
    /// A closed breaker; `threshold` 0 disables it.
    pub(super) fn new(threshold: u32, cooldown: Duration, clock: Arc<dyn Clock>) -> Self {
        Self {
            threshold,
            cooldown: u64::try_from(cooldown.as_nanos()).unwrap_or(u64::MAX),
            clock,
            inner: Mutex::new(Inner {
                failures: 0,
                opened_at: None,
                probing: false,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn cooling(&self, opened_at: u64) -> bool {
        self.clock.now().saturating_sub(opened_at) < self.cooldown
    }

    pub(super) fn state(&self) -> BreakerState {
        let inner = self.lock();
        match inner.opened_at {
            None => BreakerState::Closed,
            Some(at) if self.cooling(at) => BreakerState::Open,
            Some(_) => BreakerState::HalfOpen,
        }
    }

    /// Whether a call may go to Redis now.
    pub(super) fn allow(&self) -> bool {
        let mut inner = self.lock();
        match inner.opened_at {
            None => true,
            Some(at) if self.cooling(at) => false,
            Some(_) if inner.probing => false,
            Some(_) => {
                inner.probing = true;
                true
            }
        }
    }

    pub(super) fn success(&self) {
        let mut inner = self.lock();
        inner.failures = 0;
        inner.opened_at = None;
        inner.probing = false;
    }

    /// Records a failure; true when this failure opened the breaker.
    pub(super) fn failure(&self) -> bool {
        let mut inner = self.lock();
        if self.threshold == 0 {
            return false;
        }
        if inner.opened_at.is_some() {
            // A failed probe: open again for a full cool-down.
            let reopen = inner.probing;
            if reopen {
                inner.opened_at = Some(self.clock.now());
                inner.probing = false;
            }
            return reopen;
        }
        inner.failures += 1;
        if inner.failures >= self.threshold {
            inner.opened_at = Some(self.clock.now());
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::clock::ManualClock;

    #[test]
    fn opens_after_consecutive_failures_then_probes() {
        let clock = Arc::new(ManualClock::new(1_000));
        let b = Breaker::new(3, Duration::from_millis(30), clock.clone());
        let ms = 1_000_000;
        assert!(b.allow());
        assert!(!b.failure());
        assert!(!b.failure());
        b.success();
        assert!(!b.failure());
        assert!(!b.failure());
        assert!(b.failure(), "third consecutive failure opens it");
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.allow());
        clock.advance(30 * ms - 1);
        assert_eq!(
            b.state(),
            BreakerState::Open,
            "still cooling 1 ns before the end"
        );
        assert!(!b.allow());
        clock.advance(1);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(b.allow(), "one probe");
        assert!(!b.allow(), "only one");
        assert!(b.failure(), "a failed probe re-opens");
        assert!(!b.allow());
        clock.advance(29 * ms);
        assert!(!b.allow(), "a full cool-down from the failed probe");
        clock.advance(ms);
        assert!(b.allow());
        b.success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.allow() && b.allow());
    }

    #[test]
    fn a_zero_threshold_never_opens() {
        let b = Breaker::new(0, Duration::from_secs(1), Arc::new(ManualClock::new(0)));
        for _ in 0..100 {
            assert!(!b.failure());
        }
        assert_eq!(b.state(), BreakerState::Closed);
    }
}
