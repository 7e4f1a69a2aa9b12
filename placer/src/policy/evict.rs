//! Which opportunistic job a cap breach evicts: a pure choice over the view, shared by
//! the placer's eviction executor ([`crate::eviction`]) and the simulator.
//!
//! A breach (a [`CapBreach`] from the device's tuner) says that a production job stayed
//! measured above its slowdown cap for several rounds although every opportunistic
//! co-runner already runs at its smallest batch size: shrinking cannot help any more,
//! one of them must go. Evicting the wrong one costs a job its work since its last
//! checkpoint and leaves the production job above its cap, so the choice follows the
//! measurements.
//!
//! **Blame.** A co-runner's blame is how much the production job's slowdown is
//! predicted to drop if that co-runner alone left the device:
//! `IF(production | every co-runner) − IF(production | every co-runner but it)`, both
//! from the placer's [`SlowdownModel`] at the batch sizes the jobs run at now (their
//! reports'). That model is the one placement uses, and the daemon trains it online
//! on the co-location samples this cluster's tuners measure (every sample the tuners
//! write reaches [`SlowdownModel::observe`]); its per-job effects are keyed by model
//! name, so a job measured to slow its neighbours more than its profile says is blamed
//! for it. Measured interference is thereby what ranks the co-runners; the breach
//! itself (measured PD over the cap) is what triggers the eviction, never a prediction.
//!
//! **Ties** (a model that cannot tell two co-runners apart, e.g. before any sample of
//! their models) go to the co-runner whose solo profile takes more of what co-runners
//! contend for (SM plus DRAM-bandwidth utilisation, as measured alone), then to the
//! smaller task id, so every placer and the simulator choose the same victim.
//!
//! Only residents of the device that the breach lists and that are not production jobs
//! are candidates: a co-runner that left meanwhile needs no eviction, and a production
//! job is never evicted for another.

use iadeep_predictor::SlowdownModel;
use iadeep_proto::{CapBreach, TaskProfile};

use crate::view::{ClusterView, Resident};

/// The co-runner a breach evicts, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Victim {
    pub task_id: String,
    /// Its blame: the predicted drop of the production job's slowdown if it left (see
    /// the module docs).
    pub blame: f64,
    /// For the evicted job's log, the avoid record and the placer's log: which
    /// production job, its measured PD and cap, and the blame.
    pub reason: String,
}

/// The blame of `candidate` for the slowdown of `production` on `device_id` (see the
/// module docs): the predicted drop of the production job's slowdown if `candidate`
/// left the device. `None` when either is not a resident of the device.
pub fn blame(
    view: &ClusterView,
    device_id: &str,
    production: &str,
    candidate: &str,
    model: &dyn SlowdownModel,
) -> Option<f64> {
    let device = view.device(device_id)?;
    let kind = device.info.as_ref().map_or("", |i| i.kind.as_str());
    let find = |id: &str| {
        device
            .residents
            .iter()
            .find(|r| r.reservation.task_id == id)
    };
    let prod = find(production)?;
    find(candidate)?;
    Some(blame_among(model, kind, prod, &device.residents, candidate))
}

/// [`blame`] over residents already found.
fn blame_among(
    model: &dyn SlowdownModel,
    kind: &str,
    production: &Resident,
    residents: &[Resident],
    candidate: &str,
) -> f64 {
    let prod_id = production.reservation.task_id.as_str();
    let others = |skip: Option<&str>| -> Vec<TaskProfile> {
        residents
            .iter()
            .filter(|r| {
                let id = r.reservation.task_id.as_str();
                id != prod_id && Some(id) != skip
            })
            .map(|r| r.profile.clone())
            .collect()
    };
    let with = model.predict(kind, &production.profile, &others(None));
    let without = model.predict(kind, &production.profile, &others(Some(candidate)));
    let drop = with.slowdown - without.slowdown;
    if drop.is_finite() { drop } else { 0.0 }
}

/// The solo SM plus DRAM-bandwidth utilisation of a resident (unknown counts 0): the
/// tie-break between co-runners the model blames alike.
fn solo_pressure(r: &Resident) -> f64 {
    r.profile.sm_util_pct.unwrap_or(0.0) + r.profile.mem_bw_util_pct.unwrap_or(0.0)
}

/// The co-runner `breach` evicts on `device_id`: among the breach's
/// `opportunistic_task_ids` that are still residents there and are not production
/// jobs, the one with the largest [`blame`] (ties: see the module docs). `None` when
/// the breach is stale: its production job left the device, or none of the co-runners
/// it lists is still there.
pub fn choose_victim(
    view: &ClusterView,
    device_id: &str,
    breach: &CapBreach,
    model: &dyn SlowdownModel,
) -> Option<Victim> {
    let device = view.device(device_id)?;
    let kind = device.info.as_ref().map_or("", |i| i.kind.as_str());
    let production = device
        .residents
        .iter()
        .find(|r| r.reservation.task_id == breach.task_id)?;
    let mut best: Option<(&Resident, f64)> = None;
    for candidate in &device.residents {
        let id = candidate.reservation.task_id.as_str();
        if id == breach.task_id
            || candidate.spec().is_production()
            || !breach.opportunistic_task_ids.iter().any(|t| t == id)
        {
            continue;
        }
        let b = blame_among(model, kind, production, &device.residents, id);
        let better = match best {
            None => true,
            Some((r, best_blame)) => b
                .total_cmp(&best_blame)
                .then_with(|| solo_pressure(candidate).total_cmp(&solo_pressure(r)))
                .then_with(|| r.reservation.task_id.cmp(&candidate.reservation.task_id))
                .is_gt(),
        };
        if better {
            best = Some((candidate, b));
        }
    }
    let (victim, blame) = best?;
    let task_id = victim.reservation.task_id.clone();
    let reason = format!(
        "production job {} on {} measured PD {:.3} above its cap {:.2} for {} rounds with \
         the opportunistic co-runners at their smallest sizes; {} is blamed most (its \
         leaving is predicted to lower that job's slowdown by {:.3})",
        breach.task_id,
        device_id,
        breach.measured_pd,
        breach.max_slowdown,
        breach.rounds_above,
        task_id,
        blame,
    );
    Some(Victim {
        task_id,
        blame,
        reason,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use iadeep_predictor::{Prediction, PredictionSource};
    use iadeep_proto::{
        DeviceInfo, DeviceResidents, PriorityClass, Reservation, SoloProfile, TaskSpec,
    };

    use super::*;

    /// A model whose co-runners each add a fixed slowdown, keyed by model name: what an
    /// online model's per-job effects come to once it has measured the jobs.
    #[derive(Debug)]
    struct Additive;

    fn pressure(model: &str) -> f64 {
        match model {
            "heavy" => 0.30,
            "medium" => 0.10,
            "light" => 0.02,
            _ => 0.10,
        }
    }

    impl SlowdownModel for Additive {
        fn predict(&self, _: &str, _: &TaskProfile, corunners: &[TaskProfile]) -> Prediction {
            let extra: f64 = corunners.iter().map(|p| pressure(&p.model)).sum();
            Prediction::certain(1.0 + extra, PredictionSource::Given)
        }
    }

    fn spec(id: &str, model: &str, production: bool, sm: f64) -> TaskSpec {
        TaskSpec {
            task_id: id.into(),
            model: model.into(),
            initial_batch_size: 32,
            priority_class: if production {
                PriorityClass::Production as i32
            } else {
                PriorityClass::Opportunistic as i32
            },
            profile: Some(SoloProfile {
                batch_size: 32,
                sm_util_pct: Some(sm),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn view_of(specs: Vec<TaskSpec>) -> ClusterView {
        let mut view = ClusterView::new(Arc::new(crate::model::ModelledMemory));
        view.upsert_device(DeviceInfo {
            device_id: "d0".into(),
            memory_mib: 32_000,
            kind: "v100".into(),
            ..Default::default()
        });
        let reservations = specs
            .into_iter()
            .map(|s| Reservation {
                task_id: s.task_id.clone(),
                reserved_mem_mib: 1_000,
                spec: Some(s),
                ..Default::default()
            })
            .collect();
        let record = DeviceResidents {
            device_id: "d0".into(),
            reservations,
            ..Default::default()
        };
        view.apply_residents("d0", Some(record), 1);
        view
    }

    fn breach(candidates: &[&str]) -> CapBreach {
        CapBreach {
            device_id: "d0".into(),
            task_id: "prod".into(),
            measured_pd: 1.4,
            max_slowdown: 1.1,
            rounds_above: 3,
            opportunistic_task_ids: candidates.iter().map(|&c| c.to_owned()).collect(),
            ..Default::default()
        }
    }

    /// The co-runner whose leaving helps the production job most goes, whatever its
    /// place in the record or the breach's list.
    #[test]
    fn the_most_blamed_co_runner_is_the_victim() {
        let view = view_of(vec![
            spec("prod", "resnet", true, 50.0),
            spec("a", "light", false, 90.0),
            spec("b", "heavy", false, 10.0),
            spec("c", "medium", false, 50.0),
        ]);
        let victim =
            choose_victim(&view, "d0", &breach(&["a", "b", "c"]), &Additive).expect("a victim");
        assert_eq!(victim.task_id, "b");
        assert!((victim.blame - 0.30).abs() < 1e-9, "{victim:?}");
        assert!(victim.reason.contains("prod"), "{}", victim.reason);
        assert!(victim.reason.contains("1.400"), "{}", victim.reason);
        let c = blame(&view, "d0", "prod", "c", &Additive).expect("both resident");
        assert!((c - 0.10).abs() < 1e-9, "{c}");
        // Only the listed co-runners are candidates.
        let victim = choose_victim(&view, "d0", &breach(&["a", "c"]), &Additive);
        assert_eq!(victim.map(|v| v.task_id).as_deref(), Some("c"));
    }

    /// Co-runners the model blames alike: the one that takes more of the card alone,
    /// then the smaller id.
    #[test]
    fn ties_go_to_the_heavier_profile_then_the_smaller_id() {
        let view = view_of(vec![
            spec("prod", "resnet", true, 50.0),
            spec("y", "medium", false, 60.0),
            spec("x", "medium", false, 60.0),
            spec("w", "medium", false, 40.0),
        ]);
        let victim = choose_victim(&view, "d0", &breach(&["x", "y", "w"]), &Additive);
        assert_eq!(victim.map(|v| v.task_id).as_deref(), Some("x"));
    }

    /// A breach whose co-runners left, or whose production job left, evicts nobody;
    /// a production co-runner is never a candidate, even when a breach lists it.
    #[test]
    fn a_stale_breach_or_a_production_co_runner_gives_no_victim() {
        let view = view_of(vec![
            spec("prod", "resnet", true, 50.0),
            spec("other-prod", "heavy", true, 50.0),
        ]);
        assert_eq!(
            choose_victim(&view, "d0", &breach(&["gone", "other-prod"]), &Additive),
            None
        );
        let mut gone = breach(&["other-prod"]);
        gone.task_id = "left".into();
        assert_eq!(choose_victim(&view, "d0", &gone, &Additive), None);
        assert_eq!(choose_victim(&view, "d9", &breach(&["a"]), &Additive), None);
    }
}
