//! Logs and metrics, from the reference's variables: `LOG_LEVEL` (logrus names) and
//! `LOG_FORMAT` as settings; statsd, DogStatsD and its own Prometheus port as warnings, since
//! sluice serves its metrics for Prometheus on the admin port only; `TRACING_*` as `tracing`.

use serde_json::json;

use super::{CompatError, Env, Mapped, bad};

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
    use crate::settings::compat::tests::{get, map};

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
