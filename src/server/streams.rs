//! The calls of one gRPC connection, run in the connection's own task instead of a task each:
//! [`Streams`] is the executor hyper hands each accepted stream to, and [`Served`] the
//! connection's future, polling the connection and its calls together so that the answers to
//! one read leave in one write. What this gives up: one connection's calls share one worker
//! thread. h2 already serialises a connection on its one connection task and the streams' lock,
//! and Envoy opens a connection per worker thread, so the cores are used by the connections,
//! not by the calls. A call the service marked as one that may end itself ([`StreamReset`]) is
//! dropped when it does, so that hyper resets its stream even while the peer reads nothing.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use tokio_util::sync::CancellationToken;

/// One call: hyper's future for an accepted stream, from its request to its last frame.
type Call = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A call polled so that a panic ends it alone, as a task of its own would: the call is then
/// dropped (hyper resets its stream), and the connection and its other calls go on.
struct Isolated(Call);

impl Future for Isolated {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let call = &mut self.0;
        // Unwind-safe enough: a call that panicked is never polled again, only dropped.
        std::panic::catch_unwind(AssertUnwindSafe(|| call.as_mut().poll(cx))).unwrap_or_else(|_| {
            tracing::error!("a gRPC call panicked; its stream is reset, the connection goes on");
            Poll::Ready(())
        })
    }
}

/// Rounds of "connection, then calls" in one poll before yielding to the runtime's other tasks,
/// so that a connection whose peer keeps sending cannot hold a worker thread.
const ROUNDS_PER_POLL: usize = 16;

/// The executor of one connection's calls: hyper queues each call here, and [`Served`] runs
/// it. One per connection, shared by the connection's hyper builder and its [`Served`].
///
/// With tokio's executor each call would be a task of its own: spawned, scheduled, and woken
/// back into the connection's task once its answer is queued, so the answers to one read would
/// leave in several writes.
#[derive(Clone, Default)]
pub(crate) struct Streams {
    /// Calls accepted since [`Served`] last took them. The lock is only ever taken inside the
    /// connection's own poll, so it is never contended.
    accepted: Arc<Mutex<Vec<Call>>>,
    /// The reset of the call the service is being handed, for [`Streams::execute`] to take with
    /// it. Taken, as `accepted`, only inside the connection's own poll.
    resettable: Arc<Mutex<Option<CancellationToken>>>,
}

/// A handle that ends one call: its future is dropped, and hyper resets its HTTP/2 stream
/// (`RST_STREAM` with `CANCEL`), which reaches the peer whether or not it reads the stream's
/// data, where trailers would wait behind that data for the peer's flow-control window.
#[derive(Clone, Debug)]
pub(crate) struct StreamReset(CancellationToken);

impl StreamReset {
    /// Ends the call.
    pub(crate) fn reset(&self) {
        self.0.cancel();
    }
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streams").finish_non_exhaustive()
    }
}

impl Streams {
    /// A reset for the call the service is being handed now: hyper makes a call by calling the
    /// service and hands it to this executor in the same step of the connection's poll, so the
    /// next [`Streams::execute`] takes the reset with that call.
    pub(crate) fn resettable(&self) -> StreamReset {
        let token = CancellationToken::new();
        *self
            .resettable
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(token.clone());
        StreamReset(token)
    }

    /// Moves the calls accepted since the last time into `running`, in the order hyper accepted
    /// them; the queue keeps its capacity for the next read's calls.
    fn start(&self, running: &mut FuturesUnordered<Isolated>) {
        let mut accepted = self.accepted.lock().unwrap_or_else(PoisonError::into_inner);
        for call in accepted.drain(..) {
            running.push(Isolated(call));
        }
    }
}

impl<F> hyper::rt::Executor<F> for Streams
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, call: F) {
        let reset = self
            .resettable
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let call: Call = match reset {
            None => Box::pin(call),
            Some(token) => Box::pin(async move {
                tokio::select! {
                    () = token.cancelled() => {}
                    () = call => {}
                }
            }),
        };
        self.accepted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(call);
    }
}

/// A connection's future `C` (hyper's, built with `streams` as its executor) together with its
/// calls: ready when the connection is.
///
/// Each poll polls hyper's connection, then every call the connection accepted, and the
/// connection again while calls finish, so the answers to one read leave together, in one write,
/// and no task is spawned per call. A call waiting on Redis is polled again only when woken.
/// When the connection ends, the calls still running are dropped, as hyper drops a call whose
/// stream the client reset: there is no stream left to answer on.
pub(crate) struct Served<C> {
    conn: Pin<Box<C>>,
    streams: Streams,
    running: FuturesUnordered<Isolated>,
}

impl<C> Served<C> {
    /// `conn`, whose builder was given `streams` as its executor.
    pub(crate) fn new(conn: C, streams: Streams) -> Self {
        Self {
            conn: Box::pin(conn),
            streams,
            running: FuturesUnordered::new(),
        }
    }

    /// The connection, to start its graceful shutdown; its calls keep running.
    pub(crate) fn conn(&mut self) -> Pin<&mut C> {
        self.conn.as_mut()
    }

    /// Calls running or accepted and not yet started.
    #[cfg(test)]
    fn calls(&self) -> usize {
        self.running.len() + self.streams.accepted.lock().map_or(0, |a| a.len())
    }
}

impl<C: Future> Future for Served<C> {
    type Output = C::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let this = &mut *self;
        for _ in 0..ROUNDS_PER_POLL {
            // Reads what arrived (accepting calls into `streams`) and writes what the calls
            // answered since the last round, in one flush.
            if let Poll::Ready(done) = this.conn.as_mut().poll(cx) {
                return Poll::Ready(done);
            }
            this.streams.start(&mut this.running);
            let mut finished = false;
            while let Poll::Ready(Some(())) = this.running.poll_next_unpin(cx) {
                finished = true;
            }
            if !finished {
                // Every call left is waiting on something that will wake this task; so is the
                // connection.
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Executor;
    use std::future::poll_fn;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn calls_run_in_the_connections_task_and_end_with_it() {
        let streams = Streams::default();
        let done = Arc::new(AtomicUsize::new(0));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        // A "connection" that accepts two calls on its first poll, one that finishes at once
        // and one that never does, then ends when told to.
        let conn = {
            let (streams, done) = (streams.clone(), Arc::clone(&done));
            async move {
                let quick = Arc::clone(&done);
                streams.execute(async move {
                    quick.fetch_add(1, Ordering::Relaxed);
                });
                streams.execute(std::future::pending::<()>());
                let _ = stop_rx.await;
                "ended"
            }
        };
        let mut served = Served::new(conn, streams);
        poll_fn(|cx| {
            assert!(Pin::new(&mut served).poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        assert_eq!(
            done.load(Ordering::Relaxed),
            1,
            "the quick call ran in the same poll"
        );
        assert_eq!(served.calls(), 1, "the pending call is still held");
        stop_tx.send(()).unwrap();
        assert_eq!(served.await, "ended");
    }

    #[tokio::test]
    async fn a_connection_that_keeps_accepting_yields_to_the_runtime() {
        let streams = Streams::default();
        // Accepts a call that finishes at once on every poll, forever.
        let conn = {
            let streams = streams.clone();
            poll_fn(move |_| {
                streams.execute(async {});
                Poll::<()>::Pending
            })
        };
        let mut served = Served::new(conn, streams);
        let woken = Arc::new(AtomicUsize::new(0));
        let waker = counting_waker(Arc::clone(&woken));
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut served).poll(&mut cx).is_pending());
        assert_eq!(served.calls(), 0, "every accepted call ran");
        assert_eq!(
            woken.load(Ordering::Relaxed),
            1,
            "after its rounds the connection asks to be polled again instead of looping on"
        );
    }

    #[tokio::test]
    async fn a_call_that_panics_ends_alone() {
        let streams = Streams::default();
        let done = Arc::new(AtomicUsize::new(0));
        let conn = {
            let (streams, done) = (streams.clone(), Arc::clone(&done));
            async move {
                streams.execute(async { panic!("a bug in one call") });
                let after = Arc::clone(&done);
                streams.execute(async move {
                    after.fetch_add(1, Ordering::Relaxed);
                });
                std::future::pending::<()>().await;
            }
        };
        let mut served = Served::new(conn, streams);
        poll_fn(|cx| {
            assert!(Pin::new(&mut served).poll(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        assert_eq!(done.load(Ordering::Relaxed), 1, "the other call ran");
        assert_eq!(served.calls(), 0, "the call that panicked is gone");
    }

    fn counting_waker(woken: Arc<AtomicUsize>) -> std::task::Waker {
        struct Count(Arc<AtomicUsize>);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
            fn wake_by_ref(self: &Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        std::task::Waker::from(Arc::new(Count(woken)))
    }
}
