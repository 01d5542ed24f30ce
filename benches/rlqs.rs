//! Criterion benchmarks of the quota service's share table without transport: one report of a
//! bucket that a thousand or ten thousand streams watch (a report reads its cached share, so its
//! cost should not grow with the streams), and ten thousand streams joining one bucket at once.
//! Run with `cargo bench --bench rlqs`; numbers go in BENCHMARKS.md.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use sluice::policy::{self, PolicyHandle};
use sluice::rlqs::{Report, RlqsSettings, ShareTable, Watcher};

const POLICY: &str = "domain: d
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 10000}
";

fn table(streams: usize) -> Arc<ShareTable> {
    let set = policy::load_str(&[("d.yaml", POLICY)]).expect("policy");
    Arc::new(ShareTable::new(
        RlqsSettings {
            assignment_ttl: Duration::from_secs(10),
            max_buckets_per_stream: 10,
            max_streams: streams,
            max_streams_per_connection: streams,
            max_streams_per_peer: streams,
        },
        PolicyHandle::new(set),
    ))
}

fn report(requests: u64) -> Report {
    Report {
        bucket: sluice::rlqs::key::flat(&[("tenant".to_string(), "shared".to_string())].into()),
        elapsed_ns: 1_000_000_000,
        requests,
    }
}

/// `n` streams, each watching the one shared bucket.
fn joined(n: usize) -> (Arc<ShareTable>, Vec<Watcher>) {
    let table = table(n);
    let streams = joined_to(&table, n);
    (table, streams)
}

fn reports(c: &mut Criterion) {
    let mut group = c.benchmark_group("rlqs");
    for n in [1_000, 10_000] {
        let (_table, mut streams) = joined(n);
        let mut i = 0usize;
        let mut now = 1u64;
        group.bench_function(format!("one report, {n} streams on one bucket"), |b| {
            b.iter(|| {
                i = (i + 1) % n;
                now += 1_000;
                black_box(streams[i].report(now, vec![report(10 + (i as u64 % 50))]))
            });
        });
    }
    group.sample_size(10);
    group.bench_function("10000 streams join one bucket", |b| {
        b.iter_batched(
            || table(10_000),
            |table| black_box(joined_to(&table, 10_000)),
            BatchSize::PerIteration,
        );
    });
    group.finish();
}

/// `n` streams opened on `table`, each reporting the one shared bucket.
fn joined_to(table: &Arc<ShareTable>, n: usize) -> Vec<Watcher> {
    let mut streams: Vec<Watcher> = (0..n)
        .map(|_| table.open("d".into()).expect("open"))
        .collect();
    for (i, s) in streams.iter_mut().enumerate() {
        s.report(0, vec![report(10 + i as u64 % 50)]);
    }
    streams
}

criterion_group!(benches, reports);
criterion_main!(benches);
