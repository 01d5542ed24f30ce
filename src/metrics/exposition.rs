//! The exposition: the Prometheus text of every metric, the recorder's families followed by
//! those rendered at scrape time from their owners' figures (the decision and response-time
//! histograms, the store's or the Redis backend's figures, leasing's, the backend's mode, the
//! trace export's), each with its `# HELP` and `# TYPE` from [`FAMILIES`]. Reads figures;
//! counts nothing.

use crate::histogram::{self, LatencySnapshot};
use crate::limiter::fallback::{BackendMode, LocalFigures};
use crate::limiter::figures::{BreakerState, LeaseFigures, RedisFigures, Stats, StoreStats};
use crate::metrics::hitters::{KeyCount, RuleView};
use crate::metrics::names::{
    BACKEND_DECISIONS, BACKEND_FLEET_SIZE, BACKEND_LOCAL_KEYS, BACKEND_MODE, DECISION_DURATION,
    FAMILIES, Kind, LEASE_SHARE_RENEWALS, LEASE_SHARES, LEASE_SLICES, LEASE_TOKENS_RETURNED,
    LEASE_TOKENS_TAKEN, LEASES, REDIS_BREAKER, REDIS_CACHE_HITS, REDIS_CONNECTED,
    REDIS_COUNTER_REPAIRS, REDIS_ERRORS, REDIS_LATENCY, REDIS_REQUESTS, REDIS_ROUND_TRIPS,
    REDIS_ROUND_TRIPS_BY_PURPOSE, RESPONSE_TIME, STORE_EVICTIONS, STORE_KEYS, TOP_HITS,
    TOP_REFUSED, TRACING_DROPPED, TRACING_EXPORTED,
};
use crate::metrics::{Metrics, SHOULD_RATE_LIMIT_METHOD};

/// What became of the trace export's spans, read at scrape time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TracingFigures {
    /// Spans the collector accepted.
    pub exported: u64,
    /// Spans dropped because the export queue was full.
    pub dropped_queue_full: u64,
    /// Spans dropped because their batch could not be sent (an error or the timeout).
    pub dropped_export_failed: u64,
}

impl Metrics {
    /// The Prometheus text exposition of every metric, with this server's backend figures and,
    /// with a Redis backend, its mode and decision counts (read at scrape time from its own
    /// stores, not from the process-wide recorder).
    #[must_use]
    pub fn render(
        &self,
        stats: &Stats,
        local: Option<&LocalFigures>,
        tracing: Option<&TracingFigures>,
    ) -> String {
        let mut out = self.handle.render();
        if let Some(t) = tracing {
            family(&mut out, TRACING_EXPORTED, &plain(t.exported));
            family(
                &mut out,
                TRACING_DROPPED,
                &[
                    (
                        "{reason=\"queue_full\"}".to_owned(),
                        t.dropped_queue_full.to_string(),
                    ),
                    (
                        "{reason=\"export_failed\"}".to_owned(),
                        t.dropped_export_failed.to_string(),
                    ),
                ],
            );
        }
        family(
            &mut out,
            DECISION_DURATION,
            &histogram_samples(&self.duration.snapshot(), ""),
        );
        family(
            &mut out,
            RESPONSE_TIME,
            &histogram_samples(
                &self.should_rate_limit_time.snapshot(),
                &format!("grpc_method=\"{SHOULD_RATE_LIMIT_METHOD}\""),
            ),
        );
        match stats {
            Stats::Memory(store) => render_store(&mut out, store),
            Stats::Redis(redis) => {
                render_redis(&mut out, redis);
                let by_redis = local.map_or(redis.requests + redis.cache_hits, |l| l.by_redis);
                render_mode(&mut out, by_redis, None, local);
            }
            Stats::Leased(redis, lease) => {
                render_redis(&mut out, redis);
                render_lease(&mut out, lease);
                render_mode(&mut out, lease.by_redis, Some(lease.by_lease), local);
            }
        }
        if self.hitters.top() > 0 {
            let views = self.hitters.views();
            family(
                &mut out,
                TOP_REFUSED,
                &top_samples(&views, |v| &v.top_refused),
            );
            family(&mut out, TOP_HITS, &top_samples(&views, |v| &v.top_hits));
        }
        out
    }
}

/// One sample per rule and rank: `{domain, rule, rank, key}` where `key` is the entries as
/// `k=v` joined by `,`. At most `top_keys` per rule, so the family has at most rules × k series
/// at a time (the keys in them change as the heaviest do).
fn top_samples(views: &[RuleView], pick: fn(&RuleView) -> &[KeyCount]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for v in views {
        for (rank, k) in pick(v).iter().enumerate() {
            let key = k
                .entries
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(",");
            out.push((
                format!(
                    "{{domain=\"{}\",rule=\"{}\",rank=\"{}\",key=\"{}\"}}",
                    escape(&v.domain),
                    escape(&v.rule),
                    rank + 1,
                    escape(&key)
                ),
                k.count.to_string(),
            ));
        }
    }
    out
}

/// A label value escaped for the text format: backslash, double quote and newline.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Writes one family rendered from figures: its `# HELP` and `# TYPE` from [`FAMILIES`], then
/// `name{labels} value` per sample.
fn family(out: &mut String, name: &str, samples: &[(String, String)]) {
    use std::fmt::Write;
    let (_, kind, help) = FAMILIES
        .iter()
        .find(|(n, _, _)| *n == name)
        .copied()
        .unwrap_or((name, Kind::Gauge, ""));
    let kind = match kind {
        Kind::Counter => "counter",
        Kind::Gauge => "gauge",
        Kind::Histogram => "histogram",
    };
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, value) in samples {
        let _ = writeln!(out, "{name}{labels} {value}");
    }
}

/// One unlabelled sample.
fn plain(value: impl ToString) -> [(String, String); 1] {
    [(String::new(), value.to_string())]
}

fn render_store(out: &mut String, store: &StoreStats) {
    family(out, STORE_KEYS, &plain(store.keys));
    family(out, STORE_EVICTIONS, &plain(store.evictions));
}

/// One sample per `(value, count)` of `counts`, labelled `label="value"` by `name`.
fn labelled<K: Copy>(
    label: &str,
    counts: &[(K, u64)],
    name: impl Fn(K) -> &'static str,
) -> Vec<(String, String)> {
    counts
        .iter()
        .map(|&(k, n)| (format!("{{{label}=\"{}\"}}", name(k)), n.to_string()))
        .collect()
}

fn render_redis(out: &mut String, redis: &RedisFigures) {
    family(out, REDIS_ROUND_TRIPS, &plain(redis.round_trips));
    let purposes = labelled("purpose", &redis.round_trips_by_purpose, |p| p.as_str());
    family(out, REDIS_ROUND_TRIPS_BY_PURPOSE, &purposes);
    family(out, REDIS_REQUESTS, &plain(redis.requests));
    let errors = labelled("kind", &redis.errors, |kind| kind.as_str());
    family(out, REDIS_ERRORS, &errors);
    family(out, REDIS_CACHE_HITS, &plain(redis.cache_hits));
    family(out, REDIS_COUNTER_REPAIRS, &plain(redis.counter_repairs));
    family(out, REDIS_CONNECTED, &plain(u8::from(redis.connected)));
    let states: Vec<(String, String)> = [
        ("closed", BreakerState::Closed),
        ("open", BreakerState::Open),
        ("half_open", BreakerState::HalfOpen),
    ]
    .iter()
    .map(|(name, s)| {
        (
            format!("{{state=\"{name}\"}}"),
            u8::from(*s == redis.breaker).to_string(),
        )
    })
    .collect();
    family(out, REDIS_BREAKER, &states);
    family(out, REDIS_LATENCY, &histogram_samples(&redis.latency, ""));
}

fn render_lease(out: &mut String, lease: &LeaseFigures) {
    family(out, LEASE_SLICES, &plain(lease.slices));
    family(out, LEASE_TOKENS_TAKEN, &plain(lease.tokens_taken));
    family(out, LEASE_TOKENS_RETURNED, &plain(lease.tokens_returned));
    family(out, LEASES, &plain(lease.leases));
    family(out, LEASE_SHARES, &plain(lease.shares));
    family(out, LEASE_SHARE_RENEWALS, &plain(lease.share_renewals));
}

/// `sluice_backend_mode` and `sluice_backend_decisions_total` of a Redis backend: `by_redis`
/// and, when leasing, `by_lease` answered by the backend; `local`, the degraded mode's figures
/// when this server has them.
fn render_mode(
    out: &mut String,
    by_redis: u64,
    by_lease: Option<u64>,
    local: Option<&LocalFigures>,
) {
    let mode = match local.map(|l| l.mode) {
        Some(BackendMode::Local) => BackendMode::Local,
        _ if by_lease.is_some() => BackendMode::Leased,
        _ => BackendMode::Shared,
    };
    let modes: Vec<(String, String)> = BackendMode::ALL
        .iter()
        .map(|m| {
            (
                format!("{{mode=\"{}\"}}", m.as_str()),
                u8::from(*m == mode).to_string(),
            )
        })
        .collect();
    family(out, BACKEND_MODE, &modes);
    let mut by = vec![("{by=\"redis\"}".to_string(), by_redis.to_string())];
    if let Some(n) = by_lease {
        by.push(("{by=\"lease\"}".to_string(), n.to_string()));
    }
    if let Some(local) = local {
        by.push(("{by=\"local\"}".to_string(), local.by_local.to_string()));
    }
    family(out, BACKEND_DECISIONS, &by);
    if let Some(local) = local {
        family(out, BACKEND_FLEET_SIZE, &plain(local.fleet_size));
        family(out, BACKEND_LOCAL_KEYS, &plain(local.keys));
    }
}

/// A histogram's sample lines: cumulative `_bucket`s, `_sum`, `_count`, each with `labels`
/// (`name="value",...`, or empty) first.
fn histogram_samples(h: &LatencySnapshot, labels: &str) -> Vec<(String, String)> {
    let (counts, sum) = (h.counts, h.sum_seconds);
    let mut cumulative = 0;
    let mut samples = Vec::with_capacity(counts.len() + 2);
    let (first, braced) = if labels.is_empty() {
        (String::new(), String::new())
    } else {
        (format!("{labels},"), format!("{{{labels}}}"))
    };
    for (i, count) in counts.iter().enumerate() {
        cumulative += count;
        let le = histogram::BUCKETS
            .get(i)
            .map_or_else(|| "+Inf".to_string(), ToString::to_string);
        samples.push((
            format!("_bucket{{{first}le=\"{le}\"}}"),
            cumulative.to_string(),
        ));
    }
    samples.push((format!("_sum{braced}"), sum.to_string()));
    samples.push((format!("_count{braced}"), cumulative.to_string()));
    samples
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::names::OVER_LIMIT;
    use crate::metrics::{RequestOutcome, RuleHit};
    use crate::policy::load_str;
    use std::time::Duration;

    /// The exposition of `metrics` beside an empty memory store.
    fn rendered(metrics: &Metrics) -> String {
        let store = StoreStats {
            keys: 0,
            max_keys: 1,
            evictions: 0,
        };
        metrics.render(&Stats::Memory(store), None, None)
    }

    /// The three series Envoy Gateway's e2e reads, from the descriptor trees it generates
    /// (route entry key = value = route name, then the CIDR or header match): over-limit hits
    /// render under the sanitised `key2`.
    #[test]
    fn envoy_gateways_e2e_series_render_with_sanitised_labels() {
        let metrics = Metrics::install(10);
        let route = "httproute/gateway-conformance-infra/http-ratelimit/rule/0/match/0/eg";
        let policy = format!(
            "domain: gateway-conformance-infra/eg-rate-limit/http\ndescriptors:\n  - key: {route}\n    value: {route}\n    descriptors:\n      - key: masked_remote_address\n        value: 0.0.0.0/0\n        rate_limit: {{unit: hour, requests_per_unit: 3}}\n      - key: masked_remote_address\n        value: invert:192.0.2.0/24\n        rate_limit: {{unit: hour, requests_per_unit: 3}}\n      - key: header_x-user-id\n        value: one\n        rate_limit: {{unit: hour, requests_per_unit: 3}}\n"
        );
        let set = load_str(&[("eg.yaml", &policy)]).unwrap();
        let domain = "gateway-conformance-infra/eg-rate-limit/http";
        for rule in set.domain(domain).unwrap().rules() {
            metrics.rule_hit(&RuleHit {
                domain,
                rule,
                values: [None, None],
                depth: 2,
                hits: 1,
                spent: false,
                denied: true,
                remaining: 0,
                burst: 3,
            });
        }
        let text = rendered(&metrics);
        for key2 in [
            "masked_remote_address_0_0_0_0/0",
            "masked_remote_address_invert_192_0_2_0/24",
            "header_x-user-id_one",
        ] {
            let series = format!(
                "{OVER_LIMIT}{{domain=\"{domain}\",key1=\"{route}_{route}\",key2=\"{key2}\"}} 1"
            );
            assert!(text.contains(&series), "{series} not in:\n{text}");
        }
    }

    #[test]
    fn should_rate_limit_calls_render_by_grpc_method() {
        let metrics = Metrics::install(10);
        metrics.should_rate_limit_called(Duration::from_millis(3));
        metrics.request(RequestOutcome::BackendError);
        metrics.request(RequestOutcome::Invalid);
        let text = rendered(&metrics);
        for line in [
            "# TYPE ratelimit_service_response_time_seconds histogram",
            "ratelimit_service_response_time_seconds_bucket{grpc_method=\"ShouldRateLimit\",le=\"+Inf\"} 1",
            "ratelimit_service_response_time_seconds_count{grpc_method=\"ShouldRateLimit\"} 1",
            "ratelimit_service_total_requests{grpc_method=\"ShouldRateLimit\"}",
            "ratelimit_service_should_rate_limit_error{err_type=\"redis_error\"}",
            "ratelimit_service_should_rate_limit_error{err_type=\"service_error\"}",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
    }
}
