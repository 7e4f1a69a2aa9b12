//! Calibrated 90 % predictive intervals: split-conformal bands from residuals of
//! predictions made without the samples they predict.
//!
//! A residual is `ln(y) − ln(ŷ)` (measured over predicted slowdown, in log so the
//! band is relative and fits heavy tails). For `n` residuals, the band is the
//! `⌊(n+1)·0.05⌋`-th smallest and the `⌈(n+1)·0.95⌉`-th smallest: if the next
//! prediction's residual is exchangeable with those, it falls inside with
//! probability at least 90 % (split conformal prediction). The band always contains
//! 0, so the point prediction lies inside its own interval.
//!
//! Errors on models never seen are larger than on jobs seen before, so the
//! residuals come in two classes (Mondrian conformal prediction), each used for the
//! predictions of its kind:
//! - **known**: every training sample predicted by the trees that did not draw it
//!   (out of bag), with the linear base and the per-job effects of the whole
//!   window; what a prediction of a job seen before faces;
//! - **new model**: every training sample predicted by a model fitted without its
//!   models at all (the models of the window are split into a few groups, and each
//!   group's samples are predicted by a model fitted on the samples that involve
//!   none of them); what a prediction of a model never seen faces.
//!
//! Both are functions of the window alone, so a predictor rebuilt from the store
//! has the same intervals as the one that stopped. A class with fewer than 19
//! residuals, too few to hold 90 %, borrows the other class's; without either the
//! model states the trees' spread instead.

/// The coverage the bands aim at, in percent.
pub const COVERAGE_PCT: usize = 90;

/// A band of log-residuals: a prediction `ŷ` has the interval
/// `[ŷ·exp(lower), ŷ·exp(upper)]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Band {
    /// At most 0.
    pub lower: f64,
    /// At least 0.
    pub upper: f64,
}

impl Band {
    /// The conformal band of `residuals` (NaNs ignored), or `None` when there are
    /// too few for [`COVERAGE_PCT`].
    pub fn of(residuals: &[f64]) -> Option<Band> {
        let mut sorted: Vec<f64> = residuals.iter().copied().filter(|r| !r.is_nan()).collect();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        // 1-based ranks of the order statistics that bound the band, ⌊(n+1)·5 %⌋
        // and ⌈(n+1)·95 %⌉, in integers (0.95 · 20 is not 19 in floats).
        let tail_pct = (100 - COVERAGE_PCT) / 2;
        let low = (n + 1) * tail_pct / 100;
        let high = ((n + 1) * (100 - tail_pct)).div_ceil(100);
        if low < 1 || high > n {
            return None;
        }
        Some(Band {
            lower: sorted[low - 1].min(0.0),
            upper: sorted[high - 1].max(0.0),
        })
    }

    /// The interval of the prediction `slowdown`.
    pub fn around(&self, slowdown: f64) -> (f64, f64) {
        (slowdown * self.lower.exp(), slowdown * self.upper.exp())
    }
}

/// The bands of a fitted model.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Calibration {
    known: Option<Band>,
    new_model: Option<Band>,
    /// How many residuals each band came from, for logs.
    counts: (usize, usize),
}

impl Calibration {
    /// The bands of the residuals of known jobs and of new models.
    pub fn new(known: &[f64], new_model: &[f64]) -> Calibration {
        Calibration {
            known: Band::of(known),
            new_model: Band::of(new_model),
            counts: (known.len(), new_model.len()),
        }
    }

    /// The band for a prediction involving a model never seen (`new_model`) or
    /// not: its class's, else the other class's, else none.
    pub fn band(&self, new_model: bool) -> Option<Band> {
        if new_model {
            self.new_model.or(self.known)
        } else {
            self.known.or(self.new_model)
        }
    }

    /// Residuals behind the known and new-model bands.
    pub fn counts(&self) -> (usize, usize) {
        self.counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn the_band_takes_the_conformal_order_statistics() {
        // 19 residuals: the 1st and the 19th, the least number that holds 90 %.
        let residuals: Vec<f64> = (0..19).map(|i| f64::from(i) / 10.0 - 0.9).collect();
        let band = Band::of(&residuals).expect("19 are enough");
        assert_eq!((band.lower, band.upper), (-0.9, 0.9));
        assert_eq!(Band::of(&residuals[..18]), None);
        // 99 residuals: the 5th and the 95th.
        let residuals: Vec<f64> = (1..=99).map(f64::from).map(|r| r - 50.0).collect();
        let band = Band::of(&residuals).expect("band");
        assert_eq!((band.lower, band.upper), (-45.0, 45.0));
        // All positive: the band still holds the point prediction.
        let band = Band::of(&[1.0; 30]).expect("band");
        assert_eq!((band.lower, band.upper), (0.0, 1.0));
        let (lo, hi) = band.around(2.0);
        assert_eq!(lo, 2.0);
        assert!((hi - 2.0 * 1f64.exp()).abs() < 1e-12);
    }

    /// The guarantee: fresh residuals from the same distribution fall inside the
    /// band at least 90 % of the time on average.
    #[test]
    fn fresh_residuals_are_covered_about_ninety_percent_of_the_time() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut draw = || {
            let u: f64 = rng.random_range(-1.0..1.0);
            u * u * u * 2.0
        };
        let mut inside = 0;
        let trials = 400;
        let fresh = 50;
        for _ in 0..trials {
            let residuals: Vec<f64> = (0..40).map(|_| draw()).collect();
            let band = Band::of(&residuals).expect("band");
            for _ in 0..fresh {
                let r = draw();
                inside += usize::from(band.lower <= r && r <= band.upper);
            }
        }
        let coverage = inside as f64 / f64::from(trials * fresh);
        assert!((0.9..0.95).contains(&coverage), "{coverage}");
    }

    #[test]
    fn a_class_without_enough_residuals_borrows_the_other() {
        let wide: Vec<f64> = (0..40).map(|i| f64::from(i) - 20.0).collect();
        let narrow: Vec<f64> = (0..40).map(|i| (f64::from(i) - 20.0) / 100.0).collect();
        let both = Calibration::new(&narrow, &wide);
        assert!(both.band(true).expect("new").upper > both.band(false).expect("known").upper);
        let known_only = Calibration::new(&narrow, &wide[..5]);
        assert_eq!(known_only.band(true), known_only.band(false));
        assert_eq!(Calibration::new(&[], &[]).band(true), None);
        assert_eq!(known_only.counts(), (40, 5));
    }
}
