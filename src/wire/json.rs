//! The proto3-JSON form of `RateLimitRequest` and `RateLimitResponse` used by `POST /json`, as
//! envoyproxy/ratelimit's `/json` endpoint speaks it: lowerCamelCase names (the proto names are
//! accepted too), enums by name (or number), 64-bit integers as numbers or strings, durations as
//! `"58s"`, zero values left out. Unknown fields are refused. A body is read straight into the
//! decision layer's [`decision::Request`].

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use serde_json::{Map, Value, json};

use crate::decision::{self, Code, Decision, RequestError};
use crate::pb;
use crate::pb::envoy::r#type::v3::RateLimitUnit;

/// `RateLimitRequest` in proto3 JSON.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JsonRequest {
    domain: String,
    descriptors: Vec<JsonDescriptor>,
    #[serde(rename = "hitsAddend", alias = "hits_addend")]
    hits_addend: Number,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct JsonDescriptor {
    entries: Vec<JsonEntry>,
    limit: Option<JsonOverride>,
    #[serde(rename = "hitsAddend", alias = "hits_addend")]
    hits_addend: Option<Number>,
    #[serde(rename = "isNegativeHits", alias = "is_negative_hits")]
    is_negative_hits: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct JsonEntry {
    key: String,
    value: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct JsonOverride {
    #[serde(rename = "requestsPerUnit", alias = "requests_per_unit")]
    requests_per_unit: Number,
    unit: Option<Value>,
}

/// A proto3-JSON integer: a number or a decimal string.
#[derive(Debug, Default, Clone, Copy)]
struct Number(u64);

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Number;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a non-negative integer or a string of one")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Number, E> {
                Ok(Number(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Number, E> {
                u64::try_from(v)
                    .map(Number)
                    .map_err(|_| E::custom("must not be negative"))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Number, E> {
                // Only whole numbers in range; truncation is guarded by the checks. The bound is
                // 2^64, excluded: `u64::MAX as f64` rounds up to it.
                if v.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&v) {
                    Ok(Number(v as u64))
                } else {
                    Err(E::custom("must be a whole number"))
                }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Number, E> {
                v.parse()
                    .map(Number)
                    .map_err(|_| E::custom(format!("{v:?} is not an integer")))
            }
        }
        d.deserialize_any(V)
    }
}

/// Why a `/json` body is refused.
#[derive(Debug, thiserror::Error)]
pub enum JsonError {
    /// The body is not a valid `RateLimitRequest`.
    #[error("invalid request body: {0}")]
    Body(#[from] serde_json::Error),
    /// A number does not fit its field.
    #[error("invalid request: {field} does not fit 32 bits")]
    TooLarge {
        /// The field's path.
        field: String,
    },
    /// An override's unit is not a `RateLimitUnit` (SECOND..YEAR).
    #[error("invalid request: descriptors[{descriptor}].limit.unit is not a RateLimitUnit")]
    UnknownUnit {
        /// The descriptor's index.
        descriptor: usize,
    },
    /// The request is refused as the protobuf one would be.
    #[error("invalid request: {0}")]
    Request(RequestError),
}

/// Parses a `/json` body into a decision request.
///
/// # Errors
///
/// [`JsonError`] for malformed JSON, unknown fields or out-of-range values.
pub fn parse(body: &[u8]) -> Result<decision::Request, JsonError> {
    let raw: JsonRequest = serde_json::from_slice(body)?;
    let fits = |n: Number, field: &dyn Fn() -> String| {
        u32::try_from(n.0).map_err(|_| JsonError::TooLarge { field: field() })
    };
    let mut descriptors = Vec::with_capacity(raw.descriptors.len());
    for (i, d) in raw.descriptors.into_iter().enumerate() {
        let limit = match d.limit {
            None => None,
            Some(ov) => Some(pb::rate_limit_descriptor::RateLimitOverride {
                requests_per_unit: fits(ov.requests_per_unit, &|| {
                    format!("descriptors[{i}].limit.requestsPerUnit")
                })?,
                unit: unit_number(ov.unit.as_ref())
                    .ok_or(JsonError::UnknownUnit { descriptor: i })?,
            }),
        };
        descriptors.push(pb::RateLimitDescriptor {
            entries: d
                .entries
                .into_iter()
                .map(|e| pb::rate_limit_descriptor::Entry {
                    key: e.key,
                    value: e.value,
                })
                .collect(),
            limit,
            hits_addend: d.hits_addend.map(|n| n.0),
            is_negative_hits: d.is_negative_hits,
        });
    }
    let request = pb::RateLimitRequest {
        domain: raw.domain,
        descriptors,
        hits_addend: fits(raw.hits_addend, &|| "hitsAddend".into())?,
    };
    super::from_pb(request).map_err(|e| match e {
        RequestError::UnknownUnit { descriptor, .. } => JsonError::UnknownUnit { descriptor },
        other => JsonError::Request(other),
    })
}

/// `envoy.type.v3.RateLimitUnit` by name or number.
fn unit_number(v: Option<&Value>) -> Option<i32> {
    match v {
        None => Some(0),
        Some(Value::String(s)) => RateLimitUnit::from_str_name(s).map(Into::into),
        Some(Value::Number(n)) => n.as_i64().and_then(|n| i32::try_from(n).ok()),
        Some(_) => None,
    }
}

fn code(c: Code) -> &'static str {
    match c {
        Code::Ok => "OK",
        Code::OverLimit => "OVER_LIMIT",
    }
}

/// The proto3-JSON form of a response.
#[must_use]
pub fn render(resp: &Decision) -> Value {
    let statuses: Vec<Value> = resp
        .statuses
        .iter()
        .map(|s| {
            let mut o = Map::new();
            o.insert("code".into(), json!(code(s.code)));
            if let Some(l) = &s.limit {
                let mut limit = Map::new();
                if !l.name().is_empty() {
                    limit.insert("name".into(), json!(l.name()));
                }
                if l.rate.requests_per_unit != 0 {
                    limit.insert("requestsPerUnit".into(), json!(l.rate.requests_per_unit));
                }
                limit.insert("unit".into(), json!(l.rate.unit.name()));
                o.insert("currentLimit".into(), Value::Object(limit));
            }
            if s.remaining != 0 {
                o.insert("limitRemaining".into(), json!(s.remaining));
            }
            if let Some(secs) = s.reset_seconds {
                o.insert("durationUntilReset".into(), json!(format!("{secs}s")));
            }
            Value::Object(o)
        })
        .collect();
    let mut out = json!({ "overallCode": code(resp.overall), "statuses": statuses });
    if let (Some(metadata), Value::Object(o)) = (&resp.dynamic_metadata, &mut out) {
        // A Struct's proto3 JSON is the object itself.
        o.insert("dynamicMetadata".into(), Value::Object(metadata.clone()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_camel_and_proto_names_and_string_numbers() {
        let r = parse(
            br#"{"domain":"d","hits_addend":2,"descriptors":[
                {"entries":[{"key":"k","value":"v"}],"hitsAddend":"5","isNegativeHits":true,
                 "limit":{"requestsPerUnit":3,"unit":"MINUTE"}}]}"#,
        )
        .unwrap();
        assert_eq!(r.domain, "d");
        assert_eq!(r.hits_addend, 2);
        let d = &r.descriptors[0];
        assert_eq!(d.entries[0].key, "k");
        assert_eq!(d.hits_addend, Some(5));
        assert!(d.is_negative_hits);
        assert_eq!(
            d.limit,
            Some(decision::Override {
                requests_per_unit: 3,
                unit: crate::policy::Unit::Minute,
            })
        );
    }

    #[test]
    fn dynamic_metadata_is_written_as_the_object_it_is() {
        let mut d = Decision {
            overall: Code::Ok,
            statuses: Vec::new(),
            headers: Vec::new(),
            body: Vec::new(),
            dynamic_metadata: None,
            trace: None,
            hold: None,
        };
        assert_eq!(render(&d), json!({"overallCode": "OK", "statuses": []}));
        d.dynamic_metadata = json!({"domain": "d", "descriptors": []})
            .as_object()
            .cloned();
        assert_eq!(
            render(&d)["dynamicMetadata"],
            json!({"domain": "d", "descriptors": []})
        );
    }

    #[test]
    fn refuses_unknown_fields_and_bad_values() {
        for body in [
            &br#"{"domain":"d","descriptor":[]}"#[..],
            br#"{"domain":"d","hitsAddend":-1}"#,
            br#"{"domain":"d","hitsAddend":5000000000}"#,
            // 2^64 as a JSON number (a double), one past the largest u64.
            br#"{"domain":"d","descriptors":[{"entries":[],"hitsAddend":18446744073709551616.0}]}"#,
            br#"{"domain":"d","descriptors":[{"entries":[],"limit":{"unit":"WEEK"}}]}"#,
            b"not json",
            b"",
        ] {
            assert!(parse(body).is_err(), "{}", String::from_utf8_lossy(body));
        }
    }
}
