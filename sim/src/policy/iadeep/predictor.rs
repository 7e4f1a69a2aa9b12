//! The predictor as the simulator drives it: the same [`Learner`] (window, cadence, with
//! production's `LearnerParams::default()`) and [`ProfileTrainer`] (profile-feature
//! forest, cold-start heuristic) that `OnlinePredictor` runs, but refitted synchronously
//! when a refit is due, so a run does not depend on thread timing and the same seed gives
//! the same numbers.

use std::collections::HashMap;
use std::sync::Arc;

use iadeep_predictor::Prediction;
use iadeep_predictor::{
    FittedModel, Learner, LearnerParams, ProfileTrainer, SlowdownModel, Trainer,
};
use iadeep_proto::{CoLocationSample, TaskProfile};

/// Synchronous online predictor.
#[derive(Debug)]
pub struct SimPredictor {
    learner: Learner,
    trainer: ProfileTrainer,
    model: Arc<FittedModel>,
    pub refits: u64,
    pub samples: u64,
    /// Predictions of the current model, by their exact inputs: the placer asks the
    /// same questions over and over (every waiting task, every device, at every event)
    /// while the model changes only at a refit, and a forest prediction costs
    /// microseconds. Emptied at each refit, so an answer is always the current model's.
    memo: HashMap<PredictionKey, Prediction>,
    /// Model names and device kinds as small numbers, so a memo key is all integers
    /// (building and comparing keys of strings cost more than the lookups saved).
    names: HashMap<String, u32>,
}

/// A profile's fields exactly (the model's name by its number, floats by their bits),
/// so equal keys mean equal inputs.
type ProfileKey = (u32, u32, u64, Option<u64>, Option<u64>, Option<u64>);
type PredictionKey = (u32, ProfileKey, Vec<ProfileKey>);

/// Beyond this many memoised predictions the memo starts again (bounds its memory should
/// a model go long without a refit, e.g. while the learner refuses samples).
const MEMO_CAPACITY: usize = 1 << 20;

/// The number of `name` in `names`, given the next free one when new.
fn name_id(names: &mut HashMap<String, u32>, name: &str) -> u32 {
    if let Some(id) = names.get(name) {
        return *id;
    }
    let id = names.len() as u32;
    names.insert(name.to_owned(), id);
    id
}

fn profile_key(names: &mut HashMap<String, u32>, p: &TaskProfile) -> ProfileKey {
    (
        name_id(names, &p.model),
        p.batch_size,
        p.solo_step_time_s.to_bits(),
        p.sm_util_pct.map(f64::to_bits),
        p.mem_bw_util_pct.map(f64::to_bits),
        p.gpu_mem_mib,
    )
}

impl SimPredictor {
    /// A cold predictor with production's parameters.
    pub fn new() -> crate::Result<SimPredictor> {
        let params = LearnerParams::default();
        let learner = Learner::new(params.clone()).map_err(|e| crate::SimError::Policy {
            policy: "iadeep".into(),
            reason: format!("predictor parameters: {e}"),
        })?;
        Ok(SimPredictor {
            learner,
            trainer: ProfileTrainer { params },
            model: Arc::new(FittedModel::ColdStart),
            refits: 0,
            samples: 0,
            memo: HashMap::new(),
            names: HashMap::new(),
        })
    }

    /// Samples the current model was fitted on (0 while it is the cold-start heuristic).
    pub fn model_samples(&self) -> usize {
        self.model.n_samples()
    }

    /// Predicted slowdown of `task` next to `corunners` on a `kind` GPU: exactly what
    /// the current model says, remembered until the next refit (see `memo`).
    pub fn predict(
        &mut self,
        kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Prediction {
        let names = &mut self.names;
        let key = (
            name_id(names, kind),
            profile_key(names, task),
            corunners.iter().map(|c| profile_key(names, c)).collect(),
        );
        if let Some(hit) = self.memo.get(&key) {
            return *hit;
        }
        let fresh = self.model.predict(kind, task, corunners);
        if self.memo.len() >= MEMO_CAPACITY {
            self.memo.clear();
        }
        self.memo.insert(key, fresh);
        fresh
    }

    /// Learns one measured co-location; refits when the learner's cadence says so.
    pub fn observe(&mut self, sample: CoLocationSample) {
        match self.learner.observe(sample) {
            Ok(true) => {
                let snapshot = self.learner.snapshot();
                match self.trainer.fit(&snapshot) {
                    Ok(model) => {
                        self.model = Arc::new(model);
                        self.memo.clear();
                        self.refits += 1;
                    }
                    Err(err) => {
                        tracing::warn!(%err, "predictor refit failed; keeping the previous model")
                    }
                }
                self.samples += 1;
            }
            Ok(_) => self.samples += 1,
            Err(err) => tracing::debug!(%err, "co-location sample refused"),
        }
    }
}
