//! Metrics: every name and description, the process's Prometheus recorder, and the handles the
//! request path increments.
//!
//! Names follow envoyproxy/ratelimit's Prometheus mapping where one exists (so existing
//! dashboards work) and use the `sluice_` prefix otherwise. Label values come from configuration
//! (domain, the first two levels of a rule's path). Request values appear only for rules with
//! `detailed_metric` or `value_to_metric`, and then under a cap on series: past it they are
//! counted under the value `_other`, so a client rotating values cannot grow memory.
//!
//! The recorder is global (one per process); [`Metrics::install`] is idempotent so tests can
//! start many servers in one process.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use metrics::Counter;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::decision::{Code, Request, Response};
use crate::histogram::{self, LatencyHistogram};
use crate::limiter::redis::BreakerState;
use crate::limiter::store::KeyHash;
use crate::limiter::{MemoryStore, RedisStore};
use crate::policy::Rule;

/// Hits on a limited rule (weighted by cost).
pub const TOTAL_HITS: &str = "ratelimit_service_rate_limit_total_hits";
/// Hits refused by a limit.
pub const OVER_LIMIT: &str = "ratelimit_service_rate_limit_over_limit";
/// Hits admitted above 80 % of the bucket.
pub const NEAR_LIMIT: &str = "ratelimit_service_rate_limit_near_limit";
/// Hits admitted.
pub const WITHIN_LIMIT: &str = "ratelimit_service_rate_limit_within_limit";
/// Hits a shadow-mode rule would have refused.
pub const SHADOW_MODE: &str = "ratelimit_service_rate_limit_shadow_mode";
/// Descriptors of requests for a domain no policy defines.
pub const DOMAIN_NOT_FOUND: &str = "ratelimit_service_rate_limit_domain_not_found";
/// Successful policy loads (startup and reloads).
pub const CONFIG_LOAD_SUCCESS: &str = "ratelimit_service_config_load_success";
/// Failed policy loads.
pub const CONFIG_LOAD_ERROR: &str = "ratelimit_service_config_load_error";
/// Requests by outcome.
pub const DECISIONS: &str = "sluice_decisions_total";
/// Time to decide a request, transport excluded.
pub const DECISION_DURATION: &str = "sluice_decision_duration_seconds";
/// Keys in the in-memory store.
pub const STORE_KEYS: &str = "sluice_store_keys";
/// Live keys evicted because the store was full.
pub const STORE_EVICTIONS: &str = "sluice_store_evictions_total";
/// Policy reloads by result.
pub const POLICY_RELOADS: &str = "sluice_policy_reloads_total";
/// Script calls sent to Redis.
pub const REDIS_ROUND_TRIPS: &str = "sluice_redis_round_trips_total";
/// Failed Redis calls by kind.
pub const REDIS_ERRORS: &str = "sluice_redis_errors_total";
/// Requests refused from the local over-limit cache.
pub const REDIS_CACHE_HITS: &str = "sluice_redis_local_cache_hits_total";
/// Whether a Redis connection is established.
pub const REDIS_CONNECTED: &str = "sluice_redis_connected";
/// The circuit breaker's state.
pub const REDIS_BREAKER: &str = "sluice_redis_breaker_state";
/// Redis round-trip time.
pub const REDIS_LATENCY: &str = "sluice_redis_round_trip_duration_seconds";
/// Build information (always 1).
pub const BUILD_INFO: &str = "sluice_build_info";

/// The label value that stands for every request value past the series cap.
pub const OTHER: &str = "_other";

/// Near limit starts above this fraction of the bucket, as in envoyproxy/ratelimit.
const NEAR_LIMIT_RATIO: f64 = 0.8;

static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();

/// The counters of one rule (one label set).
#[derive(Clone, Debug)]
struct RuleCounters {
    total: Counter,
    over: Counter,
    near: Counter,
    within: Counter,
    shadow: Counter,
}

impl RuleCounters {
    fn new(domain: &str, key1: &str, key2: &str) -> Self {
        let labels = [
            ("domain", domain.to_string()),
            ("key1", key1.to_string()),
            ("key2", key2.to_string()),
        ];
        Self {
            total: metrics::counter!(TOTAL_HITS, &labels),
            over: metrics::counter!(OVER_LIMIT, &labels),
            near: metrics::counter!(NEAR_LIMIT, &labels),
            within: metrics::counter!(WITHIN_LIMIT, &labels),
            shadow: metrics::counter!(SHADOW_MODE, &labels),
        }
    }
}

/// The process's metrics: the recorder handle and the cached handles of the request path.
#[derive(Debug)]
pub struct Metrics {
    handle: PrometheusHandle,
    ok: Counter,
    over_limit: Counter,
    invalid: Counter,
    backend_errors: Counter,
    /// Our own atomics, not the recorder's histogram, which keeps every sample until a scrape
    /// drains it: memory that grows with traffic when nobody scrapes.
    duration: LatencyHistogram,
    /// Rule identity (already a hash, so not hashed again) → counters of rules whose labels
    /// come from configuration alone.
    rules: DashMap<u128, RuleCounters, KeyHash>,
    /// Label key → counters of request-valued series (`detailed_metric`, `value_to_metric`,
    /// unknown domains), at most `max_series` of them.
    detailed: DashMap<(u128, String, String), RuleCounters>,
    /// Unknown domain → its `domain_not_found` counter, within the same cap.
    unknown_domains: DashMap<String, Counter>,
    /// Request-valued series created so far.
    series: AtomicUsize,
    max_series: usize,
}

impl Metrics {
    /// Installs the global recorder (once per process) and describes every metric. At most
    /// `max_series` request-valued series are created; the rest are counted under `_other`.
    ///
    /// # Panics
    ///
    /// When another metrics recorder than sluice's is already installed in the process.
    #[must_use]
    pub fn install(max_series: usize) -> Self {
        let handle = RECORDER
            .get_or_init(|| {
                // Only counters and gauges go through the recorder; they hold no samples, so
                // the recorder needs no periodic upkeep.
                let handle = PrometheusBuilder::new()
                    .install_recorder()
                    .expect("no other metrics recorder is installed");
                describe();
                metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
                handle
            })
            .clone();
        Self {
            handle,
            ok: metrics::counter!(DECISIONS, "result" => "ok"),
            over_limit: metrics::counter!(DECISIONS, "result" => "over_limit"),
            invalid: metrics::counter!(DECISIONS, "result" => "invalid"),
            backend_errors: metrics::counter!(DECISIONS, "result" => "backend_error"),
            duration: LatencyHistogram::default(),
            rules: DashMap::default(),
            detailed: DashMap::new(),
            unknown_domains: DashMap::new(),
            series: AtomicUsize::new(0),
            max_series,
        }
    }

    /// The Prometheus text exposition of every metric, with this server's store and Redis
    /// figures (read at scrape time from its own stores, not from the process-wide recorder).
    #[must_use]
    pub fn render(&self, store: &MemoryStore, redis: Option<&RedisStore>) -> String {
        use std::fmt::Write;
        let mut out = self.handle.render();
        let mut line = |name: &str, kind: &str, help: &str, samples: &[(String, String)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        let plain = |v: String| vec![(String::new(), v)];
        line(
            DECISION_DURATION,
            "histogram",
            "Time to decide one request, transport excluded.",
            &histogram_samples(&self.duration),
        );
        line(
            STORE_KEYS,
            "gauge",
            "Keys held by the in-memory store.",
            &plain(store.len().to_string()),
        );
        line(
            STORE_EVICTIONS,
            "counter",
            "Live keys evicted because the store was full.",
            &plain(store.evictions().to_string()),
        );
        let Some(redis) = redis else { return out };
        let stats = redis.stats();
        line(
            REDIS_ROUND_TRIPS,
            "counter",
            "Script calls sent to Redis.",
            &plain(stats.round_trips().to_string()),
        );
        let errors: Vec<(String, String)> = stats
            .errors()
            .iter()
            .map(|(kind, n)| (format!("{{kind=\"{kind}\"}}"), n.to_string()))
            .collect();
        line(
            REDIS_ERRORS,
            "counter",
            "Failed Redis calls by kind.",
            &errors,
        );
        line(
            REDIS_CACHE_HITS,
            "counter",
            "Requests refused from the local over-limit cache.",
            &plain(stats.cache_hits().to_string()),
        );
        line(
            REDIS_CONNECTED,
            "gauge",
            "1 once a Redis connection is established.",
            &plain(u8::from(redis.is_connected()).to_string()),
        );
        let state = redis.breaker_state();
        let states: Vec<(String, String)> = [
            ("closed", BreakerState::Closed),
            ("open", BreakerState::Open),
            ("half_open", BreakerState::HalfOpen),
        ]
        .iter()
        .map(|(name, s)| {
            (
                format!("{{state=\"{name}\"}}"),
                u8::from(*s == state).to_string(),
            )
        })
        .collect();
        line(
            REDIS_BREAKER,
            "gauge",
            "The Redis circuit breaker's state (1 for the current one).",
            &states,
        );
        line(
            REDIS_LATENCY,
            "histogram",
            "Redis round-trip time.",
            &histogram_samples(stats.latency()),
        );
        out
    }

    /// Counts a policy load.
    pub fn policy_load(&self, ok: bool, reload: bool) {
        if ok {
            metrics::counter!(CONFIG_LOAD_SUCCESS).increment(1);
        } else {
            metrics::counter!(CONFIG_LOAD_ERROR).increment(1);
        }
        if reload {
            let result = if ok { "success" } else { "failure" };
            metrics::counter!(POLICY_RELOADS, "result" => result).increment(1);
        }
    }

    /// Counts a request refused as malformed.
    pub fn invalid(&self) {
        self.invalid.increment(1);
    }

    /// Counts a request the backend could not decide.
    pub fn backend_error(&self) {
        self.backend_errors.increment(1);
    }

    /// Counts a decided request: overall outcome, latency, and each limited descriptor.
    pub fn decided(&self, req: &Request, resp: &Response<'_>, took: Duration) {
        self.duration.record(took);
        match resp.overall {
            Code::Ok => self.ok.increment(1),
            Code::OverLimit => self.over_limit.increment(1),
        }
        if !resp.domain_known {
            self.domain_not_found(&req.domain, req.descriptors.len() as u64);
            return;
        }
        for (desc, status) in req.descriptors.iter().zip(&resp.statuses) {
            let Some(limit) = status.limit else { continue };
            let Some(rule) = limit.rule else { continue };
            if status.refund {
                continue;
            }
            let hits = status.hits;
            let burst = u64::from(limit.rate.burst);
            let record = |c: &RuleCounters| {
                c.total.increment(hits);
                if status.denied {
                    c.over.increment(hits);
                    if rule.shadow_mode {
                        c.shadow.increment(hits);
                    }
                    return;
                }
                c.within.increment(hits);
                // Truncation intended: floor of 80 % of the bucket.
                let threshold = (burst as f64 * NEAR_LIMIT_RATIO) as u64;
                let used = burst.saturating_sub(u64::from(status.remaining));
                if used > threshold {
                    c.near.increment(hits.min(used - threshold));
                }
            };
            if rule.detailed_metric || rule.value_to_metric {
                let (key1, key2) = detailed_labels(rule, desc);
                self.with_detailed(rule.id, &req.domain, &key1, &key2, record);
            } else {
                self.with_rule(rule, &req.domain, record);
            }
        }
    }

    fn with_rule(&self, rule: &Rule, domain: &str, f: impl FnOnce(&RuleCounters)) {
        if let Some(c) = self.rules.get(&rule.id) {
            return f(&c);
        }
        let (key1, key2) = rule_labels(rule);
        let c = RuleCounters::new(domain, &key1, &key2);
        f(&c);
        self.rules.insert(rule.id, c);
    }

    fn with_detailed(
        &self,
        id: u128,
        domain: &str,
        key1: &str,
        key2: &str,
        f: impl FnOnce(&RuleCounters),
    ) {
        let key = (id, key1.to_string(), key2.to_string());
        if let Some(c) = self.detailed.get(&key) {
            return f(&c);
        }
        if !self.reserve_series() {
            let other = (id, OTHER.to_string(), String::new());
            let c = self
                .detailed
                .entry(other)
                .or_insert_with(|| RuleCounters::new(domain, OTHER, ""));
            return f(&c);
        }
        let c = RuleCounters::new(domain, key1, key2);
        f(&c);
        self.detailed.insert(key, c);
    }

    fn domain_not_found(&self, domain: &str, n: u64) {
        if let Some(c) = self.unknown_domains.get(domain) {
            return c.increment(n);
        }
        let label = if self.reserve_series() { domain } else { OTHER };
        let c = self
            .unknown_domains
            .entry(label.to_string())
            .or_insert_with(|| metrics::counter!(DOMAIN_NOT_FOUND, "domain" => label.to_string()));
        c.increment(n);
    }

    /// Takes one of the `max_series` request-valued series; false when they are all taken.
    fn reserve_series(&self) -> bool {
        // Relaxed: the count only bounds memory; no other data is ordered by it.
        self.series
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < self.max_series).then_some(n + 1)
            })
            .is_ok()
    }
}

/// `key1`/`key2` of a rule from configuration: the first two levels of its stats key
/// (`key_value` for exact or wildcard levels, `key` for key-only ones).
fn rule_labels(rule: &Rule) -> (String, String) {
    let level = |i: usize| rule.levels.get(i).cloned().unwrap_or_default();
    (level(0), level(1))
}

/// `key1`/`key2` showing request values: every level's with `detailed_metric`, the rule's own
/// (last) level's with `value_to_metric`.
fn detailed_labels(rule: &Rule, desc: &crate::decision::Descriptor) -> (String, String) {
    let value = |i: usize| {
        desc.entries
            .get(i)
            .map(|e| format!("{}_{}", e.key, e.value))
            .unwrap_or_default()
    };
    if rule.detailed_metric {
        return (value(0), value(1));
    }
    let (mut key1, mut key2) = rule_labels(rule);
    match desc.entries.len() {
        1 => key1 = value(0),
        2 => key2 = value(1),
        _ => {}
    }
    (key1, key2)
}

/// A histogram's sample lines: cumulative `_bucket`s, `_sum`, `_count`.
fn histogram_samples(h: &LatencyHistogram) -> Vec<(String, String)> {
    let (counts, sum) = h.snapshot();
    let mut cumulative = 0;
    let mut samples = Vec::with_capacity(counts.len() + 2);
    for (i, count) in counts.iter().enumerate() {
        cumulative += count;
        let le = histogram::BUCKETS
            .get(i)
            .map_or_else(|| "+Inf".to_string(), ToString::to_string);
        samples.push((format!("_bucket{{le=\"{le}\"}}"), cumulative.to_string()));
    }
    samples.push(("_sum".into(), sum.to_string()));
    samples.push(("_count".into(), cumulative.to_string()));
    samples
}

fn describe() {
    use metrics::{describe_counter, describe_gauge};
    describe_counter!(TOTAL_HITS, "Hits on a limited rule, weighted by cost.");
    describe_counter!(
        OVER_LIMIT,
        "Hits over a limit (refused, or would be in shadow mode)."
    );
    describe_counter!(NEAR_LIMIT, "Admitted hits above 80% of the bucket.");
    describe_counter!(WITHIN_LIMIT, "Admitted hits.");
    describe_counter!(SHADOW_MODE, "Hits a shadow-mode rule would have refused.");
    describe_counter!(
        DOMAIN_NOT_FOUND,
        "Descriptors of requests for an unknown domain."
    );
    describe_counter!(CONFIG_LOAD_SUCCESS, "Successful policy loads.");
    describe_counter!(CONFIG_LOAD_ERROR, "Failed policy loads.");
    describe_counter!(
        DECISIONS,
        "Requests by result: ok, over_limit, invalid, backend_error."
    );
    describe_gauge!(STORE_KEYS, "Keys held by the in-memory store.");
    describe_counter!(
        STORE_EVICTIONS,
        "Live keys evicted because the store was full."
    );
    describe_counter!(POLICY_RELOADS, "Policy reloads by result.");
    describe_gauge!(BUILD_INFO, "Build information.");
}
