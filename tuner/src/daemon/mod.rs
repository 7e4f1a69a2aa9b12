//! The tuner daemon: one per GPU, driving the device's [`DeviceTuner`] over the state store.
//!
//! - [`device`]: what the card is (NVML or flags);
//! - [`ownership`]: one tuner per device (a lease-bound owner key taken in a transaction)
//!   and its `DeviceInfo` record kept published under that lease;
//! - [`tasks`]: range-then-watch folds of the tasks and of the device's reservations;
//! - `driver.rs`: the store's changes in as the tuner's inputs, its actions out (assignment
//!   rounds in one transaction, samples, persisted state);
//! - [`metrics`]: Prometheus text metrics.
//!
//! Every decision is the [`DeviceTuner`]'s (`crate::device_tuner`), the same state machine
//! the simulator drives in virtual time.

pub mod device;
mod driver;
pub mod metrics;
pub mod ownership;
pub mod tasks;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use iadeep_proto::DeviceInfo;
use iadeep_state::{StateStore, keys};
use tokio::sync::{mpsc, watch};

use crate::device_tuner::{DeviceTuner, DeviceTunerParams};
use crate::error::{Result, TunerError};
pub use device::DeviceFlags;
pub use driver::JournalEntry;
pub use metrics::Metrics;

/// Everything that tunes the daemon's behaviour (not the device's identity).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DaemonParams {
    /// The device tuner's parameters (the simulator uses the same defaults).
    pub tuner: DeviceTunerParams,
    /// TTL of the device record's lease.
    pub lease_ttl: Duration,
    /// Newest co-location samples of the device kept in the store: writing sample `seq`
    /// deletes sample `seq - samples_kept` in the same transaction, so the samples stay
    /// bounded. The placer's predictor learns from each sample as it is written (a
    /// window of the newest 512 and a reservoir of 512 older ones, see
    /// `iadeep_predictor::Learner`); the ones kept are what a restarted placer retrains on.
    pub samples_kept: u64,
}

/// Default of [`DaemonParams::samples_kept`]: several times the predictor's window.
pub const DEFAULT_SAMPLES_KEPT: u64 = 4096;

impl Default for DaemonParams {
    fn default() -> Self {
        DaemonParams {
            tuner: DeviceTunerParams::default(),
            lease_ttl: Duration::from_secs(10),
            samples_kept: DEFAULT_SAMPLES_KEPT,
        }
    }
}

impl DaemonParams {
    /// Validates every part.
    pub fn check(&self) -> Result<()> {
        self.tuner.check()?;
        if self.lease_ttl < iadeep_state::MIN_LEASE_TTL {
            return Err(TunerError::InvalidParams(
                "the lease TTL must be at least 1 s".to_owned(),
            ));
        }
        if self.samples_kept == 0 {
            return Err(TunerError::InvalidParams(
                "samples_kept must be at least 1 (the newest sample)".to_owned(),
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
    journal: Option<mpsc::UnboundedSender<JournalEntry>>,
}

/// Aborts the background tasks when the daemon's future ends or is dropped (aborted), so a
/// killed daemon never leaves a watch or a registration behind.
struct AbortOnDrop(Vec<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
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
            journal: None,
        })
    }

    /// Sends every step of the device tuner (its inputs, the time, its actions) to
    /// `journal`: to see why the tuner did what it did, or to replay a run offline.
    pub fn with_journal(mut self, journal: mpsc::UnboundedSender<JournalEntry>) -> Daemon {
        self.journal = Some(journal);
        self
    }

    /// The metrics the daemon updates (serve them with [`metrics::serve`]).
    pub fn metrics(&self) -> Arc<Metrics> {
        self.metrics.clone()
    }

    /// Takes the device (refusing, after one lease TTL, while another live tuner owns it;
    /// see [`ownership`]), follows its tasks and tunes them until `shutdown` resolves (then
    /// the tuner's state is saved and the device given up: its lease revoked, its record
    /// gone) or the future is dropped (then the lease expires by itself). Returns early
    /// only on an error it cannot ride out: the device is owned or taken by another tuner,
    /// or the persisted state cannot be read (resuming wrongly is worse than not starting).
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<()> {
        let Daemon {
            store,
            info,
            params,
            metrics,
            journal,
        } = self;
        let owned = ownership::take(store.as_ref(), &info, params.lease_ttl).await?;
        let (current, owned_now) = watch::channel(owned);
        let keeper = ownership::spawn_keeper(
            store.clone(),
            info.clone(),
            params.lease_ttl,
            owned,
            current,
        );
        let result = Self::tune(&store, &info, params, &metrics, journal, keeper, shutdown).await;
        let owned = *owned_now.borrow();
        ownership::release(store.as_ref(), &info.device_id, owned).await;
        result
    }

    /// Runs the driver while this tuner owns the device.
    async fn tune(
        store: &Arc<dyn StateStore>,
        info: &DeviceInfo,
        params: DaemonParams,
        metrics: &Arc<Metrics>,
        journal: Option<mpsc::UnboundedSender<JournalEntry>>,
        mut keeper: tokio::task::JoinHandle<TunerError>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<()> {
        let (tasks_rx, tasks_watch) =
            tasks::spawn_watcher::<tasks::TaskTable>(store.clone(), keys::TASKS.to_owned());
        let (residents_rx, residents_watch) = tasks::spawn_watcher::<tasks::ResidentsRecord>(
            store.clone(),
            keys::device_residents(&info.device_id),
        );
        let _background = AbortOnDrop(vec![
            keeper.abort_handle(),
            tasks_watch.abort_handle(),
            residents_watch.abort_handle(),
        ]);
        let driver = driver::Driver::new(
            store.clone(),
            info.clone(),
            tasks_rx,
            residents_rx,
            metrics.clone(),
            journal,
            params.samples_kept,
        );
        let tuner: DeviceTuner = driver.tuner(params.tuner).await?;
        let (stop_tx, stop_rx) = watch::channel(false);
        let running = driver.run(tuner, stop_rx);
        tokio::pin!(running);
        tokio::pin!(shutdown);
        let (result, taken) = tokio::select! {
            result = &mut running => (result, None),
            () = &mut shutdown => {
                tracing::info!(device = %info.device_id, "shutting down");
                let _ = stop_tx.send(true);
                (running.await, None)
            }
            ended = &mut keeper => {
                let err = ended.unwrap_or_else(|join| {
                    TunerError::Daemon(format!("the device's ownership task failed: {join}"))
                });
                let _ = stop_tx.send(true);
                (running.await, Some(err))
            }
        };
        if let Some(err) = taken {
            // Another tuner tunes the device now: its state is not ours to overwrite.
            return Err(err);
        }
        let tuner = result?;
        let state = tuner.persisted(iadeep_proto::now_unix_ms());
        driver::save(store.as_ref(), &info.device_id, &state, metrics).await;
        Ok(())
    }
}
