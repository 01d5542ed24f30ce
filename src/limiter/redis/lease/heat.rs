//! The heat table: which counters are hot on this node, so that only they are leased. A fixed
//! table of slots, each counting one key's hits this second and the second before; a colder key
//! wears a slot's count down before it takes the slot over, so the slot keeps whichever key is
//! hotter. Tracking never grows with the keys: a cold key costs a slot probe and allocates
//! nothing. Rates only: what a hot counter is owed is the ledger's.

use std::sync::Mutex;

use super::lock;
use crate::limiter::gcra::NANOS_PER_SEC;
use crate::limiter::key::Key;

/// Slots of the hotness table: a power of two, fixed, so tracking never grows with the keys.
const HEAT_SLOTS: usize = 4_096;

/// One slot of the hotness table.
#[derive(Debug, Default)]
struct Heat {
    key: Key,
    /// The second (of the local clock) `count` is for.
    second: u64,
    /// Hits counted this second.
    count: u64,
    /// When `count` began: the second's start, or the instant the key took the slot.
    from: u64,
    /// Hits in the second before.
    prev: u64,
    /// When `prev` began.
    prev_from: u64,
}

impl Heat {
    /// Moves the count on to the second of `now`.
    fn roll(&mut self, now: u64) {
        let second = now / NANOS_PER_SEC;
        if self.second != second {
            self.prev = if self.second + 1 == second {
                self.count
            } else {
                0
            };
            self.prev_from = self.from;
            self.count = 0;
            self.second = second;
            self.from = second.saturating_mul(NANOS_PER_SEC);
        }
    }

    /// The hits counted for the slot's key and when their count began: this second's, with
    /// the second before's when it counted any.
    fn seen(&self) -> (u64, u64) {
        if self.prev > 0 {
            (self.prev.saturating_add(self.count), self.prev_from)
        } else {
            (self.count, self.from)
        }
    }
}

/// The hotness table of one store.
#[derive(Debug)]
pub(super) struct HeatTable {
    slots: Box<[Mutex<Heat>]>,
    /// Hits per second at which a counter is hot (`redis.lease.min_rate`): a slot whose key
    /// was that hot in the second before is not taken over.
    min_rate: u64,
}

impl HeatTable {
    /// An empty table; counters are hot from `min_rate` hits per second.
    pub(super) fn new(min_rate: u64) -> Self {
        Self {
            slots: (0..HEAT_SLOTS).map(|_| Mutex::default()).collect(),
            min_rate,
        }
    }

    /// Counts `cost` hits on `key` and returns its rate: the larger of this second's hits and
    /// the last second's. A slot belongs to one key at a time; another key's hits wear its
    /// count down and take the slot over once it reaches 0, so the slot keeps whichever key is
    /// hotter.
    pub(super) fn hit(&self, key: Key, cost: u64, now: u64) -> u64 {
        let mut h = lock(self.slot(key));
        h.roll(now);
        if h.key != key {
            if h.count > cost || h.prev >= self.min_rate {
                h.count -= cost.min(h.count);
                return 0;
            }
            *h = Heat {
                key,
                second: h.second,
                count: 0,
                from: now,
                prev: 0,
                prev_from: now,
            };
        }
        h.count += cost;
        h.count.max(h.prev)
    }

    /// The hits counted on `key` as of `now` and when their count began, if it holds its slot.
    pub(super) fn seen(&self, key: Key, now: u64) -> Option<(u64, u64)> {
        let mut h = lock(self.slot(key));
        h.roll(now);
        (h.key == key).then(|| h.seen())
    }

    fn slot(&self, key: Key) -> &Mutex<Heat> {
        // Truncation intended: the key is a hash, its low bits pick the slot.
        &self.slots[(key as usize) & (HEAT_SLOTS - 1)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = NANOS_PER_SEC;

    #[test]
    fn a_rate_is_the_larger_of_this_second_and_the_last() {
        let t = HeatTable::new(20);
        assert_eq!(t.hit(7, 5, 10 * S), 5);
        assert_eq!(t.hit(7, 3, 10 * S + 1), 8);
        assert_eq!(t.hit(7, 1, 11 * S), 8, "the second before counts");
        assert_eq!(t.hit(7, 0, 11 * S + 2), 8);
        assert_eq!(
            t.hit(7, 2, 13 * S),
            2,
            "a second with no hit between: forgotten"
        );
        assert_eq!(t.hit(7, 0, 13 * S), 2, "a refund counts no hit");
    }

    #[test]
    fn a_colder_key_wears_a_slot_down_before_it_takes_it_over() {
        let t = HeatTable::new(20);
        let (hot, cold) = (1, 1 + HEAT_SLOTS as Key);
        assert_eq!(t.hit(hot, 3, 0), 3);
        assert_eq!(
            t.hit(cold, 1, 1),
            0,
            "3 > 1: the hot key keeps the slot, worn to 2"
        );
        assert_eq!(t.seen(hot, 1), Some((2, 0)));
        assert_eq!(
            t.hit(cold, 2, 2),
            2,
            "2 hits wear 2 out: the slot changes hands"
        );
        assert_eq!(t.seen(hot, 2), None);
        assert_eq!(
            t.seen(cold, 2),
            Some((2, 2)),
            "counted from when it took the slot"
        );
    }

    #[test]
    fn a_key_hot_the_second_before_keeps_its_slot() {
        let t = HeatTable::new(20);
        let (hot, cold) = (5, 5 + 2 * HEAT_SLOTS as Key);
        assert_eq!(t.hit(hot, 25, S / 2), 25);
        assert_eq!(
            t.hit(cold, 100, S + 1),
            0,
            "25 hits last second: at min_rate"
        );
        assert_eq!(t.seen(hot, S + 1), Some((25, S / 2)));
    }

    #[test]
    fn seen_counts_this_second_and_the_last_from_when_they_began() {
        let t = HeatTable::new(20);
        assert_eq!(t.seen(9, 0), None, "a slot of another key (0)");
        t.hit(9, 4, S + S / 4);
        assert_eq!(t.seen(9, S + S / 2), Some((4, S + S / 4)));
        t.hit(9, 6, 2 * S + 10);
        assert_eq!(t.seen(9, 2 * S + 20), Some((10, S + S / 4)));
        assert_eq!(
            t.seen(9, 4 * S),
            Some((0, 4 * S)),
            "an idle key: nothing from now"
        );
    }
}
