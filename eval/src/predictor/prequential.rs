//! The default split: prequential (predict-then-learn) evaluation of ours against
//! the reference and the plain forest.
//!
//! For each seed the samples are shuffled; then every sample is first predicted by
//! the current model and only afterwards learned, and the model refits on the same
//! cadence as in production ([`LearnerParams::refit_every`]), inline rather than on
//! a thread so results do not depend on thread timing. The absolute percentage
//! error |ŷ − y| / y is averaged over the samples with 0-based position 100..135
//! (the early regime the placer lives in after a cold start) and from 135 on; the
//! coverage of the 90 % interval is the share of samples from position 100 on that
//! fall inside theirs.
//!
//! Every model sees a closed set of jobs here, each identified by its step time and
//! batch size; [`super::unseen`] measures models never seen.

use std::sync::Arc;

use iadeep_proto::CoLocationSample;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use super::plain_forest::PlainForestTrainer;
use super::reference::ReferenceTrainer;
use iadeep_objective::stats::mean;
use iadeep_predictor::Prediction;
use iadeep_predictor::PredictorError;
use iadeep_predictor::{Learner, LearnerParams, ProfileTrainer, SlowdownModel, Trainer};

/// First position of the early window.
pub const EARLY_START: usize = 100;
/// End (exclusive) of the early window and start of the late one.
pub const LATE_START: usize = 135;

/// The approaches an evaluation compares, each with the same window, cadence,
/// forest parameters and cold-start rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Approach {
    /// Our predictor ([`ProfileTrainer`]).
    Ours,
    /// The job-name one-hot forest (`reference.rs`).
    Reference,
    /// A plain forest on our profile features (`plain_forest.rs`).
    PlainForest,
}

impl Approach {
    /// Every approach, in report order.
    pub const ALL: [Approach; 3] = [Approach::Ours, Approach::Reference, Approach::PlainForest];

    /// Its name in reports (the JSON key).
    pub fn name(self) -> &'static str {
        match self {
            Approach::Ours => "ours",
            Approach::Reference => "reference",
            Approach::PlainForest => "plain_forest",
        }
    }

    /// Its trainer with `params`.
    pub(crate) fn trainer(self, params: &LearnerParams) -> Box<dyn AnyTrainer> {
        let params = params.clone();
        match self {
            Approach::Ours => Box::new(ProfileTrainer { params }),
            Approach::Reference => Box::new(ReferenceTrainer { params }),
            Approach::PlainForest => Box::new(PlainForestTrainer { params }),
        }
    }
}

/// A [`Trainer`] whose models are boxed, so the approaches share one code path.
pub(crate) trait AnyTrainer: Send + Sync {
    fn initial(&self) -> Box<dyn SlowdownModel>;
    fn fit(
        &self,
        samples: &[Arc<CoLocationSample>],
    ) -> Result<Box<dyn SlowdownModel>, PredictorError>;
}

impl<T: Trainer> AnyTrainer for T
where
    T::Model: 'static,
{
    fn initial(&self) -> Box<dyn SlowdownModel> {
        Box::new(Trainer::initial(self))
    }

    fn fit(
        &self,
        samples: &[Arc<CoLocationSample>],
    ) -> Result<Box<dyn SlowdownModel>, PredictorError> {
        Ok(Box::new(Trainer::fit(self, samples)?))
    }
}

/// Runs `run` for every approach at once (one thread each) and returns the results
/// in [`Approach::ALL`] order.
pub(crate) fn for_each_approach<R: Send>(
    run: impl Fn(Approach) -> Result<R, PredictorError> + Sync,
) -> Result<Vec<R>, PredictorError> {
    std::thread::scope(|scope| {
        let run = &run;
        let handles: Vec<_> = Approach::ALL
            .iter()
            .map(|&approach| scope.spawn(move || run(approach)))
            .collect();
        handles
            .into_iter()
            .zip(Approach::ALL)
            .map(|(handle, approach)| {
                handle.join().unwrap_or_else(|_| {
                    Err(PredictorError::Fit(format!(
                        "the {} evaluation panicked",
                        approach.name()
                    )))
                })
            })
            .collect()
    })
}

/// How one prediction fared against the measured slowdown.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Outcome {
    /// |ŷ − y| / y.
    pub ape: f64,
    /// Whether y lies in the prediction's 90 % interval.
    pub inside_90: bool,
}

impl Outcome {
    /// The outcome of `prediction` for the measured `slowdown`.
    pub fn of(prediction: &Prediction, slowdown: f64) -> Outcome {
        Outcome {
            ape: (prediction.slowdown - slowdown).abs() / slowdown,
            inside_90: prediction.lower_90 <= slowdown && slowdown <= prediction.upper_90,
        }
    }
}

/// A model that learns one sample at a time at the production cadence.
struct StreamModel {
    learner: Learner,
    trainer: Box<dyn AnyTrainer>,
    model: Box<dyn SlowdownModel>,
}

impl StreamModel {
    fn new(params: &LearnerParams, approach: Approach) -> Result<StreamModel, PredictorError> {
        let trainer = approach.trainer(params);
        Ok(StreamModel {
            learner: Learner::new(params.clone())?,
            model: trainer.initial(),
            trainer,
        })
    }

    /// The current model's prediction for `sample` (`None` without a task).
    fn predict(&self, sample: &CoLocationSample) -> Option<Prediction> {
        let task = sample.task.as_ref()?;
        Some(
            self.model
                .predict(&sample.device_kind, task, &sample.corunners),
        )
    }

    /// Learns `sample`, refitting when the cadence says so.
    fn learn(&mut self, sample: CoLocationSample) -> Result<(), PredictorError> {
        if self.learner.observe(sample)? {
            let snapshot = self.learner.snapshot();
            self.model = self.trainer.fit(&snapshot)?;
        }
        Ok(())
    }
}

/// The outcome at each position of one stream, predicted before it is learned.
pub fn stream_outcomes(
    params: &LearnerParams,
    approach: Approach,
    stream: &[CoLocationSample],
) -> Result<Vec<Outcome>, PredictorError> {
    let mut model = StreamModel::new(params, approach)?;
    let mut outcomes = Vec::with_capacity(stream.len());
    for sample in stream {
        let Some(predicted) = model.predict(sample) else {
            return Err(PredictorError::InvalidSample("no task profile".into()));
        };
        outcomes.push(Outcome::of(&predicted, sample.slowdown));
        model.learn(sample.clone())?;
    }
    Ok(outcomes)
}

/// One approach on the default split.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Mape {
    /// Mean over seeds of the MAPE over positions 100..135 (`None`: too few samples).
    pub mape_100_135: Option<f64>,
    /// Mean over seeds of the MAPE from position 135 on.
    pub mape_from_135: Option<f64>,
    /// Mean over seeds of the share of samples from position 100 on inside their
    /// 90 % interval.
    pub coverage_90: Option<f64>,
    /// Per-seed values (early, late), for the spread.
    #[serde(skip)]
    pub per_seed: Vec<(Option<f64>, Option<f64>)>,
}

/// The result of a default-split evaluation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EvalReport {
    pub samples: usize,
    /// Always `"default"`.
    pub split: &'static str,
    pub ours: Mape,
    pub reference: Mape,
    pub plain_forest: Mape,
}

/// The share of `outcomes` inside their 90 % interval.
pub(crate) fn coverage(outcomes: &[Outcome]) -> Option<f64> {
    mean(outcomes.iter().map(|o| if o.inside_90 { 1.0 } else { 0.0 }))
}

/// (early MAPE, late MAPE, coverage from the early window on) of one stream.
type Windows = (Option<f64>, Option<f64>, Option<f64>);

fn windows(outcomes: &[Outcome]) -> Windows {
    let early = outcomes
        .get(EARLY_START..LATE_START.min(outcomes.len()))
        .unwrap_or(&[]);
    let late = outcomes.get(LATE_START..).unwrap_or(&[]);
    let measured = outcomes.get(EARLY_START..).unwrap_or(&[]);
    (
        mean(early.iter().map(|o| o.ape)),
        mean(late.iter().map(|o| o.ape)),
        coverage(measured),
    )
}

fn summarise(per_seed: &[Windows]) -> Mape {
    Mape {
        mape_100_135: mean(per_seed.iter().filter_map(|p| p.0)),
        mape_from_135: mean(per_seed.iter().filter_map(|p| p.1)),
        coverage_90: mean(per_seed.iter().filter_map(|p| p.2)),
        per_seed: per_seed.iter().map(|p| (p.0, p.1)).collect(),
    }
}

/// `params` for seed `seed`: the forests' seed offset by it, so that every seed
/// draws other trees as well as another order.
fn seeded(params: &LearnerParams, seed: u64) -> LearnerParams {
    let mut seeded = params.clone();
    seeded.forest.seed = params.forest.seed.wrapping_add(seed);
    seeded
}

/// The loop both splits share: checks the inputs, runs `one_seed` (one result per
/// approach, in [`Approach::ALL`] order) for every seed with [`seeded`] parameters,
/// logs each result, and returns every approach's results in seed order.
pub(crate) fn per_approach_over_seeds<R: std::fmt::Debug>(
    samples: &[CoLocationSample],
    seeds: std::ops::Range<u64>,
    params: &LearnerParams,
    mut one_seed: impl FnMut(u64, &LearnerParams) -> Result<Vec<R>, PredictorError>,
) -> Result<Vec<Vec<R>>, PredictorError> {
    params.check()?;
    if samples.is_empty() {
        return Err(PredictorError::NoSamples);
    }
    let mut per_approach: Vec<Vec<R>> = Approach::ALL.iter().map(|_| Vec::new()).collect();
    for seed in seeds {
        let results = one_seed(seed, &seeded(params, seed))?;
        for ((approach, result), all) in Approach::ALL.iter().zip(results).zip(&mut per_approach) {
            tracing::info!(
                seed,
                approach = approach.name(),
                ?result,
                "evaluation seed done"
            );
            all.push(result);
        }
    }
    Ok(per_approach)
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
    let per_approach = per_approach_over_seeds(samples, seeds, params, |seed, params| {
        let mut stream = samples.to_vec();
        stream.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        for_each_approach(|approach| Ok(windows(&stream_outcomes(params, approach, &stream)?)))
    })?;
    Ok(EvalReport {
        samples: samples.len(),
        split: "default",
        ours: summarise(&per_approach[0]),
        reference: summarise(&per_approach[1]),
        plain_forest: summarise(&per_approach[2]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_proto::TaskProfile;

    fn outcome(ape: f64, inside_90: bool) -> Outcome {
        Outcome { ape, inside_90 }
    }

    #[test]
    fn windows_split_at_100_and_135() {
        let outcomes: Vec<Outcome> = (0..200)
            .map(|i| outcome(if i < 135 { 0.1 } else { 0.3 }, i % 4 != 0))
            .collect();
        let (early, late, coverage) = windows(&outcomes);
        assert!((early.expect("early") - 0.1).abs() < 1e-12);
        assert!((late.expect("late") - 0.3).abs() < 1e-12);
        assert!((coverage.expect("coverage") - 0.75).abs() < 1e-12);
        assert_eq!(windows(&outcomes[..50]), (None, None, None));
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
            forest: iadeep_predictor::ForestParams {
                n_trees: 8,
                ..Default::default()
            },
            ..LearnerParams::default()
        };
        let report = evaluate(&samples, 1, &params).expect("eval");
        let ours = report.ours.mape_100_135.expect("ours");
        let reference = report.reference.mape_100_135.expect("ref");
        assert!(ours < 0.5 * reference, "ours {ours} reference {reference}");
        assert!(report.plain_forest.mape_100_135.is_some());
        assert_eq!(report.samples, 220);
    }
}
