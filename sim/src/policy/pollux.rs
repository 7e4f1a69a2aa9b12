//! `pollux`: the strongest single-job adaptive alternative to sharing GPUs. Every job
//! gets a GPU of its own (first idle GPU, as exclusive FIFO) and runs at its
//! goodput-optimal batch size, re-chosen as its statistics change, as Pollux's agents do:
//!
//! 1. each allowed batch size runs for one reporting interval, which measures its step
//!    time alone (the throughput side of goodput);
//! 2. then, every tuning interval, the job runs the size with the lowest PD alone
//!    (the tuner's objective, `iadeep_objective::PdInput`, with IF = 1) under the φ its
//!    agent reports now, from the step times measured at each size (the fastest seen,
//!    so a straggler window does not count against a size) and its step time alone at
//!    m0: its solo profile's when jobs bring one (`--job-info profiled`), else the one
//!    it measured at m0 in its own sweep (it runs alone).
//!    No further trial runs are needed: alone, a size's step time does not change, only
//!    its statistical efficiency does, as φ grows over training.
//!
//! A size is changed only for a predicted PD at least [`MIN_GAIN`] lower, so the
//! estimate's noise does not make the job flap between two equally good sizes.
//! Unlike iadeep it never shares a GPU, so it never runs out of memory (a job alone fits
//! the card).

use std::collections::BTreeMap;

use iadeep_objective::PdInput;

use crate::policy::batch_search::{BatchSearch, pd_alone_or_shared};
use crate::policy::{Assignment, PlaceOrQueue, Policy, TuneStep};
use crate::view::{PolicyView, ResidentJob, Waiting};

/// Relative PD gain a change of batch size must promise (the iadeep tuner's hysteresis,
/// `ControllerParams::hysteresis`).
pub const MIN_GAIN: f64 = 0.05;

/// One job on its own GPU.
#[derive(Debug)]
struct Job {
    task: usize,
    /// The first sweep over the allowed sizes, while it runs.
    sweep: Option<BatchSearch>,
    /// Fastest step time measured alone at each size.
    step_s: BTreeMap<u32, f64>,
}

impl Job {
    /// The job's step time alone at m0: its profile's, else the fastest it measured.
    fn solo_step_s_m0(&self, me: &ResidentJob<'_>) -> Option<f64> {
        match me.spec.profile {
            Some(profile) => Some(profile.step_time_s),
            None => self.step_s.get(&me.spec.m0).copied(),
        }
    }

    /// PD alone at `batch_size` with noise scale `phi`, from the measured step time.
    fn pd_at(&self, me: &ResidentJob<'_>, batch_size: u32, phi: Option<f64>) -> Option<f64> {
        let step_s = *self.step_s.get(&batch_size)?;
        PdInput {
            m0: f64::from(me.spec.m0),
            solo_step_s_m0: self.solo_step_s_m0(me)?,
            m: f64::from(batch_size),
            co_step_s: step_s,
            noise_scale: phi,
        }
        .pd()
        .ok()
        .filter(|pd| pd.is_finite())
    }

    /// The size to run now: the measured size of lowest PD under the current φ, if it
    /// beats the current size by [`MIN_GAIN`].
    fn best_now(&self, me: &ResidentJob<'_>) -> Option<u32> {
        let phi = me.report.grad_noise_scale;
        let current = me.report.batch_size;
        let (best, best_pd) = self
            .step_s
            .keys()
            .filter_map(|&b| self.pd_at(me, b, phi).map(|pd| (b, pd)))
            .min_by(|a, b| a.1.total_cmp(&b.1))?;
        let current_pd = self.pd_at(me, current, phi).unwrap_or(f64::INFINITY);
        (best != current && best_pd < current_pd * (1.0 - MIN_GAIN)).then_some(best)
    }
}

/// Exclusive GPUs, goodput-optimal batch sizes.
#[derive(Debug, Default)]
pub struct Pollux {
    /// The job on each device.
    jobs: BTreeMap<usize, Job>,
}

impl Policy for Pollux {
    fn name(&self) -> &str {
        "pollux"
    }

    fn place(&mut self, view: &dyn PolicyView, task: Waiting<'_>) -> PlaceOrQueue {
        let Some(device) = (0..view.devices()).find(|d| view.resident_count(*d) == 0) else {
            return PlaceOrQueue::Queue;
        };
        if task.spec.batch_sizes.len() > 1 {
            self.jobs.insert(
                device,
                Job {
                    task: task.spec.id,
                    sweep: Some(BatchSearch::new(
                        task.spec.id,
                        task.spec.batch_sizes.clone(),
                    )),
                    step_s: BTreeMap::new(),
                },
            );
        }
        PlaceOrQueue::place(device, task.batch_size)
    }

    fn tunes(&self) -> bool {
        true
    }

    fn tune(&mut self, view: &dyn PolicyView, device: usize) -> TuneStep {
        let Some(job) = self.jobs.get_mut(&device) else {
            return TuneStep::Done;
        };
        let residents = view.residents(device);
        let Some(me) = residents.iter().find(|r| r.spec.id == job.task) else {
            self.jobs.remove(&device);
            return TuneStep::Done;
        };
        let ran = me.report.running.then_some(me.report.batch_size);
        if let Some(size) = ran
            && me.report.step_time_s.is_finite()
            && me.report.step_time_s > 0.0
        {
            let fastest = job.step_s.entry(size).or_insert(f64::INFINITY);
            *fastest = fastest.min(me.report.step_time_s);
        }
        let solo_step_s = job.solo_step_s_m0(me).unwrap_or(f64::NAN);
        if let Some(sweep) = &mut job.sweep {
            let scored = ran.map(|size| (size, pd_alone_or_shared(me, solo_step_s)));
            let (step, over) = sweep.tune_step(scored, me.report.batch_size);
            if over {
                job.sweep = None;
            }
            // A sweep that ends by moving to its best size applies it first.
            if !over || matches!(step, TuneStep::Apply { .. }) {
                return step;
            }
        }
        match job.best_now(me) {
            Some(size) if ran.is_some() => TuneStep::Apply {
                assignments: vec![Assignment::new(job.task, size)],
                again_in_s: None,
            },
            _ => TuneStep::Wait { again_in_s: None },
        }
    }

    fn on_finish(&mut self, device: usize, task: usize) {
        if self.jobs.get(&device).is_some_and(|j| j.task == task) {
            self.jobs.remove(&device);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::{JobReport, JobSpec, SoloProfile};

    fn spec() -> JobSpec {
        JobSpec {
            id: 1,
            model: "Recommendation".into(),
            m0: 4096,
            batch_sizes: vec![512, 1024, 2048, 4096],
            profile: Some(SoloProfile {
                step_time_s: 0.4,
                peak_mem_mib: 2000,
            }),
            submit_s: 0.0,
            total_samples: 1e9,
            max_slowdown: None,
        }
    }

    fn report(batch_size: u32, phi: f64) -> JobReport {
        JobReport {
            batch_size,
            step_time_s: 0.1,
            samples_per_s: f64::from(batch_size) / 0.1,
            peak_mem_mib: 1000,
            grad_noise_scale: Some(phi),
            samples_done: 0.0,
            oom_batch_size: None,
            seq: 1,
            running: true,
        }
    }

    /// Step times alone of the sizes tried: larger batches use the GPU better.
    fn job() -> Job {
        Job {
            task: 1,
            sweep: None,
            step_s: [(512, 0.1), (1024, 0.15), (2048, 0.25), (4096, 0.4)]
                .into_iter()
                .collect(),
        }
    }

    /// Early in training (small φ) a small batch is worth more per sample than its lost
    /// throughput; later (large φ) it is not, and the job moves to a larger size, with
    /// no new trial run.
    #[test]
    fn the_goodput_optimal_size_follows_the_noise_scale() {
        let spec = spec();
        let job = job();
        let early = report(4096, 10.0);
        let me = ResidentJob {
            spec: &spec,
            report: &early,
        };
        assert_eq!(job.best_now(&me), Some(512));
        let late = report(512, 1e6);
        let me = ResidentJob {
            spec: &spec,
            report: &late,
        };
        assert_eq!(job.best_now(&me), Some(4096));
        // Where it already runs the best size, or a size within the gain it asks for,
        // nothing changes.
        let settled = report(4096, 1e6);
        let me = ResidentJob {
            spec: &spec,
            report: &settled,
        };
        assert_eq!(job.best_now(&me), None);
    }

    /// Without a profile the step time alone at m0 is the one the job's sweep measured
    /// there (0.4 s, as the profile said): the same choices. Before m0 ran, no size can
    /// be scored and nothing changes.
    #[test]
    fn without_a_profile_the_sweeps_own_m0_measurement_is_the_reference() {
        let spec = JobSpec {
            profile: None,
            ..spec()
        };
        let job = job();
        for (phi, current, best) in [(10.0, 4096, Some(512)), (1e6, 512, Some(4096))] {
            let now = report(current, phi);
            let me = ResidentJob {
                spec: &spec,
                report: &now,
            };
            assert_eq!(job.best_now(&me), best, "phi {phi}");
        }
        let mut unmeasured = job;
        unmeasured.step_s.remove(&4096);
        let early = report(1024, 10.0);
        let me = ResidentJob {
            spec: &spec,
            report: &early,
        };
        assert_eq!(unmeasured.solo_step_s_m0(&me), None);
        assert_eq!(unmeasured.best_now(&me), None);
    }
}
