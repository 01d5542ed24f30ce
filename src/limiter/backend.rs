//! The backend seam: one enum chosen at start, so a request is one match away from its store
//! (no dynamic dispatch on the hot path): memory, Redis, or Redis with leases of hot counters.
//!
//! Each backend decides at the time of its own clock: the memory backend reads the injected
//! [`Clock`]; the Redis backend uses Redis `TIME` (or, for tests, the injected clock too). Time
//! never travels as an extra parameter.

use std::sync::Arc;

use crate::limiter::batch::{Batch, Op, Source};
use crate::limiter::clock::Clock;
use crate::limiter::error::BackendError;
use crate::limiter::figures::{Stats, StoreStats};
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::lease::LeasedStore;
use crate::limiter::store::MemoryStore;

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
    pub async fn count(&self, ops: &[Op]) -> Result<Batch, BackendError> {
        self.count_from(ops).await.map(|(batch, _)| batch)
    }

    /// As [`Backend::count`], with the store that answered.
    ///
    /// # Errors
    ///
    /// As [`Backend::count`].
    pub async fn count_from(&self, ops: &[Op]) -> Result<(Batch, Source), BackendError> {
        if ops.is_empty() {
            return Ok((Batch::empty(), Source::None));
        }
        match self {
            Self::Memory { store, clock } => {
                Ok((store.count_batch_with(ops, &|| clock.now()), Source::Memory))
            }
            // Boxed, so that the futures of every decision, memory ones included, are not
            // sized for a Redis round trip's state.
            Self::Redis(redis) => Box::pin(redis.count_batch_from(ops)).await,
            // A lease answers in place; only a request sent to Redis pays for the box (a round
            // trip's state, which would otherwise be moved to the heap on every call).
            Self::Leased(leased) => match leased.answer_from_leases(ops) {
                Some(batch) => Ok((batch, Source::Lease)),
                None => Box::pin(leased.count_in_redis(ops)).await,
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

    /// How far each counter at `keys` is ahead of now, `TAT − now` in nanoseconds (0 for a
    /// full bucket), read without charging anything: the store's TAT at its clock's time, or
    /// Redis's by `GET` at Redis time. With leases this is the shared counter, in which tokens
    /// leased to nodes and not yet used count as spent ([`Backend::held`] says how many this
    /// node holds).
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot answer.
    pub async fn debts(&self, keys: &[crate::limiter::key::Key]) -> Result<Vec<u64>, BackendError> {
        let redis = match self {
            Self::Memory { store, clock } => {
                return Ok(keys
                    .iter()
                    .map(|&k| {
                        let tat = store.tat(k);
                        tat.saturating_sub(clock.now())
                    })
                    .collect());
            }
            Self::Redis(redis) => redis,
            Self::Leased(leased) => leased.redis(),
        };
        redis.debts(keys).await
    }

    /// Tokens of `key` this node holds leased and unused; `None` without leasing.
    #[must_use]
    pub fn held(&self, key: crate::limiter::key::Key) -> Option<u64> {
        match self {
            Self::Leased(leased) => Some(leased.held(key)),
            Self::Memory { .. } | Self::Redis(_) => None,
        }
    }

    /// Resets the counters at `keys` (an operator's write), so that each bucket is full again:
    /// removed from memory; in Redis, this node's lease of each dropped first, then the counter
    /// and its share table deleted and this node's over-limit cache told.
    ///
    /// # Errors
    ///
    /// [`BackendError`] when Redis cannot answer; some counters may then have been reset.
    pub async fn reset(&self, keys: &[crate::limiter::key::Key]) -> Result<(), BackendError> {
        let redis = match self {
            Self::Memory { store, .. } => {
                for &k in keys {
                    store.remove(k);
                }
                return Ok(());
            }
            Self::Redis(redis) => redis,
            Self::Leased(leased) => {
                for &k in keys {
                    leased.forget(k);
                }
                leased.redis()
            }
        };
        redis.reset(keys).await.map(drop)
    }
}
