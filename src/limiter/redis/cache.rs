//! The local over-limit cache: counters Redis reported out of tokens until an instant. While
//! every counted op of a request is such a counter and the request would be refused, it is
//! refused here without a round trip. The cache only ever refuses, and only until an instant at
//! or before the one Redis gave (dated from when the request started, before Redis saw it), so
//! it never admits anything and never refuses what Redis would admit, short of refunds made
//! through other nodes meanwhile (a refund through this node drops the counter's entry). A
//! request that gives back or reports spend is never answered here: Redis must apply it, whatever
//! the counter owes. Spend recorded past the bucket is learnt as the instant a request of one
//! fits again. Bounded; expired entries are dropped as they are met.

use dashmap::DashMap;

use crate::limiter::batch::{Batch, Charge, Mode, Op};
use crate::limiter::gcra::CounterOutcome;
use crate::limiter::key::{Key, KeyHash};

#[derive(Debug)]
pub(super) struct DenyCache {
    /// Counter → local monotonic nanoseconds until which no single request fits.
    until: DashMap<Key, u64, KeyHash>,
    max: usize,
}

impl DenyCache {
    pub(super) fn new(max: usize) -> Self {
        Self {
            until: DashMap::default(),
            max,
        }
    }

    /// The refusal of a request all of whose counted ops are known to be out of tokens.
    pub(super) fn answer(&self, ops: &[Op], now: u64) -> Option<Batch> {
        if self.max == 0 || ops.is_empty() {
            return None;
        }
        let mut outcomes = Vec::with_capacity(ops.len());
        let (mut enforce, mut quota) = (false, 0usize);
        for op in ops {
            // A refund or spend is applied in Redis whatever the outcome; a check asks nothing.
            if op.unconditional() || op.cost == 0 {
                return None;
            }
            let until = *self.until.get(&op.key)?;
            if until <= now {
                self.until.remove_if(&op.key, |_, u| *u <= now);
                return None;
            }
            match op.mode {
                Mode::Enforce => enforce = true,
                Mode::Quota => quota += 1,
                Mode::Shadow => {}
            }
            let extra = op
                .cost
                .saturating_sub(1)
                .saturating_mul(op.quota.interval());
            let wait = (until - now).saturating_add(extra);
            if wait <= op.quota.max_delay() {
                // Its rule would admit it at its slot: only Redis can claim the slot.
                return None;
            }
            outcomes.push(CounterOutcome {
                wait,
                ..CounterOutcome::NONE
            });
        }
        // Shadow-only requests are admitted: let Redis count them.
        (enforce || quota > 0).then_some(Batch {
            blocked: true,
            outcomes,
        })
    }

    /// Forgets what is known of `key` (its counter was reset).
    pub(super) fn forget(&self, key: Key) {
        self.until.remove(&key);
    }

    /// Remembers the counters Redis just found out of tokens.
    pub(super) fn learn(&self, ops: &[Op], batch: &Batch, now: u64) {
        if self.max == 0 {
            return;
        }
        for (op, o) in ops.iter().zip(&batch.outcomes) {
            if op.is_refund() {
                // Tokens given back: the counter may fit a request again before the instant
                // cached for it.
                if op.cost > 0 {
                    self.until.remove(&op.key);
                }
                continue;
            }
            if op.cost == 0 {
                continue;
            }
            if o.admitted {
                self.until.remove(&op.key);
                continue;
            }
            let spent = op.charge == Charge::Spent;
            if o.remaining != 0 || (op.cost > op.quota.burst() && !op.quota.is_ban() && !spent) {
                continue;
            }
            // The wait of one unit request: this cost's wait less the extra intervals; after
            // spend recorded past the bucket, the wait until its debt is back within the bucket
            // and one interval more.
            let unit_wait = if op.quota.is_ban() {
                o.wait
            } else if spent {
                o.wait.saturating_add(op.quota.interval())
            } else {
                o.wait
                    .saturating_sub((op.cost - 1).saturating_mul(op.quota.interval()))
            };
            if unit_wait == 0 {
                continue;
            }
            if self.until.len() >= self.max {
                self.until.retain(|_, until| *until > now);
                if self.until.len() >= self.max {
                    continue;
                }
            }
            self.until.insert(op.key, now.saturating_add(unit_wait));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::batch::Charge;
    use crate::limiter::gcra::Quota;

    fn op(cost: u64, refund: bool) -> Op {
        Op {
            key: 7,
            quota: Quota::new(1_000, 10, 10).unwrap(),
            cost,
            charge: if refund { Charge::Refund } else { Charge::Ask },
            mode: Mode::Enforce,
        }
    }

    fn spent(cost: u64) -> Op {
        Op {
            charge: Charge::Spent,
            ..op(cost, false)
        }
    }

    #[test]
    fn spend_is_never_answered_here_and_is_learnt_as_the_debt_it_left() {
        let cache = DenyCache::new(16);
        cache.learn(&[op(1, false)], &denied(500), 0);
        assert!(
            cache.answer(&[spent(3)], 10).is_none(),
            "spend reaches Redis, to be recorded"
        );
        assert!(cache.answer(&[op(1, false), spent(3)], 10).is_none());
        // Spend of 50 (T = 100 ns, B·T = 1,000 ns) on a full bucket: a debt of 5,000 ns, 4,000
        // past the bucket. A request of one fits once 4,100 ns have passed.
        let over = Batch {
            blocked: true,
            outcomes: vec![CounterOutcome {
                wait: 4_000,
                ..CounterOutcome::NONE
            }],
        };
        cache.learn(&[spent(50)], &over, 1_000);
        let refused = cache.answer(&[op(2, false)], 1_100).unwrap();
        assert_eq!(
            refused.outcomes[0].wait,
            4_000 + 100,
            "the wait Redis gives"
        );
        assert!(cache.answer(&[op(1, false)], 5_100).is_none(), "fits then");
    }

    fn denied(wait: u64) -> Batch {
        Batch {
            blocked: true,
            outcomes: vec![CounterOutcome {
                wait,
                ..CounterOutcome::NONE
            }],
        }
    }

    #[test]
    fn a_refund_through_this_node_forgets_the_counter() {
        let cache = DenyCache::new(16);
        cache.learn(&[op(1, false)], &denied(500), 0);
        assert!(
            cache.answer(&[op(1, false)], 10).is_some(),
            "cached as out of tokens"
        );
        let refunded = Batch {
            blocked: false,
            outcomes: vec![CounterOutcome {
                admitted: true,
                remaining: 10,
                ..CounterOutcome::NONE
            }],
        };
        cache.learn(&[op(10, true)], &refunded, 20);
        assert!(
            cache.answer(&[op(1, false)], 30).is_none(),
            "after a refund Redis decides again"
        );
    }
}
