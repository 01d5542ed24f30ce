//! The three counters sluice is compared with ([`FixedWindow`], [`SlidingLog`],
//! [`SlidingWindow`]), each for one rule's limit `L` per period `P`, one state per key, pure:
//! integer nanoseconds on the trace's clock, no runtime, no clock of their own. Only admitted
//! requests are counted, as sluice counts. [`Peak`] measures what any of them (or GCRA) let
//! through.

use std::collections::{HashMap, VecDeque};

/// A counter deciding requests for one rule, keyed by the descriptor's values.
pub trait WindowCounter {
    /// Whether `cost` more fits at `t` for `key`, counting nothing: `Ok(())`, or `Err` with
    /// the nanoseconds until the same request would fit.
    ///
    /// # Errors
    ///
    /// The wait, when the request is over the limit.
    fn fits(&self, key: &str, t: u64, cost: u64) -> Result<(), u64>;

    /// Counts `cost` admitted at `t` for `key` (after a [`WindowCounter::fits`] that fitted).
    fn charge(&mut self, key: &str, t: u64, cost: u64);

    /// [`WindowCounter::fits`], then [`WindowCounter::charge`] when it fits.
    ///
    /// # Errors
    ///
    /// The wait, when the request is over the limit; nothing is counted then.
    fn admit(&mut self, key: &str, t: u64, cost: u64) -> Result<(), u64> {
        self.fits(key, t, cost)?;
        self.charge(key, t, cost);
        Ok(())
    }
}

/// Epoch-aligned fixed windows: windows `[kP, (k+1)P)` aligned to the clock's origin (the Unix
/// epoch for a trace of Unix times, as envoyproxy/ratelimit counts); at most `L` per window.
#[derive(Debug)]
pub struct FixedWindow {
    limit: u64,
    period: u64,
    /// Key → (window index, count admitted in it).
    keys: HashMap<String, (u64, u64)>,
}

impl FixedWindow {
    /// `limit` per `period` nanoseconds (`period` > 0).
    #[must_use]
    pub fn new(limit: u64, period: u64) -> Self {
        Self {
            limit,
            period: period.max(1),
            keys: HashMap::new(),
        }
    }

    /// The count of `key`'s window at `t`.
    fn count(&self, key: &str, t: u64) -> u64 {
        match self.keys.get(key) {
            Some(&(w, count)) if w == t / self.period => count,
            _ => 0,
        }
    }
}

impl WindowCounter for FixedWindow {
    fn fits(&self, key: &str, t: u64, cost: u64) -> Result<(), u64> {
        if self.count(key, t) + cost <= self.limit {
            Ok(())
        } else {
            // The next window resets the count (a cost above L never fits; the same wait).
            Err((t / self.period + 1) * self.period - t)
        }
    }

    fn charge(&mut self, key: &str, t: u64, cost: u64) {
        let count = self.count(key, t) + cost;
        self.keys.insert(key.to_string(), (t / self.period, count));
    }
}

/// A log of admitted timestamps: a timestamp per admitted request; at most `L` in `(t − P, t]`.
#[derive(Debug)]
pub struct SlidingLog {
    limit: u64,
    period: u64,
    /// Key → (admitted (time, cost), oldest first; their total cost).
    keys: HashMap<String, (VecDeque<(u64, u64)>, u64)>,
}

impl SlidingLog {
    /// `limit` per `period` nanoseconds.
    #[must_use]
    pub fn new(limit: u64, period: u64) -> Self {
        Self {
            limit,
            period: period.max(1),
            keys: HashMap::new(),
        }
    }

    /// Whether an entry made at `at` still counts at `t`: it is in `(t − P, t]`.
    fn live(&self, at: u64, t: u64) -> bool {
        at + self.period > t
    }
}

impl WindowCounter for SlidingLog {
    fn fits(&self, key: &str, t: u64, cost: u64) -> Result<(), u64> {
        let Some((log, sum)) = self.keys.get(key) else {
            return if cost <= self.limit {
                Ok(())
            } else {
                Err(self.period)
            };
        };
        let expired: u64 = log
            .iter()
            .take_while(|&&(at, _)| !self.live(at, t))
            .map(|&(_, c)| c)
            .sum();
        let sum = sum - expired;
        if sum + cost <= self.limit {
            return Ok(());
        }
        if cost > self.limit {
            return Err(self.period);
        }
        // Wait until enough of the oldest live entries fall out: each leaves at its time + P.
        let mut need = sum + cost - self.limit;
        for &(at, c) in log.iter().filter(|&&(at, _)| self.live(at, t)) {
            if c >= need {
                return Err(at + self.period - t);
            }
            need -= c;
        }
        Err(self.period)
    }

    fn charge(&mut self, key: &str, t: u64, cost: u64) {
        let period = self.period;
        let (log, sum) = self.keys.entry(key.to_string()).or_default();
        while let Some(&(at, c)) = log.front() {
            if at + period > t {
                break;
            }
            log.pop_front();
            *sum -= c;
        }
        log.push_back((t, cost));
        *sum += cost;
    }
}

/// The weighted two-window estimate (Cloudflare's 2017 design): two counters per key, this
/// window's `c` and the previous one's `p`, and the estimate `p · (P − e) / P + c` where `e` is
/// the time since this window began; admitted while the estimate plus the cost is at most `L`.
/// Computed exactly as `p · (P − e) + (c + cost) · P ≤ L · P` in 128 bits.
#[derive(Debug)]
pub struct SlidingWindow {
    limit: u64,
    period: u64,
    /// Key → (window index, this window's count, the previous window's count).
    keys: HashMap<String, (u64, u64, u64)>,
}

impl SlidingWindow {
    /// `limit` per `period` nanoseconds.
    #[must_use]
    pub fn new(limit: u64, period: u64) -> Self {
        Self {
            limit,
            period: period.max(1),
            keys: HashMap::new(),
        }
    }

    /// Whether `cost` more fits at `t` given the counts `(window, current, previous)`.
    fn fits(&self, state: (u64, u64, u64), t: u64, cost: u64) -> bool {
        let (current, previous) = roll(state, t / self.period);
        let elapsed = t % self.period;
        let p = u128::from(self.period);
        u128::from(previous) * (p - u128::from(elapsed)) + u128::from(current + cost) * p
            <= u128::from(self.limit) * p
    }

    fn state(&self, key: &str, t: u64) -> (u64, u64, u64) {
        *self.keys.get(key).unwrap_or(&(t / self.period, 0, 0))
    }
}

/// `(current, previous)` counts as seen from window `now`.
fn roll((window, current, previous): (u64, u64, u64), now: u64) -> (u64, u64) {
    match now.saturating_sub(window) {
        0 => (current, previous),
        1 => (0, current),
        _ => (0, 0),
    }
}

impl WindowCounter for SlidingWindow {
    fn fits(&self, key: &str, t: u64, cost: u64) -> Result<(), u64> {
        let state = self.state(key, t);
        if self.fits(state, t, cost) {
            return Ok(());
        }
        if cost > self.limit {
            return Err(self.period);
        }
        // The estimate only falls as time passes without admissions, and within two periods
        // both counts are gone: the first time it fits is found by bisection.
        let (mut lo, mut hi) = (0, 2 * self.period - t % self.period);
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if self.fits(state, t + mid, cost) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Err(hi)
    }

    fn charge(&mut self, key: &str, t: u64, cost: u64) {
        let now = t / self.period;
        let (current, previous) = roll(self.state(key, t), now);
        self.keys
            .insert(key.to_string(), (now, current + cost, previous));
    }
}

/// The most admitted in any closed span of `span` nanoseconds, over timestamps fed in order, by
/// a sliding maximum over the admitted timestamps.
#[derive(Debug)]
pub struct Peak {
    span: u64,
    window: VecDeque<(u64, u64)>,
    sum: u64,
    max: u64,
}

impl Peak {
    /// A peak over spans of `span` nanoseconds.
    #[must_use]
    pub fn new(span: u64) -> Self {
        Self {
            span,
            window: VecDeque::new(),
            sum: 0,
            max: 0,
        }
    }

    /// Adds `cost` admitted at `t` (never earlier than the last `t`).
    pub fn add(&mut self, t: u64, cost: u64) {
        // Hits at the same instant share one entry, so a burst costs one slot.
        match self.window.back_mut() {
            Some((at, c)) if *at == t => *c += cost,
            _ => self.window.push_back((t, cost)),
        }
        self.sum += cost;
        while let Some(&(at, c)) = self.window.front() {
            if t - at <= self.span {
                break;
            }
            self.window.pop_front();
            self.sum -= c;
        }
        self.max = self.max.max(self.sum);
    }

    /// The most seen in one span so far.
    #[must_use]
    pub fn max(&self) -> u64 {
        self.max
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;
    const MS: u64 = 1_000_000;

    fn run(c: &mut dyn WindowCounter, times: &[u64]) -> u64 {
        times
            .iter()
            .filter(|&&t| c.admit("k", t, 1).is_ok())
            .count() as u64
    }

    #[test]
    fn fixed_window_resets_at_the_boundary() {
        let mut fw = FixedWindow::new(100, 60 * S);
        // 100 at 59.9 s fill window 0; 100 at 60.1 s fill window 1: 200 in 0.2 s.
        let times: Vec<u64> = [59_900 * MS; 101]
            .into_iter()
            .chain([60_100 * MS; 101])
            .collect();
        assert_eq!(run(&mut fw, &times), 200);
        // The 102nd waits for window 2, which starts at 120 s: 120 − 60.1 = 59.9 s.
        assert_eq!(fw.admit("k", 60_100 * MS, 1), Err(59_900 * MS));
        assert!(fw.admit("other", 60_100 * MS, 1).is_ok(), "keys are apart");
    }

    #[test]
    fn sliding_log_counts_the_last_period_exactly() {
        let mut log = SlidingLog::new(3, 10 * S);
        assert_eq!(run(&mut log, &[0, S, 2 * S, 3 * S]), 3);
        // The first entry (0 s) leaves at 10 s: 7 s after 3 s.
        assert_eq!(log.admit("k", 3 * S, 1), Err(7 * S));
        assert_eq!(log.admit("k", 10 * S - 1, 1), Err(1));
        assert!(log.admit("k", 10 * S, 1).is_ok());
        assert_eq!(log.admit("k", 10 * S, 4), Err(10 * S), "above L never fits");
    }

    #[test]
    fn sliding_window_weights_the_previous_window() {
        let mut sw = SlidingWindow::new(10, 10 * S);
        // 10 in window 0 (at 5 s) fill it.
        assert_eq!(run(&mut sw, &[5 * S; 11]), 10);
        // At 12 s, e = 2 s: estimate 10 · 8/10 + 0 = 8, so 2 more fit, the 3rd does not.
        assert_eq!(run(&mut sw, &[12 * S; 3]), 2);
        // Estimate 10 · (10 − e)/10 + 2 + 1 ≤ 10 ⇔ e ≥ 3 s: at 13 s, 1 s from 12 s.
        assert_eq!(sw.admit("k", 12 * S, 1), Err(S));
        assert!(sw.admit("k", 13 * S, 1).is_ok());
        // Two windows later both counts are gone.
        assert_eq!(run(&mut sw, &[30 * S; 11]), 10);
    }

    #[test]
    fn fits_counts_nothing() {
        let mut counters: [Box<dyn WindowCounter>; 3] = [
            Box::new(FixedWindow::new(2, 10 * S)),
            Box::new(SlidingLog::new(2, 10 * S)),
            Box::new(SlidingWindow::new(2, 10 * S)),
        ];
        for c in &mut counters {
            for _ in 0..5 {
                assert_eq!(c.fits("k", S, 2), Ok(()));
            }
            assert_eq!(c.admit("k", S, 2), Ok(()));
            assert!(c.fits("k", S, 1).is_err());
        }
    }

    #[test]
    fn peak_is_the_busiest_closed_span() {
        let mut p = Peak::new(S);
        for t in [0, 500 * MS, S, S + 1, 3 * S] {
            p.add(t, 1);
        }
        // [0, 1 s] holds 0, 0.5 s and 1 s; [0.5 s, 1.5 s] holds 0.5, 1, 1 s + 1 ns.
        assert_eq!(p.max(), 3);
        p.add(3 * S, 5);
        assert_eq!(p.max(), 6);
    }
}
