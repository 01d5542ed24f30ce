//! The composition root: loads policies, binds both listeners, builds the backend and the
//! decider, runs the servers and the background tasks (the store sweep, the Redis connection,
//! the policy reloader), and sequences shutdown. `main` and the integration tests share all of
//! it; tests bind port 0 and stop the app with a channel.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::decision::Decider;
use crate::limiter::{
    Backend, BackendError, Clock, MemoryStore, MonotonicClock, RedisStore, RedisTime,
};
use crate::metrics::{LoadResult, LoadTrigger, Metrics};
use crate::policy::{self, PolicyError, PolicyHandle, PolicySet};
use crate::reload::Reloader;
use crate::server::admin::{self, AdminState};
use crate::server::listener::{self, Incoming};
use crate::server::{self, Health, rls::RateLimitHandler};
use crate::settings::{BackendSettings, Settings};

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
    /// The backend cannot be set up.
    #[error("cannot set up the backend: {0}")]
    Backend(#[from] BackendError),
    /// A server failed while running.
    #[error("{what} server failed: {source}")]
    Serve {
        /// `gRPC` or `admin`.
        what: &'static str,
        /// The cause.
        source: ServeError,
    },
}

/// How a server stopped without being asked to.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The gRPC transport failed.
    #[error(transparent)]
    Grpc(#[from] tonic::transport::Error),
    /// Its task panicked or was cancelled.
    #[error(transparent)]
    Task(#[from] tokio::task::JoinError),
    /// It returned although nothing asked it to stop.
    #[error("stopped unexpectedly")]
    Stopped,
}

impl From<std::convert::Infallible> for ServeError {
    fn from(never: std::convert::Infallible) -> Self {
        match never {}
    }
}

/// Loads and validates the policies named by `settings` without serving.
///
/// # Errors
///
/// [`AppError::Policy`] listing every problem.
pub fn check(settings: &Settings) -> Result<PolicySet, AppError> {
    Ok(policy::load_dir_with(
        &settings.policies,
        load_options(settings),
    )?)
}

fn load_options(settings: &Settings) -> policy::LoadOptions {
    policy::LoadOptions {
        allow_empty: settings.allow_empty_policies,
        files: settings.policy_files,
    }
}

/// A bound, ready-to-run server.
#[derive(Debug)]
pub struct App {
    settings: Settings,
    grpc: TcpListener,
    admin: TcpListener,
    policies: PolicyHandle,
    backend: Backend,
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

    /// As [`App::bind`], with `clock` as the backend's clock (tests drive time by hand; Redis
    /// still decides at its own `TIME`).
    ///
    /// # Errors
    ///
    /// [`AppError`] when the policies are invalid or an address cannot be bound.
    pub async fn bind_with_clock(
        settings: Settings,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, AppError> {
        let metrics = Arc::new(
            Metrics::install(settings.max_detailed_series)
                .with_near_limit_ratio(settings.near_limit_ratio),
        );
        let set = policy::load_dir_with(&settings.policies, load_options(&settings)).inspect_err(
            |_| {
                metrics.policy_loaded(LoadResult::Failure, LoadTrigger::Startup);
            },
        )?;
        metrics.policy_loaded(LoadResult::Success, LoadTrigger::Startup);
        tracing::info!(policies = %settings.policies.display(), summary = %set.summary(), "policies loaded");
        let bind = |what, addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| AppError::Bind { what, addr, source })
        };
        let grpc = bind("gRPC", settings.grpc_addr).await?;
        let admin = bind("admin", settings.admin_addr).await?;
        let backend = match &settings.backend {
            BackendSettings::Memory { max_keys, .. } => {
                Backend::memory(MemoryStore::with_max_keys(*max_keys), clock)
            }
            BackendSettings::Redis(config) => {
                tracing::info!(redis = %config.redacted_urls(), cluster = config.cluster, "counting in redis");
                RedisStore::new((**config).clone(), clock, RedisTime::Server)?.backend()
            }
        };
        Ok(Self {
            policies: PolicyHandle::new(set),
            backend,
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

    /// The backend the app counts in.
    #[must_use]
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The live policies.
    #[must_use]
    pub fn policies(&self) -> PolicyHandle {
        self.policies.clone()
    }

    /// Serves until `shutdown` resolves, then stops: health goes NOT_SERVING first, the
    /// listeners close, in-flight calls finish within the grace period, and the background
    /// tasks stop.
    ///
    /// # Errors
    ///
    /// [`AppError::Serve`] when a server fails while running.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), AppError> {
        let grpc_addr = self.grpc_addr();
        let admin_addr = self.admin_addr();
        let Self {
            settings,
            grpc: grpc_listener,
            admin: admin_listener,
            policies,
            backend,
            metrics,
        } = self;
        let (reporter, health_service) = tonic_health::server::health_reporter();
        let health = Health::new(reporter);
        let stop = CancellationToken::new();
        let decider = Decider::new(
            policies.clone(),
            backend.clone(),
            Arc::clone(&metrics),
            settings.decision.clone(),
        );
        let admin_state = AdminState {
            health: health.clone(),
            decider: decider.clone(),
            metrics: Arc::clone(&metrics),
            backend: backend.clone(),
            policies: policies.clone(),
        };
        let limits = settings.grpc;
        let incoming = Incoming::new(
            grpc_listener,
            "gRPC",
            limits.max_connections,
            Some(limits.idle_timeout),
        );
        let mut grpc = tokio::spawn(
            server::grpc_router(
                RateLimitHandler::new(decider),
                health_service,
                settings.max_request_bytes,
                &limits,
            )
            .serve_with_incoming_shutdown(incoming, stop.clone().cancelled_owned()),
        );
        let admin_incoming = Incoming::new(
            admin_listener,
            "admin",
            settings.admin.max_connections,
            None,
        );
        let mut admin = tokio::spawn(listener::serve_admin(
            admin_incoming,
            admin::router(admin_state, settings.max_request_bytes),
            settings.admin.header_read_timeout,
            stop.clone(),
        ));
        let mut tasks = JoinSet::new();
        if let BackendSettings::Memory { sweep_interval, .. } = settings.backend {
            tasks.spawn(sweep(backend.clone(), sweep_interval, stop.clone()));
        }
        if let Backend::Redis(redis) = &backend {
            let (redis, stop) = (Arc::clone(redis), stop.clone());
            tasks.spawn(async move {
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = redis.connect() => {}
                }
            });
        }
        let reloader = Reloader::new(&settings.policies, policies, Arc::clone(&metrics))
            .with_options(load_options(&settings));
        tasks.spawn(reloader.run(settings.watch_policies, stop.clone()));
        health.set(true).await;
        tracing::info!(grpc = %grpc_addr, admin = %admin_addr, "serving");

        let failure = tokio::select! {
            () = shutdown => None,
            r = &mut grpc => Some(AppError::Serve { what: "gRPC", source: stopped(r) }),
            r = &mut admin => Some(AppError::Serve { what: "admin", source: stopped(r) }),
        };
        let drain = settings.drain_delay;
        tracing::info!(drain_ms = drain.as_millis(), "shutting down");
        health.set(false).await;
        if failure.is_none() && !drain.is_zero() {
            // Keep answering while load balancers see NOT_SERVING and stop sending traffic.
            tokio::time::sleep(drain).await;
        }
        stop.cancel();
        let drained = tokio::time::timeout(settings.shutdown_grace, async {
            let _ = tokio::join!(grpc, admin, tasks.join_all());
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                grace_ms = settings.shutdown_grace.as_millis(),
                "grace period over; abandoning in-flight calls"
            );
        }
        tracing::info!("stopped");
        failure.map_or(Ok(()), Err)
    }
}

/// Why a server task ended on its own.
fn stopped<E: Into<ServeError>>(r: Result<Result<(), E>, tokio::task::JoinError>) -> ServeError {
    match r {
        Ok(Ok(())) => ServeError::Stopped,
        Ok(Err(e)) => e.into(),
        Err(e) => e.into(),
    }
}

/// Removes full-bucket counters every `interval` until `stop`.
async fn sweep(backend: Backend, interval: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {
                let removed = backend.sweep();
                tracing::debug!(removed, "swept store");
            }
        }
    }
}
