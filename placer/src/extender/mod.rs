//! The Kubernetes scheduler extender: `filter`, `prioritize` and `bind` over HTTP.
//!
//! kube-scheduler posts the pod and candidate nodes; a node is a candidate for
//! the placer when one of its GPUs (devices registered with `node` = the node
//! name) can take the pod (see [`crate::policy`]). `prioritize` scores nodes
//! 0–10 by the best device's predicted Σ PD increase Δ as `round(10 / Δ)`: an
//! idle GPU (Δ = 1) scores 10, a GPU where the pod would add two units of
//! degradation scores 5. `bind` reserves the GPU with the same compare-and-swap
//! as the gRPC `Place`, then creates the pod's Binding through the Kubernetes API
//! (`--kube-api`, a `kubectl proxy` address); if the Binding fails the
//! reservation is given back, so the two never disagree for long.
//!
//! Malformed bodies get HTTP 400 with the result shape and `Error` set; problems
//! with the pod itself (a missing annotation, an unparsable quantity) are answered
//! with `Error` naming the annotation or resource, as kube-scheduler expects.

pub mod pod;
pub mod types;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use iadeep_proto::{TaskSpec, place_response};
use serde::Serialize;

use crate::http1;
use crate::policy::{Assessment, Verdict};
use crate::service::PlacementService;
use crate::validate;
use crate::view::ClusterView;
use types::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, HostPriority,
    NodeList, node_name,
};

/// Pods remembered between `filter` and `bind` (bind carries no pod).
const PENDING_CAP: usize = 10_000;
/// How long a pod seen by `filter` is remembered for `bind`.
const PENDING_TTL: Duration = Duration::from_secs(600);

/// The extender's state.
#[derive(Debug)]
pub struct Extender {
    service: PlacementService,
    /// `host:port` of a plain-HTTP Kubernetes API (e.g. `kubectl proxy`), for Bindings.
    kube_api: Option<String>,
    pending: Mutex<HashMap<(String, String), (TaskSpec, Instant)>>,
}

impl Extender {
    /// An extender answering from `service`, binding pods through `kube_api` when given.
    pub fn new(service: PlacementService, kube_api: Option<String>) -> Extender {
        Extender {
            service,
            kube_api,
            pending: Mutex::new(HashMap::new()),
        }
    }

    /// The HTTP routes: `POST /filter`, `POST /prioritize`, `POST /bind`.
    pub fn router(self: Arc<Self>) -> Router {
        Router::new()
            .route("/filter", post(filter))
            .route("/prioritize", post(prioritize))
            .route("/bind", post(bind))
            .with_state(self)
    }

    fn remember(&self, namespace: &str, name: &str, spec: &TaskSpec) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if pending.len() >= PENDING_CAP {
            pending.retain(|_, (_, seen)| seen.elapsed() < PENDING_TTL);
            if pending.len() >= PENDING_CAP {
                pending.clear();
            }
        }
        pending.insert(
            (namespace.to_owned(), name.to_owned()),
            (spec.clone(), Instant::now()),
        );
    }

    fn recall(&self, namespace: &str, name: &str) -> Option<TaskSpec> {
        let pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        pending
            .get(&(namespace.to_owned(), name.to_owned()))
            .filter(|(_, seen)| seen.elapsed() < PENDING_TTL)
            .map(|(spec, _)| spec.clone())
    }
}

fn json<T: Serialize>(status: StatusCode, body: &T) -> Response {
    (status, axum::Json(body)).into_response()
}

/// The pod's spec and the candidate node names of a filter or prioritize request.
fn parse_args(body: &[u8]) -> Result<(ExtenderArgs, TaskSpec, Vec<String>), (StatusCode, String)> {
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
    let spec = pod::task_spec(pod)
        .and_then(|spec| validate::task_spec("pod", &spec).map(|()| spec))
        .map_err(|e| (StatusCode::OK, e.to_string()))?;
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

async fn filter(State(ext): State<Arc<Extender>>, body: Bytes) -> Response {
    ext.service.metrics().extender_filter.inc();
    let (args, spec, nodes) = match parse_args(&body) {
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
    if let Some(pod) = &args.pod {
        ext.remember(&pod.metadata.namespace, &pod.metadata.name, &spec);
    }
    let mut result = ExtenderFilterResult::default();
    let mut passed: Vec<String> = Vec::new();
    let queued_for = {
        let view = ext.service.view();
        let by_node = devices_by_node(&view, &nodes);
        let placed_on = view
            .device_of(&spec.task_id)
            .and_then(|d| view.device(d))
            .and_then(|d| d.info.as_ref())
            .map(|i| i.node.clone());
        let restrict: Vec<String> = by_node.values().flatten().cloned().collect();
        let placer = ext.service.placer();
        let assessment = if restrict.is_empty() {
            Assessment::default()
        } else {
            placer.assess(&view, &spec, &restrict, iadeep_proto::now_unix_ms())
        };
        let verdict = placer.verdict(&spec, &assessment);
        let (best, why) = per_node(&assessment, &by_node);
        for node in &nodes {
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
        match verdict {
            Verdict::Queue { retry_after, .. } if placed_on.is_none() && !restrict.is_empty() => {
                Some(retry_after)
            }
            _ => None,
        }
    };
    // kube-scheduler retries a pending pod by itself: it waits like a gRPC client told to queue.
    if let Some(retry_after) = queued_for {
        ext.service.note_queued(&spec, retry_after);
    }
    match (args.nodes, args.node_names) {
        (Some(list), _) => {
            let items = list
                .items
                .into_iter()
                .filter(|n| node_name(n).is_some_and(|name| passed.iter().any(|p| p == name)))
                .collect();
            result.nodes = Some(NodeList {
                items,
                rest: list.rest,
            });
        }
        (None, _) => result.node_names = Some(passed.clone()),
    }
    tracing::debug!(task = %spec.task_id, passed = passed.len(),
        failed = result.failed_nodes.len() + result.failed_and_unresolvable_nodes.len(),
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
    ext.service.metrics().extender_prioritize.inc();
    let (_, spec, nodes) = match parse_args(&body) {
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
    ext.service.metrics().extender_bind.inc();
    let fail = |status: StatusCode, error: String| {
        tracing::info!(%error, "extender bind: not bound");
        json(status, &ExtenderBindingResult { error })
    };
    let args: ExtenderBindingArgs = match serde_json::from_slice(&body) {
        Ok(args) => args,
        Err(e) => {
            return fail(
                StatusCode::BAD_REQUEST,
                format!("invalid request body: {e}"),
            );
        }
    };
    for (field, value) in [("PodName", &args.pod_name), ("Node", &args.node)] {
        if value.is_empty() {
            return fail(StatusCode::BAD_REQUEST, format!("invalid {field}: missing"));
        }
    }
    let Some(kube_api) = ext.kube_api.clone() else {
        return fail(
            StatusCode::OK,
            "this placer was started without --kube-api, so it cannot create the pod's \
             Binding; configure the extender without bindVerb or give the placer --kube-api"
                .to_owned(),
        );
    };
    let Some(spec) = ext.recall(&args.pod_namespace, &args.pod_name) else {
        return fail(
            StatusCode::OK,
            format!(
                "pod {}/{} was not seen by filter in the last {} s; cannot bind it",
                args.pod_namespace,
                args.pod_name,
                PENDING_TTL.as_secs()
            ),
        );
    };
    let restrict = devices_by_node(&ext.service.view(), std::slice::from_ref(&args.node))
        .remove(&args.node)
        .unwrap_or_default();
    if restrict.is_empty() {
        return fail(
            StatusCode::OK,
            format!("node {} has no GPU registered with iadeep", args.node),
        );
    }
    let placement = match ext.service.place(spec.clone(), restrict).await {
        Ok(outcome) => match outcome.decision {
            place_response::Decision::Placed(placement) => placement,
            place_response::Decision::Queued(queued) => {
                return fail(StatusCode::OK, format!("queued: {}", queued.reason));
            }
        },
        Err(err) => return fail(StatusCode::OK, err.to_string()),
    };
    let binding = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": args.pod_name, "namespace": args.pod_namespace, "uid": args.pod_uid},
        "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
    });
    let namespace = if args.pod_namespace.is_empty() {
        "default"
    } else {
        args.pod_namespace.as_str()
    };
    let path = format!(
        "/api/v1/namespaces/{namespace}/pods/{}/binding",
        args.pod_name
    );
    let outcome = http1::post_json(&kube_api, &path, binding.to_string().as_bytes()).await;
    let error = match outcome {
        Ok((status, _)) if (200..300).contains(&status) => None,
        Ok((status, body)) => Some(format!(
            "Kubernetes API refused the Binding (HTTP {status}): {}",
            String::from_utf8_lossy(&body)
        )),
        Err(err) => Some(err.to_string()),
    };
    if let Some(error) = error {
        if let Err(undo) = ext.service.release(&spec.task_id).await {
            tracing::error!(task = %spec.task_id, %undo, "could not give back the reservation of an unbound pod");
        }
        return fail(StatusCode::OK, error);
    }
    tracing::info!(pod = %args.pod_name, namespace, node = %args.node,
        device = %placement.device_id, "bound");
    json(StatusCode::OK, &ExtenderBindingResult::default())
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
