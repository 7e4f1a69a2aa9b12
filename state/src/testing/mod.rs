//! Test helpers shared by every crate's tests (feature `test-util`).
//!
//! - [`EtcdServer`]: a real etcd (Debian's `etcd-server`) on free loopback ports
//!   with a temporary data directory, stopped on drop; optionally over TLS
//!   ([`ServerTls`]) and with authentication turned on ([`EtcdServer::enable_auth`]).
//! - [`EtcdCluster`]: three real etcd members, to kill and restart one at a time.
//! - [`Pki`]: a CA and the server and client certificates it signed, for TLS tests.
//! - [`conformance`]: the backend-independent suite both stores must pass.

pub mod conformance;
mod etcd_server;
mod pki;

pub use etcd_server::{EtcdCluster, EtcdServer, ServerTls};
pub use pki::Pki;
