//! Gives back what tasks hold after their agent is gone without a Release.
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

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::service::PlacementService;

/// How often the reaper looks, for a given grace period.
pub fn tick_for(grace: Duration) -> Duration {
    (grace / 4).clamp(Duration::from_millis(100), Duration::from_secs(10))
}

/// Runs the reaper until `stop` turns true (or its sender is dropped).
pub fn spawn(
    service: PlacementService,
    grace: Duration,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<crate::Result<()>> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(tick_for(grace));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(
            grace_s = grace.as_secs_f64(),
            "releasing the reservations of dead tasks"
        );
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    service.release_dead(grace).await;
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
