//! A request larger than `requests.max_request_bytes` answered `RESOURCE_EXHAUSTED`, the code
//! gRPC's status-code specification lists for "server ran out of resources or a message larger
//! than configured limits" (its table: "Client/server sent a message larger than the configured
//! limit"). tonic's decoder refuses such a message with `OUT_OF_RANGE` as soon as it reads the
//! length prefix, before the body is buffered, and that check must stay: it is what bounds the
//! memory one call can take. So the check stays in tonic and only its code is corrected here,
//! on the way out. None of sluice's own answers is `OUT_OF_RANGE` (the adapter's one mapping
//! gives `INVALID_ARGUMENT` or `UNAVAILABLE`), so every `OUT_OF_RANGE` this service returns is
//! that decoder's; its message (the length and the limit) is kept.

use std::task::{Context, Poll};

use futures_util::TryFutureExt;
use futures_util::future::MapOk;
use tonic::body::Body;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;

/// `grpc-status` of `OUT_OF_RANGE`.
const OUT_OF_RANGE: &str = "11";
/// `grpc-status` of `RESOURCE_EXHAUSTED`.
const RESOURCE_EXHAUSTED: http::HeaderValue = http::HeaderValue::from_static("8");

/// A gRPC service whose oversized-message refusals say `RESOURCE_EXHAUSTED`.
#[derive(Debug, Clone)]
pub struct OversizeIsExhausted<S>(pub S);

impl<S: NamedService> NamedService for OversizeIsExhausted<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<http::Request<B>> for OversizeIsExhausted<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = MapOk<S::Future, fn(http::Response<Body>) -> http::Response<Body>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        self.0.call(req).map_ok(exhausted)
    }
}

/// The decoder's refusal comes before any message, as a trailers-only response: its status is
/// in the headers.
fn exhausted(mut response: http::Response<Body>) -> http::Response<Body> {
    let headers = response.headers_mut();
    if headers
        .get("grpc-status")
        .is_some_and(|v| v.as_bytes() == OUT_OF_RANGE.as_bytes())
    {
        headers.insert("grpc-status", RESOURCE_EXHAUSTED);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_out_of_range_is_rewritten() {
        for (code, expected) in [("11", "8"), ("3", "3"), ("14", "14"), ("0", "0")] {
            let mut r = http::Response::new(Body::empty());
            r.headers_mut()
                .insert("grpc-status", http::HeaderValue::from_static(code));
            let r = exhausted(r);
            assert_eq!(r.headers()["grpc-status"], expected, "{code}");
        }
        let r = exhausted(http::Response::new(Body::empty()));
        assert!(r.headers().get("grpc-status").is_none());
    }
}
