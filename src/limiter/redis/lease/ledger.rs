//! One counter's lease on this node, as pure bookkeeping: its slices of tokens, when each token
//! is due on the shared schedule, which are used, and which slices have ended; and every change
//! to it — a take's reply, a renewal's, a refund, an age, a rule changed by a reload — as a
//! method, so that each is tested with numbers. No lock, clock, Redis or runtime: the leased
//! store holds a lease behind a mutex, reads the time, sends the calls and counts the figures.

use std::collections::VecDeque;

use crate::limiter::batch::{Charge, Op};
use crate::limiter::gcra::{CounterOutcome, Quota};
use crate::limiter::redis::share::ShareReply;
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
    /// The counter's rate, without the rule's `delay`: what a caller may wait for is the
    /// request's, not the lease's ([`Lease::claim_at`]).
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
            quota: quota.with_max_delay(0),
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

    /// The instant by which all of `n` unused tokens taken as [`Lease::claim`] takes them are
    /// due: `now` when `n` are due now; else every token due now and the first of those not
    /// due yet, oldest slice first, each due when the exact path would have admitted it. `None`
    /// when the lease holds fewer than `n` unused.
    pub(super) fn claim_at(&self, n: u64, now: u64) -> Option<u64> {
        let t = self.quota.interval();
        let Some(mut ahead) = n.checked_sub(self.available(now)).filter(|&a| a > 0) else {
            return Some(now);
        };
        let mut last = now;
        for s in self.live().filter(|s| !s.spent()) {
            let due = s.due_by(now, t).max(s.used);
            let k = ahead.min(s.size - due);
            if k > 0 {
                last = last.max(s.due_at(due + k, t));
                ahead -= k;
            }
            if ahead == 0 {
                return Some(last);
            }
        }
        None
    }

    /// Uses `n` unused tokens, those due at `now` first, then those not due yet, oldest slice
    /// first: a request held until [`Lease::claim_at`] says the last of them is due. The
    /// caller checked that the lease holds `n`.
    pub(super) fn claim(&mut self, n: u64, now: u64) {
        let ready = n.min(self.available(now));
        self.consume(ready, now);
        let mut ahead = n - ready;
        let from = self.first_live();
        for s in self.slices.range_mut(from..) {
            if ahead == 0 {
                break;
            }
            let k = ahead.min(s.size - s.used);
            s.used += k;
            ahead -= k;
        }
        while self.slices.get(self.spent).is_some_and(Slice::spent) {
            self.spent += 1;
        }
    }

    /// Whether some token is used before it is due: claimed by a request held for it. A refund
    /// may then give back such a token ([`Lease::unconsume`] goes newest first), which is not
    /// due now. Every slice is read, spent ones included: a claim may have spent them.
    pub(super) fn claimed_ahead(&self, now: u64) -> bool {
        let t = self.quota.interval();
        self.slices.iter().any(|s| s.used > s.due_by(now, t))
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

    /// While a share is held: how long a request of `cost` would wait for its slot on the
    /// shared TAT, at the debt Redis last reported (which, the shares taking the refill, does
    /// not fall with time). `None` without a share.
    pub(super) fn share_slot(&self, cost: u64) -> Option<u64> {
        let s = self.share.as_ref()?;
        Some(
            s.debt
                .saturating_add(cost.saturating_mul(self.quota.interval()))
                .saturating_sub(self.quota.tolerance()),
        )
    }

    /// Moves the lease to `quota` when the rule changed (a reload): its slices, of the old rate,
    /// end at once and their tokens are to go back. Whether the rule changed.
    pub(super) fn follow_rule(&mut self, quota: Quota, now: u64) -> bool {
        let quota = quota.with_max_delay(0);
        if self.quota == quota {
            return false;
        }
        self.expire(now, 0);
        self.quota = quota;
        true
    }

    /// Ends the slices taken `max_age` or more before `now` (all of them for 0) and hands over
    /// the unused tokens of every ended slice, to be given back to the shared bucket.
    pub(super) fn give_back(&mut self, now: u64, max_age: u64) -> u64 {
        self.expire(now, max_age);
        std::mem::take(&mut self.to_return)
    }

    /// Starts a take of `ask` tokens at `now`, unless one is in flight, the shared bucket is
    /// known empty, or a failed take is being backed off. Whether it started.
    pub(super) fn begin_take(&mut self, ask: u64, now: u64) -> bool {
        if self.taking || now < self.retry_at || now < self.denied_until {
            return false;
        }
        self.taking = true;
        self.last_ask = ask;
        true
    }

    /// Starts the share's renewal at `now` when it is due, unless a call is in flight or a
    /// failed one is being backed off: this node's demand since the last renewal, and the
    /// tokens it holds due now, to send.
    pub(super) fn begin_renewal(&mut self, now: u64) -> Option<(f64, u64)> {
        let share = self.share.as_mut()?;
        if self.taking || now < share.next || now < self.retry_at {
            return None;
        }
        self.taking = true;
        let demand = share.demand.renew(now);
        Some((demand, self.available(now)))
    }

    /// A take of `ask` tokens of a counter of `quota`, sent at `sent`, answered at `received`:
    /// `granted` tokens, the bucket's `debt` after the call, and, when none was granted, the
    /// `wait` until one can be reserved. Whether the counter proved contended (demand above the
    /// rate: the take had to reserve past the bucket, or got less than it asked for even so)
    /// while the lease holds no share: then it should hold one ([`Lease::hold_share`]).
    pub(super) fn taken(
        &mut self,
        quota: Quota,
        ask: u64,
        (granted, debt, wait): (u64, u64, u64),
        (sent, received): (u64, u64),
    ) -> bool {
        self.taking = false;
        self.received(quota, (granted, debt), (sent, received));
        // Dated from when the take was sent: never later than Redis's instant.
        self.denied_until = if granted > 0 {
            0
        } else {
            sent.saturating_add(wait)
        };
        (self.ahead || granted < ask) && self.share.is_none() && self.quota == quota
    }

    /// Holds a share of the counter from `received` on, for a node with `demand`, the bucket's
    /// debt at `debt`: renewals replace takes, the first one at once.
    pub(super) fn hold_share(&mut self, demand: Demand, received: u64, debt: u64) {
        self.share = Some(Share {
            demand,
            next: received,
            millionths: 0,
            debt,
        });
        self.denied_until = 0;
    }

    /// A take failed: no call before `retry_at`.
    pub(super) fn take_failed(&mut self, retry_at: u64) {
        self.taking = false;
        self.retry_at = retry_at;
    }

    /// A renewal failed: the share is dropped, so that the next request meets the failure on
    /// the exact path, and no call goes before `retry_at`.
    pub(super) fn renewal_failed(&mut self, retry_at: u64) {
        self.take_failed(retry_at);
        self.share = None;
    }

    /// A renewal of the share of a counter of `quota`, sent at `sent`, answered at `received`
    /// with `reply`: while the counter is still shared under the same rule, this node's part
    /// and the debt as Redis gave them, the next renewal a `period` after this one was sent;
    /// else the share is dropped and the lease goes back to takes. Then the tokens granted, as
    /// for a take. Whether the share stands.
    pub(super) fn renewed(
        &mut self,
        quota: Quota,
        reply: &ShareReply,
        period: u64,
        (sent, received): (u64, u64),
    ) -> bool {
        self.taking = false;
        let stands = match (reply.shared && self.quota == quota, self.share.as_mut()) {
            (true, Some(share)) => {
                share.next = sent.saturating_add(period);
                share.millionths = reply.millionths;
                share.debt = reply.debt;
                true
            }
            _ => {
                self.share = None;
                false
            }
        };
        self.received(quota, (reply.granted, reply.debt), (sent, received));
        stands
    }

    /// Records what a take or renewal of a counter of `quota`, sent at `sent`, granted: a slice
    /// of `granted` tokens (to go back at once when the rule changed meanwhile), and the
    /// bucket's debt after the call.
    fn received(
        &mut self,
        quota: Quota,
        (granted, debt): (u64, u64),
        (sent, received): (u64, u64),
    ) {
        if self.quota != quota {
            self.to_return += granted;
        } else if granted > 0 {
            let before = debt.saturating_sub(granted.saturating_mul(quota.interval()));
            let slice = Slice {
                size: granted,
                used: 0,
                taken_at: sent,
                received,
                lead: signed(quota.tolerance()) - signed(before),
            };
            self.ahead = slice.due_by(received, quota.interval()) < granted;
            self.slices.push_back(slice);
        }
        self.full_at = sent.saturating_add(debt);
    }

    /// Notes the debt the exact path reported for `op` (answered `out`) when the counter is
    /// shared under the same rule, so that its requests overflow to the exact path only while
    /// the bucket has room.
    pub(super) fn learn_debt(&mut self, op: &Op, out: &CounterOutcome) {
        if self.quota != op.quota.with_max_delay(0) {
            return;
        }
        let Some(share) = self.share.as_mut() else {
            return;
        };
        // Admitted: `wait` is the debt after; refused: the debt plus the cost past B·T, or, for
        // a cost past the burst (never admitted), the debt itself; spend recorded past the
        // bucket: the debt past B·T.
        share.debt = if op.charge == Charge::Spent && !out.admitted {
            out.wait.saturating_add(op.quota.tolerance())
        } else if out.admitted || op.cost > op.quota.burst() {
            out.wait
        } else {
            out.wait
                .saturating_add(op.quota.tolerance())
                .saturating_sub(op.cost.saturating_mul(op.quota.interval()))
        };
    }
}

/// A lease of `quota` whose one slice of 5 was taken on a debt of `B·T − 2T` (80 ms for 100 a
/// second, burst 10) and received at `at`: 2 tokens due at once, 3 reserved, due T, 2T and 3T
/// later. The tests' worked example.
#[cfg(test)]
pub(super) fn reserving(quota: Quota, at: u64) -> Lease {
    let t = quota.interval();
    let mut lease = Lease::new(quota);
    lease.slices.push_back(Slice {
        size: 5,
        used: 0,
        taken_at: at - t / 10,
        received: at,
        lead: signed(2 * t),
    });
    lease
}

/// A leased quantity (below 2^53 ns) as a signed one.
pub(super) fn signed(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::batch::Mode;
    use crate::limiter::gcra::NANOS_PER_SEC;

    const MS: u64 = 1_000_000;

    /// 100 a second, burst 10: T = 10 ms, B·T = 100 ms.
    fn quota() -> Quota {
        Quota::new(NANOS_PER_SEC, 100, 10).unwrap()
    }

    fn share(next: u64, debt: u64) -> Share {
        Share {
            demand: Demand::new(100.0, 0),
            next,
            millionths: 0,
            debt,
        }
    }

    fn reply(granted: u64, debt: u64, millionths: u64, shared: bool) -> ShareReply {
        ShareReply {
            granted,
            debt,
            wait: 0,
            millionths,
            burst: 2,
            demand: 100.0,
            shared,
        }
    }

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

    /// Up to eight slices as (size, used, received in µs, lead in units of 10 ns).
    fn any_slices() -> impl proptest::strategy::Strategy<Value = Vec<(u64, u64, u64, i64)>> {
        proptest::collection::vec((1u64..20, 0u64..=20, 0u64..2_000, -30_000i64..30_000), 0..8)
    }

    /// A lease of 10,000 a second (T = 100 µs), burst 100, holding `slices` ([`any_slices`]).
    fn lease_of(slices: &[(u64, u64, u64, i64)]) -> Lease {
        let mut l = Lease::new(Quota::new(NANOS_PER_SEC, 10_000, 100).unwrap());
        for &(size, used, received, lead) in slices {
            l.slices.push_back(Slice {
                size,
                used: used.min(size),
                taken_at: received * 1_000,
                received: received * 1_000,
                lead: lead * 10,
            });
        }
        l
    }

    proptest::proptest! {
        /// Starting past the spent slices and skipping the others changes no answer:
        /// `available`, `due_at` and `consume` give what walks over every slice give, before
        /// and after tokens are used and refunded, and every slice before the index is spent.
        #[test]
        fn spent_slices_are_skipped_without_changing_an_answer(
            slices in any_slices(),
            now in 0u64..4_000,
            n in 0u64..60,
            refund in 0u64..60,
        ) {
            let mut l = lease_of(&slices);
            let t = l.quota.interval();
            let now = now * 1_000;
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

    proptest::proptest! {
        /// A claim uses exactly the tokens `claim_at` counted: `n` more are used, the last of
        /// them not due now is due at the instant it gave (now when all are due), and it gives
        /// `None` exactly when the lease holds fewer than `n`.
        #[test]
        fn a_claim_uses_the_tokens_claim_at_counted(
            slices in any_slices(),
            now in 0u64..4_000,
            n in 1u64..60,
        ) {
            let mut l = lease_of(&slices);
            let t = l.quota.interval();
            let now = now * 1_000;
            let at = l.claim_at(n, now);
            proptest::prop_assert_eq!(at.is_none(), n > l.unused());
            let Some(at) = at else { return Ok(()) };
            let before: Vec<u64> = l.slices.iter().map(|s| s.used).collect();
            let (used, available) = (l.used(), l.available(now));
            l.claim(n, now);
            proptest::prop_assert_eq!(l.used(), used + n);
            proptest::prop_assert!(l.slices.iter().take(l.spent).all(Slice::spent));
            // The last token claimed that was not due at `now` (a token within `due_by` is due
            // now, even one counted due from a reply dated after `now`).
            let mut last = now;
            for (s, &was) in l.slices.iter().zip(&before) {
                proptest::prop_assert!(s.used <= s.size);
                if s.used > was && s.used > s.due_by(now, t) {
                    last = last.max(s.due_at(s.used, t));
                }
            }
            proptest::prop_assert_eq!(last, at);
            if n <= available {
                proptest::prop_assert_eq!(at, now, "due tokens are never held");
            }
        }
    }

    #[test]
    fn a_claim_holds_for_reserved_tokens_one_interval_apart() {
        // T = 10 ms, B = 10: a take of 5 on a debt of 80 ms holds 2 tokens due now and 3
        // reserved, due 10, 20 and 30 ms later.
        let q = quota();
        let t = q.interval();
        let at = 1_000 * MS;
        let mut l = reserving(q.with_max_delay(500 * MS), at);
        assert_eq!(l.quota, q, "a lease is of the rate alone");
        assert_eq!(l.claim_at(2, at), Some(at), "due now: not held");
        assert_eq!(l.claim_at(4, at), Some(at + 2 * t));
        assert_eq!(l.claim_at(6, at), None, "more than the lease holds");
        l.claim(3, at);
        assert_eq!((l.slices[0].used, l.available(at + t)), (3, 0));
        assert_eq!(
            l.claim_at(1, at),
            Some(at + 2 * t),
            "the next slot is after the claimed one"
        );
        assert!(
            !l.follow_rule(q.with_max_delay(MS), at),
            "a request's wait is not a new rule"
        );
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

    #[test]
    fn a_take_that_found_its_tokens_in_the_bucket_makes_them_due_at_once() {
        let q = quota();
        let mut l = Lease::new(q);
        assert!(l.begin_take(4, 0));
        assert!(!l.begin_take(4, 0), "one take in flight");
        // 4 tokens granted, 40 ms of debt after: the bucket was full before.
        let contended = l.taken(q, 4, (4, 40 * MS, 0), (0, MS));
        assert!(!contended);
        assert!(!l.taking && !l.ahead);
        assert_eq!((l.slices.len(), l.available(MS), l.unused()), (1, 4, 4));
        assert_eq!(
            (l.slices[0].taken_at, l.slices[0].lead),
            (0, signed(100 * MS))
        );
        assert_eq!((l.full_at, l.denied_until, l.last_ask), (40 * MS, 0, 4));
    }

    #[test]
    fn a_take_that_had_to_reserve_proves_the_counter_contended() {
        let q = quota();
        let at = 1_000 * MS;
        let mut l = Lease::new(q);
        assert!(l.begin_take(5, at - MS));
        // 5 granted on a debt of 80 ms: 2 held, 3 reserved.
        assert!(l.taken(q, 5, (5, 130 * MS, 0), (at - MS, at)));
        assert!(l.ahead, "one slice stays queued ahead");
        assert_eq!((l.available(at), l.unused(), l.low_water(0.5)), (2, 5, 5));
        assert_eq!(l.full_at, at - MS + 130 * MS);
        l.hold_share(Demand::new(50.0, at), at, 130 * MS);
        let s = l.share.as_ref().unwrap();
        assert_eq!((s.next, s.millionths, s.debt), (at, 0, 130 * MS));
        assert!(
            !l.taken(q, 5, (5, 130 * MS, 0), (at, at)),
            "a share is held already"
        );
        // Less than asked for, though all held: contended too.
        let mut l = Lease::new(q);
        assert!(l.taken(q, 5, (3, 30 * MS, 0), (0, 0)));
        assert!(!l.ahead);
    }

    #[test]
    fn a_take_granted_nothing_denies_until_the_wait_redis_reported() {
        let q = quota();
        let mut l = Lease::new(q);
        assert!(l.begin_take(4, 1_000 * MS));
        // Nothing for 30 ms from when the take was sent, not from its reply.
        assert!(l.taken(q, 4, (0, 100 * MS, 30 * MS), (1_000 * MS, 1_002 * MS)));
        assert_eq!((l.slices.len(), l.denied_until), (0, 1_030 * MS));
        assert_eq!(l.full_at, 1_100 * MS);
        assert!(!l.begin_take(4, 1_029 * MS), "the bucket is known empty");
        assert!(l.begin_take(4, 1_030 * MS));
        l.take_failed(2_030 * MS);
        assert!(!l.taking);
        assert!(!l.begin_take(4, 2_029 * MS), "backed off after a failure");
        assert!(l.begin_take(4, 2_030 * MS));
    }

    #[test]
    fn a_grant_for_a_rule_a_reload_replaced_goes_back_whole() {
        let (q, q2) = (quota(), Quota::new(NANOS_PER_SEC, 50, 10).unwrap());
        let mut l = Lease::new(q);
        l.slices.push_back(held(5, 0, q.interval()));
        l.consume(2, 0);
        assert!(!l.follow_rule(q, 0), "the same rule");
        assert!(l.follow_rule(q2, 0));
        assert_eq!((l.quota, l.slices.len(), l.to_return), (q2, 0, 3));
        // A take sent under the old rule answers after the reload.
        assert!(!l.taken(q, 4, (4, 40 * MS, 0), (0, MS)));
        assert_eq!((l.slices.len(), l.to_return), (0, 7));
        assert_eq!(l.give_back(MS, 1_000 * MS), 7);
        assert_eq!((l.to_return, l.give_back(MS, 1_000 * MS)), (0, 0));
    }

    #[test]
    fn slices_give_back_their_unused_tokens_at_their_age() {
        let q = quota();
        let t = q.interval();
        let mut l = Lease::new(q);
        l.slices.push_back(held(5, 0, t));
        l.slices.push_back(held(4, 500 * MS, t));
        l.consume(6, 500 * MS);
        assert_eq!(
            l.give_back(999 * MS, 1_000 * MS),
            0,
            "none a second old yet"
        );
        assert_eq!(l.give_back(1_000 * MS, 1_000 * MS), 0, "the first is spent");
        assert_eq!(l.slices.len(), 1);
        assert_eq!(l.give_back(1_500 * MS, 1_000 * MS), 3);
        assert!(l.slices.is_empty());
    }

    #[test]
    fn a_share_is_renewed_when_due_with_the_demand_since_the_last_renewal() {
        let q = quota();
        let mut l = Lease::new(q);
        assert_eq!(l.begin_renewal(0), None, "no share");
        l.slices.push_back(held(3, 0, q.interval()));
        l.share = Some(Share {
            demand: Demand::counted(50, 0),
            next: 100 * MS,
            millionths: 0,
            debt: 0,
        });
        assert_eq!(l.begin_renewal(99 * MS), None, "not due");
        // 50 hits over 100 ms: 500 a second; 3 tokens held.
        assert_eq!(l.begin_renewal(100 * MS), Some((500.0, 3)));
        assert!(l.taking);
        assert_eq!(l.begin_renewal(200 * MS), None, "one call in flight");
    }

    #[test]
    fn a_renewal_sets_the_share_and_adds_its_tokens() {
        let q = quota();
        let mut l = Lease::new(q);
        l.share = Some(share(0, 0));
        l.taking = true;
        let (sent, received) = (1_000 * MS, 1_001 * MS);
        assert!(l.renewed(
            q,
            &reply(3, 60 * MS, 250_000, true),
            25 * MS,
            (sent, received)
        ));
        let s = l.share.as_ref().unwrap();
        assert_eq!(
            (s.next, s.millionths, s.debt),
            (1_025 * MS, 250_000, 60 * MS)
        );
        // A debt of 30 ms before the renewal: its 3 tokens were in the bucket.
        assert_eq!((l.available(received), l.full_at), (3, 1_060 * MS));
        assert!(!l.taking && !l.ahead);
    }

    #[test]
    fn a_renewal_of_a_counter_no_longer_shared_goes_back_to_takes() {
        let (q, q2) = (quota(), Quota::new(NANOS_PER_SEC, 50, 10).unwrap());
        let mut l = Lease::new(q);
        l.share = Some(share(0, 0));
        assert!(!l.renewed(q, &reply(2, 20 * MS, 0, false), 25 * MS, (0, 0)));
        assert!(l.share.is_none());
        assert_eq!(l.unused(), 2, "its last tokens are kept");
        // The rule changed while the renewal was in flight: its tokens go back.
        let mut l = Lease::new(q2);
        l.share = Some(share(0, 0));
        assert!(!l.renewed(q, &reply(2, 20 * MS, 500_000, true), 25 * MS, (0, 0)));
        assert_eq!((l.share.is_none(), l.unused(), l.to_return), (true, 0, 2));
        // A failed renewal drops the share and backs off.
        let mut l = Lease::new(q);
        l.share = Some(share(0, 0));
        l.taking = true;
        l.renewal_failed(1_000 * MS);
        assert_eq!(
            (l.share.is_none(), l.taking, l.retry_at),
            (true, false, 1_000 * MS)
        );
    }

    #[test]
    fn a_shared_counter_learns_its_debt_from_the_exact_path() {
        let (q, q2) = (quota(), Quota::new(NANOS_PER_SEC, 50, 10).unwrap());
        let op = |cost, charge, quota| Op {
            key: 1,
            quota,
            cost,
            charge,
            mode: Mode::Enforce,
        };
        let out = |admitted, wait| CounterOutcome {
            admitted,
            wait,
            ..CounterOutcome::NONE
        };
        let mut l = Lease::new(q);
        l.learn_debt(&op(1, Charge::Ask, q), &out(true, 30 * MS));
        assert!(l.share.is_none(), "no share: nothing to learn");
        l.share = Some(share(0, 0));
        let debt = |l: &Lease| l.share.as_ref().unwrap().debt;
        l.learn_debt(&op(2, Charge::Ask, q), &out(true, 30 * MS));
        assert_eq!(debt(&l), 30 * MS, "admitted: the wait is the debt after");
        l.learn_debt(&op(2, Charge::Ask, q), &out(false, 20 * MS));
        assert_eq!(debt(&l), 100 * MS, "refused: 20 + 100 − 2 × 10 ms");
        l.learn_debt(&op(11, Charge::Ask, q), &out(false, 50 * MS));
        assert_eq!(debt(&l), 50 * MS, "past the burst: the debt itself");
        l.learn_debt(&op(3, Charge::Spent, q), &out(false, 40 * MS));
        assert_eq!(
            debt(&l),
            140 * MS,
            "spend past the bucket: the debt past B·T"
        );
        l.learn_debt(&op(1, Charge::Ask, q2), &out(true, 0));
        assert_eq!(debt(&l), 140 * MS, "another rule's answer");
    }
}
