//! The placer's calls to the Kubernetes API: read a pod, annotate it with its
//! GPU, create its Binding, and evict a pod whose task ignored its eviction. Through
//! the `kube` client, so the placer authenticates like any in-cluster controller
//! (service-account token and CA) or from a kubeconfig, over TLS; a plain-HTTP URL
//! (e.g. `kubectl proxy`) works too.
//!
//! Every call runs under the caller's deadline, and its failure says whether the
//! call is known *not* to have happened ([`ApiCallError::Refused`] with a definite
//! client error) or may have happened ([`ApiCallError::Unknown`]): a Binding whose
//! answer never came may well exist, and the reservation must then be kept.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Binding, ObjectReference, Pod};
use k8s_openapi::api::policy::v1::Eviction;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Preconditions};
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

// The name checks are the spec validation's too (`TaskSpec.kubernetes_pod`).
pub use crate::validate::{check_dns1123_label, check_dns1123_subdomain};

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
    /// the first call, not here. The client retries 429, 503 and 504 answers by itself,
    /// within each call's deadline.
    pub async fn connect(config: &KubeApiConfig) -> Result<KubeApi> {
        Self::connect_with(config, true).await
    }

    /// A client for `config` that hands every answer back, 429 included, for a caller
    /// that retries by itself: the pod evictor, for which a PodDisruptionBudget's 429 is
    /// an answer to log and count and ask again at its next tick, not a blip to retry
    /// until the call's deadline.
    pub async fn connect_without_retries(config: &KubeApiConfig) -> Result<KubeApi> {
        Self::connect_with(config, false).await
    }

    async fn connect_with(config: &KubeApiConfig, retries: bool) -> Result<KubeApi> {
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
        kube_config.default_retry = retries;
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

/// What the API server answered to a pod's Eviction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EvictionAnswer {
    /// Accepted (201): kubelet stops the pod, within its termination grace.
    Accepted,
    /// 404: the pod is gone already.
    Gone,
    /// 429: a PodDisruptionBudget does not allow it now; ask again later.
    Blocked(String),
    /// Anything else (no answer in time, a server error, a conflict, a refusal).
    Failed(String),
}

impl KubeApi {
    /// Creates a `policy/v1` Eviction of the pod (what `kubectl drain` does: it honours
    /// PodDisruptionBudgets), with `grace_period_s` to stop, on condition that the pod
    /// still has `uid` (when not empty), so a pod re-created under the same name is
    /// left alone.
    pub async fn evict(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        grace_period_s: i64,
        deadline: Instant,
    ) -> EvictionAnswer {
        if let Err(err) = Self::check_pod(namespace, name) {
            return EvictionAnswer::Failed(err.to_string());
        }
        let eviction = Eviction {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some(namespace.to_owned()),
                ..Default::default()
            },
            delete_options: Some(DeleteOptions {
                grace_period_seconds: Some(grace_period_s),
                preconditions: (!uid.is_empty()).then(|| Preconditions {
                    uid: Some(uid.to_owned()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        };
        let pods = self.pods(namespace);
        let params = PostParams::default();
        let call =
            pods.create_subresource::<_, serde_json::Value>("eviction", name, &params, &eviction);
        match tokio::time::timeout_at(deadline, call).await {
            Ok(Ok(_)) => EvictionAnswer::Accepted,
            Ok(Err(kube::Error::Api(status))) if status.code == 404 => EvictionAnswer::Gone,
            Ok(Err(kube::Error::Api(status))) if status.code == 429 => {
                EvictionAnswer::Blocked(status.message.clone())
            }
            Ok(Err(err)) => EvictionAnswer::Failed(classify(err).to_string()),
            Err(_) => {
                EvictionAnswer::Failed("no answer from the Kubernetes API in time".to_owned())
            }
        }
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
