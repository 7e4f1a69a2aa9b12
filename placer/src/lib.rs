//! The placement service of iadeep.
//!
//! An arriving task goes to the feasible device where it is predicted to add the
//! least performance degradation (Σ PD) — or waits, when waiting for a device to
//! free up is predicted to cost less. The decision ([`Placer::decide`], described
//! in [`policy`]) is a pure function over an in-memory [`ClusterView`], shared by
//! the daemon and the simulator. The [`PlacementService`] makes each placement real with
//! one state-store transaction that compares the device's residents record and its
//! residents' assignments with what the decision saw (concurrent ones on different
//! devices merged into one by its group commit), and reports
//! what it does to a [`PlacementEvents`] observer; [`ViewSync`] keeps the view
//! fresh from the store, and the [`reaper`] gives back what dead or never-started
//! tasks hold (deleting released tasks after their [`retention`]) and keeps the
//! store's history short ([`compaction`]). The [`eviction`] loop acts on the tuners'
//! cap breaches: it evicts the opportunistic co-runner a production job's slowdown is
//! blamed on most ([`choose_victim`], pure, shared with the simulator).
//!
//! Slowdowns come through the predictor's [`iadeep_predictor::SlowdownModel`] and
//! memory footprints through [`MemoryEstimator`], so the policy does not depend on
//! how they are estimated.
//!
//! # Features
//!
//! - `daemon`: what serves. `Daemon` runs the service over gRPC (with health and
//!   reflection) and serves the operators' HTTP endpoints with the Prometheus
//!   `PlacerMetrics`. Without it the crate is the core above and links no server,
//!   gRPC stubs or metrics library.
//! - `kubernetes` (implies `daemon`): the Kubernetes scheduler extender (`extender`),
//!   served by the daemon.

mod archive;
pub mod compaction;
mod error;
mod events;
mod every;
pub mod eviction;
mod group_commit;
mod model;
mod params;
pub mod pod_eviction;
pub mod policy;
pub mod reaper;
pub mod retention;
mod service;
mod sync;
mod validate;
mod view;

#[cfg(feature = "daemon")]
mod daemon;
#[cfg(feature = "kubernetes")]
pub mod extender;
#[cfg(feature = "daemon")]
mod grpc;
#[cfg(feature = "daemon")]
mod metrics;

pub use error::{PlacerError, Result};
pub use events::{EvictionTrigger, NoEvents, PlacementEvent, PlacementEvents};
pub use model::{MemoryEstimator, ModelledMemory};
pub use params::{DEFAULT_AVOID_PAIRING_FOR, PlacerParams};
pub use policy::evict::{Victim, blame, choose_victim};
pub use policy::{
    Assessment, Candidate, Decision, ObservedWait, Placer, Rejection, Shrink, Verdict, WaitModel,
};
pub use service::{Clock, PlaceOutcome, PlacementService};
pub use sync::ViewSync;
pub use view::{
    ClusterView, DeadResident, DeadUnreserved, DeviceState, DeviceSummary, Resident,
    UnreservedRunning, UnstartedResident, WaitingTask, profile_of,
};

#[cfg(feature = "daemon")]
pub use daemon::{Daemon, DaemonConfig};
#[cfg(feature = "daemon")]
pub use grpc::{RETRY_PUSHBACK_MS, retry_pushback};
#[cfg(feature = "daemon")]
pub use metrics::{Counter, Gauge, Histogram, PlacerMetrics};
