//! The simulator end to end: a small stream through exclusive FIFO and iadeep, the
//! iadeep run recorded in a real etcd and in the embedded store, read back with the
//! typed store API the operators' tools use.

use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_datasets::philly;
use iadeep_proto::{Placement, TaskReport, TaskSpec};
use iadeep_sim::{Experiment, ExperimentParams, RunMetrics, store_sink};
use iadeep_state::testing::EtcdServer;
use iadeep_state::{EmbeddedStore, EtcdStore, StateStore, keys, typed};

fn small_experiment() -> Experiment {
    let gavel = GavelThroughputs::bundled().expect("bundled gavel");
    let trace = philly::bundled().expect("bundled philly");
    let mut params = ExperimentParams {
        worker_type: "p100".into(),
        ..ExperimentParams::default()
    };
    params.workload.tasks = 16;
    params.workload.load = 3.0;
    params.workload.seed = 21;
    params.workload.max_duration_s = 2.0 * 3600.0;
    params.engine.gpus = 2;
    params.engine.seed = 21;
    Experiment::new(params, &gavel, &trace).expect("experiment")
}

fn run(experiment: &Experiment, name: &str) -> RunMetrics {
    let mut policy = experiment.policy(name).expect("policy");
    experiment
        .run_policy(policy.as_mut(), &mut |_, _| {})
        .expect("run")
}

async fn check_recorded(store: &dyn StateStore, experiment: &Experiment, run: &RunMetrics) {
    let written = store_sink::record_run(store, experiment, run)
        .await
        .expect("record");
    assert_eq!(written, run.gpus + 3 * run.tasks.len());
    let (specs, _) = typed::list::<TaskSpec>(store, "/iadeep/v1/tasks/", |k| k.ends_with("/spec"))
        .await
        .expect("specs");
    assert_eq!(specs.len(), experiment.job_count());
    for outcome in &run.tasks {
        let id = store_sink::task_id(outcome.id);
        let (placement, _) = typed::get::<Placement>(store, &keys::task_placement(&id))
            .await
            .expect("read")
            .expect("placement stored");
        assert!(
            store
                .get(&keys::device_info(&placement.device_id))
                .await
                .expect("read")
                .is_some(),
            "{id} placed on an unknown device {}",
            placement.device_id
        );
        let (report, _) = typed::get::<TaskReport>(store, &keys::task_report(&id))
            .await
            .expect("read")
            .expect("report stored");
        assert!(report.finished);
    }
}

#[tokio::test]
async fn iadeep_run_is_recorded_in_etcd_and_the_embedded_store() {
    let experiment = small_experiment();
    let exclusive = run(&experiment, "exclusive").summary();
    let iadeep = run(&experiment, "iadeep");
    assert_eq!(iadeep.tasks.len(), experiment.job_count());
    assert_eq!(iadeep.ooms, 0);
    assert!(iadeep.summary().avg_ct_s.is_finite() && exclusive.avg_ct_s > 0.0);

    let server = EtcdServer::start().unwrap_or_else(|e| panic!("{e}"));
    let etcd = EtcdStore::connect(&[server.endpoint()])
        .await
        .expect("connect");
    check_recorded(&etcd, &experiment, &iadeep).await;

    let dir = tempfile::tempdir().expect("tempdir");
    let embedded = EmbeddedStore::open(dir.path().join("state.redb")).expect("open");
    check_recorded(&embedded, &experiment, &iadeep).await;
}
