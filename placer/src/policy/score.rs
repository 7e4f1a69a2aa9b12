//! Scoring and ranking (step 2 of the module docs of [`super`]): the predicted Σ PD
//! increase of each feasible shared device, its throughput guard, the delay a
//! promised device would cause, and the order of the candidates.
use std::cmp::Ordering;
use std::sync::Arc;

use iadeep_proto::{TaskProfile, TaskSpec};

use super::feasibility::{Fit, claimed_by_others};
use super::verdict::Promises;
use super::{Assessment, Candidate, Placer, Rejection, Shrink};
use crate::view::{AloneTogether, ClusterView, DeviceState, profile_of};
use iadeep_predictor::{Prediction, PredictionSource, SlowdownModel};

/// What [`Placer::score`] says of a shared device.
struct Score {
    /// The newcomer's own predicted slowdown.
    newcomer: Prediction,
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

/// The task being assessed, as every device sees it.
struct Newcomer<'t> {
    task_id: &'t str,
    /// Its slowdown cap when it is production (`TaskSpec::slowdown_cap`).
    cap: Option<f64>,
    /// The tasks it must not share a device with now (unexpired avoid pairings; almost
    /// always none, so checking a device costs nothing).
    avoid: Vec<String>,
    /// The device it holds a live room claim on, if any: there the residents it
    /// evicted left for it, and only the slowdown caps hold it back.
    claimed_on: Option<String>,
    profile: TaskProfile,
    /// Its footprint at the batch size it starts at; `None` when nothing is known of
    /// its memory.
    footprint: Option<u64>,
    /// Hash of its id, for the per-task tie-break.
    hash: u64,
}

/// What the walk over the considered devices collects.
struct Survey<'v> {
    now_unix_ms: i64,
    /// Seconds until each considered device with residents is predicted to be idle,
    /// with its id (ties in time are ordered by id, so "the first q" is well defined).
    idle_in_s: Vec<(f64, &'v str)>,
    /// Feasible shared devices waiting for the model.
    shared: Vec<Shared<'v>>,
    out: Assessment<'v>,
}

impl Placer {
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
        let waiting_ahead = view.waiting_ahead_of(task, now_unix_ms);
        self.assess_in_queue(view, task, restrict, now_unix_ms, limit, waiting_ahead)
    }

    /// [`Placer::assess_limited`] of a task whose place in the queue is known:
    /// `waiting_ahead` tasks wait ahead of it ([`ClusterView::waiting_ahead_of`], which
    /// counts over the whole queue; the hold, which assesses each task of the queue in
    /// turn, knows each one's place from its position).
    pub(super) fn assess_in_queue<'v>(
        &self,
        view: &'v ClusterView,
        task: &TaskSpec,
        restrict: &'v [String],
        now_unix_ms: i64,
        limit: usize,
        waiting_ahead: usize,
    ) -> Assessment<'v> {
        let newcomer = Newcomer {
            task_id: &task.task_id,
            cap: task.slowdown_cap(),
            avoid: avoided_partners(view, &task.task_id, now_unix_ms),
            claimed_on: super::room::own_claim(view, task, now_unix_ms)
                .map(|(id, _, _)| id.to_owned()),
            profile: profile_of(task, None),
            // The task starts at its submitted batch size (its starting assignment).
            footprint: view
                .memory()
                .bound_mib(task, None, task.initial_batch_size.max(1)),
            hash: crate::view::fnv1a(task.task_id.as_bytes()),
        };
        let mut survey = Survey {
            now_unix_ms,
            idle_in_s: Vec::new(),
            shared: Vec::new(),
            out: Assessment {
                waiting_ahead,
                ..Assessment::default()
            },
        };
        if restrict.is_empty() {
            for (id, device) in view.devices() {
                self.consider(view, &newcomer, id, Some(device), &mut survey);
            }
        } else {
            for id in restrict {
                self.consider(view, &newcomer, id.as_str(), view.device(id), &mut survey);
            }
        }
        let Survey {
            mut idle_in_s,
            mut shared,
            mut out,
            ..
        } = survey;
        out.earliest_idle_s = idle_in_s.iter().map(|(s, _)| *s).reduce(f64::min);
        let promises = Promises::new(&mut idle_in_s, out.waiting_ahead);
        out.residents_done_s = promises.wait_s();
        out.wait_s = self.wait.wait_s(task, out.residents_done_s, now_unix_ms);
        // At least a second: the delay is priced per second of it.
        let duration_s = self.expected_duration_s(task).max(1.0);
        out.unscored = prescreen(&mut shared, limit);
        self.score_shared(shared, &newcomer, &promises, duration_s, &mut out);
        sort_head(&mut out.candidates, self.params.explain_top_k);
        out
    }

    /// Sorts one considered device into a rejection, an idle candidate (exactly 1.0,
    /// no model needed) or a feasible shared device for the model, noting when it is
    /// predicted to free up.
    fn consider<'v>(
        &self,
        view: &'v ClusterView,
        newcomer: &Newcomer<'_>,
        id: &'v str,
        device: Option<&'v DeviceState>,
        survey: &mut Survey<'v>,
    ) {
        let Some(device) = device else {
            survey.out.rejected.push((id, Rejection::UnknownDevice));
            return;
        };
        if let Some(other) = avoided_on(device, &newcomer.avoid) {
            survey.out.rejected.push((
                id,
                Rejection::Avoided {
                    task_id: other.to_owned(),
                },
            ));
            return;
        }
        let idle_in = device
            .summary()
            .idle_at_unix_ms
            .map(|at| (at - survey.now_unix_ms).max(0) as f64 / 1000.0);
        if device.info.is_some()
            && let Some(s) = idle_in
        {
            survey.idle_in_s.push((s, id));
        }
        let tiebreak = tiebreak(newcomer.hash, device.id_hash);
        let claimed = claimed_by_others(device, newcomer.task_id, survey.now_unix_ms);
        match self.feasible(
            device,
            &newcomer.profile,
            newcomer.footprint,
            view.memory(),
            claimed,
        ) {
            Ok(Fit {
                need,
                provisional,
                demand: None,
                shrinks,
            }) => survey.out.candidates.push(Candidate {
                device_id: id,
                pd_increase: 1.0,
                pd_increase_upper_90: 1.0,
                uncertainty: 0.0,
                rank: 1.0,
                reserved_mem_mib: need,
                shrinks,
                idle: true,
                newcomer: Prediction::certain(1.0, PredictionSource::Given),
                provisional,
                delay_s: 0.0,
                tiebreak,
            }),
            Ok(Fit {
                need,
                provisional,
                demand: Some(demand),
                shrinks,
            }) => survey.shared.push(Shared {
                id,
                device,
                need,
                provisional,
                shrinks,
                demand,
                tiebreak,
                idle_in,
            }),
            Err(rejection) => survey.out.rejected.push((id, rejection)),
        }
    }

    /// Asks the slowdown model about each feasible shared device that passed the
    /// pre-screening: a candidate ranked by its predicted Σ PD increase, its
    /// uncertainty and the delay it would cause a task ahead that was promised it, or
    /// a rejection.
    fn score_shared<'v>(
        &self,
        shared: Vec<Shared<'v>>,
        newcomer: &Newcomer<'_>,
        promises: &Promises<'v>,
        duration_s: f64,
        out: &mut Assessment<'v>,
    ) {
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
            let claimed = newcomer.claimed_on.as_deref() == Some(id);
            match self.score(model, device, newcomer, claimed, &mut scratch) {
                Ok(Score {
                    newcomer,
                    pd_increase,
                    pd_increase_upper_90,
                    uncertainty,
                }) => {
                    let delay_s = match idle_in {
                        Some(r) if promises.promised(id, idle_in) => (duration_s - r).max(0.0),
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
    }

    /// Predicted Σ PD increase of a shared device, pessimistic and not, and its
    /// uncertainty; or why the device is refused: a production job's slowdown cap
    /// (checked first: it is a promise, the others are thresholds), the Σ PD cap or
    /// the throughput guard. On the device the newcomer `claimed` by a room eviction
    /// only the caps hold: the evicted jobs left for it, and a threshold turning it
    /// away there would only make it evict again elsewhere.
    fn score(
        &self,
        model: &dyn SlowdownModel,
        device: &DeviceState,
        newcomer: &Newcomer<'_>,
        claimed: bool,
        scratch: &mut Vec<TaskProfile>,
    ) -> Result<Score, Rejection> {
        let new_profile = &newcomer.profile;
        let kind = device.info.as_ref().map_or("", |i| i.kind.as_str());
        let profiles = &device.summary().profiles;
        let own = model.predict(kind, new_profile, profiles);
        if let Some(cap) = newcomer.cap {
            cap_holds(newcomer.task_id, true, &own, cap)?;
        }
        let mut increase = own.slowdown;
        let mut increase_upper = own.upper_90.max(own.slowdown);
        // Combined normalised throughput Σ 1/IF, with the newcomer and without it.
        let mut after = throughput(own.slowdown);
        let mut before = 0.0;
        let mut variance = own.uncertainty * own.uncertainty;
        // Each resident's slowdown among the residents alone: reused while neither the
        // residents nor the model changed (see `SlowdownCache`).
        let alone = alone_together(model, device, kind, profiles, scratch);
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
            if let Some(resident) = device.residents.get(i)
                && let Some(cap) = resident.spec().slowdown_cap()
            {
                cap_holds(&resident.reservation.task_id, false, &with, cap)?;
            }
            increase += with.slowdown - without[i];
            increase_upper += with.upper_90.max(with.slowdown) - without[i];
            variance += with.uncertainty * with.uncertainty;
            after += throughput(with.slowdown);
            before += throughput(without[i]);
        }
        if increase > self.params.max_pd_increase && !claimed {
            return Err(Rejection::PdCap {
                predicted: increase,
                cap: self.params.max_pd_increase,
            });
        }
        // A gain within rounding noise of the minimum meets it: a rejection must be
        // one its text can show (see `separating_decimals`).
        if after - before < self.params.min_throughput_gain - 1e-9 && !claimed {
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
}

/// Whether production job `task_id`'s predicted slowdown keeps under its `cap` at the
/// upper end of its 90 % interval (the cap rule, see the module docs of [`super`]).
pub(super) fn cap_holds(
    task_id: &str,
    newcomer: bool,
    predicted: &Prediction,
    cap: f64,
) -> Result<(), Rejection> {
    let upper = predicted.upper_90.max(predicted.slowdown);
    if upper > cap {
        return Err(Rejection::SlowdownCap {
            task_id: task_id.to_owned(),
            newcomer,
            predicted_upper: upper,
            cap,
        });
    }
    Ok(())
}

/// The tasks `task_id` must not share a device with at `now_unix_ms`: the other task
/// of each avoid pairing naming it that [`ClusterView::avoids`] says still holds.
pub(super) fn avoided_partners(view: &ClusterView, task_id: &str, now_unix_ms: i64) -> Vec<String> {
    let mut partners: Vec<String> = view
        .avoid_pairings()
        .filter_map(|(p, _)| {
            if p.production_task_id == task_id {
                Some(&p.evicted_task_id)
            } else if p.evicted_task_id == task_id {
                Some(&p.production_task_id)
            } else {
                None
            }
        })
        .filter(|other| view.avoids(task_id, other, now_unix_ms))
        .cloned()
        .collect();
    partners.sort();
    partners.dedup();
    partners
}

/// The first task on `device` (a resident or the holder of a room claim) that is in
/// `avoid`.
pub(super) fn avoided_on<'d>(device: &'d DeviceState, avoid: &[String]) -> Option<&'d str> {
    if avoid.is_empty() {
        return None;
    }
    let avoided = |id: &str| avoid.iter().any(|a| a == id);
    device
        .residents
        .iter()
        .map(|r| r.reservation.task_id.as_str())
        .chain(device.claims.iter().map(|c| c.task_id.as_str()))
        .find(|id| avoided(id))
}

/// Each resident's slowdown among the residents alone, and its pairwise prefix when
/// the model composes pairwise: from the device's cache when neither the residents
/// nor the model changed since, else predicted and cached.
fn alone_together(
    model: &dyn SlowdownModel,
    device: &DeviceState,
    kind: &str,
    profiles: &[TaskProfile],
    scratch: &mut Vec<TaskProfile>,
) -> Arc<AloneTogether> {
    let version = model.version();
    match version.and_then(|v| device.alone_together.get(v)) {
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
    }
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

/// Keeps the `limit` feasible shared devices with the least aggregate demand (every
/// one when `limit` is 0) and says how many were left unscored.
fn prescreen(shared: &mut Vec<Shared<'_>>, limit: usize) -> usize {
    if limit == 0 || shared.len() <= limit {
        return 0;
    }
    shared.select_nth_unstable_by(limit - 1, |a, b| {
        a.demand
            .partial_cmp(&b.demand)
            .unwrap_or(Ordering::Equal)
            .then(a.tiebreak.cmp(&b.tiebreak))
    });
    let unscored = shared.len() - limit;
    shared.truncate(limit);
    unscored
}

/// Orders the head of `candidates`, best first, leaving the rest in no particular
/// order: only the best and the few an explanation lists (`top_k`) need ordering.
fn sort_head(candidates: &mut [Candidate<'_>], top_k: usize) {
    let head = top_k.max(1);
    if candidates.len() > head {
        candidates.select_nth_unstable_by(head - 1, better);
    }
    let head = head.min(candidates.len());
    candidates[..head].sort_unstable_by(better);
}

/// Mixes the task's and the device's id hashes (SplitMix64 finaliser), so each task
/// orders equally good devices differently.
pub(super) fn tiebreak(task_hash: u64, device_hash: u64) -> u64 {
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
    use super::super::test_support::*;
    use super::*;
    use crate::model::ModelledMemory;
    use crate::params::PlacerParams;
    use crate::policy::Verdict;
    use iadeep_proto::{CoLocationSample, TaskReport};

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

    /// [`TimeShare`] that counts its predictions and says which version it is.
    #[derive(Debug, Default)]
    struct Counted {
        calls: std::sync::atomic::AtomicU64,
        version: std::sync::atomic::AtomicU64,
    }

    impl SlowdownModel for Counted {
        fn predict(&self, kind: &str, task: &TaskProfile, co: &[TaskProfile]) -> Prediction {
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
        fn predict(&self, _: &str, _: &TaskProfile, co: &[TaskProfile]) -> Prediction {
            Prediction::certain(
                if co.is_empty() { 1.0 } else { self.0 },
                PredictionSource::Given,
            )
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
}
