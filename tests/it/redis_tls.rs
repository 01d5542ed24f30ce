//! TLS and authentication to real `redis-server`s with certificates made by `openssl`: single
//! node and cluster, mutual TLS, an untrusted CA, another name's certificate, ACL users with a
//! password from a file or the URL, and a wrong password never printed.
//! Skips without `redis-server` or `openssl` unless `CI` is set (`helpers::redis_missing`).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::limiter::gcra::NANOS_PER_SEC;
use sluice::limiter::redis::Password;
use sluice::limiter::{Charge, ManualClock, Mode, Op, Quota, RedisConfig, RedisStore, RedisTime};
use sluice::pb::rate_limit_response::Code;
use sluice::settings::BackendKind;

use crate::helpers::redis::RedisProcess;
use crate::helpers::{
    TestServer, eventually, free_port, http_get, openssl_missing, redis_missing, single,
};

/// Whether the test must skip (a notice printed) for want of Redis or openssl.
fn missing(test: &str) -> bool {
    redis_missing(test) || openssl_missing(test)
}

/// A CA, another CA nobody trusts, and certificates signed by the first: `server` for
/// 127.0.0.1 and localhost, `elsewhere` for another name only, `client` for mTLS.
struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Self {
        let pki = Self {
            dir: tempfile::tempdir().unwrap(),
        };
        pki.ca("ca");
        pki.ca("other-ca");
        pki.leaf(
            "server",
            // clientAuth too: cluster nodes present it to each other on the cluster bus.
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
        );
        pki.leaf(
            "elsewhere",
            "subjectAltName=DNS:redis.elsewhere.example\nextendedKeyUsage=serverAuth\n",
        );
        pki.leaf("client", "extendedKeyUsage=clientAuth\n");
        pki
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(self.dir.path())
            .output()
            .expect("openssl must be installed (Debian package openssl)");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn ca(&self, name: &str) {
        self.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN=sluice test {name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
        ]);
    }

    fn leaf(&self, name: &str, extensions: &str) {
        std::fs::write(
            self.path(&format!("{name}.ext")),
            format!("basicConstraints=CA:FALSE\n{extensions}"),
        )
        .unwrap();
        self.openssl(&[
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-subj",
            &format!("/CN=sluice test {name}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.csr"),
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.pem"),
        ]);
    }
}

/// `redis-server` on a free port, plain TCP, with `extra` arguments.
fn plain(extra: &[&str]) -> RedisProcess {
    let port = free_port();
    RedisProcess::spawn(port, extra)
}

/// `redis-server` on a free port, TLS only, with the `cert` certificate of `pki`; client
/// certificates required when `auth_clients`.
fn tls(pki: &Pki, cert: &str, auth_clients: bool, extra: &[&str]) -> RedisProcess {
    let port = free_port();
    let path = |name: &str| pki.path(name).display().to_string();
    RedisProcess::listening(
        port,
        &[
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--tls-cert-file",
            &path(&format!("{cert}.pem")),
            "--tls-key-file",
            &path(&format!("{cert}.key")),
            "--tls-ca-cert-file",
            &path("ca.pem"),
            "--tls-auth-clients",
            if auth_clients { "yes" } else { "no" },
        ],
        extra,
    )
}

fn config(url: &str) -> RedisConfig {
    RedisConfig {
        key_prefix: "sluice-tls:".into(),
        timeout: Duration::from_secs(2),
        connect_timeout: Duration::from_secs(2),
        breaker_failures: 0,
        ..crate::helpers::redis::config(url)
    }
}

fn trusting(url: &str, pki: &Pki) -> RedisConfig {
    let mut c = config(url);
    c.tls.ca_file = Some(pki.path("ca.pem"));
    c
}

fn store(config: RedisConfig) -> Arc<RedisStore> {
    sluice::tls::install_crypto_provider();
    RedisStore::new(config, Arc::new(ManualClock::new(0)), RedisTime::Server).unwrap()
}

/// Why one connection attempt with `config` fails.
async fn refused(config: RedisConfig) -> String {
    match store(config).try_connect().await {
        Ok(()) => panic!("connected"),
        Err(e) => e.to_string(),
    }
}

/// Connects `config` for serving and charges one counter (limit 2) three times: the third is
/// refused, so the answers come from Redis.
async fn decides(config: RedisConfig) {
    let store = store(config);
    let serving = Arc::clone(&store);
    let task = tokio::spawn(async move { serving.connect().await });
    assert!(
        eventually(Duration::from_secs(10), || {
            let s = Arc::clone(&store);
            async move { s.is_connected() }
        })
        .await,
        "never connected"
    );
    // A counter of its own for each call.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let key = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let op = [Op {
        key: u128::from(key),
        quota: Quota::new(3_600 * NANOS_PER_SEC, 2, 2).unwrap(),
        cost: 1,
        charge: Charge::Ask,
        mode: Mode::Enforce,
    }];
    let mut blocked = Vec::new();
    for _ in 0..3 {
        blocked.push(store.count_batch(&op).await.expect("decided").blocked);
    }
    assert_eq!(blocked, [false, false, true]);
    task.abort();
}

#[tokio::test]
async fn decisions_go_through_tls_and_an_untrusted_ca_is_refused() {
    if missing("decisions_go_through_tls_and_an_untrusted_ca_is_refused") {
        return;
    }
    let pki = Pki::new();
    let redis = tls(&pki, "server", false, &[]);
    let url = format!("rediss://127.0.0.1:{}", redis.port);
    decides(trusting(&url, &pki)).await;
    // Also by the name in the certificate.
    decides(trusting(
        &format!("rediss://localhost:{}", redis.port),
        &pki,
    ))
    .await;
    // A CA that did not sign the server's certificate.
    let mut c = config(&url);
    c.tls.ca_file = Some(pki.path("other-ca.pem"));
    let err = refused(c.clone()).await;
    assert!(err.contains("UnknownIssuer"), "{err}");
    // Skipping the hostname check does not skip the chain.
    c.tls.skip_hostname_verification = true;
    let err = refused(c).await;
    assert!(err.contains("UnknownIssuer"), "{err}");
    // Plain text to a TLS port fails too, rather than hanging.
    let err = refused(config(&format!("redis://127.0.0.1:{}", redis.port))).await;
    assert!(!err.is_empty());
}

#[tokio::test]
async fn a_certificate_for_another_name_is_refused_unless_hostname_verification_is_skipped() {
    if missing("a_certificate_for_another_name_is_refused_unless_hostname_verification_is_skipped")
    {
        return;
    }
    let pki = Pki::new();
    let redis = tls(&pki, "elsewhere", false, &[]);
    let url = format!("rediss://127.0.0.1:{}", redis.port);
    let err = refused(trusting(&url, &pki)).await;
    assert!(err.contains("not valid for name"), "{err}");
    let mut c = trusting(&url, &pki);
    c.tls.skip_hostname_verification = true;
    decides(c).await;
}

#[tokio::test]
async fn a_server_requiring_client_certificates_wants_one() {
    if missing("a_server_requiring_client_certificates_wants_one") {
        return;
    }
    let pki = Pki::new();
    let redis = tls(&pki, "server", true, &[]);
    let url = format!("rediss://127.0.0.1:{}", redis.port);
    let err = refused(trusting(&url, &pki)).await;
    // The server's TLS alert, as rustls reports it.
    assert!(
        err.contains("CertificateRequired"),
        "the error names the missing certificate: {err}"
    );
    let mut c = trusting(&url, &pki);
    c.tls.cert_file = Some(pki.path("client.pem"));
    c.tls.key_file = Some(pki.path("client.key"));
    decides(c.clone()).await;
    // A key that is not the certificate's: refused at setup, naming both files.
    c.tls.key_file = Some(pki.path("server.key"));
    let err = RedisStore::new(c, Arc::new(ManualClock::new(0)), RedisTime::Server)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("redis.tls.key_file") && err.contains("client.pem"),
        "{err}"
    );
}

#[tokio::test]
async fn a_tls_cluster_decides() {
    if missing("a_tls_cluster_decides") {
        return;
    }
    let pki = Pki::new();
    let nodes: Vec<RedisProcess> = (0..3)
        .map(|_| {
            tls(
                &pki,
                "server",
                false,
                &[
                    "--tls-cluster",
                    "yes",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    "2000",
                ],
            )
        })
        .collect();
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let cli_tls = |cmd: &mut Command| {
        cmd.args(["--tls", "--cacert"]).arg(pki.path("ca.pem"));
    };
    let mut create = Command::new("redis-cli");
    cli_tls(&mut create);
    let out = create
        .args(["--cluster", "create"])
        .args(&addrs)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .output()
        .expect("redis-cli must be installed (Debian package redis-tools)");
    assert!(
        out.status.success(),
        "cluster create failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    for n in &nodes {
        loop {
            let mut info = Command::new("redis-cli");
            cli_tls(&mut info);
            let info = info
                .args(["-p", &n.port.to_string(), "cluster", "info"])
                .output()
                .unwrap();
            if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                break;
            }
            assert!(Instant::now() < deadline, "cluster never became ok");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let mut c = trusting("", &pki);
    c.urls = addrs.iter().map(|a| format!("rediss://{a}")).collect();
    c.cluster = true;
    decides(c).await;
}

/// A server whose `default` user is off and whose `sluice` user has a password, with only the
/// keys and the commands sluice needs (as docs/src/fleet/redis.md lists them).
fn acl_server() -> RedisProcess {
    plain(&[
        "--user",
        "default",
        "off",
        "--user",
        "sluice",
        "on",
        ">s3cret-horse",
        "~sluice-tls:*",
        "+ping",
        "+evalsha",
        "+eval",
        "+script|load",
        "+time",
        "+get",
        "+mget",
        "+set",
        "+del",
    ])
}

#[tokio::test]
async fn an_acl_user_logs_in_from_a_file_or_the_url_and_a_wrong_password_stays_secret() {
    if redis_missing("an_acl_user_logs_in_from_a_file_or_the_url_and_a_wrong_password_stays_secret")
    {
        return;
    }
    let redis = acl_server();
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("password");
    // As a Kubernetes Secret mounted as a file: a trailing newline.
    std::fs::write(&file, "s3cret-horse\n").unwrap();
    let mut c = config(&url);
    c.auth.username = Some("sluice".into());
    c.auth.password_file = Some(file.clone());
    decides(c.clone()).await;
    decides(config(&format!(
        "redis://sluice:s3cret-horse@127.0.0.1:{}",
        redis.port
    )))
    .await;
    // The file is read at each attempt: a rotated (here: wrong) password is used next time.
    std::fs::write(&file, "wrong-battery\n").unwrap();
    let err = refused(c.clone()).await;
    assert!(
        err.contains("refused the login as user \"sluice\""),
        "{err}"
    );
    assert!(!err.contains("wrong-battery"), "{err}");
    c.auth.password_file = None;
    c.auth.password = Some(Password::new("wrong-battery"));
    let err = refused(c).await;
    assert!(
        err.contains("refused the login") && !err.contains("wrong-battery"),
        "{err}"
    );
    // No credentials: the default user is off.
    let err = refused(config(&url)).await;
    assert!(err.contains("NOAUTH") || err.contains("WRONGPASS"), "{err}");
}

#[tokio::test]
async fn the_server_decides_over_tls_with_an_acl_user_from_its_settings() {
    if missing("the_server_decides_over_tls_with_an_acl_user_from_its_settings") {
        return;
    }
    let pki = Pki::new();
    let redis = tls(
        &pki,
        "server",
        true,
        &[
            "--user",
            "default",
            "off",
            "--user",
            "sluice",
            "on",
            ">s3cret-horse",
            "~sluice:*",
            "+@all",
        ],
    );
    let url = format!("rediss://127.0.0.1:{}", redis.port);
    let (ca, cert, key) = (
        pki.path("ca.pem"),
        pki.path("client.pem"),
        pki.path("client.key"),
    );
    let s = TestServer::start_with(
        &[("r.yaml", "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n")],
        move |settings| {
            settings.backend = BackendKind::Redis;
            settings.redis.url = url;
            settings.redis.username = "sluice".into();
            settings.redis.password = "s3cret-horse".into();
            settings.redis.tls.ca_file = ca.display().to_string();
            settings.redis.tls.cert_file = cert.display().to_string();
            settings.redis.tls.key_file = key.display().to_string();
            settings.redis.timeout_ms = 2_000;
            settings.redis.connect_timeout_ms = 2_000;
        },
    )
    .await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            s.call(single("d", "k", "warmup")).await.is_ok()
        })
        .await,
        "server never reached redis"
    );
    let codes: Vec<i32> =
        futures_util::future::join_all((0..3).map(|_| s.call(single("d", "k", "v"))))
            .await
            .into_iter()
            .map(|r| r.expect("answered").overall_code)
            .collect();
    let over = codes
        .iter()
        .filter(|c| **c == Code::OverLimit as i32)
        .count();
    assert_eq!(over, 1, "{codes:?}");
    let (_, metrics) = http_get(s.admin, "/metrics").await;
    assert!(!metrics.contains("s3cret-horse"));
}

/// The binary with a wrong password in `SLUICE_REDIS__PASSWORD`: it serves, answers with its
/// backend-error policy, and logs why it cannot connect (a refused login) without the password.
#[test]
fn a_wrong_password_is_logged_by_its_problem_never_by_its_value() {
    if redis_missing("a_wrong_password_is_logged_by_its_problem_never_by_its_value") {
        return;
    }
    let redis = acl_server();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("serve")
        .env_clear()
        .envs([
            (
                "SLUICE_POLICIES",
                concat!(env!("CARGO_MANIFEST_DIR"), "/config/policies"),
            ),
            ("SLUICE_GRPC_ADDR", "127.0.0.1:0"),
            ("SLUICE_ADMIN_ADDR", "127.0.0.1:0"),
            ("SLUICE_LOG_FORMAT", "json"),
            ("SLUICE_BACKEND", "redis"),
            (
                "SLUICE_REDIS__URL",
                &format!("redis://127.0.0.1:{}", redis.port),
            ),
            ("SLUICE_REDIS__USERNAME", "sluice"),
            ("SLUICE_REDIS__PASSWORD", "wrong-battery-staple"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sluice");
    let lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let (mut serving, mut refused) = (false, None);
    let mut seen = Vec::new();
    for line in lines {
        let Ok(line) = line else { break };
        assert!(!line.contains("wrong-battery-staple"), "{line}");
        let event: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
        serving |= event["message"] == "serving";
        if event["message"] == "cannot connect to redis; retrying" {
            refused = Some(event["error"].as_str().unwrap_or_default().to_string());
        }
        seen.push(line);
        if serving && refused.is_some() {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let refused = refused.unwrap_or_else(|| panic!("no connection failure logged: {seen:#?}"));
    assert!(refused.contains("refused the login"), "{refused}");
}
