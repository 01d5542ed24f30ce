//! `CONFIG_TYPE=GRPC_XDS_SOTW`: policies from an xDS management server, with the reference's
//! `CONFIG_GRPC_XDS_*` and `XDS_CLIENT_*` variables as the `xds` section, and
//! `FORCE_START_WITHOUT_INITIAL_CONFIG` as `xds.force_start`. `CONFIG_TYPE=FILE` (or unset) is
//! the policy directory; any other value is an error.

use std::collections::BTreeMap;

use serde_json::json;

use super::{CompatError, Env, Mapped, bad};

/// Whether `CONFIG_TYPE` asks for the xDS source.
pub(super) fn selected(env: &Env<'_>) -> Result<bool, CompatError> {
    match env.get("CONFIG_TYPE") {
        None => Ok(false),
        Some(v) if v.eq_ignore_ascii_case("FILE") => Ok(false),
        Some(v) if v.eq_ignore_ascii_case("GRPC_XDS_SOTW") => Ok(true),
        Some(v) => Err(bad(
            "CONFIG_TYPE",
            v,
            "not supported: FILE (policies from the runtime directory) or GRPC_XDS_SOTW (from an \
             xDS server)",
        )),
    }
}

/// The xDS source and its variables, when `CONFIG_TYPE=GRPC_XDS_SOTW`.
pub(super) fn source(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    if let Some(force) = env.bool("FORCE_START_WITHOUT_INITIAL_CONFIG")? {
        m.set("xds.force_start", json!(force));
    }
    if !selected(env)? {
        return Ok(());
    }
    m.set("policy_source", json!("xds"));
    // The reference's default, where sluice's own is the same.
    m.set(
        "xds.url",
        json!(
            env.get("CONFIG_GRPC_XDS_SERVER_URL")
                .unwrap_or("localhost:18000")
        ),
    );
    if let Some(id) = env.get("CONFIG_GRPC_XDS_NODE_ID") {
        m.set("xds.node_id", json!(id));
    }
    if let Some(v) = env.get("CONFIG_GRPC_XDS_NODE_METADATA") {
        m.xds_maps.node_metadata = Some(pairs("CONFIG_GRPC_XDS_NODE_METADATA", v, '=')?);
    }
    if let Some(v) = env.get("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS") {
        m.xds_maps.headers = Some(pairs("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", v, ':')?);
    }
    if let Some(n) =
        env.parse::<usize>("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "not a number of bytes")?
    {
        m.set("xds.max_message_bytes", json!(n));
    }
    for (variable, setting) in [
        (
            "XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",
            "xds.backoff.initial_ms",
        ),
        ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "xds.backoff.max_ms"),
    ] {
        if let Some(v) = env.get(variable) {
            m.set(setting, json!(go_duration_ms(variable, v)?));
        }
    }
    if let Some(f) = env.parse::<f64>("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "not a number")? {
        m.set("xds.backoff.random_factor", json!(f));
    }
    if let Some(j) = env.bool("XDS_CLIENT_BACKOFF_JITTER")? {
        m.set("xds.backoff.jitter", json!(j));
    }
    if let Some(tls) = env.bool("CONFIG_GRPC_XDS_SERVER_USE_TLS")? {
        m.set("xds.tls.enabled", json!(tls));
    }
    let cert = env.get("CONFIG_GRPC_XDS_CLIENT_TLS_CERT");
    let key = env.get("CONFIG_GRPC_XDS_CLIENT_TLS_KEY");
    // The reference presents a client certificate only when both are set.
    if let (Some(cert), Some(key)) = (cert, key) {
        m.set("xds.tls.cert_file", json!(cert));
        m.set("xds.tls.key_file", json!(key));
    } else if cert.is_some() != key.is_some() {
        m.warn(
            "CONFIG_GRPC_XDS_CLIENT_TLS_CERT and CONFIG_GRPC_XDS_CLIENT_TLS_KEY: only one is set, \
             so no client certificate is presented (as the reference)"
                .into(),
        );
    }
    if let Some(ca) = env.get("CONFIG_GRPC_XDS_SERVER_TLS_CACERT") {
        m.set("xds.tls.ca_file", json!(ca));
    }
    if let Some(san) = env.get("CONFIG_GRPC_XDS_SERVER_TLS_SAN") {
        m.set("xds.tls.san", json!(san));
    }
    if env
        .get("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL")
        .is_some()
    {
        go_duration_ms(
            "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
            env.get("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL")
                .unwrap_or_default(),
        )?;
        m.warn(
            "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL: read, no effect (as in the reference, \
             whose retry interceptor retries nothing); reconnections wait as the \
             XDS_CLIENT_BACKOFF_* variables say"
                .into(),
        );
    }
    Ok(())
}

/// `k1<sep>v1,k2<sep>v2` as a map, split on the first `sep` of each pair.
fn pairs(
    variable: &'static str,
    text: &str,
    sep: char,
) -> Result<BTreeMap<String, String>, CompatError> {
    let mut map = BTreeMap::new();
    for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((k, v)) = pair.split_once(sep) else {
            return Err(bad(variable, pair, &format!("not key{sep}value")));
        };
        map.insert(k.trim().to_string(), v.trim().to_string());
    }
    Ok(map)
}

/// A Go duration (`10s`, `1m30s`, `500ms`, `1.5s`) in whole milliseconds.
fn go_duration_ms(variable: &'static str, text: &str) -> Result<u64, CompatError> {
    let err = || bad(variable, text, "not a duration (e.g. 10s, 500ms, 1m)");
    let mut rest = text;
    let mut total = 0.0f64;
    if rest.is_empty() {
        return Err(err());
    }
    while !rest.is_empty() {
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(err)?;
        let number: f64 = rest[..end].parse().map_err(|_| err())?;
        rest = &rest[end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let ms = match &rest[..unit_end] {
            "ns" => 1e-6,
            "us" | "µs" => 1e-3,
            "ms" => 1.0,
            "s" => 1_000.0,
            "m" => 60_000.0,
            "h" => 3_600_000.0,
            _ => return Err(err()),
        };
        total += number * ms;
        rest = &rest[unit_end..];
    }
    // Precision intended: whole milliseconds of a configured interval.
    Ok(total.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::compat::tests::{get, map, quiet};

    #[test]
    fn envoy_gateways_variables_are_the_xds_source() {
        let m = quiet(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
            ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ])
        .unwrap();
        assert_eq!(get(&m, "policy_source"), Some(&json!("xds")));
        assert_eq!(get(&m, "xds.url"), Some(&json!("envoy-gateway:18001")));
        assert_eq!(get(&m, "xds.node_id"), Some(&json!("envoy-ratelimit")));
        assert_eq!(get(&m, "xds.force_start"), Some(&json!(true)));
        assert_eq!(
            get(&m, "xds.tls"),
            Some(&json!({"enabled": true, "cert_file": "/certs/tls.crt",
                "key_file": "/certs/tls.key", "ca_file": "/certs/ca.crt"}))
        );
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
        // The reference's default URL.
        let m = quiet(&[("CONFIG_TYPE", "grpc_xds_sotw")]).unwrap();
        assert_eq!(get(&m, "xds.url"), Some(&json!("localhost:18000")));
        assert_eq!(get(&m, "xds.node_id"), None);
    }

    #[test]
    fn metadata_headers_sizes_and_backoff() {
        let m = quiet(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_NODE_METADATA", "zone=a=b, team=rl"),
            (
                "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
                "x-token:abc:def,x-env:prod",
            ),
            ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "8388608"),
            ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "1.5s"),
            ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "2m"),
            ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "0.2"),
            ("XDS_CLIENT_BACKOFF_JITTER", "false"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "envoy-gateway"),
        ])
        .unwrap();
        let expected = |pairs: &[(&str, &str)]| {
            Some(
                pairs
                    .iter()
                    .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                    .collect::<BTreeMap<_, _>>(),
            )
        };
        assert_eq!(
            m.xds_maps.node_metadata,
            expected(&[("zone", "a=b"), ("team", "rl")])
        );
        assert_eq!(
            m.xds_maps.headers,
            expected(&[("x-token", "abc:def"), ("x-env", "prod")])
        );
        assert_eq!(get(&m, "xds.max_message_bytes"), Some(&json!(8_388_608)));
        assert_eq!(
            get(&m, "xds.backoff"),
            Some(
                &json!({"initial_ms": 1500, "max_ms": 120_000, "random_factor": 0.2, "jitter": false})
            )
        );
        assert_eq!(get(&m, "xds.tls.san"), Some(&json!("envoy-gateway")));
        for (variable, value) in [
            ("CONFIG_GRPC_XDS_NODE_METADATA", "zone"),
            ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "x-token=abc"),
            ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", "4MiB"),
            ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "10"),
            ("XDS_CLIENT_BACKOFF_JITTER", "yes"),
            ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "3 s"),
        ] {
            let err = map(&[("CONFIG_TYPE", "GRPC_XDS_SOTW"), (variable, value)]).unwrap_err();
            assert_eq!(err.variable, variable, "{value}");
        }
    }

    #[test]
    fn the_retry_interval_and_a_lone_client_file_are_warned_of() {
        let m = quiet(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "3s"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
        ])
        .unwrap();
        assert_eq!(m.warnings.len(), 2, "{:?}", m.warnings);
        assert!(m.warnings.iter().any(|w| {
            w.starts_with("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL: read, no effect")
        }));
        assert_eq!(get(&m, "xds.tls.cert_file"), None);
    }

    #[test]
    fn file_is_the_directory_and_other_types_are_errors() {
        let m = quiet(&[("CONFIG_TYPE", "FILE"), ("CONFIG_GRPC_XDS_NODE_ID", "x")]).unwrap();
        assert_eq!(get(&m, "policy_source"), None);
        assert_eq!(get(&m, "xds.node_id"), None);
        let err = map(&[("CONFIG_TYPE", "GRPC_XDS_DELTA")]).unwrap_err();
        assert_eq!(err.variable, "CONFIG_TYPE");
        assert!(err.reason.contains("GRPC_XDS_SOTW"), "{}", err.reason);
    }

    #[test]
    fn go_durations() {
        for (text, ms) in [
            ("10s", 10_000),
            ("1m30s", 90_000),
            ("500ms", 500),
            ("1h", 3_600_000),
            ("0.5s", 500),
        ] {
            assert_eq!(go_duration_ms("V", text).unwrap(), ms, "{text}");
        }
        for text in ["", "10", "s", "1x", "1.2.3s"] {
            assert!(go_duration_ms("V", text).is_err(), "{text}");
        }
    }
}
