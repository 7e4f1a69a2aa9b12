//! A training job that is not one: it follows measured step times.
//!
//! For the simulator, end-to-end tests and operators smoke-testing a tuner, a
//! job "trains" by sleeping the step time the Pollux traces measured for its
//! current batch size, and hands the agent gradient norms consistent with the
//! traces' gradient statistics (|G|² and tr Σ at the trace point reached), so a
//! tuner sees the same step-time curve and noise scale a real job would produce.

use std::time::Duration;

use iadeep_datasets::pollux::{self, GradientPoint, PolluxModel};

use crate::error::EvalError;

/// One emulated model.
#[derive(Clone, Debug)]
pub struct EmulatedJob {
    model: PolluxModel,
    /// Gradient statistics along the run closest to the submitted batch size.
    gradient_points: Vec<GradientPoint>,
}

impl EmulatedJob {
    /// A bundled Pollux model (`bert`, `cifar10`, `deepspeech2`, `imagenet`, `ncf`, `yolov3`).
    pub fn bundled(name: &str, initial_batch_size: u32) -> Result<EmulatedJob, EvalError> {
        let model = pollux::bundled_model(name).map_err(|e| EvalError::Emulation(e.to_string()))?;
        EmulatedJob::new(model, initial_batch_size)
    }

    /// Emulates `model`; its gradient statistics come from the validation run
    /// whose batch size is closest to `initial_batch_size`.
    pub fn new(model: PolluxModel, initial_batch_size: u32) -> Result<EmulatedJob, EvalError> {
        if model.solo_step_times.is_empty() {
            return Err(EvalError::Emulation(format!(
                "model {} has no measured step times",
                model.name
            )));
        }
        let gradient_points = model
            .validation_runs
            .iter()
            .min_by_key(|run| run.batch_size.abs_diff(initial_batch_size))
            .map(|run| {
                run.points
                    .iter()
                    .filter(|p| p.grad_sqr > 0.0 && p.grad_var > 0.0)
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        Ok(EmulatedJob {
            model,
            gradient_points,
        })
    }

    /// The model's name.
    pub fn name(&self) -> &str {
        &self.model.name
    }

    /// Batch sizes with a measurement, smallest to largest.
    pub fn measured_batch_sizes(&self) -> Vec<u32> {
        self.model
            .solo_step_times
            .iter()
            .map(|p| p.batch_size)
            .collect()
    }

    /// The measured (interpolated) solo step time at `batch_size`.
    pub fn step_time(&self, batch_size: u32) -> Duration {
        let secs = self
            .model
            .step_time_at(f64::from(batch_size.max(1)))
            .filter(|s| s.is_finite() && *s > 0.0)
            .unwrap_or(0.0);
        Duration::from_secs_f64(secs)
    }

    /// Expected squared gradient norms (b, |g_b|², B, |g_B|²) at `fraction`
    /// (0..=1) of the run, with b = B/4 as a micro-batch of a batch of B:
    /// E|g_b|² = |G|² + tr Σ / b. `None` when the traces have no statistics.
    pub fn gradient_norms(&self, fraction: f64, batch_size: u32) -> Option<(u32, f64, u32, f64)> {
        let last = self.gradient_points.len().checked_sub(1)?;
        let index = ((fraction.clamp(0.0, 1.0) * last as f64).round() as usize).min(last);
        let point = self.gradient_points[index];
        let big = batch_size.max(2);
        let small = (big / 4).max(1);
        let norm = |b: u32| point.grad_sqr + point.grad_var / f64::from(b);
        Some((small, norm(small), big, norm(big)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_objective::GnsEstimator;

    #[test]
    fn step_times_follow_the_measurements() {
        let job = EmulatedJob::bundled("cifar10", 128).expect("bundled");
        let sizes = job.measured_batch_sizes();
        assert!(sizes.len() >= 2);
        let (small, large) = (sizes[0], sizes[sizes.len() - 1]);
        assert!(job.step_time(small) > Duration::ZERO);
        assert!(job.step_time(large) >= job.step_time(small));
    }

    #[test]
    fn gradient_norms_give_back_the_traced_noise_scale() {
        let job = EmulatedJob::bundled("cifar10", 128).expect("bundled");
        let (b, gb, big, gbig) = job.gradient_norms(0.5, 128).expect("statistics");
        let mut est = GnsEstimator::new(1.0);
        est.record(b, gb, big, gbig).expect("valid");
        let index = ((0.5 * (job.gradient_points.len() - 1) as f64).round()) as usize;
        let want = job.gradient_points[index].noise_scale().expect("positive");
        let got = est.noise_scale().expect("positive");
        assert!((got / want - 1.0).abs() < 1e-9, "{got} vs {want}");
    }

    #[test]
    fn unknown_models_are_named_in_the_error() {
        let err = EmulatedJob::bundled("alexnet", 32).expect_err("unknown");
        assert!(err.to_string().contains("alexnet"), "{err}");
    }
}
