//! Deletes what released tasks leave in the store once their retention is over.
//!
//! A Release deletes the task's placement and gives its memory back, but keeps its
//! spec, its last report and its assignment, so an operator can still read a finished
//! job (`iadeep state get /iadeep/v1/tasks/ID/...`). Without an end to that, the store
//! grows with every job ever run. So the Release transaction also writes a marker,
//! `/iadeep/v1/released/{task}`, holding the release time (see
//! [`iadeep_state::keys::task_released`]); a Place of the same id deletes it in its
//! own transaction (the keys are the new task's then). The reaper calls [`sweep`]
//! every [`tick_for`] and it deletes, in one transaction per task, the task's keys and
//! its marker, for markers older than the retention — iff, at that revision:
//!
//! - the marker is the one read (its mod revision): the id was not re-placed and
//!   released again meanwhile, which would restart its retention;
//! - the task has no placement: it was not placed again;
//! - the task has no `alive` key: its agent does not run (a task released while its
//!   agent still runs is kept; see [`crate::service::PlacementService::readmit_running`]).
//!
//! A pass reads only the markers (their prefix is apart from the tasks') and deletes
//! at most [`crate::PlacerParams::retention_batch`] tasks, the oldest first, so a
//! backlog is worked off over several passes.

use std::time::Duration;

use iadeep_state::keys::{self, KeyKind};
use iadeep_state::{Expect, Txn, TxnOutcome, typed};

use crate::error::Result;
use crate::events::PlacementEvent;
use crate::service::PlacementService;

/// What one [`sweep`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Tasks whose keys were deleted, oldest release first.
    pub deleted: Vec<String>,
    /// Tasks past their retention left alone because their agent still runs.
    pub running: usize,
    /// Tasks past their retention left for a later pass (the batch was full).
    pub deferred: usize,
}

/// How often the reaper sweeps for a given retention: a quarter of it, between 1 s
/// and a minute (reading the markers costs one range over them).
pub fn tick_for(retention: Duration) -> Duration {
    (retention / 4).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// Deletes the keys of at most `batch` tasks released at least `retention` ago (by the
/// service's clock), the oldest first.
pub async fn sweep(service: &PlacementService, retention: Duration, batch: usize) -> Result<Swept> {
    let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    let now = service.now_unix_ms();
    let snapshot = service.store().range(keys::RELEASED).await?;
    let mut due = Vec::new();
    for kv in snapshot.kvs {
        let KeyKind::TaskReleased { task } = KeyKind::parse(&kv.key) else {
            continue;
        };
        match typed::decode_released_at(&kv.key, &kv.value) {
            Ok(released_at) if released_at.saturating_add(retention_ms) <= now => {
                due.push((released_at, task, kv.mod_revision));
            }
            Ok(_) => {}
            Err(err) => {
                service.record(PlacementEvent::DecodeError);
                tracing::warn!(%err, "release marker does not decode; task kept until it is fixed or deleted");
            }
        }
    }
    due.sort();
    let mut swept = Swept::default();
    for (released_at, task, marker_revision) in due {
        if service.view().agent_alive(&task) {
            swept.running += 1;
            continue;
        }
        if swept.deleted.len() >= batch {
            swept.deferred += 1;
            continue;
        }
        let marker = keys::task_released(&task);
        let txn = Txn::new()
            .compare(marker.as_str(), Expect::ModRevision(marker_revision))
            .compare(keys::task_placement(&task), Expect::Absent)
            .compare(keys::task_alive(&task), Expect::Absent)
            .delete(keys::task_spec(&task))
            .delete(keys::task_report(&task))
            .delete(keys::task_assignment(&task))
            .delete(marker);
        match service.store().transact(txn).await? {
            TxnOutcome::Committed { .. } => {
                service.record(PlacementEvent::RetentionDeleted);
                tracing::debug!(%task, released_s_ago = (now - released_at) / 1000,
                    "deleted a released task's keys after its retention");
                swept.deleted.push(task);
            }
            TxnOutcome::Failed { .. } => {
                tracing::debug!(%task,
                    "released task changed since the marker was read (placed again, released again or its agent runs); kept");
            }
        }
    }
    if !swept.deleted.is_empty() || swept.deferred > 0 {
        tracing::info!(
            deleted = swept.deleted.len(),
            deferred = swept.deferred,
            running = swept.running,
            "deleted the keys of released tasks past their retention"
        );
    }
    Ok(swept)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicI64, Ordering};

    use iadeep_proto::{SoloProfile, TaskSpec};
    use iadeep_state::{EmbeddedStore, StateStore};

    use super::*;
    use crate::service::Clock;

    const HOUR: Duration = Duration::from_secs(3600);

    fn spec(id: &str) -> TaskSpec {
        TaskSpec {
            task_id: id.into(),
            model: "resnet50".into(),
            initial_batch_size: 32,
            profile: Some(SoloProfile {
                batch_size: 32,
                step_time_s: Some(0.1),
                peak_mem_mib: Some(1_000),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    async fn task_keys(store: &dyn StateStore, id: &str) -> usize {
        store
            .range(&keys::task_prefix(id))
            .await
            .expect("range")
            .kvs
            .len()
    }

    fn world() -> (Arc<dyn StateStore>, Arc<AtomicI64>, PlacementService) {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let now = Arc::new(AtomicI64::new(1_700_000_000_000));
        let clock = {
            let now = now.clone();
            Clock::from_fn(move || now.load(Ordering::SeqCst))
        };
        let service = crate::service::tests::service(store.clone()).with_clock(clock);
        (store, now, service)
    }

    fn advance(now: &AtomicI64, by: Duration) {
        now.fetch_add(by.as_millis() as i64, Ordering::SeqCst);
    }

    #[tokio::test]
    async fn a_released_task_is_readable_until_its_retention_ends_then_gone() {
        let (store, now, service) = world();
        let events = Arc::new(crate::events::Recorded::default());
        let service = service.with_events(events.clone());
        service.place(spec("a"), vec![]).await.expect("place");
        assert_eq!(
            task_keys(store.as_ref(), "a").await,
            3,
            "spec, placement, assignment"
        );
        service.release("a").await.expect("release");
        assert_eq!(
            task_keys(store.as_ref(), "a").await,
            2,
            "spec and assignment kept"
        );
        assert!(
            store
                .get(&keys::task_released("a"))
                .await
                .expect("get")
                .is_some()
        );

        advance(&now, HOUR - Duration::from_secs(1));
        let early = sweep(&service, HOUR, 10).await.expect("sweep");
        assert!(early.deleted.is_empty(), "{early:?}");
        assert_eq!(task_keys(store.as_ref(), "a").await, 2, "still readable");

        advance(&now, Duration::from_secs(1));
        let due = sweep(&service, HOUR, 10).await.expect("sweep");
        assert_eq!(due.deleted, vec!["a".to_owned()]);
        assert_eq!(task_keys(store.as_ref(), "a").await, 0);
        assert!(
            store
                .get(&keys::task_released("a"))
                .await
                .expect("get")
                .is_none()
        );
        assert_eq!(events.count(PlacementEvent::RetentionDeleted), 1);
    }

    #[tokio::test]
    async fn a_re_used_id_and_a_running_agent_keep_their_keys() {
        let (store, now, service) = world();
        for id in ["reused", "running"] {
            service.place(spec(id), vec![]).await.expect("place");
            service.release(id).await.expect("release");
        }
        // The id is placed again: the new task's keys are not the old one's to delete.
        service
            .place(spec("reused"), vec![])
            .await
            .expect("place again");
        let marker = keys::task_released("reused");
        assert!(
            store.get(&marker).await.expect("get").is_none(),
            "Place deletes it"
        );
        // The other's agent still runs after the Release.
        store
            .put(&keys::task_alive("running"), b"pid 1".to_vec(), None)
            .await
            .expect("alive");
        advance(&now, 2 * HOUR);
        let swept = sweep(&service, HOUR, 10).await.expect("sweep");
        assert!(swept.deleted.is_empty(), "{swept:?}");
        assert_eq!(task_keys(store.as_ref(), "reused").await, 3);
        assert!(task_keys(store.as_ref(), "running").await >= 2);
    }

    #[tokio::test]
    async fn a_marker_rewritten_after_it_was_read_is_not_acted_on() {
        let (store, now, service) = world();
        service.place(spec("a"), vec![]).await.expect("place");
        service.release("a").await.expect("release");
        advance(&now, 2 * HOUR);
        // A second release (re-placed and released again by another placer) moves the
        // marker on between this placer's read and its delete: the comparison on the
        // marker's revision is what keeps the task. Emulated by a stale revision.
        let marker = keys::task_released("a");
        let read = store.get(&marker).await.expect("get").expect("marker");
        store
            .put(&marker, typed::encode_released_at(0), None)
            .await
            .expect("rewrite");
        let txn = Txn::new()
            .compare(marker.as_str(), Expect::ModRevision(read.mod_revision))
            .delete(keys::task_spec("a"));
        assert!(!store.transact(txn).await.expect("txn").committed());
        // Read afresh, the pass deletes it.
        let swept = sweep(&service, HOUR, 10).await.expect("sweep");
        assert_eq!(swept.deleted, vec!["a".to_owned()]);
    }

    #[tokio::test]
    async fn a_backlog_is_deleted_in_batches_oldest_first() {
        let (store, now, service) = world();
        for id in ["t0", "t1", "t2", "t3", "t4"] {
            service.place(spec(id), vec![]).await.expect("place");
            service.release(id).await.expect("release");
            advance(&now, Duration::from_secs(1));
        }
        advance(&now, HOUR);
        let first = sweep(&service, HOUR, 2).await.expect("sweep");
        assert_eq!(first.deleted, vec!["t0".to_owned(), "t1".to_owned()]);
        assert_eq!(first.deferred, 3);
        let second = sweep(&service, HOUR, 2).await.expect("sweep");
        assert_eq!(second.deleted, vec!["t2".to_owned(), "t3".to_owned()]);
        let third = sweep(&service, HOUR, 2).await.expect("sweep");
        assert_eq!(third.deleted, vec!["t4".to_owned()]);
        assert!(
            store
                .range(keys::TASKS)
                .await
                .expect("range")
                .kvs
                .is_empty()
        );
        assert!(
            store
                .range(keys::RELEASED)
                .await
                .expect("range")
                .kvs
                .is_empty()
        );
    }

    /// The reaper's loop sweeps by the service's clock (virtual here): with the clock
    /// past the default retention of a day, its first sweep (at once when it starts)
    /// deletes the released task's keys.
    #[tokio::test]
    async fn the_reaper_deletes_released_tasks_a_retention_after_their_release() {
        let (store, now, service) = world();
        let retention = service.placer().params().task_retention.expect("a default");
        assert_eq!(retention, crate::params::DEFAULT_TASK_RETENTION);
        service.place(spec("a"), vec![]).await.expect("place");
        service.release("a").await.expect("release");
        advance(&now, retention);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let reaper = crate::reaper::spawn(service.clone(), Default::default(), stopped);
        let mut polls = 0;
        while task_keys(store.as_ref(), "a").await > 0 {
            polls += 1;
            assert!(polls < 1_000, "the reaper did not sweep");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.send(true).expect("reaper listening");
        reaper
            .await
            .expect("reaper task")
            .expect("reaper ends cleanly");
    }

    #[test]
    fn sweeps_are_a_quarter_of_the_retention_within_bounds() {
        assert_eq!(tick_for(Duration::ZERO), Duration::from_secs(1));
        assert_eq!(tick_for(Duration::from_secs(8)), Duration::from_secs(2));
        assert_eq!(tick_for(24 * HOUR), Duration::from_secs(60));
    }
}
