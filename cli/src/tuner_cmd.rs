//! `iadeep tuner`: the per-GPU batch-size tuner daemon, and its tools (`tuner bench`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_eval::tuner::gavel_bench::{self, BenchParams};
use iadeep_tuner::daemon::{self, DaemonParams, DeviceFlags};

use crate::StoreArgs;
use crate::tls_args::ServerTlsArgs;

/// Without a subcommand: run the tuner daemon of one GPU (--device ID), or of every GPU of
/// this node in one process (--all-gpus). It registers each device (from NVML when a GPU is
/// present, otherwise from --memory-mib and --kind), follows the tasks placed on it, and
/// tunes their batch sizes by GP-LCB over Σ PD measured from the agents' reports, never
/// assigning a configuration whose conservative memory exceeds the card minus the margin
/// (5 % + 256 MiB, the placer's). Its observations are persisted in the store, so a restarted tuner resumes.
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
    /// One of --device and --all-gpus is required to run the daemon.
    #[arg(long, value_name = "ID", conflicts_with = "all_gpus")]
    device: Option<String>,
    /// Tune every GPU of this node, one daemon per GPU in this process, with ids
    /// NODE-gpuINDEX. The GPUs are counted by NVML, or given by --gpus without it.
    #[arg(long, conflicts_with = "gpu_index")]
    all_gpus: bool,
    /// With --all-gpus and no NVML: how many GPUs the node has (each of --memory-mib).
    #[arg(long, value_name = "N", requires = "all_gpus")]
    gpus: Option<u32>,
    #[command(flatten)]
    store: StoreArgs,
    /// Total GPU memory in MiB. Required when NVML finds no GPU; overrides NVML otherwise.
    #[arg(long, value_name = "M")]
    memory_mib: Option<u64>,
    /// NVML index of the GPU on this node (with --device).
    #[arg(long, value_name = "N")]
    gpu_index: Option<u32>,
    /// Short device kind for the predictor (e.g. k80, p100, h100). Default: from the NVML
    /// name, or "unknown" without NVML.
    #[arg(long, value_name = "K")]
    kind: Option<String>,
    /// Node name recorded with each device; the placer's Kubernetes extender matches GPUs
    /// to nodes by it. Default: $NODE_NAME (set from the downward API in the DaemonSet),
    /// else this machine's host name.
    #[arg(long, value_name = "NAME", env = "NODE_NAME")]
    node: Option<String>,
    /// Do not load NVML even if it is installed (the device is then described by flags).
    #[arg(long)]
    no_nvml: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (every GPU of the process), with
    /// liveness at /healthz and readiness (the store answers) at /readyz, e.g.
    /// 127.0.0.1:9464; https:// with --tls-cert.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    #[command(flatten)]
    tls: ServerTlsArgs,
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
    /// Lease TTL of the device record and of this tuner's ownership of the device, in
    /// seconds: after a crash of this process or a lost store connection, the device stays
    /// registered this long before the placer stops placing on it and another tuner may
    /// take it over. Shorter fails over sooner; longer rides out longer store outages
    /// (an etcd leader election takes a few seconds). At least 1.
    #[arg(long, default_value_t = DaemonParams::default().lease_ttl.as_secs(), value_name = "S")]
    lease_ttl: u64,
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
        if self.lease_ttl == 0 {
            bail!("--lease-ttl must be at least 1 second");
        }
        p.lease_ttl = Duration::from_secs(self.lease_ttl);
        p.check()?;
        Ok(p)
    }
}

/// The node name: the flag or $NODE_NAME, else the host name.
fn node_name(flag: Option<&str>) -> Result<String> {
    if let Some(node) = flag.filter(|n| !n.is_empty()) {
        return Ok(node.to_owned());
    }
    gethostname::gethostname()
        .into_string()
        .ok()
        .filter(|n| !n.is_empty())
        .context("cannot read this machine's host name; give --node NAME")
}

/// How many GPUs NVML sees; `None` when NVML cannot be loaded (no driver).
fn nvml_gpu_count() -> Result<Option<u32>> {
    match nvml_wrapper::Nvml::init() {
        Ok(nvml) => Ok(Some(
            nvml.device_count()
                .context("NVML is loaded but cannot count the GPUs")?,
        )),
        Err(err) => {
            tracing::info!(%err, "NVML not available (no NVIDIA driver?)");
            Ok(None)
        }
    }
}

/// A device to tune: its flags and what NVML said about it.
type DeviceParts = (DeviceFlags, Option<daemon::device::NvmlDevice>);

/// The devices this process tunes.
fn devices(args: &DaemonArgs, node: &str) -> Result<Vec<DeviceParts>> {
    let flags = |device_id: String, index: u32| DeviceFlags {
        device_id,
        index,
        memory_mib: args.memory_mib,
        kind: args.kind.clone(),
        node: Some(node.to_owned()),
        no_nvml: args.no_nvml,
    };
    let nvml = |index: u32| -> Result<Option<daemon::device::NvmlDevice>> {
        if args.no_nvml {
            Ok(None)
        } else {
            Ok(daemon::device::query_nvml(index)?)
        }
    };
    if !args.all_gpus {
        let Some(device_id) = args.device.clone() else {
            bail!(
                "`iadeep tuner` needs --device ID or --all-gpus (or a subcommand such as \
                 `tuner bench`); see --help"
            );
        };
        let index = args.gpu_index.unwrap_or(0);
        return Ok(vec![(flags(device_id, index), nvml(index)?)]);
    }
    let count = match (args.gpus, args.no_nvml) {
        (Some(n), _) => n,
        (None, true) => bail!("--all-gpus with --no-nvml needs --gpus N"),
        (None, false) => nvml_gpu_count()?.context(
            "--all-gpus found no NVML to count the GPUs with; give --gpus N and --memory-mib",
        )?,
    };
    if count == 0 {
        bail!("--all-gpus: this node has no GPU");
    }
    (0..count)
        .map(|index| Ok((flags(format!("{node}-gpu{index}"), index), nvml(index)?)))
        .collect()
}

async fn run_daemon(args: DaemonArgs) -> Result<ExitCode> {
    let params = args.params()?;
    // The tuner's only listener is the operators' endpoint: TLS, no client certificates.
    let tls = args.tls.load(None)?;
    if tls.is_some() && args.metrics.is_none() {
        bail!("--tls-cert is for the metrics endpoint: give --metrics ADDR too");
    }
    if args.no_nvml {
        tracing::info!("--no-nvml: the devices are described by flags");
    }
    let node = node_name(args.node.as_deref())?;
    let mut infos = Vec::new();
    for (flags, nvml) in devices(&args, &node)? {
        infos.push(daemon::device::describe(&flags, nvml)?);
    }
    let store = crate::open_store(&args.store.url()).await?;
    crate::warn_of_etcd_bugs(&args.store.url()).await;
    let mut tuners = Vec::new();
    for info in &infos {
        tracing::info!(device = %info.device_id, node = %info.node, memory_mib = info.memory_mib,
            kind = %info.kind, from_nvml = info.from_nvml, store = %store.describe(), "tuner starting");
        tuners.push(daemon::Daemon::new(store.clone(), info.clone(), params)?);
    }
    let server = match args.metrics {
        Some(addr) => {
            let devices = infos
                .iter()
                .zip(&tuners)
                .map(|(info, tuner)| (info.device_id.clone(), tuner.metrics()))
                .collect();
            let ready = iadeep_ops::store_ready(store.clone());
            Some(
                daemon::metrics::serve_all(addr, devices, ready, tls)
                    .await?
                    .1,
            )
        }
        None => None,
    };
    // One signal stops every daemon of the process.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let runs = tuners.into_iter().map(|tuner| {
        let mut stopped = stopped.clone();
        tuner.run(async move {
            // An error means the sender is gone: stop as well.
            let _ = stopped.wait_for(|s| *s).await;
        })
    });
    let all = futures::future::try_join_all(runs);
    tokio::pin!(all);
    let result = tokio::select! {
        result = &mut all => result.map(|_| ()),
        () = crate::signals::shutdown() => {
            tracing::info!("shutting down");
            let _ = stop.send(true);
            all.await.map(|_| ())
        }
    };
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        daemon: DaemonArgs,
    }

    fn params(args: &[&str]) -> Result<DaemonParams> {
        let cli = Cli::try_parse_from(std::iter::once("tuner").chain(args.iter().copied()))?;
        cli.daemon.params()
    }

    #[test]
    fn lease_ttl_reaches_the_daemon_and_zero_is_refused() {
        let default = params(&[]).expect("defaults are valid");
        assert_eq!(default.lease_ttl, DaemonParams::default().lease_ttl);
        let short = params(&["--lease-ttl", "3"]).expect("3 s is valid");
        assert_eq!(short.lease_ttl, Duration::from_secs(3));
        let err = params(&["--lease-ttl", "0"]).expect_err("0 s is refused");
        assert!(err.to_string().contains("--lease-ttl"), "{err}");
    }
}
