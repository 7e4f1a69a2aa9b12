//! The one error type of the tuner crate.

/// Everything that can go wrong in the tuner's algorithms.
#[derive(Debug, thiserror::Error)]
pub enum TunerError {
    /// A caller passed a value outside its domain (the message names it).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// Parameters failed their `check()`.
    #[error("invalid parameters: {0}")]
    InvalidParams(String),
    /// A numerical step failed even after the usual remedies (e.g. jitter for Cholesky).
    #[error("numerical failure: {0}")]
    Numerical(String),
    /// There is no feasible configuration to try.
    #[error("no feasible configuration: {0}")]
    NoFeasibleConfiguration(String),
    /// The objective rejected its input (the message names the value).
    #[error(transparent)]
    Objective(#[from] iadeep_objective::ObjectiveError),
    /// The state store failed (the message names the key or operation).
    #[cfg(feature = "daemon")]
    #[error(transparent)]
    State(#[from] iadeep_state::StateError),
    /// The tuner daemon cannot run as configured (e.g. no device memory known).
    #[error("tuner daemon: {0}")]
    Daemon(String),
}

/// Result alias of the crate.
pub type Result<T> = std::result::Result<T, TunerError>;
