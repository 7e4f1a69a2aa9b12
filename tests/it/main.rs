//! All cross-crate integration tests, in one binary so the 2-core CI links once.

mod agent;
mod http;
mod kube_fake;
mod manifests;
mod placer;
mod predictor;
mod sim;
mod state_embedded;
mod state_etcd;
mod tuner_daemon;
