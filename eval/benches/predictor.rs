//! Criterion benchmarks of the predictor: a refit at 1,000 samples, one prediction,
//! and scoring one new task against 1,000 devices (what the placer does per request).
//!
//! Samples come from the bundled Gavel K80 measurements, so the trees have the
//! shape they have on real data.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_eval::samples_from_gavel;
use iadeep_predictor::{LearnerParams, OnlinePredictor};
use iadeep_predictor::{ProfileTrainer, SlowdownModel, Trainer};
use iadeep_proto::{CoLocationSample, TaskProfile};

/// `n` samples: the K80 and P100 Gavel samples, repeated with slightly perturbed
/// step times until there are `n` distinct ones.
fn samples(n: usize) -> Vec<CoLocationSample> {
    let gavel = GavelThroughputs::bundled().expect("bundled Gavel file");
    let mut base = samples_from_gavel(gavel.worker("k80").expect("k80"), "k80").samples;
    base.extend(samples_from_gavel(gavel.worker("p100").expect("p100"), "p100").samples);
    (0..n)
        .map(|i| {
            let mut s = base[i % base.len()].clone();
            let jitter = 1.0 + 0.01 * (i / base.len()) as f64;
            if let Some(t) = s.task.as_mut() {
                t.solo_step_time_s *= jitter;
            }
            s
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let params = LearnerParams {
        newest: 1000,
        reservoir: 0,
        ..LearnerParams::default()
    };
    let data = samples(1000);
    let arcs: Vec<Arc<CoLocationSample>> = data.iter().cloned().map(Arc::new).collect();
    let trainer = ProfileTrainer {
        params: params.clone(),
    };
    c.bench_function("refit_1000_samples", |b| {
        b.iter(|| black_box(trainer.fit(black_box(&arcs)).expect("fit")))
    });

    let predictor = OnlinePredictor::from_samples(params.clone(), data.clone()).expect("rebuild");
    let probe = &data[17];
    let task = probe.task.clone().expect("task");
    c.bench_function("predict_one", |b| {
        b.iter(|| {
            black_box(predictor.predict("k80", black_box(&task), black_box(&probe.corunners)))
        })
    });

    // 1,000 devices with one to three residents each. The score of a device is the
    // predicted increase of Σ slowdown: the new task's own slowdown plus, for each
    // resident, its slowdown with the new task minus without it.
    let model = trainer.fit(&arcs).expect("fit");
    let profiles: Vec<TaskProfile> = data.iter().filter_map(|s| s.task.clone()).collect();
    let devices: Vec<Vec<TaskProfile>> = (0..1000)
        .map(|d| {
            (0..(1 + d % 3))
                .map(|k| profiles[(d * 7 + k * 13) % profiles.len()].clone())
                .collect()
        })
        .collect();
    let new_task = profiles[5].clone();
    c.bench_function("score_new_task_against_1000_devices", |b| {
        b.iter(|| {
            let mut best = (f64::INFINITY, usize::MAX);
            for (d, residents) in devices.iter().enumerate() {
                let mut score = model.predict("k80", &new_task, residents).slowdown;
                for (i, r) in residents.iter().enumerate() {
                    let others: Vec<TaskProfile> = residents
                        .iter()
                        .enumerate()
                        .filter(|(j, _)| *j != i)
                        .map(|(_, t)| t.clone())
                        .collect();
                    let before = model.predict("k80", r, &others).slowdown;
                    let mut with_new = others;
                    with_new.push(new_task.clone());
                    score += model.predict("k80", r, &with_new).slowdown - before;
                }
                if score < best.0 {
                    best = (score, d);
                }
            }
            black_box(best)
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
