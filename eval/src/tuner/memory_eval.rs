//! Extrapolation test of the memory model against measured (or derived) data, with the
//! plain cubic fit as the baseline (`iadeep memory eval`).

use std::collections::BTreeMap;

use serde::Serialize;

use iadeep_datasets::csv_text::{CsvError, read_records};
use iadeep_objective::stats::{median, quantile};
use iadeep_tuner::{CubicBaseline, MemoryModel, MemoryModelParams, MemorySample};
use iadeep_tuner::{Result, TunerError};

/// One CSV row.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryRow {
    pub model: String,
    pub sample: MemorySample,
}

/// Parses a `model,batch_size,memory_mib` CSV (header required; fields may be quoted).
pub fn parse_csv(text: &str) -> Result<Vec<MemoryRow>> {
    let invalid = |e: CsvError| TunerError::InvalidInput(e.to_string());
    read_records(text, &["model", "batch_size", "memory_mib"])
        .map_err(invalid)?
        .iter()
        .map(|record| {
            let model = record.get("model").map_err(invalid)?;
            if model.is_empty() {
                return Err(invalid(record.error("model", "empty model name")));
            }
            let batch_size: u32 = record
                .parse("batch_size", "a positive integer")
                .map_err(invalid)?;
            let peak_mib: f64 = record
                .parse("memory_mib", "a number of MiB")
                .map_err(invalid)?;
            if batch_size == 0 {
                return Err(invalid(
                    record.error("batch_size", "must be positive, got 0"),
                ));
            }
            if !(peak_mib.is_finite() && peak_mib > 0.0) {
                return Err(invalid(
                    record.error("memory_mib", &format!("must be positive, got {peak_mib}")),
                ));
            }
            Ok(MemoryRow {
                model: model.to_owned(),
                sample: MemorySample {
                    batch_size,
                    peak_mib,
                },
            })
        })
        .collect()
}

/// Accuracy figures of one predictor.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EvalFigures {
    pub models: usize,
    pub predictions: usize,
    /// Fraction of predictions below 0.98 × measured.
    pub underestimate_rate: f64,
    /// Median |predicted / measured − 1|.
    pub median_abs_rel_err: f64,
    /// 90th percentile of max(predicted / measured − 1, 0).
    pub p90_over: f64,
    /// Predictions refused (the model declined to extrapolate that far); not in the rates.
    pub refused: usize,
}

/// What [`evaluate`] tests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalOptions {
    /// Fit on each model's rows with batch size ≤ this.
    pub fit_upto: u32,
    /// Predict the rows above the fit up to this many times the model's largest fitted
    /// size: 2, one doubling, is the measure and a little further than the
    /// tuner lets the model's bound run ahead of the data (it grows a task by at most
    /// `max_step_past_measured`, 1.5×; a longer jump to a task's next allowed size is
    /// bounded by the prior instead, which [`EvalReport::held`] scores).
    pub horizon: f64,
    /// The memory model's parameters.
    pub params: MemoryModelParams,
}

impl EvalOptions {
    /// Fit up to `fit_upto`, predict one doubling past it, with the default model.
    pub fn new(fit_upto: u32) -> EvalOptions {
        EvalOptions {
            fit_upto,
            horizon: 2.0,
            params: MemoryModelParams::default(),
        }
    }
}

/// Both predictors side by side.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EvalReport {
    pub models: usize,
    /// Rows up to this many times a model's largest fitted size were predicted.
    pub horizon: f64,
    pub underestimate_rate: f64,
    pub median_abs_rel_err: f64,
    pub p90_over: f64,
    pub predictions: usize,
    pub refused: usize,
    /// The bound the tuner would hold a task to that jumped from its fitted sizes
    /// straight to each predicted size (`MemoryModel::held_bound_mib`): the model's
    /// within a step of the largest fitted size, the prior's further out, as for a task
    /// whose allowed sizes are coarser than a step (the figures above score the model's
    /// bound at every size; on the default √2 grid the tuner never jumps past a step).
    pub held: EvalFigures,
    pub cubic_baseline: EvalFigures,
}

fn figures(models: usize, rel: &[f64], refused: usize) -> EvalFigures {
    let under = rel.iter().filter(|r| **r < -0.02).count();
    let abs: Vec<f64> = rel.iter().map(|r| r.abs()).collect();
    let over: Vec<f64> = rel.iter().map(|r| r.max(0.0)).collect();
    EvalFigures {
        models,
        predictions: rel.len(),
        underestimate_rate: if rel.is_empty() {
            f64::NAN
        } else {
            under as f64 / rel.len() as f64
        },
        median_abs_rel_err: median(&abs).unwrap_or(f64::NAN),
        p90_over: quantile(&over, 0.9).unwrap_or(f64::NAN),
        refused,
    }
}

/// For each model: fit on rows with batch size ≤ `fit_upto`, predict the rows above it up
/// to `horizon` × the largest fitted size. Models with fewer than two fitting rows or
/// nothing to predict are skipped (logged).
pub fn evaluate(rows: &[MemoryRow], options: EvalOptions) -> Result<EvalReport> {
    options.params.check()?;
    if !(options.horizon.is_finite() && options.horizon > 1.0) {
        return Err(TunerError::InvalidInput(format!(
            "the horizon must be a factor above 1, got {}",
            options.horizon
        )));
    }
    let fit_upto = options.fit_upto;
    let mut by_model: BTreeMap<&str, Vec<MemorySample>> = BTreeMap::new();
    for row in rows {
        by_model.entry(&row.model).or_default().push(row.sample);
    }
    let (mut ours, mut held, mut cubic) = (Vec::new(), Vec::new(), Vec::new());
    let (mut models, mut refused, mut held_refused) = (0, 0, 0);
    for (name, samples) in &by_model {
        let (fit, above): (Vec<MemorySample>, Vec<MemorySample>) =
            samples.iter().partition(|s| s.batch_size <= fit_upto);
        let largest_fitted = fit
            .iter()
            .map(|s| f64::from(s.batch_size))
            .fold(0.0, f64::max);
        let test: Vec<MemorySample> = above
            .into_iter()
            .filter(|s| f64::from(s.batch_size) <= options.horizon * largest_fitted)
            .collect();
        if fit.len() < 2 || test.is_empty() {
            tracing::info!(
                model = name,
                fit = fit.len(),
                test = test.len(),
                "skipped: needs ≥ 2 rows to fit and ≥ 1 within the horizon above"
            );
            continue;
        }
        models += 1;
        let model = MemoryModel::fit_with(&fit, &[], options.params)?;
        let baseline = CubicBaseline::fit(&fit)?;
        for s in &test {
            match model.upper_bound_mib(s.batch_size) {
                Some(p) => ours.push(p / s.peak_mib - 1.0),
                None => refused += 1,
            }
            match model.held_bound_mib(s.batch_size) {
                Some(p) => held.push(p / s.peak_mib - 1.0),
                None => held_refused += 1,
            }
            cubic.push(baseline.predict(s.batch_size) / s.peak_mib - 1.0);
        }
    }
    if models == 0 {
        return Err(TunerError::InvalidInput(format!(
            "no model has ≥ 2 rows with batch_size ≤ {fit_upto} and ≥ 1 row above it within \
             {}× its largest fitted size",
            options.horizon
        )));
    }
    let f = figures(models, &ours, refused);
    Ok(EvalReport {
        models,
        horizon: options.horizon,
        underestimate_rate: f.underestimate_rate,
        median_abs_rel_err: f.median_abs_rel_err,
        p90_over: f.p90_over,
        predictions: f.predictions,
        refused,
        held: figures(models, &held, held_refused),
        cubic_baseline: figures(models, &cubic, 0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        let rows =
            parse_csv("model,batch_size,memory_mib\nr18,8,1000\nr18,16,1500.5\n").expect("parses");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[1].sample.peak_mib, 1500.5);
        assert!(parse_csv("a,b,c\n").is_err());
        assert!(parse_csv("model,batch_size,memory_mib\nx,0,10\n").is_err());
        assert!(parse_csv("model,batch_size,memory_mib\nx,8\n").is_err());
    }

    #[test]
    fn quoted_model_names_may_hold_commas() {
        let rows =
            parse_csv("model,batch_size,memory_mib\n\"bert, large\",8,\"1000\"\n").expect("parses");
        assert_eq!(rows[0].model, "bert, large");
        assert_eq!(rows[0].sample.batch_size, 8);
        let error = parse_csv("model,batch_size,memory_mib\nr18,8,1000\n\"r18,16\",1500\n")
            .expect_err("two fields, not three");
        assert!(error.to_string().contains("line 3"), "{error}");
    }

    #[test]
    fn affine_data_is_never_underestimated() {
        let mut text = String::from("model,batch_size,memory_mib\n");
        for b in [4, 8, 16, 32, 64, 128] {
            text.push_str(&format!("m,{b},{}\n", 900 + 7 * b));
        }
        let rows = parse_csv(&text).expect("parses");
        let report = evaluate(&rows, EvalOptions::new(32)).expect("evaluates");
        assert_eq!(report.models, 1);
        assert_eq!(report.predictions, 1, "one doubling past 32: only 64");
        assert_eq!(report.underestimate_rate, 0.0);
        assert!(report.p90_over > 0.0, "extrapolation is padded");
        let far = EvalOptions {
            horizon: 4.0,
            ..EvalOptions::new(32)
        };
        assert_eq!(evaluate(&rows, far).expect("evaluates").predictions, 2);
        assert!(evaluate(&rows, EvalOptions::new(1000)).is_err());
    }

    /// The held bound is the model's within a step of the fitted sizes and the prior's
    /// (wider) past it: on straight data fitted up to 32, 48 is within the 1.5× step and
    /// 64 past it.
    #[test]
    fn the_held_bound_is_the_priors_past_a_step() {
        let mut text = String::from(
            "model,batch_size,memory_mib
",
        );
        for b in [4, 8, 16, 32, 48, 64] {
            text.push_str(&format!(
                "m,{b},{}
",
                900 + 7 * b
            ));
        }
        let rows = parse_csv(&text).expect("parses");
        let options = EvalOptions {
            horizon: 1.5,
            ..EvalOptions::new(32)
        };
        let within = evaluate(&rows, options).expect("evaluates");
        assert_eq!(within.predictions, 1, "48 only");
        assert_eq!(within.held, figures(1, &[within.median_abs_rel_err], 0));
        let doubling = evaluate(&rows, EvalOptions::new(32)).expect("evaluates");
        assert_eq!(doubling.predictions, 2, "48 and 64");
        assert_eq!(doubling.held.underestimate_rate, 0.0);
        assert!(
            doubling.held.p90_over > doubling.p90_over,
            "the prior's bound at 64 is wider: {doubling:?}"
        );
    }
}
