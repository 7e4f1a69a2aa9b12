//! Feasibility (step 1 of the module docs of [`super`]): whether a device can take
//! the task at all: registered, its memory (shrinking residents where that makes
//! room, see [`super::shrink`]) and its utilisation caps; and whether the task can
//! never run anywhere, whatever leaves.
use iadeep_proto::{TaskProfile, TaskSpec};

use super::shrink::shrink_plan;
use super::{Placer, Rejection, Shrink};
use crate::error::Result;
use crate::model::MemoryEstimator;
use crate::view::{ClusterView, DeviceState};

/// The room claims other tasks hold on a device: the memory they hold, the first
/// claimant and when the last of them expires (for the rejection's text).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Claimed<'d> {
    pub(super) mib: u64,
    pub(super) by: &'d str,
    pub(super) until_unix_ms: i64,
}

/// The unexpired room claims of tasks other than `task_id` on `device` at
/// `now_unix_ms` (see [`super::room::claim_holds`]), `None` when none hold.
pub(super) fn claimed_by_others<'d>(
    device: &'d DeviceState,
    task_id: &str,
    now_unix_ms: i64,
) -> Option<Claimed<'d>> {
    let mut held = device
        .claims
        .iter()
        .filter(|c| c.task_id != task_id && super::room::claim_holds(c, now_unix_ms));
    let first = held.next()?;
    Some(held.fold(
        Claimed {
            mib: first.mem_mib,
            by: &first.task_id,
            until_unix_ms: first.until_unix_ms,
        },
        |acc, c| Claimed {
            mib: acc.mib + c.mem_mib,
            until_unix_ms: acc.until_unix_ms.max(c.until_unix_ms),
            ..acc
        },
    ))
}

/// What a device would need to take the task.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Fit {
    /// MiB to reserve for the task.
    pub(super) need: u64,
    /// `need` is a provisional grant (see [`Candidate::provisional`]).
    pub(super) provisional: bool,
    /// Aggregate demand of a shared device, for pre-screening; `None` when idle.
    pub(super) demand: Option<f64>,
    pub(super) shrinks: Vec<Shrink>,
}

impl Placer {
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

    /// Memory and utilisation feasibility of one device: the MiB to reserve, the
    /// residents to shrink first, and for a shared device its aggregate demand.
    /// `claimed` is what other tasks' room claims hold there ([`claimed_by_others`]):
    /// a device held for another task takes nobody else ([`Rejection::Claimed`], see
    /// "Room evictions" in the module docs of [`super`] for why the whole device).
    pub(super) fn feasible(
        &self,
        device: &DeviceState,
        new_profile: &TaskProfile,
        new_footprint: Option<u64>,
        memory: &dyn MemoryEstimator,
        claimed: Option<Claimed<'_>>,
    ) -> Result<Fit, Rejection> {
        let info = device.info.as_ref().ok_or(Rejection::NotRegistered)?;
        let summary = device.summary();
        let usable = self.params.usable_memory_mib(info.memory_mib);
        if let Some(claimed) = claimed {
            return Err(Rejection::Claimed {
                task_id: claimed.by.to_owned(),
                claimed_mib: claimed.mib,
                until_unix_ms: claimed.until_unix_ms,
            });
        }
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
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::model::ModelledMemory;
    use crate::params::PlacerParams;
    use crate::policy::Verdict;
    use proptest::prelude::*;
    use std::sync::Arc;

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
