//! The JSON Lines sample format, one co-location observation per line:
//!
//! ```text
//! {"device": "v100", "task": {"model": "ResNet-50", "batch_size": 64, "solo_step_time_s": 0.12,
//!  "gpu_util": 54.0, "mem_util": 27.0, "gpu_mem_mib": 5100}, "corunners": [{...}], "slowdown": 1.43}
//! ```
//!
//! `model`, `batch_size`, `solo_step_time_s` are required; `gpu_util` (SM, percent),
//! `mem_util` (memory bandwidth, percent) and `gpu_mem_mib` are optional; unknown
//! fields are ignored so producers can add provenance. A malformed line is reported
//! with its 1-based line number and skipped.

use std::io::BufRead;

use iadeep_proto::{CoLocationSample, TaskProfile};
use serde::{Deserialize, Serialize};

use crate::learner::validate_sample;

/// One task of a line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskLine {
    pub model: String,
    pub batch_size: u32,
    pub solo_step_time_s: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_util: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_util: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_mem_mib: Option<u64>,
}

/// One line of a samples file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SampleLine {
    pub device: String,
    pub task: TaskLine,
    #[serde(default)]
    pub corunners: Vec<TaskLine>,
    pub slowdown: f64,
}

impl From<&TaskLine> for TaskProfile {
    fn from(t: &TaskLine) -> TaskProfile {
        TaskProfile {
            model: t.model.clone(),
            batch_size: t.batch_size,
            solo_step_time_s: t.solo_step_time_s,
            sm_util_pct: t.gpu_util,
            mem_bw_util_pct: t.mem_util,
            gpu_mem_mib: t.gpu_mem_mib,
        }
    }
}

impl From<&TaskProfile> for TaskLine {
    fn from(t: &TaskProfile) -> TaskLine {
        TaskLine {
            model: t.model.clone(),
            batch_size: t.batch_size,
            solo_step_time_s: t.solo_step_time_s,
            gpu_util: t.sm_util_pct,
            mem_util: t.mem_bw_util_pct,
            gpu_mem_mib: t.gpu_mem_mib,
        }
    }
}

impl SampleLine {
    /// The sample as the predictor and the store see it.
    pub fn to_sample(&self) -> CoLocationSample {
        CoLocationSample {
            device_kind: self.device.clone(),
            task: Some(TaskProfile::from(&self.task)),
            corunners: self.corunners.iter().map(TaskProfile::from).collect(),
            slowdown: self.slowdown,
            ..Default::default()
        }
    }

    /// The line of `sample`; `None` when it has no task profile.
    pub fn from_sample(sample: &CoLocationSample) -> Option<SampleLine> {
        Some(SampleLine {
            device: sample.device_kind.clone(),
            task: TaskLine::from(sample.task.as_ref()?),
            corunners: sample.corunners.iter().map(TaskLine::from).collect(),
            slowdown: sample.slowdown,
        })
    }
}

/// A line that could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LineError {
    /// 1-based line number.
    pub line: usize,
    pub reason: String,
}

impl std::fmt::Display for LineError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

/// Reads every sample of `reader`; blank lines are skipped silently, malformed or
/// invalid ones are returned as [`LineError`]s. An I/O error stops the reading.
pub fn read_samples(
    reader: impl BufRead,
) -> std::io::Result<(Vec<CoLocationSample>, Vec<LineError>)> {
    let mut samples = Vec::new();
    let mut errors = Vec::new();
    for (index, line) in reader.lines().enumerate() {
        let line = line?;
        let number = index + 1;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<SampleLine>(&line)
            .map_err(|e| e.to_string())
            .and_then(|l| {
                let sample = l.to_sample();
                validate_sample(&sample).map_err(|e| e.to_string())?;
                Ok(sample)
            });
        match parsed {
            Ok(sample) => samples.push(sample),
            Err(reason) => errors.push(LineError {
                line: number,
                reason,
            }),
        }
    }
    Ok((samples, errors))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_issue_example_and_reports_bad_lines() {
        let text = r#"{"device": "v100", "task": {"model": "ResNet-50", "batch_size": 64, "solo_step_time_s": 0.12, "gpu_util": 54.0, "mem_util": 27.0, "gpu_mem_mib": 5100}, "corunners": [{"model": "LM", "batch_size": 20, "solo_step_time_s": 0.3, "extra": 1}], "slowdown": 1.43, "note": "ignored"}

not json
{"device": "v100", "task": {"model": "A", "batch_size": 1}, "slowdown": 1.1}
{"device": "v100", "task": {"model": "A", "batch_size": 1, "solo_step_time_s": -1}, "slowdown": 1.1}
"#;
        let (samples, errors) = read_samples(text.as_bytes()).expect("read");
        assert_eq!(samples.len(), 1);
        let s = &samples[0];
        assert_eq!(s.device_kind, "v100");
        let task = s.task.as_ref().expect("task");
        assert_eq!(
            (task.sm_util_pct, task.mem_bw_util_pct, task.gpu_mem_mib),
            (Some(54.0), Some(27.0), Some(5100))
        );
        assert_eq!(s.corunners[0].sm_util_pct, None);
        assert_eq!(
            errors.iter().map(|e| e.line).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        assert!(
            errors[1].reason.contains("solo_step_time_s"),
            "{}",
            errors[1]
        );
    }

    #[test]
    fn lines_round_trip() {
        let line = SampleLine {
            device: "k80".into(),
            task: TaskLine {
                model: "A".into(),
                batch_size: 8,
                solo_step_time_s: 0.5,
                gpu_util: None,
                mem_util: Some(3.0),
                gpu_mem_mib: None,
            },
            corunners: vec![],
            slowdown: 1.5,
        };
        let back = SampleLine::from_sample(&line.to_sample()).expect("task");
        assert_eq!(back, line);
    }
}
