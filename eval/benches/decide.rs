//! One placement decision over a synthetic cluster of 1,000 GPUs with 2,000
//! resident tasks (a large cluster), with the daemon's models: the
//! online predictor cold (its transparent rule) and fitted on the bundled Gavel
//! K80 co-location measurements (its forest), and the tuner's memory model.
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

criterion_group!(benches, decide);
criterion_main!(benches);
