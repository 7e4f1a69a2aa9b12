//! From a pod to the [`TaskSpec`] the placer decides on.
//!
//! The GPU memory request is the `nvidia.com/gpumem` resource (limits, else
//! requests) of the pod, counted the way Kubernetes counts a pod's request: the sum
//! over its containers, or the largest init container's when that is larger. A
//! decimal quantity is MiB, a binary one bytes (see [`super::quantity`] for why
//! this is the one reading that survives Kubernetes' canonical forms).
//!
//! Everything else comes from annotations (see `docs/kubernetes.md`):
//!
//! | annotation | field | |
//! |---|---|---|
//! | `iadeep.io/task-id` | task id | default `{namespace}.{name}` |
//! | `iadeep.io/batch-size` | initial batch size m0 | **required** |
//! | `iadeep.io/min-batch-size`, `iadeep.io/max-batch-size` | tuner's range | default m0 |
//! | `iadeep.io/model` | model name | informative |
//! | `iadeep.io/total-samples` | total work | for queue estimates |
//! | `iadeep.io/step-time-s` | solo step time at m0 | profile |
//! | `iadeep.io/sm-util-pct`, `iadeep.io/mem-bw-util-pct` | solo utilisations | profile |
//! | `iadeep.io/peak-mem-mib` | solo peak memory at m0 | profile |
//! | `iadeep.io/device-kind` | kind the profile was measured on | profile |
//! | `iadeep.io/lr-rule` | `linear`, `sqrt` or `adascale` | |

use std::collections::BTreeMap;
use std::str::FromStr;

use iadeep_proto::{LrScalingRule, SoloProfile, TaskSpec};
use k8s_openapi::api::core::v1::{Container, Pod};

use super::quantity;
use crate::error::{PlacerError, Result};

/// Prefix of every annotation the placer reads.
pub const ANNOTATION_PREFIX: &str = "iadeep.io/";
/// The extended resource carrying the GPU memory request.
pub const GPUMEM_RESOURCE: &str = "nvidia.com/gpumem";

/// The task id a pod gets when it does not name one.
pub fn default_task_id(namespace: &str, name: &str) -> String {
    let namespace = if namespace.is_empty() {
        "default"
    } else {
        namespace
    };
    format!("{namespace}.{name}")
}

fn annotations(pod: &Pod) -> Option<&BTreeMap<String, String>> {
    pod.metadata.annotations.as_ref()
}

fn annotation<T: FromStr>(pod: &Pod, key: &str) -> Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    let full = format!("{ANNOTATION_PREFIX}{key}");
    match annotations(pod).and_then(|a| a.get(&full)) {
        None => Ok(None),
        Some(text) => text.trim().parse::<T>().map(Some).map_err(|e| {
            PlacerError::invalid(
                format!("metadata.annotations[{full}]"),
                format!("{text:?}: {e}"),
            )
        }),
    }
}

/// The GPU memory one container asks for, MiB (0 when it asks for none).
fn container_gpumem_mib(container: &Container, field: &str) -> Result<u64> {
    let Some(resources) = &container.resources else {
        return Ok(0);
    };
    let limit = resources
        .limits
        .as_ref()
        .and_then(|l| l.get(GPUMEM_RESOURCE));
    let request = resources
        .requests
        .as_ref()
        .and_then(|r| r.get(GPUMEM_RESOURCE));
    let (which, value) = match (limit, request) {
        (Some(v), _) => ("limits", v),
        (None, Some(v)) => ("requests", v),
        (None, None) => return Ok(0),
    };
    quantity::gpu_memory_mib(&value.0).map_err(|reason| {
        PlacerError::invalid(
            format!("{field}.resources.{which}[{GPUMEM_RESOURCE}]"),
            reason.to_string(),
        )
    })
}

/// The GPU memory the pod asks for, MiB (0 when it asks for none): the sum over its
/// containers, or its largest init container's when larger (they run one at a time,
/// before the others).
pub fn gpumem_request_mib(pod: &Pod) -> Result<u64> {
    let Some(spec) = &pod.spec else {
        return Ok(0);
    };
    let mut total = 0u64;
    for (i, container) in spec.containers.iter().enumerate() {
        let mib = container_gpumem_mib(container, &format!("spec.containers[{i}]"))?;
        total = total.saturating_add(mib);
    }
    for (i, container) in spec.init_containers.iter().flatten().enumerate() {
        let mib = container_gpumem_mib(container, &format!("spec.initContainers[{i}]"))?;
        total = total.max(mib);
    }
    Ok(total)
}

/// The pod's namespace (`default` when absent) and name.
pub fn namespace_and_name(pod: &Pod) -> (&str, &str) {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or("default");
    (namespace, pod.metadata.name.as_deref().unwrap_or(""))
}

/// The task spec of `pod`, or an error naming the annotation or resource at fault.
pub fn task_spec(pod: &Pod) -> Result<TaskSpec> {
    let (namespace, name) = namespace_and_name(pod);
    if name.is_empty() {
        return Err(PlacerError::invalid("Pod.metadata.name", "missing"));
    }
    let task_id =
        annotation::<String>(pod, "task-id")?.unwrap_or_else(|| default_task_id(namespace, name));
    let initial: u32 = annotation(pod, "batch-size")?.ok_or_else(|| {
        PlacerError::invalid(
            format!("metadata.annotations[{ANNOTATION_PREFIX}batch-size]"),
            "missing: the batch size the job was submitted with is required",
        )
    })?;
    let lr_rule = match annotation::<String>(pod, "lr-rule")?.as_deref() {
        None => LrScalingRule::Unspecified,
        Some("linear") => LrScalingRule::Linear,
        Some("sqrt") => LrScalingRule::Sqrt,
        Some("adascale") => LrScalingRule::Adascale,
        Some(other) => {
            return Err(PlacerError::invalid(
                format!("metadata.annotations[{ANNOTATION_PREFIX}lr-rule]"),
                format!("{other:?} is not one of linear, sqrt, adascale"),
            ));
        }
    };
    let profile = SoloProfile {
        batch_size: initial,
        step_time_s: annotation(pod, "step-time-s")?,
        sm_util_pct: annotation(pod, "sm-util-pct")?,
        mem_bw_util_pct: annotation(pod, "mem-bw-util-pct")?,
        peak_mem_mib: annotation(pod, "peak-mem-mib")?,
        device_kind: annotation::<String>(pod, "device-kind")?.unwrap_or_default(),
        from_registry: false,
    };
    // The pod's creation is its submission: the same on every filter and bind call,
    // whichever placer replica answers.
    let submitted_at_unix_ms = pod
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or_else(iadeep_proto::now_unix_ms, |t| t.0.as_millisecond());
    Ok(TaskSpec {
        task_id,
        model: annotation::<String>(pod, "model")?.unwrap_or_default(),
        initial_batch_size: initial,
        min_batch_size: annotation(pod, "min-batch-size")?.unwrap_or(initial),
        max_batch_size: annotation(pod, "max-batch-size")?.unwrap_or(initial),
        gpu_mem_request_mib: gpumem_request_mib(pod)?,
        profile: Some(profile),
        lr_rule: lr_rule as i32,
        total_samples: annotation(pod, "total-samples")?,
        submitted_at_unix_ms,
        allowed_batch_sizes: Vec::new(),
        // The pod's priority class and cap are mapped by the extender's priority rule
        // (see `priority_from_pod`); unspecified is opportunistic.
        priority_class: iadeep_proto::PriorityClass::Unspecified as i32,
        max_slowdown: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_and_init_container_requests() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "annotations": {"iadeep.io/batch-size": "8"}},
            "spec": {
                "initContainers": [{"name": "warm", "resources": {"limits": {"nvidia.com/gpumem": "20k"}}}],
                "containers": [
                    {"name": "a", "resources": {"limits": {"nvidia.com/gpumem": "12k"}}},
                    {"name": "b", "resources": {"requests": {"nvidia.com/gpumem": "1Gi"}}}]}
        }))
        .expect("pod");
        assert_eq!(gpumem_request_mib(&pod).expect("request"), 20_000);
        let spec = task_spec(&pod).expect("spec");
        assert_eq!(spec.task_id, "default.p");
    }

    #[test]
    fn pod_annotations_become_a_spec_and_errors_name_the_annotation() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "train", "namespace": "ml", "annotations": {
                "iadeep.io/batch-size": "64", "iadeep.io/max-batch-size": "256",
                "iadeep.io/sm-util-pct": "70", "iadeep.io/lr-rule": "sqrt"}},
            "spec": {"containers": [
                {"name": "a", "resources": {"limits": {"nvidia.com/gpumem": "3000"}}},
                {"name": "b", "resources": {"requests": {"nvidia.com/gpumem": "1Gi"}}}]}
        }))
        .expect("pod");
        let spec = task_spec(&pod).expect("spec");
        assert_eq!(spec.task_id, "ml.train");
        assert_eq!(
            (
                spec.initial_batch_size,
                spec.min_batch_size,
                spec.max_batch_size
            ),
            (64, 64, 256)
        );
        assert_eq!(spec.gpu_mem_request_mib, 4024);
        assert_eq!(spec.profile.and_then(|p| p.sm_util_pct), Some(70.0));
        assert_eq!(spec.lr_rule, LrScalingRule::Sqrt as i32);

        let mut bad = pod.clone();
        bad.metadata
            .annotations
            .get_or_insert_default()
            .insert("iadeep.io/batch-size".into(), "many".into());
        let err = task_spec(&bad).expect_err("bad batch size");
        assert!(err.to_string().contains("iadeep.io/batch-size"), "{err}");
        bad.metadata.annotations = None;
        let err = task_spec(&bad).expect_err("missing batch size");
        assert!(err.to_string().contains("missing"), "{err}");
    }
}
