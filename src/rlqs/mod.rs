//! Envoy's Rate Limit Quota Service (RLQS), as plain values: a bucket (an unordered map of
//! entries) matched to the rule a descriptor of those entries would match
//! ([`crate::policy::Domain::order`]), the strategy that rule gives, and this node's
//! [`ShareTable`] of the streams watching each limited bucket. No transport, no runtime and no
//! clock: `server::rlqs` reads the wire, keeps the time and pushes the actions.
//!
//! - **holder**: one stream's watched bucket, on the counter of the rule it matches.
//! - **part**: this node's fraction of a rule, told by the fleet table in Redis (the whole rule
//!   without one).
//! - **share**: a holder's piece of the part, divided by demand, never past what the others hold.
//!
//! `Quota` is GCRA's rate and burst ([`crate::limiter::gcra::Quota`]), nothing of this module.

pub mod fleet;
pub mod places;
mod table;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::limiter::gcra::{NANOS_PER_SEC, Quota};
use crate::limiter::share::{self, HEADROOM};
use crate::policy::{Limit, PolicySet};

pub use table::{Refused, RuleDemand, ShareTable, Watcher};

/// A bucket's identity: its entries, ordered by key so that equal maps are equal.
pub type BucketId = BTreeMap<String, String>;

/// The RLQS settings (`rlqs.*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RlqsSettings {
    /// How long an assignment holds (`assignment_time_to_live`); also how long a bucket may go
    /// unreported before it is abandoned.
    pub assignment_ttl: Duration,
    /// Most buckets one stream may watch; a report of one more is answered `abandon_action`.
    pub max_buckets_per_stream: usize,
    /// Most streams open at once on this node; one more is refused `RESOURCE_EXHAUSTED`.
    pub max_streams: usize,
    /// Most streams open at once on one connection, from their headers on; one more is refused
    /// `RESOURCE_EXHAUSTED` (the server counts them: the table does not know connections).
    pub max_streams_per_connection: usize,
    /// Most streams open at once from one peer address, over all its connections, from their
    /// headers on; one more is refused `RESOURCE_EXHAUSTED` (the server counts them).
    pub max_streams_per_peer: usize,
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
    /// `time_elapsed`, in nanoseconds; 0 when the report states none, as Envoy's does for a new
    /// bucket and for spans under a second (it sends whole seconds, truncated).
    pub elapsed_ns: u64,
    /// Requests allowed plus requests denied: what was offered.
    pub requests: u64,
}

impl Report {
    /// Requests offered per second over the span the report states; none when it states no
    /// span (the stream then measures it on its own clock).
    #[must_use]
    pub fn demand(&self) -> Option<f64> {
        // Precision intended: a rate, not a count.
        (self.elapsed_ns > 0)
            .then(|| self.requests as f64 * NANOS_PER_SEC as f64 / self.elapsed_ns as f64)
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

/// A token bucket as Envoy's `envoy.type.v3.TokenBucket` carries it. Envoy reads its rate as
/// `tokens_per_fill` over the fill interval's whole seconds, and fills continuously at that rate
/// up to `max_tokens`: so the interval is always whole seconds, at least one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBucket {
    /// `max_tokens` (at least 1).
    pub max_tokens: u32,
    /// `tokens_per_fill` (at least 1).
    pub tokens_per_fill: u32,
    /// `fill_interval`, in whole seconds (at least 1, at most [`LONGEST_FILL_SECS`]).
    pub fill_interval_secs: u64,
}

/// The fewest tokens per fill the interval is chosen to reach: the share, rounded down to whole
/// tokens over the interval, then loses less than one part in this many.
pub const TOKENS_PER_FILL: u32 = 100;

/// The longest fill interval sent, in seconds: the longest that fits in a `u64` of nanoseconds.
pub const LONGEST_FILL_SECS: u64 = u64::MAX / NANOS_PER_SEC;

impl TokenBucket {
    /// The bucket's rate, in tokens per second, as Envoy reads it.
    #[must_use]
    pub fn rate(&self) -> f64 {
        f64::from(self.tokens_per_fill) / self.fill_interval_secs.max(1) as f64
    }

    /// The bucket that admits at most `rate` per second with a capacity of at most `burst`
    /// (each at least one token): `tokens_per_fill` whole tokens, rounded down, every
    /// `fill_interval` of whole seconds, the fewest seconds over which the rate comes to
    /// [`TOKENS_PER_FILL`] tokens. A rate below one token per [`LONGEST_FILL_SECS`] (a share of
    /// none) is one token per that interval, the least the protocol can say.
    #[must_use]
    pub fn of(rate: f64, burst: f64) -> Self {
        let max_tokens = burst.floor().clamp(1.0, f64::from(u32::MAX)) as u32;
        let rate = if rate > 0.0 { rate } else { 0.0 };
        let secs = (f64::from(TOKENS_PER_FILL) / rate)
            .ceil()
            .clamp(1.0, LONGEST_FILL_SECS as f64) as u64;
        let mut tokens = (rate * secs as f64).floor().min(f64::from(u32::MAX));
        // Rounding of the product may land a token over the share.
        while tokens >= 1.0 && tokens / secs as f64 > rate {
            tokens -= 1.0;
        }
        if tokens < 1.0 {
            return Self {
                max_tokens,
                tokens_per_fill: 1,
                fill_interval_secs: LONGEST_FILL_SECS,
            };
        }
        Self {
            max_tokens,
            tokens_per_fill: tokens as u32,
            fill_interval_secs: secs,
        }
    }

    /// This bucket, to be sent where `sent` is in force, told apart from it by Envoy: Envoy
    /// replaces a token bucket only when `max_tokens`, `tokens_per_fill` or the interval's
    /// `nanos` differ, and the nanos are always 0 here, so a bucket that differs from `sent` in
    /// its seconds alone is sent with both its tokens and its seconds doubled (the same rate),
    /// or else with one token less of capacity.
    #[must_use]
    pub fn told_apart_from(self, sent: &Self) -> Self {
        if self == *sent
            || self.max_tokens != sent.max_tokens
            || self.tokens_per_fill != sent.tokens_per_fill
        {
            return self;
        }
        match (
            self.tokens_per_fill.checked_mul(2),
            self.fill_interval_secs
                .checked_mul(2)
                .filter(|s| *s <= LONGEST_FILL_SECS),
        ) {
            (Some(tokens_per_fill), Some(fill_interval_secs)) => Self {
                tokens_per_fill,
                fill_interval_secs,
                ..self
            },
            _ => Self {
                max_tokens: self.max_tokens.saturating_sub(1).max(1),
                ..self
            },
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
        /// The burst, in requests: the least of the node's rules' (with several limits, the
        /// bucket is held to each).
        burst: f64,
    },
}

impl Target {
    /// The strategy for a stream holding `share` requests per second of the target.
    pub(crate) fn strategy(&self, share: f64) -> Strategy {
        match *self {
            Self::Fixed(s) => s,
            Self::Shared { rate, burst, .. } => {
                Strategy::TokenBucket(TokenBucket::of(share, burst * share / rate))
            }
        }
    }
}

/// What `bucket` of `domain` matches in `set`: the rule an RLS descriptor of the bucket's
/// entries, in the order the domain's tree names their keys, would match. With several limits
/// (`rate_limits`), a token bucket that holds to each of them: a ban if any, else the lowest
/// rate per second (whose counter the bucket's holders divide) with the least burst, since
/// `b + r·W ≤ bᵢ + rᵢ·W` for every rule i and any span W. A cost node's limits are divided by
/// its cost (the bucket counts requests, not tokens). Rules in shadow mode deny nothing, so they
/// are passed over.
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
    let mut least_burst = f64::INFINITY;
    for rule in resolved.rules.iter().filter(|r| !r.shadow_mode) {
        let Limit::Limited(limit) = rule.limit else {
            continue;
        };
        if limit.quota.is_ban() {
            return Target::Fixed(Strategy::DenyAll);
        }
        let rate = f64::from(limit.requests_per_unit) * NANOS_PER_SEC as f64
            / limit.quota.period() as f64
            / cost;
        let burst = (limit.quota.burst() as f64 / cost).max(1.0);
        least_burst = least_burst.min(burst);
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
                burst,
            });
        }
    }
    match best {
        Some(Target::Shared {
            counter,
            quota,
            cost,
            rate,
            ..
        }) => Target::Shared {
            counter,
            quota,
            cost,
            rate,
            burst: least_burst,
        },
        _ => allow,
    }
}

/// The shares of `capacity` (this node's part of a rule of `rate`) among holders asking for
/// `demands`, so that no claim, however large, takes an honest holder's fair part:
///
/// - a claim counts for no more than the whole rule, nor less than [`IDLE_DEMAND`] of it (a
///   claim that is not a number counts as that floor);
/// - each holder is first given its demand with [`HEADROOM`], but no more than the fair part,
///   `capacity` over the number of holders (max-min up to the fair part);
/// - what that leaves goes to the holders that ask for more, water-filled by what they ask above
///   the fair part ([`share::divide`]), each at most [`HEADROOM`] times it.
///
/// So every holder keeps at least its demand or its fair part, whichever is smaller, the shares
/// add up to at most `capacity`, and above the fair part the rest goes by demand. The floor
/// also bounds the work: a pass of the division meets only holders asking no more than an equal
/// part, so past `1 / IDLE_DEMAND` (100) holders it makes one pass, and below it at most that
/// many.
pub(crate) fn shares(demands: Vec<f64>, capacity: f64, rate: f64) -> Vec<f64> {
    let capacity = capacity.max(0.0);
    let demands: Vec<f64> = demands.into_iter().map(|d| claim(d, rate)).collect();
    // Precision intended: a count of holders as a divisor.
    let fair = capacity / demands.len().max(1) as f64;
    let mut parts: Vec<f64> = demands
        .iter()
        .map(|d| (HEADROOM * d).min(fair).max(0.0))
        .collect();
    let left = capacity - parts.iter().sum::<f64>();
    if left > 0.0 {
        let above: Vec<f64> = demands.iter().map(|d| (d - fair).max(0.0)).collect();
        for (part, more) in parts.iter_mut().zip(share::divide(&above, left)) {
            *part += more;
        }
    }
    parts
}

/// A holder's claim of `demand` against a rule of `rate`, as [`shares`] counts it: within
/// [`IDLE_DEMAND`] of the rule and the whole rule.
pub(crate) fn claim(demand: f64, rate: f64) -> f64 {
    demand.max(rate * IDLE_DEMAND).min(rate)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_bucket_is_whole_seconds_and_never_exceeds_its_share_as_envoy_reads_it() {
        for (rate, burst) in [
            (100.0, 100.0),
            (62.5, 62.5),
            (100.0, 10.0),
            (0.5, 1.0),
            (1.5, 90.0),
            (1.25, 1.0),
            (1.9, 1.0),
            (5.0 / 3.0, 3.0),
            (1_000.0 / 60.0, 200.0),
            (1_000.0 / 86_400.0, 10.0),
            (56.25, 56.0),
            (18.75, 18.0),
            (1e-12, 1.0),
            (0.0, 1.0),
            (f64::NAN, 1.0),
            (1e12, 1e12),
        ] {
            let b = TokenBucket::of(rate, burst);
            // Envoy's rate: tokens_per_fill over the interval's whole seconds.
            let envoy = f64::from(b.tokens_per_fill) / b.fill_interval_secs as f64;
            assert_eq!(envoy, b.rate(), "{rate}: {b:?}");
            assert!(
                (1..=LONGEST_FILL_SECS).contains(&b.fill_interval_secs),
                "{b:?}"
            );
            assert!(b.max_tokens >= 1 && b.tokens_per_fill >= 1, "{b:?}");
            if rate * LONGEST_FILL_SECS as f64 >= 1.0 {
                assert!(envoy <= rate, "{rate} {burst}: {b:?}");
                assert!(
                    envoy >= rate.min(f64::from(u32::MAX)) * 0.99,
                    "{rate} {burst}: {b:?}"
                );
            } else {
                assert_eq!(
                    (b.tokens_per_fill, b.fill_interval_secs),
                    (1, LONGEST_FILL_SECS)
                );
            }
        }
        // Exact where the rule's own period makes it so.
        assert_eq!(TokenBucket::of(1_000.0 / 60.0, 200.0).rate(), 100.0 / 6.0);
        assert_eq!(TokenBucket::of(10.0, 10.0).rate(), 10.0);
    }

    #[test]
    fn a_bucket_that_differs_in_its_seconds_alone_is_told_apart() {
        // 0.5/s and 0.25/s with a capacity of one: 100 tokens over 200 s and over 400 s.
        let (a, b) = (TokenBucket::of(0.5, 1.0), TokenBucket::of(0.25, 1.0));
        assert_eq!(
            (a.max_tokens, a.tokens_per_fill),
            (b.max_tokens, b.tokens_per_fill)
        );
        let sent = b.told_apart_from(&a);
        assert_ne!(
            (sent.max_tokens, sent.tokens_per_fill),
            (a.max_tokens, a.tokens_per_fill)
        );
        assert_eq!(sent.rate(), b.rate());
        assert_eq!(a.told_apart_from(&a), a, "the same bucket is sent as it is");
        let other = TokenBucket::of(0.3, 2.0);
        assert_eq!(other.told_apart_from(&a), other, "already told apart");
        // Over any pair of rates and capacities: what is sent differs from what is in force
        // in max_tokens or tokens_per_fill whenever its rate or capacity differ.
        let rates = [
            0.001, 0.0116, 0.25, 0.5, 0.99, 1.0, 1.01, 3.3, 10.0, 16.6, 50.0, 1e4,
        ];
        for &r1 in &rates {
            for &r2 in &rates {
                for (b1, b2) in [(1.0, 1.0), (10.0, 10.0), (5.0, 9.0)] {
                    let held = TokenBucket::of(r1, b1);
                    let next = TokenBucket::of(r2, b2);
                    let sent = next.told_apart_from(&held);
                    assert_eq!(sent.rate(), next.rate());
                    if next.rate() != held.rate() || next.max_tokens != held.max_tokens {
                        assert_ne!(
                            (sent.max_tokens, sent.tokens_per_fill),
                            (held.max_tokens, held.tokens_per_fill),
                            "{held:?} then {next:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_node_with_several_limits_is_held_to_each_in_rate_and_in_burst() {
        let set = crate::policy::load_str(&[(
            "d.yaml",
            "domain: d
descriptors:
  - key: user
    rate_limits:
      - {name: per_second, unit: second, requests_per_unit: 10}
      - {name: per_day, unit: day, requests_per_unit: 1000}
    descriptors:
      - key: route
        value: search
        cost: 2
",
        )])
        .expect("policy");
        let user = |route: Option<&str>| {
            let mut b: BucketId = [("user".to_string(), "a".to_string())].into();
            if let Some(r) = route {
                b.insert("route".into(), r.into());
            }
            b
        };
        for (bucket, cost) in [(user(None), 1.0), (user(Some("search")), 2.0)] {
            let t = target(&set, "d", &bucket);
            let Target::Shared { rate, burst, .. } = t else {
                panic!("{t:?}");
            };
            assert!((rate - 1_000.0 / 86_400.0 / cost).abs() < 1e-12, "{t:?}");
            assert_eq!(burst, 10.0 / cost, "{t:?}");
            for share in [rate, rate / 2.0, rate / 1_000.0] {
                let Strategy::TokenBucket(b) = t.strategy(share) else {
                    panic!("a token bucket");
                };
                assert!(b.rate() <= 10.0 / cost && b.rate() <= rate, "{b:?}");
                assert!(f64::from(b.max_tokens) <= 10.0 / cost, "{b:?}");
            }
        }
    }

    #[test]
    fn a_move_past_ten_percent_is_pushed() {
        let at = |rate| Strategy::TokenBucket(TokenBucket::of(rate, 100.0));
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
        assert_eq!(s[1], s[2], "both claim the whole rule: {s:?}");
        // Small demands met with headroom, the rest by demand above the fair part.
        let s = shares(vec![60.0, 20.0, 5.0], 100.0, 100.0);
        assert!((s[0] - 200.0 / 3.0).abs() < 1e-9, "{s:?}");
        assert_eq!(&s[1..], &[25.0, 6.25]);
    }

    #[test]
    fn a_claim_past_the_rule_leaves_every_holder_its_fair_part() {
        let honest = [30.0, 30.0, 10.0];
        for greedy in [f64::MAX, f64::INFINITY, f64::NAN, 1e300, 100.0] {
            let s = shares(
                vec![greedy, greedy, honest[0], honest[1], honest[2]],
                100.0,
                100.0,
            );
            assert!(s.iter().sum::<f64>() <= 100.0 + 1e-9, "{greedy}: {s:?}");
            for (share, demand) in s[2..].iter().zip(honest) {
                assert!(
                    *share >= demand.min(20.0),
                    "{greedy}: an honest demand of {demand} got {share}: {s:?}"
                );
            }
        }
        // Of a node's part too: the fair part is the part over the holders.
        let s = shares(vec![f64::MAX, 50.0], 40.0, 100.0);
        assert_eq!(s, vec![20.0, 20.0]);
    }
}
