//! Co-location samples for the predictor from one measured round.
//!
//! IF = co-located step time ÷ solo step time *at the same batch size*. A round yields one
//! sample per task whose solo step time at its measured size is known: measured alone (a
//! solo profile on this device kind, or a round the task ran alone here), or interpolated
//! between two sizes measured alone. Extrapolations are not learned: on the simulator's
//! tuning seeds they biased the learned slowdowns (a step at half the batch is rarely half as
//! long), and guessed labels are worse than fewer samples.
//!
//! The co-runners' solo times are features of each sample, so they are needed too; a
//! co-runner that never ran alone may stand there with its *estimated* solo time (its
//! co-located time over the placer's predicted slowdown). That estimate is never a label:
//! a label divided by a predicted slowdown would teach the predictor its own prediction.
//! As a feature it only describes how heavy the co-runner is. Without it, a cluster whose
//! jobs mostly start next to others (no job brings a profile) would teach the predictor
//! almost nothing.

use iadeep_proto::{CoLocationSample, TaskProfile, TaskSpec};

use super::knowledge::{SoloSource, TaskKnowledge, estimate_solo_step, profile_is_local};

/// How a sample's solo step times may have been obtained to be learned.
pub const LEARNED_SOLO_SOURCES: [SoloSource; 2] = [SoloSource::Measured, SoloSource::Interpolated];

/// One task of a measured round.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Measured<'a> {
    pub task_id: &'a str,
    pub spec: &'a TaskSpec,
    pub knowledge: &'a TaskKnowledge,
    pub batch_size: u32,
    /// Robust co-located step time of the round.
    pub step_time_s: f64,
    /// The peak memory the task reported at this size, if any.
    pub peak_mem_mib: Option<u64>,
}

/// The task as a predictor feature vector at its measured size, if its solo step time there
/// is known well enough to learn from (`as_label`), or, as a co-runner's features, at
/// least estimated (see the module documentation).
fn profile(t: &Measured<'_>, device_kind: &str, as_label: bool) -> Option<TaskProfile> {
    let learned = t
        .knowledge
        .solo_estimate(t.batch_size)
        .filter(|e| LEARNED_SOLO_SOURCES.contains(&e.source))
        .map(|e| e.step_s);
    let solo_step_s = match learned {
        Some(s) => s,
        None if !as_label => estimate_solo_step(&t.knowledge.solo_estimated, t.batch_size)?.step_s,
        None => return None,
    };
    let p =
        t.spec.profile.as_ref().filter(|p| {
            p.batch_size == t.batch_size && profile_is_local(&p.device_kind, device_kind)
        });
    Some(TaskProfile {
        model: t.spec.model.clone(),
        batch_size: t.batch_size,
        solo_step_time_s: solo_step_s,
        sm_util_pct: p.and_then(|p| p.sm_util_pct),
        mem_bw_util_pct: p.and_then(|p| p.mem_bw_util_pct),
        gpu_mem_mib: t.peak_mem_mib,
    })
}

/// One sample per task of a round with two or more tasks, or none (see the module docs).
pub(crate) fn from_round(
    device_id: &str,
    device_kind: &str,
    round: u64,
    now_unix_ms: i64,
    tasks: &[Measured<'_>],
) -> Vec<CoLocationSample> {
    if tasks.len() < 2 {
        return Vec::new();
    }
    let Some(features) = tasks
        .iter()
        .map(|t| profile(t, device_kind, false))
        .collect::<Option<Vec<TaskProfile>>>()
    else {
        return Vec::new();
    };
    tasks
        .iter()
        .enumerate()
        .filter_map(|(i, t)| Some((i, t, profile(t, device_kind, true)?)))
        .map(|(i, t, p)| CoLocationSample {
            device_kind: device_kind.to_owned(),
            slowdown: t.step_time_s / p.solo_step_time_s,
            task: Some(p),
            corunners: features
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, p)| p.clone())
                .collect(),
            measured_at_unix_ms: now_unix_ms,
            device_id: device_id.to_owned(),
            task_id: t.task_id.to_owned(),
            corunner_task_ids: tasks
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, o)| o.task_id.to_owned())
                .collect(),
            round,
        })
        .collect()
}
