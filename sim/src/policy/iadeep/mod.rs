//! The iadeep policy and its two ablations, driving the production code: the placer's
//! placement service ([`placement`]: the same decision and reservation transaction as the
//! placement daemon, over an in-memory store, on the simulated clock), one device tuner
//! per GPU ([`tuning`]: the tuner crate's `DeviceTuner`, the state machine the tuner
//! daemon drives) and the predictor (`iadeep_predictor`: learner, profile-feature
//! forest), fed only with what the emulated agents report and the tuners measure.
//!
//! - `iadeep`: the placer scoring with the learned predictor, then per-GPU tuning;
//! - `iadeep-no-tuner`: the same, with every task's batch-size range pinned at its m0
//!   (the tuners still measure co-locations for the predictor, but cannot move anything);
//! - `iadeep-no-predictor`: the placer scoring with a predictor that never learns
//!   (the predictor's cold-start heuristic only), with tuning;
//! - `oracle`: the same placer with the world's true slowdowns and memory, and the true
//!   Σ PD searched exhaustively instead of the tuner ([`oracle`]): the limit;
//! - `oracle-prediction`, `oracle-memory`, `oracle-tuning`, `oracle-wait`: `iadeep` with
//!   exactly one learned part replaced by the truth ([`Oracle`]), to attribute the gap
//!   between `iadeep` and `oracle` to its parts.
//!
//! Priority classes (issue 27) take the same paths as in production: each task's spec
//! carries its class and cap, so the placer refuses devices where a production job's
//! predicted PD would pass its cap and may evict opportunistic residents to make room
//! (room evictions), and each device tuner keeps production jobs under their caps and
//! declares a breach when it cannot; the breach goes to the placer's eviction executor
//! ([`placement::SimPlacement::breach`]), which chooses the victim by blame and records
//! the avoid pairing. Every resident whose assignment then says "evict" is handed to the
//! engine ([`Policy::take_evictions`]), which takes it off its device; it is released
//! and placed again like a job that `iadeep run --requeue-on-evict` re-queues.
//!
//! Every job's agent is fenced (docs/design.md, "Memory fence"): at the placer's reservation,
//! which its starting assignment carries as its memory bound, then at each later
//! assignment's bound (the tuners', the oracle's, and those the placer writes when it
//! shrinks a resident or settles a provisional reservation). Provisional reservations are
//! settled by the service's own pass (`PlacementService::settle_provisional`) after each
//! batch of reports, as the daemon's reaper settles them every second.

pub mod oracle;
pub mod placement;
pub mod predictor;
pub mod tuning;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use iadeep_placer::{MemoryEstimator, ModelledMemory, WaitModel};
use iadeep_predictor::SlowdownModel;
use iadeep_proto::{BatchSizeAssignment, CapBreach, TaskSpec as ProtoSpec};

use crate::policy::{Assignment, OomAction, PlaceOrQueue, Policy, TuneStep};
use crate::view::{JobSpec, PolicyView, Waiting};
pub use oracle::Oracle;
use oracle::{ORACLE_RETUNE_S, TrueMemory, TrueSlowdown, TrueWait, Truth};
use placement::{SharedPredictor, SimPlacement, task_key, task_of, unix_ms};
use predictor::SimPredictor;
use tuning::{AGENT_REPORT_INTERVAL_S, SimTuner};

/// An assignment as the engine applies it: the batch size, and the memory bound the
/// task's agent moves its fence to (rounded down to whole MiB).
fn sim_assignment(task: usize, a: &BatchSizeAssignment) -> Assignment {
    Assignment {
        task,
        batch_size: a.batch_size,
        memory_bound_mib: fence_mib(a),
    }
}

/// The fence an assignment sets, whole MiB: the real agent's fence of its memory bound
/// (`MemoryMargin::fence_mib`), when it carries one.
fn fence_mib(a: &BatchSizeAssignment) -> Option<u64> {
    a.memory_bound_mib
        .filter(|mib| mib.is_finite() && *mib > 0.0)
        .map(|mib| iadeep_objective::MemoryMargin::DEFAULT.fence_mib(mib))
}

/// Which parts of iadeep are on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Full,
    NoTuner,
    NoPredictor,
}

/// iadeep (or an ablation).
#[derive(Debug)]
pub struct Iadeep {
    variant: Variant,
    /// The predictor the tuners' samples go to; `None` in the no-predictor ablation.
    predictor: Option<Arc<SharedPredictor>>,
    placement: SimPlacement,
    /// The model the placer scores with (the learning predictor, or in the
    /// no-predictor ablation one that never learns), for the audit's sample counts.
    scoring: Arc<SharedPredictor>,
    tuners: HashMap<usize, SimTuner>,
    /// The assignment round each running task is under (what its agent reports with).
    rounds: HashMap<usize, u64>,
    seed: u64,
    /// Tasks told to queue: when they ask again (simulated s), and the finish count then.
    holds: HashMap<usize, (f64, u64)>,
    /// Tasks finished so far.
    finished: u64,
    /// Samples the tuners emitted.
    samples: u64,
    /// The world's truth and which parts it replaces: set for the oracles only.
    truth: Option<(Arc<Truth>, Oracle)>,
    /// Per device, the assignments of settled provisional reservations (each moves a
    /// task's fence), applied at the device's next tuning call.
    settled: HashMap<usize, Vec<Assignment>>,
    /// Residents told to leave (see the module docs), until they have left.
    evicting: HashSet<usize>,
    /// Of those, the ones the engine has not been handed yet.
    evictions: Vec<usize>,
    /// Evictions ordered by placements (room for a production job) and by cap breaches.
    room_evictions: u64,
    cap_evictions: u64,
}

impl Iadeep {
    /// A fresh policy of the given variant.
    pub fn new(variant: Variant, seed: u64) -> crate::Result<Iadeep> {
        let model = Arc::new(SharedPredictor::new(SimPredictor::new()?));
        // Without the predictor the placer still scores, with a model that is never
        // fed samples: the predictor's cold-start heuristic.
        let predictor = (variant != Variant::NoPredictor).then(|| model.clone());
        let placement = SimPlacement::new(model.clone(), Arc::new(ModelledMemory), None)?;
        Ok(Self::with(variant, seed, predictor, placement, model, None))
    }

    /// The full policy with the parts `which` names replaced by the world's truth (see
    /// [`Oracle`]); the others learn as in `iadeep`. `starts` (task, start s) are the
    /// start times of an `iadeep` run of the same stream, for [`Oracle::Wait`].
    pub fn oracle(
        truth: Arc<Truth>,
        which: Oracle,
        starts: &[(usize, f64)],
        seed: u64,
    ) -> crate::Result<Iadeep> {
        let learned = Arc::new(SharedPredictor::new(SimPredictor::new()?));
        let slowdown: Arc<dyn SlowdownModel> = if which.prediction() {
            Arc::new(TrueSlowdown(truth.clone()))
        } else {
            learned.clone()
        };
        let memory: Arc<dyn MemoryEstimator> = if which.memory() {
            Arc::new(TrueMemory(truth.clone()))
        } else {
            Arc::new(ModelledMemory)
        };
        let wait = which
            .wait()
            .then(|| Arc::new(TrueWait::new(starts)) as Arc<dyn WaitModel>);
        let placement = SimPlacement::new(slowdown, memory, wait)?;
        // The learned predictor gets the tuners' samples unless the truth predicts (then
        // it only serves the audit's sample counts).
        let predictor = (!which.prediction()).then(|| learned.clone());
        Ok(Self::with(
            Variant::Full,
            seed,
            predictor,
            placement,
            learned,
            Some((truth, which)),
        ))
    }

    fn with(
        variant: Variant,
        seed: u64,
        predictor: Option<Arc<SharedPredictor>>,
        placement: SimPlacement,
        scoring: Arc<SharedPredictor>,
        truth: Option<(Arc<Truth>, Oracle)>,
    ) -> Iadeep {
        Iadeep {
            variant,
            predictor,
            placement,
            scoring,
            tuners: HashMap::new(),
            rounds: HashMap::new(),
            seed,
            holds: HashMap::new(),
            finished: 0,
            samples: 0,
            truth,
            settled: HashMap::new(),
            evicting: HashSet::new(),
            evictions: Vec::new(),
            room_evictions: 0,
            cap_evictions: 0,
        }
    }

    /// Hands the engine every resident the placer told to leave and it was not handed yet;
    /// returns how many.
    fn collect_evictions(&mut self) -> u64 {
        let mut new = 0;
        for task in self.placement.evict_orders() {
            if self.evicting.insert(task) {
                self.evictions.push(task);
                new += 1;
            }
        }
        new
    }

    /// Routes the assignments the placer wrote when it settled provisional reservations:
    /// to the device tuners (as `Assigned` inputs, as the daemon's watch delivers them)
    /// and to the engine at each device's next tuning call.
    fn route_settled(&mut self, view: &dyn PolicyView) {
        for a in self.placement.take_settled() {
            let Some(task) = task_of(&a.task_id) else {
                continue;
            };
            let Some(device) =
                (0..view.devices()).find(|d| view.residents(*d).iter().any(|r| r.spec.id == task))
            else {
                continue;
            };
            self.rounds.insert(task, a.round);
            self.settled
                .entry(device)
                .or_default()
                .push(sim_assignment(task, &a));
        }
    }

    /// One oracle tuning call: the best configuration of the device by the truth, written
    /// as the tuner writes assignments (a round above every resident's, the memory bound),
    /// so the placer counts the residents at it.
    fn tune_oracle(&mut self, view: &dyn PolicyView, device: usize, truth: &Truth) -> TuneStep {
        let again = TuneStep::Wait {
            again_in_s: Some(ORACLE_RETUNE_S),
        };
        let residents = view.residents(device);
        let Some(best) = truth.best_sizes(&residents) else {
            return again;
        };
        if let Some((task, pd, cap)) = best.over_cap {
            self.oracle_breach(view, device, task, pd, cap);
        }
        let changes: Vec<(usize, u32)> = best
            .sizes
            .into_iter()
            .filter(|(task, size)| {
                residents
                    .iter()
                    .any(|r| r.spec.id == *task && r.report.batch_size != *size)
            })
            .collect();
        let mut assignments = Vec::with_capacity(changes.len());
        if changes.is_empty() {
            return again;
        }
        let round = residents
            .iter()
            .map(|r| self.rounds.get(&r.spec.id).copied().unwrap_or(0))
            .max()
            .unwrap_or(0)
            + 1;
        for &(task, batch_size) in &changes {
            let memory_bound_mib = residents
                .iter()
                .find(|r| r.spec.id == task)
                .and_then(|r| truth.bound_mib(&r.spec.model, batch_size))
                .map(|mib| mib as f64);
            self.rounds.insert(task, round);
            let assignment = BatchSizeAssignment {
                task_id: task_key(task),
                batch_size,
                lr_factor: 1.0,
                round,
                assigned_at_unix_ms: unix_ms(view.now_s()),
                memory_bound_mib,
                ..BatchSizeAssignment::default()
            };
            if let Err(err) = self.placement.assigned(&assignment) {
                tracing::warn!(%err, "cannot record an assignment with the placer");
            }
            assignments.push(sim_assignment(task, &assignment));
        }
        TuneStep::Apply {
            assignments,
            again_in_s: Some(ORACLE_RETUNE_S),
        }
    }

    /// The oracle's cap breach: even its best configuration of the device puts production
    /// job `task` at true PD `pd` above its cap. Handed to the placer's eviction executor
    /// as a tuner's breach is (the victim chosen by blame among the opportunistic
    /// residents that run), unless there is no opportunistic resident to evict.
    fn oracle_breach(
        &mut self,
        view: &dyn PolicyView,
        device: usize,
        task: usize,
        pd: f64,
        cap: f64,
    ) {
        let opportunistic: Vec<String> = view
            .residents(device)
            .iter()
            .filter(|r| r.report.running && !r.spec.is_production())
            .map(|r| task_key(r.spec.id))
            .collect();
        if opportunistic.is_empty() {
            return;
        }
        let breach = CapBreach {
            device_id: placement::device_key(device),
            task_id: task_key(task),
            measured_pd: pd,
            max_slowdown: cap,
            rounds_above: 1,
            opportunistic_task_ids: opportunistic,
            round: self.rounds.get(&task).copied().unwrap_or(0),
            at_unix_ms: unix_ms(view.now_s()),
        };
        if let Err(err) = self.placement.breach(breach) {
            tracing::warn!(%err, device, "cannot act on the oracle's cap breach");
        }
        self.cap_evictions += self.collect_evictions();
    }

    /// A task as this variant submits it: without the tuner, its batch-size range is
    /// its m0 alone.
    /// The full oracle (`truth`) submits each task with its true solo profile: it is the
    /// limit with perfect information in either `--job-info` mode.
    fn spec(variant: Variant, spec: &JobSpec, kind: &str, truth: Option<&Truth>) -> ProtoSpec {
        let known;
        let spec = match truth.and_then(|t| t.solo_profile(&spec.model, spec.m0)) {
            Some(profile) => {
                known = JobSpec {
                    profile: Some(profile),
                    ..spec.clone()
                };
                &known
            }
            None => spec,
        };
        let mut proto = placement::proto_spec(spec, kind);
        if variant == Variant::NoTuner {
            proto.min_batch_size = spec.m0;
            proto.max_batch_size = spec.m0;
        }
        proto
    }
}

impl Policy for Iadeep {
    fn name(&self) -> &str {
        if let Some((_, which)) = &self.truth {
            return which.name();
        }
        match self.variant {
            Variant::Full => "iadeep",
            Variant::NoTuner => "iadeep-no-tuner",
            Variant::NoPredictor => "iadeep-no-predictor",
        }
    }

    /// A task the placer told to queue asks again once its retry hint has passed, as a
    /// client of the daemon does, or as soon as a task finished (a device may be free); in
    /// between it keeps waiting without a new decision. Without this, every event would
    /// re-ask every waiting task, and the decisions alone would take minutes.
    fn place(&mut self, view: &dyn PolicyView, task: Waiting<'_>) -> PlaceOrQueue {
        if let Some((retry_at, finished)) = self.holds.get(&task.spec.id)
            && view.now_s() < *retry_at
            && *finished == self.finished
        {
            return PlaceOrQueue::Queue;
        }
        let recorded = self.placement.audit.as_ref().map(Vec::len);
        let rounds = &self.rounds;
        let variant = self.variant;
        let kind = view.device_kind().to_owned();
        let truth = match &self.truth {
            Some((truth, which)) if which.profiles() => Some(truth.as_ref()),
            _ => None,
        };
        let decided = self.placement.decide(
            view,
            task,
            &|spec| Self::spec(variant, spec, &kind, truth),
            &|t| rounds.get(&t).copied().unwrap_or(0),
        );
        self.route_settled(view);
        self.room_evictions += self.collect_evictions();
        if let Some(audit) = self.placement.audit.as_mut()
            && Some(audit.len()) != recorded
            && let Some(record) = audit.last_mut()
        {
            record.model_samples = self.scoring.model_samples();
            record.samples_seen = self.scoring.counts().0;
        }
        let decision = match decided {
            Ok((decision, assignments)) => {
                if let PlaceOrQueue::Place { .. } = &decision {
                    for a in &assignments {
                        if let Some(t) = task_of(&a.task_id) {
                            self.rounds.insert(t, a.round);
                        }
                    }
                }
                decision
            }
            Err(err) => {
                tracing::warn!(task = task.spec.id, %err, "placement failed; the task waits");
                PlaceOrQueue::Queue
            }
        };
        match (&decision, self.placement.retry_after) {
            (PlaceOrQueue::Queue, Some(retry)) => {
                self.holds.insert(
                    task.spec.id,
                    (view.now_s() + retry.as_secs_f64(), self.finished),
                );
            }
            _ => {
                self.holds.remove(&task.spec.id);
            }
        }
        decision
    }

    fn tunes(&self) -> bool {
        true
    }

    /// The tuner hears of a change with the agents' next reports.
    fn first_tune_in_s(&self) -> Option<f64> {
        Some(AGENT_REPORT_INTERVAL_S)
    }

    fn tune(&mut self, view: &dyn PolicyView, device: usize) -> TuneStep {
        if let Some((truth, which)) = self.truth.clone()
            && which.tuning()
        {
            return self.tune_oracle(view, device, &truth);
        }
        // The reports that arrived settle provisional reservations first, as the daemon's
        // reaper does within a second of them.
        let rounds = &self.rounds;
        self.placement
            .refresh(view, &|t| rounds.get(&t).copied().unwrap_or(0));
        self.route_settled(view);
        let settled = self.settled.remove(&device).unwrap_or_default();
        let tuner = match self.tuners.entry(device) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let seed = self.seed ^ (device as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                match SimTuner::new(device, view.device_kind(), view.capacity_mib(), seed) {
                    Ok(tuner) => e.insert(tuner),
                    Err(err) => {
                        tracing::error!(%err, device, "cannot start the device tuner");
                        return TuneStep::Done;
                    }
                }
            }
        };
        let rounds = &self.rounds;
        let step = tuner.step(view, device, &self.placement, &|t| {
            rounds.get(&t).copied().unwrap_or(0)
        });
        for p in &step.profiles {
            self.placement
                .record_profile(&p.model, &p.device_kind, &p.points);
        }
        for breach in step.breaches {
            if let Err(err) = self.placement.breach(breach) {
                tracing::warn!(%err, device, "cannot act on a cap breach");
            }
        }
        for task_id in &step.restored {
            if let Err(err) = self.placement.restored(device, task_id) {
                tracing::warn!(%err, device, "cannot withdraw a cap breach");
            }
        }
        self.cap_evictions += self.collect_evictions();
        self.samples += step.samples.len() as u64;
        if let Some(predictor) = &self.predictor {
            for sample in step.samples {
                predictor.learn(sample);
            }
        }
        let mut assignments = Vec::with_capacity(step.assignments.len());
        for a in &step.assignments {
            let Some(task) = task_of(&a.task_id) else {
                continue;
            };
            self.rounds.insert(task, a.round);
            if let Err(err) = self.placement.assigned(a) {
                tracing::warn!(%err, "cannot record an assignment with the placer");
            }
            assignments.push(sim_assignment(task, a));
        }
        // A settled reservation's assignment, unless the tuner assigned the task anew (its
        // assignment comes later and carries its own bound).
        for s in settled.into_iter().rev() {
            if !assignments.iter().any(|a| a.task == s.task) {
                assignments.insert(0, s);
            }
        }
        match (assignments.is_empty(), step.again_in_s) {
            (false, again_in_s) => TuneStep::Apply {
                assignments,
                again_in_s,
            },
            (true, Some(again_in_s)) => TuneStep::Wait {
                again_in_s: Some(again_in_s),
            },
            (true, None) => TuneStep::Done,
        }
    }

    /// A crash of the card's memory (fences that together exceed the card): the job
    /// restarts at half its batch size; the tuner learns of it from its next report (a
    /// joint constraint when it shared the GPU). Fenced out-of-memory errors are no
    /// crash: the agent falls back by itself and reports the size that failed.
    fn on_oom(&mut self, _device: usize, _task: usize, _batch_size: u32) -> OomAction {
        OomAction::RestartHalf
    }

    /// A task that could not run within its fence at any size, or that was evicted, left
    /// its device: its launcher releases the placement as it exits, and it is placed
    /// afresh.
    fn on_left(&mut self, _device: usize, task: usize) {
        self.evicting.remove(&task);
        self.rounds.remove(&task);
        // A settled reservation's assignment it has not applied yet is void.
        for pending in self.settled.values_mut() {
            pending.retain(|a| a.task != task);
        }
        if let Err(err) = self.placement.release(task) {
            tracing::warn!(%err, task, "cannot release a task that left its device");
        }
    }

    fn take_evictions(&mut self) -> Vec<usize> {
        std::mem::take(&mut self.evictions)
    }

    fn enable_audit(&mut self) {
        self.placement.audit.get_or_insert_with(Vec::new);
    }

    fn take_audit(&mut self) -> Vec<crate::audit::AuditRecord> {
        self.placement
            .audit
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn diagnostics(&self) -> String {
        let (accepted, refits) = self.predictor.as_ref().map_or((0, 0), |p| p.counts());
        let mut tuners = iadeep_tuner::Counters::default();
        for t in self.tuners.values() {
            let c = t.status().counters;
            tuners.searches += c.searches;
            tuners.measured += c.measured;
            tuners.dropped += c.dropped;
            tuners.out_of_memory += c.out_of_memory;
            tuners.checks += c.checks;
            tuners.drifts += c.drifts;
        }
        format!(
            "predictor samples {} from the tuners, accepted {accepted}, refits {refits}; \
             tuning searches {}, rounds measured {}, dropped {}, ended by an out-of-memory {}, \
             settled checks {}, re-opened on drift {}; evictions for room {}, for caps {}",
            self.samples,
            tuners.searches,
            tuners.measured,
            tuners.dropped,
            tuners.out_of_memory,
            tuners.checks,
            tuners.drifts,
            self.room_evictions,
            self.cap_evictions
        )
    }

    fn on_finish(&mut self, _device: usize, task: usize) {
        self.finished += 1;
        self.rounds.remove(&task);
        if let Err(err) = self.placement.release(task) {
            tracing::warn!(%err, task, "cannot release a finished task");
        }
    }
}
