//! The client half (`--features client`) against a real server: typed answers, the deadline
//! against a server that never answers under each failure policy, backoff above the server's
//! wait, the tower layer in front of an axum and a tonic service, and `acquire` waiting for its
//! slot (the example batch job against a delaying rule and a refusing one).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sluice::client::{
    AcquireError, Answer, Backoff, ClientError, Descriptor, FailurePolicy, Jitter, RateLimitClient,
    RateLimitLayer, Refusal,
};
use tokio::net::TcpListener;
use tonic::transport::Channel;
use tower_service::Service;

use crate::helpers::{TestServer, metric};

const SEC: u64 = 1_000_000_000;

/// Two requests a minute per tenant; one a minute per API key.
const POLICY: &str = r"
domain: jobs
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: api_key
    rate_limit: {unit: minute, requests_per_unit: 1}
";

/// A deadline generous enough for a debug build on a busy machine, for the calls that must get
/// an answer.
const PATIENT: Duration = Duration::from_secs(5);

async fn server() -> TestServer {
    TestServer::start(&[("jobs.yaml", POLICY)]).await
}

fn client(server: &TestServer) -> RateLimitClient {
    RateLimitClient::connect_lazy(&format!("http://{}", server.grpc), "jobs")
        .expect("address")
        .with_deadline(PATIENT)
}

fn tenant(name: &str) -> Vec<Descriptor> {
    vec![Descriptor::new([("tenant", name)])]
}

/// A TCP listener on loopback that accepts connections and never answers: not the HTTP/2
/// handshake, not a call. Returns its address; the task holds the connections until the test
/// ends.
async fn stalling_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
        }
    });
    addr
}

#[tokio::test]
async fn answers_are_typed_allowed_or_refused_with_the_exact_wait() {
    let server = server().await;
    let client = client(&server);
    assert_eq!(client.check(&tenant("acme")).await, Answer::Allowed);
    assert_eq!(client.check(&tenant("acme")).await, Answer::Allowed);
    // Burst 2 spent; one more is admitted after T = 30 s (the clock does not move).
    assert_eq!(
        client.check(&tenant("acme")).await,
        Answer::Refused {
            wait: Duration::from_secs(30)
        }
    );
    server.clock.advance(10 * SEC);
    assert_eq!(
        client.try_check(&tenant("acme"), 1).await.expect("answer"),
        Answer::Refused {
            wait: Duration::from_secs(20)
        }
    );
    // A cost of 2 needs the whole bucket back: 50 s from here.
    assert_eq!(
        client.check_hits(&tenant("acme"), 2).await,
        Answer::Refused {
            wait: Duration::from_secs(50)
        }
    );
    server.clock.advance(20 * SEC);
    assert!(client.check(&tenant("acme")).await.is_allowed());
    // Another tenant has its own counter.
    assert!(client.check(&tenant("other")).await.is_allowed());
    assert_eq!(client.failures(), 0);
}

#[tokio::test]
async fn a_stalled_server_hits_the_deadline_and_the_failure_policy_answers() {
    // A real server too, started first: it installs the process's metrics recorder.
    let server = server().await;
    let addr = stalling_server().await;
    let deadline = Duration::from_millis(20);
    let open = RateLimitClient::connect_lazy(&format!("http://{addr}"), "jobs")
        .expect("address")
        .with_deadline(deadline);
    assert_eq!(open.failure_policy(), FailurePolicy::Open, "the default");

    let started = Instant::now();
    match open.try_check(&tenant("acme"), 1).await {
        Err(ClientError::Deadline(d)) => assert_eq!(d, deadline),
        other => panic!("expected the deadline, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the deadline bounds the call"
    );
    // try_check reports; only check applies the policy and counts.
    assert_eq!(open.failures(), 0);
    assert_eq!(open.check(&tenant("acme")).await, Answer::Allowed);
    assert_eq!(open.failures(), 1);

    let closed = open.clone().with_failure_policy(FailurePolicy::Closed {
        wait: Duration::from_secs(3),
    });
    assert_eq!(
        closed.check(&tenant("acme")).await,
        Answer::Refused {
            wait: Duration::from_secs(3)
        }
    );
    // Clones share the count.
    assert_eq!(open.failures(), 2);
    assert!(started.elapsed() < Duration::from_secs(5));

    // Each failure is a metric too, in the process's recorder (the test server's /metrics
    // shows it; other tests may add to it, never take away).
    for policy in ["open", "closed"] {
        let series =
            format!("sluice_client_failures_total{{reason=\"deadline\",policy=\"{policy}\"}}");
        let count = metric(server.admin, &series).await;
        assert!(count.is_some_and(|n| n >= 1.0), "{series}: {count:?}");
    }
}

#[tokio::test]
async fn an_unreachable_server_is_a_failure_too() {
    // A port that was just free: nothing listens, the connection is refused.
    let addr = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind")
        .local_addr()
        .expect("addr");
    let client = RateLimitClient::connect_lazy(&format!("http://{addr}"), "jobs")
        .expect("address")
        .with_deadline(PATIENT)
        .with_failure_policy(FailurePolicy::Closed {
            wait: Duration::from_secs(1),
        });
    let error = client
        .try_check(&tenant("acme"), 1)
        .await
        .expect_err("nobody answers");
    assert_eq!(error.reason(), "unavailable", "{error}");
    assert!(!client.check(&tenant("acme")).await.is_allowed());
    assert_eq!(client.failures(), 1);
    assert!(RateLimitClient::connect_lazy("not a uri", "jobs").is_err());
}

#[tokio::test]
async fn backoff_after_a_real_refusal_never_undercuts_its_wait_and_spreads() {
    let server = server().await;
    let client = client(&server);
    client.check(&tenant("acme")).await;
    client.check(&tenant("acme")).await;
    let Answer::Refused { wait } = client.check(&tenant("acme")).await else {
        panic!("the third call is refused");
    };
    assert_eq!(wait, Duration::from_secs(30));
    // Ten thousand refused callers, each with its own backoff (seeds 0..10 000).
    let waits: Vec<Duration> = (0..10_000u64)
        .map(|seed| {
            Backoff::new(Duration::from_millis(100), Duration::from_secs(10))
                .with_jitter(Jitter::seeded(seed))
                .after_refusal(wait)
        })
        .collect();
    assert!(waits.iter().all(|w| *w >= wait && *w < wait.mul_f64(1.5)));
    // Spread over the whole [30 s, 45 s): every one-second slot is used, none by more than
    // twice its share (10 000 / 15 ≈ 667).
    let mut per_second = [0usize; 15];
    for w in &waits {
        per_second[(w.as_secs() - 30) as usize] += 1;
    }
    assert!(
        per_second.iter().all(|&n| n > 333 && n < 1_333),
        "{per_second:?}"
    );
    let distinct: BTreeSet<u128> = waits.iter().map(Duration::as_millis).collect();
    assert!(distinct.len() > 5_000, "{} distinct ms", distinct.len());
}

/// An axum service counting the requests that reach it, behind the layer; descriptors from the
/// `x-api-key` header, none without it.
fn axum_service(client: RateLimitClient) -> (axum::Router, Arc<AtomicUsize>) {
    let reached = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&reached);
    let layer = RateLimitLayer::new(client, |req: &http::Request<axum::body::Body>| {
        req.headers()
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(|key| vec![Descriptor::new([("api_key", key)])])
            .unwrap_or_default()
    })
    .with_jitter(Jitter::seeded(9));
    let app = axum::Router::new()
        .route(
            "/work",
            axum::routing::get(move || async move {
                counter.fetch_add(1, Ordering::Relaxed);
                "done"
            }),
        )
        .layer(layer);
    (app, reached)
}

async fn get(app: &mut axum::Router, key: Option<&str>) -> http::Response<axum::body::Body> {
    let mut request = http::Request::get("/work");
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    let request = request.body(axum::body::Body::empty()).expect("request");
    std::future::poll_fn(|cx| Service::<http::Request<axum::body::Body>>::poll_ready(app, cx))
        .await
        .expect("ready");
    app.call(request).await.expect("infallible")
}

#[tokio::test]
async fn the_layer_answers_429_with_retry_after_and_the_service_is_never_reached() {
    let server = server().await;
    let (mut app, reached) = axum_service(client(&server));

    let first = get(&mut app, Some("k1")).await;
    assert_eq!(first.status(), http::StatusCode::OK);
    assert_eq!(reached.load(Ordering::Relaxed), 1);

    // One a minute: the next is refused for 60 s, spread upward by up to 30 s.
    let mut seen = BTreeSet::new();
    for _ in 0..20 {
        let refused = get(&mut app, Some("k1")).await;
        assert_eq!(refused.status(), http::StatusCode::TOO_MANY_REQUESTS);
        let retry_after: u64 = refused
            .headers()
            .get(http::header::RETRY_AFTER)
            .expect("Retry-After")
            .to_str()
            .expect("ascii")
            .parse()
            .expect("seconds");
        assert!((60..=90).contains(&retry_after), "{retry_after}");
        seen.insert(retry_after);
    }
    assert!(seen.len() > 3, "Retry-After is jittered: {seen:?}");
    assert_eq!(
        reached.load(Ordering::Relaxed),
        1,
        "refused requests never reach it"
    );

    // Another key, and a request without descriptors (not limited, sluice not asked).
    assert_eq!(
        get(&mut app, Some("k2")).await.status(),
        http::StatusCode::OK
    );
    for _ in 0..3 {
        assert_eq!(get(&mut app, None).await.status(), http::StatusCode::OK);
    }
    assert_eq!(reached.load(Ordering::Relaxed), 5);
}

#[tokio::test]
async fn the_layer_follows_the_failure_policy_when_sluice_stalls() {
    let addr = stalling_server().await;
    let base = RateLimitClient::connect_lazy(&format!("http://{addr}"), "jobs")
        .expect("address")
        .with_deadline(Duration::from_millis(20));

    let (mut open, reached) = axum_service(base.clone());
    assert_eq!(
        get(&mut open, Some("k")).await.status(),
        http::StatusCode::OK
    );
    assert_eq!(reached.load(Ordering::Relaxed), 1);

    let closed = base.with_failure_policy(FailurePolicy::Closed {
        wait: Duration::from_secs(2),
    });
    let (mut closed, reached) = axum_service(closed);
    let refused = get(&mut closed, Some("k")).await;
    assert_eq!(refused.status(), http::StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.headers().contains_key(http::header::RETRY_AFTER));
    assert_eq!(reached.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn the_layer_refuses_a_tonic_service_with_resource_exhausted() {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

    let server = server().await;
    let layer = RateLimitLayer::new(client(&server), |_: &http::Request<tonic::body::Body>| {
        vec![Descriptor::new([("api_key", "grpc")])]
    })
    .refusing_with(Refusal::Grpc);
    let (_reporter, health) = tonic_health::server::health_reporter();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut health = HealthClient::new(channel);
    let ok = health
        .check(HealthCheckRequest::default())
        .await
        .expect("the first call passes");
    assert_eq!(ok.into_inner().status, ServingStatus::Serving as i32);
    let refused = health
        .check(HealthCheckRequest::default())
        .await
        .expect_err("the second is over the limit");
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    let pushback: u64 = refused
        .metadata()
        .get("grpc-retry-pushback-ms")
        .expect("pushback")
        .to_str()
        .expect("ascii")
        .parse()
        .expect("ms");
    assert!((60_000..=90_000).contains(&pushback), "{pushback}");
}

/// Moves `server`'s clock with real time from now on (every millisecond), for tests where a
/// client really sleeps.
fn follow_real_time(server: &TestServer) {
    let clock = Arc::clone(&server.clock);
    let (origin, started) = (sluice::limiter::Clock::now(&*clock), Instant::now());
    tokio::spawn(async move {
        loop {
            let elapsed = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
            clock.set(origin + elapsed);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
}

#[tokio::test]
async fn acquire_stops_at_once_when_the_wait_is_past_the_longest() {
    let server = server().await;
    let client = client(&server);
    let key = [Descriptor::new([("api_key", "k")])];
    let slot = client
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("the bucket is full");
    assert_eq!((slot.refusals, slot.failed_open), (0, false));
    // One a minute: the next slot is 60 s away, past 10 s, so no sleep at all.
    let started = Instant::now();
    match client.acquire(&key, Duration::from_secs(10)).await {
        Err(AcquireError::TooLong { wait, max_wait, .. }) => {
            assert_eq!(
                (wait, max_wait),
                (Duration::from_secs(60), Duration::from_secs(10))
            );
        }
        other => panic!("expected TooLong, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "it did not sleep"
    );
}

#[tokio::test]
async fn acquire_sleeps_out_each_refusal_and_gets_its_slot() {
    // Two a second, one at once: T = 500 ms, refused with a wait of 1 s (whole seconds up).
    let server = TestServer::start(&[(
        "jobs.yaml",
        "domain: jobs\ndescriptors:\n  - key: paced\n    rate_limit: {unit: second, requests_per_unit: 2, burst: 1}\n",
    )])
    .await;
    follow_real_time(&server);
    let client = client(&server);
    let key = [Descriptor::new([("paced", "x")])];
    let started = Instant::now();
    let mut refusals = Vec::new();
    for _ in 0..3 {
        let slot = client
            .acquire(&key, Duration::from_secs(3))
            .await
            .expect("a slot within 3 s");
        refusals.push(slot.refusals);
        if slot.refusals > 0 {
            assert!(slot.waited >= Duration::from_secs(1), "{slot:?}");
        }
    }
    assert_eq!(refusals, [0, 1, 1]);
    let took = started.elapsed();
    assert!(
        (Duration::from_secs(2)..Duration::from_millis(3_500)).contains(&took),
        "{took:?}"
    );
    assert_eq!(client.failures(), 0);
}

/// The example job's rule, with or without `delay`.
fn vendor_policy(delay: bool) -> String {
    format!(
        "domain: vendor\ndescriptors:\n  - key: api\n    value: geocoder\n    rate_limit: \
         {{unit: second, requests_per_unit: {}, burst: 1{}}}\n",
        crate::paced_batch::RATE_PER_SECOND,
        if delay { ", delay: 1s" } else { "" }
    )
}

/// The example job's load (40 calls, its workers, its longest wait) against a server with its
/// rule, on real time.
async fn batch(delay: bool) -> crate::paced_batch::Run {
    let server = TestServer::start(&[("vendor.yaml", &vendor_policy(delay))]).await;
    follow_real_time(&server);
    crate::paced_batch::run(
        &format!("http://{}", server.grpc),
        40,
        crate::paced_batch::WORKERS,
        crate::paced_batch::MAX_WAIT,
    )
    .await
    .expect("the job runs")
}

#[tokio::test]
async fn the_example_job_runs_at_its_stated_rate_with_no_refusal_against_a_delaying_rule() {
    let run = batch(true).await;
    assert_eq!((run.billed, run.refusals, run.left), (40, 0, 0), "{run:?}");
    let rate = run.rate();
    let stated = f64::from(crate::paced_batch::RATE_PER_SECOND);
    assert!(
        (rate - stated).abs() <= stated * 0.1,
        "{rate:.2} per second against a stated {stated}"
    );
}

#[tokio::test]
async fn the_same_load_without_delay_is_refused() {
    let run = batch(false).await;
    assert!(run.refusals > 0 && run.left > 0, "{run:?}");
    assert_eq!(run.billed + run.left, 40, "{run:?}");
    // No more than the rule lets through: the bucket and one every 50 ms.
    let span = run.calls.last().copied().unwrap_or_default();
    assert!(
        run.billed <= 1 + span.as_millis() as u64 / 50 + 1,
        "{run:?}"
    );
}
