//! `iadeep tuner`: the per-GPU batch-size tuner daemon, and its tools (`tuner bench`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_tuner::daemon::{self, DaemonParams, DeviceFlags};
use iadeep_tuner::gavel_bench::{self, BenchParams};

use crate::StoreArgs;

/// Without a subcommand: run the tuner daemon of one GPU. It registers the device (from NVML
/// when a GPU is present, otherwise from --memory-mib and --kind), follows the tasks placed on
/// it, and tunes their batch sizes by GP-LCB over Σ PD measured from the agents' reports,
/// never assigning a configuration whose conservative memory exceeds the card minus the
/// margin (5 % + 256 MiB, the placer's). Its observations are persisted in the store, so a
/// restarted tuner resumes.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct TunerArgs {
    #[command(subcommand)]
    command: Option<TunerCommand>,
    #[command(flatten)]
    daemon: DaemonArgs,
}

/// Flags of the daemon.
#[derive(Debug, Args)]
struct DaemonArgs {
    /// Cluster-unique id of the GPU (letters, digits, '.', '_', '-', ':'), e.g. node3-gpu0.
    /// Required to run the daemon.
    #[arg(long, value_name = "ID")]
    device: Option<String>,
    #[command(flatten)]
    store: StoreArgs,
    /// Total GPU memory in MiB. Required when NVML finds no GPU; overrides NVML otherwise.
    #[arg(long, value_name = "M")]
    memory_mib: Option<u64>,
    /// NVML index of the GPU on this node.
    #[arg(long, default_value_t = 0, value_name = "N")]
    gpu_index: u32,
    /// Short device kind for the predictor (e.g. k80, p100, h100). Default: from the NVML
    /// name, or "unknown" without NVML.
    #[arg(long, value_name = "K")]
    kind: Option<String>,
    /// Node name recorded with the device.
    #[arg(long, value_name = "NAME")]
    node: Option<String>,
    /// Do not load NVML even if it is installed (the device is then described by flags).
    #[arg(long)]
    no_nvml: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Longest wait for every task's fresh reports in a round; a round without them is
    /// dropped and retried.
    #[arg(long, default_value_t = 30_000, value_name = "MS")]
    round_timeout_ms: u64,
    /// Fresh reports per task before a round counts: the first is dropped (it may mix the
    /// previous configuration), the median of the others is the measurement.
    #[arg(long, default_value_t = 4, value_name = "N")]
    reports_per_round: u32,
    /// Once settled, check the running configuration for drift every this many seconds.
    #[arg(long, default_value_t = 60.0, value_name = "S")]
    settled_interval_s: f64,
    /// Most observations of one search (the size of its Gaussian process); the search
    /// settles on its best measured configuration when it gets there.
    #[arg(long, default_value_t = 24, value_name = "N")]
    max_observations: usize,
    /// Stop searching after this many rounds without a 1% improvement.
    #[arg(long, default_value_t = 5, value_name = "N")]
    patience: usize,
    /// Do not switch a settled configuration for a predicted gain below this fraction.
    #[arg(long, default_value_t = 0.05, value_name = "F")]
    hysteresis: f64,
    /// Seed of the search's random sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl DaemonArgs {
    fn params(&self) -> Result<DaemonParams> {
        let mut p = DaemonParams::default();
        p.tuner.round_timeout = Duration::from_millis(self.round_timeout_ms);
        p.tuner.reports_per_round = self.reports_per_round;
        if !(self.settled_interval_s.is_finite() && self.settled_interval_s > 0.0) {
            bail!("--settled-interval-s must be a positive number of seconds");
        }
        p.tuner.settled_interval = Duration::from_secs_f64(self.settled_interval_s);
        p.tuner.max_observations = self.max_observations;
        p.tuner.controller.patience = self.patience;
        p.tuner.controller.hysteresis = self.hysteresis;
        p.tuner.seed = self.seed;
        p.check()?;
        Ok(p)
    }
}

async fn run_daemon(args: DaemonArgs) -> Result<ExitCode> {
    let Some(device_id) = args.device.clone() else {
        bail!(
            "`iadeep tuner` needs --device ID (or a subcommand such as `tuner bench`); see --help"
        );
    };
    let params = args.params()?;
    let flags = DeviceFlags {
        device_id,
        index: args.gpu_index,
        memory_mib: args.memory_mib,
        kind: args.kind.clone(),
        node: args.node.clone(),
        no_nvml: args.no_nvml,
    };
    let nvml = if flags.no_nvml {
        tracing::info!("--no-nvml: the device is described by flags");
        None
    } else {
        daemon::device::query_nvml(flags.index)?
    };
    let info = daemon::device::describe(&flags, nvml)?;
    let url = args.store.url();
    let store = url
        .open()
        .await
        .with_context(|| format!("cannot open the state store {url}"))?;
    tracing::info!(device = %info.device_id, memory_mib = info.memory_mib, kind = %info.kind,
        from_nvml = info.from_nvml, store = %store.describe(), "tuner starting");
    let tuner = daemon::Daemon::new(store, info.clone(), params)?;
    let server = match args.metrics {
        Some(addr) => Some(
            daemon::metrics::serve(addr, info.device_id.clone(), tuner.metrics())
                .await?
                .1,
        ),
        None => None,
    };
    let shutdown = async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            tracing::warn!(%err, "cannot listen for Ctrl-C; stop the tuner by killing it");
            std::future::pending::<()>().await;
        }
    };
    let result = tuner.run(shutdown).await;
    if let Some(server) = server {
        server.abort();
    }
    result?;
    Ok(ExitCode::SUCCESS)
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
        /// First seed: the runs use seeds FIRST..FIRST+SEEDS. The search's defaults were
        /// chosen with --first-seed 100 and 200 (--seeds 40); the figures to report use the
        /// default 0.
        #[arg(long, default_value_t = 0, value_name = "FIRST")]
        first_seed: u64,
        /// Also print one JSON object on the last line of stdout.
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(args: TunerArgs) -> Result<ExitCode> {
    let Some(command) = args.command else {
        return run_daemon(args.daemon).await;
    };
    match command {
        TunerCommand::Bench {
            gavel,
            worker_type,
            seeds,
            first_seed,
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
                first_seed,
                ..BenchParams::default()
            };
            let report = gavel_bench::run(&problems, &params)?;
            println!(
                "worker type {worker_type}: {} pair problems × {} seeds (from seed {})",
                report.problems, report.seeds, report.first_seed
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
