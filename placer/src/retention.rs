//! Deletes what released tasks leave in the store once their retention is over.
//!
//! A Release deletes the task's placement, gives its memory back and moves its spec, its
//! last report and its assignment from `tasks/{task}/` to `archive/{task}/` (see
//! `archive.rs`), so an operator can still read a finished job (`iadeep state get
//! /iadeep/v1/archive/ID/report`) while everything that reads `tasks/` whole (the
//! placer's start, every tuner) reads only live tasks. Without an end to that, the store
//! grows with every job ever run. So the Release transaction also writes a marker,
//! `/iadeep/v1/released/{task}`, holding the release time (see
//! [`iadeep_state::keys::task_released`]); a Place of the same id deletes the marker and
//! the archive in its own transaction (the id is the new task's then). The reaper calls
//! [`sweep`] every [`tick_for`] and it deletes, in transactions of [`SWEEP_TXN_TASKS`]
//! tasks, each task's archive, whatever its agent wrote under `tasks/` after the
//! Release, and its marker, for markers older than the retention — iff, at that
//! revision:
//!
//! - the marker is the one read (its mod revision): the id was not re-placed and
//!   released again meanwhile, which would restart its retention;
//! - the task has no placement: it was not placed again;
//! - the task has no `alive` key: its agent does not run (a task released while its
//!   agent still runs is kept; see [`crate::service::PlacementService::readmit_running`]).
//!
//! A transaction whose comparisons fail (one of its tasks changed) is retried one task
//! at a time, so one busy id never holds back the others.
//!
//! Why pages and a cursor: a backlog can hold millions of markers (a placer that was
//! down, or a retention shortened), more than one read can answer. A pass reads the
//! markers in pages of [`MARKER_PAGE`] in key order, from where the last pass
//! stopped, and stops once it has deleted [`crate::PlacerParams::retention_batch`]
//! tasks (within a page if need be, the last transaction cut to fit), returning where to
//! go on ([`Swept::resume_after`]: the last marker it handled); the reaper then runs the next pass at once, so a backlog
//! is cleared at the store's transaction rate without one pass holding the reaper for
//! long. (Key order, not release order: release order would need every marker read.)
//!
//! **Avoid records.** Each pass that starts from the first marker also deletes the
//! AvoidPairings ([`iadeep_state::keys::avoid_pairing`], written with each cap eviction,
//! see [`crate::eviction`]) whose `until` has passed by the service's clock, at most
//! `retention_batch` of them, [`AVOID_TXN_RECORDS`] a transaction, each compared on the
//! mod revision read (a pairing renewed by a later eviction meanwhile is kept).
//! Placement ignores an expired record already ([`crate::ClusterView::avoids`]); the
//! sweep only keeps the prefix from growing with every eviction ever made.

use std::time::Duration;

use iadeep_proto::AvoidPairing;
use iadeep_state::keys::{self, KeyKind};
use iadeep_state::{Expect, RangePage, Revision, Txn, TxnOutcome, typed};

use crate::error::Result;
use crate::events::PlacementEvent;
use crate::service::PlacementService;

/// Release markers one page of a [`sweep`] reads: a marker is at most about 200 bytes
/// (a 147-byte key, a 13-digit time), so a page stays under 2 MB, and a pass over a
/// million markers is 100 pages, each of which etcd 3.4 answers at the cost of counting
/// the rest of the prefix (see [`iadeep_state::DEFAULT_PAGE_SIZE`]).
pub const MARKER_PAGE: usize = 10_000;

/// Released tasks one sweep transaction deletes: each costs 3 comparisons and 7
/// deletes, and etcd refuses a transaction of more than 128 operations by default
/// (`--max-txn-ops`), so 16 (112 deletes) is the most that fits.
pub const SWEEP_TXN_TASKS: usize = 16;

/// Expired avoid records one sweep transaction deletes: each costs a comparison and a
/// delete, well under etcd's default limit of 128 operations per transaction.
pub const AVOID_TXN_RECORDS: usize = 64;

/// What one [`sweep`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    /// Expired AvoidPairings deleted (by a pass that started from the first marker).
    pub avoid_deleted: usize,
    /// Tasks whose keys were deleted, in key order.
    pub deleted: Vec<String>,
    /// Tasks past their retention left alone because their agent still runs.
    pub running: usize,
    /// Where the next pass goes on (the last marker handled) when this one stopped
    /// because it had deleted its batch; `None` when it read every marker to the end.
    pub resume_after: Option<String>,
}

/// How often the reaper sweeps for a given retention: a quarter of it, between 1 s
/// and a minute (a pass with nothing due costs one read per page of markers).
pub fn tick_for(retention: Duration) -> Duration {
    (retention / 4).clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// Adds to `txn` the deletion of a released task's keys, on the conditions the module
/// documentation lists; `marker_revision` is the mod revision of its marker as read.
fn retire(txn: Txn, task: &str, marker_revision: Revision) -> Txn {
    let marker = keys::task_released(task);
    let mut txn = txn
        .compare(marker.as_str(), Expect::ModRevision(marker_revision))
        .compare(keys::task_placement(task), Expect::Absent)
        .compare(keys::task_alive(task), Expect::Absent)
        .delete(marker);
    for (live, archived) in keys::archived_task_keys(task) {
        txn = txn.delete(live).delete(archived);
    }
    txn
}

/// Deletes the keys of released tasks whose marker is at least `retention` old (by the
/// service's clock), reading the markers after `from` (from the first with `None`) and
/// stopping once `batch` tasks were deleted, within a page if need be.
pub async fn sweep(
    service: &PlacementService,
    retention: Duration,
    batch: usize,
    from: Option<String>,
) -> Result<Swept> {
    sweep_paged(service, retention, batch, from, MARKER_PAGE).await
}

/// [`sweep`], reading `page_size` markers at a time (tests walk small backlogs in
/// many pages).
pub async fn sweep_paged(
    service: &PlacementService,
    retention: Duration,
    batch: usize,
    from: Option<String>,
    page_size: usize,
) -> Result<Swept> {
    let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    let now = service.now_unix_ms();
    let batch = batch.max(1);
    let mut swept = Swept::default();
    if from.is_none() {
        swept.avoid_deleted = sweep_avoid_paged(service, batch, page_size).await?;
    }
    let mut after = from;
    loop {
        let page = service
            .store()
            .range_page(keys::RELEASED, after.as_deref(), page_size)
            .await?;
        let (due, running) = due_in(service, &page, now.saturating_sub(retention_ms));
        if let Some(stop) = delete_due(service, &due, batch, &mut swept).await? {
            // The batch ended within the page: the next pass reads from after the last
            // marker handled, so what follows it is neither deleted nor counted here.
            let marker = keys::task_released(stop);
            swept.running += running.iter().filter(|key| **key <= marker).count();
            swept.resume_after = Some(marker);
            break;
        }
        swept.running += running.len();
        after = page.next_after().map(str::to_owned);
        if after.is_none() || swept.deleted.len() >= batch {
            swept.resume_after = after;
            break;
        }
    }
    if !swept.deleted.is_empty() {
        tracing::info!(
            deleted = swept.deleted.len(),
            running = swept.running,
            more = swept.resume_after.is_some(),
            "deleted the keys of released tasks past their retention"
        );
    }
    Ok(swept)
}

/// Deletes the AvoidPairings whose `until` has passed by the service's clock, at most
/// `batch` of them (see the module docs). Returns how many were deleted.
pub async fn sweep_avoid(service: &PlacementService, batch: usize) -> Result<usize> {
    sweep_avoid_paged(service, batch, MARKER_PAGE).await
}

/// [`sweep_avoid`], reading `page_size` records at a time.
async fn sweep_avoid_paged(
    service: &PlacementService,
    batch: usize,
    page_size: usize,
) -> Result<usize> {
    let now = service.now_unix_ms();
    let batch = batch.max(1);
    let mut deleted = 0;
    let mut after: Option<String> = None;
    loop {
        let page = service
            .store()
            .range_page(keys::AVOID, after.as_deref(), page_size)
            .await?;
        let mut due = Vec::new();
        for kv in &page.kvs {
            let KeyKind::AvoidPairing {
                production,
                evicted,
            } = KeyKind::parse(&kv.key)
            else {
                continue;
            };
            match typed::decode::<AvoidPairing>(kv) {
                Ok(pairing) if pairing.until_unix_ms <= now => {
                    due.push((production, evicted, kv.mod_revision));
                }
                Ok(_) => {}
                Err(err) => {
                    service.record(PlacementEvent::DecodeError);
                    tracing::warn!(%err, key = %kv.key,
                        "avoid record does not decode; kept until it is fixed or deleted");
                }
            }
        }
        due.truncate(batch - deleted);
        for chunk in due.chunks(AVOID_TXN_RECORDS) {
            deleted += delete_avoid_chunk(service, chunk).await?;
        }
        after = page.next_after().map(str::to_owned);
        if after.is_none() || deleted >= batch {
            break;
        }
    }
    if deleted > 0 {
        tracing::info!(deleted, "deleted expired avoid records");
    }
    Ok(deleted)
}

/// Deletes the avoid records of `chunk` (production, evicted, mod revision read) in one
/// transaction or, when one of them changed since it was read, one transaction each.
/// Returns how many were deleted.
async fn delete_avoid_chunk(
    service: &PlacementService,
    chunk: &[(String, String, Revision)],
) -> Result<usize> {
    let retire = |txn: Txn, (production, evicted, rev): &(String, String, Revision)| {
        let key = keys::avoid_pairing(production, evicted);
        txn.compare(key.as_str(), Expect::ModRevision(*rev))
            .delete(key)
    };
    let all = chunk.iter().fold(Txn::new(), retire);
    // Each deleted record with the revision it was deleted at.
    let committed: Vec<(&(String, String, Revision), Revision)> =
        match service.store().transact(all).await? {
            TxnOutcome::Committed { revision } => chunk.iter().map(|r| (r, revision)).collect(),
            TxnOutcome::Failed { .. } if chunk.len() == 1 => Vec::new(),
            TxnOutcome::Failed { .. } => {
                let mut committed = Vec::new();
                for record in chunk {
                    let txn = retire(Txn::new(), record);
                    if let TxnOutcome::Committed { revision } =
                        service.store().transact(txn).await?
                    {
                        committed.push((record, revision));
                    }
                }
                committed
            }
        };
    let mut view = service.view_mut();
    for ((production, evicted, _), revision) in &committed {
        view.remove_avoid(production, evicted, *revision);
    }
    Ok(committed.len())
}

/// Deletes the `due` tasks of one page in transactions of up to [`SWEEP_TXN_TASKS`],
/// none of which takes the pass past `batch` deletions. When the batch is reached
/// before the last of them, returns the last task handled (the pass stops after it).
async fn delete_due<'a>(
    service: &PlacementService,
    due: &'a [(String, Revision)],
    batch: usize,
    swept: &mut Swept,
) -> Result<Option<&'a str>> {
    let mut done = 0;
    while done < due.len() {
        let room = batch.saturating_sub(swept.deleted.len());
        if room == 0 {
            return Ok(Some(due[done - 1].0.as_str()));
        }
        let chunk = &due[done..due.len().min(done + room.min(SWEEP_TXN_TASKS))];
        delete_chunk(service, chunk, swept).await?;
        done += chunk.len();
    }
    Ok(None)
}

/// The tasks of `page` released at or before `released_by` whose agent does not run,
/// with their marker's revision, and the markers of those whose agent runs.
fn due_in(
    service: &PlacementService,
    page: &RangePage,
    released_by: i64,
) -> (Vec<(String, Revision)>, Vec<String>) {
    let (mut due, mut running) = (Vec::new(), Vec::new());
    for kv in &page.kvs {
        let KeyKind::TaskReleased { task } = KeyKind::parse(&kv.key) else {
            continue;
        };
        match typed::decode_released_at(&kv.key, &kv.value) {
            Ok(released_at) if released_at <= released_by => {
                if service.view().agent_alive(&task) {
                    running.push(kv.key.clone());
                } else {
                    due.push((task, kv.mod_revision));
                }
            }
            Ok(_) => {}
            Err(err) => {
                service.record(PlacementEvent::DecodeError);
                tracing::warn!(%err, "release marker does not decode; task kept until it is fixed or deleted");
            }
        }
    }
    (due, running)
}

/// Deletes the tasks of `chunk` in one transaction or, when one of them changed since
/// its marker was read, one transaction each.
async fn delete_chunk(
    service: &PlacementService,
    chunk: &[(String, Revision)],
    swept: &mut Swept,
) -> Result<()> {
    let all = chunk
        .iter()
        .fold(Txn::new(), |txn, (task, rev)| retire(txn, task, *rev));
    let committed: Vec<&String> = match service.store().transact(all).await? {
        TxnOutcome::Committed { .. } => chunk.iter().map(|(task, _)| task).collect(),
        TxnOutcome::Failed { .. } if chunk.len() == 1 => Vec::new(),
        TxnOutcome::Failed { .. } => {
            let mut committed = Vec::new();
            for (task, rev) in chunk {
                let txn = retire(Txn::new(), task, *rev);
                if service.store().transact(txn).await?.committed() {
                    committed.push(task);
                } else {
                    tracing::debug!(%task,
                        "released task changed since the marker was read (placed again, released again or its agent runs); kept");
                }
            }
            committed
        }
    };
    for task in committed {
        service.record(PlacementEvent::RetentionDeleted);
        swept.deleted.push(task.clone());
    }
    Ok(())
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

    async fn count(store: &dyn StateStore, prefix: &str) -> usize {
        store.range(prefix).await.expect("range").kvs.len()
    }

    async fn task_keys(store: &dyn StateStore, id: &str) -> usize {
        count(store, &keys::task_prefix(id)).await
    }

    async fn archived_keys(store: &dyn StateStore, id: &str) -> usize {
        count(store, &keys::archive_prefix(id)).await
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

    async fn place_and_release(service: &PlacementService, id: &str) {
        service.place(spec(id), vec![]).await.expect("place");
        service.release(id).await.expect("release");
    }

    /// What an agent that runs without a placement writes: its spec, its `alive`
    /// key and a report (the view learns the last two, as the sync tells it).
    async fn run_unplaced(store: &dyn StateStore, service: &PlacementService, id: &str) {
        let report = iadeep_proto::TaskReport {
            task_id: id.into(),
            device_id: "d0".into(),
            ..Default::default()
        };
        for (key, value) in [
            (
                keys::task_spec(id),
                prost::Message::encode_to_vec(&spec(id)),
            ),
            (keys::task_alive(id), b"pid 1".to_vec()),
            (
                keys::task_report(id),
                prost::Message::encode_to_vec(&report),
            ),
        ] {
            store.put(&key, value, None).await.expect("agent's write");
        }
        let mut view = service.view_mut();
        view.set_alive(id);
        view.set_report(report);
    }

    /// A job whose agent ran without ever being placed (started outside `iadeep
    /// run`) leaves its spec and report under `tasks/`, which nothing released. Once
    /// its agent has been gone for the dead-task grace the reaper archives them with a
    /// release marker, and the retention deletes them like a released task's. Not
    /// while its agent runs, by the view or by the store.
    #[tokio::test]
    async fn a_task_that_ran_without_a_placement_is_archived_then_swept() {
        let (store, now, service) = world();
        let events = Arc::new(crate::events::Recorded::default());
        let service = service.with_events(events.clone());
        let grace = Duration::from_secs(60);
        run_unplaced(store.as_ref(), &service, "solo").await;
        assert!(service.archive_dead_unreserved(grace).await.is_empty());

        // Its agent stops: the lease's key goes, the view notices.
        store
            .delete(&keys::task_alive("solo"))
            .await
            .expect("lease expiry");
        service
            .view_mut()
            .set_not_alive("solo", now.load(Ordering::SeqCst));
        advance(&now, grace - Duration::from_secs(1));
        assert!(
            service.archive_dead_unreserved(grace).await.is_empty(),
            "within the grace"
        );
        advance(&now, Duration::from_secs(1));
        // A view behind the store: the agent came back, its key is there again.
        store
            .put(&keys::task_alive("solo"), b"pid 2".to_vec(), None)
            .await
            .expect("agent's key");
        assert!(
            service.archive_dead_unreserved(grace).await.is_empty(),
            "runs by the store"
        );
        assert_eq!(task_keys(store.as_ref(), "solo").await, 3);
        store
            .delete(&keys::task_alive("solo"))
            .await
            .expect("lease expiry");
        assert_eq!(service.archive_dead_unreserved(grace).await, ["solo"]);
        assert_eq!(task_keys(store.as_ref(), "solo").await, 0, "out of tasks/");
        assert_eq!(
            archived_keys(store.as_ref(), "solo").await,
            2,
            "spec and report"
        );
        assert_eq!(events.count(PlacementEvent::UnplacedArchived), 1);
        advance(&now, HOUR);
        let swept = sweep(&service, HOUR, 10, None).await.expect("sweep");
        assert_eq!(swept.deleted, ["solo"]);
        assert_eq!(archived_keys(store.as_ref(), "solo").await, 0);
    }

    /// A fault-injecting store and a service on it holding an unplaced task `solo` whose
    /// agent is gone (from the store and from the view).
    async fn gone_unplaced() -> (Arc<iadeep_state::testing::FaultStore>, PlacementService) {
        let faults = Arc::new(iadeep_state::testing::FaultStore::in_memory());
        let store: Arc<dyn StateStore> = faults.clone();
        let service = crate::service::tests::service(store.clone());
        run_unplaced(store.as_ref(), &service, "solo").await;
        store
            .delete(&keys::task_alive("solo"))
            .await
            .expect("lease expiry");
        service.view_mut().set_not_alive("solo", 0);
        (faults, service)
    }

    /// The archive's transaction holds only if nothing that makes the task live again
    /// appeared between its read and its commit: its agent's `alive` key, a placement
    /// or a release marker. Each is written just before the commit; the keys stay.
    #[tokio::test]
    async fn an_unplaced_tasks_archive_loses_to_a_task_that_came_back() {
        for (key, value) in [
            (keys::task_alive("solo"), b"pid 2".to_vec()),
            (keys::task_placement("solo"), b"".to_vec()),
            (keys::task_released("solo"), b"1".to_vec()),
        ] {
            let (faults, service) = gone_unplaced().await;
            faults.put_before_next_transaction(key.clone(), value);
            assert!(
                service
                    .archive_dead_unreserved(Duration::ZERO)
                    .await
                    .is_empty(),
                "{key} appeared before the commit"
            );
            for kept in [keys::task_spec("solo"), keys::task_report("solo")] {
                let found = faults.get(&kept).await.expect("get");
                assert!(found.is_some(), "{kept} kept when {key} appeared");
            }
            assert_eq!(archived_keys(faults.as_ref(), "solo").await, 0, "{key}");
        }
    }

    /// A task released while its agent ran has its spec in the archive and a marker;
    /// what its agent wrote under `tasks/` afterwards is the retention's. Once that agent
    /// is gone, the reaper must not move it again (the move would delete the archived
    /// spec, which is not under `tasks/` any more, and restart the retention), and it
    /// stops looking at the task; a report the store no longer holds leaves the view.
    #[tokio::test]
    async fn a_released_task_is_left_to_the_retention_and_a_stale_report_forgotten() {
        let (store, now, service) = world();
        service.place(spec("a"), vec![]).await.expect("place");
        service.release("a").await.expect("release");
        let archived_spec = store.get(&keys::archived_spec("a")).await.expect("get");
        assert!(archived_spec.is_some());
        let report = iadeep_proto::TaskReport {
            task_id: "a".into(),
            ..Default::default()
        };
        let bytes = prost::Message::encode_to_vec(&report);
        store
            .put(&keys::task_report("a"), bytes, None)
            .await
            .expect("the agent's report after the Release");
        service.view_mut().set_report(report.clone());
        let at = now.load(Ordering::SeqCst);
        assert!(
            service
                .archive_dead_unreserved(Duration::ZERO)
                .await
                .is_empty()
        );
        assert_eq!(
            store.get(&keys::archived_spec("a")).await.expect("get"),
            archived_spec,
            "the archive stays as the Release left it"
        );
        let marker = store.get(&keys::task_released("a")).await.expect("get");
        let marker = marker.expect("marker");
        assert_eq!(
            typed::decode_released_at(&marker.key, &marker.value).expect("a time"),
            at,
            "the retention counts from the Release"
        );
        assert!(
            service.view_mut().dead_unreserved(at, 0).is_empty(),
            "set aside"
        );

        // A report in the view that the store no longer holds.
        service.view_mut().set_report(iadeep_proto::TaskReport {
            task_id: "ghost".into(),
            ..Default::default()
        });
        assert!(
            service
                .archive_dead_unreserved(Duration::ZERO)
                .await
                .is_empty()
        );
        assert!(
            service.view_mut().dead_unreserved(at, 0).is_empty(),
            "forgotten"
        );
    }

    /// A gone task whose keys the store no longer holds (its deletion not yet seen by the
    /// view) loses the report the reaper saw, not a newer one: one written after the
    /// archive's read (here, put into the view while that read is held) is the new
    /// agent's, and the view must keep it, and count it.
    #[tokio::test]
    async fn a_report_that_arrives_during_the_archives_read_stays_in_the_view() {
        let faults = Arc::new(iadeep_state::testing::FaultStore::in_memory());
        let store: Arc<dyn StateStore> = faults.clone();
        let service = Arc::new(crate::service::tests::service(store));
        let stale = iadeep_proto::TaskReport {
            task_id: "ghost".into(),
            seq: 1,
            ..Default::default()
        };
        service.view_mut().set_report(stale.clone());
        faults.hold_next(iadeep_state::testing::Op::Range, 1);
        let pass = tokio::spawn({
            let service = service.clone();
            async move { service.archive_dead_unreserved(Duration::ZERO).await }
        });
        faults.until_holding(1).await;
        service
            .view_mut()
            .set_report(iadeep_proto::TaskReport { seq: 2, ..stale });
        faults.release(1);
        assert!(pass.await.expect("join").is_empty());
        assert!(
            service
                .view_mut()
                .reported_tasks()
                .any(|task| task == "ghost"),
            "the fresh report was dropped"
        );
        let now = service.now_unix_ms();
        let dead = service.view_mut().dead_unreserved(now, 0);
        assert_eq!(dead.len(), 1, "still counted: {dead:?}");
        assert_eq!(dead[0].report_seq, 2);
    }

    /// One pass archives at most `ARCHIVE_PER_PASS` (100) tasks; the next takes the rest.
    #[tokio::test]
    async fn a_backlog_of_unplaced_tasks_is_archived_over_several_passes() {
        let (store, now, service) = world();
        let ids: Vec<String> = (0..101).map(|i| format!("t{i:03}")).collect();
        for id in &ids {
            run_unplaced(store.as_ref(), &service, id).await;
            store
                .delete(&keys::task_alive(id))
                .await
                .expect("lease expiry");
            service
                .view_mut()
                .set_not_alive(id, now.load(Ordering::SeqCst));
        }
        assert_eq!(
            service.archive_dead_unreserved(Duration::ZERO).await.len(),
            100
        );
        // Its reports' deletions reach the view through the watch in the daemon.
        for id in &ids[..100] {
            service.view_mut().remove_report(id);
        }
        assert_eq!(
            service.archive_dead_unreserved(Duration::ZERO).await,
            ["t100"]
        );
    }

    /// A Release never fails on what a task that held nothing left behind: the store
    /// error of the archive's read is logged, and the reaper archives it later.
    #[tokio::test]
    async fn a_release_does_not_fail_on_the_archive_of_an_unplaced_task() {
        let (faults, service) = gone_unplaced().await;
        faults.fail_next(iadeep_state::testing::Op::Range, 1);
        assert_eq!(service.release("solo").await.expect("release"), None);
        assert_eq!(
            task_keys(faults.as_ref(), "solo").await,
            2,
            "left for the reaper"
        );
    }

    /// A Release of a task that holds no placement archives what its agent left
    /// (once that agent is gone) instead of answering "nothing held" and leaving it.
    #[tokio::test]
    async fn releasing_a_task_that_ran_without_a_placement_archives_it() {
        let (store, _now, service) = world();
        run_unplaced(store.as_ref(), &service, "solo").await;
        assert_eq!(service.release("solo").await.expect("release"), None);
        assert_eq!(task_keys(store.as_ref(), "solo").await, 3, "its agent runs");
        store
            .delete(&keys::task_alive("solo"))
            .await
            .expect("lease expiry");
        assert_eq!(service.release("solo").await.expect("release"), None);
        assert_eq!(task_keys(store.as_ref(), "solo").await, 0);
        assert!(
            store
                .get(&keys::task_released("solo"))
                .await
                .expect("get")
                .is_some()
        );
        // A task that left nothing (withdrawn while it waited) gets no marker.
        assert_eq!(service.release("queued").await.expect("release"), None);
        assert!(
            store
                .get(&keys::task_released("queued"))
                .await
                .expect("get")
                .is_none()
        );
    }

    #[tokio::test]
    async fn a_released_task_moves_to_the_archive_until_its_retention_ends_then_is_gone() {
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
            0,
            "readers of tasks/ see live tasks only"
        );
        assert_eq!(
            archived_keys(store.as_ref(), "a").await,
            2,
            "spec and assignment kept in the archive"
        );
        let (archived, _) = typed::get::<TaskSpec>(store.as_ref(), &keys::archived_spec("a"))
            .await
            .expect("get")
            .expect("archived spec");
        assert_eq!(archived, spec("a"));
        assert!(
            store
                .get(&keys::task_released("a"))
                .await
                .expect("get")
                .is_some()
        );

        advance(&now, HOUR - Duration::from_secs(1));
        let early = sweep(&service, HOUR, 10, None).await.expect("sweep");
        assert!(early.deleted.is_empty(), "{early:?}");
        assert_eq!(
            archived_keys(store.as_ref(), "a").await,
            2,
            "still readable"
        );

        advance(&now, Duration::from_secs(1));
        let due = sweep(&service, HOUR, 10, None).await.expect("sweep");
        assert_eq!(due.deleted, vec!["a".to_owned()]);
        assert_eq!(due.resume_after, None);
        assert_eq!(archived_keys(store.as_ref(), "a").await, 0);
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
            place_and_release(&service, id).await;
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
        assert_eq!(
            archived_keys(store.as_ref(), "reused").await,
            0,
            "and the old task's archive"
        );
        // The other's agent still runs after the Release, and reports.
        store
            .put(&keys::task_alive("running"), b"pid 1".to_vec(), None)
            .await
            .expect("alive");
        advance(&now, 2 * HOUR);
        let swept = sweep(&service, HOUR, 10, None).await.expect("sweep");
        assert!(swept.deleted.is_empty(), "{swept:?}");
        assert_eq!(task_keys(store.as_ref(), "reused").await, 3);
        assert_eq!(archived_keys(store.as_ref(), "running").await, 2);
    }

    #[tokio::test]
    async fn a_marker_rewritten_after_it_was_read_is_not_acted_on() {
        let (store, now, service) = world();
        place_and_release(&service, "a").await;
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
        let txn = retire(Txn::new(), "a", read.mod_revision);
        assert!(!store.transact(txn).await.expect("txn").committed());
        // Read afresh, the pass deletes it.
        let swept = sweep(&service, HOUR, 10, None).await.expect("sweep");
        assert_eq!(swept.deleted, vec!["a".to_owned()]);
    }

    /// Pages of two markers and a batch of two: each pass deletes one page's tasks
    /// and says where the next goes on, until the backlog is gone.
    #[tokio::test]
    async fn a_backlog_is_deleted_in_passes_that_resume_where_the_last_stopped() {
        let (store, now, service) = world();
        for id in ["t0", "t1", "t2", "t3", "t4"] {
            place_and_release(&service, id).await;
            advance(&now, Duration::from_secs(1));
        }
        advance(&now, HOUR);
        let first = sweep_paged(&service, HOUR, 2, None, 2)
            .await
            .expect("sweep");
        assert_eq!(first.deleted, vec!["t0".to_owned(), "t1".to_owned()]);
        assert_eq!(first.resume_after, Some(keys::task_released("t1")));
        let second = sweep_paged(&service, HOUR, 2, first.resume_after, 2)
            .await
            .expect("sweep");
        assert_eq!(second.deleted, vec!["t2".to_owned(), "t3".to_owned()]);
        let third = sweep_paged(&service, HOUR, 2, second.resume_after, 2)
            .await
            .expect("sweep");
        assert_eq!(third.deleted, vec!["t4".to_owned()]);
        assert_eq!(third.resume_after, None, "read to the end");
        for prefix in [keys::TASKS, keys::ARCHIVE, keys::RELEASED] {
            assert_eq!(count(store.as_ref(), prefix).await, 0, "{prefix}");
        }
    }

    /// One page of 40 due markers and a batch of 20 (a transaction of 16, then one cut
    /// to 4): the pass stops at the batch within the page, says it stopped after the
    /// 20th marker, and the next pass goes on from there; a batch of 5 cuts the first
    /// transaction itself.
    #[tokio::test]
    async fn a_pass_over_a_page_larger_than_its_batch_stops_at_the_batch() {
        let (store, now, service) = world();
        let ids: Vec<String> = (0..40).map(|i| format!("t{i:02}")).collect();
        for id in &ids {
            place_and_release(&service, id).await;
        }
        advance(&now, 2 * HOUR);
        let first = sweep_paged(&service, HOUR, 20, None, 100)
            .await
            .expect("sweep");
        assert_eq!(first.deleted, ids[..20]);
        assert_eq!(first.resume_after, Some(keys::task_released("t19")));
        assert_eq!(count(store.as_ref(), keys::RELEASED).await, 20);
        let second = sweep_paged(&service, HOUR, 5, first.resume_after, 100)
            .await
            .expect("sweep");
        assert_eq!(second.deleted, ids[20..25]);
        assert_eq!(second.resume_after, Some(keys::task_released("t24")));
        let last = sweep_paged(&service, HOUR, 20, second.resume_after, 100)
            .await
            .expect("sweep");
        assert_eq!(last.deleted, ids[25..40]);
        assert_eq!(last.resume_after, None, "read to the end");
        assert_eq!(count(store.as_ref(), keys::RELEASED).await, 0);
    }

    /// A whole transaction of tasks fails when one of them changed; the others are
    /// deleted one by one, and the changed one is kept.
    #[tokio::test]
    async fn one_changed_task_does_not_hold_back_its_transaction() {
        let (store, now, service) = world();
        let ids: Vec<String> = (0..SWEEP_TXN_TASKS + 3)
            .map(|i| format!("t{i:02}"))
            .collect();
        for id in &ids {
            place_and_release(&service, id).await;
        }
        advance(&now, 2 * HOUR);
        // An agent came back behind the view's back (its `alive` key is in the store,
        // not yet in the view): only the transaction's comparison can see it.
        store
            .put(&keys::task_alive("t03"), b"pid 7".to_vec(), None)
            .await
            .expect("alive");
        let swept = sweep(&service, HOUR, 100, None).await.expect("sweep");
        let kept: Vec<&String> = ids
            .iter()
            .filter(|id| !swept.deleted.contains(id))
            .collect();
        assert_eq!(kept, ["t03"]);
        assert_eq!(count(store.as_ref(), keys::RELEASED).await, 1);
        assert_eq!(archived_keys(store.as_ref(), "t03").await, 2);
    }

    /// The reaper's loop sweeps by the service's clock (virtual here): with the clock
    /// past the default retention of a day, its first sweep (at once when it starts)
    /// deletes the released task's keys.
    #[tokio::test]
    async fn the_reaper_deletes_released_tasks_a_retention_after_their_release() {
        let (store, now, service) = world();
        let retention = service.placer().params().task_retention.expect("a default");
        assert_eq!(retention, crate::params::DEFAULT_TASK_RETENTION);
        place_and_release(&service, "a").await;
        assert_eq!(archived_keys(store.as_ref(), "a").await, 2);
        advance(&now, retention);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let reaper = crate::reaper::spawn(service.clone(), Default::default(), stopped);
        let mut polls = 0;
        while archived_keys(store.as_ref(), "a").await > 0 {
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

    fn pairing(production: &str, evicted: &str, until: i64) -> AvoidPairing {
        AvoidPairing {
            production_task_id: production.into(),
            evicted_task_id: evicted.into(),
            until_unix_ms: until,
            reason: String::new(),
        }
    }

    /// Avoid records whose `until` has passed are deleted by the sweep (in the store and
    /// the view), at most a batch a pass; one still in force stays.
    #[tokio::test]
    async fn expired_avoid_records_are_swept_in_batches() {
        let (store, now, service) = world();
        let t = now.load(Ordering::SeqCst);
        let records = [
            ("p", "e1", t - 1),
            ("p", "e2", t),
            ("p", "e3", t - 5_000),
            ("p", "kept", t + 1),
        ];
        for (production, evicted, until) in records {
            let record = pairing(production, evicted, until);
            let key = keys::avoid_pairing(production, evicted);
            let rev = typed::put(store.as_ref(), &key, &record, None)
                .await
                .expect("avoid");
            service.view_mut().set_avoid(record, rev);
        }
        let first = sweep(&service, HOUR, 2, None).await.expect("sweep");
        assert_eq!(first.avoid_deleted, 2, "{first:?}");
        assert_eq!(count(store.as_ref(), keys::AVOID).await, 2);
        let second = sweep(&service, HOUR, 2, None).await.expect("sweep");
        assert_eq!(second.avoid_deleted, 1, "{second:?}");
        let left = store.range(keys::AVOID).await.expect("range").kvs;
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].key, keys::avoid_pairing("p", "kept"));
        let view = service.view();
        assert_eq!(view.avoid_pairings().count(), 1, "the view follows");
        assert!(view.avoids("kept", "p", t));
    }

    /// A record renewed (by a later eviction) after the sweep read it is not deleted.
    #[tokio::test]
    async fn a_renewed_avoid_record_is_not_swept() {
        let (store, now, service) = world();
        let t = now.load(Ordering::SeqCst);
        let key = keys::avoid_pairing("p", "e");
        let read = typed::put(store.as_ref(), &key, &pairing("p", "e", t - 1), None)
            .await
            .expect("avoid");
        typed::put(
            store.as_ref(),
            &key,
            &pairing("p", "e", t + HOUR.as_millis() as i64),
            None,
        )
        .await
        .expect("renewed");
        let chunk = [("p".to_owned(), "e".to_owned(), read)];
        assert_eq!(
            delete_avoid_chunk(&service, &chunk).await.expect("delete"),
            0
        );
        assert_eq!(count(store.as_ref(), keys::AVOID).await, 1);
    }

    #[test]
    fn sweeps_are_a_quarter_of_the_retention_within_bounds() {
        assert_eq!(tick_for(Duration::ZERO), Duration::from_secs(1));
        assert_eq!(tick_for(Duration::from_secs(8)), Duration::from_secs(2));
        assert_eq!(tick_for(24 * HOUR), Duration::from_secs(60));
    }
}
