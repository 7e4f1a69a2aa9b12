//! `iadeep`: the command operators and orchestrators run.
//!
//! One binary, one subcommand per job. Each subcommand lives in its own module
//! (`demo` shares `sim_cmd` with `sim`);
//! this file only parses the command line, sets up logging and reports errors.

#[macro_use]
mod output;
mod codec;
mod data_cmd;
mod emulate_cmd;
mod ended;
mod local;
mod memory_cmd;
mod placer_cmd;
mod predictor_cmd;
mod progress;
mod run_cmd;
mod signals;
mod sim_cmd;
mod state_cmd;
mod status_cmd;
mod tls_args;
mod tuner_cmd;
mod up_cmd;

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use iadeep_state::{StateStore, StoreUrl};

/// iadeep lets several deep-learning training jobs share one GPU without hurting
/// each other: it places each new job where it causes the least slowdown and tunes
/// the batch size of every co-located job.
///
/// Logs go to stderr; set RUST_LOG (e.g. RUST_LOG=debug) for more detail.
#[derive(Debug, Parser)]
#[command(name = "iadeep", version, about, long_about, propagate_version = true)]
struct Cli {
    /// Log lines as text (coloured only when stderr is a terminal and NO_COLOR is
    /// unset) or as one JSON object per line, for log collectors.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text,
        env = "IADEEP_LOG_FORMAT", value_name = "FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Where the cluster state lives; shared by every subcommand that needs it.
#[derive(Debug, Clone, clap::Args)]
pub struct StoreArgs {
    /// The state store. An etcd cluster: `etcd://HOST:PORT[,HOST:PORT...]` (every
    /// member, so requests move when one is lost), `etcds://...?ca=PATH&cert=PATH&key=PATH`
    /// for TLS, `USER:PASSWORD@` before the hosts for etcd's authentication (prefer
    /// IADEEP_STORE to keep the password off the command line). Or the embedded
    /// single-machine store (one process at a time): a file path containing '/' or
    /// ending in .redb, or `file:PATH`. A bare `HOST:PORT` is refused as ambiguous.
    /// Default: the embedded store under the user's data directory
    /// (e.g. ~/.local/share/iadeep/state.redb).
    #[arg(long, global = true, env = "IADEEP_STORE", value_name = "URL")]
    store: Option<StoreUrl>,
}

impl StoreArgs {
    /// The URL given, or the default embedded store.
    pub fn url(&self) -> StoreUrl {
        self.store
            .clone()
            .unwrap_or_else(StoreUrl::default_embedded)
    }
}

/// Longest wait for a TCP connection to one etcd endpoint before saying it is unreachable.
const ETCD_REACH_TIMEOUT: Duration = Duration::from_secs(3);

/// Opens the store at `url`. An etcd nobody answers at is reported in plain words
/// (which endpoint, what the operating system said) before the client library gets
/// to wrap the failure in its own terms.
pub async fn open_store(url: &StoreUrl) -> anyhow::Result<Arc<dyn StateStore>> {
    reach(url).await?;
    url.open()
        .await
        .with_context(|| format!("cannot open the state store {url}"))
}

/// Says at a daemon's start when the etcd behind `url` has a known bug that costs its
/// clients their leases ([`iadeep_state::EtcdStore::lease_bug_warning`]): nothing else
/// tells an operator which etcd the cluster runs.
pub async fn warn_of_etcd_bugs(url: &StoreUrl) {
    let StoreUrl::Etcd(config) = url else {
        return;
    };
    if let Ok(store) = iadeep_state::EtcdStore::connect_with(config).await
        && let Some(warning) = store.lease_bug_warning().await
    {
        tracing::warn!("{warning}");
    }
}

/// [`open_store`] for commands that only read: an embedded store file is opened read-only,
/// never created, repaired or rewritten.
pub async fn open_store_read_only(url: &StoreUrl) -> anyhow::Result<Arc<dyn StateStore>> {
    reach(url).await?;
    url.open_read_only().await.with_context(|| {
        // Most often a shell that has not read the cluster's settings yet.
        let hint = if *url == StoreUrl::default_embedded() {
            " (the default, as neither --store nor IADEEP_STORE is set; for the cluster \
             `iadeep up` started, `source DIR/cluster.env` first)"
        } else {
            ""
        };
        format!("cannot open the state store {url}{hint}")
    })
}

/// Fails with a human message when no etcd member of `url` answers on TCP.
async fn reach(url: &StoreUrl) -> anyhow::Result<()> {
    if let StoreUrl::Etcd(config) = url {
        let mut failures = Vec::new();
        for endpoint in &config.endpoints {
            match tokio::time::timeout(ETCD_REACH_TIMEOUT, tokio::net::TcpStream::connect(endpoint))
                .await
            {
                Ok(Ok(_)) => {
                    failures.clear();
                    break;
                }
                Ok(Err(err)) => failures.push(format!("{endpoint}: {err}")),
                Err(_) => failures.push(format!(
                    "{endpoint}: no answer within {} s",
                    ETCD_REACH_TIMEOUT.as_secs()
                )),
            }
        }
        if !failures.is_empty() {
            anyhow::bail!(
                "cannot reach etcd ({}); is it running, and is --store (or IADEEP_STORE) right?",
                failures.join("; ")
            );
        }
    }
    Ok(())
}

#[derive(Debug, Subcommand)]
enum Command {
    // `up` and `run` take their help from their argument structs (a paragraph each).
    Up(Box<up_cmd::UpArgs>),
    Run(Box<run_cmd::RunArgs>),
    /// Read, write and watch the cluster state directly (for operators).
    State(state_cmd::StateArgs),
    /// Every GPU and job at a glance: memory, batch sizes, PD, the tuner (`--watch`, `--json`).
    Status(status_cmd::StatusArgs),
    /// Run the placement service (gRPC, Kubernetes scheduler extender, metrics),
    /// or benchmark it with `iadeep placer bench-client`.
    Placer(Box<placer_cmd::PlacerArgs>),
    /// Simulate a GPU cluster on measured data and compare scheduling policies.
    Sim(sim_cmd::SimArgs),
    /// The one-command demo: 300 jobs on 20 simulated GPUs, every policy, bundled data.
    Demo(sim_cmd::DemoArgs),
    /// Run an emulated training job (measured step times, real agent) for tuner tests.
    EmulateJob(emulate_cmd::EmulateArgs),
    /// Per-task GPU memory model tools (e.g. `memory eval`).
    Memory(memory_cmd::MemoryArgs),
    /// The per-GPU batch-size tuner daemon (`tuner --device ID`), and `tuner bench`.
    Tuner(tuner_cmd::TunerArgs),
    /// Convert public measurements into iadeep's formats (e.g. Gavel pairs to samples).
    Data(data_cmd::DataArgs),
    /// Evaluate the co-location slowdown predictor.
    Predictor(predictor_cmd::PredictorArgs),
}

impl Command {
    /// The log filter used when RUST_LOG is not set.
    ///
    /// A simulation runs the real tuner and predictor thousands of times; their
    /// per-search info lines, right for a daemon, would bury the result table, so
    /// simulations show only the simulator's own progress and warnings. The tuner's
    /// warnings are left out too: in a simulation each one is a simulated event (a
    /// job ran out of memory) that the table counts, and they came by the thousand
    /// (2,320 for the demo's iadeep policy alone, 19,199 for the README's `iadeep sim`).
    /// The placer's load test likewise keeps the in-process placer to its warnings: one
    /// info line per Place is 20,000 lines before the summary.
    fn default_log_filter(&self) -> &'static str {
        match self {
            Command::Sim(_) | Command::Demo(_) => {
                "warn,iadeep_tuner=error,iadeep_sim=info,iadeep::sim_cmd=info,iadeep::progress=info"
            }
            Command::Placer(args) if args.is_benchmark() => "info,iadeep_placer=warn",
            _ => "info",
        }
    }
}

fn init_logging(default_filter: &str, format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(progress::LogWriter);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => {
            // Colour codes are for people at a terminal, not for files and pipes.
            let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            builder.with_ansi(ansi).init();
        }
    }
}

/// Whether `err` comes from writing to a closed pipe (`iadeep state ls | head`).
fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// `err` and its causes as one line, `a: b: c`, as anyhow's `{:#}` writes it, but
/// without a cause whose text the line already ends with: some libraries (NVML's
/// loader, hyper's connect errors) print their source in their own message too, which
/// would show it twice (`cannot open shared object file ...: cannot open shared object
/// file ...`).
fn error_line(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if text.is_empty() || line.ends_with(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.command.default_log_filter(), cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Up(args) => up_cmd::run(*args).await,
            Command::Run(args) => run_cmd::run(*args).await,
            Command::State(args) => state_cmd::run(args).await,
            Command::Status(args) => status_cmd::run(args).await,
            Command::Placer(args) => placer_cmd::run(*args).await,
            Command::Sim(args) => sim_cmd::run_sim(args),
            Command::Demo(args) => sim_cmd::run_demo(args).await,
            Command::EmulateJob(args) => emulate_cmd::run(args).await,
            Command::Memory(args) => memory_cmd::run(args),
            Command::Tuner(args) => tuner_cmd::run(args).await,
            Command::Data(args) => data_cmd::run(args),
            Command::Predictor(args) => predictor_cmd::run(args),
        }
    });
    match result {
        Ok(code) => code,
        // The reader has all it wanted: stop quietly, as `cat` and `grep` do.
        Err(err) if is_broken_pipe(&err) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {}", error_line(&err));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::error_line;

    /// A library error that prints its source inside its own message.
    #[derive(Debug)]
    struct Wrapping(std::io::Error);

    impl std::fmt::Display for Wrapping {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a libloading error occurred: {}", self.0)
        }
    }

    impl std::error::Error for Wrapping {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_already_in_the_line_is_not_repeated() {
        let io = std::io::Error::other("libnvidia-ml.so.1: cannot open shared object file");
        let err = anyhow::Error::new(Wrapping(io)).context("NVML is not available");
        assert_eq!(
            error_line(&err),
            "NVML is not available: a libloading error occurred: \
             libnvidia-ml.so.1: cannot open shared object file"
        );
        let plain = anyhow::anyhow!("no answer").context("cannot reach the placer");
        assert_eq!(error_line(&plain), format!("{plain:#}"));
    }
}
