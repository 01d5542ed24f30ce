//! The quota enforcer of the client half (`sluice::client::Quota`, `--features client`) against
//! the real server's Rate Limit Quota Service with a real policy: the rate it admits under a
//! token bucket, a ban and an unknown bucket, two enforcers sharing one rule, the last
//! assignment kept until its TTL once the server is gone; and, against a recording server,
//! usage counted while the stream was down reported whole on reconnect. Rates are measured over
//! real time (the enforcer and the server keep it), so the spans are short and the bounds say
//! where their slack comes from.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice::client::quota::{Strategy, TokenBucket};
use sluice::client::{Answer, Backoff, Bucket, FailurePolicy, Quota, QuotaBuilder};
use sluice::pb::RateLimitQuotaUsageReports;
use sluice::pb::rate_limit_quota_response::BucketAction;
use sluice::pb::rate_limit_quota_response::bucket_action::{
    BucketAction as Kind, QuotaAssignmentAction,
};
use sluice::pb::rate_limit_quota_service_server::{
    RateLimitQuotaService, RateLimitQuotaServiceServer,
};
use sluice::pb::rate_limit_strategy::{BlanketRule, Strategy as PbStrategy};
use sluice::pb::{RateLimitQuotaResponse, RateLimitStrategy};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::helpers::TestServer;

/// 20 requests a second (burst 20) per user; a ban.
const POLICY: &str = "domain: edge
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 20}
  - key: banned
    rate_limit: {unit: second, requests_per_unit: 0}
";

/// The rule's rate and burst.
const RULE: f64 = 20.0;

/// How long a test waits for something it expects.
const WAIT: Duration = Duration::from_secs(5);

/// The enforcers' report interval: short, so assignments follow demand within a few of them.
const INTERVAL: Duration = Duration::from_millis(100);

/// One offered request per enforcer this often: 200 a second, ten times the rule.
const PACE: Duration = Duration::from_millis(5);

async fn server(ttl_ms: u64) -> TestServer {
    TestServer::start_with(&[("edge.yaml", POLICY)], |w| {
        w.rlqs.assignment_ttl_ms = ttl_ms;
    })
    .await
}

fn builder() -> QuotaBuilder {
    Quota::builder("edge")
        .with_report_interval(INTERVAL)
        .with_backoff(Backoff::new(
            Duration::from_millis(20),
            Duration::from_millis(200),
        ))
}

fn enforcer(server: &TestServer, builder: QuotaBuilder) -> Quota {
    builder
        .connect_lazy(&format!("http://{}", server.grpc))
        .expect("address")
}

fn user(name: &str) -> Bucket {
    Bucket::new([("user", name)])
}

/// The token bucket assigned to `bucket`, if that is what is in force.
fn token_bucket(quota: &Quota, bucket: &Bucket) -> Option<TokenBucket> {
    match quota.assignment(bucket)?.strategy {
        Strategy::TokenBucket(b) => Some(b),
        _ => None,
    }
}

/// Offers `bucket` one request per [`PACE`] on each enforcer until `until` answers, for at most
/// [`WAIT`].
async fn offer_until<T>(
    quotas: &[&Quota],
    bucket: &Bucket,
    mut until: impl FnMut() -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + WAIT;
    let mut pace = tokio::time::interval(PACE);
    while Instant::now() < deadline {
        pace.tick().await;
        for quota in quotas {
            quota.check(bucket);
        }
        if let Some(found) = until() {
            return Some(found);
        }
    }
    None
}

/// What [`offer`] saw.
struct Offered {
    /// Allowed, per enforcer.
    allowed: Vec<u64>,
    /// The longest wait a refusal named.
    longest_wait: Duration,
    refused: u64,
    /// From the first check to the last.
    span: Duration,
}

/// Offers `bucket` one request per [`PACE`] on each enforcer for `span`.
async fn offer(quotas: &[&Quota], bucket: &Bucket, span: Duration) -> Offered {
    let mut seen = Offered {
        allowed: vec![0; quotas.len()],
        longest_wait: Duration::ZERO,
        refused: 0,
        span: Duration::ZERO,
    };
    let started = Instant::now();
    let mut pace = tokio::time::interval(PACE);
    while started.elapsed() < span {
        pace.tick().await;
        for (i, quota) in quotas.iter().enumerate() {
            match quota.check(bucket) {
                Answer::Allowed => seen.allowed[i] += 1,
                Answer::Refused { wait } => {
                    seen.refused += 1;
                    seen.longest_wait = seen.longest_wait.max(wait);
                }
            }
        }
    }
    seen.span = started.elapsed();
    seen
}

#[tokio::test]
async fn client_quota_admits_the_assigned_rate_and_no_more() {
    let s = server(10_000).await;
    let quota = enforcer(&s, builder());
    let alice = user("alice");
    let assigned = offer_until(&[&quota], &alice, || token_bucket(&quota, &alice))
        .await
        .expect("a token bucket assigned within the wait");
    // One enforcer gets min(rule, 1.25 × its reported demand): the whole rule while it offers
    // ten times it, a little less after a report of a span in which a busy machine left its
    // loop waiting. Never more than the rule.
    let fair = |b: &TokenBucket| b.rate() <= RULE && b.rate() >= 0.5 * RULE;
    assert!(fair(&assigned), "{assigned:?}");

    let seen = offer(&[&quota], &alice, Duration::from_millis(1_500)).await;
    let allowed = seen.allowed[0] as f64;
    let now = token_bucket(&quota, &alice).expect("still a token bucket");
    assert!(fair(&now), "{now:?}");
    // At most a full bucket plus what it refills over the span: the rule's burst and rate (a
    // share pushed again carries the tokens left, never more than its capacity; the renewals
    // repeat the strategy and refill nothing).
    let most = RULE + RULE * seen.span.as_secs_f64();
    assert!(allowed <= most, "{allowed} allowed, at most {most}");
    // And the rate is used: the offer is ten times the rule.
    let least = 0.8 * assigned.rate().min(now.rate()) * seen.span.as_secs_f64();
    assert!(allowed >= least, "{allowed} allowed, at least {least}");
    // The rest are refused until the next token: at most one token's time away, at the
    // least rate a fair share has.
    assert!(seen.refused > 0);
    let token = Duration::from_secs_f64(1.0 / (0.5 * RULE));
    assert!(
        seen.longest_wait > Duration::ZERO && seen.longest_wait <= token,
        "{:?}, a token every {token:?}",
        seen.longest_wait
    );
    assert!(quota.is_connected());
}

#[tokio::test]
async fn client_quota_refuses_a_banned_bucket_and_allows_an_unknown_one() {
    let s = server(10_000).await;
    let quota = enforcer(&s, builder());
    let banned = Bucket::new([("banned", "mallory")]);
    // Before its first assignment a bucket gets the unassigned answer: allowed by default.
    assert_eq!(quota.check(&banned), Answer::Allowed);
    let assigned = offer_until(&[&quota], &banned, || quota.assignment(&banned))
        .await
        .expect("an assignment within the wait");
    assert_eq!(assigned.strategy, Strategy::DenyAll);
    assert!(assigned.expires_in <= Duration::from_secs(10));
    for _ in 0..200 {
        assert_eq!(
            quota.check(&banned),
            Answer::Refused { wait: INTERVAL },
            "a ban refuses every request"
        );
    }

    // A bucket that matches no rule: allowed before its assignment and under it.
    let unknown = Bucket::new([("nobody", "x")]).with("route", "search");
    assert!(quota.check(&unknown).is_allowed());
    let assigned = offer_until(&[&quota], &unknown, || quota.assignment(&unknown))
        .await
        .expect("an assignment within the wait");
    assert_eq!(assigned.strategy, Strategy::AllowAll);
    assert!((0..1_000).all(|_| quota.check(&unknown).is_allowed()));
    assert_eq!(quota.buckets(), 2);
}

#[tokio::test]
async fn client_quota_two_enforcers_on_one_bucket_share_the_rule() {
    let s = server(10_000).await;
    let (a, b) = (enforcer(&s, builder()), enforcer(&s, builder()));
    let shared = user("shared");
    // Both offer the same load; each is sent its share as the other's demand shows up.
    let (ra, rb) = offer_until(&[&a, &b], &shared, || {
        let (ta, tb) = (token_bucket(&a, &shared)?, token_bucket(&b, &shared)?);
        let (ra, rb) = (ta.rate(), tb.rate());
        // Shared: neither holds (nearly) the whole rule any more.
        (ra < 0.75 * RULE && rb < 0.75 * RULE).then_some((ra, rb))
    })
    .await
    .expect("both enforcers hold a share within the wait");
    // The server gives a share no more than the other buckets in force leave, so the shares
    // in force add up to at most the rule.
    assert!(ra + rb <= RULE + 1e-9, "{ra} + {rb}");
    assert!(ra + rb >= RULE * 0.5, "the rule is used: {ra} + {rb}");

    let seen = offer(&[&a, &b], &shared, Duration::from_secs(2)).await;
    let allowed = (seen.allowed[0] + seen.allowed[1]) as f64;
    // Together at most the rule's burst and its rate over the span, where one enforcer alone
    // would take as much again.
    let most = RULE * (1.0 + seen.span.as_secs_f64());
    assert!(
        allowed <= most,
        "{:?} allowed, at most {most}",
        seen.allowed
    );
    assert!(
        allowed >= 0.5 * RULE * seen.span.as_secs_f64(),
        "{:?} allowed in {:?} under {ra} + {rb}, now {:?} and {:?}",
        seen.allowed,
        seen.span,
        a.assignment(&shared),
        b.assignment(&shared),
    );
    assert!(
        seen.allowed.iter().all(|&n| n > 0),
        "each admits some: {:?}",
        seen.allowed
    );
}

#[tokio::test]
async fn client_quota_keeps_the_last_assignment_until_its_ttl_then_fails_closed() {
    let s = server(1_000).await;
    let closed = Answer::Refused {
        wait: Duration::from_secs(3),
    };
    let quota = enforcer(
        &s,
        builder().with_failure_policy(FailurePolicy::Closed {
            wait: Duration::from_secs(3),
        }),
    );
    let free = Bucket::new([("nobody", "x")]);
    let assigned = offer_until(&[&quota], &free, || quota.assignment(&free))
        .await
        .expect("an assignment within the wait");
    assert_eq!(assigned.strategy, Strategy::AllowAll);

    s.stop().await.expect("a clean stop");
    let down = offer_until(&[&quota], &free, || (!quota.is_connected()).then_some(()))
        .await
        .is_some();
    assert!(down, "the enforcer sees the stream go down");
    // Kept: the assignment holds until its TTL (1 s from its last renewal), which falls
    // between `early` and `late`.
    let before = Instant::now();
    let kept = quota
        .assignment(&free)
        .expect("the last assignment still holds");
    let (early, late) = (before + kept.expires_in, Instant::now() + kept.expires_in);
    assert!(kept.expires_in <= Duration::from_secs(1), "{kept:?}");
    // A bucket never assigned gets the failure policy while the stream is down.
    assert_eq!(quota.check(&Bucket::new([("other", "y")])), closed);
    let mut allowed_after = None;
    let mut pace = tokio::time::interval(Duration::from_millis(10));
    while Instant::now() < late + Duration::from_secs(1) {
        pace.tick().await;
        let before = Instant::now();
        let answer = quota.check(&free);
        let after = Instant::now();
        match answer {
            Answer::Allowed => {
                assert!(before < late, "allowed {:?} past the TTL", before - late);
                allowed_after = Some(before);
            }
            refused => {
                assert_eq!(refused, closed);
                assert!(after >= early, "refused {:?} before the TTL", early - after);
            }
        }
    }
    assert!(allowed_after.is_some(), "allowed while the assignment held");
    assert_eq!(quota.assignment(&free), None, "expired");
    assert!(!quota.is_connected(), "nothing to reconnect to");
}

#[tokio::test]
async fn client_quota_tracks_at_most_its_cap_of_buckets_and_none_it_cannot_report() {
    let s = server(10_000).await;
    let quota = enforcer(&s, builder().with_max_buckets(2));
    for name in ["a", "b", "c", "d"] {
        assert!(quota.check(&user(name)).is_allowed(), "unassigned: allowed");
    }
    assert_eq!((quota.buckets(), quota.untracked()), (2, 2));

    // The two tracked are assigned; the others never are.
    let assigned = crate::helpers::eventually(WAIT, || async {
        token_bucket(&quota, &user("a")).is_some() && token_bucket(&quota, &user("b")).is_some()
    })
    .await;
    assert!(assigned);
    assert_eq!(quota.assignment(&user("c")), None);
    // With room: an empty bucket, and one too large to report, are never tracked either (a
    // report of either would end the stream), and the stream stays up.
    let roomy = enforcer(&s, builder());
    assert!(roomy.check(&Bucket::default()).is_allowed());
    assert!(roomy.check(&user(&"x".repeat(9_000))).is_allowed());
    assert!(roomy.check(&user("fits")).is_allowed());
    assert_eq!((roomy.buckets(), roomy.untracked()), (1, 2));
    assert!(
        crate::helpers::eventually(WAIT, || async {
            token_bucket(&roomy, &user("fits")).is_some()
        })
        .await
    );
    assert_eq!(roomy.reconnects(), 0);
    assert!(roomy.is_connected());
    // Each answered by the fallback, and counted so in the process's recorder (the server's
    // /metrics shows it; other tests may add to it, never take away).
    for (reason, least) in [("untracked", 4.0), ("unassigned", 3.0)] {
        let series = format!("sluice_client_quota_fallbacks_total{{reason=\"{reason}\"}}");
        let count = crate::helpers::metric(s.admin, &series).await;
        assert!(count >= Some(least), "{series}: {count:?}");
    }
}

/// A Rate Limit Quota Service that records every report, answers each reported bucket
/// `ALLOW_ALL` for `ttl_ms` (a minute when 0), and can be taken down: its open streams end
/// `UNAVAILABLE` and new ones are refused until it is up again; or muted: it records reports
/// and answers nothing.
#[derive(Clone, Default)]
struct Recorder {
    /// Requests reported (allowed + denied), by bucket value.
    reported: Arc<Mutex<HashMap<String, u64>>>,
    /// Each report's `time_elapsed`, by bucket value.
    spans: Arc<Mutex<HashMap<String, Vec<Duration>>>>,
    down: Arc<AtomicBool>,
    mute: Arc<AtomicBool>,
    ttl_ms: Arc<AtomicU64>,
    refused: Arc<AtomicUsize>,
    opened: Arc<AtomicUsize>,
    messages: Arc<AtomicU64>,
    kill: Arc<Mutex<Option<broadcast::Sender<()>>>>,
}

impl Recorder {
    fn total(&self, value: &str) -> u64 {
        let reported = self.reported.lock().expect("lock");
        reported.get(value).copied().unwrap_or(0)
    }

    fn take_down(&self) {
        self.down.store(true, Ordering::SeqCst);
        if let Some(kill) = self.kill.lock().expect("lock").as_ref() {
            let _ = kill.send(());
        }
    }
}

type Answers = std::pin::Pin<
    Box<
        dyn tonic::codegen::tokio_stream::Stream<Item = Result<RateLimitQuotaResponse, Status>>
            + Send,
    >,
>;

#[tonic::async_trait]
impl RateLimitQuotaService for Recorder {
    type StreamRateLimitQuotasStream = Answers;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Answers>, Status> {
        if self.down.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(Status::unavailable("down"));
        }
        self.opened.fetch_add(1, Ordering::SeqCst);
        let mut kill = self
            .kill
            .lock()
            .expect("lock")
            .get_or_insert_with(|| broadcast::channel(4).0)
            .subscribe();
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(8);
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    _ = kill.recv() => {
                        let _ = tx.send(Err(Status::unavailable("taken down"))).await;
                        return;
                    }
                    message = inbound.message() => message,
                };
                let Ok(Some(message)) = message else { return };
                me.messages.fetch_add(1, Ordering::SeqCst);
                let mut actions = Vec::new();
                for usage in message.bucket_quota_usages {
                    let id = usage.bucket_id.expect("a bucket id");
                    let value = id.bucket.values().cloned().collect::<Vec<_>>().join(",");
                    let span = usage
                        .time_elapsed
                        .and_then(|d| Duration::try_from(d).ok())
                        .expect("a positive time_elapsed");
                    me.spans
                        .lock()
                        .expect("lock")
                        .entry(value.clone())
                        .or_default()
                        .push(span);
                    *me.reported.lock().expect("lock").entry(value).or_default() +=
                        usage.num_requests_allowed + usage.num_requests_denied;
                    actions.push(BucketAction {
                        bucket_id: Some(id),
                        bucket_action: Some(Kind::QuotaAssignmentAction(QuotaAssignmentAction {
                            assignment_time_to_live: prost_types::Duration::try_from(
                                match me.ttl_ms.load(Ordering::SeqCst) {
                                    0 => Duration::from_secs(60),
                                    ms => Duration::from_millis(ms),
                                },
                            )
                            .ok(),
                            rate_limit_strategy: Some(RateLimitStrategy {
                                strategy: Some(PbStrategy::BlanketRule(
                                    BlanketRule::AllowAll.into(),
                                )),
                            }),
                        })),
                    });
                }
                if me.mute.load(Ordering::SeqCst) {
                    continue;
                }
                if tx
                    .send(Ok(RateLimitQuotaResponse {
                        bucket_action: actions,
                    }))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

impl Recorder {
    /// Serves it on loopback; its address.
    async fn serve(&self) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RateLimitQuotaServiceServer::new(self.clone()))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        addr
    }

    /// Waits until `n` requests of `value` are reported.
    async fn reported(&self, value: &str, n: u64) -> bool {
        crate::helpers::eventually(WAIT, || async { self.total(value) == n }).await
    }
}

#[tokio::test]
async fn client_quota_reports_usage_counted_while_down_on_reconnect() {
    let recorder = Recorder::default();
    let addr = recorder.serve().await;
    let quota = builder()
        .connect_lazy(&format!("http://{addr}"))
        .expect("address");
    let bucket = user("counted");
    let check = |n: u64| {
        for _ in 0..n {
            assert!(quota.check(&bucket).is_allowed());
        }
    };
    check(10);
    assert!(
        recorder.reported("counted", 10).await,
        "reported: {}",
        recorder.total("counted")
    );
    assert!(
        crate::helpers::eventually(WAIT, || async { quota.assignment(&bucket).is_some() }).await,
        "assigned"
    );

    recorder.take_down();
    assert!(
        crate::helpers::eventually(WAIT, || async { !quota.is_connected() }).await,
        "the stream goes down"
    );
    // Counted while down, under the assignment kept (ALLOW_ALL for a minute).
    check(25);
    // Nothing reaches the server while it is down, and the enforcer keeps trying.
    tokio::time::sleep(INTERVAL * 3).await;
    assert_eq!(recorder.total("counted"), 10);
    assert!(recorder.refused.load(Ordering::SeqCst) >= 1, "retried");

    recorder.down.store(false, Ordering::SeqCst);
    assert!(
        recorder.reported("counted", 35).await,
        "all 35 reported after the reconnect: {}",
        recorder.total("counted")
    );
    assert!(
        crate::helpers::eventually(WAIT, || async { quota.is_connected() }).await,
        "up again"
    );
    assert_eq!(quota.reconnects(), 1);
    // Reported once: a few report intervals later, still 35.
    let messages = recorder.messages.load(Ordering::SeqCst);
    tokio::time::sleep(INTERVAL * 3).await;
    assert!(
        recorder.messages.load(Ordering::SeqCst) > messages,
        "reports go on"
    );
    assert_eq!(recorder.total("counted"), 35);
    assert_eq!(recorder.opened.load(Ordering::SeqCst), 2);
    // Past its first report (at once, when first seen), every report spans at least half an
    // interval: none is sent again in a moment with nothing counted, which the server would
    // read as no demand (as after the reconnect's first message).
    let spans = recorder.spans.lock().expect("lock")["counted"].clone();
    assert!(spans[1..].iter().all(|s| *s >= INTERVAL / 2), "{spans:?}");
}

#[tokio::test]
async fn client_quota_takes_a_server_that_never_answers_as_down() {
    // Accepts connections and never answers, not even the HTTP/2 handshake.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    let closed = Answer::Refused {
        wait: Duration::from_secs(2),
    };
    let quota = builder()
        .with_open_timeout(Duration::from_millis(200))
        .with_failure_policy(FailurePolicy::Closed {
            wait: Duration::from_secs(2),
        })
        .connect_lazy(&format!("http://{addr}"))
        .expect("address");
    let bucket = user("stalled");
    // Not known to be down yet: the unassigned answer.
    assert_eq!(quota.check(&bucket), Answer::Allowed);
    let started = Instant::now();
    assert!(
        crate::helpers::eventually(WAIT, || async { !quota.is_connected() }).await,
        "down once the stream does not open in time"
    );
    assert!(started.elapsed() >= Duration::from_millis(150));
    // Never assigned, the stream down: the failure policy.
    assert_eq!(quota.check(&bucket), closed);
    assert_eq!(quota.reconnects(), 0);
}

#[tokio::test]
async fn client_quota_reopens_a_stream_that_stops_renewing() {
    let recorder = Recorder::default();
    recorder.ttl_ms.store(300, Ordering::SeqCst);
    let addr = recorder.serve().await;
    let quota = builder()
        .connect_lazy(&format!("http://{addr}"))
        .expect("address");
    let bucket = user("muted");
    assert!(quota.check(&bucket).is_allowed());
    assert!(
        crate::helpers::eventually(WAIT, || async { quota.assignment(&bucket).is_some() }).await
    );
    // Open, reading reports, answering nothing: after a TTL of silence, reopened.
    recorder.mute.store(true, Ordering::SeqCst);
    for _ in 0..7 {
        quota.check(&bucket);
    }
    assert!(
        crate::helpers::eventually(WAIT, || async { quota.reconnects() >= 1 }).await,
        "reopened"
    );
    assert!(recorder.opened.load(Ordering::SeqCst) >= 2);
    recorder.mute.store(false, Ordering::SeqCst);
    assert!(
        crate::helpers::eventually(WAIT, || async { quota.assignment(&bucket).is_some() }).await,
        "assigned again once the server answers"
    );
    assert!(
        recorder.reported("muted", 8).await,
        "every request reported once: {}",
        recorder.total("muted")
    );
}
