//! Metrics: the process's Prometheus recorder and the handles the request path increments. It
//! reads the backends' plain figures (`limiter::figures`), no backend. The recorder is global;
//! [`Metrics::install`] is idempotent so tests can start many servers in one process.
//!
//! # Layout
//!
//! - this file: [`Metrics`], the recorder and the counts of requests, loads and streams;
//! - `names`: every metric's name, kind and description;
//! - `rules`: the per-rule counters and the cap on request-valued series ([`sanitize`] too);
//! - `hitters`: the heaviest keys of each limited rule over the last minute ([`Hitters`]);
//! - `exposition`: the text exposition, with the families rendered from figures at scrape time.

mod exposition;
mod hitters;
mod names;
mod rules;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use metrics::{Counter, Gauge};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::histogram::LatencyHistogram;
pub use crate::metrics::exposition::TracingFigures;
pub use crate::metrics::hitters::{
    CAPACITY_PER_TOP, HALF_SECONDS, Hitters, KeyCount, RuleView, Seen,
};
use crate::metrics::names::describe;
pub use crate::metrics::names::*;
use crate::metrics::rules::RuleSeries;
pub use crate::metrics::rules::{DEFAULT_NEAR_LIMIT_RATIO, OTHER, RuleHit, sanitize};
use crate::policy::{PolicyError, PolicyHandle, PolicySet, Summary};

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

/// The `strategy` labels of `sluice_rlqs_actions_total`.
const ACTION_STRATEGIES: [&str; 4] = ["allow_all", "deny_all", "token_bucket", "abandon"];

/// The Rate Limit Quota Service's figures, recorded through the global recorder. Labels are
/// fixed names, never request values.
#[derive(Clone, Debug)]
pub struct RlqsFigures {
    reports: Counter,
    /// `sluice_rlqs_actions_total`, one per strategy of [`ACTION_STRATEGIES`], registered once:
    /// a reload sends an action for every bucket watched.
    actions: [Counter; 4],
    streams: Gauge,
    buckets: Gauge,
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
            actions: ACTION_STRATEGIES.map(|s| metrics::counter!(RLQS_ACTIONS, "strategy" => s)),
            streams: metrics::gauge!(RLQS_STREAMS),
            buckets: metrics::gauge!(RLQS_BUCKETS),
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
        match ACTION_STRATEGIES.iter().position(|s| *s == strategy) {
            Some(i) => self.actions[i].increment(1),
            None => metrics::counter!(RLQS_ACTIONS, "strategy" => strategy).increment(1),
        }
    }

    /// Counts one stream refused.
    pub fn refused(&self, reason: QuotaRefusal) {
        metrics::counter!(RLQS_REFUSED, "reason" => reason.as_str()).increment(1);
    }

    /// Sets the gauges to what `read` gives: streams open and buckets watched.
    pub fn gauges(&self, read: impl FnOnce() -> (usize, usize)) {
        let _serial = self.gauges.lock().unwrap_or_else(PoisonError::into_inner);
        let (streams, buckets) = read();
        self.streams.set(streams as f64);
        self.buckets.set(buckets as f64);
    }
}

/// How a held answer ended, as `sluice_holds_total{result}` counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldEnd {
    /// Answered OK at its slot.
    Slot,
    /// Refused at once because the server drains.
    Drained,
    /// Dropped with its call: the caller went away before the slot.
    Cancelled,
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

static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();

/// The `grpc_method` of `ShouldRateLimit`'s series, as the reference's stats name it.
const SHOULD_RATE_LIMIT_METHOD: &str = "ShouldRateLimit";

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
    /// The per-rule counters and their cap.
    rules: RuleSeries,
    /// The heaviest keys of each limited rule.
    hitters: Hitters,
    /// Policy loads swapped in (the startup load is the first): the policy version.
    policy_version: AtomicU64,
    /// Reloads that failed, the running policies kept.
    reloads_failed: AtomicU64,
}

/// Keys shown per rule by default (`metrics.top_keys`).
pub const DEFAULT_TOP_KEYS: usize = 10;

/// The most keys shown per rule: 10,000 slots per sketch, four sketches per rule.
pub const MAX_TOP_KEYS: usize = 1_000;

/// The policy version and reloads, as the admin port's `/limited` shows them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyVersion {
    /// Successful loads since the process started, the startup load included.
    pub version: u64,
    /// Reloads that failed since then.
    pub reloads_failed: u64,
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
            rules: RuleSeries::new(max_series),
            hitters: Hitters::new(DEFAULT_TOP_KEYS),
            policy_version: AtomicU64::new(0),
            reloads_failed: AtomicU64::new(0),
        }
    }

    /// Tracks the top `top` keys of each limited rule instead of [`DEFAULT_TOP_KEYS`] (0:
    /// none).
    #[must_use]
    pub fn with_top_keys(mut self, top: usize) -> Self {
        self.hitters = Hitters::new(top);
        self
    }

    /// The heaviest keys of each limited rule.
    #[must_use]
    pub const fn hitters(&self) -> &Hitters {
        &self.hitters
    }

    /// The policy version and failed reloads.
    #[must_use]
    pub fn policy_version(&self) -> PolicyVersion {
        // Relaxed: plain counts, read for display.
        PolicyVersion {
            version: self.policy_version.load(Ordering::Relaxed),
            reloads_failed: self.reloads_failed.load(Ordering::Relaxed),
        }
    }

    /// Counts an admitted hit as `near_limit` above `ratio` of the bucket (0 to 1) instead of
    /// [`DEFAULT_NEAR_LIMIT_RATIO`].
    #[must_use]
    pub fn with_near_limit_ratio(mut self, ratio: f64) -> Self {
        self.rules.near_limit_ratio = ratio.clamp(0.0, 1.0);
        self
    }

    /// Counts a policy load.
    pub fn policy_loaded(&self, result: LoadResult, trigger: LoadTrigger) {
        // Relaxed: plain counts, read for display.
        match result {
            LoadResult::Success => self.policy_version.fetch_add(1, Ordering::Relaxed),
            LoadResult::Failure => self.reloads_failed.fetch_add(1, Ordering::Relaxed),
        };
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

    /// Records an answer held for its slot from now on.
    pub fn hold_began(&self) {
        metrics::gauge!(HELD_REQUESTS).increment(1.0);
    }

    /// Records a held answer's end.
    pub fn hold_ended(&self, end: HoldEnd) {
        metrics::gauge!(HELD_REQUESTS).decrement(1.0);
        let result = match end {
            HoldEnd::Slot => "slot",
            HoldEnd::Drained => "drained",
            HoldEnd::Cancelled => "cancelled",
        };
        metrics::counter!(HOLDS, "result" => result).increment(1);
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
        self.rules.hit(hit);
    }

    /// Counts the descriptors of a request for a domain no policy defines.
    pub fn domain_not_found(&self, domain: &str, descriptors: u64) {
        self.rules.domain_not_found(domain, descriptors);
    }

    /// Forgets the counter handles of rules that `set` no longer has, after a reload swapped
    /// it in, so that reloads that rename rules do not grow the maps. The series already
    /// exposed stay exposed, as Prometheus counters do; a rule that comes back continues its.
    pub fn keep_rules_of(&self, set: &PolicySet) {
        self.rules.keep_rules_of(set);
        self.hitters.keep_rules_of(set);
    }
}
