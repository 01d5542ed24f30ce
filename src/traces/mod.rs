//! Traces: one OpenTelemetry span per decided call, its parent the caller's span (W3C or B3
//! headers, `propagation`), sampled parent-based with a ratio, exported over OTLP (gRPC through
//! tonic, or HTTP/protobuf through hyper) from a bounded queue that drops and counts rather than
//! waits (`export`). [`Traces::start`] builds it all; with tracing off nothing is built and a
//! call pays one `Option` check. It reads decisions; it decides nothing.

mod export;
mod propagation;

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::{
    Span as _, SpanKind, Status, TraceContextExt as _, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, KeyValue, Value};
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider, Span};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::decision::{Code, DecideError, Decision, Request};
use crate::metrics::TracingFigures;
use crate::telemetry::cut;

/// The OTLP transport.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Protocol {
    /// OTLP/gRPC (port 4317 by convention).
    #[default]
    Grpc,
    /// OTLP/HTTP with protobuf bodies (port 4318, path `/v1/traces`).
    Http,
}

/// Validated tracing settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The OTLP transport.
    pub protocol: Protocol,
    /// The collector's URL; for HTTP, `/v1/traces` is added when it has no path.
    pub endpoint: String,
    /// The resource's attributes, `service.name` among them.
    pub resource: Vec<(String, String)>,
    /// The share of new traces sampled (a caller's sampled span is always followed).
    pub sampling_ratio: f64,
    /// When set, descriptor entries go on spans, each value cut to this many bytes.
    pub descriptor_values: Option<usize>,
    /// Most spans waiting for export; past it spans are dropped and counted.
    pub queue_size: usize,
    /// Most spans in one export.
    pub batch_size: usize,
    /// Longest a span waits for its batch to fill.
    pub batch_delay: Duration,
    /// Longest one export may take.
    pub export_timeout: Duration,
    /// Longest shutdown waits for queued spans to be sent.
    pub shutdown_timeout: Duration,
}

/// Why tracing could not start.
#[derive(Debug, thiserror::Error)]
pub enum TracesError {
    /// The exporter could not be built (an endpoint that is not a URL, for one).
    #[error("tracing: cannot build the OTLP exporter for {endpoint}: {source}")]
    Exporter {
        /// The endpoint.
        endpoint: String,
        /// Why.
        source: opentelemetry_otlp::ExporterBuildError,
    },
}

/// Running trace export: the tracer the calls use, and the sending task.
#[derive(Debug)]
pub struct Traces {
    tracer: Arc<CallTracer>,
    provider: SdkTracerProvider,
    counters: Arc<export::Counters>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    shutdown_timeout: Duration,
}

impl Traces {
    /// Builds the exporter, the queue and its task (on the current tokio runtime). Nothing is
    /// connected yet: a collector that is down only makes exports fail later.
    ///
    /// # Errors
    ///
    /// [`TracesError::Exporter`] when the exporter cannot be built.
    pub fn start(config: &Config) -> Result<Self, TracesError> {
        let resource = Resource::builder_empty()
            .with_attributes(
                config
                    .resource
                    .iter()
                    .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
            )
            .build();
        let mut exporter = exporter(config)?;
        opentelemetry_sdk::trace::SpanExporter::set_resource(&mut exporter, &resource);
        let counters = Arc::new(export::Counters::default());
        let stop = CancellationToken::new();
        let batching = export::Batching {
            queue: config.queue_size,
            batch: config.batch_size,
            delay: config.batch_delay,
            timeout: config.export_timeout,
        };
        let (queue, task) = export::start(exporter, batching, Arc::clone(&counters), stop.clone());
        let ratio = Sampler::TraceIdRatioBased(config.sampling_ratio);
        let provider = SdkTracerProvider::builder()
            .with_span_processor(queue)
            .with_sampler(Sampler::ParentBased(Box::new(ratio)))
            .with_resource(resource)
            .build();
        let tracer = Arc::new(CallTracer {
            tracer: provider.tracer("sluice"),
            values: config.descriptor_values,
        });
        Ok(Self {
            tracer,
            provider,
            counters,
            stop,
            task,
            shutdown_timeout: config.shutdown_timeout,
        })
    }

    /// What the calls start their spans with.
    #[must_use]
    pub fn tracer(&self) -> Arc<CallTracer> {
        Arc::clone(&self.tracer)
    }

    /// A reader of what became of the spans, for metrics.
    #[must_use]
    pub fn figures(&self) -> TraceFigures {
        TraceFigures(Arc::clone(&self.counters))
    }

    /// Sends what is queued, for at most the configured shutdown timeout, then stops.
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.provider.shutdown();
        if tokio::time::timeout(self.shutdown_timeout, self.task)
            .await
            .is_err()
        {
            let left = self.counters.figures();
            tracing::warn!(
                timeout_ms = self.shutdown_timeout.as_millis(),
                exported = left.exported,
                "trace export did not finish within the shutdown timeout; queued spans dropped"
            );
        }
    }
}

/// A reader of what became of the spans, shared with the metrics endpoint.
#[derive(Clone, Debug)]
pub struct TraceFigures(Arc<export::Counters>);

impl TraceFigures {
    /// The figures now.
    #[must_use]
    pub fn read(&self) -> TracingFigures {
        self.0.figures()
    }
}

fn exporter(config: &Config) -> Result<opentelemetry_otlp::SpanExporter, TracesError> {
    let failed = |source| TracesError::Exporter {
        endpoint: config.endpoint.clone(),
        source,
    };
    match config.protocol {
        Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(config.endpoint.clone())
            .with_timeout(config.export_timeout)
            .build()
            .map_err(failed),
        Protocol::Http => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(http_endpoint(&config.endpoint))
            .with_timeout(config.export_timeout)
            .with_headers(std::collections::HashMap::new())
            .build()
            .map_err(failed),
    }
}

/// An OTLP/HTTP endpoint with the traces path when it names none.
fn http_endpoint(endpoint: &str) -> String {
    let after_scheme = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest);
    match after_scheme.find('/') {
        Some(at) if after_scheme.len() > at + 1 => endpoint.to_owned(),
        _ => format!("{}/v1/traces", endpoint.trim_end_matches('/')),
    }
}

/// Starts the spans of calls.
#[derive(Debug)]
pub struct CallTracer {
    tracer: SdkTracer,
    values: Option<usize>,
}

impl CallTracer {
    /// A server span named `method`, child of the caller's span as `header` (a lookup of the
    /// request's headers by lowercase name) names it. Boxed: a call's future holds it, and
    /// with tracing off holds only the empty pointer.
    pub fn start<'a>(
        &self,
        method: &'static str,
        header: impl Fn(&str) -> Option<&'a str>,
    ) -> Box<CallSpan> {
        let parent = propagation::parent(&header);
        let span = self
            .tracer
            .span_builder(method)
            .with_kind(SpanKind::Server)
            .start_with_context(&self.tracer, &parent);
        let tracer = span.is_recording().then(|| self.tracer.clone());
        Box::new(CallSpan {
            span,
            values: self.values,
            tracer,
        })
    }
}

/// The name of the child span of a call's wait on a Redis round trip.
pub const REDIS_ROUND_TRIP: &str = "Redis round trip";

/// One call's span; it ends when dropped.
#[derive(Debug)]
pub struct CallSpan {
    span: Span,
    values: Option<usize>,
    /// For the child spans of a sampled call.
    tracer: Option<SdkTracer>,
}

impl CallSpan {
    /// Records what the request asks.
    pub fn request(&mut self, req: &Request) {
        if !self.span.is_recording() {
            return;
        }
        let overridden = req.descriptors.iter().any(|d| d.limit.is_some());
        let addend = req.hits_addend > 1 || req.descriptors.iter().any(|d| d.hits_addend.is_some());
        self.span.set_attributes([
            KeyValue::new("ratelimit.domain", req.domain.clone()),
            KeyValue::new("ratelimit.descriptors", req.descriptors.len() as i64),
            KeyValue::new("ratelimit.override", overridden),
            KeyValue::new("ratelimit.hits_addend", addend),
        ]);
        if let Some(cap) = self.values {
            for (i, d) in req.descriptors.iter().enumerate() {
                let entries: Vec<String> = d
                    .entries
                    .iter()
                    .map(|e| format!("{}={}", e.key, cut(&e.value, cap)))
                    .collect();
                self.span.set_attribute(KeyValue::new(
                    format!("ratelimit.descriptor.{i}"),
                    Value::from(entries.join(",")),
                ));
            }
        }
    }

    /// Records the answer.
    pub fn decided(&mut self, decision: &Decision) {
        if !self.span.is_recording() {
            return;
        }
        let code = match decision.overall {
            Code::Ok => "OK",
            Code::OverLimit => "OVER_LIMIT",
        };
        self.span
            .set_attributes([KeyValue::new("ratelimit.overall_code", code)]);
        let Some(trace) = &decision.trace else {
            return;
        };
        self.span.set_attribute(KeyValue::new(
            "ratelimit.backend",
            trace.answered_by.as_str(),
        ));
        if let (Some(tracer), Some((start, end))) = (&self.tracer, trace.redis_round_trip) {
            let parent = Context::new().with_remote_span_context(self.span.span_context().clone());
            let mut child = tracer
                .span_builder(REDIS_ROUND_TRIP)
                .with_kind(SpanKind::Client)
                .with_start_time(start)
                .with_attributes([KeyValue::new("db.system", "redis")])
                .start_with_context(tracer, &parent);
            child.end_with_timestamp(end);
        }
    }

    /// Records a call that got no decision.
    pub fn failed(&mut self, error: &DecideError) {
        self.failed_with(error.to_string());
    }

    /// Records a call refused before it could be decided (framing, decoding).
    pub fn failed_with(&mut self, description: String) {
        if self.span.is_recording() {
            self.span.set_status(Status::error(description));
        }
    }

    /// Records the gRPC status code the call ended with.
    pub fn grpc_status(&mut self, code: i32) {
        if self.span.is_recording() {
            self.span
                .set_attribute(KeyValue::new("rpc.grpc.status_code", i64::from(code)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_endpoints_get_the_traces_path_when_they_have_none() {
        assert_eq!(http_endpoint("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(http_endpoint("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            http_endpoint("http://c:4318/custom"),
            "http://c:4318/custom"
        );
    }
}
