//! The predictor over a real etcd: samples persisted through the store rebuild,
//! after a "restart", a predictor that predicts exactly like the one that wrote them.

use std::sync::Arc;

use iadeep_predictor::{LearnerParams, OnlinePredictor, PredictionSource, validate_sample};
use iadeep_proto::{CoLocationSample, TaskProfile};
use iadeep_state::testing::EtcdServer;
use iadeep_state::{EtcdStore, StateStore, append_sample, keys, load_samples};

fn sample(i: u32) -> CoLocationSample {
    let step = 0.03 * f64::from(i % 13 + 1);
    let co = 0.05 * f64::from(i % 5 + 1);
    let p = |m: String, s: f64, util: f64| TaskProfile {
        model: m,
        batch_size: 16 << (i % 3),
        solo_step_time_s: s,
        sm_util_pct: Some(util),
        mem_bw_util_pct: None,
        gpu_mem_mib: Some(2048),
    };
    CoLocationSample {
        device_kind: "v100".into(),
        task: Some(p(format!("m{}", i % 13), step, 40.0)),
        corunners: vec![p(format!("c{}", i % 5), co, 70.0)],
        slowdown: 1.0 + co / (step + co),
        measured_at_unix_ms: 1_000 + i64::from(i),
        device_id: format!("node-{}:gpu0", i % 2),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn samples_in_etcd_rebuild_the_same_predictor() {
    let server = EtcdServer::start().expect("start etcd");
    let store: Arc<dyn StateStore> = Arc::new(
        EtcdStore::connect(&[server.endpoint()])
            .await
            .expect("connect"),
    );
    let params = LearnerParams::default();
    let live = OnlinePredictor::new(params.clone()).expect("predictor");
    for i in 0..60 {
        let s = sample(i);
        let key = append_sample(store.as_ref(), &s.device_id, &s)
            .await
            .expect("append");
        assert!(key.starts_with(keys::SAMPLES), "{key}");
        live.observe(s);
    }
    // Sequences are per device and start at 0.
    assert!(
        store
            .get(&keys::sample("node-0:gpu0", 29))
            .await
            .expect("get")
            .is_some()
    );
    assert!(
        store
            .get(&keys::sample("node-1:gpu0", 30))
            .await
            .expect("get")
            .is_none()
    );
    live.refit_now().expect("refit");

    let loaded = load_samples(store.as_ref()).await.expect("load");
    assert_eq!(loaded.len(), 60);
    assert_eq!(loaded[0], sample(0));

    let rebuilt = OnlinePredictor::from_samples(params, loaded).expect("rebuild");
    assert_eq!(rebuilt.model_samples(), 60);
    for i in 100..120 {
        let probe = sample(i);
        let task = probe.task.clone().expect("task");
        let a = live.predict("v100", &task, &probe.corunners);
        let b = rebuilt.predict("v100", &task, &probe.corunners);
        assert_eq!(a, b, "the same model and the same calibrated interval");
        assert_eq!(b.source, PredictionSource::Model);
        assert!(b.lower_90 < b.slowdown && b.slowdown < b.upper_90, "{b:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_samples_and_ids_are_refused_before_the_store() {
    let server = EtcdServer::start().expect("start etcd");
    let store = EtcdStore::connect(&[server.endpoint()])
        .await
        .expect("connect");
    let mut bad = sample(1);
    bad.slowdown = f64::NAN;
    // A writer checks a sample before storing it; the store checks the device id.
    assert!(validate_sample(&bad).is_err());
    assert!(validate_sample(&sample(1)).is_ok());
    assert!(append_sample(&store, "a/b", &sample(1)).await.is_err());
    assert!(load_samples(&store).await.expect("load").is_empty());
}
