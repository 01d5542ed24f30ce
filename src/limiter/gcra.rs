//! The GCRA math: a [`Quota`] (emission interval `T`, burst `B`) and the pure functions that
//! decide one request against one theoretical arrival time (TAT).
//!
//! Everything is integer nanoseconds on a monotonic clock that the caller reads; nothing here
//! reads a clock, allocates, locks or fails. "Rate limited" is a value ([`CounterOutcome`]), never
//! an error. `T = ceil(P / R)` is rounded up so that at most `B + floor(W / T)` requests are
//! admitted in any span of `W` nanoseconds, whatever the schedule (`docs/gcra-properties.md`, P2).

/// Nanoseconds in one second.
pub const NANOS_PER_SEC: u64 = 1_000_000_000;

/// The largest tolerance `B·T` a quota may have (about 146 years). Keeping `B·T` and any
/// `TAT` below 2^62 means `max(TAT, now) + cost·T` can never overflow a `u64`.
pub const MAX_TOLERANCE: u64 = 1 << 62;

/// Periods of spend a key may owe past an empty bucket when work already done is recorded
/// ([`record`]): a report of up to this many whole budgets more than is left is recorded whole,
/// and no report, however large, refuses a key for longer than the bucket and this many periods.
pub const DEBT_PERIODS: u64 = 4;

/// A validated rate: `requests` per `period` nanoseconds with a bucket of `burst` requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Quota {
    /// Emission interval `T = ceil(period / requests)` in nanoseconds; 0 for a ban.
    interval: u64,
    /// Bucket capacity `B` (≥ 1); 0 for a ban.
    burst: u64,
    /// `B·T`, the most debt a key may carry, in nanoseconds.
    tolerance: u64,
    /// The configured period, reported as the retry hint of a ban.
    period: u64,
    /// The longest a request that does not fit now may wait for its slot (`delay`), in
    /// nanoseconds; 0 refuses it at once. At most [`MAX_TOLERANCE`].
    max_delay: u64,
}

/// Why a rate cannot be turned into a [`Quota`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    /// The burst is 0, which would deny every request.
    #[error("burst must be at least 1")]
    ZeroBurst,
    /// The period is 0.
    #[error("period must be longer than zero")]
    ZeroPeriod,
    /// `burst × period / requests` exceeds [`MAX_TOLERANCE`].
    #[error("burst × period / requests_per_unit is longer than 146 years")]
    TooLong,
}

impl Quota {
    /// A quota of `requests` per `period` nanoseconds with bucket capacity `burst`.
    /// `requests == 0` gives a ban: every request is denied (the burst is then ignored).
    ///
    /// # Errors
    ///
    /// [`QuotaError`] when the period or burst is zero, or `burst × T` is too long to represent.
    pub fn new(period: u64, requests: u64, burst: u64) -> Result<Self, QuotaError> {
        if period == 0 {
            return Err(QuotaError::ZeroPeriod);
        }
        if requests == 0 {
            return Ok(Self::ban(period));
        }
        if burst == 0 {
            return Err(QuotaError::ZeroBurst);
        }
        let interval = period.div_ceil(requests);
        let tolerance = interval
            .checked_mul(burst)
            .filter(|t| *t <= MAX_TOLERANCE)
            .ok_or(QuotaError::TooLong)?;
        Ok(Self {
            interval,
            burst,
            tolerance,
            period,
            max_delay: 0,
        })
    }

    /// A quota that denies everything (`requests_per_unit: 0`).
    #[must_use]
    pub const fn ban(period: u64) -> Self {
        Self {
            interval: 0,
            burst: 0,
            tolerance: 0,
            period,
            max_delay: 0,
        }
    }

    /// This quota, with a request that does not fit now admitted at its slot when that comes
    /// within `nanos` (cut so that `B·T + max_delay` stays within [`MAX_TOLERANCE`]). A ban
    /// never delays.
    #[must_use]
    pub const fn with_max_delay(mut self, nanos: u64) -> Self {
        if !self.is_ban() {
            let most = MAX_TOLERANCE - self.tolerance;
            self.max_delay = if nanos < most { nanos } else { most };
        }
        self
    }

    /// The longest a request may wait for its slot, in nanoseconds (0: refused at once).
    #[must_use]
    pub const fn max_delay(&self) -> u64 {
        self.max_delay
    }

    /// Whether this quota denies everything.
    #[must_use]
    pub const fn is_ban(&self) -> bool {
        self.burst == 0
    }

    /// Emission interval `T` in nanoseconds (0 for a ban).
    #[must_use]
    pub const fn interval(&self) -> u64 {
        self.interval
    }

    /// Bucket capacity `B` (0 for a ban).
    #[must_use]
    pub const fn burst(&self) -> u64 {
        self.burst
    }

    /// `B·T` in nanoseconds.
    #[must_use]
    pub const fn tolerance(&self) -> u64 {
        self.tolerance
    }

    /// The configured period in nanoseconds.
    #[must_use]
    pub const fn period(&self) -> u64 {
        self.period
    }

    /// This quota's share for one of `n` nodes counting apart: rate/n with burst ceil(B/n), that
    /// is emission interval `T·n` and burst `ceil(B/n)` (at least 1). A ban stays a ban, and
    /// `n` ≤ 1 changes nothing. Where `T·n·ceil(B/n)` would pass [`MAX_TOLERANCE`] (a bucket of
    /// more than 146 years) the burst is cut so that it does not, the rate staying rate/n: a
    /// share is never looser than written. Only an interval `T·n` itself past 146 years is
    /// capped there, with a burst of 1.
    #[must_use]
    pub fn scaled(&self, n: u64) -> Self {
        if self.is_ban() || n <= 1 {
            return *self;
        }
        let interval = self.interval.saturating_mul(n).min(MAX_TOLERANCE);
        let burst = self.burst.div_ceil(n).min(MAX_TOLERANCE / interval).max(1);
        Self {
            interval,
            burst,
            // interval ≤ MAX_TOLERANCE / burst, so this neither overflows nor passes the cap.
            tolerance: interval * burst,
            period: self.period,
            max_delay: self.max_delay,
        }
    }

    /// This quota's part for a holder of `millionths` of its rate (at most 1,000,000) and
    /// `burst` of its tokens: emission interval `ceil(T × 10⁶ / millionths)`, so never faster
    /// than that part, and burst `burst` (at least 1, and cut where `T·B` would pass
    /// [`MAX_TOLERANCE`]). A part of no rate, or of a ban, is a ban.
    #[must_use]
    pub fn portion(&self, millionths: u64, burst: u64) -> Self {
        if self.is_ban() || millionths == 0 {
            return Self::ban(self.period);
        }
        let scaled = u128::from(self.interval) * 1_000_000;
        let interval = u64::try_from(scaled.div_ceil(u128::from(millionths.min(1_000_000))))
            .unwrap_or(u64::MAX)
            .min(MAX_TOLERANCE);
        let burst = burst.min(MAX_TOLERANCE / interval).max(1);
        Self {
            interval,
            burst,
            tolerance: interval * burst,
            period: self.period,
            max_delay: self.max_delay,
        }
    }

    /// Whole requests available at `now` for a key whose TAT is `tat`: `floor((B·T − debt) / T)`.
    #[must_use]
    pub fn remaining(&self, tat: u64, now: u64) -> u64 {
        if self.is_ban() {
            return 0;
        }
        let debt = tat.saturating_sub(now);
        self.tolerance.saturating_sub(debt) / self.interval
    }

    /// The most a key may owe, `TAT − now`: the bucket `B·T`, the slots a delay may claim past
    /// it (`max_delay`), and [`DEBT_PERIODS`] periods of spend recorded past those, never more
    /// than [`MAX_TOLERANCE`] (so `TAT + cost·T` stays in a `u64`). At least `B·T + max_delay`,
    /// so that no admission is ever cut back.
    #[must_use]
    pub const fn debt_cap(&self) -> u64 {
        let cap = (self.tolerance + self.max_delay)
            .saturating_add(DEBT_PERIODS.saturating_mul(self.period));
        // B·T + max_delay ≤ MAX_TOLERANCE for every quota, so the cut never goes below them.
        if cap < MAX_TOLERANCE {
            cap
        } else {
            MAX_TOLERANCE
        }
    }

    /// A TAT that owes no more than [`Quota::debt_cap`]. Normally a no-op; after a reload lowers
    /// the rate it cuts old debt to what the new rule may carry.
    fn clamp(&self, tat: u64, now: u64) -> u64 {
        tat.min(now.saturating_add(self.debt_cap()))
    }
}

/// The result of deciding one request against one key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterOutcome {
    /// Whether the request fits the bucket.
    pub admitted: bool,
    /// The key's TAT after the decision: the new one when admitted, the unchanged one otherwise.
    pub tat: u64,
    /// Whole requests still available after the decision (before it, when denied).
    pub remaining: u64,
    /// Nanoseconds until the bucket is full again (admitted), or until this same request would
    /// be admitted (denied). For a cost above the burst, which can never be admitted, the time
    /// until the bucket is full; for a ban, the period.
    pub wait: u64,
    /// Admitted at a slot still ahead: nanoseconds from the decision until that slot, which the
    /// answer is held for (at most the quota's `max_delay`). 0 when it fits now, or denied.
    pub hold: u64,
}

impl CounterOutcome {
    /// Not admitted, nothing known: the placeholder of an op not decided (yet).
    pub const NONE: Self = Self {
        admitted: false,
        tat: 0,
        remaining: 0,
        wait: 0,
        hold: 0,
    };
}

/// Decides a request of `cost` at `now` for a key whose TAT is `tat` (0 for a new key).
///
/// Admitted iff `max(TAT, now) + cost·T − now ≤ B·T + max_delay`; a denial changes nothing. A
/// cost of 0 is a check that consumes nothing.
///
/// A request admitted past `B·T` is admitted at its slot: the TAT moves now, as for any
/// admission, and [`CounterOutcome::hold`] is `new − now − B·T`, the time until `new − slot` is
/// exactly `B·T`, the instant the same request would fit without a delay. Seen at its slot it
/// is an ordinary admission, so the bound `B + floor(W/T)` holds counting each delayed request
/// at its slot (slots never go backwards: each is `max(now, new − B·T)`, both non-decreasing).
#[must_use]
pub fn decide(quota: &Quota, tat: u64, now: u64, cost: u64) -> CounterOutcome {
    if quota.is_ban() {
        return CounterOutcome {
            admitted: false,
            tat,
            remaining: 0,
            hold: 0,
            wait: quota.period,
        };
    }
    let base = quota.clamp(tat, now).max(now);
    if cost > quota.burst {
        return CounterOutcome {
            admitted: false,
            tat,
            remaining: quota.remaining(base, now),
            hold: 0,
            wait: base - now,
        };
    }
    // cost ≤ B, so cost·T ≤ B·T ≤ 2^62 and base ≤ now + 2^62: no overflow below.
    let new = base + cost * quota.interval;
    let debt = new - now;
    // B·T ≤ 2^62 and max_delay ≤ 2^62: the sum fits.
    if debt <= quota.tolerance + quota.max_delay {
        CounterOutcome {
            admitted: true,
            tat: new,
            remaining: quota.tolerance.saturating_sub(debt) / quota.interval,
            wait: debt,
            hold: debt.saturating_sub(quota.tolerance),
        }
    } else {
        CounterOutcome {
            admitted: false,
            tat,
            remaining: quota.remaining(base, now),
            wait: debt - quota.tolerance,
            hold: 0,
        }
    }
}

/// Records `cost` requests of work already done (spend reported after the work, as Envoy's
/// `apply_on_stream_done` sends it): `TAT = min(max(TAT, now) + cost·T, now + debt cap)`, written
/// whatever the outcome, so a charge that crosses the budget leaves the key in debt, repaid at
/// the rule's rate. `admitted` says whether it fitted the bucket; when it did not, `wait` is the
/// time until the debt is back within the bucket (when a check of cost 0 passes again) and
/// `remaining` is 0. A ban records nothing and refuses.
#[must_use]
pub fn record(quota: &Quota, tat: u64, now: u64, cost: u64) -> CounterOutcome {
    if quota.is_ban() {
        return decide(quota, tat, now, cost);
    }
    let debt = quota
        .clamp(tat, now)
        .max(now)
        .saturating_sub(now)
        .saturating_add(cost.saturating_mul(quota.interval))
        .min(quota.debt_cap());
    // debt ≤ 2^62, and every clock here reads far below 2^62 ns past its epoch.
    let tat = now.saturating_add(debt);
    let admitted = debt <= quota.tolerance;
    CounterOutcome {
        admitted,
        tat,
        remaining: quota.remaining(tat, now),
        wait: if admitted {
            debt
        } else {
            debt - quota.tolerance
        },
        hold: 0,
    }
}

/// Gives `cost` requests back to a key: `TAT = max(now, TAT − cost·T)`. Always admitted.
#[must_use]
pub fn refund(quota: &Quota, tat: u64, now: u64, cost: u64) -> CounterOutcome {
    if quota.is_ban() {
        return decide(quota, tat, now, cost);
    }
    let tat = quota
        .clamp(tat, now)
        .saturating_sub(cost.saturating_mul(quota.interval))
        .max(now);
    CounterOutcome {
        admitted: true,
        tat,
        remaining: quota.remaining(tat, now),
        hold: 0,
        wait: tat - now,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = NANOS_PER_SEC;

    #[test]
    fn interval_is_rounded_up() {
        let q = Quota::new(SEC, 3, 3).unwrap();
        assert_eq!(q.interval(), 333_333_334);
        assert_eq!(q.tolerance(), 1_000_000_002);
    }

    #[test]
    fn rejects_zero_burst_period_and_overflow() {
        assert_eq!(Quota::new(SEC, 1, 0), Err(QuotaError::ZeroBurst));
        assert_eq!(Quota::new(0, 1, 1), Err(QuotaError::ZeroPeriod));
        let year = 365 * 86_400 * SEC;
        assert_eq!(Quota::new(year, 1, 1_000), Err(QuotaError::TooLong));
        assert!(Quota::new(year, u64::from(u32::MAX), u64::from(u32::MAX)).is_ok());
    }

    #[test]
    fn a_portion_is_never_faster_than_its_part() {
        let q = Quota::new(SEC, 200, 200).unwrap(); // T = 5 ms
        let quarter = q.portion(250_000, 50);
        assert_eq!((quarter.interval(), quarter.burst()), (20_000_000, 50));
        let third = q.portion(333_333, 0);
        assert_eq!(third.burst(), 1, "a burst of at least 1");
        assert!(
            third.interval() * 333_333 >= q.interval() * 1_000_000,
            "rounded up"
        );
        assert!(q.portion(0, 10).is_ban(), "no rate is a ban");
        assert!(Quota::ban(SEC).portion(500_000, 10).is_ban());
        assert_eq!(
            q.portion(5_000_000, 200),
            q,
            "more than the whole is the whole"
        );
        let tiny = q.portion(1, u64::MAX);
        assert!(tiny.tolerance() <= MAX_TOLERANCE);
    }

    #[test]
    fn burst_then_paced() {
        let q = Quota::new(60 * SEC, 2, 2).unwrap(); // T = 30 s
        let now = 1_000;
        let a = decide(&q, 0, now, 1);
        assert!(a.admitted);
        assert_eq!((a.remaining, a.wait), (1, 30 * SEC));
        let b = decide(&q, a.tat, now, 1);
        assert!(b.admitted);
        assert_eq!((b.remaining, b.wait), (0, 60 * SEC));
        let c = decide(&q, b.tat, now, 1);
        assert!(!c.admitted);
        assert_eq!((c.remaining, c.wait, c.tat), (0, 30 * SEC, b.tat));
        // Exactly T later one more fits, one nanosecond earlier it does not.
        assert!(!decide(&q, b.tat, now + 30 * SEC - 1, 1).admitted);
        assert!(decide(&q, b.tat, now + 30 * SEC, 1).admitted);
    }

    #[test]
    fn a_delay_admits_at_the_slot_within_it_and_refuses_past_it() {
        // 10 a second, burst 5, a delay of 1 s: T = 100 ms, B·T = 500 ms.
        let ms = SEC / 1_000;
        let q = Quota::new(SEC, 10, 5).unwrap().with_max_delay(SEC);
        let now = 7 * SEC;
        let mut tat = 0;
        let mut holds = Vec::new();
        for _ in 0..16 {
            let o = decide(&q, tat, now, 1);
            if o.admitted {
                tat = o.tat;
            }
            holds.push((o.admitted, o.hold, o.wait));
        }
        for (i, &(admitted, hold, _)) in holds[..15].iter().enumerate() {
            assert!(admitted);
            assert_eq!(hold, (i as u64).saturating_sub(4) * 100 * ms, "request {i}");
        }
        assert_eq!(
            holds[15],
            (false, 0, 1_100 * ms),
            "past the delay: its wait"
        );
        assert_eq!(tat, now + 1_500 * ms, "every slot claimed on the one TAT");
        // A held request reports an empty bucket, full again when its TAT is reached.
        let held = decide(&q, now + 600 * ms, now, 1);
        assert_eq!(
            (held.remaining, held.wait, held.hold),
            (0, 700 * ms, 200 * ms)
        );
        // A ban never delays; the delay is cut where B·T + delay would not fit a u64.
        assert_eq!(Quota::ban(SEC).with_max_delay(SEC).max_delay(), 0);
        assert_eq!(
            q.with_max_delay(u64::MAX).max_delay(),
            MAX_TOLERANCE - q.tolerance()
        );
        // A delay longer than the debt's four periods is never cut back by the cap.
        let long = Quota::new(SEC, 3, 17)
            .unwrap()
            .with_max_delay(14 * q.interval() * 10 / 3);
        assert_eq!(
            long.debt_cap(),
            long.tolerance() + long.max_delay() + 4 * SEC
        );
        assert_eq!(
            q.scaled(2).max_delay(),
            SEC,
            "a node's share keeps the delay"
        );
        assert_eq!(q.portion(500_000, 2).max_delay(), SEC);
    }

    #[test]
    fn cost_above_burst_never_fits_and_changes_nothing() {
        let q = Quota::new(SEC, 5, 5).unwrap();
        let o = decide(&q, 0, 10, 6);
        assert!(!o.admitted);
        assert_eq!((o.tat, o.remaining, o.wait), (0, 5, 0));
        assert!(decide(&q, 0, 10, 5).admitted);
    }

    #[test]
    fn cost_zero_is_a_check() {
        let q = Quota::new(SEC, 5, 5).unwrap();
        let used = decide(&q, 0, 0, 3);
        let check = decide(&q, used.tat, 0, 0);
        assert!(check.admitted);
        assert_eq!((check.tat, check.remaining), (used.tat, 2));
    }

    #[test]
    fn ban_denies_everything() {
        let q = Quota::new(60 * SEC, 0, 1).unwrap();
        assert!(q.is_ban());
        for cost in [0, 1, 100] {
            let o = decide(&q, 0, 5, cost);
            assert!(!o.admitted);
            assert_eq!((o.remaining, o.wait), (0, 60 * SEC));
        }
    }

    #[test]
    fn refund_gives_back_but_never_below_now() {
        let q = Quota::new(10 * SEC, 10, 10).unwrap(); // T = 1 s
        let used = decide(&q, 0, 0, 4);
        let r = refund(&q, used.tat, 0, 1);
        assert_eq!((r.tat, r.remaining), (3 * SEC, 7));
        let r = refund(&q, used.tat, 0, 100);
        assert_eq!((r.tat, r.remaining), (0, 10));
    }

    #[test]
    fn spend_past_the_bucket_is_recorded_as_debt() {
        // 1,000 per minute: T = 60 ms, B·T = 60 s.
        let q = Quota::new(60 * SEC, 1_000, 1_000).unwrap();
        let first = record(&q, 0, 0, 800);
        assert!(first.admitted, "800 fits an empty bucket");
        assert_eq!((first.remaining, first.wait), (200, 48 * SEC));
        assert!(
            decide(&q, first.tat, 0, 0).admitted,
            "a check while 200 are left"
        );
        let second = record(&q, first.tat, 0, 800);
        assert!(!second.admitted, "1,600 does not fit");
        assert_eq!(second.tat, 96 * SEC, "but it is recorded whole");
        assert_eq!((second.remaining, second.wait), (0, 36 * SEC));
        let check = decide(&q, second.tat, 0, 0);
        assert!(!check.admitted, "a check is refused while in debt");
        assert_eq!(
            (check.remaining, check.wait, check.tat),
            (0, 36 * SEC, 96 * SEC)
        );
        // The debt is repaid at the rule's rate, exactly.
        assert!(!decide(&q, second.tat, 36 * SEC - 1, 0).admitted);
        assert!(decide(&q, second.tat, 36 * SEC, 0).admitted);
        let plain = decide(&q, second.tat, 36 * SEC, 1);
        assert!(!plain.admitted, "a request of one needs one more interval");
        assert_eq!(plain.wait, 60_000_000);
    }

    #[test]
    fn debt_is_capped_at_the_bucket_and_four_periods() {
        let q = Quota::new(60 * SEC, 1_000, 1_000).unwrap();
        assert_eq!(q.debt_cap(), 60 * SEC + DEBT_PERIODS * 60 * SEC);
        let huge = record(&q, 0, 7, u64::MAX);
        assert!(!huge.admitted);
        assert_eq!(huge.tat, 7 + q.debt_cap(), "cut at the cap, no wrap");
        assert_eq!(huge.wait, DEBT_PERIODS * 60 * SEC);
        let again = record(&q, huge.tat, 7, u64::MAX);
        assert_eq!(again.tat, huge.tat, "nothing past the cap");
        // Five budgets past an empty bucket is exactly the cap: recorded whole.
        let five = record(&q, 0, 0, 5_000);
        assert_eq!(five.tat, q.debt_cap());
        // A quota whose bucket is already near the ceiling keeps its bucket as its cap.
        let year = 365 * 86_400 * SEC;
        let wide = Quota::new(year, 1_000, 146_000).unwrap();
        assert_eq!(wide.debt_cap(), MAX_TOLERANCE);
        assert!(wide.debt_cap() >= wide.tolerance());
        let o = record(&wide, 0, 1, u64::MAX);
        assert_eq!(o.tat, 1 + MAX_TOLERANCE);
    }

    #[test]
    fn a_ban_records_nothing() {
        let q = Quota::ban(60 * SEC);
        let o = record(&q, 0, 5, 10);
        assert!(!o.admitted);
        assert_eq!((o.tat, o.remaining, o.wait), (0, 0, 60 * SEC));
    }

    #[test]
    fn a_refund_settles_debt() {
        let q = Quota::new(10 * SEC, 10, 10).unwrap(); // T = 1 s
        let owed = record(&q, 0, 0, 15);
        assert_eq!(owed.tat, 15 * SEC);
        let settled = refund(&q, owed.tat, 0, 6);
        assert_eq!((settled.tat, settled.remaining), (9 * SEC, 1));
    }

    #[test]
    fn a_scaled_quota_is_rate_over_n_with_burst_rounded_up() {
        let q = Quota::new(60 * SEC, 100, 10).unwrap(); // T = 0.6 s, B = 10
        let s = q.scaled(3);
        assert_eq!(s.interval(), 3 * 600_000_000, "T·N exactly");
        assert_eq!(s.burst(), 4, "ceil(10 / 3)");
        assert_eq!(s.tolerance(), 4 * 1_800_000_000);
        assert_eq!(s.period(), q.period());
        // An odd interval is multiplied, not recomputed from the period (no second rounding).
        let odd = Quota::new(SEC, 3, 3).unwrap();
        assert_eq!(odd.scaled(2).interval(), 666_666_668);
        assert_eq!(odd.scaled(2).burst(), 2);
        // More nodes than tokens: a burst of 1, never 0.
        assert_eq!(q.scaled(1_000).burst(), 1);
        assert_eq!(q.scaled(1_000).interval(), 600 * SEC);
        // One node, or none known, is the quota itself; a ban stays a ban.
        assert_eq!(q.scaled(1), q);
        assert_eq!(q.scaled(0), q);
        assert!(Quota::new(SEC, 0, 1).unwrap().scaled(4).is_ban());
    }

    #[test]
    fn a_scaled_quota_never_passes_the_tolerance_cap() {
        let year = 365 * 86_400 * SEC;
        let q = Quota::new(146 * year, 1, 1).unwrap();
        let s = q.scaled(u64::MAX);
        assert_eq!(s.burst(), 1);
        assert!(s.tolerance() <= MAX_TOLERANCE);
        assert!(s.interval() >= q.interval());
        // And the math stays in range on it.
        assert!(decide(&s, 0, 1, 1).admitted);
        // A bucket that would pass the cap keeps the rate/n and gives up burst instead.
        // T = 31,536 s, B = 146,235: B·T just under the cap, ceil(B/10)·10·T just over it.
        let wide = Quota::new(year, 1_000, 146_235).unwrap();
        let s = wide.scaled(10);
        assert_eq!(s.interval(), 10 * wide.interval(), "rate/n exactly");
        assert_eq!(s.burst(), 14_623, "ceil(B/10) = 14,624, cut to fit");
        assert!(s.tolerance() <= MAX_TOLERANCE);
    }

    #[test]
    fn a_scaled_quota_admits_its_share_of_the_bound() {
        // rate 1/s, burst 10, four nodes: each admits ceil(10/4) = 3 at once, then one per 4 s.
        let q = Quota::new(SEC, 1, 10).unwrap().scaled(4);
        let (mut tat, mut admitted) = (0, 0);
        let start = 1_000 * SEC;
        for step in 0..=400 {
            let now = start + step * SEC / 10; // 10 asks per second over 40 s
            let o = decide(&q, tat, now, 1);
            if o.admitted {
                tat = o.tat;
                admitted += 1;
            }
        }
        assert_eq!(admitted, 3 + 40 / 4, "ceil(B/N) + floor(W·rate/N)");
    }

    #[test]
    fn lowered_rate_keeps_old_debt_up_to_the_new_cap() {
        let old = Quota::new(60 * SEC, 100, 100).unwrap();
        let exhausted = decide(&old, 0, 0, 100);
        let new = Quota::new(60 * SEC, 10, 10).unwrap(); // T = 6 s, B·T = 60 s
        let o = decide(&new, exhausted.tat, 0, 1);
        assert!(!o.admitted, "no fresh burst");
        assert_eq!(o.wait, 6 * SEC);
        assert!(decide(&new, exhausted.tat, 6 * SEC, 1).admitted);
        // What was spent stays owed under a smaller bucket, up to the new rule's cap.
        let strict = Quota::new(60 * SEC, 10, 1).unwrap(); // B·T = 6 s, cap 246 s
        let o = decide(&strict, exhausted.tat, 0, 1);
        assert_eq!(o.wait, 60 * SEC);
        let far = record(&old, 0, 0, 10_000).tat; // 600 s owed under the old rule's cap
        assert_eq!(far, old.debt_cap());
        assert_eq!(decide(&strict, far, 0, 0).wait, strict.debt_cap() - 6 * SEC);
    }
}
