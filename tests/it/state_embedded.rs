//! The embedded backend: the shared conformance suite, plus what only a file store has
//! (surviving a restart of the process, one process per file).

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use iadeep_state::testing::conformance::{assert_no_event_before_marker, next_event};
use iadeep_state::{EmbeddedStore, LeaseHealth, LeaseKeeper, StateError, StateStore, WatchEvent};

async fn fresh() -> (Arc<dyn StateStore>, Box<dyn Any + Send>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = EmbeddedStore::open(dir.path().join("state.redb")).expect("open");
    (Arc::new(store), Box::new(dir))
}

mod conformance {
    use super::fresh;
    iadeep_state::conformance_tests!(fresh);
}

mod in_memory_conformance {
    use std::any::Any;
    use std::sync::Arc;

    use iadeep_state::{EmbeddedStore, StateStore};

    async fn fresh() -> (Arc<dyn StateStore>, Box<dyn Any + Send>) {
        (
            Arc::new(EmbeddedStore::in_memory().expect("open")),
            Box::new(()),
        )
    }
    iadeep_state::conformance_tests!(fresh);
}

/// Keys without a lease survive a restart of the process; keys bound to a lease
/// of the dead process are deleted; a watch resumes from a revision across it.
#[tokio::test]
async fn restart_keeps_plain_keys_drops_leased_keys_and_history_resumes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("nested/dir/state.redb");
    let (kept_rev, leased_rev) = {
        let store = EmbeddedStore::open(&path).expect("open");
        let lease = store
            .grant_lease(Duration::from_secs(60))
            .await
            .expect("grant");
        let kept = store
            .put("/x/kept", b"k".to_vec(), None)
            .await
            .expect("put");
        let leased = store
            .put("/x/leased", b"l".to_vec(), Some(lease))
            .await
            .expect("put");
        (kept, leased)
        // The store is dropped here, as if the process ended.
    };
    let store = EmbeddedStore::open(&path).expect("reopen");
    let kept = store.get("/x/kept").await.expect("get").expect("kept");
    assert_eq!(
        (kept.value.as_slice(), kept.mod_revision),
        (&b"k"[..], kept_rev)
    );
    assert_eq!(store.get("/x/leased").await.expect("get"), None);

    // History: the two puts, then the delete of the orphaned leased key.
    let mut watch = store.watch("/x/", Some(kept_rev)).await.expect("watch");
    assert_eq!(next_event(&mut watch).await.revision(), kept_rev);
    assert_eq!(next_event(&mut watch).await.revision(), leased_rev);
    match next_event(&mut watch).await {
        WatchEvent::Delete { key, revision } => {
            assert_eq!(key, "/x/leased");
            assert!(revision > leased_rev);
        }
        other => panic!("expected the orphan's delete, got {other:?}"),
    }
    let next = assert_no_event_before_marker(&store, &mut watch, "/x/new").await;
    assert!(next > leased_rev, "revisions continue after a restart");
}

/// A second opener of the same file gets an error that says what to do.
#[tokio::test]
async fn second_process_on_the_same_file_gets_a_clear_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("state.redb");
    let _first = EmbeddedStore::open(&path).expect("open");
    let err = EmbeddedStore::open(&path).expect_err("second open must fail");
    let text = err.to_string();
    assert!(text.contains("already open"), "{text}");
    assert!(text.contains(&path.display().to_string()), "{text}");
}

/// A file that is not a store is reported with its path, never a panic.
#[tokio::test]
async fn unreadable_file_is_reported_with_its_path() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("not-a-store.redb");
    std::fs::write(&path, b"this is not a redb database, just text").expect("write");
    let err = EmbeddedStore::open(&path).expect_err("garbage must not open");
    assert!(matches!(err, StateError::Embedded { .. }), "{err:?}");
    assert!(err.to_string().contains("not-a-store.redb"), "{err}");
}

/// Watching from a revision older than the kept history is an explicit error.
#[tokio::test]
async fn watch_from_compacted_history_is_an_error() {
    let store = EmbeddedStore::in_memory_with_history(10).expect("open");
    for i in 0..50u8 {
        store.put("/c/k", vec![i], None).await.expect("put");
    }
    match store.watch("/c/", Some(1)).await {
        Err(StateError::Compacted {
            requested, oldest, ..
        }) => {
            assert_eq!(requested, 1);
            assert!(oldest > 1 && oldest <= 41, "oldest {oldest}");
        }
        other => panic!("expected Compacted, got {other:?}"),
    }
    // Recent history is still there.
    let mut watch = store.watch("/c/", Some(48)).await.expect("watch");
    assert_eq!(next_event(&mut watch).await.revision(), 48);
}

/// A watch starting at a future revision sees nothing before it.
#[tokio::test]
async fn watch_from_a_future_revision_skips_earlier_changes() {
    let store = EmbeddedStore::in_memory().expect("open");
    let now = store.put("/f/a", vec![], None).await.expect("put");
    let mut watch = store.watch("/f/", Some(now + 3)).await.expect("watch");
    for i in 1..=4u8 {
        store.put("/f/a", vec![i], None).await.expect("put");
    }
    let first = next_event(&mut watch).await;
    assert_eq!(first.revision(), now + 3);
    assert_eq!(next_event(&mut watch).await.revision(), now + 4);
    assert_no_event_before_marker(&store, &mut watch, "/f/marker").await;
}

/// The keeper holds a lease well past its TTL; once stopped, the lease expires;
/// a revoked lease is reported lost.
#[tokio::test]
async fn lease_keeper_keeps_a_lease_until_stopped_and_reports_loss() {
    let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("open"));
    // The keeper refreshes every third of the TTL: a lapse needs a stall of over 2 s,
    // which a loaded machine's scheduler must not cause.
    let ttl = Duration::from_secs(3);
    let lease = store.grant_lease(ttl).await.expect("grant");
    store
        .put("/k/alive", vec![1], Some(lease))
        .await
        .expect("put");
    let keeper = LeaseKeeper::spawn(store.clone(), lease, ttl);
    tokio::time::sleep(ttl * 2).await;
    assert_eq!(keeper.health(), LeaseHealth::Alive);
    assert!(
        store.get("/k/alive").await.expect("get").is_some(),
        "kept past its TTL"
    );
    keeper.stop();
    // Expired once not kept: the store's reaper deletes it a TTL after the last refresh,
    // or later on a loaded machine, so wait for the delete rather than a fixed time.
    let mut watch = store.watch("/k/", None).await.expect("watch");
    if store.get("/k/alive").await.expect("get").is_some() {
        match next_event(&mut watch).await {
            WatchEvent::Delete { key, .. } => assert_eq!(key, "/k/alive", "expired once not kept"),
            other => panic!("expected the leased key's delete, got {other:?}"),
        }
    }

    let lease = store
        .grant_lease(Duration::from_secs(3))
        .await
        .expect("grant");
    let mut keeper = LeaseKeeper::spawn(store.clone(), lease, Duration::from_secs(3));
    store.revoke_lease(lease).await.expect("revoke");
    tokio::time::timeout(Duration::from_secs(5), keeper.lost())
        .await
        .expect("loss reported within two refresh periods");
    assert_eq!(keeper.health(), LeaseHealth::Lost);
}
