//! One closed-loop round over the store, as a [`crate::search::Evaluator`]: write one
//! [`BatchSizeAssignment`] per co-located task, wait for fresh reports measured under that
//! round, and turn them into Σ PD.
//!
//! The evaluator runs on a blocking thread (the control loop fits GPs, which is CPU work) and
//! drives store calls with the runtime's handle.
//!
//! A task that does not answer within the round timeout: the round is **dropped**, not
//! observed. A Σ PD over some of the tasks is not the objective, and observing a guess would
//! poison the GP for the rest of the search. The control loop then re-reads the residents (a
//! silent task usually died and its alive key expires) and tries again with a new round.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use iadeep_proto::{
    BatchSizeAssignment, CoLocationSample, LrScalingRule, TaskProfile, TaskReport, TaskSpec,
};
use iadeep_state::{StateStore, keys, typed};
use tokio::sync::watch;

use super::knowledge::TaskKnowledge;
use super::metrics::Metrics;
use super::tasks::TaskTable;
use crate::degradation::{PdInput, lr_factor};
use crate::error::{Result, TunerError};
use crate::search::Evaluator;

/// How a round ended.
#[derive(Clone, Debug, PartialEq)]
pub enum RoundOutcome {
    /// Every task reported under the round; Σ PD is `sum_pd`.
    Measured {
        round: u64,
        sum_pd: f64,
        reports: Vec<TaskReport>,
    },
    /// Some task ran out of memory at its assigned size.
    OutOfMemory { round: u64, tasks: Vec<String> },
    /// Some tasks did not report in time; the round is dropped.
    TimedOut { round: u64, missing: Vec<String> },
    /// A task left or joined during the round; the round is dropped.
    ResidentsChanged { round: u64 },
    /// Every task reported but Σ PD cannot be computed (no solo step time at m0 for some task).
    Unmeasurable { round: u64, tasks: Vec<String> },
    /// The daemon is stopping.
    Stopped,
}

/// Settings of a round.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoundParams {
    /// Longest wait for every task's fresh reports.
    pub timeout: Duration,
    /// Reports per task under the round before it counts as measured. The first report after
    /// a change may have been timed while a co-runner still ran its previous batch size; the
    /// second is smoothed over windows where every task runs the new configuration.
    pub reports_per_round: u64,
}

impl RoundParams {
    /// Validates the parameters.
    pub fn check(&self) -> Result<()> {
        if self.timeout.is_zero() || self.reports_per_round == 0 {
            return Err(TunerError::InvalidParams(format!(
                "a round needs a positive timeout and at least one report per task, got {self:?}"
            )));
        }
        Ok(())
    }
}

/// The closed loop's view of the world for one set of co-located tasks.
pub struct StoreEvaluator {
    pub(crate) handle: tokio::runtime::Handle,
    pub(crate) store: Arc<dyn StateStore>,
    pub(crate) tasks_rx: watch::Receiver<TaskTable>,
    pub(crate) device_id: String,
    pub(crate) device_kind: String,
    /// The co-located tasks, sorted, with their specs (the search space's order).
    pub(crate) task_ids: Vec<String>,
    pub(crate) specs: Vec<TaskSpec>,
    pub(crate) knowledge: BTreeMap<String, TaskKnowledge>,
    /// Last round written.
    pub(crate) round: u64,
    pub(crate) next_sample_seq: u64,
    pub(crate) params: RoundParams,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) last: Option<RoundOutcome>,
}

impl std::fmt::Debug for StoreEvaluator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreEvaluator")
            .field("device_id", &self.device_id)
            .field("task_ids", &self.task_ids)
            .field("round", &self.round)
            .finish_non_exhaustive()
    }
}

impl StoreEvaluator {
    /// How the last round ended.
    pub fn last_outcome(&self) -> Option<&RoundOutcome> {
        self.last.as_ref()
    }

    /// The learning-rate factor for `m` per the task's rule (DESIGN.md "Learning rate"),
    /// from the one definition the agent also uses: an unspecified rule leaves the learning
    /// rate alone; AdaScale without a reported noise scale uses the square-root rule.
    fn lr_factor(spec: &TaskSpec, m: u32, noise_scale: Option<f64>) -> f64 {
        let rule = LrScalingRule::try_from(spec.lr_rule).unwrap_or(LrScalingRule::Unspecified);
        lr_factor(rule, spec.initial_batch_size, m, noise_scale)
    }

    /// Writes the assignments of a new round; returns the round.
    fn assign(&mut self, batch_sizes: &[u32]) -> Result<u64> {
        self.round += 1;
        let round = self.round;
        let table = self.tasks_rx.borrow().clone();
        for ((task, spec), &b) in self.task_ids.iter().zip(&self.specs).zip(batch_sizes) {
            let phi = table
                .tasks
                .get(task)
                .and_then(|e| e.report.as_ref())
                .and_then(|r| r.grad_noise_scale)
                .filter(|p| p.is_finite() && *p >= 0.0);
            let lr_factor = Self::lr_factor(spec, b, phi);
            let assignment = BatchSizeAssignment {
                task_id: task.clone(),
                batch_size: b,
                lr_factor,
                lr_rule: spec.lr_rule,
                round,
                assigned_at_unix_ms: iadeep_proto::now_unix_ms(),
            };
            let key = keys::task_assignment(task);
            self.handle
                .block_on(typed::put(self.store.as_ref(), &key, &assignment, None))?;
            Metrics::inc(&self.metrics.assignments);
            tracing::debug!(task, round, batch_size = b, lr_factor, "assignment written");
        }
        self.metrics.round.store(round, Ordering::Relaxed);
        Ok(round)
    }

    /// Waits until every task has `reports_per_round` reports under `round` (or an OOM).
    fn wait(&mut self, round: u64, batch_sizes: &[u32]) -> Result<RoundOutcome> {
        let deadline = Instant::now() + self.params.timeout;
        let mut first_seq: Vec<Option<u64>> = vec![None; self.task_ids.len()];
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return Ok(RoundOutcome::Stopped);
            }
            let table = self.tasks_rx.borrow_and_update().clone();
            if table.residents(&self.device_id) != self.task_ids {
                return Ok(RoundOutcome::ResidentsChanged { round });
            }
            let mut reports = Vec::with_capacity(self.task_ids.len());
            let mut missing = Vec::new();
            let mut oom = Vec::new();
            for (i, task) in self.task_ids.iter().enumerate() {
                let report = table.tasks.get(task).and_then(|e| e.report.clone());
                match report {
                    Some(r) if r.assignment_round == round => {
                        if r.oom_batch_size
                            .is_some_and(|o| o > 0 && o <= batch_sizes[i])
                        {
                            oom.push(task.clone());
                        }
                        let first = *first_seq[i].get_or_insert(r.seq);
                        let enough = r.seq + 1 >= first + self.params.reports_per_round;
                        if enough && r.batch_size == batch_sizes[i] && r.step_time_s > 0.0 {
                            reports.push(r);
                        } else {
                            missing.push(task.clone());
                        }
                    }
                    _ => missing.push(task.clone()),
                }
            }
            if !oom.is_empty() {
                return Ok(RoundOutcome::OutOfMemory { round, tasks: oom });
            }
            if missing.is_empty() {
                return Ok(self.measure(round, batch_sizes, reports));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(RoundOutcome::TimedOut { round, missing });
            }
            // Wake on any change of the tasks, at least every 100 ms to notice a stop.
            let wait = (deadline - now).min(Duration::from_millis(100));
            let mut rx = self.tasks_rx.clone();
            let _ = self
                .handle
                .block_on(async move { tokio::time::timeout(wait, rx.changed()).await });
        }
    }

    /// Σ PD from the reports, learning solo step times first (a lone task's round measures
    /// its solo step time at that size, which is also what its PD needs at m0).
    fn measure(
        &mut self,
        round: u64,
        batch_sizes: &[u32],
        reports: Vec<TaskReport>,
    ) -> RoundOutcome {
        let alone = self.task_ids.len() == 1;
        for (task, r) in self.task_ids.iter().zip(&reports) {
            let k = self.knowledge.entry(task.clone()).or_default();
            k.learn_report(r, alone);
        }
        let mut sum = 0.0;
        let mut unknown = Vec::new();
        for (((task, spec), r), &b) in self
            .task_ids
            .iter()
            .zip(&self.specs)
            .zip(&reports)
            .zip(batch_sizes)
        {
            let m0 = spec.initial_batch_size.max(1);
            let solo = self.knowledge.get(task).and_then(|k| k.solo_at(m0));
            let Some(solo_step_s_m0) = solo else {
                unknown.push(task.clone());
                continue;
            };
            let input = PdInput {
                m0: f64::from(m0),
                solo_step_s_m0,
                m: f64::from(b),
                co_step_s: r.step_time_s,
                noise_scale: r.grad_noise_scale.filter(|p| p.is_finite() && *p >= 0.0),
            };
            match input.pd() {
                Ok(pd) => sum += pd,
                Err(err) => {
                    tracing::warn!(task, %err, "cannot compute PD from this report");
                    unknown.push(task.clone());
                }
            }
        }
        if !unknown.is_empty() {
            return RoundOutcome::Unmeasurable {
                round,
                tasks: unknown,
            };
        }
        RoundOutcome::Measured {
            round,
            sum_pd: sum,
            reports,
        }
    }

    /// Writes one CoLocationSample per task of a measured co-location.
    ///
    /// IF = co-located step time / solo step time *at the same batch size*. A sample is
    /// written only when that solo time is known — from the task's solo profile (TaskSpec) or
    /// from a round the tuner ran with the task alone on this device at that size — for the
    /// task and for each co-runner (whose solo time is a predictor feature). Anything else
    /// would be a guessed label.
    fn write_samples(&mut self, round: u64, reports: &[TaskReport]) -> Result<usize> {
        if reports.len() < 2 {
            return Ok(0);
        }
        let profiles: Vec<Option<TaskProfile>> = self
            .task_ids
            .iter()
            .zip(&self.specs)
            .zip(reports)
            .map(|((task, spec), r)| {
                let solo = self.knowledge.get(task)?.solo_at(r.batch_size)?;
                let p = spec.profile.as_ref();
                let same_size = p.is_some_and(|p| p.batch_size == r.batch_size);
                Some(TaskProfile {
                    model: spec.model.clone(),
                    batch_size: r.batch_size,
                    solo_step_time_s: solo,
                    sm_util_pct: p.filter(|_| same_size).and_then(|p| p.sm_util_pct),
                    mem_bw_util_pct: p.filter(|_| same_size).and_then(|p| p.mem_bw_util_pct),
                    gpu_mem_mib: r.peak_mem_mib,
                })
            })
            .collect();
        let Some(profiles) = profiles.into_iter().collect::<Option<Vec<_>>>() else {
            tracing::debug!(
                round,
                "no co-location sample: a solo step time at the measured sizes is unknown"
            );
            return Ok(0);
        };
        let now = iadeep_proto::now_unix_ms();
        let mut written = 0;
        for (i, (task, r)) in self.task_ids.iter().zip(reports).enumerate() {
            let sample = CoLocationSample {
                device_kind: self.device_kind.clone(),
                task: Some(profiles[i].clone()),
                corunners: profiles
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, p)| p.clone())
                    .collect(),
                slowdown: r.step_time_s / profiles[i].solo_step_time_s,
                measured_at_unix_ms: now,
                device_id: self.device_id.clone(),
                task_id: task.clone(),
                corunner_task_ids: self
                    .task_ids
                    .iter()
                    .filter(|t| *t != task)
                    .cloned()
                    .collect(),
                round,
            };
            let key = keys::sample(&self.device_id, self.next_sample_seq);
            self.handle
                .block_on(typed::put(self.store.as_ref(), &key, &sample, None))?;
            self.next_sample_seq += 1;
            written += 1;
            Metrics::inc(&self.metrics.samples);
        }
        Ok(written)
    }
}

impl Evaluator for StoreEvaluator {
    /// Runs one round. `Ok(None)`: out of memory; an error for a dropped round (timeout,
    /// residents changed, unmeasurable, stopping) — [`StoreEvaluator::last_outcome`] says which.
    fn evaluate(&mut self, batch_sizes: &[u32]) -> Result<Option<f64>> {
        if batch_sizes.len() != self.task_ids.len() {
            return Err(TunerError::InvalidInput(format!(
                "{} batch sizes for {} tasks",
                batch_sizes.len(),
                self.task_ids.len()
            )));
        }
        let round = self.assign(batch_sizes)?;
        let outcome = self.wait(round, batch_sizes)?;
        let result = match &outcome {
            RoundOutcome::Measured {
                sum_pd, reports, ..
            } => {
                let reports = reports.clone();
                if let Err(err) = self.write_samples(round, &reports) {
                    tracing::warn!(%err, round, "cannot write co-location samples");
                    Metrics::inc(&self.metrics.errors);
                }
                Ok(Some(*sum_pd))
            }
            RoundOutcome::OutOfMemory { tasks, .. } => {
                let table = self.tasks_rx.borrow().clone();
                for task in tasks {
                    if let Some(r) = table.tasks.get(task).and_then(|e| e.report.as_ref()) {
                        self.knowledge
                            .entry(task.clone())
                            .or_default()
                            .learn_report(r, false);
                    }
                }
                Ok(None)
            }
            RoundOutcome::TimedOut { missing, .. } => Err(TunerError::RoundTimeout {
                round,
                timeout_ms: u64::try_from(self.params.timeout.as_millis()).unwrap_or(u64::MAX),
                missing: missing.clone(),
            }),
            RoundOutcome::ResidentsChanged { .. } => Err(TunerError::Daemon(format!(
                "round {round}: the tasks on the device changed"
            ))),
            RoundOutcome::Unmeasurable { tasks, .. } => Err(TunerError::Daemon(format!(
                "round {round}: no solo step time at m0 for {tasks:?}"
            ))),
            RoundOutcome::Stopped => Err(TunerError::Daemon("stopping".to_owned())),
        };
        self.last = Some(outcome);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lr_factor_follows_the_task_rule() {
        let spec = |rule: LrScalingRule| TaskSpec {
            initial_batch_size: 16,
            lr_rule: rule as i32,
            ..Default::default()
        };
        let f = |rule, m, phi| StoreEvaluator::lr_factor(&spec(rule), m, phi);
        assert_eq!(f(LrScalingRule::Linear, 64, None), 4.0);
        assert_eq!(f(LrScalingRule::Sqrt, 64, None), 2.0);
        assert_eq!(f(LrScalingRule::Unspecified, 64, None), 1.0);
        assert_eq!(f(LrScalingRule::Adascale, 64, None), 2.0);
        // φ = 16: (16/16 + 1) / (16/64 + 1) = 1.6.
        assert!((f(LrScalingRule::Adascale, 64, Some(16.0)) - 1.6).abs() < 1e-12);
    }

    #[test]
    fn round_params_are_checked() {
        assert!(
            RoundParams {
                timeout: Duration::ZERO,
                reports_per_round: 1
            }
            .check()
            .is_err()
        );
    }
}
