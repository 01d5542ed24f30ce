//! The process's one TLS crypto provider: ring, installed as rustls's default once at start-up.
//!
//! sluice builds its own rustls configs with an explicit provider, so they never depend on this
//! global; it is installed for the libraries that build theirs with `ClientConfig::builder()`
//! (redis-rs's TLS connections), which panics when no default exists. Only ring is compiled
//! in: a second provider (aws-lc-rs) would make rustls unable to choose one by itself.

/// Installs ring as rustls's process-wide default provider. Idempotent: when a provider is
/// installed already (by an earlier call, or by a test), it is kept.
pub fn install_crypto_provider() {
    // An error only says a provider is installed already, which is what this wants.
    let _ = rustls::crypto::ring::default_provider().install_default();
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
