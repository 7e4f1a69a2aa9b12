//! `iadeep`: the command operators and orchestrators run.
//!
//! One binary, one subcommand per job. Each subcommand lives in its own module;
//! this file only parses the command line, sets up logging and reports errors.

mod codec;
mod data_cmd;
mod emulate_cmd;
mod local;
mod memory_cmd;
mod placer_cmd;
mod predictor_cmd;
mod run_cmd;
mod signals;
mod sim_cmd;
mod state_cmd;
mod tuner_cmd;
mod up_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use iadeep_state::StoreUrl;

/// iadeep lets several deep-learning training jobs share one GPU without hurting
/// each other: it places each new job where it causes the least slowdown and tunes
/// the batch size of every co-located job.
///
/// Logs go to stderr; set RUST_LOG (e.g. RUST_LOG=debug) for more detail.
#[derive(Debug, Parser)]
#[command(name = "iadeep", version, about, long_about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where the cluster state lives; shared by every subcommand that needs it.
#[derive(Debug, Clone, clap::Args)]
pub struct StoreArgs {
    /// The state store: `etcd://HOST:PORT[,HOST:PORT...]` for an etcd cluster, or a
    /// file path for the embedded single-machine store (one process at a time).
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

#[derive(Debug, Subcommand)]
enum Command {
    // `up` and `run` take their help from their argument structs (a paragraph each).
    Up(Box<up_cmd::UpArgs>),
    Run(Box<run_cmd::RunArgs>),
    /// Read, write and watch the cluster state directly (for operators).
    State(state_cmd::StateArgs),
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
    /// simulations show only the simulator's own progress and warnings.
    fn default_log_filter(&self) -> &'static str {
        match self {
            Command::Sim(_) | Command::Demo(_) => "warn,iadeep_sim=info,iadeep::sim_cmd=info",
            _ => "info",
        }
    }
}

fn init_logging(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.command.default_log_filter());
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
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
