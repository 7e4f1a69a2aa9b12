//! One placement decision over a synthetic cluster of 1,000 GPUs with 2,000
//! resident tasks (the size the issue sets), with the interim models.
//!
//! `cargo bench -p iadeep-placer --bench decide`

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use iadeep_placer::synthetic::SyntheticCluster;
use iadeep_placer::{DeclaredOrPeakMemory, Placer, PlacerParams, UtilisationHeuristic};

fn decide(c: &mut Criterion) {
    let cluster = SyntheticCluster::new(1_000, 2_000, 42);
    assert_eq!(
        cluster.resident_count(),
        2_000,
        "the cluster must hold every resident"
    );
    let view = cluster.view(Arc::new(DeclaredOrPeakMemory));
    let placer = Placer::new(PlacerParams::default(), Arc::new(UtilisationHeuristic))
        .expect("default params are valid");
    let arrivals: Vec<_> = (0..64).map(|i| cluster.arrival(i)).collect();
    let now = iadeep_proto::now_unix_ms();
    let mut i = 0;
    c.bench_function("decide_1000_devices_2000_residents", |b| {
        b.iter(|| {
            i = (i + 1) % arrivals.len();
            black_box(placer.decide(&view, &arrivals[i], &[], now))
        })
    });
}

criterion_group!(benches, decide);
criterion_main!(benches);
