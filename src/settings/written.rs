//! The first stage of settings: [`Written`], the values as written, with the built-in
//! defaults and the schema of the settings file (unknown fields are errors). Values keep the
//! units they are written in (milliseconds, URL strings); `layers` fills them in from every
//! source and `validate` turns them into [`super::Settings`]. Secrets stay out of `Debug`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::BackendKind;
use super::compat::Compat;
use crate::decision::{Caps, HeaderMode, LegacyNames, OnBackendError};
use crate::policy::Files;
use crate::telemetry::LogFormat;
use crate::traces::Protocol;

/// The process settings as written, every source merged, not yet validated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Written {
    /// Read another service's environment variables as settings: `none`, or
    /// `envoy-ratelimit` (envoyproxy/ratelimit's `PORT`, `RUNTIME_ROOT`, `REDIS_URL`, ...),
    /// layered between the settings file and `SLUICE_*`.
    pub compat: Compat,
    /// gRPC listen address.
    pub grpc_addr: SocketAddr,
    /// HTTP admin listen address.
    pub admin_addr: SocketAddr,
    /// Where policies come from: `files` (the `policies` directory, watched) or `xds` (pushed by
    /// an xDS management server, the `xds` section; the directory is then not read).
    pub policy_source: PolicySource,
    /// The xDS management server, for `policy_source: xds`.
    pub xds: XdsSection,
    /// Directory of policy files.
    pub policies: PathBuf,
    /// Which of its entries are policy files: `yaml` (`*.yaml`, `*.yml`, not hidden), `all`
    /// (every entry, envoyproxy/ratelimit's reading) or `visible` (every entry not starting
    /// with a dot, its `RUNTIME_IGNOREDOTFILES=true`).
    pub policy_files: Files,
    /// Reload policies when files in the directory change (SIGHUP always reloads).
    pub watch_policies: bool,
    /// Accept a policy directory with no policy file (no domain: every request answered OK)
    /// at startup, on reload and in `sluice check`; refused when false.
    pub allow_empty_policies: bool,
    /// Merge policy files that name the same domain into one descriptor tree, in file order
    /// (envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG`); when false such a pair is refused.
    pub merge_domains: bool,
    /// Log format.
    pub log_format: LogFormat,
    /// Log level or filter directives; `RUST_LOG` wins when set.
    pub log_level: String,
    /// Global shadow mode: count and report as usual, never answer OVER_LIMIT overall.
    pub shadow_mode: bool,
    /// Global quota mode: every limited rule counts as `quota_mode`.
    pub quota_mode: bool,
    /// Rate-limit header fields to add to responses: `none`, `draft` or `legacy`.
    pub response_headers: HeaderMode,
    /// The names of the `legacy` header fields (`limit`, `remaining`, `reset`).
    pub legacy_headers: LegacyNames,
    /// Most seconds added at random to `Retry-After` on denials (with `response_headers`).
    pub retry_after_jitter_seconds: u64,
    /// Add an RFC 9457 problem+json body (`raw_body`) to denials.
    pub problem_body: bool,
    /// Fill the response's `dynamic_metadata` in envoyproxy/ratelimit's shape (its
    /// `RESPONSE_DYNAMIC_METADATA`): the domain, the descriptors, and the merged `metadata` of
    /// the rules whose descriptors passed.
    pub response_dynamic_metadata: bool,
    /// Caps on request size.
    pub requests: RequestsSection,
    /// The in-memory store.
    pub store: StoreSection,
    /// Where counters live: `memory` or `redis`.
    pub backend: BackendKind,
    /// The answer when the backend cannot decide: `allow`, `deny` or `error`.
    pub on_backend_error: OnBackendError,
    /// Redis, for `backend: redis`.
    pub redis: RedisSection,
    /// Metrics.
    pub metrics: MetricsSection,
    /// Traces: OpenTelemetry spans exported over OTLP.
    pub tracing: TracingSection,
    /// After a stop signal, how long to keep answering while health reports NOT_SERVING (so
    /// load balancers notice first), in milliseconds.
    pub drain_delay_ms: u64,
    /// How long shutdown then waits for in-flight calls, in milliseconds.
    pub shutdown_grace_ms: u64,
    /// Bounds on the gRPC port's connections and HTTP/2 streams.
    pub grpc: GrpcSection,
    /// Bounds on the admin port's connections.
    pub admin: AdminSection,
    /// Envoy's Rate Limit Quota Service on the gRPC port.
    pub rlqs: RlqsSection,
    /// What the `compat` variables asked for that is not acted on, for the log. Not a setting.
    #[serde(skip)]
    pub compat_warnings: Vec<String>,
    /// The settings the `compat` variables set (dotted names), for the log. Not a setting.
    #[serde(skip)]
    pub compat_set: Vec<String>,
}

/// Where policies come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PolicySource {
    /// The policy directory.
    #[default]
    Files,
    /// An xDS management server (aggregated discovery, state of the world).
    Xds,
}

/// The xDS management server that pushes `RateLimitConfig` resources, as written. Its `Debug`
/// hides the headers' values.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct XdsSection {
    /// `host:port`, `http://host:port` or `https://host:port` (TLS).
    pub url: String,
    /// The node id sent to the server (Envoy Gateway answers only `envoy-ratelimit`).
    pub node_id: String,
    /// The node's metadata, string values.
    pub node_metadata: BTreeMap<String, String>,
    /// Extra gRPC metadata (HTTP/2 headers) sent on the stream.
    pub headers: BTreeMap<String, String>,
    /// Largest response accepted, in bytes; 0 is gRPC's default, 4 MiB. A larger one resets the
    /// stream.
    pub max_message_bytes: usize,
    /// Before the first policies arrive, report healthy and answer calls `UNKNOWN` ("no rate
    /// limit configuration loaded"); when false, health reports not serving until then (calls
    /// get the same answer).
    pub force_start: bool,
    /// The wait before reconnecting.
    pub backoff: XdsBackoffSection,
    /// TLS to the server.
    pub tls: XdsTlsSection,
}

impl Default for XdsSection {
    fn default() -> Self {
        Self {
            url: "localhost:18000".into(),
            node_id: "default".into(),
            node_metadata: BTreeMap::new(),
            headers: BTreeMap::new(),
            max_message_bytes: 0,
            force_start: false,
            backoff: XdsBackoffSection::default(),
            tls: XdsTlsSection::default(),
        }
    }
}

impl std::fmt::Debug for XdsSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdsSection")
            .field("url", &self.url)
            .field("node_id", &self.node_id)
            .field("node_metadata", &self.node_metadata)
            .field(
                "headers",
                &self.headers.keys().map(|k| (k, "***")).collect::<Vec<_>>(),
            )
            .field("max_message_bytes", &self.max_message_bytes)
            .field("force_start", &self.force_start)
            .field("backoff", &self.backoff)
            .field("tls", &self.tls)
            .finish()
    }
}

/// The wait before each reconnection to the xDS server: `initial_ms`, doubled after each failed
/// attempt up to `max_ms`, back to `initial_ms` after an accepted response; with `jitter`, drawn
/// at random within ±`random_factor` of that (never past `max_ms`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct XdsBackoffSection {
    /// The first wait, in milliseconds.
    pub initial_ms: u64,
    /// The longest wait, in milliseconds.
    pub max_ms: u64,
    /// How far a jittered wait may be from the computed one, as a fraction (0 to 1).
    pub random_factor: f64,
    /// Jitter the waits.
    pub jitter: bool,
}

impl Default for XdsBackoffSection {
    fn default() -> Self {
        Self {
            initial_ms: 10_000,
            max_ms: 60_000,
            random_factor: 0.5,
            jitter: true,
        }
    }
}

/// TLS to the xDS server, as written. Empty paths are unset.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct XdsTlsSection {
    /// Connect over TLS (also implied by an `https://` URL).
    pub enabled: bool,
    /// Client certificate chain (PEM), for a server that requires one (mTLS); with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<PathBuf>,
    /// CA certificates (PEM) the server's certificate may chain to, besides the system's roots.
    pub ca_file: Option<PathBuf>,
    /// The name the server's certificate must carry; unset: the host of `url`.
    pub san: Option<String>,
}

/// Bounds on the gRPC port: what one connection, and all of them, can hold; and its TLS.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpcSection {
    /// Most connections open at once; one accepted past it is closed at once.
    pub max_connections: usize,
    /// Most concurrent streams (calls) per connection, advertised as
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`; a stream past it is refused.
    pub max_concurrent_streams: u32,
    /// Most bytes of request headers (`SETTINGS_MAX_HEADER_LIST_SIZE`).
    pub max_header_list_bytes: u32,
    /// Longest a call may take from its headers to its answer, body included, in
    /// milliseconds; past it the call ends with `DEADLINE_EXCEEDED` (a shorter `grpc-timeout` wins).
    pub request_timeout_ms: u64,
    /// How long without a frame from the peer before sending an HTTP/2 PING, in milliseconds.
    pub keepalive_interval_ms: u64,
    /// How long to wait for the PING's acknowledgement before closing, in milliseconds.
    pub keepalive_timeout_ms: u64,
    /// How long a connection may carry no request (no HEADERS or DATA frame from the peer)
    /// before it is closed, in milliseconds; longer than `request_timeout_ms`.
    pub idle_timeout_ms: u64,
    /// How long a connection may stay open before it is asked to go (a GOAWAY; calls in flight
    /// finish), in milliseconds, with ±10 % jitter so that connections opened together do not
    /// leave together; 0 keeps connections for as long as their peer wants.
    pub max_connection_age_ms: u64,
    /// How long a connection past its age is then given for the calls in flight before it is
    /// closed, in milliseconds.
    pub max_connection_age_grace_ms: u64,
    /// Most answers held at once for their slot (a rule's `delay`), over all connections; a
    /// request that would be held past it is refused at once with its wait. 0: none is held.
    pub max_held_requests: usize,
    /// Most answers held at once on one connection; past it, as past `max_held_requests`.
    pub max_held_per_connection: usize,
    /// How long before the caller's deadline (its `grpc-timeout`, or `request_timeout_ms`) a
    /// held answer must be given, in milliseconds; a request whose slot falls later is refused
    /// at once with its wait.
    pub hold_deadline_margin_ms: u64,
    /// TLS on the gRPC port (off unless `cert_file` and `key_file` are set).
    pub tls: GrpcTlsSection,
}

/// TLS (and mTLS) on the gRPC port, as written.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpcTlsSection {
    /// The server's certificate chain (PEM, leaf first); with `key_file`, turns TLS on.
    pub cert_file: Option<PathBuf>,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<PathBuf>,
    /// CA certificates (PEM) that client certificates must chain to; when set, every client
    /// must present a valid certificate (mTLS).
    pub client_ca_file: Option<PathBuf>,
    /// A DNS name the client certificate must carry as a subject alternative name (with
    /// `client_ca_file`).
    pub client_san: Option<String>,
    /// Longest a new connection may take to complete its TLS handshake, in milliseconds.
    pub handshake_timeout_ms: u64,
}

impl Default for GrpcTlsSection {
    fn default() -> Self {
        Self {
            cert_file: None,
            key_file: None,
            client_ca_file: None,
            client_san: None,
            handshake_timeout_ms: 5_000,
        }
    }
}

impl Default for GrpcSection {
    fn default() -> Self {
        Self {
            max_connections: 4_096,
            max_concurrent_streams: 1_024,
            max_header_list_bytes: 16_384,
            request_timeout_ms: 5_000,
            keepalive_interval_ms: 30_000,
            keepalive_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            max_connection_age_ms: 0,
            max_connection_age_grace_ms: 3_600_000,
            max_held_requests: 10_000,
            max_held_per_connection: 1_000,
            hold_deadline_margin_ms: 5,
            tls: GrpcTlsSection::default(),
        }
    }
}

/// Bounds on the admin port (and the metrics and debug listeners, which share its server), and
/// the debug listener.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminSection {
    /// Most connections open at once; one accepted past it is closed at once.
    pub max_connections: usize,
    /// Longest a connection may take to send a complete request head (for its first request,
    /// or the next one on a kept-alive connection) before it is closed, in milliseconds.
    pub header_read_timeout_ms: u64,
    /// A listener of its own serving only `GET /rlconfig` (envoyproxy/ratelimit's debug port,
    /// where `egctl config envoy-ratelimit` looks); unset: none (the admin port serves it too).
    pub debug_addr: Option<SocketAddr>,
    /// A file holding the bearer token that writes on the admin port (`POST /counters/reset`)
    /// must present, read at startup; unset: writes are off (refused with 403).
    pub write_token_file: Option<PathBuf>,
}

impl Default for AdminSection {
    fn default() -> Self {
        Self {
            max_connections: 256,
            header_read_timeout_ms: 5_000,
            debug_addr: None,
            write_token_file: None,
        }
    }
}

/// Caps on request size; larger requests are refused with `INVALID_ARGUMENT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RequestsSection {
    /// Largest encoded request, in bytes (refused by the gRPC layer beyond this).
    pub max_request_bytes: usize,
    /// Most descriptors per request.
    pub max_descriptors: usize,
    /// Most entries per descriptor.
    pub max_entries: usize,
    /// Longest domain, in bytes.
    pub max_domain_bytes: usize,
    /// Longest entry key, in bytes.
    pub max_key_bytes: usize,
    /// Longest entry value, in bytes.
    pub max_value_bytes: usize,
}

/// The in-memory store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreSection {
    /// Most counters held; past it a new counter evicts the one closest to expiry.
    pub max_keys: usize,
    /// How often keys with a full bucket (no information) are removed, in milliseconds.
    pub sweep_interval_ms: u64,
}

/// Envoy's Rate Limit Quota Service (`StreamRateLimitQuotas`) on the gRPC port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RlqsSection {
    /// Serve it.
    pub enabled: bool,
    /// How long an assignment holds (`assignment_time_to_live`), in milliseconds, from a
    /// second to an hour; a bucket not reported for this long is abandoned, and assignments are
    /// renewed at half of it.
    pub assignment_ttl_ms: u64,
    /// Most buckets one stream may watch; a report of one more is answered `abandon_action`.
    pub max_buckets_per_stream: usize,
    /// Most quota streams open at once; one more is refused `RESOURCE_EXHAUSTED`.
    pub max_streams: usize,
    /// Most quota streams open at once on one connection, counted from their headers (a stream
    /// whose first message has not come yet counts); one more is refused `RESOURCE_EXHAUSTED`.
    pub max_streams_per_connection: usize,
    /// Most quota streams open at once from one peer IP address, over all its connections,
    /// counted from their headers; one more is refused `RESOURCE_EXHAUSTED`.
    pub max_streams_per_peer: usize,
}

impl Default for RlqsSection {
    fn default() -> Self {
        Self {
            enabled: true,
            assignment_ttl_ms: 10_000,
            max_buckets_per_stream: 1_000,
            max_streams: 1_000,
            max_streams_per_connection: 100,
            max_streams_per_peer: 250,
        }
    }
}

/// Redis, for `backend: redis`. Its `Debug` hides the password and URL credentials.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisSection {
    /// `redis://host:port` (`rediss://` for TLS, `redis://user:password@host:port` for an
    /// ACL user); for a cluster, the seed nodes, comma-separated.
    pub url: String,
    /// ACL user name, when not in the URL; empty: Redis's `default` user.
    pub username: String,
    /// Password, when not in the URL (e.g. from `SLUICE_REDIS__PASSWORD`); empty: none.
    pub password: String,
    /// File holding the password (a mounted Kubernetes Secret), read at each connection
    /// attempt, one trailing newline dropped; empty: none.
    pub password_file: String,
    /// TLS, for `rediss://` URLs.
    pub tls: RedisTlsSection,
    /// Talk Redis Cluster.
    pub cluster: bool,
    /// Prefix of every key sluice writes.
    pub key_prefix: String,
    /// Deadline of one request's round trip, in milliseconds (Envoy's default budget for the
    /// whole call is 20 ms).
    pub timeout_ms: u64,
    /// Deadline of one connection attempt, in milliseconds.
    pub connect_timeout_ms: u64,
    /// Consecutive failures that open the circuit breaker (0 disables it).
    pub breaker_failures: u32,
    /// How long the open breaker answers without trying Redis, in milliseconds.
    pub breaker_cooldown_ms: u64,
    /// Most counters in the local over-limit cache (0 disables it).
    pub deny_cache_keys: usize,
    /// Leased counting of hot counters.
    pub lease: LeaseSection,
    /// Redis Sentinel: find the master through its sentinels and follow its failovers.
    pub sentinel: SentinelSection,
    /// The number of nodes sharing each budget, N, for `on_backend_error: local`; unset, N is the
    /// number of live nodes seen through Redis heartbeats before the outage.
    pub fleet_size: Option<u64>,
    /// How often each node records itself in Redis (for `on_backend_error: local` without
    /// `fleet_size`), in milliseconds.
    pub heartbeat_interval_ms: u64,
}

/// Leased counting (`redis.lease`): slices of hot counters' tokens taken from Redis and
/// answered locally, within `B + floor((W + L) / T)` in any span W (L = `max_age_ms`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeaseSection {
    /// Lease hot counters (off: every decision is a round trip).
    pub enabled: bool,
    /// L: the longest a slice is used before its unused tokens go back, in milliseconds.
    pub max_age_ms: u64,
    /// Hits per second on this node before a counter is leased.
    pub min_rate: u64,
    /// The most of a counter's burst one slice may take (above 0, at most 1).
    pub max_burst_share: f64,
    /// The fraction of the last slice left when the next one is taken (0 to below 1).
    pub low_water: f64,
}

impl Default for LeaseSection {
    fn default() -> Self {
        Self {
            enabled: false,
            max_age_ms: 1_000,
            min_rate: 20,
            max_burst_share: 0.1,
            low_water: 0.5,
        }
    }
}

/// Redis Sentinel, for `backend: redis`: off while both the master's name and the sentinels
/// are empty. Its `Debug` hides credentials.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SentinelSection {
    /// The master's name, as the sentinels know it (`sentinel monitor <name> ...`).
    pub master_name: String,
    /// `redis://host:port` URLs of the sentinels, comma-separated, asked in this order.
    pub urls: String,
    /// The sentinels' password (`requirepass` in their config), for URLs that carry none.
    pub password: String,
}

impl std::fmt::Debug for SentinelSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelSection")
            .field("master_name", &self.master_name)
            .field(
                "urls",
                &crate::limiter::redis::redact_all(self.urls.split(',')),
            )
            .field(
                "password",
                &if self.password.is_empty() { "" } else { "***" },
            )
            .finish()
    }
}

/// TLS to Redis (with `rediss://` URLs). Empty paths are unset.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisTlsSection {
    /// PEM CA certificate(s) the server's certificate must chain to; empty: the system's roots.
    pub ca_file: String,
    /// PEM client certificate, for servers that require one (mTLS); with `key_file`.
    pub cert_file: String,
    /// PEM private key of `cert_file`.
    pub key_file: String,
    /// Accept a server certificate whose names do not match the host (a hosted Redis reached
    /// by IP); the chain is still verified against the CA.
    pub skip_hostname_verification: bool,
}

impl Default for RedisSection {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379".into(),
            username: String::new(),
            password: String::new(),
            password_file: String::new(),
            tls: RedisTlsSection::default(),
            cluster: false,
            key_prefix: "sluice:".into(),
            timeout_ms: 10,
            connect_timeout_ms: 1_000,
            breaker_failures: 5,
            breaker_cooldown_ms: 1_000,
            deny_cache_keys: 100_000,
            lease: LeaseSection::default(),
            sentinel: SentinelSection::default(),
            fleet_size: None,
            heartbeat_interval_ms: 1_000,
        }
    }
}

impl std::fmt::Debug for RedisSection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisSection")
            .field("url", &self.redacted_url())
            .field("username", &self.username)
            .field(
                "password",
                &if self.password.is_empty() { "" } else { "***" },
            )
            .field("password_file", &self.password_file)
            .field("tls", &self.tls)
            .field("cluster", &self.cluster)
            .field("key_prefix", &self.key_prefix)
            .field("timeout_ms", &self.timeout_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("breaker_failures", &self.breaker_failures)
            .field("breaker_cooldown_ms", &self.breaker_cooldown_ms)
            .field("deny_cache_keys", &self.deny_cache_keys)
            .field("lease", &self.lease)
            .field("sentinel", &self.sentinel)
            .field("fleet_size", &self.fleet_size)
            .field("heartbeat_interval_ms", &self.heartbeat_interval_ms)
            .finish()
    }
}

impl RedisSection {
    /// The URL(s) with any `user:password@` replaced by `***@`, for logs.
    #[must_use]
    pub fn redacted_url(&self) -> String {
        crate::limiter::redis::redact_all(self.url.split(','))
    }
}

/// Metrics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSection {
    /// A listener of its own serving the Prometheus text at `path` (as envoyproxy/ratelimit's
    /// `PROMETHEUS_ADDR`); unset: none. The admin port's `/metrics` serves it either way.
    pub addr: Option<SocketAddr>,
    /// The path the Prometheus text is served at on `addr`.
    pub path: String,
    /// Most series whose labels carry request values (`detailed_metric`, `value_to_metric`,
    /// unknown domains); past it they are counted under `_other`.
    pub max_detailed_series: usize,
    /// An admitted hit counts as `near_limit` when it uses the bucket above this fraction
    /// (0 to 1), as envoyproxy/ratelimit's `NEAR_LIMIT_RATIO`.
    pub near_limit_ratio: f64,
    /// Keys shown per limited rule by `/limited` and the top-key series (0: none tracked); each
    /// rule's sketches hold ten times as many.
    pub top_keys: usize,
}

impl Default for MetricsSection {
    fn default() -> Self {
        Self {
            addr: None,
            path: "/metrics".into(),
            max_detailed_series: 1_000,
            near_limit_ratio: crate::metrics::DEFAULT_NEAR_LIMIT_RATIO,
            top_keys: crate::metrics::DEFAULT_TOP_KEYS,
        }
    }
}

/// Traces, as written. Empty strings are unset: `endpoint`, `service_name` and
/// `resource_attributes` then come from `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME` and
/// `OTEL_RESOURCE_ATTRIBUTES`, else from the defaults (`layers` fills them in).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingSection {
    /// Export a span per call.
    pub enabled: bool,
    /// The OTLP transport: `grpc` or `http` (protobuf bodies).
    pub protocol: Protocol,
    /// The collector's URL (default `http://localhost:4317` for gRPC, `http://localhost:4318`
    /// for HTTP, where `/v1/traces` is added to a URL without a path).
    pub endpoint: String,
    /// The resource's `service.name` (default `sluice`).
    pub service_name: String,
    /// More resource attributes, `key=value` pairs separated by commas, values percent-encoded
    /// (the format of `OTEL_RESOURCE_ATTRIBUTES`).
    pub resource_attributes: String,
    /// The share of new traces sampled, 0 to 1; a caller's sampled span is always followed,
    /// an unsampled one never.
    pub sampling_ratio: f64,
    /// Put the descriptors' entries (`key=value`) on spans; off by default, since values can
    /// be user identifiers.
    pub descriptor_values: bool,
    /// Longest descriptor value put on a span, in bytes (cut past it).
    pub max_value_bytes: usize,
    /// Most spans waiting for export; past it spans are dropped and counted.
    pub queue_size: usize,
    /// Most spans in one export.
    pub batch_size: usize,
    /// Longest a span waits for its batch to fill, in milliseconds.
    pub batch_delay_ms: u64,
    /// Longest one export may take, in milliseconds; its spans are dropped and counted past it.
    pub export_timeout_ms: u64,
    /// Longest shutdown waits for queued spans to be sent, in milliseconds.
    pub shutdown_timeout_ms: u64,
}

impl Default for TracingSection {
    fn default() -> Self {
        Self {
            enabled: false,
            protocol: Protocol::Grpc,
            endpoint: String::new(),
            service_name: String::new(),
            resource_attributes: String::new(),
            sampling_ratio: 1.0,
            descriptor_values: false,
            max_value_bytes: 64,
            queue_size: 2048,
            batch_size: 512,
            batch_delay_ms: 1_000,
            export_timeout_ms: 5_000,
            shutdown_timeout_ms: 2_000,
        }
    }
}

impl Default for Written {
    fn default() -> Self {
        Self {
            compat: Compat::None,
            grpc_addr: SocketAddr::from(([0, 0, 0, 0], 8081)),
            admin_addr: SocketAddr::from(([0, 0, 0, 0], 8080)),
            policy_source: PolicySource::Files,
            xds: XdsSection::default(),
            policies: PathBuf::from("config/policies"),
            policy_files: Files::Yaml,
            watch_policies: true,
            allow_empty_policies: false,
            merge_domains: false,
            log_format: LogFormat::Text,
            log_level: "info".into(),
            shadow_mode: false,
            quota_mode: false,
            response_headers: HeaderMode::None,
            legacy_headers: LegacyNames::default(),
            retry_after_jitter_seconds: 2,
            problem_body: false,
            response_dynamic_metadata: false,
            requests: RequestsSection::default(),
            store: StoreSection::default(),
            backend: BackendKind::Memory,
            on_backend_error: OnBackendError::Error,
            redis: RedisSection::default(),
            metrics: MetricsSection::default(),
            tracing: TracingSection::default(),
            drain_delay_ms: 0,
            shutdown_grace_ms: 10_000,
            grpc: GrpcSection::default(),
            admin: AdminSection::default(),
            rlqs: RlqsSection::default(),
            compat_warnings: Vec::new(),
            compat_set: Vec::new(),
        }
    }
}

impl Default for RequestsSection {
    fn default() -> Self {
        let caps = Caps::default();
        Self {
            max_request_bytes: 1 << 20,
            max_descriptors: caps.max_descriptors,
            max_entries: caps.max_entries,
            max_domain_bytes: caps.max_domain_bytes,
            max_key_bytes: caps.max_key_bytes,
            max_value_bytes: caps.max_value_bytes,
        }
    }
}

impl Default for StoreSection {
    fn default() -> Self {
        Self {
            max_keys: 1_000_000,
            sweep_interval_ms: 10_000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xds_header_values_stay_out_of_logs() {
        let mut w = Written {
            policy_source: PolicySource::Xds,
            ..Written::default()
        };
        w.xds
            .headers
            .insert("authorization".into(), "Bearer hunter2".into());
        assert!(!format!("{w:?}").contains("hunter2"));
        assert!(format!("{w:?}").contains("authorization"));
        let s = w.validate().unwrap();
        assert!(!format!("{s:?}").contains("hunter2"));
        assert!(format!("{s:?}").contains("authorization"));
    }

    #[test]
    fn redis_credentials_stay_out_of_logs() {
        let r = RedisSection {
            url: "redis://user:secret@10.0.0.5:6379,redis://10.0.0.6:6379".into(),
            password: "hunter2".into(),
            ..RedisSection::default()
        };
        assert_eq!(
            r.redacted_url(),
            "redis://***@10.0.0.5:6379,redis://10.0.0.6:6379"
        );
        assert!(!format!("{r:?}").contains("secret"));
        assert!(!format!("{r:?}").contains("hunter2"));
    }
}
