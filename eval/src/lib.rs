//! Offline evaluation of iadeep's components.
//!
//! What measures the libraries rather than runs in production lives here:
//! - [`predictor`]: the predictor's two evaluation splits (prequential over a
//!   shuffled stream, model families never seen), its baselines (a forest on
//!   one-hot job names, a plain forest on our features) and the converter of
//!   Gavel's measurements into co-location samples;
//! - [`tuner`]: the benchmark of the tuner's search on Gavel's measured
//!   co-location throughputs, and the evaluation of the memory model on measured
//!   peaks;
//! - [`SyntheticCluster`]: a seeded cluster of any size, load for the placer's
//!   benchmarks;
//! - [`EmulatedJob`]: a training job that follows measured (Pollux) step times;
//! - [`random`]: the one normal sampler of the evaluation and the simulator.
//!
//! None of it is in the libraries' API: the daemons and the agent never need it,
//! and keeping it apart keeps the measured data sets (and their readers) out of
//! what production links — the agent SDK, and so the Python wheel, in particular.
//! `iadeep tuner bench`, `memory eval`, `predictor eval`, `emulate-job`, `data
//! gavel-pairs`, the simulator and the benchmarks use it.

mod cluster;
mod emulate;
mod error;
pub mod predictor;
pub mod random;
pub mod tuner;

pub use cluster::{GPUS_PER_NODE, SyntheticCluster};
pub use emulate::EmulatedJob;
pub use error::EvalError;
pub use predictor::gavel::{GavelSamples, samples_from_gavel};
