//! Test helpers shared by every crate's tests (feature `test-util`).
//!
//! - [`EtcdServer`]: a real etcd (Debian's `etcd-server`) on free loopback ports
//!   with a temporary data directory, stopped on drop; optionally over TLS
//!   ([`EtcdServerTls`]) and with authentication turned on ([`EtcdServer::enable_auth`]).
//! - [`EtcdCluster`]: three real etcd members, to kill and restart one at a time.
//! - [`Pki`]: a CA and the server and client certificates it signed, for TLS tests.
//! - [`conformance`]: the backend-independent suite both stores must pass.
//! - [`FaultStore`]: a store wrapper that fails, loses the answers of, re-sends or holds
//!   the calls a test scripts, and counts them.
//! - [`start_etcd`] and [`runtime`]: the two lines every store test starts with, once.
//! - [`free_ports`]: loopback ports free right now, all different, for processes a test
//!   starts on them.

pub mod conformance;
mod etcd_server;
mod fault_store;
mod pki;

pub use etcd_server::{EtcdCluster, EtcdServer, EtcdServerTls, free_ports};
pub use fault_store::{Fault, FaultStore, Op};
pub use pki::Pki;

/// A real etcd for one test; panics with etcd's own error (and the install hint) when
/// it cannot start, because a test cannot go on without its store.
pub fn start_etcd() -> EtcdServer {
    EtcdServer::start().unwrap_or_else(|err| panic!("{err}"))
}

/// The runtime of tests that mix async calls with blocking threads: two workers, as
/// many as the CI machine has cores.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|err| panic!("cannot build the test runtime: {err}"))
}
