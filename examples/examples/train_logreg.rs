//! A real training loop on the CPU with the iadeep agent embedded.
//!
//! Logistic regression by minibatch SGD on generated data (256 Gaussian features,
//! labels from a hidden linear rule with label noise). The agent runs on an
//! in-memory embedded store. A thread in this example plays the tuner: it reads
//! the agent's reports and, once three epochs ran, assigns a larger batch size with
//! a linear learning-rate factor, as a tuner daemon would. The loop applies the
//! change between steps, the loss keeps falling, and at the end the example
//! prints the last report the agent stored.
//!
//! Run: `cargo run --release -p iadeep-examples --example train_logreg`

use std::sync::Arc;
use std::time::{Duration, Instant};

use iadeep_agent::Agent;
use iadeep_proto::{BatchSizeAssignment, LrScalingRule, TaskReport};
use iadeep_state::{EmbeddedStore, StateStore, keys, typed};

const FEATURES: usize = 256;
const TRAIN: usize = 32_768;
const TEST: usize = 4_096;
const EPOCHS: usize = 12;
/// The stand-in tuner acts once this many epochs ran at the initial batch size.
const EPOCHS_BEFORE_TUNING: u64 = 3;
const BASE_LR: f64 = 0.05;
const INITIAL_BATCH: u32 = 32;
const TUNED_BATCH: u32 = 256;

/// A small deterministic generator (SplitMix64) so the example needs no RNG crate.
struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn gaussian(&mut self) -> f64 {
        (-2.0 * self.uniform().ln()).sqrt() * (std::f64::consts::TAU * self.uniform()).cos()
    }
}

struct Data {
    x: Vec<f64>,
    y: Vec<f64>,
}

fn generate(rng: &mut Rng, truth: &[f64], n: usize) -> Data {
    let mut x = Vec::with_capacity(n * FEATURES);
    let mut y = Vec::with_capacity(n);
    for _ in 0..n {
        let row: Vec<f64> = (0..FEATURES).map(|_| rng.gaussian()).collect();
        let margin: f64 =
            row.iter().zip(truth).map(|(a, b)| a * b).sum::<f64>() + 0.5 * rng.gaussian();
        y.push(if margin > 0.0 { 1.0 } else { 0.0 });
        x.extend(row);
    }
    Data { x, y }
}

fn sigmoid(z: f64) -> f64 {
    1.0 / (1.0 + (-z).exp())
}

/// Mean log-loss and accuracy of `w` on `data`.
fn evaluate(w: &[f64], data: &Data) -> (f64, f64) {
    let n = data.y.len();
    let (mut loss, mut correct) = (0.0, 0usize);
    for i in 0..n {
        let row = &data.x[i * FEATURES..(i + 1) * FEATURES];
        let p = sigmoid(row.iter().zip(w).map(|(a, b)| a * b).sum());
        let y = data.y[i];
        loss -= y * p.max(1e-12).ln() + (1.0 - y) * (1.0 - p).max(1e-12).ln();
        correct += usize::from((p > 0.5) == (y > 0.5));
    }
    (loss / n as f64, correct as f64 / n as f64)
}

/// One SGD step on rows `batch`; the gradient buffer is reused across steps.
fn sgd_step(w: &mut [f64], grad: &mut [f64], data: &Data, batch: &[usize], lr: f64) {
    grad.iter_mut().for_each(|g| *g = 0.0);
    for &i in batch {
        let row = &data.x[i * FEATURES..(i + 1) * FEATURES];
        let err = sigmoid(row.iter().zip(w.iter()).map(|(a, b)| a * b).sum()) - data.y[i];
        grad.iter_mut().zip(row).for_each(|(g, a)| *g += err * a);
    }
    let scale = lr / batch.len() as f64;
    w.iter_mut()
        .zip(grad.iter())
        .for_each(|(wi, g)| *wi -= scale * g);
}

/// The stand-in tuner: waits for a measured report, then assigns a new batch size.
fn tuner(store: Arc<dyn StateStore>, task: &'static str) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let report = typed::get::<TaskReport>(store.as_ref(), &keys::task_report(task))
                .await
                .map_err(|e| e.to_string())?;
            let enough = EPOCHS_BEFORE_TUNING * TRAIN as u64;
            if let Some((r, _)) =
                report.filter(|(r, _)| r.step_time_s > 0.0 && r.samples_done >= enough)
            {
                println!(
                    "[tuner] report seq {}: batch size {}, {:.3} ms/step, {:.0} samples/s, step {}",
                    r.seq,
                    r.batch_size,
                    r.step_time_s * 1e3,
                    r.samples_per_s,
                    r.steps_done
                );
                break;
            }
            if Instant::now() > deadline {
                return Err("no measured report within 60 s".into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let factor = f64::from(TUNED_BATCH) / f64::from(INITIAL_BATCH);
        let assignment = BatchSizeAssignment {
            task_id: task.into(),
            batch_size: TUNED_BATCH,
            lr_factor: factor,
            lr_rule: LrScalingRule::Linear as i32,
            round: 1,
            assigned_at_unix_ms: iadeep_proto::now_unix_ms(),
            ..BatchSizeAssignment::default()
        };
        typed::put(
            store.as_ref(),
            &keys::task_assignment(task),
            &assignment,
            None,
        )
        .await
        .map_err(|e| e.to_string())?;
        println!("[tuner] assigned batch size {TUNED_BATCH}, lr factor {factor} (round 1)");
        Ok(())
    })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let task = "logreg-example";
    let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory()?);
    let agent = Agent::builder()
        .task_id(task)
        .store_handle(store.clone())
        .model("logistic-regression")
        .initial_batch_size(INITIAL_BATCH)
        .batch_size_bounds(8..=1024)
        .lr_rule(LrScalingRule::Linear)
        .total_samples((EPOCHS * TRAIN) as u64)
        .report_interval(Duration::from_millis(100))
        .use_nvml(false)
        .connect()?;
    let tuner = {
        let store = store.clone();
        std::thread::spawn(move || tuner(store, task))
    };

    let mut rng = Rng(42);
    let truth: Vec<f64> = (0..FEATURES)
        .map(|_| rng.gaussian() * 3.0 / (FEATURES as f64).sqrt())
        .collect();
    let train = generate(&mut rng, &truth, TRAIN);
    let test = generate(&mut rng, &truth, TEST);
    let mut w = vec![0.0; FEATURES];
    let mut grad = vec![0.0; FEATURES];
    let mut order: Vec<usize> = (0..TRAIN).collect();
    let mut lr = BASE_LR;
    let (loss, acc) = evaluate(&w, &test);
    println!(
        "epoch  0: batch size {:4}, lr {lr:.3}, test loss {loss:.4}, accuracy {:.1}%",
        agent.batch_size(),
        acc * 100.0
    );
    let started = Instant::now();
    for epoch in 1..=EPOCHS {
        for i in (1..order.len()).rev() {
            order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let mut at = 0;
        while at < TRAIN {
            let bs = agent.batch_size();
            let batch = &order[at..(at + bs as usize).min(TRAIN)];
            let step = Instant::now();
            sgd_step(&mut w, &mut grad, &train, batch, lr);
            agent.record_step(batch.len() as u32, step.elapsed());
            at += batch.len();
            if let Some(change) = agent.poll_change() {
                lr = BASE_LR * change.lr_factor;
                println!(
                    "  step change (epoch {epoch}): batch size {bs} -> {}, lr -> {lr:.3} (round {})",
                    change.batch_size, change.round
                );
            }
        }
        let (loss, acc) = evaluate(&w, &test);
        println!(
            "epoch {epoch:2}: batch size {:4}, lr {lr:.3}, test loss {loss:.4}, accuracy {:.1}%",
            agent.batch_size(),
            acc * 100.0
        );
    }
    println!("trained {EPOCHS} epochs in {:.2?}", started.elapsed());
    tuner.join().map_err(|_| "tuner thread panicked")??;
    agent.report_now();
    std::thread::sleep(Duration::from_millis(200));
    agent.finish()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    if let Some((r, _)) = rt.block_on(typed::get::<TaskReport>(
        store.as_ref(),
        &keys::task_report(task),
    ))? {
        println!(
            "final report: seq {}, finished {}, batch size {}, {:.3} ms/step, {:.0} samples/s, {} steps, {} samples, round {}",
            r.seq,
            r.finished,
            r.batch_size,
            r.step_time_s * 1e3,
            r.samples_per_s,
            r.steps_done,
            r.samples_done,
            r.assignment_round
        );
    }
    let alive = rt.block_on(store.get(&keys::task_alive(task)))?;
    println!(
        "alive key after finish: {}",
        if alive.is_some() { "present" } else { "gone" }
    );
    Ok(())
}
