//! All cross-crate integration tests, in one binary so the 2-core CI links once.

mod agent;
mod cluster_failover;
mod fixtures;
mod http;
mod kube_fake;
mod manifests;
mod placer;
mod placer_decide;
mod placer_evict;
mod pod_evict;
mod predictor;
mod retention;
mod sim;
mod state_embedded;
mod state_etcd;
mod state_etcd_security;
mod store_scale;
mod tls;
mod tuner_daemon;
