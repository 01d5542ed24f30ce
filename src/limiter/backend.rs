//! The backend seam: one enum chosen at start, so a request is one match away from its store
//! (no dynamic dispatch on the hot path): memory, Redis, or Redis with leases of hot counters.
//!
//! Each backend decides at the time of its own clock: the memory backend reads the injected
//! [`Clock`]; the Redis backend uses Redis `TIME` (or, for tests, the injected clock too). Time
//! never travels as an extra parameter.

use std::sync::Arc;
use std::time::Duration;

use super::redis::{LeaseFigures, LeasedStore, RedisFigures, RedisStore};
use super::{Batch, Clock, MemoryStore, Op};

/// Where counters live.
#[derive(Debug, Clone)]
pub enum Backend {
    /// This process's memory, decided at `clock`'s time.
    Memory {
        /// The counters.
        store: Arc<MemoryStore>,
        /// The time decisions are made at.
        clock: Arc<dyn Clock>,
    },
    /// Redis, shared by every node pointed at it.
    Redis(Arc<RedisStore>),
    /// Redis, with slices of hot counters leased to this node and answered locally.
    Leased(Arc<LeasedStore>),
}

impl Backend {
    /// A memory backend over `store`, deciding at `clock`'s time.
    #[must_use]
    pub fn memory(store: MemoryStore, clock: Arc<dyn Clock>) -> Self {
        Self::Memory {
            store: Arc::new(store),
            clock,
        }
    }

    /// Decides a request's ops, all or nothing. A request without ops is admitted without
    /// asking any store.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot decide (memory always can); nothing is known to be
    /// charged then.
    pub async fn check(&self, ops: &[Op]) -> Result<Batch, BackendError> {
        if ops.is_empty() {
            return Ok(Batch::empty());
        }
        match self {
            Self::Memory { store, clock } => Ok(store.check_batch_with(ops, &|| clock.now())),
            // Boxed, so that the futures of every decision, memory ones included, are not
            // sized for a Redis round trip's state.
            Self::Redis(redis) => Box::pin(redis.check_batch(ops)).await,
            // A lease answers in place; only a request sent to Redis pays for the box (a round
            // trip's state, moved to the heap on every call, was a leased node's largest cost
            // after the lease's own bookkeeping).
            Self::Leased(leased) => match leased.answer_from_leases(ops) {
                Some(batch) => Ok(batch),
                None => Box::pin(leased.check_in_redis(ops)).await,
            },
        }
    }

    /// Removes what no future decision needs (full buckets in memory; Redis expires its own
    /// keys). Returns how many counters were removed.
    pub fn sweep(&self) -> usize {
        match self {
            Self::Memory { store, clock } => store.sweep(clock.now()),
            Self::Redis(_) | Self::Leased(_) => 0,
        }
    }

    /// Plain figures for metrics, read now.
    #[must_use]
    pub fn stats(&self) -> Stats {
        match self {
            Self::Memory { store, .. } => Stats::Memory(StoreStats {
                keys: store.len(),
                max_keys: store.max_keys(),
                evictions: store.evictions(),
            }),
            Self::Redis(redis) => Stats::Redis(Box::new(redis.figures())),
            Self::Leased(leased) => {
                Stats::Leased(Box::new(leased.redis().figures()), leased.figures())
            }
        }
    }
}

/// A backend's figures at one instant.
#[derive(Clone, Debug, PartialEq)]
pub enum Stats {
    /// The memory store's.
    Memory(StoreStats),
    /// Redis's (the counters themselves live in Redis and expire there).
    Redis(Box<RedisFigures>),
    /// Redis's, and this node's leases'.
    Leased(Box<RedisFigures>, LeaseFigures),
}

/// The memory store's figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoreStats {
    /// Keys held (live, or expired and not yet swept).
    pub keys: usize,
    /// The most keys it holds.
    pub max_keys: usize,
    /// Keys evicted before their bucket was full.
    pub evictions: u64,
}

/// What kind of failure kept Redis from deciding, for metrics and logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// No answer within the deadline.
    Timeout,
    /// Not connected, or the connection failed.
    Connection,
    /// The circuit breaker is open.
    BreakerOpen,
    /// Redis answered with an error, or with something the script never returns.
    Redis,
}

impl ErrorKind {
    /// Every kind, in the order metrics list them.
    pub const ALL: [Self; 4] = [
        Self::Timeout,
        Self::Connection,
        Self::BreakerOpen,
        Self::Redis,
    ];

    /// The metric label.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Connection => "connection",
            Self::BreakerOpen => "breaker_open",
            Self::Redis => "redis",
        }
    }

    /// Position in [`ErrorKind::ALL`].
    #[must_use]
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// Why a backend could not decide.
///
/// Its `Display` is in the product's words, for a client's status details: no Redis error text,
/// script source or line number. [`BackendError::detail`] adds what Redis said, for the log.
#[derive(Clone, Debug, thiserror::Error)]
pub enum BackendError {
    /// No answer within the deadline.
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    /// No connection has been established yet.
    #[error("redis is not connected yet")]
    NotConnected,
    /// The connection failed or was dropped.
    #[error("the connection to redis failed")]
    Connection(#[source] ::redis::RedisError),
    /// The circuit breaker is open after repeated failures.
    #[error("redis circuit breaker is open")]
    BreakerOpen,
    /// Redis answered with an error.
    #[error("redis refused the rate-limit call")]
    Redis(#[source] ::redis::RedisError),
    /// Redis answered with something the script never returns.
    #[error("redis answered the rate-limit call with an unexpected reply")]
    Reply(String),
    /// The connection cannot be set up: a malformed URL, contradicting settings, or a
    /// certificate, key or password file that cannot be used.
    #[error("{0}")]
    Setup(#[source] super::redis::ConnectError),
}

impl BackendError {
    /// The error with what Redis said, for the log (never for a client).
    #[must_use]
    pub fn detail(&self) -> String {
        match self {
            Self::Connection(e) | Self::Redis(e) => format!("{self}: {e}"),
            Self::Reply(what) => format!("{self}: {what}"),
            _ => self.to_string(),
        }
    }

    /// Whether the error is about the data of a call (a key of the wrong type, a script that
    /// failed on what it read), not about Redis being reachable: Redis answered. Such an error
    /// is no reason to open the circuit breaker for every other key.
    #[must_use]
    pub fn is_data_error(&self) -> bool {
        match self {
            Self::Redis(e) => {
                e.code() == Some("WRONGTYPE")
                    || e.detail().is_some_and(|d| d.contains("user_script"))
                    || e.to_string().contains("user_script")
            }
            _ => false,
        }
    }

    /// Its kind, for metrics.
    #[must_use]
    pub const fn kind(&self) -> ErrorKind {
        match self {
            Self::Timeout(_) => ErrorKind::Timeout,
            Self::NotConnected | Self::Connection(_) | Self::Setup(_) => ErrorKind::Connection,
            Self::BreakerOpen => ErrorKind::BreakerOpen,
            Self::Redis(_) | Self::Reply(_) => ErrorKind::Redis,
        }
    }
}
