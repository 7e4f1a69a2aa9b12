//! The JSON shapes of `k8s.io/kube-scheduler/extender/v1`, over the Kubernetes
//! objects of `k8s-openapi`.
//!
//! The Go structs carry no JSON tags, so the keys are the Go field names
//! (`Pod`, `NodeNames`, `FailedNodes`, ...). Go's decoder matches keys without
//! regard to case, so the lower-case spellings are accepted too. Pods and nodes
//! are `k8s-openapi`'s `Pod` and `Node`, so every field kube-scheduler sends has
//! its real type (quantities, annotations, the node name).

use std::collections::BTreeMap;

use k8s_openapi::List;
use k8s_openapi::api::core::v1::{Node, Pod};
use serde::{Deserialize, Serialize};

/// What kube-scheduler posts to `filter` and `prioritize`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ExtenderArgs {
    #[serde(rename = "Pod", alias = "pod")]
    pub pod: Option<Pod>,
    /// Candidate nodes, when the extender is not node-cache capable.
    #[serde(rename = "Nodes", alias = "nodes", default)]
    pub nodes: Option<List<Node>>,
    /// Candidate node names, when it is.
    #[serde(
        rename = "NodeNames",
        alias = "nodenames",
        alias = "nodeNames",
        default
    )]
    pub node_names: Option<Vec<String>>,
}

/// The name of a node object (`metadata.name`).
pub fn node_name(node: &Node) -> Option<&str> {
    node.metadata.name.as_deref()
}

/// What `filter` answers.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ExtenderFilterResult {
    #[serde(rename = "Nodes", skip_serializing_if = "Option::is_none", default)]
    pub nodes: Option<List<Node>>,
    #[serde(rename = "NodeNames", skip_serializing_if = "Option::is_none", default)]
    pub node_names: Option<Vec<String>>,
    /// Nodes that cannot take the pod now, with why (preemption might help).
    #[serde(rename = "FailedNodes", default)]
    pub failed_nodes: BTreeMap<String, String>,
    /// Nodes that can never take the pod as it is: no GPU the placer knows, or
    /// every GPU of the node too small for the request even when empty.
    #[serde(rename = "FailedAndUnresolvableNodes", default)]
    pub failed_and_unresolvable_nodes: BTreeMap<String, String>,
    #[serde(rename = "Error", default)]
    pub error: String,
}

/// One entry of what `prioritize` answers (`HostPriorityList` is a list of these).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPriority {
    #[serde(rename = "Host")]
    pub host: String,
    /// 0 (worst) to 10 (best); kube-scheduler multiplies it by the extender's weight.
    #[serde(rename = "Score")]
    pub score: i64,
}

/// What kube-scheduler posts to `bind`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ExtenderBindingArgs {
    #[serde(rename = "PodName", alias = "podName", alias = "podname", default)]
    pub pod_name: String,
    #[serde(
        rename = "PodNamespace",
        alias = "podNamespace",
        alias = "podnamespace",
        default
    )]
    pub pod_namespace: String,
    #[serde(rename = "PodUID", alias = "podUID", alias = "poduid", default)]
    pub pod_uid: String,
    #[serde(rename = "Node", alias = "node", default)]
    pub node: String,
}

/// What `bind` answers: an empty `Error` means bound.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ExtenderBindingResult {
    #[serde(rename = "Error", default)]
    pub error: String,
}
