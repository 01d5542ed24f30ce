//! Response dynamic metadata on the wire (gRPC `Struct` and `/json`) and merged domains through
//! the running server, reload included.

use std::path::Path;
use std::time::Duration;

use prost_types::value::Kind;
use sluice::pb::rate_limit_response::Code;
use sluice::pb::{RateLimitResponse, rate_limit_descriptor::RateLimitOverride};

use crate::helpers::{TestServer, descriptor, eventually, http, metric, request, single};

const RELOAD_WITHIN: Duration = Duration::from_secs(5);

const QUOTAS: &str = r#"
domain: meta
descriptors:
  - key: service
    value: service_1
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {service_with_quota: {name: "service_1"}, tier: gold}
  - key: service
    value: service_2
    rate_limit: {unit: minute, requests_per_unit: 2}
    metadata: {service_with_quota: {name: "service_2", region: eu}, weight: 2.5}
  - key: shadowed
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
    metadata: {shadowed: true}
"#;

/// The response's dynamic metadata as JSON, read back from the protobuf `Struct`.
fn dynamic(resp: &RateLimitResponse) -> serde_json::Value {
    fn value(v: &prost_types::Value) -> serde_json::Value {
        match v.kind.as_ref().expect("a kind") {
            Kind::NullValue(_) => serde_json::Value::Null,
            Kind::BoolValue(b) => (*b).into(),
            Kind::NumberValue(n) => (*n).into(),
            Kind::StringValue(s) => s.clone().into(),
            Kind::ListValue(l) => l.values.iter().map(value).collect(),
            Kind::StructValue(s) => strukt(s),
        }
    }
    fn strukt(s: &prost_types::Struct) -> serde_json::Value {
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), value(v)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
    strukt(resp.dynamic_metadata.as_ref().expect("dynamic_metadata"))
}

#[tokio::test]
async fn dynamic_metadata_on_the_wire_merges_what_passed() {
    let s = TestServer::start_with(&[("meta.yaml", QUOTAS)], |r| {
        r.response_dynamic_metadata = true;
    })
    .await;
    let both = || {
        let mut r = request(
            "meta",
            vec![
                descriptor(&[("service", "service_1")]),
                descriptor(&[("service", "service_2")]),
                descriptor(&[("shadowed", "x")]),
            ],
        );
        // A check of its own cost 0: a cost above 0 would report spend, recorded even when
        // the request is refused.
        r.descriptors[1].hits_addend = Some(0);
        r
    };
    let first = s.ok(both()).await;
    assert_eq!(
        dynamic(&first),
        serde_json::json!({
            "domain": "meta",
            "descriptors": [
                {"entries": ["service=service_1"]},
                {"entries": ["service=service_2"], "hitsAddend": 0.0},
                {"entries": ["shadowed=x"]},
            ],
            "metadata": {
                "service_with_quota": {"name": "service_1", "region": "eu"},
                "tier": "gold",
                "weight": 2.5,
                "shadowed": true,
            },
        })
    );
    // service_1 is now over its limit: refused, and only what passed (service_2, and the
    // shadow-mode rule, over its limit but OK) is merged.
    let second = s.ok(both()).await;
    assert_eq!(second.overall_code, Code::OverLimit as i32);
    assert_eq!(
        dynamic(&second)["metadata"],
        serde_json::json!({
            "service_with_quota": {"name": "service_2", "region": "eu"},
            "weight": 2.5,
            "shadowed": true,
        })
    );
    // An override and the request's hitsAddend are described too; no rule, no metadata.
    let mut r = request("meta", vec![descriptor(&[("other", "o")])]);
    r.hits_addend = 4;
    r.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 7,
        unit: sluice::pb::envoy::r#type::v3::RateLimitUnit::Hour as i32,
    });
    let m = dynamic(&s.ok(r).await);
    assert_eq!(
        m,
        serde_json::json!({
            "domain": "meta",
            "descriptors": [{"entries": ["other=o"], "limit": "requests_per_unit:7 unit:HOUR"}],
            "hitsAddend": 4.0,
        })
    );
    // /json answers the same object as dynamicMetadata.
    let (status, body) = http(
        s.admin,
        "POST",
        "/json",
        r#"{"domain":"meta","descriptors":[{"entries":[{"key":"service","value":"service_2"}]}]}"#,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        body["dynamicMetadata"]["metadata"]["service_with_quota"]["name"],
        "service_2"
    );
}

#[tokio::test]
async fn no_dynamic_metadata_by_default() {
    let s = TestServer::start(&[("meta.yaml", QUOTAS)]).await;
    let r = s.ok(single("meta", "service", "service_1")).await;
    assert_eq!(r.dynamic_metadata, None);
    let (_, body) = http(
        s.admin,
        "POST",
        "/json",
        r#"{"domain":"meta","descriptors":[{"entries":[{"key":"service","value":"service_1"}]}]}"#,
    )
    .await;
    assert!(!body.contains("dynamicMetadata"), "{body}");
}

const PART_A: &str = "domain: merged\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
const PART_B: &str = "domain: merged\ndescriptors:\n  - key: b\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";

async fn rpu(s: &TestServer, key: &str) -> Option<u32> {
    s.ok(single("merged", key, "v")).await.statuses[0]
        .current_limit
        .as_ref()
        .map(|l| l.requests_per_unit)
}

fn write(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn merged_domains_serve_both_files_and_a_bad_merge_keeps_the_last_good_policies() {
    let s = TestServer::start_with(&[("a.yaml", PART_A), ("b.yaml", PART_B)], |r| {
        r.merge_domains = true;
    })
    .await;
    assert_eq!(rpu(&s, "a").await, Some(1));
    assert_eq!(rpu(&s, "b").await, Some(2));
    let errors = || async {
        metric(s.admin, "ratelimit_service_config_load_error")
            .await
            .unwrap_or(0.0)
    };
    let before = errors().await;
    // A third file repeating `a` at the top of the domain: the reload is refused.
    write(
        &s.dir.path().join("c.yaml"),
        "domain: merged\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 9}\n  - key: c\n    rate_limit: {unit: hour, requests_per_unit: 3}\n",
    );
    assert!(eventually(RELOAD_WITHIN, || async { errors().await > before }).await);
    assert_eq!(rpu(&s, "a").await, Some(1), "old policies keep answering");
    assert_eq!(rpu(&s, "c").await, None);
    // Fixed, the third file joins the merge.
    write(
        &s.dir.path().join("c.yaml"),
        "domain: merged\ndescriptors:\n  - key: c\n    rate_limit: {unit: hour, requests_per_unit: 3}\n",
    );
    assert!(eventually(RELOAD_WITHIN, || async { rpu(&s, "c").await == Some(3) }).await);
    assert_eq!(rpu(&s, "a").await, Some(1));
    assert_eq!(rpu(&s, "b").await, Some(2));
}
