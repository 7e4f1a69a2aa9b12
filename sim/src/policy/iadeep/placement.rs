//! iadeep's placement in the simulator: the placement service the daemon runs
//! ([`iadeep_placer::PlacementService`]), with the production defaults, over an
//! in-memory embedded store and a view this module keeps up to date with what the
//! emulated agents report (their reports, their `alive` keys) and what the device tuners
//! assign, as the daemon's store watch does; never with the simulator's ground truth.
//! Every Place is the service's: the same decision, the same reservation transaction
//! (with the newcomer's starting assignment and the shrinks of residents that make room
//! for it), the same waiting set with its expiry. Its clock is the simulated one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use iadeep_placer::Assessment;
use iadeep_placer::profile_of;
use iadeep_placer::{Clock, PlacementService, Placer, PlacerParams, Verdict};
use iadeep_placer::{MemoryEstimator, WaitModel};
use iadeep_predictor::{Prediction, SlowdownModel};
use iadeep_proto::{
    BatchSizeAssignment, CapBreach, CoLocationSample, DeviceInfo, PriorityClass, ProfilePoint,
    SoloProfile, TaskProfile, TaskReport, TaskSpec as ProtoSpec, place_response,
};
use iadeep_state::{EmbeddedStore, Expect, StateStore, Txn, TxnOutcome, keys, typed};

use crate::audit::{AuditCandidate, AuditRecord, Slowdowns};
use crate::policy::PlaceOrQueue;
use crate::policy::iadeep::predictor::SimPredictor;
use crate::view::{JobSpec, PolicyView, ResidentJob, Waiting};

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
    ) -> Prediction {
        self.lock().predict(device_kind, task, corunners)
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

/// The key of simulated task `id` (one store key segment).
pub fn task_key(id: usize) -> String {
    format!("task-{id}")
}

/// The simulated task a key names.
pub fn task_of(key: &str) -> Option<usize> {
    key.strip_prefix("task-")?.parse().ok()
}

/// The key of simulated GPU `device` (its device id in the placer's and tuners' records).
pub fn device_key(device: usize) -> String {
    format!("gpu-{device}")
}

/// Simulated time 0 as a Unix time in ms. Not 0: the placer reads a submission time
/// of 0 as "not stated", and the first trace job is submitted at time 0.
const EPOCH_UNIX_MS: i64 = 1_600_000_000_000;

/// Simulated seconds as the Unix ms the placement service and the tuners see.
pub fn unix_ms(now_s: f64) -> i64 {
    EPOCH_UNIX_MS + (now_s * 1000.0).round() as i64
}

/// A task as its submitter sends it to the placer: its model, m0, the batch sizes it can
/// run at and its work, with its solo profile at m0 (a profiling run on this kind of GPU)
/// only when jobs bring one (`JobInfo::Profiled`), and no memory request (the trace's
/// requests are capped at the whole card): what `iadeep run` sends by default. Its class
/// and cap are the workload's (`iadeep run --class --max-slowdown`).
pub fn proto_spec(spec: &JobSpec, kind: &str) -> ProtoSpec {
    ProtoSpec {
        task_id: task_key(spec.id),
        model: spec.model.clone(),
        initial_batch_size: spec.m0,
        min_batch_size: spec.batch_sizes.first().copied().unwrap_or(spec.m0),
        max_batch_size: spec.batch_sizes.last().copied().unwrap_or(spec.m0),
        gpu_mem_request_mib: 0,
        profile: spec.profile.map(|p| SoloProfile {
            batch_size: spec.m0,
            step_time_s: Some(p.step_time_s),
            sm_util_pct: None,
            mem_bw_util_pct: None,
            peak_mem_mib: Some(p.peak_mem_mib),
            device_kind: kind.to_owned(),
            ..SoloProfile::default()
        }),
        total_samples: Some(spec.total_samples.max(0.0).round() as u64),
        submitted_at_unix_ms: unix_ms(spec.submit_s),
        // The sizes the world has measurements for, as a job states the sizes it can run.
        allowed_batch_sizes: spec.batch_sizes.clone(),
        priority_class: if spec.is_production() {
            PriorityClass::Production
        } else {
            PriorityClass::Opportunistic
        } as i32,
        max_slowdown: spec.max_slowdown,
        ..ProtoSpec::default()
    }
}

/// What the task's agent reports now, under assignment `round`: the peak memory of the
/// batch size it runs at (the agent restarts its peak with each batch size).
pub fn proto_report(r: &ResidentJob<'_>, device: usize, round: u64, now_ms: i64) -> TaskReport {
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
        peak_mem_batch_size: r.report.batch_size,
        grad_noise_scale: r.report.grad_noise_scale,
        samples_done: r.report.samples_done.max(0.0).round() as u64,
        oom_batch_size: r.report.oom_batch_size,
        seq: r.report.seq,
        reported_at_unix_ms: now_ms,
        assignment_round: round,
        ..TaskReport::default()
    }
}

/// A task reserved on a device, as the placer stored it.
#[derive(Clone, Debug)]
pub struct ReservedTask {
    /// The spec the placer stored with the reservation (with a registry profile when it
    /// filled one).
    pub spec: Option<ProtoSpec>,
    pub reserved_mib: u64,
    /// Its current assignment (the placer's starting or settling one, or the tuner's).
    pub assignment: Option<BatchSizeAssignment>,
}

/// The placement service and what keeps its view current.
#[derive(Debug)]
pub struct SimPlacement {
    service: PlacementService,
    /// The service's view, which this module keeps current as the daemon's sync does.
    view: Arc<RwLock<iadeep_placer::ClusterView>>,
    store: Arc<dyn StateStore>,
    /// The simulated time the service's clock reads, Unix ms.
    now_ms: Arc<AtomicI64>,
    devices: usize,
    /// Per device, the (task, report seq, running) triples last put into the view.
    applied: Vec<Vec<(usize, u64, bool)>>,
    /// The retry hint of the last decision, when the placer said "queue".
    pub retry_after: Option<std::time::Duration>,
    /// Assignments the service wrote when it settled provisional reservations, not yet
    /// taken ([`SimPlacement::take_settled`]).
    settled: Vec<BatchSizeAssignment>,
    /// Decisions recorded for the placement audit, when it is on (see [`crate::audit`]).
    pub audit: Option<Vec<AuditRecord>>,
}

fn policy_error(reason: impl std::fmt::Display) -> crate::SimError {
    crate::SimError::Policy {
        policy: "iadeep".into(),
        reason: reason.to_string(),
    }
}

impl SimPlacement {
    /// A placement service deciding with `slowdown`, sizing memory with `memory` (the
    /// production `ModelledMemory` for iadeep), and the production parameters.
    ///
    /// `wait` replaces the placer's wait model (`oracle-wait`); `None` keeps the
    /// production one.
    pub fn new(
        slowdown: Arc<dyn SlowdownModel>,
        memory: Arc<dyn MemoryEstimator>,
        wait: Option<Arc<dyn WaitModel>>,
    ) -> crate::Result<SimPlacement> {
        let mut placer = Placer::new(PlacerParams::default(), slowdown)
            .map_err(|e| policy_error(format!("placer parameters: {e}")))?;
        if let Some(wait) = wait {
            placer = placer.with_wait_model(wait);
        }
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().map_err(|e| policy_error(format!("store: {e}")))?);
        let view = Arc::new(RwLock::new(iadeep_placer::ClusterView::new(memory)));
        let now_ms = Arc::new(AtomicI64::new(EPOCH_UNIX_MS));
        let clock = {
            let now_ms = now_ms.clone();
            Clock::from_fn(move || now_ms.load(Ordering::Relaxed))
        };
        let service =
            PlacementService::new(store.clone(), view.clone(), Arc::new(placer)).with_clock(clock);
        Ok(SimPlacement {
            service,
            view,
            store,
            now_ms,
            devices: 0,
            applied: Vec::new(),
            retry_after: None,
            settled: Vec::new(),
            audit: None,
        })
    }

    /// Runs a store call of the service to completion on the calling thread. The
    /// simulation is synchronous, and the service's store calls on the in-memory store
    /// need no runtime (a writer thread answers them over channels), so any caller may
    /// run the simulation, in an async context or not. Inside a Tokio task (the CLI runs
    /// in one) Tokio's cooperative budget would run out after a hundred-odd store calls
    /// and, with no runtime here to refill it, every poll would answer "pending" for
    /// ever: `unconstrained` takes these polls out of the budget.
    fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        futures::executor::block_on(tokio::task::unconstrained(future))
    }

    fn view_mut(&self) -> std::sync::RwLockWriteGuard<'_, iadeep_placer::ClusterView> {
        self.view.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Puts the agents' latest reports into the view ([`SimPlacement::sync`]), then
    /// settles the provisional reservations of tasks that reported their peak, with the
    /// service's own pass (`PlacementService::settle_provisional`, which the daemon's
    /// reaper runs every second): the settled tasks' new assignments (their batch size,
    /// their fence at the peak plus the margin) wait in [`SimPlacement::take_settled`].
    pub fn refresh(&mut self, view: &dyn PolicyView, round_of: &dyn Fn(usize) -> u64) {
        self.sync(view, round_of);
        let settled = self.block_on(self.service.settle_provisional());
        self.settled.extend(settled);
    }

    /// The assignments written by settling provisional reservations since the last call.
    pub fn take_settled(&mut self) -> Vec<BatchSizeAssignment> {
        std::mem::take(&mut self.settled)
    }

    /// Registers new devices and puts the agents' latest reports into the view (as the
    /// daemon's watch delivers them). `round_of` is the assignment round each task runs
    /// under.
    fn sync(&mut self, view: &dyn PolicyView, round_of: &dyn Fn(usize) -> u64) {
        self.now_ms.store(unix_ms(view.now_s()), Ordering::Relaxed);
        let kind = view.device_kind().to_owned();
        while self.devices < view.devices() {
            let device = self.devices;
            self.view_mut().upsert_device(DeviceInfo {
                device_id: device_key(device),
                index: device as u32,
                memory_mib: view.capacity_mib(),
                kind: kind.clone(),
                ..DeviceInfo::default()
            });
            self.applied.push(Vec::new());
            self.devices += 1;
        }
        let now_ms = unix_ms(view.now_s());
        for device in 0..view.devices() {
            if view.resident_count(device) == 0 && self.applied[device].is_empty() {
                continue;
            }
            let residents = view.residents(device);
            let now: Vec<(usize, u64, bool)> = residents
                .iter()
                .map(|r| (r.spec.id, r.report.seq, r.report.running))
                .collect();
            if now == self.applied[device] {
                continue;
            }
            let mut placer_view = self.view_mut();
            for r in &residents {
                let task = task_key(r.spec.id);
                if r.report.running {
                    placer_view.set_alive(&task);
                }
                placer_view.set_report(proto_report(r, device, round_of(r.spec.id), now_ms));
            }
            drop(placer_view);
            self.applied[device] = now;
        }
    }

    /// The placement service's decision for a waiting task, committed as the daemon
    /// commits it. A "queue" verdict keeps the task waiting; the engine asks again.
    pub fn decide(
        &mut self,
        view: &dyn PolicyView,
        task: Waiting<'_>,
        spec_of: &dyn Fn(&JobSpec) -> ProtoSpec,
        round_of: &dyn Fn(usize) -> u64,
    ) -> crate::Result<(PlaceOrQueue, Vec<BatchSizeAssignment>)> {
        self.retry_after = None;
        self.refresh(view, round_of);
        let spec = spec_of(task.spec);
        if self.audit.is_some() {
            self.record_audit(view, task, &spec);
        }
        let outcome = self
            .block_on(self.service.place(spec, Vec::new()))
            .map_err(|e| policy_error(format!("place: {e}")))?;
        match outcome.decision {
            place_response::Decision::Placed(placement) => {
                let device = placement
                    .device_id
                    .strip_prefix("gpu-")
                    .and_then(|d| d.parse::<usize>().ok())
                    .filter(|d| *d < view.devices())
                    .ok_or_else(|| {
                        policy_error(format!("placed on unknown device {}", placement.device_id))
                    })?;
                let shrinks = outcome
                    .assignments
                    .iter()
                    .filter(|a| a.task_id != placement.task_id)
                    .filter_map(|a| Some(super::sim_assignment(task_of(&a.task_id)?, a)))
                    .collect();
                // The agent fences its allocator at the reservation, which the starting
                // assignment carries as its memory bound.
                let fence_mib = outcome
                    .assignments
                    .iter()
                    .find(|a| a.task_id == placement.task_id)
                    .and_then(super::fence_mib)
                    .or(Some(placement.reserved_mem_mib));
                let decision = PlaceOrQueue::Place {
                    device,
                    batch_size: placement.batch_size,
                    shrinks,
                    fence_mib,
                };
                Ok((decision, outcome.assignments))
            }
            place_response::Decision::Queued(q) => {
                self.retry_after = Some(std::time::Duration::from_millis(q.retry_after_ms));
                Ok((PlaceOrQueue::Queue, Vec::new()))
            }
        }
    }

    /// Every task the placer has reserved on simulated GPU `device`, by task key: what the
    /// daemon's tuner reads from the device's residents record and the tasks' keys.
    pub fn device_tasks(&self, device: usize) -> HashMap<String, ReservedTask> {
        let view = self.view.read().unwrap_or_else(|e| e.into_inner());
        view.device(&device_key(device))
            .map(|d| {
                d.residents
                    .iter()
                    .map(|r| {
                        (
                            r.reservation.task_id.clone(),
                            ReservedTask {
                                spec: r.reservation.spec.clone(),
                                reserved_mib: r.reservation.reserved_mem_mib,
                                assignment: r.assignment.as_ref().map(|(a, _)| a.clone()),
                            },
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The residents whose current assignment tells them to leave (`evict`): the victims
    /// of the placer's room evictions and of its eviction executor, as their agents read
    /// it. The engine takes them off their devices; [`SimPlacement::release`] then drops
    /// them from the view, as their launchers release them.
    pub fn evict_orders(&self) -> Vec<usize> {
        let view = self.view.read().unwrap_or_else(|e| e.into_inner());
        (0..self.devices)
            .filter_map(|d| view.device(&device_key(d)))
            .flat_map(|d| d.residents.iter())
            .filter(|r| r.assignment.as_ref().is_some_and(|(a, _)| a.evict))
            .filter_map(|r| task_of(&r.reservation.task_id))
            .collect()
    }

    /// A device tuner's cap breach, as the daemons handle it: the tuner daemon writes the
    /// record at the device's breach key, the placer's view follows it, and the placer's
    /// eviction executor acts on it at once (`iadeep_placer::eviction::act_on_breach`:
    /// the victim chosen by blame, its evict assignment, the avoid record and the
    /// breach's deletion in one transaction). The victim is then among
    /// [`SimPlacement::evict_orders`].
    pub fn breach(&mut self, breach: CapBreach) -> crate::Result<()> {
        let device_id = breach.device_id.clone();
        let key = keys::device_breach(&device_id);
        let revision = self
            .block_on(typed::put(self.store.as_ref(), &key, &breach, None))
            .map_err(|e| policy_error(format!("breach record: {e}")))?;
        self.view_mut().set_breach(&device_id, breach, revision);
        let outcome = self
            .block_on(iadeep_placer::eviction::act_on_breach(
                &self.service,
                &device_id,
            ))
            .map_err(|e| policy_error(format!("eviction: {e}")))?;
        tracing::debug!(device = %device_id, ?outcome, "acted on a cap breach");
        Ok(())
    }

    /// The breach of `task_id` on `device` is over: its record is deleted if it is still
    /// there and names the task, as the tuner daemon does (the executor acts on a breach
    /// at once here, so it rarely is).
    pub fn restored(&mut self, device: usize, task_id: &str) -> crate::Result<()> {
        let device_id = device_key(device);
        let revision = {
            let view = self.view.read().unwrap_or_else(|e| e.into_inner());
            match view.breach(&device_id) {
                Some((breach, revision)) if breach.task_id == task_id => revision,
                _ => return Ok(()),
            }
        };
        let key = keys::device_breach(&device_id);
        let txn = Txn::new()
            .compare(key.clone(), Expect::ModRevision(revision))
            .delete(key);
        let outcome = self
            .block_on(self.store.transact(txn))
            .map_err(|e| policy_error(format!("breach record: {e}")))?;
        if let TxnOutcome::Committed { revision } = outcome {
            self.view_mut().remove_breach(&device_id, revision);
        }
        Ok(())
    }

    /// The room claims on simulated GPU `device` (task, MiB, until Unix ms): what the
    /// daemon's tuner reads from the device's residents record besides its reservations.
    pub fn device_claims(&self, device: usize) -> Vec<(String, u64, i64)> {
        let view = self.view.read().unwrap_or_else(|e| e.into_inner());
        view.device(&device_key(device))
            .map(|d| {
                d.claims
                    .iter()
                    .map(|c| (c.task_id.clone(), c.mem_mib, c.until_unix_ms))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Records a tuner's measurements in the profile registry of the placement's store,
    /// as the daemon's driver does (`iadeep_state::registry::record`).
    pub fn record_profile(&self, model: &str, device_kind: &str, points: &[ProfilePoint]) {
        if let Err(err) = self.block_on(iadeep_state::registry::record(
            self.store.as_ref(),
            model,
            device_kind,
            points,
        )) {
            tracing::warn!(%err, model, "cannot record a measurement in the profile registry");
        }
    }

    /// Records a device tuner's assignment in the store and the view (the placer counts
    /// the task at it, and its next placement on the device compares it).
    pub fn assigned(&mut self, assignment: &BatchSizeAssignment) -> crate::Result<()> {
        let key = keys::task_assignment(&assignment.task_id);
        let revision = self
            .block_on(typed::put(self.store.as_ref(), &key, assignment, None))
            .map_err(|e| policy_error(format!("assignment: {e}")))?;
        self.view_mut().set_assignment(assignment.clone(), revision);
        Ok(())
    }

    /// Releases a finished task, as its orchestrator does.
    pub fn release(&mut self, task: usize) -> crate::Result<()> {
        self.block_on(self.service.release(&task_key(task)))
            .map_err(|e| policy_error(format!("release: {e}")))?;
        let mut view = self.view_mut();
        view.remove_report(&task_key(task));
        view.set_not_alive(&task_key(task), self.now_ms.load(Ordering::Relaxed));
        Ok(())
    }

    /// The audit record of the decision about to be made: the same pure assessment the
    /// service makes, of the task as the service sees it (with the profile registry's
    /// entry of its model, when it brings none), on the same view at the same time.
    fn record_audit(&mut self, view: &dyn PolicyView, task: Waiting<'_>, spec: &ProtoSpec) {
        let spec = &self.block_on(self.service.with_registry_profile(spec.clone(), &[]));
        let placer_view = self.view.read().unwrap_or_else(|e| e.into_inner());
        let placer = self.service.placer();
        let now = self.now_ms.load(Ordering::Relaxed);
        let assessment = placer.assess_limited(
            &placer_view,
            spec,
            &[],
            now,
            placer.params().max_scored_devices,
        );
        let (verdict, held_for) =
            placer.with_holds(&placer_view, spec, placer.verdict(spec, &assessment), now);
        let mut record = audit_record(
            placer,
            &placer_view,
            view,
            task,
            spec,
            &assessment,
            &verdict,
        );
        if held_for.is_some() {
            // Not the queue rule's answer: the audit keeps it out of the rule's figures.
            record.verdict = "held";
        }
        drop(placer_view);
        if let Some(records) = self.audit.as_mut() {
            records.push(record);
        }
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
    view: &dyn PolicyView,
    task: Waiting<'_>,
    spec: &ProtoSpec,
    assessment: &Assessment<'_>,
    verdict: &Verdict,
) -> AuditRecord {
    let candidates = audit_candidates(placer, placer_view, view.device_kind(), spec, assessment);
    let (verdict, device) = match verdict {
        Verdict::Place { device_id, .. } => (
            "place",
            device_id
                .strip_prefix("gpu-")
                .and_then(|d| d.parse::<usize>().ok()),
        ),
        Verdict::Queue { .. } => ("queue", None),
        // A production job that makes room by evicting opportunistic residents waits
        // for them to leave, then asks again.
        Verdict::Evict { .. } => ("evict", None),
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

/// The scored shared candidates at the head of the ranking (`explain_top_k`), each
/// with the slowdowns the placer's model and the cold-start heuristic predict for
/// `spec` joining it.
fn audit_candidates(
    placer: &Placer,
    placer_view: &iadeep_placer::ClusterView,
    kind: &str,
    spec: &ProtoSpec,
    assessment: &Assessment<'_>,
) -> Vec<AuditCandidate> {
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
        let p = iadeep_predictor::cold_start_prediction(t, co);
        (p.slowdown, p.uncertainty)
    };
    let head = placer.params().explain_top_k.max(1);
    assessment
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
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CLI runs the simulator inside a Tokio task; thousands of store calls there
    /// must not exhaust Tokio's cooperative budget (they spun for ever before). The
    /// calls run on their own thread so that a regression fails here (after a bound far
    /// above the second they take) instead of hanging the test run.
    #[test]
    fn store_calls_complete_inside_a_tokio_task() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let predictor = SimPredictor::new().expect("predictor");
            let mut placement = SimPlacement::new(
                Arc::new(SharedPredictor::new(predictor)),
                Arc::new(iadeep_placer::ModelledMemory),
                None,
            )
            .expect("service");
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                for round in 0..1_000u64 {
                    let assignment = BatchSizeAssignment {
                        task_id: "t0".into(),
                        batch_size: 32,
                        round,
                        ..Default::default()
                    };
                    placement.assigned(&assignment).expect("assignment stored");
                }
            });
            let _ = done.send(());
        });
        finished
            .recv_timeout(std::time::Duration::from_secs(300))
            .expect("1,000 store calls inside a Tokio task never finished");
    }
}
