//! Checks on what callers send, before anything is decided or written.
//!
//! Every error names the field (as the caller spells it in the request), because
//! "invalid argument" alone makes an orchestrator's operator guess.

use iadeep_proto::TaskSpec;
use iadeep_state::keys;

use crate::error::{PlacerError, Result};

/// Largest memory request taken seriously, MiB (1 TiB): beyond it is a unit mistake.
const MAX_MEM_MIB: u64 = 1 << 20;

fn id(field: &str, kind: &'static str, value: &str) -> Result<()> {
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

/// Checks a task spec; `prefix` is the path of the spec in the request (e.g. `task`).
///
/// Batch-size bounds of 0 mean "not given" and default to the initial batch size.
pub fn task_spec(prefix: &str, spec: &TaskSpec) -> Result<()> {
    let f = |name: &str| format!("{prefix}.{name}");
    id(&f("task_id"), "task", &spec.task_id)?;
    if spec.initial_batch_size == 0 {
        return Err(PlacerError::invalid(
            f("initial_batch_size"),
            "must be positive (the batch size the job was submitted with)",
        ));
    }
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
        if let Some(t) = profile.step_time_s
            && !(t.is_finite() && t > 0.0)
        {
            return Err(PlacerError::invalid(
                f("profile.step_time_s"),
                format!("{t} is not a positive number of seconds"),
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
    }
    Ok(())
}

/// Checks the device ids a caller restricts the choice to.
pub fn device_ids(field: &str, ids: &[String]) -> Result<()> {
    for (i, device) in ids.iter().enumerate() {
        id(&format!("{field}[{i}]"), "device", device)?;
    }
    Ok(())
}

/// Checks a task id.
pub fn task_id(field: &str, task: &str) -> Result<()> {
    id(field, "task", task)
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_proto::SoloProfile;

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
    }
}
