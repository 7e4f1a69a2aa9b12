//! `iadeep predictor`: evaluate the co-location predictor offline.

use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use iadeep_eval::predictor::prequential::{EARLY_START, LATE_START, Mape, evaluate_seeds};
use iadeep_eval::predictor::unseen::{UnseenScore, evaluate_unseen};
use iadeep_predictor::LearnerParams;
use iadeep_predictor::jsonl::read_samples;

#[derive(Debug, Args)]
pub struct PredictorArgs {
    #[command(subcommand)]
    command: PredictorCommand,
}

/// How the evaluation splits what a model learns from what it predicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Split {
    /// Prequential: the shuffled samples are predicted one by one, each before it
    /// is learned; every job recurs, so this measures jobs seen before.
    Default,
    /// Models never seen: each model family (the `model` field) is predicted by
    /// models fitted only on the samples of the families placed before it that do
    /// not involve it at all.
    UnseenModels,
}

#[derive(Debug, Subcommand)]
enum PredictorCommand {
    /// Evaluate on a JSON Lines samples file: ours against the reference (a forest
    /// on one-hot job names) and a plain forest on our profile features.
    ///
    /// `--split default` (prequential): for each seed the samples are shuffled; each
    /// sample is predicted before it is learned, and every model refits on the
    /// production cadence. Prints the mean absolute percentage error over samples
    /// 100..135 (0-based) and from 135 on, averaged over seeds.
    ///
    /// `--split unseen-models`: for each seed the model families are put in a random
    /// order; each family is predicted by models fitted only on the samples of the
    /// families before it that do not involve it at all. Prints the MAPE over every
    /// sample, averaged over seeds.
    ///
    /// Both print `coverage_90`, the share of samples inside their 90 % predictive
    /// interval (calibrated for ours; a log-normal reading of the trees' spread for
    /// the others). Malformed lines are reported with their line number and skipped.
    Eval {
        /// Samples file (JSON Lines, e.g. from `iadeep data gavel-pairs`).
        samples: PathBuf,
        /// Which split to evaluate.
        #[arg(long, value_enum, default_value_t = Split::Default)]
        split: Split,
        /// Number of shuffles (seeds OFFSET..OFFSET+N).
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
        seeds: u64,
        /// First shuffle seed. Tune parameters on seeds that the reported figures
        /// do not use (e.g. --seed-offset 100 --seeds 40), then report seeds 0..5.
        #[arg(long, default_value_t = 0)]
        seed_offset: u64,
        /// JSON object overriding the default learner parameters of our predictor
        /// (the reference keeps its forest and cadence from them too), e.g.
        /// '{"job_effects_prior": null}' to leave the per-job effects out or
        /// '{"forest": {"n_trees": 64}}'. Unknown keys are an error.
        #[arg(long, value_name = "JSON")]
        params: Option<String>,
        /// Print one JSON object on the last line: {"samples": N, "split": "default",
        /// "ours": {"mape_100_135": x, "mape_from_135": y, "coverage_90": c},
        /// "reference": {...}, "plain_forest": {...}}, or with `--split
        /// unseen-models` {"samples": N, "split": "unseen-models", "ours": {"mape": x,
        /// "coverage_90": c}, "reference": {...}, "plain_forest": {...}}.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(args: PredictorArgs) -> Result<ExitCode> {
    match args.command {
        PredictorCommand::Eval {
            samples,
            split,
            seeds,
            seed_offset,
            params,
            json,
        } => {
            let params = learner_params(params.as_deref())?;
            let Some(end) = seed_offset.checked_add(seeds) else {
                bail!("--seed-offset {seed_offset} + --seeds {seeds} overflows");
            };
            eval(&samples, split, seed_offset..end, &params, json)
        }
    }
}

fn fmt(value: Option<f64>) -> String {
    value.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.4}"))
}

/// ` [min..max]` of per-seed values, or nothing without any.
fn spread(values: &[f64]) -> String {
    if values.is_empty() {
        return String::new();
    }
    let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!(" [{lo:.4}..{hi:.4}]")
}

/// Overlays `key: value` pairs of `over` on `base`, recursing into objects; a key
/// that `base` does not have is an error naming its path.
fn overlay(base: &mut serde_json::Value, over: &serde_json::Value, path: &str) -> Result<()> {
    match (base, over) {
        (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
            for (k, v) in o {
                let here = format!("{path}{k}");
                let Some(slot) = b.get_mut(k) else {
                    let known: Vec<&String> = b.keys().collect();
                    bail!("--params: unknown key {here:?} (known here: {known:?})");
                };
                overlay(slot, v, &format!("{here}."))?;
            }
            Ok(())
        }
        (b, o) => {
            *b = o.clone();
            Ok(())
        }
    }
}

/// The default learner parameters with the `--params` overrides applied.
fn learner_params(overrides: Option<&str>) -> Result<LearnerParams> {
    let defaults = LearnerParams::default();
    let Some(text) = overrides else {
        return Ok(defaults);
    };
    let over: serde_json::Value =
        serde_json::from_str(text).context("--params is not valid JSON")?;
    if !over.is_object() {
        bail!("--params must be a JSON object, e.g. '{{\"refit_every\": 1}}'");
    }
    let mut merged = serde_json::to_value(&defaults)?;
    overlay(&mut merged, &over, "")?;
    let params: LearnerParams =
        serde_json::from_value(merged).context("--params: a value has the wrong type")?;
    params
        .check()
        .map_err(|e| anyhow::anyhow!("--params: {e}"))?;
    Ok(params)
}

fn per_seed(m: &Mape, early: bool) -> Vec<f64> {
    m.per_seed
        .iter()
        .filter_map(|p| if early { p.0 } else { p.1 })
        .collect()
}

fn eval(
    path: &std::path::Path,
    split: Split,
    seeds: std::ops::Range<u64>,
    params: &LearnerParams,
    json: bool,
) -> Result<ExitCode> {
    let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let (samples, errors) = read_samples(BufReader::new(file))
        .with_context(|| format!("cannot read {}", path.display()))?;
    for err in &errors {
        tracing::warn!("{}: {err}; line skipped", path.display());
    }
    if samples.is_empty() {
        bail!("{}: no valid samples", path.display());
    }
    if split == Split::Default && samples.len() <= EARLY_START {
        tracing::warn!(
            samples = samples.len(),
            "fewer than {} samples: the MAPE windows are empty",
            EARLY_START + 1
        );
    }
    tracing::info!(
        samples = samples.len(),
        skipped = errors.len(),
        ?split,
        ?seeds,
        ?params,
        "predictor evaluation"
    );
    match split {
        Split::Default => eval_default(&samples, seeds, params, json)?,
        Split::UnseenModels => eval_unseen(&samples, seeds, params, json)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `eval` with the default split: ours, the reference and the plain forest, per window.
fn eval_default(
    samples: &[iadeep_proto::CoLocationSample],
    seeds: std::ops::Range<u64>,
    params: &LearnerParams,
    json: bool,
) -> Result<()> {
    let report = evaluate_seeds(samples, seeds.clone(), params)?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "{} samples, default split, seeds {}..{}; MAPE and coverage of the 90 % \
         interval, mean over seeds [min..max]",
        report.samples, seeds.start, seeds.end
    );
    println!(
        "{:<13} {:>28} {:>28} {:>12}",
        "approach",
        format!("samples {EARLY_START}..{LATE_START}"),
        format!("samples {LATE_START}.."),
        "coverage_90",
    );
    for (name, m) in [
        ("ours", &report.ours),
        ("reference", &report.reference),
        ("plain_forest", &report.plain_forest),
    ] {
        println!(
            "{:<13} {:>28} {:>28} {:>12}",
            name,
            format!("{}{}", fmt(m.mape_100_135), spread(&per_seed(m, true))),
            format!("{}{}", fmt(m.mape_from_135), spread(&per_seed(m, false))),
            fmt(m.coverage_90),
        );
    }
    Ok(())
}

/// `eval` with the unseen-models split.
fn eval_unseen(
    samples: &[iadeep_proto::CoLocationSample],
    seeds: std::ops::Range<u64>,
    params: &LearnerParams,
    json: bool,
) -> Result<()> {
    let report = evaluate_unseen(samples, seeds.clone(), params)?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "{} samples, unseen-models split, seeds {}..{}; MAPE and coverage of the \
         90 % interval, mean over seeds [min..max]",
        report.samples, seeds.start, seeds.end
    );
    println!("{:<13} {:>28} {:>12}", "approach", "MAPE", "coverage_90");
    let row = |name: &str, s: &UnseenScore| {
        println!(
            "{:<13} {:>28} {:>12}",
            name,
            format!("{}{}", fmt(s.mape), spread(&s.per_seed)),
            fmt(s.coverage_90),
        );
    };
    row("ours", &report.ours);
    row("reference", &report.reference);
    row("plain_forest", &report.plain_forest);
    Ok(())
}
