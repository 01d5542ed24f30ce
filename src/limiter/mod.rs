//! Counting: the GCRA math, the clock, counter keys, and the backends that hold TATs.
//!
//! The [`Backend`] is the one seam the decision layer counts through: it decides a whole [`Op`]
//! batch (a request's counters) all or nothing, at the time its own clock gives, in this
//! process's memory ([`MemoryStore`]) or in Redis shared by several nodes ([`RedisStore`]). It
//! knows nothing of gRPC, YAML or policies; it is given keys, quotas and costs. While Redis cannot
//! decide, [`LocalFallback`] can count in this node's memory at its share of each rate
//! (`on_backend_error: local`).

pub mod backend;
pub mod batch;
pub mod clock;
pub mod error;
pub mod fallback;
pub mod figures;
pub mod gcra;
pub mod key;
pub mod redis;
pub mod store;

pub use backend::Backend;
pub use batch::{Batch, Mode, Op};
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use error::{BackendError, ErrorKind};
pub use fallback::{BackendMode, LocalFallback, LocalFigures};
pub use figures::{BreakerState, LeaseFigures, RedisFigures, Stats, StoreStats};
pub use gcra::{CounterOutcome, Quota, QuotaError};
pub use key::{Key, KeyBuilder};
pub use redis::{LeaseConfig, LeasedStore, RedisConfig, RedisStore, RedisTime};
pub use store::MemoryStore;
