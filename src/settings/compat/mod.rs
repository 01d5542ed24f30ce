//! `compat: envoy-ratelimit`: envoyproxy/ratelimit's environment variables read as sluice
//! settings, so a Deployment written for it runs unchanged. Opt-in: without it none of these
//! names is read. [`from_env`] is pure: the variables give setting overrides, the reference's
//! defaults that go beneath the settings file (its Redis backend) and warnings for what is read
//! but not acted on; `layers` puts the overrides between the file and `SLUICE_*`. A value that
//! cannot be read, or that asks for what sluice cannot do without changing decisions or
//! security, is an error naming the variable. One module per group of variables.

mod decisions;
mod listeners;
mod observability;
mod policies;
mod redis;
mod xds;

use std::collections::BTreeMap;

use serde_json::Value;

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
    /// `xds.node_metadata` and `xds.headers`, set on the layered settings rather than through
    /// the layers, whose paths would split a key with a dot in it.
    pub xds_maps: XdsMaps,
}

/// The two maps of the `xds` section, when their variables are set.
#[derive(Debug, Default, PartialEq)]
pub(super) struct XdsMaps {
    /// `CONFIG_GRPC_XDS_NODE_METADATA`.
    pub node_metadata: Option<BTreeMap<String, String>>,
    /// `CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS`.
    pub headers: Option<BTreeMap<String, String>>,
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

/// The reference's variables in `vars` as sluice settings.
///
/// # Errors
///
/// [`CompatError`] naming the first variable whose value cannot be read, or that asks for
/// something sluice does not offer yet and cannot ignore.
pub(super) fn from_env(vars: &BTreeMap<String, String>) -> Result<Mapped, CompatError> {
    let env = Env(vars);
    let mut m = Mapped::default();
    listeners::addresses(&env, &mut m)?;
    observability::logging(&env, &mut m)?;
    xds::source(&env, &mut m)?;
    policies::runtime(&env, &mut m)?;
    redis::backend(&env, &mut m)?;
    decisions::answers(&env, &mut m)?;
    observability::metrics(&env, &mut m)?;
    observability::tracing(&env, &mut m)?;
    listeners::grpc(&env, &mut m)?;
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

/// Variables that ask for what sluice does not offer yet, where ignoring them would change
/// where configuration comes from or where clients connect: errors.
fn unsupported(env: &Env<'_>) -> Result<(), CompatError> {
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
    use serde_json::json;

    use super::*;

    pub(super) fn map(vars: &[(&str, &str)]) -> Result<Mapped, CompatError> {
        from_env(
            &vars
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
        )
    }

    /// The setting at dotted `name` in `map`.
    pub(super) fn at<'a>(map: &'a serde_json::Map<String, Value>, name: &str) -> Option<&'a Value> {
        let mut parts = name.split('.');
        let first = map.get(parts.next()?)?;
        parts.try_fold(first, |v, part| v.get(part))
    }

    /// The setting at dotted `name` above the settings file.
    pub(super) fn get<'a>(m: &'a Mapped, name: &str) -> Option<&'a Value> {
        at(&m.overrides, name)
    }

    /// `vars` with what a Deployment that feeds no statsd and names its backend sets, for the
    /// tests of other variables' warnings.
    pub(super) fn quiet(vars: &[(&str, &str)]) -> Result<Mapped, CompatError> {
        let mut all = vec![("USE_STATSD", "false"), ("BACKEND_TYPE", "redis")];
        all.extend_from_slice(vars);
        map(&all)
    }

    /// The setting at dotted `name` beneath the settings file.
    pub(super) fn beneath<'a>(m: &'a Mapped, name: &str) -> Option<&'a Value> {
        at(&m.defaults, name)
    }

    #[test]
    fn no_reference_variable_the_references_defaults_beneath_the_file() {
        let m = map(&[("PATH", "/bin"), ("SLUICE_GRPC_ADDR", "127.0.0.1:1")]).unwrap();
        // The reference counts in Redis over its default unix socket, feeds statsd and opens
        // its debug port; an unset variable says less than a settings file, so these defaults
        // go beneath it.
        assert!(m.overrides.is_empty(), "{:?}", m.overrides);
        assert_eq!(
            Value::Object(m.defaults),
            json!({"backend": "redis", "redis": {
                "url": "unix:///var/run/nutcracker/ratelimit.sock", "cluster": false},
                "admin": {"debug_addr": "0.0.0.0:6070"}})
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
        assert_eq!(get(&m, "metrics.addr"), Some(&json!("0.0.0.0:9090")));
        assert_eq!(
            map(&[("GRPC_SERVER_USE_TLS", "true")])
                .unwrap_err()
                .variable,
            "GRPC_SERVER_TLS_CERT"
        );
        assert_eq!(
            map(&[("CONFIG_TYPE", "GRPC_XDS_DELTA")])
                .unwrap_err()
                .variable,
            "CONFIG_TYPE"
        );
    }
}
