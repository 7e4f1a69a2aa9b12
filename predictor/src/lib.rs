//! Online co-location slowdown predictor.
//!
//! Given a task's solo profile and the profiles of the tasks it would share a GPU
//! with, predicts its slowdown IF = co-located step time ÷ solo step time, with an
//! uncertainty. The placer turns per-task predictions into the predicted increase
//! of a device's Σ PD.
//!
//! How it is put together, one private module per idea, with what other crates use
//! re-exported at the root:
//! - `features.rs`: the profile features that generalise to models never seen before;
//! - `heuristic.rs`: the transparent cold-start rule used until enough samples exist;
//! - `linear.rs`: the ridge base on the features whose scale means the same for every
//!   model (the additive part, which few samples suffice to learn and which
//!   transfers to new models), clamped to the range it was fitted on;
//! - `effects.rs`: per-job sensitivity and aggressiveness of jobs seen before,
//!   shrunk towards 0 (a new model has none and gets the profile model alone);
//! - `forest.rs`: our own bagged forest of our own CART regression trees (`tree`),
//!   so the spread across trees is available as uncertainty;
//! - `calibration.rs`: the 90 % predictive interval of every prediction, conformal
//!   from out-of-sample residuals, apart for jobs seen and for models never seen;
//! - `window.rs`: the bounded training window (newest samples plus an order-independent
//!   reservoir for diversity);
//! - `learner.rs`: the synchronous core (window, cadence, fit) that production and the
//!   evaluation share;
//! - `online.rs`: [`OnlinePredictor`], which refits in a background thread and never
//!   makes a prediction wait for a refit;
//! - [`jsonl`]: the JSON Lines sample format, the one public module.
//!
//! The evaluation (its two splits, the baselines, the Gavel converter) is in the
//! `iadeep-eval` crate, which drives this one through its public API.
//!
//! The model ([`FittedModel`]) predicts ln(slowdown − 0.8) as ridge base +
//! per-job effects + forest on the residuals.
//!
//! **How the defaults were chosen.** Every setting is chosen on one data set and
//! reported on the other, on seeds the reported figures do not use (docs/design.md,
//! "Tune on one data set, report on another"); the search and what it chose are in
//! docs/predictor-experiments.md, "How the defaults were chosen", the figures in the
//! README ("Evaluating the predictor").
//!
//! For two or more co-runners the fitted model multiplies the slowdowns it predicts
//! for each co-runner alone ([`learner::compose_pairwise`]): training windows hold
//! almost only pairs, and a forest does not extrapolate in the number of co-runners.

mod calibration;
mod effects;
mod error;
mod features;
mod forest;
mod heuristic;
pub mod jsonl;
mod learner;
mod linear;
mod online;
mod tree;
mod window;

pub use error::PredictorError;
pub use features::{DEVICE_KINDS, device_column, feature_row};
pub use forest::{Forest, ForestParams};
pub use heuristic::predict as cold_start_prediction;
pub use learner::{
    FittedModel, Learner, LearnerParams, PairwiseFold, ProfileTrainer, SlowdownModel, Trainer,
    compose_pairwise, validate_sample,
};
pub use online::OnlinePredictor;

/// Where a prediction came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PredictionSource {
    /// The fitted forest.
    Model,
    /// The cold-start heuristic (not enough samples yet, or no fitted model).
    ColdStart,
    /// A model given its answers rather than fitted: the simulator's oracle (the world's
    /// true slowdowns) and fixed models in tests.
    Given,
}

/// A predicted slowdown of one task given its co-runners.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Prediction {
    /// Predicted IF = co-located step time ÷ solo step time.
    pub slowdown: f64,
    /// Standard deviation of the per-tree predictions (model), or the heuristic's
    /// stated width (cold start). Same unit as `slowdown`.
    pub uncertainty: f64,
    /// Lower end of the 90 % predictive interval of the slowdown.
    pub lower_90: f64,
    /// Upper end of the 90 % predictive interval of the slowdown.
    pub upper_90: f64,
    pub source: PredictionSource,
}

/// The standard normal quantile of 0.95: ±`Z_90` standard deviations hold 90 %.
pub const Z_90: f64 = 1.644_853_626_951_472_2;

impl Prediction {
    /// A prediction with no doubt: alone on a GPU a task runs at its solo speed.
    pub fn certain(slowdown: f64, source: PredictionSource) -> Prediction {
        Prediction {
            slowdown,
            uncertainty: 0.0,
            lower_90: slowdown,
            upper_90: slowdown,
            source,
        }
    }

    /// A prediction whose 90 % interval is `slowdown · exp(±Z_90 · uncertainty /
    /// slowdown)`: a log-normal reading of a stated spread, for the models that have
    /// no calibration (the cold-start rule and the baselines).
    pub fn with_stated_spread(
        slowdown: f64,
        uncertainty: f64,
        source: PredictionSource,
    ) -> Prediction {
        let relative = if slowdown > 0.0 {
            uncertainty / slowdown
        } else {
            0.0
        };
        Prediction {
            slowdown,
            uncertainty,
            lower_90: slowdown * (-Z_90 * relative).exp(),
            upper_90: slowdown * (Z_90 * relative).exp(),
            source,
        }
    }
}
