//! The two synchronous halves of a decision around the backend call: [`plan`] matches each
//! descriptor against the policy snapshot and turns the matches into backend [`Op`]s; [`finish`]
//! turns the backend's [`Batch`] into one status per descriptor and an overall code.
//!
//! Semantics, decided once here:
//! - cost: the descriptor's `hits_addend` when set (0 = check only), else the request's, where
//!   0 means 1; `is_negative_hits` refunds instead (refunds apply whatever the outcome);
//! - all or nothing: when an enforced descriptor is over, nothing of the request is charged
//!   (the backend guarantees it);
//! - `shadow_mode` rules are counted exactly as enforced ones but never refuse and report OK;
//!   `quota_mode` rules refuse only when every quota rule of the request is over; global shadow
//!   mode never refuses but keeps each status's OVER_LIMIT;
//! - `replaces`: a matched rule named in another matched rule's `replaces` is dropped;
//! - a request's `RateLimitOverride` replaces matching when its domain is known.

use std::sync::Arc;

use super::request::{Descriptor, Request};
use super::{AppliedLimit, Code, Status};
use crate::limiter::gcra::NANOS_PER_SEC;
use crate::limiter::{Batch, Key, KeyBuilder, Mode, Op};
use crate::policy::{Domain, Limit, Rate, Rule};

/// Seed of override counter keys, distinct from any rule identity's role.
const OVERRIDE_SEED: u128 = 0x6f76_6572_7269_6465;

/// What was matched for one descriptor.
#[derive(Clone, Copy, Debug)]
pub(super) enum Slot<'p> {
    /// No rule applies.
    None,
    /// An unlimited rule.
    Unlimited,
    /// A limited rule (`None` for a request's override), counted by op `op`.
    Counted {
        rate: Rate,
        rule: Option<&'p Arc<Rule>>,
        op: usize,
    },
}

/// A request matched against one domain's policies, ready to count.
#[derive(Debug)]
pub(super) struct Plan<'p> {
    pub(super) slots: Vec<Slot<'p>>,
    pub(super) ops: Vec<Op>,
}

/// What matching found for one descriptor: the rule (if any), and the rate and counter when it
/// is counted.
type Matched<'p> = (Option<&'p Arc<Rule>>, Option<(Rate, Key)>);

/// Matches a (valid) request against its domain; `shadow_mode` is the global switch.
pub(super) fn plan<'p>(req: &Request, domain: &'p Domain, shadow_mode: bool) -> Plan<'p> {
    let mut matched: Vec<Matched<'p>> = Vec::with_capacity(req.descriptors.len());
    for desc in &req.descriptors {
        matched.push(match desc.limit {
            Some(ov) => (
                None,
                Some((
                    Rate::per_unit(ov.requests_per_unit, ov.unit),
                    override_key(&req.domain, desc),
                )),
            ),
            None => match domain.resolve(
                desc.entries
                    .iter()
                    .map(|e| (e.key.as_str(), e.value.as_str())),
            ) {
                None => (None, None),
                Some(r) => match r.rule.limit {
                    Limit::Unlimited => (Some(r.rule), None),
                    Limit::Limited(rate) => (Some(r.rule), Some((rate, r.key))),
                },
            },
        });
    }
    let replaced = |rule: &Rule| {
        rule.name.as_ref().is_some_and(|name| {
            matched
                .iter()
                .filter_map(|(r, _)| *r)
                .any(|other| other.replaces.iter().any(|n| n == name))
        })
    };
    let mut plan = Plan {
        slots: Vec::with_capacity(req.descriptors.len()),
        ops: Vec::new(),
    };
    for (index, (desc, (rule, counted))) in req.descriptors.iter().zip(&matched).enumerate() {
        let slot = match (rule, counted) {
            (Some(rule), _) if replaced(rule) => Slot::None,
            (Some(_), None) => Slot::Unlimited,
            (None, None) => Slot::None,
            (rule, Some((rate, key))) => {
                let mode = match rule {
                    _ if shadow_mode => Mode::Shadow,
                    Some(r) if r.shadow_mode => Mode::Shadow,
                    Some(r) if r.quota_mode => Mode::Quota,
                    _ => Mode::Enforce,
                };
                plan.ops.push(Op {
                    key: *key,
                    quota: rate.quota,
                    cost: req.cost(index),
                    refund: desc.is_negative_hits,
                    mode,
                });
                Slot::Counted {
                    rate: *rate,
                    rule: *rule,
                    op: plan.ops.len() - 1,
                }
            }
        };
        plan.slots.push(slot);
    }
    plan
}

/// The statuses and overall code of `plan` as decided by `batch`.
pub(super) fn finish(plan: &Plan<'_>, batch: &Batch, shadow_mode: bool) -> (Code, Vec<Status>) {
    let statuses = plan
        .slots
        .iter()
        .map(|slot| match *slot {
            Slot::None => Status::UNMATCHED,
            Slot::Unlimited => Status {
                remaining: u32::MAX,
                ..Status::UNMATCHED
            },
            Slot::Counted { rate, rule, op } => {
                let outcome = batch.outcomes[op];
                let shadow = rule.is_some_and(|r| r.shadow_mode);
                Status {
                    code: if outcome.admitted || shadow {
                        Code::Ok
                    } else {
                        Code::OverLimit
                    },
                    limit: Some(AppliedLimit {
                        rate,
                        rule: rule.cloned(),
                    }),
                    remaining: u32::try_from(outcome.remaining).unwrap_or(u32::MAX),
                    reset_seconds: Some(outcome.wait.div_ceil(NANOS_PER_SEC)),
                }
            }
        })
        .collect();
    let overall = if batch.blocked && !shadow_mode {
        Code::OverLimit
    } else {
        Code::Ok
    };
    (overall, statuses)
}

/// The counter of a request's override: its domain and entries, whatever the rate.
fn override_key(domain: &str, desc: &Descriptor) -> Key {
    let mut key = KeyBuilder::new(OVERRIDE_SEED);
    key.part(domain.as_bytes());
    for e in &desc.entries {
        key.part(e.key.as_bytes()).part(e.value.as_bytes());
    }
    key.finish()
}
