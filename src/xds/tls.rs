//! TLS to the xDS server, done by our own connector for tonic's
//! `Endpoint::connect_with_connector` (tonic's TLS features are off in this crate): rustls on
//! ring, TLS 1.3 or 1.2, ALPN `h2`. The server is verified against the system's roots (as the
//! reference does) plus the configured CA file, under the URL's host or the configured name; a
//! client certificate and key (PKCS#8, PKCS#1 `RSA PRIVATE KEY` as Envoy Gateway writes it, or
//! SEC1) are presented when configured. Every file is read when the connector is made, which
//! is at every (re)connection, so rotated certificates are picked up.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tonic::codegen::Service;
use tonic::codegen::http::Uri;

use crate::settings::XdsTls;

/// Makes TLS connections to the xDS server.
#[derive(Clone)]
pub(super) struct Connector {
    config: Arc<ClientConfig>,
    server_name: ServerName<'static>,
    /// `host:port` to dial.
    authority: String,
}

impl Connector {
    /// A connector for `authority` with the files of `tls` read now.
    pub(super) fn new(tls: &XdsTls, authority: &str) -> Result<Self, String> {
        let mut roots = RootCertStore::empty();
        // The system's roots, as the reference trusts them; a store that cannot be read only
        // leaves the CA file.
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
        if let Some(ca) = &tls.ca_file {
            let certs = CertificateDer::pem_file_iter(ca)
                .and_then(Iterator::collect::<Result<Vec<_>, _>>)
                .map_err(|e| format!("xds.tls.ca_file {}: {e}", ca.display()))?;
            if certs.is_empty() {
                return Err(format!("xds.tls.ca_file {}: no certificate", ca.display()));
            }
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| format!("xds.tls.ca_file {}: {e}", ca.display()))?;
            }
        }
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_root_certificates(roots);
        let mut config = match &tls.client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = CertificateDer::pem_file_iter(cert)
                    .and_then(Iterator::collect::<Result<Vec<_>, _>>)
                    .map_err(|e| format!("xds.tls.cert_file {}: {e}", cert.display()))?;
                if chain.is_empty() {
                    return Err(format!(
                        "xds.tls.cert_file {}: no certificate",
                        cert.display()
                    ));
                }
                let key_der = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("xds.tls.key_file {}: {e}", key.display()))?;
                builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                    format!(
                        "xds.tls.key_file {} cannot be used with xds.tls.cert_file {}: {e}",
                        key.display(),
                        cert.display()
                    )
                })?
            }
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        let server_name = ServerName::try_from(tls.server_name.clone())
            .map_err(|_| format!("{:?} is not a DNS name or IP address", tls.server_name))?;
        Ok(Self {
            config: Arc::new(config),
            server_name,
            authority: authority.to_string(),
        })
    }
}

impl Service<Uri> for Connector {
    type Response = TokioIo<TlsStream<TcpStream>>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let tcp = TcpStream::connect(&this.authority).await?;
            let _ = tcp.set_nodelay(true);
            let tls = tokio_rustls::TlsConnector::from(this.config)
                .connect(this.server_name, tcp)
                .await?;
            if let Some(other) = tls.get_ref().1.alpn_protocol()
                && other != b"h2"
            {
                return Err(std::io::Error::other(format!(
                    "the xDS server chose ALPN {:?}, not h2",
                    String::from_utf8_lossy(other)
                )));
            }
            Ok(TokioIo::new(tls))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(dir: &std::path::Path) -> XdsTls {
        XdsTls {
            client: Some((dir.join("tls.crt"), dir.join("tls.key"))),
            ca_file: Some(dir.join("ca.crt")),
            server_name: "envoy-gateway".into(),
        }
    }

    #[test]
    fn a_file_that_cannot_be_used_is_named_with_its_setting() {
        let dir = tempfile::tempdir().unwrap();
        let err = |t: &XdsTls| Connector::new(t, "envoy-gateway:18001").err().unwrap();
        assert!(err(&tls(dir.path())).starts_with("xds.tls.ca_file"));
        std::fs::write(dir.path().join("ca.crt"), "not PEM\n").unwrap();
        let e = err(&tls(dir.path()));
        assert!(e.contains("no certificate"), "{e}");
        let no_client = XdsTls {
            client: None,
            ca_file: None,
            server_name: "not a name!".into(),
        };
        assert!(err(&no_client).contains("not a DNS name"));
    }
}
