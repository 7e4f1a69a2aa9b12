//! The discrete-event engine: arrivals, completions, tuning rounds, out-of-memory
//! errors and crash restarts over simulated time, with emulated agents reporting what they measure.
//!
//! Progress between events is exact: a task's rate (samples at m0 per second) is
//! constant between two events on its device, and every event first advances the
//! device's residents to the current time, then recomputes their rates from the
//! ground truth and re-schedules their completions (stale completion events carry an
//! old version and are dropped). The statistical efficiency term follows the task's
//! progress: it is refreshed at each event on its device and, whatever the policy does,
//! at least every [`EngineParams::progress_refresh_s`] (a policy that stops tuning once
//! it has chosen its batch sizes causes no events for hours, and without the refresh a
//! job kept at a batch size below m0 would keep the efficiency of its first minutes,
//! when φ is small, for its whole run).
//!
//! Admission is one rule for every policy ([`EngineParams::admission`]). By default
//! ([`Admission::EachTask`], per-task backfill) every waiting task is offered in
//! submission order, as every client of the placement daemon asks for itself, and one
//! told to wait does not block the others. [`Admission::Fifo`] offers only the head of
//! the queue: while the policy keeps it waiting, the tasks behind it wait too. A task
//! that crashes and has to leave its device waits in a recovery list that is offered
//! first and blocks nobody.
//!
//! What a job brings is one rule for every policy too ([`EngineParams::job_info`]): by
//! default its spec only (model, m0, allowed batch sizes, submit time, work), as a job
//! started with `iadeep run`; with [`JobInfo::Profiled`] also its solo profile at m0.
//!
//! **Memory.** A job's peak memory at its batch size comes from the world's memory model
//! with a fresh fragmentation draw at each allocation. A job placed with a memory fence
//! (`PlaceOrQueue::Place::fence_mib`: its agent caps its own allocator there, docs/design.md,
//! "Memory fence"; the iadeep policies fence every job at the placer's reservation, and
//! each assignment's memory bound moves the fence) whose run needs more than the fence
//! fails its own allocation: a *fenced out-of-memory* ([`RunMetrics::fenced_ooms`]). It
//! loses the step that failed, reports the size, and falls back as the real agent does
//! (see [`crate::agent`]); its co-runners are not touched. Otherwise, when the jobs on a
//! card need more than the card, the job that just allocated the most crashes
//! ([`RunMetrics::ooms`]) and restarts after [`EngineParams::restart_s`] at half its batch
//! size, or leaves the card when the policy says so: how jobs without a fence fail.
//!
//! **Evictions.** A policy may take running tasks off their devices
//! ([`Policy::take_evictions`], asked right after each placement decision and each tuning
//! call): the victim leaves its device, waits in the recovery list for
//! [`EngineParams::restart_s`] (its launcher re-queues it, as `iadeep run
//! --requeue-on-evict` does) and restarts from its last checkpoint. A task checkpoints
//! after every [`EngineParams::checkpoint_every_s`] seconds it ran (counted across
//! placements, from its last checkpoint or restart), so an eviction loses exactly the
//! progress since then; a crash restart loses nothing, as before evictions existed. Each
//! eviction is counted with the work it cost, in seconds of progress alone at m0
//! ([`TaskOutcome::evicted_work_s`]).
//!
//! **Time above the cap.** While a task runs, the engine adds up its running time and the
//! part of it during which its true PD (the world's, as the batch trace records it: its
//! goodput alone at m0 over its goodput now) is above its slowdown cap; an opportunistic
//! task, which has no cap, is measured against the production default
//! ([`iadeep_proto::DEFAULT_MAX_SLOWDOWN`]), which says how often it ran slower than a
//! production job may ([`TaskOutcome::above_cap_s`]).
//!
//! With [`Admission::EachTask`] one pass stops after [`MAX_CONSECUTIVE_WAITS`]
//! tasks in a row were told to wait: when every card is full, the tasks further back
//! would be told the same, and asking all of them at every event would make a pass
//! cost the whole queue. The production jobs further back are still offered: a policy
//! that puts them first (`priority`) holds the opportunistic jobs ahead of them back, and
//! without this they would wait for a pass that never reaches them.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::agent::{EmulatedAgent, measured_step_time, normal};
use crate::error::{Result, SimError};
use crate::metrics::{AboveCapWhere, BatchPoint, RunMetrics, TaskOutcome};
use crate::policy::{Admission, Assignment, OomAction, PlaceOrQueue, Policy, TuneStep};
use crate::view::{JobInfo, JobReport, JobSpec, PolicyView, ResidentJob, SoloProfile, Waiting};
use crate::workload::TaskTemplate;
use crate::world::catalogue::Family;
use crate::world::{TypeId, World, memory};

/// With [`Admission::EachTask`], a pass over the queue stops after this many tasks
/// in a row were told to wait (see the module docs).
pub const MAX_CONSECUTIVE_WAITS: usize = 64;

/// Engine parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineParams {
    pub gpus: usize,
    /// Seconds between tuning rounds on a device (the reporting interval the tuner
    /// waits for fresh reports).
    pub tune_interval_s: f64,
    /// Seconds a crashed task needs before it runs again (restart from checkpoint).
    pub restart_s: f64,
    /// Relative standard deviation of the agents' step-time measurements.
    pub measurement_noise: f64,
    /// Seed of the measurement noise.
    pub seed: u64,
    /// How waiting tasks are offered, the same for every policy.
    pub admission: Admission,
    /// Safety stop: a run needing more events than this is reported as stuck.
    pub max_events: u64,
    /// Seconds between two refreshes of every running task's rate, so that the
    /// statistical efficiency follows φ as the task trains (see the module docs). Between
    /// refreshes the rate lags φ; at the default 10 s a test's completion times are
    /// within 1 % of those at 2 s (at 60 s they were 1.2 % off).
    pub progress_refresh_s: f64,
    /// What every job brings besides its spec, the same for every policy: by default
    /// nothing ([`JobInfo::None`]), as a job started with `iadeep run`; with
    /// [`JobInfo::Profiled`] its solo profile at m0 (`iadeep sim --job-info`).
    pub job_info: JobInfo,
    /// Seconds of running between two checkpoints of a job: an evicted job loses the
    /// progress since its last one (see the module docs). The default, 10 minutes, is a
    /// common epoch-or-time checkpoint interval of training scripts.
    pub checkpoint_every_s: f64,
}

impl Default for EngineParams {
    fn default() -> Self {
        EngineParams {
            gpus: 20,
            tune_interval_s: 60.0,
            restart_s: 60.0,
            measurement_noise: 0.02,
            seed: 1,
            admission: Admission::EachTask,
            max_events: 50_000_000,
            progress_refresh_s: 10.0,
            job_info: JobInfo::None,
            checkpoint_every_s: 600.0,
        }
    }
}

impl EngineParams {
    /// Checks the parameters, naming the first bad one.
    pub fn check(&self) -> Result<()> {
        let bad = |field, reason: String| Err(SimError::InvalidParam { field, reason });
        if self.gpus == 0 {
            return bad("gpus", "must be at least 1".into());
        }
        if !(self.tune_interval_s.is_finite() && self.tune_interval_s > 0.0) {
            return bad("tune interval", format!("{} s", self.tune_interval_s));
        }
        if !(self.restart_s.is_finite() && self.restart_s >= 0.0) {
            return bad("restart time", format!("{} s", self.restart_s));
        }
        if !(self.measurement_noise.is_finite() && (0.0..0.5).contains(&self.measurement_noise)) {
            return bad("measurement noise", format!("{}", self.measurement_noise));
        }
        if !(self.progress_refresh_s.is_finite() && self.progress_refresh_s > 0.0) {
            return bad("progress refresh", format!("{} s", self.progress_refresh_s));
        }
        if !(self.checkpoint_every_s.is_finite() && self.checkpoint_every_s > 0.0) {
            return bad(
                "checkpoint interval",
                format!("{} s", self.checkpoint_every_s),
            );
        }
        Ok(())
    }
}

/// The smallest relative change of a job's PD that makes a new point of the batch trace.
const TRACE_PD_STEP: f64 = 0.01;

/// A running task's true PD: its goodput alone at m0 over its goodput now.
fn true_pd(state: &TaskState) -> f64 {
    f64::from(state.spec.m0) / state.true_solo_step_s / state.rate
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    NotArrived,
    Waiting,
    Running(usize),
    Done,
}

#[derive(Debug)]
struct TaskState {
    spec: JobSpec,
    /// The world's step time alone at m0 (the spec holds what the profiling run measured).
    true_solo_step_s: f64,
    family: usize,
    status: Status,
    batch_size: u32,
    job: TypeId,
    /// Samples at m0 done.
    done: f64,
    /// Samples at m0 per second since `last_s` (0 while not running).
    rate: f64,
    last_s: f64,
    version: u64,
    /// False while restarting after a crash.
    active: bool,
    report: JobReport,
    /// Out-of-memory crashes (the card's memory ran out).
    ooms: u32,
    /// Fenced out-of-memory errors (its run needed more than its fence).
    fenced_ooms: u32,
    /// The batch size and PD of its last point in the run's batch trace.
    traced: Option<(u32, f64)>,
    /// The memory fence of its agent, MiB, when it has one (see the module docs).
    fence_mib: Option<u64>,
    /// Not before this time may the task be offered to the policy again.
    hold_until_s: f64,
    first_start_s: Option<f64>,
    finish_s: Option<f64>,
    /// The device it last ran on.
    last_device: usize,
    /// Fragmentation overhead of its current allocation (see [`crate::world::memory`]).
    fragmentation: f64,
    /// How many times it allocated its memory (seeds the next fragmentation draw).
    allocations: u64,
    /// Its agent's measuring side (the gradient noise scale estimator).
    agent: EmulatedAgent,
    /// When its agent last reported, simulated s.
    reported_s: f64,
    /// Samples at m0 done at its last checkpoint (what an eviction goes back to).
    checkpoint_done: f64,
    /// Seconds it ran since its last checkpoint (or restart from one).
    since_checkpoint_s: f64,
    /// Seconds it ran (active on a device), and the part of them above its cap (see the
    /// module docs).
    running_s: f64,
    above_cap_s: f64,
    above_cap_where: AboveCapWhere,
    /// Times it was evicted, and the samples at m0 those evictions cost.
    evictions: u32,
    evicted_samples: f64,
}

/// A simulated GPU as the engine tracks it: which tasks run on it.
#[derive(Debug, Default)]
struct GpuState {
    residents: Vec<usize>,
    /// Incremented whenever the residents change, to retire old tuning chains.
    epoch: u64,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum EventKind {
    Arrival(usize),
    Finish {
        task: usize,
        version: u64,
    },
    Tune {
        device: usize,
        epoch: u64,
    },
    Restart {
        task: usize,
        version: u64,
    },
    Retry,
    /// Every running task's rate follows its progress (see [`EngineParams::progress_refresh_s`]).
    Refresh,
}

#[derive(Debug)]
struct Event {
    at: f64,
    seq: u64,
    kind: EventKind,
}

impl PartialEq for Event {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Event {}
impl PartialOrd for Event {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Event {
    /// Reversed, so the max-heap pops the earliest event (ties: first scheduled).
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at
            .total_cmp(&self.at)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// One simulation run of one policy.
#[derive(Debug)]
pub struct Engine<'w> {
    world: &'w World,
    params: EngineParams,
    tasks: Vec<TaskState>,
    devices: Vec<GpuState>,
    queue: VecDeque<usize>,
    /// Tasks that crashed and left their device: offered before the queue, and
    /// never blocking it (a policy may keep them waiting for a GPU of their own).
    recovery: VecDeque<usize>,
    events: BinaryHeap<Event>,
    seq: u64,
    now: f64,
    rng: ChaCha8Rng,
    metrics: RunMetrics,
    retry_pending: bool,
    /// A [`EventKind::Refresh`] is scheduled.
    refresh_pending: bool,
    /// Incremented whenever a task joins or leaves the queue or the recovery list.
    waiting_version: u64,
}

/// The view handed to policies: specs and reports only.
struct View<'e, 'w> {
    engine: &'e Engine<'w>,
}

impl PolicyView for View<'_, '_> {
    fn now_s(&self) -> f64 {
        self.engine.now
    }
    fn devices(&self) -> usize {
        self.engine.devices.len()
    }
    fn device_kind(&self) -> &str {
        &self.engine.world.catalogue.worker_type
    }
    fn capacity_mib(&self) -> u64 {
        self.engine.world.memory.capacity_mib
    }
    fn residents(&self, device: usize) -> Vec<ResidentJob<'_>> {
        self.engine
            .devices
            .get(device)
            .map(|d| {
                d.residents
                    .iter()
                    .map(|t| {
                        let task = &self.engine.tasks[*t];
                        ResidentJob {
                            spec: &task.spec,
                            report: &task.report,
                        }
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
    fn resident_count(&self, device: usize) -> usize {
        self.engine
            .devices
            .get(device)
            .map_or(0, |d| d.residents.len())
    }
    fn waiting(&self) -> Vec<&JobSpec> {
        self.engine
            .recovery
            .iter()
            .chain(&self.engine.queue)
            .map(|t| &self.engine.tasks[*t].spec)
            .collect()
    }
    fn waiting_version(&self) -> u64 {
        self.engine.waiting_version
    }
    fn admission(&self) -> Admission {
        self.engine.params.admission
    }
}

/// What became of an event (see [`Engine::dispatch`]).
enum Dispatched {
    Stale,
    /// A task finished.
    Finished,
    Handled,
}

impl TaskState {
    /// Task `index` of the workload, `t` (of `family`), before it arrives; `profile` is
    /// what it is submitted with, and `solo_steps_per_s` its true solo speed.
    fn submitted(
        index: usize,
        t: &TaskTemplate,
        family: &Family,
        profile: Option<SoloProfile>,
        solo_steps_per_s: f64,
    ) -> TaskState {
        TaskState {
            spec: JobSpec {
                id: index,
                model: family.name.clone(),
                m0: t.m0,
                batch_sizes: family.batch_sizes.clone(),
                profile,
                submit_s: t.submit_s,
                total_samples: t.work_samples,
                max_slowdown: t.max_slowdown,
            },
            true_solo_step_s: 1.0 / solo_steps_per_s,
            family: t.family,
            status: Status::NotArrived,
            batch_size: t.m0,
            job: t.job,
            done: 0.0,
            rate: 0.0,
            last_s: t.submit_s,
            version: 0,
            traced: None,
            active: false,
            // Nothing measured before the first steps (`seq` 0): no step time, no
            // peak (the world's values must not reach a policy this way either).
            report: JobReport {
                batch_size: t.m0,
                step_time_s: 0.0,
                samples_per_s: 0.0,
                peak_mem_mib: 0,
                // No estimate before the first steps.
                grad_noise_scale: None,
                samples_done: 0.0,
                oom_batch_size: None,
                seq: 0,
                running: false,
            },
            ooms: 0,
            fenced_ooms: 0,
            fence_mib: None,
            hold_until_s: 0.0,
            first_start_s: None,
            finish_s: None,
            last_device: 0,
            fragmentation: 0.0,
            allocations: 0,
            agent: EmulatedAgent::default(),
            reported_s: t.submit_s,
            checkpoint_done: 0.0,
            since_checkpoint_s: 0.0,
            running_s: 0.0,
            above_cap_s: 0.0,
            above_cap_where: AboveCapWhere::default(),
            evictions: 0,
            evicted_samples: 0.0,
        }
    }
}

impl<'w> Engine<'w> {
    /// Prepares a run over `workload` on `params.gpus` devices of the world's kind.
    pub fn new(
        world: &'w World,
        workload: &[TaskTemplate],
        params: EngineParams,
    ) -> Result<Engine<'w>> {
        params.check()?;
        let catalogue = &world.catalogue;
        // With `JobInfo::Profiled` each job is submitted with a solo profile at m0: one
        // profiling run, measured with the same noise as every report (policies never see
        // the world's exact step time). The draws are made in both modes, so the rest of
        // a run's randomness does not depend on the mode.
        let mut profiling = ChaCha8Rng::seed_from_u64(params.seed ^ 0x0070_f11e_5eed);
        let tasks = workload
            .iter()
            .enumerate()
            .map(|(index, t)| {
                let family = &catalogue.families[t.family];
                let info = &catalogue.types[t.job];
                let profiled = (params.measurement_noise * normal(&mut profiling)).exp();
                let profiled_fragmentation =
                    profiling.random_range(0.0..=memory::FRAGMENTATION_MAX);
                let profile = (params.job_info == JobInfo::Profiled).then(|| SoloProfile {
                    step_time_s: profiled / info.solo_steps_per_s,
                    peak_mem_mib: world.memory.peak_mib(t.job, profiled_fragmentation),
                });
                TaskState::submitted(index, t, family, profile, info.solo_steps_per_s)
            })
            .collect();
        let mut engine = Engine {
            world,
            devices: (0..params.gpus).map(|_| GpuState::default()).collect(),
            rng: ChaCha8Rng::seed_from_u64(params.seed ^ 0x005e_ed0f_a6e7),
            params,
            tasks,
            queue: VecDeque::new(),
            recovery: VecDeque::new(),
            events: BinaryHeap::new(),
            seq: 0,
            now: 0.0,
            metrics: RunMetrics::default(),
            retry_pending: false,
            refresh_pending: false,
            waiting_version: 0,
        };
        for (index, t) in workload.iter().enumerate() {
            engine.schedule(t.submit_s, EventKind::Arrival(index));
        }
        Ok(engine)
    }

    fn schedule(&mut self, at: f64, kind: EventKind) {
        self.seq += 1;
        self.events.push(Event {
            at,
            seq: self.seq,
            kind,
        });
    }

    /// Runs `policy` to the end; `progress(done, total)` is called as tasks finish.
    pub fn run(
        mut self,
        policy: &mut dyn Policy,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<RunMetrics> {
        let total = self.tasks.len();
        let mut finished = 0;
        let mut processed: u64 = 0;
        self.metrics.policy = policy.name().to_owned();
        self.metrics.gpus = self.devices.len();
        while let Some(event) = self.events.pop() {
            processed += 1;
            if processed > self.params.max_events {
                return Err(SimError::Policy {
                    policy: policy.name().to_owned(),
                    reason: format!(
                        "no end after {} events ({finished} of {total} tasks done)",
                        self.params.max_events
                    ),
                });
            }
            self.now = event.at;
            match self.dispatch(event.kind, policy)? {
                Dispatched::Stale => continue,
                Dispatched::Finished => {
                    finished += 1;
                    progress(finished, total);
                }
                Dispatched::Handled => {}
            }
            self.admit(policy)?;
            if finished == total {
                break;
            }
        }
        if finished < total {
            return Err(SimError::Policy {
                policy: policy.name().to_owned(),
                reason: format!(
                    "{} tasks unfinished with no event left ({} queued, {} recovering, {} on devices): the policy never placed them",
                    total - finished,
                    self.queue.len(),
                    self.recovery.len(),
                    self.devices
                        .iter()
                        .map(|d| d.residents.len())
                        .sum::<usize>()
                ),
            });
        }
        self.metrics.tasks = self.outcomes();
        self.metrics.events = processed;
        Ok(self.metrics)
    }

    /// Handles one event at `self.now`: `Stale` when it no longer applies (a task or
    /// device moved on since it was scheduled), and then nothing is admitted after it.
    fn dispatch(&mut self, kind: EventKind, policy: &mut dyn Policy) -> Result<Dispatched> {
        match kind {
            EventKind::Arrival(task) => {
                self.tasks[task].status = Status::Waiting;
                self.queue.push_back(task);
                self.waiting_version += 1;
            }
            EventKind::Finish { task, version } => {
                if self.tasks[task].version != version {
                    return Ok(Dispatched::Stale);
                }
                let Status::Running(device) = self.tasks[task].status else {
                    return Ok(Dispatched::Stale);
                };
                self.advance(device);
                let state = &mut self.tasks[task];
                state.status = Status::Done;
                state.finish_s = Some(self.now);
                state.rate = 0.0;
                state.version += 1;
                state.report.running = false;
                self.devices[device].residents.retain(|t| *t != task);
                policy.on_finish(device, task);
                self.residents_changed(device, policy);
                return Ok(Dispatched::Finished);
            }
            EventKind::Tune { device, epoch } => {
                if self.devices[device].epoch != epoch {
                    return Ok(Dispatched::Stale);
                }
                self.tune(device, policy)?;
            }
            EventKind::Restart { task, version } => {
                if self.tasks[task].version != version {
                    return Ok(Dispatched::Stale);
                }
                let Status::Running(device) = self.tasks[task].status else {
                    return Ok(Dispatched::Stale);
                };
                self.advance(device);
                self.tasks[task].active = true;
                self.allocate(task);
                self.after_memory_change(device, &[task], policy);
            }
            EventKind::Retry => self.retry_pending = false,
            EventKind::Refresh => self.refresh(),
        }
        Ok(Dispatched::Handled)
    }

    /// Every task's outcome, as the run left it.
    fn outcomes(&self) -> Vec<TaskOutcome> {
        self.tasks
            .iter()
            .map(|t| TaskOutcome {
                id: t.spec.id,
                model: t.spec.model.clone(),
                m0: t.spec.m0,
                submit_s: t.spec.submit_s,
                start_s: t.first_start_s.unwrap_or(t.spec.submit_s),
                finish_s: t.finish_s.unwrap_or(self.now),
                ooms: t.ooms,
                fenced_ooms: t.fenced_ooms,
                work_samples: t.spec.total_samples,
                done_samples: t.done,
                device: t.last_device,
                final_batch_size: t.batch_size,
                max_slowdown: t.spec.max_slowdown,
                running_s: t.running_s,
                above_cap_s: t.above_cap_s,
                above_cap_where: t.above_cap_where,
                evictions: t.evictions,
                evicted_work_s: t.evicted_samples * t.true_solo_step_s / f64::from(t.spec.m0),
            })
            .collect()
    }

    /// Offers crashed tasks (each, in order), then the head of the queue until the
    /// policy says wait.
    fn admit(&mut self, policy: &mut dyn Policy) -> Result<()> {
        self.admit_recovering(policy)?;
        match self.params.admission {
            Admission::Fifo => self.admit_fifo(policy),
            Admission::EachTask => self.admit_each_task(policy),
        }
    }

    /// Offers `task` to the policy. When it is placed, `take` removes it from the list it
    /// waits in, before it starts (so the policy no longer sees it waiting), and it
    /// starts. Whether it was placed.
    fn offer(
        &mut self,
        task: usize,
        policy: &mut dyn Policy,
        take: impl FnOnce(&mut Self),
    ) -> Result<bool> {
        match self.decide(task, policy) {
            PlaceOrQueue::Queue => Ok(false),
            PlaceOrQueue::Place {
                device,
                batch_size,
                shrinks,
                fence_mib,
            } => {
                take(self);
                self.waiting_version += 1;
                self.start(task, device, batch_size, &shrinks, fence_mib, policy)?;
                Ok(true)
            }
        }
    }

    /// Offers each crashed task whose hold is over, in order; those still held get a
    /// retry at their hold's end.
    fn admit_recovering(&mut self, policy: &mut dyn Policy) -> Result<()> {
        let mut index = 0;
        while index < self.recovery.len() {
            let task = self.recovery[index];
            if self.tasks[task].hold_until_s > self.now {
                self.retry_at(self.tasks[task].hold_until_s);
                index += 1;
                continue;
            }
            if !self.offer(task, policy, |e| {
                e.recovery.remove(index);
            })? {
                index += 1;
            }
        }
        Ok(())
    }

    /// FIFO admission: places the head of the queue until the policy says it waits.
    fn admit_fifo(&mut self, policy: &mut dyn Policy) -> Result<()> {
        while let Some(&task) = self.queue.front() {
            if !self.offer(task, policy, |e| {
                e.queue.pop_front();
            })? {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Each-task admission: offers every queued task in order until
    /// `MAX_CONSECUTIVE_WAITS` in a row wait, then production jobs past that cut.
    fn admit_each_task(&mut self, policy: &mut dyn Policy) -> Result<()> {
        let mut index = 0;
        let mut waits = 0;
        while index < self.queue.len() && waits < MAX_CONSECUTIVE_WAITS {
            let task = self.queue[index];
            if self.offer(task, policy, |e| {
                e.queue.remove(index);
            })? {
                waits = 0;
            } else {
                index += 1;
                waits += 1;
            }
        }
        // Production jobs past the cut still ask (see the module docs).
        while index < self.queue.len() {
            let task = self.queue[index];
            let placed = self.tasks[task].spec.is_production()
                && self.offer(task, policy, |e| {
                    e.queue.remove(index);
                })?;
            if !placed {
                index += 1;
            }
        }
        Ok(())
    }

    /// Makes sure waiting tasks are offered again at `at`.
    fn retry_at(&mut self, at: f64) {
        if !self.retry_pending {
            self.retry_pending = true;
            self.schedule(at, EventKind::Retry);
        }
    }

    /// Asks the policy about one waiting task, timing the decision.
    fn decide(&mut self, task: usize, policy: &mut dyn Policy) -> PlaceOrQueue {
        let started = Instant::now();
        let decision = {
            let state = &self.tasks[task];
            let waiting = Waiting {
                spec: &state.spec,
                batch_size: state.batch_size,
                ooms: state.ooms,
            };
            policy.place(&View { engine: self }, waiting)
        };
        self.metrics
            .decision_latency_us
            .push(started.elapsed().as_secs_f64() * 1e6);
        // Room made for this task (or any other the policy chose to evict) is made before
        // it starts.
        self.apply_evictions(policy);
        decision
    }

    fn policy_error(policy: &dyn Policy, reason: String) -> SimError {
        SimError::Policy {
            policy: policy.name().to_owned(),
            reason,
        }
    }

    /// The measured job type of `task` at `batch_size`; a policy asking for a batch
    /// size the task's family was never measured at is a policy error.
    fn job_type(&self, policy: &dyn Policy, task: usize, batch_size: u32) -> Result<TypeId> {
        let family = self.tasks[task].family;
        self.world
            .catalogue
            .type_of(family, batch_size)
            .ok_or_else(|| {
                Self::policy_error(
                    policy,
                    format!("batch size {batch_size} is not allowed for task {task}"),
                )
            })
    }

    /// Starts `task` on `device` at `batch_size`, after the residents in `shrinks` moved
    /// to their new batch sizes (the placement made room before the newcomer's first
    /// step, as the real agents apply their assignments first), with its agent's memory
    /// fence at `fence_mib` (none: an agent without a fence).
    fn start(
        &mut self,
        task: usize,
        device: usize,
        batch_size: u32,
        shrinks: &[Assignment],
        fence_mib: Option<u64>,
        policy: &mut dyn Policy,
    ) -> Result<()> {
        if device >= self.devices.len() {
            return Err(Self::policy_error(
                policy,
                format!("placed task {task} on unknown device {device}"),
            ));
        }
        let job = self.job_type(policy, task, batch_size)?;
        self.advance(device);
        let (shrunk, refenced) = self.set_batch_sizes(device, shrinks, policy)?;
        if !shrunk.is_empty() || refenced {
            self.metrics.batch_changes += shrunk.len() as u64;
            self.after_memory_change(device, &shrunk, policy);
        }
        let now = self.now;
        let state = &mut self.tasks[task];
        state.status = Status::Running(device);
        state.batch_size = batch_size;
        state.job = job;
        state.active = true;
        state.last_s = now;
        state.first_start_s.get_or_insert(now);
        state.last_device = device;
        state.fence_mib = fence_mib;
        self.allocate(task);
        self.devices[device].residents.push(task);
        self.keep_refreshing();
        tracing::trace!(task, device, batch_size, now, "placed");
        self.after_memory_change(device, &[task], policy);
        self.residents_changed(device, policy);
        Ok(())
    }

    /// Moves residents of `device` to new batch sizes and moves the fences of fenced
    /// ones to the assignments' memory bounds; returns the tasks whose batch size changed
    /// and whether a fence moved.
    fn set_batch_sizes(
        &mut self,
        device: usize,
        assignments: &[Assignment],
        policy: &mut dyn Policy,
    ) -> Result<(Vec<usize>, bool)> {
        let mut changed = Vec::new();
        let mut refenced = false;
        for &Assignment {
            task,
            batch_size,
            memory_bound_mib,
        } in assignments
        {
            if self.tasks.get(task).map(|t| t.status) != Some(Status::Running(device)) {
                return Err(Self::policy_error(
                    policy,
                    format!("assigned a batch size to task {task}, not on device {device}"),
                ));
            }
            let job = self.job_type(policy, task, batch_size)?;
            let state = &mut self.tasks[task];
            // The agent moves its fence with every assignment that carries a bound.
            if let (Some(fence), Some(bound)) = (state.fence_mib, memory_bound_mib)
                && fence != bound
            {
                state.fence_mib = Some(bound);
                refenced = true;
            }
            if state.batch_size != batch_size && state.active {
                state.batch_size = batch_size;
                state.job = job;
                self.allocate(task);
                changed.push(task);
            }
        }
        Ok((changed, refenced))
    }

    /// The task allocates its memory anew (start, restart, batch-size change): a fresh
    /// fragmentation overhead, drawn from the seed, the task and its allocation count,
    /// so that every policy's run of a task sees the same sequence of draws.
    fn allocate(&mut self, task: usize) {
        let state = &mut self.tasks[task];
        let mut draw = ChaCha8Rng::seed_from_u64(
            self.params.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                ^ ((task as u64) << 24)
                ^ state.allocations,
        );
        state.allocations += 1;
        state.fragmentation = draw.random_range(0.0..=memory::FRAGMENTATION_MAX);
    }

    /// Peak MiB of a task's current run.
    fn peak_mib(&self, task: usize) -> u64 {
        let state = &self.tasks[task];
        self.world.memory.peak_mib(state.job, state.fragmentation)
    }

    /// Brings every resident of `device` to the current time at its current rate, with
    /// its checkpoints and its time above its cap on the way (the rate is constant since
    /// `last_s`, so both are exact).
    fn advance(&mut self, device: usize) {
        let now = self.now;
        let every = self.params.checkpoint_every_s;
        let active = self.devices[device]
            .residents
            .iter()
            .filter(|&&t| self.tasks[t].active)
            .count();
        for &t in &self.devices[device].residents {
            let state = &mut self.tasks[t];
            let ran_s = now - state.last_s;
            if state.active && ran_s > 0.0 {
                let since = state.since_checkpoint_s + ran_s;
                if since >= every {
                    // The last checkpoint in this stretch, `since % every` before now.
                    let taken = (since / every).floor() * every;
                    let at_s = ran_s - (since - taken);
                    state.checkpoint_done = (state.done + state.rate * at_s)
                        .min(state.spec.total_samples)
                        .max(state.checkpoint_done);
                    state.since_checkpoint_s = since - taken;
                } else {
                    state.since_checkpoint_s = since;
                }
                state.running_s += ran_s;
                let cap = state
                    .spec
                    .max_slowdown
                    .unwrap_or(iadeep_proto::DEFAULT_MAX_SLOWDOWN);
                if state.rate > 0.0 && true_pd(state) > cap {
                    state.above_cap_s += ran_s;
                    let at = &mut state.above_cap_where;
                    match state.batch_size.cmp(&state.spec.m0) {
                        Ordering::Less => at.below_m0_s += ran_s,
                        Ordering::Greater => at.above_m0_s += ran_s,
                        Ordering::Equal => {}
                    }
                    if active > 1 {
                        at.shared_s += ran_s;
                    }
                }
            }
            state.done =
                (state.done + state.rate * (now - state.last_s)).min(state.spec.total_samples);
            state.last_s = now;
        }
    }

    /// Takes the tasks the policy evicted off their devices (see the module docs).
    fn apply_evictions(&mut self, policy: &mut dyn Policy) {
        for task in policy.take_evictions() {
            let Some(Status::Running(device)) = self.tasks.get(task).map(|t| t.status) else {
                // Finished (or gone) since the policy decided: nothing to evict.
                tracing::debug!(task, "eviction of a task not running ignored");
                continue;
            };
            self.advance(device);
            let state = &mut self.tasks[task];
            let lost = (state.done - state.checkpoint_done).max(0.0);
            state.done = state.checkpoint_done;
            state.report.samples_done = state.done;
            state.since_checkpoint_s = 0.0;
            state.evictions += 1;
            state.evicted_samples += lost;
            state.version += 1;
            self.metrics.evictions += 1;
            tracing::debug!(task, device, lost, now = self.now, "evicted");
            self.leave(device, task, policy);
        }
    }

    /// Checks the device after `changed` tasks allocated memory (or fences moved).
    /// First the fences: an active fenced task whose run needs more than its fence fails
    /// its own allocation ([`Engine::fenced_oom`]), whatever its co-runners do. Then the
    /// card: if the active residents no longer fit, the changed task with the most memory
    /// crashes (its allocation is the one that fails). Then rates are recomputed.
    fn after_memory_change(&mut self, device: usize, changed: &[usize], policy: &mut dyn Policy) {
        let over_fence: Vec<usize> = self.devices[device]
            .residents
            .iter()
            .copied()
            .filter(|&t| {
                let state = &self.tasks[t];
                state.active
                    && state
                        .fence_mib
                        .is_some_and(|fence| self.peak_mib(t) > fence)
            })
            .collect();
        for task in over_fence {
            self.fenced_oom(device, task, policy);
        }
        loop {
            let peaks: Vec<u64> = self.devices[device]
                .residents
                .iter()
                .filter(|t| self.tasks[**t].active)
                .map(|t| self.peak_mib(*t))
                .collect();
            if self.world.memory.fits(peaks.into_iter()) {
                break;
            }
            let Some(&victim) = changed
                .iter()
                .filter(|t| {
                    self.tasks[**t].active && self.tasks[**t].status == Status::Running(device)
                })
                .max_by_key(|t| self.peak_mib(**t))
            else {
                break;
            };
            self.crash(device, victim, policy);
        }
        self.recompute(device);
    }

    fn crash(&mut self, device: usize, task: usize, policy: &mut dyn Policy) {
        self.metrics.ooms += 1;
        let batch = self.tasks[task].batch_size;
        let action = policy.on_oom(device, task, batch);
        let family = self.tasks[task].family;
        let sizes = &self.world.catalogue.families[family].batch_sizes;
        let half = sizes.iter().rev().find(|b| **b <= batch / 2).copied();
        if tracing::enabled!(tracing::Level::DEBUG) {
            let residents: Vec<(usize, u32, u64, bool)> = self.devices[device]
                .residents
                .iter()
                .map(|&t| {
                    let s = &self.tasks[t];
                    (t, s.batch_size, self.peak_mib(t), s.active)
                })
                .collect();
            tracing::debug!(
                task,
                device,
                batch,
                ?action,
                now = self.now,
                capacity_mib = self.world.memory.capacity_mib,
                ?residents,
                "out of memory (residents: task, batch size, peak MiB of this run, active)"
            );
        }
        let restart_at = self.now + self.params.restart_s;
        let state = &mut self.tasks[task];
        state.ooms += 1;
        state.report.oom_batch_size = Some(batch);
        state.rate = 0.0;
        state.active = false;
        state.version += 1;
        state.report.running = false;
        if let Some(half) = half {
            state.batch_size = half;
            if let Some(job) = self.world.catalogue.type_of(family, half) {
                state.job = job;
            }
        }
        match (action, half) {
            (OomAction::RestartHalf, Some(_)) => {
                let version = state.version;
                self.schedule(restart_at, EventKind::Restart { task, version });
            }
            _ => self.leave(device, task, policy),
        }
    }

    /// A task that cannot go on on its device leaves it and waits in the recovery list
    /// for a new placement after the restart time (restarted from its checkpoint); the
    /// policy hears of it ([`Policy::on_left`]).
    fn leave(&mut self, device: usize, task: usize, policy: &mut dyn Policy) {
        let state = &mut self.tasks[task];
        state.status = Status::Waiting;
        state.active = false;
        state.rate = 0.0;
        state.report.running = false;
        state.hold_until_s = self.now + self.params.restart_s;
        self.devices[device].residents.retain(|t| *t != task);
        self.recovery.push_back(task);
        self.waiting_version += 1;
        policy.on_left(device, task);
        self.residents_changed(device, policy);
    }

    /// A fenced task's run needs more than its fence: its own allocation fails, as the
    /// real agent's fenced allocator makes it, and nothing happens to its co-runners. Its
    /// agent reports the failed size and falls back by the real agent's rule
    /// ([`EmulatedAgent::out_of_memory`]); the task loses the step that failed (one step
    /// at that size next to its co-runners) and runs on at the fall-back size, which is
    /// checked against the fence again. A task that cannot run any smaller leaves the
    /// device ([`Engine::leave`]).
    fn fenced_oom(&mut self, device: usize, task: usize, policy: &mut dyn Policy) {
        self.metrics.fenced_ooms += 1;
        let capacity_mib = self.world.memory.capacity_mib;
        let others: Vec<TypeId> = self.devices[device]
            .residents
            .iter()
            .filter(|&&t| t != task && self.tasks[t].active)
            .map(|&t| self.tasks[t].job)
            .collect();
        let state = &self.tasks[task];
        let lost_step_s = 1.0 / self.world.steps_per_s(state.job, others.into_iter());
        let family = state.family;
        let batch = state.batch_size;
        let sizes = &self.world.catalogue.families[family].batch_sizes;
        tracing::debug!(
            task,
            device,
            batch,
            peak_mib = self.peak_mib(task),
            fence_mib = ?state.fence_mib,
            now = self.now,
            "fenced out of memory"
        );
        let state = &mut self.tasks[task];
        let fallback = state.agent.out_of_memory(batch, capacity_mib, sizes);
        state.fenced_ooms += 1;
        state.report.oom_batch_size = state.agent.smallest_oom();
        state.rate = 0.0;
        state.active = false;
        state.version += 1;
        match self.world.catalogue.type_of(family, fallback) {
            Some(job) if fallback < batch => {
                state.batch_size = fallback;
                state.job = job;
                let version = state.version;
                self.schedule(self.now + lost_step_s, EventKind::Restart { task, version });
            }
            _ => self.leave(device, task, policy),
        }
    }

    /// Recomputes rates, reports and completion times of the device's residents.
    fn recompute(&mut self, device: usize) {
        self.update_rates(device, true);
        self.record_util();
    }

    /// Records the cluster's utilisation now (one sample per instant: the last wins).
    fn record_util(&mut self) {
        self.metrics
            .record_util(self.now, self.busy_devices(), self.work_rate());
    }

    /// Recomputes the rates and completion times of the device's residents; with
    /// `fresh_reports`, their agents also report what they measured since their last
    /// report (a world refresh changes rates only: agents report on their own schedule).
    fn update_rates(&mut self, device: usize, fresh_reports: bool) {
        let world = self.world;
        let active: Vec<(usize, TypeId)> = self.devices[device]
            .residents
            .iter()
            .filter(|t| self.tasks[**t].active)
            .map(|t| (*t, self.tasks[*t].job))
            .collect();
        for &(task, job) in &active {
            let steps = world.steps_per_s(
                job,
                active.iter().filter(|(t, _)| *t != task).map(|(_, j)| *j),
            );
            let peak_mib = self.peak_mib(task);
            let state = &mut self.tasks[task];
            let fraction = state.done / state.spec.total_samples.max(f64::MIN_POSITIVE);
            let phi = world.phi(state.family, fraction);
            let efficiency = phi.map_or(1.0, |phi| {
                crate::world::efficiency::efficiency(phi, state.spec.m0, state.batch_size)
            });
            let samples_per_s = steps * f64::from(state.batch_size);
            state.rate = samples_per_s * efficiency;
            state.version += 1;
            if fresh_reports {
                // A point only where the batch size or the PD moved (by 1 % or more): the
                // plot is a step function, and a long run has a change every few seconds.
                let pd = true_pd(state);
                let moved = state.traced.is_none_or(|(batch, last)| {
                    batch != state.batch_size || (pd / last - 1.0).abs() >= TRACE_PD_STEP
                });
                if moved {
                    state.traced = Some((state.batch_size, pd));
                    self.metrics.batch_trace.push(BatchPoint {
                        at_s: self.now,
                        device,
                        task,
                        batch_size: state.batch_size,
                        pd,
                    });
                }
                // What the agent measured since its last report (see `crate::agent`).
                let steps_run = ((self.now - state.reported_s) * steps).max(0.0) as u64;
                state.reported_s = self.now;
                let step_time_s =
                    measured_step_time(&mut self.rng, 1.0 / steps, self.params.measurement_noise);
                let grad_noise_scale =
                    state
                        .agent
                        .observe_gradients(&mut self.rng, phi, state.batch_size, steps_run);
                state.agent.ran(state.batch_size, peak_mib);
                state.report = JobReport {
                    batch_size: state.batch_size,
                    step_time_s,
                    samples_per_s: f64::from(state.batch_size) / step_time_s,
                    peak_mem_mib: peak_mib,
                    grad_noise_scale,
                    samples_done: state.done,
                    oom_batch_size: state.report.oom_batch_size,
                    seq: state.report.seq + 1,
                    running: true,
                };
            }
            let remaining = (state.spec.total_samples - state.done).max(0.0);
            let at = self.now + remaining / state.rate;
            let version = state.version;
            self.schedule(at, EventKind::Finish { task, version });
        }
    }

    fn busy_devices(&self) -> usize {
        self.devices
            .iter()
            .filter(|d| !d.residents.is_empty())
            .count()
    }

    /// Progress of all running tasks in GPU-equivalents: Σ rate / (rate alone at m0).
    fn work_rate(&self) -> f64 {
        self.tasks
            .iter()
            .filter(|t| matches!(t.status, Status::Running(_)))
            .map(|t| t.rate * t.true_solo_step_s / f64::from(t.spec.m0))
            .sum()
    }

    /// Schedules the next [`EventKind::Refresh`] unless one is pending.
    fn keep_refreshing(&mut self) {
        if !self.refresh_pending {
            self.refresh_pending = true;
            self.schedule(
                self.now + self.params.progress_refresh_s,
                EventKind::Refresh,
            );
        }
    }

    /// Brings every running task to the current time and recomputes its rate (its
    /// efficiency at the φ it has reached); refreshes again while anything runs (placing
    /// a task starts the refreshes again).
    fn refresh(&mut self) {
        self.refresh_pending = false;
        let busy: Vec<usize> = (0..self.devices.len())
            .filter(|d| !self.devices[*d].residents.is_empty())
            .collect();
        for &device in &busy {
            self.advance(device);
            self.update_rates(device, false);
        }
        if !busy.is_empty() {
            // Once for the instant, not once per device: only the last sample of an
            // instant is kept, and each costs a pass over every task.
            self.record_util();
            self.keep_refreshing();
        }
    }

    fn residents_changed(&mut self, device: usize, policy: &mut dyn Policy) {
        self.recompute(device);
        let state = &mut self.devices[device];
        state.epoch += 1;
        if policy.tunes() && !state.residents.is_empty() {
            let epoch = state.epoch;
            let delay = policy
                .first_tune_in_s()
                .unwrap_or(self.params.tune_interval_s);
            self.schedule(self.now + delay, EventKind::Tune { device, epoch });
        }
    }

    fn tune(&mut self, device: usize, policy: &mut dyn Policy) -> Result<()> {
        self.advance(device);
        // Fresh reports (new measurement noise) for the interval that just ran: what the
        // agents would have published since the last call (φ follows progress too).
        self.recompute(device);
        let started = Instant::now();
        let step = policy.tune(&View { engine: self }, device);
        self.metrics
            .tune_latency_us
            .push(started.elapsed().as_secs_f64() * 1e6);
        let again_in_s = match step {
            TuneStep::Done => None,
            TuneStep::Wait { again_in_s } => {
                Some(again_in_s.unwrap_or(self.params.tune_interval_s))
            }
            TuneStep::Apply {
                assignments,
                again_in_s,
            } => {
                let (changed, _) = self.set_batch_sizes(device, &assignments, policy)?;
                self.metrics.tuning_rounds += 1;
                self.metrics.batch_changes += changed.len() as u64;
                self.after_memory_change(device, &changed, policy);
                Some(again_in_s.unwrap_or(self.params.tune_interval_s))
            }
        };
        let epoch = self.devices[device].epoch;
        if let Some(delay) = again_in_s
            && !self.devices[device].residents.is_empty()
        {
            // Never at the same instant: a policy's clock moves forward with the world's.
            self.schedule(
                self.now + delay.max(1e-3),
                EventKind::Tune { device, epoch },
            );
        }
        // After the next call is scheduled: an eviction changes the residents, which
        // retires that call and schedules the first of the new residents'.
        self.apply_evictions(policy);
        Ok(())
    }
}
