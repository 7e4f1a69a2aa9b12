//! The one error type of the predictor crate.

/// Errors of the predictor.
#[derive(Debug, thiserror::Error)]
pub enum PredictorError {
    /// A parameter struct failed its `check()`.
    #[error("invalid parameter {name}: {reason}")]
    InvalidParam { name: &'static str, reason: String },
    /// A sample cannot be learned from (e.g. a non-positive step time or slowdown).
    #[error("invalid sample: {0}")]
    InvalidSample(String),
    /// Fitting a model failed (rows that do not line up, or non-finite values).
    #[error("fitting the forest failed: {0}")]
    Fit(String),
    /// Nothing to learn from.
    #[error("no training samples")]
    NoSamples,
    /// Reading a samples file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// The background refit thread could not be started.
    #[error("cannot start the refit thread: {0}")]
    Thread(std::io::Error),
}
