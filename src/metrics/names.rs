//! Every metric's name, kind and description, written once. The recorder is told the
//! descriptions of the families it records ([`describe`]); the families rendered from the
//! backends' figures at scrape time read theirs from [`FAMILIES`]. Names follow
//! envoyproxy/ratelimit's Prometheus mapping where one exists (so dashboards work), else the
//! `sluice_` prefix. No handle and no value lives here.

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
/// The heaviest keys of each limited rule by refusals over the last minute, by `rank` (1 to
/// `metrics.top_keys`), rendered at scrape time.
pub const TOP_REFUSED: &str = "sluice_rule_top_refused";
/// The heaviest keys of each limited rule by hits over the last minute, by `rank`.
pub const TOP_HITS: &str = "sluice_rule_top_hits";
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
/// Answers held for their slot now (a rule's `delay`).
pub const HELD_REQUESTS: &str = "sluice_held_requests";
/// Answers held for their slot, by how the hold ended: `slot` (answered OK at its slot),
/// `drained` (refused at once because the server stopped) or `cancelled` (the caller went away).
pub const HOLDS: &str = "sluice_holds_total";
/// Build information (always 1).
pub const BUILD_INFO: &str = "sluice_build_info";

/// Whether a metric is a counter, a gauge or a histogram (its `# TYPE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every metric's kind and description, written once: the recorder is told them at install,
/// and the families rendered from stores at scrape time read them from here.
pub(super) const FAMILIES: [(&str, Kind, &str); 52] = [
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
        TOP_REFUSED,
        Kind::Gauge,
        "Refusals over the last 30 to 60 s of the rule's heaviest keys, by rank (at most metrics.top_keys per rule; each within N/capacity of the true count).",
    ),
    (
        TOP_HITS,
        Kind::Gauge,
        "Hits over the last 30 to 60 s of the rule's heaviest keys, by rank (at most metrics.top_keys per rule; each within N/capacity of the true count).",
    ),
    (
        XDS_RESPONSES,
        Kind::Counter,
        "Responses of the xDS management server, by result: accepted (ACKed, policies swapped in) or rejected (NACKed, the last good policies kept).",
    ),
    (
        HELD_REQUESTS,
        Kind::Gauge,
        "Answers held now until their slot (a rule's delay), over all gRPC connections.",
    ),
    (
        HOLDS,
        Kind::Counter,
        "Answers held until their slot, by result: slot (answered OK at its slot), drained (refused at once, the server stopping) or cancelled (the call ended first: its caller went away).",
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
const RECORDED: [&str; 25] = [
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
    HELD_REQUESTS,
    HOLDS,
    BUILD_INFO,
    crate::tls::NOT_AFTER_METRIC,
    RLQS_STREAMS,
    RLQS_BUCKETS,
    RLQS_REPORTS,
    RLQS_ACTIONS,
    RLQS_REFUSED,
];

/// Tells the recorder the description of every family it records.
pub(super) fn describe() {
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
