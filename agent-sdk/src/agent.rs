//! The handle a training loop holds.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use iadeep_state::StateError;
use tokio::sync::{Notify, watch};

use crate::config::{AgentBuilder, AgentConfig};
use crate::error::{AgentError, Result};
use crate::memory::{NvmlProbe, PeakMemory};
use crate::reporter::Reporter;
use crate::shared::{BatchSizeChange, ChangeReason, Control, Outcome, Shared};
use crate::signals::{end_process, run_until_stop_signal};
use iadeep_objective::{MemoryMargin, lr_factor};

/// The agent of one training task.
///
/// Cheap, non-blocking calls for the loop ([`Agent::batch_size`],
/// [`Agent::record_step`], [`Agent::poll_change`]); a background reporter
/// thread does all store traffic. `Agent` is `Sync`: a data-loader thread may
/// read the batch size while the training thread records steps.
///
/// ```no_run
/// # fn main() -> Result<(), iadeep_agent::AgentError> {
/// use std::time::Instant;
/// let agent = iadeep_agent::Agent::builder()
///     .task_id("job-42")
///     .store("etcd://127.0.0.1:2379")
///     .model("resnet50")
///     .initial_batch_size(256)
///     .batch_size_bounds(32..=1024)
///     .connect()?;
/// let mut lr = 0.1;
/// for _ in 0..1000 {
///     let bs = agent.batch_size();
///     let start = Instant::now();
///     // ... one training step at `bs` ...
///     agent.record_step(bs, start.elapsed());
///     if let Some(change) = agent.poll_change() {
///         // Rebuild the data loader for change.batch_size.
///         lr = 0.1 * change.lr_factor;
///     }
/// }
/// agent.finish()?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Agent {
    config: Arc<AgentConfig>,
    shared: Arc<Shared>,
    kick: Arc<Notify>,
    /// Shared with the reporter's thread, which finishes the task on a stop signal.
    control: Arc<watch::Sender<Control>>,
    done: Mutex<Option<Receiver<Outcome>>>,
    thread: Option<JoinHandle<()>>,
}

/// Extra time `finish` grants beyond the two store calls it makes.
const FINISH_SLACK: Duration = Duration::from_secs(1);

impl Agent {
    /// A builder; see [`AgentBuilder`].
    pub fn builder() -> AgentBuilder {
        AgentBuilder::default()
    }

    /// Starts the reporter; returns the agent and the channel of the first
    /// registration's outcome.
    fn start(builder: AgentBuilder) -> Result<(Agent, Receiver<Result<(), StateError>>)> {
        let (config, probe) = builder.into_config()?;
        let config = Arc::new(config);
        let shared = Arc::new(Shared::new(config.initial_batch_size, config.gns_smoothing));
        let kick = Arc::new(Notify::new());
        let (control, control_rx) = watch::channel(Control::Run);
        let control = Arc::new(control);
        let (first_tx, first_rx) = mpsc::sync_channel(1);
        let (done_tx, done_rx) = mpsc::sync_channel(1);
        let thread = {
            let (config, shared, kick, control) = (
                config.clone(),
                shared.clone(),
                kick.clone(),
                control.clone(),
            );
            std::thread::Builder::new()
                .name(format!("iadeep-agent-{}", config.task_id))
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(runtime) => runtime,
                        Err(err) => {
                            tracing::error!(%err, "agent reporter cannot start its runtime");
                            let _ = done_tx.send(Err(err.to_string()));
                            return;
                        }
                    };
                    let nvml = if config.use_nvml {
                        NvmlProbe::try_new(std::process::id())
                    } else {
                        None
                    };
                    let memory = PeakMemory::new(nvml, probe);
                    let stop_signals = config.stop_signals;
                    let task_id = config.task_id.clone();
                    let deadline = config.op_timeout * 2 + FINISH_SLACK;
                    let reporter =
                        Reporter::new(config, shared, kick, control_rx, memory, first_tx);
                    let (outcome, signal) = runtime.block_on(run_until_stop_signal(
                        reporter.run(),
                        stop_signals,
                        &control,
                        deadline,
                        &task_id,
                    ));
                    if let Some(signal) = signal {
                        match &outcome {
                            Ok(()) => tracing::info!(task = %task_id, signal,
                                "task finished; ending the process as the signal does"),
                            Err(reason) => tracing::warn!(task = %task_id, signal, %reason,
                                "could not finish the task; ending the process as the signal does"),
                        }
                        end_process(signal);
                    }
                    let _ = done_tx.send(outcome);
                })
                .map_err(AgentError::Spawn)?
        };
        let agent = Agent {
            config,
            shared,
            kick,
            control,
            done: Mutex::new(Some(done_rx)),
            thread: Some(thread),
        };
        Ok((agent, first_rx))
    }

    /// Decides what the first registration's outcome means for `connect`.
    fn settle(
        self,
        first: std::result::Result<Result<(), StateError>, RecvTimeoutError>,
    ) -> Result<Agent> {
        match first {
            Ok(Ok(())) => Ok(self),
            Ok(Err(err))
                if matches!(
                    err,
                    StateError::InvalidUrl { .. }
                        | StateError::Embedded { .. }
                        | StateError::InvalidId { .. }
                        | StateError::InvalidTtl(_)
                ) =>
            {
                Err(AgentError::Store(err))
            }
            Ok(Err(err)) => {
                tracing::warn!(task = %self.config.task_id, %err,
                    "state store unreachable at start; training goes on, the agent keeps retrying");
                Ok(self)
            }
            Err(_) => {
                tracing::warn!(task = %self.config.task_id, timeout = ?self.config.connect_timeout,
                    "not registered yet; training goes on, the agent keeps trying");
                Ok(self)
            }
        }
    }

    /// Starts the agent from a synchronous program.
    ///
    /// Waits until the task is registered (spec, lease, alive key, assignment
    /// watch), at most the connect timeout. An unreachable store is *not* an
    /// error: training can start and the agent registers when the store answers.
    /// Errors are only for what retrying cannot fix: bad configuration, a
    /// malformed URL, an embedded store file that cannot be opened.
    pub fn connect_with(builder: AgentBuilder) -> Result<Agent> {
        let (agent, first) = Agent::start(builder)?;
        let first = first.recv_timeout(agent.config.connect_timeout);
        agent.settle(first)
    }

    /// [`Agent::connect_with`] for async code: waits without blocking the runtime.
    pub async fn connect_async_with(builder: AgentBuilder) -> Result<Agent> {
        let (agent, first) = Agent::start(builder)?;
        let timeout = agent.config.connect_timeout;
        let first = tokio::task::spawn_blocking(move || first.recv_timeout(timeout))
            .await
            .unwrap_or(Err(RecvTimeoutError::Disconnected));
        agent.settle(first)
    }

    /// The batch size to train the next step at. One relaxed atomic load.
    #[inline]
    pub fn batch_size(&self) -> u32 {
        self.shared.batch_size()
    }

    /// Records one finished step: its batch size and wall time. Three relaxed
    /// atomic additions; no I/O, no allocation, no lock.
    #[inline]
    pub fn record_step(&self, batch_size: u32, elapsed: Duration) {
        self.shared.record_step(batch_size, elapsed);
    }

    /// Records the squared gradient norms over `small` and `big` samples of the
    /// same step (b < B, e.g. one micro-batch and the accumulated batch) for the
    /// gradient noise scale. Invalid pairs are ignored with a debug log.
    pub fn record_gradient_norms(
        &self,
        small: u32,
        small_sq_norm: f64,
        big: u32,
        big_sq_norm: f64,
    ) {
        let result = self
            .shared
            .gns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .record(small, small_sq_norm, big, big_sq_norm);
        if let Err(why) = result {
            tracing::debug!(small, big, ?why, "gradient norms ignored");
        }
    }

    /// Records the peak GPU memory the trainer measured itself, in MiB (e.g. from
    /// `torch.cuda.max_memory_reserved()` since the last batch-size change), for a
    /// job whose memory NVML cannot see: the tuner needs it to grow the batch size.
    /// One relaxed atomic maximum; the reporter sends the largest value recorded
    /// between two reports, once a step at the current batch size has been recorded
    /// (a figure from before it is not a training step's peak). When NVML sees this
    /// process, its figure is used instead.
    #[inline]
    pub fn record_peak_memory(&self, mib: u64) {
        self.shared.record_peak(mib);
    }

    /// A batch-size change to apply before the next step, if the tuner sent one.
    ///
    /// The agent's batch size switches here, not behind the loop's back, so the
    /// data loader, the learning rate and the reported measurements all change at
    /// the same step boundary. Costs one relaxed load when nothing is pending.
    ///
    /// After an eviction, the next call returns a change with
    /// [`ChangeReason::Evicted`] (once; the batch size is unchanged), whatever else is
    /// pending: checkpoint, then [`Agent::leave`].
    pub fn poll_change(&self) -> Option<BatchSizeChange> {
        if self.shared.take_evict_notice() {
            return Some(BatchSizeChange {
                batch_size: self.shared.batch_size(),
                lr_factor: self.shared.lr_factor(),
                round: self.shared.round(),
                reason: ChangeReason::Evicted,
                memory_bound_mib: None,
            });
        }
        let change = self.shared.take_pending()?;
        let previous = self.shared.batch_size();
        self.shared.apply(&change);
        // An assignment may keep the size (the placer's starting one, a tuner round that
        // holds it); "batch size changed from=64 to=64" read as a bug to a new user.
        let what = if previous == change.batch_size {
            "assignment applied; batch size unchanged"
        } else {
            "batch size changed"
        };
        tracing::info!(task = %self.config.task_id, from = previous, to = change.batch_size,
            lr_factor = change.lr_factor, round = change.round, "{what}");
        Some(change)
    }

    /// The trainer ran out of GPU memory at `batch_size`: falls back to the largest
    /// batch size below it that ran and whose measured peak leaves the card's memory
    /// margin free (the margin the placer and the tuner keep; the card's size comes from
    /// the device's record), else the largest below it that ran, else half of it (within
    /// the bounds); tells the tuner at once, and returns the change to apply.
    pub fn report_oom(&self, batch_size: u32) -> BatchSizeChange {
        let c = &self.config;
        let fallback = match self.shared.fallback(batch_size, &MemoryMargin::DEFAULT) {
            Some(fit) => fit,
            None => c.clamp(batch_size / 2),
        };
        self.shared.mark_oom(batch_size);
        let phi = self.shared.noise_scale();
        let change = BatchSizeChange {
            batch_size: fallback,
            lr_factor: lr_factor(c.lr_rule, c.initial_batch_size, fallback, phi),
            round: self.shared.round(),
            reason: ChangeReason::OutOfMemory,
            memory_bound_mib: None,
        };
        self.shared.apply(&change);
        if fallback >= batch_size {
            tracing::error!(task = %c.task_id, oom_at = batch_size, min = c.min_batch_size,
                "out of GPU memory at the smallest allowed batch size; the task does not fit here");
        } else {
            tracing::warn!(task = %c.task_id, oom_at = batch_size, fallback, "out of GPU memory; falling back");
        }
        self.kick.notify_one();
        change
    }

    /// The GPU memory this task is counted at now, MiB: the latest of the memory its
    /// placement reserved (as first seen, and whenever the placer rewrites it) and the
    /// memory bound of each applied assignment that carries one (it moves at
    /// [`Agent::poll_change`], with the batch size); `None` when neither is known (no
    /// placer, or not registered yet).
    pub fn memory_limit_mib(&self) -> Option<u64> {
        self.shared.memory_limit_mib()
    }

    /// What a trainer caps its own allocator at (the Python agent's memory fence), MiB:
    /// [`Agent::memory_limit_mib`] plus the margin's fraction of it
    /// ([`iadeep_objective::MemoryMargin::fence_mib`], which the card keeps free for every
    /// task's run-to-run variation), so outgrowing it fails in the task's own process,
    /// never in a co-runner's.
    pub fn memory_fence_mib(&self) -> Option<u64> {
        self.memory_limit_mib()
            .map(|mib| iadeep_objective::MemoryMargin::DEFAULT.fence_mib(mib as f64))
    }

    /// Why the placer evicted the task, once its evict assignment reached the agent
    /// (`None` until then). The agent keeps the task's lease and reports meanwhile, so
    /// its reservation stays counted while the job checkpoints; the job then ends the
    /// agent with [`Agent::leave`] (a final report, not finished, and the lease revoked),
    /// and its launcher releases the placement when the process exits. The agent never
    /// releases the placement itself: the process holds its GPU memory until it exits.
    pub fn evicted(&self) -> Option<String> {
        self.shared.evicted()
    }

    /// The learning-rate factor of the current batch size (1 until a change).
    pub fn lr_factor(&self) -> f64 {
        self.shared.lr_factor()
    }

    /// The tuner round the loop currently trains under (0 before any assignment).
    pub fn round(&self) -> u64 {
        self.shared.round()
    }

    /// The task id.
    pub fn task_id(&self) -> &str {
        &self.config.task_id
    }

    /// Whether the task is registered with a live lease right now.
    pub fn is_registered(&self) -> bool {
        self.shared.registered.load(Ordering::Relaxed)
    }

    /// Reports stored so far.
    pub fn reports_published(&self) -> u64 {
        self.shared.reports_published.load(Ordering::Relaxed)
    }

    /// Asks the reporter to publish a report now (e.g. at the end of an epoch).
    pub fn report_now(&self) {
        self.kick.notify_one();
    }

    fn stop(&mut self, mode: Control) -> Outcome {
        self.control.send_replace(mode);
        let wait = self.config.op_timeout * 2 + FINISH_SLACK;
        let done = self
            .done
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let outcome = match done.map(|rx| rx.recv_timeout(wait)) {
            Some(Ok(outcome)) => outcome,
            Some(Err(_)) => Err(format!("the reporter did not stop within {wait:?}")),
            None => Ok(()),
        };
        if outcome.is_ok()
            && let Some(thread) = self.thread.take()
        {
            let _ = thread.join();
        }
        outcome
    }

    /// Marks the task finished (a final report with `finished = true`) and
    /// revokes the lease, so the device frees at once. If the store cannot be
    /// reached, the error says so and the lease expires by itself.
    ///
    /// After an eviction ([`Agent::evicted`]) call [`Agent::leave`] instead, unless the
    /// job's work is done: a finished report tells `iadeep run` not to start it again.
    pub fn finish(mut self) -> Result<()> {
        let timeout = self.config.op_timeout * 2 + FINISH_SLACK;
        self.stop(Control::Finish)
            .map_err(|reason| AgentError::FinishIncomplete { timeout, reason })
    }

    /// Ends the agent without claiming the task finished: a final report with
    /// `finished = false`, then the lease revoked, so the placer's reaper sees the task
    /// gone. What a loop does after an eviction, once its checkpoint is written (its
    /// launcher releases the placement and, with `--requeue-on-evict`, places the job
    /// again). Dropping the agent does the same, without the outcome.
    pub fn leave(mut self) -> Result<()> {
        let timeout = self.config.op_timeout * 2 + FINISH_SLACK;
        self.stop(Control::Abandon)
            .map_err(|reason| AgentError::LeaveIncomplete { timeout, reason })
    }

    /// [`Agent::finish`] for async code.
    pub async fn finish_async(self) -> Result<()> {
        tokio::task::spawn_blocking(move || self.finish())
            .await
            .unwrap_or_else(|err| {
                Err(AgentError::FinishIncomplete {
                    timeout: Duration::ZERO,
                    reason: err.to_string(),
                })
            })
    }
}

impl AgentBuilder {
    /// Validates the configuration and starts the agent (see [`Agent::connect_with`]).
    pub fn connect(self) -> Result<Agent> {
        Agent::connect_with(self)
    }

    /// Async variant of [`AgentBuilder::connect`].
    pub async fn connect_async(self) -> Result<Agent> {
        Agent::connect_async_with(self).await
    }
}

impl Drop for Agent {
    /// Dropped without `finish()` (an error path, a panic): revoke the lease so
    /// the device frees, but do not claim the task finished.
    fn drop(&mut self) {
        if self.thread.is_some()
            && let Err(reason) = self.stop(Control::Abandon)
        {
            tracing::warn!(task = %self.config.task_id, %reason, "agent dropped; lease left to expire");
        }
    }
}

#[cfg(test)]
mod tests;
