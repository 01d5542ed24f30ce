//! The HTTP admin port: `GET /healthcheck` (200 `OK` while serving, 500 otherwise).

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use super::Health;

/// The admin routes.
pub fn router(health: Health) -> Router {
    Router::new()
        .route("/healthcheck", get(healthcheck))
        .with_state(health)
}

async fn healthcheck(State(health): State<Health>) -> (StatusCode, &'static str) {
    if health.is_serving() {
        (StatusCode::OK, "OK")
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, "")
    }
}
