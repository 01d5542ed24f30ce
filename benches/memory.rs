//! Resident memory per tracked key: fills an in-memory store with N live keys (default
//! 10,000,000; `SLUICE_BENCH_KEYS` overrides) and reports the growth of the process's resident
//! set divided by N. Run with `cargo bench --bench memory`; numbers go in BENCHMARKS.md.

use sluice::limiter::gcra::NANOS_PER_SEC;
use sluice::limiter::{KeyBuilder, MemoryStore, Quota};

// The server's allocator (src/main.rs declares the same), so the figure is the server's.
#[global_allocator]
static ALLOCATOR: sluice::allocator::Allocator = sluice::allocator::ALLOCATOR;

/// Resident set size in bytes, from `/proc/self/statm` (Linux).
fn rss() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn main() {
    // `cargo bench` passes `--bench`; this target takes no other arguments.
    let keys: u64 = std::env::var("SLUICE_BENCH_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000_000);
    let Some(before) = rss() else {
        eprintln!("memory: /proc/self/statm is not readable here; nothing measured");
        return;
    };
    let store = MemoryStore::with_max_keys(usize::try_from(keys).unwrap_or(usize::MAX));
    let quota = Quota::new(3_600 * NANOS_PER_SEC, 1, 1).expect("valid quota");
    let step = (keys / 10).max(1);
    for i in 0..keys {
        let key = KeyBuilder::new(1).part(&i.to_le_bytes()).finish();
        assert!(store.count(key, &quota, 1, 1).admitted);
        if (i + 1) % step == 0 {
            eprintln!("memory: {} of {keys} keys", i + 1);
        }
    }
    let after = rss().unwrap_or(before);
    let grown = after.saturating_sub(before);
    println!(
        "memory: {} keys, resident set grew {:.1} MiB: {:.1} bytes per key",
        store.len(),
        grown as f64 / (1 << 20) as f64,
        grown as f64 / keys as f64
    );
}
