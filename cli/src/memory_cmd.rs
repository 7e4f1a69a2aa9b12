//! `iadeep memory`: tools around the per-task GPU memory model.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use iadeep_eval::tuner::memory_eval::{self, EvalOptions};

#[derive(Debug, Args)]
pub struct MemoryArgs {
    #[command(subcommand)]
    command: MemoryCommand,
}

#[derive(Debug, Subcommand)]
enum MemoryCommand {
    /// Test how well the memory model extrapolates past the batch sizes it was fitted on.
    ///
    /// For each model in FILE: fit on the rows with batch_size ≤ N, predict the rows above
    /// N up to the horizon, and print for three predictors side by side the underestimate
    /// rate (predictions below 0.98 × measured: the dangerous error, an out-of-memory),
    /// the median absolute relative error and the 90th percentile of the overestimate.
    ///
    /// The predictors: iadeep's conservative model; the bound the tuner holds a task to
    /// that jumps straight to each size (the model's within a 1.5× step of the fitted
    /// sizes, the prior's wider one past it, as for a task whose allowed sizes are that
    /// coarse); a plain least-squares cubic.
    Eval {
        /// CSV with the header `model,batch_size,memory_mib` (peak memory in MiB).
        file: PathBuf,
        /// Largest batch size used for fitting.
        #[arg(long, value_name = "N")]
        fit_upto: u32,
        /// Predict rows up to R × a model's largest fitted size (2: one doubling, the jump of
        /// a task whose allowed sizes double; the tuner's own step is at most 1.5×).
        #[arg(long, value_name = "R", default_value_t = 2.0)]
        horizon: f64,
        /// Override the model's curvature safety factor (how many times faster than the
        /// task's own measured curvature the bound grows past the data).
        #[arg(long, value_name = "X")]
        curvature_safety: Option<f64>,
        /// Also print one JSON object on the last line of stdout.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(args: MemoryArgs) -> Result<ExitCode> {
    match args.command {
        MemoryCommand::Eval {
            file,
            fit_upto,
            horizon,
            curvature_safety,
            json,
        } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let rows =
                memory_eval::parse_csv(&text).with_context(|| format!("in {}", file.display()))?;
            tracing::info!(rows = rows.len(), fit_upto, file = %file.display(), "evaluating the memory model");
            let mut options = EvalOptions {
                horizon,
                ..EvalOptions::new(fit_upto)
            };
            if let Some(x) = curvature_safety {
                options.params.curvature_safety = x;
            }
            let report = memory_eval::evaluate(&rows, options)?;
            let (c, h) = (&report.cubic_baseline, &report.held);
            println!(
                "models evaluated: {} ({} predictions above batch size {fit_upto}, up to \
                 {horizon}x the largest fitted)",
                report.models, report.predictions
            );
            println!(
                "{:<28} {:>12} {:>12} {:>12}",
                "", "iadeep", "as held", "cubic"
            );
            let row = |what: &str, ours: f64, held: f64, cubic: f64| {
                println!(
                    "{what:<28} {:>11.1}% {:>11.1}% {:>11.1}%",
                    100.0 * ours,
                    100.0 * held,
                    100.0 * cubic
                );
            };
            row(
                "underestimate rate (<0.98x)",
                report.underestimate_rate,
                h.underestimate_rate,
                c.underestimate_rate,
            );
            row(
                "median |relative error|",
                report.median_abs_rel_err,
                h.median_abs_rel_err,
                c.median_abs_rel_err,
            );
            row("p90 overestimate", report.p90_over, h.p90_over, c.p90_over);
            println!(
                "(iadeep: the model's bound at every size; as held: what the tuner holds a task \
                 to that jumps straight there, the prior's bound past a {}x step)",
                options.params.max_step_past_measured
            );
            if report.refused > 0 {
                println!(
                    "refused (too far past the fitted sizes): {}",
                    report.refused
                );
            }
            if json {
                println!("{}", serde_json::to_string(&report)?);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
