//! Counting: the GCRA math, the clock, counter keys and the stores that hold TATs.
//!
//! The [`Limiter`] is the facade the decision layer uses: it reads the clock once per request
//! and decides a whole [`Op`] batch (a request's counters) all or nothing. It knows nothing of
//! gRPC, YAML or policies; it is given keys, quotas and costs.

pub mod clock;
pub mod gcra;
pub mod key;
pub mod redis;
pub mod store;

use std::sync::Arc;

pub use clock::{Clock, ManualClock, MonotonicClock};
pub use gcra::{Outcome, Quota, QuotaError};
pub use key::{Key, KeyBuilder};
pub use redis::{BackendError, RedisConfig, RedisStore};
pub use store::MemoryStore;

/// How a denial of one op weighs on its request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A denial refuses the request.
    Enforce,
    /// A denial is reported but never refuses the request (`shadow_mode`).
    Shadow,
    /// A denial refuses the request only when every quota-mode op of it is denied (`quota_mode`).
    Quota,
}

/// One counter operation of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    /// The counter.
    pub key: Key,
    /// Its rate.
    pub quota: Quota,
    /// Requests to charge (0 = check only) or to refund.
    pub cost: u64,
    /// Give `cost` back instead of charging it. Refunds are applied whatever the outcome.
    pub refund: bool,
    /// How a denial of this op weighs on the request.
    pub mode: Mode,
}

/// The decision on a request's ops.
///
/// The request is blocked when an [`Mode::Enforce`] op is denied, or when it has
/// [`Mode::Quota`] ops and all of them are denied. A blocked request charges nothing; an admitted
/// one charges every op that was admitted (denied shadow and quota ops charge nothing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Whether the request is refused.
    pub blocked: bool,
    /// One outcome per op, in order. For a blocked request, an op that fit reports the state it
    /// found, uncharged.
    pub outcomes: Vec<Outcome>,
}

/// The counting backend (memory, or Redis shared by several nodes) plus the clock it decides
/// with.
#[derive(Debug, Clone)]
pub struct Limiter {
    store: Arc<MemoryStore>,
    redis: Option<Arc<RedisStore>>,
    clock: Arc<dyn Clock>,
}

impl Limiter {
    /// A limiter over the in-memory `store`, deciding at the times `clock` gives.
    #[must_use]
    pub fn new(store: Arc<MemoryStore>, clock: Arc<dyn Clock>) -> Self {
        Self {
            store,
            redis: None,
            clock,
        }
    }

    /// A limiter with a fresh in-memory store and the process's monotonic clock.
    #[must_use]
    pub fn in_memory() -> Self {
        Self::new(
            Arc::new(MemoryStore::new()),
            Arc::new(MonotonicClock::new()),
        )
    }

    /// This limiter counting in Redis instead of memory.
    #[must_use]
    pub fn with_redis(mut self, redis: Arc<RedisStore>) -> Self {
        self.redis = Some(redis);
        self
    }

    /// The in-memory store (empty when counting in Redis).
    #[must_use]
    pub fn store(&self) -> &Arc<MemoryStore> {
        &self.store
    }

    /// The Redis store, when counting in Redis.
    #[must_use]
    pub fn redis(&self) -> Option<&Arc<RedisStore>> {
        self.redis.as_ref()
    }

    /// The current time of the limiter's clock, in nanoseconds.
    #[must_use]
    pub fn now(&self) -> u64 {
        self.clock.now()
    }

    /// Decides a request's ops now in the in-memory store, all or nothing (whatever the
    /// backend; for tests and benchmarks of the memory path).
    #[must_use]
    pub fn check_in_memory(&self, ops: &[Op]) -> Batch {
        self.store.check_batch_with(ops, &|| self.clock.now())
    }

    /// Decides a request's ops now, all or nothing.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot decide (the memory store always can).
    pub async fn check(&self, ops: &[Op]) -> Result<Batch, BackendError> {
        match &self.redis {
            None => Ok(self.check_in_memory(ops)),
            Some(redis) => redis.check_batch(ops, self.clock.now(), None).await,
        }
    }
}

impl Batch {
    /// The answer for `ops` when the backend cannot decide and the operator chose to allow
    /// (every op admitted, nothing known) or to deny (every op refused, retry after one
    /// emission interval).
    #[must_use]
    pub fn fallback(ops: &[Op], allow: bool) -> Self {
        Self {
            blocked: !allow,
            outcomes: ops
                .iter()
                .map(|op| Outcome {
                    admitted: allow,
                    tat: 0,
                    remaining: 0,
                    wait: if allow {
                        0
                    } else {
                        op.quota
                            .interval()
                            .max(op.quota.period() * u64::from(op.quota.is_ban()))
                    },
                })
                .collect(),
        }
    }
}
