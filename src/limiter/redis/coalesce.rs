//! Coalescing: concurrent requests bound for one Redis node leave in one script call, the lease
//! calls waiting beside them in the same pipeline. At most [`IN_FLIGHT`] calls are out at once,
//! each with every call that was waiting (up to [`MAX_REQUESTS`] requests or [`MAX_KEYS`]
//! counters); nothing waits on a timer. `gcra_lean.lua` decides a call's requests one after the
//! other, each all or nothing on its own, exactly as separate calls in that order would; each
//! lease call is atomic on its own as when sent alone. The calls themselves come from `call`.
//!
//! The queue is bounded ([`QUEUE`]): past it a call fails at once, and `on_backend_error`
//! answers it. A call whose caller stopped waiting (timed out, and so answered by
//! `on_backend_error`) is dropped before it is sent; one already sent when its caller left has
//! what it charged given back as soon as its answer arrives, so a request answered otherwise is
//! not charged in Redis as well. A call the connection gave up on at its own deadline gets no
//! answer to give back: at most the [`IN_FLIGHT`] calls out when Redis stopped answering. So a
//! call that times out stalls the store's gate (`stall`, shared with the calls that are not
//! coalesced): until Redis answers its `PING`, every call is answered with the timeout at once,
//! unsent. Otherwise each call sent behind the unanswered ones would wait in Redis's socket, be
//! given up on in turn, and be carried out and charged when Redis reads again, however long the
//! pause and whatever `on_backend_error` answered meanwhile. The give-back of a late answer is
//! sent all the same: it charges nothing.

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use redis::Value;
use redis::aio::ConnectionManager;
use tokio::sync::mpsc;

use crate::limiter::batch::{Batch, Charge, Op};
use crate::limiter::error::BackendError;
use crate::limiter::figures::Purpose;
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::call::{
    Call, CountCall, LeaseCall, classify, lean_batch, no_script, parse_lean,
};
use crate::limiter::redis::connect::RedisConn;

/// Calls in flight at once on the connection; the next requests queue behind them. Enough to
/// keep Redis busy while sluice reads one call's answers and gathers the next, few enough that
/// calls stay large (BENCHMARKS.md has the measurements behind the number).
pub(super) const IN_FLIGHT: usize = 4;
/// Most requests in one call.
pub(super) const MAX_REQUESTS: usize = 128;
/// Most counters in one call (the script unpacks them onto Lua's stack for one `MGET`).
pub(super) const MAX_KEYS: usize = 1_024;
/// Most `lease.lua` calls in one round trip.
pub(super) const MAX_LEASE_CALLS: usize = 64;
/// Most calls waiting for a round trip: eight full calls behind the ones in flight.
pub(super) const QUEUE: usize = 8 * MAX_REQUESTS;

impl RedisStore {
    /// Sends the queued requests, [`IN_FLIGHT`] calls at most at a time, until the queue closes
    /// (the store is dropped) or this future is dropped.
    pub(super) async fn coalesce(&self, mut queue: mpsc::Receiver<Call>) {
        let mut in_flight = FuturesUnordered::new();
        let mut carry: Option<Call> = None;
        loop {
            tokio::select! {
                next = recv(&mut carry, &mut queue), if in_flight.len() < IN_FLIGHT => {
                    let Some(mut job) = next else { return };
                    // A call timed out and no probe has been answered since (module `stall`).
                    if !self.stall.open(|| self.ping()) {
                        let timeout = BackendError::Timeout(self.config.timeout);
                        job.fail(timeout.clone());
                        while let Ok(next) = queue.try_recv() {
                            next.fail(timeout.clone());
                        }
                        continue;
                    }
                    let (mut batch, mut leases, mut keys) = (Vec::new(), Vec::new(), 0);
                    loop {
                        match job {
                            // Its caller stopped waiting: nobody is answered by it.
                            _ if job.abandoned() => {}
                            Call::Count(p) => {
                                if batch.first().is_some_and(|f: &CountCall| {
                                    p.now != f.now || keys + p.ops.len() > MAX_KEYS
                                }) {
                                    carry = Some(Call::Count(p));
                                    break;
                                }
                                keys += p.ops.len();
                                batch.push(p);
                            }
                            Call::Lease(l) => leases.push(l),
                        }
                        if batch.len() >= MAX_REQUESTS
                            || keys >= MAX_KEYS
                            || leases.len() >= MAX_LEASE_CALLS
                        {
                            break;
                        }
                        let Ok(next) = queue.try_recv() else { break };
                        job = next;
                    }
                    if batch.is_empty() && leases.is_empty() {
                        continue;
                    }
                    in_flight.push(Box::pin(self.send(batch, leases)) as Trip<'_>);
                }
                Some(timed_out) = in_flight.next(), if !in_flight.is_empty() => {
                    if timed_out {
                        self.stall.timed_out(|| self.ping());
                    }
                }
            }
        }
    }

    /// One round trip for `batch` and `leases`; every request and lease call gets its own
    /// answer, or the round trip's error. Whether it timed out.
    async fn send(&self, batch: Vec<CountCall>, leases: Vec<LeaseCall>) -> bool {
        let (answers, leased) = if leases.is_empty() {
            (self.call(&batch).await, Vec::new())
        } else {
            match self.call_with_leases(&batch, &leases).await {
                Ok((answers, leased)) => (answers, leased),
                Err(e) => (Err(e.clone()), vec![Err(e); leases.len()]),
            }
        };
        let timed_out = matches!(answers, Err(BackendError::Timeout(_)));
        match answers {
            Ok(answers) => {
                // Every request of a call was decided at one time.
                let now = batch.first().and_then(|p| p.now);
                let mut late = Vec::new();
                for (p, a) in batch.into_iter().zip(answers) {
                    if let Err(Ok(a)) = p.reply.send(Ok(a)) {
                        late.extend(charged(&p.ops, &a));
                    }
                }
                if !late.is_empty() {
                    self.give_back(late, now).await;
                }
            }
            Err(e) => {
                for p in batch {
                    let _ = p.reply.send(Err(e.clone()));
                }
            }
        }
        for (l, a) in leases.into_iter().zip(leased) {
            let _ = l.reply.send(a);
        }
        timed_out
    }

    /// Gives back, in one call, the charges of requests whose callers stopped waiting before
    /// their answer came. Best effort: a failure leaves the charge, which can only refuse more.
    async fn give_back(&self, refunds: Vec<Op>, now: Option<u64>) {
        let (reply, _) = tokio::sync::oneshot::channel();
        let call = CountCall {
            ops: refunds,
            now,
            reply,
        };
        if let Err(e) = self.call(std::slice::from_ref(&call)).await {
            tracing::debug!(error = %e.detail(), "redis: charges of abandoned calls not given back");
        }
    }

    /// One pipeline: the lean script over `batch` (when it has requests), then each lease
    /// call. A command Redis refuses with `NOSCRIPT` did not run, so it is sent again alone,
    /// its script loaded; nothing that ran is sent twice.
    async fn call_with_leases(
        &self,
        batch: &[CountCall],
        leases: &[LeaseCall],
    ) -> Result<(Answers, LeaseAnswers), BackendError> {
        let mut c = self.single()?;
        let timeout = self.config.timeout;
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        let mut sizes = Vec::with_capacity(batch.len());
        if !batch.is_empty() {
            let call = lean_batch(&self.lean, &self.config.key_prefix, batch, &mut sizes);
            pipe.invoke_script(&call);
        }
        for l in leases {
            pipe.add_command(l.cmd.clone());
        }
        let purpose = match leases.first() {
            Some(l) if batch.is_empty() => l.purpose,
            _ => Purpose::Count,
        };
        let trip = self.stats.round_trip(purpose);
        let replies = pipe
            .query_async::<Vec<redis::RedisResult<Value>>>(&mut c)
            .await;
        drop(trip);
        let mut replies = replies.map_err(|e| classify(e, timeout))?.into_iter();
        let answers = if batch.is_empty() {
            Ok(Vec::new())
        } else {
            match replies.next() {
                Some(Ok(Value::BulkString(reply))) => self.read_lean(&reply, &sizes),
                Some(Err(e)) if no_script(&e) => self.call(batch).await,
                Some(Err(e)) => Err(classify(e, timeout)),
                other => Err(BackendError::Reply(format!("{other:?}"))),
            }
        };
        let mut leased = Vec::with_capacity(leases.len());
        for l in leases {
            leased.push(match replies.next() {
                Some(Ok(v)) => Ok(v),
                Some(Err(e)) if no_script(&e) => self.lease_alone(&c, l).await,
                Some(Err(e)) => Err(classify(e, timeout)),
                None => Err(BackendError::Reply("a pipeline reply is missing".into())),
            });
        }
        Ok((answers, leased))
    }

    /// A lease call sent alone after `NOSCRIPT`: its script loaded, then the call again.
    async fn lease_alone(
        &self,
        c: &ConnectionManager,
        l: &LeaseCall,
    ) -> Result<Value, BackendError> {
        let timeout = self.config.timeout;
        let mut c = c.clone();
        l.script
            .load_async(&mut c)
            .await
            .map_err(|e| classify(e, timeout))?;
        let _trip = self.stats.round_trip(l.purpose);
        l.cmd
            .query_async(&mut c)
            .await
            .map_err(|e| classify(e, timeout))
    }

    async fn call(&self, batch: &[CountCall]) -> Answers {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let mut c = self.single()?;
        let mut sizes = Vec::with_capacity(batch.len());
        let call = lean_batch(&self.lean, &self.config.key_prefix, batch, &mut sizes);
        let trip = self.stats.round_trip(Purpose::Count);
        let reply = call.invoke_async::<Vec<u8>>(&mut c).await;
        drop(trip);
        let reply = reply.map_err(|e| classify(e, self.config.timeout))?;
        self.read_lean(&reply, &sizes)
    }

    /// The answers in the lean script's reply to a batch of `sizes`, its repairs counted.
    fn read_lean(&self, reply: &[u8], sizes: &[usize]) -> Answers {
        let (answers, repairs) = parse_lean(reply, sizes)?;
        self.stats.repaired(repairs);
        Ok(answers)
    }
}

/// The refunds of what an answered request charged: its asking ops that were admitted, when
/// the request was. Spend already made stays recorded (its caller's answer recorded it too,
/// which can only refuse more).
fn charged(ops: &[Op], answer: &Batch) -> Vec<Op> {
    if answer.blocked {
        return Vec::new();
    }
    ops.iter()
        .zip(&answer.outcomes)
        .filter(|(op, o)| op.charge == Charge::Ask && o.admitted && op.cost > 0)
        .map(|(op, _)| Op {
            charge: Charge::Refund,
            ..*op
        })
        .collect()
}

/// A round trip in flight: whether it timed out.
type Trip<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + 'a>>;

/// The lean script's answers to a batch, one per request.
type Answers = Result<Vec<Batch>, BackendError>;
/// The replies to the lease calls of a round trip, one per call.
type LeaseAnswers = Vec<Result<Value, BackendError>>;

impl RedisStore {
    /// The connection to the single node the coalesced calls go to.
    fn single(&self) -> Result<ConnectionManager, BackendError> {
        match self.conn.load_full().as_deref() {
            None => Err(BackendError::NotConnected),
            Some(RedisConn::Single(c)) => Ok(c.clone()),
            Some(RedisConn::Cluster(_)) => Err(BackendError::Reply(
                "coalescing runs on a single node only".into(),
            )),
        }
    }
}

/// The carried-over job if any, else the next one from the queue.
async fn recv(carry: &mut Option<Call>, queue: &mut mpsc::Receiver<Call>) -> Option<Call> {
    match carry.take() {
        Some(p) => Some(p),
        None => queue.recv().await,
    }
}
