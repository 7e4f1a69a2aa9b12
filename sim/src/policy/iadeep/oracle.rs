//! `oracle`: iadeep's placement rule and tuning objective with perfect information, the
//! limit that better prediction and tuning could reach (docs/design.md, "Level
//! baselines"). It is the `iadeep` policy with three parts swapped for the world's truth:
//!
//! - the placer (the production `PlacementService`, same rule and parameters) scores with
//!   [`TrueSlowdown`], the world's slowdowns under its interference model, instead of the
//!   learned predictor;
//! - it sizes memory with [`TrueMemory`], the world's peak of each job type with the largest
//!   fragmentation a run can have, instead of the profile and the agents' reports;
//! - instead of GP-LCB on measured rounds, each device's batch sizes are chosen by
//!   [`Truth::best_sizes`]: the joint configuration with the smallest true Σ PD (the
//!   tuner's objective with the world's step times and φ), searched exhaustively, among
//!   those whose true memory fits the card; re-chosen every [`ORACLE_RETUNE_S`] as φ moves.
//!   Production jobs' caps bind it as they bind the tuner: a configuration that puts a
//!   production job's true PD above its cap is chosen only when every configuration does,
//!   and then the one that passes the caps least; the oracle then declares a cap breach,
//!   which the placer's eviction executor acts on as it does on a tuner's
//!   ([`BestSizes::over_cap`]).
//!
//! Its agents still report (with noise); it ignores them for every decision it can take
//! from the truth. The gap between iadeep and the oracle is what imperfect prediction,
//! memory modelling and search cost.
//!
//! **The gap attributed** ([`Oracle`]): four more policies replace exactly one learned
//! part of `iadeep` by the truth and keep the rest, through the same code: the placer's
//! slowdown model (`oracle-prediction`), its memory estimator (`oracle-memory`), the
//! tuners (`oracle-tuning`), and the queue rule's wait `W` (`oracle-wait`, [`TrueWait`]).
//! What each closes of the `iadeep` → `oracle` gap is in `iadeep sim`'s output.

use std::collections::HashMap;
use std::sync::Arc;

use iadeep_objective::PdInput;
use iadeep_placer::{MemoryEstimator, ObservedWait, WaitModel};
use iadeep_predictor::{Prediction, PredictionSource, SlowdownModel};
use iadeep_proto::{CoLocationSample, TaskProfile, TaskReport, TaskSpec as ProtoSpec};

use crate::policy::iadeep::placement::{task_key, unix_ms};
use crate::view::{ResidentJob, SoloProfile};
use crate::world::{TypeId, World, memory};

/// Seconds between two choices of a device's batch sizes: φ changes over training and
/// the best configuration moves with it. As often as `pollux` re-chooses (the engine's
/// tuning interval), so the limit is not staler than a baseline (a longer interval made
/// it measurably worse, see docs/simulator-experiments.md, "Oracle retuning interval").
/// The engine also calls again whenever the residents change.
pub const ORACLE_RETUNE_S: f64 = 60.0;

/// Largest joint lattice searched exhaustively; larger ones (five or more tasks with many
/// sizes each) fall back to coordinate descent from what runs.
pub const MAX_EXHAUSTIVE_CONFIGURATIONS: usize = 50_000;

/// Which learned parts of iadeep an oracle policy replaces by the world's truth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Oracle {
    /// `oracle`: true slowdowns, true memory, the true Σ PD searched exhaustively, and
    /// every task submitted with its true solo profile (the limit). The queue rule's
    /// wait stays the production one: what it weighs is the future traffic, which the
    /// limit does not claim to know.
    All,
    /// `oracle-prediction`: the placer scores with the world's slowdowns; the tuners'
    /// samples go nowhere.
    Prediction,
    /// `oracle-memory`: the placer sizes reservations, shrinks and the bounds it writes
    /// with the world's memory (the tuners keep their own memory models).
    Memory,
    /// `oracle-tuning`: each GPU's batch sizes by the true Σ PD searched exhaustively,
    /// instead of the tuners. No tuner runs, so the predictor gets no samples: its
    /// measured rounds are what feed it.
    Tuning,
    /// `oracle-wait`: the queue rule's `W` is the wait the task really had ([`TrueWait`]).
    Wait,
}

impl Oracle {
    /// Every oracle, in table order.
    pub const ALL: [Oracle; 5] = [
        Oracle::All,
        Oracle::Prediction,
        Oracle::Memory,
        Oracle::Tuning,
        Oracle::Wait,
    ];

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            Oracle::All => "oracle",
            Oracle::Prediction => "oracle-prediction",
            Oracle::Memory => "oracle-memory",
            Oracle::Tuning => "oracle-tuning",
            Oracle::Wait => "oracle-wait",
        }
    }

    /// The oracle named `name`, if it is one.
    pub fn from_name(name: &str) -> Option<Oracle> {
        Oracle::ALL.into_iter().find(|o| o.name() == name)
    }

    pub fn prediction(self) -> bool {
        matches!(self, Oracle::All | Oracle::Prediction)
    }

    pub fn memory(self) -> bool {
        matches!(self, Oracle::All | Oracle::Memory)
    }

    pub fn tuning(self) -> bool {
        matches!(self, Oracle::All | Oracle::Tuning)
    }

    pub fn wait(self) -> bool {
        self == Oracle::Wait
    }

    /// Tasks are submitted with their true solo profile.
    pub fn profiles(self) -> bool {
        self == Oracle::All
    }
}

/// The true wait for `oracle-wait`: how long each task really waited until it started in
/// an `iadeep` run of the same stream, counted down from the decision. What a queued task
/// waits depends on what every later decision does, so no state of the world at the
/// decision holds it; hindsight on the run being improved does. Once a task waits past
/// the start it had there (this run went differently), the truth is spent and the
/// production estimate answers.
#[derive(Debug)]
pub struct TrueWait {
    /// Each task's start in the `iadeep` run, Unix ms as the placer's clock reads it.
    starts_ms: HashMap<String, i64>,
    production: ObservedWait,
}

impl TrueWait {
    /// From the (task, start s) of an `iadeep` run.
    pub fn new(starts: &[(usize, f64)]) -> TrueWait {
        TrueWait {
            starts_ms: starts
                .iter()
                .map(|&(task, start_s)| (task_key(task), unix_ms(start_s)))
                .collect(),
            production: ObservedWait::default(),
        }
    }
}

impl WaitModel for TrueWait {
    fn wait_s(
        &self,
        task: &ProtoSpec,
        residents_done_s: Option<f64>,
        now_unix_ms: i64,
    ) -> Option<f64> {
        match self.starts_ms.get(&task.task_id) {
            Some(&start) if start > now_unix_ms => Some((start - now_unix_ms) as f64 / 1000.0),
            _ => self.production.wait_s(task, residents_done_s, now_unix_ms),
        }
    }

    fn queued(&self, task_id: &str, residents_done_s: f64, now_unix_ms: i64) {
        self.production
            .queued(task_id, residents_done_s, now_unix_ms);
    }

    fn placed(&self, task_id: &str, now_unix_ms: i64) {
        self.production.placed(task_id, now_unix_ms);
    }
}

/// The world's truth as the oracle reads it.
#[derive(Debug)]
pub struct Truth {
    world: World,
    family_by_model: HashMap<String, usize>,
}

/// One running resident for the search: its family, m0, candidate sizes and φ now.
struct Searched {
    family: usize,
    m0: u32,
    sizes: Vec<u32>,
    phi: Option<f64>,
    /// A production job's slowdown cap.
    cap: Option<f64>,
}

/// A configuration's value: how far it puts production jobs above their caps (the most
/// any is, 0 when none is), then Σ PD. Smaller is better, in that order.
type Value = (f64, f64);

fn better(a: Value, b: Value) -> bool {
    a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)).is_lt()
}

/// The oracle's choice for a device (see [`Truth::best_sizes`]).
#[derive(Clone, Debug, PartialEq)]
pub struct BestSizes {
    /// (task, batch size) of each running resident.
    pub sizes: Vec<(usize, u32)>,
    /// The production job furthest above its cap in that configuration, with its true PD
    /// and cap, when even the best configuration passes a cap.
    pub over_cap: Option<(usize, f64, f64)>,
}

impl Truth {
    /// The truth of `world` (the oracle keeps its own copy).
    pub fn new(world: &World) -> Arc<Truth> {
        let family_by_model = world
            .catalogue
            .families
            .iter()
            .enumerate()
            .map(|(i, f)| (f.name.clone(), i))
            .collect();
        Arc::new(Truth {
            world: world.clone(),
            family_by_model,
        })
    }

    /// The job type of a task of `model` (a family name) at `batch_size`.
    fn job(&self, model: &str, batch_size: u32) -> Option<TypeId> {
        let family = *self.family_by_model.get(model)?;
        self.world.catalogue.type_of(family, batch_size)
    }

    /// True IF of `job` next to `others`.
    fn slowdown(&self, job: TypeId, others: &[TypeId]) -> f64 {
        let alone = self.world.steps_per_s(job, std::iter::empty());
        let shared = self.world.steps_per_s(job, others.iter().copied());
        alone / shared
    }

    /// The solo profile of a task of `model` at `m0` as the world has it: its exact step
    /// time alone and the most a run of it can take. The oracle places with perfect
    /// information whatever the jobs bring (`--job-info`).
    pub fn solo_profile(&self, model: &str, m0: u32) -> Option<SoloProfile> {
        let job = self.job(model, m0)?;
        let steps_per_s = self.world.steps_per_s(job, std::iter::empty());
        (steps_per_s > 0.0).then(|| SoloProfile {
            step_time_s: 1.0 / steps_per_s,
            peak_mem_mib: self.peak_bound_mib(job),
        })
    }

    /// The most a run of a task of `model` at `batch_size` can take, MiB.
    pub fn bound_mib(&self, model: &str, batch_size: u32) -> Option<u64> {
        self.job(model, batch_size)
            .map(|job| self.peak_bound_mib(job))
    }

    /// The most a run of `job` can take: its peak with the largest fragmentation.
    fn peak_bound_mib(&self, job: TypeId) -> u64 {
        self.world.memory.peak_mib(job, memory::FRAGMENTATION_MAX)
    }

    /// The configuration of `residents` (running ones only, in order) with the smallest
    /// true Σ PD whose true memory fits the card, among those that keep every production
    /// job under its cap if any does (else the one passing the caps least), or `None` when
    /// none of them runs or nothing fits.
    pub fn best_sizes(&self, residents: &[ResidentJob<'_>]) -> Option<BestSizes> {
        let running: Vec<&ResidentJob<'_>> =
            residents.iter().filter(|r| r.report.running).collect();
        let searched: Vec<Searched> = running
            .iter()
            .map(|r| {
                let family = *self.family_by_model.get(&r.spec.model)?;
                let fraction = if r.spec.total_samples > 0.0 {
                    (r.report.samples_done / r.spec.total_samples).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                Some(Searched {
                    family,
                    m0: r.spec.m0,
                    sizes: r.spec.batch_sizes.clone(),
                    phi: self.world.phi(family, fraction),
                    cap: r.spec.max_slowdown,
                })
            })
            .collect::<Option<_>>()?;
        if searched.is_empty() {
            return None;
        }
        let lattice: usize = searched
            .iter()
            .map(|s| s.sizes.len().max(1))
            .try_fold(1usize, |acc, n| acc.checked_mul(n))
            .unwrap_or(usize::MAX);
        let current: Vec<usize> = running
            .iter()
            .zip(&searched)
            .map(|(r, s)| {
                s.sizes
                    .iter()
                    .position(|&b| b == r.report.batch_size)
                    .unwrap_or(0)
            })
            .collect();
        let best = if lattice <= MAX_EXHAUSTIVE_CONFIGURATIONS {
            self.exhaustive(&searched)
        } else {
            self.descent(&searched, current)
        }?;
        let over_cap = self.pds(&searched, &best).and_then(|pds| {
            running
                .iter()
                .zip(&searched)
                .zip(pds)
                .filter_map(|((r, s), pd)| s.cap.filter(|c| pd > *c).map(|c| (r.spec.id, pd, c)))
                .max_by(|a, b| (a.1 - a.2).total_cmp(&(b.1 - b.2)))
        });
        Some(BestSizes {
            sizes: running
                .iter()
                .zip(&searched)
                .zip(best)
                .map(|((r, s), i)| (r.spec.id, s.sizes[i]))
                .collect(),
            over_cap,
        })
    }

    /// The value of a configuration (indices into each task's sizes, see [`Value`]),
    /// `None` when it does not fit the card or a size is not a world job type.
    fn value(&self, searched: &[Searched], config: &[usize]) -> Option<Value> {
        let pds = self.pds(searched, config)?;
        let over = searched
            .iter()
            .zip(&pds)
            .filter_map(|(s, pd)| s.cap.map(|c| (pd - c).max(0.0)))
            .fold(0.0, f64::max);
        let mut sum = 0.0;
        for pd in pds {
            sum += pd;
        }
        Some((over, sum))
    }

    /// Each task's true PD in a configuration (indices into each task's sizes), `None`
    /// when it does not fit the card or a size is not a world job type.
    fn pds(&self, searched: &[Searched], config: &[usize]) -> Option<Vec<f64>> {
        let jobs: Vec<TypeId> = searched
            .iter()
            .zip(config)
            .map(|(s, &i)| self.world.catalogue.type_of(s.family, s.sizes[i]))
            .collect::<Option<_>>()?;
        let memory: u64 = jobs.iter().map(|&j| self.peak_bound_mib(j)).sum();
        if memory > self.world.memory.capacity_mib {
            return None;
        }
        let mut pds = Vec::with_capacity(searched.len());
        for (k, s) in searched.iter().enumerate() {
            let others: Vec<TypeId> = (0..jobs.len())
                .filter(|&j| j != k)
                .map(|j| jobs[j])
                .collect();
            let at_m0 = self.world.catalogue.type_of(s.family, s.m0)?;
            let co_steps = self.world.steps_per_s(jobs[k], others.iter().copied());
            let solo_steps_m0 = self.world.steps_per_s(at_m0, std::iter::empty());
            pds.push(
                PdInput {
                    m0: f64::from(s.m0),
                    solo_step_s_m0: 1.0 / solo_steps_m0,
                    m: f64::from(s.sizes[config[k]]),
                    co_step_s: 1.0 / co_steps,
                    noise_scale: s.phi,
                }
                .pd()
                .ok()?,
            );
        }
        Some(pds)
    }

    fn exhaustive(&self, searched: &[Searched]) -> Option<Vec<usize>> {
        let mut config = vec![0usize; searched.len()];
        let mut best: Option<(Value, Vec<usize>)> = None;
        loop {
            if let Some(v) = self.value(searched, &config)
                && best.as_ref().is_none_or(|(b, _)| better(v, *b))
            {
                best = Some((v, config.clone()));
            }
            // Next configuration (odometer order).
            let mut k = 0;
            loop {
                if k == config.len() {
                    return best.map(|(_, c)| c);
                }
                config[k] += 1;
                if config[k] < searched[k].sizes.len() {
                    break;
                }
                config[k] = 0;
                k += 1;
            }
        }
    }

    /// Coordinate descent from `start` (for lattices too large to enumerate): each task in
    /// turn moves to its best size with the others fixed, until nothing improves.
    fn descent(&self, searched: &[Searched], start: Vec<usize>) -> Option<Vec<usize>> {
        let mut config = start;
        let mut value = self
            .value(searched, &config)
            .unwrap_or((f64::INFINITY, f64::INFINITY));
        loop {
            let mut improved = false;
            for k in 0..config.len() {
                for i in 0..searched[k].sizes.len() {
                    let mut trial = config.clone();
                    trial[k] = i;
                    if let Some(v) = self.value(searched, &trial)
                        && better(v, value)
                    {
                        (config, value) = (trial, v);
                        improved = true;
                    }
                }
            }
            if !improved {
                return value.1.is_finite().then_some(config);
            }
        }
    }
}

/// The world's slowdowns as the placer's model: certain, and never learning.
#[derive(Debug)]
pub struct TrueSlowdown(pub Arc<Truth>);

impl SlowdownModel for TrueSlowdown {
    fn predict(
        &self,
        _device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> Prediction {
        let job = self.0.job(&task.model, task.batch_size);
        let others: Option<Vec<TypeId>> = corunners
            .iter()
            .map(|c| self.0.job(&c.model, c.batch_size))
            .collect();
        match (job, others) {
            (Some(job), Some(others)) => {
                Prediction::certain(self.0.slowdown(job, &others), PredictionSource::Given)
            }
            // Not a world job type (cannot happen for the simulator's tasks): the worst.
            _ => Prediction::certain(f64::MAX, PredictionSource::Given),
        }
    }

    fn observe(&self, _sample: &CoLocationSample) {}

    /// The truth never changes: the placer may reuse every prediction.
    fn version(&self) -> Option<u64> {
        Some(0)
    }
}

/// The world's memory as the placer's estimator: the most a run of the task's job type at
/// that size can take.
#[derive(Debug)]
pub struct TrueMemory(pub Arc<Truth>);

impl MemoryEstimator for TrueMemory {
    fn bound_mib(
        &self,
        spec: &ProtoSpec,
        _report: Option<&TaskReport>,
        batch_size: u32,
    ) -> Option<u64> {
        self.0.bound_mib(&spec.model, batch_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(task: usize) -> ProtoSpec {
        ProtoSpec {
            task_id: task_key(task),
            ..ProtoSpec::default()
        }
    }

    /// The true wait counts down to the task's start in the `iadeep` run, then (and for
    /// tasks it does not know) the production estimate answers.
    #[test]
    fn the_true_wait_is_hindsight_until_it_is_spent() {
        let wait = TrueWait::new(&[(1, 500.0)]);
        assert_eq!(
            wait.wait_s(&spec(1), Some(20.0), unix_ms(100.0)),
            Some(400.0)
        );
        // Known even where no device says when it frees up.
        assert_eq!(wait.wait_s(&spec(1), None, unix_ms(499.0)), Some(1.0));
        assert_eq!(
            wait.wait_s(&spec(1), Some(20.0), unix_ms(500.0)),
            Some(20.0)
        );
        assert_eq!(wait.wait_s(&spec(2), Some(20.0), unix_ms(0.0)), Some(20.0));
        assert_eq!(wait.wait_s(&spec(2), None, unix_ms(0.0)), None);
    }

    #[test]
    fn each_single_part_oracle_names_one_part_and_the_oracle_three() {
        let parts = |o: Oracle| [o.prediction(), o.memory(), o.tuning(), o.wait()];
        assert_eq!(parts(Oracle::All), [true, true, true, false]);
        for o in &Oracle::ALL[1..] {
            assert_eq!(parts(*o).iter().filter(|p| **p).count(), 1, "{o:?}");
            assert!(!o.profiles());
            assert_eq!(Oracle::from_name(o.name()), Some(*o));
        }
    }
}
