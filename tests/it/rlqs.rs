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

/// Opens a stream whose first message is `first`.
async fn open(server: &TestServer, first: RateLimitQuotaUsageReports) -> Result<Envoy, Status> {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{}", server.grpc))
        .await
        .expect("connect");
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

/// A token bucket's rate, per second.
fn rate(b: &TokenBucket) -> f64 {
    let interval = b.fill_interval.expect("fill_interval");
    let secs = interval.seconds as f64 + f64::from(interval.nanos) / 1e9;
    f64::from(b.tokens_per_fill.expect("tokens_per_fill")) / secs
}

#[tokio::test]
async fn a_stream_without_a_domain_is_invalid() {
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
    let s = server(10_000, 100).await;
    let mut envoy = opened(&s, reports("edge", &[(bucket(&[("user", "a")]), 500)])).await;
    let a = envoy.assignment().await;
    let b = token_bucket(&a);
    assert_eq!(rate(&b), 100.0, "{b:?}");
    assert_eq!(b.max_tokens, 100);
    assert!(a.assignment_time_to_live.is_some());
    // `route` before `user` in the map; the tree names `user` first, then `route`: the rule
    // of `user` → `route=search`, 600 a minute.
    envoy
        .send(reports(
            "",
            &[(bucket(&[("route", "search"), ("user", "a")]), 100)],
        ))
        .await;
    let b = token_bucket(&envoy.assignment().await);
    assert!((rate(&b) - 10.0).abs() < 1e-9, "{b:?}");
    let reports = metric(s.admin, "sluice_rlqs_reports_total").await;
    assert!(reports >= Some(2.0), "{reports:?}");
}

#[tokio::test]
async fn two_streams_share_by_demand_and_a_closed_ones_share_goes_to_the_other() {
    let s = server(2_000, 100).await;
    let id = bucket(&[("user", "shared")]);
    let mut big = opened(&s, reports("edge", &[(id.clone(), 300)])).await;
    assert_eq!(rate(&token_bucket(&big.assignment().await)), 100.0);
    let mut small = opened(&s, reports("edge", &[(id.clone(), 100)])).await;
    let small_rate = rate(&token_bucket(&small.assignment().await));
    big.send(reports("", &[(id.clone(), 300)])).await;
    let big_rate = rate(&token_bucket(&big.assignment().await));
    assert!(big_rate + small_rate <= 100.0, "{big_rate} + {small_rate}");
    assert!(
        (big_rate / small_rate - 3.0).abs() < 0.3,
        "3 : 1 expected, got {big_rate} : {small_rate}"
    );
    // The big one leaves: the small one is pushed its demand's worth (the rule, capped at
    // 1.25 × 100) at its next tick, with no report.
    drop(big);
    let grown = tokio::time::timeout(WAIT, async {
        loop {
            let actions = small.next().await;
            if let [(_, Kind::QuotaAssignmentAction(a))] = actions.as_slice() {
                let r = rate(&token_bucket(a));
                if r > 2.0 * small_rate {
                    return r;
                }
            }
        }
    })
    .await
    .expect("a larger share pushed");
    assert_eq!(grown, 100.0);
}

#[tokio::test]
async fn a_bucket_past_the_cap_is_abandoned() {
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
    let s = server(400, 100).await;
    let id = bucket(&[("user", "renewed")]);
    let mut envoy = opened(&s, reports("edge", &[(id.clone(), 100)])).await;
    let start = tokio::time::Instant::now();
    envoy.assignment().await;
    // Not reported again: renewed at half the TTL, then abandoned once a TTL has passed.
    let renewed = envoy.assignment().await;
    let renewed_after = start.elapsed();
    assert!(renewed.assignment_time_to_live.is_some());
    assert!(
        renewed_after < Duration::from_millis(400),
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
    // The default TTL: the streams' tick is 1 s, so what pushes within 1 s is the reload itself.
    let s = server(10_000, 100).await;
    let id = bucket(&[("user", "reloaded")]);
    let mut envoy = opened(&s, reports("edge", &[(id.clone(), 500)])).await;
    assert_eq!(rate(&token_bucket(&envoy.assignment().await)), 100.0);
    let halved = POLICY.replace("requests_per_unit: 100}", "requests_per_unit: 50}");
    let (tmp, file) = (
        s.dir.path().join("edge.tmp"),
        s.dir.path().join("edge.yaml"),
    );
    std::fs::write(&tmp, halved).expect("write");
    let start = tokio::time::Instant::now();
    std::fs::rename(&tmp, &file).expect("rename");
    let pushed = tokio::time::timeout(WAIT, async {
        loop {
            if let [(_, Kind::QuotaAssignmentAction(a))] = envoy.next().await.as_slice()
                && rate(&token_bucket(a)) == 50.0
            {
                return start.elapsed();
            }
        }
    })
    .await
    .expect("the halved rule pushed within the wait");
    assert!(
        pushed < Duration::from_secs(1),
        "pushed {pushed:?} after the file changed"
    );
}

#[tokio::test]
async fn a_disabled_service_is_unimplemented() {
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
    let id = bucket(&[("user", "fleet")]);
    let mut big = opened(&one, reports("edge", &[(id.clone(), 300)])).await;
    let first = rate(&token_bucket(&big.assignment().await));
    assert!(first <= 100.0, "{first}");
    let mut small = opened(&two, reports("edge", &[(id.clone(), 100)])).await;
    small.assignment().await;
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
    assert!(
        (big_rate / small_rate - 3.0).abs() < 0.6,
        "3 : 1 by demand expected, got {big_rate} : {small_rate}"
    );
    // A node whose streams all leave gives its part up at once: the other node's stream is
    // pushed the whole rule.
    drop(small);
    let grown = rate_after(&mut big, &id, 300, Duration::from_secs(2)).await;
    assert!(grown >= 95.0, "{grown}");
    let trips = metric(
        one.admin,
        "sluice_redis_round_trips_by_purpose_total{purpose=\"quota\"}",
    )
    .await;
    assert!(trips >= Some(1.0), "{trips:?}");
}
