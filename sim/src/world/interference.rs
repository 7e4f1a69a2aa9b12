//! How co-located jobs slow each other in the simulated world.
//!
//! Gavel measured pairs only. For a job k next to one co-runner j the world uses the
//! measured normalised throughput `a(k|j)` as is, under every model here. Write its
//! stall `p(k|j) = 1 / a(k|j) − 1`: the extra time per step, as a fraction of k's
//! solo step, that j's presence costs.
//!
//! **Three or more jobs** need a model, and it must not be the rule iadeep's predictor
//! composes with (the product of pairwise slowdowns; docs/design.md, "The world does not
//! share the models' assumptions"). The default is a **contention model**: the
//! co-runners compete for the same GPU time slices, so their stalls *add up* instead of
//! compounding, and every co-runner beyond the first costs a context-switch overhead
//! (cache and TLB refills when the scheduler rotates three or more contexts):
//!
//! `slowdown(k | S) = 1 + Σ_{j∈S} p(k|j) + σ · (|S| − 1)`
//!
//! With one co-runner this is exactly the measured pair. With two it is above the
//! product for mild pairs (`p(k|i)·p(k|j) < σ`) and below it for heavy ones, so a
//! predictor that multiplies pairs is wrong in both directions, as a real one would
//! be. σ ([`SWITCH_OVERHEAD`]) is an assumption: no public three-job measurement on
//! the Gavel GPUs exists to calibrate it, so it is a named parameter of the world.
//!
//! [`Interference::Product`] keeps the product rule (`--interference product`) so a
//! result can be checked under the predictor's own assumption.

use std::fmt;
use std::str::FromStr;

/// Context-switch overhead per co-runner beyond the first, as a fraction of the job's
/// solo step time (see the module docs).
pub const SWITCH_OVERHEAD: f64 = 0.05;

/// The model for three or more co-located jobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Interference {
    /// Stalls of the co-runners add up, plus `switch_overhead` per co-runner beyond
    /// the first (the default).
    Contention { switch_overhead: f64 },
    /// The product of the pairwise normalised throughputs (the predictor's rule).
    Product,
}

impl Default for Interference {
    fn default() -> Self {
        Interference::Contention {
            switch_overhead: SWITCH_OVERHEAD,
        }
    }
}

impl Interference {
    /// Normalised throughput of a job next to co-runners whose pairwise normalised
    /// throughputs with it (`a(k|j)`, each > 0) are `pair_ratios`.
    pub fn normalised_throughput(&self, pair_ratios: impl Iterator<Item = f64>) -> f64 {
        match *self {
            Interference::Product => pair_ratios.product(),
            Interference::Contention { switch_overhead } => {
                let (mut stall, mut count) = (0.0, 0usize);
                for ratio in pair_ratios {
                    stall += 1.0 / ratio - 1.0;
                    count += 1;
                }
                let switching = switch_overhead * count.saturating_sub(1) as f64;
                // A co-runner that speeds a job up (ratio > 1, negative stall) cannot
                // make it faster than the measured best: the slowdown stays positive.
                1.0 / (1.0 + stall + switching).max(f64::MIN_POSITIVE)
            }
        }
    }
}

impl fmt::Display for Interference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Interference::Contention { .. } => f.write_str("contention"),
            Interference::Product => f.write_str("product"),
        }
    }
}

impl FromStr for Interference {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "contention" => Ok(Interference::default()),
            "product" => Ok(Interference::Product),
            other => Err(format!(
                "unknown interference model {other:?} (contention or product)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_models_reproduce_a_measured_pair_exactly() {
        for ratio in [0.3, 0.55, 0.9, 1.0, 1.1] {
            for model in [Interference::default(), Interference::Product] {
                let got = model.normalised_throughput([ratio].into_iter());
                assert!((got - ratio).abs() < 1e-12, "{model}: {got} vs {ratio}");
            }
            assert_eq!(
                Interference::default().normalised_throughput(std::iter::empty()),
                1.0
            );
        }
    }

    #[test]
    fn contention_is_not_the_product_for_three_jobs_in_either_direction() {
        let contention = Interference::default();
        // Heavy pairs: stalls add, the product compounds them.
        let heavy = [0.5, 0.5];
        let product = Interference::Product.normalised_throughput(heavy.into_iter());
        let got = contention.normalised_throughput(heavy.into_iter());
        assert!((product - 0.25).abs() < 1e-12);
        // 1 / (1 + 1 + 1 + 0.05)
        assert!((got - 1.0 / 3.05).abs() < 1e-12, "{got}");
        assert!(got > product);
        // Mild pairs: the switching overhead dominates the cross term.
        let mild = [0.95, 0.95];
        let product = Interference::Product.normalised_throughput(mild.into_iter());
        let got = contention.normalised_throughput(mild.into_iter());
        assert!(got < product, "{got} vs {product}");
    }

    #[test]
    fn the_flag_parses_both_models_and_rejects_others() {
        assert_eq!(
            "contention".parse::<Interference>(),
            Ok(Interference::default())
        );
        assert_eq!("product".parse::<Interference>(), Ok(Interference::Product));
        assert!("sum".parse::<Interference>().is_err());
    }
}
