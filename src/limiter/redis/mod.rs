//! The Redis backend: the same GCRA as the in-memory store, run inside Redis by one Lua script
//! per request (`gcra.lua`), so several sluice nodes share one budget.
//!
//! - One round trip: all of a request's counters go in one `EVALSHA` (loaded once, reloaded on
//!   `NOSCRIPT`), with Redis `TIME` as the single clock. Each key expires at its TAT (to the
//!   millisecond), so Redis holds only live state. Concurrent requests share one multiplexed
//!   connection (pipelined).
//! - Two scripts, one answer: `gcra_lean.lua` keeps every quantity relative to now in plain
//!   numbers, exact while a bucket's `B·T + T` is under 2^52 ns (about 52 days), which is every
//!   usual limit, and reads its arguments and writes its reply as binary doubles ([`fits_lean`],
//!   `parse_lean`); a request with a longer tolerance goes to `gcra.lua`, exact over the whole
//!   range in pairs of seconds and nanoseconds. Both store the same decimal TAT, so a fleet of
//!   old and new nodes agrees.
//! - Redis Cluster: keys are grouped by hash slot and the groups sent concurrently. Each group is
//!   atomic; a request spanning slots is all or nothing by compensation: when one group refuses
//!   (or every quota-mode op is over), the charges other groups made are refunded at once. A
//!   concurrent request may see those charges for that instant (it can be refused, never
//!   over-admitted).
//! - Fast failure: every call has a deadline; after consecutive failures a circuit breaker
//!   answers at once for a cool-down, then lets one probe through. The connection manager
//!   reconnects in the background.
//! - Redis Sentinel (`sentinel.rs`): the master is the one the sentinels name, reached as a
//!   single node, and followed through a failover with no restart.
//! - A local cache of counters Redis reported out of tokens until an instant answers repeat
//!   offenders without a round trip. It only ever refuses what Redis itself would refuse.
//!
//! Unlike the memory store this is async I/O by nature; it still knows nothing of policies,
//! protobuf or the server.

mod breaker;
mod cache;
mod coalesce;
mod connect;
mod heartbeat;
mod lease;
mod scripts;
mod sentinel;
mod stats;

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::{RedisError, Script, Value};

use super::gcra::Outcome;
use super::{Backend, BackendError, Batch, Clock, ErrorKind, Key, Mode, Op};
pub use crate::histogram::LatencySnapshot;
use breaker::Breaker;
pub use breaker::BreakerState;
use cache::DenyCache;
use connect::Connector;
pub use connect::{ConnectError, Password, RedisAuth, RedisTls};
pub use heartbeat::Heartbeat;
pub use lease::{LeaseConfig, LeaseFigures, LeasedStore};
pub use sentinel::{SentinelConfig, SentinelError};
pub use stats::RedisFigures;
use stats::RedisStats;

/// How to reach Redis and how hard to try. Its `Debug` hides credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://` URLs: one for a single node, the seed nodes for a cluster. With
    /// [`RedisConfig::sentinel`], one URL whose credentials, database and scheme the master is
    /// reached with (its host and port are replaced by the master's).
    pub urls: Vec<String>,
    /// Talk Redis Cluster.
    pub cluster: bool,
    /// Prefix of every key sluice writes.
    pub key_prefix: String,
    /// Deadline of one call (the whole request's round trip).
    pub timeout: Duration,
    /// Deadline of one connection attempt.
    pub connect_timeout: Duration,
    /// Consecutive failures that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long the open breaker answers without trying Redis.
    pub breaker_cooldown: Duration,
    /// Most counters kept in the local over-limit cache (0 disables it).
    pub deny_cache_keys: usize,
    /// Find the master through Redis Sentinel (never with `cluster`).
    pub sentinel: Option<SentinelConfig>,
    /// TLS files and options, for `rediss://` URLs.
    pub tls: RedisTls,
    /// Credentials kept out of the URLs.
    pub auth: RedisAuth,
}

impl RedisConfig {
    /// The URLs with any `user:password@` replaced by `***@`, comma-separated, for logs.
    #[must_use]
    pub fn redacted_urls(&self) -> String {
        redact_all(self.urls.iter().map(String::as_str))
    }

    /// What is connected to, for logs: the URLs, or the master's name and its sentinels;
    /// credentials redacted.
    #[must_use]
    pub fn describe(&self) -> String {
        match &self.sentinel {
            Some(s) => format!(
                "master {:?} via sentinels {}",
                s.master_name,
                s.redacted_urls()
            ),
            None => self.redacted_urls(),
        }
    }
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("urls", &self.redacted_urls())
            .field("cluster", &self.cluster)
            .field("key_prefix", &self.key_prefix)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("breaker_failures", &self.breaker_failures)
            .field("breaker_cooldown", &self.breaker_cooldown)
            .field("deny_cache_keys", &self.deny_cache_keys)
            .field("sentinel", &self.sentinel)
            .field("tls", &self.tls)
            .field("auth", &self.auth)
            .finish()
    }
}

/// Whose clock the script decides at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RedisTime {
    /// Redis `TIME`: one clock for every node sharing the budget.
    #[default]
    Server,
    /// The store's injected clock (tests drive time by hand).
    Clock,
}

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// The Redis counter store.
pub struct RedisStore {
    config: RedisConfig,
    conn: ArcSwapOption<Conn>,
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
    queue: tokio::sync::mpsc::UnboundedSender<coalesce::Job>,
    /// Whether the last call sent to Redis got an answer (a deny-cache answer is not one).
    answering: std::sync::atomic::AtomicBool,
    /// The queue's receiving end, until the connection loop takes it.
    queued: std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<coalesce::Job>>>,
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
        let (queue, queued) = tokio::sync::mpsc::unbounded_channel();
        Ok(Arc::new(Self {
            queue,
            queued: std::sync::Mutex::new(Some(queued)),
            answering: std::sync::atomic::AtomicBool::new(false),
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

    /// This store as the process's backend.
    #[must_use]
    pub fn backend(self: &Arc<Self>) -> Backend {
        Backend::Redis(Arc::clone(self))
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
                    let single = matches!(conn, Conn::Single(_));
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
    fn set_answering(&self, answered: bool) {
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

    /// Decides a request's ops at Redis time (or the store's clock, see [`RedisTime`]), all or
    /// nothing. The store's clock dates entries of the over-limit cache.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot decide; nothing is known to be charged then.
    pub async fn check_batch(&self, ops: &[Op]) -> Result<Batch, BackendError> {
        let local_now = self.clock.now();
        if let Some(batch) = self.cache.answer(ops, local_now) {
            self.stats.cache_hit();
            return Ok(batch);
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
        let started = std::time::Instant::now();
        let result = match tokio::time::timeout(self.config.timeout, self.run(ops, now)).await {
            Ok(r) => r,
            Err(_) => Err(BackendError::Timeout(self.config.timeout)),
        };
        self.stats.record_latency(started.elapsed());
        self.set_answering(result.is_ok());
        match result {
            Ok(batch) => {
                self.breaker.success();
                self.cache.learn(ops, &batch, local_now);
                Ok(batch)
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

    async fn run(&self, ops: &[Op], now: Option<u64>) -> Result<Batch, BackendError> {
        let Some(conn) = self.conn.load_full() else {
            return Err(BackendError::NotConnected);
        };
        match &*conn {
            Conn::Single(_) if fits_lean(ops) => {
                let (reply, answer) = tokio::sync::oneshot::channel();
                let pending = coalesce::Pending {
                    ops: ops.to_vec(),
                    now,
                    reply,
                };
                self.queue
                    .send(coalesce::Job::Check(pending))
                    .map_err(|_| BackendError::NotConnected)?;
                // A dropped answer: the sending loop stopped (shutdown).
                let (blocked, outcomes) =
                    answer.await.map_err(|_| BackendError::NotConnected)??;
                Ok(Batch { blocked, outcomes })
            }
            Conn::Single(c) => {
                let all: Vec<usize> = (0..ops.len()).collect();
                let (blocked, outcomes) = self.invoke(&mut c.clone(), ops, &all, true, now).await?;
                Ok(Batch { blocked, outcomes })
            }
            Conn::Cluster(c) => self.run_cluster(c, ops, now).await,
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
    ) -> Result<(bool, Vec<Outcome>), BackendError> {
        let picked = || idx.iter().map(|&i| &ops[i]);
        let lean = fits_lean(picked());
        let script = if lean { &self.lean } else { &self.script };
        let mut call = script.prepare_invoke();
        call.arg(now.map(|n| n.to_string()).unwrap_or_default());
        self.push_keys(&mut call, picked());
        if lean {
            let mut args = Vec::with_capacity(lean_len(idx.len()));
            lean_args(&mut args, picked(), whole);
            call.arg(1).arg(args);
        } else {
            exact_args(&mut call, picked(), whole);
        }
        self.stats.round_trip();
        let reply: Value = call
            .invoke_async(conn)
            .await
            .map_err(|e| classify(e, self.config.timeout))?;
        let (answer, repairs) = match (lean, reply) {
            (true, Value::BulkString(reply)) => {
                let (mut answers, repairs) = parse_lean(&reply, &[idx.len()])?;
                let answer = answers
                    .pop()
                    .ok_or_else(|| BackendError::Reply("an empty reply".into()))?;
                (answer, repairs)
            }
            (false, Value::Array(reply)) => parse(&reply, idx.len())?,
            (_, reply) => return Err(BackendError::Reply(format!("{reply:?}"))),
        };
        self.stats.repaired(repairs);
        Ok(answer)
    }

    /// Adds the counters of `ops` to a script call's keys, in order.
    fn push_keys<'a>(
        &self,
        call: &mut redis::ScriptInvocation<'_>,
        ops: impl IntoIterator<Item = &'a Op>,
    ) {
        for op in ops {
            call.key(self.key(op.key));
        }
    }

    async fn run_cluster(
        &self,
        conn: &ClusterConnection,
        ops: &[Op],
        now: Option<u64>,
    ) -> Result<Batch, BackendError> {
        let mut groups: Vec<(u16, Vec<usize>)> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            let slot = hash_slot(self.key(op.key).as_bytes());
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, idx)) => idx.push(i),
                None => groups.push((slot, vec![i])),
            }
        }
        let whole = groups.len() == 1;
        let calls = groups.iter().map(|(_, idx)| {
            let mut c = conn.clone();
            async move { self.invoke(&mut c, ops, idx, whole, now).await }
        });
        let replies = futures_util::future::try_join_all(calls).await?;
        let mut outcomes = vec![Outcome::NONE; ops.len()];
        let mut group_blocked = Vec::with_capacity(groups.len());
        for ((_, idx), (blocked, outs)) in groups.iter().zip(replies) {
            group_blocked.push(blocked);
            for (&i, o) in idx.iter().zip(outs) {
                outcomes[i] = o;
            }
        }
        let blocked = group_blocked.iter().any(|b| *b) || Batch::all_quota_denied(ops, &outcomes);
        if blocked && !whole {
            // Compensate: refund what the groups that did not refuse have charged, one call
            // per such group (its keys share its slot), concurrently.
            let mut refunds: Vec<Vec<Op>> = Vec::new();
            for ((_, idx), group_was_blocked) in groups.iter().zip(&group_blocked) {
                if *group_was_blocked {
                    continue;
                }
                let mut group = Vec::new();
                for &i in idx {
                    let op = &ops[i];
                    let o = &mut outcomes[i];
                    if !op.refund && o.admitted && op.cost > 0 {
                        group.push(Op {
                            refund: true,
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
        format!("{}{key:032x}", self.config.key_prefix)
    }
}

/// Below this many nanoseconds (2^52, about 52 days) a debt, and every sum the lean script forms
/// from it, is an integer a double holds exactly.
const LEAN_LIMIT: u64 = 1 << 52;

/// Below this every integer is a double, exactly: the bound on the lean script's arguments.
const EXACT_DOUBLE: u64 = 1 << 53;

/// Whether `gcra_lean.lua` decides these ops exactly: every counter's `B·T + T` is below
/// 2^52 ns, and its period and cost are below 2^53, so that every argument is exact as a
/// double. The rest (a tolerance of weeks or more, a period of over 104 days, a cost of 2^53)
/// go to the pair arithmetic of `gcra.lua`.
pub fn fits_lean<'a>(ops: impl IntoIterator<Item = &'a Op>) -> bool {
    ops.into_iter().all(|op| {
        op.quota.tolerance().saturating_add(op.quota.interval()) < LEAN_LIMIT
            && op.quota.period() < EXACT_DOUBLE
            && op.cost < EXACT_DOUBLE
    })
}

/// The bytes of a request of `n` ops in [`lean_args`].
const fn lean_len(n: usize) -> usize {
    8 * (2 + 6 * n)
}

/// Appends one request of `ops` to the lean script's arguments (its `ARGV[3]`): `whole`, the
/// op count, then six per op (T, B·T, B, cost, kind, period), each a little-endian double.
/// Every value is an integer below 2^53 for ops that [`fits_lean`], so each converts exactly.
fn lean_args<'a>(out: &mut Vec<u8>, ops: impl ExactSizeIterator<Item = &'a Op>, whole: bool) {
    let mut put = |v: u64| out.extend_from_slice(&(v as f64).to_le_bytes());
    put(u64::from(whole));
    put(ops.len() as u64);
    for op in ops {
        put(op.quota.interval());
        put(op.quota.tolerance());
        put(op.quota.burst());
        put(op.cost);
        put(kind(op));
        put(op.quota.period());
    }
}

/// Appends one request of `ops` to `gcra.lua`'s arguments: `whole`, then six per op (T, B·T,
/// B, cost, kind, period) in decimal.
fn exact_args<'a>(
    call: &mut redis::ScriptInvocation<'_>,
    ops: impl IntoIterator<Item = &'a Op>,
    whole: bool,
) {
    call.arg(if whole { "1" } else { "0" });
    for op in ops {
        call.arg(op.quota.interval())
            .arg(op.quota.tolerance())
            .arg(op.quota.burst())
            .arg(op.cost)
            .arg(kind(op))
            .arg(op.quota.period());
    }
}

/// An op's kind in the scripts' arguments: 0 enforce, 1 shadow, 2 quota; plus 4 for a refund.
fn kind(op: &Op) -> u64 {
    let mode = match op.mode {
        Mode::Enforce => 0,
        Mode::Shadow => 1,
        Mode::Quota => 2,
    };
    mode + if op.refund { 4 } else { 0 }
}

/// Checks that `config` can be used to connect: URLs, TLS options and credentials agree, and
/// every certificate, key and password file can be read and used. Nothing is connected.
///
/// # Errors
///
/// [`ConnectError`] naming the setting (and the file) at fault.
pub fn check(config: &RedisConfig) -> Result<(), ConnectError> {
    Connector::new(config).map(drop)
}

/// `urls` each through [`redact`], comma-separated.
#[must_use]
pub fn redact_all<'a>(urls: impl IntoIterator<Item = &'a str>) -> String {
    urls.into_iter().map(redact).collect::<Vec<_>>().join(",")
}

/// A Redis URL with any `user:password@` replaced by `***@`, for logs.
#[must_use]
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}***{}", &url[..scheme + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

fn classify(e: RedisError, timeout: Duration) -> BackendError {
    if e.is_timeout() {
        BackendError::Timeout(timeout)
    } else if e.is_io_error() || e.is_connection_refusal() || e.is_connection_dropped() {
        BackendError::Connection(e)
    } else {
        BackendError::Redis(e)
    }
}

/// Reads `gcra.lua`'s reply: `{blocked, now, then per op: admitted, remaining, wait}`, then
/// the counters it repaired when there were any (else 0).
fn parse(reply: &[Value], n: usize) -> Result<(Answer, u64), BackendError> {
    let bad = || BackendError::Reply(format!("{reply:?}"));
    let repairs = match reply.len().checked_sub(2 + 3 * n) {
        Some(0) => 0,
        Some(1) => int(&reply[2 + 3 * n]).ok_or_else(bad)?,
        _ => return Err(bad()),
    };
    let blocked = int(&reply[0]).ok_or_else(bad)? == 1;
    Ok((
        (blocked, outcomes(&reply[2..], n).ok_or_else(bad)?),
        repairs,
    ))
}

/// One request's answer from a script: whether it was blocked, and each op's outcome.
type Answer = (bool, Vec<Outcome>);

/// Reads `gcra_lean.lua`'s reply to a batch of requests of `sizes` ops each: little-endian
/// doubles, per request `blocked, then per op: admitted, remaining, wait`, each an integer below
/// 2^53; then, when the call repaired counters, how many (else 0).
fn parse_lean(reply: &[u8], sizes: &[usize]) -> Result<(Vec<Answer>, u64), BackendError> {
    let values = sizes.iter().map(|n| 1 + 3 * n).sum::<usize>();
    let bad = |what: &str| {
        BackendError::Reply(format!(
            "{what} in a reply of {} bytes for {values} values",
            reply.len()
        ))
    };
    let repaired = match reply.len().checked_sub(8 * values) {
        Some(0) => false,
        Some(8) => true,
        _ => return Err(bad("a wrong length")),
    };
    let mut doubles = reply.chunks_exact(8).map(|b| {
        let x = f64::from_le_bytes(<[u8; 8]>::try_from(b).ok()?);
        // Every value is an integer in 0..2^53, which a double holds exactly.
        (x >= 0.0 && x < EXACT_DOUBLE as f64 && x.fract() == 0.0).then_some(x as u64)
    });
    let mut next = || {
        doubles
            .next()
            .flatten()
            .ok_or_else(|| bad("a value not an integer"))
    };
    let mut out = Vec::with_capacity(sizes.len());
    for &n in sizes {
        let blocked = next()? == 1;
        let mut outcomes = Vec::with_capacity(n);
        for _ in 0..n {
            outcomes.push(Outcome {
                admitted: next()? == 1,
                remaining: next()?,
                wait: next()?,
                ..Outcome::NONE
            });
        }
        out.push((blocked, outcomes));
    }
    let repairs = if repaired { next()? } else { 0 };
    Ok((out, repairs))
}

/// `n` outcomes from `admitted, remaining, wait` triples.
fn outcomes(values: &[Value], n: usize) -> Option<Vec<Outcome>> {
    (0..n)
        .map(|k| {
            Some(Outcome {
                admitted: int(&values[3 * k])? == 1,
                remaining: int(&values[3 * k + 1])?,
                wait: int(&values[3 * k + 2])?,
                ..Outcome::NONE
            })
        })
        .collect()
}

/// A non-negative integer reply value (Lua numbers arrive as integers, strings as bulk strings).
fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// Redis Cluster's hash slot of a key: CRC16 (XMODEM) of the key, or of its `{hash tag}`.
fn hash_slot(key: &[u8]) -> u16 {
    let tagged = key
        .iter()
        .position(|b| *b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|b| *b == b'}')
                .filter(|len| *len > 0)
                .map(|len| &rest[..len])
        })
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &b in tagged {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Quota;

    const SEC: u64 = 1_000_000_000;

    fn op(period: u64, burst: u64, cost: u64, mode: Mode, refund: bool) -> Op {
        Op {
            key: 7,
            quota: Quota::new(period, burst, burst).unwrap(),
            cost,
            refund,
            mode,
        }
    }

    #[test]
    fn the_lean_reply_is_read_as_exact_doubles_per_request() {
        let doubles = |v: &[f64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let big = (EXACT_DOUBLE - 1) as f64;
        let reply = doubles(&[1.0, 1.0, 4.0, 250.0, 0.0, 7.0, big, 0.0, 0.0, 3.0, 0.0]);
        let (got, repairs) = parse_lean(&reply, &[2, 1]).unwrap();
        assert_eq!(repairs, 0);
        let outcome = |admitted, remaining, wait| Outcome {
            admitted,
            remaining,
            wait,
            ..Outcome::NONE
        };
        assert_eq!(
            got,
            vec![
                (
                    true,
                    vec![outcome(true, 4, 250), outcome(false, 7, EXACT_DOUBLE - 1)]
                ),
                (false, vec![outcome(false, 3, 0)]),
            ]
        );
        // One more value: the counters the call repaired.
        let mut repaired = reply.clone();
        repaired.extend(doubles(&[2.0]));
        assert_eq!(parse_lean(&repaired, &[2, 1]).unwrap(), (got, 2));
        // A reply of another length, a negative, fractional or inexact value: an error naming the
        // problem (in the log's detail), never a guess.
        assert!(parse_lean(&reply[..80], &[2, 1]).is_err());
        repaired.extend(doubles(&[0.0]));
        assert!(parse_lean(&repaired, &[2, 1]).is_err());
        for bad in [-1.0, 0.5, EXACT_DOUBLE as f64, f64::NAN, f64::INFINITY] {
            let reply = doubles(&[0.0, 1.0, bad, 0.0]);
            let err = parse_lean(&reply, &[1]).unwrap_err().detail();
            assert!(err.contains("not an integer"), "{bad}: {err}");
        }
    }

    #[test]
    fn the_lean_arguments_are_exact_doubles_in_order() {
        let ops = [
            op(SEC, 10, 1, Mode::Enforce, false),
            op(60 * SEC, 3, 2, Mode::Quota, true),
            op(3_600 * SEC, 5, 0, Mode::Shadow, false),
        ];
        assert!(fits_lean(&ops));
        let mut out = Vec::new();
        lean_args(&mut out, [&ops[2], &ops[1]].into_iter(), false);
        assert_eq!(out.len(), lean_len(2));
        let values: Vec<f64> = out
            .chunks(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let (a, b) = (&ops[2].quota, &ops[1].quota);
        let expected: Vec<f64> = [
            0,
            2,
            a.interval(),
            a.tolerance(),
            5,
            0,
            1,
            a.period(),
            b.interval(),
            b.tolerance(),
            3,
            2,
            2 + 4,
            b.period(),
        ]
        .iter()
        .map(|v| *v as f64)
        .collect();
        assert_eq!(values, expected);
    }

    #[test]
    fn what_a_double_cannot_hold_goes_to_the_exact_script() {
        let fits = |o: Op| fits_lean([&o]);
        assert!(fits(op(SEC, 10, 1, Mode::Enforce, false)));
        // A year's period is above 2^53 ns even when the bucket is small: a burst of 1 of a
        // billion a year (T of 31.5 ms) fits the tolerance bound, not the period's.
        let yearly = Op {
            quota: Quota::new(365 * 86_400 * SEC, 1_000_000_000, 1).unwrap(),
            ..op(SEC, 10, 1, Mode::Enforce, false)
        };
        assert!(yearly.quota.tolerance() + yearly.quota.interval() < LEAN_LIMIT);
        assert!(!fits(yearly));
        assert!(!fits(Op {
            quota: Quota::ban(365 * 86_400 * SEC),
            ..yearly
        }));
        assert!(fits(op(
            30 * 86_400 * SEC,
            1_000_000,
            1,
            Mode::Enforce,
            false
        )));
        // A cost of 2^53 (a client's hits_addend) is not a double.
        assert!(!fits(op(SEC, 10, 1 << 53, Mode::Enforce, false)));
        assert!(fits(op(SEC, 10, (1 << 53) - 1, Mode::Enforce, false)));
        // A tolerance of 60 days, its period below 2^53: the pair arithmetic all the same.
        assert!(!fits(op(60 * 86_400 * SEC, 10, 1, Mode::Enforce, false)));
    }

    #[test]
    fn hash_slots_match_redis() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(hash_slot(b"123456789"), 0x31C3);
        assert_eq!(hash_slot(b"foo"), 12182);
        assert_eq!(hash_slot(b"{user1000}.following"), hash_slot(b"user1000"));
        // An empty first tag: the whole key is hashed (CRC16/XMODEM of "foo{}{bar}" is 8363
        // mod 16384), not "bar".
        assert_eq!(hash_slot(b"foo{}{bar}"), 8363);
        assert_ne!(hash_slot(b"foo{}{bar}"), hash_slot(b"bar"));
    }
}
