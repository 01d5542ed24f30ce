//! sluice: a rate-limit decision server that speaks Envoy's
//! `envoy.service.ratelimit.v3.RateLimitService`, reads envoyproxy/ratelimit policy files, and
//! counts with GCRA (one theoretical arrival time per counter) instead of fixed windows.
//!
//! # Layout
//!
//! - [`app`]: the composition root: loads policies, binds listeners, runs the servers and the
//!   store sweeper, sequences shutdown.
//! - [`server`]: the transport adapters: gRPC (`rls`, health) and the HTTP admin port. The only
//!   code that speaks protobuf.
//! - [`decision`]: the transport-free use case: validate, match, count, aggregate.
//! - [`policy`]: YAML policy files → validated, compiled `PolicySet` behind an `ArcSwap`.
//! - [`limiter`]: GCRA math, the clock, counter keys and the in-memory store.
//! - [`reload`]: watches the policy directory and SIGHUP; load → validate → swap.
//! - [`metrics`]: metric names, the Prometheus recorder, the request path's counters;
//!   [`histogram`]: the fixed-bucket latency histogram they and the Redis stats record into.
//! - [`settings`], [`telemetry`], [`shutdown`]: process settings and CLI, logging, signals.
//! - [`pb`]: generated protobuf code.
//!
//! # Request flow
//!
//! ```text
//! pb request → server::rls → decision::plan → policy::Domain::resolve → limiter (store CAS)
//!            ← server::rls ← decision::finish ←─────────────────────── Batch
//! ```
//!
//! Dependencies point one way: `limiter` and `policy` know nothing of tonic, tokio or protobuf.

pub mod app;
pub mod decision;
pub mod histogram;
pub mod limiter;
pub mod metrics;
pub mod pb;
pub mod policy;
pub mod reload;
pub mod server;
pub mod settings;
pub mod shutdown;
pub mod telemetry;
