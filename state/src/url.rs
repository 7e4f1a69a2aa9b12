//! Choosing a backend from a URL, as operators write it on the command line.
//!
//! - `etcd://HOST:PORT[,HOST:PORT…]`: an etcd cluster;
//! - `memory:`: an in-memory embedded store (tests, the simulator);
//! - anything else is a file path of an embedded store (`file:PATH` also works).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use crate::embedded::EmbeddedStore;
use crate::error::{Result, StateError};
use crate::etcd::EtcdStore;
use crate::store::StateStore;

/// Where the state lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreUrl {
    /// etcd endpoints as `host:port`.
    Etcd(Vec<String>),
    /// An embedded store file.
    Embedded(PathBuf),
    /// An embedded store in memory, gone when the process ends.
    Memory,
}

impl StoreUrl {
    /// The embedded store at its default path (see [`crate::embedded::default_path`]).
    pub fn default_embedded() -> StoreUrl {
        StoreUrl::Embedded(crate::embedded::default_path())
    }

    /// Opens the store this URL names.
    pub async fn open(&self) -> Result<Arc<dyn StateStore>> {
        Ok(match self {
            StoreUrl::Etcd(endpoints) => Arc::new(EtcdStore::connect(endpoints).await?),
            StoreUrl::Embedded(path) => Arc::new(EmbeddedStore::open(path)?),
            StoreUrl::Memory => Arc::new(EmbeddedStore::in_memory()?),
        })
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreUrl::Etcd(endpoints) => write!(f, "etcd://{}", endpoints.join(",")),
            StoreUrl::Embedded(path) => write!(f, "{}", path.display()),
            StoreUrl::Memory => f.write_str("memory:"),
        }
    }
}

impl FromStr for StoreUrl {
    type Err = StateError;

    fn from_str(url: &str) -> Result<StoreUrl> {
        let invalid = |reason: &str| StateError::InvalidUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        if let Some(rest) = url.strip_prefix("etcd://") {
            let mut endpoints = Vec::new();
            for endpoint in rest.split(',') {
                let endpoint = endpoint.trim().trim_end_matches('/');
                let (host, port) = endpoint
                    .rsplit_once(':')
                    .ok_or_else(|| invalid("each etcd endpoint must be HOST:PORT"))?;
                if host.is_empty() {
                    return Err(invalid("an etcd endpoint has an empty host"));
                }
                port.parse::<u16>()
                    .ok()
                    .filter(|&p| p != 0)
                    .ok_or_else(|| invalid("an etcd endpoint has no valid port (1-65535)"))?;
                endpoints.push(endpoint.to_owned());
            }
            return Ok(StoreUrl::Etcd(endpoints));
        }
        if url == "memory:" {
            return Ok(StoreUrl::Memory);
        }
        if let Some((scheme, _)) = url.split_once("://") {
            return Err(invalid(&format!(
                "unknown scheme {scheme:?}: use etcd://HOST:PORT, memory: or a file path"
            )));
        }
        let path = url.strip_prefix("file:").unwrap_or(url);
        if path.is_empty() {
            return Err(invalid("empty path"));
        }
        Ok(StoreUrl::Embedded(PathBuf::from(path)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_form() {
        assert_eq!(
            "etcd://10.0.0.1:2379,etcd-b:2379".parse::<StoreUrl>().ok(),
            Some(StoreUrl::Etcd(vec![
                "10.0.0.1:2379".into(),
                "etcd-b:2379".into()
            ]))
        );
        assert_eq!("memory:".parse::<StoreUrl>().ok(), Some(StoreUrl::Memory));
        assert_eq!(
            "/var/lib/iadeep/state.redb".parse::<StoreUrl>().ok(),
            Some(StoreUrl::Embedded("/var/lib/iadeep/state.redb".into()))
        );
        assert_eq!(
            "file:rel/state.redb".parse::<StoreUrl>().ok(),
            Some(StoreUrl::Embedded("rel/state.redb".into()))
        );
    }

    #[test]
    fn rejects_malformed_urls_with_a_reason() {
        for (url, needle) in [
            ("etcd://localhost", "HOST:PORT"),
            ("etcd://:2379", "empty host"),
            ("etcd://h:99999", "valid port"),
            ("http://h:1", "unknown scheme"),
            ("", "empty path"),
        ] {
            let err = url.parse::<StoreUrl>().expect_err(url).to_string();
            assert!(err.contains(needle), "{url}: {err}");
        }
    }

    #[test]
    fn display_round_trips() {
        for url in ["etcd://a:1,b:2", "memory:", "/tmp/x.redb"] {
            let parsed: StoreUrl = url.parse().expect("parses");
            assert_eq!(parsed.to_string(), url);
        }
    }
}
