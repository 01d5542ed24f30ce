//! The Redis backend: the same GCRA as the memory store, run inside Redis by Lua scripts, so
//! several sluice nodes share one budget. [`RedisStore`] owns the connection, the deadline, the
//! circuit breaker and the over-limit cache, and sends what `call` assembles; `coalesce` batches
//! a single node's requests, `lease` answers hot counters locally, `share` renews a node's share
//! of a contended counter, `fleet` its parts of RLQS rules, `stall` holds back every charging call
//! on a single node, coalesced or not, while the connection is stalled (a call timed out and
//! Redis has not answered a `PING` since), `connect` and `sentinel` open and follow connections,
//! `config` holds the settings.
//!
//! It is async I/O by nature, yet knows nothing of policies, protobuf or the server.

mod breaker;
mod cache;
mod call;
mod coalesce;
pub mod config;
pub mod connect;
pub mod fleet;
pub mod heartbeat;
pub mod lease;
pub mod redact;
mod scripts;
pub mod sentinel;
pub mod share;
mod slot;
mod stall;
mod stats;

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use redis::Script;
use redis::cluster_async::ClusterConnection;

pub use crate::histogram::LatencySnapshot;
use crate::limiter::batch::{Batch, Charge, Op, Source};
use crate::limiter::clock::Clock;
pub use crate::limiter::error::ConnectError;
use crate::limiter::error::{BackendError, ErrorKind};
use crate::limiter::figures::{Purpose, RedisFigures};
use crate::limiter::gcra::CounterOutcome;
use crate::limiter::key::Key;
use crate::limiter::redis::breaker::Breaker;
use crate::limiter::redis::cache::DenyCache;
pub use crate::limiter::redis::call::fits_lean;
use crate::limiter::redis::call::{Call, CountCall, classify, count_call, read_count, redis_key};
pub use crate::limiter::redis::config::{
    Password, RedisAuth, RedisConfig, RedisTime, RedisTls, SentinelConfig,
};
pub use crate::limiter::redis::connect::validate;
use crate::limiter::redis::connect::{Connector, RedisConn};
pub use crate::limiter::redis::heartbeat::Heartbeat;
pub use crate::limiter::redis::lease::{LeaseConfig, LeasedStore};
pub use crate::limiter::redis::redact::{redact, redact_all};
pub use crate::limiter::redis::sentinel::SentinelError;
pub use crate::limiter::redis::share::{ShareRenewal, ShareReply};
use crate::limiter::redis::slot::group_by_slot;
use crate::limiter::redis::stall::StallGate;
use crate::limiter::redis::stats::RedisStats;

/// The Redis counter store.
///
/// - One round trip: all of a request's counters go in one `EVALSHA` (loaded once, reloaded on
///   `NOSCRIPT`), with Redis `TIME` as the single clock. Each key expires at its TAT (to the
///   millisecond), so Redis holds only live state. Concurrent requests share one multiplexed
///   connection (pipelined).
/// - Two scripts, one answer: `gcra_lean.lua` keeps every quantity relative to now in plain
///   numbers, exact while a bucket's debt cap plus `T` is under 2^52 ns (about 52 days), and
///   reads its arguments and writes its reply as binary doubles ([`fits_lean`]); a request with
///   a longer cap goes to `gcra.lua`, exact over the whole range in pairs of seconds and
///   nanoseconds. Both store the same decimal TAT, so a fleet of old and new nodes agrees.
/// - Redis Cluster: keys are grouped by hash slot and the groups sent concurrently. Each group is
///   atomic; a request spanning slots is all or nothing by compensation: when one group refuses
///   (or every quota-mode op is over), the charges other groups made are refunded at once (spend
///   recorded and refunds, applied whatever the outcome, stay). A
///   concurrent request may see those charges for that instant (it can be refused, never
///   over-admitted).
/// - Fast failure: every call has a deadline; after consecutive failures a circuit breaker
///   answers at once for a cool-down, then lets one probe through. On a single node, once a
///   charging call times out, none is sent until Redis answers a `PING` (`stall`), so a paused
///   Redis carries out at most the calls in flight when it stopped. The connection manager reconnects in the
///   background.
/// - Redis Sentinel: the master is the one the sentinels name, reached as a single node, and
///   followed through a failover with no restart.
/// - A local cache of counters Redis reported out of tokens until an instant answers repeat
///   offenders without a round trip. It only ever refuses what Redis itself would refuse.
pub struct RedisStore {
    config: RedisConfig,
    conn: ArcSwapOption<RedisConn>,
    connector: Connector,
    /// `gcra.lua`: exact over the whole range of times, in pairs of seconds and nanoseconds.
    script: Script,
    /// `gcra_lean.lua`: the same decisions in plain numbers, for requests that [`fits_lean`].
    lean: Script,
    breaker: Breaker,
    cache: DenyCache,
    stats: RedisStats,
    /// Dates over-limit cache entries and breaker cool-downs; the decision time with
    /// [`RedisTime::Clock`].
    clock: Arc<dyn Clock>,
    time: RedisTime,
    /// Requests for the lean script on a single node, coalesced by [`RedisStore::connect`].
    queue: tokio::sync::mpsc::Sender<Call>,
    /// Shut once a call times out, until Redis answers a probe: every charging call on the
    /// connection passes it (module `stall`).
    stall: StallGate,
    /// Whether the last call sent to Redis got an answer (a deny-cache answer is not one).
    answering: std::sync::atomic::AtomicBool,
    /// The queue's receiving end, until the connection loop takes it.
    queued: std::sync::Mutex<Option<tokio::sync::mpsc::Receiver<Call>>>,
    /// This node's id in the fleet tables of the rules it hands to Envoys (RLQS).
    quota_holder: String,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("config", &self.config)
            .field("time", &self.time)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store for `config`, not yet connected: [`RedisStore::connect`] connects it, and until
    /// then every call fails fast with [`BackendError::NotConnected`] (so sluice starts, and
    /// answers with its backend-error policy, while Redis is down).
    ///
    /// # Errors
    ///
    /// [`BackendError::Setup`] when a URL is malformed, settings contradict each other, or a
    /// certificate, key or password file cannot be read or used.
    pub fn new(
        config: RedisConfig,
        clock: Arc<dyn Clock>,
        time: RedisTime,
    ) -> Result<Arc<Self>, BackendError> {
        let (queue, queued) = tokio::sync::mpsc::channel(coalesce::QUEUE);
        Ok(Arc::new(Self {
            queue,
            queued: std::sync::Mutex::new(Some(queued)),
            stall: StallGate::default(),
            answering: std::sync::atomic::AtomicBool::new(false),
            quota_holder: heartbeat::random_id(),
            conn: ArcSwapOption::empty(),
            connector: Connector::new(&config).map_err(BackendError::Setup)?,
            script: Script::new(scripts::GCRA),
            lean: Script::new(scripts::LEAN),
            breaker: Breaker::new(
                config.breaker_failures,
                config.breaker_cooldown,
                Arc::clone(&clock),
            ),
            cache: DenyCache::new(config.deny_cache_keys),
            stats: RedisStats::default(),
            clock,
            time,
            config,
        }))
    }

    /// Connects, retrying with back-off (100 ms doubling to 5 s) until it succeeds; the
    /// connection then reconnects by itself. On a single node it goes on to send the coalesced
    /// requests for as long as it runs. The caller owns this future and drops it to stop.
    pub async fn connect(&self) {
        let urls = self.config.describe();
        let mut delay = Duration::from_millis(100);
        loop {
            match self.connector.connect().await {
                Ok(conn) => {
                    tracing::info!(redis = %urls, "connected to redis");
                    let single = matches!(conn, RedisConn::Single(_));
                    self.conn.store(Some(Arc::new(conn)));
                    let queued = self
                        .queued
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .take();
                    if let (true, Some(queued)) = (single, queued) {
                        tokio::join!(self.coalesce(queued), self.follow_failovers());
                    }
                    return;
                }
                Err(e) => {
                    tracing::warn!(redis = %urls, error = %e, retry_ms = delay.as_millis(), "cannot connect to redis; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    /// One connection attempt with these settings (files read, handshake, login, `PING`),
    /// the connection then dropped: why Redis cannot be reached, for diagnostics. Serving
    /// connects with [`RedisStore::connect`].
    ///
    /// # Errors
    ///
    /// [`ConnectError`] naming the problem (a refused certificate, `WRONGPASS ...`), never a
    /// secret.
    pub async fn try_connect(&self) -> Result<(), ConnectError> {
        self.connector.connect().await.map(drop)
    }

    /// Whether a connection has been established.
    #[must_use]
    pub fn is_connected(&self) -> bool {
        self.conn.load().is_some()
    }

    /// Whether the last call sent to Redis got an answer from it (false before the first, and
    /// after a failure or a breaker refusal until a call succeeds again).
    #[must_use]
    pub fn answering(&self) -> bool {
        // Relaxed: a hint about the last call; it guards no other data.
        self.answering.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records whether Redis answered, writing only on a change (the flag is read far more
    /// often than it changes, and every request passes here).
    pub(super) fn set_answering(&self, answered: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.answering.load(Relaxed) != answered {
            self.answering.store(answered, Relaxed);
        }
    }

    /// Round trips, errors, cache hits, connection, breaker and latency, read now.
    #[must_use]
    pub fn figures(&self) -> RedisFigures {
        self.stats
            .figures(self.is_connected(), self.breaker.state())
    }

    /// Resets the counters at `keys` (an operator's write): deletes each counter and its share
    /// table (`share::table_key`, in the counter's slot, so one `DEL` per counter also works on
    /// a cluster), and forgets them in this node's over-limit cache. The fleet tables of RLQS
    /// rules are left alone. Other nodes' over-limit caches still refuse until the instants they
    /// hold. Returns how many Redis keys were deleted.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot be reached by the deadline; some counters may then
    /// have been reset.
    pub async fn reset(&self, keys: &[Key]) -> Result<u64, BackendError> {
        for &key in keys {
            self.cache.forget(key);
        }
        let conn = self.conn.load_full().ok_or(BackendError::NotConnected)?;
        let timeout = self.config.timeout;
        let mut deleted = 0;
        for &key in keys {
            let counter = self.key(key);
            let mut del = redis::cmd("DEL");
            del.arg(&counter).arg(share::table_key(&counter));
            let sent = async {
                match &*conn {
                    RedisConn::Single(c) => del.query_async::<u64>(&mut c.clone()).await,
                    RedisConn::Cluster(c) => del.query_async::<u64>(&mut c.clone()).await,
                }
            };
            deleted += tokio::time::timeout(timeout, sent)
                .await
                .map_err(|_| BackendError::Timeout(timeout))?
                .map_err(|e| classify(e, timeout))?;
        }
        Ok(deleted)
    }

    /// The debt `TAT − now` of each counter at `keys`, in nanoseconds, read by `GET` and no
    /// script: 0 for an absent counter or one holding no TAT.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot be reached by the deadline.
    pub async fn debts(&self, keys: &[Key]) -> Result<Vec<u64>, BackendError> {
        let conn = self.conn.load_full().ok_or(BackendError::NotConnected)?;
        let timeout = self.config.timeout;
        let mut debts = Vec::with_capacity(keys.len());
        for &key in keys {
            let sent = async {
                let mut get = redis::pipe();
                get.cmd("TIME").cmd("GET").arg(self.key(key));
                match &*conn {
                    RedisConn::Single(c) => {
                        get.query_async::<(Vec<u64>, Option<String>)>(&mut c.clone())
                            .await
                    }
                    RedisConn::Cluster(c) => {
                        get.query_async::<(Vec<u64>, Option<String>)>(&mut c.clone())
                            .await
                    }
                }
            };
            let (time, tat) = tokio::time::timeout(timeout, sent)
                .await
                .map_err(|_| BackendError::Timeout(timeout))?
                .map_err(|e| classify(e, timeout))?;
            let now = match (self.time, time.as_slice()) {
                (RedisTime::Clock, _) => self.clock.now(),
                (RedisTime::Server, [s, us]) => s
                    .saturating_mul(1_000_000_000)
                    .saturating_add(us.saturating_mul(1_000)),
                (RedisTime::Server, _) => {
                    return Err(BackendError::Reply(format!("TIME answered {time:?}")));
                }
            };
            let tat = tat.and_then(|t| t.parse::<u64>().ok()).unwrap_or(0);
            debts.push(tat.saturating_sub(now));
        }
        Ok(debts)
    }

    /// Decides a request's ops at Redis time (or the store's clock, see [`RedisTime`]), all or
    /// nothing. The store's clock dates entries of the over-limit cache.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot decide; nothing is known to be charged then.
    pub async fn count_batch(&self, ops: &[Op]) -> Result<Batch, BackendError> {
        self.count_batch_from(ops).await.map(|(batch, _)| batch)
    }

    /// As [`RedisStore::count_batch`], with where the answer came from: a round trip, or the
    /// over-limit cache.
    ///
    /// # Errors
    ///
    /// As [`RedisStore::count_batch`].
    pub async fn count_batch_from(&self, ops: &[Op]) -> Result<(Batch, Source), BackendError> {
        // The scripts report an admitted charge's wait; its hold is read from it.
        let (batch, source) = self.decide_from(ops).await?;
        Ok((batch.with_holds(ops), source))
    }

    /// [`RedisStore::count_batch_from`] as the scripts answer it, holds not yet read.
    async fn decide_from(&self, ops: &[Op]) -> Result<(Batch, Source), BackendError> {
        let local_now = self.clock.now();
        if let Some(batch) = self.cache.answer(ops, local_now) {
            self.stats.cache_hit();
            return Ok((batch, Source::RedisCache));
        }
        if !self.breaker.allow() {
            self.set_answering(false);
            self.stats.error(ErrorKind::BreakerOpen);
            return Err(BackendError::BreakerOpen);
        }
        let now = match self.time {
            RedisTime::Server => None,
            RedisTime::Clock => Some(local_now),
        };
        self.stats.request();
        let deadline = tokio::time::Instant::now() + self.config.timeout;
        let result = match tokio::time::timeout_at(deadline, self.run(ops, now, deadline)).await {
            Ok(r) => r,
            Err(_) => Err(BackendError::Timeout(self.config.timeout)),
        };
        self.set_answering(result.is_ok());
        match result {
            Ok(batch) => {
                self.breaker.success();
                self.cache.learn(ops, &batch, local_now);
                Ok((batch, Source::Redis))
            }
            // Not connected yet: the call failed at once, so there is nothing for the breaker
            // to save; the connection loop is already retrying.
            Err(e @ BackendError::NotConnected) => {
                self.stats.error(e.kind());
                Err(e)
            }
            Err(e) => {
                if self.failed(&e, local_now) {
                    self.connector.failed(&e);
                }
                Err(e)
            }
        }
    }

    /// Counts a failed call (at clock nanoseconds `now`) and tells the breaker. An error about
    /// the call's data means Redis answered: the breaker stays closed for every other key. Any
    /// other error counts towards opening it. The log gets what Redis said, at most once a
    /// second, and when the breaker opens. Returns whether Redis itself failed.
    fn failed(&self, e: &BackendError, now: u64) -> bool {
        self.stats.error(e.kind());
        if e.is_data_error() {
            self.breaker.success();
            if self.stats.may_log(now) {
                tracing::warn!(error = %e.detail(), "redis could not decide one call; other calls go on");
            }
            return false;
        }
        if self.breaker.failure() {
            tracing::warn!(error = %e.detail(), cooldown_ms = self.config.breaker_cooldown.as_millis(), "redis circuit breaker opened");
        } else if self.stats.may_log(now) {
            tracing::warn!(error = %e.detail(), "redis call failed");
        }
        true
    }

    /// Queues a call for the coalescing loop; a full queue is a backend error, answered by
    /// `on_backend_error` rather than waited out.
    fn enqueue(&self, call: Call) -> Result<(), BackendError> {
        use tokio::sync::mpsc::error::TrySendError;
        self.queue.try_send(call).map_err(|e| match e {
            TrySendError::Full(_) => BackendError::QueueFull,
            // The sending loop stopped (shutdown).
            TrySendError::Closed(_) => BackendError::NotConnected,
        })
    }

    /// Decides `ops` by the deadline: coalesced on a single node when they [`fits_lean`], else
    /// in calls of their own, through the stall gate on a single node.
    async fn run(
        &self,
        ops: &[Op],
        now: Option<u64>,
        deadline: tokio::time::Instant,
    ) -> Result<Batch, BackendError> {
        let Some(conn) = self.conn.load_full() else {
            return Err(BackendError::NotConnected);
        };
        match &*conn {
            RedisConn::Single(_) if fits_lean(ops) => {
                let (reply, answer) = tokio::sync::oneshot::channel();
                let count = CountCall {
                    ops: ops.to_vec(),
                    now,
                    reply,
                };
                self.enqueue(Call::Count(count))?;
                // A dropped answer: the sending loop stopped (shutdown).
                answer.await.map_err(|_| BackendError::NotConnected)?
            }
            RedisConn::Single(c) => {
                let all: Vec<usize> = (0..ops.len()).collect();
                let mut c = c.clone();
                let call = self.invoke(&mut c, ops, &all, true, now);
                self.gated(deadline, call).await
            }
            RedisConn::Cluster(c) => self.run_cluster(c, ops, now).await,
        }
    }

    /// `call`, a charging call on the connection, sent through the stall gate by `deadline`.
    async fn gated<T>(
        &self,
        deadline: tokio::time::Instant,
        call: impl Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        let timeout = self.config.timeout;
        self.stall
            .pass((deadline, timeout), || self.ping(), call)
            .await
    }

    /// A `PING` on the connection (to every primary of a cluster), to run on its own: whether
    /// Redis answered it within the call deadline. It charges nothing.
    fn ping(&self) -> impl Future<Output = bool> + Send + 'static {
        let conn = self.conn.load_full();
        let timeout = self.config.timeout;
        async move {
            let Some(conn) = conn else { return false };
            let ping = redis::cmd("PING");
            let answer = async {
                match &*conn {
                    RedisConn::Single(c) => ping.query_async::<redis::Value>(&mut c.clone()).await,
                    RedisConn::Cluster(c) => ping.query_async::<redis::Value>(&mut c.clone()).await,
                }
            };
            matches!(tokio::time::timeout(timeout, answer).await, Ok(Ok(_)))
        }
    }

    /// One round trip: the script over `ops[idx]`, alone.
    async fn invoke(
        &self,
        conn: &mut impl redis::aio::ConnectionLike,
        ops: &[Op],
        idx: &[usize],
        whole: bool,
        now: Option<u64>,
    ) -> Result<Batch, BackendError> {
        let prefix = &self.config.key_prefix;
        let (call, lean) = count_call(&self.lean, &self.script, prefix, (ops, idx), whole, now);
        let trip = self.stats.round_trip(Purpose::Count);
        let reply = call.invoke_async(conn).await;
        drop(trip);
        let reply = reply.map_err(|e| classify(e, self.config.timeout))?;
        let (batch, repairs) = read_count(lean, reply, idx.len())?;
        self.stats.repaired(repairs);
        Ok(batch)
    }

    async fn run_cluster(
        &self,
        conn: &ClusterConnection,
        ops: &[Op],
        now: Option<u64>,
    ) -> Result<Batch, BackendError> {
        let groups = group_by_slot(ops.iter().map(|op| self.key(op.key)));
        let whole = groups.len() == 1;
        let calls = groups.iter().map(|(_, idx)| {
            let mut c = conn.clone();
            async move { self.invoke(&mut c, ops, idx, whole, now).await }
        });
        // Not through the stall gate: a gate for the whole cluster would answer every slot with
        // `on_backend_error` while one node is away (module `stall`).
        let replies = futures_util::future::try_join_all(calls).await?;
        let mut outcomes = vec![CounterOutcome::NONE; ops.len()];
        let mut group_blocked = Vec::with_capacity(groups.len());
        for ((_, idx), reply) in groups.iter().zip(replies) {
            group_blocked.push(reply.blocked);
            for (&i, o) in idx.iter().zip(reply.outcomes) {
                outcomes[i] = o;
            }
        }
        let blocked = group_blocked.iter().any(|b| *b) || Batch::all_quota_denied(ops, &outcomes);
        if blocked && !whole {
            // Compensate: refund what the groups that did not refuse have charged, one call
            // per such group (its keys share its slot), concurrently. Refunds charge nothing:
            // they do not pass the stall gate.
            let mut refunds: Vec<Vec<Op>> = Vec::new();
            for ((_, idx), group_was_blocked) in groups.iter().zip(&group_blocked) {
                if *group_was_blocked {
                    continue;
                }
                let mut group = Vec::new();
                for &i in idx {
                    let op = &ops[i];
                    let o = &mut outcomes[i];
                    if op.charge == Charge::Ask && o.admitted && op.cost > 0 {
                        group.push(Op {
                            charge: Charge::Refund,
                            ..*op
                        });
                        o.remaining = (o.remaining + op.cost).min(op.quota.burst());
                        o.wait = o
                            .wait
                            .saturating_sub(op.cost.saturating_mul(op.quota.interval()));
                    }
                }
                if !group.is_empty() {
                    refunds.push(group);
                }
            }
            let calls = refunds.iter().map(|group| {
                let mut c = conn.clone();
                let all: Vec<usize> = (0..group.len()).collect();
                async move { self.invoke(&mut c, group, &all, true, now).await }
            });
            futures_util::future::try_join_all(calls).await?;
        }
        Ok(Batch { blocked, outcomes })
    }

    fn key(&self, key: Key) -> String {
        redis_key(&self.config.key_prefix, key)
    }
}
