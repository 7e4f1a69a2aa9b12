//! The tuner of one GPU as a clock-free, I/O-free state machine (like raft-rs's `RawNode`).
//!
//! [`DeviceTuner::step`] takes one [`Input`] (a task joined or left the device, a report, an
//! assignment seen in the store, or just the passing of time) with the driver's clock, and
//! returns [`Action`]s (a round of batch-size assignments, co-location samples for the
//! predictor, the state to persist). It owns everything per device: what is known about each
//! task ([`TaskKnowledge`]), the search over the residents' joint batch sizes (GP-LCB under
//! the memory model, with the [`Controller`]'s stopping rule), hysteresis, drift checks, and
//! sample generation. It never reads a clock, sleeps, or touches a store: the tuner daemon
//! drives it over the state store in real time, the simulator in virtual time, and tests with
//! scripted event sequences, so all three run the same decisions.
//!
//! A search's life:
//! 1. **Start** when the set of residents changes (or at the first step): at the batch sizes
//!    the tasks run now (a lone task whose solo step time at m0 is unknown starts at m0, so
//!    its first round measures it). A persisted search over exactly these tasks and sizes is
//!    resumed.
//! 2. **Rounds.** Each configuration the search proposes is assigned to *every* resident with
//!    a new round number; the round is measured from fresh reports made under it (the first
//!    of each task dropped, the median of the next ones: one slow step cannot decide a
//!    round), Σ PD is observed, and a measured co-location of a configuration not sampled
//!    before becomes predictor samples. A round without enough fresh reports before
//!    [`DeviceTunerParams::round_timeout`] is dropped, never observed half-measured.
//! 3. **Out of memory.** A configuration that runs out of memory is a joint constraint of
//!    the co-location (it and every larger one are infeasible for this search); only a task
//!    that ran out of memory *alone* gets a per-task limit. A production job that ran out
//!    of its agent's memory fence with room left on the card learns a floor above the
//!    fence instead, no limit, and may go back up to its m0 in one step: its m0 is where
//!    its PD alone is 1, the way back under its cap (see `learn_shared_oom`).
//! 4. **Settle** when the stopping rule says so or after
//!    [`DeviceTunerParams::max_observations`] observations: keep what runs unless the best
//!    measured configuration is predicted better by the hysteresis threshold.
//! 5. **Check** the configuration that actually runs every
//!    [`DeviceTunerParams::settled_interval`], as a round of fresh reports that is compared
//!    with what was expected of it and *not* added to the Gaussian process. A drift beyond
//!    the controller's threshold (the noise scale grows as training goes on, so the best
//!    batch sizes move) starts a fresh search whose only observation is the one that showed
//!    the drift: the observations from before describe another objective.
//! 6. **Slowdown caps** (production jobs, `TaskSpec::slowdown_cap`). Every measured round
//!    (explore, check or cap round) checks each production job's PD = IF·DT/E, measured,
//!    never predicted, against its cap:
//!    - a configuration in which one is above its cap is infeasible for the search, and so
//!      is every configuration with the same production sizes and opportunistic sizes at
//!      least as large (assumed: a co-runner's interference does not fall as its batch
//!      grows; nothing is assumed across production sizes, whose own DT and E move either
//!      way). Its Σ PD stays in the Gaussian process, but it is never the incumbent, and a
//!      settled configuration it rules out is given up;
//!    - while one is above its cap, the tuner decides, not the search: a job above its cap
//!      away from its submitted size m0 goes back to m0 first (its own size may be the
//!      cause: at m0 DT = E = 1 and its PD is its interference alone, what placement
//!      bounded); then every opportunistic co-runner goes one candidate size down a round
//!      (all at once: the tuner does not know which one interferes, and the production job
//!      pays for every round above its cap), skipping sizes already known to be above it;
//!      no opportunistic job ever grows and production jobs move only back to m0. With
//!      nothing left to change, what runs is measured again, round after round. On a
//!      device without an opportunistic co-runner a production job above its cap away
//!      from m0 goes back to m0 as well (alone there its PD is 1 whatever its noise scale
//!      did: the one size known to be under its cap), and at m0 the search goes on, away
//!      from what it measured above the cap. Leaving the way back to the search was not
//!      enough: its next rounds stay within one doubling of what it measured, and once
//!      both neighbours of a lone job's size below m0 had been measured above the cap
//!      (a noisy round, or an earlier search, whose violations carry over), it held the
//!      job there, above its cap, until it finished (in the simulator, P100 seed 3: an LM
//!      job at 10 of m0 80 with PD up to 2.2 for 4,000 s, 1.25 of the run's 2.0 % of
//!      production time above the cap);
//!    - after [`DeviceTunerParams::breach_rounds`] consecutive measured rounds above its
//!      cap at m0 with every opportunistic co-runner at its smallest size, it reports
//!      [`Action::CapBreached`] (once; again only for another set of co-runners, e.g. after
//!      an eviction, or after the residents changed), and [`Action::CapRestored`] when the
//!      job is measured back under its cap or leaves. A change of residents restarts the
//!      count.
//!
//!    A device with only opportunistic jobs has no caps, so none of this applies to it.
//!    The placer's evict flag is repeated by every later round, so no round cancels it.
//!    An evicted job keeps the size it runs at until it exits (its agent ignores later
//!    assignments): the search restarts with it fixed there, counted in memory at it.
//!    The search's cap violations are persisted with its observations (as batch sizes),
//!    and a restarted tuner rules them out again before it replays the observations, so
//!    it never measures a configuration it knows puts a production job above its cap
//!    (the breach streaks are not: a restarted tuner measures them again). They are
//!    persisted with each task's cap and restored only where the caps are the same (a
//!    violation of a cap says nothing of a looser one).
//!
//! The Gaussian process therefore never holds more than `max_observations` points (a cap
//! round that shrinks co-runners is observed only while the search has room for it).

mod caps;
mod knowledge;
mod measure;
mod persist;
mod samples;
mod translate;

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use iadeep_objective::{MemoryMargin, PdInput, lr_factor};
use iadeep_proto::{
    BatchSizeAssignment, CapBreach, CoLocationSample, DeviceInfo, LrScalingRule, ProfilePoint,
    TaskReport, TaskSpec, TunerObservation, TunerState,
};

use crate::error::{Result, TunerError};
use crate::memory::MemoryModelParams;
use crate::search::{
    Controller, ControllerParams, GpLcb, LcbParams, MemoryConstraint, NextRun, SearchSpace,
};
use caps::{CapWatch, Verdict};
pub use knowledge::{TaskKnowledge, candidate_sizes};
use measure::{Measurement, Outcome, Purpose};
pub use persist::{Persisted, Session};
pub use translate::{DeviceTask, RunningTask, Translator};

/// Everything that tunes a device tuner's behaviour. The daemon and the simulator use the
/// same defaults; a simulation that changes one says so (see the README).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceTunerParams {
    pub lcb: LcbParams,
    pub controller: ControllerParams,
    pub memory: MemoryModelParams,
    /// Fresh reports per task before a round counts; the first is dropped (it may have been
    /// timed while a co-runner still ran its previous size), the median of the rest is
    /// taken. At least 2.
    pub reports_per_round: u32,
    /// A round without enough fresh reports by then is dropped and tried again.
    pub round_timeout: Duration,
    /// How often the settled configuration is checked for drift.
    pub settled_interval: Duration,
    /// Most observations of one search (the Gaussian process's size); the search settles
    /// on its incumbent when it reaches it.
    pub max_observations: usize,
    /// Seed of the searches' sampling (reproducible runs).
    pub seed: u64,
    /// Consecutive measured rounds a production job must stay above its slowdown cap,
    /// with every opportunistic co-runner at its smallest size, before the tuner reports
    /// the breach ([`Action::CapBreached`]) for the placer to evict one. At least 1. Three
    /// rounds (about half a minute at the default report interval) tell a lasting breach
    /// from one noisy round.
    pub breach_rounds: u32,
}

impl Default for DeviceTunerParams {
    /// Agents report every 2 s by default, so 4 reports make a round of about 8 s, and a
    /// round waits up to 30 s; a settled configuration is checked every minute; a search
    /// stops after 24 observations (the stopping rule usually ends it within 5–15).
    fn default() -> Self {
        DeviceTunerParams {
            lcb: LcbParams::default(),
            controller: ControllerParams::default(),
            memory: MemoryModelParams::default(),
            reports_per_round: 4,
            round_timeout: Duration::from_secs(30),
            settled_interval: Duration::from_secs(60),
            max_observations: 24,
            seed: 0,
            breach_rounds: 3,
        }
    }
}

impl DeviceTunerParams {
    /// Validates every part, naming the first bad one.
    pub fn check(&self) -> Result<()> {
        self.lcb.check()?;
        self.memory.check()?;
        let bad = |m: String| Err(TunerError::InvalidParams(m));
        if self.reports_per_round < 2 {
            return bad(format!(
                "reports_per_round must be at least 2 (the first is dropped), got {}",
                self.reports_per_round
            ));
        }
        if self.round_timeout.is_zero() || self.settled_interval.is_zero() {
            return bad("round_timeout and settled_interval must be positive".to_owned());
        }
        if self.max_observations < 2 {
            return bad(format!(
                "max_observations must be at least 2, got {}",
                self.max_observations
            ));
        }
        if self.breach_rounds < 1 {
            return bad("breach_rounds must be at least 1".to_owned());
        }
        if !(self.controller.drift > 0.0 && self.controller.hysteresis >= 0.0) {
            return bad(format!(
                "controller drift must be positive and hysteresis non-negative, got {:?}",
                self.controller
            ));
        }
        Ok(())
    }
}

/// What happened, as the driver tells it.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// A task runs on this device: its spec as submitted, and the MiB the placer reserved
    /// for it (0 when unknown). Repeating it for a resident changes nothing.
    Joined { spec: TaskSpec, reserved_mib: u64 },
    /// A task holds `mib` of the card without running (placed, its agent not started or
    /// restarting): the memory is kept free, the task is not tuned.
    Reserved { task_id: String, mib: u64 },
    /// A task no longer runs here or holds memory (finished, released, or its agent gone).
    Left { task_id: String },
    /// A task's agent reported.
    Report(TaskReport),
    /// The store holds this assignment for a task: one of ours coming back, or one another
    /// writer made (the placer shrinking a resident to make room).
    Assigned(BatchSizeAssignment),
    /// The round numbered `round` that this tuner assigned to `task_ids` was not written:
    /// the store changed since it was decided (a placement, or another writer's
    /// assignment), so its transaction failed its comparisons. Told once the driver's view
    /// shows what beat it, followed by the assignment the store holds for each task of the
    /// round: the round is dropped at once and decided again on that view, rather than
    /// waited for until its timeout.
    RoundLost { round: u64, task_ids: Vec<String> },
    /// Only time passed (a round's timeout, a settled check).
    Tick,
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Apply these batch sizes to every resident at once: one round.
    Assign(Vec<BatchSizeAssignment>),
    /// Store this measured co-location for the predictor under the device's sample `seq`.
    Sample { seq: u64, sample: CoLocationSample },
    /// Store this state, so a restarted tuner resumes from it.
    Persist(TunerState),
    /// Record what was measured of a task's model on this device's kind in the profile
    /// registry (`iadeep_state::registry::record`), so a later job of the same model
    /// starts with it: step times measured alone and peak memory, per batch size.
    Profile {
        model: String,
        device_kind: String,
        points: Vec<ProfilePoint>,
    },
    /// A production job stayed above its slowdown cap for
    /// [`DeviceTunerParams::breach_rounds`] measured rounds with every opportunistic
    /// co-runner at its smallest size: shrinking cannot help any more. The daemon writes it
    /// at `keys::device_breach(device)` for the placer to evict one of
    /// `opportunistic_task_ids`; the simulator evicts at once. Emitted once per breach (again
    /// only when the co-runners at the floor change, e.g. after an eviction, or after the
    /// residents changed).
    CapBreached(CapBreach),
    /// The job of an earlier [`Action::CapBreached`] was measured back under its cap or left
    /// the device: the breach is over (the daemon deletes its record if it still names the
    /// job).
    CapRestored { task_id: String },
}

/// Running totals, for metrics and logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Rounds assigned.
    pub rounds: u64,
    /// Explore rounds measured and observed.
    pub measured: u64,
    /// Rounds dropped: too few fresh reports before the timeout, Σ PD not computable, or
    /// the round never written ([`Input::RoundLost`]).
    pub dropped: u64,
    /// Rounds that ran out of memory.
    pub out_of_memory: u64,
    /// Assignments written (one per task per round).
    pub assignments: u64,
    /// Co-location samples emitted.
    pub samples: u64,
    /// Searches started (a new set of residents, or a drift).
    pub searches: u64,
    /// Settled checks measured.
    pub checks: u64,
    /// Searches re-opened because a settled check drifted.
    pub drifts: u64,
}

/// The tuner's state in a few numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Status {
    /// The last round assigned (or seen in the store).
    pub round: u64,
    pub residents: usize,
    /// The search has settled and only checks for drift (a check may be under way).
    pub settled: bool,
    /// Holding the batch sizes: Σ PD cannot be measured, or nothing fits.
    pub holding: bool,
    /// Observations of the current search (the Gaussian process's size).
    pub observations: usize,
    /// Σ PD of the last measured round.
    pub last_sum_pd: Option<f64>,
    /// Production jobs whose PD was above their slowdown caps in the last measured round.
    pub above_cap: usize,
    pub counters: Counters,
}

/// A resident's PD in the last measured round, with its class and cap (metrics, logs).
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredPd {
    pub task_id: String,
    /// "production" or "opportunistic" (`TaskSpec::class_name`).
    pub class: &'static str,
    pub pd: f64,
    /// The slowdown cap of a production job.
    pub cap: Option<f64>,
    /// A production job measured above its cap in the last measured round.
    pub above_cap: bool,
}

/// A task running on the device as its tuner knows it: spec, reservation, last report and
/// current assignment.
#[derive(Clone, Debug, PartialEq)]
struct TunedTask {
    spec: TaskSpec,
    reserved_mib: u64,
    report: Option<TaskReport>,
    /// The batch size and round of its current assignment, when one is known.
    assigned: Option<(u32, u64)>,
    /// The assignment round of the last out-of-memory crash learned from (the agent keeps
    /// reporting its out-of-memory size after the crash).
    oom_learned_round: Option<u64>,
    /// Where its agent fences its allocator: the bound of its latest assignment that
    /// carried one, else its reservation (none when neither is known).
    fence_mib: Option<f64>,
    /// Its last out-of-memory crash was a production job outgrowing its fence with room
    /// left on the card (see [`DeviceTuner::learn_shared_oom`]): no limit of the task or of
    /// the configuration, only a floor on its memory.
    outgrew_fence: bool,
    /// The placer evicts the task (an assignment with `evict` set, and its reason): every
    /// later round repeats the flag, so a round of the tuner never cancels an eviction.
    evict: Option<String>,
}

/// The only size the search may give `task`: an evicted task runs at its size until it
/// exits (its agent ignores later assignments), so it is never given another, and no other
/// task may grow into memory it still holds. Counted at the larger of what it last
/// reported and what it was last assigned (it may run at either), on the safe side.
fn fixed_size(task: &TunedTask) -> Option<u32> {
    task.evict.as_ref()?;
    let reported = reported_size(task);
    let assigned = task.assigned.map(|(b, _)| b).filter(|&b| b > 0);
    reported.max(assigned)
}

/// Where a task's agent fences its allocator before any assignment with a bound: its
/// reservation (none when unknown, 0).
fn reservation_fence(reserved_mib: u64) -> Option<f64> {
    (reserved_mib > 0).then_some(reserved_mib as f64)
}

/// The batch size `task` last reported running at, if it reported one.
fn reported_size(task: &TunedTask) -> Option<u32> {
    task.report
        .as_ref()
        .map(|r| r.batch_size)
        .filter(|&b| b > 0)
}

/// Why the search holds the batch sizes.
#[derive(Clone, Debug, PartialEq)]
enum Hold {
    /// Σ PD needs these tasks' solo step time at m0 (no local profile, never ran alone here).
    Unmeasurable(Vec<String>),
    /// No configuration fits the card.
    Infeasible(String),
    /// The search settled without a value to expect of the configuration it keeps.
    NoExpectation,
}

#[derive(Clone, Debug, PartialEq)]
enum Phase {
    /// Decide what to run next at once.
    Idle,
    Measuring(Measurement),
    /// The search is over; `config` runs and is checked at `check_at_ms` against `expected`.
    Settled {
        config: Vec<usize>,
        expected: f64,
        check_at_ms: i64,
    },
    Holding {
        why: Hold,
        until_ms: i64,
    },
}

/// The search over one set of residents.
#[derive(Debug)]
struct Search {
    task_ids: Vec<String>,
    sizes: Vec<Vec<u32>>,
    controller: Controller,
    /// The observations, in persisted form.
    observations: Vec<TunerObservation>,
    /// Configurations (batch sizes) whose co-location samples were emitted.
    sampled: HashSet<Vec<u32>>,
    phase: Phase,
    /// The configuration running now and the round each task runs it under, when known.
    applied: Option<(Vec<usize>, Vec<u64>)>,
    /// The configuration of the last measured round.
    measured: Option<Vec<usize>>,
    /// Per task: opportunistic (may be shrunk for a production job's cap).
    opportunistic: Vec<bool>,
    /// Per task: its slowdown cap when the search started (`None`: not production), what
    /// the search's cap violations are measured against (persisted with them).
    slowdown_caps: Vec<Option<f64>>,
    /// The hold reason last logged, so a hold is logged once, not every step.
    logged_hold: Option<Hold>,
}

/// The tuner of one device; see the module documentation.
#[derive(Debug)]
pub struct DeviceTuner {
    device_id: String,
    device_kind: String,
    capacity_mib: f64,
    params: DeviceTunerParams,
    residents: BTreeMap<String, TunedTask>,
    /// MiB held by placed tasks that do not run (see [`Input::Reserved`]).
    held: BTreeMap<String, u64>,
    /// What a resident held aside (restarting after a crash) had reported and been assigned,
    /// restored when it runs again: its first report then tells of the crash.
    parked: BTreeMap<String, TunedTask>,
    knowledge: BTreeMap<String, TaskKnowledge>,
    search: Option<Search>,
    /// A persisted search waiting for its residents to come back.
    resumed: Option<Session>,
    residents_changed: bool,
    /// The placer evicted a resident since the search started: the search starts again
    /// with that resident held at the size it runs at (see [`fixed_size`]), its caps' state
    /// kept (the co-location is the same).
    eviction_fixed: bool,
    /// Tasks with measurements not yet offered to the profile registry.
    profile_changed: std::collections::BTreeSet<String>,
    /// Memory knowledge changed since the settled configuration was last checked to fit.
    memory_changed: bool,
    round: u64,
    next_sample_seq: u64,
    last_sum_pd: Option<f64>,
    counters: Counters,
    /// The production residents' caps as measured (see the module documentation).
    caps: BTreeMap<String, CapWatch>,
    /// Each resident's PD in the last measured round it was part of.
    measured_pd: BTreeMap<String, f64>,
    /// Actions decided while taking in inputs (a breach over because its job left).
    pending: Vec<Action>,
}

/// Iterations of one step's state transitions at most; each one either waits for input or
/// moves the phase forward, so this only guards against a bug looping forever.
const MAX_TRANSITIONS_PER_STEP: usize = 8;

/// The floor a production job that ran out of its memory fence learns, as a multiple of
/// the fence: it needed more than the fence, and the next bound (which moves the fence)
/// must clear it, or the same crash repeats without teaching anything new.
const FENCE_STEP: f64 = 1.05;

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Where a persisted cap violation's size `b` of one task falls among its current candidate
/// `sizes` (ascending). A violation at an opportunistic size rules out every size at or
/// above it (see [`crate::search::GpLcb::rule_out_over_cap`]), so it maps to the smallest
/// candidate at or above `b`: exactly the candidates it rules out, even when `b` is no
/// candidate any more. A production size rules out only itself: it must still be a
/// candidate. `None`: the violation rules out nothing now.
fn over_cap_index(b: u32, sizes: &[u32], opportunistic: bool) -> Option<usize> {
    if opportunistic {
        sizes.iter().position(|&x| x >= b)
    } else {
        sizes.iter().position(|&x| x == b)
    }
}

impl DeviceTuner {
    /// A tuner for `device`, resuming `persisted` state if given (a state of another device
    /// is refused).
    pub fn new(
        device: &DeviceInfo,
        params: DeviceTunerParams,
        persisted: Option<&TunerState>,
    ) -> Result<DeviceTuner> {
        params.check()?;
        if device.memory_mib == 0 {
            return Err(TunerError::InvalidInput(format!(
                "device {} has no memory size",
                device.device_id
            )));
        }
        let mut tuner = DeviceTuner {
            device_id: device.device_id.clone(),
            device_kind: device.kind.clone(),
            capacity_mib: device.memory_mib as f64,
            params,
            residents: BTreeMap::new(),
            held: BTreeMap::new(),
            parked: BTreeMap::new(),
            knowledge: BTreeMap::new(),
            search: None,
            resumed: None,
            residents_changed: false,
            eviction_fixed: false,
            profile_changed: std::collections::BTreeSet::new(),
            memory_changed: false,
            round: 0,
            next_sample_seq: 0,
            last_sum_pd: None,
            counters: Counters::default(),
            caps: BTreeMap::new(),
            measured_pd: BTreeMap::new(),
            pending: Vec::new(),
        };
        if let Some(state) = persisted {
            if !state.device_id.is_empty() && state.device_id != device.device_id {
                return Err(TunerError::InvalidInput(format!(
                    "persisted tuner state belongs to device {}, not {}",
                    state.device_id, device.device_id
                )));
            }
            let p = Persisted::from_proto(state);
            tuner.round = p.round;
            tuner.next_sample_seq = p.next_sample_seq;
            tuner.knowledge = p.knowledge;
            tuner.resumed = (!p.session.task_ids.is_empty()).then_some(p.session);
        }
        Ok(tuner)
    }

    /// Takes in the inputs that arrived together at the driver's time `now_ms` (any monotone
    /// millisecond clock: Unix time in the daemon, simulated time in the simulator) and
    /// returns what to do. Inputs of one store revision belong together (a placement that
    /// shrinks a resident also adds a task): the tuner decides once, after all of them.
    pub fn step(&mut self, now_ms: i64, inputs: impl IntoIterator<Item = Input>) -> Vec<Action> {
        let mut out = Vec::new();
        for input in inputs {
            self.apply(input);
        }
        out.append(&mut self.pending);
        self.advance(now_ms, &mut out);
        self.offer_profiles(now_ms, &mut out);
        out
    }

    /// Offers the registry what was newly measured of each task: every batch size with a
    /// step time measured alone or a peak memory (never an estimate or a floor).
    fn offer_profiles(&mut self, now_ms: i64, out: &mut Vec<Action>) {
        for task_id in std::mem::take(&mut self.profile_changed) {
            let (Some(r), Some(k)) = (self.residents.get(&task_id), self.knowledge.get(&task_id))
            else {
                continue;
            };
            if r.spec.model.is_empty() {
                continue;
            }
            let sizes: std::collections::BTreeSet<u32> =
                k.memory.keys().chain(k.solo.keys()).copied().collect();
            let points = sizes
                .into_iter()
                .map(|b| ProfilePoint {
                    batch_size: b,
                    solo_step_time_s: k.solo.get(&b).copied(),
                    peak_mem_mib: k.memory.get(&b).map(|m| m.ceil() as u64),
                    measured_at_unix_ms: now_ms,
                })
                .collect();
            out.push(Action::Profile {
                model: r.spec.model.clone(),
                device_kind: self.device_kind.clone(),
                points,
            });
        }
    }

    /// When the tuner needs a [`Input::Tick`] even if nothing else happens (a round's
    /// timeout, a settled check, the end of a hold); `None` when it only waits for input.
    pub fn next_wakeup_ms(&self) -> Option<i64> {
        match &self.search.as_ref()?.phase {
            Phase::Idle => None,
            Phase::Measuring(m) => Some(
                m.started_ms
                    .saturating_add(millis(self.params.round_timeout)),
            ),
            Phase::Settled { check_at_ms, .. } => Some(*check_at_ms),
            Phase::Holding { until_ms, .. } => Some(*until_ms),
        }
    }

    /// Whether a round is being measured, i.e. fresh reports matter now (a driver that
    /// emulates agents can skip delivering reports otherwise).
    pub fn wants_reports(&self) -> bool {
        self.search
            .as_ref()
            .is_some_and(|s| matches!(s.phase, Phase::Measuring(_)))
    }

    /// The device's id.
    pub fn device_id(&self) -> &str {
        &self.device_id
    }

    /// The tasks it tunes, sorted.
    pub fn residents(&self) -> impl Iterator<Item = &str> {
        self.residents.keys().map(String::as_str)
    }

    /// The tuner's state in a few numbers.
    pub fn status(&self) -> Status {
        let search = self.search.as_ref();
        Status {
            round: self.round,
            residents: self.residents.len(),
            settled: search.is_some_and(|s| match &s.phase {
                Phase::Settled { .. } => true,
                Phase::Measuring(m) => m.purpose == Purpose::Check,
                _ => false,
            }),
            holding: search.is_some_and(|s| matches!(s.phase, Phase::Holding { .. })),
            observations: search.map_or(0, |s| s.observations.len()),
            last_sum_pd: self.last_sum_pd,
            above_cap: self.caps.values().filter(|w| w.above).count(),
            counters: self.counters,
        }
    }

    /// Every resident's PD in the last measured round it was part of, with its class and
    /// cap, in task order.
    pub fn measured_pds(&self) -> Vec<MeasuredPd> {
        self.residents
            .iter()
            .filter_map(|(id, r)| {
                Some(MeasuredPd {
                    task_id: id.clone(),
                    class: r.spec.class_name(),
                    pd: *self.measured_pd.get(id)?,
                    cap: r.spec.slowdown_cap(),
                    above_cap: self.caps.get(id).is_some_and(|w| w.above),
                })
            })
            .collect()
    }

    /// Makes sure the next sample's sequence is at least `floor` (the driver found samples
    /// of this device in the store that a lost state write did not record).
    pub fn ensure_next_sample_seq(&mut self, floor: u64) {
        self.next_sample_seq = self.next_sample_seq.max(floor);
    }

    /// What is known about a task, if it is resident.
    pub fn knowledge(&self, task_id: &str) -> Option<&TaskKnowledge> {
        self.knowledge.get(task_id)
    }

    /// The state to persist now.
    pub fn persisted(&self, now_ms: i64) -> TunerState {
        let session = match &self.search {
            Some(s) => {
                let space = s.controller.space();
                let over_cap = s.controller.over_cap().iter();
                Session {
                    task_ids: s.task_ids.clone(),
                    sizes: s.sizes.clone(),
                    observations: s.observations.clone(),
                    over_cap: over_cap.map(|c| space.batch_sizes(c)).collect(),
                    caps: Some(s.slowdown_caps.clone()),
                }
            }
            None => self.resumed.clone().unwrap_or_default(),
        };
        Persisted {
            round: self.round,
            next_sample_seq: self.next_sample_seq,
            session,
            knowledge: self.knowledge.clone(),
            settled: self.status().settled,
        }
        .to_proto(&self.device_id, now_ms)
    }

    fn apply(&mut self, input: Input) {
        match input {
            Input::Joined { spec, reserved_mib } => self.on_joined(spec, reserved_mib),
            Input::Reserved { task_id, mib } => {
                if let Some(resident) = self.residents.remove(&task_id) {
                    self.parked.insert(task_id.clone(), resident);
                    self.residents_changed = true;
                }
                if self.held.insert(task_id, mib) != Some(mib) {
                    self.memory_changed = true;
                }
            }
            Input::Left { task_id } => {
                self.forget_cap(&task_id);
                self.measured_pd.remove(&task_id);
                self.parked.remove(&task_id);
                self.memory_changed |= self.held.remove(&task_id).is_some();
                if self.residents.remove(&task_id).is_some() {
                    self.residents_changed = true;
                }
                self.knowledge.remove(&task_id);
            }
            Input::Report(report) => self.on_report(report),
            Input::Assigned(a) => self.on_assigned(a),
            Input::RoundLost { round, task_ids } => self.on_round_lost(round, &task_ids),
            Input::Tick => {}
        }
    }

    /// A task left, or is no longer production: a breach reported for it is over.
    fn forget_cap(&mut self, task_id: &str) {
        if let Some(watch) = self.caps.remove(task_id)
            && watch.reported
        {
            self.pending.push(Action::CapRestored {
                task_id: task_id.to_owned(),
            });
        }
    }

    /// A task runs here with `spec`, `reserved_mib` reserved for it.
    fn on_joined(&mut self, spec: TaskSpec, reserved_mib: u64) {
        self.held.remove(&spec.task_id);
        if !spec.is_production() {
            self.forget_cap(&spec.task_id);
        }
        if let Some(r) = self.residents.get_mut(&spec.task_id)
            && r.spec == spec
        {
            // The placer settled a provisional reservation (or one was rewritten):
            // what the memory model may assume changed, not who runs here.
            if r.reserved_mib != reserved_mib {
                r.reserved_mib = reserved_mib;
                self.memory_changed = true;
            }
            return;
        }
        let knowledge = self.knowledge.entry(spec.task_id.clone()).or_default();
        if !knowledge.learn_spec(&spec, &self.device_kind)
            && let Some(p) = &spec.profile
        {
            tracing::info!(task = %spec.task_id, profile_kind = %p.device_kind,
                device_kind = %self.device_kind,
                "solo profile measured on another device kind; not used here");
        }
        // The same task again with another spec keeps what it reported and was assigned.
        let (report, assigned, oom_learned_round, fence_mib, evict) = self
            .residents
            .remove(&spec.task_id)
            .or_else(|| self.parked.remove(&spec.task_id))
            .map(|r| {
                (
                    r.report,
                    r.assigned,
                    r.oom_learned_round,
                    r.fence_mib,
                    r.evict,
                )
            })
            .unwrap_or_default();
        let fence_mib = fence_mib.or(reservation_fence(reserved_mib));
        self.residents.insert(
            spec.task_id.clone(),
            TunedTask {
                spec,
                reserved_mib,
                report,
                assigned,
                oom_learned_round,
                fence_mib,
                outgrew_fence: false,
                evict,
            },
        );
        self.residents_changed = true;
    }

    /// A task's report: what it learns of its memory, and a measurement for the search.
    fn on_report(&mut self, mut report: TaskReport) {
        // The agent repeats its out-of-memory size in every later report. A fenced
        // production job that reports running at or above that size is past the crash
        // (a crash falls back below it): the size is no new crash of this round, or the
        // job could never go back to an m0 it once outgrew a fence at.
        if let Some(r) = self.residents.get(&report.task_id)
            && r.spec.is_production()
            && r.fence_mib.is_some()
            && report
                .oom_batch_size
                .is_some_and(|oom| report.batch_size >= oom)
        {
            report.oom_batch_size = None;
        }
        self.learn_shared_oom(&report);
        let Some(resident) = self.residents.get_mut(&report.task_id) else {
            return;
        };
        if let Some(k) = self.knowledge.get_mut(&report.task_id) {
            let before = k.memory.clone();
            k.learn_report(&report);
            if k.memory != before {
                self.memory_changed = true;
                self.profile_changed.insert(report.task_id.clone());
            }
        }
        self.round = self.round.max(report.assignment_round);
        if let Some(search) = &mut self.search
            && let Phase::Measuring(m) = &mut search.phase
            && let Some(i) = search.task_ids.iter().position(|t| *t == report.task_id)
        {
            m.add(i, &report);
        }
        resident.report = Some(report);
    }

    /// An assignment was written, by the tuner itself or another writer.
    fn on_assigned(&mut self, a: BatchSizeAssignment) {
        if a.predicted_slowdown.is_some() {
            // Kept even while the task is only held (its agent not started yet):
            // the starting assignment is not repeated when it starts.
            self.knowledge
                .entry(a.task_id.clone())
                .or_default()
                .learn_placed_slowdown(a.predicted_slowdown);
        }
        let Some(resident) = self.residents.get_mut(&a.task_id) else {
            return;
        };
        if a.evict && resident.evict.is_none() {
            tracing::info!(device = %self.device_id, task = %a.task_id, reason = %a.evict_reason,
                "the placer evicts the task; later rounds keep the flag");
            resident.evict = Some(a.evict_reason.clone());
            self.eviction_fixed = true;
        }
        resident.assigned = Some((a.batch_size, a.round));
        if let Some(bound) = a.memory_bound_mib.filter(|b| b.is_finite() && *b > 0.0) {
            resident.fence_mib = Some(bound);
        }
        // Another writer that decided before it saw the tuner's last round numbers its
        // assignment the same (the placer making room: one above every round *it* saw).
        // The tuner's own write of that round then failed its comparison, so the store
        // holds the other writer's size under the round the search applied: what runs is
        // not what the search measures, and a report at that size under the round would
        // read as an out-of-memory fall-back.
        let same_round_other_size = self.search.as_ref().is_some_and(|search| {
            search
                .task_ids
                .iter()
                .position(|t| *t == a.task_id)
                .zip(search.applied.as_ref())
                .is_some_and(|(i, (config, rounds))| {
                    rounds[i] == a.round && search.sizes[i].get(config[i]) != Some(&a.batch_size)
                })
        });
        if a.round > self.round || same_round_other_size {
            self.round = self.round.max(a.round);
            // Only the round (and the bound) moved, at the size the search applied:
            // the placer settled the task's reservation. What runs is unchanged;
            // its reports under the new round measure it as well.
            if let Some(search) = &mut self.search
                && let Some(i) = search.task_ids.iter().position(|t| *t == a.task_id)
                && let Some((config, rounds)) = &mut search.applied
                && search.sizes[i].get(config[i]) == Some(&a.batch_size)
            {
                rounds[i] = a.round;
                if let Phase::Measuring(m) = &mut search.phase {
                    m.follow_round(i, a.round);
                }
                return;
            }
            // Someone else (the placer making room) moved the task: what runs is no
            // longer what the search applied.
            if let Some(search) = &mut self.search {
                tracing::info!(task = %a.task_id, batch_size = a.batch_size, round = a.round,
                    "assignment written by another writer; re-deciding");
                search.applied = None;
                if matches!(search.phase, Phase::Measuring(_) | Phase::Settled { .. }) {
                    search.phase = Phase::Idle;
                }
            }
        }
    }

    /// The tuner's round `round` was not written to `task_ids` (see [`Input::RoundLost`]).
    /// Their assignments are unknown until the driver tells what the store holds (it does
    /// so next, in the same step); their fences fall back to their reservations unless that
    /// assignment carries a bound. A round being measured is dropped without waiting for its
    /// timeout, a settled configuration that round was to apply is decided again, and what
    /// runs is no longer taken for what the round applied.
    fn on_round_lost(&mut self, round: u64, task_ids: &[String]) {
        let mut unwritten = Vec::new();
        for id in task_ids {
            // A task parked meanwhile (restarting) takes its assignment back when it runs.
            let Some(task) = self
                .residents
                .get_mut(id)
                .or_else(|| self.parked.get_mut(id))
            else {
                continue;
            };
            if task.assigned.is_some_and(|(_, r)| r == round) {
                task.assigned = None;
                task.fence_mib = reservation_fence(task.reserved_mib);
                unwritten.push(id.clone());
            }
        }
        let Some(search) = &mut self.search else {
            return;
        };
        let applied_it = search
            .applied
            .as_ref()
            .is_some_and(|(_, rounds)| rounds.contains(&round));
        if applied_it {
            search.applied = None;
        }
        let measuring_it =
            matches!(&search.phase, Phase::Measuring(m) if m.rounds.contains(&round));
        if measuring_it || applied_it && matches!(search.phase, Phase::Settled { .. }) {
            search.phase = Phase::Idle;
        }
        if measuring_it || !unwritten.is_empty() {
            self.counters.dropped += 1;
        }
        tracing::info!(device = %self.device_id, round, tasks = ?unwritten, dropped = measuring_it,
            "round not written: the store changed since it was decided; deciding again on what it holds");
    }

    /// A report of an out-of-memory crash under an assignment at or above the crashed size:
    /// the task needed more than its co-runners left it (the card, less what is held for
    /// others, less the co-runners' measured peaks at the sizes they run). That is a floor
    /// on its memory at that size and above, which every later search keeps, so the same
    /// crash is not repeated whenever a search starts afresh. Co-runners' measured peaks are
    /// at most what they use, so the floor never exceeds what the task really needed. No
    /// floor when a co-runner's memory at its size was never measured.
    ///
    /// A production job whose agent fences its allocator below what the card left it ran
    /// out of its fence, not of the card: it needed more than its fence, which says
    /// nothing of the card. The floor is then the fence (a step above it, so that the next
    /// bound, which moves the fence, clears it), and the crash is no limit of the task or
    /// of the configuration. Taken for a limit, it would bar the job from its m0 (a fence
    /// a few MiB under its peak there is enough), the one size at which its PD alone is 1:
    /// as its statistical efficiency drifts, a lone production job kept below m0 drifts
    /// above its cap with nowhere to go. Opportunistic jobs keep the rule above unchanged.
    fn learn_shared_oom(&mut self, report: &TaskReport) {
        let Some(oom) = report.oom_batch_size.filter(|&b| b > 0) else {
            return;
        };
        let Some(resident) = self.residents.get(&report.task_id) else {
            return;
        };
        let crashed_under_it = resident
            .assigned
            .is_some_and(|(size, round)| round == report.assignment_round && size >= oom);
        if !crashed_under_it || resident.oom_learned_round == Some(report.assignment_round) {
            return;
        }
        // Only at or below m0: the way back to m0 is what the cap needs; a fence outgrown
        // above m0 stays a limit as for every job (climbing it by fence steps crashed
        // round after round in the simulator).
        let fence_mib = resident
            .fence_mib
            .filter(|_| resident.spec.is_production() && oom <= resident.spec.initial_batch_size);
        let mut others_mib = Some(0.0);
        for (id, other) in &self.residents {
            if *id == report.task_id {
                continue;
            }
            let size = reported_size(other).or(other.assigned.map(|(b, _)| b));
            let measured = size.and_then(|b| {
                self.knowledge
                    .get(id)
                    .and_then(|k| k.memory.get(&b).copied())
            });
            others_mib = others_mib.zip(measured).map(|(sum, mib)| sum + mib);
        }
        // Unmeasured co-runners leave the card's room unknown: a fence is still a fact.
        let room = others_mib.map(|others| self.capacity_mib - self.held_mib() - others);
        let outgrew_fence = fence_mib.filter(|&fence| room.is_none_or(|room| fence < room));
        if let Some(resident) = self.residents.get_mut(&report.task_id) {
            resident.outgrew_fence = outgrew_fence.is_some();
        }
        let (floor_mib, why) = match (outgrew_fence, room) {
            (Some(fence), room) => (
                room.map_or(fence * FENCE_STEP, |room| (fence * FENCE_STEP).min(room)),
                "production job ran out of its memory fence with room left on the card; \
                its memory at this size and above is above the fence, no limit",
            ),
            (None, Some(room)) => (
                room,
                "ran out of memory next to co-runners; its memory at this size and above is \
                at least what they left it",
            ),
            (None, None) => return,
        };
        if let Some(resident) = self.residents.get_mut(&report.task_id) {
            resident.oom_learned_round = Some(report.assignment_round);
        }
        if let Some(k) = self.knowledge.get_mut(&report.task_id)
            && k.learn_oom_floor(oom, floor_mib)
        {
            tracing::warn!(device = %self.device_id, task = %report.task_id, batch_size = oom,
                floor_mib, fence_mib = ?outgrew_fence, "{why}");
            self.memory_changed = true;
        }
    }

    /// MiB held on the card by placed tasks that do not run.
    fn held_mib(&self) -> f64 {
        self.held.values().map(|&m| m as f64).sum()
    }

    fn advance(&mut self, now_ms: i64, out: &mut Vec<Action>) {
        for _ in 0..MAX_TRANSITIONS_PER_STEP {
            let changed = std::mem::take(&mut self.residents_changed);
            if std::mem::take(&mut self.eviction_fixed) || changed {
                self.start_search(now_ms, changed, out);
            }
            let Some(search) = &mut self.search else {
                return;
            };
            match &search.phase {
                Phase::Idle => self.decide(now_ms, out),
                Phase::Measuring(m) => {
                    if let Some(outcome) = m.outcome(self.params.reports_per_round) {
                        self.conclude(now_ms, outcome, out);
                    } else if now_ms
                        >= m.started_ms
                            .saturating_add(millis(self.params.round_timeout))
                    {
                        self.drop_round(now_ms);
                    } else {
                        return;
                    }
                }
                Phase::Settled { check_at_ms, .. } => {
                    let check_at_ms = *check_at_ms;
                    if std::mem::take(&mut self.memory_changed) && !self.settled_config_fits() {
                        tracing::warn!(device = %self.device_id,
                            "the settled configuration no longer fits the memory model; searching again");
                        self.restart_search(now_ms, None, out);
                        continue;
                    }
                    if now_ms < check_at_ms {
                        return;
                    }
                    if !self.begin_check(now_ms)
                        && let Some(search) = &mut self.search
                    {
                        search.phase = Phase::Idle;
                        continue;
                    }
                    return;
                }
                Phase::Holding { until_ms, .. } => {
                    if now_ms < *until_ms {
                        return;
                    }
                    search.phase = Phase::Idle;
                }
            }
        }
        tracing::error!(device = %self.device_id, "device tuner did not come to rest within one step");
    }

    /// A new search over the current residents (see the module documentation, step 1);
    /// the caps' streaks start again when `residents_changed` (the co-location is another).
    fn start_search(&mut self, now_ms: i64, residents_changed: bool, out: &mut Vec<Action>) {
        if residents_changed {
            for watch in self.caps.values_mut() {
                watch.residents_changed();
            }
        }
        if self.residents.is_empty() {
            if self.search.take().is_some() {
                tracing::info!(device = %self.device_id, "no tasks left on the device");
                // What is stored (and what `iadeep status` shows) describes the device
                // now: no search, no tasks.
                out.push(Action::Persist(self.persisted(now_ms)));
            }
            return;
        }
        let task_ids: Vec<String> = self.residents.keys().cloned().collect();
        let sizes: Vec<Vec<u32>> = self
            .residents
            .values()
            .map(|r| fixed_size(r).map_or_else(|| candidate_sizes(&r.spec), |b| vec![b]))
            .collect();
        let lone = task_ids.len() == 1;
        let mut running = true;
        let start: Vec<usize> = self
            .residents
            .iter()
            .zip(&sizes)
            .map(|((id, r), s)| {
                let m0 = r.spec.initial_batch_size.max(1);
                let m0_at = s.iter().position(|&b| b == m0).unwrap_or(0);
                let solo_unknown = self
                    .knowledge
                    .get(id)
                    .is_none_or(|k| k.solo_at(m0).is_none());
                if lone && solo_unknown {
                    running = false;
                    return m0_at;
                }
                let now = r.assigned.map(|(b, _)| b).or_else(|| reported_size(r));
                match now.and_then(|b| s.iter().position(|&x| x == b)) {
                    Some(i) => i,
                    None => {
                        running = false;
                        m0_at
                    }
                }
            })
            .collect();
        let rounds: Option<Vec<u64>> = self
            .residents
            .values()
            .map(|r| r.assigned.map(|(_, round)| round))
            .collect();
        let applied = match rounds {
            Some(rounds) if running => Some((start.clone(), rounds)),
            _ => None,
        };
        let search = match self.new_search(task_ids.clone(), sizes.clone(), start) {
            Ok(search) => search,
            Err(err) => {
                tracing::error!(device = %self.device_id, %err, "cannot set up the batch-size search; holding");
                self.search = None;
                return;
            }
        };
        self.search = Some(Search { applied, ..search });
        self.resume_persisted(&task_ids, &sizes);
        if let Some(search) = &self.search {
            tracing::info!(device = %self.device_id, tasks = ?task_ids, sizes = ?sizes,
                observations = search.observations.len(), "search starts");
        }
        out.push(Action::Persist(self.persisted(now_ms)));
    }

    /// Carries what a previous tuner of this device persisted into the new search, once,
    /// when it was about the same tasks: its cap violations, then (at the same candidate
    /// sizes) its observations.
    fn resume_persisted(&mut self, task_ids: &[String], sizes: &[Vec<u32>]) {
        let Some(session) = self.resumed.take() else {
            return;
        };
        if session.task_ids == task_ids {
            // Before the observations: a value measured above a cap is no improvement
            // for the stopping rule, as when it was first recorded.
            self.restore_over_cap(&session.over_cap, session.caps.as_deref());
        }
        if session.task_ids == task_ids && session.sizes == sizes {
            self.replay(session.observations);
        } else {
            tracing::info!(device = %self.device_id, "persisted search is about other tasks; starting afresh");
        }
    }

    /// A fresh search over `task_ids` at `sizes`, starting at `start`.
    fn new_search(
        &mut self,
        task_ids: Vec<String>,
        sizes: Vec<Vec<u32>>,
        start: Vec<usize>,
    ) -> Result<Search> {
        let memory = self.memory_constraint(&task_ids, &sizes);
        let space = SearchSpace {
            sizes: sizes.clone(),
            start,
            memory: Some(memory),
        };
        // A different, reproducible seed per search: two searches on one device must not
        // sample the same candidates.
        let seed = self.params.seed ^ self.counters.searches.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.counters.searches += 1;
        let mut search = GpLcb::new(space, self.params.lcb, seed)?;
        let slowdown_caps: Vec<Option<f64>> = task_ids
            .iter()
            .map(|id| self.residents.get(id).and_then(|r| r.spec.slowdown_cap()))
            .collect();
        // Only a production job has a cap.
        let opportunistic: Vec<bool> = slowdown_caps.iter().map(Option::is_none).collect();
        search.set_opportunistic(opportunistic.clone())?;
        Ok(Search {
            task_ids,
            sizes,
            controller: Controller::new(search, self.params.controller),
            observations: Vec::new(),
            sampled: HashSet::new(),
            phase: Phase::Idle,
            applied: None,
            measured: None,
            opportunistic,
            slowdown_caps,
            logged_hold: None,
        })
    }

    /// Rules the persisted cap violations (batch sizes, in task order) out of the current
    /// search over the same tasks: facts about these tasks at these sizes, kept even when
    /// the candidate sizes changed (see [`over_cap_index`]). Only when every task has the
    /// cap (and so the class) it had when they were measured (`caps`; `None`: unknown): a
    /// job above a cap may be below a looser one, and a task that changed class changes
    /// which configurations a violation rules out.
    fn restore_over_cap(&mut self, over_cap: &[Vec<u32>], caps: Option<&[Option<f64>]>) {
        let Some(search) = &mut self.search else {
            return;
        };
        if over_cap.is_empty() {
            return;
        }
        if caps != Some(search.slowdown_caps.as_slice()) {
            tracing::info!(device = %self.device_id, stored = ?caps, now = ?search.slowdown_caps,
                "persisted cap violations were measured against other (or unknown) caps; \
                not restored");
            return;
        }
        let mut restored = 0;
        for batch_sizes in over_cap {
            let idx: Option<Vec<usize>> = batch_sizes
                .iter()
                .zip(&search.sizes)
                .zip(&search.opportunistic)
                .map(|((&b, s), &opportunistic)| over_cap_index(b, s, opportunistic))
                .collect();
            match idx {
                Some(idx) if idx.len() == search.sizes.len() => {
                    match search.controller.rule_out_over_cap(&idx) {
                        Ok(()) => restored += 1,
                        Err(err) => tracing::warn!(%err, "persisted cap violation refused"),
                    }
                }
                _ => tracing::debug!(
                    ?batch_sizes,
                    "persisted cap violation rules out no current candidate; not needed"
                ),
            }
        }
        if restored > 0 {
            tracing::info!(device = %self.device_id, restored,
                "cap violations of the persisted search ruled out again");
        }
    }

    /// Replays persisted observations into the current search.
    fn replay(&mut self, observations: Vec<TunerObservation>) {
        let Some(search) = &mut self.search else {
            return;
        };
        for o in observations {
            let idx: Option<Vec<usize>> = o
                .batch_sizes
                .iter()
                .zip(&search.sizes)
                .map(|(b, s)| s.iter().position(|x| x == b))
                .collect();
            match idx {
                Some(idx) if idx.len() == search.sizes.len() => {
                    if let Err(err) = search.controller.record(&idx, o.sum_pd) {
                        tracing::warn!(%err, "persisted observation refused; skipped");
                        continue;
                    }
                    search.observations.push(o);
                }
                _ => tracing::warn!(batch_sizes = ?o.batch_sizes,
                    "persisted observation outside the search space; skipped"),
            }
        }
        tracing::info!(device = %self.device_id, observations = search.observations.len(),
            settled = search.controller.is_settled(), "search resumed from persisted observations");
    }

    /// Drops the current search's observations and starts a fresh one over the same tasks
    /// at `config` (or their current sizes), with `first` as its first observation.
    fn restart_search(
        &mut self,
        now_ms: i64,
        first: Option<(Vec<usize>, f64)>,
        out: &mut Vec<Action>,
    ) {
        let Some(mut old) = self.search.take() else {
            return;
        };
        let start = first
            .as_ref()
            .map(|(c, _)| c.clone())
            .or_else(|| old.applied.as_ref().map(|(c, _)| c.clone()))
            .unwrap_or_else(|| old.controller.search().space().start.clone());
        match self.new_search(old.task_ids.clone(), old.sizes.clone(), start) {
            Ok(fresh) => {
                let mut fresh = Search {
                    applied: old.applied,
                    measured: old.measured,
                    sampled: old.sampled,
                    ..fresh
                };
                // Measured cap violations are facts about these tasks at these sizes,
                // whatever else drifted: the fresh search keeps them.
                for config in old.controller.search().over_cap().to_vec() {
                    if let Err(err) = fresh.controller.rule_out_over_cap(&config) {
                        tracing::warn!(%err, "cap violation not carried over");
                    }
                }
                if let Some((config, value)) = first {
                    if let Err(err) = fresh.controller.record(&config, Some(value)) {
                        tracing::warn!(%err, "drift observation refused");
                    } else {
                        fresh.observations.push(TunerObservation {
                            batch_sizes: fresh.controller.search().space().batch_sizes(&config),
                            sum_pd: Some(value),
                            round: self.round,
                        });
                    }
                }
                self.search = Some(fresh);
                out.push(Action::Persist(self.persisted(now_ms)));
            }
            Err(err) => {
                tracing::error!(device = %self.device_id, %err, "cannot restart the search; holding");
            }
        }
    }

    /// The card and every task's conservative memory at each candidate size.
    fn memory_constraint(&self, task_ids: &[String], sizes: &[Vec<u32>]) -> MemoryConstraint {
        let upper_mib = task_ids
            .iter()
            .zip(sizes)
            .map(|(id, s)| {
                let Some(r) = self.residents.get(id) else {
                    return vec![None; s.len()];
                };
                let reserved = if r.reserved_mib > 0 {
                    r.reserved_mib
                } else {
                    r.spec.gpu_mem_request_mib
                } as f64;
                let k = self.knowledge.get(id).cloned().unwrap_or_default();
                let m0 = r.spec.initial_batch_size.max(1);
                let mut bounds = k.upper_bounds(s, m0, reserved, self.params.memory);
                // A production job that outgrew its fence at or below m0 may go back up
                // to m0 (the size it was placed for, where its PD alone is 1) in one step,
                // bounded by its model and the floor its crash left, rather than only a
                // step past its largest measured size at a time.
                if r.spec.is_production() && k.oom_floors.range(..=m0).next().is_some() {
                    for (bound, &b) in bounds.iter_mut().zip(s) {
                        if bound.is_none() && b <= m0 {
                            *bound = k.bound_ignoring_reach(b, self.params.memory);
                        }
                    }
                }
                bounds
            })
            .collect();
        MemoryConstraint {
            upper_mib,
            capacity_mib: self.capacity_mib,
            held_mib: self.held_mib(),
            // The one margin, which the placer and the agent's fall-back keep too.
            margin: MemoryMargin::DEFAULT,
        }
    }

    /// Puts the current memory knowledge into the search.
    fn refresh_memory(&mut self) -> Result<()> {
        let Some(search) = &self.search else {
            return Ok(());
        };
        let constraint = self.memory_constraint(&search.task_ids, &search.sizes);
        if let Some(search) = &mut self.search {
            search.controller.search().set_memory(Some(constraint))?;
        }
        Ok(())
    }

    /// Whether the settled configuration still fits with what is known about memory now.
    fn settled_config_fits(&mut self) -> bool {
        if self.refresh_memory().is_err() {
            return false;
        }
        let Some(search) = &mut self.search else {
            return true;
        };
        match &search.phase {
            Phase::Settled { config, .. } => {
                let config = config.clone();
                search.controller.search().feasible(&config)
            }
            _ => true,
        }
    }

    /// Tasks of the search without a solo step time at m0.
    fn unmeasurable(&self, search: &Search) -> Vec<String> {
        search
            .task_ids
            .iter()
            .filter(|id| {
                let m0 = self
                    .residents
                    .get(*id)
                    .map_or(1, |r| r.spec.initial_batch_size.max(1));
                self.knowledge
                    .get(*id)
                    .is_none_or(|k| k.solo_for_pd(m0).is_none())
            })
            .cloned()
            .collect()
    }

    fn hold(&mut self, now_ms: i64, why: Hold) {
        let until_ms = now_ms.saturating_add(millis(self.params.settled_interval));
        let Some(search) = &mut self.search else {
            return;
        };
        if search.logged_hold.as_ref() != Some(&why) {
            match &why {
                Hold::Unmeasurable(tasks) => tracing::warn!(device = %self.device_id, ?tasks,
                    "no solo step time at the submitted batch size (no local profile, never ran alone here): holding the batch sizes, not tuning"),
                // Nothing failed: what runs keeps running, only the memory model (which
                // errs on the large side) cannot vouch for any other configuration.
                Hold::Infeasible(why) => tracing::warn!(device = %self.device_id, %why,
                    "the memory model allows no configuration of the resident tasks; holding the batch sizes that run"),
                Hold::NoExpectation => tracing::warn!(device = %self.device_id,
                    "settled without a prediction of the kept configuration; deciding again later"),
            }
            search.logged_hold = Some(why.clone());
        }
        search.phase = Phase::Holding { why, until_ms };
    }

    /// Decides what runs next (phase `Idle`).
    fn decide(&mut self, now_ms: i64, out: &mut Vec<Action>) {
        if let Err(err) = self.refresh_memory() {
            self.hold(now_ms, Hold::Infeasible(err.to_string()));
            return;
        }
        if self.guard_caps(now_ms, out) {
            return;
        }
        let Some(search) = &self.search else {
            return;
        };
        let first_lone_round = search.task_ids.len() == 1 && search.observations.is_empty();
        let unknown = self.unmeasurable(search);
        if !unknown.is_empty() && !first_lone_round {
            self.measure_to_estimate(now_ms, unknown, out);
            return;
        }
        let max_observations = self.params.max_observations;
        let Some(search) = &mut self.search else {
            return;
        };
        let single = search.sizes.iter().all(|s| s.len() == 1);
        if !search.controller.is_settled()
            && (search.observations.len() >= max_observations
                || single && search.observations.iter().any(|o| o.sum_pd.is_some()))
        {
            tracing::info!(device = %self.device_id, observations = search.observations.len(),
                "nothing more to search; settling on the best measured configuration");
            if let Err(err) = search.controller.stop() {
                tracing::warn!(%err, "cannot settle");
            }
        }
        match search.controller.decide() {
            Ok(NextRun::Explore(idx)) => self.begin_round(now_ms, idx, Purpose::Explore, out),
            Ok(NextRun::Settle(best)) => self.settle(now_ms, best, out),
            Err(TunerError::NoFeasibleConfiguration(why)) => {
                self.hold(now_ms, Hold::Infeasible(why));
            }
            Err(err) => self.hold(now_ms, Hold::Infeasible(err.to_string())),
        }
    }

    /// Tasks that never ran alone here (`unknown`): measures what runs now, and estimates
    /// their solo step times from it (see `estimate_missing_solos`), rather than leave them
    /// untuned until they happen to run alone.
    fn measure_to_estimate(&mut self, now_ms: i64, unknown: Vec<String>, out: &mut Vec<Action>) {
        let Some(search) = &self.search else {
            return;
        };
        let applied = search.applied.as_ref().map(|(c, _)| c.clone());
        let reported = self.reported_config(search);
        let Some(search) = &mut self.search else {
            return;
        };
        // What runs, or else the sizes the search started from if the memory model
        // vouches for them: never a configuration that could overflow the card.
        let feasible =
            |search: &mut Search, config: &[usize]| search.controller.search().feasible(config);
        let (config, assign_afresh) = match applied {
            // Under a round of its own, assigned to every task: what runs may be under
            // rounds this tuner never saw written (the placer's newcomer round, a round
            // of ours whose write lost to that placement), whose reports never come.
            Some(config) if feasible(search, &config) => (config, true),
            // Measured as it runs: assigning it would move the agents' fences to
            // bounds the memory model does not vouch for together.
            Some(config) => (config, false),
            // The sizes the search started from, or else what the agents report: after
            // the start ran out of memory, what they fell back to.
            None => {
                let start = search.controller.search().space().start.clone();
                let Some(config) = [Some(start), reported]
                    .into_iter()
                    .flatten()
                    .find(|config| feasible(search, config))
                else {
                    self.hold(now_ms, Hold::Unmeasurable(unknown));
                    return;
                };
                (config, true)
            }
        };
        tracing::info!(device = %self.device_id, tasks = ?unknown,
            "no solo step time measured alone: measuring what runs to estimate it from the placer's predicted slowdown");
        if assign_afresh && let Some(search) = &mut self.search {
            search.applied = None;
        }
        self.begin_round(now_ms, config, Purpose::Explore, out);
    }

    /// Settles on `best`, or keeps what runs when switching is not worth it (hysteresis).
    fn settle(&mut self, now_ms: i64, best: Vec<usize>, out: &mut Vec<Action>) {
        let Some(search) = &mut self.search else {
            return;
        };
        let running = search.applied.as_ref().map(|(c, _)| c.clone());
        let keep = match &running {
            Some(current)
                if *current != best
                    && search.controller.search().feasible(current)
                    && !search
                        .controller
                        .worth_switching(current, &best)
                        .unwrap_or(true) =>
            {
                current.clone()
            }
            _ => best,
        };
        let expected = search
            .controller
            .search()
            .predict(&keep)
            .ok()
            .flatten()
            .map(|p| p.mean)
            .filter(|m| m.is_finite() && *m > 0.0);
        let Some(expected) = expected else {
            self.hold(now_ms, Hold::NoExpectation);
            return;
        };
        tracing::info!(device = %self.device_id,
            batch_sizes = ?search.controller.search().space().batch_sizes(&keep),
            expected_sum_pd = expected, kept_running = running.as_ref() == Some(&keep), "settled");
        if running.as_ref() != Some(&keep) {
            self.assign(now_ms, &keep, out);
        }
        if let Some(search) = &mut self.search {
            search.phase = Phase::Settled {
                config: keep,
                expected,
                check_at_ms: now_ms.saturating_add(millis(self.params.settled_interval)),
            };
        }
        // The state says it settled (`TunerState::settled`) from now, not from the next check.
        out.push(Action::Persist(self.persisted(now_ms)));
    }

    /// Writes one round of assignments for `config`; returns the round.
    fn assign(&mut self, now_ms: i64, config: &[usize], out: &mut Vec<Action>) -> u64 {
        self.round += 1;
        let round = self.round;
        let Some(search) = &mut self.search else {
            return round;
        };
        let space = search.controller.search().space().clone();
        let batch_sizes = space.batch_sizes(config);
        let mut assignments = Vec::with_capacity(batch_sizes.len());
        for (i, (id, &b)) in search.task_ids.iter().zip(&batch_sizes).enumerate() {
            let Some(r) = self.residents.get_mut(id) else {
                continue;
            };
            let rule =
                LrScalingRule::try_from(r.spec.lr_rule).unwrap_or(LrScalingRule::Unspecified);
            let phi = r
                .report
                .as_ref()
                .and_then(|r| r.grad_noise_scale)
                .filter(|p| p.is_finite() && *p >= 0.0);
            let memory_bound_mib = space
                .memory
                .as_ref()
                .and_then(|m| m.upper_mib[i][config[i]]);
            assignments.push(BatchSizeAssignment {
                task_id: id.clone(),
                batch_size: b,
                lr_factor: lr_factor(rule, r.spec.initial_batch_size, b, phi),
                lr_rule: r.spec.lr_rule,
                round,
                assigned_at_unix_ms: now_ms,
                memory_bound_mib,
                evict: r.evict.is_some(),
                evict_reason: r.evict.clone().unwrap_or_default(),
                ..BatchSizeAssignment::default()
            });
            r.assigned = Some((b, round));
            if let Some(bound) = memory_bound_mib {
                r.fence_mib = Some(bound);
            }
        }
        self.counters.rounds += 1;
        self.counters.assignments += assignments.len() as u64;
        search.applied = Some((config.to_vec(), vec![round; config.len()]));
        tracing::debug!(device = %self.device_id, round, ?batch_sizes,
            memory_bounds_mib = ?assignments.iter().map(|a| a.memory_bound_mib).collect::<Vec<_>>(),
            held_mib = self.held_mib(), "round assigned");
        out.push(Action::Assign(assignments));
        round
    }

    /// The sequence of each search task's latest report (what a round's reports must beat).
    fn seen_seq(&self, task_ids: &[String]) -> Vec<Option<u64>> {
        task_ids
            .iter()
            .map(|id| {
                self.residents
                    .get(id)
                    .and_then(|r| r.report.as_ref())
                    .map(|r| r.seq)
            })
            .collect()
    }

    /// Assigns `config` (unless it runs already) and starts measuring it for `purpose`.
    fn begin_round(
        &mut self,
        now_ms: i64,
        config: Vec<usize>,
        purpose: Purpose,
        out: &mut Vec<Action>,
    ) {
        let running = self
            .search
            .as_ref()
            .and_then(|s| s.applied.as_ref())
            .filter(|(c, _)| *c == config)
            .map(|(_, rounds)| rounds.clone());
        // Re-assigning what runs would only make every training loop apply a "change" to
        // the same batch size; its reports under the current rounds measure it as well.
        let rounds = match running {
            Some(rounds) => rounds,
            None => {
                let round = self.assign(now_ms, &config, out);
                vec![round; config.len()]
            }
        };
        let Some(search) = &self.search else {
            return;
        };
        let seen = self.seen_seq(&search.task_ids);
        let batch_sizes = search.batch_sizes(&config);
        let m = Measurement::new(rounds, config, batch_sizes, purpose, now_ms, &seen);
        if let Some(search) = &mut self.search {
            search.phase = Phase::Measuring(m);
        }
    }

    /// Starts measuring the settled configuration that runs, without assigning anything;
    /// false when what runs is not known to be the settled configuration.
    fn begin_check(&mut self, now_ms: i64) -> bool {
        let Some(search) = &self.search else {
            return false;
        };
        let (Phase::Settled { config, .. }, Some((applied, rounds))) =
            (&search.phase, &search.applied)
        else {
            return false;
        };
        if config != applied {
            return false;
        }
        let seen = self.seen_seq(&search.task_ids);
        let m = Measurement::new(
            rounds.clone(),
            config.clone(),
            search.batch_sizes(config),
            Purpose::Check,
            now_ms,
            &seen,
        );
        if let Some(search) = &mut self.search {
            search.phase = Phase::Measuring(m);
        }
        true
    }

    /// A round without enough fresh reports in time: dropped, never observed. A dropped
    /// check leaves the search settled until the next check.
    fn drop_round(&mut self, now_ms: i64) {
        let reports_per_round = self.params.reports_per_round;
        let settled_interval = millis(self.params.settled_interval);
        let Some(search) = &mut self.search else {
            return;
        };
        let Phase::Measuring(m) = std::mem::replace(&mut search.phase, Phase::Idle) else {
            return;
        };
        self.counters.dropped += 1;
        // What was assigned may never have reached the agents (a round whose write lost to
        // a placement): the configuration is assigned afresh, not assumed to run.
        if m.purpose != Purpose::Check {
            search.applied = None;
        }
        let missing: Vec<&String> = m
            .missing(reports_per_round)
            .into_iter()
            .filter_map(|i| search.task_ids.get(i))
            .collect();
        tracing::warn!(device = %self.device_id, rounds = ?m.rounds, ?missing,
            "not enough fresh reports in time; round dropped");
        if m.purpose == Purpose::Check
            && let Some(expected) = self.expected_of(&m.config)
            && let Some(search) = &mut self.search
        {
            search.phase = Phase::Settled {
                config: m.config,
                expected,
                check_at_ms: now_ms.saturating_add(settled_interval),
            };
        }
    }

    /// What a check of `config` is compared with: the settled expectation.
    fn expected_of(&mut self, config: &[usize]) -> Option<f64> {
        let search = self.search.as_mut()?;
        search
            .controller
            .search()
            .predict(config)
            .ok()
            .flatten()
            .map(|p| p.mean)
            .filter(|m| m.is_finite() && *m > 0.0)
    }

    /// Each task's PD in a measured round (`None` where it cannot be computed: no solo
    /// step time at m0).
    fn task_pds(
        &self,
        task_ids: &[String],
        batch_sizes: &[u32],
        step_times: &[f64],
        noise_scales: &[Option<f64>],
    ) -> Vec<Option<f64>> {
        let mut pds = Vec::with_capacity(task_ids.len());
        for (i, id) in task_ids.iter().enumerate() {
            let m0 = self
                .residents
                .get(id)
                .map_or(1, |r| r.spec.initial_batch_size.max(1));
            let pd = self
                .knowledge
                .get(id)
                .and_then(|k| k.solo_for_pd(m0))
                .ok_or(())
                .and_then(|solo_step_s_m0| {
                    PdInput {
                        m0: f64::from(m0),
                        solo_step_s_m0,
                        m: f64::from(batch_sizes[i]),
                        co_step_s: step_times[i],
                        noise_scale: noise_scales[i],
                    }
                    .pd()
                    .map_err(|err| tracing::warn!(task = %id, %err, "cannot compute PD"))
                });
            pds.push(pd.ok());
        }
        pds
    }

    /// A complete round (see the module documentation, steps 2, 3 and 5).
    fn conclude(&mut self, now_ms: i64, outcome: Outcome, out: &mut Vec<Action>) {
        let Some(search) = &mut self.search else {
            return;
        };
        let Phase::Measuring(m) = std::mem::replace(&mut search.phase, Phase::Idle) else {
            return;
        };
        let task_ids = search.task_ids.clone();
        let lone = task_ids.len() == 1;
        match outcome {
            Outcome::OutOfMemory(tasks)
                if tasks.iter().all(|&i| {
                    // At or below m0 only, as `learn_shared_oom` learns a floor: above
                    // m0 a fence outgrown is a limit.
                    self.residents.get(&task_ids[i]).is_some_and(|r| {
                        r.outgrew_fence && m.batch_sizes[i] <= r.spec.initial_batch_size.max(1)
                    })
                }) =>
            {
                // Production jobs that outgrew their fences with room left on the card:
                // a floor was learned from the report, the configuration is no out of
                // memory (its next assignment's bound moves the fence past the floor).
                self.counters.out_of_memory += 1;
                self.counters.dropped += 1;
                search.applied = None;
                tracing::warn!(device = %self.device_id, rounds = ?m.rounds, batch_sizes = ?m.batch_sizes,
                    tasks = ?tasks.iter().map(|&i| &task_ids[i]).collect::<Vec<_>>(),
                    "production job ran out of its memory fence; measuring again under a higher bound");
                out.push(Action::Persist(self.persisted(now_ms)));
            }
            Outcome::OutOfMemory(tasks) => {
                self.counters.out_of_memory += 1;
                // What runs is no longer what was applied: each task that ran out fell
                // back to a smaller size. Kept, the next decision would measure the
                // failed configuration "as it runs" under the same rounds, read the
                // fall-back's reports as the same out-of-memory again, and loop there.
                search.applied = None;
                let params = self.params.memory;
                for &i in &tasks {
                    if lone && let Some(k) = self.knowledge.get_mut(&task_ids[i]) {
                        k.learn_oom_alone_past(m.batch_sizes[i], params);
                    }
                }
                tracing::warn!(device = %self.device_id, rounds = ?m.rounds, batch_sizes = ?m.batch_sizes,
                    tasks = ?tasks.iter().map(|&i| &task_ids[i]).collect::<Vec<_>>(),
                    joint = !lone, "configuration ran out of memory");
                self.observe(&m, None);
                out.push(Action::Persist(self.persisted(now_ms)));
            }
            Outcome::Measured {
                step_times,
                noise_scales,
            } => self.conclude_measured(now_ms, m, &task_ids, &step_times, &noise_scales, out),
        }
    }

    /// A round that measured every task: learns from it, checks the caps and, when every
    /// task's PD is known, records the round's sum of PDs for its purpose.
    fn conclude_measured(
        &mut self,
        now_ms: i64,
        m: Measurement,
        task_ids: &[String],
        step_times: &[f64],
        noise_scales: &[Option<f64>],
        out: &mut Vec<Action>,
    ) {
        let lone = task_ids.len() == 1;
        if lone && let Some(k) = self.knowledge.get_mut(&task_ids[0]) {
            k.learn_solo(m.batch_sizes[0], step_times[0]);
            self.profile_changed.insert(task_ids[0].clone());
        } else if !lone {
            self.estimate_missing_solos(task_ids, &m.batch_sizes, step_times);
        }
        let pds = self.task_pds(task_ids, &m.batch_sizes, step_times, noise_scales);
        let over_cap = self.watch_caps(now_ms, &m, &pds, out);
        let unknown: Vec<String> = task_ids
            .iter()
            .zip(&pds)
            .filter(|(_, pd)| pd.is_none())
            .map(|(id, _)| id.clone())
            .collect();
        if !unknown.is_empty() {
            self.counters.dropped += 1;
            self.hold(now_ms, Hold::Unmeasurable(unknown));
            return;
        }
        let value: f64 = pds.iter().flatten().sum();
        self.last_sum_pd = Some(value);
        self.emit_samples(now_ms, &m, step_times, out);
        if let Some(search) = &mut self.search {
            search.measured = Some(m.config.clone());
        }
        if over_cap && m.purpose != Purpose::Check {
            self.rule_out_over_cap(&m.config);
        }
        match m.purpose {
            Purpose::Explore => {
                self.counters.measured += 1;
                tracing::info!(device = %self.device_id, rounds = ?m.rounds,
                    batch_sizes = ?m.batch_sizes, sum_pd = value, "round measured");
                self.observe(&m, Some(value));
            }
            Purpose::Check => self.check(now_ms, m, value, over_cap, out),
            Purpose::Guard => {
                tracing::info!(device = %self.device_id, rounds = ?m.rounds,
                    batch_sizes = ?m.batch_sizes, sum_pd = value, over_cap,
                    "cap round measured");
            }
        }
        out.push(Action::Persist(self.persisted(now_ms)));
    }

    /// Checks a measured round's PDs against the production jobs' caps (see the module
    /// documentation, step 6): records each resident's PD, reports a breach or its end, and
    /// says whether a production job was above its cap.
    fn watch_caps(
        &mut self,
        now_ms: i64,
        m: &Measurement,
        pds: &[Option<f64>],
        out: &mut Vec<Action>,
    ) -> bool {
        let Some(search) = &self.search else {
            return false;
        };
        let task_ids = search.task_ids.clone();
        let opportunistic = search.opportunistic.clone();
        let homes = self.home_indices(search);
        for (id, pd) in task_ids.iter().zip(pds) {
            if let Some(pd) = pd {
                self.measured_pd.insert(id.clone(), *pd);
            }
        }
        // The opportunistic co-runners when every one runs at its smallest size.
        let opportunistic_ids: Vec<String> = task_ids
            .iter()
            .zip(&opportunistic)
            .filter(|(_, o)| **o)
            .map(|(id, _)| id.clone())
            .collect();
        let all_at_floor = opportunistic
            .iter()
            .zip(&m.config)
            .all(|(&o, &i)| !o || i == 0);
        let floor = (all_at_floor && !opportunistic_ids.is_empty()).then_some(opportunistic_ids);
        let round = m.rounds.iter().copied().max().unwrap_or(self.round);
        let mut over_cap = false;
        for (i, id) in task_ids.iter().enumerate() {
            let (Some(pd), Some(cap)) = (
                pds[i],
                self.residents.get(id).and_then(|r| r.spec.slowdown_cap()),
            ) else {
                continue;
            };
            // Only at its own submitted size is a job's PD its interference alone.
            let at_home = homes[i].is_none_or(|h| h == m.config[i]);
            let at_floor = floor.clone().filter(|_| at_home);
            let watch = self.caps.entry(id.clone()).or_default();
            let verdict = watch.measured(pd, cap, at_floor, self.params.breach_rounds);
            if watch.above {
                over_cap = true;
                tracing::info!(device = %self.device_id, task = %id, pd, cap,
                    batch_sizes = ?m.batch_sizes, rounds_at_floor = watch.rounds_at_floor,
                    "production job measured above its slowdown cap");
            }
            match verdict {
                Verdict::Nothing => {}
                Verdict::Breach => {
                    out.push(Action::CapBreached(CapBreach {
                        device_id: self.device_id.clone(),
                        task_id: id.clone(),
                        measured_pd: pd,
                        max_slowdown: cap,
                        rounds_above: watch.rounds_at_floor,
                        opportunistic_task_ids: watch.floor_set.clone(),
                        round,
                        at_unix_ms: now_ms,
                    }));
                }
                Verdict::Restored => {
                    tracing::info!(device = %self.device_id, task = %id, pd, cap,
                        "production job measured back under its slowdown cap");
                    out.push(Action::CapRestored {
                        task_id: id.clone(),
                    });
                }
            }
        }
        over_cap
    }

    /// Rules `config` out of the search: a production job ran above its cap there.
    fn rule_out_over_cap(&mut self, config: &[usize]) {
        if let Some(search) = &mut self.search
            && let Err(err) = search.controller.rule_out_over_cap(config)
        {
            tracing::warn!(%err, "cap violation refused by the search");
        }
    }

    /// While a production job is above its cap, decides the next round instead of the
    /// search (see the module documentation, step 6): a production job above its cap away
    /// from its submitted size m0 goes back to m0 first (its own size may be the cause);
    /// then every opportunistic co-runner goes one candidate size down from what runs a
    /// round, production jobs staying as they are; with nothing left to change, what runs
    /// is measured again (the rounds that count towards a breach). The way back to m0
    /// holds on a device without an opportunistic co-runner too. False when no
    /// production job is above its cap, or when none is away from m0 and no co-runner is
    /// opportunistic (nothing to shrink or evict: the search itself moves away from the
    /// configurations it measured over a cap, which are infeasible).
    fn guard_caps(&mut self, now_ms: i64, out: &mut Vec<Action>) -> bool {
        let max_observations = self.params.max_observations;
        let Some(search) = &self.search else {
            return false;
        };
        let above: Vec<bool> = search
            .task_ids
            .iter()
            .map(|id| self.caps.get(id).is_some_and(|w| w.above))
            .collect();
        if !above.contains(&true) {
            return false;
        }
        let shrinkable = search.opportunistic.contains(&true);
        let Some(base) = search
            .applied
            .as_ref()
            .map(|(c, _)| c.clone())
            .or_else(|| self.running_config(search))
            .or_else(|| search.measured.clone())
        else {
            return false;
        };
        let mut next = base.clone();
        for ((i, home), &above) in next.iter_mut().zip(self.home_indices(search)).zip(&above) {
            if let Some(home) = home.filter(|_| above) {
                *i = home;
            }
        }
        let why = if next != base && search.controller.space().fits_memory(&next) {
            "a production job is above its slowdown cap away from its submitted size: back to it"
        } else if !shrinkable {
            // Nothing to shrink or evict, and the job is at m0 (or m0 does not fit): the
            // search moves away from what it measured over the cap.
            return false;
        } else {
            next = base
                .iter()
                .zip(&search.opportunistic)
                .map(|(&i, &o)| if o { i.saturating_sub(1) } else { i })
                .collect();
            "a production job is above its slowdown cap: shrinking the opportunistic co-runners"
        };
        // Past what is known to be above a cap already: shrinking on.
        while search.controller.over_cap_rules_out(&next)
            && next
                .iter()
                .zip(&search.opportunistic)
                .any(|(&i, &o)| o && i > 0)
        {
            for (i, &o) in next.iter_mut().zip(&search.opportunistic) {
                if o {
                    *i = i.saturating_sub(1);
                }
            }
        }
        if next == base {
            // Not a configuration that ran out of memory (what the assignments still say
            // after a fall-back): assigned again, it would fail again every round. The
            // search moves elsewhere instead.
            if self.ran_out_of_memory_at(&base) {
                return false;
            }
            self.begin_round(now_ms, base, Purpose::Guard, out);
            return true;
        }
        // Observed while the search has room for it: a true measurement of a configuration
        // the search may want to know later.
        let purpose = if search.observations.len() < max_observations {
            Purpose::Explore
        } else {
            Purpose::Guard
        };
        tracing::info!(device = %self.device_id, from = ?search.batch_sizes(&base),
            to = ?search.batch_sizes(&next), "{why}");
        self.begin_round(now_ms, next, purpose, out);
        true
    }

    /// The search observed `config` run out of memory.
    fn ran_out_of_memory_at(&self, config: &[usize]) -> bool {
        self.search.as_ref().is_some_and(|s| {
            let sizes = s.batch_sizes(config);
            s.observations
                .iter()
                .any(|o| o.sum_pd.is_none() && o.batch_sizes == sizes)
        })
    }

    /// Each task's submitted size m0 as an index into its candidate sizes.
    fn home_indices(&self, search: &Search) -> Vec<Option<usize>> {
        search
            .task_ids
            .iter()
            .zip(&search.sizes)
            .map(|(id, sizes)| {
                let m0 = self.residents.get(id)?.spec.initial_batch_size.max(1);
                sizes.iter().position(|&b| b == m0)
            })
            .collect()
    }

    /// The configuration the tasks run now by their latest assignments (or reports), when
    /// every one is a candidate size.
    fn running_config(&self, search: &Search) -> Option<Vec<usize>> {
        self.config_by(search, |r| {
            r.assigned.map(|(b, _)| b).or_else(|| reported_size(r))
        })
    }

    /// The configuration the tasks last reported running at, when every one is a
    /// candidate size: after an out-of-memory, what the agents fell back to.
    fn reported_config(&self, search: &Search) -> Option<Vec<usize>> {
        self.config_by(search, reported_size)
    }

    /// The configuration of each search task's size by `size`, when every one is a
    /// candidate.
    fn config_by(
        &self,
        search: &Search,
        size: impl Fn(&TunedTask) -> Option<u32>,
    ) -> Option<Vec<usize>> {
        search
            .task_ids
            .iter()
            .zip(&search.sizes)
            .map(|(id, sizes)| {
                let b = size(self.residents.get(id)?)?;
                sizes.iter().position(|&x| x == b)
            })
            .collect()
    }

    /// Estimates the solo step time of every task of a co-located round that has none at
    /// m0 (measured alone, or estimated before): its measured step time divided by the
    /// slowdown the placer predicted for it where it placed it (docs/design.md, "Solo step time
    /// of a job that never ran alone"). A task placed without a prediction (an older
    /// placer, or one written by hand) is taken as not slowed down, so its PD is
    /// underestimated rather than left out: every resident is tuned. A measurement alone
    /// replaces the estimate as soon as the task runs alone.
    fn estimate_missing_solos(
        &mut self,
        task_ids: &[String],
        batch_sizes: &[u32],
        step_times: &[f64],
    ) {
        for ((id, &b), &step_s) in task_ids.iter().zip(batch_sizes).zip(step_times) {
            let Some(r) = self.residents.get(id) else {
                continue;
            };
            let m0 = r.spec.initial_batch_size.max(1);
            let Some(k) = self.knowledge.get_mut(id) else {
                continue;
            };
            if k.solo_at(m0).is_some() {
                continue;
            }
            let slowdown = k.placed_slowdown.unwrap_or(1.0);
            let estimate_s = step_s / slowdown;
            // Said once per task; every later round re-estimates (the trial's log had the
            // line at every round).
            let first = k.solo_estimated.is_empty();
            k.learn_solo_estimate(b, estimate_s);
            let message =
                "solo step time estimated (never ran alone here); a measurement alone replaces it";
            if first {
                tracing::info!(device = %self.device_id, task = %id, batch_size = b,
                    co_located_step_s = step_s, predicted_slowdown = slowdown,
                    predicted = k.placed_slowdown.is_some(), solo_step_s = estimate_s, "{message}");
            } else {
                tracing::debug!(device = %self.device_id, task = %id, batch_size = b,
                    co_located_step_s = step_s, predicted_slowdown = slowdown,
                    solo_step_s = estimate_s, "{message}");
            }
        }
    }

    /// Adds an explore round's value (or out of memory) to the search.
    fn observe(&mut self, m: &Measurement, value: Option<f64>) {
        let round = self.round;
        let Some(search) = &mut self.search else {
            return;
        };
        if let Err(err) = search.controller.record(&m.config, value) {
            tracing::warn!(%err, "measurement refused by the search");
            return;
        }
        search.observations.push(TunerObservation {
            batch_sizes: m.batch_sizes.clone(),
            sum_pd: value,
            round,
        });
    }

    /// A settled check: stay, or start a fresh search on drift. A check that finds a
    /// production job above its cap rules the configuration out (and so un-settles the
    /// search), drifted or not.
    fn check(
        &mut self,
        now_ms: i64,
        m: Measurement,
        value: f64,
        over_cap: bool,
        out: &mut Vec<Action>,
    ) {
        self.counters.checks += 1;
        let drift = self.params.controller.drift;
        let settled_interval = millis(self.params.settled_interval);
        let expected = self.expected_of(&m.config);
        let drifted = expected.is_none_or(|e| (value - e).abs() > drift * e);
        if over_cap {
            if drifted {
                self.counters.drifts += 1;
                tracing::info!(device = %self.device_id, measured = value, ?expected,
                    batch_sizes = ?m.batch_sizes, "measured Σ PD drifted; fresh search from what runs");
                self.restart_search(now_ms, Some((m.config.clone(), value)), out);
            }
            self.rule_out_over_cap(&m.config);
            return;
        }
        let Some(expected) = expected else {
            return;
        };
        if (value - expected).abs() <= drift * expected {
            if let Some(search) = &mut self.search {
                search.phase = Phase::Settled {
                    config: m.config,
                    expected,
                    check_at_ms: now_ms.saturating_add(settled_interval),
                };
            }
            return;
        }
        self.counters.drifts += 1;
        tracing::info!(device = %self.device_id, measured = value, expected,
            batch_sizes = ?m.batch_sizes, "measured Σ PD drifted; fresh search from what runs");
        self.restart_search(now_ms, Some((m.config, value)), out);
    }

    /// Samples of a measured co-location whose configuration was not sampled before.
    fn emit_samples(
        &mut self,
        now_ms: i64,
        m: &Measurement,
        step_times: &[f64],
        out: &mut Vec<Action>,
    ) {
        let Some(search) = &self.search else {
            return;
        };
        if search.task_ids.len() < 2 || search.sampled.contains(&m.batch_sizes) {
            return;
        }
        let empty = TaskKnowledge::default();
        let measured: Vec<samples::Measured<'_>> = search
            .task_ids
            .iter()
            .enumerate()
            .filter_map(|(i, id)| {
                let r = self.residents.get(id)?;
                Some(samples::Measured {
                    task_id: id,
                    spec: &r.spec,
                    knowledge: self.knowledge.get(id).unwrap_or(&empty),
                    batch_size: m.batch_sizes[i],
                    step_time_s: step_times[i],
                    peak_mem_mib: r
                        .report
                        .as_ref()
                        .filter(|rep| {
                            rep.peak_mem_batch_size == m.batch_sizes[i]
                                || rep.peak_mem_batch_size == 0
                        })
                        .and_then(|rep| rep.peak_mem_mib),
                })
            })
            .collect();
        let made = samples::from_round(
            &self.device_id,
            &self.device_kind,
            m.rounds.iter().copied().max().unwrap_or(0),
            now_ms,
            &measured,
        );
        if made.is_empty() {
            return;
        }
        for sample in made {
            out.push(Action::Sample {
                seq: self.next_sample_seq,
                sample,
            });
            self.next_sample_seq += 1;
            self.counters.samples += 1;
        }
        if let Some(search) = &mut self.search {
            search.sampled.insert(m.batch_sizes.clone());
        }
    }
}

impl Search {
    /// The batch sizes of a configuration (indices into `sizes`).
    fn batch_sizes(&self, config: &[usize]) -> Vec<u32> {
        config.iter().zip(&self.sizes).map(|(&i, s)| s[i]).collect()
    }
}

#[cfg(test)]
mod tests;
