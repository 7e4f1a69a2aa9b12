//! Test helpers shared by every crate's tests (feature `test-util`).
//!
//! - [`EtcdServer`]: a real etcd (Debian's `etcd-server`) on free loopback ports
//!   with a temporary data directory, stopped on drop.
//! - [`conformance`]: the backend-independent suite both stores must pass.

pub mod conformance;
mod etcd_server;

pub use etcd_server::EtcdServer;
