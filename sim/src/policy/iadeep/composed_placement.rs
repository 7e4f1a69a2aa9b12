//! iadeep's placement decision, composed here from the predictor and the tuner's
//! memory model because the placer crate's decision function (`iadeep_placer`) had
//! not landed when the simulator was written. It follows DESIGN.md's placer rules:
//!
//! - candidates: an idle GPU always; a shared GPU when the residents' reported peak
//!   memory plus the new task's conservative memory at its starting batch size fit
//!   the card with a 5 % margin, and it has fewer than [`MAX_RESIDENTS`] residents;
//! - score (with the predictor): the extra time the placement adds, summed over the
//!   new task and the residents, from predicted slowdowns:
//!   `D_new·(IF_new − 1) + Σ_k R_k·(IF_k,after / IF_k,now − 1)` (D = solo duration,
//!   R = remaining time at the current speed); an idle GPU scores 0;
//! - queue or place: place on the best candidate when its score is below the expected
//!   wait for a GPU to free up (the soonest time any device's residents all finish);
//!   otherwise wait;
//! - without the predictor (ablation): an idle GPU, else the memory-feasible GPU with
//!   the fewest residents and most free memory, never waiting while one fits.

use iadeep_proto::TaskProfile;

use crate::policy::Decision;
use crate::policy::iadeep::knowledge::Knowledge;
use crate::policy::iadeep::predictor::SimPredictor;
use crate::view::{ClusterView, Resident, Waiting};

/// Most tasks iadeep puts on one GPU (keeps the tuner's lattice small).
pub const MAX_RESIDENTS: usize = 3;
/// Fraction of the card kept free.
pub const MEMORY_MARGIN: f64 = 0.05;

/// Seconds until a resident finishes at its current reported speed.
fn remaining_s(r: &Resident<'_>) -> f64 {
    if !r.report.running || r.report.samples_per_s <= 0.0 {
        return r.spec.total_samples * r.spec.solo_step_time_s / f64::from(r.spec.m0);
    }
    (r.spec.total_samples - r.report.samples_done).max(0.0) / r.report.samples_per_s
}

/// Memory the residents use now (reported), MiB.
fn used_mib(residents: &[Resident<'_>], knowledge: &Knowledge) -> f64 {
    residents
        .iter()
        .map(|r| {
            if r.report.running {
                r.report.peak_mem_mib as f64
            } else {
                knowledge
                    .memory_upper_mib(r.spec.id, r.report.batch_size)
                    .unwrap_or(r.spec.solo_peak_mem_mib as f64)
            }
        })
        .sum()
}

/// The placement decision.
pub fn decide(
    view: &dyn ClusterView,
    task: Waiting<'_>,
    knowledge: &Knowledge,
    predictor: Option<&SimPredictor>,
) -> Decision {
    let place = |device| Decision::Place {
        device,
        batch_size: task.batch_size,
    };
    if let Some(device) = (0..view.devices()).find(|d| view.resident_count(*d) == 0) {
        return place(device);
    }
    let budget = view.capacity_mib() as f64 * (1.0 - MEMORY_MARGIN);
    let new_mib = knowledge
        .memory_upper_mib(task.spec.id, task.batch_size)
        .unwrap_or(task.spec.solo_peak_mem_mib as f64);
    let kind = view.device_kind().to_owned();
    let new_profile = knowledge.profile(task.spec, task.batch_size);
    let solo_duration =
        task.spec.total_samples * task.spec.solo_step_time_s / f64::from(task.spec.m0);
    let mut best: Option<(f64, usize)> = None;
    let mut soonest_free = f64::INFINITY;
    for device in 0..view.devices() {
        let residents = view.residents(device);
        let frees_in = residents.iter().map(remaining_s).fold(0.0, f64::max);
        soonest_free = soonest_free.min(frees_in);
        if residents.len() >= MAX_RESIDENTS || used_mib(&residents, knowledge) + new_mib > budget {
            continue;
        }
        let score = match predictor {
            Some(predictor) => {
                let profiles: Vec<TaskProfile> = residents
                    .iter()
                    .map(|r| knowledge.profile(r.spec, r.report.batch_size))
                    .collect();
                let if_new = predictor
                    .predict(&kind, &new_profile, &profiles)
                    .slowdown
                    .max(1.0);
                let mut extra = solo_duration * (if_new - 1.0);
                for (index, r) in residents.iter().enumerate() {
                    let mut others: Vec<TaskProfile> = profiles
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| *i != index)
                        .map(|(_, p)| p.clone())
                        .collect();
                    let now = predictor
                        .predict(&kind, &profiles[index], &others)
                        .slowdown
                        .max(1e-3);
                    others.push(new_profile.clone());
                    let after = predictor.predict(&kind, &profiles[index], &others).slowdown;
                    extra += remaining_s(r) * (after / now - 1.0).max(0.0);
                }
                extra
            }
            // Fewest residents, then most free memory.
            None => residents.len() as f64 * 1e9 + used_mib(&residents, knowledge),
        };
        if best.is_none_or(|(b, _)| score < b) {
            best = Some((score, device));
        }
    }
    match (best, predictor) {
        (Some((_, device)), None) => place(device),
        (Some((extra, device)), Some(_)) if extra < soonest_free => place(device),
        _ => Decision::Queue,
    }
}
