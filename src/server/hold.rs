//! Answers held until their slot (a rule's `delay`): the bounds on how many are held at once
//! (over all connections, and on each), how long a call may be held (its deadline less a margin),
//! and the end of every hold when the server drains. A hold is a timer in the call's own future,
//! which runs in its connection's task (`super::streams`): no task and no stack of its own.
//!
//! A call a delaying rule matched reserves its place under both bounds once it is planned and
//! before it is charged, so that a request is never charged for a slot it could not be held
//! for: without a place, or without time before its deadline, the rule that would delay refuses
//! instead, with its wait, charging nothing. A call no delaying rule matched takes no place. The
//! place is given back at once when the answer is not held.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::settings::GrpcLimits;

/// The instant a call must be answered by: its `grpc-timeout` or the server's request timeout,
/// whichever comes first. Put on each request by the edge (`super::edge`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallDeadline(pub(crate) Instant);

/// The answers held on one connection, put on each of its requests.
#[derive(Clone, Debug, Default)]
pub(crate) struct ConnectionHolds(Arc<AtomicUsize>);

/// The server's held answers: their bounds, and the drain that ends them.
#[derive(Debug)]
pub(crate) struct Holds {
    /// Places taken (calls being decided that may be held, and calls held), over all
    /// connections.
    taken: AtomicUsize,
    max_held: usize,
    max_per_connection: usize,
    margin: Duration,
    /// Cancelled when the server stops taking traffic: every held answer is given at once.
    drain: CancellationToken,
}

/// A place under both bounds, given back when dropped.
#[derive(Debug)]
pub(crate) struct HoldPlace {
    holds: Arc<Holds>,
    connection: Option<ConnectionHolds>,
}

impl Drop for HoldPlace {
    fn drop(&mut self) {
        // Relaxed: a count under a bound; nothing else is ordered by it.
        self.holds.taken.fetch_sub(1, Ordering::Relaxed);
        if let Some(c) = &self.connection {
            c.0.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Holds {
    /// The bounds of `limits`: `grpc.max_held_requests`, `grpc.max_held_per_connection` and
    /// `grpc.hold_deadline_margin_ms`.
    pub(crate) fn new(limits: &GrpcLimits) -> Self {
        Self {
            taken: AtomicUsize::new(0),
            max_held: limits.max_held_requests,
            max_per_connection: limits.max_held_per_connection,
            margin: limits.hold_deadline_margin,
            drain: CancellationToken::new(),
        }
    }

    /// No answer is held (the fuzz targets, and tests).
    #[cfg(any(test, fuzzing))]
    pub(crate) fn none() -> Self {
        Self {
            taken: AtomicUsize::new(0),
            max_held: 0,
            max_per_connection: 0,
            margin: Duration::ZERO,
            drain: CancellationToken::new(),
        }
    }

    /// Ends every hold now, and holds nothing from now on.
    pub(crate) fn drain(&self) {
        self.drain.cancel();
    }

    /// Resolves when the server drains.
    pub(crate) async fn drained(&self) {
        self.drain.cancelled().await;
    }

    /// A place for a call on `connection`, or `None` when either bound is reached or the
    /// server drains.
    pub(crate) fn reserve(
        self: &Arc<Self>,
        connection: Option<&ConnectionHolds>,
    ) -> Option<HoldPlace> {
        if self.drain.is_cancelled() || !take(&self.taken, self.max_held) {
            return None;
        }
        // Gives the place in all back if the connection has none.
        let mut place = HoldPlace {
            holds: Arc::clone(self),
            connection: None,
        };
        match connection {
            Some(c) if !take(&c.0, self.max_per_connection) => None,
            connection => {
                place.connection = connection.cloned();
                Some(place)
            }
        }
    }

    /// How long, in nanoseconds, a call due by `deadline` may be held from `now`: up to its
    /// deadline less the margin; 0 without a deadline's room.
    pub(crate) fn budget(&self, deadline: Option<CallDeadline>, now: Instant) -> u64 {
        let Some(CallDeadline(deadline)) = deadline else {
            return 0;
        };
        let room = deadline
            .saturating_duration_since(now)
            .saturating_sub(self.margin);
        u64::try_from(room.as_nanos()).unwrap_or(u64::MAX)
    }
}

/// Takes one of `count`'s places if it is below `max`.
fn take(count: &AtomicUsize, max: usize) -> bool {
    // Relaxed: the bound needs only the count's own atomicity.
    count
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
            (n < max).then_some(n + 1)
        })
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holds(max_held: usize, max_per_connection: usize) -> Arc<Holds> {
        Arc::new(Holds {
            max_held,
            max_per_connection,
            margin: Duration::from_millis(5),
            ..Holds::none()
        })
    }

    #[test]
    fn places_are_bounded_in_all_and_per_connection_and_given_back() {
        let h = holds(3, 2);
        let (a, b) = (ConnectionHolds::default(), ConnectionHolds::default());
        let a1 = h.reserve(Some(&a)).unwrap();
        let _a2 = h.reserve(Some(&a)).unwrap();
        assert!(h.reserve(Some(&a)).is_none(), "two per connection");
        let _b1 = h.reserve(Some(&b)).unwrap();
        assert!(h.reserve(Some(&b)).is_none(), "three in all");
        assert_eq!(a.0.load(Ordering::Relaxed), 2, "a refusal takes nothing");
        drop(a1);
        assert!(h.reserve(Some(&b)).is_some());
        h.drain();
        assert!(h.reserve(None).is_none(), "nothing is held while draining");
        assert!(holds(0, 5).reserve(None).is_none());
    }

    #[test]
    fn the_budget_is_the_deadline_less_the_margin() {
        let h = holds(1, 1);
        let now = Instant::now();
        let at = |ms| Some(CallDeadline(now + Duration::from_millis(ms)));
        assert_eq!(h.budget(at(300), now), 295_000_000);
        assert_eq!(h.budget(at(3), now), 0, "inside the margin");
        assert_eq!(h.budget(None, now), 0);
        assert_eq!(
            h.budget(Some(CallDeadline(now)), now + Duration::from_secs(1)),
            0
        );
    }
}
