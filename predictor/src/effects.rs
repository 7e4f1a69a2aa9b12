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
//!
//! With a family level (`LearnerParams::family_effects_prior`) each role is the
//! model family's effect plus the job's deviation from it, each shrunk: the job's
//! towards its family's, the family's towards 0, the population. A known model at a
//! batch size never seen then starts from what its other sizes showed, and a known
//! co-runner's effect on a new task, what transfers to a model never seen, is
//! pooled over all its sizes (docs/predictor-experiments.md, "Transfer to models
//! never seen").

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

/// A model family's key (every batch size of one model name).
fn family_key(p: &TaskProfile) -> JobKey {
    stable_hash(p.model.as_bytes())
}

/// One role's effects (sensitivity as a task, or aggressiveness as a co-runner) at
/// two levels: the model family's, shared by all its batch sizes, and each job's
/// deviation from it. A job seen at a new batch size starts from its family's
/// effect; a family never seen from 0, the population.
#[derive(Clone, Debug, Default, PartialEq)]
struct Role {
    family: HashMap<JobKey, f64>,
    job: HashMap<JobKey, f64>,
}

impl Role {
    fn of(&self, p: &TaskProfile) -> f64 {
        self.family_of(p) + self.job_of(p)
    }

    fn family_of(&self, p: &TaskProfile) -> f64 {
        self.family.get(&family_key(p)).copied().unwrap_or(0.0)
    }

    fn job_of(&self, p: &TaskProfile) -> f64 {
        self.job.get(&key(p)).copied().unwrap_or(0.0)
    }
}

/// Fitted per-job effects, in the unit of the residuals they were fitted on.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobEffects {
    sensitivity: Role,
    aggressiveness: Role,
}

/// Shrunk means of `(sum, count)` accumulators.
fn shrunk(sums: HashMap<JobKey, (f64, f64)>, prior: f64) -> HashMap<JobKey, f64> {
    sums.into_iter()
        .map(|(k, (sum, n))| (k, sum / (n + prior)))
        .collect()
}

/// A shrinkage prior as given, or 0 when it is not a non-negative number.
fn clean_prior(prior: f64) -> f64 {
    if prior.is_finite() {
        prior.max(0.0)
    } else {
        0.0
    }
}

/// A sample as the effects see it: task, co-runners, residual.
type Pair<'s> = (&'s TaskProfile, &'s [TaskProfile], f64);

/// Which level of a role one backfitting step refits.
#[derive(Clone, Copy, PartialEq)]
enum Level {
    Family,
    Job,
}

impl JobEffects {
    /// Fits the effects on `residuals[i]`, the residual of `samples[i]`, with
    /// shrinkage `prior` (in samples; 0 = plain means) of each job's effect towards
    /// its family's, and, with `family_prior`, shrinkage of each family's effect
    /// towards 0 (`None`: no family level, each job shrinks towards 0 directly).
    /// Samples without a task and residuals past the end of either slice are
    /// ignored.
    pub fn fit(
        samples: &[Arc<CoLocationSample>],
        residuals: &[f64],
        prior: f64,
        family_prior: Option<f64>,
    ) -> JobEffects {
        let prior = clean_prior(prior);
        let family_prior = family_prior.map(clean_prior);
        let pairs: Vec<Pair> = samples
            .iter()
            .zip(residuals)
            .filter_map(|(s, r)| s.task.as_ref().map(|t| (t, s.corunners.as_slice(), *r)))
            .collect();
        let mut fx = JobEffects::default();
        for _ in 0..ROUNDS {
            if let Some(fp) = family_prior {
                fx.sensitivity.family = fx.refit_sensitivity(&pairs, Level::Family, fp);
            }
            fx.sensitivity.job = fx.refit_sensitivity(&pairs, Level::Job, prior);
            if let Some(fp) = family_prior {
                fx.aggressiveness.family = fx.refit_aggressiveness(&pairs, Level::Family, fp);
            }
            fx.aggressiveness.job = fx.refit_aggressiveness(&pairs, Level::Job, prior);
        }
        fx
    }

    /// The sensitivities at `level` given every other effect: each the shrunk mean of
    /// what the rest leaves of its samples.
    fn refit_sensitivity(&self, pairs: &[Pair], level: Level, prior: f64) -> HashMap<JobKey, f64> {
        let mut sums: HashMap<JobKey, (f64, f64)> = HashMap::new();
        for &(task, corunners, r) in pairs {
            let (k, own) = match level {
                Level::Family => (family_key(task), self.sensitivity.family_of(task)),
                Level::Job => (key(task), self.sensitivity.job_of(task)),
            };
            let e = sums.entry(k).or_default();
            e.0 += r - self.predict(task, corunners) + own;
            e.1 += 1.0;
        }
        shrunk(sums, prior)
    }

    /// The aggressiveness at `level` given every other effect: each co-runner's share
    /// is the residual minus everyone else's effect.
    fn refit_aggressiveness(
        &self,
        pairs: &[Pair],
        level: Level,
        prior: f64,
    ) -> HashMap<JobKey, f64> {
        let mut sums: HashMap<JobKey, (f64, f64)> = HashMap::new();
        for &(task, corunners, r) in pairs {
            let rest = r - self.predict(task, corunners);
            for c in corunners {
                let (k, own) = match level {
                    Level::Family => (family_key(c), self.aggressiveness.family_of(c)),
                    Level::Job => (key(c), self.aggressiveness.job_of(c)),
                };
                let e = sums.entry(k).or_default();
                e.0 += rest + own;
                e.1 += 1.0;
            }
        }
        shrunk(sums, prior)
    }

    /// The effect for `task` next to `corunners` (0 for jobs never seen).
    pub fn predict(&self, task: &TaskProfile, corunners: &[TaskProfile]) -> f64 {
        self.sensitivity.of(task)
            + corunners
                .iter()
                .map(|c| self.aggressiveness.of(c))
                .sum::<f64>()
    }

    /// Number of jobs with a sensitivity and with an aggressiveness.
    #[cfg(test)]
    fn n_jobs(&self) -> (usize, usize) {
        (self.sensitivity.job.len(), self.aggressiveness.job.len())
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
        let fx = JobEffects::fit(&samples, &residuals, 0.0, None);
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

    /// With a family level, a model seen at some batch sizes lends its effect to a
    /// batch size never seen; with one level that job starts from 0.
    #[test]
    fn a_new_batch_size_starts_from_its_family() {
        let at = |model: &str, batch: u32| TaskProfile {
            batch_size: batch,
            ..p(model)
        };
        let mut samples = Vec::new();
        let mut residuals = Vec::new();
        for batch in [8, 16, 32] {
            for co in ["x", "y", "z"] {
                samples.push(Arc::new(CoLocationSample {
                    device_kind: "k80".into(),
                    task: Some(at("a", batch)),
                    corunners: vec![p(co)],
                    slowdown: 1.5,
                    ..Default::default()
                }));
                residuals.push(0.3);
            }
        }
        let new_size = at("a", 64);
        let one_level = JobEffects::fit(&samples, &residuals, 1.0, None);
        assert_eq!(one_level.predict(&new_size, &[]), 0.0);
        let two_levels = JobEffects::fit(&samples, &residuals, 1.0, Some(1.0));
        let got = two_levels.predict(&new_size, &[]);
        assert!(got > 0.2 && got <= 0.3, "{got}");
        let seen = two_levels.predict(&at("a", 16), &[p("x")]);
        assert!((seen - 0.3).abs() < 0.05, "{seen}");
        assert_eq!(two_levels.predict(&p("never-seen"), &[]), 0.0);
    }

    #[test]
    fn the_prior_shrinks_rarely_seen_jobs() {
        let samples = vec![sample("a", "z")];
        let loose = JobEffects::fit(&samples, &[0.4], 0.0, None);
        let tight = JobEffects::fit(&samples, &[0.4], 3.0, None);
        let got = |fx: &JobEffects| fx.predict(&p("a"), &[p("z")]);
        assert!(got(&tight).abs() < got(&loose).abs());
        assert!(got(&tight) > 0.0);
    }
}
