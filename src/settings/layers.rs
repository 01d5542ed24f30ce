//! How [`Written`] is filled in: built-in defaults, an optional settings file (YAML), with
//! `compat: envoy-ratelimit` the reference service's variables (`super::compat`), `SLUICE_*`
//! environment variables (`__` between nested names, e.g.
//! `SLUICE_REQUESTS__MAX_DESCRIPTORS=16`) and the command line's [`Overrides`], in that order,
//! each over the one before. Nothing here validates (see `validate`).

use std::net::SocketAddr;
use std::path::PathBuf;

use config::{Config, Environment, File, FileFormat};

use super::compat::{self, Compat};
use super::written::TracingSection;
use super::{BackendKind, SettingsError, Written};
use crate::decision::{HeaderMode, OnBackendError};
use crate::telemetry::LogFormat;

/// The settings the command line can set, over every other source; `None` leaves a setting
/// to them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `compat`, deciding which environment is read (the binary invoked as `ratelimit` reads
    /// envoyproxy/ratelimit's).
    pub compat: Option<Compat>,
    /// `policies`.
    pub policies: Option<PathBuf>,
    /// `grpc_addr`.
    pub grpc_addr: Option<SocketAddr>,
    /// `admin_addr`.
    pub admin_addr: Option<SocketAddr>,
    /// `log_format`.
    pub log_format: Option<LogFormat>,
    /// `log_level`.
    pub log_level: Option<String>,
    /// `store.max_keys`.
    pub max_keys: Option<usize>,
    /// `backend`.
    pub backend: Option<BackendKind>,
    /// `redis.url`.
    pub redis_url: Option<String>,
    /// `on_backend_error`.
    pub on_backend_error: Option<OnBackendError>,
    /// `response_headers`.
    pub response_headers: Option<HeaderMode>,
}

impl Written {
    /// Layers the sources: defaults, then (with `compat: envoy-ratelimit`, from the file or
    /// `SLUICE_COMPAT`) the reference's defaults where they differ from sluice's, then `file`
    /// when given, then the reference's variables that are set, then `SLUICE_*` variables,
    /// then `flags`. Nothing is validated yet (see [`Written::validate`]).
    ///
    /// # Errors
    ///
    /// [`SettingsError::Load`] when a source cannot be read, or a field is unknown or
    /// mistyped; [`SettingsError::Compat`] naming a reference variable that cannot be used.
    pub fn load(file: Option<&std::path::Path>, flags: &Overrides) -> Result<Self, SettingsError> {
        Self::load_with_env(file, flags, std::env::vars().collect())
    }

    /// As [`Written::load`], with `env` standing for the process environment.
    fn load_with_env(
        file: Option<&std::path::Path>,
        flags: &Overrides,
        env: std::collections::BTreeMap<String, String>,
    ) -> Result<Self, SettingsError> {
        let layered = |compat: Option<&compat::Mapped>| {
            let mut builder = Config::builder().add_source(Config::try_from(&Written::default())?);
            if let Some(mapped) = compat {
                builder = builder.add_source(Config::try_from(&mapped.defaults)?);
            }
            if let Some(path) = file {
                builder =
                    builder.add_source(File::from(path).format(FileFormat::Yaml).required(true));
            }
            if let Some(mapped) = compat {
                builder = builder.add_source(Config::try_from(&mapped.overrides)?);
            }
            builder
                .add_source(
                    Environment::with_prefix("SLUICE")
                        .prefix_separator("_")
                        .separator("__")
                        .try_parsing(true)
                        .source(Some(settings_from_env(env.clone().into_iter()))),
                )
                .build()?
                .try_deserialize::<Written>()
        };
        let mut settings = layered(None)?;
        let mut default_socket = None;
        if flags.compat.unwrap_or(settings.compat) == Compat::EnvoyRatelimit {
            let mapped = compat::from_env(&env)?;
            settings = layered(Some(&mapped))?;
            settings.compat = Compat::EnvoyRatelimit;
            // Above the file, as the other variables are (no `SLUICE_*` variable names a map).
            if let Some(m) = mapped.xds_maps.node_metadata {
                settings.xds.node_metadata = m;
            }
            if let Some(h) = mapped.xds_maps.headers {
                settings.xds.headers = h;
            }
            settings.compat_warnings = mapped.warnings;
            setting_names(
                &serde_json::Value::Object(mapped.overrides),
                "",
                &mut settings.compat_set,
            );
            default_socket = mapped.default_socket;
        }
        if let Some(p) = &flags.policies {
            settings.policies.clone_from(p);
        }
        if let Some(a) = flags.grpc_addr {
            settings.grpc_addr = a;
        }
        if let Some(a) = flags.admin_addr {
            settings.admin_addr = a;
        }
        if let Some(f) = flags.log_format {
            settings.log_format = f;
        }
        if let Some(l) = &flags.log_level {
            settings.log_level.clone_from(l);
        }
        if let Some(n) = flags.max_keys {
            settings.store.max_keys = n;
        }
        if let Some(b) = flags.backend {
            settings.backend = b;
        }
        if let Some(u) = &flags.redis_url {
            settings.redis.url.clone_from(u);
        }
        if let Some(o) = flags.on_backend_error {
            settings.on_backend_error = o;
        }
        if let Some(h) = flags.response_headers {
            settings.response_headers = h;
        }
        otel_variables(&mut settings.tracing, &env);
        // Said once the file, `SLUICE_*` and the flags have had their say.
        if let Some(url) = default_socket
            && settings.backend == BackendKind::Redis
            && settings.redis.url == url
        {
            settings.compat_warnings.push(format!(
                "REDIS_URL unset: counting in Redis at the reference's default, {url}; set \
                 REDIS_URL, or SLUICE_BACKEND=memory for counters in memory on each node"
            ));
        }
        Ok(settings)
    }
}

/// The standard OpenTelemetry variables, under every other source: each fills in its setting
/// only when no source set it (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` before
/// `OTEL_EXPORTER_OTLP_ENDPOINT`).
fn otel_variables(t: &mut TracingSection, env: &std::collections::BTreeMap<String, String>) {
    let var = |name: &str| env.get(name).filter(|v| !v.trim().is_empty()).cloned();
    if t.endpoint.is_empty()
        && let Some(v) =
            var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT"))
    {
        t.endpoint = v;
    }
    if t.service_name.is_empty()
        && let Some(v) = var("OTEL_SERVICE_NAME")
    {
        t.service_name = v;
    }
    if let Some(v) = var("OTEL_RESOURCE_ATTRIBUTES") {
        // Both apply, the setting's pairs over the variable's.
        t.resource_attributes = if t.resource_attributes.is_empty() {
            v
        } else {
            format!("{v},{}", t.resource_attributes)
        };
    }
}

/// The `SLUICE_*` variables that name a setting. Others are left alone: Kubernetes, for one,
/// gives every pod `SLUICE_PORT`, `SLUICE_SERVICE_HOST` and so on for a Service named `sluice`,
/// and those must not stop the server. (The settings file, by contrast, is strict.)
fn settings_from_env(vars: impl Iterator<Item = (String, String)>) -> config::Map<String, String> {
    let mut known = Vec::new();
    if let Ok(defaults) = serde_json::to_value(Written::default()) {
        setting_names(&defaults, "", &mut known);
    }
    vars.filter(|(name, _)| {
        name.strip_prefix("SLUICE_")
            .is_some_and(|rest| known.contains(&rest.to_ascii_lowercase().replace("__", ".")))
    })
    .collect()
}

/// Every setting's dotted name (`redis.url`, `grpc_addr`, ...).
fn setting_names(v: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
    if let serde_json::Value::Object(map) = v {
        for (k, v) in map {
            let name = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            if v.is_object() {
                setting_names(v, &name, out);
            } else {
                out.push(name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::settings::RequestsSection;

    fn env(vars: &[(&str, &str)]) -> BTreeMap<String, String> {
        vars.iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    }

    #[test]
    fn xds_maps_keep_their_keys_through_the_layers() {
        let vars = env(&[
            ("SLUICE_COMPAT", "envoy-ratelimit"),
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            (
                "CONFIG_GRPC_XDS_NODE_METADATA",
                "Zone=eu-West-1,team.name=RL",
            ),
            ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "X-Token:Abc"),
        ]);
        let s = Written::load_with_env(None, &Overrides::default(), vars).unwrap();
        assert_eq!(s.policy_source, super::super::PolicySource::Xds);
        let metadata: Vec<_> = s
            .xds
            .node_metadata
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(metadata, [("Zone", "eu-West-1"), ("team.name", "RL")]);
        let settings = s.validate().unwrap();
        let xds = settings.xds.expect("xds");
        assert_eq!(xds.headers, [("x-token".to_string(), "Abc".to_string())]);
        // From a settings file too.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.yaml");
        std::fs::write(
            &path,
            "xds:\n  node_metadata:\n    Zone: eu\n    \"team.name\": RL\n",
        )
        .unwrap();
        let s = Written::load_with_env(Some(&path), &Overrides::default(), env(&[])).unwrap();
        let metadata: Vec<_> = s
            .xds
            .node_metadata
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(metadata, [("Zone", "eu"), ("team.name", "RL")]);
    }

    #[test]
    fn compat_is_opt_in_and_sluice_variables_and_flags_win() {
        let reference = [
            ("PORT", "9080"),
            ("GRPC_PORT", "9081"),
            ("LOG_LEVEL", "debug"),
            ("SHADOW_MODE", "true"),
        ];
        // Without compat the reference's names are not read.
        let s = Written::load_with_env(None, &Overrides::default(), env(&reference)).unwrap();
        assert_eq!(s, Written::default());
        // With it they are; SLUICE_* beats them, flags beat both.
        let mut vars = env(&reference);
        vars.extend(env(&[
            ("SLUICE_COMPAT", "envoy-ratelimit"),
            ("SLUICE_LOG_LEVEL", "warn"),
        ]));
        let flags = Overrides {
            grpc_addr: Some("127.0.0.1:7".parse().unwrap()),
            ..Overrides::default()
        };
        let s = Written::load_with_env(None, &flags, vars).unwrap();
        assert_eq!(s.compat, Compat::EnvoyRatelimit);
        assert_eq!(s.admin_addr, "0.0.0.0:9080".parse().unwrap());
        assert_eq!(s.grpc_addr, "127.0.0.1:7".parse().unwrap());
        assert_eq!(s.log_level, "warn");
        assert!(s.shadow_mode);
        // The reference's variables beat the settings file; compat can be set there too.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.yaml");
        std::fs::write(&path, "compat: envoy-ratelimit\nadmin_addr: 127.0.0.1:1\n").unwrap();
        let s = Written::load_with_env(
            Some(&path),
            &Overrides::default(),
            env(&[("PORT", "2"), ("USE_STATSD", "true")]),
        )
        .unwrap();
        assert_eq!(s.admin_addr, "0.0.0.0:2".parse().unwrap());
        assert!(
            s.compat_warnings
                .iter()
                .any(|w| w.starts_with("USE_STATSD")),
            "{:?}",
            s.compat_warnings
        );
        // A bad value is an error naming the variable.
        let err = Written::load_with_env(
            Some(&path),
            &Overrides::default(),
            env(&[("GRPC_PORT", "http")]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("GRPC_PORT"), "{err}");
    }

    /// Envoy Gateway's tracing variables, through every layer and validated: OTLP over HTTP to
    /// the collector's URL, as the reference exports them.
    #[test]
    fn envoy_gateways_tracing_exports_over_http_to_its_endpoint() {
        let vars = env(&[
            ("SLUICE_COMPAT", "envoy-ratelimit"),
            ("USE_STATSD", "false"),
            ("TRACING_ENABLED", "true"),
            ("TRACING_SERVICE_NAME", "envoy-ratelimit"),
            ("TRACING_SAMPLING_RATE", "0.5"),
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                "http://otel-collector.monitoring:4318",
            ),
        ]);
        let s = Written::load_with_env(None, &Overrides::default(), vars)
            .unwrap()
            .validate()
            .unwrap();
        let t = s.tracing.expect("tracing on");
        assert_eq!(t.protocol, crate::traces::Protocol::Http);
        assert_eq!(t.endpoint, "http://otel-collector.monitoring:4318");
        assert!((t.sampling_ratio - 0.5).abs() < f64::EPSILON);
    }

    #[test]
    fn compat_asked_by_the_command_line_reads_the_references_variables_alone() {
        let flags = Overrides {
            compat: Some(Compat::EnvoyRatelimit),
            ..Overrides::default()
        };
        let s = Written::load_with_env(None, &flags, env(&[("PORT", "9080")])).unwrap();
        assert_eq!(s.compat, Compat::EnvoyRatelimit);
        assert_eq!(s.admin_addr, "0.0.0.0:9080".parse().unwrap());
        // Whatever SLUICE_COMPAT says.
        let vars = env(&[("PORT", "9080"), ("SLUICE_COMPAT", "none")]);
        let s = Written::load_with_env(None, &flags, vars).unwrap();
        assert_eq!(s.admin_addr, "0.0.0.0:9080".parse().unwrap());
    }

    #[test]
    fn the_references_unset_backend_is_beneath_the_file_and_said_only_when_kept() {
        let unset = env(&[
            ("SLUICE_COMPAT", "envoy-ratelimit"),
            ("USE_STATSD", "false"),
        ]);
        let said = |s: &Written| s.compat_warnings.iter().any(|w| w.starts_with("REDIS_URL"));
        // Nothing else: the reference's Redis, at its default socket, and a warning.
        let s = Written::load_with_env(None, &Overrides::default(), unset.clone()).unwrap();
        assert_eq!(s.backend, BackendKind::Redis);
        assert_eq!(s.redis.url, "unix:///var/run/nutcracker/ratelimit.sock");
        assert!(said(&s), "{:?}", s.compat_warnings);
        // A settings file that names the backend, or its Redis, wins over unset variables.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.yaml");
        std::fs::write(&path, "backend: memory\n").unwrap();
        let s = Written::load_with_env(Some(&path), &Overrides::default(), unset.clone()).unwrap();
        assert_eq!(s.backend, BackendKind::Memory);
        assert!(!said(&s), "{:?}", s.compat_warnings);
        std::fs::write(
            &path,
            "backend: redis\nredis:\n  url: redis://a:6379,redis://b:6379\n  cluster: true\n",
        )
        .unwrap();
        let s = Written::load_with_env(Some(&path), &Overrides::default(), unset.clone()).unwrap();
        assert_eq!(
            (s.backend, s.redis.url.as_str(), s.redis.cluster),
            (BackendKind::Redis, "redis://a:6379,redis://b:6379", true)
        );
        assert!(!said(&s), "{:?}", s.compat_warnings);
        // So do SLUICE_BACKEND and --backend, and then nothing is said of Redis.
        let flags = Overrides {
            backend: Some(BackendKind::Memory),
            ..Overrides::default()
        };
        let s = Written::load_with_env(None, &flags, unset.clone()).unwrap();
        assert_eq!(s.backend, BackendKind::Memory);
        assert!(!said(&s), "{:?}", s.compat_warnings);
        let mut vars = unset;
        vars.insert("SLUICE_BACKEND".into(), "memory".into());
        let s = Written::load_with_env(None, &Overrides::default(), vars).unwrap();
        assert_eq!(s.backend, BackendKind::Memory);
        assert!(!said(&s), "{:?}", s.compat_warnings);
    }

    #[test]
    fn merged_domains_and_dynamic_metadata_from_the_reference_and_sluice_names() {
        let reference = env(&[
            ("SLUICE_COMPAT", "envoy-ratelimit"),
            ("MERGE_DOMAIN_CONFIG", "true"),
            ("RESPONSE_DYNAMIC_METADATA", "true"),
            ("USE_STATSD", "false"),
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
        ]);
        let s = Written::load_with_env(None, &Overrides::default(), reference.clone())
            .unwrap()
            .validate()
            .unwrap();
        assert!(s.merge_domains);
        assert!(s.decision.dynamic_metadata);
        assert!(s.compat_warnings.is_empty(), "{:?}", s.compat_warnings);
        let mut vars = reference;
        vars.insert("SLUICE_MERGE_DOMAINS".into(), "false".into());
        let s = Written::load_with_env(None, &Overrides::default(), vars).unwrap();
        assert!(!s.merge_domains);
        assert!(s.response_dynamic_metadata);
        let d = Written::default().validate().unwrap();
        assert!(!d.merge_domains && !d.decision.dynamic_metadata);
    }

    #[test]
    fn only_variables_that_name_a_setting_are_read() {
        let vars = [
            ("SLUICE_GRPC_ADDR", "127.0.0.1:1"),
            ("SLUICE_REDIS__URL", "redis://r:6379"),
            ("SLUICE_PORT", "tcp://10.0.0.1:8081"),
            ("SLUICE_SERVICE_HOST", "10.0.0.1"),
            ("SLUICE_REDIS", "x"),
            ("PATH", "/bin"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let mut kept: Vec<String> = settings_from_env(vars.into_iter()).into_keys().collect();
        kept.sort();
        assert_eq!(kept, ["SLUICE_GRPC_ADDR", "SLUICE_REDIS__URL"]);
    }

    #[test]
    fn local_mode_from_the_environment_and_a_file() {
        let s = Written::load_with_env(
            None,
            &Overrides::default(),
            env(&[
                ("SLUICE_ON_BACKEND_ERROR", "local"),
                ("SLUICE_REDIS__FLEET_SIZE", "4"),
                ("SLUICE_REDIS__HEARTBEAT_INTERVAL_MS", "500"),
            ]),
        )
        .unwrap();
        assert_eq!(s.on_backend_error, OnBackendError::Local);
        assert_eq!(s.redis.fleet_size, Some(4));
        assert_eq!(s.redis.heartbeat_interval_ms, 500);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.yaml");
        std::fs::write(&path, "on_backend_error: local\nredis:\n  fleet_size: 2\n").unwrap();
        let s =
            Written::load_with_env(Some(&path), &Overrides::default(), BTreeMap::new()).unwrap();
        assert_eq!(s.redis.fleet_size, Some(2));
        let s = Written::load_with_env(None, &Overrides::default(), BTreeMap::new()).unwrap();
        assert_eq!(s.redis.fleet_size, None, "unset by default");
    }

    #[test]
    fn file_then_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.yaml");
        std::fs::write(
            &path,
            "grpc_addr: 127.0.0.1:9000\nrequests:\n  max_descriptors: 3\n",
        )
        .unwrap();
        let flags = Overrides {
            admin_addr: Some("127.0.0.1:0".parse().unwrap()),
            ..Overrides::default()
        };
        let s = Written::load_with_env(Some(&path), &flags, BTreeMap::new()).unwrap();
        assert_eq!(s.grpc_addr, "127.0.0.1:9000".parse().unwrap());
        assert_eq!(s.admin_addr, "127.0.0.1:0".parse().unwrap());
        assert_eq!(s.requests.max_descriptors, 3);
        assert_eq!(
            s.requests.max_entries,
            RequestsSection::default().max_entries
        );
    }

    #[test]
    fn the_shipped_settings_file_spells_out_the_defaults() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/sluice.yaml");
        let text = std::fs::read_to_string(&path).unwrap();
        let s = Written::load(Some(&path), &Overrides::default()).unwrap();
        assert_eq!(s, Written::default());
        // Every field is written out, not left to the defaults.
        let defaults = serde_json::to_value(Written::default()).unwrap();
        let mut names = Vec::new();
        collect_names(&defaults, &mut names);
        for name in names {
            assert!(
                text.contains(&format!("{name}:")),
                "{name} missing from config/sluice.yaml"
            );
        }
    }

    fn collect_names(v: &serde_json::Value, out: &mut Vec<String>) {
        if let serde_json::Value::Object(map) = v {
            for (k, v) in map {
                out.push(k.clone());
                collect_names(v, out);
            }
        }
    }

    #[test]
    fn the_reference_sentinel_variables_give_a_valid_sentinel_backend() {
        let s = Written::load_with_env(
            None,
            &Overrides::default(),
            env(&[
                ("SLUICE_COMPAT", "envoy-ratelimit"),
                ("BACKEND_TYPE", "redis"),
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_TYPE", "sentinel"),
                ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
                ("REDIS_SENTINEL_AUTH", "pw"),
            ]),
        )
        .unwrap()
        .validate()
        .unwrap();
        let crate::settings::BackendSettings::Redis(redis) = s.backend else {
            panic!("redis backend expected")
        };
        let sentinel = redis.sentinel.expect("sentinel mode");
        assert_eq!(sentinel.master_name, "mymaster");
        assert_eq!(
            sentinel.urls,
            ["redis://:pw@s1:26379", "redis://:pw@s2:26379"]
        );
        // And SLUICE_* wins over the reference's variables, as everywhere.
        let s = Written::load_with_env(
            None,
            &Overrides::default(),
            env(&[
                ("SLUICE_COMPAT", "envoy-ratelimit"),
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_TYPE", "sentinel"),
                ("REDIS_URL", "mymaster,s1:26379"),
                ("SLUICE_REDIS__SENTINEL__MASTER_NAME", "other"),
            ]),
        )
        .unwrap();
        assert_eq!(s.redis.sentinel.master_name, "other");
    }

    #[test]
    fn unknown_fields_and_bad_values_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.yaml");
        std::fs::write(&path, "grpc_adr: 127.0.0.1:9000\n").unwrap();
        let err = Written::load(Some(&path), &Overrides::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("grpc_adr"), "{err}");
        let missing = dir.path().join("missing.yaml");
        assert!(Written::load(Some(&missing), &Overrides::default()).is_err());
    }

    #[test]
    fn otel_variables_fill_in_what_no_setting_set() {
        let otel = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317"),
            ("OTEL_SERVICE_NAME", "from-otel"),
            ("OTEL_RESOURCE_ATTRIBUTES", "a=1,b=2"),
        ];
        let s = Written::load_with_env(None, &Overrides::default(), env(&otel)).unwrap();
        assert_eq!(s.tracing.endpoint, "http://collector:4317");
        assert_eq!(s.tracing.service_name, "from-otel");
        assert_eq!(s.tracing.resource_attributes, "a=1,b=2");
        let mut vars = env(&otel);
        vars.extend(env(&[
            ("SLUICE_TRACING__ENDPOINT", "http://mine:4317"),
            ("SLUICE_TRACING__SERVICE_NAME", "mine"),
            ("SLUICE_TRACING__RESOURCE_ATTRIBUTES", "b=3"),
        ]));
        let s = Written::load_with_env(None, &Overrides::default(), vars).unwrap();
        assert_eq!(s.tracing.endpoint, "http://mine:4317");
        assert_eq!(s.tracing.service_name, "mine");
        assert_eq!(s.tracing.resource_attributes, "a=1,b=2,b=3");
    }
}
