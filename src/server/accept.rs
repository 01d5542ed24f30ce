//! Accepting connections for both ports within bounds that hyper cannot set by itself:
//! - **connections**: at most `max_connections` are open at once; a connection accepted past the
//!   cap is closed at once (the peer sees a reset and can try another node instead of waiting in
//!   the kernel backlog until its deadline), with a rate-limited warning;
//! - **accept errors**: when `accept` fails for want of resources (`EMFILE`, `ENOBUFS`, ...) the
//!   loop backs off, 5 ms doubling to 1 s, instead of spinning on the pending connection, and
//!   warns at most once a second.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};

/// First pause after an accept error; it doubles on every further error.
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
/// Longest pause between accepts after errors.
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// Least time between two warnings of the same kind from one listener.
const WARN_EVERY: Duration = Duration::from_secs(1);

/// A listener's accepted connections, bounded in number, with back-off on accept errors.
#[derive(Debug)]
pub struct CappedListener {
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

impl CappedListener {
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
    pub async fn accept(&mut self) -> Accepted {
        std::future::poll_fn(|cx| self.poll_conn(cx)).await
    }

    fn poll_conn(&mut self, cx: &mut Context<'_>) -> Poll<Accepted> {
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

    fn admit(&self, stream: TcpStream, peer: SocketAddr) -> Accepted {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY");
        }
        self.open.fetch_add(1, Ordering::Relaxed);
        Accepted {
            io: stream,
            peer,
            place: CapPlace(Arc::clone(&self.open)),
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

/// A connection's place under the cap, freed when it drops: the task serving the connection
/// holds it for as long as the connection is open.
#[derive(Debug)]
pub struct CapPlace(Arc<AtomicUsize>);

impl Drop for CapPlace {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An accepted connection: the TCP stream, the peer, and its place under the cap.
#[derive(Debug)]
pub struct Accepted {
    /// The connection.
    pub io: TcpStream,
    /// The peer's address.
    pub peer: SocketAddr,
    /// Held until the connection closes.
    pub place: CapPlace,
}

#[cfg(test)]
mod tests {
    use super::*;

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
