//! One experiment: the same world and arrival stream, every requested policy.

use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_datasets::philly::PhillyJob;

use crate::audit::{self, AuditRecord};
use crate::engine::{Engine, EngineParams};
use crate::error::{Result, SimError};
use crate::metrics::RunMetrics;
use crate::policy::{POLICY_NAMES, Policy};
use crate::workload::{self, TaskTemplate, WorkloadParams};
use crate::world::{Interference, World};

/// What to simulate.
#[derive(Clone, Debug, PartialEq)]
pub struct ExperimentParams {
    pub worker_type: String,
    /// GPU memory, MiB (default: the worker type's known size).
    pub capacity_mib: Option<u64>,
    /// The world's model for three or more co-located jobs.
    pub interference: Interference,
    pub workload: WorkloadParams,
    pub engine: EngineParams,
    /// Policies to run (names from [`POLICY_NAMES`]).
    pub policies: Vec<String>,
}

impl Default for ExperimentParams {
    fn default() -> Self {
        ExperimentParams {
            worker_type: "k80".into(),
            capacity_mib: None,
            interference: Interference::default(),
            workload: WorkloadParams::default(),
            engine: EngineParams::default(),
            policies: POLICY_NAMES.iter().map(|s| (*s).to_owned()).collect(),
        }
    }
}

impl ExperimentParams {
    /// Checks every part, naming the first bad parameter.
    pub fn check(&self) -> Result<()> {
        self.workload.check()?;
        self.engine.check()?;
        if self.policies.is_empty() {
            return Err(SimError::InvalidParam {
                field: "policies",
                reason: "none selected".into(),
            });
        }
        for name in &self.policies {
            if !POLICY_NAMES.contains(&name.as_str()) {
                return Err(SimError::UnknownPolicy {
                    requested: name.clone(),
                    known: POLICY_NAMES.join(", "),
                });
            }
        }
        Ok(())
    }
}

/// A prepared experiment: world and stream built once, shared by every policy.
#[derive(Debug)]
pub struct Experiment {
    pub params: ExperimentParams,
    pub(crate) world: World,
    pub(crate) workload: Vec<TaskTemplate>,
}

impl Experiment {
    /// Builds the world from `gavel` and the stream from `philly`.
    pub fn new(
        params: ExperimentParams,
        gavel: &GavelThroughputs,
        philly: &[PhillyJob],
    ) -> Result<Experiment> {
        params.check()?;
        let world = World::new(
            gavel,
            &params.worker_type,
            params.capacity_mib,
            params.interference,
        )?;
        let workload = workload::build(&world, philly, &params.workload)?;
        Ok(Experiment {
            params,
            world,
            workload,
        })
    }

    /// Number of jobs in the arrival stream (`params.workload.tasks`).
    pub fn job_count(&self) -> usize {
        self.workload.len()
    }

    /// Builds a policy by name (one of [`POLICY_NAMES`]): the oracles read this
    /// experiment's world, the others only what the engine shows them. `oracle-wait`
    /// runs `iadeep` on the stream first, for the waits its tasks really had.
    pub fn policy(&self, name: &str) -> Result<Box<dyn Policy>> {
        self.policy_after(name, None)
    }

    /// [`Experiment::policy`], given `iadeep`'s run of this experiment if one was made:
    /// `oracle-wait` reads its waits there rather than running `iadeep` again. The run is
    /// deterministic, so the waits are the same either way.
    pub fn policy_after(
        &self,
        name: &str,
        iadeep_run: Option<&RunMetrics>,
    ) -> Result<Box<dyn Policy>> {
        use crate::policy::iadeep::{Iadeep, Oracle, Variant, oracle::Truth};
        let seed = self.params.workload.seed;
        if let Some(which) = Oracle::from_name(name) {
            let starts = match (which.wait(), iadeep_run) {
                (false, _) => Vec::new(),
                (true, Some(run)) => run.tasks.iter().map(|t| (t.id, t.start_s)).collect(),
                (true, None) => {
                    let mut iadeep = Iadeep::new(Variant::Full, seed)?;
                    let run = self.run_policy(&mut iadeep, &mut |_, _| {})?;
                    run.tasks.iter().map(|t| (t.id, t.start_s)).collect()
                }
            };
            let truth = Truth::new(&self.world);
            return Ok(Box::new(Iadeep::oracle(truth, which, &starts, seed)?));
        }
        crate::policy::build(name, seed)
    }

    /// Runs one policy over the stream.
    pub fn run_policy(
        &self,
        policy: &mut dyn Policy,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<RunMetrics> {
        let engine = Engine::new(&self.world, &self.workload, self.params.engine.clone())?;
        let started = std::time::Instant::now();
        let metrics = engine.run(policy, progress)?;
        tracing::info!(
            policy = policy.name(),
            tasks = metrics.tasks.len(),
            events = metrics.events,
            wall_ms = started.elapsed().as_millis() as u64,
            diagnostics = %policy.diagnostics(),
            "policy run finished"
        );
        Ok(metrics)
    }

    /// Runs one policy with the placement audit on: its decisions, with the world's
    /// slowdowns and the real start times filled in (see [`AuditRecord`]). Empty for
    /// policies that do not record decisions.
    pub fn run_policy_audited(
        &self,
        policy: &mut dyn Policy,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(RunMetrics, Vec<AuditRecord>)> {
        policy.enable_audit();
        let metrics = self.run_policy(policy, progress)?;
        let mut records = policy.take_audit();
        audit::fill_truth(&mut records, &self.world, &self.workload, &metrics.tasks);
        Ok((metrics, records))
    }
}
