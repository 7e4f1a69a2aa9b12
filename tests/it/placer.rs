//! The placement service over a real etcd and real gRPC / HTTP on loopback:
//! place, release and list; malformed requests; concurrent placements on a
//! nearly full cluster served by two placer daemons; the view following the
//! store; the Kubernetes extender's filter, prioritize and bind.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use iadeep_placer::extender::ExtenderConfig;
use iadeep_placer::extender::kube_api::KubeApiConfig;
use iadeep_placer::{Daemon, DaemonConfig, ModelledMemory, Placer, PlacerParams};
use iadeep_predictor::{LearnerParams, OnlinePredictor};
use iadeep_proto::placer_client::PlacerClient;
use iadeep_proto::{
    CoLocationSample, DeviceInfo, DeviceResidents, ListDevicesRequest, LrScalingRule, PlaceRequest,
    Placement, ReleaseRequest, SoloProfile, TaskReport, TaskSpec, place_response,
};
use iadeep_state::testing::{EtcdServer, start_etcd};
use iadeep_state::{EtcdStore, StateStore, WatchEvent, keys, typed};
use serde_json::{Value, json};
use tonic::Code;
use tonic::transport::Channel;

use crate::http;
use crate::kube_fake::{BindAnswer, FakeKube};

async fn etcd_store(server: &EtcdServer) -> Arc<dyn StateStore> {
    Arc::new(
        EtcdStore::connect(&[server.endpoint()])
            .await
            .expect("connect to etcd"),
    )
}

pub(crate) fn placer() -> Placer {
    Placer::new(
        PlacerParams::default(),
        Arc::new(OnlinePredictor::new(LearnerParams::default()).expect("predictor")),
    )
    .expect("default params are valid")
}

/// Short, so the dead-task test does not wait long; no other test has a dead agent.
const DEAD_TASK_GRACE: Duration = Duration::from_millis(1500);
/// The dead-task grace of a daemon that evicts pods: the production default.
const KUBE_DEAD_TASK_GRACE: Duration = Duration::from_secs(60);

pub(crate) fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// The extender's bind budget in these tests: generous for a loaded machine, short
/// enough that the stalled-Binding test does not wait long.
const BIND_TIMEOUT: Duration = Duration::from_secs(3);

async fn daemon(store: Arc<dyn StateStore>, kube: Option<&FakeKube>) -> Daemon {
    daemon_with(store, kube, None, Default::default()).await
}

/// A daemon that also releases tasks whose agent never started after `unstarted`, and
/// whose extender counts pods by `priority_rule`.
async fn daemon_with(
    store: Arc<dyn StateStore>,
    kube: Option<&FakeKube>,
    unstarted: Option<Duration>,
    priority_rule: iadeep_placer::extender::PriorityRule,
) -> Daemon {
    let config = DaemonConfig {
        grpc: loopback(),
        extender: Some(ExtenderConfig {
            listen: loopback(),
            kube_api: kube.map(|k| KubeApiConfig::Url(k.url.clone())),
            bind_timeout: BIND_TIMEOUT,
            priority_rule,
        }),
        metrics: Some(loopback()),
        // With the Kubernetes API the daemon refuses a dead-task grace that an evicted
        // pod could outlive (its pod-eviction grace plus kubelet's 30 s); the tests that
        // bind pods never wait for a dead task.
        dead_task_grace: Some(if kube.is_some() {
            KUBE_DEAD_TASK_GRACE
        } else {
            DEAD_TASK_GRACE
        }),
        unstarted_task_grace: unstarted,
        tls: None,
    };
    Daemon::start(store, placer(), Arc::new(ModelledMemory), config)
        .await
        .expect("start the placer")
}

async fn client(daemon: &Daemon) -> PlacerClient<Channel> {
    PlacerClient::connect(format!("http://{}", daemon.grpc_addr()))
        .await
        .expect("connect to the placer")
}

pub(crate) async fn register(store: &dyn StateStore, id: &str, node: &str, memory_mib: u64) {
    let info = DeviceInfo {
        device_id: id.into(),
        node: node.into(),
        memory_mib,
        kind: "v100".into(),
        ..Default::default()
    };
    typed::put(store, &keys::device_info(id), &info, None)
        .await
        .expect("register device");
}

/// The shared job at m0 = 64 (16–256) with a `mib` request and an SM utilisation of `sm`.
pub(crate) fn task(id: &str, mib: u64, sm: f64) -> TaskSpec {
    TaskSpec {
        initial_batch_size: 64,
        min_batch_size: 16,
        max_batch_size: 256,
        gpu_mem_request_mib: mib,
        profile: Some(SoloProfile {
            batch_size: 64,
            step_time_s: Some(0.2),
            sm_util_pct: Some(sm),
            mem_bw_util_pct: Some(sm / 2.0),
            ..Default::default()
        }),
        lr_rule: LrScalingRule::Unspecified as i32,
        ..crate::fixtures::spec(id)
    }
}

async fn place(
    client: &mut PlacerClient<Channel>,
    spec: TaskSpec,
) -> Result<iadeep_proto::PlaceResponse, tonic::Status> {
    client
        .place(PlaceRequest {
            task: Some(spec),
            candidate_device_ids: Vec::new(),
        })
        .await
        .map(tonic::Response::into_inner)
}

/// Places `spec` on `device` over gRPC, failing the test unless it is placed.
pub(crate) async fn place_on(client: &mut PlacerClient<Channel>, spec: TaskSpec, device: &str) {
    let id = spec.task_id.clone();
    let placed = client
        .place(PlaceRequest {
            task: Some(spec),
            candidate_device_ids: vec![device.into()],
        })
        .await
        .expect("place")
        .into_inner();
    assert!(
        matches!(placed.decision, Some(place_response::Decision::Placed(_))),
        "{id} not placed: {placed:?}"
    );
}

/// Polls until `check` holds, failing the test after 60 s.
pub(crate) async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    // Generous: etcd restarting or a lease expiring on a loaded 2-core machine.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn place_list_and_release_over_grpc_and_etcd() {
    let mut server = start_etcd();
    let store = etcd_store(&server).await;
    register(store.as_ref(), "n1.gpu0", "n1", 16_384).await;
    register(store.as_ref(), "n1.gpu1", "n1", 16_384).await;
    let daemon = daemon(store.clone(), None).await;
    let mut c = client(&daemon).await;

    let first = place(&mut c, task("job-a", 4000, 60.0))
        .await
        .expect("place");
    let Some(place_response::Decision::Placed(a)) = first.decision else {
        panic!("expected a placement: {first:?}");
    };
    assert_eq!(a.reserved_mem_mib, 4000);
    let explanation = first.explanation.expect("explanation");
    assert!(
        explanation.summary.starts_with("placed on"),
        "{explanation:?}"
    );
    assert_eq!(explanation.candidates.len(), 2, "both idle GPUs are scored");

    // The reservation and the placement are in etcd before the answer came back.
    let (record, _) =
        typed::get::<DeviceResidents>(store.as_ref(), &keys::device_residents(&a.device_id))
            .await
            .expect("read residents")
            .expect("residents record exists");
    assert_eq!(record.reservations.len(), 1);
    assert_eq!(record.reservations[0].task_id, "job-a");
    let (stored, _) = typed::get::<Placement>(store.as_ref(), &keys::task_placement("job-a"))
        .await
        .expect("read placement")
        .expect("placement exists");
    assert_eq!(stored, a);
    assert!(
        store
            .get(&keys::task_spec("job-a"))
            .await
            .expect("get spec")
            .is_some()
    );

    // A second, heavy task goes to the other (idle) GPU rather than slowing job-a down.
    let second = place(&mut c, task("job-b", 4000, 90.0))
        .await
        .expect("place");
    let Some(place_response::Decision::Placed(b)) = second.decision else {
        panic!("expected a placement: {second:?}");
    };
    assert_ne!(b.device_id, a.device_id);
    // Placing job-a again answers its existing reservation.
    let again = place(&mut c, task("job-a", 4000, 60.0))
        .await
        .expect("place again");
    assert_eq!(
        again.decision,
        Some(place_response::Decision::Placed(a.clone()))
    );

    let listed = c
        .list_devices(ListDevicesRequest {})
        .await
        .expect("list")
        .into_inner()
        .devices;
    assert_eq!(listed.len(), 2);
    let on_a = listed
        .iter()
        .find(|d| d.device.as_ref().map(|i| i.device_id.as_str()) == Some(a.device_id.as_str()))
        .expect("device of job-a listed");
    assert_eq!(on_a.resident_task_ids, vec!["job-a".to_owned()]);
    assert_eq!(on_a.reserved_mem_mib, 4000);

    let released = c
        .release(ReleaseRequest {
            task_id: "job-a".into(),
        })
        .await
        .expect("release")
        .into_inner();
    assert!(released.released);
    assert_eq!(released.device_id, a.device_id);
    assert!(
        store
            .get(&keys::device_residents(&a.device_id))
            .await
            .expect("get")
            .is_none()
    );
    assert!(
        store
            .get(&keys::task_placement("job-a"))
            .await
            .expect("get")
            .is_none()
    );
    let twice = c
        .release(ReleaseRequest {
            task_id: "job-a".into(),
        })
        .await
        .expect("release twice")
        .into_inner();
    assert!(
        !twice.released,
        "releasing twice is not an error and frees nothing"
    );

    let metrics_addr = daemon.metrics_addr().expect("metrics served").to_string();
    let (status, content_type, body) = http::request("GET", &metrics_addr, "/metrics", &[]).await;
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200);
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    assert!(
        text.contains("iadeep_build_info{component=\"placer\""),
        "{text}"
    );
    assert!(text.contains("process_resident_memory_bytes"), "{text}");
    assert_eq!(http::get(&metrics_addr, "/healthz").await.0, 200);
    assert_eq!(
        http::get(&metrics_addr, "/readyz").await,
        (200, "ready\n".to_owned())
    );
    assert!(
        text.contains("iadeep_placer_decisions_total{outcome=\"placed\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("iadeep_placer_place_seconds_count 3"),
        "{text}"
    );
    assert!(text.contains("iadeep_placer_releases_total 1"), "{text}");

    // Not ready while the store does not answer, ready again once it does.
    server.stop();
    let (status, body) = http::get(&metrics_addr, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("state store"), "{body}");
    server.restart().expect("restart etcd");
    eventually("ready again", async || {
        http::get(&metrics_addr, "/readyz").await.0 == 200
    })
    .await;
    daemon.shutdown().await;
}

/// The daemon counts the tasks it told to queue (until twice their retry hint has
/// passed, or until they are placed or released) ahead of the tasks that come after
/// them: with one device freeing up and one task already waiting for it, the next
/// task would wait a whole round, so it is co-located instead of queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_told_to_queue_count_ahead_of_later_ones() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    register(store.as_ref(), "n1.gpu0", "n1", 16_384).await;
    // The resident's report is in the store before the daemon loads its view, so the
    // first decision already knows: 100,000 samples left at 1,000/s, free in ~100 s.
    let report = TaskReport {
        task_id: "resident".into(),
        device_id: "n1.gpu0".into(),
        batch_size: 64,
        samples_per_s: 1000.0,
        reported_at_unix_ms: iadeep_proto::now_unix_ms(),
        ..Default::default()
    };
    typed::put(
        store.as_ref(),
        &keys::task_report("resident"),
        &report,
        None,
    )
    .await
    .expect("write report");
    // Its agent runs, so the dead-task reaper leaves it alone.
    start_agent(store.as_ref(), "resident", Duration::from_secs(60)).await;
    let daemon = daemon(store.clone(), None).await;
    let mut c = client(&daemon).await;

    let long = |id: &str| TaskSpec {
        // 64e6 samples at 0.2 s per 64: 200,000 s alone.
        total_samples: Some(64_000_000),
        ..task(id, 4000, 90.0)
    };
    let resident = TaskSpec {
        total_samples: Some(100_000),
        ..task("resident", 4000, 90.0)
    };
    let first = place(&mut c, resident).await.expect("place");
    assert!(
        matches!(first.decision, Some(place_response::Decision::Placed(_))),
        "{first:?}"
    );
    // Sharing costs far more than 100 s of waiting: the first long task queues.
    let queued = place(&mut c, long("first")).await.expect("place");
    assert!(
        matches!(queued.decision, Some(place_response::Decision::Queued(_))),
        "{queued:?}"
    );
    let summary = queued.explanation.expect("explanation").summary;
    assert!(summary.contains("no task waits ahead"), "{summary}");
    let Some(place_response::Decision::Queued(q)) = queued.decision else {
        unreachable!("checked above");
    };
    assert!(
        (90_000..=100_000).contains(&q.retry_after_ms),
        "retry after the resident finishes: {q:?}"
    );

    // Requests no GPU can ever hold are refused at once, never told to queue, so they
    // do not count as waiting ahead of anyone.
    let huge = TaskSpec {
        gpu_mem_request_mib: 1 << 20,
        ..long("huge")
    };
    let refused = place(&mut c, huge).await.expect_err("1 TiB never fits");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().contains("never fits"),
        "{}",
        refused.message()
    );
    let unknown = c
        .place(PlaceRequest {
            task: Some(long("nowhere")),
            candidate_device_ids: vec!["no-such-gpu".into()],
        })
        .await
        .expect_err("an unknown candidate");
    assert_eq!(unknown.code(), Code::InvalidArgument, "{unknown:?}");
    assert!(
        unknown.message().contains("no-such-gpu: unknown device"),
        "{}",
        unknown.message()
    );

    // The second sees the first ahead of it: only one device frees up, so the
    // second would wait a whole round; it is placed next to the resident.
    let second = place(&mut c, long("second")).await.expect("place");
    let summary = second.explanation.clone().expect("explanation").summary;
    assert!(
        matches!(second.decision, Some(place_response::Decision::Placed(_))),
        "{second:?}"
    );
    assert!(summary.contains("1 task waits ahead"), "{summary}");

    // The first asks again and keeps its place: nobody waits ahead of it.
    let again = place(&mut c, long("first")).await.expect("place");
    let summary = again.explanation.expect("explanation").summary;
    assert!(summary.contains("no task waits ahead"), "{summary}");

    // Withdrawn (released while it waited), it no longer holds anyone back.
    c.release(ReleaseRequest {
        task_id: "first".into(),
    })
    .await
    .expect("release");
    let third = place(&mut c, task("third", 1000, 5.0))
        .await
        .expect("place");
    let summary = third.explanation.expect("explanation").summary;
    assert!(summary.contains("no task waits ahead"), "{summary}");
}

/// An agent's `alive` key under a fresh lease, as the agent SDK writes it.
async fn start_agent(store: &dyn StateStore, task: &str, ttl: Duration) -> iadeep_state::LeaseId {
    let lease = store.grant_lease(ttl).await.expect("grant lease");
    store
        .put(&keys::task_alive(task), b"pid 1".to_vec(), Some(lease))
        .await
        .expect("put alive");
    lease
}

async fn report(store: &dyn StateStore, task: &str, finished: bool) {
    let report = TaskReport {
        task_id: task.into(),
        batch_size: 64,
        samples_per_s: 100.0,
        finished,
        reported_at_unix_ms: iadeep_proto::now_unix_ms(),
        ..Default::default()
    };
    typed::put(store, &keys::task_report(task), &report, None)
        .await
        .expect("write report");
}

async fn residents_of(store: &dyn StateStore, device: &str) -> Vec<String> {
    typed::get::<DeviceResidents>(store, &keys::device_residents(device))
        .await
        .expect("read residents")
        .map(|(r, _)| r.reservations.into_iter().map(|r| r.task_id).collect())
        .unwrap_or_default()
}

/// Waits until `task` (`what`, for the failure message) holds no reservation on `device`.
async fn until_released(store: &dyn StateStore, device: &str, task: &str, what: &str) {
    eventually(&format!("{what} to be released"), async || {
        !residents_of(store, device).await.iter().any(|t| t == task)
    })
    .await;
}

/// Tasks whose agent dies without Release: the reservation and placement of one whose
/// lease expired go after the grace period; one that finished goes at once; one whose
/// agent restarts within the grace keeps its device; one whose agent never started
/// keeps it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_of_tasks_whose_agent_died_are_released_after_the_grace() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    register(store.as_ref(), "n1.gpu0", "n1", 32_768).await;
    let daemon = daemon(store.clone(), None).await;
    let mut c = client(&daemon).await;
    for id in ["crashed", "restarted", "done", "unstarted"] {
        let answer = place(&mut c, task(id, 2000, 10.0)).await.expect("place");
        assert!(
            matches!(answer.decision, Some(place_response::Decision::Placed(_))),
            "{answer:?}"
        );
    }
    let s = store.as_ref();
    // "crashed" never renews its lease: etcd expires it and deletes the alive key, not
    // before its TTL after this instant (the grant comes later).
    let crashed_gone_earliest = std::time::Instant::now() + Duration::from_secs(1);
    start_agent(s, "crashed", Duration::from_secs(1)).await;
    report(s, "crashed", false).await;
    let restarted = start_agent(s, "restarted", Duration::from_secs(30)).await;
    report(s, "restarted", false).await;
    let done = start_agent(s, "done", Duration::from_secs(30)).await;
    report(s, "done", true).await;
    // The agent of "done" exits normally: finished report, lease revoked.
    s.revoke_lease(done).await.expect("revoke");
    // "restarted" crashes and comes back at once with a new lease (granted first, so
    // only one write lies between the key's deletion and its return, well within the
    // grace even on a loaded machine).
    let again = s
        .grant_lease(Duration::from_secs(30))
        .await
        .expect("grant lease");
    s.revoke_lease(restarted).await.expect("revoke");
    s.put(
        &keys::task_alive("restarted"),
        b"pid 2".to_vec(),
        Some(again),
    )
    .await
    .expect("put alive");

    until_released(s, "n1.gpu0", "done", "the finished task").await;
    eventually("the crashed task's alive key to expire", async || {
        s.get(&keys::task_alive("crashed"))
            .await
            .expect("get")
            .is_none()
    })
    .await;
    // Still held, if this read came within the grace of the earliest the key can have
    // gone (a test thread descheduled for longer cannot tell, and does not assert).
    let held = residents_of(s, "n1.gpu0").await;
    if crashed_gone_earliest.elapsed() < DEAD_TASK_GRACE {
        assert!(
            held.contains(&"crashed".to_owned()),
            "released before the grace period"
        );
    }
    until_released(s, "n1.gpu0", "crashed", "the crashed task").await;
    // A lower bound, from before the key can have gone: load only makes it longer.
    let waited = crashed_gone_earliest.elapsed();
    assert!(
        waited >= DEAD_TASK_GRACE,
        "released {waited:?} after the alive key went, before the {DEAD_TASK_GRACE:?} grace"
    );
    for gone in ["crashed", "done"] {
        assert!(
            s.get(&keys::task_placement(gone))
                .await
                .expect("get")
                .is_none(),
            "{gone}'s placement is deleted"
        );
    }
    // The live and the unstarted keep their devices: a marker task whose agent dies
    // now is released a grace later, and "restarted", whose agent was gone before the
    // marker's, or "unstarted", placed before it, would be released by then if the
    // reaper took either for dead. Nothing to wait out, nothing to miss if it is slow.
    let answer = place(&mut c, task("marker", 2000, 10.0))
        .await
        .expect("place");
    assert!(
        matches!(answer.decision, Some(place_response::Decision::Placed(_))),
        "{answer:?}"
    );
    let marker = start_agent(s, "marker", Duration::from_secs(30)).await;
    report(s, "marker", false).await;
    s.revoke_lease(marker)
        .await
        .expect("the marker's agent dies");
    until_released(s, "n1.gpu0", "marker", "the marker task").await;
    let mut left = residents_of(s, "n1.gpu0").await;
    left.sort();
    assert_eq!(left, ["restarted", "unstarted"]);
    let metrics = daemon.metrics();
    assert_eq!(
        metrics.dead_released.get(),
        3,
        "crashed, done and the marker"
    );
}

/// A task placed whose agent never starts gives its device back once the
/// never-started grace has passed since its placement (reservation and placement
/// both); a task placed with it whose agent started keeps its device.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reservations_of_tasks_whose_agent_never_started_are_released_after_their_grace() {
    // Long enough for the "started" agent's two writes after the placements on a loaded
    // machine: a later start would see it released, and the test fail for no fault.
    const UNSTARTED_GRACE: Duration = Duration::from_secs(5);
    let server = start_etcd();
    let store = etcd_store(&server).await;
    register(store.as_ref(), "n1.gpu0", "n1", 32_768).await;
    let daemon = daemon_with(
        store.clone(),
        None,
        Some(UNSTARTED_GRACE),
        Default::default(),
    )
    .await;
    let mut c = client(&daemon).await;
    let placed_before = std::time::Instant::now();
    for id in ["never", "started"] {
        let answer = place(&mut c, task(id, 2000, 10.0)).await.expect("place");
        assert!(
            matches!(answer.decision, Some(place_response::Decision::Placed(_))),
            "{answer:?}"
        );
    }
    let s = store.as_ref();
    start_agent(s, "started", Duration::from_secs(30)).await;
    // Both still held, if this read came within the grace of their placement (a test
    // thread descheduled for longer cannot tell, and does not assert).
    let mut held = residents_of(s, "n1.gpu0").await;
    if placed_before.elapsed() < UNSTARTED_GRACE {
        held.sort();
        assert_eq!(
            held,
            ["never", "started"],
            "released before the grace period"
        );
    }
    until_released(s, "n1.gpu0", "never", "the never-started task").await;
    let waited = placed_before.elapsed();
    assert!(
        waited >= UNSTARTED_GRACE,
        "released {waited:?} after its placement, before the {UNSTARTED_GRACE:?} grace"
    );
    assert!(
        s.get(&keys::task_placement("never"))
            .await
            .expect("get")
            .is_none(),
        "its placement is deleted with the reservation"
    );
    // The started one keeps its device: a marker task placed now, never started, is
    // released a grace later, and "started", placed before it, would be released by
    // then if the reaper took it for unstarted.
    let answer = place(&mut c, task("marker", 2000, 10.0))
        .await
        .expect("place");
    assert!(
        matches!(answer.decision, Some(place_response::Decision::Placed(_))),
        "{answer:?}"
    );
    until_released(s, "n1.gpu0", "marker", "the marker task").await;
    assert_eq!(residents_of(s, "n1.gpu0").await, ["started"]);
    let metrics = daemon.metrics();
    assert_eq!(
        (
            metrics.unstarted_released.get(),
            metrics.dead_released.get()
        ),
        (2, 0),
        "never and the marker"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_requests_are_invalid_argument_naming_the_field_and_write_nothing() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    register(store.as_ref(), "n1.gpu0", "n1", 16_384).await;
    let before = store.range(keys::ROOT).await.expect("range");
    let daemon = daemon(store.clone(), None).await;
    let mut c = client(&daemon).await;

    let missing = c
        .place(PlaceRequest {
            task: None,
            candidate_device_ids: Vec::new(),
        })
        .await
        .expect_err("missing task");
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert!(missing.message().contains("task"), "{}", missing.message());

    let cases: Vec<(&str, PlaceRequest)> = vec![
        (
            "task.task_id",
            PlaceRequest {
                task: Some(task("a/b", 100, 10.0)),
                candidate_device_ids: vec![],
            },
        ),
        (
            "task.task_id",
            PlaceRequest {
                task: Some(task("", 100, 10.0)),
                candidate_device_ids: vec![],
            },
        ),
        (
            "task.initial_batch_size",
            PlaceRequest {
                task: Some(TaskSpec {
                    initial_batch_size: 0,
                    ..task("ok", 100, 10.0)
                }),
                candidate_device_ids: vec![],
            },
        ),
        (
            "task.max_batch_size",
            PlaceRequest {
                task: Some(TaskSpec {
                    max_batch_size: 8,
                    ..task("ok", 100, 10.0)
                }),
                candidate_device_ids: vec![],
            },
        ),
        (
            "task.profile.sm_util_pct",
            PlaceRequest {
                task: Some(task("ok", 100, 250.0)),
                candidate_device_ids: vec![],
            },
        ),
        (
            "candidate_device_ids[0]",
            PlaceRequest {
                task: Some(task("ok", 100, 10.0)),
                candidate_device_ids: vec!["../etc".into()],
            },
        ),
        // 300,000 entries once passed, and etcd refused the spec (RESOURCE_EXHAUSTED).
        (
            "task.allowed_batch_sizes",
            PlaceRequest {
                task: Some(TaskSpec {
                    allowed_batch_sizes: vec![64; 100_000],
                    ..task("ok", 100, 10.0)
                }),
                candidate_device_ids: vec![],
            },
        ),
    ];
    for (field, request) in cases {
        let status = c.place(request).await.expect_err(field);
        assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
        assert!(
            status.message().contains(field),
            "{field}: {}",
            status.message()
        );
    }
    let status = c
        .release(ReleaseRequest {
            task_id: "no spaces".into(),
        })
        .await
        .expect_err("bad id");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().contains("task_id"), "{}", status.message());
    // Bytes that are not a PlaceRequest at all: the client's fault, not the server's.
    let status = undecodable_place(&daemon).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("PlaceRequest does not decode"),
        "{}",
        status.message()
    );

    let after = store.range(keys::ROOT).await.expect("range");
    assert_eq!(after.kvs, before.kvs, "malformed requests wrote nothing");
    // And the daemon is still serving.
    let ok = place(&mut c, task("fine", 1000, 10.0))
        .await
        .expect("valid request");
    assert!(matches!(
        ok.decision,
        Some(place_response::Decision::Placed(_))
    ));
    daemon.shutdown().await;
}

/// What a client whose stubs disagree with the placer's schema might send: field 1
/// (`task`, a TaskSpec) holding bytes that are no TaskSpec.
#[derive(Clone, PartialEq, prost::Message)]
struct NotAPlaceRequest {
    #[prost(bytes = "vec", tag = "1")]
    task: Vec<u8>,
}

/// Sends a Place whose body does not decode; the status it is answered with.
async fn undecodable_place(daemon: &Daemon) -> tonic::Status {
    let channel = Channel::from_shared(format!("http://{}", daemon.grpc_addr()))
        .expect("uri")
        .connect()
        .await
        .expect("connect to the placer");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let codec =
        iadeep_proto::codec::IadeepCodec::<NotAPlaceRequest, iadeep_proto::PlaceResponse>::default(
        );
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/iadeep.v1.Placer/Place");
    let request = tonic::Request::new(NotAPlaceRequest {
        task: vec![0xff; 4],
    });
    grpc.unary(request, path, codec)
        .await
        .expect_err("the placer cannot decode it")
}

/// Usable memory of a 16 GiB GPU with the default margins.
fn usable_16g() -> u64 {
    PlacerParams::default().usable_memory_mib(16_384)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_places_on_a_nearly_full_cluster_never_overpack_a_device() {
    const DEVICES: usize = 4;
    const REQUESTS: usize = 48;
    let server = start_etcd();
    let store = etcd_store(&server).await;
    // Each GPU already holds a resident leaving room for exactly one 3,000 MiB task.
    let filler = usable_16g() - 3_000 - 100;
    for d in 0..DEVICES {
        let id = format!("n{d}.gpu0");
        register(store.as_ref(), &id, &format!("n{d}"), 16_384).await;
        let record = DeviceResidents {
            device_id: id.clone(),
            reservations: vec![iadeep_proto::Reservation {
                task_id: format!("filler-{d}"),
                reserved_mem_mib: filler,
                spec: Some(task(&format!("filler-{d}"), filler, 10.0)),
                ..Default::default()
            }],
            ..Default::default()
        };
        typed::put(store.as_ref(), &keys::device_residents(&id), &record, None)
            .await
            .expect("seed residents");
    }
    let start = store.range(keys::DEVICES).await.expect("range").revision;
    // Every version of every residents record, as etcd saw it.
    let mut watch = store
        .watch(keys::DEVICES, Some(start + 1))
        .await
        .expect("watch");

    // Two placer daemons on the same etcd: their only coordination is the CAS.
    let one = daemon(store.clone(), None).await;
    let two = daemon(store.clone(), None).await;
    let mut calls = Vec::new();
    for i in 0..REQUESTS {
        let addr = if i % 2 == 0 {
            one.grpc_addr()
        } else {
            two.grpc_addr()
        };
        calls.push(tokio::spawn(async move {
            let mut c = PlacerClient::connect(format!("http://{addr}"))
                .await
                .expect("connect");
            // Light tasks, so every device is a good candidate and they all race.
            place(&mut c, task(&format!("burst-{i}"), 3_000, 5.0)).await
        }));
    }
    let mut placed = Vec::new();
    let mut not_placed = 0;
    for call in calls {
        match call.await.expect("client task") {
            Ok(response) => match response.decision {
                Some(place_response::Decision::Placed(p)) => placed.push(p),
                Some(place_response::Decision::Queued(_)) => not_placed += 1,
                None => panic!("a response without a decision"),
            },
            // Losing the race too often is an honest "try again", never an over-pack.
            Err(status) if status.code() == Code::Unavailable => not_placed += 1,
            Err(status) => panic!("Place failed: {status:?}"),
        }
    }
    assert_eq!(placed.len(), DEVICES, "exactly one task fits per device");
    assert_eq!(not_placed, REQUESTS - DEVICES);
    let mut per_device: HashMap<String, usize> = HashMap::new();
    for p in &placed {
        *per_device.entry(p.device_id.clone()).or_default() += 1;
    }
    assert!(per_device.values().all(|&n| n == 1), "{per_device:?}");
    // The reservation, placement and spec are one transaction: a placed task has all
    // three, a task that lost the race has none (no placement left behind).
    let placements = store.range(keys::TASKS).await.expect("range tasks").kvs;
    let with = |suffix: &str| -> Vec<String> {
        let mut ids: Vec<String> = placements
            .iter()
            .filter(|kv| kv.key.ends_with(suffix))
            .map(|kv| kv.key.clone())
            .collect();
        ids.sort();
        ids
    };
    let mut expected: Vec<String> = placed
        .iter()
        .map(|p| keys::task_placement(&p.task_id))
        .collect();
    expected.sort();
    assert_eq!(with("/placement"), expected);
    let mut expected: Vec<String> = placed.iter().map(|p| keys::task_spec(&p.task_id)).collect();
    expected.sort();
    assert_eq!(with("/spec"), expected);

    // No version of any residents record ever exceeded the device's usable memory: every
    // change up to a marker written now (events come in revision order, so the watch has
    // delivered them all once it delivers the marker, however slow it is).
    let marker = format!("{}test-marker", keys::DEVICES);
    store
        .put(&marker, b"end".to_vec(), None)
        .await
        .expect("put the marker");
    let mut versions = 0;
    loop {
        match tokio::time::timeout(Duration::from_secs(30), watch.next()).await {
            Ok(Some(Ok(WatchEvent::Put(kv)))) if kv.key == marker => break,
            Ok(Some(Ok(WatchEvent::Put(kv)))) if kv.key.ends_with("/residents") => {
                let record: DeviceResidents = typed::decode(&kv).expect("decode");
                let total: u64 = record.reservations.iter().map(|r| r.reserved_mem_mib).sum();
                assert!(
                    total <= usable_16g(),
                    "{} over capacity: {total} MiB",
                    kv.key
                );
                versions += 1;
            }
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(err))) => panic!("watch failed: {err}"),
            Ok(None) => panic!("the watch ended before the marker"),
            Err(_) => panic!("the marker did not arrive within 30 s"),
        }
    }
    assert_eq!(versions, DEVICES, "one successful reservation per device");
    for d in 0..DEVICES {
        let (record, _) = typed::get::<DeviceResidents>(
            store.as_ref(),
            &keys::device_residents(&format!("n{d}.gpu0")),
        )
        .await
        .expect("get")
        .expect("record");
        assert_eq!(record.reservations.len(), 2);
    }
    one.shutdown().await;
    two.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_follows_registrations_reservations_and_samples_written_by_others() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    let daemon = daemon(store.clone(), None).await;
    let mut c = client(&daemon).await;
    let queued = place(&mut c, task("early", 1000, 10.0))
        .await
        .expect("place");
    assert!(
        matches!(queued.decision, Some(place_response::Decision::Queued(_))),
        "no device yet"
    );

    register(store.as_ref(), "late.gpu0", "late", 8_192).await;
    let service = daemon.service().clone();
    eventually("the new device in the view", async || {
        service.view().len() == 1
    })
    .await;
    // Another placer's reservation fills the device: the view must see it.
    let record = DeviceResidents {
        device_id: "late.gpu0".into(),
        reservations: vec![iadeep_proto::Reservation {
            task_id: "elsewhere".into(),
            reserved_mem_mib: 7_000,
            ..Default::default()
        }],
        ..Default::default()
    };
    typed::put(
        store.as_ref(),
        &keys::device_residents("late.gpu0"),
        &record,
        None,
    )
    .await
    .expect("put residents");
    eventually("the foreign reservation", async || {
        service.view().resident_count() == 1
    })
    .await;
    let full = place(&mut c, task("early", 1000, 10.0))
        .await
        .expect("place");
    let Some(place_response::Decision::Queued(q)) = full.decision else {
        panic!("the device is full: {full:?}");
    };
    assert!(q.reason.contains("memory"), "{}", q.reason);
    assert!(q.retry_after_ms > 0);

    let sample = CoLocationSample {
        device_kind: "v100".into(),
        slowdown: 1.4,
        device_id: "late.gpu0".into(),
        ..Default::default()
    };
    typed::put(store.as_ref(), &keys::sample("late.gpu0", 1), &sample, None)
        .await
        .expect("put sample");
    // A value that does not decode is skipped, not fatal.
    store
        .put(&keys::sample("late.gpu0", 2), vec![0xff, 0xff, 0xff], None)
        .await
        .expect("put garbage");
    let metrics = daemon.metrics().clone();
    eventually("the sample observed", async || {
        metrics.samples_observed.get() == 1
    })
    .await;
    eventually("the garbage counted", async || {
        metrics.decode_errors.get() == 1
    })
    .await;

    store
        .delete(&keys::device_info("late.gpu0"))
        .await
        .expect("delete");
    eventually("the device unregistered", async || {
        service
            .view()
            .device("late.gpu0")
            .is_some_and(|d| d.info.is_none())
    })
    .await;
    daemon.shutdown().await;
}

// ----- gRPC health and reflection -----

/// Kubernetes' gRPC probes and grpcurl use these two standard services; the clients
/// here are generated from their published protos (tonic-health, tonic-reflection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_and_reflection_answer_generated_clients() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let server = start_etcd();
    let store = etcd_store(&server).await;
    let daemon = daemon(store.clone(), None).await;
    let channel = Channel::from_shared(format!("http://{}", daemon.grpc_addr()))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    let mut health = HealthClient::new(channel.clone());
    for service in ["", "iadeep.v1.Placer"] {
        let answer = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .expect("health check")
            .into_inner();
        assert_eq!(answer.status(), ServingStatus::Serving, "{service:?}");
    }
    let unknown = health
        .check(HealthCheckRequest {
            service: "no.such.Service".into(),
        })
        .await
        .expect_err("unknown service");
    assert_eq!(unknown.code(), Code::NotFound);

    let mut reflection = ServerReflectionClient::new(channel);
    let requests = [
        MessageRequest::ListServices(String::new()),
        MessageRequest::FileContainingSymbol("iadeep.v1.Placer".into()),
    ]
    .map(|message| ServerReflectionRequest {
        host: String::new(),
        message_request: Some(message),
    });
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter(requests))
        .await
        .expect("reflection stream")
        .into_inner();
    let Some(MessageResponse::ListServicesResponse(list)) = answers
        .message()
        .await
        .expect("answer")
        .and_then(|a| a.message_response)
    else {
        panic!("a service list");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for expected in ["iadeep.v1.Placer", "grpc.health.v1.Health"] {
        assert!(names.iter().any(|n| n == expected), "{names:?}");
    }
    let Some(MessageResponse::FileDescriptorResponse(files)) = answers
        .message()
        .await
        .expect("answer")
        .and_then(|a| a.message_response)
    else {
        panic!("file descriptors");
    };
    assert!(!files.file_descriptor_proto.is_empty());
    daemon.shutdown().await;
}

// ----- Kubernetes scheduler extender -----

pub(crate) fn pod(name: &str, gpumem: &str, annotations: Value) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"),
                      "annotations": annotations},
        "spec": {"schedulerName": "iadeep", "containers": [{"name": "trainer", "image": "pytorch:2",
            "resources": {"limits": {"nvidia.com/gpumem": gpumem, "cpu": "4"}}}]}
    })
}

fn node(name: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
           "status": {"allocatable": {"nvidia.com/gpumem": "32768"}}})
}

/// POSTs to the extender as kube-scheduler does; prints the exchange (run with
/// `--nocapture` for a kube-scheduler-shaped transcript).
async fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, bytes) = http::post_json(addr, path, body.to_string().as_bytes()).await;
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    eprintln!("POST {path} {body}\n  -> HTTP {status} {value}");
    (status, value)
}

/// Writes `device`'s residents record as the placer would: `spec` alone, reserved at
/// its memory request.
async fn put_resident(store: &dyn StateStore, device: &str, spec: TaskSpec) {
    let record = DeviceResidents {
        device_id: device.into(),
        reservations: vec![iadeep_proto::Reservation {
            task_id: spec.task_id.clone(),
            reserved_mem_mib: spec.gpu_mem_request_mib,
            spec: Some(spec),
            ..Default::default()
        }],
        ..Default::default()
    };
    typed::put(store, &keys::device_residents(device), &record, None)
        .await
        .expect("put residents");
}

fn bind_args(name: &str, node: &str) -> Value {
    json!({"PodName": name, "PodNamespace": "ml", "PodUID": format!("uid-{name}"), "Node": node})
}

async fn placement_of(store: &dyn StateStore, task: &str) -> Option<Placement> {
    typed::get::<Placement>(store, &keys::task_placement(task))
        .await
        .expect("get")
        .map(|(p, _)| p)
}

/// The whole kube-scheduler conversation, with the pod's GPU memory in the canonical
/// form Kubernetes sends (`12k` for a pod that asked for "12000", i.e. 12,000 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extender_filters_prioritizes_and_binds_kube_scheduler_payloads() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    register(store.as_ref(), "big.gpu0", "big", 32_768).await;
    register(store.as_ref(), "small.gpu0", "small", 8_192).await;
    // "busy" has a GPU with a heavy resident: feasible, but a worse place than "big".
    register(store.as_ref(), "busy.gpu0", "busy", 32_768).await;
    put_resident(store.as_ref(), "busy.gpu0", task("heavy", 4_000, 95.0)).await;
    let kube = FakeKube::start().await;
    let daemon = daemon(store.clone(), Some(&kube)).await;
    let ext = daemon.extender_addr().expect("extender served").to_string();
    let annotations = json!({"iadeep.io/batch-size": "64", "iadeep.io/max-batch-size": "256",
                             "iadeep.io/sm-util-pct": "80", "iadeep.io/step-time-s": "0.3",
                             "iadeep.io/model": "bert-base"});
    let p = pod("bert", "12k", annotations.clone());
    kube.add_pod(&p);

    // Not node-cache capable: full Node objects in, the passing ones echoed back.
    let args = json!({"Pod": p, "Nodes": {"metadata": {}, "items": [node("big"), node("small"), node("busy"), node("cpu-only")]}});
    let (status, result) = post(&ext, "/filter", &args).await;
    assert_eq!(status, 200, "{result}");
    assert_eq!(result["Error"], "", "{result}");
    let names: Vec<&str> = result["Nodes"]["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|n| n["metadata"]["name"].as_str())
        .collect();
    assert_eq!(names, vec!["big", "busy"]);
    assert_eq!(
        result["Nodes"]["items"][0]["status"]["allocatable"]["nvidia.com/gpumem"],
        "32768"
    );
    // 12,000 MiB can never fit the 8 GiB card: preemption cannot help.
    let small = result["FailedAndUnresolvableNodes"]["small"]
        .as_str()
        .expect("small can never take it");
    assert!(small.contains("never fits"), "{small}");
    assert!(
        result["FailedAndUnresolvableNodes"]["cpu-only"]
            .as_str()
            .is_some(),
        "{result}"
    );

    // Node-cache capable: names in, names out.
    let args = json!({"Pod": p, "NodeNames": ["big", "small", "busy"]});
    let (_, result) = post(&ext, "/filter", &args).await;
    assert_eq!(result["NodeNames"], json!(["big", "busy"]), "{result}");

    let (status, scores) = post(&ext, "/prioritize", &args).await;
    assert_eq!(status, 200, "{scores}");
    let score = |host: &str| {
        scores
            .as_array()
            .expect("HostPriorityList")
            .iter()
            .find(|h| h["Host"] == host)
            .and_then(|h| h["Score"].as_i64())
            .expect("scored")
    };
    assert_eq!(score("big"), 10, "an idle GPU scores 10");
    assert_eq!(score("small"), 0, "an infeasible node scores 0");
    assert!((1..10).contains(&score("busy")), "{scores}");

    let (status, result) = post(&ext, "/bind", &bind_args("bert", "big")).await;
    assert_eq!((status, &result["Error"]), (200, &json!("")), "{result}");
    let seen = kube.bindings();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].0, "ml/bert");
    assert_eq!(seen[0].1["kind"], "Binding");
    assert_eq!(seen[0].1["target"]["name"], "big");
    assert_eq!(seen[0].1["metadata"]["uid"], "uid-bert");
    let placement = placement_of(store.as_ref(), "ml.bert")
        .await
        .expect("placement recorded");
    assert_eq!(placement.device_id, "big.gpu0");
    assert_eq!(placement.reserved_mem_mib, 12_000, "12k is 12,000 MiB");
    // The pod says which GPU it got, for a device plugin or the container.
    let bound = kube.pod("ml", "bert");
    eprintln!("pod after bind: {}", bound["metadata"]["annotations"]);
    assert_eq!(
        bound["metadata"]["annotations"]["iadeep.io/device-id"],
        "big.gpu0"
    );
    assert_eq!(
        bound["metadata"]["annotations"]["iadeep.io/reserved-mem-mib"],
        "12000"
    );
    assert_eq!(
        bound["metadata"]["annotations"]["iadeep.io/task-id"],
        "ml.bert"
    );
    assert_eq!(bound["spec"]["nodeName"], "big");

    // Once placed, filter only lets the pod's own node through.
    let (_, result) = post(&ext, "/filter", &args).await;
    assert_eq!(result["NodeNames"], json!(["big"]), "{result}");

    // Bind for a pod the API server does not have, and a pod whose annotation is wrong.
    let (_, result) = post(&ext, "/bind", &bind_args("ghost", "big")).await;
    let error = result["Error"].as_str().expect("error");
    assert!(
        error.contains("cannot read pod ml/ghost") && error.contains("404"),
        "{error}"
    );
    let bad = pod("bad", "4000", json!({"iadeep.io/batch-size": "lots"}));
    let (status, result) = post(&ext, "/filter", &json!({"Pod": bad, "NodeNames": ["big"]})).await;
    assert_eq!(status, 200);
    assert!(
        result["Error"]
            .as_str()
            .expect("error")
            .contains("iadeep.io/batch-size"),
        "{result}"
    );
    let bad = pod("bad", "4 GB", json!({"iadeep.io/batch-size": "8"}));
    let (_, result) = post(&ext, "/filter", &json!({"Pod": bad, "NodeNames": ["big"]})).await;
    assert!(
        result["Error"]
            .as_str()
            .expect("error")
            .contains("nvidia.com/gpumem"),
        "{result}"
    );
    daemon.shutdown().await;
}

/// The extender's filter holds a GPU for a pod waiting ahead as a Place does: once the
/// GPU frees up, a pod filtered after it that asks first fails every node with the
/// hold's reason, and the earlier pod passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_extender_filter_holds_a_gpu_for_the_pod_waiting_ahead() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    register(store.as_ref(), "solo.gpu0", "solo", 16_384).await;
    put_resident(store.as_ref(), "solo.gpu0", task("resident", 10_000, 50.0)).await;
    let key = keys::device_residents("solo.gpu0");
    let kube = FakeKube::start().await;
    let daemon = daemon(store.clone(), Some(&kube)).await;
    let ext = daemon.extender_addr().expect("extender served").to_string();
    let annotations = json!({"iadeep.io/batch-size": "64", "iadeep.io/model": "bert-base"});
    let filter = |name: &str| {
        let args = json!({"Pod": pod(name, "10000", annotations.clone()), "NodeNames": ["solo"]});
        let ext = ext.clone();
        async move { post(&ext, "/filter", &args).await.1 }
    };
    // 10,000 MiB each next to the resident's 10,000 on 16,384: both wait, early first.
    for name in ["early", "late"] {
        let result = filter(name).await;
        assert_eq!(result["NodeNames"], json!([]), "{result}");
    }
    typed::put(
        store.as_ref(),
        &key,
        &DeviceResidents {
            device_id: "solo.gpu0".into(),
            ..Default::default()
        },
        None,
    )
    .await
    .expect("the resident leaves");
    // The later pod asks first once the placer's view has seen the GPU free up.
    let started = Instant::now();
    let held = loop {
        let result = filter("late").await;
        let reason = result["FailedNodes"]["solo"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if reason.contains("is held for") {
            break reason;
        }
        assert_ne!(
            result["NodeNames"],
            json!(["solo"]),
            "the later pod passed: {result}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the GPU was never held: {result}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(held.contains("is held for ml.early"), "{held}");
    let result = filter("early").await;
    assert_eq!(result["NodeNames"], json!(["solo"]), "{result}");
    daemon.shutdown().await;
}

/// A request no GPU can hold fails every node as unresolvable, and does not count as
/// waiting ahead of the pods after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_that_can_never_fit_are_unresolvable_and_wait_for_nothing() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    register(store.as_ref(), "n1.gpu0", "n1", 16_384).await;
    let daemon = daemon(store.clone(), None).await;
    let ext = daemon.extender_addr().expect("extender").to_string();
    for (name, gpumem) in [("huge", "100Gi"), ("tebi", "1Ti"), ("many-mib", "200k")] {
        let p = pod(name, gpumem, json!({"iadeep.io/batch-size": "8"}));
        let (_, result) = post(&ext, "/filter", &json!({"Pod": p, "NodeNames": ["n1"]})).await;
        assert_eq!(result["NodeNames"], json!([]), "{result}");
        assert_eq!(result["FailedNodes"], json!({}), "{result}");
        let why = result["FailedAndUnresolvableNodes"]["n1"]
            .as_str()
            .expect("unresolvable");
        assert!(why.contains("never fits"), "{why}");
    }
    // Absurd amounts are malformed requests, answered with the reason.
    let p = pod("exa", "2E", json!({"iadeep.io/batch-size": "8"}));
    let (_, result) = post(&ext, "/filter", &json!({"Pod": p, "NodeNames": ["n1"]})).await;
    let error = result["Error"].as_str().expect("error");
    assert!(error.contains("gpu_mem_request_mib"), "{error}");
    assert_eq!(
        daemon
            .service()
            .view()
            .waiting_ahead_of(&task("next", 1000, 10.0), iadeep_proto::now_unix_ms()),
        0,
        "never-fitting pods wait ahead of nobody"
    );
    daemon.shutdown().await;
}

/// A production pod whose slowdown cap every node's GPU would break (a heavy
/// opportunistic resident there) is not failed everywhere: the node where evicting
/// opportunistic residents makes room passes the filter, so the bind reaches the
/// placer, which evicts them and answers "queued" until they are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_production_pod_makes_room_through_bind_by_evicting() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    register(store.as_ref(), "n1.gpu0", "n1", 32_768).await;
    put_resident(store.as_ref(), "n1.gpu0", task("opp", 4_000, 95.0)).await;
    let kube = FakeKube::start().await;
    // Production by its Kubernetes PriorityClass, through the daemon's rule (the
    // annotation's path is the extender's unit tests').
    let rule = iadeep_placer::extender::PriorityRule::new(["prod-critical"]);
    let daemon = daemon_with(store.clone(), Some(&kube), None, rule).await;
    let ext = daemon.extender_addr().expect("extender").to_string();
    let annotations = json!({"iadeep.io/batch-size": "64", "iadeep.io/sm-util-pct": "95",
                             "iadeep.io/mem-bw-util-pct": "50", "iadeep.io/step-time-s": "0.2"});
    let mut p = pod("prod", "4000", annotations);
    p["spec"]["priorityClassName"] = json!("prod-critical");
    // Created long ago, so it has waited past the placer's room-eviction patience (its
    // submission is the pod's creation); a pod created now would queue for 30 minutes
    // first (the patience rule's own test is the policy's).
    p["metadata"]["creationTimestamp"] = json!("2020-01-01T00:00:00Z");
    kube.add_pod(&p);
    let (_, result) = post(&ext, "/filter", &json!({"Pod": p, "NodeNames": ["n1"]})).await;
    assert_eq!(result["NodeNames"], json!(["n1"]), "{result}");

    let (_, result) = post(&ext, "/bind", &bind_args("prod", "n1")).await;
    let error = result["Error"].as_str().expect("not bound yet");
    assert!(error.contains("queued"), "{error}");
    assert!(
        kube.bindings().is_empty(),
        "no Binding while the victim runs"
    );
    let (evicted, _) = typed::get::<iadeep_proto::BatchSizeAssignment>(
        store.as_ref(),
        &keys::task_assignment("opp"),
    )
    .await
    .expect("get")
    .expect("the victim's assignment");
    assert!(evicted.evict, "{evicted:?}");
    assert!(placement_of(store.as_ref(), "ml.prod").await.is_none());

    daemon.shutdown().await;
}

async fn extender_with_pod(
    store: &Arc<dyn StateStore>,
    kube: &FakeKube,
    name: &str,
) -> (Daemon, String) {
    register(store.as_ref(), "big.gpu0", "big", 32_768).await;
    let daemon = daemon(store.clone(), Some(kube)).await;
    let ext = daemon.extender_addr().expect("extender").to_string();
    let p = pod(name, "4000", json!({"iadeep.io/batch-size": "32"}));
    kube.add_pod(&p);
    let (_, result) = post(&ext, "/filter", &json!({"Pod": p, "NodeNames": ["big"]})).await;
    assert_eq!(result["NodeNames"], json!(["big"]), "{result}");
    (daemon, ext)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_binding_gives_the_reservation_back() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    let kube = FakeKube::start().await;
    let (daemon, ext) = extender_with_pod(&store, &kube, "bert").await;
    kube.answer_bindings(BindAnswer::Refuse(403));
    let (_, result) = post(&ext, "/bind", &bind_args("bert", "big")).await;
    let error = result["Error"].as_str().expect("error");
    assert!(error.contains("HTTP 403"), "{error}");
    assert_eq!(kube.bindings().len(), 1);
    assert!(
        store
            .get(&keys::device_residents("big.gpu0"))
            .await
            .expect("get")
            .is_none()
    );
    assert!(placement_of(store.as_ref(), "ml.bert").await.is_none());
    daemon.shutdown().await;
}

/// Names go into the API server's URL paths: a pod or namespace name Kubernetes
/// would never have given is refused before any call, and a valid one reaches the
/// pod's own `binding` subresource.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_refuses_names_kubernetes_would_not_give_before_calling_the_api() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    let kube = FakeKube::start().await;
    let (daemon, ext) = extender_with_pod(&store, &kube, "bert").await;
    let traversal = "x/../../../../namespaces/kube-system/pods/other";
    let hostile = [
        (
            json!({"PodName": traversal, "PodNamespace": "ml", "Node": "big"}),
            "PodName",
        ),
        (
            json!({"PodName": "bert", "PodNamespace": "ml/../kube-system", "Node": "big"}),
            "PodNamespace",
        ),
        (
            json!({"PodName": "bert", "PodNamespace": "ml", "Node": "big/../x"}),
            "Node",
        ),
        (
            json!({"PodName": "Bert", "PodNamespace": "ml", "Node": "big"}),
            "PodName",
        ),
        (
            json!({"PodName": "..", "PodNamespace": "ml", "Node": "big"}),
            "PodName",
        ),
    ];
    for (args, field) in hostile {
        let (status, result) = post(&ext, "/bind", &args).await;
        assert_eq!(
            status, 200,
            "kube-scheduler reads the Error field: {result}"
        );
        let error = result["Error"].as_str().expect("an error");
        assert!(error.contains(&format!("invalid {field}")), "{error}");
    }
    assert_eq!(
        kube.requests(),
        Vec::<String>::new(),
        "nothing may reach the API server"
    );
    assert!(placement_of(store.as_ref(), "ml.bert").await.is_none());

    let (_, result) = post(&ext, "/bind", &bind_args("bert", "big")).await;
    assert_eq!(result["Error"], "", "{result}");
    assert!(
        kube.requests()
            .contains(&"POST /api/v1/namespaces/ml/pods/bert/binding".to_owned()),
        "{:?}",
        kube.requests()
    );
    daemon.shutdown().await;
}

/// A Binding whose answer never came may exist: the reservation stays, and the pod
/// itself tells whether it was bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_binding_keeps_the_reservation_and_settles_against_the_pod() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    let kube = FakeKube::start().await;
    let (daemon, ext) = extender_with_pod(&store, &kube, "slow").await;

    // Applied, but the answer comes after the bind budget: the read-back sees the pod
    // on the node, so the bind succeeded.
    kube.answer_bindings(BindAnswer::ApplyThenStall(BIND_TIMEOUT * 3));
    let (_, result) = post(&ext, "/bind", &bind_args("slow", "big")).await;
    assert_eq!(result["Error"], "", "{result}");
    assert_eq!(kube.pod("ml", "slow")["spec"]["nodeName"], "big");
    let placement = placement_of(store.as_ref(), "ml.slow").await.expect("kept");
    assert_eq!(placement.device_id, "big.gpu0");

    // A server error and nothing applied: the outcome is unknown and the pod not bound,
    // so the reservation is kept and the bind reported failed.
    let p = pod("flaky", "4000", json!({"iadeep.io/batch-size": "32"}));
    kube.add_pod(&p);
    kube.answer_bindings(BindAnswer::FailUnapplied);
    let (_, result) = post(&ext, "/bind", &bind_args("flaky", "big")).await;
    let error = result["Error"].as_str().expect("error");
    assert!(
        error.contains("HTTP 500") && error.contains("kept"),
        "{error}"
    );
    let first = placement_of(store.as_ref(), "ml.flaky")
        .await
        .expect("kept");

    // kube-scheduler retries. A second placer replica, which never saw this pod's
    // filter, answers: filter passes only the reserved node, bind keeps the reservation
    // it finds and creates the Binding.
    let replica = daemon_with(store.clone(), Some(&kube), None, Default::default()).await;
    let ext2 = replica.extender_addr().expect("extender").to_string();
    kube.answer_bindings(BindAnswer::Create);
    eventually("the replica sees the reservation", async || {
        replica.service().view().device_of("ml.flaky").is_some()
    })
    .await;
    let (_, result) = post(&ext2, "/filter", &json!({"Pod": p, "NodeNames": ["big"]})).await;
    assert_eq!(result["NodeNames"], json!(["big"]), "{result}");
    let (_, result) = post(&ext2, "/bind", &bind_args("flaky", "big")).await;
    assert_eq!(result["Error"], "", "{result}");
    assert_eq!(kube.pod("ml", "flaky")["spec"]["nodeName"], "big");
    let again = placement_of(store.as_ref(), "ml.flaky")
        .await
        .expect("still placed");
    assert_eq!(again, first, "the same reservation, not a second one");
    let mut residents = residents_of(store.as_ref(), "big.gpu0").await;
    residents.sort();
    assert_eq!(residents, ["ml.flaky", "ml.slow"]);
    replica.shutdown().await;
    daemon.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_never_crashes_the_daemon() {
    let server = start_etcd();
    let store = etcd_store(&server).await;
    register(store.as_ref(), "n1.gpu0", "n1", 16_384).await;
    let daemon = daemon(store.clone(), None).await;
    let ext = daemon.extender_addr().expect("extender").to_string();
    let bodies: Vec<&[u8]> = vec![
        b"",
        b"not json",
        b"[]",
        b"{\"Pod\": 7}",
        b"{\"Pod\": {\"metadata\": {\"name\": \"x\", \"annotations\": {\"iadeep.io/batch-size\": \"99999999999999\"}}}}",
        b"{\"Pod\": {\"metadata\": {\"name\": \"x\", \"annotations\": {\"iadeep.io/batch-size\": \"8\"}}, \"spec\": {\"containers\": [{\"name\": \"c\", \"resources\": {\"limits\": {\"nvidia.com/gpumem\": \"1e400\"}}}]}}, \"NodeNames\": [\"n1\"]}",
        b"{\"Pod\": {\"metadata\": {\"name\": \"x\", \"annotations\": {\"iadeep.io/batch-size\": \"8\"}}, \"spec\": {\"containers\": [{\"name\": \"c\", \"resources\": {\"limits\": {\"nvidia.com/gpumem\": 3000}}}]}}, \"NodeNames\": [\"n1\"]}",
        b"{\"PodName\": \"\", \"Node\": \"\"}",
        &[0xff, 0xfe, 0x00],
    ];
    for path in ["/filter", "/prioritize", "/bind"] {
        for body in &bodies {
            let (status, _) = http::post_json(&ext, path, body).await;
            assert!(status == 200 || status == 400, "{path}: HTTP {status}");
        }
    }
    let (status, _) = http::post_json(&ext, "/nope", b"{}").await;
    assert_eq!(status, 404);
    // Still serving both front ends.
    let mut c = client(&daemon).await;
    let ok = place(&mut c, task("after", 1000, 10.0))
        .await
        .expect("place");
    assert!(matches!(
        ok.decision,
        Some(place_response::Decision::Placed(_))
    ));
    let (status, _) = post(
        &ext,
        "/filter",
        &json!({"Pod": pod("p", "100", json!({"iadeep.io/batch-size": "8"})), "NodeNames": ["n1"]}),
    )
    .await;
    assert_eq!(status, 200);
    daemon.shutdown().await;
}
