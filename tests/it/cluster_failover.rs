//! A whole iadeep deployment on a real three-member etcd cluster loses a follower,
//! then the leader, then the member its placer uses hangs (SIGSTOP, as a follower: see
//! `EtcdCluster::freeze_follower`): two training jobs
//! (agent SDK), a tuner daemon and a placer daemon (real gRPC on loopback) keep
//! running, and a client keeps placing and releasing tasks throughout.
//!
//! Asserted, whatever the machine's speed: no Place or Release fails during
//! any loss; nothing running loses its lease (the agents' alive keys and the
//! tuner's device record keep the lease they had, and are never deleted); the
//! jobs' reservations are never dropped from the device's residents record. Then the
//! leader itself hangs and resumes, which on etcd before 3.4.31 may revoke every lease
//! (etcd-io/etcd#15247; the test revokes what it left): every leased key must come back
//! with a new lease and still no reservation be dropped. The failed-request counts and
//! the slowest request of each loss are printed, and how many leases etcd revoked.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::fixtures;
use crate::placer::place_on;
use iadeep_agent::Agent;
use iadeep_placer::{Daemon, DaemonConfig, ModelledMemory, Placer, PlacerParams};
use iadeep_predictor::{LearnerParams, OnlinePredictor};
use iadeep_proto::placer_client::PlacerClient;
use iadeep_proto::{
    DeviceInfo, DeviceResidents, LrScalingRule, PlaceRequest, ReleaseRequest, SoloProfile,
    TaskSpec, place_response,
};
use iadeep_state::FAILOVER_BOUND;
use iadeep_state::testing::EtcdCluster;
use iadeep_state::testing::runtime;
use iadeep_state::{EtcdStore, LeaseId, StateError, StateStore, StoreUrl, WatchEvent, keys, typed};
use iadeep_tuner::daemon::{Daemon as Tuner, DaemonParams};

const DEVICE: &str = "n1:gpu0";
const JOBS: [&str; 2] = ["job-a", "job-b"];
/// Short leases make a lost keep-alive show quickly; the grace lets the placer
/// release a job whose alive key vanished, which is what must not happen. 5 s, not 3:
/// behind a frozen member a keep-alive may wait a third of the TTL, then one attempt
/// (at least 1 s) before another member answers, which leaves a 3 s lease about 1 s of
/// margin.
const LEASE_TTL: Duration = Duration::from_secs(5);
/// Past the time an agent whose lease was revoked takes to register again (a third of
/// the TTL, then a few requests), as the production default (60 s) is past 10 s leases'.
const DEAD_TASK_GRACE: Duration = Duration::from_secs(5);

/// The shared job with a smaller, faster profile measured on a v100.
fn spec(task: &str) -> TaskSpec {
    TaskSpec {
        gpu_mem_request_mib: 1024,
        profile: Some(SoloProfile {
            batch_size: 32,
            step_time_s: Some(0.01),
            sm_util_pct: Some(30.0),
            mem_bw_util_pct: Some(20.0),
            peak_mem_mib: Some(1024),
            device_kind: "v100".into(),
            ..Default::default()
        }),
        ..fixtures::spec(task)
    }
}

/// A training loop stepping every 5 ms through a real agent until stopped.
fn train(url: String, task: &'static str, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let agent = Agent::builder()
        .task_id(task)
        .store(&url)
        .model("resnet50")
        .initial_batch_size(32)
        .batch_size_bounds(16..=64)
        .lr_rule(LrScalingRule::Linear)
        .device_id(DEVICE)
        .use_nvml(false)
        .memory_probe(|| Some(1024))
        .report_interval(Duration::from_millis(200))
        .lease_ttl(LEASE_TTL)
        .connect()
        .expect("agent connects");
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let b = agent.batch_size();
            std::thread::sleep(Duration::from_millis(5));
            agent.record_step(b, Duration::from_millis(5));
            let _ = agent.poll_change();
        }
        // Left running: finishing would release nothing here, and the test is over.
        drop(agent);
    })
}

#[derive(Debug, Default)]
struct Requests {
    ok: AtomicU64,
    failed: AtomicU64,
    slowest_ms: AtomicU64,
}

impl Requests {
    fn take(&self) -> (u64, u64, u64) {
        (
            self.ok.swap(0, Ordering::Relaxed),
            self.failed.swap(0, Ordering::Relaxed),
            self.slowest_ms.swap(0, Ordering::Relaxed),
        )
    }
}

/// Places and releases short-lived tasks on the placer until stopped.
async fn client_load(addr: std::net::SocketAddr, counts: Arc<Requests>, stop: Arc<AtomicBool>) {
    let mut client = PlacerClient::connect(format!("http://{addr}"))
        .await
        .expect("connect to the placer");
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let task = format!("load-{n}");
        n += 1;
        let started = Instant::now();
        let placed = client
            .place(PlaceRequest {
                task: Some(spec(&task)),
                candidate_device_ids: vec![DEVICE.into()],
            })
            .await;
        let ok = match placed {
            Ok(resp) => match resp.into_inner().decision {
                Some(place_response::Decision::Placed(_)) => client
                    .release(ReleaseRequest {
                        task_id: task.clone(),
                    })
                    .await
                    .map_err(|s| eprintln!("release {task}: {s}"))
                    .is_ok(),
                // Queued is an answer, not a failure (the card may be busy).
                _ => true,
            },
            Err(status) => {
                eprintln!("place {task}: {status}");
                false
            }
        };
        let took = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        counts.slowest_ms.fetch_max(took, Ordering::Relaxed);
        let counter = if ok { &counts.ok } else { &counts.failed };
        counter.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the watch on the deployment's keys saw going wrong.
#[derive(Debug, Default)]
struct Damage {
    deleted: Vec<String>,
    reservations_dropped: Vec<String>,
    /// The last marker the watch delivered (see [`damage_until_now`]).
    marker: Option<Vec<u8>>,
}

/// The key the test writes to know the watch has caught up (see [`damage_until_now`]).
fn marker_key() -> String {
    format!("{}test/marker", keys::ROOT)
}

/// Writes the marker with `label` and waits until the watch delivers it: it has then
/// delivered every change before it, so the damage it saw is all there was. Takes that
/// damage out (a guard held while the runtime runs would block the watch's task).
fn damage_until_now(
    rt: &tokio::runtime::Runtime,
    store: &Arc<dyn StateStore>,
    damage: &std::sync::Mutex<Damage>,
    label: &str,
) -> Damage {
    rt.block_on(store.put(&marker_key(), label.as_bytes().to_vec(), None))
        .expect("put the marker");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        {
            let mut damage = damage.lock().expect("lock");
            if damage.marker.as_deref() == Some(label.as_bytes()) {
                return std::mem::take(&mut *damage);
            }
        }
        assert!(
            Instant::now() < deadline,
            "the watch did not reach the marker {label}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Keeps member `victim` lost (frozen, or killed, by the caller) for longer than the
/// leases' TTL plus the placer's grace while the client load runs and checks that no
/// request failed or took too long; the caller brings it back. Returns the line for the
/// report.
fn lose_member(counts: &Requests, phase: &str, victim: usize) -> String {
    std::thread::sleep(LEASE_TTL + DEAD_TASK_GRACE);
    let (ok, failed, slowest) = counts.take();
    assert!(ok > 0, "no request answered after the {phase} was lost");
    assert_eq!(failed, 0, "requests failed when the {phase} was lost");
    assert!(
        u128::from(slowest) < FAILOVER_BOUND.as_millis() + 1000,
        "a request took {slowest} ms"
    );
    format!(
        "{phase} (member {victim}) lost: {ok} Place+Release ok, {failed} failed, slowest {slowest} ms"
    )
}

/// The lease `key` is bound to now; `None` while the key is missing (or unleased).
fn lease_now(rt: &tokio::runtime::Runtime, store: &Arc<dyn StateStore>, key: &str) -> Option<i64> {
    rt.block_on(store.get(key))
        .expect("get")
        .and_then(|kv| kv.lease)
        .map(|lease| lease.0)
}

fn lease_of(rt: &tokio::runtime::Runtime, store: &Arc<dyn StateStore>, key: &str) -> i64 {
    rt.block_on(store.get(key))
        .expect("get")
        .unwrap_or_else(|| panic!("{key} is missing"))
        .lease
        .unwrap_or_else(|| panic!("{key} has no lease"))
        .0
}

#[test]
fn a_deployment_rides_out_losing_a_follower_then_the_leader_then_frozen_members() {
    let mut cluster = EtcdCluster::start().unwrap_or_else(|err| panic!("{err}"));
    let leader = cluster.leader(Duration::from_secs(10)).expect("leader");
    let follower = (leader + 1) % 3;
    let other = (leader + 2) % 3;
    // Everything starts on the follower to be lost, then moves to the leader.
    let endpoints = cluster.endpoints();
    let url = format!(
        "etcd://{},{},{}",
        endpoints[follower], endpoints[leader], endpoints[other]
    );
    let rt = runtime();
    let open = || -> Arc<dyn StateStore> {
        let parsed: StoreUrl = url.parse().expect("url");
        rt.block_on(parsed.open()).expect("open the cluster")
    };
    // The placer's own store, kept typed to learn which member it uses (the last phase
    // freezes that one).
    let ordered = [follower, leader, other].map(|i| endpoints[i].clone());
    let placer_store = Arc::new(rt.block_on(EtcdStore::connect(&ordered)).expect("connect"));

    // The tuner registers the device (leased) and runs.
    let tuner_store = open();
    let device = DeviceInfo {
        device_id: DEVICE.into(),
        node: "n1".into(),
        memory_mib: 32_768,
        kind: "v100".into(),
        ..Default::default()
    };
    let params = DaemonParams {
        lease_ttl: LEASE_TTL,
        ..DaemonParams::default()
    };
    let tuner = Tuner::new(tuner_store, device, params).expect("tuner");
    let (stop_tuner, tuner_stopped) = tokio::sync::oneshot::channel::<()>();
    let tuner = rt.spawn(tuner.run(async {
        let _ = tuner_stopped.await;
    }));

    let store = open();
    let deadline = Instant::now() + Duration::from_secs(60);
    while rt
        .block_on(store.get(&keys::device_info(DEVICE)))
        .expect("get")
        .is_none()
    {
        assert!(Instant::now() < deadline, "the tuner did not register");
        std::thread::sleep(Duration::from_millis(50));
    }

    // The placer, and the two jobs it places.
    let placer = Placer::new(
        PlacerParams::default(),
        Arc::new(OnlinePredictor::new(LearnerParams::default()).expect("predictor")),
    )
    .expect("placer");
    let config = DaemonConfig {
        grpc: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        extender: None,
        metrics: None,
        dead_task_grace: Some(DEAD_TASK_GRACE),
        unstarted_task_grace: None,
        tls: None,
    };
    let daemon = rt
        .block_on(Daemon::start(
            placer_store.clone(),
            placer,
            Arc::new(ModelledMemory),
            config,
        ))
        .expect("placer starts");
    let addr = daemon.grpc_addr();
    rt.block_on(async {
        let mut client = PlacerClient::connect(format!("http://{addr}"))
            .await
            .expect("connect");
        for job in JOBS {
            place_on(&mut client, spec(job), DEVICE).await;
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let trainers: Vec<_> = JOBS
        .iter()
        .map(|job| train(url.clone(), job, stop.clone()))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    for job in JOBS {
        while rt
            .block_on(store.get(&keys::task_alive(job)))
            .expect("get")
            .is_none()
        {
            assert!(Instant::now() < deadline, "{job}'s agent did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let leased: Vec<String> = JOBS
        .iter()
        .map(|job| keys::task_alive(job))
        .chain([keys::device_info(DEVICE)])
        .collect();
    let leases_before: Vec<i64> = leased.iter().map(|k| lease_of(&rt, &store, k)).collect();

    // Watch for what must not happen: a leased key deleted, a job's reservation dropped.
    let damage = Arc::new(std::sync::Mutex::new(Damage::default()));
    let mut watch = rt.block_on(store.watch(keys::ROOT, None)).expect("watch");
    let seen = damage.clone();
    let watched = leased.clone();
    rt.spawn(async move {
        while let Some(Ok(event)) = watch.next().await {
            let mut damage = seen.lock().expect("lock");
            match event {
                WatchEvent::Delete { key, .. } if watched.contains(&key) => {
                    damage.deleted.push(key);
                }
                WatchEvent::Put(kv) if kv.key == marker_key() => damage.marker = Some(kv.value),
                WatchEvent::Put(kv) if kv.key == keys::device_residents(DEVICE) => {
                    let record: DeviceResidents = typed::decode(&kv).expect("residents");
                    for job in JOBS {
                        if !record.reservations.iter().any(|r| r.task_id == job) {
                            damage
                                .reservations_dropped
                                .push(format!("{job} at revision {}", kv.mod_revision));
                        }
                    }
                }
                _ => {}
            }
        }
    });

    let counts = Arc::new(Requests::default());
    let load_stop = Arc::new(AtomicBool::new(false));
    let load = rt.spawn(client_load(addr, counts.clone(), load_stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(30);
    while counts.ok.load(Ordering::Relaxed) + counts.failed.load(Ordering::Relaxed) < 5 {
        assert!(
            Instant::now() < deadline,
            "no request answered before any loss"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (warm_ok, warm_failed, _) = counts.take();
    assert!(
        warm_ok > 0 && warm_failed == 0,
        "{warm_ok} ok, {warm_failed} failed before any loss"
    );

    let mut report = Vec::new();
    for phase in ["follower", "leader", "placer's member frozen"] {
        let victim = match phase {
            "follower" => follower,
            "leader" => cluster.leader(Duration::from_secs(10)).expect("leader"),
            _ => {
                let on = placer_store.current_endpoint();
                cluster
                    .endpoints()
                    .iter()
                    .position(|e| *e == on)
                    .expect("a member")
            }
        };
        let frozen = phase.ends_with("frozen");
        if frozen {
            // Hangs instead of dying: its connections stay open, nothing is answered. A
            // follower: a hung leader that resumes may revoke the leases (the phase after
            // this one).
            rt.block_on(cluster.freeze_follower(victim))
                .expect("freeze the member as a follower");
        } else {
            cluster.kill(victim);
        }
        report.push(lose_member(&counts, phase, victim));
        if frozen {
            cluster.thaw(victim).expect("member resumes");
        } else {
            cluster.restart(victim).expect("member restarts");
        }
    }
    let leases_after: Vec<i64> = leased.iter().map(|k| lease_of(&rt, &store, k)).collect();
    assert_eq!(
        leases_after, leases_before,
        "a lease was lost and re-granted ({leased:?})"
    );
    let seen = damage_until_now(&rt, &store, &damage, "three losses");
    assert!(seen.deleted.is_empty(), "deleted: {:?}", seen.deleted);
    assert!(
        seen.reservations_dropped.is_empty(),
        "reservations dropped: {:?}",
        seen.reservations_dropped
    );

    // The leader hangs: the leases live on through the new leader. Then it resumes, and
    // etcd before 3.4.31 and 3.5.13 (Debian's 3.4.23 among them) may revoke the leases
    // it saw expire meanwhile, though the new leader kept them alive (etcd-io/etcd#15247;
    // it happened in 2 of 3 loaded runs that froze the leader in the phase before this
    // one, when it still could: it depends on whether the resumed leader's lease timer
    // runs before it learns it lost the leadership). What it left is revoked here, as it
    // would: the agents and the tuner must find their leases gone at their next
    // keep-alive and register again, well within the placer's dead-task grace, so that
    // nothing is released and no request fails.
    let leader = cluster.leader(Duration::from_secs(10)).expect("leader");
    cluster.freeze(leader).expect("freeze");
    report.push(lose_member(&counts, "leader frozen", leader));
    let leases_frozen: Vec<i64> = leased.iter().map(|k| lease_of(&rt, &store, k)).collect();
    assert_eq!(
        leases_frozen, leases_before,
        "a lease was lost and re-granted behind the hung leader ({leased:?})"
    );
    cluster.thaw(leader).expect("member resumes");
    let resumed = Instant::now();
    let mut revoked_by_etcd = 0;
    for (key, before) in leased.iter().zip(&leases_before) {
        if lease_now(&rt, &store, key) == Some(*before) {
            match rt.block_on(store.revoke_lease(LeaseId(*before))) {
                Ok(()) | Err(StateError::LeaseNotFound(_)) => {}
                Err(err) => panic!("revoke {key}'s lease: {err}"),
            }
        } else {
            revoked_by_etcd += 1;
        }
    }
    let deadline = Instant::now() + LEASE_TTL * 3;
    for (key, before) in leased.iter().zip(&leases_before) {
        loop {
            if lease_now(&rt, &store, key).is_some_and(|lease| lease != *before) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{key} did not come back with a new lease"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let back_ms = resumed.elapsed().as_millis();
    // A release the re-registration came too late to prevent would happen by now.
    std::thread::sleep(DEAD_TASK_GRACE + Duration::from_secs(1));
    let (ok, failed, slowest) = counts.take();
    report.push(format!(
        "after the leader resumed: {revoked_by_etcd} of {} leases revoked by etcd, the rest \
         by the test; every key back with a new lease {back_ms} ms after the resumption; \
         {ok} Place+Release ok, {failed} failed, slowest {slowest} ms",
        leased.len()
    ));
    assert!(ok > 0, "no request answered after the leader resumed");
    assert_eq!(failed, 0, "requests failed after the leader resumed");
    load_stop.store(true, Ordering::Relaxed);
    rt.block_on(load).expect("load");
    eprintln!("{}", report.join("\n"));

    let residents: DeviceResidents = rt
        .block_on(typed::get(store.as_ref(), &keys::device_residents(DEVICE)))
        .expect("get")
        .expect("residents")
        .0;
    for job in JOBS {
        assert!(
            residents.reservations.iter().any(|r| r.task_id == job),
            "{job} lost its reservation"
        );
    }
    let seen = damage_until_now(&rt, &store, &damage, "end");
    assert!(
        seen.reservations_dropped.is_empty(),
        "reservations dropped: {:?}",
        seen.reservations_dropped
    );

    stop.store(true, Ordering::Relaxed);
    for trainer in trainers {
        trainer.join().expect("trainer");
    }
    let _ = stop_tuner.send(());
    let _ = rt.block_on(tuner);
    rt.block_on(daemon.shutdown());
}
