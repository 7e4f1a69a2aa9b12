//! What an agent needs to know, validated once before anything starts.

use std::fmt;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use iadeep_proto::{LrScalingRule, PriorityClass};
use iadeep_state::{StateStore, StoreUrl, keys};

use crate::error::{AgentError, Result};
use crate::memory::MemoryProbe;
use crate::signals::StopSignals;

/// Where the agent's state store comes from.
#[derive(Clone)]
pub enum StoreSource {
    /// Opened (and re-opened after failures) by the reporter.
    Url(StoreUrl),
    /// A store the caller already holds, e.g. an in-memory store shared with a
    /// tuner in the same process.
    Handle(Arc<dyn StateStore>),
}

impl fmt::Debug for StoreSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreSource::Url(url) => write!(f, "Url({url})"),
            StoreSource::Handle(store) => write!(f, "Handle({})", store.describe()),
        }
    }
}

/// Validated settings of one agent (see [`crate::AgentBuilder`] for meanings).
#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub task_id: String,
    pub store: StoreSource,
    pub model: String,
    pub initial_batch_size: u32,
    pub min_batch_size: u32,
    pub max_batch_size: u32,
    pub lr_rule: LrScalingRule,
    pub device_id: Option<String>,
    pub gpu_mem_request_mib: Option<u64>,
    pub total_samples: Option<u64>,
    pub report_interval: Duration,
    pub lease_ttl: Duration,
    pub connect_timeout: Duration,
    pub op_timeout: Duration,
    pub use_nvml: bool,
    pub gns_smoothing: f64,
    pub stop_signals: StopSignals,
    pub model_replaces_placed: bool,
    pub priority_class: PriorityClass,
    pub max_slowdown: Option<f64>,
}

/// Report every 2 s: a tuner round needs a few reports, and etcd barely notices.
pub const DEFAULT_REPORT_INTERVAL: Duration = Duration::from_secs(2);
/// A crashed trainer frees its device 10 s after its last keep-alive.
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(10);

impl AgentConfig {
    /// Checks every value, naming the one at fault.
    pub fn check(&self) -> Result<()> {
        let bad = |msg: String| Err(AgentError::InvalidConfig(msg));
        keys::validate_id("task", &self.task_id)?;
        if let Some(device) = &self.device_id {
            keys::validate_id("device", device)?;
        }
        if self.min_batch_size == 0 {
            return bad("batch sizes must be at least 1".into());
        }
        if !(self.min_batch_size..=self.max_batch_size).contains(&self.initial_batch_size) {
            return bad(format!(
                "initial batch size {} is outside the bounds {}..={}",
                self.initial_batch_size, self.min_batch_size, self.max_batch_size
            ));
        }
        if self.report_interval < Duration::from_millis(50) {
            return bad(format!(
                "report interval {:?} is below 50 ms: that floods the store",
                self.report_interval
            ));
        }
        if self.lease_ttl < Duration::from_secs(2) || self.lease_ttl > Duration::from_secs(3600) {
            return bad(format!(
                "lease TTL {:?} must be between 2 s and 1 h",
                self.lease_ttl
            ));
        }
        if self.op_timeout.is_zero() || self.connect_timeout.is_zero() {
            return bad("timeouts must be positive".into());
        }
        if let Err((field, why)) =
            iadeep_proto::check_priority(self.priority_class as i32, self.max_slowdown)
        {
            return bad(format!("{field}: {why}"));
        }
        if !(self.gns_smoothing > 0.0 && self.gns_smoothing <= 1.0) {
            return bad(format!(
                "gradient-noise smoothing {} must be in (0, 1]",
                self.gns_smoothing
            ));
        }
        Ok(())
    }

    /// Clamps a batch size into the bounds.
    pub fn clamp(&self, batch_size: u32) -> u32 {
        batch_size.clamp(self.min_batch_size, self.max_batch_size)
    }
}

/// Builds an [`crate::Agent`]: `task_id`, `store` and `initial_batch_size` are required.
pub struct AgentBuilder {
    pub(crate) task_id: Option<String>,
    pub(crate) store: Option<StoreSource>,
    pub(crate) model: String,
    pub(crate) initial_batch_size: Option<u32>,
    pub(crate) bounds: Option<RangeInclusive<u32>>,
    pub(crate) lr_rule: LrScalingRule,
    pub(crate) device_id: Option<String>,
    pub(crate) gpu_mem_request_mib: Option<u64>,
    pub(crate) total_samples: Option<u64>,
    pub(crate) report_interval: Duration,
    pub(crate) lease_ttl: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) op_timeout: Duration,
    pub(crate) use_nvml: bool,
    pub(crate) gns_smoothing: f64,
    pub(crate) stop_signals: StopSignals,
    pub(crate) model_replaces_placed: bool,
    pub(crate) priority_class: PriorityClass,
    pub(crate) max_slowdown: Option<f64>,
    pub(crate) memory_probe: Option<Box<dyn MemoryProbe>>,
    pub(crate) store_error: Option<iadeep_state::StateError>,
}

impl fmt::Debug for AgentBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentBuilder")
            .field("task_id", &self.task_id)
            .field("store", &self.store)
            .field("initial_batch_size", &self.initial_batch_size)
            .field("bounds", &self.bounds)
            .finish_non_exhaustive()
    }
}

impl Default for AgentBuilder {
    fn default() -> Self {
        AgentBuilder {
            task_id: None,
            store: None,
            model: String::new(),
            initial_batch_size: None,
            bounds: None,
            lr_rule: LrScalingRule::Unspecified,
            device_id: None,
            gpu_mem_request_mib: None,
            total_samples: None,
            report_interval: DEFAULT_REPORT_INTERVAL,
            lease_ttl: DEFAULT_LEASE_TTL,
            connect_timeout: Duration::from_secs(5),
            op_timeout: Duration::from_secs(3),
            use_nvml: true,
            gns_smoothing: 0.05,
            stop_signals: StopSignals::default(),
            model_replaces_placed: false,
            priority_class: PriorityClass::Unspecified,
            max_slowdown: None,
            memory_probe: None,
            store_error: None,
        }
    }
}

impl AgentBuilder {
    /// The task's id, as the placer knows it (one key segment: letters, digits, `.`, `_`, `-`, `:`).
    pub fn task_id(mut self, id: impl Into<String>) -> Self {
        self.task_id = Some(id.into());
        self
    }
    /// The store to report to, by URL (`etcd://HOST:PORT`, `memory:` or a file path).
    pub fn store_url(mut self, url: StoreUrl) -> Self {
        self.store = Some(StoreSource::Url(url));
        self.store_error = None;
        self
    }
    /// The store to report to, by URL text; a malformed URL fails in `connect`
    /// with the parser's reason.
    pub fn store(mut self, url: &str) -> Self {
        match url.parse::<StoreUrl>() {
            Ok(url) => {
                self.store = Some(StoreSource::Url(url));
                self.store_error = None;
            }
            Err(err) => self.store_error = Some(err),
        }
        self
    }
    /// A store handle the caller already holds.
    pub fn store_handle(mut self, store: Arc<dyn StateStore>) -> Self {
        self.store = Some(StoreSource::Handle(store));
        self.store_error = None;
        self
    }
    /// Model name, informative only (written into the TaskSpec).
    pub fn model(mut self, model: impl Into<String>) -> Self {
        self.model = model.into();
        self
    }
    /// Whether [`AgentBuilder::model`] replaces the model name of a spec the placer
    /// already wrote (default false: the placer's spec is the truth). For a launcher
    /// that named the model after the script only because the user named none
    /// (`iadeep run` without `--model`), while the script names it.
    pub fn model_replaces_placed(mut self, on: bool) -> Self {
        self.model_replaces_placed = on;
        self
    }
    /// The batch size the job was submitted with (m0); PD is measured against it.
    pub fn initial_batch_size(mut self, batch_size: u32) -> Self {
        self.initial_batch_size = Some(batch_size);
        self
    }
    /// The range the tuner may move the batch size in (default: only the initial one).
    pub fn batch_size_bounds(mut self, bounds: RangeInclusive<u32>) -> Self {
        self.bounds = Some(bounds);
        self
    }
    /// How the trainer rescales its learning rate (written into the TaskSpec, used on OOM fall-back).
    pub fn lr_rule(mut self, rule: LrScalingRule) -> Self {
        self.lr_rule = rule;
        self
    }
    /// The device the task runs on, if known; otherwise read from the task's placement.
    pub fn device_id(mut self, device: impl Into<String>) -> Self {
        self.device_id = Some(device.into());
        self
    }
    /// GPU memory the user asked for, MiB (written into the TaskSpec).
    pub fn gpu_mem_request_mib(mut self, mib: u64) -> Self {
        self.gpu_mem_request_mib = Some(mib);
        self
    }
    /// Total work in samples, when known.
    pub fn total_samples(mut self, samples: u64) -> Self {
        self.total_samples = Some(samples);
        self
    }
    /// How often a TaskReport is published (default 2 s).
    pub fn report_interval(mut self, interval: Duration) -> Self {
        self.report_interval = interval;
        self
    }
    /// TTL of the liveness lease (default 10 s): how long a crashed trainer keeps its device.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }
    /// How long `connect` waits for the first registration before going on
    /// without it (the reporter keeps trying in the background). Default 5 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }
    /// Deadline of each store operation of the reporter (default 3 s).
    pub fn op_timeout(mut self, timeout: Duration) -> Self {
        self.op_timeout = timeout;
        self
    }
    /// Whether to try NVML for peak memory (default true).
    pub fn use_nvml(mut self, on: bool) -> Self {
        self.use_nvml = on;
        self
    }
    /// A memory probe used when NVML is absent or does not see this process.
    pub fn memory_probe(mut self, probe: impl MemoryProbe + 'static) -> Self {
        self.memory_probe = Some(Box::new(probe));
        self
    }
    /// Weight of a new sample in the gradient-noise moving averages (default 0.05).
    pub fn gns_smoothing(mut self, alpha: f64) -> Self {
        self.gns_smoothing = alpha;
        self
    }

    /// The job's priority class, written into the TaskSpec the agent registers when no
    /// spec is there yet (`iadeep run --class` writes the placer's): production jobs keep
    /// their slowdown under [`AgentBuilder::max_slowdown`]; opportunistic jobs (the
    /// default) use what production jobs leave, and may be shrunk and evicted.
    pub fn priority_class(mut self, class: PriorityClass) -> Self {
        self.priority_class = class;
        self
    }
    /// A production job's slowdown cap, the most PD it accepts (greater than 1, at most
    /// [`iadeep_proto::MAX_SLOWDOWN_CAP`]; default [`iadeep_proto::DEFAULT_MAX_SLOWDOWN`]).
    /// Refused for any other class, as the placer refuses it.
    pub fn max_slowdown(mut self, cap: f64) -> Self {
        self.max_slowdown = Some(cap);
        self
    }

    /// Which signals make the agent finish the task (final report, lease revoked) and then
    /// end the process as the signal would have (default SIGTERM and SIGINT; see
    /// [`StopSignals`]). Leave out a signal the program handles itself.
    pub fn stop_signals(mut self, signals: StopSignals) -> Self {
        self.stop_signals = signals;
        self
    }

    /// The validated configuration, and the caller's probe.
    pub(crate) fn into_config(self) -> Result<(AgentConfig, Option<Box<dyn MemoryProbe>>)> {
        if let Some(err) = self.store_error {
            return Err(err.into());
        }
        let missing = |what: &str| AgentError::InvalidConfig(format!("{what} is required"));
        let initial = self
            .initial_batch_size
            .ok_or_else(|| missing("initial_batch_size"))?;
        let bounds = self.bounds.unwrap_or(initial..=initial);
        let config = AgentConfig {
            task_id: self.task_id.ok_or_else(|| missing("task_id"))?,
            store: self.store.ok_or_else(|| missing("store"))?,
            model: self.model,
            initial_batch_size: initial,
            min_batch_size: *bounds.start(),
            max_batch_size: *bounds.end(),
            lr_rule: self.lr_rule,
            device_id: self.device_id,
            gpu_mem_request_mib: self.gpu_mem_request_mib,
            total_samples: self.total_samples,
            report_interval: self.report_interval,
            lease_ttl: self.lease_ttl,
            connect_timeout: self.connect_timeout,
            op_timeout: self.op_timeout,
            use_nvml: self.use_nvml,
            gns_smoothing: self.gns_smoothing,
            stop_signals: self.stop_signals,
            model_replaces_placed: self.model_replaces_placed,
            priority_class: self.priority_class,
            max_slowdown: self.max_slowdown,
        };
        config.check()?;
        Ok((config, self.memory_probe))
    }
}
