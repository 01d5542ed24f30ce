//! TLS on the gRPC port: a call over TLS (rustls client, h2 on top) is answered; a peer that
//! connects and never sends its ClientHello is cut at the handshake timeout without holding up
//! other clients; a certificate and key that do not belong together stop the start with an
//! error naming the setting. Certificates are made by the `openssl` command in a temp dir.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use prost::Message;
use sluice::app::App;
use sluice::settings::Written;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::helpers::{TestServer, openssl, openssl_missing, single};

const POLICY: &str = r"
domain: test
descriptors:
  - key: free
    rate_limit: {unlimited: true}
";

const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

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

fn with_tls(certs: &Path, handshake_timeout_ms: u64) -> impl FnOnce(&mut Written) {
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
        let mut raw = Written {
            grpc_addr: "127.0.0.1:0".parse().unwrap(),
            admin_addr: "127.0.0.1:0".parse().unwrap(),
            policies: policies.path().to_path_buf(),
            ..Written::default()
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

/// A self-signed certificate for localhost valid from `start` to `end` (`YYYYMMDDHHMMSSZ`), as
/// `name.crt` and `name.key` in `dir` (`openssl ca`, which alone takes both dates).
fn dated_cert(dir: &Path, name: &str, start: &str, end: &str) {
    let ca = dir.join(format!("{name}-ca"));
    std::fs::create_dir_all(&ca).unwrap();
    std::fs::write(ca.join("index.txt"), "").unwrap();
    std::fs::write(ca.join("serial"), "01\n").unwrap();
    std::fs::write(
        ca.join("ca.cnf"),
        "[ca]\ndefault_ca = d\n[d]\ndatabase = index.txt\nnew_certs_dir = .\nserial = serial\n\
         default_md = sha256\npolicy = p\n[p]\ncommonName = supplied\n[ext]\n\
         subjectAltName = DNS:localhost,IP:127.0.0.1\n",
    )
    .unwrap();
    let key = dir.join(format!("{name}.key"));
    let crt = dir.join(format!("{name}.crt"));
    let (key, crt) = (key.to_str().unwrap(), crt.to_str().unwrap());
    openssl(
        &ca,
        &[
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            key,
            "-out",
            "r.csr",
            "-subj",
            "/CN=localhost",
        ],
    );
    openssl(
        &ca,
        &[
            "ca",
            "-batch",
            "-notext",
            "-selfsign",
            "-config",
            "ca.cnf",
            "-extensions",
            "ext",
            "-keyfile",
            key,
            "-in",
            "r.csr",
            "-out",
            crt,
            "-startdate",
            start,
            "-enddate",
            end,
        ],
    );
}

/// `sluice serve` as a process of its own, serving `name.crt`/`name.key` of `dir` on the gRPC
/// port: its log and its metrics are its own.
fn serve_tls(dir: &Path, name: &str) -> crate::helpers::Process {
    crate::helpers::Process::start(
        &[("test.yaml", POLICY)],
        &format!(
            "grpc:\n  tls:\n    cert_file: {}\n    key_file: {}\n",
            dir.join(format!("{name}.crt")).display(),
            dir.join(format!("{name}.key")).display()
        ),
    )
}

/// The line logged before "serving" with `message`.
fn at_start<'a>(p: &'a crate::helpers::Process, message: &str) -> &'a serde_json::Value {
    p.startup
        .iter()
        .find(|e| e["message"] == message)
        .unwrap_or_else(|| panic!("{message:?} not in {:?}", p.startup))
}

/// The gauge of a served certificate's end, from the server's `/metrics`.
async fn not_after(admin: std::net::SocketAddr) -> Option<f64> {
    crate::helpers::metric(
        admin,
        "sluice_tls_certificate_not_after_timestamp_seconds{certificate=\"grpc\"}",
    )
    .await
}

/// Starting on an expired pair, or on one that is not valid yet, logs an error naming the
/// date; one that ends within 14 days, a warning; each served certificate's end is a gauge.
#[tokio::test]
async fn a_certificate_out_of_its_dates_is_logged_at_error_with_its_gauge() {
    if openssl_missing("a_certificate_out_of_its_dates_is_logged_at_error_with_its_gauge") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    dated_cert(dir.path(), "old", "20200101000000Z", "20200102000000Z");
    dated_cert(dir.path(), "future", "20990101000000Z", "20990102000000Z");
    make_certs(dir.path());
    let cases = [
        (
            "old",
            "ERROR",
            "TLS certificate has expired: peers that verify it refuse the connection",
            1_577_923_200.0,
        ),
        (
            "future",
            "ERROR",
            "TLS certificate is not valid yet: peers that verify it refuse the connection",
            4_070_995_200.0,
        ),
    ];
    for (name, level, message, end) in cases {
        let p = serve_tls(dir.path(), name);
        let line = at_start(&p, message);
        assert_eq!(line["level"], level, "{name}");
        assert_eq!(line["certificate"], "grpc");
        assert_eq!(not_after(p.admin).await, Some(end), "{name}");
    }
    // make_certs' pair ends in 2 days.
    let p = serve_tls(dir.path(), "server");
    let soon = at_start(&p, "TLS certificate expires within 14 days");
    assert_eq!(soon["level"], "WARN");
    assert!(not_after(p.admin).await.unwrap() > 1.0e9);
}

/// A rotation to an expired pair is refused like a bad PEM: logged at error, the served pair
/// kept (its gauge too). A certificate file deleted from under the server is logged at warn
/// and the served pair stays; a good pair written back is loaded.
#[tokio::test]
async fn a_rotation_to_an_expired_pair_keeps_the_served_one() {
    if openssl_missing("a_rotation_to_an_expired_pair_keeps_the_served_one") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    make_certs(dir.path());
    dated_cert(dir.path(), "old", "20200101000000Z", "20200102000000Z");
    let p = serve_tls(dir.path(), "server");
    let served = not_after(p.admin).await.unwrap();
    let within = Duration::from_secs(10);
    let (crt, key) = (dir.path().join("server.crt"), dir.path().join("server.key"));
    let good = (std::fs::read(&crt).unwrap(), std::fs::read(&key).unwrap());
    std::fs::copy(dir.path().join("old.key"), &key).unwrap();
    std::fs::copy(dir.path().join("old.crt"), &crt).unwrap();
    let refused = p
        .logged(
            "new gRPC TLS certificate has expired; not loaded, keeping the served one",
            within,
        )
        .expect("the refusal is logged");
    assert_eq!(refused["level"], "ERROR");
    assert_eq!(refused["not_after"], "2020-01-02T00:00:00Z");
    assert_eq!(not_after(p.admin).await, Some(served));
    assert_eq!(call_over_tls(p.grpc, &dir.path().join("ca.crt")).await, "0");
    std::fs::remove_file(&crt).unwrap();
    let gone = p
        .logged(
            "gRPC TLS certificate or key unusable on disk; keeping the served pair",
            within,
        )
        .expect("the missing file is logged");
    assert_eq!(gone["level"], "WARN");
    assert!(
        gone["problem"].as_str().unwrap().contains("server.crt"),
        "{gone}"
    );
    assert_eq!(call_over_tls(p.grpc, &dir.path().join("ca.crt")).await, "0");
    std::fs::write(&key, &good.1).unwrap();
    std::fs::write(&crt, &good.0).unwrap();
    assert!(p.logged("gRPC TLS certificate reloaded", within).is_some());
}

/// The Redis client certificate is judged the same way when its files are read: expired, an
/// error at start-up and its gauge, whether or not Redis can be reached.
#[tokio::test]
async fn an_expired_redis_client_certificate_is_logged_at_error_with_its_gauge() {
    if openssl_missing("an_expired_redis_client_certificate_is_logged_at_error_with_its_gauge") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    dated_cert(dir.path(), "old", "20200101000000Z", "20200102000000Z");
    let port = crate::helpers::free_port();
    let p = crate::helpers::Process::start(
        &[("test.yaml", POLICY)],
        &format!(
            "backend: redis\nredis:\n  url: rediss://127.0.0.1:{port}\n  tls:\n    cert_file: {}\n    key_file: {}\n",
            dir.path().join("old.crt").display(),
            dir.path().join("old.key").display()
        ),
    );
    let line = at_start(
        &p,
        "TLS certificate has expired: peers that verify it refuse the connection",
    );
    assert_eq!(line["level"], "ERROR");
    assert_eq!(line["certificate"], "redis_client");
    assert_eq!(
        crate::helpers::metric(
            p.admin,
            "sluice_tls_certificate_not_after_timestamp_seconds{certificate=\"redis_client\"}"
        )
        .await,
        Some(1_577_923_200.0)
    );
}
