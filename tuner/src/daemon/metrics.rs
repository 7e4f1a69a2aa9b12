//! Metrics of the tuner daemon, served at `GET /metrics` with `/healthz` and
//! `/readyz` (see [`iadeep_ops`]).
//!
//! The control loop writes plain atomics (one relaxed add or store per event); the
//! Prometheus library reads them at scrape time through [`TunerCollector`], which
//! exports every device of the process (one tuner process may run one daemon per
//! GPU) under its `device` label, next to the process and build-info metrics.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{CounterVec, GaugeVec, Opts, Registry};

use crate::error::{Result, TunerError};

/// The daemon's counters and gauges.
#[derive(Debug, Default)]
pub struct Metrics {
    /// Rounds whose Σ PD (or out-of-memory) was observed.
    pub rounds: AtomicU64,
    /// Rounds dropped: a task did not report in time, or the round was not written because
    /// the store changed since it was decided.
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
    /// Breaches reported to the placer ([`crate::Action::CapBreached`]).
    pub cap_breaches: AtomicU64,
    /// Milliseconds production jobs ran measured above their caps (job-time: two jobs
    /// above their caps for a second add two).
    pub above_cap_ms: AtomicU64,
    /// Each resident's last measured PD: (task, class, PD). Replaced whole after every
    /// step, so a task that left has no series.
    task_pds: Mutex<Vec<(String, &'static str, f64)>>,
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

    /// Replaces the residents' last measured PDs (task, class, PD).
    pub fn set_task_pds(&self, pds: Vec<(String, &'static str, f64)>) {
        // A poisoned lock only means a panic elsewhere mid-write of plain data.
        *self.task_pds.lock().unwrap_or_else(|e| e.into_inner()) = pds;
    }

    /// The residents' last measured PDs (task, class, PD).
    pub fn task_pds(&self) -> Vec<(String, &'static str, f64)> {
        self.task_pds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Adds one to a counter.
    pub fn inc(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition (format 0.0.4) of this device's metrics alone.
    pub fn render(self: &Arc<Self>, device: &str) -> String {
        let registry = Registry::new();
        iadeep_ops::register(
            &registry,
            Box::new(TunerCollector::new(vec![(device.to_owned(), self.clone())])),
        );
        iadeep_ops::encode(&registry)
    }
}

/// Whether a row is a counter or a gauge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
}

type Read = fn(&Metrics) -> f64;

/// Every exported metric: name, kind, help, how to read it.
const ROWS: [(&str, Kind, &str, Read); 12] = [
    (
        "iadeep_tuner_rounds_total",
        Kind::Counter,
        "Closed-loop rounds observed.",
        |m| load(&m.rounds),
    ),
    (
        "iadeep_tuner_rounds_dropped_total",
        Kind::Counter,
        "Rounds dropped (a task did not report in time, or the store changed before the round was written).",
        |m| load(&m.rounds_dropped),
    ),
    (
        "iadeep_tuner_out_of_memory_total",
        Kind::Counter,
        "Configurations that ran out of GPU memory.",
        |m| load(&m.out_of_memory),
    ),
    (
        "iadeep_tuner_assignments_total",
        Kind::Counter,
        "Batch-size assignments written.",
        |m| load(&m.assignments),
    ),
    (
        "iadeep_tuner_samples_total",
        Kind::Counter,
        "Co-location samples written.",
        |m| load(&m.samples),
    ),
    (
        "iadeep_tuner_errors_total",
        Kind::Counter,
        "Errors of the control loop.",
        |m| load(&m.errors),
    ),
    (
        "iadeep_tuner_resident_tasks",
        Kind::Gauge,
        "Tasks resident on the device.",
        |m| load(&m.residents),
    ),
    (
        "iadeep_tuner_round",
        Kind::Gauge,
        "Last assignment round.",
        |m| load(&m.round),
    ),
    (
        "iadeep_tuner_sum_pd",
        Kind::Gauge,
        "Last measured summed performance degradation (NaN before the first).",
        Metrics::sum_pd,
    ),
    (
        "iadeep_tuner_settled",
        Kind::Gauge,
        "1 when the search has settled on a configuration.",
        |m| load(&m.settled),
    ),
    (
        "iadeep_tuner_above_cap_seconds_total",
        Kind::Counter,
        "Seconds production jobs on the device ran measured above their slowdown caps (job-seconds).",
        |m| load(&m.above_cap_ms) / 1000.0,
    ),
    (
        "iadeep_tuner_cap_breaches_total",
        Kind::Counter,
        "Breaches reported to the placer: a production job above its cap with every opportunistic co-runner at its smallest size.",
        |m| load(&m.cap_breaches),
    ),
];

/// The per-task family: each resident's last measured PD.
const TASK_PD: (&str, &str) = (
    "iadeep_tuner_task_pd",
    "Last measured performance degradation (PD = IF·DT/E) of each resident task, by priority class.",
);

fn task_pd_family() -> prometheus::Result<GaugeVec> {
    GaugeVec::new(
        Opts::new(TASK_PD.0, TASK_PD.1),
        &["device", "task", "class"],
    )
}

fn load(a: &AtomicU64) -> f64 {
    a.load(Ordering::Relaxed) as f64
}

/// One metric family of [`ROWS`], labelled by device.
#[derive(Clone, Debug)]
enum Family {
    Counter(CounterVec),
    Gauge(GaugeVec),
}

impl Family {
    fn new(name: &str, kind: Kind, help: &str) -> prometheus::Result<Family> {
        let opts = Opts::new(name, help);
        Ok(match kind {
            Kind::Counter => Family::Counter(CounterVec::new(opts, &["device"])?),
            Kind::Gauge => Family::Gauge(GaugeVec::new(opts, &["device"])?),
        })
    }

    fn collector(&self) -> &dyn Collector {
        match self {
            Family::Counter(c) => c,
            Family::Gauge(g) => g,
        }
    }
}

/// Reads the atomics of every tuner daemon of the process at scrape time.
#[derive(Debug)]
pub struct TunerCollector {
    devices: Vec<(String, Arc<Metrics>)>,
    /// Templates: their descriptions are what this collector declares.
    templates: Vec<Family>,
    task_pd: Option<GaugeVec>,
}

impl TunerCollector {
    /// A collector of `devices` (device id, its daemon's metrics).
    pub fn new(devices: Vec<(String, Arc<Metrics>)>) -> TunerCollector {
        let templates = ROWS
            .iter()
            .filter_map(|&(name, kind, help, _)| Family::new(name, kind, help).ok())
            .collect();
        TunerCollector {
            devices,
            templates,
            task_pd: task_pd_family().ok(),
        }
    }
}

impl Collector for TunerCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.templates
            .iter()
            .flat_map(|f| f.collector().desc())
            .chain(self.task_pd.iter().flat_map(|g| g.desc()))
            .collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut out = Vec::with_capacity(ROWS.len());
        for &(name, kind, help, read) in &ROWS {
            let Ok(family) = Family::new(name, kind, help) else {
                continue;
            };
            for (device, metrics) in &self.devices {
                let value = read(metrics);
                match &family {
                    Family::Counter(c) => c.with_label_values(&[device]).inc_by(value),
                    Family::Gauge(g) => g.with_label_values(&[device]).set(value),
                }
            }
            out.extend(family.collector().collect());
        }
        if let Ok(family) = task_pd_family() {
            for (device, metrics) in &self.devices {
                for (task, class, pd) in metrics.task_pds() {
                    family.with_label_values(&[device, &task, class]).set(pd);
                }
            }
            out.extend(family.collect());
        }
        out
    }
}

/// Binds `addr` and serves `/metrics` (this device), `/healthz` and `/readyz` (always
/// ready) over plain HTTP until the returned task is aborted.
pub async fn serve(
    addr: SocketAddr,
    device: String,
    metrics: Arc<Metrics>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    serve_all(
        addr,
        vec![(device, metrics)],
        Arc::new(|| Box::pin(async { Ok(()) })),
        None,
    )
    .await
}

/// Binds `addr` and serves `/metrics` for every device of the process (with the
/// process and build-info metrics), `/healthz`, and `/readyz` from `ready`, over
/// HTTPS with `tls` (else plain HTTP), until the returned task is aborted.
pub async fn serve_all(
    addr: SocketAddr,
    devices: Vec<(String, Arc<Metrics>)>,
    ready: iadeep_ops::ReadyCheck,
    tls: Option<iadeep_ops::tls::ServerTls>,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| TunerError::Daemon(format!("cannot listen for metrics on {addr}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| TunerError::Daemon(format!("metrics listener address: {e}")))?;
    let registry = iadeep_ops::registry("tuner");
    iadeep_ops::register(&registry, Box::new(TunerCollector::new(devices)));
    let app = iadeep_ops::router(iadeep_ops::scrape(registry), ready);
    tracing::info!(%bound, tls = ?tls, "serving /metrics, /healthz and /readyz");
    let task = tokio::spawn(async move {
        let forever = std::future::pending();
        if let Err(err) = iadeep_ops::tls::serve_http(listener, app, tls.as_ref(), forever).await {
            tracing::error!(%err, "metrics server stopped");
        }
    });
    Ok((bound, task))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_task_pd_series_follow_the_residents() {
        let m = Arc::new(Metrics::default());
        m.set_task_pds(vec![
            ("p".into(), "production", 1.25),
            ("o".into(), "opportunistic", 1.5),
        ]);
        m.above_cap_ms.store(2500, Ordering::Relaxed);
        Metrics::inc(&m.cap_breaches);
        let text = m.render("d");
        for line in [
            "iadeep_tuner_task_pd{class=\"production\",device=\"d\",task=\"p\"} 1.25",
            "iadeep_tuner_task_pd{class=\"opportunistic\",device=\"d\",task=\"o\"} 1.5",
            "iadeep_tuner_above_cap_seconds_total{device=\"d\"} 2.5",
            "iadeep_tuner_cap_breaches_total{device=\"d\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from {text}");
        }
        // The task that left has no series any more.
        m.set_task_pds(vec![("p".into(), "production", 1.0)]);
        let text = m.render("d");
        assert!(!text.contains("task=\"o\""), "{text}");
        assert!(text.contains("task=\"p\"} 1\n"), "{text}");
    }

    #[test]
    fn renders_every_metric_with_the_device_label() {
        let m = Arc::new(Metrics::default());
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
        assert_eq!(text.matches("# TYPE").count(), 12, "{text}");
        // No resident measured: no per-task series.
        assert!(!text.contains("iadeep_tuner_task_pd{"), "{text}");
        assert!(
            Arc::new(Metrics::default())
                .render("d")
                .contains("iadeep_tuner_sum_pd{device=\"d\"} NaN")
        );
    }
}
