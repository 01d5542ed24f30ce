//! The caller's span, read from its request headers: W3C `traceparent`/`tracestate`, else B3
//! (single-header `b3`, else the `x-b3-*` headers). Headers are read through a lookup function,
//! so no transport's types appear here. Nothing is injected: sluice calls no one downstream.

use std::marker::PhantomData;

use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The context holding the caller's span, or an empty context when the headers name none.
pub(crate) fn parent<'a>(header: &impl Fn(&str) -> Option<&'a str>) -> Context {
    let w3c = TraceContextPropagator::new().extract(&Lookup(header, PhantomData));
    if w3c.span().span_context().is_valid() {
        return w3c;
    }
    let b3 = header("b3")
        .and_then(b3_single)
        .or_else(|| b3_multi(header));
    match b3 {
        Some(span) => Context::new().with_remote_span_context(span),
        None => Context::new(),
    }
}

struct Lookup<'f, 'a, F>(&'f F, PhantomData<&'a str>);

impl<'a, F: Fn(&str) -> Option<&'a str>> Extractor for Lookup<'_, 'a, F> {
    fn get(&self, key: &str) -> Option<&str> {
        (self.0)(key)
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}

/// A B3 trace id: 16 or 32 hex digits (a 64-bit id is the low half of a 128-bit one).
fn trace_id(hex: &str) -> Option<TraceId> {
    if !matches!(hex.len(), 16 | 32) || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let id = TraceId::from_hex(hex).ok()?;
    (id != TraceId::INVALID).then_some(id)
}

/// A B3 span id: 16 hex digits.
fn span_id(hex: &str) -> Option<SpanId> {
    if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let id = SpanId::from_hex(hex).ok()?;
    (id != SpanId::INVALID).then_some(id)
}

/// B3's sampling state: `1`/`true` or debug `d` sampled, `0`/`false` not; `None` for deferred.
fn sampled(flag: &str) -> Option<bool> {
    match flag {
        "1" | "d" | "true" => Some(true),
        "0" | "false" => Some(false),
        _ => None,
    }
}

fn remote(trace: TraceId, span: SpanId, sampled: bool) -> SpanContext {
    let flags = if sampled {
        TraceFlags::SAMPLED
    } else {
        TraceFlags::default()
    };
    SpanContext::new(trace, span, flags, true, TraceState::default())
}

/// `b3: {trace}-{span}[-{sampling}[-{parent}]]`; a bare sampling state carries no span.
fn b3_single(value: &str) -> Option<SpanContext> {
    let mut parts = value.trim().split('-');
    let trace = trace_id(parts.next()?)?;
    let span = span_id(parts.next()?)?;
    let sampled = parts.next().and_then(sampled).unwrap_or(false);
    Some(remote(trace, span, sampled))
}

/// `x-b3-traceid`, `x-b3-spanid`, and `x-b3-sampled` or `x-b3-flags: 1` (debug).
fn b3_multi<'a>(header: &impl Fn(&str) -> Option<&'a str>) -> Option<SpanContext> {
    let trace = trace_id(header("x-b3-traceid")?.trim())?;
    let span = span_id(header("x-b3-spanid")?.trim())?;
    let debug = header("x-b3-flags").is_some_and(|f| f.trim() == "1");
    let sampled = debug
        || header("x-b3-sampled")
            .and_then(|s| sampled(s.trim()))
            .unwrap_or(false);
    Some(remote(trace, span, sampled))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(headers: &[(&'static str, &'static str)]) -> SpanContext {
        let lookup = |name: &str| headers.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
        parent(&lookup).span().span_context().clone()
    }

    #[test]
    fn w3c_wins_then_single_b3_then_multi_b3() {
        let w3c = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let span = from(&[
            ("traceparent", w3c),
            ("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1"),
        ]);
        assert_eq!(
            span.trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(span.span_id().to_string(), "00f067aa0ba902b7");
        assert!(span.is_sampled() && span.is_remote());

        let span = from(&[
            (
                "b3",
                "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1-05e3ac9a4f6e3b90",
            ),
            ("x-b3-traceid", "463ac35c9f6413ad48485a3953bb6124"),
            ("x-b3-spanid", "a2fb4a1d1a96d312"),
        ]);
        assert_eq!(
            span.trace_id().to_string(),
            "80f198ee56343ba864fe8b2a57d3eff7"
        );
        assert_eq!(span.span_id().to_string(), "e457b5a2e4d86bd1");
        assert!(span.is_sampled());

        let span = from(&[
            ("x-b3-traceid", "463ac35c9f6413ad48485a3953bb6124"),
            ("x-b3-spanid", "a2fb4a1d1a96d312"),
            ("x-b3-sampled", "0"),
        ]);
        assert_eq!(
            span.trace_id().to_string(),
            "463ac35c9f6413ad48485a3953bb6124"
        );
        assert!(!span.is_sampled());
    }

    #[test]
    fn b3_64_bit_ids_debug_and_garbage() {
        let span = from(&[
            ("x-b3-traceid", "a3ce929d0e0e4736"),
            ("x-b3-spanid", "a2fb4a1d1a96d312"),
            ("x-b3-flags", "1"),
        ]);
        assert_eq!(
            span.trace_id().to_string(),
            "0000000000000000a3ce929d0e0e4736"
        );
        assert!(span.is_sampled());
        for bad in [
            "1",
            "0",
            "xyz-a2fb4a1d1a96d312",
            "a3ce929d0e0e4736-00000000000000000",
        ] {
            assert!(!from(&[("b3", bad)]).is_valid(), "{bad}");
        }
        assert!(!from(&[("traceparent", "00-zz-yy-01")]).is_valid());
        assert!(!from(&[]).is_valid());
    }
}
