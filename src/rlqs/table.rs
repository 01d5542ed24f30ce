//! This node's share table: for each limited counter, this node's part of it (told by the
//! fleet, or the whole rule) and the holders watching it, each with its claim, its cached share
//! and the token bucket it holds, in a slot its stream keeps; and each stream's own watch list,
//! which decides what to send and when. A share is never more than what the other holders'
//! buckets in force leave.
//!
//! Each counter sits behind its own mutex, in a sharded map; a report locks only the counters
//! of the buckets it names, one at a time, after its target is resolved, and never across an
//! `.await` (there is none here). A counter keeps running sums of its holders' claims and of
//! the buckets in force, and a count of the holders due more than they hold, so a report reads
//! its cached share in constant time. The division is redone, whole, on the first read after
//! its inputs changed: at once when the capacity moved (the fleet's part, a reload), and after
//! joins, leaves and claims that moved by more than [`CLAIM_STEP`] once they number a
//! [`REDIVIDE_BATCH`]th of the holders or are [`SETTLE_NS`] old, so that each change costs a
//! constant share of a division and ten thousand streams joining one counter are not divided
//! ten thousand times. A reload that keeps a rule's counter (its identity, whatever its figures)
//! moves that counter to the new figures in place, once, as the first of its holders sees it:
//! every holder stays, its claim made again of its demand against the new rate and its bucket
//! in force counted until it is sent another, and the division is redone whole at the next
//! read; a bucket the reload gives another rule leaves its counter for that rule's. A counter
//! counts its changes, so that a stream's tick figures again only the shares whose counter or
//! capacity moved since. A stream's shares are freed when its [`Watcher`] is dropped.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use dashmap::DashMap;
use indexmap::IndexMap;
use smallvec::SmallVec;

use super::key::{self, Flat};
use super::{
    Action, ActionKind, MOVE_DIVISOR, PER_RULE, PER_TOKEN, Report, RlqsSettings, Strategy, Target,
    TokenBucket, claim, divide, mul_div, rate_over, target_of, tick_interval,
};
use crate::limiter::gcra::Quota;
use crate::limiter::key::KeyHash;
use crate::policy::{PolicyHandle, PolicySet};

/// A claim that moves by more than its last divided figure over this (5 %) asks for a new
/// division; smaller moves are left until another change comes.
pub const CLAIM_STEP: u64 = 20;

/// Pending changes of a counter are divided once they number its holders over this (or at
/// once below this many holders).
pub const REDIVIDE_BATCH: usize = 32;

/// Pending changes of a counter are divided, however few, once the first is this old
/// (nanoseconds on the streams' clock).
pub const SETTLE_NS: u64 = 250_000_000;

/// The stream's duties run with a report a tick less this fraction of it after they last ran,
/// and on the stream's timer a tick and this fraction after.
pub const SLACK: u64 = 4;

/// `unknown_part` when nothing is to be assigned until the fleet tells the part.
const NO_PART: u64 = u64::MAX;

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
    /// The limited counters watched, and those whose part is kept for a while without holders.
    counters: DashMap<u128, Arc<Mutex<Counter>>, KeyHash>,
    // The atomics below are counts and settings read on their own, publishing no other memory:
    // relaxed ordering is enough for each.
    streams: AtomicUsize,
    watched: AtomicUsize,
    next_holder: AtomicU64,
    /// Calls of [`ShareTable::demands`] so far.
    rounds: AtomicU64,
    /// This node's part of a rule whose part the fleet has not told, in millionths: the whole
    /// rule until [`ShareTable::set_unknown_part`] says otherwise; [`NO_PART`] to assign
    /// nothing until told.
    unknown_part: AtomicU64,
}

/// The figures of a counter's rule, as [`Counter::refigure`] last set them.
#[derive(Clone, Copy, Debug)]
struct RuleFigures {
    quota: Quota,
    /// Counter tokens per second, in [`PER_TOKEN`]ths.
    rate: u64,
}

/// This node's part of a rule as the fleet table last told it.
#[derive(Clone, Copy, Debug)]
struct FleetPart {
    /// Millionths of the rule.
    millionths: u64,
    /// When (the fleet's clock, ns).
    at: u64,
}

/// One limited counter this node's streams watch. Its figures are in the counter's tokens per
/// second, in [`PER_TOKEN`]ths (a request of a cost node's bucket costs its cost), so that
/// buckets of different costs on one counter divide one budget.
#[derive(Debug, Default)]
struct Counter {
    rule: Option<RuleFigures>,
    holders: Holders,
    part: Option<FleetPart>,
    /// Whether a renewal of the part failed since it was last told: its entry in Redis then
    /// lapses a TTL after that, so no assignment of the rule is sent, lest it outlive the part.
    unconfirmed: bool,
    /// The round ([`ShareTable::demands`]) since which it has no holder: its part is kept for
    /// the next join, and dropped two rounds later when none came.
    empty_since: u64,
    /// The sum of the holders' claims.
    claims: u128,
    /// The sum of what the holders' buckets in force hold.
    in_force: u128,
    /// Holders due more than a move over what they hold.
    wanting: usize,
    /// The capacity the shares were last divided for (none before the first division).
    divided_for: Option<u64>,
    /// Changes since: joins, leaves and claims moved past [`CLAIM_STEP`].
    pending: usize,
    /// When the first of them came (the streams' clock, ns).
    pending_since: u64,
    /// Counts the changes to anything a share is figured from (a claim moved, a holder come or
    /// gone, a bucket in force, the figures, a division), so that a tick can tell that none
    /// came since a holder's share was last figured.
    revision: u64,
    /// Holders divided so far, over all divisions: the work the batching bounds.
    #[cfg(test)]
    divided: usize,
    /// Shares figured so far: the work a tick spares when nothing moved.
    #[cfg(test)]
    figured: usize,
}

/// A counter's holders, each in the slot it was given when it joined. Its stream keeps the
/// slot ([`Seat`]), so that it finds its holder with no lookup; a slot left is given to the next
/// to join. The first slot lives in the counter's own allocation.
#[derive(Debug, Default)]
struct Holders {
    slots: SmallVec<[Option<Holder>; 1]>,
    /// The empty slots.
    free: Vec<usize>,
}

/// Where a stream's holder sits on its counter: its id, which the table gives out once, and
/// its slot. A seat whose slot holds another id finds nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seat {
    id: u64,
    slot: usize,
}

impl Seat {
    /// The seat of holder `id` before it joins a counter: no slot is past the slots, so it
    /// finds nothing, and the holder is seated where it joins.
    fn unseated(id: u64) -> Self {
        Self {
            id,
            slot: usize::MAX,
        }
    }
}

impl Holders {
    fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn get(&self, seat: Seat) -> Option<&Holder> {
        self.slots
            .get(seat.slot)?
            .as_ref()
            .filter(|h| h.id == seat.id)
    }

    fn get_mut(&mut self, seat: Seat) -> Option<&mut Holder> {
        self.slots
            .get_mut(seat.slot)?
            .as_mut()
            .filter(|h| h.id == seat.id)
    }

    /// Seats `holder` in an empty slot, or a new one.
    fn insert(&mut self, holder: Holder) -> Seat {
        let id = holder.id;
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = Some(holder);
                slot
            }
            None => {
                self.slots.push(Some(holder));
                self.slots.len() - 1
            }
        };
        Seat { id, slot }
    }

    /// Takes the holder at `seat` out; the slots are freed whole when none is left.
    fn remove(&mut self, seat: Seat) -> Option<Holder> {
        self.get(seat)?;
        let holder = self.slots[seat.slot].take();
        if self.len() == 1 {
            *self = Self::default();
        } else {
            self.free.push(seat.slot);
        }
        holder
    }

    /// The holders, in their slots' order.
    fn values(&self) -> impl Iterator<Item = &Holder> {
        self.slots.iter().flatten()
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut Holder> {
        self.slots.iter_mut().flatten()
    }
}

/// One holder of a counter: a stream's watched bucket.
#[derive(Clone, Copy, Debug)]
struct Holder {
    /// Its seat's id.
    id: u64,
    /// Tokens a request of its bucket costs.
    cost: u64,
    /// Its demand as last reported, in requests per second ([`PER_TOKEN`]ths): its claim is
    /// made again of it when a reload moves the rule's rate.
    demand: u64,
    /// Its claim ([`claim`]) as last reported.
    claim: u64,
    /// Its claim as the last division counted it.
    divided_claim: u64,
    /// Its share, as the last division gave it (none before).
    due: Option<u64>,
    /// The token bucket in force (none before, or for another strategy).
    bucket: Option<TokenBucket>,
    /// What that bucket holds of the counter ([`TokenBucket::held`]).
    in_force: u64,
    /// Whether `due` comes to a bucket more than a move over what it holds.
    wanting: bool,
}

/// Whether a holder of a counter may be sent a smaller assignment at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Room {
    /// No other holder waits, and the buckets in force fit the part.
    Enough,
    /// Another holder is due more than a move over what it holds, or the buckets in force add
    /// up past the part (it shrank): any assignment that shrank goes at once, to make room.
    Wanted,
}

/// A holder's assignment now.
#[derive(Clone, Copy, Debug)]
struct Assigned {
    strategy: Strategy,
    room: Room,
}

/// A share of a counter, in its tokens per second ([`PER_TOKEN`]ths), and whether room is wanted.
#[derive(Clone, Copy, Debug)]
struct Share {
    tokens: u64,
    room: Room,
}

/// A rule this node hands out, as the fleet table is told of it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RuleDemand {
    /// The rule's counter.
    pub counter: u128,
    /// The rule's quota.
    pub quota: Quota,
    /// What this node's streams ask of it, in the counter's tokens per second: each holder's
    /// claim, at least the rule over [`IDLE_DEMAND_DIVISOR`](super::IDLE_DEMAND_DIVISOR) and
    /// at most the whole rule.
    pub tokens: f64,
}

/// A rate in [`PER_TOKEN`]ths as tokens per second.
fn per_second(rate: u128) -> f64 {
    // Precision intended: a figure for the fleet table, not an assignment.
    rate as f64 / PER_TOKEN as f64
}

impl Counter {
    /// Whether it may be dropped at round `round`: no holder, and no part kept (or kept two
    /// rounds).
    fn lapsed(&self, round: u64) -> bool {
        self.holders.is_empty() && (self.part.is_none() || self.empty_since + 2 <= round)
    }

    /// This node's capacity of the rule, in its tokens per second: its part (told, else
    /// `unknown` millionths) of the rule. None while the part is unknown and nothing is to be
    /// assigned until told, and while it is unconfirmed (an assignment sent then, with a whole
    /// TTL, would outlive the part's entry in Redis).
    fn capacity(&self, unknown: u64) -> Option<u64> {
        if self.part.is_some() && self.unconfirmed {
            return None;
        }
        let millionths = self.part.map_or(unknown, |p| p.millionths);
        if millionths == NO_PART {
            return None;
        }
        let rule = self.rule?;
        Some(mul_div(rule.rate, millionths.min(PER_RULE), PER_RULE))
    }

    /// Counts a change of the division's inputs at `now`.
    fn changed(&mut self, now: u64) {
        self.revision += 1;
        if self.pending == 0 {
            self.pending_since = now;
        }
        self.pending += 1;
    }

    /// Records the demand of the holder at `seat`, in requests per second ([`PER_TOKEN`]ths),
    /// on the counter of `target`, whose figures [`Counter::refigure`] set: the seat it holds
    /// then. A holder new to the counter (its seat finds nothing) is seated holding `in_force`.
    fn join(
        &mut self,
        target: &Target,
        seat: Seat,
        demand: u64,
        in_force: Option<Strategy>,
        now: u64,
    ) -> Seat {
        let Target::Shared { cost, rate, .. } = *target else {
            return seat;
        };
        let claim = claim(demand.saturating_mul(cost), rate);
        let Some(h) = self.holders.get_mut(seat) else {
            let seat = self.holders.insert(Holder {
                id: seat.id,
                cost,
                demand,
                claim,
                divided_claim: 0,
                due: None,
                bucket: None,
                in_force: 0,
                wanting: false,
            });
            self.claims += u128::from(claim);
            self.changed(now);
            if let Some(s) = in_force {
                self.put_in_force(seat, s);
            }
            return seat;
        };
        self.claims = self.claims - u128::from(h.claim) + u128::from(claim);
        (h.demand, h.claim) = (demand, claim);
        let moved = u128::from(claim.abs_diff(h.divided_claim)) * u128::from(CLAIM_STEP)
            > u128::from(h.divided_claim);
        if h.cost != cost {
            // A reload may change a bucket's cost under the token bucket it holds: that bucket
            // is counted at the new cost.
            h.cost = cost;
            let bucket = h.bucket.map(Strategy::TokenBucket);
            self.put_in_force(seat, bucket.unwrap_or(Strategy::AllowAll));
        }
        if moved {
            self.changed(now);
        }
        seat
    }

    /// Moves the counter to its rule's figures of a reload, `quota` and `rate` ([`PER_TOKEN`]ths
    /// of its tokens per second), once: every holder stays, its claim made again of its demand
    /// against the new rate, its bucket in force still counted until it is sent another, and the
    /// division is redone whole at the next read. Nothing when the figures are those it has.
    fn refigure(&mut self, quota: Quota, rate: u64) {
        if self
            .rule
            .is_some_and(|r| r.quota == quota && r.rate == rate)
        {
            return;
        }
        self.rule = Some(RuleFigures { quota, rate });
        self.revision += 1;
        let mut claims = 0u128;
        for h in self.holders.values_mut() {
            h.claim = claim(h.demand.saturating_mul(h.cost), rate);
            claims += u128::from(h.claim);
        }
        self.claims = claims;
        (self.divided_for, self.pending) = (None, 0);
    }

    /// Takes the holder at `seat` off the counter at round `round`.
    fn leave(&mut self, seat: Seat, round: u64, now: u64) {
        let Some(h) = self.holders.remove(seat) else {
            return;
        };
        self.claims -= u128::from(h.claim);
        self.in_force -= u128::from(h.in_force);
        self.wanting -= usize::from(h.wanting);
        self.changed(now);
        if self.holders.is_empty() {
            self.empty_since = round;
            (self.divided_for, self.pending, self.wanting) = (None, 0, 0);
        }
    }

    /// Counts the holder at `seat` as holding `strategy`: the token bucket's rate times the
    /// cost, none else.
    fn put_in_force(&mut self, seat: Seat, strategy: Strategy) {
        let Some(h) = self.holders.get_mut(seat) else {
            return;
        };
        let bucket = match strategy {
            Strategy::TokenBucket(b) => Some(b),
            Strategy::AllowAll | Strategy::DenyAll => None,
        };
        let held = bucket.map_or(0, |b| b.held(h.cost));
        let moved = bucket != h.bucket || held != h.in_force;
        h.bucket = bucket;
        self.in_force = self.in_force - u128::from(h.in_force) + u128::from(held);
        h.in_force = held;
        let was = h.wanting;
        h.wanting = wanting(h);
        self.wanting = self.wanting - usize::from(was) + usize::from(h.wanting);
        if moved || was != h.wanting {
            self.revision += 1;
        }
    }

    /// Divides `capacity` again when its inputs changed enough since the last division.
    fn settle(&mut self, capacity: u64, now: u64) {
        let due = self.divided_for != Some(capacity)
            || (self.pending > 0
                && (self.pending.saturating_mul(REDIVIDE_BATCH) >= self.holders.len()
                    || now.saturating_sub(self.pending_since) >= SETTLE_NS));
        if !due {
            return;
        }
        let claims: Vec<u64> = self.holders.values().map(|h| h.claim).collect();
        let shares = divide(&claims, capacity);
        self.wanting = 0;
        // The slots are not changed between the two walks, so they meet the holders in one order.
        for (h, due) in self.holders.values_mut().zip(shares) {
            (h.due, h.divided_claim) = (Some(due), h.claim);
            h.wanting = wanting(h);
            self.wanting += usize::from(h.wanting);
        }
        (self.divided_for, self.pending) = (Some(capacity), 0);
        // A division at another capacity moves shares at this one too, once it comes back.
        self.revision += 1;
        #[cfg(test)]
        {
            self.divided += self.holders.len();
        }
    }

    /// The share of the holder at `seat`, in the counter's tokens: its share of `capacity` as
    /// divided, no more than what the others' buckets in force leave of it, so that the buckets
    /// in force never add up past it. A holder not divided yet is due its claim with headroom,
    /// up to an equal part.
    fn share(&mut self, seat: Seat, capacity: u64, now: u64) -> Share {
        self.settle(capacity, now);
        #[cfg(test)]
        {
            self.figured += 1;
        }
        let Some(h) = self.holders.get(seat) else {
            return Share {
                tokens: 0,
                room: Room::Enough,
            };
        };
        let equal = capacity / u64::try_from(self.holders.len()).unwrap_or(u64::MAX);
        let due = h
            .due
            .unwrap_or_else(|| h.claim.saturating_add(h.claim / 4).min(equal));
        let others = self.in_force - u128::from(h.in_force);
        let left = u128::from(capacity).saturating_sub(others);
        let tokens = u64::try_from(u128::from(due).min(left)).unwrap_or(u64::MAX);
        let starved = self.wanting > usize::from(h.wanting);
        let over = self.in_force > u128::from(capacity);
        Share {
            tokens,
            room: if starved || over {
                Room::Wanted
            } else {
                Room::Enough
            },
        }
    }
}

/// Whether `h` is due a bucket more than a move ([`MOVE_DIVISOR`]) over what it holds.
fn wanting(h: &Holder) -> bool {
    let Some(due) = h.due else {
        return false;
    };
    let next = TokenBucket::within(due / h.cost.max(1), 1).held(h.cost);
    u128::from(next) * u128::from(MOVE_DIVISOR)
        > u128::from(h.in_force) * u128::from(MOVE_DIVISOR + 1)
}

/// `part` as millionths of a rule, rounded down: within 0..=[`PER_RULE`], and none for a part
/// that is not a number.
fn millionths(part: f64) -> u64 {
    if part.is_nan() {
        0
    } else {
        (part.clamp(0.0, 1.0) * PER_RULE as f64).floor() as u64
    }
}

/// Locks `counter`, poisoned or not (its sums are updated together, and no step of them panics).
fn lock(counter: &Mutex<Counter>) -> MutexGuard<'_, Counter> {
    counter.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ShareTable {
    /// An empty table, matching buckets against `policies`.
    #[must_use]
    pub fn new(settings: RlqsSettings, policies: PolicyHandle) -> Self {
        Self {
            settings,
            policies,
            counters: DashMap::default(),
            streams: AtomicUsize::new(0),
            watched: AtomicUsize::new(0),
            next_holder: AtomicU64::new(0),
            rounds: AtomicU64::new(0),
            unknown_part: AtomicU64::new(PER_RULE),
        }
    }

    /// The settings.
    #[must_use]
    pub fn settings(&self) -> &RlqsSettings {
        &self.settings
    }

    /// The policies buckets are matched against now.
    #[must_use]
    pub fn policies(&self) -> Arc<PolicySet> {
        self.policies.load()
    }

    /// Streams open, and buckets watched over all of them.
    #[must_use]
    pub fn figures(&self) -> (usize, usize) {
        (
            self.streams.load(Ordering::Relaxed),
            self.watched.load(Ordering::Relaxed),
        )
    }

    fn round(&self) -> u64 {
        self.rounds.load(Ordering::Relaxed)
    }

    fn unknown_part(&self) -> u64 {
        self.unknown_part.load(Ordering::Relaxed)
    }

    /// Seats the holder `id` on the counter of `target`, holding `in_force`, the counter moved
    /// to the target's figures first: the counter, for a shared target, and the holder's seat on
    /// it (none for a fixed target). Joined under the map's entry, so that
    /// [`ShareTable::demands`] never drops a counter a holder is joining.
    fn enter(
        &self,
        target: &Target,
        id: u64,
        demand: u64,
        in_force: Option<Strategy>,
        now: u64,
    ) -> (Option<Arc<Mutex<Counter>>>, Seat) {
        let Target::Shared {
            counter,
            quota,
            rate,
            ..
        } = *target
        else {
            return (None, Seat::unseated(id));
        };
        let entry = self.counters.entry(counter).or_default();
        let c = Arc::clone(entry.value());
        let seat = {
            let mut c = lock(&c);
            c.refigure(quota, rate);
            c.join(target, Seat::unseated(id), demand, in_force, now)
        };
        drop(entry);
        (Some(c), seat)
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
        let round = self.rounds.fetch_add(1, Ordering::Relaxed) + 1;
        let mut out = Vec::new();
        self.counters.retain(|counter, c| {
            let mut c = lock(c);
            if c.lapsed(round) {
                return false;
            }
            if c.holders.is_empty() {
                return true;
            }
            if c.part.is_some_and(|p| now.saturating_sub(p.at) > stale) {
                (c.part, c.unconfirmed) = (None, false);
            }
            if let Some(rule) = c.rule {
                out.push(RuleDemand {
                    counter: *counter,
                    quota: rule.quota,
                    tokens: per_second(c.claims),
                });
            }
            true
        });
        out
    }

    /// Records this node's part of the rule counted at `counter`, in millionths of it (at most
    /// [`PER_RULE`]), as the fleet table said at `now` (the fleet's clock, ns); the streams' next tick pushes what it moves. A part of a rule no stream watches yet
    /// is kept for the first that joins it.
    pub fn set_part(&self, counter: u128, millionths: u64, now: u64) {
        let round = self.round();
        let entry = self.counters.entry(counter).or_default();
        let mut c = lock(entry.value());
        c.part = Some(FleetPart {
            millionths: millionths.min(PER_RULE),
            at: now,
        });
        c.unconfirmed = false;
        if c.holders.is_empty() {
            c.empty_since = round;
        }
    }

    /// Records that a renewal of this node's part of the rule counted at `counter` failed: the
    /// part's entry in Redis lapses a TTL after its last renewal, and the other nodes may then
    /// take it, so until a renewal succeeds no assignment of the rule is sent, renewed or pushed
    /// (the Envoys' assignments lapse with the part), and a part told of a rule no stream
    /// watches is forgotten.
    pub fn set_unconfirmed(&self, counter: u128) {
        if let Some(entry) = self.counters.get(&counter) {
            let mut c = lock(entry.value());
            if c.holders.is_empty() {
                c.part = None;
            } else {
                c.unconfirmed = true;
            }
        }
    }

    /// Sets the part of a rule this node assumes before the fleet has told it its own (the
    /// whole rule, 1, until set), or `None` to assign a bucket of such a rule nothing until its
    /// part is told (Envoy then applies its own `no_assignment_behavior`).
    pub fn set_unknown_part(&self, part: Option<f64>) {
        self.unknown_part
            .store(part.map_or(NO_PART, millionths), Ordering::Relaxed);
    }

    /// Opens a stream of `domain`.
    ///
    /// # Errors
    ///
    /// [`Refused::TooManyStreams`] past `max_streams`.
    pub fn open(self: &Arc<Self>, domain: String) -> Result<Watcher, Refused> {
        let max = self.settings.max_streams;
        self.streams
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_| Refused::TooManyStreams)?;
        Ok(Watcher {
            table: Arc::clone(self),
            domain,
            seen: self.policies.load(),
            buckets: IndexMap::default(),
            order: Vec::new(),
            warned: false,
            duties_at: 0,
        })
    }

    /// Parts kept for rules no stream watches.
    #[cfg(test)]
    fn kept_parts(&self) -> usize {
        self.counters
            .iter()
            .filter(|e| {
                let c = lock(e.value());
                c.holders.is_empty() && c.part.is_some()
            })
            .count()
    }
}

/// The shortest span over which a stream's own clock measures a bucket's demand, for reports
/// that state no `time_elapsed` (nanoseconds): reports closer together are added up until their
/// span is this long, so that a report right after a new bucket's first one (Envoy sends both)
/// is not read as a demand of nothing.
pub const SHORTEST_SPAN_NS: u64 = 100_000_000;

/// The span of reports that state none, measured on the stream's clock.
#[derive(Clone, Copy, Debug)]
struct Span {
    /// When it began (clock nanoseconds).
    since: u64,
    /// The requests reported in it so far.
    requests: u64,
}

/// How a bucket came into one report message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Arrival {
    /// Seen for the first time: answered at once.
    New,
    /// Watched already: answered when its assignment moved.
    Again,
}

/// One bucket a stream watches.
#[derive(Debug)]
struct Watched {
    /// Its seat on the counter; only the id while it has none.
    seat: Seat,
    target: Target,
    /// The counter it holds a share of, for a shared target.
    counter: Option<Arc<Mutex<Counter>>>,
    /// The demand, requests per second ([`PER_TOKEN`]ths): as the last report states it, or
    /// as measured on the stream's clock over the last span of at least [`SHORTEST_SPAN_NS`].
    demand: u64,
    /// When it was last reported (clock nanoseconds).
    reported_at: u64,
    span: Span,
    /// The strategy in force: what was last sent (nothing yet while its rule's part is
    /// unknown), and when.
    in_force: Option<Strategy>,
    assigned_at: u64,
    /// What its share was last figured from, when nothing could move it since but a change.
    figured: Option<Figured>,
    /// Figured by the message being taken, whose duties follow it in the same call
    /// ([`Watcher::take`]), as its counter's only holder: nothing could move its share since,
    /// so they need not look.
    fresh: bool,
}

/// What a holder's share was last figured from: its counter's [`Counter::revision`] and the
/// capacity divided. With both unchanged, the share is the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Figured {
    revision: u64,
    capacity: u64,
}

/// What follows a message's reports in the same call ([`Watcher::take`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum After {
    Nothing,
    /// The stream's duties, which then skip the shares the reports figured alone on their
    /// counters.
    Duties,
}

/// Whether [`Watched::assign`] figures a share its counter has not moved since it was last
/// figured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refigure {
    /// Always: a report, a reload, a renewal due, or nothing in force yet.
    Always,
    /// Only when its counter changed since: a tick's look for moved shares.
    IfMoved,
}

/// One RLQS stream: its domain and the buckets it watches. Dropping it frees its shares.
#[derive(Debug)]
pub struct Watcher {
    table: Arc<ShareTable>,
    domain: String,
    /// The policies its targets were resolved against.
    seen: Arc<PolicySet>,
    /// By their ids' bytes ([`key`]), in the order they came, so that a report finds each once
    /// and its answers by place.
    buckets: IndexMap<Flat, Watched, foldhash::fast::RandomState>,
    /// The places in `buckets` of the last message's reports, in their order (no more of them
    /// than the stream may watch): where the next message's reports are looked for first
    /// ([`Watcher::place_of`]).
    order: Vec<usize>,
    /// Whether the bucket cap was already logged for this stream.
    warned: bool,
    /// When its duties last ran ([`Watcher::tick`]; clock nanoseconds).
    duties_at: u64,
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
    /// with this node's whole claim on it, the reports' included.
    #[must_use]
    pub fn rules_without_part(&self, reports: &[Report]) -> Vec<RuleDemand> {
        let policies = self.table.policies.load();
        let room = self
            .table
            .settings
            .max_buckets_per_stream
            .saturating_sub(self.buckets.len());
        let mut out: Vec<RuleDemand> = Vec::new();
        for report in reports
            .iter()
            .filter(|r| !self.buckets.contains_key(&r.bucket[..]))
            .take(room)
        {
            let Target::Shared {
                counter,
                quota,
                cost,
                rate,
                ..
            } = target_of(&policies, &self.domain, &key::entries(&report.bucket))
            else {
                continue;
            };
            let kept = self
                .table
                .counters
                .get(&counter)
                .map(|e| Arc::clone(e.value()));
            let (has_part, claims) = kept.map_or((false, 0), |c| {
                let c = lock(&c);
                (c.part.is_some(), c.claims)
            });
            if has_part {
                continue;
            }
            let first = first_demand(report, rate / cost.max(1)).saturating_mul(cost);
            let tokens = per_second(u128::from(claim(first, rate)));
            match out.iter_mut().find(|d| d.counter == counter) {
                Some(d) => d.tokens += tokens,
                None => out.push(RuleDemand {
                    counter,
                    quota,
                    tokens: per_second(claims) + tokens,
                }),
            }
        }
        out
    }

    /// Takes one message's reports at `now` (clock nanoseconds): records each bucket's demand,
    /// and answers a bucket seen for the first time at once, one past the cap with
    /// `abandon_action`, and one whose share moved by more than 10 % with its new assignment.
    pub fn report(&mut self, now: u64, reports: Vec<Report>) -> Vec<Action> {
        self.record(now, reports, After::Nothing)
    }

    /// Takes one message at `now`: its reports ([`Watcher::report`]), then the stream's duties
    /// when they are due ([`Watcher::duties_due`]). A share the message figured on a counter
    /// its bucket holds alone cannot have moved by the time the duties run, so they skip it;
    /// every other share, and every renewal, they look at as a tick does. It sends what a
    /// report and then a tick at the same instant send.
    pub fn take(&mut self, now: u64, reports: Vec<Report>) -> Vec<Action> {
        if !self.duties_due(now) {
            return self.record(now, reports, After::Nothing);
        }
        let mut actions = self.record(now, reports, After::Duties);
        actions.extend(self.duties(now, Refigure::IfMoved));
        actions
    }

    /// [`Watcher::report`], marking the buckets it figures fresh when `after` is the duties.
    fn record(&mut self, now: u64, reports: Vec<Report>, after: After) -> Vec<Action> {
        let mut actions = Vec::new();
        let refreshed = self.refresh(now);
        let table = Arc::clone(&self.table);
        let mut touched = Vec::with_capacity(reports.len());
        let n = reports.len();
        for (i, report) in reports.into_iter().enumerate() {
            if let Some(place) = self.place_of(self.order.get(i).copied(), &report.bucket)
                && let Some((_, w)) = self.buckets.get_index_mut(place)
            {
                w.observe(now, &report);
                if let Some(c) = &w.counter {
                    w.seat = lock(c).join(&w.target, w.seat, w.demand, None, now);
                }
                touched.push((place, Arrival::Again));
                self.keep_order(i, place);
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
                // No place: the next message's report here is looked for by its id.
                self.keep_order(i, usize::MAX);
                continue;
            }
            let target = target_of(&self.seen, &self.domain, &key::entries(&report.bucket));
            let demand = match target {
                Target::Shared { rate, cost, .. } => first_demand(&report, rate / cost.max(1)),
                Target::Fixed(_) => 0,
            };
            // A report that states no span starts the span the stream's clock measures.
            let span = Span {
                since: now,
                requests: if report.elapsed_ns == 0 {
                    report.requests
                } else {
                    0
                },
            };
            // Relaxed: a unique number, and a count read on its own.
            let id = table.next_holder.fetch_add(1, Ordering::Relaxed);
            table.watched.fetch_add(1, Ordering::Relaxed);
            let (counter, seat) = table.enter(&target, id, demand, None, now);
            let (place, _) = self.buckets.insert_full(
                report.bucket,
                Watched {
                    seat,
                    target,
                    counter,
                    demand,
                    reported_at: now,
                    span,
                    in_force: None,
                    assigned_at: now,
                    figured: None,
                    fresh: false,
                },
            );
            touched.push((place, Arrival::New));
            self.keep_order(i, place);
        }
        self.order.truncate(n);
        let unknown = table.unknown_part();
        // Nothing is taken out of `buckets` in between: each place is still its bucket's.
        for (place, arrival) in touched {
            let Some((bucket, w)) = self.buckets.get_index_mut(place) else {
                continue;
            };
            let send = w.assign(unknown, now, Refigure::Always, after, |in_force, next| {
                (arrival == Arrival::New
                    || refreshed
                    || in_force.is_none_or(|f| replaces(&f, &next)))
                .then(|| told_apart(next.strategy, in_force))
            });
            if let Some(strategy) = send {
                actions.push(Action {
                    bucket: bucket.clone(),
                    kind: ActionKind::Assign(strategy),
                });
            }
        }
        actions
    }

    /// Where `bucket` is among those watched, looked for first at `guess`: where the last
    /// message's report in the same position was. A peer that reports its buckets in the same
    /// order each time (Envoy walks its table of buckets) has each found with no hashing.
    fn place_of(&self, guess: Option<usize>, bucket: &[u8]) -> Option<usize> {
        match guess.and_then(|g| Some((g, self.buckets.get_index(g)?))) {
            Some((g, (watched, _))) if **watched == *bucket => Some(g),
            _ => self.buckets.get_index_of(bucket),
        }
    }

    /// Keeps `place` as the place of a message's `i`th report, for the next message's; past
    /// as many reports as the stream may watch, none is kept.
    fn keep_order(&mut self, i: usize, place: usize) {
        match self.order.get_mut(i) {
            Some(o) => *o = place,
            None if i < self.table.settings.max_buckets_per_stream => self.order.push(place),
            None => {}
        }
    }

    /// The stream's periodic duties at `now`: abandons buckets not reported for a TTL, pushes
    /// an assignment whose share moved by more than 10 % (another stream came, left or changed
    /// its demand) or whose policies a reload replaced, and renews every other assignment, as
    /// in force, once half its TTL, less a quarter of a tick ([`tick_interval`]), has passed.
    /// A share whose counter did not change since it was last figured is not figured again.
    pub fn tick(&mut self, now: u64) -> Vec<Action> {
        self.duties(now, Refigure::IfMoved)
    }

    /// Whether a message taken at `now` should run the duties too ([`Watcher::tick`]): a tick,
    /// less a quarter, has passed since they last ran. A stream that reports about once a
    /// tick, or more often, then has its duties run with its reports, while its counters are
    /// fresh, and its own timer ([`Watcher::next_duties`]) does not wake it.
    #[must_use]
    pub fn duties_due(&self, now: u64) -> bool {
        let (tick, slack) = self.duty_spans();
        now.saturating_sub(self.duties_at) >= tick - slack
    }

    /// When the duties are due with no report (clock nanoseconds): a tick and a quarter
    /// after they last ran, so that a report a little late still runs them first. A renewal is
    /// due that much early, so that it is never later than a tick past half the TTL.
    #[must_use]
    pub fn next_duties(&self) -> u64 {
        let (tick, slack) = self.duty_spans();
        self.duties_at.saturating_add(tick + slack)
    }

    /// The stream's tick ([`tick_interval`]) and its [`SLACK`]th, in nanoseconds.
    fn duty_spans(&self) -> (u64, u64) {
        let tick = tick_interval(self.table.settings.assignment_ttl).as_nanos();
        let tick = u64::try_from(tick).unwrap_or(u64::MAX);
        (tick, tick / SLACK)
    }

    /// [`Watcher::tick`], figuring the shares of buckets neither renewed nor refreshed as
    /// `refigure` says.
    fn duties(&mut self, now: u64, refigure: Refigure) -> Vec<Action> {
        let refreshed = self.refresh(now);
        let table = Arc::clone(&self.table);
        let ttl = u64::try_from(table.settings.assignment_ttl.as_nanos()).unwrap_or(u64::MAX);
        let renew_after = (ttl / 2).saturating_sub(self.duty_spans().1);
        self.duties_at = now;
        let mut actions = Vec::new();
        self.buckets.retain(|bucket, w| {
            let stale = now.saturating_sub(w.reported_at) >= ttl;
            if stale {
                w.forget(&table, now);
                actions.push(Action {
                    bucket: bucket.clone(),
                    kind: ActionKind::Abandon,
                });
            }
            !stale
        });
        let unknown = table.unknown_part();
        for (bucket, w) in &mut self.buckets {
            let fresh = std::mem::take(&mut w.fresh);
            let assigned_at = w.assigned_at;
            let renewal_due = now.saturating_sub(assigned_at) >= renew_after;
            let refigure = if refreshed || renewal_due || w.in_force.is_none() {
                Refigure::Always
            } else if fresh && refigure == Refigure::IfMoved {
                continue;
            } else {
                refigure
            };
            let decide = |in_force: Option<Strategy>, next: Assigned| match in_force {
                Some(f) if !refreshed && !replaces(&f, &next) => {
                    // A renewal repeats the strategy in force, so that Envoy extends the active
                    // assignment instead of replacing it (and refilling its token bucket).
                    renewal_due.then_some(f)
                }
                _ => Some(told_apart(next.strategy, in_force)),
            };
            let send = w.assign(unknown, now, refigure, After::Nothing, decide);
            if let Some(strategy) = send {
                actions.push(Action {
                    bucket: bucket.clone(),
                    kind: ActionKind::Assign(strategy),
                });
            }
        }
        actions
    }

    /// Re-resolves every bucket when the policies changed since they were resolved; whether
    /// they did.
    fn refresh(&mut self, now: u64) -> bool {
        let policies = self.table.policies.load();
        if Arc::ptr_eq(&policies, &self.seen) {
            return false;
        }
        self.seen = policies;
        let table = Arc::clone(&self.table);
        let round = table.round();
        for (bucket, w) in &mut self.buckets {
            w.figured = None;
            let next = target_of(&self.seen, &self.domain, &key::entries(bucket));
            if let (Some(c), Some((quota, rate))) = (&w.counter, same_counter(&w.target, &next)) {
                // The rule kept its counter: the holder stays on it, and the first holder to see
                // the reload moves the counter to the rule's new figures.
                let mut c = lock(c);
                c.refigure(quota, rate);
                w.seat = c.join(&next, w.seat, w.demand, None, now);
                w.target = next;
                continue;
            }
            if let Some(c) = w.counter.take() {
                lock(&c).leave(w.seat, round, now);
            }
            w.target = next;
            // The bucket's Envoy enforces what it was sent until it is sent the new rule's: it
            // stays counted on the new counter until then.
            (w.counter, w.seat) = table.enter(&w.target, w.seat.id, w.demand, w.in_force, now);
        }
        true
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        // Relaxed: a count read on its own.
        self.table.streams.fetch_sub(1, Ordering::Relaxed);
        let now = self
            .buckets
            .values()
            .map(|w| w.reported_at)
            .max()
            .unwrap_or(0);
        for w in self.buckets.values() {
            w.forget(&self.table, now);
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
            self.span = Span {
                since: now,
                requests: 0,
            };
            return;
        }
        let requests = self.span.requests.saturating_add(report.requests);
        let span = now.saturating_sub(self.span.since);
        if span >= SHORTEST_SPAN_NS {
            self.demand = rate_over(requests, span);
            self.span = Span {
                since: now,
                requests: 0,
            };
        } else {
            self.span.requests = requests;
        }
    }

    /// Decides, under its counter's lock, what to send now: `decide` is given the strategy in
    /// force and the assignment due, and what it returns is sent and counted as in force at
    /// once. Nothing while its rule's part is unknown and the table waits for it. With the
    /// duties `after` it, the bucket is marked fresh when it holds its counter alone: a
    /// message's joins all come before its first share is figured, so no other report of it
    /// touches that counter since.
    fn assign(
        &mut self,
        unknown: u64,
        now: u64,
        refigure: Refigure,
        after: After,
        decide: impl FnOnce(Option<Strategy>, Assigned) -> Option<Strategy>,
    ) -> Option<Strategy> {
        let Some(counter) = &self.counter else {
            let next = Assigned {
                strategy: self.target.strategy(0),
                room: Room::Enough,
            };
            let send = decide(self.in_force, next)?;
            (self.in_force, self.assigned_at) = (Some(send), now);
            return Some(send);
        };
        let mut c = lock(counter);
        self.fresh = after == After::Duties && c.holders.len() == 1;
        let capacity = c.capacity(unknown)?;
        let unmoved = self.figured
            == Some(Figured {
                revision: c.revision,
                capacity,
            });
        if refigure == Refigure::IfMoved && unmoved {
            return None;
        }
        let share = c.share(self.seat, capacity, now);
        // A change still pending may be divided once it is old enough, with no other change.
        self.figured = (c.pending == 0).then_some(Figured {
            revision: c.revision,
            capacity,
        });
        let next = Assigned {
            strategy: self.target.strategy(share.tokens),
            room: share.room,
        };
        let send = decide(self.in_force, next)?;
        c.put_in_force(self.seat, send);
        (self.in_force, self.assigned_at) = (Some(send), now);
        Some(send)
    }

    /// Takes the bucket out of `table`.
    fn forget(&self, table: &ShareTable, now: u64) {
        // Relaxed: a count read on its own.
        table.watched.fetch_sub(1, Ordering::Relaxed);
        if let Some(c) = &self.counter {
            lock(c).leave(self.seat, table.round(), now);
        }
    }
}

/// The demand a bucket's first report on a stream reads as, for a rule of `rate` requests per
/// second ([`PER_TOKEN`]ths): what it states, or, when it states no span (Envoy's first report
/// of a new bucket says 0), the whole rule: a new bucket is given a large share at once, and
/// its next reports say what it really offers.
fn first_demand(report: &Report, rate: u64) -> u64 {
    report.demand().unwrap_or(rate)
}

/// The figures of `next`, its quota and rate, when it divides the counter `was` divides.
fn same_counter(was: &Target, next: &Target) -> Option<(Quota, u64)> {
    match (was, next) {
        (
            Target::Shared { counter: a, .. },
            Target::Shared {
                counter: b,
                quota,
                rate,
                ..
            },
        ) if a == b => Some((*quota, *rate)),
        _ => None,
    }
}

/// `next`, told apart by Envoy from the token bucket `in_force` (see
/// [`TokenBucket::told_apart_from`]).
fn told_apart(next: Strategy, in_force: Option<Strategy>) -> Strategy {
    match (next, in_force) {
        (Strategy::TokenBucket(n), Some(Strategy::TokenBucket(f))) => {
            Strategy::TokenBucket(n.told_apart_from(&f))
        }
        _ => next,
    }
}

/// Whether `next` replaces `in_force`: it moved past a [`MOVE_DIVISOR`]th, or it is slower
/// while room is wanted.
fn replaces(in_force: &Strategy, next: &Assigned) -> bool {
    let shrank = match (in_force, &next.strategy) {
        (Strategy::TokenBucket(a), Strategy::TokenBucket(b)) => b.slower_than(a),
        _ => false,
    };
    in_force.moved(&next.strategy) || (next.room == Room::Wanted && shrank)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::*;
    use crate::limiter::gcra::NANOS_PER_SEC;
    use crate::policy;
    use crate::rlqs::{BucketId, target};

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

    /// A table of `n` streams at most, matching against `policies`.
    fn crowd(n: usize, policies: PolicyHandle) -> Arc<ShareTable> {
        Arc::new(ShareTable::new(
            RlqsSettings {
                assignment_ttl: Duration::from_secs(10),
                max_buckets_per_stream: 10,
                max_streams: n,
                max_streams_per_connection: n,
                max_streams_per_peer: n,
            },
            policies,
        ))
    }

    fn report(value: &str, per_second: u64) -> Report {
        Report {
            bucket: key::flat(&[("user".to_string(), value.to_string())].into()),
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
    fn a_bucket_is_found_wherever_its_report_sits_in_the_message() {
        let table = table(10);
        let mut a = table.open("d".into()).expect("a");
        let [x, y, z] = ["x", "y", "z"].map(|v| report(v, 10));
        a.report(0, vec![x.clone(), y.clone(), z.clone()]);
        let unknown = report("w", 10).bucket;
        assert_eq!(a.order, [0, 1, 2]);
        let guesses = [None, Some(0), Some(1), Some(2), Some(3), Some(usize::MAX)];
        for guess in guesses {
            for bucket in [&x.bucket, &y.bucket, &z.bucket, &unknown] {
                assert_eq!(
                    a.place_of(guess, bucket),
                    a.buckets.get_index_of(&bucket[..]),
                    "{guess:?}"
                );
            }
        }
        // Another order, and another demand for one of them: each report is its own bucket's,
        // and the next message is looked for in this order.
        let z_now = report("z", 40);
        a.report(1, vec![z_now.clone(), x.clone()]);
        assert_eq!(a.watched(), 3);
        assert_eq!(a.order, [2, 0]);
        let demand = |r: &Report| a.buckets[&r.bucket[..]].demand;
        assert_eq!(demand(&z_now), z_now.demand().expect("a span"));
        assert_eq!(demand(&x), x.demand().expect("a span"));
        assert_ne!(demand(&z_now), demand(&x));
    }

    /// Shares figured so far on every counter of `table`.
    #[test]
    fn a_seat_finds_only_its_own_holder_and_a_slot_left_is_given_again() {
        let holder = |id| Holder {
            id,
            cost: 1,
            demand: 0,
            claim: 0,
            divided_claim: 0,
            due: None,
            bucket: None,
            in_force: 0,
            wanting: false,
        };
        let mut holders = Holders::default();
        let a = holders.insert(holder(1));
        let b = holders.insert(holder(2));
        assert_eq!((a.slot, b.slot, holders.len()), (0, 1, 2));
        assert_eq!(holders.remove(a).map(|h| h.id), Some(1));
        assert!(holders.get(a).is_none());
        let c = holders.insert(holder(3));
        assert_eq!(c.slot, a.slot);
        // The slot is another's now: the old seat finds nothing, and takes nothing out.
        assert!(holders.get(a).is_none());
        assert!(holders.remove(a).is_none());
        assert!(holders.get(Seat::unseated(2)).is_none());
        let ids: Vec<u64> = holders.values().map(|h| h.id).collect();
        assert_eq!((ids, holders.len()), (vec![3, 2], 2));
        holders.remove(b);
        holders.remove(c);
        assert!(holders.is_empty() && holders.slots.is_empty() && holders.free.is_empty());
    }

    fn figured(table: &ShareTable) -> usize {
        table.counters.iter().map(|c| lock(c.value()).figured).sum()
    }

    #[test]
    fn a_tick_figures_no_share_whose_counter_did_not_move() {
        let table = table(10);
        let mut a = table.open("d".into()).expect("a");
        let mut b = table.open("d".into()).expect("b");
        assert_eq!(rate(&a.report(0, vec![report("x", 80)])), 100.0);
        assert!(rate(&b.report(0, vec![report("x", 80)])) < 1e-9);
        // `a` shrinks to its half at its tick; that frees room, and `b`'s tick takes it.
        assert_eq!(rate(&a.tick(1)), 50.0);
        assert_eq!(rate(&b.tick(1)), 50.0);
        // `b`'s new bucket moved the counter: `a` figures its share once more, and keeps it.
        assert!(a.tick(2).is_empty() && b.tick(2).is_empty());
        let settled = figured(&table);
        assert!(a.tick(3).is_empty() && b.tick(3).is_empty());
        assert_eq!(figured(&table), settled, "nothing moved: no share figured");
        assert!(a.report(3, vec![report("x", 80)]).is_empty());
        assert_eq!(figured(&table), settled + 1, "a report figures its share");
        // `b` asks for a quarter as much: `a`'s share grows, and its next tick pushes it.
        assert_eq!(rate(&b.report(4, vec![report("x", 20)])), 25.0);
        assert_eq!(rate(&a.tick(5)), 75.0);
        assert!(a.tick(6).is_empty() && b.tick(6).is_empty());
        // `b` leaves: its share is `a`'s at its next tick.
        drop(b);
        assert_eq!(rate(&a.tick(7)), 100.0);
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
        let mut tokens = [0u64; 3];
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
                    tokens[i] = b.held(1);
                }
            }
            // Exactly: each bucket's rate rounded up, in billionths of a token per second.
            let sum: u64 = tokens.iter().sum();
            assert!(sum <= 100 * PER_TOKEN, "step {step}: {held:?}");
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
            bucket: key::flat(&[("banned".to_string(), "x".to_string())].into()),
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
        // An abandoned report has no place for the next message's to be looked for at, and no
        // more places are kept than the stream may watch buckets.
        assert_eq!(s.order, [usize::MAX]);
        let many: Vec<Report> = ["x", "y", "z"].map(|v| report(v, 1)).into();
        assert!(
            s.report(0, many)
                .iter()
                .all(|a| a.kind == ActionKind::Abandon)
        );
        assert_eq!(s.order, [usize::MAX]);
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
    fn duties_run_with_a_report_near_the_tick_and_renew_a_slack_before_half_the_ttl() {
        // A TTL of 10 s: a tick of 1 s, and a slack of 250 ms.
        let table = table(10);
        let mut s = table.open("d".into()).expect("s");
        let ms = NANOS_PER_SEC / 1_000;
        s.report(0, vec![report("x", 100)]);
        assert!(s.tick(0).is_empty(), "just assigned");
        assert_eq!(s.next_duties(), 1_250 * ms, "a tick and a slack on");
        assert!(!s.duties_due(749 * ms), "a report sooner runs none");
        assert!(
            s.duties_due(750 * ms),
            "a report a slack before the tick runs them"
        );
        assert!(s.tick(1_000 * ms).is_empty());
        assert_eq!(
            s.next_duties(),
            2_250 * ms,
            "counted from when they last ran"
        );
        assert!(!s.duties_due(1_749 * ms));
        assert!(s.tick(4_749 * ms).is_empty(), "no renewal yet");
        let renewed = s.tick(4_750 * ms);
        assert_eq!(renewed.len(), 1, "{renewed:?}");
        assert!(matches!(
            renewed[0].kind,
            ActionKind::Assign(Strategy::TokenBucket(_))
        ));
    }

    #[test]
    fn with_a_fleet_only_this_nodes_part_is_divided() {
        let table = table(10);
        let mut a = table.open("d".into()).expect("a");
        let x = report("x", 300);
        let asked = a.rules_without_part(std::slice::from_ref(&x));
        assert_eq!(asked.len(), 1, "a new rule is asked for: {asked:?}");
        assert!(
            (asked[0].tokens - 100.0).abs() < 1e-9,
            "a claim of 300 counts as the whole rule: {asked:?}"
        );
        // A part told before the first bucket joins is that bucket's first assignment.
        table.set_unknown_part(Some(0.5));
        table.set_part(asked[0].counter, 400_000, 0);
        assert!(
            a.rules_without_part(std::slice::from_ref(&x)).is_empty(),
            "told, not asked again"
        );
        assert_eq!(rate(&a.report(0, vec![x.clone()])), 40.0);
        assert!(
            a.rules_without_part(std::slice::from_ref(&x)).is_empty(),
            "watched"
        );
        // A part told for a rule no bucket joins is dropped two rounds later.
        table.set_part(12_345, 900_000, 0);
        let _ = table.demands(0);
        let _ = table.demands(0);
        assert_eq!(table.kept_parts(), 0, "dropped");
        // Until the fleet tells it, a rule is assumed the unknown part.
        assert_eq!(rate(&a.report(0, vec![report("y", 300)])), 50.0);
        // Or, when the table is to wait for it, not assigned until told, then pushed.
        table.set_unknown_part(None);
        let z = report("z", 300);
        let z_rule = a.rules_without_part(std::slice::from_ref(&z))[0].counter;
        assert!(a.report(0, vec![z]).is_empty(), "nothing assigned yet");
        assert!(a.tick(1).is_empty(), "nor at a tick");
        table.set_part(z_rule, 200_000, 0);
        assert_eq!(rate(&a.tick(2)), 20.0, "the told part is pushed");
        // Parts that move are pushed; a part that is not a number is none.
        let demands = table.demands(0);
        assert_eq!(demands.len(), 3);
        for d in &demands {
            table.set_part(d.counter, 250_000, 0);
        }
        let pushed = a.tick(3);
        assert_eq!(pushed.len(), 3, "{pushed:?}");
        for action in &pushed {
            assert_eq!(rate(std::slice::from_ref(action)), 25.0);
        }
        // A part that shrinks by less than the 10 % that moves a share is still pushed: the
        // buckets in force would add up past it.
        for d in &demands {
            table.set_part(d.counter, 240_000, 0);
        }
        let pushed = a.tick(3);
        assert_eq!(pushed.len(), 3, "{pushed:?}");
        for action in &pushed {
            assert_eq!(rate(std::slice::from_ref(action)), 24.0);
        }
        for d in &demands {
            table.set_part(d.counter, millionths(f64::NAN), 0);
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
            bucket: key::flat(&[("user".to_string(), "a".to_string())].into()),
            elapsed_ns: NANOS_PER_SEC,
            requests: n,
        };
        let search = |n| Report {
            bucket: key::flat(
                &[
                    ("user".to_string(), "a".to_string()),
                    ("route".to_string(), "search".to_string()),
                ]
                .into(),
            ),
            elapsed_ns: NANOS_PER_SEC,
            requests: n,
        };
        // 300 plain requests a second against 30 searches (300 tokens): an even split of the
        // 100 tokens, 50 plain requests and 5 searches, once both have been pushed.
        let mut in_force = [0.0f64; 2];
        let mut held = [0u64; 2];
        let keep = |rate: &mut f64, held: &mut u64, cost, actions: Vec<Action>| {
            for a in actions {
                if let ActionKind::Assign(Strategy::TokenBucket(b)) = a.kind {
                    (*rate, *held) = (b.rate(), b.held(cost));
                }
            }
        };
        for step in 0..8 {
            let [cheap_rate, dear_rate] = &mut in_force;
            let [cheap_held, dear_held] = &mut held;
            keep(
                cheap_rate,
                cheap_held,
                1,
                cheap.report(step, vec![plain(300)]),
            );
            keep(
                dear_rate,
                dear_held,
                10,
                dear.report(step, vec![search(30)]),
            );
            assert!(
                held[0] + held[1] <= 100 * PER_TOKEN,
                "step {step}: {in_force:?}"
            );
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
        let rule = a.rules_without_part(std::slice::from_ref(&x))[0].counter;
        table.set_unknown_part(None);
        table.set_part(rule, 500_000, 0);
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
        table.set_part(rule, 500_000, 8 * sec);
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
        table.set_part(rule, 500_000, 6 * sec);
        assert!(!a.tick(7 * sec).is_empty(), "renewed once confirmed");
        // A part told of a rule no stream watches, then unconfirmed, is not kept for the next.
        table.set_part(12_345, 900_000, 0);
        table.set_unconfirmed(12_345);
        assert_eq!(table.kept_parts(), 0);
    }

    /// The report of a [`Step::Report`]: `requests` of `bucket` over a second when `stated`,
    /// else over no stated span.
    fn stepped(bucket: &BucketId, requests: u64, stated: bool) -> Report {
        Report {
            bucket: key::flat(bucket),
            elapsed_ns: if stated { NANOS_PER_SEC } else { 0 },
            requests,
        }
    }

    /// A step of the exactness property: what the streams and the fleet may do.
    #[derive(Clone, Copy, Debug)]
    enum Step {
        Open(usize),
        Close(usize),
        /// A stream reports a bucket (0: plain, 1: of cost 3): requests over a second, or over
        /// no stated span.
        Report(usize, usize, u64, bool),
        Tick(usize),
        Part(f64),
        Unknown(Option<f64>),
        Reload(u32),
        Wait(u64),
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            (0..4usize).prop_map(Step::Open),
            (0..4usize).prop_map(Step::Close),
            (0..4usize, 0..2usize, 0..2_000u64, any::<bool>())
                .prop_map(|(s, b, n, stated)| Step::Report(s, b, n, stated)),
            (0..4usize).prop_map(Step::Tick),
            prop_oneof![
                (0..=1_000_000u64).prop_map(|m| m as f64 / 1e6),
                Just(f64::NAN),
                any::<f64>()
            ]
            .prop_map(Step::Part),
            proptest::option::of(0.0..=1.0f64).prop_map(Step::Unknown),
            prop_oneof![Just(3u32), Just(7), Just(100), Just(1_000), Just(123_457)]
                .prop_map(Step::Reload),
            prop_oneof![
                Just(0u64),
                Just(NANOS_PER_SEC / 1_000),
                Just(NANOS_PER_SEC / 3),
                Just(NANOS_PER_SEC),
                Just(6 * NANOS_PER_SEC)
            ]
            .prop_map(Step::Wait),
        ]
    }

    const COSTLY: &str = "domain: d
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: RATE}
    descriptors:
      - key: route
        value: search
        cost: 3
";

    /// [`COSTLY`] at `rate` a second.
    fn costly(rate: u32) -> PolicySet {
        policy::load_str(&[("d.yaml", &COSTLY.replace("RATE", &rate.to_string()))]).expect("policy")
    }

    /// A bucket of [`COSTLY`]'s plain rule, and one of its cost node.
    fn costly_buckets() -> [BucketId; 2] {
        [
            [("user".to_string(), "a".to_string())].into(),
            [
                ("user".to_string(), "a".to_string()),
                ("route".to_string(), "search".to_string()),
            ]
            .into(),
        ]
    }

    #[test]
    fn the_buckets_sent_never_take_more_than_the_others_leave_of_the_part() {
        use proptest::prelude::*;
        let buckets = costly_buckets();
        let costs = [1u64, 3];
        let config = ProptestConfig {
            cases: 200,
            ..ProptestConfig::default()
        };
        proptest!(config, |(steps in proptest::collection::vec(step(), 1..120))| {
            let policies = PolicyHandle::new(costly(100));
            let table = crowd(4, policies.clone());
            let Target::Shared { counter, .. } = target(&policies.load(), "d", &buckets[0]) else {
                panic!("a shared rule");
            };
            let mut streams: Vec<Option<Watcher>> = (0..4).map(|_| None).collect();
            // What each stream's Envoy enforces for each bucket, and the model of the part.
            let mut in_force: HashMap<(usize, usize), TokenBucket> = HashMap::new();
            let (mut rate, mut told, mut unknown) = (100u64, None::<u64>, Some(PER_RULE));
            let mut now = 0u64;
            let held = |in_force: &HashMap<(usize, usize), TokenBucket>| -> u128 {
                in_force
                    .iter()
                    .map(|((_, b), t)| u128::from(t.held(costs[*b])))
                    .sum()
            };
            for step in steps {
                let before = held(&in_force);
                let actions = match step {
                    Step::Open(i) => {
                        if streams[i].is_none() {
                            streams[i] = Some(table.open("d".into()).expect("open"));
                        }
                        continue;
                    }
                    Step::Close(i) => {
                        streams[i] = None;
                        in_force.retain(|(s, _), _| *s != i);
                        continue;
                    }
                    Step::Part(p) => {
                        told = Some(millionths(p));
                        table.set_part(counter, millionths(p), 0);
                        continue;
                    }
                    Step::Unknown(p) => {
                        table.set_unknown_part(p);
                        unknown = p.map(millionths);
                        continue;
                    }
                    Step::Reload(r) => {
                        policies.store(costly(r));
                        rate = u64::from(r);
                        continue;
                    }
                    Step::Wait(dt) => {
                        now += dt;
                        continue;
                    }
                    Step::Report(i, b, requests, stated) => {
                        let Some(s) = streams[i].as_mut() else { continue };
                        s.report(now, vec![stepped(&buckets[b], requests, stated)])
                            .into_iter()
                            .map(|a| (i, a))
                            .collect::<Vec<_>>()
                    }
                    Step::Tick(i) => {
                        let Some(s) = streams[i].as_mut() else { continue };
                        s.tick(now).into_iter().map(|a| (i, a)).collect()
                    }
                };
                let capacity = told
                    .or(unknown)
                    .map(|m| u128::from(rate * PER_TOKEN) * u128::from(m) / u128::from(PER_RULE));
                for (i, action) in actions {
                    let b = buckets.iter().position(|x| key::flat(x) == action.bucket).expect("bucket");
                    in_force.remove(&(i, b));
                    let ActionKind::Assign(crate::rlqs::Strategy::TokenBucket(t)) = action.kind else {
                        continue;
                    };
                    let others = held(&in_force);
                    let sent = u128::from(t.held(costs[b]));
                    let capacity = capacity.expect("nothing is sent of a part unknown");
                    // What is sent takes no more than the others leave of the part (the least
                    // bucket, for a share of none, holds none).
                    prop_assert!(
                        sent + others <= capacity || sent == 0,
                        "sent {:?} ({}) with {} held by others of {}", t, sent, others, capacity
                    );
                    in_force.insert((i, b), t);
                }
                let after = held(&in_force);
                // The buckets in force never add up past the part, but for what a shrink of the
                // part left, which only falls.
                if let Some(capacity) = capacity {
                    prop_assert!(after <= capacity || after <= before, "{} then {} of {}", before, after, capacity);
                }
            }
        });
    }

    /// Two tables fed the same steps, each with four places for streams, for the tests that
    /// hold two ways of doing one thing to the same answers.
    struct Twins {
        sides: [(PolicyHandle, Arc<ShareTable>); 2],
        streams: [Vec<Option<Watcher>>; 2],
        /// The counter of [`costly_buckets`].
        counter: u128,
        now: u64,
    }

    impl Twins {
        fn new(buckets: &[BucketId; 2]) -> Self {
            let sides: [(PolicyHandle, Arc<ShareTable>); 2] = std::array::from_fn(|_| {
                let handle = PolicyHandle::new(costly(100));
                (handle.clone(), crowd(4, handle))
            });
            let Target::Shared { counter, .. } = target(&sides[0].0.load(), "d", &buckets[0])
            else {
                panic!("a shared rule");
            };
            Self {
                sides,
                streams: std::array::from_fn(|_| (0..4).map(|_| None).collect()),
                counter,
                now: 0,
            }
        }

        /// Takes `step` on both sides when it is not a stream's report or tick, which the test
        /// takes itself: whether it did.
        fn take(&mut self, step: &Step) -> bool {
            for (side, (handle, table)) in self.sides.iter().enumerate() {
                let streams = &mut self.streams[side];
                match *step {
                    Step::Open(i) => {
                        if streams[i].is_none() {
                            streams[i] = Some(table.open("d".into()).expect("open"));
                        }
                    }
                    Step::Close(i) => streams[i] = None,
                    Step::Part(p) => {
                        // A few parts, so that a capacity comes back to one figured before.
                        let part = [900_000, 910_000, PER_RULE][millionths(p) as usize % 3];
                        table.set_part(self.counter, part, 0);
                    }
                    Step::Unknown(p) => table.set_unknown_part(p),
                    Step::Reload(r) => handle.store(costly(r)),
                    Step::Wait(_) => {}
                    Step::Report(..) | Step::Tick(_) => return false,
                }
            }
            if let Step::Wait(dt) = *step {
                self.now += dt;
            }
            true
        }
    }

    /// Takes `steps` on [`Twins`], each report and tick on each side as `take` does it (side,
    /// stream, step, now), and fails unless both sides send the same.
    fn twins_agree(
        steps: Vec<Step>,
        buckets: &[BucketId; 2],
        mut take: impl FnMut(usize, &mut Watcher, Step, u64) -> Vec<Action>,
    ) -> Result<(), proptest::test_runner::TestCaseError> {
        let mut twins = Twins::new(buckets);
        for step in steps {
            if twins.take(&step) {
                continue;
            }
            let (Step::Report(i, ..) | Step::Tick(i)) = step else {
                unreachable!("taken by the twins");
            };
            let now = twins.now;
            let sent: [Vec<Action>; 2] = std::array::from_fn(|side| {
                twins.streams[side][i]
                    .as_mut()
                    .map_or_else(Vec::new, |s| take(side, s, step, now))
            });
            proptest::prop_assert_eq!(&sent[0], &sent[1], "{:?}", step);
        }
        Ok(())
    }

    /// A thousand sequences of [`step`]s, each of up to 120.
    fn twin_steps() -> (
        proptest::test_runner::Config,
        impl proptest::strategy::Strategy<Value = Vec<Step>>,
    ) {
        let config = proptest::test_runner::Config {
            cases: 1_000,
            ..proptest::test_runner::Config::default()
        };
        (config, proptest::collection::vec(step(), 1..120))
    }

    #[test]
    fn a_tick_that_skips_unmoved_shares_sends_what_figuring_every_share_sends() {
        // One bucket a stream, so that a tick's order over its buckets cannot tell them apart.
        let buckets = costly_buckets();
        let (config, steps) = twin_steps();
        proptest::proptest!(config, |(steps in steps)| {
            // Ticked on one side skipping unmoved shares, on the other figuring every share.
            twins_agree(steps, &buckets, |side, s, step, now| match step {
                Step::Report(i, _, requests, stated) => {
                    s.report(now, vec![stepped(&buckets[i % 2], requests, stated)])
                }
                _ => s.duties(now, [Refigure::IfMoved, Refigure::Always][side]),
            })?;
        });
    }

    #[test]
    fn taking_a_message_sends_what_its_reports_and_then_its_duties_send() {
        let buckets = costly_buckets();
        let (config, steps) = twin_steps();
        proptest::proptest!(config, |(steps in steps)| {
            // One side takes each message whole; the other reports it and then runs the duties
            // when they are due, figuring every share they look at.
            twins_agree(steps, &buckets, |side, s, step, now| match step {
                Step::Report(_, b, requests, stated) => {
                    // One bucket, both, or one of them twice, as a message may report a bucket
                    // twice: a bucket alone on its counter, or not.
                    let shape: &[usize] = match requests % 3 {
                        0 => &[b],
                        1 => &[b, 1 - b],
                        _ => &[b, 1 - b, b],
                    };
                    let reports: Vec<Report> = shape
                        .iter()
                        .map(|&b| stepped(&buckets[b], requests, stated))
                        .collect();
                    if side == 0 {
                        return s.take(now, reports);
                    }
                    let due = s.duties_due(now);
                    let mut sent = s.report(now, reports);
                    if due {
                        sent.extend(s.duties(now, Refigure::Always));
                    }
                    sent
                }
                _ => s.tick(now),
            })?;
        });
    }

    /// Four streams on one bucket of a rule of 1,000 a second, this node's part 0.9, and what
    /// each step sent, a tick figuring shares as `refigure` says.
    fn a_part_that_comes_back(refigure: Refigure) -> Vec<Vec<Action>> {
        let set = policy::load_str(&[(
            "d.yaml",
            "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 1000}\n",
        )])
        .expect("policy");
        let table = crowd(4, PolicyHandle::new(set));
        let mut streams: Vec<Watcher> = (0..4)
            .map(|_| table.open("d".into()).expect("open"))
            .collect();
        let Target::Shared { counter, .. } = target(
            &table.policies(),
            "d",
            &key::bucket_id(&report("x", 0).bucket),
        ) else {
            panic!("a shared rule");
        };
        table.set_part(counter, 900_000, 0);
        let mut sent = Vec::new();
        for (i, s) in streams.iter_mut().enumerate() {
            sent.push(s.report(0, vec![report("x", if i == 0 { 1_000 } else { 170 })]));
        }
        for now in 1..4 {
            for s in &mut streams {
                sent.push(s.duties(now, refigure));
            }
        }
        // Claims moved by less than a step: no change counted, and nothing sent.
        for s in &mut streams[1..] {
            sent.push(s.report(4, vec![report("x", 178)]));
        }
        // Another stream divides at another part, and the part comes back.
        table.set_part(counter, 910_000, 0);
        sent.push(streams[1].duties(5, refigure));
        table.set_part(counter, 900_000, 0);
        sent.push(streams[0].duties(6, refigure));
        sent
    }

    #[test]
    fn a_share_divided_at_another_capacity_is_figured_again_when_it_comes_back() {
        let skipping = a_part_that_comes_back(Refigure::IfMoved);
        assert_eq!(skipping, a_part_that_comes_back(Refigure::Always));
        // The first stream's share shrank by more than a move, and its tick pushed it.
        assert!(rate(skipping.last().expect("the last tick")) < 240.0);
    }

    #[test]
    fn ten_thousand_streams_joining_one_bucket_are_divided_in_batches() {
        let n = 10_000;
        let table = crowd(
            n,
            PolicyHandle::new(policy::load_str(&[("d.yaml", POLICY)]).expect("policy")),
        );
        let mut streams: Vec<Watcher> = (0..n)
            .map(|_| table.open("d".into()).expect("open"))
            .collect();
        for (i, s) in streams.iter_mut().enumerate() {
            let actions = s.report(0, vec![report("x", 10 + i as u64 % 50)]);
            assert_eq!(actions.len(), 1, "every newcomer is answered at once");
        }
        let counter = table.counters.iter().next().expect("one counter");
        let c = lock(counter.value());
        assert_eq!(c.holders.len(), n);
        // A division of every join would divide n²/2 (50 million) holders; batches of a
        // thirty-second of the holders divide about 33 n.
        assert!(c.divided <= 40 * n, "{} holders divided", c.divided);
        assert!(c.in_force <= u128::from(100 * PER_TOKEN), "{}", c.in_force);
    }

    #[test]
    fn a_reload_that_changes_the_rate_moves_ten_thousand_holders_with_one_division() {
        let n = 10_000;
        let at = |rate: u64| {
            policy::load_str(&[(
                "d.yaml",
                &POLICY.replace(
                    "requests_per_unit: 100",
                    &format!("requests_per_unit: {rate}"),
                ),
            )])
            .expect("policy")
        };
        let table = crowd(n, PolicyHandle::new(at(100)));
        let mut streams: Vec<Watcher> = (0..n)
            .map(|_| table.open("d".into()).expect("open"))
            .collect();
        // What each stream's Envoy enforces, in billionths of a token per second.
        let mut held = vec![0u64; n];
        let mut sum = 0u128;
        let mut now = 0;
        for (i, s) in streams.iter_mut().enumerate() {
            for action in s.report(now, vec![report("x", 10 + i as u64 % 50)]) {
                if let ActionKind::Assign(Strategy::TokenBucket(b)) = action.kind {
                    held[i] = b.held(1);
                }
            }
            sum += u128::from(held[i]);
        }
        let counter = {
            let entry = table.counters.iter().next().expect("one counter");
            Arc::clone(entry.value())
        };
        for rate in [50u64, 200] {
            let capacity = u128::from(rate * PER_TOKEN);
            table.policies.store(at(rate));
            let divided = lock(&counter).divided;
            // Every stream wakes to the reload; then those that were short of their share
            // (room made by the others' shrinking) are pushed it at their next tick.
            for pass in 0..2 {
                now += 1;
                for (i, s) in streams.iter_mut().enumerate() {
                    let before = sum;
                    for action in s.tick(now) {
                        let ActionKind::Assign(Strategy::TokenBucket(b)) = action.kind else {
                            panic!("a token bucket: {action:?}");
                        };
                        sum -= u128::from(held[i]);
                        let others = sum;
                        let sent = u128::from(b.held(1));
                        // What is sent takes no more than the others' buckets, the old rule's
                        // while they are in force, leave of the new rule.
                        assert!(
                            sent + others <= capacity || sent == 0,
                            "rate {rate}, pass {pass}, stream {i}: {b:?} with {others} held"
                        );
                        held[i] = b.held(1);
                        sum += u128::from(held[i]);
                    }
                    let after = sum;
                    assert!(
                        after <= capacity || after <= before,
                        "rate {rate}, pass {pass}, stream {i}: {before} then {after}"
                    );
                }
            }
            let c = lock(&counter);
            assert_eq!(c.holders.len(), n);
            // One whole division for the reload, not one per batch of holders moving.
            assert!(
                c.divided - divided <= n,
                "{} holders divided over a reload of {n}",
                c.divided - divided
            );
            drop(c);
            // Each asks for more than its fair part of the new rule: each holds that part.
            let fair = rate * PER_TOKEN / n as u64;
            for (i, h) in held.iter().enumerate() {
                assert!(
                    (fair - fair / 100..=fair).contains(h),
                    "rate {rate}, stream {i}: {h} held, {fair} fair"
                );
            }
            assert_eq!(sum, held.iter().map(|h| u128::from(*h)).sum::<u128>());
            assert!(sum <= capacity, "rate {rate}: {sum} held");
        }
    }

    #[test]
    fn a_reload_that_gives_a_bucket_another_rule_moves_it_to_that_rules_counter() {
        let table = table(10);
        let mut a = table.open("d".into()).expect("a");
        let mut b = table.open("d".into()).expect("b");
        assert_eq!(rate(&a.report(0, vec![report("x", 300)])), 100.0);
        b.report(0, vec![report("y", 300)]);
        let counter_of = |w: &Watcher, value: &str| {
            let bucket: BucketId = [("user".to_string(), value.to_string())].into();
            let mut flat = Vec::new();
            key::flatten(&bucket, &mut flat);
            match w.buckets.get(flat.as_slice()).map(|w| w.target) {
                Some(Target::Shared { counter, .. }) => counter,
                other => panic!("a shared target: {other:?}"),
            }
        };
        let (before, kept) = (counter_of(&a, "x"), counter_of(&b, "y"));
        // `x` gets a rule of its own; `y` keeps the general one, at a new rate.
        table.policies.store(
            policy::load_str(&[(
                "d.yaml",
                "domain: d
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 60}
  - key: user
    value: x
    rate_limit: {unit: second, requests_per_unit: 30}
",
            )])
            .expect("policy"),
        );
        assert_eq!(rate(&a.tick(1)), 30.0);
        assert_eq!(rate(&b.tick(1)), 60.0);
        let after = counter_of(&a, "x");
        assert_ne!(before, after, "another rule, another counter");
        let holders = |counter: u128| {
            table
                .counters
                .get(&counter)
                .map_or(0, |c| lock(c.value()).holders.len())
        };
        assert_eq!((holders(before), holders(after)), (0, 1));
        assert_eq!(counter_of(&b, "y"), kept, "the same rule, the same counter");
        assert_eq!(holders(kept), 1);
    }
}
