//! The placement decision: a pure function of a [`ClusterView`] and a task.
//!
//! For each device (or each of the devices the caller allows):
//! 1. **Feasibility.** The device must be registered; its residents' footprints
//!    (each at the batch size it is *assigned*, never its smallest allowed one: the
//!    largest of its reservation, its reported peak, its assigner's bound and the
//!    [`MemoryEstimator`]'s bound there, see [`crate::view::Resident::footprint_mib`])
//!    plus the new task's footprint at its submitted batch size, where it starts, must
//!    fit the device's memory less the one memory margin. When they do not, residents
//!    that run above sizes they are known to fit at are shrunk, one candidate size at a
//!    time, the one that frees most first, until the newcomer fits (or it cannot); the
//!    shrinks are written with the placement, before the newcomer starts. The predicted
//!    aggregate SM and DRAM-bandwidth utilisations (sums of the known solo values) must
//!    stay under their caps. An idle device is always a candidate when the task fits the
//!    card at all (nothing shares it, so the margin is not needed).
//!    **Memory of a task nothing is known of** (no request, no profile, no registry
//!    entry): on an idle card it reserves the whole card; on a shared card it is granted
//!    all the free memory, provisionally, when every resident's memory is measured and
//!    at least [`PlacerParams::min_unknown_memory_share`] of the card is free. Its agent
//!    fences its allocator at the grant, so an under-estimate costs that task a step, not
//!    its co-runners their run; its first measured peak settles the reservation
//!    ([`crate::PlacementService::settle_provisional`]). A grant is never made while a
//!    resident's own grant is unmeasured: two guesses on one card could over-pack it.
//! 2. **Score.** The predicted increase of the device's Σ PD if the task joins:
//!    Σ over residents of (predicted IF with the task − predicted IF without it),
//!    plus the new task's own predicted IF. The placer does not change batch sizes,
//!    so at the submitted batch sizes DT = E = 1 and PD = IF; the tuner then
//!    improves on it. An idle device costs exactly 1.0 (the task alone).
//!    **Throughput guard.** A shared device is rejected unless the task joining
//!    raises its predicted combined normalised throughput, Σ 1/IF over its tasks
//!    (each task alone counts 1), by at least
//!    [`PlacerParams::min_throughput_gain`]: if the residents plus the newcomer do
//!    less work per second than the residents alone (plus the margin), running the
//!    task later alone does the same work sooner, however long the queue, so no
//!    queue rule below should place it there.
//!    **Promised devices.** A device among the first `q` predicted to free up (see
//!    step 3) is what a task waiting ahead counts on. Joining it keeps it busy at
//!    least until the newcomer finishes, about its solo duration `D` from now, so
//!    that task waits `delay = max(0, D − R)` longer, `R` being when the device's
//!    residents are predicted to finish. The placer's own audit (`iadeep sim
//!    --audit`) showed this is why `W` ran 2–2.5× below the real wait: the
//!    residents' progress was predicted well, but devices about to free up were
//!    joined before they did. The delay is priced like the excess below, per
//!    second of the newcomer's solo run (`delay / D` added to the rank), so an
//!    unpromised device of similar PD is preferred, and in full in step 3.
//!    Devices are ranked by `increase + uncertainty_weight × uncertainty + delay / D`;
//!    equal ranks are broken by a hash of (task, device) so that concurrent requests
//!    spread over equally good devices instead of all racing for the first.
//! 3. **Queue or place.** If the best device is not idle, placing costs the excess
//!    `increase₉₀ − 1` units of PD for about the task's solo duration `D`, i.e.
//!    `(increase₉₀ − 1) × D` seconds of solo-speed progress lost across the device's
//!    tasks, plus the `delay` it imposes on a task waiting ahead if the device was
//!    promised to one. `increase₉₀` is the pessimistic increase: each slowdown it
//!    sums at the upper end of the model's 90 % predictive interval
//!    ([`SlowdownEstimate::upper_90`]). Why pessimistic: a placement holds for the
//!    task's whole run, while `W` comes from measured progress; where the model is
//!    unsure (a model it has never seen, a wide interval) a co-location that merely
//!    looks cheap should not win over a wait that is known. Waiting costs the time `W` until a device frees up *for this task*,
//!    after which it would run alone at PD 1. The `q` tasks waiting ahead of it
//!    (told to queue earlier and submitted before it, see
//!    [`ClusterView::waiting_ahead_of`]) take the first `q` devices that free up, so
//!    `W` is the (q+1)-th smallest predicted idle time (every resident finished, from
//!    their reported progress) among the devices considered that have residents.
//!    The task queues, with a retry hint of `W`, when `W × wait_cost_factor` is
//!    smaller. `W` is unknown, and the task is placed, when fewer than `q + 1` such
//!    devices have every resident reporting its progress: either nothing says when a
//!    device frees up (as with an empty queue and no reports), or more tasks wait
//!    than devices promise to free up, so waiting would last longer than a whole
//!    round of the residents' work, which no co-location cost is worth predicting
//!    against. Devices that do not report are left out of the order statistic, so
//!    `W` is what the reporting devices promise: it can only be an over-estimate if
//!    the others free up sooner. The tasks ahead may themselves be co-located
//!    instead of waiting, which also makes `W` an over-estimate; both bias towards
//!    placing, never towards an unbounded wait.
use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use iadeep_proto::{CandidateScore, Explanation, TaskProfile, TaskSpec};

use crate::error::Result;
use crate::model::{MemoryEstimator, SlowdownEstimate, SlowdownModel};
use crate::params::PlacerParams;
use crate::view::{AloneTogether, ClusterView, DeviceState, profile_of};

/// Why a device cannot take the task.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rejection {
    /// The caller named a device the placer does not know.
    UnknownDevice,
    /// The device is not registered (its tuner is gone); it takes no new task.
    NotRegistered,
    /// Nothing is known about the task's memory and a resident's memory is not measured
    /// yet either: granting the newcomer the free memory could stack two guesses. The
    /// resident's first report settles it, seconds after it starts.
    UnknownTaskMemory,
    /// Not enough memory: the task needs `need_mib`, `free_mib` are left of the usable memory.
    Memory { need_mib: u64, free_mib: u64 },
    /// The task needs more than the whole card at the batch size it starts at:
    /// waiting cannot help (see [`Placer::never_fits`]).
    TooLarge { need_mib: u64, usable_mib: u64 },
    /// Predicted aggregate SM utilisation over the cap.
    SmCap { predicted_pct: f64, cap_pct: f64 },
    /// Predicted aggregate DRAM-bandwidth utilisation over the cap.
    MemBwCap { predicted_pct: f64, cap_pct: f64 },
    /// Predicted Σ PD increase over [`PlacerParams::max_pd_increase`].
    PdCap { predicted: f64, cap: f64 },
    /// Joining would not raise the device's predicted combined normalised throughput
    /// (Σ 1/IF over its tasks) by [`PlacerParams::min_throughput_gain`]: running the
    /// task later alone does the same work sooner.
    ThroughputGain {
        before: f64,
        after: f64,
        min_gain: f64,
    },
}

impl Rejection {
    /// A short stable name, for counting rejections and for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Rejection::UnknownDevice => "unknown_device",
            Rejection::NotRegistered => "not_registered",
            Rejection::UnknownTaskMemory => "unknown_task_memory",
            Rejection::Memory { .. } => "memory",
            Rejection::TooLarge { .. } => "too_large",
            Rejection::SmCap { .. } => "sm_cap",
            Rejection::MemBwCap { .. } => "mem_bw_cap",
            Rejection::PdCap { .. } => "pd_cap",
            Rejection::ThroughputGain { .. } => "throughput_gain",
        }
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::UnknownDevice => f.write_str("unknown device"),
            Rejection::NotRegistered => {
                f.write_str("device not registered (its tuner is not running)")
            }
            Rejection::UnknownTaskMemory => f.write_str(
                "the task's memory is unknown (no request, profile or registry entry) and a \
                 resident's is not measured yet; asked again once it reports its peak",
            ),
            Rejection::Memory { need_mib, free_mib } => write!(
                f,
                "memory: the task needs {need_mib} MiB, {free_mib} MiB are free after the margin"
            ),
            Rejection::TooLarge {
                need_mib,
                usable_mib,
            } => write!(
                f,
                "never fits: the task needs {need_mib} MiB at the batch size it starts at, \
                 more than the {usable_mib} MiB this GPU has even when empty"
            ),
            Rejection::SmCap {
                predicted_pct,
                cap_pct,
            } => write!(
                f,
                "predicted SM utilisation {predicted_pct:.0}% is over the cap of {cap_pct:.0}%"
            ),
            Rejection::MemBwCap {
                predicted_pct,
                cap_pct,
            } => write!(
                f,
                "predicted memory-bandwidth utilisation {predicted_pct:.0}% is over the cap of {cap_pct:.0}%"
            ),
            Rejection::PdCap { predicted, cap } => write!(
                f,
                "predicted increase of the device's summed PD {predicted:.2} is over the cap of {cap:.2}"
            ),
            Rejection::ThroughputGain {
                before,
                after,
                min_gain,
            } => write!(
                f,
                "sharing gains too little: predicted combined normalised throughput \
                 {before:.2} → {after:.2}, less than the required gain of {min_gain:.2} \
                 (the task would do its work sooner later, alone)"
            ),
        }
    }
}

/// A device that can take the task, and what it would cost.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate<'v> {
    pub device_id: &'v str,
    /// Predicted increase of the device's Σ PD.
    pub pd_increase: f64,
    /// The same increase with every slowdown of the newcomer and of the residents
    /// next to it at the upper end of its 90 % interval (see the module docs).
    pub pd_increase_upper_90: f64,
    /// Uncertainty of that prediction (root of the summed squared model uncertainties).
    pub uncertainty: f64,
    /// What the ranking sorts by: `pd_increase + uncertainty_weight × uncertainty`.
    pub rank: f64,
    /// MiB to reserve for the task on this device.
    pub reserved_mem_mib: u64,
    /// Residents to shrink, before the task starts, to make room for it.
    pub shrinks: Vec<Shrink>,
    /// The device has no resident.
    pub idle: bool,
    /// The task's own predicted slowdown there (exactly 1 on an idle device), which the
    /// tuner uses to estimate its solo step time until it runs alone.
    pub newcomer: SlowdownEstimate,
    /// The reservation is provisional: nothing was known of the task's memory, so it is
    /// granted the device's free memory until it reports its peak.
    pub provisional: bool,
    /// Seconds a task waiting ahead, promised this device, would wait longer if the
    /// task joined it (see the module docs); 0 when no waiting task counts on it.
    pub delay_s: f64,
    tiebreak: u64,
}

/// A resident shrunk to make room for a newcomer: written as its assignment in the
/// placement's transaction, applied by its agent before the newcomer's first step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shrink {
    pub task_id: String,
    pub batch_size: u32,
    /// The memory estimator's bound at that size, MiB (the resident's new reservation).
    pub bound_mib: u64,
}

/// What a device would need to take the task.
#[derive(Clone, Debug, PartialEq)]
struct Fit {
    /// MiB to reserve for the task.
    need: u64,
    /// `need` is a provisional grant (see [`Candidate::provisional`]).
    provisional: bool,
    /// Aggregate demand of a shared device, for pre-screening; `None` when idle.
    demand: Option<f64>,
    shrinks: Vec<Shrink>,
}

/// Every device considered for one task, split into candidates and rejections.
#[derive(Clone, Debug, Default)]
pub struct Assessment<'v> {
    /// Feasible devices: the first `explain_top_k` (at least one) are the best, in
    /// order; the rest are in no particular order.
    pub candidates: Vec<Candidate<'v>>,
    /// Infeasible devices with the reason, in device order.
    pub rejected: Vec<(&'v str, Rejection)>,
    /// Feasible shared devices not scored because of the pre-screening limit.
    pub unscored: usize,
    /// Seconds until the first considered device is predicted to be idle (all its
    /// residents finished), from the residents' reported progress.
    pub earliest_idle_s: Option<f64>,
    /// Tasks waiting ahead of this one (see [`ClusterView::waiting_ahead_of`]).
    pub waiting_ahead: usize,
    /// Seconds until the (`waiting_ahead` + 1)-th considered device is predicted to be
    /// idle: the wait `W` of the queue-or-place rule (see the module docs). `None`
    /// when fewer devices say when they free up.
    pub wait_s: Option<f64>,
}

/// What [`Placer::score`] says of a shared device.
struct Score {
    /// The newcomer's own predicted slowdown.
    newcomer: SlowdownEstimate,
    pd_increase: f64,
    pd_increase_upper_90: f64,
    uncertainty: f64,
}

/// A feasible shared device waiting for the slowdown model.
struct Shared<'v> {
    id: &'v str,
    device: &'v DeviceState,
    /// MiB to reserve.
    need: u64,
    provisional: bool,
    shrinks: Vec<Shrink>,
    /// Aggregate demand, for pre-screening.
    demand: f64,
    tiebreak: u64,
    /// Seconds until its residents are predicted to finish, if they all report.
    idle_in: Option<f64>,
}

/// Orders devices by when they free up, then by id.
fn by_idle_time(a: &(f64, &str), b: &(f64, &str)) -> Ordering {
    a.0.total_cmp(&b.0).then(a.1.cmp(b.1))
}

/// What to tell the caller.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Run the task on `device_id`, reserving `reserved_mem_mib`, after shrinking the
    /// residents in `shrinks`.
    Place {
        device_id: String,
        reserved_mem_mib: u64,
        shrinks: Vec<Shrink>,
        /// The task's own predicted slowdown there (see [`Candidate::newcomer`]).
        newcomer: SlowdownEstimate,
        /// `reserved_mem_mib` is a provisional grant (see [`Candidate::provisional`]).
        provisional: bool,
    },
    /// Ask again after `retry_after`.
    Queue {
        retry_after: Duration,
        reason: String,
    },
}

/// A verdict with its explanation.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub verdict: Verdict,
    pub explanation: Explanation,
}

/// The placement policy. Cheap to share: decisions take `&self`.
///
/// Memory footprints come from the view's [`crate::model::MemoryEstimator`]
/// (see [`ClusterView::new`]), slowdowns from the placer's [`SlowdownModel`].
#[derive(Clone, Debug)]
pub struct Placer {
    params: PlacerParams,
    slowdown: Arc<dyn SlowdownModel>,
}

impl Placer {
    /// A policy with checked `params`.
    pub fn new(params: PlacerParams, slowdown: Arc<dyn SlowdownModel>) -> Result<Placer> {
        params.check()?;
        Ok(Placer { params, slowdown })
    }

    /// The parameters in force.
    pub fn params(&self) -> &PlacerParams {
        &self.params
    }

    /// The slowdown model (the daemon feeds it samples).
    pub fn slowdown_model(&self) -> &Arc<dyn SlowdownModel> {
        &self.slowdown
    }

    /// Assesses every device of `view` (or only those in `restrict`, when not empty)
    /// for `task`, predicting the degradation of every feasible device.
    pub fn assess<'v>(
        &self,
        view: &'v ClusterView,
        task: &TaskSpec,
        restrict: &'v [String],
        now_unix_ms: i64,
    ) -> Assessment<'v> {
        self.assess_limited(view, task, restrict, now_unix_ms, 0)
    }

    /// Why `task` can never run on `device_id`, whatever leaves it: the device is
    /// unknown, or the task's footprint at the batch size it starts at exceeds the whole
    /// card (what an idle device takes, see [`Placer::assess`]). `None` when waiting
    /// might help (including a device whose tuner is away, which may come back).
    ///
    /// Front ends answer such a request at once (gRPC INVALID_ARGUMENT, the extender's
    /// `FailedAndUnresolvableNodes`) instead of "queue": a task that can never start
    /// must not count as waiting ahead of later ones.
    pub fn never_fits(
        &self,
        view: &ClusterView,
        task: &TaskSpec,
        device_id: &str,
    ) -> Option<Rejection> {
        let Some(device) = view.device(device_id) else {
            return Some(Rejection::UnknownDevice);
        };
        let info = device.info.as_ref()?;
        let need_mib = view
            .memory()
            .bound_mib(task, None, task.initial_batch_size.max(1))?;
        let usable_mib = info.memory_mib;
        (need_mib > usable_mib).then_some(Rejection::TooLarge {
            need_mib,
            usable_mib,
        })
    }

    /// The reason for each device when `task` can never run on any of `restrict`
    /// (every registered device when empty); `None` when some device might take it
    /// one day, or when no device is registered yet.
    pub fn never_fits_any(
        &self,
        view: &ClusterView,
        task: &TaskSpec,
        restrict: &[String],
    ) -> Option<Vec<(String, Rejection)>> {
        let ids: Vec<&str> = if restrict.is_empty() {
            view.devices()
                .filter(|(_, d)| d.info.is_some())
                .map(|(id, _)| id)
                .collect()
        } else {
            restrict.iter().map(String::as_str).collect()
        };
        if ids.is_empty() {
            return None;
        }
        ids.into_iter()
            .map(|id| Some((id.to_owned(), self.never_fits(view, task, id)?)))
            .collect()
    }

    /// Like [`Placer::assess`], but with `limit` > 0 the slowdown model is asked only
    /// about the `limit` feasible shared devices with the least aggregate demand
    /// (sum of the solo utilisations on the busiest resource, plus 10 points per
    /// resident); idle devices are always scored (exactly 1.0, no model needed). This
    /// bounds a decision's cost on a large cluster, where a learned model costs
    /// microseconds per prediction and a device needs 2n + 1 of them, the way
    /// kube-scheduler scores only a share of the feasible nodes.
    pub fn assess_limited<'v>(
        &self,
        view: &'v ClusterView,
        task: &TaskSpec,
        restrict: &'v [String],
        now_unix_ms: i64,
        limit: usize,
    ) -> Assessment<'v> {
        let new_profile = profile_of(task, None);
        // The task starts at its submitted batch size (its starting assignment).
        let new_footprint = view
            .memory()
            .bound_mib(task, None, task.initial_batch_size.max(1));
        let task_hash = crate::view::fnv1a(task.task_id.as_bytes());
        let mut out = Assessment {
            waiting_ahead: view.waiting_ahead_of(task, now_unix_ms),
            ..Assessment::default()
        };
        // Seconds until each considered device with residents is predicted to be idle,
        // with its id (ties in time are ordered by id, so "the first q" is well defined).
        let mut idle_in_s: Vec<(f64, &'v str)> = Vec::new();
        // Feasible shared devices waiting for the model.
        let mut shared: Vec<Shared<'v>> = Vec::new();
        let mut consider =
            |id: &'v str, device: Option<&'v DeviceState>, out: &mut Assessment<'v>| {
                let Some(device) = device else {
                    out.rejected.push((id, Rejection::UnknownDevice));
                    return;
                };
                let idle_in = device
                    .summary()
                    .idle_at_unix_ms
                    .map(|at| (at - now_unix_ms).max(0) as f64 / 1000.0);
                if device.info.is_some()
                    && let Some(s) = idle_in
                {
                    idle_in_s.push((s, id));
                }
                let tiebreak = tiebreak(task_hash, device.id_hash);
                match self.feasible(device, &new_profile, new_footprint, view.memory()) {
                    Ok(Fit {
                        need,
                        provisional,
                        demand: None,
                        shrinks,
                    }) => out.candidates.push(Candidate {
                        device_id: id,
                        pd_increase: 1.0,
                        pd_increase_upper_90: 1.0,
                        uncertainty: 0.0,
                        rank: 1.0,
                        reserved_mem_mib: need,
                        shrinks,
                        idle: true,
                        newcomer: SlowdownEstimate::certain(1.0),
                        provisional,
                        delay_s: 0.0,
                        tiebreak,
                    }),
                    Ok(Fit {
                        need,
                        provisional,
                        demand: Some(demand),
                        shrinks,
                    }) => shared.push(Shared {
                        id,
                        device,
                        need,
                        provisional,
                        shrinks,
                        demand,
                        tiebreak,
                        idle_in,
                    }),
                    Err(rejection) => out.rejected.push((id, rejection)),
                }
            };
        if restrict.is_empty() {
            for (id, device) in view.devices() {
                consider(id, Some(device), &mut out);
            }
        } else {
            for id in restrict {
                consider(id.as_str(), view.device(id), &mut out);
            }
        }
        out.earliest_idle_s = idle_in_s.iter().map(|(s, _)| *s).reduce(f64::min);
        let q = out.waiting_ahead;
        // The (q+1)-th device to free up: W, and the bound below which a device is
        // promised to a task ahead. With fewer such devices than tasks ahead, every
        // device that says when it frees up is promised to one.
        let promised_below = if q < idle_in_s.len() {
            let (_, w, _) = idle_in_s.select_nth_unstable_by(q, by_idle_time);
            out.wait_s = Some(w.0);
            Some(*w)
        } else {
            None
        };
        let promised = |id: &'v str, idle_in: Option<f64>| match (idle_in, promised_below) {
            (None, _) => false,
            (Some(s), Some(bound)) => by_idle_time(&(s, id), &bound) == Ordering::Less,
            (Some(_), None) => q > 0,
        };
        // At least a second: the delay is priced per second of it.
        let duration_s = self.expected_duration_s(task).max(1.0);
        if limit > 0 && shared.len() > limit {
            shared.select_nth_unstable_by(limit - 1, |a, b| {
                a.demand
                    .partial_cmp(&b.demand)
                    .unwrap_or(Ordering::Equal)
                    .then(a.tiebreak.cmp(&b.tiebreak))
            });
            out.unscored = shared.len() - limit;
            shared.truncate(limit);
        }
        let mut scratch = Vec::new();
        let pinned = self.slowdown.pinned();
        let model = pinned.as_deref().unwrap_or(&*self.slowdown);
        for Shared {
            id,
            device,
            need,
            provisional,
            shrinks,
            tiebreak,
            idle_in,
            ..
        } in shared
        {
            match self.score(model, device, &new_profile, &mut scratch) {
                Ok(Score {
                    newcomer,
                    pd_increase,
                    pd_increase_upper_90,
                    uncertainty,
                }) => {
                    let delay_s = match idle_in {
                        Some(r) if promised(id, idle_in) => (duration_s - r).max(0.0),
                        _ => 0.0,
                    };
                    out.candidates.push(Candidate {
                        device_id: id,
                        pd_increase,
                        pd_increase_upper_90,
                        uncertainty,
                        rank: pd_increase
                            + self.params.uncertainty_weight * uncertainty
                            + delay_s / duration_s,
                        reserved_mem_mib: need,
                        shrinks,
                        idle: false,
                        newcomer,
                        provisional,
                        delay_s,
                        tiebreak,
                    })
                }
                Err(rejection) => out.rejected.push((id, rejection)),
            }
        }
        // Only the head needs ordering: the best and the few an explanation lists.
        let head = self.params.explain_top_k.max(1);
        if out.candidates.len() > head {
            out.candidates.select_nth_unstable_by(head - 1, better);
        }
        let head = head.min(out.candidates.len());
        out.candidates[..head].sort_unstable_by(better);
        out
    }

    /// Memory and utilisation feasibility of one device: the MiB to reserve, the
    /// residents to shrink first, and for a shared device its aggregate demand.
    fn feasible(
        &self,
        device: &DeviceState,
        new_profile: &TaskProfile,
        new_footprint: Option<u64>,
        memory: &dyn MemoryEstimator,
    ) -> Result<Fit, Rejection> {
        let info = device.info.as_ref().ok_or(Rejection::NotRegistered)?;
        let summary = device.summary();
        let usable = self.params.usable_memory_mib(info.memory_mib);
        if device.residents.is_empty() {
            // Nothing shares the card: the task fits if it fits the card at all, and one
            // nothing is known of is granted all of it (its first report settles that).
            let need = new_footprint.unwrap_or(info.memory_mib);
            if need == 0 || need > info.memory_mib {
                return Err(Rejection::Memory {
                    need_mib: need,
                    free_mib: info.memory_mib,
                });
            }
            return Ok(Fit {
                need,
                provisional: new_footprint.is_none(),
                demand: None,
                shrinks: Vec::new(),
            });
        }
        let free = usable.saturating_sub(summary.used_mib);
        let (need, provisional) = match new_footprint {
            Some(need) => (need, false),
            None => (
                self.unknown_memory_grant(device, info.memory_mib, free)?,
                true,
            ),
        };
        if need == 0 {
            return Err(Rejection::Memory {
                need_mib: need,
                free_mib: free,
            });
        }
        let shrinks = if need <= free {
            Vec::new()
        } else {
            shrink_plan(device, memory, usable, need).ok_or(Rejection::Memory {
                need_mib: need,
                free_mib: free,
            })?
        };
        let sm = summary.sm_util_pct + new_profile.sm_util_pct.unwrap_or(0.0);
        if sm > self.params.sm_util_cap_pct {
            return Err(Rejection::SmCap {
                predicted_pct: sm,
                cap_pct: self.params.sm_util_cap_pct,
            });
        }
        let bw = summary.mem_bw_util_pct + new_profile.mem_bw_util_pct.unwrap_or(0.0);
        if bw > self.params.mem_bw_util_cap_pct {
            return Err(Rejection::MemBwCap {
                predicted_pct: bw,
                cap_pct: self.params.mem_bw_util_cap_pct,
            });
        }
        Ok(Fit {
            need,
            provisional,
            demand: Some(sm.max(bw) + 10.0 * device.residents.len() as f64),
            shrinks,
        })
    }

    /// The provisional grant of a task nothing is known of on a shared device: all of its
    /// `free_mib`, when every resident's memory is known (a second guess on a card whose
    /// first one is not measured yet could over-pack it) and at least
    /// [`PlacerParams::min_unknown_memory_share`] of the card is free. The task's agent
    /// fences its allocator at the grant, so a task that needs more fails its own
    /// allocation and falls back, never its co-runners'; its first report replaces the
    /// grant with its measured peak ([`crate::PlacementService::settle_provisional`]).
    fn unknown_memory_grant(
        &self,
        device: &DeviceState,
        card_mib: u64,
        free_mib: u64,
    ) -> Result<u64, Rejection> {
        if device.residents.iter().any(|r| r.memory_unmeasured()) {
            return Err(Rejection::UnknownTaskMemory);
        }
        let least = (card_mib as f64 * self.params.min_unknown_memory_share).ceil() as u64;
        if free_mib < least.max(1) {
            return Err(Rejection::Memory {
                need_mib: least,
                free_mib,
            });
        }
        Ok(free_mib)
    }

    /// Predicted Σ PD increase of a shared device, pessimistic and not, and its
    /// uncertainty.
    fn score(
        &self,
        model: &dyn SlowdownModel,
        device: &DeviceState,
        new_profile: &TaskProfile,
        scratch: &mut Vec<TaskProfile>,
    ) -> Result<Score, Rejection> {
        let kind = device.info.as_ref().map_or("", |i| i.kind.as_str());
        let profiles = &device.summary().profiles;
        let own = model.predict(kind, new_profile, profiles);
        let mut increase = own.slowdown;
        let mut increase_upper = own.upper_90.max(own.slowdown);
        // Combined normalised throughput Σ 1/IF, with the newcomer and without it.
        let mut after = throughput(own.slowdown);
        let mut before = 0.0;
        let mut variance = own.uncertainty * own.uncertainty;
        // Each resident's slowdown among the residents alone: reused while neither the
        // residents nor the model changed (see `SlowdownCache`).
        let version = model.version();
        let alone = match version.and_then(|v| device.alone_together.get(v)) {
            Some(cached) if cached.slowdowns.len() == profiles.len() => cached,
            _ => {
                let mut fresh = AloneTogether {
                    slowdowns: Vec::with_capacity(profiles.len()),
                    prefixes: Vec::new(),
                };
                for (i, me) in profiles.iter().enumerate() {
                    fill_profiles(scratch, others(profiles, i));
                    fresh
                        .slowdowns
                        .push(model.predict(kind, me, scratch).slowdown);
                    // Only reused when it spares work: with one resident, the pair
                    // with the newcomer is the whole prediction.
                    if version.is_some()
                        && profiles.len() >= 2
                        && let Some(prefix) = model.pairwise_prefix(kind, me, scratch)
                    {
                        fresh.prefixes.push(prefix);
                    }
                }
                if fresh.prefixes.len() != profiles.len() {
                    fresh.prefixes.clear();
                }
                let fresh = Arc::new(fresh);
                if let Some(v) = version {
                    device.alone_together.put(v, fresh.clone());
                }
                fresh
            }
        };
        let without = &alone.slowdowns;
        // Each resident's slowdown with the newcomer too: from the cached pairs among
        // the residents plus the newcomer's pair when the model composes pairwise,
        // else predicted over the whole list.
        for (i, me) in profiles.iter().enumerate() {
            let extended = alone
                .prefixes
                .get(i)
                .and_then(|prefix| model.predict_extending(kind, me, prefix, new_profile));
            let with = match extended {
                Some(with) => with,
                None => {
                    fill_profiles(
                        scratch,
                        others(profiles, i).chain(std::iter::once(new_profile)),
                    );
                    model.predict(kind, me, scratch)
                }
            };
            increase += with.slowdown - without[i];
            increase_upper += with.upper_90.max(with.slowdown) - without[i];
            variance += with.uncertainty * with.uncertainty;
            after += throughput(with.slowdown);
            before += throughput(without[i]);
        }
        if increase > self.params.max_pd_increase {
            return Err(Rejection::PdCap {
                predicted: increase,
                cap: self.params.max_pd_increase,
            });
        }
        if after - before < self.params.min_throughput_gain {
            return Err(Rejection::ThroughputGain {
                before,
                after,
                min_gain: self.params.min_throughput_gain,
            });
        }
        Ok(Score {
            newcomer: own,
            pd_increase: increase,
            pd_increase_upper_90: increase_upper,
            uncertainty: variance.sqrt(),
        })
    }

    /// Decides where `task` goes (among `restrict`, when not empty), or that it waits.
    pub fn decide(
        &self,
        view: &ClusterView,
        task: &TaskSpec,
        restrict: &[String],
        now_unix_ms: i64,
    ) -> Decision {
        let assessment = self.assess_limited(
            view,
            task,
            restrict,
            now_unix_ms,
            self.params.max_scored_devices,
        );
        let verdict = self.verdict(task, &assessment);
        let explanation = self.explain(&assessment, &verdict);
        Decision {
            verdict,
            explanation,
        }
    }

    /// The task's solo duration `D` (see the module docs), or the assumed one when
    /// its spec does not say how much work it has.
    pub fn expected_duration_s(&self, task: &TaskSpec) -> f64 {
        solo_duration_s(task).unwrap_or(self.params.assumed_task_duration.as_secs_f64())
    }

    fn retry_hint(&self, wait_s: Option<f64>) -> Duration {
        let p = &self.params;
        match wait_s {
            Some(w) if w.is_finite() => {
                Duration::from_secs_f64(w.max(0.0)).clamp(p.min_retry_after, p.max_retry_after)
            }
            _ => p.min_retry_after.max(p.max_retry_after / 10),
        }
    }

    /// Queue or place, given the assessment of the devices (see the module docs).
    pub fn verdict(&self, task: &TaskSpec, assessment: &Assessment<'_>) -> Verdict {
        let wait = assessment.wait_s;
        let ahead = assessment.waiting_ahead;
        let Some(best) = assessment.candidates.first() else {
            let reason = if assessment.rejected.is_empty() {
                "no device is registered".to_owned()
            } else {
                format!(
                    "no device can take the task now ({})",
                    rejection_counts(&assessment.rejected)
                )
            };
            return Verdict::Queue {
                // Something may change when the first device frees up, even with a queue.
                retry_after: self.retry_hint(wait.or(assessment.earliest_idle_s)),
                reason: format!("{reason}; {}", waiting_ahead_text(ahead)),
            };
        };
        let place = Verdict::Place {
            device_id: best.device_id.to_owned(),
            reserved_mem_mib: best.reserved_mem_mib,
            shrinks: best.shrinks.clone(),
            newcomer: best.newcomer,
            provisional: best.provisional,
        };
        if best.idle {
            return place;
        }
        let excess = (best.pd_increase_upper_90 - 1.0).max(0.0);
        let duration_s = self.expected_duration_s(task);
        let cost_place_s = excess * duration_s + best.delay_s;
        match wait {
            Some(w) if w * self.params.wait_cost_factor < cost_place_s => Verdict::Queue {
                retry_after: self.retry_hint(Some(w)),
                reason: format!(
                    "waiting about {w:.0} s for a device to become idle ({}, so it waits \
                     for the {} device to free up) costs less than running now on {} \
                     (predicted summed PD +{:.2}, up to +{:.2} at the upper ends of the \
                     90 % intervals: {excess:.2} × {duration_s:.0} s of solo-speed \
                     progress lost, plus {:.0} s of delay to a task waiting ahead that \
                     counts on that device)",
                    waiting_ahead_text(ahead),
                    ordinal(ahead + 1),
                    best.device_id,
                    best.pd_increase,
                    best.pd_increase_upper_90,
                    best.delay_s
                ),
            },
            _ => place,
        }
    }

    fn explain(&self, assessment: &Assessment<'_>, verdict: &Verdict) -> Explanation {
        let k = self.params.explain_top_k;
        let mut candidates: Vec<CandidateScore> = assessment
            .candidates
            .iter()
            .take(k)
            .map(|c| CandidateScore {
                device_id: c.device_id.to_owned(),
                predicted_pd_increase: c.pd_increase,
                uncertainty: c.uncertainty,
                feasible: true,
                rejected_because: String::new(),
            })
            .collect();
        candidates.extend(
            assessment
                .rejected
                .iter()
                .take(k)
                .map(|(id, why)| CandidateScore {
                    device_id: (*id).to_owned(),
                    predicted_pd_increase: 0.0,
                    uncertainty: 0.0,
                    feasible: false,
                    rejected_because: why.to_string(),
                }),
        );
        let head = match verdict {
            Verdict::Place { device_id, .. } => {
                let best = assessment.candidates.first();
                format!(
                    "placed on {device_id}: predicted summed PD +{:.2} (±{:.2}); {}",
                    best.map_or(0.0, |c| c.pd_increase),
                    best.map_or(0.0, |c| c.uncertainty),
                    waiting_ahead_text(assessment.waiting_ahead)
                )
            }
            Verdict::Queue {
                retry_after,
                reason,
            } => {
                format!("queued, retry after {} s: {reason}", retry_after.as_secs())
            }
        };
        let rejected = if assessment.rejected.is_empty() {
            "none rejected".to_owned()
        } else {
            format!(
                "{} rejected ({})",
                assessment.rejected.len(),
                rejection_counts(&assessment.rejected)
            )
        };
        let unscored = if assessment.unscored > 0 {
            format!(
                " ({} more feasible shared devices not scored: busier than the {} scored)",
                assessment.unscored, self.params.max_scored_devices
            )
        } else {
            String::new()
        };
        Explanation {
            summary: format!(
                "{head}; {} feasible{unscored}, {rejected}",
                assessment.candidates.len()
            ),
            candidates,
        }
    }
}

/// "no task waits ahead", "1 task waits ahead", "3 tasks wait ahead".
fn waiting_ahead_text(ahead: usize) -> String {
    match ahead {
        0 => "no task waits ahead".to_owned(),
        1 => "1 task waits ahead".to_owned(),
        n => format!("{n} tasks wait ahead"),
    }
}

/// "1st", "2nd", "3rd", "4th", … "11th", "21st".
fn ordinal(n: usize) -> String {
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

/// "memory: 12, sm_cap: 3", in a stable order.
fn rejection_counts(rejected: &[(&str, Rejection)]) -> String {
    let mut counts: Vec<(&'static str, usize)> = Vec::new();
    for (_, why) in rejected {
        match counts.iter_mut().find(|(k, _)| *k == why.kind()) {
            Some((_, n)) => *n += 1,
            None => counts.push((why.kind(), 1)),
        }
    }
    counts.sort();
    counts
        .iter()
        .map(|(k, n)| format!("{k}: {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Normalised throughput of a task slowed down `slowdown`× (1 alone); a slowdown
/// below 1 (a model's noise) counts as 1, so sharing never looks like a speed-up.
fn throughput(slowdown: f64) -> f64 {
    if slowdown.is_finite() && slowdown > 1.0 {
        1.0 / slowdown
    } else if slowdown.is_nan() || slowdown == f64::INFINITY {
        0.0
    } else {
        1.0
    }
}

/// Makes `scratch` a copy of `profiles`, in order, reusing the strings already
/// there: a decision builds ~150 co-runner lists, and cloning each profile afresh
/// (its `model` string) cost an allocation and a free per co-runner.
fn fill_profiles<'a>(
    scratch: &mut Vec<TaskProfile>,
    profiles: impl Iterator<Item = &'a TaskProfile>,
) {
    let mut len = 0;
    for p in profiles {
        match scratch.get_mut(len) {
            Some(slot) => copy_profile(slot, p),
            None => scratch.push(p.clone()),
        }
        len += 1;
    }
    scratch.truncate(len);
}

/// `*to = from.clone()`, keeping `to`'s string buffer (prost's derived `Clone` has
/// no `clone_from`). Destructured so a new field of `TaskProfile` fails to compile
/// here instead of being left out.
fn copy_profile(to: &mut TaskProfile, from: &TaskProfile) {
    let TaskProfile {
        model,
        batch_size,
        solo_step_time_s,
        sm_util_pct,
        mem_bw_util_pct,
        gpu_mem_mib,
    } = from;
    to.model.clone_from(model);
    to.batch_size = *batch_size;
    to.solo_step_time_s = *solo_step_time_s;
    to.sm_util_pct = *sm_util_pct;
    to.mem_bw_util_pct = *mem_bw_util_pct;
    to.gpu_mem_mib = *gpu_mem_mib;
}

/// Every profile but the `i`-th: resident `i`'s co-runners.
fn others(profiles: &[TaskProfile], i: usize) -> impl Iterator<Item = &TaskProfile> {
    profiles
        .iter()
        .enumerate()
        .filter(move |&(j, _)| j != i)
        .map(|(_, p)| p)
}

/// Shrinks of `device`'s residents after which a newcomer needing `need` MiB fits in
/// `usable`, or `None` when no shrink makes room.
///
/// Each resident may step down its candidate batch sizes (the tuner's lattice, within the
/// sizes it allows); at a smaller size it is counted at the estimator's bound there, which
/// never drops below its bound at the smallest size it was measured at (weights and
/// optimiser state do not shrink), so only what the tuner grew can be given back. Greedy:
/// the step that frees the most memory first, so as few residents move as little as
/// possible.
fn shrink_plan(
    device: &DeviceState,
    memory: &dyn MemoryEstimator,
    usable: u64,
    need: u64,
) -> Option<Vec<Shrink>> {
    struct Steps {
        /// (batch size, MiB) from the current size downwards; the first is what it uses now.
        steps: Vec<(u32, u64)>,
        at: usize,
    }
    let mut options: Vec<Steps> = device
        .residents
        .iter()
        .map(|r| {
            let current = r.batch_size();
            let mut steps = vec![(current, r.footprint_mib(memory))];
            let mut sizes = iadeep_tuner::device_tuner::candidate_sizes(r.spec());
            sizes.retain(|&b| b < current);
            for b in sizes.into_iter().rev() {
                match memory.bound_mib(r.spec(), r.report.as_ref(), b) {
                    Some(mib) => steps.push((b, mib)),
                    None => break,
                }
            }
            Steps { steps, at: 0 }
        })
        .collect();
    let mut used: u64 = options.iter().map(|o| o.steps[0].1).sum();
    while used + need > usable {
        let (best, saving) = options
            .iter()
            .enumerate()
            .filter_map(|(i, o)| {
                let now = o.steps[o.at].1;
                let next = o.steps.get(o.at + 1)?.1;
                Some((i, now.saturating_sub(next)))
            })
            .max_by_key(|&(i, saving)| (saving, std::cmp::Reverse(i)))?;
        if saving == 0 {
            return None;
        }
        let o = &mut options[best];
        used -= saving;
        o.at += 1;
    }
    Some(
        device
            .residents
            .iter()
            .zip(&options)
            .filter(|(_, o)| o.at > 0)
            .map(|(r, o)| Shrink {
                task_id: r.reservation.task_id.clone(),
                batch_size: o.steps[o.at].0,
                bound_mib: o.steps[o.at].1,
            })
            .collect(),
    )
}

/// Solo run time of the whole task: total samples × solo step time ÷ batch size.
pub fn solo_duration_s(task: &TaskSpec) -> Option<f64> {
    let total = task.total_samples? as f64;
    let profile = task.profile.as_ref()?;
    let step = profile.step_time_s?;
    let batch = if profile.batch_size > 0 {
        profile.batch_size
    } else {
        task.initial_batch_size
    };
    (batch > 0 && step.is_finite() && step > 0.0).then(|| total * step / f64::from(batch))
}

/// Mixes the task's and the device's id hashes (SplitMix64 finaliser), so each task
/// orders equally good devices differently.
fn tiebreak(task_hash: u64, device_hash: u64) -> u64 {
    let mut z = task_hash ^ device_hash.rotate_left(29);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Best first: by rank, then by the per-task tie-break.
fn better(a: &Candidate<'_>, b: &Candidate<'_>) -> Ordering {
    a.rank
        .partial_cmp(&b.rank)
        .unwrap_or(Ordering::Equal)
        .then(a.tiebreak.cmp(&b.tiebreak))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ModelledMemory, SlowdownEstimate};
    use iadeep_proto::CoLocationSample;

    /// A fixed rule so the expected numbers can be worked out by hand: a GPU time-slices,
    /// so IF = max(1, ΣSM / 100, ΣBW / 100) over the task and its co-runners.
    #[derive(Debug)]
    struct TimeShare;

    impl SlowdownModel for TimeShare {
        fn predict(
            &self,
            _: &str,
            task: &TaskProfile,
            corunners: &[TaskProfile],
        ) -> SlowdownEstimate {
            let all = || std::iter::once(task).chain(corunners);
            let sm: f64 = all().map(|p| p.sm_util_pct.unwrap_or(100.0)).sum();
            let bw: f64 = all().map(|p| p.mem_bw_util_pct.unwrap_or(100.0)).sum();
            SlowdownEstimate::certain((sm / 100.0).max(bw / 100.0).max(1.0))
        }
        fn observe(&self, _: &CoLocationSample) {}
    }
    use iadeep_proto::{DeviceInfo, DeviceResidents, Reservation, SoloProfile, TaskReport};
    use proptest::prelude::*;

    #[test]
    fn scratch_profiles_are_exact_copies_whatever_was_there() {
        let p = |model: &str, b: u32, sm: Option<f64>| TaskProfile {
            model: model.into(),
            batch_size: b,
            solo_step_time_s: f64::from(b) / 100.0,
            sm_util_pct: sm,
            mem_bw_util_pct: sm.map(|v| v / 2.0),
            gpu_mem_mib: Some(u64::from(b) * 10),
        };
        let long = vec![
            p("a", 1, None),
            p("bbbbbbbb", 2, Some(3.0)),
            p("c", 3, None),
        ];
        let short = vec![p("zz", 9, Some(1.0))];
        let mut scratch = Vec::new();
        for want in [&long, &short, &long, &Vec::new(), &short] {
            fill_profiles(&mut scratch, want.iter());
            assert_eq!(&scratch, want);
        }
        fill_profiles(
            &mut scratch,
            others(&long, 1).chain(std::iter::once(&short[0])),
        );
        assert_eq!(
            scratch,
            vec![long[0].clone(), long[2].clone(), short[0].clone()]
        );
    }

    fn placer() -> Placer {
        Placer::new(PlacerParams::default(), Arc::new(TimeShare)).expect("valid params")
    }

    /// The queue-or-place rule alone: these tests pair heavy tasks (SM 95% each, a
    /// combined throughput gain of only 0.05 under [`TimeShare`]) that the throughput
    /// guard would otherwise reject before the rule is reached.
    fn queue_rule_placer() -> Placer {
        let params = PlacerParams {
            min_throughput_gain: 0.0,
            ..Default::default()
        };
        Placer::new(params, Arc::new(TimeShare)).expect("valid params")
    }

    fn spec(id: &str, mib: u64, sm: f64, total: Option<u64>) -> TaskSpec {
        TaskSpec {
            task_id: id.into(),
            initial_batch_size: 32,
            gpu_mem_request_mib: mib,
            total_samples: total,
            profile: Some(SoloProfile {
                batch_size: 32,
                step_time_s: Some(0.1),
                sm_util_pct: Some(sm),
                mem_bw_util_pct: Some(sm / 2.0),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn device(view: &mut ClusterView, id: &str, mib: u64, residents: &[TaskSpec]) {
        view.upsert_device(DeviceInfo {
            device_id: id.into(),
            node: "n".into(),
            memory_mib: mib,
            kind: "v100".into(),
            ..Default::default()
        });
        if !residents.is_empty() {
            let record = DeviceResidents {
                device_id: id.into(),
                reservations: residents
                    .iter()
                    .map(|s| Reservation {
                        task_id: s.task_id.clone(),
                        reserved_mem_mib: s.gpu_mem_request_mib,
                        spec: Some(s.clone()),
                        ..Default::default()
                    })
                    .collect(),
            };
            view.apply_residents(id, Some(record), 1);
        }
    }

    #[test]
    fn requests_no_card_can_ever_hold_never_fit_and_others_may_wait() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "small", 16_384, &[spec("r", 10_000, 50.0, None)]);
        let p = placer();
        // An idle card takes a task alone without the margin: the whole card counts.
        let usable = 16_384;
        // Too large even for the empty card: waiting cannot help.
        assert_eq!(
            p.never_fits(&view, &spec("huge", usable + 1, 10.0, None), "small"),
            Some(Rejection::TooLarge {
                need_mib: usable + 1,
                usable_mib: usable
            })
        );
        // Does not fit next to the resident now, but would once it leaves.
        assert_eq!(
            p.never_fits(&view, &spec("later", usable, 10.0, None), "small"),
            None
        );
        assert_eq!(
            p.never_fits(&view, &spec("x", 1, 10.0, None), "nope"),
            Some(Rejection::UnknownDevice)
        );
        // A task of unknown size may still get a whole card.
        assert_eq!(
            p.never_fits(&view, &spec("unknown", 0, 10.0, None), "small"),
            None
        );
    }

    #[test]
    fn prefers_the_device_that_adds_least_degradation() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "busy", 32_000, &[spec("r1", 4000, 90.0, None)]);
        device(&mut view, "light", 32_000, &[spec("r2", 4000, 10.0, None)]);
        let d = placer().decide(&view, &spec("new", 4000, 80.0, None), &[], 0);
        // With "light": SM 10 + 80 = 90% < 100, no slowdown: increase exactly 1.
        // With "busy": SM 170% → both slow down 1.7×: 1.7 + 0.7.
        assert!(
            matches!(&d.verdict, Verdict::Place { device_id, reserved_mem_mib: 4000, shrinks, provisional: false, .. }
                if device_id == "light" && shrinks.is_empty()),
            "{:?}",
            d.verdict
        );
        let scores: Vec<(&str, f64)> = d
            .explanation
            .candidates
            .iter()
            .map(|c| (c.device_id.as_str(), c.predicted_pd_increase))
            .collect();
        assert_eq!(scores[0], ("light", 1.0));
        assert_eq!(scores[1].0, "busy");
        assert!((scores[1].1 - 2.4).abs() < 1e-9, "{scores:?}");
        assert!(
            d.explanation.summary.starts_with("placed on light"),
            "{}",
            d.explanation.summary
        );
    }

    #[test]
    fn rejections_say_why_and_unknown_memory_is_granted_what_is_free() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "full", 16_000, &[spec("r1", 14_000, 10.0, None)]);
        device(
            &mut view,
            "hot",
            32_000,
            &[spec("r2", 1000, 100.0, None), spec("r3", 1000, 100.0, None)],
        );
        let d = placer().decide(&view, &spec("new", 4000, 50.0, None), &[], 0);
        let Verdict::Queue { reason, .. } = &d.verdict else {
            panic!("expected queue, got {:?}", d.verdict);
        };
        assert!(
            reason.contains("memory: 1") && reason.contains("sm_cap: 1"),
            "{reason}"
        );
        let why: Vec<&str> = d
            .explanation
            .candidates
            .iter()
            .map(|c| c.rejected_because.as_str())
            .collect();
        assert!(
            why.iter()
                .any(|w| w.starts_with("memory: the task needs 4000 MiB")),
            "{why:?}"
        );

        let mut unknown = spec("mystery", 0, 50.0, None);
        unknown.profile = None;
        device(&mut view, "idle", 16_000, &[]);
        device(&mut view, "roomy", 80_000, &[spec("r4", 1000, 10.0, None)]);
        let d = placer().decide(&view, &unknown, &[], 0);
        assert!(
            matches!(&d.verdict, Verdict::Place { device_id, reserved_mem_mib, .. } if device_id == "idle" && *reserved_mem_mib == 16_000),
            "{:?}",
            d.verdict
        );
        // A shared card whose residents' memory is known grants it all its free memory,
        // provisionally (its agent fences there until its first report settles it).
        let free = PlacerParams::default().usable_memory_mib(80_000) - 1000;
        let d = placer().decide(&view, &unknown, &["roomy".into(), "ghost".into()], 0);
        assert!(
            matches!(&d.verdict, Verdict::Place { device_id, reserved_mem_mib, provisional: true, .. }
                if device_id == "roomy" && *reserved_mem_mib == free),
            "{:?}",
            d.verdict
        );
        // ... but not while a resident's own grant is not measured yet: two guesses on
        // one card could over-pack it. Unknown ids are named.
        let mut guessed = view
            .device("roomy")
            .map(|d| d.residents_record("roomy"))
            .expect("roomy");
        guessed.reservations[0].provisional = true;
        view.apply_residents("roomy", Some(guessed), 2);
        let d = placer().decide(&view, &unknown, &["roomy".into(), "ghost".into()], 0);
        assert!(matches!(d.verdict, Verdict::Queue { .. }));
        assert!(
            d.explanation.summary.contains("unknown_device: 1"),
            "{}",
            d.explanation.summary
        );
        assert!(
            d.explanation.summary.contains("unknown_task_memory: 1"),
            "{}",
            d.explanation.summary
        );
    }

    #[test]
    fn queues_when_a_device_frees_up_soon_and_places_when_nobody_reports_progress() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        let resident = spec("r1", 4000, 95.0, Some(10_000));
        device(&mut view, "d0", 32_000, std::slice::from_ref(&resident));
        let new = spec("new", 4000, 95.0, Some(1_000_000)); // 1e6 × 0.1 / 32 ≈ 3125 s alone
        // Nobody reports: the wait is unknown, so the task is placed despite the cost.
        let d = queue_rule_placer().decide(&view, &new, &[], 0);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
        // The resident has 9,000 samples left at 900/s: free in 10 s. Placing costs
        // (1.9 + 0.9 − 1) × 3125 s; waiting 10 s is far cheaper.
        view.set_report(TaskReport {
            task_id: "r1".into(),
            samples_done: 1000,
            samples_per_s: 900.0,
            reported_at_unix_ms: 0,
            ..Default::default()
        });
        let d = queue_rule_placer().decide(&view, &new, &[], 0);
        match d.verdict {
            Verdict::Queue {
                retry_after,
                reason,
            } => {
                assert_eq!(retry_after, Duration::from_secs(10));
                assert!(reason.contains("waiting about 10 s"), "{reason}");
            }
            other => panic!("expected queue, got {other:?}"),
        }
        // A light newcomer costs nothing extra: placed even though a device frees soon.
        let d =
            queue_rule_placer().decide(&view, &spec("light", 1000, 4.0, Some(1_000_000)), &[], 0);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
    }

    /// Every task next to company slows down 1.2×, but the model is unsure: the
    /// upper end of its 90 % interval is `upper`.
    #[derive(Debug)]
    struct Unsure {
        upper: f64,
    }

    impl SlowdownModel for Unsure {
        fn predict(&self, _: &str, _: &TaskProfile, co: &[TaskProfile]) -> SlowdownEstimate {
            if co.is_empty() {
                return SlowdownEstimate::certain(1.0);
            }
            SlowdownEstimate {
                slowdown: 1.2,
                uncertainty: 0.1,
                upper_90: self.upper,
            }
        }
        fn observe(&self, _: &CoLocationSample) {}
    }

    /// The queue-or-place rule charges the upper ends of the 90 % intervals: the same
    /// predicted slowdowns place the task when the model is sure and queue it when
    /// the model says they could be much worse.
    #[test]
    fn an_unsure_co_location_is_charged_at_the_upper_end_of_its_interval() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        // Free in (2,701,000 − 1,000) / 900 = 3,000 s.
        let resident = spec("r1", 4000, 50.0, Some(2_701_000));
        device(&mut view, "d0", 32_000, std::slice::from_ref(&resident));
        view.set_report(TaskReport {
            task_id: "r1".into(),
            samples_done: 1000,
            samples_per_s: 900.0,
            reported_at_unix_ms: 0,
            ..Default::default()
        });
        let new = spec("new", 4000, 50.0, Some(1_000_000)); // 3,125 s alone
        let decide = |upper: f64| {
            Placer::new(PlacerParams::default(), Arc::new(Unsure { upper }))
                .expect("valid params")
                .decide(&view, &new, &[], 0)
        };
        // Sure: (1.2 + 0.2 − 1) × 3,125 s = 1,250 s lost < 3,000 s of waiting.
        let sure = decide(1.2);
        assert!(
            matches!(sure.verdict, Verdict::Place { .. }),
            "{:?}",
            sure.verdict
        );
        // Unsure: (2.0 + 1.0 − 1) × 3,125 s = 6,250 s lost > 3,000 s of waiting.
        let unsure = decide(2.0);
        let Verdict::Queue { reason, .. } = &unsure.verdict else {
            panic!("expected queue, got {:?}", unsure.verdict);
        };
        assert!(reason.contains("+1.40, up to +3.00"), "{reason}");
    }

    /// A view with shared devices `(id, MiB of the resident, seconds until it
    /// finishes)`, each resident reporting 900 samples/s, and `ahead` tasks told to
    /// queue before the newcomer submitted at 5 s.
    fn freeing_view(devices: &[(&str, u64, u64)], ahead: usize) -> ClusterView {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        for (id, mib, left_s) in devices {
            let resident = format!("r-{id}");
            device(
                &mut view,
                id,
                32_000,
                &[spec(&resident, *mib, 40.0, Some(1000 + 900 * left_s))],
            );
            view.set_report(TaskReport {
                task_id: resident,
                samples_done: 1000,
                samples_per_s: 900.0,
                reported_at_unix_ms: 0,
                ..Default::default()
            });
        }
        for k in 0..ahead {
            let mut earlier = spec(&format!("early{k}"), 4000, 95.0, None);
            earlier.submitted_at_unix_ms = 1_000;
            view.note_waiting(&earlier, 0, 600_000);
        }
        view
    }

    fn light_newcomer() -> TaskSpec {
        // 1e6 samples × 0.1 s / 32 = 3125 s alone; at 4% SM it slows nobody.
        let mut new = spec("new", 1000, 4.0, Some(1_000_000));
        new.submitted_at_unix_ms = 5_000;
        new
    }

    /// The device a task waiting ahead counts on (the first to free up) carries the
    /// delay joining it would cause; the next one, the newcomer's own W, does not,
    /// and with nobody waiting ahead no device is promised.
    #[test]
    fn joining_a_device_promised_to_a_task_ahead_is_priced_by_the_delay() {
        let devices = [("soon", 4000, 10), ("later", 4000, 1000)];
        let new = light_newcomer();
        let view = freeing_view(&devices, 1);
        let a = queue_rule_placer().assess(&view, &new, &[], 0);
        assert_eq!((a.waiting_ahead, a.wait_s), (1, Some(1000.0)));
        let delay = |a: &Assessment<'_>, id: &str| {
            a.candidates
                .iter()
                .find(|c| c.device_id == id)
                .map(|c| c.delay_s)
                .expect("device is a candidate")
        };
        assert!((delay(&a, "soon") - (3125.0 - 10.0)).abs() < 1e-6);
        assert_eq!(delay(&a, "later"), 0.0);
        // Same predicted PD on both: the unpromised device ranks first.
        assert_eq!(a.candidates[0].device_id, "later");
        assert!(a.candidates[0].rank < a.candidates[1].rank);
        let d = queue_rule_placer().decide(&view, &new, &[], 0);
        assert!(
            matches!(&d.verdict, Verdict::Place { device_id, reserved_mem_mib: 1000, shrinks, provisional: false, .. }
                if device_id == "later" && shrinks.is_empty()),
            "{:?}",
            d.verdict
        );

        let view = freeing_view(&devices, 0);
        let a = queue_rule_placer().assess(&view, &new, &[], 0);
        assert!(a.candidates.iter().all(|c| c.delay_s == 0.0), "{a:?}");
    }

    /// When the only device the newcomer fits is promised to a task ahead, the delay
    /// it would cause outweighs its own wait: it queues although it slows nobody,
    /// whereas without a task ahead it is placed.
    #[test]
    fn the_delay_to_a_task_ahead_can_make_a_free_co_location_wait() {
        // "full" frees up later and has no room for the newcomer.
        let devices = [("soon", 4000, 10), ("full", 31_000, 1000)];
        let new = light_newcomer();
        let d = queue_rule_placer().decide(&freeing_view(&devices, 1), &new, &[], 0);
        match d.verdict {
            Verdict::Queue { reason, .. } => {
                assert!(reason.contains("3115 s of delay"), "{reason}")
            }
            other => panic!("expected queue, got {other:?}"),
        }
        let d = queue_rule_placer().decide(&freeing_view(&devices, 0), &new, &[], 0);
        assert!(
            matches!(&d.verdict, Verdict::Place { device_id, reserved_mem_mib: 1000, shrinks, provisional: false, .. }
                if device_id == "soon" && shrinks.is_empty()),
            "{:?}",
            d.verdict
        );
    }

    /// With more tasks ahead than devices that say when they free up, W is unknown
    /// (the task is placed) but every such device is promised to a task ahead.
    #[test]
    fn every_reporting_device_is_promised_when_more_tasks_wait_than_free_up() {
        let view = freeing_view(&[("soon", 4000, 10)], 2);
        let a = queue_rule_placer().assess(&view, &light_newcomer(), &[], 0);
        assert_eq!((a.waiting_ahead, a.wait_s), (2, None));
        assert!((a.candidates[0].delay_s - 3115.0).abs() < 1e-6);
    }

    /// Three shared devices freeing up in 10, 20 and 30 s: the wait is the time until
    /// the (q+1)-th frees up, with q the tasks waiting ahead.
    #[test]
    fn the_wait_counts_the_tasks_queued_ahead() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        for (i, left_s) in [30u64, 10, 20].into_iter().enumerate() {
            let id = format!("r{i}");
            device(
                &mut view,
                &format!("d{i}"),
                32_000,
                &[spec(&id, 4000, 95.0, Some(1000 + 900 * left_s))],
            );
            view.set_report(TaskReport {
                task_id: id,
                samples_done: 1000,
                samples_per_s: 900.0,
                reported_at_unix_ms: 0,
                ..Default::default()
            });
        }
        // Placing costs (1.9 + 0.9 − 1) × 3125 s, far more than any of these waits.
        let mut new = spec("new", 4000, 95.0, Some(1_000_000));
        new.submitted_at_unix_ms = 5_000;
        let ahead = |view: &mut ClusterView, n: usize| {
            view.clear_waiting();
            for k in 0..n {
                let mut earlier = spec(&format!("early{k}"), 4000, 95.0, None);
                earlier.submitted_at_unix_ms = 1_000;
                view.note_waiting(&earlier, 0, 600_000);
            }
        };
        for (q, expect_s) in [(0usize, 10u64), (1, 20), (2, 30)] {
            ahead(&mut view, q);
            let assessment = queue_rule_placer().assess(&view, &new, &[], 0);
            assert_eq!(assessment.waiting_ahead, q);
            assert_eq!(assessment.earliest_idle_s, Some(10.0));
            assert_eq!(assessment.wait_s, Some(expect_s as f64));
            let d = queue_rule_placer().decide(&view, &new, &[], 0);
            match &d.verdict {
                Verdict::Queue {
                    retry_after,
                    reason,
                } => {
                    assert_eq!(*retry_after, Duration::from_secs(expect_s));
                    assert!(
                        reason.contains(&format!("waiting about {expect_s} s")),
                        "{reason}"
                    );
                    let said = match q {
                        0 => "no task waits ahead".to_owned(),
                        1 => "1 task waits ahead".to_owned(),
                        n => format!("{n} tasks wait ahead"),
                    };
                    assert!(reason.contains(&said), "{reason}");
                    assert!(
                        d.explanation.summary.contains(&said),
                        "{}",
                        d.explanation.summary
                    );
                }
                other => panic!("{q} ahead: expected queue, got {other:?}"),
            }
        }
        // Three ahead, three devices reporting: no device frees up for this task within
        // a round of the residents' work, so the wait is unknown and the task is placed.
        ahead(&mut view, 3);
        let assessment = queue_rule_placer().assess(&view, &new, &[], 0);
        assert_eq!((assessment.waiting_ahead, assessment.wait_s), (3, None));
        let d = queue_rule_placer().decide(&view, &new, &[], 0);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
        assert!(
            d.explanation.summary.contains("3 tasks wait ahead"),
            "{}",
            d.explanation.summary
        );
        // Tasks submitted after this one, or expired, do not count.
        view.clear_waiting();
        let mut later = spec("later", 4000, 95.0, None);
        later.submitted_at_unix_ms = 9_000;
        view.note_waiting(&later, 0, 600_000);
        view.note_waiting(&spec("gone", 4000, 95.0, None), 0, 1_000);
        let assessment = queue_rule_placer().assess(&view, &new, &[], 1_000);
        assert_eq!(
            (assessment.waiting_ahead, assessment.wait_s),
            (0, Some(9.0))
        );
        // The wait is over the devices considered only.
        ahead(&mut view, 1);
        let only = ["d0".to_owned(), "d1".to_owned()];
        let assessment = queue_rule_placer().assess(&view, &new, &only, 0);
        assert_eq!(assessment.wait_s, Some(30.0));
    }

    /// [`TimeShare`] that counts its predictions and says which version it is.
    #[derive(Debug, Default)]
    struct Counted {
        calls: std::sync::atomic::AtomicU64,
        version: std::sync::atomic::AtomicU64,
    }

    impl SlowdownModel for Counted {
        fn predict(&self, kind: &str, task: &TaskProfile, co: &[TaskProfile]) -> SlowdownEstimate {
            self.calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            TimeShare.predict(kind, task, co)
        }
        fn observe(&self, _: &CoLocationSample) {}
        fn version(&self) -> Option<u64> {
            Some(self.version.load(std::sync::atomic::Ordering::Relaxed))
        }
    }

    /// The residents' slowdowns among themselves are predicted once per change of the
    /// residents or the model, and reusing them changes no score.
    #[test]
    fn residents_slowdowns_without_the_newcomer_are_reused_until_something_changes() {
        use std::sync::atomic::Ordering::Relaxed;
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        let three = [
            spec("r1", 1000, 40.0, None),
            spec("r2", 1000, 30.0, None),
            spec("r3", 1000, 50.0, None),
        ];
        device(&mut view, "d0", 32_000, &three);
        let model = Arc::new(Counted::default());
        let p = Placer::new(PlacerParams::default(), model.clone()).expect("valid");
        let uncached = placer().assess(&view, &spec("a", 1000, 30.0, None), &[], 0);
        let calls = |f: &dyn Fn()| {
            let before = model.calls.load(Relaxed);
            f();
            model.calls.load(Relaxed) - before
        };
        // First decision: own + 3 with + 3 without; then only own + 3 with.
        let first = calls(&|| {
            let a = p.assess(&view, &spec("a", 1000, 30.0, None), &[], 0);
            assert_eq!(
                a.candidates[0].pd_increase,
                uncached.candidates[0].pd_increase
            );
            assert_eq!(
                a.candidates[0].uncertainty,
                uncached.candidates[0].uncertainty
            );
        });
        assert_eq!(first, 7);
        let second = calls(&|| {
            let a = p.assess(&view, &spec("b", 1000, 30.0, None), &[], 0);
            let fresh = placer().assess(&view, &spec("b", 1000, 30.0, None), &[], 0);
            assert_eq!(a.candidates[0].pd_increase, fresh.candidates[0].pd_increase);
        });
        assert_eq!(second, 4);
        // A new model version: predicted afresh.
        model.version.store(1, Relaxed);
        assert_eq!(
            calls(&|| drop(p.assess(&view, &spec("c", 1000, 30.0, None), &[], 0))),
            7
        );
        assert_eq!(
            calls(&|| drop(p.assess(&view, &spec("c", 1000, 30.0, None), &[], 0))),
            4
        );
        // A resident's report changes its profile: predicted afresh, with the new batch.
        view.set_report(TaskReport {
            task_id: "r2".into(),
            batch_size: 64,
            ..Default::default()
        });
        assert_eq!(
            calls(&|| drop(p.assess(&view, &spec("d", 1000, 30.0, None), &[], 0))),
            7
        );
        // The residents change: two left, predicted afresh, scores still exact.
        device(&mut view, "d0", 32_000, &three[..2]);
        let fewer = calls(&|| {
            let a = p.assess(&view, &spec("e", 1000, 30.0, None), &[], 0);
            let fresh = placer().assess(&view, &spec("e", 1000, 30.0, None), &[], 0);
            assert_eq!(a.candidates[0].pd_increase, fresh.candidates[0].pd_increase);
        });
        assert_eq!(fewer, 5);
    }

    /// Every task slows down by a fixed factor whenever it has company.
    #[derive(Debug)]
    struct FixedIf(f64);

    impl SlowdownModel for FixedIf {
        fn predict(&self, _: &str, _: &TaskProfile, co: &[TaskProfile]) -> SlowdownEstimate {
            SlowdownEstimate::certain(if co.is_empty() { 1.0 } else { self.0 })
        }
        fn observe(&self, _: &CoLocationSample) {}
    }

    /// A pair at IF 2.2 each does 2/2.2 < 1 task of work per second: worse than the
    /// resident alone, so the device is rejected; at IF 1.3 each it does 1.54, accepted.
    /// An idle device is never rejected for it.
    #[test]
    fn sharing_must_raise_the_combined_throughput() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "d0", 32_000, &[spec("r1", 4000, 10.0, None)]);
        let new = spec("new", 4000, 10.0, None);
        let with_if = |slowdown: f64| {
            Placer::new(PlacerParams::default(), Arc::new(FixedIf(slowdown))).expect("valid")
        };
        let d = with_if(2.2).decide(&view, &new, &[], 0);
        let Verdict::Queue { reason, .. } = &d.verdict else {
            panic!("expected queue, got {:?}", d.verdict);
        };
        assert!(reason.contains("throughput_gain: 1"), "{reason}");
        let why = &d.explanation.candidates[0].rejected_because;
        assert!(
            why.contains("combined normalised throughput 1.00 → 0.91"),
            "{why}"
        );
        let a = with_if(2.2).assess(&view, &new, &[], 0);
        assert!(matches!(
            a.rejected[0].1,
            Rejection::ThroughputGain { before, after, .. }
                if before == 1.0 && (after - 2.0 / 2.2).abs() < 1e-12
        ));
        assert_eq!(a.rejected[0].1.kind(), "throughput_gain");

        let d = with_if(1.3).decide(&view, &new, &[], 0);
        assert!(
            matches!(&d.verdict, Verdict::Place { device_id, .. } if device_id == "d0"),
            "{:?}",
            d.verdict
        );
        // A gain of 0.54 is below a required 0.6.
        let strict = Placer::new(
            PlacerParams {
                min_throughput_gain: 0.6,
                ..Default::default()
            },
            Arc::new(FixedIf(1.3)),
        )
        .expect("valid");
        assert!(matches!(
            strict.decide(&view, &new, &[], 0).verdict,
            Verdict::Queue { .. }
        ));

        // With an idle device besides, the task goes there, whatever sharing costs.
        device(&mut view, "idle", 32_000, &[]);
        let d = with_if(2.2).decide(&view, &new, &[], 0);
        assert!(
            matches!(&d.verdict, Verdict::Place { device_id, reserved_mem_mib: 4000, shrinks, provisional: false, .. }
                if device_id == "idle" && shrinks.is_empty()),
            "{:?}",
            d.verdict
        );
        let a = with_if(2.2).assess(&view, &new, &[], 0);
        assert!(a.candidates.iter().any(|c| c.idle && c.device_id == "idle"));
    }

    /// The fitted predictor, hiding its pairwise composition: every resident is
    /// predicted over its whole co-runner list, as before the prefixes were reused.
    #[derive(Debug)]
    struct WholeLists(crate::model::PredictorSlowdown);

    impl SlowdownModel for WholeLists {
        fn predict(&self, kind: &str, task: &TaskProfile, co: &[TaskProfile]) -> SlowdownEstimate {
            self.0.predict(kind, task, co)
        }
        fn observe(&self, _: &CoLocationSample) {}
        fn version(&self) -> Option<u64> {
            self.0.version()
        }
    }

    /// Reusing the residents' pairwise predictions changes no decision and no
    /// explanation, bit for bit: a forest fitted on the bundled Gavel K80
    /// measurements, a seeded synthetic cluster, and many arrivals, each decided
    /// twice so the second decision runs on the cached prefixes.
    #[test]
    fn reusing_the_residents_pairs_changes_no_decision() {
        use crate::model::PredictorSlowdown;
        use crate::synthetic::SyntheticCluster;
        let gavel = iadeep_datasets::gavel::GavelThroughputs::bundled().expect("bundled Gavel");
        let worker = gavel.worker("k80").expect("k80 measurements");
        let samples = iadeep_predictor::gavel::samples_from_gavel(worker, "k80").samples;
        let params = iadeep_predictor::LearnerParams {
            forest: iadeep_predictor::forest::ForestParams {
                n_trees: 8,
                ..Default::default()
            },
            ..Default::default()
        };
        let predictor = Arc::new(
            iadeep_predictor::OnlinePredictor::from_samples(params, samples).expect("fit"),
        );
        assert!(predictor.model_samples() > 0, "the forest is fitted");
        let cluster = SyntheticCluster::new(120, 300, 7);
        let reused_view = cluster.view(Arc::new(ModelledMemory));
        let whole_view = cluster.view(Arc::new(ModelledMemory));
        let reused = Placer::new(
            PlacerParams::default(),
            Arc::new(PredictorSlowdown::new(predictor.clone())),
        )
        .expect("valid");
        let whole = Placer::new(
            PlacerParams::default(),
            Arc::new(WholeLists(PredictorSlowdown::new(predictor.clone()))),
        )
        .expect("valid");
        assert!(
            reused_view
                .devices()
                .any(|(_, d)| d.summary().profiles.len() >= 3),
            "the cluster has devices with several residents"
        );
        let now = 1_000;
        for round in 0..2 {
            for i in 0..40 {
                let task = cluster.arrival(i);
                let a = reused.assess(&reused_view, &task, &[], now);
                let b = whole.assess(&whole_view, &task, &[], now);
                fn bits<'v>(a: &Assessment<'v>) -> Vec<(&'v str, u64, u64)> {
                    let mut c: Vec<_> = a
                        .candidates
                        .iter()
                        .map(|c| {
                            (
                                c.device_id,
                                c.pd_increase.to_bits(),
                                c.uncertainty.to_bits(),
                            )
                        })
                        .collect();
                    c.sort_unstable();
                    c
                }
                assert_eq!(bits(&a), bits(&b), "round {round}, arrival {i}");
                assert_eq!(a.rejected, b.rejected, "round {round}, arrival {i}");
                assert_eq!(
                    reused.decide(&reused_view, &task, &[], now),
                    whole.decide(&whole_view, &task, &[], now),
                    "round {round}, arrival {i}"
                );
            }
        }
        // The reused path was taken: the cache holds prefixes for shared devices.
        assert!(reused_view.devices().any(|(_, d)| {
            d.summary().profiles.len() >= 2
                && d.alone_together
                    .get(predictor.generation())
                    .is_some_and(|c| c.prefixes.len() == d.summary().profiles.len())
        }));
    }

    #[test]
    fn ordinals_read_right() {
        let got: Vec<String> = [1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111]
            .into_iter()
            .map(ordinal)
            .collect();
        assert_eq!(
            got,
            [
                "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st",
                "111th"
            ]
        );
    }

    #[test]
    fn only_the_least_loaded_shared_devices_are_scored_when_limited() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "heavy", 32_000, &[spec("r1", 1000, 80.0, None)]);
        device(&mut view, "light", 32_000, &[spec("r2", 1000, 10.0, None)]);
        device(&mut view, "medium", 32_000, &[spec("r3", 1000, 40.0, None)]);
        let params = PlacerParams {
            max_scored_devices: 1,
            ..PlacerParams::default()
        };
        let p = Placer::new(params, Arc::new(TimeShare)).expect("valid");
        let d = p.decide(&view, &spec("new", 1000, 30.0, None), &[], 0);
        assert!(
            matches!(&d.verdict, Verdict::Place { device_id, .. } if device_id == "light"),
            "{:?}",
            d.verdict
        );
        assert_eq!(d.explanation.candidates.len(), 1);
        assert!(
            d.explanation
                .summary
                .contains("2 more feasible shared devices not scored"),
            "{}",
            d.explanation.summary
        );
        // Unlimited, all three are scored.
        let all = placer().assess(&view, &spec("new", 1000, 30.0, None), &[], 0);
        assert_eq!((all.candidates.len(), all.unscored), (3, 0));
    }

    fn arb_spec(id: String) -> impl Strategy<Value = TaskSpec> {
        (
            1u64..20_000,
            0.0f64..100.0,
            proptest::option::of(1u64..10_000_000),
        )
            .prop_map(move |(mib, sm, total)| spec(&id, mib, sm, total))
    }

    proptest! {
        /// Whatever the cluster, a placement on a shared device fits its usable memory
        /// (the card less the one margin) with every resident at its footprint, one on an
        /// idle device fits the card, and a task that fits an idle device is never turned
        /// away for lack of room.
        #[test]
        fn placements_always_fit(
            sizes in proptest::collection::vec(8_000u64..40_000, 1..6),
            loads in proptest::collection::vec(proptest::collection::vec(1u64..12_000, 0..4), 6),
            new in arb_spec("new".into()),
        ) {
            let mut view = ClusterView::new(Arc::new(ModelledMemory));
            let mut k = 0;
            for (i, size) in sizes.iter().enumerate() {
                let residents: Vec<TaskSpec> = loads[i]
                    .iter()
                    .map(|&mib| { k += 1; spec(&format!("r{k}"), mib, 50.0, None) })
                    .collect();
                device(&mut view, &format!("d{i}"), *size, &residents);
            }
            let p = placer();
            let d = p.decide(&view, &new, &[], 0);
            if let Verdict::Place { device_id, reserved_mem_mib, .. } = &d.verdict {
                let dev = view.device(device_id).expect("chosen device exists");
                let total = dev.info.as_ref().expect("registered").memory_mib;
                let limit = if dev.residents.is_empty() { total } else { p.params().usable_memory_mib(total) };
                prop_assert!(dev.summary().used_mib + reserved_mem_mib <= limit);
                prop_assert!(*reserved_mem_mib >= new.gpu_mem_request_mib);
            }
            let idle_fits = view.devices().any(|(_, dev)| dev.residents.is_empty()
                && dev.info.as_ref().is_some_and(|i| i.memory_mib >= new.gpu_mem_request_mib));
            if idle_fits {
                prop_assert!(matches!(d.verdict, Verdict::Place { .. }), "{:?}", d.verdict);
            }
        }
    }
}
