//! The placer evicts, through the Kubernetes API, the pod of a task that keeps running
//! after the placer told it to leave: a pod bound by the extender's bind, a real etcd,
//! the API server faked at the HTTP level ([`FakeKube`]). The driver runs at chosen
//! instants ([`PodEvictor::tick`]) for the rules; one test lets the daemon's own loop
//! do it, for the wiring.

use std::sync::Arc;
use std::time::Duration;

use iadeep_placer::extender::ExtenderConfig;
use iadeep_placer::extender::kube_api::{KubeApi, KubeApiConfig};
use iadeep_placer::extender::pod_evictor::{PodEvictionOutcome, PodEvictor};
use iadeep_placer::{Daemon, DaemonConfig, ModelledMemory, Placer, PlacerParams};
use iadeep_predictor::{LearnerParams, OnlinePredictor};
use iadeep_proto::BatchSizeAssignment;
use iadeep_state::testing::start_etcd;
use iadeep_state::{EmbeddedStore, EtcdStore, StateStore, keys, typed};
use serde_json::{Value, json};

use crate::http;
use crate::kube_fake::FakeKube;
use crate::placer::{loopback, pod, register};

/// The grace the tests' own driver runs with.
const GRACE: Duration = Duration::from_secs(20);
/// A time the tests' driver first sees the order at, Unix ms.
const T0: i64 = 1_800_000_000_000;

/// A placer serving the extender with `fake` as its API server, whose own pod-eviction
/// loop waits `pod_evict_grace`.
async fn daemon(store: Arc<dyn StateStore>, fake: &FakeKube, pod_evict_grace: Duration) -> Daemon {
    start(store, fake, pod_evict_grace, None)
        .await
        .expect("start the placer")
}

/// [`daemon`] releasing dead tasks' memory `dead_task_grace` after their agent went.
async fn start(
    store: Arc<dyn StateStore>,
    fake: &FakeKube,
    pod_evict_grace: Duration,
    dead_task_grace: Option<Duration>,
) -> iadeep_placer::Result<Daemon> {
    let params = PlacerParams {
        pod_evict_grace,
        ..PlacerParams::default()
    };
    let placer = Placer::new(
        params,
        Arc::new(OnlinePredictor::new(LearnerParams::default()).expect("predictor")),
    )
    .expect("valid params");
    let config = DaemonConfig {
        grpc: loopback(),
        extender: Some(ExtenderConfig {
            listen: loopback(),
            kube_api: Some(KubeApiConfig::Url(fake.url.clone())),
            bind_timeout: Duration::from_secs(3),
            priority_rule: Default::default(),
        }),
        metrics: None,
        dead_task_grace,
        unstarted_task_grace: None,
        tls: None,
    };
    Daemon::start(store, placer, Arc::new(ModelledMemory), config).await
}

/// A daemon embedded without the CLI is held to the same rule as `iadeep placer`: a
/// pod-eviction grace that, with kubelet's termination grace, does not end before the
/// dead-task grace is refused at start (an evicted pod could still run on a GPU whose
/// memory was given away); within it, the daemon starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_evict_grace_past_the_dead_task_grace_is_refused_at_start() {
    let fake = FakeKube::start().await;
    let store = || -> Arc<dyn StateStore> { Arc::new(EmbeddedStore::in_memory().expect("store")) };
    let dead = Some(Duration::from_secs(40));
    let err = start(store(), &fake, GRACE, dead)
        .await
        .expect_err("20 s + 30 s is not under 40 s");
    assert!(err.to_string().contains("pod_evict_grace"), "{err}");
    let daemon = start(store(), &fake, Duration::from_secs(9), dead)
        .await
        .expect("9 s + 30 s is under 40 s");
    daemon.shutdown().await;
}

async fn post(addr: &str, path: &str, body: &Value) -> Value {
    let (status, bytes) = http::post_json(addr, path, body.to_string().as_bytes()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    serde_json::from_slice(&bytes).expect("JSON")
}

/// Binds the opportunistic pod `ml/{name}` (task `ml.{name}`) to node `n1` through the
/// extender, as kube-scheduler does.
async fn bind(daemon: &Daemon, fake: &FakeKube, name: &str) {
    let ext = daemon.extender_addr().expect("extender").to_string();
    let p = pod(name, "4000", json!({"iadeep.io/batch-size": "32"}));
    fake.add_pod(&p);
    let args = json!({"PodName": name, "PodNamespace": "ml", "PodUID": format!("uid-{name}"),
                      "Node": "n1"});
    let result = post(&ext, "/bind", &args).await;
    assert_eq!(result["Error"], "", "{result}");
}

/// Writes the task's assignment with `evict` set, as the placer's eviction executor
/// does, and waits until the daemon's view has it.
async fn order_to_leave(store: &dyn StateStore, daemon: &Daemon, task: &str) {
    set_order(store, daemon, task, true).await;
}

/// Writes the task's next assignment with `evict` as given and waits until the
/// daemon's view has it.
async fn set_order(store: &dyn StateStore, daemon: &Daemon, task: &str, evict: bool) {
    let key = keys::task_assignment(task);
    let (last, _) = typed::get::<BatchSizeAssignment>(store, &key)
        .await
        .expect("get")
        .expect("the placement wrote a starting assignment");
    let next = BatchSizeAssignment {
        round: last.round + 1,
        evict,
        evict_reason: if evict {
            "prod at PD 1.31 above its cap 1.10".into()
        } else {
            String::new()
        },
        ..last
    };
    typed::put(store, &key, &next, None).await.expect("put");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let seen = daemon.service().view().devices().any(|(_, d)| {
            d.residents
                .iter()
                .any(|r| r.reservation.task_id == task && r.leaving() == evict)
        });
        if seen {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the view never saw the order (evict: {evict})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn setup(
    pod_evict_grace: Duration,
) -> (
    iadeep_state::testing::EtcdServer,
    Arc<dyn StateStore>,
    FakeKube,
    Daemon,
) {
    let server = start_etcd();
    let store: Arc<dyn StateStore> = Arc::new(
        EtcdStore::connect(&[server.endpoint()])
            .await
            .expect("connect to etcd"),
    );
    register(store.as_ref(), "n1.gpu0", "n1", 32_768).await;
    let fake = FakeKube::start().await;
    let daemon = daemon(store.clone(), &fake, pod_evict_grace).await;
    (server, store, fake, daemon)
}

/// The tests' own driver, on the daemon's view, with [`GRACE`].
async fn driver(daemon: &Daemon, fake: &FakeKube) -> PodEvictor {
    let kube = KubeApi::connect_without_retries(&KubeApiConfig::Url(fake.url.clone()))
        .await
        .expect("client");
    PodEvictor::new(daemon.service().clone(), kube, daemon.metrics().clone()).with_grace(GRACE)
}

/// Whether the one pod of a tick was refused again, if it was refused.
fn refused_again(
    done: &[(iadeep_placer::pod_eviction::DuePod, PodEvictionOutcome)],
) -> Option<bool> {
    match done {
        [(_, PodEvictionOutcome::Blocked { again, .. })] => Some(*again),
        _ => None,
    }
}

fn outcomes(done: &[(iadeep_placer::pod_eviction::DuePod, PodEvictionOutcome)]) -> Vec<String> {
    done.iter()
        .map(|(pod, outcome)| format!("{} {outcome:?}", pod.pod()))
        .collect()
}

/// An order the pod ignores: nothing before the grace, then exactly one Eviction of
/// that pod (with its UID as precondition), never a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_still_running_after_its_grace_is_evicted_once() {
    // The daemon's own loop would wait an hour: only the test's driver acts.
    let (_server, store, fake, daemon) = setup(Duration::from_secs(3600)).await;
    bind(&daemon, &fake, "opp").await;
    bind(&daemon, &fake, "calm").await;
    let mut evictor = driver(&daemon, &fake).await;
    order_to_leave(store.as_ref(), &daemon, "ml.opp").await;

    assert!(evictor.tick(T0).await.is_empty(), "first seen now");
    assert!(
        evictor.tick(T0 + 19_999).await.is_empty(),
        "within the grace"
    );
    assert!(fake.evictions().is_empty());
    let done = evictor.tick(T0 + 20_000).await;
    assert_eq!(outcomes(&done), ["ml/opp Evicted"]);
    assert_eq!(done[0].0.task_id, "ml.opp");
    // The pod stays (the fake does not delete it): the driver must not evict it again.
    for later in [21_000, 60_000, 600_000] {
        assert!(evictor.tick(T0 + later).await.is_empty());
    }
    let evictions = fake.evictions();
    assert_eq!(evictions.len(), 1, "{evictions:?}");
    let (pod, body) = &evictions[0];
    assert_eq!(pod, "ml/opp");
    assert_eq!(body["kind"], "Eviction");
    assert_eq!(body["apiVersion"], "policy/v1");
    assert_eq!(body["metadata"]["name"], "opp");
    assert_eq!(body["deleteOptions"]["preconditions"]["uid"], "uid-opp");
    assert_eq!(
        body["deleteOptions"]["gracePeriodSeconds"], 30,
        "at most kubelet's default termination grace: {body}"
    );
    assert!(
        fake.requests()
            .contains(&"POST /api/v1/namespaces/ml/pods/opp/eviction".to_owned())
    );
    assert_eq!(daemon.metrics().pod_evicted.get(), 1);
    daemon.shutdown().await;
}

/// The pod `ml/opp` bound and ordered out, the API answering its next two Evictions
/// with a PodDisruptionBudget's 429, and the tests' driver past the grace, where the
/// first refusal (a new one) came.
async fn refused_once() -> (
    iadeep_state::testing::EtcdServer,
    Arc<dyn StateStore>,
    FakeKube,
    Daemon,
    PodEvictor,
) {
    let (server, store, fake, daemon) = setup(Duration::from_secs(3600)).await;
    bind(&daemon, &fake, "opp").await;
    let mut evictor = driver(&daemon, &fake).await;
    order_to_leave(store.as_ref(), &daemon, "ml.opp").await;
    fake.answer_evictions(&[429, 429]);
    evictor.tick(T0).await;
    let done = evictor.tick(T0 + 20_000).await;
    assert_eq!(refused_again(&done), Some(false), "{done:?}");
    (server, store, fake, daemon, evictor)
}

/// A PodDisruptionBudget refuses (429) twice: each next tick asks again (the second
/// refusal is known as one that goes on, logged at debug), and the one success ends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disruption_budget_is_asked_again_until_it_allows_the_eviction() {
    let (_server, _store, fake, daemon, mut evictor) = refused_once().await;
    // At the very next tick: a budget's refusal does not back off.
    let done = evictor.tick(T0 + 20_001).await;
    assert_eq!(refused_again(&done), Some(true), "{done:?}");
    let done = evictor.tick(T0 + 20_002).await;
    assert_eq!(outcomes(&done), ["ml/opp Evicted"]);
    assert!(evictor.tick(T0 + 22_000).await.is_empty());
    assert_eq!(fake.evictions().len(), 3, "two refused, one accepted");
    assert_eq!(daemon.metrics().pod_eviction_blocked.get(), 2);
    assert_eq!(daemon.metrics().pod_evicted.get(), 1);
    daemon.shutdown().await;
}

/// A refusal that ends because the order was withdrawn is forgotten: the same pod
/// ordered out again waits a new grace, and its first refusal then is a new one
/// (logged at info), not "refused again".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_withdrawn_order_forgets_the_budgets_refusal() {
    let (_server, store, fake, daemon, mut evictor) = refused_once().await;

    // The production job fell back under its cap: the placer withdrew the order.
    set_order(store.as_ref(), &daemon, "ml.opp", false).await;
    assert!(
        evictor.tick(T0 + 20_001).await.is_empty(),
        "no order, no eviction"
    );
    order_to_leave(store.as_ref(), &daemon, "ml.opp").await;
    assert!(
        evictor.tick(T0 + 30_000).await.is_empty(),
        "a new order starts a new grace"
    );
    let done = evictor.tick(T0 + 50_000).await;
    assert_eq!(refused_again(&done), Some(false), "a new refusal: {done:?}");
    let done = evictor.tick(T0 + 50_001).await;
    assert_eq!(outcomes(&done), ["ml/opp Evicted"]);
    assert_eq!(fake.evictions().len(), 3, "two refused, one accepted");
    daemon.shutdown().await;
}

/// The daemon runs the driver by itself when the extender binds through the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_evicts_the_pod_by_itself() {
    let (_server, store, fake, daemon) = setup(Duration::ZERO).await;
    bind(&daemon, &fake, "opp").await;
    order_to_leave(store.as_ref(), &daemon, "ml.opp").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while fake.evictions().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the daemon never evicted the pod"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(fake.evictions()[0].0, "ml/opp");
    daemon.shutdown().await;
}
