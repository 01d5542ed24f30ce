//! The wait before each reconnection to the xDS server. The reference's defaults are kept
//! (10 s, at most 60 s, jitter 0.5) but, unlike its jpillora/backoff use (where a factor of 0.5
//! clamps every wait to the initial one), the wait doubles after each failed attempt up to the
//! maximum and goes back to the initial one after an accepted response. With jitter each wait is
//! drawn uniformly within ±`random_factor` of the computed one, never past the maximum, so a
//! fleet restarted together does not reconnect in step.

use std::time::Duration;

use crate::settings::XdsBackoff;

/// The waits of one client.
#[derive(Debug)]
pub(super) struct Backoff {
    settings: XdsBackoff,
    /// Failed attempts since the last accepted response.
    attempts: u32,
    /// xorshift64 state: jitter needs spread, not secrecy.
    seed: u64,
}

impl Backoff {
    pub(super) fn new(settings: XdsBackoff) -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let seed = xxhash_rust::xxh3::xxh3_64(
            &[
                now.as_nanos().to_le_bytes().as_slice(),
                &std::process::id().to_le_bytes(),
            ]
            .concat(),
        );
        Self {
            settings,
            attempts: 0,
            seed: seed | 1,
        }
    }

    /// The wait before the next attempt; each call counts one failed attempt.
    pub(super) fn next(&mut self) -> Duration {
        let s = self.settings;
        let base = s
            .initial
            .saturating_mul(1u32 << self.attempts.min(20))
            .min(s.max);
        self.attempts = self.attempts.saturating_add(1);
        if !s.jitter || s.random_factor == 0.0 {
            return base;
        }
        // A uniform draw in [-1, 1).
        let unit = (self.random() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
        base.mul_f64(1.0 + s.random_factor * unit).min(s.max)
    }

    /// Back to the first wait (after an accepted response).
    pub(super) fn reset(&mut self) {
        self.attempts = 0;
    }

    fn random(&mut self) -> u64 {
        let mut x = self.seed;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.seed = x;
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff(jitter: bool) -> Backoff {
        Backoff::new(XdsBackoff {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(60),
            random_factor: 0.5,
            jitter,
        })
    }

    #[test]
    fn the_wait_doubles_to_the_maximum_and_resets() {
        let mut b = backoff(false);
        let waits: Vec<u64> = (0..5).map(|_| b.next().as_secs()).collect();
        assert_eq!(waits, [10, 20, 40, 60, 60]);
        b.reset();
        assert_eq!(b.next(), Duration::from_secs(10));
    }

    #[test]
    fn jittered_waits_stay_within_the_factor_and_the_maximum_and_spread() {
        let mut b = backoff(true);
        let mut firsts = std::collections::BTreeSet::new();
        for _ in 0..200 {
            b.reset();
            let w = b.next();
            assert!(
                w >= Duration::from_secs(5) && w <= Duration::from_secs(15),
                "{w:?}"
            );
            firsts.insert(w.as_millis());
            for _ in 0..6 {
                assert!(b.next() <= Duration::from_secs(60));
            }
        }
        assert!(firsts.len() > 100, "{} distinct waits", firsts.len());
    }
}
