//! The response's dynamic metadata, in envoyproxy/ratelimit's shape (its
//! `RESPONSE_DYNAMIC_METADATA`), as JSON values; Envoy's rate-limit filter puts it under its own
//! namespace, `envoy.filters.http.ratelimit`. The transport adapters turn it into a
//! `google.protobuf.Struct` (gRPC) or write it as it is (`/json`). It is built only when the
//! setting is on: off, a decision costs nothing more.

use serde_json::{Map, Value, json};

use super::request::Request;
use crate::policy::Metadata;

/// The dynamic metadata of `req`, with `passed` the `metadata` of each descriptor whose
/// counted rule passed (`None` for the others), in descriptor order:
///
/// ```text
/// domain:      the request's domain
/// descriptors: one per request descriptor, in order:
///              entries:    ["key=value", ...]
///              limit:      the request's override as protobuf text, e.g.
///                          "requests_per_unit:10 unit:MINUTE" (only when it has one)
///              hitsAddend: the descriptor's own hits_addend (only when set, 0 included)
/// hitsAddend:  the request's hits_addend (only when not 0)
/// metadata:    the `metadata` maps of the rules whose descriptors passed, merged in
///              descriptor order: nested maps are merged, otherwise the first value wins
///              (only when not empty)
/// ```
///
/// "Passed" is the reference's: a descriptor a rule was counted for whose status is OK. A
/// shadow-mode rule's status is OK even over its limit, so it passes; over the limit under
/// global shadow mode or in quota mode the status stays OVER_LIMIT, so it does not. A
/// descriptor with no rule, an unlimited or replaced rule, or a request's override brings no
/// `metadata`.
pub(super) fn build<'m>(
    req: &Request,
    passed: impl IntoIterator<Item = Option<&'m Metadata>>,
) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert("domain".into(), json!(req.domain));
    let descriptors = req
        .descriptors
        .iter()
        .map(|d| {
            let mut o = Map::new();
            let entries: Vec<Value> = d
                .entries
                .iter()
                .map(|e| Value::String(format!("{}={}", e.key, e.value)))
                .collect();
            o.insert("entries".into(), Value::Array(entries));
            if let Some(ov) = d.limit {
                // Protobuf text of the RateLimitOverride, zero fields left out.
                let mut text = String::new();
                if ov.requests_per_unit != 0 {
                    text = format!("requests_per_unit:{} ", ov.requests_per_unit);
                }
                text.push_str("unit:");
                text.push_str(ov.unit.name());
                o.insert("limit".into(), Value::String(text));
            }
            if let Some(n) = d.hits_addend {
                o.insert("hitsAddend".into(), json!(n));
            }
            Value::Object(o)
        })
        .collect();
    out.insert("descriptors".into(), Value::Array(descriptors));
    if req.hits_addend != 0 {
        out.insert("hitsAddend".into(), json!(req.hits_addend));
    }
    let mut merged = Map::new();
    for m in passed.into_iter().flatten() {
        merge(&mut merged, m);
    }
    if !merged.is_empty() {
        out.insert("metadata".into(), Value::Object(merged));
    }
    out
}

/// Merges `src` into `dest`: a key new to `dest` is added; where both hold a map, the maps are
/// merged; otherwise `dest`'s (the first) value stays.
fn merge(dest: &mut Map<String, Value>, src: &Map<String, Value>) {
    for (k, v) in src {
        match (dest.get_mut(k), v) {
            (None, _) => {
                dest.insert(k.clone(), v.clone());
            }
            (Some(Value::Object(d)), Value::Object(s)) => merge(d, s),
            (Some(_), _) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{Descriptor, Entry, Override};
    use crate::policy::Unit;

    fn map(v: Value) -> Metadata {
        match v {
            Value::Object(m) => m,
            _ => unreachable!("a map"),
        }
    }

    #[test]
    fn the_shape_and_the_optional_fields() {
        let mut req = Request::from_entries("d", &[&[("a", "1"), ("b", "")], &[("c", "x")]]);
        req.descriptors[1].limit = Some(Override {
            requests_per_unit: 10,
            unit: Unit::Minute,
        });
        req.descriptors[1].hits_addend = Some(0);
        req.descriptors.push(Descriptor {
            entries: vec![Entry {
                key: "k".into(),
                value: "v".into(),
            }],
            limit: Some(Override {
                requests_per_unit: 0,
                unit: Unit::Week,
            }),
            ..Descriptor::default()
        });
        assert_eq!(
            Value::Object(build(&req, [None, None, None])),
            json!({
                "domain": "d",
                "descriptors": [
                    {"entries": ["a=1", "b="]},
                    {"entries": ["c=x"], "limit": "requests_per_unit:10 unit:MINUTE", "hitsAddend": 0},
                    {"entries": ["k=v"], "limit": "unit:WEEK"},
                ],
            })
        );
        // The request's hits_addend only when not 0.
        req.hits_addend = 3;
        assert_eq!(build(&req, []).get("hitsAddend"), Some(&json!(3)));
    }

    #[test]
    fn metadata_merges_with_the_first_value_winning() {
        let req = Request::from_entries("d", &[&[("a", "1")], &[("b", "2")], &[("c", "3")]]);
        let first = map(json!({"name": "one", "nested": {"x": 1, "list": [1]}, "n": 1}));
        let second = map(
            json!({"name": "two", "nested": {"x": 2, "y": 2, "list": [2]}, "n": {"deep": true}, "other": null}),
        );
        let out = build(&req, [Some(&first), None, Some(&second)]);
        assert_eq!(
            out["metadata"],
            json!({"name": "one", "nested": {"x": 1, "y": 2, "list": [1]}, "n": 1, "other": null})
        );
        // Nothing passed with metadata: no `metadata` key at all.
        assert!(!build(&req, [None, None, None]).contains_key("metadata"));
        let empty = Metadata::new();
        assert!(!build(&req, [Some(&empty)]).contains_key("metadata"));
    }
}
