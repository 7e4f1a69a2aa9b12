//! Per-job interference effects learned online: how much more (or less) a job has
//! been slowed down as a task, and how much more it has slowed others as a
//! co-runner, than the profile model predicted.
//!
//! Two jobs with similar solo profiles can interfere differently (one is
//! compute-bound, the other waits on memory), and the jobs of a cluster recur: the
//! same model at the same batch size is submitted again and again. After the
//! profile model (linear base), the remaining error of a sample, in the target's
//! unit, is modelled as `sensitivity(task) + Σ aggressiveness(co-runner)`: each the
//! mean residual of the job's samples in that role, shrunk towards 0 by
//! `n / (n + prior)`, fitted by a few rounds of backfitting between the two roles.
//! This is the additive part of a pairwise interference matrix, which a forest
//! learns only slowly from few samples.
//!
//! A job never seen has both effects 0, so for a new model the prediction is the
//! profile model's alone: the effects refine what the profile features generalise,
//! they do not replace them. Jobs are keyed by model name and batch size.

use std::collections::HashMap;
use std::sync::Arc;

use iadeep_proto::{CoLocationSample, TaskProfile};

use crate::window::stable_hash;

/// Rounds of backfitting between sensitivities and aggressiveness; the effects
/// change by well under 1 % of their size after four on the Gavel samples.
const ROUNDS: usize = 4;

/// A job's key: the stable hash of its model name and batch size. A hash rather
/// than the name keeps a prediction free of allocations; two jobs sharing a 64-bit
/// hash would only share their effects.
type JobKey = u64;

fn key(p: &TaskProfile) -> JobKey {
    let mut bytes = [0u8; 12];
    bytes[..8].copy_from_slice(&stable_hash(p.model.as_bytes()).to_le_bytes());
    bytes[8..].copy_from_slice(&p.batch_size.to_le_bytes());
    stable_hash(&bytes)
}

/// Fitted per-job effects, in the unit of the residuals they were fitted on.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobEffects {
    sensitivity: HashMap<JobKey, f64>,
    aggressiveness: HashMap<JobKey, f64>,
}

/// Shrunk means of `(sum, count)` accumulators.
fn shrunk(sums: HashMap<JobKey, (f64, f64)>, prior: f64) -> HashMap<JobKey, f64> {
    sums.into_iter()
        .map(|(k, (sum, n))| (k, sum / (n + prior)))
        .collect()
}

impl JobEffects {
    /// Fits the effects on `residuals[i]`, the residual of `samples[i]`, with
    /// shrinkage `prior` (in samples; 0 = plain means). Samples without a task and
    /// residuals past the end of either slice are ignored.
    pub fn fit(samples: &[Arc<CoLocationSample>], residuals: &[f64], prior: f64) -> JobEffects {
        let prior = if prior.is_finite() {
            prior.max(0.0)
        } else {
            0.0
        };
        let pairs: Vec<(&TaskProfile, &[TaskProfile], f64)> = samples
            .iter()
            .zip(residuals)
            .filter_map(|(s, r)| s.task.as_ref().map(|t| (t, s.corunners.as_slice(), *r)))
            .collect();
        let mut fx = JobEffects::default();
        for _ in 0..ROUNDS {
            let mut sums: HashMap<JobKey, (f64, f64)> = HashMap::new();
            for &(task, corunners, r) in &pairs {
                let e = sums.entry(key(task)).or_default();
                e.0 += r - fx.aggressiveness_of(corunners);
                e.1 += 1.0;
            }
            fx.sensitivity = shrunk(sums, prior);
            let mut sums: HashMap<JobKey, (f64, f64)> = HashMap::new();
            for &(task, corunners, r) in &pairs {
                let rest = r - fx.sensitivity_of(task) - fx.aggressiveness_of(corunners);
                for c in corunners {
                    // This co-runner's share: the residual minus everyone else's effect.
                    let e = sums.entry(key(c)).or_default();
                    e.0 += rest + fx.aggressiveness.get(&key(c)).copied().unwrap_or(0.0);
                    e.1 += 1.0;
                }
            }
            fx.aggressiveness = shrunk(sums, prior);
        }
        fx
    }

    fn sensitivity_of(&self, task: &TaskProfile) -> f64 {
        self.sensitivity.get(&key(task)).copied().unwrap_or(0.0)
    }

    fn aggressiveness_of(&self, corunners: &[TaskProfile]) -> f64 {
        corunners
            .iter()
            .map(|c| self.aggressiveness.get(&key(c)).copied().unwrap_or(0.0))
            .sum()
    }

    /// The effect for `task` next to `corunners` (0 for jobs never seen).
    pub fn predict(&self, task: &TaskProfile, corunners: &[TaskProfile]) -> f64 {
        self.sensitivity_of(task) + self.aggressiveness_of(corunners)
    }

    /// Number of jobs with a sensitivity and with an aggressiveness.
    #[cfg(test)]
    fn n_jobs(&self) -> (usize, usize) {
        (self.sensitivity.len(), self.aggressiveness.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(model: &str) -> TaskProfile {
        TaskProfile {
            model: model.into(),
            batch_size: 32,
            solo_step_time_s: 0.1,
            ..Default::default()
        }
    }

    fn sample(task: &str, co: &str) -> Arc<CoLocationSample> {
        Arc::new(CoLocationSample {
            device_kind: "k80".into(),
            task: Some(p(task)),
            corunners: vec![p(co)],
            slowdown: 1.5,
            ..Default::default()
        })
    }

    #[test]
    fn recovers_additive_effects_and_leaves_new_jobs_at_zero() {
        let sens = [("a", 0.3), ("b", -0.1), ("c", 0.0)];
        let aggr = [("a", -0.2), ("b", 0.25), ("c", 0.05)];
        let mut samples = Vec::new();
        let mut residuals = Vec::new();
        for (t, st) in sens {
            for (c, ac) in aggr {
                samples.push(sample(t, c));
                residuals.push(st + ac);
            }
        }
        let fx = JobEffects::fit(&samples, &residuals, 0.0);
        for (t, st) in sens {
            for (c, ac) in aggr {
                let got = fx.predict(&p(t), &[p(c)]);
                assert!(
                    (got - (st + ac)).abs() < 0.02,
                    "{t}|{c}: {got} vs {}",
                    st + ac
                );
            }
        }
        assert_eq!(fx.predict(&p("never-seen"), &[p("nor-this")]), 0.0);
        assert_eq!(fx.n_jobs(), (3, 3));
    }

    #[test]
    fn the_prior_shrinks_rarely_seen_jobs() {
        let samples = vec![sample("a", "z")];
        let loose = JobEffects::fit(&samples, &[0.4], 0.0);
        let tight = JobEffects::fit(&samples, &[0.4], 3.0);
        let got = |fx: &JobEffects| fx.predict(&p("a"), &[p("z")]);
        assert!(got(&tight).abs() < got(&loose).abs());
        assert!(got(&tight) > 0.0);
    }
}
