//! The placement decision: a pure function of a [`ClusterView`] and a task.
//!
//! For each device (or each of the devices the caller allows):
//! 1. **Feasibility.** The device must be registered; its residents' footprints
//!    (the larger of what was reserved and what the [`MemoryEstimator`] says now)
//!    plus the new task's smallest footprint must fit the device's memory less the
//!    margins of [`PlacerParams`]. The predicted aggregate SM and DRAM-bandwidth
//!    utilisations (sums of the known solo values) must stay under their caps.
//!    An idle device is always a candidate when the task fits it at all.
//! 2. **Score.** The predicted increase of the device's Σ PD if the task joins:
//!    Σ over residents of (predicted IF with the task − predicted IF without it),
//!    plus the new task's own predicted IF. The placer does not change batch sizes,
//!    so at the submitted batch sizes DT = E = 1 and PD = IF; the tuner then
//!    improves on it. An idle device costs exactly 1.0 (the task alone).
//!    Devices are ranked by `increase + uncertainty_weight × uncertainty`; equal
//!    ranks are broken by a hash of (task, device) so that concurrent requests
//!    spread over equally good devices instead of all racing for the first.
//! 3. **Queue or place.** If the best device is not idle, placing costs the excess
//!    `increase − 1` units of PD for about the task's solo duration `D`, i.e.
//!    `(increase − 1) × D` seconds of solo-speed progress lost across the device's
//!    tasks. Waiting costs the time `W` until the first resident (among the devices
//!    considered) is predicted to finish, from its reported progress. The task
//!    queues, with a retry hint of `W`, when `W × wait_cost_factor` is smaller.
//!    When no resident reports its progress, `W` is unknown and the task is placed.

use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use iadeep_proto::{CandidateScore, Explanation, TaskProfile, TaskSpec};

use crate::error::Result;
use crate::model::{MemoryEstimator, SlowdownModel};
use crate::params::PlacerParams;
use crate::view::{ClusterView, DeviceState, profile_of};

/// Why a device cannot take the task.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rejection {
    /// The caller named a device the placer does not know.
    UnknownDevice,
    /// The device is not registered (its tuner is gone); it takes no new task.
    NotRegistered,
    /// Nothing is known about the task's memory, so it can only have a device to itself.
    UnknownTaskMemory,
    /// Not enough memory: the task needs `need_mib`, `free_mib` are left of the usable memory.
    Memory { need_mib: u64, free_mib: u64 },
    /// Predicted aggregate SM utilisation over the cap.
    SmCap { predicted_pct: f64, cap_pct: f64 },
    /// Predicted aggregate DRAM-bandwidth utilisation over the cap.
    MemBwCap { predicted_pct: f64, cap_pct: f64 },
    /// Predicted Σ PD increase over [`PlacerParams::max_pd_increase`].
    PdCap { predicted: f64, cap: f64 },
}

impl Rejection {
    /// A short stable name, for counting rejections and for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Rejection::UnknownDevice => "unknown_device",
            Rejection::NotRegistered => "not_registered",
            Rejection::UnknownTaskMemory => "unknown_task_memory",
            Rejection::Memory { .. } => "memory",
            Rejection::SmCap { .. } => "sm_cap",
            Rejection::MemBwCap { .. } => "mem_bw_cap",
            Rejection::PdCap { .. } => "pd_cap",
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
                "the task's memory is unknown (no request, profile or report), \
                 so it can only run on an idle device",
            ),
            Rejection::Memory { need_mib, free_mib } => write!(
                f,
                "memory: the task needs {need_mib} MiB, {free_mib} MiB are free after the margin"
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
        }
    }
}

/// A device that can take the task, and what it would cost.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate<'v> {
    pub device_id: &'v str,
    /// Predicted increase of the device's Σ PD.
    pub pd_increase: f64,
    /// Uncertainty of that prediction (root of the summed squared model uncertainties).
    pub uncertainty: f64,
    /// What the ranking sorts by: `pd_increase + uncertainty_weight × uncertainty`.
    pub rank: f64,
    /// MiB to reserve for the task on this device.
    pub reserved_mem_mib: u64,
    /// The device has no resident.
    pub idle: bool,
    tiebreak: u64,
}

/// Every device considered for one task, split into candidates and rejections.
#[derive(Clone, Debug, Default)]
pub struct Assessment<'v> {
    /// Feasible devices, best first.
    pub candidates: Vec<Candidate<'v>>,
    /// Infeasible devices with the reason, in device order.
    pub rejected: Vec<(&'v str, Rejection)>,
    /// Seconds until the first resident of a considered device is predicted to finish.
    pub earliest_release_s: Option<f64>,
}

/// What to tell the caller.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Run the task on `device_id`, reserving `reserved_mem_mib`.
    Place {
        device_id: String,
        reserved_mem_mib: u64,
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
#[derive(Clone, Debug)]
pub struct Placer {
    params: PlacerParams,
    slowdown: Arc<dyn SlowdownModel>,
    memory: Arc<dyn MemoryEstimator>,
}

impl Placer {
    /// A policy with checked `params`.
    pub fn new(
        params: PlacerParams,
        slowdown: Arc<dyn SlowdownModel>,
        memory: Arc<dyn MemoryEstimator>,
    ) -> Result<Placer> {
        params.check()?;
        Ok(Placer {
            params,
            slowdown,
            memory,
        })
    }

    /// The parameters in force.
    pub fn params(&self) -> &PlacerParams {
        &self.params
    }

    /// The slowdown model (the daemon feeds it samples).
    pub fn slowdown_model(&self) -> &Arc<dyn SlowdownModel> {
        &self.slowdown
    }

    /// Assesses every device of `view` (or only those in `restrict`, when not empty) for `task`.
    pub fn assess<'v>(
        &self,
        view: &'v ClusterView,
        task: &TaskSpec,
        restrict: &'v [String],
        now_unix_ms: i64,
    ) -> Assessment<'v> {
        let new_profile = profile_of(task, None);
        let new_footprint = self.memory.min_footprint_mib(task, None);
        let mut out = Assessment::default();
        let mut scratch = Vec::new();
        let mut consider =
            |id: &'v str, device: Option<&'v DeviceState>, out: &mut Assessment<'v>| {
                let Some(device) = device else {
                    out.rejected.push((id, Rejection::UnknownDevice));
                    return;
                };
                if device.info.is_some() {
                    for resident in &device.residents {
                        if let Some(left) = resident.remaining_s(now_unix_ms) {
                            out.earliest_release_s =
                                Some(out.earliest_release_s.map_or(left, |e: f64| e.min(left)));
                        }
                    }
                }
                match self.assess_device(device, &new_profile, new_footprint, &mut scratch) {
                    Ok((pd_increase, uncertainty, reserved_mem_mib)) => {
                        out.candidates.push(Candidate {
                            device_id: id,
                            pd_increase,
                            uncertainty,
                            rank: pd_increase + self.params.uncertainty_weight * uncertainty,
                            reserved_mem_mib,
                            idle: device.residents.is_empty(),
                            tiebreak: tiebreak(&task.task_id, id),
                        });
                    }
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
        out.candidates.sort_by(|a, b| {
            a.rank
                .partial_cmp(&b.rank)
                .unwrap_or(Ordering::Equal)
                .then(a.tiebreak.cmp(&b.tiebreak))
        });
        out
    }

    /// Feasibility and score of one device: `(pd_increase, uncertainty, reserved_mem_mib)`.
    fn assess_device(
        &self,
        device: &DeviceState,
        new_profile: &TaskProfile,
        new_footprint: Option<u64>,
        scratch: &mut Vec<TaskProfile>,
    ) -> Result<(f64, f64, u64), Rejection> {
        let info = device.info.as_ref().ok_or(Rejection::NotRegistered)?;
        let usable = self.params.usable_memory_mib(info.memory_mib);
        let idle = device.residents.is_empty();
        let used: u64 = device
            .residents
            .iter()
            .map(|r| {
                let now = self
                    .memory
                    .min_footprint_mib(r.spec(), r.report.as_ref())
                    .unwrap_or(0);
                now.max(r.reservation.reserved_mem_mib)
            })
            .sum();
        let need = match new_footprint {
            Some(mib) => mib,
            // The whole card: nothing else can join a task of unknown size.
            None if idle => usable,
            None => return Err(Rejection::UnknownTaskMemory),
        };
        let free = usable.saturating_sub(used);
        if need > free || need == 0 {
            return Err(Rejection::Memory {
                need_mib: need,
                free_mib: free,
            });
        }
        if idle {
            return Ok((1.0, 0.0, need));
        }
        let sum = |get: fn(&TaskProfile) -> Option<f64>| -> f64 {
            device
                .residents
                .iter()
                .map(|r| &r.profile)
                .chain(std::iter::once(new_profile))
                .filter_map(get)
                .sum()
        };
        let sm = sum(|p| p.sm_util_pct);
        if sm > self.params.sm_util_cap_pct {
            return Err(Rejection::SmCap {
                predicted_pct: sm,
                cap_pct: self.params.sm_util_cap_pct,
            });
        }
        let bw = sum(|p| p.mem_bw_util_pct);
        if bw > self.params.mem_bw_util_cap_pct {
            return Err(Rejection::MemBwCap {
                predicted_pct: bw,
                cap_pct: self.params.mem_bw_util_cap_pct,
            });
        }
        let kind = info.kind.as_str();
        scratch.clear();
        scratch.extend(device.residents.iter().map(|r| r.profile.clone()));
        let own = self.slowdown.predict(kind, new_profile, scratch);
        let mut increase = own.slowdown;
        let mut variance = own.uncertainty * own.uncertainty;
        // For each resident i: its co-runners without the task, then with it.
        let n = device.residents.len();
        for i in 0..n {
            scratch.clear();
            scratch.extend(
                device
                    .residents
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != i)
                    .map(|(_, r)| r.profile.clone()),
            );
            let me = &device.residents[i].profile;
            let without = self.slowdown.predict(kind, me, scratch);
            scratch.push(new_profile.clone());
            let with = self.slowdown.predict(kind, me, scratch);
            increase += with.slowdown - without.slowdown;
            variance += with.uncertainty * with.uncertainty;
        }
        if increase > self.params.max_pd_increase {
            return Err(Rejection::PdCap {
                predicted: increase,
                cap: self.params.max_pd_increase,
            });
        }
        Ok((increase, variance.sqrt(), need))
    }

    /// Decides where `task` goes (among `restrict`, when not empty), or that it waits.
    pub fn decide(
        &self,
        view: &ClusterView,
        task: &TaskSpec,
        restrict: &[String],
        now_unix_ms: i64,
    ) -> Decision {
        let assessment = self.assess(view, task, restrict, now_unix_ms);
        let verdict = self.verdict(task, &assessment);
        let explanation = self.explain(&assessment, &verdict);
        Decision {
            verdict,
            explanation,
        }
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
        let wait = assessment.earliest_release_s;
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
                retry_after: self.retry_hint(wait),
                reason,
            };
        };
        let place = Verdict::Place {
            device_id: best.device_id.to_owned(),
            reserved_mem_mib: best.reserved_mem_mib,
        };
        if best.idle {
            return place;
        }
        let excess = (best.pd_increase - 1.0).max(0.0);
        let duration_s =
            solo_duration_s(task).unwrap_or(self.params.assumed_task_duration.as_secs_f64());
        let cost_place_s = excess * duration_s;
        match wait {
            Some(w) if w * self.params.wait_cost_factor < cost_place_s => Verdict::Queue {
                retry_after: self.retry_hint(Some(w)),
                reason: format!(
                    "waiting about {w:.0} s for a device to free up costs less than running now \
                     on {} (predicted summed PD +{:.2}: {excess:.2} × {duration_s:.0} s of \
                     solo-speed progress lost)",
                    best.device_id, best.pd_increase
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
                    "placed on {device_id}: predicted summed PD +{:.2} (±{:.2})",
                    best.map_or(0.0, |c| c.pd_increase),
                    best.map_or(0.0, |c| c.uncertainty)
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
        Explanation {
            summary: format!(
                "{head}; {} feasible, {rejected}",
                assessment.candidates.len()
            ),
            candidates,
        }
    }
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

fn tiebreak(task_id: &str, device_id: &str) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    task_id.hash(&mut h);
    device_id.hash(&mut h);
    h.finish()
}
