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
    agent.finish().expect("finish");
}

criterion_group!(benches, hot_path);
criterion_main!(benches);
