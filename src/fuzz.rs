//! Thin public wrappers over crate-private entry points, for the fuzz targets in `fuzz/` only:
//! the gRPC adapter's answer to a decoded `ShouldRateLimit` request (`server::rls`), and the
//! `/json` body's parser and renderer (`wire::json`) under the names the targets use.
//!
//! Compiled only under `--cfg fuzzing`, which `cargo fuzz` passes; the server, the binaries and
//! the documentation never see it. Nothing here parses, converts or decides anything itself.

use std::sync::Arc;

use futures_util::FutureExt;

use crate::decision::{Decider, Decision, Options, Request};
use crate::limiter::{Backend, ManualClock, MemoryStore};
use crate::metrics::Metrics;
use crate::pb::{RateLimitRequest, RateLimitResponse};
use crate::policy::PolicyHandle;
use crate::server::hold::Holds;
use crate::server::rls::{HoldContext, RateLimitHandler};
use crate::wire::json;

/// `wire::json::parse`: a `/json` body as a decision request, or why it is refused.
///
/// # Errors
///
/// The parser's error, as its text.
pub fn json_parse(body: &[u8]) -> Result<Request, String> {
    json::parse(body).map_err(|e| e.to_string())
}

/// `wire::json::render`: a decision as the `/json` answer's body.
#[must_use]
pub fn json_render(decision: &Decision) -> serde_json::Value {
    json::render(decision)
}

/// The gRPC adapter's `ShouldRateLimit` handler over the in-memory store, on a hand-driven clock.
#[derive(Debug)]
pub struct Rls {
    handler: RateLimitHandler,
    clock: Arc<ManualClock>,
}

impl Rls {
    /// A handler deciding against `policies` with `options`, counting in a fresh in-memory
    /// store, its clock set at `now` nanoseconds.
    #[must_use]
    pub fn new(policies: PolicyHandle, metrics: Arc<Metrics>, options: Options, now: u64) -> Self {
        let clock = Arc::new(ManualClock::new(now));
        let backend = Backend::memory(MemoryStore::new(), clock.clone());
        let decider = Decider::new(policies, backend, metrics, options);
        Self {
            handler: RateLimitHandler::new(decider, Arc::new(Holds::none())),
            clock,
        }
    }

    /// Sets the clock to `now` nanoseconds.
    pub fn set_clock(&self, now: u64) {
        self.clock.set(now);
    }

    /// What `ShouldRateLimit` answers to `request`: `server::rls`'s conversion, the decider, and
    /// the conversion back.
    ///
    /// # Errors
    ///
    /// The gRPC status the call fails with.
    ///
    /// # Panics
    ///
    /// When the in-memory decision waits, which it never does.
    pub fn answer(&self, request: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
        self.handler
            .answer(request, None, HoldContext::default())
            .now_or_never()
            .expect("the in-memory decision completes without waiting")
    }
}
