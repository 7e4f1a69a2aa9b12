//! An emulated GPU job: follows the step-time curve Pollux measured for a model,
//! with the iadeep agent embedded, from async code. A task in this example plays
//! the tuner and moves the batch size twice; the job sleeps the measured step time
//! of whatever batch size it currently runs, so throughput follows the traces.
//! (`iadeep emulate-job` is the same loop as an operator command.)
//!
//! Run: `cargo run -p iadeep-examples --example emulated_job [MODEL]` (default cifar10)

use std::sync::Arc;
use std::time::{Duration, Instant};

use iadeep_agent::Agent;
use iadeep_eval::EmulatedJob;
use iadeep_proto::{BatchSizeAssignment, LrScalingRule, TaskReport};
use iadeep_state::{EmbeddedStore, StateStore, keys, typed};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = std::env::args().nth(1).unwrap_or_else(|| "cifar10".into());
    let task = "emulated-example";
    let sizes = EmulatedJob::bundled(&model, 1)?.measured_batch_sizes();
    let (first, last) = (sizes[0], sizes[sizes.len() - 1]);
    let job = EmulatedJob::bundled(&model, first)?;
    let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory()?);
    let agent = Agent::builder()
        .task_id(task)
        .store_handle(store.clone())
        .model(&model)
        .initial_batch_size(first)
        .batch_size_bounds(first..=last)
        .lr_rule(LrScalingRule::Sqrt)
        .report_interval(Duration::from_millis(250))
        .use_nvml(false)
        .connect_async()
        .await?;
    println!("{model}: measured batch sizes {sizes:?}");

    // The stand-in tuner: two rounds, one second apart.
    let tuner = {
        let store = store.clone();
        let plan = [(1u64, sizes[sizes.len() / 2]), (2, sizes[sizes.len() / 4])];
        tokio::spawn(async move {
            for (round, batch_size) in plan {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let a = BatchSizeAssignment {
                    task_id: task.into(),
                    batch_size,
                    lr_factor: (f64::from(batch_size) / f64::from(first)).sqrt(),
                    round,
                    ..Default::default()
                };
                typed::put(store.as_ref(), &keys::task_assignment(task), &a, None).await?;
            }
            Ok::<_, iadeep_state::StateError>(())
        })
    };

    let started = Instant::now();
    let (mut step, mut window_start, mut window_samples) = (0u64, Instant::now(), 0u64);
    while started.elapsed() < Duration::from_secs(3) {
        let bs = agent.batch_size();
        let t = Instant::now();
        tokio::time::sleep(job.step_time(bs)).await;
        agent.record_step(bs, t.elapsed());
        if let Some((b, gb, big, gbig)) =
            job.gradient_norms(started.elapsed().as_secs_f64() / 3.0, bs)
        {
            agent.record_gradient_norms(b, gb, big, gbig);
        }
        window_samples += u64::from(bs);
        step += 1;
        if let Some(change) = agent.poll_change() {
            let secs = window_start.elapsed().as_secs_f64();
            println!(
                "step {step}: at batch size {bs}: {:.0} samples/s (measured {:.1} ms/step); now -> {} (lr x{:.2}, round {})",
                window_samples as f64 / secs,
                job.step_time(bs).as_secs_f64() * 1e3,
                change.batch_size,
                change.lr_factor,
                change.round
            );
            (window_start, window_samples) = (Instant::now(), 0);
        }
    }
    tuner.await??;
    agent.report_now();
    tokio::time::sleep(Duration::from_millis(100)).await;
    if let Some((r, _)) = typed::get::<TaskReport>(store.as_ref(), &keys::task_report(task)).await?
    {
        println!(
            "last report: batch size {}, {:.1} ms/step (trace: {:.1}), {:.0} samples/s, noise scale {:.0}, round {}, {} steps",
            r.batch_size,
            r.step_time_s * 1e3,
            job.step_time(r.batch_size).as_secs_f64() * 1e3,
            r.samples_per_s,
            r.grad_noise_scale.unwrap_or(f64::NAN),
            r.assignment_round,
            r.steps_done
        );
    }
    agent.finish_async().await?;
    Ok(())
}
