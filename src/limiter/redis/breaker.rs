//! A circuit breaker: after `threshold` consecutive failures it opens, and for `cooldown` every
//! call is refused at once instead of waiting on a dead Redis; then one probe call goes through
//! (half-open), and its result closes or re-opens the breaker.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// What the breaker currently does with calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls are refused until the cool-down ends.
    Open,
    /// One probe call is allowed through.
    HalfOpen,
}

#[derive(Debug)]
struct Inner {
    failures: u32,
    opened_at: Option<Instant>,
    probing: bool,
}

/// The breaker. A mutex is fine here: it is held for a few instructions, never across an await.
#[derive(Debug)]
pub(super) struct Breaker {
    threshold: u32,
    cooldown: Duration,
    inner: Mutex<Inner>,
}

impl Breaker {
    /// A closed breaker; `threshold` 0 disables it.
    pub(super) fn new(threshold: u32, cooldown: Duration) -> Self {
        Self {
            threshold,
            cooldown,
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

    pub(super) fn state(&self) -> BreakerState {
        let inner = self.lock();
        match inner.opened_at {
            None => BreakerState::Closed,
            Some(at) if at.elapsed() < self.cooldown => BreakerState::Open,
            Some(_) => BreakerState::HalfOpen,
        }
    }

    /// Whether a call may go to Redis now.
    pub(super) fn allow(&self) -> bool {
        let mut inner = self.lock();
        match inner.opened_at {
            None => true,
            Some(at) if at.elapsed() < self.cooldown => false,
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
                inner.opened_at = Some(Instant::now());
                inner.probing = false;
            }
            return reopen;
        }
        inner.failures += 1;
        if inner.failures >= self.threshold {
            inner.opened_at = Some(Instant::now());
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_then_probes() {
        let b = Breaker::new(3, Duration::from_millis(30));
        assert!(b.allow());
        assert!(!b.failure());
        assert!(!b.failure());
        b.success();
        assert!(!b.failure());
        assert!(!b.failure());
        assert!(b.failure(), "third consecutive failure opens it");
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.allow());
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(b.state(), BreakerState::HalfOpen);
        assert!(b.allow(), "one probe");
        assert!(!b.allow(), "only one");
        assert!(b.failure(), "a failed probe re-opens");
        assert!(!b.allow());
        std::thread::sleep(Duration::from_millis(40));
        assert!(b.allow());
        b.success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(b.allow() && b.allow());
    }
}
