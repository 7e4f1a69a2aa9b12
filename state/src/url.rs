//! Choosing a backend from a URL, as operators write it on the command line.
//!
//! Accepted forms, and nothing else (a form that could mean two things is refused,
//! never guessed, so `127.0.0.1:2379` cannot silently become a file of that name):
//!
//! - `etcd://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT…]`: an etcd cluster in plain
//!   text; with a user, every request is authenticated (etcd's auth);
//! - `etcds://[USER[:PASSWORD]@]HOST:PORT[,…][?ca=PATH&cert=PATH&key=PATH]`: the
//!   same over TLS; `ca` is the CA of the members' certificates (default: the
//!   system's roots), `cert` and `key` a client certificate for members that verify
//!   clients (`--client-cert-auth`). User, password and values are percent-decoded;
//! - `memory:`: an in-memory embedded store (tests, the simulator);
//! - an embedded store file: `file:PATH`, or a bare path that contains a `/` or
//!   ends in `.redb` and has no `:` (`./state`, `/var/lib/iadeep/state.redb`,
//!   `state.redb`).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use percent_encoding::percent_decode_str;

use crate::embedded::EmbeddedStore;
use crate::error::{Result, StateError};
#[cfg(feature = "etcd")]
use crate::etcd::EtcdStore;
use crate::etcd_config::{EtcdConfig, EtcdCredentials, EtcdTls};
use crate::store::StateStore;

/// The accepted forms, for error messages.
const FORMS: &str = "use etcd://HOST:PORT[,HOST:PORT...] (or etcds:// for TLS) for an etcd \
                     cluster, or a file path containing '/' or ending in .redb (or file:PATH) \
                     for the embedded store";

/// Why an etcd URL does not open in a build without the etcd backend.
#[cfg(not(feature = "etcd"))]
const NO_ETCD_BACKEND: &str = "this build has no etcd backend (feature `etcd`); use memory: or an \
                               embedded store file";

/// Where the state lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreUrl {
    /// An etcd cluster: endpoints as `host:port`, TLS, credentials.
    Etcd(EtcdConfig),
    /// An embedded store file.
    Embedded(PathBuf),
    /// An embedded store in memory, gone when the process ends.
    Memory,
}

impl StoreUrl {
    /// The embedded store at its default path: `state.redb` in
    /// [`embedded_data_dir`](crate::embedded_data_dir).
    pub fn default_embedded() -> StoreUrl {
        StoreUrl::Embedded(crate::embedded::default_path())
    }

    /// Opens the store this URL names. An etcd URL in a build without the etcd
    /// backend (feature `etcd`) is refused with an error that says so.
    pub async fn open(&self) -> Result<Arc<dyn StateStore>> {
        Ok(match self {
            #[cfg(feature = "etcd")]
            StoreUrl::Etcd(config) => Arc::new(EtcdStore::connect_with(config).await?),
            #[cfg(not(feature = "etcd"))]
            StoreUrl::Etcd(_) => {
                return Err(StateError::InvalidUrl {
                    url: self.to_string(),
                    reason: NO_ETCD_BACKEND.into(),
                });
            }
            StoreUrl::Embedded(path) => Arc::new(EmbeddedStore::open(path)?),
            StoreUrl::Memory => Arc::new(EmbeddedStore::in_memory()?),
        })
    }

    /// Opens the store for reading only: an embedded file must already exist and is
    /// neither created nor modified (see [`EmbeddedStore::open_read_only`]); etcd and
    /// memory stores open as usual.
    pub async fn open_read_only(&self) -> Result<Arc<dyn StateStore>> {
        match self {
            StoreUrl::Embedded(path) => Ok(Arc::new(EmbeddedStore::open_read_only(path)?)),
            other => other.open().await,
        }
    }
}

impl fmt::Display for StoreUrl {
    /// The URL as given, with the password replaced by `***`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreUrl::Etcd(config) => {
                let scheme = if config.tls.is_some() {
                    "etcds"
                } else {
                    "etcd"
                };
                write!(f, "{scheme}://")?;
                if let Some(credentials) = &config.credentials {
                    write!(f, "{}:***@", credentials.user)?;
                }
                write!(f, "{}", config.joined())?;
                if let Some(tls) = &config.tls {
                    let options: Vec<String> = [
                        ("ca", &tls.ca),
                        ("cert", &tls.client_cert),
                        ("key", &tls.client_key),
                    ]
                    .into_iter()
                    .filter_map(|(name, path)| {
                        path.as_ref().map(|p| format!("{name}={}", p.display()))
                    })
                    .collect();
                    if !options.is_empty() {
                        write!(f, "?{}", options.join("&"))?;
                    }
                }
                Ok(())
            }
            StoreUrl::Embedded(path) => write!(f, "{}", path.display()),
            StoreUrl::Memory => f.write_str("memory:"),
        }
    }
}

fn decode(text: &str) -> std::result::Result<String, String> {
    percent_decode_str(text)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|_| format!("{text:?} is not UTF-8 once percent-decoded"))
}

/// Parses what follows `etcd://` or `etcds://`.
fn parse_etcd(rest: &str, tls: bool) -> std::result::Result<EtcdConfig, String> {
    let (authority, query) = match rest.split_once('?') {
        Some((authority, query)) => (authority, Some(query)),
        None => (rest, None),
    };
    // The password may contain '@' only percent-encoded; the last '@' ends the user part.
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => (Some(userinfo), hosts),
        None => (None, authority),
    };
    let credentials = match userinfo {
        None => None,
        Some(userinfo) => {
            let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
            let user = decode(user)?;
            if user.is_empty() {
                return Err("the user before '@' is empty".into());
            }
            Some(EtcdCredentials {
                user,
                password: decode(password)?,
            })
        }
    };
    let mut endpoints = Vec::new();
    for endpoint in hosts.split(',') {
        let endpoint = endpoint.trim().trim_end_matches('/');
        let (host, port) = endpoint
            .rsplit_once(':')
            .ok_or("each etcd endpoint must be HOST:PORT")?;
        if host.is_empty() {
            return Err("an etcd endpoint has an empty host".into());
        }
        port.parse::<u16>()
            .ok()
            .filter(|&p| p != 0)
            .ok_or("an etcd endpoint has no valid port (1-65535)")?;
        endpoints.push(endpoint.to_owned());
    }
    let mut settings = EtcdTls::default();
    for pair in query.into_iter().flat_map(|q| q.split('&')) {
        if pair.is_empty() {
            continue;
        }
        let (name, value) = pair
            .split_once('=')
            .ok_or_else(|| format!("option {pair:?} has no value (NAME=VALUE)"))?;
        let value = PathBuf::from(decode(value)?);
        let slot = match name {
            "ca" => &mut settings.ca,
            "cert" => &mut settings.client_cert,
            "key" => &mut settings.client_key,
            other => {
                return Err(format!(
                    "unknown option {other:?} (etcds:// takes ca=, cert= and key=)"
                ));
            }
        };
        if !tls {
            return Err(format!(
                "option {name:?} is a TLS setting: use etcds:// for a TLS cluster"
            ));
        }
        *slot = Some(value);
    }
    if settings.client_cert.is_some() != settings.client_key.is_some() {
        return Err("cert= and key= go together (a client certificate and its key)".into());
    }
    Ok(EtcdConfig {
        endpoints,
        tls: tls.then_some(settings),
        credentials,
    })
}

impl FromStr for StoreUrl {
    type Err = StateError;

    fn from_str(url: &str) -> Result<StoreUrl> {
        let invalid = |reason: String| StateError::InvalidUrl {
            url: url.to_owned(),
            reason,
        };
        if let Some(rest) = url.strip_prefix("etcd://") {
            return parse_etcd(rest, false).map(StoreUrl::Etcd).map_err(invalid);
        }
        if let Some(rest) = url.strip_prefix("etcds://") {
            return parse_etcd(rest, true).map(StoreUrl::Etcd).map_err(invalid);
        }
        if url == "memory:" {
            return Ok(StoreUrl::Memory);
        }
        if let Some(path) = url.strip_prefix("file:") {
            if path.is_empty() {
                return Err(invalid("empty path after file:".into()));
            }
            return Ok(StoreUrl::Embedded(PathBuf::from(path)));
        }
        if url.is_empty() {
            return Err(invalid(format!("empty store URL: {FORMS}")));
        }
        if let Some((scheme, _)) = url.split_once("://") {
            return Err(invalid(format!("unknown scheme {scheme:?}: {FORMS}")));
        }
        // `etcd:/HOST:PORT` or `etcd:HOST:PORT`: a scheme with its slashes mistyped.
        for scheme in ["etcd", "etcds"] {
            if let Some(rest) = url
                .strip_prefix(scheme)
                .and_then(|rest| rest.strip_prefix(':'))
            {
                let hosts = rest.trim_start_matches('/');
                if hosts.is_empty() {
                    return Err(invalid(format!("no host after {scheme}: {FORMS}")));
                }
                return Err(invalid(format!(
                    "did you mean {scheme}://{hosts}? ({FORMS})"
                )));
            }
        }
        if url.contains(':') {
            return Err(invalid(format!(
                "ambiguous: HOST:PORT or a file name? Write etcd://{url} for etcd, or \
                 file:{url} for a file ({FORMS})"
            )));
        }
        if !(url.contains('/') || url.ends_with(".redb")) {
            return Err(invalid(format!(
                "ambiguous: a bare name is not taken as a file; write ./{url} or \
                 {url}.redb ({FORMS})"
            )));
        }
        Ok(StoreUrl::Embedded(PathBuf::from(url)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn etcd(endpoints: &[&str]) -> StoreUrl {
        StoreUrl::Etcd(EtcdConfig::plain(
            endpoints.iter().map(|e| (*e).to_owned()).collect(),
        ))
    }

    #[test]
    fn parses_each_form() {
        assert_eq!(
            "etcd://10.0.0.1:2379,etcd-b:2379".parse::<StoreUrl>().ok(),
            Some(etcd(&["10.0.0.1:2379", "etcd-b:2379"]))
        );
        assert_eq!("memory:".parse::<StoreUrl>().ok(), Some(StoreUrl::Memory));
        for (url, path) in [
            ("/var/lib/iadeep/state.redb", "/var/lib/iadeep/state.redb"),
            ("./state", "./state"),
            ("state.redb", "state.redb"),
            ("file:rel/state.redb", "rel/state.redb"),
            ("file:odd:name", "odd:name"),
        ] {
            assert_eq!(
                url.parse::<StoreUrl>().ok(),
                Some(StoreUrl::Embedded(path.into())),
                "{url}"
            );
        }
    }

    #[test]
    fn parses_credentials_and_tls_options() {
        let url: StoreUrl =
            "etcds://iadeep:p%40ss%3Aw@a:2379,b:2379?ca=/etc/ca.pem&cert=/c.pem&key=/k%20x.pem"
                .parse()
                .expect("parses");
        let StoreUrl::Etcd(config) = &url else {
            panic!("not etcd: {url:?}");
        };
        assert_eq!(config.endpoints, vec!["a:2379", "b:2379"]);
        let credentials = config.credentials.as_ref().expect("credentials");
        assert_eq!(
            (credentials.user.as_str(), credentials.password.as_str()),
            ("iadeep", "p@ss:w")
        );
        let tls = config.tls.as_ref().expect("tls");
        assert_eq!(tls.ca.as_deref(), Some(std::path::Path::new("/etc/ca.pem")));
        assert_eq!(
            tls.client_key.as_deref(),
            Some(std::path::Path::new("/k x.pem"))
        );
        let shown = url.to_string();
        assert!(
            shown.starts_with("etcds://iadeep:***@a:2379,b:2379?ca=/etc/ca.pem"),
            "{shown}"
        );
        assert!(!shown.contains("p@ss"), "{shown}");
        assert_eq!(
            "etcds://h:1"
                .parse::<StoreUrl>()
                .map(|u| matches!(u, StoreUrl::Etcd(c) if c.tls == Some(EtcdTls::default())))
                .ok(),
            Some(true),
            "etcds without options uses the system's roots"
        );
    }

    #[test]
    fn rejects_malformed_and_ambiguous_urls_with_a_reason() {
        for (url, needle) in [
            ("etcd://localhost", "HOST:PORT"),
            ("etcd://:2379", "empty host"),
            ("etcd://h:99999", "valid port"),
            ("etcd://@h:1", "user before '@' is empty"),
            ("etcd://h:1?ca=/x", "use etcds://"),
            ("etcds://h:1?cert=/c", "go together"),
            ("etcds://h:1?bogus=1", "unknown option"),
            ("http://h:1", "unknown scheme"),
            ("", "empty store URL"),
            ("file:", "empty path"),
            ("127.0.0.1:2379", "etcd://127.0.0.1:2379"),
            ("localhost:2379/x", "ambiguous"),
            (
                "etcd:/127.0.0.1:23790",
                "did you mean etcd://127.0.0.1:23790?",
            ),
            (
                "etcd:127.0.0.1:23790",
                "did you mean etcd://127.0.0.1:23790?",
            ),
            ("etcds:/h:1", "did you mean etcds://h:1?"),
            ("etcd:", "no host after etcd"),
            ("state", "./state"),
        ] {
            let err = url.parse::<StoreUrl>().expect_err(url).to_string();
            assert!(err.contains(needle), "{url}: {err}");
        }
        // Every refusal of a scheme-less form names both accepted forms.
        let err = "127.0.0.1:2379"
            .parse::<StoreUrl>()
            .expect_err("ambiguous")
            .to_string();
        assert!(
            err.contains("etcd://HOST:PORT") && err.contains(".redb"),
            "{err}"
        );
    }

    #[test]
    fn display_round_trips() {
        for url in [
            "etcd://a:1,b:2",
            "etcds://a:1?ca=/ca.pem&cert=/c.pem&key=/k.pem",
            "memory:",
            "/tmp/x.redb",
        ] {
            let parsed: StoreUrl = url.parse().expect("parses");
            assert_eq!(parsed.to_string(), url);
        }
    }
}
