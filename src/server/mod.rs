//! The transport adapters: the gRPC port (rate-limit service, rate-limit quota service and
//! `grpc.health.v1`) and the HTTP admin port, and the health state both report. Each adapter
//! reads its wire form into a decision request ([`crate::wire`]), asks the
//! [`crate::decision::Decider`] (or, for quota streams ([`rlqs`]), a [`crate::rlqs`] table)
//! and writes the answer back; none counts or reaches a store. The gRPC port is served without tonic's
//! `Server`: connections accepted under a cap ([`accept`]), served by hyper's HTTP/2 builder
//! with ages, idle cuts and a drain ([`connections`], [`idle`]), calls run in the connection's
//! task ([`streams`]) and routed by path to `ShouldRateLimit` served by hand ([`unary`]), or the
//! generated quota and health services, each behind the edge ([`edge`]). An answer a rule admits
//! at a later slot is held until then in its call's future, within the bounds of [`hold`].

mod accept;
pub(crate) mod admin;
mod connections;
mod edge;
pub(crate) mod hold;
mod idle;
mod limited;
pub(crate) mod rlqs;
pub(crate) mod rls;
mod streams;
mod unary;
mod woken;

pub(crate) use accept::CappedListener;
pub(crate) use connections::{GrpcConnections, serve_grpc};

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use futures_util::future::{Either, MapOk, Ready, TryFutureExt, ready};
use hyper::body::Incoming;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{Service, http};
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::HealthReporter;

use crate::pb::{rate_limit_quota_service_server, rate_limit_service_server};
use crate::settings::GrpcLimits;
use crate::traces::CallTracer;
use edge::GrpcEdge;
use rlqs::RateLimitQuotaServiceServer;
use rlqs::RlqsService;
use rls::RateLimitHandler;
use unary::{ShouldRateLimit, UnaryBody};

/// The gRPC health service name envoyproxy/ratelimit registers, kept for existing probes.
pub(crate) const HEALTH_SERVICE: &str = "ratelimit";

/// Whether the server takes traffic, as seen by gRPC health checks and `GET /healthcheck`.
#[derive(Clone)]
pub(crate) struct Health {
    /// Relaxed: a lone flag; readers need no other memory ordered with it.
    serving: Arc<AtomicBool>,
    reporter: HealthReporter,
    /// Whether the rate-limit quota service is served (its name then reports too).
    quota: bool,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("serving", &self.is_serving())
            .finish()
    }
}

impl Health {
    /// Health reported through `reporter`, with the quota service's name when `quota`; not
    /// serving until [`Health::set`] says so.
    pub(crate) fn new(reporter: HealthReporter, quota: bool) -> Self {
        Self {
            serving: Arc::new(AtomicBool::new(false)),
            reporter,
            quota,
        }
    }

    /// Whether the server takes traffic.
    pub(crate) fn is_serving(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
    }

    /// Sets the status of every name health is asked under: `""`, `ratelimit` and the
    /// full names of the rate-limit service and, when served, the rate-limit quota service.
    pub(crate) async fn set(&self, serving: bool) {
        self.serving.store(serving, Ordering::Relaxed);
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        let quota = self
            .quota
            .then_some(rate_limit_quota_service_server::SERVICE_NAME);
        for name in [
            Some(""),
            Some(HEALTH_SERVICE),
            Some(rate_limit_service_server::SERVICE_NAME),
            quota,
        ]
        .into_iter()
        .flatten()
        {
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
/// CVE-2025-8671; RUSTSEC-2024-0003). hyper's default, set here so it cannot drift.
pub(crate) const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1_024;

/// The HTTP/2 connection builder of one gRPC connection, with every per-connection limit in
/// `limits` (streams, header list size, keep-alive) and the reset-stream limits, its calls run
/// by `streams` in the connection's own task; [`serve_grpc`] builds one for each
/// connection. The request timeout is applied per call by the edge.
pub(crate) fn grpc_connection(
    limits: &GrpcLimits,
    streams: streams::Streams,
) -> hyper::server::conn::http2::Builder<streams::Streams> {
    use hyper_util::rt::TokioTimer;
    let mut builder = hyper::server::conn::http2::Builder::new(streams);
    builder
        .timer(TokioTimer::new())
        // No `date` header: gRPC does not use it, and grpc-go's server (envoyproxy/ratelimit's)
        // sends none. hyper would format it once a second and HPACK-encode it on every answer.
        .auto_date_header(false)
        .max_concurrent_streams(limits.max_concurrent_streams)
        .max_header_list_size(limits.max_header_list_bytes)
        .keep_alive_interval(limits.keepalive_interval)
        .keep_alive_timeout(limits.keepalive_timeout)
        .max_pending_accept_reset_streams(MAX_PENDING_ACCEPT_RESET_STREAMS)
        .max_local_error_reset_streams(MAX_LOCAL_ERROR_RESET_STREAMS);
    builder
}

/// Path prefix of the rate-limit service's methods.
const RLS_PREFIX: &str = "/envoy.service.ratelimit.v3.RateLimitService/";
/// Path prefix of the rate-limit quota service's methods.
const RLQS_PREFIX: &str = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/";
/// Path prefix of `grpc.health.v1`'s methods.
const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";

/// The gRPC port's one service: each call routed by its path to the rate-limit service
/// (responses never compressed, as Envoy requires), the rate-limit quota service (when
/// `rlqs.enabled`) or `grpc.health.v1`, all behind the edge
/// (non-gRPC content types refused, a message over the size limit answered
/// `RESOURCE_EXHAUSTED`, a call past the request timeout `DEADLINE_EXCEEDED`); any other path
/// is answered `UNIMPLEMENTED` (HTTP 200, `grpc-status: 12`), as tonic's router answers it.
///
/// No router and no tower layers: a call costs a prefix comparison and the edge, and its body
/// reaches the reader as hyper delivers it.
pub(crate) struct GrpcRoutes<H> {
    rls: GrpcEdge<ShouldRateLimit>,
    quota: Option<GrpcEdge<RateLimitQuotaServiceServer<RlqsService>>>,
    health: GrpcEdge<HealthServer<H>>,
}

// By hand: the generated servers are `Clone` whatever `H` is (it sits behind an `Arc`).
impl<H> Clone for GrpcRoutes<H> {
    fn clone(&self) -> Self {
        Self {
            rls: self.rls.clone(),
            quota: self.quota.clone(),
            health: self.health.clone(),
        }
    }
}

impl<H> std::fmt::Debug for GrpcRoutes<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcRoutes").finish_non_exhaustive()
    }
}

impl<H: tonic_health::pb::health_server::Health> GrpcRoutes<H> {
    /// The rate-limit service answered by `handler`, the quota service when given, and
    /// `health`, with requests refused past `max_request_bytes` and calls cut at
    /// `limits.request_timeout` (a quota stream's call ends when its first message is read and
    /// its stream begins; the stream itself is not cut).
    pub(crate) fn new(
        handler: RateLimitHandler,
        quota: Option<RlqsService>,
        health: HealthServer<H>,
        max_request_bytes: usize,
        limits: &GrpcLimits,
        tracer: Option<Arc<CallTracer>>,
    ) -> Self {
        Self {
            rls: GrpcEdge::new(
                ShouldRateLimit::new(handler, max_request_bytes, tracer),
                limits.request_timeout,
            ),
            quota: quota.map(|q| {
                GrpcEdge::with_tonic_decoder(
                    RateLimitQuotaServiceServer::new(q)
                        .max_decoding_message_size(max_request_bytes),
                    limits.request_timeout,
                )
            }),
            // The same cap on the health service's messages, refused by tonic's decoder (its
            // `OUT_OF_RANGE` made `RESOURCE_EXHAUSTED` by the edge).
            health: GrpcEdge::with_tonic_decoder(
                health.max_decoding_message_size(max_request_bytes),
                limits.request_timeout,
            ),
        }
    }
}

type EdgeFuture<S> = <GrpcEdge<S> as Service<http::Request<Incoming>>>::Future;
type Wrap<F, B> = MapOk<F, fn(http::Response<B>) -> http::Response<GrpcBody>>;

impl<H: tonic_health::pb::health_server::Health> hyper::service::Service<http::Request<Incoming>>
    for GrpcRoutes<H>
{
    type Response = http::Response<GrpcBody>;
    type Error = Infallible;
    type Future = Either<
        Either<
            Wrap<EdgeFuture<ShouldRateLimit>, UnaryBody>,
            Wrap<EdgeFuture<HealthServer<H>>, Body>,
        >,
        Either<
            Wrap<EdgeFuture<RateLimitQuotaServiceServer<RlqsService>>, Body>,
            Ready<Result<http::Response<GrpcBody>, Infallible>>,
        >,
    >;

    fn call(&self, req: http::Request<Incoming>) -> Self::Future {
        // Both services are always ready (`poll_ready` is `Ready(Ok)`), and a clone is a
        // reference count: their state is behind an `Arc`.
        let path = req.uri().path();
        if path.starts_with(RLS_PREFIX) {
            let answer: fn(_) -> _ = |r: http::Response<UnaryBody>| r.map(GrpcBody::Unary);
            Either::Left(Either::Left(self.rls.clone().call(req).map_ok(answer)))
        } else if path.starts_with(HEALTH_PREFIX) {
            let answer: fn(_) -> _ = |r: http::Response<Body>| r.map(GrpcBody::Tonic);
            Either::Left(Either::Right(self.health.clone().call(req).map_ok(answer)))
        } else if let Some(quota) = self
            .quota
            .as_ref()
            .filter(|_| path.starts_with(RLQS_PREFIX))
        {
            let answer: fn(_) -> _ = |r: http::Response<Body>| r.map(GrpcBody::Tonic);
            Either::Right(Either::Left(quota.clone().call(req).map_ok(answer)))
        } else {
            // The router's answer to a service it does not have: trailers-only, no message.
            Either::Right(Either::Right(ready(Ok(
                Status::unimplemented("").into_http()
            ))))
        }
    }
}

/// The body of a gRPC answer: `ShouldRateLimit`'s own, or one of tonic's (health).
#[derive(Debug)]
pub(crate) enum GrpcBody {
    Unary(UnaryBody),
    Tonic(Body),
}

impl Default for GrpcBody {
    fn default() -> Self {
        Self::Unary(UnaryBody::default())
    }
}

impl hyper::body::Body for GrpcBody {
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Status>>> {
        match self.get_mut() {
            Self::Unary(body) => Pin::new(body)
                .poll_frame(cx)
                .map_err(|never| match never {}),
            Self::Tonic(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Unary(body) => body.is_end_stream(),
            Self::Tonic(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            Self::Unary(body) => body.size_hint(),
            Self::Tonic(body) => body.size_hint(),
        }
    }
}
