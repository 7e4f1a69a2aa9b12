//! Per-GPU batch-size tuner of iadeep.
//!
//! The pieces, one private module per idea, with what other crates use re-exported at the
//! root ([`gp`] and [`daemon`] are public modules of their own):
//! - `memory`: a conservative, monotone per-task memory model (batch size → peak MiB);
//! - `feasibility`: the probability that a configuration does not run out of memory,
//!   learned from the search's own probes and the monotonicity of memory;
//! - [`gp`]: a Gaussian-process surrogate (Matérn-5/2, ARD, hyper-parameters by marginal
//!   likelihood);
//! - `search`: GP-LCB over the memory-feasible lattice of co-located batch sizes, with a
//!   stopping rule, hysteresis and re-opening, behind the [`Evaluator`] trait so the
//!   algorithm never knows where its observations come from;
//! - `device_tuner`: the tuner of one GPU as a clock-free, I/O-free state machine (task
//!   knowledge, the search over the residents' batch sizes, hysteresis, drift checks,
//!   co-location samples): events in, actions out, driven by the daemon and the simulator;
//! - [`daemon`] (feature `daemon`): the per-GPU tuner daemon driving a [`DeviceTuner`] over
//!   the state store.
//!
//! The benchmark of the search on Gavel's measurements and the memory model's evaluation
//! are in the `iadeep-eval` crate.

#[cfg(feature = "daemon")]
pub mod daemon;
mod device_tuner;
mod error;
mod feasibility;
pub mod gp;
mod memory;
mod search;

// `TaskKnowledge` is public so readers of a persisted `TunerState` (`iadeep status`) compute
// a job's PD against the same solo step time the tuner divides by.
pub use device_tuner::{
    Action, Counters, DeviceTask, DeviceTuner, DeviceTunerParams, Input, MeasuredPd, RunningTask,
    Status, TaskKnowledge, Translator, candidate_sizes,
};
pub use error::{Result, TunerError};
pub use memory::{CubicBaseline, MemoryModel, MemoryModelParams, MemorySample};
pub use search::{Evaluator, GpLcb, LcbParams, SearchSpace, at_or_above_an_oom};
