//! `iadeep run`: place a training job, run it on its GPU, release the GPU after.
//!
//! Signals while the job runs: SIGTERM and SIGHUP sent to `iadeep run` are forwarded
//! to the job, which may still clean up (its agent's `finish`). SIGINT is not: a
//! Ctrl-C at the terminal reaches the job directly (it is in the same foreground
//! process group), and a second copy would interrupt its clean-up; `iadeep run` just
//! keeps waiting for the job to exit. Whatever ends the job, the placement is
//! released before `iadeep run` exits with the job's exit code (128 + N for a job
//! killed by signal N); before that, once nothing the job started runs any more, the
//! agent's `alive` key is deleted if its process is gone (`Evictions::agent_gone`). If `iadeep run` itself is killed, the placer releases the GPU
//! once the job's agent is gone for the grace period.
//!
//! Eviction: while the job runs, `iadeep run` follows the task's assignment (a watch
//! through the state store, re-opened after a failure, never fatal to the job). Once it
//! says evict, the job has `--evict-grace` to checkpoint and exit on its own; one that
//! has not by then gets SIGTERM, and SIGKILL `--evict-kill-after` later ([`enforce`]),
//! since a job that ignores the eviction (a loop that swallows `iadeep.Evicted`, no
//! agent, a hung checkpoint) would otherwise keep the GPU and the production job it was
//! evicted for above its cap. The signals go to the job's whole process tree as /proc
//! shows it then ([`tree`]: a wrapper such as `bash train.sh` or `torchrun` would
//! otherwise leave its trainer on the GPU; `iadeep run` is the subreaper of what the job
//! starts, so a double-forked trainer stays in that tree), what is left of an evicted
//! job once it exited is killed (stopped or not), and a job whose last report says
//! finished is not stopped (it is writing its outputs). What a job that was not evicted
//! leaves running is named in the log, not stopped. Grace and kill-after together must stay under the placer's
//! `--dead-task-grace-s`: the agent revokes its lease as it raises `iadeep.Evicted`, and
//! the placer gives the memory away that long after. When the job exits, `iadeep run`
//! reads the task's assignment (what the watch saw, else the live key, else the
//! archived one, whichever was written since this run was placed); if the placer
//! evicted it and its last report does not say finished, it is released, placed again
//! under the same task id through the usual queue, and the same command started again
//! with IADEEP_REQUEUED and IADEEP_EVICTED_REASON set (`--requeue-on-evict`, on by
//! default for opportunistic jobs), at most `--max-requeues` times: the same for a job
//! stopped by `iadeep run` as for one that left on its own.

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitCode, ExitStatus};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use clap::builder::PossibleValuesParser;
use iadeep_agent::launch::{self, Launch};
use iadeep_proto::placer_client::PlacerClient;
use iadeep_proto::{
    BatchSizeAssignment, DeviceInfo, ListDevicesRequest, PlaceRequest, Placement, PriorityClass,
    ReleaseRequest, TaskReport, TaskSpec, place_response,
};
use iadeep_state::{StateStore, StoreUrl, keys, typed};

use crate::tls_args::PlacerTlsArgs;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::signal::unix::{SignalKind, signal};
use tonic::transport::Channel;
use wake::QueueWatch;

mod agent_check;
mod enforce;
mod tree;
mod wake;

pub(crate) use agent_check::AGENT_START_PATIENCE;

/// Run a training command on a GPU of this machine chosen by iadeep's placer.
///
/// Asks the placer (IADEEP_PLACER) where the job should go and waits, saying why,
/// while it is queued; then runs CMD with IADEEP_TASK_ID, IADEEP_STORE and
/// CUDA_VISIBLE_DEVICES set (the job's `iadeep.Agent.from_env()` reads them, together
/// with the batch sizes given here), releases the placement when CMD exits (also
/// after Ctrl-C, SIGTERM or a crash), and exits with CMD's exit code (127, asking
/// nothing, when CMD is not found).
///
/// Production jobs (`--class production`) keep their slowdown under `--max-slowdown`;
/// opportunistic ones (the default) use what production jobs leave and may be evicted.
/// After an eviction `iadeep run` places the job again and restarts CMD with
/// IADEEP_REQUEUED=N and IADEEP_EVICTED_REASON set (`--requeue-on-evict`), so the job
/// resumes from its checkpoint. A job that writes no checkpoint loses all its progress
/// when evicted: it starts over. An evicted job that has not exited `--evict-grace`
/// after the eviction is stopped (SIGTERM, then SIGKILL).
///
/// Example: `source ~/.local/share/iadeep/cluster/cluster.env;
/// iadeep run --batch-size 64 --max-batch-size 256 -- python train.py`
#[derive(Debug, Args)]
// clap's own usage line names every argument given, from the environment too: after
// `source cluster.env` a mistake would be answered with `--placer <URL> --store <URL>`
// as if they had to be typed.
#[command(override_usage = "iadeep run [OPTIONS] --batch-size <M0> -- <CMD>...")]
pub struct RunArgs {
    /// The task's id (letters, digits, '.', '_', '-', ':'). Default: the script's name,
    /// the time and this process's id.
    #[arg(long, value_name = "ID", value_parser = parse_task_id, help_heading = THE_JOB)]
    task_id: Option<String>,
    /// Model name. Default: the command's own `--model` value (`train.py --model
    /// resnet50`: `resnet50`), else the script's file name without its extension
    /// (`train.py`: `train`).
    ///
    /// Jobs of one model share an entry of the profile registry, from which the placer
    /// fills a new job's profile (the memory it reserves, the speed alone the tuner
    /// measures PD against) before the job has measured its own.
    #[arg(long, value_name = "NAME", help_heading = THE_JOB)]
    model: Option<String>,
    /// The batch size the job starts with (m0). Required.
    ///
    /// The placer reserves memory for it and the tuner measures the job's slowdown
    /// against it.
    #[arg(long = "batch-size", value_name = "M0", help_heading = THE_JOB)]
    batch_size: u32,
    /// Smallest batch size the tuner may assign (default: M0).
    #[arg(long, value_name = "N", help_heading = THE_JOB)]
    min_batch_size: Option<u32>,
    /// Largest batch size the tuner may assign (default: M0).
    #[arg(long, value_name = "N", help_heading = THE_JOB)]
    max_batch_size: Option<u32>,
    /// GPU memory the job needs at M0, MiB, if known (helps the placer before the job
    /// has reported any).
    #[arg(long, value_name = "MIB", help_heading = THE_JOB)]
    gpu_mem_mib: Option<u64>,
    /// How the job rescales its learning rate when the batch size changes.
    ///
    /// Sent to the placer and the tuner, and to the job as IADEEP_LR_RULE, where it takes
    /// precedence over the rule the script passes to `Agent.from_env` (whose default is
    /// sqrt too).
    #[arg(long, value_name = "RULE", default_value = DEFAULT_LR_RULE,
        value_parser = PossibleValuesParser::new(launch::LR_RULE_NAMES), help_heading = THE_JOB)]
    lr_rule: String,
    /// Total work in samples, if known (lets the placer weigh waiting against sharing).
    #[arg(long, value_name = "N", help_heading = THE_JOB)]
    total_samples: Option<u64>,
    /// The placer's gRPC address (`iadeep up` prints it and writes it to cluster.env).
    ///
    /// HOST:PORT or http://HOST:PORT, or https://HOST:PORT for a placer serving TLS
    /// (with --placer-ca).
    #[arg(long, env = "IADEEP_PLACER", value_name = "URL", help_heading = CONNECTION)]
    placer: Option<String>,
    #[command(flatten, next_help_heading = CONNECTION)]
    placer_tls: PlacerTlsArgs,
    /// The state store the job's agent reports to (etcd; from cluster.env).
    #[arg(long, env = "IADEEP_STORE", value_name = "URL", help_heading = CONNECTION)]
    store: Option<StoreUrl>,
    /// Give up (exit 75) after waiting this long in the queue. Default: wait as long as
    /// it takes.
    #[arg(long, value_name = "SECONDS", help_heading = PLACEMENT)]
    max_wait_s: Option<u64>,
    /// Let the placer choose a GPU of any machine, not only this one's.
    ///
    /// The command still runs here: only for a cluster whose machines share this one's
    /// GPUs.
    #[arg(long, help_heading = PLACEMENT)]
    any_node: bool,
    /// The job's priority class.
    ///
    /// `production`: must run nearly as fast as alone; placement, batch-size tuning and
    /// eviction keep its slowdown (PD) at or under --max-slowdown. `opportunistic`: uses
    /// what production jobs leave; shrunk first, and evicted when a production job on
    /// its GPU stays above its cap.
    #[arg(long = "class", value_name = "CLASS", default_value = "opportunistic",
        help_heading = PRIORITY,
        value_parser = PossibleValuesParser::new(iadeep_proto::PRIORITY_CLASS_NAMES))]
    class: String,
    /// Production jobs only: the most slowdown the job accepts, as PD. Default: 1.10.
    ///
    /// PD is the job's time per sample relative to running alone at M0; greater than 1
    /// and at most 10; 1.1 means at most 10 % slower.
    #[arg(long, value_name = "X", help_heading = PRIORITY)]
    max_slowdown: Option<f64>,
    /// After an eviction, queue the job again and restart CMD. Default: on for
    /// opportunistic jobs, off for production ones.
    ///
    /// When the placer evicts the job: release it, queue it again (same task id) and
    /// restart CMD once placed, with IADEEP_REQUEUED=N (the restart's number) and
    /// IADEEP_EVICTED_REASON set, so it resumes from its checkpoint (`iadeep.torch`'s
    /// `on_evict` hook, or the Lightning callback's `checkpoint_path`). A job without a
    /// checkpoint loses all its progress: it starts over. When the evicted placement
    /// cannot be released (the placer does not answer Release), `iadeep run` exits 69
    /// instead of queueing it again.
    #[arg(long, overrides_with = "no_requeue_on_evict", help_heading = PRIORITY)]
    requeue_on_evict: bool,
    /// After an eviction, exit with the job's exit code instead of starting it again.
    #[arg(long, overrides_with = "requeue_on_evict", help_heading = PRIORITY)]
    no_requeue_on_evict: bool,
    /// The most restarts after evictions; after that, an eviction ends `iadeep run` with
    /// the job's exit code.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_REQUEUES,
        help_heading = PRIORITY)]
    max_requeues: u32,
    /// How long an evicted job has to checkpoint and exit on its own (`30s`, `1m`; `0s`:
    /// none; at most 1h).
    ///
    /// A job still running then is stopped by `iadeep run`: SIGTERM
    /// to it and every process it started, and SIGKILL --evict-kill-after later; then it
    /// is released and re-queued as after any eviction. Why: the production job it was
    /// evicted for stays above its slowdown cap until its GPU is free, and a job that
    /// ignores the eviction (a loop that catches `iadeep.Evicted`, no iadeep agent, a
    /// hung checkpoint) would never free it. Keep --evict-grace plus --evict-kill-after
    /// well under the placer's --dead-task-grace-s (60 s by default): the job's agent
    /// gives up its lease as it raises `iadeep.Evicted`, and the placer gives the job's
    /// GPU memory to another job that long after, while a job that swallowed the
    /// eviction may still be using it.
    #[arg(long, value_name = "DURATION", default_value = enforce::DEFAULT_GRACE,
        value_parser = enforce::parse_grace, help_heading = PRIORITY)]
    evict_grace: Duration,
    /// How long an evicted job stopped with SIGTERM (see --evict-grace) has to exit
    /// before SIGKILL.
    ///
    /// At most 1h; with --evict-grace, under the placer's --dead-task-grace-s.
    #[arg(long, value_name = "DURATION", default_value = enforce::DEFAULT_KILL_AFTER,
        value_parser = enforce::parse_grace, help_heading = PRIORITY)]
    evict_kill_after: Duration,
    /// How long the job may run before its iadeep agent's first report is overdue; then
    /// `iadeep run` warns, once (0s: never).
    ///
    /// A job without an agent (a script that never creates `iadeep.Agent.from_env(...)`)
    /// is never tuned, and the placer gives its GPU memory back after its
    /// unstarted-task grace (10 min by default) while the job may still use it.
    #[arg(long, value_name = "DURATION", default_value = agent_check::DEFAULT_PATIENCE,
        value_parser = agent_check::parse_patience, help_heading = THE_JOB)]
    agent_patience: Duration,
    /// The command and its arguments, after `--` (or from its first word on: every
    /// argument after it is the command's).
    #[arg(trailing_var_arg = true, required = true,
        value_name = "CMD", help_heading = THE_JOB)]
    command: Vec<String>,
}

/// `iadeep run --help`'s groups of options.
const THE_JOB: &str = "The job";
const CONNECTION: &str = "Connection";
const PLACEMENT: &str = "Placement";
const PRIORITY: &str = "Priority and eviction";

/// The learning-rate rule of a job launched without --lr-rule: the Python agent's
/// (`Agent.from_env`) default too, so that the tuner's factors and the job's agree.
const DEFAULT_LR_RULE: &str = "sqrt";
/// Exit status when the queue wait ran out (EX_TEMPFAIL: try again later).
const QUEUE_TIMEOUT_EXIT: u8 = 75;
/// How long a run waits for an agent already under its task id to go: a killed job's
/// agent keeps its `alive` key until its lease ends, the default lease plus etcd's lag
/// (an agent given a longer lease is waited for only this long).
const AGENT_GONE_WAIT: Duration =
    Duration::from_secs(2 * iadeep_agent::DEFAULT_LEASE_TTL.as_secs());

/// Exit status when the command does not exist, as a shell's.
const COMMAND_NOT_FOUND_EXIT: u8 = 127;

/// The command's program when it cannot be run: a path that is no executable file, or a
/// name no directory of PATH holds as one. Checked before the placer is asked, so a typo
/// costs no placement (and no GPU reserved for a job that cannot start).
fn missing_program(command: &[String]) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let program = command.first()?;
    let executable = |path: &std::path::Path| {
        std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    let found = if program.contains('/') {
        executable(std::path::Path::new(program))
    } else {
        // No PATH: the exec searches its default one; let it tell.
        std::env::var_os("PATH").is_none_or(|path| {
            std::env::split_paths(&path).any(|dir| executable(&dir.join(program)))
        })
    };
    (!found).then(|| program.clone())
}

/// The exit code when the command cannot be run, said as a shell says it.
fn command_not_found(command: &[String]) -> Option<ExitCode> {
    let missing = missing_program(command)?;
    eprintln!("iadeep run: {missing}: command not found (nothing was placed)");
    Some(ExitCode::from(COMMAND_NOT_FOUND_EXIT))
}

/// Exit status when the placer evicted the job and it is to be queued again, but its
/// placement could not be released (EX_UNAVAILABLE). Why not queue it anyway: Place is
/// idempotent per task id, so it would answer the old placement, whose evict assignment
/// the restarted job would find at once. Distinct from [`QUEUE_TIMEOUT_EXIT`], so a
/// caller can tell "evicted, not re-queued" from "never placed in time".
const EVICTED_NOT_REQUEUED_EXIT: u8 = 69;
/// How often a queued job looks (ListDevices) whether a GPU has room now.
const FREED_POLL: Duration = Duration::from_secs(2);
/// Deadline of each call to the placer.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Restarts after evictions when --max-requeues is not given: enough for a job that
/// meets a few busy production jobs, bounded so a job evicted over and over stops.
const DEFAULT_MAX_REQUEUES: u32 = 10;
/// Deadline of each store read after the job exits (is it evicted?).
const STORE_TIMEOUT: Duration = Duration::from_secs(10);

/// The signals `iadeep run` handles, registered before anything can be interrupted.
struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Result<Signals> {
        let on = |kind| signal(kind).context("cannot install a signal handler");
        Ok(Signals {
            interrupt: on(SignalKind::interrupt())?,
            terminate: on(SignalKind::terminate())?,
            hangup: on(SignalKind::hangup())?,
        })
    }

    /// The next signal that arrives.
    async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.interrupt.recv() => Signal::SIGINT,
            _ = self.terminate.recv() => Signal::SIGTERM,
            _ = self.hangup.recv() => Signal::SIGHUP,
        }
    }
}

/// The placer's address as a URI tonic connects to.
fn endpoint(placer: &str) -> String {
    if placer.contains("://") {
        placer.to_owned()
    } else {
        format!("http://{placer}")
    }
}

/// The job's name: the script's file name (the first argument after the program that
/// names a file), else the program's.
fn job_name(command: &[String]) -> String {
    let stem = |arg: &String| {
        std::path::Path::new(arg)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
    };
    command
        .iter()
        .skip(1)
        .find(|arg| !arg.starts_with('-') && std::path::Path::new(arg).is_file())
        .or(command.first())
        .and_then(stem)
        .unwrap_or_else(|| "job".to_owned())
}

/// A `--model` value as a model name: a path's last part, less a checkpoint file's
/// suffix (`/ckpt/run3/resnet.pt` → `resnet`); a hub name keeps its dots
/// (`facebook/opt-1.3b` → `opt-1.3b`).
fn model_of_path(value: &str) -> String {
    let last = value.rsplit('/').next().unwrap_or(value);
    const CHECKPOINTS: [&str; 6] = [".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".onnx"];
    CHECKPOINTS
        .iter()
        .find_map(|suffix| last.strip_suffix(suffix))
        .unwrap_or(last)
        .to_owned()
}

/// The longest model name taken from a command (the placer refuses longer names).
const MAX_MODEL_NAME_BYTES: usize = 256;

/// The model a job is of, when `--model` does not say: the value of the command's own
/// `--model` flag (`train.py --model resnet50`, `iadeep emulate-job --model cifar10`),
/// else the job's name ([`job_name`]). The profile registry is per model: one script
/// that trains several models must not share one entry, nor `iadeep emulate-job`'s
/// models the name `iadeep`.
fn model_name(command: &[String], job_name: &str) -> String {
    let mut args = command.iter().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--" {
            break;
        }
        let value = match arg.strip_prefix("--model") {
            Some("") => args.next().cloned(),
            Some(rest) => rest.strip_prefix('=').map(str::to_owned),
            None => None,
        };
        // A path (`--model /ckpt/run3/resnet.pt`) names its file: one entry per model,
        // not per checkpoint.
        let model = value
            .filter(|m| !m.is_empty() && !m.starts_with('-'))
            .map(|m| model_of_path(&m));
        if let Some(model) = model.filter(|m| !m.is_empty() && m.len() <= MAX_MODEL_NAME_BYTES) {
            return model;
        }
    }
    job_name.to_owned()
}

/// A task id from the job's name: id characters only, unique per launch.
fn default_task_id(name: &str) -> String {
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect();
    let now_s = iadeep_proto::now_unix_ms() / 1000;
    format!("{name}-{now_s}-{}", std::process::id())
}

/// A call to the placer with a deadline, so a hung placer cannot hang the job's launch.
async fn call<T>(
    what: &str,
    fut: impl Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
) -> std::result::Result<T, tonic::Status> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(result) => result.map(tonic::Response::into_inner),
        Err(_) => Err(tonic::Status::deadline_exceeded(format!(
            "{what}: no answer within {CALL_TIMEOUT:?}"
        ))),
    }
}

/// Whether a failed call is worth repeating later (the placer restarting, contention).
fn transient(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Aborted
    )
}

/// How the queue wait ended.
enum Waited {
    Placed(Box<(Placement, DeviceInfo)>),
    Interrupted(Signal),
    TimedOut,
}

/// The batch sizes as given, checked before anything is asked of the cluster, naming the
/// flags (the placer checks the spec too, but names its fields).
fn check_batch_sizes(args: &RunArgs) -> Result<()> {
    let m0 = args.batch_size;
    if m0 == 0 {
        bail!("--batch-size 0: the batch size the job starts with must be at least 1");
    }
    for (flag, value) in [
        ("--min-batch-size", args.min_batch_size),
        ("--max-batch-size", args.max_batch_size),
    ] {
        if value == Some(0) {
            bail!("{flag} 0: must be at least 1 (leave it out for --batch-size {m0})");
        }
    }
    match (args.min_batch_size, args.max_batch_size) {
        (Some(min), Some(max)) if min > max => {
            bail!("--min-batch-size {min} is larger than --max-batch-size {max}")
        }
        (Some(min), _) if min > m0 => {
            bail!(
                "--min-batch-size {min} is larger than --batch-size {m0}, which must lie between them"
            )
        }
        (_, Some(max)) if max < m0 => {
            bail!(
                "--max-batch-size {max} is smaller than --batch-size {m0}, which must lie between them"
            )
        }
        _ => Ok(()),
    }
}

/// The job's class and cap as given, checked as the placer checks them.
fn class_of(args: &RunArgs) -> Result<(PriorityClass, Option<f64>)> {
    let class = iadeep_proto::priority_class_from_name(&args.class)
        .with_context(|| format!("--class {}: not a class", args.class))?;
    if let Err((field, why)) = iadeep_proto::check_priority(class as i32, args.max_slowdown) {
        match (field, args.max_slowdown) {
            ("max_slowdown", Some(_)) if class != PriorityClass::Production => {
                bail!(
                    "--max-slowdown applies to --class production only (this job is {})",
                    args.class
                )
            }
            ("max_slowdown", Some(cap)) => bail!("--max-slowdown {cap}: {why}"),
            _ => bail!("--class {}: {why}", args.class),
        }
    }
    Ok((class, args.max_slowdown))
}

/// Whether an evicted job is placed again and restarted: as asked, else by its class.
fn requeues(args: &RunArgs, class: PriorityClass) -> bool {
    match (args.requeue_on_evict, args.no_requeue_on_evict) {
        (true, _) => true,
        (_, true) => false,
        _ => class != PriorityClass::Production,
    }
}

/// Parses `--task-id`: checked here as the store checks it, so a bad one is refused
/// before the placer is asked.
fn parse_task_id(text: &str) -> std::result::Result<String, String> {
    keys::validate_id("task", text).map_err(|err| err.to_string())?;
    Ok(text.to_owned())
}

/// The placer's address and the store, both required: the job's agent and the placer
/// run in different processes, so only a shared etcd store lets them see each other.
fn placer_and_store(args: &RunArgs) -> Result<(&str, StoreUrl)> {
    let placer = args.placer.as_deref().context(
        "no placer: set IADEEP_PLACER or --placer (`source DIR/cluster.env` written by `iadeep up`)",
    )?;
    let store = args.store.clone().context(
        "no store: set IADEEP_STORE or --store (`source DIR/cluster.env` written by `iadeep up`)",
    )?;
    if !matches!(store, StoreUrl::Etcd(_)) {
        bail!(
            "--store {store}: the job's agent and the placer run in different processes, so they \
             must share an etcd store (the embedded store serves one process); start one with `iadeep up`"
        );
    }
    Ok((placer, store))
}

/// Turns the wait for a placement into the placement, or the exit code `run` ends with
/// when the wait ends otherwise; every way out releases the task, since a Place may
/// have committed before the wait ended.
async fn placed_or_exit(
    waited: Result<Waited>,
    client: &mut PlacerClient<Channel>,
    task_id: &str,
    args: &RunArgs,
) -> Result<std::result::Result<(Placement, DeviceInfo), ExitCode>> {
    match waited {
        Ok(Waited::Placed(placed)) => Ok(Ok(*placed)),
        Ok(Waited::Interrupted(sig)) => {
            tracing::info!(signal = %sig, "interrupted while queued");
            release(client, task_id, false).await;
            Ok(Err(ExitCode::from(128 + sig as i32 as u8)))
        }
        Ok(Waited::TimedOut) => {
            release(client, task_id, false).await;
            eprintln!(
                "iadeep run: still queued after --max-wait-s {}; giving up",
                args.max_wait_s.unwrap_or(0)
            );
            Ok(Err(ExitCode::from(QUEUE_TIMEOUT_EXIT)))
        }
        Err(err) => {
            // A Place may have committed before the failure: give it back.
            release(client, task_id, false).await;
            Err(err)
        }
    }
}

/// The launch settings every start of the job shares; each start adds its device and
/// its restart count.
fn base_launch(
    args: &RunArgs,
    task_id: &str,
    store: &StoreUrl,
    lr_rule: iadeep_proto::LrScalingRule,
    class: PriorityClass,
    max_slowdown: Option<f64>,
) -> Launch {
    Launch {
        task_id: task_id.to_string(),
        store: store.to_string(),
        // Only a name the user gave: the script's own name for itself is as good as ours.
        model: args.model.clone(),
        initial_batch_size: Some(args.batch_size),
        min_batch_size: args.min_batch_size,
        max_batch_size: args.max_batch_size,
        lr_rule: Some(lr_rule),
        priority_class: Some(class),
        max_slowdown,
        ..Launch::default()
    }
}

pub async fn run(args: RunArgs) -> Result<ExitCode> {
    check_batch_sizes(&args)?;
    let mut signals = Signals::install()?;
    let (placer, store) = placer_and_store(&args)?;
    let (class, max_slowdown) = class_of(&args)?;
    let requeue = requeues(&args, class);
    let name = job_name(&args.command);
    let task_id = args
        .task_id
        .clone()
        .unwrap_or_else(|| default_task_id(&name));
    let lr_rule = launch::lr_rule_from_name(&args.lr_rule)
        .with_context(|| format!("--lr-rule {}: not a rule", args.lr_rule))?;
    let spec = task_spec(&args, &task_id, &name, lr_rule, class);
    let base = base_launch(&args, &task_id, &store, lr_rule, class, max_slowdown);
    let mut evictions = Evictions::new(store.clone(), &task_id);
    let mut client =
        match checked_client(&args, placer, &store, &mut evictions, &mut signals).await? {
            Ok(client) => client,
            Err(code) => return Ok(code),
        };
    let mut requeued = 0u32;
    let mut evicted_reason: Option<String> = None;
    loop {
        let waited = wait_for_placement(&mut client, &spec, &args, &mut signals).await;
        let (placement, device) = match placed_or_exit(waited, &mut client, &task_id, &args).await?
        {
            Ok(placed) => placed,
            Err(code) => return Ok(code),
        };
        // What the store holds from here on is this run's: an eviction written later.
        evictions.placed().await;

        let launch = Launch {
            device_id: Some(placement.device_id.clone()),
            requeued,
            evicted_reason: evicted_reason.clone(),
            ..base.clone()
        };
        tracing::info!(task = %task_id, device = %placement.device_id, gpu_index = device.index,
            reserved_mib = placement.reserved_mem_mib, class = %args.class, requeued,
            command = ?args.command, "placed; starting the job");
        let mut ran = start_job(
            &args,
            &launch,
            (&device, placement.reserved_mem_mib),
            &mut signals,
            &mut evictions,
        )
        .await;
        // Read before the Release, which moves the keys to the archive (read there too,
        // for a task the reaper released first, once its agent had left).
        let evicted = match &ran {
            Ok(ran) if ran.interrupted.is_none() => evictions.evicted().await,
            // A signal stopped it, or it could not be waited for: not an eviction.
            _ => None,
        };
        after_exit(&task_id, &mut ran, evicted.is_some(), &mut evictions).await;
        let released = release(&mut client, &task_id, true).await;
        let Ran {
            status, enforced, ..
        } = ran?;
        log_exit(&task_id, status, enforced, args.evict_grace);
        if let Some(reason) = evicted {
            let next = after_eviction(requeue, requeued, args.max_requeues, released);
            match after_evicted(&task_id, reason, next, requeued, args.max_requeues) {
                Some(reason) => {
                    requeued += 1;
                    evicted_reason = Some(reason);
                    continue;
                }
                None if next == AfterEviction::NotReleased => {
                    return Ok(ExitCode::from(EVICTED_NOT_REQUEUED_EXIT));
                }
                None => {}
            }
        }
        return Ok(exit_code(status));
    }
}

/// Runs one start of the job to its exit on `device`, where it holds `reserved_mib`,
/// enforcing its eviction, and looks for its agent meanwhile.
async fn start_job(
    args: &RunArgs,
    launch: &Launch,
    (device, reserved_mib): (&DeviceInfo, u64),
    signals: &mut Signals,
    evictions: &mut Evictions,
) -> Result<Ran> {
    let enforcer = enforce::Enforcer::new(args.evict_grace, args.evict_kill_after);
    // Called off when the job exits (dropped at the end of this function).
    let _agent_check = agent_check::AgentCheck::start(
        evictions.store.clone(),
        evictions.url.clone(),
        launch.task_id.clone(),
        reserved_mib,
        args.agent_patience,
    );
    run_job(&args.command, launch, device, signals, evictions, enforcer).await
}

/// Logs how the job ended: on its own, or stopped by `iadeep run` (`enforced`: the last
/// signal sent) because it outlived its eviction's `grace`.
fn log_exit(task_id: &str, status: ExitStatus, enforced: Option<Signal>, grace: Duration) {
    match enforced {
        Some(sig) => tracing::warn!(task = %task_id, exit_code = status.code(),
            signal = crate::ended::signal_name(status),
            "job exited: stopped by iadeep run because of the eviction (still running \
             --evict-grace {} after it; sent {}, it {})",
            humantime::format_duration(grace),
            if sig == Signal::SIGKILL { "SIGTERM, then SIGKILL" } else { "SIGTERM" },
            crate::ended::Ended(status)),
        None => tracing::info!(task = %task_id, exit_code = status.code(),
            signal = crate::ended::signal_name(status), "job exited"),
    }
}

/// Says what follows an eviction (`next`, after `requeued` restarts): the reason to
/// restart the job with, or `None` when it is not restarted.
fn after_evicted(
    task_id: &str,
    reason: String,
    next: AfterEviction,
    requeued: u32,
    max_requeues: u32,
) -> Option<String> {
    match next {
        AfterEviction::Exit => tracing::warn!(task = %task_id, %reason, requeued,
            "the placer evicted the job; not restarting it (--no-requeue-on-evict, or --max-requeues {max_requeues})"),
        AfterEviction::NotReleased => {
            tracing::error!(task = %task_id, %reason,
                "the placer evicted the job, but its placement could not be released; \
                 not queueing it again (the placer would answer the evicted placement)");
            eprintln!(
                "iadeep run: evicted, and the placement could not be released; not re-queued (exit {EVICTED_NOT_REQUEUED_EXIT})"
            );
        }
        AfterEviction::Requeue => {
            let requeued = requeued + 1;
            tracing::warn!(task = %task_id, %reason, requeued,
                "the placer evicted the job; queueing it again, to restart it with IADEEP_REQUEUED={requeued} \
                 (it resumes from its checkpoint, if it wrote one)");
            return Some(reason);
        }
    }
    None
}

/// What `iadeep run` does after the placer evicted the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AfterEviction {
    /// Queue it again and restart it.
    Requeue,
    /// Exit with the job's exit code (no re-queue asked, or no restarts left).
    Exit,
    /// Exit with [`EVICTED_NOT_REQUEUED_EXIT`]: a re-queue was due, but the placement
    /// was not released, so Place would answer the evicted placement again.
    NotReleased,
}

/// Whether an evicted job is queued again: when asked (`requeue`), with restarts left,
/// and only once its placement is gone (`released`).
fn after_eviction(
    requeue: bool,
    requeued: u32,
    max_requeues: u32,
    released: bool,
) -> AfterEviction {
    if !requeue || requeued >= max_requeues {
        AfterEviction::Exit
    } else if !released {
        AfterEviction::NotReleased
    } else {
        AfterEviction::Requeue
    }
}

/// `iadeep run`'s exit code for the job's: its code, or 128 + N when killed by signal N.
fn exit_code(status: ExitStatus) -> ExitCode {
    let code = match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => 128 + sig,
        (None, None) => 1,
    };
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Whether the placer evicted this run of the task.
///
/// While the job runs, a follower of the task's assignment (a watch, re-opened after
/// every failure) publishes an evict assignment, even one a tuner overwrote before the
/// job exited, for `run_job` to enforce; after it exits, the assignment is read too
/// (the live key, else the archived one: the reaper may have released the task once
/// its agent left). Only what was written after this run was placed counts
/// (compared by the store's revision, no clock): an eviction archived by an earlier
/// run's Release is not this run's. A job whose last report says it finished its work
/// is not evicted, whatever the assignment says. The store is opened on first use; a
/// store that cannot be read after the exit is logged, and counts as the eviction the
/// follower saw during the run, else as none (the job's exit code is then the answer).
struct Evictions {
    url: StoreUrl,
    task_id: String,
    store: Option<Arc<dyn StateStore>>,
    /// The revision of the Place commit that created this run's placement (its key's
    /// create revision), else the store's revision when it was read: what was written
    /// later is this run's.
    since: i64,
    /// The reason of an evict assignment the follower saw during this run.
    seen: tokio::sync::watch::Receiver<Option<String>>,
    watch: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for Evictions {
    fn drop(&mut self) {
        if let Some(watch) = self.watch.take() {
            watch.abort();
        }
    }
}

/// An operation on the store with [`STORE_TIMEOUT`].
async fn timed<T>(
    what: &str,
    fut: impl Future<Output = std::result::Result<T, iadeep_state::StateError>>,
) -> Result<T> {
    match tokio::time::timeout(STORE_TIMEOUT, fut).await {
        Ok(result) => result.with_context(|| what.to_owned()),
        Err(_) => bail!("{what}: no answer within {STORE_TIMEOUT:?}"),
    }
}

/// The reason an evict assignment gives, or a plain one when it gives none.
fn evict_reason(a: BatchSizeAssignment) -> String {
    Some(a.evict_reason)
        .filter(|r| !r.trim().is_empty())
        .unwrap_or_else(|| "evicted by the placer".to_owned())
}

impl Evictions {
    fn new(url: StoreUrl, task_id: &str) -> Evictions {
        Evictions {
            url,
            task_id: task_id.to_owned(),
            store: None,
            since: 0,
            seen: tokio::sync::watch::channel(None).1,
            watch: None,
        }
    }

    /// Fails unless the store answers a read (unreachable, or refusing this client's
    /// credentials or certificate): a job whose agent reports to a store
    /// nobody reads (a mistyped --store) would be placed and run untuned, its agent
    /// warning all its life, and an unreachable store stops the placer too.
    ///
    /// Fails too when an agent of this task id runs (its `alive` key): a second run
    /// under a live id would be answered with the first one's placement (a Place is
    /// idempotent, so that a retry finds its own), start a second copy, and on its exit
    /// release the first one's placement under it. A placement with no agent is not
    /// refused: that is a run that stopped without releasing it, which a new run of the
    /// same id takes over. A killed job's agent holds the id until its lease ends, so a
    /// leased `alive` key is waited for (twice the agents' default lease) before the
    /// refusal: a retry right after a crash goes ahead. Two runs started at the same
    /// moment are not told apart (the read comes before the Place).
    async fn reachable_and_free(&mut self) -> Result<()> {
        let store = self.open().await;
        let checked = async {
            timed(
                "reading the store",
                store?.range(&keys::task_prefix(&self.task_id)),
            )
            .await
        };
        let task = checked.await.with_context(|| {
            format!(
                "the state store {} (--store or IADEEP_STORE) cannot be read; the job's agent \
                 reports there: is it the store `iadeep up` wrote to cluster.env, and does that \
                 cluster run?",
                self.url
            )
        })?;
        let alive = keys::task_alive(&self.task_id);
        let Some(key) = task.kvs.iter().find(|kv| kv.key == alive) else {
            return Ok(());
        };
        if key.lease.is_some() && self.alive_goes(&alive).await? {
            return Ok(());
        }
        bail!(
            "task id {} is in use: a job's agent runs under it ({alive} is in the store; \
             `iadeep status` shows the job). Give this run another --task-id, or leave it out \
             for a new one; to reuse the id, stop that job first.",
            self.task_id
        )
    }

    /// Whether the leased `alive` key goes within [`AGENT_GONE_WAIT`] (a killed agent's
    /// lease ending). A new report meanwhile ends the wait at once: that agent runs.
    async fn alive_goes(&mut self, alive: &str) -> Result<bool> {
        let store = self.open().await?;
        tracing::info!(task = %self.task_id, wait_s = AGENT_GONE_WAIT.as_secs(),
            "an agent holds this task id; waiting for its lease to end in case its job was killed");
        let report = keys::task_report(&self.task_id);
        let reported = |kv: Option<iadeep_state::KeyValue>| kv.map(|kv| kv.mod_revision);
        let first = reported(timed("reading the task", store.get(&report)).await?);
        let deadline = Instant::now() + AGENT_GONE_WAIT;
        while Instant::now() < deadline {
            tokio::time::sleep(Duration::from_secs(1)).await;
            if timed("reading the task", store.get(alive)).await?.is_none() {
                return Ok(true);
            }
            if reported(timed("reading the task", store.get(&report)).await?) != first {
                return Ok(false);
            }
        }
        Ok(false)
    }

    /// Deletes the task's `alive` key once nothing the job started runs any more and the
    /// process the key names (`pid N`, the agent's) is gone: a killed agent's key outlives
    /// it by up to its lease (10 s by default), and meanwhile the placer takes the
    /// released job for one that runs without a reservation (`iadeep status` says its
    /// agent runs) and may place it again (`PlacementService::readmit_running`), holding
    /// memory for a dead job. Only if the key is unchanged since it was read (another
    /// run of the same id may have started), and never when its pid still exists: an
    /// agent outside the job's process tree (in a container the job's client started)
    /// keeps its key, which its lease ends if it is gone. A failure is only logged.
    async fn agent_gone(&mut self) {
        let alive = keys::task_alive(&self.task_id);
        let deleted = async {
            let store = self.open().await?;
            let Some(kv) = timed("reading the agent's alive key", store.get(&alive)).await? else {
                return Ok(false);
            };
            if !named_process_gone(&kv.value) {
                return Ok(false);
            }
            let delete = store.compare_and_delete(&alive, kv.mod_revision);
            timed("deleting the agent's alive key", delete).await
        };
        match deleted.await {
            Ok(true) => tracing::info!(task = %self.task_id,
                "the job and every process it started have exited; its agent's alive key is deleted"),
            Ok(false) => {}
            Err(err) => tracing::warn!(task = %self.task_id, error = %format!("{err:#}"),
                "cannot delete the agent's alive key; it ends with the agent's lease"),
        }
    }

    async fn open(&mut self) -> Result<Arc<dyn StateStore>> {
        if let Some(store) = &self.store {
            return Ok(store.clone());
        }
        let store = timed("opening the state store", self.url.open()).await?;
        self.store = Some(store.clone());
        Ok(store)
    }

    /// Notes the revision of this run's placement (the task was just placed) and
    /// follows the task's assignment from there.
    ///
    /// Why the placement key's create revision, not the revision of the read: the
    /// placer may evict the job between Place's commit and this read, and that
    /// eviction is this run's. Its create revision, not its mod revision: a settlement
    /// rewrites the placement, possibly after an eviction. When the key is gone
    /// already (released meanwhile), the read's revision is the fallback. When the
    /// store cannot be read now, the follower keeps trying, and counts what it first
    /// reads as written since the last revision known.
    async fn placed(&mut self) {
        if let Some(watch) = self.watch.take() {
            watch.abort();
        }
        let (publish, seen) = tokio::sync::watch::channel(None);
        self.seen = seen;
        let start = async {
            let store = self.open().await?;
            let prefix = keys::task_prefix(&self.task_id);
            let snapshot = timed("reading the task", store.range(&prefix)).await?;
            let placement_key = keys::task_placement(&self.task_id);
            let since = match snapshot.kvs.iter().find(|kv| kv.key == placement_key) {
                Some(kv) => kv.create_revision,
                None => {
                    // Released already (rare this soon), or this store is not the one the
                    // placer writes to: then the job runs untuned and its evictions go unseen.
                    tracing::warn!(task = %self.task_id, store = %self.url,
                        "the state store holds no placement of this task just placed: if --store \
                         (IADEEP_STORE) names another cluster than the placer's, the job runs \
                         untuned; counting evictions from this read on");
                    snapshot.revision
                }
            };
            anyhow::Ok((store, since))
        };
        let follower = match start.await {
            Ok((store, since)) => {
                self.since = since;
                Follower {
                    url: self.url.clone(),
                    store: Some(store),
                    since,
                    watch_from_since: true,
                }
            }
            Err(err) => {
                tracing::warn!(task = %self.task_id, err = format!("{err:#}"),
                    "cannot read the state store; following the task's assignment once it answers");
                Follower {
                    url: self.url.clone(),
                    store: self.store.clone(),
                    since: self.since,
                    watch_from_since: false,
                }
            }
        };
        let key = keys::task_assignment(&self.task_id);
        self.watch = Some(tokio::spawn(follower.publish_eviction(key, publish)));
    }

    /// The eviction the follower saw during this run, as it changes (`None` until then).
    fn eviction(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.seen.clone()
    }

    /// The eviction's reason when the placer evicted this run and the job did not
    /// finish its work anyway.
    async fn evicted(&mut self) -> Option<String> {
        if let Some(watch) = self.watch.take() {
            watch.abort();
        }
        let seen = self.seen.borrow().clone();
        let read = self.read().await;
        evicted_after_read(&self.task_id, seen, read)
    }

    /// Whether this run's last report (live, else archived) says the job finished its
    /// work: an evicted job that did is writing its outputs, and is not stopped.
    async fn finished(&mut self) -> Result<bool> {
        let store = self.open().await?;
        let report: Option<TaskReport> = self
            .latest(
                &*store,
                &keys::task_report(&self.task_id),
                &keys::archived_report(&self.task_id),
            )
            .await?;
        Ok(report.is_some_and(|r| r.finished))
    }

    async fn read(&mut self) -> Result<Option<String>> {
        let store = self.open().await?;
        let task = self.task_id.clone();
        let seen = self.seen.borrow().clone();
        let reason = match seen {
            Some(reason) => reason,
            None => {
                let assignment: Option<BatchSizeAssignment> = self
                    .latest(
                        &*store,
                        &keys::task_assignment(&task),
                        &keys::archived_assignment(&task),
                    )
                    .await?;
                match assignment.filter(|a| a.evict) {
                    Some(a) => evict_reason(a),
                    None => return Ok(None),
                }
            }
        };
        let report: Option<TaskReport> = self
            .latest(
                &*store,
                &keys::task_report(&task),
                &keys::archived_report(&task),
            )
            .await?;
        if report.is_some_and(|r| r.finished) {
            tracing::info!(task = %task, %reason,
                "the placer evicted the job as it finished its work; nothing to restart");
            return Ok(None);
        }
        Ok(Some(reason))
    }

    /// The value at `live`, else at `archived`, when written since this run was placed.
    async fn latest<M: prost::Message + Default>(
        &self,
        store: &dyn StateStore,
        live: &str,
        archived: &str,
    ) -> Result<Option<M>> {
        for key in [live, archived] {
            if let Some((value, kv)) = timed(key, typed::get::<M>(store, key)).await?
                && kv.mod_revision > self.since
            {
                return Ok(Some(value));
            }
        }
        Ok(None)
    }
}

/// The eviction after the read that follows the job's exit: what the read says, and
/// when it failed, the eviction the follower `seen` during the run, if any. Why not "no
/// eviction" then: the job may have been stopped by `iadeep run` because of it (exit 143
/// or 137), and taking that exit as final would end a job that is to be re-queued.
fn evicted_after_read(
    task: &str,
    seen: Option<String>,
    read: Result<Option<String>>,
) -> Option<String> {
    match (read, seen) {
        (Ok(evicted), _) => evicted,
        (Err(err), Some(reason)) => {
            tracing::warn!(task, err = format!("{err:#}"), %reason,
                "cannot read the job's last report; the placer evicted it, so it is treated \
                 as evicted");
            Some(reason)
        }
        (Err(err), None) => {
            tracing::warn!(
                task,
                err = format!("{err:#}"),
                "cannot read whether the placer evicted the job; taking its exit as final"
            );
            None
        }
    }
}

/// How long the follower of a task's assignment waits after losing its watch (or
/// failing to open the store), doubling up to [`FOLLOW_BACKOFF_MAX`].
const FOLLOW_BACKOFF: Duration = Duration::from_secs(1);
const FOLLOW_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Where the follower of one run's assignment starts.
struct Follower {
    url: StoreUrl,
    /// The store, once opened.
    store: Option<Arc<dyn StateStore>>,
    /// What was written after this revision is this run's.
    since: i64,
    /// Whether to watch from `since` on (it is this run's placement revision), rather
    /// than read the assignment first (the store could not be read when it was placed).
    watch_from_since: bool,
}

impl Follower {
    /// Follows the task's assignment at `key` and publishes the reason of the first
    /// evict assignment written since this run was placed, then ends. A lost watch is
    /// re-opened (logged, after a backoff), so the job never depends on the store
    /// answering; it is the job's own exit that ends the run.
    async fn publish_eviction(
        self,
        key: String,
        publish: tokio::sync::watch::Sender<Option<String>>,
    ) {
        let backoff = iadeep_state::Backoff::doubling(FOLLOW_BACKOFF, FOLLOW_BACKOFF_MAX);
        let store = match self.store {
            Some(store) => store,
            None => open_until_it_answers(&self.url, &key, backoff).await,
        };
        let mut follow = if self.watch_from_since {
            iadeep_state::Follow::after(store, key.clone(), self.since, backoff)
        } else {
            iadeep_state::Follow::new(store, key.clone(), backoff)
        };
        loop {
            let kv = match follow.next().await {
                iadeep_state::Followed::Change(iadeep_state::WatchEvent::Put(kv)) => Some(kv),
                iadeep_state::Followed::Change(_) => None,
                // The first item after a lost watch: the assignment as it is now.
                iadeep_state::Followed::Snapshot(snapshot) => {
                    snapshot.kvs.into_iter().find(|kv| kv.key == key)
                }
            };
            if let Some(reason) = kv.and_then(|kv| eviction_since(&kv, &key, self.since)) {
                publish.send_replace(Some(reason));
                return;
            }
        }
    }
}

/// The reason of `kv` when it is an evict assignment at `key` written after `since`
/// (this run's, not one an earlier run left).
fn eviction_since(kv: &iadeep_state::KeyValue, key: &str, since: i64) -> Option<String> {
    if kv.key != key || kv.mod_revision <= since {
        return None;
    }
    match typed::decode::<BatchSizeAssignment>(kv) {
        Ok(a) if a.evict => Some(evict_reason(a)),
        Ok(_) => None,
        Err(err) => {
            tracing::debug!(%err, "an assignment that does not decode");
            None
        }
    }
}

/// The store at `url`, opened however many tries it takes, pausing as `backoff` says
/// (`key` names what for, in the log).
async fn open_until_it_answers(
    url: &StoreUrl,
    key: &str,
    backoff: iadeep_state::Backoff,
) -> Arc<dyn StateStore> {
    let mut pause = backoff.first();
    loop {
        match timed("opening the state store", url.open()).await {
            Ok(store) => return store,
            Err(err) => {
                tracing::warn!(key, err = format!("{err:#}"), retry_in = ?pause,
                    "cannot open the state store to follow the job's assignment; retrying");
                tokio::time::sleep(pause).await;
                pause = backoff.after(pause);
            }
        }
    }
}

/// The spec `iadeep run` submits for the job, named `name` unless `--model` says.
fn task_spec(
    args: &RunArgs,
    task_id: &str,
    name: &str,
    lr_rule: iadeep_proto::LrScalingRule,
    class: PriorityClass,
) -> TaskSpec {
    TaskSpec {
        task_id: task_id.to_owned(),
        model: args
            .model
            .clone()
            .unwrap_or_else(|| model_name(&args.command, name)),
        initial_batch_size: args.batch_size,
        min_batch_size: args.min_batch_size.unwrap_or(0),
        max_batch_size: args.max_batch_size.unwrap_or(0),
        gpu_mem_request_mib: args.gpu_mem_mib.unwrap_or(0),
        lr_rule: lr_rule as i32,
        total_samples: args.total_samples,
        submitted_at_unix_ms: iadeep_proto::now_unix_ms(),
        priority_class: class as i32,
        max_slowdown: args.max_slowdown,
        ..Default::default()
    }
}

/// A client of the placer at `placer` (an address or URL).
async fn connect(placer: &str, tls: &PlacerTlsArgs) -> Result<PlacerClient<Channel>> {
    let endpoint = endpoint(placer);
    // Settings first: a missing CA is not an unreachable placer.
    let placer_endpoint = tls.endpoint(&endpoint)?;
    let channel = tokio::time::timeout(CALL_TIMEOUT, placer_endpoint.connect())
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {CALL_TIMEOUT:?}"))
        .and_then(|r| r.map_err(anyhow::Error::from));
    channel.map(PlacerClient::new).map_err(|err| {
        // A TLS failure is not an absent placer: say which setting to look at.
        let chain = format!("{err:#}");
        // BadSignature: an issuer of the CA's name whose key did not sign it.
        let hint = if chain.contains("UnknownIssuer") || chain.contains("BadSignature") {
            "its certificate is not signed by --placer-ca (give the CA that signed it, not \
             the placer's own certificate)"
        } else if chain.contains("NotValidForName") || chain.contains("not valid for name") {
            "its certificate names another host than the address"
        } else if chain.contains("invalid peer certificate") {
            "its certificate was refused (see the cause)"
        } else {
            "is `iadeep up` running?"
        };
        err.context(format!("cannot reach the placer at {endpoint}: {hint}"))
    })
}

/// Asks the placer until it places the task, saying why it waits meanwhile.
async fn wait_for_placement(
    client: &mut PlacerClient<Channel>,
    spec: &TaskSpec,
    args: &RunArgs,
    signals: &mut Signals,
) -> Result<Waited> {
    let started = Instant::now();
    let node = crate::local::node_name();
    let mut unavailable_since: Option<Instant> = None;
    let mut seen = wake::Snapshot::new();
    let mut candidates = std::collections::BTreeSet::new();
    let mut watch = QueueWatch::new();
    let mut said = wake::QueueLog::default();
    let mut woken = false;
    loop {
        let attempt = ask(client, spec, args, &node, &mut seen, &mut candidates);
        let hint = match attempt.await {
            Ok((devices, _, None)) => return Err(none_local(&devices, &node)),
            Ok((_, local, Some(response))) => {
                unavailable_since = None;
                match response.decision {
                    Some(place_response::Decision::Placed(placement)) => {
                        let device = placed_device(local, &placement)?;
                        return Ok(Waited::Placed(Box::new((placement, device))));
                    }
                    Some(place_response::Decision::Queued(queued)) => {
                        let asked = Instant::now();
                        watch.asked(
                            std::mem::take(&mut seen),
                            std::mem::take(&mut candidates),
                            asked,
                        );
                        let hint = Duration::from_millis(queued.retry_after_ms);
                        let wait = (queued.reason, response.explanation);
                        let next_ask = watch.next_ask(hint, asked);
                        say_wait(&mut said, wait, woken, started.elapsed(), &next_ask, asked);
                        hint
                    }
                    None => bail!("the placer answered neither placed nor queued"),
                }
            }
            Err(status) if transient(&status) => {
                let since = *unavailable_since.get_or_insert_with(Instant::now);
                tracing::warn!(code = ?status.code(), message = status.message(),
                    unreachable_s = since.elapsed().as_secs(), "the placer cannot answer now; asking again");
                Duration::from_secs(2)
            }
            Err(status) => return Err(refused(&status, args.placer.as_deref())),
        };
        let max_wait = args.max_wait_s.map(Duration::from_secs);
        if max_wait.is_some_and(|max| started.elapsed() >= max) {
            return Ok(Waited::TimedOut);
        }
        let until = max_wait.map(|max| started + max);
        match wait_or_woken(client, &mut watch, hint, until, signals).await {
            NextAsk::Signalled(sig) => return Ok(Waited::Interrupted(sig)),
            _ if until.is_some_and(|until| Instant::now() >= until) => {
                return Ok(Waited::TimedOut);
            }
            next => woken = next == NextAsk::Woken,
        }
    }
}

/// Says the placer's "wait" answer (its reason and explanation) in the log: when the
/// reason is new or was said a minute ago ([`wake::QueueLog`]), with the rejected GPUs'
/// own reasons and `next_ask`; else, after an ask that a wake caused (`woken`, which the
/// log said), that the answer stayed the same.
fn say_wait(
    said: &mut wake::QueueLog,
    (reason, explanation): (String, Option<iadeep_proto::Explanation>),
    woken: bool,
    waited: Duration,
    next_ask: &str,
    at: Instant,
) {
    let waited_s = waited.as_secs();
    match said.answer(&reason, at, woken) {
        wake::Said::Reason => {}
        wake::Said::Same => {
            tracing::info!(waited_s, "the placer still says wait, for the same reason");
            return;
        }
        wake::Said::Nothing => return,
    }
    let (summary, why) = match explanation {
        Some(e) => (
            Some(e.summary).filter(|s| !s.is_empty()),
            wake::rejections(&e.candidates, 3),
        ),
        None => (None, None),
    };
    // The summary repeats the reason with the candidates' counts.
    let summary = summary.unwrap_or(reason);
    let why = why.map(|w| format!("; {w}")).unwrap_or_default();
    tracing::info!(
        waited_s,
        "the placer says wait ({summary}{why}); {next_ask}"
    );
}

/// One ask: the placer's devices, those this machine may use (noting them in
/// `candidates`, and their room in `seen`), and the placer's answer to Place on
/// them (`None` when it lists devices but none here).
async fn ask(
    client: &mut PlacerClient<Channel>,
    spec: &TaskSpec,
    args: &RunArgs,
    node: &str,
    seen: &mut wake::Snapshot,
    candidates: &mut std::collections::BTreeSet<String>,
) -> std::result::Result<
    (
        Vec<DeviceInfo>,
        Vec<DeviceInfo>,
        Option<iadeep_proto::PlaceResponse>,
    ),
    tonic::Status,
> {
    let statuses = call("ListDevices", client.list_devices(ListDevicesRequest {}))
        .await?
        .devices;
    *seen = wake::snapshot(&statuses);
    let devices: Vec<DeviceInfo> = statuses.into_iter().filter_map(|d| d.device).collect();
    let local: Vec<DeviceInfo> = devices
        .iter()
        .filter(|d| args.any_node || crate::local::is_local(&d.node, node))
        .cloned()
        .collect();
    *candidates = local.iter().map(|d| d.device_id.clone()).collect();
    let response = if local.is_empty() && !devices.is_empty() {
        None
    } else {
        let request = PlaceRequest {
            task: Some(spec.clone()),
            candidate_device_ids: if args.any_node {
                Vec::new()
            } else {
                local.iter().map(|d| d.device_id.clone()).collect()
            },
        };
        Some(call("Place", client.place(request)).await?)
    };
    Ok((devices, local, response))
}

/// The placer's client, once the command is found, the store answers, no agent runs
/// under the task id, and the placer and the store are of one cluster. Else the exit code
/// when a check or a signal ends the run first (the checks may wait for a killed job's
/// lease; nothing is placed yet to give back).
async fn checked_client(
    args: &RunArgs,
    placer: &str,
    store: &StoreUrl,
    evictions: &mut Evictions,
    signals: &mut Signals,
) -> Result<std::result::Result<PlacerClient<Channel>, ExitCode>> {
    if let Some(code) = command_not_found(&args.command) {
        return Ok(Err(code));
    }
    let checks = async {
        evictions.reachable_and_free().await?;
        let mut client = connect(placer, &args.placer_tls).await?;
        let opened = evictions.open().await?;
        same_cluster(&mut client, opened.as_ref(), placer, store).await?;
        anyhow::Ok(client)
    };
    tokio::select! {
        checked = checks => checked.map(Ok),
        sig = signals.next() => {
            tracing::info!(signal = %sig, "interrupted before anything was placed");
            Ok(Err(ExitCode::from(128 + sig as i32 as u8)))
        }
    }
}

/// Fails when the placer and the store are of different clusters, as far as their GPUs
/// tell: the placer lists GPUs and the store holds no key of any of them (a `--store` or
/// `IADEEP_STORE` of another cluster, e.g. a shell that sourced another `cluster.env`).
/// The job would be placed, and its agent would report where no tuner reads: untuned,
/// its evictions unseen. Any key of a device counts, not only its `info`, which its
/// tuner's lease holds and a restarting tuner leaves out for a while; the residents
/// record is not leased. A heuristic: two clusters of one machine name their GPUs alike
/// (`HOST-gpuN`) and pass. A placer that lists nothing, or cannot answer now, is left to
/// the asks that follow.
async fn same_cluster(
    client: &mut PlacerClient<Channel>,
    store: &dyn StateStore,
    placer: &str,
    url: &StoreUrl,
) -> Result<()> {
    let Ok(listed) = call("ListDevices", client.list_devices(ListDevicesRequest {})).await else {
        return Ok(());
    };
    let ids: Vec<String> = listed
        .devices
        .into_iter()
        .filter_map(|d| d.device.map(|d| d.device_id))
        .collect();
    for id in &ids {
        let keys = timed(
            "reading a GPU's keys",
            store.range(&keys::device_prefix(id)),
        )
        .await?;
        if !keys.kvs.is_empty() {
            return Ok(());
        }
    }
    if ids.is_empty() {
        return Ok(());
    }
    bail!(
        "the placer at {placer} and the state store {url} are of different clusters: the \
         placer's GPUs ({}) are not in the store, so the job's agent would report where no \
         tuner reads. Give both of one cluster (`source` its cluster.env, or --placer and \
         --store)",
        ids.join(", ")
    )
}

/// The device of `placement` among this machine's, `local`.
fn placed_device(local: Vec<DeviceInfo>, placement: &Placement) -> Result<DeviceInfo> {
    match local
        .into_iter()
        .find(|d| d.device_id == placement.device_id)
    {
        Some(device) => Ok(device),
        None => bail!(
            "the placer chose {}, which it does not list among this machine's GPUs",
            placement.device_id
        ),
    }
}

/// The error when the placer lists GPUs but none on this machine.
fn none_local(devices: &[DeviceInfo], node: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "none of the placer's {} GPU(s) is on this machine ({node:?}): {}; \
         --any-node lets it choose another machine's",
        devices.len(),
        devices
            .iter()
            .map(|d| format!("{} on {:?}", d.device_id, d.node))
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// The error for a refusal the placer will not change its mind about, with a transport
/// failure's cause, e.g. the TLS alert of a placer that wants a client certificate
/// (--placer-cert).
/// `placer`: its address, to tell whether it was asked over `http://`, where a TLS
/// placer's answer is a transport error.
fn refused(status: &tonic::Status, placer: Option<&str>) -> anyhow::Error {
    let plain = placer.is_some_and(|p| endpoint(p).starts_with("http://"));
    let chain = iadeep_placer::extender::kube_api::error_chain(status);
    let cause = chain.strip_prefix(&status.to_string()).unwrap_or_default();
    // What a TLS placer's answer looks like to a plain-text HTTP/2 client: a failure of
    // the connection, not an answer. Its code and message vary with when the connection
    // broke (Unknown "h2 protocol error" or "connection error", Cancelled "operation was
    // canceled"); the chain names the transport in each.
    let transport = chain.contains("transport error") || chain.contains("h2 protocol error");
    let hint = if plain && transport {
        "\n(if the placer serves TLS, an http:// client gets this: give its address as \
         https://HOST:PORT with --placer-ca)"
    } else {
        ""
    };
    anyhow::anyhow!(
        "the placer refused the task: {} ({:?}){cause}{hint}",
        status.message(),
        status.code(),
    )
}

/// How a queued job's wait between two asks ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NextAsk {
    /// Its time to ask again came ([`QueueWatch::ask_again_after`]).
    Due,
    /// ListDevices showed a reason to ask now (a [`wake::Wake`], said in the log).
    Woken,
    /// A signal came first.
    Signalled(Signal),
}

/// Waits until it is time to ask the placer again: `hint` after the ask (or sooner:
/// [`QueueWatch::ask_again_after`]), when a poll of ListDevices shows more room on a
/// candidate GPU ([`QueueWatch::observe`]), or at `until` (the queue wait's end).
/// Returns the signal that interrupted the wait, if one did. A placer that cannot
/// answer a poll is asked again at the next one; the ask itself reports it.
async fn wait_or_woken(
    client: &mut PlacerClient<Channel>,
    watch: &mut QueueWatch,
    hint: Duration,
    until: Option<Instant>,
    signals: &mut Signals,
) -> NextAsk {
    let asked = Instant::now();
    loop {
        let now = Instant::now();
        let mut deadline = asked + watch.ask_again_after(hint, now).after;
        if let Some(until) = until {
            deadline = deadline.min(until);
        }
        if now >= deadline {
            return NextAsk::Due;
        }
        tokio::select! {
            _ = tokio::time::sleep((deadline - now).min(FREED_POLL)) => {}
            sig = signals.next() => return NextAsk::Signalled(sig),
        }
        if Instant::now() >= deadline {
            return NextAsk::Due;
        }
        match call("ListDevices", client.list_devices(ListDevicesRequest {})).await {
            Ok(list) => {
                if let Some(woke) = watch.observe(wake::snapshot(&list.devices), Instant::now()) {
                    tracing::info!(%woke, "{woke}; asking the placer again");
                    return NextAsk::Woken;
                }
            }
            Err(status) => tracing::debug!(code = ?status.code(), message = status.message(),
                "cannot list the devices; looking again at the next poll"),
        }
    }
}

/// How a start of the job ended.
struct Ran {
    status: ExitStatus,
    /// The last signal `iadeep run` got while the job ran (a job stopped by one is not
    /// restarted).
    interrupted: Option<Signal>,
    /// The last signal `iadeep run` sent the job to enforce its eviction, if it did.
    enforced: Option<Signal>,
    /// The job's processes as `iadeep run` knows them: what it signalled and adopted.
    processes: tree::Signalled,
}

/// Sends `sig` to the job: how `iadeep run` forwards SIGTERM and SIGHUP. To the job's
/// process, not a process group: the job shares `iadeep run`'s group, so that a Ctrl-C
/// at the terminal reaches it directly. (An evicted job is stopped with its whole
/// process tree instead: [`tree::Signalled`].)
fn signal_job(pid: Option<u32>, sig: Signal) {
    let Some(pid) = pid.and_then(|pid| i32::try_from(pid).ok()) else {
        return;
    };
    if let Err(err) = kill(Pid::from_raw(pid), sig) {
        tracing::warn!(%err, signal = %sig, pid, "cannot signal the job");
    }
}

/// How long `iadeep run` waits for what is left of a job it stopped (the processes it
/// signalled, once the job itself exited) to be gone after SIGKILL, before it releases
/// the GPU anyway; a process the kernel is still tearing down holds its memory.
const LEFTOVER_WAIT: Duration = Duration::from_secs(10);
/// How often it looks meanwhile.
const LEFTOVER_POLL: Duration = Duration::from_millis(50);
/// The longest `iadeep run` waits for the store to say whether an evicted job finished
/// before it signals it: the signal is due, and another job may be placed into its
/// memory soon (see `--evict-grace`), so a slow store does not hold it back.
const FINISHED_CHECK: Duration = Duration::from_secs(3);

/// Once an evicted job has exited (stopped by `iadeep run` or on its own): SIGKILL to
/// what is left of its tree (processes orphaned when the wrapper died, as Kubernetes
/// kills a container's other processes when its main one exits), then waits (at most
/// [`LEFTOVER_WAIT`]) until none runs, so that the GPU is released only once nothing of
/// the job holds it.
async fn kill_leftovers(task: &str, signalled: &mut tree::Signalled) {
    let left = signalled.signal(None, Signal::SIGKILL);
    if left == 0 {
        return;
    }
    tracing::warn!(
        task,
        processes = left,
        "the evicted job left processes behind; iadeep run sends them SIGKILL"
    );
    let until = Instant::now() + LEFTOVER_WAIT;
    loop {
        let running = signalled.still_running();
        if running.is_empty() {
            return;
        }
        if Instant::now() >= until {
            tracing::error!(task, pids = ?running,
                "processes of the stopped job still run after SIGKILL; releasing the GPU anyway");
            return;
        }
        tokio::time::sleep(LEFTOVER_POLL).await;
    }
}

/// What `iadeep run` does about the job's processes once the job exited (`ran`), before
/// the GPU is released: an evicted job's GPU is being given away, so nothing of it may
/// stay (whether it was signalled or left on its own); any other job's leftovers are
/// named, not stopped. Then the adopted processes that exited are reaped.
async fn after_exit(task: &str, ran: &mut Result<Ran>, evicted: bool, store: &mut Evictions) {
    let Ok(Ran {
        processes,
        enforced,
        ..
    }) = ran
    else {
        return;
    };
    if evicted || enforced.is_some() {
        kill_leftovers(task, processes).await;
    } else {
        warn_left_behind(task, processes);
    }
    processes.reap();
    if processes.all_gone() {
        store.agent_gone().await;
    }
}

/// Whether an `alive` key's value (`pid N`, what the agent writes) names a process that
/// no longer exists on this machine. Anything else (no pid, a pid that exists or cannot
/// be signalled) is not gone.
fn named_process_gone(value: &[u8]) -> bool {
    let pid = std::str::from_utf8(value)
        .ok()
        .and_then(|text| text.trim().strip_prefix("pid "))
        .and_then(|pid| pid.trim().parse::<i32>().ok())
        .filter(|&pid| pid > 0);
    pid.is_some_and(|pid| {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
            == Err(nix::errno::Errno::ESRCH)
    })
}

/// After a job exited on its own: names the processes it started that still run. They
/// are not stopped (a job may leave a server it meant to), but the GPU is released, so
/// any memory they hold on it is no longer reserved.
fn warn_left_behind(task: &str, signalled: &tree::Signalled) {
    let left = signalled.left_behind();
    if !left.is_empty() {
        tracing::warn!(task, pids = ?left,
            "the job exited but processes it started still run; iadeep run releases the \
             GPU, so memory they hold on it is no longer reserved");
    }
}

/// Runs the job on `device` and waits for it, forwarding SIGTERM and SIGHUP, and
/// stopping it as `enforcer` says once `evictions` saw the placer's eviction.
async fn run_job(
    command: &[String],
    launch: &Launch,
    device: &DeviceInfo,
    signals: &mut Signals,
    evictions: &mut Evictions,
    mut enforcer: enforce::Enforcer,
) -> Result<Ran> {
    let mut eviction = evictions.eviction();
    let (program, args) = command.split_first().context("no command to run")?;
    let adopting = tree::adopt_orphans();
    let mut job = tokio::process::Command::new(program);
    job.args(args)
        .envs(launch.vars())
        // NVML numbers GPUs in PCI bus order; CUDA's default order differs.
        .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        .env("CUDA_VISIBLE_DEVICES", device.index.to_string());
    let mut child = job
        .spawn()
        .with_context(|| format!("cannot start {program:?}"))?;
    let pid = child.id();
    let mut interrupted = None;
    // Until the follower of the assignment ends (it ends once it saw an eviction).
    let mut following = true;
    let adopter = pid.filter(|_| adopting).and_then(tree::Adopter::of_job);
    let mut signalled = tree::Signalled::new(adopter);
    loop {
        let deadline = enforcer.deadline();
        tokio::select! {
            // The job's exit first: one that exited on its own as a deadline came is
            // not reported as stopped by iadeep run.
            biased;
            status = child.wait() => {
                let status = status.with_context(|| format!("cannot wait for {program:?}"))?;
                return Ok(Ran { status, interrupted, enforced: enforcer.sent(), processes: signalled });
            }
            sig = signals.next() => {
                interrupted = Some(sig);
                // SIGINT is not sent on: a Ctrl-C at the terminal, or a signal to the
                // process group, reached the job already, and a second KeyboardInterrupt
                // would break its clean-up. Only what reached `iadeep run` alone is missed.
                if sig == Signal::SIGINT && tree::in_terminal_foreground() {
                    tracing::info!("Ctrl-C: the job got it too from the terminal; waiting for it \
                        to exit");
                } else if sig == Signal::SIGINT {
                    tracing::info!(pid, "SIGINT: not sent on to the job (one sent to the \
                        process group reached it already, and a second would interrupt its \
                        clean-up); waiting for it to exit. If it went to iadeep run alone, the \
                        job did not get it: send SIGTERM, which iadeep run forwards");
                } else {
                    tracing::info!(signal = %sig, pid, "forwarding to the job");
                    signal_job(pid, sig);
                }
            }
            changed = eviction.changed(), if following => {
                if changed.is_err() {
                    following = false;
                    continue;
                }
                let reason = eviction.borrow_and_update().clone();
                if let Some(reason) = reason
                    && enforcer.evicted(tokio::time::Instant::now())
                {
                    let grace = humantime::format_duration(enforcer.grace());
                    tracing::warn!(task = %launch.task_id, %reason, pid,
                        "the placer evicted the job: it has {grace} (--evict-grace) to checkpoint \
                         and exit; iadeep run stops it then");
                }
            }
            () = tokio::time::sleep_until(deadline.unwrap_or_else(tokio::time::Instant::now)),
                if deadline.is_some() =>
            {
                let stopping = Stopping { task_id: &launch.task_id, pid };
                stopping.at_deadline(&mut enforcer, evictions, &mut signalled).await;
            }
        }
    }
}

/// The job `iadeep run` may have to stop for its eviction: its task and process.
struct Stopping<'a> {
    task_id: &'a str,
    pid: Option<u32>,
}

impl Stopping<'_> {
    /// At an enforcement deadline: spares a job whose last report says it finished (it
    /// is writing its outputs), else sends the signal due to it and its process tree.
    async fn at_deadline(
        &self,
        enforcer: &mut enforce::Enforcer,
        evictions: &mut Evictions,
        signalled: &mut tree::Signalled,
    ) {
        let (task_id, pid) = (self.task_id, self.pid);
        let finished = tokio::time::timeout(FINISHED_CHECK, evictions.finished())
            .await
            .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {FINISHED_CHECK:?}")));
        match finished {
            Ok(true) => {
                enforcer.spare();
                tracing::info!(task = %task_id, pid,
                    "the evicted job has not exited, but its last report says it \
                     finished its work (it is writing its outputs); not stopping it");
                return;
            }
            Ok(false) => {}
            // The GPU is at stake: stopped as if it had not finished.
            Err(err) => tracing::warn!(task = %task_id, err = format!("{err:#}"),
                "cannot read whether the evicted job finished its work; stopping it"),
        }
        let Some(sig) = enforcer.due(tokio::time::Instant::now()) else {
            return;
        };
        let job = pid.and_then(|pid| i32::try_from(pid).ok());
        let others = signalled.signal(job, sig);
        tracing::warn!(task = %task_id, signal = %sig, pid, processes = others,
            "the evicted job has not exited; iadeep run sends {sig} to it and the \
             {others} process(es) it started");
    }
}

/// Gives the task's placement back. `placed`: the job ran on it, so the release is tried
/// three times and a failure said at warn level. Otherwise (the run stops queued, or its
/// ask failed) a placement can exist only if a Place committed without its answer
/// arriving, as when a slow placer's answer came after the call's timeout: a timed-out
/// release is tried again then, any other failure ends it at once and quietly (a
/// placer that cannot be reached at all would make the failure that brought the run
/// here look like a lost placement). Returns whether the placement is gone now:
/// released, or the placer had none (false when no try got an answer).
async fn release(client: &mut PlacerClient<Channel>, task_id: &str, placed: bool) -> bool {
    for attempt in 1..=3 {
        let request = ReleaseRequest {
            task_id: task_id.to_owned(),
        };
        match call("Release", client.release(request)).await {
            Ok(answer) if answer.released => {
                tracing::info!(task = task_id, device = %answer.device_id, "placement released");
                return true;
            }
            Ok(_) if placed => {
                // Said, so a run's log always ends by saying its GPU is free again.
                tracing::info!(
                    task = task_id,
                    "the placement was released already (by the placer, once the job's agent \
                     finished or went)"
                );
                return true;
            }
            Ok(_) => {
                tracing::debug!(task = task_id, "never placed: nothing to release");
                return true;
            }
            Err(status) if placed || status.code() == tonic::Code::DeadlineExceeded => {
                if placed {
                    tracing::warn!(task = task_id, attempt, code = ?status.code(),
                        message = status.message(), "cannot release the placement");
                } else {
                    tracing::debug!(
                        task = task_id,
                        attempt,
                        message = status.message(),
                        "the release of a task perhaps placed timed out"
                    );
                }
                if attempt < 3 {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
            Err(status) => {
                tracing::debug!(task = task_id, code = ?status.code(), message = status.message(),
                    "no release of a task never placed for this run");
                return false;
            }
        }
    }
    if placed {
        tracing::warn!(
            task = task_id,
            "placement not released; the placer gives the GPU back after its grace period"
        );
    } else {
        tracing::info!(
            task = task_id,
            "the placer did not answer in time; had it placed the task, it gives the GPU back \
             after its grace period"
        );
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a key naming a process that is gone is deleted: not one naming a live
    /// process (this one), nor one that names none.
    #[test]
    fn an_alive_key_names_a_gone_process_only_by_a_pid_that_is_gone() {
        let mut exited = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let gone = exited.id();
        exited.wait().expect("reaped");
        assert!(named_process_gone(format!("pid {gone}").as_bytes()));
        assert!(!named_process_gone(
            format!("pid {}", std::process::id()).as_bytes()
        ));
        for other in ["", "x", "pid", "pid 0", "pid -1", "pid 12ab"] {
            assert!(!named_process_gone(other.as_bytes()), "{other:?}");
        }
    }

    /// `iadeep run`'s arguments as a command of their own, to parse them.
    #[derive(clap::Parser)]
    struct Run {
        #[command(flatten)]
        run: RunArgs,
    }

    /// `iadeep run ARGS -- python train.py`, parsed.
    fn run_args(args: &[&str]) -> RunArgs {
        let command = [
            "iadeep-run",
            "--placer",
            "127.0.0.1:1",
            "--store",
            "memory:",
        ];
        let all = command
            .iter()
            .chain(args)
            .chain(&["--", "python", "train.py"]);
        <Run as clap::Parser>::try_parse_from(all)
            .expect("parses")
            .run
    }

    /// The command after `--`, or without it from its first word on (a user who forgot
    /// the `--` got only "unexpected argument"): the command's own flags stay its own.
    #[test]
    fn the_command_is_everything_from_its_first_word() {
        let parse = |args: &[&str]| {
            <Run as clap::Parser>::try_parse_from(
                ["iadeep-run", "--batch-size", "8"].iter().chain(args),
            )
            .map(|r| r.run.command)
        };
        let job = ["python", "x.py", "--batch-size", "3", "--", "-v"];
        assert_eq!(parse(&job).expect("parses"), job);
        let with_dashes = ["--", "python", "x.py", "--batch-size", "3"];
        assert_eq!(parse(&with_dashes).expect("parses"), with_dashes[1..]);
        assert!(
            parse(&["--bogus", "--", "true"]).is_err(),
            "a mistyped flag of iadeep run is not the command"
        );
    }

    /// A command that is not there (no executable file at its path, or none of that name
    /// on PATH) is named before the placer is asked.
    #[test]
    fn a_command_that_cannot_run_is_named_before_placing() {
        let cmd = |parts: &[&str]| parts.iter().map(|p| p.to_string()).collect::<Vec<_>>();
        assert_eq!(missing_program(&cmd(&["sh", "-c", "true"])), None);
        assert_eq!(missing_program(&cmd(&["/bin/sh"])), None);
        assert_eq!(
            missing_program(&cmd(&["no-such-program-iadeep", "x"])).as_deref(),
            Some("no-such-program-iadeep")
        );
        assert_eq!(
            missing_program(&cmd(&["/nonexistent/prog"])).as_deref(),
            Some("/nonexistent/prog")
        );
        // A directory, and a file without the execute bit, do not run either.
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = dir.path().join("train.py");
        std::fs::write(&plain, "print()").expect("write");
        for path in [dir.path(), plain.as_path()] {
            let path = path.to_str().expect("UTF-8").to_owned();
            assert_eq!(missing_program(std::slice::from_ref(&path)), Some(path));
        }
    }

    /// A task id the store would refuse is refused as an argument, before the placer is
    /// asked (the trial's `bad/id` was placed-then-released three times first).
    #[test]
    fn a_bad_task_id_is_refused_as_an_argument() {
        let parse = |id: &str| {
            <Run as clap::Parser>::try_parse_from([
                "iadeep-run",
                "--batch-size",
                "8",
                "--task-id",
                id,
                "--",
                "true",
            ])
            .map(|r| r.run.task_id)
        };
        let err = parse("bad/id").expect_err("refused").to_string();
        assert!(err.contains("may only contain"), "{err}");
        assert!(err.contains("--task-id"), "{err}");
        assert_eq!(
            parse("job-1.a:b").expect("parses"),
            Some("job-1.a:b".into())
        );
    }

    /// Batch sizes that cannot work are refused before the cluster is asked, naming the
    /// flags; sizes that can are let through.
    #[test]
    fn batch_sizes_are_checked_naming_the_flags() {
        let refused = |args: &[&str]| {
            check_batch_sizes(&run_args(args))
                .expect_err("refused")
                .to_string()
        };
        assert!(refused(&["--batch-size", "0"]).starts_with("--batch-size 0:"));
        assert!(
            refused(&["--batch-size", "8", "--min-batch-size", "0"])
                .starts_with("--min-batch-size 0:")
        );
        assert_eq!(
            refused(&[
                "--batch-size",
                "64",
                "--min-batch-size",
                "512",
                "--max-batch-size",
                "16"
            ]),
            "--min-batch-size 512 is larger than --max-batch-size 16"
        );
        assert!(
            refused(&["--batch-size", "64", "--min-batch-size", "128"]).contains("--batch-size 64")
        );
        assert!(
            refused(&["--batch-size", "64", "--max-batch-size", "32"]).contains("--batch-size 64")
        );
        for fine in [
            &["--batch-size", "64"][..],
            &[
                "--batch-size",
                "64",
                "--min-batch-size",
                "16",
                "--max-batch-size",
                "512",
            ],
            &[
                "--batch-size",
                "64",
                "--min-batch-size",
                "64",
                "--max-batch-size",
                "64",
            ],
        ] {
            assert!(check_batch_sizes(&run_args(fine)).is_ok(), "{fine:?}");
        }
    }

    #[test]
    fn the_job_is_named_after_its_script() {
        let dir = tempfile::tempdir().expect("tempdir");
        let script = dir.path().join("train_mnist.py");
        std::fs::write(&script, "").expect("script");
        let command = vec![
            "python3".to_owned(),
            "-u".to_owned(),
            script.display().to_string(),
        ];
        assert_eq!(job_name(&command), "train_mnist");
        assert_eq!(job_name(&["./train.sh".to_owned()]), "train");
        let words = |text: &str| text.split(' ').map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(model_name(&command, "train_mnist"), "train_mnist");
        for (command, model) in [
            ("python train.py --model resnet50 --epochs 3", "resnet50"),
            ("python train.py --model=vit_b --epochs 3", "vit_b"),
            ("iadeep emulate-job --model cifar10", "cifar10"),
            ("python train.py --models a --model", "train"),
            ("python train.py --model --epochs 3", "train"),
            ("sh -c x -- --model m", "train"),
            ("python train.py --model /ckpt/run3/resnet.pt", "resnet"),
            ("python train.py --model facebook/opt-1.3b", "opt-1.3b"),
            ("python train.py --model Qwen/Qwen2.5-0.5B", "Qwen2.5-0.5B"),
        ] {
            assert_eq!(model_name(&words(command), "train"), model, "{command}");
        }
        let id = default_task_id("my job/1");
        assert!(id.starts_with("my-job-1-"), "{id}");
        assert!(iadeep_state::keys::validate_id("task", &id).is_ok(), "{id}");
    }

    /// Evictions over an in-memory store, placed (its revision noted, its watch started).
    async fn placed(store: &Arc<dyn StateStore>, task: &str) -> Evictions {
        let url: StoreUrl = "etcd://127.0.0.1:1".parse().expect("url");
        let mut evictions = Evictions::new(url, task);
        evictions.store = Some(store.clone());
        evictions.placed().await;
        evictions
    }

    async fn put_assignment(store: &Arc<dyn StateStore>, key: &str, round: u64, evict: bool) {
        let a = BatchSizeAssignment {
            task_id: "t".into(),
            batch_size: 64,
            lr_factor: 1.0,
            round,
            evict,
            evict_reason: if evict {
                "prod-1 above its cap".into()
            } else {
                String::new()
            },
            ..Default::default()
        };
        typed::put(store.as_ref(), key, &a, None)
            .await
            .expect("put");
    }

    /// Only an eviction written since this run was placed is this run's (not one an
    /// earlier run left archived); one a tuner overwrote before the job exited still
    /// counts (the watch saw it); a job that finished its work is not restarted.
    #[tokio::test]
    async fn only_this_runs_eviction_counts_even_one_overwritten_and_not_once_finished() {
        let store: Arc<dyn StateStore> =
            Arc::new(iadeep_state::EmbeddedStore::in_memory().expect("store"));
        let task = "t";
        put_assignment(&store, &keys::archived_assignment(task), 3, true).await;
        let mut evictions = placed(&store, task).await;
        assert_eq!(evictions.evicted().await, None, "an earlier run's eviction");

        let mut evictions = placed(&store, task).await;
        put_assignment(&store, &keys::task_assignment(task), 4, true).await;
        put_assignment(&store, &keys::task_assignment(task), 5, false).await;
        // A guard against a hang, not a timing: the wait ends on the publication.
        tokio::time::timeout(
            Duration::from_secs(30),
            evictions.seen.clone().wait_for(Option::is_some),
        )
        .await
        .expect("the follower saw the eviction")
        .expect("the follower published before ending");
        assert_eq!(
            evictions.evicted().await.as_deref(),
            Some("prod-1 above its cap")
        );

        let mut evictions = placed(&store, task).await;
        put_assignment(&store, &keys::archived_assignment(task), 6, true).await;
        let finished = TaskReport {
            task_id: task.into(),
            finished: true,
            ..Default::default()
        };
        typed::put(
            store.as_ref(),
            &keys::archived_report(task),
            &finished,
            None,
        )
        .await
        .expect("put");
        assert_eq!(evictions.evicted().await, None, "it finished its work");
        typed::put(
            store.as_ref(),
            &keys::archived_report(task),
            &TaskReport::default(),
            None,
        )
        .await
        .expect("put");
        assert!(evictions.evicted().await.is_some(), "read from the archive");
    }

    /// An eviction committed between Place's commit and the read after it is this
    /// run's: it counts from the placement's own revision, not from the read's.
    #[tokio::test]
    async fn an_eviction_right_after_place_counts() {
        let store: Arc<dyn StateStore> =
            Arc::new(iadeep_state::EmbeddedStore::in_memory().expect("store"));
        let task = "t";
        let placement = Placement {
            task_id: task.into(),
            device_id: "gpu-0".into(),
            ..Default::default()
        };
        typed::put(
            store.as_ref(),
            &keys::task_placement(task),
            &placement,
            None,
        )
        .await
        .expect("put");
        put_assignment(&store, &keys::task_assignment(task), 1, false).await;
        // The placer evicts it before `iadeep run` has read the store.
        put_assignment(&store, &keys::task_assignment(task), 2, true).await;
        let mut evictions = placed(&store, task).await;
        assert_eq!(
            evictions.evicted().await.as_deref(),
            Some("prod-1 above its cap")
        );
    }

    /// A follower that could not read the placement's revision (the store did not
    /// answer then) starts from the assignment as it is: an eviction written since the
    /// last revision known is published, an older one is not (the next one is).
    #[tokio::test]
    async fn a_follower_started_without_the_placement_revision_reads_the_assignment_first() {
        let store: Arc<dyn StateStore> =
            Arc::new(iadeep_state::EmbeddedStore::in_memory().expect("store"));
        let key = keys::task_assignment("t");
        put_assignment(&store, &key, 1, true).await;
        let old = store.range(&key).await.expect("range").revision;
        let url: StoreUrl = "etcd://127.0.0.1:1".parse().expect("url");
        let follow = |since| {
            let (publish, seen) = tokio::sync::watch::channel(None);
            let follower = Follower {
                url: url.clone(),
                store: Some(store.clone()),
                since,
                watch_from_since: false,
            };
            (
                tokio::spawn(follower.publish_eviction(key.clone(), publish)),
                seen,
            )
        };
        // A guard against a hang, not a timing: each wait ends on a publication.
        let published = |mut seen: tokio::sync::watch::Receiver<Option<String>>| async move {
            tokio::time::timeout(Duration::from_secs(30), seen.wait_for(Option::is_some))
                .await
                .expect("published")
                .expect("the follower published before ending")
                .clone()
        };

        let (_task, seen) = follow(old - 1);
        assert_eq!(
            published(seen).await.as_deref(),
            Some("prod-1 above its cap")
        );
        let kv = store.get(&key).await.expect("get").expect("the assignment");
        assert_eq!(kv.mod_revision, old);
        assert_eq!(eviction_since(&kv, &key, old), None, "an earlier run's");
        assert_eq!(eviction_since(&kv, "other", old - 1), None);

        let (_task, seen) = follow(old);
        let later = BatchSizeAssignment {
            task_id: "t".into(),
            evict: true,
            evict_reason: "a later eviction".into(),
            ..Default::default()
        };
        typed::put(store.as_ref(), &key, &later, None)
            .await
            .expect("put");
        assert_eq!(
            published(seen).await.as_deref(),
            Some("a later eviction"),
            "not the earlier run's"
        );
    }

    /// Once the eviction was seen, a report that cannot be read after the exit does not
    /// turn the eviction into a final exit (137 or 143 of a job iadeep run stopped); with
    /// no eviction seen, the exit is final.
    #[test]
    fn a_failed_read_after_a_seen_eviction_still_requeues() {
        let failed = || Err(anyhow::anyhow!("no answer"));
        assert_eq!(
            evicted_after_read("t", Some("prod-1".into()), failed()).as_deref(),
            Some("prod-1")
        );
        assert_eq!(evicted_after_read("t", None, failed()), None);
        assert_eq!(
            evicted_after_read("t", Some("prod-1".into()), Ok(None)),
            None,
            "a read that says finished stands"
        );
    }

    /// An evicted job is queued again only once its placement is gone: Place would
    /// answer the evicted placement otherwise. Then the exit code is its own.
    #[test]
    fn an_unreleased_eviction_is_not_requeued() {
        assert_eq!(after_eviction(true, 0, 10, true), AfterEviction::Requeue);
        assert_eq!(
            after_eviction(true, 0, 10, false),
            AfterEviction::NotReleased
        );
        assert_eq!(after_eviction(false, 0, 10, false), AfterEviction::Exit);
        assert_eq!(after_eviction(true, 10, 10, true), AfterEviction::Exit);
        assert_ne!(EVICTED_NOT_REQUEUED_EXIT, QUEUE_TIMEOUT_EXIT);
        assert_ne!(EVICTED_NOT_REQUEUED_EXIT, crate::emulate_cmd::EVICTED_EXIT);
    }

    #[test]
    fn a_bare_address_gets_a_scheme() {
        assert_eq!(endpoint("127.0.0.1:50061"), "http://127.0.0.1:50061");
        assert_eq!(endpoint("http://h:1"), "http://h:1");
    }
}
