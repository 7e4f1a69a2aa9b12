//! The etcd backend on a real three-member cluster: requests, a kept lease and a
//! watch ride out the loss of a follower and then of the leader.
//!
//! What is asserted is what must hold whatever the machine's speed: no request
//! fails, the lease and its key survive, the watch misses nothing, and no request
//! takes longer than the stated failover bound (`FAILOVER_BOUND`). The measured figures are printed for the record.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use iadeep_state::FAILOVER_BOUND;
use iadeep_state::testing::EtcdCluster;
use iadeep_state::{EtcdStore, LeaseHealth, LeaseKeeper, StateStore, WatchEvent};

/// What a stream of requests saw while a member was lost.
#[derive(Debug, Default)]
struct Load {
    done: AtomicU64,
    failed: AtomicU64,
    slowest_ms: AtomicU64,
}

/// Puts then reads `/load/{n}` in a loop until `stop`, counting outcomes.
async fn drive(store: Arc<EtcdStore>, load: Arc<Load>, stop: Arc<AtomicBool>) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let key = format!("/load/{n}");
        let ok = match store.put(&key, n.to_le_bytes().to_vec(), None).await {
            Ok(_) => matches!(store.get(&key).await, Ok(Some(_))),
            Err(err) => {
                eprintln!("request failed: {err}");
                false
            }
        };
        let took = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        load.slowest_ms.fetch_max(took, Ordering::Relaxed);
        if ok {
            load.done.fetch_add(1, Ordering::Relaxed);
        } else {
            load.failed.fetch_add(1, Ordering::Relaxed);
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `load` has answered `n` requests; the bound is for a broken build only,
/// far above the failover bound.
async fn answered(load: &Load, n: u64, when: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while load.done.load(Ordering::Relaxed) < n {
        assert!(
            Instant::now() < deadline,
            "requests were not answered {when}: {load:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs load around losing member `victim` (before the kill, until it resumed, and a
/// little after).
async fn lose_member(
    cluster: &mut EtcdCluster,
    store: &Arc<EtcdStore>,
    victim: usize,
    what: &str,
) -> (u64, u64, u64) {
    let load = Arc::new(Load::default());
    let stop = Arc::new(AtomicBool::new(false));
    let driver = tokio::spawn(drive(store.clone(), load.clone(), stop.clone()));
    // Load runs before the kill: 20 requests answered.
    answered(&load, 20, "before the kill").await;
    let before = store.current_endpoint();
    cluster.kill(victim);
    let killed_at = Instant::now();
    // Until requests are answered again, and 20 more. That each one was answered within
    // the failover bound is asserted from the slowest, once the load stops.
    let done_at_kill = load.done.load(Ordering::Relaxed);
    answered(&load, done_at_kill + 20, &format!("after {what}")).await;
    let resumed_ms = killed_at.elapsed().as_millis();
    answered(&load, done_at_kill + 40, &format!("after {what}")).await;
    stop.store(true, Ordering::Relaxed);
    driver.await.expect("driver");
    let (done, failed, slowest) = (
        load.done.load(Ordering::Relaxed),
        load.failed.load(Ordering::Relaxed),
        load.slowest_ms.load(Ordering::Relaxed),
    );
    eprintln!(
        "{what}: member {victim} killed (requests were on {before}, now on {}); \
         20 requests answered {resumed_ms} ms after the kill; {done} requests ok, \
         {failed} failed, slowest {slowest} ms",
        store.current_endpoint()
    );
    (failed, slowest, done)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_leases_and_watches_survive_a_follower_then_the_leader() {
    let mut cluster = EtcdCluster::start().expect("etcd cluster");
    let leader = cluster.leader(Duration::from_secs(10)).expect("leader");
    let follower = (leader + 1) % 3;
    // Requests go to the first endpoint listed: the follower about to be lost.
    let mut endpoints = cluster.endpoints();
    endpoints.swap(0, follower);
    let store = Arc::new(EtcdStore::connect(&endpoints).await.expect("connect"));
    assert_eq!(store.current_endpoint(), cluster.endpoints()[follower]);

    let ttl = Duration::from_secs(3);
    let lease = store.grant_lease(ttl).await.expect("lease");
    store
        .put("/held", b"mine".to_vec(), Some(lease))
        .await
        .expect("leased put");
    let keeper = LeaseKeeper::spawn(store.clone(), lease, ttl);
    let mut watch = store.watch("/load/", None).await.expect("watch");

    let (failed_follower, slowest_follower, done_follower) =
        lose_member(&mut cluster, &store, follower, "follower loss").await;
    cluster.restart(follower).expect("restart follower");

    let leader = cluster.leader(Duration::from_secs(10)).expect("leader");
    let (failed_leader, slowest_leader, done_leader) =
        lose_member(&mut cluster, &store, leader, "leader loss").await;

    // Outlive the lease's TTL twice more on the two remaining members.
    tokio::time::sleep(ttl * 2).await;
    assert_ne!(keeper.health(), LeaseHealth::Lost, "the lease was lost");
    let held = store.get("/held").await.expect("get").expect("leased key");
    assert_eq!(held.lease, Some(lease));

    // The watch saw every put of both phases, in order, once.
    let expected = done_follower + done_leader;
    let mut seen = 0u64;
    let mut last_revision = 0;
    while seen < expected {
        let event = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .expect("watch event in time")
            .expect("watch open")
            .expect("watch event");
        let WatchEvent::Put(kv) = event else {
            panic!("unexpected {event:?}");
        };
        assert!(kv.mod_revision > last_revision, "revisions go forward");
        last_revision = kv.mod_revision;
        seen += 1;
    }

    let bound = (FAILOVER_BOUND).as_millis();
    assert_eq!(
        (failed_follower, failed_leader),
        (0, 0),
        "requests failed during a member loss"
    );
    for slowest in [slowest_follower, slowest_leader] {
        assert!(
            u128::from(slowest) < bound,
            "{slowest} ms is over the bound {bound} ms"
        );
    }
}

/// A member that hangs rather than dies (SIGSTOP: its connections stay open and
/// nothing is ever answered, as with a frozen machine or a network that drops
/// packets): requests move on after one attempt timeout, a 3 s lease outlives it (its
/// keep-alives wait a quarter of the TTL for one member, not 2 s), and the watch,
/// whose stream was on the frozen member, follows the requests to another one without
/// missing or repeating a put.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_leases_and_watches_survive_a_frozen_member() {
    let mut cluster = EtcdCluster::start().expect("etcd cluster");
    let leader = cluster.leader(Duration::from_secs(10)).expect("leader");
    let follower = (leader + 1) % 3;
    let mut endpoints = cluster.endpoints();
    endpoints.swap(0, follower);
    let store = Arc::new(EtcdStore::connect(&endpoints).await.expect("connect"));
    assert_eq!(store.current_endpoint(), cluster.endpoints()[follower]);

    let ttl = Duration::from_secs(3);
    let lease = store.grant_lease(ttl).await.expect("lease");
    store
        .put("/held", b"mine".to_vec(), Some(lease))
        .await
        .expect("leased put");
    let keeper = LeaseKeeper::spawn(store.clone(), lease, ttl);
    let mut watch = store.watch("/load/", None).await.expect("watch");

    let load = Arc::new(Load::default());
    let stop = Arc::new(AtomicBool::new(false));
    let driver = tokio::spawn(drive(store.clone(), load.clone(), stop.clone()));
    answered(&load, 20, "before the freeze").await;
    cluster.freeze(follower).expect("freeze");
    let frozen_at = Instant::now();
    let done_at_freeze = load.done.load(Ordering::Relaxed);
    answered(&load, done_at_freeze + 20, "after the freeze").await;
    let resumed_ms = frozen_at.elapsed().as_millis();
    answered(&load, done_at_freeze + 40, "after the freeze").await;
    stop.store(true, Ordering::Relaxed);
    driver.await.expect("driver");
    let (done, failed, slowest) = (
        load.done.load(Ordering::Relaxed),
        load.failed.load(Ordering::Relaxed),
        load.slowest_ms.load(Ordering::Relaxed),
    );

    // Every put, in order, once; the bound is for a broken build only.
    let mut seen = 0u64;
    let mut last_revision = 0;
    while seen < done {
        let event = tokio::time::timeout(Duration::from_secs(60), watch.next())
            .await
            .expect("watch event in time")
            .expect("watch open")
            .expect("watch event");
        let WatchEvent::Put(kv) = event else {
            panic!("unexpected {event:?}");
        };
        assert!(kv.mod_revision > last_revision, "revisions go forward");
        last_revision = kv.mod_revision;
        seen += 1;
    }
    let watch_caught_up_ms = frozen_at.elapsed().as_millis();

    // Past the lease's TTL since the freeze, counted from the member's last answer.
    tokio::time::sleep(
        (frozen_at + ttl + Duration::from_secs(1)).saturating_duration_since(Instant::now()),
    )
    .await;
    assert_ne!(keeper.health(), LeaseHealth::Lost, "the lease was lost");
    let held = store.get("/held").await.expect("get").expect("leased key");
    assert_eq!(held.lease, Some(lease));
    eprintln!(
        "frozen member {follower}: requests now on {}; 20 requests answered {resumed_ms} ms \
         after the freeze; {done} ok, {failed} failed, slowest {slowest} ms; the watch had \
         every put {watch_caught_up_ms} ms after the freeze",
        store.current_endpoint()
    );
    assert_eq!(failed, 0, "requests failed while a member was frozen");
    let bound = FAILOVER_BOUND.as_millis();
    assert!(
        u128::from(slowest) < bound,
        "{slowest} ms is over the bound {bound} ms"
    );
    assert_ne!(store.current_endpoint(), cluster.endpoints()[follower]);
    // The watch follows the requests off the frozen member instead of waiting for its
    // connection's pings (10 s + 5 s), so it too is back within the failover bound.
    assert!(
        watch_caught_up_ms < bound,
        "the watch had every put {watch_caught_up_ms} ms after the freeze, over {bound} ms"
    );
    cluster.thaw(follower).expect("thaw");
}
