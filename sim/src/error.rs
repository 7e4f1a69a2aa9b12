//! The one error type of the simulator crate.

use iadeep_datasets::DatasetError;

/// Why a simulation could not be set up or its results not be written.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A bundled or user-supplied dataset could not be read.
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// The parameters make no sense (named field and reason).
    #[error("invalid simulation parameter {field}: {reason}")]
    InvalidParam { field: &'static str, reason: String },
    /// The data cannot support the requested simulation.
    #[error("unusable data: {0}")]
    Data(String),
    /// A policy name that does not exist.
    #[error("unknown policy {requested:?} (known: {known})")]
    UnknownPolicy { requested: String, known: String },
    /// Writing results failed.
    #[error("cannot write {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Drawing a plot failed.
    #[error("cannot draw {path}: {reason}")]
    Plot { path: String, reason: String },
    /// The state store refused a write.
    #[error(transparent)]
    Store(#[from] iadeep_state::StateError),
    /// A policy's component failed (predictor, tuner, placer).
    #[error("policy {policy}: {reason}")]
    Policy { policy: String, reason: String },
}

/// Result with [`SimError`].
pub type Result<T> = std::result::Result<T, SimError>;
