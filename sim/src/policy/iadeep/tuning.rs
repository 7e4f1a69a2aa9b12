//! The device tuners in the simulator: each GPU's [`DeviceTuner`], the tuner crate's state
//! machine that the daemon drives over the store, driven here in virtual time by what the
//! emulated agents report.
//!
//! The driver only translates, as the daemon's does: the device's residents become
//! `Joined` / `Reserved` / `Left` inputs, the placer's starting and shrinking assignments
//! `Assigned` inputs, each emulated agent's latest report a `Report`, all stamped with the
//! simulated clock; the tuner's assignments go back to the engine, its samples to the
//! predictor. The engine calls again when the tuner wants the next reports (one agent
//! report interval later) or at its next wake-up (a round's timeout, a settled check).

use std::collections::BTreeMap;

use iadeep_proto::{
    BatchSizeAssignment, CoLocationSample, DeviceInfo, ProfilePoint, TaskSpec as ProtoSpec,
};
use iadeep_tuner::device_tuner::{Action, DeviceTuner, DeviceTunerParams, Input};

use crate::policy::iadeep::placement::{proto_report, task_key, unix_ms};
use crate::view::ClusterView;

/// How often an emulated agent reports, seconds: the real agent's default
/// (`iadeep_agent::DEFAULT_REPORT_INTERVAL`; an integration test checks they agree).
pub const AGENT_REPORT_INTERVAL_S: f64 = 2.0;

/// What the driver last told the tuner about a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Told {
    Running,
    Held,
}

/// One device's tuner and its driver state.
#[derive(Debug)]
pub struct SimTuner {
    tuner: DeviceTuner,
    told: BTreeMap<usize, Told>,
    /// Assignments the placer wrote for this device's tasks, not yet told.
    placed: Vec<BatchSizeAssignment>,
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
            told: BTreeMap::new(),
            placed: Vec::new(),
        })
    }

    /// The placer wrote these assignments (a newcomer's start, residents' shrinks).
    pub fn placed(&mut self, assignments: &[BatchSizeAssignment]) {
        self.placed.extend_from_slice(assignments);
    }

    /// The tuner's counters.
    pub fn status(&self) -> iadeep_tuner::device_tuner::Status {
        self.tuner.status()
    }

    /// One step: the residents' changes and fresh reports in, the tuner's actions out.
    /// `spec_of` is each task's spec as submitted to the placer, `round_of` the
    /// assignment round each task runs under.
    pub fn step(
        &mut self,
        view: &dyn ClusterView,
        device: usize,
        spec_of: &dyn Fn(&crate::view::TaskSpec) -> ProtoSpec,
        round_of: &dyn Fn(usize) -> u64,
    ) -> Step {
        let now_ms = unix_ms(view.now_s());
        let residents = view.residents(device);
        let mut left = Vec::new();
        let mut joined = Vec::new();
        let mut reports = Vec::new();
        let here: Vec<usize> = residents.iter().map(|r| r.spec.id).collect();
        self.told.retain(|task, _| {
            let stays = here.contains(task);
            if !stays {
                left.push(Input::Left {
                    task_id: task_key(*task),
                });
            }
            stays
        });
        for r in &residents {
            let id = r.spec.id;
            if r.report.running {
                if self.told.insert(id, Told::Running) != Some(Told::Running) {
                    joined.push(Input::Joined {
                        spec: spec_of(r.spec),
                        reserved_mib: 0,
                    });
                }
                reports.push(Input::Report(proto_report(r, device, round_of(id), now_ms)));
            } else if self.told.insert(id, Told::Held) != Some(Told::Held) {
                // Restarting after a crash: its memory stays held, it is not tuned.
                joined.push(Input::Reserved {
                    task_id: task_key(id),
                    mib: r.report.peak_mem_mib,
                });
            }
        }
        let assigned = std::mem::take(&mut self.placed)
            .into_iter()
            .map(Input::Assigned);
        let inputs = left
            .into_iter()
            .chain(joined)
            .chain(assigned)
            .chain(reports);
        let mut step = Step::default();
        for action in self.tuner.step(now_ms, inputs) {
            match action {
                Action::Assign(round) => step.assignments.extend(round),
                Action::Sample { sample, .. } => step.samples.push(sample),
                Action::Persist(_) => {}
                Action::Profile {
                    model,
                    device_kind,
                    points,
                } => step.profiles.push(ProfileUpdate {
                    model,
                    device_kind,
                    points,
                }),
            }
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
