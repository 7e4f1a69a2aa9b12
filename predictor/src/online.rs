//! [`OnlinePredictor`]: predictions from the last fitted model, refits in the background.
//!
//! The model lives behind `RwLock<Arc<FittedModel>>`: a prediction holds the read
//! lock only long enough to clone the `Arc`, and the refit thread holds the write
//! lock only to swap in a finished model, so a prediction never waits for a fit.
//! `observe` only validates the sample and pushes it into the window; when a refit
//! is due it wakes the refit thread through a channel of capacity one, so bursts of
//! samples coalesce into one refit on the newest window instead of a queue of stale ones.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use iadeep_proto::{CoLocationSample, TaskProfile};

use crate::Prediction;
use crate::error::PredictorError;
use crate::learner::{
    FittedModel, Learner, LearnerParams, PairwiseFold, ProfileTrainer, SlowdownModel, Trainer,
};

#[derive(Debug)]
struct Shared {
    /// The model predictions use, with the number of samples observed when the
    /// window it was fitted on was taken.
    model: RwLock<(u64, Arc<FittedModel>)>,
    learner: Mutex<Learner>,
    trainer: ProfileTrainer,
    /// Number of models swapped in so far.
    generation: AtomicU64,
}

impl Shared {
    fn learner(&self) -> MutexGuard<'_, Learner> {
        // A panic in another thread while holding the lock leaves a window that is
        // still consistent (pushes are atomic from the window's view), so carry on.
        self.learner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Swaps in `model`, fitted on the window taken when `observed_at_snapshot`
    /// samples had been observed, unless the current model is newer. A background
    /// fit and `refit_now` can overlap and the one that started from the older
    /// window may finish last; installing it would move the model back in time.
    fn install(&self, observed_at_snapshot: u64, model: FittedModel) -> bool {
        let mut current = self.model.write().unwrap_or_else(|e| e.into_inner());
        if current.0 > observed_at_snapshot {
            return false;
        }
        *current = (observed_at_snapshot, Arc::new(model));
        true
    }

    fn refit(&self) -> Result<(), PredictorError> {
        let (observed_at_snapshot, snapshot) = {
            let mut learner = self.learner();
            (learner.observed(), learner.snapshot())
        };
        let started = Instant::now();
        let model = self.trainer.fit(&snapshot)?;
        let n = model.n_samples();
        if !self.install(observed_at_snapshot, model) {
            tracing::debug!(
                samples = n,
                "predictor refit finished after a newer one; discarded"
            );
            return Ok(());
        }
        let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        tracing::debug!(
            samples = n,
            generation,
            elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
            "predictor refitted"
        );
        Ok(())
    }
}

/// The online co-location predictor.
#[derive(Debug)]
pub struct OnlinePredictor {
    shared: Arc<Shared>,
    /// The refit thread's wake-up channel. Held here alone (models pinned from this
    /// predictor hold a `Weak`), so dropping the predictor closes it and ends the thread.
    wake: Option<Arc<SyncSender<()>>>,
    worker: Option<JoinHandle<()>>,
}

impl OnlinePredictor {
    /// A predictor with no samples (cold start) and its refit thread.
    pub fn new(params: LearnerParams) -> Result<OnlinePredictor, PredictorError> {
        let learner = Learner::new(params.clone())?;
        let shared = Arc::new(Shared {
            model: RwLock::new((0, Arc::new(FittedModel::ColdStart))),
            learner: Mutex::new(learner),
            trainer: ProfileTrainer { params },
            generation: AtomicU64::new(0),
        });
        let (wake, rx) = mpsc::sync_channel::<()>(1);
        let worker_shared = Arc::clone(&shared);
        let worker = std::thread::Builder::new()
            .name("iadeep-predictor-refit".into())
            .spawn(move || {
                // Ends when the predictor is dropped (the sender goes away).
                while rx.recv().is_ok() {
                    if let Err(err) = worker_shared.refit() {
                        tracing::warn!(error = %err, "predictor refit failed; keeping the previous model");
                    }
                }
            })
            .map_err(PredictorError::Thread)?;
        Ok(OnlinePredictor {
            shared,
            wake: Some(Arc::new(wake)),
            worker: Some(worker),
        })
    }

    /// A predictor that has learned `samples` in order and fitted on them before
    /// returning (used after a restart, on the samples the store kept:
    /// `iadeep_state::load_samples`). Invalid samples are skipped with a warning.
    pub fn from_samples(
        params: LearnerParams,
        samples: impl IntoIterator<Item = CoLocationSample>,
    ) -> Result<OnlinePredictor, PredictorError> {
        let predictor = OnlinePredictor::new(params)?;
        {
            let mut learner = predictor.shared.learner();
            let mut skipped = 0usize;
            for sample in samples {
                if let Err(err) = learner.observe(sample) {
                    skipped += 1;
                    tracing::warn!(error = %err, "skipping a stored sample");
                }
            }
            tracing::info!(
                samples = learner.observed(),
                skipped,
                window = learner.window_len(),
                "predictor rebuilt from samples"
            );
        }
        predictor.refit_now()?;
        Ok(predictor)
    }

    /// Predicted slowdown of `task` on a `device_kind` GPU shared with `corunners`.
    ///
    /// Uses the last fitted model; never waits for a refit.
    pub fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Prediction {
        self.current().predict(device_kind, task, corunners)
    }

    /// The generation and the last fitted model, to predict from one model for a
    /// while without taking the lock for every prediction (the placer asks ~200
    /// per decision, from several threads at once). The generation is read first,
    /// so the model is that generation's or a newer one.
    pub fn snapshot(&self) -> (u64, Arc<FittedModel>) {
        let generation = self.generation();
        (generation, self.current())
    }

    fn current(&self) -> Arc<FittedModel> {
        Arc::clone(
            &self
                .shared
                .model
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .1,
        )
    }

    /// Learns from one measured co-location. Cheap: the refit, when due, runs in
    /// the background. An invalid sample is dropped with a warning.
    pub fn observe(&self, sample: CoLocationSample) {
        observe_into(&self.shared, self.wake.as_deref(), sample);
    }

    /// Fits on the current window now, on the caller's thread, and swaps the model in.
    pub fn refit_now(&self) -> Result<(), PredictorError> {
        self.shared.refit()
    }

    /// Number of models fitted so far (grows with each background or explicit refit).
    pub fn generation(&self) -> u64 {
        self.shared.generation.load(Ordering::Acquire)
    }

    /// Waits until at least `generation` models have been fitted or `timeout` passes;
    /// returns whether it got there. For tests and tools, never on the predict path.
    pub fn wait_for_generation(&self, generation: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.generation() < generation {
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        true
    }

    /// Number of samples the current model was fitted on.
    pub fn model_samples(&self) -> usize {
        self.shared
            .model
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .1
            .n_samples()
    }

    /// Valid samples observed since creation.
    pub fn observed(&self) -> u64 {
        self.shared.learner().observed()
    }
}

/// Feeds one sample to the learner and wakes the refit thread when a refit is due: what
/// [`OnlinePredictor::observe`] and a model pinned from it ([`SlowdownModel::pinned`]) do.
fn observe_into(shared: &Shared, wake: Option<&SyncSender<()>>, sample: CoLocationSample) {
    let due = match shared.learner().observe(sample) {
        Ok(due) => due,
        Err(err) => {
            tracing::warn!(error = %err, "predictor ignored a sample");
            return;
        }
    };
    if due && let Some(wake) = wake {
        match wake.try_send(()) {
            // Full: a refit is already pending and will see this sample too.
            Ok(()) | Err(TrySendError::Full(())) => {}
            Err(TrySendError::Disconnected(())) => {
                tracing::error!("predictor refit thread is gone; the model will not be updated");
            }
        }
    }
}

/// The online predictor as the placer's slowdown model: its forest once it has enough
/// co-location samples, its transparent cold-start rule before. Predictions never wait
/// for a refit; `observe` feeds the bounded window and wakes the background refit.
impl SlowdownModel for OnlinePredictor {
    fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Prediction {
        OnlinePredictor::predict(self, device_kind, task, corunners)
    }

    fn observe(&self, sample: &CoLocationSample) {
        OnlinePredictor::observe(self, sample.clone());
    }

    /// The generation: the predictor swaps its model in before counting it, so a
    /// prediction made after reading generation `g` comes from model `g` or a newer
    /// one, and a newer one is counted (and the reuse dropped) right after.
    fn version(&self) -> Option<u64> {
        Some(self.generation())
    }

    fn pinned(&self) -> Option<Arc<dyn SlowdownModel>> {
        let (generation, model) = self.snapshot();
        Some(Arc::new(PinnedModel {
            shared: Arc::clone(&self.shared),
            wake: self.wake.as_ref().map_or_else(Weak::new, Arc::downgrade),
            model,
            generation,
        }))
    }

    fn pairwise_prefix(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Option<PairwiseFold> {
        self.current().pairwise_prefix(device_kind, task, corunners)
    }

    fn predict_extending(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        prefix: &PairwiseFold,
        extra: &TaskProfile,
    ) -> Option<Prediction> {
        self.current()
            .predict_extending(device_kind, task, prefix, extra)
    }
}

/// One fitted model of an [`OnlinePredictor`], pinned for a decision
/// ([`SlowdownModel::pinned`]): predictions without the predictor's lock.
#[derive(Debug)]
struct PinnedModel {
    /// Where samples still go: pinning a model does not stop learning.
    shared: Arc<Shared>,
    /// Wakes the refit thread while the predictor lives; never keeps it alive.
    wake: Weak<SyncSender<()>>,
    model: Arc<FittedModel>,
    /// The generation read just before `model` (which is that one or newer).
    generation: u64,
}

impl SlowdownModel for PinnedModel {
    fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Prediction {
        self.model.predict(device_kind, task, corunners)
    }

    fn observe(&self, sample: &CoLocationSample) {
        let wake = self.wake.upgrade();
        observe_into(&self.shared, wake.as_deref(), sample.clone());
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
    ) -> Option<Prediction> {
        self.model
            .predict_extending(device_kind, task, prefix, extra)
    }
}

impl Drop for OnlinePredictor {
    fn drop(&mut self) {
        // Closing the channel ends the refit loop; wait so no thread outlives us.
        self.wake.take();
        if let Some(worker) = self.worker.take()
            && worker.join().is_err()
        {
            tracing::error!("predictor refit thread panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PredictionSource;

    /// A model pinned from the predictor does not keep its refit thread alive: dropping
    /// the predictor returns (it joins the thread) while the pinned model lives, and the
    /// pinned model still answers from its fit.
    #[test]
    fn dropping_the_predictor_while_a_pinned_model_lives_returns() {
        let predictor = OnlinePredictor::new(LearnerParams::default()).expect("predictor");
        let pinned = SlowdownModel::pinned(&predictor).expect("the predictor pins");
        drop(predictor);
        let task = TaskProfile::default();
        assert_eq!(pinned.predict("v100", &task, &[]).slowdown, 1.0);
        pinned.observe(&sample(1));
    }

    /// Through the trait (as the placer asks) the predictor answers what it answers
    /// directly; alone a task is not slowed.
    #[test]
    fn the_trait_passes_predictions_through() {
        let predictor = OnlinePredictor::new(LearnerParams::default()).expect("predictor");
        let model: &dyn SlowdownModel = &predictor;
        let busy = TaskProfile {
            sm_util_pct: Some(90.0),
            mem_bw_util_pct: Some(10.0),
            ..Default::default()
        };
        assert_eq!(model.predict("v100", &busy, &[]).slowdown, 1.0);
        let shared = model.predict("v100", &busy, std::slice::from_ref(&busy));
        let direct = predictor.predict("v100", &busy, std::slice::from_ref(&busy));
        assert_eq!(shared, direct);
        assert!(shared.slowdown > 1.0);
        assert_eq!(model.version(), Some(predictor.generation()));
    }

    fn sample(i: u32) -> CoLocationSample {
        let step = 0.05 * f64::from(i % 10 + 1);
        let p = |m: &str, s| TaskProfile {
            model: m.into(),
            batch_size: 32,
            solo_step_time_s: s,
            ..Default::default()
        };
        CoLocationSample {
            device_kind: "p100".into(),
            task: Some(p("a", step)),
            corunners: vec![p("b", 0.3)],
            slowdown: 1.0 + 0.3 / (step + 0.3),
            ..Default::default()
        }
    }

    #[test]
    fn a_fit_of_an_older_window_never_replaces_a_newer_model() {
        let predictor = OnlinePredictor::new(LearnerParams::default()).expect("new");
        for i in 0..60 {
            predictor.observe(sample(i));
        }
        predictor.refit_now().expect("refit");
        let newest = predictor.model_samples();
        assert_eq!(newest, 60);
        // A fit that started when only 20 samples had been seen finishes now.
        let stale = predictor
            .shared
            .trainer
            .fit(&(0..20).map(|i| Arc::new(sample(i))).collect::<Vec<_>>())
            .expect("fit");
        assert!(!predictor.shared.install(20, stale));
        assert_eq!(predictor.model_samples(), newest);
    }

    #[test]
    fn refits_in_the_background_and_switches_from_cold_start() {
        let predictor = OnlinePredictor::new(LearnerParams::default()).expect("new");
        let probe = sample(3);
        let task = probe.task.clone().expect("task");
        assert_eq!(
            predictor.predict("p100", &task, &probe.corunners).source,
            PredictionSource::ColdStart
        );
        for i in 0..40 {
            predictor.observe(sample(i));
        }
        assert!(predictor.wait_for_generation(1, Duration::from_secs(30)));
        // The last refit may still be running; wait until it has all 40 samples.
        let deadline = Instant::now() + Duration::from_secs(30);
        while predictor.model_samples() < 40 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let p = predictor.predict("p100", &task, &probe.corunners);
        assert_eq!(p.source, PredictionSource::Model);
        assert!(
            (p.slowdown - probe.slowdown).abs() < 0.05,
            "{p:?} vs {}",
            probe.slowdown
        );
        assert!(p.uncertainty.is_finite() && p.uncertainty >= 0.0);
    }

    #[test]
    fn rebuilt_predictor_matches_the_live_one() {
        let samples: Vec<_> = (0..60).map(sample).collect();
        let live = OnlinePredictor::new(LearnerParams::default()).expect("new");
        for s in samples.clone() {
            live.observe(s);
        }
        live.refit_now().expect("refit");
        let rebuilt =
            OnlinePredictor::from_samples(LearnerParams::default(), samples).expect("rebuild");
        for i in 0..10 {
            let s = sample(i * 7 + 1);
            let task = s.task.expect("task");
            assert_eq!(
                live.predict("p100", &task, &s.corunners),
                rebuilt.predict("p100", &task, &s.corunners)
            );
        }
    }

    #[test]
    fn invalid_samples_are_ignored() {
        let predictor = OnlinePredictor::new(LearnerParams::default()).expect("new");
        let mut bad = sample(1);
        bad.slowdown = f64::INFINITY;
        predictor.observe(bad);
        assert_eq!(predictor.observed(), 0);
    }
}
