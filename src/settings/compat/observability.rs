//! Logs and metrics, from the reference's variables: `LOG_LEVEL` (logrus names) and
//! `LOG_FORMAT` as settings; `USE_PROMETHEUS` with `PROMETHEUS_ADDR`/`PROMETHEUS_PATH` as the
//! metrics listener; statsd, DogStatsD and a custom statsd mapping as warnings, since sluice
//! serves Prometheus text only, under the reference's default mapping's names; `TRACING_*` as
//! `tracing`, exported over HTTP unless `TRACING_EXPORTER_PROTOCOL` says otherwise (the
//! reference's default).

use serde_json::json;

use super::listeners::parse_go_addr;
use super::{CompatError, Env, Mapped, bad};

/// The reference's Prometheus listener when `PROMETHEUS_ADDR` is unset.
const DEFAULT_PROMETHEUS_ADDR: &str = ":9090";

/// `LOG_LEVEL` (logrus names) and `LOG_FORMAT`.
pub(super) fn logging(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
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

/// `USE_STATSD`, `USE_DOG_STATSD`, `USE_PROMETHEUS`, `PROMETHEUS_ADDR`, `PROMETHEUS_PATH`.
pub(super) fn metrics(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    // Unset is the reference's default, true: such a Deployment fed statsd.
    if env.bool("USE_STATSD")? != Some(false) {
        m.warn(
            "USE_STATSD: statsd is not offered; metrics are served for Prometheus on the admin \
             port's /metrics (and on PROMETHEUS_ADDR with USE_PROMETHEUS=true), under the \
             reference's Prometheus names"
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
    if env.bool("USE_PROMETHEUS")? == Some(true) {
        let text = env
            .get("PROMETHEUS_ADDR")
            .unwrap_or(DEFAULT_PROMETHEUS_ADDR);
        let addr = parse_go_addr(text).ok_or_else(|| {
            bad(
                "PROMETHEUS_ADDR",
                text,
                "not a listen address (:9090, 0.0.0.0:9090, [::1]:9090)",
            )
        })?;
        m.set("metrics.addr", json!(addr.to_string()));
        if let Some(path) = env.get("PROMETHEUS_PATH") {
            m.set("metrics.path", json!(path));
        }
        if env.get("PROMETHEUS_MAPPER_YAML").is_some() {
            m.warn(
                "PROMETHEUS_MAPPER_YAML: not read; the series carry the names and labels of the \
                 reference's default mapping (ratelimit_service_rate_limit_*{domain,key1,key2}, \
                 the ones Envoy Gateway's mapping gives)"
                    .into(),
            );
        }
        if env.bool("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS")? == Some(true) {
            m.warn(
                "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS: not offered; \
                 ratelimit_service_response_time_seconds is in seconds"
                    .into(),
            );
        }
    } else if env.any_set(&[
        "PROMETHEUS_ADDR",
        "PROMETHEUS_PATH",
        "PROMETHEUS_MAPPER_YAML",
    ]) {
        m.warn(
            "PROMETHEUS_ADDR/PROMETHEUS_PATH/PROMETHEUS_MAPPER_YAML: not read without \
             USE_PROMETHEUS=true (as the reference); metrics are served on the admin port's \
             /metrics"
                .into(),
        );
    }
    Ok(())
}

/// `TRACING_ENABLED`, `TRACING_EXPORTER_PROTOCOL`, `TRACING_SERVICE_NAME`,
/// `TRACING_SERVICE_NAMESPACE`, `TRACING_SERVICE_INSTANCE_ID`, `TRACING_SAMPLING_RATE`; the
/// reference's service name, `RateLimit`, beneath the settings file when tracing is on.
pub(super) fn tracing(env: &Env<'_>, m: &mut Mapped) -> Result<(), CompatError> {
    let enabled = env.bool("TRACING_ENABLED")?;
    if let Some(on) = enabled {
        m.set("tracing.enabled", json!(on));
    }
    if let Some(v) = env.get("TRACING_EXPORTER_PROTOCOL") {
        let protocol = match v.to_ascii_lowercase().as_str() {
            "grpc" => "grpc",
            "http" => "http",
            _ => return Err(bad("TRACING_EXPORTER_PROTOCOL", v, "not http or grpc")),
        };
        m.set("tracing.protocol", json!(protocol));
    } else if enabled == Some(true) {
        // The reference's default; sluice's own is gRPC.
        m.beneath("tracing.protocol", json!("http"));
    }
    match env.get("TRACING_SERVICE_NAME") {
        Some(v) => m.set("tracing.service_name", json!(v)),
        None if enabled == Some(true) => m.beneath("tracing.service_name", json!("RateLimit")),
        None => {}
    }
    let mut attributes = Vec::new();
    for (variable, key) in [
        ("TRACING_SERVICE_NAMESPACE", "service.namespace"),
        ("TRACING_SERVICE_INSTANCE_ID", "service.instance.id"),
    ] {
        if let Some(v) = env.get(variable).filter(|v| !v.is_empty()) {
            let value =
                percent_encoding::utf8_percent_encode(v, percent_encoding::NON_ALPHANUMERIC);
            attributes.push(format!("{key}={value}"));
        }
    }
    if !attributes.is_empty() {
        m.set("tracing.resource_attributes", json!(attributes.join(",")));
    }
    if let Some(v) = env.get("TRACING_SAMPLING_RATE") {
        let rate: f64 = v
            .trim()
            .parse()
            .ok()
            .filter(|r| (0.0..=1.0).contains(r))
            .ok_or_else(|| bad("TRACING_SAMPLING_RATE", v, "not a number from 0 to 1"))?;
        m.set("tracing.sampling_ratio", json!(rate));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::compat::tests::{beneath, get, map, quiet};

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
    fn use_prometheus_opens_the_metrics_listener() {
        // Envoy Gateway's variables.
        let m = quiet(&[
            ("USE_PROMETHEUS", "true"),
            ("PROMETHEUS_ADDR", ":19001"),
            ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
        ])
        .unwrap();
        assert_eq!(get(&m, "metrics.addr"), Some(&json!("0.0.0.0:19001")));
        assert_eq!(get(&m, "metrics.path"), None);
        assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
        assert!(m.warnings[0].starts_with("PROMETHEUS_MAPPER_YAML"));
        // The reference's defaults, and a path of its own.
        let m = quiet(&[("USE_PROMETHEUS", "true")]).unwrap();
        assert_eq!(get(&m, "metrics.addr"), Some(&json!("0.0.0.0:9090")));
        let m = quiet(&[("USE_PROMETHEUS", "1"), ("PROMETHEUS_PATH", "/prom")]).unwrap();
        assert_eq!(get(&m, "metrics.path"), Some(&json!("/prom")));
        // Without USE_PROMETHEUS the others are not read, as in the reference; said so.
        let m = quiet(&[("PROMETHEUS_ADDR", ":19001")]).unwrap();
        assert_eq!(get(&m, "metrics.addr"), None);
        assert!(
            m.warnings[0].starts_with("PROMETHEUS_ADDR"),
            "{:?}",
            m.warnings
        );
        assert_eq!(
            map(&[("USE_PROMETHEUS", "true"), ("PROMETHEUS_ADDR", "19001")])
                .unwrap_err()
                .variable,
            "PROMETHEUS_ADDR"
        );
    }

    /// Envoy Gateway turns tracing on with a collector's HTTP port and no protocol: the
    /// reference then exports over OTLP/HTTP, and so does sluice.
    #[test]
    fn tracing_without_a_protocol_exports_over_http_as_the_reference() {
        let m = map(&[
            ("TRACING_ENABLED", "true"),
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "http://otel-collector.monitoring:4318",
            ),
        ])
        .unwrap();
        assert_eq!(beneath(&m, "tracing.protocol"), Some(&json!("http")));
        assert_eq!(get(&m, "tracing.protocol"), None);
        let m = map(&[
            ("TRACING_ENABLED", "true"),
            ("TRACING_EXPORTER_PROTOCOL", "grpc"),
        ])
        .unwrap();
        assert_eq!(get(&m, "tracing.protocol"), Some(&json!("grpc")));
        assert_eq!(beneath(&m, "tracing.protocol"), None);
        // Tracing off: sluice's own default is left alone.
        assert_eq!(beneath(&map(&[]).unwrap(), "tracing.protocol"), None);
    }

    #[test]
    fn tracing_variables_map_to_the_tracing_section() {
        let m = map(&[
            ("TRACING_ENABLED", "true"),
            ("TRACING_EXPORTER_PROTOCOL", "HTTP"),
            ("TRACING_SERVICE_NAMESPACE", "edge"),
            ("TRACING_SERVICE_INSTANCE_ID", "pod 7"),
            ("TRACING_SAMPLING_RATE", "0.25"),
        ])
        .unwrap();
        assert_eq!(get(&m, "tracing.enabled"), Some(&json!(true)));
        assert_eq!(get(&m, "tracing.protocol"), Some(&json!("http")));
        assert_eq!(get(&m, "tracing.sampling_ratio"), Some(&json!(0.25)));
        assert_eq!(
            get(&m, "tracing.resource_attributes"),
            Some(&json!("service.namespace=edge,service.instance.id=pod%207"))
        );
        assert_eq!(
            crate::settings::compat::tests::beneath(&m, "tracing.service_name"),
            Some(&json!("RateLimit"))
        );
        let m = map(&[("TRACING_SERVICE_NAME", "rls")]).unwrap();
        assert_eq!(get(&m, "tracing.service_name"), Some(&json!("rls")));
        for (variable, value) in [
            ("TRACING_EXPORTER_PROTOCOL", "thrift"),
            ("TRACING_SAMPLING_RATE", "2"),
            ("TRACING_ENABLED", "maybe"),
        ] {
            assert_eq!(map(&[(variable, value)]).unwrap_err().variable, variable);
        }
    }
}
