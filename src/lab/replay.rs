//! The replay engine: requests at given times through the server's own [`Decider::decide`]
//! on a [`ManualClock`] set to each request's time (the in-memory backend, which never
//! awaits), and, for comparison, through the three counters of [`super::algorithms`] with
//! each matched rule's limit. Every algorithm answers a whole request as the server does, all
//! or nothing: it goes through only when each of its counted descriptors fits, and only then is
//! each charged; spend reported after the work (a descriptor's own `hits_addend` above 0) is
//! recorded whatever the answer, as the server records it and as the reference's `INCRBY`
//! lands. A request whose cost is known only at its end ([`Lab::offer_usage`]) is the AI
//! Gateway's recipe: a check of cost 0 on arrival and, when admitted, its tokens reported at its
//! end. What each let through is tallied per rule ([`Tally`]). A rule's `delay` is replayed by
//! the lab's own model ([`Algorithm::GcraDelay`], [`DelayingGcra`]), never by holding the
//! decider: a delayed request is tallied as admitted at its slot, with the wait it paid.

use std::collections::{BTreeMap, HashMap};
use std::ops::Not;
use std::sync::Arc;

use futures_util::FutureExt;
use serde::Serialize;

use crate::decision::{Code, DecideError, Decider, Options, Request};
use crate::limiter::gcra::NANOS_PER_SEC;
use crate::limiter::{Backend, ManualClock, MemoryStore, Quota};
use crate::metrics::Metrics;
use crate::policy::{Limit, PolicyHandle, PolicySet, Rule};

use super::algorithms::{FixedWindow, Peak, SlidingLog, SlidingWindow, WindowCounter};
use super::delay::DelayingGcra;
use super::trace::Usage;

/// Where the decider's clock stands at a trace's time 0, so that no request is ever decided
/// at time 0 (a TAT of 0 means a fresh key). GCRA does not depend on the origin; the
/// comparison windows use the trace's own times.
const ORIGIN: u64 = 1_000_000 * NANOS_PER_SEC;

/// The width of one bin of the per-rule timeline.
pub const BIN_NS: u64 = 100_000_000;

/// A counting algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Algorithm {
    /// sluice's GCRA, through the real decider.
    Gcra,
    /// Epoch-aligned fixed windows.
    FixedWindow,
    /// A log of admitted timestamps.
    SlidingLog,
    /// The weighted two-window counter.
    SlidingWindow,
    /// GCRA with each rule's `delay` (none: refused at once, as [`Algorithm::Gcra`]), modelled
    /// in the lab: a request whose slot comes within the delay is admitted at its slot.
    GcraDelay,
}

impl Algorithm {
    /// The two a token trace is replayed with: GCRA, whose debt is repaid at the rule's rate,
    /// and the reference's fixed window, whose count forgets the debt at the boundary.
    pub const TOKENS: [Self; 2] = [Self::Gcra, Self::FixedWindow];

    /// All four counters, GCRA first.
    pub const ALL: [Self; 4] = [
        Self::Gcra,
        Self::FixedWindow,
        Self::SlidingLog,
        Self::SlidingWindow,
    ];

    /// The one a rule's `delay` is replayed with.
    pub const DELAY: [Self; 1] = [Self::GcraDelay];

    /// Every algorithm, in the order reports list them.
    pub const EVERY: [Self; 5] = [
        Self::Gcra,
        Self::FixedWindow,
        Self::SlidingLog,
        Self::SlidingWindow,
        Self::GcraDelay,
    ];

    /// The name reports use.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Gcra => "gcra",
            Self::FixedWindow => "fixed_window",
            Self::SlidingLog => "sliding_log",
            Self::SlidingWindow => "sliding_window",
            Self::GcraDelay => "gcra_delay",
        }
    }
}

/// What one algorithm said to one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// Whether the whole request went through.
    pub admitted: bool,
    /// When refused, the `Retry-After` a client would be given, in whole seconds (rounded up).
    pub retry_after: u64,
}

/// Why a replay stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The decider refused the request (the server would answer 400).
    #[error("{0}")]
    Request(#[from] DecideError),
    /// The in-memory decision awaited, which it never does.
    #[error("the in-memory decision did not complete without waiting")]
    Pending,
}

/// One algorithm's tally for one rule. It counts hits (a request's cost, 1 unless `hitsAddend`
/// says otherwise) of the requests that reached the rule, over all of its keys together: what
/// the service behind it receives. For a request whose cost is reported after the work, its
/// tokens: admitted when they are reported (at its end), refused when it arrives.
#[derive(Debug, Serialize)]
pub struct Tally {
    /// Hits admitted.
    pub admitted: u64,
    /// Hits refused.
    pub denied: u64,
    /// The most admitted in any 1 s.
    pub worst_second: u64,
    /// The most admitted in any span of the rule's period.
    pub worst_period: u64,
    /// The most offered (admitted or not) in any 1 s.
    pub offered_worst_second: u64,
    /// Requests whose cost is reported after the work: how many were admitted and refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub calls: Option<Calls>,
    /// With [`Algorithm::GcraDelay`]: the waits paid by the requests admitted at their slot.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waits: Option<Waits>,
    /// The longest wait paid per [`BIN_NS`] of arrival, in nanoseconds, by bin index.
    #[serde(skip)]
    pub wait_bins: BTreeMap<u64, u64>,
    /// Admitted per [`BIN_NS`], by bin index (time / `BIN_NS`).
    #[serde(skip)]
    pub bins: BTreeMap<u64, u64>,
    /// Refused per [`BIN_NS`], by bin index.
    #[serde(skip)]
    pub refused_bins: BTreeMap<u64, u64>,
    #[serde(skip)]
    second: Peak,
    #[serde(skip)]
    period: Peak,
    #[serde(skip)]
    offered: Peak,
}

impl Tally {
    fn new(period: u64) -> Self {
        Self {
            admitted: 0,
            denied: 0,
            worst_second: 0,
            worst_period: 0,
            offered_worst_second: 0,
            calls: None,
            waits: None,
            wait_bins: BTreeMap::new(),
            bins: BTreeMap::new(),
            refused_bins: BTreeMap::new(),
            second: Peak::new(NANOS_PER_SEC),
            period: Peak::new(period),
            offered: Peak::new(NANOS_PER_SEC),
        }
    }

    fn count(&mut self, t: u64, cost: u64, admitted: bool) {
        self.offer(t, cost);
        if admitted {
            self.admit(t, cost);
        } else {
            self.deny(t, cost);
        }
    }

    fn offer(&mut self, t: u64, cost: u64) {
        self.offered.add(t, cost);
        self.offered_worst_second = self.offered.max();
    }

    fn admit(&mut self, t: u64, cost: u64) {
        self.admitted += cost;
        self.second.add(t, cost);
        self.period.add(t, cost);
        self.worst_second = self.second.max();
        self.worst_period = self.period.max();
        *self.bins.entry(t / BIN_NS).or_default() += cost;
    }

    fn deny(&mut self, t: u64, cost: u64) {
        self.denied += cost;
        *self.refused_bins.entry(t / BIN_NS).or_default() += cost;
    }

    /// A request offered at `t` admitted at its slot `wait` later: its wait (the admission
    /// itself is tallied at the slot).
    fn held(&mut self, t: u64, cost: u64, wait: u64) {
        let w = self.waits.get_or_insert_default();
        w.delayed += cost;
        w.longest_ns = w.longest_ns.max(wait);
        w.total_ns += u128::from(wait) * u128::from(cost);
        w.mean_ns = u64::try_from(w.total_ns / u128::from(w.delayed)).unwrap_or(u64::MAX);
        let bin = self.wait_bins.entry(t / BIN_NS).or_default();
        *bin = (*bin).max(wait);
    }

    /// A request whose cost is reported after the work, offered at `t`: counted as a call, and
    /// its tokens refused now when it is (when admitted, they count when reported).
    fn call(&mut self, t: u64, tokens: u64, admitted: bool) {
        self.offer(t, tokens);
        let calls = self.calls.get_or_insert_default();
        if admitted {
            calls.admitted += 1;
        } else {
            calls.denied += 1;
            self.deny(t, tokens);
        }
    }
}

/// The waits of the hits admitted at their slot rather than at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Waits {
    /// Hits admitted late, at their slot.
    pub delayed: u64,
    /// The longest wait paid, in nanoseconds.
    pub longest_ns: u64,
    /// The mean wait of the delayed hits, in nanoseconds.
    pub mean_ns: u64,
    #[serde(skip)]
    total_ns: u128,
}

/// Requests whose cost is reported after the work, by their check's answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Calls {
    /// Passed the check of cost 0; their tokens were then reported.
    pub admitted: u64,
    /// Refused at the check; they spent nothing.
    pub denied: u64,
}

/// The four tallies of one rule (only those that ran).
#[derive(Debug, Default, Serialize)]
pub struct Algorithms {
    /// sluice.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gcra: Option<Tally>,
    /// Fixed window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fixed_window: Option<Tally>,
    /// Sliding log.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sliding_log: Option<Tally>,
    /// Sliding window counter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<Tally>,
    /// GCRA with the rule's delay.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gcra_delay: Option<Tally>,
}

impl Algorithms {
    /// The tally of `a`, if it ran.
    #[must_use]
    pub fn get(&self, a: Algorithm) -> Option<&Tally> {
        match a {
            Algorithm::Gcra => self.gcra.as_ref(),
            Algorithm::FixedWindow => self.fixed_window.as_ref(),
            Algorithm::SlidingLog => self.sliding_log.as_ref(),
            Algorithm::SlidingWindow => self.sliding_window.as_ref(),
            Algorithm::GcraDelay => self.gcra_delay.as_ref(),
        }
    }

    fn slot(&mut self, a: Algorithm) -> &mut Option<Tally> {
        match a {
            Algorithm::Gcra => &mut self.gcra,
            Algorithm::FixedWindow => &mut self.fixed_window,
            Algorithm::SlidingLog => &mut self.sliding_log,
            Algorithm::SlidingWindow => &mut self.sliding_window,
            Algorithm::GcraDelay => &mut self.gcra_delay,
        }
    }

    /// Moves the tallies of `other` that ran into this one.
    pub fn merge(&mut self, other: Self) {
        let Self {
            gcra,
            fixed_window,
            sliding_log,
            sliding_window,
            gcra_delay,
        } = other;
        for (a, t) in [
            (Algorithm::Gcra, gcra),
            (Algorithm::FixedWindow, fixed_window),
            (Algorithm::SlidingLog, sliding_log),
            (Algorithm::SlidingWindow, sliding_window),
            (Algorithm::GcraDelay, gcra_delay),
        ] {
            if t.is_some() {
                *self.slot(a) = t;
            }
        }
    }
}

/// One rule's results.
#[derive(Debug, Serialize)]
pub struct RuleReport {
    /// The domain.
    pub domain: String,
    /// The rule's stats key, as `/rlconfig` writes it.
    pub path: String,
    /// `rate_limit.name`, empty when none.
    pub name: String,
    /// `requests_per_unit`.
    pub limit: u32,
    /// The period in seconds.
    pub period_seconds: u64,
    /// The bucket.
    pub burst: u32,
    /// Whether the burst was written in the policy.
    pub burst_set: bool,
    /// The rule's `delay` in nanoseconds (0: none).
    #[serde(skip_serializing_if = "is_zero")]
    pub delay_ns: u64,
    /// Per algorithm.
    pub algorithms: Algorithms,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The results of a replay, rules in the order they were first matched.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    /// Requests decided (a token trace's check and report are one request).
    pub requests: u64,
    /// Whether requests of the replay had their cost reported after the work (tokens).
    #[serde(skip_serializing_if = "<&bool>::not")]
    pub tokens: bool,
    /// Per rule.
    pub rules: Vec<RuleReport>,
}

impl Report {
    /// The rule `path` of `domain`.
    #[must_use]
    pub fn rule(&self, domain: &str, path: &str) -> Option<&RuleReport> {
        self.rules
            .iter()
            .find(|r| r.domain == domain && r.path == path)
    }

    /// Moves the tallies of `other`'s rules into the same rules of this report (adding the
    /// rules this one lacks), for runs of one algorithm each.
    pub fn merge(&mut self, other: Self) {
        self.requests = self.requests.max(other.requests);
        self.tokens |= other.tokens;
        for rule in other.rules {
            match self
                .rules
                .iter_mut()
                .find(|r| r.domain == rule.domain && r.path == rule.path)
            {
                Some(mine) => mine.algorithms.merge(rule.algorithms),
                None => self.rules.push(rule),
            }
        }
    }
}

/// The comparison counters of one rule.
struct Comparisons {
    fixed_window: FixedWindow,
    sliding_log: SlidingLog,
    sliding_window: SlidingWindow,
    gcra_delay: DelayingGcra,
}

impl Comparisons {
    fn counter(&mut self, a: Algorithm) -> Option<&mut dyn WindowCounter> {
        match a {
            Algorithm::Gcra | Algorithm::GcraDelay => None,
            Algorithm::FixedWindow => Some(&mut self.fixed_window),
            Algorithm::SlidingLog => Some(&mut self.sliding_log),
            Algorithm::SlidingWindow => Some(&mut self.sliding_window),
        }
    }
}

/// A running replay.
pub struct Lab {
    decider: Decider,
    clock: Arc<ManualClock>,
    algorithms: Vec<Algorithm>,
    /// Rule id → index into `report.rules` and `comparisons`.
    index: HashMap<u128, usize>,
    comparisons: Vec<Comparisons>,
    /// Token reports not yet made, by (end, order offered): the request as reported, its
    /// tokens, and the algorithms that admitted it.
    pending: BTreeMap<(u64, u64), (Request, u64, Vec<Algorithm>)>,
    /// Requests admitted at a later slot by [`Algorithm::GcraDelay`], by (slot, order offered):
    /// each counted descriptor's rule slot and cost, tallied as admitted at the slot.
    held: BTreeMap<(u64, u64), Vec<(usize, u64)>>,
    offered: u64,
    report: Report,
}

/// How [`Lab::decide`] tallies what it decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tallying {
    /// Each descriptor's cost, admitted or refused with the request.
    Hits,
    /// A check of a request whose cost comes at its end: its tokens, as a call.
    Call(u64),
    /// Tokens reported for work done: admitted spend.
    Spend,
}

impl std::fmt::Debug for Lab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lab")
            .field("algorithms", &self.algorithms)
            .field("requests", &self.report.requests)
            .finish_non_exhaustive()
    }
}

impl Lab {
    /// A lab over `policies` running `algorithms`.
    #[must_use]
    pub fn new(policies: PolicySet, algorithms: &[Algorithm]) -> Self {
        let clock = Arc::new(ManualClock::new(ORIGIN));
        let decider = Decider::new(
            PolicyHandle::new(policies),
            Backend::memory(MemoryStore::new(), clock.clone()),
            Arc::new(Metrics::install(100)),
            Options::default(),
        );
        Self {
            decider,
            clock,
            algorithms: algorithms.to_vec(),
            index: HashMap::new(),
            comparisons: Vec::new(),
            pending: BTreeMap::new(),
            held: BTreeMap::new(),
            offered: 0,
            report: Report::default(),
        }
    }

    /// Decides `req` at `t` (nanoseconds on the trace's clock, never earlier than the last).
    ///
    /// # Errors
    ///
    /// [`ReplayError`] when the request is malformed.
    pub fn offer(&mut self, t: u64, req: &Request) -> Result<Vec<Verdict>, ReplayError> {
        self.settle(t)?;
        self.report.requests += 1;
        let all = self.algorithms.clone();
        self.decide(t, req, &all, Tallying::Hits)
    }

    /// Offers at `t` a request whose cost is reported after the work, as Envoy AI Gateway sends
    /// one: each descriptor checked with a `hits_addend` of 0 now and, for each algorithm that
    /// admits it, reported with a `hits_addend` of `usage.tokens` at its end (`t +
    /// usage.duration`), decided in time order with the other requests. The verdicts are the
    /// check's.
    ///
    /// # Errors
    ///
    /// [`ReplayError`] when the request is malformed.
    pub fn offer_usage(
        &mut self,
        t: u64,
        req: &Request,
        usage: Usage,
    ) -> Result<Vec<Verdict>, ReplayError> {
        self.settle(t)?;
        self.report.requests += 1;
        self.report.tokens = true;
        let with_cost = |cost: u64| {
            let mut r = req.clone();
            for d in &mut r.descriptors {
                d.hits_addend = Some(cost);
                d.is_negative_hits = false;
            }
            r
        };
        let all = self.algorithms.clone();
        let verdicts = self.decide(t, &with_cost(0), &all, Tallying::Call(usage.tokens))?;
        let admitted: Vec<Algorithm> = verdicts
            .iter()
            .filter(|v| v.admitted)
            .map(|v| v.algorithm)
            .collect();
        // A report of 0 tokens is a check of its own, and records nothing.
        if !admitted.is_empty() && usage.tokens > 0 {
            let end = t.saturating_add(usage.duration);
            self.offered += 1;
            self.pending.insert(
                (end, self.offered),
                (with_cost(usage.tokens), usage.tokens, admitted),
            );
        }
        Ok(verdicts)
    }

    /// Makes every pending token report due by `t`, in time order, and tallies the delayed
    /// admissions whose slot has come.
    fn settle(&mut self, t: u64) -> Result<(), ReplayError> {
        while let Some(entry) = self.held.first_entry() {
            if entry.key().0 > t {
                break;
            }
            let ((slot, _), hits) = entry.remove_entry();
            for (rule, cost) in hits {
                if let Some(tally) = self.report.rules[rule].algorithms.gcra_delay.as_mut() {
                    tally.admit(slot, cost);
                }
            }
        }
        while let Some(entry) = self.pending.first_entry() {
            if entry.key().0 > t {
                break;
            }
            let ((end, _), (req, _, algorithms)) = entry.remove_entry();
            self.decide(end, &req, &algorithms, Tallying::Spend)?;
        }
        Ok(())
    }

    /// Decides `req` at `t` with `algorithms`, tallied as `tallying` says.
    fn decide(
        &mut self,
        t: u64,
        req: &Request,
        algorithms: &[Algorithm],
        tallying: Tallying,
    ) -> Result<Vec<Verdict>, ReplayError> {
        self.clock.set(ORIGIN + t);
        // The decider matches the rules for every algorithm; when GCRA is not among them it
        // only checks (cost 0 everywhere), so its counters stay as GCRA left them.
        let check;
        let decided = if algorithms.contains(&Algorithm::Gcra) {
            req
        } else {
            let mut r = req.clone();
            for d in &mut r.descriptors {
                d.hits_addend = Some(0);
            }
            check = r;
            &check
        };
        let decision = self
            .decider
            .decide(decided)
            .now_or_never()
            .ok_or(ReplayError::Pending)??;
        let gcra_admitted = decision.overall == Code::Ok;
        let gcra_retry = decision
            .statuses
            .iter()
            .filter(|s| s.code == Code::OverLimit)
            .filter_map(|s| s.reset_seconds)
            .max()
            .unwrap_or(0);
        // The counted descriptors: (rule slot, counter key, cost, spend reported after the work).
        let mut counted: Vec<(usize, String, u64, bool)> =
            Vec::with_capacity(req.descriptors.len());
        for (i, status) in decision.statuses.iter().enumerate() {
            let Some(rule) = status.limit.as_ref().and_then(|l| l.rule.as_ref()) else {
                continue;
            };
            if req.descriptors[i].is_negative_hits {
                continue;
            }
            let mut key = String::new();
            for e in &req.descriptors[i].entries {
                key.push_str(&e.key);
                key.push('\u{1f}');
                key.push_str(&e.value);
                key.push('\u{1e}');
            }
            let spent = req.descriptors[i].hits_addend.is_some_and(|n| n > 0);
            counted.push((self.rule_slot(&req.domain, rule), key, req.cost(i), spent));
        }
        let mut verdicts = Vec::with_capacity(algorithms.len());
        for &algorithm in algorithms {
            let mut delayed = 0;
            let (admitted, retry_after) = if algorithm == Algorithm::Gcra {
                (gcra_admitted, gcra_retry)
            } else if algorithm == Algorithm::GcraDelay {
                let (admitted, wait) = self.decide_delayed(t, &counted);
                delayed = if admitted { wait } else { 0 };
                (
                    admitted,
                    if admitted {
                        0
                    } else {
                        wait.div_ceil(NANOS_PER_SEC)
                    },
                )
            } else {
                // As the server decides: spend reported is recorded first, whatever fits (as
                // the reference's INCRBY always lands); then the request is admitted only when
                // every counted descriptor fitted, and only then are the others charged.
                let mut wait: Option<u64> = None;
                let mut over = |w: u64| wait = Some(wait.unwrap_or(0).max(w));
                for (slot, key, cost, _) in counted.iter().filter(|c| c.3) {
                    if let Some(c) = self.comparisons[*slot].counter(algorithm) {
                        if let Err(w) = c.fits(key, t, *cost) {
                            over(w);
                        }
                        c.charge(key, t, *cost);
                    }
                }
                for (slot, key, cost, _) in counted.iter().filter(|c| !c.3) {
                    if let Some(Err(w)) = self.comparisons[*slot]
                        .counter(algorithm)
                        .map(|c| c.fits(key, t, *cost))
                    {
                        over(w);
                    }
                }
                if wait.is_none() {
                    for (slot, key, cost, _) in counted.iter().filter(|c| !c.3) {
                        if let Some(c) = self.comparisons[*slot].counter(algorithm) {
                            c.charge(key, t, *cost);
                        }
                    }
                }
                (
                    wait.is_none(),
                    wait.map_or(0, |w| w.div_ceil(NANOS_PER_SEC)),
                )
            };
            if delayed > 0 && tallying == Tallying::Hits {
                // Admitted at its slot: the wait now, the admission when the slot comes.
                self.offered += 1;
                let mut hits = Vec::with_capacity(counted.len());
                for (slot, _, cost, _) in &counted {
                    if let Some(tally) = self.report.rules[*slot].algorithms.slot(algorithm) {
                        tally.offer(t, *cost);
                        tally.held(t, *cost, delayed);
                        hits.push((*slot, *cost));
                    }
                }
                self.held.insert((t + delayed, self.offered), hits);
                verdicts.push(Verdict {
                    algorithm,
                    admitted,
                    retry_after,
                });
                continue;
            }
            for (slot, _, cost, _) in &counted {
                if let Some(tally) = self.report.rules[*slot].algorithms.slot(algorithm) {
                    match tallying {
                        Tallying::Hits => tally.count(t, *cost, admitted),
                        Tallying::Call(tokens) => tally.call(t, tokens, admitted),
                        Tallying::Spend => tally.admit(t, *cost),
                    }
                }
            }
            verdicts.push(Verdict {
                algorithm,
                admitted,
                retry_after,
            });
        }
        Ok(verdicts)
    }

    /// [`Algorithm::GcraDelay`]'s answer to a request of `counted` descriptors at `t`, as the
    /// server answers a request with a delaying rule, all or nothing: spend reported after the
    /// work is recorded whatever the answer; the request is admitted when every other
    /// descriptor's slot comes within its rule's delay, at the latest of those slots, each
    /// charged at its own (the claim of each counter). `(admitted, wait)`: the wait until its
    /// slot when admitted, until it would fit when refused.
    fn decide_delayed(&mut self, t: u64, counted: &[(usize, String, u64, bool)]) -> (bool, u64) {
        for (slot, key, cost, _) in counted.iter().filter(|c| c.3) {
            self.comparisons[*slot].gcra_delay.record(key, t, *cost);
        }
        let mut slot_wait = 0;
        let mut refused: Option<u64> = None;
        let mut waits = Vec::with_capacity(counted.len());
        for (slot, key, cost, _) in counted.iter().filter(|c| !c.3) {
            match self.comparisons[*slot].gcra_delay.fits(key, t, *cost) {
                Ok(w) => {
                    slot_wait = slot_wait.max(w);
                    waits.push(w);
                }
                Err(w) => refused = Some(refused.unwrap_or(0).max(w)),
            }
        }
        if let Some(wait) = refused {
            return (false, wait);
        }
        for ((slot, key, cost, _), w) in counted.iter().filter(|c| !c.3).zip(waits) {
            self.comparisons[*slot].gcra_delay.charge(key, t, w, *cost);
        }
        (true, slot_wait)
    }

    /// The slot of `rule`, made on first sight.
    fn rule_slot(&mut self, domain: &str, rule: &Rule) -> usize {
        if let Some(&i) = self.index.get(&rule.id) {
            return i;
        }
        let (limit, period, burst, burst_set) = match rule.limit {
            Limit::Limited(r) => (r.requests_per_unit, r.quota.period(), r.burst, r.burst_set),
            Limit::Unlimited => (u32::MAX, NANOS_PER_SEC, u32::MAX, false),
        };
        let (quota, delay_ns) = match rule.limit {
            Limit::Limited(r) => (r.quota, r.max_delay_nanos),
            Limit::Unlimited => (
                Quota::new(NANOS_PER_SEC, u64::from(u32::MAX), u64::from(u32::MAX))
                    .unwrap_or(Quota::ban(NANOS_PER_SEC)),
                0,
            ),
        };
        let mut algorithms = Algorithms::default();
        for &a in &self.algorithms {
            *algorithms.slot(a) = Some(Tally::new(period));
        }
        self.report.rules.push(RuleReport {
            domain: domain.to_string(),
            path: rule.stats_key.clone(),
            name: rule.name.clone().unwrap_or_default(),
            limit,
            period_seconds: period / NANOS_PER_SEC,
            burst,
            burst_set,
            delay_ns,
            algorithms,
        });
        let l = u64::from(limit);
        self.comparisons.push(Comparisons {
            fixed_window: FixedWindow::new(l, period),
            sliding_log: SlidingLog::new(l, period),
            sliding_window: SlidingWindow::new(l, period),
            gcra_delay: DelayingGcra::new(quota, delay_ns),
        });
        self.index.insert(rule.id, self.report.rules.len() - 1);
        self.report.rules.len() - 1
    }

    /// The results, once every pending token report is made.
    ///
    /// # Errors
    ///
    /// [`ReplayError`], which a report of a request already decided never causes.
    pub fn finish(mut self) -> Result<Report, ReplayError> {
        self.settle(u64::MAX)?;
        Ok(self.report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::load_str;

    #[test]
    fn every_algorithm_is_tallied_for_the_matched_rule() {
        let set = load_str(&[(
            "p.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 2}\n",
        )])
        .unwrap();
        let mut lab = Lab::new(set, &Algorithm::ALL);
        let req = Request::from_entries("d", &[&[("k", "v")]]);
        for _ in 0..3 {
            lab.offer(5 * NANOS_PER_SEC, &req).unwrap();
        }
        let v = lab.offer(5 * NANOS_PER_SEC, &req).unwrap();
        assert!(v.iter().all(|v| !v.admitted), "{v:?}");
        // GCRA waits T = 0.5 s, the windows 1 s; the weighted estimate 2 · (1 − e) + 1 ≤ 2
        // needs e ≥ 0.5 s into the next window: 1.5 s. Retry-After rounds each up.
        let retry: Vec<u64> = v.iter().map(|v| v.retry_after).collect();
        assert_eq!(retry, [1, 1, 1, 2]);
        // Unmatched requests are decided but tallied nowhere.
        lab.offer(
            6 * NANOS_PER_SEC,
            &Request::from_entries("d", &[&[("x", "y")]]),
        )
        .unwrap();
        let report = lab.finish().unwrap();
        assert_eq!(report.requests, 5);
        let rule = report.rule("d", "d.k").unwrap();
        for a in Algorithm::ALL {
            let t = rule.algorithms.get(a).unwrap();
            // 2 per second, 4 at once: 2 admitted, 2 denied, by every algorithm.
            assert_eq!((t.admitted, t.denied, t.worst_second), (2, 2, 2), "{a:?}");
        }
    }

    #[test]
    fn the_delay_model_without_delay_is_the_servers_gcra_and_with_it_admits_at_slots() {
        let set = load_str(&[(
            "p.yaml",
            "domain: d\ndescriptors:\n  - key: plain\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 5}\n  - key: held\n    rate_limit: {unit: second, requests_per_unit: 10, burst: 5, delay: 1s}\n",
        )])
        .unwrap();
        // The server's decider beside the model on the rule without delay: the same answers.
        let mut lab = Lab::new(set.clone(), &[Algorithm::Gcra, Algorithm::GcraDelay]);
        let plain = Request::from_entries("d", &[&[("plain", "x")]]);
        let s = NANOS_PER_SEC;
        for i in 0..300 {
            let v = lab.offer(5 * s + i * 3_000_000, &plain).unwrap();
            assert_eq!(v[0].admitted, v[1].admitted, "request {i}: {v:?}");
            assert_eq!(v[0].retry_after, v[1].retry_after, "request {i}: {v:?}");
        }
        let report = lab.finish().unwrap();
        let rule = report.rule("d", "d.plain").unwrap();
        let (g, m) = (
            rule.algorithms.gcra.as_ref().unwrap(),
            rule.algorithms.gcra_delay.as_ref().unwrap(),
        );
        assert_eq!(
            (g.admitted, g.denied, g.worst_second),
            (m.admitted, m.denied, m.worst_second)
        );
        assert_eq!(m.waits, None, "nothing held without delay");
        // With delay: 100 at once, 5 now, 10 at their slots 100 ms apart (tallied there).
        let mut lab = Lab::new(set, &Algorithm::DELAY);
        let held = Request::from_entries("d", &[&[("held", "x")]]);
        for _ in 0..100 {
            lab.offer(5 * s, &held).unwrap();
        }
        let report = lab.finish().unwrap();
        let rule = report.rule("d", "d.held").unwrap();
        assert_eq!(rule.delay_ns, s);
        let m = rule.algorithms.gcra_delay.as_ref().unwrap();
        assert_eq!((m.admitted, m.denied), (15, 85));
        let w = m.waits.unwrap();
        assert_eq!((w.delayed, w.longest_ns, w.mean_ns), (10, s, 550_000_000));
        // Admitted per 100 ms: 5 at 5.0 s, then one in each bin from 5.1 s to 6.0 s.
        let bins: Vec<(u64, u64)> = m.bins.iter().map(|(&b, &n)| (b, n)).collect();
        let mut expected = vec![(50, 5)];
        expected.extend((51..=60).map(|b| (b, 1)));
        assert_eq!(bins, expected);
        assert_eq!(
            m.worst_second,
            5 + 10,
            "B + floor(1 s / T) on admission times"
        );
    }

    #[test]
    fn a_request_is_all_or_nothing_for_every_algorithm() {
        let set = load_str(&[(
            "p.yaml",
            "domain: d\ndescriptors:\n  - key: tight\n    rate_limit: {unit: minute, requests_per_unit: 1}\n  - key: wide\n    rate_limit: {unit: minute, requests_per_unit: 2}\n",
        )])
        .unwrap();
        let mut lab = Lab::new(set, &Algorithm::ALL);
        let both = Request::from_entries("d", &[&[("tight", "x")], &[("wide", "y")]]);
        let wide = Request::from_entries("d", &[&[("wide", "y")]]);
        let s = NANOS_PER_SEC;
        // The first takes tight's only hit and one of wide's two; the second is refused for
        // tight, so wide is not charged, and a lone wide request still fits.
        assert!(lab.offer(s, &both).unwrap().iter().all(|v| v.admitted));
        assert!(lab.offer(s, &both).unwrap().iter().all(|v| !v.admitted));
        let v = lab.offer(s, &wide).unwrap();
        assert!(v.iter().all(|v| v.admitted), "{v:?}");
        let report = lab.finish().unwrap();
        for a in Algorithm::ALL {
            let wide = report
                .rule("d", "d.wide")
                .unwrap()
                .algorithms
                .get(a)
                .unwrap();
            assert_eq!((wide.admitted, wide.denied), (2, 1), "{a:?}");
        }
    }
}
