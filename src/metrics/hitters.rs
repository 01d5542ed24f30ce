//! Heavy hitters per rule: for each limited rule, the keys (the descriptor values its counter
//! depends on) with the most hits and the most refusals over the last minute, and the smallest
//! remaining each was last answered with, so that "who is being limited, by which rule" has an
//! answer without a series per value.
//!
//! Each rule holds a fixed number of slots, whatever the traffic: a filtered space-saving sketch
//! (Metwally et al.; the filter of Homem and Carvalho) of `capacity` = [`CAPACITY_PER_TOP`] ×
//! `top` slots for hits and one for refusals, in each of two rotating halves of
//! [`HALF_SECONDS`]. Once the slots are full, a key not in them is counted in a filter cell of
//! its hash ([`FILTER_CELLS_PER_SLOT`] × `capacity` cells, each an upper bound of the counts of
//! the untracked keys that fall in it) and takes the smallest count's slot only when its cell
//! and its hits pass that count, starting from its cell's count, which is also its error; the
//! key it evicts leaves its count in its own cell. So a rotating attacker churns the filter and
//! the slots' low end, and never grows memory. The window is the current half and the one before
//! it (30 to 60 s). Every reported count is at least the true count and within `N / capacity` of
//! it, `N` being the total (hits or refusals) the rule saw in the window: the slots' counts never
//! add up past `N`, and no error exceeds the smallest of them. [`RuleView`] carries that bound.
//!
//! Cost on the request path: one hash of the key's entries, one map lookup for the rule, one
//! mutex per rule, and no allocation when the key is already tracked. An untracked key is one
//! index miss and one cell; one admitted costs a sift in a min-heap of the slots by count (so
//! the smallest is found without a scan) and reuses its slot's string. It reads the current
//! counter of no key: the read side (the admin port) does that for the few keys it shows.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use dashmap::DashMap;
use foldhash::fast::FixedState;
use smallvec::SmallVec;

use crate::limiter::key::KeyHash;
use crate::policy::{PolicySet, Rule};

/// Slots per key shown: a rule showing the top `k` keys tracks `CAPACITY_PER_TOP × k`.
pub const CAPACITY_PER_TOP: usize = 10;

/// Filter cells per slot: an untracked key is counted in one of `FILTER_CELLS_PER_SLOT ×
/// capacity` cells until it passes the smallest slot's count.
pub const FILTER_CELLS_PER_SLOT: usize = 4;

/// Seconds per half of the window: the window is the current half and the one before.
pub const HALF_SECONDS: u64 = 30;

/// One key seen by a rule: its descriptor entries and what the sketch knows of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyCount {
    /// The descriptor entries the rule's counter depends on, (key, value) in order.
    pub entries: Vec<(String, String)>,
    /// Its estimated count in the window (within the view's bound of the true count).
    pub count: u64,
    /// How much of `count` may come from keys whose slot it took (space-saving's error).
    pub error: u64,
    /// The remaining it was last answered with.
    pub remaining: u64,
    /// The wait it was last answered with, in nanoseconds.
    pub wait: u64,
}

/// One rule's view over the window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleView {
    /// The rule's domain.
    pub domain: String,
    /// The rule's stats key (with its entry's name in brackets for one of several limits).
    pub rule: String,
    /// `rate_limit.name`, empty when none.
    pub name: String,
    /// The rule's identity.
    pub id: u128,
    /// Hits admitted since the process started (or since the rule was first hit).
    pub admitted_total: u64,
    /// Hits refused since then.
    pub refused_total: u64,
    /// Seconds the window covers now (30 to 60).
    pub window_seconds: u64,
    /// Hits in the window.
    pub window_hits: u64,
    /// Refusals in the window.
    pub window_refused: u64,
    /// Slots per sketch.
    pub capacity: usize,
    /// The keys with the most refusals, heaviest first, at most `top`.
    pub top_refused: Vec<KeyCount>,
    /// The keys with the most hits, heaviest first, at most `top`.
    pub top_hits: Vec<KeyCount>,
    /// Keys of the hits sketch with the least remaining last answered, least first, at most
    /// `top`: the candidates nearest their limit, whose current state the reader looks up.
    pub nearest: Vec<KeyCount>,
}

impl RuleView {
    /// The bound on every hits count's error: hits in the window / capacity.
    #[must_use]
    pub fn hits_error_bound(&self) -> u64 {
        self.window_hits / self.capacity.max(1) as u64
    }

    /// The bound on every refusal count's error: refusals in the window / capacity.
    #[must_use]
    pub fn refused_error_bound(&self) -> u64 {
        self.window_refused / self.capacity.max(1) as u64
    }
}

/// One decided descriptor of a limited rule, as the sketches record it.
#[derive(Clone, Copy, Debug)]
pub struct Seen<'a, I> {
    /// The request's domain.
    pub domain: &'a str,
    /// The rule that counted it.
    pub rule: &'a Rule,
    /// The entries its counter depends on.
    pub entries: I,
    /// Its cost.
    pub hits: u64,
    /// Whether it was over the limit.
    pub denied: bool,
    /// Remaining after it.
    pub remaining: u64,
    /// Its wait, nanoseconds.
    pub wait: u64,
}

/// The heavy hitters of every limited rule.
#[derive(Debug)]
pub struct Hitters {
    top: usize,
    capacity: usize,
    base: Instant,
    rules: DashMap<u128, Arc<RuleHitters>, KeyHash>,
}

#[derive(Debug)]
struct RuleHitters {
    domain: String,
    rule: String,
    name: String,
    state: Mutex<RuleState>,
}

#[derive(Debug)]
struct RuleState {
    admitted: u64,
    refused: u64,
    halves: [Half; 2],
}

#[derive(Debug)]
struct Half {
    /// The half (seconds since the base / [`HALF_SECONDS`]) it counts.
    number: u64,
    hits: Sketch,
    refused: Sketch,
}

/// A space-saving sketch of fixed capacity.
#[derive(Debug)]
struct Sketch {
    slots: Vec<Slot>,
    /// Key hash → slot; the hash is already uniform, so the map folds it and no more.
    index: HashMap<u64, u32, KeyHash>,
    capacity: usize,
    /// Slots `[..used]` hold keys of this half; the rest are emptied ones kept for reuse.
    used: usize,
    /// The used slots' indices as a binary min-heap by count: the slot a new key takes is the
    /// root, found without a scan; a count only grows, so a hit moves its slot down.
    heap: Vec<u32>,
    /// Each cell is at least the count of any untracked key whose hash falls in it; allocated
    /// when the slots first fill.
    filter: Vec<u64>,
    total: u64,
}

#[derive(Debug)]
struct Slot {
    hash: u64,
    /// Its place in the heap.
    place: u32,
    count: u64,
    error: u64,
    remaining: u64,
    wait: u64,
    /// The entries' keys and values, back to back; `ends` gives where each ends.
    text: String,
    ends: SmallVec<[u32; 8]>,
}

impl Hitters {
    /// Tracks the top `top` keys of each rule (0: tracks nothing).
    #[must_use]
    pub fn new(top: usize) -> Self {
        Self {
            top,
            capacity: top.saturating_mul(CAPACITY_PER_TOP),
            base: Instant::now(),
            rules: DashMap::default(),
        }
    }

    /// Keys shown per rule.
    #[must_use]
    pub const fn top(&self) -> usize {
        self.top
    }

    /// Records one decided descriptor at `at`.
    pub fn record<'a, I>(&self, seen: &Seen<'a, I>, at: Instant)
    where
        I: Iterator<Item = (&'a str, &'a str)> + Clone,
    {
        let half = at.saturating_duration_since(self.base).as_secs() / HALF_SECONDS;
        self.record_in(seen, half);
    }

    fn record_in<'a, I>(&self, seen: &Seen<'a, I>, half: u64)
    where
        I: Iterator<Item = (&'a str, &'a str)> + Clone,
    {
        if self.capacity == 0 {
            return;
        }
        let hash = key_hash(seen.entries.clone());
        // The map's guard is held while the rule records: no await, and a shard's read lock.
        if let Some(rule) = self.rules.get(&seen.rule.id) {
            return rule.record(hash, seen, half);
        }
        self.rules
            .entry(seen.rule.id)
            .or_insert_with(|| Arc::new(RuleHitters::new(seen, self.capacity)))
            .record(hash, seen, half);
    }

    /// Forgets the rules `set` no longer has.
    pub fn keep_rules_of(&self, set: &PolicySet) {
        if self.rules.is_empty() {
            return;
        }
        let kept: std::collections::HashSet<u128> = set
            .domains()
            .into_iter()
            .flat_map(|d| d.rules().map(|r| r.id))
            .collect();
        self.rules.retain(|id, _| kept.contains(id));
    }

    /// Every rule's view now, sorted by domain and rule.
    #[must_use]
    pub fn views(&self) -> Vec<RuleView> {
        let half = self.base.elapsed().as_secs() / HALF_SECONDS;
        let into_half = self.base.elapsed().as_secs() % HALF_SECONDS;
        self.views_at(half, into_half)
    }

    fn views_at(&self, half: u64, into_half: u64) -> Vec<RuleView> {
        let rules: Vec<(u128, Arc<RuleHitters>)> = self
            .rules
            .iter()
            .map(|e| (*e.key(), Arc::clone(e.value())))
            .collect();
        let mut out: Vec<RuleView> = rules
            .into_iter()
            .map(|(id, r)| r.view(id, half, into_half, self.top, self.capacity))
            .collect();
        out.sort_by(|a, b| (&a.domain, &a.rule).cmp(&(&b.domain, &b.rule)));
        out
    }

    /// Slots held over every rule, both halves, both sketches: at most
    /// `rules × 4 × capacity`.
    #[must_use]
    pub fn slots(&self) -> usize {
        self.rules
            .iter()
            .map(|r| {
                let s = r.state.lock().unwrap_or_else(PoisonError::into_inner);
                s.halves
                    .iter()
                    .map(|h| h.hits.slots.len() + h.refused.slots.len())
                    .sum::<usize>()
            })
            .sum()
    }
}

/// The hash a key's entries are tracked by.
fn key_hash<'a>(entries: impl Iterator<Item = (&'a str, &'a str)>) -> u64 {
    let mut hasher = FixedState::with_seed(0).build_hasher();
    for (k, v) in entries {
        hasher.write(k.as_bytes());
        hasher.write_u8(0xff);
        hasher.write(v.as_bytes());
        hasher.write_u8(0xfe);
    }
    hasher.finish()
}

impl RuleHitters {
    fn record<'a, I>(&self, hash: u64, seen: &Seen<'a, I>, half: u64)
    where
        I: Iterator<Item = (&'a str, &'a str)> + Clone,
    {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.denied {
            state.refused = state.refused.saturating_add(seen.hits);
        } else {
            state.admitted = state.admitted.saturating_add(seen.hits);
        }
        let h = &mut state.halves[(half % 2) as usize];
        if h.number != half {
            h.number = half;
            h.hits.clear();
            h.refused.clear();
        }
        h.hits.add(hash, seen);
        if seen.denied {
            h.refused.add(hash, seen);
        }
    }

    fn new<I>(seen: &Seen<'_, I>, capacity: usize) -> Self {
        let half = || Half {
            number: u64::MAX,
            hits: Sketch::new(capacity),
            refused: Sketch::new(capacity),
        };
        Self {
            domain: seen.domain.to_owned(),
            rule: seen.rule.qualified_key(),
            name: seen.rule.name.clone().unwrap_or_default(),
            state: Mutex::new(RuleState {
                admitted: 0,
                refused: 0,
                halves: [half(), half()],
            }),
        }
    }

    fn view(&self, id: u128, half: u64, into_half: u64, top: usize, capacity: usize) -> RuleView {
        let s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let live: Vec<&Half> = s
            .halves
            .iter()
            .filter(|h| h.number != u64::MAX && (h.number == half || h.number + 1 == half))
            .collect();
        let has_previous = live.iter().any(|h| h.number != half);
        let merged = |pick: fn(&Half) -> &Sketch| {
            let mut keys: HashMap<u64, KeyCount> = HashMap::new();
            // The older half first, so that the newer one's last answer wins.
            let mut halves = live.clone();
            halves.sort_by_key(|h| h.number);
            for h in halves {
                for slot in pick(h).live() {
                    let k = keys.entry(slot.hash).or_insert_with(|| KeyCount {
                        entries: slot.entries(),
                        count: 0,
                        error: 0,
                        remaining: slot.remaining,
                        wait: slot.wait,
                    });
                    k.count = k.count.saturating_add(slot.count);
                    k.error = k.error.saturating_add(slot.error);
                    k.remaining = slot.remaining;
                    k.wait = slot.wait;
                }
            }
            let total = live
                .iter()
                .fold(0u64, |sum, h| sum.saturating_add(pick(h).total));
            (keys.into_values().collect::<Vec<_>>(), total)
        };
        // Ranked by the count each key surely has (count less error), then by count: a key
        // that just took a slot inherits a large count and as large an error, and must not
        // outrank one counted from the start (a rotating attacker's keys would).
        let heaviest = |mut v: Vec<KeyCount>| {
            v.sort_by(|a, b| {
                b.count
                    .saturating_sub(b.error)
                    .cmp(&a.count.saturating_sub(a.error))
                    .then(b.count.cmp(&a.count))
                    .then(a.entries.cmp(&b.entries))
            });
            v.truncate(top);
            v
        };
        let (hits, window_hits) = merged(|h| &h.hits);
        let (refused, window_refused) = merged(|h| &h.refused);
        let mut nearest = hits.clone();
        nearest.sort_by(|a, b| {
            a.remaining
                .cmp(&b.remaining)
                .then(b.count.cmp(&a.count))
                .then(a.entries.cmp(&b.entries))
        });
        nearest.truncate(top);
        RuleView {
            domain: self.domain.clone(),
            rule: self.rule.clone(),
            name: self.name.clone(),
            id,
            admitted_total: s.admitted,
            refused_total: s.refused,
            window_seconds: into_half + if has_previous { HALF_SECONDS } else { 0 },
            window_hits,
            window_refused,
            capacity,
            top_refused: heaviest(refused),
            top_hits: heaviest(hits),
            nearest,
        }
    }
}

impl Sketch {
    fn new(capacity: usize) -> Self {
        let mut index = HashMap::with_hasher(KeyHash::default());
        index.reserve(capacity);
        Self {
            slots: Vec::with_capacity(capacity),
            index,
            capacity,
            used: 0,
            heap: Vec::with_capacity(capacity),
            filter: Vec::new(),
            total: 0,
        }
    }

    /// The slots holding keys.
    fn live(&self) -> &[Slot] {
        &self.slots[..self.used]
    }

    fn clear(&mut self) {
        // Keeps the slots' strings and the index's table: the next half reuses them.
        self.index.clear();
        self.heap.clear();
        self.filter.fill(0);
        self.total = 0;
        self.used = 0;
    }

    fn add<'a, I>(&mut self, hash: u64, seen: &Seen<'a, I>)
    where
        I: Iterator<Item = (&'a str, &'a str)> + Clone,
    {
        // Saturating: a request's hits are the caller's number, up to `u64::MAX`.
        self.total = self.total.saturating_add(seen.hits);
        let mut fresh = false;
        let at = if let Some(&at) = self.index.get(&hash) {
            at as usize
        } else {
            let at = if self.used < self.capacity {
                if self.used == self.slots.len() {
                    self.slots.push(Slot::empty());
                }
                // A fresh slot, or one of an earlier half emptied: no count to inherit.
                let slot = &mut self.slots[self.used];
                slot.count = 0;
                fresh = true;
                self.used += 1;
                self.used - 1
            } else {
                // Filtered space-saving: counted in its cell until the cell and its hits pass
                // the smallest count (the heap's root); then it takes that slot from its cell's
                // count, and the key it evicts leaves its count in its own cell.
                if self.filter.is_empty() {
                    self.filter = vec![0; self.capacity * FILTER_CELLS_PER_SLOT];
                }
                let min = self.heap.first().map_or(0, |&i| i as usize);
                let cell = self.cell(hash);
                let from = self.filter[cell];
                let counted = from.saturating_add(seen.hits);
                if counted <= self.slots[min].count {
                    self.filter[cell] = counted;
                    return;
                }
                let evicted = &self.slots[min];
                let (gone, left) = (evicted.hash, evicted.count);
                let its = self.cell(gone);
                self.filter[its] = self.filter[its].max(left);
                self.index.remove(&gone);
                self.slots[min].count = from;
                min
            };
            let slot = &mut self.slots[at];
            slot.error = slot.count;
            slot.hash = hash;
            slot.set_entries(seen.entries.clone());
            // The index never holds more than `capacity` keys: reserved, it never grows.
            self.index.insert(hash, at as u32);
            at
        };
        let slot = &mut self.slots[at];
        slot.count = slot.count.saturating_add(seen.hits);
        slot.remaining = seen.remaining;
        slot.wait = seen.wait;
        let place = slot.place as usize;
        if fresh {
            slot.place = self.heap.len() as u32;
            self.heap.push(at as u32);
            self.sift_up(self.heap.len() - 1);
        } else {
            self.sift_down(place);
        }
    }

    /// The filter cell of a key's hash (the hash's high bits, scaled to the cells).
    fn cell(&self, hash: u64) -> usize {
        ((u128::from(hash) * self.filter.len() as u128) >> 64) as usize
    }

    fn count_at(&self, place: usize) -> u64 {
        self.slots[self.heap[place] as usize].count
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        self.slots[self.heap[a] as usize].place = a as u32;
        self.slots[self.heap[b] as usize].place = b as u32;
    }

    /// Moves the slot at heap place `i` up while it counts less than its parent.
    fn sift_up(&mut self, mut i: usize) {
        while i > 0 {
            let parent = (i - 1) / 2;
            if self.count_at(i) >= self.count_at(parent) {
                break;
            }
            self.swap(i, parent);
            i = parent;
        }
    }

    /// Moves the slot at heap place `i` down while a child counts less.
    fn sift_down(&mut self, mut i: usize) {
        let n = self.heap.len();
        loop {
            let (l, r) = (2 * i + 1, 2 * i + 2);
            let mut least = i;
            if l < n && self.count_at(l) < self.count_at(least) {
                least = l;
            }
            if r < n && self.count_at(r) < self.count_at(least) {
                least = r;
            }
            if least == i {
                return;
            }
            self.swap(i, least);
            i = least;
        }
    }
}

impl Slot {
    fn empty() -> Self {
        Self {
            hash: 0,
            place: 0,
            count: 0,
            error: 0,
            remaining: 0,
            wait: 0,
            text: String::new(),
            ends: SmallVec::new(),
        }
    }

    fn set_entries<'a>(&mut self, entries: impl Iterator<Item = (&'a str, &'a str)>) {
        self.text.clear();
        self.ends.clear();
        for (k, v) in entries {
            self.text.push_str(k);
            self.ends.push(self.text.len() as u32);
            self.text.push_str(v);
            self.ends.push(self.text.len() as u32);
        }
    }

    fn entries(&self) -> Vec<(String, String)> {
        let mut out = Vec::with_capacity(self.ends.len() / 2);
        let mut start = 0;
        for pair in self.ends.chunks(2) {
            let [k_end, v_end] = [pair[0] as usize, pair.get(1).map_or(0, |&e| e as usize)];
            let key = self.text.get(start..k_end).unwrap_or_default();
            let value = self.text.get(k_end..v_end).unwrap_or_default();
            out.push((key.to_owned(), value.to_owned()));
            start = v_end;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::load_str;

    const POLICY: &str = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {name: per_user, unit: second, requests_per_unit: 5}\n";

    fn set() -> PolicySet {
        load_str(&[("p.yaml", POLICY)]).unwrap()
    }

    /// Records `n` hits of `user=value` in `half`.
    fn hit(h: &Hitters, set: &PolicySet, value: &str, denied: bool, n: u64, half: u64) {
        let rule = set.domain("d").unwrap().rules().next().unwrap();
        let entries = [("user", value)];
        let seen = Seen {
            domain: "d",
            rule,
            entries: entries.iter().copied(),
            hits: n,
            denied,
            remaining: u64::from(!denied),
            wait: if denied { 7 } else { 0 },
        };
        h.record_in(&seen, half);
    }

    fn names(keys: &[KeyCount]) -> Vec<(String, u64)> {
        keys.iter()
            .map(|k| (k.entries[0].1.clone(), k.count))
            .collect()
    }

    #[test]
    fn hits_past_u64_max_saturate_every_count() {
        // A request's `hits_addend` is the caller's number: counts reach the top and stay there.
        let (h, set) = (Hitters::new(1), set());
        for (value, denied) in [("a", false), ("a", true), ("b", true), ("b", true)] {
            hit(&h, &set, value, denied, u64::MAX / 2 + 1, 0);
            hit(&h, &set, value, denied, u64::MAX / 2 + 1, 1);
        }
        let views = h.views_at(1, 10);
        let v = &views[0];
        assert_eq!((v.admitted_total, v.refused_total), (u64::MAX, u64::MAX));
        assert_eq!((v.window_hits, v.window_refused), (u64::MAX, u64::MAX));
        assert!(v.top_hits.iter().all(|k| k.count == u64::MAX));
    }

    #[test]
    fn counts_hits_and_refusals_per_key_exactly_below_capacity() {
        let (h, set) = (Hitters::new(2), set());
        hit(&h, &set, "a", false, 5, 0);
        hit(&h, &set, "a", true, 3, 0);
        hit(&h, &set, "b", false, 1, 0);
        hit(&h, &set, "c", true, 4, 0);
        let views = h.views_at(0, 10);
        let v = &views[0];
        assert_eq!((v.domain.as_str(), v.rule.as_str()), ("d", "d.user"));
        assert_eq!(v.name, "per_user");
        assert_eq!((v.admitted_total, v.refused_total), (6, 7));
        assert_eq!(
            (v.window_hits, v.window_refused, v.window_seconds),
            (13, 7, 10)
        );
        assert_eq!(names(&v.top_hits), [("a".into(), 8), ("c".into(), 4)]);
        assert_eq!(names(&v.top_refused), [("c".into(), 4), ("a".into(), 3)]);
        assert_eq!(v.top_refused[0].entries, [("user".into(), "c".into())]);
        assert_eq!(v.top_refused[0].wait, 7);
        // The last answers: c and a were refused last (0 left), b admitted.
        assert_eq!(v.nearest.len(), 2);
        assert!(
            v.nearest.iter().all(|k| k.remaining == 0),
            "{:?}",
            v.nearest
        );
        assert_eq!(v.hits_error_bound(), 0, "13 hits over 20 slots");
    }

    #[test]
    fn a_million_distinct_keys_stay_in_the_cap_and_the_heavy_key_is_found() {
        let (h, set) = (Hitters::new(10), set());
        let cap = 10 * CAPACITY_PER_TOP;
        for i in 0..1_000_000u32 {
            hit(&h, &set, &i.to_string(), true, 1, 0);
            if i % 10 == 0 {
                hit(&h, &set, "heavy", true, 1, 0);
            }
        }
        {
            // The heap's root is the smallest count, as space-saving needs.
            let rule = h.rules.iter().next().unwrap();
            let state = rule.state.lock().unwrap();
            let sketch = &state.halves[0].hits;
            let min = sketch.live().iter().map(|s| s.count).min().unwrap();
            assert_eq!(sketch.count_at(0), min);
            assert_eq!(sketch.heap.len(), cap);
        }
        // Two sketches in one half: each at its cap, the other half untouched.
        assert_eq!(h.slots(), 2 * cap);
        // The bytes held stay those of `2 × cap` keys: a slot's string is reused, and grows
        // only to the longest key it held ("user" and at most seven digits, here 11 bytes).
        let held: usize = {
            let rule = h.rules.iter().next().unwrap();
            let state = rule.state.lock().unwrap();
            let half = &state.halves[0];
            (half.hits.slots.iter())
                .chain(half.refused.slots.iter())
                .map(|s| s.text.capacity() + s.ends.capacity() * 4)
                .sum()
        };
        assert!(held <= 2 * cap * (32 + 8 * 4), "{held} bytes in the slots");
        let state = h.rules.iter().next().unwrap().state.lock().unwrap().halves[0]
            .refused
            .index
            .capacity();
        assert!(state < 4 * cap, "index reserved once: {state}");
        let v = &h.views_at(0, 0)[0];
        let bound = v.refused_error_bound();
        assert_eq!(bound, 1_100_000 / cap as u64);
        let top = &v.top_refused[0];
        assert_eq!(top.entries[0].1, "heavy");
        assert!(
            top.count >= 100_000 && top.count - 100_000 <= bound,
            "{top:?}"
        );
    }

    #[test]
    fn every_count_bounds_the_true_count_within_n_over_capacity() {
        use proptest::prelude::*;
        let set = set();
        let config = ProptestConfig {
            cases: 300,
            ..ProptestConfig::default()
        };
        // Skewed keys (the low ones far more often), costs of 1 to 4, ten slots.
        let hits = proptest::collection::vec((0u32..60, 0u32..60, 1u64..5), 1..600);
        proptest!(config, |(hits in hits)| {
            let h = Hitters::new(1);
            let mut truth: HashMap<String, u64> = HashMap::new();
            for &(a, b, n) in &hits {
                let key = (a.min(b)).to_string();
                hit(&h, &set, &key, false, n, 0);
                *truth.entry(key).or_default() += n;
            }
            let rule = h.rules.iter().next().unwrap();
            let state = rule.state.lock().unwrap();
            let sketch = &state.halves[0].hits;
            let n: u64 = truth.values().sum();
            prop_assert_eq!(sketch.total, n);
            let bound = n / sketch.capacity as u64;
            let min = sketch.live().iter().map(|s| s.count).min().unwrap_or(0);
            let mut tracked = std::collections::HashSet::new();
            for slot in sketch.live() {
                let key = slot.entries()[0].1.clone();
                let t = truth[&key];
                prop_assert!(slot.count >= t, "{key}: {} < true {t}", slot.count);
                prop_assert!(slot.count - slot.error <= t, "{key}: surely more than true {t}");
                prop_assert!(slot.count - t <= bound, "{key}: {} past true {t} + {bound}", slot.count);
                tracked.insert(key);
            }
            prop_assert!(sketch.live().iter().map(|s| s.count).sum::<u64>() <= n);
            // A key not tracked has no more than the smallest count, and its cell knows it.
            for (key, &t) in truth.iter().filter(|(k, _)| !tracked.contains(*k)) {
                prop_assert!(t <= min, "{key}: untracked with {t} > smallest {min}");
                let hash = key_hash([("user", key.as_str())].into_iter());
                prop_assert!(sketch.filter[sketch.cell(hash)] >= t);
            }
        });
    }

    #[test]
    fn a_key_that_took_a_slot_does_not_outrank_keys_counted_from_the_start() {
        let (h, set) = (Hitters::new(1), set());
        // Ten slots, each held by a key of 4 hits counted from its first.
        for i in 0..10 {
            hit(&h, &set, &format!("k{i}"), false, 4, 0);
        }
        // New keys of one hit each fill the filter's cells until one passes 4 and takes a slot:
        // at least 5 by count, but only 1 surely (its cell's count is its error).
        let mut admitted = None;
        for i in 0..10_000 {
            hit(&h, &set, &format!("r{i}"), false, 1, 0);
            let v = &h.views_at(0, 0)[0];
            if let Some(k) = v.top_hits.iter().chain(&v.nearest).find(|k| k.error > 0) {
                admitted = Some(k.clone());
                break;
            }
            assert_eq!(v.top_hits[0].error, 0);
        }
        let admitted = admitted.expect("a rotated key takes a slot");
        assert!(
            admitted.count >= 5 && admitted.count - admitted.error == 1,
            "{admitted:?}"
        );
        let v = &h.views_at(0, 0)[0];
        let top = &v.top_hits[0];
        assert!(top.entries[0].1.starts_with('k'), "{top:?}");
        assert_eq!((top.count, top.error), (4, 0));
    }

    #[test]
    fn the_window_is_this_half_and_the_one_before() {
        let (h, set) = (Hitters::new(3), set());
        hit(&h, &set, "old", true, 9, 4);
        hit(&h, &set, "new", true, 1, 5);
        let v = &h.views_at(5, 12)[0];
        assert_eq!(
            names(&v.top_refused),
            [("old".into(), 9), ("new".into(), 1)]
        );
        assert_eq!(v.window_seconds, HALF_SECONDS + 12);
        // A half later, "old" has left the window; the totals since start stay.
        let v = &h.views_at(6, 0)[0];
        assert_eq!(names(&v.top_refused), [("new".into(), 1)]);
        assert_eq!(v.refused_total, 10);
        hit(&h, &set, "newer", true, 2, 6);
        let v = &h.views_at(6, 0)[0];
        assert_eq!(
            names(&v.top_refused),
            [("newer".into(), 2), ("new".into(), 1)]
        );
        assert!(h.views_at(8, 0)[0].top_refused.is_empty());
    }

    #[test]
    fn zero_tracks_nothing_and_a_reload_forgets_removed_rules() {
        let set = set();
        let off = Hitters::new(0);
        hit(&off, &set, "a", true, 1, 0);
        assert!(off.views().is_empty());
        let h = Hitters::new(1);
        hit(&h, &set, "a", true, 1, 0);
        assert_eq!(h.views().len(), 1);
        h.keep_rules_of(&load_str(&[("p.yaml", "domain: other\ndescriptors: []\n")]).unwrap());
        assert!(h.views().is_empty());
    }
}
