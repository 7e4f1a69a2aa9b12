//! The error of what the evaluation adds to the libraries.
//!
//! The predictor's and the tuner's evaluations fail only where the library they drive
//! fails (a parameter, a sample, a fit), so they return that library's error
//! (`PredictorError`, `TunerError`) unchanged; this type covers the rest.

/// Errors of the evaluation crate's own code.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The emulated job's measured data is unusable.
    #[error("emulated job: {0}")]
    Emulation(String),
}
