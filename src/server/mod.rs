//! The transport adapters: the gRPC server (rate-limit service and `grpc.health.v1`) and the
//! HTTP admin server. The only code that speaks protobuf or HTTP; it owns health state.

pub mod admin;
pub mod content_type;
pub mod headers;
pub mod json;
pub mod listener;
pub mod rls;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tonic::transport::Server;
use tonic::transport::server::Router;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::pb::rate_limit_service_server::RateLimitServiceServer;
use crate::settings::GrpcSettings;
use content_type::RequireGrpc;
use rls::RateLimitHandler;

/// The gRPC health service name envoyproxy/ratelimit registers, kept for existing probes.
pub const HEALTH_SERVICE: &str = "ratelimit";

/// Whether the server takes traffic, as seen by gRPC health checks and `GET /healthcheck`.
#[derive(Clone)]
pub struct Health {
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
    #[must_use]
    pub fn new(reporter: HealthReporter) -> Self {
        Self {
            serving: Arc::new(AtomicBool::new(false)),
            reporter,
        }
    }

    /// Whether the server takes traffic.
    #[must_use]
    pub fn is_serving(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
    }

    /// Sets the status of every name health is asked under: `""`, `ratelimit` and the
    /// rate-limit service's full name.
    pub async fn set(&self, serving: bool) {
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
pub const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Streams a connection may make us reset for its protocol errors, refused streams past
/// `max_concurrent_streams` included, before it is sent a GOAWAY ("MadeYouReset",
/// CVE-2025-8671; RUSTSEC-2024-0003). hyper's default; tonic passes `None`, which turns the
/// limit off, unless it is set.
pub const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1_024;

/// The gRPC router: the rate-limit service (responses never compressed, as Envoy requires)
/// and `grpc.health.v1`, both refusing non-gRPC content types, on a server bounded by `limits`
/// (streams, headers, request time, keep-alive; `listener` bounds connections and idleness).
pub fn grpc_router(
    handler: RateLimitHandler,
    health: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    max_request_bytes: usize,
    limits: &GrpcSettings,
) -> Router {
    Server::builder()
        .max_concurrent_streams(limits.max_concurrent_streams)
        .http2_max_header_list_size(limits.max_header_list_bytes)
        .timeout(Duration::from_millis(limits.request_timeout_ms))
        .http2_keepalive_interval(Some(Duration::from_millis(limits.keepalive_interval_ms)))
        .http2_keepalive_timeout(Some(Duration::from_millis(limits.keepalive_timeout_ms)))
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESET_STREAMS))
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
        .add_service(RequireGrpc(health))
        .add_service(RequireGrpc(
            RateLimitServiceServer::new(handler).max_decoding_message_size(max_request_bytes),
        ))
}
