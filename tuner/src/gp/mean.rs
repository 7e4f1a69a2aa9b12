//! Constant mean and output scaling.
//!
//! The GP is fit on standardised targets (zero mean, unit variance) so that one prior on the
//! signal and noise scales fits every objective, whether Σ PD is near 2 or near 20.

/// The mean and scale of the observed targets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConstantMean {
    pub mean: f64,
    pub scale: f64,
}

impl ConstantMean {
    /// Mean and standard deviation of `y` (scale 1 when `y` is constant or has one element).
    pub fn fit(y: &[f64]) -> ConstantMean {
        if y.is_empty() {
            return ConstantMean {
                mean: 0.0,
                scale: 1.0,
            };
        }
        let n = y.len() as f64;
        let mean = y.iter().sum::<f64>() / n;
        let var = y.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        let scale = if var.sqrt() > 1e-12 * mean.abs().max(1.0) {
            var.sqrt()
        } else {
            1.0
        };
        ConstantMean { mean, scale }
    }

    /// Raw value → standardised.
    pub fn standardise(&self, y: f64) -> f64 {
        (y - self.mean) / self.scale
    }

    /// Standardised value → raw.
    pub fn restore(&self, z: f64) -> f64 {
        z * self.scale + self.mean
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let m = ConstantMean::fit(&[1.0, 3.0]);
        assert_eq!((m.mean, m.scale), (2.0, 1.0));
        assert_eq!(m.restore(m.standardise(7.5)), 7.5);
        assert_eq!(ConstantMean::fit(&[4.0, 4.0]).scale, 1.0);
    }
}
