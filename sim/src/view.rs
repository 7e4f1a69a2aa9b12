//! What a scheduling policy may see: task specs as submitted and the emulated agents'
//! reports. Never the ground truth of [`crate::world`].

/// A task as its submitter describes it, plus its solo profile (one profiling run
/// alone at m0, as DESIGN.md's `SoloProfile`).
#[derive(Clone, Debug, PartialEq)]
pub struct TaskSpec {
    pub id: usize,
    /// Model family name, e.g. `ResNet-50` (a job name, as orchestrators know it).
    pub model: String,
    /// The submitted batch size m0.
    pub m0: u32,
    /// The batch sizes the job can run at, ascending (`[m0]` when it cannot change).
    pub batch_sizes: Vec<u32>,
    /// Seconds per step alone at m0, as one profiling run measured it (with the
    /// agents' measurement noise; the world's exact value is never shown to a policy).
    pub solo_step_time_s: f64,
    /// Peak GPU memory alone at m0, MiB (profiled: one run, with its own fragmentation).
    /// The only memory figure of a waiting task any policy sees, so every policy sizes
    /// memory from the same information (the user's request stays in the workload, for
    /// the store records).
    pub solo_peak_mem_mib: u64,
    /// Submit time, seconds from the start.
    pub submit_s: f64,
    /// Work in samples at m0, when the submitter states it (used for remaining-time
    /// estimates, as `TaskSpec.total_samples`).
    pub total_samples: f64,
}

/// The latest report of a task's agent (as `TaskReport`).
#[derive(Clone, Debug, PartialEq)]
pub struct AgentReport {
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
    /// The last batch size that ran out of memory, if any.
    pub oom_batch_size: Option<u32>,
    /// Counter of reports, increasing with each fresh measurement.
    pub seq: u64,
    /// False while the task restarts after a crash (no step times).
    pub running: bool,
}

/// A task waiting for a device.
#[derive(Clone, Copy, Debug)]
pub struct Waiting<'a> {
    pub spec: &'a TaskSpec,
    /// Batch size it will start at (m0, or smaller after out-of-memory crashes).
    pub batch_size: u32,
    /// Out-of-memory crashes so far.
    pub ooms: u32,
}

/// A task on a device, as seen through its agent.
#[derive(Clone, Copy, Debug)]
pub struct Resident<'a> {
    pub spec: &'a TaskSpec,
    pub report: &'a AgentReport,
}

/// Read-only view of the cluster for one decision.
pub trait ClusterView {
    /// Simulated time, seconds.
    fn now_s(&self) -> f64;
    /// Number of devices (ids are `0..devices()`).
    fn devices(&self) -> usize;
    /// Device kind, e.g. `k80`.
    fn device_kind(&self) -> &str;
    /// Memory of each device, MiB.
    fn capacity_mib(&self) -> u64;
    /// The residents of a device.
    fn residents(&self, device: usize) -> Vec<Resident<'_>>;
    /// Number of residents of a device (cheaper than `residents`).
    fn resident_count(&self, device: usize) -> usize;
    /// The tasks submitted and not running: the recovery list (crashed tasks waiting
    /// to restart), then the queue, each in the order the engine offers them.
    fn waiting(&self) -> Vec<&TaskSpec>;
    /// A number that changes whenever [`ClusterView::waiting`] does, so a policy
    /// can tell cheaply whether the set of waiting tasks changed.
    fn waiting_version(&self) -> u64;
}
