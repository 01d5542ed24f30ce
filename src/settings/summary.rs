//! What an operator reads at startup (`kubectl logs`): a few lines naming the policy source, the
//! listeners, the backend and, under `compat`, which settings the reference's variables set.
//! Secrets never appear: Redis URLs are redacted and compat names settings, not values.

use super::{BackendSettings, Settings};
use crate::policy::Files;

impl Settings {
    /// The startup summary, one line per subject.
    #[must_use]
    pub fn summary(&self) -> Vec<String> {
        let files = match self.policy_files {
            Files::Yaml => "*.yaml and *.yml",
            Files::All => "every file, dot files too",
            Files::Visible => "every file but dot files",
        };
        let watched = if self.watch_policies {
            "reloaded on change and SIGHUP"
        } else {
            "reloaded on SIGHUP"
        };
        let mut lines = vec![match &self.xds {
            Some(x) => format!(
                "policies: over xDS from {} ({}), node {}, {}",
                x.authority,
                if x.tls.is_some() { "TLS" } else { "plaintext" },
                x.node_id,
                if x.force_start {
                    "healthy before the first policies"
                } else {
                    "not serving until the first policies"
                }
            ),
            None => format!(
                "policies: directory {} ({files}), {watched}",
                self.policies.display()
            ),
        }];
        let grpc = match &self.grpc_tls {
            None => "plaintext (h2c)".to_owned(),
            Some(t) => match (&t.client_ca_file, &t.client_san) {
                (None, _) => format!(
                    "TLS with {}, no client certificates asked",
                    t.cert_file.display()
                ),
                (Some(ca), san) => format!(
                    "TLS with {}, client certificates required against {}{}",
                    t.cert_file.display(),
                    ca.display(),
                    san.as_ref()
                        .map(|s| format!(" carrying {s}"))
                        .unwrap_or_default()
                ),
            },
        };
        let mut listeners = format!(
            "listeners: gRPC {} {grpc}; admin {} (/healthcheck, /json, /metrics, /rlconfig, \
             /counters; writes {})",
            self.grpc_addr,
            self.admin_addr,
            match &self.admin.write_token {
                Some(t) => format!(
                    "need the token {} from admin.write_token_file",
                    t.fingerprint()
                ),
                None => "off".to_owned(),
            }
        );
        if let Some((addr, path)) = &self.metrics_listener {
            listeners.push_str(&format!("; metrics {addr} ({path})"));
        }
        if let Some(addr) = self.debug_addr {
            listeners.push_str(&format!("; debug {addr} (/rlconfig)"));
        }
        lines.push(listeners);
        lines.push(match &self.backend {
            BackendSettings::Memory { max_keys, .. } => {
                format!("backend: memory on this node, at most {max_keys} counters")
            }
            BackendSettings::Redis(config) => format!(
                "backend: redis {}{}{}, on_backend_error {}",
                config.describe(),
                if config.cluster { " (cluster)" } else { "" },
                if self.lease.is_some() { ", leased" } else { "" },
                format!("{:?}", self.decision.on_backend_error).to_lowercase(),
            ),
        });
        if let Some(t) = &self.tracing {
            lines.push(format!(
                "tracing: OTLP over {} to {}, sampling {}",
                match t.protocol {
                    crate::traces::Protocol::Grpc => "gRPC",
                    crate::traces::Protocol::Http => "HTTP",
                },
                t.endpoint,
                t.sampling_ratio
            ));
        }
        if !self.compat_set.is_empty() {
            lines.push(format!(
                "compat envoy-ratelimit: the reference's variables set {}",
                self.compat_set.join(", ")
            ));
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use crate::settings::Written;

    #[test]
    fn the_summary_names_the_source_listeners_and_backend_without_secrets() {
        let lines = Written::default().validate().unwrap().summary();
        assert_eq!(lines.len(), 3, "{lines:#?}");
        assert!(lines[0].starts_with("policies: directory config/policies"));
        assert!(
            lines[1].contains("gRPC 0.0.0.0:8081 plaintext") && !lines[1].contains("debug"),
            "{}",
            lines[1]
        );
        assert!(lines[2].starts_with("backend: memory"), "{}", lines[2]);
        let mut raw = Written {
            backend: crate::settings::BackendKind::Redis,
            ..Written::default()
        };
        raw.redis.url = "redis://user:hunter2@10.0.0.5:6379".into();
        raw.metrics.addr = Some("0.0.0.0:19001".parse().unwrap());
        raw.admin.debug_addr = Some("0.0.0.0:6070".parse().unwrap());
        raw.compat_set = vec!["admin_addr".into(), "redis.url".into()];
        let text = raw.validate().unwrap().summary().join("\n");
        assert!(!text.contains("hunter2"), "{text}");
        for part in [
            "metrics 0.0.0.0:19001 (/metrics)",
            "debug 0.0.0.0:6070 (/rlconfig)",
            "backend: redis redis://***@10.0.0.5:6379",
            "the reference's variables set admin_addr, redis.url",
        ] {
            assert!(text.contains(part), "{part} not in {text}");
        }
        let mut raw = Written {
            policy_source: crate::settings::written::PolicySource::Xds,
            ..Written::default()
        };
        raw.xds.url = "envoy-gateway:18001".into();
        raw.xds.node_id = "envoy-ratelimit".into();
        let lines = raw.validate().unwrap().summary();
        assert_eq!(
            lines[0],
            "policies: over xDS from envoy-gateway:18001 (plaintext), node envoy-ratelimit, \
             not serving until the first policies"
        );
    }
}
