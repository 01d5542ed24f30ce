//! sluice: a rate-limit decision server that speaks Envoy's
//! `envoy.service.ratelimit.v3.RateLimitService`, reads envoyproxy/ratelimit policy files, and
//! counts with GCRA (one theoretical arrival time per counter) instead of fixed windows.
//!
//! # Layout
//!
//! - [`app`]: the composition root: loads policies, binds listeners, builds the backend and the
//!   decider, runs the servers and the background tasks, sequences shutdown.
//! - `server` (internal): the transport adapters: gRPC (`rls`, health) and the HTTP admin port
//!   (`admin`, with the proto3-JSON `json`). The only code that speaks protobuf or HTTP.
//! - [`decision`]: the transport-free use case, [`decision::Decider::decide`]: validate, match,
//!   count through the backend, answer backend failures as configured, aggregate, add response
//!   headers, record metrics.
//! - [`policy`]: YAML policy files → validated, compiled `PolicySet` behind an `ArcSwap`.
//! - [`limiter`]: GCRA math, the clock, counter keys, and the [`limiter::Backend`] seam over the
//!   in-memory store and Redis; [`limiter::LocalFallback`], the node's own store at rate/N
//!   while Redis cannot decide (`on_backend_error: local`).
//! - `reload` (internal): watches the policy directory and SIGHUP; load → validate → swap.
//! - [`metrics`]: metric names and how to record them; `histogram` (internal): the fixed-bucket
//!   latency histogram.
//! - [`cli`]: the command line and one `run` per subcommand, above everything else; only
//!   `main` uses it.
//! - [`settings`]: settings as written (defaults, file, environment, flags), validated once
//!   into typed [`settings::Settings`].
//! - [`telemetry`], [`shutdown`]: logging and signals for the binary; [`allocator`]: the global
//!   allocator the binaries declare.
//! - [`tls`]: the gRPC port's TLS: rustls on ring, certificates reloaded when their files
//!   change, mTLS, and every served certificate's expiry logged and published.
//! - [`lab`]: `sluice check`'s per-rule guarantees and `sluice replay`: traces through the real
//!   decider on a hand-driven clock, beside fixed-window, sliding-log and sliding-counter
//!   comparisons, with the SVG chart. Never serves.
//! - [`probe`]: `sluice probe`, a gRPC client that loads a running rate-limit service and
//!   reports what it answered; the server never imports it.
//! - [`pb`]: generated protobuf code.
//! - `client` (feature `client`): the other side of the wire, for services that ask sluice: a
//!   typed client with a deadline and a failure policy, jittered backoff, a tower layer, and an
//!   adaptive concurrency limit for the service's own downstream calls. It speaks `pb` only.
//!
//! # Request flow
//!
//! ```text
//! gRPC: pb request → server::rls ─┐                      ┌→ policy::Domain::resolve
//! HTTP: JSON body → server::json ─┴→ decision::Decider ──┼→ limiter::Backend (memory CAS | Redis script)
//!                   wire answer  ←─ decision::Decision ←─┴→ metrics
//! ```
//!
//! Dependencies point one way: `limiter` and `policy` know nothing of tonic, tokio (Redis aside)
//! or protobuf; `decision` knows no transport; the adapters reach no store.

pub mod allocator;
pub mod app;
pub mod cli;
#[cfg(feature = "client")]
pub mod client;
pub mod decision;
#[cfg(fuzzing)]
#[doc(hidden)]
pub mod fuzz;
pub(crate) mod histogram;
pub mod lab;
pub mod limiter;
pub mod metrics;
pub mod pb;
pub mod policy;
pub mod probe;
pub(crate) mod reload;
pub(crate) mod server;
pub mod settings;
pub mod shutdown;
pub mod telemetry;
pub mod tls;
pub mod wire;
