//! The placer's cap-breach eviction over a real etcd (issue 27, item 4): jobs placed
//! through a placer daemon's gRPC service, a breach record written at the device's
//! `breach` key exactly as a tuner writes it, and the daemon's own eviction loop acting
//! on it. What the store holds afterwards is checked through its watch, event by event,
//! so "nothing else changed" is a fact about every write, not about a few keys.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use iadeep_placer::eviction::{Outcome, act_on_breach, evict_on_breaches};
use iadeep_placer::{
    Clock, ClusterView, Daemon, DaemonConfig, ModelledMemory, NoEvents, PlacementService, ViewSync,
};
use iadeep_proto::placer_client::PlacerClient;
use iadeep_proto::{AvoidPairing, BatchSizeAssignment, CapBreach, PriorityClass, TaskSpec};
use iadeep_state::testing::{EtcdServer, FaultStore, Op, start_etcd};
use iadeep_state::{EtcdStore, KeyValue, StateStore, WatchEvent, WatchStream, keys, typed};

use crate::placer::{eventually, loopback, place_on, placer, register, task};

const DEVICE: &str = "cap.gpu0";
const PROD: &str = "prod";
/// The co-runner with the heavier solo profile: the one the placer's model blames.
const HEAVY: &str = "opp-heavy";
const LIGHT: &str = "opp-light";
/// Generous, so that placement admits the three together; the breach is measured, and
/// says the job is above it anyway.
const CAP: f64 = 4.0;

async fn etcd_store(server: &EtcdServer) -> Arc<dyn StateStore> {
    Arc::new(
        EtcdStore::connect(&[server.endpoint()])
            .await
            .expect("connect to etcd"),
    )
}

/// A placer daemon with gRPC only (its dead-task reaper and eviction loop run whatever
/// the config).
async fn daemon(store: Arc<dyn StateStore>) -> Daemon {
    let config = DaemonConfig {
        grpc: loopback(),
        extender: None,
        metrics: None,
        dead_task_grace: None,
        unstarted_task_grace: None,
        tls: None,
    };
    Daemon::start(store, placer(), Arc::new(ModelledMemory), config)
        .await
        .expect("start the placer")
}

fn production(id: &str) -> TaskSpec {
    TaskSpec {
        priority_class: PriorityClass::Production as i32,
        max_slowdown: Some(CAP),
        ..task(id, 3_000, 30.0)
    }
}

fn opportunistic(id: &str, sm: f64) -> TaskSpec {
    TaskSpec {
        priority_class: PriorityClass::Opportunistic as i32,
        ..task(id, 3_000, sm)
    }
}

/// A production job and two opportunistic co-runners placed on [`DEVICE`] through
/// `daemon`'s gRPC service.
async fn place_three(store: &dyn StateStore, daemon: &Daemon) {
    register_device(store, daemon).await;
    let mut client = PlacerClient::connect(format!("http://{}", daemon.grpc_addr()))
        .await
        .expect("connect to the placer");
    place_on(&mut client, production(PROD), DEVICE).await;
    place_on(&mut client, opportunistic(HEAVY, 95.0), DEVICE).await;
    place_on(&mut client, opportunistic(LIGHT, 5.0), DEVICE).await;
}

async fn register_device(store: &dyn StateStore, daemon: &Daemon) {
    register(store, DEVICE, "cap", 32_768).await;
    // The device reaches the daemon's view through its watch: a readiness wait, bounded
    // only so that a view that never sees it fails the test.
    eventually("the placer's view to see the device", async || {
        daemon.service().view().device(DEVICE).is_some()
    })
    .await;
}

/// The record a device's tuner writes when `PROD` stays above its cap with both
/// co-runners at their smallest size: the type and key of the tuner daemon's
/// `Driver::breached` (a plain put, no lease).
async fn write_breach(store: &dyn StateStore) -> KeyValue {
    let breach = CapBreach {
        device_id: DEVICE.into(),
        task_id: PROD.into(),
        measured_pd: 4.4,
        max_slowdown: CAP,
        rounds_above: 3,
        opportunistic_task_ids: vec![HEAVY.into(), LIGHT.into()],
        round: 9,
        at_unix_ms: iadeep_proto::now_unix_ms(),
    };
    let key = keys::device_breach(DEVICE);
    typed::put(store, &key, &breach, None)
        .await
        .expect("write the breach");
    store
        .get(&key)
        .await
        .expect("read the breach")
        .expect("the breach")
}

/// Every event `watch` delivers up to a marker key written now (events come in revision
/// order, so once the marker arrives every earlier write has), the marker excluded.
async fn events_until_marker(store: &dyn StateStore, watch: &mut WatchStream) -> Vec<WatchEvent> {
    let marker = format!("{}test-marker", keys::ROOT);
    store
        .put(&marker, b"end".to_vec(), None)
        .await
        .expect("put the marker");
    let mut events = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(30), watch.next()).await {
            Ok(Some(Ok(WatchEvent::Put(kv)))) if kv.key == marker => {
                store.delete(&marker).await.expect("delete the marker");
                return events;
            }
            Ok(Some(Ok(event))) => events.push(event),
            Ok(Some(Err(err))) => panic!("watch failed: {err}"),
            Ok(None) => panic!("the watch ended before the marker"),
            Err(_) => panic!("the marker did not arrive within 30 s"),
        }
    }
}

/// Waits for the watch to deliver the breach record's deletion; returns every event up
/// to it, the deletion included.
async fn until_breach_deleted(watch: &mut WatchStream) -> Vec<WatchEvent> {
    let key = keys::device_breach(DEVICE);
    let mut events = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(30), watch.next()).await {
            Ok(Some(Ok(event))) => {
                let done = matches!(&event, WatchEvent::Delete { key: k, .. } if *k == key);
                events.push(event);
                if done {
                    return events;
                }
            }
            Ok(Some(Err(err))) => panic!("watch failed: {err}"),
            Ok(None) => panic!("the watch ended before the breach was deleted"),
            Err(_) => panic!("the breach was not acted on within 30 s: {events:?}"),
        }
    }
}

async fn assignment_of(
    store: &dyn StateStore,
    task: &str,
) -> Option<(BatchSizeAssignment, KeyValue)> {
    typed::get::<BatchSizeAssignment>(store, &keys::task_assignment(task))
        .await
        .expect("read the assignment")
}

/// The daemon's eviction loop evicts the co-runner the placer's model blames, in one
/// commit that writes its evict assignment, the avoid record and the residents record
/// (unchanged) and deletes the breach; nothing else in the store changes, the
/// production job keeps its reservation, and acting again on the same state writes
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_breach_evicts_the_blamed_co_runner_in_one_commit_and_nothing_else() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    let daemon = daemon(store.clone()).await;
    place_three(store.as_ref(), &daemon).await;

    let before = store.range(keys::ROOT).await.expect("range");
    let mut watch = store
        .watch(keys::ROOT, Some(before.revision + 1))
        .await
        .expect("watch");
    let breach = write_breach(store.as_ref()).await;
    let mut events = until_breach_deleted(&mut watch).await;

    // Acting again on the state the eviction left: nothing to do, nothing written (the
    // event log below ends at the eviction). The daemon's view may still hold the breach
    // for a moment (its loop puts the commit into the view after etcd answers, and this
    // test's watch may see the commit first): that pass then finds it gone.
    let again = evict_on_breaches(daemon.service()).await;
    assert!(
        again.iter().all(|(_, outcome)| *outcome == Outcome::Gone),
        "{again:?}"
    );
    assert_eq!(
        act_on_breach(daemon.service(), DEVICE)
            .await
            .expect("act again"),
        Outcome::Gone
    );
    events.extend(events_until_marker(store.as_ref(), &mut watch).await);

    // Exactly: the tuner's breach, then one commit of four writes.
    let [
        WatchEvent::Put(put_breach),
        WatchEvent::Put(residents),
        WatchEvent::Put(victim),
        WatchEvent::Put(avoid),
        WatchEvent::Delete {
            key: deleted,
            revision: deleted_at,
        },
    ] = events.as_slice()
    else {
        panic!("the breach, then one commit of four writes; got {events:?}");
    };
    assert_eq!(put_breach.mod_revision, breach.mod_revision);
    assert_eq!(residents.key, keys::device_residents(DEVICE));
    assert_eq!(victim.key, keys::task_assignment(HEAVY));
    assert_eq!(avoid.key, keys::avoid_pairing(PROD, HEAVY));
    assert_eq!(*deleted, keys::device_breach(DEVICE));
    for kv in [residents, victim, avoid] {
        assert_eq!(
            kv.mod_revision, *deleted_at,
            "{} in the same commit",
            kv.key
        );
    }

    let written: BatchSizeAssignment = typed::decode(victim).expect("assignment");
    assert!(written.evict, "{written:?}");
    for part in [PROD, "4.400", "4.00"] {
        assert!(
            written.evict_reason.contains(part),
            "{part} not in the reason: {}",
            written.evict_reason
        );
    }
    let pairing: AvoidPairing = typed::decode(avoid).expect("avoid");
    assert_eq!(
        (
            pairing.production_task_id.as_str(),
            pairing.evicted_task_id.as_str()
        ),
        (PROD, HEAVY)
    );
    assert!(pairing.until_unix_ms > written.assigned_at_unix_ms);

    // The residents record is written again byte for byte: every job, the production
    // job and the victim included, keeps its reservation (the victim's is released when
    // it exits). Every other key is as it was.
    let after = store.range(keys::ROOT).await.expect("range");
    let old = |key: &str| before.kvs.iter().find(|kv| kv.key == key);
    let residents_before = old(&residents.key).expect("residents before");
    assert_eq!(residents.value, residents_before.value);
    let holders: Vec<String> = typed::decode::<iadeep_proto::DeviceResidents>(residents)
        .expect("residents")
        .reservations
        .into_iter()
        .map(|r| r.task_id)
        .collect();
    assert_eq!(holders.len(), 3, "{holders:?}");
    for kv in &after.kvs {
        if [&residents.key, &victim.key, &avoid.key].contains(&&kv.key) {
            continue;
        }
        let was = old(&kv.key).unwrap_or_else(|| panic!("{} is new", kv.key));
        assert_eq!(
            (was.mod_revision, &was.value),
            (kv.mod_revision, &kv.value),
            "{} changed",
            kv.key
        );
    }
    assert_eq!(
        after.kvs.len(),
        before.kvs.len() + usize::from(old(&victim.key).is_none()) + 1,
        "only the victim's assignment (if it had none) and the avoid record are new"
    );
    for other in [PROD, LIGHT] {
        assert!(
            assignment_of(store.as_ref(), other)
                .await
                .is_none_or(|(a, _)| !a.evict),
            "{other} evicted"
        );
    }
    assert_eq!(daemon.metrics().cap_evictions.get(), 1);
    daemon.shutdown().await;
}

/// One placer process without its loops: a view followed from the store and the service
/// over it, its clock stopped at `now_ms`.
async fn bare_placer(store: Arc<dyn StateStore>, now_ms: i64) -> (PlacementService, ViewSync) {
    let view = Arc::new(RwLock::new(ClusterView::new(Arc::new(ModelledMemory))));
    let placer = placer();
    let sync = ViewSync::start(
        store.clone(),
        view.clone(),
        placer.slowdown_model().clone(),
        Arc::new(NoEvents),
    )
    .await
    .expect("view sync");
    let clock = Clock::from_fn(move || now_ms);
    let service = PlacementService::new(store, view, Arc::new(placer)).with_clock(clock);
    (service, sync)
}

/// Two placers that loaded the same breach both decide to evict for it before either
/// commits (their transactions are held until both were sent): one evicts, the other
/// loses its comparison and finds the breach gone; the store holds one eviction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_placers_racing_on_one_breach_evict_once() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    // Placed through the daemon's service, which then stops (its eviction loop must
    // not take the breach from the two racing below).
    let placing = daemon(store.clone()).await;
    place_three(store.as_ref(), &placing).await;
    placing.shutdown().await;
    let victim_before = assignment_of(store.as_ref(), HEAVY)
        .await
        .map_or(0, |(_, kv)| kv.version);
    write_breach(store.as_ref()).await;

    // In the same millisecond: their evictions differ only in the placer each names
    // (`evicted_by`), which is what keeps the loser from taking the winner's commit for
    // a re-sent one of its own (see `eviction::absorb`) and counting it too.
    let now = iadeep_proto::now_unix_ms();
    // Both placers' first transactions (their evictions) wait until both were sent, so
    // each decided on the breach before either committed: whichever commits second is
    // sent with the breach gone from the store, not from its view, and only the
    // transaction's comparisons stop it.
    let racing = Arc::new(FaultStore::over(store.clone()));
    racing.hold_next(Op::Transact, 2);
    let (one, _one_sync) = bare_placer(racing.clone(), now).await;
    let (two, _two_sync) = bare_placer(racing.clone(), now).await;
    assert_ne!(one.instance(), two.instance());
    for service in [&one, &two] {
        assert!(service.view().breach(DEVICE).is_some(), "loaded");
    }
    let both_sent = async {
        tokio::time::timeout(Duration::from_secs(30), racing.until_holding(2))
            .await
            .expect("both placers decided to evict and sent their transactions");
        racing.release(2);
    };
    let ((first, second), ()) = tokio::join!(
        async { tokio::join!(act_on_breach(&one, DEVICE), act_on_breach(&two, DEVICE)) },
        both_sent
    );
    let outcomes = [first.expect("one"), second.expect("two")];
    // The two evictions, then no more: the loser decided again on what its lost
    // comparison read, and found nothing to do.
    assert_eq!(racing.calls(Op::Transact), 2, "{outcomes:?}");
    let evicted: Vec<&str> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Evicted(e) => Some(e.victim.task_id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(evicted, [HEAVY], "{outcomes:?}");
    assert!(outcomes.contains(&Outcome::Gone), "{outcomes:?}");

    let (written, kv) = assignment_of(store.as_ref(), HEAVY)
        .await
        .expect("the victim's assignment");
    assert!(written.evict);
    assert!(
        [one.instance(), two.instance()].contains(&written.evicted_by.as_str()),
        "{written:?}"
    );
    assert_eq!(kv.version, victim_before + 1, "written once");
    let avoids = store.range(keys::AVOID).await.expect("range").kvs;
    assert_eq!(avoids.len(), 1, "{avoids:?}");
    assert_eq!(avoids[0].version, 1, "written once");
    assert!(
        store
            .get(&keys::device_breach(DEVICE))
            .await
            .expect("read")
            .is_none()
    );
}
