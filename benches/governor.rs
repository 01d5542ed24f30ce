//! The store side by side with a peer: `governor`'s keyed GCRA limiter (DashMap state, its
//! default) against sluice's `MemoryStore`, on the same workloads: one hot key and 100,000 keys
//! visited in the same order, on one thread and on two. Both run at 10^9 per second with a
//! burst of 1,000, so every call is admitted and writes its key, and both are given the same
//! precomputed 128-bit keys and the same key hasher, so neither pays for hashing a string.
//!
//! Two clock setups: each library's production clock (`MonotonicClock` for sluice,
//! `quanta` for governor), which is what a user gets, and a shared-nothing manual clock
//! advanced by 1 ns per call, which leaves only the store.
//!
//! Run with `cargo bench --bench governor`; numbers go in BENCHMARKS.md.

use std::hash::BuildHasherDefault;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use governor::clock::{DefaultClock, FakeRelativeClock};
use governor::state::keyed::DashMapStateStore;
use governor::{Quota as GovQuota, RateLimiter};
use sluice::limiter::gcra::NANOS_PER_SEC;
use sluice::limiter::key::KeyHasher;
use sluice::limiter::{Clock, KeyBuilder, ManualClock, MemoryStore, MonotonicClock, Quota};

type Hasher = BuildHasherDefault<KeyHasher>;
type Governor<C> = RateLimiter<
    u128,
    DashMapStateStore<u128, Hasher>,
    C,
    governor::middleware::NoOpMiddleware<<C as governor::clock::Clock>::Instant>,
>;

const KEYS: usize = 100_000;
/// Visits every key once per round, in an order that defeats the prefetcher.
const STRIDE: usize = 7919;

fn sluice_quota() -> Quota {
    Quota::new(NANOS_PER_SEC, NANOS_PER_SEC, 1_000).expect("a valid quota")
}

fn governor_quota() -> GovQuota {
    GovQuota::per_second(NonZeroU32::new(1_000_000_000).expect("non-zero"))
        .allow_burst(NonZeroU32::new(1_000).expect("non-zero"))
}

fn keys() -> Vec<u128> {
    (0..KEYS as u64)
        .map(|i| KeyBuilder::new(2).part(&i.to_le_bytes()).finish())
        .collect()
}

/// The key of call `i` of a thread: one hot key, or the 100k keys in stride order.
fn pick(keys: &[u128], hot: bool, i: u64) -> u128 {
    if hot {
        keys[0]
    } else {
        keys[(i as usize).wrapping_mul(STRIDE) % keys.len()]
    }
}

/// Time per decision with `threads` threads each making `iters` calls of `decide(i)`.
fn per_decision(iters: u64, threads: u64, decide: &(dyn Fn(u64) -> bool + Sync)) -> Duration {
    let start = Instant::now();
    if threads == 1 {
        let mut admitted = 0u64;
        for i in 0..iters {
            admitted += u64::from(decide(i));
        }
        black_box(admitted);
        return start.elapsed();
    }
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut admitted = 0u64;
                for i in 0..iters {
                    admitted += u64::from(decide(i * threads + t));
                }
                black_box(admitted)
            });
        }
    });
    // Criterion divides by `iters`; each thread made `iters` of the `threads × iters` calls.
    start.elapsed() / u32::try_from(threads).expect("few threads")
}

fn side_by_side(c: &mut Criterion) {
    let keys = keys();
    let q = sluice_quota();
    for (workload, hot) in [("hot key", true), ("100k keys", false)] {
        for threads in [1u64, 2] {
            let mut group = c.benchmark_group(format!("{workload}, {threads} thread(s)"));

            // Each library's production clock.
            let store = MemoryStore::new();
            let clock = MonotonicClock::new();
            group.bench_function("sluice, its clock", |b| {
                b.iter_custom(|iters| {
                    per_decision(iters, threads, &|i| {
                        store
                            .count(pick(&keys, hot, i), &q, clock.now(), 1)
                            .admitted
                    })
                });
            });
            let gov: Governor<DefaultClock> = RateLimiter::dashmap_with_clock_and_hasher(
                governor_quota(),
                DefaultClock::default(),
                Hasher::default(),
            );
            group.bench_function("governor, its clock", |b| {
                b.iter_custom(|iters| {
                    per_decision(iters, threads, &|i| {
                        gov.check_key(&pick(&keys, hot, i)).is_ok()
                    })
                });
            });

            // A manual clock advanced by 1 ns per call: the stores alone.
            let store = MemoryStore::new();
            let clock = ManualClock::new(1);
            group.bench_function("sluice, manual clock", |b| {
                b.iter_custom(|iters| {
                    per_decision(iters, threads, &|i| {
                        clock.advance(1);
                        store
                            .count(pick(&keys, hot, i), &q, clock.now(), 1)
                            .admitted
                    })
                });
            });
            let fake = FakeRelativeClock::default();
            let gov: Governor<FakeRelativeClock> = RateLimiter::dashmap_with_clock_and_hasher(
                governor_quota(),
                fake.clone(),
                Hasher::default(),
            );
            group.bench_function("governor, manual clock", |b| {
                b.iter_custom(|iters| {
                    per_decision(iters, threads, &|i| {
                        fake.advance(Duration::from_nanos(1));
                        gov.check_key(&pick(&keys, hot, i)).is_ok()
                    })
                });
            });
            // Both stores saw the same keys (or none, when a filter skipped the benchmark).
            let expected = if hot { 1 } else { KEYS };
            for held in [store.len(), gov.len()] {
                assert!(held == 0 || held == expected, "{held} keys, not {expected}");
            }
            group.finish();
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = side_by_side
}
criterion_main!(benches);
