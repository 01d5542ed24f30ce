//! Policies pushed by an xDS management server (`policy_source: xds`), as envoyproxy/ratelimit's
//! `CONFIG_TYPE=GRPC_XDS_SOTW` receives them from Envoy Gateway: one aggregated discovery stream
//! (`StreamAggregatedResources`, state of the world) with a wildcard subscription to
//! `RateLimitConfig` resources. Each response is the whole set: decoded and loaded
//! (`resources`), swapped in through the same path as a file reload
//! ([`crate::metrics::Metrics::swap_policies`]), then ACKed with its version and nonce; one that
//! does not decode or load is NACKed with the last accepted version and an `error_detail`
//! naming the resource and descriptor, and the running policies stay. Responses are handled one
//! at a time (the next is not read before the answer to this one is sent), so a server flooding
//! versions holds at most one response and HTTP/2's window in memory. A stream that ends, fails,
//! or carries a response over the size limit is dropped, the policies kept, and a new one opened
//! after a backoff (`backoff`), subscribing with the last accepted version. TLS: `tls`.
//! It does not serve anything, and it never reads or writes the policy directory.

mod backoff;
mod resources;
mod tls;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use crate::metrics::{LoadResult, LoadTrigger, Metrics};
use crate::pb::envoy::config::core::v3::Node;
use crate::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use crate::pb::google::rpc::Status as RpcStatus;
use crate::policy::{PolicyHandle, PolicySet};
use crate::settings::XdsSettings;
use crate::telemetry::cut;
use backoff::Backoff;
pub use resources::TYPE_URL;

/// Longest a TCP connection (and TLS handshake) to the server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Quiet time on the connection before an HTTP/2 PING, and how long its answer may take: a
/// server that vanished without closing is found, one that is merely silent is waited for.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest NACK message sent (a response with thousands of problems is cut here).
const MAX_NACK_BYTES: usize = 4_096;

/// gRPC's `INVALID_ARGUMENT`, the code of a NACK's `error_detail`.
const INVALID_ARGUMENT: i32 = 3;

/// One line per response is logged up to this many per [`LOG_WINDOW`]; past it responses are
/// counted and summed up in one line when the window ends (or the stream does).
const LOG_LINES_PER_WINDOW: u32 = 10;
const LOG_WINDOW: Duration = Duration::from_secs(10);

/// The xDS client: keeps `policies` as the server says, until stopped.
#[derive(Debug)]
pub struct XdsClient {
    settings: XdsSettings,
    merge_domains: bool,
    policies: PolicyHandle,
    metrics: Arc<Metrics>,
    /// Told once, when the first policies are swapped in.
    first: Option<oneshot::Sender<()>>,
    /// The version of the last response accepted; empty before any.
    accepted: String,
    log: LogBudget,
}

/// Why a stream ended.
type Ended = String;

impl XdsClient {
    /// A client of the server in `settings` keeping `policies`; with `merge_domains`,
    /// resources naming the same domain are merged (the reference's `MERGE_DOMAIN_CONFIG`).
    #[must_use]
    pub fn new(
        settings: XdsSettings,
        merge_domains: bool,
        policies: PolicyHandle,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            settings,
            merge_domains,
            policies,
            metrics,
            first: None,
            accepted: String::new(),
            log: LogBudget::default(),
        }
    }

    /// Sends on `first` once the first policies are in force.
    #[must_use]
    pub fn on_first_policies(mut self, first: oneshot::Sender<()>) -> Self {
        self.first = Some(first);
        self
    }

    /// Holds a stream to the server until `stop`, reconnecting after each end.
    pub async fn run(mut self, stop: CancellationToken) {
        let mut backoff = Backoff::new(self.settings.backoff);
        loop {
            let ended = tokio::select! {
                () = stop.cancelled() => return,
                ended = self.session(&mut backoff) => ended,
            };
            self.metrics.xds_connected(false);
            self.log.flush();
            let delay = backoff.next();
            tracing::warn!(
                server = %self.settings.authority,
                reason = %ended,
                retry_in_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                "xDS stream ended; keeping the last good policies and reconnecting"
            );
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// One stream: connect, subscribe, then answer each response until the stream ends.
    async fn session(&mut self, backoff: &mut Backoff) -> Ended {
        let channel = match self.connect().await {
            Ok(c) => c,
            Err(e) => return format!("cannot connect: {e}"),
        };
        let mut client = AggregatedDiscoveryServiceClient::new(channel)
            .max_decoding_message_size(self.settings.max_message_bytes);
        // Room for the subscription and one answer: responses are answered one at a time.
        let (tx, rx) = mpsc::channel::<DiscoveryRequest>(2);
        let subscribe = self.request(String::new(), None);
        if tx.send(subscribe).await.is_err() {
            return "the request stream closed".into();
        }
        let outbound =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        let mut request = tonic::Request::new(outbound);
        for (name, value) in &self.settings.headers {
            // Both checked when the settings were validated.
            if let (Ok(name), Ok(value)) = (
                tonic::metadata::MetadataKey::from_bytes(name.as_bytes()),
                value.parse(),
            ) {
                request.metadata_mut().insert(name, value);
            }
        }
        // A server may hold its response headers back until it has something to send (Envoy
        // Gateway's does while it has no policy): the stream counts as open from here.
        self.metrics.xds_connected(true);
        tracing::info!(server = %self.settings.authority, version = %self.accepted, "connected to the xDS server; subscribed to RateLimitConfig");
        let mut inbound = match client.stream_aggregated_resources(request).await {
            Ok(r) => r.into_inner(),
            Err(status) => return describe(&status),
        };
        loop {
            let summary = self.log.due();
            let message = tokio::select! {
                m = inbound.message() => m,
                () = until(summary) => {
                    self.log.flush();
                    continue;
                }
            };
            let response = match message {
                Ok(Some(r)) => r,
                Ok(None) => return "the server ended the stream".into(),
                Err(status) => return describe(&status),
            };
            let reply = self.answer(response, backoff).await;
            if tx.send(reply).await.is_err() {
                return "the request stream closed".into();
            }
        }
    }

    /// A channel to the server, over TLS when configured (its files read now).
    async fn connect(&self) -> Result<Channel, String> {
        let s = &self.settings;
        let scheme = if s.tls.is_some() { "https" } else { "http" };
        let endpoint = Endpoint::from_shared(format!("{scheme}://{}", s.authority))
            .map_err(|e| e.to_string())?
            .connect_timeout(CONNECT_TIMEOUT)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .tcp_nodelay(true);
        let connected = match &s.tls {
            None => endpoint.connect().await,
            Some(t) => {
                let connector = tls::Connector::new(t, &s.authority)?;
                endpoint.connect_with_connector(connector).await
            }
        };
        connected.map_err(|e| error_chain(&e))
    }

    /// Loads one response and says how it went: an ACK, or a NACK with why.
    async fn answer(
        &mut self,
        response: DiscoveryResponse,
        backoff: &mut Backoff,
    ) -> DiscoveryRequest {
        let DiscoveryResponse {
            version_info,
            resources,
            type_url,
            nonce,
            ..
        } = response;
        let count = resources.len();
        let loaded = if type_url == TYPE_URL {
            let merge = self.merge_domains;
            tokio::task::spawn_blocking(move || {
                resources::decode(&resources).and_then(|c| resources::load(&c, merge))
            })
            .await
            .unwrap_or_else(|e| Err(format!("the load failed: {e}")))
        } else {
            Err(format!(
                "response type {type_url:?} is not {TYPE_URL}, the only type subscribed to"
            ))
        };
        match loaded {
            Ok(set) => {
                self.install(set, &version_info, count);
                backoff.reset();
                self.accepted = version_info;
                self.request(nonce, None)
            }
            Err(reason) => {
                self.metrics
                    .policy_loaded(LoadResult::Failure, LoadTrigger::Reload);
                self.metrics.xds_response(false);
                if self.log.allow() {
                    tracing::warn!(version = %version_info, nonce = %nonce, error = %reason, "xDS response rejected (NACK); keeping the last good policies");
                }
                let message = cut(&reason, MAX_NACK_BYTES).to_owned();
                self.request(
                    nonce,
                    Some(RpcStatus {
                        code: INVALID_ARGUMENT,
                        message,
                        details: Vec::new(),
                    }),
                )
            }
        }
    }

    /// Swaps an accepted set in and logs it.
    fn install(&mut self, set: PolicySet, version: &str, resources: usize) {
        let Ok((summary, old)) = self.metrics.swap_policies(&self.policies, Ok(set)) else {
            return;
        };
        tokio::task::spawn_blocking(move || drop(old));
        self.metrics.xds_response(true);
        if self.log.allow() {
            tracing::info!(version = %version, resources, domains = summary.domains, rules = summary.limited + summary.bans + summary.unlimited, "xDS policies accepted (ACK)");
        }
        if let Some(first) = self.first.take() {
            let _ = first.send(());
        }
    }

    /// A request on the stream: the subscription (empty `nonce`), an ACK, or a NACK (`error`).
    fn request(&self, nonce: String, error: Option<RpcStatus>) -> DiscoveryRequest {
        let metadata = prost_types::Struct {
            fields: self
                .settings
                .node_metadata
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        prost_types::Value {
                            kind: Some(prost_types::value::Kind::StringValue(v.clone())),
                        },
                    )
                })
                .collect(),
        };
        DiscoveryRequest {
            version_info: self.accepted.clone(),
            node: Some(Node {
                id: self.settings.node_id.clone(),
                cluster: String::new(),
                metadata: (!metadata.fields.is_empty()).then_some(metadata),
            }),
            resource_names: Vec::new(),
            type_url: TYPE_URL.into(),
            response_nonce: nonce,
            error_detail: error,
        }
    }
}

/// A status from the stream in a log's words.
fn describe(status: &tonic::Status) -> String {
    format!("{:?}: {}", status.code(), status.message())
}

/// An error and its causes, `: `-joined (tonic's transport errors say little on their own).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Resolves at `at`, or never.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// How many response lines may still be logged in this window, and how many were held back.
#[derive(Debug, Default)]
struct LogBudget {
    window: Option<Instant>,
    lines: u32,
    held: u32,
}

impl LogBudget {
    /// Whether a response may have its line now.
    fn allow(&mut self) -> bool {
        let now = Instant::now();
        if self
            .window
            .is_none_or(|w| now.duration_since(w) >= LOG_WINDOW)
        {
            self.flush();
            self.window = Some(now);
            self.lines = 0;
        }
        if self.lines < LOG_LINES_PER_WINDOW {
            self.lines += 1;
            true
        } else {
            self.held += 1;
            false
        }
    }

    /// When the lines held back are due to be summed up: the end of the window.
    fn due(&self) -> Option<Instant> {
        self.window
            .filter(|_| self.held > 0)
            .map(|w| w + LOG_WINDOW)
    }

    /// Sums up the responses handled without a line, if any.
    fn flush(&mut self) {
        if self.held > 0 {
            tracing::info!(
                responses = self.held,
                "xDS: more responses handled than logged (each accepted or rejected as counted by sluice_xds_responses_total)"
            );
            self.held = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_is_logged_a_few_lines_a_window() {
        let mut log = LogBudget::default();
        let allowed = (0..1_000).filter(|_| log.allow()).count();
        assert_eq!(allowed, LOG_LINES_PER_WINDOW as usize);
        assert_eq!(log.held, 990);
        assert_eq!(log.due(), log.window.map(|w| w + LOG_WINDOW));
        log.flush();
        assert_eq!((log.held, log.due()), (0, None));
    }
}
