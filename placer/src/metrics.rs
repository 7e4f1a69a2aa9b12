//! Prometheus metrics of the placer, rendered in the text exposition format.
//!
//! A handful of counters and histograms do not justify a metrics framework:
//! atomics, fixed buckets and one `render` keep the hot path to a few relaxed
//! atomic adds.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// The current count.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Upper bounds of the latency buckets, seconds: 50 µs to 2.5 s.
const LATENCY_BUCKETS_S: [f64; 14] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
    2.5,
];

/// A latency histogram with Prometheus' cumulative buckets.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS_S.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        if let Some(i) = LATENCY_BUCKETS_S.iter().position(|&le| secs <= le) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0;
        for (le, bucket) in LATENCY_BUCKETS_S.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// Everything the placer counts.
#[derive(Debug, Default)]
pub struct PlacerMetrics {
    /// Place requests answered "placed".
    pub placed: Counter,
    /// Place requests answered "queued".
    pub queued: Counter,
    /// Place requests refused as malformed.
    pub invalid: Counter,
    /// Place requests that failed (store errors, contention).
    pub failed: Counter,
    /// Reservations lost to a concurrent writer (each leads to a fresh decision).
    pub cas_conflicts: Counter,
    /// Places that waited for another request's commit on their chosen device and
    /// decided again, instead of sending a transaction certain to lose.
    pub gate_waits: Counter,
    /// Releases that removed a reservation.
    pub released: Counter,
    /// Reservations given back because the task's agent was gone (see [`crate::reaper`]).
    pub dead_released: Counter,
    /// Reservations given back because the task's agent never started (see [`crate::reaper`]).
    pub unstarted_released: Counter,
    /// Co-location samples handed to the slowdown model.
    pub samples_observed: Counter,
    /// Stored values that could not be decoded (skipped).
    pub decode_errors: Counter,
    /// Extender requests, by verb.
    pub extender_filter: Counter,
    pub extender_prioritize: Counter,
    pub extender_bind: Counter,
    /// Time of the pure decision (policy over the in-memory view).
    pub decision_latency: Histogram,
    /// Time of a whole Place, reservation in the store included.
    pub place_latency: Histogram,
}

impl PlacerMetrics {
    /// The metrics in Prometheus' text format; `devices` and `residents` are gauges of the view.
    pub fn render(&self, devices: usize, residents: usize) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP iadeep_placer_decisions_total Place requests by outcome.\n\
             # TYPE iadeep_placer_decisions_total counter"
        );
        for (outcome, counter) in [
            ("placed", &self.placed),
            ("queued", &self.queued),
            ("invalid", &self.invalid),
            ("failed", &self.failed),
        ] {
            let _ = writeln!(
                out,
                "iadeep_placer_decisions_total{{outcome=\"{outcome}\"}} {}",
                counter.get()
            );
        }
        let _ = writeln!(
            out,
            "# HELP iadeep_placer_extender_requests_total Kubernetes extender requests by verb.\n\
             # TYPE iadeep_placer_extender_requests_total counter"
        );
        for (verb, counter) in [
            ("filter", &self.extender_filter),
            ("prioritize", &self.extender_prioritize),
            ("bind", &self.extender_bind),
        ] {
            let _ = writeln!(
                out,
                "iadeep_placer_extender_requests_total{{verb=\"{verb}\"}} {}",
                counter.get()
            );
        }
        for (name, help, counter) in [
            (
                "iadeep_placer_cas_conflicts_total",
                "Reservations lost to a concurrent writer, each followed by a fresh decision.",
                &self.cas_conflicts,
            ),
            (
                "iadeep_placer_gate_waits_total",
                "Places that waited for another request's commit on the same device, then decided again.",
                &self.gate_waits,
            ),
            (
                "iadeep_placer_releases_total",
                "Releases that removed a reservation.",
                &self.released,
            ),
            (
                "iadeep_placer_dead_task_releases_total",
                "Reservations given back because the task's agent was gone past the grace period.",
                &self.dead_released,
            ),
            (
                "iadeep_placer_unstarted_task_releases_total",
                "Reservations given back because the task's agent never started within its grace period.",
                &self.unstarted_released,
            ),
            (
                "iadeep_placer_samples_observed_total",
                "Co-location samples fed to the slowdown model.",
                &self.samples_observed,
            ),
            (
                "iadeep_placer_decode_errors_total",
                "Stored values that did not decode and were skipped.",
                &self.decode_errors,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            let _ = writeln!(out, "{name} {}", counter.get());
        }
        for (name, help, value) in [
            (
                "iadeep_placer_devices",
                "Devices in the placer's view.",
                devices,
            ),
            (
                "iadeep_placer_residents",
                "Tasks holding a reservation.",
                residents,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        self.decision_latency.render(
            &mut out,
            "iadeep_placer_decision_seconds",
            "Time of one placement decision over the in-memory view.",
        );
        self.place_latency.render(
            &mut out,
            "iadeep_placer_place_seconds",
            "Time of one Place request, reservation in the store included.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_counts_match() {
        let m = PlacerMetrics::default();
        m.decision_latency.observe(Duration::from_micros(30));
        m.decision_latency.observe(Duration::from_millis(3));
        m.decision_latency.observe(Duration::from_secs(10));
        m.placed.inc();
        let text = m.render(3, 2);
        assert!(text.contains("iadeep_placer_decision_seconds_bucket{le=\"0.00005\"} 1"));
        assert!(text.contains("iadeep_placer_decision_seconds_bucket{le=\"0.005\"} 2"));
        assert!(text.contains("iadeep_placer_decision_seconds_bucket{le=\"+Inf\"} 3"));
        assert!(text.contains("iadeep_placer_decision_seconds_count 3"));
        assert!(text.contains("iadeep_placer_decisions_total{outcome=\"placed\"} 1"));
        assert!(text.contains("iadeep_placer_devices 3"));
    }
}
