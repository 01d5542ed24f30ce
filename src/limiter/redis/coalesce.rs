//! Coalescing: concurrent requests bound for one Redis node leave in one script call.
//!
//! Requests queue while calls are in flight and go together in the next one: at most
//! [`IN_FLIGHT`] calls are out at once, each with every request that was waiting (up to
//! [`MAX_REQUESTS`] requests or [`MAX_KEYS`] counters). Nothing waits on a timer: an idle
//! connection sends a lone request at once, and under load a call carries many. `gcra_lean.lua`
//! decides a call's requests one after the other, each all or nothing on its own, exactly as
//! separate calls in that order would.

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::Value;
use tokio::sync::{mpsc, oneshot};

use super::{BackendError, Conn, Outcome, RedisStore, classify, parse_lean};
use crate::limiter::Op;

/// Calls in flight at once on the connection; the next requests queue behind them.
pub(super) const IN_FLIGHT: usize = 2;
/// Most requests in one call.
pub(super) const MAX_REQUESTS: usize = 128;
/// Most counters in one call (the script unpacks them onto Lua's stack for one `MGET`).
pub(super) const MAX_KEYS: usize = 1_024;

/// One request's answer: blocked, and one outcome per op.
pub(super) type Answer = Result<(bool, Vec<Outcome>), BackendError>;

/// A request waiting for a call.
pub(super) struct Pending {
    pub(super) ops: Vec<Op>,
    /// The decision time, when the store decides at its own clock (tests); requests with
    /// different times never share a call.
    pub(super) now: Option<u64>,
    pub(super) reply: oneshot::Sender<Answer>,
}

impl RedisStore {
    /// Sends the queued requests, [`IN_FLIGHT`] calls at most at a time, until the queue closes
    /// (the store is dropped) or this future is dropped.
    pub(super) async fn coalesce(&self, mut queue: mpsc::UnboundedReceiver<Pending>) {
        let mut in_flight = FuturesUnordered::new();
        let mut carry: Option<Pending> = None;
        loop {
            tokio::select! {
                next = recv(&mut carry, &mut queue), if in_flight.len() < IN_FLIGHT => {
                    let Some(first) = next else { return };
                    let mut keys = first.ops.len();
                    let mut batch = vec![first];
                    while batch.len() < MAX_REQUESTS && keys < MAX_KEYS {
                        let Ok(p) = queue.try_recv() else { break };
                        if p.now != batch[0].now || keys + p.ops.len() > MAX_KEYS {
                            carry = Some(p);
                            break;
                        }
                        keys += p.ops.len();
                        batch.push(p);
                    }
                    in_flight.push(self.send(batch));
                }
                Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
            }
        }
    }

    /// One call for `batch`; every request gets its own answer, or the call's error.
    async fn send(&self, batch: Vec<Pending>) {
        let answers = self.call(&batch).await;
        match answers {
            Ok(answers) => {
                for (p, a) in batch.into_iter().zip(answers) {
                    let _ = p.reply.send(Ok(a));
                }
            }
            Err(e) => {
                for p in batch {
                    let _ = p.reply.send(Err(e.clone()));
                }
            }
        }
    }

    async fn call(&self, batch: &[Pending]) -> Result<Vec<(bool, Vec<Outcome>)>, BackendError> {
        let Some(conn) = self.conn.load_full() else {
            return Err(BackendError::NotConnected);
        };
        let Conn::Single(c) = &*conn else {
            return Err(BackendError::Reply(
                "coalescing runs on a single node only".into(),
            ));
        };
        let mut call = self.lean.prepare_invoke();
        call.arg(batch[0].now.map(|n| n.to_string()).unwrap_or_default())
            .arg(batch.len());
        let mut sizes = Vec::with_capacity(batch.len());
        for p in batch {
            let all: Vec<usize> = (0..p.ops.len()).collect();
            self.push_request(&mut call, &p.ops, &all, true, true);
            sizes.push(p.ops.len());
        }
        self.stats.round_trip();
        let reply: Vec<Value> = call
            .invoke_async(&mut c.clone())
            .await
            .map_err(|e| classify(e, self.config.timeout))?;
        parse_lean(&reply, &sizes)
    }
}

/// The carried-over request if any, else the next one from the queue.
async fn recv(
    carry: &mut Option<Pending>,
    queue: &mut mpsc::UnboundedReceiver<Pending>,
) -> Option<Pending> {
    match carry.take() {
        Some(p) => Some(p),
        None => queue.recv().await,
    }
}
