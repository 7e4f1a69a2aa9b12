//! All cross-crate integration tests, in one binary so the 2-core CI links once.

mod agent;
mod cluster_failover;
mod http;
mod kube_fake;
mod manifests;
mod placer;
mod predictor;
mod retention;
mod sim;
mod state_embedded;
mod state_etcd;
mod state_etcd_security;
mod tls;
mod tuner_daemon;

/// The runtime of tests that mix async calls with blocking threads: two workers,
/// as many as the CI machine has cores.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}
