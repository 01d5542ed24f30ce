//! Bounded connections: what one peer can hold on the gRPC and admin ports. Raw HTTP/2 frames
//! (and the `h2` client where a well-behaved peer is wanted) against a real server: a flood of
//! header-only streams leaves memory bounded and other clients served; the stream limit is
//! advertised; idle connections, header-only streams and half-sent admin requests are closed
//! in bounded time; connections past the cap are closed; non-gRPC content types get 415.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::helpers::{TestServer, single};

const POLICY: &str = r"
domain: test
descriptors:
  - key: free
    rate_limit: {unlimited: true}
";

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const SETTINGS: u8 = 0x4;
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;
const REFUSED_STREAM: u32 = 0x7;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
    let mut f = vec![len[1], len[2], len[3], kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// One frame: (type, flags, stream, payload); `None` at end of stream or on a reset.
async fn read_frame(r: &mut (impl AsyncRead + Unpin)) -> Option<(u8, u8, u32, Vec<u8>)> {
    let mut head = [0u8; 9];
    r.read_exact(&mut head).await.ok()?;
    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0; len];
    r.read_exact(&mut payload).await.ok()?;
    Some((head[3], head[4], stream, payload))
}

/// A request header block for `ShouldRateLimit` with a `grpc-timeout` of `timeout`, from the
/// static table and literals only, so the same bytes are valid on every stream (RFC 7541: no
/// dynamic-table state).
fn request_headers(timeout: &str) -> Vec<u8> {
    let mut b = vec![0x83, 0x86]; // :method POST, :scheme http
    let mut literal = |name_index: u8, value: &str| {
        b.push(name_index); // literal without indexing, indexed name (4-bit prefix)
        b.push(u8::try_from(value.len()).unwrap());
        b.extend_from_slice(value.as_bytes());
    };
    literal(0x04, PATH); // :path
    literal(0x01, "localhost"); // :authority
    b.extend_from_slice(&[0x0f, 0x10]); // content-type (index 31 = 15 + 16)
    b.push(16);
    b.extend_from_slice(b"application/grpc");
    b.extend_from_slice(&[0x00, 2, b't', b'e', 8]);
    b.extend_from_slice(b"trailers");
    // Literal without indexing, new name.
    b.extend_from_slice(&[0x00, 12]);
    b.extend_from_slice(b"grpc-timeout");
    b.push(u8::try_from(timeout.len()).unwrap());
    b.extend_from_slice(timeout.as_bytes());
    b
}

/// Connects, sends the preface and an empty SETTINGS, reads the server's SETTINGS and acks
/// it. `None` when the server closes the connection instead.
async fn raw_h2(addr: SocketAddr) -> Option<(TcpStream, Vec<u8>)> {
    let mut s = TcpStream::connect(addr).await.ok()?;
    s.write_all(PREFACE).await.ok()?;
    s.write_all(&frame(SETTINGS, 0, 0, &[])).await.ok()?;
    let (kind, flags, _, payload) =
        tokio::time::timeout(Duration::from_secs(5), read_frame(&mut s))
            .await
            .ok()??;
    assert_eq!(
        (kind, flags),
        (SETTINGS, 0),
        "the server speaks first with SETTINGS"
    );
    s.write_all(&frame(SETTINGS, ACK, 0, &[])).await.ok()?;
    Some((s, payload))
}

/// The value of one setting in a SETTINGS payload.
fn setting(payload: &[u8], id: u16) -> Option<u32> {
    payload.chunks_exact(6).find_map(|c| {
        (u16::from_be_bytes([c[0], c[1]]) == id)
            .then(|| u32::from_be_bytes([c[2], c[3], c[4], c[5]]))
    })
}

/// This process's resident set, in bytes (the server runs in it).
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

fn grpc_body() -> Bytes {
    let msg = single("test", "free", "x").encode_to_vec();
    let mut b = vec![0];
    b.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
    b.extend_from_slice(&msg);
    Bytes::from(b)
}

fn grpc_request(addr: SocketAddr, content_type: &str) -> http::Request<()> {
    http::Request::post(format!("http://{addr}{PATH}"))
        .header("content-type", content_type)
        .header("te", "trailers")
        .body(())
        .unwrap()
}

type H2Client = h2::client::SendRequest<Bytes>;

/// A well-behaved HTTP/2 client (it answers PINGs and SETTINGS); the task ends when the server
/// closes the connection.
async fn h2_client(addr: SocketAddr) -> (H2Client, tokio::task::JoinHandle<()>) {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (client, conn) = h2::client::handshake(tcp).await.expect("handshake");
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    (client, task)
}

/// Sends one `ShouldRateLimit` call: (HTTP status, grpc-status from trailers or headers).
async fn call(client: &H2Client, addr: SocketAddr, content_type: &str) -> (u16, String) {
    let (resp, body) = open_call(client, addr, content_type).await;
    finish_call(resp, body).await
}

/// Opens a `ShouldRateLimit` call: its headers sent, its body not yet.
async fn open_call(
    client: &H2Client,
    addr: SocketAddr,
    content_type: &str,
) -> (h2::client::ResponseFuture, h2::SendStream<Bytes>) {
    let mut ready = client.clone().ready().await.expect("connection open");
    ready
        .send_request(grpc_request(addr, content_type), false)
        .expect("send request")
}

/// Sends an open call's body and reads its answer within 10 s: (HTTP status, grpc-status from
/// trailers or headers).
async fn finish_call(
    resp: h2::client::ResponseFuture,
    mut body: h2::SendStream<Bytes>,
) -> (u16, String) {
    body.send_data(grpc_body(), true).expect("send body");
    let resp = tokio::time::timeout(Duration::from_secs(10), resp)
        .await
        .expect("the call is answered in time")
        .expect("response");
    let status = resp.status().as_u16();
    let mut grpc_status = resp
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_string());
    let mut recv = resp.into_body();
    while let Some(chunk) = recv.data().await {
        let chunk = chunk.expect("body");
        let _ = recv.flow_control().release_capacity(chunk.len());
    }
    if let Ok(Some(trailers)) = recv.trailers().await {
        grpc_status = trailers
            .get("grpc-status")
            .map(|v| v.to_str().unwrap().to_string());
    }
    (status, grpc_status.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_header_only_streams_leaves_memory_bounded_and_others_served() {
    const STREAMS: u32 = 30_000;
    let server = TestServer::start(&[("test.yaml", POLICY)]).await;
    server.ok(single("test", "free", "warm-up")).await;
    let before = rss();

    let (s, _) = raw_h2(server.grpc).await.expect("handshake");
    let (mut r, mut w) = s.into_split();
    // Each stream the server takes is answered DEADLINE_EXCEEDED by its call 200 ms after it
    // was taken, so once every stream taken is answered every call has been made and run. The
    // reader counts refusals and answers, and stops when the server closes the connection, or
    // once the PING is answered (every HEADERS before it has been processed) and every stream
    // taken is answered.
    let reader = tokio::spawn(async move {
        let (mut refused, mut goaway, mut pinged) = (0u32, false, false);
        let mut answered = std::collections::HashSet::new();
        while let Some((kind, flags, stream, payload)) = read_frame(&mut r).await {
            match kind {
                RST_STREAM if payload[..] == REFUSED_STREAM.to_be_bytes() => refused += 1,
                RST_STREAM => {
                    answered.insert(stream);
                }
                HEADERS | DATA if flags & END_STREAM != 0 => {
                    answered.insert(stream);
                }
                GOAWAY => goaway = true,
                PING if flags & ACK != 0 => pinged = true,
                _ => {}
            }
            if pinged && answered.len() + refused as usize == STREAMS as usize {
                break;
            }
        }
        (refused, goaway)
    });
    let writer = tokio::spawn(async move {
        let block = request_headers("200m");
        let mut batch = Vec::new();
        for i in 0..STREAMS {
            batch.extend(frame(HEADERS, END_HEADERS, 2 * i + 1, &block));
            if batch.len() > 64 * 1024 || i + 1 == STREAMS {
                if w.write_all(&batch).await.is_err() {
                    return;
                }
                batch.clear();
            }
        }
        let _ = w.write_all(&frame(PING, 0, 0, &[0; 8])).await;
        // Keep the connection open until the test is done with it.
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(w);
    });

    // Meanwhile another client is served, and the resident set is sampled until the flood is
    // processed and its streams answered: its largest size is measured.
    let mut served = 0;
    let mut largest = rss();
    let started = Instant::now();
    while !reader.is_finished() && started.elapsed() < Duration::from_secs(30) {
        server
            .ok(single("test", "free", &format!("other-{served}")))
            .await;
        served += 1;
        largest = largest.max(rss());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (refused, goaway) = tokio::time::timeout(Duration::from_secs(30), reader)
        .await
        .expect("the flood is processed in time")
        .unwrap();
    let grown = largest.max(rss()).saturating_sub(before);
    server.ok(single("test", "free", "after")).await;
    writer.abort();

    // Unbounded, each held stream costs about 9 KB: 30,000 of them over 250 MB. The margin
    // leaves room for the tests running beside this one.
    assert!(
        grown < 96 << 20,
        "resident set grew {} MiB under {STREAMS} header-only streams",
        grown >> 20
    );
    assert!(served > 0, "no call completed during the flood");
    assert!(
        refused > 0 || goaway,
        "streams past the limit must be refused (refused {refused}, goaway {goaway})"
    );
}

/// A connection's calls run in its own task: a call waiting for its body holds up none of the
/// others on the same connection, many calls sent at once are all answered, and the waiting
/// call is answered once its body comes.
#[tokio::test]
async fn calls_waiting_on_one_connection_hold_up_none_of_its_others() {
    let server = TestServer::start(&[("test.yaml", POLICY)]).await;
    let addr = server.grpc;
    let (client, _conn) = h2_client(addr).await;
    let (waiting, waiting_body) = open_call(&client, addr, "application/grpc").await;
    // Frames of one connection are read in order: once this call is answered, the waiting
    // call has been accepted and started.
    assert_eq!(
        call(&client, addr, "application/grpc").await,
        (200, "0".to_string())
    );

    let calls: Vec<_> = (0..64)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { call(&client, addr, "application/grpc").await })
        })
        .collect();
    for c in calls {
        let answered = tokio::time::timeout(Duration::from_secs(10), c)
            .await
            .expect("a call beside the waiting one is answered")
            .unwrap();
        assert_eq!(answered, (200, "0".to_string()));
    }

    // Answered once its body comes.
    assert_eq!(
        finish_call(waiting, waiting_body).await,
        (200, "0".to_string())
    );
}

#[tokio::test]
async fn the_stream_and_header_limits_are_advertised() {
    let server = TestServer::start_with(&[("test.yaml", POLICY)], |s| {
        s.grpc.max_concurrent_streams = 77;
        s.grpc.max_header_list_bytes = 9_000;
    })
    .await;
    let (_s, settings) = raw_h2(server.grpc).await.expect("handshake");
    // SETTINGS_MAX_CONCURRENT_STREAMS (0x3), SETTINGS_MAX_HEADER_LIST_SIZE (0x6).
    assert_eq!(setting(&settings, 0x3), Some(77), "{settings:02x?}");
    assert_eq!(setting(&settings, 0x6), Some(9_000), "{settings:02x?}");
}

#[tokio::test]
async fn an_idle_connection_is_closed_and_a_busy_one_is_not() {
    let server = TestServer::start_with(&[("test.yaml", POLICY)], |s| {
        s.grpc.request_timeout_ms = 200;
        s.grpc.idle_timeout_ms = 600;
        // Pings (answered by the h2 client) must not count as traffic.
        s.grpc.keepalive_interval_ms = 100;
        s.grpc.keepalive_timeout_ms = 5_000;
    })
    .await;
    let addr = server.grpc;

    let (busy, busy_conn) = h2_client(addr).await;
    let (_idle, idle_conn) = h2_client(addr).await;
    let opened = Instant::now();
    // The busy connection calls every 150 ms for three idle timeouts.
    while opened.elapsed() < Duration::from_millis(1_800) {
        assert_eq!(
            call(&busy, addr, "application/grpc").await,
            (200, "0".into())
        );
        assert!(!busy_conn.is_finished(), "a busy connection was closed");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert!(idle_conn.is_finished(), "the idle connection is still open");
    // A raw connection that never sends a request is closed too.
    let (mut raw, _) = raw_h2(addr).await.expect("handshake");
    let started = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        // Server SETTINGS ack, then PINGs, then nothing.
        while read_frame(&mut raw).await.is_some() {}
    })
    .await;
    assert!(closed.is_ok(), "a raw idle connection is still open");
    assert!(started.elapsed() >= Duration::from_millis(400));
}

#[tokio::test]
async fn a_header_only_stream_is_answered_at_the_request_timeout() {
    let server = TestServer::start_with(&[("test.yaml", POLICY)], |s| {
        s.grpc.request_timeout_ms = 300;
    })
    .await;
    let (client, _conn) = h2_client(server.grpc).await;
    let mut ready = client.ready().await.unwrap();
    let started = Instant::now();
    let (resp, _body) = ready
        .send_request(grpc_request(server.grpc, "application/grpc"), false)
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(5), resp)
        .await
        .expect("a stream without a body is answered in bounded time")
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(250));
    // DEADLINE_EXCEEDED, as gRPC's status-code specification lists for a deadline that
    // expires before the server answers (tonic's own server timeout would say CANCELLED).
    assert_eq!(resp.headers()["grpc-status"], "4", "{:?}", resp.headers());
}

#[tokio::test]
async fn connections_past_the_cap_are_closed() {
    let server = TestServer::start_with(&[("test.yaml", POLICY)], |s| {
        // The test server's own client holds one.
        s.grpc.max_connections = 3;
    })
    .await;
    let first = raw_h2(server.grpc).await.expect("second connection");
    let _second = raw_h2(server.grpc).await.expect("third connection");
    assert!(
        raw_h2(server.grpc).await.is_none(),
        "a fourth connection was served"
    );
    drop(first);
    let mut again = None;
    let deadline = Instant::now() + Duration::from_secs(5);
    while again.is_none() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        again = raw_h2(server.grpc).await;
    }
    assert!(again.is_some(), "a freed place is not reused");
    server.ok(single("test", "free", "x")).await;
}

#[tokio::test]
async fn only_protobuf_grpc_content_types_are_served() {
    let server = TestServer::start(&[("test.yaml", POLICY)]).await;
    let addr = server.grpc;
    let (client, _conn) = h2_client(addr).await;
    for ct in ["application/grpc", "application/grpc+proto"] {
        assert_eq!(call(&client, addr, ct).await, (200, "0".into()), "{ct}");
    }
    for ct in ["application/json", "application/grpc+json", "text/plain"] {
        assert_eq!(call(&client, addr, ct).await.0, 415, "{ct}");
    }
}

#[tokio::test]
async fn the_admin_port_closes_a_connection_that_never_finishes_its_headers() {
    let server = TestServer::start_with(&[("test.yaml", POLICY)], |s| {
        s.admin.header_read_timeout_ms = 300;
    })
    .await;
    let mut s = TcpStream::connect(server.admin).await.unwrap();
    s.write_all(b"GET /healthcheck HTTP/1.1\r\nHost: test\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
    assert!(
        closed.is_ok(),
        "a connection with half a request head is still open"
    );
    assert!(started.elapsed() >= Duration::from_millis(250));
    // A complete request is still answered.
    let (status, body) = crate::helpers::http_get(server.admin, "/healthcheck").await;
    assert_eq!((status, body.as_str()), (200, "OK"));
}

#[tokio::test]
async fn a_connection_past_its_max_age_is_sent_goaway_and_its_call_in_flight_completes() {
    let server = TestServer::start_with(&[("test.yaml", POLICY)], |s| {
        s.grpc.max_connection_age_ms = 300;
        s.grpc.max_connection_age_grace_ms = 5_000;
    })
    .await;
    let addr = server.grpc;
    let opened = Instant::now();
    let (client, conn) = h2_client(addr).await;
    // A call in flight across the age: its headers now, its body after the GOAWAY.
    let (resp, body) = open_call(&client, addr, "application/grpc").await;
    // New calls on the connection are taken until its age and jitter (at most 330 ms) pass;
    // from the GOAWAY on, none is.
    loop {
        let refused = match client.clone().ready().await {
            Err(_) => true,
            Ok(mut c) => match c.send_request(grpc_request(addr, "application/grpc"), true) {
                Err(_) => true,
                Ok((resp, _)) => resp.await.is_err(),
            },
        };
        if refused {
            break;
        }
        assert!(
            opened.elapsed() < Duration::from_millis(700),
            "new streams are still taken 700 ms after the connection opened, past its age"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(finish_call(resp, body).await, (200, "0".to_string()));
    // With nothing left in flight the connection closes, long before the grace ends.
    tokio::time::timeout(Duration::from_secs(3), conn)
        .await
        .expect("the aged connection closes once drained")
        .unwrap();
    // A new connection is served as usual.
    server.ok(single("test", "free", "after")).await;
}

#[tokio::test]
async fn a_connection_past_its_max_age_and_grace_is_closed() {
    let server = TestServer::start_with(&[("test.yaml", POLICY)], |s| {
        s.grpc.max_connection_age_ms = 200;
        s.grpc.max_connection_age_grace_ms = 300;
    })
    .await;
    let (client, conn) = h2_client(server.grpc).await;
    // A header-only call that never ends by itself before the request timeout (5 s).
    let mut ready = client.ready().await.unwrap();
    let started = Instant::now();
    let (_resp, _body) = ready
        .send_request(grpc_request(server.grpc, "application/grpc"), false)
        .unwrap();
    tokio::time::timeout(Duration::from_secs(3), conn)
        .await
        .expect("closed at age + grace")
        .unwrap();
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(400), "closed after {took:?}");
}
