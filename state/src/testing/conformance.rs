//! The conformance suite every [`StateStore`] backend must pass.
//!
//! Each case takes a fresh, empty store and panics (as a test assertion) when
//! the backend deviates from the semantics of [`crate::StateStore`]. Instantiate the
//! whole suite for a backend with [`conformance_tests!`](crate::conformance_tests):
//!
//! ```ignore
//! async fn fresh() -> (Arc<dyn StateStore>, Box<dyn std::any::Any + Send>) { ... }
//! iadeep_state::conformance_tests!(fresh);
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use iadeep_proto::TaskSpec;

use crate::error::StateError;
use crate::keys;
use crate::store::{CasOutcome, Expect, StateStore, Txn, TxnOutcome, WatchEvent, WatchStream};
use crate::typed;

/// How long a case waits for an event that must come.
const EVENT_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits for the next event of `watch`, failing the test after `EVENT_TIMEOUT`.
pub async fn next_event(watch: &mut WatchStream) -> WatchEvent {
    match tokio::time::timeout(EVENT_TIMEOUT, watch.next()).await {
        Ok(Some(Ok(event))) => event,
        Ok(Some(Err(err))) => panic!("watch failed: {err}"),
        Ok(None) => panic!("watch closed"),
        Err(_) => panic!("no watch event within {EVENT_TIMEOUT:?}"),
    }
}

/// Asserts that `watch` has nothing more to yield so far: puts `marker` (a key under the
/// watched prefix) and expects its put as the very next event. Events come in revision
/// order, so an event that should not be there would come first. No quiet period to wait
/// out, which would pass whenever the store is slower than the period. Returns the
/// marker's revision.
pub async fn assert_no_event_before_marker(
    store: &dyn StateStore,
    watch: &mut WatchStream,
    marker: &str,
) -> crate::Revision {
    let revision = store
        .put(marker, b"marker".to_vec(), None)
        .await
        .expect("put the marker");
    match next_event(watch).await {
        WatchEvent::Put(kv) if kv.key == marker => assert_eq!(kv.mod_revision, revision),
        other => panic!("unexpected watch event before the marker {marker:?}: {other:?}"),
    }
    revision
}

fn put_key(event: &WatchEvent) -> Option<&str> {
    match event {
        WatchEvent::Put(kv) => Some(&kv.key),
        WatchEvent::Delete { .. } => None,
    }
}

/// get / put / delete, with etcd's revision and version bookkeeping.
pub async fn put_get_delete(store: Arc<dyn StateStore>) {
    assert_eq!(store.get("/c/a").await.expect("get"), None);
    let r1 = store.put("/c/a", b"one".to_vec(), None).await.expect("put");
    let r2 = store.put("/c/a", b"two".to_vec(), None).await.expect("put");
    assert!(r2 > r1, "revisions increase: {r1} then {r2}");
    let kv = store.get("/c/a").await.expect("get").expect("present");
    assert_eq!(kv.value, b"two");
    assert_eq!(kv.create_revision, r1);
    assert_eq!(kv.mod_revision, r2);
    assert_eq!(kv.version, 2);
    assert_eq!(kv.lease, None);
    assert!(store.delete("/c/a").await.expect("delete"));
    assert_eq!(store.get("/c/a").await.expect("get"), None);
    assert!(!store.delete("/c/a").await.expect("delete absent"));
    let r3 = store
        .put("/c/a", b"three".to_vec(), None)
        .await
        .expect("put");
    let kv = store.get("/c/a").await.expect("get").expect("present");
    assert_eq!(
        (kv.create_revision, kv.version),
        (r3, 1),
        "re-created key starts over"
    );
}

/// A prefix range returns exactly the keys under the prefix, sorted.
pub async fn range_is_prefix_bounded_and_sorted(store: Arc<dyn StateStore>) {
    for key in ["/r/b", "/r/a", "/r/c", "/rr/x", "/q/z"] {
        store
            .put(key, key.as_bytes().to_vec(), None)
            .await
            .expect("put");
    }
    let last = store.put("/r/d", b"d".to_vec(), None).await.expect("put");
    let snapshot = store.range("/r/").await.expect("range");
    let keys: Vec<&str> = snapshot.kvs.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, ["/r/a", "/r/b", "/r/c", "/r/d"]);
    assert!(snapshot.revision >= last);
    assert!(
        store
            .range("/nothing/")
            .await
            .expect("range")
            .kvs
            .is_empty()
    );
}

/// Pages cover a prefix exactly once, in order, and say when more follow; a page
/// may start after a key that is not there (deleted since) or before the prefix.
pub async fn range_pages_cover_the_prefix(store: Arc<dyn StateStore>) {
    let mut expected = Vec::new();
    for i in 0..23 {
        let key = format!("/pg/{i:03}");
        store.put(&key, vec![1], None).await.expect("put");
        expected.push(key);
    }
    for key in ["/pg", "/pg0", "/ph/a", "/pf/z"] {
        store.put(key, vec![2], None).await.expect("put");
    }
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    let mut pages = 0;
    loop {
        let page = store
            .range_page("/pg/", after.as_deref(), 5)
            .await
            .expect("page");
        pages += 1;
        assert!(page.kvs.len() <= 5, "{page:?}");
        seen.extend(page.kvs.iter().map(|kv| kv.key.clone()));
        match page.next_after() {
            Some(next) => after = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(seen, expected);
    assert_eq!(pages, 5, "4 full pages and one of 3");
    let gap = store
        .range_page("/pg/", Some("/pg/0105"), 2)
        .await
        .expect("page after an absent key");
    let keys: Vec<&str> = gap.kvs.iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, ["/pg/011", "/pg/012"]);
    assert!(gap.more);
    let before = store
        .range_page("/pg/", Some("/a"), 1)
        .await
        .expect("page after a key before the prefix");
    assert_eq!(before.kvs[0].key, "/pg/000");
    let last = store
        .range_page("/pg/", Some("/pg/022"), 5)
        .await
        .expect("past the end");
    assert!(last.kvs.is_empty() && !last.more, "{last:?}");
}

/// Compare-and-swap on absence and on mod-revision.
pub async fn compare_and_swap_semantics(store: Arc<dyn StateStore>) {
    let first = store
        .compare_and_swap("/cas/k", Expect::Absent, b"v1".to_vec(), None)
        .await
        .expect("cas");
    let CasOutcome::Swapped { revision: r1 } = first else {
        panic!("creating an absent key must swap: {first:?}");
    };
    let again = store
        .compare_and_swap("/cas/k", Expect::Absent, b"other".to_vec(), None)
        .await
        .expect("cas");
    match again {
        CasOutcome::Conflict { current: Some(kv) } => assert_eq!(kv.value, b"v1"),
        other => panic!("key exists, must conflict with its value: {other:?}"),
    }
    let swapped = store
        .compare_and_swap("/cas/k", Expect::ModRevision(r1), b"v2".to_vec(), None)
        .await
        .expect("cas");
    assert!(swapped.swapped(), "{swapped:?}");
    let missing = store
        .compare_and_swap("/cas/none", Expect::ModRevision(r1), b"x".to_vec(), None)
        .await
        .expect("cas");
    assert_eq!(missing, CasOutcome::Conflict { current: None });
    assert_eq!(store.get("/cas/none").await.expect("get"), None);
}

/// Fault: a compare-and-swap on a stale revision fails and writes nothing.
pub async fn stale_compare_and_swap_writes_nothing(store: Arc<dyn StateStore>) {
    let stale = store
        .put("/stale/k", b"old".to_vec(), None)
        .await
        .expect("put");
    let fresh = store
        .put("/stale/k", b"new".to_vec(), None)
        .await
        .expect("put");
    let before = store.range("/stale/").await.expect("range").revision;
    let outcome = store
        .compare_and_swap(
            "/stale/k",
            Expect::ModRevision(stale),
            b"lost".to_vec(),
            None,
        )
        .await
        .expect("cas");
    match outcome {
        CasOutcome::Conflict { current: Some(kv) } => {
            assert_eq!((kv.value.as_slice(), kv.mod_revision), (&b"new"[..], fresh));
        }
        other => panic!("stale revision must conflict: {other:?}"),
    }
    let kv = store.get("/stale/k").await.expect("get").expect("present");
    assert_eq!(kv.value, b"new");
    assert_eq!(kv.mod_revision, fresh);
    assert_eq!(kv.version, 2);
    let after = store.range("/stale/").await.expect("range").revision;
    assert_eq!(after, before, "a failed CAS must not advance the revision");
    assert!(
        !store
            .compare_and_delete("/stale/k", stale)
            .await
            .expect("cad")
    );
    assert!(store.get("/stale/k").await.expect("get").is_some());
    assert!(
        store
            .compare_and_delete("/stale/k", fresh)
            .await
            .expect("cad")
    );
    assert_eq!(store.get("/stale/k").await.expect("get"), None);
}

/// A transaction whose comparisons hold applies every operation at ONE new revision:
/// puts create and update keys, deletes remove them, a watcher sees all of it at
/// that revision, and keys it does not name are untouched.
pub async fn transaction_applies_all_at_one_revision(store: Arc<dyn StateStore>) {
    let ra = store.put("/tx/a", b"a1".to_vec(), None).await.expect("put");
    store.put("/tx/c", b"c1".to_vec(), None).await.expect("put");
    let other = store.put("/tx/z", b"z".to_vec(), None).await.expect("put");
    let mut watch = store.watch("/tx/", None).await.expect("watch");
    let txn = Txn::new()
        .compare("/tx/a", Expect::ModRevision(ra))
        .compare("/tx/b", Expect::Absent)
        .put("/tx/a", b"a2".to_vec(), None)
        .put("/tx/b", b"b1".to_vec(), None)
        .delete("/tx/c")
        .delete("/tx/never");
    let outcome = store.transact(txn).await.expect("transact");
    let TxnOutcome::Committed { revision } = outcome else {
        panic!("every comparison holds, must commit: {outcome:?}");
    };
    assert!(revision > other, "a commit advances the revision");
    let a = store.get("/tx/a").await.expect("get").expect("a");
    assert_eq!(
        (a.value.as_slice(), a.mod_revision, a.version),
        (&b"a2"[..], revision, 2)
    );
    let b = store.get("/tx/b").await.expect("get").expect("b");
    assert_eq!(
        (b.create_revision, b.mod_revision, b.version),
        (revision, revision, 1)
    );
    assert_eq!(store.get("/tx/c").await.expect("get"), None);
    let z = store.get("/tx/z").await.expect("get").expect("z");
    assert_eq!(
        z.mod_revision, other,
        "a key the transaction does not name is untouched"
    );
    assert_eq!(store.range("/tx/").await.expect("range").revision, revision);
    let mut seen = Vec::new();
    for _ in 0..3 {
        let event = next_event(&mut watch).await;
        assert_eq!(event.revision(), revision, "{event:?}");
        seen.push((event.key().to_owned(), matches!(event, WatchEvent::Put(_))));
    }
    seen.sort();
    assert_eq!(
        seen,
        [
            ("/tx/a".to_owned(), true),
            ("/tx/b".to_owned(), true),
            ("/tx/c".to_owned(), false)
        ]
    );

    // Deleting only absent keys commits without a new revision, as in etcd.
    let noop = store
        .transact(Txn::new().delete("/tx/never"))
        .await
        .expect("transact");
    assert_eq!(noop, TxnOutcome::Committed { revision });
    assert_no_event_before_marker(store.as_ref(), &mut watch, "/tx/marker").await;
}

/// Fault: one failed comparison among several fails the whole transaction: nothing
/// is written, the revision does not move, and the caller gets every compared key as
/// it is now, in the order of the comparisons.
pub async fn failed_transaction_writes_nothing(store: Arc<dyn StateStore>) {
    let stale = store
        .put("/txf/a", b"old".to_vec(), None)
        .await
        .expect("put");
    let fresh = store
        .put("/txf/a", b"new".to_vec(), None)
        .await
        .expect("put");
    let b = store.put("/txf/b", b"b".to_vec(), None).await.expect("put");
    let before = store.range("/txf/").await.expect("range").revision;
    let txn = Txn::new()
        .compare("/txf/b", Expect::ModRevision(b))
        .compare("/txf/a", Expect::ModRevision(stale))
        .compare("/txf/none", Expect::Absent)
        .put("/txf/b", b"lost".to_vec(), None)
        .put("/txf/new", b"lost".to_vec(), None)
        .delete("/txf/a");
    match store.transact(txn).await.expect("transact") {
        TxnOutcome::Failed { current } => {
            assert_eq!(current.len(), 3, "{current:?}");
            let b_now = current[0].as_ref().expect("b is there");
            assert_eq!((b_now.value.as_slice(), b_now.mod_revision), (&b"b"[..], b));
            let a_now = current[1].as_ref().expect("a is there");
            assert_eq!(
                (a_now.value.as_slice(), a_now.mod_revision),
                (&b"new"[..], fresh)
            );
            assert_eq!(current[2], None);
        }
        other => panic!("a stale comparison must fail the transaction: {other:?}"),
    }
    assert_eq!(store.range("/txf/").await.expect("range").revision, before);
    let a = store.get("/txf/a").await.expect("get").expect("a survives");
    assert_eq!(a.value, b"new");
    let b_kv = store.get("/txf/b").await.expect("get").expect("b");
    assert_eq!(b_kv.value, b"b");
    assert_eq!(store.get("/txf/new").await.expect("get"), None);

    // A key that must be absent but exists fails it too.
    let txn = Txn::new()
        .compare("/txf/b", Expect::Absent)
        .put("/txf/new", b"lost".to_vec(), None);
    assert!(!store.transact(txn).await.expect("transact").committed());
    assert_eq!(store.get("/txf/new").await.expect("get"), None);

    // Writing one key twice is refused, not applied in some order.
    let twice = Txn::new()
        .put("/txf/new", b"1".to_vec(), None)
        .delete("/txf/new");
    match store.transact(twice).await {
        Err(StateError::InvalidTxn { reason }) => assert!(reason.contains("/txf/new"), "{reason}"),
        other => panic!("a key written twice must be refused: {other:?}"),
    }
    assert_eq!(store.get("/txf/new").await.expect("get"), None);
}

/// A transaction's puts carry their lease (revoking it deletes them, not the
/// unleased ones), and a put bound to a lease that is gone fails the whole
/// transaction with nothing written.
pub async fn transaction_attaches_leases(store: Arc<dyn StateStore>) {
    let lease = store
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("grant");
    let txn = Txn::new()
        .compare("/txl/leased", Expect::Absent)
        .put("/txl/leased", b"l".to_vec(), Some(lease))
        .put("/txl/plain", b"p".to_vec(), None);
    assert!(store.transact(txn).await.expect("transact").committed());
    let leased = store
        .get("/txl/leased")
        .await
        .expect("get")
        .expect("leased");
    assert_eq!(leased.lease, Some(lease));
    store.revoke_lease(lease).await.expect("revoke");
    assert_eq!(store.get("/txl/leased").await.expect("get"), None);
    assert!(store.get("/txl/plain").await.expect("get").is_some());
    let before = store.range("/txl/").await.expect("range").revision;
    let txn = Txn::new().put("/txl/other", b"o".to_vec(), None).put(
        "/txl/leased",
        b"l".to_vec(),
        Some(lease),
    );
    match store.transact(txn).await {
        Err(StateError::LeaseNotFound(id)) => assert_eq!(id, lease),
        other => panic!("a put with a revoked lease must fail the transaction: {other:?}"),
    }
    assert_eq!(store.get("/txl/other").await.expect("get"), None);
    assert_eq!(store.range("/txl/").await.expect("range").revision, before);
}

/// Concurrent transactions that each add one to a counter with a comparison on its
/// revision never lose an update: the final count equals the commits, and the
/// commits' revisions are all different.
pub async fn concurrent_transactions_serialise(store: Arc<dyn StateStore>) {
    const WRITERS: usize = 8;
    const ADDS: usize = 5;
    store.put("/txc/n", b"0".to_vec(), None).await.expect("put");
    let mut handles = Vec::new();
    for w in 0..WRITERS {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            let mut revisions = Vec::new();
            while revisions.len() < ADDS {
                let kv = store.get("/txc/n").await.expect("get").expect("counter");
                let n: u64 = std::str::from_utf8(&kv.value)
                    .expect("utf8")
                    .parse()
                    .expect("number");
                let txn = Txn::new()
                    .compare("/txc/n", Expect::ModRevision(kv.mod_revision))
                    .put("/txc/n", (n + 1).to_string().into_bytes(), None)
                    .put(format!("/txc/by/{w}/{}", revisions.len()), vec![], None);
                if let TxnOutcome::Committed { revision } =
                    store.transact(txn).await.expect("transact")
                {
                    revisions.push(revision);
                }
            }
            revisions
        }));
    }
    let mut revisions = Vec::new();
    for handle in handles {
        revisions.extend(handle.await.expect("writer"));
    }
    let kv = store.get("/txc/n").await.expect("get").expect("counter");
    assert_eq!(kv.value, (WRITERS * ADDS).to_string().into_bytes());
    revisions.sort_unstable();
    revisions.dedup();
    assert_eq!(revisions.len(), WRITERS * ADDS, "one revision per commit");
    let markers = store.range("/txc/by/").await.expect("range").kvs;
    assert_eq!(markers.len(), WRITERS * ADDS);
}

/// A watch sees puts and deletes under its prefix, in order, and nothing else.
pub async fn watch_sees_changes_in_order(store: Arc<dyn StateStore>) {
    let mut watch = store.watch("/w/", None).await.expect("watch");
    store.put("/w/a", b"1".to_vec(), None).await.expect("put");
    store
        .put("/other/a", b"x".to_vec(), None)
        .await
        .expect("put");
    store.put("/w/b", b"2".to_vec(), None).await.expect("put");
    store.delete("/w/a").await.expect("delete");
    let mut last = 0;
    let mut seen = Vec::new();
    for _ in 0..3 {
        let event = next_event(&mut watch).await;
        assert!(event.revision() > last, "revision order");
        last = event.revision();
        seen.push(match &event {
            WatchEvent::Put(kv) => format!("put {} {}", kv.key, String::from_utf8_lossy(&kv.value)),
            WatchEvent::Delete { key, .. } => format!("delete {key}"),
        });
    }
    assert_eq!(seen, ["put /w/a 1", "put /w/b 2", "delete /w/a"]);
    assert_no_event_before_marker(store.as_ref(), &mut watch, "/w/marker").await;
}

/// A watch from an old revision replays history, then continues live.
pub async fn watch_resumes_from_a_revision(store: Arc<dyn StateStore>) {
    let mut revisions = Vec::new();
    for i in 0..5 {
        revisions.push(
            store
                .put(&format!("/h/{i}"), vec![i], None)
                .await
                .expect("put"),
        );
    }
    let mut watch = store.watch("/h/", Some(revisions[2])).await.expect("watch");
    for i in 2..5u8 {
        let event = next_event(&mut watch).await;
        assert_eq!(put_key(&event), Some(format!("/h/{i}").as_str()));
        assert_eq!(event.revision(), revisions[usize::from(i)]);
    }
    store
        .put("/h/live", b"x".to_vec(), None)
        .await
        .expect("put");
    assert_eq!(put_key(&next_event(&mut watch).await), Some("/h/live"));
}

/// Range at revision R then watch from R+1: every later change, no gap, no repeat.
pub async fn range_then_watch_has_no_gap(store: Arc<dyn StateStore>) {
    store.put("/g/0", b"0".to_vec(), None).await.expect("put");
    let snapshot = store.range("/g/").await.expect("range");
    assert_eq!(snapshot.kvs.len(), 1);
    store.put("/g/1", b"1".to_vec(), None).await.expect("put");
    store.put("/g/2", b"2".to_vec(), None).await.expect("put");
    let mut watch = store
        .watch("/g/", Some(snapshot.revision + 1))
        .await
        .expect("watch");
    assert_eq!(put_key(&next_event(&mut watch).await), Some("/g/1"));
    assert_eq!(put_key(&next_event(&mut watch).await), Some("/g/2"));
    assert_no_event_before_marker(store.as_ref(), &mut watch, "/g/marker").await;
}

/// Fault: a lease that stops being kept alive expires; its keys disappear with
/// delete events. While kept alive, it outlives its TTL.
pub async fn unkept_lease_expires_and_deletes_its_keys(store: Arc<dyn StateStore>) {
    // Refreshed every quarter second, so a lapse needs a stall of over 2.7 s: a loaded
    // machine's scheduler must not end the lease the test keeps.
    let ttl = Duration::from_secs(3);
    let lease = store.grant_lease(ttl).await.expect("grant");
    store
        .put("/lease/alive", b"1".to_vec(), Some(lease))
        .await
        .expect("put with lease");
    store
        .put("/lease/plain", b"2".to_vec(), None)
        .await
        .expect("put");
    let kv = store
        .get("/lease/alive")
        .await
        .expect("get")
        .expect("present");
    assert_eq!(kv.lease, Some(lease));
    let mut watch = store.watch("/lease/", None).await.expect("watch");

    // Kept alive for well past its TTL: still there. (A refresh must come within the
    // TTL of the one before, a real-time bound no virtual clock can stand in for: the
    // stores count leases on the wall clock, as etcd does.)
    let kept_until = Instant::now() + ttl * 2;
    let last_refresh = loop {
        // Taken before the call: the store renews the lease when the call reaches it,
        // at this instant or later, so the expiry below is timed from no later than
        // the renewal, whatever delays the answer on a loaded machine.
        let sent = Instant::now();
        store.keep_alive(lease).await.expect("keep alive");
        if sent >= kept_until {
            break sent;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(store.get("/lease/alive").await.expect("get").is_some());

    // Left alone: it expires (etcd may take up to about twice the TTL to notice), and
    // not before most of its TTL after the last refresh (a lower bound: load only
    // makes the wait longer).
    let expired = tokio::time::timeout(ttl * 10, watch.next()).await;
    match expired {
        Ok(Some(Ok(WatchEvent::Delete { key, .. }))) => assert_eq!(key, "/lease/alive"),
        other => panic!("expected the leased key's delete event, got {other:?}"),
    }
    let waited = last_refresh.elapsed();
    assert!(
        waited >= ttl / 2,
        "expired too early: {waited:?} after the last refresh"
    );
    assert_eq!(store.get("/lease/alive").await.expect("get"), None);
    assert!(store.get("/lease/plain").await.expect("get").is_some());
    match store.keep_alive(lease).await {
        Err(StateError::LeaseNotFound(id)) => assert_eq!(id, lease),
        other => panic!("keep-alive of an expired lease must fail: {other:?}"),
    }
}

/// Revoking a lease deletes its keys at once; revoking again is fine.
pub async fn revoke_deletes_keys_now(store: Arc<dyn StateStore>) {
    let lease = store
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("grant");
    store
        .put("/rev/a", vec![1], Some(lease))
        .await
        .expect("put");
    store
        .put("/rev/b", vec![2], Some(lease))
        .await
        .expect("put");
    store.revoke_lease(lease).await.expect("revoke");
    assert!(store.range("/rev/").await.expect("range").kvs.is_empty());
    store
        .revoke_lease(lease)
        .await
        .expect("revoking twice is not an error");
    match store.put("/rev/c", vec![3], Some(lease)).await {
        Err(StateError::LeaseNotFound(id)) => assert_eq!(id, lease),
        other => panic!("put with a revoked lease must fail: {other:?}"),
    }
    assert_eq!(store.get("/rev/c").await.expect("get"), None);
}

/// Re-putting a leased key without a lease detaches it from the lease.
pub async fn put_without_lease_detaches_key(store: Arc<dyn StateStore>) {
    let lease = store
        .grant_lease(Duration::from_secs(60))
        .await
        .expect("grant");
    store
        .put("/det/k", vec![1], Some(lease))
        .await
        .expect("put");
    store.put("/det/k", vec![2], None).await.expect("put");
    store.revoke_lease(lease).await.expect("revoke");
    let kv = store
        .get("/det/k")
        .await
        .expect("get")
        .expect("survives revoke");
    assert_eq!((kv.value, kv.lease), (vec![2], None));
}

/// Fault: a value that does not decode is an error naming the key, never a panic.
pub async fn undecodable_value_names_its_key(store: Arc<dyn StateStore>) {
    let key = keys::task_spec("broken-task");
    // Field 1, length-delimited, claims 5 bytes but carries 1.
    store
        .put(&key, vec![0x0a, 0x05, 0x01], None)
        .await
        .expect("put");
    match typed::get::<TaskSpec>(store.as_ref(), &key).await {
        Err(err @ StateError::Decode { .. }) => {
            let text = err.to_string();
            assert!(text.contains(&key), "error must name the key: {text}");
            assert!(
                text.contains("TaskSpec"),
                "error must name the type: {text}"
            );
        }
        other => panic!("expected a decode error, got {other:?}"),
    }
    let listed = typed::list::<TaskSpec>(store.as_ref(), keys::TASKS, |_| true).await;
    assert!(
        matches!(listed, Err(StateError::Decode { .. })),
        "{listed:?}"
    );
}

/// Typed values round-trip.
pub async fn typed_values_round_trip(store: Arc<dyn StateStore>) {
    let spec = TaskSpec {
        task_id: "t1".into(),
        model: "ResNet-18".into(),
        initial_batch_size: 128,
        ..Default::default()
    };
    let key = keys::task_spec("t1");
    typed::put(store.as_ref(), &key, &spec, None)
        .await
        .expect("put");
    let (back, kv) = typed::get::<TaskSpec>(store.as_ref(), &key)
        .await
        .expect("get")
        .expect("present");
    assert_eq!(back, spec);
    assert_eq!(kv.key, key);
    let (listed, _) =
        typed::list::<TaskSpec>(store.as_ref(), keys::TASKS, |k| k.ends_with("/spec"))
            .await
            .expect("list");
    assert_eq!(listed.len(), 1);
}

/// Instantiates every conformance case as a `#[tokio::test]` for one backend.
///
/// `$fresh` is an async fn returning `(Arc<dyn StateStore>, guard)`; the guard
/// (e.g. the etcd server) lives until the case ends.
#[macro_export]
macro_rules! conformance_tests {
    ($fresh:path) => {
        $crate::conformance_tests!(@cases $fresh;
            put_get_delete,
            range_is_prefix_bounded_and_sorted,
            range_pages_cover_the_prefix,
            compare_and_swap_semantics,
            stale_compare_and_swap_writes_nothing,
            transaction_applies_all_at_one_revision,
            failed_transaction_writes_nothing,
            transaction_attaches_leases,
            concurrent_transactions_serialise,
            watch_sees_changes_in_order,
            watch_resumes_from_a_revision,
            range_then_watch_has_no_gap,
            unkept_lease_expires_and_deletes_its_keys,
            revoke_deletes_keys_now,
            put_without_lease_detaches_key,
            undecodable_value_names_its_key,
            typed_values_round_trip,
        );
    };
    (@cases $fresh:path; $($case:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let (store, _guard) = $fresh().await;
                $crate::testing::conformance::$case(store).await;
            }
        )+
    };
}
