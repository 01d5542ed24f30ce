//! Logs and metrics, from the reference's variables: `LOG_LEVEL` (logrus names) and
//! `LOG_FORMAT` as settings; statsd, DogStatsD, its own Prometheus port and tracing export as
//! warnings, since sluice serves its metrics for Prometheus on the admin port only.

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
    if env.bool("TRACING_ENABLED")? == Some(true) {
        m.warn("TRACING_ENABLED=true: tracing export is not supported yet".into());
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
}
