//! Validated parameters of the placement policy.

use std::time::Duration;

use iadeep_objective::MemoryMargin;

use crate::error::{PlacerError, Result};

/// What the policy may do, in operator terms. Build one, then call [`PlacerParams::check`]
/// (the [`crate::policy::Placer`] constructor does) so nonsense is refused at start-up
/// rather than discovered as strange placements.
#[derive(Clone, Debug, PartialEq)]
pub struct PlacerParams {
    /// Cap on the predicted aggregate SM utilisation of a device, in percent: the sum of
    /// the solo utilisations of its tasks. Above 100 the tasks contend for SM cycles.
    pub sm_util_cap_pct: f64,
    /// Cap on the predicted aggregate DRAM-bandwidth utilisation, percent (sum of solo values).
    pub mem_bw_util_cap_pct: f64,
    /// A device whose predicted Σ PD would grow by more than this is not a candidate.
    /// An idle device costs exactly 1.0 (the task's own PD alone), so this must be ≥ 1.
    pub max_pd_increase: f64,
    /// A shared device is a candidate only if the task joining raises its predicted
    /// combined normalised throughput (Σ 1/IF over its tasks, 1 per task alone) by at
    /// least this, in units of one task's solo throughput. Otherwise running the task
    /// later alone does the same work sooner, however long the queue. 0 accepts any
    /// co-location that does not lose throughput; must be in [0, 1].
    pub min_throughput_gain: f64,
    /// How much the ranking penalises the predictor's uncertainty: devices are ranked
    /// by `increase + uncertainty_weight × uncertainty` (pessimistic, like an upper
    /// confidence bound), so a poorly known co-location has to look clearly better.
    pub uncertainty_weight: f64,
    /// Seconds of degraded progress one second of waiting is worth. The task queues when
    /// `wait × wait_cost_factor < excess PD × task duration + delay to a task ahead`
    /// (see [`crate::policy`]).
    pub wait_cost_factor: f64,
    /// Solo run time assumed for a task that does not say how much work it has.
    pub assumed_task_duration: Duration,
    /// Bounds of the retry hint of a "queue" answer.
    pub min_retry_after: Duration,
    /// See [`PlacerParams::min_retry_after`].
    pub max_retry_after: Duration,
    /// How many feasible and rejected devices an explanation lists (it always counts all).
    pub explain_top_k: usize,
    /// How many times a placement decides again after losing a compare-and-swap.
    pub max_reserve_attempts: u32,
    /// Most shared devices a decision asks the slowdown model about, the least loaded
    /// first (see [`crate::policy::Placer::assess_limited`]); 0 scores every device.
    pub max_scored_devices: usize,
    /// How long the keys of a released task (spec, report, assignment) stay in the store
    /// after its Release, so `iadeep state get` still shows a finished job; then the
    /// reaper deletes them (see [`crate::retention`]). `None` keeps them forever.
    pub task_retention: Option<Duration>,
    /// Most released tasks one retention pass deletes, so a backlog (a placer started
    /// on a store full of old tasks) is worked off over several passes instead of
    /// holding the store's write path for one long burst.
    pub retention_batch: usize,
    /// How often the placer compacts the store's history (see [`crate::compaction`]);
    /// `None` never does (an etcd compacted by its own `--auto-compaction-*`).
    pub compact_every: Option<Duration>,
    /// Most revisions of history a compaction keeps (it keeps at most one
    /// `compact_every` of it either way; see [`crate::compaction`]).
    pub compact_keep_revisions: i64,
    /// Least share of a shared card that must be free for a task nothing is known of
    /// (no request, no profile, no registry entry) to join it. Such a task is granted
    /// all the free memory *provisionally*: its agent fences its allocator there, and
    /// the placer replaces the grant with the measured peak as soon as the task reports
    /// one (see [`crate::policy`], "Memory of a task nothing is known of"). In (0, 1].
    pub min_unknown_memory_share: f64,
    /// How long, after a cap breach evicted an opportunistic job, the placer keeps it off
    /// the device of the production job it slowed (the AvoidPairing the eviction writes,
    /// see [`crate::eviction`]): long enough that the re-queued job lands elsewhere or
    /// after the production job has moved on, short enough that a pairing that only
    /// clashed in one phase of training is tried again. Positive.
    pub avoid_pairing_for: Duration,
    /// How long a room eviction's claim holds the room it makes for the production
    /// task (see [`crate::policy`], "Room evictions"): long enough for the evicted jobs
    /// to checkpoint, exit and release, and for the task to ask again; after it the
    /// claim counts for nothing, so a task that never comes back holds nothing.
    pub room_claim_ttl: Duration,
    /// How long a production task waits for a device to take it, counted from its
    /// submission (`TaskSpec::submitted_at_unix_ms`), before it may make room by evicting
    /// opportunistic jobs (see [`crate::policy`], "Room evictions"). Zero: at once, the
    /// first time it fits nowhere. A task that does not say when it was submitted may
    /// evict at once. What it trades: production jobs that evict at once finish well
    /// ahead of what a non-preemptive priority queue gives them, at the opportunistic
    /// jobs' expense (docs/simulator-experiments.md, "Waiting instead of evicting").
    pub room_eviction_patience: Duration,
    /// How long a task told to leave (its assignment says `evict`) may keep running in
    /// its Kubernetes pod, from when this placer first saw the order, before the placer
    /// evicts the pod through the Kubernetes API (only with the extender and
    /// `--kube-api`; see [`crate::pod_eviction`]). Time for the job to checkpoint and
    /// exit on its own; kubelet then gives the pod its termination grace, and the two
    /// together must stay under the dead-task grace
    /// ([`crate::pod_eviction::check_grace`]). Zero evicts at the first tick.
    pub pod_evict_grace: Duration,
    /// How long a device is held for a task waiting ahead that the decision would place
    /// there, while that task does not ask again (see [`crate::policy`], "Room held for
    /// a task waiting ahead"): a task submitted later is told to queue meanwhile, for at
    /// most this long in a row. Clients that wait (`iadeep run`) look at the devices
    /// every 2 s and ask at once when a candidate has more room (a resident left, a
    /// reservation shrank), so a live one comes back well within it when room is what
    /// changed; when its own decision changed otherwise (time passed, the queue rule's
    /// wait moved), it asks at its hint, and the hold lapses first. Zero holds nothing:
    /// requests are served as they come.
    pub waiter_hold: Duration,
    /// Most tasks waiting ahead whose own decision a placing decision works out, for
    /// the hold: the first this many, in submission order, that the chosen device can
    /// take at all; 0 works out every one. Each is a decision over the whole cluster, so
    /// without a bound a decision costs the queue's length times the cluster's size
    /// (see [`crate::policy`], "Room held for a task waiting ahead", for the figures). A
    /// task waiting behind that many others that could also use the device holds
    /// nothing for the task asking.
    pub max_waiters_checked: usize,
}

/// Default of [`PlacerParams::task_retention`]: a day to look at a finished job.
pub const DEFAULT_TASK_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// Default of [`PlacerParams::room_eviction_patience`]: half an hour, chosen on the
/// simulator's K80 runs as the longest patience tried (0, 6, 30, 60, 90 and 120 minutes)
/// that kept every run's production jobs within 5 % of the completion time `priority`
/// gives them (docs/simulator-experiments.md, "Waiting instead of evicting").
pub const DEFAULT_ROOM_EVICTION_PATIENCE: Duration = Duration::from_secs(30 * 60);

/// Default of [`PlacerParams::waiter_hold`]: five of `iadeep run`'s 2 s looks at the
/// devices, so a waiting run that is alive comes back within it when room is what
/// changed.
pub const DEFAULT_WAITER_HOLD: Duration = Duration::from_secs(10);

/// Default of [`PlacerParams::max_waiters_checked`]: as many waiters as the devices a
/// decision asks the slowdown model about ([`PlacerParams::max_scored_devices`]). With
/// it, every run of the simulator's headline (20 GPUs, K80 and P100, seeds 1 to 5) gave
/// the same `tasks.csv` as without a bound, where 16 changed six of the ten
/// (docs/simulator-experiments.md, "Bounding the hold's cost").
pub const DEFAULT_MAX_WAITERS_CHECKED: usize = 64;

/// Default of [`PlacerParams::avoid_pairing_for`]: half an hour.
pub const DEFAULT_AVOID_PAIRING_FOR: Duration = Duration::from_secs(30 * 60);

impl Default for PlacerParams {
    fn default() -> Self {
        PlacerParams {
            sm_util_cap_pct: 200.0,
            mem_bw_util_cap_pct: 150.0,
            max_pd_increase: 4.0,
            min_throughput_gain: 0.1,
            uncertainty_weight: 0.5,
            wait_cost_factor: 1.0,
            assumed_task_duration: Duration::from_secs(3600),
            min_retry_after: Duration::from_secs(5),
            max_retry_after: Duration::from_secs(600),
            explain_top_k: 5,
            max_reserve_attempts: 16,
            max_scored_devices: 64,
            task_retention: Some(DEFAULT_TASK_RETENTION),
            retention_batch: 1000,
            compact_every: Some(crate::compaction::DEFAULT_COMPACT_EVERY),
            compact_keep_revisions: crate::compaction::DEFAULT_COMPACT_KEEP_REVISIONS,
            min_unknown_memory_share: 0.25,
            avoid_pairing_for: DEFAULT_AVOID_PAIRING_FOR,
            room_claim_ttl: Duration::from_secs(60),
            room_eviction_patience: DEFAULT_ROOM_EVICTION_PATIENCE,
            pod_evict_grace: crate::pod_eviction::DEFAULT_POD_EVICT_GRACE,
            waiter_hold: DEFAULT_WAITER_HOLD,
            max_waiters_checked: DEFAULT_MAX_WAITERS_CHECKED,
        }
    }
}

fn bad(name: &'static str, reason: impl Into<String>) -> PlacerError {
    PlacerError::InvalidParams {
        name,
        reason: reason.into(),
    }
}

impl PlacerParams {
    /// Refuses values the policy cannot work with, naming the parameter.
    pub fn check(&self) -> Result<()> {
        for (name, value) in [
            ("sm_util_cap_pct", self.sm_util_cap_pct),
            ("mem_bw_util_cap_pct", self.mem_bw_util_cap_pct),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(bad(name, format!("{value} is not a positive percentage")));
            }
        }
        if self.max_pd_increase.is_nan() || self.max_pd_increase < 1.0 {
            return Err(bad(
                "max_pd_increase",
                format!(
                    "{} < 1: even an idle device costs the task's own PD of 1",
                    self.max_pd_increase
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.min_throughput_gain) {
            return Err(bad(
                "min_throughput_gain",
                format!(
                    "{} is not in [0, 1] (a fraction of one task's solo throughput)",
                    self.min_throughput_gain
                ),
            ));
        }
        for (name, value) in [
            ("uncertainty_weight", self.uncertainty_weight),
            ("wait_cost_factor", self.wait_cost_factor),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(bad(name, format!("{value} is not a finite value ≥ 0")));
            }
        }
        if self.assumed_task_duration.is_zero() {
            return Err(bad("assumed_task_duration", "must be positive"));
        }
        if self.min_retry_after.is_zero() || self.min_retry_after > self.max_retry_after {
            return Err(bad(
                "min_retry_after",
                format!(
                    "need 0 < min_retry_after ({:?}) ≤ max_retry_after ({:?})",
                    self.min_retry_after, self.max_retry_after
                ),
            ));
        }
        if self.max_reserve_attempts == 0 {
            return Err(bad("max_reserve_attempts", "must be at least 1"));
        }
        if !(self.min_unknown_memory_share > 0.0 && self.min_unknown_memory_share <= 1.0) {
            return Err(bad(
                "min_unknown_memory_share",
                format!("{} is not in (0, 1]", self.min_unknown_memory_share),
            ));
        }
        if self.room_claim_ttl.is_zero() {
            return Err(bad("room_claim_ttl", "must be positive"));
        }
        if self.avoid_pairing_for.is_zero() {
            return Err(bad("avoid_pairing_for", "must be positive"));
        }
        if self.retention_batch == 0 {
            return Err(bad("retention_batch", "must be at least 1"));
        }
        if self.compact_keep_revisions < 1 {
            return Err(bad("compact_keep_revisions", "must be at least 1"));
        }
        if self.compact_every.is_some_and(|every| every.is_zero()) {
            return Err(bad(
                "compact_every",
                "must be positive (None never compacts)",
            ));
        }
        Ok(())
    }

    /// Memory of a device of `total_mib` that tasks sharing it may reserve together: the
    /// card less the one memory margin ([`MemoryMargin::DEFAULT`], which the tuner and the
    /// agent keep too).
    pub fn usable_memory_mib(&self, total_mib: u64) -> u64 {
        // Float is fine here: device sizes are far below 2^53 MiB.
        MemoryMargin::DEFAULT.usable_mib(total_mib as f64).floor() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_pass_and_each_bad_value_is_named() {
        PlacerParams::default().check().expect("defaults are valid");
        let cases: Vec<(&str, PlacerParams)> = vec![
            (
                "sm_util_cap_pct",
                PlacerParams {
                    sm_util_cap_pct: f64::NAN,
                    ..Default::default()
                },
            ),
            (
                "max_pd_increase",
                PlacerParams {
                    max_pd_increase: 0.5,
                    ..Default::default()
                },
            ),
            (
                "min_throughput_gain",
                PlacerParams {
                    min_throughput_gain: -0.1,
                    ..Default::default()
                },
            ),
            (
                "min_retry_after",
                PlacerParams {
                    min_retry_after: Duration::from_secs(700),
                    ..Default::default()
                },
            ),
            (
                "max_reserve_attempts",
                PlacerParams {
                    max_reserve_attempts: 0,
                    ..Default::default()
                },
            ),
            (
                "retention_batch",
                PlacerParams {
                    retention_batch: 0,
                    ..Default::default()
                },
            ),
        ];
        for (name, params) in cases {
            let err = params.check().expect_err(name);
            assert!(err.to_string().contains(name), "{err}");
        }
    }

    #[test]
    fn usable_memory_keeps_the_one_margin() {
        let p = PlacerParams::default();
        // 5% of 16000 = 800, plus 256.
        assert_eq!(p.usable_memory_mib(16_000), 16_000 - 800 - 256);
        assert_eq!(p.usable_memory_mib(100), 0);
    }
}
