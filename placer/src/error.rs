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

    /// Concurrent placements kept taking the devices this request chose: nothing was
    /// reserved, and asking again after `retry_after_ms` is the cure (gRPC UNAVAILABLE
    /// with that hint). `lost` counts the reservations the store refused because another
    /// commit got there first, `waits` the times the request waited behind another
    /// request committing on its chosen device (each means that other made progress).
    #[error(
        "could not reserve a device for task {task_id}: other placements kept taking the \
         devices it chose ({lost} reservation attempts lost, {waits} waits behind other \
         requests); nothing was reserved, retry after {retry_after_ms} ms"
    )]
    Contention {
        task_id: String,
        lost: u32,
        waits: u32,
        retry_after_ms: u64,
    },

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

    /// [`PlacerError::Contention`] for `task_id` after `lost` lost commits and `waits` waits.
    pub fn contention(task_id: impl Into<String>, lost: u32, waits: u32) -> PlacerError {
        let task_id = task_id.into();
        PlacerError::Contention {
            retry_after_ms: contention_retry_after_ms(&task_id),
            task_id,
            lost,
            waits,
        }
    }
}

/// How long a request that lost to concurrent placements is told to wait, ms: about
/// the time a burst of commits on the same devices takes to clear, spread over
/// [`CONTENTION_RETRY_MS`]..2×[`CONTENTION_RETRY_MS`] by the task id so that the
/// requests that lost together do not all come back together.
pub fn contention_retry_after_ms(task_id: &str) -> u64 {
    let spread = task_id
        .bytes()
        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
    CONTENTION_RETRY_MS + spread % CONTENTION_RETRY_MS
}

/// Least retry hint of [`PlacerError::Contention`], ms.
pub const CONTENTION_RETRY_MS: u64 = 100;

/// Shorthand used throughout the crate.
pub type Result<T, E = PlacerError> = std::result::Result<T, E>;
