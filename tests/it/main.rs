//! sluice integration tests: one binary, a module per area.
mod check;
#[cfg(feature = "client")]
mod client;
mod compat;
mod conn;
mod counters;
mod delay;
mod docs;
mod docs_examples;
mod gcra;
mod headers;
mod helpers;
mod lab;
mod layers;
mod lease;
mod limited;
mod local;
mod memory;
mod metadata;
mod ops;
// The example job, run by `client`'s tests against a real server (its `main` is not called).
#[cfg(feature = "client")]
#[allow(dead_code)]
#[path = "../../examples/paced_batch.rs"]
mod paced_batch;
#[cfg(feature = "client")]
mod quota_client;
mod redis;
mod redis_commands;
mod redis_queue;
mod redis_sentinel;
mod redis_tls;
mod rlqs;
mod service;
mod shares;
mod tls;
mod traces;
mod wire;
mod xds;
