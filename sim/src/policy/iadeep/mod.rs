//! The iadeep policy and its two ablations, driving the real tuner
//! (`iadeep_tuner`: memory model, PD objective, GP-LCB controller) and predictor
//! (`iadeep_predictor`: learner, profile-feature forest) with what the emulated
//! agents report.
//!
//! Placement is the placer crate's own decision (`iadeep_placer::Placer::decide`,
//! see [`placement`]).
//!
//! - `iadeep`: the placer scoring with the learned predictor, then per-GPU tuning;
//! - `iadeep-no-tuner`: the same placement, batch sizes stay as submitted;
//! - `iadeep-no-predictor`: the placer scoring with a predictor that never learns
//!   (the predictor's cold-start heuristic only), with tuning.

pub mod knowledge;
pub mod placement;
pub mod predictor;
pub mod tuning;

use std::collections::HashMap;
use std::sync::Arc;

use iadeep_proto::CoLocationSample;

use crate::policy::{Admission, Decision, OomAction, Policy, TuneStep};
use crate::view::{ClusterView, Resident, Waiting};
use knowledge::{Knowledge, SoloSource};
use placement::{SharedPredictor, SimPlacement};
use predictor::SimPredictor;
use tuning::{DeviceTuner, Next};

/// Which parts of iadeep are on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Full,
    NoTuner,
    NoPredictor,
}

/// Refit the predictor after this many new co-location samples. The daemons refit
/// every few samples in the background; here refits are synchronous, so they are
/// spaced further apart to keep large simulations fast.
pub const REFIT_EVERY: usize = 25;

/// How a co-location sample's solo step time may have been obtained for the sample to
/// be learned: measured at that batch size, or interpolated between two measured
/// sizes. Extrapolations (mostly the constant-samples-per-second guess from one
/// measurement) are counted but not learned: on tuning seeds 2 and 3 they biased the
/// slowdowns the predictor learned (a step at half the batch size is rarely half as
/// long), and the placement it then made was worse than the cold-start heuristic's.
const ACCEPTED_SOURCES: [SoloSource; 2] = [SoloSource::Measured, SoloSource::Interpolated];

/// iadeep (or an ablation).
#[derive(Debug)]
pub struct Iadeep {
    variant: Variant,
    knowledge: Knowledge,
    /// The predictor the policy learns into; `None` in the no-predictor ablation.
    predictor: Option<Arc<SharedPredictor>>,
    placement: SimPlacement,
    /// The model the placer scores with (the learning predictor, or in the
    /// no-predictor ablation one that never learns), for the audit's sample counts.
    scoring: Arc<SharedPredictor>,
    tuners: HashMap<usize, DeviceTuner>,
    seed: u64,
    searches: u64,
    /// Searches re-opened because the measured Σ PD drifted.
    reopened: u64,
    /// Tasks told to queue: when they ask again (simulated s), and the finish count then.
    holds: HashMap<usize, (f64, u64)>,
    /// Tasks finished so far.
    finished: u64,
    /// Per device, the residents and batch sizes of the last co-location learned from.
    learned: HashMap<usize, Vec<(usize, u32)>>,
    sample_stats: SampleStats,
}

/// Co-location samples given to the predictor, by how the task's solo step time
/// was obtained (see [`knowledge::SoloSource`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SampleStats {
    pub measured: u64,
    pub interpolated: u64,
    pub extrapolated: u64,
    pub proportional: u64,
}

impl SampleStats {
    fn count(&mut self, source: SoloSource) {
        match source {
            SoloSource::Measured => self.measured += 1,
            SoloSource::Interpolated => self.interpolated += 1,
            SoloSource::Extrapolated => self.extrapolated += 1,
            SoloSource::Proportional => self.proportional += 1,
        }
    }

    /// All samples.
    pub fn total(&self) -> u64 {
        self.measured + self.interpolated + self.extrapolated + self.proportional
    }
}

impl Iadeep {
    /// A fresh policy of the given variant.
    pub fn new(variant: Variant, seed: u64) -> crate::Result<Iadeep> {
        let model = Arc::new(SharedPredictor::new(SimPredictor::new(REFIT_EVERY)?));
        // Without the predictor the placer still scores, with a model that is never
        // fed samples: the predictor's cold-start heuristic.
        let predictor = (variant != Variant::NoPredictor).then(|| model.clone());
        Ok(Iadeep {
            variant,
            knowledge: Knowledge::default(),
            predictor,
            placement: SimPlacement::new(model.clone())?,
            scoring: model,
            tuners: HashMap::new(),
            seed,
            searches: 0,
            reopened: 0,
            learned: HashMap::new(),
            holds: HashMap::new(),
            finished: 0,
            sample_stats: SampleStats::default(),
        })
    }

    /// Co-location samples for the predictor from one device's fresh reports: one per
    /// running resident, its slowdown measured against its solo step time at its
    /// current batch size as [`Knowledge::solo_step_estimate`] gives it (measured alone
    /// at that size, or estimated from the sizes it was measured alone at; never the
    /// ground truth). How each solo time was obtained is counted in [`SampleStats`].
    fn learn(&mut self, kind: &str, device: usize, residents: &[Resident<'_>]) {
        let Some(predictor) = self.predictor.as_ref() else {
            return;
        };
        if residents.len() < 2 || residents.iter().any(|r| !r.report.running) {
            return;
        }
        // One sample per co-location and configuration: re-measuring a settled device
        // every interval would flood the window with near-copies of one point.
        let signature: Vec<(usize, u32)> = residents
            .iter()
            .map(|r| (r.spec.id, r.report.batch_size))
            .collect();
        if self.learned.get(&device) == Some(&signature) {
            return;
        }
        self.learned.insert(device, signature);
        for (index, r) in residents.iter().enumerate() {
            let Some(solo) = self
                .knowledge
                .solo_step_estimate(r.spec.id, r.report.batch_size)
            else {
                continue;
            };
            self.sample_stats.count(solo.source);
            if !ACCEPTED_SOURCES.contains(&solo.source) {
                continue;
            }
            let solo = solo.step_s;
            let corunners: Vec<_> = residents
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != index)
                .map(|(_, o)| self.knowledge.profile(o.spec, o.report.batch_size))
                .collect();
            predictor.learn(CoLocationSample {
                device_kind: kind.to_owned(),
                task: Some(self.knowledge.profile(r.spec, r.report.batch_size)),
                corunners,
                slowdown: r.report.step_time_s / solo,
                device_id: format!("gpu-{device}"),
                task_id: format!("task-{}", r.spec.id),
                corunner_task_ids: residents
                    .iter()
                    .filter(|o| o.spec.id != r.spec.id)
                    .map(|o| format!("task-{}", o.spec.id))
                    .collect(),
                ..CoLocationSample::default()
            });
        }
    }
}

impl Policy for Iadeep {
    fn name(&self) -> &str {
        match self.variant {
            Variant::Full => "iadeep",
            Variant::NoTuner => "iadeep-no-tuner",
            Variant::NoPredictor => "iadeep-no-predictor",
        }
    }

    /// A task the placer told to queue asks again once its retry hint has passed, as a
    /// daemon client does, or as soon as a task finished (a device may be free); in
    /// between it keeps waiting without a new decision. Without this, every event
    /// would re-ask every waiting task, and the decisions alone would take minutes.
    fn place(&mut self, view: &dyn ClusterView, task: Waiting<'_>) -> Decision {
        if let Some((retry_at, finished)) = self.holds.get(&task.spec.id)
            && view.now_s() < *retry_at
            && *finished == self.finished
        {
            return Decision::Queue;
        }
        self.knowledge.submit(task.spec);
        let recorded = self.placement.audit.as_ref().map(Vec::len);
        let decision = self.placement.decide(view, task);
        if let Some(audit) = self.placement.audit.as_mut()
            && Some(audit.len()) != recorded
            && let Some(record) = audit.last_mut()
        {
            record.model_samples = self.scoring.model_samples();
            record.samples_seen = self.scoring.counts().0;
        }
        match (decision, self.placement.retry_after) {
            (Decision::Queue, Some(retry)) => {
                self.holds.insert(
                    task.spec.id,
                    (view.now_s() + retry.as_secs_f64(), self.finished),
                );
            }
            _ => {
                self.holds.remove(&task.spec.id);
            }
        }
        decision
    }

    /// The placer decides itself whether a task waits, knowing how many wait ahead of
    /// it, so every waiting task asks, as every client of the daemon does.
    fn admission(&self) -> Admission {
        Admission::EachTask
    }

    fn tunes(&self) -> bool {
        // Without the tuner the rounds still run, to measure co-locations for the predictor.
        true
    }

    fn tune(&mut self, view: &dyn ClusterView, device: usize) -> TuneStep {
        let residents = view.residents(device);
        self.knowledge.ingest(&residents);
        self.learn(view.device_kind(), device, &residents);
        if self.variant == Variant::NoTuner {
            return TuneStep::Done;
        }
        if residents.iter().any(|r| !r.report.running) {
            return TuneStep::Wait;
        }
        let ids: Vec<usize> = residents.iter().map(|r| r.spec.id).collect();
        // A new search when the residents changed (as the daemon starts a new session),
        // or when the measured Σ PD of the settled configuration drifted.
        if self
            .tuners
            .get(&device)
            .is_none_or(|t| t.tasks != ids || t.drifted)
        {
            let seed = self.seed ^ self.searches.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            self.searches += 1;
            match DeviceTuner::new(&residents, &self.knowledge, view.capacity_mib(), seed) {
                Some(tuner) => {
                    self.tuners.insert(device, tuner);
                }
                None => {
                    self.tuners.remove(&device);
                    return TuneStep::Done;
                }
            }
        }
        let Some(tuner) = self.tuners.get_mut(&device) else {
            return TuneStep::Done;
        };
        let reopened = tuner.reopened;
        let next = tuner.round(&residents);
        self.reopened += tuner.reopened - reopened;
        match next {
            Next::Apply(assignments) => TuneStep::Apply(assignments),
            Next::Wait => TuneStep::Wait,
            Next::Done => TuneStep::Done,
        }
    }

    fn on_oom(&mut self, device: usize, task: usize, batch_size: u32) -> OomAction {
        self.knowledge.oom(task, batch_size);
        if let Some(tuner) = self.tuners.get_mut(&device) {
            tuner.oom = true;
        }
        OomAction::RestartHalf
    }

    fn enable_audit(&mut self) {
        self.placement.audit.get_or_insert_with(Vec::new);
    }

    fn take_audit(&mut self) -> Vec<crate::audit::AuditRecord> {
        self.placement
            .audit
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn diagnostics(&self) -> String {
        let (accepted, refits) = self.predictor.as_ref().map_or((0, 0), |p| p.counts());
        let s = &self.sample_stats;
        format!(
            "predictor samples {} (solo time measured {}, interpolated {}, extrapolated {}, \
             proportional {}), accepted {accepted}, refits {refits}; tuning searches {}, \
             re-opened on drift {}",
            s.total(),
            s.measured,
            s.interpolated,
            s.extrapolated,
            s.proportional,
            self.searches,
            self.reopened
        )
    }

    fn on_finish(&mut self, device: usize, task: usize) {
        self.finished += 1;
        self.knowledge.forget(task);
        self.placement.forget(task);
        if self
            .tuners
            .get(&device)
            .is_some_and(|t| t.tasks.contains(&task))
        {
            self.tuners.remove(&device);
        }
    }
}
