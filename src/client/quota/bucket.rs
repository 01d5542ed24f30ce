//! One bucket's enforcement as plain values over an injected `now`: the assignment in force
//! (with its token bucket and its expiry), what a check answers from it, and the usage counted
//! since the bucket was last reported. No transport, no runtime and no clock of its own, so the
//! stream task and the unit tests drive it with whatever instants they like.

use std::time::{Duration, Instant};

use super::super::{Answer, FailurePolicy};

/// A token bucket as Envoy's `envoy.type.v3.TokenBucket` describes it: up to `max_tokens`,
/// `tokens_per_fill` more every `fill_interval`; a request takes one token. Read as Envoy reads
/// it: filled continuously at `tokens_per_fill` over the interval's whole seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBucket {
    /// The capacity: the most requests admitted at once after a quiet spell (at least 1).
    pub max_tokens: u32,
    /// Tokens added per `fill_interval` (at least 1).
    pub tokens_per_fill: u32,
    /// How often `tokens_per_fill` are added, as received (at least a second); its fraction of
    /// a second is not counted, as Envoy does not count it.
    pub fill_interval: Duration,
}

impl TokenBucket {
    /// The bucket's rate, in requests per second: `tokens_per_fill` over the interval's whole
    /// seconds, as Envoy reads it.
    #[must_use]
    pub fn rate(&self) -> f64 {
        f64::from(self.tokens_per_fill) / self.whole_seconds() as f64
    }

    /// The interval's whole seconds (at least 1).
    fn whole_seconds(&self) -> u64 {
        self.fill_interval.as_secs().max(1)
    }

    /// Whether Envoy would keep its token bucket of `self` when assigned `other`: it replaces a
    /// token bucket only when `max_tokens`, `tokens_per_fill` or the interval's nanoseconds
    /// differ.
    fn kept_for(&self, other: &Self) -> bool {
        self.max_tokens == other.max_tokens
            && self.tokens_per_fill == other.tokens_per_fill
            && self.fill_interval.subsec_nanos() == other.fill_interval.subsec_nanos()
    }
}

/// What the server assigned to a bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// `blanket_rule: ALLOW_ALL`: every request is allowed.
    AllowAll,
    /// `blanket_rule: DENY_ALL`: every request is refused.
    DenyAll,
    /// A token bucket (also what `requests_per_time_unit` is read as).
    TokenBucket(TokenBucket),
}

/// A bucket's assignment in force, as [`Quota::assignment`](super::Quota::assignment) shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The strategy.
    pub strategy: Strategy,
    /// How long it still holds unless renewed or replaced (`assignment_time_to_live` from its
    /// last renewal).
    pub expires_in: Duration,
}

/// What answers when no assignment is in force; see [`Quota`](super::Quota) for when each
/// applies.
#[derive(Clone, Copy, Debug)]
pub(super) struct Fallbacks {
    /// Before the first assignment of a bucket, while the stream is up.
    pub(super) unassigned: Answer,
    /// After an assignment expired, or while the stream is down.
    pub(super) failure: FailurePolicy,
    /// The wait a `DENY_ALL` refusal reports.
    pub(super) deny_wait: Duration,
}

/// Why a check was answered by a fallback rather than an assignment in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fallback {
    /// No assignment yet, the stream up: the unassigned answer.
    Unassigned,
    /// The assignment's TTL passed: the failure policy.
    Expired,
    /// No assignment, the stream down: the failure policy.
    Down,
    /// Not tracked (the cap, or a bucket that cannot be reported).
    Untracked,
}

impl Fallback {
    /// The metric label.
    pub(super) fn label(self) -> &'static str {
        match self {
            Self::Unassigned => "unassigned",
            Self::Expired => "expired",
            Self::Down => "down",
            Self::Untracked => "untracked",
        }
    }
}

/// The rule in force and its running state.
#[derive(Clone, Debug)]
enum Rule {
    AllowAll,
    DenyAll,
    Tokens {
        spec: TokenBucket,
        /// What the bucket holds at `at`, in parts of a token: one token is the interval's
        /// whole seconds in nanoseconds, so a span of `d` nanoseconds adds exactly `d × tokens_per_fill` (the
        /// bucket fills continuously at its rate, in integers: no drift).
        held: u128,
        at: Instant,
    },
}

impl TokenBucket {
    /// One token, in the parts `Rule::Tokens` counts.
    fn token(&self) -> u128 {
        u128::from(self.whole_seconds()) * 1_000_000_000
    }

    /// A full bucket, in parts.
    fn full(&self) -> u128 {
        u128::from(self.max_tokens) * self.token()
    }
}

impl Rule {
    fn new(strategy: Strategy, now: Instant) -> Self {
        match strategy {
            Strategy::AllowAll => Self::AllowAll,
            Strategy::DenyAll => Self::DenyAll,
            // A new bucket starts full, as Envoy's does.
            Strategy::TokenBucket(spec) => Self::Tokens {
                spec,
                held: spec.full(),
                at: now,
            },
        }
    }

    fn strategy(&self) -> Strategy {
        match self {
            Self::AllowAll => Strategy::AllowAll,
            Self::DenyAll => Strategy::DenyAll,
            Self::Tokens { spec, .. } => Strategy::TokenBucket(*spec),
        }
    }

    /// What the bucket holds at `now` (refilled up to then), in parts; none for a blanket rule.
    fn refill(&mut self, now: Instant) -> u128 {
        let Self::Tokens { spec, held, at } = self else {
            return 0;
        };
        if now > *at {
            let grown = now
                .duration_since(*at)
                .as_nanos()
                .saturating_mul(u128::from(spec.tokens_per_fill));
            *held = held.saturating_add(grown).min(spec.full());
            *at = now;
        }
        *held
    }

    /// Takes one request at `now`: allowed, or refused for `deny_wait` (a ban) or until the next
    /// whole token.
    fn take(&mut self, now: Instant, deny_wait: Duration) -> Answer {
        self.refill(now);
        match self {
            Self::AllowAll => Answer::Allowed,
            Self::DenyAll => Answer::Refused { wait: deny_wait },
            Self::Tokens { spec, held, .. } => {
                let token = spec.token();
                if *held >= token {
                    *held -= token;
                    Answer::Allowed
                } else {
                    let nanos = (token - *held).div_ceil(u128::from(spec.tokens_per_fill.max(1)));
                    Answer::Refused {
                        wait: Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX)),
                    }
                }
            }
        }
    }
}

/// The assignment in force.
#[derive(Clone, Debug)]
struct Live {
    rule: Rule,
    expires: Instant,
}

/// Usage taken for a report: what was counted since `since`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Usage {
    pub(super) allowed: u64,
    pub(super) denied: u64,
    /// Where the reported span began.
    pub(super) since: Instant,
    /// The span, more than zero (the protocol asks for a positive `time_elapsed`).
    pub(super) elapsed: Duration,
    /// Whether the bucket had been reported before this.
    was_reported: bool,
}

/// The shortest `time_elapsed` reported: a bucket reported in the instant it was first checked
/// still reports a positive span.
const SHORTEST_SPAN: Duration = Duration::from_millis(1);

/// One bucket's state, behind its mutex.
#[derive(Clone, Debug)]
pub(super) struct State {
    live: Option<Live>,
    /// Requests allowed and refused since `since`, not yet reported (saturating).
    allowed: u64,
    denied: u64,
    since: Instant,
    /// When it was last checked, to forget idle buckets.
    last_check: Instant,
    /// Whether it was ever reported (a new bucket is reported at once).
    reported: bool,
}

impl State {
    /// A bucket first seen at `now`: no assignment, nothing counted.
    pub(super) fn new(now: Instant) -> Self {
        Self {
            live: None,
            allowed: 0,
            denied: 0,
            since: now,
            last_check: now,
            reported: false,
        }
    }

    /// Answers one request at `now` and counts it; with the fallback that answered, if it was
    /// not an assignment in force. `up` is whether the stream is up (or not yet known to be
    /// down).
    pub(super) fn check(
        &mut self,
        now: Instant,
        up: bool,
        fallbacks: &Fallbacks,
    ) -> (Answer, Option<Fallback>) {
        self.last_check = self.last_check.max(now);
        let (answer, fallback) = match &mut self.live {
            Some(live) if now < live.expires => (live.rule.take(now, fallbacks.deny_wait), None),
            Some(_) => (fallbacks.failure.answer(), Some(Fallback::Expired)),
            None if up => (fallbacks.unassigned, Some(Fallback::Unassigned)),
            None => (fallbacks.failure.answer(), Some(Fallback::Down)),
        };
        if answer.is_allowed() {
            self.allowed = self.allowed.saturating_add(1);
        } else {
            self.denied = self.denied.saturating_add(1);
        }
        (answer, fallback)
    }

    /// Puts `strategy` in force at `now` until `ttl` from now. A token bucket that Envoy would
    /// not tell from the one in force (even an expired one) extends it, as Envoy does: its token
    /// bucket, rate included, is kept and not refilled; so does the same blanket rule. Another
    /// token bucket after a token bucket keeps the tokens left, up to its own capacity; any
    /// other change starts the new rule afresh (a token bucket full).
    pub(super) fn assign(&mut self, strategy: Strategy, ttl: Duration, now: Instant) {
        let expires = now.checked_add(ttl).unwrap_or_else(|| far_future(now));
        let kept = |rule: &Rule| match (rule.strategy(), strategy) {
            (Strategy::TokenBucket(a), Strategy::TokenBucket(b)) => a.kept_for(&b),
            (held, next) => held == next,
        };
        match &mut self.live {
            Some(live) if kept(&live.rule) => live.expires = expires,
            Some(live) => {
                // What is left, as (parts, parts in a token) of the old bucket.
                let left = if let Rule::Tokens { spec, .. } = live.rule {
                    Some((live.rule.refill(now), spec.token()))
                } else {
                    None
                };
                let mut rule = Rule::new(strategy, now);
                if let (Rule::Tokens { spec, held, .. }, Some((parts, token))) = (&mut rule, left) {
                    // The same number of tokens, fractions included (a share pushed again and
                    // again must not lose the part of a token it was filling), in this
                    // bucket's parts.
                    let carried = parts.saturating_mul(spec.token()) / token.max(1);
                    *held = (*held).min(carried);
                }
                *live = Live { rule, expires };
            }
            None => {
                self.live = Some(Live {
                    rule: Rule::new(strategy, now),
                    expires,
                });
            }
        }
    }

    /// The assignment in force at `now`, if any.
    pub(super) fn assignment(&self, now: Instant) -> Option<Assignment> {
        let live = self.live.as_ref().filter(|l| now < l.expires)?;
        Some(Assignment {
            strategy: live.rule.strategy(),
            expires_in: live.expires.duration_since(now),
        })
    }

    /// Whether the bucket is due in a report at `now`: never reported, or its span is at least
    /// `min_span` long (so a bucket just reported is not reported again with nothing counted,
    /// which the server would read as no demand).
    pub(super) fn due(&self, now: Instant, min_span: Duration) -> bool {
        !self.reported || now.saturating_duration_since(self.since) >= min_span
    }

    /// Takes the usage counted since the last report, starting a new span at `now`.
    pub(super) fn take_usage(&mut self, now: Instant) -> Usage {
        let usage = Usage {
            allowed: self.allowed,
            denied: self.denied,
            since: self.since,
            elapsed: now.saturating_duration_since(self.since).max(SHORTEST_SPAN),
            was_reported: self.reported,
        };
        self.allowed = 0;
        self.denied = 0;
        self.since = self.since.max(now);
        self.reported = true;
        usage
    }

    /// Gives back usage taken for a report that was never delivered, so the next report carries
    /// it.
    pub(super) fn give_back(&mut self, usage: Usage) {
        self.allowed = self.allowed.saturating_add(usage.allowed);
        self.denied = self.denied.saturating_add(usage.denied);
        self.since = self.since.min(usage.since);
        self.reported = self.reported && usage.was_reported;
    }

    /// Whether the bucket may be forgotten at `now`: not checked for `idle`, and nothing counted
    /// that was not reported.
    pub(super) fn idle(&self, now: Instant, idle: Duration) -> bool {
        self.allowed == 0
            && self.denied == 0
            && now.saturating_duration_since(self.last_check) >= idle
    }
}

/// An instant far enough ahead to stand for "never" (a century), or `now` where even that does
/// not fit.
fn far_future(now: Instant) -> Instant {
    now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600))
        .unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn fallbacks() -> Fallbacks {
        Fallbacks {
            unassigned: Answer::Allowed,
            failure: FailurePolicy::Closed {
                wait: Duration::from_secs(7),
            },
            deny_wait: Duration::from_secs(1),
        }
    }

    fn tokens(max_tokens: u32, tokens_per_fill: u32, fill_secs: u64) -> Strategy {
        Strategy::TokenBucket(TokenBucket {
            max_tokens,
            tokens_per_fill,
            fill_interval: Duration::from_secs(fill_secs),
        })
    }

    /// One check's answer.
    fn ask(state: &mut State, at: Instant, up: bool) -> Answer {
        state.check(at, up, &fallbacks()).0
    }

    fn admitted(state: &mut State, at: Instant, n: usize) -> usize {
        (0..n).filter(|_| ask(state, at, true).is_allowed()).count()
    }

    #[test]
    fn a_token_bucket_admits_its_capacity_then_its_rate() {
        let t0 = Instant::now();
        let mut s = State::new(t0);
        // 10 at once, then 10 per second.
        s.assign(tokens(10, 10, 1), Duration::from_secs(60), t0);
        assert_eq!(admitted(&mut s, t0, 50), 10);
        assert_eq!(ask(&mut s, t0, true), Answer::Refused { wait: 100 * MS });
        // Over 2.5 s of steady demand: 25 more, never more.
        let mut more = 0;
        for step in 1..=250 {
            more += admitted(&mut s, t0 + 10 * MS * step, 3);
        }
        assert_eq!(more, 25);
        // A quiet spell refills to the capacity, not past it.
        assert_eq!(admitted(&mut s, t0 + Duration::from_secs(30), 50), 10);
    }

    #[test]
    fn a_renewal_extends_without_refilling_and_a_change_keeps_what_is_left() {
        let t0 = Instant::now();
        let mut s = State::new(t0);
        s.assign(tokens(10, 10, 1), Duration::from_secs(2), t0);
        assert_eq!(admitted(&mut s, t0, 8), 8);
        // Renewed with the same bucket: 2 tokens left, not 10; and it holds 2 s from now.
        let t1 = t0 + Duration::from_secs(1) - 100 * MS;
        s.assign(tokens(10, 10, 1), Duration::from_secs(2), t0 + 10 * MS);
        assert_eq!(admitted(&mut s, t0 + 10 * MS, 10), 2);
        assert!(s.assignment(t0 + 2_005 * MS).is_some(), "extended");
        // A smaller bucket: what is left (8.9 tokens by t1), capped at its capacity.
        s.assign(tokens(4, 4, 1), Duration::from_secs(2), t1);
        assert_eq!(admitted(&mut s, t1, 10), 4);
        // A changed strategy of another kind replaces it.
        s.assign(Strategy::DenyAll, Duration::from_secs(2), t1);
        assert_eq!(admitted(&mut s, t1 + Duration::from_secs(1), 3), 0);
        s.assign(tokens(3, 1, 1), Duration::from_secs(2), t1);
        assert_eq!(
            admitted(&mut s, t1 + 10 * MS, 5),
            3,
            "a new bucket starts full"
        );
    }

    #[test]
    fn a_change_keeps_the_part_of_a_token_being_filled() {
        let t0 = Instant::now();
        let mut s = State::new(t0);
        // 10 a second, emptied; half a token by t0 + 50 ms.
        s.assign(tokens(1, 10, 1), Duration::from_secs(60), t0);
        assert_eq!(admitted(&mut s, t0, 2), 1);
        let t1 = t0 + 50 * MS;
        // Now 5 a second: the half token stays, and the other half takes 100 ms.
        s.assign(tokens(1, 5, 1), Duration::from_secs(60), t1);
        assert_eq!(
            ask(&mut s, t1 + 99 * MS, true),
            Answer::Refused { wait: MS }
        );
        assert_eq!(ask(&mut s, t1 + 100 * MS, true), Answer::Allowed);
    }

    #[test]
    fn a_bucket_envoy_would_not_tell_apart_is_kept_as_envoy_keeps_it() {
        let t0 = Instant::now();
        let mut s = State::new(t0);
        // One token a second; emptied.
        s.assign(tokens(1, 1, 1), Duration::from_secs(60), t0);
        assert_eq!(admitted(&mut s, t0, 2), 1);
        // One token per 4 s differs in its seconds alone: Envoy keeps the bucket in force, rate
        // and all, and so does this enforcer.
        s.assign(tokens(1, 1, 4), Duration::from_secs(60), t0);
        assert_eq!(s.assignment(t0).map(|a| a.strategy), Some(tokens(1, 1, 1)));
        assert_eq!(admitted(&mut s, t0 + Duration::from_secs(1), 2), 1);
        // Two tokens per 8 s is told apart: the new rate holds.
        s.assign(
            tokens(1, 2, 8),
            Duration::from_secs(60),
            t0 + Duration::from_secs(1),
        );
        assert_eq!(admitted(&mut s, t0 + Duration::from_secs(4), 2), 0);
        assert_eq!(admitted(&mut s, t0 + Duration::from_secs(5), 2), 1);
    }

    #[test]
    fn without_an_assignment_the_fallbacks_answer_and_an_expired_one_fails_as_stated() {
        let t0 = Instant::now();
        let mut s = State::new(t0);
        let closed = Answer::Refused {
            wait: Duration::from_secs(7),
        };
        assert_eq!(
            s.check(t0, true, &fallbacks()),
            (Answer::Allowed, Some(Fallback::Unassigned))
        );
        assert_eq!(
            s.check(t0, false, &fallbacks()),
            (closed, Some(Fallback::Down))
        );
        s.assign(Strategy::AllowAll, Duration::from_secs(1), t0);
        // Kept while the stream is down, until its TTL.
        assert_eq!(ask(&mut s, t0 + 999 * MS, false), Answer::Allowed);
        assert_eq!(s.assignment(t0 + Duration::from_secs(1)), None);
        assert_eq!(
            s.check(t0 + Duration::from_secs(1), false, &fallbacks()).1,
            Some(Fallback::Expired)
        );
        assert_eq!(ask(&mut s, t0 + Duration::from_secs(1), true), closed);
        s.assign(
            Strategy::DenyAll,
            Duration::from_secs(1),
            t0 + Duration::from_secs(2),
        );
        assert_eq!(
            ask(&mut s, t0 + Duration::from_secs(2), true),
            Answer::Refused {
                wait: Duration::from_secs(1)
            }
        );
    }

    proptest::proptest! {
        /// Over any schedule of checks and renewals of the same strategy, a token bucket admits
        /// at most its capacity plus what it fills over the span, to the request: renewals add
        /// nothing, and the integer parts neither drift nor round up.
        #[test]
        fn a_token_bucket_never_admits_more_than_its_capacity_and_its_fill(
            max_tokens in 1u32..50,
            tokens_per_fill in 1u32..50,
            fill_secs in 1u64..5,
            steps in proptest::collection::vec(
                (0u64..300_000_000, 0usize..6, proptest::bool::ANY),
                1..200,
            ),
        ) {
            let spec = Strategy::TokenBucket(TokenBucket {
                max_tokens,
                tokens_per_fill,
                fill_interval: Duration::from_secs(fill_secs),
            });
            let t0 = Instant::now();
            let mut s = State::new(t0);
            let ttl = Duration::from_secs(3_600);
            s.assign(spec, ttl, t0);
            let (mut t, mut allowed) = (t0, 0u128);
            for (dt, n, renew) in steps {
                t += Duration::from_nanos(dt);
                if renew {
                    s.assign(spec, ttl, t);
                }
                allowed += admitted(&mut s, t, n) as u128;
            }
            let span = t.duration_since(t0).as_nanos();
            let bound = u128::from(max_tokens)
                + span * u128::from(tokens_per_fill) / u128::from(fill_secs * 1_000_000_000);
            proptest::prop_assert!(allowed <= bound, "{allowed} > {bound}");
        }
    }

    #[test]
    fn usage_is_taken_once_and_given_back_whole() {
        let t0 = Instant::now();
        let mut s = State::new(t0);
        s.assign(tokens(2, 1, 1), Duration::from_secs(60), t0);
        admitted(&mut s, t0, 5);
        assert!(s.due(t0, Duration::from_secs(1)), "never reported");
        let u = s.take_usage(t0 + 500 * MS);
        assert_eq!((u.allowed, u.denied, u.elapsed), (2, 3, 500 * MS));
        assert!(!s.due(t0 + 600 * MS, Duration::from_secs(1)));
        admitted(&mut s, t0 + 600 * MS, 1);
        // The report was not delivered: the next one carries both spans' usage.
        s.give_back(u);
        let again = s.take_usage(t0 + Duration::from_secs(2));
        assert_eq!(
            (again.allowed, again.denied, again.elapsed),
            (2, 4, Duration::from_secs(2))
        );
        assert!(!again.was_reported);
        // Reported in the instant it was first seen: a positive span still.
        let mut fresh = State::new(t0);
        assert_eq!(fresh.take_usage(t0).elapsed, SHORTEST_SPAN);
        assert!(fresh.idle(t0 + Duration::from_secs(60), Duration::from_secs(60)));
        ask(&mut fresh, t0, true);
        assert!(!fresh.idle(t0 + Duration::from_secs(60), Duration::from_secs(60)));
    }
}
