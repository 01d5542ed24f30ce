//! Where counters live, from the reference's variables: `BACKEND_TYPE`, and `REDIS_URL` in
//! each of its forms (a unix socket, one host, a cluster's seeds, a Sentinel master and its
//! sentinels) with `REDIS_AUTH`, `REDIS_SENTINEL_AUTH` and `REDIS_TLS` folded into sluice's
//! `redis://` URLs. An unset `BACKEND_TYPE` is the reference's Redis, set beneath the settings
//! file; what sluice sizes differently (`LOCAL_CACHE_SIZE_IN_BYTES`, pools) is a warning.

use serde_json::json;

use super::{CompatError, Env, Mapped, bad, unsupported_error};

/// The reference's Redis when `REDIS_URL` is unset: its unix socket.
const DEFAULT_REDIS_URL: &str = "/var/run/nutcracker/ratelimit.sock";

/// `BACKEND_TYPE`, `REDIS_TYPE`, `REDIS_SOCKET_TYPE`, `REDIS_URL`, `REDIS_AUTH`,
/// `REDIS_SENTINEL_AUTH`, `REDIS_TLS` and its certificate variables, `CACHE_KEY_PREFIX`,
/// `LOCAL_CACHE_SIZE_IN_BYTES`.
pub(super) fn backend(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::compat::tests::{beneath, get, map, quiet};

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
}
