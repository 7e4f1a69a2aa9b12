//! One placement decision over a synthetic cluster of 1,000 GPUs with 2,000
//! resident tasks (a large cluster), with the daemon's models: the
//! online predictor cold (its transparent rule) and fitted on the bundled Gavel
//! K80 co-location measurements (its forest), and the tuner's memory model.
//!
//! The same decision with a queue of tasks that arrived earlier and wait: every
//! decision that would place asks, for each of them, whether it would take the chosen
//! device now (the hold for a task waiting ahead, `iadeep_placer`'s `policy` docs), so
//! a long queue costs each decision more.
//!
//! `cargo bench -p iadeep-eval --bench decide`

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_eval::{SyntheticCluster, samples_from_gavel};
use iadeep_placer::{ModelledMemory, Placer, PlacerParams};
use iadeep_predictor::SlowdownModel;
use iadeep_predictor::{LearnerParams, OnlinePredictor};

fn fitted() -> Arc<OnlinePredictor> {
    let gavel = GavelThroughputs::bundled().expect("bundled Gavel data");
    let worker = gavel.worker("k80").expect("k80 measurements");
    let samples = samples_from_gavel(worker, "k80").samples;
    assert!(samples.len() > 100, "enough samples to fit a forest");
    let predictor =
        OnlinePredictor::from_samples(LearnerParams::default(), samples).expect("fit forest");
    Arc::new(predictor)
}

fn decide(c: &mut Criterion) {
    let cluster = SyntheticCluster::new(1_000, 2_000, 42);
    assert_eq!(
        cluster.resident_count(),
        2_000,
        "the cluster must hold every resident"
    );
    let view = cluster.view(Arc::new(ModelledMemory));
    let arrivals: Vec<_> = (0..64).map(|i| cluster.arrival(i)).collect();
    let now = iadeep_proto::now_unix_ms();
    let models: [(&str, Arc<dyn SlowdownModel>); 2] = [
        (
            "cold",
            Arc::new(OnlinePredictor::new(LearnerParams::default()).expect("predictor")),
        ),
        ("forest", fitted()),
    ];
    for (name, model) in models {
        let placer = Placer::new(PlacerParams::default(), model).expect("default params");
        let mut i = 0;
        c.bench_function(&format!("decide_1000_devices_2000_residents_{name}"), |b| {
            b.iter(|| {
                i = (i + 1) % arrivals.len();
                black_box(placer.decide(&view, &arrivals[i], &[], now))
            })
        });
    }
}

/// `waiting` tasks submitted a minute before the arrivals, each told to queue once.
fn with_queue(cluster: &SyntheticCluster, waiting: u64, now: i64) -> iadeep_placer::ClusterView {
    let mut view = cluster.view(Arc::new(ModelledMemory));
    for k in 0..waiting {
        let mut task = cluster.arrival(1_000_000 + k);
        task.submitted_at_unix_ms = now - 60_000 + k as i64;
        view.note_waiting(&task, &[], now - 1_000, now + 600_000, None);
    }
    view
}

fn decide_with_queue(c: &mut Criterion) {
    let cluster = SyntheticCluster::new(1_000, 2_000, 42);
    let now = iadeep_proto::now_unix_ms();
    let arrivals: Vec<_> = (0..64).map(|i| cluster.arrival(i)).collect();
    let model = Arc::new(OnlinePredictor::new(LearnerParams::default()).expect("predictor"));
    let placer = Placer::new(PlacerParams::default(), model).expect("default params");
    for waiting in [10, 100, 1_000] {
        let view = with_queue(&cluster, waiting, now);
        let mut i = 0;
        c.bench_function(
            &format!("decide_1000_devices_2000_residents_{waiting}_waiting_cold"),
            |b| {
                b.iter(|| {
                    i = (i + 1) % arrivals.len();
                    black_box(placer.decide(&view, &arrivals[i], &[], now))
                })
            },
        );
    }
}

criterion_group!(benches, decide, decide_with_queue);
criterion_main!(benches);
