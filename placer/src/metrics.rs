//! Prometheus metrics of the placer, kept in a [`prometheus::Registry`] (with the
//! process and build-info metrics of [`iadeep_ops::registry`]) and rendered by the
//! library's text encoder.
//!
//! The fields keep small wrappers ([`Counter`], [`Histogram`]) so the hot path is
//! one atomic add and callers never touch label plumbing. The placement service
//! counts into them through [`PlacementEvents`] (one metric per [`PlacementEvent`]);
//! the extender counts its requests directly.

use std::time::Duration;

use prometheus::{HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};

use crate::events::{EvictionTrigger, PlacementEvent, PlacementEvents};

/// A monotonically increasing count.
#[derive(Clone, Debug)]
pub struct Counter(prometheus::IntCounter);

impl Counter {
    /// Adds one.
    pub fn inc(&self) {
        self.0.inc();
    }

    /// The current count.
    pub fn get(&self) -> u64 {
        self.0.get()
    }
}

/// Upper bounds of the latency buckets, seconds: 50 µs to 2.5 s.
const LATENCY_BUCKETS_S: [f64; 14] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
    2.5,
];

/// A value that goes up and down.
#[derive(Clone, Debug)]
pub struct Gauge(IntGauge);

impl Gauge {
    /// Sets the value.
    pub fn set(&self, value: usize) {
        self.0.set(i64::try_from(value).unwrap_or(i64::MAX));
    }

    /// The current value.
    pub fn get(&self) -> i64 {
        self.0.get()
    }
}

/// A latency histogram (seconds).
#[derive(Clone, Debug)]
pub struct Histogram(prometheus::Histogram);

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, elapsed: Duration) {
        self.0.observe(elapsed.as_secs_f64());
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.0.get_sample_count()
    }
}

/// Everything the placer counts.
#[derive(Clone, Debug)]
pub struct PlacerMetrics {
    /// Place requests answered "placed".
    pub placed: Counter,
    /// Place requests answered "queued".
    pub queued: Counter,
    /// Place requests refused as malformed, or as never satisfiable.
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
    /// Reservations given back because the task's agent was gone (see
    /// [`DaemonConfig::dead_task_grace`](crate::DaemonConfig::dead_task_grace)).
    pub dead_released: Counter,
    /// Reservations given back because the task's agent never started (see
    /// [`DaemonConfig::unstarted_task_grace`](crate::DaemonConfig::unstarted_task_grace)).
    pub unstarted_released: Counter,
    /// Tasks that held no placement whose keys were archived and marked for the
    /// retention (see [`crate::PlacementService::archive_dead_unreserved`]).
    pub unplaced_archived: Counter,
    /// Released tasks whose keys were deleted after their retention (see
    /// [`PlacerParams::task_retention`](crate::PlacerParams::task_retention)).
    pub retention_deleted: Counter,
    /// Tasks released while their agent kept running, admitted again on their device.
    pub readmitted: Counter,
    /// Tasks whose agent runs without a reservation that could not be admitted again
    /// (their device has no room), as the last reaper pass found them.
    pub unreserved_running: Gauge,
    /// Opportunistic jobs evicted because a production job on their device stayed
    /// measured above its slowdown cap (see [`crate::eviction`]).
    pub cap_evictions: Counter,
    /// Opportunistic jobs evicted to make room for a production job's placement.
    pub room_evictions: Counter,
    /// Placements that refused a device because a production job's cap would be exceeded.
    pub cap_refusals: Counter,
    /// Places told to queue because their device was held for a task waiting ahead.
    pub holds: Counter,
    /// AvoidPairings in force, as the last eviction pass counted them.
    pub avoided_pairings: Gauge,
    /// Co-location samples handed to the slowdown model.
    pub samples_observed: Counter,
    /// Stored values that could not be decoded (skipped).
    pub decode_errors: Counter,
    /// Extender requests, by verb.
    pub extender_filter: Counter,
    pub extender_prioritize: Counter,
    pub extender_bind: Counter,
    /// Kubernetes Evictions of pods whose task did not leave when told to, by outcome
    /// (see `extender::pod_evictor`): accepted by the API server.
    pub pod_evicted: Counter,
    /// Pods found gone, re-created, ended or terminating when due: nothing to evict.
    pub pod_eviction_gone: Counter,
    /// Evictions a PodDisruptionBudget refused for now (HTTP 429; retried next tick).
    pub pod_eviction_blocked: Counter,
    /// Evictions that failed otherwise (retried after a backoff).
    pub pod_eviction_failed: Counter,
    /// Time of the pure decision (policy over the in-memory view).
    pub decision_latency: Histogram,
    /// Time of a whole Place, reservation in the store included.
    pub place_latency: Histogram,
    devices: IntGauge,
    residents: IntGauge,
    registry: Registry,
}

impl Default for PlacerMetrics {
    fn default() -> Self {
        PlacerMetrics::new(iadeep_ops::registry("placer"))
    }
}

/// Registers a metric whose definition is a constant of this file (so an error is a
/// bug, caught by the tests below, not something input can cause).
fn registered<C: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    metric: prometheus::Result<C>,
) -> C {
    let metric = metric.expect("metric definitions are valid constants");
    iadeep_ops::register(registry, Box::new(metric.clone()));
    metric
}

fn counter(registry: &Registry, name: &str, help: &str) -> Counter {
    Counter(registered(
        registry,
        prometheus::IntCounter::new(name, help),
    ))
}

fn labelled(vec: &IntCounterVec, label: &str) -> Counter {
    Counter(vec.with_label_values(&[label]))
}

fn histogram(registry: &Registry, name: &str, help: &str) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS_S.to_vec());
    Histogram(registered(registry, prometheus::Histogram::with_opts(opts)))
}

impl PlacerMetrics {
    /// The placer's metrics, registered in `registry`.
    ///
    /// long: one struct literal that defines every metric, its name and help text
    /// beside its field; split up, the definitions would only be scattered.
    pub fn new(registry: Registry) -> PlacerMetrics {
        let vec = |name: &str, help: &str, label: &str| {
            registered(
                &registry,
                IntCounterVec::new(Opts::new(name, help), &[label]),
            )
        };
        let decisions = vec(
            "iadeep_placer_decisions_total",
            "Place requests by outcome.",
            "outcome",
        );
        let verbs = vec(
            "iadeep_placer_extender_requests_total",
            "Kubernetes extender requests by verb.",
            "verb",
        );
        let evictions = vec(
            "iadeep_placer_evictions_total",
            "Opportunistic jobs told to leave their GPU, by trigger: cap (a production job stayed measured above its slowdown cap) or room (a production job's placement).",
            "trigger",
        );
        let pod_evictions = vec(
            "iadeep_placer_pod_evictions_total",
            "Kubernetes Evictions of pods whose task kept running past --pod-evict-grace after it was told to leave, by outcome: evicted (accepted), gone (nothing to evict), blocked (a PodDisruptionBudget refused it for now), failed.",
            "outcome",
        );
        let gauge = |name: &str, help: &str| registered(&registry, IntGauge::new(name, help));
        PlacerMetrics {
            placed: labelled(&decisions, "placed"),
            queued: labelled(&decisions, "queued"),
            invalid: labelled(&decisions, "invalid"),
            failed: labelled(&decisions, "failed"),
            cas_conflicts: counter(
                &registry,
                "iadeep_placer_cas_conflicts_total",
                "Reservations lost to a concurrent writer, each followed by a fresh decision.",
            ),
            gate_waits: counter(
                &registry,
                "iadeep_placer_gate_waits_total",
                "Places that waited for another request's commit on the same device, then decided again.",
            ),
            released: counter(
                &registry,
                "iadeep_placer_releases_total",
                "Releases that removed a reservation.",
            ),
            dead_released: counter(
                &registry,
                "iadeep_placer_dead_task_releases_total",
                "Reservations given back because the task's agent was gone past the grace period.",
            ),
            unstarted_released: counter(
                &registry,
                "iadeep_placer_unstarted_task_releases_total",
                "Reservations given back because the task's agent never started within its grace period.",
            ),
            unplaced_archived: counter(
                &registry,
                "iadeep_placer_unplaced_archived_tasks_total",
                "Tasks that never held a reservation (or lost it) whose keys were archived for the retention once their agent was gone.",
            ),
            retention_deleted: counter(
                &registry,
                "iadeep_placer_retention_deleted_tasks_total",
                "Released tasks whose keys were deleted after their retention.",
            ),
            readmitted: counter(
                &registry,
                "iadeep_placer_readmitted_tasks_total",
                "Tasks released while their agent kept running, admitted again on their device.",
            ),
            unreserved_running: Gauge(gauge(
                "iadeep_placer_unreserved_running_tasks",
                "Tasks whose agent runs without a reservation and could not be admitted again.",
            )),
            cap_evictions: labelled(&evictions, EvictionTrigger::Cap.label()),
            room_evictions: labelled(&evictions, EvictionTrigger::Room.label()),
            cap_refusals: counter(
                &registry,
                "iadeep_placer_cap_refusals_total",
                "Placements that refused a GPU because a production job's slowdown cap would be exceeded there.",
            ),
            holds: counter(
                &registry,
                "iadeep_placer_holds_total",
                "Places told to queue because their GPU was held for a task submitted earlier that would be placed there now.",
            ),
            avoided_pairings: Gauge(gauge(
                "iadeep_placer_avoided_pairings",
                "Pairings of a production job and a job evicted for it that placement keeps apart (unexpired).",
            )),
            samples_observed: counter(
                &registry,
                "iadeep_placer_samples_observed_total",
                "Co-location samples fed to the slowdown model.",
            ),
            decode_errors: counter(
                &registry,
                "iadeep_placer_decode_errors_total",
                "Stored values that did not decode and were skipped.",
            ),
            extender_filter: labelled(&verbs, "filter"),
            extender_prioritize: labelled(&verbs, "prioritize"),
            extender_bind: labelled(&verbs, "bind"),
            pod_evicted: labelled(&pod_evictions, "evicted"),
            pod_eviction_gone: labelled(&pod_evictions, "gone"),
            pod_eviction_blocked: labelled(&pod_evictions, "blocked"),
            pod_eviction_failed: labelled(&pod_evictions, "failed"),
            decision_latency: histogram(
                &registry,
                "iadeep_placer_decision_seconds",
                "Time of one placement decision over the in-memory view.",
            ),
            place_latency: histogram(
                &registry,
                "iadeep_placer_place_seconds",
                "Time of one Place request, reservation in the store included.",
            ),
            devices: gauge("iadeep_placer_devices", "Devices in the placer's view."),
            residents: gauge("iadeep_placer_residents", "Tasks holding a reservation."),
            registry,
        }
    }

    /// The metrics in Prometheus' text format; `devices` and `residents` are gauges of the view.
    pub fn render(&self, devices: usize, residents: usize) -> String {
        self.devices.set(i64::try_from(devices).unwrap_or(i64::MAX));
        self.residents
            .set(i64::try_from(residents).unwrap_or(i64::MAX));
        iadeep_ops::encode(&self.registry)
    }
}

impl PlacementEvents for PlacerMetrics {
    fn record(&self, event: PlacementEvent) {
        match event {
            PlacementEvent::Placed => self.placed.inc(),
            PlacementEvent::Queued => self.queued.inc(),
            PlacementEvent::Invalid => self.invalid.inc(),
            PlacementEvent::Failed => self.failed.inc(),
            PlacementEvent::PlaceTime(elapsed) => self.place_latency.observe(elapsed),
            PlacementEvent::DecisionTime(elapsed) => self.decision_latency.observe(elapsed),
            PlacementEvent::CasConflict => self.cas_conflicts.inc(),
            PlacementEvent::GateWait => self.gate_waits.inc(),
            PlacementEvent::Released => self.released.inc(),
            PlacementEvent::DeadReleased => self.dead_released.inc(),
            PlacementEvent::UnstartedReleased => self.unstarted_released.inc(),
            PlacementEvent::UnplacedArchived => self.unplaced_archived.inc(),
            PlacementEvent::RetentionDeleted => self.retention_deleted.inc(),
            PlacementEvent::Readmitted => self.readmitted.inc(),
            PlacementEvent::UnreservedRunning(tasks) => self.unreserved_running.set(tasks),
            PlacementEvent::Evicted(EvictionTrigger::Cap) => self.cap_evictions.inc(),
            PlacementEvent::Evicted(EvictionTrigger::Room) => self.room_evictions.inc(),
            PlacementEvent::CapRefusal => self.cap_refusals.inc(),
            PlacementEvent::Held => self.holds.inc(),
            PlacementEvent::AvoidedPairings(n) => self.avoided_pairings.set(n),
            PlacementEvent::SampleObserved => self.samples_observed.inc(),
            PlacementEvent::DecodeError => self.decode_errors.inc(),
        }
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
        m.record(PlacementEvent::DecisionTime(Duration::from_secs(10)));
        m.record(PlacementEvent::Placed);
        let text = m.render(3, 2);
        assert!(
            text.contains("iadeep_placer_decision_seconds_bucket{le=\"0.00005\"} 1"),
            "{text}"
        );
        assert!(text.contains("iadeep_placer_decision_seconds_bucket{le=\"0.005\"} 2"));
        assert!(text.contains("iadeep_placer_decision_seconds_bucket{le=\"+Inf\"} 3"));
        assert!(text.contains("iadeep_placer_decision_seconds_count 3"));
        assert!(text.contains("iadeep_placer_decisions_total{outcome=\"placed\"} 1"));
        assert!(text.contains("iadeep_placer_decisions_total{outcome=\"queued\"} 0"));
        assert!(text.contains("iadeep_placer_devices 3"));
        assert!(text.contains("iadeep_build_info{component=\"placer\""));
        assert_eq!(m.decision_latency.count(), 3);
    }

    /// The metric names, both eviction triggers listed from the start (a
    /// dashboard's rate() needs the series before the first eviction).
    #[test]
    fn eviction_metrics_are_exposed_by_their_fixed_names() {
        let m = PlacerMetrics::default();
        let text = m.render(0, 0);
        for series in [
            "iadeep_placer_evictions_total{trigger=\"cap\"} 0",
            "iadeep_placer_evictions_total{trigger=\"room\"} 0",
            "iadeep_placer_cap_refusals_total 0",
            "iadeep_placer_holds_total 0",
            "iadeep_placer_avoided_pairings 0",
            "iadeep_placer_pod_evictions_total{outcome=\"evicted\"} 0",
            "iadeep_placer_pod_evictions_total{outcome=\"blocked\"} 0",
        ] {
            assert!(text.contains(series), "{series} missing from:\n{text}");
        }
        m.record(PlacementEvent::Evicted(EvictionTrigger::Cap));
        m.record(PlacementEvent::Evicted(EvictionTrigger::Room));
        m.record(PlacementEvent::Evicted(EvictionTrigger::Room));
        m.record(PlacementEvent::CapRefusal);
        m.record(PlacementEvent::Held);
        m.record(PlacementEvent::AvoidedPairings(3));
        let text = m.render(0, 0);
        for series in [
            "iadeep_placer_evictions_total{trigger=\"cap\"} 1",
            "iadeep_placer_evictions_total{trigger=\"room\"} 2",
            "iadeep_placer_cap_refusals_total 1",
            "iadeep_placer_holds_total 1",
            "iadeep_placer_avoided_pairings 3",
        ] {
            assert!(text.contains(series), "{series} missing from:\n{text}");
        }
    }
}
