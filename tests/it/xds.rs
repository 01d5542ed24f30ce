//! Policies pushed over xDS: a management server in the test shaped like Envoy Gateway's (ADS,
//! state of the world; only node id `envoy-ratelimit` is answered; versions from a counter, a
//! nonce per response; a fresh wildcard stream gets the snapshot; nothing while it is empty)
//! drives the app with Envoy Gateway's descriptor trees, and the binary started as Envoy
//! Gateway's Deployment (`deploy/envoy-gateway/ratelimit-deployment.yaml`) starts it. Then the
//! broken and hostile servers: an oversized response, another type, a silent server, a flood of
//! versions.

use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::Stream;
use prost::Message;
use sluice::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use sluice::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use sluice::pb::rate_limit_response::Code;
use sluice::pb::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use sluice::pb::{RateLimitRequest, RateLimitResponse};
use sluice::settings::{PolicySource, Written};
use tokio::sync::{mpsc, watch};
use tonic::{Request, Response, Status, Streaming};

use crate::helpers::{TestServer, descriptor, eventually, http_get, openssl, request};

/// Envoy Gateway's node id for its rate-limit service.
const NODE_ID: &str = "envoy-ratelimit";
const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";
const ROUTE: &str = "httproute/default/r/rule/0/match/0/x";
const DOMAIN: &str = "default/eg/http";
const WITHIN: Duration = Duration::from_secs(10);

/// What the server holds: a version (from a counter) and the response's resources.
#[derive(Clone, Debug, Default)]
struct Snapshot {
    version: String,
    type_url: String,
    resources: Vec<prost_types::Any>,
}

/// The management server's state, shared by its streams and the test.
#[derive(Clone)]
struct Control {
    snapshot: Arc<watch::Sender<Option<Snapshot>>>,
    counter: Arc<Mutex<u64>>,
    nonces: Arc<Mutex<u64>>,
    /// Every request of every stream, in arrival order, with its stream's number and headers.
    seen: Arc<Mutex<Vec<(usize, DiscoveryRequest, tonic::metadata::MetadataMap)>>>,
    streams: Arc<Mutex<usize>>,
}

impl Control {
    fn new() -> Self {
        Self {
            snapshot: Arc::new(watch::channel(None).0),
            counter: Arc::new(Mutex::new(0)),
            nonces: Arc::new(Mutex::new(0)),
            seen: Arc::new(Mutex::new(Vec::new())),
            streams: Arc::new(Mutex::new(0)),
        }
    }

    /// A new snapshot of `configs`; its version.
    fn set(&self, configs: &[RateLimitConfig]) -> String {
        self.set_raw(TYPE_URL, configs.iter().map(any).collect())
    }

    /// A new snapshot of raw resources in a response of `type_url`; its version.
    fn set_raw(&self, type_url: &str, resources: Vec<prost_types::Any>) -> String {
        let version = {
            let mut c = self.counter.lock().unwrap();
            *c += 1;
            c.to_string()
        };
        self.snapshot.send_replace(Some(Snapshot {
            version: version.clone(),
            type_url: type_url.into(),
            resources,
        }));
        version
    }

    fn requests(&self) -> Vec<(usize, DiscoveryRequest)> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .map(|(s, r, _)| (*s, r.clone()))
            .collect()
    }

    fn streams(&self) -> usize {
        *self.streams.lock().unwrap()
    }

    /// Waits for a request that `matches`; the first one.
    async fn wait_for(&self, matches: impl Fn(&DiscoveryRequest) -> bool) -> DiscoveryRequest {
        let mut found = None;
        let ok = eventually(WITHIN, || {
            found = self.requests().into_iter().map(|(_, r)| r).find(&matches);
            let ok = found.is_some();
            async move { ok }
        })
        .await;
        assert!(ok, "no such request; seen: {:#?}", self.requests());
        found.unwrap()
    }

    /// Waits for the ACK of `version`: that version, no error detail, and the nonce of a
    /// response that carried it.
    async fn acked(&self, version: &str) -> DiscoveryRequest {
        let ack = self
            .wait_for(|r| {
                r.version_info == version
                    && r.error_detail.is_none()
                    && !r.response_nonce.is_empty()
            })
            .await;
        assert_eq!(ack.type_url, TYPE_URL);
        assert!(ack.resource_names.is_empty(), "a wildcard subscription");
        ack
    }

    /// Serves on `listener` until [`Serving::kill`].
    fn serve(&self, listener: tokio::net::TcpListener) -> Serving {
        serve_ads(self.clone(), listener, None)
    }

    /// Serves on `listener` over TLS through `tls`.
    fn serve_tls(
        &self,
        listener: tokio::net::TcpListener,
        tls: tokio_rustls::TlsAcceptor,
    ) -> Serving {
        serve_ads(self.clone(), listener, Some(tls))
    }

    fn next_nonce(&self) -> String {
        let mut n = self.nonces.lock().unwrap();
        *n += 1;
        format!("nonce-{n}")
    }
}

/// A running management server.
struct Serving {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    sockets: Arc<Mutex<Vec<std::net::TcpStream>>>,
    refused: Arc<Mutex<usize>>,
}

/// Serves `service` on `listener`, over TLS through `tls` when given (a connection whose
/// handshake fails is counted in [`Serving::refused`] and dropped), until [`Serving::kill`].
fn serve_ads<S: AggregatedDiscoveryService>(
    service: S,
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> Serving {
    let service =
        AggregatedDiscoveryServiceServer::new(service).max_encoding_message_size(usize::MAX);
    let sockets = Arc::new(Mutex::new(Vec::new()));
    let refused = Arc::new(Mutex::new(0usize));
    let (tx, rx) = mpsc::unbounded_channel::<std::io::Result<Io>>();
    let (held, failed) = (Arc::clone(&sockets), Arc::clone(&refused));
    let accept = tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            // A second handle on the socket, to cut the connection from outside tonic.
            let socket = socket.into_std().unwrap();
            held.lock().unwrap().push(socket.try_clone().unwrap());
            let socket = tokio::net::TcpStream::from_std(socket).unwrap();
            let (tx, failed, tls) = (tx.clone(), Arc::clone(&failed), tls.clone());
            tokio::spawn(async move {
                let io = match tls {
                    None => Io::Plain(socket),
                    Some(tls) => match tls.accept(socket).await {
                        Ok(s) => Io::Tls(Box::new(s)),
                        Err(_) => {
                            *failed.lock().unwrap() += 1;
                            return;
                        }
                    },
                };
                let _ = tx.send(Ok(io));
            });
        }
    });
    let incoming =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let task = tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming)
            .await;
    });
    Serving {
        tasks: vec![accept, task],
        sockets,
        refused,
    }
}

/// A connection to the management server, plain or TLS.
enum Io {
    Plain(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>),
}

impl tonic::transport::server::Connected for Io {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

impl tokio::io::AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

impl Serving {
    /// Connections whose TLS handshake failed.
    fn refused(&self) -> usize {
        *self.refused.lock().unwrap()
    }

    /// Gone as a crashed process is: no listener, every connection cut.
    async fn kill(self) {
        for task in &self.tasks {
            task.abort();
        }
        for task in self.tasks {
            let _ = task.await;
        }
        for socket in self.sockets.lock().unwrap().drain(..) {
            let _ = socket.shutdown(std::net::Shutdown::Both);
        }
    }
}

type Responses = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Control {
    type StreamAggregatedResourcesStream = Responses;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Responses>, Status> {
        let stream = {
            let mut n = self.streams.lock().unwrap();
            *n += 1;
            *n
        };
        let headers = request.metadata().clone();
        let mut inbound = request.into_inner();
        // One response at a time: the next is made only once this one is taken.
        let (tx, rx) = mpsc::channel::<Result<DiscoveryResponse, Status>>(1);
        let control = self.clone();
        tokio::spawn(async move {
            let mut snapshot = control.snapshot.subscribe();
            let mut sent: Option<String> = None;
            let mut answered = false;
            loop {
                if answered {
                    let current = snapshot.borrow_and_update().clone();
                    if let Some(s) = current
                        && sent.as_ref() != Some(&s.version)
                    {
                        let response = DiscoveryResponse {
                            version_info: s.version.clone(),
                            resources: s.resources,
                            canary: false,
                            type_url: s.type_url,
                            nonce: control.next_nonce(),
                        };
                        if tx.send(Ok(response)).await.is_err() {
                            return;
                        }
                        sent = Some(s.version);
                    }
                }
                tokio::select! {
                    changed = snapshot.changed(), if answered => if changed.is_err() { return },
                    msg = inbound.message() => match msg {
                        Ok(Some(r)) => {
                            // Only Envoy Gateway's rate-limit node is ever answered.
                            answered = r.node.as_ref().is_some_and(|n| n.id == NODE_ID);
                            control.seen.lock().unwrap().push((stream, r, headers.clone()));
                        }
                        _ => return,
                    },
                }
            }
        });
        let out =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        Ok(Response::new(Box::pin(out)))
    }
}

fn any(c: &RateLimitConfig) -> prost_types::Any {
    prost_types::Any {
        type_url: TYPE_URL.into(),
        value: c.encode_to_vec(),
    }
}

/// Envoy Gateway's tree for one route: `key = value = route name`, then the client's CIDR
/// `masked_remote_address = 0.0.0.0/0` with `requests_per_unit` per `unit`.
fn gateway(domain: &str, requests_per_unit: u32, unit: RateLimitUnit) -> RateLimitConfig {
    RateLimitConfig {
        name: domain.into(),
        domain: domain.into(),
        descriptors: vec![RateLimitDescriptor {
            key: ROUTE.into(),
            value: ROUTE.into(),
            descriptors: vec![RateLimitDescriptor {
                key: "masked_remote_address".into(),
                value: "0.0.0.0/0".into(),
                rate_limit: Some(RateLimitPolicy {
                    unit: unit as i32,
                    requests_per_unit,
                    ..RateLimitPolicy::default()
                }),
                ..RateLimitDescriptor::default()
            }],
            ..RateLimitDescriptor::default()
        }],
    }
}

/// Envoy's request for that route from any client.
fn route_call(domain: &str) -> RateLimitRequest {
    request(
        domain,
        vec![descriptor(&[
            (ROUTE, ROUTE),
            ("masked_remote_address", "0.0.0.0/0"),
        ])],
    )
}

/// The limit the app applies to the route in `domain` now (`None`: no rule).
async fn limit_of(app: &TestServer, domain: &str) -> Option<(u32, i32)> {
    let answer: RateLimitResponse = app.ok(route_call(domain)).await;
    answer.statuses[0]
        .current_limit
        .as_ref()
        .map(|l| (l.requests_per_unit, l.unit))
}

/// Waits until the route in `domain` is limited as `expected`.
async fn until_limit(app: &TestServer, domain: &str, expected: Option<(u32, i32)>) {
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        let last = limit_of(app, domain).await;
        if last == expected {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{domain}: limit {last:?}, expected {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A management server on a loopback port.
async fn management_server() -> (Control, SocketAddr, Serving) {
    let control = Control::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = control.serve(listener);
    (control, addr, task)
}

/// The app on `policy_source: xds` pointed at `addr` as Envoy Gateway's node, with short waits.
fn xds_settings(addr: SocketAddr, force_start: bool) -> impl FnOnce(&mut Written) {
    move |w| {
        w.policy_source = PolicySource::Xds;
        w.xds.url = addr.to_string();
        w.xds.node_id = NODE_ID.into();
        w.xds.force_start = force_start;
        w.xds
            .node_metadata
            .insert("pod".into(), "ratelimit-0".into());
        w.xds.headers.insert("x-tenant".into(), "eg".into());
        w.xds.backoff.initial_ms = 50;
        w.xds.backoff.max_ms = 200;
    }
}

#[tokio::test]
async fn policies_arrive_are_acked_and_an_update_replaces_every_one() {
    let (control, addr, _server) = management_server().await;
    let app = TestServer::start_with(&[], xds_settings(addr, true)).await;
    // The subscription: Envoy Gateway's node, its metadata and the extra header, wildcard.
    let first = control.wait_for(|_| true).await;
    let node = first.node.as_ref().unwrap();
    assert_eq!(node.id, NODE_ID);
    let pod = &node.metadata.as_ref().unwrap().fields["pod"];
    assert_eq!(
        pod.kind,
        Some(prost_types::value::Kind::StringValue("ratelimit-0".into()))
    );
    assert_eq!(
        (first.version_info.as_str(), first.response_nonce.as_str()),
        ("", "")
    );
    assert_eq!(first.type_url, TYPE_URL);
    let header = control.seen.lock().unwrap()[0].2.get("x-tenant").cloned();
    assert_eq!(header.unwrap(), "eg");

    let v1 = control.set(&[
        gateway(DOMAIN, 2, RateLimitUnit::Week),
        gateway("default/eg/https", 5, RateLimitUnit::Minute),
    ]);
    let ack = control.acked(&v1).await;
    assert_eq!(ack.response_nonce, "nonce-1");
    until_limit(&app, DOMAIN, Some((2, 7))).await;
    // Decisions follow: 2 a week, the third is over (the clock stands still).
    let call = route_call(DOMAIN);
    assert_eq!(app.ok(call.clone()).await.overall_code, Code::Ok as i32);
    assert_eq!(
        app.ok(call.clone()).await.overall_code,
        Code::OverLimit as i32
    );
    until_limit(&app, "default/eg/https", Some((5, 2))).await;

    // The next version has one domain, with another limit: the other domain is gone.
    let v2 = control.set(&[gateway(DOMAIN, 100, RateLimitUnit::Second)]);
    let ack = control.acked(&v2).await;
    assert_eq!(ack.response_nonce, "nonce-2");
    until_limit(&app, DOMAIN, Some((100, 1))).await;
    assert_eq!(limit_of(&app, "default/eg/https").await, None);
    let (status, rlconfig) = http_get(app.admin, "/rlconfig").await;
    assert_eq!(status, 200);
    assert!(
        rlconfig.contains(DOMAIN) && !rlconfig.contains("default/eg/https"),
        "{rlconfig}"
    );

    // An empty list is an empty set, ACKed.
    let v3 = control.set(&[]);
    control.acked(&v3).await;
    until_limit(&app, DOMAIN, None).await;
}

#[tokio::test]
async fn a_bad_resource_is_nacked_by_name_and_the_last_good_set_keeps_deciding() {
    let (control, addr, _server) = management_server().await;
    let app = TestServer::start_with(&[], xds_settings(addr, true)).await;
    let good = control.set(&[gateway(DOMAIN, 3, RateLimitUnit::Hour)]);
    control.acked(&good).await;
    until_limit(&app, DOMAIN, Some((3, 3))).await;

    // A limited descriptor with unit UNKNOWN, beside a good resource.
    let bad = control.set(&[
        gateway("default/eg/other", 1, RateLimitUnit::Second),
        gateway("default/eg/broken", 1, RateLimitUnit::Unknown),
    ]);
    let nack = control.wait_for(|r| r.error_detail.is_some()).await;
    // The last accepted version, the rejected response's nonce, and why.
    assert_eq!(nack.version_info, good);
    assert_eq!(nack.response_nonce, "nonce-2");
    let detail = nack.error_detail.unwrap();
    assert_eq!(detail.code, 3);
    assert_eq!(
        detail.message,
        "default/eg/broken: descriptors[0].descriptors[0].rate_limit.unit: invalid rate limit \
         unit \"UNKNOWN\" (expected second, minute, hour, day, week, month or year)"
    );
    assert_ne!(bad, good);
    // Nothing of the rejected response is in force.
    assert_eq!(limit_of(&app, DOMAIN).await, Some((3, 3)));
    assert_eq!(limit_of(&app, "default/eg/other").await, None);

    // A resource of another type in the list: NACKed too.
    let cluster = prost_types::Any {
        type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
        value: vec![],
    };
    control.set_raw(
        TYPE_URL,
        vec![any(&gateway(DOMAIN, 9, RateLimitUnit::Day)), cluster],
    );
    let nack = control.wait_for(|r| r.response_nonce == "nonce-3").await;
    assert_eq!(nack.version_info, good);
    let message = nack.error_detail.expect("a NACK").message;
    assert!(
        message.starts_with(
            "resources[1]: type \"type.googleapis.com/envoy.config.cluster.v3.Cluster\""
        ),
        "{message}"
    );
    assert_eq!(limit_of(&app, DOMAIN).await, Some((3, 3)));

    // And a response of another type altogether.
    control.set_raw(
        "type.googleapis.com/envoy.config.cluster.v3.Cluster",
        vec![],
    );
    let nack = control.wait_for(|r| r.response_nonce == "nonce-4").await;
    assert_eq!(nack.version_info, good);
    assert!(
        nack.error_detail
            .expect("a NACK")
            .message
            .starts_with("response type")
    );
    assert_eq!(limit_of(&app, DOMAIN).await, Some((3, 3)));

    // The next good version is accepted.
    let fixed = control.set(&[gateway(DOMAIN, 4, RateLimitUnit::Hour)]);
    control.acked(&fixed).await;
    until_limit(&app, DOMAIN, Some((4, 3))).await;
    let rejected =
        crate::helpers::metric(app.admin, "sluice_xds_responses_total{result=\"rejected\"}").await;
    assert!(rejected.is_some_and(|n| n >= 3.0), "{rejected:?}");
}

#[tokio::test]
async fn the_server_goes_away_and_comes_back_and_the_client_rejoins() {
    let (control, addr, server) = management_server().await;
    let app = TestServer::start_with(&[], xds_settings(addr, true)).await;
    let v = control.set(&[gateway(DOMAIN, 3, RateLimitUnit::Minute)]);
    control.acked(&v).await;
    until_limit(&app, DOMAIN, Some((3, 2))).await;

    // Gone: every stream dropped, nothing listening.
    server.kill().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        limit_of(&app, DOMAIN).await,
        Some((3, 2)),
        "kept while the server is away"
    );
    let (status, _) = http_get(app.admin, "/healthcheck").await;
    assert_eq!(status, 200);

    // Back, restarted as Envoy Gateway restarts: its version counter starts again from 1.
    let again = Control::new();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let _server = again.serve(listener);
    let first = again.wait_for(|_| true).await;
    assert_eq!(
        first.version_info, v,
        "the rejoining client says what it runs"
    );
    assert_eq!(first.response_nonce, "");
    let restarted = again.set(&[gateway(DOMAIN, 7, RateLimitUnit::Minute)]);
    assert_eq!(restarted, "1");
    again.acked(&restarted).await;
    until_limit(&app, DOMAIN, Some((7, 2))).await;
}

#[tokio::test]
async fn with_force_start_health_is_ok_and_calls_are_unknown_before_any_policy() {
    let (control, addr, _server) = management_server().await;
    let app = TestServer::start_with(&[], xds_settings(addr, true)).await;
    control.wait_for(|_| true).await;
    let (status, body) = http_get(app.admin, "/healthcheck").await;
    assert_eq!((status, body.trim()), (200, "OK"));
    let err = app.call(route_call(DOMAIN)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unknown);
    assert_eq!(err.message(), "no rate limit configuration loaded");
    // The empty snapshot is never sent: still nothing loaded.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(control.requests().len(), 1);
    let v = control.set(&[gateway(DOMAIN, 3, RateLimitUnit::Minute)]);
    control.acked(&v).await;
    until_limit(&app, DOMAIN, Some((3, 2))).await;
}

#[tokio::test]
async fn without_force_start_health_waits_for_the_first_policies() {
    let (control, addr, _server) = management_server().await;
    let app = TestServer::start_with(&[], xds_settings(addr, false)).await;
    control.wait_for(|_| true).await;
    let (status, _) = http_get(app.admin, "/healthcheck").await;
    assert_eq!(status, 500);
    let mut health = app.health().await;
    let check = |service: &str| tonic_health::pb::HealthCheckRequest {
        service: service.into(),
    };
    let serving = |r: tonic_health::pb::HealthCheckResponse| r.status;
    let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
    let answer = health.check(check("ratelimit")).await.unwrap().into_inner();
    assert_eq!(serving(answer), not_serving);
    let err = app.call(route_call(DOMAIN)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unknown);

    let v = control.set(&[gateway(DOMAIN, 3, RateLimitUnit::Minute)]);
    control.acked(&v).await;
    assert!(
        eventually(WITHIN, || async {
            http_get(app.admin, "/healthcheck").await.0 == 200
        })
        .await,
        "healthy after the first policies"
    );
    let answer = health.check(check("ratelimit")).await.unwrap().into_inner();
    assert_eq!(
        serving(answer),
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    until_limit(&app, DOMAIN, Some((3, 2))).await;
}

#[tokio::test]
async fn an_oversized_response_resets_the_stream_and_the_last_good_set_stays() {
    let (control, addr, _server) = management_server().await;
    let app = TestServer::start_with(&[], |w| {
        xds_settings(addr, true)(w);
        w.xds.max_message_bytes = 4_096;
    })
    .await;
    let good = control.set(&[gateway(DOMAIN, 3, RateLimitUnit::Minute)]);
    control.acked(&good).await;
    until_limit(&app, DOMAIN, Some((3, 2))).await;

    // Far over the limit: one domain with a 64 KiB route name.
    let mut big = gateway("default/eg/big", 1, RateLimitUnit::Minute);
    big.descriptors[0].value = "x".repeat(65_536);
    control.set(&[big]);
    // The stream is reset and opened again (again and again, after the backoff), subscribing
    // with the last good version; nothing of the big response is ever ACKed or NACKed.
    assert!(
        eventually(WITHIN, || async { control.streams() >= 3 }).await,
        "streams: {}",
        control.streams()
    );
    let rejoined: Vec<_> = control
        .requests()
        .into_iter()
        .filter(|(s, _)| *s > 1)
        .map(|(_, r)| r)
        .collect();
    assert!(!rejoined.is_empty());
    for r in &rejoined {
        assert_eq!(
            (r.version_info.as_str(), r.error_detail.is_none()),
            (good.as_str(), true)
        );
    }
    assert_eq!(limit_of(&app, DOMAIN).await, Some((3, 2)));
    assert_eq!(limit_of(&app, "default/eg/big").await, None);

    // A server that comes to its senses is followed again.
    let fixed = control.set(&[gateway(DOMAIN, 5, RateLimitUnit::Minute)]);
    control.acked(&fixed).await;
    until_limit(&app, DOMAIN, Some((5, 2))).await;
}

#[tokio::test]
async fn a_silent_server_is_waited_for_without_reconnecting() {
    let (control, addr, _server) = management_server().await;
    // Another node id: Envoy Gateway's cache never answers it.
    let app = TestServer::start_with(&[], |w| {
        xds_settings(addr, true)(w);
        w.xds.node_id = "not-envoy-ratelimit".into();
    })
    .await;
    control.set(&[gateway(DOMAIN, 3, RateLimitUnit::Minute)]);
    control.wait_for(|_| true).await;
    // With a 50 ms backoff, a client that gave up on silence would have come back many times.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!((control.streams(), control.requests().len()), (1, 1));
    let err = app.call(route_call(DOMAIN)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unknown);
    let (status, _) = http_get(app.admin, "/healthcheck").await;
    assert_eq!(status, 200);
}

/// Certificates as Envoy Gateway makes them (`internal/crypto/certgen.go`): RSA 2048 keys written
/// as PKCS#1 (`RSA PRIVATE KEY`), key usage set, no extended key usage. In `dir`: `ca.crt`;
/// the server's `server.crt`/`server.key` for `envoy-gateway` (and 127.0.0.1); the client's
/// `client.crt`/`client.key` (CN `envoy`, DNS `*.envoy-gateway-system`); and a client
/// certificate of another CA, `rogue.crt`/`rogue.key`.
fn envoy_gateway_certs(dir: &Path) {
    for ca in ["ca", "other-ca"] {
        openssl(
            dir,
            &[
                "genrsa",
                "-traditional",
                "-out",
                &format!("{ca}.key"),
                "2048",
            ],
        );
        openssl(
            dir,
            &[
                "req",
                "-x509",
                "-new",
                "-key",
                &format!("{ca}.key"),
                "-days",
                "2",
                "-subj",
                "/CN=envoy-gateway",
                "-out",
                &format!("{ca}.crt"),
            ],
        );
    }
    let leaves = [
        (
            "server",
            "ca",
            "envoy-gateway",
            "DNS:envoy-gateway,DNS:envoy-gateway.envoy-gateway-system,IP:127.0.0.1",
        ),
        ("client", "ca", "envoy", "DNS:*.envoy-gateway-system"),
        ("rogue", "other-ca", "envoy", "DNS:*.envoy-gateway-system"),
    ];
    for (name, ca, cn, san) in leaves {
        std::fs::write(
            dir.join(format!("{name}.ext")),
            format!("subjectAltName={san}\nkeyUsage=critical,digitalSignature,keyEncipherment\n"),
        )
        .unwrap();
        openssl(
            dir,
            &[
                "genrsa",
                "-traditional",
                "-out",
                &format!("{name}.key"),
                "2048",
            ],
        );
        openssl(
            dir,
            &[
                "req",
                "-new",
                "-key",
                &format!("{name}.key"),
                "-subj",
                &format!("/CN={cn}"),
                "-out",
                &format!("{name}.csr"),
            ],
        );
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                &format!("{ca}.crt"),
                "-CAkey",
                &format!("{ca}.key"),
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &format!("{name}.ext"),
                "-out",
                &format!("{name}.crt"),
            ],
        );
    }
}

/// Envoy Gateway's xDS server TLS: its certificate, client certificates required and verified
/// against the CA, TLS 1.3 only, ALPN h2.
fn envoy_gateway_tls(dir: &Path) -> tokio_rustls::TlsAcceptor {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(dir.join("ca.crt")).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::clone(&provider),
    )
    .build()
    .unwrap();
    let chain: Vec<_> = CertificateDer::pem_file_iter(dir.join("server.crt"))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

#[tokio::test]
async fn mtls_with_envoy_gateways_certificates_and_rotated_client_files() {
    if crate::helpers::openssl_missing(
        "mtls_with_envoy_gateways_certificates_and_rotated_client_files",
    ) {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    let dir = certs.path();
    envoy_gateway_certs(dir);
    let key = std::fs::read_to_string(dir.join("client.key")).unwrap();
    assert!(
        key.starts_with("-----BEGIN RSA PRIVATE KEY-----"),
        "PKCS#1, as Envoy Gateway"
    );
    // The mounted files start out holding a certificate the server does not trust.
    let mounted = tempfile::tempdir().unwrap();
    let (crt, tls_key) = (
        mounted.path().join("tls.crt"),
        mounted.path().join("tls.key"),
    );
    std::fs::copy(dir.join("rogue.crt"), &crt).unwrap();
    std::fs::copy(dir.join("rogue.key"), &tls_key).unwrap();

    let control = Control::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = control.serve_tls(listener, envoy_gateway_tls(dir));
    let v = control.set(&[gateway(DOMAIN, 3, RateLimitUnit::Minute)]);
    let (ca, crt2, key2) = (dir.join("ca.crt"), crt.clone(), tls_key.clone());
    let app = TestServer::start_with(&[], move |w| {
        xds_settings(format!("127.0.0.1:{port}").parse().unwrap(), true)(w);
        // Envoy Gateway's URL names the host; here the certificate's name is given instead.
        w.xds.tls.enabled = true;
        w.xds.tls.cert_file = Some(crt2);
        w.xds.tls.key_file = Some(key2);
        w.xds.tls.ca_file = Some(ca);
        w.xds.tls.san = Some("envoy-gateway".into());
    })
    .await;
    assert!(
        eventually(WITHIN, || async { server.refused() >= 2 }).await,
        "the untrusted client certificate is refused, and tried again"
    );
    assert!(control.requests().is_empty());
    // Rotated in place, as the kubelet updates a mounted Secret: the next attempt uses it.
    std::fs::copy(dir.join("client.crt"), &crt).unwrap();
    std::fs::copy(dir.join("client.key"), &tls_key).unwrap();
    control.acked(&v).await;
    until_limit(&app, DOMAIN, Some((3, 2))).await;

    // A server name the certificate does not carry is refused by the client.
    let wrong = TestServer::start_with(&[], move |w| {
        xds_settings(format!("127.0.0.1:{port}").parse().unwrap(), true)(w);
        w.xds.tls.enabled = true;
        w.xds.tls.cert_file = Some(crt);
        w.xds.tls.key_file = Some(tls_key);
        w.xds.tls.ca_file = Some(certs.path().join("ca.crt"));
        w.xds.tls.san = Some("not-envoy-gateway".into());
    })
    .await;
    let before = control.requests().len();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        control.requests().len(),
        before,
        "no stream without a trusted server"
    );
    let err = wrong.call(route_call(DOMAIN)).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unknown);
}

/// A server that floods: on a stream from Envoy Gateway's node it pushes `good` versions of a
/// small valid policy (`requests_per_unit` = the version), then `big` responses each holding a
/// 1 MiB resource of another type, then one last good version with `requests_per_unit` 42,
/// without waiting for any answer. Every request is recorded.
#[derive(Clone)]
struct Flooder {
    good: u32,
    big: u32,
    seen: Arc<Mutex<Vec<DiscoveryRequest>>>,
}

impl Flooder {
    fn last(&self) -> u32 {
        self.good + self.big + 1
    }

    fn response(&self, n: u32) -> DiscoveryResponse {
        let resources = if n > self.good && n < self.last() {
            vec![prost_types::Any {
                type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
                value: vec![0; 1 << 20],
            }]
        } else {
            let rpu = if n == self.last() { 42 } else { n };
            vec![any(&gateway(DOMAIN, rpu, RateLimitUnit::Minute))]
        };
        DiscoveryResponse {
            version_info: n.to_string(),
            resources,
            canary: false,
            type_url: TYPE_URL.into(),
            nonce: format!("nonce-{n}"),
        }
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Flooder {
    type StreamAggregatedResourcesStream = Responses;

    async fn stream_aggregated_resources(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Responses>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel::<Result<DiscoveryResponse, Status>>(1);
        let this = self.clone();
        tokio::spawn(async move {
            let Ok(Some(first)) = inbound.message().await else {
                return;
            };
            this.seen.lock().unwrap().push(first);
            let seen = Arc::clone(&this.seen);
            tokio::spawn(async move {
                while let Ok(Some(r)) = inbound.message().await {
                    seen.lock().unwrap().push(r);
                }
            });
            for n in 1..=this.last() {
                if tx.send(Ok(this.response(n))).await.is_err() {
                    return;
                }
            }
            // Held open, silent, as a real server would be.
            tx.closed().await;
        });
        let out =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        Ok(Response::new(Box::pin(out)))
    }
}

/// The peak resident memory of process `pid`, in KiB (`VmHWM`).
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

/// The real binary against a flood of 1,000 versions, then 200 responses of 1 MiB each (NACKed),
/// then a last version: every response is answered in turn, the last version decides, the
/// log stays short, and the process's peak memory grows by far less than the 200 MiB pushed.
#[tokio::test]
async fn a_flood_of_versions_is_answered_in_turn_in_bounded_memory() {
    if !std::path::Path::new("/proc/self/status").exists() {
        return;
    }
    let flooder = Flooder {
        good: 1_000,
        big: 200,
        seen: Arc::new(Mutex::new(Vec::new())),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let settings = format!(
        "log_level: info\npolicy_source: xds\nxds:\n  url: {addr}\n  node_id: {NODE_ID}\n  \
         force_start: true\n  backoff:\n    initial_ms: 50\n    max_ms: 200\n"
    );
    let process = crate::helpers::Process::start(&[], &settings);
    let before = peak_rss_kib(process.pid());
    let _server = serve_ads(flooder.clone(), listener, None);

    let last = flooder.last().to_string();
    let answered = eventually(Duration::from_secs(120), || {
        let done = flooder
            .seen
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.version_info == last && r.error_detail.is_none());
        async move { done }
    })
    .await;
    let seen = flooder.seen.lock().unwrap().clone();
    assert!(
        answered,
        "the last version was not ACKed; {} requests",
        seen.len()
    );
    // One stream, the subscription, then exactly one answer per response, in order.
    assert_eq!(seen.len(), 1 + flooder.last() as usize);
    for (n, reply) in (1..=flooder.last()).zip(&seen[1..]) {
        assert_eq!(reply.response_nonce, format!("nonce-{n}"));
        let nacked = n > flooder.good && n < flooder.last();
        assert_eq!(reply.error_detail.is_some(), nacked, "response {n}");
        // A NACK repeats the last accepted version.
        let version = if nacked { flooder.good } else { n };
        assert_eq!(reply.version_info, version.to_string(), "response {n}");
    }
    let after = peak_rss_kib(process.pid());
    assert!(
        after.saturating_sub(before) < 64 * 1024,
        "peak memory grew from {before} KiB to {after} KiB"
    );

    // The last version decides.
    let mut client = sluice::pb::rate_limit_service_client::RateLimitServiceClient::connect(
        format!("http://{}", process.grpc),
    )
    .await
    .unwrap();
    let answer = client
        .should_rate_limit(route_call(DOMAIN))
        .await
        .unwrap()
        .into_inner();
    let limit = answer.statuses[0].current_limit.as_ref().expect("a limit");
    assert_eq!(limit.requests_per_unit, 42);
    // A line per response, but not 1,201 of them.
    let lines = process.log_for(Duration::from_millis(500));
    let responses = lines
        .iter()
        .filter(|l| {
            let m = l["message"].as_str().unwrap_or_default();
            m.starts_with("xDS policies accepted") || m.starts_with("xDS response rejected")
        })
        .count();
    assert!((1..=40).contains(&responses), "{responses} response lines");
}

/// The `env` of the `envoy-ratelimit` container in `deploy/envoy-gateway/ratelimit-deployment.yaml`
/// (Envoy Gateway's Deployment with sluice's image), in order, after checking that the container
/// is started as Envoy Gateway starts it (`command: ["/bin/ratelimit"]`, no arguments).
/// `REDIS_URL` from a Secret (`valueFrom`, as Envoy Gateway renders a `urlRef`) is kept with an
/// empty value, which [`envoy_gateways_deployment_takes_policies_over_xds`] replaces; any other
/// variable without a string value fails the test until it is given a test value.
fn deployment_env() -> Vec<(String, String)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/envoy-gateway/ratelimit-deployment.yaml"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let docs = yaml_rust2::YamlLoader::load_from_str(&text).unwrap();
    let containers = docs[0]["spec"]["template"]["spec"]["containers"]
        .as_vec()
        .expect("containers");
    let container = containers
        .iter()
        .find(|c| c["name"].as_str() == Some(NODE_ID))
        .expect("the envoy-ratelimit container");
    let command: Vec<_> = container["command"]
        .as_vec()
        .expect("a command")
        .iter()
        .map(|a| a.as_str().expect("a string"))
        .collect();
    assert_eq!(command, ["/bin/ratelimit"]);
    assert!(container["args"].is_badvalue(), "no arguments");
    container["env"]
        .as_vec()
        .expect("env")
        .iter()
        .map(|e| {
            let name = e["name"].as_str().expect("a name").to_string();
            let value = match e["value"].as_str() {
                Some(v) => v.to_string(),
                // Only Envoy Gateway's Redis URL from a Secret: the test sets its own.
                None if name == "REDIS_URL" && !e["valueFrom"].is_badvalue() => String::new(),
                None => panic!("{name}: no string value; give it a test value here"),
            };
            (name, value)
        })
        .collect()
}

/// Connects over TLS as Envoy does to Envoy Gateway's rate-limit Service: the chain verified
/// against the CA of `/certs/ca.crt`, no name matched (the certificate's `*.envoy-gateway-system`
/// is not a name webpki accepts), ALPN h2.
#[derive(Clone)]
struct TlsTo(Arc<tokio_rustls::rustls::ClientConfig>);

impl TlsTo {
    fn trusting(ca: &Path) -> Self {
        use tokio_rustls::rustls;
        use tokio_rustls::rustls::pki_types::CertificateDer;
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_file_iter(ca).unwrap() {
            roots.add(cert.unwrap()).unwrap();
        }
        let chain = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::clone(&provider),
        )
        .build()
        .unwrap();
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ChainOnly(chain)))
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        Self(Arc::new(config))
    }
}

/// A server certificate verified as Envoy's upstream TLS context without SAN matchers does:
/// the chain, dates and signatures, and not the name.
#[derive(Debug)]
struct ChainOnly(Arc<tokio_rustls::rustls::client::WebPkiServerVerifier>);

impl tokio_rustls::rustls::client::danger::ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &tokio_rustls::rustls::pki_types::CertificateDer<'_>,
        intermediates: &[tokio_rustls::rustls::pki_types::CertificateDer<'_>],
        server_name: &tokio_rustls::rustls::pki_types::ServerName<'_>,
        ocsp_response: &[u8],
        now: tokio_rustls::rustls::pki_types::UnixTime,
    ) -> Result<tokio_rustls::rustls::client::danger::ServerCertVerified, tokio_rustls::rustls::Error>
    {
        use tokio_rustls::rustls::{CertificateError, Error};
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(tokio_rustls::rustls::client::danger::ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &tokio_rustls::rustls::pki_types::CertificateDer<'_>,
        dss: &tokio_rustls::rustls::DigitallySignedStruct,
    ) -> Result<
        tokio_rustls::rustls::client::danger::HandshakeSignatureValid,
        tokio_rustls::rustls::Error,
    > {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &tokio_rustls::rustls::pki_types::CertificateDer<'_>,
        dss: &tokio_rustls::rustls::DigitallySignedStruct,
    ) -> Result<
        tokio_rustls::rustls::client::danger::HandshakeSignatureValid,
        tokio_rustls::rustls::Error,
    > {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<tokio_rustls::rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

impl tonic::codegen::Service<http::Uri> for TlsTo {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;
    type Error = std::io::Error;
    type Future =
        Pin<Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let config = Arc::clone(&self.0);
        Box::pin(async move {
            let to = uri.authority().map(|a| a.to_string()).unwrap_or_default();
            let tcp = tokio::net::TcpStream::connect(to).await?;
            let name = tokio_rustls::rustls::pki_types::ServerName::try_from(
                "envoy-ratelimit.envoy-gateway-system",
            )
            .map_err(std::io::Error::other)?;
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await?;
            Ok(hyper_util::rt::TokioIo::new(tls))
        })
    }
}

/// A process, killed when dropped, and its log (text, as the Deployment leaves `LOG_FORMAT`
/// unset) as it arrives.
struct Ratelimit {
    child: std::process::Child,
    log: Arc<Mutex<Vec<String>>>,
}

impl Ratelimit {
    fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

impl Drop for Ratelimit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The binary as Envoy Gateway runs it: through a symlink named `ratelimit` (its image's
/// `/bin/ratelimit`), no arguments, and the environment of `deploy/envoy-gateway/
/// ratelimit-deployment.yaml` with only these changes, each needed to run it here:
/// - `PORT`, `GRPC_PORT`, `DEBUG_PORT` (not in the Deployment: the reference's 8080, 8081 and
///   6070) and `PROMETHEUS_ADDR` (`:19001`) on free ports, so that tests run side by side;
/// - `CONFIG_GRPC_XDS_SERVER_URL` (`envoy-gateway:18001`, a cluster name) to the management
///   server of the test, whose certificate carries 127.0.0.1 as Envoy Gateway's carries
///   `envoy-gateway`;
/// - the `/certs/...` paths (the Secret `envoy-rate-limit` mounted there) to certificates made
///   here in the shape of Envoy Gateway's;
/// - `REDIS_URL` (`redis.redis-system.svc.cluster.local:6379`, or a Secret) to a `redis-server`
///   of the test.
///
/// It serves `/healthcheck` before any policy (force start), answers `UNKNOWN` until the first
/// policies, takes Envoy Gateway's descriptor tree over mTLS and ACKs it, decides over TLS,
/// and shows the over-limit series on `PROMETHEUS_ADDR` and the limit on `/rlconfig`.
#[tokio::test]
async fn envoy_gateways_deployment_takes_policies_over_xds() {
    let test = "envoy_gateways_deployment_takes_policies_over_xds";
    if crate::helpers::openssl_missing(test) || crate::helpers::redis_missing(test) {
        return;
    }
    let redis = crate::helpers::redis::RedisProcess::start();
    let dir = tempfile::tempdir().unwrap();
    let made = dir.path().join("made");
    std::fs::create_dir(&made).unwrap();
    envoy_gateway_certs(&made);
    // The Secret's keys: the rate-limit certificate (CN envoy, `*.envoy-gateway-system`, PKCS#1
    // key) serves gRPC and is presented to the xDS server, and the CA.
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).unwrap();
    for (from, to) in [
        ("client.crt", "tls.crt"),
        ("client.key", "tls.key"),
        ("ca.crt", "ca.crt"),
    ] {
        std::fs::copy(made.join(from), certs.join(to)).unwrap();
    }
    let control = Control::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let xds_url = listener.local_addr().unwrap().to_string();
    let _server = control.serve_tls(listener, envoy_gateway_tls(&made));

    let deployed = deployment_env();
    let port = crate::helpers::free_port();
    let grpc_port = crate::helpers::free_port();
    let debug_port = crate::helpers::free_port();
    let prometheus_port = crate::helpers::free_port();
    let mut env: Vec<(String, String)> = deployed
        .iter()
        .map(|(name, value)| {
            let value = match (name.as_str(), value.strip_prefix("/certs/")) {
                (_, Some(file)) => certs.join(file).to_str().unwrap().to_string(),
                ("PROMETHEUS_ADDR", _) => format!(":{prometheus_port}"),
                ("CONFIG_GRPC_XDS_SERVER_URL", _) => xds_url.clone(),
                ("REDIS_URL", _) => format!("127.0.0.1:{}", redis.port),
                _ => value.clone(),
            };
            (name.clone(), value)
        })
        .collect();
    for (name, p) in [
        ("PORT", port),
        ("GRPC_PORT", grpc_port),
        ("DEBUG_PORT", debug_port),
    ] {
        assert!(
            deployed.iter().all(|(n, _)| n != name),
            "the Deployment sets {name} now: move it to a free port in the mapping above"
        );
        env.push((name.into(), p.to_string()));
    }
    // Every variable of the Deployment is passed, and only the ones above differ.
    let names = |vars: &[(String, String)]| -> Vec<String> {
        vars.iter().map(|(n, _)| n.clone()).collect()
    };
    assert_eq!(names(&env[..deployed.len()]), names(&deployed));
    let changed: Vec<&str> = deployed
        .iter()
        .zip(&env)
        .filter(|(d, e)| d.1 != e.1)
        .map(|(d, _)| d.0.as_str())
        .collect();
    assert_eq!(
        changed,
        [
            "CONFIG_GRPC_XDS_SERVER_URL",
            "GRPC_SERVER_TLS_CERT",
            "GRPC_SERVER_TLS_KEY",
            "GRPC_SERVER_TLS_CA_CERT",
            "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
            "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
            "CONFIG_GRPC_XDS_SERVER_TLS_CACERT",
            "REDIS_URL",
            "PROMETHEUS_ADDR",
        ]
    );
    let value = |name: &str| env.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    assert_eq!(value("CONFIG_TYPE"), Some("GRPC_XDS_SOTW"));
    assert_eq!(value("FORCE_START_WITHOUT_INITIAL_CONFIG"), Some("true"));
    assert!(value("SLUICE_COMPAT").is_none());

    let ratelimit = dir.path().join("ratelimit");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_sluice"), &ratelimit).unwrap();
    let mut child = std::process::Command::new(&ratelimit)
        .env_clear()
        .envs(env.iter().map(|(n, v)| (n, v)))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start ratelimit");
    let log = Arc::new(Mutex::new(Vec::new()));
    let stderr = child.stderr.take().unwrap();
    let lines = Arc::clone(&log);
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            lines.lock().unwrap().push(line);
        }
    });
    let process = Ratelimit { child, log };
    let local = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));

    // The probes' `/healthcheck` on PORT, before any policy.
    let healthy = eventually(WITHIN, || async {
        tokio::net::TcpStream::connect(local(port)).await.is_ok() && {
            let (status, body) = http_get(local(port), "/healthcheck").await;
            (status, body.trim()) == (200, "OK")
        }
    })
    .await;
    assert!(healthy, "not healthy: {}", process.log());
    let subscribed = control.wait_for(|_| true).await;
    assert_eq!(subscribed.node.unwrap().id, NODE_ID);
    assert!(
        control
            .requests()
            .iter()
            .all(|(_, r)| r.version_info.is_empty())
    );

    // gRPC over TLS, as Envoy calls the Service; plaintext is not served there.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", local(grpc_port)))
        .unwrap()
        .connect_with_connector(TlsTo::trusting(&certs.join("ca.crt")))
        .await
        .expect("a TLS connection");
    let mut client = sluice::pb::rate_limit_service_client::RateLimitServiceClient::new(channel);
    let err = client
        .should_rate_limit(route_call(DOMAIN))
        .await
        .unwrap_err();
    assert_eq!(
        (err.code(), err.message()),
        (tonic::Code::Unknown, "no rate limit configuration loaded")
    );
    let mut plain = sluice::pb::rate_limit_service_client::RateLimitServiceClient::connect(
        format!("http://{}", local(grpc_port)),
    )
    .await
    .unwrap();
    assert!(plain.should_rate_limit(route_call(DOMAIN)).await.is_err());

    // Envoy Gateway's tree for the route, 2 an hour from any client, pushed and ACKed; and the
    // same route on another listener, called until Redis answers in time (the first call loads
    // the script), so that the counted calls below are not cut by the backend's timeout.
    const WARM: &str = "default/eg/https";
    let v = control.set(&[
        gateway(DOMAIN, 2, RateLimitUnit::Hour),
        gateway(WARM, 1_000, RateLimitUnit::Hour),
    ]);
    control.acked(&v).await;
    let warmed = eventually(WITHIN, || {
        let mut warm = client.clone();
        async move { warm.should_rate_limit(route_call(WARM)).await.is_ok() }
    })
    .await;
    assert!(warmed, "Redis never answered in time: {}", process.log());
    let mut codes = Vec::new();
    for _ in 0..3 {
        let answer = client
            .should_rate_limit(route_call(DOMAIN))
            .await
            .unwrap()
            .into_inner();
        codes.push(answer.overall_code);
    }
    assert_eq!(
        codes,
        [Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32]
    );

    // The series Envoy Gateway's e2e reads, on PROMETHEUS_ADDR, `key2` sanitised.
    let (status, metrics) = http_get(local(prometheus_port), "/metrics").await;
    assert_eq!(status, 200);
    let series = format!(
        "ratelimit_service_rate_limit_over_limit{{domain=\"{DOMAIN}\",key1=\"{ROUTE}_{ROUTE}\",\
         key2=\"masked_remote_address_0_0_0_0/0\"}} 1"
    );
    assert!(metrics.lines().any(|l| l == series), "{series}\n{metrics}");
    let total = "ratelimit_service_total_requests{grpc_method=\"ShouldRateLimit\"}";
    assert!(metrics.lines().any(|l| l.starts_with(total)), "{metrics}");

    // `/rlconfig` on the debug port, where `egctl config envoy-ratelimit` reads it.
    let (status, rlconfig) = http_get(local(debug_port), "/rlconfig").await;
    assert_eq!(status, 200);
    let limit = format!(
        "{DOMAIN}.{ROUTE}_{ROUTE}.masked_remote_address_0.0.0.0/0: unit=HOUR unit_multiplier=1 \
         requests_per_unit=2"
    );
    assert!(rlconfig.contains(&limit), "{limit}\n{rlconfig}");

    // Started under the name, from the xDS server, counting in Redis; what of the environment is
    // not acted on is said.
    let log = process.log();
    for said in [
        "invoked as ratelimit".to_string(),
        format!("policies: over xDS from {xds_url} (TLS), node envoy-ratelimit"),
        format!("backend: redis redis://127.0.0.1:{}", redis.port),
        format!("metrics 0.0.0.0:{prometheus_port} (/metrics)"),
        "RUNTIME_ROOT, RUNTIME_SUBDIRECTORY, RUNTIME_IGNOREDOTFILES, RUNTIME_WATCH_ROOT: not read \
         with CONFIG_TYPE=GRPC_XDS_SOTW (as in the reference): policies come from the xDS server"
            .to_string(),
        "GRPC_SERVER_TLS_CA_CERT: not a variable of the reference".to_string(),
    ] {
        assert!(log.contains(&said), "{said}\n{log}");
    }
}

/// The operator's view, from the real binary's JSON log: a line per accepted version with its
/// counts, per NACK with the reason, per lost stream with the reason and the wait before the
/// next attempt (an oversized response, then the server gone). The log is read by blocking, so
/// the management server runs on other threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_event_has_its_log_line() {
    let control = Control::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = control.serve(listener);
    let settings = format!(
        "policy_source: xds\nxds:\n  url: {addr}\n  node_id: {NODE_ID}\n  force_start: true\n  \
         max_message_bytes: 4096\n  backoff:\n    initial_ms: 50\n    max_ms: 200\n    \
         jitter: false\n"
    );
    let process = crate::helpers::Process::start(&[], &settings);
    let within = Duration::from_secs(10);

    let v1 = control.set(&[
        gateway(DOMAIN, 3, RateLimitUnit::Minute),
        gateway("default/eg/https", 3, RateLimitUnit::Minute),
    ]);
    let accepted = process
        .logged("xDS policies accepted (ACK)", within)
        .expect("an ACK line");
    assert_eq!(accepted["version"], v1.as_str());
    assert_eq!(
        (accepted["domains"].as_u64(), accepted["rules"].as_u64()),
        (Some(2), Some(2))
    );

    let v2 = control.set(&[gateway("default/eg/broken", 1, RateLimitUnit::Unknown)]);
    let nack = process
        .logged(
            "xDS response rejected (NACK); keeping the last good policies",
            within,
        )
        .expect("a NACK line");
    assert_eq!(nack["version"], v2.as_str());
    assert!(
        nack["level"]
            .as_str()
            .is_some_and(|l| l.eq_ignore_ascii_case("warn")),
        "{nack}"
    );
    let error = nack["error"].as_str().unwrap_or_default();
    assert!(
        error.starts_with("default/eg/broken: descriptors[0]"),
        "{error}"
    );

    let mut big = gateway("default/eg/big", 1, RateLimitUnit::Minute);
    big.descriptors[0].value = "x".repeat(8_192);
    control.set(&[big]);
    let ended = process
        .logged(
            "xDS stream ended; keeping the last good policies and reconnecting",
            within,
        )
        .expect("a line for the reset stream");
    let reason = ended["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("too large"), "{reason}");
    assert_eq!(ended["retry_in_ms"].as_u64(), Some(50));

    // The server gone for good: the waits grow to the maximum, and are said.
    control.set(&[gateway(DOMAIN, 5, RateLimitUnit::Minute)]);
    server.kill().await;
    let mut waits = Vec::new();
    while waits.last() != Some(&200) {
        let ended = process
            .logged(
                "xDS stream ended; keeping the last good policies and reconnecting",
                within,
            )
            .expect("a line per attempt");
        waits.push(ended["retry_in_ms"].as_u64().expect("retry_in_ms"));
    }
    assert!(waits.windows(2).all(|w| w[0] <= w[1]), "{waits:?}");
}
