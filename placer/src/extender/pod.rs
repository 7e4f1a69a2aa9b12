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
//! | `iadeep.io/priority-class` | `production` or `opportunistic` | see below |
//! | `iadeep.io/max-slowdown` | a production job's slowdown cap, e.g. `"1.10"` | default 1.10 |
//!
//! The priority class is the `iadeep.io/priority-class` annotation when the pod has
//! one. Without it, a pod whose `spec.priorityClassName` is one of the Kubernetes
//! PriorityClasses the placer was told count as production
//! (`--production-priority-classes`, see [`PriorityRule`]) is production, and every
//! other pod is opportunistic. The name, not `spec.priority`, decides: a number's
//! meaning differs between clusters, while a class name is what the cluster's
//! operators chose to mean "must not slow down". `iadeep.io/max-slowdown` is refused on
//! a pod that turns out opportunistic, so a cap is never silently ignored.

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

use iadeep_proto::{KubernetesPod, LrScalingRule, PriorityClass, SoloProfile, TaskSpec};
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

/// Which pods without an `iadeep.io/priority-class` annotation are production: those
/// whose `spec.priorityClassName` is one of `production_classes`. Empty (the default),
/// only the annotation makes a pod production.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PriorityRule {
    /// Names of Kubernetes PriorityClass objects whose pods count as production.
    pub production_classes: BTreeSet<String>,
}

impl PriorityRule {
    /// The rule counting pods of the PriorityClasses named in `names` as production.
    pub fn new<S: Into<String>>(names: impl IntoIterator<Item = S>) -> PriorityRule {
        PriorityRule {
            production_classes: names.into_iter().map(Into::into).collect(),
        }
    }
}

/// The pod's priority class and slowdown cap (`None`: the class's default), by the rule
/// in the module's documentation; an error names the annotation at fault.
pub fn priority_from_pod(pod: &Pod, rule: &PriorityRule) -> Result<(PriorityClass, Option<f64>)> {
    let class_field = format!("metadata.annotations[{ANNOTATION_PREFIX}priority-class]");
    let cap_field = format!("metadata.annotations[{ANNOTATION_PREFIX}max-slowdown]");
    let class = match annotation::<String>(pod, "priority-class")? {
        Some(text) => iadeep_proto::priority_class_from_name(&text).ok_or_else(|| {
            PlacerError::invalid(
                &class_field,
                format!(
                    "{text:?} is not one of {}",
                    iadeep_proto::PRIORITY_CLASS_NAMES.join(", ")
                ),
            )
        })?,
        None => {
            let named = pod
                .spec
                .as_ref()
                .and_then(|s| s.priority_class_name.as_deref());
            if named.is_some_and(|n| rule.production_classes.contains(n)) {
                PriorityClass::Production
            } else {
                PriorityClass::Opportunistic
            }
        }
    };
    let cap: Option<f64> = annotation(pod, "max-slowdown")?;
    if cap.is_some() && class != PriorityClass::Production {
        return Err(PlacerError::invalid(
            cap_field,
            format!(
                "applies to production pods only, and this pod is opportunistic (set \
                 {ANNOTATION_PREFIX}priority-class: production, or give it a \
                 PriorityClass the placer counts as production)"
            ),
        ));
    }
    // The same check as every other entry point's, named by the annotation.
    iadeep_proto::check_priority(class as i32, cap).map_err(|(field, why)| {
        let at = if field == "max_slowdown" {
            cap_field
        } else {
            class_field
        };
        PlacerError::invalid(at, why)
    })?;
    Ok((class, cap))
}

/// The task spec of `pod` under the priority `rule`, or an error naming the annotation
/// or resource at fault.
pub fn task_spec(pod: &Pod, rule: &PriorityRule) -> Result<TaskSpec> {
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
    let (priority_class, max_slowdown) = priority_from_pod(pod, rule)?;
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
        priority_class: priority_class as i32,
        max_slowdown,
        // Which pod to evict should the task not leave when told to (see
        // [`crate::pod_eviction`]).
        kubernetes_pod: Some(KubernetesPod {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            uid: pod.metadata.uid.clone().unwrap_or_default(),
        }),
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
        let spec = task_spec(&pod, &PriorityRule::default()).expect("spec");
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
        let spec = task_spec(&pod, &PriorityRule::default()).expect("spec");
        assert_eq!(spec.task_id, "ml.train");
        let named = spec.kubernetes_pod.as_ref().expect("the pod is named");
        assert_eq!(
            (named.namespace.as_str(), named.name.as_str()),
            ("ml", "train")
        );
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
        let err = task_spec(&bad, &PriorityRule::default()).expect_err("bad batch size");
        assert!(err.to_string().contains("iadeep.io/batch-size"), "{err}");
        bad.metadata.annotations = None;
        let err = task_spec(&bad, &PriorityRule::default()).expect_err("missing batch size");
        assert!(err.to_string().contains("missing"), "{err}");
    }

    /// A pod with `annotations` (besides its batch size) and `spec.priorityClassName`.
    fn pod_with(annotations: &[(&str, &str)], priority_class_name: Option<&str>) -> Pod {
        let mut all: BTreeMap<String, String> = annotations
            .iter()
            .map(|(k, v)| (format!("{ANNOTATION_PREFIX}{k}"), (*v).to_owned()))
            .collect();
        all.insert(format!("{ANNOTATION_PREFIX}batch-size"), "32".into());
        serde_json::from_value(json!({
            "metadata": {"name": "job", "annotations": all},
            "spec": {"priorityClassName": priority_class_name, "containers": [{"name": "c"}]}
        }))
        .expect("pod")
    }

    #[test]
    fn the_annotation_decides_the_class_and_carries_the_cap() {
        let rule = PriorityRule::default();
        let class = |pod: &Pod| {
            let spec = task_spec(pod, &rule).expect("spec");
            (spec.class_name(), spec.max_slowdown, spec.slowdown_cap())
        };
        assert_eq!(
            class(&pod_with(&[("priority-class", "production")], None)),
            ("production", None, Some(iadeep_proto::DEFAULT_MAX_SLOWDOWN))
        );
        assert_eq!(
            class(&pod_with(
                &[("priority-class", "Production"), ("max-slowdown", " 1.25 ")],
                None
            )),
            ("production", Some(1.25), Some(1.25))
        );
        assert_eq!(
            class(&pod_with(&[("priority-class", "opportunistic")], None)),
            ("opportunistic", None, None)
        );
        let spec = task_spec(&pod_with(&[], None), &rule).expect("spec");
        assert_eq!(spec.priority_class, PriorityClass::Opportunistic as i32);
        // The annotation wins over the PriorityClass mapping, both ways.
        let mapped = PriorityRule::new(["prod-critical"]);
        let spec = task_spec(
            &pod_with(
                &[("priority-class", "opportunistic")],
                Some("prod-critical"),
            ),
            &mapped,
        )
        .expect("spec");
        assert!(!spec.is_production());
    }

    #[test]
    fn without_the_annotation_configured_priority_class_names_are_production() {
        let rule = PriorityRule::new(["prod-critical", "prod"]);
        let is_production = |name: Option<&str>, rule: &PriorityRule| {
            task_spec(&pod_with(&[], name), rule)
                .expect("spec")
                .is_production()
        };
        assert!(is_production(Some("prod-critical"), &rule));
        assert!(is_production(Some("prod"), &rule));
        assert!(!is_production(Some("batch-low"), &rule));
        assert!(!is_production(None, &rule));
        // Empty by default: no PriorityClass makes a pod production by itself.
        assert!(!is_production(Some("prod"), &PriorityRule::default()));
        // A cap on a pod its PriorityClass makes production is kept.
        let spec =
            task_spec(&pod_with(&[("max-slowdown", "1.05")], Some("prod")), &rule).expect("spec");
        assert_eq!(spec.slowdown_cap(), Some(1.05));
    }

    #[test]
    fn bad_priority_annotations_are_refused_naming_the_annotation() {
        let rule = PriorityRule::new(["prod"]);
        let refused = |annotations: &[(&str, &str)], name: Option<&str>| {
            task_spec(&pod_with(annotations, name), &rule)
                .expect_err("refused")
                .to_string()
        };
        let err = refused(&[("priority-class", "urgent")], None);
        assert!(
            err.contains("iadeep.io/priority-class") && err.contains("urgent"),
            "{err}"
        );
        for bad in ["fast", "1.0", "0.9", "11", "NaN", "inf"] {
            let err = refused(
                &[("priority-class", "production"), ("max-slowdown", bad)],
                None,
            );
            assert!(err.contains("iadeep.io/max-slowdown"), "{bad}: {err}");
        }
        // A cap on an opportunistic pod, said or mapped, would be ignored: refused instead.
        let err = refused(&[("max-slowdown", "1.2")], None);
        assert!(
            err.contains("iadeep.io/max-slowdown") && err.contains("opportunistic"),
            "{err}"
        );
        let err = refused(&[("max-slowdown", "1.2")], Some("batch-low"));
        assert!(err.contains("iadeep.io/max-slowdown"), "{err}");
    }
}
