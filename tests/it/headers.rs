//! Response headers and bodies: the IETF draft fields and the reference's legacy fields for the
//! most constrained limit, Retry-After never earlier than the exact wait and spread across
//! clients, and the problem+json body of a denial.

use std::collections::HashSet;

use sluice::decision::HeaderMode;
use sluice::pb::RateLimitResponse;
use sluice::pb::rate_limit_response::Code;

use crate::helpers::{TestServer, descriptor, http_raw, request, single};

const POLICY: &str = r#"
domain: hdr
descriptors:
  - key: paced
    rate_limit: {name: paced, unit: minute, requests_per_unit: 60, burst: 2}
  - key: wide
    rate_limit: {name: wide, unit: hour, requests_per_unit: 100}
  - key: unnamed
    rate_limit: {unit: second, requests_per_unit: 5, unit_multiplier: 10}
"#;

async fn server(mode: HeaderMode, problem: bool) -> TestServer {
    TestServer::start_with(&[("h.yaml", POLICY)], |s| {
        s.response_headers = mode;
        s.retry_after_jitter_seconds = 3;
        s.problem_body = problem;
    })
    .await
}

fn headers(r: &RateLimitResponse) -> Vec<(String, String)> {
    r.response_headers_to_add
        .iter()
        .map(|h| (h.key.clone(), h.value.clone()))
        .collect()
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// One member of an RFC 9651 List: a String item with parameters, e.g. `"name";q=10;w=60`.
/// Returns the string and the parameters, or `None` when the syntax is wrong.
fn sf_item(s: &str) -> Option<(String, Vec<(String, u64)>)> {
    let rest = s.strip_prefix('"')?;
    let mut name = String::new();
    let mut chars = rest.char_indices();
    let end = loop {
        let (i, c) = chars.next()?;
        match c {
            '\\' => name.push(chars.next()?.1),
            '"' => break i + 1,
            ' '..='~' => name.push(c),
            _ => return None,
        }
    };
    let mut params = Vec::new();
    for p in rest[end..].split(';').skip(1) {
        let (k, v) = p.split_once('=')?;
        if k.is_empty()
            || !k
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return None;
        }
        params.push((k.to_string(), v.parse().ok()?));
    }
    rest[end..]
        .is_empty()
        .then_some(())
        .or(rest[end..].starts_with(';').then_some(()))?;
    Some((name, params))
}

#[tokio::test]
async fn draft_fields_follow_the_structured_field_syntax() {
    let s = server(HeaderMode::Draft, false).await;
    let r = s.ok(single("hdr", "paced", "a")).await;
    let h = headers(&r);
    let policy = sf_item(header(&h, "RateLimit-Policy").unwrap()).unwrap();
    assert_eq!(
        policy,
        ("paced".into(), vec![("q".into(), 60), ("w".into(), 60)])
    );
    let limit = sf_item(header(&h, "RateLimit").unwrap()).unwrap();
    assert_eq!(
        limit,
        ("paced".into(), vec![("r".into(), 1), ("t".into(), 1)])
    );
    assert_eq!(header(&h, "Retry-After"), None, "only on denials");
    // An unnamed rule is named by its path; its window is unit × unit_multiplier.
    let r = s.ok(single("hdr", "unnamed", "a")).await;
    let h = headers(&r);
    let policy = sf_item(header(&h, "RateLimit-Policy").unwrap()).unwrap();
    assert_eq!(
        policy,
        (
            "hdr.unnamed".into(),
            vec![("q".into(), 5), ("w".into(), 10)]
        )
    );
}

#[tokio::test]
async fn the_most_constrained_limit_is_reported() {
    let s = server(HeaderMode::Legacy, false).await;
    let both = request(
        "hdr",
        vec![descriptor(&[("wide", "a")]), descriptor(&[("paced", "a")])],
    );
    let r = s.ok(both).await;
    let h = headers(&r);
    assert_eq!(header(&h, "RateLimit-Limit"), Some("60"));
    assert_eq!(header(&h, "RateLimit-Remaining"), Some("1"));
    assert_eq!(header(&h, "RateLimit-Reset"), Some("1"));
}

#[tokio::test]
async fn retry_after_is_never_early_and_is_spread() {
    let s = server(HeaderMode::Draft, false).await;
    let mut seen = HashSet::new();
    for client in 0..40 {
        let key = format!("c{client}");
        s.ok(single("hdr", "paced", &key)).await;
        s.ok(single("hdr", "paced", &key)).await;
        let r = s.ok(single("hdr", "paced", &key)).await;
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        let exact = r.statuses[0].duration_until_reset.as_ref().unwrap().seconds;
        let h = headers(&r);
        let retry: i64 = header(&h, "Retry-After").unwrap().parse().unwrap();
        assert!(
            retry >= exact.max(1),
            "Retry-After {retry} < exact wait {exact}"
        );
        assert!(retry <= exact.max(1) + 3, "jitter is at most 3 s: {retry}");
        seen.insert(retry);
    }
    assert!(seen.len() >= 2, "40 refused clients all told {seen:?}");
}

#[tokio::test]
async fn denials_carry_a_problem_json_body() {
    let s = server(HeaderMode::None, true).await;
    for _ in 0..2 {
        assert!(s.ok(single("hdr", "paced", "p")).await.raw_body.is_empty());
    }
    let r = s.ok(single("hdr", "paced", "p")).await;
    let h = headers(&r);
    assert_eq!(header(&h, "content-type"), Some("application/problem+json"));
    let body: serde_json::Value = serde_json::from_slice(&r.raw_body).unwrap();
    assert_eq!(
        body["type"],
        "https://iana.org/assignments/http-problem-types#quota-exceeded"
    );
    assert_eq!(body["status"], 429);
    assert_eq!(body["violated-policies"], serde_json::json!(["paced"]));
}

#[tokio::test]
async fn none_adds_nothing_and_json_gets_the_headers_too() {
    let s = server(HeaderMode::None, false).await;
    assert!(
        s.ok(single("hdr", "paced", "n"))
            .await
            .response_headers_to_add
            .is_empty()
    );
    let s = server(HeaderMode::Legacy, false).await;
    let body = r#"{"domain":"hdr","descriptors":[{"entries":[{"key":"paced","value":"j"}]}]}"#;
    let raw = http_raw(s.admin, "POST", "/json", body)
        .await
        .to_ascii_lowercase();
    assert!(raw.starts_with("http/1.1 200"), "{raw}");
    assert!(raw.contains("\r\nratelimit-limit: 60\r\n"), "{raw}");
    assert!(raw.contains("\r\nratelimit-remaining: 1\r\n"), "{raw}");
}

/// The legacy fields renamed (`legacy_headers`, the reference's `LIMIT_*_HEADER`): the new
/// names in the gRPC answer's `response_headers_to_add` and as the `/json` answer's HTTP
/// headers, the default names nowhere.
#[tokio::test]
async fn legacy_fields_take_the_configured_names_on_the_wire() {
    let s = TestServer::start_with(&[("h.yaml", POLICY)], |s| {
        s.response_headers = HeaderMode::Legacy;
        s.legacy_headers.limit = "X-Quota-Limit".into();
        s.legacy_headers.remaining = "X-Quota-Left".into();
        s.legacy_headers.reset = "X-Quota-Reset".into();
    })
    .await;
    let h = headers(&s.ok(single("hdr", "paced", "w")).await);
    let names: Vec<&str> = h.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["X-Quota-Limit", "X-Quota-Left", "X-Quota-Reset"]);
    assert_eq!(header(&h, "X-Quota-Limit"), Some("60"));
    assert_eq!(header(&h, "X-Quota-Left"), Some("1"));
    let body = r#"{"domain":"hdr","descriptors":[{"entries":[{"key":"paced","value":"j"}]}]}"#;
    let raw = http_raw(s.admin, "POST", "/json", body)
        .await
        .to_ascii_lowercase();
    assert!(raw.contains("\r\nx-quota-limit: 60\r\n"), "{raw}");
    assert!(raw.contains("\r\nx-quota-left: 1\r\n"), "{raw}");
    assert!(raw.contains("\r\nx-quota-reset: "), "{raw}");
    assert!(!raw.contains("ratelimit-"), "{raw}");
}
