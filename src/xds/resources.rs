//! One response's resources to a policy set: every `Any` decoded as a `RateLimitConfig` (another
//! type, or bytes that do not decode, reject the response), each rendered as the reference's
//! YAML policy (in JSON form, which YAML reads) under its resource name, and all loaded as one
//! new set by `policy::load_str_with`, so a resource is validated exactly as a policy file is
//! and an error names the resource and the descriptor path. Nothing is swapped here.

use prost::Message;
use serde_json::{Map, Value, json};

use crate::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use crate::policy::{self, PolicyError, PolicySet};

/// The type of the resources subscribed to.
pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// Decodes every resource, refusing the first of another type or that does not decode, named
/// by its place in the response (its name is inside what did not decode).
pub(super) fn decode(resources: &[prost_types::Any]) -> Result<Vec<RateLimitConfig>, String> {
    resources
        .iter()
        .enumerate()
        .map(|(i, any)| {
            if any.type_url != TYPE_URL {
                return Err(format!(
                    "resources[{i}]: type {:?} is not {TYPE_URL}",
                    any.type_url
                ));
            }
            RateLimitConfig::decode(any.value.as_slice())
                .map_err(|e| format!("resources[{i}]: cannot decode a RateLimitConfig: {e}"))
        })
        .collect()
}

/// Loads the resources as one policy set (an empty list is an empty set); on failure, every
/// problem as `<resource name>: <descriptor path>: <reason>`, joined by `; `.
pub(super) fn load(configs: &[RateLimitConfig], merge_domains: bool) -> Result<PolicySet, String> {
    let sources: Vec<(String, String)> = configs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let name = if c.name.is_empty() {
                format!("resources[{i}]")
            } else {
                c.name.clone()
            };
            (name, render(c))
        })
        .collect();
    let borrowed: Vec<(&str, &str)> = sources
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    policy::load_str_with(&borrowed, merge_domains).map_err(|e| describe(&e))
}

/// A load's problems without the positions in the rendered text (they point at nothing the
/// server sent).
fn describe(e: &PolicyError) -> String {
    match e {
        PolicyError::Invalid(problems) => problems
            .iter()
            .map(|p| {
                if p.path.is_empty() {
                    format!("{}: {}", p.file, p.message)
                } else {
                    format!("{}: {}: {}", p.file, p.path, p.message)
                }
            })
            .collect::<Vec<_>>()
            .join("; "),
        other => other.to_string(),
    }
}

/// One resource as a policy file, as the reference converts it (`config_xds.go`): empty strings
/// and false flags left out; a unit `UNKNOWN` left out, so it is accepted with `unlimited` and
/// refused (as "invalid rate limit unit") on a limited descriptor.
fn render(c: &RateLimitConfig) -> String {
    json!({
        "domain": c.domain,
        "descriptors": c.descriptors.iter().map(descriptor).collect::<Vec<_>>(),
    })
    .to_string()
}

fn descriptor(d: &RateLimitDescriptor) -> Value {
    let mut m = Map::new();
    m.insert("key".into(), json!(d.key));
    if !d.value.is_empty() {
        m.insert("value".into(), json!(d.value));
    }
    if let Some(p) = &d.rate_limit {
        m.insert("rate_limit".into(), rate_limit(p));
    }
    if !d.descriptors.is_empty() {
        m.insert(
            "descriptors".into(),
            Value::Array(d.descriptors.iter().map(descriptor).collect()),
        );
    }
    for (name, on) in [
        ("shadow_mode", d.shadow_mode),
        ("detailed_metric", d.detailed_metric),
        ("quota_mode", d.quota_mode),
    ] {
        if on {
            m.insert(name.into(), json!(true));
        }
    }
    if let Some(metadata) = &d.metadata {
        m.insert("metadata".into(), structure(metadata));
    }
    Value::Object(m)
}

fn rate_limit(p: &RateLimitPolicy) -> Value {
    let mut m = Map::new();
    let unit = match RateLimitUnit::try_from(p.unit) {
        Ok(RateLimitUnit::Unknown) if p.unlimited => None,
        Ok(unit) => Some(unit.as_str_name().to_string()),
        Err(_) => Some(format!("unit number {}", p.unit)),
    };
    if let Some(unit) = unit {
        m.insert("unit".into(), json!(unit));
    }
    if p.unlimited {
        m.insert("unlimited".into(), json!(true));
    } else {
        m.insert("requests_per_unit".into(), json!(p.requests_per_unit));
    }
    if !p.name.is_empty() {
        m.insert("name".into(), json!(p.name));
    }
    if !p.replaces.is_empty() {
        m.insert(
            "replaces".into(),
            Value::Array(p.replaces.iter().map(|r| json!({"name": r.name})).collect()),
        );
    }
    Value::Object(m)
}

fn structure(s: &prost_types::Struct) -> Value {
    Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), value(v)))
            .collect(),
    )
}

fn value(v: &prost_types::Value) -> Value {
    use prost_types::value::Kind;
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::NumberValue(n)) => json!(n),
        Some(Kind::StringValue(s)) => json!(s),
        Some(Kind::BoolValue(b)) => json!(b),
        Some(Kind::StructValue(s)) => structure(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::ratelimit::config::ratelimit::v3::RateLimitReplace;

    fn limited(key: &str, value: &str, rpu: u32, unit: RateLimitUnit) -> RateLimitDescriptor {
        RateLimitDescriptor {
            key: key.into(),
            value: value.into(),
            rate_limit: Some(RateLimitPolicy {
                unit: unit as i32,
                requests_per_unit: rpu,
                ..RateLimitPolicy::default()
            }),
            ..RateLimitDescriptor::default()
        }
    }

    /// Envoy Gateway's tree: the route's entry, then the client's CIDR with the limit.
    fn gateway(name: &str, unit: RateLimitUnit) -> RateLimitConfig {
        let route = "httproute/default/r/rule/0/match/0/x";
        RateLimitConfig {
            name: name.into(),
            domain: name.into(),
            descriptors: vec![RateLimitDescriptor {
                key: route.into(),
                value: route.into(),
                descriptors: vec![limited("masked_remote_address", "0.0.0.0/0", 3, unit)],
                ..RateLimitDescriptor::default()
            }],
        }
    }

    fn any(c: &RateLimitConfig) -> prost_types::Any {
        prost_types::Any {
            type_url: TYPE_URL.into(),
            value: c.encode_to_vec(),
        }
    }

    #[test]
    fn envoy_gateways_trees_load_with_every_unit() {
        let configs = decode(&[
            any(&gateway("default/eg/http", RateLimitUnit::Week)),
            any(&gateway("default/eg/https", RateLimitUnit::Second)),
        ])
        .unwrap();
        let set = load(&configs, false).unwrap();
        let d = set.domain("default/eg/http").expect("domain");
        let route = "httproute/default/r/rule/0/match/0/x";
        let found = d
            .resolve([(route, route), ("masked_remote_address", "0.0.0.0/0")])
            .expect("rule");
        let policy::Limit::Limited(rate) = found.rules[0].limit else {
            panic!("unlimited")
        };
        assert_eq!((rate.requests_per_unit, rate.unit), (3, policy::Unit::Week));
        assert_eq!(set.summary().domains, 2);
        assert!(load(&[], false).unwrap().domains().is_empty());
    }

    #[test]
    fn a_bad_resource_is_named_with_its_descriptor_path() {
        let good = gateway("good", RateLimitUnit::Minute);
        let bad = gateway("default/eg/http", RateLimitUnit::Unknown);
        let err = load(&[good, bad], false).unwrap_err();
        assert_eq!(
            err,
            "default/eg/http: descriptors[0].descriptors[0].rate_limit.unit: invalid rate limit \
             unit \"UNKNOWN\" (expected second, minute, hour, day, week, month or year)"
        );
        let mut dup = gateway("again", RateLimitUnit::Minute);
        dup.domain = "good".into();
        let err = load(&[gateway("good", RateLimitUnit::Minute), dup], false).unwrap_err();
        assert!(
            err.starts_with("again: domain: duplicate domain \"good\""),
            "{err}"
        );
    }

    #[test]
    fn unknown_unit_is_fine_when_unlimited_and_the_rest_carries_over() {
        let c = RateLimitConfig {
            name: "n".into(),
            domain: "d".into(),
            descriptors: vec![RateLimitDescriptor {
                key: "k".into(),
                rate_limit: Some(RateLimitPolicy {
                    unlimited: true,
                    name: "free".into(),
                    replaces: vec![RateLimitReplace {
                        name: "other".into(),
                    }],
                    ..RateLimitPolicy::default()
                }),
                shadow_mode: true,
                ..RateLimitDescriptor::default()
            }],
        };
        let text = render(&c);
        assert_eq!(
            text,
            r#"{"descriptors":[{"key":"k","rate_limit":{"name":"free","replaces":[{"name":"other"}],"unlimited":true},"shadow_mode":true}],"domain":"d"}"#
        );
        let set = load(&[c], false).unwrap();
        assert_eq!(set.summary().unlimited, 1);
    }

    #[test]
    fn another_type_or_bad_bytes_are_refused_by_place() {
        let wrong = prost_types::Any {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            value: vec![],
        };
        let err = decode(&[any(&gateway("a", RateLimitUnit::Hour)), wrong]).unwrap_err();
        assert!(
            err.starts_with(
                "resources[1]: type \"type.googleapis.com/envoy.config.cluster.v3.Cluster\""
            ),
            "{err}"
        );
        let garbage = prost_types::Any {
            type_url: TYPE_URL.into(),
            value: vec![0x0a, 0xff],
        };
        let err = decode(&[garbage]).unwrap_err();
        assert!(err.starts_with("resources[0]: cannot decode"), "{err}");
    }
}
