//! What a scheduling policy may see: task specs as submitted and the emulated agents'
//! reports. Never the ground truth of [`crate::world`].

/// What the simulated jobs bring to the policies besides their spec: the same for every
/// policy in a run (`EngineParams::job_info`, `iadeep sim --job-info`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum JobInfo {
    /// What a user gives `iadeep run`: model name, m0, the batch sizes it accepts, its
    /// submit time and work. No solo profile and no memory figure: everything else is
    /// learned from the agents' reports, as in production. The default.
    #[default]
    None,
    /// Each job also brings its solo profile at m0 (step time and peak memory, one
    /// profiling run measured with noise): the simulator's former default, kept for
    /// comparison (docs/simulator-experiments.md, "Jobs without a profile"). Production
    /// jobs rarely have one.
    Profiled,
}

impl std::str::FromStr for JobInfo {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(JobInfo::None),
            "profiled" => Ok(JobInfo::Profiled),
            other => Err(format!(
                "unknown job information {other:?} (none or profiled)"
            )),
        }
    }
}

impl std::fmt::Display for JobInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            JobInfo::None => "none",
            JobInfo::Profiled => "profiled",
        })
    }
}

/// A job's solo profile at m0: one profiling run alone (what a user rarely brings, see
/// docs/design.md, "What a job brings").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoloProfile {
    /// Seconds per step alone at m0, as the profiling run measured it (with the agents'
    /// measurement noise; the world's exact value is never shown to a policy).
    pub step_time_s: f64,
    /// Peak GPU memory alone at m0, MiB (one run, with its own fragmentation).
    pub peak_mem_mib: u64,
}

/// A simulated job as its submitter describes it: what a policy knows of it before
/// any report. The simulator's counterpart of `iadeep_proto::TaskSpec`, kept apart
/// because the simulator counts jobs by index, time in simulated seconds and work in
/// fractional samples at m0 (the iadeep policies translate it with
/// `policy::iadeep::placement::proto_spec`).
#[derive(Clone, Debug, PartialEq)]
pub struct JobSpec {
    pub id: usize,
    /// Model family name, e.g. `ResNet-50` (a job name, as orchestrators know it).
    pub model: String,
    /// The submitted batch size m0.
    pub m0: u32,
    /// The batch sizes the job can run at, ascending (`[m0]` when it cannot change).
    pub batch_sizes: Vec<u32>,
    /// The solo profile at m0, only with [`JobInfo::Profiled`]: the only memory figure
    /// of a waiting task any policy may see then, so every policy sizes memory from the
    /// same information. With [`JobInfo::None`] (the default) it is `None`, as for a job
    /// started with `iadeep run`, and policies learn from the agents' reports. The
    /// user's memory request stays in the workload, for the store records: no policy
    /// sees it.
    pub profile: Option<SoloProfile>,
    /// Submit time, seconds from the start.
    pub submit_s: f64,
    /// Work in samples at m0, when the submitter states it (used for remaining-time
    /// estimates, as `iadeep_proto::TaskSpec::total_samples`).
    pub total_samples: f64,
    /// A production job's slowdown cap (the most PD it accepts, as
    /// `iadeep_proto::TaskSpec::slowdown_cap`); `None` for an opportunistic job.
    pub max_slowdown: Option<f64>,
}

impl JobSpec {
    /// Whether the job is production (it has a slowdown cap).
    pub fn is_production(&self) -> bool {
        self.max_slowdown.is_some()
    }
}

/// The latest report of a simulated job's emulated agent: the simulator's counterpart
/// of `iadeep_proto::TaskReport`, with fractional progress and a `running` flag for a
/// job restarting after a crash.
#[derive(Clone, Debug, PartialEq)]
pub struct JobReport {
    /// Batch size the last steps ran at.
    pub batch_size: u32,
    /// Seconds per step at that batch size, with measurement noise.
    pub step_time_s: f64,
    pub samples_per_s: f64,
    /// Peak GPU memory of the process, MiB.
    pub peak_mem_mib: u64,
    /// φ from the trainer's gradient statistics, when it reports them.
    pub grad_noise_scale: Option<f64>,
    /// Work done, in samples at m0, as the agent counts progress.
    pub samples_done: f64,
    /// A batch size that ran out of memory, if any: after a crash the size that crashed;
    /// after a fenced out-of-memory (see [`crate::engine`]) the smallest size that failed
    /// so far, as the real agent reports it.
    pub oom_batch_size: Option<u32>,
    /// Counter of reports, increasing with each fresh measurement.
    pub seq: u64,
    /// False while the task restarts after a crash (no step times).
    pub running: bool,
}

/// A task waiting for a device.
#[derive(Clone, Copy, Debug)]
pub struct Waiting<'a> {
    pub spec: &'a JobSpec,
    /// Batch size it will start at (m0, or smaller after out-of-memory crashes).
    pub batch_size: u32,
    /// Out-of-memory crashes so far.
    pub ooms: u32,
}

/// A job on a simulated device, as a policy sees it through its agent.
#[derive(Clone, Copy, Debug)]
pub struct ResidentJob<'a> {
    pub spec: &'a JobSpec,
    pub report: &'a JobReport,
}

/// What a policy sees of the simulated cluster for one decision: read-only, specs and
/// agents' reports only.
pub trait PolicyView {
    /// Simulated time, seconds.
    fn now_s(&self) -> f64;
    /// Number of devices (ids are `0..devices()`).
    fn devices(&self) -> usize;
    /// Device kind, e.g. `k80`.
    fn device_kind(&self) -> &str;
    /// Memory of each device, MiB.
    fn capacity_mib(&self) -> u64;
    /// The residents of a device.
    fn residents(&self, device: usize) -> Vec<ResidentJob<'_>>;
    /// Number of residents of a device (cheaper than `residents`).
    fn resident_count(&self, device: usize) -> usize;
    /// The tasks submitted and not running: the recovery list (crashed tasks waiting
    /// to restart), then the queue, each in the order the engine offers them.
    fn waiting(&self) -> Vec<&JobSpec>;
    /// A number that changes whenever [`PolicyView::waiting`] does, so a policy
    /// can tell cheaply whether the set of waiting tasks changed.
    fn waiting_version(&self) -> u64;
    /// How the engine offers waiting tasks in this run (the same for every policy): a
    /// policy that holds some tasks back for others must know whether the others will
    /// be offered at all.
    fn admission(&self) -> Admission;
}

/// How the engine offers waiting tasks to a policy: one rule for every policy in a
/// run (`EngineParams::admission`), so no policy gains by its queue discipline alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Admission {
    /// Only the head of the queue is offered; while the policy keeps it waiting, the
    /// tasks behind it wait too (first in, first out with head-of-line blocking).
    Fifo,
    /// Every waiting task is offered, in submission order, and one told to wait does
    /// not hold back the tasks behind it: how clients of the placement daemon behave,
    /// each task asking for itself and retrying when told to queue. The placer then
    /// decides each task knowing how many wait ahead of it. The default.
    #[default]
    EachTask,
}

impl std::str::FromStr for Admission {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "each-task" => Ok(Admission::EachTask),
            "fifo" => Ok(Admission::Fifo),
            other => Err(format!(
                "unknown admission rule {other:?} (each-task or fifo)"
            )),
        }
    }
}
