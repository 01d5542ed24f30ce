//! Process settings and the command line, in two stages (as ripgrep does with its low and high
//! arguments): [`RawSettings`] holds the values as written, merged from defaults, a settings
//! file, `SLUICE_*` variables and flags; [`RawSettings::validate`] checks them once and gives
//! [`Settings`], typed for the code that uses them (durations, addresses, the decision layer's
//! own options, the backend's own config), so nothing downstream converts units or splits
//! strings again. Secrets stay out of `Debug` and logs.
//!
//! "Settings" are the process's knobs; "policies" are the hot-reloadable rules (`policy`).

mod cli;
mod compat;
mod raw;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

pub use cli::{CheckArgs, Cli, Command, ProbeArgs, ReplayArgs, ServeArgs};
pub use compat::{Compat, CompatError};
pub use raw::{
    MetricsSettings, RawSettings, RedisSettings, RedisTlsSettings, RequestSettings, StoreSettings,
};

use crate::decision::{self, Caps, HeaderOptions};
use crate::limiter::RedisConfig;
use crate::limiter::redis::{ConnectError, Password, RedisAuth, RedisTls};
use crate::telemetry::LogFormat;

/// Where counters live, as the `backend` setting names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
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
    /// Directory of policy files.
    pub policies: PathBuf,
    /// Which of its entries are policy files.
    pub policy_files: crate::policy::Files,
    /// Reload policies when files in the directory change (SIGHUP always reloads).
    pub watch_policies: bool,
    /// Accept a load that leaves no domain at all (otherwise refused, at startup and on reload).
    pub allow_empty_policies: bool,
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
    /// Most series whose labels carry request values.
    pub max_detailed_series: usize,
    /// The fraction of a bucket above which an admitted hit counts as `near_limit`.
    pub near_limit_ratio: f64,
    /// After a stop signal, how long to keep answering while health reports NOT_SERVING.
    pub drain_delay: Duration,
    /// How long shutdown then waits for in-flight calls.
    pub shutdown_grace: Duration,
    /// Bounds on the gRPC port's connections and streams.
    pub grpc: GrpcLimits,
    /// Bounds on the admin port's connections.
    pub admin: AdminLimits,
    /// Reference variables (`compat`) read but not acted on, each with why: logged at
    /// startup as warnings.
    pub compat_warnings: Vec<String>,
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
}

/// Bounds on the admin port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdminLimits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// Longest a connection may take to send a complete request head.
    pub header_read_timeout: Duration,
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
    /// `grpc.idle_timeout_ms` not longer than `grpc.request_timeout_ms`.
    #[error(
        "invalid settings: grpc.idle_timeout_ms must be longer than grpc.request_timeout_ms, so \
         no call is on a connection closed as idle"
    )]
    IdleBeforeRequestTimeout,
    /// `metrics.near_limit_ratio` outside 0..=1.
    #[error("invalid settings: metrics.near_limit_ratio {0} is not between 0 and 1")]
    NearLimitRatio(f64),
    /// A header name that HTTP does not allow.
    #[error("invalid settings: {setting} {name:?} is not an HTTP header name")]
    HeaderName {
        /// The setting's dotted name.
        setting: &'static str,
        /// The name given.
        name: String,
    },
    /// `backend: redis` without a URL.
    #[error("invalid settings: redis.url is empty")]
    NoRedisUrl,
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
}

impl Settings {
    /// Loads and validates settings: defaults, then `file` when given, then `SLUICE_*`
    /// variables, then `flags`.
    ///
    /// # Errors
    ///
    /// [`SettingsError`] when a source cannot be read, a field is unknown or mistyped, or a
    /// value is out of range.
    pub fn load(file: Option<&std::path::Path>, flags: &ServeArgs) -> Result<Self, SettingsError> {
        RawSettings::load(file, flags)?.validate()
    }
}

impl Default for Settings {
    /// The built-in defaults, validated.
    fn default() -> Self {
        RawSettings::default()
            .validate()
            .unwrap_or_else(|e| unreachable!("the built-in defaults are valid: {e}"))
    }
}

impl RawSettings {
    /// Checks every value and gives the typed settings.
    ///
    /// # Errors
    ///
    /// [`SettingsError`] naming the first value out of range.
    pub fn validate(self) -> Result<Settings, SettingsError> {
        let r = &self.requests;
        let positive = |setting: &'static str, value: u64| {
            if value == 0 {
                Err(SettingsError::Zero { setting })
            } else {
                Ok(())
            }
        };
        for (setting, value) in [
            ("requests.max_request_bytes", r.max_request_bytes),
            ("requests.max_descriptors", r.max_descriptors),
            ("requests.max_entries", r.max_entries),
            ("requests.max_domain_bytes", r.max_domain_bytes),
            ("requests.max_key_bytes", r.max_key_bytes),
            ("requests.max_value_bytes", r.max_value_bytes),
            ("store.max_keys", self.store.max_keys),
        ] {
            positive(setting, value as u64)?;
        }
        let g = &self.grpc;
        for (setting, value) in [
            ("store.sweep_interval_ms", self.store.sweep_interval_ms),
            ("grpc.max_connections", g.max_connections as u64),
            (
                "grpc.max_concurrent_streams",
                u64::from(g.max_concurrent_streams),
            ),
            (
                "grpc.max_header_list_bytes",
                u64::from(g.max_header_list_bytes),
            ),
            ("grpc.request_timeout_ms", g.request_timeout_ms),
            ("grpc.keepalive_interval_ms", g.keepalive_interval_ms),
            ("grpc.keepalive_timeout_ms", g.keepalive_timeout_ms),
            ("grpc.idle_timeout_ms", g.idle_timeout_ms),
            ("admin.max_connections", self.admin.max_connections as u64),
            (
                "admin.header_read_timeout_ms",
                self.admin.header_read_timeout_ms,
            ),
        ] {
            positive(setting, value)?;
        }
        if g.idle_timeout_ms <= g.request_timeout_ms {
            return Err(SettingsError::IdleBeforeRequestTimeout);
        }
        let ratio = self.metrics.near_limit_ratio;
        if !(0.0..=1.0).contains(&ratio) {
            return Err(SettingsError::NearLimitRatio(ratio));
        }
        for (setting, name) in [
            ("legacy_headers.limit", &self.legacy_headers.limit),
            ("legacy_headers.remaining", &self.legacy_headers.remaining),
            ("legacy_headers.reset", &self.legacy_headers.reset),
        ] {
            if !is_header_name(name) {
                return Err(SettingsError::HeaderName {
                    setting,
                    name: name.clone(),
                });
            }
        }
        positive("redis.timeout_ms", self.redis.timeout_ms)?;
        positive("redis.connect_timeout_ms", self.redis.connect_timeout_ms)?;
        let backend = match self.backend {
            BackendKind::Memory => BackendSettings::Memory {
                max_keys: self.store.max_keys,
                sweep_interval: Duration::from_millis(self.store.sweep_interval_ms),
            },
            BackendKind::Redis => BackendSettings::Redis(Box::new(redis_config(&self.redis)?)),
        };
        Ok(Settings {
            grpc_addr: self.grpc_addr,
            admin_addr: self.admin_addr,
            policies: self.policies,
            policy_files: self.policy_files,
            watch_policies: self.watch_policies,
            allow_empty_policies: self.allow_empty_policies,
            log_format: self.log_format,
            log_level: self.log_level,
            decision: decision::Options {
                caps: Caps {
                    max_descriptors: r.max_descriptors,
                    max_entries: r.max_entries,
                    max_domain_bytes: r.max_domain_bytes,
                    max_key_bytes: r.max_key_bytes,
                    max_value_bytes: r.max_value_bytes,
                },
                shadow_mode: self.shadow_mode,
                on_backend_error: self.on_backend_error,
                headers: HeaderOptions {
                    mode: self.response_headers,
                    legacy_names: self.legacy_headers,
                    retry_after_jitter_seconds: self.retry_after_jitter_seconds,
                    problem_body: self.problem_body,
                },
            },
            max_request_bytes: r.max_request_bytes,
            backend,
            max_detailed_series: self.metrics.max_detailed_series,
            near_limit_ratio: self.metrics.near_limit_ratio,
            drain_delay: Duration::from_millis(self.drain_delay_ms),
            shutdown_grace: Duration::from_millis(self.shutdown_grace_ms),
            grpc: GrpcLimits {
                max_connections: g.max_connections,
                max_concurrent_streams: g.max_concurrent_streams,
                max_header_list_bytes: g.max_header_list_bytes,
                request_timeout: Duration::from_millis(g.request_timeout_ms),
                keepalive_interval: Duration::from_millis(g.keepalive_interval_ms),
                keepalive_timeout: Duration::from_millis(g.keepalive_timeout_ms),
                idle_timeout: Duration::from_millis(g.idle_timeout_ms),
            },
            admin: AdminLimits {
                max_connections: self.admin.max_connections,
                header_read_timeout: Duration::from_millis(self.admin.header_read_timeout_ms),
            },
            compat_warnings: self.compat_warnings,
        })
    }
}

/// An HTTP field name: one or more token characters (RFC 9110, 5.1 and 5.6.2).
fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// The Redis backend's config: the URL list split and each URL parsed once, here.
fn redis_config(r: &RedisSettings) -> Result<RedisConfig, SettingsError> {
    let urls: Vec<String> = r
        .url
        .split(',')
        .map(|u| u.trim().to_string())
        .filter(|u| !u.is_empty())
        .collect();
    if urls.is_empty() {
        return Err(SettingsError::NoRedisUrl);
    }
    for url in &urls {
        ::redis::IntoConnectionInfo::into_connection_info(url.as_str()).map_err(|source| {
            SettingsError::RedisUrl {
                url: crate::limiter::redis::redact(url),
                source,
            }
        })?;
    }
    let path = |p: &str| (!p.trim().is_empty()).then(|| PathBuf::from(p.trim()));
    let config = RedisConfig {
        urls,
        tls: RedisTls {
            ca_file: path(&r.tls.ca_file),
            cert_file: path(&r.tls.cert_file),
            key_file: path(&r.tls.key_file),
            skip_hostname_verification: r.tls.skip_hostname_verification,
        },
        auth: RedisAuth {
            username: (!r.username.is_empty()).then(|| r.username.clone()),
            password: (!r.password.is_empty()).then(|| Password::new(r.password.clone())),
            password_file: path(&r.password_file),
        },
        cluster: r.cluster,
        key_prefix: r.key_prefix.clone(),
        timeout: Duration::from_millis(r.timeout_ms),
        connect_timeout: Duration::from_millis(r.connect_timeout_ms),
        breaker_failures: r.breaker_failures,
        breaker_cooldown: Duration::from_millis(r.breaker_cooldown_ms),
        deny_cache_keys: r.deny_cache_keys,
    };
    // The files are read here too, so `sluice check` reports one that cannot be used.
    crate::limiter::redis::check(&config)?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redis(url: &str) -> RawSettings {
        RawSettings {
            backend: BackendKind::Redis,
            redis: RedisSettings {
                url: url.into(),
                ..RedisSettings::default()
            },
            ..RawSettings::default()
        }
    }

    #[test]
    fn values_out_of_range_name_the_setting() {
        let mut raw = RawSettings::default();
        raw.requests.max_entries = 0;
        let err = raw.validate().unwrap_err().to_string();
        assert_eq!(
            err,
            "invalid settings: requests.max_entries must be at least 1"
        );
        assert!(matches!(
            redis(" , ").validate(),
            Err(SettingsError::NoRedisUrl)
        ));
        let err = redis("redis://user:secret@[::1:6379")
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("invalid settings: redis.url"), "{err}");
        assert!(!err.contains("secret"), "{err}");
    }

    #[test]
    fn redis_files_and_contradictions_are_checked_naming_the_setting() {
        let mut raw = redis("rediss://10.0.0.5:6380");
        raw.redis.tls.ca_file = "/nonexistent/ca.pem".into();
        let err = raw.validate().unwrap_err().to_string();
        assert!(
            err.starts_with(
                "invalid settings: redis.tls.ca_file /nonexistent/ca.pem: cannot be read"
            ),
            "{err}"
        );
        let mut raw = redis("redis://10.0.0.5:6379");
        raw.redis.tls.skip_hostname_verification = true;
        let err = raw.validate().unwrap_err().to_string();
        assert!(err.contains("not rediss://"), "{err}");
        let mut raw = redis("redis://10.0.0.5:6379");
        raw.redis.username = "sluice".into();
        raw.redis.password = "hunter2".into();
        let s = raw.validate().unwrap();
        let BackendSettings::Redis(redis) = &s.backend else {
            panic!("redis backend expected")
        };
        assert_eq!(redis.auth.username.as_deref(), Some("sluice"));
        assert!(redis.auth.password.is_some());
        assert!(!format!("{s:?}").contains("hunter2"));
    }

    #[test]
    fn header_names_and_the_near_limit_ratio_are_checked() {
        let mut raw = RawSettings::default();
        raw.legacy_headers.remaining = "X-Left".into();
        raw.metrics.near_limit_ratio = 0.5;
        let s = raw.clone().validate().unwrap();
        assert_eq!(s.decision.headers.legacy_names.remaining, "X-Left");
        assert!((s.near_limit_ratio - 0.5).abs() < f64::EPSILON);
        raw.legacy_headers.reset = "Bad Name".into();
        let err = raw.clone().validate().unwrap_err().to_string();
        assert!(err.contains("legacy_headers.reset"), "{err}");
        raw.legacy_headers.reset = "x".into();
        raw.metrics.near_limit_ratio = 1.5;
        let err = raw.validate().unwrap_err().to_string();
        assert!(err.contains("metrics.near_limit_ratio"), "{err}");
    }

    #[test]
    fn validation_types_every_value() {
        let mut raw = redis("redis://a:6379, redis://b:6380,");
        raw.redis.timeout_ms = 7;
        raw.drain_delay_ms = 1_500;
        raw.requests.max_descriptors = 3;
        let s = raw.validate().unwrap();
        let BackendSettings::Redis(redis) = &s.backend else {
            panic!("redis backend expected")
        };
        assert_eq!(redis.urls, ["redis://a:6379", "redis://b:6380"]);
        assert_eq!(redis.timeout, Duration::from_millis(7));
        assert_eq!(s.drain_delay, Duration::from_millis(1_500));
        assert_eq!(s.decision.caps.max_descriptors, 3);
        let memory = Settings::default();
        assert_eq!(
            memory.backend,
            BackendSettings::Memory {
                max_keys: 1_000_000,
                sweep_interval: Duration::from_secs(10)
            }
        );
    }
}
