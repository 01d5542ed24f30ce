//! Opening connections to Redis: the URLs, TLS files and credentials of a [`RedisConfig`] made
//! into a redis-rs client, then one connection and a `PING` (`Connector`); and, with Sentinel,
//! following the master through a failover. Every file is read at each attempt, so a file rotated
//! while Redis was unreachable is used by the next one; no error carries a secret.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{ClientTlsConfig, ConnectionAddr, ConnectionInfo, IntoConnectionInfo, TlsCertificates};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::limiter::error::BackendError;
use crate::limiter::error::ConnectError;
use crate::limiter::redis::RedisStore;
use crate::limiter::redis::config::{RedisAuth, RedisConfig, RedisTls};
use crate::limiter::redis::redact::redact;
use crate::limiter::redis::sentinel::{Found, Sentinels};

/// The most bytes read from a certificate, key or password file: a careless path (a device,
/// a log) must not fill memory.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// The shortest and longest wait between two checks of the sentinels after failures.
const FOLLOW_MIN: Duration = Duration::from_millis(100);
const FOLLOW_MAX: Duration = Duration::from_secs(1);

/// A connection to Redis: one node (directly or through Sentinel), or a cluster.
#[derive(Clone)]
pub(super) enum RedisConn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Checks that `config` can be used to connect: URLs, TLS options and credentials agree, and
/// every certificate, key and password file can be read and used. Nothing is connected.
///
/// # Errors
///
/// [`ConnectError`] naming the setting (and the file) at fault.
pub fn validate(config: &RedisConfig) -> Result<(), ConnectError> {
    Connector::new(config).map(drop)
}

/// What is read from files at each attempt.
struct Material {
    certs: Option<TlsCertificates>,
    password: Option<String>,
}

/// Opens connections for a config.
///
/// - TLS is asked for by `rediss://` URLs. The CA file (else the system's roots), the client
///   certificate and key (mTLS) and the password file are read at every connection attempt;
///   [`Connector::new`] reads them once too, so a missing or malformed file is a startup error
///   naming the setting and the path, never the contents. Once connected, redis-rs's
///   reconnections reuse what was read for that connection.
/// - `skip_hostname_verification` ignores only a certificate's name mismatch: the chain is still
///   verified against the CA. A URL's `#insecure`, which turns verification off altogether, is
///   refused.
/// - Credentials come from the URL (`redis://user:pass@host`) or from `username` with `password`
///   or `password_file`, never from both. [`Password`](crate::limiter::redis::config::Password)
///   and every error keep the secret out of logs: a refused login is reported with the user name
///   and the problem only.
pub(super) struct Connector {
    urls: Vec<ConnectionInfo>,
    cluster: bool,
    tls: RedisTls,
    auth: RedisAuth,
    connect_timeout: Duration,
    timeout: Duration,
    /// With Redis Sentinel: the sentinels that name the master (single-node mode only).
    pub(super) sentinel: Option<Box<Sentinels>>,
    /// The client certificate's expiry, judged each time the files are read.
    client_expiry: crate::tls::Expiry,
}

impl Connector {
    /// Parses the URLs, checks that the settings agree and reads every file once.
    pub(super) fn new(config: &RedisConfig) -> Result<Self, ConnectError> {
        if config.urls.is_empty() {
            return Err(ConnectError::Invalid("redis.url is empty".into()));
        }
        let mut urls = Vec::with_capacity(config.urls.len());
        let mut tls_urls = 0;
        for url in &config.urls {
            let info = url
                .as_str()
                .into_connection_info()
                .map_err(|e| ConnectError::Invalid(format!("redis.url {}: {e}", redact(url))))?;
            if let ConnectionAddr::TcpTls { insecure, .. } = info.addr() {
                if *insecure {
                    return Err(ConnectError::Invalid(format!(
                        "redis.url {}: #insecure turns certificate verification off and is \
                         not accepted; redis.tls.skip_hostname_verification skips the \
                         hostname check only",
                        redact(url)
                    )));
                }
                tls_urls += 1;
            }
            let redis = info.redis_settings();
            if redis.password().is_some()
                && (config.auth.password.is_some() || config.auth.password_file.is_some())
            {
                return Err(ConnectError::Invalid(format!(
                    "redis.url {} has a password and redis.password or redis.password_file \
                     gives another; give it once",
                    redact(url)
                )));
            }
            if redis.username().is_some() && config.auth.username.is_some() {
                return Err(ConnectError::Invalid(format!(
                    "redis.url {} has a user name and redis.username gives another; give it \
                     once",
                    redact(url)
                )));
            }
            urls.push(info);
        }
        if tls_urls != 0 && tls_urls != urls.len() {
            return Err(ConnectError::Invalid(
                "redis.url mixes rediss:// and redis:// URLs; use rediss:// for every node".into(),
            ));
        }
        if tls_urls == 0 && config.tls.is_set() {
            return Err(ConnectError::Invalid(format!(
                "redis.tls is set but redis.url {} is not rediss://; TLS needs rediss:// URLs",
                config.redacted_urls()
            )));
        }
        if config.tls.cert_file.is_some() != config.tls.key_file.is_some() {
            return Err(ConnectError::Invalid(
                "redis.tls.cert_file and redis.tls.key_file go together: set both or neither"
                    .into(),
            ));
        }
        if config.auth.password.is_some() && config.auth.password_file.is_some() {
            return Err(ConnectError::Invalid(
                "redis.password and redis.password_file are both set; give one".into(),
            ));
        }
        if tls_urls != 0 {
            // redis-rs builds its rustls configs on the process default.
            crate::tls::install_crypto_provider();
        }
        if config.sentinel.is_some() && config.tls.is_set() {
            return Err(ConnectError::Invalid(
                "redis.tls files are not supported with redis.sentinel yet; a rediss:// \
                 redis.url verified against the system's roots is"
                    .into(),
            ));
        }
        let mut connector = Self {
            urls,
            cluster: config.cluster,
            tls: config.tls.clone(),
            auth: config.auth.clone(),
            connect_timeout: config.connect_timeout,
            timeout: config.timeout,
            sentinel: None,
            client_expiry: crate::tls::Expiry::new("redis_client"),
        };
        let material = connector.material()?;
        if let Some(sentinel) = &config.sentinel {
            // The master's credentials, database and scheme; its address comes from the
            // sentinels.
            let master = connector.node(&connector.urls[0], material.password.as_deref());
            connector.sentinel = Some(Box::new(
                Sentinels::new(config, sentinel, master)
                    .map_err(|e| ConnectError::Invalid(e.to_string()))?,
            ));
        }
        Ok(connector)
    }

    /// Reads the files: the certificates checked as rustls will use them, the password file
    /// trimmed.
    fn material(&self) -> Result<Material, ConnectError> {
        let certs = if self.tls.ca_file.is_some() || self.tls.cert_file.is_some() {
            let root_cert = self.tls.ca_file.as_deref().map(read_ca).transpose()?;
            let client_tls = match (&self.tls.cert_file, &self.tls.key_file) {
                (Some(cert), Some(key)) => {
                    let (config, leaf) = read_client(cert, key)?;
                    self.client_expiry
                        .judge(cert, &leaf, crate::tls::expiry::now());
                    Some(config)
                }
                _ => None,
            };
            Some(TlsCertificates {
                client_tls,
                root_cert,
            })
        } else {
            None
        };
        let password = match (&self.auth.password, &self.auth.password_file) {
            (Some(p), _) => Some(p.expose().to_string()),
            (None, Some(path)) => Some(read_password(path)?),
            (None, None) => None,
        };
        Ok(Material { certs, password })
    }

    /// A node's connection info with the credentials set.
    fn node(&self, info: &ConnectionInfo, password: Option<&str>) -> ConnectionInfo {
        let mut redis = info.redis_settings().clone();
        if let Some(user) = &self.auth.username {
            redis = redis.set_username(user);
        }
        if let Some(password) = password {
            redis = redis.set_password(password);
        }
        info.clone().set_redis_settings(redis)
    }

    /// Connects once (reading the files again) and checks the connection with a `PING`.
    pub(super) async fn connect(&self) -> Result<RedisConn, ConnectError> {
        self.open().await.map_err(|e| match e {
            ConnectError::Redis(source)
                if source.kind() == redis::ErrorKind::AuthenticationFailed =>
            {
                let user = self
                    .auth
                    .username
                    .as_deref()
                    .or_else(|| self.urls[0].redis_settings().username())
                    .unwrap_or("default");
                ConnectError::Login {
                    user: user.to_string(),
                    source,
                }
            }
            e => e,
        })
    }

    async fn open(&self) -> Result<RedisConn, ConnectError> {
        if let Some(sentinels) = &self.sentinel {
            return Ok(RedisConn::Single(sentinels.connect().await?));
        }
        let material = self.material()?;
        let password = material.password.as_deref();
        if self.cluster {
            let nodes: Vec<ConnectionInfo> =
                self.urls.iter().map(|u| self.node(u, password)).collect();
            let mut builder = ClusterClientBuilder::new(nodes)
                .connection_timeout(self.connect_timeout)
                .response_timeout(self.timeout)
                .retries(0);
            if let Some(certs) = material.certs {
                builder = builder.certs(certs);
            }
            if self.tls.skip_hostname_verification {
                builder = builder.danger_accept_invalid_hostnames(true);
            }
            let mut conn = builder.build()?.get_async_connection().await?;
            ping(&mut conn).await?;
            Ok(RedisConn::Cluster(conn))
        } else {
            let info = self.node(&self.urls[0], password);
            let client = match material.certs {
                Some(certs) => redis::Client::build_with_tls(info, certs)?,
                None => redis::Client::open(info)?,
            };
            let client = if self.tls.skip_hostname_verification {
                let info = client.get_connection_info().clone();
                let mut addr = info.addr().clone();
                addr.set_danger_accept_invalid_hostnames(true);
                redis::Client::open(info.set_addr(addr))?
            } else {
                client
            };
            let cm = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(self.connect_timeout))
                .set_response_timeout(Some(self.timeout))
                .set_number_of_retries(1)
                .set_max_delay(Duration::from_secs(1));
            let mut conn = ConnectionManager::new_with_config(client, cm).await?;
            ping(&mut conn).await?;
            Ok(RedisConn::Single(conn))
        }
    }
}

/// One `PING`, so that a refused handshake or login shows at connect time.
async fn ping(conn: &mut impl redis::aio::ConnectionLike) -> Result<(), ConnectError> {
    redis::cmd("PING").query_async::<()>(conn).await?;
    Ok(())
}

/// A file's bytes, at most [`MAX_FILE_BYTES`].
fn read(setting: &'static str, path: &Path) -> Result<Vec<u8>, ConnectError> {
    let fail = |reason: String| ConnectError::File {
        setting,
        path: path.to_path_buf(),
        reason,
    };
    let file = std::fs::File::open(path).map_err(|e| fail(format!("cannot be read: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| fail(format!("cannot be read: {e}")))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(fail(format!("larger than {MAX_FILE_BYTES} bytes")));
    }
    Ok(bytes)
}

/// PEM certificates, at least one; errors say what is wrong, never what the file holds.
fn certificates(
    setting: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, ConnectError> {
    let fail = |reason: &str| ConnectError::File {
        setting,
        path: path.to_path_buf(),
        reason: reason.into(),
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| fail("not PEM: a certificate section is malformed"))?;
    if certs.is_empty() {
        return Err(fail(
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        ));
    }
    Ok(certs)
}

/// The CA file, checked as a root store.
fn read_ca(path: &Path) -> Result<Vec<u8>, ConnectError> {
    let pem = read("tls.ca_file", path)?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in certificates("tls.ca_file", path, &pem)? {
        roots.add(cert).map_err(|e| ConnectError::File {
            setting: "tls.ca_file",
            path: path.to_path_buf(),
            reason: format!("not a usable CA certificate: {e}"),
        })?;
    }
    Ok(pem)
}

/// The client certificate and key, checked to belong together.
/// Returns them with the first certificate of the chain (its own), in DER.
fn read_client(
    cert_path: &Path,
    key_path: &Path,
) -> Result<(ClientTlsConfig, CertificateDer<'static>), ConnectError> {
    let client_cert = read("tls.cert_file", cert_path)?;
    let chain = certificates("tls.cert_file", cert_path, &client_cert)?;
    let leaf = chain[0].clone();
    let (client_key, key) = read_key(key_path)?;
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| ConnectError::Invalid(format!("TLS: {e}")))?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_client_auth_cert(chain, key)
        .map_err(|e| ConnectError::File {
            setting: "tls.key_file",
            path: key_path.to_path_buf(),
            reason: format!(
                "does not fit redis.tls.cert_file {}: {e}",
                cert_path.display()
            ),
        })?;
    Ok((
        ClientTlsConfig {
            client_cert,
            client_key,
        },
        leaf,
    ))
}

/// The key file: its bytes and its one private key.
fn read_key(path: &Path) -> Result<(Vec<u8>, PrivateKeyDer<'static>), ConnectError> {
    let pem = read("tls.key_file", path)?;
    let fail = |reason: String| ConnectError::File {
        setting: "tls.key_file",
        path: path.to_path_buf(),
        reason,
    };
    // The parser's own errors may quote a line of the file: none of it is repeated.
    let key = PrivateKeyDer::from_pem_slice(&pem).map_err(|_| {
        fail(
            "holds no PEM private key (PKCS#8, PKCS#1 or SEC1: -----BEGIN PRIVATE KEY-----)".into(),
        )
    })?;
    // Decoded, not yet understood: load it as the handshake will (rustls's error names the
    // problem, never the key).
    rustls::crypto::ring::default_provider()
        .key_provider
        .load_private_key(key.clone_key())
        .map_err(|e| fail(format!("not a usable private key: {e}")))?;
    Ok((pem, key))
}

/// The password file's text without its trailing newline.
fn read_password(path: &Path) -> Result<String, ConnectError> {
    let fail = |reason: &str| ConnectError::File {
        setting: "password_file",
        path: path.to_path_buf(),
        reason: reason.into(),
    };
    let bytes = read("password_file", path)?;
    let text = String::from_utf8(bytes).map_err(|_| fail("is not UTF-8 text"))?;
    let password = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(&text);
    if password.is_empty() {
        return Err(fail("is empty"));
    }
    Ok(password.to_string())
}

impl Connector {
    /// Notes a failed call; with Sentinel, one a failover explains wakes the follower.
    pub(super) fn failed(&self, e: &BackendError) {
        if let Some(s) = &self.sentinel
            && Sentinels::wakes(e)
        {
            s.wake.notify_one();
        }
    }
}

impl RedisStore {
    /// With Sentinel, follows failovers for as long as it runs; returns at once otherwise.
    ///
    /// A call that fails for a reason a failover explains (connection refused or reset, a
    /// timeout, the breaker open, `READONLY` from a demoted master) wakes it; it asks the
    /// sentinels again and, when they name another master that confirms its role, swaps the
    /// store's connection and closes the breaker. Checks are spaced by a back-off (100 ms
    /// doubling to 1 s) and, after a failed one, repeated on their own, so a dead master is
    /// left soon after the sentinels' promotion, without a busy loop. Meanwhile calls fail fast
    /// and decisions get `on_backend_error`.
    pub(super) async fn follow_failovers(&self) {
        let Some(sentinels) = &self.connector.sentinel else {
            return;
        };
        let mut delay = FOLLOW_MIN;
        let mut again = false;
        loop {
            if !again {
                sentinels.wake.notified().await;
            }
            let current = sentinels.lock().clone();
            match sentinels.find(current.as_ref()).await {
                Ok(Found::Same) => {
                    again = false;
                    delay = FOLLOW_MIN;
                }
                Ok(Found::New(addr, conn)) => {
                    self.conn.store(Some(Arc::new(RedisConn::Single(conn))));
                    // The new master just answered: no cool-down to sit out.
                    self.breaker.success();
                    tracing::warn!(
                        master = %addr,
                        previous = %current.map(|a| a.to_string()).unwrap_or_default(),
                        name = %sentinels.master_name,
                        "redis sentinel: switched to a new master"
                    );
                    *sentinels.lock() = Some(addr);
                    again = false;
                    delay = FOLLOW_MIN;
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_ms = delay.as_millis(), "redis sentinel: no usable master yet; asking again");
                    again = true;
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(FOLLOW_MAX);
                    continue;
                }
            }
            // At most one check per back-off step, however many calls fail meanwhile.
            tokio::time::sleep(delay).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::redis::config::Password;

    fn config(urls: &[&str]) -> RedisConfig {
        RedisConfig {
            urls: urls.iter().map(|u| (*u).to_string()).collect(),
            cluster: false,
            key_prefix: "t:".into(),
            timeout: Duration::from_millis(10),
            connect_timeout: Duration::from_millis(10),
            breaker_failures: 0,
            breaker_cooldown: Duration::from_millis(10),
            deny_cache_keys: 0,
            tls: RedisTls::default(),
            auth: RedisAuth::default(),
            sentinel: None,
        }
    }

    fn invalid(config: &RedisConfig) -> String {
        match Connector::new(config) {
            Ok(_) => panic!("accepted {config:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn contradicting_settings_are_refused_by_name() {
        let mut c = config(&["redis://127.0.0.1:6379"]);
        c.tls.skip_hostname_verification = true;
        assert!(invalid(&c).contains("not rediss://"));
        let c = config(&["rediss://127.0.0.1:6379/#insecure"]);
        assert!(invalid(&c).contains("#insecure"));
        let c = config(&["rediss://a:1", "redis://b:2"]);
        assert!(invalid(&c).contains("mixes"));
        let mut c = config(&["rediss://a:1"]);
        c.tls.cert_file = Some("/c.pem".into());
        assert!(invalid(&c).contains("go together"));
        let mut c = config(&["redis://u:hunter2@a:1"]);
        c.auth.password = Some(Password::new("other"));
        let err = invalid(&c);
        assert!(
            err.contains("give it once") && !err.contains("hunter2"),
            "{err}"
        );
        let mut c = config(&["redis://a:1"]);
        c.auth.password = Some(Password::new("x"));
        c.auth.password_file = Some("/p".into());
        assert!(invalid(&c).contains("both set"));
        // A plain config is fine, and a rediss:// URL alone uses the system's roots.
        assert!(Connector::new(&config(&["redis://a:1"])).is_ok());
        assert!(Connector::new(&config(&["rediss://a:1"])).is_ok());
    }

    #[test]
    fn bad_files_name_the_setting_and_the_path_not_the_contents() {
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "hunter2 is not a certificate\n").unwrap();
        let missing = dir.path().join("missing.pem");
        let mut c = config(&["rediss://a:1"]);
        c.tls.ca_file = Some(missing.clone());
        let err = invalid(&c);
        assert!(
            err.starts_with(&format!(
                "redis.tls.ca_file {}: cannot be read",
                missing.display()
            )),
            "{err}"
        );
        c.tls.ca_file = Some(junk.clone());
        let err = invalid(&c);
        assert!(
            err.contains("no PEM certificate") && !err.contains("hunter2"),
            "{err}"
        );
        c.tls.ca_file = None;
        c.tls.cert_file = Some(junk.clone());
        c.tls.key_file = Some(junk.clone());
        assert!(invalid(&c).starts_with("redis.tls.cert_file"));
        // A key section with a secret-looking line in it: the parser's error is not repeated.
        let key = dir.path().join("key.pem");
        std::fs::write(
            &key,
            "-----BEGIN PRIVATE KEY-----\nhunter2hunter2\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        let mut c = config(&["redis://a:1"]);
        c.auth.password_file = Some(dir.path().join("nope"));
        assert!(invalid(&c).starts_with("redis.password_file"));
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        c.auth.password_file = Some(empty);
        assert!(invalid(&c).ends_with("is empty"));
        let err = read_key(&key).unwrap_err().to_string();
        assert!(
            err.starts_with("redis.tls.key_file") && !err.contains("hunter2"),
            "{err}"
        );
    }

    #[test]
    fn the_password_file_loses_one_trailing_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p");
        for (text, want) in [
            ("s3cret\n", "s3cret"),
            ("s3cret\r\n", "s3cret"),
            ("s3 cret", "s3 cret"),
            ("s3cret\n\n", "s3cret\n"),
        ] {
            std::fs::write(&path, text).unwrap();
            assert_eq!(read_password(&path).unwrap(), want);
        }
        std::fs::write(&path, [0xff, 0xfe]).unwrap();
        assert!(
            read_password(&path)
                .unwrap_err()
                .to_string()
                .contains("not UTF-8")
        );
    }

    #[test]
    fn passwords_stay_out_of_debug() {
        let mut c = config(&["redis://a:1"]);
        c.auth.username = Some("sluice".into());
        c.auth.password = Some(Password::new("hunter2"));
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("hunter2") && shown.contains("sluice"),
            "{shown}"
        );
    }
}
