//! What a backend is asked and what it answers, and the rules every backend applies the same
//! way: a request's counter operations ([`Op`]), how a denial of one weighs on the whole request
//! ([`Mode`], [`Batch::blocked_by`]), and the answer when no backend could decide
//! ([`Batch::fallback`]).

use crate::limiter::gcra::{CounterOutcome, Quota};
use crate::limiter::key::Key;

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

/// What an op does to its counter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Charge {
    /// A request charged before the work: charged only when it fits, and only when its whole
    /// request is admitted (a refused request charges nothing).
    #[default]
    Ask,
    /// Spend reported for work already done: recorded whatever the outcome, into debt past the
    /// bucket ([`gcra::record`](crate::limiter::gcra::record)); it is denied when it did not
    /// fit, and a denial refuses its request as any other would.
    Spent,
    /// Gives the cost back, whatever the outcome.
    Refund,
}

/// One counter operation of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    /// The counter.
    pub key: Key,
    /// Its rate.
    pub quota: Quota,
    /// Requests to charge (0 = check only), to record or to refund.
    pub cost: u64,
    /// Charge before the work, record spent work, or refund.
    pub charge: Charge,
    /// How a denial of this op weighs on the request.
    pub mode: Mode,
}

impl Op {
    /// Whether this op is applied whatever its request's outcome: a refund, or spend recorded.
    #[must_use]
    pub const fn unconditional(&self) -> bool {
        !matches!(self.charge, Charge::Ask)
    }

    /// Whether this op gives its cost back.
    #[must_use]
    pub const fn is_refund(&self) -> bool {
        matches!(self.charge, Charge::Refund)
    }
}

/// The decision on a request's ops.
///
/// The request is blocked when an [`Mode::Enforce`] op is denied, or when it has
/// [`Mode::Quota`] ops and all of them are denied. A blocked request charges nothing of what it
/// asks ([`Charge::Ask`]); an admitted one charges every asking op that was admitted (denied
/// shadow and quota ops charge nothing). Refunds and recorded spend apply either way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Whether the request is refused.
    pub blocked: bool,
    /// One outcome per op, in order. For a blocked request, an op that fit reports the state it
    /// found, uncharged.
    pub outcomes: Vec<CounterOutcome>,
}

impl Batch {
    /// The answer for a request with no ops: admitted, nothing counted.
    #[must_use]
    pub const fn empty() -> Self {
        Self {
            blocked: false,
            outcomes: Vec::new(),
        }
    }

    /// Whether a request with these per-op outcomes is refused: an enforced op is denied, or
    /// every quota-mode op is.
    #[must_use]
    pub fn blocked_by(ops: &[Op], outcomes: &[CounterOutcome]) -> bool {
        let enforce_denied = ops
            .iter()
            .zip(outcomes)
            .any(|(op, o)| !op.is_refund() && op.mode == Mode::Enforce && !o.admitted);
        enforce_denied || Self::all_quota_denied(ops, outcomes)
    }

    /// Whether the request has quota-mode ops and every one of them is denied.
    #[must_use]
    pub fn all_quota_denied(ops: &[Op], outcomes: &[CounterOutcome]) -> bool {
        let mut quota = ops
            .iter()
            .zip(outcomes)
            .filter(|(op, _)| !op.is_refund() && op.mode == Mode::Quota)
            .peekable();
        quota.peek().is_some() && quota.all(|(_, o)| !o.admitted)
    }

    /// The answer for `ops` when the backend cannot decide and the operator chose to allow
    /// (every op admitted, nothing known) or to deny (every op refused, retry after one
    /// emission interval, or the period for a ban).
    #[must_use]
    pub fn fallback(ops: &[Op], allow: bool) -> Self {
        Self {
            blocked: !allow,
            outcomes: ops
                .iter()
                .map(|op| CounterOutcome {
                    admitted: allow,
                    wait: if allow {
                        0
                    } else {
                        op.quota
                            .interval()
                            .max(op.quota.period() * u64::from(op.quota.is_ban()))
                    },
                    ..CounterOutcome::NONE
                })
                .collect(),
        }
    }
}

impl Batch {
    /// This batch with each admitted charge's [`CounterOutcome::hold`] read from its wait, for a
    /// store that reports only the wait: an admitted charge whose debt passes the bucket `B·T`
    /// was admitted at a slot `debt − B·T` ahead (only a quota with a `delay` admits so).
    #[must_use]
    pub fn with_holds(mut self, ops: &[Op]) -> Self {
        for (op, o) in ops.iter().zip(self.outcomes.iter_mut()) {
            if o.admitted && op.charge == Charge::Ask {
                o.hold = o
                    .wait
                    .saturating_sub(op.quota.tolerance())
                    .min(op.quota.max_delay());
            }
        }
        self
    }
}

/// Which store answered a request's ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// No store: the request had no ops.
    None,
    /// This process's memory.
    Memory,
    /// Redis, in a round trip.
    Redis,
    /// This node's cache of Redis's over-limit answers, without a round trip.
    RedisCache,
    /// This node's leases of hot counters, without a round trip.
    Lease,
}
