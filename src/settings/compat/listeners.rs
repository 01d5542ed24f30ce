//! Where sluice listens, from the reference's variables: `HOST`:`PORT` (its HTTP port, sluice's
//! admin port), `GRPC_HOST`:`GRPC_PORT` and `DEBUG_HOST`:`DEBUG_PORT` (its debug port, on by
//! default at 6070, sluice's `admin.debug_addr`), a missing half taking the reference's default;
//! the gRPC port's TLS and mTLS (read only with `GRPC_SERVER_USE_TLS=true`, as the reference
//! does) and its connection age, written as Go durations. `parse_go_addr` reads a Go listen
//! address (`:9090`) for `PROMETHEUS_ADDR`.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use serde_json::json;

use super::{CompatError, Env, Mapped, bad, unsupported_error};

/// The reference's defaults for the halves of an address left unset.
const DEFAULT_HOST: IpAddr = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
const DEFAULT_PORT: u16 = 8080;
const DEFAULT_GRPC_PORT: u16 = 8081;
const DEFAULT_DEBUG_PORT: u16 = 6070;

/// `HOST`:`PORT` (the HTTP port: sluice's admin port), `GRPC_HOST`:`GRPC_PORT` and
/// `DEBUG_HOST`:`DEBUG_PORT` (the debug port, which the reference always opens: unset, its
/// default goes beneath the settings file).
pub(super) fn addresses(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    for (host, port, default_port, setting) in [
        ("HOST", "PORT", DEFAULT_PORT, "admin_addr"),
        ("GRPC_HOST", "GRPC_PORT", DEFAULT_GRPC_PORT, "grpc_addr"),
        (
            "DEBUG_HOST",
            "DEBUG_PORT",
            DEFAULT_DEBUG_PORT,
            "admin.debug_addr",
        ),
    ] {
        if !env.any_set(&[host, port]) {
            if setting == "admin.debug_addr" {
                let addr = SocketAddr::new(DEFAULT_HOST, DEFAULT_DEBUG_PORT);
                m.beneath(setting, json!(addr.to_string()));
            }
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
    Ok(())
}

/// A Go listen address as `net.Listen` takes it (`:9090`, `0.0.0.0:9090`, `localhost:9090`,
/// `[::1]:9090`): an empty host is every interface. `None` when it is not one.
pub(super) fn parse_go_addr(text: &str) -> Option<SocketAddr> {
    let (host, port) = text.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let ip = match host {
        "" => DEFAULT_HOST,
        "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        h => h
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .ok()?,
    };
    Some(SocketAddr::new(ip, port))
}

/// `GRPC_SERVER_USE_TLS` with `GRPC_SERVER_TLS_CERT`/`_KEY`, `GRPC_CLIENT_TLS_CACERT` and
/// `GRPC_CLIENT_TLS_SAN` (mTLS), `GRPC_MAX_CONNECTION_AGE` and `GRPC_MAX_CONNECTION_AGE_GRACE`.
/// The reference reads the certificate variables only with `GRPC_SERVER_USE_TLS=true`, and so
/// does this; TLS asked for without a certificate and key is an error, never plaintext.
pub(super) fn grpc(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
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
        } else if env.get("GRPC_SERVER_TLS_CA_CERT").is_some() {
            // Envoy Gateway sets it; the reference has never read it.
            m.warn(
                "GRPC_SERVER_TLS_CA_CERT: not a variable of the reference, which does not read it; \
                 the gRPC port serves TLS without asking for client certificates, as the reference \
                 does under Envoy Gateway (GRPC_CLIENT_TLS_CACERT turns client-certificate checks on)"
                    .into(),
            );
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
        "GRPC_SERVER_TLS_CA_CERT",
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::compat::tests::{get, map, quiet};

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
    fn the_debug_port_is_on_at_the_references_default_unless_moved() {
        // Unset: the reference's debug port, beneath the settings file, and nothing said.
        let m = quiet(&[]).unwrap();
        assert_eq!(
            crate::settings::compat::tests::beneath(&m, "admin.debug_addr"),
            Some(&json!("0.0.0.0:6070"))
        );
        assert_eq!(get(&m, "admin.debug_addr"), None);
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
        let m = quiet(&[("DEBUG_HOST", "127.0.0.1"), ("DEBUG_PORT", "0")]).unwrap();
        assert_eq!(get(&m, "admin.debug_addr"), Some(&json!("127.0.0.1:0")));
        let m = quiet(&[("DEBUG_PORT", "7070")]).unwrap();
        assert_eq!(get(&m, "admin.debug_addr"), Some(&json!("0.0.0.0:7070")));
        assert_eq!(
            map(&[("DEBUG_PORT", "x")]).unwrap_err().variable,
            "DEBUG_PORT"
        );
    }

    #[test]
    fn go_listen_addresses() {
        for (text, addr) in [
            (":19001", "0.0.0.0:19001"),
            ("0.0.0.0:9090", "0.0.0.0:9090"),
            ("localhost:9090", "127.0.0.1:9090"),
            ("[::1]:9090", "[::1]:9090"),
            ("127.0.0.1:0", "127.0.0.1:0"),
        ] {
            assert_eq!(parse_go_addr(text), Some(addr.parse().unwrap()), "{text}");
        }
        for bad in ["9090", ":http", "example.com:80", ":70000", ""] {
            assert_eq!(parse_go_addr(bad), None, "{bad}");
        }
    }

    /// Envoy Gateway's gRPC variables: TLS with its certificate and key; its CA variable, which
    /// the reference does not read, is said to be unread and asks for no client certificate.
    #[test]
    fn envoy_gateways_ca_variable_is_not_read_and_said_so() {
        let eg = [
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/certs/tls.crt"),
            ("GRPC_SERVER_TLS_KEY", "/certs/tls.key"),
            ("GRPC_SERVER_TLS_CA_CERT", "/certs/ca.crt"),
        ];
        let m = quiet(&eg).unwrap();
        assert_eq!(
            get(&m, "grpc.tls.cert_file"),
            Some(&json!("/certs/tls.crt"))
        );
        assert_eq!(get(&m, "grpc.tls.client_ca_file"), None);
        assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
        assert!(
            m.warnings[0].starts_with("GRPC_SERVER_TLS_CA_CERT")
                && m.warnings[0].contains("without asking for client certificates"),
            "{:?}",
            m.warnings
        );
        // With the reference's own variable, client certificates are checked against it.
        let mut mtls = eg.to_vec();
        mtls.push(("GRPC_CLIENT_TLS_CACERT", "/certs/client-ca.crt"));
        let m = quiet(&mtls).unwrap();
        assert_eq!(
            get(&m, "grpc.tls.client_ca_file"),
            Some(&json!("/certs/client-ca.crt"))
        );
        assert!(m.warnings.is_empty(), "{:?}", m.warnings);
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
