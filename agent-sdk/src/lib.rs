//! The iadeep agent SDK: embedded in a training loop, it applies the batch sizes
//! the tuner assigns and reports how the task is doing.
//!
//! - [`Agent`]: `batch_size()` / `record_step()` on the hot path (atomics only),
//!   `poll_change()` between steps, `report_oom()`, `finish()`; after the placer
//!   evicts the task, `evicted()` says why and `leave()` ends the agent unfinished.
//! - A background reporter thread registers the task (TaskSpec if absent, a
//!   leased alive key), publishes [`iadeep_proto::TaskReport`]s, watches the
//!   task's assignment and rides out store outages with back-off.
//! - [`gns`]: the two-batch-size gradient noise scale estimator; [`lr`]: the
//!   learning-rate rules; [`memory`]: NVML or caller-supplied peak memory.
//! - SIGTERM and Ctrl-C finish the task (final report, lease revoked) before the process
//!   ends as the signal would have ended it; [`StopSignals`] says which signals.
//! - [`launch`]: the environment variables a launcher (`iadeep run`) sets for the
//!   job, written and read through one definition.

mod agent;
mod config;
mod error;
pub mod launch;
/// The gradient-noise-scale estimator and learning-rate rules live in `iadeep-objective`,
/// shared with the tuner; re-exported because trainers use them through the agent.
pub use iadeep_objective::{gns, lr};
mod measure;
pub mod memory;
mod reporter;
mod shared;
mod signals;

pub use agent::Agent;
pub use config::{
    AgentBuilder, AgentConfig, DEFAULT_LEASE_TTL, DEFAULT_REPORT_INTERVAL, StoreSource,
};
pub use error::{AgentError, Result};
pub use shared::{BatchSizeChange, ChangeReason};
pub use signals::StopSignals;
