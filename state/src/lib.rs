//! The cluster-state store of iadeep.
//!
//! One trait, [`StateStore`], with two backends that pass one conformance suite:
//! `EtcdStore` for clusters and [`EmbeddedStore`], a single redb file (or
//! memory) for one machine with no server. [`keys`] is the key layout,
//! [`typed`] reads and writes protobuf values with errors that name the key,
//! [`StoreUrl`] picks a backend from what an operator typed, [`Follow`] keeps a
//! component current with a prefix (range, then watch, and read again when a watch is
//! lost), and [`append_sample`] and [`load_samples`] keep the predictor's co-location
//! samples.
//!
//! The etcd backend (and with it the etcd client and tonic) is the default feature
//! `etcd`; without it a build has the embedded store only, still parses `etcd://`
//! URLs and refuses to open them. The simulator is built so.

mod embedded;
mod error;
#[cfg(feature = "etcd")]
mod etcd;
mod etcd_config;
pub mod etcd_program;
mod follow;
mod ids;
pub mod keys;
mod lease;
pub mod registry;
mod samples;
mod store;
pub mod typed;
mod url;

#[cfg(feature = "test-util")]
pub mod testing;

pub use embedded::{DEFAULT_HISTORY_REVISIONS, EmbeddedStore, data_dir as embedded_data_dir};
pub use error::{Result, StateError};
#[cfg(feature = "etcd")]
pub use etcd::{EtcdStore, FAILOVER_BOUND};
pub use etcd_config::{EtcdConfig, EtcdCredentials, EtcdTls};
pub use follow::{Backoff, Follow, Followed};
pub use lease::{LeaseHealth, LeaseKeeper};
pub use samples::{append_sample, load_samples};
pub use store::{
    CasOutcome, DEFAULT_PAGE_SIZE, Expect, KeyValue, LeaseId, MIN_LEASE_TTL, RangePage,
    RangeSnapshot, Revision, StateStore, Txn, TxnCompare, TxnOp, TxnOutcome, WatchEvent,
    WatchStream,
};
pub use url::StoreUrl;
