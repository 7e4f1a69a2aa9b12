//! The arrival stream: single-GPU jobs of the Philly trace, each given a measured
//! job type.
//!
//! Arrival times and durations are those of consecutive single-GPU Philly jobs (sorted
//! by submit time, starting at a seed-chosen position), with inter-arrival gaps divided
//! by the load factor. A job's duration becomes its *work*: the number of samples it
//! would process in that time alone on the GPU at its submitted batch size, so it ends
//! exactly after its Philly duration when it has a GPU to itself, and later when it
//! shares one. Jobs shorter than a minute (mostly failed launches) are skipped, and
//! durations are capped (default one day) so that a handful of multi-week jobs do not
//! make the makespan a property of the trace rather than of the scheduler.
//!
//! Philly does not say which model a job trained, so each job draws a job type
//! uniformly from the measured ones (seeded). Its memory request, the number a user
//! writes in a job file, is the job's true peak memory at its batch size times a
//! seeded factor in [0.8, 1.25], rounded up to a whole GiB (at most the card): users ask roughly,
//! some too little.
//!
//! **Classes.** Each job is *production* with probability
//! [`WorkloadParams::production_fraction`] (TGS's job stream is half and half), with the
//! slowdown cap [`WorkloadParams::max_slowdown`], and *opportunistic* otherwise. The draws
//! come from their own stream of the experiment's seed, one per job whatever the fraction,
//! so the jobs themselves (window, types, requests) are the same at every fraction and the
//! default fraction 0 leaves the stream exactly as it was before classes existed.

use iadeep_datasets::philly::PhillyJob;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Result, SimError};
use crate::world::{TypeId, World};

/// Parameters of the arrival stream.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadParams {
    pub tasks: usize,
    /// Arrival-rate multiplier: 2.0 halves every gap between arrivals.
    pub load: f64,
    pub seed: u64,
    /// Jobs shorter than this are skipped, seconds.
    pub min_duration_s: f64,
    /// Durations are capped at this, seconds.
    pub max_duration_s: f64,
    /// Probability that a job is production (see the module docs); 0 (the default) makes
    /// every job opportunistic, as every job was before classes existed.
    pub production_fraction: f64,
    /// The slowdown cap (most PD) of every production job.
    pub max_slowdown: f64,
}

impl Default for WorkloadParams {
    fn default() -> Self {
        WorkloadParams {
            tasks: 300,
            load: 1.0,
            seed: 1,
            min_duration_s: 60.0,
            max_duration_s: 86_400.0,
            production_fraction: 0.0,
            max_slowdown: iadeep_proto::DEFAULT_MAX_SLOWDOWN,
        }
    }
}

impl WorkloadParams {
    /// Checks the parameters, naming the first bad one.
    pub fn check(&self) -> Result<()> {
        let bad = |field, reason: String| Err(SimError::InvalidParam { field, reason });
        if self.tasks == 0 {
            return bad("tasks", "must be at least 1".into());
        }
        if !(self.load.is_finite() && self.load > 0.0) {
            return bad("load", format!("{} is not a positive number", self.load));
        }
        if !(self.min_duration_s >= 0.0 && self.max_duration_s > self.min_duration_s) {
            return bad(
                "duration bounds",
                format!(
                    "[{}, {}] is empty",
                    self.min_duration_s, self.max_duration_s
                ),
            );
        }
        if !(0.0..=1.0).contains(&self.production_fraction) {
            return bad(
                "production fraction",
                format!("{} is not in [0, 1]", self.production_fraction),
            );
        }
        // The caps every entry point accepts (`iadeep run --max-slowdown`, the placer).
        if let Err((_, reason)) = iadeep_proto::check_priority(
            iadeep_proto::PriorityClass::Production as i32,
            Some(self.max_slowdown),
        ) {
            return bad("max slowdown", reason);
        }
        Ok(())
    }
}

/// Salt of the class draws' stream (see the module docs).
const CLASS_SALT: u64 = 0x0c1a_55e5;

/// One submitted job.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskTemplate {
    pub id: usize,
    /// Submit time, seconds from the start of the simulation.
    pub submit_s: f64,
    pub family: usize,
    /// The submitted batch size m0.
    pub m0: u32,
    /// Job type at m0.
    pub job: TypeId,
    /// Work in samples at m0 (duration alone × samples per second alone at m0).
    pub work_samples: f64,
    /// Seconds the job would take alone at m0 (its capped Philly duration).
    pub solo_duration_s: f64,
    /// What the user asked for, MiB (whole GiB).
    pub mem_request_mib: u64,
    /// The slowdown cap of a production job; `None` for an opportunistic one.
    pub max_slowdown: Option<f64>,
}

/// Builds the arrival stream from Philly jobs.
pub fn build(
    world: &World,
    philly: &[PhillyJob],
    params: &WorkloadParams,
) -> Result<Vec<TaskTemplate>> {
    params.check()?;
    let mut jobs: Vec<&PhillyJob> = philly
        .iter()
        .filter(|j| j.num_gpus == 1 && j.duration_s >= params.min_duration_s)
        .collect();
    if jobs.len() < params.tasks {
        return Err(SimError::InvalidParam {
            field: "tasks",
            reason: format!(
                "the trace has only {} single-GPU jobs of at least {} s",
                jobs.len(),
                params.min_duration_s
            ),
        });
    }
    jobs.sort_by_key(|j| j.submit_unix_s);
    let mut rng = ChaCha8Rng::seed_from_u64(params.seed);
    let start = rng.random_range(0..=jobs.len() - params.tasks);
    let window = &jobs[start..start + params.tasks];
    let first = window[0].submit_unix_s;
    let catalogue = &world.catalogue;
    let span_s = (window[window.len() - 1].submit_unix_s - first) as f64 / params.load;
    let gpu_seconds: f64 = window
        .iter()
        .map(|j| j.duration_s.min(params.max_duration_s))
        .sum();
    tracing::info!(
        tasks = params.tasks,
        first_trace_row = start,
        arrival_span_h = format!("{:.1}", span_s / 3600.0),
        solo_gpu_hours = format!("{:.1}", gpu_seconds / 3600.0),
        "built the arrival stream from the Philly trace"
    );
    let mut classes = ChaCha8Rng::seed_from_u64(params.seed ^ CLASS_SALT);
    window
        .iter()
        .enumerate()
        .map(|(id, job)| {
            // One draw per job at every fraction (see the module docs).
            let production = classes.random_bool(params.production_fraction);
            let t = rng.random_range(0..catalogue.len());
            let info = &catalogue.types[t];
            let duration = job.duration_s.min(params.max_duration_s);
            let samples_per_s = info.solo_steps_per_s * f64::from(info.batch_size);
            let factor: f64 = rng.random_range(0.8..=1.25);
            let request_gib = (world.memory.mib(t) as f64 * factor / 1024.0)
                .ceil()
                .max(1.0);
            Ok(TaskTemplate {
                id,
                submit_s: (job.submit_unix_s - first) as f64 / params.load,
                family: info.family,
                m0: info.batch_size,
                job: t,
                work_samples: duration * samples_per_s,
                solo_duration_s: duration,
                // Nobody can ask for more than the card.
                mem_request_mib: (request_gib as u64 * 1024).min(world.memory.capacity_mib),
                max_slowdown: production.then_some(params.max_slowdown),
            })
        })
        .collect()
}
