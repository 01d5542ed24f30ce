//! A tower layer that asks sluice before each request ([`RateLimitLayer`], [`RateLimit`]): a
//! limiter for an axum or tonic service in a few lines. A refused request never reaches the
//! inner service and is answered as [`Refusal`] says; when sluice does not answer, the client's
//! [`FailurePolicy`](super::FailurePolicy) decides. The layer reads nothing but the request's
//! head, so it is generic over the request body.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

use super::backoff::Jitter;
use super::{Answer, Descriptor, RateLimitClient};

/// How a refused request is answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Refusal {
    /// HTTP `429 Too Many Requests` with `Retry-After` (an axum or any HTTP service): in whole
    /// seconds, the exact wait rounded up and then spread upward by up to half of it (at least
    /// one second), so refused clients do not come back in lockstep
    /// ([`retry_after_seconds`]).
    #[default]
    Http,
    /// gRPC `RESOURCE_EXHAUSTED` (a trailers-only response) with the same jittered wait in
    /// `grpc-retry-pushback-ms`, which gRPC's own retry policy honours (a tonic service).
    Grpc,
}

/// Puts [`RateLimit`] in front of a service.
///
/// The service supplies a closure that builds the descriptors from the request (a header, the
/// path, the peer); no descriptors means the request is not limited and sluice is not asked.
///
/// ```no_run
/// use axum::{Router, routing::get};
/// use sluice::client::{Descriptor, RateLimitClient, RateLimitLayer};
///
/// # fn main() -> Result<(), sluice::client::ClientError> {
/// // config/policies/edge.yaml: 600 a minute per API key, as [generic_key=api, api_key=<key>].
/// let sluice = RateLimitClient::connect_lazy("http://127.0.0.1:8081", "edge")?;
/// let app: Router = Router::new()
///     .route("/api/search", get(|| async { "results" }))
///     .layer(RateLimitLayer::new(sluice, |req: &http::Request<axum::body::Body>| {
///         let key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok());
///         // No key, no descriptor: not limited here.
///         key.map(|k| vec![Descriptor::new([("generic_key", "api"), ("api_key", k)])])
///             .unwrap_or_default()
///     }));
/// # Ok(())
/// # }
/// ```
pub struct RateLimitLayer<F> {
    client: RateLimitClient,
    describe: Arc<F>,
    refusal: Refusal,
    jitter: Arc<Jitter>,
}

impl<F> Clone for RateLimitLayer<F> {
    fn clone(&self) -> Self {
        Self {
            client: self.client.clone(),
            describe: Arc::clone(&self.describe),
            refusal: self.refusal,
            jitter: Arc::clone(&self.jitter),
        }
    }
}

impl<F> RateLimitLayer<F> {
    /// A layer asking `client` with the descriptors `describe` builds from each request, and
    /// answering refusals with HTTP 429.
    pub fn new(client: RateLimitClient, describe: F) -> Self {
        Self {
            client,
            describe: Arc::new(describe),
            refusal: Refusal::Http,
            jitter: Arc::new(Jitter::from_entropy()),
        }
    }

    /// This layer answering refusals as `refusal` says (e.g. [`Refusal::Grpc`] for tonic).
    pub fn refusing_with(mut self, refusal: Refusal) -> Self {
        self.refusal = refusal;
        self
    }

    /// This layer spreading the retry wait with `jitter` (e.g. [`Jitter::seeded`] in a test).
    pub fn with_jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = Arc::new(jitter);
        self
    }
}

impl<S, F> Layer<S> for RateLimitLayer<F> {
    type Service = RateLimit<S, F>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            shared: Arc::new(Shared {
                client: self.client.clone(),
                describe: Arc::clone(&self.describe),
                refusal: self.refusal,
                jitter: Arc::clone(&self.jitter),
            }),
        }
    }
}

/// What a service and its clones share.
struct Shared<F> {
    client: RateLimitClient,
    describe: Arc<F>,
    refusal: Refusal,
    jitter: Arc<Jitter>,
}

/// A service that asks sluice before passing a request on (see [`RateLimitLayer`]).
pub struct RateLimit<S, F> {
    inner: S,
    shared: Arc<Shared<F>>,
}

impl<S: Clone, F> Clone for RateLimit<S, F> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S, F, B, ResBody> Service<Request<B>> for RateLimit<S, F>
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    F: Fn(&Request<B>) -> Vec<Descriptor> + Send + Sync + 'static,
    B: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let descriptors = (self.shared.describe)(&request);
        // The service that was polled ready goes with the request; its clone stays for the
        // next one (which will be polled ready before its call).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            if !descriptors.is_empty()
                && let Answer::Refused { wait } = shared.client.check(&descriptors).await
            {
                return Ok(shared.refuse(wait));
            }
            inner.call(request).await
        })
    }
}

impl<F> Shared<F> {
    /// The response to a request refused for `wait`.
    fn refuse<B: Default>(&self, wait: Duration) -> Response<B> {
        let seconds = retry_after_seconds(wait, self.jitter.unit());
        match self.refusal {
            Refusal::Http => {
                let mut response = Response::new(B::default());
                *response.status_mut() = StatusCode::TOO_MANY_REQUESTS;
                let headers = response.headers_mut();
                headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
                headers.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
                response
            }
            Refusal::Grpc => {
                let mut status = tonic::Status::resource_exhausted(format!(
                    "rate limited; retry in {seconds} s"
                ));
                let pushback = seconds.saturating_mul(1_000).to_string();
                if let Ok(value) = pushback.parse() {
                    status
                        .metadata_mut()
                        .insert("grpc-retry-pushback-ms", value);
                }
                status.into_http()
            }
        }
    }
}

/// `Retry-After` for an exact `wait`: the wait in whole seconds rounded up (at least 1), plus a
/// whole number of extra seconds drawn from `[0, max(1, ⌈that / 2⌉)]` by `unit` in `[0, 1)`.
/// Never earlier than `wait`.
pub fn retry_after_seconds(wait: Duration, unit: f64) -> u64 {
    let exact = wait
        .as_secs()
        .saturating_add(u64::from(wait.subsec_nanos() > 0))
        .max(1);
    let most = exact.div_ceil(2).max(1);
    // Truncation intended: uniform over the whole numbers 0..=most.
    let extra = (unit.clamp(0.0, 1.0) * (most + 1) as f64) as u64;
    exact.saturating_add(extra.min(most))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_only_adds() {
        assert_eq!(retry_after_seconds(Duration::ZERO, 0.0), 1);
        assert_eq!(retry_after_seconds(Duration::from_millis(1_001), 0.0), 2);
        assert_eq!(retry_after_seconds(Duration::from_secs(2), 0.0), 2);
        assert_eq!(retry_after_seconds(Duration::from_secs(2), 0.999), 3);
        assert_eq!(retry_after_seconds(Duration::from_secs(10), 0.999), 15);
        assert_eq!(retry_after_seconds(Duration::MAX, 0.999), u64::MAX);
        let jitter = Jitter::seeded(3);
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..1_000 {
            let s = retry_after_seconds(Duration::from_millis(9_500), jitter.unit());
            assert!((10..=15).contains(&s), "{s}");
            seen.insert(s);
        }
        assert_eq!(
            seen.len(),
            6,
            "every second of the spread is used: {seen:?}"
        );
    }
}
