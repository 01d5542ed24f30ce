//! Quota assignments for Envoy's Rate Limit Quota Service (RLQS), as plain values: a bucket (an
//! unordered map of entries) matched to the rule a descriptor of those entries would match
//! ([`crate::policy::Domain::order`]), the strategy that rule gives, and this node's table of the
//! streams watching each limited bucket, whose shares of the rule's rate are divided by reported
//! demand with [`share::divide`]. No transport, no runtime and no clock: `server::quota` reads
//! the wire, keeps the time and pushes the actions. With Redis, this node's part of each rule
//! comes from the fleet's quota table (`server::quota` renews it), and only that part is divided
//! among its streams.

mod table;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::limiter::gcra::{NANOS_PER_SEC, Quota};
use crate::limiter::share;
use crate::policy::{Limit, PolicySet};

pub use table::{QuotaStream, QuotaTable, Refused, RuleDemand};

/// A bucket's identity: its entries, ordered by key so that equal maps are equal.
pub type BucketId = BTreeMap<String, String>;

/// The RLQS settings (`rlqs.*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuotaSettings {
    /// How long an assignment holds (`assignment_time_to_live`); also how long a bucket may go
    /// unreported before it is abandoned.
    pub assignment_ttl: Duration,
    /// Most buckets one stream may watch; a report of one more is answered `abandon_action`.
    pub max_buckets_per_stream: usize,
    /// Most streams open at once on this node; one more is refused `RESOURCE_EXHAUSTED`.
    pub max_streams: usize,
}

/// The part of its share a stream that reports no demand is assumed to ask for, as a fraction
/// of the rule's rate: so an idle or new stream still gets a token bucket (the protocol needs
/// at least one token per fill), and busier streams keep almost all of the rule.
pub const IDLE_DEMAND: f64 = 0.01;

/// How far a stream's share may move before a new assignment is pushed: 10 %.
pub const MOVE_THRESHOLD: f64 = 0.1;

/// One bucket's usage since the stream's last report of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// The bucket.
    pub bucket: BucketId,
    /// `time_elapsed`, in nanoseconds (more than zero).
    pub elapsed_ns: u64,
    /// Requests allowed plus requests denied: what was offered.
    pub requests: u64,
}

impl Report {
    /// Requests offered per second.
    #[must_use]
    pub fn demand(&self) -> f64 {
        // Precision intended: a rate, not a count.
        self.requests as f64 * NANOS_PER_SEC as f64 / self.elapsed_ns.max(1) as f64
    }
}

/// What a bucket is assigned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// `blanket_rule: ALLOW_ALL`.
    AllowAll,
    /// `blanket_rule: DENY_ALL`.
    DenyAll,
    /// A `token_bucket`.
    TokenBucket(TokenBucket),
}

/// A token bucket as Envoy's `envoy.type.v3.TokenBucket` carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBucket {
    /// `max_tokens` (at least 1).
    pub max_tokens: u32,
    /// `tokens_per_fill` (at least 1).
    pub tokens_per_fill: u32,
    /// `fill_interval`, in nanoseconds (at least 1).
    pub fill_interval_ns: u64,
}

impl TokenBucket {
    /// The bucket's rate, in tokens per second.
    #[must_use]
    pub fn rate(&self) -> f64 {
        f64::from(self.tokens_per_fill) * NANOS_PER_SEC as f64 / self.fill_interval_ns as f64
    }

    /// The bucket that admits at most `rate` per second with a capacity of at most `burst`
    /// (each at least one token), refilled once per `period_ns`, or more often when a
    /// period's tokens would not fit in the capacity (Envoy fills at most `max_tokens`).
    #[must_use]
    pub fn of(rate: f64, burst: f64, period_ns: u64) -> Self {
        let max_tokens = burst.floor().clamp(1.0, f64::from(u32::MAX));
        let per_period = rate * period_ns as f64 / NANOS_PER_SEC as f64;
        if per_period < 1.0 {
            // Fewer than one token per period: one token, less often.
            let interval = (NANOS_PER_SEC as f64 / rate.max(f64::MIN_POSITIVE)).ceil();
            return Self {
                max_tokens: max_tokens as u32,
                tokens_per_fill: 1,
                fill_interval_ns: interval.clamp(1.0, u64::MAX as f64) as u64,
            };
        }
        // No more fills than whole tokens in a period, so that each fill is at least one token
        // without rounding the rate up past the share.
        let fills = (per_period / max_tokens)
            .ceil()
            .min(per_period.floor())
            .max(1.0);
        Self {
            max_tokens: max_tokens as u32,
            tokens_per_fill: (per_period / fills).floor().clamp(1.0, f64::from(u32::MAX)) as u32,
            fill_interval_ns: ((period_ns as f64 / fills) as u64).max(1),
        }
    }
}

impl Strategy {
    /// Whether going from `self` to `next` is worth a push: another kind, or a rate moved by
    /// more than [`MOVE_THRESHOLD`].
    #[must_use]
    pub fn moved(&self, next: &Self) -> bool {
        match (self, next) {
            (Self::TokenBucket(a), Self::TokenBucket(b)) => {
                (a.rate() - b.rate()).abs() > MOVE_THRESHOLD * a.rate()
            }
            _ => self != next,
        }
    }
}

/// What the server tells a stream about one bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Action {
    /// The bucket.
    pub bucket: BucketId,
    /// What to do with it.
    pub kind: ActionKind,
}

/// An action's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActionKind {
    /// `quota_assignment_action`, with the settings' TTL.
    Assign(Strategy),
    /// `abandon_action`.
    Abandon,
}

/// What a bucket's rule gives, before any division.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Target {
    /// The same strategy to every stream.
    Fixed(Strategy),
    /// A limited rule, divided among the streams watching its counter.
    Shared {
        /// The counter, as the rule and the bucket's values key it.
        counter: u128,
        /// The rule's quota, in the counter's tokens.
        quota: Quota,
        /// Tokens a request costs (a cost node's cost, else 1).
        cost: f64,
        /// The rule's rate, in requests per second.
        rate: f64,
        /// The rule's burst, in requests.
        burst: f64,
        /// The rule's period, in nanoseconds.
        period_ns: u64,
    },
}

impl Target {
    /// The strategy for a stream holding `share` requests per second of the target.
    pub(crate) fn strategy(&self, share: f64) -> Strategy {
        match *self {
            Self::Fixed(s) => s,
            Self::Shared {
                rate,
                burst,
                period_ns,
                ..
            } => Strategy::TokenBucket(TokenBucket::of(share, burst * share / rate, period_ns)),
        }
    }
}

/// What `bucket` of `domain` matches in `set`: the rule an RLS descriptor of the bucket's
/// entries, in the order the domain's tree names their keys, would match. With several limits
/// (`rate_limits`), the most constrained: a ban if any, else the lowest rate per second. A cost
/// node's limits are divided by its cost (the bucket counts requests, not tokens). Rules in
/// shadow mode deny nothing, so they are passed over.
pub(crate) fn target(set: &PolicySet, domain: &str, bucket: &BucketId) -> Target {
    let allow = Target::Fixed(Strategy::AllowAll);
    let Some(domain) = set.domain(domain) else {
        return allow;
    };
    let entries: Vec<(&str, &str)> = bucket
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let Some(ordered) = domain.order(&entries) else {
        return allow;
    };
    let Some(resolved) = domain.resolve(ordered.iter().copied()) else {
        return allow;
    };
    let cost = resolved.cost.max(1) as f64;
    let mut best: Option<Target> = None;
    for rule in resolved.rules.iter().filter(|r| !r.shadow_mode) {
        let Limit::Limited(limit) = rule.limit else {
            continue;
        };
        if limit.quota.is_ban() {
            return Target::Fixed(Strategy::DenyAll);
        }
        let period_ns = limit.quota.period();
        let rate =
            f64::from(limit.requests_per_unit) * NANOS_PER_SEC as f64 / period_ns as f64 / cost;
        let lower = match best {
            Some(Target::Shared { rate: r, .. }) => rate < r,
            _ => true,
        };
        if lower {
            best = Some(Target::Shared {
                counter: resolved.key(rule),
                quota: limit.quota,
                cost,
                rate,
                burst: (limit.quota.burst() as f64 / cost).max(1.0),
                period_ns,
            });
        }
    }
    best.unwrap_or(allow)
}

/// The shares of `capacity` (this node's part of a rule of `rate`) among holders asking for
/// `demands`: water-filled by demand ([`share::divide`]), a demand below [`IDLE_DEMAND`] of the
/// rule counted as that much. The floor also bounds the work: a pass of the division meets only
/// holders asking no more than an equal part, so past `1 / IDLE_DEMAND` (100) holders it makes
/// one pass, and below it at most that many.
pub(crate) fn shares(mut demands: Vec<f64>, capacity: f64, rate: f64) -> Vec<f64> {
    let floor = rate * IDLE_DEMAND;
    for d in &mut demands {
        *d = d.max(floor);
    }
    share::divide(&demands, capacity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_bucket_never_exceeds_its_share() {
        for (rate, burst, period) in [
            (100.0, 100.0, NANOS_PER_SEC),
            (62.5, 62.5, NANOS_PER_SEC),
            (100.0, 10.0, NANOS_PER_SEC),
            (0.5, 1.0, NANOS_PER_SEC),
            (1.5, 90.0, 60 * NANOS_PER_SEC),
            // A capacity of one token and 1.25 tokens a period: one fill a period, not two.
            (1.25, 1.0, NANOS_PER_SEC),
            (1.9, 1.0, NANOS_PER_SEC),
        ] {
            let b = TokenBucket::of(rate, burst, period);
            assert!(b.rate() <= rate * 1.000_001, "{rate} {burst}: {b:?}");
            assert!(b.rate() >= rate * 0.5, "{rate} {burst}: {b:?}");
            assert!(b.tokens_per_fill <= b.max_tokens.max(1), "{b:?}");
            assert!(b.max_tokens >= 1 && b.tokens_per_fill >= 1);
        }
    }

    #[test]
    fn a_move_past_ten_percent_is_pushed() {
        let at = |rate| Strategy::TokenBucket(TokenBucket::of(rate, 100.0, NANOS_PER_SEC));
        assert!(!at(50.0).moved(&at(54.0)));
        assert!(at(50.0).moved(&at(56.0)));
        assert!(at(50.0).moved(&Strategy::DenyAll));
        assert!(!Strategy::AllowAll.moved(&Strategy::AllowAll));
    }

    #[test]
    fn idle_holders_get_a_little_and_the_rest_goes_by_demand() {
        let s = shares(vec![0.0, 300.0, 100.0], 100.0, 100.0);
        assert!(s.iter().sum::<f64>() <= 100.0 + 1e-9, "{s:?}");
        assert!(
            s[0] > 0.0 && s[0] <= 1.25,
            "a stream idle is met, with headroom: {s:?}"
        );
        assert!((s[1] / s[2] - 3.0).abs() < 1e-9, "{s:?}");
    }
}
