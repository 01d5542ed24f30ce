//! The client half (`--features client`) against a real server: typed answers, the deadline
//! against a server that never answers under each failure policy, and backoff above the
//! server's wait.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use sluice::client::{
    Answer, Backoff, ClientError, Descriptor, FailurePolicy, Jitter, RateLimitClient,
};
use tokio::net::TcpListener;

use crate::helpers::TestServer;

const SEC: u64 = 1_000_000_000;

/// Two requests a minute per tenant.
const POLICY: &str = r"
domain: jobs
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 2}
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
