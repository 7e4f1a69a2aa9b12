//! `iadeep predictor`: evaluate the co-location predictor offline.

use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use iadeep_predictor::LearnerParams;
use iadeep_predictor::jsonl::read_samples;
use iadeep_predictor::prequential::{EARLY_START, LATE_START, Mape, evaluate};

#[derive(Debug, Args)]
pub struct PredictorArgs {
    #[command(subcommand)]
    command: PredictorCommand,
}

#[derive(Debug, Subcommand)]
enum PredictorCommand {
    /// Prequential evaluation on a JSON Lines samples file, ours against the
    /// reference (a forest on one-hot job names).
    ///
    /// For each seed the samples are shuffled; each sample is predicted before it
    /// is learned, and both models refit on the production cadence. Prints the mean
    /// absolute percentage error over samples 100..135 (0-based) and from 135 on,
    /// averaged over seeds. Malformed lines are reported with their line number and
    /// skipped.
    Eval {
        /// Samples file (JSON Lines, e.g. from `iadeep data gavel-pairs`).
        samples: PathBuf,
        /// Number of shuffles (seeds 0..N).
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
        seeds: u64,
        /// Print one JSON object on the last line:
        /// {"samples": N, "ours": {"mape_100_135": x, "mape_from_135": y}, "reference": {...}}.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(args: PredictorArgs) -> Result<ExitCode> {
    match args.command {
        PredictorCommand::Eval {
            samples,
            seeds,
            json,
        } => eval(&samples, seeds, json),
    }
}

fn fmt(value: Option<f64>) -> String {
    value.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.4}"))
}

fn spread(m: &Mape, early: bool) -> String {
    let values: Vec<f64> = m
        .per_seed
        .iter()
        .filter_map(|p| if early { p.0 } else { p.1 })
        .collect();
    if values.is_empty() {
        return String::new();
    }
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!(" [{lo:.4}..{hi:.4}]")
}

fn eval(path: &std::path::Path, seeds: u64, json: bool) -> Result<ExitCode> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let (samples, errors) = read_samples(BufReader::new(file))
        .with_context(|| format!("cannot read {}", path.display()))?;
    for err in &errors {
        tracing::warn!("{}: {err}; line skipped", path.display());
    }
    if samples.is_empty() {
        bail!("{}: no valid samples", path.display());
    }
    if samples.len() <= EARLY_START {
        tracing::warn!(
            samples = samples.len(),
            "fewer than {} samples: the MAPE windows are empty",
            EARLY_START + 1
        );
    }
    let params = LearnerParams::default();
    tracing::info!(
        samples = samples.len(),
        skipped = errors.len(),
        seeds,
        ?params,
        "prequential evaluation"
    );
    let report = evaluate(&samples, seeds, &params)?;
    if !json {
        println!(
            "{} samples, {} seeds; MAPE mean over seeds [min..max]",
            report.samples, seeds
        );
        println!(
            "{:<10} {:>28} {:>28}",
            "approach",
            format!("samples {EARLY_START}..{LATE_START}"),
            format!("samples {LATE_START}.."),
        );
        for (name, m) in [("ours", &report.ours), ("reference", &report.reference)] {
            println!(
                "{:<10} {:>28} {:>28}",
                name,
                format!("{}{}", fmt(m.mape_100_135), spread(m, true)),
                format!("{}{}", fmt(m.mape_from_135), spread(m, false)),
            );
        }
    } else {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(ExitCode::SUCCESS)
}
