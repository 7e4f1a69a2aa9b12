//! Prequential (predict-then-learn) evaluation, ours against the reference.
//!
//! For each seed the samples are shuffled; then every sample is first predicted by
//! the current model and only afterwards learned, and the model refits on the same
//! cadence as in production ([`LearnerParams::refit_every`]), inline rather than on
//! a thread so results do not depend on thread timing. The absolute percentage
//! error |ŷ − y| / y is averaged over the samples with 0-based position 100..135
//! (the early regime the placer lives in after a cold start) and from 135 on.

use std::sync::Arc;

use iadeep_proto::CoLocationSample;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::error::PredictorError;
use crate::learner::{Learner, LearnerParams, ProfileTrainer, SlowdownModel, Trainer};
use crate::reference::ReferenceTrainer;

/// First position of the early window.
pub const EARLY_START: usize = 100;
/// End (exclusive) of the early window and start of the late one.
pub const LATE_START: usize = 135;

/// A model that learns one sample at a time at the production cadence.
#[derive(Debug)]
pub struct StreamModel<T: Trainer> {
    learner: Learner,
    trainer: T,
    model: T::Model,
}

impl<T: Trainer> StreamModel<T> {
    pub fn new(params: LearnerParams, trainer: T) -> Result<StreamModel<T>, PredictorError> {
        Ok(StreamModel {
            learner: Learner::new(params)?,
            model: trainer.initial(),
            trainer,
        })
    }

    /// The current model's prediction for `sample`.
    pub fn predict(&self, sample: &CoLocationSample) -> f64 {
        match sample.task.as_ref() {
            Some(task) => {
                self.model
                    .predict(&sample.device_kind, task, &sample.corunners)
                    .slowdown
            }
            None => f64::NAN,
        }
    }

    /// Learns `sample`, refitting when the cadence says so.
    pub fn learn(&mut self, sample: CoLocationSample) -> Result<(), PredictorError> {
        if self.learner.observe(sample)? {
            let snapshot: Vec<Arc<CoLocationSample>> = self.learner.snapshot();
            self.model = self.trainer.fit(&snapshot)?;
        }
        Ok(())
    }
}

/// MAPE of one approach.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Mape {
    /// Mean over seeds of the MAPE over positions 100..135 (`None`: too few samples).
    pub mape_100_135: Option<f64>,
    /// Mean over seeds of the MAPE from position 135 on.
    pub mape_from_135: Option<f64>,
    /// Per-seed values (early, late), for the spread.
    #[serde(skip)]
    pub per_seed: Vec<(Option<f64>, Option<f64>)>,
}

/// The result of an evaluation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EvalReport {
    pub samples: usize,
    pub ours: Mape,
    pub reference: Mape,
}

fn mean(values: &[f64]) -> Option<f64> {
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}

/// Errors of one stream: the absolute percentage error at each position.
pub fn stream_errors<T: Trainer>(
    params: &LearnerParams,
    trainer: T,
    stream: &[CoLocationSample],
) -> Result<Vec<f64>, PredictorError> {
    let mut model = StreamModel::new(params.clone(), trainer)?;
    let mut errors = Vec::with_capacity(stream.len());
    for sample in stream {
        let predicted = model.predict(sample);
        errors.push((predicted - sample.slowdown).abs() / sample.slowdown);
        model.learn(sample.clone())?;
    }
    Ok(errors)
}

fn windows(errors: &[f64]) -> (Option<f64>, Option<f64>) {
    let early = errors
        .get(EARLY_START..LATE_START.min(errors.len()))
        .unwrap_or(&[]);
    let late = errors.get(LATE_START..).unwrap_or(&[]);
    (mean(early), mean(late))
}

fn summarise(per_seed: Vec<(Option<f64>, Option<f64>)>) -> Mape {
    let early: Vec<f64> = per_seed.iter().filter_map(|p| p.0).collect();
    let late: Vec<f64> = per_seed.iter().filter_map(|p| p.1).collect();
    Mape {
        mape_100_135: mean(&early),
        mape_from_135: mean(&late),
        per_seed,
    }
}

/// Runs the evaluation over `seeds` shuffles of `samples` (seeds 0, 1, ...).
pub fn evaluate(
    samples: &[CoLocationSample],
    seeds: u64,
    params: &LearnerParams,
) -> Result<EvalReport, PredictorError> {
    evaluate_seeds(samples, 0..seeds, params)
}

/// Runs the evaluation over the shuffles numbered `seeds`.
///
/// Seed `s` shuffles the stream with `ChaCha8Rng::seed_from_u64(s)` and offsets the
/// forests' seed by `s`, so seeds `0..5` are exactly [`evaluate`] with 5 seeds.
/// Tune hyper-parameters on a range that does not overlap the seeds you report.
pub fn evaluate_seeds(
    samples: &[CoLocationSample],
    seeds: std::ops::Range<u64>,
    params: &LearnerParams,
) -> Result<EvalReport, PredictorError> {
    params.check()?;
    if samples.is_empty() {
        return Err(PredictorError::NoSamples);
    }
    let mut ours = Vec::new();
    let mut reference = Vec::new();
    for seed in seeds {
        let mut stream = samples.to_vec();
        stream.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        let mut seeded = params.clone();
        seeded.forest.seed = params.forest.seed.wrapping_add(seed);
        let (o, r) = std::thread::scope(|scope| {
            let reference = scope.spawn(|| {
                stream_errors(
                    &seeded,
                    ReferenceTrainer {
                        params: seeded.clone(),
                    },
                    &stream,
                )
            });
            let ours = stream_errors(
                &seeded,
                ProfileTrainer {
                    params: seeded.clone(),
                },
                &stream,
            );
            let reference = reference.join().unwrap_or_else(|_| {
                Err(PredictorError::Fit("reference evaluation panicked".into()))
            });
            (ours, reference)
        });
        let (o, r) = (windows(&o?), windows(&r?));
        tracing::info!(seed, ours_early = ?o.0, ours_late = ?o.1, reference_early = ?r.0, reference_late = ?r.1, "prequential seed done");
        ours.push(o);
        reference.push(r);
    }
    Ok(EvalReport {
        samples: samples.len(),
        ours: summarise(ours),
        reference: summarise(reference),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_proto::TaskProfile;

    #[test]
    fn windows_split_at_100_and_135() {
        let errors: Vec<f64> = (0..200).map(|i| if i < 135 { 0.1 } else { 0.3 }).collect();
        let (early, late) = windows(&errors);
        assert!((early.expect("early") - 0.1).abs() < 1e-12);
        assert!((late.expect("late") - 0.3).abs() < 1e-12);
        assert_eq!(windows(&errors[..50]), (None, None));
    }

    /// On a synthetic stream where new model names keep appearing but the slowdown
    /// follows the profile, our features must beat the one-hot names.
    #[test]
    fn profile_features_beat_names_on_new_models() {
        let samples: Vec<CoLocationSample> = (0..220u32)
            .map(|i| {
                let step = 0.02 + 0.01 * f64::from(i % 37);
                let co = 0.05 + 0.02 * f64::from(i % 11);
                let p = |m: String, s| TaskProfile {
                    model: m,
                    batch_size: 32,
                    solo_step_time_s: s,
                    ..Default::default()
                };
                CoLocationSample {
                    device_kind: "k80".into(),
                    task: Some(p(format!("model-{i}"), step)),
                    corunners: vec![p(format!("other-{i}"), co)],
                    slowdown: 1.0 + co / (step + co),
                    ..Default::default()
                }
            })
            .collect();
        let params = LearnerParams {
            forest: crate::forest::ForestParams {
                n_trees: 8,
                ..Default::default()
            },
            ..LearnerParams::default()
        };
        let report = evaluate(&samples, 1, &params).expect("eval");
        let ours = report.ours.mape_100_135.expect("ours");
        let reference = report.reference.mape_100_135.expect("ref");
        assert!(ours < 0.5 * reference, "ours {ours} reference {reference}");
        assert_eq!(report.samples, 220);
    }
}
