//! The reference approach we compare against: a forest on one-hot job names.
//!
//! A job is a model name at a batch size. The row is one column per job seen in the
//! training window for the task (1 if it is this task) and one per job for the
//! co-runners (how many co-runners are that job), plus the device kind. A job never
//! seen in training gets all zeros: this is exactly why the approach cannot say
//! anything about a new model.
//! Same forest, same window, same refit cadence as ours, so the comparison isolates
//! the features.

use std::collections::BTreeMap;
use std::sync::Arc;

use iadeep_proto::{CoLocationSample, TaskProfile};

use super::plain_forest::baseline_prediction;
use iadeep_predictor::Forest;
use iadeep_predictor::Prediction;
use iadeep_predictor::PredictorError;
use iadeep_predictor::cold_start_prediction;
use iadeep_predictor::{DEVICE_KINDS, device_column};
use iadeep_predictor::{LearnerParams, SlowdownModel, Trainer};

/// The reference model.
#[derive(Debug)]
pub enum ReferenceModel {
    ColdStart,
    Forest {
        forest: Forest,
        vocabulary: Vocabulary,
    },
}

/// The column of each job (model name, batch size) seen in training.
type Vocabulary = BTreeMap<(String, u32), usize>;

fn job(p: &TaskProfile) -> (String, u32) {
    (p.model.clone(), p.batch_size)
}

fn one_hot_row(
    vocabulary: &Vocabulary,
    device_kind: &str,
    task: &TaskProfile,
    corunners: &[TaskProfile],
) -> Vec<f64> {
    let n = vocabulary.len();
    let mut row = vec![0.0; DEVICE_KINDS.len() + 2 * n];
    row[device_column(device_kind)] = 1.0;
    let base = DEVICE_KINDS.len();
    if let Some(i) = vocabulary.get(&job(task)) {
        row[base + i] = 1.0;
    }
    for c in corunners {
        if let Some(i) = vocabulary.get(&job(c)) {
            row[base + n + i] += 1.0;
        }
    }
    row
}

impl SlowdownModel for ReferenceModel {
    fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Prediction {
        match self {
            ReferenceModel::ColdStart => cold_start_prediction(task, corunners),
            ReferenceModel::Forest { forest, vocabulary } => baseline_prediction(
                forest,
                &one_hot_row(vocabulary, device_kind, task, corunners),
                task,
                corunners,
            ),
        }
    }
}

/// Trains [`ReferenceModel`]s.
#[derive(Debug, Clone)]
pub struct ReferenceTrainer {
    pub params: LearnerParams,
}

impl Trainer for ReferenceTrainer {
    type Model = ReferenceModel;

    fn initial(&self) -> ReferenceModel {
        ReferenceModel::ColdStart
    }

    fn fit(&self, samples: &[Arc<CoLocationSample>]) -> Result<ReferenceModel, PredictorError> {
        if samples.len() < self.params.min_samples {
            return Ok(ReferenceModel::ColdStart);
        }
        let mut vocabulary = BTreeMap::new();
        for s in samples {
            for p in s.task.iter().chain(s.corunners.iter()) {
                let next = vocabulary.len();
                vocabulary.entry(job(p)).or_insert(next);
            }
        }
        let mut rows = Vec::with_capacity(samples.len());
        let mut targets = Vec::with_capacity(samples.len());
        for s in samples {
            let Some(task) = s.task.as_ref() else {
                continue;
            };
            rows.push(one_hot_row(&vocabulary, &s.device_kind, task, &s.corunners));
            targets.push(s.slowdown);
        }
        let forest = Forest::fit(&rows, &targets, &self.params.forest)?;
        Ok(ReferenceModel::Forest { forest, vocabulary })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unseen_names_get_no_column() {
        let mut vocabulary = Vocabulary::new();
        vocabulary.insert(("A".to_owned(), 1), 0);
        vocabulary.insert(("B".to_owned(), 1), 1);
        let p = |m: &str| TaskProfile {
            model: m.into(),
            batch_size: 1,
            solo_step_time_s: 1.0,
            ..Default::default()
        };
        let row = one_hot_row(&vocabulary, "k80", &p("A"), &[p("B"), p("B"), p("Z")]);
        assert_eq!(&row[8..], &[1.0, 0.0, 0.0, 2.0]);
        let mut larger = p("A");
        larger.batch_size = 2;
        let row = one_hot_row(&vocabulary, "k80", &larger, &[]);
        assert!(
            row[8..].iter().all(|v| *v == 0.0),
            "another batch size, another job"
        );
        let row = one_hot_row(&vocabulary, "k80", &p("Z"), &[]);
        assert!(row[8..].iter().all(|v| *v == 0.0));
    }
}
