//! Metrics: every name and description, the process's Prometheus recorder, and the handles the
//! request path increments. It reads the backends' plain figures (`limiter::figures`), no backend.
//! Names follow envoyproxy/ratelimit's Prometheus mapping where one exists (so dashboards work),
//! else the `sluice_` prefix. Label values come from configuration; request values appear only for
//! rules with `detailed_metric` or `value_to_metric`, under a cap on series past which they count
//! as `_other`, so a client rotating values cannot grow memory. Label values of rules are
//! sanitised as the reference sanitises its stat names ([`sanitize`]), so the series match its
//! Prometheus mapping's (Envoy Gateway's e2e reads them). The recorder is global;
//! [`Metrics::install`] is idempotent so tests can start many servers in one process.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use dashmap::DashMap;
use metrics::Counter;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::histogram::{self, LatencyHistogram, LatencySnapshot};
use crate::limiter::fallback::{BackendMode, LocalFigures};
use crate::limiter::figures::{BreakerState, LeaseFigures, RedisFigures, Stats, StoreStats};
use crate::limiter::key::KeyHash;
use crate::policy::{PolicyError, PolicyHandle, PolicySet, Rule, Summary};

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
/// Spend reported after the work (a descriptor's own `hits_addend`), recorded.
pub const SPEND_RECORDED: &str = "sluice_spend_recorded_total";
/// Spend reported after the work that did not fit the bucket, recorded as debt.
pub const SPEND_OVER_LIMIT: &str = "sluice_spend_over_limit_total";
/// Descriptors of requests for a domain no policy defines.
pub const DOMAIN_NOT_FOUND: &str = "ratelimit_service_rate_limit_domain_not_found";
/// `ShouldRateLimit` calls that failed, by `err_type`: `service_error` (the request could not be
/// decided as sent) or `redis_error` (the backend could not decide).
pub const SHOULD_RATE_LIMIT_ERROR: &str = "ratelimit_service_should_rate_limit_error";
/// gRPC calls by `grpc_method` (`ShouldRateLimit`).
pub const TOTAL_REQUESTS: &str = "ratelimit_service_total_requests";
/// Time to answer a gRPC call, from its headers to its answer, by `grpc_method`.
pub const RESPONSE_TIME: &str = "ratelimit_service_response_time_seconds";
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
/// Responses of the xDS management server, by result.
pub const XDS_RESPONSES: &str = "sluice_xds_responses_total";
/// Whether the xDS stream is open.
pub const XDS_CONNECTED: &str = "sluice_xds_connected";
/// Script calls sent to Redis.
pub const REDIS_ROUND_TRIPS: &str = "sluice_redis_round_trips_total";
/// The same round trips by purpose: count, take, give or renew.
pub const REDIS_ROUND_TRIPS_BY_PURPOSE: &str = "sluice_redis_round_trips_by_purpose_total";
/// Requests sent to Redis, alone or coalesced with others in one call.
pub const REDIS_REQUESTS: &str = "sluice_redis_requests_total";
/// Failed Redis calls by kind.
pub const REDIS_ERRORS: &str = "sluice_redis_errors_total";
/// Requests refused from the local over-limit cache.
pub const REDIS_CACHE_HITS: &str = "sluice_redis_local_cache_hits_total";
/// Counters found holding no TAT, read as absent and rewritten.
pub const REDIS_COUNTER_REPAIRS: &str = "sluice_redis_counter_repairs_total";
/// Whether a Redis connection is established.
pub const REDIS_CONNECTED: &str = "sluice_redis_connected";
/// The circuit breaker's state.
pub const REDIS_BREAKER: &str = "sluice_redis_breaker_state";
/// Redis round-trip time.
pub const REDIS_LATENCY: &str = "sluice_redis_round_trip_duration_seconds";
/// Slices of hot counters taken from Redis by this node's leases.
pub const LEASE_SLICES: &str = "sluice_lease_slices_total";
/// Tokens those slices took from the shared buckets.
pub const LEASE_TOKENS_TAKEN: &str = "sluice_lease_tokens_taken_total";
/// Unused leased tokens given back to the shared buckets.
pub const LEASE_TOKENS_RETURNED: &str = "sluice_lease_tokens_returned_total";
/// Counters this node holds a lease of.
pub const LEASES: &str = "sluice_leases";
/// Shares of contended counters this node holds.
pub const LEASE_SHARES: &str = "sluice_lease_shares";
/// Share renewals Redis answered.
pub const LEASE_SHARE_RENEWALS: &str = "sluice_lease_share_renewals_total";
/// Which counter answers this node's decisions: shared, leased or local.
pub const BACKEND_MODE: &str = "sluice_backend_mode";
/// Decisions by who answered them: Redis, this node's leases, or the local store.
pub const BACKEND_DECISIONS: &str = "sluice_backend_decisions_total";
/// N, the nodes a budget is divided among in local mode.
pub const BACKEND_FLEET_SIZE: &str = "sluice_backend_fleet_size";
/// Counters held by the local store of `on_backend_error: local`.
pub const BACKEND_LOCAL_KEYS: &str = "sluice_backend_local_keys";
/// Spans the trace collector accepted.
pub const TRACING_EXPORTED: &str = "sluice_tracing_spans_exported_total";
/// Spans dropped before reaching the collector, by reason.
pub const TRACING_DROPPED: &str = "sluice_tracing_spans_dropped_total";
/// RLQS streams open.
pub const RLQS_STREAMS: &str = "sluice_rlqs_streams";
/// Buckets watched over all RLQS streams.
pub const RLQS_BUCKETS: &str = "sluice_rlqs_buckets";
/// Bucket usage reports received on RLQS streams.
pub const RLQS_REPORTS: &str = "sluice_rlqs_reports_total";
/// Bucket actions sent on RLQS streams, by strategy.
pub const RLQS_ACTIONS: &str = "sluice_rlqs_actions_total";
/// RLQS streams refused, by reason.
pub const RLQS_REFUSED: &str = "sluice_rlqs_refused_streams_total";
/// Build information (always 1).
pub const BUILD_INFO: &str = "sluice_build_info";

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

/// Whether a metric is a counter, a gauge or a histogram (its `# TYPE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every metric's kind and description, written once: the recorder is told them at install,
/// and the families rendered from stores at scrape time read them from here.
const FAMILIES: [(&str, Kind, &str); 48] = [
    (
        SHOULD_RATE_LIMIT_ERROR,
        Kind::Counter,
        "ShouldRateLimit calls that failed, by err_type: service_error (the request could not be decided as sent), redis_error (the backend could not decide).",
    ),
    (TOTAL_REQUESTS, Kind::Counter, "gRPC calls, by grpc_method."),
    (
        RESPONSE_TIME,
        Kind::Histogram,
        "Time to answer a gRPC call, from its headers to its answer, by grpc_method.",
    ),
    (
        TRACING_EXPORTED,
        Kind::Counter,
        "Spans the trace collector accepted (with tracing on).",
    ),
    (
        TRACING_DROPPED,
        Kind::Counter,
        "Spans dropped before the collector: queue_full (the queue was full), export_failed (their batch failed or timed out).",
    ),
    (
        TOTAL_HITS,
        Kind::Counter,
        "Hits on a limited rule, weighted by cost.",
    ),
    (
        OVER_LIMIT,
        Kind::Counter,
        "Hits over a limit (refused, or would be in shadow mode).",
    ),
    (
        NEAR_LIMIT,
        Kind::Counter,
        "Admitted hits above 80% of the bucket.",
    ),
    (WITHIN_LIMIT, Kind::Counter, "Admitted hits."),
    (
        SHADOW_MODE,
        Kind::Counter,
        "Hits a shadow-mode rule would have refused.",
    ),
    (
        SPEND_RECORDED,
        Kind::Counter,
        "Spend reported after the work (a descriptor's own hits_addend above 0), recorded whatever the outcome.",
    ),
    (
        SPEND_OVER_LIMIT,
        Kind::Counter,
        "Spend reported after the work that did not fit the bucket, recorded as debt that later checks wait out.",
    ),
    (
        DOMAIN_NOT_FOUND,
        Kind::Counter,
        "Descriptors of requests for an unknown domain.",
    ),
    (
        CONFIG_LOAD_SUCCESS,
        Kind::Counter,
        "Successful policy loads.",
    ),
    (CONFIG_LOAD_ERROR, Kind::Counter, "Failed policy loads."),
    (
        DECISIONS,
        Kind::Counter,
        "Requests by result: ok, over_limit, invalid, backend_error.",
    ),
    (
        DECISION_DURATION,
        Kind::Histogram,
        "Time to decide one request, transport excluded.",
    ),
    (STORE_KEYS, Kind::Gauge, "Keys held by the in-memory store."),
    (
        STORE_EVICTIONS,
        Kind::Counter,
        "Live keys evicted because the store was full.",
    ),
    (POLICY_RELOADS, Kind::Counter, "Policy reloads by result."),
    (
        XDS_RESPONSES,
        Kind::Counter,
        "Responses of the xDS management server, by result: accepted (ACKed, policies swapped in) or rejected (NACKed, the last good policies kept).",
    ),
    (
        XDS_CONNECTED,
        Kind::Gauge,
        "1 while the stream to the xDS management server is open.",
    ),
    (
        REDIS_ROUND_TRIPS,
        Kind::Counter,
        "Script calls sent to Redis.",
    ),
    (
        REDIS_ROUND_TRIPS_BY_PURPOSE,
        Kind::Counter,
        "Round trips to Redis by purpose: count (requests on the exact path, with any lease calls beside them), take (a lease's slice), give (unused tokens back) or renew (a share's renewal).",
    ),
    (
        REDIS_REQUESTS,
        Kind::Counter,
        "Requests sent to Redis; per round trip, more than one when coalesced.",
    ),
    (REDIS_ERRORS, Kind::Counter, "Failed Redis calls by kind."),
    (
        REDIS_CACHE_HITS,
        Kind::Counter,
        "Requests refused from the local over-limit cache.",
    ),
    (
        crate::tls::NOT_AFTER_METRIC,
        Kind::Gauge,
        "When each served TLS certificate stops being valid (notAfter), in Unix seconds; certificate = grpc or redis_client.",
    ),
    (
        REDIS_COUNTER_REPAIRS,
        Kind::Counter,
        "Redis counters found holding no valid TAT (not a number, or a key of another type), read as absent and rewritten.",
    ),
    (
        REDIS_CONNECTED,
        Kind::Gauge,
        "1 once a Redis connection is established.",
    ),
    (
        REDIS_BREAKER,
        Kind::Gauge,
        "The Redis circuit breaker's state (1 for the current one).",
    ),
    (REDIS_LATENCY, Kind::Histogram, "Redis round-trip time."),
    (
        LEASE_SLICES,
        Kind::Counter,
        "Slices of hot counters taken from Redis (takes, and share renewals, granted at least one token).",
    ),
    (
        LEASE_TOKENS_TAKEN,
        Kind::Counter,
        "Tokens leased slices took from the shared buckets.",
    ),
    (
        LEASE_TOKENS_RETURNED,
        Kind::Counter,
        "Unused leased tokens given back to the shared buckets.",
    ),
    (LEASES, Kind::Gauge, "Counters this node holds a lease of."),
    (
        LEASE_SHARES,
        Kind::Gauge,
        "Shares of contended counters this node holds (a rate and burst renewed every L / 4).",
    ),
    (
        LEASE_SHARE_RENEWALS,
        Kind::Counter,
        "Share renewals Redis answered.",
    ),
    (
        BACKEND_MODE,
        Kind::Gauge,
        "Which counter answers decisions: shared (Redis), leased (hot counters from leases) or local (rate/N in memory); 1 for the current one.",
    ),
    (
        BACKEND_DECISIONS,
        Kind::Counter,
        "Decisions by who answered them: redis (a round trip, or its over-limit cache), lease (this node's leased tokens) or local (rate/N in memory).",
    ),
    (
        BACKEND_FLEET_SIZE,
        Kind::Gauge,
        "N: the nodes each budget is divided among while counting locally.",
    ),
    (
        BACKEND_LOCAL_KEYS,
        Kind::Gauge,
        "Counters held by the local store of on_backend_error: local.",
    ),
    (
        RLQS_STREAMS,
        Kind::Gauge,
        "Rate Limit Quota Service streams open on this server.",
    ),
    (
        RLQS_BUCKETS,
        Kind::Gauge,
        "Buckets watched over all Rate Limit Quota Service streams on this server.",
    ),
    (
        RLQS_REPORTS,
        Kind::Counter,
        "Bucket usage reports received on Rate Limit Quota Service streams.",
    ),
    (
        RLQS_ACTIONS,
        Kind::Counter,
        "Bucket actions sent on Rate Limit Quota Service streams, by strategy: allow_all, deny_all, token_bucket (assignments), abandon.",
    ),
    (
        RLQS_REFUSED,
        Kind::Counter,
        "Rate Limit Quota Service streams refused, by reason: no_domain, invalid (a malformed report), too_many_streams (rlqs.max_streams), too_many_streams_on_connection (rlqs.max_streams_per_connection), too_many_streams_from_peer (rlqs.max_streams_per_peer).",
    ),
    (BUILD_INFO, Kind::Gauge, "Build information."),
];

/// Families recorded through the `metrics` recorder; the rest are rendered from their owners'
/// figures at scrape time.
const RECORDED: [&str; 23] = [
    SHOULD_RATE_LIMIT_ERROR,
    TOTAL_REQUESTS,
    TOTAL_HITS,
    OVER_LIMIT,
    NEAR_LIMIT,
    WITHIN_LIMIT,
    SHADOW_MODE,
    SPEND_RECORDED,
    SPEND_OVER_LIMIT,
    DOMAIN_NOT_FOUND,
    CONFIG_LOAD_SUCCESS,
    CONFIG_LOAD_ERROR,
    DECISIONS,
    POLICY_RELOADS,
    XDS_RESPONSES,
    XDS_CONNECTED,
    BUILD_INFO,
    crate::tls::NOT_AFTER_METRIC,
    RLQS_STREAMS,
    RLQS_BUCKETS,
    RLQS_REPORTS,
    RLQS_ACTIONS,
    RLQS_REFUSED,
];

/// Why an RLQS stream was refused, as `sluice_rlqs_refused_streams_total{reason}` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuotaRefusal {
    /// The first message carried no domain, or there was none.
    NoDomain,
    /// A usage report was malformed.
    Invalid,
    /// `rlqs.max_streams` streams were open.
    TooManyStreams,
    /// `rlqs.max_streams_per_connection` streams were open on its connection.
    TooManyOnConnection,
    /// `rlqs.max_streams_per_peer` streams were open from its peer's address.
    TooManyFromPeer,
}

impl QuotaRefusal {
    /// The label value.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::NoDomain => "no_domain",
            Self::Invalid => "invalid",
            Self::TooManyStreams => "too_many_streams",
            Self::TooManyOnConnection => "too_many_streams_on_connection",
            Self::TooManyFromPeer => "too_many_streams_from_peer",
        }
    }
}

/// The Rate Limit Quota Service's figures, recorded through the global recorder. Labels are
/// fixed names, never request values.
#[derive(Clone, Debug)]
pub struct RlqsFigures {
    reports: Counter,
    /// Held while the gauges' figures are read and set, so that of two streams closing at once
    /// the later reading is the one left, not an earlier one written last.
    gauges: Arc<Mutex<()>>,
}

impl Default for RlqsFigures {
    fn default() -> Self {
        Self::new()
    }
}

impl RlqsFigures {
    /// The handles.
    #[must_use]
    pub fn new() -> Self {
        Self {
            reports: metrics::counter!(RLQS_REPORTS),
            gauges: Arc::default(),
        }
    }

    /// Counts `n` bucket usage reports.
    pub fn reported(&self, n: usize) {
        self.reports.increment(n as u64);
    }

    /// Counts one action sent, of `strategy` (`allow_all`, `deny_all`, `token_bucket`,
    /// `abandon`).
    pub fn sent(&self, strategy: &'static str) {
        metrics::counter!(RLQS_ACTIONS, "strategy" => strategy).increment(1);
    }

    /// Counts one stream refused.
    pub fn refused(&self, reason: QuotaRefusal) {
        metrics::counter!(RLQS_REFUSED, "reason" => reason.as_str()).increment(1);
    }

    /// Sets the gauges to what `read` gives: streams open and buckets watched.
    pub fn gauges(&self, read: impl FnOnce() -> (usize, usize)) {
        let _serial = self.gauges.lock().unwrap_or_else(PoisonError::into_inner);
        let (streams, buckets) = read();
        metrics::gauge!(RLQS_STREAMS).set(streams as f64);
        metrics::gauge!(RLQS_BUCKETS).set(buckets as f64);
    }
}

/// A request's result, as `sluice_decisions_total{result}` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    /// Decided: may go through.
    Ok,
    /// Decided: over the limit.
    OverLimit,
    /// Refused as malformed.
    Invalid,
    /// The backend could not decide (counted besides the fallback answer, if any).
    BackendError,
}

/// Whether a policy load succeeded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadResult {
    /// Loaded and swapped in.
    Success,
    /// Rejected; the running policies stay.
    Failure,
}

/// What started a policy load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadTrigger {
    /// The process starting.
    Startup,
    /// A change in the directory, a re-scan, SIGHUP, or a response of the xDS server.
    Reload,
}

/// One counted descriptor of a decided request, for the per-rule counters.
#[derive(Clone, Copy, Debug)]
pub struct RuleHit<'a> {
    /// The request's domain.
    pub domain: &'a str,
    /// The rule that counted it.
    pub rule: &'a Rule,
    /// The descriptor's first two entries (key, value), for request-valued labels.
    pub values: [Option<(&'a str, &'a str)>; 2],
    /// How many entries the descriptor has.
    pub depth: usize,
    /// Its cost.
    pub hits: u64,
    /// Whether it reports spend already made, recorded whatever the outcome.
    pub spent: bool,
    /// Whether the backend found it over its limit (whatever shadow mode answered).
    pub denied: bool,
    /// Requests left after it.
    pub remaining: u64,
    /// The rule's burst.
    pub burst: u64,
}

/// The label value that stands for every request value past the series cap.
pub const OTHER: &str = "_other";

/// Near limit starts above this fraction of the bucket by default, as in envoyproxy/ratelimit
/// (`metrics.near_limit_ratio`).
pub const DEFAULT_NEAR_LIMIT_RATIO: f64 = 0.8;

static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();

/// The `grpc_method` of `ShouldRateLimit`'s series, as the reference's stats name it.
const SHOULD_RATE_LIMIT_METHOD: &str = "ShouldRateLimit";

/// The counters of one rule (one label set).
#[derive(Clone, Debug)]
struct RuleCounters {
    total: Counter,
    over: Counter,
    near: Counter,
    within: Counter,
    shadow: Counter,
    spent: Counter,
    spent_over: Counter,
}

impl RuleCounters {
    fn new(domain: &str, key1: &str, key2: &str) -> Self {
        let labels = [
            ("domain", sanitize(domain)),
            ("key1", sanitize(key1)),
            ("key2", sanitize(key2)),
        ];
        Self {
            total: metrics::counter!(TOTAL_HITS, &labels),
            over: metrics::counter!(OVER_LIMIT, &labels),
            near: metrics::counter!(NEAR_LIMIT, &labels),
            within: metrics::counter!(WITHIN_LIMIT, &labels),
            shadow: metrics::counter!(SHADOW_MODE, &labels),
            spent: metrics::counter!(SPEND_RECORDED, &labels),
            spent_over: metrics::counter!(SPEND_OVER_LIMIT, &labels),
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
    service_error: Counter,
    redis_error: Counter,
    /// `ShouldRateLimit` calls, and the time each took end to end.
    should_rate_limit_calls: Counter,
    should_rate_limit_time: LatencyHistogram,
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
    /// The fraction of a bucket above which an admitted hit is near the limit.
    near_limit_ratio: f64,
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
            service_error: metrics::counter!(SHOULD_RATE_LIMIT_ERROR, "err_type" => "service_error"),
            redis_error: metrics::counter!(SHOULD_RATE_LIMIT_ERROR, "err_type" => "redis_error"),
            should_rate_limit_calls: metrics::counter!(TOTAL_REQUESTS, "grpc_method" => SHOULD_RATE_LIMIT_METHOD),
            should_rate_limit_time: LatencyHistogram::default(),
            duration: LatencyHistogram::default(),
            rules: DashMap::default(),
            detailed: DashMap::new(),
            unknown_domains: DashMap::new(),
            series: AtomicUsize::new(0),
            max_series,
            near_limit_ratio: DEFAULT_NEAR_LIMIT_RATIO,
        }
    }

    /// Counts an admitted hit as `near_limit` above `ratio` of the bucket (0 to 1) instead of
    /// [`DEFAULT_NEAR_LIMIT_RATIO`].
    #[must_use]
    pub fn with_near_limit_ratio(mut self, ratio: f64) -> Self {
        self.near_limit_ratio = ratio.clamp(0.0, 1.0);
        self
    }

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
        out
    }

    /// Counts a policy load.
    pub fn policy_loaded(&self, result: LoadResult, trigger: LoadTrigger) {
        match result {
            LoadResult::Success => metrics::counter!(CONFIG_LOAD_SUCCESS).increment(1),
            LoadResult::Failure => metrics::counter!(CONFIG_LOAD_ERROR).increment(1),
        }
        if trigger == LoadTrigger::Reload {
            let result = match result {
                LoadResult::Success => "success",
                LoadResult::Failure => "failure",
            };
            metrics::counter!(POLICY_RELOADS, "result" => result).increment(1);
        }
    }

    /// Swaps a loaded set into `policies` and counts the load as a reload, or only counts the
    /// failure (the running policies stay): the one path every policy source takes. Series of
    /// rules the new set no longer has are dropped before the swap. Gives the previous set, to
    /// be dropped wherever suits the caller (freeing a large set takes a while).
    ///
    /// # Errors
    ///
    /// The load's error, unchanged.
    pub fn swap_policies(
        &self,
        policies: &PolicyHandle,
        loaded: Result<PolicySet, PolicyError>,
    ) -> Result<(Summary, Arc<PolicySet>), PolicyError> {
        match loaded {
            Ok(set) => {
                let summary = set.summary();
                self.keep_rules_of(&set);
                let old = policies.swap(set);
                self.policy_loaded(LoadResult::Success, LoadTrigger::Reload);
                Ok((summary, old))
            }
            Err(e) => {
                self.policy_loaded(LoadResult::Failure, LoadTrigger::Reload);
                Err(e)
            }
        }
    }

    /// Counts a response of the xDS server, accepted or rejected.
    pub fn xds_response(&self, accepted: bool) {
        let result = if accepted { "accepted" } else { "rejected" };
        metrics::counter!(XDS_RESPONSES, "result" => result).increment(1);
    }

    /// Records whether the stream to the xDS server is open.
    pub fn xds_connected(&self, open: bool) {
        metrics::gauge!(XDS_CONNECTED).set(f64::from(u8::from(open)));
    }

    /// Counts a request by its result; a failed one also as the reference's
    /// `should_rate_limit_error` (`service_error` for input it refuses, `redis_error` for a
    /// backend that cannot decide).
    pub fn request(&self, outcome: RequestOutcome) {
        match outcome {
            RequestOutcome::Ok => &self.ok,
            RequestOutcome::OverLimit => &self.over_limit,
            RequestOutcome::Invalid => {
                self.service_error.increment(1);
                &self.invalid
            }
            RequestOutcome::BackendError => {
                self.redis_error.increment(1);
                &self.backend_errors
            }
        }
        .increment(1);
    }

    /// Records one `ShouldRateLimit` call on the gRPC port, answered after `took`.
    pub fn should_rate_limit_called(&self, took: Duration) {
        self.should_rate_limit_calls.increment(1);
        self.should_rate_limit_time.record(took);
    }

    /// Records the time one decided request took.
    pub fn decided(&self, took: Duration) {
        self.duration.record(took);
    }

    /// Counts one descriptor a rule counted.
    pub fn rule_hit(&self, hit: &RuleHit<'_>) {
        let record = |c: &RuleCounters| {
            c.total.increment(hit.hits);
            if hit.spent {
                c.spent.increment(hit.hits);
                if hit.denied {
                    c.spent_over.increment(hit.hits);
                }
            }
            if hit.denied {
                c.over.increment(hit.hits);
                if hit.rule.shadow_mode {
                    c.shadow.increment(hit.hits);
                }
                return;
            }
            c.within.increment(hit.hits);
            // Truncation intended: the floor of that fraction of the bucket.
            let threshold = (hit.burst as f64 * self.near_limit_ratio) as u64;
            let used = hit.burst.saturating_sub(hit.remaining);
            if used > threshold {
                c.near.increment(hit.hits.min(used - threshold));
            }
        };
        if hit.rule.detailed_metric || hit.rule.value_to_metric {
            let (key1, key2) = detailed_labels(hit);
            self.with_detailed(hit.rule.id, hit.domain, &key1, &key2, record);
        } else {
            self.with_rule(hit.rule, hit.domain, record);
        }
    }

    /// Counts the descriptors of a request for a domain no policy defines.
    pub fn domain_not_found(&self, domain: &str, descriptors: u64) {
        if let Some(c) = self.unknown_domains.get(domain) {
            return c.increment(descriptors);
        }
        let label = if self.reserve_series() { domain } else { OTHER };
        let c = self
            .unknown_domains
            .entry(label.to_string())
            .or_insert_with(|| metrics::counter!(DOMAIN_NOT_FOUND, "domain" => sanitize(label)));
        c.increment(descriptors);
    }

    /// Forgets the counter handles of rules that `set` no longer has, after a reload swapped
    /// it in, so that reloads that rename rules do not grow the maps. The series already
    /// exposed stay exposed, as Prometheus counters do; a rule that comes back continues its.
    pub fn keep_rules_of(&self, set: &PolicySet) {
        let kept: std::collections::HashSet<u128> = set
            .domains()
            .into_iter()
            .flat_map(|d| d.rules().map(|r| r.id))
            .collect();
        self.rules.retain(|id, _| kept.contains(id));
        self.detailed.retain(|(id, _, _), _| kept.contains(id));
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
    entry_labels(rule, (level(0), level(1)))
}

/// One of several limits of a node (`rate_limits`) shares its levels with its siblings, so its
/// name, in brackets, goes on its last label (`key2`, or `key1` when that is empty) to keep the
/// series apart: `key1="user", key2="route_search[per_day]"`.
fn entry_labels(rule: &Rule, (mut key1, mut key2): (String, String)) -> (String, String) {
    if let Some(name) = &rule.entry {
        let last = if key2.is_empty() {
            &mut key1
        } else {
            &mut key2
        };
        last.push_str(&format!("[{name}]"));
    }
    (key1, key2)
}

/// `key1`/`key2` showing request values: every level's with `detailed_metric`, the rule's own
/// (last) level's with `value_to_metric`.
fn detailed_labels(hit: &RuleHit<'_>) -> (String, String) {
    let value = |i: usize| {
        hit.values[i]
            .map(|(k, v)| format!("{k}_{v}"))
            .unwrap_or_default()
    };
    if hit.rule.detailed_metric {
        return entry_labels(hit.rule, (value(0), value(1)));
    }
    let level = |i: usize| hit.rule.levels.get(i).cloned().unwrap_or_default();
    let (mut key1, mut key2) = (level(0), level(1));
    match hit.depth {
        1 => key1 = value(0),
        2 => key2 = value(1),
        _ => {}
    }
    entry_labels(hit.rule, (key1, key2))
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

fn render_redis(out: &mut String, redis: &RedisFigures) {
    family(out, REDIS_ROUND_TRIPS, &plain(redis.round_trips));
    let purposes: Vec<(String, String)> = redis
        .round_trips_by_purpose
        .iter()
        .map(|(p, n)| (format!("{{purpose=\"{}\"}}", p.as_str()), n.to_string()))
        .collect();
    family(out, REDIS_ROUND_TRIPS_BY_PURPOSE, &purposes);
    family(out, REDIS_REQUESTS, &plain(redis.requests));
    let errors: Vec<(String, String)> = redis
        .errors
        .iter()
        .map(|(kind, n)| (format!("{{kind=\"{}\"}}", kind.as_str()), n.to_string()))
        .collect();
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

/// A label value as envoyproxy/ratelimit's `SanitizeStatName` leaves a stat name: `:` and `|`
/// become `_`, then the dots of every IPv4 address in it (four runs of 1 to 3 ASCII digits
/// joined by dots, found left to right as Go's regexp finds `\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}`)
/// become `_`: `masked_remote_address_0.0.0.0/0` → `masked_remote_address_0_0_0_0/0`.
#[must_use]
pub fn sanitize(value: &str) -> String {
    let mut out: Vec<u8> = value
        .bytes()
        .map(|b| if b == b':' || b == b'|' { b'_' } else { b })
        .collect();
    let digits = |s: &[u8], at: usize| s[at..].iter().take_while(|b| b.is_ascii_digit()).count();
    let mut i = 0;
    while i < out.len() {
        // An address starting at i: three runs of 1 to 3 digits each followed by a dot (a
        // shorter prefix of a run would be followed by a digit), then the greedy last run.
        let mut at = i;
        let mut dots = [0; 3];
        let mut found = true;
        for dot in &mut dots {
            let n = digits(&out, at);
            if !(1..=3).contains(&n) || out.get(at + n) != Some(&b'.') {
                found = false;
                break;
            }
            *dot = at + n;
            at += n + 1;
        }
        let last = if found { digits(&out, at).min(3) } else { 0 };
        if last == 0 {
            i += 1;
            continue;
        }
        for dot in dots {
            out[dot] = b'_';
        }
        i = at + last;
    }
    // Only ASCII bytes were replaced by ASCII bytes: still UTF-8.
    String::from_utf8(out).unwrap_or_else(|_| value.to_owned())
}

/// Tells the recorder the description of every family it records.
fn describe() {
    for (name, kind, help) in FAMILIES {
        if !RECORDED.contains(&name) {
            continue;
        }
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::load_str;

    fn hit(metrics: &Metrics, set: &PolicySet, domain: &str) {
        for rule in set.domain(domain).unwrap().rules() {
            metrics.rule_hit(&RuleHit {
                domain,
                rule,
                values: [Some(("k", "v")), None],
                depth: 1,
                hits: 1,
                spent: false,
                denied: false,
                remaining: 1,
                burst: 2,
            });
        }
    }

    #[test]
    fn label_values_are_sanitised_as_the_references_stat_names() {
        for (value, sanitised) in [
            (
                "masked_remote_address_0.0.0.0/0",
                "masked_remote_address_0_0_0_0/0",
            ),
            (
                "masked_remote_address_invert:192.0.2.0/24",
                "masked_remote_address_invert_192_0_2_0/24",
            ),
            ("header_x-user-id_one", "header_x-user-id_one"),
            ("a|b:c", "a_b_c"),
            // Go's leftmost match: the first digit of a four-digit run cannot start one.
            ("1234.5.6.7", "1234_5_6_7"),
            ("v1.2.3", "v1.2.3"),
            ("1.2.3.4.5.6.7.8", "1_2_3_4.5_6_7_8"),
            ("10.0.0.1234", "10_0_0_1234"),
            ("ip_10.1.2.3,x", "ip_10_1_2_3,x"),
            ("ünï.1.2.3.4", "ünï.1_2_3_4"),
            ("", ""),
        ] {
            assert_eq!(sanitize(value), sanitised, "{value}");
        }
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
        let text = metrics.render(
            &Stats::Memory(StoreStats {
                keys: 0,
                max_keys: 1,
                evictions: 0,
            }),
            None,
            None,
        );
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
        let text = metrics.render(
            &Stats::Memory(StoreStats {
                keys: 0,
                max_keys: 1,
                evictions: 0,
            }),
            None,
            None,
        );
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

    #[test]
    fn a_reload_forgets_the_rules_it_removed() {
        let metrics = Metrics::install(10);
        let policy = |name: &str| {
            format!(
                "domain: {name}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n  - key: d\n    detailed_metric: true\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
            )
        };
        let before = load_str(&[("a.yaml", &policy("a")), ("b.yaml", &policy("b"))]).unwrap();
        hit(&metrics, &before, "a");
        hit(&metrics, &before, "b");
        assert_eq!((metrics.rules.len(), metrics.detailed.len()), (2, 2));
        let after = load_str(&[("a.yaml", &policy("a"))]).unwrap();
        metrics.keep_rules_of(&after);
        assert_eq!((metrics.rules.len(), metrics.detailed.len()), (1, 1));
        hit(&metrics, &after, "a");
        assert_eq!((metrics.rules.len(), metrics.detailed.len()), (1, 1));
    }
}
