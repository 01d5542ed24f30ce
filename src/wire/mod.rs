//! The request and the answer in their wire forms, converted to and from the decision layer:
//! the protobuf messages of `envoy.service.ratelimit.v3` here, their proto3-JSON form in
//! [`json`]. The JSON form is read into the protobuf message first, so a descriptor is built in
//! one place. A quota stream's usage reports are read in [`quota`], each bucket id straight
//! into the bytes a stream keeps. Knows no transport: serving gRPC and HTTP is `server`'s.

pub mod json;
pub mod quota;

use prost_types::Duration;

use crate::decision::{self, Code, Decision, RequestError};
use crate::pb::envoy::config::core::v3::HeaderValue;
use crate::pb::envoy::r#type::v3::RateLimitUnit;
use crate::pb::rate_limit_response::{self as pbr, rate_limit::Unit as PbUnit};
use crate::pb::{RateLimitRequest, RateLimitResponse};
use crate::policy::Unit;

/// A protobuf request as a decision request (strings moved, not copied).
///
/// # Errors
///
/// [`RequestError::UnknownUnit`] for an override whose unit is not SECOND..YEAR.
pub fn from_pb(req: RateLimitRequest) -> Result<decision::Request, RequestError> {
    let mut descriptors = Vec::with_capacity(req.descriptors.len());
    for (i, d) in req.descriptors.into_iter().enumerate() {
        let limit = match d.limit {
            None => None,
            Some(ov) => Some(decision::Override {
                requests_per_unit: ov.requests_per_unit,
                unit: override_unit(ov.unit).ok_or(RequestError::UnknownUnit {
                    descriptor: i,
                    value: ov.unit,
                })?,
            }),
        };
        descriptors.push(decision::Descriptor {
            entries: d
                .entries
                .into_iter()
                .map(|e| decision::Entry {
                    key: e.key,
                    value: e.value,
                })
                .collect(),
            limit,
            hits_addend: d.hits_addend,
            is_negative_hits: d.is_negative_hits,
        });
    }
    Ok(decision::Request {
        domain: req.domain,
        descriptors,
        hits_addend: req.hits_addend,
    })
}

/// Our unit → `RateLimitResponse.RateLimit.Unit` (where WEEK is 7).
fn response_unit(unit: Unit) -> PbUnit {
    match unit {
        Unit::Second => PbUnit::Second,
        Unit::Minute => PbUnit::Minute,
        Unit::Hour => PbUnit::Hour,
        Unit::Day => PbUnit::Day,
        Unit::Week => PbUnit::Week,
        Unit::Month => PbUnit::Month,
        Unit::Year => PbUnit::Year,
    }
}

fn code(code: Code) -> pbr::Code {
    match code {
        Code::Ok => pbr::Code::Ok,
        Code::OverLimit => pbr::Code::OverLimit,
    }
}

#[must_use]
pub fn to_pb(resp: Decision) -> RateLimitResponse {
    RateLimitResponse {
        dynamic_metadata: resp.dynamic_metadata.map(to_struct),
        response_headers_to_add: resp
            .headers
            .into_iter()
            .map(|(key, value)| HeaderValue {
                key,
                value,
                raw_value: Vec::new(),
            })
            .collect(),
        raw_body: resp.body,
        overall_code: code(resp.overall).into(),
        statuses: resp
            .statuses
            .iter()
            .map(|s| pbr::DescriptorStatus {
                code: code(s.code).into(),
                current_limit: s.limit.as_ref().map(|l| pbr::RateLimit {
                    name: l.name().to_string(),
                    requests_per_unit: l.rate.requests_per_unit,
                    unit: response_unit(l.rate.unit).into(),
                }),
                limit_remaining: s.remaining,
                duration_until_reset: s.reset_seconds.map(|secs| Duration {
                    seconds: i64::try_from(secs).unwrap_or(i64::MAX),
                    nanos: 0,
                }),
                quota: None,
            })
            .collect(),
        ..RateLimitResponse::default()
    }
}

/// A JSON map as a `google.protobuf.Struct` (numbers become doubles, as in any Struct).
fn to_struct(map: serde_json::Map<String, serde_json::Value>) -> prost_types::Struct {
    prost_types::Struct {
        fields: map.into_iter().map(|(k, v)| (k, to_value(v))).collect(),
    }
}

fn to_value(v: serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    use serde_json::Value as J;
    let kind = match v {
        J::Null => Kind::NullValue(prost_types::NullValue::NullValue.into()),
        J::Bool(b) => Kind::BoolValue(b),
        J::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or_default()),
        J::String(s) => Kind::StringValue(s),
        J::Array(items) => Kind::ListValue(prost_types::ListValue {
            values: items.into_iter().map(to_value).collect(),
        }),
        J::Object(map) => Kind::StructValue(to_struct(map)),
    };
    prost_types::Value { kind: Some(kind) }
}

/// `envoy.type.v3.RateLimitUnit` (no WEEK) → our unit; `None` for UNKNOWN or undefined values.
fn override_unit(value: i32) -> Option<Unit> {
    Some(match RateLimitUnit::try_from(value).ok()? {
        RateLimitUnit::Unknown => return None,
        RateLimitUnit::Second => Unit::Second,
        RateLimitUnit::Minute => Unit::Minute,
        RateLimitUnit::Hour => Unit::Hour,
        RateLimitUnit::Day => Unit::Day,
        RateLimitUnit::Month => Unit::Month,
        RateLimitUnit::Year => Unit::Year,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost_types::value::Kind;

    #[test]
    fn dynamic_metadata_becomes_a_struct() {
        let map = serde_json::json!({
            "domain": "d",
            "descriptors": [{"entries": ["k=v"], "hitsAddend": 3}],
            "metadata": {"ok": true, "none": null},
        });
        let decision = Decision {
            overall: Code::Ok,
            statuses: Vec::new(),
            headers: Vec::new(),
            body: Vec::new(),
            dynamic_metadata: map.as_object().cloned(),
            trace: None,
            hold: None,
        };
        let s = to_pb(decision).dynamic_metadata.unwrap();
        let kind = |v: &prost_types::Value| v.kind.clone().unwrap();
        assert_eq!(kind(&s.fields["domain"]), Kind::StringValue("d".into()));
        let Kind::ListValue(list) = kind(&s.fields["descriptors"]) else {
            panic!("a list")
        };
        let Kind::StructValue(desc) = kind(&list.values[0]) else {
            panic!("a struct")
        };
        assert_eq!(kind(&desc.fields["hitsAddend"]), Kind::NumberValue(3.0));
        let Kind::ListValue(entries) = kind(&desc.fields["entries"]) else {
            panic!("a list")
        };
        assert_eq!(kind(&entries.values[0]), Kind::StringValue("k=v".into()));
        let Kind::StructValue(meta) = kind(&s.fields["metadata"]) else {
            panic!("a struct")
        };
        assert_eq!(kind(&meta.fields["ok"]), Kind::BoolValue(true));
        assert_eq!(kind(&meta.fields["none"]), Kind::NullValue(0));
        // Off: no field at all.
        let off = Decision {
            overall: Code::Ok,
            statuses: Vec::new(),
            headers: Vec::new(),
            body: Vec::new(),
            dynamic_metadata: None,
            trace: None,
            hold: None,
        };
        assert_eq!(to_pb(off).dynamic_metadata, None);
    }
}
