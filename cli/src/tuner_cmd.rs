//! `iadeep tuner`: the per-GPU batch-size tuner's tools.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_tuner::gavel_bench::{self, BenchParams};

#[derive(Debug, Args)]
pub struct TunerArgs {
    #[command(subcommand)]
    command: TunerCommand,
}

#[derive(Debug, Subcommand)]
enum TunerCommand {
    /// Benchmark GP-LCB against random search on measured co-location throughputs.
    ///
    /// For every pair of job families with at least three measured batch sizes (a family
    /// with itself included) the true Σ PD surface is built from the measurements (m0 = the
    /// family's middle batch size, E = 1, failed pairs are out of memory), and both searches
    /// observe it with 1% noise. Prints the median and p90 number of rounds until a
    /// configuration within 2% of the exhaustive optimum was measured.
    Bench {
        /// Throughput file in Gavel's layout. Default: the K80/P100 file bundled with iadeep.
        #[arg(long, value_name = "FILE")]
        gavel: Option<PathBuf>,
        /// Worker (GPU) type in the file, e.g. k80 or p100.
        #[arg(long, value_name = "T")]
        worker_type: String,
        /// Seeds per problem.
        #[arg(long, default_value_t = 20)]
        seeds: u64,
        /// Also print one JSON object on the last line of stdout.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(args: TunerArgs) -> Result<ExitCode> {
    match args.command {
        TunerCommand::Bench {
            gavel,
            worker_type,
            seeds,
            json,
        } => {
            let data = match &gavel {
                Some(path) => GavelThroughputs::from_path(path)
                    .with_context(|| format!("cannot load {}", path.display()))?,
                None => {
                    GavelThroughputs::bundled().context("cannot load the bundled Gavel file")?
                }
            };
            let worker = data.worker(&worker_type)?;
            let problems = gavel_bench::pair_problems(worker);
            tracing::info!(
                worker_type,
                problems = problems.len(),
                seeds,
                "benchmarking GP-LCB against random search"
            );
            let params = BenchParams {
                seeds,
                ..BenchParams::default()
            };
            let report = gavel_bench::run(&problems, &params)?;
            println!(
                "worker type {worker_type}: {} pair problems × {} seeds",
                report.problems, report.seeds
            );
            println!(
                "{:<10} {:>14} {:>11} {:>12} {:>10}",
                "strategy", "median rounds", "p90 rounds", "mean rounds", "unreached"
            );
            for (name, s) in [("gp-lcb", &report.gp_lcb), ("random", &report.random)] {
                println!(
                    "{name:<10} {:>14} {:>11} {:>12.2} {:>10}",
                    s.median_rounds, s.p90_rounds, s.mean_rounds, s.unreached
                );
            }
            if json {
                println!("{}", serde_json::to_string(&report)?);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
