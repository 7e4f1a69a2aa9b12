//! `iadeep placer`: the placement daemon, and a load generator for it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use iadeep_eval::SyntheticCluster;
use iadeep_placer::extender::PriorityRule;
use iadeep_placer::extender::kube_api::KubeApiConfig;
use iadeep_placer::extender::{DEFAULT_BIND_TIMEOUT, ExtenderConfig};
use iadeep_placer::{Daemon, DaemonConfig, ModelledMemory, Placer, PlacerParams};
use iadeep_predictor::{LearnerParams, OnlinePredictor};
use iadeep_proto::placer_client::PlacerClient;
use iadeep_proto::{ListDevicesRequest, PlaceRequest, ReleaseRequest, place_response};
use iadeep_state::{StoreUrl, keys};

use crate::StoreArgs;
use crate::tls_args::ServerTlsArgs;

/// Run the placement service: it decides where each new training task goes
/// (the GPU where it adds the least predicted degradation, or "queue" when
/// waiting is cheaper), reserves the GPU in the state store, and answers over
/// gRPC and as a Kubernetes scheduler extender.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct PlacerArgs {
    #[command(flatten)]
    store: StoreArgs,
    #[command(subcommand)]
    command: Option<PlacerCommand>,
    #[command(flatten)]
    daemon: DaemonArgs,
}

impl PlacerArgs {
    /// Whether this runs the load test (`bench-client`) rather than the daemon.
    pub fn is_benchmark(&self) -> bool {
        matches!(self.command, Some(PlacerCommand::BenchClient(_)))
    }
}

#[derive(Debug, Subcommand)]
enum PlacerCommand {
    /// Measure Place latency and throughput over loopback gRPC on a synthetic cluster.
    ///
    /// Seeds DEVICES GPUs and RESIDENTS running tasks into the store, then sends
    /// REQUESTS Place calls from CONCURRENCY clients; every placed task is released
    /// right away so the cluster keeps its size. Without --grpc it starts a placer
    /// in-process (same code as the daemon) on a free loopback port.
    BenchClient(BenchArgs),
}

#[derive(Debug, Args)]
struct DaemonArgs {
    /// gRPC listen address (with grpc.health.v1 and server reflection).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:50061")]
    grpc: SocketAddr,
    /// Kubernetes scheduler-extender listen address (filter, prioritize, bind); off when absent.
    #[arg(long, value_name = "ADDR")]
    extender: Option<SocketAddr>,
    /// Operators' HTTP address: Prometheus metrics (GET /metrics), liveness (GET /healthz)
    /// and readiness (GET /readyz: the state store answers); off when absent.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// How the extender's bind verb reaches the Kubernetes API to create pod Bindings:
    /// `auto` (a kubeconfig from $KUBECONFIG or ~/.kube/config, else the in-cluster
    /// service account, over TLS), or the URL of an API server used without credentials,
    /// e.g. http://127.0.0.1:8001 of a `kubectl proxy`. Without it, bind refuses.
    #[arg(long, value_name = "auto|URL")]
    kube_api: Option<KubeApiConfig>,
    /// Longest a bind may take, Kubernetes API calls included. Keep it below the
    /// extender's `httpTimeout` in the scheduler configuration (5 s in deploy/).
    #[arg(long, value_name = "MS", default_value_t = DEFAULT_BIND_TIMEOUT.as_millis() as u64)]
    bind_timeout_ms: u64,
    /// Kubernetes PriorityClass names whose pods the extender treats as production
    /// (slowdown cap 1.10 unless the pod's `iadeep.io/max-slowdown` says otherwise),
    /// comma-separated. A pod's `iadeep.io/priority-class` annotation overrides this;
    /// every other pod is opportunistic.
    #[arg(
        long,
        value_name = "NAME,...",
        value_delimiter = ',',
        requires = "extender"
    )]
    production_priority_classes: Vec<String>,
    /// How long a pod the extender bound may keep running after the placer told its task
    /// to leave (a room eviction, or a production job above its slowdown cap) before the
    /// placer evicts the pod through the Kubernetes API (a policy/v1 Eviction, which
    /// PodDisruptionBudgets may hold back; needs --kube-api and RBAC `create` on
    /// `pods/eviction`), counted from when this placer first saw the order. Why: a
    /// training loop that swallows `iadeep.Evicted`, hangs checkpointing or has no agent
    /// would keep its pod on the GPU after the placer gave the GPU's memory to another
    /// job, which it does --dead-task-grace-s after the job's agent gave up its lease.
    /// Kubelet then gives the pod its terminationGracePeriodSeconds (30 s by default),
    /// and this plus 30 s must stay under --dead-task-grace-s: the placer refuses to
    /// start otherwise. A duration such as `20s`; `0s` evicts at once.
    #[arg(long, value_name = "DURATION", default_value = "20s",
        value_parser = parse_pod_evict_grace)]
    pod_evict_grace: Duration,
    #[command(flatten)]
    tls: ServerTlsArgs,
    /// Verify clients of the gRPC API and the extender: each must present a
    /// certificate signed by a CA in this PEM file (kube-scheduler does with the
    /// extender's `tlsConfig.certFile`/`keyFile`). /metrics, /healthz and /readyz stay
    /// TLS without client certificates, so kubelet's HTTPS probes reach them.
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    #[command(flatten)]
    graces: GraceArgs,
    #[command(flatten)]
    policy: PolicyArgs,
}

/// When the placer gives back the reservation of a task that did not release it
/// (shared by `iadeep placer` and `iadeep up`).
#[derive(Debug, Clone, Args)]
pub(crate) struct GraceArgs {
    /// Seconds a task's agent may be gone (its `alive` key deleted when its lease
    /// expired, without a Release) before the placer gives its GPU reservation back;
    /// long enough for a restarted agent to come back and keep its GPU. A task that
    /// reported finishing is released as soon as its agent is gone. The same grace
    /// archives what a job that ran without a placement left in the store (so the
    /// task retention deletes it). 0 never releases nor archives.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_DEAD_TASK_GRACE_S)]
    dead_task_grace_s: u64,
    /// Seconds after its placement a task whose agent never started (no `alive` key
    /// and no report ever seen: the job was never launched, its pod never ran) keeps
    /// its GPU reservation before the placer gives it back. Must cover the slowest
    /// legitimate start (image pull, data staging). 0 never releases.
    #[arg(long, value_name = "SECONDS", default_value_t = DEFAULT_UNSTARTED_TASK_GRACE_S)]
    unstarted_task_grace_s: u64,
    /// How long a released task's keys (its spec, last report and batch-size
    /// assignment) stay in the state store after its Release, so `iadeep state get`
    /// still shows a finished job; then the placer deletes them, at most 1000 tasks per
    /// sweep. A duration such as `1d`, `12h`, `30m` or `0s`, or `never` to keep them
    /// forever (the store then grows with every job run). A task whose agent still
    /// runs is never deleted.
    #[arg(long, value_name = "DURATION|never", default_value = "1d", value_parser = parse_retention)]
    task_retention: Retention,
    /// How often the placer compacts the state store's history, keeping what was
    /// written since the previous compaction but at most `--compact-keep-revisions`
    /// revisions, so an etcd does not grow with every write ever made (compaction frees space inside etcd's file; `etcdctl defrag` gives it
    /// back to the disk). `never` leaves it to etcd's own `--auto-compaction-*`. The
    /// embedded store bounds its history itself.
    #[arg(long, value_name = "DURATION|never", default_value = "5m", value_parser = parse_retention)]
    compact_every: Retention,
    /// Most revisions of history a compaction keeps: how far a watching tuner or placer
    /// may fall behind (at most) before it must read its keys afresh.
    #[arg(long, value_name = "N",
        default_value_t = iadeep_placer::compaction::DEFAULT_COMPACT_KEEP_REVISIONS,
        value_parser = clap::value_parser!(i64).range(1..))]
    compact_keep_revisions: i64,
}

/// A retention as typed: a duration, or none at all.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Retention(Option<Duration>);

/// Parses `--pod-evict-grace`: a duration as `humantime` reads it.
fn parse_pod_evict_grace(text: &str) -> std::result::Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|err| format!("{err}: give a duration such as 20s or 1m"))
}

/// Parses `--task-retention`: `never`, or a duration as `humantime` reads it.
fn parse_retention(text: &str) -> std::result::Result<Retention, String> {
    if text.trim().eq_ignore_ascii_case("never") {
        return Ok(Retention(None));
    }
    humantime::parse_duration(text.trim())
        .map(|d| Retention(Some(d)))
        .map_err(|err| format!("{err}: give a duration such as 1d, 12h or 30m, or `never`"))
}

impl GraceArgs {
    /// The reaper's graces as the daemon takes them (`None`: never release).
    pub(crate) fn durations(&self) -> (Option<Duration>, Option<Duration>) {
        let seconds = |s: u64| (s > 0).then(|| Duration::from_secs(s));
        (
            seconds(self.dead_task_grace_s),
            seconds(self.unstarted_task_grace_s),
        )
    }

    /// `params` with the store's upkeep as given: the retention of released tasks'
    /// keys (`None`: forever) and the compaction of the store's history.
    pub(crate) fn upkeep(&self, params: PlacerParams) -> PlacerParams {
        PlacerParams {
            task_retention: self.task_retention.0,
            compact_every: self.compact_every.0.filter(|every| !every.is_zero()),
            compact_keep_revisions: self.compact_keep_revisions,
            ..params
        }
    }
}

/// Default of `--dead-task-grace-s`: a minute covers an agent's restart after a crash.
pub(crate) const DEFAULT_DEAD_TASK_GRACE_S: u64 = 60;
/// Default of `--unstarted-task-grace-s`: ten minutes cover a slow image pull.
const DEFAULT_UNSTARTED_TASK_GRACE_S: u64 = 600;
/// [`DEFAULT_UNSTARTED_TASK_GRACE_S`] as a duration, for messages that name it.
pub(crate) const DEFAULT_UNSTARTED_TASK_GRACE: Duration =
    Duration::from_secs(DEFAULT_UNSTARTED_TASK_GRACE_S);

/// Policy knobs (see `iadeep_placer::PlacerParams` for what each means). The memory
/// margin is not one of them: it is defined once (5 % of each GPU plus 256 MiB) so that
/// the placer, the tuners and the agents never disagree about what fits.
#[derive(Debug, Clone, Args)]
pub(crate) struct PolicyArgs {
    /// Cap on the sum of the solo SM utilisations of a GPU's tasks, percent.
    #[arg(long, default_value_t = PlacerParams::default().sm_util_cap_pct)]
    sm_util_cap_pct: f64,
    /// Cap on the sum of the solo memory-bandwidth utilisations, percent.
    #[arg(long, default_value_t = PlacerParams::default().mem_bw_util_cap_pct)]
    mem_bw_util_cap_pct: f64,
    /// A GPU whose summed PD would grow by more than this is not a candidate (≥ 1).
    #[arg(long, default_value_t = PlacerParams::default().max_pd_increase)]
    max_pd_increase: f64,
    /// A shared GPU is a candidate only if the task joining raises its predicted
    /// combined normalised throughput (Σ 1/slowdown) by at least this, in [0, 1].
    #[arg(long, default_value_t = PlacerParams::default().min_throughput_gain)]
    min_throughput_gain: f64,
    /// Seconds of degraded progress one second of waiting is worth (queue-or-place).
    #[arg(long, default_value_t = PlacerParams::default().wait_cost_factor)]
    wait_cost_factor: f64,
    /// Most shared GPUs a decision asks the slowdown predictor about, least loaded
    /// first (bounds decision time on large clusters); 0 scores every feasible GPU.
    #[arg(long, default_value_t = PlacerParams::default().max_scored_devices)]
    max_scored_devices: usize,
    /// After a production job's slowdown cap breach evicted an opportunistic job, how
    /// long the placer keeps the two apart (the evicted job, re-queued, is not placed on
    /// the production job's GPU, nor the other way round). A duration such as `30m` or
    /// `2h`.
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = parse_positive_duration)]
    avoid_pairing_for: Duration,
    /// How long a production job that fits on no GPU under its slowdown cap waits,
    /// counted from its submission, before it may evict opportunistic jobs to make room.
    /// `0s` evicts at once: production jobs finish sooner, opportunistic jobs lose more
    /// work (docs/simulator-experiments.md, "Waiting instead of evicting").
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = parse_duration)]
    room_eviction_patience: Duration,
    /// How long a GPU that a job waiting ahead would be placed on is kept for it while
    /// that job does not ask again: a job submitted later is told to queue meanwhile
    /// (for at most this long in a row), so among the queued jobs that would be placed
    /// now, the one submitted first goes first, not the one whose request arrives
    /// first. `0s` serves requests as they come.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    waiter_hold: Duration,
    /// For that hold, the most jobs waiting ahead whose own placement a decision works
    /// out (the first that could use the GPU, in submission order); each is a decision
    /// over the whole cluster, so this bounds a decision's cost on a long queue. A job
    /// waiting behind that many others that could use the GPU holds nothing. 0: all.
    #[arg(long, default_value_t = PlacerParams::default().max_waiters_checked)]
    max_waiters_checked: usize,
}

/// Parses a duration, zero included, as `humantime` reads it (`0s`, `30m`, `2h`).
fn parse_duration(text: &str) -> std::result::Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|err| format!("{err}: give a duration such as 0s, 30m or 2h"))
}

/// Parses a positive duration as `humantime` reads it (`30m`, `2h`, `90s`).
fn parse_positive_duration(text: &str) -> std::result::Result<Duration, String> {
    match humantime::parse_duration(text.trim()) {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err("must be positive".to_owned()),
        Err(err) => Err(format!("{err}: give a duration such as 30m, 2h or 90s")),
    }
}

impl PolicyArgs {
    /// The policy, with the store's upkeep (retention, compaction) of `graces`.
    pub(crate) fn placer(&self, graces: &GraceArgs) -> Result<Placer> {
        self.placer_over(graces.upkeep(PlacerParams::default()))
    }

    /// The policy with these flags over `base`, with a fresh slowdown predictor.
    fn placer_over(&self, base: PlacerParams) -> Result<Placer> {
        let predictor = OnlinePredictor::new(LearnerParams::default())
            .context("cannot start the slowdown predictor")?;
        self.placer_with(Arc::new(predictor), base)
    }

    /// The policy with these flags over `base` (which gives everything they do not set).
    fn placer_with(&self, predictor: Arc<OnlinePredictor>, base: PlacerParams) -> Result<Placer> {
        let params = PlacerParams {
            sm_util_cap_pct: self.sm_util_cap_pct,
            mem_bw_util_cap_pct: self.mem_bw_util_cap_pct,
            max_pd_increase: self.max_pd_increase,
            min_throughput_gain: self.min_throughput_gain,
            wait_cost_factor: self.wait_cost_factor,
            max_scored_devices: self.max_scored_devices,
            avoid_pairing_for: self.avoid_pairing_for,
            room_eviction_patience: self.room_eviction_patience,
            waiter_hold: self.waiter_hold,
            max_waiters_checked: self.max_waiters_checked,
            ..base
        };
        Ok(Placer::new(params, predictor)?)
    }
}

#[derive(Debug, Args)]
struct BenchArgs {
    /// Drive the placer already listening here instead of starting one in-process
    /// (it must use the same --store, which this command seeds).
    #[arg(long, value_name = "ADDR")]
    grpc: Option<SocketAddr>,
    /// GPUs in the synthetic cluster.
    #[arg(long, default_value_t = 1000)]
    devices: usize,
    /// Resident tasks in the synthetic cluster.
    #[arg(long, default_value_t = 2000)]
    residents: usize,
    /// Place calls to send.
    #[arg(long, default_value_t = 20_000)]
    requests: u64,
    /// Clients sending concurrently.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Seed of the synthetic cluster and arrivals.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Also seed the co-location samples converted from the bundled Gavel measurements
    /// of this worker type (k80 or p100), so the placer's predictor fits its forest
    /// from the store as in production, and wait until it has.
    #[arg(long, value_name = "WORKER")]
    gavel_samples: Option<String>,
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    policy: PolicyArgs,
}

pub async fn run(args: PlacerArgs) -> Result<ExitCode> {
    match args.command {
        Some(PlacerCommand::BenchClient(bench)) => {
            // The benchmark defaults to a throw-away store, never the operator's state.
            let url = args.store.store.clone().unwrap_or(StoreUrl::Memory);
            bench_client(url, bench).await
        }
        None => daemon(args.store.url(), args.daemon).await,
    }
}

async fn daemon(url: StoreUrl, args: DaemonArgs) -> Result<ExitCode> {
    let placer = args.policy.placer_over(PlacerParams {
        pod_evict_grace: args.pod_evict_grace,
        ..args.graces.upkeep(PlacerParams::default())
    })?;
    let (dead_task_grace, unstarted_task_grace) = args.graces.durations();
    if args.kube_api.is_some() {
        // Only then does the placer evict pods (see --pod-evict-grace). `Daemon::start`
        // checks it too; here it fails before the store is opened, naming the flags.
        iadeep_placer::pod_eviction::check_grace(args.pod_evict_grace, dead_task_grace)
            .context("--pod-evict-grace with --dead-task-grace-s")?;
    }
    let tls = args.tls.load(args.tls_client_ca.as_deref())?;
    let store = crate::open_store(&url).await?;
    crate::warn_of_etcd_bugs(&url).await;
    if args.kube_api.is_some() && args.extender.is_none() {
        bail!("--kube-api is for the extender's bind verb: give --extender ADDR too");
    }
    if args.bind_timeout_ms == 0 {
        bail!("--bind-timeout-ms must be positive");
    }
    let config = DaemonConfig {
        grpc: args.grpc,
        extender: args.extender.map(|listen| ExtenderConfig {
            listen,
            kube_api: args.kube_api.clone(),
            bind_timeout: Duration::from_millis(args.bind_timeout_ms),
            priority_rule: PriorityRule::new(
                args.production_priority_classes
                    .iter()
                    .map(|name| name.trim())
                    .filter(|name| !name.is_empty()),
            ),
        }),
        metrics: args.metrics,
        dead_task_grace,
        unstarted_task_grace,
        tls,
    };
    let mut daemon = Daemon::start(store, placer, Arc::new(ModelledMemory), config)
        .await
        .context("cannot start the placer")?;
    tokio::select! {
        _ = crate::signals::shutdown() => {
            tracing::info!("shutting down");
            daemon.shutdown().await;
            Ok(ExitCode::SUCCESS)
        }
        err = daemon.failed() => Err(err).context("the placer stopped"),
    }
}

/// Latency percentile (nearest rank, [`iadeep_objective::stats::quantile`]) of the
/// samples, in milliseconds; 0 when there are none.
fn percentile_ms(samples: &[Duration], p: f64) -> f64 {
    let ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    iadeep_objective::stats::quantile(&ms, p / 100.0).unwrap_or(0.0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Writes the bundled Gavel measurements of `worker` into the store as co-location
/// samples of a device `gavel-WORKER`; returns how many.
async fn seed_gavel_samples(store: &dyn iadeep_state::StateStore, worker: &str) -> Result<usize> {
    let gavel = iadeep_datasets::gavel::GavelThroughputs::bundled()
        .context("cannot read the bundled Gavel measurements")?;
    let measurements = gavel
        .worker(worker)
        .with_context(|| format!("no Gavel measurements for worker type {worker:?}"))?;
    let samples = iadeep_eval::samples_from_gavel(measurements, worker).samples;
    for (seq, sample) in samples.iter().enumerate() {
        let device = format!("gavel-{worker}");
        iadeep_state::typed::put(
            store,
            &iadeep_state::keys::sample(&device, seq as u64),
            sample,
            None,
        )
        .await
        .context("cannot seed the Gavel samples")?;
    }
    tracing::info!(
        samples = samples.len(),
        worker,
        "seeded co-location samples"
    );
    Ok(samples.len())
}

/// Starts a placer daemon in this process on a loopback port, with the daemon's
/// default graces and a cold slowdown predictor; returns it and its predictor.
async fn start_local_placer(
    store: Arc<dyn iadeep_state::StateStore>,
    args: &BenchArgs,
) -> Result<(Daemon, Arc<OnlinePredictor>)> {
    let predictor = Arc::new(
        OnlinePredictor::new(LearnerParams::default())
            .context("cannot start the slowdown predictor")?,
    );
    let forest = predictor.clone();
    let config = DaemonConfig {
        grpc: SocketAddr::from(([127, 0, 0, 1], 0)),
        extender: None,
        metrics: None,
        // As the daemon runs by default.
        dead_task_grace: Some(Duration::from_secs(DEFAULT_DEAD_TASK_GRACE_S)),
        unstarted_task_grace: Some(DEFAULT_UNSTARTED_TASK_GRACE),
        tls: None,
    };
    let placer = args
        .policy
        .placer_with(predictor, PlacerParams::default())?;
    let daemon = Daemon::start(store, placer, Arc::new(ModelledMemory), config)
        .await
        .context("cannot start the in-process placer")?;
    Ok((daemon, forest))
}

/// Waits (up to 60 s) until the placer at `endpoint` sees at least `devices` devices
/// and `residents` residents: the seeded cluster.
async fn wait_for_cluster(endpoint: &str, devices: usize, residents: usize) -> Result<()> {
    let mut probe = PlacerClient::connect(endpoint.to_owned())
        .await
        .with_context(|| format!("cannot connect to the placer at {endpoint}"))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = probe
            .list_devices(ListDevicesRequest {})
            .await
            .context("ListDevices failed")?
            .into_inner()
            .devices;
        let seen: usize = listed.iter().map(|d| d.resident_task_ids.len()).sum();
        if listed.len() >= devices && seen >= residents {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the placer sees {} devices and {seen} residents, not the seeded cluster",
                listed.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits (up to 120 s) until the in-process placer's predictor has fitted on the
/// seeded samples, which the daemon learns through its watch.
async fn wait_for_fit(predictor: &iadeep_predictor::OnlinePredictor) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while predictor.model_samples() == 0 {
        if Instant::now() > deadline {
            bail!("the placer's predictor did not fit on the seeded samples in 120 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tracing::info!(
        model_samples = predictor.model_samples(),
        "predictor fitted"
    );
    Ok(())
}

/// What the benchmark's clients measured, over all of them.
#[derive(Default)]
struct Latencies {
    /// Each call from its first sending to its answer: the pauses before re-sending a
    /// call answered UNAVAILABLE are part of what a client waits, so they count.
    place: Vec<Duration>,
    release: Vec<Duration>,
    placed: u64,
    queued: u64,
    /// Calls answered UNAVAILABLE and sent again (see [`BENCH_UNAVAILABLE_RETRIES`]).
    unavailable: u64,
}

/// How often one call answered UNAVAILABLE is sent again before the benchmark fails.
///
/// Why retry at all: UNAVAILABLE is the placer's "ask again" (a store that did not
/// answer in time, placements that kept racing), and every real client does; Place and
/// Release are idempotent per task id, so a re-sent call is answered as the first would
/// have been. A long soak on a loaded machine meets a few; failing the whole run on the
/// first one measured the machine's worst second, not the placer. Bounded, so a store
/// that is down still ends the run.
const BENCH_UNAVAILABLE_RETRIES: u32 = 20;

/// The pause before a call answered UNAVAILABLE is sent again: the placer's
/// `grpc-retry-pushback-ms` when it gives one, else 100 ms.
fn retry_pause(status: &tonic::Status) -> Duration {
    iadeep_placer::retry_pushback(status)
        .unwrap_or(Duration::from_millis(100))
        .min(Duration::from_secs(5))
}

/// Sends `call` until it is answered with anything but UNAVAILABLE, at most
/// [`BENCH_UNAVAILABLE_RETRIES`] times more, counting the retries in `retries`.
async fn until_available<T, F, Fut>(
    retries: &mut u64,
    mut call: F,
) -> std::result::Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, tonic::Status>>,
{
    let mut left = BENCH_UNAVAILABLE_RETRIES;
    loop {
        match call().await {
            Err(status) if status.code() == tonic::Code::Unavailable && left > 0 => {
                left -= 1;
                *retries += 1;
                tracing::debug!(%status, "answered UNAVAILABLE; sending the call again");
                tokio::time::sleep(retry_pause(&status)).await;
            }
            other => return other,
        }
    }
}

/// Runs `concurrency` clients, each on its own connection, that together send
/// `requests` Place calls for the cluster's arrivals, releasing each placed task.
async fn run_clients(
    endpoint: &str,
    cluster: &Arc<SyntheticCluster>,
    concurrency: usize,
    requests: u64,
) -> Result<Latencies> {
    let next = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let client = PlacerClient::connect(endpoint.to_owned())
            .await
            .with_context(|| format!("cannot connect to the placer at {endpoint}"))?;
        workers.push(tokio::spawn(client_loop(
            client,
            next.clone(),
            cluster.clone(),
            requests,
        )));
    }
    let mut all = Latencies::default();
    for worker in workers {
        let one = worker
            .await
            .context("a benchmark client panicked")?
            .context("a Place or Release call failed")?;
        all.place.extend(one.place);
        all.release.extend(one.release);
        all.placed += one.placed;
        all.queued += one.queued;
        all.unavailable += one.unavailable;
    }
    Ok(all)
}

/// One benchmark client: takes the next arrival until `requests` are taken.
async fn client_loop(
    client: PlacerClient<tonic::transport::Channel>,
    next: Arc<AtomicU64>,
    cluster: Arc<SyntheticCluster>,
    requests: u64,
) -> std::result::Result<Latencies, tonic::Status> {
    let mut out = Latencies::default();
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= requests {
            break;
        }
        let task = cluster.arrival(i);
        let task_id = task.task_id.clone();
        let t0 = Instant::now();
        let request = PlaceRequest {
            task: Some(task),
            candidate_device_ids: Vec::new(),
        };
        let response = until_available(&mut out.unavailable, || {
            let mut client = client.clone();
            let request = request.clone();
            async move { client.place(request).await }
        })
        .await?
        .into_inner();
        out.place.push(t0.elapsed());
        match response.decision {
            Some(place_response::Decision::Placed(_)) => {
                out.placed += 1;
                let t1 = Instant::now();
                until_available(&mut out.unavailable, || {
                    let mut client = client.clone();
                    let task_id = task_id.clone();
                    async move { client.release(ReleaseRequest { task_id }).await }
                })
                .await?;
                out.release.push(t1.elapsed());
            }
            _ => out.queued += 1,
        }
    }
    Ok(out)
}

/// One finished benchmark, for its summary.
struct BenchRun<'a> {
    url: &'a StoreUrl,
    residents: usize,
    /// Sorted.
    latencies: Latencies,
    wall: Duration,
    /// The in-process placer, when the benchmark started one.
    local: Option<&'a Daemon>,
    forest: Option<&'a iadeep_predictor::OnlinePredictor>,
}

/// Prints the benchmark's summary: one JSON object with `--json`, else a few lines.
fn print_summary(args: &BenchArgs, run: &BenchRun<'_>) {
    let Latencies {
        place,
        release,
        placed,
        queued,
        unavailable,
    } = &run.latencies;
    let (url, wall, local, forest) = (run.url, run.wall, run.local, run.forest);
    let decisions_per_s = place.len() as f64 / wall.as_secs_f64();
    let summary = serde_json::json!({
        "devices": args.devices,
        "residents": run.residents,
        "concurrency": args.concurrency,
        "requests": place.len(),
        "placed": placed,
        "queued": queued,
        "unavailable_retries": unavailable,
        "wall_s": wall.as_secs_f64(),
        "decisions_per_s": decisions_per_s,
        "place_p50_ms": percentile_ms(place, 50.0),
        "place_p99_ms": percentile_ms(place, 99.0),
        "place_max_ms": ms(place.last().copied().unwrap_or_default()),
        "release_p50_ms": percentile_ms(release, 50.0),
        "release_p99_ms": percentile_ms(release, 99.0),
        "store": url.to_string(),
        "cas_conflicts": local.as_ref().map(|d| d.metrics().cas_conflicts.get()),
        "gate_waits": local.as_ref().map(|d| d.metrics().gate_waits.get()),
        "predictor_model_samples": forest.as_ref().map(|p| p.model_samples()),
    });
    if args.json {
        println!("{summary}");
    } else {
        println!(
            "{} Place calls ({placed} placed, {queued} queued; {unavailable} calls answered \
             UNAVAILABLE and sent again) from {} clients in {:.2} s over loopback gRPC, {} \
             devices / {} residents, store {url}",
            place.len(),
            args.concurrency,
            wall.as_secs_f64(),
            args.devices,
            run.residents
        );
        println!(
            "  decisions/s {decisions_per_s:.0} (each placed task is also released, inside the same wall time)"
        );
        println!(
            "  Place   p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms",
            percentile_ms(place, 50.0),
            percentile_ms(place, 99.0),
            ms(place.last().copied().unwrap_or_default())
        );
        println!(
            "  Release p50 {:.3} ms  p99 {:.3} ms",
            percentile_ms(release, 50.0),
            percentile_ms(release, 99.0)
        );
        if let Some(daemon) = local {
            let m = daemon.metrics();
            println!(
                "  in-process placer: {} reservations lost to a concurrent request and re-decided; \
                 {} decisions timed, see iadeep_placer_decision_seconds",
                m.cas_conflicts.get(),
                m.decision_latency.count()
            );
        }
    }
}

/// Refuses to seed a store that holds a device the synthetic cluster does not have: a
/// live cluster's (a shell that sourced `iadeep up`'s cluster.env names it through
/// IADEEP_STORE), which the synthetic GPUs and residents would join and stay in, listed
/// by `iadeep status` and offered to real jobs. A store this command seeded before (the
/// same or a smaller synthetic cluster) is reused.
async fn refuse_a_live_store(
    store: &dyn iadeep_state::StateStore,
    cluster: &SyntheticCluster,
    url: &StoreUrl,
) -> Result<()> {
    let ours: std::collections::HashSet<String> = cluster
        .devices
        .iter()
        .map(|d| keys::device_info(&d.device_id))
        .collect();
    let devices = store
        .range(keys::DEVICES)
        .await
        .with_context(|| format!("cannot read the devices in {url}"))?;
    let foreign = devices
        .kvs
        .iter()
        .filter(|kv| {
            matches!(
                keys::KeyKind::parse(&kv.key),
                keys::KeyKind::DeviceInfo { .. }
            )
        })
        .filter(|kv| !ours.contains(&kv.key))
        .count();
    if foreign > 0 {
        bail!(
            "{url} already holds {foreign} device(s) this benchmark did not seed: it looks like \
             a live cluster's store (is IADEEP_STORE set, e.g. by a sourced cluster.env?). \
             The benchmark writes synthetic GPUs and residents that would stay there; give it \
             a store of its own with --store (e.g. --store /tmp/bench.redb)"
        );
    }
    Ok(())
}

async fn bench_client(url: StoreUrl, args: BenchArgs) -> Result<ExitCode> {
    if args.concurrency == 0 || args.requests == 0 {
        bail!("--concurrency and --requests must be positive");
    }
    let store = crate::open_store(&url).await?;
    let cluster = SyntheticCluster::new(args.devices, args.residents, args.seed);
    refuse_a_live_store(store.as_ref(), &cluster, &url).await?;
    let seeding = Instant::now();
    cluster
        .seed(store.as_ref())
        .await
        .context("cannot seed the synthetic cluster")?;
    tracing::info!(devices = args.devices, residents = cluster.resident_count(),
        elapsed_ms = seeding.elapsed().as_millis() as u64, store = %url, "seeded");
    let mut seeded_samples = 0usize;
    if let Some(worker) = &args.gavel_samples {
        seeded_samples = seed_gavel_samples(store.as_ref(), worker).await?;
    }
    if cluster.resident_count() < args.residents {
        bail!(
            "only {} of {} residents fit on {} devices",
            cluster.resident_count(),
            args.residents,
            args.devices
        );
    }
    let mut local = None;
    let mut forest = None;
    let addr = match args.grpc {
        Some(addr) => addr,
        None => {
            let (daemon, predictor) = start_local_placer(store.clone(), &args).await?;
            forest = Some(predictor);
            let addr = daemon.grpc_addr();
            local = Some(daemon);
            addr
        }
    };
    let endpoint = format!("http://{addr}");
    wait_for_cluster(&endpoint, args.devices, cluster.resident_count()).await?;
    if let Some(predictor) = &forest
        && seeded_samples > 0
    {
        wait_for_fit(predictor).await?;
    }
    let cluster = Arc::new(cluster);
    // Marks the timed phase's start for whoever samples the processes' CPU time.
    tracing::info!(
        concurrency = args.concurrency,
        requests = args.requests,
        "clients starting"
    );
    let started = Instant::now();
    let mut latencies = run_clients(&endpoint, &cluster, args.concurrency, args.requests).await?;
    let wall = started.elapsed();
    latencies.place.sort();
    latencies.release.sort();
    let run = BenchRun {
        url: &url,
        residents: cluster.resident_count(),
        latencies,
        wall,
        local: local.as_ref(),
        forest: forest.as_deref(),
    };
    print_summary(&args, &run);
    if let Some(daemon) = local {
        daemon.shutdown().await;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn task_retention_reads_humane_durations_and_never() {
        let parse = |text: &str| parse_retention(text).map(|r| r.0);
        assert_eq!(parse("1d"), Ok(Some(Duration::from_secs(86_400))));
        assert_eq!(parse("90m"), Ok(Some(Duration::from_secs(5_400))));
        assert_eq!(parse("0s"), Ok(Some(Duration::ZERO)));
        assert_eq!(parse("never"), Ok(None));
        let err = parse("a while").expect_err("not a duration");
        assert!(err.contains("such as 1d"), "{err}");
    }

    /// The benchmark sends a call answered UNAVAILABLE again after the placer's
    /// pushback, counts it, gives up after a bound, and never retries other errors.
    #[tokio::test(start_paused = true)]
    async fn the_benchmark_asks_again_only_when_told_unavailable() {
        let unavailable = || {
            let mut status = tonic::Status::unavailable("placements kept racing");
            status.metadata_mut().insert(
                iadeep_placer::RETRY_PUSHBACK_MS,
                "150".parse().expect("ascii"),
            );
            status
        };
        assert_eq!(retry_pause(&unavailable()), Duration::from_millis(150));
        assert_eq!(
            retry_pause(&tonic::Status::unavailable("no pushback")),
            Duration::from_millis(100)
        );

        let (mut retries, mut calls) = (0, 0);
        let started = tokio::time::Instant::now();
        let answer = until_available(&mut retries, || {
            calls += 1;
            let answer = if calls <= 2 {
                Err(unavailable())
            } else {
                Ok(calls)
            };
            async move { answer }
        })
        .await;
        assert_eq!(answer.expect("answered the third time"), 3);
        assert_eq!(retries, 2);
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(300),
            "two pushbacks"
        );

        let (mut retries, mut calls) = (0, 0);
        let answer: std::result::Result<(), _> = until_available(&mut retries, || {
            calls += 1;
            async { Err(tonic::Status::invalid_argument("bad task")) }
        })
        .await;
        assert_eq!(
            answer.expect_err("not retried").code(),
            tonic::Code::InvalidArgument
        );
        assert_eq!((retries, calls), (0, 1));

        let mut retries = 0;
        let answer: std::result::Result<(), _> =
            until_available(&mut retries, || async { Err(unavailable()) }).await;
        assert_eq!(
            answer.expect_err("gave up").code(),
            tonic::Code::Unavailable
        );
        assert_eq!(retries, u64::from(BENCH_UNAVAILABLE_RETRIES));
    }

    /// The policy flags alone, as `iadeep placer` and `bench-client` flatten them.
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        policy: PolicyArgs,
    }

    #[test]
    fn avoid_pairing_for_defaults_to_half_an_hour_and_must_be_positive() {
        use clap::Parser;
        let parsed = Cli::try_parse_from(["iadeep"]).expect("defaults");
        assert_eq!(parsed.policy.avoid_pairing_for, Duration::from_secs(1_800));
        assert_eq!(
            iadeep_placer::PlacerParams::default().avoid_pairing_for,
            parsed.policy.avoid_pairing_for
        );
        let parsed = Cli::try_parse_from(["iadeep", "--avoid-pairing-for", "2h"]).expect("2h");
        assert_eq!(parsed.policy.avoid_pairing_for, Duration::from_secs(7_200));
        assert!(Cli::try_parse_from(["iadeep", "--avoid-pairing-for", "0s"]).is_err());
    }

    /// The daemon's flags alone.
    #[derive(clap::Parser)]
    struct DaemonCli {
        #[command(flatten)]
        daemon: DaemonArgs,
    }

    /// The pod-eviction grace defaults to the placer's, and with kubelet's termination
    /// grace must stay under the dead-task grace when the placer evicts pods
    /// (`--kube-api`): refused before the store is opened.
    #[tokio::test]
    async fn pod_evict_grace_must_end_before_the_dead_task_grace() {
        use clap::Parser;
        let parsed = DaemonCli::try_parse_from(["iadeep"]).expect("defaults");
        assert_eq!(
            parsed.daemon.pod_evict_grace,
            iadeep_placer::PlacerParams::default().pod_evict_grace
        );
        let args = [
            "iadeep",
            "--grpc",
            "127.0.0.1:0",
            "--extender",
            "127.0.0.1:0",
            "--kube-api",
            "http://127.0.0.1:1",
            "--pod-evict-grace",
            "31s",
        ];
        let parsed = DaemonCli::try_parse_from(args).expect("flags");
        let err = daemon(StoreUrl::Memory, parsed.daemon)
            .await
            .expect_err("31 s + 30 s is not under 60 s");
        let text = format!("{err:#}");
        assert!(
            text.contains("--pod-evict-grace") && text.contains("dead-task"),
            "{text}"
        );
    }

    #[test]
    fn room_eviction_patience_defaults_to_the_placers_and_may_be_zero() {
        use clap::Parser;
        let parsed = Cli::try_parse_from(["iadeep"]).expect("defaults");
        assert_eq!(
            parsed.policy.room_eviction_patience,
            iadeep_placer::PlacerParams::default().room_eviction_patience
        );
        let parsed = Cli::try_parse_from(["iadeep", "--room-eviction-patience", "0s"]).expect("0s");
        assert_eq!(parsed.policy.room_eviction_patience, Duration::ZERO);
        assert!(Cli::try_parse_from(["iadeep", "--room-eviction-patience", "soon"]).is_err());
    }

    #[test]
    fn waiter_hold_defaults_to_the_placers_and_may_be_zero() {
        use clap::Parser;
        let parsed = Cli::try_parse_from(["iadeep"]).expect("defaults");
        assert_eq!(
            parsed.policy.waiter_hold,
            iadeep_placer::PlacerParams::default().waiter_hold
        );
        let parsed = Cli::try_parse_from(["iadeep", "--waiter-hold", "0s"]).expect("0s");
        assert_eq!(parsed.policy.waiter_hold, Duration::ZERO);
    }

    #[test]
    fn the_waiters_a_decision_checks_reach_the_placer() {
        use clap::Parser;
        let defaults = Cli::try_parse_from(["iadeep"]).expect("defaults");
        let placer = defaults
            .policy
            .placer_over(PlacerParams::default())
            .expect("placer");
        assert_eq!(
            placer.params().max_waiters_checked,
            PlacerParams::default().max_waiters_checked
        );
        let parsed =
            Cli::try_parse_from(["iadeep", "--max-waiters-checked", "0"]).expect("0 is all");
        let placer = parsed
            .policy
            .placer_over(PlacerParams::default())
            .expect("placer");
        assert_eq!(placer.params().max_waiters_checked, 0);
        assert!(Cli::try_parse_from(["iadeep", "--max-waiters-checked", "-1"]).is_err());
    }
}
