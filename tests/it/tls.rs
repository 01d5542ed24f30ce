//! TLS on the gRPC port: a call over TLS (rustls client, h2 on top) is answered; a peer that
//! connects and never sends its ClientHello is cut at the handshake timeout without holding up
//! other clients; a certificate and key that do not belong together stop the start with an
//! error naming the setting. Certificates are made by the `openssl` command in a temp dir.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use prost::Message;
use sluice::app::App;
use sluice::settings::RawSettings;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::helpers::{TestServer, openssl_missing, single};

const POLICY: &str = r"
domain: test
descriptors:
  - key: free
    rate_limit: {unlimited: true}
";

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Runs `openssl` with `args` in `dir`; panics with its stderr when it fails.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
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

/// A CA (`ca.crt`) and a server certificate for `localhost`/127.0.0.1 signed by it
/// (`server.crt`, `server.key`), in `dir`.
fn make_certs(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=sluice test CA",
        ],
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    );
}

fn with_tls(certs: &Path, handshake_timeout_ms: u64) -> impl FnOnce(&mut RawSettings) {
    let certs = certs.to_path_buf();
    move |s| {
        s.grpc.tls.cert_file = Some(certs.join("server.crt"));
        s.grpc.tls.key_file = Some(certs.join("server.key"));
        s.grpc.tls.handshake_timeout_ms = handshake_timeout_ms;
    }
}

/// One `ShouldRateLimit` call over TLS (trusting `ca`, ALPN h2): the grpc-status.
async fn call_over_tls(addr: std::net::SocketAddr, ca: &Path) -> String {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca).unwrap();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots.add(cert.unwrap()).unwrap();
    }
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .expect("TLS handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
    let (client, conn) = h2::client::handshake(tls).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut client = client.ready().await.unwrap();
    let req = http::Request::post(format!("https://localhost{PATH}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (resp, mut body) = client.send_request(req, false).unwrap();
    let msg = single("test", "free", "x").encode_to_vec();
    let mut framed = vec![0];
    framed.extend_from_slice(&u32::try_from(msg.len()).unwrap().to_be_bytes());
    framed.extend_from_slice(&msg);
    body.send_data(Bytes::from(framed), true).unwrap();
    let mut recv = resp.await.expect("response").into_body();
    while let Some(chunk) = recv.data().await {
        let _ = recv.flow_control().release_capacity(chunk.unwrap().len());
    }
    let trailers = recv.trailers().await.unwrap().expect("trailers");
    trailers["grpc-status"].to_str().unwrap().to_string()
}

#[tokio::test]
async fn a_call_over_tls_is_answered() {
    if openssl_missing("a_call_over_tls_is_answered") {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path());
    let server =
        TestServer::start_with(&[("test.yaml", POLICY)], with_tls(certs.path(), 5_000)).await;
    assert_eq!(
        call_over_tls(server.grpc, &certs.path().join("ca.crt")).await,
        "0"
    );
    // Plaintext HTTP/2 on the TLS port is not served.
    let mut tcp = TcpStream::connect(server.grpc).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut tcp, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "a plaintext connection is still open");
    assert!(
        !buf.starts_with(&[0, 0]),
        "answered with HTTP/2 frames: {buf:02x?}"
    );
}

#[tokio::test]
async fn a_peer_that_never_says_hello_is_cut_at_the_handshake_timeout() {
    if openssl_missing("a_peer_that_never_says_hello_is_cut_at_the_handshake_timeout") {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path());
    let server = TestServer::start_with(&[("test.yaml", POLICY)], |s| {
        with_tls(certs.path(), 300)(s);
        // The silent peers fill the cap; their places must come back.
        s.grpc.max_connections = 2;
    })
    .await;
    let started = Instant::now();
    let mut silent = TcpStream::connect(server.grpc).await.unwrap();
    let mut silent2 = TcpStream::connect(server.grpc).await.unwrap();
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), silent.read_to_end(&mut buf)).await;
    assert!(
        closed.is_ok(),
        "a connection without a ClientHello is still open"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "cut too early"
    );
    let closed = tokio::time::timeout(Duration::from_secs(5), silent2.read_to_end(&mut buf)).await;
    assert!(closed.is_ok(), "the second silent connection is still open");
    // Their places under the cap are free again: a real client is served.
    assert_eq!(
        call_over_tls(server.grpc, &certs.path().join("ca.crt")).await,
        "0"
    );
}

#[tokio::test]
async fn a_key_that_does_not_match_the_certificate_stops_the_start() {
    if openssl_missing("a_key_that_does_not_match_the_certificate_stops_the_start") {
        return;
    }
    let certs = tempfile::tempdir().unwrap();
    make_certs(certs.path());
    let policies = tempfile::tempdir().unwrap();
    std::fs::write(policies.path().join("test.yaml"), POLICY).unwrap();
    let start = |cert: PathBuf, key: PathBuf| {
        let mut raw = RawSettings {
            grpc_addr: "127.0.0.1:0".parse().unwrap(),
            admin_addr: "127.0.0.1:0".parse().unwrap(),
            policies: policies.path().to_path_buf(),
            ..RawSettings::default()
        };
        raw.grpc.tls.cert_file = Some(cert);
        raw.grpc.tls.key_file = Some(key);
        async move { App::bind(raw.validate().unwrap()).await.map(|_| ()) }
    };
    let p = |name: &str| certs.path().join(name);
    // The CA's key beside the server's certificate.
    let err = start(p("server.crt"), p("ca.key"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("grpc.tls.key_file") && err.contains("ca.key"),
        "{err}"
    );
    // A certificate file with no certificate in it.
    let err = start(p("server.key"), p("server.key"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("grpc.tls.cert_file") && err.contains("no PEM certificate"),
        "{err}"
    );
    let err = start(p("missing.crt"), p("server.key"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cannot read grpc.tls.cert_file") && err.contains("missing.crt"),
        "{err}"
    );
    // The key's contents are never in the message.
    let key = std::fs::read_to_string(p("server.key")).unwrap();
    let body = key.lines().nth(1).unwrap();
    assert!(!err.contains(body));
}
