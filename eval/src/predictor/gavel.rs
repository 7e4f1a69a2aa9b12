//! Co-location samples from a Gavel throughput file.
//!
//! For every ordered pair (A, B) that ran together on one GPU, A's slowdown is
//! A's solo steps/s ÷ A's co-located steps/s (so each unordered pair gives two
//! samples, one per task). Failed pairs (out of memory) and pairs where a job made
//! no progress are skipped. Gavel gives no utilisations and no memory, so those
//! fields are left unknown (not zero).
//!
//! A profile's `model` is the family (`ResNet-18`), its batch size the job type's
//! (`ResNet-18 (batch size 16)` is family `ResNet-18` at batch size 16), as the
//! simulator and a real agent name them: the sizes of one family are one model at
//! several batch sizes, which is what the unseen-models evaluation holds out.
//!
//! Gavel lists two families without a batch size (A3C, CycleGAN). Their samples use
//! batch size 1: CycleGAN trains with batch size 1, and for A3C a "step" is one
//! update of a worker; samples/s then equals steps/s.

use iadeep_datasets::gavel::{JobType, PairOutcome, WorkerThroughputs};
use iadeep_proto::{CoLocationSample, TaskProfile};

/// What the conversion produced.
#[derive(Debug, Default)]
pub struct GavelSamples {
    pub samples: Vec<CoLocationSample>,
    /// Ordered pairs that failed together (out of memory).
    pub failed: usize,
    /// Ordered pairs skipped for missing solo throughputs or zero progress.
    pub unusable: usize,
}

fn profile(job: &JobType, steps_per_s: f64) -> TaskProfile {
    TaskProfile {
        model: job.family.clone(),
        batch_size: job.batch_size.unwrap_or(1),
        solo_step_time_s: 1.0 / steps_per_s,
        sm_util_pct: None,
        mem_bw_util_pct: None,
        gpu_mem_mib: None,
    }
}

/// The samples of one worker type, labelled with `device_kind`, in file order.
pub fn samples_from_gavel(worker: &WorkerThroughputs, device_kind: &str) -> GavelSamples {
    let mut out = GavelSamples::default();
    for ((first, second), outcome) in &worker.pairs {
        let PairOutcome::Ran {
            first: co_steps, ..
        } = *outcome
        else {
            out.failed += 1;
            continue;
        };
        let (Some(solo_a), Some(solo_b)) = (
            worker.solo_steps_per_s(first),
            worker.solo_steps_per_s(second),
        ) else {
            out.unusable += 1;
            continue;
        };
        if !(co_steps > 0.0 && solo_a > 0.0 && solo_b > 0.0) {
            out.unusable += 1;
            continue;
        }
        out.samples.push(CoLocationSample {
            device_kind: device_kind.to_owned(),
            task: Some(profile(first, solo_a)),
            corunners: vec![profile(second, solo_b)],
            slowdown: solo_a / co_steps,
            ..Default::default()
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use iadeep_datasets::gavel::GavelThroughputs;
    use iadeep_predictor::{LearnerParams, OnlinePredictor, SlowdownModel};

    #[test]
    fn bundled_k80_gives_both_views_of_each_pair() {
        let gavel = GavelThroughputs::bundled().expect("bundled");
        let k80 = gavel.worker("k80").expect("k80");
        let out = samples_from_gavel(k80, "k80");
        assert!(out.samples.len() > 400, "{}", out.samples.len());
        assert!(out.failed > 0);
        for s in &out.samples {
            assert!(s.slowdown.is_finite() && s.slowdown > 0.0);
            iadeep_predictor::validate_sample(s).expect("valid");
        }
        let a = JobType::parse("ResNet-18 (batch size 16)").expect("job");
        let b = JobType::parse("LM (batch size 10)").expect("job");
        let Some(PairOutcome::Ran { first, .. }) = k80.pair(&a, &b) else {
            panic!("pair ran");
        };
        let solo = k80.solo_steps_per_s(&a).expect("solo");
        let s = out
            .samples
            .iter()
            .find(|s| {
                s.task
                    .as_ref()
                    .is_some_and(|t| t.model == "ResNet-18" && t.batch_size == 16)
                    && s.corunners[0].model == "LM"
                    && s.corunners[0].batch_size == 10
            })
            .expect("sample of the pair");
        assert!((s.slowdown - solo / first).abs() < 1e-12);
        assert_eq!(s.task.as_ref().and_then(|t| t.sm_util_pct), None);
    }

    /// A pinned model predicts what the live predictor does, names the same
    /// version, and still passes samples on to the predictor.
    #[test]
    fn a_pinned_predictor_is_the_live_one_without_the_lock() {
        let gavel = iadeep_datasets::gavel::GavelThroughputs::bundled().expect("bundled Gavel");
        let worker = gavel.worker("k80").expect("k80 measurements");
        let samples = samples_from_gavel(worker, "k80").samples;
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
        let live: &dyn SlowdownModel = &*predictor;
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
}
