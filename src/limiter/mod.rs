//! Counting: the GCRA math, the clock, counter keys, and the backends that hold TATs.
//!
//! The [`Backend`] is the one seam the decision layer counts through: it decides a request's
//! [`Op`]s all or nothing, at its own clock's time, in this process's memory ([`MemoryStore`]) or
//! in Redis shared by several nodes ([`RedisStore`], [`LeasedStore`]); [`LocalFallback`] counts at
//! this node's share of each rate while Redis cannot decide. Beneath them lie plain values (`gcra`,
//! `clock`, `key`, `batch`, `error`, `figures`, and `share`: the division of a contended rate). It knows nothing of gRPC, YAML or policies; the
//! re-exports below are for callers outside `limiter`, whose own files import from the definer.

pub mod backend;
pub mod batch;
pub mod clock;
pub mod error;
pub mod fallback;
pub mod figures;
pub mod gcra;
pub mod key;
pub mod redis;
pub mod share;
pub mod store;

pub use backend::Backend;
pub use batch::{Batch, Charge, Mode, Op, Source};
pub use clock::{Clock, ManualClock, MonotonicClock};
pub use error::{BackendError, ErrorKind};
pub use fallback::{BackendMode, LocalFallback, LocalFigures};
pub use figures::{BreakerState, LeaseFigures, Purpose, RedisFigures, Stats, StoreStats};
pub use gcra::{CounterOutcome, Quota, QuotaError};
pub use key::{Key, KeyBuilder};
pub use redis::{LeaseConfig, LeasedStore, RedisConfig, RedisStore, RedisTime};
pub use share::{Demand, Grant, ShareBook};
pub use store::MemoryStore;
