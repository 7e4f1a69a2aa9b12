//! The per-device tuner loop, driven by the engine's tuning rounds: the tuner crate's
//! GP-LCB [`Controller`] (stopping rule, hysteresis) over the joint batch sizes of
//! the device's residents, its memory constraint from the tuner's conservative
//! memory model of each task, and Σ PD measured from the agents' reports with the
//! tuner's own [`PdInput`]. One configuration per reporting interval: the engine
//! applies it, the emulated agents report, the next round measures it.

use iadeep_tuner::degradation::PdInput;
use iadeep_tuner::search::{
    Controller, ControllerParams, Decision as TunerDecision, GpLcb, LcbParams, MemoryConstraint,
    SearchSpace,
};

use crate::policy::iadeep::knowledge::Knowledge;
use crate::view::Resident;

/// Hard cap on rounds per search (the stopping rule usually ends it sooner).
pub const MAX_ROUNDS: usize = 12;

/// Once settled, the running configuration is re-measured every this many reporting
/// intervals, to notice drift (the daemon's `settled_interval`). Spaced wider than the
/// daemon's one minute because every re-measurement is an observation the search's
/// Gaussian process keeps, and a task can run for a day.
pub const SETTLED_EVERY: usize = 5;

/// The search of one device for one set of residents.
#[derive(Debug)]
pub struct DeviceTuner {
    /// Task ids the search is over, in lattice order.
    pub tasks: Vec<usize>,
    sizes: Vec<Vec<u32>>,
    controller: Controller,
    /// Configuration applied and waiting to be measured.
    pending: Option<Vec<usize>>,
    pub rounds: usize,
    /// An out-of-memory crash happened under the pending configuration.
    pub oom: bool,
    /// Settled: the configuration kept and the Σ PD expected of it, re-measured every
    /// [`SETTLED_EVERY`] intervals.
    settled: Option<(Vec<usize>, f64)>,
    /// Intervals since the last re-measurement while settled.
    idle: usize,
    /// Times the search re-opened because the measured Σ PD drifted.
    pub reopened: u64,
    /// The measured Σ PD drifted: the owner starts a fresh search from what runs now.
    /// Fresh rather than [`Controller::reopen`], which keeps every observation: they
    /// describe the objective before the drift, and a search that kept them all
    /// through a day-long run would refit its Gaussian process on thousands of points.
    pub drifted: bool,
    /// The search cannot go on (no feasible configuration, a refused measurement).
    pub finished: bool,
}

/// What the device should do next.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    Apply(Vec<(usize, u32)>),
    Wait,
    Done,
}

/// Σ PD of the residents from their reports; `None` if one cannot be computed.
pub fn measured_pd(residents: &[Resident<'_>]) -> Option<f64> {
    let mut total = 0.0;
    for r in residents {
        let input = PdInput {
            m0: f64::from(r.spec.m0),
            solo_step_s_m0: r.spec.solo_step_time_s,
            m: f64::from(r.report.batch_size),
            co_step_s: r.report.step_time_s,
            noise_scale: r.report.grad_noise_scale,
        };
        total += input.pd().ok()?;
    }
    Some(total)
}

impl DeviceTuner {
    /// A new search over the residents (all running), starting at their current sizes.
    pub fn new(
        residents: &[Resident<'_>],
        knowledge: &Knowledge,
        capacity_mib: u64,
        seed: u64,
    ) -> Option<DeviceTuner> {
        let tasks: Vec<usize> = residents.iter().map(|r| r.spec.id).collect();
        let sizes: Vec<Vec<u32>> = residents
            .iter()
            .map(|r| r.spec.batch_sizes.clone())
            .collect();
        let start: Vec<usize> = residents
            .iter()
            .zip(&sizes)
            .map(|(r, s)| s.iter().position(|b| *b == r.report.batch_size))
            .collect::<Option<_>>()?;
        let upper_mib = residents
            .iter()
            .zip(&sizes)
            .map(|(r, s)| {
                s.iter()
                    .map(|b| knowledge.memory_upper_mib(r.spec.id, *b))
                    .collect()
            })
            .collect();
        let space = SearchSpace {
            sizes: sizes.clone(),
            start,
            memory: Some(MemoryConstraint {
                upper_mib,
                capacity_mib: capacity_mib as f64,
                // The placer's margin, so tuning never spends what placement kept free.
                margin: crate::policy::iadeep::placement::sim_params().memory_margin_frac,
            }),
        };
        let search = match GpLcb::new(space, LcbParams::default(), seed) {
            Ok(search) => search,
            Err(err) => {
                tracing::warn!(%err, "cannot set up the batch-size search");
                return None;
            }
        };
        Some(DeviceTuner {
            tasks,
            sizes,
            controller: Controller::new(search, ControllerParams::default()),
            pending: None,
            rounds: 0,
            oom: false,
            settled: None,
            idle: 0,
            reopened: 0,
            drifted: false,
            finished: false,
        })
    }

    fn assignments(&self, idx: &[usize]) -> Vec<(usize, u32)> {
        self.tasks
            .iter()
            .zip(idx.iter().zip(&self.sizes))
            .map(|(t, (i, s))| (*t, s[*i]))
            .collect()
    }

    fn current(&self, residents: &[Resident<'_>]) -> Option<Vec<usize>> {
        residents
            .iter()
            .zip(&self.sizes)
            .map(|(r, s)| s.iter().position(|b| *b == r.report.batch_size))
            .collect()
    }

    /// One round: measure what ran, decide what runs next.
    ///
    /// Once settled the search is not over: like the daemon, the tuner keeps
    /// re-measuring what runs and gives the measurement to the [`Controller`], whose
    /// drift test says when the measured Σ PD left what it expected (the statistical
    /// efficiency changes as training progresses, so the best batch sizes do too);
    /// the owner then starts a fresh search ([`DeviceTuner::drifted`]). A search
    /// settled by the [`MAX_ROUNDS`] cap, or kept on another configuration by
    /// hysteresis, gets the same test against the predicted Σ PD of what runs, with
    /// the controller's threshold.
    pub fn round(&mut self, residents: &[Resident<'_>]) -> Next {
        if self.finished {
            return Next::Done;
        }
        if self.drifted {
            return Next::Wait;
        }
        let Some(current) = self.current(residents) else {
            return Next::Wait;
        };
        if self.settled.is_some() {
            return self.remeasure(residents, current);
        }
        let measured = if std::mem::take(&mut self.oom) {
            None
        } else {
            match measured_pd(residents) {
                Some(v) => Some(v),
                None => return Next::Wait,
            }
        };
        let idx = self.pending.take().unwrap_or_else(|| current.clone());
        if let Err(err) = self.controller.record(&idx, measured) {
            tracing::warn!(%err, "tuner refused a measurement; stopping this search");
            self.finished = true;
            return Next::Done;
        }
        self.rounds += 1;
        let decision = if self.rounds >= MAX_ROUNDS {
            match self.controller.search().incumbent() {
                Ok(Some((best, _))) => TunerDecision::Settle(best),
                _ => TunerDecision::Settle(current.clone()),
            }
        } else {
            match self.controller.decide() {
                Ok(decision) => decision,
                Err(err) => {
                    tracing::debug!(%err, "no feasible configuration to explore; keeping the current one");
                    self.finished = true;
                    return Next::Done;
                }
            }
        };
        match decision {
            TunerDecision::Explore(next) => {
                self.pending = Some(next.clone());
                Next::Apply(self.assignments(&next))
            }
            TunerDecision::Settle(best) => {
                let switch = self
                    .controller
                    .worth_switching(&current, &best)
                    .unwrap_or(false);
                let keep = if switch { best } else { current };
                let expected = self
                    .controller
                    .search()
                    .predict(&keep)
                    .ok()
                    .flatten()
                    .map(|p| p.mean)
                    .or(measured);
                match expected {
                    Some(expected) => {
                        self.settled = Some((keep.clone(), expected));
                        self.idle = 0;
                    }
                    // Nothing to compare a re-measurement with: keep it, stop here.
                    None => self.finished = true,
                }
                if switch {
                    Next::Apply(self.assignments(&keep))
                } else if self.finished {
                    Next::Done
                } else {
                    Next::Wait
                }
            }
        }
    }

    /// A settled round: every [`SETTLED_EVERY`] intervals, measure what runs and
    /// re-open the search if it drifted.
    fn remeasure(&mut self, residents: &[Resident<'_>], current: Vec<usize>) -> Next {
        let Some((kept, expected)) = self.settled.clone() else {
            return Next::Wait;
        };
        self.idle += 1;
        let oom = std::mem::take(&mut self.oom);
        if !oom && self.idle < SETTLED_EVERY {
            return Next::Wait;
        }
        self.idle = 0;
        let measured = if oom { None } else { measured_pd(residents) };
        if !oom && measured.is_none() {
            return Next::Wait;
        }
        // The controller tests drift only on the configuration it settled on; when
        // hysteresis kept another one running, the same test is applied here.
        let by_controller = matches!(
            self.controller.decide(),
            Ok(TunerDecision::Settle(ref idx)) if *idx == current
        );
        if let Err(err) = self.controller.record(&current, measured) {
            tracing::warn!(%err, "tuner refused a measurement; stopping this search");
            self.finished = true;
            return Next::Done;
        }
        let drift = self.controller.params().drift;
        let drifted = if by_controller {
            // The controller applied its own test and re-opened itself.
            !self.controller.is_settled()
        } else {
            current != kept
                || measured.is_none_or(|v| (v - expected).abs() > drift * expected.abs())
        };
        if !drifted {
            return Next::Wait;
        }
        tracing::debug!(?measured, expected, tasks = ?self.tasks, "measured Σ PD drifted; re-opening the search");
        self.settled = None;
        self.drifted = true;
        self.reopened += 1;
        Next::Wait
    }
}
