//! The gRPC adapter for `envoy.service.rate_limit_quota.v3.RateLimitQuotaService` (RLQS):
//! `StreamRateLimitQuotas`, one task per stream. The first message names the domain (else the
//! stream ends `INVALID_ARGUMENT`); each message's usage reports go to the stream's
//! [`QuotaStream`], and the actions it returns go back as `RateLimitQuotaResponse`s; a tick
//! drives abandons, pushes and renewals. It keeps the time and speaks the wire; what to assign
//! is decided in [`crate::quota`]. Served through tonic's generated server behind the edge, as
//! the health service is.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::codegen::tokio_stream::Stream;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::metrics::{QuotaFigures, QuotaRefusal};
use crate::pb::rate_limit_quota_response::BucketAction;
use crate::pb::rate_limit_quota_response::bucket_action::{
    self, AbandonAction, QuotaAssignmentAction,
};
use crate::pb::rate_limit_quota_service_server::RateLimitQuotaService;
use crate::pb::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports, RateLimitStrategy,
    rate_limit_strategy,
};
use crate::quota::{Action, ActionKind, QuotaStream, QuotaTable, Report, Strategy};

/// Answers awaiting the peer on one stream; past it the stream's task waits.
const QUEUE: usize = 8;

/// `StreamRateLimitQuotas`, answered from `table`.
#[derive(Debug, Clone)]
pub(crate) struct QuotaService {
    table: Arc<QuotaTable>,
    figures: QuotaFigures,
    /// Ends every stream at shutdown (`UNAVAILABLE`), so the drain does not wait for them.
    stop: CancellationToken,
    /// When the process's quota clock began.
    epoch: Instant,
}

impl QuotaService {
    pub(crate) fn new(table: Arc<QuotaTable>, stop: CancellationToken) -> Self {
        Self {
            table,
            figures: QuotaFigures::new(),
            stop,
            epoch: Instant::now(),
        }
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for QuotaService {
    type StreamRateLimitQuotasStream = Answers;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Answers>, Status> {
        let mut inbound = request.into_inner();
        let refuse = |reason, status: Status| {
            self.figures.refused(reason);
            status
        };
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
        let reports = reports(first.bucket_quota_usages.into_iter())
            .map_err(|status| refuse(QuotaRefusal::Invalid, status))?;
        let stream = self.table.open(first.domain).map_err(|e| {
            refuse(
                QuotaRefusal::TooManyStreams,
                Status::resource_exhausted(e.to_string()),
            )
        })?;
        let (tx, rx) = mpsc::channel(QUEUE);
        let run = StreamTask {
            stream,
            figures: self.figures.clone(),
            tx,
            epoch: self.epoch,
            ttl: self.table.settings().assignment_ttl,
        };
        tokio::spawn(run.run(inbound, reports, self.stop.clone()));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// One stream's task: its reports in, its actions out.
struct StreamTask {
    stream: QuotaStream,
    figures: QuotaFigures,
    tx: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    epoch: Instant,
    /// `rlqs.assignment_ttl_ms`.
    ttl: Duration,
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
        let first_count = first.len();
        let actions = self.stream.report(self.now(), first);
        self.figures.reported(first_count);
        if !self.send(actions).await {
            return self.close();
        }
        loop {
            let outcome = tokio::select! {
                () = stop.cancelled() => Err(Status::unavailable("the server is shutting down")),
                () = self.tx.closed() => break,
                _ = tick.tick() => {
                    let actions = self.stream.tick(self.now());
                    Ok(actions)
                }
                message = inbound.message() => match message {
                    Ok(Some(message)) => reports(message.bucket_quota_usages.into_iter()).map(|r| {
                        self.figures.reported(r.len());
                        self.stream.report(self.now(), r)
                    }),
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
                    // The peer may be gone; nothing more to do either way.
                    let _ = self.tx.send(Err(status)).await;
                    break;
                }
            }
        }
        self.close();
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
        self.tx
            .send(Ok(RateLimitQuotaResponse { bucket_action }))
            .await
            .is_ok()
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
/// report without a bucket id, with an empty one, or without a positive `time_elapsed`.
fn reports(
    usages: impl Iterator<
        Item = crate::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage,
    >,
) -> Result<Vec<Report>, Status> {
    usages
        .map(|usage| {
            let bucket = usage
                .bucket_id
                .map(|b| b.bucket)
                .filter(|b| !b.is_empty())
                .ok_or_else(|| Status::invalid_argument("a usage report has no bucket_id"))?;
            let elapsed = usage
                .time_elapsed
                // A negative one is refused here: prost's conversion negates it to report the
                // error, which overflows on `i64::MIN` seconds.
                .filter(|d| d.seconds >= 0 && d.nanos >= 0)
                .and_then(|d| Duration::try_from(d).ok())
                .filter(|d| !d.is_zero())
                .ok_or_else(|| {
                    Status::invalid_argument("a usage report's time_elapsed must be more than zero")
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
            fill_interval: prost_types::Duration::try_from(Duration::from_nanos(
                b.fill_interval_ns,
            ))
            .ok(),
            name: String::new(),
        }),
    };
    RateLimitStrategy {
        strategy: Some(strategy),
    }
}
