//! TLS on both public listeners: the certificate chain and key of `--tls-cert` / `--tls-key`,
//! checked once at start-up (so a bad file is a start-up error naming it), then handed to
//! the HTTP accept loop (a `tokio-rustls` acceptor offering `h2` and `http/1.1`) and to
//! tonic for the public gRPC listener (the same PEMs). Crypto is `ring`'s; no client
//! certificates are asked for.
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tonic::transport::{Identity, ServerTlsConfig};

use crate::error::RouterError;

/// The loaded certificate and key.
#[derive(Clone)]
pub struct Tls {
    http: TlsAcceptor,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
    handshake_timeout: Duration,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("Tls")
            .field("handshake_timeout", &self.handshake_timeout)
            .finish_non_exhaustive()
    }
}

fn tls_error(path: &Path, message: impl Into<String>) -> RouterError {
    RouterError::Tls {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

impl Tls {
    /// Reads and checks the PEM files; the gRPC listener's handshakes time out after
    /// `handshake_timeout` (the HTTP loop puts its own header timeout around them).
    pub fn load(cert: &Path, key: &Path, handshake_timeout: Duration) -> Result<Self, RouterError> {
        let read = |path: &Path| std::fs::read(path).map_err(|e| tls_error(path, e.to_string()));
        let cert_pem = read(cert)?;
        let key_pem = read(key)?;
        let chain = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| tls_error(cert, format!("not a PEM certificate chain: {e}")))?;
        if chain.is_empty() {
            return Err(tls_error(cert, "has no `CERTIFICATE` PEM block"));
        }
        let private = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|e| tls_error(key, format!("not a PEM private key: {e}")))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error(cert, e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, private)
            .map_err(|e| tls_error(key, format!("does not fit the certificate: {e}")))?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Self {
            http: TlsAcceptor::from(Arc::new(config)),
            cert_pem,
            key_pem,
            handshake_timeout,
        })
    }

    /// The acceptor of the HTTP listener.
    pub fn http_acceptor(&self) -> TlsAcceptor {
        self.http.clone()
    }

    /// tonic's config for the public gRPC listener: the same certificate and key.
    pub fn grpc_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .timeout(self.handshake_timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_files_are_named() {
        let dir = std::env::temp_dir().join(format!("ferry-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let cert = dir.join("cert.pem");
        let key = dir.join("key.pem");
        std::fs::write(&cert, "not a certificate").expect("write");
        std::fs::write(&key, "not a key").expect("write");
        let e = Tls::load(&cert, &key, Duration::from_secs(1)).expect_err("no PEM blocks");
        assert!(e.to_string().contains("cert.pem"), "{e}");
        let missing = dir.join("missing.pem");
        let e = Tls::load(&missing, &key, Duration::from_secs(1)).expect_err("missing");
        assert!(e.to_string().contains("missing.pem"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
