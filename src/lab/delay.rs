//! A rule's `delay` in the lab: [`DelayingGcra`], GCRA that admits a request at its slot when
//! the slot comes within the rule's delay. It is a model over the limiter's own pure functions
//! ([`gcra::decide`], [`gcra::record`]), one TAT per key on the trace's clock; it holds nothing
//! and has no caller deadlines (the server's hold, bounds and `grpc-timeout` are the server's).

use std::collections::HashMap;

use crate::limiter::Quota;
use crate::limiter::gcra;

/// GCRA with a rule's `delay` D: a request that does not fit at `t` but whose slot comes within
/// D is admitted at its slot `t + wait`, the slot claimed at `t` on the same TAT; one whose slot
/// is further is refused with its wait. With D = 0 it is GCRA as the server decides without
/// delay. The arithmetic is [`gcra::decide`]'s: the wait of a refusal is the time until the
/// same request fits, and admitting it at that instant leaves the TAT where admitting it now on
/// a bucket D longer would.
#[derive(Debug)]
pub struct DelayingGcra {
    quota: Quota,
    max_delay: u64,
    /// Key → TAT (absent: a fresh key).
    keys: HashMap<String, u64>,
}

impl DelayingGcra {
    /// The model of `quota` holding requests up to `max_delay` nanoseconds (0: refuse at once).
    #[must_use]
    pub fn new(quota: Quota, max_delay: u64) -> Self {
        Self {
            quota,
            max_delay,
            keys: HashMap::new(),
        }
    }

    fn tat(&self, key: &str) -> u64 {
        self.keys.get(key).copied().unwrap_or(0)
    }

    /// Whether `cost` more fits at `t` for `key` within the delay, counting nothing: `Ok` with
    /// the wait until its slot (0: fits now), or `Err` with the wait until it would fit.
    ///
    /// # Errors
    ///
    /// The wait, when the slot is further than the delay (or never comes: a ban, a cost above
    /// the burst).
    pub fn fits(&self, key: &str, t: u64, cost: u64) -> Result<u64, u64> {
        let outcome = gcra::decide(&self.quota, self.tat(key), t, cost);
        if outcome.admitted {
            return Ok(0);
        }
        let never = self.quota.is_ban() || cost > self.quota.burst();
        if never || outcome.wait > self.max_delay {
            Err(outcome.wait)
        } else {
            Ok(outcome.wait)
        }
    }

    /// Charges `cost` for `key` at `t`, at its slot `t + wait` (after a [`DelayingGcra::fits`]
    /// that gave `Ok(wait)`): the TAT moves as the server's claim moves it.
    pub fn charge(&mut self, key: &str, t: u64, wait: u64, cost: u64) {
        let outcome = gcra::decide(&self.quota, self.tat(key), t + wait, cost);
        if outcome.admitted {
            self.keys.insert(key.to_string(), outcome.tat);
        }
    }

    /// Records `cost` of work already done at `t` (spend reported after the work), as the
    /// server records it.
    pub fn record(&mut self, key: &str, t: u64, cost: u64) {
        let outcome = gcra::record(&self.quota, self.tat(key), t, cost);
        self.keys.insert(key.to_string(), outcome.tat);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;
    const MS: u64 = 1_000_000;

    #[test]
    fn a_delaying_gcra_admits_the_burst_then_one_per_slot_within_the_delay() {
        // 10 per second, burst 5, delay 1 s; 100 at once: 5 now, 10 at 100 ms … 1 s, 85 refused.
        let q = Quota::new(S, 10, 5).unwrap();
        let mut g = DelayingGcra::new(q, S);
        let t = 1_000 * S;
        let mut waits = Vec::new();
        let mut refused = Vec::new();
        for _ in 0..100 {
            match g.fits("k", t, 1) {
                Ok(w) => {
                    g.charge("k", t, w, 1);
                    waits.push(w);
                }
                Err(w) => refused.push(w),
            }
        }
        let mut expected = vec![0; 5];
        expected.extend((1..=10).map(|i| i * 100 * MS));
        assert_eq!(waits, expected);
        assert_eq!(refused.len(), 85);
        // The first refused would wait 1.1 s; refusals change nothing.
        assert_eq!(refused[0], 1_100 * MS);
        assert!(refused.iter().all(|&w| w == 1_100 * MS));
        // Without delay the same model is GCRA as the server decides: 5 admitted.
        let mut plain = DelayingGcra::new(q, 0);
        let admitted = (0..100)
            .filter(|_| match plain.fits("k", t, 1) {
                Ok(w) => {
                    plain.charge("k", t, w, 1);
                    true
                }
                Err(_) => false,
            })
            .count();
        assert_eq!(admitted, 5);
        // A cost above the burst never fits, however long the delay.
        assert!(DelayingGcra::new(q, 60 * S).fits("k", t, 6).is_err());
        assert!(DelayingGcra::new(Quota::ban(S), S).fits("k", t, 1).is_err());
    }
}
