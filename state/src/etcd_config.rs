//! How an etcd cluster is reached: its members' endpoints, TLS, and credentials.
//!
//! Plain data, in every build: a store URL names an etcd cluster (and parses) even
//! in a build without the etcd backend (feature `etcd`), which refuses to open it.
//!
//! Operators write all of it in one store URL (see [`crate::StoreUrl`]), so every
//! component that takes `--store` (or an agent's `store(...)`) can reach a secured
//! cluster without flags of its own.

use std::fmt;
use std::path::PathBuf;

/// Everything needed to reach one etcd cluster.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Client endpoints of the members as `host:port`, in the operator's order.
    pub endpoints: Vec<String>,
    /// `Some` for `etcds://`: every member is reached over TLS.
    pub tls: Option<EtcdTls>,
    /// etcd user whose credentials authenticate every request (etcd's auth).
    pub credentials: Option<EtcdCredentials>,
}

impl EtcdConfig {
    /// Plain-text access to `endpoints`, without authentication.
    pub fn plain(endpoints: Vec<String>) -> EtcdConfig {
        EtcdConfig {
            endpoints,
            tls: None,
            credentials: None,
        }
    }

    /// The endpoints joined by commas, for messages.
    pub fn joined(&self) -> String {
        self.endpoints.join(",")
    }
}

impl fmt::Debug for EtcdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("tls", &self.tls)
            .field("credentials", &self.credentials)
            .finish()
    }
}

/// TLS settings of `etcds://`: PEM files read when connecting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EtcdTls {
    /// The CA that signed the members' server certificates; without one, the
    /// system's trusted roots are used.
    pub ca: Option<PathBuf>,
    /// Client certificate and its private key, for members started with
    /// `--client-cert-auth` (both or neither).
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

/// An etcd user and password. The password never appears in `Debug` or `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdCredentials {
    pub user: String,
    pub password: String,
}

impl fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdCredentials")
            .field("user", &self.user)
            .field("password", &"<redacted>")
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_password() {
        let config = EtcdConfig {
            credentials: Some(EtcdCredentials {
                user: "iadeep".into(),
                password: "hunter2".into(),
            }),
            ..EtcdConfig::plain(vec!["a:1".into()])
        };
        let shown = format!("{config:?}");
        assert!(
            shown.contains("iadeep") && !shown.contains("hunter2"),
            "{shown}"
        );
    }
}
