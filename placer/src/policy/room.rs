//! Room evictions (see the module docs of [`super`], "Room evictions"): where a
//! production task that fits no device under the caps would fit once some
//! opportunistic residents left, which residents, and what a task that holds a room
//! claim is told while they leave.
use std::time::Duration;

use iadeep_proto::{Claim, TaskProfile, TaskSpec};

use super::feasibility::claimed_by_others;
use super::score::{avoided_partners, cap_holds};
use super::{Assessment, Candidate, Placer, Verdict};
use crate::model::MemoryEstimator;
use crate::view::{ClusterView, DeviceState, fnv1a};
use iadeep_predictor::SlowdownModel;

/// Whether `claim` still holds its room at `now_unix_ms`: the one expiry rule of
/// claims, for every reader (feasibility, the claimant's retry, the record's rewrite).
pub fn claim_holds(claim: &Claim, now_unix_ms: i64) -> bool {
    claim.until_unix_ms > now_unix_ms
}

/// The device on which production `task` holds a live room claim, with the claim
/// (`None` for an opportunistic task, which never claims).
pub(super) fn own_claim<'v>(
    view: &'v ClusterView,
    task: &TaskSpec,
    now_unix_ms: i64,
) -> Option<(&'v str, &'v DeviceState, &'v Claim)> {
    if !task.is_production() {
        return None;
    }
    view.devices().find_map(|(id, d)| {
        d.claims
            .iter()
            .find(|c| c.task_id == task.task_id && claim_holds(c, now_unix_ms))
            .map(|c| (id, d, c))
    })
}

/// Most opportunistic residents of one device whose subsets a room eviction tries
/// (the largest by footprint, besides those the task must not share the device with):
/// the subsets double with each, and a device rarely has more than a few.
const MAX_MOVABLE: usize = 10;

/// One way to make room for a production task: the device, the opportunistic
/// residents to evict there, and what the choice weighed.
#[derive(Clone, Debug, PartialEq)]
pub struct RoomPlan<'v> {
    pub device_id: &'v str,
    pub victims: Vec<&'v str>,
    /// MiB the task needs there (its footprint at the batch size it starts at, or, if
    /// nothing is known of its memory, the share of the card an unknown task needs):
    /// what its claim holds.
    pub need_mib: u64,
    /// Seconds the victims have run since they were placed, summed: what they lose at
    /// most (all of it for a job without a checkpoint, less for one with).
    pub work_lost_s: f64,
    /// The task's predicted slowdown next to the residents that stay, at the upper end
    /// of its 90 % interval (1 on a device the eviction empties).
    pub upper_slowdown: f64,
    tiebreak: u64,
}

impl RoomPlan<'_> {
    /// The order of preference: fewest victims, then least work lost, then the task
    /// least slowed (among equal losses, evicting the co-runner that would slow it
    /// most), then a per-task hash of the device.
    fn better_than(&self, other: &RoomPlan<'_>) -> bool {
        self.victims
            .len()
            .cmp(&other.victims.len())
            .then(self.work_lost_s.total_cmp(&other.work_lost_s))
            .then(self.upper_slowdown.total_cmp(&other.upper_slowdown))
            .then(self.tiebreak.cmp(&other.tiebreak))
            .is_lt()
    }
}

impl Placer {
    /// The room eviction for production `task` (see the module docs of [`super`]):
    /// among the registered devices of `view` (or of `restrict`, when not empty)
    /// that no other task holds a claim on, the one where evicting opportunistic
    /// residents lets the task fit its memory (usable memory less the margin, or the
    /// whole card when nobody stays) and the utilisation caps, with its own and every
    /// staying production resident's slowdown under its cap at the upper end of the
    /// 90 % interval. Residents the task must avoid are always among the victims (a
    /// production one rules the device out). `None` for an opportunistic task or when
    /// no eviction makes room.
    pub fn room_eviction<'v>(
        &self,
        view: &'v ClusterView,
        task: &TaskSpec,
        restrict: &'v [String],
        now_unix_ms: i64,
    ) -> Option<RoomPlan<'v>> {
        let cap = task.slowdown_cap()?;
        let avoid = avoided_partners(view, &task.task_id, now_unix_ms);
        let profile = crate::view::profile_of(task, None);
        let footprint = view
            .memory()
            .bound_mib(task, None, task.initial_batch_size.max(1));
        let pinned = self.slowdown.pinned();
        let model = pinned.as_deref().unwrap_or(&*self.slowdown);
        let task_hash = fnv1a(task.task_id.as_bytes());
        let mut best: Option<RoomPlan<'v>> = None;
        let mut consider = |id: &'v str, device: &'v DeviceState| {
            let room = RoomSearch {
                placer: self,
                model,
                memory: view.memory(),
                task,
                cap,
                profile: &profile,
                footprint,
                avoid: &avoid,
                now_unix_ms,
                tiebreak: super::score::tiebreak(task_hash, device.id_hash),
                most_victims: best.as_ref().map_or(usize::MAX, |b| b.victims.len()),
            };
            if let Some(plan) = room.on(id, device)
                && best.as_ref().is_none_or(|b| plan.better_than(b))
            {
                best = Some(plan);
            }
        };
        if restrict.is_empty() {
            for (id, device) in view.devices() {
                consider(id, device);
            }
        } else {
            for id in restrict {
                if let Some(device) = view.device(id) {
                    consider(id.as_str(), device);
                }
            }
        }
        best
    }

    /// Seconds `task` must still wait before it may make room by evicting
    /// ([`crate::PlacerParams::room_eviction_patience`]), counted from its submission;
    /// `None` once it may (or when it does not say when it was submitted).
    pub(super) fn patience_left(&self, task: &TaskSpec, now_unix_ms: i64) -> Option<Duration> {
        let patience = self.params.room_eviction_patience;
        if patience.is_zero() || task.submitted_at_unix_ms <= 0 {
            return None;
        }
        let waited_ms = now_unix_ms.saturating_sub(task.submitted_at_unix_ms).max(0);
        patience
            .checked_sub(Duration::from_millis(waited_ms as u64))
            .filter(|left| !left.is_zero())
    }

    /// The queue `verdict` of a production task that fits nowhere and may not evict yet:
    /// asked again no later than when its patience (`left`) ends, told so.
    pub(super) fn patient_verdict(&self, verdict: Verdict, left: Duration) -> Verdict {
        let Verdict::Queue {
            retry_after,
            reason,
        } = verdict
        else {
            return verdict;
        };
        Verdict::Queue {
            retry_after: retry_after.min(left).max(self.params.min_retry_after),
            reason: format!(
                "{reason}; may make room by evicting opportunistic jobs in {} s \
                 (the placer's --room-eviction-patience)",
                left.as_secs()
            ),
        }
    }

    /// What a task holding a room claim is told (see the module docs of [`super`]):
    /// placed on its claimed device once that device is a candidate, whatever the
    /// queue rule says (its victims were evicted for it); told to wait for them while
    /// any of them is still resident there and nothing else takes it. `None` when the
    /// claim decides nothing (no claim, an expired one, or a placement elsewhere).
    pub(super) fn claimant_verdict(
        &self,
        view: &ClusterView,
        task: &TaskSpec,
        assessment: &Assessment<'_>,
        verdict: &Verdict,
        now_unix_ms: i64,
    ) -> Option<Verdict> {
        let (device_id, device, claim) = own_claim(view, task, now_unix_ms)?;
        if let Some(c) = assessment
            .candidates
            .iter()
            .find(|c| c.device_id == device_id)
        {
            return Some(place_on(c));
        }
        if matches!(verdict, Verdict::Place { .. }) {
            return None;
        }
        let leaving: Vec<&str> = claim
            .evicting
            .iter()
            .map(String::as_str)
            .filter(|v| device.residents.iter().any(|r| r.reservation.task_id == *v))
            .collect();
        if leaving.is_empty() {
            return None;
        }
        Some(Verdict::Queue {
            retry_after: self.params.min_retry_after,
            reason: format!(
                "{} MiB on {device_id} are held for this task until {} (Unix ms); waiting \
                 for {} to leave (evicted to make room for it; their memory counts until \
                 they release it)",
                claim.mem_mib,
                claim.until_unix_ms,
                leaving.join(", ")
            ),
        })
    }

    /// The verdict of a room eviction `plan` for `task`, decided at `now_unix_ms`, with
    /// why the task fits nowhere as it is (`assessment`).
    pub(super) fn evict_verdict(
        &self,
        task: &TaskSpec,
        plan: &RoomPlan<'_>,
        assessment: &Assessment<'_>,
        now_unix_ms: i64,
    ) -> Verdict {
        let ttl = self.params.room_claim_ttl;
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let caps =
            super::explain::cap_refusals_text(&assessment.rejected, self.params.explain_top_k)
                .map(|t| format!("; {t}"))
                .unwrap_or_default();
        let cap = task
            .slowdown_cap()
            .unwrap_or(iadeep_proto::DEFAULT_MAX_SLOWDOWN);
        Verdict::Evict {
            device_id: plan.device_id.to_owned(),
            victims: plan.victims.iter().map(|v| (*v).to_owned()).collect(),
            claim_mib: plan.need_mib,
            claim_until_unix_ms: now_unix_ms.saturating_add(ttl_ms),
            retry_after: self.params.min_retry_after,
            reason: format!(
                "production task {} fits no device under the caps ({}){caps}; evicting \
                 opportunistic {} on {} makes room (its predicted slowdown there up to \
                 {:.2}, cap {cap:.2}); {} MiB held for it for {} s",
                task.task_id,
                super::explain::rejection_counts(&assessment.rejected),
                plan.victims.join(", "),
                plan.device_id,
                plan.upper_slowdown,
                plan.need_mib,
                ttl.as_secs()
            ),
        }
    }
}

/// The place verdict for candidate `c`.
fn place_on(c: &Candidate<'_>) -> Verdict {
    Verdict::Place {
        device_id: c.device_id.to_owned(),
        reserved_mem_mib: c.reserved_mem_mib,
        shrinks: c.shrinks.clone(),
        newcomer: c.newcomer,
        provisional: c.provisional,
    }
}

/// What evicting `resident` costs, in seconds of its work: its time since it was
/// placed (all a job without a checkpoint loses, a bound for one with); nothing when
/// it is leaving already (its assignment says evict: a cap breach's or an earlier
/// room eviction's victim).
fn lost_if_evicted_s(resident: &crate::view::Resident, now_unix_ms: i64) -> f64 {
    if resident.leaving() {
        return 0.0;
    }
    let at = resident.reservation.placed_at_unix_ms;
    now_unix_ms.saturating_sub(at).max(0) as f64 / 1000.0
}

/// One production task's search for room on one device.
struct RoomSearch<'a> {
    placer: &'a Placer,
    model: &'a dyn SlowdownModel,
    memory: &'a dyn MemoryEstimator,
    task: &'a TaskSpec,
    cap: f64,
    profile: &'a TaskProfile,
    footprint: Option<u64>,
    avoid: &'a [String],
    now_unix_ms: i64,
    tiebreak: u64,
    /// Plans with more victims than the best one found so far lose anyway.
    most_victims: usize,
}

impl RoomSearch<'_> {
    /// The best plan on `device` (fewest victims, then the order of [`RoomPlan::better_than`]).
    fn on<'v>(&self, id: &'v str, device: &'v DeviceState) -> Option<RoomPlan<'v>> {
        let info = device.info.as_ref()?;
        if claimed_by_others(device, &self.task.task_id, self.now_unix_ms).is_some() {
            return None;
        }
        let params = &self.placer.params;
        let need = self.footprint.unwrap_or_else(|| {
            (info.memory_mib as f64 * params.min_unknown_memory_share).ceil() as u64
        });
        if need == 0 || need > info.memory_mib {
            return None;
        }
        let avoided = |r: &crate::view::Resident| self.avoid.contains(&r.reservation.task_id);
        let mut forced = Vec::new();
        let mut movable = Vec::new();
        for (i, r) in device.residents.iter().enumerate() {
            match (r.spec().is_production(), avoided(r)) {
                (true, true) => return None,
                (true, false) => {}
                (false, true) => forced.push(i),
                (false, false) => movable.push(i),
            }
        }
        if forced.is_empty() && movable.is_empty() {
            return None;
        }
        let footprints: Vec<u64> = device
            .residents
            .iter()
            .enumerate()
            .map(|(i, r)| match device.summary().shrink_steps.get(i) {
                Some(steps) if device.summary().shrink_steps.len() == device.residents.len() => {
                    steps[0].1
                }
                _ => r.footprint_mib(self.memory),
            })
            .collect();
        // The largest first: with few victims they are the ones that can make room.
        movable.sort_by_key(|&i| std::cmp::Reverse(footprints[i]));
        movable.truncate(MAX_MOVABLE.saturating_sub(forced.len()));
        let n = movable.len();
        // A device where even evicting every one of them does not make room is passed
        // over after that one try: fewer co-runners never slow a job more, nor take
        // less memory, so no smaller set can. A hopeless device (a retry of a task
        // that fits nowhere asks every device) costs one plan, not every subset.
        let everyone: Vec<usize> = forced.iter().chain(&movable).copied().collect();
        self.plan(id, device, &footprints, need, &everyone)?;
        let least = forced.len().max(1);
        let most = (forced.len() + n).min(self.most_victims);
        for k in least..=most {
            let mut best: Option<RoomPlan<'v>> = None;
            for mask in 0u32..(1u32 << n) {
                if mask.count_ones() as usize + forced.len() != k {
                    continue;
                }
                let victims: Vec<usize> = forced
                    .iter()
                    .copied()
                    .chain((0..n).filter(|b| mask & (1 << b) != 0).map(|b| movable[b]))
                    .collect();
                if let Some(plan) = self.plan(id, device, &footprints, need, &victims)
                    && best.as_ref().is_none_or(|b| plan.better_than(b))
                {
                    best = Some(plan);
                }
            }
            if best.is_some() {
                return best;
            }
        }
        None
    }

    /// The plan evicting the residents at `victims` of `device`, if the task then fits
    /// under every cap.
    fn plan<'v>(
        &self,
        id: &'v str,
        device: &'v DeviceState,
        footprints: &[u64],
        need: u64,
        victims: &[usize],
    ) -> Option<RoomPlan<'v>> {
        let info = device.info.as_ref()?;
        let params = &self.placer.params;
        let stay: Vec<usize> = (0..device.residents.len())
            .filter(|i| !victims.contains(i))
            .collect();
        let victim_ids: Vec<&'v str> = victims
            .iter()
            .map(|&i| device.residents[i].reservation.task_id.as_str())
            .collect();
        let work_lost_s = victims
            .iter()
            .map(|&i| lost_if_evicted_s(&device.residents[i], self.now_unix_ms))
            .sum();
        if stay.is_empty() {
            return Some(RoomPlan {
                device_id: id,
                victims: victim_ids,
                need_mib: need,
                work_lost_s,
                upper_slowdown: 1.0,
                tiebreak: self.tiebreak,
            });
        }
        let used: u64 = stay.iter().map(|&i| footprints[i]).sum();
        if used + need > params.usable_memory_mib(info.memory_mib) {
            return None;
        }
        let profiles: Vec<&TaskProfile> =
            stay.iter().map(|&i| &device.residents[i].profile).collect();
        let sm: f64 = profiles
            .iter()
            .map(|p| p.sm_util_pct.unwrap_or(0.0))
            .sum::<f64>()
            + self.profile.sm_util_pct.unwrap_or(0.0);
        let bw: f64 = profiles
            .iter()
            .map(|p| p.mem_bw_util_pct.unwrap_or(0.0))
            .sum::<f64>()
            + self.profile.mem_bw_util_pct.unwrap_or(0.0);
        if sm > params.sm_util_cap_pct || bw > params.mem_bw_util_cap_pct {
            return None;
        }
        let kind = info.kind.as_str();
        let staying: Vec<TaskProfile> = profiles.iter().map(|p| (*p).clone()).collect();
        let own = self.model.predict(kind, self.profile, &staying);
        cap_holds(&self.task.task_id, true, &own, self.cap).ok()?;
        for (j, &i) in stay.iter().enumerate() {
            let resident = &device.residents[i];
            let Some(cap) = resident.spec().slowdown_cap() else {
                continue;
            };
            let co: Vec<TaskProfile> = staying
                .iter()
                .enumerate()
                .filter(|&(o, _)| o != j)
                .map(|(_, p)| p.clone())
                .chain(std::iter::once(self.profile.clone()))
                .collect();
            let with = self.model.predict(kind, &resident.profile, &co);
            cap_holds(&resident.reservation.task_id, false, &with, cap).ok()?;
        }
        Some(RoomPlan {
            device_id: id,
            victims: victim_ids,
            need_mib: need,
            work_lost_s,
            upper_slowdown: own.upper_90.max(own.slowdown),
            tiebreak: self.tiebreak,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::*;
    use crate::model::ModelledMemory;
    use iadeep_predictor::PredictionSource;
    use iadeep_proto::{
        AvoidPairing, Claim, CoLocationSample, DeviceResidents, PriorityClass, TaskProfile,
    };

    fn production(mut spec: TaskSpec, cap: f64) -> TaskSpec {
        spec.priority_class = PriorityClass::Production as i32;
        spec.max_slowdown = Some(cap);
        spec
    }

    fn queue_reason(d: &Decision) -> &str {
        match &d.verdict {
            Verdict::Queue { reason, .. } => reason,
            other => panic!("expected queue, got {other:?}"),
        }
    }

    fn placed_on(d: &Decision) -> &str {
        match &d.verdict {
            Verdict::Place { device_id, .. } => device_id,
            other => panic!("expected a placement, got {other:?}"),
        }
    }

    /// With the newcomer, a production resident's slowdown would reach 1.2 (SM 60 +
    /// 60 under [`TimeShare`]), over its cap of 1.1: its device is refused, naming the
    /// job, the predicted upper slowdown and the cap; the same pair of opportunistic
    /// jobs shares a device as before.
    #[test]
    fn a_production_resident_is_protected_and_opportunistic_pairs_are_not() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(
            &mut view,
            "d0",
            32_000,
            &[production(spec("prod", 4000, 60.0, None), 1.1)],
        );
        let new = spec("new", 4000, 60.0, None);
        let d = placer().decide(&view, &new, &[], 0);
        let reason = queue_reason(&d);
        assert!(reason.contains("slowdown_cap: 1"), "{reason}");
        assert!(
            reason.contains("slowdown caps refused d0 (production job prod up to 1.20 > cap 1.10)"),
            "{reason}"
        );
        let why = &d.explanation.candidates[0].rejected_because;
        assert!(
            why.contains("production job prod's predicted slowdown could reach 1.20")
                && why.contains("cap of 1.10"),
            "{why}"
        );
        let a = placer().assess(&view, &new, &[], 0);
        assert_eq!(cap_refusals(&a.rejected), 1);
        // An opportunistic resident in the same place takes it.
        device(&mut view, "d1", 32_000, &[spec("opp", 4000, 60.0, None)]);
        let d = placer().decide(&view, &new, &[], 0);
        assert_eq!(placed_on(&d), "d1");
        // A looser cap admits it too.
        device(
            &mut view,
            "d1",
            32_000,
            &[production(spec("prod2", 4000, 60.0, None), 1.25)],
        );
        assert_eq!(placed_on(&placer().decide(&view, &new, &[], 0)), "d1");
    }

    /// A production newcomer is not placed where its own predicted slowdown would
    /// exceed its cap; with a cap it meets, it is.
    #[test]
    fn a_production_newcomer_is_protected() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "d0", 32_000, &[spec("opp", 4000, 60.0, None)]);
        let tight = production(spec("prod", 4000, 60.0, None), 1.1);
        let a = placer().assess(&view, &tight, &[], 0);
        assert!(a.candidates.is_empty(), "{a:?}");
        assert_eq!(
            a.rejected[0].1,
            Rejection::SlowdownCap {
                task_id: "prod".into(),
                newcomer: true,
                predicted_upper: 1.2,
                cap: 1.1
            }
        );
        assert!(
            a.rejected[0]
                .1
                .to_string()
                .contains("the task's own (production job prod)"),
            "{}",
            a.rejected[0].1
        );
        let loose = production(spec("prod", 4000, 60.0, None), 1.3);
        assert_eq!(placed_on(&placer().decide(&view, &loose, &[], 0)), "d0");
    }

    /// Slows every task with company by 1.05, but could be 1.2 (its 90 % interval).
    #[derive(Debug)]
    struct Unsure;

    impl SlowdownModel for Unsure {
        fn predict(&self, _: &str, _: &TaskProfile, co: &[TaskProfile]) -> Prediction {
            if co.is_empty() {
                return Prediction::certain(1.0, PredictionSource::Given);
            }
            Prediction {
                slowdown: 1.05,
                uncertainty: 0.05,
                lower_90: 1.0,
                upper_90: 1.2,
                source: PredictionSource::Given,
            }
        }
        fn observe(&self, _: &CoLocationSample) {}
    }

    /// The cap is checked at the upper end of the 90 % interval, not the point
    /// prediction: a 1.05 that could be 1.2 does not meet a cap of 1.1.
    #[test]
    fn the_cap_is_checked_at_the_upper_end_of_the_interval() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(
            &mut view,
            "d0",
            32_000,
            &[production(spec("prod", 4000, 10.0, None), 1.1)],
        );
        let p = Placer::new(PlacerParams::default(), Arc::new(Unsure)).expect("valid");
        let a = p.assess(&view, &spec("new", 4000, 10.0, None), &[], 0);
        assert!(
            matches!(&a.rejected[0].1, Rejection::SlowdownCap { predicted_upper, .. } if *predicted_upper == 1.2),
            "{a:?}"
        );
    }

    /// A task is not placed next to one it must avoid (either way round) until the
    /// pairing expires.
    #[test]
    fn an_avoided_pairing_is_refused_until_it_expires() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "d0", 32_000, &[spec("prod", 1000, 10.0, None)]);
        view.set_avoid(
            AvoidPairing {
                production_task_id: "prod".into(),
                evicted_task_id: "opp".into(),
                until_unix_ms: 10_000,
                reason: String::new(),
            },
            1,
        );
        let d = placer().decide(&view, &spec("opp", 1000, 10.0, None), &[], 0);
        let reason = queue_reason(&d);
        assert!(reason.contains("avoided_pairing: 1"), "{reason}");
        assert!(
            d.explanation.candidates[0]
                .rejected_because
                .contains("must not share a GPU with prod"),
            "{:?}",
            d.explanation
        );
        // Anyone else is welcome; after the pairing expires, so is the evicted job.
        assert_eq!(
            placed_on(&placer().decide(&view, &spec("other", 1000, 10.0, None), &[], 0)),
            "d0"
        );
        assert_eq!(
            placed_on(&placer().decide(&view, &spec("opp", 1000, 10.0, None), &[], 10_000)),
            "d0"
        );
        // The other way round: the production job does not join the evicted one (it
        // may only make room by evicting it again).
        device(&mut view, "d0", 32_000, &[spec("opp", 1000, 10.0, None)]);
        let back = production(spec("prod", 1000, 10.0, None), 1.5);
        let a = placer().assess(&view, &back, &[], 0);
        assert_eq!(
            a.rejected,
            vec![(
                "d0",
                Rejection::Avoided {
                    task_id: "opp".into()
                }
            )]
        );
        assert!(matches!(
            placer().decide(&view, &back, &[], 0).verdict,
            Verdict::Evict { victims, .. } if victims == ["opp".to_owned()]
        ));
    }

    /// A card of 32,000 MiB (usable less the margin) holding two opportunistic jobs of
    /// 12,000 MiB placed at 1 s and 5 s, and a small production job.
    fn crowded() -> ClusterView {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(
            &mut view,
            "d0",
            32_000,
            &[
                spec("old", 12_000, 10.0, None),
                spec("young", 12_000, 10.0, None),
                production(spec("prod", 2000, 10.0, None), 1.1),
            ],
        );
        let mut record = view
            .device("d0")
            .map(|d| d.residents_record("d0"))
            .expect("d0");
        record.reservations[0].placed_at_unix_ms = 1_000;
        record.reservations[1].placed_at_unix_ms = 5_000;
        view.apply_residents("d0", Some(record), 2);
        view
    }

    /// With a patience, a production job that fits nowhere queues like any task until it
    /// has waited that long since its submission, told when it may evict; then it makes
    /// room as without one. A job that does not say when it was submitted evicts at once.
    #[test]
    fn a_production_job_evicts_only_once_it_has_waited_its_patience() {
        let view = crowded();
        let patient = Placer::new(
            PlacerParams {
                room_eviction_patience: Duration::from_secs(600),
                ..PlacerParams::default()
            },
            Arc::new(TimeShare),
        )
        .expect("valid params");
        let mut new = production(spec("urgent", 10_000, 10.0, None), 1.1);
        new.submitted_at_unix_ms = 5_000;
        let d = patient.decide(&view, &new, &[], 10_000);
        match &d.verdict {
            Verdict::Queue {
                retry_after,
                reason,
            } => {
                assert!(*retry_after <= Duration::from_secs(595), "{retry_after:?}");
                assert!(reason.contains("in 595 s"), "{reason}");
            }
            other => panic!("expected to queue, got {other:?}"),
        }
        let evicts = |d: Decision| matches!(d.verdict, Verdict::Evict { .. });
        assert!(evicts(patient.decide(&view, &new, &[], 605_000)));
        new.submitted_at_unix_ms = 0;
        assert!(evicts(patient.decide(&view, &new, &[], 10_000)));
    }

    /// A production job that fits nowhere makes room by evicting the fewest
    /// opportunistic residents, among equals the one that has run least (least work
    /// lost), never a production one; an opportunistic job in its place just queues.
    #[test]
    fn a_production_job_that_fits_nowhere_evicts_the_fewest_cheapest_opportunistic_jobs() {
        let view = crowded();
        let new = production(spec("urgent", 10_000, 10.0, None), 1.1);
        let d = placer().decide(&view, &new, &[], 10_000);
        match &d.verdict {
            Verdict::Evict {
                device_id,
                victims,
                claim_mib,
                claim_until_unix_ms,
                reason,
                ..
            } => {
                assert_eq!(device_id, "d0");
                assert_eq!(victims, &["young".to_owned()]);
                assert_eq!(*claim_mib, 10_000);
                assert_eq!(*claim_until_unix_ms, 70_000);
                assert!(
                    reason.contains("evicting opportunistic young on d0"),
                    "{reason}"
                );
            }
            other => panic!("expected a room eviction, got {other:?}"),
        }
        assert!(
            d.explanation
                .summary
                .starts_with("queued while room is made"),
            "{}",
            d.explanation.summary
        );
        // Needing room both take, both go.
        let big = production(spec("big", 20_000, 10.0, None), 1.1);
        assert!(matches!(
            &placer().decide(&view, &big, &[], 10_000).verdict,
            Verdict::Evict { victims, .. } if victims.len() == 2
        ));
        // More than the opportunistic jobs free: nothing to do but wait.
        let huge = production(spec("huge", 30_500, 10.0, None), 1.1);
        assert!(matches!(
            placer().decide(&view, &huge, &[], 10_000).verdict,
            Verdict::Queue { .. }
        ));
        let opp = spec("opp", 10_000, 10.0, None);
        assert!(matches!(
            placer().decide(&view, &opp, &[], 10_000).verdict,
            Verdict::Queue { .. }
        ));
        // A resident already leaving (a cap breach's victim) costs nothing more.
        let mut view = view;
        view.set_assignment(
            iadeep_proto::BatchSizeAssignment {
                task_id: "old".into(),
                batch_size: 32,
                evict: true,
                ..Default::default()
            },
            5,
        );
        assert!(matches!(
            &placer().decide(&view, &new, &[], 10_000).verdict,
            Verdict::Evict { victims, .. } if victims == &["old".to_owned()]
        ));
    }

    /// Fewer victims win over less work lost: two young jobs on d0 or one old one on
    /// d1 — the old one goes.
    #[test]
    fn fewer_victims_win_over_less_work_lost() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(
            &mut view,
            "d0",
            32_000,
            &[
                spec("young1", 12_000, 10.0, None),
                spec("young2", 12_000, 10.0, None),
            ],
        );
        device(&mut view, "d1", 32_000, &[spec("old", 24_000, 10.0, None)]);
        for (id, at) in [("d0", 9_000), ("d1", 1_000)] {
            let mut record = view
                .device(id)
                .map(|d| d.residents_record(id))
                .expect("device");
            for r in &mut record.reservations {
                r.placed_at_unix_ms = at;
            }
            view.apply_residents(id, Some(record), 2);
        }
        let new = production(spec("urgent", 20_000, 10.0, None), 1.1);
        let d = placer().decide(&view, &new, &[], 10_000);
        assert!(
            matches!(&d.verdict, Verdict::Evict { device_id, victims, .. }
                if device_id == "d1" && victims == &["old".to_owned()]),
            "{:?}",
            d.verdict
        );
    }

    /// A room eviction also clears a production job's cap: the newcomer fits the
    /// memory, but next to the heavy opportunistic job the production resident would
    /// be slowed past its cap. Evicting the light job would lose less work (it started
    /// later) but leaves the resident at 1.2 > 1.1; evicting the heavy one makes room.
    #[test]
    fn a_room_eviction_makes_room_under_the_caps() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(
            &mut view,
            "d0",
            32_000,
            &[
                spec("light", 1000, 5.0, None),
                spec("heavy", 1000, 60.0, None),
                production(spec("prod", 1000, 40.0, None), 1.1),
            ],
        );
        let mut record = view
            .device("d0")
            .map(|d| d.residents_record("d0"))
            .expect("d0");
        record.reservations[0].placed_at_unix_ms = 5_000;
        record.reservations[1].placed_at_unix_ms = 1_000;
        view.apply_residents("d0", Some(record), 2);
        // With everyone: SM 5 + 60 + 40 + 20 = 125 %, a slowdown of 1.25.
        let new = production(spec("urgent", 1000, 20.0, None), 1.2);
        let d = placer().decide(&view, &new, &[], 10_000);
        assert!(
            matches!(&d.verdict, Verdict::Evict { victims, .. } if victims == &["heavy".to_owned()]),
            "{:?}",
            d.verdict
        );
    }

    /// `view` with a claim on d0 by `claimant`, evicting `evicting`.
    fn claimed(view: &mut ClusterView, claimant: &str, evicting: &[&str], until: i64) {
        let mut record: DeviceResidents = view
            .device("d0")
            .map(|d| d.residents_record("d0"))
            .expect("d0");
        record.claims = vec![Claim {
            task_id: claimant.into(),
            mem_mib: 10_000,
            until_unix_ms: until,
            evicting: evicting.iter().map(|s| (*s).to_owned()).collect(),
        }];
        view.apply_residents("d0", Some(record), 3);
    }

    /// While its victims are still resident, the claimant is told to wait for them
    /// (their memory counts), not to evict again; once they left it is placed on the
    /// claimed device, while anyone else finds the claimed memory taken until the
    /// claim expires.
    #[test]
    fn the_claimed_room_goes_to_its_claimant_after_the_victims_leave() {
        let mut view = crowded();
        let urgent = production(spec("urgent", 10_000, 10.0, None), 1.1);
        claimed(&mut view, "urgent", &["young"], 70_000);
        let d = placer().decide(&view, &urgent, &[], 10_000);
        let reason = queue_reason(&d);
        assert!(reason.contains("waiting for young to leave"), "{reason}");
        // The victim leaves (its release rewrites the record, claims kept).
        let mut record = view
            .device("d0")
            .map(|d| d.residents_record("d0"))
            .expect("d0");
        record.reservations.retain(|r| r.task_id != "young");
        view.apply_residents("d0", Some(record), 4);
        // Another task of the same size finds the room taken, and says by whom.
        let other = spec("other", 10_000, 10.0, None);
        let d = placer().decide(&view, &other, &[], 20_000);
        let reason = queue_reason(&d);
        assert!(reason.contains("claimed: 1"), "{reason}");
        assert!(
            d.explanation.candidates[0]
                .rejected_because
                .contains("10000 MiB are held for production task urgent"),
            "{:?}",
            d.explanation
        );
        // Another production job does not evict on a claimed device either.
        let rival = production(spec("rival", 10_000, 10.0, None), 1.1);
        assert!(matches!(
            placer().decide(&view, &rival, &[], 20_000).verdict,
            Verdict::Queue { .. }
        ));
        // The claimant takes it.
        let d = placer().decide(&view, &urgent, &[], 20_000);
        assert!(
            matches!(&d.verdict, Verdict::Place { device_id, reserved_mem_mib: 10_000, .. } if device_id == "d0"),
            "{:?}",
            d.verdict
        );
        // After the claim expires, anyone may.
        assert_eq!(
            placed_on(&placer().decide(&view, &other, &[], 70_000)),
            "d0"
        );
    }

    /// Every task with company slows down 2.2×: two tasks do less work together
    /// than one alone, so the throughput guard refuses every shared device.
    #[derive(Debug)]
    struct Crowded;

    impl SlowdownModel for Crowded {
        fn predict(&self, _: &str, _: &TaskProfile, co: &[TaskProfile]) -> Prediction {
            let slowdown = if co.is_empty() { 1.0 } else { 2.2 };
            Prediction::certain(slowdown, PredictionSource::Given)
        }
        fn observe(&self, _: &CoLocationSample) {}
    }

    /// On the device it claimed, after its victims left, the claimant is held to the
    /// caps only: the throughput guard that refuses anyone else on a device like it
    /// (d1) does not turn it away (to evict again elsewhere).
    #[test]
    fn on_its_claimed_device_only_the_caps_hold_the_claimant_back() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "d0", 32_000, &[spec("stay", 4000, 10.0, None)]);
        device(&mut view, "d1", 32_000, &[spec("stay1", 4000, 10.0, None)]);
        claimed(&mut view, "urgent", &["gone"], 70_000);
        let p = Placer::new(PlacerParams::default(), Arc::new(Crowded)).expect("valid");
        let urgent = production(spec("urgent", 4000, 10.0, None), 3.0);
        let d = p.decide(&view, &urgent, &[], 10_000);
        assert_eq!(placed_on(&d), "d0");
        let other = production(spec("other", 4000, 10.0, None), 3.0);
        let a = p.assess(&view, &other, &[], 10_000);
        let kinds: Vec<(&str, &str)> = a.rejected.iter().map(|(d, r)| (*d, r.kind())).collect();
        assert_eq!(
            kinds,
            [("d0", "claimed"), ("d1", "throughput_gain")],
            "{a:?}"
        );
    }

    /// Adds `task` to d0's residents, keeping the record's claims (what the service's
    /// placement writes).
    fn join_d0(view: &mut ClusterView, task: &TaskSpec, revision: i64) {
        let mut record = view
            .device("d0")
            .map(|d| d.residents_record("d0"))
            .expect("d0");
        record.reservations.push(iadeep_proto::Reservation {
            task_id: task.task_id.clone(),
            reserved_mem_mib: task.gpu_mem_request_mib,
            spec: Some(task.clone()),
            ..Default::default()
        });
        view.apply_residents("d0", Some(record), revision);
    }

    /// The churn the simulator found: a production job evicted a resident of d0 to make
    /// room under its cap; the victim has left, and the card has memory to spare beside
    /// the claim. An opportunistic job that would fit there (and would slow nobody
    /// already there past a cap) is refused the claimed device all the same, since next
    /// to it the claimant would be slowed past its cap (SM 40 + 50 + 40: 1.3 > 1.1) and
    /// would evict again. The claimant, coming back, is placed there without a second
    /// eviction; once it runs, the caps decide as usual (the newcomer is refused for the
    /// claimant's cap, no longer for a claim).
    #[test]
    fn a_claimed_device_takes_no_newcomer_so_the_claimant_does_not_evict_twice() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "d0", 32_000, &[spec("stay", 4000, 40.0, None)]);
        claimed(&mut view, "urgent", &["gone"], 70_000);
        let urgent = production(spec("urgent", 10_000, 50.0, None), 1.1);
        let opp = spec("opp", 4000, 40.0, None);
        let d = placer().decide(&view, &opp, &[], 10_000);
        if let Verdict::Place { .. } = d.verdict {
            // What the churn did next: the newcomer runs there.
            join_d0(&mut view, &opp, 5);
        } else {
            let reason = queue_reason(&d);
            assert!(reason.contains("claimed: 1"), "{reason}");
            assert!(
                d.explanation.candidates[0]
                    .rejected_because
                    .contains("takes no other task until urgent is placed"),
                "{:?}",
                d.explanation
            );
        }
        let d = placer().decide(&view, &urgent, &[], 12_000);
        assert!(
            matches!(&d.verdict, Verdict::Place { device_id, reserved_mem_mib: 10_000, .. } if device_id == "d0"),
            "the claimant must be placed on its claimed device, not evict again: {:?}",
            d.verdict
        );
        // Placed (the claim spent with the placement), the caps keep the newcomer off.
        let mut record = view
            .device("d0")
            .map(|d| d.residents_record("d0"))
            .expect("d0");
        record.claims.clear();
        view.apply_residents("d0", Some(record), 6);
        join_d0(&mut view, &urgent, 7);
        let a = placer().assess(&view, &opp, &[], 13_000);
        assert_eq!(a.rejected[0].1.kind(), "slowdown_cap", "{a:?}");
        // Nor does any other task join a claimed device before then, a production one
        // or one that only needs a sliver of the card; an expired claim holds nothing.
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "d0", 32_000, &[spec("stay", 4000, 40.0, None)]);
        claimed(&mut view, "urgent", &["gone"], 70_000);
        for task in [
            spec("tiny", 100, 1.0, None),
            production(spec("other", 1000, 1.0, None), 2.0),
        ] {
            let a = placer().assess(&view, &task, &[], 69_999);
            assert_eq!(
                a.rejected,
                vec![(
                    "d0",
                    Rejection::Claimed {
                        task_id: "urgent".into(),
                        claimed_mib: 10_000,
                        until_unix_ms: 70_000
                    }
                )]
            );
            assert_eq!(placed_on(&placer().decide(&view, &task, &[], 70_000)), "d0");
        }
    }

    #[test]
    fn claims_hold_until_they_expire() {
        let claim = Claim {
            until_unix_ms: 100,
            ..Default::default()
        };
        assert!(claim_holds(&claim, 99));
        assert!(!claim_holds(&claim, 100));
    }
}
