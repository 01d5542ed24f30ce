//! The load benchmark's transport floor: a default tonic server (its `Server` and `Router`, none
//! of sluice's limits, the system allocator) whose `ShouldRateLimit` decodes the request as
//! sluice does ([`sluice::wire::from_pb`]) and answers OK for every descriptor without deciding.
//! What sluice's own gRPC path gains or costs is read against it.
//!
//! It takes the server's command line (`serve --grpc-addr A --admin-addr B`; other flags are
//! accepted and ignored) and answers `GET /healthcheck` (and an empty `GET /metrics`) on the
//! admin address, so the benchmark scripts start it as they start `sluice`.

use std::net::SocketAddr;

use sluice::pb::rate_limit_response::{Code, DescriptorStatus};
use sluice::pb::rate_limit_service_server::{RateLimitService, RateLimitServiceServer};
use sluice::pb::{RateLimitRequest, RateLimitResponse};
use tonic::{Request, Response, Status};

/// Answers OK without deciding.
struct Floor;

#[tonic::async_trait]
impl RateLimitService for Floor {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = sluice::wire::from_pb(request.into_inner())
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let ok = DescriptorStatus {
            code: Code::Ok.into(),
            ..DescriptorStatus::default()
        };
        Ok(Response::new(RateLimitResponse {
            overall_code: Code::Ok.into(),
            statuses: vec![ok; req.descriptors.len()],
            ..RateLimitResponse::default()
        }))
    }
}

/// The value of `--name`, either `--name value` or `--name=value`.
fn flag(args: &[String], name: &str) -> Option<SocketAddr> {
    let prefix = format!("{name}=");
    args.iter().enumerate().find_map(|(i, a)| {
        let value = if a == name {
            args.get(i + 1)?
        } else {
            a.strip_prefix(&prefix)?
        };
        value.parse().ok()
    })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(grpc), Some(admin)) = (flag(&args, "--grpc-addr"), flag(&args, "--admin-addr"))
    else {
        return Err("usage: floor serve --grpc-addr HOST:PORT --admin-addr HOST:PORT".into());
    };
    let admin = tokio::net::TcpListener::bind(admin).await?;
    let routes = axum::Router::new()
        .route("/healthcheck", axum::routing::get(|| async { "OK" }))
        .route("/metrics", axum::routing::get(|| async { "" }));
    tokio::spawn(async move { axum::serve(admin, routes).await });
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<RateLimitServiceServer<Floor>>()
        .await;
    tonic::transport::Server::builder()
        .add_service(health)
        .add_service(RateLimitServiceServer::new(Floor))
        .serve(grpc)
        .await?;
    Ok(())
}
