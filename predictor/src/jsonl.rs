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
//! with its 1-based line number and the field at fault, and skipped.
//!
//! Every numeric field takes any JSON number, integers written with a fraction
//! included (`"gpu_mem_mib": 2694.0`), because tools that write JSON from floats do
//! that. A negative value or one too large for a float is refused. `gpu_mem_mib`
//! may have a fraction and is rounded up to whole MiB (memory is never
//! under-counted); `batch_size` must be a whole number.

use std::io::BufRead;

use iadeep_proto::{CoLocationSample, TaskProfile};
use serde::{Deserialize, Deserializer, Serialize};

use crate::learner::validate_sample;

/// One task of a line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskLine {
    pub model: String,
    #[serde(deserialize_with = "whole_u32")]
    pub batch_size: u32,
    #[serde(deserialize_with = "non_negative")]
    pub solo_step_time_s: f64,
    #[serde(
        default,
        deserialize_with = "optional_non_negative",
        skip_serializing_if = "Option::is_none"
    )]
    pub gpu_util: Option<f64>,
    #[serde(
        default,
        deserialize_with = "optional_non_negative",
        skip_serializing_if = "Option::is_none"
    )]
    pub mem_util: Option<f64>,
    #[serde(
        default,
        deserialize_with = "optional_mib",
        skip_serializing_if = "Option::is_none"
    )]
    pub gpu_mem_mib: Option<u64>,
}

/// One line of a samples file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SampleLine {
    pub device: String,
    pub task: TaskLine,
    #[serde(default)]
    pub corunners: Vec<TaskLine>,
    #[serde(deserialize_with = "non_negative")]
    pub slowdown: f64,
}

/// Any JSON number as a float, refused when negative (JSON has no NaN or infinity;
/// a number too large for a float is already an error of the JSON reader).
fn checked(value: f64) -> Result<f64, String> {
    if !value.is_finite() {
        Err(format!("must be a finite number, got {value}"))
    } else if value < 0.0 {
        Err(format!("must not be negative, got {value}"))
    } else {
        Ok(value)
    }
}

fn non_negative<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    checked(f64::deserialize(d)?).map_err(serde::de::Error::custom)
}

fn optional_non_negative<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    Option::<f64>::deserialize(d)?
        .map(checked)
        .transpose()
        .map_err(serde::de::Error::custom)
}

fn whole_u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let value = checked(f64::deserialize(d)?).map_err(serde::de::Error::custom)?;
    if value.fract() != 0.0 || value > f64::from(u32::MAX) {
        return Err(serde::de::Error::custom(format!(
            "must be a whole number up to {}, got {value}",
            u32::MAX
        )));
    }
    Ok(value as u32)
}

/// MiB rounded up: a measured 2694.2 MiB needs 2695 whole ones.
fn optional_mib<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let Some(value) = optional_non_negative(d)? else {
        return Ok(None);
    };
    let mib = value.ceil();
    // 2^64 is the first float that no longer fits.
    if mib >= 18_446_744_073_709_551_616.0 {
        return Err(serde::de::Error::custom(format!(
            "must be at most {} MiB, got {value}",
            u64::MAX
        )));
    }
    Ok(Some(mib as u64))
}

/// One line parsed, or why not: the field at fault (e.g. `corunners[0].gpu_mem_mib`)
/// and the column, since the line number is the file's.
fn parse_line(line: &str) -> Result<SampleLine, String> {
    let mut reader = serde_json::Deserializer::from_str(line);
    let parsed: SampleLine = serde_path_to_error::deserialize(&mut reader).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let text = inner.to_string();
        let position = format!(" at line {} column {}", inner.line(), inner.column());
        let text = text.strip_suffix(&position).unwrap_or(&text);
        if path == "." {
            format!("{text} (column {})", inner.column())
        } else {
            format!("{path}: {text} (column {})", inner.column())
        }
    })?;
    reader.end().map_err(|e| e.to_string())?;
    Ok(parsed)
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
        let parsed = parse_line(&line).and_then(|l| {
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

    /// Any JSON number is a number: integers written with a fraction (as float-only
    /// writers do) are read, memory with a fraction is rounded up.
    #[test]
    fn integers_written_as_floats_are_read() {
        let text = r#"{"device": "k80", "task": {"model": "A", "batch_size": 64.0, "solo_step_time_s": 1, "gpu_util": 54, "gpu_mem_mib": 2694.0}, "corunners": [{"model": "B", "batch_size": 8, "solo_step_time_s": 2e-1, "gpu_mem_mib": 5100.25}], "slowdown": 2}"#;
        let (samples, errors) = read_samples(text.as_bytes()).expect("read");
        assert!(errors.is_empty(), "{errors:?}");
        let task = samples[0].task.as_ref().expect("task");
        assert_eq!(task.batch_size, 64);
        assert_eq!(task.solo_step_time_s, 1.0);
        assert_eq!(task.sm_util_pct, Some(54.0));
        assert_eq!(task.gpu_mem_mib, Some(2694));
        assert_eq!(samples[0].corunners[0].gpu_mem_mib, Some(5101));
        assert_eq!(samples[0].slowdown, 2.0);
    }

    /// A negative or out-of-range number is an error naming the line and the field.
    #[test]
    fn bad_numbers_name_their_line_and_field() {
        let line = |task: &str, co: &str, slowdown: &str| {
            format!(
                r#"{{"device": "k80", "task": {{"model": "A", "solo_step_time_s": 0.5, {task}}}, "corunners": [{{"model": "B", "solo_step_time_s": 0.2, {co}}}], "slowdown": {slowdown}}}"#
            )
        };
        let ok = r#""batch_size": 8"#;
        let cases = [
            (
                line(r#""batch_size": -8"#, ok, "1.5"),
                "task.batch_size: must not be negative, got -8",
            ),
            (
                line(r#""batch_size": 8.5"#, ok, "1.5"),
                "task.batch_size: must be a whole number",
            ),
            (
                line(r#""batch_size": 1e10"#, ok, "1.5"),
                "task.batch_size: must be a whole number",
            ),
            (
                line(ok, r#""batch_size": 8, "gpu_mem_mib": -2694.0"#, "1.5"),
                "corunners[0].gpu_mem_mib: must not be negative",
            ),
            (
                line(ok, r#""batch_size": 8, "gpu_mem_mib": 1e30"#, "1.5"),
                "corunners[0].gpu_mem_mib: must be at most",
            ),
            (
                line(ok, r#""batch_size": 8, "mem_util": -1"#, "1.5"),
                "corunners[0].mem_util: must not be negative",
            ),
            (
                line(r#""batch_size": 8, "gpu_util": 1e400"#, ok, "1.5"),
                "task.gpu_util: number out of range",
            ),
            (line(ok, ok, "-1.5"), "slowdown: must not be negative"),
        ];
        let text: String = cases.iter().map(|(l, _)| format!("{l}\n")).collect();
        let (samples, errors) = read_samples(text.as_bytes()).expect("read");
        assert!(samples.is_empty());
        assert_eq!(errors.len(), cases.len());
        for (i, ((_, want), got)) in cases.iter().zip(&errors).enumerate() {
            assert_eq!(got.line, i + 1);
            assert!(
                got.to_string()
                    .starts_with(&format!("line {}: {want}", i + 1)),
                "{got}"
            );
        }
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
