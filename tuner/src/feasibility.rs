//! The probability that a configuration runs at all (does not run out of memory), learned
//! only from what the search has observed.
//!
//! Why: when the memory of the co-located tasks is unknown (no memory samples yet, or a
//! world such as Gavel's measurements that records none), the only hard knowledge is the
//! monotonicity of memory in every task's batch size: a configuration at or below a measured
//! one (in every task) runs, one at or above a configuration that ran out of memory does not.
//! Between the two the search used to treat every configuration as feasible, and on Gavel's
//! K80 surfaces about a fifth of GP-LCB's rounds were crashes. Constrained Bayesian
//! optimisation (Gardner et al., "Bayesian optimization with inequality constraints",
//! ICML 2014; Gelbart et al., "Bayesian optimization with unknown constraints", UAI 2014)
//! weighs the acquisition by the probability that the constraint holds; this module supplies
//! that probability.
//!
//! The model is deliberately small, because a search has a handful of observations: the
//! memory threshold, walked upwards from what is known to run, is a geometric variable with
//! a hazard h per doubling of batch size. A configuration's *excess* is how many doublings
//! (summed over tasks, because the card holds the sum of the tasks' memory) it lies above the
//! nearest configuration that ran; its *shortfall* is how many doublings it lies below the
//! nearest configuration that ran out of memory. With excess e and no out-of-memory above it
//! P(runs) = (1 − h)^e; with a shortfall s the threshold is known to lie within e + s
//! doublings and P(runs) = ((1 − h)^e − (1 − h)^(e+s)) / (1 − (1 − h)^(e+s)), the truncated
//! geometric (it tends to s / (e + s) as h → 0). Both are monotone: non-increasing when any
//! batch size grows, 1 at or below a success and 0 at or above an out-of-memory report. The
//! hazard is the posterior mean of a Beta prior updated with the search's own probes: a probe
//! that ran with excess e survived e doublings, one that failed survived e − 1 and failed one.

use crate::error::{Result, TunerError};

/// The prior of the hazard per doubling.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FeasibilityParams {
    /// Prior mean of the probability that one more doubling of some task's batch size, past
    /// what is known to run, runs out of memory. In (0, 1).
    pub prior_hazard: f64,
    /// Weight of that prior, in pseudo-doublings observed. Positive.
    pub prior_weight: f64,
}

impl Default for FeasibilityParams {
    /// A hazard of 0.25 per doubling worth 4 doublings of evidence: m0 is what the user
    /// submitted, usually close to what fits a card alone, so two tasks on one card rarely
    /// take several doublings more; 4 pseudo-doublings let a few probes of the search itself
    /// override it. Chosen on the Gavel benchmark's tuning seeds (see
    /// docs/tuner-experiments.md, "Feasibility prior").
    fn default() -> Self {
        FeasibilityParams {
            prior_hazard: 0.25,
            prior_weight: 4.0,
        }
    }
}

impl FeasibilityParams {
    /// Validates the parameters.
    pub fn check(&self) -> Result<()> {
        let valid = self.prior_hazard > 0.0
            && self.prior_hazard < 1.0
            && self.prior_weight.is_finite()
            && self.prior_weight > 0.0;
        if !valid {
            return Err(TunerError::InvalidParams(format!(
                "the feasibility prior needs a hazard in (0, 1) and a positive finite weight, got {self:?}"
            )));
        }
        Ok(())
    }
}

/// The learned hazard: the prior plus the search's own probes.
#[derive(Clone, Debug, PartialEq)]
pub struct Feasibility {
    params: FeasibilityParams,
    /// Doublings past a known success that ran.
    survived: f64,
    /// Probes past a known success that ran out of memory.
    failed: f64,
}

impl Feasibility {
    /// The prior alone.
    pub fn new(params: FeasibilityParams) -> Result<Feasibility> {
        params.check()?;
        Ok(Feasibility {
            params,
            survived: 0.0,
            failed: 0.0,
        })
    }

    /// Records a probe made `excess` doublings past the nearest configuration known to run
    /// at the time; `ran` = it did not run out of memory. Probes within what was known to run
    /// (excess 0) carry no information and change nothing.
    pub fn record(&mut self, excess: f64, ran: bool) {
        if !(excess.is_finite() && excess > 0.0) {
            return;
        }
        if ran {
            self.survived += excess;
        } else {
            self.survived += (excess - 1.0).max(0.0);
            self.failed += 1.0;
        }
    }

    /// Posterior mean of the hazard per doubling.
    pub fn hazard(&self) -> f64 {
        let FeasibilityParams {
            prior_hazard,
            prior_weight,
        } = self.params;
        (prior_hazard * prior_weight + self.failed) / (prior_weight + self.survived + self.failed)
    }

    /// P(runs) of a configuration `excess` doublings above the nearest success and
    /// `shortfall` doublings below the nearest out-of-memory report (`None`: none above it).
    pub fn probability(&self, excess: f64, shortfall: Option<f64>) -> f64 {
        if excess <= 0.0 {
            return 1.0;
        }
        let survive = 1.0 - self.hazard();
        let beyond = survive.powf(excess);
        match shortfall {
            None => beyond,
            Some(s) if s <= 0.0 => 0.0,
            Some(s) => {
                let within = 1.0 - survive.powf(excess + s);
                if within <= 1e-12 {
                    s / (excess + s)
                } else {
                    ((beyond - survive.powf(excess + s)) / within).clamp(0.0, 1.0)
                }
            }
        }
    }
}

/// Doublings (summed over tasks) by which `point` exceeds the nearest of `references`, all
/// as log2 batch sizes, `references` row-major with `point.len()` columns; `None` when there
/// is no reference.
pub fn excess_over(references: &[f64], point: &[f64]) -> Option<f64> {
    nearest_gap(references, point, |reference, p| p - reference)
}

/// Doublings (summed over tasks) `point` must grow to reach the nearest of `ooms` (row-major
/// log2 batch sizes); 0 at or above one; `None` when there is none.
pub fn shortfall_below(ooms: &[f64], point: &[f64]) -> Option<f64> {
    nearest_gap(ooms, point, |oom, p| oom - p)
}

/// The smallest, over the rows of `references`, of the summed positive `gap(reference, p)`
/// per task.
fn nearest_gap(references: &[f64], point: &[f64], gap: impl Fn(f64, f64) -> f64) -> Option<f64> {
    references
        .chunks_exact(point.len())
        .map(|r| {
            r.iter()
                .zip(point)
                .map(|(&a, &p)| gap(a, p).max(0.0))
                .sum::<f64>()
        })
        .reduce(f64::min)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn model() -> Feasibility {
        Feasibility::new(FeasibilityParams::default()).expect("valid")
    }

    #[test]
    fn hand_computed_probabilities() {
        let f = model();
        assert_eq!(f.hazard(), 0.25);
        assert_eq!(f.probability(0.0, None), 1.0);
        assert!((f.probability(2.0, None) - 0.5625).abs() < 1e-12);
        // Between a success and an OOM one doubling either side: (1 − h) / (2 − h).
        assert!((f.probability(1.0, Some(1.0)) - 0.75 / 1.75).abs() < 1e-12);
        assert_eq!(f.probability(1.0, Some(0.0)), 0.0);
    }

    #[test]
    fn probes_update_the_hazard() {
        let mut f = model();
        f.record(2.0, true);
        f.record(2.0, true);
        // (0.25·4 + 0) / (4 + 4) = 0.125.
        assert!((f.hazard() - 0.125).abs() < 1e-12);
        f.record(1.0, false);
        // (1 + 1) / (4 + 4 + 0 + 1) = 2 / 9.
        assert!((f.hazard() - 2.0 / 9.0).abs() < 1e-12);
        f.record(0.0, false);
        assert!((f.hazard() - 2.0 / 9.0).abs() < 1e-12);
    }

    #[test]
    fn distances_in_doublings() {
        let successes = [4.0, 4.0, 6.0, 3.0];
        assert_eq!(excess_over(&successes, &[5.0, 5.0]), Some(2.0));
        assert_eq!(excess_over(&successes, &[3.0, 3.0]), Some(0.0));
        assert_eq!(excess_over(&[], &[3.0, 3.0]), None);
        assert_eq!(shortfall_below(&[6.0, 6.0], &[5.0, 5.0]), Some(2.0));
        assert_eq!(shortfall_below(&[6.0, 6.0], &[7.0, 6.0]), Some(0.0));
    }

    proptest! {
        /// Monotone: more excess never raises P(runs), more shortfall never lowers it, and
        /// it stays a probability whatever the evidence.
        #[test]
        fn probability_is_monotone(
            e in 0.0f64..8.0, de in 0.0f64..4.0, s in 0.0f64..8.0, ds in 0.0f64..4.0,
            probes in proptest::collection::vec((0.0f64..4.0, any::<bool>()), 0..12),
        ) {
            let mut f = model();
            for (x, ran) in probes {
                f.record(x, ran);
            }
            let p = f.probability(e, Some(s));
            prop_assert!((0.0..=1.0).contains(&p));
            prop_assert!(f.probability(e + de, Some(s)) <= p + 1e-12);
            prop_assert!(f.probability(e, Some(s + ds)) >= p - 1e-12);
            prop_assert!(f.probability(e, None) >= p - 1e-12);
        }

        /// Monotone in the batch sizes themselves: growing any task's size never raises
        /// P(runs), whatever successes and OOMs were recorded.
        #[test]
        fn probability_never_rises_with_a_batch_size(
            successes in proptest::collection::vec(0.0f64..8.0, 2..10),
            ooms in proptest::collection::vec(0.0f64..8.0, 0..8),
            x in proptest::collection::vec(0.0f64..8.0, 2),
            grow in 0.0f64..3.0, task in 0usize..2,
        ) {
            let (successes, ooms) = (&successes[..successes.len() / 2 * 2], &ooms[..ooms.len() / 2 * 2]);
            let mut y = x.clone();
            y[task] += grow;
            let f = model();
            let p = |pt: &[f64]| {
                f.probability(
                    excess_over(successes, pt).expect("a success"),
                    shortfall_below(ooms, pt),
                )
            };
            prop_assert!(p(&y) <= p(&x) + 1e-12, "{} > {}", p(&y), p(&x));
        }
    }
}
