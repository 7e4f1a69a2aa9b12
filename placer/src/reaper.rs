//! Gives back what tasks hold after their agent is gone without a Release, or never came.
//!
//! A task's agent holds the lease of `tasks/{task}/alive`; when the process dies
//! (crash, node loss, a killed pod) the lease expires and etcd deletes the key, but
//! nobody calls Release, so the task's reservation and placement would block the
//! device forever. The daemon's reaper looks every `grace / 4` (bounded to
//! 0.1–10 s) for resident tasks without an `alive` key whose agent had run (see
//! [`crate::view::ClusterView::dead_residents`]) and releases those gone for at
//! least `grace` — long enough for a restarted agent to re-create its key and keep
//! its device. A task whose last report said it finished is released at once: its
//! agent has no reason to come back.
//!
//! A task can also be placed and never start (the job was never launched, its pod
//! never got to run): no `alive` key ever appears, so no lease ever expires for it.
//! With an `unstarted` grace, the reaper releases a resident task with no `alive` key
//! and no report seen that was placed at least that long ago (see
//! [`crate::view::ClusterView::unstarted_residents`]). That grace must cover the
//! slowest legitimate start (image pulls, data staging), so it is separate from the
//! dead-task grace and much longer by default.
//!
//! Each tick also gives a reservation back to tasks whose agent runs without one (they
//! were released while it ran; see
//! [`crate::service::PlacementService::readmit_running`]), or reports them; and once
//! the agent of a job that ran without ever being placed has been gone for the
//! dead-task grace, it archives what the task left under `tasks/` with a release marker,
//! so the retention deletes it like a released task's (see
//! [`crate::service::PlacementService::archive_dead_unreserved`]). A task released while
//! its agent ran has its marker already: the retention deletes what the agent wrote
//! after the Release.
//!
//! The reaper also deletes the keys of released tasks once their retention is over
//! (see [`crate::retention`]), so that there is one loop that cleans up after tasks,
//! and compacts the store's history (see [`crate::compaction`]).

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::service::PlacementService;
use crate::{compaction, retention};

/// The grace periods the reaper applies; `None` turns that check off.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Graces {
    /// How long a task's agent may be gone before its reservation is released.
    pub dead: Option<Duration>,
    /// How long after placement a task whose agent never appeared keeps its reservation.
    pub unstarted: Option<Duration>,
}

/// How often provisional reservations whose task has reported its peak are settled
/// ([`PlacementService::settle_provisional`]); a pass over the view with nothing to
/// settle costs no store request.
pub const SETTLE_PERIOD: Duration = Duration::from_secs(1);

/// How often the reaper looks, for a given grace period.
pub fn tick_for(grace: Duration) -> Duration {
    (grace / 4).clamp(Duration::from_millis(100), Duration::from_secs(10))
}

/// Runs the reaper until `stop` turns true (or its sender is dropped): the graces'
/// releases, and the retention of released tasks when the service's parameters set
/// one (see [`crate::retention`]).
pub fn spawn(
    service: PlacementService,
    graces: Graces,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<crate::Result<()>> {
    tokio::spawn(async move {
        let period = [graces.dead, graces.unstarted]
            .into_iter()
            .flatten()
            .map(tick_for)
            .min()
            .unwrap_or(Duration::from_secs(10));
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let params = service.placer().params();
        let (retention, retention_batch) = (params.task_retention, params.retention_batch);
        // Without a retention the sweep never comes due (its branch is disabled).
        let mut sweep_tick =
            tokio::time::interval(retention.map_or(Duration::from_secs(3600), retention::tick_for));
        sweep_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Where the next retention pass goes on: a pass that deleted its batch stops
        // there, and the next one runs at once, until the backlog is gone.
        let mut sweep_from: Option<String> = None;
        // Without a period the compaction never comes due (its branch is disabled).
        let compact_every = params.compact_every;
        let mut compactor = compaction::Compactor::new(params.compact_keep_revisions);
        let mut compact_tick =
            tokio::time::interval(compact_every.unwrap_or(Duration::from_secs(3600)));
        compact_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Provisional reservations are settled within a second of the task's first
        // measured peak: tasks waiting for room ask again within seconds.
        let mut settle_tick = tokio::time::interval(SETTLE_PERIOD);
        settle_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(
            dead_grace_s = graces.dead.map(|g| g.as_secs_f64()),
            unstarted_grace_s = graces.unstarted.map(|g| g.as_secs_f64()),
            task_retention_s = retention.map(|r| r.as_secs_f64()),
            "releasing the reservations of dead and never-started tasks, deleting released ones after their retention"
        );
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if let Some(grace) = graces.dead {
                        service.release_dead(grace).await;
                        service.archive_dead_unreserved(grace).await;
                    }
                    if let Some(grace) = graces.unstarted {
                        service.release_unstarted(grace).await;
                    }
                    service.readmit_running().await;
                }
                _ = settle_tick.tick() => {
                    service.settle_provisional().await;
                }
                _ = sweep_tick.tick(), if retention.is_some() => {
                    let retention = retention.unwrap_or_default();
                    match retention::sweep(&service, retention, retention_batch, sweep_from.take()).await {
                        Ok(swept) => {
                            sweep_from = swept.resume_after;
                            if sweep_from.is_some() {
                                sweep_tick.reset_immediately();
                            }
                        }
                        Err(err) => tracing::warn!(%err, "cannot delete released tasks past their retention; retrying later"),
                    }
                }
                _ = compact_tick.tick(), if compact_every.is_some() => {
                    if let Err(err) = compactor.tick(service.store().as_ref()).await {
                        tracing::warn!(%err, "cannot compact the store's history; retrying later");
                    }
                }
                changed = stop.changed() => {
                    if changed.is_err() || *stop.borrow() {
                        return Ok(());
                    }
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_a_quarter_of_the_grace_within_bounds() {
        assert_eq!(tick_for(Duration::from_secs(60)), Duration::from_secs(10));
        assert_eq!(tick_for(Duration::from_secs(8)), Duration::from_secs(2));
        assert_eq!(tick_for(Duration::ZERO), Duration::from_millis(100));
        assert_eq!(tick_for(Duration::from_secs(3600)), Duration::from_secs(10));
    }
}
