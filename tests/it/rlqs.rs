//! The Rate Limit Quota Service on the wire: a tonic client of the generated service against
//! the real server. Shares are timed by the server's real clock (the stream's tick), so the
//! tests that wait for a push poll with a deadline.

use std::time::Duration;

use sluice::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use sluice::pb::rate_limit_quota_response::bucket_action::{
    BucketAction as Kind, QuotaAssignmentAction,
};
use sluice::pb::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use sluice::pb::rate_limit_strategy::{BlanketRule, Strategy};
use sluice::pb::{BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports, TokenBucket};
use tokio::sync::mpsc;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, Streaming};

use crate::helpers::envoy::{self as sim, entries, envoy_rate};
use crate::helpers::{TestServer, metric};

const POLICY: &str = "domain: edge
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 100}
    descriptors:
      - key: route
        value: search
        rate_limit: {unit: minute, requests_per_unit: 600}
  - key: banned
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: free
    rate_limit: {unlimited: true}
";

/// The RLQS gauges are the process's (one recorder for every test server): a test that reads
/// them holds this alone; every other test of this module, which opens streams, shares it.
static GAUGES: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// How long a test waits for an answer it expects.
const WAIT: Duration = Duration::from_secs(5);

async fn server(ttl_ms: u64, max_buckets: usize) -> TestServer {
    TestServer::start_with(&[("edge.yaml", POLICY)], |w| {
        w.rlqs.assignment_ttl_ms = ttl_ms;
        w.rlqs.max_buckets_per_stream = max_buckets;
    })
    .await
}

/// One simulated Envoy: its report sender and the server's answers.
struct Envoy {
    tx: mpsc::Sender<RateLimitQuotaUsageReports>,
    answers: Streaming<RateLimitQuotaResponse>,
}

fn bucket(entries: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: entries
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect(),
    }
}

/// A message reporting `requests` over one second for each bucket.
fn reports(domain: &str, buckets: &[(BucketId, u64)]) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: domain.into(),
        bucket_quota_usages: buckets
            .iter()
            .map(|(id, requests)| BucketQuotaUsage {
                bucket_id: Some(id.clone()),
                time_elapsed: Some(prost_types::Duration {
                    seconds: 1,
                    nanos: 0,
                }),
                num_requests_allowed: *requests,
                num_requests_denied: 0,
            })
            .collect(),
    }
}

/// A client of `server` on a connection of its own.
async fn client(server: &TestServer) -> Client {
    RateLimitQuotaServiceClient::connect(format!("http://{}", server.grpc))
        .await
        .expect("connect")
}

type Client = RateLimitQuotaServiceClient<tonic::transport::Channel>;

/// Opens a stream whose first message is `first`, on a connection of its own.
async fn open(server: &TestServer, first: RateLimitQuotaUsageReports) -> Result<Envoy, Status> {
    open_on(&mut client(server).await, first).await
}

/// Opens a stream whose first message is `first` on `client`'s connection.
async fn open_on(client: &mut Client, first: RateLimitQuotaUsageReports) -> Result<Envoy, Status> {
    let (tx, rx) = mpsc::channel(8);
    tx.send(first).await.expect("queued");
    let answers = client
        .stream_rate_limit_quotas(ReceiverStream::new(rx))
        .await?
        .into_inner();
    Ok(Envoy { tx, answers })
}

/// Opens a stream whose first message is `first`, expecting it to be accepted.
async fn opened(server: &TestServer, first: RateLimitQuotaUsageReports) -> Envoy {
    open(server, first).await.expect("the stream is accepted")
}

/// The status a stream whose first message is `first` is refused with.
async fn refused(server: &TestServer, first: RateLimitQuotaUsageReports) -> Status {
    match open(server, first).await {
        Ok(_) => panic!("the stream was accepted"),
        Err(status) => status,
    }
}

impl Envoy {
    async fn send(&self, message: RateLimitQuotaUsageReports) {
        self.tx.send(message).await.expect("stream open");
    }

    /// The next answer's actions, by bucket.
    async fn next(&mut self) -> Vec<(BucketId, Kind)> {
        let answer = tokio::time::timeout(WAIT, self.answers.message())
            .await
            .expect("an answer in time")
            .expect("no error")
            .expect("the stream is open");
        answer
            .bucket_action
            .into_iter()
            .map(|a| {
                (
                    a.bucket_id.expect("bucket_id"),
                    a.bucket_action.expect("action"),
                )
            })
            .collect()
    }

    /// The next answer's one assignment.
    async fn assignment(&mut self) -> QuotaAssignmentAction {
        match self.next().await.as_slice() {
            [(_, Kind::QuotaAssignmentAction(a))] => a.clone(),
            other => panic!("one assignment expected: {other:?}"),
        }
    }
}

fn strategy(a: &QuotaAssignmentAction) -> Strategy {
    a.rate_limit_strategy
        .clone()
        .and_then(|s| s.strategy)
        .expect("a strategy")
}

fn token_bucket(a: &QuotaAssignmentAction) -> TokenBucket {
    match strategy(a) {
        Strategy::TokenBucket(b) => b,
        other => panic!("a token bucket expected: {other:?}"),
    }
}

/// A token bucket's rate, per second, as Envoy reads it (the interval's whole seconds).
fn rate(b: &TokenBucket) -> f64 {
    let interval = b.fill_interval.expect("fill_interval");
    assert_eq!(interval.nanos, 0, "whole seconds: {b:?}");
    assert!(interval.seconds >= 1, "at least a second: {b:?}");
    envoy_rate(b)
}

#[tokio::test]
async fn a_stream_without_a_domain_is_invalid() {
    let _gauges = GAUGES.read().await;
    let s = server(10_000, 100).await;
    let refused = refused(&s, reports("", &[(bucket(&[("user", "a")]), 1)])).await;
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    let counted = metric(
        s.admin,
        "sluice_rlqs_refused_streams_total{reason=\"no_domain\"}",
    )
    .await;
    assert!(counted >= Some(1.0), "{counted:?}");
}

#[tokio::test]
async fn unmatched_and_unlimited_buckets_are_allow_all_and_a_ban_deny_all() {
    let _gauges = GAUGES.read().await;
    let s = server(10_000, 100).await;
    for (domain, entries, expected) in [
        ("edge", vec![("nobody", "x")], BlanketRule::AllowAll),
        ("other", vec![("user", "a")], BlanketRule::AllowAll),
        ("edge", vec![("free", "x")], BlanketRule::AllowAll),
        ("edge", vec![("banned", "x")], BlanketRule::DenyAll),
    ] {
        let mut envoy = opened(&s, reports(domain, &[(bucket(&entries), 5)])).await;
        let a = envoy.assignment().await;
        assert_eq!(
            strategy(&a),
            Strategy::BlanketRule(expected.into()),
            "{domain} {entries:?}"
        );
        assert_eq!(
            a.assignment_time_to_live,
            Some(prost_types::Duration {
                seconds: 10,
                nanos: 0
            })
        );
    }
}

#[tokio::test]
async fn one_stream_gets_the_whole_rule_and_entries_match_in_the_tree_order() {
    let _gauges = GAUGES.read().await;
    let s = server(10_000, 100).await;
    let user = entries(&[("user", "a")]);
    let mut envoy = sim::Envoy::open(s.grpc, "edge", &user).await;
    // Envoy's first report of a new bucket says time_elapsed 0: answered at once.
    let first = envoy.first_assignment(&user, WAIT).await;
    assert!(first < Duration::from_millis(100), "{first:?}");
    let b = envoy.token_bucket(&user).expect("a token bucket");
    assert_eq!(rate(&b), 100.0, "{b:?}");
    assert_eq!(b.max_tokens, 100);
    // `route` before `user` in the map; the tree names `user` first, then `route`: the rule
    // of `user` → `route=search`, 600 a minute.
    let search = entries(&[("route", "search"), ("user", "a")]);
    envoy.request(&search).await;
    let first = envoy.first_assignment(&search, WAIT).await;
    assert!(first < Duration::from_millis(100), "{first:?}");
    let b = envoy.token_bucket(&search).expect("a token bucket");
    assert!((rate(&b) - 10.0).abs() < 1e-9, "{b:?}");
    // Reports at a quarter-second interval all say 0: the stream goes on, answered.
    for _ in 0..4 {
        envoy.requests(&user, 20).await;
        envoy.report_all().await;
        envoy.receive(Duration::from_millis(250)).await;
    }
    envoy.request(&entries(&[("user", "b")])).await;
    let first = envoy
        .first_assignment(&entries(&[("user", "b")]), WAIT)
        .await;
    assert!(first < Duration::from_millis(100), "{first:?}");
    assert!(envoy.ignored.is_empty(), "{:?}", envoy.ignored);
    let reports = metric(s.admin, "sluice_rlqs_reports_total").await;
    assert!(reports >= Some(6.0), "{reports:?}");
}

/// Envoys offering `demands` requests a second for `bucket`, each reporting every `interval`
/// and enforcing what it holds, for `span`: at every step the token buckets in force, read as
/// Envoy reads them, add up to at most `rule`. The Envoys, after it.
async fn offer(
    envoys: &mut [sim::Envoy],
    bucket: &sim::Entries,
    demands: &[f64],
    rule: f64,
    interval: Duration,
    span: Duration,
) {
    drive(envoys, bucket, demands, interval, span).await;
    within_the_rule(envoys, bucket, rule);
    for envoy in envoys.iter() {
        assert!(envoy.ignored.is_empty(), "{:?}", envoy.ignored);
    }
}

/// Envoys offering `demands` requests a second for `bucket`, each reporting every `interval`
/// and enforcing what it holds, for `span`.
async fn drive(
    envoys: &mut [sim::Envoy],
    bucket: &sim::Entries,
    demands: &[f64],
    interval: Duration,
    span: Duration,
) {
    let start = tokio::time::Instant::now();
    let mut owed = vec![0.0f64; envoys.len()];
    let (mut last, mut reported) = (start, start);
    while start.elapsed() < span {
        tokio::time::sleep(Duration::from_millis(10)).await;
        let now = tokio::time::Instant::now();
        let due = now - reported >= interval;
        for (i, envoy) in envoys.iter_mut().enumerate() {
            owed[i] += demands[i] * (now - last).as_secs_f64();
            let n = owed[i].floor();
            owed[i] -= n;
            envoy.requests(bucket, n as u64).await;
            if due {
                envoy.report_all().await;
            }
        }
        if due {
            reported = now;
        }
        last = now;
        for envoy in envoys.iter_mut() {
            envoy.receive(Duration::from_millis(1)).await;
        }
    }
}

/// How late one Envoy may take a smaller token bucket sent before another's larger one: they
/// travel on different connections.
const IN_TRANSIT: Duration = Duration::from_millis(50);

/// Asserts that the token buckets `envoys` put in force for `bucket`, read as Envoy reads them,
/// never add up past `rule` (each Envoy credited with a smaller bucket up to [`IN_TRANSIT`]
/// before it arrived; a share of none is still one token per the longest interval).
fn within_the_rule(envoys: &[sim::Envoy], bucket: &sim::Entries, rule: f64) {
    let histories: Vec<Vec<(tokio::time::Instant, f64)>> = envoys
        .iter()
        .map(|e| {
            e.history
                .iter()
                .filter(|(_, b, _)| b == bucket)
                .map(|(t, _, tb)| (*t, envoy_rate(tb)))
                .collect()
        })
        .collect();
    let at = |h: &[(tokio::time::Instant, f64)], t| {
        h.iter()
            .take_while(|(when, _)| *when <= t)
            .last()
            .map_or(0.0, |(_, r)| *r)
    };
    for &(t, _) in histories.iter().flatten() {
        let held: Vec<f64> = histories
            .iter()
            .map(|h| {
                h.iter()
                    .filter(|(when, _)| *when > t && *when <= t + IN_TRANSIT)
                    .map(|(_, r)| *r)
                    .fold(at(h, t), f64::min)
            })
            .collect();
        let sum: f64 = held.iter().sum();
        assert!(
            sum <= rule * (1.0 + 1e-9) + 1e-9,
            "the token buckets in force add up to {sum}: {held:?}; {histories:?}"
        );
    }
}

#[tokio::test]
async fn two_streams_share_by_demand_and_a_closed_ones_share_goes_to_the_other() {
    let _gauges = GAUGES.read().await;
    let s = server(2_000, 100).await;
    let id = entries(&[("user", "shared")]);
    let mut envoys = vec![
        sim::Envoy::open(s.grpc, "edge", &id).await,
        sim::Envoy::open(s.grpc, "edge", &id).await,
    ];
    for envoy in &mut envoys {
        let first = envoy.first_assignment(&id, WAIT).await;
        assert!(first < Duration::from_millis(100), "{first:?}");
    }
    // Reports every 250 ms (all saying time_elapsed 0) for 3 s: both offered the rule or more
    // (300 and 100 a second), each keeps its fair part, half.
    let interval = Duration::from_millis(250);
    offer(
        &mut envoys,
        &id,
        &[300.0, 100.0],
        100.0,
        interval,
        Duration::from_secs(3),
    )
    .await;
    let (big, small) = (
        envoys[0].rate(&id).expect("big"),
        envoys[1].rate(&id).expect("small"),
    );
    eprintln!("two Envoys offered 300 and 100 a second hold {big} and {small}");
    assert!(
        big + small >= 90.0,
        "the rule is handed out: {big} + {small}"
    );
    assert!(
        big >= 49.5 && small >= 49.5,
        "a fair part each expected, got {big} and {small}"
    );
    // The big one leaves: the small one is pushed its demand's worth (the rule, capped at
    // 1.25 × 100) at its next tick.
    envoys.remove(0);
    offer(
        &mut envoys,
        &id,
        &[100.0],
        100.0,
        interval,
        Duration::from_secs(1),
    )
    .await;
    assert_eq!(envoys[0].rate(&id), Some(100.0));
}

const SEVERAL: &str = "domain: edge
descriptors:
  - key: user
    rate_limits:
      - {name: user_second, unit: second, requests_per_unit: 10}
      - {name: user_day, unit: day, requests_per_unit: 1000}
    descriptors:
      - key: route
        value: search
        cost: 2
";

/// A bucket under [10/s, 1000/day], and a cost node's under the same two limits, are never sent
/// a token bucket past either rule in rate or in burst.
#[tokio::test]
async fn a_bucket_under_several_limits_is_held_to_each_in_rate_and_in_burst() {
    let _gauges = GAUGES.read().await;
    let s = TestServer::start_with(&[("edge.yaml", SEVERAL)], |w| {
        w.rlqs.assignment_ttl_ms = 2_000;
    })
    .await;
    for (pairs, cost) in [
        (vec![("user", "a")], 1.0),
        (vec![("user", "b"), ("route", "search")], 2.0),
    ] {
        let id = entries(&pairs);
        let mut envoys = vec![
            sim::Envoy::open(s.grpc, "edge", &id).await,
            sim::Envoy::open(s.grpc, "edge", &id).await,
        ];
        for envoy in &mut envoys {
            envoy.first_assignment(&id, WAIT).await;
        }
        offer(
            &mut envoys,
            &id,
            &[50.0, 5.0],
            1_000.0 / 86_400.0 / cost,
            Duration::from_millis(250),
            Duration::from_millis(1_500),
        )
        .await;
        let sent: Vec<TokenBucket> = envoys
            .iter()
            .flat_map(|e| e.history.iter().map(|(_, _, b)| b.clone()))
            .collect();
        assert!(!sent.is_empty());
        for b in &sent {
            assert!(rate(b) <= 10.0 / cost, "{pairs:?}: {b:?}");
            assert!(f64::from(b.max_tokens) <= 10.0 / cost, "{pairs:?}: {b:?}");
        }
        let most = sent.iter().map(|b| b.max_tokens).max();
        eprintln!(
            "{pairs:?}: {} token buckets sent, the largest capacity {most:?}",
            sent.len()
        );
    }
}

#[tokio::test]
async fn a_bucket_past_the_cap_is_abandoned() {
    let _gauges = GAUGES.read().await;
    let s = server(10_000, 1).await;
    let mut envoy = opened(
        &s,
        reports(
            "edge",
            &[(bucket(&[("user", "a")]), 1), (bucket(&[("user", "b")]), 1)],
        ),
    )
    .await;
    let actions = envoy.next().await;
    let abandoned = actions
        .iter()
        .filter(|(_, k)| matches!(k, Kind::AbandonAction(_)))
        .count();
    let assigned = actions
        .iter()
        .filter(|(_, k)| matches!(k, Kind::QuotaAssignmentAction(_)))
        .count();
    assert_eq!((assigned, abandoned), (1, 1), "{actions:?}");
}

#[tokio::test]
async fn assignments_are_renewed_before_their_ttl_and_unreported_buckets_abandoned() {
    let _gauges = GAUGES.read().await;
    let s = server(1_000, 100).await;
    let id = bucket(&[("user", "renewed")]);
    let mut envoy = opened(&s, reports("edge", &[(id.clone(), 100)])).await;
    let start = tokio::time::Instant::now();
    envoy.assignment().await;
    // Not reported again: renewed at half the TTL, then abandoned once a TTL has passed.
    let renewed = envoy.assignment().await;
    let renewed_after = start.elapsed();
    assert!(renewed.assignment_time_to_live.is_some());
    assert!(
        renewed_after < Duration::from_millis(1_000),
        "renewed after {renewed_after:?}"
    );
    let abandoned = tokio::time::timeout(WAIT, async {
        loop {
            let actions = envoy.next().await;
            if actions
                .iter()
                .any(|(b, k)| *b == id && matches!(k, Kind::AbandonAction(_)))
            {
                return;
            }
        }
    })
    .await;
    assert!(abandoned.is_ok(), "abandoned within the wait");
}

#[tokio::test]
async fn a_bad_report_later_in_the_stream_ends_it_with_a_clear_status() {
    let _gauges = GAUGES.read().await;
    let s = TestServer::start_with(&[("edge.yaml", POLICY)], |w| {
        w.requests.max_request_bytes = 512;
    })
    .await;
    let id = bucket(&[("user", "a")]);
    // A negative time_elapsed: INVALID_ARGUMENT.
    let mut envoy = opened(&s, reports("edge", &[(id.clone(), 1)])).await;
    envoy.assignment().await;
    let mut negative = reports("", &[(id.clone(), 1)]);
    for usage in &mut negative.bucket_quota_usages {
        usage.time_elapsed = Some(prost_types::Duration {
            seconds: -1,
            nanos: 0,
        });
    }
    envoy.send(negative).await;
    let status = ended(&mut envoy).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    // A message over requests.max_request_bytes: RESOURCE_EXHAUSTED.
    let mut envoy = opened(&s, reports("edge", &[(id.clone(), 1)])).await;
    envoy.assignment().await;
    let many: Vec<(BucketId, u64)> = (0..40)
        .map(|i| (bucket(&[("user", &format!("user-{i}"))]), 1))
        .collect();
    envoy.send(reports("", &many)).await;
    let status = ended(&mut envoy).await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    // Counts near u64::MAX saturate: the stream goes on.
    let mut envoy = opened(&s, reports("edge", &[(id.clone(), 1)])).await;
    envoy.assignment().await;
    let mut huge = reports("", &[(bucket(&[("user", "b")]), u64::MAX)]);
    for usage in &mut huge.bucket_quota_usages {
        usage.num_requests_denied = u64::MAX;
    }
    envoy.send(huge).await;
    let b = token_bucket(&envoy.assignment().await);
    assert_eq!(rate(&b), 100.0, "{b:?}");
}

/// The status a stream ends with, skipping answers before it.
async fn ended(envoy: &mut Envoy) -> Status {
    tokio::time::timeout(WAIT, async {
        loop {
            match envoy.answers.message().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream ended with OK"),
                Err(status) => return status,
            }
        }
    })
    .await
    .expect("the stream ends in time")
}

#[tokio::test]
async fn a_reload_that_changes_the_rule_is_pushed_with_no_report() {
    let _gauges = GAUGES.read().await;
    // The default TTL: the streams' tick is 1 s, so what pushes within 1 s is the reload itself.
    let s = server(10_000, 100).await;
    let id = bucket(&[("user", "reloaded")]);
    let mut envoy = opened(&s, reports("edge", &[(id.clone(), 500)])).await;
    assert_eq!(rate(&token_bucket(&envoy.assignment().await)), 100.0);
    // Twice: the stream waits for the next reload once it has taken one.
    for per_unit in [50, 25] {
        let changed = POLICY.replace(
            "requests_per_unit: 100}",
            &format!("requests_per_unit: {per_unit}}}"),
        );
        let (tmp, file) = (
            s.dir.path().join("edge.tmp"),
            s.dir.path().join("edge.yaml"),
        );
        std::fs::write(&tmp, changed).expect("write");
        let start = tokio::time::Instant::now();
        std::fs::rename(&tmp, &file).expect("rename");
        let pushed = tokio::time::timeout(WAIT, async {
            loop {
                if let [(_, Kind::QuotaAssignmentAction(a))] = envoy.next().await.as_slice()
                    && rate(&token_bucket(a)) == f64::from(per_unit)
                {
                    return start.elapsed();
                }
            }
        })
        .await
        .expect("the changed rule pushed within the wait");
        assert!(
            pushed < Duration::from_secs(1),
            "{per_unit}/s pushed {pushed:?} after the file changed"
        );
    }
}

#[tokio::test]
async fn a_stream_open_at_shutdown_ends_unavailable() {
    let _gauges = GAUGES.read().await;
    let mut s = server(10_000, 100).await;
    let id = bucket(&[("user", "stopped")]);
    let mut envoy = opened(&s, reports("edge", &[(id, 100)])).await;
    envoy.assignment().await;
    // The stream waits for its next report, a second away, when the server is told to stop.
    let start = tokio::time::Instant::now();
    s.begin_stop();
    let status = ended(&mut envoy).await;
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("shutting down"), "{status:?}");
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "ended {:?} after the stop",
        start.elapsed()
    );
}

#[tokio::test]
async fn a_disabled_service_is_unimplemented() {
    let _gauges = GAUGES.read().await;
    let s = TestServer::start_with(&[("edge.yaml", POLICY)], |w| w.rlqs.enabled = false).await;
    let refused = refused(&s, reports("edge", &[(bucket(&[("user", "a")]), 1)])).await;
    assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    let unknown = s
        .health()
        .await
        .check(tonic_health::pb::HealthCheckRequest {
            service: "envoy.service.rate_limit_quota.v3.RateLimitQuotaService".into(),
        })
        .await
        .expect_err("no health for a service not served");
    assert_eq!(unknown.code(), Code::NotFound, "{unknown:?}");
}

#[tokio::test]
async fn health_answers_for_the_quota_service() {
    let _gauges = GAUGES.read().await;
    let s = server(10_000, 100).await;
    let serving = crate::helpers::eventually(WAIT, || async {
        s.health()
            .await
            .check(tonic_health::pb::HealthCheckRequest {
                service: "envoy.service.rate_limit_quota.v3.RateLimitQuotaService".into(),
            })
            .await
            .is_ok_and(|r| r.into_inner().status == 1)
    })
    .await;
    assert!(serving, "SERVING under the quota service's name");
}

/// The latest token bucket rate `envoy` was assigned within `span`, reporting `requests` a second
/// for `id` every 100 ms meanwhile.
async fn rate_after(envoy: &mut Envoy, id: &BucketId, requests: u64, span: Duration) -> f64 {
    let mut last = None;
    let end = tokio::time::Instant::now() + span;
    while tokio::time::Instant::now() < end {
        envoy.send(reports("", &[(id.clone(), requests)])).await;
        let until = tokio::time::Instant::now() + Duration::from_millis(100);
        while let Ok(answer) = tokio::time::timeout_at(until, envoy.answers.message()).await {
            let answer = answer.expect("no error").expect("the stream is open");
            for action in answer.bucket_action {
                if let Some(Kind::QuotaAssignmentAction(a)) = action.bucket_action {
                    last = Some(rate(&token_bucket(&a)));
                }
            }
        }
    }
    last.expect("an assignment")
}

#[tokio::test]
async fn two_nodes_on_one_redis_hand_out_one_rule() {
    if crate::helpers::redis_missing("two_nodes_on_one_redis_hand_out_one_rule") {
        return;
    }
    let _gauges = GAUGES.read().await;
    let redis = crate::helpers::redis::RedisProcess::start();
    let node = || {
        let url = redis.url();
        TestServer::start_with(&[("edge.yaml", POLICY)], move |w| {
            w.backend = sluice::settings::BackendKind::Redis;
            w.redis.url = url;
            w.rlqs.assignment_ttl_ms = 2_000;
        })
    };
    let (one, two) = (node().await, node().await);
    let started = std::time::Instant::now();
    let id = bucket(&[("user", "fleet")]);
    let mut big = opened(&one, reports("edge", &[(id.clone(), 300)])).await;
    let first = rate(&token_bucket(&big.assignment().await));
    assert!(first <= 100.0, "{first}");
    let mut small = opened(&two, reports("edge", &[(id.clone(), 100)])).await;
    // A node new to the rule asks Redis for its part before the first assignment: out of what
    // the first node leaves, so the two never add up past the rule.
    let first_small = rate(&token_bucket(&small.assignment().await));
    assert!(
        first + first_small <= 100.0 * 1.05,
        "the first assignments add up past the rule: {first} + {first_small}"
    );
    // Each node renews its part every 500 ms (a quarter of the TTL); two renewals each settle it.
    let span = Duration::from_millis(2_500);
    let (big_rate, small_rate) = tokio::join!(
        rate_after(&mut big, &id, 300, span),
        rate_after(&mut small, &id, 100, span)
    );
    assert!(
        big_rate + small_rate <= 100.0 * 1.05,
        "the nodes' assignments add up past the rule: {big_rate} + {small_rate}"
    );
    assert!(
        big_rate + small_rate >= 90.0,
        "the rule is handed out: {big_rate} + {small_rate}"
    );
    // Each node's streams ask for the rule or more (300 and 100 a second): a node's claim
    // counts for at most the rule, so the nodes split it evenly.
    assert!(
        (big_rate / small_rate - 1.0).abs() < 0.2,
        "an even split expected, got {big_rate} : {small_rate}"
    );
    // A node whose streams all leave gives its part up at once: the other node's stream is
    // pushed the whole rule.
    drop(small);
    let grown = rate_after(&mut big, &id, 300, Duration::from_secs(2)).await;
    assert!(grown >= 95.0, "{grown}");
    // The price is fixed: one call for the rule's first bucket, then one per tick (500 ms),
    // however many reports (ten a second here) the stream sends.
    let elapsed = started.elapsed().as_secs_f64();
    let trips = metric(
        one.admin,
        "sluice_redis_round_trips_by_purpose_total{purpose=\"quota\"}",
    )
    .await
    .expect("quota round trips counted");
    let most = 1.0 + (elapsed / 0.5).ceil() + 1.0;
    eprintln!(
        "two nodes: first {first} + {first_small}, settled {big_rate} + {small_rate}, then \
         {grown}; {trips} quota round trips in {elapsed:.1} s"
    );
    assert!(
        trips >= 2.0 && trips <= most,
        "{trips} quota round trips in {elapsed:.1} s; at most {most} expected"
    );
}

/// A TCP proxy to a local port that can be cut: every connection through it closed, and new
/// ones refused. Cuts one node off from a Redis the others still reach.
struct Proxy {
    port: u16,
    accept: tokio::task::JoinHandle<()>,
    links: Links,
}

/// The proxy's open connections, each one task.
type Links = std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>;

impl Proxy {
    async fn start(to: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let links: Links = std::sync::Arc::default();
        let held = std::sync::Arc::clone(&links);
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let link = tokio::spawn(async move {
                    if let Ok(mut outbound) =
                        tokio::net::TcpStream::connect(("127.0.0.1", to)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                held.lock().expect("links").push(link);
            }
        });
        Self {
            port,
            accept,
            links,
        }
    }

    fn cut(&self) {
        self.accept.abort();
        for link in self.links.lock().expect("links").drain(..) {
            link.abort();
        }
    }
}

/// Two nodes on one Redis, `on_backend_error: error`, TTL 8 s; one node is cut off from Redis.
/// It sends its Envoys nothing more of the rule, so their assignments lapse with its part's entry
/// in Redis (no later than a tick, 1 s, after it), not a TTL after a renewal sent meanwhile; the
/// other node then takes the whole rule; and the token buckets in force over both nodes pass
/// the rule for no more than that tick.
#[tokio::test]
async fn a_node_cut_from_redis_lets_its_envoys_assignments_lapse_with_its_part() {
    if crate::helpers::redis_missing(
        "a_node_cut_from_redis_lets_its_envoys_assignments_lapse_with_its_part",
    ) {
        return;
    }
    let _gauges = GAUGES.read().await;
    let redis = crate::helpers::redis::RedisProcess::start();
    let proxy = Proxy::start(redis.port).await;
    let ttl = Duration::from_secs(8);
    let tick = Duration::from_secs(1);
    let node = |port: u16| {
        TestServer::start_with(&[("edge.yaml", POLICY)], move |w| {
            w.backend = sluice::settings::BackendKind::Redis;
            w.redis.url = format!("redis://127.0.0.1:{port}");
            w.redis.timeout_ms = 100;
            w.redis.connect_timeout_ms = 100;
            w.on_backend_error = sluice::decision::OnBackendError::Error;
            w.rlqs.assignment_ttl_ms = 8_000;
        })
    };
    let (cut, whole) = (node(proxy.port).await, node(redis.port).await);
    let id = entries(&[("user", "partition")]);
    let mut envoys = vec![
        sim::Envoy::open(cut.grpc, "edge", &id).await,
        sim::Envoy::open(whole.grpc, "edge", &id).await,
    ];
    for envoy in &mut envoys {
        envoy.first_assignment(&id, WAIT).await;
    }
    let (demands, interval) = ([300.0, 300.0], Duration::from_millis(250));
    drive(&mut envoys, &id, &demands, interval, Duration::from_secs(3)).await;
    // Cut right after the node's Envoy is sent an assignment: its next renewal would be due
    // half a TTL later, while the part it holds is still kept.
    let seen = envoys[0].received.len();
    let until = tokio::time::Instant::now() + ttl;
    while envoys[0].received.len() == seen && tokio::time::Instant::now() < until {
        drive(
            &mut envoys,
            &id,
            &demands,
            interval,
            Duration::from_millis(20),
        )
        .await;
    }
    assert!(
        envoys[0].received.len() > seen,
        "an assignment renewed before the cut"
    );
    proxy.cut();
    let at = tokio::time::Instant::now();
    drive(&mut envoys, &id, &demands, interval, ttl + 3 * tick).await;
    let slack = Duration::from_millis(500);
    for (t, _, life) in &envoys[0].received {
        assert!(
            *t + *life <= at + ttl + tick + slack,
            "an assignment received {:?} after the cut holds {life:?} more, past the part's \
             life (at most {ttl:?} after the cut, and a tick)",
            t.saturating_duration_since(at)
        );
    }
    let step = Duration::from_millis(10);
    let (mut t, mut over) = (at, Duration::ZERO);
    let end = tokio::time::Instant::now();
    while t < end {
        let sum: f64 = envoys.iter().map(|e| e.rate_at(&id, t)).sum();
        if sum > 100.0 * (1.0 + 1e-9) {
            over += step;
        }
        t += step;
    }
    let whole_rate = envoys[1].rate(&id).expect("a token bucket");
    eprintln!(
        "a node cut from Redis: its Envoy's last assignment {:?} after the cut; the buckets in \
         force past the rule for {over:?}; the other node's Envoy holds {whole_rate}",
        envoys[0]
            .received
            .last()
            .map(|(t, _, _)| t.saturating_duration_since(at))
    );
    assert!(
        over <= tick + slack,
        "the buckets in force passed the rule for {over:?}"
    );
    assert!(
        whole_rate >= 95.0,
        "the other node takes the rule: {whole_rate}"
    );
    assert!(
        envoys[0].rate_at(&id, end) == 0.0,
        "no assignment in force on the cut node's Envoy"
    );
}

// Hostile input: each case ends or refuses only the stream that misbehaves, bounds what it
// costs, and leaves a well-behaved stream served.

/// Asserts that `envoy` is still served: a report of a bucket it has not reported before is
/// answered with that bucket's token bucket.
async fn still_served(envoy: &mut Envoy, user: &str) {
    let id = bucket(&[("user", user)]);
    envoy.send(reports("", &[(id.clone(), 10)])).await;
    let assigned = tokio::time::timeout(WAIT, async {
        loop {
            let actions = envoy.next().await;
            if let Some((_, Kind::QuotaAssignmentAction(a))) =
                actions.iter().find(|(b, _)| *b == id)
            {
                return token_bucket(a);
            }
        }
    })
    .await
    .expect("the well-behaved stream is answered");
    assert!(rate(&assigned) > 0.0, "{assigned:?}");
}

/// A message over `requests.max_request_bytes`, first or later in a stream, ends that stream
/// with `RESOURCE_EXHAUSTED`; a stream on the same connection goes on.
#[tokio::test]
async fn an_oversized_report_ends_its_stream_and_no_other() {
    let _gauges = GAUGES.write().await;
    let s = TestServer::start_with(&[("edge.yaml", POLICY)], |w| {
        w.requests.max_request_bytes = 1024;
    })
    .await;
    let mut shared = client(&s).await;
    let mut good = open_on(
        &mut shared,
        reports("edge", &[(bucket(&[("user", "good")]), 5)]),
    )
    .await
    .expect("accepted");
    good.assignment().await;
    let many: Vec<(BucketId, u64)> = (0..100)
        .map(|i| (bucket(&[("user", &format!("user-{i}"))]), 1))
        .collect();
    let oversized = reports("edge", &many);
    assert!(prost::Message::encoded_len(&oversized) > 1024);
    // As the first message: refused.
    let status = match open_on(&mut shared, oversized.clone()).await {
        Ok(mut envoy) => ended(&mut envoy).await,
        Err(status) => status,
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    still_served(&mut good, "good-1").await;
    // Later in a stream: that stream ends.
    let mut bad = open_on(
        &mut shared,
        reports("edge", &[(bucket(&[("user", "b")]), 1)]),
    )
    .await
    .expect("accepted");
    bad.assignment().await;
    bad.send(oversized).await;
    let status = ended(&mut bad).await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    still_served(&mut good, "good-2").await;
    let streams = metric(s.admin, "sluice_rlqs_streams").await;
    assert_eq!(streams, Some(1.0), "only the good stream is open");
}

/// A bucket id past the request caps (a 1 MB value, a 500 KB key, 20,000 entries), or a 900 KB
/// domain, is refused `INVALID_ARGUMENT` naming the cap, as the first message or later in a
/// stream, and nothing of it is kept: streams of 1 MB buckets leave the table holding the
/// well-behaved stream's bucket alone.
#[tokio::test]
async fn bucket_ids_past_the_request_caps_are_refused_and_nothing_is_kept() {
    let _gauges = GAUGES.write().await;
    let s = server(10_000, 100).await;
    let mut good = opened(&s, reports("edge", &[(bucket(&[("user", "good")]), 5)])).await;
    good.assignment().await;
    let big = |i: usize| bucket(&[("user", &format!("{i}{}", "v".repeat(1_000_000)))]);
    for i in 0..20 {
        let status = refused(&s, reports("edge", &[(big(i), 1)])).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains("requests.max_value_bytes"),
            "{status:?}"
        );
    }
    let many: Vec<(String, String)> = (0..20_000).map(|i| (format!("k{i}"), "v".into())).collect();
    let many = BucketId {
        bucket: many.into_iter().collect(),
    };
    let long_key = bucket(&[(&"k".repeat(500_000), "v")]);
    for (first, cap) in [
        (reports("edge", &[(many, 1)]), "requests.max_entries"),
        (reports("edge", &[(long_key, 1)]), "requests.max_key_bytes"),
        (
            reports(&"d".repeat(900_000), &[(bucket(&[("user", "a")]), 1)]),
            "requests.max_domain_bytes",
        ),
    ] {
        let status = refused(&s, first).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(cap), "{cap}: {status:?}");
    }
    // Later in a stream: the whole message is refused and the stream ends, its buckets freed.
    let mut envoy = opened(&s, reports("edge", &[(bucket(&[("user", "b")]), 1)])).await;
    envoy.assignment().await;
    envoy
        .send(reports("", &[(bucket(&[("user", "c")]), 1), (big(99), 1)]))
        .await;
    let status = ended(&mut envoy).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("bucket_quota_usages[1]"),
        "{status:?}"
    );
    still_served(&mut good, "good-1").await;
    let held = crate::helpers::eventually(WAIT, || async {
        metric(s.admin, "sluice_rlqs_streams").await == Some(1.0)
            && metric(s.admin, "sluice_rlqs_buckets").await == Some(2.0)
    })
    .await;
    assert!(held, "the good stream and its two buckets alone are held");
}

/// `time_elapsed` below zero, however far, is `INVALID_ARGUMENT`; one of hundreds of billions of
/// years is accepted, and read as next to no demand.
#[tokio::test]
async fn a_negative_time_elapsed_is_invalid_and_a_huge_one_is_no_demand() {
    let _gauges = GAUGES.read().await;
    let s = server(10_000, 100).await;
    let mut good = opened(&s, reports("edge", &[(bucket(&[("user", "good")]), 5)])).await;
    good.assignment().await;
    let with_elapsed = |seconds: i64, nanos: i32| {
        let mut m = reports("edge", &[(bucket(&[("user", "t")]), 1_000)]);
        m.bucket_quota_usages[0].time_elapsed = Some(prost_types::Duration { seconds, nanos });
        m
    };
    for (seconds, nanos) in [(-1, 0), (0, -1), (i64::MIN, 0), (i64::MIN, -999_999_999)] {
        // As the first message, and later in a stream.
        let status = refused(&s, with_elapsed(seconds, nanos)).await;
        assert_eq!(
            status.code(),
            Code::InvalidArgument,
            "{seconds} {nanos}: {status:?}"
        );
        let mut envoy = opened(&s, reports("edge", &[(bucket(&[("user", "t")]), 1)])).await;
        envoy.assignment().await;
        envoy.send(with_elapsed(seconds, nanos)).await;
        let status = ended(&mut envoy).await;
        assert_eq!(
            status.code(),
            Code::InvalidArgument,
            "{seconds} {nanos}: {status:?}"
        );
    }
    still_served(&mut good, "good-1").await;
    // 1,000 requests over i64::MAX seconds: no demand to speak of, so the idle floor's share
    // (at most 1.25 % of 100/s), still a valid token bucket.
    for (seconds, nanos) in [(i64::MAX, 999_999_999), (i64::MAX, i32::MAX), (1 << 40, 0)] {
        let mut envoy = opened(&s, with_elapsed(seconds, nanos)).await;
        let b = token_bucket(&envoy.assignment().await);
        assert!(
            rate(&b) > 0.0 && rate(&b) <= 1.25 + 1e-9,
            "{seconds}: {b:?}"
        );
        assert!(b.max_tokens >= 1 && b.tokens_per_fill >= Some(1), "{b:?}");
    }
    still_served(&mut good, "good-2").await;
}

/// Counts near `u64::MAX` over the shortest `time_elapsed` do not overflow: the reporter's share
/// of a shared bucket stays within the rule and the other reporter keeps a share.
#[tokio::test]
async fn counts_near_u64_max_get_a_sane_share() {
    let _gauges = GAUGES.read().await;
    let s = server(2_000, 100).await;
    let id = bucket(&[("user", "shared")]);
    let mut good = opened(&s, reports("edge", &[(id.clone(), 50)])).await;
    good.assignment().await;
    let mut huge = reports("edge", &[(id.clone(), u64::MAX)]);
    huge.bucket_quota_usages[0].num_requests_denied = u64::MAX;
    huge.bucket_quota_usages[0].time_elapsed = Some(prost_types::Duration {
        seconds: 0,
        nanos: 1,
    });
    let mut greedy = opened(&s, huge.clone()).await;
    let b = token_bucket(&greedy.assignment().await);
    assert!(rate(&b) > 0.0 && rate(&b) <= 100.0, "{b:?}");
    assert!(b.max_tokens >= 1 && b.max_tokens <= 100, "{b:?}");
    greedy
        .send(RateLimitQuotaUsageReports {
            domain: String::new(),
            ..huge
        })
        .await;
    // The good stream, alone, held 1.25 times its demand (62.5/s); it is pushed the smaller
    // share at its next tick, and keeps its demand: water-filled, the greedy one has the rest.
    let good_rate = tokio::time::timeout(WAIT, async {
        loop {
            if let [(_, Kind::QuotaAssignmentAction(a))] = good.next().await.as_slice() {
                let r = rate(&token_bucket(a));
                if r < 60.0 {
                    return r;
                }
            }
        }
    })
    .await
    .expect("the good stream's smaller share is pushed");
    assert!(good_rate >= 45.0, "its demand of 50/s is met: {good_rate}");
    still_served(&mut good, "good-1").await;
}

/// Two streams claiming `u64::MAX` requests over a nanosecond, report after report, leave three
/// honest Envoys each at least its fair part: a fifth of the rule, less than the 30 a second
/// each is offered.
#[tokio::test]
async fn honest_envoys_keep_their_fair_part_while_a_peer_claims_u64_max() {
    let _gauges = GAUGES.read().await;
    let s = server(2_000, 100).await;
    let id = entries(&[("user", "claimed")]);
    let mut huge = reports("edge", &[(bucket(&[("user", "claimed")]), u64::MAX)]);
    huge.bucket_quota_usages[0].num_requests_denied = u64::MAX;
    huge.bucket_quota_usages[0].time_elapsed = Some(prost_types::Duration {
        seconds: 0,
        nanos: 1,
    });
    let mut greedy = Vec::new();
    for _ in 0..2 {
        let mut g = opened(&s, huge.clone()).await;
        g.assignment().await;
        let again = RateLimitQuotaUsageReports {
            domain: String::new(),
            ..huge.clone()
        };
        greedy.push(tokio::spawn(async move {
            loop {
                g.send(again.clone()).await;
                let until = tokio::time::Instant::now() + Duration::from_millis(250);
                while let Ok(answer) = tokio::time::timeout_at(until, g.answers.message()).await {
                    if !matches!(answer, Ok(Some(_))) {
                        return;
                    }
                }
            }
        }));
    }
    let mut honest = Vec::new();
    for _ in 0..3 {
        let mut envoy = sim::Envoy::open(s.grpc, "edge", &id).await;
        envoy.first_assignment(&id, WAIT).await;
        honest.push(envoy);
    }
    offer(
        &mut honest,
        &id,
        &[30.0, 30.0, 30.0],
        100.0,
        Duration::from_millis(250),
        Duration::from_secs(3),
    )
    .await;
    let rates: Vec<f64> = honest
        .iter()
        .map(|e| e.rate(&id).expect("a token bucket"))
        .collect();
    eprintln!("three honest Envoys beside two claims of u64::MAX hold {rates:?}");
    for g in &greedy {
        assert!(!g.is_finished(), "the greedy streams kept claiming");
    }
    for r in &rates {
        assert!(*r >= 20.0 * 0.99, "a fair part each (20/s): {rates:?}");
    }
    for g in greedy {
        g.abort();
    }
}

/// Ten thousand distinct buckets on one stream: the first `rlqs.max_buckets_per_stream` are
/// assigned, the rest abandoned, and the table holds no more than the cap, report after report.
#[tokio::test]
async fn ten_thousand_buckets_on_one_stream_stop_at_the_cap() {
    let _gauges = GAUGES.write().await;
    let cap = 1_000;
    let s = server(10_000, cap).await;
    let mut good = opened(&s, reports("edge", &[(bucket(&[("user", "good")]), 5)])).await;
    good.assignment().await;
    let many: Vec<(BucketId, u64)> = (0..10_000)
        .map(|i| (bucket(&[("user", &format!("u-{i}"))]), 1))
        .collect();
    let mut flood = opened(&s, reports("edge", &many)).await;
    for round in 0..2 {
        if round > 0 {
            flood.send(reports("", &many)).await;
        }
        let actions = flood.next().await;
        let assigned: Vec<&BucketId> = actions
            .iter()
            .filter(|(_, k)| matches!(k, Kind::QuotaAssignmentAction(_)))
            .map(|(b, _)| b)
            .collect();
        let abandoned = actions
            .iter()
            .filter(|(_, k)| matches!(k, Kind::AbandonAction(_)))
            .count();
        // The first round assigns every watched bucket; the second, none has moved.
        let expected = if round == 0 { cap } else { 0 };
        assert_eq!(
            (assigned.len(), abandoned),
            (expected, 10_000 - cap),
            "round {round}"
        );
        if round == 0 {
            assert!(
                assigned
                    .iter()
                    .all(|b| many[..cap].iter().any(|(m, _)| m == *b))
            );
        }
        let buckets = metric(s.admin, "sluice_rlqs_buckets").await;
        assert_eq!(
            buckets,
            Some((cap + 1) as f64),
            "round {round}: the cap and the good one"
        );
    }
    still_served(&mut good, "good-1").await;
    drop(flood);
    let freed = crate::helpers::eventually(WAIT, || async {
        metric(s.admin, "sluice_rlqs_buckets").await == Some(2.0)
    })
    .await;
    assert!(freed, "the flood's buckets are freed when it closes");
}

/// Two thousand streams opened and dropped, some before their first answer: afterwards no
/// stream is left open, the well-behaved one was served throughout, and a new one is served.
#[tokio::test]
async fn streams_opened_and_dropped_in_a_loop_leave_nothing_behind() {
    let _gauges = GAUGES.write().await;
    let s = server(10_000, 100).await;
    let mut good = opened(&s, reports("edge", &[(bucket(&[("user", "good")]), 5)])).await;
    good.assignment().await;
    let mut shared = client(&s).await;
    for i in 0..2_000 {
        let first = reports(
            "edge",
            &[(bucket(&[("user", &format!("churn-{}", i % 7))]), 3)],
        );
        let mut envoy = open_on(&mut shared, first).await.expect("accepted");
        if i % 2 == 0 {
            envoy.assignment().await;
        }
        drop(envoy);
        if i % 500 == 499 {
            still_served(&mut good, &format!("good-{i}")).await;
        }
    }
    let settled = crate::helpers::eventually(WAIT, || async {
        metric(s.admin, "sluice_rlqs_streams").await == Some(1.0)
            && metric(s.admin, "sluice_rlqs_buckets").await == Some(5.0)
    })
    .await;
    assert!(settled, "only the good stream and its 5 buckets are left");
    drop(good);
    let none = crate::helpers::eventually(WAIT, || async {
        metric(s.admin, "sluice_rlqs_streams").await == Some(0.0)
            && metric(s.admin, "sluice_rlqs_buckets").await == Some(0.0)
    })
    .await;
    assert!(none, "no stream left open");
    let mut fresh = opened(&s, reports("edge", &[(bucket(&[("user", "fresh")]), 5)])).await;
    assert!(rate(&token_bucket(&fresh.assignment().await)) > 0.0);
}

/// Past `rlqs.max_streams` a stream is refused `RESOURCE_EXHAUSTED` and counted; the open ones
/// are served, and a closed one's place can be taken.
#[tokio::test]
async fn streams_past_the_cap_are_refused_and_counted() {
    let _gauges = GAUGES.read().await;
    let s = TestServer::start_with(&[("edge.yaml", POLICY)], |w| w.rlqs.max_streams = 3).await;
    let mut good = opened(&s, reports("edge", &[(bucket(&[("user", "good")]), 5)])).await;
    good.assignment().await;
    let mut others = Vec::new();
    for i in 0..2 {
        let mut envoy = opened(
            &s,
            reports("edge", &[(bucket(&[("user", &format!("o-{i}"))]), 1)]),
        )
        .await;
        envoy.assignment().await;
        others.push(envoy);
    }
    let first = || reports("edge", &[(bucket(&[("user", "late")]), 1)]);
    let series = "sluice_rlqs_refused_streams_total{reason=\"too_many_streams\"}";
    let before = metric(s.admin, series).await.unwrap_or(0.0);
    for _ in 0..3 {
        let status = refused(&s, first()).await;
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    }
    let counted = metric(s.admin, series).await;
    assert_eq!(counted, Some(before + 3.0));
    still_served(&mut good, "good-1").await;
    others.pop();
    let admitted = crate::helpers::eventually(WAIT, || async {
        match open(&s, first()).await {
            Ok(mut envoy) => {
                envoy.assignment().await;
                true
            }
            Err(_) => false,
        }
    })
    .await;
    assert!(admitted, "a closed stream's place is taken");
    still_served(&mut good, "good-2").await;
}

/// The path of `StreamRateLimitQuotas`.
const QUOTA_PATH: &str =
    "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";

/// Past `rlqs.max_streams_per_connection` on one connection a stream is refused
/// `RESOURCE_EXHAUSTED` and counted, streams that sent their headers alone counting too; one
/// connection cannot take every place of `rlqs.max_streams`, and another connection still gets a
/// stream.
#[tokio::test]
async fn one_connection_cannot_take_every_stream() {
    let _gauges = GAUGES.read().await;
    let s = TestServer::start_with(&[("edge.yaml", POLICY)], |w| {
        w.rlqs.max_streams = 5;
        w.rlqs.max_streams_per_connection = 3;
    })
    .await;
    let series = "sluice_rlqs_refused_streams_total{reason=\"too_many_streams_on_connection\"}";
    let before = metric(s.admin, series).await.unwrap_or(0.0);
    let first = |user: &str| reports("edge", &[(bucket(&[("user", user)]), 1)]);
    // A peer on a raw connection: three streams of headers alone, then one with a report.
    let tcp = tokio::net::TcpStream::connect(s.grpc)
        .await
        .expect("connect");
    let (h2, conn) = h2::client::handshake(tcp).await.expect("handshake");
    tokio::spawn(conn);
    let mut h2 = h2.ready().await.expect("ready");
    let call = || {
        http::Request::post(format!("http://{}{QUOTA_PATH}", s.grpc))
            .header("te", "trailers")
            .header("content-type", "application/grpc")
            .body(())
            .expect("request")
    };
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(h2.send_request(call(), false).expect("headers"));
        h2 = h2.ready().await.expect("ready");
    }
    let (response, mut body) = h2.send_request(call(), false).expect("headers");
    let report = crate::helpers::grpc_framed(&prost::Message::encode_to_vec(&first("raw")));
    body.send_data(report.into(), false).expect("data");
    let response = tokio::time::timeout(WAIT, response)
        .await
        .expect("answered in time")
        .expect("response");
    let field = |name| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap_or_default().to_string())
    };
    assert_eq!(field("grpc-status").as_deref(), Some("8"), "{response:?}");
    assert!(
        field("grpc-message").is_some_and(|m| m.contains("rlqs.max_streams_per_connection")),
        "{response:?}"
    );
    // A client over one connection: three streams, the fourth refused.
    let mut shared = client(&s).await;
    let mut held = Vec::new();
    for i in 0..3 {
        let mut envoy = open_on(&mut shared, first(&format!("s-{i}")))
            .await
            .expect("accepted");
        envoy.assignment().await;
        held.push(envoy);
    }
    let status = match open_on(&mut shared, first("s-3")).await {
        Ok(_) => panic!("a fourth stream on one connection was accepted"),
        Err(status) => status,
    };
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(metric(s.admin, series).await, Some(before + 2.0));
    // Another connection still gets a stream.
    let mut other = opened(&s, first("other")).await;
    assert!(rate(&token_bucket(&other.assignment().await)) > 0.0);
    // The silent streams' places come back when they go.
    drop(silent);
    drop(body);
    let again = crate::helpers::eventually(WAIT, || async {
        let Ok(mut h2) = h2.clone().ready().await else {
            return false;
        };
        let Ok((response, mut body)) = h2.send_request(call(), false) else {
            return false;
        };
        let report = crate::helpers::grpc_framed(&prost::Message::encode_to_vec(&first("again")));
        if body.send_data(report.into(), false).is_err() {
            return false;
        }
        matches!(response.await, Ok(r) if !r.headers().contains_key("grpc-status"))
    })
    .await;
    assert!(again, "a place freed on the raw connection is taken again");
}

/// A client whose connections come from `source` (any address of 127/8 reaches the server).
async fn client_from(server: &TestServer, source: std::net::IpAddr) -> Client {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
        .expect("endpoint")
        .connect_with_connector(FromSource(source))
        .await
        .expect("connect");
    RateLimitQuotaServiceClient::new(channel)
}

/// Connects from one source address.
#[derive(Clone)]
struct FromSource(std::net::IpAddr);

impl tonic::codegen::Service<http::Uri> for FromSource {
    type Response = hyper_util::rt::TokioIo<tokio::net::TcpStream>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let source = self.0;
        Box::pin(async move {
            let to: std::net::SocketAddr = uri
                .authority()
                .map(|a| a.as_str())
                .unwrap_or_default()
                .parse()
                .map_err(std::io::Error::other)?;
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(std::net::SocketAddr::new(source, 0))?;
            Ok(hyper_util::rt::TokioIo::new(socket.connect(to).await?))
        })
    }
}

/// Past `rlqs.max_streams_per_peer` from one address, over any number of connections, a stream
/// is refused `RESOURCE_EXHAUSTED` naming the setting, and counted; a client from another
/// address is still served, and a place given back is taken again.
#[tokio::test]
async fn one_peer_cannot_take_every_stream_over_many_connections() {
    let _gauges = GAUGES.read().await;
    let s = TestServer::start_with(&[("edge.yaml", POLICY)], |w| {
        w.rlqs.max_streams = 10;
        w.rlqs.max_streams_per_connection = 2;
        w.rlqs.max_streams_per_peer = 4;
    })
    .await;
    let series = "sluice_rlqs_refused_streams_total{reason=\"too_many_streams_from_peer\"}";
    let before = metric(s.admin, series).await.unwrap_or(0.0);
    let first = |user: &str| reports("edge", &[(bucket(&[("user", user)]), 1)]);
    // One client from 127.0.0.1: two streams on each of two connections, its four places.
    let mut held = Vec::new();
    for c in 0..2 {
        let mut connection = client(&s).await;
        for i in 0..2 {
            let mut envoy = open_on(&mut connection, first(&format!("c{c}-{i}")))
                .await
                .expect("accepted");
            envoy.assignment().await;
            held.push(envoy);
        }
    }
    // A third connection of its own has room, the address has none.
    let third = client(&s).await;
    for _ in 0..2 {
        let status = match open_on(&mut third.clone(), first("c2")).await {
            Ok(_) => panic!("a fifth stream from one address was accepted"),
            Err(status) => status,
        };
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
        assert!(
            status.message().contains("rlqs.max_streams_per_peer"),
            "{status:?}"
        );
    }
    assert_eq!(metric(s.admin, series).await, Some(before + 2.0));
    // Another address is served.
    let mut other = client_from(&s, [127, 0, 0, 2].into()).await;
    let mut envoy = open_on(&mut other, first("other"))
        .await
        .expect("another address is served");
    assert!(rate(&token_bucket(&envoy.assignment().await)) > 0.0);
    still_served(&mut held[0], "c0-0").await;
    // A place given back is taken again, on the third connection.
    held.pop();
    let again = crate::helpers::eventually(WAIT, || {
        let mut third = third.clone();
        async move { open_on(&mut third, first("again")).await.is_ok() }
    })
    .await;
    assert!(again, "a place given back is taken again");
}

/// A peer that stops reading its answers (it grants no flow-control window) while it goes on
/// reporting is given up on once an answer has waited a TTL, and its stream is reset: the
/// `RST_STREAM` reaches it behind the unread answers, not at the connection's idle cut.
#[tokio::test]
async fn a_stream_whose_peer_stops_reading_is_reset() {
    let _gauges = GAUGES.read().await;
    let s = server(1_000, 100).await;
    let tcp = tokio::net::TcpStream::connect(s.grpc)
        .await
        .expect("connect");
    let (h2, conn) = h2::client::Builder::new()
        .initial_window_size(16)
        .handshake::<_, bytes::Bytes>(tcp)
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let mut h2 = h2.ready().await.expect("ready");
    let call = http::Request::post(format!("http://{}{QUOTA_PATH}", s.grpc))
        .header("te", "trailers")
        .header("content-type", "application/grpc")
        .body(())
        .expect("request");
    let (_response, mut body) = h2.send_request(call, false).expect("headers");
    let report = |i: usize| {
        let domain = if i == 0 { "edge" } else { "" };
        let m = reports(domain, &[(bucket(&[("user", &format!("r-{i}"))]), 1)]);
        crate::helpers::grpc_framed(&prost::Message::encode_to_vec(&m))
    };
    // Each report of a new bucket is answered with its assignment, which the peer never reads.
    for i in 0..40 {
        body.send_data(report(i).into(), false).expect("data");
    }
    let start = tokio::time::Instant::now();
    let reset = tokio::time::timeout(WAIT, std::future::poll_fn(|cx| body.poll_reset(cx)))
        .await
        .expect("the stream is reset within the wait, not left to the idle cut");
    assert_eq!(reset.expect("a reset"), h2::Reason::CANCEL);
    assert!(
        start.elapsed() >= Duration::from_millis(900),
        "given up after a TTL: {:?}",
        start.elapsed()
    );
}

/// With Redis out of reach, a bucket of a rule whose part no renewal has told is assigned as
/// `on_backend_error` says: `local`, 1/N of the rule; `error`, nothing (Envoy applies its own
/// `no_assignment_behavior`).
#[tokio::test]
async fn with_redis_away_a_new_rule_is_assigned_as_on_backend_error_says() {
    let _gauges = GAUGES.read().await;
    let url = format!("redis://127.0.0.1:{}", crate::helpers::free_port());
    let node = |on_error| {
        let url = url.clone();
        TestServer::start_with(&[("edge.yaml", POLICY)], move |w| {
            w.backend = sluice::settings::BackendKind::Redis;
            w.redis.url = url;
            w.redis.fleet_size = Some(4);
            w.on_backend_error = on_error;
        })
    };
    let local = node(sluice::decision::OnBackendError::Local).await;
    let id = bucket(&[("user", "away")]);
    let mut envoy = opened(&local, reports("edge", &[(id.clone(), 300)])).await;
    let b = token_bucket(&envoy.assignment().await);
    assert_eq!(rate(&b), 25.0, "1/N of the rule: {b:?}");
    let error = node(sluice::decision::OnBackendError::Error).await;
    let mut envoy = opened(&error, reports("edge", &[(id.clone(), 300)])).await;
    let answer = tokio::time::timeout(Duration::from_millis(1_500), envoy.answers.message()).await;
    assert!(
        answer.is_err(),
        "no assignment while Redis is away: {answer:?}"
    );
}
