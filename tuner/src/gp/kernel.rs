//! Matérn-5/2 kernel with automatic relevance determination (one length scale per input).
//!
//! Matérn-5/2 rather than RBF: throughput surfaces have kinks (a co-runner saturating the
//! SMs, the allocator switching algorithms) that the infinitely smooth RBF over-smooths.

use nalgebra::DVector;

/// k(x, y) = σ² (1 + √5 r + 5r²/3) exp(−√5 r), r² = Σ_i ((x_i − y_i)/ℓ_i)².
#[derive(Clone, Debug, PartialEq)]
pub struct Matern52 {
    /// ln ℓ_i, one per input dimension.
    pub log_lengths: DVector<f64>,
    /// ln σ (signal standard deviation).
    pub log_signal: f64,
}

const SQRT5: f64 = 2.236_067_977_499_79;

impl Matern52 {
    /// The kernel value between two points.
    pub fn value(&self, x: &[f64], y: &[f64]) -> f64 {
        let r2: f64 = x
            .iter()
            .zip(y)
            .zip(self.log_lengths.iter())
            .map(|((a, b), l)| {
                let d = (a - b) / l.exp();
                d * d
            })
            .sum();
        let signal2 = (2.0 * self.log_signal).exp();
        signal2 * Self::shape(r2.sqrt())
    }

    /// (1 + √5 r + 5r²/3) exp(−√5 r), the unit-variance profile.
    pub fn shape(r: f64) -> f64 {
        (1.0 + SQRT5 * r + 5.0 / 3.0 * r * r) * (-SQRT5 * r).exp()
    }

    /// ∂k/∂ln ℓ_i divided by the squared scaled distance in dimension i:
    /// σ² (5/3)(1 + √5 r) exp(−√5 r). Multiply by ((x_i − y_i)/ℓ_i)² for the derivative.
    pub fn length_derivative_factor(signal2: f64, r: f64) -> f64 {
        signal2 * 5.0 / 3.0 * (1.0 + SQRT5 * r) * (-SQRT5 * r).exp()
    }
}

/// A linear trend in the inputs, k_lin(x, y) = v · (x − c)·(y − c), added to the Matérn kernel.
///
/// A stationary kernel reverts to the constant mean away from the data, so after m0 and one
/// smaller configuration it has no opinion on whether larger batch sizes are better. Throughput
/// per sample usually moves monotonically with the batch size over much of the lattice (until
/// memory or interference bites), and the Bayesian linear-regression prior on the slope
/// (Rasmussen & Williams §2.7, here as a kernel term) lets the observations say which way
/// to go. The centre c is the mean observed input, so the trend adds no intercept.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearTrend {
    /// Prior variance v of the slope per unit of log2 batch size (standardised targets).
    pub variance: f64,
    /// The centre c, one per input dimension.
    pub center: Vec<f64>,
}

impl LinearTrend {
    /// The kernel value between two points.
    pub fn value(&self, x: &[f64], y: &[f64]) -> f64 {
        self.variance
            * x.iter()
                .zip(y)
                .zip(&self.center)
                .map(|((a, b), c)| (a - c) * (b - c))
                .sum::<f64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_values() {
        let k = Matern52 {
            log_lengths: DVector::from_vec(vec![0.0, 2f64.ln()]),
            log_signal: 0.0,
        };
        assert!((k.value(&[0.0, 0.0], &[0.0, 0.0]) - 1.0).abs() < 1e-15);
        // r = 1 (one unit in the first dimension): (1 + √5 + 5/3) e^{−√5} ≈ 0.523994.
        assert!((k.value(&[0.0, 0.0], &[1.0, 0.0]) - 0.523_994_108_9).abs() < 1e-9);
        // Two units in the second dimension (ℓ = 2) is the same distance.
        assert!(
            (k.value(&[0.0, 0.0], &[0.0, 2.0]) - k.value(&[0.0, 0.0], &[1.0, 0.0])).abs() < 1e-15
        );
    }

    #[test]
    fn linear_trend_hand_computed() {
        let t = LinearTrend {
            variance: 0.5,
            center: vec![2.0, 4.0],
        };
        // (−1, −2)·(1, 2) = −5, × 0.5.
        assert_eq!(t.value(&[1.0, 2.0], &[3.0, 6.0]), -2.5);
        assert_eq!(t.value(&[2.0, 4.0], &[7.0, 1.0]), 0.0);
    }

    #[test]
    fn length_derivative_matches_finite_difference() {
        let (x, y) = ([0.3, 1.0], [1.1, 0.2]);
        let base = Matern52 {
            log_lengths: DVector::from_vec(vec![0.2, -0.4]),
            log_signal: 0.3,
        };
        let h = 1e-6;
        let mut up = base.clone();
        up.log_lengths[0] += h;
        let mut down = base.clone();
        down.log_lengths[0] -= h;
        let numeric = (up.value(&x, &y) - down.value(&x, &y)) / (2.0 * h);
        let d: Vec<f64> = (0..2)
            .map(|i| (x[i] - y[i]) / base.log_lengths[i].exp())
            .collect();
        let r = d.iter().map(|v| v * v).sum::<f64>().sqrt();
        let analytic = Matern52::length_derivative_factor((2.0 * 0.3f64).exp(), r) * d[0] * d[0];
        assert!((numeric - analytic).abs() < 1e-6, "{numeric} vs {analytic}");
    }
}
