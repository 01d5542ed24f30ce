//! Envoy's Rate Limit Quota Service (RLQS), as plain values: a bucket (an unordered map of
//! entries) matched to the rule a descriptor of those entries would match
//! ([`crate::policy::Domain::order`]), the strategy that rule gives, and this node's
//! [`ShareTable`] of the streams watching each limited bucket; the streams' places per
//! connection and peer ([`places`]); and the fleet's rounds ([`fleet`]), which renew this node's
//! parts through a [`fleet::FleetTable`] by the crate's [`Clock`](crate::limiter::clock::Clock).
//! No transport and no runtime: `server::rlqs` reads the wire, runs the timers and pushes the
//! actions.
//!
//! - **holder**: one stream's watched bucket, on the counter of the rule it matches.
//! - **part**: this node's fraction of a rule, told by the fleet table in Redis (the whole rule
//!   without one).
//! - **share**: a holder's piece of the part, divided by demand, never past what the others hold.
//!
//! `Quota` is GCRA's rate and burst ([`crate::limiter::gcra::Quota`]), nothing of this module.
//!
//! The division is in integers, so that "the buckets in force never add up past the part" is
//! an exact comparison: rates are in billionths of a token per second ([`PER_TOKEN`]), rounded
//! down for what may be given (a rule, a part, a share) and up for what is held (a token
//! bucket in force), and parts are in millionths of the rule, as the fleet tells them.

pub mod fleet;
pub mod key;
pub mod places;
mod table;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::limiter::gcra::{NANOS_PER_SEC, Quota};
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
    /// `RESOURCE_EXHAUSTED` (counted in [`places`]: the table does not know connections).
    pub max_streams_per_connection: usize,
    /// Most streams open at once from one peer address, over all its connections, from their
    /// headers on; one more is refused `RESOURCE_EXHAUSTED` (counted in [`places`]).
    pub max_streams_per_peer: usize,
}

/// How often the quota service's duties run (the fleet's renewals, and a stream's abandons,
/// pushes and renewals when it reports less often): a quarter of the TTL, between 10 ms and
/// 1 s, so that a renewal is never late by more than a quarter of the TTL.
#[must_use]
pub fn tick_interval(ttl: Duration) -> Duration {
    (ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// A rate's unit, per token per second: rates are counted in billionths of a token (or of a
/// request) per second.
pub const PER_TOKEN: u64 = 1_000_000_000;

/// A part's unit, per rule: parts are counted in millionths of the rule, as the fleet table
/// tells them.
pub const PER_RULE: u64 = 1_000_000;

/// A stream that reports no demand is assumed to ask for the rule over this (1 %): so an idle
/// or new stream still gets a token bucket (the protocol needs at least one token per fill),
/// and busier streams keep almost all of the rule.
pub const IDLE_DEMAND_DIVISOR: u64 = 100;

/// A stream's share may move by its own over this (10 %) before a new assignment is pushed.
pub const MOVE_DIVISOR: u64 = 10;

/// `x` with [`HEADROOM`](crate::limiter::share::HEADROOM), 1.25 times it, rounded down.
const fn with_headroom(x: u64) -> u64 {
    x.saturating_add(x / 4)
}

/// `a * b / c`, rounded down, at most `u64::MAX` (`c` of 0 is taken as 1).
pub(crate) fn mul_div(a: u64, b: u64, c: u64) -> u64 {
    let q = u128::from(a) * u128::from(b) / u128::from(c.max(1));
    u64::try_from(q).unwrap_or(u64::MAX)
}

/// One bucket's usage since the stream's last report of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// The bucket's id, as a stream keeps it ([`key`]).
    pub bucket: key::Flat,
    /// `time_elapsed`, in nanoseconds; 0 when the report states none, as Envoy's does for a new
    /// bucket and for spans under a second (it sends whole seconds, truncated).
    pub elapsed_ns: u64,
    /// Requests allowed plus requests denied: what was offered.
    pub requests: u64,
}

impl Report {
    /// Requests offered per second over the span the report states, in [`PER_TOKEN`]ths; none
    /// when it states no span (the stream then measures it on its own clock).
    #[must_use]
    pub fn demand(&self) -> Option<u64> {
        (self.elapsed_ns > 0).then(|| rate_over(self.requests, self.elapsed_ns))
    }
}

/// `requests` over `span_ns` nanoseconds, in [`PER_TOKEN`]ths of a request per second, rounded
/// down and at most `u64::MAX`.
pub(crate) fn rate_over(requests: u64, span_ns: u64) -> u64 {
    let q = u128::from(requests) * u128::from(PER_TOKEN) * u128::from(NANOS_PER_SEC)
        / u128::from(span_ns.max(1));
    u64::try_from(q).unwrap_or(u64::MAX)
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
    /// The least bucket the protocol can say: one token per [`LONGEST_FILL_SECS`], sent for a
    /// share below it (under one token in 584 years), and counted as holding none.
    pub const LEAST: Self = Self {
        max_tokens: 1,
        tokens_per_fill: 1,
        fill_interval_secs: LONGEST_FILL_SECS,
    };

    /// The bucket's rate, in tokens per second, as Envoy reads it.
    #[must_use]
    pub fn rate(&self) -> f64 {
        f64::from(self.tokens_per_fill) / self.fill_interval_secs.max(1) as f64
    }

    /// The bucket's rate times `cost`, in [`PER_TOKEN`]ths, rounded up: what a holder of this
    /// bucket, whose requests cost `cost` tokens, holds of its counter. None for [`Self::LEAST`].
    #[must_use]
    pub fn held(&self, cost: u64) -> u64 {
        if self.tokens_per_fill == Self::LEAST.tokens_per_fill
            && self.fill_interval_secs == Self::LEAST.fill_interval_secs
        {
            return 0;
        }
        let tokens =
            u128::from(self.tokens_per_fill) * u128::from(cost.max(1)) * u128::from(PER_TOKEN);
        let secs = u128::from(self.fill_interval_secs.max(1));
        u64::try_from(tokens.div_ceil(secs)).unwrap_or(u64::MAX)
    }

    /// Whether this bucket's rate is lower than `other`'s, exactly.
    #[must_use]
    pub fn slower_than(&self, other: &Self) -> bool {
        u128::from(self.tokens_per_fill) * u128::from(other.fill_interval_secs)
            < u128::from(other.tokens_per_fill) * u128::from(self.fill_interval_secs)
    }

    /// The bucket that admits at most `rate` requests per second ([`PER_TOKEN`]ths) with a
    /// capacity of `max_tokens` (at least one): `tokens_per_fill` whole tokens, rounded down,
    /// every `fill_interval` of whole seconds, the fewest seconds over which the rate comes to
    /// [`TOKENS_PER_FILL`] tokens. So `tokens_per_fill / fill_interval <= rate` exactly. A rate
    /// below one token per [`LONGEST_FILL_SECS`] is [`Self::LEAST`].
    #[must_use]
    pub fn within(rate: u64, max_tokens: u32) -> Self {
        let max_tokens = max_tokens.max(1);
        if rate == 0 {
            return Self {
                max_tokens,
                ..Self::LEAST
            };
        }
        let fill = u128::from(TOKENS_PER_FILL) * u128::from(PER_TOKEN);
        let secs = u64::try_from(fill.div_ceil(u128::from(rate)))
            .unwrap_or(LONGEST_FILL_SECS)
            .clamp(1, LONGEST_FILL_SECS);
        let tokens = u128::from(rate) * u128::from(secs) / u128::from(PER_TOKEN);
        match u32::try_from(tokens.min(u128::from(u32::MAX))) {
            Ok(tokens) if tokens >= 1 => Self {
                max_tokens,
                tokens_per_fill: tokens,
                fill_interval_secs: secs,
            },
            _ => Self {
                max_tokens,
                ..Self::LEAST
            },
        }
    }

    /// [`Self::within`] a rate and capacity given as real numbers: `rate` requests per second
    /// (rounded down to [`PER_TOKEN`]ths; none when not a positive number) and `burst` tokens.
    #[must_use]
    pub fn of(rate: f64, burst: f64) -> Self {
        let max_tokens = burst.floor().clamp(1.0, f64::from(u32::MAX)) as u32;
        let rate = if rate > 0.0 {
            (rate * PER_TOKEN as f64).floor().min(u64::MAX as f64) as u64
        } else {
            0
        };
        Self::within(rate, max_tokens)
    }

    /// This bucket, to be sent where `in_force` is, told apart from it by Envoy: Envoy replaces
    /// a token bucket only when `max_tokens`, `tokens_per_fill` or the interval's `nanos`
    /// differ, and the nanos are always 0 here, so a bucket that differs from `in_force` in its
    /// seconds alone is sent with both its tokens and its seconds doubled (the same rate),
    /// or else with one token less of capacity.
    #[must_use]
    pub fn told_apart_from(self, in_force: &Self) -> Self {
        if self == *in_force
            || self.max_tokens != in_force.max_tokens
            || self.tokens_per_fill != in_force.tokens_per_fill
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
    /// more than its own over [`MOVE_DIVISOR`], exactly.
    #[must_use]
    pub fn moved(&self, next: &Self) -> bool {
        match (self, next) {
            (Self::TokenBucket(a), Self::TokenBucket(b)) => {
                // a = ta/sa, b = tb/sb: |a - b| > a / 10 over the common denominator sa·sb.
                let ta_sb = u128::from(a.tokens_per_fill) * u128::from(b.fill_interval_secs);
                let tb_sa = u128::from(b.tokens_per_fill) * u128::from(a.fill_interval_secs);
                ta_sb.abs_diff(tb_sa) * u128::from(MOVE_DIVISOR) > ta_sb
            }
            _ => self != next,
        }
    }
}

/// What the server tells a stream about one bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Action {
    /// The bucket's id, as a stream keeps it ([`key`]).
    pub bucket: key::Flat,
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
        cost: u64,
        /// The rule's rate, in the counter's tokens per second ([`PER_TOKEN`]ths).
        rate: u64,
        /// The burst, in the counter's tokens: the least of the node's rules' (with several
        /// limits, the bucket is held to each), at least one request's cost.
        burst: u64,
    },
}

impl Target {
    /// The token bucket of a holder of this (shared) target whose share is `share` of the
    /// counter's tokens per second ([`PER_TOKEN`]ths): its rate at most the share, its capacity
    /// the burst in the same proportion to the rule. A fixed target's strategy as it is.
    pub(crate) fn strategy(&self, share: u64) -> Strategy {
        match *self {
            Self::Fixed(s) => s,
            Self::Shared {
                cost, rate, burst, ..
            } => {
                let max_tokens = u128::from(burst) * u128::from(share)
                    / (u128::from(rate) * u128::from(cost)).max(1);
                Strategy::TokenBucket(TokenBucket::within(
                    share / cost.max(1),
                    u32::try_from(max_tokens).unwrap_or(u32::MAX),
                ))
            }
        }
    }
}

/// What `bucket` of `domain` matches in `set`: the rule an RLS descriptor of the bucket's
/// entries, in the order the domain's tree names their keys, would match. With several limits
/// (`rate_limits`), a token bucket that holds to each of them: a ban if any, else the lowest
/// rate per second (whose counter the bucket's holders divide) with the least burst, since
/// `b + r·W ≤ bᵢ + rᵢ·W` for every rule i and any span W. A cost node's bucket counts requests,
/// each of its cost in tokens. Rules in shadow mode deny nothing, so they are passed over.
#[cfg(test)]
pub(crate) fn target(set: &PolicySet, domain: &str, bucket: &BucketId) -> Target {
    let entries: Vec<(&str, &str)> = bucket
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    target_of(set, domain, &entries)
}

/// [`target`] of a bucket given by its entries.
pub(crate) fn target_of(set: &PolicySet, domain: &str, entries: &[(&str, &str)]) -> Target {
    let allow = Target::Fixed(Strategy::AllowAll);
    let Some(domain) = set.domain(domain) else {
        return allow;
    };
    let Some(ordered) = domain.order(entries) else {
        return allow;
    };
    let Some(resolved) = domain.resolve(ordered.iter().copied()) else {
        return allow;
    };
    let cost = resolved.cost.max(1);
    let mut best: Option<Target> = None;
    let mut least_burst = u64::MAX;
    for rule in resolved.rules.iter().filter(|r| !r.shadow_mode) {
        let Limit::Limited(limit) = rule.limit else {
            continue;
        };
        if limit.quota.is_ban() {
            return Target::Fixed(Strategy::DenyAll);
        }
        let rate = mul_div(
            u64::from(limit.requests_per_unit),
            PER_TOKEN.saturating_mul(NANOS_PER_SEC),
            limit.quota.period(),
        );
        least_burst = least_burst.min(limit.quota.burst().max(cost));
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
                burst: 0,
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

/// The shares of `capacity` (this node's part of a rule) among holders of `claims` ([`claim`]),
/// in the same unit, so that no claim, however large, takes an honest holder's fair part:
///
/// - each holder is first given its claim with [`HEADROOM`](crate::limiter::share::HEADROOM),
///   but no more than the fair part, `capacity` over the number of holders (max-min up to the
///   fair part);
/// - what that leaves goes to the holders that ask for more, water-filled by what they ask above
///   the fair part, each at most 1.25 times it.
///
/// So every holder keeps at least its claim or its fair part, whichever is smaller, the shares
/// add up to at most `capacity` (each is rounded down), and above the fair part the rest goes by
/// claim. The claims' floor bounds the work: a pass of the water-fill meets only holders asking
/// no more than an equal part, so past [`IDLE_DEMAND_DIVISOR`] holders it makes one pass, and
/// below it at most that many.
pub(crate) fn divide(claims: &[u64], capacity: u64) -> Vec<u64> {
    let fair = capacity / u64::try_from(claims.len().max(1)).unwrap_or(u64::MAX);
    let mut shares: Vec<u64> = claims.iter().map(|c| with_headroom(*c).min(fair)).collect();
    let given = shares.iter().map(|s| u128::from(*s)).sum::<u128>();
    let left = u64::try_from(u128::from(capacity).saturating_sub(given)).unwrap_or(0);
    if left > 0 {
        let above: Vec<u64> = claims.iter().map(|c| c.saturating_sub(fair)).collect();
        for (share, more) in shares.iter_mut().zip(water_fill(&above, left)) {
            *share += more;
        }
    }
    shares
}

/// `capacity` water-filled among holders asking for `asks`: while some holder asks for no more
/// than an equal part of what is left, each such holder gets its ask with headroom (but no more
/// than that equal part) and leaves the game; the holders that remain split what is left in
/// proportion to their asks, each at most 1.25 times its ask. Rounded down: the parts never add
/// up past `capacity`. An ask of none gets nothing.
fn water_fill(asks: &[u64], capacity: u64) -> Vec<u64> {
    let mut parts = vec![0; asks.len()];
    let mut open: Vec<usize> = (0..asks.len()).filter(|&i| asks[i] > 0).collect();
    let mut left = capacity;
    loop {
        let level = left / u64::try_from(open.len().max(1)).unwrap_or(u64::MAX);
        let before = open.len();
        open.retain(|&i| {
            if asks[i] > level {
                return true;
            }
            parts[i] = with_headroom(asks[i]).min(level);
            left -= parts[i];
            false
        });
        if open.len() == before || open.is_empty() {
            break;
        }
    }
    let total: u128 = open.iter().map(|&i| u128::from(asks[i])).sum();
    for &i in &open {
        let share = u128::from(left) * u128::from(asks[i]) / total.max(1);
        parts[i] = u64::try_from(share)
            .unwrap_or(u64::MAX)
            .min(with_headroom(asks[i]));
    }
    parts
}

/// A holder's claim of `demand` against a rule of `rate` (any one unit): within the rule over
/// [`IDLE_DEMAND_DIVISOR`] and the whole rule.
pub(crate) fn claim(demand: u64, rate: u64) -> u64 {
    demand.max(rate / IDLE_DEMAND_DIVISOR).min(rate)
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
        // Exact where the rate is whole billionths; else rounded down to them first (1,000 a
        // minute is 16.666666666 a second: 116 tokens every 7 s).
        assert_eq!(TokenBucket::of(62.5, 1.0).rate(), 62.5);
        assert_eq!(TokenBucket::of(1_000.0 / 60.0, 200.0).rate(), 116.0 / 7.0);
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
        for (bucket, cost) in [(user(None), 1), (user(Some("search")), 2)] {
            let t = target(&set, "d", &bucket);
            let Target::Shared {
                rate,
                burst,
                cost: c,
                ..
            } = t
            else {
                panic!("{t:?}");
            };
            // The day's 1,000 tokens, in billionths per second, rounded down; the second's burst.
            assert_eq!(rate, 1_000 * PER_TOKEN / 86_400, "{t:?}");
            assert_eq!((burst, c), (10, cost), "{t:?}");
            for share in [rate, rate / 2, rate / 1_000] {
                let Strategy::TokenBucket(b) = t.strategy(share) else {
                    panic!("a token bucket");
                };
                assert!(b.held(cost) <= share, "{b:?}");
                assert!(u64::from(b.max_tokens) * cost <= 10, "{b:?}");
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

    /// The shares of `capacity` among `demands` against a rule of `rate`, all in whole tokens
    /// per second, as billionths.
    fn shares(demands: &[u64], capacity: u64, rate: u64) -> Vec<u64> {
        let claims: Vec<u64> = demands
            .iter()
            .map(|d| claim(d.saturating_mul(PER_TOKEN), rate * PER_TOKEN))
            .collect();
        divide(&claims, capacity * PER_TOKEN)
    }

    #[test]
    fn idle_holders_get_a_little_and_the_rest_goes_by_demand() {
        let s = shares(&[0, 300, 100], 100, 100);
        assert!(s.iter().sum::<u64>() <= 100 * PER_TOKEN, "{s:?}");
        assert!(
            s[0] > 0 && s[0] <= 5 * PER_TOKEN / 4,
            "a stream idle is met, with headroom: {s:?}"
        );
        assert_eq!(s[1], s[2], "both claim the whole rule: {s:?}");
        // Small demands met with headroom, the rest by demand above the fair part.
        let s = shares(&[60, 20, 5], 100, 100);
        assert_eq!(s[0], 200 * PER_TOKEN / 3, "{s:?}");
        assert_eq!(&s[1..], &[25 * PER_TOKEN, 6_250_000_000]);
    }

    #[test]
    fn a_claim_past_the_rule_leaves_every_holder_its_fair_part() {
        let honest = [30, 30, 10];
        for greedy in [u64::MAX, u64::MAX / PER_TOKEN, 100] {
            let s = shares(&[greedy, greedy, honest[0], honest[1], honest[2]], 100, 100);
            assert!(s.iter().sum::<u64>() <= 100 * PER_TOKEN, "{greedy}: {s:?}");
            for (share, demand) in s[2..].iter().zip(honest) {
                assert!(
                    *share >= demand.min(20) * PER_TOKEN,
                    "{greedy}: an honest demand of {demand} got {share}: {s:?}"
                );
            }
        }
        // Of a node's part too: the fair part is the part over the holders.
        assert_eq!(
            shares(&[u64::MAX, 50], 40, 100),
            vec![20 * PER_TOKEN, 20 * PER_TOKEN]
        );
    }

    #[test]
    fn shares_never_add_up_past_the_capacity_in_integers() {
        use proptest::prelude::*;
        proptest!(|(claims in proptest::collection::vec(0..u64::MAX, 0..40), capacity: u64)| {
            let shares = divide(&claims, capacity);
            prop_assert_eq!(shares.len(), claims.len());
            let sum: u128 = shares.iter().map(|s| u128::from(*s)).sum();
            prop_assert!(sum <= u128::from(capacity));
        });
    }
}
