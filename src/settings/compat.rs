//! `compat: envoy-ratelimit`: the environment variables of envoyproxy/ratelimit read as sluice
//! settings, so a Deployment written for it runs unchanged. [`from_env`] is a pure function
//! from the variables to setting overrides (dotted setting names and values) plus warnings for
//! what is read but not offered; [`super::Written::load`] layers the overrides between the
//! settings file and `SLUICE_*`, so `SLUICE_*` variables and flags win. The reference's default
//! backend, Redis, where sluice's is memory, goes beneath the settings file instead: an unset
//! `BACKEND_TYPE` says less than a file that names a backend.
//!
//! Compatibility is opt-in: without it none of these names is read, so a stray `PORT` in a
//! shell never moves a listener. A value that cannot be read is an error naming the variable;
//! a variable asking for something sluice cannot do without changing decisions or security
//! (statsd aside) is an error too, never a silent ignore. Unset variables leave sluice's own
//! settings alone, except where the reference builds one setting from several variables (an
//! address from `HOST` and `PORT`, the policy directory from the three `RUNTIME_*`), where the
//! missing parts take the reference's defaults.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use serde_json::{Value, json};

/// Which other service's environment is read as settings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Compat {
    /// None: only `SLUICE_*` variables are read.
    #[default]
    None,
    /// envoyproxy/ratelimit's variables (`PORT`, `RUNTIME_ROOT`, `REDIS_URL`, ...).
    EnvoyRatelimit,
}

/// A variable of the reference whose value cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("invalid settings: {variable}: {reason}")]
pub struct CompatError {
    /// The variable.
    pub variable: &'static str,
    /// Why (with the value, unless it is a secret).
    pub reason: String,
}

/// What the reference's variables say, as sluice settings.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Mapped {
    /// Setting overrides from the variables that are set, nested as the settings file is: above
    /// the settings file.
    pub overrides: serde_json::Map<String, Value>,
    /// The reference's defaults for variables left unset, where they differ from sluice's
    /// (its backend is Redis): beneath the settings file, which says more than an unset
    /// variable does.
    pub defaults: serde_json::Map<String, Value>,
    /// Variables read but not acted on, each with why, for the log.
    pub warnings: Vec<String>,
    /// With no Redis variable set: the reference's default socket, which deserves a warning if
    /// it is still the Redis counted in once every source is layered.
    pub default_socket: Option<String>,
}

impl Mapped {
    /// Sets the setting at dotted `name`.
    fn set(&mut self, name: &str, value: Value) {
        insert(&mut self.overrides, name, value);
    }

    /// Sets the setting at dotted `name` beneath the settings file.
    fn beneath(&mut self, name: &str, value: Value) {
        insert(&mut self.defaults, name, value);
    }

    fn warn(&mut self, text: String) {
        self.warnings.push(text);
    }
}

/// Inserts `value` at dotted `name` in `map`, making the maps on the way.
fn insert(map: &mut serde_json::Map<String, Value>, name: &str, value: Value) {
    let mut parts: Vec<&str> = name.split('.').collect();
    let last = parts.pop().unwrap_or_default();
    let mut map = map;
    for part in parts {
        let entry = map
            .entry(part.to_string())
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if !entry.is_object() {
            *entry = Value::Object(serde_json::Map::new());
        }
        let Value::Object(inner) = entry else {
            unreachable!("made an object just above")
        };
        map = inner;
    }
    map.insert(last.to_string(), value);
}

/// The reference's defaults, where its settings combine several variables.
const DEFAULT_HOST: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
const DEFAULT_PORT: u16 = 8080;
const DEFAULT_GRPC_PORT: u16 = 8081;
const DEFAULT_RUNTIME_ROOT: &str = "/srv/runtime_data/current";
const DEFAULT_APPDIRECTORY: &str = "config";
const DEFAULT_REDIS_URL: &str = "/var/run/nutcracker/ratelimit.sock";

/// The reference's variables in `vars` as sluice settings.
///
/// # Errors
///
/// [`CompatError`] naming the first variable whose value cannot be read, or that asks for
/// something sluice does not offer yet and cannot ignore.
pub(super) fn from_env(vars: &BTreeMap<String, String>) -> Result<Mapped, CompatError> {
    let env = Env(vars);
    let mut m = Mapped::default();
    listeners(&env, &mut m)?;
    logging(&env, &mut m)?;
    runtime(&env, &mut m)?;
    backend(&env, &mut m)?;
    decisions(&env, &mut m)?;
    observability(&env, &mut m)?;
    grpc(&env, &mut m)?;
    unsupported(&env)?;
    Ok(m)
}

/// The variables, with typed reads that name the variable on failure.
struct Env<'a>(&'a BTreeMap<String, String>);

impl Env<'_> {
    /// The value, trimmed; `None` when unset or empty (the reference's envconfig treats an
    /// empty value as unset).
    fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(|v| v.trim()).filter(|v| !v.is_empty())
    }

    /// A boolean as Go's `strconv.ParseBool` reads it.
    fn bool(&self, name: &'static str) -> Result<Option<bool>, CompatError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        match v {
            "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(Some(true)),
            "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(Some(false)),
            _ => Err(bad(name, v, "not a boolean (true or false)")),
        }
    }

    fn parse<T: std::str::FromStr>(
        &self,
        name: &'static str,
        what: &str,
    ) -> Result<Option<T>, CompatError> {
        self.get(name)
            .map(|v| v.parse().map_err(|_| bad(name, v, what)))
            .transpose()
    }

    fn any_set(&self, names: &[&str]) -> bool {
        names.iter().any(|n| self.get(n).is_some())
    }
}

fn bad(variable: &'static str, value: &str, why: &str) -> CompatError {
    CompatError {
        variable,
        reason: format!("{value:?} is {why}"),
    }
}

fn unsupported_error(variable: &'static str, why: &str) -> CompatError {
    CompatError {
        variable,
        reason: why.to_string(),
    }
}

/// `HOST`:`PORT` (the HTTP port: sluice's admin port) and `GRPC_HOST`:`GRPC_PORT`.
fn listeners(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    for (host, port, default_port, setting) in [
        ("HOST", "PORT", DEFAULT_PORT, "admin_addr"),
        ("GRPC_HOST", "GRPC_PORT", DEFAULT_GRPC_PORT, "grpc_addr"),
    ] {
        if !env.any_set(&[host, port]) {
            continue;
        }
        let ip = match env.get(host) {
            None => DEFAULT_HOST,
            Some("localhost") => IpAddr::V4(Ipv4Addr::LOCALHOST),
            Some(v) => v
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse()
                .map_err(|_| bad(host, v, "not an IP address (or localhost)"))?,
        };
        let port = env
            .parse::<u16>(port, "not a port number (0 to 65535)")?
            .unwrap_or(default_port);
        m.set(setting, json!(SocketAddr::new(ip, port).to_string()));
    }
    if env.any_set(&["DEBUG_HOST", "DEBUG_PORT"]) {
        m.warn(
            "DEBUG_HOST/DEBUG_PORT: there is no separate debug port; the admin port (HOST:PORT) \
             serves /healthcheck, /json, /metrics and the loaded policies"
                .into(),
        );
    }
    Ok(())
}

/// `LOG_LEVEL` (logrus names) and `LOG_FORMAT`.
fn logging(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    if let Some(v) = env.get("LOG_LEVEL") {
        let level = match v.to_ascii_lowercase().as_str() {
            "trace" => "trace",
            "debug" => "debug",
            "info" => "info",
            "warn" | "warning" => "warn",
            "error" | "fatal" | "panic" => "error",
            _ => {
                return Err(bad(
                    "LOG_LEVEL",
                    v,
                    "not a log level (trace, debug, info, warn, error, fatal, panic)",
                ));
            }
        };
        m.set("log_level", json!(level));
    }
    if let Some(v) = env.get("LOG_FORMAT") {
        let format = match v.to_ascii_lowercase().as_str() {
            "json" => "json",
            "text" => "text",
            _ => return Err(bad("LOG_FORMAT", v, "not a log format (json or text)")),
        };
        m.set("log_format", json!(format));
    }
    Ok(())
}

/// The policy directory `RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY`, read as the
/// reference reads it: every file whatever its extension, dot files too unless
/// `RUNTIME_IGNOREDOTFILES`. Both of its reload modes (`RUNTIME_WATCH_ROOT`: a symlink swap of
/// the root, or changes in the directory) are followed by sluice's one watcher, which sees
/// either. `MERGE_DOMAIN_CONFIG` (read with or without the layout) is `merge_domains`.
fn runtime(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    let layout = [
        "RUNTIME_ROOT",
        "RUNTIME_SUBDIRECTORY",
        "RUNTIME_APPDIRECTORY",
        "RUNTIME_IGNOREDOTFILES",
        "RUNTIME_WATCH_ROOT",
    ];
    // Read whatever the layout: files of one domain may be merged in sluice's own directory.
    if let Some(merge) = env.bool("MERGE_DOMAIN_CONFIG")? {
        m.set("merge_domains", json!(merge));
    }
    if !env.any_set(&layout) {
        return Ok(());
    }
    let mut dir = PathBuf::from(env.get("RUNTIME_ROOT").unwrap_or(DEFAULT_RUNTIME_ROOT));
    if let Some(sub) = env.get("RUNTIME_SUBDIRECTORY") {
        dir.push(sub);
    }
    dir.push(
        env.get("RUNTIME_APPDIRECTORY")
            .unwrap_or(DEFAULT_APPDIRECTORY),
    );
    m.set("policies", json!(dir));
    let ignore_dot = env.bool("RUNTIME_IGNOREDOTFILES")?.unwrap_or(false);
    m.set(
        "policy_files",
        json!(if ignore_dot { "visible" } else { "all" }),
    );
    // Either mode: sluice's watcher (`watch_policies`) watches the directory and its parent
    // and re-scans it, which follows a swapped root and changed files alike.
    env.bool("RUNTIME_WATCH_ROOT")?;
    Ok(())
}

/// `BACKEND_TYPE`, `REDIS_TYPE`, `REDIS_SOCKET_TYPE`, `REDIS_URL`, `REDIS_AUTH`,
/// `REDIS_SENTINEL_AUTH`, `REDIS_TLS` and its certificate variables, `CACHE_KEY_PREFIX`,
/// `LOCAL_CACHE_SIZE_IN_BYTES`.
fn backend(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    match env
        .get("BACKEND_TYPE")
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        // Unset is the reference's default, Redis: a Deployment that names only `REDIS_URL`
        // shares its budgets, as it did, instead of counting alone on every replica. A
        // settings file that names a backend says more, and wins.
        None => m.beneath("backend", json!("redis")),
        Some("redis") => m.set("backend", json!("redis")),
        Some("memcache") => {
            return Err(unsupported_error(
                "BACKEND_TYPE",
                "memcache is not supported; use redis (or set SLUICE_BACKEND=memory for \
                 counters in memory on each node)",
            ));
        }
        Some(_) => {
            return Err(bad(
                "BACKEND_TYPE",
                env.get("BACKEND_TYPE").unwrap_or_default(),
                "not a backend (redis)",
            ));
        }
    }
    let redis_vars = [
        "REDIS_TYPE",
        "REDIS_SENTINEL_AUTH",
        "REDIS_SOCKET_TYPE",
        "REDIS_URL",
        "REDIS_AUTH",
        "REDIS_TLS",
    ];
    let target = redis_urls(env)?;
    if env.any_set(&redis_vars) {
        m.set("redis.url", json!(target.url));
        m.set("redis.cluster", json!(target.cluster));
        if let Some((master_name, sentinels)) = target.sentinel {
            m.set("redis.sentinel.master_name", json!(master_name));
            m.set("redis.sentinel.urls", json!(sentinels));
        } else if env.get("REDIS_SENTINEL_AUTH").is_some() {
            m.warn("REDIS_SENTINEL_AUTH: not read without REDIS_TYPE=sentinel".into());
        }
    } else {
        // Nothing names Redis: the reference's default socket, beneath a file that names
        // one, and a word in the log if it is kept.
        m.beneath("redis.url", json!(target.url));
        m.beneath("redis.cluster", json!(target.cluster));
        m.default_socket = Some(target.url);
    }
    // Empty is the reference's default (no prefix); sluice keeps its own then.
    if let Some(prefix) = env.get("CACHE_KEY_PREFIX") {
        m.set("redis.key_prefix", json!(prefix));
    }
    if let Some(bytes) = env.parse::<u64>("LOCAL_CACHE_SIZE_IN_BYTES", "not a number of bytes")? {
        if bytes == 0 {
            m.set("redis.deny_cache_keys", json!(0));
        } else {
            m.warn(
                "LOCAL_CACHE_SIZE_IN_BYTES: the local over-limit cache is sized in counters, \
                 not bytes (redis.deny_cache_keys, SLUICE_REDIS__DENY_CACHE_KEYS); its own \
                 size is kept"
                    .into(),
            );
        }
    }
    redis_auth(env, m);
    redis_tls(env, m)?;
    if env.bool("REDIS_PERSECOND")? == Some(true) {
        m.warn(
            "REDIS_PERSECOND=true: one Redis holds every counter (REDIS_URL); the \
             REDIS_PERSECOND_* variables are not read"
                .into(),
        );
    }
    if env.get("REDIS_POOL_SIZE").is_some() {
        m.warn(
            "REDIS_POOL_SIZE: not read; sluice multiplexes calls over one connection per node"
                .into(),
        );
    }
    Ok(())
}

/// Where the reference's variables point sluice's Redis.
struct RedisTarget {
    /// `redis.url`: comma-separated URLs; with Sentinel, the master's credentials only.
    url: String,
    /// `redis.cluster`.
    cluster: bool,
    /// `redis.sentinel.master_name` and `redis.sentinel.urls`.
    sentinel: Option<(String, String)>,
}

/// `user:password@` (or `:password@`) for a URL, each part percent-encoded.
fn userinfo(auth: &str) -> String {
    let enc = |s: &str| {
        percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    match auth.split_once(':') {
        Some((user, password)) => format!("{}:{}@", enc(user), enc(password)),
        None => format!(":{}@", enc(auth)),
    }
}

/// `host:port` checked, for `REDIS_URL`.
fn host_port(item: &str) -> Result<(), CompatError> {
    if item.contains("://") {
        return Err(bad(
            "REDIS_URL",
            &crate::limiter::redis::redact(item),
            "a URL; envoyproxy/ratelimit takes host:port (or a socket path with \
             REDIS_SOCKET_TYPE=unix); for a URL set SLUICE_REDIS__URL instead",
        ));
    }
    if item
        .rsplit_once(':')
        .is_none_or(|(_, p)| p.parse::<u16>().is_err())
    {
        return Err(bad("REDIS_URL", item, "not host:port"));
    }
    Ok(())
}

/// `REDIS_AUTH`, `password` or `user:password`, as `redis.password` (and `redis.username`),
/// out of the URL.
fn redis_auth(env: &Env<'_>, m: &mut Mapped) {
    let Some(auth) = env.get("REDIS_AUTH") else {
        return;
    };
    match auth.split_once(':') {
        Some((user, password)) if !user.is_empty() => {
            m.set("redis.username", json!(user));
            m.set("redis.password", json!(password));
        }
        Some((_, password)) => m.set("redis.password", json!(password)),
        None => m.set("redis.password", json!(auth)),
    }
}

/// With `REDIS_TLS=true` (the URLs made `rediss://` by [`redis_urls`]), the certificate
/// variables as `redis.tls.*`; without it the reference does not read them, and neither does
/// sluice (a warning says so).
fn redis_tls(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    let files = [
        ("REDIS_TLS_CACERT", "redis.tls.ca_file"),
        ("REDIS_TLS_CLIENT_CERT", "redis.tls.cert_file"),
        ("REDIS_TLS_CLIENT_KEY", "redis.tls.key_file"),
    ];
    let skip = env.bool("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION")?;
    if env.bool("REDIS_TLS")? == Some(true) {
        for (variable, setting) in files {
            if let Some(path) = env.get(variable) {
                m.set(setting, json!(path));
            }
        }
        if let Some(skip) = skip {
            m.set("redis.tls.skip_hostname_verification", json!(skip));
        }
    } else {
        for (variable, _) in files {
            if env.get(variable).is_some() {
                m.warn(format!(
                    "{variable}: read only with REDIS_TLS=true; not read"
                ));
            }
        }
        if skip == Some(true) {
            m.warn(
                "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION: read only with REDIS_TLS=true; not read"
                    .into(),
            );
        }
    }
    Ok(())
}

/// `REDIS_TYPE=sentinel`: `REDIS_URL` is `master_name,host:port,...` (the sentinels), with
/// `REDIS_SENTINEL_AUTH` folded into the sentinels' URLs. The master's credentials are
/// `REDIS_AUTH`'s (see [`redis_auth`]) and its scheme `REDIS_TLS`'s (`redis.url`, whose host
/// and port the sentinels' answer replaces).
fn sentinel_target(env: &Env<'_>, unix: bool, tls: bool) -> Result<RedisTarget, CompatError> {
    if unix {
        return Err(unsupported_error(
            "REDIS_SOCKET_TYPE",
            "unix with REDIS_TYPE=sentinel: sentinels and the master they name are reached \
             over tcp; set REDIS_SOCKET_TYPE=tcp",
        ));
    }
    let raw = env.get("REDIS_URL").unwrap_or(DEFAULT_REDIS_URL);
    let items: Vec<&str> = raw
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let [master_name, sentinels @ ..] = items.as_slice() else {
        return Err(bad("REDIS_URL", raw, "empty"));
    };
    if sentinels.is_empty() {
        return Err(bad(
            "REDIS_URL",
            raw,
            "not master_name,host:port,... (a master name and at least one sentinel) for \
             REDIS_TYPE=sentinel",
        ));
    }
    let sentinel_auth = env.get("REDIS_SENTINEL_AUTH").map(userinfo);
    let mut urls = Vec::with_capacity(sentinels.len());
    for item in sentinels {
        host_port(item)?;
        urls.push(format!(
            "redis://{}{item}",
            sentinel_auth.as_deref().unwrap_or("")
        ));
    }
    Ok(RedisTarget {
        url: format!("{}://127.0.0.1:6379", if tls { "rediss" } else { "redis" }),
        cluster: false,
        sentinel: Some(((*master_name).to_string(), urls.join(","))),
    })
}

/// `REDIS_URL` in each of the reference's forms, with `REDIS_AUTH`, `REDIS_SENTINEL_AUTH` and
/// `REDIS_TLS` folded in: sluice's comma-separated `redis://` URLs, whether they are a
/// cluster's seeds, and the master name and sentinels with `REDIS_TYPE=sentinel`.
fn redis_urls(env: &Env<'_>) -> Result<RedisTarget, CompatError> {
    let (cluster, sentinel) = match env
        .get("REDIS_TYPE")
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        None | Some("single") => (false, false),
        Some("cluster") => (true, false),
        Some("sentinel") => (false, true),
        Some(_) => {
            return Err(bad(
                "REDIS_TYPE",
                env.get("REDIS_TYPE").unwrap_or_default(),
                "not a Redis type (single, cluster or sentinel)",
            ));
        }
    };
    let unix = match env
        .get("REDIS_SOCKET_TYPE")
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        None | Some("unix") => true,
        Some("tcp") => false,
        Some(_) => {
            return Err(bad(
                "REDIS_SOCKET_TYPE",
                env.get("REDIS_SOCKET_TYPE").unwrap_or_default(),
                "not a socket type (tcp or unix)",
            ));
        }
    };
    let tls = env.bool("REDIS_TLS")? == Some(true);
    if sentinel {
        return sentinel_target(env, unix, tls);
    }
    let raw = env.get("REDIS_URL").unwrap_or(DEFAULT_REDIS_URL);
    let mut urls = Vec::new();
    for item in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        if unix {
            if item.contains("://") {
                host_port(item)?;
            }
            if cluster {
                return Err(unsupported_error(
                    "REDIS_SOCKET_TYPE",
                    "unix with REDIS_TYPE=cluster: cluster nodes are reached over tcp",
                ));
            }
            if tls {
                return Err(unsupported_error(
                    "REDIS_TLS",
                    "true with REDIS_SOCKET_TYPE=unix: TLS runs over tcp",
                ));
            }
            urls.push(format!("unix://{item}"));
        } else {
            host_port(item)?;
            urls.push(format!("{}://{item}", if tls { "rediss" } else { "redis" }));
        }
    }
    if urls.is_empty() {
        return Err(bad("REDIS_URL", raw, "empty"));
    }
    if !cluster && urls.len() > 1 {
        return Err(bad(
            "REDIS_URL",
            raw,
            "several addresses for REDIS_TYPE=single",
        ));
    }
    Ok(RedisTarget {
        url: urls.join(","),
        cluster,
        sentinel: None,
    })
}

/// `SHADOW_MODE`, `QUOTA_MODE`, `LIMIT_RESPONSE_HEADERS_ENABLED` and the header names,
/// `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT`, `RESPONSE_DYNAMIC_METADATA`, `NEAR_LIMIT_RATIO`.
fn decisions(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    if let Some(shadow) = env.bool("SHADOW_MODE")? {
        m.set("shadow_mode", json!(shadow));
    }
    if let Some(quota) = env.bool("QUOTA_MODE")? {
        m.set("quota_mode", json!(quota));
    }
    if let Some(enabled) = env.bool("LIMIT_RESPONSE_HEADERS_ENABLED")? {
        m.set(
            "response_headers",
            json!(if enabled { "legacy" } else { "none" }),
        );
    }
    for (variable, setting) in [
        ("LIMIT_LIMIT_HEADER", "legacy_headers.limit"),
        ("LIMIT_REMAINING_HEADER", "legacy_headers.remaining"),
        ("LIMIT_RESET_HEADER", "legacy_headers.reset"),
    ] {
        if let Some(name) = env.get(variable) {
            m.set(setting, json!(name));
        }
    }
    // sluice never charges a refused request, so the option is always on.
    env.bool("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT")?;
    if let Some(enabled) = env.bool("RESPONSE_DYNAMIC_METADATA")? {
        m.set("response_dynamic_metadata", json!(enabled));
    }
    if let Some(text) = env.get("NEAR_LIMIT_RATIO") {
        let ratio = text
            .parse::<f64>()
            .ok()
            .filter(|r| (0.0..=1.0).contains(r))
            .ok_or_else(|| bad("NEAR_LIMIT_RATIO", text, "not a number from 0 to 1"))?;
        m.set("metrics.near_limit_ratio", json!(ratio));
    }
    Ok(())
}

/// `USE_STATSD`, `USE_DOG_STATSD`, `USE_PROMETHEUS`, `PROMETHEUS_ADDR`, `PROMETHEUS_PATH`.
fn observability(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    // Unset is the reference's default, true: such a Deployment fed statsd.
    if env.bool("USE_STATSD")? != Some(false) {
        m.warn(
            "USE_STATSD: statsd is not offered; metrics are served for Prometheus on the admin \
             port's /metrics, under the reference's Prometheus names"
                .into(),
        );
    }
    if env.bool("USE_DOG_STATSD")? == Some(true) {
        m.warn(
            "USE_DOG_STATSD: DogStatsD is not offered; metrics are served for Prometheus on \
             the admin port's /metrics"
                .into(),
        );
    }
    let prometheus = env.bool("USE_PROMETHEUS")?;
    if prometheus == Some(true) || env.any_set(&["PROMETHEUS_ADDR", "PROMETHEUS_PATH"]) {
        m.warn(
            "USE_PROMETHEUS/PROMETHEUS_ADDR/PROMETHEUS_PATH: metrics are always on; they are \
             served on the admin port (HOST:PORT) at /metrics, not on a port of their own \
             (the reference's :9090); point the scrape there"
                .into(),
        );
    }
    if env.bool("TRACING_ENABLED")? == Some(true) {
        m.warn("TRACING_ENABLED=true: tracing export is not supported yet".into());
    }
    Ok(())
}

/// `GRPC_SERVER_USE_TLS` with `GRPC_SERVER_TLS_CERT`/`_KEY`, `GRPC_CLIENT_TLS_CACERT` and
/// `GRPC_CLIENT_TLS_SAN` (mTLS), `GRPC_MAX_CONNECTION_AGE` and `GRPC_MAX_CONNECTION_AGE_GRACE`.
/// The reference reads the certificate variables only with `GRPC_SERVER_USE_TLS=true`, and so
/// does this; TLS asked for without a certificate and key is an error, never plaintext.
fn grpc(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    if env.bool("GRPC_SERVER_USE_TLS")? == Some(true) {
        for (variable, setting) in [
            ("GRPC_SERVER_TLS_CERT", "grpc.tls.cert_file"),
            ("GRPC_SERVER_TLS_KEY", "grpc.tls.key_file"),
        ] {
            let path = env.get(variable).ok_or_else(|| {
                unsupported_error(variable, "must be set with GRPC_SERVER_USE_TLS=true")
            })?;
            m.set(setting, json!(path));
        }
        if let Some(ca) = env.get("GRPC_CLIENT_TLS_CACERT") {
            m.set("grpc.tls.client_ca_file", json!(ca));
        }
        if let Some(san) = env.get("GRPC_CLIENT_TLS_SAN") {
            if env.get("GRPC_CLIENT_TLS_CACERT").is_none() {
                return Err(unsupported_error(
                    "GRPC_CLIENT_TLS_SAN",
                    "needs GRPC_CLIENT_TLS_CACERT (the CA client certificates are verified against)",
                ));
            }
            m.set("grpc.tls.client_san", json!(san));
        }
    } else if env.any_set(&[
        "GRPC_SERVER_TLS_CERT",
        "GRPC_SERVER_TLS_KEY",
        "GRPC_CLIENT_TLS_CACERT",
        "GRPC_CLIENT_TLS_SAN",
    ]) {
        m.warn(
            "GRPC_SERVER_TLS_*/GRPC_CLIENT_TLS_*: not read without GRPC_SERVER_USE_TLS=true (as \
             the reference); the gRPC port serves plaintext"
                .into(),
        );
    }
    for (variable, setting) in [
        ("GRPC_MAX_CONNECTION_AGE", "grpc.max_connection_age_ms"),
        (
            "GRPC_MAX_CONNECTION_AGE_GRACE",
            "grpc.max_connection_age_grace_ms",
        ),
    ] {
        if let Some(text) = env.get(variable) {
            let ms = go_duration_ms(text)
                .ok_or_else(|| bad(variable, text, "not a duration (e.g. 24h, 1h30m, 500ms)"))?;
            if ms == 0 && variable == "GRPC_MAX_CONNECTION_AGE_GRACE" {
                return Err(bad(variable, text, "not a positive duration"));
            }
            m.set(setting, json!(ms));
        }
    }
    Ok(())
}

/// A Go `time.Duration` string (`24h`, `1h30m`, `1.5s`, `500ms`, `0`) in whole milliseconds
/// (rounded up, so a positive duration stays positive); `None` when it does not parse, is
/// negative or does not fit.
fn go_duration_ms(text: &str) -> Option<u64> {
    if text == "0" {
        return Some(0);
    }
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    if rest.is_empty() {
        return None;
    }
    let mut nanos: u128 = 0;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(number_end);
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_end);
        let per: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return None,
        };
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
            return None;
        }
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().ok()?
        };
        let mut part = whole.checked_mul(per)?;
        let mut scale = per;
        for digit in fraction.bytes().take(18) {
            scale /= 10;
            part += u128::from(digit - b'0') * scale;
        }
        nanos = nanos.checked_add(part)?;
        rest = tail;
    }
    u64::try_from(nanos.div_ceil(1_000_000)).ok()
}

/// Variables that ask for what sluice does not offer yet, where ignoring them would change
/// where configuration comes from or where clients connect: errors.
fn unsupported(env: &Env<'_>) -> Result<(), CompatError> {
    if let Some(v) = env.get("CONFIG_TYPE")
        && !v.eq_ignore_ascii_case("FILE")
    {
        return Err(bad(
            "CONFIG_TYPE",
            v,
            "not supported: only FILE (policies from the runtime directory)",
        ));
    }
    if env.get("GRPC_UDS").is_some() {
        return Err(unsupported_error(
            "GRPC_UDS",
            "a unix socket for gRPC is not supported yet; use GRPC_HOST/GRPC_PORT",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(vars: &[(&str, &str)]) -> Result<Mapped, CompatError> {
        from_env(
            &vars
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
        )
    }

    /// The setting at dotted `name` in `map`.
    fn at<'a>(map: &'a serde_json::Map<String, Value>, name: &str) -> Option<&'a Value> {
        let mut parts = name.split('.');
        let first = map.get(parts.next()?)?;
        parts.try_fold(first, |v, part| v.get(part))
    }

    /// The setting at dotted `name` above the settings file.
    fn get<'a>(m: &'a Mapped, name: &str) -> Option<&'a Value> {
        at(&m.overrides, name)
    }

    /// `vars` with what a Deployment that feeds no statsd and names its backend sets, for the
    /// tests of other variables' warnings.
    fn quiet(vars: &[(&str, &str)]) -> Result<Mapped, CompatError> {
        let mut all = vec![("USE_STATSD", "false"), ("BACKEND_TYPE", "redis")];
        all.extend_from_slice(vars);
        map(&all)
    }

    /// The setting at dotted `name` beneath the settings file.
    fn beneath<'a>(m: &'a Mapped, name: &str) -> Option<&'a Value> {
        at(&m.defaults, name)
    }

    #[test]
    fn no_reference_variable_the_references_defaults_beneath_the_file() {
        let m = map(&[("PATH", "/bin"), ("SLUICE_GRPC_ADDR", "127.0.0.1:1")]).unwrap();
        // The reference counts in Redis over its default unix socket, and feeds statsd; an unset
        // variable says less than a settings file, so both defaults go beneath it.
        assert!(m.overrides.is_empty(), "{:?}", m.overrides);
        assert_eq!(
            Value::Object(m.defaults),
            json!({"backend": "redis", "redis": {
                "url": "unix:///var/run/nutcracker/ratelimit.sock", "cluster": false}})
        );
        assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
        assert!(m.warnings[0].starts_with("USE_STATSD"));
        // Said only if the default socket is kept (`Written` checks once all is layered).
        assert_eq!(
            m.default_socket.as_deref(),
            Some("unix:///var/run/nutcracker/ratelimit.sock")
        );
        // A set variable goes above the file; the other stays beneath.
        let m = map(&[("BACKEND_TYPE", "redis")]).unwrap();
        assert_eq!(get(&m, "backend"), Some(&json!("redis")));
        assert_eq!(get(&m, "redis.url"), None);
        assert!(beneath(&m, "redis.url").is_some());
        assert!(m.default_socket.is_some());
        let m = map(&[("REDIS_URL", "/r.sock")]).unwrap();
        assert_eq!(get(&m, "backend"), None);
        assert_eq!(beneath(&m, "backend"), Some(&json!("redis")));
        assert_eq!(get(&m, "redis.url"), Some(&json!("unix:///r.sock")));
        assert_eq!(m.default_socket, None);
    }

    #[test]
    fn listeners_take_the_missing_half_from_the_reference() {
        let m = map(&[("PORT", "9000"), ("GRPC_HOST", "127.0.0.1")]).unwrap();
        assert_eq!(get(&m, "admin_addr"), Some(&json!("0.0.0.0:9000")));
        assert_eq!(get(&m, "grpc_addr"), Some(&json!("127.0.0.1:8081")));
        let m = map(&[("GRPC_HOST", "::1"), ("GRPC_PORT", "0")]).unwrap();
        assert_eq!(get(&m, "grpc_addr"), Some(&json!("[::1]:0")));
        let err = map(&[("PORT", "80x")]).unwrap_err().to_string();
        assert!(err.contains("PORT") && err.contains("80x"), "{err}");
        let err = map(&[("GRPC_HOST", "example.com")]).unwrap_err();
        assert_eq!(err.variable, "GRPC_HOST");
    }

    #[test]
    fn logging_maps_logrus_names() {
        let m = map(&[("LOG_LEVEL", "WARNING"), ("LOG_FORMAT", "json")]).unwrap();
        assert_eq!(get(&m, "log_level"), Some(&json!("warn")));
        assert_eq!(get(&m, "log_format"), Some(&json!("json")));
        assert_eq!(
            map(&[("LOG_LEVEL", "loud")]).unwrap_err().variable,
            "LOG_LEVEL"
        );
        assert_eq!(
            map(&[("LOG_FORMAT", "xml")]).unwrap_err().variable,
            "LOG_FORMAT"
        );
    }

    #[test]
    fn the_runtime_layout_is_the_policy_directory() {
        let m = map(&[
            ("RUNTIME_ROOT", "/data/current"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("RUNTIME_IGNOREDOTFILES", "true"),
            ("RUNTIME_WATCH_ROOT", "false"),
        ])
        .unwrap();
        assert_eq!(
            get(&m, "policies"),
            Some(&json!("/data/current/ratelimit/config"))
        );
        assert_eq!(get(&m, "policy_files"), Some(&json!("visible")));
        let m = map(&[
            ("RUNTIME_SUBDIRECTORY", "rl"),
            ("RUNTIME_APPDIRECTORY", "c"),
        ])
        .unwrap();
        assert_eq!(
            get(&m, "policies"),
            Some(&json!("/srv/runtime_data/current/rl/c"))
        );
        assert_eq!(get(&m, "policy_files"), Some(&json!("all")));
        assert_eq!(
            map(&[("RUNTIME_IGNOREDOTFILES", "yes")])
                .unwrap_err()
                .variable,
            "RUNTIME_IGNOREDOTFILES"
        );
        let m = quiet(&[("RUNTIME_ROOT", "/r"), ("MERGE_DOMAIN_CONFIG", "true")]).unwrap();
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
        assert_eq!(get(&m, "merge_domains"), Some(&json!(true)));
        // Read on its own too, and false is said as well.
        let m = map(&[("MERGE_DOMAIN_CONFIG", "0")]).unwrap();
        assert_eq!(get(&m, "merge_domains"), Some(&json!(false)));
        assert_eq!(get(&m, "policies"), None);
        assert_eq!(
            map(&[("MERGE_DOMAIN_CONFIG", "merge")])
                .unwrap_err()
                .variable,
            "MERGE_DOMAIN_CONFIG"
        );
    }

    #[test]
    fn redis_urls_in_each_form() {
        let m = map(&[
            ("BACKEND_TYPE", "redis"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("REDIS_AUTH", "p@ss:w/rd"),
        ])
        .unwrap();
        assert_eq!(get(&m, "backend"), Some(&json!("redis")));
        // user:password, out of the URL: the user is what comes before the first colon.
        assert_eq!(get(&m, "redis.url"), Some(&json!("redis://redis:6379")));
        assert_eq!(get(&m, "redis.username"), Some(&json!("p@ss")));
        assert_eq!(get(&m, "redis.password"), Some(&json!("w/rd")));
        assert_eq!(get(&m, "redis.cluster"), Some(&json!(false)));
        let m = map(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_TYPE", "CLUSTER"),
            ("REDIS_URL", "a:7000, b:7001"),
            ("REDIS_AUTH", "secret"),
        ])
        .unwrap();
        assert_eq!(
            get(&m, "redis.url"),
            Some(&json!("redis://a:7000,redis://b:7001"))
        );
        assert_eq!(get(&m, "redis.password"), Some(&json!("secret")));
        assert_eq!(get(&m, "redis.username"), None);
        assert_eq!(get(&m, "redis.cluster"), Some(&json!(true)));
        // A password over the reference's default unix socket.
        let m = map(&[("REDIS_AUTH", ":secret")]).unwrap();
        assert_eq!(
            get(&m, "redis.url"),
            Some(&json!("unix:///var/run/nutcracker/ratelimit.sock"))
        );
        assert_eq!(get(&m, "redis.password"), Some(&json!("secret")));
        let m = map(&[("CACHE_KEY_PREFIX", "rl_")]).unwrap();
        assert_eq!(get(&m, "redis.key_prefix"), Some(&json!("rl_")));
        assert_eq!(map(&[("CACHE_KEY_PREFIX", "")]).unwrap(), map(&[]).unwrap());
        // The reference's defaults: a unix socket.
        let m = map(&[("BACKEND_TYPE", "redis")]).unwrap();
        assert_eq!(
            beneath(&m, "redis.url"),
            Some(&json!("unix:///var/run/nutcracker/ratelimit.sock"))
        );
        for (vars, variable) in [
            (&[("REDIS_TYPE", "ring")][..], "REDIS_TYPE"),
            (&[("BACKEND_TYPE", "memcache")][..], "BACKEND_TYPE"),
            (&[("REDIS_TLS", "true")][..], "REDIS_TLS"),
            (
                &[("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_TLS", "yes")][..],
                "REDIS_TLS",
            ),
            (
                &[
                    ("REDIS_SOCKET_TYPE", "tcp"),
                    ("REDIS_URL", "r:6379"),
                    ("REDIS_TLS", "true"),
                    ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "maybe"),
                ][..],
                "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
            ),
            (
                &[("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "redis")][..],
                "REDIS_URL",
            ),
            (
                &[("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "a:1,b:2")][..],
                "REDIS_URL",
            ),
            (&[("REDIS_URL", "redis://x:1")][..], "REDIS_URL"),
        ] {
            assert_eq!(map(vars).unwrap_err().variable, variable, "{vars:?}");
        }
        let err = map(&[("REDIS_AUTH", "topsecret"), ("REDIS_URL", "redis://x:1")])
            .unwrap_err()
            .to_string();
        assert!(!err.contains("topsecret"), "{err}");
    }

    #[test]
    fn sentinel_master_name_and_sentinels() {
        let m = map(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_TYPE", "Sentinel"),
            ("REDIS_URL", "mymaster, s1:26379,s2:26380 ,[::1]:26381"),
            ("REDIS_AUTH", "app:master-pw"),
            ("REDIS_SENTINEL_AUTH", "s3cret/pw"),
        ])
        .unwrap();
        assert_eq!(
            get(&m, "redis.sentinel.master_name"),
            Some(&json!("mymaster"))
        );
        assert_eq!(
            get(&m, "redis.sentinel.urls"),
            Some(&json!(
                "redis://:s3cret%2Fpw@s1:26379,redis://:s3cret%2Fpw@s2:26380,\
                 redis://:s3cret%2Fpw@[::1]:26381"
            ))
        );
        // The master's credentials as settings; its address comes from the sentinels.
        assert_eq!(get(&m, "redis.url"), Some(&json!("redis://127.0.0.1:6379")));
        assert_eq!(get(&m, "redis.username"), Some(&json!("app")));
        assert_eq!(get(&m, "redis.password"), Some(&json!("master-pw")));
        assert_eq!(get(&m, "redis.cluster"), Some(&json!(false)));
        let m = map(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_TYPE", "sentinel"),
            ("REDIS_URL", "m,s1:26379"),
        ])
        .unwrap();
        assert_eq!(
            get(&m, "redis.sentinel.urls"),
            Some(&json!("redis://s1:26379"))
        );
        assert_eq!(get(&m, "redis.url"), Some(&json!("redis://127.0.0.1:6379")));
        for (vars, variable) in [
            // A master name alone, or nothing: at least two items.
            (
                &[
                    ("REDIS_SOCKET_TYPE", "tcp"),
                    ("REDIS_TYPE", "sentinel"),
                    ("REDIS_URL", "m"),
                ][..],
                "REDIS_URL",
            ),
            (
                &[
                    ("REDIS_SOCKET_TYPE", "tcp"),
                    ("REDIS_TYPE", "sentinel"),
                    ("REDIS_URL", " , "),
                ][..],
                "REDIS_URL",
            ),
            (
                &[
                    ("REDIS_SOCKET_TYPE", "tcp"),
                    ("REDIS_TYPE", "sentinel"),
                    ("REDIS_URL", "m,s1"),
                ][..],
                "REDIS_URL",
            ),
            (
                &[
                    ("REDIS_SOCKET_TYPE", "tcp"),
                    ("REDIS_TYPE", "sentinel"),
                    ("REDIS_URL", "m,redis://s1:26379"),
                ][..],
                "REDIS_URL",
            ),
            // The reference's default socket type is unix; sentinels are reached over tcp.
            (
                &[("REDIS_TYPE", "sentinel"), ("REDIS_URL", "m,s1:26379")][..],
                "REDIS_SOCKET_TYPE",
            ),
        ] {
            assert_eq!(map(vars).unwrap_err().variable, variable, "{vars:?}");
        }
        let err = map(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_TYPE", "sentinel"),
            ("REDIS_URL", "m,s1"),
            ("REDIS_SENTINEL_AUTH", "topsecret"),
        ])
        .unwrap_err()
        .to_string();
        assert!(!err.contains("topsecret"), "{err}");
        // Without sentinel the sentinels' password is not read, and said so.
        let m = map(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "r:6379"),
            ("REDIS_SENTINEL_AUTH", "pw"),
        ])
        .unwrap();
        assert_eq!(get(&m, "redis.sentinel.urls"), None);
        assert!(
            m.warnings
                .iter()
                .any(|w| w.starts_with("REDIS_SENTINEL_AUTH")),
            "{:?}",
            m.warnings
        );
    }

    #[test]
    fn redis_tls_and_its_certificates() {
        let m = quiet(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_TYPE", "cluster"),
            ("REDIS_URL", "10.0.0.1:6379,10.0.0.2:6379"),
            ("REDIS_TLS", "true"),
            ("REDIS_TLS_CACERT", "/certs/ca.pem"),
            ("REDIS_TLS_CLIENT_CERT", "/certs/tls.crt"),
            ("REDIS_TLS_CLIENT_KEY", "/certs/tls.key"),
            ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "true"),
        ])
        .unwrap();
        assert_eq!(
            get(&m, "redis.url"),
            Some(&json!("rediss://10.0.0.1:6379,rediss://10.0.0.2:6379"))
        );
        assert_eq!(get(&m, "redis.tls.ca_file"), Some(&json!("/certs/ca.pem")));
        assert_eq!(
            get(&m, "redis.tls.cert_file"),
            Some(&json!("/certs/tls.crt"))
        );
        assert_eq!(
            get(&m, "redis.tls.key_file"),
            Some(&json!("/certs/tls.key"))
        );
        assert_eq!(
            get(&m, "redis.tls.skip_hostname_verification"),
            Some(&json!(true))
        );
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
        // Without REDIS_TLS=true the reference does not read them: a warning, no setting.
        let m = map(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "r:6379"),
            ("REDIS_TLS_CACERT", "/certs/ca.pem"),
        ])
        .unwrap();
        assert_eq!(get(&m, "redis.url"), Some(&json!("redis://r:6379")));
        assert_eq!(get(&m, "redis.tls.ca_file"), None);
        assert!(
            m.warnings[0].starts_with("REDIS_TLS_CACERT"),
            "{:?}",
            m.warnings
        );
    }

    #[test]
    fn decisions_and_headers() {
        let m = map(&[
            ("SHADOW_MODE", "1"),
            ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
        ])
        .unwrap();
        assert_eq!(get(&m, "shadow_mode"), Some(&json!(true)));
        assert_eq!(get(&m, "response_headers"), Some(&json!("legacy")));
        let m = map(&[
            ("LIMIT_REMAINING_HEADER", "X-Left"),
            ("NEAR_LIMIT_RATIO", "0.5"),
        ])
        .unwrap();
        assert_eq!(get(&m, "legacy_headers.remaining"), Some(&json!("X-Left")));
        assert_eq!(get(&m, "legacy_headers.limit"), None);
        assert_eq!(get(&m, "metrics.near_limit_ratio"), Some(&json!(0.5)));
        for ratio in ["high", "1.5", "-0.1"] {
            assert_eq!(
                map(&[("NEAR_LIMIT_RATIO", ratio)]).unwrap_err().variable,
                "NEAR_LIMIT_RATIO"
            );
        }
        let m = map(&[("QUOTA_MODE", "true")]).unwrap();
        assert_eq!(get(&m, "quota_mode"), Some(&json!(true)));
        assert_eq!(
            map(&[("QUOTA_MODE", "sometimes")]).unwrap_err().variable,
            "QUOTA_MODE"
        );
        let m = quiet(&[("RESPONSE_DYNAMIC_METADATA", "true")]).unwrap();
        assert_eq!(get(&m, "response_dynamic_metadata"), Some(&json!(true)));
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
        let m = map(&[("RESPONSE_DYNAMIC_METADATA", "False")]).unwrap();
        assert_eq!(get(&m, "response_dynamic_metadata"), Some(&json!(false)));
        assert_eq!(
            map(&[("RESPONSE_DYNAMIC_METADATA", "enabled")])
                .unwrap_err()
                .variable,
            "RESPONSE_DYNAMIC_METADATA"
        );
        assert_eq!(
            map(&[("SHADOW_MODE", "on")]).unwrap_err().variable,
            "SHADOW_MODE"
        );
    }

    #[test]
    fn statsd_is_a_warning_and_security_an_error() {
        // Unset is the reference's default, true: warned of too.
        for vars in [&[("USE_STATSD", "true")][..], &[]] {
            let m = map(vars).unwrap();
            assert!(m.warnings.iter().any(|w| w.starts_with("USE_STATSD")));
            assert_eq!(
                m.overrides,
                map(&[("USE_STATSD", "false")]).unwrap().overrides
            );
        }
        let m = map(&[("USE_STATSD", "false"), ("USE_PROMETHEUS", "true")]).unwrap();
        assert!(!m.warnings.iter().any(|w| w.starts_with("USE_STATSD")));
        assert!(m.warnings.iter().any(|w| w.starts_with("USE_PROMETHEUS")));
        assert_eq!(
            map(&[("GRPC_SERVER_USE_TLS", "true")])
                .unwrap_err()
                .variable,
            "GRPC_SERVER_TLS_CERT"
        );
        assert_eq!(
            map(&[("CONFIG_TYPE", "GRPC_XDS_SOTW")])
                .unwrap_err()
                .variable,
            "CONFIG_TYPE"
        );
    }

    #[test]
    fn grpc_tls_and_mtls_map_onto_the_tls_settings() {
        let m = map(&[
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/tls/tls.crt"),
            ("GRPC_SERVER_TLS_KEY", "/tls/tls.key"),
            ("GRPC_CLIENT_TLS_CACERT", "/tls/ca.crt"),
            ("GRPC_CLIENT_TLS_SAN", "envoy.local"),
        ])
        .unwrap();
        assert_eq!(get(&m, "grpc.tls.cert_file"), Some(&json!("/tls/tls.crt")));
        assert_eq!(get(&m, "grpc.tls.key_file"), Some(&json!("/tls/tls.key")));
        assert_eq!(
            get(&m, "grpc.tls.client_ca_file"),
            Some(&json!("/tls/ca.crt"))
        );
        assert_eq!(get(&m, "grpc.tls.client_san"), Some(&json!("envoy.local")));
        // Without GRPC_SERVER_USE_TLS the files are not read, as in the reference; said so.
        let m = map(&[("GRPC_SERVER_TLS_CERT", "/tls/tls.crt")]).unwrap();
        assert_eq!(get(&m, "grpc.tls.cert_file"), None);
        assert!(
            m.warnings.iter().any(|w| w.starts_with("GRPC_SERVER_TLS_")),
            "{:?}",
            m.warnings
        );
        for (vars, variable) in [
            (
                &[
                    ("GRPC_SERVER_USE_TLS", "true"),
                    ("GRPC_SERVER_TLS_CERT", "/c"),
                ][..],
                "GRPC_SERVER_TLS_KEY",
            ),
            (
                &[
                    ("GRPC_SERVER_USE_TLS", "true"),
                    ("GRPC_SERVER_TLS_CERT", "/c"),
                    ("GRPC_SERVER_TLS_KEY", "/k"),
                    ("GRPC_CLIENT_TLS_SAN", "x"),
                ][..],
                "GRPC_CLIENT_TLS_SAN",
            ),
            (&[("GRPC_SERVER_USE_TLS", "yes")][..], "GRPC_SERVER_USE_TLS"),
        ] {
            assert_eq!(map(vars).unwrap_err().variable, variable, "{vars:?}");
        }
    }

    #[test]
    fn connection_age_reads_go_durations() {
        let m = map(&[
            ("GRPC_MAX_CONNECTION_AGE", "24h"),
            ("GRPC_MAX_CONNECTION_AGE_GRACE", "1h30m"),
        ])
        .unwrap();
        assert_eq!(
            get(&m, "grpc.max_connection_age_ms"),
            Some(&json!(86_400_000))
        );
        assert_eq!(
            get(&m, "grpc.max_connection_age_grace_ms"),
            Some(&json!(5_400_000))
        );
        for bad in [
            "24",
            "1d",
            "-1h",
            "h",
            "1.2.3s",
            "1h 30m",
            "99999999999999999h",
        ] {
            let err = map(&[("GRPC_MAX_CONNECTION_AGE", bad)]).unwrap_err();
            assert_eq!(err.variable, "GRPC_MAX_CONNECTION_AGE", "{bad}");
        }
        assert_eq!(
            map(&[("GRPC_MAX_CONNECTION_AGE_GRACE", "0s")])
                .unwrap_err()
                .variable,
            "GRPC_MAX_CONNECTION_AGE_GRACE"
        );
    }

    #[test]
    fn go_durations_in_milliseconds() {
        for (text, ms) in [
            ("0", 0),
            ("500ms", 500),
            ("1.5s", 1_500),
            ("2m", 120_000),
            ("1h30m", 5_400_000),
            ("+3s", 3_000),
            ("1us", 1),
            ("250µs", 1),
            ("1h0.5m10ms", 3_630_010),
            (".5s", 500),
        ] {
            assert_eq!(go_duration_ms(text), Some(ms), "{text}");
        }
        for bad in ["", "+", "5", "s", "1.s.", "1 s", "-2s", "1y", "1..5s"] {
            assert_eq!(go_duration_ms(bad), None, "{bad}");
        }
    }
}
