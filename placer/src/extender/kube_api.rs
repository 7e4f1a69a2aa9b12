//! The extender's calls to the Kubernetes API: read a pod, annotate it with its
//! GPU, create its Binding. Through the `kube` client, so the placer authenticates
//! like any in-cluster controller (service-account token and CA) or from a
//! kubeconfig, over TLS; a plain-HTTP URL (e.g. `kubectl proxy`) works too.
//!
//! Every call runs under the caller's deadline, and its failure says whether the
//! call is known *not* to have happened ([`ApiCallError::Refused`] with a definite
//! client error) or may have happened ([`ApiCallError::Unknown`]): a Binding whose
//! answer never came may well exist, and the reservation must then be kept.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use tokio::time::Instant;

use crate::error::{PlacerError, Result};

/// How to reach the Kubernetes API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KubeApiConfig {
    /// A kubeconfig (`$KUBECONFIG`, else `~/.kube/config`), else the in-cluster
    /// service account: what `kubectl` and controllers do.
    Infer,
    /// An API server URL used without credentials, e.g. `http://127.0.0.1:8001` of a
    /// `kubectl proxy` that authenticates for the placer.
    Url(String),
}

impl std::str::FromStr for KubeApiConfig {
    type Err = String;

    /// `auto`, or a URL; a bare `HOST:PORT` is taken as `http://HOST:PORT`.
    fn from_str(text: &str) -> std::result::Result<Self, Self::Err> {
        let text = text.trim();
        if text == "auto" {
            return Ok(KubeApiConfig::Infer);
        }
        let url = if text.contains("://") {
            text.to_owned()
        } else {
            format!("http://{text}")
        };
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("{text:?} is neither `auto` nor a URL: {e}"))?;
        match (uri.scheme_str(), uri.host()) {
            (Some("http" | "https"), Some(_)) => Ok(KubeApiConfig::Url(url)),
            _ => Err(format!(
                "{text:?} is neither `auto` nor an http:// or https:// URL with a host"
            )),
        }
    }
}

impl fmt::Display for KubeApiConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KubeApiConfig::Infer => f.write_str("auto (kubeconfig or in-cluster)"),
            KubeApiConfig::Url(url) => f.write_str(url),
        }
    }
}

/// Checks `value` is a DNS-1123 label, Kubernetes' rule for namespace names: at most
/// 63 lowercase letters, digits and '-', starting and ending with a letter or digit.
pub fn check_dns1123_label(what: &str, value: &str) -> std::result::Result<(), String> {
    const MAX: usize = 63;
    if value.len() > MAX {
        return Err(format!(
            "invalid {what} {value:?}: longer than {MAX} characters (a Kubernetes DNS-1123 label)"
        ));
    }
    check_label(value).map_err(|why| {
        format!(
            "invalid {what} {value:?}: {why} (a Kubernetes DNS-1123 label: lowercase letters, \
             digits and '-', starting and ending with a letter or digit)"
        )
    })
}

/// Checks `value` is a DNS-1123 subdomain, Kubernetes' rule for pod and node names:
/// at most 253 characters, dot-separated labels of lowercase letters, digits and
/// '-', each starting and ending with a letter or digit. Such a name is a safe URL
/// path segment: it can hold no '/', '%', '?' or '#', and is never "." or "..".
pub fn check_dns1123_subdomain(what: &str, value: &str) -> std::result::Result<(), String> {
    const MAX: usize = 253;
    if value.len() > MAX {
        return Err(format!(
            "invalid {what} {value:?}: longer than {MAX} characters (a Kubernetes DNS-1123 subdomain)"
        ));
    }
    value.split('.').try_for_each(check_label).map_err(|why| {
        format!(
            "invalid {what} {value:?}: {why} (a Kubernetes DNS-1123 subdomain: lowercase \
             letters, digits, '-' and '.', starting and ending with a letter or digit)"
        )
    })
}

/// One label of a DNS-1123 name, without the length limit of the whole.
fn check_label(label: &str) -> std::result::Result<(), &'static str> {
    let alphanumeric = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let bytes = label.as_bytes();
    match (bytes.first(), bytes.last()) {
        (None, _) | (_, None) => Err("empty (or an empty part between dots)"),
        _ if !bytes.iter().all(|&c| alphanumeric(c) || c == b'-') => {
            Err("a character other than a lowercase letter, a digit, '-' or '.'")
        }
        (Some(&first), Some(&last)) if !(alphanumeric(first) && alphanumeric(last)) => {
            Err("a part starts or ends with something other than a letter or digit")
        }
        _ => Ok(()),
    }
}

/// Why a call to the API did not succeed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApiCallError {
    /// The API server answered with an error that means the call did not take effect.
    #[error("Kubernetes API refused it (HTTP {code} {reason}): {message}")]
    Refused {
        code: u16,
        reason: String,
        message: String,
    },
    /// The call was not sent: its arguments are not valid names (see
    /// [`check_dns1123_label`] and [`check_dns1123_subdomain`]).
    #[error("not sent to the Kubernetes API: {0}")]
    NotSent(String),
    /// The outcome is unknown: no answer in time, a broken connection, a server
    /// error, or a conflict (409: the object changed, or the pod is already bound).
    #[error("outcome unknown: {0}")]
    Unknown(String),
}

/// The client the extender uses.
#[derive(Clone)]
pub struct KubeApi {
    client: kube::Client,
    describe: String,
}

impl fmt::Debug for KubeApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeApi")
            .field("server", &self.describe)
            .finish()
    }
}

impl KubeApi {
    /// A client for `config`. Connects lazily: an unreachable API server shows up in
    /// the first call, not here.
    pub async fn connect(config: &KubeApiConfig) -> Result<KubeApi> {
        let failed = |reason: String| PlacerError::Kubernetes {
            what: format!("cannot configure the Kubernetes client ({config})"),
            reason,
        };
        let mut kube_config = match config {
            KubeApiConfig::Infer => kube::Config::infer()
                .await
                .map_err(|e| failed(error_chain(&e)))?,
            KubeApiConfig::Url(url) => {
                let uri: http::Uri = url.parse().map_err(|e| failed(format!("{e}")))?;
                kube::Config::new(uri)
            }
        };
        // Calls are bounded by each caller's deadline; this only stops a connection
        // attempt from outliving it.
        kube_config.connect_timeout = Some(Duration::from_secs(5));
        let describe = kube_config.cluster_url.to_string();
        let client = kube::Client::try_from(kube_config).map_err(|e| failed(error_chain(&e)))?;
        Ok(KubeApi { client, describe })
    }

    /// The API server's URL.
    pub fn server(&self) -> &str {
        &self.describe
    }

    fn pods(&self, namespace: &str) -> Api<Pod> {
        Api::namespaced(self.client.clone(), namespace)
    }

    /// The pod's namespace and name go into the request's URL path unescaped (kube
    /// builds it), so every call checks them first: nothing else is ever sent.
    fn check_pod(namespace: &str, name: &str) -> Result<(), ApiCallError> {
        check_dns1123_label("namespace", namespace)
            .and_then(|()| check_dns1123_subdomain("pod name", name))
            .map_err(ApiCallError::NotSent)
    }

    /// The pod as the API server has it now.
    pub async fn pod(
        &self,
        namespace: &str,
        name: &str,
        deadline: Instant,
    ) -> Result<Pod, ApiCallError> {
        Self::check_pod(namespace, name)?;
        within(deadline, self.pods(namespace).get(name)).await
    }

    /// Merges `annotations` into the pod's.
    pub async fn annotate(
        &self,
        namespace: &str,
        name: &str,
        annotations: &BTreeMap<String, String>,
        deadline: Instant,
    ) -> Result<(), ApiCallError> {
        Self::check_pod(namespace, name)?;
        let patch = serde_json::json!({ "metadata": { "annotations": annotations } });
        within(
            deadline,
            self.pods(namespace)
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await
        .map(|_| ())
    }

    /// Creates the pod's Binding to `node` (what kube-scheduler's own binder does).
    pub async fn bind(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        node: &str,
        deadline: Instant,
    ) -> Result<(), ApiCallError> {
        Self::check_pod(namespace, name)?;
        let binding = Binding {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(namespace.to_owned()),
                uid: (!uid.is_empty()).then(|| uid.to_owned()),
                ..Default::default()
            },
            target: ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Node".to_owned()),
                name: Some(node.to_owned()),
                ..Default::default()
            },
        };
        within(
            deadline,
            self.pods(namespace)
                .create_subresource::<_, serde_json::Value>(
                    "binding",
                    name,
                    &PostParams::default(),
                    &binding,
                ),
        )
        .await
        .map(|_| ())
    }
}

/// Runs one call under `deadline` and sorts its failure.
async fn within<T>(
    deadline: Instant,
    call: impl std::future::Future<Output = kube::Result<T>>,
) -> Result<T, ApiCallError> {
    match tokio::time::timeout_at(deadline, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(classify(err)),
        Err(_) => Err(ApiCallError::Unknown(
            "no answer from the Kubernetes API in time".to_owned(),
        )),
    }
}

fn classify(err: kube::Error) -> ApiCallError {
    match err {
        kube::Error::Api(status) => {
            let code = status.code;
            // 408 and 429 are "try again"; 409 may mean it was done by an earlier try;
            // 5xx may have been applied before the server failed.
            let definite = (400..500).contains(&code) && !matches!(code, 408 | 409 | 429);
            if definite {
                ApiCallError::Refused {
                    code,
                    reason: status.reason.clone(),
                    message: status.message.clone(),
                }
            } else {
                ApiCallError::Unknown(format!("HTTP {code} {}: {}", status.reason, status.message))
            }
        }
        other => ApiCallError::Unknown(error_chain(&other)),
    }
}

/// An error and its sources, "outer: inner: innermost", without Debug output.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_addresses_parse_with_or_without_a_scheme() {
        let parse = |t: &str| t.parse::<KubeApiConfig>();
        assert_eq!(parse("auto"), Ok(KubeApiConfig::Infer));
        assert_eq!(
            parse("127.0.0.1:8001"),
            Ok(KubeApiConfig::Url("http://127.0.0.1:8001".into()))
        );
        assert_eq!(
            parse("http://127.0.0.1:8001"),
            Ok(KubeApiConfig::Url("http://127.0.0.1:8001".into())),
            "a URL is taken as given, not prefixed twice"
        );
        assert_eq!(
            parse("https://10.0.0.1:6443"),
            Ok(KubeApiConfig::Url("https://10.0.0.1:6443".into()))
        );
        assert!(parse("ftp://x").is_err());
        assert!(parse("http://").is_err());
    }

    #[test]
    fn names_are_checked_as_kubernetes_does() {
        for good in ["a", "bert-7", "x.y-z.0", &"a".repeat(253)] {
            assert_eq!(check_dns1123_subdomain("pod name", good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "x/../../../../namespaces/kube-system/pods/other",
            "..",
            ".",
            "a..b",
            ".a",
            "a.",
            "-a",
            "a-",
            "A",
            "a_b",
            "a%2fb",
            "a?b",
            &"a".repeat(254),
        ] {
            let err = check_dns1123_subdomain("pod name", bad).expect_err(bad);
            assert!(err.contains("invalid pod name"), "{err}");
        }
        assert_eq!(check_dns1123_label("namespace", "ml-team1"), Ok(()));
        assert_eq!(check_dns1123_label("namespace", &"n".repeat(63)), Ok(()));
        for bad in ["kube.system", "", "-ml", &"n".repeat(64), "ml/x"] {
            assert!(check_dns1123_label("namespace", bad).is_err(), "{bad}");
        }
    }
}
