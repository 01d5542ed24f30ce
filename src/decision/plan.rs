//! The two synchronous halves of a decision around the backend call, where its semantics are
//! decided once: [`plan`] matches each descriptor against the policy snapshot and turns the
//! matches into backend [`Op`]s; [`finish`] turns the backend's [`Batch`] into one status per
//! descriptor and an overall code. A request is charged all or nothing: when an enforced
//! descriptor is over, nothing of it is charged (the backend guarantees it).

use std::sync::Arc;

use super::request::{Descriptor, Request};
use super::{AppliedLimit, Code, Status};
use crate::limiter::gcra::NANOS_PER_SEC;
use crate::limiter::{Batch, Charge, Key, KeyBuilder, Mode, Op};
use crate::policy::{Domain, Limit, Metadata, Rate, Resolved, Rule};

/// Seed of override counter keys, distinct from any rule identity's role.
const OVERRIDE_SEED: u128 = 0x6f76_6572_7269_6465;

/// What was matched for one descriptor.
#[derive(Clone, Copy, Debug)]
pub(super) enum DescriptorPlan<'p> {
    /// No rule applies.
    None,
    /// Only unlimited rules.
    Unlimited,
    /// Limited rules (or a request's override), counted by ops `start..end`; `metadata` is the
    /// matched node's (never an override's).
    Counted {
        start: usize,
        end: usize,
        metadata: Option<&'p Metadata>,
    },
}

/// The limit an op counts for: its rate and rule (`None` for a request's override).
#[derive(Clone, Copy, Debug)]
pub(super) struct Applied<'p> {
    pub(super) rate: Rate,
    pub(super) rule: Option<&'p Arc<Rule>>,
}

/// A request matched against one domain's policies, ready to count.
#[derive(Debug)]
pub(super) struct Plan<'p> {
    /// One per request descriptor.
    pub(super) descriptors: Vec<DescriptorPlan<'p>>,
    /// The backend's ops.
    pub(super) ops: Vec<Op>,
    /// One per op: what it counts for.
    pub(super) applied: Vec<Applied<'p>>,
}

/// What matching found for one descriptor.
enum Matched<'p> {
    /// Nothing applies.
    None,
    /// A request's override: its rate and counter.
    Override(Rate, Key),
    /// Policy rules: the rules (kept for `replaces` after the match is taken) and the match.
    Rules(&'p [Arc<Rule>], Option<Resolved<'p>>),
}

impl Matched<'_> {
    fn rules(&self) -> &[Arc<Rule>] {
        match self {
            Self::Rules(rules, _) => rules,
            _ => &[],
        }
    }
}

/// Whether a matched rule of the request names `rule` in its `replaces`.
fn replaced(matched: &[Matched<'_>], rule: &Rule) -> bool {
    rule.name.as_ref().is_some_and(|name| {
        matched
            .iter()
            .flat_map(Matched::rules)
            .any(|other| other.replaces.iter().any(|n| n == name))
    })
}

/// Matches a (valid) request against its domain; `shadow_mode` and `quota_mode` are the global
/// switches (shadow wins, as a rule's own `shadow_mode` does).
///
/// - cost: the descriptor's `hits_addend` when set (0 = check only), else the request's, where
///   0 means 1; times a cost node's `cost`; `is_negative_hits` refunds instead (refunds apply
///   whatever the outcome);
/// - several rules on one node (`rate_limits`): one op each, charged all or nothing with the rest
///   of the request; the descriptor's status is the most constrained of them (see [`finish`]);
/// - `shadow_mode` rules are counted exactly as enforced ones but never refuse and report OK;
///   `quota_mode` rules refuse only when every quota rule of the request is over;
/// - `replaces`: a matched rule named in another matched rule's `replaces` is dropped (each
///   entry of `rate_limits` on its own);
/// - a request's `RateLimitOverride` replaces matching when its domain is known;
/// - a rule's `delay` is its own here; [`cut_delays`] cuts it to how long the answer may be held.
pub(super) fn plan<'p>(
    req: &Request,
    domain: &'p Domain,
    (shadow_mode, quota_mode): (bool, bool),
) -> Plan<'p> {
    let mut matched: Vec<Matched<'p>> = Vec::with_capacity(req.descriptors.len());
    for desc in &req.descriptors {
        matched.push(match desc.limit {
            Some(ov) => Matched::Override(
                Rate::per_unit(ov.requests_per_unit, ov.unit),
                override_key(&req.domain, desc),
            ),
            None => match domain.resolve(
                desc.entries
                    .iter()
                    .map(|e| (e.key.as_str(), e.value.as_str())),
            ) {
                None => Matched::None,
                Some(r) => Matched::Rules(r.rules, Some(r)),
            },
        });
    }
    let mut plan = Plan {
        descriptors: Vec::with_capacity(req.descriptors.len()),
        // Most descriptors match one rule: sized so that the first op does not grow them.
        ops: Vec::with_capacity(req.descriptors.len()),
        applied: Vec::with_capacity(req.descriptors.len()),
    };
    let mode = |rule: Option<&Rule>| match rule {
        _ if shadow_mode => Mode::Shadow,
        Some(r) if r.shadow_mode => Mode::Shadow,
        Some(r) if r.quota_mode || quota_mode => Mode::Quota,
        _ => Mode::Enforce,
    };
    for (i, desc) in req.descriptors.iter().enumerate() {
        let hits = req.cost(i);
        let start = plan.ops.len();
        let mut unlimited = false;
        let mut metadata = None;
        let resolved = match &mut matched[i] {
            Matched::None => None,
            Matched::Override(rate, key) => {
                plan.ops.push(op(*key, *rate, hits, desc, mode(None)));
                plan.applied.push(Applied {
                    rate: *rate,
                    rule: None,
                });
                None
            }
            Matched::Rules(_, resolved) => resolved.take(),
        };
        if let Some(resolved) = resolved {
            metadata = resolved.metadata;
            let rules = resolved.rules;
            let cost = hits.saturating_mul(resolved.cost);
            let counted =
                |rule: &Rule| matches!(rule.limit, Limit::Limited(_)) && !replaced(&matched, rule);
            // The last rule counted takes the walk's key state; the rest copy it. One
            // `replaces` scan per rule in the common one-rule case.
            let last = rules.iter().rposition(|r| counted(r));
            let mut resolved = Some(resolved);
            for (j, rule) in rules.iter().enumerate() {
                let (rate, key) = match rule.limit {
                    Limit::Limited(rate) if Some(j) == last => {
                        (rate, resolved.take().map(|r| r.into_key(rule)))
                    }
                    Limit::Limited(rate)
                        if last.is_some_and(|l| j < l) && !replaced(&matched, rule) =>
                    {
                        (rate, resolved.as_ref().map(|r| r.key(rule)))
                    }
                    // Replaced (every limited rule after `last` is).
                    Limit::Limited(_) => continue,
                    Limit::Unlimited => {
                        unlimited |= !replaced(&matched, rule);
                        continue;
                    }
                };
                let Some(key) = key else { continue };
                plan.ops.push(op(key, rate, cost, desc, mode(Some(rule))));
                plan.applied.push(Applied {
                    rate,
                    rule: Some(rule),
                });
            }
        }
        let end = plan.ops.len();
        plan.descriptors.push(if end > start {
            DescriptorPlan::Counted {
                start,
                end,
                metadata,
            }
        } else if unlimited {
            DescriptorPlan::Unlimited
        } else {
            DescriptorPlan::None
        });
    }
    plan
}

/// Cuts each enforced rule's `delay` in `plan` to `max_hold()`, how long this request's answer
/// may be held (0 when it may not be: the rule then refuses as one without a delay).
/// `max_hold` is asked once, and only when an enforced rule delays. A shadow-mode rule keeps its
/// own, being evaluated as if enforced, and is never held (see [`finish`]). So do spend recorded
/// and refunds, which are never held: their debt cap keeps the rule's delay, so that they never
/// cut back the slots held requests have claimed.
pub(super) fn cut_delays(plan: &mut Plan<'_>, max_hold: impl FnOnce() -> u64) {
    let delays =
        |op: &Op| op.mode != Mode::Shadow && op.charge == Charge::Ask && op.quota.max_delay() > 0;
    if !plan.ops.iter().any(delays) {
        return;
    }
    let max_hold = max_hold();
    for op in plan.ops.iter_mut().filter(|op| delays(op)) {
        op.quota = op.quota.with_max_delay(op.quota.max_delay().min(max_hold));
    }
}

fn op(key: Key, rate: Rate, cost: u64, desc: &Descriptor, mode: Mode) -> Op {
    Op {
        key,
        quota: rate.quota.with_max_delay(rate.max_delay_nanos),
        cost,
        charge: charge(desc),
        mode,
    }
}

/// How a descriptor charges its counters. A cost of its own above zero reports spend: Envoy
/// sets a descriptor's `hits_addend` only from a route's `hits_addend` (Envoy Gateway's
/// `cost.request` and `cost.response`, AI Gateway's token counts), and sends the one of
/// `apply_on_stream_done` when the work is done, ignoring the answer. Such a charge is recorded
/// even past the limit, or the budget would be free once one response is larger than what is
/// left. A descriptor without a cost of its own (the request's `hits_addend`, or none) asks
/// before the work, and a refused request charges nothing of it.
fn charge(desc: &Descriptor) -> Charge {
    if desc.is_negative_hits {
        Charge::Refund
    } else if desc.hits_addend.is_some_and(|n| n > 0) {
        Charge::Spent
    } else {
        Charge::Ask
    }
}

/// The statuses and overall code of `plan` as decided by `batch`. A descriptor counted on
/// several limits reports the most constrained: one that refuses (denied, not shadow), else
/// one denied in shadow, else the fewest remaining; ties go to the longest wait, then to the
/// first in file order. Global shadow mode (`shadow_mode`) never refuses but keeps each
/// status's OVER_LIMIT.
pub(super) fn finish(plan: &Plan<'_>, batch: &Batch, shadow_mode: bool) -> (Code, Vec<Status>) {
    let statuses = statuses(plan, batch);
    let overall = if batch.blocked && !shadow_mode {
        Code::OverLimit
    } else {
        Code::Ok
    };
    (overall, statuses)
}

/// How long the answer to an admitted request is held: the longest wait for a slot of its
/// charges (several rules on one request wait for the last of their slots). Never for a refused
/// request, a shadow-mode rule, or under global shadow mode; 0 when every charge fits now.
pub(super) fn hold(plan: &Plan<'_>, batch: &Batch, shadow_mode: bool) -> u64 {
    if batch.blocked || shadow_mode {
        return 0;
    }
    plan.ops
        .iter()
        .zip(&batch.outcomes)
        .filter(|(op, o)| op.charge == Charge::Ask && op.mode != Mode::Shadow && o.admitted)
        .map(|(_, o)| o.hold)
        .max()
        .unwrap_or(0)
}

/// One status per descriptor of `plan`, as decided by `batch` (see [`finish`]).
fn statuses(plan: &Plan<'_>, batch: &Batch) -> Vec<Status> {
    plan.descriptors
        .iter()
        .map(|planned| match *planned {
            DescriptorPlan::None => Status::UNMATCHED,
            DescriptorPlan::Unlimited => Status {
                remaining: u32::MAX,
                ..Status::UNMATCHED
            },
            DescriptorPlan::Counted { start, end, .. } => {
                let rank = |i: usize| {
                    let o = &batch.outcomes[i];
                    let shadow = plan.applied[i].rule.is_some_and(|r| r.shadow_mode);
                    (
                        !o.admitted && !shadow,
                        !o.admitted,
                        std::cmp::Reverse(o.remaining),
                        o.wait,
                    )
                };
                let op = (start..end)
                    .reduce(|a, b| if rank(b) > rank(a) { b } else { a })
                    .unwrap_or(start);
                let outcome = batch.outcomes[op];
                let Applied { rate, rule } = plan.applied[op];
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
        .collect()
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
