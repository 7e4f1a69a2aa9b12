//! What every iadeep daemon serves to its operators over HTTP, defined once:
//!
//! - `GET /metrics`: Prometheus text format (0.0.4) from a [`prometheus::Registry`]
//!   that also carries the standard `process_*` metrics (CPU, memory, open file
//!   descriptors, start time; Linux) and `iadeep_build_info{component, version}`;
//! - `GET /healthz`: liveness, 200 while the process serves HTTP at all;
//! - `GET /readyz`: readiness, 200 when the daemon's [`ReadyCheck`] passes (for the
//!   daemons, the state store answers), 503 with the reason otherwise.
//!
//! Kubernetes probes, Prometheus and load balancers all speak these, so the
//! manifests in `deploy/` need no daemon-specific knowledge.
//!
//! [`tls`] serves these (and the placer's other servers) over TLS when asked.

pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use futures::future::BoxFuture;
use iadeep_state::StateStore;
use prometheus::{Encoder, IntGaugeVec, Opts, Registry, TextEncoder};

/// Decides readiness: `Err(reason)` when the daemon should get no traffic.
pub type ReadyCheck = Arc<dyn Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// Produces the `/metrics` body (for daemons that refresh gauges before a scrape).
pub type Scrape = Arc<dyn Fn() -> String + Send + Sync>;

/// Longest a readiness probe waits for the store.
pub const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// A registry with the process metrics and `iadeep_build_info{component}` = 1.
pub fn registry(component: &str) -> Registry {
    let registry = Registry::new();
    let build = IntGaugeVec::new(
        Opts::new(
            "iadeep_build_info",
            "Always 1; the labels say which iadeep component and version runs.",
        ),
        &["component", "version"],
    );
    match build {
        Ok(build) => {
            build
                .with_label_values(&[component, env!("CARGO_PKG_VERSION")])
                .set(1);
            register(&registry, Box::new(build));
        }
        Err(err) => tracing::warn!(%err, "cannot create the build-info metric"),
    }
    #[cfg(target_os = "linux")]
    register(
        &registry,
        Box::new(prometheus::process_collector::ProcessCollector::for_self()),
    );
    registry
}

/// Registers `collector`; a failure (a programming error: two metrics of one name)
/// is logged, never fatal to a daemon.
pub fn register(registry: &Registry, collector: Box<dyn prometheus::core::Collector>) {
    if let Err(err) = registry.register(collector) {
        tracing::warn!(%err, "cannot register a metric");
    }
}

/// The registry's metrics in the text format.
pub fn encode(registry: &Registry) -> String {
    let mut buffer = Vec::new();
    if let Err(err) = TextEncoder::new().encode(&registry.gather(), &mut buffer) {
        tracing::warn!(%err, "cannot encode metrics");
    }
    String::from_utf8_lossy(&buffer).into_owned()
}

/// A scrape of `registry` as it is.
pub fn scrape(registry: Registry) -> Scrape {
    Arc::new(move || encode(&registry))
}

/// Ready while `store` answers a read within [`READY_TIMEOUT`].
pub fn store_ready(store: Arc<dyn StateStore>) -> ReadyCheck {
    Arc::new(move || {
        let store = store.clone();
        Box::pin(async move {
            match tokio::time::timeout(READY_TIMEOUT, store.get(iadeep_state::keys::ROOT)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(err)) => Err(format!("state store {}: {err}", store.describe())),
                Err(_) => Err(format!(
                    "state store {} did not answer within {READY_TIMEOUT:?}",
                    store.describe()
                )),
            }
        })
    })
}

/// `/metrics`, `/healthz` and `/readyz`.
pub fn router(scrape: Scrape, ready: ReadyCheck) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let body = scrape();
                async move { ([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], body) }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let check = ready();
                async move {
                    match check.await {
                        Ok(()) => (StatusCode::OK, "ready\n".to_owned()).into_response(),
                        Err(reason) => {
                            tracing::debug!(%reason, "not ready");
                            (
                                StatusCode::SERVICE_UNAVAILABLE,
                                format!("not ready: {reason}\n"),
                            )
                                .into_response()
                        }
                    }
                }
            }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_carries_build_and_process_metrics() {
        let text = encode(&registry("test"));
        assert!(
            text.contains(&format!(
                "iadeep_build_info{{component=\"test\",version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            )),
            "{text}"
        );
        #[cfg(target_os = "linux")]
        assert!(text.contains("process_resident_memory_bytes"), "{text}");
    }
}
