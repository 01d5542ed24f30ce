//! One counter's lease on this node, as pure bookkeeping: its slices of tokens, when each token
//! is due on the shared schedule, which are used, and which slices have ended. No lock, clock,
//! Redis or runtime: the leased store holds a lease behind a mutex, reads the time and takes
//! and gives back the tokens.

use std::collections::VecDeque;

use crate::limiter::gcra::Quota;
use crate::limiter::share::Demand;

/// Tokens taken in one call.
#[derive(Debug)]
pub(super) struct Slice {
    pub(super) size: u64,
    pub(super) used: u64,
    /// Local instant the take was sent (no later than Redis charged it).
    pub(super) taken_at: u64,
    /// Local instant its reply came (no earlier than Redis charged it).
    pub(super) received: u64,
    /// `B·T − d` for the debt d the shared bucket had before the take: the slice's i-th token
    /// (from 1) is due at `received + i·T − lead`, when the exact path would have admitted it
    /// (the tokens the bucket held are due at once; those reserved past it, one T apart).
    /// Below 2^53 either way: a debt of a leased counter is, and so is B·T.
    pub(super) lead: i64,
}

impl Slice {
    /// How many of this slice's tokens are due at `now`, for an emission interval `t`.
    /// In 64 bits: every leased decision passes here, and a 128-bit division is dear.
    pub(super) fn due_by(&self, now: u64, t: u64) -> u64 {
        let elapsed = now.saturating_sub(self.received);
        let ahead = if self.lead >= 0 {
            elapsed.saturating_add(self.lead.unsigned_abs())
        } else {
            elapsed.saturating_sub(self.lead.unsigned_abs())
        };
        (ahead / t.max(1)).min(self.size)
    }

    /// Whether every token of the slice is used: it has none to hand out, whatever the time,
    /// until a refund gives some back. Over the rate a lease holds about one slice per take
    /// of the last L, nearly all of them spent: the walks of a decision start
    /// past the spent ones at the front ([`Lease::spent`]) and skip the others without a
    /// division.
    pub(super) fn spent(&self) -> bool {
        self.used >= self.size
    }

    /// The instant its `i`-th token (from 1) is due.
    pub(super) fn due_at(&self, i: u64, t: u64) -> u64 {
        let at = i128::from(self.received) + i128::from(i) * i128::from(t) - i128::from(self.lead);
        u64::try_from(at.max(0)).unwrap_or(u64::MAX)
    }
}

/// A lease of a contended counter holds a share: its tokens come from a renewal every period,
/// sized by this node's part of the rate, instead of from takes as the lease runs low.
#[derive(Debug)]
pub(super) struct Share {
    /// This node's demand for the counter, sent with each renewal.
    pub(super) demand: Demand,
    /// When the next renewal is due (local clock).
    pub(super) next: u64,
    /// This node's part of the rate at the last renewal, in millionths (0 before the first).
    pub(super) millionths: u64,
    /// The counter's debt (ns) Redis last reported, at a renewal or on the exact path. While the
    /// counter is shared the shares take its refill, so the debt does not fall with time: it is
    /// read as it was reported.
    pub(super) debt: u64,
}

/// One counter's lease on this node.
#[derive(Debug)]
pub(super) struct Lease {
    pub(super) quota: Quota,
    /// Oldest first.
    pub(super) slices: VecDeque<Slice>,
    /// Every slice before this index is spent: `consume` moves it on, `unconsume` back to the
    /// oldest slice a refund reached, `expire` with the front.
    pub(super) spent: usize,
    /// Unused tokens of ended slices, not yet given back.
    pub(super) to_return: u64,
    /// Until this local instant the shared bucket has no token (the last take got none).
    pub(super) denied_until: u64,
    /// When the shared bucket is full again, as of this node's last call (a hint for waits).
    pub(super) full_at: u64,
    /// A take is in flight.
    pub(super) taking: bool,
    /// The size of the last slice asked for.
    pub(super) last_ask: u64,
    /// The last take reserved tokens past the bucket: demand is above the rate, so one slice
    /// is kept queued ahead (the next take starts once the lease holds no more than the last
    /// ask), and the lease does not run dry while a take waits for its reply.
    pub(super) ahead: bool,
    /// No take before this instant (after a failed one).
    pub(super) retry_at: u64,
    /// Set while the counter is contended: renewals replace takes.
    pub(super) share: Option<Share>,
}

impl Lease {
    pub(super) fn new(quota: Quota) -> Self {
        Self {
            quota,
            slices: VecDeque::new(),
            spent: 0,
            to_return: 0,
            denied_until: 0,
            full_at: 0,
            taking: false,
            last_ask: 1,
            ahead: false,
            retry_at: 0,
            share: None,
        }
    }

    /// Ends the slices taken `max_age` or more before `now` (all of them for 0).
    pub(super) fn expire(&mut self, now: u64, max_age: u64) {
        while let Some(s) = self.slices.front() {
            if s.taken_at.saturating_add(max_age) > now {
                break;
            }
            self.to_return += s.size - s.used;
            self.slices.pop_front();
            self.spent = self.spent.saturating_sub(1);
        }
    }

    /// Where the slices that may still have a token to hand out begin (oldest first).
    pub(super) fn first_live(&self) -> usize {
        self.spent.min(self.slices.len())
    }

    /// The slices that may still have a token to hand out, oldest first.
    pub(super) fn live(&self) -> std::collections::vec_deque::Iter<'_, Slice> {
        self.slices.range(self.first_live()..)
    }

    /// Tokens held unused, due or not.
    pub(super) fn unused(&self) -> u64 {
        self.live().map(|s| s.size - s.used).sum()
    }

    /// Tokens held unused and due at `now`: what the lease can hand out now.
    pub(super) fn available(&self, now: u64) -> u64 {
        let t = self.quota.interval();
        self.live()
            .filter(|s| !s.spent())
            .map(|s| s.due_by(now, t).saturating_sub(s.used))
            .sum()
    }

    /// The instant by which `n` unused tokens are due (oldest slices first), or `None` when
    /// the lease holds fewer than `n`.
    pub(super) fn due_at(&self, n: u64, now: u64) -> Option<u64> {
        let t = self.quota.interval();
        let mut need = n;
        if need == 0 {
            // Ready at once, as the first slice would answer; `None` without a slice.
            return (!self.slices.is_empty()).then_some(now);
        }
        for s in self.live() {
            if s.spent() {
                // Nothing ready, nothing to come: `need` passes it unchanged.
                continue;
            }
            let due = s.due_by(now, t).max(s.used);
            let ready = due - s.used;
            if need <= ready {
                return Some(now);
            }
            need -= ready;
            if need <= s.size - due {
                return Some(s.due_at(due + need, t).max(now));
            }
            need -= s.size - due;
        }
        None
    }

    pub(super) fn used(&self) -> u64 {
        self.slices.iter().map(|s| s.used).sum()
    }

    /// Uses `n` due tokens, oldest first; the caller checked they are there.
    pub(super) fn consume(&mut self, mut n: u64, now: u64) {
        let t = self.quota.interval();
        if n == 0 {
            return;
        }
        let from = self.first_live();
        for s in self.slices.range_mut(from..).filter(|s| !s.spent()) {
            let k = n.min(s.due_by(now, t).saturating_sub(s.used));
            s.used += k;
            n -= k;
            if n == 0 {
                break;
            }
        }
        while self.slices.get(self.spent).is_some_and(Slice::spent) {
            self.spent += 1;
        }
    }

    /// Gives `n` used tokens back to their slices, newest first; the caller checked they were
    /// used.
    pub(super) fn unconsume(&mut self, mut n: u64) {
        for (i, s) in self.slices.iter_mut().enumerate().rev() {
            if n == 0 {
                break;
            }
            let k = n.min(s.used);
            if k > 0 {
                s.used -= k;
                n -= k;
                self.spent = self.spent.min(i);
            }
        }
    }

    /// The tokens held at or below which the next slice is taken: `fraction` of the last ask,
    /// or all of it while demand is above the rate.
    pub(super) fn low_water(&self, fraction: f64) -> u64 {
        if self.ahead {
            return self.last_ask;
        }
        // Truncation intended: the floor of that fraction of the last slice.
        (self.last_ask as f64 * fraction) as u64
    }

    /// Whether the lease can be dropped: nothing held, nothing in flight, no denial standing,
    /// and no share whose renewal was due more than `max_age` ago (a share with no traffic).
    pub(super) fn idle(&self, now: u64, max_age: u64) -> bool {
        self.slices.is_empty()
            && !self.taking
            && self.to_return == 0
            && self.denied_until <= now
            && self
                .share
                .as_ref()
                .is_none_or(|s| s.next.saturating_add(max_age) <= now)
    }

    /// While a share is held and the lease cannot cover a request of `cost`: the wait to
    /// report, until the next renewal's tokens and at least one interval of the share's rate;
    /// `None` when, at the last reply from Redis, the bucket held `cost` tokens and a quarter of
    /// its burst past what the shares took (demand under the rate: the exact path may admit
    /// it). The quarter keeps the requests that go there few while demand is near the rate.
    pub(super) fn share_wait(&self, cost: u64, now: u64) -> Option<u64> {
        let s = self.share.as_ref()?;
        let t = self.quota.interval();
        let room = cost
            .saturating_add(self.quota.burst() / 4)
            .saturating_mul(t);
        if s.debt.saturating_add(room) <= self.quota.tolerance() {
            return None;
        }
        let share_t = if s.millionths == 0 {
            t
        } else {
            u64::try_from(u128::from(t) * 1_000_000 / u128::from(s.millionths)).unwrap_or(u64::MAX)
        };
        Some(s.next.saturating_sub(now).max(share_t))
    }
}

/// A leased quantity (below 2^53 ns) as a signed one.
pub(super) fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::gcra::NANOS_PER_SEC;

    /// A slice whose tokens were all in the bucket at its take (`lead` of at least size·T).
    fn held(size: u64, taken_at: u64, t: u64) -> Slice {
        Slice {
            size,
            used: 0,
            taken_at,
            received: taken_at,
            lead: signed(size * t),
        }
    }

    /// `available` and `due_at` as walks over every slice, spent ones included.
    fn walked(l: &Lease, n: u64, now: u64) -> (u64, Option<u64>) {
        let t = l.quota.interval();
        let available = l
            .slices
            .iter()
            .map(|s| s.due_by(now, t).saturating_sub(s.used))
            .sum();
        let mut need = n;
        for s in &l.slices {
            let due = s.due_by(now, t).max(s.used);
            let ready = due - s.used;
            if need <= ready {
                return (available, Some(now));
            }
            need -= ready;
            if need <= s.size - due {
                return (available, Some(s.due_at(due + need, t).max(now)));
            }
            need -= s.size - due;
        }
        (available, None)
    }

    proptest::proptest! {
        /// Starting past the spent slices and skipping the others changes no answer:
        /// `available`, `due_at` and `consume` give what walks over every slice give, before
        /// and after tokens are used and refunded, and every slice before the index is spent.
        #[test]
        fn spent_slices_are_skipped_without_changing_an_answer(
            slices in proptest::collection::vec(
                (1u64..20, 0u64..=20, 0u64..2_000, -30_000i64..30_000),
                0..8,
            ),
            now in 0u64..4_000,
            n in 0u64..60,
            refund in 0u64..60,
        ) {
            let q = Quota::new(NANOS_PER_SEC, 10_000, 100).unwrap();
            let t = q.interval();
            let now = now * 1_000;
            let mut l = Lease::new(q);
            for &(size, used, received, lead) in &slices {
                l.slices.push_back(Slice {
                    size,
                    used: used.min(size),
                    taken_at: received * 1_000,
                    received: received * 1_000,
                    lead: lead * 10,
                });
            }
            let (available, due_at) = walked(&l, n, now);
            proptest::prop_assert_eq!((l.available(now), l.due_at(n, now)), (available, due_at));
            // `consume` as a walk over every slice.
            let take = n.min(available);
            let mut expected: Vec<u64> = l.slices.iter().map(|s| s.used).collect();
            let mut left = take;
            for (s, used) in l.slices.iter().zip(expected.iter_mut()) {
                let k = left.min(s.due_by(now, t).saturating_sub(s.used));
                *used += k;
                left -= k;
            }
            l.consume(take, now);
            let used: Vec<u64> = l.slices.iter().map(|s| s.used).collect();
            proptest::prop_assert_eq!(used, expected);
            proptest::prop_assert!(l.slices.iter().take(l.spent).all(Slice::spent));
            proptest::prop_assert_eq!((l.available(now), l.due_at(n, now)), walked(&l, n, now));
            l.unconsume(refund.min(l.used()));
            proptest::prop_assert!(l.slices.iter().take(l.spent).all(Slice::spent));
            proptest::prop_assert_eq!((l.available(now), l.due_at(n, now)), walked(&l, n, now));
            proptest::prop_assert_eq!(
                l.unused(),
                l.slices.iter().map(|s| s.size - s.used).sum::<u64>()
            );
        }
    }

    #[test]
    fn a_lease_uses_oldest_tokens_first_and_ends_slices_at_their_age() {
        let q = Quota::new(NANOS_PER_SEC, 100, 100).unwrap();
        let t = q.interval();
        let mut l = Lease::new(q);
        l.slices.push_back(held(5, 0, t));
        l.slices.push_back(held(5, 10, t));
        l.consume(7, 10);
        assert_eq!((l.slices[0].used, l.slices[1].used), (5, 2));
        l.unconsume(3);
        assert_eq!((l.slices[0].used, l.slices[1].used), (4, 0));
        l.expire(99, 100);
        assert_eq!((l.slices.len(), l.to_return), (2, 0));
        l.expire(100, 100);
        assert_eq!((l.slices.len(), l.to_return, l.available(100)), (1, 1, 5));
        l.expire(100, 0);
        assert_eq!(
            (l.slices.len(), l.to_return),
            (0, 6),
            "an age of 0 ends them all"
        );
    }

    #[test]
    fn reserved_tokens_come_due_one_interval_apart_when_the_exact_path_would_admit_them() {
        // T = 10 ms, B = 10: tolerance 100 ms. A take of 5 on a debt of 80 ms finds two tokens
        // in the bucket (due at once) and reserves three, due 10, 20 and 30 ms later.
        let q = Quota::new(NANOS_PER_SEC, 100, 10).unwrap();
        let (t, ms) = (q.interval(), 1_000_000);
        let mut l = Lease::new(q);
        let at = 1_000 * ms;
        l.slices.push_back(Slice {
            size: 5,
            used: 0,
            taken_at: at - ms,
            received: at,
            lead: signed(q.tolerance()) - signed(80 * ms),
        });
        assert_eq!((l.available(at), l.unused()), (2, 5));
        assert_eq!(l.due_at(2, at), Some(at), "held: now");
        assert_eq!(l.due_at(3, at), Some(at + t), "the first reserved one");
        assert_eq!(l.due_at(5, at), Some(at + 3 * t));
        assert_eq!(l.due_at(6, at), None, "more than the lease holds");
        l.consume(2, at);
        assert_eq!(l.available(at + t - 1), 0, "not a nanosecond early");
        assert_eq!(l.available(at + t), 1);
        l.consume(5, at + t);
        assert_eq!(l.slices[0].used, 3, "only what is due is used");
        assert_eq!(l.due_at(1, at + t), Some(at + 2 * t));
        assert_eq!(l.available(at + 10 * t), 2, "never more than the slice");
    }

    #[test]
    fn a_spent_share_refuses_until_its_renewal_unless_the_bucket_has_room() {
        // 200 a second, burst 200: T = 5 ms, B·T = 1 s.
        let q = Quota::new(NANOS_PER_SEC, 200, 200).unwrap();
        let ms = 1_000_000;
        let mut l = Lease::new(q);
        assert_eq!(l.share_wait(1, 0), None, "no share: the exact path");
        l.share = Some(Share {
            demand: Demand::new(100.0, 0),
            next: 100 * ms,
            millionths: 250_000,
            debt: q.tolerance(),
        });
        // A quarter of the rate: 20 ms a token; the renewal 100 ms away.
        assert_eq!(l.share_wait(1, 0), Some(100 * ms));
        assert_eq!(
            l.share_wait(1, 95 * ms),
            Some(20 * ms),
            "at least one interval of the share"
        );
        // The bucket had room for the request and a quarter of its burst past the shares.
        l.share.as_mut().unwrap().debt = q.tolerance() - 51 * q.interval();
        assert_eq!(l.share_wait(1, 0), None);
        assert_eq!(l.share_wait(2, 0), Some(100 * ms), "not for a cost of 2");
    }

    #[test]
    fn a_share_keeps_its_lease_until_its_traffic_stops() {
        let q = Quota::new(NANOS_PER_SEC, 200, 200).unwrap();
        let mut l = Lease::new(q);
        assert!(l.idle(0, 100));
        l.share = Some(Share {
            demand: Demand::new(100.0, 0),
            next: 50,
            millionths: 0,
            debt: 0,
        });
        assert!(!l.idle(149, 100), "a renewal due less than L ago");
        assert!(l.idle(150, 100));
    }

    #[test]
    fn above_the_rate_one_slice_is_kept_queued_ahead() {
        let q = Quota::new(NANOS_PER_SEC, 100, 10).unwrap();
        let mut l = Lease::new(q);
        l.last_ask = 10;
        assert_eq!(l.low_water(0.5), 5, "half the last ask");
        l.ahead = true;
        assert_eq!(l.low_water(0.5), 10, "the whole last ask");
    }
}
