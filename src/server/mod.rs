//! The transport adapters: the gRPC server (rate-limit service and `grpc.health.v1`) and the
//! HTTP admin server. The only code that speaks protobuf or HTTP; it owns health state. Each
//! adapter converts its wire form to a [`crate::decision::Request`], asks the
//! [`crate::decision::Decider`], and converts the [`crate::decision::Decision`] back; none of
//! them counts or reaches a store.

pub(crate) mod admin;
mod edge;
pub(crate) mod json;
pub(crate) mod listener;
pub(crate) mod rls;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tonic::transport::Server;
use tonic::transport::server::Router;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::pb::envoy::r#type::v3::RateLimitUnit;
use crate::pb::rate_limit_service_server::RateLimitServiceServer;
use crate::policy::Unit;
use crate::settings::GrpcLimits;
use edge::GrpcEdge;
use rls::RateLimitHandler;

/// The gRPC health service name envoyproxy/ratelimit registers, kept for existing probes.
pub(crate) const HEALTH_SERVICE: &str = "ratelimit";

/// Whether the server takes traffic, as seen by gRPC health checks and `GET /healthcheck`.
#[derive(Clone)]
pub(crate) struct Health {
    /// Relaxed: a lone flag; readers need no other memory ordered with it.
    serving: Arc<AtomicBool>,
    reporter: HealthReporter,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("serving", &self.is_serving())
            .finish()
    }
}

impl Health {
    /// Health reported through `reporter`; not serving until [`Health::set`] says so.
    pub(crate) fn new(reporter: HealthReporter) -> Self {
        Self {
            serving: Arc::new(AtomicBool::new(false)),
            reporter,
        }
    }

    /// Whether the server takes traffic.
    pub(crate) fn is_serving(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
    }

    /// Sets the status of every name health is asked under: `""`, `ratelimit` and the
    /// rate-limit service's full name.
    pub(crate) async fn set(&self, serving: bool) {
        self.serving.store(serving, Ordering::Relaxed);
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for name in [
            "",
            HEALTH_SERVICE,
            <RateLimitServiceServer<RateLimitHandler> as tonic::server::NamedService>::NAME,
        ] {
            self.reporter.set_service_status(name, status).await;
        }
    }
}

/// Remotely reset streams a connection may have waiting to be accepted before it is sent a
/// GOAWAY (the HTTP/2 "rapid reset" attack, CVE-2023-44487). h2's own default, set here so it
/// cannot drift.
pub(crate) const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Streams a connection may make us reset for its protocol errors, refused streams past
/// `max_concurrent_streams` included, before it is sent a GOAWAY ("MadeYouReset",
/// CVE-2025-8671; RUSTSEC-2024-0003). hyper's default; tonic passes `None`, which turns the
/// limit off, unless it is set.
pub(crate) const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1_024;

/// The gRPC router: the rate-limit service (responses never compressed, as Envoy requires)
/// and `grpc.health.v1`, both refusing non-gRPC content types, answering a message over the
/// size limit `RESOURCE_EXHAUSTED` and a call past the request timeout `DEADLINE_EXCEEDED`,
/// on a server bounded by `limits` (streams, headers, request time, keep-alive; `listener`
/// bounds connections and idleness).
pub(crate) fn grpc_router(
    handler: RateLimitHandler,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    max_request_bytes: usize,
    limits: &GrpcLimits,
) -> Router {
    Server::builder()
        .max_concurrent_streams(limits.max_concurrent_streams)
        .http2_max_header_list_size(limits.max_header_list_bytes)
        .http2_keepalive_interval(Some(limits.keepalive_interval))
        .http2_keepalive_timeout(Some(limits.keepalive_timeout))
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESET_STREAMS))
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
        .add_service(GrpcEdge::new(health, limits.request_timeout))
        .add_service(GrpcEdge::new(
            RateLimitServiceServer::new(handler).max_decoding_message_size(max_request_bytes),
            limits.request_timeout,
        ))
}

/// `envoy.type.v3.RateLimitUnit` (no WEEK) → our unit; `None` for UNKNOWN or undefined values.
pub(crate) fn override_unit(value: i32) -> Option<Unit> {
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
