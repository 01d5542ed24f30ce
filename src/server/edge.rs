//! The edge of each gRPC service ([`GrpcEdge`]): what every call meets before and after the
//! service itself, in one wrapper, so a call pays for one layer, not three. It refuses a content
//! type other than protobuf gRPC with HTTP 415, cuts a call at its deadline with
//! `DEADLINE_EXCEEDED`, and answers an oversized message `RESOURCE_EXHAUSTED`: each as gRPC's
//! specification says, where tonic alone would answer otherwise.

use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::{Either, Map, Ready, ready};
use tokio::time::Timeout;
use tokio::time::error::Elapsed;
use tonic::Status;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;

use super::hold::CallDeadline;

/// `grpc-status` of `OUT_OF_RANGE`.
const OUT_OF_RANGE: &str = "11";
/// `grpc-status` of `RESOURCE_EXHAUSTED`.
const RESOURCE_EXHAUSTED: http::HeaderValue = http::HeaderValue::from_static("8");

/// A gRPC service behind the edge: the content-type check, the server's deadline, and the
/// standard code for oversized messages.
///
/// - **Content type.** gRPC says a server SHOULD answer a `content-type` that does not begin
///   with `application/grpc` with HTTP 415, so that a plain HTTP/2 client does not take a gRPC
///   error's `200 OK` for success. sluice speaks protobuf only, so `application/grpc+json` is
///   refused too (there is no JSON codec here), as is a missing one; the refusal is a bare 415,
///   before the request reaches the service.
/// - **Deadline.** `grpc.request_timeout_ms`, answered `DEADLINE_EXCEEDED`, the code gRPC's
///   status-code specification lists for "deadline expires before server returns status".
///   tonic's own server timeout answers `CANCELLED`, so the deadline is applied here instead,
///   around the service, body reading included. A client's shorter `grpc-timeout` wins; that
///   client never reads the answer, its own deadline having passed. The deadline is put on the
///   request ([`CallDeadline`]), so that an answer held for its slot is never held past it.
/// - **Oversized messages.** A request larger than `requests.max_request_bytes` is answered
///   `RESOURCE_EXHAUSTED`, the code the specification lists for "a message larger than the
///   configured limit", as soon as its length prefix is read, before the body is buffered: that
///   check is what bounds the memory one call can take. `ShouldRateLimit`'s own reader
///   (`super::unary`) answers so itself; tonic's decoder, which reads the health service's
///   requests, refuses with `OUT_OF_RANGE`, which [`GrpcEdge::with_tonic_decoder`] corrects on
///   the way out.
#[derive(Debug, Clone)]
pub struct GrpcEdge<S> {
    inner: S,
    timeout: Duration,
    /// Whether `inner` reads its requests with tonic's decoder, whose `OUT_OF_RANGE` is
    /// answered `RESOURCE_EXHAUSTED`.
    tonic_decoder: bool,
}

impl<S> GrpcEdge<S> {
    /// `inner`, with calls cut at `timeout`: a service that refuses oversized messages itself,
    /// with `RESOURCE_EXHAUSTED`, so its answers pass as they are.
    pub fn new(inner: S, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            tonic_decoder: false,
        }
    }

    /// `inner`, with calls cut at `timeout`, reading its requests with tonic's decoder: its
    /// `OUT_OF_RANGE` for an oversized message is answered `RESOURCE_EXHAUSTED`.
    pub fn with_tonic_decoder(inner: S, timeout: Duration) -> Self {
        Self {
            inner,
            timeout,
            tonic_decoder: true,
        }
    }
}

impl<S: NamedService> NamedService for GrpcEdge<S> {
    const NAME: &'static str = S::NAME;
}

type TimedResult<R, E> = Result<Result<http::Response<R>, E>, Elapsed>;

impl<S, B, R> Service<http::Request<B>> for GrpcEdge<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>>,
    R: Default,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = Either<
        Map<Timeout<S::Future>, fn(TimedResult<R, S::Error>) -> Result<Self::Response, S::Error>>,
        Ready<Result<Self::Response, S::Error>>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if is_grpc_proto(req.headers().get(http::header::CONTENT_TYPE)) {
            let timeout = client_timeout(req.headers().get("grpc-timeout"))
                .map_or(self.timeout, |t| t.min(self.timeout));
            // What a held answer must beat (`super::hold`); none past the clock's range.
            if let Some(at) = tokio::time::Instant::now().checked_add(timeout) {
                req.extensions_mut().insert(CallDeadline(at));
            }
            let done: fn(_) -> _ = if self.tonic_decoder {
                finish_corrected
            } else {
                finish
            };
            Either::Left(tokio::time::timeout(timeout, self.inner.call(req)).map(done))
        } else {
            let mut refused = http::Response::new(R::default());
            *refused.status_mut() = http::StatusCode::UNSUPPORTED_MEDIA_TYPE;
            Either::Right(ready(Ok(refused)))
        }
    }
}

/// The service's answer, or `DEADLINE_EXCEEDED` when it took too long.
fn finish<R: Default, E>(outcome: TimedResult<R, E>) -> Result<http::Response<R>, E> {
    outcome.unwrap_or_else(|_| {
        Ok(Status::deadline_exceeded(
            "the call took longer than its deadline (grpc.request_timeout_ms or a shorter grpc-timeout)",
        )
        .into_http())
    })
}

/// As [`finish`], with tonic's decoder's code for an oversized message corrected.
fn finish_corrected<R: Default, E>(outcome: TimedResult<R, E>) -> Result<http::Response<R>, E> {
    finish(outcome).map(exhausted)
}

/// The client's `grpc-timeout` (`TimeoutValue`: at most 8 digits, then `H`, `M`, `S`, `m`, `u`
/// or `n`), read as tonic's server reads it; `None` when absent or malformed, which is ignored.
fn client_timeout(value: Option<&http::HeaderValue>) -> Option<Duration> {
    let text = value?.to_str().ok()?;
    let digits = text.get(..text.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match &text[digits.len()..] {
        "H" => Duration::from_secs(n * 3_600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// `application/grpc` (what Envoy and every gRPC client send) or `application/grpc+proto`, any
/// case, with any parameters after `;`.
fn is_grpc_proto(value: Option<&http::HeaderValue>) -> bool {
    // What Envoy and every gRPC client send, compared at once.
    if value.is_some_and(|v| v.as_bytes() == b"application/grpc") {
        return true;
    }
    let Some(value) = value.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let media = value.split(';').next().unwrap_or_default().trim();
    media.eq_ignore_ascii_case("application/grpc")
        || media.eq_ignore_ascii_case("application/grpc+proto")
}

/// `response` with tonic's decoder's `OUT_OF_RANGE` answered `RESOURCE_EXHAUSTED`, its message
/// (the length and the limit) kept. None of sluice's own answers is `OUT_OF_RANGE` (the
/// adapter's one mapping gives `INVALID_ARGUMENT` or `UNAVAILABLE`), so every `OUT_OF_RANGE` a
/// service returns is that decoder's. The refusal comes before any message, as a trailers-only
/// response: its status is in the headers.
fn exhausted<R>(mut response: http::Response<R>) -> http::Response<R> {
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
    use tonic::body::Body;

    #[test]
    fn protobuf_grpc_media_types_only() {
        let check = |v: &str| is_grpc_proto(Some(&http::HeaderValue::from_str(v).unwrap()));
        for ok in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC",
            "application/grpc; charset=utf-8",
        ] {
            assert!(check(ok), "{ok}");
        }
        for bad in [
            "application/json",
            "application/grpc+json",
            "application/grpc-web",
            "application/grpcx",
            "text/plain",
            "",
        ] {
            assert!(!check(bad), "{bad}");
        }
        assert!(!is_grpc_proto(None));
    }

    #[test]
    fn the_client_deadline_is_read_as_grpc_specifies_it() {
        let read = |v: &str| client_timeout(Some(&http::HeaderValue::from_str(v).unwrap()));
        assert_eq!(read("20m"), Some(Duration::from_millis(20)));
        assert_eq!(read("1H"), Some(Duration::from_secs(3_600)));
        assert_eq!(read("3M"), Some(Duration::from_secs(180)));
        assert_eq!(read("99999999S"), Some(Duration::from_secs(99_999_999)));
        assert_eq!(read("5u"), Some(Duration::from_micros(5)));
        assert_eq!(read("7n"), Some(Duration::from_nanos(7)));
        for bad in [
            "",
            "m",
            "100",
            "123456789m",
            "1x",
            "-1m",
            "+1m",
            "1.5S",
            "１m",
        ] {
            assert_eq!(read(bad), None, "{bad}");
        }
        assert_eq!(client_timeout(None), None);
    }

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
