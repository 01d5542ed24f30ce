//! This node's share table: for each limited counter, this node's part of it (told by the
//! fleet, or the whole rule), and the demand and last-sent token bucket of every watched bucket
//! that matches it, one holder per (stream, bucket), in the counter's tokens; and each stream's
//! own watch list, which decides what to send and when. A share is never more than what the
//! other holders' buckets in force leave. The table sits behind one mutex, taken once per report
//! message or tick, never across an `.await` (there is none here). A stream's shares are freed
//! when its [`Watcher`] is dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::{
    Action, ActionKind, BucketId, MOVE_THRESHOLD, Report, RlqsSettings, Strategy, Target,
    TokenBucket, claim, shares, target,
};
use crate::limiter::gcra::{NANOS_PER_SEC, Quota};
use crate::policy::{PolicyHandle, PolicySet};

/// Why a stream is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// `rlqs.max_streams` streams are open.
    #[error("too many quota streams open on this server (rlqs.max_streams)")]
    TooManyStreams,
}

/// The streams of this node and the shares of the counters they watch.
#[derive(Debug)]
pub struct ShareTable {
    settings: RlqsSettings,
    policies: PolicyHandle,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    streams: usize,
    watched: usize,
    next_holder: u64,
    /// The limited counters watched, each with the demand of its holders.
    counters: HashMap<u128, Counter>,
    /// This node's part of a rule whose part the fleet has not told: the whole rule until
    /// [`ShareTable::set_unknown_part`] says otherwise; `None` to assign nothing until told.
    unknown_part: Option<f64>,
    /// Parts told of rules no stream watches (asked for before a first assignment, or left by
    /// the last stream), with when they were told and the count of [`ShareTable::demands`]
    /// calls then: kept for the next join, and dropped two calls later when none came.
    told: HashMap<u128, (f64, u64, u64)>,
    /// Calls of [`ShareTable::demands`] so far.
    rounds: u64,
}

impl Default for Inner {
    fn default() -> Self {
        Self {
            streams: 0,
            watched: 0,
            next_holder: 0,
            counters: HashMap::new(),
            unknown_part: Some(1.0),
            told: HashMap::new(),
            rounds: 0,
        }
    }
}

/// One limited counter this node's streams watch. Its figures are in the counter's tokens (a
/// request of a cost node's bucket costs its cost), so that buckets of different costs on one
/// counter divide one budget.
#[derive(Debug)]
struct Counter {
    quota: Quota,
    /// The rule's rate, in tokens per second.
    rate: f64,
    /// The burst, in tokens: the shape of the buckets sent.
    burst: f64,
    /// Holder → its demand and the rate it was last sent.
    holders: HashMap<u64, Holder>,
    /// This node's part of the rule, a fraction of it, as the fleet table last said,
    /// and when (the fleet's clock, ns).
    part: Option<(f64, u64)>,
    /// Whether a renewal of the part failed since it was last told: its entry in Redis then
    /// lapses a TTL after that, so no assignment of the rule is sent, lest it outlive the part.
    unconfirmed: bool,
}

/// One holder of a counter: a stream's watched bucket.
#[derive(Clone, Copy, Debug)]
struct Holder {
    /// Tokens a request of its bucket costs.
    cost: f64,
    /// Tokens per second, as last reported.
    demand: f64,
    /// The rate of the token bucket it was last sent, in tokens per second (none before).
    sent: f64,
}

impl Counter {
    /// What its holders ask of it, in tokens per second.
    fn asked(&self) -> f64 {
        self.holders
            .values()
            .map(|h| asked(h.demand, self.rate))
            .sum()
    }

    /// The rate, in tokens per second, of the token bucket that a share of `tokens` per second
    /// comes to for a holder of `cost`: its whole tokens per fill.
    fn as_sent(&self, tokens: f64, cost: f64) -> f64 {
        if tokens <= 0.0 {
            return 0.0;
        }
        let b = TokenBucket::of(tokens / cost, self.burst * tokens / (self.rate * cost));
        b.rate() * cost
    }
}

/// A rule this node hands out, as the fleet table is told of it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RuleDemand {
    /// The rule's counter.
    pub counter: u128,
    /// The rule's quota.
    pub quota: Quota,
    /// What this node's streams ask of it, in the counter's tokens per second: each holder's
    /// demand times the cost, at least [`IDLE_DEMAND`](super::IDLE_DEMAND) of the rule and at most the whole rule.
    pub tokens: f64,
}

impl Inner {
    /// Records `holder`'s demand, in requests per second, on `target`'s counter (and the rule's
    /// figures, which a reload may have changed).
    fn join(&mut self, target: &Target, holder: u64, demand: f64) {
        let Target::Shared {
            counter,
            quota,
            cost,
            rate,
            burst,
        } = *target
        else {
            return;
        };
        let told = &mut self.told;
        let c = self.counters.entry(counter).or_insert_with(|| Counter {
            quota,
            rate: rate * cost,
            burst: burst * cost,
            holders: HashMap::new(),
            part: told.remove(&counter).map(|(part, at, _)| (part, at)),
            unconfirmed: false,
        });
        (c.quota, c.rate, c.burst) = (quota, rate * cost, burst * cost);
        let h = c.holders.entry(holder).or_insert(Holder {
            cost,
            demand: 0.0,
            sent: 0.0,
        });
        // A reload may change a bucket's cost under the token bucket it holds: what it was sent
        // stays counted at the cost it was sent at.
        h.sent *= cost / h.cost;
        (h.cost, h.demand) = (cost, demand * cost);
    }

    /// Takes `holder` off `target`'s counter. The counter's last holder takes the counter, and
    /// keeps its part for a while (a stream that reconnects at once finds it).
    fn leave(&mut self, target: &Target, holder: u64) {
        let Target::Shared { counter, .. } = *target else {
            return;
        };
        if let Some(c) = self.counters.get_mut(&counter) {
            c.holders.remove(&holder);
            if c.holders.is_empty() {
                if let Some((part, at)) = c.part {
                    self.told.insert(counter, (part, at, self.rounds));
                }
                self.counters.remove(&counter);
            }
        }
    }

    /// `holder`'s share of `counter`, in its requests per second: of this node's part of the
    /// rule, divided by demand in the counter's tokens, and no more than what the others' token
    /// buckets, as last sent, leave of that part, so that the buckets in force never add up past
    /// it. With it, whether another holder is due more than [`MOVE_THRESHOLD`] over what it
    /// holds, or the buckets in force add up past the part (it shrank): then any share that
    /// shrank is pushed at once, to make room. `None` while the part is unknown and nothing is
    /// to be assigned until told, and while it is unconfirmed (an assignment sent then, with a
    /// whole TTL, would outlive the part's entry in Redis).
    fn share(&self, counter: u128, holder: u64) -> Option<(f64, bool)> {
        let Some(c) = self.counters.get(&counter) else {
            return Some((0.0, false));
        };
        if c.part.is_some() && c.unconfirmed {
            return None;
        }
        let part = c.part.map(|(part, _)| part).or(self.unknown_part)?;
        let capacity = c.rate * part;
        let demands: Vec<f64> = c.holders.values().map(|x| x.demand).collect();
        let fair = shares(demands, capacity, c.rate);
        let (mut mine, mut others, mut starved) = (None, 0.0, false);
        // The map is not changed between the two walks, so they meet its holders in one order.
        for ((h, x), due) in c.holders.iter().zip(&fair) {
            if *h == holder {
                mine = Some((*due, *x));
            } else {
                others += x.sent;
                // Due more than it holds past the move threshold, as the buckets would be sent
                // (a bucket's rate is at most its share, so the share is looked at first).
                let wanted = (1.0 + MOVE_THRESHOLD) * x.sent + 1e-9;
                starved |= !starved && *due > wanted && c.as_sent(*due, x.cost) > wanted;
            }
        }
        let Some((due, x)) = mine else {
            return Some((0.0, false));
        };
        // The part itself shrank (the fleet's table, or a reload) under the buckets in force.
        let over = others + x.sent > capacity * (1.0 + 1e-9) + 1e-9;
        let tokens = due.min((capacity - others).max(0.0));
        Some((tokens / x.cost, starved || over))
    }

    /// The rate, in requests per second, of the token bucket `holder` of `target` was last sent
    /// (0 for none).
    fn sent_rate(&self, target: &Target, holder: u64) -> f64 {
        let Target::Shared { counter, .. } = *target else {
            return 0.0;
        };
        self.counters
            .get(&counter)
            .and_then(|c| c.holders.get(&holder))
            .map_or(0.0, |h| h.sent / h.cost)
    }

    /// Counts `holder` of `target` as holding a token bucket of `rate` requests per second.
    fn hold(&mut self, target: &Target, holder: u64, rate: f64) {
        let Target::Shared { counter, .. } = *target else {
            return;
        };
        if let Some(h) = self
            .counters
            .get_mut(&counter)
            .and_then(|c| c.holders.get_mut(&holder))
        {
            h.sent = rate * h.cost;
        }
    }

    /// Records the strategy sent to `holder` of `target`: the rate of a token bucket, none else.
    fn sent(&mut self, target: &Target, holder: u64, strategy: Strategy) {
        let rate = match strategy {
            Strategy::TokenBucket(b) => b.rate(),
            Strategy::AllowAll | Strategy::DenyAll => 0.0,
        };
        self.hold(target, holder, rate);
    }
}

/// `part` as a fraction of a rule: within 0..=1, and none for a part that is not a number.
fn fraction(part: f64) -> f64 {
    if part.is_nan() {
        0.0
    } else {
        part.clamp(0.0, 1.0)
    }
}

/// What a holder asking for `demand` tokens per second asks of a rule of `rate` tokens per second:
/// its claim, at least [`IDLE_DEMAND`](super::IDLE_DEMAND) of the rule and at most the whole rule ([`claim`]).
fn asked(demand: f64, rate: f64) -> f64 {
    claim(demand, rate)
}

impl ShareTable {
    /// An empty table, matching buckets against `policies`.
    #[must_use]
    pub fn new(settings: RlqsSettings, policies: PolicyHandle) -> Self {
        Self {
            settings,
            policies,
            inner: Mutex::default(),
        }
    }

    /// The settings.
    #[must_use]
    pub fn settings(&self) -> &RlqsSettings {
        &self.settings
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The policies buckets are matched against now.
    #[must_use]
    pub fn policies(&self) -> Arc<PolicySet> {
        self.policies.load()
    }

    /// Streams open, and buckets watched over all of them.
    #[must_use]
    pub fn figures(&self) -> (usize, usize) {
        let inner = self.inner();
        (inner.streams, inner.watched)
    }

    /// What this node's streams ask of each rule they watch, for the fleet tables, at
    /// `now` (the fleet's clock, ns). A part told more than three quarters of a TTL ago is
    /// dropped first: its entry in Redis lapses a TTL after its last renewal, and then the other
    /// nodes may take it, so this node stops counting on it before (a rule whose renewals fail
    /// goes back to the unknown part).
    #[must_use]
    pub fn demands(&self, now: u64) -> Vec<RuleDemand> {
        let stale =
            u64::try_from(self.settings.assignment_ttl.as_nanos() / 4 * 3).unwrap_or(u64::MAX);
        let mut inner = self.inner();
        inner.rounds += 1;
        let rounds = inner.rounds;
        inner.told.retain(|_, (_, _, round)| *round + 2 > rounds);
        inner
            .counters
            .iter_mut()
            .map(|(counter, c)| {
                if c.part.is_some_and(|(_, at)| now.saturating_sub(at) > stale) {
                    (c.part, c.unconfirmed) = (None, false);
                }
                RuleDemand {
                    counter: *counter,
                    quota: c.quota,
                    tokens: c.asked(),
                }
            })
            .collect()
    }

    /// Records this node's part of the rule counted at `counter` (a fraction of it, clamped to
    /// 0..=1), as the fleet table said at `now` (the fleet's clock, ns); the streams'
    /// next tick pushes what it moves. A part of a rule no stream watches yet is kept for the
    /// first that joins it.
    pub fn set_part(&self, counter: u128, part: f64, now: u64) {
        let part = fraction(part);
        let mut inner = self.inner();
        let rounds = inner.rounds;
        match inner.counters.get_mut(&counter) {
            Some(c) => (c.part, c.unconfirmed) = (Some((part, now)), false),
            None => {
                inner.told.insert(counter, (part, now, rounds));
            }
        }
    }

    /// Records that a renewal of this node's part of the rule counted at `counter` failed: the
    /// part's entry in Redis lapses a TTL after its last renewal, and the other nodes may then
    /// take it, so until a renewal succeeds no assignment of the rule is sent, renewed or pushed
    /// (the Envoys' assignments lapse with the part), and a part told of a rule no stream
    /// watches is forgotten.
    pub fn set_unconfirmed(&self, counter: u128) {
        let mut inner = self.inner();
        inner.told.remove(&counter);
        if let Some(c) = inner.counters.get_mut(&counter) {
            c.unconfirmed = true;
        }
    }

    /// Sets the part of a rule this node assumes before the fleet has told it its own (the
    /// whole rule, 1, until set), or `None` to assign a bucket of such a rule nothing until its
    /// part is told (Envoy then applies its own `no_assignment_behavior`).
    pub fn set_unknown_part(&self, part: Option<f64>) {
        self.inner().unknown_part = part.map(fraction);
    }

    /// Opens a stream of `domain`.
    ///
    /// # Errors
    ///
    /// [`Refused::TooManyStreams`] past `max_streams`.
    pub fn open(self: &Arc<Self>, domain: String) -> Result<Watcher, Refused> {
        let mut inner = self.inner();
        if inner.streams >= self.settings.max_streams {
            return Err(Refused::TooManyStreams);
        }
        inner.streams += 1;
        drop(inner);
        Ok(Watcher {
            table: Arc::clone(self),
            domain,
            seen: self.policies.load(),
            buckets: HashMap::new(),
            warned: false,
        })
    }
}

/// The shortest span over which a stream's own clock measures a bucket's demand, for reports
/// that state no `time_elapsed` (nanoseconds): reports closer together are added up until their
/// span is this long, so that a report right after a new bucket's first one (Envoy sends both)
/// is not read as a demand of nothing.
pub const SHORTEST_SPAN_NS: u64 = 100_000_000;

/// One bucket a stream watches.
#[derive(Debug)]
struct Watched {
    holder: u64,
    target: Target,
    /// The demand, requests per second: as the last report states it, or as measured on the
    /// stream's clock over the last span of at least [`SHORTEST_SPAN_NS`].
    demand: f64,
    /// When it was last reported (clock nanoseconds).
    reported_at: u64,
    /// For reports that state no span: when the span being measured began, and the requests
    /// reported in it so far.
    span: (u64, u64),
    /// What was last sent (nothing yet while its rule's part is unknown), and when.
    sent: Option<Strategy>,
    sent_at: u64,
}

/// One RLQS stream: its domain and the buckets it watches. Dropping it frees its shares.
#[derive(Debug)]
pub struct Watcher {
    table: Arc<ShareTable>,
    domain: String,
    /// The policies its targets were resolved against.
    seen: Arc<PolicySet>,
    buckets: HashMap<BucketId, Watched>,
    /// Whether the bucket cap was already logged for this stream.
    warned: bool,
}

impl Watcher {
    /// The stream's domain.
    #[must_use]
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// Buckets watched.
    #[must_use]
    pub fn watched(&self) -> usize {
        self.buckets.len()
    }

    /// The table it is part of.
    #[must_use]
    pub fn table(&self) -> Arc<ShareTable> {
        Arc::clone(&self.table)
    }

    /// Streams open, and buckets watched over all of them, on this node.
    #[must_use]
    pub fn figures(&self) -> (usize, usize) {
        self.table.figures()
    }

    /// The rules that the buckets among `reports` this stream does not watch yet would join (no
    /// more than the stream may watch), and whose part this node has not been told: what to ask
    /// the fleet tables before [`Watcher::report`] assigns them. One entry per rule,
    /// with this node's whole demand for it, the reports' included.
    #[must_use]
    pub fn unpriced(&self, reports: &[Report]) -> Vec<RuleDemand> {
        let policies = self.table.policies.load();
        let inner = self.table.inner();
        let room = self
            .table
            .settings
            .max_buckets_per_stream
            .saturating_sub(self.buckets.len());
        let mut out: Vec<RuleDemand> = Vec::new();
        for report in reports
            .iter()
            .filter(|r| !self.buckets.contains_key(&r.bucket))
            .take(room)
        {
            let Target::Shared {
                counter,
                quota,
                cost,
                rate,
                ..
            } = target(&policies, &self.domain, &report.bucket)
            else {
                continue;
            };
            let watched = inner.counters.get(&counter);
            if watched.is_some_and(|c| c.part.is_some()) || inner.told.contains_key(&counter) {
                continue;
            }
            let tokens = asked(first_demand(report, rate) * cost, rate * cost);
            match out.iter_mut().find(|d| d.counter == counter) {
                Some(d) => d.tokens += tokens,
                None => {
                    let held = watched.map_or(0.0, Counter::asked);
                    out.push(RuleDemand {
                        counter,
                        quota,
                        tokens: held + tokens,
                    });
                }
            }
        }
        out
    }

    /// Takes one message's reports at `now` (clock nanoseconds): records each bucket's demand,
    /// and answers a bucket seen for the first time at once, one past the cap with
    /// `abandon_action`, and one whose share moved by more than 10 % with its new assignment.
    pub fn report(&mut self, now: u64, reports: Vec<Report>) -> Vec<Action> {
        let mut actions = Vec::new();
        let refreshed = self.refresh();
        let table = Arc::clone(&self.table);
        let mut inner = table.inner();
        let mut touched = Vec::with_capacity(reports.len());
        for report in reports {
            if let Some(w) = self.buckets.get_mut(&report.bucket) {
                w.observe(now, &report);
                inner.join(&w.target, w.holder, w.demand);
                touched.push((report.bucket, false));
                continue;
            }
            if self.buckets.len() >= table.settings.max_buckets_per_stream {
                if !self.warned {
                    self.warned = true;
                    tracing::warn!(
                        domain = %self.domain,
                        max = table.settings.max_buckets_per_stream,
                        "a quota stream reports more buckets than rlqs.max_buckets_per_stream; the rest are abandoned"
                    );
                }
                actions.push(Action {
                    bucket: report.bucket,
                    kind: ActionKind::Abandon,
                });
                continue;
            }
            let target = target(&self.seen, &self.domain, &report.bucket);
            let demand = match target {
                Target::Shared { rate, .. } => first_demand(&report, rate),
                Target::Fixed(_) => 0.0,
            };
            // A report that states no span starts the span the stream's clock measures.
            let span = (
                now,
                if report.elapsed_ns == 0 {
                    report.requests
                } else {
                    0
                },
            );
            let holder = inner.next_holder;
            inner.next_holder += 1;
            inner.watched += 1;
            inner.join(&target, holder, demand);
            self.buckets.insert(
                report.bucket.clone(),
                Watched {
                    holder,
                    target,
                    demand,
                    reported_at: now,
                    span,
                    sent: None,
                    sent_at: now,
                },
            );
            touched.push((report.bucket, true));
        }
        for (bucket, new) in touched {
            let Some(w) = self.buckets.get_mut(&bucket) else {
                continue;
            };
            let Some((next, starved)) = assignment(&inner, w) else {
                continue;
            };
            if new || refreshed || w.sent.is_none_or(|sent| replaces(&sent, &next, starved)) {
                let next = told_apart(next, w.sent);
                w.sent = Some(next);
                w.sent_at = now;
                inner.sent(&w.target, w.holder, next);
                actions.push(Action {
                    bucket,
                    kind: ActionKind::Assign(next),
                });
            }
        }
        actions
    }

    /// The stream's periodic duties at `now`: abandons buckets not reported for a TTL, pushes
    /// an assignment whose share moved by more than 10 % (another stream came, left or changed
    /// its demand) or whose policies a reload replaced, and renews every other assignment, as
    /// sent, once half its TTL has passed.
    pub fn tick(&mut self, now: u64) -> Vec<Action> {
        let refreshed = self.refresh();
        let table = Arc::clone(&self.table);
        let ttl = u64::try_from(table.settings.assignment_ttl.as_nanos()).unwrap_or(u64::MAX);
        let mut inner = table.inner();
        let mut actions = Vec::new();
        let stale: Vec<BucketId> = self
            .buckets
            .iter()
            .filter(|(_, w)| now.saturating_sub(w.reported_at) >= ttl)
            .map(|(b, _)| b.clone())
            .collect();
        for bucket in stale {
            if let Some(w) = self.buckets.remove(&bucket) {
                forget(&mut inner, &w);
            }
            actions.push(Action {
                bucket,
                kind: ActionKind::Abandon,
            });
        }
        for (bucket, w) in &mut self.buckets {
            let Some((next, starved)) = assignment(&inner, w) else {
                continue;
            };
            let send = match w.sent {
                Some(sent) if !refreshed && !replaces(&sent, &next, starved) => {
                    if now.saturating_sub(w.sent_at) < ttl / 2 {
                        continue;
                    }
                    // A renewal repeats the strategy sent, so that Envoy extends the active
                    // assignment instead of replacing it (and refilling its token bucket).
                    sent
                }
                _ => told_apart(next, w.sent),
            };
            w.sent = Some(send);
            w.sent_at = now;
            inner.sent(&w.target, w.holder, send);
            actions.push(Action {
                bucket: bucket.clone(),
                kind: ActionKind::Assign(send),
            });
        }
        actions
    }

    /// Re-resolves every bucket when the policies changed since they were resolved; whether
    /// they did.
    fn refresh(&mut self) -> bool {
        let now = self.table.policies.load();
        if Arc::ptr_eq(&now, &self.seen) {
            return false;
        }
        self.seen = now;
        let table = Arc::clone(&self.table);
        let mut inner = table.inner();
        for (bucket, w) in &mut self.buckets {
            let next = target(&self.seen, &self.domain, bucket);
            if next == w.target {
                continue;
            }
            // The bucket's Envoy enforces what it was sent until it is sent the new rule's: it
            // stays counted on the new counter until then.
            let sent = inner.sent_rate(&w.target, w.holder);
            inner.leave(&w.target, w.holder);
            w.target = next;
            inner.join(&w.target, w.holder, w.demand);
            inner.hold(&w.target, w.holder, sent);
        }
        true
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        let mut inner = self.table.inner();
        inner.streams = inner.streams.saturating_sub(1);
        for w in self.buckets.values() {
            forget(&mut inner, w);
        }
    }
}

impl Watched {
    /// Takes a report of the bucket at `now`: the demand it states, or, when it states no span,
    /// the requests reported over the stream's own clock, once the span is long enough.
    fn observe(&mut self, now: u64, report: &Report) {
        self.reported_at = now;
        if let Some(demand) = report.demand() {
            self.demand = demand;
            self.span = (now, 0);
            return;
        }
        let (since, requests) = self.span;
        let requests = requests.saturating_add(report.requests);
        let span = now.saturating_sub(since);
        if span >= SHORTEST_SPAN_NS {
            // Precision intended: a rate, not a count.
            self.demand = requests as f64 * NANOS_PER_SEC as f64 / span as f64;
            self.span = (now, 0);
        } else {
            self.span = (since, requests);
        }
    }
}

/// The demand a bucket's first report on a stream reads as, for a rule of `rate` requests per
/// second: what it states, or, when it states no span (Envoy's first report of a new bucket
/// says 0), the whole rule: a new bucket is given a large share at once, and its next reports
/// say what it really offers.
fn first_demand(report: &Report, rate: f64) -> f64 {
    report.demand().unwrap_or(rate)
}

/// `next`, told apart by Envoy from the token bucket `sent` (see
/// [`TokenBucket::told_apart_from`]).
fn told_apart(next: Strategy, sent: Option<Strategy>) -> Strategy {
    match (next, sent) {
        (Strategy::TokenBucket(n), Some(Strategy::TokenBucket(s))) => {
            Strategy::TokenBucket(n.told_apart_from(&s))
        }
        _ => next,
    }
}

/// Takes a watched bucket out of the table.
fn forget(inner: &mut Inner, w: &Watched) {
    inner.watched = inner.watched.saturating_sub(1);
    inner.leave(&w.target, w.holder);
}

/// What `w` is to be assigned now, and whether a smaller assignment must go at once (another
/// holder of its counter waits for room): nothing while its rule's part is unknown and the table
/// waits for it.
fn assignment(inner: &Inner, w: &Watched) -> Option<(Strategy, bool)> {
    match w.target {
        Target::Fixed(s) => Some((s, false)),
        Target::Shared { counter, .. } => inner
            .share(counter, w.holder)
            .map(|(share, starved)| (w.target.strategy(share), starved)),
    }
}

/// Whether `next` replaces `sent`: it moved past [`MOVE_THRESHOLD`], or it is smaller while
/// another holder waits for room.
fn replaces(sent: &Strategy, next: &Strategy, starved: bool) -> bool {
    let shrank = match (sent, next) {
        (Strategy::TokenBucket(a), Strategy::TokenBucket(b)) => b.rate() < a.rate(),
        _ => false,
    };
    sent.moved(next) || (starved && shrank)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::policy;
    use crate::rlqs::TokenBucket;

    const POLICY: &str = "domain: d
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: banned
    rate_limit: {unit: second, requests_per_unit: 0}
";

    fn table(max_buckets: usize) -> Arc<ShareTable> {
        let set = policy::load_str(&[("d.yaml", POLICY)]).expect("policy");
        Arc::new(ShareTable::new(
            RlqsSettings {
                assignment_ttl: Duration::from_secs(10),
                max_buckets_per_stream: max_buckets,
                max_streams: 2,
                max_streams_per_connection: 100,
                max_streams_per_peer: 100,
            },
            PolicyHandle::new(set),
        ))
    }

    fn report(value: &str, per_second: u64) -> Report {
        Report {
            bucket: [("user".to_string(), value.to_string())].into(),
            elapsed_ns: NANOS_PER_SEC,
            requests: per_second,
        }
    }

    fn rate(actions: &[Action]) -> f64 {
        match actions {
            [
                Action {
                    kind: ActionKind::Assign(Strategy::TokenBucket(b)),
                    ..
                },
            ] => b.rate(),
            other => panic!("one token bucket expected: {other:?}"),
        }
    }

    #[test]
    fn streams_share_by_demand_and_a_closed_one_frees_its_share() {
        let table = table(10);
        let mut a = table.open("d".into()).expect("a");
        let mut b = table.open("d".into()).expect("b");
        assert_eq!(table.open("d".into()).err(), Some(Refused::TooManyStreams));
        assert_eq!(rate(&a.report(0, vec![report("x", 300)])), 100.0);
        // The newcomer is due 25, but gets only what `a`'s bucket, as sent, leaves: none.
        let b_first = rate(&b.report(0, vec![report("x", 100)]));
        assert!(b_first < 1e-9, "{b_first}");
        // `a` shrinks to make room at its next report; `b` grows at its next tick.
        let a_rate = rate(&a.report(1, vec![report("x", 300)]));
        assert!(a_rate + b_first <= 100.0, "{a_rate} + {b_first}");
        let b_rate = rate(&b.tick(1));
        assert!(a_rate + b_rate <= 100.0, "{a_rate} + {b_rate}");
        // Both ask for the rule or more: each keeps its fair part, half.
        for r in [a_rate, b_rate] {
            assert!((49.5..=50.0).contains(&r), "{a_rate} and {b_rate}");
        }
        drop(a);
        assert_eq!(table.figures(), (1, 1));
        assert!(rate(&b.tick(2)) >= 99.0);
    }

    #[test]
    fn the_buckets_in_force_never_add_up_past_the_rule() {
        // Three streams whose demands drift by a few percent at each report, under the 10 %
        // that would push a change: the buckets as last sent never add up past 100.
        let table = Arc::new(ShareTable::new(
            RlqsSettings {
                assignment_ttl: Duration::from_secs(10),
                max_buckets_per_stream: 10,
                max_streams: 3,
                max_streams_per_connection: 100,
                max_streams_per_peer: 100,
            },
            PolicyHandle::new(policy::load_str(&[("d.yaml", POLICY)]).expect("policy")),
        ));
        let mut streams: Vec<Watcher> = (0..3)
            .map(|_| table.open("d".into()).expect("open"))
            .collect();
        let mut in_force = [0.0f64; 3];
        let mut held: [Option<TokenBucket>; 3] = [None; 3];
        let mut rng = 0x5eed_u64;
        for step in 0..600u64 {
            rng = rng.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let i = (rng >> 33) as usize % 3;
            let base = [300, 100, 20][i];
            let drift = (rng >> 40) % 7;
            let actions = if step % 4 == 3 {
                streams[i].tick(step)
            } else {
                streams[i].report(step, vec![report("x", base + drift * base / 100)])
            };
            for action in &actions {
                if let ActionKind::Assign(Strategy::TokenBucket(b)) = action.kind {
                    // Envoy replaces its bucket only when max_tokens or tokens_per_fill differ
                    // (the interval's nanos are always 0): a change is never of the seconds alone.
                    if let Some(h) = held[i].filter(|h| *h != b) {
                        assert_ne!(
                            (h.max_tokens, h.tokens_per_fill),
                            (b.max_tokens, b.tokens_per_fill),
                            "step {step}: {h:?} then {b:?}"
                        );
                    }
                    held[i] = Some(b);
                    in_force[i] = b.rate();
                }
            }
            let sum: f64 = in_force.iter().sum();
            assert!(sum <= 100.0 + 1e-9, "step {step}: {in_force:?}");
        }
        // And they settle near the division: the small demand met (25), the two that ask for
        // the rule or more each its fair part and half of what is left (37.5).
        for (i, s) in streams.iter_mut().enumerate() {
            if let [action] = s.tick(1_000).as_slice()
                && let ActionKind::Assign(Strategy::TokenBucket(b)) = action.kind
            {
                in_force[i] = b.rate();
            }
        }
        assert!(in_force[2] >= 20.0, "the small demand is met: {in_force:?}");
        for r in &in_force[..2] {
            assert!(*r >= 100.0 / 3.0 * 0.99, "a fair part each: {in_force:?}");
        }
    }

    #[test]
    fn a_report_that_states_no_span_is_measured_on_the_streams_clock() {
        let table = table(10);
        let mut a = table.open("d".into()).expect("a");
        let unstated = |requests| Report {
            bucket: report("x", 0).bucket,
            elapsed_ns: 0,
            requests,
        };
        let ms = NANOS_PER_SEC / 1_000;
        // A new bucket's first report, as Envoy sends it (one request, time_elapsed 0): read as
        // asking for the whole rule.
        assert_eq!(rate(&a.report(0, vec![unstated(1)])), 100.0);
        // Envoy's next report, moments later: too short a span to measure, so added up.
        assert_eq!(a.report(5 * ms, vec![unstated(0)]), vec![]);
        // 250 ms after the first, 6 requests in all: 24 a second, given with 25 % headroom.
        assert_eq!(rate(&a.report(250 * ms, vec![unstated(5)])), 30.0);
        // A report that states its span is read as it says.
        assert_eq!(rate(&a.report(300 * ms, vec![report("x", 60)])), 75.0);
        // Demand on the stream's clock, again: 8 requests over 400 ms, 20 a second.
        assert_eq!(a.report(350 * ms, vec![unstated(4)]), vec![]);
        assert_eq!(rate(&a.report(700 * ms, vec![unstated(4)])), 25.0);
    }

    #[test]
    fn a_ban_is_deny_all_and_past_the_cap_a_bucket_is_abandoned() {
        let table = table(1);
        let mut s = table.open("d".into()).expect("s");
        let ban = Report {
            bucket: [("banned".to_string(), "x".to_string())].into(),
            elapsed_ns: NANOS_PER_SEC,
            requests: 1,
        };
        assert_eq!(
            s.report(0, vec![ban])[0].kind,
            ActionKind::Assign(Strategy::DenyAll)
        );
        assert_eq!(
            s.report(0, vec![report("x", 1)])[0].kind,
            ActionKind::Abandon
        );
    }

    #[test]
    fn an_unreported_bucket_is_abandoned_after_a_ttl_and_others_renewed() {
        let table = table(10);
        let mut s = table.open("d".into()).expect("s");
        let sec = NANOS_PER_SEC;
        s.report(0, vec![report("x", 100)]);
        s.report(0, vec![report("y", 100)]);
        assert!(s.tick(sec).is_empty(), "nothing due yet");
        s.report(9 * sec, vec![report("y", 100)]);
        let actions = s.tick(10 * sec);
        let abandoned: Vec<_> = actions
            .iter()
            .filter(|a| a.kind == ActionKind::Abandon)
            .collect();
        assert_eq!(abandoned.len(), 1);
        assert_eq!(abandoned[0].bucket, report("x", 0).bucket);
        assert!(actions.iter().any(|a| a.bucket == report("y", 0).bucket
            && matches!(
                a.kind,
                ActionKind::Assign(Strategy::TokenBucket(TokenBucket { .. }))
            )));
        assert_eq!(table.figures(), (1, 1));
    }

    #[test]
    fn with_a_fleet_only_this_nodes_part_is_divided() {
        let table = table(10);
        let mut a = table.open("d".into()).expect("a");
        let x = report("x", 300);
        let asked = a.unpriced(std::slice::from_ref(&x));
        assert_eq!(asked.len(), 1, "a new rule is asked for: {asked:?}");
        assert!(
            (asked[0].tokens - 100.0).abs() < 1e-9,
            "a claim of 300 counts as the whole rule: {asked:?}"
        );
        // A part told before the first bucket joins is that bucket's first assignment.
        table.set_unknown_part(Some(0.5));
        table.set_part(asked[0].counter, 0.4, 0);
        assert!(
            a.unpriced(std::slice::from_ref(&x)).is_empty(),
            "told, not asked again"
        );
        assert_eq!(rate(&a.report(0, vec![x.clone()])), 40.0);
        assert!(a.unpriced(std::slice::from_ref(&x)).is_empty(), "watched");
        // A part told for a rule no bucket joins is dropped two rounds later.
        table.set_part(12_345, 0.9, 0);
        let _ = table.demands(0);
        let _ = table.demands(0);
        assert!(table.inner().told.is_empty(), "dropped");
        // Until the fleet tells it, a rule is assumed the unknown part.
        assert_eq!(rate(&a.report(0, vec![report("y", 300)])), 50.0);
        // Or, when the table is to wait for it, not assigned until told, then pushed.
        table.set_unknown_part(None);
        let z = report("z", 300);
        let z_rule = a.unpriced(std::slice::from_ref(&z))[0].counter;
        assert!(a.report(0, vec![z]).is_empty(), "nothing assigned yet");
        assert!(a.tick(1).is_empty(), "nor at a tick");
        table.set_part(z_rule, 0.2, 0);
        assert_eq!(rate(&a.tick(2)), 20.0, "the told part is pushed");
        // Parts that move are pushed; a part that is not a number is none.
        let demands = table.demands(0);
        assert_eq!(demands.len(), 3);
        for d in &demands {
            table.set_part(d.counter, 0.25, 0);
        }
        let pushed = a.tick(3);
        assert_eq!(pushed.len(), 3, "{pushed:?}");
        for action in &pushed {
            assert_eq!(rate(std::slice::from_ref(action)), 25.0);
        }
        // A part that shrinks by less than the 10 % that moves a share is still pushed: the
        // buckets in force would add up past it.
        for d in &demands {
            table.set_part(d.counter, 0.24, 0);
        }
        let pushed = a.tick(3);
        assert_eq!(pushed.len(), 3, "{pushed:?}");
        for action in &pushed {
            assert_eq!(rate(std::slice::from_ref(action)), 24.0);
        }
        for d in &demands {
            table.set_part(d.counter, f64::NAN, 0);
        }
        for action in &a.tick(4) {
            let r = rate(std::slice::from_ref(action));
            assert!(r < 1e-9, "a part that is not a number is none: {r}");
        }
        drop(a);
        assert!(
            table.demands(0).is_empty(),
            "a rule no stream watches is not renewed"
        );
    }

    #[test]
    fn buckets_of_different_costs_on_one_counter_divide_its_tokens() {
        const COSTS: &str = "domain: d
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 100, burst: 100}
    descriptors:
      - key: route
        value: search
        cost: 10
";
        let set = policy::load_str(&[("d.yaml", COSTS)]).expect("policy");
        let table = Arc::new(ShareTable::new(
            RlqsSettings {
                assignment_ttl: Duration::from_secs(10),
                max_buckets_per_stream: 10,
                max_streams: 2,
                max_streams_per_connection: 100,
                max_streams_per_peer: 100,
            },
            PolicyHandle::new(set),
        ));
        let (mut cheap, mut dear) = (
            table.open("d".into()).expect("cheap"),
            table.open("d".into()).expect("dear"),
        );
        let plain = |n| Report {
            bucket: [("user".to_string(), "a".to_string())].into(),
            elapsed_ns: NANOS_PER_SEC,
            requests: n,
        };
        let search = |n| Report {
            bucket: [
                ("user".to_string(), "a".to_string()),
                ("route".to_string(), "search".to_string()),
            ]
            .into(),
            elapsed_ns: NANOS_PER_SEC,
            requests: n,
        };
        // 300 plain requests a second against 30 searches (300 tokens): an even split of the
        // 100 tokens, 50 plain requests and 5 searches, once both have been pushed.
        let mut in_force = [0.0f64; 2];
        let keep = |held: &mut f64, actions: Vec<Action>| {
            for a in actions {
                if let ActionKind::Assign(Strategy::TokenBucket(b)) = a.kind {
                    *held = b.rate();
                }
            }
        };
        for step in 0..8 {
            keep(&mut in_force[0], cheap.report(step, vec![plain(300)]));
            keep(&mut in_force[1], dear.report(step, vec![search(30)]));
            let tokens = in_force[0] + 10.0 * in_force[1];
            assert!(tokens <= 100.0 + 1e-9, "step {step}: {in_force:?}");
        }
        assert!((in_force[0] - 50.0).abs() <= 1.0, "{in_force:?}");
        assert!((in_force[1] - 5.0).abs() <= 0.1, "{in_force:?}");
        let demands = table.demands(0);
        // Each claim counts for at most the rule's 100 tokens.
        assert!((demands[0].tokens - 200.0).abs() < 1e-9, "{demands:?}");
    }

    /// A node told half of the rule at 0 and one stream assigned all of it (50 a second) for a
    /// bucket offered 300: the table, the stream and the rule's counter.
    fn holding_half_of_the_rule() -> (Arc<ShareTable>, Watcher, u128) {
        let table = table(10);
        let mut a = table.open("d".into()).expect("a");
        let x = report("x", 300);
        let rule = a.unpriced(std::slice::from_ref(&x))[0].counter;
        table.set_unknown_part(None);
        table.set_part(rule, 0.5, 0);
        assert_eq!(rate(&a.report(0, vec![x])), 50.0);
        (table, a, rule)
    }

    #[test]
    fn a_part_not_renewed_for_three_quarters_of_a_ttl_is_dropped() {
        let (table, mut a, rule) = holding_half_of_the_rule();
        let sec = NANOS_PER_SEC;
        let _ = table.demands(7 * sec);
        assert_eq!(
            a.tick(1),
            vec![],
            "a part told 7 s ago (TTL 10 s) still stands"
        );
        let _ = table.demands(8 * sec);
        // Unknown now, and the table waits for it: nothing more is pushed or renewed.
        assert_eq!(
            a.tick(6 * sec),
            vec![],
            "no renewal of a part no longer known"
        );
        table.set_part(rule, 0.5, 8 * sec);
        assert_eq!(rate(&a.tick(7 * sec)), 50.0, "renewed once told again");
    }

    #[test]
    fn nothing_is_sent_of_a_part_whose_renewal_failed_until_one_succeeds() {
        let (table, mut a, rule) = holding_half_of_the_rule();
        let sec = NANOS_PER_SEC;
        // A renewal fails: the part's entry lapses a TTL after its last renewal, so an
        // assignment sent now, with a whole TTL, would outlive it. Nothing is renewed, pushed or
        // assigned to a new bucket of the rule.
        table.set_unconfirmed(rule);
        assert_eq!(a.tick(6 * sec), vec![], "no renewal of an unconfirmed part");
        assert_eq!(
            a.report(6 * sec, vec![report("x", 10)]),
            vec![],
            "nor a push"
        );
        let mut b = table.open("d".into()).expect("b");
        assert_eq!(
            b.report(6 * sec, vec![report("x", 300)]),
            vec![],
            "nor a first one"
        );
        // A renewal succeeds: the part stands again, and what is due is sent.
        table.set_part(rule, 0.5, 6 * sec);
        assert!(!a.tick(7 * sec).is_empty(), "renewed once confirmed");
        // A part told of a rule no stream watches, then unconfirmed, is not kept for the next.
        table.set_part(12_345, 0.9, 0);
        table.set_unconfirmed(12_345);
        assert!(table.inner().told.is_empty());
    }
}
