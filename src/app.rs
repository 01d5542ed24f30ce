//! The composition root: loads policies, binds the listeners (gRPC, admin, and the optional
//! metrics and debug ones), builds the backend and the decider, runs the servers and the
//! background tasks (the store sweep, the Redis connection, the heartbeat and local-store sweep
//! of `on_backend_error: local`, the policy reloader or the xDS client), and sequences shutdown.
//! With an xDS source the ports open at once and calls are answered `UNKNOWN` until the first
//! policies; health reports serving at once with `xds.force_start`, else only from then.
//! `sluice serve` and the integration tests share all of it; tests bind port 0 and stop the app
//! with a channel.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tonic_health::pb::health_server::HealthServer;

use crate::decision::{Decider, OnBackendError};
use crate::limiter::redis::Heartbeat;
use crate::limiter::{
    Backend, BackendError, Clock, LeasedStore, LocalFallback, MemoryStore, MonotonicClock,
    RedisStore, RedisTime,
};
use crate::metrics::{LoadResult, LoadTrigger, Metrics};
use crate::policy::{self, PolicyError, PolicyHandle, PolicySet};
use crate::reload::Reloader;
use crate::rlqs::ShareTable;
use crate::rlqs::fleet::{Fleet, FleetTable};
use crate::server::admin::{self, AdminState};
use crate::server::hold::Holds;
use crate::server::rlqs::{self, RlqsService};
use crate::server::{self, Health, rls::RateLimitHandler};
use crate::server::{CappedListener, GrpcConnections, GrpcRoutes};
use crate::settings::{BackendSettings, Settings};
use crate::tls::{self, ServerTls, TlsError};
use crate::traces::{CallTracer, Traces, TracesError};
use crate::xds::XdsClient;

/// Why the app could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The policies are invalid (exit status 2).
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A listener could not be bound.
    #[error("cannot listen for {what} on {addr}: {source}")]
    Bind {
        /// `gRPC`, `admin`, `metrics` or `debug`.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// The gRPC port's TLS cannot be set up.
    #[error("cannot set up TLS on the gRPC port: {0}")]
    Tls(#[from] TlsError),
    /// The backend cannot be set up.
    #[error("cannot set up the backend: {0}")]
    Backend(#[from] BackendError),
    /// Trace export cannot be set up.
    #[error(transparent)]
    Traces(#[from] TracesError),
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
pub fn load_policies(settings: &Settings) -> Result<PolicySet, AppError> {
    Ok(policy::load_dir_with(
        &settings.policies,
        load_options(settings),
    )?)
}

fn load_options(settings: &Settings) -> policy::LoadOptions {
    policy::LoadOptions {
        allow_empty: settings.allow_empty_policies,
        files: settings.policy_files,
        merge_domains: settings.merge_domains,
    }
}

/// A bound, ready-to-run server.
#[derive(Debug)]
pub struct App {
    settings: Settings,
    grpc: TcpListener,
    admin: TcpListener,
    /// The metrics listener and the path it serves the Prometheus text at, when on.
    metrics_listener: Option<(TcpListener, String)>,
    /// The debug listener (`/rlconfig`), when on.
    debug: Option<TcpListener>,
    policies: PolicyHandle,
    backend: Backend,
    /// With a Redis backend: the mode, the decision counts and the local store.
    local: Option<Arc<LocalFallback>>,
    metrics: Arc<Metrics>,
    tls: Option<ServerTls>,
    /// Trace export, when `tracing.enabled`.
    traces: Option<Traces>,
}

impl App {
    /// Loads policies and binds both listeners, deciding with the process's monotonic clock.
    ///
    /// # Errors
    ///
    /// [`AppError`] when the policies are invalid, the gRPC port's certificate cannot be loaded
    /// or an address cannot be bound.
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
                .with_near_limit_ratio(settings.near_limit_ratio)
                .with_top_keys(settings.top_keys),
        );
        let set = match &settings.xds {
            Some(xds) => {
                tracing::info!(server = %xds.authority, node_id = %xds.node_id, tls = xds.tls.is_some(), force_start = xds.force_start, "policies from an xDS server; none until its first response");
                PolicySet::pending()
            }
            None => {
                let set = policy::load_dir_with(&settings.policies, load_options(&settings))
                    .inspect_err(|_| {
                        metrics.policy_loaded(LoadResult::Failure, LoadTrigger::Startup);
                    })?;
                metrics.policy_loaded(LoadResult::Success, LoadTrigger::Startup);
                tracing::info!(policies = %settings.policies.display(), summary = %set.summary(), "policies loaded");
                set
            }
        };
        let bind = |what, addr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| AppError::Bind { what, addr, source })
        };
        let tls = settings
            .grpc_tls
            .as_ref()
            .map(ServerTls::load)
            .transpose()?;
        if let Some(t) = &settings.grpc_tls {
            tracing::info!(cert_file = %t.cert_file.display(), mtls = t.client_ca_file.is_some(), "TLS on the gRPC port");
        }
        let grpc = bind("gRPC", settings.grpc_addr).await?;
        let admin = bind("admin", settings.admin_addr).await?;
        let metrics_listener = match &settings.metrics_listener {
            Some((addr, path)) => Some((bind("metrics", *addr).await?, path.clone())),
            None => None,
        };
        let debug = match settings.debug_addr {
            Some(addr) => Some(bind("debug", addr).await?),
            None => None,
        };
        let backend = match &settings.backend {
            BackendSettings::Memory { max_keys, .. } => {
                Backend::memory(MemoryStore::with_max_keys(*max_keys), Arc::clone(&clock))
            }
            BackendSettings::Redis(config) => {
                tracing::info!(redis = %config.describe(), cluster = config.cluster, leased = settings.lease.is_some(), "counting in redis");
                let redis =
                    RedisStore::new((**config).clone(), Arc::clone(&clock), RedisTime::Server)?;
                match settings.lease {
                    Some(lease) => {
                        Backend::Leased(LeasedStore::new(redis, lease, Arc::clone(&clock)))
                    }
                    None => Backend::Redis(redis),
                }
            }
        };
        let local = matches!(backend, Backend::Redis(_) | Backend::Leased(_)).then(|| {
            let local = LocalFallback::new(
                MemoryStore::with_max_keys(settings.local.max_keys),
                clock,
                settings.local.fleet_size,
            );
            Arc::new(match &backend {
                Backend::Leased(leased) => local.with_shares(Arc::clone(leased.shares())),
                _ => local,
            })
        });
        let traces = settings.tracing.as_ref().map(Traces::start).transpose()?;
        if let Some(t) = &settings.tracing {
            tracing::info!(endpoint = %t.endpoint, protocol = ?t.protocol, sampling_ratio = t.sampling_ratio, "exporting traces");
        }
        Ok(Self {
            traces,
            policies: PolicyHandle::new(set),
            backend,
            local,
            metrics,
            settings,
            grpc,
            admin,
            metrics_listener,
            debug,
            tls,
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

    /// The bound metrics address, when the metrics listener is on.
    #[must_use]
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_listener
            .as_ref()
            .and_then(|(l, _)| l.local_addr().ok())
    }

    /// The bound debug address, when the debug listener is on.
    #[must_use]
    pub fn debug_addr(&self) -> Option<SocketAddr> {
        self.debug.as_ref().and_then(|l| l.local_addr().ok())
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
        let (grpc_addr, admin_addr) = (self.grpc_addr(), self.admin_addr());
        let (metrics_addr, debug_addr) = (self.metrics_addr(), self.debug_addr());
        let (reporter, health_service) = tonic_health::server::health_reporter();
        let health = Health::new(reporter, self.settings.rlqs.is_some());
        let stop = CancellationToken::new();
        let decider = self.decider();
        let admin_state = self.admin_state(&health, &decider);
        let Self {
            settings,
            grpc,
            admin,
            metrics_listener,
            debug,
            policies,
            backend,
            local,
            metrics,
            tls,
            traces,
        } = self;
        let tracer = traces.as_ref().map(Traces::tracer);
        let table = settings
            .rlqs
            .map(|q| Arc::new(ShareTable::new(q, policies.clone())));
        let fleet = table
            .as_ref()
            .and_then(|t| quota_fleet(&settings, &backend, local.as_ref(), t));
        let quota =
            table.map(|t| RlqsService::new(t, fleet.clone(), stop.clone(), settings.decision.caps));
        let quota_reloads = quota.as_ref().map(|q| q.watch_reloads(stop.clone()));
        let holds = Arc::new(Holds::new(&settings.grpc));
        let grpc = start_grpc(
            grpc,
            &settings,
            tls.clone(),
            (decider, quota, tracer, Arc::clone(&holds)),
            health_service,
            &stop,
        );
        let mut extra = Vec::new();
        if let Some((listener, path)) = metrics_listener {
            let router = admin::metrics_router(admin_state.clone(), &path);
            extra.push((
                "metrics",
                start_http(listener, "metrics", &settings, router, &stop),
            ));
        }
        if let Some(listener) = debug {
            let router = admin::debug_router(admin_state.clone());
            extra.push((
                "debug",
                start_http(listener, "debug", &settings, router, &stop),
            ));
        }
        let router = admin::router(admin_state, settings.max_request_bytes);
        let admin = start_http(admin, "admin", &settings, router, &stop);
        let redis = redis_of(&backend);
        let mut tasks = JoinSet::new();
        start_counting_tasks(
            &mut tasks,
            &settings,
            &backend,
            redis.as_ref(),
            local.as_ref(),
            &stop,
        );
        if let Some(tls) = tls {
            tasks.spawn(tls.watch(tls::RELOAD_EVERY, stop.clone()));
        }
        if let Some(fleet) = fleet {
            tasks.spawn(rlqs::run_fleet(fleet, stop.clone()));
        }
        if let Some(watch) = quota_reloads {
            tasks.spawn(watch);
        }
        // Cancelled when shutdown begins, before health goes NOT_SERVING for good.
        let draining = CancellationToken::new();
        match &settings.xds {
            Some(xds) => {
                let (first, arrived) = oneshot::channel();
                let client = XdsClient::new(xds.clone(), settings.merge_domains, policies, metrics)
                    .on_first_policies(first);
                tasks.spawn(client.run(stop.clone()));
                if xds.force_start {
                    health.set(true).await;
                } else {
                    // Said to gRPC health checks too (an unset status is "not found").
                    health.set(false).await;
                    tracing::info!("health reports not serving until the first policies arrive");
                    tasks.spawn(healthy_when(arrived, health.clone(), draining.clone()));
                }
            }
            None => {
                let reloader = Reloader::new(&settings.policies, policies, metrics)
                    .with_options(load_options(&settings));
                tasks.spawn(reloader.run(settings.watch_policies, stop.clone()));
                health.set(true).await;
            }
        }
        tracing::info!(
            grpc = %grpc_addr,
            admin = %admin_addr,
            metrics = %Listening(metrics_addr),
            debug = %Listening(debug_addr),
            "serving"
        );
        let mut servers = Servers { grpc, admin, extra };
        let failure = servers.until_stopped(shutdown).await;
        draining.cancel();
        // Held answers are given now, refused with their wait: a draining server holds none.
        holds.drain();
        shut_down(&settings, &health, failure.is_none(), stop, async {
            let extra = servers.extra.into_iter().map(|(_, task)| task);
            let _ = tokio::join!(
                servers.grpc,
                servers.admin,
                futures_util::future::join_all(extra),
                tasks.join_all()
            );
        })
        .await;
        if let Some(traces) = traces {
            traces.shutdown().await;
        }
        failure.map_or(Ok(()), Err)
    }

    /// The decider both ports answer with, backed by the local fallback when there is one.
    fn decider(&self) -> Decider {
        let decider = Decider::new(
            self.policies.clone(),
            self.backend.clone(),
            Arc::clone(&self.metrics),
            self.settings.decision.clone(),
        );
        match &self.local {
            Some(local) => decider.with_local(Arc::clone(local)),
            None => decider,
        }
    }

    /// What the admin port reads and answers with.
    fn admin_state(&self, health: &Health, decider: &Decider) -> AdminState {
        AdminState {
            health: health.clone(),
            decider: decider.clone(),
            metrics: Arc::clone(&self.metrics),
            backend: self.backend.clone(),
            policies: self.policies.clone(),
            traces: self.traces.as_ref().map(|t| (t.tracer(), t.figures())),
            write_token: self.settings.admin.write_token.clone().map(Arc::new),
        }
    }
}

/// A server's task: it ends only when stopped, or on a failure.
type ServerTask = JoinHandle<Result<(), Infallible>>;

/// An optional listener's address in the "serving" line: the address, or `off`.
struct Listening(Option<SocketAddr>);

impl std::fmt::Display for Listening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(addr) => addr.fmt(f),
            None => f.write_str("off"),
        }
    }
}

/// The servers' tasks: gRPC, admin, and the optional metrics and debug listeners.
struct Servers {
    grpc: ServerTask,
    admin: ServerTask,
    extra: Vec<(&'static str, ServerTask)>,
}

impl Servers {
    /// Waits for `shutdown`, or for a server to end on its own, which is a failure.
    async fn until_stopped(&mut self, shutdown: impl Future<Output = ()>) -> Option<AppError> {
        let extra = async {
            if self.extra.is_empty() {
                return std::future::pending().await;
            }
            let (r, i, _) =
                futures_util::future::select_all(self.extra.iter_mut().map(|(_, t)| t)).await;
            (i, r)
        };
        tokio::select! {
            () = shutdown => None,
            r = &mut self.grpc => Some(AppError::Serve { what: "gRPC", source: stopped(r) }),
            r = &mut self.admin => Some(AppError::Serve { what: "admin", source: stopped(r) }),
            (i, r) = extra => Some(AppError::Serve { what: self.extra[i].0, source: stopped(r) }),
        }
    }
}

/// Starts the gRPC server on `listener`: the rate-limit service answered by `decider`, the
/// quota service when on, and `grpc.health.v1`, within the port's connection bounds, over TLS
/// when it is on.
fn start_grpc(
    listener: TcpListener,
    settings: &Settings,
    tls: Option<ServerTls>,
    (decider, quota, tracer, holds): (
        Decider,
        Option<RlqsService>,
        Option<Arc<CallTracer>>,
        Arc<Holds>,
    ),
    health: HealthServer<impl tonic_health::pb::health_server::Health>,
    stop: &CancellationToken,
) -> ServerTask {
    let limits = settings.grpc;
    let incoming = CappedListener::new(listener, "gRPC", limits.max_connections);
    let connections = GrpcConnections { limits, tls };
    let routes = GrpcRoutes::new(
        RateLimitHandler::new(decider, holds),
        quota,
        health,
        settings.max_request_bytes,
        &limits,
        tracer,
    );
    tokio::spawn(server::serve_grpc(
        incoming,
        routes,
        connections,
        stop.clone(),
    ))
}

/// Starts the admin server's code on `listener` (the admin port, or the metrics or debug
/// listener, `what`) with `router`, within the admin port's connection bounds.
fn start_http(
    listener: TcpListener,
    what: &'static str,
    settings: &Settings,
    router: axum::Router,
    stop: &CancellationToken,
) -> ServerTask {
    let incoming = CappedListener::new(listener, what, settings.admin.max_connections);
    tokio::spawn(admin::serve_admin(
        incoming,
        router,
        settings.admin.header_read_timeout,
        stop.clone(),
    ))
}

/// With Redis, the fleet the quota service hands each rule out across. A bucket of a rule whose
/// part Redis has not told (it cannot answer) is assigned as `on_backend_error` says: `local`,
/// 1/N of the rule, N as local mode counts the fleet; `deny`, nothing (a token bucket that
/// admits nothing); `allow`, 1/`redis.fleet_size` (the whole rule when unset); `error`, no
/// assignment until Redis answers, so Envoy applies its `no_assignment_behavior`.
fn quota_fleet(
    settings: &Settings,
    backend: &Backend,
    local: Option<&Arc<LocalFallback>>,
    table: &Arc<ShareTable>,
) -> Option<Fleet> {
    // Precision intended: a count of nodes as a divisor.
    let fixed = 1.0 / settings.local.fleet_size.unwrap_or(1).max(1) as f64;
    let unknown: Arc<dyn Fn() -> Option<f64> + Send + Sync> =
        match (settings.decision.on_backend_error, local) {
            (OnBackendError::Local, Some(local)) => {
                let local = Arc::clone(local);
                Arc::new(move || Some(1.0 / local.fleet_size().max(1) as f64))
            }
            (OnBackendError::Deny, _) => Arc::new(|| Some(0.0)),
            (OnBackendError::Allow, _) => Arc::new(move || Some(fixed)),
            (OnBackendError::Error | OnBackendError::Local, _) => Arc::new(|| None),
        };
    let store: Arc<dyn FleetTable> = redis_of(backend)?;
    // The fleet's own clock, the process's: a backend's clock may be driven by hand in tests.
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    Some(Fleet::new(Arc::clone(table), store, clock, unknown))
}

/// The Redis store `backend` counts in, leased or not.
fn redis_of(backend: &Backend) -> Option<Arc<RedisStore>> {
    match backend {
        Backend::Redis(redis) => Some(Arc::clone(redis)),
        Backend::Leased(leased) => Some(Arc::clone(leased.redis())),
        Backend::Memory { .. } => None,
    }
}

/// Starts what counting needs beside the calls: the memory store's sweep; with Redis the
/// connection, lease upkeep, and for `on_backend_error: local` the local store's sweep and,
/// when N is learned, the heartbeat.
fn start_counting_tasks(
    tasks: &mut JoinSet<()>,
    settings: &Settings,
    backend: &Backend,
    redis: Option<&Arc<RedisStore>>,
    local: Option<&Arc<LocalFallback>>,
    stop: &CancellationToken,
) {
    if let BackendSettings::Memory { sweep_interval, .. } = settings.backend {
        let backend = backend.clone();
        tasks.spawn(sweep(move || backend.sweep(), sweep_interval, stop.clone()));
    }
    if let Backend::Leased(leased) = backend {
        // Ends slices as they age; at shutdown gives every unused token back (while the
        // connection below may already be stopping: the give-backs do not queue behind it).
        tasks.spawn(Arc::clone(leased).maintain(stop.clone().cancelled_owned()));
    }
    let Some(redis) = redis else {
        return;
    };
    let connection = Arc::clone(redis);
    let connection_stop = stop.clone();
    tasks.spawn(async move {
        tokio::select! {
            () = connection_stop.cancelled() => {}
            () = connection.connect() => {}
        }
    });
    if let Some(local) = local
        && settings.decision.on_backend_error == OnBackendError::Local
    {
        let swept = Arc::clone(local);
        let interval = settings.local.sweep_interval;
        tasks.spawn(sweep(move || swept.sweep(), interval, stop.clone()));
        if settings.local.fleet_size.is_none() {
            // N is learned: beat until shutdown, then leave the fleet.
            let heartbeat = Heartbeat::new(settings.local.heartbeat_interval);
            tracing::info!(
                node = heartbeat.id(),
                interval_ms = settings.local.heartbeat_interval.as_millis(),
                "recording this node in redis for the local mode's fleet size"
            );
            let (redis, local, stop) = (Arc::clone(redis), Arc::clone(local), stop.clone());
            tasks.spawn(async move {
                redis
                    .heartbeat(&heartbeat, |n| local.see_fleet(n), stop.cancelled_owned())
                    .await;
            });
        }
    }
}

/// Reports healthy once the first policies have `arrived`, unless shutdown began first
/// (`draining`): with an xDS source and no force start, health says not serving until then.
async fn healthy_when(arrived: oneshot::Receiver<()>, health: Health, draining: CancellationToken) {
    tokio::select! {
        () = draining.cancelled() => {}
        got = arrived => if got.is_ok() && !draining.is_cancelled() {
            health.set(true).await;
            tracing::info!("first policies in force; health reports serving");
        }
    }
}

/// The shutdown sequence: health NOT_SERVING; unless a server failed, the drain delay while
/// still answering; then `stop`, and `drained` (the servers and tasks ending) given the grace
/// period.
async fn shut_down(
    settings: &Settings,
    health: &Health,
    asked: bool,
    stop: CancellationToken,
    drained: impl Future<Output = ()>,
) {
    let drain = settings.drain_delay;
    tracing::info!(drain_ms = drain.as_millis(), "shutting down");
    health.set(false).await;
    if asked && !drain.is_zero() {
        // Keep answering while load balancers see NOT_SERVING and stop sending traffic.
        tokio::time::sleep(drain).await;
    }
    stop.cancel();
    if tokio::time::timeout(settings.shutdown_grace, drained)
        .await
        .is_err()
    {
        tracing::warn!(
            grace_ms = settings.shutdown_grace.as_millis(),
            "grace period over; abandoning in-flight calls"
        );
    }
    tracing::info!("stopped");
}

/// Why a server task ended on its own.
fn stopped<E: Into<ServeError>>(r: Result<Result<(), E>, tokio::task::JoinError>) -> ServeError {
    match r {
        Ok(Ok(())) => ServeError::Stopped,
        Ok(Err(e)) => e.into(),
        Err(e) => e.into(),
    }
}

/// Removes full-bucket counters (through `sweep`) every `interval` until `stop`.
async fn sweep(sweep: impl Fn() -> usize, interval: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {
                let removed = sweep();
                tracing::debug!(removed, "swept store");
            }
        }
    }
}
