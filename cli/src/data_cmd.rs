//! `iadeep data`: turn public measurements into iadeep's own formats.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use iadeep_datasets::gavel::GavelThroughputs;
use iadeep_eval::samples_from_gavel;
use iadeep_predictor::jsonl::SampleLine;

#[derive(Debug, Args)]
pub struct DataArgs {
    #[command(subcommand)]
    command: DataCommand,
}

#[derive(Debug, Subcommand)]
enum DataCommand {
    /// Write co-location samples (JSON Lines, the format `iadeep predictor eval`
    /// reads) from a Gavel throughput file to stdout.
    ///
    /// Each ordered pair of jobs that ran together on one GPU of WORKER_TYPE gives
    /// one sample: slowdown = solo steps/s ÷ co-located steps/s of the first job.
    /// Failed pairs (out of memory) are skipped and counted on stderr. Gavel has no
    /// utilisation or memory measurements, so those fields are omitted (unknown).
    /// The repository bundles Gavel's K80/P100 file as
    /// data/gavel/throughputs-k80-p100.json.
    GavelPairs {
        /// Gavel throughput file (JSON).
        file: PathBuf,
        /// Worker type to read, e.g. k80 or p100; also written as each sample's device.
        #[arg(long, value_name = "T")]
        worker_type: String,
    },
}

pub fn run(args: DataArgs) -> Result<ExitCode> {
    match args.command {
        DataCommand::GavelPairs { file, worker_type } => gavel_pairs(&file, &worker_type),
    }
}

fn gavel_pairs(file: &std::path::Path, worker_type: &str) -> Result<ExitCode> {
    let gavel = GavelThroughputs::from_path(file)?;
    let worker = gavel.worker(worker_type)?;
    let out = samples_from_gavel(worker, worker_type);
    let stdout = std::io::stdout();
    let mut lock = std::io::BufWriter::new(stdout.lock());
    for sample in &out.samples {
        let Some(line) = SampleLine::from_sample(sample) else {
            continue;
        };
        serde_json::to_writer(&mut lock, &line).context("cannot encode a sample")?;
        lock.write_all(b"\n").context("cannot write to stdout")?;
    }
    lock.flush().context("cannot write to stdout")?;
    tracing::info!(
        worker_type,
        samples = out.samples.len(),
        failed_pairs = out.failed,
        unusable_pairs = out.unusable,
        "wrote Gavel co-location samples"
    );
    Ok(ExitCode::SUCCESS)
}
