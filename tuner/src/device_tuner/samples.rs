//! Co-location samples for the predictor from one measured round.
//!
//! IF = co-located step time ÷ solo step time *at the same batch size*. A round yields one
//! sample per task, and only when every task's solo step time at its measured size is known:
//! measured alone (a solo profile on this device kind, or a round the task ran alone here),
//! or interpolated between two sizes measured alone. The co-runners' solo times are features
//! of each sample, so they are needed too. Extrapolations are not learned: on the simulator's
//! tuning seeds they biased the learned slowdowns (a step at half the batch is rarely half as
//! long), and guessed labels are worse than fewer samples.

use iadeep_proto::{CoLocationSample, TaskProfile, TaskSpec};

use super::knowledge::{SoloSource, TaskKnowledge, profile_is_local};

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
/// is known well enough to learn from.
fn profile(t: &Measured<'_>, device_kind: &str) -> Option<TaskProfile> {
    let solo = t
        .knowledge
        .solo_estimate(t.batch_size)
        .filter(|e| LEARNED_SOLO_SOURCES.contains(&e.source))?;
    let p =
        t.spec.profile.as_ref().filter(|p| {
            p.batch_size == t.batch_size && profile_is_local(&p.device_kind, device_kind)
        });
    Some(TaskProfile {
        model: t.spec.model.clone(),
        batch_size: t.batch_size,
        solo_step_time_s: solo.step_s,
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
    let Some(profiles) = tasks
        .iter()
        .map(|t| profile(t, device_kind))
        .collect::<Option<Vec<TaskProfile>>>()
    else {
        return Vec::new();
    };
    tasks
        .iter()
        .zip(&profiles)
        .enumerate()
        .map(|(i, (t, p))| CoLocationSample {
            device_kind: device_kind.to_owned(),
            task: Some(p.clone()),
            corunners: profiles
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, p)| p.clone())
                .collect(),
            slowdown: t.step_time_s / p.solo_step_time_s,
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
