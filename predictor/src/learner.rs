//! The synchronous core shared by production and the evaluation: validate a sample,
//! keep it in the window, say when a refit is due, fit a model from a snapshot.
//!
//! [`crate::OnlinePredictor`] runs [`Trainer::fit`] on a background thread;
//! [`crate::prequential`] runs it inline at exactly the same cadence, so the
//! evaluation measures the production schedule without thread timing noise.

use std::collections::HashSet;
use std::sync::Arc;

use iadeep_proto::{CoLocationSample, TaskProfile};
use prost::Message;

use crate::calibration::Calibration;
use crate::effects::JobEffects;
use crate::error::PredictorError;
use crate::features::{
    N_FEATURES, base_columns, feature_row, feature_row_into, mask_speed_dependent,
};
use crate::forest::{Forest, ForestParams};
use crate::heuristic;
use crate::linear::Ridge;
use crate::window::{Window, stable_hash};
use crate::{Prediction, PredictionSource};

/// Default of [`LearnerParams::target_floor`].
pub const DEFAULT_TARGET_FLOOR: f64 = 0.8;
/// Least excess over the floor a sample is learned with (keeps the log finite).
pub const MIN_EXCESS: f64 = 0.05;

fn default_target_floor() -> f64 {
    DEFAULT_TARGET_FLOOR
}

/// How the online model learns.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LearnerParams {
    /// Refit after this many new samples ("every few new samples").
    pub refit_every: usize,
    /// Below this many samples in the window the cold-start heuristic answers.
    pub min_samples: usize,
    /// Most recent samples kept in the window.
    pub newest: usize,
    /// Older samples kept beside them for diversity (see `window.rs`).
    pub reservoir: usize,
    /// Fit on ln(slowdown − `target_floor`) instead of the slowdown: errors are then
    /// relative (what MAPE and the placer's ratios care about), and a few extreme
    /// slowdowns do not dominate the squared-error splits.
    pub log_target: bool,
    /// Floor under the slowdown for the log target. A slowdown is at least 1 by
    /// physics (sharing never speeds a task up), so what varies multiplicatively
    /// between pairings is the excess over a floor, not the whole slowdown: with a
    /// floor of 0 a light pairing (1.05) and a heavy one (3.0) differ by a factor 3 in
    /// the model's unit, with 0.8 by a factor 9, which lets the linear base and the
    /// per-job effects model the excess additively. A fit lowers it, for its window,
    /// to `MIN_EXCESS` (0.05) under the smallest slowdown there, so data with slowdowns
    /// below 1 (measurement noise, or a task that runs faster shared) is learned as
    /// it is rather than clamped. Chosen on the K80 samples (see
    /// docs/predictor-experiments.md, "Target floor").
    #[serde(default = "default_target_floor")]
    pub target_floor: f64,
    /// Ridge penalty of the linear base model on the profile features (see
    /// `linear.rs`); `None` leaves the base out. A stiff line generalises
    /// better to models never seen (chosen on the K80 samples, see
    /// docs/predictor-experiments.md, "Ridge penalty").
    #[serde(default)]
    pub ridge_lambda: Option<f64>,
    /// Shrinkage prior, in samples, of the per-job effects (see `effects.rs`):
    /// a job seen `n` times gets `n / (n + prior)` of its mean residual. `None`
    /// leaves the effects out (profile features only). Selected on tuning seeds (see
    /// docs/predictor-experiments.md, "How the defaults were chosen").
    #[serde(default)]
    pub job_effects_prior: Option<f64>,
    /// Shrinkage prior, in samples, of the per-family level of the effects (see
    /// `effects.rs`): every batch size of a model shares its family's effect, each
    /// job's own effect is shrunk towards it by `job_effects_prior`, and the
    /// family's towards 0, the population. A job seen at a new batch size starts
    /// from its family's effect rather than from nothing. `None`: one level.
    /// Chosen on the K80 samples' MAPE (1, with `job_effects_prior` 3) but not the
    /// default: the simulator on the K80 completed jobs no sooner with it
    /// (docs/predictor-experiments.md, "Checked in the simulator").
    #[serde(default)]
    pub family_effects_prior: Option<f64>,
    /// Whether the model leaves out the columns that depend on the GPU's speed
    /// (absolute step times and samples per second, see
    /// `features::SPEED_DEPENDENT`), keeping batch sizes, utilisations, memory and
    /// the task-to-co-runner ratios, which mean the same on any card.
    #[serde(default)]
    pub speed_free: bool,
    /// Which columns the linear base is fitted on.
    #[serde(default)]
    pub base_features: BaseFeatures,
    /// Whether the forest's correction applies to a task whose model the window has
    /// never seen (as task or co-runner). The forest learns what the base and the
    /// effects leave of the jobs seen, mostly their own quirks, keyed by their step
    /// times; for a new model that is another model's quirk.
    #[serde(default = "yes")]
    pub forest_on_new_models: bool,
    /// From this many samples (at least 1) below `min_samples`, fit the model
    /// anyway rather than answer with the cold-start rule: the ridge base's
    /// intercept is the window's typical slowdown and the co-runner effects
    /// (aggressiveness) are what transfers to a model never seen, both useful from
    /// the first few samples, while the rule knows only the utilisations. Too few
    /// residuals calibrate no band then, so the interval is the rule's stated width
    /// (`heuristic::RELATIVE_UNCERTAINTY`) around the model's slowdown. `None`: the
    /// rule answers until `min_samples`. Searched on the tuning seeds
    /// (docs/predictor-experiments.md, "Transfer to models never seen").
    #[serde(default)]
    pub early_model_from: Option<usize>,
    /// The forest.
    pub forest: ForestParams,
}

fn yes() -> bool {
    true
}

/// The columns of the linear base.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BaseFeatures {
    /// Every column but [`crate::features::NOT_IN_BASE`]: those on a scale shared
    /// by all models.
    #[default]
    Generalising,
    /// Every feature.
    All,
}

impl Default for LearnerParams {
    fn default() -> Self {
        LearnerParams {
            refit_every: 5,
            min_samples: 20,
            newest: 512,
            reservoir: 512,
            log_target: true,
            target_floor: DEFAULT_TARGET_FLOOR,
            ridge_lambda: Some(1.0),
            job_effects_prior: Some(1.0),
            family_effects_prior: None,
            speed_free: false,
            base_features: BaseFeatures::default(),
            forest_on_new_models: true,
            early_model_from: None,
            forest: ForestParams::default(),
        }
    }
}

impl LearnerParams {
    /// The fewest samples our model is fitted on: [`LearnerParams::early_model_from`]
    /// if set (never above `min_samples`), else `min_samples`. The calibration's
    /// held-out fits (`new_model_residuals`) take the same bound, since a model
    /// fitted on that many samples is what a new model would be predicted by.
    pub fn model_from(&self) -> usize {
        match self.early_model_from {
            Some(early) => early.clamp(1, self.min_samples),
            None => self.min_samples,
        }
    }

    /// Checks the parameters.
    pub fn check(&self) -> Result<(), PredictorError> {
        let bad = |name, reason: &str| {
            Err(PredictorError::InvalidParam {
                name,
                reason: reason.into(),
            })
        };
        if self.refit_every == 0 {
            return bad("refit_every", "must be at least 1");
        }
        if self.min_samples == 0 {
            return bad("min_samples", "must be at least 1");
        }
        if self.newest == 0 {
            return bad("newest", "must be at least 1");
        }
        if self.min_samples > self.newest + self.reservoir {
            return bad(
                "min_samples",
                "must not exceed the window size (newest + reservoir)",
            );
        }
        if !(self.target_floor.is_finite() && (0.0..1.0).contains(&self.target_floor)) {
            return bad(
                "target_floor",
                "must be in [0, 1): a slowdown is at least 1",
            );
        }
        if let Some(lambda) = self.ridge_lambda
            && !(lambda.is_finite() && lambda > 0.0)
        {
            return bad("ridge_lambda", "must be a positive number");
        }
        if let Some(prior) = self.job_effects_prior
            && !(prior.is_finite() && prior >= 0.0)
        {
            return bad("job_effects_prior", "must be a non-negative number");
        }
        if let Some(prior) = self.family_effects_prior
            && !(prior.is_finite() && prior >= 0.0)
        {
            return bad("family_effects_prior", "must be a non-negative number");
        }
        if self.early_model_from == Some(0) {
            return bad("early_model_from", "must be at least 1");
        }
        self.forest.check()
    }
}

/// Checks that a sample can be learned from.
pub fn validate_sample(sample: &CoLocationSample) -> Result<(), PredictorError> {
    let bad = |reason: String| Err(PredictorError::InvalidSample(reason));
    let Some(task) = sample.task.as_ref() else {
        return bad("no task profile".into());
    };
    for (who, p) in
        std::iter::once(("task", task)).chain(sample.corunners.iter().map(|c| ("co-runner", c)))
    {
        if !(p.solo_step_time_s.is_finite() && p.solo_step_time_s > 0.0) {
            return bad(format!(
                "{who} {:?}: solo_step_time_s must be a positive number, got {}",
                p.model, p.solo_step_time_s
            ));
        }
        if p.batch_size == 0 {
            return bad(format!("{who} {:?}: batch_size must be positive", p.model));
        }
    }
    if !(sample.slowdown.is_finite() && sample.slowdown > 0.0) {
        return bad(format!(
            "slowdown must be a positive number, got {}",
            sample.slowdown
        ));
    }
    Ok(())
}

/// Predicts how much a task slows down next to co-runners: what a [`Trainer`] produces,
/// what the placer's decision asks, and what the evaluation's baselines and the
/// simulator's oracle implement. The placer must not care *how* a slowdown is
/// estimated; the optional methods let a model that can do better say so.
pub trait SlowdownModel: Send + Sync + std::fmt::Debug {
    /// IF of `task` on a device of `device_kind` shared with `corunners` (an empty slice
    /// means "alone", which must give 1.0).
    fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Prediction;

    /// Learns from a measured co-location. Models that do not learn ignore it; the
    /// placer's daemon feeds every sample the tuners write here.
    fn observe(&self, _sample: &CoLocationSample) {}

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
    /// concurrent decisions on different cores those counters bounce between caches.
    /// A pinned model also gives predictions and [`SlowdownModel::version`] from the
    /// same fit.
    fn pinned(&self) -> Option<Arc<dyn SlowdownModel>> {
        None
    }

    /// For a model that composes several co-runners from one-co-runner predictions
    /// (see [`compose_pairwise`]): the composition of `task`'s predictions next to each
    /// of `corunners`. `None`, the default: the model does not compose that way, and
    /// [`SlowdownModel::predict_extending`] is never asked.
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
    ) -> Option<Prediction> {
        None
    }
}

/// Fits a model from the samples of a window.
pub trait Trainer: Send + Sync + std::fmt::Debug {
    type Model: SlowdownModel;
    /// The model to use before any fit.
    fn initial(&self) -> Self::Model;
    fn fit(&self, samples: &[Arc<CoLocationSample>]) -> Result<Self::Model, PredictorError>;
}

/// Our model, or the heuristic before enough samples.
///
/// Fitted in three stages on the target (see [`LearnerParams::log_target`]), each
/// on what the previous ones leave: a ridge line on the profile features that mean
/// the same for every model (the additive part, learnable from few samples and
/// valid for models never seen), per-job effects of jobs seen before
/// (`effects.rs`), and the forest on the profile features for the
/// interactions. The forest's spread across trees is the uncertainty; the 90 %
/// interval is calibrated (`calibration.rs`).
#[derive(Debug)]
pub enum FittedModel {
    /// Not enough samples yet: every prediction comes from [`crate::cold_start_prediction`].
    ColdStart,
    /// A model fitted on samples.
    Forest(Box<Staged>),
}

/// The stages of a fitted model (see [`FittedModel`]).
#[derive(Debug)]
pub struct Staged {
    n_samples: usize,
    target: Target,
    /// Linear base the rest corrects.
    base: Option<Ridge>,
    /// Per-job effects added to the base (fitted on its residuals).
    effects: Option<JobEffects>,
    /// Fitted on what the base and the effects leave.
    forest: Forest,
    /// The models (by [`model_key`]) in the window, as task or co-runner.
    known_models: HashSet<u64>,
    /// [`LearnerParams::forest_on_new_models`].
    forest_on_new_models: bool,
    /// [`LearnerParams::speed_free`].
    speed_free: bool,
    calibration: Calibration,
    /// Fitted on fewer than [`LearnerParams::min_samples`] samples
    /// ([`LearnerParams::early_model_from`]): an interval without a band takes the
    /// cold-start rule's stated width, not the trees' spread over a handful of rows.
    early: bool,
}

/// The unit the stages are fitted in (see [`LearnerParams::log_target`]).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Target {
    log: bool,
    floor: f64,
}

impl Target {
    /// The unit for a window of `samples`: the floor is
    /// [`LearnerParams::target_floor`] or lower, so that every slowdown in the window
    /// lies at least [`MIN_EXCESS`] above it (data with slowdowns far below 1 would
    /// otherwise all be learned as one value).
    fn for_window(params: &LearnerParams, samples: &[Arc<CoLocationSample>]) -> Target {
        let least = samples
            .iter()
            .map(|s| s.slowdown)
            .fold(f64::INFINITY, f64::min);
        Target {
            log: params.log_target,
            floor: params.target_floor.min(least - MIN_EXCESS).max(0.0),
        }
    }

    /// A slowdown in the model's unit.
    fn encode(&self, slowdown: f64) -> f64 {
        if self.log {
            (slowdown - self.floor).max(MIN_EXCESS).ln()
        } else {
            slowdown
        }
    }

    /// The slowdown and its spread of a value `mean` ± `sd` in the model's unit.
    fn decode(&self, mean: f64, sd: f64) -> (f64, f64) {
        if self.log {
            // Delta method: sd of exp(X) ≈ exp(mean) · sd(X).
            (self.floor + mean.exp(), mean.exp() * sd)
        } else {
            (mean, sd)
        }
    }
}

/// A model name's key in [`Staged::known_models`].
fn model_key(model: &str) -> u64 {
    stable_hash(model.as_bytes())
}

/// Groups of models whose samples the new-model residuals leave out together
/// (see [`crate::calibration`]): enough that each model fitted for them still sees
/// most models, few enough to cost a handful of small fits per refit.
const CALIBRATION_GROUPS: usize = 4;
/// Most trees of the forests fitted for the new-model residuals: they only need a
/// mean, not a spread.
const CALIBRATION_TREES: usize = 8;

/// The samples of a window as the stages see them.
struct Rows {
    target: Target,
    samples: Vec<Arc<CoLocationSample>>,
    rows: Vec<Vec<f64>>,
    /// In the model's unit.
    targets: Vec<f64>,
}

impl Rows {
    fn of(samples: &[Arc<CoLocationSample>], target: Target, speed_free: bool) -> Rows {
        let mut kept = Rows {
            target,
            samples: Vec::with_capacity(samples.len()),
            rows: Vec::with_capacity(samples.len()),
            targets: Vec::with_capacity(samples.len()),
        };
        for s in samples {
            let Some(task) = s.task.as_ref() else {
                continue;
            };
            kept.samples.push(Arc::clone(s));
            let mut row = feature_row(&s.device_kind, task, &s.corunners);
            if speed_free {
                mask_speed_dependent(&mut row);
            }
            kept.rows.push(row);
            kept.targets.push(target.encode(s.slowdown));
        }
        kept
    }
}

impl Staged {
    /// Fits the stages on `rows` with `forest` parameters; with `calibrate`, also
    /// the calibration (which fits further, smaller models), else none.
    fn fit(
        rows: &Rows,
        params: &LearnerParams,
        forest_params: &ForestParams,
        calibrate: bool,
    ) -> Result<Staged, PredictorError> {
        let target = rows.target;
        let mut residuals = rows.targets.clone();
        let base = match params.ridge_lambda {
            Some(lambda) => {
                let columns = match params.base_features {
                    BaseFeatures::Generalising => base_columns(params.speed_free),
                    BaseFeatures::All => (0..N_FEATURES).collect(),
                };
                let base = Ridge::fit(&rows.rows, &residuals, lambda, &columns)?;
                for (t, r) in residuals.iter_mut().zip(&rows.rows) {
                    *t -= base.predict(r);
                }
                Some(base)
            }
            None => None,
        };
        let effects = params.job_effects_prior.map(|prior| {
            let fx = JobEffects::fit(
                &rows.samples,
                &residuals,
                prior,
                params.family_effects_prior,
            );
            for (t, s) in residuals.iter_mut().zip(&rows.samples) {
                if let Some(task) = s.task.as_ref() {
                    *t -= fx.predict(task, &s.corunners);
                }
            }
            fx
        });
        let (forest, out_of_bag) =
            Forest::fit_with_out_of_bag(&rows.rows, &residuals, forest_params)?;
        let known_models = rows
            .samples
            .iter()
            .flat_map(|s| s.task.iter().chain(&s.corunners))
            .map(|p| model_key(&p.model))
            .collect();
        let mut staged = Staged {
            n_samples: rows.rows.len(),
            target,
            base,
            effects,
            forest,
            known_models,
            forest_on_new_models: params.forest_on_new_models,
            speed_free: params.speed_free,
            calibration: Calibration::default(),
            early: rows.rows.len() < params.min_samples,
        };
        if calibrate {
            // Each sample by the trees that never drew it, on top of the same base
            // and effects as the whole model.
            let known: Vec<f64> = rows
                .targets
                .iter()
                .zip(&residuals)
                .zip(&out_of_bag)
                .zip(&rows.samples)
                .filter_map(|(((t, left), oob), s)| {
                    let offset = t - left;
                    let (predicted, _) = target.decode(offset + (*oob)?, 0.0);
                    Some(log_residual(s.slowdown, predicted))
                })
                .collect();
            let new_model = new_model_residuals(rows, params, forest_params)?;
            staged.calibration = Calibration::new(&known, &new_model);
        }
        Ok(staged)
    }

    /// The slowdown of `task` next to one co-runner and its spread across trees,
    /// and whether a model in the pair is new to this model.
    fn point(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunner: &TaskProfile,
    ) -> Result<(f64, f64, bool), PredictorError> {
        let corunners = std::slice::from_ref(corunner);
        let mut row = [0.0; N_FEATURES];
        feature_row_into(device_kind, task, corunners, &mut row);
        if self.speed_free {
            mask_speed_dependent(&mut row);
        }
        let offset = self.base.as_ref().map_or(0.0, |b| b.predict(&row))
            + self
                .effects
                .as_ref()
                .map_or(0.0, |e| e.predict(task, corunners));
        let new_model = [task, corunner]
            .iter()
            .any(|p| !self.known_models.contains(&model_key(&p.model)));
        let (mean, sd) = if new_model && !self.forest_on_new_models {
            (0.0, 0.0)
        } else {
            self.forest.predict(&row)?
        };
        let (slowdown, sd) = self.target.decode(offset + mean, sd);
        Ok((slowdown, sd, new_model))
    }

    /// The prediction for `task` next to one co-runner, with its calibrated interval.
    fn predict_pair(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunner: &TaskProfile,
    ) -> Prediction {
        match self.point(device_kind, task, corunner) {
            Ok((slowdown, sd, new_model))
                if slowdown.is_finite() && slowdown > 0.0 && sd.is_finite() =>
            {
                match self.calibration.band(new_model) {
                    Some(band) => {
                        let (lower_90, upper_90) = band.around(slowdown);
                        Prediction {
                            slowdown,
                            uncertainty: sd,
                            lower_90,
                            upper_90,
                            source: PredictionSource::Model,
                        }
                    }
                    None if self.early => Prediction::with_stated_spread(
                        slowdown,
                        sd.max(heuristic::RELATIVE_UNCERTAINTY * slowdown),
                        PredictionSource::Model,
                    ),
                    None => Prediction::with_stated_spread(slowdown, sd, PredictionSource::Model),
                }
            }
            Ok(_) | Err(_) => {
                tracing::warn!("forest prediction failed; using the cold-start heuristic");
                heuristic::predict(task, std::slice::from_ref(corunner))
            }
        }
    }
}

/// `ln(measured) − ln(predicted)`.
fn log_residual(measured: f64, predicted: f64) -> f64 {
    measured.ln() - predicted.ln()
}

/// Residuals of every sample predicted by a model fitted without any of its models
/// (see [`crate::calibration`]).
fn new_model_residuals(
    rows: &Rows,
    params: &LearnerParams,
    forest_params: &ForestParams,
) -> Result<Vec<f64>, PredictorError> {
    let mut models: Vec<(u64, &str)> = rows
        .samples
        .iter()
        .flat_map(|s| s.task.iter().chain(&s.corunners))
        .map(|p| (model_key(&p.model), p.model.as_str()))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    // In hash order, so the groups do not follow the names' alphabet.
    models.sort_unstable();
    let groups = CALIBRATION_GROUPS.min(models.len());
    if groups < 2 {
        return Ok(Vec::new());
    }
    let small = ForestParams {
        n_trees: forest_params.n_trees.min(CALIBRATION_TREES),
        ..forest_params.clone()
    };
    let mut residuals = Vec::new();
    for group in 0..groups {
        let held: HashSet<&str> = models
            .iter()
            .skip(group)
            .step_by(groups)
            .map(|(_, m)| *m)
            .collect();
        let involves_held = |s: &CoLocationSample| {
            s.task
                .iter()
                .chain(&s.corunners)
                .any(|p| held.contains(p.model.as_str()))
        };
        let (held_out, kept): (Vec<_>, Vec<_>) =
            rows.samples.iter().partition(|s| involves_held(s));
        if kept.len() < params.model_from() || held_out.is_empty() {
            continue;
        }
        let kept: Vec<Arc<CoLocationSample>> = kept.into_iter().cloned().collect();
        let model = Staged::fit(
            &Rows::of(&kept, rows.target, params.speed_free),
            params,
            &small,
            false,
        )?;
        for s in held_out {
            let Some(task) = s.task.as_ref() else {
                continue;
            };
            // The model composes co-runners from pairs; a pair is what it is asked.
            if let [corunner] = s.corunners.as_slice() {
                let (predicted, _, _) = model.point(&s.device_kind, task, corunner)?;
                residuals.push(log_residual(s.slowdown, predicted));
            }
        }
    }
    Ok(residuals)
}

/// A task's slowdown next to several co-runners, composed from its slowdown next to
/// each alone: the product `Π_c s_c`, each co-runner independently taking its share
/// of what the task would otherwise get (uncertainties combined in relative terms,
/// by the delta method).
///
/// Why: the forest is constant outside the range of its training rows and the
/// linear base was fitted where nearly every sample had one co-runner, so for more
/// co-runners than the window has (almost) ever seen its answers barely grow, and the
/// placer stacks jobs on a GPU. One-co-runner predictions are what the window
/// supports.
///
/// Why the product rather than adding the excesses (`1 + Σ (s_c − 1)`, exact for
/// jobs that only time-slice): with excesses below 1 the sum predicts a device's
/// combined throughput to grow with every further job, towards `1 / excess`, so
/// the placer's throughput guard never stops stacking; the product gives the
/// diminishing, then falling, returns a saturated GPU shows. Gavel measured pairs
/// only, so no data set tells whether the rule holds for three or more jobs on real
/// GPUs. The simulator runs behind both choices are in docs/predictor-experiments.md,
/// "Composing several co-runners".
pub fn compose_pairwise(pairwise: impl Iterator<Item = Prediction>) -> Prediction {
    let mut fold = PairwiseFold::default();
    for p in pairwise {
        fold.add(p);
    }
    fold.finish()
}

/// The running state of [`compose_pairwise`]: the composition of the pairwise
/// predictions added so far, in order.
///
/// Why it is exposed: the placer predicts each resident of a device next to the
/// other residents *and* a newcomer, for every newcomer it considers. The pairs
/// among the residents do not change between newcomers, so it keeps this fold of
/// them and adds only the newcomer's pair ([`SlowdownModel::predict_extending`]);
/// the additions happen in the same order as [`compose_pairwise`] over the whole
/// list would make them, so the result has the same bits.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PairwiseFold {
    log: f64,
    rel_var: f64,
    /// Sums of the squared log-distances from each pairwise prediction to the ends
    /// of its 90 % interval.
    lower_sq: f64,
    upper_sq: f64,
    count: usize,
}

impl PairwiseFold {
    /// Adds the prediction next to one more co-runner.
    pub fn add(&mut self, p: Prediction) {
        let s = p.slowdown.max(1.0);
        self.log += s.ln();
        self.rel_var += (p.uncertainty / s).powi(2);
        self.lower_sq += (p.lower_90 / p.slowdown).ln().powi(2);
        self.upper_sq += (p.upper_90 / p.slowdown).ln().powi(2);
        self.count += 1;
    }

    /// Number of pairwise predictions added.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The composed prediction. Its interval adds the pairs' log-distances in
    /// quadrature, as if their errors were independent (like the uncertainty): no
    /// sample of three or more jobs calibrates it.
    pub fn finish(&self) -> Prediction {
        let slowdown = f64::exp(self.log);
        Prediction {
            slowdown,
            uncertainty: slowdown * self.rel_var.sqrt(),
            lower_90: slowdown * (-self.lower_sq.sqrt()).exp(),
            upper_90: slowdown * self.upper_sq.sqrt().exp(),
            source: PredictionSource::Model,
        }
    }
}

impl FittedModel {
    /// `task`'s pairwise predictions next to each of `corunners`, folded in order:
    /// the one path both a whole-list prediction and a prefix take, so extending a
    /// prefix gives the same bits as predicting the whole list.
    fn fold_pairwise(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> PairwiseFold {
        let mut fold = PairwiseFold::default();
        for c in corunners {
            fold.add(self.predict(device_kind, task, std::slice::from_ref(c)));
        }
        fold
    }

    /// Number of samples the model was fitted on (0 for cold start).
    pub fn n_samples(&self) -> usize {
        match self {
            FittedModel::ColdStart => 0,
            FittedModel::Forest(staged) => staged.n_samples,
        }
    }

    /// The calibration of a fitted model (`None` for cold start).
    pub fn calibration(&self) -> Option<&Calibration> {
        match self {
            FittedModel::ColdStart => None,
            FittedModel::Forest(staged) => Some(&staged.calibration),
        }
    }
}

impl SlowdownModel for FittedModel {
    fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Prediction {
        if corunners.is_empty() {
            // Alone on a GPU a task runs at its solo speed by definition.
            return Prediction::certain(1.0, PredictionSource::Model);
        }
        match self {
            FittedModel::ColdStart => heuristic::predict(task, corunners),
            FittedModel::Forest(staged) => match corunners {
                [corunner] => staged.predict_pair(device_kind, task, corunner),
                _ => self.fold_pairwise(device_kind, task, corunners).finish(),
            },
        }
    }

    /// The fold of `task`'s pairwise predictions next to each of `corunners`, in
    /// order, when this model composes several co-runners from pairs (the fitted
    /// forest); `None` for the cold-start rule, which does not.
    fn pairwise_prefix(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Option<PairwiseFold> {
        match self {
            FittedModel::ColdStart => None,
            FittedModel::Forest(_) => Some(self.fold_pairwise(device_kind, task, corunners)),
        }
    }

    /// `self.predict(device_kind, task, [corunners…, extra])`, given `prefix` =
    /// `self.pairwise_prefix(device_kind, task, [corunners…])` with at least one
    /// co-runner: one pairwise prediction instead of `prefix.count() + 1`, with the
    /// same bits. `None` when this model does not compose pairwise or `prefix` is
    /// empty (one co-runner alone is predicted directly, not composed).
    fn predict_extending(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        prefix: &PairwiseFold,
        extra: &TaskProfile,
    ) -> Option<Prediction> {
        match self {
            FittedModel::ColdStart => None,
            FittedModel::Forest(_) if prefix.count() == 0 => None,
            FittedModel::Forest(_) => {
                let mut fold = *prefix;
                fold.add(self.predict(device_kind, task, std::slice::from_ref(extra)));
                Some(fold.finish())
            }
        }
    }
}

/// Trains [`FittedModel`]s on profile features (and per-job effects).
#[derive(Debug, Clone)]
pub struct ProfileTrainer {
    pub params: LearnerParams,
}

impl Trainer for ProfileTrainer {
    type Model = FittedModel;

    fn initial(&self) -> FittedModel {
        FittedModel::ColdStart
    }

    fn fit(&self, samples: &[Arc<CoLocationSample>]) -> Result<FittedModel, PredictorError> {
        if samples.len() < self.params.model_from() {
            return Ok(FittedModel::ColdStart);
        }
        let rows = Rows::of(
            samples,
            Target::for_window(&self.params, samples),
            self.params.speed_free,
        );
        let staged = Staged::fit(&rows, &self.params, &self.params.forest, true)?;
        let (known, new_model) = staged.calibration.counts();
        tracing::debug!(
            samples = staged.n_samples,
            known_residuals = known,
            new_model_residuals = new_model,
            "predictor model fitted"
        );
        Ok(FittedModel::Forest(Box::new(staged)))
    }
}

/// The window and the refit cadence.
#[derive(Debug, Clone)]
pub struct Learner {
    params: LearnerParams,
    window: Window<Arc<CoLocationSample>>,
    since_refit: usize,
    observed: u64,
}

impl Learner {
    /// An empty learner; fails if `params` do not pass their check.
    pub fn new(params: LearnerParams) -> Result<Learner, PredictorError> {
        params.check()?;
        Ok(Learner {
            window: Window::new(params.newest, params.reservoir),
            params,
            since_refit: 0,
            observed: 0,
        })
    }

    /// The parameters.
    pub fn params(&self) -> &LearnerParams {
        &self.params
    }

    /// Adds a valid sample to the window; returns whether a refit is now due.
    pub fn observe(&mut self, sample: CoLocationSample) -> Result<bool, PredictorError> {
        validate_sample(&sample)?;
        // Provenance fields do not change what the sample says; hash only its content
        // so the same measurement hashes alike wherever it was stored.
        let content = CoLocationSample {
            device_kind: sample.device_kind.clone(),
            task: sample.task.clone(),
            corunners: sample.corunners.clone(),
            slowdown: sample.slowdown,
            ..Default::default()
        };
        let hash = stable_hash(&content.encode_to_vec());
        self.window.push(hash, Arc::new(sample));
        self.observed += 1;
        self.since_refit += 1;
        Ok(self.refit_due())
    }

    /// True when enough samples arrived since the last snapshot.
    pub fn refit_due(&self) -> bool {
        self.since_refit >= self.params.refit_every
    }

    /// The samples to fit on; resets the cadence counter.
    pub fn snapshot(&mut self) -> Vec<Arc<CoLocationSample>> {
        self.since_refit = 0;
        self.window.items()
    }

    /// Samples currently in the window.
    pub fn window_len(&self) -> usize {
        self.window.len()
    }

    /// Valid samples observed since creation.
    pub fn observed(&self) -> u64 {
        self.observed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(slowdown: f64, step: f64) -> CoLocationSample {
        let p = |m: &str, s| TaskProfile {
            model: m.into(),
            batch_size: 32,
            solo_step_time_s: s,
            ..Default::default()
        };
        CoLocationSample {
            device_kind: "k80".into(),
            task: Some(p("a", step)),
            corunners: vec![p("b", 0.2)],
            slowdown,
            ..Default::default()
        }
    }

    #[test]
    fn refit_is_due_on_cadence_and_bad_samples_are_refused() {
        let mut l = Learner::new(LearnerParams {
            refit_every: 3,
            ..LearnerParams::default()
        })
        .expect("params");
        assert!(!l.observe(sample(1.2, 0.1)).expect("ok"));
        assert!(!l.observe(sample(1.3, 0.1)).expect("ok"));
        assert!(l.observe(sample(1.4, 0.1)).expect("ok"));
        assert_eq!(l.snapshot().len(), 3);
        assert!(!l.refit_due());
        assert!(l.observe(sample(f64::NAN, 0.1)).is_err());
        assert!(l.observe(sample(1.1, 0.0)).is_err());
        assert!(l.observe(CoLocationSample::default()).is_err());
        assert_eq!(l.observed(), 3);
    }

    #[test]
    fn cold_start_until_min_samples_then_model() {
        let trainer = ProfileTrainer {
            params: LearnerParams::default(),
        };
        let few: Vec<_> = (0..5)
            .map(|i| Arc::new(sample(1.5, 0.1 + f64::from(i))))
            .collect();
        assert!(matches!(
            trainer.fit(&few).expect("fit"),
            FittedModel::ColdStart
        ));
        let many: Vec<_> = (0..40)
            .map(|i| {
                Arc::new(sample(
                    if i % 2 == 0 { 1.2 } else { 2.0 },
                    if i % 2 == 0 { 0.1 } else { 1.0 },
                ))
            })
            .collect();
        let model = trainer.fit(&many).expect("fit");
        assert_eq!(model.n_samples(), 40);
        let probe = sample(0.0, 1.0);
        let task = probe.task.as_ref().expect("task");
        let p = model.predict("k80", task, &probe.corunners);
        assert_eq!(p.source, PredictionSource::Model);
        assert!((p.slowdown - 2.0).abs() < 0.1, "{p:?}");
        assert_eq!(model.predict("k80", task, &[]).slowdown, 1.0);
    }

    /// With `early_model_from`, a handful of samples already give a fitted model:
    /// a model never seen, next to a co-runner the window knows, is predicted at
    /// what that co-runner did to others (here 2.4), not at the cold-start rule's
    /// 1.2 for two jobs of unknown utilisation; the interval is at least the
    /// rule's stated width, since no band can be calibrated on five samples.
    #[test]
    fn early_model_answers_before_min_samples() {
        let p = |m: &str, step: f64| TaskProfile {
            model: m.into(),
            batch_size: 32,
            solo_step_time_s: step,
            ..Default::default()
        };
        let few: Vec<_> = (0..5)
            .map(|i| {
                Arc::new(CoLocationSample {
                    device_kind: "k80".into(),
                    task: Some(p("a", 0.1 + 0.01 * f64::from(i))),
                    corunners: vec![p("b", 0.2)],
                    slowdown: 2.4,
                    ..Default::default()
                })
            })
            .collect();
        let (new_task, corunner) = (p("new", 0.3), p("b", 0.2));
        let cold = ProfileTrainer {
            params: LearnerParams::default(),
        }
        .fit(&few)
        .expect("fit");
        assert!(matches!(cold, FittedModel::ColdStart));
        let early = ProfileTrainer {
            params: LearnerParams {
                early_model_from: Some(3),
                ..LearnerParams::default()
            },
        };
        assert!(matches!(
            early.fit(&few[..2]).expect("fit"),
            FittedModel::ColdStart
        ));
        let model = early.fit(&few).expect("fit");
        assert_eq!(model.n_samples(), 5);
        let got = model.predict("k80", &new_task, std::slice::from_ref(&corunner));
        assert_eq!(got.source, PredictionSource::Model);
        assert!((got.slowdown - 2.4).abs() < 0.2, "{got:?}");
        let rule = heuristic::predict(&new_task, std::slice::from_ref(&corunner));
        assert!(
            got.upper_90 / got.slowdown >= rule.upper_90 / rule.slowdown - 1e-9,
            "{got:?} narrower than the rule's {rule:?}"
        );
    }

    /// The calibration's held-out fits start where the model does: with
    /// `early_model_from`, a window too small to leave `min_samples` out of each
    /// group still gives new-model residuals, so the new-model band is measured
    /// rather than borrowed from the known jobs' narrower one.
    #[test]
    fn new_model_band_is_measured_from_early_model_from() {
        let p = |m: &str| TaskProfile {
            model: m.into(),
            batch_size: 32,
            solo_step_time_s: 0.1,
            ..Default::default()
        };
        let models = ["a", "b", "c", "d", "e", "f", "g", "h"];
        let window: Vec<_> = (0..24)
            .map(|i| {
                Arc::new(CoLocationSample {
                    device_kind: "k80".into(),
                    task: Some(p(models[i % 8])),
                    corunners: vec![p(models[(i + 3) % 8])],
                    slowdown: 1.2 + 0.1 * (i % 5) as f64,
                    ..Default::default()
                })
            })
            .collect();
        let new_model_residuals = |params: LearnerParams| {
            let model = ProfileTrainer { params }.fit(&window).expect("fit");
            model.calibration().expect("fitted").counts().1
        };
        assert_eq!(new_model_residuals(LearnerParams::default()), 0);
        assert!(
            new_model_residuals(LearnerParams {
                early_model_from: Some(5),
                ..LearnerParams::default()
            }) > 0
        );
    }

    /// Trained on one-co-runner samples only, the model answers for two and three
    /// co-runners by multiplying their one-co-runner slowdowns, so a further
    /// co-runner never lowers the prediction.
    #[test]
    fn several_corunners_multiply_their_pairwise_slowdowns() {
        let trainer = ProfileTrainer {
            params: LearnerParams::default(),
        };
        let pairs: Vec<_> = (0..40)
            .map(|i| {
                Arc::new(sample(
                    if i % 2 == 0 { 1.2 } else { 2.0 },
                    if i % 2 == 0 { 0.1 } else { 1.0 },
                ))
            })
            .collect();
        let model = trainer.fit(&pairs).expect("fit");
        let probe = sample(0.0, 1.0);
        let task = probe.task.as_ref().expect("task");
        let co = &probe.corunners[0];
        let one = model.predict("k80", task, std::slice::from_ref(co));
        assert!(one.slowdown > 1.0, "{one:?}");
        let two = model.predict("k80", task, &[co.clone(), co.clone()]);
        let three = model.predict("k80", task, &[co.clone(), co.clone(), co.clone()]);
        assert!((two.slowdown - one.slowdown.powi(2)).abs() < 1e-9);
        assert!((three.slowdown - one.slowdown.powi(3)).abs() < 1e-9);
        assert!(one.slowdown <= two.slowdown && two.slowdown <= three.slowdown);
        let relative = one.uncertainty / one.slowdown;
        assert!((two.uncertainty - two.slowdown * relative * 2f64.sqrt()).abs() < 1e-9);
    }

    /// Extending a cached prefix of pairwise predictions gives the same bits as
    /// predicting over the whole list; the cold-start rule and an empty prefix
    /// decline.
    #[test]
    fn extending_a_pairwise_prefix_matches_the_whole_list() {
        let trainer = ProfileTrainer {
            params: LearnerParams::default(),
        };
        let pairs: Vec<_> = (0..40)
            .map(|i| {
                let step = 0.1 + 0.05 * f64::from(i % 9);
                Arc::new(sample(1.1 + step, step))
            })
            .collect();
        let model = trainer.fit(&pairs).expect("fit");
        let profile = |m: &str, step: f64| TaskProfile {
            model: m.into(),
            batch_size: 32,
            solo_step_time_s: step,
            ..Default::default()
        };
        let task = profile("a", 0.3);
        let others = [profile("b", 0.2), profile("a", 0.45), profile("c", 0.1)];
        let extra = profile("b", 0.35);
        for n in 1..=others.len() {
            let prefix = model
                .pairwise_prefix("k80", &task, &others[..n])
                .expect("the forest composes pairwise");
            assert_eq!(prefix.count(), n);
            let mut whole = others[..n].to_vec();
            whole.push(extra.clone());
            let want = model.predict("k80", &task, &whole);
            let got = model
                .predict_extending("k80", &task, &prefix, &extra)
                .expect("a non-empty prefix extends");
            assert_eq!(got.slowdown.to_bits(), want.slowdown.to_bits(), "{n}");
            assert_eq!(got.uncertainty.to_bits(), want.uncertainty.to_bits(), "{n}");
            if n >= 2 {
                let alone = model.predict("k80", &task, &others[..n]);
                assert_eq!(prefix.finish().slowdown.to_bits(), alone.slowdown.to_bits());
            }
        }
        let empty = model.pairwise_prefix("k80", &task, &[]).expect("forest");
        assert!(
            model
                .predict_extending("k80", &task, &empty, &extra)
                .is_none()
        );
        let cold = FittedModel::ColdStart;
        assert!(cold.pairwise_prefix("k80", &task, &others).is_none());
        assert!(
            cold.predict_extending("k80", &task, &prefix_of(&model, &task, &others), &extra)
                .is_none()
        );
    }

    fn prefix_of(model: &FittedModel, task: &TaskProfile, co: &[TaskProfile]) -> PairwiseFold {
        model.pairwise_prefix("k80", task, co).expect("forest")
    }

    proptest! {
        /// Composing never lowers a slowdown when a co-runner is added, and one
        /// co-runner's prediction (at least 1) is returned as it is.
        #[test]
        fn composition_is_monotone(
            parts in proptest::collection::vec((0.5f64..20.0, 0.0f64..5.0), 1..6),
            extra in (0.5f64..20.0, 0.0f64..5.0),
        ) {
            let p = |(s, u): (f64, f64)| {
                Prediction::with_stated_spread(s, u, PredictionSource::Model)
            };
            let before = compose_pairwise(parts.iter().copied().map(p));
            let after = compose_pairwise(parts.iter().copied().chain([extra]).map(p));
            prop_assert!(after.slowdown >= before.slowdown);
            prop_assert!(after.uncertainty >= before.uncertainty);
            prop_assert!(before.slowdown >= 1.0);
            let single = compose_pairwise([p(parts[0])].into_iter());
            prop_assert!((single.slowdown - parts[0].0.max(1.0)).abs() < 1e-12);
        }
    }

    /// Synthetic pairs of `families` × 3 batch sizes, whose slowdown follows the
    /// step-time ratio times a factor of each family that no feature reveals, with
    /// noise: what a model can learn of a new family is the ratio alone.
    fn families(names: &[&str], seed: u64) -> Vec<Arc<CoLocationSample>> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let factor = |name: &str| 1.0 + (stable_hash(name.as_bytes()) % 7) as f64 / 10.0;
        let profile = |name: &str, b: u32| TaskProfile {
            model: name.into(),
            batch_size: 16 << b,
            solo_step_time_s: 0.02 * f64::from(1 << b) * factor(name),
            ..Default::default()
        };
        let mut out = Vec::new();
        for t in names {
            for c in names {
                for (bt, bc) in [(0, 1), (1, 2), (2, 0), (1, 1)] {
                    let (task, co) = (profile(t, bt), profile(c, bc));
                    let ratio = co.solo_step_time_s / task.solo_step_time_s;
                    let noise: f64 = rng.random_range(-0.1..0.1);
                    out.push(Arc::new(CoLocationSample {
                        device_kind: "k80".into(),
                        slowdown: (1.0 + 0.5 * ratio.sqrt()) * factor(t) * noise.exp(),
                        task: Some(task),
                        corunners: vec![co],
                        ..Default::default()
                    }));
                }
            }
        }
        out
    }

    /// Intervals are calibrated per class: a model never seen gets the wider band of
    /// the new-model residuals, and fresh samples of the jobs seen fall inside their
    /// intervals about 90 % of the time.
    #[test]
    fn intervals_are_wider_for_new_models_and_cover_fresh_samples() {
        let trainer = ProfileTrainer {
            params: LearnerParams::default(),
        };
        let seen = ["a", "b", "c", "d", "e", "f", "g"];
        let model = trainer.fit(&families(&seen, 1)).expect("fit");
        let calibration = model.calibration().expect("fitted");
        let (known, new_model) = calibration.counts();
        assert!(known > 100 && new_model > 100, "{known} {new_model}");
        let width = |p: &Prediction| (p.upper_90 / p.lower_90).ln();
        let fresh = families(&seen, 2);
        let mut inside = 0;
        for s in &fresh {
            let task = s.task.as_ref().expect("task");
            let p = model.predict("k80", task, &s.corunners);
            inside += usize::from(p.lower_90 <= s.slowdown && s.slowdown <= p.upper_90);
        }
        let coverage = inside as f64 / fresh.len() as f64;
        assert!((0.8..=1.0).contains(&coverage), "{coverage}");
        let old = fresh[0].task.as_ref().expect("task");
        let known_pair = model.predict("k80", old, &fresh[0].corunners);
        let mut stranger = old.clone();
        stranger.model = "never-seen".into();
        let new_pair = model.predict("k80", &stranger, &fresh[0].corunners);
        assert!(
            width(&new_pair) > width(&known_pair),
            "{new_pair:?} vs {known_pair:?}"
        );
    }

    #[test]
    fn invalid_params_are_rejected() {
        let p = LearnerParams {
            refit_every: 0,
            ..LearnerParams::default()
        };
        assert!(Learner::new(p).is_err());
        let p = LearnerParams {
            min_samples: 5000,
            ..LearnerParams::default()
        };
        assert!(p.check().is_err());
        for p in [
            LearnerParams {
                target_floor: 1.0,
                ..LearnerParams::default()
            },
            LearnerParams {
                target_floor: f64::NAN,
                ..LearnerParams::default()
            },
            LearnerParams {
                ridge_lambda: Some(0.0),
                ..LearnerParams::default()
            },
            LearnerParams {
                job_effects_prior: Some(-1.0),
                ..LearnerParams::default()
            },
        ] {
            assert!(p.check().is_err(), "{p:?}");
        }
    }

    fn any_profile() -> impl Strategy<Value = TaskProfile> {
        (
            "[a-c]",
            any::<u32>(),
            prop_oneof![any::<f64>(), 1e-4..10.0f64],
            proptest::option::of(any::<f64>()),
            proptest::option::of(any::<u64>()),
        )
            .prop_map(|(m, b, s, sm, mem)| TaskProfile {
                model: m,
                batch_size: b,
                solo_step_time_s: s,
                sm_util_pct: sm,
                mem_bw_util_pct: None,
                gpu_mem_mib: mem,
            })
    }

    /// A model fitted on a few jobs (named like the probes, so the per-job effects
    /// take part) answers any input with a finite slowdown above the target floor.
    #[test]
    fn predictions_are_finite_for_any_input() {
        let trainer = ProfileTrainer {
            params: LearnerParams {
                forest: ForestParams {
                    n_trees: 4,
                    ..ForestParams::default()
                },
                ..LearnerParams::default()
            },
        };
        let samples: Vec<_> = (0..30u32)
            .map(|i| {
                let mut s = sample(1.1 + 0.1 * f64::from(i % 7), 0.05 * f64::from(i % 5 + 1));
                if let Some(t) = s.task.as_mut() {
                    t.model = ["a", "b", "c"][(i % 3) as usize].into();
                }
                Arc::new(s)
            })
            .collect();
        let model = trainer.fit(&samples).expect("fit");
        proptest!(|(task in any_profile(), co in proptest::collection::vec(any_profile(), 0..4))| {
            let p = model.predict("k80", &task, &co);
            prop_assert!(p.slowdown.is_finite() && p.uncertainty.is_finite(), "{:?}", p);
            prop_assert!(p.slowdown > 0.0);
            prop_assert!(p.lower_90.is_finite() && p.upper_90.is_finite(), "{:?}", p);
            prop_assert!(p.lower_90 <= p.slowdown && p.slowdown <= p.upper_90, "{:?}", p);
        });
    }
}
