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

use crate::policy::{Decision, OomAction, Policy, TuneStep};
use crate::view::{ClusterView, Resident, Waiting};
use knowledge::Knowledge;
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

/// iadeep (or an ablation).
#[derive(Debug)]
pub struct Iadeep {
    variant: Variant,
    knowledge: Knowledge,
    /// The predictor the policy learns into; `None` in the no-predictor ablation.
    predictor: Option<Arc<SharedPredictor>>,
    placement: SimPlacement,
    tuners: HashMap<usize, DeviceTuner>,
    seed: u64,
    searches: u64,
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
            placement: SimPlacement::new(model)?,
            tuners: HashMap::new(),
            seed,
            searches: 0,
        })
    }

    /// Co-location samples for the predictor from one device's fresh reports: each
    /// running resident whose solo step time at its current batch size is known.
    fn learn(&mut self, kind: &str, device: usize, residents: &[Resident<'_>]) {
        let Some(predictor) = self.predictor.as_ref() else {
            return;
        };
        if residents.len() < 2 || residents.iter().any(|r| !r.report.running) {
            return;
        }
        for (index, r) in residents.iter().enumerate() {
            let Some(solo) = self.knowledge.solo_step_s(r.spec.id, r.report.batch_size) else {
                continue;
            };
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

    fn place(&mut self, view: &dyn ClusterView, task: Waiting<'_>) -> Decision {
        self.knowledge.submit(task.spec);
        self.placement.decide(view, task)
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
        if self.tuners.get(&device).is_none_or(|t| t.tasks != ids) {
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
        match tuner.round(&residents) {
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

    fn on_finish(&mut self, device: usize, task: usize) {
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
