//! Jittered backoff that never asks again earlier than the server said ([`Backoff`]). A refused
//! caller that waits exactly `duration_until_reset` comes back at the same instant as every
//! other caller refused with it, and the second wave is refused too. So each wait is spread
//! *upward* by a random fraction: never below the server's wait (asking earlier is a wasted call
//! that is refused again), never all at once. Repeated refusals or failures of one caller also
//! raise the floor exponentially, capped, so a caller that keeps losing the race yields to the
//! others.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A shareable source of uniform fractions in `[0, 1)` (SplitMix64): seeded for tests (the draws
/// are then reproducible), seeded from the process's hasher keys otherwise. It is for spreading
/// retries, not for secrets, and needs no dependency.
#[derive(Debug)]
pub struct Jitter {
    state: AtomicU64,
}

/// SplitMix64's increment (the golden ratio in 64 bits).
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

impl Jitter {
    /// A generator whose draws are fixed by `seed`.
    pub fn seeded(seed: u64) -> Self {
        Self {
            state: AtomicU64::new(seed),
        }
    }

    /// A generator seeded differently in each process and each call.
    pub fn from_entropy() -> Self {
        // RandomState's keys are random per process (and per thread's first use); hashing the
        // time as well separates generators made in the same thread.
        let seed = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
        Self::seeded(seed)
    }

    /// The next fraction in `[0, 1)`.
    pub fn unit(&self) -> f64 {
        // Relaxed: each draw needs a distinct state, which fetch_add gives; nothing else is
        // published through it.
        let state = self
            .state
            .fetch_add(GAMMA, Ordering::Relaxed)
            .wrapping_add(GAMMA);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        // The top 53 bits as a fraction: exactly representable, always below 1.
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The backoff of one caller. For attempt `n` (0 for the first wait after a success), with the
/// server's wait `w` (zero after a failure, when there is no answer), base `b`, cap `c`, spread
/// `s` and `u` drawn uniformly from `[0, 1)` by a [`Jitter`]:
///
/// ```text
/// floor = max(w, min(c, b · 2ⁿ))
/// wait  = floor · (1 + s · u)           ∈ [floor, floor · (1 + s))
/// ```
#[derive(Debug)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    spread: f64,
    attempt: u32,
    jitter: Jitter,
}

impl Backoff {
    /// A backoff starting at `base`, growing to at most `cap` (the server's wait may exceed
    /// it), spread by half of each wait.
    pub fn new(base: Duration, cap: Duration) -> Self {
        Self {
            base,
            cap,
            spread: 0.5,
            attempt: 0,
            jitter: Jitter::from_entropy(),
        }
    }

    /// This backoff with another spread: each wait is drawn from `[floor, floor · (1 +
    /// spread))`. Negative or non-finite values count as 0.
    pub fn with_spread(mut self, spread: f64) -> Self {
        self.spread = if spread.is_finite() {
            spread.max(0.0)
        } else {
            0.0
        };
        self
    }

    /// This backoff drawing from `jitter` (e.g. [`Jitter::seeded`] in a test).
    pub fn with_jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// The wait after the server refused with `server_wait`: never less than it.
    pub fn after_refusal(&mut self, server_wait: Duration) -> Duration {
        self.next(server_wait)
    }

    /// The wait after a call that got no answer.
    pub fn after_failure(&mut self) -> Duration {
        self.next(Duration::ZERO)
    }

    /// Starts over (after a success).
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// Waits since the last reset.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    fn next(&mut self, server_wait: Duration) -> Duration {
        // 2^31 × base is past any sensible cap; the shift stays in range.
        let grown = self
            .base
            .saturating_mul(1u32 << self.attempt.min(31))
            .min(self.cap);
        self.attempt = self.attempt.saturating_add(1);
        let floor = server_wait.max(grown);
        let extra = floor.as_secs_f64() * self.spread * self.jitter.unit();
        // from_secs_f64 would panic on overflow; an absurd extra is dropped instead.
        floor.saturating_add(Duration::try_from_secs_f64(extra).unwrap_or(Duration::ZERO))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_jitter_repeats_and_stays_in_range() {
        let (a, b) = (Jitter::seeded(7), Jitter::seeded(7));
        for _ in 0..1_000 {
            let x = a.unit();
            assert_eq!(x.to_bits(), b.unit().to_bits());
            assert!((0.0..1.0).contains(&x));
        }
        assert_ne!(Jitter::seeded(7).unit(), Jitter::seeded(8).unit());
    }

    #[test]
    fn failures_grow_exponentially_to_the_cap_and_reset() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1))
            .with_spread(0.0)
            .with_jitter(Jitter::seeded(1));
        let waits: Vec<u128> = (0..6).map(|_| b.after_failure().as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1_000, 1_000]);
        b.reset();
        assert_eq!(b.after_failure(), Duration::from_millis(100));
        // A server's wait above the cap is still honoured.
        assert_eq!(
            b.after_refusal(Duration::from_secs(5)),
            Duration::from_secs(5)
        );
        // Many failures neither overflow nor panic: the exponent stops at 31.
        let mut b = Backoff::new(Duration::from_millis(1), Duration::MAX).with_spread(0.0);
        for _ in 0..100 {
            b.after_failure();
        }
        assert_eq!(b.after_failure(), Duration::from_millis(1 << 31));
    }

    #[test]
    fn waits_never_undercut_the_server_and_spread_uniformly_above_it() {
        const N: usize = 20_000;
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_secs(1))
            .with_jitter(Jitter::seeded(0x5eed));
        let server = Duration::from_secs(2);
        let mut deciles = [0i64; 10];
        let mut sum = 0.0;
        for _ in 0..N {
            b.reset();
            let wait = b.after_refusal(server);
            assert!(wait >= server && wait < server.mul_f64(1.5), "{wait:?}");
            // Where in [w, 1.5 w) the wait fell, as a fraction.
            let at = (wait.as_secs_f64() / server.as_secs_f64() - 1.0) / 0.5;
            deciles[((at * 10.0) as usize).min(9)] += 1;
            sum += at;
        }
        // Uniform: each decile holds N/10 = 2000, σ = √(N·0.1·0.9) ≈ 42; χ² with 9 degrees of
        // freedom stays under 27.9 with probability 0.999.
        let expected = (N / 10) as f64;
        let chi2: f64 = deciles
            .iter()
            .map(|&c| (c as f64 - expected).powi(2) / expected)
            .sum();
        assert!(chi2 < 27.9, "χ² = {chi2}, deciles {deciles:?}");
        assert!((sum / N as f64 - 0.5).abs() < 0.01);
    }

    #[test]
    fn repeated_refusals_never_undercut_any_server_wait() {
        let jitter = Jitter::seeded(42);
        let mut b = Backoff::new(Duration::from_millis(50), Duration::from_secs(30))
            .with_jitter(Jitter::seeded(43));
        for i in 0..10_000 {
            if i % 7 == 0 {
                b.reset();
            }
            // Server waits from 0 to 60 s, in nanoseconds.
            let server = Duration::from_nanos((jitter.unit() * 60e9) as u64);
            let wait = b.after_refusal(server);
            assert!(wait >= server, "{wait:?} < {server:?}");
            assert!(wait < server.max(Duration::from_secs(30)).mul_f64(1.5));
        }
    }
}
