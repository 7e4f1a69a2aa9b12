//! The device tuners in the simulator: each GPU's [`DeviceTuner`], the tuner crate's state
//! machine that the daemon drives over the store, driven here in virtual time by what the
//! emulated agents report.
//!
//! The driver only describes the device as the daemon's does, and the tuner crate's one
//! [`Translator`] turns that into inputs: every task the placer reserved on the device,
//! with the spec and reservation the placer stored and its current assignment (the
//! placer's view, which the simulated placement keeps as the daemon's watch does), each
//! unexpired room claim as memory held, and each emulated agent's latest report, told
//! once per fresh report. A cap breach goes to the placer's eviction executor. The tuner's
//! assignments go back to the engine, its samples to the predictor, its measurements to
//! the profile registry in the placement's store. The engine calls again when the tuner
//! wants the next reports (one agent report interval later) or at its next wake-up (a
//! round's timeout, a settled check).

use std::collections::{BTreeMap, HashMap};

use iadeep_proto::{
    BatchSizeAssignment, CapBreach, CoLocationSample, DeviceInfo, ProfilePoint, TaskReport,
};
use iadeep_tuner::{Action, DeviceTask, DeviceTuner, DeviceTunerParams, RunningTask, Translator};

use crate::policy::iadeep::placement::{SimPlacement, proto_report, task_key, unix_ms};
use crate::view::PolicyView;

/// How often an emulated agent reports, seconds: the real agent's default
/// (`iadeep_agent::DEFAULT_REPORT_INTERVAL`; an integration test checks they agree).
pub const AGENT_REPORT_INTERVAL_S: f64 = 2.0;

/// One device's tuner and its driver state.
#[derive(Debug)]
pub struct SimTuner {
    tuner: DeviceTuner,
    translator: Translator,
    /// Each running task's report as last built, by task: rebuilt only when the agent
    /// reported afresh, so an unchanged report is not told twice.
    reports: HashMap<usize, (u64, TaskReport)>,
}

/// What a tuner offers the profile registry (its `Action::Profile`).
#[derive(Debug)]
pub struct ProfileUpdate {
    pub model: String,
    pub device_kind: String,
    pub points: Vec<ProfilePoint>,
}

/// What one step of a device tuner asks of the simulation.
#[derive(Debug, Default)]
pub struct Step {
    pub assignments: Vec<BatchSizeAssignment>,
    pub samples: Vec<CoLocationSample>,
    /// Measurements for the profile registry, as the daemon records them.
    pub profiles: Vec<ProfileUpdate>,
    /// Cap breaches the tuner declared (`Action::CapBreached`): what the daemon writes at
    /// the device's breach key for the placer's eviction executor.
    pub breaches: Vec<CapBreach>,
    /// Production jobs whose breach is over (`Action::CapRestored`): the daemon deletes
    /// the breach record.
    pub restored: Vec<String>,
    /// When to call again; `None` when the tuner waits for the residents to change.
    pub again_in_s: Option<f64>,
}

impl SimTuner {
    /// A tuner for simulated GPU `device` with the production parameters and `seed`.
    pub fn new(device: usize, kind: &str, capacity_mib: u64, seed: u64) -> crate::Result<SimTuner> {
        let info = DeviceInfo {
            device_id: format!("gpu-{device}"),
            memory_mib: capacity_mib,
            kind: kind.to_owned(),
            ..DeviceInfo::default()
        };
        let params = DeviceTunerParams {
            seed,
            ..DeviceTunerParams::default()
        };
        let tuner = DeviceTuner::new(&info, params, None).map_err(|e| crate::SimError::Policy {
            policy: "iadeep".into(),
            reason: format!("device tuner: {e}"),
        })?;
        Ok(SimTuner {
            tuner,
            translator: Translator::default(),
            reports: HashMap::new(),
        })
    }

    /// The tuner's counters.
    pub fn status(&self) -> iadeep_tuner::Status {
        self.tuner.status()
    }

    /// One step: the device as it is now in, the tuner's actions out. `placement` holds
    /// the placer's reservations and the tasks' assignments, `round_of` the assignment
    /// round each task runs under.
    pub fn step(
        &mut self,
        view: &dyn PolicyView,
        device: usize,
        placement: &SimPlacement,
        round_of: &dyn Fn(usize) -> u64,
    ) -> Step {
        let now_ms = unix_ms(view.now_s());
        let reserved = placement.device_tasks(device);
        let residents = view.residents(device);
        self.reports
            .retain(|task, _| residents.iter().any(|r| r.spec.id == *task));
        let mut now = BTreeMap::new();
        for r in &residents {
            let id = r.spec.id;
            let key = task_key(id);
            let Some(held) = reserved.get(&key) else {
                // Not (or no longer) reserved by the placer: nothing to tune.
                continue;
            };
            let task = match (&held.spec, r.report.running) {
                (Some(spec), true) => {
                    let report = match self.reports.get(&id) {
                        Some((seq, report)) if *seq == r.report.seq => report.clone(),
                        _ => {
                            let report = proto_report(r, device, round_of(id), now_ms);
                            self.reports.insert(id, (r.report.seq, report.clone()));
                            report
                        }
                    };
                    DeviceTask::Running(Box::new(RunningTask {
                        spec: spec.clone(),
                        reserved_mib: held.reserved_mib,
                        report: Some(report),
                        assignment: held.assignment.clone(),
                    }))
                }
                // Restarting after a crash: its memory stays held, it is not tuned.
                _ => DeviceTask::Held {
                    mib: held.reserved_mib,
                },
            };
            now.insert(key, task);
        }
        // Room a production task's placement evicted residents for is the claimant's until
        // it is placed or the claim expires: the tuner keeps it free too, as the daemon's
        // driver tells it (no resident grows into it meanwhile).
        for (task_id, mib, until_unix_ms) in placement.device_claims(device) {
            if until_unix_ms > now_ms && !now.contains_key(&task_id) {
                now.insert(task_id, DeviceTask::Held { mib });
            }
        }
        let inputs = self.translator.diff(now);
        let mut step = Step::default();
        for action in self.tuner.step(now_ms, inputs) {
            step.record(action);
        }
        step.again_in_s = if self.tuner.wants_reports() {
            Some(AGENT_REPORT_INTERVAL_S)
        } else {
            self.tuner
                .next_wakeup_ms()
                .map(|at| (at - now_ms).max(1) as f64 / 1000.0)
        };
        step
    }
}

impl Step {
    /// Files one of the tuner's actions where the simulator reads it; persisting is the
    /// daemon's business and has no counterpart here.
    fn record(&mut self, action: Action) {
        match action {
            Action::Assign(round) => self.assignments.extend(round),
            Action::Sample { sample, .. } => self.samples.push(sample),
            Action::Persist(_) => {}
            Action::CapBreached(breach) => self.breaches.push(breach),
            Action::CapRestored { task_id } => self.restored.push(task_id),
            Action::Profile {
                model,
                device_kind,
                points,
            } => self.profiles.push(ProfileUpdate {
                model,
                device_kind,
                points,
            }),
        }
    }
}
