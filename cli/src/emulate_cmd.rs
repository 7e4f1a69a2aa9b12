//! `iadeep emulate-job`: a training job that follows measured step times.
//!
//! It embeds the real agent, so a tuner, the simulator or an end-to-end test sees
//! exactly what a real trainer would publish: it sleeps the Pollux-measured step
//! time of its current batch size, reports gradient norms consistent with the
//! traced noise scale, and switches batch size when an assignment arrives.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use iadeep_agent::{Agent, ChangeReason, DEFAULT_LEASE_TTL, DEFAULT_REPORT_INTERVAL, launch};
use iadeep_eval::EmulatedJob;
use iadeep_proto::LrScalingRule;

use crate::StoreArgs;

/// Runs an emulated training job with the agent embedded.
///
/// Each step sleeps the solo step time measured for the current batch size in the
/// bundled Pollux traces (interpolated between measured sizes), so a tuner can be
/// smoke-tested without a GPU. Stops after --steps steps (default: until Ctrl-C or
/// SIGTERM) and marks the task finished; on a signal the agent finishes the task and the
/// process ends as the signal ends it. Evicted by the placer, it leaves the task
/// unfinished and exits with status 75.
#[derive(Debug, Args)]
pub struct EmulateArgs {
    /// Task id (letters, digits, '.', '_', '-', ':'). Under `iadeep run` it is the
    /// placed task's, from IADEEP_TASK_ID, so `iadeep run -- iadeep emulate-job` works.
    #[arg(long, env = "IADEEP_TASK_ID")]
    task_id: String,
    /// Bundled Pollux model: bert, cifar10, deepspeech2, imagenet, ncf, yolov3. Under
    /// `iadeep run --model M`, M (IADEEP_MODEL).
    #[arg(long, env = launch::MODEL, default_value = "cifar10")]
    model: String,
    /// Batch size the job is submitted with (m0). Default: under `iadeep run`, its
    /// --batch-size (IADEEP_BATCH_SIZE), else the smallest measured one.
    #[arg(long, env = launch::BATCH_SIZE)]
    initial_batch_size: Option<u32>,
    /// Smallest batch size the tuner may assign. Default: under `iadeep run`, its
    /// --min-batch-size (IADEEP_MIN_BATCH_SIZE), else the smallest measured one.
    #[arg(long, env = launch::MIN_BATCH_SIZE)]
    min_batch_size: Option<u32>,
    /// Largest batch size the tuner may assign. Default: under `iadeep run`, its
    /// --max-batch-size (IADEEP_MAX_BATCH_SIZE), else the largest measured one.
    #[arg(long, env = launch::MAX_BATCH_SIZE)]
    max_batch_size: Option<u32>,
    /// The learning-rate rule the job registers (none, linear, sqrt, adascale). Default: under
    /// `iadeep run`, its --lr-rule (IADEEP_LR_RULE), else sqrt.
    #[arg(long, env = launch::LR_RULE, default_value = "sqrt",
        value_parser = clap::builder::PossibleValuesParser::new(launch::LR_RULE_NAMES))]
    lr_rule: String,
    /// Number of steps to run; without it, run until interrupted.
    #[arg(long)]
    steps: Option<u64>,
    /// Multiply every measured step time by this (e.g. 0.1 to run ten times faster).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Seconds between reports.
    #[arg(long, default_value_t = DEFAULT_REPORT_INTERVAL.as_secs_f64())]
    report_interval: f64,
    /// Lease TTL in seconds: how long the task outlives a crash of this process.
    #[arg(long, default_value_t = DEFAULT_LEASE_TTL.as_secs())]
    lease_ttl: u64,
    /// Device the job runs on, when no placement says so.
    #[arg(long)]
    device_id: Option<String>,
    #[command(flatten)]
    store: StoreArgs,
}

/// Exit status after an eviction (EX_TEMPFAIL: `iadeep run --requeue-on-evict` starts
/// the job again).
pub const EVICTED_EXIT: u8 = 75;

/// Rejects a time scale or report interval that would make the step loop sleep for a
/// negative, infinite or NaN time.
fn check_timings(args: &EmulateArgs) -> anyhow::Result<()> {
    if !(args.time_scale.is_finite() && args.time_scale > 0.0) {
        anyhow::bail!(
            "--time-scale must be a positive number, got {}",
            args.time_scale
        );
    }
    if !(args.report_interval.is_finite() && args.report_interval > 0.0) {
        anyhow::bail!("--report-interval must be a positive number of seconds");
    }
    Ok(())
}

/// The initial, smallest and largest batch size: as given, else from the model's
/// measured sizes, widened so the initial size always lies within the bounds.
fn batch_sizes(args: &EmulateArgs) -> anyhow::Result<(u32, u32, u32)> {
    let measured_sizes = EmulatedJob::bundled(&args.model, 1)
        .with_context(|| {
            format!(
                "cannot emulate model {:?} (--model, or {} from `iadeep run --model`)",
                args.model,
                launch::MODEL
            )
        })?
        .measured_batch_sizes();
    let (smallest, largest) = match (measured_sizes.first(), measured_sizes.last()) {
        (Some(&s), Some(&l)) => (s, l),
        _ => anyhow::bail!("model {} has no measured step times", args.model),
    };
    let initial = args.initial_batch_size.unwrap_or(smallest);
    let min = args.min_batch_size.unwrap_or(smallest.min(initial));
    let max = args.max_batch_size.unwrap_or(largest.max(initial));
    Ok((initial, min, max))
}

/// Starts the embedded agent, registered as a real trainer of this model would be.
async fn start_agent(
    args: &EmulateArgs,
    initial: u32,
    min: u32,
    max: u32,
) -> anyhow::Result<Agent> {
    let mut builder = Agent::builder()
        .task_id(&args.task_id)
        .store_url(args.store.url())
        .model(&args.model)
        .initial_batch_size(initial)
        .batch_size_bounds(min..=max)
        .lr_rule(launch::lr_rule_from_name(&args.lr_rule).unwrap_or(LrScalingRule::Sqrt))
        .report_interval(Duration::from_secs_f64(args.report_interval))
        .lease_ttl(Duration::from_secs(args.lease_ttl));
    if let Some(device) = &args.device_id {
        builder = builder.device_id(device);
    }
    builder
        .connect_async()
        .await
        .context("cannot start the agent")
}

pub async fn run(args: EmulateArgs) -> anyhow::Result<ExitCode> {
    check_timings(&args)?;
    let (initial, min, max) = batch_sizes(&args)?;
    let job = EmulatedJob::bundled(&args.model, initial)?;
    let agent = start_agent(&args, initial, min, max).await?;
    tracing::info!(task = %args.task_id, model = job.name(), initial, min, max,
        "emulated job started; it reports no GPU memory, so unless `iadeep run \
         --gpu-mem-mib` said what it needs, the placer holds its whole card for it");

    let total = args.steps;
    let mut step = 0u64;
    let mut last_log = Instant::now();
    // Ctrl-C and SIGTERM are the agent's: it finishes the task and ends the process.
    while total.is_none_or(|t| step < t) {
        let bs = agent.batch_size();
        let step_time = job.step_time(bs).mul_f64(args.time_scale);
        let started = Instant::now();
        tokio::time::sleep(step_time).await;
        agent.record_step(bs, started.elapsed());
        let fraction = total.map_or(0.5, |t| step as f64 / t.max(1) as f64);
        if let Some((b, gb, big, gbig)) = job.gradient_norms(fraction, bs) {
            agent.record_gradient_norms(b, gb, big, gbig);
        }
        if let Some(change) = agent.poll_change() {
            if change.reason == ChangeReason::Evicted {
                // What a trainer does: checkpoint (nothing to save here), leave, exit.
                let reason = agent.evicted().unwrap_or_default();
                println!("step {step}: evicted ({reason}); leaving");
                tokio::task::spawn_blocking(move || agent.leave())
                    .await
                    .context("leaving the task")?
                    .context("leaving the task")?;
                return Ok(ExitCode::from(EVICTED_EXIT));
            }
            if change.batch_size == bs {
                // A new round at the same size (e.g. a new memory bound): one short line.
                println!(
                    "step {step}: batch size stays {bs} (round {})",
                    change.round
                );
            } else {
                println!(
                    "step {step}: batch size {bs} -> {} (lr x{:.3}, round {})",
                    change.batch_size, change.lr_factor, change.round
                );
            }
        }
        step += 1;
        if last_log.elapsed() >= Duration::from_secs(10) {
            tracing::info!(
                step,
                batch_size = agent.batch_size(),
                "emulated job running"
            );
            last_log = Instant::now();
        }
    }
    println!("{step} steps done; last batch size {}", agent.batch_size());
    agent.finish_async().await.context("finishing the task")?;
    Ok(ExitCode::SUCCESS)
}
