//! Process settings in two stages, as ripgrep does with its low and high arguments:
//! [`Written`] holds the values as written (`written`), filled in from defaults, a settings
//! file, the reference's variables under `compat`, `SLUICE_*` variables and [`Overrides`] from
//! the command line (`layers`); [`Written::validate`] checks them once (`validate`) and gives
//! [`Settings`], typed for the code that uses them, so nothing downstream converts units or
//! splits strings again. "Settings" are the process's knobs; "policies" the hot-reloadable rules.

mod compat;
mod layers;
mod summary;
mod token;
mod validate;
mod written;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use compat::{Compat, CompatError};
pub use layers::Overrides;
pub use token::{TokenError, WriteToken};
pub use written::{
    AdminSection, GrpcSection, GrpcTlsSection, LeaseSection, MetricsSection, PolicySource,
    RedisSection, RedisTlsSection, RequestsSection, SentinelSection, StoreSection, TracingSection,
    Written, XdsBackoffSection, XdsSection, XdsTlsSection,
};

use crate::decision;
use crate::limiter::redis::ConnectError;
use crate::limiter::{LeaseConfig, RedisConfig};
use crate::telemetry::LogFormat;

/// Where counters live, as the `backend` setting names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// In this process's memory.
    #[default]
    Memory,
    /// In Redis (single node or cluster), shared by every node pointed at it.
    Redis,
}

/// The validated process settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// gRPC listen address.
    pub grpc_addr: SocketAddr,
    /// HTTP admin listen address.
    pub admin_addr: SocketAddr,
    /// With `policy_source: xds`, the management server that pushes the policies; the policy
    /// directory is then neither read nor watched.
    pub xds: Option<XdsSettings>,
    /// Directory of policy files.
    pub policies: PathBuf,
    /// Which of its entries are policy files.
    pub policy_files: crate::policy::Files,
    /// Reload policies when files in the directory change (SIGHUP always reloads).
    pub watch_policies: bool,
    /// Accept a load that leaves no domain at all (otherwise refused, at startup and on reload).
    pub allow_empty_policies: bool,
    /// Merge policy files that name the same domain (otherwise refused).
    pub merge_domains: bool,
    /// Log format.
    pub log_format: LogFormat,
    /// Log level or filter directives; `RUST_LOG` wins when set.
    pub log_level: String,
    /// How requests are decided and answered.
    pub decision: decision::Options,
    /// Largest encoded request, in bytes (refused by the transport beyond this).
    pub max_request_bytes: usize,
    /// Where counters live.
    pub backend: BackendSettings,
    /// Leased counting of hot counters, when counting in Redis with `redis.lease.enabled`.
    pub lease: Option<LeaseConfig>,
    /// Degraded local mode (`on_backend_error: local`) with a Redis backend.
    pub local: LocalSettings,
    /// Most series whose labels carry request values.
    pub max_detailed_series: usize,
    /// The fraction of a bucket above which an admitted hit counts as `near_limit`.
    pub near_limit_ratio: f64,
    /// Keys shown per limited rule (`metrics.top_keys`).
    pub top_keys: usize,
    /// After a stop signal, how long to keep answering while health reports NOT_SERVING.
    pub drain_delay: Duration,
    /// How long shutdown then waits for in-flight calls.
    pub shutdown_grace: Duration,
    /// Bounds on the gRPC port's connections and streams.
    pub grpc: GrpcLimits,
    /// TLS on the gRPC port; `None` serves plaintext HTTP/2.
    pub grpc_tls: Option<GrpcTls>,
    /// Bounds on the admin port's connections.
    pub admin: AdminLimits,
    /// The metrics listener: its address and the path of the Prometheus text; `None` when
    /// `metrics.addr` is unset.
    pub metrics_listener: Option<(SocketAddr, String)>,
    /// The debug listener (`/rlconfig`); `None` when `admin.debug_addr` is unset.
    pub debug_addr: Option<SocketAddr>,
    /// Envoy's Rate Limit Quota Service; `None` when `rlqs.enabled` is false.
    pub rlqs: Option<crate::rlqs::RlqsSettings>,
    /// Trace export; `None` when `tracing.enabled` is false.
    pub tracing: Option<crate::traces::Config>,
    /// Reference variables (`compat`) read but not acted on, each with why: logged at
    /// startup as warnings.
    pub compat_warnings: Vec<String>,
    /// The settings the reference's variables (`compat`) set, by dotted name, for the log.
    pub compat_set: Vec<String>,
}

/// The xDS management server that pushes the policies, validated. Its `Debug` shows the
/// names of the extra headers, not their values (often credentials).
#[derive(Clone, PartialEq)]
pub struct XdsSettings {
    /// `host:port` of the server.
    pub authority: String,
    /// The host alone (the server name TLS checks, unless `tls.server_name` says otherwise).
    pub host: String,
    /// The node id.
    pub node_id: String,
    /// The node's metadata.
    pub node_metadata: std::collections::BTreeMap<String, String>,
    /// Extra gRPC metadata on the stream (names lowercase).
    pub headers: Vec<(String, String)>,
    /// Largest response accepted, in bytes.
    pub max_message_bytes: usize,
    /// Healthy before the first policies (envoyproxy/ratelimit's
    /// `FORCE_START_WITHOUT_INITIAL_CONFIG`).
    pub force_start: bool,
    /// The wait before each reconnection.
    pub backoff: XdsBackoff,
    /// TLS to the server; `None` is plaintext HTTP/2.
    pub tls: Option<XdsTls>,
}

impl std::fmt::Debug for XdsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdsSettings")
            .field("authority", &self.authority)
            .field("host", &self.host)
            .field("node_id", &self.node_id)
            .field("node_metadata", &self.node_metadata)
            .field(
                "headers",
                &self
                    .headers
                    .iter()
                    .map(|(k, _)| (k, "***"))
                    .collect::<Vec<_>>(),
            )
            .field("max_message_bytes", &self.max_message_bytes)
            .field("force_start", &self.force_start)
            .field("backoff", &self.backoff)
            .field("tls", &self.tls)
            .finish()
    }
}

/// gRPC's default largest message, taken when `xds.max_message_bytes` is 0.
pub const DEFAULT_XDS_MAX_MESSAGE_BYTES: usize = 4 << 20;

/// The wait before each reconnection to the xDS server (see [`XdsBackoffSection`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct XdsBackoff {
    /// The first wait.
    pub initial: Duration,
    /// The longest wait.
    pub max: Duration,
    /// How far a jittered wait may be from the computed one (0 to 1).
    pub random_factor: f64,
    /// Jitter the waits.
    pub jitter: bool,
}

/// TLS to the xDS server: files re-read at every connection, so rotated ones are picked up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XdsTls {
    /// Client certificate chain and key (PEM), when the server asks for one.
    pub client: Option<(PathBuf, PathBuf)>,
    /// CA certificates (PEM) trusted besides the system's roots.
    pub ca_file: Option<PathBuf>,
    /// The name the server's certificate must carry.
    pub server_name: String,
}

/// Bounds on the gRPC port: what one connection, and all of them, can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrpcLimits {
    /// Most connections open at once; one accepted past it is closed at once.
    pub max_connections: usize,
    /// Most concurrent streams per connection (`SETTINGS_MAX_CONCURRENT_STREAMS`).
    pub max_concurrent_streams: u32,
    /// Most bytes of request headers (`SETTINGS_MAX_HEADER_LIST_SIZE`).
    pub max_header_list_bytes: u32,
    /// Longest a call may take from its headers to its answer.
    pub request_timeout: Duration,
    /// Quiet time before an HTTP/2 PING.
    pub keepalive_interval: Duration,
    /// How long the PING's acknowledgement may take.
    pub keepalive_timeout: Duration,
    /// How long a connection may carry no request before it is closed; longer than
    /// `request_timeout`, so no call is ever cut.
    pub idle_timeout: Duration,
    /// How long a connection may stay open before it is sent a GOAWAY (±10 % jitter); `None`
    /// keeps it as long as the peer wants.
    pub max_connection_age: Option<Duration>,
    /// How long a connection past its age then has for its calls in flight before it is closed.
    pub max_connection_age_grace: Duration,
    /// Most answers held for their slot at once, over all connections.
    pub max_held_requests: usize,
    /// Most answers held for their slot at once on one connection.
    pub max_held_per_connection: usize,
    /// How long before the caller's deadline a held answer must be given.
    pub hold_deadline_margin: Duration,
}

/// TLS on the gRPC port: the files it is loaded from (and reloaded from when they change). The
/// `tls` module owns the type; settings only fill it in.
pub use crate::tls::TlsFiles as GrpcTls;

/// Bounds on the admin port, and who may write on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdminLimits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// Longest a connection may take to send a complete request head.
    pub header_read_timeout: Duration,
    /// The token writes (`POST /counters/reset`) must present; `None`: writes are off.
    pub write_token: Option<WriteToken>,
}

/// The chosen backend and its settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendSettings {
    /// Counters in this process's memory.
    Memory {
        /// Most counters held; past it a new counter evicts the one closest to expiry.
        max_keys: usize,
        /// How often counters with a full bucket (no information) are removed.
        sweep_interval: Duration,
    },
    /// Counters in Redis (boxed: its TLS and credential paths make it much the larger).
    Redis(Box<RedisConfig>),
}

/// How a node counts while Redis cannot decide (`on_backend_error: local`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalSettings {
    /// N when set (`redis.fleet_size`); otherwise learned from heartbeats.
    pub fleet_size: Option<u64>,
    /// How often this node records itself in Redis when N is learned.
    pub heartbeat_interval: Duration,
    /// Most counters in the local store (`store.max_keys`).
    pub max_keys: usize,
    /// How often the local store drops full buckets (`store.sweep_interval_ms`).
    pub sweep_interval: Duration,
}

/// The longest heartbeat interval: an hour (a fleet size learned more slowly is stale).
pub const MAX_HEARTBEAT_INTERVAL_MS: u64 = 3_600_000;

/// Why settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The layered sources could not be read or did not fit the schema.
    #[error("invalid settings: {0}")]
    Load(#[from] config::ConfigError),
    /// A reference variable (`compat`) that cannot be used.
    #[error(transparent)]
    Compat(#[from] CompatError),
    /// A value that must be positive is 0.
    #[error("invalid settings: {setting} must be at least 1")]
    Zero {
        /// The setting's dotted name.
        setting: &'static str,
    },
    /// A value past the most it may be.
    #[error("invalid settings: {setting} must be at most {max} ({why})")]
    TooLarge {
        /// The setting's dotted name.
        setting: &'static str,
        /// The most it may be.
        max: u64,
        /// Why.
        why: &'static str,
    },
    /// A value below the least it may be.
    #[error("invalid settings: {setting} must be at least {min} ({why})")]
    TooSmall {
        /// The setting's dotted name.
        setting: &'static str,
        /// The least it may be.
        min: u64,
        /// Why.
        why: &'static str,
    },
    /// `grpc.idle_timeout_ms` not longer than `grpc.request_timeout_ms`.
    #[error(
        "invalid settings: grpc.idle_timeout_ms must be longer than grpc.request_timeout_ms, so \
         no call is on a connection closed as idle"
    )]
    IdleBeforeRequestTimeout,
    /// A TLS setting that needs another one.
    #[error("invalid settings: {setting} needs {needs}")]
    TlsNeeds {
        /// The setting given.
        setting: &'static str,
        /// What it needs as well.
        needs: &'static str,
    },
    /// `metrics.path` that is not a plain absolute path.
    #[error(
        "invalid settings: metrics.path {0:?} must start with / and hold none of {{ }} * (a plain path)"
    )]
    MetricsPath(String),
    /// An `xds` setting that cannot be used.
    #[error("invalid settings: {setting} {value:?}: {why}")]
    Xds {
        /// The setting's dotted name.
        setting: &'static str,
        /// The value given.
        value: String,
        /// Why it cannot be used.
        why: String,
    },
    /// `metrics.top_keys` above [`crate::metrics::MAX_TOP_KEYS`].
    #[error("invalid settings: metrics.top_keys {0} is above {max}", max = crate::metrics::MAX_TOP_KEYS)]
    TopKeys(usize),
    /// `metrics.near_limit_ratio` outside 0..=1.
    #[error("invalid settings: metrics.near_limit_ratio {0} is not between 0 and 1")]
    NearLimitRatio(f64),
    /// `tracing.sampling_ratio` outside 0..=1.
    #[error("invalid settings: tracing.sampling_ratio {0} is not between 0 and 1")]
    SamplingRatio(f64),
    /// A `tracing` setting that cannot be used.
    #[error("invalid settings: {setting} {value:?}: {why}")]
    Tracing {
        /// The setting's dotted name (or the variable it came from).
        setting: &'static str,
        /// The value given.
        value: String,
        /// Why it cannot be used.
        why: &'static str,
    },
    /// A header name that HTTP does not allow.
    #[error("invalid settings: {setting} {name:?} is not an HTTP header name")]
    HeaderName {
        /// The setting's dotted name.
        setting: &'static str,
        /// The name given.
        name: String,
    },
    /// `redis.heartbeat_interval_ms` past [`MAX_HEARTBEAT_INTERVAL_MS`].
    #[error(
        "invalid settings: redis.heartbeat_interval_ms {0} is longer than an hour (3600000); a \
         fleet size learned that slowly is stale"
    )]
    HeartbeatInterval(u64),
    /// `backend: redis` without a URL.
    #[error("invalid settings: redis.url is empty")]
    NoRedisUrl,
    /// A `redis.lease` fraction out of its range.
    #[error("invalid settings: redis.lease.{setting} {value} is not {range}")]
    LeaseFraction {
        /// The setting's name under `redis.lease`.
        setting: &'static str,
        /// The value given.
        value: f64,
        /// The range it must be in, in words.
        range: &'static str,
    },
    /// Redis settings that cannot be used: contradicting credentials or TLS options, or a
    /// certificate, key or password file that cannot be read (named with its setting).
    #[error("invalid settings: {0}")]
    Redis(#[from] ConnectError),
    /// A Redis URL that does not parse.
    #[error("invalid settings: redis.url {url:?}: {source}")]
    RedisUrl {
        /// The URL, credentials redacted.
        url: String,
        /// Why it does not parse.
        source: ::redis::RedisError,
    },
    /// One of `redis.sentinel.master_name` and `redis.sentinel.urls` without the other.
    #[error(
        "invalid settings: {missing} is empty but {given} is set; set both for Redis Sentinel, or neither"
    )]
    SentinelIncomplete {
        /// The empty setting.
        missing: &'static str,
        /// The one that is set.
        given: &'static str,
    },
    /// Sentinel and cluster at once.
    #[error(
        "invalid settings: redis.sentinel and redis.cluster exclude each other (sentinels watch \
         one master; a cluster fails over by itself)"
    )]
    SentinelWithCluster,
    /// A sentinel URL that does not parse.
    #[error("invalid settings: redis.sentinel.urls {url:?}: {source}")]
    SentinelUrl {
        /// The URL, credentials redacted.
        url: String,
        /// Why it does not parse.
        source: ::redis::RedisError,
    },
    /// Several `redis.url`s with Sentinel, where it gives the master's credentials only.
    #[error(
        "invalid settings: redis.url has several URLs, but with redis.sentinel it is one URL \
         whose credentials, database and scheme reach the master the sentinels name"
    )]
    SentinelMasterUrl,
    /// `admin.write_token_file` that cannot be used.
    #[error("invalid settings: {0}")]
    WriteToken(#[from] TokenError),
}

impl Settings {
    /// Loads and validates settings: defaults, then `file` when given, then `SLUICE_*`
    /// variables, then `flags`.
    ///
    /// # Errors
    ///
    /// [`SettingsError`] when a source cannot be read, a field is unknown or mistyped, or a
    /// value is out of range.
    pub fn load(file: Option<&std::path::Path>, flags: &Overrides) -> Result<Self, SettingsError> {
        Written::load(file, flags)?.validate()
    }
}

impl Default for Settings {
    /// The built-in defaults, validated.
    fn default() -> Self {
        Written::default()
            .validate()
            .unwrap_or_else(|e| unreachable!("the built-in defaults are valid: {e}"))
    }
}
