//! Per-GPU batch-size tuner of iadeep.
//!
//! The pieces, one module per idea:
//! - [`degradation`]: the objective PD = IF·DT/E, the gradient-noise-scale estimator and the
//!   learning-rate rules that come with a batch-size change;
//! - [`memory`]: a conservative, monotone per-task memory model (batch size → peak MiB);
//! - [`feasibility`]: the probability that a configuration does not run out of memory,
//!   learned from the search's own probes and the monotonicity of memory;
//! - [`gp`]: a Gaussian-process surrogate (Matérn-5/2, ARD, hyper-parameters by marginal
//!   likelihood);
//! - [`search`]: GP-LCB over the memory-feasible lattice of co-located batch sizes, with a
//!   stopping rule, hysteresis and re-opening, behind the [`search::Evaluator`] trait so the
//!   algorithm never knows where its observations come from;
//! - [`device_tuner`]: the tuner of one GPU as a clock-free, I/O-free state machine (task
//!   knowledge, the search over the residents' batch sizes, hysteresis, drift checks,
//!   co-location samples): events in, actions out, driven by the daemon and the simulator;
//! - [`daemon`] (feature `daemon`): the per-GPU tuner daemon driving a [`device_tuner`] over
//!   the state store.
//!
//! The benchmark of the search on Gavel's measurements and the memory model's evaluation
//! are in the `iadeep-eval` crate.

#[cfg(feature = "daemon")]
pub mod daemon;
pub mod degradation;
pub mod device_tuner;
pub mod error;
pub mod feasibility;
pub mod gp;
pub mod memory;
pub mod search;

pub use error::TunerError;
pub use iadeep_objective::stats;
