//! Criterion benchmarks of the counting core: the pure GCRA decision, the store on one hot key
//! (admitted and denied), the store over many keys, and one key shared by two threads.
//! Run with `cargo bench --bench limiter`; numbers go in BENCHMARKS.md.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use sluice::limiter::gcra::{self, NANOS_PER_SEC};
use sluice::limiter::{Charge, KeyBuilder, MemoryStore, Mode, Op, Quota};

/// 1e9 per second: T = 1 ns, so advancing time by 1 ns per call keeps every call admitted.
fn fast() -> Quota {
    Quota::new(NANOS_PER_SEC, NANOS_PER_SEC, 1_000).unwrap()
}

fn op(key: u128, quota: Quota) -> Op {
    Op {
        key,
        quota,
        cost: 1,
        charge: Charge::Ask,
        mode: Mode::Enforce,
    }
}

fn core(c: &mut Criterion) {
    let q = fast();
    c.bench_function("gcra/decide", |b| {
        let mut now = 1u64;
        b.iter(|| {
            now += 1;
            black_box(gcra::decide(&q, black_box(now), now, 1))
        });
    });

    let store = MemoryStore::new();
    let key = KeyBuilder::new(1).part(b"hot").finish();
    c.bench_function("store/check hot key (admitted)", |b| {
        let mut now = 1u64;
        b.iter(|| {
            now += 1;
            black_box(store.count(black_box(key), &q, now, 1))
        });
    });
    let slow = Quota::new(3_600 * NANOS_PER_SEC, 1, 1).unwrap();
    c.bench_function("store/check hot key (denied)", |b| {
        store.count(7, &slow, 1, 1);
        b.iter(|| black_box(store.count(black_box(7), &slow, 2, 1)));
    });
    c.bench_function("store/check_batch 1 op hot key (admitted)", |b| {
        let ops = [op(key, q)];
        let mut now = 1u64;
        b.iter(|| {
            now += 1;
            black_box(store.count_batch(black_box(&ops), now))
        });
    });

    let many = MemoryStore::new();
    let keys: Vec<u128> = (0..100_000u64)
        .map(|i| KeyBuilder::new(2).part(&i.to_le_bytes()).finish())
        .collect();
    for k in &keys {
        many.count(*k, &q, 1, 1);
    }
    c.bench_function("store/check 100k keys round robin", |b| {
        let mut i = 0usize;
        let mut now = 2u64;
        b.iter(|| {
            i = (i + 7919) % keys.len();
            now += 1;
            black_box(many.count(keys[i], &q, now, 1))
        });
    });

    c.bench_function("store/check hot key, 2 threads", |b| {
        let store = Arc::new(MemoryStore::new());
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|s| {
                for t in 0..2u64 {
                    let store = &store;
                    s.spawn(move || {
                        for i in 0..iters {
                            black_box(store.count(key, &q, 2 * i + t + 1, 1));
                        }
                    });
                }
            });
            // Time per decision across both threads.
            start.elapsed() / 2
        });
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = core
}
criterion_main!(benches);
