//! Who is being limited, on the admin port: `GET /limited`, per domain and rule, the admitted
//! and refused totals, the heaviest refused and hit keys of the last minute with the sketch's
//! error bound, and the keys nearest their limit with their counter's state now (looked up as
//! `POST /counters/lookup` does, charging nothing); and `GET /limited/page`, one self-contained
//! page that polls it. Descriptor values come from clients: the page only ever sets them as
//! text. In Redis mode the view is this node's decisions only; the counters looked up are the
//! fleet's.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use crate::decision::{Decider, Request};
use crate::limiter::Backend;
use crate::metrics::{CAPACITY_PER_TOP, HALF_SECONDS, KeyCount, Metrics, RuleView};
use crate::policy::{Limit, PolicyHandle};

/// What `/limited` reads.
#[derive(Debug, Clone)]
pub(crate) struct LimitedState {
    /// Looks up the counters of the keys nearest their limit.
    pub(crate) decider: Decider,
    /// The sketches, and the policy version.
    pub(crate) metrics: Arc<Metrics>,
    /// Which backend: what this node's view covers.
    pub(crate) backend: Backend,
    /// The rules' limits and the policies' summary.
    pub(crate) policies: PolicyHandle,
}

/// `GET /limited` and `GET /limited/page`.
pub(crate) fn router(state: LimitedState) -> Router {
    Router::new()
        .route("/limited", get(limited))
        .route("/limited/page", get(page))
        .with_state(state)
}

/// The live page, embedded: no asset, no build step.
const PAGE: &str = include_str!("limited.html");

/// `GET /limited/page`: the live page.
async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // Everything is inline; nothing may be loaded from elsewhere.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:",
            ),
        ],
        PAGE,
    )
        .into_response()
}

/// `GET /limited`: the heavy hitters of every limited rule, as JSON.
async fn limited(State(s): State<LimitedState>) -> Response {
    let hitters = s.metrics.hitters();
    let views = hitters.views();
    let policies = s.policies.load();
    let mut rules = Vec::with_capacity(views.len());
    for v in &views {
        let limit = policies
            .domain(&v.domain)
            .and_then(|d| d.rules().find(|r| r.id == v.id))
            .and_then(|r| match r.limit {
                Limit::Limited(rate) => Some(json!({
                    "requests_per_unit": rate.requests_per_unit,
                    "unit": rate.unit.name().to_ascii_lowercase(),
                    "unit_multiplier": rate.unit_multiplier,
                    "burst": rate.burst,
                })),
                Limit::Unlimited => None,
            });
        let mut nearest = Vec::with_capacity(v.nearest.len());
        for k in &v.nearest {
            nearest.push(nearest_now(&s, v, k).await);
        }
        nearest.sort_by_key(|n| {
            (
                n["remaining"].as_u64(),
                std::cmp::Reverse(n["wait_ms"].as_u64()),
            )
        });
        rules.push(json!({
            "domain": v.domain,
            "rule": v.rule,
            "name": v.name,
            "limit": limit,
            "admitted_total": v.admitted_total,
            "refused_total": v.refused_total,
            "window": {
                "seconds": v.window_seconds,
                "hits": v.window_hits,
                "refused": v.window_refused,
            },
            "error_bound": {
                "hits": v.hits_error_bound(),
                "refused": v.refused_error_bound(),
                "capacity": v.capacity,
            },
            "top_refused": keys(&v.top_refused),
            "top_hits": keys(&v.top_hits),
            "nearest_limit": nearest,
        }));
    }
    let (backend, view) = match &s.backend {
        Backend::Memory { .. } => ("memory", "local: this node holds every counter"),
        Backend::Redis(_) | Backend::Leased(_) => (
            "redis",
            "this node's decisions only; remaining and wait are the fleet's counters, in Redis",
        ),
    };
    let version = s.metrics.policy_version();
    axum::Json(json!({
        "backend": backend,
        "view": view,
        "top_keys": hitters.top(),
        "capacity_per_rule": hitters.top() * CAPACITY_PER_TOP,
        "slots_held": hitters.slots(),
        "window": format!("the current {HALF_SECONDS} s and the {HALF_SECONDS} s before"),
        "error_bound": "every count is at least the true count and within N / capacity of it, N being the rule's hits (or refusals) in the window",
        "policy": {
            "version": version.version,
            "reloads": version.version.saturating_sub(1),
            "reloads_failed": version.reloads_failed,
            "summary": policies.summary().to_string(),
        },
        "rules": rules,
    }))
    .into_response()
}

/// A list of keys as JSON.
fn keys(list: &[KeyCount]) -> Vec<Value> {
    list.iter()
        .map(|k| {
            json!({
                "entries": entries(k),
                "count": k.count,
                "error": k.error,
                "remaining": k.remaining,
                "wait_ms": k.wait.div_ceil(1_000_000),
            })
        })
        .collect()
}

fn entries(k: &KeyCount) -> Vec<Value> {
    k.entries
        .iter()
        .map(|(key, value)| json!({"key": key, "value": value}))
        .collect()
}

/// A key near its limit with its counter's state now; the last answer when the counter cannot
/// be read (the backend failing, the rule gone).
async fn nearest_now(s: &LimitedState, v: &RuleView, k: &KeyCount) -> Value {
    let pairs: Vec<(&str, &str)> = k
        .entries
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    let req = Request::from_entries(&v.domain, &[&pairs]);
    let now = s.decider.look_up(&req).await.ok().and_then(|states| {
        states
            .into_iter()
            .find(|st| st.counter.rule.as_ref().is_some_and(|r| r.id == v.id))
    });
    let (remaining, wait, read_now) = match now {
        Some(st) => (st.remaining, st.wait, true),
        None => (k.remaining, k.wait, false),
    };
    json!({
        "entries": entries(k),
        "remaining": remaining,
        "wait_ms": wait.div_ceil(1_000_000),
        "hits": k.count,
        "now": read_now,
    })
}
