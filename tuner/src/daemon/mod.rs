//! The tuner daemon: one per GPU, closing the loop between GP-LCB and the training jobs.
//!
//! - [`device`]: what the card is (NVML or flags) and its leased `DeviceInfo` record;
//! - [`tasks`]: range-then-watch over the tasks, picking the residents of this device;
//! - [`knowledge`]: memory samples, out-of-memory sizes and solo step times per task, and the
//!   candidate sizes and memory bounds that follow;
//! - [`round`]: one round over the store as a [`crate::search::Evaluator`] (assign, wait for
//!   fresh reports, Σ PD, co-location samples);
//! - [`persist`]: the state a restarted tuner resumes from;
//! - [`metrics`]: Prometheus text metrics;
//! - [`control`]: the loop tying them to the [`crate::search::Controller`].

pub mod control;
pub mod device;
pub mod knowledge;
pub mod metrics;
pub mod persist;
pub mod round;
pub mod tasks;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use iadeep_proto::DeviceInfo;
use iadeep_state::{StateStore, keys};

use crate::error::{Result, TunerError};
use crate::memory::MemoryModelParams;
use crate::search::{ControllerParams, LcbParams};
pub use device::DeviceFlags;
pub use metrics::Metrics;
pub use round::RoundParams;

/// Everything that tunes the daemon's behaviour (not the device's identity).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DaemonParams {
    pub round: RoundParams,
    /// Fraction of the card kept free when summing memory upper bounds.
    pub memory_margin: f64,
    /// Once settled, re-measure the running configuration this often (drift detection).
    pub settled_interval: Duration,
    /// How long to wait between looks when there is nothing to tune.
    pub idle_poll: Duration,
    /// TTL of the device record's lease.
    pub lease_ttl: Duration,
    pub lcb: LcbParams,
    pub controller: ControllerParams,
    pub memory: MemoryModelParams,
    /// Seed of the search's sampling (reproducible runs).
    pub seed: u64,
}

impl Default for DaemonParams {
    /// Rounds wait up to 30 s for two reports per task (agents report every 2 s by default);
    /// 10% of the card stays free (allocator fragmentation and workspaces the memory model
    /// does not see); a settled configuration is re-measured every minute.
    fn default() -> Self {
        DaemonParams {
            round: RoundParams {
                timeout: Duration::from_secs(30),
                reports_per_round: 2,
            },
            memory_margin: 0.10,
            settled_interval: Duration::from_secs(60),
            idle_poll: Duration::from_secs(1),
            lease_ttl: Duration::from_secs(10),
            lcb: LcbParams::default(),
            controller: ControllerParams::default(),
            memory: MemoryModelParams::default(),
            seed: 0,
        }
    }
}

impl DaemonParams {
    /// Validates every part.
    pub fn check(&self) -> Result<()> {
        self.round.check()?;
        self.lcb.check()?;
        self.memory.check()?;
        if !(0.0..1.0).contains(&self.memory_margin) {
            return Err(TunerError::InvalidParams(format!(
                "memory margin must be in [0, 1), got {}",
                self.memory_margin
            )));
        }
        if self.idle_poll.is_zero() || self.lease_ttl < iadeep_state::store::MIN_LEASE_TTL {
            return Err(TunerError::InvalidParams(
                "idle poll must be positive and the lease TTL at least 1 s".to_owned(),
            ));
        }
        Ok(())
    }
}

/// A tuner daemon for one registered device.
#[derive(Debug)]
pub struct Daemon {
    store: Arc<dyn StateStore>,
    info: DeviceInfo,
    params: DaemonParams,
    metrics: Arc<Metrics>,
}

/// Stops the control loop and the background tasks when the daemon's future ends or is
/// dropped (aborted), so a killed daemon never leaves a loop assigning batch sizes behind.
struct StopGuard {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for StopGuard {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Daemon {
    /// A daemon for the device `info` (see [`device::describe`]).
    pub fn new(
        store: Arc<dyn StateStore>,
        info: DeviceInfo,
        params: DaemonParams,
    ) -> Result<Daemon> {
        params.check()?;
        keys::validate_id("device", &info.device_id)?;
        if info.memory_mib == 0 {
            return Err(TunerError::Daemon(format!(
                "device {} has no memory size",
                info.device_id
            )));
        }
        Ok(Daemon {
            store,
            info,
            params,
            metrics: Arc::new(Metrics::default()),
        })
    }

    /// The metrics the daemon updates (serve them with [`metrics::serve`]).
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Registers the device, follows its tasks and tunes them until `shutdown` resolves
    /// (then the device record is deleted) or the future is dropped (then the record's lease
    /// expires by itself). Returns early only on an error the loop cannot ride out.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<()> {
        let Daemon {
            store,
            info,
            params,
            metrics,
        } = self;
        let registration =
            device::spawn_registration(store.clone(), info.clone(), params.lease_ttl);
        let (tasks_rx, watcher) = tasks::spawn_watcher(store.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let guard = StopGuard {
            stop: stop.clone(),
            tasks: vec![registration, watcher],
        };
        let control = control::ControlLoop::new(
            tokio::runtime::Handle::current(),
            store.clone(),
            tasks_rx,
            &info,
            params,
            stop.clone(),
            metrics,
        );
        let mut blocking = tokio::task::spawn_blocking(move || control.run());
        tokio::pin!(shutdown);
        let result = tokio::select! {
            joined = &mut blocking => joined,
            () = &mut shutdown => {
                tracing::info!(device = %info.device_id, "shutting down");
                stop.store(true, Ordering::Relaxed);
                blocking.await
            }
        };
        drop(guard);
        let result = result
            .map_err(|e| TunerError::Daemon(format!("control loop panicked or was cancelled: {e}")))
            .and_then(|r| r);
        if let Err(err) = store.delete(&keys::device_info(&info.device_id)).await {
            tracing::warn!(%err, "cannot delete the device record; its lease will expire");
        }
        result
    }
}
