//! The wire contract: golden request bytes (produced by Envoy's own generated Python client,
//! xds-protos, for a request with two descriptors) decode to what Envoy meant.

use prost::Message;
use sluice::pb::rate_limit_response::{self as pbr, rate_limit::Unit};
use sluice::pb::{RateLimitDescriptor, RateLimitRequest, RateLimitResponse, rate_limit_descriptor};

const GOLDEN: &str = "0a0465646765121c0a1a0a0e72656d6f74655f61646472657373120831302e302e302e31122d0a120a0b67656e657269635f6b657912036170690a130a09782d6170692d6b657912066162633132331a0208051801";

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn entry(key: &str, value: &str) -> rate_limit_descriptor::Entry {
    rate_limit_descriptor::Entry {
        key: key.into(),
        value: value.into(),
    }
}

#[test]
fn golden_request_decodes() {
    let bytes = hex(GOLDEN);
    assert_eq!(bytes.len(), 85);
    let req = RateLimitRequest::decode(bytes.as_slice()).unwrap();
    let expected = RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![
            RateLimitDescriptor {
                entries: vec![entry("remote_address", "10.0.0.1")],
                ..RateLimitDescriptor::default()
            },
            RateLimitDescriptor {
                entries: vec![entry("generic_key", "api"), entry("x-api-key", "abc123")],
                hits_addend: Some(5),
                ..RateLimitDescriptor::default()
            },
        ],
        hits_addend: 1,
    };
    assert_eq!(req, expected);
    // And encodes back to the same bytes.
    assert_eq!(expected.encode_to_vec(), bytes);
}

#[test]
fn negative_hits_is_field_four() {
    let d = RateLimitDescriptor {
        entries: vec![entry("k", "v")],
        is_negative_hits: true,
        ..RateLimitDescriptor::default()
    };
    let bytes = d.encode_to_vec();
    assert_eq!(&bytes[bytes.len() - 2..], &[0x20, 0x01]);
    // A descriptor hits_addend of 0 is present on the wire (the wrapper), unlike a plain 0.
    let zero = RateLimitDescriptor {
        hits_addend: Some(0),
        ..RateLimitDescriptor::default()
    };
    assert_eq!(zero.encode_to_vec(), vec![0x1a, 0x00]);
}

#[test]
fn response_week_is_seven_and_fields_keep_their_numbers() {
    let resp = RateLimitResponse {
        overall_code: pbr::Code::OverLimit.into(),
        statuses: vec![pbr::DescriptorStatus {
            code: pbr::Code::OverLimit.into(),
            current_limit: Some(pbr::RateLimit {
                name: "n".into(),
                requests_per_unit: 3,
                unit: Unit::Week.into(),
            }),
            limit_remaining: 4,
            duration_until_reset: Some(prost_types::Duration {
                seconds: 5,
                nanos: 0,
            }),
            quota: None,
        }],
        ..RateLimitResponse::default()
    };
    let bytes = resp.encode_to_vec();
    assert_eq!(&bytes[..2], &[0x08, 0x02], "overall_code is field 1");
    assert_eq!(bytes[2], 0x12, "statuses is field 2");
    let status = &bytes[4..];
    assert_eq!(&status[..2], &[0x08, 0x02], "status code is field 1");
    assert_eq!(status[2], 0x12, "current_limit is field 2");
    let limit = &status[4..4 + usize::from(status[3])];
    for field in [[0x08, 0x03], [0x10, 0x07], [0x1a, 0x01]] {
        assert!(
            limit.windows(2).any(|w| w == field),
            "{field:02x?} in {limit:02x?}"
        );
    }
    let rest = &status[4 + usize::from(status[3])..];
    assert_eq!(rest, &[0x18, 0x04, 0x22, 0x02, 0x08, 0x05]);
    assert_eq!(RateLimitResponse::decode(bytes.as_slice()).unwrap(), resp);
}
