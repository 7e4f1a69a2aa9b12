//! A store that outgrows one answer: prefixes larger than a page are read whole by
//! everything that reads them (the placer's start, a follower), a backlog of released
//! tasks is swept in pages and bounded transactions, and the placer compacts etcd's
//! history. Over a real etcd whose store reads pages of 50 keys, so a few hundred keys
//! stand for the tens of thousands a busy cluster holds.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use iadeep_placer::{
    ClusterView, Daemon, DaemonConfig, ModelledMemory, NoEvents, PlacementService, Placer,
    PlacerParams, compaction, retention,
};
use iadeep_predictor::{LearnerParams, OnlinePredictor};
use iadeep_proto::{DeviceInfo, TaskReport};
use iadeep_state::testing::{EtcdServer, start_etcd};
use iadeep_state::{EtcdStore, Follow, Followed, StateError, StateStore, Txn, keys, typed};
use prost::Message;

use crate::placer::eventually;

/// The page size of these tests' etcd store: far below the default, so a few hundred
/// keys span many pages.
const PAGE: usize = 50;

async fn paged_store(server: &EtcdServer) -> Arc<dyn StateStore> {
    Arc::new(
        EtcdStore::connect(&[server.endpoint()])
            .await
            .expect("connect to etcd")
            .with_page_size(PAGE),
    )
}

/// Writes `kvs` in transactions of 100 puts (etcd's default limit is 128 operations).
async fn put_all(store: &dyn StateStore, kvs: Vec<(String, Vec<u8>)>) {
    for chunk in kvs.chunks(100) {
        let txn = chunk.iter().fold(Txn::new(), |txn, (k, v)| {
            txn.put(k.as_str(), v.clone(), None)
        });
        assert!(store.transact(txn).await.expect("write").committed());
    }
}

fn placer(params: PlacerParams) -> Placer {
    let slowdown = OnlinePredictor::new(LearnerParams::default()).expect("cold predictor");
    Placer::new(params, Arc::new(slowdown)).expect("params")
}

fn daemon_config() -> DaemonConfig {
    DaemonConfig {
        grpc: ([127, 0, 0, 1], 0).into(),
        extender: None,
        metrics: None,
        dead_task_grace: None,
        unstarted_task_grace: None,
        tls: None,
    }
}

const DEVICES: usize = 260;
const TASKS: usize = 240;

/// 260 devices and 240 running tasks (an `alive` key and a report each): 480 keys
/// under `tasks/`, ten pages.
fn cluster_keys() -> Vec<(String, Vec<u8>)> {
    let mut kvs = Vec::new();
    for i in 0..DEVICES {
        let device = format!("n{i:03}.gpu0");
        let info = DeviceInfo {
            device_id: device.clone(),
            node: format!("n{i:03}"),
            memory_mib: 16_384,
            kind: "v100".into(),
            ..Default::default()
        };
        kvs.push((keys::device_info(&device), info.encode_to_vec()));
    }
    for i in 0..TASKS {
        let task = format!("job-{i:03}");
        let report = TaskReport {
            task_id: task.clone(),
            batch_size: 32,
            step_time_s: 0.1,
            device_id: format!("n{i:03}.gpu0"),
            ..Default::default()
        };
        kvs.push((keys::task_alive(&task), b"pid 1".to_vec()));
        kvs.push((keys::task_report(&task), report.encode_to_vec()));
    }
    kvs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_placer_and_a_follower_read_prefixes_many_pages_long() {
    let server = start_etcd();
    let store = paged_store(&server).await;
    put_all(store.as_ref(), cluster_keys()).await;

    let tasks = store.range(keys::TASKS).await.expect("paged range");
    assert_eq!(tasks.kvs.len(), 2 * TASKS);
    assert!(
        tasks.kvs.windows(2).all(|w| w[0].key < w[1].key),
        "sorted, no key twice"
    );

    let mut follow = Follow::new(store.clone(), keys::TASKS, Duration::from_millis(100));
    match follow.next().await {
        Followed::Snapshot(snapshot) => assert_eq!(snapshot.kvs.len(), 2 * TASKS),
        other => panic!("a follow starts with a snapshot: {other:?}"),
    }
    // The change after the paged snapshot arrives: the watch starts at its revision.
    store
        .put(&keys::task_alive("late"), b"pid 2".to_vec(), None)
        .await
        .expect("put");
    match follow.next().await {
        Followed::Change(change) => assert_eq!(change.key(), keys::task_alive("late")),
        other => panic!("the change after the snapshot: {other:?}"),
    }

    let daemon = Daemon::start(
        store.clone(),
        placer(PlacerParams::default()),
        Arc::new(ModelledMemory),
        daemon_config(),
    )
    .await
    .expect("the placer starts on prefixes many pages long");
    {
        let view = daemon.service().view();
        assert_eq!(view.len(), DEVICES, "every device page loaded");
        assert!((0..TASKS).all(|i| view.agent_alive(&format!("job-{i:03}"))));
    }
    daemon.shutdown().await;
}

/// 1,000 released tasks past their retention, each with its marker and archive: the
/// sweep reads the markers in pages (of 100 here) and deletes in transactions of 16
/// tasks, in passes (of 300 tasks) that resume where the last stopped, until nothing is
/// left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_of_released_tasks_is_swept_to_nothing() {
    const BACKLOG: usize = 1_000;
    let server = start_etcd();
    let store = paged_store(&server).await;
    let mut kvs = Vec::new();
    for i in 0..BACKLOG {
        let task = format!("old-{i:04}");
        kvs.push((keys::task_released(&task), typed::encode_released_at(1_000)));
        kvs.push((keys::archived_spec(&task), vec![]));
        kvs.push((keys::archived_report(&task), vec![]));
    }
    put_all(store.as_ref(), kvs).await;
    let params = PlacerParams {
        task_retention: Some(Duration::from_secs(3600)),
        ..PlacerParams::default()
    };
    let service = PlacementService::new(
        store.clone(),
        Arc::new(RwLock::new(ClusterView::new(Arc::new(ModelledMemory)))),
        Arc::new(placer(params)),
    )
    .with_events(Arc::new(NoEvents));
    let (mut deleted, mut passes, mut from) = (0, 0, None);
    loop {
        let swept = retention::sweep_paged(&service, Duration::from_secs(3600), 300, from, 100)
            .await
            .expect("sweep");
        deleted += swept.deleted.len();
        passes += 1;
        from = swept.resume_after;
        if from.is_none() {
            break;
        }
    }
    assert_eq!(deleted, BACKLOG);
    assert!(passes > 1, "a batch of 300 cannot take 1,000 in one pass");
    for prefix in [keys::RELEASED, keys::ARCHIVE] {
        assert!(
            store.range(prefix).await.expect("range").kvs.is_empty(),
            "{prefix}"
        );
    }
}

/// Whether a watch from `from` fails because that history was compacted (etcd says so
/// when the watch is created or as its first item). The callers' `from` always has
/// writes at or after it, so the first item comes however loaded the machine is: the
/// compaction cancel (sent after etcd's watcher sync) or, while not compacted, an event.
/// The timeout only keeps a lost answer from hanging the test.
async fn compacted(store: &dyn StateStore, from: i64) -> bool {
    match store.watch(keys::ROOT, Some(from)).await {
        Err(StateError::Compacted { .. }) => true,
        Err(err) => panic!("{err}"),
        Ok(mut stream) => matches!(
            tokio::time::timeout(Duration::from_secs(30), stream.next()).await,
            Ok(Some(Err(StateError::Compacted { .. })))
        ),
    }
}

/// The placer compacts etcd's history to its last `compact_keep_revisions`, at start
/// and then every `compact_every`: a watch from before that fails as compacted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_placer_compacts_etcds_history() {
    let server = start_etcd();
    let store = paged_store(&server).await;
    let mut last = 0;
    for i in 0..40 {
        last = store
            .put("/iadeep/v1/profiles/m", vec![i], None)
            .await
            .expect("put");
    }
    let params = PlacerParams {
        compact_every: Some(Duration::from_secs(3600)),
        compact_keep_revisions: 10,
        ..PlacerParams::default()
    };
    let daemon = Daemon::start(
        store.clone(),
        placer(params),
        Arc::new(ModelledMemory),
        daemon_config(),
    )
    .await
    .expect("start the placer");
    eventually(
        "the history before the last 10 revisions to be compacted",
        async || compacted(store.as_ref(), last - 12).await,
    )
    .await;
    // Within the kept revisions, a watch resumes.
    let mut recent = store
        .watch(keys::ROOT, Some(last - 5))
        .await
        .expect("watch within the kept history");
    assert!(matches!(recent.next().await, Some(Ok(_))));
    // Compacting again to a revision already compacted is not an error; the second
    // tick compacts to the first one's revision, leaving no history before it.
    let mut compactor = compaction::Compactor::new(1_000);
    assert_eq!(
        compactor.tick(store.as_ref()).await.expect("first tick"),
        None
    );
    let now = store
        .put("/iadeep/v1/profiles/m", vec![0], None)
        .await
        .expect("put");
    let to = compactor.tick(store.as_ref()).await.expect("second tick");
    assert_eq!(to, Some(now - 1), "one period behind");
    eventually(
        "the history before the second tick's revision to be compacted",
        async || compacted(store.as_ref(), now - 2).await,
    )
    .await;
    daemon.shutdown().await;
}

/// A page of values too large for one gRPC answer (600 values of 10 KB asked for at
/// once: 6 MB, over the 4 MiB limit) is read in halves, whole and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_too_large_for_one_answer_is_read_in_halves() {
    let server = start_etcd();
    let store: Arc<dyn StateStore> = Arc::new(
        EtcdStore::connect(&[server.endpoint()])
            .await
            .expect("connect to etcd")
            .with_page_size(600),
    );
    let kvs: Vec<(String, Vec<u8>)> = (0..600)
        .map(|i| (format!("/large/{i:04}"), vec![b'v'; 10 * 1024]))
        .collect();
    put_all(store.as_ref(), kvs.clone()).await;
    let read = store.range("/large/").await.expect("range in halves");
    let keys: Vec<&str> = read.kvs.iter().map(|kv| kv.key.as_str()).collect();
    let written: Vec<&str> = kvs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, written);
}
