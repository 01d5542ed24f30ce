//! A rule that delays (`delay`), on the wire: a request that does not fit now but whose slot
//! comes within the delay is answered OK at its slot; one past it is refused with its wait. The
//! hold never outlives the caller's `grpc-timeout`, is bounded in all, ends at shutdown with a
//! refusal, and in Redis mode follows the TAT two nodes share, which spend recorded by a caller
//! that cannot wait never cuts back.
//!
//! The memory servers decide at a hand-driven clock that the tests leave still, so every request
//! is decided at one instant and the slots are exact; the holds themselves are real time, and
//! each answer is timed from the send of the whole burst.

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use sluice::pb::rate_limit_response::Code;
use sluice::pb::{RateLimitRequest, RateLimitResponse};
use sluice::settings::{BackendKind, Written};

use crate::helpers::redis::RedisProcess;
use crate::helpers::{TestServer, eventually, redis_missing, single};

/// 10 a second (T = 100 ms), a bucket of 5, and a wait of up to a second for a slot.
const POLICY: &str = r"
domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 10, burst: 5, delay: 1s}
";

const MS: Duration = Duration::from_millis(1);

/// Each answer (or error) of `n` requests for value `v` sent at once, with the time it took
/// from the send, in the order the requests were sent.
async fn burst(
    server: &TestServer,
    n: usize,
    v: &str,
    timeout: Option<Duration>,
) -> Vec<(Result<RateLimitResponse, tonic::Status>, Duration)> {
    let sent = Instant::now();
    let calls = (0..n).map(|_| {
        let mut client = server.client.clone();
        let mut req = tonic::Request::new(single("d", "k", v));
        if let Some(t) = timeout {
            req.set_timeout(t);
        }
        async move {
            let answer = client
                .should_rate_limit(req)
                .await
                .map(tonic::Response::into_inner);
            (answer, sent.elapsed())
        }
    });
    join_all(calls).await
}

/// The answers of a burst split into OK (their times, sorted) and OVER_LIMIT (time and
/// `duration_until_reset` in seconds); panics on an error.
fn split(
    answers: &[(Result<RateLimitResponse, tonic::Status>, Duration)],
) -> (Vec<Duration>, Vec<(Duration, i64)>) {
    let (mut ok, mut over) = (Vec::new(), Vec::new());
    for (answer, took) in answers {
        let r = answer.as_ref().expect("an answer, not an error");
        if r.overall_code == Code::Ok as i32 {
            ok.push(*took);
        } else {
            let reset = r.statuses[0]
                .duration_until_reset
                .as_ref()
                .map_or(0, |d| d.seconds);
            over.push((*took, reset));
        }
    }
    ok.sort();
    (ok, over)
}

fn within(took: Duration, at: Duration, slack: Duration) -> bool {
    took + slack >= at && took <= at + slack
}

/// How late a held answer may come under a loaded test run (a debug build beside parallel
/// tests on two cores wakes timers up to about 100 ms late at times); the spacing itself is
/// held to ±20 ms by the median gap.
const LATE: Duration = Duration::from_millis(150);

/// Checks that the answers after the bucket's five came at their slots, one interval apart:
/// - none before its slot counted from the send (less `early`, the slack of a clock other than
///   the test's, as Redis's);
/// - none later than [`LATE`] past its slot counted from the first held answer, which comes
///   within an interval of the last answer given at once;
/// - the median gap between held answers one interval, ±20 ms.
fn at_their_slots(ok: &[Duration], early: Duration) {
    let held = &ok[5..];
    assert!(held[0] <= ok[4] + 100 * MS + LATE, "slot 0 late: {ok:?}");
    for (i, took) in held.iter().enumerate() {
        let n = i as u32;
        assert!(
            *took + early >= 100 * MS * (n + 1),
            "slot {i} early: {ok:?}"
        );
        assert!(
            *took <= held[0] + 100 * MS * n + LATE,
            "slot {i} late: {ok:?}"
        );
    }
    if held.len() >= 4 {
        let mut gaps: Vec<Duration> = held.windows(2).map(|w| w[1] - w[0]).collect();
        gaps.sort();
        let median = gaps[gaps.len() / 2];
        assert!(
            within(median, 100 * MS, 20 * MS),
            "median gap {median:?}: {ok:?}"
        );
    }
}

#[tokio::test]
async fn a_burst_is_answered_at_once_then_at_its_slots_then_refused_with_its_wait() {
    let server = TestServer::start(&[("p.yaml", POLICY)]).await;
    let answers = burst(&server, 100, "a", None).await;
    let (ok, over) = split(&answers);
    assert_eq!((ok.len(), over.len()), (15, 85), "{ok:?}");
    // At once: before the first held answer's slot, 100 ms after the burst was taken (a debug
    // build beside parallel tests takes tens of milliseconds, at times more, to take it).
    for took in &ok[..5] {
        assert!(*took < 300 * MS, "the bucket's five at once: {ok:?}");
    }
    at_their_slots(&ok, Duration::ZERO);
    for (took, reset) in &over {
        assert!(
            *took < ok[5],
            "refused at once, before the first slot: {took:?}, {ok:?}"
        );
        // The sixteenth's slot is 1.1 s away, past the delay: a wait of 2 s, rounded up.
        assert!(*reset >= 2, "refused with its wait: {reset}");
    }
    let metrics = crate::helpers::http_get(server.admin, "/metrics").await.1;
    assert!(
        metrics.contains("sluice_holds_total{result=\"slot\"}"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_hold_never_outlives_the_callers_grpc_timeout() {
    let server = TestServer::start(&[("p.yaml", POLICY)]).await;
    let answers = burst(&server, 20, "t", Some(300 * MS)).await;
    let (ok, over) = split(&answers);
    // Five at once, then the slots at 100 and 200 ms; the one at 300 ms is past 300 ms less
    // the 5 ms margin.
    assert_eq!((ok.len(), over.len()), (7, 13), "{ok:?}");
    at_their_slots(&ok, Duration::ZERO);
    assert!(ok[6] < 300 * MS, "{ok:?}");
    for (took, reset) in &over {
        assert!(*took < ok[5], "refused at once, not late: {took:?}, {ok:?}");
        assert!(*reset >= 1);
    }
    // A deadline before the slot (90 ms, less the margin, before the slot at 100 ms) holds
    // nothing; a malformed or enormous one is no deadline of the caller's (the server's request
    // timeout bounds the hold).
    for (value, held) in [("90m", false), ("soon", true), ("99999999H", true)] {
        let v = format!("x{value}");
        burst(&server, 5, &v, None).await;
        let mut req = tonic::Request::new(single("d", "k", &v));
        req.metadata_mut()
            .insert("grpc-timeout", value.parse().unwrap());
        let sent = Instant::now();
        let r = server.client.clone().should_rate_limit(req).await;
        let r = r.expect("answered").into_inner();
        let code = if held { Code::Ok } else { Code::OverLimit };
        assert_eq!(r.overall_code, code as i32, "{value}");
        if held {
            let took = sent.elapsed();
            assert!(took >= 100 * MS && took < 200 * MS, "{value}: {took:?}");
        }
    }
}

#[tokio::test]
async fn a_caller_that_goes_away_ends_its_hold_and_gives_its_place_back() {
    let server = TestServer::start_with(&[("p.yaml", POLICY)], bounded(1)).await;
    burst(&server, 5, "c", None).await;
    // The sixth is held for 100 ms; its caller gives up after 30 ms.
    let mut client = server.client.clone();
    let gone = tokio::time::timeout(30 * MS, client.should_rate_limit(single("d", "k", "c")));
    assert!(gone.await.is_err(), "still held when its caller went away");
    let counted = eventually(Duration::from_secs(2), || async {
        let text = crate::helpers::http_get(server.admin, "/metrics").await.1;
        text.contains("sluice_holds_total{result=\"cancelled\"}")
    })
    .await;
    assert!(counted, "the hold ended with its call");
    // Its place is free: the next request is held (for the seventh slot, its own, at 200 ms:
    // the abandoned one's slot stays spent).
    let sent = Instant::now();
    let r = server.ok(single("d", "k", "c")).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert!(sent.elapsed() >= 100 * MS, "{:?}", sent.elapsed());
}

fn bounded(max_held: usize) -> impl FnOnce(&mut Written) {
    move |w: &mut Written| w.grpc.max_held_requests = max_held
}

#[tokio::test]
async fn past_the_bound_a_request_is_refused_at_once_and_charged_nothing() {
    let server = TestServer::start_with(&[("p.yaml", POLICY)], bounded(2)).await;
    let answers = burst(&server, 20, "b", None).await;
    let (ok, over) = split(&answers);
    assert_eq!((ok.len(), over.len()), (7, 13), "two held: {ok:?}");
    at_their_slots(&ok, Duration::ZERO);
    for (took, reset) in &over {
        assert!(*took < ok[5], "refused at once: {took:?}, {ok:?}");
        assert!(*reset >= 1, "with its wait");
    }
    // Nothing of the thirteen was charged: the next request takes the eighth slot, 300 ms on.
    let sent = Instant::now();
    let r = server.ok(single("d", "k", "b")).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    let took = sent.elapsed();
    assert!(took >= 300 * MS && took < 400 * MS, "{took:?}");
}

#[tokio::test]
async fn shutdown_answers_held_requests_at_once_refused_with_their_wait() {
    let mut server = TestServer::start(&[("p.yaml", POLICY)]).await;
    let client = server.client.clone();
    let held = tokio::spawn(async move {
        let sent = Instant::now();
        let calls = (0..15).map(|_| {
            let mut client = client.clone();
            async move {
                let r = client.should_rate_limit(single("d", "k", "s")).await;
                (r.map(tonic::Response::into_inner), sent.elapsed())
            }
        });
        join_all(calls).await
    });
    tokio::time::sleep(150 * MS).await;
    server.begin_stop();
    let answers = held.await.unwrap();
    let (ok, over) = split(&answers);
    // Five at once and the first slot (100 ms) before the stop; the other nine at the stop.
    assert_eq!((ok.len(), over.len()), (6, 9), "{ok:?}");
    for (took, reset) in &over {
        assert!(
            *took < 400 * MS,
            "answered at the stop, not at its slot: {took:?}"
        );
        assert!(*reset >= 1, "with its wait");
    }
}
/// Two servers on one Redis: a burst split across them is admitted within the shared bucket and
/// its slots, one interval apart whichever node answered.
#[tokio::test]
async fn two_nodes_on_one_redis_hold_for_the_shared_slots() {
    if redis_missing("two_nodes_on_one_redis_hold_for_the_shared_slots") {
        return;
    }
    two_nodes(false).await;
}

/// The same with leases on, the burst too short-lived to make the counter hot on either node
/// (15 hits each, under `min_rate`): it stays on the exact path, and its holds follow the
/// shared TAT as without leases. Holds from a lease are tested in `lease.rs`.
#[tokio::test]
async fn with_leases_a_delaying_counter_holds_for_the_shared_slots() {
    if redis_missing("with_leases_a_delaying_counter_holds_for_the_shared_slots") {
        return;
    }
    two_nodes(true).await;
}

/// Settings counting in the Redis at `url`, leasing or not.
fn on_redis(url: String, leases: bool) -> impl FnOnce(&mut Written) {
    move |w: &mut Written| {
        w.backend = BackendKind::Redis;
        w.redis.url = url;
        w.redis.timeout_ms = 2_000;
        w.redis.connect_timeout_ms = 500;
        w.redis.lease.enabled = leases;
    }
}

/// Waits until `server` has a Redis that answers.
async fn connected(server: &TestServer) {
    let answered = eventually(Duration::from_secs(5), || async {
        server.call(single("d", "k", "warm")).await.is_ok()
    })
    .await;
    assert!(answered, "Redis answers");
}

async fn two_nodes(leases: bool) {
    let redis = RedisProcess::start();
    let a = TestServer::start_with(&[("p.yaml", POLICY)], on_redis(redis.url(), leases)).await;
    let b = TestServer::start_with(&[("p.yaml", POLICY)], on_redis(redis.url(), leases)).await;
    for server in [&a, &b] {
        connected(server).await;
    }
    let sent = Instant::now();
    let send = |server: &TestServer| {
        let mut client = server.client.clone();
        async move {
            let req: RateLimitRequest = single("d", "k", "r");
            let r = client.should_rate_limit(req).await;
            (r.map(tonic::Response::into_inner), sent.elapsed())
        }
    };
    let calls = (0..30).map(|i| send(if i % 2 == 0 { &a } else { &b }));
    let answers = join_all(calls).await;
    let (ok, over) = split(&answers);
    // The bound over the 1 s of holds: B + floor(W/T) = 5 + 10, whichever node asked.
    assert_eq!(ok.len(), 15, "{ok:?}");
    assert_eq!(over.len(), 15);
    // The slots follow the one TAT: one interval apart across both nodes (Redis time, so
    // measured from the send, with the round trips' slack).
    at_their_slots(&ok, 40 * MS);
}

/// 10 a second, a bucket of 1, and slots up to 10 s ahead: more debt than the four periods a
/// counter may carry past its bucket and its delay.
const LONG: &str = r"
domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 10, burst: 1, delay: 10s}
";

/// Spend reported after the work by a caller that cannot wait for a slot is recorded on the
/// shared TAT without cutting the slots held requests claimed: the next request still waits
/// for the last of them.
#[tokio::test]
async fn on_redis_spend_from_a_caller_that_cannot_wait_keeps_the_slots_held() {
    if redis_missing("on_redis_spend_from_a_caller_that_cannot_wait_keeps_the_slots_held") {
        return;
    }
    let redis = RedisProcess::start();
    let redis_settings = on_redis(redis.url(), false);
    let server = TestServer::start_with(&[("p.yaml", LONG)], move |w: &mut Written| {
        redis_settings(w);
        w.grpc.request_timeout_ms = 15_000;
    })
    .await;
    connected(&server).await;
    let call = |req: RateLimitRequest, timeout: Duration| {
        let mut client = server.client.clone();
        let mut req = tonic::Request::new(req);
        req.set_timeout(timeout);
        async move { client.should_rate_limit(req).await }
    };
    // One at once, and 99 held for slots up to 9.9 s ahead, left waiting.
    let held: Vec<_> = (0..100)
        .map(|_| tokio::spawn(call(single("d", "k", "r"), Duration::from_secs(14))))
        .collect();
    let decided = eventually(Duration::from_secs(10), || async {
        let m = crate::helpers::http_get(server.admin, "/metrics").await.1;
        m.lines().any(|l| l == "sluice_held_requests 99")
    })
    .await;
    assert!(decided, "99 answers held");
    // Spend reported after the work, by a caller with 30 ms to wait: recorded, never held.
    let mut spend = single("d", "k", "r");
    spend.descriptors[0].hits_addend = Some(1);
    call(spend, 30 * MS).await.expect("the spend is answered");
    // The next caller that cannot wait is refused with the wait to the last slot (about 10 s
    // from the burst), not to four periods past the bucket.
    let next = call(single("d", "k", "r"), 30 * MS)
        .await
        .expect("answered at once")
        .into_inner();
    assert_eq!(next.overall_code, Code::OverLimit as i32);
    let reset = next.statuses[0]
        .duration_until_reset
        .as_ref()
        .map_or(0, |d| d.seconds);
    assert!(reset >= 8, "refused with {reset} s to wait: {next:?}");
    for h in held {
        h.abort();
    }
}
