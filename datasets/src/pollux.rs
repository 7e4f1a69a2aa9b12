//! Pollux traces: single-GPU step time against batch size, and gradient
//! statistics over training progress, for six real models.
//!
//! Used where iadeep needs ground truth it must not invent: the emulated
//! training job follows a measured step-time curve, and the simulator draws
//! statistical efficiency from the measured gradient noise scale.

use crate::DatasetError;
use crate::csv_text::read_records;

/// One single-GPU measurement: seconds per step at a local batch size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTimePoint {
    pub batch_size: u32,
    pub step_time_s: f64,
}

/// One row of a validation run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradientPoint {
    /// Training progress (samples processed, scaled as in the trace).
    pub progress: f64,
    pub iteration: u64,
    /// Validation metric at this point.
    pub metric: f64,
    /// |G|², squared norm of the true gradient (estimate).
    pub grad_sqr: f64,
    /// tr Σ, the gradient variance (estimate).
    pub grad_var: f64,
}

impl GradientPoint {
    /// Gradient noise scale φ = tr Σ / |G|², when |G|² is positive.
    pub fn noise_scale(&self) -> Option<f64> {
        (self.grad_sqr > 0.0).then(|| self.grad_var / self.grad_sqr)
    }
}

/// A training run at one total batch size.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidationRun {
    pub batch_size: u32,
    pub points: Vec<GradientPoint>,
}

/// Everything the traces say about one model.
#[derive(Clone, Debug, PartialEq)]
pub struct PolluxModel {
    pub name: String,
    /// Placement `1` rows, sorted by batch size.
    pub solo_step_times: Vec<StepTimePoint>,
    /// Sorted by batch size.
    pub validation_runs: Vec<ValidationRun>,
}

struct BundledModel {
    name: &'static str,
    placements: &'static str,
    validations: &'static [(u32, &'static str)],
}

include!("pollux_bundled.rs");

/// Names of the bundled models.
pub fn bundled_model_names() -> Vec<&'static str> {
    BUNDLED.iter().map(|m| m.name).collect()
}

/// A bundled model by name (`bert`, `cifar10`, `deepspeech2`, `imagenet`, `ncf`, `yolov3`).
pub fn bundled_model(name: &str) -> Result<PolluxModel, DatasetError> {
    let model =
        BUNDLED
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| DatasetError::UnknownModel {
                requested: name.to_owned(),
                available: bundled_model_names().join(", "),
            })?;
    let mut validation_runs = model
        .validations
        .iter()
        .map(|(batch_size, text)| {
            Ok(ValidationRun {
                batch_size: *batch_size,
                points: parse_validation(text)
                    .map_err(|e| e.context(&format!("{name}/validation-{batch_size}.csv")))?,
            })
        })
        .collect::<Result<Vec<_>, DatasetError>>()?;
    validation_runs.sort_by_key(|r| r.batch_size);
    Ok(PolluxModel {
        name: name.to_owned(),
        solo_step_times: parse_placements(model.placements)
            .map_err(|e| e.context(&format!("{name}/placements.csv")))?,
        validation_runs,
    })
}

/// Single-GPU rows (placement `1`) of a `placements.csv`.
pub fn parse_placements(text: &str) -> Result<Vec<StepTimePoint>, DatasetError> {
    let mut points = Vec::new();
    for record in read_records(text, &["placement", "local_bsz", "step_time", "sync_time"])? {
        if record.get("placement")? != "1" {
            continue;
        }
        let step_time_s: f64 = record.parse("step_time", "a number of seconds")?;
        if !(step_time_s.is_finite() && step_time_s > 0.0) {
            return Err(record
                .error(
                    "step_time",
                    &format!("non-positive step time {step_time_s}"),
                )
                .into());
        }
        points.push(StepTimePoint {
            batch_size: record.parse("local_bsz", "a batch size")?,
            step_time_s,
        });
    }
    points.sort_by_key(|p| p.batch_size);
    Ok(points)
}

/// The rows of a `validation-<batch>.csv`.
pub fn parse_validation(text: &str) -> Result<Vec<GradientPoint>, DatasetError> {
    read_records(
        text,
        &["progress", "iteration", "metric", "grad_sqr", "grad_var"],
    )?
    .into_iter()
    .map(|record| {
        Ok(GradientPoint {
            progress: record.parse("progress", "a number")?,
            iteration: record.parse("iteration", "an iteration count")?,
            metric: record.parse("metric", "a number")?,
            grad_sqr: record.parse("grad_sqr", "a number")?,
            grad_var: record.parse("grad_var", "a number")?,
        })
    })
    .collect()
}

impl PolluxModel {
    /// Seconds per step alone at `batch_size`: piecewise-linear between measured
    /// points, linear extrapolation from the two nearest points outside them
    /// (never below a small positive floor).
    pub fn step_time_at(&self, batch_size: f64) -> Option<f64> {
        let points = &self.solo_step_times;
        match points.len() {
            0 => None,
            1 => Some(points[0].step_time_s * batch_size / f64::from(points[0].batch_size)),
            n => {
                let index = points
                    .iter()
                    .position(|p| f64::from(p.batch_size) >= batch_size)
                    .unwrap_or(n - 1)
                    .clamp(1, n - 1);
                let (a, b) = (points[index - 1], points[index]);
                let (xa, xb) = (f64::from(a.batch_size), f64::from(b.batch_size));
                let t = (batch_size - xa) / (xb - xa);
                let time = a.step_time_s + t * (b.step_time_s - a.step_time_s);
                Some(time.max(points[0].step_time_s * 0.05))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bundled_model_parses() {
        for name in bundled_model_names() {
            let model = bundled_model(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!model.solo_step_times.is_empty(), "{name}");
            assert!(!model.validation_runs.is_empty(), "{name}");
            assert!(
                model
                    .validation_runs
                    .iter()
                    .flat_map(|r| &r.points)
                    .any(|p| p.noise_scale().is_some_and(|phi| phi > 0.0)),
                "{name}"
            );
        }
    }

    #[test]
    fn step_time_interpolates_between_measurements() {
        let model = bundled_model("imagenet").expect("bundled");
        let first = model.solo_step_times[0];
        let second = model.solo_step_times[1];
        assert_eq!(
            model.step_time_at(f64::from(first.batch_size)),
            Some(first.step_time_s)
        );
        let mid = model
            .step_time_at(f64::from(first.batch_size + second.batch_size) / 2.0)
            .expect("some");
        assert!(mid > first.step_time_s && mid < second.step_time_s);
    }

    #[test]
    fn unknown_models_and_bad_csv_are_errors() {
        assert!(bundled_model("gpt5").is_err());
        assert!(parse_placements("a,b\n1,2").is_err());
        assert!(parse_validation("progress,iteration,metric,grad_sqr,grad_var\n1,2,3").is_err());
    }

    #[test]
    fn quoted_fields_are_read_whole() {
        let points = parse_placements(
            "placement,local_bsz,step_time,sync_time\n\"1\",\" 8 \",\"0.5\",\"0,1\"\n",
        )
        .expect("parses");
        assert_eq!(
            points,
            [StepTimePoint {
                batch_size: 8,
                step_time_s: 0.5
            }]
        );
        let error =
            parse_validation("progress,iteration,metric,grad_sqr,grad_var\n1,2,\"3,5\",4,5")
                .expect_err("3,5 is one field, not a number");
        assert!(
            error.to_string().contains("line 2, column metric"),
            "{error}"
        );
    }
}
