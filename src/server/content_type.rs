//! The gRPC port's `content-type` check. gRPC over HTTP/2 requires a `content-type` that
//! begins with `application/grpc`, and says a server SHOULD answer anything else with HTTP 415
//! (Unsupported Media Type), so that a plain HTTP/2 client does not take a gRPC error's
//! `200 OK` for success. sluice speaks protobuf only, so it accepts `application/grpc` (what
//! Envoy and every gRPC client send) and `application/grpc+proto`, case-insensitively and with
//! any parameters after `;`, and answers every other value, or none, with a bare 415 before the
//! request reaches a service (`application/grpc+json` included: there is no JSON codec here).

use std::task::{Context, Poll};

use futures_util::future::{Either, Ready, ready};
use tonic::body::Body;
use tonic::codegen::{Service, http};
use tonic::server::NamedService;

/// A gRPC service that refuses requests whose `content-type` is not protobuf gRPC.
#[derive(Debug, Clone)]
pub struct RequireGrpc<S>(pub S);

impl<S: NamedService> NamedService for RequireGrpc<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<http::Request<B>> for RequireGrpc<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Either<S::Future, Ready<Result<Self::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if is_grpc_proto(req.headers().get(http::header::CONTENT_TYPE)) {
            Either::Left(self.0.call(req))
        } else {
            let mut refused = http::Response::new(Body::empty());
            *refused.status_mut() = http::StatusCode::UNSUPPORTED_MEDIA_TYPE;
            Either::Right(ready(Ok(refused)))
        }
    }
}

/// `application/grpc` or `application/grpc+proto`, any case, optionally with parameters.
fn is_grpc_proto(value: Option<&http::HeaderValue>) -> bool {
    let Some(value) = value.and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let media = value.split(';').next().unwrap_or_default().trim();
    media.eq_ignore_ascii_case("application/grpc")
        || media.eq_ignore_ascii_case("application/grpc+proto")
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
