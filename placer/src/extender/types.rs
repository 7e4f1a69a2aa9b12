//! The JSON shapes of `k8s.io/kube-scheduler/extender/v1`.
//!
//! The Go structs carry no JSON tags, so the keys are the Go field names
//! (`Pod`, `NodeNames`, `FailedNodes`, ...). Go's decoder matches keys without
//! regard to case, so the lower-case spellings are accepted too. Only the parts
//! of `v1.Pod` and `v1.Node` the placer reads are modelled; everything else is
//! ignored on input, and nodes are echoed back exactly as received.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What kube-scheduler posts to `filter` and `prioritize`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ExtenderArgs {
    #[serde(rename = "Pod", alias = "pod")]
    pub pod: Option<Pod>,
    /// Candidate nodes, when the extender is not node-cache capable.
    #[serde(rename = "Nodes", alias = "nodes", default)]
    pub nodes: Option<NodeList>,
    /// Candidate node names, when it is.
    #[serde(
        rename = "NodeNames",
        alias = "nodenames",
        alias = "nodeNames",
        default
    )]
    pub node_names: Option<Vec<String>>,
}

/// `v1.NodeList`, keeping each node as received so it can be echoed back.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct NodeList {
    #[serde(default)]
    pub items: Vec<Value>,
    #[serde(flatten)]
    pub rest: BTreeMap<String, Value>,
}

/// The name of a node object (`metadata.name`).
pub fn node_name(node: &Value) -> Option<&str> {
    node.get("metadata")?.get("name")?.as_str()
}

/// `v1.Pod`, the parts the placer reads.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Pod {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: PodSpec,
}

/// `metav1.ObjectMeta`, the parts the placer reads.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ObjectMeta {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub namespace: String,
    #[serde(default)]
    pub uid: String,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// `v1.PodSpec`, the parts the placer reads.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct PodSpec {
    #[serde(default)]
    pub containers: Vec<Container>,
}

/// `v1.Container`, the parts the placer reads.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Container {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub resources: Resources,
}

/// `v1.ResourceRequirements`: quantities are strings (`"4Gi"`) or, from some clients, numbers.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Resources {
    #[serde(default)]
    pub limits: BTreeMap<String, Value>,
    #[serde(default)]
    pub requests: BTreeMap<String, Value>,
}

/// What `filter` answers.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ExtenderFilterResult {
    #[serde(rename = "Nodes", skip_serializing_if = "Option::is_none", default)]
    pub nodes: Option<NodeList>,
    #[serde(rename = "NodeNames", skip_serializing_if = "Option::is_none", default)]
    pub node_names: Option<Vec<String>>,
    /// Nodes that cannot take the pod now, with why (preemption might help).
    #[serde(rename = "FailedNodes", default)]
    pub failed_nodes: BTreeMap<String, String>,
    /// Nodes that can never take the pod as it is (no GPU the placer knows).
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
