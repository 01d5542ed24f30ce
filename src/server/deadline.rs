//! `grpc.request_timeout_ms`, answered `DEADLINE_EXCEEDED`: the code gRPC's status-code
//! specification lists for "deadline expires before server returns status". tonic's own server
//! timeout answers `CANCELLED`, so the server's deadline is applied here instead, around each
//! service, body reading included. A client's shorter `grpc-timeout` is still applied by tonic,
//! outside this layer, with its `CANCELLED`, which that client never reads: its own deadline
//! has passed, and gRPC clients report `DEADLINE_EXCEEDED` for it themselves.

use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::Map;
use tokio::time::Timeout;
use tokio::time::error::Elapsed;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;

/// A gRPC service whose calls end with `DEADLINE_EXCEEDED` after `timeout`.
#[derive(Debug, Clone)]
pub struct Deadline<S> {
    inner: S,
    timeout: Duration,
}

impl<S> Deadline<S> {
    /// `inner`, each call bounded by `timeout`.
    pub fn new(inner: S, timeout: Duration) -> Self {
        Self { inner, timeout }
    }
}

impl<S: NamedService> NamedService for Deadline<S> {
    const NAME: &'static str = S::NAME;
}

type Outcome<E> = Result<Result<http::Response<Body>, E>, Elapsed>;

impl<S, B> Service<http::Request<B>> for Deadline<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future =
        Map<Timeout<S::Future>, fn(Outcome<S::Error>) -> Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        tokio::time::timeout(self.timeout, self.inner.call(req)).map(exceeded)
    }
}

fn exceeded<E>(outcome: Outcome<E>) -> Result<http::Response<Body>, E> {
    outcome.unwrap_or_else(|_| {
        Ok(
            Status::deadline_exceeded("the call took longer than grpc.request_timeout_ms")
                .into_http(),
        )
    })
}
