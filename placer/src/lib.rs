//! The placement service of iadeep.
//!
//! An arriving task goes to the feasible device where it is predicted to add the
//! least performance degradation (Σ PD) — or waits, when waiting for a device to
//! free up is predicted to cost less. The decision ([`policy::Placer::decide`])
//! is a pure function over an in-memory [`view::ClusterView`], shared by the
//! daemon and the simulator; the daemon ([`daemon::Daemon`]) keeps the view
//! fresh from the store ([`sync`]), makes each placement real with a
//! compare-and-swap on the device's residents record ([`service`]), and serves
//! it over gRPC ([`grpc`]) and, with the `kubernetes` feature, as a Kubernetes
//! scheduler extender (`extender`).
//!
//! Slowdowns and memory footprints come through two small traits
//! ([`model::SlowdownModel`], [`model::MemoryEstimator`]) so the policy does not
//! depend on how they are estimated.

pub mod daemon;
pub mod error;
#[cfg(feature = "kubernetes")]
pub mod extender;
pub mod grpc;
pub mod metrics;
pub mod model;
pub mod params;
pub mod policy;
pub mod reaper;
pub mod retention;
pub mod service;
pub mod sync;
pub mod validate;
pub mod view;

// The unit tests that need a realistic fitted forest and a loaded cluster use the
// evaluation crate's Gavel converter and synthetic cluster. `iadeep-eval` depends on
// this crate, so the tests compile those two files in rather than depend on it (a
// second copy of this crate's types would not mix with `crate::`'s); the
// `iadeep_placer` name lets the cluster's imports resolve here too.
#[cfg(test)]
extern crate self as iadeep_placer;
#[cfg(test)]
#[path = "../../eval/src/predictor/gavel.rs"]
mod gavel;
#[cfg(test)]
#[allow(dead_code)] // the store seeding and counts are the CLI's and benchmarks'
#[path = "../../eval/src/cluster.rs"]
mod synthetic;

pub use daemon::{Daemon, DaemonConfig};
pub use error::{PlacerError, Result};
pub use model::{
    MemoryEstimator, ModelledMemory, PredictorSlowdown, SlowdownEstimate, SlowdownModel,
};
pub use params::PlacerParams;
pub use policy::{Decision, Placer, Rejection, Verdict};
pub use service::{Clock, PlaceOutcome, PlacementService};
pub use view::{
    ClusterView, DeadResident, DeviceState, Resident, UnreservedRunning, UnstartedResident,
    WaitingTask,
};
