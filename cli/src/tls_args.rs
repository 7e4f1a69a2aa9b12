//! TLS flags shared by the daemons (their listeners) and by the clients of the
//! placer's gRPC API (`iadeep run`), so each is spelled and explained once.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use iadeep_ops::tls::ServerTls;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// The certificate a daemon serves TLS with.
#[derive(Debug, Clone, Args)]
pub(crate) struct ServerTlsArgs {
    /// Serve TLS on every listener of this daemon with this certificate chain (PEM, the
    /// server's certificate first, then intermediates). Requires --tls-key. Without it
    /// the daemon serves plain text.
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

impl ServerTlsArgs {
    /// The TLS settings, checked now so a bad file stops the daemon before it serves;
    /// `client_ca` makes the listeners that verify clients require a certificate
    /// signed by it.
    pub(crate) fn load(&self, client_ca: Option<&Path>) -> Result<Option<ServerTls>> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(ServerTls::load(cert, key, client_ca)?)),
            (None, None) if client_ca.is_some() => {
                bail!(
                    "--tls-client-ca verifies the clients of a TLS server: give --tls-cert and --tls-key too"
                )
            }
            (None, None) => Ok(None),
            // clap's `requires` refuses one without the other.
            _ => bail!("--tls-cert and --tls-key go together"),
        }
    }
}

/// How a client reaches the placer's gRPC API over TLS.
#[derive(Debug, Clone, Args)]
pub(crate) struct PlacerTlsArgs {
    /// CA certificate(s) (PEM) the placer's certificate must be signed by, for an
    /// https:// placer address. Default: an https:// placer is refused without it.
    #[arg(long, env = "IADEEP_PLACER_CA", value_name = "PEM")]
    placer_ca: Option<PathBuf>,
    /// Client certificate (PEM) presented to a placer started with --tls-client-ca.
    /// Requires --placer-key.
    #[arg(
        long,
        env = "IADEEP_PLACER_CERT",
        value_name = "PEM",
        requires = "placer_key"
    )]
    placer_cert: Option<PathBuf>,
    /// The private key of --placer-cert (PEM).
    #[arg(
        long,
        env = "IADEEP_PLACER_KEY",
        value_name = "PEM",
        requires = "placer_cert"
    )]
    placer_key: Option<PathBuf>,
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("cannot read the {what} {}", path.display()))
}

impl PlacerTlsArgs {
    /// A lazily connecting channel to the placer at `url` (`http://` or `https://`).
    pub(crate) fn endpoint(&self, url: &str) -> Result<Endpoint> {
        let endpoint = Endpoint::from_shared(url.to_owned())
            .with_context(|| format!("{url:?} is not a placer address"))?;
        let https = endpoint.uri().scheme_str() == Some("https");
        if !https {
            if self.placer_ca.is_some() || self.placer_cert.is_some() {
                bail!("--placer-ca and --placer-cert are for an https:// placer, not {url}");
            }
            return Ok(endpoint);
        }
        let Some(ca) = &self.placer_ca else {
            bail!(
                "the placer {url} speaks TLS: give the CA that signed its certificate (--placer-ca or IADEEP_PLACER_CA)"
            );
        };
        let mut tls =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read("placer CA", ca)?));
        if let (Some(cert), Some(key)) = (&self.placer_cert, &self.placer_key) {
            tls = tls.identity(Identity::from_pem(
                read("client certificate", cert)?,
                read("client key", key)?,
            ));
        }
        endpoint
            .tls_config(tls)
            .with_context(|| format!("cannot configure TLS for the placer {url}"))
    }
}
