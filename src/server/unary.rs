//! `ShouldRateLimit` served by hand over hyper's body ([`ShouldRateLimit`]): the one unary call
//! Envoy makes, without tonic's per-call codec machinery (its `Streaming` decoder with an 8 KiB
//! buffer, the request body boxed twice over, the encode body and its buffer, and two boxed
//! futures). On the wire it answers as tonic's generated server does, answer for answer.

use std::convert::Infallible;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use hyper::body::{Body as _, Frame, Incoming};
use prost::Message;
use tonic::codegen::{Service, http};
use tonic::{Code, Status};

use super::hold::{CallDeadline, ConnectionHolds};
use super::rls::{HoldContext, RateLimitHandler};
use crate::pb::RateLimitRequest;
use crate::pb::codec::Wire;
use crate::traces::CallTracer;

/// The path of the rate-limit service's one method.
const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The name of its spans.
const TRACED_METHOD: &str = "ShouldRateLimit";

/// The status of a unary call whose body holds a second message (grpc-java's words).
const TOO_MANY_REQUESTS: &str = "Too many requests";

/// The length of a gRPC message's prefix: the compressed flag and a 4-byte big-endian length.
const PREFIX: usize = 5;

/// `ShouldRateLimit` answered by `handler`, with request messages limited to `max_request_bytes`.
/// Each call holds one reference to the handler, where a clone of the decider itself would take
/// a reference count for each of its parts.
///
/// The call behaves on the wire as tonic's generated server does:
/// - another method of the service: `UNIMPLEMENTED`, trailers-only;
/// - the request's `grpc-encoding`: absent or `identity`, else `UNIMPLEMENTED` with
///   `grpc-accept-encoding: identity` (no compression is offered);
/// - each message's 5-byte prefix, checked as soon as it arrives, before the message is
///   buffered: a compressed flag is `INTERNAL` (nothing may be compressed), another flag is
///   `INTERNAL`, a length over `requests.max_request_bytes` is `RESOURCE_EXHAUSTED` at once, so
///   a call never holds more than the limit and one frame;
/// - a unary call carries exactly one message: a second one is `INTERNAL` ("Too many requests",
///   as grpc-java answers) and nothing is decided (tonic decides the first and drops the rest);
///   a body that ends inside a message is `INTERNAL` ("Unexpected EOF"), one without a message
///   `INTERNAL` ("Missing request message");
/// - a message that does not decode is `INVALID_ARGUMENT` (`crate::pb::codec`);
/// - every call refused for what its body or headers carry counts as an invalid request in
///   `sluice_decisions_total`;
/// - the answer: `content-type: application/grpc`, one message frame, then `grpc-status: 0` as
///   trailers; an error is a trailers-only answer, its status in the headers.
#[derive(Debug, Clone)]
pub(crate) struct ShouldRateLimit {
    handler: Arc<RateLimitHandler>,
    max_request_bytes: usize,
    /// With tracing on: a span per call, child of the caller's.
    tracer: Option<Arc<CallTracer>>,
}

impl ShouldRateLimit {
    pub(crate) fn new(
        handler: RateLimitHandler,
        max_request_bytes: usize,
        tracer: Option<Arc<CallTracer>>,
    ) -> Self {
        Self {
            handler: Arc::new(handler),
            max_request_bytes,
            tracer,
        }
    }

    async fn answer(self, req: http::Request<Incoming>) -> http::Response<UnaryBody> {
        if req.uri().path() != SHOULD_RATE_LIMIT {
            // The generated server's answer to a method the service does not have.
            return Status::unimplemented("").into_http();
        }
        let started = std::time::Instant::now();
        let mut span = self.tracer.as_ref().map(|tracer| {
            let headers = req.headers();
            tracer.start(TRACED_METHOD, |name| {
                headers.get(name).and_then(|v| v.to_str().ok())
            })
        });
        let context = HoldContext {
            deadline: req.extensions().get::<CallDeadline>().copied(),
            connection: req.extensions().get::<ConnectionHolds>().cloned(),
        };
        let answered = async {
            let request = read_request(req, self.max_request_bytes)
                .await
                .inspect_err(|_| self.handler.count_malformed())?;
            encode(
                &self
                    .handler
                    .answer(request, span.as_deref_mut(), context)
                    .await?,
            )
        };
        let answered = answered.await;
        self.handler.called(started.elapsed());
        if let Some(span) = &mut span {
            match &answered {
                Ok(_) => span.grpc_status(0),
                Err(status) => {
                    span.grpc_status(status.code() as i32);
                    span.failed_with(status.message().to_owned());
                }
            }
        }
        match answered {
            Ok(message) => {
                let mut trailers = http::HeaderMap::with_capacity(1);
                trailers.insert(Status::GRPC_STATUS, http::HeaderValue::from_static("0"));
                let mut response = http::Response::new(UnaryBody {
                    message: Some(message),
                    trailers: Some(trailers),
                });
                response.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    tonic::metadata::GRPC_CONTENT_TYPE,
                );
                response
            }
            Err(status) => status.into_http(),
        }
    }
}

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<UnaryBody>, Infallible>> + Send>>;

impl Service<http::Request<Incoming>> for ShouldRateLimit {
    type Response = http::Response<UnaryBody>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Incoming>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move { Ok(this.answer(req).await) })
    }
}

/// The call's one request message, decoded; any failure to get it is the status it ends with.
async fn read_request(
    req: http::Request<Incoming>,
    max: usize,
) -> Result<RateLimitRequest, Status> {
    refuse_compression(req.headers())?;
    let message = read_message(req.into_body(), max).await?;
    RateLimitRequest::decode(message).map_err(RateLimitRequest::decode_error)
}

/// The request's `grpc-encoding`, which must name no compression.
fn refuse_compression(headers: &http::HeaderMap) -> Result<(), Status> {
    let Some(value) = headers.get("grpc-encoding") else {
        return Ok(());
    };
    if value.as_bytes() == b"identity" {
        return Ok(());
    }
    let name = std::str::from_utf8(value.as_bytes())
        .map_or_else(|_| format!("{:?}", value.as_bytes()), str::to_owned);
    let mut status = Status::unimplemented(format!(
        "Content is compressed with `{name}` which isn't supported"
    ));
    status.metadata_mut().insert(
        "grpc-accept-encoding",
        tonic::metadata::MetadataValue::from_static("identity"),
    );
    Err(status)
}

/// The length in a message prefix at the start of `bytes` (`None` until all five bytes are
/// there), refused when the message is compressed or longer than `max`.
fn prefix(bytes: &[u8], max: usize) -> Result<Option<usize>, Status> {
    let Some(head) = bytes.get(..PREFIX) else {
        return Ok(None);
    };
    match head[0] {
        0 => {}
        1 => {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ));
        }
        flag => {
            return Err(Status::internal(format!(
                "protocol error: received message with invalid compression flag: {flag} (valid flags are 0 and 1), while sending request"
            )));
        }
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > max {
        return Err(Status::resource_exhausted(format!(
            "Error, decoded message length too large: found {len} bytes, the limit is: {max} bytes"
        )));
    }
    Ok(Some(len))
}

/// Splits a unary call's body into messages, checking each prefix as soon as it is complete.
/// A message that arrives in one DATA frame (Envoy's requests do) is taken where hyper put it,
/// without a copy; one split across frames is assembled in a buffer sized once from its prefix.
#[derive(Debug)]
struct Messages {
    max: usize,
    /// A message (prefix included) that spans DATA frames, as far as it has arrived.
    partial: BytesMut,
    first: Option<Bytes>,
}

impl Messages {
    fn feed(&mut self, mut data: Bytes) -> Result<(), Status> {
        while !data.is_empty() {
            // Any byte past the first message begins a second one: refused before it is read.
            if self.first.is_some() {
                return Err(Status::internal(TOO_MANY_REQUESTS));
            }
            if self.partial.is_empty()
                && let Some(len) = prefix(&data, self.max)?
                && data.len() >= PREFIX + len
            {
                // The whole message is in this frame: no copy.
                data.advance(PREFIX);
                let message = data.split_to(len);
                self.first = Some(message);
                continue;
            }
            let want = match prefix(&self.partial, self.max)? {
                Some(len) => PREFIX + len,
                None => PREFIX,
            };
            let take = (want - self.partial.len()).min(data.len());
            self.partial.extend_from_slice(&data.split_to(take));
            if let Some(len) = prefix(&self.partial, self.max)? {
                if self.partial.len() == PREFIX + len {
                    let mut message = self.partial.split().freeze();
                    message.advance(PREFIX);
                    self.first = Some(message);
                } else {
                    self.partial.reserve(PREFIX + len - self.partial.len());
                }
            }
        }
        Ok(())
    }
}

/// Reads a unary call's body to its end and returns its one message.
async fn read_message(body: Incoming, max: usize) -> Result<Bytes, Status> {
    let mut body = pin!(body);
    let mut messages = Messages {
        max,
        partial: BytesMut::new(),
        first: None,
    };
    while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        match frame {
            // Trailers of a request carry nothing the call reads.
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    messages.feed(data)?;
                }
            }
            Err(e) => {
                let status = Status::from_error(Box::new(e));
                // A client that cancels has ended its request; tonic reads that as the end.
                if status.code() == Code::Cancelled {
                    break;
                }
                return Err(status);
            }
        }
    }
    if !messages.partial.is_empty() {
        return Err(Status::internal("Unexpected EOF decoding stream."));
    }
    messages
        .first
        .ok_or_else(|| Status::internal("Missing request message."))
}

/// `message` framed as one gRPC message: the prefix, then the protobuf, in one buffer.
fn encode(message: &impl Message) -> Result<Bytes, Status> {
    let len = message.encoded_len();
    let prefix_len = u32::try_from(len)
        .map_err(|_| Status::internal(format!("a response of {len} bytes cannot be framed")))?;
    let mut buf = BytesMut::with_capacity(PREFIX + len);
    buf.put_u8(0);
    buf.put_u32(prefix_len);
    message.encode_raw(&mut buf);
    Ok(buf.freeze())
}

/// A unary answer's body: one message, then the trailers; empty (the default) for a
/// trailers-only answer, whose status is in the headers.
#[derive(Debug, Default)]
pub(crate) struct UnaryBody {
    message: Option<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl hyper::body::Body for UnaryBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        Poll::Ready(match this.message.take() {
            Some(message) => Some(Ok(Frame::data(message))),
            None => this.trailers.take().map(|t| Ok(Frame::trailers(t))),
        })
    }

    // No exact size hint: hyper would add a `content-length`, which tonic's answers never had.
    fn is_end_stream(&self) -> bool {
        self.message.is_none() && self.trailers.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut out = vec![flag];
        out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    fn messages(max: usize) -> Messages {
        Messages {
            max,
            partial: BytesMut::new(),
            first: None,
        }
    }

    fn request(domain: &str) -> Vec<u8> {
        RateLimitRequest {
            domain: domain.into(),
            ..RateLimitRequest::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn a_message_in_one_frame_or_split_at_every_byte_reads_the_same() {
        let body = framed(0, &request("svc"));
        let mut whole = messages(1024);
        whole.feed(Bytes::from(body.clone())).unwrap();
        assert_eq!(whole.first.as_deref(), Some(&request("svc")[..]));
        assert!(whole.partial.is_empty());
        for cut in 1..body.len() {
            let mut split = messages(1024);
            split.feed(Bytes::copy_from_slice(&body[..cut])).unwrap();
            assert!(split.first.is_none(), "cut at {cut}");
            split.feed(Bytes::copy_from_slice(&body[cut..])).unwrap();
            assert_eq!(split.first, whole.first, "cut at {cut}");
            assert!(split.partial.is_empty(), "cut at {cut}");
        }
        let mut bytewise = messages(1024);
        for b in &body {
            bytewise.feed(Bytes::copy_from_slice(&[*b])).unwrap();
        }
        assert_eq!(bytewise.first, whole.first);
    }

    #[test]
    fn an_empty_message_is_a_message() {
        let mut m = messages(16);
        m.feed(Bytes::from(framed(0, &[]))).unwrap();
        assert_eq!(m.first.as_deref(), Some(&[][..]));
    }

    #[test]
    fn the_prefix_is_checked_before_the_message_arrives() {
        // Only the prefix of a message one byte over the limit: refused already.
        let prefix_only = &framed(0, &[0; 17])[..PREFIX];
        let err = messages(16)
            .feed(Bytes::copy_from_slice(prefix_only))
            .unwrap_err();
        assert_eq!(err.code(), Code::ResourceExhausted);
        assert!(
            err.message()
                .contains("found 17 bytes, the limit is: 16 bytes")
        );
        // At the limit: accepted.
        let mut at = messages(16);
        at.feed(Bytes::from(framed(0, &[0; 16]))).unwrap();
        assert_eq!(at.first.as_deref(), Some(&[0; 16][..]));
    }

    #[test]
    fn compressed_and_unknown_flags_are_internal() {
        for (flag, words) in [(1, "compressed-flag"), (2, "invalid compression flag: 2")] {
            let err = messages(64)
                .feed(Bytes::from(framed(flag, &[])))
                .unwrap_err();
            assert_eq!(err.code(), Code::Internal);
            assert!(err.message().contains(words), "{}", err.message());
        }
    }

    #[test]
    fn a_second_message_is_refused() {
        let mut body = framed(0, &request("first"));
        body.extend(framed(0, &request("second")));
        let err = messages(64).feed(Bytes::from(body)).unwrap_err();
        assert_eq!(err.code(), Code::Internal);
        assert_eq!(err.message(), TOO_MANY_REQUESTS);
        // Also when the second arrives in a frame of its own, from its first byte on.
        let mut m = messages(64);
        m.feed(Bytes::from(framed(0, &request("first")))).unwrap();
        let err = m.feed(Bytes::from_static(&[0])).unwrap_err();
        assert_eq!(err.code(), Code::Internal);
    }

    #[test]
    fn only_identity_encoding_is_accepted() {
        let mut headers = http::HeaderMap::new();
        assert!(refuse_compression(&headers).is_ok());
        headers.insert("grpc-encoding", http::HeaderValue::from_static("identity"));
        assert!(refuse_compression(&headers).is_ok());
        headers.insert("grpc-encoding", http::HeaderValue::from_static("gzip"));
        let err = refuse_compression(&headers).unwrap_err();
        assert_eq!(err.code(), Code::Unimplemented);
        assert!(err.message().contains("`gzip`"));
        assert_eq!(
            err.metadata().get("grpc-accept-encoding").unwrap(),
            "identity"
        );
    }

    #[test]
    fn an_answer_is_one_framed_message() {
        let response = crate::pb::RateLimitResponse {
            overall_code: 1,
            ..crate::pb::RateLimitResponse::default()
        };
        let framed_answer = encode(&response).unwrap();
        assert_eq!(
            &framed_answer[..],
            &framed(0, &response.encode_to_vec())[..]
        );
    }
}
