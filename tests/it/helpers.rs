//! Test support: a real server (`App`) on 127.0.0.1:0 with policies in a temporary directory, a
//! hand-driven clock, and a gRPC client; raw HTTP/2 and HTTP/1 exchanges; the real binary in a
//! process of its own; real `redis-server`s ([`redis`]).

pub mod envoy;
pub mod redis;

use std::net::SocketAddr;
use std::sync::Arc;

use sluice::app::{App, AppError};
use sluice::limiter::{Backend, ManualClock, MemoryStore};
use sluice::pb::rate_limit_service_client::RateLimitServiceClient;
use sluice::pb::{RateLimitDescriptor, RateLimitRequest, RateLimitResponse, rate_limit_descriptor};
use sluice::settings::Written;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

/// A running server and a client for it.
pub struct TestServer {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    /// The metrics and debug listeners, when on.
    pub metrics: Option<SocketAddr>,
    pub debug: Option<SocketAddr>,
    pub clock: Arc<ManualClock>,
    /// The memory backend's store (an empty one when counting in Redis).
    pub store: Arc<MemoryStore>,
    pub client: RateLimitServiceClient<Channel>,
    pub dir: tempfile::TempDir,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), AppError>>>,
}

impl TestServer {
    /// Starts a server with the given policy files (name, YAML).
    pub async fn start(policies: &[(&str, &str)]) -> Self {
        Self::start_with(policies, |_| {}).await
    }

    /// Starts a server with the given policy files, after `tune` adjusts the settings.
    pub async fn start_with(policies: &[(&str, &str)], tune: impl FnOnce(&mut Written)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        for (name, text) in policies {
            std::fs::write(dir.path().join(name), text).expect("write policy");
        }
        Self::start_in(dir, tune).await
    }

    /// Starts a server on the policies already in `dir`.
    pub async fn start_in(dir: tempfile::TempDir, tune: impl FnOnce(&mut Written)) -> Self {
        sluice::tls::install_crypto_provider();
        let mut settings = Written {
            grpc_addr: "127.0.0.1:0".parse().unwrap(),
            admin_addr: "127.0.0.1:0".parse().unwrap(),
            policies: dir.path().to_path_buf(),
            shutdown_grace_ms: 2_000,
            ..Written::default()
        };
        tune(&mut settings);
        sluice::tls::install_crypto_provider();
        let settings = settings.validate().expect("valid settings");
        let tls = settings.grpc_tls.is_some();
        // Start well away from 0 so "TAT 0 = fresh key" is never confused with a real time.
        let clock = Arc::new(ManualClock::new(1_000_000_000_000));
        let app = App::bind_with_clock(settings, clock.clone())
            .await
            .expect("bind");
        let store = match app.backend() {
            Backend::Memory { store, .. } => Arc::clone(store),
            Backend::Redis(_) | Backend::Leased(_) => Arc::new(MemoryStore::new()),
        };
        let (grpc, admin) = (app.grpc_addr(), app.admin_addr());
        let (metrics, debug) = (app.metrics_addr(), app.debug_addr());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(app.run(async {
            let _ = stopped.await;
        }));
        // Over TLS this plaintext client could not connect: it stays unconnected, unused.
        let client = if tls {
            RateLimitServiceClient::new(
                Channel::from_shared(format!("http://{grpc}"))
                    .expect("valid uri")
                    .connect_lazy(),
            )
        } else {
            RateLimitServiceClient::connect(format!("http://{grpc}"))
                .await
                .expect("connect")
        };
        Self {
            grpc,
            admin,
            metrics,
            debug,
            clock,
            store,
            client,
            dir,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// A gRPC health client connected to the server.
    pub async fn health(&self) -> tonic_health::pb::health_client::HealthClient<Channel> {
        let channel = Channel::from_shared(format!("http://{}", self.grpc))
            .expect("valid uri")
            .connect()
            .await
            .expect("connect");
        tonic_health::pb::health_client::HealthClient::new(channel)
    }

    /// Calls `ShouldRateLimit`.
    pub async fn call(&self, req: RateLimitRequest) -> Result<RateLimitResponse, tonic::Status> {
        self.client
            .clone()
            .should_rate_limit(req)
            .await
            .map(tonic::Response::into_inner)
    }

    /// Calls `ShouldRateLimit` and expects an answer.
    pub async fn ok(&self, req: RateLimitRequest) -> RateLimitResponse {
        self.call(req).await.expect("ShouldRateLimit failed")
    }

    /// Stops the server and waits for it.
    pub async fn stop(mut self) -> Result<(), AppError> {
        self.begin_stop();
        self.task.take().expect("running").await.expect("join")
    }

    /// Asks the server to stop without waiting.
    pub fn begin_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.begin_stop();
    }
}

/// One descriptor from (key, value) entries.
pub fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| rate_limit_descriptor::Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

/// A request of one or more descriptors.
pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

/// A request with one descriptor of one entry.
pub fn single(domain: &str, key: &str, value: &str) -> RateLimitRequest {
    request(domain, vec![descriptor(&[(key, value)])])
}

/// A plain HTTP/1.1 GET on the admin port: (status, body).
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    http(addr, "GET", path, "").await
}

/// A plain HTTP/1.1 request on the admin port: (status, body).
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let raw = http_raw(addr, method, path, body).await;
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let body = raw
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// A plain HTTP/1.1 request on the admin port: the whole response, headers included.
pub async fn http_raw(addr: SocketAddr, method: &str, path: &str, body: &str) -> String {
    http_raw_with(addr, method, path, &[], body).await
}

/// As [`http_raw`], with more request headers.
pub async fn http_raw_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let more: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n{more}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = String::new();
    s.read_to_string(&mut buf).await.expect("read");
    buf
}

/// The value of one sample (`name{labels}`, labels in the exposition's order) in `/metrics`.
pub async fn metric(addr: SocketAddr, series: &str) -> Option<f64> {
    let (_, body) = http_get(addr, "/metrics").await;
    body.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// Polls `check` every 20 ms until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: std::time::Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A small deterministic generator, so a failing schedule can be replayed.
/// The seeds of a randomized test: the one in environment variable `var`, to replay a run,
/// else two from the time.
pub fn seeds(var: &str) -> Vec<u64> {
    match std::env::var(var) {
        Ok(s) => vec![s.parse().expect("a seed is a number")],
        Err(_) => {
            let base = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64;
            vec![base, base ^ 0x9e37_79b9_7f4a_7c15]
        }
    }
}

pub struct Lcg(pub u64);

impl Lcg {
    /// The next number below `n`.
    pub fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bound, then released), for a server a
/// test starts.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A gRPC answer as the wire carried it.
#[derive(Debug)]
pub struct RawAnswer {
    pub http: http::StatusCode,
    pub headers: http::HeaderMap,
    pub data: Vec<u8>,
    pub trailers: Option<http::HeaderMap>,
}

impl RawAnswer {
    /// `grpc-status` and `grpc-message`: in the headers of a trailers-only answer, else in the
    /// trailers.
    pub fn status(&self) -> (String, String) {
        let field = |headers: &http::HeaderMap, name: &str| {
            headers
                .get(name)
                .map(|v| v.to_str().unwrap_or_default().to_string())
        };
        let from = if self.headers.contains_key("grpc-status") {
            &self.headers
        } else {
            self.trailers.as_ref().expect("trailers")
        };
        (
            field(from, "grpc-status").unwrap_or_default(),
            field(from, "grpc-message").unwrap_or_default(),
        )
    }
}

/// `message` with its gRPC prefix (not compressed).
pub fn grpc_framed(message: &[u8]) -> Vec<u8> {
    let mut frame = vec![0u8];
    frame.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    frame.extend_from_slice(message);
    frame
}

/// One call to `path` over a raw HTTP/2 connection, with `headers` (and `content-type:
/// application/grpc` unless they name one), its body sent as the given DATA frames; the stream is ended after the last one when `end`.
/// Reads the whole answer.
pub async fn raw_exchange(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    frames: &[&[u8]],
    end: bool,
) -> (RawAnswer, h2::SendStream<bytes::Bytes>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (h2, conn) = h2::client::handshake(tcp).await.expect("handshake");
    tokio::spawn(conn);
    let mut h2 = h2.ready().await.expect("ready");
    let mut req = http::Request::post(format!("http://{addr}{path}")).header("te", "trailers");
    if !headers.iter().any(|(name, _)| *name == "content-type") {
        req = req.header("content-type", "application/grpc");
    }
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let (response, mut body) = h2
        .send_request(req.body(()).expect("request"), frames.is_empty() && end)
        .expect("send");
    for (i, frame) in frames.iter().enumerate() {
        let last = i + 1 == frames.len();
        body.send_data(bytes::Bytes::copy_from_slice(frame), last && end)
            .expect("data");
    }
    let response = response.await.expect("response");
    let http = response.status();
    let headers = response.headers().clone();
    let mut recv = response.into_body();
    let mut data = Vec::new();
    while let Some(chunk) = recv.data().await {
        data.extend_from_slice(&chunk.expect("body"));
    }
    let trailers = recv.trailers().await.expect("trailers");
    (
        RawAnswer {
            http,
            headers,
            data,
            trailers,
        },
        body,
    )
}

/// Sends `message` (gRPC-framed here) to `ShouldRateLimit` over a raw HTTP/2 connection and
/// returns the answer's `grpc-status` and `grpc-message`.
pub async fn raw_call(addr: SocketAddr, message: &[u8]) -> (String, String) {
    let framed = grpc_framed(message);
    let (answer, _) = raw_exchange(addr, SHOULD_RATE_LIMIT, &[], &[&framed], true).await;
    answer.status()
}

/// The path of `ShouldRateLimit`.
pub const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Whether a test that needs `programs` (each run with `version_arg`, from the Debian
/// `packages`) must skip: one is not installed and this is not CI. On CI (`CI` set, as
/// `.ci/run` runs) a missing program fails the test instead, so such tests cannot silently stop
/// running there.
fn missing(test: &str, programs: &[&str], version_arg: &str, packages: &str) -> bool {
    use std::io::Write;
    let installed = programs.iter().all(|bin| {
        std::process::Command::new(bin)
            .arg(version_arg)
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if installed {
        return false;
    }
    let names = programs.join(" and ");
    assert!(
        std::env::var_os("CI").is_none(),
        "{test}: {names} required on CI (Debian: apt-get install {packages})"
    );
    // Straight to stderr, past the test harness's capture, so the skip is seen.
    let _ = writeln!(
        std::io::stderr(),
        "{test}: skipped: {names} not installed (Debian: apt-get install {packages})"
    );
    true
}

/// Whether a test that needs `redis-server` and `redis-cli` must skip (see [`missing`]).
pub fn redis_missing(test: &str) -> bool {
    missing(
        test,
        &["redis-server", "redis-cli"],
        "--version",
        "redis-server redis-tools",
    )
}

/// As [`redis_missing`], for tests that also need `redis-sentinel`.
pub fn sentinel_missing(test: &str) -> bool {
    redis_missing(test) || missing(test, &["redis-sentinel"], "--version", "redis-sentinel")
}

/// Whether a test that needs the `openssl` command (to make test certificates) must skip.
pub fn openssl_missing(test: &str) -> bool {
    missing(test, &["openssl"], "version", "openssl")
}

/// Runs `openssl` with `args` in `dir` (to make test certificates); panics with its stderr when
/// it fails.
pub fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The real `sluice serve` binary in a process of its own, on loopback ports it chose, with
/// the given policy files: its metrics are its own, not the test binary's shared recorder.
pub struct Process {
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
    /// Holds the policies and the config until the process is gone.
    _dir: tempfile::TempDir,
    child: std::process::Child,
    /// The log lines after "serving" (JSON), as they arrive.
    log: std::sync::mpsc::Receiver<serde_json::Value>,
    /// The log lines up to and including "serving".
    pub startup: Vec<serde_json::Value>,
}

impl Process {
    /// Starts `sluice serve` on `policies` with `settings` (YAML lines) added to its config.
    pub fn start(policies: &[(&str, &str)], settings: &str) -> Self {
        use std::io::{BufRead, BufReader};
        let dir = tempfile::tempdir().expect("tempdir");
        let policy_dir = dir.path().join("policies");
        std::fs::create_dir(&policy_dir).expect("mkdir");
        for (name, text) in policies {
            std::fs::write(policy_dir.join(name), text).expect("write policy");
        }
        let config = dir.path().join("sluice.yaml");
        std::fs::write(
            &config,
            format!(
                "grpc_addr: 127.0.0.1:0\nadmin_addr: 127.0.0.1:0\npolicies: {}\n{settings}",
                policy_dir.display()
            ),
        )
        .expect("write config");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["serve", "--config"])
            .arg(&config)
            .args(["--log-format", "json"])
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run sluice serve");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let mut startup = Vec::new();
        let (grpc, admin) = loop {
            let line = lines
                .next()
                .expect("sluice exited before serving")
                .expect("log");
            let event: serde_json::Value = serde_json::from_str(&line).expect("json log");
            startup.push(event.clone());
            if event["message"] == "serving" {
                let addr = |k: &str| event[k].as_str().expect(k).parse().expect(k);
                break (addr("grpc"), addr("admin"));
            }
        };
        // Read as they come, so that the process never blocks on a full pipe.
        let (send, log) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let Ok(event) = serde_json::from_str(&line) else {
                    continue;
                };
                if send.send(event).is_err() {
                    break;
                }
            }
        });
        Self {
            grpc,
            admin,
            _dir: dir,
            child,
            log,
            startup,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The log lines after "serving" not read yet, until none comes for `quiet`.
    pub fn log_for(&self, quiet: std::time::Duration) -> Vec<serde_json::Value> {
        let mut lines = Vec::new();
        while let Ok(event) = self.log.recv_timeout(quiet) {
            lines.push(event);
        }
        lines
    }

    /// The first log line after "serving" with the message `message`, waiting at most `within`.
    pub fn logged(&self, message: &str, within: std::time::Duration) -> Option<serde_json::Value> {
        let deadline = std::time::Instant::now() + within;
        loop {
            let left = deadline.checked_duration_since(std::time::Instant::now())?;
            let event = self.log.recv_timeout(left).ok()?;
            if event["message"] == message {
                return Some(event);
            }
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
