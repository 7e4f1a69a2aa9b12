//! Trace-driven GPU-cluster simulator: every scheduling policy on the same
//! job stream, over a world built only from measurements, with emulated agents as the
//! policies' only window on it.
//!
//! Policies see what production would see: each job's spec as a user gives it to
//! `iadeep run` (model name, m0, allowed batch sizes, submit time, work; no solo
//! profile and no memory figure by default, [`JobInfo`], `--job-info`) and the
//! emulated agents' reports. Only the `oracle` reads the world.
//!
//! The API: an [`Experiment`] builds one world and one arrival stream from
//! [`ExperimentParams`] ([`WorkloadParams`], [`EngineParams`], [`Interference`],
//! [`Admission`], [`JobInfo`]), builds each [`Policy`] by name ([`POLICY_NAMES`]) and
//! runs it into [`RunMetrics`]; [`report`] turns the runs into a table, JSON, CSV and
//! plots, [`store_sink`] writes a run to a state store, and [`AuditRecord`] /
//! [`AuditSummary`] hold iadeep's placement decisions next to the truth.
//!
//! Inside, one module per idea:
//! - `world`: the ground truth (Gavel throughputs and the contention model for 3+ jobs,
//!   the memory model fitted to Gavel's failed pairs, Pollux noise-scale curves);
//! - `workload`: the arrival stream from the Philly trace (single-GPU jobs, load
//!   factor, seeded job types and memory requests, and each job's class: production
//!   with a slowdown cap, or opportunistic, `--production-fraction`);
//! - `agent`: what the emulated agents measure (noisy step times with stragglers, the
//!   gradient noise scale through the production estimator) and how a fenced agent falls
//!   back after an out-of-memory error (the real agent's rule);
//! - `view`: what policies may see (job specs, with a solo profile only under
//!   [`JobInfo::Profiled`], and agent reports, through the `PolicyView` trait);
//! - `engine`: the discrete-event engine (arrivals, completions, tuning rounds,
//!   fenced out-of-memory errors, which cost one job a step, unfenced crashes, which
//!   restart a job at half its batch size, and evictions, which cost a job its work since
//!   its last checkpoint);
//! - `policy`: the [`Policy`] trait and one module per policy: exclusive FIFO, `priority`
//!   (exclusive GPUs, production jobs first),
//!   naive packing, utilisation-based, most-available-memory, the reference approach,
//!   `pollux` (what the baselines make of specs and reports: `policy::solo`), and
//!   iadeep with its two ablations, which drive the real `iadeep_tuner` and
//!   `iadeep_predictor` code, and the oracles that replace some or all of iadeep's
//!   learned parts by the truth; iadeep's placement is the placer crate's own decision
//!   (`iadeep_placer::Placer::decide`, see `policy::iadeep::placement`) over a view
//!   kept in sync with the agents' reports, and its jobs' agents are fenced at their
//!   reservations;
//! - `experiment`: one world, one stream, many policies;
//! - `metrics`, [`report`]: completion times, makespan, utilisation, crashes and
//!   fenced out-of-memory errors, tuning rounds, decision latency, and per job class the
//!   completion times, the share of running time above the cap (by the world's PD) and
//!   the evictions with the work they cost; table, CSV, JSON, SVG plots;
//! - `audit`: iadeep's placement decisions next to the world's truth (diagnosis);
//! - [`Attribution`]: how much of the gap between iadeep and the oracle each single-part
//!   oracle (`oracle-prediction`, `-memory`, `-tuning`, `-wait`) closes;
//! - [`store_sink`]: a finished run written to a state store in iadeep's key layout.

mod agent;
mod attribution;
mod audit;
mod engine;
mod error;
mod experiment;
mod metrics;
mod policy;
pub mod report;
pub mod store_sink;
mod view;
mod workload;
mod world;

pub use attribution::{Attribution, GapShare};
pub use audit::{AuditCandidate, AuditRecord, AuditSummary, ErrorStats, Slowdowns};
pub use engine::EngineParams;
pub use error::{Result, SimError};
pub use experiment::{Experiment, ExperimentParams};
pub use metrics::{AboveCapWhere, ClassSummary, Classes, RunMetrics, Summary, TaskOutcome};
pub use policy::{Admission, POLICY_NAMES, Policy};
pub use view::JobInfo;
pub use workload::WorkloadParams;
pub use world::Interference;

#[cfg(test)]
mod class_tests;
#[cfg(test)]
mod tests;
