//! TLS for the gRPC port, with rustls on the ring provider ([`ServerTls`]): the server's
//! certificate and key read from PEM files ([`TlsFiles`]) and re-read when they change
//! ([`ServerTls::watch`]), each served certificate's expiry judged ([`expiry`]), and optionally
//! mTLS (client certificates verified against a CA file, and a DNS subject alternative name
//! required of them). It does not re-read the CA file or the required SAN (both are read once,
//! at start-up), and the admin port stays plain HTTP.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ParsedCertificate, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig};
use tokio_util::sync::CancellationToken;

pub mod expiry;

pub use expiry::{Expiry, NOT_AFTER_METRIC, Standing};

/// What the gRPC port's TLS is loaded from (and reloaded from when the files change).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain (PEM).
    pub cert_file: PathBuf,
    /// Its private key (PEM).
    pub key_file: PathBuf,
    /// With mTLS, the CA certificates (PEM) client certificates must chain to.
    pub client_ca_file: Option<PathBuf>,
    /// With mTLS, a DNS name client certificates must carry as a subject alternative name.
    pub client_san: Option<String>,
    /// Longest a connection may take to complete its handshake.
    pub handshake_timeout: Duration,
}

/// How often the certificate and key files are re-read.
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// Makes ring rustls's process-wide default provider, once at start-up, for any library that
/// asks rustls for the default; a no-op when one is installed already. The configs built here
/// never depend on that global: each is built with ring's provider explicitly.
pub fn install_crypto_provider() {
    // Err only when a provider is installed already, which is what this asks for.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Why the gRPC port's TLS cannot be set up (or a new certificate cannot be loaded).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file cannot be read.
    #[error("cannot read {setting} {path}: {source}")]
    Read {
        /// The setting naming the file.
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A file holds no usable PEM of the kind the setting needs.
    #[error("{setting} {path}: {reason}")]
    Pem {
        /// The setting naming the file.
        setting: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The key cannot be used with the certificate.
    #[error("grpc.tls.key_file {key} cannot be used with grpc.tls.cert_file {cert}: {reason}")]
    Pair {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// Why (the key does not match, or its algorithm is not supported).
        reason: String,
    },
    /// `grpc.tls.client_san` is not a DNS name.
    #[error("grpc.tls.client_san {0:?} is not a DNS name")]
    ClientSan(String),
    /// The client verifier cannot be built from the CA file.
    #[error("grpc.tls.client_ca_file {path}: {reason}")]
    ClientCa {
        /// The CA file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

fn ring() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The gRPC port's TLS: the config handshakes use, and the certificate it serves.
#[derive(Clone)]
pub struct ServerTls {
    acceptor: tokio_rustls::TlsAcceptor,
    certs: Arc<Certs>,
    handshake_timeout: Duration,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert_file", &self.certs.cert_file)
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Loads the certificate, the key and (for mTLS) the client CA named by `settings`. A pair
    /// that has expired or is not valid yet is logged at error and served: there is no other.
    ///
    /// # Errors
    ///
    /// [`TlsError`] naming the setting and the file that cannot be used.
    pub fn load(settings: &TlsFiles) -> Result<Self, TlsError> {
        let provider = ring();
        let (pair, seen) = load_pair(&settings.cert_file, &settings.key_file, &provider)?;
        let expiry = Expiry::new("grpc");
        expiry.judge(&settings.cert_file, &pair.cert[0], expiry::now());
        let certs = Arc::new(Certs {
            current: ArcSwap::from_pointee(pair),
            seen: std::sync::Mutex::new(seen),
            missing: std::sync::Mutex::new(None),
            cert_file: settings.cert_file.clone(),
            key_file: settings.key_file.clone(),
            provider: Arc::clone(&provider),
            expiry,
        });
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| TlsError::ClientCa {
                path: PathBuf::new(),
                reason: e.to_string(),
            })?;
        let builder = match &settings.client_ca_file {
            None => builder.with_no_client_auth(),
            Some(ca) => builder.with_client_cert_verifier(client_verifier(
                ca,
                settings.client_san.as_deref(),
                &provider,
            )?),
        };
        let mut config = builder.with_cert_resolver(Arc::clone(&certs) as _);
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Self {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            certs,
            handshake_timeout: settings.handshake_timeout,
        })
    }

    /// The acceptor that runs handshakes with the current certificate.
    #[must_use]
    pub fn acceptor(&self) -> &tokio_rustls::TlsAcceptor {
        &self.acceptor
    }

    /// Longest a handshake may take.
    #[must_use]
    pub fn handshake_timeout(&self) -> Duration {
        self.handshake_timeout
    }

    /// Re-reads the certificate and key every `every` ([`RELOAD_EVERY`]) until `stop`, serving
    /// a new pair from the next handshake on once it loads; a pair that does not load is logged
    /// and skipped.
    ///
    /// cert-manager and Kubernetes Secret volumes replace the files (through a `..data` symlink
    /// swap) without telling anyone. Polling the contents, not file events or mtimes, sees every
    /// way a file can be replaced (symlink swaps, renames, copies within one second) and costs
    /// two small reads; the pair is loaded only when the files' bytes changed. The certificate is
    /// chosen per handshake by a resolver over an `ArcSwap`, so new connections get the new pair
    /// while open ones keep theirs.
    ///
    /// The served pair stays when a new one does not load (bad PEM, a key that does not match:
    /// logged at error once), when the new one has expired (refused like a bad PEM, logged at
    /// error), and when a file is deleted or emptied from under the server (an unmounted Secret:
    /// logged at warn, once). A new pair not valid yet is logged at error and served: it becomes
    /// valid by itself, and the pair it replaces may expire first. A served pair within
    /// [`expiry::WARN_WITHIN`] of its end is logged at warn once a day, and each served
    /// certificate's end is the gauge [`NOT_AFTER_METRIC`].
    pub async fn watch(self, every: Duration, stop: CancellationToken) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let certs = Arc::clone(&self.certs);
            // File reads and key parsing block; keep them off the serving threads.
            let _ = tokio::task::spawn_blocking(move || certs.reload()).await;
        }
    }
}

/// The served certificate and key, and where they are re-read from.
struct Certs {
    current: ArcSwap<CertifiedKey>,
    /// A fingerprint of the files' bytes last tried, so an unchanged pair is not parsed again
    /// and a broken one is logged once.
    seen: std::sync::Mutex<u64>,
    /// Why the files could not be read at the last try (gone, empty), so it is logged once.
    missing: std::sync::Mutex<Option<String>>,
    cert_file: PathBuf,
    key_file: PathBuf,
    provider: Arc<CryptoProvider>,
    expiry: Expiry,
}

impl fmt::Debug for Certs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Certs")
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .finish_non_exhaustive()
    }
}

impl ResolvesServerCert for Certs {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

impl Certs {
    /// Loads the pair when the files' bytes changed since the last try, and judges the served
    /// certificate's expiry again.
    fn reload(&self) {
        let now = expiry::now();
        self.expiry
            .judge(&self.cert_file, &self.current.load().cert[0], now);
        let read = |path: &Path| match std::fs::read(path) {
            Ok(bytes) if bytes.iter().all(u8::is_ascii_whitespace) => {
                Err(format!("{} is empty", path.display()))
            }
            Ok(bytes) => Ok(bytes),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        };
        let (cert, key) = match (read(&self.cert_file), read(&self.key_file)) {
            (Ok(c), Ok(k)) => (c, k),
            (Err(why), _) | (_, Err(why)) => {
                // Gone or emptied (an unmounted Secret), or caught mid-swap: the old pair stays.
                if let Ok(mut missing) = self.missing.lock()
                    && missing.as_deref() != Some(why.as_str())
                {
                    tracing::warn!(problem = %why, "gRPC TLS certificate or key unusable on disk; keeping the served pair");
                    *missing = Some(why);
                }
                return;
            }
        };
        if let Ok(mut missing) = self.missing.lock() {
            *missing = None;
        }
        let print = fingerprint(&cert, &key);
        let Ok(mut seen) = self.seen.lock() else {
            return;
        };
        if *seen == print {
            return;
        }
        *seen = print;
        match parse_pair(&self.cert_file, &cert, &self.key_file, &key, &self.provider) {
            Ok(pair) => match expiry::validity(&pair.cert[0]) {
                Some(v) if v.at(now) == Standing::Expired => tracing::error!(
                    cert_file = %self.cert_file.display(),
                    not_after = %expiry::date(v.not_after),
                    "new gRPC TLS certificate has expired; not loaded, keeping the served one"
                ),
                _ => {
                    tracing::info!(cert_file = %self.cert_file.display(), "gRPC TLS certificate reloaded");
                    self.expiry.judge(&self.cert_file, &pair.cert[0], now);
                    self.current.store(Arc::new(pair));
                }
            },
            Err(e) => {
                tracing::error!(error = %e, "new gRPC TLS certificate not loaded; keeping the served one")
            }
        }
    }
}

fn fingerprint(cert: &[u8], key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(cert) ^ xxhash_rust::xxh3::xxh3_64(key).rotate_left(1)
}

fn read(setting: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        setting,
        path: path.to_path_buf(),
        source,
    })
}

fn load_pair(
    cert_file: &Path,
    key_file: &Path,
    provider: &CryptoProvider,
) -> Result<(CertifiedKey, u64), TlsError> {
    let cert = read("grpc.tls.cert_file", cert_file)?;
    let key = read("grpc.tls.key_file", key_file)?;
    let pair = parse_pair(cert_file, &cert, key_file, &key, provider)?;
    Ok((pair, fingerprint(&cert, &key)))
}

/// A certificate chain and its key, checked to belong together.
fn parse_pair(
    cert_file: &Path,
    cert: &[u8],
    key_file: &Path,
    key: &[u8],
    provider: &CryptoProvider,
) -> Result<CertifiedKey, TlsError> {
    let chain = certificates("grpc.tls.cert_file", cert_file, cert)?;
    let pem = |reason: String| TlsError::Pem {
        setting: "grpc.tls.key_file",
        path: key_file.to_path_buf(),
        reason,
    };
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            pem("no PEM private key (PKCS#8, PKCS#1 or SEC1) in the file".into())
        }
        e => pem(format!("not a readable PEM private key: {e}")),
    })?;
    CertifiedKey::from_der(chain, key, provider).map_err(|e| TlsError::Pair {
        cert: cert_file.to_path_buf(),
        key: key_file.to_path_buf(),
        reason: e.to_string(),
    })
}

/// Every certificate in a PEM file; an error when there is none.
fn certificates(
    setting: &'static str,
    path: &Path,
    bytes: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |reason: String| TlsError::Pem {
        setting,
        path: path.to_path_buf(),
        reason,
    };
    let chain = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(format!("not readable PEM: {e}")))?;
    if chain.is_empty() {
        return Err(pem("no PEM certificate in the file".into()));
    }
    Ok(chain)
}

/// Requires a client certificate that chains to the CAs in `ca_file` (and carries `san`).
fn client_verifier(
    ca_file: &Path,
    san: Option<&str>,
    provider: &Arc<CryptoProvider>,
) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    let bytes = read("grpc.tls.client_ca_file", ca_file)?;
    let mut roots = RootCertStore::empty();
    for cert in certificates("grpc.tls.client_ca_file", ca_file, &bytes)? {
        roots.add(cert).map_err(|e| TlsError::ClientCa {
            path: ca_file.to_path_buf(),
            reason: format!("not a usable CA certificate: {e}"),
        })?;
    }
    let webpki = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::clone(provider))
        .build()
        .map_err(|e| TlsError::ClientCa {
            path: ca_file.to_path_buf(),
            reason: e.to_string(),
        })?;
    let Some(san) = san else {
        return Ok(webpki);
    };
    let name = ServerName::try_from(san.to_string())
        .ok()
        .filter(|n| matches!(n, ServerName::DnsName(_)))
        .ok_or_else(|| TlsError::ClientSan(san.to_string()))?;
    Ok(Arc::new(RequireSan {
        inner: webpki,
        name,
    }))
}

/// A client verifier that also requires a DNS subject alternative name, as
/// envoyproxy/ratelimit's `GRPC_CLIENT_TLS_SAN` does.
#[derive(Debug)]
struct RequireSan {
    inner: Arc<dyn ClientCertVerifier>,
    name: ServerName<'static>,
}

impl ClientCertVerifier for RequireSan {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        let cert = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_name(&cert, &self.name)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installing_twice_is_harmless() {
        install_crypto_provider();
        install_crypto_provider();
        assert!(rustls::crypto::CryptoProvider::get_default().is_some());
    }
}
