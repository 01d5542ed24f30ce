//! sluice: a rate-limit decision server that speaks Envoy's
//! `envoy.service.ratelimit.v3.RateLimitService`, reads envoyproxy/ratelimit policy files, and
//! counts with GCRA (one theoretical arrival time per counter) instead of fixed windows.
//!
//! # Layout
//!
//! Top first; a module imports only from the layers below its own, and `tests/it/layers.rs`
//! checks that from the imports (`cargo test --test it layers -- --nocapture` prints the graph).
//!
//! - `main.rs` and [`cli`]: the command line, one `run` per subcommand.
//! - [`app`]: the composition root: loads policies, binds listeners, builds the backend and the
//!   decider, runs the servers and background tasks as named steps, sequences shutdown.
//! - `server` (internal): the gRPC port (`ShouldRateLimit`, `StreamRateLimitQuotas`, health) and
//!   the HTTP admin port, with their bounds on what a peer can hold. [`lab`]: `sluice check`'s
//!   guarantees and `sluice replay`; never serves. `reload` (internal): the policy directory and
//!   SIGHUP. [`xds`]: policies pushed by an xDS management server instead. [`probe`]: the load
//!   client. `client` (feature `client`): the other side of the wire; it speaks `pb` only.
//! - [`settings`]: settings as written (defaults, file, environment, flags), validated once into
//!   typed [`settings::Settings`]. [`wire`]: the request and answer as protobuf and proto3 JSON,
//!   converted to and from the decision layer.
//! - [`traces`]: OpenTelemetry spans of calls, joined to the caller's trace, exported over OTLP
//!   from a bounded queue; nothing is built when tracing is off.
//! - [`decision`]: the transport-free use case, [`decision::Decider::decide`]: validate, match,
//!   count through the backend, answer backend failures as configured, aggregate, add headers.
//! - [`rlqs`]: Envoy's Rate Limit Quota Service, transport-free: buckets matched to rules, this
//!   node's shares of each limited rule divided among the streams watching it by demand, the
//!   streams' places per connection and peer, and the fleet's rounds renewing this node's parts.
//! - [`metrics`]: metric names, the recorder, the exposition of the backends' plain figures, and
//!   the heaviest keys of each limited rule.
//! - [`policy`]: YAML policy files → validated, compiled `PolicySet` behind an `ArcSwap`.
//! - [`limiter`]: GCRA math, the clock, counter keys, and the [`limiter::Backend`] seam over the
//!   in-memory store, Redis (exact, leased) and local mode.
//! - Leaves: `histogram`, [`tls`], [`pb`], [`telemetry`], [`shutdown`], [`allocator`].
//!
//! # Request flow
//!
//! ```text
//! gRPC: pb request ─ wire ─→ server::rls ─┐                      ┌→ policy::Domain::resolve
//! HTTP: JSON body ─ wire::json → admin ───┴→ decision::Decider ──┼→ limiter::Backend
//!                        wire answer  ←──── decision::Decision ←─┴→ metrics
//! ```

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
pub mod rlqs;
pub(crate) mod server;
pub mod settings;
pub mod shutdown;
pub mod telemetry;
pub mod tls;
pub mod traces;
pub mod wire;
pub mod xds;
