//! The stall gate of the store's connection: once a charging call on it times out, it sends no
//! charging call until Redis answers a probe. A call given up on at its deadline stays in
//! Redis's socket and is carried out, and charged, when Redis reads again; so does every call
//! sent behind it. A stalled gate answers each call with the timeout at once, unsent
//! (`on_backend_error` answers it), and sends a `PING` (which charges nothing), one at a time:
//! at once when a call times out, then as calls come, never in a loop of its own. Redis answers
//! a connection's commands in order, so a `PING` answered means every call sent before it was
//! carried out, and the gate opens. Only a probe opens it: an answer to a call sent before the
//! stall says nothing of the calls sent beside it.
//!
//! One gate per store, for its one connection: the coalesced calls and the direct ones share a
//! single node's connection (a Sentinel master is one too). Redis Cluster has none: a gate for
//! the whole store would answer every hash slot with `on_backend_error` while one node is away,
//! and a gate per node needs the slot map. The gate does not send the calls, nor know what they are: the
//! store passes its charging calls through it (requests, lease calls, share renewals), and says
//! how to probe. Refunds and heartbeats charge nothing and do not pass it.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::limiter::error::BackendError;

/// Whether the connection is stalled, and whether a probe is out. Cheap to clone: the clones
/// share one state, so that a probe running on its own can open the gate.
#[derive(Clone, Debug, Default)]
pub(super) struct StallGate(Arc<State>);

#[derive(Debug, Default)]
struct State {
    stalled: AtomicBool,
    probing: AtomicBool,
}

impl StallGate {
    /// Whether a call timed out and no probe has been answered since.
    pub(super) fn stalled(&self) -> bool {
        // Relaxed: the flag orders nothing else; a call that races a change is one of those in
        // flight when it changed.
        self.0.stalled.load(Ordering::Relaxed)
    }

    /// A call timed out: stalls the gate and probes at once (so that a Redis that was only
    /// slow is trusted again within a round trip), unless a probe is out.
    pub(super) fn timed_out<P>(&self, ping: impl FnOnce() -> P)
    where
        P: Future<Output = bool> + Send + 'static,
    {
        // Relaxed: as in `stalled`.
        self.0.stalled.store(true, Ordering::Relaxed);
        self.probe(ping);
    }

    /// Redis answered a probe: the gate opens.
    pub(super) fn answered(&self) {
        // Relaxed: as in `stalled`.
        self.0.stalled.store(false, Ordering::Relaxed);
    }

    /// Whether a charging call may be sent now. When not, the probe is started unless one is
    /// out, and the call is to be answered with the timeout.
    pub(super) fn open<P>(&self, ping: impl FnOnce() -> P) -> bool
    where
        P: Future<Output = bool> + Send + 'static,
    {
        if !self.stalled() {
            return true;
        }
        self.probe(ping);
        false
    }

    /// Runs `ping` on its own unless a probe is out; its `true` (Redis answered in time) opens
    /// the gate. Outside a Tokio runtime (at shutdown) nothing is probed.
    fn probe<P>(&self, ping: impl FnOnce() -> P)
    where
        P: Future<Output = bool> + Send + 'static,
    {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // Relaxed: the flag only elects one prober; it guards no other data.
        if self.0.probing.swap(true, Ordering::Relaxed) {
            return;
        }
        let gate = self.clone();
        let ping = ping();
        runtime.spawn(async move {
            let answered = ping.await;
            if answered {
                gate.answered();
            }
            // Relaxed: as above.
            gate.0.probing.store(false, Ordering::Relaxed);
        });
    }

    /// Sends one charging call, `trip`, through the gate, with the caller's `deadline`:
    /// answered at once with the timeout while stalled; when `trip` times out, or is dropped
    /// unanswered once its deadline has passed (its caller gave up at the same deadline), the
    /// gate stalls.
    pub(super) async fn pass<T, P>(
        &self,
        (deadline, timeout): (Instant, Duration),
        ping: impl Fn() -> P + Send,
        trip: impl Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError>
    where
        P: Future<Output = bool> + Send + 'static,
    {
        if !self.open(&ping) {
            return Err(BackendError::Timeout(timeout));
        }
        let mut watch = Watch {
            gate: self,
            deadline,
            ping: Some(Box::new(move || Box::pin(ping()) as Probe)),
        };
        let result = tokio::time::timeout_at(deadline, trip)
            .await
            .unwrap_or(Err(BackendError::Timeout(timeout)));
        let ping = watch.ping.take();
        if let (Err(BackendError::Timeout(_)), Some(ping)) = (&result, ping) {
            self.timed_out(ping);
        }
        result
    }
}

/// A probe started by a call through the gate.
type Probe = std::pin::Pin<Box<dyn Future<Output = bool> + Send>>;

/// A call through the gate, until its answer is read.
struct Watch<'a> {
    gate: &'a StallGate,
    deadline: Instant,
    /// Taken when the answer is read.
    ping: Option<Box<dyn FnOnce() -> Probe + Send + 'a>>,
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        // Dropped before its deadline, the caller left: that says nothing of Redis.
        if let Some(ping) = self.ping.take()
            && Instant::now() >= self.deadline
        {
            self.gate.timed_out(ping);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio::sync::Notify;

    /// A gate, and a probe of it that counts itself in `sent` and answers `answer` once `go` is
    /// notified.
    fn gate_and_probe(
        answer: bool,
    ) -> (StallGate, Arc<AtomicUsize>, Arc<Notify>, impl Fn() -> Probe) {
        let (sent, go) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
        let (counted, told) = (Arc::clone(&sent), Arc::clone(&go));
        let ping = move || {
            counted.fetch_add(1, Ordering::Relaxed);
            let told = Arc::clone(&told);
            Box::pin(async move {
                told.notified().await;
                answer
            }) as Probe
        };
        (StallGate::default(), sent, go, ping)
    }

    const T: Duration = Duration::from_millis(20);

    /// Lets the spawned probe run (the test runtime has one thread).
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_timeout_stalls_until_one_probe_is_answered() {
        let (gate, sent, go, ping) = gate_and_probe(true);
        assert!(gate.open(&ping), "a new gate is open");
        gate.timed_out(&ping);
        assert!(gate.stalled());
        // Calls while stalled start no second probe while one is out.
        for _ in 0..5 {
            assert!(!gate.open(&ping));
        }
        assert_eq!(sent.load(Ordering::Relaxed), 1);
        go.notify_one();
        settle().await;
        assert!(!gate.stalled());
        assert!(gate.open(&ping));
        assert_eq!(sent.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn an_unanswered_probe_leaves_it_stalled_and_the_next_call_probes_again() {
        let (gate, sent, go, ping) = gate_and_probe(false);
        gate.timed_out(&ping);
        go.notify_one();
        settle().await;
        assert!(gate.stalled());
        assert!(!gate.open(&ping));
        assert_eq!(sent.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn a_call_is_refused_unsent_while_stalled_and_its_timeout_stalls() {
        let (gate, _, _, ping) = gate_and_probe(false);
        let now = Instant::now();
        // Answered: the gate stays open.
        let ok = gate.pass((now + T, T), &ping, async { Ok(1) }).await;
        assert_eq!(ok.unwrap(), 1);
        assert!(!gate.stalled());
        // Another failure says nothing of Redis.
        let failed = gate
            .pass((now + T, T), &ping, async {
                Err::<(), _>(BackendError::Reply("no".into()))
            })
            .await;
        assert!(matches!(failed, Err(BackendError::Reply(_))));
        assert!(!gate.stalled());
        // Unanswered by its deadline: timed out, and the gate stalls.
        let never = std::future::pending::<Result<(), BackendError>>();
        let late = gate.pass((Instant::now() + T, T), &ping, never).await;
        assert!(matches!(late, Err(BackendError::Timeout(_))));
        assert!(gate.stalled());
        let unsent = Arc::new(AtomicBool::new(true));
        let flag = Arc::clone(&unsent);
        let refused = gate
            .pass((Instant::now() + T, T), &ping, async move {
                flag.store(false, Ordering::Relaxed);
                Ok(())
            })
            .await;
        assert!(matches!(refused, Err(BackendError::Timeout(_))));
        assert!(unsent.load(Ordering::Relaxed), "a stalled gate sent a call");
    }

    #[tokio::test]
    async fn a_call_dropped_at_its_deadline_stalls_one_dropped_before_does_not() {
        let (gate, _, _, ping) = gate_and_probe(false);
        let never = || std::future::pending::<Result<(), BackendError>>();
        // The caller leaves halfway to the deadline.
        let deadline = Instant::now() + T;
        let early = tokio::time::timeout(T / 2, gate.pass((deadline, T), &ping, never())).await;
        assert!(early.is_err());
        assert!(!gate.stalled());
        // The caller's own timer, at the same deadline, wins the race.
        let deadline = Instant::now() + T;
        let at = tokio::time::timeout_at(deadline, gate.pass((deadline, T), &ping, never())).await;
        assert!(at.is_err() || matches!(at, Ok(Err(BackendError::Timeout(_)))));
        assert!(gate.stalled());
    }
}
