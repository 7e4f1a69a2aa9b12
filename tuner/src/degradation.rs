//! The tuner's objective: performance degradation (PD), in exactly one place.
//!
//! For a task with submitted batch size `m0` running at batch size `m` (DESIGN.md):
//! - interference IF = Tco(m) / T(m),
//! - throughput drop DT = (m0 / T(m0)) / (m / T(m)),
//! - statistical efficiency E(m) = (φ + m0) / (φ + m) with φ the gradient noise scale,
//! - **PD = IF · DT / E(m)**.
//!
//! PD divides by E: a larger batch is *less* statistically efficient per sample, so it must
//! raise PD, not lower it (the reference implementation multiplies, which rewards large
//! batches backwards). T(m) cancels out of IF·DT, so PD is goodput alone at m0 divided by
//! goodput co-located at m; the closed loop therefore only needs the solo step time at m0
//! and the measured co-located step time at m ([`PdInput`]).

use crate::error::{Result, TunerError};

fn positive(name: &str, value: f64) -> Result<f64> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(TunerError::InvalidInput(format!(
            "{name} must be a positive finite number, got {value}"
        )))
    }
}

/// Statistical efficiency E(m) = (φ + m0) / (φ + m); `None` for φ means "no gradient
/// statistics reported", and then E = 1 (PD is throughput-only).
pub fn statistical_efficiency(noise_scale: Option<f64>, m0: f64, m: f64) -> Result<f64> {
    positive("m0", m0)?;
    positive("m", m)?;
    match noise_scale {
        None => Ok(1.0),
        Some(phi) if phi.is_finite() && phi >= 0.0 => Ok((phi + m0) / (phi + m)),
        Some(phi) => Err(TunerError::InvalidInput(format!(
            "gradient noise scale must be finite and non-negative, got {phi}"
        ))),
    }
}

/// IF = Tco(m) / T(m).
pub fn interference(co_step_s: f64, solo_step_s: f64) -> Result<f64> {
    Ok(positive("co-located step time", co_step_s)? / positive("solo step time", solo_step_s)?)
}

/// DT = (m0 / T(m0)) / (m / T(m)).
pub fn throughput_drop(m0: f64, solo_step_s_m0: f64, m: f64, solo_step_s_m: f64) -> Result<f64> {
    let alone_m0 = positive("m0", m0)? / positive("solo step time at m0", solo_step_s_m0)?;
    let alone_m = positive("m", m)? / positive("solo step time at m", solo_step_s_m)?;
    Ok(alone_m0 / alone_m)
}

/// PD from its three factors: IF · DT / E.
pub fn pd_from_factors(interference: f64, throughput_drop: f64, efficiency: f64) -> Result<f64> {
    Ok(
        positive("interference", interference)? * positive("throughput drop", throughput_drop)?
            / positive("statistical efficiency", efficiency)?,
    )
}

/// What the closed loop knows about one task for one measured configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdInput {
    /// Submitted batch size m0 (the one the user's learning rate was tuned for).
    pub m0: f64,
    /// Step time alone at m0, seconds.
    pub solo_step_s_m0: f64,
    /// Current batch size m.
    pub m: f64,
    /// Measured co-located step time at m, seconds.
    pub co_step_s: f64,
    /// Gradient noise scale φ, if the task reports gradient statistics.
    pub noise_scale: Option<f64>,
}

impl PdInput {
    /// PD = (m0 / T(m0)) / (m / Tco(m)) / E(m): goodput alone at m0 over goodput co-located at m.
    pub fn pd(&self) -> Result<f64> {
        let alone =
            positive("m0", self.m0)? / positive("solo step time at m0", self.solo_step_s_m0)?;
        let co = positive("m", self.m)? / positive("co-located step time", self.co_step_s)?;
        let efficiency = statistical_efficiency(self.noise_scale, self.m0, self.m)?;
        Ok(alone / co / efficiency)
    }
}

/// Parameters of the gradient-noise-scale estimator.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GnsParams {
    /// Weight of a new observation in the exponential moving averages, in (0, 1].
    pub ema_weight: f64,
}

impl Default for GnsParams {
    /// 0.1: the two norms are noisy per step; about ten steps of memory smooths them without
    /// lagging much behind φ, which drifts slowly over training.
    fn default() -> Self {
        GnsParams { ema_weight: 0.1 }
    }
}

impl GnsParams {
    /// Validates the parameters.
    pub fn check(&self) -> Result<()> {
        if self.ema_weight.is_finite() && self.ema_weight > 0.0 && self.ema_weight <= 1.0 {
            Ok(())
        } else {
            Err(TunerError::InvalidParams(format!(
                "ema_weight must be in (0, 1], got {}",
                self.ema_weight
            )))
        }
    }
}

/// Gradient noise scale φ = tr(Σ) / |G|² from two gradient norms of the same step taken at
/// two *different* batch sizes b < B (e.g. one micro-batch and the accumulated batch):
/// |G|² ≈ (B|g_B|² − b|g_b|²)/(B − b), tr Σ ≈ (|g_b|² − |g_B|²)/(1/b − 1/B). Each estimate is
/// unbiased but very noisy, so both are smoothed with an EMA *before* taking the ratio (the
/// ratio of noisy estimates is biased and can be negative).
#[derive(Clone, Debug, PartialEq)]
pub struct GnsEstimator {
    params: GnsParams,
    grad_sqr: Option<f64>,
    grad_var: Option<f64>,
}

impl GnsEstimator {
    /// A new estimator with no observations.
    pub fn new(params: GnsParams) -> Result<Self> {
        params.check()?;
        Ok(GnsEstimator {
            params,
            grad_sqr: None,
            grad_var: None,
        })
    }

    /// Adds one step's squared gradient norms: `small_sq` = |g_b|² at batch `small`,
    /// `large_sq` = |g_B|² at batch `large`.
    pub fn observe(&mut self, small: f64, small_sq: f64, large: f64, large_sq: f64) -> Result<()> {
        positive("small batch size", small)?;
        positive("large batch size", large)?;
        if large <= small {
            return Err(TunerError::InvalidInput(format!(
                "the gradient noise scale needs two different batch sizes b < B, got b = {small}, B = {large}"
            )));
        }
        for (name, v) in [("|g_b|²", small_sq), ("|g_B|²", large_sq)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(TunerError::InvalidInput(format!(
                    "{name} must be finite and non-negative, got {v}"
                )));
            }
        }
        let g2 = (large * large_sq - small * small_sq) / (large - small);
        let tr = (small_sq - large_sq) / (1.0 / small - 1.0 / large);
        let w = self.params.ema_weight;
        self.grad_sqr = Some(self.grad_sqr.map_or(g2, |old| (1.0 - w) * old + w * g2));
        self.grad_var = Some(self.grad_var.map_or(tr, |old| (1.0 - w) * old + w * tr));
        Ok(())
    }

    /// Smoothed |G|² estimate.
    pub fn grad_sqr(&self) -> Option<f64> {
        self.grad_sqr
    }

    /// Smoothed tr Σ estimate.
    pub fn grad_var(&self) -> Option<f64> {
        self.grad_var
    }

    /// φ = tr Σ / |G|², or `None` before any observation or while the smoothed |G|² is not
    /// positive (then φ is undefined and callers must use E = 1). Clamped at 0.
    pub fn noise_scale(&self) -> Option<f64> {
        match (self.grad_var, self.grad_sqr) {
            (Some(tr), Some(g2)) if g2 > 0.0 => Some((tr / g2).max(0.0)),
            _ => None,
        }
    }
}

/// How the learning rate follows a batch-size change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LrRule {
    /// lr ∝ m (Goyal et al.).
    Linear,
    /// lr ∝ √m (Krizhevsky; Adam-style optimisers).
    Sqrt,
    /// AdaScale gain r = (σ² + μ²)/(σ²/s + μ²) for scale s = m/m0 (Johnson et al.); with
    /// σ² = tr Σ / m0 and μ² = |G|² this is (φ/m0 + 1)/(φ/m + 1).
    AdaScale,
}

impl std::str::FromStr for LrRule {
    type Err = TunerError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "linear" => Ok(LrRule::Linear),
            "sqrt" => Ok(LrRule::Sqrt),
            "adascale" => Ok(LrRule::AdaScale),
            other => Err(TunerError::InvalidInput(format!(
                "unknown learning-rate rule {other:?} (expected linear, sqrt or adascale)"
            ))),
        }
    }
}

impl LrRule {
    /// The factor to multiply the learning rate tuned for `m0` by when running at `m`.
    /// AdaScale needs the gradient noise scale; without it this is an error, not a guess.
    pub fn factor(self, m0: f64, m: f64, noise_scale: Option<f64>) -> Result<f64> {
        positive("m0", m0)?;
        positive("m", m)?;
        match self {
            LrRule::Linear => Ok(m / m0),
            LrRule::Sqrt => Ok((m / m0).sqrt()),
            LrRule::AdaScale => match noise_scale {
                Some(phi) if phi.is_finite() && phi >= 0.0 => {
                    Ok((phi / m0 + 1.0) / (phi / m + 1.0))
                }
                Some(phi) => Err(TunerError::InvalidInput(format!(
                    "gradient noise scale must be finite and non-negative, got {phi}"
                ))),
                None => Err(TunerError::InvalidInput(
                    "the AdaScale rule needs the task's gradient noise scale".to_owned(),
                )),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn pd_hand_computed() {
        // m0 = 64 at 0.2 s alone; now m = 128 at 0.5 s co-located; φ = 64.
        // goodput alone = 320, goodput co = 256, E = 128/192 = 2/3 → PD = 1.25 · 1.5 = 1.875.
        let input = PdInput {
            m0: 64.0,
            solo_step_s_m0: 0.2,
            m: 128.0,
            co_step_s: 0.5,
            noise_scale: Some(64.0),
        };
        assert!(close(input.pd().expect("valid"), 1.875));
        // The same through the three factors, with T(128) = 0.35 s alone.
        let i = interference(0.5, 0.35).expect("valid");
        let dt = throughput_drop(64.0, 0.2, 128.0, 0.35).expect("valid");
        let e = statistical_efficiency(Some(64.0), 64.0, 128.0).expect("valid");
        assert!(close(pd_from_factors(i, dt, e).expect("valid"), 1.875));
    }

    #[test]
    fn larger_batch_is_penalised_by_efficiency_not_rewarded() {
        let base = PdInput {
            m0: 32.0,
            solo_step_s_m0: 0.1,
            m: 64.0,
            co_step_s: 0.2,
            noise_scale: None,
        };
        let with_noise = PdInput {
            noise_scale: Some(10.0),
            ..base
        };
        assert!(with_noise.pd().expect("valid") > base.pd().expect("valid"));
    }

    #[test]
    fn rejects_bad_input() {
        let bad = PdInput {
            m0: 32.0,
            solo_step_s_m0: 0.0,
            m: 64.0,
            co_step_s: 0.2,
            noise_scale: None,
        };
        assert!(bad.pd().is_err());
        assert!(statistical_efficiency(Some(-1.0), 1.0, 2.0).is_err());
        assert!(LrRule::AdaScale.factor(1.0, 2.0, None).is_err());
    }

    #[test]
    fn gns_recovers_known_statistics() {
        // E|g_b|² = |G|² + tr Σ / b exactly: with |G|² = 2 and tr Σ = 40, φ = 20.
        let mut est = GnsEstimator::new(GnsParams::default()).expect("valid");
        for _ in 0..5 {
            est.observe(8.0, 2.0 + 40.0 / 8.0, 64.0, 2.0 + 40.0 / 64.0)
                .expect("valid");
        }
        assert!(close(est.grad_sqr().expect("observed"), 2.0));
        assert!(close(est.grad_var().expect("observed"), 40.0));
        assert!(close(est.noise_scale().expect("observed"), 20.0));
    }

    #[test]
    fn gns_smooths_and_refuses_equal_batches() {
        let mut est = GnsEstimator::new(GnsParams { ema_weight: 0.5 }).expect("valid");
        assert!(est.observe(8.0, 1.0, 8.0, 1.0).is_err());
        assert_eq!(est.noise_scale(), None);
        est.observe(1.0, 3.0, 2.0, 2.0).expect("valid"); // G² = 1, trΣ = 2
        est.observe(1.0, 5.0, 2.0, 3.0).expect("valid"); // G² = 1, trΣ = 4
        assert!(close(est.grad_sqr().expect("observed"), 1.0));
        assert!(close(est.grad_var().expect("observed"), 3.0));
        assert!(GnsEstimator::new(GnsParams { ema_weight: 0.0 }).is_err());
    }

    #[test]
    fn lr_factors_hand_computed() {
        assert!(close(
            LrRule::Linear.factor(32.0, 128.0, None).expect("valid"),
            4.0
        ));
        assert!(close(
            LrRule::Sqrt.factor(32.0, 128.0, None).expect("valid"),
            2.0
        ));
        // φ = 32: r = (1 + 1)/(0.25 + 1) = 1.6.
        assert!(close(
            LrRule::AdaScale
                .factor(32.0, 128.0, Some(32.0))
                .expect("valid"),
            1.6
        ));
        assert_eq!("sqrt".parse::<LrRule>().expect("known"), LrRule::Sqrt);
    }

    proptest! {
        #[test]
        fn pd_is_one_alone_at_m0(m0 in 1.0f64..4096.0, t in 1e-3f64..10.0, phi in proptest::option::of(0.0f64..1e5)) {
            let input = PdInput { m0, solo_step_s_m0: t, m: m0, co_step_s: t, noise_scale: phi };
            prop_assert!(close(input.pd().expect("valid"), 1.0));
        }

        #[test]
        fn pd_grows_with_interference(m0 in 1.0f64..4096.0, m in 1.0f64..4096.0, t in 1e-3f64..10.0,
                                      slow in 1.0f64..5.0, extra in 1e-3f64..5.0, phi in proptest::option::of(0.0f64..1e5)) {
            let a = PdInput { m0, solo_step_s_m0: t, m, co_step_s: t * slow, noise_scale: phi };
            let b = PdInput { co_step_s: t * (slow + extra), ..a };
            prop_assert!(b.pd().expect("valid") > a.pd().expect("valid"));
        }

        #[test]
        fn adascale_gain_between_one_and_scale(m0 in 1.0f64..1024.0, s in 1.0f64..64.0, phi in 0.0f64..1e5) {
            let r = LrRule::AdaScale.factor(m0, m0 * s, Some(phi)).expect("valid");
            prop_assert!(r >= 1.0 - 1e-12 && r <= s + 1e-9);
        }
    }
}
