//! The store's identifiers: revisions and leases.
//!
//! They sit below both [`crate::store`] (whose values carry them) and
//! [`crate::error`] (whose errors name them), so neither module needs the other's
//! items for them; `store` re-exports them at their old paths.

use std::fmt;

/// A store-wide revision number. Every write produces a larger one.
pub type Revision = i64;

/// A lease: keys put with it are deleted when it expires or is revoked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}
