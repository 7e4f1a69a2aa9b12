//! Checks on what callers send, before anything is decided or written.
//!
//! Every error names the field (as the caller spells it in the request), because
//! "invalid argument" alone makes an orchestrator's operator guess. The limits are
//! the constants below, one set for gRPC and the scheduler extender alike, and the
//! proto comments (`proto/iadeep/v1/placer.proto`, `task.proto`) state them.
//!
//! Why limits at all: everything a request carries is stored (the spec, and a
//! copy in the device's residents record), so an absurd value is not only a wrong
//! decision (a batch size of 4,294,967,295 reserves a whole card) but a record
//! that every later reader pays for.

use iadeep_proto::{KubernetesPod, LrScalingRule, SoloProfile, TaskSpec};
#[cfg(feature = "daemon")]
use iadeep_proto::{PlaceRequest, ReleaseRequest};
use iadeep_state::keys;

use crate::error::{PlacerError, Result};

/// Largest memory request taken seriously, MiB (1 TiB): beyond it is a unit mistake.
pub const MAX_MEM_MIB: u64 = 1 << 20;
/// Largest batch size accepted anywhere in a spec (initial, bounds, profile): 2^20.
pub const MAX_BATCH_SIZE: u32 = 1 << 20;
/// Longest free-text name (model, device kind), bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// Longest task or device id, bytes (ids are key segments; see [`keys::validate_id`]).
pub const MAX_ID_BYTES: usize = keys::MAX_ID_LEN;
/// Most candidate devices one Place may name.
pub const MAX_CANDIDATE_DEVICES: usize = 4096;
/// Most entries of a spec's `allowed_batch_sizes`: every power of two and the sizes
/// between several times over, far more than a job runs at, while 300,000 entries
/// (which passed before this limit) made a spec the store refused.
pub const MAX_ALLOWED_BATCH_SIZES: usize = 1024;
/// Longest solo step time taken seriously, seconds (a day).
pub const MAX_STEP_TIME_S: f64 = 86_400.0;
/// Earliest submission time accepted, Unix ms (2000-01-01): before it is a unit
/// mistake (seconds for milliseconds) or garbage. 0 means "not given".
pub const MIN_TIMESTAMP_MS: i64 = 946_684_800_000;
/// How far in the future a submission time may be, ms (a day of clock skew).
pub const MAX_FUTURE_MS: i64 = 86_400_000;
/// Largest gRPC request the placer decodes, bytes. The largest valid PlaceRequest
/// ([`MAX_CANDIDATE_DEVICES`] ids of [`MAX_ID_BYTES`]) is about half of it; a
/// larger request is refused by gRPC itself with OUT_OF_RANGE before it is read.
#[cfg(feature = "daemon")]
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

fn id(field: &str, kind: &'static str, value: &str) -> Result<()> {
    // Checked first so the message never echoes a huge value back.
    if value.len() > MAX_ID_BYTES {
        return Err(PlacerError::invalid(
            field,
            format!(
                "is {} bytes long; at most {MAX_ID_BYTES} are accepted",
                value.len()
            ),
        ));
    }
    keys::validate_id(kind, value).map_err(|e| PlacerError::invalid(field, e.to_string()))
}

fn pct(field: &str, value: Option<f64>) -> Result<()> {
    match value {
        Some(v) if !(v.is_finite() && (0.0..=100.0).contains(&v)) => Err(PlacerError::invalid(
            field,
            format!("{v} is not a percentage in [0, 100]"),
        )),
        _ => Ok(()),
    }
}

fn name(field: &str, value: &str) -> Result<()> {
    if value.len() > MAX_NAME_BYTES {
        return Err(PlacerError::invalid(
            field,
            format!(
                "is {} bytes long; at most {MAX_NAME_BYTES} are accepted",
                value.len()
            ),
        ));
    }
    if value.chars().any(char::is_control) {
        return Err(PlacerError::invalid(field, "contains control characters"));
    }
    Ok(())
}

fn batch_size(field: &str, value: u32) -> Result<()> {
    if value > MAX_BATCH_SIZE {
        return Err(PlacerError::invalid(
            field,
            format!("{value} is larger than the largest batch size accepted, {MAX_BATCH_SIZE}"),
        ));
    }
    Ok(())
}

/// Checks a Place request: the spec under `task`, the candidate list.
#[cfg(feature = "daemon")]
pub fn place_request(request: &PlaceRequest) -> Result<()> {
    let Some(task) = &request.task else {
        return Err(PlacerError::invalid(
            "task",
            "missing (a PlaceRequest must carry the TaskSpec to place)",
        ));
    };
    task_spec("task", task)?;
    if task.kubernetes_pod.is_some() {
        return Err(PlacerError::invalid(
            "task.kubernetes_pod",
            "is set only by the placer's Kubernetes scheduler extender, from the pod it \
             binds: the placer evicts that pod when the task ignores an eviction, so a \
             client naming a pod could have it evict a pod the client does not own",
        ));
    }
    device_ids("candidate_device_ids", &request.candidate_device_ids)
}

/// Checks a Release request.
#[cfg(feature = "daemon")]
pub fn release_request(request: &ReleaseRequest) -> Result<()> {
    task_id("task_id", &request.task_id)
}

/// Checks a task spec; `prefix` is the path of the spec in the request (e.g. `task`).
///
/// Batch-size bounds of 0 mean "not given" and default to the initial batch size.
pub fn task_spec(prefix: &str, spec: &TaskSpec) -> Result<()> {
    let f = |name: &str| format!("{prefix}.{name}");
    id(&f("task_id"), "task", &spec.task_id)?;
    name(&f("model"), &spec.model)?;
    if spec.initial_batch_size == 0 {
        return Err(PlacerError::invalid(
            f("initial_batch_size"),
            "must be positive (the batch size the job was submitted with)",
        ));
    }
    batch_size(&f("initial_batch_size"), spec.initial_batch_size)?;
    batch_size(&f("min_batch_size"), spec.min_batch_size)?;
    batch_size(&f("max_batch_size"), spec.max_batch_size)?;
    if LrScalingRule::try_from(spec.lr_rule).is_err() {
        return Err(PlacerError::invalid(
            f("lr_rule"),
            format!(
                "{} is not a known LrScalingRule (0 unspecified, 1 linear, 2 sqrt, 3 adascale)",
                spec.lr_rule
            ),
        ));
    }
    submitted_at(&f("submitted_at_unix_ms"), spec.submitted_at_unix_ms)?;
    batch_bounds(prefix, spec)?;
    if spec.gpu_mem_request_mib > MAX_MEM_MIB {
        return Err(PlacerError::invalid(
            f("gpu_mem_request_mib"),
            format!(
                "{} MiB is more than any GPU has (is the unit bytes?)",
                spec.gpu_mem_request_mib
            ),
        ));
    }
    if spec.total_samples == Some(0) {
        return Err(PlacerError::invalid(
            f("total_samples"),
            "must be positive when given",
        ));
    }
    if let Some(profile) = &spec.profile {
        solo_profile(prefix, profile)?;
    }
    priority(prefix, spec)?;
    if let Some(pod) = &spec.kubernetes_pod {
        kubernetes_pod(prefix, pod)?;
    }
    allowed_batch_sizes(&f("allowed_batch_sizes"), &spec.allowed_batch_sizes)
}

/// Longest pod UID accepted, bytes (Kubernetes' are 36-byte UUIDs).
pub const MAX_POD_UID_BYTES: usize = 128;

/// Checks the pod a task runs in: names Kubernetes itself could have given, since they
/// go into the URL path of the pod's Eviction, and a UID of lowercase letters, digits
/// and '-'.
fn kubernetes_pod(prefix: &str, pod: &KubernetesPod) -> Result<()> {
    let f = |name: &str| format!("{prefix}.kubernetes_pod.{name}");
    let invalid = |field: String| move |why: String| PlacerError::invalid(field, why);
    check_dns1123_label("namespace", &pod.namespace).map_err(invalid(f("namespace")))?;
    check_dns1123_subdomain("pod name", &pod.name).map_err(invalid(f("name")))?;
    let uid_ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    if pod.uid.len() > MAX_POD_UID_BYTES || !pod.uid.chars().all(uid_ok) {
        return Err(PlacerError::invalid(
            f("uid"),
            format!(
                "is not a Kubernetes UID (at most {MAX_POD_UID_BYTES} lowercase letters, \
                 digits and '-')"
            ),
        ));
    }
    Ok(())
}

/// Checks the priority class and the slowdown cap, which only production jobs have
/// ([`iadeep_proto::check_priority`], shared with `iadeep run` and the agent).
fn priority(prefix: &str, spec: &TaskSpec) -> Result<()> {
    iadeep_proto::check_priority(spec.priority_class, spec.max_slowdown)
        .map_err(|(field, why)| PlacerError::invalid(format!("{prefix}.{field}"), why))
}

/// Checks the batch sizes a job says it can run at: at most
/// [`MAX_ALLOWED_BATCH_SIZES`] of them, each from 1 to [`MAX_BATCH_SIZE`].
fn allowed_batch_sizes(field: &str, sizes: &[u32]) -> Result<()> {
    if sizes.len() > MAX_ALLOWED_BATCH_SIZES {
        return Err(PlacerError::invalid(
            field,
            format!(
                "lists {} batch sizes; at most {MAX_ALLOWED_BATCH_SIZES} are accepted",
                sizes.len()
            ),
        ));
    }
    for (i, &size) in sizes.iter().enumerate() {
        if size == 0 {
            return Err(PlacerError::invalid(
                format!("{field}[{i}]"),
                "must be positive",
            ));
        }
        batch_size(&format!("{field}[{i}]"), size)?;
    }
    Ok(())
}

/// Checks when a task was submitted: 0 (now), or a time between 2000 and a day from now.
fn submitted_at(field: &str, at_unix_ms: i64) -> Result<()> {
    if at_unix_ms != 0 {
        let latest = iadeep_proto::now_unix_ms().saturating_add(MAX_FUTURE_MS);
        if !(MIN_TIMESTAMP_MS..=latest).contains(&at_unix_ms) {
            return Err(PlacerError::invalid(
                field,
                format!(
                    "{at_unix_ms} is not a time in milliseconds since 1970 between 2000 and \
                     a day from now (0 means now)"
                ),
            ));
        }
    }
    Ok(())
}

/// Checks that a spec's batch-size bounds (0: the initial batch size) enclose its
/// initial batch size.
fn batch_bounds(prefix: &str, spec: &TaskSpec) -> Result<()> {
    let f = |name: &str| format!("{prefix}.{name}");
    let min = if spec.min_batch_size == 0 {
        spec.initial_batch_size
    } else {
        spec.min_batch_size
    };
    let max = if spec.max_batch_size == 0 {
        spec.initial_batch_size
    } else {
        spec.max_batch_size
    };
    if min > spec.initial_batch_size {
        return Err(PlacerError::invalid(
            f("min_batch_size"),
            format!(
                "{min} is larger than initial_batch_size {}",
                spec.initial_batch_size
            ),
        ));
    }
    if max < spec.initial_batch_size {
        return Err(PlacerError::invalid(
            f("max_batch_size"),
            format!(
                "{max} is smaller than initial_batch_size {}",
                spec.initial_batch_size
            ),
        ));
    }
    Ok(())
}

/// Checks a spec's solo profile; `prefix` is the path of the spec in the request.
fn solo_profile(prefix: &str, profile: &SoloProfile) -> Result<()> {
    let f = |name: &str| format!("{prefix}.{name}");
    batch_size(&f("profile.batch_size"), profile.batch_size)?;
    name(&f("profile.device_kind"), &profile.device_kind)?;
    if let Some(t) = profile.step_time_s
        && !(t.is_finite() && t > 0.0 && t <= MAX_STEP_TIME_S)
    {
        return Err(PlacerError::invalid(
            f("profile.step_time_s"),
            format!("{t} is not a positive number of seconds up to {MAX_STEP_TIME_S}"),
        ));
    }
    pct(&f("profile.sm_util_pct"), profile.sm_util_pct)?;
    pct(&f("profile.mem_bw_util_pct"), profile.mem_bw_util_pct)?;
    if profile.peak_mem_mib.is_some_and(|m| m > MAX_MEM_MIB) {
        return Err(PlacerError::invalid(
            f("profile.peak_mem_mib"),
            "is more than any GPU has",
        ));
    }
    Ok(())
}

/// Checks the device ids a caller restricts the choice to.
pub fn device_ids(field: &str, ids: &[String]) -> Result<()> {
    if ids.len() > MAX_CANDIDATE_DEVICES {
        return Err(PlacerError::invalid(
            field,
            format!(
                "names {} devices; at most {MAX_CANDIDATE_DEVICES} are accepted",
                ids.len()
            ),
        ));
    }
    for (i, device) in ids.iter().enumerate() {
        id(&format!("{field}[{i}]"), "device", device)?;
    }
    Ok(())
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

/// Checks a task id.
pub fn task_id(field: &str, task: &str) -> Result<()> {
    id(field, "task", task)
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_proto::{MAX_SLOWDOWN_CAP, PriorityClass, SoloProfile};

    fn good() -> TaskSpec {
        TaskSpec {
            task_id: "job-1".into(),
            initial_batch_size: 64,
            ..Default::default()
        }
    }

    #[test]
    fn each_malformed_field_is_named() {
        task_spec("task", &good()).expect("valid");
        let cases: Vec<(&str, TaskSpec)> = vec![
            (
                "task.task_id",
                TaskSpec {
                    task_id: "a/b".into(),
                    ..good()
                },
            ),
            (
                "task.initial_batch_size",
                TaskSpec {
                    initial_batch_size: 0,
                    ..good()
                },
            ),
            (
                "task.min_batch_size",
                TaskSpec {
                    min_batch_size: 128,
                    ..good()
                },
            ),
            (
                "task.max_batch_size",
                TaskSpec {
                    max_batch_size: 32,
                    ..good()
                },
            ),
            (
                "task.gpu_mem_request_mib",
                TaskSpec {
                    gpu_mem_request_mib: u64::MAX,
                    ..good()
                },
            ),
            (
                "task.total_samples",
                TaskSpec {
                    total_samples: Some(0),
                    ..good()
                },
            ),
            (
                "task.profile.sm_util_pct",
                TaskSpec {
                    profile: Some(SoloProfile {
                        sm_util_pct: Some(f64::NAN),
                        ..Default::default()
                    }),
                    ..good()
                },
            ),
            (
                "task.profile.step_time_s",
                TaskSpec {
                    profile: Some(SoloProfile {
                        step_time_s: Some(-1.0),
                        ..Default::default()
                    }),
                    ..good()
                },
            ),
            // What the hostile-input trials sent, each refused and named.
            (
                "task.initial_batch_size",
                TaskSpec {
                    initial_batch_size: u32::MAX,
                    max_batch_size: u32::MAX,
                    ..good()
                },
            ),
            (
                "task.max_batch_size",
                TaskSpec {
                    max_batch_size: MAX_BATCH_SIZE + 1,
                    ..good()
                },
            ),
            (
                "task.lr_rule",
                TaskSpec {
                    lr_rule: 99,
                    ..good()
                },
            ),
            (
                "task.submitted_at_unix_ms",
                TaskSpec {
                    submitted_at_unix_ms: i64::MIN,
                    ..good()
                },
            ),
            (
                "task.submitted_at_unix_ms",
                TaskSpec {
                    submitted_at_unix_ms: i64::MAX,
                    ..good()
                },
            ),
            (
                "task.model",
                TaskSpec {
                    model: "m".repeat(700_000),
                    ..good()
                },
            ),
            (
                "task.model",
                TaskSpec {
                    model: "a\u{1b}[2J".into(),
                    ..good()
                },
            ),
            (
                "task.priority_class",
                TaskSpec {
                    priority_class: 7,
                    ..good()
                },
            ),
            (
                "task.max_slowdown",
                TaskSpec {
                    max_slowdown: Some(1.2),
                    ..good()
                },
            ),
            (
                "task.max_slowdown",
                TaskSpec {
                    priority_class: PriorityClass::Production as i32,
                    max_slowdown: Some(1.0),
                    ..good()
                },
            ),
            (
                "task.max_slowdown",
                TaskSpec {
                    priority_class: PriorityClass::Production as i32,
                    max_slowdown: Some(f64::NAN),
                    ..good()
                },
            ),
            (
                "task.max_slowdown",
                TaskSpec {
                    priority_class: PriorityClass::Production as i32,
                    max_slowdown: Some(MAX_SLOWDOWN_CAP + 0.5),
                    ..good()
                },
            ),
            (
                "task.profile.device_kind",
                TaskSpec {
                    profile: Some(SoloProfile {
                        device_kind: "k".repeat(MAX_NAME_BYTES + 1),
                        ..Default::default()
                    }),
                    ..good()
                },
            ),
            (
                "task.profile.batch_size",
                TaskSpec {
                    profile: Some(SoloProfile {
                        batch_size: u32::MAX,
                        ..Default::default()
                    }),
                    ..good()
                },
            ),
            (
                "task.task_id",
                TaskSpec {
                    task_id: "t".repeat(MAX_ID_BYTES + 1),
                    ..good()
                },
            ),
            // What the hostile-input trials sent: 300,000 sizes, which etcd refused.
            (
                "task.allowed_batch_sizes",
                TaskSpec {
                    allowed_batch_sizes: vec![64; 300_000],
                    ..good()
                },
            ),
            (
                "task.allowed_batch_sizes[1]",
                TaskSpec {
                    allowed_batch_sizes: vec![64, 0],
                    ..good()
                },
            ),
            (
                "task.allowed_batch_sizes[0]",
                TaskSpec {
                    allowed_batch_sizes: vec![MAX_BATCH_SIZE + 1],
                    ..good()
                },
            ),
            // The pod's names go into the Eviction's URL path.
            (
                "task.kubernetes_pod.name",
                TaskSpec {
                    kubernetes_pod: Some(pod("ml", "x/../../kube-system/pods/dns", "")),
                    ..good()
                },
            ),
            (
                "task.kubernetes_pod.namespace",
                TaskSpec {
                    kubernetes_pod: Some(pod("", "train", "")),
                    ..good()
                },
            ),
            (
                "task.kubernetes_pod.uid",
                TaskSpec {
                    kubernetes_pod: Some(pod("ml", "train", "a/b")),
                    ..good()
                },
            ),
        ];
        for (field, spec) in cases {
            let err = task_spec("task", &spec).expect_err(field);
            assert!(
                err.to_string().starts_with(&format!("invalid {field}:")),
                "{err}"
            );
        }
        let err =
            device_ids("candidate_device_ids", &["ok".into(), "".into()]).expect_err("empty id");
        assert!(err.to_string().contains("candidate_device_ids[1]"), "{err}");
        let many = vec!["d".to_owned(); MAX_CANDIDATE_DEVICES + 1];
        let err = device_ids("candidate_device_ids", &many).expect_err("too many");
        assert!(
            err.to_string().starts_with("invalid candidate_device_ids:"),
            "{err}"
        );
    }

    fn pod(namespace: &str, name: &str, uid: &str) -> KubernetesPod {
        KubernetesPod {
            namespace: namespace.into(),
            name: name.into(),
            uid: uid.into(),
        }
    }

    /// The extender's spec may name its pod; a gRPC client's may not (it would have the
    /// placer evict a pod the client does not own).
    #[test]
    fn only_the_extender_names_a_pod() {
        let named = TaskSpec {
            kubernetes_pod: Some(pod("ml", "train-0", "0d4f6c1e-9b1a-4c55-8f1e-3c2b1a0f9e8d")),
            ..good()
        };
        task_spec("pod", &named).expect("the extender's spec");
        #[cfg(feature = "daemon")]
        {
            let err = place_request(&PlaceRequest {
                task: Some(named),
                candidate_device_ids: Vec::new(),
            })
            .expect_err("a gRPC Place naming a pod");
            assert!(
                err.to_string().starts_with("invalid task.kubernetes_pod:"),
                "{err}"
            );
        }
    }

    #[test]
    fn limits_themselves_are_accepted() {
        let spec = TaskSpec {
            model: "m".repeat(MAX_NAME_BYTES),
            initial_batch_size: MAX_BATCH_SIZE,
            max_batch_size: MAX_BATCH_SIZE,
            lr_rule: LrScalingRule::Adascale as i32,
            submitted_at_unix_ms: iadeep_proto::now_unix_ms(),
            allowed_batch_sizes: vec![MAX_BATCH_SIZE; MAX_ALLOWED_BATCH_SIZES],
            priority_class: PriorityClass::Production as i32,
            max_slowdown: Some(MAX_SLOWDOWN_CAP),
            ..good()
        };
        task_spec("task", &spec).expect("at the limits");
        // The gRPC requests' checks (the daemon's).
        #[cfg(feature = "daemon")]
        {
            let request = PlaceRequest {
                task: Some(spec),
                candidate_device_ids: vec!["d".to_owned(); MAX_CANDIDATE_DEVICES],
            };
            place_request(&request).expect("valid request");
            let err = place_request(&PlaceRequest::default()).expect_err("no task");
            assert!(err.to_string().starts_with("invalid task:"), "{err}");
            let err = release_request(&ReleaseRequest {
                task_id: "x".repeat(10_000),
            })
            .expect_err("long id");
            assert!(err.to_string().starts_with("invalid task_id:"), "{err}");
        }
    }
}
