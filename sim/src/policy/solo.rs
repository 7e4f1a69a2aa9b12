//! What the baselines know of a job's memory and of its speed alone, from the same
//! information every policy gets: the job's solo profile at m0 when it brings one
//! ([`crate::view::JobInfo::Profiled`]), else only what its agent reported.

use std::collections::BTreeMap;

use crate::view::{JobSpec, PolicyView, ResidentJob};

/// A baseline places a job whose memory it does not know (no profile) only on a GPU
/// whose residents all reported their peaks and leave at least this share of the card
/// free: the share the placer asks of a shared card for such a job
/// (`iadeep_placer::PlacerParams::min_unknown_memory_share`, read from the placer's
/// defaults so the two cannot drift), so no baseline packs an unknown job more eagerly
/// than iadeep may.
pub fn unknown_memory_free_share() -> f64 {
    iadeep_placer::PlacerParams::default().min_unknown_memory_share
}

/// A resident's memory as its agent last reported it, MiB; `None` before its first
/// report (nothing measured yet).
pub fn reported_peak_mib(r: &ResidentJob<'_>) -> Option<u64> {
    (r.report.seq > 0).then_some(r.report.peak_mem_mib)
}

/// The memory the baselines count a resident at: its reported peak while it runs, its
/// profiled peak at m0 before that when it has a profile, else its last reported peak;
/// `None` when nothing is known.
pub fn resident_mib(r: &ResidentJob<'_>) -> Option<u64> {
    if r.report.running {
        return Some(r.report.peak_mem_mib);
    }
    match r.spec.profile {
        Some(p) => Some(p.peak_mem_mib),
        None => reported_peak_mib(r),
    }
}

/// Whether a job whose memory is unknown may join residents using `used_mib` of a card
/// of `capacity_mib` (see [`unknown_memory_free_share`]).
pub fn room_for_unknown(used_mib: u64, capacity_mib: u64) -> bool {
    capacity_mib.saturating_sub(used_mib) as f64
        >= unknown_memory_free_share() * capacity_mib as f64
}

/// Step times measured alone: for each task and batch size, the fastest step time its
/// agent reported while the task was alone on its GPU (the fastest, so that a straggler
/// window does not count; as `pollux` keeps its own sweep's).
#[derive(Debug, Default)]
pub struct SoloTimes {
    measured: BTreeMap<(usize, u32), f64>,
}

impl SoloTimes {
    /// Looks at every GPU with one running task and records its reported step time.
    pub fn observe(&mut self, view: &dyn PolicyView) {
        for device in 0..view.devices() {
            if view.resident_count(device) != 1 {
                continue;
            }
            for r in view.residents(device) {
                let step_s = r.report.step_time_s;
                let measured = step_s.is_finite() && step_s > 0.0;
                if !r.report.running || !measured {
                    continue;
                }
                let fastest = self
                    .measured
                    .entry((r.spec.id, r.report.batch_size))
                    .or_insert(f64::INFINITY);
                *fastest = fastest.min(step_s);
            }
        }
    }

    /// Seconds per step of a task alone at `batch_size`: its profile's at m0 when it has
    /// one, else the fastest its agent reported alone; `None` when neither exists.
    pub fn step_s(&self, spec: &JobSpec, batch_size: u32) -> Option<f64> {
        if batch_size == spec.m0
            && let Some(profile) = spec.profile
        {
            return Some(profile.step_time_s);
        }
        self.measured.get(&(spec.id, batch_size)).copied()
    }

    /// A resident's share of its GPU: its reported speed over its speed alone at the same
    /// batch size (with a profile, over its profiled speed at m0, as under
    /// `--job-info profiled`); 1 while it has not run, or when its speed alone is unknown
    /// (a job that never ran alone counts as using the whole GPU).
    pub fn share(&self, r: &ResidentJob<'_>) -> f64 {
        if !r.report.running || r.report.samples_per_s <= 0.0 {
            return 1.0;
        }
        let alone_samples_per_s = match r.spec.profile {
            Some(p) => f64::from(r.spec.m0) / p.step_time_s,
            None => match self.step_s(r.spec, r.report.batch_size) {
                Some(step_s) => f64::from(r.report.batch_size) / step_s,
                None => return 1.0,
            },
        };
        (r.report.samples_per_s / alone_samples_per_s).clamp(0.0, 1.0)
    }

    /// Forgets a finished task.
    pub fn forget(&mut self, task: usize) {
        self.measured.retain(|(t, _), _| *t != task);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::{JobReport, SoloProfile};

    fn spec(profile: Option<SoloProfile>) -> JobSpec {
        JobSpec {
            id: 3,
            model: "ResNet-18".into(),
            m0: 64,
            batch_sizes: vec![32, 64, 128],
            profile,
            submit_s: 0.0,
            total_samples: 1e6,
            max_slowdown: None,
        }
    }

    fn report(batch_size: u32, step_time_s: f64, seq: u64) -> JobReport {
        JobReport {
            batch_size,
            step_time_s,
            samples_per_s: f64::from(batch_size) / step_time_s,
            peak_mem_mib: 2_000,
            grad_noise_scale: None,
            samples_done: 0.0,
            oom_batch_size: None,
            seq,
            running: seq > 0,
        }
    }

    /// Without a profile a share comes from the speed the task's agent reported alone at
    /// the same batch size; never measured alone, the task counts as a whole GPU. With a
    /// profile, the profiled speed at m0 is the reference, as before.
    #[test]
    fn shares_come_from_speeds_measured_alone_unless_a_profile_is_given() {
        let unprofiled = spec(None);
        let mut solo = SoloTimes::default();
        solo.measured.insert((3, 64), 0.1);
        let shared = report(64, 0.2, 5);
        let me = ResidentJob {
            spec: &unprofiled,
            report: &shared,
        };
        assert!((solo.share(&me) - 0.5).abs() < 1e-12);
        let unmeasured = report(32, 0.2, 5);
        let me = ResidentJob {
            spec: &unprofiled,
            report: &unmeasured,
        };
        assert_eq!(solo.share(&me), 1.0);
        assert_eq!(solo.step_s(&unprofiled, 32), None);
        let profiled = spec(Some(SoloProfile {
            step_time_s: 0.05,
            peak_mem_mib: 1_500,
        }));
        let me = ResidentJob {
            spec: &profiled,
            report: &shared,
        };
        assert!((solo.share(&me) - 0.25).abs() < 1e-12);
        assert_eq!(solo.step_s(&profiled, 64), Some(0.05));
        // Memory: a resident that has not reported counts at its profile, else unknown.
        let fresh = report(64, 0.2, 0);
        let me = ResidentJob {
            spec: &profiled,
            report: &fresh,
        };
        assert_eq!(resident_mib(&me), Some(1_500));
        let me = ResidentJob {
            spec: &unprofiled,
            report: &fresh,
        };
        assert_eq!(resident_mib(&me), None);
        assert!(room_for_unknown(7_500, 10_000));
        assert!(!room_for_unknown(7_501, 10_000));
        solo.forget(3);
        assert_eq!(solo.step_s(&unprofiled, 64), None);
    }
}
