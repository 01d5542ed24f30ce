//! The composition root: loads policies, binds both listeners, wires the limiter, the gRPC and
//! admin servers and the background sweeper, and sequences shutdown. `main` and the integration
//! tests share all of it; tests bind port 0 and stop the app with a channel.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;

use crate::decision::Decider;
use crate::limiter::{Clock, Limiter, MemoryStore, MonotonicClock, RedisStore};
use crate::metrics::Metrics;
use crate::policy::{self, PolicyError, PolicyHandle, Summary};
use crate::reload::Reloader;
use crate::server::admin::AdminState;
use crate::server::headers::HeaderOptions;
use crate::server::{self, Health, rls::RateLimitHandler};
use crate::settings::{BackendKind, Settings};

/// Why the app could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The policies are invalid (exit status 2).
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A listener could not be bound.
    #[error("cannot listen for {what} on {addr}: {source}")]
    Bind {
        /// `gRPC` or `admin`.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The backend cannot be set up (e.g. a malformed Redis URL).
    #[error("cannot set up the backend: {0}")]
    Backend(String),
    /// A server failed while running.
    #[error("{what} server failed: {message}")]
    Serve {
        /// `gRPC` or `admin`.
        what: &'static str,
        /// The cause.
        message: String,
    },
}

/// Validates the policies named by `settings` without serving.
///
/// # Errors
///
/// [`AppError::Policy`] listing every problem.
pub fn check(settings: &Settings) -> Result<Summary, AppError> {
    Ok(policy::load_dir_with(&settings.policies, load_options(settings))?.summary())
}

fn load_options(settings: &Settings) -> policy::LoadOptions {
    policy::LoadOptions {
        allow_empty: settings.allow_empty_policies,
    }
}

/// A bound, ready-to-run server.
#[derive(Debug)]
pub struct App {
    settings: Settings,
    grpc: TcpListener,
    admin: TcpListener,
    policies: PolicyHandle,
    limiter: Limiter,
    metrics: Arc<Metrics>,
}

impl App {
    /// Loads policies and binds both listeners, deciding with the process's monotonic clock.
    ///
    /// # Errors
    ///
    /// [`AppError`] when the policies are invalid or an address cannot be bound.
    pub async fn bind(settings: Settings) -> Result<Self, AppError> {
        Self::bind_with_clock(settings, Arc::new(MonotonicClock::new())).await
    }

    /// As [`App::bind`], deciding with `clock` (tests drive time by hand).
    ///
    /// # Errors
    ///
    /// [`AppError`] when the policies are invalid or an address cannot be bound.
    pub async fn bind_with_clock(
        settings: Settings,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, AppError> {
        let metrics = Arc::new(Metrics::install(settings.metrics.max_detailed_series));
        let set = policy::load_dir_with(&settings.policies, load_options(&settings))
            .inspect_err(|_| metrics.policy_load(false, false))?;
        metrics.policy_load(true, false);
        tracing::info!(policies = %settings.policies.display(), summary = %set.summary(), "policies loaded");
        let bind = |what, addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| AppError::Bind { what, addr, source })
        };
        let grpc = bind("gRPC", settings.grpc_addr).await?;
        let admin = bind("admin", settings.admin_addr).await?;
        let mut limiter = Limiter::new(
            Arc::new(MemoryStore::with_max_keys(settings.store.max_keys)),
            clock,
        );
        if settings.backend == BackendKind::Redis {
            let redis = RedisStore::connect(settings.redis.config())
                .map_err(|e| AppError::Backend(e.to_string()))?;
            tracing::info!(redis = %settings.redis.redacted_url(), cluster = settings.redis.cluster, "counting in redis");
            limiter = limiter.with_redis(redis);
        }
        Ok(Self {
            policies: PolicyHandle::new(set),
            limiter,
            metrics,
            settings,
            grpc,
            admin,
        })
    }

    /// The bound gRPC address.
    ///
    /// # Panics
    ///
    /// Never in practice: a bound TCP listener always has a local address.
    #[must_use]
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc
            .local_addr()
            .expect("bound listener has an address")
    }

    /// The bound admin address.
    ///
    /// # Panics
    ///
    /// Never in practice: a bound TCP listener always has a local address.
    #[must_use]
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin
            .local_addr()
            .expect("bound listener has an address")
    }

    /// The in-memory store.
    #[must_use]
    pub fn store(&self) -> Arc<MemoryStore> {
        Arc::clone(self.limiter.store())
    }

    /// The live policies.
    #[must_use]
    pub fn policies(&self) -> PolicyHandle {
        self.policies.clone()
    }

    /// Serves until `shutdown` resolves, then stops: health goes NOT_SERVING first, the
    /// listeners close, in-flight calls finish within the grace period.
    ///
    /// # Errors
    ///
    /// [`AppError::Serve`] when a server fails while running.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), AppError> {
        let grpc_addr = self.grpc_addr();
        let admin_addr = self.admin_addr();
        let (reporter, health_service) = tonic_health::server::health_reporter();
        let health = Health::new(reporter);
        let stop = CancellationToken::new();
        let decider = Decider {
            caps: self.settings.requests.caps(),
            shadow_mode: self.settings.shadow_mode,
        };
        let handler = RateLimitHandler::new(
            self.policies.clone(),
            self.limiter.clone(),
            decider,
            Arc::clone(&self.metrics),
            self.settings.on_backend_error,
            HeaderOptions {
                mode: self.settings.response_headers,
                retry_after_jitter_seconds: self.settings.retry_after_jitter_seconds,
                problem_body: self.settings.problem_body,
            },
        );
        let admin_state = AdminState {
            health: health.clone(),
            handler: handler.clone(),
            metrics: Arc::clone(&self.metrics),
            store: self.store(),
            redis: self.limiter.redis().cloned(),
            policies: self.policies.clone(),
        };
        let max_request_bytes = self.settings.requests.max_request_bytes;
        let incoming = TcpIncoming::from(self.grpc).with_nodelay(Some(true));
        let mut grpc = tokio::spawn(
            server::grpc_router(handler, health_service, max_request_bytes)
                .serve_with_incoming_shutdown(incoming, stop.clone().cancelled_owned()),
        );
        let mut admin = tokio::spawn(
            axum::serve(
                self.admin,
                server::admin::router(admin_state, max_request_bytes),
            )
            .with_graceful_shutdown(stop.clone().cancelled_owned())
            .into_future(),
        );
        let sweeper = tokio::spawn(sweep(
            self.limiter.clone(),
            Duration::from_millis(self.settings.store.sweep_interval_ms),
            stop.clone(),
        ));
        let reloader = Reloader::new(
            &self.settings.policies,
            self.policies.clone(),
            Arc::clone(&self.metrics),
        )
        .with_options(load_options(&self.settings));
        let reload = tokio::spawn(reloader.run(self.settings.watch_policies, stop.clone()));
        health.set(true).await;
        tracing::info!(grpc = %grpc_addr, admin = %admin_addr, "serving");

        let failure = tokio::select! {
            () = shutdown => None,
            r = &mut grpc => Some(AppError::Serve { what: "gRPC", message: outcome(r.map(|r| r.map_err(|e| e.to_string()))) }),
            r = &mut admin => Some(AppError::Serve { what: "admin", message: outcome(r.map(|r| r.map_err(|e| e.to_string()))) }),
        };
        tracing::info!(drain_ms = self.settings.drain_delay_ms, "shutting down");
        health.set(false).await;
        if failure.is_none() && self.settings.drain_delay_ms > 0 {
            // Keep answering while load balancers see NOT_SERVING and stop sending traffic.
            tokio::time::sleep(Duration::from_millis(self.settings.drain_delay_ms)).await;
        }
        stop.cancel();
        let grace = Duration::from_millis(self.settings.shutdown_grace_ms);
        let drained = tokio::time::timeout(grace, async {
            let _ = tokio::join!(grpc, admin, sweeper, reload);
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                grace_ms = self.settings.shutdown_grace_ms,
                "grace period over; abandoning in-flight calls"
            );
        }
        tracing::info!("stopped");
        failure.map_or(Ok(()), Err)
    }
}

fn outcome(r: Result<Result<(), String>, tokio::task::JoinError>) -> String {
    match r {
        Ok(Ok(())) => "stopped unexpectedly".into(),
        Ok(Err(e)) => e,
        Err(e) => e.to_string(),
    }
}

/// Removes full-bucket keys every `interval` until `stop`.
async fn sweep(limiter: Limiter, interval: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {
                let removed = limiter.store().sweep(limiter.now());
                tracing::debug!(removed, keys = limiter.store().len(), "swept store");
            }
        }
    }
}
