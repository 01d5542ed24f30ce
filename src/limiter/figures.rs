//! The figures the backends report, as plain values read at scrape time: the memory store's,
//! Redis's (calls, errors, breaker, latency) and leasing's. The backends fill them; metrics reads
//! them and knows no backend type.

use crate::histogram::LatencySnapshot;
use crate::limiter::error::ErrorKind;

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

/// The Redis backend's figures at one instant.
#[derive(Clone, Debug, PartialEq)]
pub struct RedisFigures {
    /// Script calls sent.
    pub round_trips: u64,
    /// The same round trips by what each was for (its first call's purpose).
    pub round_trips_by_purpose: [(Purpose, u64); Purpose::ALL.len()],
    /// Requests those calls decided (more than one per call when coalesced).
    pub requests: u64,
    /// Requests refused from the local over-limit cache.
    pub cache_hits: u64,
    /// Counters found holding no TAT (not a number, or a key of another type), read as absent
    /// and rewritten by the scripts.
    pub counter_repairs: u64,
    /// Failed calls of each kind.
    pub errors: [(ErrorKind, u64); ErrorKind::ALL.len()],
    /// Whether a connection is established.
    pub connected: bool,
    /// The circuit breaker's state.
    pub breaker: BreakerState,
    /// Round-trip latency.
    pub latency: LatencySnapshot,
}

/// What a round trip to Redis is for: the purpose of its first call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// Requests counted on the exact path (a GCRA script), with any lease calls beside them.
    Count,
    /// A lease's take of a slice.
    Take,
    /// Unused leased tokens given back.
    Give,
    /// A share's renewal.
    Renew,
    /// A renewal of this node's part of a rule it hands to Envoys (RLQS).
    Quota,
}

impl Purpose {
    /// Every purpose, in the order metrics list them.
    pub const ALL: [Self; 5] = [
        Self::Count,
        Self::Take,
        Self::Give,
        Self::Renew,
        Self::Quota,
    ];

    /// The metric label.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Count => "count",
            Self::Take => "take",
            Self::Give => "give",
            Self::Renew => "renew",
            Self::Quota => "quota",
        }
    }

    /// Its index in [`Purpose::ALL`].
    #[must_use]
    pub const fn index(self) -> usize {
        self as usize
    }
}

/// Leasing's figures at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseFigures {
    /// Slices taken (takes, and share renewals, granted at least one token).
    pub slices: u64,
    /// Tokens those slices took from the shared buckets.
    pub tokens_taken: u64,
    /// Unused tokens given back to the shared buckets.
    pub tokens_returned: u64,
    /// Requests answered from leases, without Redis.
    pub by_lease: u64,
    /// Requests sent the exact path, to Redis.
    pub by_redis: u64,
    /// Counters with a lease now.
    pub leases: usize,
    /// Shares of contended counters this node holds now.
    pub shares: usize,
    /// Share renewals answered by Redis.
    pub share_renewals: u64,
}

/// What the breaker currently does with calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls are refused until the cool-down ends.
    Open,
    /// One probe call is allowed through.
    HalfOpen,
}
