//! TLS for the daemons' servers, defined once: the certificate, key and optional
//! client CA an operator gives (`--tls-cert`, `--tls-key`, `--tls-client-ca`) are read
//! and checked here, with errors that name the file, and [`serve_http`] serves an
//! HTTP router over plain TCP or TLS. The placer's gRPC server takes the same
//! [`ServerTls`] (its PEM text, through tonic's own rustls acceptor).
//!
//! Crypto is rustls with the *ring* provider, the one kube's client already links.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::server::danger::ClientCertVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};
use tokio_rustls::server::TlsStream;

/// Longest a client may take over its TLS handshake: a client that connects and
/// says nothing holds no server resources for longer.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the TLS settings cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file cannot be read.
    #[error("cannot read the TLS {what} {path}: {reason}")]
    Read {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    /// A file holds no PEM block of the kind expected, or a malformed one.
    #[error("the TLS {what} {path} holds no usable PEM {expected}: {reason}")]
    Pem {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
        reason: String,
    },
    /// rustls refused the combination (e.g. a key that does not match the certificate).
    #[error("cannot use the TLS certificate {cert} with the key {key}: {reason}")]
    Config {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
}

/// A server's certificate chain and key, and the CA its clients' certificates must
/// be signed by when it verifies them. Cheap to clone.
#[derive(Clone)]
pub struct ServerTls {
    cert_pem: Arc<Vec<u8>>,
    key_pem: Arc<Vec<u8>>,
    client_ca_pem: Option<Arc<Vec<u8>>>,
    /// For HTTP/1.1 servers ([`serve_http`]).
    http: Arc<ServerConfig>,
    /// The same without client verification, for [`ServerTls::without_client_verification`].
    http_without_client_auth: Arc<ServerConfig>,
    cert_path: PathBuf,
    client_ca_path: Option<PathBuf>,
}

impl std::fmt::Debug for ServerTls {
    // Never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert", &self.cert_path)
            .field("client_ca", &self.client_ca_path)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(tokio_rustls::rustls::crypto::ring::default_provider())
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| TlsError::Read {
        what,
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

fn certificates(
    what: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |reason: String| TlsError::Pem {
        what,
        path: path.to_owned(),
        expected: "CERTIFICATE",
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no certificate in it".to_owned()));
    }
    Ok(certs)
}

impl ServerTls {
    /// Reads and checks the PEM files: `cert` (the server's certificate chain, leaf
    /// first), `key` (its private key: PKCS#8, PKCS#1 or SEC1), and `client_ca` (when
    /// given, every client must present a certificate signed by one of its CAs).
    pub fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<ServerTls, TlsError> {
        let cert_pem = read("certificate", cert)?;
        let key_pem = read("key", key)?;
        let chain = certificates("certificate", cert, &cert_pem)?;
        let private_key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Pem {
            what: "key",
            path: key.to_owned(),
            expected: "PRIVATE KEY",
            reason: e.to_string(),
        })?;
        let config_error = |reason: String| TlsError::Config {
            cert: cert.to_owned(),
            key: key.to_owned(),
            reason,
        };
        let client_roots = match client_ca {
            Some(path) => {
                let pem = read("client CA", path)?;
                let bad_ca = |reason: String| TlsError::Pem {
                    what: "client CA",
                    path: path.to_owned(),
                    expected: "CA CERTIFICATE",
                    reason,
                };
                let mut roots = RootCertStore::empty();
                for ca in certificates("client CA", path, &pem)? {
                    roots.add(ca).map_err(|e| bad_ca(e.to_string()))?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                        .build()
                        .map_err(|e| bad_ca(e.to_string()))?;
                Some((verifier, pem))
            }
            None => None,
        };
        let build = |verifier: Option<Arc<dyn ClientCertVerifier>>| {
            let builder = ServerConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .map_err(|e| config_error(e.to_string()))?;
            let builder = match verifier {
                Some(verifier) => builder.with_client_cert_verifier(verifier),
                None => builder.with_no_client_auth(),
            };
            let mut config = builder
                .with_single_cert(chain.clone(), private_key.clone_key())
                .map_err(|e| config_error(e.to_string()))?;
            config.alpn_protocols = vec![b"http/1.1".to_vec()];
            Ok::<_, TlsError>(Arc::new(config))
        };
        let http_without_client_auth = build(None)?;
        let (http, client_ca_pem) = match client_roots {
            Some((verifier, pem)) => (build(Some(verifier))?, Some(Arc::new(pem))),
            None => (http_without_client_auth.clone(), None),
        };
        Ok(ServerTls {
            cert_pem: Arc::new(cert_pem),
            key_pem: Arc::new(key_pem),
            client_ca_pem,
            http,
            http_without_client_auth,
            cert_path: cert.to_owned(),
            client_ca_path: client_ca.map(Path::to_owned),
        })
    }

    /// The certificate chain, PEM (for tonic's `Identity::from_pem`).
    pub fn cert_pem(&self) -> &[u8] {
        &self.cert_pem
    }

    /// The private key, PEM.
    pub fn key_pem(&self) -> &[u8] {
        &self.key_pem
    }

    /// The CAs clients must be signed by, PEM; `None` when clients are not verified.
    pub fn client_ca_pem(&self) -> Option<&[u8]> {
        self.client_ca_pem.as_deref().map(Vec::as_slice)
    }

    /// Whether clients must present a certificate.
    pub fn verifies_clients(&self) -> bool {
        self.client_ca_pem.is_some()
    }

    /// The same certificate, clients not verified: for the read-only operators'
    /// endpoints (`/metrics`, `/healthz`, `/readyz`), which kubelet's HTTPS probes
    /// must reach without a client certificate.
    pub fn without_client_verification(&self) -> ServerTls {
        ServerTls {
            client_ca_pem: None,
            http: self.http_without_client_auth.clone(),
            client_ca_path: None,
            ..self.clone()
        }
    }
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets in-flight
/// requests finish: plain HTTP without `tls`, HTTPS with it (the handshakes run
/// concurrently, each bounded by [`HANDSHAKE_TIMEOUT`], so one slow client stalls
/// nobody). Responses are not delayed by Nagle's algorithm (TCP_NODELAY).
pub async fn serve_http(
    listener: TcpListener,
    router: Router,
    tls: Option<&ServerTls>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    match tls {
        None => {
            use axum::serve::ListenerExt;
            let listener = listener.tap_io(set_nodelay);
            axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
        }
        Some(tls) => {
            let listener = TlsListener::new(listener, TlsAcceptor::from(tls.http.clone()))?;
            axum::serve(listener, router)
                .with_graceful_shutdown(shutdown)
                .await
        }
    }
}

fn set_nodelay(tcp: &mut TcpStream) {
    if let Err(err) = tcp.set_nodelay(true) {
        tracing::debug!(%err, "cannot set TCP_NODELAY");
    }
}

/// A listener whose connections have completed a TLS handshake: a task accepts TCP
/// connections and shakes hands with each in a task of its own.
struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
    accepting: JoinHandle<()>,
}

impl TlsListener {
    fn new(listener: TcpListener, acceptor: TlsAcceptor) -> std::io::Result<TlsListener> {
        let local = listener.local_addr()?;
        let (done, ready) = mpsc::channel(64);
        let accepting = tokio::spawn(async move {
            loop {
                let (mut tcp, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        // Out of file descriptors and the like: wait rather than spin.
                        tracing::warn!(%err, "cannot accept a connection");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                set_nodelay(&mut tcp);
                let acceptor = acceptor.clone();
                let done = done.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = done.send((stream, peer)).await;
                        }
                        Ok(Err(err)) => {
                            tracing::info!(%peer, %err, "TLS handshake failed");
                        }
                        Err(_) => {
                            tracing::info!(%peer, "TLS handshake timed out");
                        }
                    }
                });
            }
        });
        Ok(TlsListener {
            ready,
            local,
            accepting,
        })
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        // The server is done: stop accepting (closes the socket).
        self.accepting.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(accepted) => accepted,
            // The accepting task holds a sender for as long as it runs, and it runs
            // until this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_state::testing::Pki;

    fn error(cert: &Path, key: &Path, ca: Option<&Path>) -> String {
        ServerTls::load(cert, key, ca)
            .expect_err("refused")
            .to_string()
    }

    #[test]
    fn loads_a_certificate_and_says_which_file_is_wrong() {
        let pki = Pki::generate();
        let tls = ServerTls::load(&pki.server_cert, &pki.server_key, None).expect("valid");
        assert!(!tls.verifies_clients());
        let verifying =
            ServerTls::load(&pki.server_cert, &pki.server_key, Some(&pki.ca)).expect("valid");
        assert!(verifying.verifies_clients());
        assert!(!verifying.without_client_verification().verifies_clients());
        assert!(
            !format!("{verifying:?}").contains("PRIVATE"),
            "no key in logs"
        );

        let missing = pki.ca.with_file_name("missing.pem");
        let err = error(&missing, &pki.server_key, None);
        assert!(
            err.contains("certificate") && err.contains("missing.pem"),
            "{err}"
        );
        // A certificate where the key should be: no key in it.
        let err = error(&pki.server_cert, &pki.server_cert, None);
        assert!(err.contains("key") && err.contains("server.pem"), "{err}");
        // A key where the certificate should be: no certificate in it.
        let err = error(&pki.server_key, &pki.server_key, None);
        assert!(
            err.contains("CERTIFICATE") && err.contains("server.key"),
            "{err}"
        );
        let err = error(&pki.server_cert, &pki.server_key, Some(&pki.server_key));
        assert!(
            err.contains("client CA") && err.contains("server.key"),
            "{err}"
        );
        // The client's key does not belong to the server's certificate.
        let err = error(&pki.server_cert, &pki.client_key, None);
        assert!(err.contains("client.key"), "{err}");
    }
}
