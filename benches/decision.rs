//! Criterion benchmarks of a whole decision without transport, through the same
//! `Decider::decide` the servers call: validate, match a request against a realistic policy set,
//! count in the memory backend, build the statuses, record the metrics.
//! Run with `cargo bench --bench decision`; numbers go in BENCHMARKS.md.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use futures_util::FutureExt;
use sluice::decision::{Decider, Options, Request};
use sluice::limiter::{Backend, ManualClock, MemoryStore};
use sluice::metrics::Metrics;
use sluice::policy::{self, PolicyHandle};

fn request(descriptors: &[&[(&str, &str)]]) -> Request {
    Request {
        hits_addend: 1,
        ..Request::from_entries("edge", descriptors)
    }
}

fn decisions(c: &mut Criterion) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/config/policies");
    let set = policy::load_dir(std::path::Path::new(dir)).expect("example policies load");
    let clock = Arc::new(ManualClock::new(1));
    let decider = Decider::new(
        PolicyHandle::new(set),
        Backend::memory(MemoryStore::new(), clock.clone()),
        Arc::new(Metrics::install(1_000)),
        Options::default(),
    );
    // The memory backend never waits, so a decision completes on its first poll.
    let decide = |req: &Request| {
        decider
            .decide(black_box(req))
            .now_or_never()
            .expect("the memory path never waits")
            .expect("valid request")
    };

    let mut group = c.benchmark_group("decision");
    // The api_key rule allows 600 per minute (T = 0.1 s): advance time by T per call so each
    // decision is an admission that writes.
    let two_entries = request(&[&[("generic_key", "api"), ("api_key", "k-123")]]);
    group.bench_function("two-entry descriptor, admitted", |b| {
        b.iter(|| {
            clock.advance(100_000_000);
            black_box(decide(&two_entries))
        });
    });
    let edge = request(&[
        &[("remote_address", "198.51.100.7")],
        &[("generic_key", "api"), ("api_key", "k-123")],
        &[("path", "/api/v1/export")],
    ]);
    group.bench_function("three descriptors, denied", |b| {
        b.iter(|| black_box(decide(&edge)));
    });
    let unmatched = request(&[&[("nothing", "here")]]);
    group.bench_function("unmatched descriptor", |b| {
        b.iter(|| black_box(decide(&unmatched)));
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = decisions
}
criterion_main!(benches);
