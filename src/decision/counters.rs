//! One counter, looked at and reset by an operator: [`Decider::look_up`] finds the counters a
//! request's descriptors would be charged on (the same match as a decision: the plan) and reads
//! each one's state without charging anything; [`Decider::reset`] empties them, so the next
//! request is admitted. Neither records decision metrics. Who may reset is the transport's
//! question, not this module's.

use std::sync::Arc;

use super::plan::{self, Applied};
use super::{Decider, Request, RequestError};
use crate::limiter::{BackendError, Key};
use crate::policy::{Rate, Rule};

/// One counter a request's descriptor is charged on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counter {
    /// The index of the request descriptor it belongs to.
    pub descriptor: usize,
    /// The rule, or `None` for a request's override.
    pub rule: Option<Arc<Rule>>,
    /// The rate it counts at.
    pub rate: Rate,
    /// The counter key.
    pub key: Key,
}

/// A counter's state now, read without charging anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CounterState {
    /// The counter.
    pub counter: Counter,
    /// Requests of cost 1 that would be admitted now, one after another.
    pub remaining: u64,
    /// Nanoseconds until a request of cost 1 is admitted (0 when one would be now).
    pub wait: u64,
    /// How far its TAT is ahead of now, in nanoseconds (0 for a full bucket).
    pub debt: u64,
    /// With leasing: tokens of it this node holds leased and unused (already spent in `debt`).
    pub held_here: Option<u64>,
}

impl CounterState {
    /// The state of `counter` owing `debt` nanoseconds.
    fn of(counter: Counter, debt: u64, held_here: Option<u64>) -> Self {
        let quota = counter.rate.quota;
        let (remaining, wait) = if quota.is_ban() {
            (0, quota.period())
        } else {
            (
                quota.tolerance().saturating_sub(debt) / quota.interval(),
                debt.saturating_add(quota.interval())
                    .saturating_sub(quota.tolerance()),
            )
        };
        Self {
            counter,
            remaining,
            wait,
            debt,
            held_here,
        }
    }
}

/// Why no counter could be looked at or reset.
#[derive(Debug, thiserror::Error)]
pub enum CounterError {
    /// The request is malformed.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// No policies were loaded yet.
    #[error("no rate limit configuration loaded")]
    NoPolicies,
    /// No policy names the domain.
    #[error("unknown domain {0:?}")]
    UnknownDomain(String),
    /// A descriptor is charged on no counter (no limited rule matches it).
    #[error("descriptors[{0}] matches no limited rule")]
    NoRule(usize),
    /// The backend could not answer.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl Decider {
    /// The counters `req`'s descriptors are charged on, in order, each with its state now.
    /// Nothing is charged and no metric is recorded.
    ///
    /// # Errors
    ///
    /// [`CounterError`] for a malformed request, an unknown domain, a descriptor that matches
    /// no limited rule, or a backend that cannot answer.
    pub async fn look_up(&self, req: &Request) -> Result<Vec<CounterState>, CounterError> {
        let counters = self.counters(req)?;
        let keys: Vec<Key> = counters.iter().map(|c| c.key).collect();
        let debts = self.backend.debts(&keys).await?;
        Ok(counters
            .into_iter()
            .zip(debts)
            .map(|(c, debt)| {
                let held = self.backend.held(c.key);
                CounterState::of(c, debt, held)
            })
            .collect())
    }

    /// Resets the counters `req`'s descriptors are charged on, so that each bucket is full
    /// again; returns them. When any descriptor matches no counter, nothing is reset.
    ///
    /// # Errors
    ///
    /// As [`Decider::look_up`]; after a backend error some counters may have been reset.
    pub async fn reset(&self, req: &Request) -> Result<Vec<Counter>, CounterError> {
        let counters = self.counters(req)?;
        let mut keys: Vec<Key> = counters.iter().map(|c| c.key).collect();
        keys.sort_unstable();
        keys.dedup();
        self.backend.reset(&keys).await?;
        Ok(counters)
    }

    /// The counters of `req`, matched on one policy snapshot as a decision would be.
    fn counters(&self, req: &Request) -> Result<Vec<Counter>, CounterError> {
        self.options.caps.validate(req)?;
        let policies = self.policies.load();
        if policies.is_pending() {
            return Err(CounterError::NoPolicies);
        }
        let domain = policies
            .domain(&req.domain)
            .ok_or_else(|| CounterError::UnknownDomain(req.domain.clone()))?;
        let mut plan = plan::plan(
            req,
            domain,
            (self.options.shadow_mode, self.options.quota_mode),
        );
        plan::cut_delays(&mut plan, || 0);
        let mut counters = Vec::with_capacity(plan.ops.len());
        for (i, planned) in plan.descriptors.iter().enumerate() {
            let plan::DescriptorPlan::Counted { start, end, .. } = *planned else {
                return Err(CounterError::NoRule(i));
            };
            for (op, &Applied { rate, rule }) in
                plan.ops[start..end].iter().zip(&plan.applied[start..end])
            {
                counters.push(Counter {
                    descriptor: i,
                    rule: rule.cloned(),
                    rate,
                    key: op.key,
                });
            }
        }
        Ok(counters)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::gcra::NANOS_PER_SEC;
    use crate::policy::Unit;

    fn state(requests: u32, debt: u64) -> CounterState {
        let counter = Counter {
            descriptor: 0,
            rule: None,
            rate: Rate::per_unit(requests, Unit::Second),
            key: 1,
        };
        CounterState::of(counter, debt, None)
    }

    #[test]
    fn a_full_bucket_has_its_burst_and_no_wait() {
        let s = state(10, 0);
        assert_eq!((s.remaining, s.wait, s.debt), (10, 0, 0));
    }

    #[test]
    fn an_exhausted_bucket_waits_one_interval() {
        // 10 per second: T = 100 ms, B·T = 1 s.
        let s = state(10, NANOS_PER_SEC);
        assert_eq!((s.remaining, s.wait), (0, NANOS_PER_SEC / 10));
    }

    #[test]
    fn debt_past_the_bucket_adds_to_the_wait() {
        let s = state(10, 3 * NANOS_PER_SEC);
        assert_eq!(
            (s.remaining, s.wait),
            (0, 2 * NANOS_PER_SEC + NANOS_PER_SEC / 10)
        );
    }

    #[test]
    fn a_ban_never_has_room() {
        let s = state(0, 0);
        assert_eq!((s.remaining, s.wait), (0, NANOS_PER_SEC));
    }
}
