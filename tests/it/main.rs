//! All cross-crate integration tests, in one binary so the 2-core CI links once.

mod agent;
mod cluster_failover;
mod placer;
mod predictor;
mod sim;
mod state_embedded;
mod state_etcd;
mod state_etcd_security;
mod tuner_daemon;
