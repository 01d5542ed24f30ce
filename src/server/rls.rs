//! The gRPC adapter for `envoy.service.ratelimit.v3.RateLimitService`: a decoded request
//! decided (converted by [`crate::wire`]), and the one place errors become gRPC statuses.

use tonic::Status;

use crate::decision::{DecideError, Decider};
use crate::pb::{RateLimitRequest, RateLimitResponse};
use crate::traces::CallSpan;
use crate::wire;

/// Answers `ShouldRateLimit` with the decider.
#[derive(Debug, Clone)]
pub struct RateLimitHandler {
    decider: Decider,
}

impl RateLimitHandler {
    /// A handler deciding with `decider`.
    #[must_use]
    pub fn new(decider: Decider) -> Self {
        Self { decider }
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
    pub(crate) async fn answer(
        &self,
        request: RateLimitRequest,
        mut span: Option<&mut CallSpan>,
    ) -> Result<RateLimitResponse, Status> {
        let req = wire::from_pb(request)
            .inspect_err(|_| self.decider.count_malformed())
            .map_err(|e| status(e.into()))?;
        if let Some(span) = span.as_deref_mut() {
            span.request(&req);
        }
        let decided = self.decider.decide(&req).await;
        if let Some(span) = span {
            match &decided {
                Ok(decision) => span.decided(decision),
                Err(e) => span.failed(e),
            }
        }
        decided.map(wire::to_pb).map_err(status)
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
