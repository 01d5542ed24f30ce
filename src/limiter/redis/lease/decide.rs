//! The local decision: a request answered from this node's leases alone, all of it or none of
//! it. The request's counters are found and their leases locked in key order; refunds are
//! weighed, then charges, before any lease changes (a rule that delays holds a request for the
//! tokens its lease has due within the wait); a request that fits is applied, and its
//! leases topped up (a take for one running low, a renewal for a share that is due). A request
//! the leases cannot answer whole goes the exact path, after takes are started for its hot
//! counters. No call is sent from here: the takes and renewals run in the background.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use smallvec::{SmallVec, smallvec};

use super::{LeasedStore, lock};
use crate::limiter::batch::{Batch, Charge, Op};
use crate::limiter::gcra::{CounterOutcome, Quota};
use crate::limiter::key::Key;
use crate::limiter::redis::call::fits_lean;
use crate::limiter::redis::lease::ledger::Lease;

/// One distinct counter of a request.
pub(super) struct RequestCounter {
    pub(super) key: Key,
    /// Its rate on this node, in hits per second.
    pub(super) rate: u64,
    /// Its lease, if it has one.
    pub(super) lease: Option<Arc<Mutex<Lease>>>,
}

/// The leases of a request's counters, locked, index for index with the counters.
type Guards<'a> = [MutexGuard<'a, Lease>];

/// What a request would do to its leases, worked out before any of them changes.
struct Tally {
    /// Per lease: the tokens the request gives back.
    refunded: SmallVec<[u64; 4]>,
    /// Per lease: the tokens the request uses.
    charged: SmallVec<[u64; 4]>,
    /// Per op: its outcome.
    outcomes: Vec<CounterOutcome>,
    /// Per op: the tokens it found due (a charge only).
    found: SmallVec<[u64; 4]>,
}

impl LeasedStore {
    /// The answer from leases, or `None` when the request must go to Redis (then takes are
    /// started for the hot counters that need one).
    pub(super) fn decide_from_leases(self: &Arc<Self>, ops: &[Op], now: u64) -> Option<Batch> {
        if !self.may_answer(ops) {
            return None;
        }
        let (mut counters, answerable) = self.request_counters(ops, now);
        if !answerable {
            self.start_takes(ops, &counters, (now, false));
            return None;
        }
        counters.sort_unstable_by_key(|c| c.key);
        // Locked in key order, so two requests never wait on each other in a cycle.
        let mut guards: SmallVec<[MutexGuard<'_, Lease>; 4]> = counters
            .iter()
            .filter_map(|c| c.lease.as_deref())
            .map(lock)
            .collect();
        let max_age = self.config.max_age_nanos();
        for g in &mut guards {
            g.expire(now, max_age);
        }
        count_demand(ops, &counters, &mut guards);
        let Some(tally) = weigh(ops, &counters, &mut guards, now) else {
            drop(guards);
            // The shared counters' demand was counted above.
            self.start_takes(ops, &counters, (now, true));
            return None;
        };
        let batch = apply(ops, &counters, &mut guards, tally, now);
        self.top_up(&counters, &mut guards, now);
        Some(batch)
    }

    /// Whether leases may answer `ops` at all: leasing is open, and no op reports spend or
    /// checks at cost 0 (spend is recorded in Redis whole, and a check reads the debt there:
    /// module header).
    fn may_answer(&self, ops: &[Op]) -> bool {
        !ops.is_empty()
            && !self.closed.load(Ordering::Relaxed)
            && !ops
                .iter()
                .any(|op| op.charge == Charge::Spent || (op.charge == Charge::Ask && op.cost == 0))
    }

    /// The request's distinct counters, each with its rate (its hits counted now) and its
    /// lease; and whether every op is on a leasable counter that has a lease.
    fn request_counters(&self, ops: &[Op], now: u64) -> (SmallVec<[RequestCounter; 4]>, bool) {
        let mut counters: SmallVec<[RequestCounter; 4]> = SmallVec::with_capacity(ops.len());
        let mut answerable = true;
        for op in ops {
            if !leasable(op) {
                answerable = false;
                continue;
            }
            let hits = if op.is_refund() { 0 } else { op.cost };
            let rate = self.heat.hit(op.key, hits, now);
            if let Some(c) = counters.iter_mut().find(|c| c.key == op.key) {
                c.rate = c.rate.max(rate);
                continue;
            }
            let lease = self.leases.get(&op.key).map(|l| Arc::clone(&l));
            if lease.is_none() {
                answerable = false;
            }
            counters.push(RequestCounter {
                key: op.key,
                rate,
                lease,
            });
        }
        (counters, answerable)
    }

    /// Low water: the next slice before this one runs out; a share, when its renewal is due.
    fn top_up(self: &Arc<Self>, counters: &[RequestCounter], guards: &mut Guards<'_>, now: u64) {
        for (c, g) in counters.iter().zip(guards.iter_mut()) {
            if g.share.is_some() {
                self.start_renewal(c.key, g, now);
                continue;
            }
            let low = g.low_water(self.config.low_water);
            if g.unused() <= low && c.rate >= self.config.min_rate {
                // Sized only when a take is due: the size is a 128-bit division.
                let ask = self.config.slice(&g.quota, c.rate);
                self.start_take(c.key, g, (ask, c.rate), now);
            }
        }
    }
}

/// Whether this counter's quota can be leased: not a ban, and exact in `lease.lua`'s plain
/// numbers. A rule's `delay` does not count: a lease is of the rate, and a request that may
/// wait is held from the tokens its lease has due within the wait (`charges`).
fn leasable(op: &Op) -> bool {
    let rate = Op {
        quota: op.quota.with_max_delay(0),
        ..*op
    };
    !op.quota.is_ban() && fits_lean([&rate])
}

/// Where the counter `key` stands among a request's `counters`, and its lease among the guards.
fn index(counters: &[RequestCounter], key: Key) -> usize {
    counters.iter().position(|c| c.key == key).unwrap_or(0)
}

/// A shared counter's demand: every hit offered here, whatever the answer.
fn count_demand(ops: &[Op], counters: &[RequestCounter], guards: &mut Guards<'_>) {
    for op in ops.iter().filter(|op| !op.is_refund()) {
        if let Some(share) = guards[index(counters, op.key)].share.as_mut() {
            share.demand.hit(op.cost);
        }
    }
}

/// Every op's outcome from the leases, refunds first as the stores apply them; `None` when the
/// leases cannot answer all of the request.
fn weigh(
    ops: &[Op],
    counters: &[RequestCounter],
    guards: &mut Guards<'_>,
    now: u64,
) -> Option<Tally> {
    let mut tally = Tally {
        refunded: smallvec![0; guards.len()],
        charged: smallvec![0; guards.len()],
        outcomes: vec![CounterOutcome::NONE; ops.len()],
        found: smallvec![0; ops.len()],
    };
    let fits = refunds(ops, counters, guards, &mut tally, now)
        && charges(ops, counters, guards, &mut tally, now);
    fits.then_some(tally)
}

/// Weighs the refunds: each is admitted when its lease handed the tokens out. False when one is
/// not, or when a lease is of a rule a reload changed (it moves to the new one).
fn refunds(
    ops: &[Op],
    counters: &[RequestCounter],
    guards: &mut Guards<'_>,
    t: &mut Tally,
    now: u64,
) -> bool {
    for (op, out) in ops.iter().zip(t.outcomes.iter_mut()) {
        let i = index(counters, op.key);
        let l = &mut guards[i];
        if l.follow_rule(op.quota, now) {
            // The rule changed (a reload): this lease was of the old rate.
            return false;
        }
        if !op.is_refund() {
            continue;
        }
        if op.cost > l.used() - t.refunded[i] {
            return false;
        }
        t.refunded[i] += op.cost;
        let remaining = (l.available(now) + t.refunded[i]).min(op.quota.burst());
        *out = admitted(l, &op.quota, remaining, now);
    }
    true
}

/// Weighs the charges against the tokens each lease has due after the refunds and the charges
/// before: admitted when they are there; for a rule that delays, admitted and held when the
/// tokens come due within the request's delay; refused here when the lease knows the wait is
/// longer. False when a charge cannot be decided here.
fn charges(
    ops: &[Op],
    counters: &[RequestCounter],
    guards: &Guards<'_>,
    t: &mut Tally,
    now: u64,
) -> bool {
    for (k, (op, out)) in ops.iter().zip(t.outcomes.iter_mut()).enumerate() {
        if op.is_refund() {
            continue;
        }
        let i = index(counters, op.key);
        let l = &guards[i];
        if t.refunded[i] > 0 && l.claimed_ahead(now) {
            // The refunds may give back tokens claimed ahead, not due now: Redis decides.
            return false;
        }
        // Charges held for tokens not yet due may pass what is due now.
        let avail = (l.available(now) + t.refunded[i]).saturating_sub(t.charged[i]);
        t.found[k] = avail;
        if op.cost > op.quota.burst() {
            return false;
        }
        if op.cost <= avail {
            t.charged[i] += op.cost;
            *out = admitted(l, &op.quota, avail - op.cost, now);
            continue;
        }
        let needed = (t.charged[i] + op.cost).saturating_sub(t.refunded[i]);
        let delay = op.quota.max_delay();
        if delay > 0 {
            if t.refunded[i] > 0 {
                // Refunded tokens go back newest first, ahead of any claim: Redis decides.
                return false;
            }
            if let Some(at) = l.claim_at(needed, now).filter(|&at| at - now <= delay) {
                t.charged[i] += op.cost;
                *out = held(l, &op.quota, at - now, now);
                continue;
            }
        }
        match refusal(l, op, (avail, needed), now) {
            Some(refused) => *out = refused,
            None => return false,
        }
    }
    true
}

/// A charge admitted at a slot `hold` ahead, the tokens claimed from its lease: the answer is
/// held until the last of them is due, when the exact path would have admitted it.
fn held(lease: &Lease, quota: &Quota, hold: u64, now: u64) -> CounterOutcome {
    CounterOutcome {
        hold,
        wait: wait(lease, quota, 0, now).max(quota.tolerance().saturating_add(hold)),
        ..admitted(lease, quota, 0, now)
    }
}

/// The refusal of a charge of `op` the lease cannot cover with the `avail` tokens due now
/// (`needed` counting the request's charges before it), with the wait the lease knows: until
/// its reserved tokens are due, until the instant Redis reported when the last take got none,
/// or until the share's next renewal. `None` when only Redis can decide; for a rule that
/// delays, also unless the slot the lease knows of (a wait no longer than the exact path's:
/// the first two, or the shared slot at the debt a share last reported) is further than the
/// request may wait.
fn refusal(l: &Lease, op: &Op, (avail, needed): (u64, u64), now: u64) -> Option<CounterOutcome> {
    let (wait, slot) = if let Some(at) = l.due_at(needed, now) {
        // Reserved tokens not due yet: the shared bucket has none before them.
        (at - now, at - now)
    } else if avail == 0 && l.denied_until > now {
        let extra = (op.cost - 1).saturating_mul(op.quota.interval());
        let wait = (l.denied_until - now).saturating_add(extra);
        (wait, wait)
    } else {
        // This node's share is spent until its next renewal, and the bucket holds nothing
        // past the shares (else the request takes the exact path).
        (l.share_wait(op.cost, now)?, l.share_slot(op.cost)?)
    };
    let delay = op.quota.max_delay();
    (delay == 0 || slot > delay).then_some(CounterOutcome {
        wait,
        ..CounterOutcome::NONE
    })
}

/// Applies a request that fits: refunds given back, and charges used unless the request is
/// blocked (then nothing is charged, and an op that fit reports the state it found).
fn apply(
    ops: &[Op],
    counters: &[RequestCounter],
    guards: &mut Guards<'_>,
    t: Tally,
    now: u64,
) -> Batch {
    let Tally {
        refunded,
        charged,
        mut outcomes,
        found,
    } = t;
    let blocked = Batch::blocked_by(ops, &outcomes);
    for (i, g) in guards.iter_mut().enumerate() {
        g.unconsume(refunded[i]);
        if !blocked {
            g.claim(charged[i], now);
        }
    }
    if blocked {
        for ((op, out), avail) in ops.iter().zip(outcomes.iter_mut()).zip(&found) {
            if !op.is_refund() && out.admitted {
                out.remaining = *avail;
                out.wait = wait(&guards[index(counters, op.key)], &op.quota, *avail, now);
                out.hold = 0;
            }
        }
    }
    Batch { blocked, outcomes }
}

/// An admitted op's outcome, `remaining` tokens left in this node's view.
fn admitted(lease: &Lease, quota: &Quota, remaining: u64, now: u64) -> CounterOutcome {
    CounterOutcome {
        admitted: true,
        remaining,
        wait: wait(lease, quota, remaining, now),
        ..CounterOutcome::NONE
    }
}

/// The wait reported for an admitted local op: until the shared bucket is full again as of
/// this node's last call, and no less than the tokens missing from this node's view.
fn wait(lease: &Lease, quota: &Quota, remaining: u64, now: u64) -> u64 {
    let missing = quota
        .burst()
        .saturating_sub(remaining)
        .saturating_mul(quota.interval());
    lease.full_at.saturating_sub(now).max(missing)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::batch::Mode;
    use crate::limiter::gcra::NANOS_PER_SEC;
    use crate::limiter::redis::lease::ledger::reserving;

    const MS: u64 = 1_000_000;

    /// A lease of 100 a second, burst 10 (T = 10 ms), whose one slice of 5 was taken on a debt
    /// of 80 ms at `at`: 2 tokens due at once, 3 reserved, due 10, 20 and 30 ms later.
    fn counter(at: u64) -> [RequestCounter; 1] {
        let lease = reserving(Quota::new(NANOS_PER_SEC, 100, 10).unwrap(), at);
        [RequestCounter {
            key: 1,
            rate: 100,
            lease: Some(Arc::new(Mutex::new(lease))),
        }]
    }

    /// A request of `ops` decided on `counters` at `now`: its batch, or `None` for Redis.
    fn decide(ops: &[Op], counters: &[RequestCounter], now: u64) -> Option<Batch> {
        let mut guards: SmallVec<[MutexGuard<'_, Lease>; 4]> = counters
            .iter()
            .filter_map(|c| c.lease.as_deref())
            .map(lock)
            .collect();
        let tally = weigh(ops, counters, &mut guards, now)?;
        Some(apply(ops, counters, &mut guards, tally, now))
    }

    fn op(cost: u64, charge: Charge) -> Op {
        Op {
            key: 1,
            quota: Quota::new(NANOS_PER_SEC, 100, 10)
                .unwrap()
                .with_max_delay(500 * MS),
            cost,
            charge,
            mode: Mode::Enforce,
        }
    }

    #[test]
    fn a_request_is_held_for_the_tokens_it_claims_and_never_less() {
        let at = 1_000 * MS;
        let counters = counter(at);
        let held = decide(&[op(3, Charge::Ask)], &counters, at).expect("from the lease");
        assert!(!held.blocked);
        assert_eq!(
            held.outcomes[0].hold,
            10 * MS,
            "the third token is due 10 ms on"
        );
        let next = decide(&[op(2, Charge::Ask)], &counters, at).expect("from the lease");
        assert_eq!(
            next.outcomes[0].hold,
            30 * MS,
            "after the tokens already claimed"
        );
        let short = Op {
            quota: op(1, Charge::Ask).quota.with_max_delay(5 * MS),
            ..op(1, Charge::Ask)
        };
        let refused = decide(&[short], &counters, at);
        assert!(
            refused.as_ref().is_none_or(|b| b.blocked),
            "nothing left within a 5 ms wait: {refused:?}"
        );
    }

    /// A refund in the same request gives back, newest first, a token claimed ahead (due in
    /// 30 ms): the charge beside it must not use that token now.
    #[test]
    fn a_refund_beside_a_charge_never_lets_the_charge_use_a_token_before_it_is_due() {
        let at = 1_000 * MS;
        let counters = counter(at);
        let all = decide(&[op(5, Charge::Ask)], &counters, at).expect("from the lease");
        assert_eq!(all.outcomes[0].hold, 30 * MS);
        let both = [op(1, Charge::Refund), op(1, Charge::Ask)];
        if let Some(b) = decide(&both, &counters, at) {
            assert!(
                b.blocked || b.outcomes[1].hold >= 30 * MS,
                "the charge was admitted {} ns before its token is due",
                30 * MS - b.outcomes[1].hold
            );
        }
    }
}
