//! `iadeep.Agent`: the Rust agent behind a Python class.

use std::fmt::Display;
use std::sync::{OnceLock, PoisonError, RwLock};
use std::time::Duration;

use iadeep_agent::launch::{self, Launch};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyType;

use crate::change::BatchSizeChange;
use crate::logging;
use crate::{AgentError, Evicted};

/// The learning-rate rule when neither the script nor `iadeep run` names one: the
/// square-root rule suits the Adam family and is safe for SGD.
const DEFAULT_LR_RULE: &str = "sqrt";

/// The agent of one training task: tells the loop which batch size to train at,
/// hears how long steps take, and reports to the state store from a background
/// thread of its own. An unreachable store never stops or slows the loop.
#[pyclass(frozen, module = "iadeep")]
#[derive(Debug)]
pub struct Agent {
    /// `None` once finished (or abandoned on leaving a `with` block by an exception).
    inner: RwLock<Option<iadeep_agent::Agent>>,
    task_id: String,
    /// Why the placer evicted the task, once `poll_change` raised `Evicted` (and ended
    /// the agent): every later call raises it again.
    evicted: OnceLock<String>,
}

/// The settings both constructors take as keyword arguments.
struct Options {
    gpu_mem_request_mib: Option<u64>,
    total_samples: Option<u64>,
    report_interval_s: f64,
    lease_ttl_s: f64,
    connect_timeout_s: f64,
    use_nvml: bool,
}

/// The job's class and cap, by name as the user wrote them.
struct Class {
    priority_class: Option<String>,
    max_slowdown: Option<f64>,
}

impl Class {
    /// Sets them on `builder`; an unknown class name is a `ValueError`, the pair is
    /// checked with the rest of the configuration (`AgentError`).
    fn apply(self, builder: iadeep_agent::AgentBuilder) -> PyResult<iadeep_agent::AgentBuilder> {
        let mut builder = builder;
        if let Some(name) = self.priority_class {
            let class = iadeep_proto::priority_class_from_name(&name).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "priority_class={name:?} is not one of {}",
                    iadeep_proto::PRIORITY_CLASS_NAMES.join(", ")
                ))
            })?;
            builder = builder.priority_class(class);
        }
        if let Some(cap) = self.max_slowdown {
            builder = builder.max_slowdown(cap);
        }
        Ok(builder)
    }
}

/// What the task is: from the constructor's arguments, or the environment.
struct Task {
    task_id: String,
    store: String,
    device_id: Option<String>,
    model: String,
    initial_batch_size: u32,
    min_batch_size: Option<u32>,
    max_batch_size: Option<u32>,
    lr_rule: String,
    /// The script named the model and the launcher did not: its name replaces the one
    /// the launcher wrote into the placed spec (the script's file name).
    model_replaces_placed: bool,
}

fn seconds(name: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "{name}={value} is not a positive number of seconds"
            ))
        })
}

fn agent_error(err: iadeep_agent::AgentError) -> PyErr {
    AgentError::new_err(err.to_string())
}

/// The value `iadeep run` set, else the script's; a disagreement is logged, because
/// the launcher's value is what the placer reserved memory for.
fn launched_or_given<T: PartialEq + Display>(
    what: &str,
    launched: Option<T>,
    given: Option<T>,
) -> Option<T> {
    match (launched, given) {
        (Some(launched), Some(given)) if launched != given => {
            tracing::warn!(
                target: "iadeep",
                "{what}: using {launched} from `iadeep run` (what the placer reserved for), \
                 not the script's {given}"
            );
            Some(launched)
        }
        (Some(launched), _) => Some(launched),
        (None, given) => given,
    }
}

impl Agent {
    /// Builds and connects the agent with the GIL released: the first registration
    /// waits on the store (at most the connect timeout).
    fn connect(py: Python<'_>, task: Task, class: Class, options: Options) -> PyResult<Agent> {
        let rule = launch::lr_rule_from_name(&task.lr_rule).ok_or_else(|| {
            PyValueError::new_err(format!(
                "lr_rule={:?} is not one of {}",
                task.lr_rule,
                launch::LR_RULE_NAMES.join(", ")
            ))
        })?;
        let m0 = task.initial_batch_size;
        let bounds = task.min_batch_size.unwrap_or(m0)..=task.max_batch_size.unwrap_or(m0);
        let mut builder = iadeep_agent::Agent::builder()
            .task_id(task.task_id.clone())
            .store(&task.store)
            .model(task.model)
            .initial_batch_size(m0)
            .batch_size_bounds(bounds)
            .lr_rule(rule)
            .report_interval(seconds("report_interval_s", options.report_interval_s)?)
            .lease_ttl(seconds("lease_ttl_s", options.lease_ttl_s)?)
            .connect_timeout(seconds("connect_timeout_s", options.connect_timeout_s)?)
            .use_nvml(options.use_nvml)
            .model_replaces_placed(task.model_replaces_placed)
            // Ctrl-C raises KeyboardInterrupt in Python and the `with agent:` block
            // finishes the task; SIGTERM (Kubernetes, systemd) would kill the interpreter
            // at once, so the agent finishes the task first.
            .stop_signals(iadeep_agent::StopSignals::Terminate);
        builder = class.apply(builder)?;
        if let Some(device) = task.device_id {
            builder = builder.device_id(device);
        }
        if let Some(mib) = options.gpu_mem_request_mib {
            builder = builder.gpu_mem_request_mib(mib);
        }
        if let Some(samples) = options.total_samples {
            builder = builder.total_samples(samples);
        }
        let agent = py.detach(|| builder.connect()).map_err(agent_error)?;
        Ok(Agent {
            inner: RwLock::new(Some(agent)),
            task_id: task.task_id,
            evicted: OnceLock::new(),
        })
    }

    /// Runs `f` on the agent, or raises if it has finished. A read lock: the
    /// training thread and a data-loader thread never wait on each other.
    #[inline]
    fn with<R>(&self, f: impl FnOnce(&iadeep_agent::Agent) -> R) -> PyResult<R> {
        let guard = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        match guard.as_ref() {
            Some(agent) => Ok(f(agent)),
            None => Err(match self.evicted.get() {
                Some(reason) => Evicted::new_err(reason.clone()),
                None => PyRuntimeError::new_err(format!(
                    "the agent of task {} has finished",
                    self.task_id
                )),
            }),
        }
    }

    /// Ends the agent of an evicted task (a final report, not finished; the lease
    /// revoked, with the GIL released) and returns the `Evicted` to raise.
    fn leave_evicted(&self, py: Python<'_>, reason: String) -> PyErr {
        let reason = self.evicted.get_or_init(|| reason).clone();
        if let Some(agent) = self.take() {
            tracing::warn!(target: "iadeep", task = %self.task_id, %reason,
                "evicted by the placer; the agent leaves (iadeep run --requeue-on-evict starts the job again)");
            if let Err(err) = py.detach(|| agent.leave()) {
                tracing::warn!(target: "iadeep", task = %self.task_id, %err,
                    "the store did not confirm the agent's end; its lease expires by itself");
            }
        }
        Evicted::new_err(reason)
    }

    fn take(&self) -> Option<iadeep_agent::Agent> {
        self.inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

#[pymethods]
impl Agent {
    /// Starts the agent of task `task_id`, reporting to `store`
    /// (`etcd://HOST:PORT`, or an embedded store's file path).
    ///
    /// Waits until the task is registered, at most `connect_timeout_s`, with the GIL
    /// released; a store that does not answer is not an error (training starts, the
    /// agent keeps trying). Raises `AgentError` for what retrying cannot fix.
    #[new]
    #[pyo3(signature = (
        task_id, store, model, initial_batch_size, min_batch_size=None, max_batch_size=None,
        lr_rule=DEFAULT_LR_RULE, *, gpu_mem_request_mib=None, total_samples=None,
        report_interval_s=2.0, lease_ttl_s=10.0, connect_timeout_s=5.0, use_nvml=true,
        priority_class=None, max_slowdown=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        task_id: String,
        store: String,
        model: String,
        initial_batch_size: u32,
        min_batch_size: Option<u32>,
        max_batch_size: Option<u32>,
        lr_rule: &str,
        gpu_mem_request_mib: Option<u64>,
        total_samples: Option<u64>,
        report_interval_s: f64,
        lease_ttl_s: f64,
        connect_timeout_s: f64,
        use_nvml: bool,
        priority_class: Option<String>,
        max_slowdown: Option<f64>,
    ) -> PyResult<Agent> {
        logging::init();
        let class = Class {
            priority_class,
            max_slowdown,
        };
        let task = Task {
            task_id,
            store,
            device_id: None,
            model,
            initial_batch_size,
            min_batch_size,
            max_batch_size,
            lr_rule: lr_rule.to_owned(),
            model_replaces_placed: false,
        };
        let options = Options {
            gpu_mem_request_mib,
            total_samples,
            report_interval_s,
            lease_ttl_s,
            connect_timeout_s,
            use_nvml,
        };
        Agent::connect(py, task, class, options)
    }

    /// Starts the agent of the task `iadeep run` launched: `IADEEP_TASK_ID` and
    /// `IADEEP_STORE` are required; the model, batch sizes and learning-rate rule
    /// `iadeep run` was given (`--model`, `--batch-size`, ... as `IADEEP_MODEL`,
    /// `IADEEP_BATCH_SIZE`, ...) take precedence over the arguments, which are the
    /// defaults for a job started without them. A disagreement is logged. A `model`
    /// given here replaces the script's file name, under which `iadeep run` without
    /// `--model` submitted the task. The learning-rate rule is `sqrt` when neither
    /// names one.
    #[classmethod]
    #[pyo3(signature = (
        model=None, initial_batch_size=None, min_batch_size=None, max_batch_size=None,
        lr_rule=None, *, gpu_mem_request_mib=None, total_samples=None,
        report_interval_s=2.0, lease_ttl_s=10.0, connect_timeout_s=5.0, use_nvml=true,
        priority_class=None, max_slowdown=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn from_env(
        _cls: &Bound<'_, PyType>,
        py: Python<'_>,
        model: Option<String>,
        initial_batch_size: Option<u32>,
        min_batch_size: Option<u32>,
        max_batch_size: Option<u32>,
        lr_rule: Option<String>,
        gpu_mem_request_mib: Option<u64>,
        total_samples: Option<u64>,
        report_interval_s: f64,
        lease_ttl_s: f64,
        connect_timeout_s: f64,
        use_nvml: bool,
        priority_class: Option<String>,
        max_slowdown: Option<f64>,
    ) -> PyResult<Agent> {
        logging::init();
        let env = Launch::from_env().map_err(agent_error)?;
        let class = Class {
            priority_class: launched_or_given(
                "priority_class",
                env.priority_class.map(|c| c.name().to_owned()),
                priority_class,
            ),
            max_slowdown: launched_or_given("max_slowdown", env.max_slowdown, max_slowdown),
        };
        let initial_batch_size = launched_or_given(
            "initial_batch_size",
            env.initial_batch_size,
            initial_batch_size,
        )
        .ok_or_else(|| {
            AgentError::new_err(format!(
                "initial_batch_size is required: pass it, or launch with \
                         `iadeep run --batch-size N` (which sets {})",
                launch::BATCH_SIZE
            ))
        })?;
        // `iadeep run` passes a model only when the user gave `--model`; otherwise it
        // named the placed task after the command (its own `--model` value, else the
        // script's file name), and the script's own name wins in the spec.
        let model_replaces_placed = env.model.is_none() && model.is_some();
        let task = Task {
            task_id: env.task_id,
            store: env.store,
            device_id: env.device_id,
            model: launched_or_given("model", env.model, model).unwrap_or_default(),
            model_replaces_placed,
            initial_batch_size,
            min_batch_size: launched_or_given("min_batch_size", env.min_batch_size, min_batch_size),
            max_batch_size: launched_or_given("max_batch_size", env.max_batch_size, max_batch_size),
            lr_rule: launched_or_given(
                "lr_rule",
                env.lr_rule.map(|r| launch::lr_rule_name(r).to_owned()),
                lr_rule,
            )
            .unwrap_or_else(|| DEFAULT_LR_RULE.to_owned()),
        };
        let options = Options {
            gpu_mem_request_mib,
            total_samples,
            report_interval_s,
            lease_ttl_s,
            connect_timeout_s,
            use_nvml,
        };
        Agent::connect(py, task, class, options)
    }

    /// The batch size to train the next step at. One atomic load.
    #[getter]
    fn batch_size(&self) -> PyResult<u32> {
        self.with(|a| a.batch_size())
    }

    /// Records one finished step: the batch size it ran at and its wall time in
    /// seconds. A few atomic additions; no I/O, no allocation.
    fn record_step(&self, batch_size: u32, seconds: f64) -> PyResult<()> {
        let elapsed = Duration::try_from_secs_f64(seconds)
            .map_err(|_| PyValueError::new_err(format!("seconds={seconds} is not a duration")))?;
        self.with(|a| a.record_step(batch_size, elapsed))
    }

    /// A batch-size change to apply before the next step, or `None` (one atomic load
    /// when nothing is pending). The agent's batch size switches here, so the data
    /// loader, the learning rate and the measurements change at the same step.
    ///
    /// Once the placer has evicted the task, raises `iadeep.Evicted` (with its
    /// `reason`) after ending the agent (a final report, not finished; the lease
    /// revoked); every later call raises it too. Write the checkpoint before: when
    /// `agent.evicted` is set, or when `poll_change(raise_evicted=False)` returns the
    /// change with reason `"evicted"` (once), then call `poll_change()` to raise.
    #[pyo3(signature = (*, raise_evicted=true))]
    fn poll_change(
        &self,
        py: Python<'_>,
        raise_evicted: bool,
    ) -> PyResult<Option<BatchSizeChange>> {
        let (change, evicted) = self.with(|a| {
            let change = a.poll_change();
            let evicted = if raise_evicted { a.evicted() } else { None };
            (change, evicted)
        })?;
        match evicted {
            Some(reason) => Err(self.leave_evicted(py, reason)),
            None => Ok(change.map(BatchSizeChange::from)),
        }
    }

    /// Why the placer evicted the task (its assignment said so), or `None`. Never
    /// raises: a loop checks it between steps to write its checkpoint while the task
    /// still holds its reservation, then calls `poll_change()`, which raises `Evicted`.
    #[getter]
    fn evicted(&self) -> Option<String> {
        if let Some(reason) = self.evicted.get() {
            return Some(reason.clone());
        }
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .and_then(iadeep_agent::Agent::evicted)
    }

    /// Records the squared gradient norms over `small_batch` and `big_batch` samples
    /// of the same step (small < big, e.g. one micro-batch and the accumulated
    /// batch), from which the agent estimates the gradient noise scale.
    fn record_gradient_norms(
        &self,
        small_batch: u32,
        small_sq_norm: f64,
        big_batch: u32,
        big_sq_norm: f64,
    ) -> PyResult<()> {
        self.with(|a| a.record_gradient_norms(small_batch, small_sq_norm, big_batch, big_sq_norm))
    }

    /// Records the peak GPU memory (MiB) the job measured itself, e.g.
    /// `torch.cuda.max_memory_reserved() // 2**20`; NVML's figure wins when NVML
    /// sees this process. Either is reported once a step at the current batch size
    /// was recorded. Without any memory figure the tuner never grows the batch.
    fn record_peak_memory(&self, mib: u64) -> PyResult<()> {
        self.with(|a| a.record_peak_memory(mib))
    }

    /// The job ran out of GPU memory at `batch_size` (default: the current one):
    /// the agent falls back to the largest size known to fit below it (else half),
    /// tells the tuner at once, and returns the change to apply before retrying.
    #[pyo3(signature = (batch_size=None))]
    fn report_oom(&self, batch_size: Option<u32>) -> PyResult<BatchSizeChange> {
        self.with(|a| BatchSizeChange::from(a.report_oom(batch_size.unwrap_or(a.batch_size()))))
    }

    /// Publishes a report now (e.g. at the end of an epoch) instead of at the next tick.
    fn report_now(&self) -> PyResult<()> {
        self.with(|a| a.report_now())
    }

    /// The GPU memory this task may use now, MiB: the latest of its placement's
    /// reservation (as first seen, and whenever the placer rewrites it) and the memory
    /// bound of each applied change that carries one; `None` when neither is known.
    #[getter]
    fn memory_limit_mib(&self) -> PyResult<Option<u64>> {
        self.with(|a| a.memory_limit_mib())
    }

    /// What the job caps its own allocator at, MiB: `memory_limit_mib` plus the memory
    /// margin's fraction of it (a peak varies a few percent from run to run, and the card
    /// keeps that fraction free for every task at once); `None` without a limit.
    #[getter]
    fn memory_fence_mib(&self) -> PyResult<Option<u64>> {
        self.with(|a| a.memory_fence_mib())
    }

    /// The learning-rate factor of the current batch size (1.0 until a change).
    #[getter]
    fn lr_factor(&self) -> PyResult<f64> {
        self.with(|a| a.lr_factor())
    }

    /// The tuner round the loop trains under (0 before any assignment).
    #[getter]
    fn round(&self) -> PyResult<u64> {
        self.with(|a| a.round())
    }

    /// The task's id.
    #[getter]
    fn task_id(&self) -> &str {
        &self.task_id
    }

    /// Whether the task is registered with a live lease right now.
    #[getter]
    fn registered(&self) -> PyResult<bool> {
        self.with(|a| a.is_registered())
    }

    /// Reports stored so far.
    #[getter]
    fn reports_published(&self) -> PyResult<u64> {
        self.with(|a| a.reports_published())
    }

    /// Whether `finish()` was called (or a `with` block left by an exception).
    #[getter]
    fn finished(&self) -> bool {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    /// Marks the task finished and revokes its lease, so its GPU frees at once
    /// (GIL released meanwhile). Raises `AgentError` when the store did not confirm
    /// (the lease then expires by itself). A second call does nothing.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        match self.take() {
            Some(agent) => py.detach(|| agent.finish()).map_err(agent_error),
            None => Ok(()),
        }
    }

    /// Ends the agent without claiming the task finished (a final report with
    /// `finished` false, the lease revoked; GIL released meanwhile): what a job does
    /// when it stops before its work is done, e.g. after an eviction when it raises
    /// its own exception instead of `poll_change()`'s `Evicted`. A second call, or
    /// one after `finish()`, does nothing.
    fn leave(&self, py: Python<'_>) -> PyResult<()> {
        match self.take() {
            Some(agent) => py.detach(|| agent.leave()).map_err(agent_error),
            None => Ok(()),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving the block normally finishes the task (a store that does not confirm
    /// is logged, not raised: the training itself succeeded). Leaving it by an
    /// exception revokes the lease without claiming the task finished.
    #[pyo3(signature = (exc_type=None, _exc_value=None, _traceback=None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<Bound<'_, PyAny>>,
        _exc_value: Option<Bound<'_, PyAny>>,
        _traceback: Option<Bound<'_, PyAny>>,
    ) -> bool {
        let failed = exc_type.is_some_and(|t| !t.is_none());
        if let Some(agent) = self.take() {
            if failed {
                py.detach(|| drop(agent));
            } else if let Err(err) = py.detach(|| agent.finish()) {
                tracing::warn!(target: "iadeep", task = %self.task_id, %err,
                    "finish not confirmed by the store");
            }
        }
        false
    }

    fn __repr__(&self) -> String {
        match self
            .inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            Some(agent) => format!(
                "Agent(task_id={:?}, batch_size={}, round={}, registered={})",
                self.task_id,
                agent.batch_size(),
                agent.round(),
                agent.is_registered()
            ),
            None => format!("Agent(task_id={:?}, finished)", self.task_id),
        }
    }
}
