//! The one error type of the placer crate.

use iadeep_state::StateError;

/// Everything that can go wrong placing or releasing a task.
#[derive(Debug, thiserror::Error)]
pub enum PlacerError {
    /// A request is malformed; `field` names the offending field so the caller can fix it.
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: String, reason: String },

    /// A parameter of the policy is out of range (see [`PlacerParams::check`](crate::PlacerParams::check)).
    #[error("invalid placer parameter {name}: {reason}")]
    InvalidParams { name: &'static str, reason: String },

    /// The state store failed; nothing was reserved, or the reservation is unknown.
    #[error("state store: {0}")]
    Store(#[from] StateError),

    /// The compare-and-swap kept losing to concurrent writers.
    #[error(
        "could not reserve a device for task {task_id} after {attempts} attempts: \
         concurrent placements kept changing the chosen devices"
    )]
    Contention { task_id: String, attempts: u32 },

    /// The task already holds a reservation (place it once, release it to move it).
    #[error("task {task_id} is already placed on device {device_id}")]
    AlreadyPlaced { task_id: String, device_id: String },

    /// The Kubernetes client could not be set up.
    #[cfg(feature = "daemon")]
    #[error("{what}: {reason}")]
    Kubernetes { what: String, reason: String },

    /// A network listener could not be bound or served.
    #[cfg(feature = "daemon")]
    #[error("{what} on {addr}: {reason}")]
    Serve {
        what: &'static str,
        addr: String,
        reason: String,
    },
}

impl PlacerError {
    /// Shorthand for [`PlacerError::InvalidArgument`].
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> PlacerError {
        PlacerError::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Shorthand used throughout the crate.
pub type Result<T, E = PlacerError> = std::result::Result<T, E>;
