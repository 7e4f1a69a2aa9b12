//! Statistical efficiency over training progress, from Pollux's measured gradient
//! statistics.
//!
//! A job that trains at batch size m instead of its submitted m0 makes
//! `E(m) = (φ + m0) / (φ + m)` as much progress per sample (docs/design.md, "The
//! objective"), where φ, the gradient noise scale, grows as training proceeds. The
//! simulated job's φ at a fraction p of its work is the φ = grad_var / grad_sqr
//! measured at fraction p of a Pollux validation run of the closest model (the run
//! with the most rows), linearly interpolated. Families with no comparable Pollux
//! model have no gradient statistics: their agents report none, and their progress
//! ignores batch size effects on efficiency (E = 1), as docs/design.md prescribes for
//! such tasks ("Gradient noise scale").

use iadeep_datasets::pollux;

use crate::error::Result;

/// Which Pollux model stands in for a Gavel family, and why.
///
/// ResNet-18 and ResNet-50 are the same models (cifar10 is ResNet-18 on CIFAR-10,
/// imagenet is ResNet-50); Recommendation and ncf are both neural collaborative
/// filtering on MovieLens; Transformer maps to bert (a Transformer encoder); LM (an
/// LSTM language model) maps to deepspeech2 (recurrent layers). A3C and CycleGAN have
/// no counterpart.
pub fn pollux_model_for(family: &str) -> Option<&'static str> {
    match family {
        "ResNet-18" => Some("cifar10"),
        "ResNet-50" => Some("imagenet"),
        "Recommendation" => Some("ncf"),
        "Transformer" => Some("bert"),
        "LM" => Some("deepspeech2"),
        _ => None,
    }
}

/// Measured φ against the fraction of training done.
#[derive(Clone, Debug, PartialEq)]
pub struct NoiseScaleCurve {
    pub model: String,
    /// `(fraction of the run in [0, 1], φ)`, ascending fraction.
    points: Vec<(f64, f64)>,
}

impl NoiseScaleCurve {
    /// The curve of a bundled Pollux model, or `None` if it has no usable run.
    pub fn bundled(model: &str) -> Result<Option<NoiseScaleCurve>> {
        let model = pollux::bundled_model(model)?;
        let Some(run) = model
            .validation_runs
            .iter()
            .max_by_key(|run| (run.points.len(), std::cmp::Reverse(run.batch_size)))
        else {
            return Ok(None);
        };
        let last = run.points.iter().map(|p| p.progress).fold(0.0, f64::max);
        if last <= 0.0 {
            return Ok(None);
        }
        let mut points: Vec<(f64, f64)> = run
            .points
            .iter()
            .filter_map(|p| {
                p.noise_scale()
                    .filter(|phi| phi.is_finite() && *phi > 0.0)
                    .map(|phi| (p.progress / last, phi))
            })
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok((!points.is_empty()).then_some(NoiseScaleCurve {
            model: model.name,
            points,
        }))
    }

    /// φ at a fraction of training, interpolated, held constant outside the run.
    pub fn phi_at(&self, fraction: f64) -> f64 {
        let points = &self.points;
        let index = points.partition_point(|(x, _)| *x < fraction);
        if index == 0 {
            return points[0].1;
        }
        if index >= points.len() {
            return points[points.len() - 1].1;
        }
        let ((x0, y0), (x1, y1)) = (points[index - 1], points[index]);
        if x1 <= x0 {
            return y1;
        }
        y0 + (y1 - y0) * (fraction - x0) / (x1 - x0)
    }
}

/// Statistical efficiency of batch size `m` relative to `m0` at noise scale `phi`.
pub fn efficiency(phi: f64, m0: u32, m: u32) -> f64 {
    (phi + f64::from(m0)) / (phi + f64::from(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curves_exist_for_mapped_families_and_interpolate() {
        for family in [
            "ResNet-18",
            "ResNet-50",
            "Recommendation",
            "Transformer",
            "LM",
        ] {
            let model = pollux_model_for(family).expect("mapped");
            let curve = NoiseScaleCurve::bundled(model)
                .expect("reads")
                .expect("usable run");
            let (early, late) = (curve.phi_at(0.0), curve.phi_at(1.0));
            assert!(early > 0.0 && late > 0.0, "{family}");
            let mid = curve.phi_at(0.5);
            assert!(mid.is_finite() && mid > 0.0);
        }
        assert!(pollux_model_for("A3C").is_none());
    }

    #[test]
    fn efficiency_is_one_at_m0_and_penalises_larger_batches() {
        assert_eq!(efficiency(100.0, 64, 64), 1.0);
        assert!(efficiency(100.0, 64, 128) < 1.0);
        assert!(efficiency(100.0, 64, 32) > 1.0);
        // A large noise scale makes batch size nearly free.
        assert!(efficiency(1e9, 64, 128) > 0.999_999);
    }
}
