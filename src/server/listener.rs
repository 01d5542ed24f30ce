//! Accepting and serving connections with bounds: what one peer, or many, can hold on a
//! listener.
//!
//! [`Incoming`] accepts TCP connections for both ports and bounds what hyper cannot bound by
//! itself:
//! - **connections**: at most `max_connections` are open at once; a connection accepted past the
//!   cap is closed at once (the peer sees a reset and can try another node, instead of hanging in
//!   the kernel backlog until its deadline), with a rate-limited warning;
//! - **accept errors**: when `accept` fails for want of resources (`EMFILE`, `ENFILE`, `ENOBUFS`,
//!   `ENOMEM`, ...) the loop sleeps, 5 ms doubling to 1 s, instead of retrying at once (the
//!   pending connection stays in the backlog, so every retry fails again and the loop spins a
//!   core); a warning at most once a second says how many accepts failed.
//!
//! [`serve_grpc`] serves the gRPC port, one task per connection, which also runs the
//! connection's calls (`super::streams`: no task per call, and the answers to one read leave in
//! one write), each with:
//! - **TLS** (when configured): the handshake runs in the connection's task, never in the accept
//!   loop, and is cut at the handshake timeout, so a peer that connects and never finishes it
//!   neither blocks accepting nor holds its place under the cap for longer than that;
//! - **an idle timeout**: a connection over which the peer has sent no HEADERS or DATA frame for
//!   `idle_timeout` is closed. [`IdleCut`] counts frames from their 9-byte headers in the bytes
//!   read (decrypted ones, under TLS), so keep-alive PINGs (ours and their acknowledgements),
//!   SETTINGS and WINDOW_UPDATEs do not keep a connection alive, while a connection that carries
//!   requests is never cut. The connection is ended by reporting end-of-stream to hyper, so no
//!   GOAWAY is sent: the peer sees the TCP connection close with no stream open on it. Because
//!   every call must end within the gRPC request timeout, which settings keep below the idle
//!   timeout, a unary call is never open on a connection closed as idle. A server-streaming call
//!   (`grpc.health.v1.Health/Watch`) with no traffic is; its client reconnects;
//! - **a maximum age** (when configured): past its age (±10 % jitter) the connection is sent a
//!   GOAWAY and its calls in flight finish; past the age and the grace it is closed, so that
//!   clients behind a Kubernetes Service reconnect and rebalance;
//! - **a graceful drain**: at shutdown every connection is sent a GOAWAY and the server waits
//!   for the calls in flight (the app bounds that wait by its grace period).
//!
//! The HTTP/2 limits per connection (concurrent streams, header list size, keep-alive,
//! reset-stream limits) are set on hyper's builder in [`super::grpc_connection`], the request
//! timeout per call by the edge; the admin port's header-read timeout is hyper's, set in
//! [`serve_admin`], which is why the admin port is served with hyper's HTTP/1 connection builder
//! rather than `axum::serve`.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tonic::codegen::http;

use super::streams::{Served, Streams};
use crate::settings::GrpcLimits;
use crate::tls::ServerTls;

/// First pause after an accept error; it doubles on every further error.
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
/// Longest pause between accepts after errors.
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// Least time between two warnings of the same kind from one listener.
const WARN_EVERY: Duration = Duration::from_secs(1);

/// A listener's accepted connections, bounded in number, with back-off on accept errors.
#[derive(Debug)]
pub struct Incoming {
    listener: TcpListener,
    what: &'static str,
    max_connections: usize,
    /// Connections open now. Relaxed: a counter compared against the cap; no other memory is
    /// published through it, and a momentary overshoot by a racing close is harmless.
    open: Arc<AtomicUsize>,
    backoff: Duration,
    pause: Option<Pin<Box<Sleep>>>,
    accept_errors: Throttle,
    over_cap: Throttle,
}

impl Incoming {
    /// Accepts on `listener` (`what` names it in logs), holding at most `max_connections` open.
    #[must_use]
    pub fn new(listener: TcpListener, what: &'static str, max_connections: usize) -> Self {
        Self {
            listener,
            what,
            max_connections,
            open: Arc::new(AtomicUsize::new(0)),
            backoff: Duration::ZERO,
            pause: None,
            accept_errors: Throttle::default(),
            over_cap: Throttle::default(),
        }
    }

    /// The next connection within the cap; never fails (errors are backed off and logged).
    pub async fn accept(&mut self) -> Conn {
        std::future::poll_fn(|cx| self.poll_conn(cx)).await
    }

    fn poll_conn(&mut self, cx: &mut Context<'_>) -> Poll<Conn> {
        loop {
            if let Some(pause) = self.pause.as_mut() {
                ready!(pause.as_mut().poll(cx));
                self.pause = None;
            }
            match ready!(self.listener.poll_accept(cx)) {
                Ok((stream, peer)) => {
                    self.backoff = Duration::ZERO;
                    if self.open.load(Ordering::Relaxed) >= self.max_connections {
                        if let Some(dropped) = self.over_cap.tick() {
                            tracing::warn!(
                                listener = self.what,
                                max_connections = self.max_connections,
                                refused = dropped,
                                "connection limit reached; closing new connections"
                            );
                        }
                        drop(stream);
                        continue;
                    }
                    return Poll::Ready(self.admit(stream, peer));
                }
                Err(e) if per_connection(&e) => {}
                Err(e) => {
                    self.backoff = (self.backoff * 2).clamp(FIRST_BACKOFF, MAX_BACKOFF);
                    if let Some(failed) = self.accept_errors.tick() {
                        tracing::warn!(
                            listener = self.what,
                            error = %e,
                            failed,
                            backoff_ms = self.backoff.as_millis(),
                            "cannot accept connections; backing off"
                        );
                    }
                    self.pause = Some(Box::pin(tokio::time::sleep(self.backoff)));
                }
            }
        }
    }

    fn admit(&self, stream: TcpStream, peer: SocketAddr) -> Conn {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        self.open.fetch_add(1, Ordering::Relaxed);
        Conn {
            io: stream,
            peer,
            _slot: Slot(Arc::clone(&self.open)),
        }
    }
}

/// Errors that concern one pending connection (the peer gave up before we accepted it), after
/// which the next accept can succeed at once; every other error is a resource problem.
fn per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::Interrupted
            | io::ErrorKind::WouldBlock
    )
}

/// Says when a warning may be logged again, and how many events it then summarises.
#[derive(Debug, Default)]
struct Throttle {
    last: Option<Instant>,
    events: u64,
}

impl Throttle {
    /// Counts an event; `Some(events since the last warning)` when one may be logged now.
    fn tick(&mut self) -> Option<u64> {
        self.events += 1;
        let now = Instant::now();
        if self
            .last
            .is_some_and(|l| now.duration_since(l) < WARN_EVERY)
        {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.events))
    }
}

/// Frees a connection's place under the cap when the connection is dropped.
#[derive(Debug)]
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An accepted connection: the TCP stream and its place under the cap, freed when it drops.
#[derive(Debug)]
pub struct Conn {
    io: TcpStream,
    peer: SocketAddr,
    _slot: Slot,
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// An HTTP/2 byte stream that reports end-of-stream once the peer has sent no request frame for
/// the idle timeout (see the module header); writes pass through.
#[derive(Debug)]
pub struct IdleCut<T> {
    io: T,
    idle: Idle,
    peer: SocketAddr,
}

impl<T> IdleCut<T> {
    /// `io`, cut after `timeout` without a request frame from `peer`.
    pub fn new(io: T, timeout: Duration, peer: SocketAddr) -> Self {
        Self {
            io,
            idle: Idle::new(timeout),
            peer,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for IdleCut<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let idle = &mut this.idle;
        if idle.expired {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let now = Instant::now();
                if idle.frames.feed(&buf.filled()[before..]) {
                    idle.last = now;
                } else if now >= idle.last + idle.timeout {
                    // Upkeep frames arriving without pause must not keep the connection either:
                    // this read is delivered, the next one ends the connection.
                    tracing::debug!(peer = %this.peer, "closing idle connection");
                    idle.expired = true;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if idle.poll_expired(cx) {
                    tracing::debug!(peer = %this.peer, "closing idle connection");
                    // End-of-stream: hyper ends the connection and drops it, closing the socket.
                    return Poll::Ready(Ok(()));
                }
                Poll::Pending
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for IdleCut<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The idle timer of one HTTP/2 connection.
#[derive(Debug)]
struct Idle {
    timeout: Duration,
    /// When the peer last sent a HEADERS or DATA frame (or connected).
    last: Instant,
    /// Fires at `last + timeout` or earlier; moved on lazily, so activity costs no timer update.
    timer: Pin<Box<Sleep>>,
    frames: FrameScan,
    expired: bool,
}

impl Idle {
    fn new(timeout: Duration) -> Self {
        let now = Instant::now();
        Self {
            timeout,
            last: now,
            timer: Box::pin(tokio::time::sleep_until(now + timeout)),
            frames: FrameScan::default(),
            expired: false,
        }
    }

    /// Whether the connection has now been idle for the timeout; registers a wake-up otherwise.
    fn poll_expired(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return false;
            }
            let deadline = self.last + self.timeout;
            if Instant::now() >= deadline {
                self.expired = true;
                return true;
            }
            self.timer.as_mut().reset(deadline);
        }
    }
}

/// Follows the frames of an inbound HTTP/2 byte stream from their headers, without buffering
/// payloads, to tell request traffic from connection upkeep.
#[derive(Debug)]
struct FrameScan {
    /// Bytes of the client connection preface still to skip.
    preface: usize,
    head: [u8; 9],
    filled: usize,
    /// Payload bytes of the current frame still to skip.
    payload: usize,
}

impl Default for FrameScan {
    fn default() -> Self {
        Self {
            preface: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".len(),
            head: [0; 9],
            filled: 0,
            payload: 0,
        }
    }
}

impl FrameScan {
    /// HTTP/2 frame types that carry requests: DATA, HEADERS, CONTINUATION.
    const REQUEST_FRAMES: [u8; 3] = [0x0, 0x1, 0x9];

    /// Consumes the next bytes read; true when they began a frame that carries requests.
    fn feed(&mut self, mut bytes: &[u8]) -> bool {
        let mut active = false;
        while !bytes.is_empty() {
            let skip = if self.preface > 0 {
                &mut self.preface
            } else {
                &mut self.payload
            };
            if *skip > 0 {
                let n = (*skip).min(bytes.len());
                *skip -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (9 - self.filled).min(bytes.len());
            self.head[self.filled..self.filled + n].copy_from_slice(&bytes[..n]);
            self.filled += n;
            bytes = &bytes[n..];
            if self.filled == 9 {
                self.filled = 0;
                let [a, b, c, kind, ..] = self.head;
                self.payload = usize::from(a) << 16 | usize::from(b) << 8 | usize::from(c);
                active |= Self::REQUEST_FRAMES.contains(&kind);
            }
        }
        active
    }
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
    mut incoming: Incoming,
    service: S,
    connections: GrpcConnections,
    stop: CancellationToken,
) -> Result<(), std::convert::Infallible>
where
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<B>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
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
    conn: Conn,
    service: S,
    connections: &GrpcConnections,
    stop: &CancellationToken,
) where
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<B>,
            Error = std::convert::Infallible,
        > + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let peer = conn.peer;
    let idle = connections.limits.idle_timeout;
    let Some(tls) = &connections.tls else {
        let io = IdleCut::new(conn, idle, peer);
        return serve_http2(io, service, connections, stop).await;
    };
    let handshake = tokio::time::timeout(tls.handshake_timeout(), tls.acceptor().accept(conn));
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
    serve_http2(io, service, connections, stop).await;
}

async fn serve_http2<IO, S, B>(
    io: IO,
    service: S,
    connections: &GrpcConnections,
    stop: &CancellationToken,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<B>,
            Error = std::convert::Infallible,
        > + Send
        + 'static,
    S::Future: Send + 'static,
    B: hyper::body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let streams = Streams::default();
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

/// Serves `router` over HTTP/1.1 on `incoming` until `stop`, then finishes the requests in
/// flight and returns. A connection that has not sent a complete request head within
/// `header_read_timeout` (for its first request or the next one on a kept-alive connection) is
/// closed; axum's `serve` sets no timer, so hyper enforces no header deadline under it.
///
/// # Errors
///
/// Never: accept errors are backed off and retried, connection errors end one connection.
/// (The `Result` lets callers treat it like the gRPC server's future.)
pub async fn serve_admin(
    mut incoming: Incoming,
    router: axum::Router,
    header_read_timeout: Duration,
    stop: CancellationToken,
) -> Result<(), std::convert::Infallible> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;

    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    // Every connection task holds a receiver; shutdown waits until all are dropped.
    let (open_tx, open_rx) = tokio::sync::watch::channel(());
    loop {
        let conn = tokio::select! {
            () = stop.cancelled() => break,
            conn = incoming.accept() => conn,
        };
        let served =
            builder.serve_connection(TokioIo::new(conn), TowerToHyperService::new(router.clone()));
        let (stop, open) = (stop.clone(), open_rx.clone());
        tokio::spawn(async move {
            let mut served = std::pin::pin!(served);
            tokio::select! {
                r = served.as_mut() => finished(r),
                () = stop.cancelled() => {
                    served.as_mut().graceful_shutdown();
                    finished(served.await);
                }
            }
            drop(open);
        });
    }
    drop(incoming);
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}

fn finished(r: Result<(), hyper::Error>) {
    if let Err(e) = r {
        tracing::debug!(error = %e, "admin connection ended");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, 0, 0, 0, 0, 1];
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn only_request_frames_count_as_activity_however_the_bytes_are_split() {
        let mut upkeep = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        upkeep.extend(frame(0x4, &[0; 12])); // SETTINGS
        upkeep.extend(frame(0x6, &[1; 8])); // PING, whose payload holds a HEADERS type byte
        upkeep.extend(frame(0x8, &[0, 0, 1, 0])); // WINDOW_UPDATE
        let headers = frame(0x1, &[0x83; 40]);
        // Feeds every chunk (no short circuit): whether any began a request frame.
        let feed = |scan: &mut FrameScan, bytes: &[u8], split: usize| {
            bytes
                .chunks(split)
                .fold(false, |seen, c| scan.feed(c) | seen)
        };
        for split in [1, 2, 7, 9, 1_000] {
            let mut scan = FrameScan::default();
            assert!(
                !feed(&mut scan, &upkeep, split),
                "upkeep counted, split {split}"
            );
            assert!(feed(&mut scan, &headers, split), "split {split}");
            assert!(!scan.feed(&frame(0x6, &[0; 8])), "split {split}");
            assert!(scan.feed(&frame(0x0, b"body")), "DATA, split {split}");
        }
    }

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

    #[test]
    fn warnings_are_throttled_and_count_what_they_summarise() {
        let mut t = Throttle::default();
        assert_eq!(t.tick(), Some(1));
        assert_eq!(t.tick(), None);
        assert_eq!(t.tick(), None);
        t.last = Some(Instant::now() - WARN_EVERY);
        assert_eq!(t.tick(), Some(3));
    }
}
