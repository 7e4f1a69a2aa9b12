//! iadeep's placement in the simulator: the placer crate's own decision
//! ([`iadeep_placer::Placer::decide`]), the function the placement daemon runs, over
//! an [`iadeep_placer::ClusterView`] that this module keeps in sync with what the
//! emulated agents report (specs, reports, placements and releases), never with the
//! simulator's ground truth.
//!
//! Two choices are specific to the simulator, both because its tuner keeps running
//! tasks at the batch size it last applied until the next round:
//!
//! - a waiting task's smallest batch size, for the placer's footprint, is the batch
//!   size it will start at (m0, or less after out-of-memory crashes): the placer's
//!   rule assumes the tuner shrinks batch sizes at once when a task joins, which the
//!   simulated tuner does only after its first round;
//! - a resident's reservation is the larger of what the placer reserved and the
//!   peak memory its agent last reported while running, so memory a tuner round
//!   added is counted (the placer counts `max(reserved, footprint)`).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

use iadeep_placer::model::{ModelledMemory, SlowdownEstimate, SlowdownModel};
use iadeep_placer::policy::Assessment;
use iadeep_placer::view::profile_of;
use iadeep_placer::{Placer, PlacerParams, Verdict};
use iadeep_proto::{
    CoLocationSample, DeviceInfo, DeviceResidents, Reservation, SoloProfile, TaskProfile,
    TaskReport, TaskSpec as ProtoSpec,
};

use crate::audit::{AuditCandidate, AuditRecord, Slowdowns};
use crate::policy::Decision;
use crate::policy::iadeep::predictor::SimPredictor;
use crate::view::{ClusterView, Resident, TaskSpec, Waiting};

/// The simulator's predictor as the placer's slowdown model: the very model the
/// policy feeds co-location samples into (shared, behind a lock the single-threaded
/// simulator never contends), so placement sees every refit as soon as it happens.
#[derive(Debug)]
pub struct SharedPredictor(Mutex<SimPredictor>);

impl SharedPredictor {
    /// Shares `predictor`.
    pub fn new(predictor: SimPredictor) -> SharedPredictor {
        SharedPredictor(Mutex::new(predictor))
    }

    /// The predictor. A panic elsewhere while it was held cannot leave it half
    /// updated in a way that matters to a simulation already failing, so carry on.
    fn lock(&self) -> MutexGuard<'_, SimPredictor> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Samples the current model was fitted on (0 while it is the cold-start heuristic).
    pub fn model_samples(&self) -> usize {
        self.lock().model_samples()
    }

    /// Samples accepted and refits done so far.
    pub fn counts(&self) -> (u64, u64) {
        let p = self.lock();
        (p.samples, p.refits)
    }

    /// Learns one measured co-location (refits synchronously when due).
    pub fn learn(&self, sample: CoLocationSample) {
        self.lock().observe(sample);
    }
}

impl SlowdownModel for SharedPredictor {
    fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> SlowdownEstimate {
        self.lock().predict(device_kind, task, corunners).into()
    }

    /// The policy feeds samples itself ([`SharedPredictor::learn`]); the placer never
    /// calls this in the simulator.
    fn observe(&self, sample: &CoLocationSample) {
        self.learn(sample.clone());
    }

    /// The refits so far: the model changes only at a refit, so the placer may reuse
    /// the residents' slowdowns among themselves until the next one.
    fn version(&self) -> Option<u64> {
        Some(self.counts().1)
    }
}

/// The placer's parameters in the simulator: the daemon's defaults except the fixed
/// per-process margin (`memory_margin_mib` 0 instead of 256): the simulated agents'
/// peak memory is the whole process's, CUDA context included, and with the extra
/// 256 MiB the largest trace jobs no longer fit an idle card they run on alone.
/// The simulator has no SM or DRAM-bandwidth utilisation in its profiles, so those
/// caps never bind.
pub fn sim_params() -> PlacerParams {
    PlacerParams {
        memory_margin_mib: 0,
        ..PlacerParams::default()
    }
}

fn task_key(id: usize) -> String {
    format!("task-{id}")
}

fn device_key(device: usize) -> String {
    format!("gpu-{device}")
}

/// Simulated time 0 as a Unix time in ms. Not 0: the placer reads a submission time
/// of 0 as "not stated", and the first trace job is submitted at time 0.
const EPOCH_UNIX_MS: i64 = 1_600_000_000_000;

fn unix_ms(now_s: f64) -> i64 {
    EPOCH_UNIX_MS + (now_s * 1000.0).round() as i64
}

/// A submitted spec as the placer's protobuf spec; `start_batch` is the smallest
/// batch size the placer sizes memory for (see the module doc).
fn proto_spec(spec: &TaskSpec, start_batch: u32, kind: &str) -> ProtoSpec {
    ProtoSpec {
        task_id: task_key(spec.id),
        model: spec.model.clone(),
        initial_batch_size: spec.m0,
        min_batch_size: start_batch,
        max_batch_size: spec.batch_sizes.last().copied().unwrap_or(spec.m0),
        // Not the trace's request: the workload caps it at the whole card, and the
        // placer takes it as a floor, so such a job would fit no card at all even
        // alone. The measured solo profile sizes the task instead.
        gpu_mem_request_mib: 0,
        profile: Some(SoloProfile {
            batch_size: spec.m0,
            step_time_s: Some(spec.solo_step_time_s),
            sm_util_pct: None,
            mem_bw_util_pct: None,
            peak_mem_mib: Some(spec.solo_peak_mem_mib),
            device_kind: kind.to_owned(),
        }),
        total_samples: Some(spec.total_samples.max(0.0).round() as u64),
        submitted_at_unix_ms: unix_ms(spec.submit_s),
        ..ProtoSpec::default()
    }
}

fn proto_report(r: &Resident<'_>, device: usize, now_ms: i64) -> TaskReport {
    TaskReport {
        task_id: task_key(r.spec.id),
        device_id: device_key(device),
        batch_size: r.report.batch_size,
        step_time_s: r.report.step_time_s,
        samples_per_s: if r.report.running {
            r.report.samples_per_s
        } else {
            0.0
        },
        peak_mem_mib: r.report.running.then_some(r.report.peak_mem_mib),
        grad_noise_scale: r.report.grad_noise_scale,
        samples_done: r.report.samples_done.max(0.0).round() as u64,
        oom_batch_size: r.report.oom_batch_size,
        seq: r.report.seq,
        reported_at_unix_ms: now_ms,
        ..TaskReport::default()
    }
}

/// The placer and the view it decides on.
#[derive(Debug)]
pub struct SimPlacement {
    placer: Placer,
    view: iadeep_placer::ClusterView,
    /// Per device, the (task, report seq, running) triples last applied to the view.
    applied: Vec<Vec<(usize, u64, bool)>>,
    /// What the placer reserved for each placed task, MiB.
    reserved: HashMap<usize, u64>,
    /// Start batch size of each placed task (the spec's smallest batch, see module doc).
    start_batch: HashMap<usize, u32>,
    revision: i64,
    /// The tasks noted as waiting in the placer's view, and the engine's
    /// [`ClusterView::waiting_version`] they were taken from.
    waiting: HashSet<usize>,
    waiting_version: Option<u64>,
    /// The retry hint of the last decision, when the placer said "queue".
    pub retry_after: Option<std::time::Duration>,
    /// Decisions recorded for the placement audit, when it is on (see [`crate::audit`]).
    pub audit: Option<Vec<AuditRecord>>,
}

impl SimPlacement {
    /// A placer deciding with `slowdown`.
    pub fn new(slowdown: Arc<dyn SlowdownModel>) -> crate::Result<SimPlacement> {
        let placer = Placer::new(sim_params(), slowdown).map_err(|e| crate::SimError::Policy {
            policy: "iadeep".into(),
            reason: format!("placer parameters: {e}"),
        })?;
        Ok(SimPlacement {
            placer,
            view: iadeep_placer::ClusterView::new(Arc::new(ModelledMemory)),
            applied: Vec::new(),
            reserved: HashMap::new(),
            start_batch: HashMap::new(),
            revision: 0,
            waiting: HashSet::new(),
            waiting_version: None,
            retry_after: None,
            audit: None,
        })
    }

    /// Brings the placer's view up to date with the agents' reports: registers new
    /// devices, and rewrites a device's residents record when its residents or their
    /// reports changed since the last decision.
    fn sync(&mut self, view: &dyn ClusterView) {
        let kind = view.device_kind().to_owned();
        let now_ms = unix_ms(view.now_s());
        while self.applied.len() < view.devices() {
            let device = self.applied.len();
            self.view.upsert_device(DeviceInfo {
                device_id: device_key(device),
                index: device as u32,
                memory_mib: view.capacity_mib(),
                kind: kind.clone(),
                ..DeviceInfo::default()
            });
            self.applied.push(Vec::new());
        }
        for device in 0..view.devices() {
            if view.resident_count(device) == 0 && self.applied[device].is_empty() {
                continue;
            }
            let residents = view.residents(device);
            let same = residents.len() == self.applied[device].len()
                && residents
                    .iter()
                    .zip(&self.applied[device])
                    .all(|(r, a)| (r.spec.id, r.report.seq, r.report.running) == (a.0, a.1, a.2));
            if same {
                continue;
            }
            let mut reservations = Vec::with_capacity(residents.len());
            for r in &residents {
                self.view.set_report(proto_report(r, device, now_ms));
                let start = self
                    .start_batch
                    .get(&r.spec.id)
                    .copied()
                    .unwrap_or(r.report.batch_size);
                let placed = self.reserved.get(&r.spec.id).copied().unwrap_or(0);
                let reported = if r.report.running {
                    r.report.peak_mem_mib
                } else {
                    0
                };
                reservations.push(Reservation {
                    task_id: task_key(r.spec.id),
                    reserved_mem_mib: placed.max(reported),
                    placed_at_unix_ms: now_ms,
                    spec: Some(proto_spec(r.spec, start, &kind)),
                });
            }
            self.revision += 1;
            let record = (!reservations.is_empty()).then(|| DeviceResidents {
                device_id: device_key(device),
                reservations,
            });
            self.view
                .apply_residents(&device_key(device), record, self.revision);
            self.applied[device] = residents
                .iter()
                .map(|r| (r.spec.id, r.report.seq, r.report.running))
                .collect();
        }
    }

    /// Tells the placer's view which tasks wait for a device: every task submitted and
    /// not running, as the engine knows it (the daemon learns the same set from the
    /// tasks it answered "queue"). They never expire here: the simulator knows exactly
    /// when one is placed, and it is then forgotten.
    fn sync_waiting(&mut self, view: &dyn ClusterView) {
        let version = view.waiting_version();
        if self.waiting_version == Some(version) {
            return;
        }
        self.waiting_version = Some(version);
        let kind = view.device_kind().to_owned();
        let now_ms = unix_ms(view.now_s());
        let waiting = view.waiting();
        let now: HashSet<usize> = waiting.iter().map(|spec| spec.id).collect();
        for gone in self.waiting.difference(&now) {
            self.view.forget_waiting(&task_key(*gone));
        }
        for spec in waiting {
            if !self.waiting.contains(&spec.id) {
                self.view
                    .note_waiting(&proto_spec(spec, spec.m0, &kind), now_ms, i64::MAX);
            }
        }
        self.waiting = now;
    }

    /// The placer's decision for a waiting task. A "queue" verdict keeps it waiting;
    /// the engine asks again at the next event.
    ///
    /// The verdict is the one [`Placer::decide`] gives (the same assessment and
    /// verdict functions), without the explanation the daemon sends to its clients:
    /// formatting it for every waiting task at every event cost the simulator more
    /// than the decision itself, and nobody reads it here.
    pub fn decide(&mut self, view: &dyn ClusterView, task: Waiting<'_>) -> Decision {
        self.retry_after = None;
        self.sync(view);
        self.sync_waiting(view);
        let now_ms = unix_ms(view.now_s());
        let spec = proto_spec(task.spec, task.batch_size, view.device_kind());
        let assessment = self.placer.assess_limited(
            &self.view,
            &spec,
            &[],
            now_ms,
            self.placer.params().max_scored_devices,
        );
        let verdict = self.placer.verdict(&spec, &assessment);
        if let Some(records) = self.audit.as_mut() {
            records.push(audit_record(
                &self.placer,
                &self.view,
                view,
                task,
                &spec,
                &assessment,
                &verdict,
            ));
        }
        match verdict {
            Verdict::Place {
                device_id,
                reserved_mem_mib,
            } => {
                let Some(device) = device_id
                    .strip_prefix("gpu-")
                    .and_then(|d| d.parse::<usize>().ok())
                    .filter(|d| *d < view.devices())
                else {
                    tracing::warn!(%device_id, "placer chose a device the simulator does not have; task waits");
                    return Decision::Queue;
                };
                self.reserved.insert(task.spec.id, reserved_mem_mib);
                self.start_batch.insert(task.spec.id, task.batch_size);
                Decision::Place {
                    device,
                    batch_size: task.batch_size,
                }
            }
            Verdict::Queue {
                retry_after,
                reason,
            } => {
                // Trace jobs whose profiled peak is the whole card fit no card after
                // the placer's margin; they ran alone in the trace, so they run alone
                // on an idle card here rather than wait forever.
                let usable =
                    view.capacity_mib() as f64 * (1.0 - self.placer.params().memory_margin_frac);
                if task.spec.solo_peak_mem_mib as f64 > usable
                    && let Some(device) = (0..view.devices()).find(|d| view.resident_count(*d) == 0)
                {
                    tracing::debug!(
                        task = task.spec.id,
                        device,
                        "too large for the placer's margin; runs alone"
                    );
                    self.start_batch.insert(task.spec.id, task.batch_size);
                    if let Some(record) = self.audit.as_mut().and_then(|a| a.last_mut()) {
                        record.verdict = "place";
                        record.device = Some(device);
                        record.placed_idle = true;
                    }
                    return Decision::Place {
                        device,
                        batch_size: task.batch_size,
                    };
                }
                tracing::trace!(task = task.spec.id, ?retry_after, %reason, "placer queues");
                self.retry_after = Some(retry_after);
                Decision::Queue
            }
        }
    }

    /// Forgets a finished task (its device's record is rewritten at the next sync).
    pub fn forget(&mut self, task: usize) {
        self.reserved.remove(&task);
        self.start_batch.remove(&task);
        self.view.remove_report(&task_key(task));
    }
}

/// A slowdown model as a function: (slowdown, uncertainty) of a task next to co-runners.
type Predict<'a> = dyn Fn(&TaskProfile, &[TaskProfile]) -> (f64, f64) + 'a;

/// The slowdowns `predict` gives the newcomer `new` and each resident of `profiles`
/// (with the newcomer and among themselves): the inputs of the placer's score.
fn slowdowns(
    predict: &Predict<'_>,
    new: &TaskProfile,
    profiles: &[TaskProfile],
) -> (Slowdowns, f64) {
    let others = |i: usize| -> Vec<TaskProfile> {
        profiles
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, p)| p.clone())
            .collect()
    };
    let (own, own_sd) = predict(new, profiles);
    let mut variance = own_sd * own_sd;
    let mut with = Vec::with_capacity(profiles.len());
    let mut without = Vec::with_capacity(profiles.len());
    for (i, me) in profiles.iter().enumerate() {
        let mut co = others(i);
        without.push(predict(me, &co).0);
        co.push(new.clone());
        let (w, sd) = predict(me, &co);
        variance += sd * sd;
        with.push(w);
    }
    (Slowdowns { own, with, without }, variance.sqrt())
}

/// What the placer knew for one decision, for the placement audit: the scored shared
/// candidates at the head of the ranking, each with the slowdowns the placer's model
/// and the cold-start heuristic predict (asked again with the placer's own inputs).
fn audit_record(
    placer: &Placer,
    placer_view: &iadeep_placer::ClusterView,
    view: &dyn ClusterView,
    task: Waiting<'_>,
    spec: &ProtoSpec,
    assessment: &Assessment<'_>,
    verdict: &Verdict,
) -> AuditRecord {
    let kind = view.device_kind();
    let new = profile_of(spec, None);
    let model = placer.slowdown_model();
    let learned = |t: &TaskProfile, co: &[TaskProfile]| {
        let p = model.predict(kind, t, co);
        (p.slowdown, p.uncertainty)
    };
    let heuristic = |t: &TaskProfile, co: &[TaskProfile]| {
        if co.is_empty() {
            return (1.0, 0.0);
        }
        let p = iadeep_predictor::heuristic::predict(t, co);
        (p.slowdown, p.uncertainty)
    };
    let head = placer.params().explain_top_k.max(1);
    let candidates = assessment
        .candidates
        .iter()
        .take(head)
        .filter(|c| !c.idle)
        .filter_map(|c| {
            let device_state = placer_view.device(c.device_id)?;
            let profiles = &device_state.summary().profiles;
            let residents = device_state
                .residents
                .iter()
                .zip(profiles)
                .map(|(r, p)| {
                    let id = r
                        .reservation
                        .task_id
                        .strip_prefix("task-")
                        .and_then(|t| t.parse().ok())
                        .unwrap_or(usize::MAX);
                    (id, p.batch_size)
                })
                .collect();
            let (predicted, uncertainty) = slowdowns(&learned, &new, profiles);
            Some(AuditCandidate {
                device: c.device_id.strip_prefix("gpu-")?.parse().ok()?,
                residents,
                predicted,
                uncertainty,
                rank: c.rank,
                heuristic: slowdowns(&heuristic, &new, profiles).0,
                truth: None,
            })
        })
        .collect();
    let (verdict, device) = match verdict {
        Verdict::Place { device_id, .. } => (
            "place",
            device_id
                .strip_prefix("gpu-")
                .and_then(|d| d.parse::<usize>().ok()),
        ),
        Verdict::Queue { .. } => ("queue", None),
    };
    AuditRecord {
        at_s: view.now_s(),
        task: task.spec.id,
        batch_size: task.batch_size,
        verdict,
        device,
        placed_idle: device.is_some_and(|d| view.resident_count(d) == 0),
        idle_available: assessment.candidates.iter().any(|c| c.idle),
        model_samples: 0,
        samples_seen: 0,
        waiting_ahead: assessment.waiting_ahead,
        wait_s: assessment.wait_s,
        duration_s: placer.expected_duration_s(spec),
        candidates,
        rejected: assessment.rejected.iter().fold(
            std::collections::BTreeMap::new(),
            |mut counts, (_, why)| {
                *counts.entry(why.kind()).or_default() += 1;
                counts
            },
        ),
        started_s: None,
        residents_done_s: None,
        drained_s: None,
    }
}
