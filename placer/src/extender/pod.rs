//! From a pod to the [`TaskSpec`] the placer decides on.
//!
//! The GPU memory request is the `nvidia.com/gpumem` resource (limits, else
//! requests) summed over the pod's containers. Following the convention of GPU
//! sharing device plugins, a plain number is MiB; a quantity with a binary
//! suffix (`Ki`, `Mi`, `Gi`, `Ti`) or a decimal one (`k`, `M`, `G`, `T`, in bytes)
//! is converted to MiB, rounding up.
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

use std::str::FromStr;

use iadeep_proto::{LrScalingRule, SoloProfile, TaskSpec};
use serde_json::Value;

use super::types::Pod;
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

fn annotation<T: FromStr>(pod: &Pod, key: &str) -> Result<Option<T>>
where
    T::Err: std::fmt::Display,
{
    let full = format!("{ANNOTATION_PREFIX}{key}");
    match pod.metadata.annotations.get(&full) {
        None => Ok(None),
        Some(text) => text.trim().parse::<T>().map(Some).map_err(|e| {
            PlacerError::invalid(
                format!("metadata.annotations[{full}]"),
                format!("{text:?}: {e}"),
            )
        }),
    }
}

/// Parses a Kubernetes quantity of GPU memory into MiB (a plain number is MiB).
pub fn parse_gpumem_mib(value: &Value) -> std::result::Result<u64, String> {
    let text = match value {
        Value::String(s) => s.trim().to_owned(),
        Value::Number(n) => n.to_string(),
        other => return Err(format!("{other} is not a quantity")),
    };
    let digits_end = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(digits_end);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a quantity"))?;
    let bytes_per_unit: Option<f64> = match suffix {
        "" => None,
        "Ki" => Some(1024.0),
        "Mi" => Some(1024.0 * 1024.0),
        "Gi" => Some(1024.0 * 1024.0 * 1024.0),
        "Ti" => Some(1024.0f64.powi(4)),
        "k" => Some(1e3),
        "M" => Some(1e6),
        "G" => Some(1e9),
        "T" => Some(1e12),
        other => return Err(format!("{text:?} has an unknown unit {other:?}")),
    };
    let mib = match bytes_per_unit {
        None => number,
        Some(unit) => number * unit / (1024.0 * 1024.0),
    };
    if !(0.0..1e15).contains(&mib) {
        return Err(format!("{text:?} is out of range"));
    }
    Ok(mib.ceil() as u64)
}

/// The GPU memory the pod asks for, MiB, summed over containers (0 when it asks for none).
pub fn gpumem_request_mib(pod: &Pod) -> Result<u64> {
    let mut total = 0u64;
    for (i, container) in pod.spec.containers.iter().enumerate() {
        let resources = &container.resources;
        let (which, value) = match (
            resources.limits.get(GPUMEM_RESOURCE),
            resources.requests.get(GPUMEM_RESOURCE),
        ) {
            (Some(v), _) => ("limits", v),
            (None, Some(v)) => ("requests", v),
            (None, None) => continue,
        };
        let mib = parse_gpumem_mib(value).map_err(|reason| {
            PlacerError::invalid(
                format!("spec.containers[{i}].resources.{which}[{GPUMEM_RESOURCE}]"),
                reason,
            )
        })?;
        total = total.saturating_add(mib);
    }
    Ok(total)
}

/// The task spec of `pod`, or an error naming the annotation or resource at fault.
pub fn task_spec(pod: &Pod) -> Result<TaskSpec> {
    if pod.metadata.name.is_empty() {
        return Err(PlacerError::invalid("Pod.metadata.name", "missing"));
    }
    let task_id = annotation::<String>(pod, "task-id")?
        .unwrap_or_else(|| default_task_id(&pod.metadata.namespace, &pod.metadata.name));
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
    };
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
        submitted_at_unix_ms: iadeep_proto::now_unix_ms(),
        allowed_batch_sizes: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn quantities_convert_to_mib() {
        assert_eq!(parse_gpumem_mib(&json!("4000")), Ok(4000));
        assert_eq!(parse_gpumem_mib(&json!(3000)), Ok(3000));
        assert_eq!(parse_gpumem_mib(&json!("4Gi")), Ok(4096));
        assert_eq!(parse_gpumem_mib(&json!("512Mi")), Ok(512));
        assert_eq!(parse_gpumem_mib(&json!("1G")), Ok(954));
        assert!(parse_gpumem_mib(&json!("4GB")).is_err());
        assert!(parse_gpumem_mib(&json!("-1")).is_err());
        assert!(parse_gpumem_mib(&json!(["4"])).is_err());
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
            .insert("iadeep.io/batch-size".into(), "many".into());
        let err = task_spec(&bad).expect_err("bad batch size");
        assert!(err.to_string().contains("iadeep.io/batch-size"), "{err}");
        bad.metadata.annotations.clear();
        let err = task_spec(&bad).expect_err("missing batch size");
        assert!(err.to_string().contains("missing"), "{err}");
    }
}
