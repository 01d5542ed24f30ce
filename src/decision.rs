//! The use case "may this request through?", free of any transport: validate the request, match
//! each descriptor against the policy snapshot, turn the matches into limiter [`Op`]s, and turn
//! the limiter's [`Batch`] into one status per descriptor and an overall code.
//!
//! Split in two ([`Decider::plan`], then [`Decider::finish`]) so the counting in between can be
//! synchronous (memory) or a network round trip (Redis) without this module knowing which.
//!
//! Semantics (`DESIGN.md` §4), decided once here:
//! - cost: the descriptor's `hits_addend` when set (0 = check only), else the request's, where
//!   0 means 1; `is_negative_hits` refunds instead (refunds apply whatever the outcome);
//! - all or nothing: when an enforced descriptor is over, nothing of the request is charged;
//! - `shadow_mode` rules are counted exactly as enforced ones but never refuse and report OK;
//!   `quota_mode` rules refuse only when every quota rule of the request is over; global shadow
//!   mode never refuses but keeps each status's OVER_LIMIT;
//! - `replaces`: a matched rule named in another matched rule's `replaces` is dropped;
//! - a request's `RateLimitOverride` replaces matching when its domain is known.

use crate::limiter::{Batch, Key, KeyBuilder, Mode, Op};
use crate::policy::{Limit, PolicySet, Rate, Rule, Unit};

/// Seed of override counter keys, distinct from any rule identity's role.
const OVERRIDE_SEED: u128 = 0x6f76_6572_7269_6465;

/// A rate-limit request, as decoded from the wire.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    /// The policy domain.
    pub domain: String,
    /// The descriptors, each decided against its own rule.
    pub descriptors: Vec<Descriptor>,
    /// The request-level cost; 0 means 1.
    pub hits_addend: u32,
}

impl Request {
    /// A request of plain descriptors, each from (key, value) entries, at the default cost
    /// (`hits_addend` 0, which counts as 1).
    #[must_use]
    pub fn from_entries(domain: &str, descriptors: &[&[(&str, &str)]]) -> Self {
        Self {
            domain: domain.into(),
            descriptors: descriptors
                .iter()
                .map(|entries| Descriptor {
                    entries: entries
                        .iter()
                        .map(|(k, v)| Entry {
                            key: (*k).into(),
                            value: (*v).into(),
                        })
                        .collect(),
                    ..Descriptor::default()
                })
                .collect(),
            hits_addend: 0,
        }
    }
}

/// One descriptor of a request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// Entries, in order; each matches one level of the policy tree.
    pub entries: Vec<Entry>,
    /// A per-request limit that replaces the configured one.
    pub limit: Option<Override>,
    /// This descriptor's cost, overriding the request's even when 0.
    pub hits_addend: Option<u64>,
    /// Refund the cost instead of charging it.
    pub is_negative_hits: bool,
}

/// One key/value entry of a descriptor.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    /// The key.
    pub key: String,
    /// The value (may be empty).
    pub value: String,
}

/// A request's own limit for one descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Override {
    /// Requests per unit.
    pub requests_per_unit: u32,
    /// The unit.
    pub unit: Unit,
}

/// Caps on request size, so a hostile or broken client cannot make a request expensive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// Most descriptors per request.
    pub max_descriptors: usize,
    /// Most entries per descriptor.
    pub max_entries: usize,
    /// Longest domain, in bytes.
    pub max_domain_bytes: usize,
    /// Longest entry key, in bytes.
    pub max_key_bytes: usize,
    /// Longest entry value, in bytes.
    pub max_value_bytes: usize,
}

impl Default for Caps {
    fn default() -> Self {
        Self {
            max_descriptors: 64,
            max_entries: 32,
            max_domain_bytes: 256,
            max_key_bytes: 256,
            max_value_bytes: 4096,
        }
    }
}

/// Why a request is refused as malformed. Nothing is charged for it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The domain is empty.
    #[error("rate limit domain must not be empty")]
    EmptyDomain,
    /// The domain is longer than allowed.
    #[error("domain is {len} bytes, more than the {max} allowed")]
    DomainTooLong {
        /// Its length.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// There are no descriptors.
    #[error("rate limit descriptor list must not be empty")]
    NoDescriptors,
    /// There are more descriptors than allowed.
    #[error("{len} descriptors, more than the {max} allowed")]
    TooManyDescriptors {
        /// How many.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// A descriptor has no entries.
    #[error("descriptors[{descriptor}] has no entries")]
    NoEntries {
        /// Its index.
        descriptor: usize,
    },
    /// A descriptor has more entries than allowed.
    #[error("descriptors[{descriptor}] has {len} entries, more than the {max} allowed")]
    TooManyEntries {
        /// Its index.
        descriptor: usize,
        /// How many.
        len: usize,
        /// The cap.
        max: usize,
    },
    /// An entry's key is empty.
    #[error("descriptors[{descriptor}].entries[{entry}] has an empty key")]
    EmptyKey {
        /// Descriptor index.
        descriptor: usize,
        /// Entry index.
        entry: usize,
    },
    /// A `RateLimitOverride` names no known unit.
    #[error("descriptors[{descriptor}].limit.unit {value} is not a unit (expected SECOND..YEAR)")]
    UnknownUnit {
        /// Descriptor index.
        descriptor: usize,
        /// The value sent.
        value: i32,
    },
    /// An entry's key or value is longer than allowed.
    #[error(
        "descriptors[{descriptor}].entries[{entry}].{field} is {len} bytes, more than the {max} allowed"
    )]
    TooLong {
        /// Descriptor index.
        descriptor: usize,
        /// Entry index.
        entry: usize,
        /// `key` or `value`.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The cap.
        max: usize,
    },
}

/// The answer for a whole request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response<'p> {
    /// Whether the request may go through.
    pub overall: Code,
    /// One status per request descriptor, in order.
    pub statuses: Vec<Status<'p>>,
    /// Whether the request's domain has policies.
    pub domain_known: bool,
}

/// OK or over the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// Within the limit.
    Ok,
    /// Over the limit.
    OverLimit,
}

/// The answer for one descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status<'p> {
    /// This descriptor's code.
    pub code: Code,
    /// The limit applied; `None` when no rule applied or the rule is unlimited.
    pub limit: Option<AppliedLimit<'p>>,
    /// Requests left (4294967295 for unlimited, 0 when no rule applied).
    pub remaining: u32,
    /// Whole seconds, rounded up: until the bucket is full again when admitted, until this
    /// request would be admitted when over. `None` when no limit applied.
    pub reset_seconds: Option<u64>,
    /// The cost charged or checked (for metrics).
    pub hits: u64,
    /// Whether the limiter found this descriptor over its limit, whatever the code says
    /// (shadow mode reports OK).
    pub denied: bool,
    /// Whether the cost was refunded.
    pub refund: bool,
}

/// The limit a status reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppliedLimit<'p> {
    /// The rate.
    pub rate: Rate,
    /// The rule, or `None` for a request's override.
    pub rule: Option<&'p Rule>,
}

impl AppliedLimit<'_> {
    /// The rule's name, empty when it has none.
    #[must_use]
    pub fn name(&self) -> &str {
        self.rule.and_then(|r| r.name.as_deref()).unwrap_or("")
    }
}

/// What matching found for one descriptor: the rule (if any), and the rate and counter when it
/// is counted.
type Matched<'p> = (Option<&'p Rule>, Option<(Rate, Key)>);

/// What was matched for one descriptor.
#[derive(Clone, Copy, Debug)]
enum Slot<'p> {
    /// No rule applies.
    None,
    /// An unlimited rule.
    Unlimited,
    /// A limited rule (or override), counted by op `op`.
    Counted { limit: AppliedLimit<'p>, op: usize },
}

/// A request matched against policies, ready to count.
#[derive(Debug)]
pub struct Plan<'p> {
    slots: Vec<Slot<'p>>,
    ops: Vec<Op>,
    domain_known: bool,
}

impl Plan<'_> {
    /// The counter operations to decide, all or nothing.
    #[must_use]
    pub fn ops(&self) -> &[Op] {
        &self.ops
    }
}

/// Request validation and the match/aggregate halves of a decision.
#[derive(Clone, Copy, Debug, Default)]
pub struct Decider {
    /// Request size caps.
    pub caps: Caps,
    /// Global shadow mode: never refuse, report as usual.
    pub shadow_mode: bool,
}

impl Decider {
    /// Checks a request against the caps.
    ///
    /// # Errors
    ///
    /// The first [`RequestError`] found.
    pub fn validate(&self, req: &Request) -> Result<(), RequestError> {
        let caps = &self.caps;
        if req.domain.is_empty() {
            return Err(RequestError::EmptyDomain);
        }
        if req.domain.len() > caps.max_domain_bytes {
            return Err(RequestError::DomainTooLong {
                len: req.domain.len(),
                max: caps.max_domain_bytes,
            });
        }
        if req.descriptors.is_empty() {
            return Err(RequestError::NoDescriptors);
        }
        if req.descriptors.len() > caps.max_descriptors {
            return Err(RequestError::TooManyDescriptors {
                len: req.descriptors.len(),
                max: caps.max_descriptors,
            });
        }
        for (d, desc) in req.descriptors.iter().enumerate() {
            if desc.entries.is_empty() {
                return Err(RequestError::NoEntries { descriptor: d });
            }
            if desc.entries.len() > caps.max_entries {
                return Err(RequestError::TooManyEntries {
                    descriptor: d,
                    len: desc.entries.len(),
                    max: caps.max_entries,
                });
            }
            for (e, entry) in desc.entries.iter().enumerate() {
                if entry.key.is_empty() {
                    return Err(RequestError::EmptyKey {
                        descriptor: d,
                        entry: e,
                    });
                }
                for (field, len, max) in [
                    ("key", entry.key.len(), caps.max_key_bytes),
                    ("value", entry.value.len(), caps.max_value_bytes),
                ] {
                    if len > max {
                        return Err(RequestError::TooLong {
                            descriptor: d,
                            entry: e,
                            field,
                            len,
                            max,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Validates `req` and matches it against `policies`.
    ///
    /// # Errors
    ///
    /// [`RequestError`] when the request is malformed.
    pub fn plan<'p>(
        &self,
        req: &Request,
        policies: &'p PolicySet,
    ) -> Result<Plan<'p>, RequestError> {
        self.validate(req)?;
        let domain = policies.domain(&req.domain);
        let mut plan = Plan {
            slots: Vec::with_capacity(req.descriptors.len()),
            ops: Vec::new(),
            domain_known: domain.is_some(),
        };
        let Some(domain) = domain else {
            plan.slots.resize(req.descriptors.len(), Slot::None);
            return Ok(plan);
        };
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
        let request_cost = u64::from(req.hits_addend.max(1));
        for (desc, (rule, counted)) in req.descriptors.iter().zip(&matched) {
            let slot = match (rule, counted) {
                (Some(rule), _) if replaced(rule) => Slot::None,
                (Some(_), None) => Slot::Unlimited,
                (None, None) => Slot::None,
                (rule, Some((rate, key))) => {
                    let mode = match rule {
                        _ if self.shadow_mode => Mode::Shadow,
                        Some(r) if r.shadow_mode => Mode::Shadow,
                        Some(r) if r.quota_mode => Mode::Quota,
                        _ => Mode::Enforce,
                    };
                    plan.ops.push(Op {
                        key: *key,
                        quota: rate.quota,
                        cost: desc.hits_addend.unwrap_or(request_cost),
                        refund: desc.is_negative_hits,
                        mode,
                    });
                    Slot::Counted {
                        limit: AppliedLimit {
                            rate: *rate,
                            rule: *rule,
                        },
                        op: plan.ops.len() - 1,
                    }
                }
            };
            plan.slots.push(slot);
        }
        Ok(plan)
    }

    /// Turns the limiter's decision on `plan`'s ops into the response.
    #[must_use]
    pub fn finish<'p>(&self, plan: &Plan<'p>, batch: &Batch) -> Response<'p> {
        let statuses = plan
            .slots
            .iter()
            .map(|slot| match *slot {
                Slot::None => Status {
                    code: Code::Ok,
                    limit: None,
                    remaining: 0,
                    reset_seconds: None,
                    hits: 0,
                    denied: false,
                    refund: false,
                },
                Slot::Unlimited => Status {
                    code: Code::Ok,
                    limit: None,
                    remaining: u32::MAX,
                    reset_seconds: None,
                    hits: 0,
                    denied: false,
                    refund: false,
                },
                Slot::Counted { limit, op } => {
                    let outcome = batch.outcomes[op];
                    let shadow = limit.rule.is_some_and(|r| r.shadow_mode);
                    Status {
                        hits: plan.ops[op].cost,
                        denied: !outcome.admitted,
                        refund: plan.ops[op].refund,
                        code: if outcome.admitted || shadow {
                            Code::Ok
                        } else {
                            Code::OverLimit
                        },
                        limit: Some(limit),
                        remaining: u32::try_from(outcome.remaining).unwrap_or(u32::MAX),
                        reset_seconds: Some(
                            outcome.wait.div_ceil(crate::limiter::gcra::NANOS_PER_SEC),
                        ),
                    }
                }
            })
            .collect();
        Response {
            overall: if batch.blocked && !self.shadow_mode {
                Code::OverLimit
            } else {
                Code::Ok
            },
            statuses,
            domain_known: plan.domain_known,
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::MemoryStore;
    use crate::policy::load_str;

    fn req(domain: &str, descs: &[&[(&str, &str)]]) -> Request {
        Request::from_entries(domain, descs)
    }

    #[test]
    fn caps_are_enforced() {
        let d = Decider {
            caps: Caps {
                max_descriptors: 1,
                max_entries: 1,
                max_domain_bytes: 3,
                max_key_bytes: 2,
                max_value_bytes: 2,
            },
            shadow_mode: false,
        };
        let set = PolicySet::default();
        let err = |r: Request| d.plan(&r, &set).unwrap_err().to_string();
        assert_eq!(
            err(req("", &[&[("a", "b")]])),
            "rate limit domain must not be empty"
        );
        assert_eq!(
            err(req("abcd", &[&[("a", "b")]])),
            "domain is 4 bytes, more than the 3 allowed"
        );
        assert_eq!(
            err(req("d", &[])),
            "rate limit descriptor list must not be empty"
        );
        assert!(err(req("d", &[&[("a", "b")], &[("a", "b")]])).contains("2 descriptors"));
        assert_eq!(err(req("d", &[&[]])), "descriptors[0] has no entries");
        assert!(err(req("d", &[&[("a", "b"), ("c", "d")]])).contains("2 entries"));
        assert_eq!(
            err(req("d", &[&[("", "b")]])),
            "descriptors[0].entries[0] has an empty key"
        );
        assert_eq!(
            err(req("d", &[&[("a", "bcd")]])),
            "descriptors[0].entries[0].value is 3 bytes, more than the 2 allowed"
        );
    }

    #[test]
    fn replaces_drops_the_named_rule() {
        let set = load_str(&[(
            "p.yaml",
            r"
domain: d
descriptors:
  - key: a
    rate_limit: {name: broad, unit: minute, requests_per_unit: 1}
  - key: b
    rate_limit: {replaces: [{name: broad}], unit: minute, requests_per_unit: 5}
",
        )])
        .unwrap();
        let decider = Decider::default();
        let store = MemoryStore::new();
        let r = req("d", &[&[("a", "x")], &[("b", "y")]]);
        let plan = decider.plan(&r, &set).unwrap();
        assert_eq!(plan.ops().len(), 1);
        let batch = store.check_batch(plan.ops(), 1);
        let resp = decider.finish(&plan, &batch);
        assert_eq!(resp.statuses[0].limit, None);
        assert_eq!(resp.statuses[1].remaining, 4);
    }
}
