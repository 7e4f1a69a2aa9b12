//! Scheduling policies: one module each, all behind [`Policy`].
//!
//! A policy answers two questions: where a waiting task goes (or that it waits), and,
//! for policies that tune, which batch sizes the residents of a device should use
//! next. It sees only [`crate::view`]: specs (with a solo profile only under
//! [`crate::view::JobInfo::Profiled`]) and agents' reports; [`solo`] is what the
//! baselines make of them.

pub mod batch_search;
pub mod exclusive;
pub mod iadeep;
pub mod memory;
pub mod packing;
pub mod pollux;
pub mod priority;
pub mod reference;
pub mod solo;
pub mod util;

use crate::view::{PolicyView, Waiting};

/// A batch size for a task on a device, as an assignment carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub task: usize,
    pub batch_size: u32,
    /// The assigner's bound on the task's memory at that size, MiB (the assignment's
    /// `memory_bound_mib`). A fenced task's agent moves its memory fence to it (see
    /// [`PlaceOrQueue::Place`]); `None` leaves the fence where it is. Ignored for tasks
    /// without a fence.
    pub memory_bound_mib: Option<u64>,
}

impl Assignment {
    /// `batch_size` for `task`, with no memory bound.
    pub fn new(task: usize, batch_size: u32) -> Assignment {
        Assignment {
            task,
            batch_size,
            memory_bound_mib: None,
        }
    }
}

/// Where a waiting task goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlaceOrQueue {
    /// Start it on `device` at `batch_size`, after shrinking the residents in `shrinks`
    /// to make room for it.
    Place {
        device: usize,
        batch_size: u32,
        shrinks: Vec<Assignment>,
        /// The memory fence of the task's agent, MiB, when it has one: the agent caps its
        /// own allocator there (docs/design.md, "Memory fence"), so a run that needs more fails
        /// its own allocation and falls back, never touching its co-runners; later
        /// assignments move the fence ([`Assignment::memory_bound_mib`]). The iadeep
        /// policies fence every task at the placer's reservation; `None` (the baselines)
        /// is an agent without a fence, whose overflow crashes as before.
        fence_mib: Option<u64>,
    },
    /// Keep it waiting (under [`Admission::Fifo`], later tasks wait too).
    Queue,
}

impl PlaceOrQueue {
    /// Start on `device` at `batch_size`, shrinking nobody, without a fence.
    pub fn place(device: usize, batch_size: u32) -> PlaceOrQueue {
        PlaceOrQueue::Place {
            device,
            batch_size,
            shrinks: Vec::new(),
            fence_mib: None,
        }
    }
}

/// The outcome of one tuning call on a device.
#[derive(Clone, Debug, PartialEq)]
pub enum TuneStep {
    /// Apply these batch sizes and call again after `again_in_s` (`None`: the engine's
    /// tuning interval), so the result can be measured.
    Apply {
        assignments: Vec<Assignment>,
        again_in_s: Option<f64>,
    },
    /// Nothing to change now; call again after `again_in_s` (`None`: the engine's
    /// tuning interval).
    Wait { again_in_s: Option<f64> },
    /// Nothing to do until the residents change.
    Done,
}

pub use crate::view::Admission;

/// What happens to a task that ran out of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OomAction {
    /// Restart on the same device at half the batch size (back to the queue when it
    /// cannot be halved).
    RestartHalf,
    /// Leave the device and wait at the front of the queue at half the batch size.
    Requeue,
}

/// A scheduling policy under test.
pub trait Policy {
    /// Short name used in tables and JSON (`exclusive`, `iadeep`, ...).
    fn name(&self) -> &str;

    /// Decides where the task at the head of the queue goes.
    fn place(&mut self, view: &dyn PolicyView, task: Waiting<'_>) -> PlaceOrQueue;

    /// Whether the engine should call [`Policy::tune`] after residents change.
    fn tunes(&self) -> bool {
        false
    }

    /// Seconds after a change of a device's residents until the first [`Policy::tune`]
    /// (`None`: the engine's tuning interval). A policy that keeps its own clock (the
    /// iadeep tuner, driven by the agents' reports) asks to be called one report later.
    fn first_tune_in_s(&self) -> Option<f64> {
        None
    }

    /// One tuning round on `device`; the agents' reports reflect the previous round.
    fn tune(&mut self, _view: &dyn PolicyView, _device: usize) -> TuneStep {
        TuneStep::Done
    }

    /// A task on `device` crashed out of memory at `batch_size`: the card's memory ran
    /// out. (A fenced task over its own fence is not a crash: its agent falls back by
    /// itself and the policy learns of it from the task's reports.)
    fn on_oom(&mut self, _device: usize, _task: usize, _batch_size: u32) -> OomAction {
        OomAction::RestartHalf
    }

    /// A task finished on `device`.
    fn on_finish(&mut self, _device: usize, _task: usize) {}

    /// A task left `device` without finishing (out of memory where it could not run
    /// smaller, or evicted): it waits to be placed again, as a job restarted from its
    /// checkpoint.
    fn on_left(&mut self, _device: usize, _task: usize) {}

    /// The running tasks this policy evicted since it was last asked (a production job's
    /// room, a breach of its cap): the engine asks right after each [`Policy::place`] and
    /// [`Policy::tune`] call, takes each victim off its device (it loses its work since
    /// its last checkpoint and waits to be placed again, see `crate::engine`), and tells
    /// the policy with [`Policy::on_left`]. Tasks no longer running are ignored.
    fn take_evictions(&mut self) -> Vec<usize> {
        Vec::new()
    }

    /// Starts recording placement decisions for the audit ([`crate::AuditRecord`]); policies
    /// without a placement model to audit ignore it.
    fn enable_audit(&mut self) {}

    /// The decisions recorded since the audit was enabled (truth not yet filled in).
    fn take_audit(&mut self) -> Vec<crate::audit::AuditRecord> {
        Vec::new()
    }

    /// What the policy learned or did internally, for the run's log line (e.g. how
    /// many samples its predictor got); empty when there is nothing to say.
    fn diagnostics(&self) -> String {
        String::new()
    }
}

/// The policy names, in table order: the ones `policy::build` knows, and the oracles
/// (which [`Experiment::policy`](crate::Experiment::policy) builds from the world).
pub const POLICY_NAMES: &[&str] = &[
    "exclusive",
    "priority",
    "packing",
    "util",
    "memory",
    "reference",
    "reference-fixed",
    "pollux",
    "iadeep",
    "iadeep-no-tuner",
    "iadeep-no-predictor",
    "oracle",
    "oracle-prediction",
    "oracle-memory",
    "oracle-tuning",
    "oracle-wait",
];

/// Builds a policy by name (see [`POLICY_NAMES`]); the oracles
/// need the world and are built by [`crate::experiment::Experiment::policy`].
pub fn build(name: &str, seed: u64) -> crate::Result<Box<dyn Policy>> {
    Ok(match name {
        "exclusive" => Box::new(exclusive::Exclusive),
        "priority" => Box::new(priority::Priority::default()),
        "packing" => Box::new(packing::Packing),
        "util" => Box::new(util::LeastUtilised::default()),
        "memory" => Box::new(memory::MostMemory::default()),
        "reference" => Box::new(reference::Reference::new(seed, false)),
        "reference-fixed" => Box::new(reference::Reference::new(seed, true)),
        "pollux" => Box::new(pollux::Pollux::default()),
        "iadeep" => Box::new(iadeep::Iadeep::new(iadeep::Variant::Full, seed)?),
        "iadeep-no-tuner" => Box::new(iadeep::Iadeep::new(iadeep::Variant::NoTuner, seed)?),
        "iadeep-no-predictor" => Box::new(iadeep::Iadeep::new(iadeep::Variant::NoPredictor, seed)?),
        _ if iadeep::Oracle::from_name(name).is_some() => {
            return Err(crate::SimError::InvalidParam {
                field: "policy",
                reason: "the oracles are built from the world (Experiment::policy)".into(),
            });
        }
        _ => {
            return Err(crate::SimError::UnknownPolicy {
                requested: name.to_owned(),
                known: POLICY_NAMES.join(", "),
            });
        }
    })
}
