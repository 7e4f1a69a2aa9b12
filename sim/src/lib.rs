//! Trace-driven GPU-cluster simulator (issue 7): every scheduling policy on the same
//! job stream, over a world built only from measurements, with emulated agents as the
//! policies' only window on it.
//!
//! Module map, one idea each:
//! - [`world`]: the ground truth (Gavel throughputs and the contention model for 3+ jobs, the
//!   memory model fitted to Gavel's failed pairs, Pollux noise-scale curves);
//! - [`workload`]: the arrival stream from the Philly trace (single-GPU jobs, load
//!   factor, seeded job types and memory requests);
//! - [`agent`]: what the emulated agents measure (noisy step times with stragglers, the
//!   gradient noise scale through the production estimator);
//! - [`view`]: what policies may see (specs, agent reports);
//! - [`engine`]: the discrete-event engine (arrivals, completions, tuning rounds,
//!   out-of-memory crashes and restarts at half the batch size);
//! - [`policy`]: the [`policy::Policy`] trait and one module per policy: exclusive FIFO,
//!   naive packing, utilisation-based, most-available-memory, the reference approach,
//!   and iadeep with its two ablations, which drive the real `iadeep_tuner` and
//!   `iadeep_predictor` code; iadeep's placement is the placer crate's own decision
//!   (`iadeep_placer::Placer::decide`, see [`policy::iadeep::placement`]) over a view
//!   kept in sync with the agents' reports;
//! - [`experiment`]: one world, one stream, many policies;
//! - [`metrics`], [`report`]: completion times, makespan, utilisation, crashes, tuning
//!   rounds, decision latency; table, CSV, JSON, SVG plots;
//! - [`audit`]: iadeep's placement decisions next to the world's truth (diagnosis);
//! - [`store_sink`]: a finished run written to a state store in iadeep's key layout.

pub mod agent;
pub mod audit;
pub mod engine;
pub mod error;
pub mod experiment;
pub mod metrics;
pub mod policy;
pub mod report;
pub mod store_sink;
pub mod view;
pub mod workload;
pub mod world;

pub use error::{Result, SimError};

#[cfg(test)]
mod tests;
