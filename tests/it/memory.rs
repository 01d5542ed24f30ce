//! Bounded memory: a million distinct keys pushed through a store capped at ten thousand, from
//! two threads, never hold more than the cap; every eviction of a live key is counted; the keys
//! that survive still decide correctly.

use std::sync::atomic::{AtomicBool, Ordering};

use sluice::limiter::gcra::NANOS_PER_SEC;
use sluice::limiter::{KeyBuilder, MemoryStore, Quota};

const CAP: usize = 10_000;
const KEYS: u64 = 1_000_000;

#[test]
fn a_million_keys_through_a_store_of_ten_thousand() {
    let store = MemoryStore::with_max_keys(CAP);
    // One per hour, at one instant: every first request is admitted and leaves a live key.
    let quota = Quota::new(3_600 * NANOS_PER_SEC, 1, 1).unwrap();
    let now = 1_000;
    let key = |i: u64| KeyBuilder::new(7).part(&i.to_le_bytes()).finish();
    let done = AtomicBool::new(false);
    let max_seen = std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let mut max = 0;
            while !done.load(Ordering::Relaxed) {
                max = max.max(store.len());
                std::thread::yield_now();
            }
            max
        });
        let workers: Vec<_> = (0..2u64)
            .map(|t| {
                let store = &store;
                s.spawn(move || {
                    for i in (t..KEYS).step_by(2) {
                        assert!(
                            store.count(key(i), &quota, now, 1).admitted,
                            "fresh key {i} denied"
                        );
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        done.store(true, Ordering::Relaxed);
        watcher.join().unwrap()
    });
    assert!(max_seen <= CAP, "saw {max_seen} keys");
    assert_eq!(store.len(), CAP);
    assert_eq!(
        store.evictions(),
        KEYS - CAP as u64,
        "every eviction was of a live key"
    );
    // Survivors still carry their state: a second request within the hour is denied.
    let survivors: Vec<u64> = (0..KEYS).filter(|i| store.tat(key(*i)) > 0).collect();
    assert_eq!(survivors.len(), CAP);
    for i in survivors.iter().take(1_000) {
        let o = store.count(key(*i), &quota, now, 1);
        assert!(
            !o.admitted && o.remaining == 0,
            "survivor {i} forgot its debt"
        );
    }
}
