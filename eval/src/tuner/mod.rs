//! Evaluation of the batch-size tuner (`iadeep-tuner`).
//!
//! - [`gavel_bench`]: GP-LCB against random search on the Σ PD surfaces Gavel's
//!   measured co-location throughputs give;
//! - [`memory_eval`]: the memory model's upper bound against measured peaks, next
//!   to a cubic baseline.

pub mod gavel_bench;
pub mod memory_eval;
