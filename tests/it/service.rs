//! `ShouldRateLimit` over gRPC against a real server: each request field (hits_addend, negative
//! hits, overrides) and each response field as the wire carries them for every kind of rule,
//! all-or-nothing charging, bad input, framing and health. The decision rules' combinations
//! (options, caps, backend failures) are `decision`'s unit tests, matching is the policy tests',
//! and GCRA's arithmetic is `gcra.rs`'s.

use sluice::pb::envoy::r#type::v3::RateLimitUnit;
use sluice::pb::rate_limit_descriptor::RateLimitOverride;
use sluice::pb::rate_limit_response::{Code, DescriptorStatus, RateLimit, rate_limit::Unit};
use tonic::Code as GrpcCode;

use crate::helpers::{
    Process, SHOULD_RATE_LIMIT, TestServer, descriptor, grpc_framed, http_get, metric, raw_call,
    raw_exchange, request, single,
};

const SEC: u64 = 1_000_000_000;

const POLICY: &str = r"
domain: test
descriptors:
  - key: burst
    rate_limit: {unit: hour, requests_per_unit: 3}
  - key: paced
    rate_limit: {name: paced, unit: minute, requests_per_unit: 60, burst: 2}
  - key: free
    rate_limit: {unlimited: true}
  - key: banned
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: white
  - key: broad
    rate_limit: {name: broad, unit: hour, requests_per_unit: 1}
  - key: narrow
    rate_limit: {replaces: [{name: broad}], unit: hour, requests_per_unit: 5}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: weekly
    rate_limit: {unit: week, requests_per_unit: 7}
";

async fn server() -> TestServer {
    TestServer::start(&[("test.yaml", POLICY)]).await
}

fn limited(
    code: Code,
    rpu: u32,
    unit: Unit,
    name: &str,
    remaining: u32,
    reset: i64,
) -> DescriptorStatus {
    DescriptorStatus {
        code: code.into(),
        current_limit: Some(RateLimit {
            name: name.into(),
            requests_per_unit: rpu,
            unit: unit.into(),
        }),
        limit_remaining: remaining,
        duration_until_reset: Some(prost_types::Duration {
            seconds: reset,
            nanos: 0,
        }),
        quota: None,
    }
}

fn no_limit(remaining: u32) -> DescriptorStatus {
    DescriptorStatus {
        code: Code::Ok.into(),
        limit_remaining: remaining,
        ..DescriptorStatus::default()
    }
}

#[tokio::test]
async fn burst_then_over_limit_with_exact_counts() {
    let s = server().await;
    // 3 per hour: T = 1200 s. Each admission adds 1200 s of debt.
    for (remaining, reset) in [(2, 1200), (1, 2400), (0, 3600)] {
        let r = s.ok(single("test", "burst", "x")).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(
            r.statuses,
            vec![limited(Code::Ok, 3, Unit::Hour, "", remaining, reset)]
        );
    }
    let r = s.ok(single("test", "burst", "x")).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(
        r.statuses,
        vec![limited(Code::OverLimit, 3, Unit::Hour, "", 0, 1200)]
    );
    // Another value has its own counter.
    let r = s.ok(single("test", "burst", "y")).await;
    assert_eq!(r.statuses[0].limit_remaining, 2);
    // One emission interval later exactly one more fits; a nanosecond earlier it does not.
    s.clock.advance(1200 * SEC - 1);
    assert_eq!(
        s.ok(single("test", "burst", "x")).await.overall_code,
        Code::OverLimit as i32
    );
    s.clock.advance(1);
    let r = s.ok(single("test", "burst", "x")).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::Ok, 3, Unit::Hour, "", 0, 3600)]
    );
}

#[tokio::test]
async fn explicit_burst_and_name() {
    let s = server().await;
    let r = s.ok(single("test", "paced", "x")).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::Ok, 60, Unit::Minute, "paced", 1, 1)]
    );
    let r = s.ok(single("test", "paced", "x")).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::Ok, 60, Unit::Minute, "paced", 0, 2)]
    );
    let r = s.ok(single("test", "paced", "x")).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::OverLimit, 60, Unit::Minute, "paced", 0, 1)]
    );
    // Sub-second waits round up, never down.
    s.clock.advance(SEC / 2);
    let r = s.ok(single("test", "paced", "x")).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::OverLimit, 60, Unit::Minute, "paced", 0, 1)]
    );
}

#[tokio::test]
async fn unknown_domain_and_unmatched_descriptors_are_ok_without_limit() {
    let s = server().await;
    let r = s
        .ok(request(
            "nope",
            vec![descriptor(&[("burst", "x")]), descriptor(&[("a", "b")])],
        ))
        .await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses, vec![no_limit(0), no_limit(0)]);
    let r = s.ok(single("test", "unknown", "x")).await;
    assert_eq!(r.statuses, vec![no_limit(0)]);
    // A node without rate_limit whitelists.
    let r = s.ok(single("test", "white", "x")).await;
    assert_eq!(r.statuses, vec![no_limit(0)]);
}

#[tokio::test]
async fn unlimited_reports_max_remaining() {
    let s = server().await;
    let r = s.ok(single("test", "free", "x")).await;
    assert_eq!(r.statuses, vec![no_limit(4_294_967_295)]);
    assert!(s.store.is_empty(), "unlimited rules are never counted");
}

#[tokio::test]
async fn replaces_drops_the_named_limit_in_the_same_request() {
    let s = server().await;
    let both = || {
        request(
            "test",
            vec![
                descriptor(&[("broad", "x")]),
                descriptor(&[("narrow", "y")]),
            ],
        )
    };
    for remaining in [4, 3] {
        let r = s.ok(both()).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(r.statuses[0], no_limit(0));
        assert_eq!(r.statuses[1].limit_remaining, remaining);
    }
    // Alone, the broad limit applies (1 per hour).
    assert_eq!(
        s.ok(single("test", "broad", "x")).await.overall_code,
        Code::Ok as i32
    );
    assert_eq!(
        s.ok(single("test", "broad", "x")).await.overall_code,
        Code::OverLimit as i32
    );
}

#[tokio::test]
async fn shadow_mode_reports_ok_and_charges_no_denial() {
    let s = server().await;
    let r = s.ok(single("test", "shadow", "x")).await;
    assert_eq!(r.statuses[0].limit_remaining, 0);
    let keys = s.store.len();
    for _ in 0..3 {
        let r = s
            .ok(request(
                "test",
                vec![
                    descriptor(&[("shadow", "x")]),
                    descriptor(&[("burst", "s")]),
                ],
            ))
            .await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
        assert_eq!(r.statuses[0].limit_remaining, 0);
        assert_eq!(
            r.statuses[0].duration_until_reset.as_ref().unwrap().seconds,
            3600
        );
    }
    // The enforced descriptor beside it was charged each time.
    assert_eq!(
        s.ok(single("test", "burst", "s")).await.overall_code,
        Code::OverLimit as i32
    );
    assert_eq!(s.store.len(), keys + 1);
}

#[tokio::test]
async fn request_hits_addend_zero_counts_as_one() {
    let s = server().await;
    let mut req = single("test", "burst", "x");
    req.hits_addend = 0;
    assert_eq!(s.ok(req.clone()).await.statuses[0].limit_remaining, 2);
    req.hits_addend = 2;
    assert_eq!(s.ok(req).await.statuses[0].limit_remaining, 0);
}

#[tokio::test]
async fn descriptor_hits_addend_zero_consumes_nothing() {
    let s = server().await;
    let mut req = single("test", "burst", "x");
    req.hits_addend = 3;
    req.descriptors[0].hits_addend = Some(0);
    for _ in 0..5 {
        let r = s.ok(req.clone()).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        assert_eq!(r.statuses[0].limit_remaining, 3);
    }
    // And it overrides the request's cost when set to something else.
    req.descriptors[0].hits_addend = Some(2);
    assert_eq!(s.ok(req).await.statuses[0].limit_remaining, 1);
}

#[tokio::test]
async fn cost_above_burst_is_denied_without_changing_state() {
    let s = server().await;
    let mut req = single("test", "burst", "x");
    req.hits_addend = 4;
    let r = s.ok(req.clone()).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(
        r.statuses[0].limit_remaining, 3,
        "all three tokens are still there"
    );
    req.hits_addend = 3;
    let r = s.ok(req).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 0);
}

#[tokio::test]
async fn a_rejected_request_charges_none_of_its_descriptors() {
    let s = server().await;
    let r = s
        .ok(request(
            "test",
            vec![
                descriptor(&[("burst", "x")]),
                descriptor(&[("banned", "z")]),
                descriptor(&[("paced", "p")]),
            ],
        ))
        .await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0], limited(Code::Ok, 3, Unit::Hour, "", 3, 0));
    assert_eq!(
        r.statuses[1],
        limited(Code::OverLimit, 0, Unit::Second, "", 0, 1)
    );
    assert_eq!(
        r.statuses[2],
        limited(Code::Ok, 60, Unit::Minute, "paced", 2, 0)
    );
    assert!(s.store.is_empty(), "nothing was charged");
    assert_eq!(
        s.ok(single("test", "burst", "x")).await.statuses[0].limit_remaining,
        2
    );
}

#[tokio::test]
async fn negative_hits_refund() {
    let s = server().await;
    let mut req = single("test", "burst", "x");
    req.hits_addend = 3;
    assert_eq!(s.ok(req.clone()).await.statuses[0].limit_remaining, 0);
    req.hits_addend = 2;
    req.descriptors[0].is_negative_hits = true;
    let r = s.ok(req).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses[0].limit_remaining, 2);
    assert_eq!(
        s.ok(single("test", "burst", "x")).await.statuses[0].limit_remaining,
        1
    );
}

#[tokio::test]
async fn request_override_replaces_the_configured_limit() {
    let s = server().await;
    let mut req = single("test", "unknown-key", "x");
    req.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 2,
        unit: RateLimitUnit::Minute.into(),
    });
    let r = s.ok(req.clone()).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::Ok, 2, Unit::Minute, "", 1, 30)]
    );
    s.ok(req.clone()).await;
    assert_eq!(s.ok(req.clone()).await.overall_code, Code::OverLimit as i32);
    // With an unknown domain the override is ignored.
    req.domain = "nope".into();
    assert_eq!(s.ok(req).await.statuses, vec![no_limit(0)]);
}

#[tokio::test]
async fn week_is_unit_seven() {
    let s = server().await;
    let r = s.ok(single("test", "weekly", "x")).await;
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().unit, 7);
    assert_eq!(
        r.statuses[0].duration_until_reset.as_ref().unwrap().seconds,
        86_400
    );
}

#[tokio::test]
async fn bad_input_is_invalid_argument_and_charges_nothing() {
    let s = TestServer::start_with(&[("test.yaml", POLICY)], |settings| {
        settings.requests.max_descriptors = 2;
        settings.requests.max_entries = 2;
        settings.requests.max_key_bytes = 8;
        settings.requests.max_value_bytes = 16;
        settings.requests.max_request_bytes = 4096;
    })
    .await;
    let ok = || descriptor(&[("burst", "x")]);
    let mut unknown_unit = request("test", vec![ok()]);
    unknown_unit.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: 0,
    });
    let cases = [
        (request("", vec![ok()]), "domain must not be empty"),
        (request("test", vec![]), "descriptor list must not be empty"),
        (
            request("test", vec![ok(), descriptor(&[("", "v")])]),
            "descriptors[1].entries[0] has an empty key",
        ),
        (
            request("test", vec![descriptor(&[])]),
            "descriptors[0] has no entries",
        ),
        (
            request("test", vec![ok(), ok(), ok()]),
            "3 descriptors, more than the 2 allowed",
        ),
        (
            request(
                "test",
                vec![descriptor(&[("a", "1"), ("b", "2"), ("c", "3")])],
            ),
            "3 entries",
        ),
        (
            request("test", vec![descriptor(&[("longer-key", "v")])]),
            "key is 10 bytes",
        ),
        (
            request("test", vec![descriptor(&[("burst", &"v".repeat(17))])]),
            "value is 17 bytes",
        ),
        (unknown_unit, "limit.unit 0 is not a unit"),
    ];
    for (req, message) in cases {
        let err = s.call(req).await.unwrap_err();
        assert_eq!(err.code(), GrpcCode::InvalidArgument, "{message}: {err:?}");
        assert!(
            err.message().contains(message),
            "{message:?} not in {:?}",
            err.message()
        );
    }
    // Larger than the transport accepts: refused by the gRPC layer with RESOURCE_EXHAUSTED,
    // the code gRPC's status-code specification gives a message over the configured limit.
    let err = s
        .call(request(
            "test",
            vec![descriptor(&[("burst", &"v".repeat(8000))])],
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), GrpcCode::ResourceExhausted, "{err:?}");
    assert!(s.store.is_empty(), "bad input charged something");
    // The server still answers.
    assert_eq!(
        s.ok(single("test", "burst", "x")).await.statuses[0].limit_remaining,
        2
    );
}

#[tokio::test]
async fn health_is_serving_over_grpc_and_http() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    let s = server().await;
    let mut health = s.health().await;
    for service in [
        "",
        "ratelimit",
        "envoy.service.ratelimit.v3.RateLimitService",
    ] {
        let r = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
    }
    assert_eq!(
        http_get(s.admin, "/healthcheck").await,
        (200, "OK".to_string())
    );
    s.stop().await.unwrap();
}

/// A message over `requests.max_request_bytes`, on the wire: `grpc-status` 8
/// (RESOURCE_EXHAUSTED), not tonic's 11 (OUT_OF_RANGE), with the size and the limit in the
/// message; one at the limit is decoded (and, being garbage, refused as INVALID_ARGUMENT).
#[tokio::test]
async fn oversized_requests_are_resource_exhausted_on_the_wire() {
    let s = TestServer::start_with(&[("test.yaml", POLICY)], |settings| {
        settings.requests.max_request_bytes = 1024;
    })
    .await;
    let (status, message) = raw_call(s.grpc, &[0xff; 1025]).await;
    assert_eq!(status, "8", "{message}");
    assert!(
        message.contains("1025") && message.contains("1024"),
        "{message}"
    );
    let (status, message) = raw_call(s.grpc, &[0xff; 1024]).await;
    assert_eq!(status, "3", "{message}");
    // The health service has the same cap, refused by tonic's decoder and its code corrected.
    let health = |len: usize| {
        let framed = grpc_framed(&vec![0x0a; len]);
        async move {
            let (answer, _) = raw_exchange(
                s.grpc,
                "/grpc.health.v1.Health/Check",
                &[],
                &[&framed],
                true,
            )
            .await;
            answer.status()
        }
    };
    let (status, message) = health(1025).await;
    assert_eq!(status, "8", "{message}");
    assert!(message.contains("1025"), "{message}");
    let (status, message) = health(1024).await;
    assert_ne!(status, "8", "{message}");
    assert_eq!(
        s.ok(single("test", "burst", "x")).await.overall_code,
        Code::Ok as i32
    );
}

/// gRPC's framing of a unary call, on the wire, as tonic's generated server answered it: a
/// message split at every byte is one message; the answer is `application/grpc`, one framed
/// message and `grpc-status: 0` in the trailers, with no `content-length` (and no `date`, as
/// grpc-go's server answers); an oversized prefix is refused before the rest is sent;
/// compression, a missing or cut message, and an unknown method each get their status
/// (`grpc-message` percent-encoded, as gRPC sends it); a second message is refused.
#[tokio::test]
async fn unary_framing_on_the_wire() {
    use prost::Message;
    let s = TestServer::start_with(&[("test.yaml", POLICY)], |settings| {
        settings.requests.max_request_bytes = 1024;
    })
    .await;
    let call = |frames: Vec<Vec<u8>>, headers: Vec<(&'static str, &'static str)>| {
        let addr = s.grpc;
        async move {
            let frames: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            raw_exchange(addr, SHOULD_RATE_LIMIT, &headers, &frames, true)
                .await
                .0
        }
    };
    let body = grpc_framed(&single("test", "free", "x").encode_to_vec());

    let bytewise = call(body.iter().map(|b| vec![*b]).collect(), vec![]).await;
    assert_eq!(bytewise.headers["content-type"], "application/grpc");
    assert!(bytewise.headers.get("content-length").is_none());
    // As grpc-go's server answers (envoyproxy/ratelimit's): no `date`.
    assert!(bytewise.headers.get("date").is_none());
    assert!(bytewise.headers.get("grpc-status").is_none());
    assert_eq!(bytewise.status(), ("0".into(), String::new()));
    let (prefix, message) = bytewise.data.split_at(5);
    assert_eq!(prefix[0], 0);
    assert_eq!(
        u32::from_be_bytes(prefix[1..].try_into().unwrap()) as usize,
        message.len()
    );
    let answer = sluice::pb::RateLimitResponse::decode(message).unwrap();
    assert_eq!(answer.overall_code, Code::Ok as i32);
    assert_eq!(answer.statuses.len(), 1);

    // Two messages: refused, nothing answered.
    let two = call(vec![[body.clone(), body.clone()].concat()], vec![]).await;
    assert_eq!(two.status().0, "13");
    assert!(two.data.is_empty());

    // Only the prefix of an oversized message, the stream left open: answered at once.
    let mut over = vec![0u8];
    over.extend_from_slice(&1025u32.to_be_bytes());
    let (refused, _open) = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        raw_exchange(s.grpc, SHOULD_RATE_LIMIT, &[], &[&over], false),
    )
    .await
    .expect("answered before the message was sent");
    let (status, message) = refused.status();
    assert_eq!(status, "8", "{message}");
    assert!(
        message.contains("1025") && message.contains("1024"),
        "{message}"
    );

    let gzip = call(vec![body.clone()], vec![("grpc-encoding", "gzip")]).await;
    assert_eq!(gzip.status().0, "12", "{:?}", gzip.status());
    assert_eq!(gzip.headers["grpc-accept-encoding"], "identity");
    let mut compressed = body.clone();
    compressed[0] = 1;
    let (status, message) = call(vec![compressed], vec![]).await.status();
    assert_eq!(status, "13");
    assert!(message.contains("compressed-flag"), "{message}");
    let (status, message) = call(vec![], vec![]).await.status();
    assert_eq!(
        (status.as_str(), message.as_str()),
        ("13", "Missing%20request%20message.")
    );
    let (status, message) = call(vec![body[..body.len() - 1].to_vec()], vec![])
        .await
        .status();
    assert_eq!(
        (status.as_str(), message.as_str()),
        ("13", "Unexpected%20EOF%20decoding%20stream.")
    );

    let (other, _) = raw_exchange(
        s.grpc,
        "/envoy.service.ratelimit.v3.RateLimitService/Other",
        &[],
        &[&body],
        true,
    )
    .await;
    assert_eq!(other.status().0, "12");
    assert!(other.data.is_empty());
    // Behind the edge like the service's method: not gRPC, not answered.
    let (plain, _) = raw_exchange(
        s.grpc,
        "/envoy.service.ratelimit.v3.RateLimitService/Other",
        &[("content-type", "text/plain")],
        &[&body],
        true,
    )
    .await;
    assert_eq!(plain.http, http::StatusCode::UNSUPPORTED_MEDIA_TYPE);
    s.stop().await.unwrap();
}

/// A request that does not decode is the client's error: INVALID_ARGUMENT with prost's reason,
/// not INTERNAL, and nothing is charged.
#[tokio::test]
async fn undecodable_requests_are_invalid_arguments() {
    let s = server().await;
    let cases: [(&str, &[u8]); 3] = [
        // domain (field 1) of two bytes that are not UTF-8
        ("a domain that is not UTF-8", &[0x0a, 0x02, 0xff, 0xfe]),
        // domain announced as 5 bytes, 1 sent
        ("a truncated field", &[0x0a, 0x05, b'a']),
        // field 2 (descriptors) with wire type 7, which does not exist
        ("an invalid wire type", &[0x17, 0x00]),
    ];
    for (what, bytes) in cases {
        let (status, message) = raw_call(s.grpc, bytes).await;
        assert_eq!(status, "3", "{what}: {message}");
        assert!(
            message.contains("cannot") && message.contains("decode"),
            "{what}: {message}"
        );
    }
    // A well-formed request on the same server is still answered.
    assert_eq!(
        s.ok(single("svc", "user", "u")).await.overall_code,
        Code::Ok as i32
    );
}

/// Every call refused for what it carried counts in `sluice_decisions_total{result="invalid"}`:
/// bodies that do not decode, bad framing, oversized messages and a doubled unary call. Counted
/// in a server process of its own, whose metrics no other test touches.
#[tokio::test]
async fn every_refused_call_counts_as_invalid() {
    let p = Process::start(
        &[("test.yaml", POLICY)],
        "requests: {max_request_bytes: 1024}\n",
    );
    let invalid = "sluice_decisions_total{result=\"invalid\"}";
    let first = prost::Message::encode_to_vec(&single("test", "burst", "counted"));
    let undecodable: [&[u8]; 3] = [
        &[0x0a, 0x02, 0xff, 0xfe],
        &[0x0a, 0x05, b'a'],
        &[0x17, 0x00],
    ];
    for bytes in undecodable {
        assert_eq!(raw_call(p.grpc, bytes).await.0, "3");
    }
    assert_eq!(raw_call(p.grpc, &[0xff; 1025]).await.0, "8");
    let mut compressed = grpc_framed(&first);
    compressed[0] = 1;
    let (answer, _) = raw_exchange(p.grpc, SHOULD_RATE_LIMIT, &[], &[&compressed], true).await;
    assert_eq!(answer.status().0, "13");
    let (answer, _) = raw_exchange(p.grpc, SHOULD_RATE_LIMIT, &[], &[], true).await;
    assert_eq!(answer.status().0, "13", "no message");
    let doubled = [grpc_framed(&first), grpc_framed(&first)].concat();
    let (answer, _) = raw_exchange(p.grpc, SHOULD_RATE_LIMIT, &[], &[&doubled], true).await;
    assert_eq!(answer.status().0, "13", "two messages");
    assert_eq!(metric(p.admin, invalid).await, Some(7.0));
    // A call the decider refuses (an empty domain) is counted once, as before.
    assert_eq!(
        raw_call(
            p.grpc,
            &prost::Message::encode_to_vec(&single("", "k", "v"))
        )
        .await
        .0,
        "3"
    );
    assert_eq!(metric(p.admin, invalid).await, Some(8.0));
}

/// A unary call carries exactly one request message: a second one, in the same DATA frame or
/// in a frame of its own, ends the call with `INTERNAL` and nothing is decided, so nothing is
/// charged.
#[tokio::test]
async fn a_unary_call_with_two_messages_is_refused_and_decides_nothing() {
    let s = server().await;
    let one = grpc_framed(&prost::Message::encode_to_vec(&single(
        "test", "burst", "twice",
    )));
    let together = [one.clone(), one.clone()].concat();
    let cases: [(&str, Vec<&[u8]>); 2] = [
        ("in one frame", vec![&together]),
        ("in two frames", vec![&one, &one]),
    ];
    for (what, frames) in cases {
        let (answer, _) = raw_exchange(s.grpc, SHOULD_RATE_LIMIT, &[], &frames, true).await;
        let (status, message) = answer.status();
        assert_eq!(status, "13", "{what}: {message}");
        assert_eq!(message, "Too%20many%20requests", "{what}");
        assert!(answer.data.is_empty(), "{what}: no response message");
    }
    // Nothing was charged: `burst` allows 3 an hour, and all 3 are still there.
    for n in 1..=3 {
        let r = s.ok(single("test", "burst", "twice")).await;
        assert_eq!(r.overall_code, Code::Ok as i32, "request {n}");
    }
    assert_eq!(
        s.ok(single("test", "burst", "twice")).await.overall_code,
        Code::OverLimit as i32
    );
}

const LAYERED: &str = r"
domain: layered
descriptors:
  - key: user
    rate_limits:
      - {name: per_second, unit: second, requests_per_unit: 2}
      - {name: per_day, unit: day, requests_per_unit: 3}
  - key: acct
    rate_limit: {name: budget, unit: hour, requests_per_unit: 100, burst: 20}
    descriptors:
      - key: route
        value: search
        cost: 10
      - key: route
        value: item
        cost: 1
";

async fn layered(mode: sluice::decision::HeaderMode) -> TestServer {
    TestServer::start_with(&[("layered.yaml", LAYERED)], |s| {
        s.response_headers = mode;
    })
    .await
}

fn header(r: &sluice::pb::RateLimitResponse, name: &str) -> String {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| h.value.clone())
        .unwrap_or_default()
}

#[tokio::test]
async fn rate_limits_charge_every_limit_of_a_node_all_or_nothing() {
    let s = layered(sluice::decision::HeaderMode::Legacy).await;
    let user = || single("layered", "user", "u");
    let r = s.ok(user()).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::Ok, 2, Unit::Second, "per_second", 1, 1)]
    );
    let r = s.ok(user()).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::Ok, 2, Unit::Second, "per_second", 0, 1)]
    );
    // Per second refuses while the day has one left; nothing is charged.
    let r = s.ok(user()).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(
        r.statuses,
        vec![limited(
            Code::OverLimit,
            2,
            Unit::Second,
            "per_second",
            0,
            1
        )]
    );
    assert_eq!(header(&r, "RateLimit-Limit"), "2");
    s.clock.advance(SEC);
    // The day still had one: the refusal took none of it. Now it is the tightest.
    let r = s.ok(user()).await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(
        r.statuses,
        vec![limited(Code::Ok, 3, Unit::Day, "per_day", 0, 86_399)]
    );
    assert_eq!(header(&r, "RateLimit-Limit"), "3");
    assert_eq!(header(&r, "RateLimit-Remaining"), "0");
    // The day refuses after the per-second ones passed.
    s.clock.advance(SEC);
    let r = s.ok(user()).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(
        r.statuses,
        vec![limited(Code::OverLimit, 3, Unit::Day, "per_day", 0, 28_798)]
    );
    assert_eq!(header(&r, "RateLimit-Limit"), "3");
    // A two-descriptor request refused by the day charges the other descriptor nothing.
    let r = s
        .ok(request(
            "layered",
            vec![descriptor(&[("user", "w")]), descriptor(&[("user", "u")])],
        ))
        .await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    let r = s.ok(single("layered", "user", "w")).await;
    assert_eq!(
        r.statuses,
        vec![limited(Code::Ok, 2, Unit::Second, "per_second", 1, 1)]
    );
}

#[tokio::test]
async fn cost_nodes_share_one_budget_at_their_costs() {
    let s = layered(sluice::decision::HeaderMode::None).await;
    let route = |r: &str| request("layered", vec![descriptor(&[("acct", "a"), ("route", r)])]);
    let budget =
        |code, remaining, reset| limited(code, 100, Unit::Hour, "budget", remaining, reset);
    // 100 per hour is one per 36 s.
    assert_eq!(
        s.ok(route("search")).await.statuses,
        vec![budget(Code::Ok, 10, 360)]
    );
    assert_eq!(
        s.ok(route("item")).await.statuses,
        vec![budget(Code::Ok, 9, 396)]
    );
    assert_eq!(
        s.ok(single("layered", "acct", "a")).await.statuses,
        vec![budget(Code::Ok, 8, 432)]
    );
    // Eight left, search costs ten: refused, nothing charged.
    let r = s.ok(route("search")).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses, vec![budget(Code::OverLimit, 8, 72)]);
    // The request's hits_addend multiplies the cost: 3 items take 3.
    let mut three = route("item");
    three.hits_addend = 3;
    assert_eq!(s.ok(three).await.statuses, vec![budget(Code::Ok, 5, 540)]);
    // Refunding a search gives back its ten (15 left; the next plain hit leaves 14).
    let mut refund = route("search");
    refund.descriptors[0].is_negative_hits = true;
    assert_eq!(s.ok(refund).await.overall_code, Code::Ok as i32);
    assert_eq!(
        s.ok(single("layered", "acct", "a")).await.statuses[0].limit_remaining,
        14
    );
}

#[tokio::test]
async fn rlconfig_lists_each_limit_and_cost_node() {
    let s = layered(sluice::decision::HeaderMode::None).await;
    let (status, body) = http_get(s.admin, "/rlconfig").await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        "layered.acct.route_item: cost=1 of layered.acct\n\
         layered.acct.route_search: cost=10 of layered.acct\n\
         layered.acct: unit=HOUR unit_multiplier=1 requests_per_unit=100 burst=20 name=budget, shadow_mode: false, quota_mode: false\n\
         layered.user[per_day]: unit=DAY unit_multiplier=1 requests_per_unit=3 burst=3 name=per_day, shadow_mode: false, quota_mode: false\n\
         layered.user[per_second]: unit=SECOND unit_multiplier=1 requests_per_unit=2 burst=2 name=per_second, shadow_mode: false, quota_mode: false\n"
    );
}
