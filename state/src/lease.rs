//! Keeping a lease alive in the background.
//!
//! Agents and tuners hold a lease while they run so that their keys vanish when
//! they crash. [`LeaseKeeper`] refreshes it at a third of its TTL, rides out
//! transient store errors (retrying a failed refresh after a short pause), and tells its owner when the lease is gone so the
//! owner can grant a new one and re-publish its keys.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::StateError;
use crate::store::{LeaseId, StateStore};

/// Pause before retrying a keep-alive that failed (the store already retried
/// inside the call, e.g. across etcd members, before giving up).
const RETRY_PAUSE: Duration = Duration::from_millis(250);

/// What the keeper knows about its lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseHealth {
    /// The last keep-alive succeeded.
    Alive,
    /// Keep-alives are failing (store unreachable); the lease may still be alive.
    Unconfirmed,
    /// The store said the lease no longer exists. The keeper has stopped.
    Lost,
}

/// Refreshes one lease until dropped, revoked or lost.
#[derive(Debug)]
pub struct LeaseKeeper {
    lease: LeaseId,
    health: watch::Receiver<LeaseHealth>,
    task: JoinHandle<()>,
}

impl LeaseKeeper {
    /// Starts refreshing `lease` (granted with `ttl`) on the current tokio runtime.
    pub fn spawn(store: Arc<dyn StateStore>, lease: LeaseId, ttl: Duration) -> LeaseKeeper {
        let (tx, health) = watch::channel(LeaseHealth::Alive);
        let period = (ttl / 3).max(Duration::from_millis(200));
        let retry = RETRY_PAUSE.min(period);
        let task = tokio::spawn(async move {
            let mut wait = period;
            loop {
                tokio::time::sleep(wait).await;
                let next = match store.keep_alive(lease).await {
                    Ok(_) => LeaseHealth::Alive,
                    Err(StateError::LeaseNotFound(_)) => LeaseHealth::Lost,
                    Err(err) => {
                        tracing::warn!(%lease, %err, "lease keep-alive failed; will retry");
                        LeaseHealth::Unconfirmed
                    }
                };
                tx.send_replace(next);
                if next == LeaseHealth::Lost {
                    tracing::warn!(%lease, "lease lost (expired); its keys are gone");
                    return;
                }
                // A failed refresh is retried soon, not a whole period later: the
                // lease keeps running down meanwhile.
                wait = if next == LeaseHealth::Alive {
                    period
                } else {
                    retry
                };
            }
        });
        LeaseKeeper {
            lease,
            health,
            task,
        }
    }

    /// The lease being kept.
    pub fn lease(&self) -> LeaseId {
        self.lease
    }

    /// The current health.
    pub fn health(&self) -> LeaseHealth {
        *self.health.borrow()
    }

    /// Resolves once the lease is lost.
    pub async fn lost(&mut self) {
        // An error means the keeper task ended, which only happens once the lease is lost.
        let _ = self.health.wait_for(|h| *h == LeaseHealth::Lost).await;
    }

    /// Stops refreshing without revoking (the lease then expires after its TTL).
    pub fn stop(self) {
        self.task.abort();
    }
}

impl Drop for LeaseKeeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}
