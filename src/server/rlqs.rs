//! The gRPC adapter for `envoy.service.rate_limit_quota.v3.RateLimitQuotaService` (RLQS):
//! `StreamRateLimitQuotas`, one task per stream. The first message names the domain (else the
//! stream ends `INVALID_ARGUMENT`); each message's usage reports go to the stream's
//! [`Watcher`], and the actions it returns go back as `RateLimitQuotaResponse`s; a tick
//! drives abandons, pushes and renewals. Bucket ids are held to the request caps, a
//! connection's streams to `rlqs.max_streams_per_connection` and a peer address's to
//! `rlqs.max_streams_per_peer`, from their headers on ([`ConnectionStreams`],
//! [`PeerStreams`]). It keeps the time and speaks the wire; what to assign is decided in
//! [`crate::rlqs`]. With Redis, [`Fleet`] renews this node's part of every rule
//! its streams watch in the fleet tables, one call per rule every tick, and asks for a
//! rule's part before its first bucket is assigned. Served through tonic's generated server
//! behind the edge, as the health service is.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::codegen::tokio_stream::Stream;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::streams::StreamReset;
use crate::decision::Caps;
use crate::limiter::{Backend, BackendError, PartRenewal};
use crate::metrics::{QuotaRefusal, RlqsFigures};
use crate::pb::rate_limit_quota_response::BucketAction;
use crate::pb::rate_limit_quota_response::bucket_action::{
    self, AbandonAction, QuotaAssignmentAction,
};
use crate::pb::rate_limit_quota_service_server::RateLimitQuotaService;
use crate::pb::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports, RateLimitStrategy,
    rate_limit_strategy,
};
use crate::rlqs::{Action, ActionKind, Report, RuleDemand, ShareTable, Strategy, Watcher};

/// Answers awaiting the peer on one stream; past it the stream's task waits.
const QUEUE: usize = 8;

/// `StreamRateLimitQuotas`, answered from `table`.
#[derive(Debug, Clone)]
pub(crate) struct RlqsService {
    table: Arc<ShareTable>,
    figures: RlqsFigures,
    /// Ends every stream at shutdown (`UNAVAILABLE`), so the drain does not wait for them.
    stop: CancellationToken,
    /// When the process's quota clock began.
    epoch: Instant,
    /// The fleet tables, with Redis.
    fleet: Option<Fleet>,
    /// Marked when the policies are replaced, so that every stream pushes at once.
    reloaded: Arc<watch::Sender<()>>,
    /// The request caps (`requests.*`), applied to the domain and to every bucket id.
    caps: Caps,
    /// The streams open from each peer address.
    peers: PeerStreams,
}

impl RlqsService {
    /// The service of `table`'s streams, across `fleet` when there is one, refusing a domain
    /// or bucket id past `caps`.
    pub(crate) fn new(
        table: Arc<ShareTable>,
        fleet: Option<Fleet>,
        stop: CancellationToken,
        caps: Caps,
    ) -> Self {
        Self {
            table,
            figures: RlqsFigures::new(),
            stop,
            epoch: Instant::now(),
            fleet,
            reloaded: Arc::new(watch::channel(()).0),
            caps,
            peers: PeerStreams::default(),
        }
    }

    /// Looks for a replaced policy set every [`RELOAD_POLL`] until `stop`, and wakes every
    /// stream when there is one, so that a reload's assignments are pushed within that, not at
    /// the streams' next tick.
    pub(crate) fn watch_reloads(
        &self,
        stop: CancellationToken,
    ) -> impl Future<Output = ()> + use<> {
        let (table, reloaded) = (Arc::clone(&self.table), Arc::clone(&self.reloaded));
        async move {
            let mut seen = table.policies();
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(RELOAD_POLL) => {}
                }
                let now = table.policies();
                if !Arc::ptr_eq(&now, &seen) {
                    seen = now;
                    reloaded.send_replace(());
                }
            }
        }
    }
}

/// How often [`RlqsService::watch_reloads`] looks for a reload.
const RELOAD_POLL: Duration = Duration::from_millis(100);

/// Requests to Redis one renewal sends at once.
const RENEWALS_AT_ONCE: usize = 64;

/// This node's parts of the rules its streams watch, kept in the fleet tables in Redis
/// (`share.lua`'s quota mode), so that the sluice nodes behind one Service hand out one budget.
/// Each rule's part is renewed every tick with the node's demand for it and lives a TTL
/// unrenewed; a rule no stream watches any more is given up at once. A rule whose part Redis
/// has not told (it cannot answer) is divided as if this node held the part `unknown` says, or
/// not assigned until told (as `on_backend_error` has it); a part once told is kept while Redis
/// is away.
#[derive(Clone)]
pub(crate) struct Fleet {
    backend: Backend,
    table: Arc<ShareTable>,
    /// The part of a rule assumed before Redis has told this node its own (`None`: assign
    /// nothing until it has).
    unknown: Arc<dyn Fn() -> Option<f64> + Send + Sync>,
    /// When the fleet's clock began.
    epoch: Instant,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").finish_non_exhaustive()
    }
}

impl Fleet {
    /// The fleet of `table`'s rules through `backend`, assuming `unknown()` of a rule whose part
    /// Redis has not told.
    pub(crate) fn new(
        backend: Backend,
        table: Arc<ShareTable>,
        unknown: Arc<dyn Fn() -> Option<f64> + Send + Sync>,
    ) -> Self {
        table.set_unknown_part(unknown());
        Self {
            backend,
            table,
            unknown,
            epoch: Instant::now(),
        }
    }

    /// The fleet's clock: nanoseconds since it began.
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    fn renewal(&self, tokens: f64, leave: bool) -> PartRenewal {
        PartRenewal {
            demand: tokens,
            lifetime: self.table.settings().assignment_ttl,
            leave,
        }
    }

    /// Renews each of `rules` with its demand, and records the part each is told, as of when
    /// the renewal was sent (its entry in Redis lives a TTL from no earlier than that).
    async fn renew(&self, rules: &[RuleDemand]) {
        self.table.set_unknown_part((self.unknown)());
        let sent = self.now();
        for (counter, answer) in self.call(rules, false).await {
            match answer {
                Ok(part) => self.table.set_part(counter, part.unwrap_or(1.0), sent),
                // The breaker and the Redis metrics count it. The part is unconfirmed: no
                // assignment of the rule is sent until a renewal succeeds, and the part is
                // dropped once three quarters of a TTL old (`ShareTable::demands`).
                Err(e) => {
                    tracing::debug!(error = %e, "a quota part was not renewed");
                    self.table.set_unconfirmed(counter);
                }
            }
        }
    }

    /// Gives up this node's part of each of `rules`. A part not given up lapses within a TTL.
    async fn leave(&self, rules: &[RuleDemand]) {
        let _ = self.call(rules, true).await;
    }

    /// One quota-table call for each of `rules` (a renewal with its demand, or a leave),
    /// [`RENEWALS_AT_ONCE`] at a time: each rule's counter with Redis's answer.
    async fn call(
        &self,
        rules: &[RuleDemand],
        leave: bool,
    ) -> Vec<(u128, Result<Option<f64>, BackendError>)> {
        let mut answers = Vec::with_capacity(rules.len());
        for chunk in rules.chunks(RENEWALS_AT_ONCE) {
            let calls = chunk.iter().map(|rule| async move {
                let demand = if leave { 0.0 } else { rule.tokens };
                let renewal = self.renewal(demand, leave);
                let answer = self
                    .backend
                    .fleet_part(rule.counter, &rule.quota, &renewal)
                    .await;
                (rule.counter, answer)
            });
            answers.extend(futures_util::future::join_all(calls).await);
        }
        answers
    }

    /// Renews every watched rule each `tick_interval` of the TTL, gives up the rules no stream
    /// watches any more, and at `stop` gives up all of them.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let mut tick = tokio::time::interval(tick_interval(self.table.settings().assignment_ttl));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut held: Vec<RuleDemand> = Vec::new();
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            let rules = self.table.demands(self.now());
            let gone: Vec<RuleDemand> = held
                .iter()
                .filter(|h| !rules.iter().any(|r| r.counter == h.counter))
                .copied()
                .collect();
            self.leave(&gone).await;
            self.renew(&rules).await;
            held = rules;
        }
        self.leave(&held).await;
    }
}

/// The quota streams open on one connection, from their headers on, and the connection's peer
/// address: the connection puts one into the extensions of each of its requests, and a stream
/// holds a [`StreamPlace`] of it until it ends, so that one peer cannot hold every place of
/// `rlqs.max_streams` over a few streams of one connection.
#[derive(Clone, Debug, Default)]
pub(crate) struct ConnectionStreams {
    open: Arc<AtomicUsize>,
    /// The peer's address, when the connection has one.
    peer: Option<IpAddr>,
}

impl ConnectionStreams {
    /// The count of a connection from `peer`.
    pub(crate) fn from_peer(peer: IpAddr) -> Self {
        Self {
            open: Arc::default(),
            peer: Some(peer.to_canonical()),
        }
    }

    /// A place for one more stream, or `None` when `max` are open.
    fn take(&self, max: usize) -> Option<StreamPlace> {
        // Relaxed: a lone count; no other memory is ordered with it.
        self.open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| StreamPlace(Arc::clone(&self.open)))
    }
}

/// One stream's place on its connection, given back when dropped.
#[derive(Debug)]
struct StreamPlace(Arc<AtomicUsize>);

impl Drop for StreamPlace {
    fn drop(&mut self) {
        // Relaxed: as in `ConnectionStreams::take`.
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The quota streams open from each peer address, across all its connections, from their
/// headers on, so that one client cannot hold every place of `rlqs.max_streams` over many
/// connections. An address is forgotten when its last stream ends, so the map holds no more
/// entries than streams are open.
#[derive(Clone, Debug, Default)]
pub(crate) struct PeerStreams(Arc<Mutex<HashMap<IpAddr, usize>>>);

impl PeerStreams {
    fn open(&self) -> MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A place for one more stream from `peer`, or `None` when `max` are open.
    fn take(&self, peer: IpAddr, max: usize) -> Option<PeerPlace> {
        let mut open = self.open();
        let n = open.entry(peer).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(PeerPlace {
            peers: self.clone(),
            peer,
        })
    }

    /// Addresses with a stream open.
    #[cfg(test)]
    fn peers(&self) -> usize {
        self.open().len()
    }
}

/// One stream's place among its peer's, given back when dropped.
#[derive(Debug)]
struct PeerPlace {
    peers: PeerStreams,
    peer: IpAddr,
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        let mut open = self.peers.open();
        if let Some(n) = open.get_mut(&self.peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.peer);
            }
        }
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for RlqsService {
    type StreamRateLimitQuotasStream = Answers;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Answers>, Status> {
        let refuse = |reason, status: Status| {
            self.figures.refused(reason);
            status
        };
        // Taken from the headers on, so that streams that never send a message count too.
        let place = match request.extensions().get::<ConnectionStreams>() {
            Some(streams) => Some(
                streams
                    .take(self.table.settings().max_streams_per_connection)
                    .ok_or_else(|| {
                        refuse(
                            QuotaRefusal::TooManyOnConnection,
                            Status::resource_exhausted(
                                "too many quota streams open on this connection \
                                 (rlqs.max_streams_per_connection)",
                            ),
                        )
                    })?,
            ),
            None => None,
        };
        let peer = request
            .extensions()
            .get::<ConnectionStreams>()
            .and_then(|streams| streams.peer);
        let peer_place = match peer {
            Some(peer) => Some(
                self.peers
                    .take(peer, self.table.settings().max_streams_per_peer)
                    .ok_or_else(|| {
                        refuse(
                            QuotaRefusal::TooManyFromPeer,
                            Status::resource_exhausted(
                                "too many quota streams open from this address \
                                 (rlqs.max_streams_per_peer)",
                            ),
                        )
                    })?,
            ),
            None => None,
        };
        let reset = request.extensions().get::<StreamReset>().cloned();
        let reset = reset.as_ref();
        let mut inbound = request.into_inner();
        let first = match inbound.message().await {
            Ok(Some(first)) => first,
            Ok(None) => {
                return Err(refuse(
                    QuotaRefusal::NoDomain,
                    Status::invalid_argument("the stream ended before its first usage report"),
                ));
            }
            Err(status) => return Err(refuse(QuotaRefusal::Invalid, status)),
        };
        if first.domain.is_empty() {
            return Err(refuse(
                QuotaRefusal::NoDomain,
                Status::invalid_argument("the first usage report must carry a domain"),
            ));
        }
        if first.domain.len() > self.caps.max_domain_bytes {
            return Err(refuse(
                QuotaRefusal::Invalid,
                Status::invalid_argument(format!(
                    "the domain is {} bytes, more than the {} allowed (requests.max_domain_bytes)",
                    first.domain.len(),
                    self.caps.max_domain_bytes
                )),
            ));
        }
        let reports = reports(first.bucket_quota_usages.into_iter(), &self.caps)
            .map_err(|status| refuse(QuotaRefusal::Invalid, status))?;
        let stream = self.table.open(first.domain).map_err(|e| {
            refuse(
                QuotaRefusal::TooManyStreams,
                Status::resource_exhausted(e.to_string()),
            )
        })?;
        let (tx, rx) = mpsc::channel(QUEUE);
        let run = StreamTask {
            reloads: self.reloaded.subscribe(),
            stream,
            fleet: self.fleet.clone(),
            figures: self.figures.clone(),
            tx,
            epoch: self.epoch,
            ttl: self.table.settings().assignment_ttl,
            caps: self.caps,
            _place: (place, peer_place),
            reset: reset.cloned(),
        };
        tokio::spawn(run.run(inbound, reports, self.stop.clone()));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// One stream's task: its reports in, its actions out.
struct StreamTask {
    /// Marked at each reload of the policies.
    reloads: watch::Receiver<()>,
    stream: Watcher,
    fleet: Option<Fleet>,
    figures: RlqsFigures,
    tx: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    epoch: Instant,
    /// `rlqs.assignment_ttl_ms`.
    ttl: Duration,
    /// The request caps, for every bucket id.
    caps: Caps,
    /// Its places on its connection and among its peer's streams, held until the task ends.
    _place: (Option<StreamPlace>, Option<PeerPlace>),
    /// Resets its HTTP/2 stream, when it gives up on a peer that stopped reading.
    reset: Option<StreamReset>,
}

impl StreamTask {
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    async fn run(
        mut self,
        mut inbound: Streaming<RateLimitQuotaUsageReports>,
        first: Vec<Report>,
        stop: CancellationToken,
    ) {
        let ttl = self.ttl;
        let mut tick = tokio::time::interval(tick_interval(ttl));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.figures.reported(first.len());
        let actions = self.report(first).await;
        if !self.send(actions).await {
            return self.close();
        }
        let mut watching = true;
        loop {
            let outcome = tokio::select! {
                () = stop.cancelled() => Err(Status::unavailable("the server is shutting down")),
                () = self.tx.closed() => break,
                _ = tick.tick() => Ok(self.stream.tick(self.now())),
                changed = self.reloads.changed(), if watching => {
                    // The service is going away when its sender is; the tick still runs.
                    watching = changed.is_ok();
                    Ok(self.stream.tick(self.now()))
                }
                message = inbound.message() => match message {
                    Ok(Some(message)) => match reports(message.bucket_quota_usages.into_iter(), &self.caps) {
                        Ok(r) => {
                            self.figures.reported(r.len());
                            Ok(self.report(r).await)
                        }
                        Err(status) => Err(status),
                    },
                    Ok(None) => break,
                    Err(status) => Err(exhausted(status)),
                },
            };
            match outcome {
                Ok(actions) => {
                    if !self.send(actions).await {
                        break;
                    }
                }
                Err(status) => {
                    // The peer may be gone, or not reading: then the stream is reset.
                    let sent = tokio::time::timeout(self.ttl, self.tx.send(Err(status))).await;
                    if sent.is_err()
                        && let Some(reset) = &self.reset
                    {
                        reset.reset();
                    }
                    break;
                }
            }
        }
        self.close();
    }

    /// The actions one message's reports call for: with a fleet, the part of each rule a new
    /// bucket joins is asked for first, so that its first assignment is of this node's part.
    async fn report(&mut self, reports: Vec<Report>) -> Vec<Action> {
        if let Some(fleet) = &self.fleet {
            let rules = self.stream.rules_without_part(&reports);
            if !rules.is_empty() {
                fleet.renew(&rules).await;
            }
        }
        self.stream.report(self.now(), reports)
    }

    /// Sends `actions` as one response; false when the peer has gone.
    async fn send(&mut self, actions: Vec<Action>) -> bool {
        self.figures.gauges(|| self.stream.figures());
        if actions.is_empty() {
            return true;
        }
        let ttl = self.ttl;
        let bucket_action = actions
            .into_iter()
            .map(|a| {
                self.figures.sent(label(&a.kind));
                to_pb(a, ttl)
            })
            .collect();
        // A peer that stops reading for a TTL has let every assignment lapse; its stream ends,
        // so that its task does not wait for ever while its shares hold room, and is reset, so
        // that the peer learns it at once (trailers would wait behind the unread answers).
        let sent = self.tx.send(Ok(RateLimitQuotaResponse { bucket_action }));
        match tokio::time::timeout(self.ttl, sent).await {
            Ok(sent) => sent.is_ok(),
            Err(_) => {
                tracing::debug!("a quota stream's peer stopped reading; resetting the stream");
                if let Some(reset) = &self.reset {
                    reset.reset();
                }
                false
            }
        }
    }

    fn close(self) {
        let table = self.stream.table();
        // Frees the stream's shares.
        drop(self.stream);
        self.figures.gauges(|| table.figures());
    }
}

/// tonic's decoder refuses an oversized message with `OUT_OF_RANGE`; gRPC's code for it, as the
/// edge answers on the call's first message, is `RESOURCE_EXHAUSTED`.
fn exhausted(status: Status) -> Status {
    if status.code() == tonic::Code::OutOfRange {
        Status::resource_exhausted(status.message().to_owned())
    } else {
        status
    }
}

/// An action's `strategy` label in `sluice_rlqs_actions_total`.
fn label(kind: &ActionKind) -> &'static str {
    match kind {
        ActionKind::Abandon => "abandon",
        ActionKind::Assign(Strategy::AllowAll) => "allow_all",
        ActionKind::Assign(Strategy::DenyAll) => "deny_all",
        ActionKind::Assign(Strategy::TokenBucket(_)) => "token_bucket",
    }
}

/// How often a stream's duties run: a quarter of the TTL, between 10 ms and 1 s, so a renewal
/// (due at half the TTL) is never late by more than a quarter of it.
fn tick_interval(ttl: Duration) -> Duration {
    (ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// A message's usage reports as the quota module reads them, or `INVALID_ARGUMENT` for a
/// report without a bucket id, with an empty one, with one past the request caps (more entries
/// than `requests.max_entries`, a key or value longer than `requests.max_key_bytes` or
/// `requests.max_value_bytes`), or with a negative `time_elapsed`: the whole message is
/// checked before any of it is kept. A
/// `time_elapsed` of zero (or none) states no span: Envoy sends whole seconds, so its first
/// report of a new bucket, and every report at intervals under a second, say 0; the stream then
/// measures the span on its own clock.
fn reports(
    usages: impl Iterator<
        Item = crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage,
    >,
    caps: &Caps,
) -> Result<Vec<Report>, Status> {
    usages
        .enumerate()
        .map(|(i, usage)| {
            let bucket = usage
                .bucket_id
                .map(|b| b.bucket)
                .filter(|b| !b.is_empty())
                .ok_or_else(|| Status::invalid_argument("a usage report has no bucket_id"))?;
            within_caps(i, &bucket, caps)?;
            let elapsed = Some(usage.time_elapsed.unwrap_or_default())
                // A negative one is refused here: prost's conversion negates it to report the
                // error, which overflows on `i64::MIN` seconds.
                .filter(|d| d.seconds >= 0 && d.nanos >= 0)
                .and_then(|d| Duration::try_from(d).ok())
                .ok_or_else(|| {
                    Status::invalid_argument("a usage report's time_elapsed must not be negative")
                })?;
            Ok(Report {
                bucket: bucket.into_iter().collect(),
                elapsed_ns: u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX),
                requests: usage
                    .num_requests_allowed
                    .saturating_add(usage.num_requests_denied),
            })
        })
        .collect()
}

/// `INVALID_ARGUMENT` naming what is too large when the bucket id of usage report `i` is past
/// `caps`: a bucket id is kept for as long as its stream watches it, so it is held to the same
/// caps as a `ShouldRateLimit` descriptor. A key past its cap is not echoed.
fn within_caps(
    i: usize,
    bucket: &std::collections::HashMap<String, String>,
    caps: &Caps,
) -> Result<(), Status> {
    let refuse =
        |what: String| Status::invalid_argument(format!("bucket_quota_usages[{i}].{what}"));
    if bucket.len() > caps.max_entries {
        return Err(refuse(format!(
            "bucket_id has {} entries, more than the {} allowed (requests.max_entries)",
            bucket.len(),
            caps.max_entries
        )));
    }
    for (key, value) in bucket {
        if key.len() > caps.max_key_bytes {
            return Err(refuse(format!(
                "bucket_id has a key of {} bytes, more than the {} allowed (requests.max_key_bytes)",
                key.len(),
                caps.max_key_bytes
            )));
        }
        if value.len() > caps.max_value_bytes {
            return Err(refuse(format!(
                "bucket_id[{key:?}] is {} bytes, more than the {} allowed \
                 (requests.max_value_bytes)",
                value.len(),
                caps.max_value_bytes
            )));
        }
    }
    Ok(())
}

/// One action on the wire.
fn to_pb(action: Action, ttl: Duration) -> BucketAction {
    let bucket_id = Some(BucketId {
        bucket: action.bucket.into_iter().collect(),
    });
    let bucket_action = match action.kind {
        ActionKind::Abandon => bucket_action::BucketAction::AbandonAction(AbandonAction {}),
        ActionKind::Assign(strategy) => {
            bucket_action::BucketAction::QuotaAssignmentAction(QuotaAssignmentAction {
                assignment_time_to_live: prost_types::Duration::try_from(ttl).ok(),
                rate_limit_strategy: Some(strategy_pb(strategy)),
            })
        }
    };
    BucketAction {
        bucket_id,
        bucket_action: Some(bucket_action),
    }
}

fn strategy_pb(strategy: Strategy) -> RateLimitStrategy {
    use rate_limit_strategy::{BlanketRule, Strategy as Pb};
    let strategy = match strategy {
        Strategy::AllowAll => Pb::BlanketRule(BlanketRule::AllowAll.into()),
        Strategy::DenyAll => Pb::BlanketRule(BlanketRule::DenyAll.into()),
        Strategy::TokenBucket(b) => Pb::TokenBucket(crate::pb::TokenBucket {
            max_tokens: b.max_tokens,
            tokens_per_fill: Some(b.tokens_per_fill),
            fill_interval: Some(prost_types::Duration {
                seconds: i64::try_from(b.fill_interval_secs).unwrap_or(i64::MAX),
                nanos: 0,
            }),
            name: String::new(),
        }),
    };
    RateLimitStrategy {
        strategy: Some(strategy),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_holds_at_most_its_places_and_is_forgotten_with_its_last_stream() {
        let peers = PeerStreams::default();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let mut held: Vec<PeerPlace> = (0..3).map(|_| peers.take(a, 3).unwrap()).collect();
        assert!(peers.take(a, 3).is_none(), "a fourth place for one address");
        let other = peers
            .take(b, 3)
            .expect("another address has its own places");
        held.pop();
        held.push(peers.take(a, 3).expect("a place given back is taken again"));
        drop(held);
        drop(other);
        assert_eq!(peers.peers(), 0, "no address is kept without a stream");
    }

    #[test]
    fn an_ipv4_peer_over_ipv6_counts_as_itself() {
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let streams = ConnectionStreams::from_peer(mapped);
        assert_eq!(streams.peer, Some("10.0.0.1".parse().unwrap()));
    }
}
