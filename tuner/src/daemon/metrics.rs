//! Prometheus text metrics of the tuner daemon, served at `GET /metrics`.
//!
//! Plain atomics rather than a metrics library: a handful of counters and gauges, read by
//! one scrape endpoint, written by one control loop.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Result, TunerError};

/// The daemon's counters and gauges.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Rounds whose Σ PD (or out-of-memory) was observed.
    pub rounds: AtomicU64,
    /// Rounds dropped: a task did not report in time or the residents changed.
    pub rounds_dropped: AtomicU64,
    /// Configurations that ran out of memory.
    pub out_of_memory: AtomicU64,
    /// Assignments written (one per task per round).
    pub assignments: AtomicU64,
    /// Co-location samples written.
    pub samples: AtomicU64,
    /// Errors (store failures, bad reports, numerical failures).
    pub errors: AtomicU64,
    /// Tasks resident on the device now.
    pub residents: AtomicU64,
    /// Last assignment round.
    pub round: AtomicU64,
    /// Last measured Σ PD, as f64 bits.
    sum_pd_bits: AtomicU64,
    /// 1 when the search has settled.
    pub settled: AtomicU64,
}

impl Metrics {
    /// Sets the last measured Σ PD.
    pub fn set_sum_pd(&self, v: f64) {
        self.sum_pd_bits.store(v.to_bits(), Ordering::Relaxed);
    }

    /// The last measured Σ PD (NaN before the first).
    pub fn sum_pd(&self) -> f64 {
        let bits = self.sum_pd_bits.load(Ordering::Relaxed);
        if bits == 0 {
            f64::NAN
        } else {
            f64::from_bits(bits)
        }
    }

    /// Adds one to a counter.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition (format 0.0.4) of every metric, labelled with the device.
    pub fn render(&self, device: &str) -> String {
        let mut out = String::new();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let rows: [(&str, &str, &str, String); 10] = [
            (
                "iadeep_tuner_rounds_total",
                "counter",
                "Closed-loop rounds observed.",
                get(&self.rounds).to_string(),
            ),
            (
                "iadeep_tuner_rounds_dropped_total",
                "counter",
                "Rounds dropped (a task did not report in time, or the residents changed).",
                get(&self.rounds_dropped).to_string(),
            ),
            (
                "iadeep_tuner_out_of_memory_total",
                "counter",
                "Configurations that ran out of GPU memory.",
                get(&self.out_of_memory).to_string(),
            ),
            (
                "iadeep_tuner_assignments_total",
                "counter",
                "Batch-size assignments written.",
                get(&self.assignments).to_string(),
            ),
            (
                "iadeep_tuner_samples_total",
                "counter",
                "Co-location samples written.",
                get(&self.samples).to_string(),
            ),
            (
                "iadeep_tuner_errors_total",
                "counter",
                "Errors of the control loop.",
                get(&self.errors).to_string(),
            ),
            (
                "iadeep_tuner_resident_tasks",
                "gauge",
                "Tasks resident on the device.",
                get(&self.residents).to_string(),
            ),
            (
                "iadeep_tuner_round",
                "gauge",
                "Last assignment round.",
                get(&self.round).to_string(),
            ),
            (
                "iadeep_tuner_sum_pd",
                "gauge",
                "Last measured summed performance degradation.",
                format_f64(self.sum_pd()),
            ),
            (
                "iadeep_tuner_settled",
                "gauge",
                "1 when the search has settled on a configuration.",
                get(&self.settled).to_string(),
            ),
        ];
        for (name, kind, help, value) in rows {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name}{{device=\"{}\"}} {value}", escape(device));
        }
        out
    }
}

fn format_f64(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else {
        format!("{v}")
    }
}

/// Label values escape backslash, quote and newline (Prometheus text format).
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Binds `addr` and serves `/metrics` until the returned task is aborted.
pub async fn serve(
    addr: SocketAddr,
    device: String,
    metrics: Arc<Metrics>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| TunerError::Daemon(format!("cannot listen for metrics on {addr}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| TunerError::Daemon(format!("metrics listener address: {e}")))?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let body = metrics.render(&device);
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    body,
                )
            }
        }),
    );
    tracing::info!(%bound, "serving Prometheus metrics at /metrics");
    let task = tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::error!(%err, "metrics server stopped");
        }
    });
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_metric_with_the_device_label() {
        let m = Metrics::default();
        Metrics::inc(&m.rounds);
        m.set_sum_pd(2.5);
        let text = m.render("gpu\"0");
        assert!(
            text.contains("iadeep_tuner_rounds_total{device=\"gpu\\\"0\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("iadeep_tuner_sum_pd{device=\"gpu\\\"0\"} 2.5"),
            "{text}"
        );
        assert_eq!(text.matches("# TYPE").count(), 10);
        assert!(
            Metrics::default()
                .render("d")
                .contains("iadeep_tuner_sum_pd{device=\"d\"} NaN")
        );
    }
}
