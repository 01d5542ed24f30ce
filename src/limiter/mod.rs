//! Counting: the GCRA math, the clock, counter keys and the stores that hold TATs.
//!
//! The [`Limiter`] is the facade the decision layer uses: it reads the clock once per request
//! and decides a whole [`Op`] batch (a request's counters) all or nothing. It knows nothing of
//! gRPC, YAML or policies; it is given keys, quotas and costs.

pub mod clock;
pub mod gcra;
pub mod key;

pub mod store;

use std::sync::Arc;

pub use clock::{Clock, ManualClock, MonotonicClock};
pub use gcra::{Outcome, Quota, QuotaError};
pub use key::{Key, KeyBuilder};
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

/// The counting backend plus the clock it decides with.
#[derive(Debug, Clone)]
pub struct Limiter {
    store: Arc<MemoryStore>,
    clock: Arc<dyn Clock>,
}

impl Limiter {
    /// A limiter over `store`, deciding at the times `clock` gives.
    #[must_use]
    pub fn new(store: Arc<MemoryStore>, clock: Arc<dyn Clock>) -> Self {
        Self { store, clock }
    }

    /// A limiter with a fresh in-memory store and the process's monotonic clock.
    #[must_use]
    pub fn in_memory() -> Self {
        Self::new(
            Arc::new(MemoryStore::new()),
            Arc::new(MonotonicClock::new()),
        )
    }

    /// The in-memory store.
    #[must_use]
    pub fn store(&self) -> &Arc<MemoryStore> {
        &self.store
    }

    /// The current time of the limiter's clock, in nanoseconds.
    #[must_use]
    pub fn now(&self) -> u64 {
        self.clock.now()
    }

    /// Decides a request's ops at the current time.
    #[must_use]
    pub fn check(&self, ops: &[Op]) -> Batch {
        self.store.check_batch_with(ops, &|| self.clock.now())
    }
}
