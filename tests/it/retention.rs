//! Retention and re-admission of released tasks, over a real etcd, a placer daemon and
//! a real agent: a released task's keys go once its retention is over, and a job
//! released while it runs holds a reservation again.

use std::sync::Arc;
use std::time::Duration;

use iadeep_agent::{Agent, ChangeReason};
use iadeep_placer::{Daemon, DaemonConfig, ModelledMemory, Placer, PlacerParams};
use iadeep_predictor::{LearnerParams, OnlinePredictor};
use iadeep_proto::placer_client::PlacerClient;
use iadeep_proto::{DeviceInfo, DeviceResidents, LrScalingRule, ReleaseRequest};
use iadeep_state::testing::EtcdServer;
use iadeep_state::{EtcdStore, StateStore, keys, typed};
use tonic::transport::Channel;

use crate::fixtures::spec;
use crate::placer::{eventually, place_on};

const DEVICE: &str = "n1.gpu0";

async fn cluster(server: &EtcdServer, params: PlacerParams) -> (Arc<dyn StateStore>, Daemon) {
    let store: Arc<dyn StateStore> = Arc::new(
        EtcdStore::connect(&[server.endpoint()])
            .await
            .expect("connect to etcd"),
    );
    let info = DeviceInfo {
        device_id: DEVICE.into(),
        node: "n1".into(),
        memory_mib: 16_384,
        kind: "v100".into(),
        ..Default::default()
    };
    typed::put(store.as_ref(), &keys::device_info(DEVICE), &info, None)
        .await
        .expect("register device");
    let placer = Placer::new(
        params,
        Arc::new(OnlinePredictor::new(LearnerParams::default()).expect("predictor")),
    )
    .expect("params");
    let config = DaemonConfig {
        grpc: ([127, 0, 0, 1], 0).into(),
        extender: None,
        metrics: None,
        // Short, so the reaper looks every 0.5 s (it re-admits on each look); no agent
        // here dies.
        dead_task_grace: Some(Duration::from_secs(2)),
        unstarted_task_grace: None,
        tls: None,
    };
    let daemon = Daemon::start(store.clone(), placer, Arc::new(ModelledMemory), config)
        .await
        .expect("start the placer");
    (store, daemon)
}

async fn place_and_release(client: &mut PlacerClient<Channel>, id: &str, release: bool) {
    place_on(client, spec(id), DEVICE).await;
    if release {
        client
            .release(ReleaseRequest { task_id: id.into() })
            .await
            .expect("release");
    }
}

/// A real agent of task `id` (on `device`, when given: otherwise the one its placement
/// names) that has taken one step and whose first report is in the store.
async fn start_agent(server: &EtcdServer, id: &'static str, device: Option<&'static str>) -> Agent {
    let url = server.url();
    let agent = tokio::task::spawn_blocking(move || {
        let builder = Agent::builder()
            .task_id(id)
            .store(&url)
            .model("resnet50")
            .initial_batch_size(32)
            .batch_size_bounds(16..=64)
            .lr_rule(LrScalingRule::Linear)
            .use_nvml(false)
            .memory_probe(|| Some(2_000))
            .report_interval(Duration::from_millis(100));
        match device {
            Some(device) => builder.device_id(device),
            None => builder,
        }
        .connect()
        .expect("agent connects")
    })
    .await
    .expect("agent thread");
    agent.record_step(32, Duration::from_millis(5));
    let store = EtcdStore::connect(&[server.endpoint()])
        .await
        .expect("connect to etcd");
    // The placer knows where the job runs from its report.
    eventually("the agent's report", async || {
        store
            .get(&keys::task_report(id))
            .await
            .expect("get")
            .is_some()
    })
    .await;
    agent
}

async fn task_keys(store: &dyn StateStore, id: &str) -> usize {
    store
        .range(&keys::task_prefix(id))
        .await
        .expect("range")
        .kvs
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_tasks_keys_are_deleted_after_its_retention_on_etcd() {
    let server = EtcdServer::start().expect("etcd");
    let params = PlacerParams {
        task_retention: Some(Duration::ZERO),
        ..PlacerParams::default()
    };
    let (store, daemon) = cluster(&server, params).await;
    let mut client = PlacerClient::connect(format!("http://{}", daemon.grpc_addr()))
        .await
        .expect("connect");
    place_and_release(&mut client, "done", true).await;
    place_and_release(&mut client, "running", false).await;
    let s = store.as_ref();
    // The Release moved the task out of `tasks/` at once; the retention deletes the
    // archive it moved to.
    assert_eq!(task_keys(s, "done").await, 0);
    eventually("the released task's archive to be deleted", async || {
        s.range(&keys::archive_prefix("done"))
            .await
            .expect("range")
            .kvs
            .is_empty()
    })
    .await;
    assert!(
        s.get(&keys::task_released("done"))
            .await
            .expect("get")
            .is_none()
    );
    assert_eq!(
        task_keys(s, "running").await,
        3,
        "a placed task keeps its keys"
    );
    assert!(daemon.metrics().retention_deleted.get() >= 1);
}

/// A job whose placement is released while its agent runs: the placer admits it again
/// on its device (it fits), and the agent tells its loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_released_while_it_runs_holds_a_reservation_again() {
    let server = EtcdServer::start().expect("etcd");
    let (store, daemon) = cluster(&server, PlacerParams::default()).await;
    let mut client = PlacerClient::connect(format!("http://{}", daemon.grpc_addr()))
        .await
        .expect("connect");
    place_and_release(&mut client, "job", false).await;
    let agent = start_agent(&server, "job", None).await;
    let s = store.as_ref();
    client
        .release(ReleaseRequest {
            task_id: "job".into(),
        })
        .await
        .expect("release");
    eventually("the job to be admitted again", async || {
        s.get(&keys::task_placement("job"))
            .await
            .expect("get")
            .is_some()
    })
    .await;
    let (residents, _) = typed::get::<DeviceResidents>(s, &keys::device_residents(DEVICE))
        .await
        .expect("read")
        .expect("residents");
    assert!(residents.reservations.iter().any(|r| r.task_id == "job"));
    assert!(daemon.metrics().readmitted.get() >= 1);
    let mut told = None;
    eventually("the loop to hear of it", async || {
        if let Some(change) = agent.poll_change() {
            told = Some(change.reason);
        }
        told == Some(ChangeReason::ReservationRestored)
    })
    .await;
    agent.finish().expect("finish");
}

/// A job whose agent runs without ever being placed (started outside `iadeep run`, on a
/// GPU this placer does not know, so it cannot be admitted): once it has finished, the
/// reaper archives what it left under `tasks/` and the retention deletes that, so no
/// ended job stays among the live tasks that the placer and every tuner read at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_ran_without_a_placement_leaves_nothing_once_it_ends() {
    let server = EtcdServer::start().expect("etcd");
    let params = PlacerParams {
        task_retention: Some(Duration::ZERO),
        ..PlacerParams::default()
    };
    let (store, daemon) = cluster(&server, params).await;
    let agent = start_agent(&server, "stray", Some("n9.gpu0")).await;
    let s = store.as_ref();
    // While it runs, its keys stay where its agent reads them.
    assert!(task_keys(s, "stray").await >= 3, "spec, alive, report");
    agent.finish().expect("finish");
    eventually("the ended job's keys to be gone", async || {
        task_keys(s, "stray").await == 0
            && s.range(&keys::archive_prefix("stray"))
                .await
                .expect("range")
                .kvs
                .is_empty()
    })
    .await;
    assert!(daemon.metrics().unplaced_archived.get() >= 1);
    assert!(
        s.get(&keys::task_released("stray"))
            .await
            .expect("get")
            .is_none(),
        "its marker went with it"
    );
}
