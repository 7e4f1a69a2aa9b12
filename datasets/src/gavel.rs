//! Gavel's measured co-location throughputs.
//!
//! The file maps each worker (GPU) type to job types, each job type to its solo
//! throughput (`"null"`) and its throughput while sharing one GPU with another job:
//!
//! ```text
//! {worker_type: {"(job_type, scale_factor)": {"null": solo, "(other_job_type, sf)": [a, b]}}}
//! ```
//!
//! Only scale factor 1 (one GPU) is kept: co-located pairs exist only there, and
//! iadeep packs jobs onto single GPUs. A job type is a model family and, for most
//! families, a batch size, e.g. `ResNet-50 (batch size 64)`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde_json::Value;

use crate::DatasetError;

/// The Gavel file shipped in the repository (K80 and P100 workers).
pub const BUNDLED_K80_P100: &str = include_str!("../../data/gavel/throughputs-k80-p100.json");

/// A model family and its batch size (`None` for families Gavel lists without one).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobType {
    pub family: String,
    pub batch_size: Option<u32>,
}

impl JobType {
    /// Parses Gavel's job-type text, e.g. `ResNet-50 (batch size 64)` or `A3C`.
    pub fn parse(text: &str) -> Result<JobType, DatasetError> {
        let text = text.trim();
        match text.split_once(" (batch size ") {
            Some((family, rest)) => {
                let size = rest
                    .strip_suffix(')')
                    .and_then(|n| n.trim().parse::<u32>().ok())
                    .ok_or_else(|| DatasetError::Format(format!("bad job type {text:?}")))?;
                Ok(JobType {
                    family: family.trim().to_owned(),
                    batch_size: Some(size),
                })
            }
            None => Ok(JobType {
                family: text.to_owned(),
                batch_size: None,
            }),
        }
    }
}

impl fmt::Display for JobType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.batch_size {
            Some(size) => write!(f, "{} (batch size {size})", self.family),
            None => f.write_str(&self.family),
        }
    }
}

/// What happened when two jobs shared one GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PairOutcome {
    /// Both ran: steps per second of the first and of the second job.
    Ran { first: f64, second: f64 },
    /// The pair failed together (`[0, 0]` in the file; mostly out of memory).
    Failed,
}

/// The measurements of one worker type.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerThroughputs {
    /// Steps per second of each job type alone on one GPU.
    pub solo: BTreeMap<JobType, f64>,
    /// Outcome of each ordered pair (both orders are present).
    pub pairs: BTreeMap<(JobType, JobType), PairOutcome>,
}

impl WorkerThroughputs {
    /// Steps per second of `job` alone.
    pub fn solo_steps_per_s(&self, job: &JobType) -> Option<f64> {
        self.solo.get(job).copied()
    }

    /// The outcome of `first` sharing a GPU with `second`, oriented that way round.
    pub fn pair(&self, first: &JobType, second: &JobType) -> Option<PairOutcome> {
        if let Some(outcome) = self.pairs.get(&(first.clone(), second.clone())) {
            return Some(*outcome);
        }
        self.pairs
            .get(&(second.clone(), first.clone()))
            .map(|outcome| match *outcome {
                PairOutcome::Ran { first, second } => PairOutcome::Ran {
                    first: second,
                    second: first,
                },
                PairOutcome::Failed => PairOutcome::Failed,
            })
    }

    /// Batch sizes measured for each family, ascending (families without batch sizes omitted).
    pub fn families(&self) -> BTreeMap<String, Vec<u32>> {
        let mut families: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for job in self.solo.keys() {
            if let Some(size) = job.batch_size {
                families.entry(job.family.clone()).or_default().push(size);
            }
        }
        for sizes in families.values_mut() {
            sizes.sort_unstable();
            sizes.dedup();
        }
        families
    }
}

/// A whole Gavel throughput file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GavelThroughputs {
    pub workers: BTreeMap<String, WorkerThroughputs>,
}

/// Parses `('ResNet-50 (batch size 64)', 1)` into the job type and scale factor.
fn parse_key(key: &str) -> Result<(JobType, u32), DatasetError> {
    let bad = || DatasetError::Format(format!("bad job key {key:?}"));
    let inner = key
        .trim()
        .strip_prefix('(')
        .and_then(|k| k.strip_suffix(')'))
        .ok_or_else(bad)?;
    let (job, scale) = inner.rsplit_once(',').ok_or_else(bad)?;
    let job = job.trim().trim_matches('\'').trim_matches('"');
    let scale = scale.trim().parse::<u32>().map_err(|_| bad())?;
    Ok((JobType::parse(job)?, scale))
}

fn number(value: &Value, context: &str) -> Result<f64, DatasetError> {
    value
        .as_f64()
        .filter(|v| v.is_finite() && *v >= 0.0)
        .ok_or_else(|| DatasetError::Format(format!("{context}: expected a non-negative number")))
}

impl GavelThroughputs {
    /// Parses the JSON text of a Gavel throughput file.
    pub fn parse(json: &str) -> Result<GavelThroughputs, DatasetError> {
        let root: Value = serde_json::from_str(json)
            .map_err(|e| DatasetError::Format(format!("not JSON: {e}")))?;
        let root = root
            .as_object()
            .ok_or_else(|| DatasetError::Format("top level must be an object".into()))?;
        let mut workers = BTreeMap::new();
        for (worker, jobs) in root {
            let jobs = jobs
                .as_object()
                .ok_or_else(|| DatasetError::Format(format!("{worker}: must be an object")))?;
            let mut parsed = WorkerThroughputs::default();
            for (key, entries) in jobs {
                let (job, scale) = parse_key(key)?;
                if scale != 1 {
                    continue;
                }
                let entries = entries.as_object().ok_or_else(|| {
                    DatasetError::Format(format!("{worker} {key}: not an object"))
                })?;
                for (other, value) in entries {
                    let context = format!("{worker} {key} {other}");
                    if other == "null" {
                        parsed.solo.insert(job.clone(), number(value, &context)?);
                        continue;
                    }
                    let (other_job, other_scale) = parse_key(other)?;
                    if other_scale != 1 {
                        continue;
                    }
                    let pair = value.as_array().filter(|a| a.len() == 2).ok_or_else(|| {
                        DatasetError::Format(format!("{context}: expected [a, b]"))
                    })?;
                    let first = number(&pair[0], &context)?;
                    let second = number(&pair[1], &context)?;
                    let outcome = if first == 0.0 && second == 0.0 {
                        PairOutcome::Failed
                    } else {
                        PairOutcome::Ran { first, second }
                    };
                    parsed.pairs.insert((job.clone(), other_job), outcome);
                }
            }
            workers.insert(worker.clone(), parsed);
        }
        Ok(GavelThroughputs { workers })
    }

    /// Reads and parses a Gavel throughput file.
    pub fn from_path(path: &Path) -> Result<GavelThroughputs, DatasetError> {
        let text = std::fs::read_to_string(path).map_err(|source| DatasetError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text).map_err(|e| match e {
            DatasetError::Format(reason) => {
                DatasetError::Format(format!("{}: {reason}", path.display()))
            }
            other => other,
        })
    }

    /// The bundled K80/P100 file.
    pub fn bundled() -> Result<GavelThroughputs, DatasetError> {
        Self::parse(BUNDLED_K80_P100)
    }

    /// The measurements of `worker_type`; the error lists the types the file has.
    pub fn worker(&self, worker_type: &str) -> Result<&WorkerThroughputs, DatasetError> {
        self.workers
            .get(worker_type)
            .ok_or_else(|| DatasetError::UnknownWorkerType {
                requested: worker_type.to_owned(),
                available: self.workers.keys().cloned().collect::<Vec<_>>().join(", "),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_types_parse_with_and_without_batch_size() {
        let job = JobType::parse("ResNet-50 (batch size 64)").expect("parses");
        assert_eq!(
            (job.family.as_str(), job.batch_size),
            ("ResNet-50", Some(64))
        );
        assert_eq!(job.to_string(), "ResNet-50 (batch size 64)");
        assert_eq!(JobType::parse("A3C").expect("parses").batch_size, None);
        assert!(JobType::parse("LM (batch size x)").is_err());
    }

    #[test]
    fn bundled_file_has_both_workers_and_symmetric_pairs() {
        let gavel = GavelThroughputs::bundled().expect("bundled file parses");
        assert_eq!(gavel.workers.keys().collect::<Vec<_>>(), ["k80", "p100"]);
        let k80 = gavel.worker("k80").expect("k80");
        let families = k80.families();
        assert_eq!(
            families.get("ResNet-50").map(Vec::as_slice),
            Some(&[16, 32, 64, 128][..])
        );
        let a = JobType::parse("ResNet-18 (batch size 16)").expect("job");
        let b = JobType::parse("LM (batch size 10)").expect("job");
        let solo = k80.solo_steps_per_s(&a).expect("solo");
        assert!(solo > 0.0);
        match (k80.pair(&a, &b), k80.pair(&b, &a)) {
            (
                Some(PairOutcome::Ran { first, second }),
                Some(PairOutcome::Ran {
                    first: f2,
                    second: s2,
                }),
            ) => {
                assert_eq!((first, second), (s2, f2));
            }
            other => panic!("expected a measured pair both ways: {other:?}"),
        }
        assert!(k80.pairs.values().any(|o| matches!(o, PairOutcome::Failed)));
    }

    #[test]
    fn unknown_worker_lists_the_known_ones() {
        let gavel = GavelThroughputs::bundled().expect("parses");
        let err = gavel.worker("v100").expect_err("absent").to_string();
        assert!(err.contains("k80, p100"), "{err}");
    }

    #[test]
    fn malformed_files_are_errors_not_panics() {
        for text in [
            "[]",
            "{\"k80\": 3}",
            "{\"k80\": {\"bad key\": {}}}",
            "{\"k80\": {\"('A', 1)\": {\"null\": -1}}}",
            "{\"k80\": {\"('A', 1)\": {\"('B', 1)\": [1]}}}",
            "not json",
        ] {
            assert!(GavelThroughputs::parse(text).is_err(), "{text}");
        }
    }
}
