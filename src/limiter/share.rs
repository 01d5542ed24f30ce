//! Shares of a contended counter, as pure values: the demand a node measures for a counter, the
//! division of a rate among demanders by demand, and the book of the shares this node holds,
//! which degraded local mode counts at while Redis is away. No clock, Redis or runtime:
//! `redis::share` keeps the fleet's share tables, and leasing renews them.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::limiter::gcra::{NANOS_PER_SEC, Quota};
use crate::limiter::key::Key;

/// The most a share may be of what its holder asks for: 1.25 times its demand, so a demand that
/// grows between renewals is not cut at once, and the rest goes to the others.
pub const HEADROOM: f64 = 1.25;

/// The holders' parts of a rate of `capacity` when they ask for `demands` (any unit, the same
/// for all), water-filled: while some holder asks for no more than an equal part of what is left,
/// each such holder gets what it asks, with [`HEADROOM`] (but no more than that equal part), and
/// leaves the game; the holders that remain split what is left in proportion to their demand,
/// each at most [`HEADROOM`] times it. So a small demand is met whole, the large ones share the
/// rest by demand, none holds much more than it asks for, and the parts never add up past
/// `capacity`. A demand that is not a positive number counts as none, and gets nothing.
#[must_use]
pub fn divide(demands: &[f64], capacity: f64) -> Vec<f64> {
    let asked = |d: f64| d.is_finite() && d > 0.0;
    let mut parts = vec![0.0; demands.len()];
    let mut open: Vec<usize> = (0..demands.len()).filter(|&i| asked(demands[i])).collect();
    let mut left = capacity.max(0.0);
    loop {
        // Precision intended: a count of holders as a divisor.
        let level = left / open.len().max(1) as f64;
        let before = open.len();
        open.retain(|&i| {
            if demands[i] > level {
                return true;
            }
            parts[i] = (HEADROOM * demands[i]).min(level);
            left -= parts[i];
            false
        });
        if open.len() == before || open.is_empty() {
            break;
        }
    }
    let total: f64 = open.iter().map(|&i| demands[i]).sum();
    for &i in &open {
        parts[i] = (left.max(0.0) * (demands[i] / total)).min(HEADROOM * demands[i]);
    }
    parts
}

/// The shortest span a first rate is measured over: hits that came all at once count as
/// having come over this long, not as an unbounded rate.
pub const FIRST_SPAN: u64 = NANOS_PER_SEC / 1_000;

/// One counter's demand on this node: hits offered, admitted and refused, since the last
/// renewal, and the rate they came at over the last two renewal periods (so a demand that
/// falls is seen within two renewals, and one period's noise weighs half).
///
/// A demand counted from the hits already seen ([`Demand::counted`]) has its first rate
/// measured over all the time since those hits began, and taken whole: a count of part of a
/// second averaged as if it were a rate would make a node new to a counter ask for a fraction
/// of what it is offered until its second renewal.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Demand {
    /// Hits per second over the period before the current one.
    last: f64,
    /// Hits per second over the last two periods.
    rate: f64,
    /// Hits since `since`.
    hits: u64,
    /// When the current count began (clock nanoseconds).
    since: u64,
    /// Not renewed yet, and no rate known: the first renewal measures it.
    fresh: bool,
}

impl Demand {
    /// A demand first seen at `rate` hits per second, counted from `now`.
    #[must_use]
    pub fn new(rate: f64, now: u64) -> Self {
        Self {
            last: rate,
            rate,
            hits: 0,
            since: now,
            fresh: false,
        }
    }

    /// A demand of `hits` counted since `since`, its rate not known yet: the first renewal
    /// measures it over the real time since `since` (at least [`FIRST_SPAN`]).
    #[must_use]
    pub fn counted(hits: u64, since: u64) -> Self {
        Self {
            last: 0.0,
            rate: 0.0,
            hits,
            since,
            fresh: true,
        }
    }

    /// Counts `n` hits offered.
    pub fn hit(&mut self, n: u64) {
        self.hits = self.hits.saturating_add(n);
    }

    /// Ends the current count at `now`: the rate over it and the period before, in hits per
    /// second.
    pub fn renew(&mut self, now: u64) -> f64 {
        let elapsed = now.saturating_sub(self.since);
        if self.fresh {
            // Precision intended: a rate, not a count.
            let first = self.hits as f64 * NANOS_PER_SEC as f64 / elapsed.max(FIRST_SPAN) as f64;
            self.rate = first;
            self.last = first;
            self.hits = 0;
            self.since = now.max(self.since);
            self.fresh = false;
        } else if elapsed > 0 {
            // Precision intended: a rate, not a count.
            let current = self.hits as f64 * NANOS_PER_SEC as f64 / elapsed as f64;
            self.rate = 0.5 * (self.last + current);
            self.last = current;
            self.hits = 0;
            self.since = now;
        }
        self.rate
    }

    /// The rate as of the last renewal.
    #[must_use]
    pub fn rate(&self) -> f64 {
        self.rate
    }
}

/// What a node was granted of one counter at its last renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    /// The counter's quota, as the rule gives it, without its `delay`.
    pub quota: Quota,
    /// This node's part of it: rate r_i and burst b_i.
    pub share: Quota,
}

/// The shares this node holds, by counter. Leasing records each grant and drops it when the
/// counter is no longer shared; the local fallback counts a shared counter at its share instead
/// of at rate/N, so that the fleet stays within the rate while Redis is away.
#[derive(Debug, Default)]
pub struct ShareBook {
    held: Mutex<HashMap<Key, Grant>>,
}

impl ShareBook {
    /// An empty book.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Grant>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the grant of counter `key`.
    pub fn hold(&self, key: Key, grant: Grant) {
        self.held().insert(key, grant);
    }

    /// Forgets counter `key`'s share.
    pub fn release(&self, key: Key) {
        self.held().remove(&key);
    }

    /// The share held of counter `key` under `quota`: `None` without one, or when the rule
    /// changed since it was granted. A share is granted for the rate; it keeps the `delay` of
    /// `quota`, which is the request's.
    #[must_use]
    pub fn share(&self, key: Key, quota: &Quota) -> Option<Quota> {
        self.held()
            .get(&key)
            .filter(|g| g.quota == quota.with_max_delay(0))
            .map(|g| g.share.with_max_delay(quota.max_delay()))
    }

    /// Keeps only the shares of the counters `keep` says yes to.
    pub fn retain(&self, mut keep: impl FnMut(&Key) -> bool) {
        self.held().retain(|k, _| keep(k));
    }

    /// Shares held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.held().len()
    }

    /// Whether no share is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_follow_demand_and_never_pass_the_capacity() {
        // Over the capacity, each asking more than an equal part: proportional, all of it
        // handed out.
        let parts = divide(&[300.0, 100.0], 100.0);
        assert_eq!(parts, vec![75.0, 25.0]);
        // One asks no more than an equal part: met, the other has the rest.
        let parts = divide(&[300.0, 100.0], 200.0);
        assert_eq!(parts, vec![100.0, 100.0]);
        // Under it: a little more than each asks, the rest undivided.
        let parts = divide(&[40.0, 20.0], 200.0);
        assert_eq!(parts, vec![50.0, 25.0]);
        // A small demand is met whole; the large ones split the rest by demand.
        let parts = divide(&[300.0, 100.0, 20.0], 100.0);
        assert_eq!(parts, vec![56.25, 18.75, 25.0]);
        // Met whole, but no more than an equal part of what is left.
        let parts = divide(&[300.0, 30.0], 100.0);
        assert_eq!(parts, vec![62.5, 37.5]);
        // A holder that asks nothing gets nothing; bad numbers count as nothing.
        assert_eq!(divide(&[0.0, 100.0, f64::NAN], 50.0), vec![0.0, 50.0, 0.0]);
        assert_eq!(divide(&[], 10.0), Vec::<f64>::new());
        for demands in [
            [1.0, 2.0, 3.0],
            [1e9, 1.0, 0.5],
            [7.0, 7.0, 7.0],
            [40.0, 33.0, 30.0],
            [f64::MAX, f64::MIN_POSITIVE, 50.0],
        ] {
            let sum: f64 = divide(&demands, 100.0).iter().sum();
            assert!(sum <= 100.0 + 1e-9, "{demands:?}: {sum}");
        }
    }

    #[test]
    fn demand_is_the_rate_over_the_last_two_renewals() {
        let s = NANOS_PER_SEC;
        let mut d = Demand::new(100.0, 0);
        d.hit(50);
        assert_eq!(d.renew(s / 4), 150.0, "half of 100, half of 200");
        assert_eq!(d.renew(s / 2), 100.0, "half of 200, half of 0");
        assert_eq!(d.renew(s / 2), 100.0, "no time passed: unchanged");
        assert_eq!(
            d.renew(3 * s / 4),
            0.0,
            "a demand that stops is gone in two renewals"
        );
        assert_eq!(d.rate(), 0.0);
    }

    #[test]
    fn a_counted_demand_is_first_measured_over_the_time_since_its_hits_began() {
        let ms = NANOS_PER_SEC / 1_000;
        // 5 hits in the first 5 ms of a node's use of a counter, 2 more in the 2 ms until its
        // first renewal: 1,000 a second, not 5 a second averaged with the 2 ms.
        let mut d = Demand::counted(5, 0);
        d.hit(2);
        assert_eq!(d.renew(7 * ms), 1_000.0);
        // Then as any demand: half of 1,000, half of 200.
        d.hit(50);
        assert_eq!(d.renew(257 * ms), 600.0);
        // Hits that came all at once are a rate over FIRST_SPAN, never an unbounded one.
        let mut burst = Demand::counted(5, 10 * ms);
        assert_eq!(burst.renew(10 * ms), 5_000.0);
        assert!(Demand::counted(0, 0).renew(ms).abs() < f64::EPSILON);
    }

    #[test]
    fn the_book_answers_only_for_the_rule_it_was_granted_under() {
        let q = Quota::new(NANOS_PER_SEC, 200, 200).unwrap();
        let book = ShareBook::new();
        let share = q.portion(500_000, 100);
        book.hold(7, Grant { quota: q, share });
        assert_eq!(book.share(7, &q), Some(share));
        let waits = q.with_max_delay(NANOS_PER_SEC);
        assert_eq!(
            book.share(7, &waits),
            Some(share.with_max_delay(NANOS_PER_SEC)),
            "a request that may wait keeps its wait on the share"
        );
        let reloaded = Quota::new(NANOS_PER_SEC, 100, 100).unwrap();
        assert_eq!(book.share(7, &reloaded), None);
        assert_eq!(book.len(), 1);
        book.release(7);
        assert!(book.is_empty());
    }
}
