//! The unseen-models split: how well each approach predicts a model it has never
//! seen, the promise of profile features that the default split cannot measure
//! (there every job is identified by its step time and batch size).
//!
//! Per seed, the model families (the `model` field; one family runs at several
//! batch sizes) are put in a random order, and the stream is the samples grouped by
//! their task's family in that order (shuffled by the seed within a family). For
//! each family `f` in turn, every approach is fitted, through the production window,
//! only on the samples placed before `f`'s that do not involve `f` at all (neither
//! as task nor as co-runner), and then predicts every sample whose task is `f`. The
//! first family is predicted with nothing learned (the cold-start rule, for every
//! approach alike). The MAPE and the coverage of the 90 % intervals are over all
//! those predictions, i.e. every sample once, averaged over seeds.

use std::collections::BTreeSet;

use iadeep_proto::CoLocationSample;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use iadeep_objective::stats::mean;
use iadeep_predictor::PredictorError;
use iadeep_predictor::{Learner, LearnerParams};

use super::prequential::{Approach, Outcome, coverage, for_each_approach, per_approach_over_seeds};

/// One approach on the unseen-models split.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UnseenScore {
    /// Mean over seeds of the MAPE over every sample.
    pub mape: Option<f64>,
    /// Mean over seeds of the share of samples inside their 90 % interval.
    pub coverage_90: Option<f64>,
    /// Per-seed MAPE, for the spread.
    #[serde(skip)]
    pub per_seed: Vec<f64>,
}

/// The result of an unseen-models evaluation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UnseenReport {
    pub samples: usize,
    /// Always `"unseen-models"`.
    pub split: &'static str,
    pub ours: UnseenScore,
    pub reference: UnseenScore,
    pub plain_forest: UnseenScore,
}

fn family_of(sample: &CoLocationSample) -> Result<&str, PredictorError> {
    sample
        .task
        .as_ref()
        .map(|t| t.model.as_str())
        .ok_or_else(|| PredictorError::InvalidSample("no task profile".into()))
}

fn involves(sample: &CoLocationSample, family: &str) -> bool {
    sample
        .task
        .iter()
        .chain(&sample.corunners)
        .any(|p| p.model == family)
}

/// The stream of one seed: the families in a random order, and the samples grouped
/// by their task's family in that order.
type Stream<'s> = (Vec<&'s str>, Vec<&'s CoLocationSample>);

fn stream_of(samples: &[CoLocationSample], seed: u64) -> Result<Stream<'_>, PredictorError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let families: BTreeSet<&str> = samples
        .iter()
        .flat_map(|s| s.task.iter().chain(&s.corunners))
        .map(|p| p.model.as_str())
        .collect();
    let mut families: Vec<&str> = families.into_iter().collect();
    families.shuffle(&mut rng);
    let mut stream: Vec<&CoLocationSample> = samples.iter().collect();
    stream.shuffle(&mut rng);
    let position = |s: &CoLocationSample| -> Result<usize, PredictorError> {
        let family = family_of(s)?;
        Ok(families
            .iter()
            .position(|f| *f == family)
            .unwrap_or(usize::MAX))
    };
    let mut keyed = stream
        .into_iter()
        .map(|s| Ok((position(s)?, s)))
        .collect::<Result<Vec<_>, PredictorError>>()?;
    // Stable: the shuffled order within a family stays.
    keyed.sort_by_key(|(p, _)| *p);
    Ok((families, keyed.into_iter().map(|(_, s)| s).collect()))
}

/// Every sample's outcome for `approach` on one seed's stream.
fn outcomes(
    params: &LearnerParams,
    approach: Approach,
    families: &[&str],
    stream: &[&CoLocationSample],
) -> Result<Vec<Outcome>, PredictorError> {
    let trainer = approach.trainer(params);
    let mut outcomes = Vec::with_capacity(stream.len());
    let mut done = 0;
    for &family in families {
        // The samples of `family` start where the earlier families' end.
        let block = stream[done..]
            .iter()
            .take_while(|s| family_of(s).is_ok_and(|f| f == family))
            .count();
        if block == 0 {
            continue;
        }
        let mut learner = Learner::new(params.clone())?;
        for sample in &stream[..done] {
            if !involves(sample, family) {
                learner.observe((*sample).clone())?;
            }
        }
        let model = trainer.fit(&learner.snapshot())?;
        let mut apes = Vec::with_capacity(block);
        for sample in &stream[done..done + block] {
            let task = sample
                .task
                .as_ref()
                .ok_or_else(|| PredictorError::InvalidSample("no task profile".into()))?;
            let predicted = model.predict(&sample.device_kind, task, &sample.corunners);
            let outcome = Outcome::of(&predicted, sample.slowdown);
            apes.push(outcome.ape);
            outcomes.push(outcome);
        }
        tracing::debug!(
            approach = approach.name(),
            family,
            trained_on = learner.window_len(),
            predicted = block,
            mape = ?mean(apes),
            "unseen family predicted"
        );
        done += block;
    }
    Ok(outcomes)
}

fn summarise(per_seed: &[(Option<f64>, Option<f64>)]) -> UnseenScore {
    UnseenScore {
        mape: mean(per_seed.iter().filter_map(|p| p.0)),
        coverage_90: mean(per_seed.iter().filter_map(|p| p.1)),
        per_seed: per_seed.iter().filter_map(|p| p.0).collect(),
    }
}

/// Runs the unseen-models split over the seeds `seeds` (seed `s` orders the
/// families and the samples with `ChaCha8Rng::seed_from_u64(s)` and offsets the
/// forests' seed by `s`).
pub fn evaluate_unseen(
    samples: &[CoLocationSample],
    seeds: std::ops::Range<u64>,
    params: &LearnerParams,
) -> Result<UnseenReport, PredictorError> {
    let per_approach = per_approach_over_seeds(samples, seeds, params, |seed, params| {
        let (families, stream) = stream_of(samples, seed)?;
        for_each_approach(|approach| {
            let outcomes = outcomes(params, approach, &families, &stream)?;
            Ok((mean(outcomes.iter().map(|o| o.ape)), coverage(&outcomes)))
        })
    })?;
    Ok(UnseenReport {
        samples: samples.len(),
        split: "unseen-models",
        ours: summarise(&per_approach[0]),
        reference: summarise(&per_approach[1]),
        plain_forest: summarise(&per_approach[2]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_proto::TaskProfile;

    fn sample(task: &str, co: &str, slowdown: f64) -> CoLocationSample {
        let p = |m: &str| TaskProfile {
            model: m.into(),
            batch_size: 8,
            solo_step_time_s: 0.1,
            ..Default::default()
        };
        CoLocationSample {
            device_kind: "k80".into(),
            task: Some(p(task)),
            corunners: vec![p(co)],
            slowdown,
            ..Default::default()
        }
    }

    #[test]
    fn the_stream_groups_samples_by_their_task_family() {
        let samples: Vec<_> = ["a", "b", "c", "a", "b", "c", "a"]
            .iter()
            .zip(["b", "c", "a", "a", "d", "c", "c"])
            .map(|(t, c)| sample(t, c, 1.5))
            .collect();
        let (families, stream) = stream_of(&samples, 3).expect("stream");
        assert_eq!(
            families.len(),
            4,
            "co-runner-only families are families too"
        );
        let order: Vec<&str> = stream.iter().map(|s| family_of(s).expect("task")).collect();
        let mut seen: Vec<&str> = order.clone();
        seen.dedup();
        assert_eq!(seen.len(), 3, "each family is one block: {order:?}");
        let ranks: Vec<usize> = seen
            .iter()
            .map(|f| families.iter().position(|g| g == f).expect("family"))
            .collect();
        assert!(ranks.windows(2).all(|w| w[0] < w[1]), "{ranks:?}");
        assert_ne!(stream_of(&samples, 4).expect("stream").0, families);
    }

    /// A family is predicted by a model that never saw it: here every family has
    /// its own slowdown, which no profile feature reveals (all profiles are alike),
    /// so a model that had seen the family would be exact and one that had not
    /// cannot be.
    #[test]
    fn a_family_is_never_in_its_own_training_set() {
        let families = ["a", "b", "c", "d", "e"];
        let mut samples = Vec::new();
        for (i, t) in families.iter().enumerate() {
            for c in families {
                for _ in 0..6 {
                    samples.push(sample(t, c, 1.2 + 0.4 * i as f64));
                }
            }
        }
        let params = LearnerParams {
            min_samples: 5,
            forest: iadeep_predictor::ForestParams {
                n_trees: 4,
                ..Default::default()
            },
            ..LearnerParams::default()
        };
        let report = evaluate_unseen(&samples, 0..2, &params).expect("eval");
        assert_eq!(report.split, "unseen-models");
        assert_eq!(report.samples, 150);
        for score in [&report.ours, &report.reference, &report.plain_forest] {
            let mape = score.mape.expect("mape");
            assert!(mape > 0.1, "{mape}: a family leaked into its training set");
            assert!(score.coverage_90.is_some());
        }
        // The default split, which learns every family as it goes, gets them right.
        let default = crate::predictor::prequential::evaluate(&samples, 1, &params).expect("eval");
        let late = default.ours.mape_from_135.expect("late");
        assert!(late < 0.05, "{late}");
    }
}
