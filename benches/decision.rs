//! Criterion benchmarks of a whole decision without transport: validate, match a request
//! against a realistic policy set, count in the store, and build the statuses.
//! Run with `cargo bench --bench decision`; numbers go in BENCHMARKS.md.

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use sluice::decision::{Decider, Request};
use sluice::limiter::MemoryStore;
use sluice::policy;

fn request(descriptors: &[&[(&str, &str)]]) -> Request {
    Request {
        hits_addend: 1,
        ..Request::from_entries("edge", descriptors)
    }
}

fn decisions(c: &mut Criterion) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/config/policies");
    let set = policy::load_dir(std::path::Path::new(dir)).expect("example policies load");
    let decider = Decider::default();
    let store = MemoryStore::new();

    let mut group = c.benchmark_group("decision");
    // The api_key rule allows 600 per minute (T = 0.1 s): advance time by T per call so each
    // decision is an admission that writes.
    let two_entries = request(&[&[("generic_key", "api"), ("api_key", "k-123")]]);
    group.bench_function("two-entry descriptor, admitted", |b| {
        let mut now = 1u64;
        b.iter(|| {
            now += 100_000_000;
            let plan = decider.plan(black_box(&two_entries), &set).unwrap();
            let batch = store.check_batch(plan.ops(), now);
            black_box(decider.finish(&plan, &batch))
        });
    });
    let edge = request(&[
        &[("remote_address", "198.51.100.7")],
        &[("generic_key", "api"), ("api_key", "k-123")],
        &[("path", "/api/v1/export")],
    ]);
    group.bench_function("three descriptors, denied", |b| {
        b.iter(|| {
            let plan = decider.plan(black_box(&edge), &set).unwrap();
            let batch = store.check_batch(plan.ops(), 5);
            black_box(decider.finish(&plan, &batch))
        });
    });
    let unmatched = request(&[&[("nothing", "here")]]);
    group.bench_function("unmatched descriptor", |b| {
        b.iter(|| {
            black_box(
                decider
                    .plan(black_box(&unmatched), &set)
                    .unwrap()
                    .ops()
                    .len(),
            )
        });
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = decisions
}
criterion_main!(benches);
