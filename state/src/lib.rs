//! The cluster-state store of iadeep.
//!
//! One trait, [`StateStore`], with two backends that pass one conformance suite:
//! [`EtcdStore`] for clusters and [`EmbeddedStore`], a single redb file (or
//! memory) for one machine with no server. [`keys`] is the key layout,
//! [`typed`] reads and writes protobuf values with errors that name the key, and
//! [`StoreUrl`] picks a backend from what an operator typed.

mod embedded;
mod error;
mod etcd;
pub mod etcd_program;
mod ids;
pub mod keys;
mod lease;
pub mod registry;
mod store;
pub mod typed;
mod url;

#[cfg(feature = "test-util")]
pub mod testing;

pub use embedded::{EmbeddedStore, data_dir as embedded_data_dir};
pub use error::{Result, StateError};
pub use etcd::{EtcdConfig, EtcdCredentials, EtcdStore, EtcdTls, FAILOVER_BOUND};
pub use lease::{LeaseHealth, LeaseKeeper};
pub use store::{
    CasOutcome, Expect, KeyValue, LeaseId, MIN_LEASE_TTL, RangeSnapshot, Revision, StateStore, Txn,
    TxnCompare, TxnOp, TxnOutcome, WatchEvent, WatchStream,
};
pub use url::StoreUrl;
