//! The gRPC adapter for `envoy.service.rate_limit_quota.v3.RateLimitQuotaService` (RLQS):
//! `StreamRateLimitQuotas`, one task per stream. The first message names the domain (else the
//! stream ends `INVALID_ARGUMENT`); each message's usage reports go to the stream's
//! [`Watcher`], and the actions it returns go back as `RateLimitQuotaResponse`s; a tick
//! drives abandons, pushes and renewals. Bucket ids are held to the request caps, and a stream
//! takes its places ([`crate::rlqs::places`]) from its headers on. It keeps the stream's time,
//! speaks the wire and runs the tasks; what to assign is decided in [`crate::rlqs`], and with
//! Redis the fleet's rounds ([`Fleet`]) run on [`run_fleet`]'s timer, a stream asking for a
//! rule's part before its first bucket is assigned. Served through tonic's generated server
//! behind the edge, as the health service is.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, ReusableBoxFuture};
use tonic::codegen::tokio_stream::Stream;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::streams::StreamReset;
use crate::decision::Caps;
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
use crate::rlqs::fleet::{Fleet, tick_interval};
use crate::rlqs::places::{ConnectionStreams, PeerPlace, PeerStreams, StreamPlace};
use crate::rlqs::{Action, ActionKind, Report, ShareTable, Strategy, Watcher};

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

/// How often [`RlqsService::watch_reloads`] looks for a reload: a look is one load of the
/// policies' pointer.
const RELOAD_POLL: Duration = Duration::from_millis(20);

/// Runs `fleet`'s rounds every tick until `stop`, then gives up every rule it holds.
pub(crate) async fn run_fleet(fleet: Fleet, stop: CancellationToken) {
    let mut tick = tokio::time::interval(fleet.tick_interval());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut rounds = fleet.rounds();
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => rounds.tick().await,
        }
    }
    rounds.stop().await;
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
            .and_then(ConnectionStreams::peer);
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
        // The waits other than the next message are kept across messages, so that a message
        // neither joins nor leaves the shared wait lists of the shutdown and the reloads.
        let stopped = stop.cancelled();
        tokio::pin!(stopped);
        let peer = self.tx.clone();
        let gone = peer.closed();
        tokio::pin!(gone);
        let mut reloaded = ReusableBoxFuture::new(reload(self.reloads.clone()));
        let mut watching = true;
        loop {
            let outcome = tokio::select! {
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
                () = &mut stopped => Err(Status::unavailable("the server is shutting down")),
                () = &mut gone => break,
                _ = tick.tick() => Ok(self.stream.tick(self.now())),
                (changed, reloads) = &mut reloaded, if watching => {
                    // The service is going away when its sender is; the tick still runs.
                    watching = changed.is_ok();
                    reloaded.set(reload(reloads));
                    Ok(self.stream.tick(self.now()))
                }
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
            fleet.renew(&self.stream.rules_without_part(&reports)).await;
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

/// The next reload `reloads` is marked with, and the receiver to wait for the one after.
async fn reload(
    mut reloads: watch::Receiver<()>,
) -> (Result<(), watch::error::RecvError>, watch::Receiver<()>) {
    let changed = reloads.changed().await;
    (changed, reloads)
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
                bucket,
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
fn within_caps(i: usize, bucket: &crate::rlqs::BucketId, caps: &Caps) -> Result<(), Status> {
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
        bucket: action.bucket,
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
