//! What the decision targets share: a fixed policy set, the decider options they run under, the
//! clock times each input is decided at, and one metrics recorder for the whole process.
//!
//! Each input gets a fresh in-memory store and clock, so an input decides the same whatever ran
//! before it (a crash reproduces from its file alone). The metrics are shared: the recorder is
//! process-global, and a fresh `Metrics` per input would let request-valued series grow without
//! bound across inputs.

#![allow(dead_code)] // Each target uses part of it.

use std::sync::{Arc, OnceLock};

use futures_util::FutureExt;
use sluice::decision::{
    DecideError, Decider, Decision, HeaderMode, HeaderOptions, Options, Request,
};
use sluice::limiter::{Backend, ManualClock, MemoryStore};
use sluice::metrics::Metrics;
use sluice::policy::{PolicyHandle, load_str};

/// The clock at an input's time 0, as `sluice replay` sets it: never 0, which a fresh key's TAT is.
pub const ORIGIN: u64 = 1_000_000 * 1_000_000_000;

/// When, after [`ORIGIN`], each input is decided: twice at once (the second sees the first's
/// charge), after 1.5 s (partly refilled), and after 400 days (past every bucket but the longest).
pub const TIMES: [u64; 4] = [0, 0, 1_500_000_000, 400 * 86_400 * 1_000_000_000];

/// The reference's schema with our additions, each of which the policy tests check the
/// meaning of.
const TEST_DOMAIN: &str = include_str!("../../../tests/fixtures/reference-schema.yaml");

/// The example deployment's policy (domain `edge`) and [`TEST_DOMAIN`].
pub fn policies() -> PolicyHandle {
    static SET: OnceLock<PolicyHandle> = OnceLock::new();
    SET.get_or_init(|| {
        let edge = include_str!("../../../config/policies/edge.yaml");
        let set = load_str(&[("edge.yaml", edge), ("test.yaml", TEST_DOMAIN)])
            .unwrap_or_else(|e| panic!("the fuzz policies load: {e}"));
        PolicyHandle::new(set)
    })
    .clone()
}

/// One recorder for the process.
pub fn metrics() -> Arc<Metrics> {
    static METRICS: OnceLock<Arc<Metrics>> = OnceLock::new();
    METRICS
        .get_or_init(|| Arc::new(Metrics::install(100)))
        .clone()
}

/// The server's defaults; then global quota mode with dynamic metadata, draft headers and the
/// problem body; then global shadow mode with the legacy headers. No `Retry-After` jitter: an
/// input decides the same every time.
pub fn options() -> [Options; 3] {
    [
        Options::default(),
        Options {
            quota_mode: true,
            dynamic_metadata: true,
            headers: HeaderOptions {
                mode: HeaderMode::Draft,
                problem_body: true,
                ..HeaderOptions::default()
            },
            ..Options::default()
        },
        Options {
            shadow_mode: true,
            headers: HeaderOptions {
                mode: HeaderMode::Legacy,
                ..HeaderOptions::default()
            },
            ..Options::default()
        },
    ]
}

/// A decider over [`policies`] with `options`, on a fresh in-memory store, and its clock.
pub fn decider(options: Options) -> (Decider, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(ORIGIN));
    let backend = Backend::memory(MemoryStore::new(), clock.clone());
    (Decider::new(policies(), backend, metrics(), options), clock)
}

/// `req` decided by `decider` (in-memory: it never waits).
pub fn decide(decider: &Decider, req: &Request) -> Result<Decision, DecideError> {
    decider
        .decide(req)
        .now_or_never()
        .expect("the in-memory decision completes without waiting")
}
