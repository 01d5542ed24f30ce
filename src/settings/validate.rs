//! The second stage of settings: [`Written::validate`] checks every value once, naming the
//! setting at fault, and gives [`Settings`] in the types the code that uses them takes
//! (durations, addresses, the decision layer's options, the Redis backend's config).

use std::path::PathBuf;
use std::time::Duration;

use super::written::{RlqsSection, TracingSection};
use super::{
    AdminLimits, AdminSection, BackendKind, BackendSettings, DEFAULT_XDS_MAX_MESSAGE_BYTES,
    GrpcLimits, GrpcSection, GrpcTls, GrpcTlsSection, LeaseSection, LocalSettings,
    MAX_HEARTBEAT_INTERVAL_MS, MetricsSection, PolicySource, RedisSection, RequestsSection,
    Settings, SettingsError, StoreSection, WriteToken, Written, XdsBackoff, XdsSection,
    XdsSettings, XdsTls,
};
use crate::decision::{self, Caps, HeaderOptions, LegacyNames};
use crate::limiter::redis::{Password, RedisAuth, RedisTls, SentinelConfig};
use crate::limiter::{LeaseConfig, RedisConfig};

/// The longest `rlqs.assignment_ttl_ms`: an hour.
const MAX_ASSIGNMENT_TTL_MS: u64 = 3_600_000;

/// The shortest `rlqs.assignment_ttl_ms`: a second.
const MIN_ASSIGNMENT_TTL_MS: u64 = 1_000;

impl Written {
    /// Checks every value and gives the typed settings, one section after the other.
    ///
    /// # Errors
    ///
    /// [`SettingsError`] naming the first value out of range.
    pub fn validate(self) -> Result<Settings, SettingsError> {
        let caps = requests(&self.requests)?;
        store(&self.store)?;
        let rlqs = rlqs(&self.rlqs)?;
        let (grpc, grpc_tls) = grpc(&self.grpc)?;
        let admin = admin(&self.admin)?;
        metrics(&self.metrics)?;
        legacy_headers(&self.legacy_headers)?;
        let local = local(&self.redis, &self.store)?;
        let backend = backend(self.backend, &self.store, &self.redis)?;
        let tracing = tracing_config(&self.tracing)?;
        let xds = match self.policy_source {
            PolicySource::Files => None,
            PolicySource::Xds => Some(xds_config(&self.xds)?),
        };
        let lease = lease_config(&self.redis.lease)?
            .filter(|_| matches!(backend, BackendSettings::Redis(_)));
        Ok(Settings {
            grpc_addr: self.grpc_addr,
            admin_addr: self.admin_addr,
            xds,
            policies: self.policies,
            policy_files: self.policy_files,
            watch_policies: self.watch_policies,
            allow_empty_policies: self.allow_empty_policies,
            merge_domains: self.merge_domains,
            log_format: self.log_format,
            log_level: self.log_level,
            decision: decision::Options {
                caps,
                shadow_mode: self.shadow_mode,
                quota_mode: self.quota_mode,
                on_backend_error: self.on_backend_error,
                dynamic_metadata: self.response_dynamic_metadata,
                headers: HeaderOptions {
                    mode: self.response_headers,
                    legacy_names: self.legacy_headers,
                    retry_after_jitter_seconds: self.retry_after_jitter_seconds,
                    problem_body: self.problem_body,
                },
                traced: tracing.is_some(),
            },
            max_request_bytes: self.requests.max_request_bytes,
            backend,
            lease,
            local,
            max_detailed_series: self.metrics.max_detailed_series,
            near_limit_ratio: self.metrics.near_limit_ratio,
            top_keys: self.metrics.top_keys,
            drain_delay: Duration::from_millis(self.drain_delay_ms),
            shutdown_grace: Duration::from_millis(self.shutdown_grace_ms),
            grpc,
            grpc_tls,
            admin,
            metrics_listener: self.metrics.addr.map(|a| (a, self.metrics.path.clone())),
            debug_addr: self.admin.debug_addr,
            tracing,
            rlqs,
            compat_warnings: self.compat_warnings,
            compat_set: self.compat_set,
        })
    }
}

/// `Ok` for a value above 0, else the error naming `setting`.
fn positive(setting: &'static str, value: u64) -> Result<(), SettingsError> {
    if value == 0 {
        Err(SettingsError::Zero { setting })
    } else {
        Ok(())
    }
}

/// `requests`: every cap above 0; the decision layer's caps.
fn requests(r: &RequestsSection) -> Result<Caps, SettingsError> {
    for (setting, value) in [
        ("requests.max_request_bytes", r.max_request_bytes),
        ("requests.max_descriptors", r.max_descriptors),
        ("requests.max_entries", r.max_entries),
        ("requests.max_domain_bytes", r.max_domain_bytes),
        ("requests.max_key_bytes", r.max_key_bytes),
        ("requests.max_value_bytes", r.max_value_bytes),
    ] {
        positive(setting, value as u64)?;
    }
    Ok(Caps {
        max_descriptors: r.max_descriptors,
        max_entries: r.max_entries,
        max_domain_bytes: r.max_domain_bytes,
        max_key_bytes: r.max_key_bytes,
        max_value_bytes: r.max_value_bytes,
    })
}

/// `store`: its size and its sweep above 0.
fn store(s: &StoreSection) -> Result<(), SettingsError> {
    positive("store.max_keys", s.max_keys as u64)?;
    positive("store.sweep_interval_ms", s.sweep_interval_ms)
}

/// `rlqs`: every limit above 0, and an assignment's life between a second and an hour; the
/// service's settings when it is on.
fn rlqs(q: &RlqsSection) -> Result<Option<crate::rlqs::RlqsSettings>, SettingsError> {
    for (setting, value) in [
        ("rlqs.max_buckets_per_stream", q.max_buckets_per_stream),
        ("rlqs.max_streams", q.max_streams),
        (
            "rlqs.max_streams_per_connection",
            q.max_streams_per_connection,
        ),
        ("rlqs.max_streams_per_peer", q.max_streams_per_peer),
    ] {
        positive(setting, value as u64)?;
    }
    if q.assignment_ttl_ms < MIN_ASSIGNMENT_TTL_MS {
        return Err(SettingsError::TooSmall {
            setting: "rlqs.assignment_ttl_ms",
            min: MIN_ASSIGNMENT_TTL_MS,
            why: "a second: a shorter one lapses before Envoy's next report, and every bucket \
                  is abandoned soon after its assignment",
        });
    }
    if q.assignment_ttl_ms > MAX_ASSIGNMENT_TTL_MS {
        return Err(SettingsError::TooLarge {
            setting: "rlqs.assignment_ttl_ms",
            max: MAX_ASSIGNMENT_TTL_MS,
            why: "an hour: an assignment that outlives its stream by more makes the bound a loose one",
        });
    }
    Ok(q.enabled.then(|| crate::rlqs::RlqsSettings {
        assignment_ttl: Duration::from_millis(q.assignment_ttl_ms),
        max_buckets_per_stream: q.max_buckets_per_stream,
        max_streams: q.max_streams,
        max_streams_per_connection: q.max_streams_per_connection,
        max_streams_per_peer: q.max_streams_per_peer,
    }))
}

/// `grpc`: every limit and timeout above 0, the idle timeout past the request timeout, and the
/// TLS files ([`grpc_tls`]); the port's limits and its TLS.
fn grpc(g: &GrpcSection) -> Result<(GrpcLimits, Option<GrpcTls>), SettingsError> {
    for (setting, value) in [
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
        (
            "grpc.max_connection_age_grace_ms",
            g.max_connection_age_grace_ms,
        ),
        ("grpc.tls.handshake_timeout_ms", g.tls.handshake_timeout_ms),
    ] {
        positive(setting, value)?;
    }
    if g.idle_timeout_ms <= g.request_timeout_ms {
        return Err(SettingsError::IdleBeforeRequestTimeout);
    }
    let limits = GrpcLimits {
        max_connections: g.max_connections,
        max_concurrent_streams: g.max_concurrent_streams,
        max_header_list_bytes: g.max_header_list_bytes,
        request_timeout: Duration::from_millis(g.request_timeout_ms),
        keepalive_interval: Duration::from_millis(g.keepalive_interval_ms),
        keepalive_timeout: Duration::from_millis(g.keepalive_timeout_ms),
        idle_timeout: Duration::from_millis(g.idle_timeout_ms),
        max_connection_age: (g.max_connection_age_ms > 0)
            .then(|| Duration::from_millis(g.max_connection_age_ms)),
        max_connection_age_grace: Duration::from_millis(g.max_connection_age_grace_ms),
        max_held_requests: g.max_held_requests,
        max_held_per_connection: g.max_held_per_connection,
        hold_deadline_margin: Duration::from_millis(g.hold_deadline_margin_ms),
    };
    Ok((limits, grpc_tls(&g.tls)?))
}

/// `admin`: its limits above 0, and the write token's file readable and not empty.
fn admin(a: &AdminSection) -> Result<AdminLimits, SettingsError> {
    positive("admin.max_connections", a.max_connections as u64)?;
    positive("admin.header_read_timeout_ms", a.header_read_timeout_ms)?;
    let write_token = match &a.write_token_file {
        Some(path) => Some(WriteToken::read(path)?),
        None => None,
    };
    Ok(AdminLimits {
        max_connections: a.max_connections,
        header_read_timeout: Duration::from_millis(a.header_read_timeout_ms),
        write_token,
    })
}

/// `metrics`: a plain path, and a near-limit ratio from 0 to 1.
fn metrics(m: &MetricsSection) -> Result<(), SettingsError> {
    let path = &m.path;
    if !path.starts_with('/') || path.contains(['{', '}', '*']) {
        return Err(SettingsError::MetricsPath(path.clone()));
    }
    let ratio = m.near_limit_ratio;
    if !(0.0..=1.0).contains(&ratio) {
        return Err(SettingsError::NearLimitRatio(ratio));
    }
    if m.top_keys > crate::metrics::MAX_TOP_KEYS {
        return Err(SettingsError::TopKeys(m.top_keys));
    }
    Ok(())
}

/// `legacy_headers`: every name a header name.
fn legacy_headers(h: &LegacyNames) -> Result<(), SettingsError> {
    for (setting, name) in [
        ("legacy_headers.limit", &h.limit),
        ("legacy_headers.remaining", &h.remaining),
        ("legacy_headers.reset", &h.reset),
    ] {
        if !is_header_name(name) {
            return Err(SettingsError::HeaderName {
                setting,
                name: name.clone(),
            });
        }
    }
    Ok(())
}

/// The Redis timings every backend is checked for (`redis.timeout_ms`,
/// `redis.connect_timeout_ms`, `redis.heartbeat_interval_ms`) and `redis.fleet_size`; the local
/// fallback's settings, which read them and the store's.
fn local(r: &RedisSection, s: &StoreSection) -> Result<LocalSettings, SettingsError> {
    positive("redis.timeout_ms", r.timeout_ms)?;
    positive("redis.connect_timeout_ms", r.connect_timeout_ms)?;
    positive("redis.heartbeat_interval_ms", r.heartbeat_interval_ms)?;
    if r.heartbeat_interval_ms > MAX_HEARTBEAT_INTERVAL_MS {
        return Err(SettingsError::HeartbeatInterval(r.heartbeat_interval_ms));
    }
    if let Some(n) = r.fleet_size {
        positive("redis.fleet_size", n)?;
    }
    Ok(LocalSettings {
        fleet_size: r.fleet_size,
        heartbeat_interval: Duration::from_millis(r.heartbeat_interval_ms),
        max_keys: s.max_keys,
        sweep_interval: Duration::from_millis(s.sweep_interval_ms),
    })
}

/// The backend `kind` names, from the store's section or the Redis one ([`redis_config`]).
fn backend(
    kind: BackendKind,
    s: &StoreSection,
    r: &RedisSection,
) -> Result<BackendSettings, SettingsError> {
    Ok(match kind {
        BackendKind::Memory => BackendSettings::Memory {
            max_keys: s.max_keys,
            sweep_interval: Duration::from_millis(s.sweep_interval_ms),
        },
        BackendKind::Redis => BackendSettings::Redis(Box::new(redis_config(r)?)),
    })
}

/// The gRPC port's TLS: `None` when neither the certificate nor the key is set; an error when
/// only one of them is, or when an mTLS setting comes without what it needs.
fn grpc_tls(t: &GrpcTlsSection) -> Result<Option<GrpcTls>, SettingsError> {
    // An empty value (an unset variable in a template) counts as unset.
    let path = |p: &Option<PathBuf>| p.clone().filter(|p| !p.as_os_str().is_empty());
    let san = t.client_san.clone().filter(|s| !s.trim().is_empty());
    let (cert, key, ca) = (
        path(&t.cert_file),
        path(&t.key_file),
        path(&t.client_ca_file),
    );
    let needs = |setting, needs| Err(SettingsError::TlsNeeds { setting, needs });
    match (cert, key) {
        (None, None) if ca.is_some() => needs("grpc.tls.client_ca_file", "grpc.tls.cert_file"),
        (None, None) if san.is_some() => needs("grpc.tls.client_san", "grpc.tls.cert_file"),
        (None, None) => Ok(None),
        (Some(_), None) => needs("grpc.tls.cert_file", "grpc.tls.key_file"),
        (None, Some(_)) => needs("grpc.tls.key_file", "grpc.tls.cert_file"),
        (Some(_), Some(_)) if san.is_some() && ca.is_none() => {
            needs("grpc.tls.client_san", "grpc.tls.client_ca_file")
        }
        (Some(cert_file), Some(key_file)) => Ok(Some(GrpcTls {
            cert_file,
            key_file,
            client_ca_file: ca,
            client_san: san.map(|s| s.trim().to_string()),
            handshake_timeout: Duration::from_millis(t.handshake_timeout_ms),
        })),
    }
}

/// The xDS server's settings: the URL split into authority and host, TLS from the scheme or
/// `xds.tls.enabled`, header names checked as gRPC metadata keys, the backoff in range.
fn xds_config(x: &XdsSection) -> Result<XdsSettings, SettingsError> {
    let (scheme_tls, authority, host) = xds_url(x)?;
    if x.node_id.trim().is_empty() {
        return Err(xds_error("xds.node_id", &x.node_id, "empty"));
    }
    let headers = xds_headers(x)?;
    let backoff = xds_backoff(x)?;
    let tls = xds_tls(x, scheme_tls, &host)?;
    Ok(XdsSettings {
        authority,
        host,
        node_id: x.node_id.trim().to_string(),
        node_metadata: x.node_metadata.clone(),
        headers,
        max_message_bytes: if x.max_message_bytes == 0 {
            DEFAULT_XDS_MAX_MESSAGE_BYTES
        } else {
            x.max_message_bytes
        },
        force_start: x.force_start,
        backoff,
        tls,
    })
}

/// An `xds.*` value refused: the setting, the value and why.
fn xds_error(setting: &'static str, value: &str, why: &str) -> SettingsError {
    SettingsError::Xds {
        setting,
        value: value.to_string(),
        why: why.to_string(),
    }
}

/// `xds.url`: `host:port`, `http://` or `https://` before it (not `http://` with
/// `xds.tls.enabled`). Whether the scheme asks for TLS, the authority and the bare host.
fn xds_url(x: &XdsSection) -> Result<(bool, String, String), SettingsError> {
    let url = x.url.trim();
    let (scheme_tls, authority) = match url.split_once("://") {
        None => (false, url),
        Some(("http", rest)) => (false, rest),
        Some(("https", rest)) => (true, rest),
        Some(_) => {
            return Err(xds_error(
                "xds.url",
                url,
                "the scheme must be http:// or https://",
            ));
        }
    };
    let authority = authority.trim_end_matches('/');
    let parsed: tonic::codegen::http::uri::Authority = authority
        .parse()
        .map_err(|_| xds_error("xds.url", url, "not host:port"))?;
    if parsed.port_u16().is_none() || parsed.host().is_empty() || authority.contains('@') {
        return Err(xds_error(
            "xds.url",
            url,
            "not host:port (the port is required)",
        ));
    }
    if x.tls.enabled && url.starts_with("http://") {
        return Err(xds_error(
            "xds.url",
            url,
            "http:// with xds.tls.enabled; write host:port or https://",
        ));
    }
    let host = parsed.host().trim_start_matches('[').trim_end_matches(']');
    Ok((scheme_tls, authority.to_string(), host.to_string()))
}

/// `xds.headers`: each name a gRPC metadata key (lowercased), each value visible ASCII.
fn xds_headers(x: &XdsSection) -> Result<Vec<(String, String)>, SettingsError> {
    let mut headers = Vec::new();
    for (name, value) in &x.headers {
        let lower = name.trim().to_ascii_lowercase();
        if tonic::metadata::MetadataKey::<tonic::metadata::Ascii>::from_bytes(lower.as_bytes())
            .is_err()
            || lower.ends_with("-bin")
            || lower.starts_with("grpc-")
        {
            return Err(xds_error(
                "xds.headers",
                name,
                "not a gRPC metadata name (token characters, not grpc-*, not *-bin)",
            ));
        }
        if tonic::metadata::MetadataValue::<tonic::metadata::Ascii>::try_from(value.as_str())
            .is_err()
        {
            return Err(xds_error(
                "xds.headers",
                name,
                "its value is not visible ASCII",
            ));
        }
        headers.push((lower, value.clone()));
    }
    Ok(headers)
}

/// `xds.backoff`: a first wait above 0, a longest one no shorter, a random factor from 0 to 1.
fn xds_backoff(x: &XdsSection) -> Result<XdsBackoff, SettingsError> {
    let b = &x.backoff;
    if b.initial_ms == 0 {
        return Err(SettingsError::Zero {
            setting: "xds.backoff.initial_ms",
        });
    }
    if b.max_ms < b.initial_ms {
        return Err(xds_error(
            "xds.backoff.max_ms",
            &b.max_ms.to_string(),
            "shorter than xds.backoff.initial_ms",
        ));
    }
    if !(0.0..=1.0).contains(&b.random_factor) {
        return Err(xds_error(
            "xds.backoff.random_factor",
            &b.random_factor.to_string(),
            "not between 0 and 1",
        ));
    }
    Ok(XdsBackoff {
        initial: Duration::from_millis(b.initial_ms),
        max: Duration::from_millis(b.max_ms),
        random_factor: b.random_factor,
        jitter: b.jitter,
    })
}

/// `xds.tls`: on with an `https://` URL (`scheme_tls`) or `xds.tls.enabled`; a client
/// certificate needs its key and the reverse; no file or name without TLS on. The server's
/// name is `xds.tls.san`, else `host`.
fn xds_tls(x: &XdsSection, scheme_tls: bool, host: &str) -> Result<Option<XdsTls>, SettingsError> {
    let path = |p: &Option<PathBuf>| p.clone().filter(|p| !p.as_os_str().is_empty());
    let t = &x.tls;
    let (cert, key, ca) = (path(&t.cert_file), path(&t.key_file), path(&t.ca_file));
    let san = t.san.clone().filter(|s| !s.trim().is_empty());
    let tls = scheme_tls || t.enabled;
    let client = match (cert, key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(SettingsError::TlsNeeds {
                setting: "xds.tls.cert_file",
                needs: "xds.tls.key_file",
            });
        }
        (None, Some(_)) => {
            return Err(SettingsError::TlsNeeds {
                setting: "xds.tls.key_file",
                needs: "xds.tls.cert_file",
            });
        }
    };
    if !tls && (client.is_some() || ca.is_some() || san.is_some()) {
        return Err(SettingsError::TlsNeeds {
            setting: "xds.tls.cert_file, key_file, ca_file or san",
            needs: "xds.tls.enabled (or an https:// xds.url)",
        });
    }
    Ok(tls.then(|| XdsTls {
        client,
        ca_file: ca,
        server_name: san.map_or_else(|| host.to_string(), |s| s.trim().to_string()),
    }))
}

/// An HTTP field name: one or more token characters (RFC 9110, 5.1 and 5.6.2).
fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Leasing's config, checked whether or not it is enabled (so a mistake shows before it is
/// turned on); `None` when it is off.
fn lease_config(l: &LeaseSection) -> Result<Option<LeaseConfig>, SettingsError> {
    if l.max_age_ms == 0 {
        return Err(SettingsError::Zero {
            setting: "redis.lease.max_age_ms",
        });
    }
    if l.min_rate == 0 {
        return Err(SettingsError::Zero {
            setting: "redis.lease.min_rate",
        });
    }
    if !(l.max_burst_share > 0.0 && l.max_burst_share <= 1.0) {
        return Err(SettingsError::LeaseFraction {
            setting: "max_burst_share",
            value: l.max_burst_share,
            range: "above 0 and at most 1",
        });
    }
    if !(0.0..1.0).contains(&l.low_water) {
        return Err(SettingsError::LeaseFraction {
            setting: "low_water",
            value: l.low_water,
            range: "at least 0 and below 1",
        });
    }
    Ok(l.enabled.then(|| LeaseConfig {
        max_age: Duration::from_millis(l.max_age_ms),
        min_rate: l.min_rate,
        max_burst_share: l.max_burst_share,
        low_water: l.low_water,
    }))
}

/// The Redis backend's config: the URL list split and each URL parsed once, here.
fn redis_config(r: &RedisSection) -> Result<RedisConfig, SettingsError> {
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
    let sentinel = sentinel_config(r, urls.len())?;
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
        sentinel,
    };
    // The files are read here too, so `sluice check` reports one that cannot be used.
    crate::limiter::redis::validate(&config)?;
    Ok(config)
}

/// Redis Sentinel's part of the config: none while its master name and sentinels are empty.
fn sentinel_config(r: &RedisSection, urls: usize) -> Result<Option<SentinelConfig>, SettingsError> {
    let s = &r.sentinel;
    let master_name = s.master_name.trim();
    let sentinels: Vec<String> = s
        .urls
        .split(',')
        .map(|u| u.trim().to_string())
        .filter(|u| !u.is_empty())
        .collect();
    match (master_name.is_empty(), sentinels.is_empty()) {
        (true, true) => return Ok(None),
        (false, true) => {
            return Err(SettingsError::SentinelIncomplete {
                missing: "redis.sentinel.urls",
                given: "redis.sentinel.master_name",
            });
        }
        (true, false) => {
            return Err(SettingsError::SentinelIncomplete {
                missing: "redis.sentinel.master_name",
                given: "redis.sentinel.urls",
            });
        }
        (false, false) => {}
    }
    if r.cluster {
        return Err(SettingsError::SentinelWithCluster);
    }
    if urls > 1 {
        return Err(SettingsError::SentinelMasterUrl);
    }
    for url in &sentinels {
        ::redis::IntoConnectionInfo::into_connection_info(url.as_str()).map_err(|source| {
            SettingsError::SentinelUrl {
                url: crate::limiter::redis::redact(url),
                source,
            }
        })?;
    }
    Ok(Some(SentinelConfig {
        master_name: master_name.to_string(),
        urls: sentinels,
        password: Some(s.password.clone()).filter(|p| !p.is_empty()),
    }))
}

/// The trace export's settings, when on. The OTEL_* variables were read into the section when it
/// was layered; what is still empty takes the defaults here.
fn tracing_config(t: &TracingSection) -> Result<Option<crate::traces::Config>, SettingsError> {
    if !t.enabled {
        return Ok(None);
    }
    if !(0.0..=1.0).contains(&t.sampling_ratio) {
        return Err(SettingsError::SamplingRatio(t.sampling_ratio));
    }
    for (setting, value) in [
        ("tracing.max_value_bytes", t.max_value_bytes as u64),
        ("tracing.queue_size", t.queue_size as u64),
        ("tracing.batch_size", t.batch_size as u64),
        ("tracing.batch_delay_ms", t.batch_delay_ms),
        ("tracing.export_timeout_ms", t.export_timeout_ms),
    ] {
        if value == 0 {
            return Err(SettingsError::Zero { setting });
        }
    }
    let endpoint = if t.endpoint.is_empty() {
        match t.protocol {
            crate::traces::Protocol::Grpc => "http://localhost:4317".to_owned(),
            crate::traces::Protocol::Http => "http://localhost:4318".to_owned(),
        }
    } else {
        t.endpoint.clone()
    };
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(SettingsError::Tracing {
            setting: "tracing.endpoint",
            value: endpoint,
            why: "not an http:// or https:// URL",
        });
    }
    let mut resource = resource_attributes(&t.resource_attributes)?;
    let service_name = if t.service_name.is_empty() {
        resource
            .iter()
            .find(|(k, _)| k == "service.name")
            .map_or_else(|| "sluice".to_owned(), |(_, v)| v.clone())
    } else {
        t.service_name.clone()
    };
    resource.retain(|(k, _)| k != "service.name");
    resource.insert(0, ("service.name".to_owned(), service_name));
    Ok(Some(crate::traces::Config {
        protocol: t.protocol,
        endpoint,
        resource,
        sampling_ratio: t.sampling_ratio,
        descriptor_values: t.descriptor_values.then_some(t.max_value_bytes),
        queue_size: t.queue_size,
        batch_size: t.batch_size,
        batch_delay: Duration::from_millis(t.batch_delay_ms),
        export_timeout: Duration::from_millis(t.export_timeout_ms),
        shutdown_timeout: Duration::from_millis(t.shutdown_timeout_ms),
    }))
}

/// `key=value,key=value`, values percent-decoded (`OTEL_RESOURCE_ATTRIBUTES`' format).
fn resource_attributes(written: &str) -> Result<Vec<(String, String)>, SettingsError> {
    let mut out: Vec<(String, String)> = Vec::new();
    for pair in written.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = |why| SettingsError::Tracing {
            setting: "tracing.resource_attributes",
            value: pair.to_owned(),
            why,
        };
        let (key, value) = pair.split_once('=').ok_or_else(|| bad("not key=value"))?;
        let key = key.trim();
        if key.is_empty() {
            return Err(bad("an empty key"));
        }
        let value = percent_encoding::percent_decode_str(value.trim())
            .decode_utf8()
            .map_err(|_| bad("a value that is not UTF-8 once percent-decoded"))?;
        out.retain(|(k, _)| k != key);
        out.push((key.to_owned(), value.into_owned()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::SentinelSection;

    fn redis(url: &str) -> Written {
        Written {
            backend: BackendKind::Redis,
            redis: RedisSection {
                url: url.into(),
                ..RedisSection::default()
            },
            ..Written::default()
        }
    }

    #[test]
    fn values_out_of_range_name_the_setting() {
        let mut raw = Written::default();
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

    fn xds(tune: impl FnOnce(&mut Written)) -> Result<XdsSettings, String> {
        let mut raw = Written {
            policy_source: PolicySource::Xds,
            ..Written::default()
        };
        tune(&mut raw);
        raw.validate()
            .map(|s| s.xds.expect("the xds source"))
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_xds_url_gives_the_authority_host_and_tls() {
        assert_eq!(Written::default().validate().unwrap().xds, None);
        let plain = xds(|_| {}).unwrap();
        assert_eq!(
            (plain.authority.as_str(), plain.host.as_str(), plain.tls),
            ("localhost:18000", "localhost", None)
        );
        assert_eq!(plain.max_message_bytes, 4 << 20);
        assert_eq!(plain.backoff.initial, Duration::from_secs(10));
        let tls = xds(|w| w.xds.url = "https://envoy-gateway:18001/".into()).unwrap();
        assert_eq!(tls.authority, "envoy-gateway:18001");
        let t = tls.tls.expect("TLS from the scheme");
        assert_eq!(
            (t.server_name.as_str(), t.client.is_none()),
            ("envoy-gateway", true)
        );
        let san = xds(|w| {
            w.xds.url = "[::1]:18001".into();
            w.xds.tls.enabled = true;
            w.xds.tls.san = Some("envoy-gateway".into());
            w.xds.tls.cert_file = Some("/certs/tls.crt".into());
            w.xds.tls.key_file = Some("/certs/tls.key".into());
        })
        .unwrap();
        assert_eq!(san.host, "::1");
        let t = san.tls.unwrap();
        assert_eq!(t.server_name, "envoy-gateway");
        assert_eq!(
            t.client,
            Some(("/certs/tls.crt".into(), "/certs/tls.key".into()))
        );
    }

    #[test]
    fn xds_settings_that_cannot_be_used_name_the_setting() {
        type Tune = fn(&mut Written);
        let cases: [(&str, Tune); 9] = [
            ("xds.url", |w| w.xds.url = "envoy-gateway".into()),
            ("xds.url", |w| {
                w.xds.url = "grpc://envoy-gateway:18001".into()
            }),
            ("xds.url", |w| {
                w.xds.url = "http://envoy-gateway:18001".into();
                w.xds.tls.enabled = true;
            }),
            ("xds.node_id", |w| w.xds.node_id = " ".into()),
            ("xds.headers", |w| {
                w.xds.headers.insert("grpc-timeout".into(), "1s".into());
            }),
            ("xds.headers", |w| {
                w.xds.headers.insert("x-a".into(), "line\nbreak".into());
            }),
            ("xds.backoff.max_ms", |w| w.xds.backoff.max_ms = 1),
            ("xds.backoff.random_factor", |w| {
                w.xds.backoff.random_factor = 1.5;
            }),
            ("xds.tls.cert_file", |w| {
                w.xds.tls.enabled = true;
                w.xds.tls.cert_file = Some("/c".into());
            }),
        ];
        for (setting, tune) in cases {
            let err = xds(tune).unwrap_err();
            assert!(
                err.starts_with(&format!("invalid settings: {setting}")),
                "{err}"
            );
        }
        let err = xds(|w| w.xds.tls.ca_file = Some("/ca".into())).unwrap_err();
        assert!(err.contains("needs xds.tls.enabled"), "{err}");
        let err = xds(|w| w.xds.backoff.initial_ms = 0).unwrap_err();
        assert!(err.contains("xds.backoff.initial_ms"), "{err}");
    }

    #[test]
    fn lease_settings_are_checked_and_apply_to_redis_only() {
        let mut raw = redis("redis://a:6379");
        raw.redis.lease.enabled = true;
        raw.redis.lease.max_age_ms = 250;
        let s = raw.clone().validate().unwrap();
        let lease = s.lease.expect("leasing on");
        assert_eq!(lease.max_age, Duration::from_millis(250));
        assert_eq!((lease.min_rate, lease.max_burst_share), (20, 0.1));
        let mut memory = Written::default();
        memory.redis.lease.enabled = true;
        assert_eq!(
            memory.validate().unwrap().lease,
            None,
            "memory counts alone"
        );
        raw.redis.lease.max_burst_share = 0.0;
        let err = raw.clone().validate().unwrap_err().to_string();
        assert_eq!(
            err,
            "invalid settings: redis.lease.max_burst_share 0 is not above 0 and at most 1"
        );
        raw.redis.lease.max_burst_share = 0.5;
        raw.redis.lease.low_water = 1.0;
        let err = raw.clone().validate().unwrap_err().to_string();
        assert!(err.contains("redis.lease.low_water 1"), "{err}");
        raw.redis.lease.low_water = 0.0;
        raw.redis.lease.max_age_ms = 0;
        let err = raw.validate().unwrap_err().to_string();
        assert!(
            err.contains("redis.lease.max_age_ms must be at least 1"),
            "{err}"
        );
    }

    #[test]
    fn local_mode_settings_are_checked() {
        let mut raw = redis("redis://a:6379");
        raw.on_backend_error = decision::OnBackendError::Local;
        raw.redis.fleet_size = Some(3);
        raw.redis.heartbeat_interval_ms = 250;
        raw.store.max_keys = 10;
        let s = raw.clone().validate().unwrap();
        assert_eq!(s.decision.on_backend_error, decision::OnBackendError::Local);
        assert_eq!(s.local.fleet_size, Some(3));
        assert_eq!(s.local.heartbeat_interval, Duration::from_millis(250));
        assert_eq!(s.local.max_keys, 10);
        raw.redis.fleet_size = Some(0);
        let err = raw.clone().validate().unwrap_err().to_string();
        assert_eq!(err, "invalid settings: redis.fleet_size must be at least 1");
        raw.redis.fleet_size = None;
        raw.redis.heartbeat_interval_ms = 0;
        let err = raw.clone().validate().unwrap_err().to_string();
        assert!(err.contains("redis.heartbeat_interval_ms"), "{err}");
        raw.redis.heartbeat_interval_ms = MAX_HEARTBEAT_INTERVAL_MS + 1;
        let err = raw.validate().unwrap_err().to_string();
        assert!(err.contains("longer than an hour"), "{err}");
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
    fn top_keys_is_capped() {
        let mut raw = Written::default();
        raw.metrics.top_keys = crate::metrics::MAX_TOP_KEYS;
        assert!(raw.clone().validate().is_ok());
        raw.metrics.top_keys = crate::metrics::MAX_TOP_KEYS + 1;
        let e = raw.validate().unwrap_err().to_string();
        assert!(e.contains("metrics.top_keys 1001 is above 1000"), "{e}");
    }

    #[test]
    fn header_names_and_the_near_limit_ratio_are_checked() {
        let mut raw = Written::default();
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
    fn the_metrics_and_debug_listeners_are_off_unless_given_and_the_path_is_plain() {
        let s = Written::default().validate().unwrap();
        assert_eq!((s.metrics_listener, s.debug_addr), (None, None));
        let mut raw = Written::default();
        raw.metrics.addr = Some("0.0.0.0:19001".parse().unwrap());
        raw.metrics.path = "/stats/prometheus".into();
        raw.admin.debug_addr = Some("127.0.0.1:6070".parse().unwrap());
        let s = raw.clone().validate().unwrap();
        assert_eq!(
            s.metrics_listener,
            Some(("0.0.0.0:19001".parse().unwrap(), "/stats/prometheus".into()))
        );
        assert_eq!(s.debug_addr, Some("127.0.0.1:6070".parse().unwrap()));
        for bad in ["metrics", "/{x}", "/*rest", ""] {
            raw.metrics.path = bad.into();
            let err = raw.clone().validate().unwrap_err().to_string();
            assert!(err.contains("metrics.path"), "{bad}: {err}");
        }
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
        assert_eq!(s.local.fleet_size, None);
        assert_eq!(s.local.heartbeat_interval, Duration::from_secs(1));
        let memory = Settings::default();
        assert_eq!(
            memory.backend,
            BackendSettings::Memory {
                max_keys: 1_000_000,
                sweep_interval: Duration::from_secs(10)
            }
        );
    }

    #[test]
    fn sentinel_settings_are_checked_and_typed() {
        let sentinel = |master: &str, urls: &str| {
            let mut raw = redis("redis://:master-secret@127.0.0.1:6379/2");
            raw.redis.sentinel = SentinelSection {
                master_name: master.into(),
                urls: urls.into(),
                password: "sentinel-secret".into(),
            };
            raw
        };
        let s = sentinel(
            " mymaster ",
            "redis://10.0.0.1:26379, redis://10.0.0.2:26379",
        )
        .validate()
        .unwrap();
        let BackendSettings::Redis(redis) = &s.backend else {
            panic!("redis backend expected")
        };
        let sc = redis.sentinel.as_ref().expect("sentinel mode");
        assert_eq!(sc.master_name, "mymaster");
        assert_eq!(
            sc.urls,
            ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379"]
        );
        assert_eq!(sc.password.as_deref(), Some("sentinel-secret"));
        let shown = format!("{redis:?} {}", redis.describe());
        assert!(
            !shown.contains("sentinel-secret") && !shown.contains("master-secret"),
            "{shown}"
        );
        assert!(shown.contains("mymaster"), "{shown}");
        // Neither set: no sentinel.
        let BackendSettings::Redis(plain) = redis_default_backend() else {
            panic!("redis backend expected")
        };
        assert_eq!(plain.sentinel, None);
        for (raw, setting) in [
            (sentinel("m", ""), "redis.sentinel.urls is empty"),
            (
                sentinel("", "redis://10.0.0.1:26379"),
                "redis.sentinel.master_name is empty",
            ),
            (
                sentinel("m", "redis://:bad-secret@[::1:26379"),
                "redis.sentinel.urls",
            ),
            (
                {
                    let mut raw = sentinel("m", "redis://10.0.0.1:26379");
                    raw.redis.cluster = true;
                    raw
                },
                "redis.cluster",
            ),
            (
                {
                    let mut raw = sentinel("m", "redis://10.0.0.1:26379");
                    raw.redis.url = "redis://a:1,redis://b:2".into();
                    raw
                },
                "redis.url has several URLs",
            ),
        ] {
            let err = raw.validate().unwrap_err().to_string();
            assert!(err.contains(setting), "{err}");
            assert!(!err.contains("secret"), "{err}");
        }
    }

    fn redis_default_backend() -> BackendSettings {
        redis("redis://127.0.0.1:6379").validate().unwrap().backend
    }

    #[test]
    fn tls_needs_both_files_and_mtls_needs_a_certificate() {
        let tls = |cert: &str, key: &str, ca: &str, san: &str| {
            let mut raw = Written::default();
            let p = |v: &str| (!v.is_empty()).then(|| PathBuf::from(v));
            raw.grpc.tls.cert_file = p(cert);
            raw.grpc.tls.key_file = p(key);
            raw.grpc.tls.client_ca_file = p(ca);
            raw.grpc.tls.client_san = (!san.is_empty()).then(|| san.to_string());
            raw.validate().map(|s| s.grpc_tls)
        };
        assert_eq!(tls("", "", "", "").unwrap(), None);
        let on = tls("c.pem", "k.pem", "ca.pem", "envoy.local")
            .unwrap()
            .unwrap();
        assert_eq!(on.cert_file, PathBuf::from("c.pem"));
        assert_eq!(on.client_ca_file, Some(PathBuf::from("ca.pem")));
        assert_eq!(on.client_san.as_deref(), Some("envoy.local"));
        assert_eq!(on.handshake_timeout, Duration::from_secs(5));
        for (args, message) in [
            (
                ("c.pem", "", "", ""),
                "grpc.tls.cert_file needs grpc.tls.key_file",
            ),
            (
                ("", "k.pem", "", ""),
                "grpc.tls.key_file needs grpc.tls.cert_file",
            ),
            (
                ("", "", "ca.pem", ""),
                "grpc.tls.client_ca_file needs grpc.tls.cert_file",
            ),
            (
                ("c.pem", "k.pem", "", "x"),
                "grpc.tls.client_san needs grpc.tls.client_ca_file",
            ),
        ] {
            let err = tls(args.0, args.1, args.2, args.3).unwrap_err().to_string();
            assert_eq!(err, format!("invalid settings: {message}"));
        }
    }

    #[test]
    fn connection_age_is_off_by_default_and_typed_when_set() {
        let s = Settings::default();
        assert_eq!(s.grpc.max_connection_age, None);
        assert_eq!(s.grpc.max_connection_age_grace, Duration::from_secs(3_600));
        let mut raw = Written::default();
        raw.grpc.max_connection_age_ms = 90_000;
        raw.grpc.max_connection_age_grace_ms = 0;
        assert!(raw.clone().validate().is_err(), "a zero grace is refused");
        raw.grpc.max_connection_age_grace_ms = 1_000;
        let s = raw.validate().unwrap();
        assert_eq!(s.grpc.max_connection_age, Some(Duration::from_secs(90)));
    }

    #[test]
    fn tracing_is_off_by_default_and_fills_its_defaults_when_on() {
        assert_eq!(Written::default().validate().unwrap().tracing, None);
        let mut raw = Written::default();
        raw.tracing.enabled = true;
        raw.tracing.resource_attributes = "deployment.environment=prod%20eu,service.name=x".into();
        let t = raw.clone().validate().unwrap().tracing.unwrap();
        assert_eq!(t.endpoint, "http://localhost:4317");
        assert_eq!(
            t.resource,
            vec![
                ("service.name".to_owned(), "x".to_owned()),
                ("deployment.environment".to_owned(), "prod eu".to_owned()),
            ]
        );
        assert_eq!(t.descriptor_values, None);
        raw.tracing.service_name = "edge-rls".into();
        raw.tracing.descriptor_values = true;
        let t = raw.clone().validate().unwrap().tracing.unwrap();
        assert_eq!(
            t.resource[0],
            ("service.name".to_owned(), "edge-rls".to_owned())
        );
        assert_eq!(t.descriptor_values, Some(64));
        raw.tracing.sampling_ratio = 1.5;
        let err = raw.clone().validate().unwrap_err().to_string();
        assert!(err.contains("tracing.sampling_ratio"), "{err}");
        raw.tracing.sampling_ratio = 0.0;
        raw.tracing.endpoint = "collector:4317".into();
        let err = raw.clone().validate().unwrap_err().to_string();
        assert!(err.contains("tracing.endpoint"), "{err}");
        raw.tracing.endpoint = String::new();
        raw.tracing.resource_attributes = "novalue".into();
        let err = raw.validate().unwrap_err().to_string();
        assert!(err.contains("tracing.resource_attributes"), "{err}");
    }

    #[test]
    fn an_assignment_ttl_past_an_hour_is_refused() {
        let mut raw = Written::default();
        raw.rlqs.assignment_ttl_ms = 3_600_001;
        let err = raw.clone().validate().unwrap_err().to_string();
        assert!(
            err.starts_with("invalid settings: rlqs.assignment_ttl_ms must be at most 3600000"),
            "{err}"
        );
        raw.rlqs.assignment_ttl_ms = 3_600_000;
        assert!(raw.validate().is_ok());
    }

    #[test]
    fn an_assignment_ttl_under_a_second_is_refused() {
        let mut raw = Written::default();
        for ttl in [0, 1, 999] {
            raw.rlqs.assignment_ttl_ms = ttl;
            let err = raw.clone().validate().unwrap_err().to_string();
            assert!(
                err.starts_with("invalid settings: rlqs.assignment_ttl_ms must be at least 1000"),
                "{ttl}: {err}"
            );
        }
        raw.rlqs.assignment_ttl_ms = 1_000;
        assert!(raw.validate().is_ok());
    }
}
