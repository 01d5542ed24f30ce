//! Serving the gRPC port's connections, one task each, which also runs the connection's calls
//! (`super::streams`): the TLS handshake in that task, cut at its timeout, never in the accept
//! loop; the idle cut (`super::idle`); a maximum age (±10 % jitter) after which the connection
//! gets a GOAWAY and, past the grace, is closed, so clients behind a Service rebalance; and a
//! graceful drain at shutdown. Each request carries what its connection's calls share (the count
//! of its quota streams and of its held answers, and its peer's address). The HTTP/2 limits are
//! set on hyper's builder in [`super::grpc_connection`], the request timeout per call by the
//! edge.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http;

use super::accept::{Accepted, CappedListener};
use super::hold::ConnectionHolds;
use super::idle::IdleCut;
use super::streams::{Served, Streams};
use crate::rlqs::places::ConnectionStreams;
use crate::settings::GrpcLimits;
use crate::tls::ServerTls;

/// What the gRPC port serves: a hyper service whose calls may run in any task.
pub trait GrpcService<B>:
    hyper::service::Service<
        http::Request<hyper::body::Incoming>,
        Response = http::Response<B>,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + Send
    + 'static
{
}

impl<S, B> GrpcService<B> for S where
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<B>,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + Send
        + 'static
{
}

/// The body of the gRPC port's answers.
pub trait GrpcBody:
    hyper::body::Body<Data = bytes::Bytes, Error: Into<Box<dyn std::error::Error + Send + Sync>>>
    + Send
    + 'static
{
}

impl<B> GrpcBody for B where
    B: hyper::body::Body<
            Data = bytes::Bytes,
            Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        > + Send
        + 'static
{
}

/// How the gRPC port serves each connection.
#[derive(Debug, Clone)]
pub struct GrpcConnections {
    /// The per-connection limits: HTTP/2's, the idle timeout, the maximum age (before jitter)
    /// and the grace after it.
    pub limits: GrpcLimits,
    /// TLS, when configured.
    pub tls: Option<ServerTls>,
}

/// Serves `service` over HTTP/2 on `incoming`, one task per connection, until `stop`; then
/// sends every connection a GOAWAY, waits for their calls in flight and returns.
///
/// # Errors
///
/// Never: accept errors are backed off and retried, connection errors end one connection.
/// (The `Result` lets callers treat it like any other server's future.)
pub async fn serve_grpc<S, B>(
    mut incoming: CappedListener,
    service: S,
    connections: GrpcConnections,
    stop: CancellationToken,
) -> Result<(), std::convert::Infallible>
where
    S: GrpcService<B> + Clone + Sync,
    B: GrpcBody,
{
    let connections = Arc::new(connections);
    // Every connection task holds a receiver; shutdown waits until all are dropped.
    let (open_tx, open_rx) = tokio::sync::watch::channel(());
    loop {
        let conn = tokio::select! {
            () = stop.cancelled() => break,
            conn = incoming.accept() => conn,
        };
        let (service, connections, stop, open) = (
            service.clone(),
            Arc::clone(&connections),
            stop.clone(),
            open_rx.clone(),
        );
        tokio::spawn(async move {
            serve_grpc_connection(conn, service, &connections, &stop).await;
            drop(open);
        });
    }
    // Closes the listening socket at once, so new clients go elsewhere during the drain.
    drop(incoming);
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}

/// One gRPC connection: the TLS handshake when configured, then HTTP/2 until the peer leaves,
/// the connection idles or ages out, or the server stops.
async fn serve_grpc_connection<S, B>(
    conn: Accepted,
    service: S,
    connections: &GrpcConnections,
    stop: &CancellationToken,
) where
    S: GrpcService<B>,
    B: GrpcBody,
{
    let Accepted { io, peer, place } = conn;
    // The connection's place under the cap, until this task ends.
    let _place = place;
    let idle = connections.limits.idle_timeout;
    let Some(tls) = &connections.tls else {
        let io = IdleCut::new(io, idle, peer);
        return serve_http2(io, peer, service, connections, stop).await;
    };
    let handshake = tokio::time::timeout(tls.handshake_timeout(), tls.acceptor().accept(io));
    let stream = tokio::select! {
        () = stop.cancelled() => return,
        done = handshake => match done {
            Ok(Ok(stream)) => stream,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "TLS handshake timed out; closing the connection");
                return;
            }
        },
    };
    // The frame counter reads the decrypted bytes.
    let io = IdleCut::new(stream, idle, peer);
    serve_http2(io, peer, service, connections, stop).await;
}

async fn serve_http2<IO, S, B>(
    io: IO,
    peer: SocketAddr,
    service: S,
    connections: &GrpcConnections,
    stop: &CancellationToken,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: GrpcService<B>,
    B: GrpcBody,
{
    let streams = Streams::default();
    let service = OnConnection {
        service,
        quota_streams: ConnectionStreams::from_peer(peer.ip()),
        streams: streams.clone(),
        holds: ConnectionHolds::default(),
    };
    let served = super::grpc_connection(&connections.limits, streams.clone())
        .serve_connection(hyper_util::rt::TokioIo::new(io), service);
    let mut served = Served::new(served, streams);
    let aged = async {
        match connections.limits.max_connection_age {
            Some(age) => tokio::time::sleep(jittered(age)).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        r = &mut served => return finished_grpc(r),
        () = stop.cancelled() => {
            served.conn().graceful_shutdown();
            // The app's grace period bounds this wait.
            return finished_grpc(served.await);
        }
        () = aged => {
            tracing::debug!("connection past its max age; sending GOAWAY");
            served.conn().graceful_shutdown();
        }
    }
    // Only an aged connection gets here.
    let grace = connections.limits.max_connection_age_grace;
    match tokio::time::timeout(grace, served).await {
        Ok(r) => finished_grpc(r),
        Err(_) => tracing::debug!("connection past its max age and grace; closing it"),
    }
}

/// A connection's service: each request carries, in its extensions, what the calls of its
/// connection share (the count of its quota streams and the peer's address, by which the quota
/// service bounds them), and a
/// quota stream its [`super::streams::StreamReset`], so that it can end a stream whose peer stopped reading.
#[derive(Clone)]
struct OnConnection<S> {
    service: S,
    quota_streams: ConnectionStreams,
    streams: Streams,
    holds: ConnectionHolds,
}

impl<S, B> hyper::service::Service<http::Request<hyper::body::Incoming>> for OnConnection<S>
where
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<B>,
            Error = std::convert::Infallible,
        >,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn call(&self, mut request: http::Request<hyper::body::Incoming>) -> Self::Future {
        request.extensions_mut().insert(self.quota_streams.clone());
        request.extensions_mut().insert(self.holds.clone());
        if request.uri().path().starts_with(super::RLQS_PREFIX) {
            request.extensions_mut().insert(self.streams.resettable());
        }
        self.service.call(request)
    }
}

/// `age` ±10 %, at random, so that connections opened together do not all leave together.
fn jittered(age: Duration) -> Duration {
    use std::hash::BuildHasher;
    // A fresh random seed per call; only its spread matters here.
    let r = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
    let permille = 900 + r % 201; // 900..=1100
    age.mul_f64(permille as f64 / 1_000.0)
}

fn finished_grpc(r: Result<(), hyper::Error>) {
    if let Err(e) = r {
        tracing::debug!(error = %e, "gRPC connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_age_is_jittered_within_ten_percent() {
        let age = Duration::from_secs(100);
        let ages: Vec<Duration> = (0..200).map(|_| jittered(age)).collect();
        assert!(
            ages.iter().all(|a| (90..=110).contains(&a.as_secs())),
            "{ages:?}"
        );
        assert!(ages.iter().any(|a| *a != ages[0]), "jitter varies");
    }
}
