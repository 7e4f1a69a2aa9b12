//! The gradient noise scale φ = tr(Σ)/|G|² from two gradient norms of one step.
//!
//! docs/design.md ("Gradient noise scale"): with the squared norms |g_b|² and |g_B|² of
//! the gradient over b and over B > b samples of the same step,
//! |G|² ≈ (B|g_B|² − b|g_b|²)/(B − b) and tr Σ ≈ (|g_b|² − |g_B|²)/(1/b − 1/B).
//! Both are unbiased but very noisy per step (either can be negative), so each is
//! smoothed by an exponential moving average *before* the ratio is taken; the
//! ratio of smoothed values is what McCandlish et al. (2018) recommend. Feeding
//! two batches of the *same* size (the reference code's mistake) is rejected.

/// Why a pair of gradient norms was not used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GnsSampleError {
    /// b must be positive and strictly smaller than B.
    BatchSizes,
    /// A norm is negative, NaN or infinite.
    Norms,
}

/// Exponentially smoothed two-batch-size estimator.
#[derive(Clone, Debug)]
pub struct GnsEstimator {
    /// Weight of a new sample in the moving averages, in (0, 1].
    alpha: f64,
    grad_sq: Option<f64>,
    trace_cov: Option<f64>,
    samples: u64,
}

impl GnsEstimator {
    /// A new estimator; `alpha` is clamped into (0, 1] (0.05 smooths over ~20 steps).
    pub fn new(alpha: f64) -> GnsEstimator {
        let alpha = if alpha.is_finite() {
            alpha.clamp(1e-6, 1.0)
        } else {
            0.05
        };
        GnsEstimator {
            alpha,
            grad_sq: None,
            trace_cov: None,
            samples: 0,
        }
    }

    /// Adds the squared gradient norms over `small` and `big` samples of one step.
    pub fn record(
        &mut self,
        small: u32,
        small_sq_norm: f64,
        big: u32,
        big_sq_norm: f64,
    ) -> Result<(), GnsSampleError> {
        if small == 0 || small >= big {
            return Err(GnsSampleError::BatchSizes);
        }
        if !(small_sq_norm.is_finite() && big_sq_norm.is_finite())
            || small_sq_norm < 0.0
            || big_sq_norm < 0.0
        {
            return Err(GnsSampleError::Norms);
        }
        let (b, bb) = (f64::from(small), f64::from(big));
        let grad_sq = (bb * big_sq_norm - b * small_sq_norm) / (bb - b);
        let trace_cov = (small_sq_norm - big_sq_norm) / (1.0 / b - 1.0 / bb);
        let alpha = self.alpha;
        let smooth = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| o + alpha * (new - o)));
        self.grad_sq = smooth(self.grad_sq, grad_sq);
        self.trace_cov = smooth(self.trace_cov, trace_cov);
        self.samples += 1;
        Ok(())
    }

    /// φ from the smoothed values; `None` before any sample or while either
    /// smoothed value is not positive (the estimate is then meaningless).
    pub fn noise_scale(&self) -> Option<f64> {
        match (self.trace_cov, self.grad_sq) {
            (Some(tr), Some(g)) if tr > 0.0 && g > 0.0 => Some(tr / g),
            _ => None,
        }
    }

    /// The smoothed |G|² estimate, once a sample was accepted.
    pub fn grad_sqr(&self) -> Option<f64> {
        self.grad_sq
    }

    /// The smoothed tr Σ estimate, once a sample was accepted.
    pub fn grad_var(&self) -> Option<f64> {
        self.trace_cov
    }

    /// Number of samples accepted so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

impl Default for GnsEstimator {
    fn default() -> Self {
        GnsEstimator::new(0.05)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn same_batch_sizes_and_bad_norms_are_rejected() {
        let mut est = GnsEstimator::default();
        assert_eq!(
            est.record(32, 1.0, 32, 1.0),
            Err(GnsSampleError::BatchSizes)
        );
        assert_eq!(
            est.record(64, 1.0, 32, 1.0),
            Err(GnsSampleError::BatchSizes)
        );
        assert_eq!(est.record(0, 1.0, 32, 1.0), Err(GnsSampleError::BatchSizes));
        assert_eq!(est.record(8, f64::NAN, 32, 1.0), Err(GnsSampleError::Norms));
        assert_eq!(est.record(8, 1.0, 32, -1.0), Err(GnsSampleError::Norms));
        assert_eq!(est.noise_scale(), None);
        assert_eq!(est.samples(), 0);
    }

    #[test]
    fn recovers_hand_computed_statistics() {
        // E|g_b|² = |G|² + tr Σ / b exactly: with |G|² = 2 and tr Σ = 40, φ = 20.
        let mut est = GnsEstimator::new(0.1);
        for _ in 0..5 {
            est.record(8, 2.0 + 40.0 / 8.0, 64, 2.0 + 40.0 / 64.0)
                .expect("valid");
        }
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1.0);
        assert!(close(est.grad_sqr().expect("observed"), 2.0));
        assert!(close(est.grad_var().expect("observed"), 40.0));
        assert!(close(est.noise_scale().expect("observed"), 20.0));
    }

    #[test]
    fn smooths_each_term_before_the_ratio() {
        let mut est = GnsEstimator::new(0.5);
        est.record(1, 3.0, 2, 2.0).expect("valid"); // |G|² = 1, tr Σ = 2
        est.record(1, 5.0, 2, 3.0).expect("valid"); // |G|² = 1, tr Σ = 4
        assert_eq!(est.grad_sqr(), Some(1.0));
        assert_eq!(est.grad_var(), Some(3.0));
        assert_eq!(est.noise_scale(), Some(3.0));
    }

    proptest! {
        /// With exact expected norms E|g_b|² = |G|² + tr Σ / b the estimator
        /// recovers φ = tr Σ / |G|², whatever the two batch sizes.
        #[test]
        fn recovers_the_noise_scale_from_exact_norms(
            g in 1e-3f64..1e3, phi in 1e-2f64..1e5, b in 1u32..512, extra in 1u32..4096,
        ) {
            let big = b + extra;
            let tr = phi * g;
            let mut est = GnsEstimator::new(0.3);
            for _ in 0..3 {
                est.record(b, g + tr / f64::from(b), big, g + tr / f64::from(big)).expect("valid");
            }
            let got = est.noise_scale().expect("positive");
            prop_assert!((got - phi).abs() <= 1e-6 * phi.max(1.0), "got {got}, want {phi}");
        }

        /// Zero-mean noise on the norms averages out: the smoothed ratio is close
        /// to φ although single-step estimates are often negative.
        #[test]
        fn smoothing_averages_out_noise(seed in 0u64..1000) {
            let (g, phi, b, big) = (1.0f64, 200.0f64, 16u32, 256u32);
            let tr = phi * g;
            let mut est = GnsEstimator::new(0.01);
            let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            let mut noise = || {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 11) as f64 / (1u64 << 53) as f64) - 0.5
            };
            for _ in 0..5000 {
                let small = (g + tr / f64::from(b)) * (1.0 + 0.8 * noise());
                let large = (g + tr / f64::from(big)) * (1.0 + 0.8 * noise());
                est.record(b, small.max(0.0), big, large.max(0.0)).expect("valid");
            }
            let got = est.noise_scale().expect("positive");
            prop_assert!((got / phi - 1.0).abs() < 0.5, "got {got}, want {phi}");
        }
    }
}
