//! What the Redis backend is configured with: where Redis is ([`RedisConfig`], with Sentinel's
//! [`SentinelConfig`]), TLS and credentials, and whose clock decides ([`RedisTime`]). Plain
//! values, validated by `connect`; their `Debug` hides every credential.

use std::path::PathBuf;
use std::time::Duration;

use crate::limiter::redis::redact::redact_all;

/// How to reach Redis and how hard to try. Its `Debug` hides credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisConfig {
    /// `redis://` URLs: one for a single node, the seed nodes for a cluster. With
    /// [`RedisConfig::sentinel`], one URL whose credentials, database and scheme the master is
    /// reached with (its host and port are replaced by the master's).
    pub urls: Vec<String>,
    /// Talk Redis Cluster.
    pub cluster: bool,
    /// Prefix of every key sluice writes.
    pub key_prefix: String,
    /// Deadline of one call (the whole request's round trip).
    pub timeout: Duration,
    /// Deadline of one connection attempt.
    pub connect_timeout: Duration,
    /// Consecutive failures that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long the open breaker answers without trying Redis.
    pub breaker_cooldown: Duration,
    /// Most counters kept in the local over-limit cache (0 disables it).
    pub deny_cache_keys: usize,
    /// Find the master through Redis Sentinel (never with `cluster`).
    pub sentinel: Option<SentinelConfig>,
    /// TLS files and options, for `rediss://` URLs.
    pub tls: RedisTls,
    /// Credentials kept out of the URLs.
    pub auth: RedisAuth,
}

impl RedisConfig {
    /// The URLs with any `user:password@` replaced by `***@`, comma-separated, for logs.
    #[must_use]
    pub fn redacted_urls(&self) -> String {
        redact_all(self.urls.iter().map(String::as_str))
    }

    /// What is connected to, for logs: the URLs, or the master's name and its sentinels;
    /// credentials redacted.
    #[must_use]
    pub fn describe(&self) -> String {
        match &self.sentinel {
            Some(s) => format!(
                "master {:?} via sentinels {}",
                s.master_name,
                s.redacted_urls()
            ),
            None => self.redacted_urls(),
        }
    }
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConfig")
            .field("urls", &self.redacted_urls())
            .field("cluster", &self.cluster)
            .field("key_prefix", &self.key_prefix)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("breaker_failures", &self.breaker_failures)
            .field("breaker_cooldown", &self.breaker_cooldown)
            .field("deny_cache_keys", &self.deny_cache_keys)
            .field("sentinel", &self.sentinel)
            .field("tls", &self.tls)
            .field("auth", &self.auth)
            .finish()
    }
}

/// Whose clock the script decides at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RedisTime {
    /// Redis `TIME`: one clock for every node sharing the budget.
    #[default]
    Server,
    /// The store's injected clock (tests drive time by hand).
    Clock,
}

/// TLS to Redis, for `rediss://` URLs. Paths only: the files are read when connecting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// PEM CA certificates that sign the server's certificate; the system's roots when unset.
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate (chain), for servers that require one (mTLS).
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    pub key_file: Option<PathBuf>,
    /// Accept a server certificate whose names do not match the host (hosted Redis reached by
    /// IP); its chain is still verified.
    pub skip_hostname_verification: bool,
}

impl RedisTls {
    /// Whether any TLS option is set (they need `rediss://` URLs).
    #[must_use]
    pub fn is_set(&self) -> bool {
        self.ca_file.is_some()
            || self.cert_file.is_some()
            || self.key_file.is_some()
            || self.skip_hostname_verification
    }
}

/// A password. Its `Debug` prints `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct Password(String);

impl Password {
    /// Wraps a password.
    #[must_use]
    pub fn new(password: impl Into<String>) -> Self {
        Self(password.into())
    }

    pub(super) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// Credentials kept out of the URL (an ACL user, a password or a file holding one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RedisAuth {
    /// ACL user; Redis's `default` user when unset.
    pub username: Option<String>,
    /// The password.
    pub password: Option<Password>,
    /// A file holding the password (a mounted Kubernetes Secret), read when connecting; one
    /// trailing newline is dropped.
    pub password_file: Option<PathBuf>,
}

/// Where the sentinels are and which master they watch. Its `Debug` hides credentials.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelConfig {
    /// The master's name, as the sentinels know it (`sentinel monitor <name> ...`).
    pub master_name: String,
    /// `redis://host:port` URLs of the sentinels, asked in this order.
    pub urls: Vec<String>,
    /// The sentinels' password, for those whose URL carries none.
    pub password: Option<String>,
}

impl SentinelConfig {
    /// The sentinel URLs with any `user:password@` replaced by `***@`, comma-separated.
    #[must_use]
    pub fn redacted_urls(&self) -> String {
        redact_all(self.urls.iter().map(String::as_str))
    }
}

impl std::fmt::Debug for SentinelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelConfig")
            .field("master_name", &self.master_name)
            .field("urls", &self.redacted_urls())
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}
