//! The off-the-shelf baseline we also compare against: a plain random forest on the
//! same profile features as ours (`iadeep_predictor`'s `feature_row`), fitted on the slowdown
//! itself, with no linear base, no per-job effects, no log target and no pairwise
//! composition. Same forest parameters, window, refit cadence and cold-start rule
//! as ours, so the comparison isolates what our model adds to the features.

use std::sync::Arc;

use iadeep_proto::{CoLocationSample, TaskProfile};

use iadeep_predictor::Forest;
use iadeep_predictor::PredictorError;
use iadeep_predictor::cold_start_prediction;
use iadeep_predictor::feature_row;
use iadeep_predictor::{LearnerParams, SlowdownModel, Trainer};
use iadeep_predictor::{Prediction, PredictionSource};

/// The plain forest, or the heuristic before enough samples.
#[derive(Debug)]
pub enum PlainForestModel {
    ColdStart,
    Forest(Forest),
}

impl SlowdownModel for PlainForestModel {
    fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Prediction {
        match self {
            PlainForestModel::ColdStart => cold_start_prediction(task, corunners),
            PlainForestModel::Forest(forest) => baseline_prediction(
                forest,
                &feature_row(device_kind, task, corunners),
                task,
                corunners,
            ),
        }
    }
}

/// A baseline forest's prediction from its `row`: the trees' mean with their
/// spread read as log-normal for the interval (the baselines have no calibration),
/// or the cold-start rule when the row does not fit the forest.
pub(crate) fn baseline_prediction(
    forest: &Forest,
    row: &[f64],
    task: &TaskProfile,
    corunners: &[TaskProfile],
) -> Prediction {
    match forest.predict(row) {
        Ok((mean, sd)) => Prediction::with_stated_spread(mean, sd, PredictionSource::Model),
        Err(_) => cold_start_prediction(task, corunners),
    }
}

/// Trains [`PlainForestModel`]s.
#[derive(Debug, Clone)]
pub struct PlainForestTrainer {
    pub params: LearnerParams,
}

impl Trainer for PlainForestTrainer {
    type Model = PlainForestModel;

    fn initial(&self) -> PlainForestModel {
        PlainForestModel::ColdStart
    }

    fn fit(&self, samples: &[Arc<CoLocationSample>]) -> Result<PlainForestModel, PredictorError> {
        if samples.len() < self.params.min_samples {
            return Ok(PlainForestModel::ColdStart);
        }
        let (rows, targets): (Vec<Vec<f64>>, Vec<f64>) = samples
            .iter()
            .filter_map(|s| {
                let task = s.task.as_ref()?;
                Some((feature_row(&s.device_kind, task, &s.corunners), s.slowdown))
            })
            .unzip();
        Ok(PlainForestModel::Forest(Forest::fit(
            &rows,
            &targets,
            &self.params.forest,
        )?))
    }
}
