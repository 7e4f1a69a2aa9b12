//! Trace-driven GPU-cluster simulator: measured ground truth ([`world`]), an arrival
//! stream from the Philly trace ([`workload`]), emulated agents and a discrete-event
//! [`engine`], and scheduling [`policy`]s compared on the same stream ([`metrics`],
//! [`report`]).

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
