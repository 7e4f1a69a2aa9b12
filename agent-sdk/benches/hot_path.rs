//! The per-step cost the agent adds to a training loop: `batch_size()` +
//! `record_step()` (+ the `poll_change()` a loop calls between steps), with a
//! live reporter sampling the counters in the background, as in production.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use iadeep_agent::Agent;
use iadeep_state::{EmbeddedStore, StateStore};

fn hot_path(c: &mut Criterion) {
    let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
    let agent = Agent::builder()
        .task_id("bench")
        .store_handle(store)
        .initial_batch_size(128)
        .batch_size_bounds(16..=1024)
        .use_nvml(false)
        // Frequent reports, so the reporter really reads the counters while we measure.
        .report_interval(Duration::from_millis(50))
        .connect()
        .expect("agent");
    let step = Duration::from_micros(1500);

    c.bench_function("batch_size+record_step", |b| {
        b.iter(|| {
            let bs = agent.batch_size();
            agent.record_step(black_box(bs), black_box(step));
        })
    });
    c.bench_function("batch_size+record_step+poll_change", |b| {
        b.iter(|| {
            let bs = agent.batch_size();
            agent.record_step(black_box(bs), black_box(step));
            black_box(agent.poll_change());
        })
    });
    c.bench_function("record_gradient_norms", |b| {
        b.iter(|| agent.record_gradient_norms(black_box(32), 2.0, black_box(128), 1.2))
    });

    // A real (small) loop step: logistic-regression SGD on 32 x 256 inputs,
    // alone and with the agent's per-step calls, to show the overhead in context.
    const FEATURES: usize = 256;
    const BATCH: usize = 32;
    let x: Vec<f64> = (0..BATCH * FEATURES)
        .map(|i| ((i * 7919) % 1000) as f64 / 500.0 - 1.0)
        .collect();
    let y: Vec<f64> = (0..BATCH).map(|i| (i % 2) as f64).collect();
    let mut w = vec![0.0f64; FEATURES];
    let mut grad = vec![0.0f64; FEATURES];
    let sgd = |w: &mut [f64], grad: &mut [f64]| {
        grad.iter_mut().for_each(|g| *g = 0.0);
        for (row, yi) in x.chunks_exact(FEATURES).zip(&y) {
            let z: f64 = row.iter().zip(w.iter()).map(|(a, b)| a * b).sum();
            let err = 1.0 / (1.0 + (-z).exp()) - yi;
            grad.iter_mut().zip(row).for_each(|(g, a)| *g += err * a);
        }
        w.iter_mut()
            .zip(grad.iter())
            .for_each(|(wi, g)| *wi -= 0.01 * g / BATCH as f64);
    };
    let mut group = c.benchmark_group("logreg_step_32x256");
    group.bench_function("without_agent", |b| b.iter(|| sgd(&mut w, &mut grad)));
    group.bench_function("with_agent", |b| {
        b.iter(|| {
            let bs = agent.batch_size();
            let started = std::time::Instant::now();
            sgd(&mut w, &mut grad);
            agent.record_step(bs, started.elapsed());
            black_box(agent.poll_change());
        })
    });
    group.finish();
    agent.finish().expect("finish");
}

criterion_group!(benches, hot_path);
criterion_main!(benches);
