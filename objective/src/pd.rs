//! Performance degradation (PD), the objective iadeep minimises, in exactly one place.
//!
//! For a task with submitted batch size `m0` running at batch size `m` (docs/design.md,
//! "The objective"):
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

use crate::{ObjectiveError, Result};

fn positive(name: &str, value: f64) -> Result<f64> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(ObjectiveError::InvalidInput(format!(
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
        Some(phi) => Err(ObjectiveError::InvalidInput(format!(
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
    }
}
