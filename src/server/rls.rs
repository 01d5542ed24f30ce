//! The gRPC adapter for `envoy.service.ratelimit.v3.RateLimitService`: protobuf → domain
//! request, decision, domain response → protobuf, and the one place errors become gRPC statuses.

use std::sync::Arc;
use std::time::Instant;

use prost_types::Duration;
use tonic::{Request, Response, Status};

use crate::decision::{self, Code, Decider, RequestError};
use crate::limiter::{BackendError, Batch, Limiter};
use crate::metrics::Metrics;
use crate::pb::envoy::config::core::v3::HeaderValue;
use crate::pb::envoy::r#type::v3::RateLimitUnit;
use crate::pb::rate_limit_response::{self as pbr, rate_limit::Unit as PbUnit};
use crate::pb::rate_limit_service_server::RateLimitService;
use crate::pb::{RateLimitRequest, RateLimitResponse};
use crate::policy::{PolicyHandle, Unit};
use crate::settings::OnBackendError;

use super::headers::{Extras, HeaderMode, HeaderOptions, extras};

/// Answers `ShouldRateLimit` from the live policies and the limiter, and counts what it did.
#[derive(Debug, Clone)]
pub struct RateLimitHandler {
    policies: PolicyHandle,
    limiter: Limiter,
    decider: Decider,
    metrics: Arc<Metrics>,
    on_backend_error: OnBackendError,
    headers: HeaderOptions,
}

/// Why a request got no decision.
#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    /// The request is malformed.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The backend could not decide and the operator chose to answer with an error.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl RateLimitHandler {
    /// A handler over the given policies and limiter.
    #[must_use]
    pub fn new(
        policies: PolicyHandle,
        limiter: Limiter,
        decider: Decider,
        metrics: Arc<Metrics>,
        on_backend_error: OnBackendError,
        headers: HeaderOptions,
    ) -> Self {
        Self {
            policies,
            limiter,
            decider,
            metrics,
            on_backend_error,
            headers,
        }
    }

    /// The headers and body to add to `resp`.
    #[must_use]
    pub fn extras(&self, resp: &decision::Response<'_>) -> Extras {
        if self.headers.mode == HeaderMode::None && !self.headers.problem_body {
            return Extras::default();
        }
        let jitter =
            if resp.overall == Code::OverLimit && self.headers.retry_after_jitter_seconds > 0 {
                random_unit()
            } else {
                0.0
            };
        extras(resp, &self.headers, jitter)
    }

    /// Decides `req` on one policy snapshot and hands the response to `respond` (which encodes
    /// it for its transport); counts the decision.
    ///
    /// # Errors
    ///
    /// [`DecideError`] for a malformed request (nothing is charged), or when the backend fails
    /// and `on_backend_error` is `error`.
    pub async fn decide<R>(
        &self,
        req: &decision::Request,
        respond: impl FnOnce(&decision::Response<'_>) -> R,
    ) -> Result<R, DecideError> {
        let start = Instant::now();
        let policies = self.policies.load();
        let plan = self
            .decider
            .plan(req, &policies)
            .inspect_err(|_| self.metrics.invalid())?;
        let batch = if plan.ops().is_empty() {
            Batch {
                blocked: false,
                outcomes: Vec::new(),
            }
        } else {
            match self.limiter.check(plan.ops()).await {
                Ok(b) => b,
                Err(e) => {
                    tracing::debug!(domain = %req.domain, error = %e, "backend failed");
                    self.metrics.backend_error();
                    match self.on_backend_error {
                        OnBackendError::Allow => Batch::fallback(plan.ops(), true),
                        OnBackendError::Deny => Batch::fallback(plan.ops(), false),
                        OnBackendError::Error => return Err(e.into()),
                    }
                }
            }
        };
        let resp = self.decider.finish(&plan, &batch);
        let out = respond(&resp);
        self.metrics.decided(req, &resp, start.elapsed());
        tracing::debug!(domain = %req.domain, overall = ?resp.overall, "decided");
        Ok(out)
    }
}

#[tonic::async_trait]
impl RateLimitService for RateLimitHandler {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = from_pb(request.into_inner())
            .inspect_err(|_| self.metrics.invalid())
            .map_err(|e| status(e.into()))?;
        if cfg!(feature = "bench-floor") {
            // The transport floor of the load benchmark: decode, answer OK, decide nothing.
            return Ok(Response::new(floor(&req)));
        }
        self.decide(&req, |resp| to_pb(resp, self.extras(resp)))
            .await
            .map(Response::new)
            .map_err(status)
    }
}

/// The one mapping from errors to gRPC statuses: malformed input is `INVALID_ARGUMENT`; a
/// backend that cannot decide is `UNAVAILABLE`, so Envoy's `failure_mode_deny` decides.
fn status(err: DecideError) -> Status {
    match err {
        DecideError::Request(e) => Status::invalid_argument(e.to_string()),
        DecideError::Backend(e) => Status::unavailable(e.to_string()),
    }
}

/// The protobuf request as a domain request (strings moved, not copied).
///
/// # Errors
///
/// [`RequestError::UnknownUnit`] for an override whose unit is not SECOND..YEAR.
pub fn from_pb(req: RateLimitRequest) -> Result<decision::Request, RequestError> {
    let mut descriptors = Vec::with_capacity(req.descriptors.len());
    for (i, d) in req.descriptors.into_iter().enumerate() {
        let limit = match d.limit {
            None => None,
            Some(ov) => Some(decision::Override {
                requests_per_unit: ov.requests_per_unit,
                unit: override_unit(ov.unit).ok_or(RequestError::UnknownUnit {
                    descriptor: i,
                    value: ov.unit,
                })?,
            }),
        };
        descriptors.push(decision::Descriptor {
            entries: d
                .entries
                .into_iter()
                .map(|e| decision::Entry {
                    key: e.key,
                    value: e.value,
                })
                .collect(),
            limit,
            hits_addend: d.hits_addend,
            is_negative_hits: d.is_negative_hits,
        });
    }
    Ok(decision::Request {
        domain: req.domain,
        descriptors,
        hits_addend: req.hits_addend,
    })
}

/// `envoy.type.v3.RateLimitUnit` (no WEEK) → our unit; `None` for UNKNOWN or undefined values.
fn override_unit(value: i32) -> Option<Unit> {
    Some(match RateLimitUnit::try_from(value).ok()? {
        RateLimitUnit::Unknown => return None,
        RateLimitUnit::Second => Unit::Second,
        RateLimitUnit::Minute => Unit::Minute,
        RateLimitUnit::Hour => Unit::Hour,
        RateLimitUnit::Day => Unit::Day,
        RateLimitUnit::Month => Unit::Month,
        RateLimitUnit::Year => Unit::Year,
    })
}

/// Our unit → `RateLimitResponse.RateLimit.Unit` (where WEEK is 7).
fn response_unit(unit: Unit) -> PbUnit {
    match unit {
        Unit::Second => PbUnit::Second,
        Unit::Minute => PbUnit::Minute,
        Unit::Hour => PbUnit::Hour,
        Unit::Day => PbUnit::Day,
        Unit::Week => PbUnit::Week,
        Unit::Month => PbUnit::Month,
        Unit::Year => PbUnit::Year,
    }
}

fn code(code: Code) -> pbr::Code {
    match code {
        Code::Ok => pbr::Code::Ok,
        Code::OverLimit => pbr::Code::OverLimit,
    }
}

fn to_pb(resp: &decision::Response<'_>, extras: Extras) -> RateLimitResponse {
    RateLimitResponse {
        response_headers_to_add: extras
            .headers
            .into_iter()
            .map(|(key, value)| HeaderValue {
                key,
                value,
                raw_value: Vec::new(),
            })
            .collect(),
        raw_body: extras.body,
        overall_code: code(resp.overall).into(),
        statuses: resp
            .statuses
            .iter()
            .map(|s| pbr::DescriptorStatus {
                code: code(s.code).into(),
                current_limit: s.limit.map(|l| pbr::RateLimit {
                    name: l.name().to_string(),
                    requests_per_unit: l.rate.requests_per_unit,
                    unit: response_unit(l.rate.unit).into(),
                }),
                limit_remaining: s.remaining,
                duration_until_reset: s.reset_seconds.map(|secs| Duration {
                    seconds: i64::try_from(secs).unwrap_or(i64::MAX),
                    nanos: 0,
                }),
                quota: None,
            })
            .collect(),
        ..RateLimitResponse::default()
    }
}

/// A number in `[0, 1)`, different for each call (for jitter, not for secrets).
fn random_unit() -> f64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    // Relaxed: only needs to differ between calls.
    let n = CALLS.fetch_add(1, Ordering::Relaxed);
    let bits = std::collections::hash_map::RandomState::new().hash_one(n);
    // The top 53 bits as a fraction; the precision loss is the point.
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// A constant OK answer of the right shape (answered by the `bench-floor` build only).
fn floor(req: &decision::Request) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: pbr::Code::Ok.into(),
        statuses: vec![
            pbr::DescriptorStatus {
                code: pbr::Code::Ok.into(),
                ..pbr::DescriptorStatus::default()
            };
            req.descriptors.len()
        ],
        ..RateLimitResponse::default()
    }
}
