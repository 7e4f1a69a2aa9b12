//! What the policy needs to know about tasks, behind two small traits.
//!
//! The policy must not care *how* a slowdown or a memory footprint is
//! estimated: the daemon plugs in the online predictor ([`PredictorSlowdown`])
//! and the tuner's memory model ([`ModelledMemory`]) through thin adapters, and
//! tests and the simulator can plug in whatever they need.

use std::fmt;
use std::sync::Arc;

use iadeep_predictor::SlowdownModel as PredictorModel;
use iadeep_predictor::{FittedModel, LearnerParams, OnlinePredictor, PairwiseFold};
use iadeep_proto::{CoLocationSample, TaskProfile, TaskReport, TaskSpec};
use iadeep_tuner::{MemoryModel, MemoryModelParams, MemorySample};

/// A predicted interference factor IF (co-located step time ÷ solo step time).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlowdownEstimate {
    /// Predicted IF, ≥ 1 for any sensible model.
    pub slowdown: f64,
    /// Spread of the prediction (e.g. the standard deviation across a forest's trees),
    /// in the same unit; 0 when the model claims certainty.
    pub uncertainty: f64,
    /// Upper end of the model's 90 % predictive interval of IF: the pessimistic
    /// slowdown the queue-or-place rule charges (see [`crate::policy`]); equal to
    /// `slowdown` when the model claims certainty.
    pub upper_90: f64,
}

impl SlowdownEstimate {
    /// An estimate the model is sure of.
    pub fn certain(slowdown: f64) -> SlowdownEstimate {
        SlowdownEstimate {
            slowdown,
            uncertainty: 0.0,
            upper_90: slowdown,
        }
    }
}

/// The predictor's answer as the placer uses it (its source is only for logs).
impl From<iadeep_predictor::Prediction> for SlowdownEstimate {
    fn from(p: iadeep_predictor::Prediction) -> SlowdownEstimate {
        SlowdownEstimate {
            slowdown: p.slowdown,
            uncertainty: p.uncertainty,
            upper_90: p.upper_90,
        }
    }
}

/// Predicts how much a task slows down next to co-runners.
pub trait SlowdownModel: Send + Sync + fmt::Debug {
    /// IF of `task` on a device of `device_kind` shared with `corunners`
    /// (an empty slice means "alone", which must give 1.0).
    fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> SlowdownEstimate;

    /// Learns from a measured co-location. Models that do not learn ignore it; the
    /// daemon feeds every sample the tuners write here.
    fn observe(&self, sample: &CoLocationSample);

    /// Identifies the model's current state: two calls that return the same `Some(v)`
    /// must give the same predictions for the same inputs, so the placer may reuse
    /// them (the residents' slowdowns without a newcomer change only when the residents
    /// or the model do). `None`, the default, means "may change at any time": nothing
    /// is reused.
    fn version(&self) -> Option<u64> {
        None
    }

    /// The model as it is now, to ask for the predictions of one whole decision:
    /// `None`, the default, means ask `self`. A decision makes ~200 predictions, and
    /// the online predictor takes a lock and counts a reference for each; from
    /// concurrent decisions on different cores those counters bounce between
    /// caches. A pinned model also gives predictions and [`SlowdownModel::version`]
    /// from the same fit.
    fn pinned(&self) -> Option<Arc<dyn SlowdownModel>> {
        None
    }

    /// For a model that composes several co-runners from one-co-runner predictions
    /// (see [`iadeep_predictor::compose_pairwise`]): the composition of
    /// `task`'s predictions next to each of `corunners`. `None`, the default: the
    /// model does not compose that way, and [`SlowdownModel::predict_extending`] is
    /// never asked.
    ///
    /// Why: a resident is predicted next to the other residents and a newcomer for
    /// every newcomer; the placer keeps this prefix of the pairs among the residents
    /// (with [`SlowdownModel::version`]) and adds only the newcomer's pair.
    fn pairwise_prefix(
        &self,
        _device_kind: &str,
        _task: &TaskProfile,
        _corunners: &[TaskProfile],
    ) -> Option<PairwiseFold> {
        None
    }

    /// `predict(device_kind, task, [corunners…, extra])` from `prefix` =
    /// `pairwise_prefix(device_kind, task, [corunners…])`, with the same result;
    /// `None` when the model cannot (the caller then predicts the whole list).
    fn predict_extending(
        &self,
        _device_kind: &str,
        _task: &TaskProfile,
        _prefix: &PairwiseFold,
        _extra: &TaskProfile,
    ) -> Option<SlowdownEstimate> {
        None
    }
}

/// Estimates the GPU memory of a task.
pub trait MemoryEstimator: Send + Sync + fmt::Debug {
    /// A conservative bound on the task's peak MiB at `batch_size`, from its spec and
    /// latest report (if it runs already), never below what the user asked for; `None`
    /// when nothing is known about its memory.
    fn bound_mib(
        &self,
        spec: &TaskSpec,
        report: Option<&TaskReport>,
        batch_size: u32,
    ) -> Option<u64>;
}

/// The online predictor of `iadeep-predictor` as the policy's slowdown model: its
/// forest once it has enough co-location samples, its transparent cold-start rule
/// before. Predictions never wait for a refit; `observe` feeds the predictor's
/// bounded window and wakes its background refit.
#[derive(Clone, Debug)]
pub struct PredictorSlowdown {
    predictor: Arc<OnlinePredictor>,
}

impl PredictorSlowdown {
    /// Wraps a running predictor (shared, e.g. with an evaluation).
    pub fn new(predictor: Arc<OnlinePredictor>) -> PredictorSlowdown {
        PredictorSlowdown { predictor }
    }

    /// A fresh predictor with the default learner parameters, cold until samples arrive.
    pub fn cold() -> Result<PredictorSlowdown, iadeep_predictor::PredictorError> {
        Ok(PredictorSlowdown::new(Arc::new(OnlinePredictor::new(
            LearnerParams::default(),
        )?)))
    }

    /// The wrapped predictor.
    pub fn predictor(&self) -> &Arc<OnlinePredictor> {
        &self.predictor
    }
}

impl SlowdownModel for PredictorSlowdown {
    fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> SlowdownEstimate {
        self.predictor.predict(device_kind, task, corunners).into()
    }

    fn observe(&self, sample: &CoLocationSample) {
        self.predictor.observe(sample.clone());
    }

    /// The predictor's generation: it swaps its model in before counting it, so a
    /// prediction made after reading generation `g` comes from model `g` or a newer
    /// one, and a newer one is counted (and the reuse dropped) right after.
    fn version(&self) -> Option<u64> {
        Some(self.predictor.generation())
    }

    fn pairwise_prefix(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Option<PairwiseFold> {
        self.predictor.pairwise_prefix(device_kind, task, corunners)
    }

    fn pinned(&self) -> Option<Arc<dyn SlowdownModel>> {
        let (generation, model) = self.predictor.snapshot();
        Some(Arc::new(PinnedPredictor {
            predictor: self.predictor.clone(),
            model,
            generation,
        }))
    }

    fn predict_extending(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        prefix: &PairwiseFold,
        extra: &TaskProfile,
    ) -> Option<SlowdownEstimate> {
        self.predictor
            .predict_extending(device_kind, task, prefix, extra)
            .map(SlowdownEstimate::from)
    }
}

/// One fitted model of a [`PredictorSlowdown`], pinned for a decision
/// ([`SlowdownModel::pinned`]): predictions without the predictor's lock.
#[derive(Debug)]
struct PinnedPredictor {
    /// Where samples still go: pinning a model does not stop learning.
    predictor: Arc<OnlinePredictor>,
    model: Arc<FittedModel>,
    /// The generation read just before `model` (which is that one or newer).
    generation: u64,
}

impl SlowdownModel for PinnedPredictor {
    fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> SlowdownEstimate {
        PredictorModel::predict(&*self.model, device_kind, task, corunners).into()
    }

    fn observe(&self, sample: &CoLocationSample) {
        self.predictor.observe(sample.clone());
    }

    fn version(&self) -> Option<u64> {
        Some(self.generation)
    }

    fn pairwise_prefix(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Option<PairwiseFold> {
        self.model.pairwise_prefix(device_kind, task, corunners)
    }

    fn predict_extending(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        prefix: &PairwiseFold,
        extra: &TaskProfile,
    ) -> Option<SlowdownEstimate> {
        self.model
            .predict_extending(device_kind, task, prefix, extra)
            .map(SlowdownEstimate::from)
    }
}

/// Bounds from the tuner's conservative memory model ([`iadeep_tuner::MemoryModel`]), fitted on
/// what the placer knows of the task: its solo profile (peak memory at its size) and its
/// latest report (the peak at the batch size the agent names with it). Below the smallest
/// measured size the model keeps its bound there (weights and optimiser state do not
/// shrink), above the largest it grows proportionally to the batch with a padding and
/// refuses to guess past 8×. Never below the user's request (`gpu_mem_request_mib`);
/// `None` when nothing is known.
#[derive(Clone, Copy, Debug, Default)]
pub struct ModelledMemory;

impl MemoryEstimator for ModelledMemory {
    fn bound_mib(
        &self,
        spec: &TaskSpec,
        report: Option<&TaskReport>,
        batch_size: u32,
    ) -> Option<u64> {
        let declared = Some(spec.gpu_mem_request_mib).filter(|&m| m > 0);
        let mut samples: Vec<MemorySample> = Vec::with_capacity(2);
        if let Some(p) = &spec.profile
            && let Some(peak) = p.peak_mem_mib
        {
            let batch = if p.batch_size > 0 {
                p.batch_size
            } else {
                spec.initial_batch_size
            };
            samples.push(MemorySample {
                batch_size: batch,
                peak_mib: peak as f64,
            });
        }
        if let Some(r) = report
            && let Some(peak) = r.peak_mem_mib
        {
            let batch = if r.peak_mem_batch_size > 0 {
                r.peak_mem_batch_size
            } else {
                r.batch_size
            };
            samples.push(MemorySample {
                batch_size: batch,
                peak_mib: peak as f64,
            });
        }
        samples.retain(|s| s.batch_size > 0 && s.peak_mib > 0.0);
        let modelled = if samples.is_empty() {
            None
        } else {
            MemoryModel::fit_with(&samples, &[], MemoryModelParams::default())
                .ok()
                .and_then(|m| m.upper_bound_mib(batch_size.max(1)))
                .map(|mib| mib.ceil() as u64)
        };
        [declared, modelled].into_iter().flatten().max()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_proto::SoloProfile;

    /// A pinned model predicts what the live predictor does, names the same
    /// version, and still passes samples on to the predictor.
    #[test]
    fn a_pinned_predictor_is_the_live_one_without_the_lock() {
        let gavel = iadeep_datasets::gavel::GavelThroughputs::bundled().expect("bundled Gavel");
        let worker = gavel.worker("k80").expect("k80 measurements");
        let samples = crate::gavel::samples_from_gavel(worker, "k80").samples;
        let params = LearnerParams {
            forest: iadeep_predictor::ForestParams {
                n_trees: 4,
                ..Default::default()
            },
            ..Default::default()
        };
        let some = samples[0].clone();
        let predictor =
            Arc::new(OnlinePredictor::from_samples(params, samples).expect("fit a forest"));
        let live = PredictorSlowdown::new(predictor.clone());
        let pinned = live.pinned().expect("the predictor pins its model");
        assert_eq!(pinned.version(), live.version());
        let task = some.task.clone().expect("task");
        let co = &some.corunners;
        assert!(!co.is_empty());
        assert_eq!(
            pinned.predict("k80", &task, co),
            live.predict("k80", &task, co)
        );
        let prefix = pinned.pairwise_prefix("k80", &task, co).expect("forest");
        assert_eq!(
            pinned.predict_extending("k80", &task, &prefix, &co[0]),
            live.predict_extending("k80", &task, &prefix, &co[0])
        );
        let observed = predictor.observed();
        pinned.observe(&some);
        assert_eq!(predictor.observed(), observed + 1);
    }

    fn spec(request: u64, profile: Option<(u32, u64)>) -> TaskSpec {
        TaskSpec {
            initial_batch_size: 64,
            min_batch_size: 16,
            max_batch_size: 256,
            gpu_mem_request_mib: request,
            profile: profile.map(|(batch_size, peak)| SoloProfile {
                batch_size,
                peak_mem_mib: Some(peak),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn report(batch_size: u32, peak: u64) -> TaskReport {
        TaskReport {
            batch_size,
            peak_mem_mib: Some(peak),
            peak_mem_batch_size: batch_size,
            ..Default::default()
        }
    }

    #[test]
    fn memory_is_declared_or_modelled_and_never_below_the_request() {
        let m = ModelledMemory;
        assert_eq!(m.bound_mib(&spec(0, None), None, 64), None);
        assert_eq!(m.bound_mib(&spec(4000, None), None, 64), Some(4000));
        // One measured size: it bounds every smaller size (weights do not shrink)...
        assert_eq!(
            m.bound_mib(&spec(0, Some((64, 6000))), None, 16),
            Some(6000)
        );
        assert_eq!(
            m.bound_mib(&spec(7000, Some((64, 6000))), None, 16),
            Some(7000)
        );
        // ... and a larger one grows at least proportionally.
        assert!(
            m.bound_mib(&spec(0, Some((64, 6000))), None, 128)
                .is_some_and(|b| b >= 12_000)
        );
        // Two sizes: the tuner's model, 2000 + 50·b through (64, 5200) and (128, 8400);
        // at the size the task is assigned, 128: 8400 (rounded up).
        let fitted = m
            .bound_mib(&spec(0, Some((64, 5200))), Some(&report(128, 8400)), 128)
            .expect("known");
        assert!((8400..=8401).contains(&fitted), "{fitted}");
        // Below the smallest measured size, its bound there.
        let below = m
            .bound_mib(&spec(0, Some((64, 5200))), Some(&report(128, 8400)), 16)
            .expect("known");
        assert!((5200..=5201).contains(&below), "{below}");
    }

    #[test]
    fn the_predictor_adapter_passes_predictions_through() {
        let model = PredictorSlowdown::cold().expect("predictor");
        let busy = TaskProfile {
            sm_util_pct: Some(90.0),
            mem_bw_util_pct: Some(10.0),
            ..Default::default()
        };
        assert_eq!(model.predict("v100", &busy, &[]).slowdown, 1.0);
        let shared = model.predict("v100", &busy, std::slice::from_ref(&busy));
        let direct = model
            .predictor()
            .predict("v100", &busy, std::slice::from_ref(&busy));
        assert_eq!(
            (shared.slowdown, shared.uncertainty),
            (direct.slowdown, direct.uncertainty)
        );
        assert!(shared.slowdown > 1.0);
    }
}
