//! The gRPC adapter for `envoy.service.ratelimit.v3.RateLimitService`: a decoded request
//! decided (converted by [`crate::wire`]) and, when a rule admits it at a later slot, held until
//! then within the bounds of [`super::hold`]; and the one place errors become gRPC statuses.

use std::sync::Arc;
use std::time::Duration;

use tonic::Status;

use super::hold::{CallDeadline, ConnectionHolds, HoldPlace, Holds};
use crate::decision::{DecideError, Decider, Decision};
use crate::metrics::{HoldEnd, Metrics};
use crate::pb::{RateLimitRequest, RateLimitResponse};
use crate::traces::CallSpan;
use crate::wire;

/// Answers `ShouldRateLimit` with the decider, holding an answer admitted at a later slot
/// until that slot, within `holds`.
#[derive(Debug, Clone)]
pub struct RateLimitHandler {
    decider: Decider,
    holds: Arc<Holds>,
}

/// What a call brings for its answer to be held: its deadline, and its connection's count.
#[derive(Debug, Default)]
pub(crate) struct HoldContext {
    pub(crate) deadline: Option<CallDeadline>,
    pub(crate) connection: Option<ConnectionHolds>,
}

impl RateLimitHandler {
    /// A handler deciding with `decider`, holding answers within `holds`.
    #[must_use]
    pub(crate) fn new(decider: Decider, holds: Arc<Holds>) -> Self {
        Self { decider, holds }
    }

    /// Counts a call refused before its request could be read (framing, size, decoding).
    pub(crate) fn count_malformed(&self) {
        self.decider.count_malformed();
    }

    /// Records a `ShouldRateLimit` call answered (or failed) after `took`.
    pub(crate) fn called(&self, took: std::time::Duration) {
        self.decider.metrics().should_rate_limit_called(took);
    }

    /// The answer to one decoded `ShouldRateLimit` request, or the status it fails with.
    /// With tracing on, what was asked and answered goes on the call's `span`.
    ///
    /// A request a delaying rule admits at a later slot is answered at that slot: once planned,
    /// such a request reserves a place under the hold bounds and may be held until its deadline
    /// less the margin; without a place or that time, the rule refuses it at once with its wait.
    /// A request no delaying rule matched takes no place.
    /// When the server drains, a held answer is given at once, refused with the wait left.
    pub(crate) async fn answer(
        &self,
        request: RateLimitRequest,
        mut span: Option<&mut CallSpan>,
        context: HoldContext,
    ) -> Result<RateLimitResponse, Status> {
        let req = wire::from_pb(request)
            .inspect_err(|_| self.decider.count_malformed())
            .map_err(|e| status(e.into()))?;
        if let Some(span) = span.as_deref_mut() {
            span.request(&req);
        }
        // A place is taken only for a request a delaying rule matched.
        let mut place = None;
        let decided = self
            .decider
            .decide_within(&req, || {
                place = self.holds.reserve(context.connection.as_ref());
                place.as_ref().map_or(0, |_| {
                    self.holds
                        .budget(context.deadline, tokio::time::Instant::now())
                })
            })
            .await;
        let decided = match (decided, place) {
            (Ok(decision), Some(place)) if decision.hold.is_some() => {
                Ok(self.hold(decision, place).await)
            }
            (decided, _) => decided,
        };
        if let Some(span) = span {
            match &decided {
                Ok(decision) => span.decided(decision),
                Err(e) => span.failed(e),
            }
        }
        decided.map(wire::to_pb).map_err(status)
    }
}

impl RateLimitHandler {
    /// Holds `decision` until its slot, in `place`; refused at once with the wait left when the
    /// server drains first.
    async fn hold(&self, decision: Decision, place: HoldPlace) -> Decision {
        let nanos = decision.hold.as_ref().map_or(0, |h| h.nanos);
        let slot = tokio::time::Instant::now() + Duration::from_nanos(nanos);
        let mut holding = Holding::new(self.decider.metrics(), place);
        let drained = tokio::select! {
            () = tokio::time::sleep_until(slot) => false,
            () = self.holds.drained() => true,
        };
        holding.end = if drained {
            HoldEnd::Drained
        } else {
            HoldEnd::Slot
        };
        drop(holding);
        if drained {
            let left = slot.saturating_duration_since(tokio::time::Instant::now());
            let left = u64::try_from(left.as_nanos()).unwrap_or(u64::MAX);
            self.decider.refuse_held(decision, left).await
        } else {
            decision
        }
    }
}

/// A hold from its start to its end, however it ends: at its slot, at the drain, or dropped
/// with its call (the caller went away first), which gives its place back and counts it.
struct Holding<'m> {
    metrics: &'m Metrics,
    _place: HoldPlace,
    end: HoldEnd,
}

impl<'m> Holding<'m> {
    fn new(metrics: &'m Metrics, place: HoldPlace) -> Self {
        metrics.hold_began();
        Self {
            metrics,
            _place: place,
            end: HoldEnd::Cancelled,
        }
    }
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        self.metrics.hold_ended(self.end);
    }
}

/// The one mapping from errors to gRPC statuses: malformed input is `INVALID_ARGUMENT`; a
/// backend that cannot decide is `UNAVAILABLE`, so Envoy's `failure_mode_deny` decides; no
/// policies yet is `UNKNOWN` with envoyproxy/ratelimit's message.
fn status(err: DecideError) -> Status {
    match err {
        DecideError::Request(e) => Status::invalid_argument(e.to_string()),
        DecideError::Backend(e) => Status::unavailable(e.to_string()),
        e @ DecideError::NoPolicies => Status::unknown(e.to_string()),
    }
}
