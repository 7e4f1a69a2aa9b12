//! Learning-rate factors for a batch-size change (docs/design.md, "Learning rate").
//!
//! The tuner sends a factor with each assignment it writes; the agent uses the same
//! rules when it changes the batch size on its own (out-of-memory fall-back).

/// How the learning rate follows the batch size. The same four rules as the wire's
/// `iadeep.v1.LrScalingRule` (the proto crate converts its enum into this one), kept
/// here so that the objective, and the agent SDK through it, need no protobuf runtime.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LrScalingRule {
    /// Leave the learning rate alone.
    #[default]
    Unspecified,
    /// Proportional to the batch size (Goyal et al.).
    Linear,
    /// Proportional to the square root of the batch size.
    Sqrt,
    /// AdaScale's gain from the gradient noise scale, or the square-root rule without it.
    Adascale,
}

/// Factor to multiply the learning rate at `m0` by when training at `batch_size`.
///
/// `noise_scale` is φ; AdaScale's gain for scale s = m/m0 is
/// r = (σ² + μ²)/(σ²/s + μ²) with σ² = tr Σ/m0 and μ² = |G|², i.e.
/// r = m(φ + m0) / (m0(φ + m)). Without φ, AdaScale falls back to the
/// square-root rule, which lies between its two limits (1 and linear).
/// An unspecified rule means "do not touch the learning rate".
pub fn lr_factor(
    rule: impl Into<LrScalingRule>,
    m0: u32,
    batch_size: u32,
    noise_scale: Option<f64>,
) -> f64 {
    if m0 == 0 || batch_size == 0 {
        return 1.0;
    }
    let (m0, m) = (f64::from(m0), f64::from(batch_size));
    match rule.into() {
        LrScalingRule::Unspecified => 1.0,
        LrScalingRule::Linear => m / m0,
        LrScalingRule::Sqrt => (m / m0).sqrt(),
        LrScalingRule::Adascale => match noise_scale.filter(|phi| phi.is_finite() && *phi >= 0.0) {
            Some(phi) => m * (phi + m0) / (m0 * (phi + m)),
            None => (m / m0).sqrt(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_give_their_textbook_factors() {
        assert_eq!(lr_factor(LrScalingRule::Linear, 128, 256, None), 2.0);
        assert_eq!(lr_factor(LrScalingRule::Sqrt, 128, 512, None), 2.0);
        assert_eq!(lr_factor(LrScalingRule::Unspecified, 128, 512, None), 1.0);
        assert_eq!(
            lr_factor(LrScalingRule::Adascale, 128, 128, Some(50.0)),
            1.0
        );
    }

    #[test]
    fn adascale_hand_computed() {
        // φ = 32, m0 = 32, m = 128: r = (1 + 1)/(0.25 + 1) = 1.6.
        let r = lr_factor(LrScalingRule::Adascale, 32, 128, Some(32.0));
        assert!((r - 1.6).abs() < 1e-12, "{r}");
        // Without φ AdaScale falls back to the square-root rule.
        assert_eq!(lr_factor(LrScalingRule::Adascale, 32, 128, None), 2.0);
    }

    proptest::proptest! {
        #[test]
        fn adascale_gain_between_one_and_scale(m0 in 1u32..1024, s in 1u32..64, phi in 0.0f64..1e5) {
            let r = lr_factor(LrScalingRule::Adascale, m0, m0 * s, Some(phi));
            proptest::prop_assert!(r >= 1.0 - 1e-12 && r <= f64::from(s) + 1e-9);
        }
    }

    #[test]
    fn adascale_lies_between_one_and_linear() {
        // Noise-dominated gradients (huge φ): close to linear; tiny φ: close to 1.
        let noisy = lr_factor(LrScalingRule::Adascale, 100, 400, Some(1e9));
        let clean = lr_factor(LrScalingRule::Adascale, 100, 400, Some(1e-9));
        assert!((noisy - 4.0).abs() < 1e-5, "{noisy}");
        assert!((clean - 1.0).abs() < 1e-5, "{clean}");
        let mid = lr_factor(LrScalingRule::Adascale, 100, 400, Some(100.0));
        assert!(mid > 1.0 && mid < 4.0, "{mid}");
    }
}
