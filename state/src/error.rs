//! The one error type of the state crate.

use std::time::Duration;

use crate::ids::{LeaseId, Revision};

/// Everything that can go wrong talking to a state store.
///
/// Variants name the key, the lease or the endpoint involved, because an operator
/// reading a log line must be able to act on it without a debugger.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The store URL could not be understood.
    #[error("invalid store URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },

    /// An etcd cluster could not be reached (connect, DNS, refused, timed out).
    #[error("etcd at {endpoints} is unreachable: {reason}")]
    Unavailable { endpoints: String, reason: String },

    /// The embedded store file could not be opened or written.
    #[error("embedded store {path}: {reason}")]
    Embedded { path: String, reason: String },

    /// A request to the store failed after it was sent.
    #[error("{op} on {target} failed: {reason}")]
    Backend {
        op: &'static str,
        target: String,
        reason: String,
    },

    /// A stored value is not what its key says it is.
    #[error("value at key {key:?} does not decode as {expected}: {reason}")]
    Decode {
        key: String,
        expected: &'static str,
        reason: String,
    },

    /// A key or stored record is malformed (not UTF-8, unreadable record header, ...).
    #[error("corrupt record at key {key:?}: {reason}")]
    Corrupt { key: String, reason: String },

    /// An identifier (task or device id) cannot be used in the key layout.
    #[error("invalid {kind} id {id:?}: {reason}")]
    InvalidId {
        kind: &'static str,
        id: String,
        reason: &'static str,
    },

    /// The lease does not exist any more (expired or revoked).
    #[error("lease {0} not found (expired or revoked)")]
    LeaseNotFound(LeaseId),

    /// A transaction the store cannot apply as asked (e.g. one key written twice).
    #[error("invalid transaction: {reason}")]
    InvalidTxn { reason: String },

    /// A lease TTL the store cannot represent.
    #[error("invalid lease TTL {0:?}: must be between 1 s and 1 year")]
    InvalidTtl(Duration),

    /// A watch asked for history the store no longer keeps.
    #[error("watch on {prefix:?} from revision {requested} is too old: history starts at {oldest}")]
    Compacted {
        prefix: String,
        requested: Revision,
        oldest: Revision,
    },
}

/// Shorthand used throughout the crate.
pub type Result<T, E = StateError> = std::result::Result<T, E>;
