//! The one error type of the agent crate.

use std::time::Duration;

/// What can go wrong setting up or ending an agent.
///
/// Nothing on the training hot path returns an error: once an agent is
/// connected, store trouble is logged and retried in the background, because an
/// unreachable store must never stop training.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The builder was given values that cannot work together.
    #[error("invalid agent configuration: {0}")]
    InvalidConfig(String),

    /// The state store refused the agent in a way retrying cannot fix
    /// (malformed URL, unopenable embedded file, bad task id).
    #[error("state store: {0}")]
    Store(#[from] iadeep_state::StateError),

    /// The background reporter could not be started.
    #[error("cannot start the agent's reporter thread: {0}")]
    Spawn(#[source] std::io::Error),

    /// `finish()` could not confirm that the task was marked finished and its
    /// lease revoked; the task's keys then disappear when the lease expires.
    #[error("task could not be marked finished within {timeout:?}: {reason}")]
    FinishIncomplete { timeout: Duration, reason: String },

    /// `leave()` could not confirm that its last report was written and its lease
    /// revoked (it does not mark the task finished); the task's keys then disappear
    /// when the lease expires.
    #[error(
        "could not leave the task cleanly (tried for at most {timeout:?}): {reason}; its keys go \
         when its lease expires"
    )]
    LeaveIncomplete { timeout: Duration, reason: String },
}

/// Shorthand used throughout the crate.
pub type Result<T, E = AgentError> = std::result::Result<T, E>;
