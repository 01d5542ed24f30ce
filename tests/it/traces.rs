//! Traces against a real OTLP receiver (the collector's `TraceService`, served by tonic on
//! 127.0.0.1:0, or its OTLP/HTTP route `POST /v1/traces`, served by axum): a span per gRPC and
//! `/json` call joined to the caller's W3C or B3 trace, its attributes and resource, a child
//! span for a call's wait on a Redis round trip, parent-based sampling at ratios 0 and 1, the
//! reference's `TRACING_*` variables on the real binary, and a dead collector (refusing or
//! silent) that makes 2,000 calls no slower than without tracing while its drops are counted.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use sluice::settings::{BackendKind, Written};

use crate::helpers::redis::RedisProcess;
use crate::helpers::{
    TestServer, eventually, free_port, http_raw_with, metric, redis_missing, single,
};

const POLICY: &str = r#"
domain: traced
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1000}
"#;

/// A span as received, with its resource's attributes.
#[derive(Clone, Debug)]
struct Received {
    span: Span,
    resource: Vec<KeyValue>,
}

#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<Received>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.record(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Receiver {
    fn record(&self, request: ExportTraceServiceRequest) {
        let mut spans = self.0.lock().unwrap();
        for rs in request.resource_spans {
            let resource = rs.resource.map(|r| r.attributes).unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    spans.push(Received {
                        span,
                        resource: resource.clone(),
                    });
                }
            }
        }
    }

    /// Serves OTLP/HTTP (`POST /v1/traces`, protobuf bodies) on 127.0.0.1:0; returns its URL.
    async fn start_http(&self) -> String {
        use axum::http::{StatusCode, header};
        use prost::Message as _;
        async fn export(
            axum::extract::State(receiver): axum::extract::State<Receiver>,
            headers: axum::http::HeaderMap,
            body: axum::body::Bytes,
        ) -> (StatusCode, [(header::HeaderName, &'static str); 1], Vec<u8>) {
            let protobuf = headers
                .get(header::CONTENT_TYPE)
                .is_some_and(|v| v == "application/x-protobuf");
            match ExportTraceServiceRequest::decode(body) {
                Ok(request) if protobuf => {
                    receiver.record(request);
                    let answer = ExportTraceServiceResponse::default().encode_to_vec();
                    (
                        StatusCode::OK,
                        [(header::CONTENT_TYPE, "application/x-protobuf")],
                        answer,
                    )
                }
                _ => (
                    StatusCode::BAD_REQUEST,
                    [(header::CONTENT_TYPE, "text/plain")],
                    Vec::new(),
                ),
            }
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new()
            .route("/v1/traces", axum::routing::post(export))
            .with_state(self.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}")
    }

    /// Serves on `listener` until `stop` fires; then ends its connections.
    fn serve_until(
        &self,
        listener: tokio::net::TcpListener,
        stop: tokio::sync::oneshot::Receiver<()>,
    ) -> tokio::task::JoinHandle<()> {
        let service = TraceServiceServer::new(self.clone());
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener),
                    async {
                        let _ = stop.await;
                    },
                )
                .await;
        })
    }

    /// Serves on 127.0.0.1:0; returns its URL.
    async fn start(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = TraceServiceServer::new(self.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        format!("http://{addr}")
    }

    fn spans(&self) -> Vec<Received> {
        self.0.lock().unwrap().clone()
    }

    async fn wait_for(&self, n: usize) -> Vec<Received> {
        let arrived = eventually(Duration::from_secs(10), || async {
            self.spans().len() >= n
        })
        .await;
        assert!(arrived, "{n} spans expected, got {}", self.spans().len());
        self.spans()
    }
}

fn traced(endpoint: &str, ratio: f64) -> impl FnOnce(&mut Written) + use<> {
    let endpoint = endpoint.to_owned();
    move |s: &mut Written| {
        s.tracing.enabled = true;
        s.tracing.endpoint = endpoint;
        s.tracing.service_name = "edge-rls".into();
        s.tracing.sampling_ratio = ratio;
        s.tracing.batch_delay_ms = 20;
    }
}

async fn call_with(s: &TestServer, headers: &[(&'static str, &str)]) {
    let mut req = tonic::Request::new(single("traced", "k", "v"));
    for (name, value) in headers {
        req.metadata_mut().insert(*name, value.parse().unwrap());
    }
    s.client.clone().should_rate_limit(req).await.unwrap();
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

fn string(attrs: &[KeyValue], key: &str) -> Option<String> {
    match attr(attrs, key)? {
        Value::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

/// A `ShouldRateLimit` span in the trace of the caller's `traceparent`, its span the parent.
fn assert_is_the_callers_call(span: &Span) {
    assert_eq!(span.name, "ShouldRateLimit");
    assert_eq!(hex(&span.trace_id), TRACE);
    assert_eq!(hex(&span.parent_span_id), PARENT);
}

#[tokio::test]
async fn a_call_with_a_traceparent_is_a_span_of_the_callers_trace() {
    let receiver = Receiver::default();
    let endpoint = receiver.start().await;
    let s = TestServer::start_with(&[("p.yaml", POLICY)], traced(&endpoint, 1.0)).await;
    call_with(&s, &[("traceparent", &format!("00-{TRACE}-{PARENT}-01"))]).await;
    let got = receiver.wait_for(1).await;
    let Received { span, resource } = &got[0];
    assert_is_the_callers_call(span);
    assert_eq!(
        string(&span.attributes, "ratelimit.domain").as_deref(),
        Some("traced")
    );
    assert_eq!(
        string(&span.attributes, "ratelimit.overall_code").as_deref(),
        Some("OK")
    );
    assert_eq!(
        string(&span.attributes, "ratelimit.backend").as_deref(),
        Some("memory")
    );
    assert!(matches!(
        attr(&span.attributes, "ratelimit.descriptors"),
        Some(Value::IntValue(1))
    ));
    assert!(matches!(
        attr(&span.attributes, "ratelimit.override"),
        Some(Value::BoolValue(false))
    ));
    // Descriptor values stay off spans unless asked for.
    assert!(attr(&span.attributes, "ratelimit.descriptor.0").is_none());
    assert_eq!(
        string(resource, "service.name").as_deref(),
        Some("edge-rls")
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn a_json_call_with_a_traceparent_is_a_span_of_the_callers_trace() {
    let receiver = Receiver::default();
    let endpoint = receiver.start().await;
    let s = TestServer::start_with(&[("p.yaml", POLICY)], traced(&endpoint, 0.0)).await;
    let parent = format!("00-{TRACE}-{PARENT}-01");
    let body = r#"{"domain":"traced","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#;
    let answer = http_raw_with(s.admin, "POST", "/json", &[("traceparent", &parent)], body).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    // A body that is not a request: a span all the same, its status the error.
    let answer = http_raw_with(s.admin, "POST", "/json", &[("traceparent", &parent)], "{").await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let got = receiver.wait_for(2).await;
    for Received { span, .. } in &got {
        assert_eq!(span.name, "POST /json");
        assert_eq!(hex(&span.trace_id), TRACE);
        assert_eq!(hex(&span.parent_span_id), PARENT);
        assert_eq!(span.kind, SpanKind::Server as i32);
    }
    let (decided, refused): (Vec<_>, Vec<_>) = got.iter().map(|r| &r.span).partition(|span| {
        span.status
            .as_ref()
            .is_none_or(|st| st.code != StatusCode::Error as i32)
    });
    let ([decided], [refused]) = (&decided[..], &refused[..]) else {
        panic!("one decided and one refused span: {got:?}");
    };
    assert_eq!(
        string(&decided.attributes, "ratelimit.domain").as_deref(),
        Some("traced")
    );
    assert_eq!(
        string(&decided.attributes, "ratelimit.overall_code").as_deref(),
        Some("OK")
    );
    assert_eq!(
        string(&decided.attributes, "ratelimit.backend").as_deref(),
        Some("memory")
    );
    assert!(matches!(
        attr(&decided.attributes, "ratelimit.descriptors"),
        Some(Value::IntValue(1))
    ));
    assert!(attr(&refused.attributes, "ratelimit.overall_code").is_none());
    assert!(
        !refused.status.as_ref().unwrap().message.is_empty(),
        "{refused:?}"
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn the_references_tracing_variables_send_spans_with_its_resource() {
    let receiver = Receiver::default();
    let endpoint = receiver.start().await;
    let dir = tempfile::tempdir().unwrap();
    let current = dir.path().join("current");
    let config = current.join("ratelimit").join("config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(config.join("traced"), POLICY).unwrap();
    let mut vars = crate::compat::reference_env(&current);
    vars.extend([
        ("TRACING_ENABLED", "true"),
        ("TRACING_EXPORTER_PROTOCOL", "grpc"),
        ("TRACING_SERVICE_NAME", "edge-rls"),
        ("TRACING_SERVICE_NAMESPACE", "edge"),
        ("TRACING_SERVICE_INSTANCE_ID", "pod 7"),
        ("TRACING_SAMPLING_RATE", "0"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
    ]);
    let server = crate::compat::spawn(&vars);
    let mut client = sluice::pb::rate_limit_service_client::RateLimitServiceClient::connect(
        format!("http://{}", server.grpc),
    )
    .await
    .unwrap();
    // Sampling rate 0: only a sampled caller's span is followed.
    client
        .should_rate_limit(single("traced", "k", "v"))
        .await
        .unwrap();
    let mut req = tonic::Request::new(single("traced", "k", "v"));
    let parent = format!("00-{TRACE}-{PARENT}-01");
    req.metadata_mut()
        .insert("traceparent", parent.parse().unwrap());
    client.should_rate_limit(req).await.unwrap();
    let got = receiver.wait_for(1).await;
    let Received { span, resource } = &got[0];
    assert_eq!(span.name, "ShouldRateLimit");
    assert_eq!(hex(&span.trace_id), TRACE);
    assert_eq!(
        string(&span.attributes, "ratelimit.domain").as_deref(),
        Some("traced")
    );
    assert_eq!(
        string(resource, "service.name").as_deref(),
        Some("edge-rls")
    );
    assert_eq!(
        string(resource, "service.namespace").as_deref(),
        Some("edge")
    );
    assert_eq!(
        string(resource, "service.instance.id").as_deref(),
        Some("pod 7")
    );
    // The unsampled call came first; what was sampled before the sampled one went with it.
    assert_eq!(receiver.spans().len(), 1, "{got:?}");
    let exported = eventually(Duration::from_secs(10), || async {
        metric(server.admin, "sluice_tracing_spans_exported_total").await == Some(1.0)
    })
    .await;
    assert!(
        exported,
        "{}",
        crate::helpers::http_get(server.admin, "/metrics").await.1
    );
}

#[tokio::test]
async fn http_protobuf_export_reaches_an_otlp_http_receiver() {
    let receiver = Receiver::default();
    let endpoint = receiver.start_http().await;
    let s = TestServer::start_with(&[("p.yaml", POLICY)], |w| {
        traced(&endpoint, 1.0)(w);
        w.tracing.protocol = sluice::traces::Protocol::Http;
    })
    .await;
    call_with(&s, &[("traceparent", &format!("00-{TRACE}-{PARENT}-01"))]).await;
    let got = receiver.wait_for(1).await;
    let Received { span, resource } = &got[0];
    assert_is_the_callers_call(span);
    assert_eq!(
        string(&span.attributes, "ratelimit.overall_code").as_deref(),
        Some("OK")
    );
    assert_eq!(
        string(resource, "service.name").as_deref(),
        Some("edge-rls")
    );
    let exported = eventually(Duration::from_secs(10), || async {
        metric(s.admin, "sluice_tracing_spans_exported_total").await == Some(1.0)
    })
    .await;
    assert!(
        exported,
        "{}",
        crate::helpers::http_get(s.admin, "/metrics").await.1
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn b3_single_and_multi_header_join_the_callers_trace() {
    let receiver = Receiver::default();
    let endpoint = receiver.start().await;
    let s = TestServer::start_with(&[("p.yaml", POLICY)], |w| {
        traced(&endpoint, 0.0)(w);
        w.tracing.descriptor_values = true;
        w.tracing.max_value_bytes = 1;
    })
    .await;
    call_with(
        &s,
        &[("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1")],
    )
    .await;
    call_with(
        &s,
        &[
            ("x-b3-traceid", "463ac35c9f6413ad48485a3953bb6124"),
            ("x-b3-spanid", "a2fb4a1d1a96d312"),
            ("x-b3-sampled", "1"),
        ],
    )
    .await;
    let got = receiver.wait_for(2).await;
    let ids: Vec<(String, String)> = got
        .iter()
        .map(|r| (hex(&r.span.trace_id), hex(&r.span.parent_span_id)))
        .collect();
    assert!(
        ids.contains(&(
            "80f198ee56343ba864fe8b2a57d3eff7".into(),
            "e457b5a2e4d86bd1".into()
        )),
        "{ids:?}"
    );
    assert!(
        ids.contains(&(
            "463ac35c9f6413ad48485a3953bb6124".into(),
            "a2fb4a1d1a96d312".into()
        )),
        "{ids:?}"
    );
    // With descriptor values on, each value is cut at max_value_bytes.
    assert_eq!(
        string(&got[0].span.attributes, "ratelimit.descriptor.0").as_deref(),
        Some("k=v")
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn ratio_0_samples_no_new_trace_but_follows_a_sampled_parent() {
    let receiver = Receiver::default();
    let endpoint = receiver.start().await;
    let s = TestServer::start_with(&[("p.yaml", POLICY)], traced(&endpoint, 0.0)).await;
    for _ in 0..5 {
        call_with(&s, &[]).await;
    }
    // An unsampled parent is not followed either.
    call_with(&s, &[("traceparent", &format!("00-{TRACE}-{PARENT}-00"))]).await;
    call_with(&s, &[("traceparent", &format!("00-{TRACE}-{PARENT}-01"))]).await;
    let got = receiver.wait_for(1).await;
    // The sampled call came last; what was sampled before it has been sent with it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(receiver.spans().len(), 1, "{got:?}");
    assert_eq!(hex(&got[0].span.trace_id), TRACE);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn ratio_1_sends_one_span_per_call() {
    let receiver = Receiver::default();
    let endpoint = receiver.start().await;
    let s = TestServer::start_with(&[("p.yaml", POLICY)], traced(&endpoint, 1.0)).await;
    for _ in 0..20 {
        call_with(&s, &[]).await;
    }
    let got = receiver.wait_for(20).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(receiver.spans().len(), 20);
    let traces: std::collections::HashSet<_> =
        got.iter().map(|r| r.span.trace_id.clone()).collect();
    assert_eq!(
        traces.len(),
        20,
        "untraced calls are each a trace of their own"
    );
    let exported = metric(s.admin, "sluice_tracing_spans_exported_total").await;
    assert_eq!(exported, Some(20.0));
    s.stop().await.unwrap();
}

/// Calls `ShouldRateLimit` `n` times, one after another; how long that took and the slowest.
async fn timed_calls(s: &TestServer, n: usize) -> (Duration, Duration) {
    let mut client = s.client.clone();
    let mut slowest = Duration::ZERO;
    let start = Instant::now();
    for _ in 0..n {
        let call = Instant::now();
        let answer = client.should_rate_limit(single("traced", "k", "v")).await;
        slowest = slowest.max(call.elapsed());
        assert!(answer.is_ok(), "{answer:?}");
    }
    (start.elapsed(), slowest)
}

/// 2,000 calls to a server whose collector at `dead` never takes a span, against 2,000 to one
/// without tracing, in alternating rounds so both see the same machine: as fast within the
/// noise (a call that waited on the collector would cost at least a connection attempt, and
/// the queue's drops are counted), and a stop that does not wait for the collector either.
async fn a_dead_collector_costs_no_time(dead: &str) {
    let traced_server = TestServer::start_with(&[("p.yaml", POLICY)], |w| {
        traced(dead, 1.0)(w);
        w.tracing.queue_size = 8;
        w.tracing.batch_size = 4;
        w.tracing.export_timeout_ms = 200;
        w.tracing.shutdown_timeout_ms = 300;
    })
    .await;
    let plain = TestServer::start(&[("p.yaml", POLICY)]).await;
    // Both connections warmed before the clock starts.
    timed_calls(&plain, 50).await;
    timed_calls(&traced_server, 50).await;
    let (mut with, mut without, mut slowest) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for _ in 0..4 {
        let (took, _) = timed_calls(&plain, 500).await;
        without += took;
        let (took, slow) = timed_calls(&traced_server, 500).await;
        with += took;
        slowest = slowest.max(slow);
    }
    assert!(
        with <= without * 3 / 2 + Duration::from_millis(200),
        "2,000 calls took {with:?} with tracing to a dead collector, {without:?} without"
    );
    assert!(
        slowest < Duration::from_millis(500),
        "slowest traced call took {slowest:?}"
    );
    let s = traced_server;
    let counted = eventually(Duration::from_secs(10), || async {
        let full = metric(
            s.admin,
            "sluice_tracing_spans_dropped_total{reason=\"queue_full\"}",
        )
        .await;
        let failed = metric(
            s.admin,
            "sluice_tracing_spans_dropped_total{reason=\"export_failed\"}",
        )
        .await;
        full.unwrap_or(0.0) > 0.0 && failed.unwrap_or(0.0) > 0.0
    })
    .await;
    assert!(
        counted,
        "{}",
        crate::helpers::http_get(s.admin, "/metrics").await.1
    );
    assert_eq!(
        metric(s.admin, "sluice_tracing_spans_exported_total").await,
        Some(0.0)
    );
    let stopping = Instant::now();
    s.stop().await.unwrap();
    assert!(
        stopping.elapsed() < Duration::from_secs(3),
        "stop took {:?}",
        stopping.elapsed()
    );
    plain.stop().await.unwrap();
}

/// A collector that comes and goes (up 1 s, down 1 s, for 6 s) while calls go on: every call
/// is answered and none waits on it, spans are exported while it is up and the ones it cannot
/// take are counted as dropped, and the server still stops at once.
#[tokio::test]
async fn a_collector_that_flaps_delays_no_answer() {
    let port = free_port();
    let receiver = Receiver::default();
    let endpoint = format!("http://127.0.0.1:{port}");
    let s = TestServer::start_with(&[("p.yaml", POLICY)], |w| {
        traced(&endpoint, 1.0)(w);
        w.tracing.export_timeout_ms = 200;
        w.tracing.shutdown_timeout_ms = 300;
    })
    .await;
    timed_calls(&s, 20).await;
    let (mut calls, mut slowest) = (0, Duration::ZERO);
    for _ in 0..3 {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("the collector's port again");
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let up = receiver.serve_until(listener, stopped);
        let until = Instant::now() + Duration::from_secs(1);
        while Instant::now() < until {
            let (_, slow) = timed_calls(&s, 20).await;
            (calls, slowest) = (calls + 20, slowest.max(slow));
        }
        let _ = stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(2), up).await;
        let until = Instant::now() + Duration::from_secs(1);
        while Instant::now() < until {
            let (_, slow) = timed_calls(&s, 20).await;
            (calls, slowest) = (calls + 20, slowest.max(slow));
        }
    }
    assert!(
        slowest < Duration::from_millis(500),
        "the slowest of {calls} calls took {slowest:?}"
    );
    let exported = metric(s.admin, "sluice_tracing_spans_exported_total").await;
    assert!(
        exported.unwrap_or(0.0) > 0.0,
        "exported while up: {exported:?}"
    );
    assert!(!receiver.spans().is_empty(), "the collector received spans");
    let dropped = eventually(Duration::from_secs(10), || async {
        metric(
            s.admin,
            "sluice_tracing_spans_dropped_total{reason=\"export_failed\"}",
        )
        .await
        .unwrap_or(0.0)
            > 0.0
    })
    .await;
    assert!(
        dropped,
        "the spans of the down seconds are counted as dropped"
    );
    let stopping = Instant::now();
    s.stop().await.unwrap();
    assert!(
        stopping.elapsed() < Duration::from_secs(3),
        "stop took {:?}",
        stopping.elapsed()
    );
}

#[tokio::test]
async fn a_refusing_collector_delays_no_answer_and_its_drops_are_counted() {
    a_dead_collector_costs_no_time(&format!("http://127.0.0.1:{}", free_port())).await;
}

#[tokio::test]
async fn a_silent_collector_delays_no_answer_and_its_drops_are_counted() {
    // Connections are taken by the kernel and never answered: every export runs to its timeout.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", silent.local_addr().unwrap());
    a_dead_collector_costs_no_time(&dead).await;
    drop(silent);
}

#[tokio::test]
async fn a_call_that_waits_on_redis_has_a_child_span_for_the_round_trip() {
    if redis_missing("a_call_that_waits_on_redis_has_a_child_span_for_the_round_trip") {
        return;
    }
    let redis = RedisProcess::start();
    let url = redis.url();
    let receiver = Receiver::default();
    let endpoint = receiver.start().await;
    let trace = traced(&endpoint, 1.0);
    let s = TestServer::start_with(&[("p.yaml", POLICY)], move |w| {
        trace(w);
        w.backend = BackendKind::Redis;
        w.redis.url = url;
    })
    .await;
    assert!(
        eventually(Duration::from_secs(5), || {
            let call = s.call(single("traced", "k", "warm-up"));
            async move { call.await.is_ok() }
        })
        .await,
        "redis never connected"
    );
    call_with(&s, &[("traceparent", &format!("00-{TRACE}-{PARENT}-01"))]).await;
    let ours = || -> Vec<Span> {
        receiver
            .spans()
            .into_iter()
            .map(|r| r.span)
            .filter(|span| hex(&span.trace_id) == TRACE)
            .collect()
    };
    assert!(
        eventually(Duration::from_secs(10), || async { ours().len() >= 2 }).await,
        "{:?}",
        ours()
    );
    let spans = ours();
    let call = spans.iter().find(|s| s.name == "ShouldRateLimit").unwrap();
    let trip = spans.iter().find(|s| s.name == "Redis round trip").unwrap();
    assert_eq!(hex(&call.parent_span_id), PARENT);
    assert_eq!(trip.parent_span_id, call.span_id);
    assert_eq!(
        string(&trip.attributes, "db.system").as_deref(),
        Some("redis")
    );
    assert_eq!(
        string(&call.attributes, "ratelimit.backend").as_deref(),
        Some("redis")
    );
    // The wait lies within the call.
    assert!(call.start_time_unix_nano <= trip.start_time_unix_nano);
    assert!(trip.start_time_unix_nano <= trip.end_time_unix_nano);
    assert!(trip.end_time_unix_nano <= call.end_time_unix_nano);
    s.stop().await.unwrap();
}
