//! `iadeep sim` and `iadeep demo`: the trace-driven cluster simulator.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_datasets::philly;
use iadeep_sim::{Attribution, Experiment, ExperimentParams, RunMetrics, report, store_sink};
use iadeep_state::EmbeddedStore;

use crate::progress::Progress;

mod audit;

/// Simulate a GPU cluster on measured data and compare scheduling policies on the
/// same job stream.
///
/// Ground truth comes from measurements only: co-located throughputs from a
/// Gavel-format file, out-of-memory crashes from a memory model fitted to the pairs
/// Gavel marks as failed, statistical efficiency from Pollux's gradient statistics,
/// arrivals and durations from the Philly trace (single-GPU jobs). Policies see only
/// what agents report. Prints a table (or, with --json, one JSON object on the last
/// line) and writes CSV files and SVG plots to --out.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Gavel-format throughput file. Default: the bundled K80/P100 measurements.
    #[arg(long, value_name = "FILE")]
    gavel: Option<PathBuf>,
    /// Worker (GPU) type in the Gavel file, e.g. k80 or p100.
    #[arg(long, default_value = "k80", value_name = "T")]
    worker_type: String,
    /// GPU memory in MiB. Default: the known size of the worker type (k80 11441, p100 16280).
    #[arg(long, value_name = "MIB")]
    gpu_mem_mib: Option<u64>,
    /// How three or more jobs on one GPU slow each other (Gavel measured pairs only):
    /// `contention` adds the co-runners' measured stalls plus a context-switch overhead
    /// per extra co-runner; `product` multiplies the pairwise slowdowns (the rule
    /// iadeep's predictor composes with, so it favours iadeep).
    #[arg(long, default_value = "contention", value_name = "MODEL")]
    interference: iadeep_sim::Interference,
    /// How waiting jobs are offered to every policy alike: `each-task` (every waiting
    /// job asks in submission order and one told to wait blocks nobody: per-task
    /// backfill) or `fifo` (only the head of the queue; the jobs behind it wait too).
    #[arg(long, default_value = "each-task", value_name = "RULE")]
    admission: iadeep_sim::Admission,
    /// What every job brings to every policy alike: `none` (what a user gives `iadeep
    /// run`: model name, submitted batch size and allowed sizes; no solo profile and no
    /// memory figure, everything else learned from the agents' reports) or `profiled`
    /// (each job also brings its solo step time and peak memory at the submitted batch
    /// size, for comparison). The oracle reads the world in both.
    #[arg(long, default_value = "none", value_name = "INFO")]
    job_info: iadeep_sim::JobInfo,
    /// Number of jobs (consecutive single-GPU Philly jobs).
    #[arg(long, default_value_t = 300, value_name = "N")]
    tasks: usize,
    /// Number of GPUs.
    #[arg(long, default_value_t = 20, value_name = "G")]
    gpus: usize,
    /// Load factor: arrival gaps are divided by it (2 = twice as many arrivals per hour).
    #[arg(long, default_value_t = 1.0, value_name = "X")]
    load: f64,
    /// Seed of everything random (trace window, job types, measurement noise).
    #[arg(long, default_value_t = 1, value_name = "S")]
    seed: u64,
    /// Jobs longer than this many hours are capped to it.
    #[arg(long, default_value_t = 24.0, value_name = "H")]
    max_duration_h: f64,
    /// Share of production jobs: each job is production with this probability (seeded),
    /// opportunistic otherwise. 0.5 is TGS's job stream; the default 0 keeps every job
    /// opportunistic, as before classes existed. Every policy then reports each class
    /// apart (`classes` in --json).
    #[arg(long, default_value_t = 0.0, value_name = "F")]
    production_fraction: f64,
    /// The slowdown cap of every production job: the most PD it accepts (1.10 = at most
    /// 10 % slower than alone).
    #[arg(long, default_value_t = iadeep_proto::DEFAULT_MAX_SLOWDOWN, value_name = "X")]
    max_slowdown: f64,
    /// Seconds of running between two checkpoints of a job: an evicted job loses the
    /// progress since its last one.
    #[arg(long, default_value_t = 600.0, value_name = "S")]
    checkpoint_every: f64,
    /// Comma-separated policies to run (exclusive, priority, packing, util, memory, reference,
    /// reference-fixed, pollux, iadeep, iadeep-no-tuner, iadeep-no-predictor, oracle,
    /// oracle-prediction, oracle-memory, oracle-tuning, oracle-wait). Default: all of
    /// them. The `oracle-*` policies are iadeep with one learned part replaced by the
    /// truth; with iadeep and oracle, the output says how much of the gap between them
    /// each closes (`gap_closed` in --json). `oracle-wait` reads the waits of iadeep's run,
    /// made first when both are listed.
    #[arg(long, value_delimiter = ',', value_name = "NAMES")]
    policies: Vec<String>,
    /// Directory for the CSV files and plots.
    #[arg(long, default_value = "iadeep-sim-out", value_name = "DIR")]
    out: PathBuf,
    /// Print one JSON object with every policy's results as the last line of stdout.
    #[arg(long)]
    json: bool,
    /// Diagnose iadeep's placement: record every decision of the iadeep policies (the
    /// predicted slowdowns of the scored devices, the cold-start heuristic's for the
    /// same co-locations, the samples the predictor had, queue or place) next to the
    /// simulated world's true slowdowns and the real waits; writes
    /// audit-POLICY.jsonl to --out and prints a summary per policy on stderr.
    #[arg(long)]
    audit: bool,
}

/// Run the 300-job, 20-GPU demo on the bundled data and print the comparison.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Directory for the CSV files and plots.
    #[arg(long, default_value = "iadeep-demo", value_name = "DIR")]
    out: PathBuf,
    /// Worker (GPU) type of the bundled measurements: k80 or p100.
    #[arg(long, default_value = "k80", value_name = "T")]
    worker_type: String,
    /// Seed of everything random.
    #[arg(long, default_value_t = 1, value_name = "S")]
    seed: u64,
}

/// `iadeep sim`.
pub fn run_sim(args: SimArgs) -> anyhow::Result<ExitCode> {
    let gavel = match &args.gavel {
        Some(path) => GavelThroughputs::from_path(path)?,
        None => GavelThroughputs::bundled().context("bundled Gavel data")?,
    };
    let mut params = ExperimentParams {
        worker_type: args.worker_type.clone(),
        capacity_mib: args.gpu_mem_mib,
        interference: args.interference,
        ..ExperimentParams::default()
    };
    params.workload.tasks = args.tasks;
    params.workload.load = args.load;
    params.workload.seed = args.seed;
    params.workload.max_duration_s = args.max_duration_h * 3600.0;
    params.workload.production_fraction = args.production_fraction;
    params.workload.max_slowdown = args.max_slowdown;
    params.engine.checkpoint_every_s = args.checkpoint_every;
    params.engine.gpus = args.gpus;
    params.engine.seed = args.seed;
    params.engine.admission = args.admission;
    params.engine.job_info = args.job_info;
    if !args.policies.is_empty() {
        params.policies = args.policies.clone();
    }
    simulate(params, &gavel, &args.out, args.json, args.audit)?;
    Ok(ExitCode::SUCCESS)
}

/// `iadeep demo`.
pub async fn run_demo(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let gavel = GavelThroughputs::bundled().context("bundled Gavel data")?;
    let mut params = ExperimentParams {
        worker_type: args.worker_type,
        ..ExperimentParams::default()
    };
    params.workload.tasks = 300;
    params.workload.seed = args.seed;
    params.engine.gpus = 20;
    params.engine.seed = args.seed;
    outln!(
        "iadeep demo: 300 single-GPU jobs from the Philly trace on 20 simulated {} GPUs, \
         every policy on the same stream",
        params.worker_type
    )?;
    let (experiment, runs) = simulate(params, &gavel, &args.out, false, false)?;
    // The iadeep run, in the embedded store, as a live cluster would have it.
    if let Some(run) = runs.iter().find(|r| r.policy == "iadeep") {
        let path = args.out.join("state.redb");
        if path.exists() {
            std::fs::remove_file(&path)
                .with_context(|| format!("removing the previous {}", path.display()))?;
        }
        let store = EmbeddedStore::open(&path)
            .with_context(|| format!("opening the embedded store {}", path.display()))?;
        let keys = store_sink::record_run(&store, &experiment, run).await?;
        outln!(
            "The iadeep run's devices, specs, placements and final reports ({keys} keys) are in \
             the embedded store {p}; try: iadeep state ls --store {p} /iadeep/v1/devices/",
            p = path.display()
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The order to run `names` in (indices into it): as given, except that `iadeep` runs
/// before an `oracle-wait` listed ahead of it, whose queue rule reads iadeep's waits.
fn run_order(names: &[String]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..names.len()).collect();
    let at = |name: &str| names.iter().position(|n| n == name);
    if let (Some(iadeep), Some(wait)) = (at("iadeep"), at("oracle-wait"))
        && wait < iadeep
    {
        order.remove(iadeep);
        order.insert(wait, iadeep);
    }
    order
}

/// Runs every policy, prints the table (and JSON), writes CSV and plots.
fn simulate(
    params: ExperimentParams,
    gavel: &GavelThroughputs,
    out: &std::path::Path,
    json: bool,
    audit: bool,
) -> anyhow::Result<(Experiment, Vec<RunMetrics>)> {
    let trace = philly::bundled().context("bundled Philly trace")?;
    let names = params.policies.clone();
    let started = std::time::Instant::now();
    let experiment = Experiment::new(params, gavel, &trace)?;
    let mut runs: Vec<Option<RunMetrics>> = vec![None; names.len()];
    let iadeep_at = names.iter().position(|n| n == "iadeep");
    for index in run_order(&names) {
        let name = &names[index];
        // `oracle-wait` needs iadeep's run, made first ([`run_order`]) and not again.
        let iadeep_run = iadeep_at.and_then(|i| runs[i].as_ref());
        let mut policy = experiment.policy_after(name, iadeep_run)?;
        let mut shown = Progress::start(name);
        let mut progress = |done: usize, total: usize| shown.update(done, total);
        let run = if audit {
            let (run, records) = experiment
                .run_policy_audited(policy.as_mut(), &mut progress)
                .with_context(|| format!("simulating policy {name}"))?;
            if !records.is_empty() {
                audit::write(out, name, &records)?;
            }
            run
        } else {
            experiment
                .run_policy(policy.as_mut(), &mut progress)
                .with_context(|| format!("simulating policy {name}"))?
        };
        shown.finish();
        runs[index] = Some(run);
    }
    let runs: Vec<RunMetrics> = runs.into_iter().flatten().collect();
    let summaries: Vec<_> = runs.iter().map(RunMetrics::summary).collect();
    let files = report::write_all(out, &runs, &summaries)?;
    tracing::info!(
        policies = names.len(),
        wall_s = format!("{:.2}", started.elapsed().as_secs_f64()),
        "simulation finished"
    );
    crate::output::text(&report::table(&summaries))?;
    crate::output::text(&report::class_table(&summaries))?;
    outln!(
        "CT = completion time (submit to end); util = mean fraction of GPUs busy; work = mean \
         useful work per GPU (1 = one job alone at full speed); place/tune µs = mean decision time."
    )?;
    if summaries.iter().any(|s| s.classes.production.tasks > 0) {
        outln!(
            "above cap = share of running time with a job's true PD above its cap (opportunistic \
             jobs: above the production default {}); lost work = progress alone at m0 lost to \
             evictions since the last checkpoints.",
            iadeep_proto::DEFAULT_MAX_SLOWDOWN
        )?;
    }
    let attribution = Attribution::of(&summaries);
    if let Some(a) = &attribution {
        outln!("{}", a.text())?;
    }
    outln!("Results and plots written to {}:", out.display())?;
    for file in &files {
        outln!("  {}", file.display())?;
    }
    if json {
        let mut object = report::json(&summaries);
        if let Some(a) = &attribution {
            object["gap_closed"] = a.json();
        }
        outln!("{}", object)?;
    }
    Ok((experiment, runs))
}

#[cfg(test)]
mod tests {
    use super::run_order;

    #[test]
    fn iadeep_runs_before_an_oracle_wait_listed_ahead_of_it() {
        let names = |list: &[&str]| list.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        assert_eq!(
            run_order(&names(&["exclusive", "oracle-wait", "pollux", "iadeep"])),
            [0, 3, 1, 2]
        );
        assert_eq!(run_order(&names(&["iadeep", "oracle-wait"])), [0, 1]);
        assert_eq!(run_order(&names(&["oracle-wait", "pollux"])), [0, 1]);
    }
}
