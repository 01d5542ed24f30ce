//! The HTTP admin port, envoyproxy/ratelimit's surface: `GET /healthcheck`, `GET /metrics`,
//! `POST /json` (a request decided like a gRPC call) and `GET /rlconfig`; and ours, an
//! operator's hand on one counter: `POST /counters/lookup` (read-only) and `POST
//! /counters/reset`, a write, refused unless `admin.write_token_file` is set and the request
//! carries its token (`reset_counters`); who is being limited, `GET /limited` and its live page
//! `GET /limited/page` (`limited`). Routed by [`router`]
//! and served over HTTP/1 by [`serve_admin`], which holds a header-read deadline. The same
//! server serves the two optional listeners the reference has beside it: the Prometheus text
//! alone ([`metrics_router`], its `PROMETHEUS_ADDR`) and `/rlconfig` alone ([`debug_router`], its
//! debug port).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use tokio_util::sync::CancellationToken;

use super::Health;
use super::accept::CappedListener;
use crate::decision::{Code, Counter, CounterError, CounterState, DecideError, Decider};
use crate::limiter::Backend;
use crate::metrics::Metrics;
use crate::policy::{Limit, PolicyHandle};
use crate::settings::WriteToken;
use crate::traces::{CallTracer, TraceFigures};
use crate::wire::json;

/// What the admin endpoints read.
#[derive(Debug, Clone)]
pub(crate) struct AdminState {
    /// Serving or not.
    pub(crate) health: Health,
    /// Decides `/json` requests.
    pub(crate) decider: Decider,
    /// Renders `/metrics`.
    pub(crate) metrics: Arc<Metrics>,
    /// Its figures, for `/metrics`.
    pub(crate) backend: Backend,
    /// For `/rlconfig`.
    pub(crate) policies: PolicyHandle,
    /// With tracing on: a span per `/json` call, and what became of the spans for `/metrics`.
    pub(crate) traces: Option<(Arc<CallTracer>, TraceFigures)>,
    /// The token writes must present; `None`: writes are off.
    pub(crate) write_token: Option<Arc<WriteToken>>,
}

/// The admin routes; `/json` bodies are limited to `max_body_bytes`.
pub(crate) fn router(state: AdminState, max_body_bytes: usize) -> Router {
    let limited = super::limited::router(super::limited::LimitedState {
        decider: state.decider.clone(),
        metrics: Arc::clone(&state.metrics),
        backend: state.backend.clone(),
        policies: state.policies.clone(),
    });
    Router::new()
        .route("/healthcheck", get(healthcheck))
        .route("/metrics", get(metrics))
        .route("/json", post(decide_json))
        .route("/rlconfig", get(rlconfig))
        .route("/counters/lookup", post(look_up_counters))
        .route("/counters/reset", post(reset_counters))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
        .merge(limited)
}

/// The metrics listener's one route: the Prometheus text at `path` (a plain absolute path).
pub(crate) fn metrics_router(state: AdminState, path: &str) -> Router {
    Router::new().route(path, get(metrics)).with_state(state)
}

/// The debug listener's route: `GET /rlconfig`, as on the admin port.
pub(crate) fn debug_router(state: AdminState) -> Router {
    Router::new()
        .route("/rlconfig", get(rlconfig))
        .with_state(state)
}

/// `GET /healthcheck`: 200 `OK` while serving, 500 otherwise.
async fn healthcheck(State(s): State<AdminState>) -> (StatusCode, &'static str) {
    if s.health.is_serving() {
        (StatusCode::OK, "OK")
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, "")
    }
}

/// `GET /metrics`: Prometheus text exposition.
async fn metrics(State(s): State<AdminState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(
            &s.backend.stats(),
            s.decider.local().map(|l| l.figures()).as_ref(),
            s.traces.as_ref().map(|(_, f)| f.read()).as_ref(),
        ),
    )
        .into_response()
}

/// `POST /json`: a proto3-JSON `RateLimitRequest` decided like a gRPC call: 200 OK, 429 over
/// limit, 400 with the reason for bad input, 503 when the backend fails.
async fn decide_json(
    State(s): State<AdminState>,
    request_headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut span = s.traces.as_ref().map(|(tracer, _)| {
        tracer.start("POST /json", |name| {
            request_headers.get(name).and_then(|v| v.to_str().ok())
        })
    });
    let bad = |reason: String| (StatusCode::BAD_REQUEST, format!("{reason}\n")).into_response();
    let req = match json::parse(&body) {
        Ok(r) => r,
        Err(e) => {
            s.decider.count_malformed();
            if let Some(span) = &mut span {
                span.failed_with(e.to_string());
            }
            return bad(e.to_string());
        }
    };
    if let Some(span) = &mut span {
        span.request(&req);
    }
    let decided = s.decider.decide(&req).await;
    if let Some(span) = &mut span {
        match &decided {
            Ok(decision) => span.decided(decision),
            Err(e) => span.failed(e),
        }
    }
    let decision = match decided {
        Ok(d) => d,
        Err(e @ (DecideError::Backend(_) | DecideError::NoPolicies)) => {
            return (StatusCode::SERVICE_UNAVAILABLE, format!("{e}\n")).into_response();
        }
        Err(e @ DecideError::Request(_)) => return bad(e.to_string()),
    };
    let status = match decision.overall {
        Code::Ok => StatusCode::OK,
        Code::OverLimit => StatusCode::TOO_MANY_REQUESTS,
    };
    let mut response = (status, axum::Json(json::render(&decision))).into_response();
    // The same rate-limit headers a gRPC caller gets (the problem body stays gRPC-only).
    for (name, value) in decision.headers {
        if name.eq_ignore_ascii_case("content-type") {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::from_bytes(name.as_bytes()),
            axum::http::HeaderValue::from_str(&value),
        ) {
            response.headers_mut().append(name, value);
        }
    }
    response
}

/// A JSON error answer: `{"error": reason}`.
fn json_error(status: StatusCode, reason: impl std::fmt::Display) -> Response {
    (
        status,
        axum::Json(serde_json::json!({ "error": reason.to_string() })),
    )
        .into_response()
}

/// The answer for a counter request that failed: 400 bad input, 404 no such counter, 503 the
/// backend (or the policies) not there.
fn counter_error(e: &CounterError) -> Response {
    let status = match e {
        CounterError::Request(_) => StatusCode::BAD_REQUEST,
        CounterError::UnknownDomain(_) | CounterError::NoRule(_) => StatusCode::NOT_FOUND,
        CounterError::NoPolicies | CounterError::Backend(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    let reason = match e {
        CounterError::Backend(b) => b.detail(),
        other => other.to_string(),
    };
    json_error(status, reason)
}

/// A counter's rule and key, as the counter endpoints show them.
fn counter_json(c: &Counter) -> serde_json::Map<String, serde_json::Value> {
    let rate = c.rate;
    let rule = serde_json::json!({
        "name": c.rule.as_ref().and_then(|r| r.name.clone()),
        "stats_key": c.rule.as_ref().map(|r| r.qualified_key()),
        "requests_per_unit": rate.requests_per_unit,
        "unit": rate.unit.name().to_ascii_lowercase(),
        "unit_multiplier": rate.unit_multiplier,
        "burst": rate.burst,
        "shadow_mode": c.rule.as_ref().is_some_and(|r| r.shadow_mode),
    });
    let mut out = serde_json::Map::new();
    out.insert("descriptor".into(), c.descriptor.into());
    out.insert("rule".into(), rule);
    out.insert("key".into(), format!("{:032x}", c.key).into());
    out
}

/// Milliseconds in `nanos`, rounded up: a wait is never shown shorter than it is.
fn millis_up(nanos: u64) -> u64 {
    nanos.div_ceil(1_000_000)
}

/// `POST /counters/lookup`: the counters a `/json` body's descriptors are charged on, each with
/// its rule, key, remaining, wait and debt, read without charging anything. 404 for an unknown
/// domain or a descriptor no limited rule matches. Read-only, so open like `/json`.
async fn look_up_counters(State(s): State<AdminState>, body: Bytes) -> Response {
    // The `/json` body: `hitsAddend` and `isNegativeHits` are read and ignored.
    let req = match json::parse(&body) {
        Ok(r) => r,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, e),
    };
    let states = match s.decider.look_up(&req).await {
        Ok(states) => states,
        Err(e) => return counter_error(&e),
    };
    let counters: Vec<serde_json::Value> = states
        .iter()
        .map(|st: &CounterState| {
            let mut out = counter_json(&st.counter);
            out.insert("remaining".into(), st.remaining.into());
            out.insert("wait_ms".into(), millis_up(st.wait).into());
            out.insert("debt_ms".into(), millis_up(st.debt).into());
            if let Some(held) = st.held_here {
                out.insert("held_here".into(), held.into());
            }
            out.into()
        })
        .collect();
    let (backend, reflects) = match &s.backend {
        Backend::Memory { .. } => ("memory", "this node's counter"),
        Backend::Redis(_) => ("redis", "the counter the fleet shares, in Redis"),
        Backend::Leased(_) => (
            "redis",
            "the counter the fleet shares, in Redis; tokens leased to nodes and not yet used count as spent (held_here: this node's)",
        ),
    };
    axum::Json(serde_json::json!({
        "domain": req.domain,
        "backend": backend,
        "reflects": reflects,
        "counters": counters,
    }))
    .into_response()
}

/// `POST /counters/reset`: empties the counters a `/json` body's descriptors are charged on, so
/// the next request is admitted. A write: 403 while `admin.write_token_file` is unset, 401
/// without `Authorization: Bearer <token>` matching it; a refused write changes nothing. Each
/// reset is logged at info with who (the peer, the token's fingerprint) and what.
async fn reset_counters(
    State(s): State<AdminState>,
    peer: Option<axum::Extension<ConnectInfo<std::net::SocketAddr>>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let peer = peer.map_or_else(
        || "unknown".to_owned(),
        |axum::Extension(ConnectInfo(p))| p.to_string(),
    );
    let Some(token) = &s.write_token else {
        tracing::info!(%peer, "counter reset refused: writes are off");
        return json_error(
            StatusCode::FORBIDDEN,
            "writes on the admin port are off: set admin.write_token_file to allow them",
        );
    };
    if !bearer(&headers).is_some_and(|presented| token.matches(presented)) {
        tracing::info!(%peer, "counter reset refused: missing or wrong token");
        let mut response = json_error(
            StatusCode::UNAUTHORIZED,
            "a reset needs the header Authorization: Bearer <the admin write token>",
        );
        response.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            axum::http::HeaderValue::from_static("Bearer"),
        );
        return response;
    }
    // The `/json` body: `hitsAddend` and `isNegativeHits` are read and ignored.
    let req = match json::parse(&body) {
        Ok(r) => r,
        Err(e) => return json_error(StatusCode::BAD_REQUEST, e),
    };
    let counters = match s.decider.reset(&req).await {
        Ok(counters) => counters,
        Err(e) => {
            tracing::info!(%peer, token = token.fingerprint(), domain = %req.domain, error = %e, "counter reset failed");
            return counter_error(&e);
        }
    };
    let entries: Vec<String> = req
        .descriptors
        .iter()
        .map(|d| {
            d.entries
                .iter()
                .map(|e| format!("{}={}", e.key, e.value))
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    let keys: Vec<String> = counters.iter().map(|c| format!("{:032x}", c.key)).collect();
    tracing::info!(%peer, token = token.fingerprint(), domain = %req.domain, entries = ?entries, keys = ?keys, "counters reset");
    let reset: Vec<serde_json::Value> = counters.iter().map(|c| counter_json(c).into()).collect();
    axum::Json(serde_json::json!({ "domain": req.domain, "reset": reset })).into_response()
}

/// The token of an `Authorization: Bearer <token>` header (the scheme in any case).
fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(7)?;
    scheme
        .eq_ignore_ascii_case(b"bearer ")
        .then(|| token.trim_ascii())
}

/// `GET /rlconfig`: the loaded limits (each entry of a `rate_limits` its own line, its name in
/// brackets after the stats key) and cost nodes, one sorted line each.
async fn rlconfig(State(s): State<AdminState>) -> String {
    let set = s.policies.load();
    let domains = set.domains();
    let costs = domains
        .iter()
        .flat_map(|d| d.costs())
        .map(|c| format!("{}: cost={} of {}", c.stats_key, c.cost, c.of));
    let mut lines: Vec<String> = domains
        .iter()
        .flat_map(|d| d.rules())
        .map(|r| {
            let mut line = format!("{}: ", r.qualified_key());
            match r.limit {
                Limit::Unlimited => line.push_str("unlimited"),
                Limit::Limited(rate) => line.push_str(&format!(
                    "unit={} unit_multiplier={} requests_per_unit={} burst={}",
                    rate.unit.name(),
                    rate.unit_multiplier,
                    rate.requests_per_unit,
                    rate.burst
                )),
            }
            if let Some(name) = &r.name {
                line.push_str(&format!(" name={name}"));
            }
            line.push_str(&format!(
                ", shadow_mode: {}, quota_mode: {}",
                r.shadow_mode, r.quota_mode
            ));
            line
        })
        .chain(costs)
        .collect();
    lines.sort();
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// Serves `router` over HTTP/1.1 on `incoming` until `stop`, then finishes the requests in
/// flight and returns. A connection that has not sent a complete request head within
/// `header_read_timeout` (for its first request or the next one on a kept-alive connection) is
/// closed; axum's `serve` sets no timer, so hyper enforces no header deadline under it.
///
/// # Errors
///
/// Never: accept errors are backed off and retried, connection errors end one connection.
/// (The `Result` lets callers treat it like the gRPC server's future.)
pub async fn serve_admin(
    mut incoming: CappedListener,
    router: axum::Router,
    header_read_timeout: Duration,
    stop: CancellationToken,
) -> Result<(), std::convert::Infallible> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;

    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    // Every connection task holds a receiver; shutdown waits until all are dropped.
    let (open_tx, open_rx) = tokio::sync::watch::channel(());
    loop {
        let conn = tokio::select! {
            () = stop.cancelled() => break,
            conn = incoming.accept() => conn,
        };
        // The peer, for the log line of a write.
        let routed = router
            .clone()
            .layer(axum::Extension(ConnectInfo(conn.peer)));
        let served =
            builder.serve_connection(TokioIo::new(conn.io), TowerToHyperService::new(routed));
        let (stop, open, place) = (stop.clone(), open_rx.clone(), conn.place);
        tokio::spawn(async move {
            let mut served = std::pin::pin!(served);
            tokio::select! {
                r = served.as_mut() => finished(r),
                () = stop.cancelled() => {
                    served.as_mut().graceful_shutdown();
                    finished(served.await);
                }
            }
            drop((open, place));
        });
    }
    drop(incoming);
    drop(open_rx);
    open_tx.closed().await;
    Ok(())
}

fn finished(r: Result<(), hyper::Error>) {
    if let Err(e) = r {
        tracing::debug!(error = %e, "admin connection ended");
    }
}
