//! The Kubernetes scheduler extender: `filter`, `prioritize` and `bind` over HTTP.
//!
//! kube-scheduler posts the pod and candidate nodes; a node is a candidate for
//! the placer when one of its GPUs (devices registered with `node` = the node
//! name) can take the pod (see [`crate::policy`]). `prioritize` scores nodes
//! 0–10 by the best device's predicted Σ PD increase Δ as `round(10 / Δ)`: an
//! idle GPU (Δ = 1) scores 10, a GPU where the pod would add two units of
//! degradation scores 5.
//!
//! `bind` reads the pod from the Kubernetes API (so any placer replica, or one
//! restarted since `filter`, can bind it), reserves a GPU of the node with the
//! same store transaction as the gRPC `Place` (or keeps the one an earlier,
//! inconclusive bind of the pod made there), writes the GPU into the pod's
//! annotations, and creates the pod's Binding. A Binding the API server refused
//! gives the reservation back; one whose outcome is unknown (no answer in time,
//! a conflict, a server error) is settled by reading the pod back: bound to this
//! node is success, bound elsewhere gives the reservation back, still pending
//! keeps it, and kube-scheduler's retry binds the pod to the same node.
//!
//! Requests that can never be met on a node (every GPU of the node too small even
//! when empty) fail it in `FailedAndUnresolvableNodes`, and such a pod does not
//! count as waiting ahead of others.
//!
//! A pod's priority class and slowdown cap come from its annotations, or from its
//! Kubernetes PriorityClass through [`ExtenderConfig::priority_rule`] (see [`pod`]).
//!
//! Malformed bodies get HTTP 400 with the result shape and `Error` set; problems
//! with the pod itself (a missing annotation, an unparsable quantity) are answered
//! with `Error` naming the annotation or resource, as kube-scheduler expects.

pub mod kube_api;
pub mod pod;
pub mod pod_evictor;
pub mod quantity;
pub mod types;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use iadeep_proto::{TaskSpec, place_response};
use k8s_openapi::api::core::v1::Pod;
use serde::Serialize;
use tokio::time::Instant;

use crate::error::PlacerError;
use crate::metrics::PlacerMetrics;
use crate::policy::{Assessment, Rejection, Verdict};
use crate::service::PlacementService;
use crate::validate;
use crate::view::ClusterView;
use kube_api::{ApiCallError, KubeApi, KubeApiConfig};
pub use pod::PriorityRule;
use types::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, HostPriority,
    node_name,
};

/// Annotation the extender writes on a bound pod: the id of its GPU in the store.
pub const DEVICE_ANNOTATION: &str = "iadeep.io/device-id";
/// Annotation with the GPU's index on its node (for `CUDA_VISIBLE_DEVICES`).
pub const GPU_INDEX_ANNOTATION: &str = "iadeep.io/gpu-index";
/// Annotation with the GPU's UUID, when its tuner read one from NVML.
pub const GPU_UUID_ANNOTATION: &str = "iadeep.io/gpu-uuid";
/// Annotation with the GPU memory reserved for the pod, MiB.
pub const RESERVED_MEM_ANNOTATION: &str = "iadeep.io/reserved-mem-mib";

/// Default of [`ExtenderConfig::bind_timeout`]: under the 5 s `httpTimeout` of the
/// scheduler configuration in `deploy/kubernetes/`, so kube-scheduler hears the
/// answer instead of giving up on a bind that may still succeed.
pub const DEFAULT_BIND_TIMEOUT: Duration = Duration::from_secs(4);

/// The extender's settings.
#[derive(Clone, Debug)]
pub struct ExtenderConfig {
    /// Where to serve filter, prioritize and bind.
    pub listen: SocketAddr,
    /// The Kubernetes API for `bind`; `None` makes `bind` refuse.
    pub kube_api: Option<KubeApiConfig>,
    /// Longest a `bind` may take, Kubernetes API calls included; must stay below the
    /// scheduler's `httpTimeout` for the extender.
    pub bind_timeout: Duration,
    /// Which pods without an `iadeep.io/priority-class` annotation are production.
    pub priority_rule: PriorityRule,
}

/// The extender's state.
#[derive(Debug)]
pub struct Extender {
    service: PlacementService,
    metrics: Arc<PlacerMetrics>,
    kube: Option<KubeApi>,
    bind_timeout: Duration,
    priority_rule: PriorityRule,
}

impl Extender {
    /// An extender answering from `service`, binding pods through `kube` when given,
    /// counting its requests in `metrics`. Every pod is opportunistic unless annotated
    /// otherwise until [`Extender::with_priority_rule`] says which PriorityClasses count
    /// as production.
    pub fn new(
        service: PlacementService,
        metrics: Arc<PlacerMetrics>,
        kube: Option<KubeApi>,
        bind_timeout: Duration,
    ) -> Extender {
        Extender {
            service,
            metrics,
            kube,
            bind_timeout,
            priority_rule: PriorityRule::default(),
        }
    }

    /// The extender, reading pods' priority classes by `rule`
    /// ([`ExtenderConfig::priority_rule`]).
    pub fn with_priority_rule(mut self, rule: PriorityRule) -> Extender {
        self.priority_rule = rule;
        self
    }

    /// The HTTP routes: `POST /filter`, `POST /prioritize`, `POST /bind`.
    pub fn router(self: Arc<Self>) -> Router {
        Router::new()
            .route("/filter", post(filter))
            .route("/prioritize", post(prioritize))
            .route("/bind", post(bind))
            .with_state(self)
    }
}

fn json<T: Serialize>(status: StatusCode, body: &T) -> Response {
    (status, axum::Json(body)).into_response()
}

/// The pod's spec from a pod object under the priority `rule`, checked, or the error
/// to answer.
fn spec_of(pod: &Pod, rule: &PriorityRule) -> Result<TaskSpec, String> {
    pod::task_spec(pod, rule)
        .and_then(|spec| validate::task_spec("pod", &spec).map(|()| spec))
        .map_err(|e| e.to_string())
}

/// The pod's spec and the candidate node names of a filter or prioritize request.
fn parse_args(
    body: &[u8],
    rule: &PriorityRule,
) -> Result<(ExtenderArgs, TaskSpec, Vec<String>), (StatusCode, String)> {
    let args: ExtenderArgs = serde_json::from_slice(body).map_err(|e| {
        (
            StatusCode::BAD_REQUEST,
            format!("invalid request body: {e}"),
        )
    })?;
    let pod = args
        .pod
        .as_ref()
        .ok_or((StatusCode::BAD_REQUEST, "invalid Pod: missing".to_owned()))?;
    let spec = spec_of(pod, rule).map_err(|e| (StatusCode::OK, e))?;
    let nodes: Vec<String> = match (&args.nodes, &args.node_names) {
        (Some(list), _) => list
            .items
            .iter()
            .filter_map(|n| node_name(n).map(str::to_owned))
            .collect(),
        (None, Some(names)) => names.clone(),
        (None, None) => Vec::new(),
    };
    Ok((args, spec, nodes))
}

/// Device ids of each node, for the nodes asked about.
fn devices_by_node(view: &ClusterView, nodes: &[String]) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> =
        nodes.iter().map(|n| (n.clone(), Vec::new())).collect();
    for (id, device) in view.devices() {
        if let Some(info) = &device.info
            && let Some(list) = out.get_mut(&info.node)
        {
            list.push(id.to_owned());
        }
    }
    out
}

/// Best candidate per node, and the first rejection of each node without one.
fn per_node<'a>(
    assessment: &'a Assessment<'_>,
    by_node: &'a BTreeMap<String, Vec<String>>,
) -> (HashMap<&'a str, f64>, HashMap<&'a str, String>) {
    let mut node_of: HashMap<&str, &str> = HashMap::new();
    for (node, devices) in by_node {
        for d in devices {
            node_of.insert(d.as_str(), node.as_str());
        }
    }
    let mut best: HashMap<&str, (f64, f64)> = HashMap::new();
    for c in &assessment.candidates {
        if let Some(node) = node_of.get(c.device_id) {
            let entry = best.entry(node).or_insert((c.rank, c.pd_increase));
            if c.rank < entry.0 {
                *entry = (c.rank, c.pd_increase);
            }
        }
    }
    let best = best.into_iter().map(|(n, (_, pd))| (n, pd)).collect();
    let mut why: HashMap<&str, String> = HashMap::new();
    for (device, rejection) in &assessment.rejected {
        if let Some(node) = node_of.get(device) {
            why.entry(node)
                .or_insert_with(|| format!("GPU {device}: {rejection}"));
        }
    }
    (best, why)
}

/// Why the pod can never run on any GPU of a node (`None` when one might take it).
fn never_fits_on(
    ext: &Extender,
    view: &ClusterView,
    spec: &TaskSpec,
    devices: &[String],
) -> Option<String> {
    let reasons: Option<Vec<(String, Rejection)>> = devices
        .iter()
        .map(|d| Some((d.clone(), ext.service.placer().never_fits(view, spec, d)?)))
        .collect();
    reasons
        .filter(|r| !r.is_empty())
        .map(|r| crate::grpc::never_fits_text(&r))
}

/// The node of the GPU the task is already placed on, if any: a placed pod may only
/// pass that node, whatever the others offer.
fn placed_node(view: &ClusterView, spec: &TaskSpec) -> Option<String> {
    view.device_of(&spec.task_id)
        .and_then(|d| view.device(d))
        .and_then(|d| d.info.as_ref())
        .map(|i| i.node.clone())
}

/// Splits `by_node` into the nodes the task never fits on, with why, and the devices
/// of the other nodes: only those are worth assessing, and the former fail for good.
fn split_never_fits<'a>(
    ext: &Extender,
    view: &ClusterView,
    spec: &TaskSpec,
    by_node: &'a BTreeMap<String, Vec<String>>,
) -> (HashMap<&'a str, String>, Vec<String>) {
    let never: HashMap<&str, String> = by_node
        .iter()
        .filter_map(|(node, devices)| {
            Some((node.as_str(), never_fits_on(ext, view, spec, devices)?))
        })
        .collect();
    let restrict = by_node
        .iter()
        .filter(|(node, _)| !never.contains_key(node.as_str()))
        .flat_map(|(_, devices)| devices.iter().cloned())
        .collect();
    (never, restrict)
}

/// Sorts `nodes` into those that pass the filter (`passed`) and those that fail it,
/// with why (`result`). Returns how long the pod is told to wait when it queues and
/// some node could take it one day, with the devices it was assessed on (those of the
/// nodes kube-scheduler offered: what its hold is decided over) and the task waiting
/// ahead its device was held for, when that is why.
fn filter_nodes(
    ext: &Extender,
    view: &ClusterView,
    spec: &TaskSpec,
    nodes: &[String],
    result: &mut ExtenderFilterResult,
    passed: &mut Vec<String>,
) -> Option<(Duration, Vec<String>, Option<String>)> {
    let by_node = devices_by_node(view, nodes);
    let placed_on = placed_node(view, spec);
    let (never, restrict) = split_never_fits(ext, view, spec, &by_node);
    let placer = ext.service.placer();
    let assessment = if restrict.is_empty() {
        Assessment::default()
    } else {
        placer.assess(view, spec, &restrict, iadeep_proto::now_unix_ms())
    };
    // A device held for a task waiting ahead fails every node, as the bind would be
    // told to queue.
    let (verdict, held_for) = placer.with_holds(
        view,
        spec,
        placer.verdict(spec, &assessment),
        iadeep_proto::now_unix_ms(),
    );
    let room_on = match &verdict {
        Verdict::Queue { .. } if placed_on.is_none() => {
            room_node(ext, view, spec, &assessment, &restrict, &by_node)
        }
        _ => None,
    };
    let (best, why) = per_node(&assessment, &by_node);
    for node in nodes {
        let has_gpus = by_node.get(node).is_some_and(|d| !d.is_empty());
        if let Some(on) = &placed_on {
            if on == node {
                passed.push(node.clone());
            } else {
                result.failed_nodes.insert(
                    node.clone(),
                    format!("task {} is already placed on node {on}", spec.task_id),
                );
            }
        } else if !has_gpus {
            result.failed_and_unresolvable_nodes.insert(
                node.clone(),
                "no GPU on this node is registered with iadeep".to_owned(),
            );
        } else if let Some(reason) = never.get(node.as_str()) {
            result
                .failed_and_unresolvable_nodes
                .insert(node.clone(), reason.clone());
        } else if room_on.as_deref() == Some(node.as_str()) {
            passed.push(node.clone());
        } else if let Verdict::Queue { reason, .. } = &verdict {
            result
                .failed_nodes
                .insert(node.clone(), format!("queued: {reason}"));
        } else if best.contains_key(node.as_str()) {
            passed.push(node.clone());
        } else {
            let reason = why
                .get(node.as_str())
                .cloned()
                .unwrap_or_else(|| "no GPU can take the pod".to_owned());
            result.failed_nodes.insert(node.clone(), reason);
        }
    }
    // Only a pod that some node could take one day waits ahead of later pods; one that
    // passes a node to make room there is not told to wait by the filter.
    match verdict {
        Verdict::Queue { retry_after, .. }
            if placed_on.is_none() && !restrict.is_empty() && room_on.is_none() =>
        {
            Some((retry_after, restrict, held_for))
        }
        _ => None,
    }
}

/// The node where a production pod that fits no node under the slowdown caps would
/// make room by evicting opportunistic residents of one GPU ([`Verdict::Evict`]), if
/// any. That node passes the filter, so kube-scheduler binds the pod there: the bind
/// asks the placer, which writes the evictions (and its claim on the room) and answers
/// "queued" until the evicted jobs are gone, and kube-scheduler's retry places the pod.
/// A filter that failed every node would never reach the placer's eviction.
fn room_node(
    ext: &Extender,
    view: &ClusterView,
    spec: &TaskSpec,
    assessment: &Assessment<'_>,
    restrict: &[String],
    by_node: &BTreeMap<String, Vec<String>>,
) -> Option<String> {
    if !spec.is_production() || !assessment.candidates.is_empty() || restrict.is_empty() {
        return None;
    }
    let decision = ext
        .service
        .placer()
        .decide(view, spec, restrict, iadeep_proto::now_unix_ms());
    let Verdict::Evict { device_id, .. } = decision.verdict else {
        return None;
    };
    by_node
        .iter()
        .find(|(_, devices)| devices.contains(&device_id))
        .map(|(node, _)| node.clone())
}

async fn filter(State(ext): State<Arc<Extender>>, body: Bytes) -> Response {
    ext.metrics.extender_filter.inc();
    let (args, spec, nodes) = match parse_args(&body, &ext.priority_rule) {
        Ok(parsed) => parsed,
        Err((status, error)) => {
            tracing::info!(%error, "extender filter: request refused");
            return json(
                status,
                &ExtenderFilterResult {
                    error,
                    ..Default::default()
                },
            );
        }
    };
    let mut result = ExtenderFilterResult::default();
    let mut passed: Vec<String> = Vec::new();
    let queued_for = {
        let view = ext.service.view();
        filter_nodes(&ext, &view, &spec, &nodes, &mut result, &mut passed)
    };
    // kube-scheduler retries a pending pod by itself: it waits like a gRPC client told to queue.
    if let Some((retry_after, restrict, held_for)) = queued_for {
        ext.service
            .note_queued(&spec, &restrict, retry_after, held_for.as_deref());
    }
    match (args.nodes, args.node_names) {
        (Some(mut list), _) => {
            list.items
                .retain(|n| node_name(n).is_some_and(|name| passed.iter().any(|p| p == name)));
            result.nodes = Some(list);
        }
        (None, _) => result.node_names = Some(passed.clone()),
    }
    tracing::debug!(task = %spec.task_id, passed = passed.len(),
        failed = result.failed_nodes.len(),
        unresolvable = result.failed_and_unresolvable_nodes.len(),
        "extender filter");
    json(StatusCode::OK, &result)
}

/// Score 0–10 from the predicted Σ PD increase (1 on an idle GPU).
fn score(pd_increase: f64) -> i64 {
    if !(pd_increase.is_finite() && pd_increase > 0.0) {
        return 0;
    }
    (10.0 / pd_increase.max(1.0)).round().clamp(0.0, 10.0) as i64
}

async fn prioritize(State(ext): State<Arc<Extender>>, body: Bytes) -> Response {
    ext.metrics.extender_prioritize.inc();
    let (_, spec, nodes) = match parse_args(&body, &ext.priority_rule) {
        Ok(parsed) => parsed,
        Err((_, error)) => {
            // HostPriorityList has no error field: a bad request is answered with a
            // 400 whose body says why; kube-scheduler logs it and ignores the scores.
            tracing::info!(%error, "extender prioritize: request refused");
            return (StatusCode::BAD_REQUEST, error).into_response();
        }
    };
    let view = ext.service.view();
    let by_node = devices_by_node(&view, &nodes);
    let restrict: Vec<String> = by_node.values().flatten().cloned().collect();
    let assessment = if restrict.is_empty() {
        Assessment::default()
    } else {
        ext.service
            .placer()
            .assess(&view, &spec, &restrict, iadeep_proto::now_unix_ms())
    };
    let (best, _) = per_node(&assessment, &by_node);
    let list: Vec<HostPriority> = nodes
        .iter()
        .map(|node| HostPriority {
            host: node.clone(),
            score: best.get(node.as_str()).copied().map_or(0, score),
        })
        .collect();
    drop(view);
    json(StatusCode::OK, &list)
}

async fn bind(State(ext): State<Arc<Extender>>, body: Bytes) -> Response {
    ext.metrics.extender_bind.inc();
    let deadline = Instant::now() + ext.bind_timeout;
    let answer = match serde_json::from_slice::<ExtenderBindingArgs>(&body) {
        Ok(args) => bind_pod(&ext, &args, deadline).await,
        Err(e) => Err((
            StatusCode::BAD_REQUEST,
            format!("invalid request body: {e}"),
        )),
    };
    match answer {
        Ok(()) => json(StatusCode::OK, &ExtenderBindingResult::default()),
        Err((status, error)) => {
            tracing::info!(%error, "extender bind: not bound");
            json(status, &ExtenderBindingResult { error })
        }
    }
}

/// The reservation a bind works with.
struct Reserved {
    device_id: String,
    reserved_mem_mib: u64,
    /// Made by this bind (given back if the Binding is refused), rather than kept from
    /// an earlier, inconclusive bind of the same pod.
    new: bool,
}

/// Time kept back from the Binding call to read the pod back when its outcome is unknown.
fn read_back_reserve(budget: Duration) -> Duration {
    budget / 4
}

async fn bind_pod(
    ext: &Extender,
    args: &ExtenderBindingArgs,
    deadline: Instant,
) -> Result<(), (StatusCode, String)> {
    let refuse = |error: String| (StatusCode::OK, error);
    let namespace = checked_namespace(args)?;
    let Some(kube) = &ext.kube else {
        return Err(refuse(
            "this placer was started without --kube-api, so it cannot create the pod's \
             Binding; configure the extender without bindVerb or give the placer --kube-api"
                .to_owned(),
        ));
    };
    let pod = Target {
        namespace,
        name: args.pod_name.as_str(),
        node: args.node.as_str(),
    };
    let Target {
        namespace,
        name,
        node,
    } = pod;
    let calls_until = deadline - read_back_reserve(ext.bind_timeout);

    let Some((uid, spec)) = unbound_pod(kube, pod, &args.pod_uid, &ext.priority_rule, calls_until)
        .await
        .map_err(refuse)?
    else {
        return Ok(());
    };

    let reserved = reserve(ext, &spec, node).await.map_err(refuse)?;

    // The GPU goes on the pod before the Binding, so it is there when the kubelet
    // starts the pod (for a device plugin, or the container through the downward API).
    let annotations = gpu_annotations(ext, &spec, &reserved);
    if let Err(e) = kube
        .annotate(namespace, name, &annotations, calls_until)
        .await
    {
        // No Binding was attempted: nothing runs on the reservation yet.
        give_back(ext, &spec, &reserved, "annotating the pod failed").await;
        return Err(refuse(format!(
            "cannot annotate pod {namespace}/{name} with its GPU: {e}"
        )));
    }

    let outcome = kube.bind(namespace, name, &uid, node, calls_until).await;
    match outcome {
        Ok(()) => {}
        // Not sent (names are checked above, so not expected) or refused: no Binding.
        Err(refused @ (ApiCallError::Refused { .. } | ApiCallError::NotSent(_))) => {
            give_back(ext, &spec, &reserved, "the Binding was refused").await;
            return Err(refuse(format!(
                "Binding of pod {namespace}/{name} to {node}: {refused}"
            )));
        }
        Err(ApiCallError::Unknown(why)) => {
            read_back(ext, kube, pod, &spec, &reserved, &why, deadline)
                .await
                .map_err(refuse)?;
        }
    }
    tracing::info!(pod = %name, namespace, node, device = %reserved.device_id,
        reserved_mem_mib = reserved.reserved_mem_mib, "bound");
    Ok(())
}

/// The pod a bind is for, and the node it is to be bound to.
#[derive(Clone, Copy)]
struct Target<'a> {
    namespace: &'a str,
    name: &'a str,
    node: &'a str,
}

/// The pod's namespace ("default" when the request names none), once the request
/// names a pod and a node, all of them names Kubernetes itself could have given.
fn checked_namespace(args: &ExtenderBindingArgs) -> Result<&str, (StatusCode, String)> {
    for (field, value) in [("PodName", &args.pod_name), ("Node", &args.node)] {
        if value.is_empty() {
            return Err((StatusCode::BAD_REQUEST, format!("invalid {field}: missing")));
        }
    }
    let namespace = if args.pod_namespace.is_empty() {
        "default"
    } else {
        args.pod_namespace.as_str()
    };
    // The names go into the API's URL paths and the Binding: refuse what Kubernetes
    // itself would never have named so (e.g. a pod name with "/.." in it), before any call.
    kube_api::check_dns1123_label("PodNamespace", namespace)
        .and_then(|()| kube_api::check_dns1123_subdomain("PodName", &args.pod_name))
        .and_then(|()| kube_api::check_dns1123_subdomain("Node", &args.node))
        .map_err(|error| (StatusCode::OK, error))?;
    Ok(namespace)
}

/// The pod's UID and task spec, read from the API server, not from memory: any replica
/// can bind it. `None` when it is bound to `pod.node` already; an error when it was
/// re-created since it was scheduled (its UID is not `want_uid`), is bound elsewhere,
/// or cannot be read.
async fn unbound_pod(
    kube: &KubeApi,
    pod: Target<'_>,
    want_uid: &str,
    rule: &PriorityRule,
    calls_until: Instant,
) -> Result<Option<(String, TaskSpec)>, String> {
    let Target {
        namespace,
        name,
        node,
    } = pod;
    let pod = kube
        .pod(namespace, name, calls_until)
        .await
        .map_err(|e| format!("cannot read pod {namespace}/{name}: {e}"))?;
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    if !want_uid.is_empty() && uid != want_uid {
        return Err(format!(
            "pod {namespace}/{name} has UID {uid}, not {want_uid}: it was re-created since it was scheduled"
        ));
    }
    let spec = spec_of(&pod, rule)?;
    let already = pod.spec.as_ref().and_then(|s| s.node_name.clone());
    if let Some(bound) = already.as_deref().filter(|n| !n.is_empty()) {
        return if bound == node {
            Ok(None)
        } else {
            Err(format!(
                "pod {namespace}/{name} is already bound to node {bound}"
            ))
        };
    }
    Ok(Some((uid, spec)))
}

/// Gives back a reservation this bind made (one kept from an earlier bind stays), for
/// a pod that was not bound; `why` is logged if that fails.
async fn give_back(ext: &Extender, spec: &TaskSpec, reserved: &Reserved, why: &str) {
    if !reserved.new {
        return;
    }
    if let Err(undo) = ext.service.release(&spec.task_id).await {
        tracing::error!(task = %spec.task_id, %undo, why,
            "could not give back the reservation of an unbound pod");
    }
}

/// After a Binding whose outcome is unknown (`why`): asks the API server where the pod
/// is now. Bound to `pod.node`: done. Bound elsewhere or gone: the reservation is given
/// back. Not bound yet: it is kept, for a retry to bind the pod to the same node.
async fn read_back(
    ext: &Extender,
    kube: &KubeApi,
    pod: Target<'_>,
    spec: &TaskSpec,
    reserved: &Reserved,
    why: &str,
    deadline: Instant,
) -> Result<(), String> {
    let Target {
        namespace,
        name,
        node,
    } = pod;
    // It may exist: ask the API server where the pod is now.
    let now = kube.pod(namespace, name, deadline).await;
    match now
        .as_ref()
        .map(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()))
    {
        Ok(Some(bound)) if bound == node => {
            tracing::info!(pod = %name, namespace, node, why = %why,
                "Binding's answer was lost, but the pod is bound to this node");
            Ok(())
        }
        Ok(Some(other)) if !other.is_empty() => {
            give_back(ext, spec, reserved, "the pod is bound to another node").await;
            Err(format!(
                "pod {namespace}/{name} is bound to node {other}, not {node}"
            ))
        }
        Err(ApiCallError::Refused { code: 404, .. }) => {
            give_back(ext, spec, reserved, "the pod is gone").await;
            Err(format!("pod {namespace}/{name} no longer exists"))
        }
        _ => Err(format!(
            "Binding of pod {namespace}/{name} to {node}: {why}; the pod does not \
             show as bound yet, so its reservation on GPU {} is kept (a retry binds \
             it to the same node; the unstarted-task grace gives it back if the pod \
             never runs)",
            reserved.device_id
        )),
    }
}

/// Reserves a GPU of `node` for the pod, or finds the one an earlier bind reserved there.
async fn reserve(ext: &Extender, spec: &TaskSpec, node: &str) -> Result<Reserved, String> {
    let existing = |device_id: &str| -> Result<Reserved, String> {
        let view = ext.service.view();
        let device = view.device(device_id);
        let on = device
            .and_then(|d| d.info.as_ref())
            .map(|i| i.node.as_str());
        if on != Some(node) {
            return Err(format!(
                "task {} already holds GPU {device_id} on node {}, not on {node}",
                spec.task_id,
                on.unwrap_or("(unknown)")
            ));
        }
        let reserved_mem_mib = device
            .and_then(|d| {
                d.residents
                    .iter()
                    .find(|r| r.reservation.task_id == spec.task_id)
            })
            .map_or(spec.gpu_mem_request_mib, |r| r.reservation.reserved_mem_mib);
        Ok(Reserved {
            device_id: device_id.to_owned(),
            reserved_mem_mib,
            new: false,
        })
    };
    let held = ext
        .service
        .view()
        .device_of(&spec.task_id)
        .map(str::to_owned);
    if let Some(device_id) = held {
        return existing(&device_id);
    }
    let restrict = devices_by_node(&ext.service.view(), &[node.to_owned()])
        .remove(node)
        .unwrap_or_default();
    if restrict.is_empty() {
        return Err(format!("node {node} has no GPU registered with iadeep"));
    }
    match ext.service.place(spec.clone(), restrict).await {
        Ok(outcome) => match outcome.decision {
            place_response::Decision::Placed(placement) => Ok(Reserved {
                device_id: placement.device_id,
                reserved_mem_mib: placement.reserved_mem_mib,
                new: true,
            }),
            place_response::Decision::Queued(queued) => Err(format!("queued: {}", queued.reason)),
        },
        // Placed by another replica whose write this view has not seen yet.
        Err(PlacerError::AlreadyPlaced { device_id, .. }) => existing(&device_id),
        Err(err) => Err(err.to_string()),
    }
}

/// The annotations that tell the pod which GPU it got.
fn gpu_annotations(
    ext: &Extender,
    spec: &TaskSpec,
    reserved: &Reserved,
) -> BTreeMap<String, String> {
    let mut out = BTreeMap::from([
        (DEVICE_ANNOTATION.to_owned(), reserved.device_id.clone()),
        (
            RESERVED_MEM_ANNOTATION.to_owned(),
            reserved.reserved_mem_mib.to_string(),
        ),
        (
            format!("{}task-id", pod::ANNOTATION_PREFIX),
            spec.task_id.clone(),
        ),
    ]);
    let view = ext.service.view();
    if let Some(info) = view
        .device(&reserved.device_id)
        .and_then(|d| d.info.as_ref())
    {
        out.insert(GPU_INDEX_ANNOTATION.to_owned(), info.index.to_string());
        if !info.uuid.is_empty() {
            out.insert(GPU_UUID_ANNOTATION.to_owned(), info.uuid.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::score;

    #[test]
    fn scores_fall_with_predicted_degradation() {
        assert_eq!(score(1.0), 10);
        assert_eq!(score(2.0), 5);
        assert_eq!(score(3.0), 3);
        assert_eq!(score(f64::NAN), 0);
        assert_eq!(score(0.5), 10);
    }
}
