//! What an emulated agent measures: the statistics a real agent would report, with the
//! noise a real measurement has. Schedulers see these, never the world's values.
//!
//! - **Gradient noise scale.** The trainer hands its agent two squared gradient norms
//!   per step: over a micro-batch of `b = B/4` samples and over the whole batch of `B`
//!   (as `iadeep_eval::EmulatedJob` and the Python SDK do). The agent feeds them to the
//!   production estimator, [`iadeep_objective::GnsEstimator`] (exponentially smoothed,
//!   α = 0.05, the agent's default), and reports its φ. The norms are drawn around
//!   their expectations `E|g_b|² = |G|² + tr Σ / b`, with the world's φ = tr Σ / |G|²:
//!   the noise part `tr Σ / b` is scaled by a χ² variable with
//!   [`GRADIENT_NOISE_DIMENSIONS`] degrees of freedom over its mean (the squared norm of
//!   a Gaussian in that many independent directions), and the cross term `2 Gᵀ ξ` adds a
//!   normal with variance `4 |G|² tr Σ / (b · dims)`. With 1000 dimensions one step's
//!   noise term is off by ±4.5 % (one σ); at B = 128 the reported φ is off by about
//!   3 % (one σ) where φ = 50 and by about 30 % where φ = 2000 (the test measures it):
//!   the larger φ is against the batch, the harder |G|² is to see, as in real training.
//!   Between two reports the agent folds in the steps it ran, at most
//!   [`STEPS_PER_REPORT_MAX`] per report (enough for the average to forget its start).
//! - **Step time.** Each report's step time is the true one times a log-normal
//!   measurement noise (σ = `EngineParams::measurement_noise`, 2 %), and with
//!   probability [`STRAGGLER_PROBABILITY`] a straggler window (a data-loader stall,
//!   a garbage-collection pause, a neighbour's burst) inflates it by a factor drawn
//!   uniformly from [`STRAGGLER_SLOWDOWN`]. Stragglers are measurement outliers the
//!   tuner and predictor must be robust to; the job's real progress is unaffected.
//! - **Out-of-memory fall-back.** A fenced agent whose run needs more than its fence
//!   (see [`crate::engine`]) falls back as the real agent's `Agent::report_oom` does
//!   ([`EmulatedAgent::out_of_memory`]): to the largest batch size below the failed one
//!   that ran and whose measured peak leaves the one memory margin
//!   ([`iadeep_objective::MemoryMargin::DEFAULT`]) free on the card, else the largest
//!   below it that ran, else half of it; and it reports the smallest size that failed.

use std::collections::BTreeMap;

use iadeep_objective::{GnsEstimator, MemoryMargin};
use rand::Rng;

/// Independent directions of gradient noise (χ² degrees of freedom of a norm).
pub const GRADIENT_NOISE_DIMENSIONS: f64 = 1000.0;
/// At most this many steps' gradient norms go into the estimator between two reports.
pub const STEPS_PER_REPORT_MAX: u64 = 50;
/// Probability that a report's step time comes from a straggler window.
pub const STRAGGLER_PROBABILITY: f64 = 0.02;
/// Range of the factor a straggler window inflates a report's step time by.
pub const STRAGGLER_SLOWDOWN: (f64, f64) = (1.5, 3.0);
/// The agent's smoothing of the estimator (the agent SDK's default `gns_smoothing`).
pub const GNS_SMOOTHING: f64 = 0.05;

pub use iadeep_eval::random::standard_normal as normal;

/// The measuring side of one task's agent.
#[derive(Clone, Debug)]
pub struct EmulatedAgent {
    gns: GnsEstimator,
    /// Peak MiB measured at each batch size the job ran (the largest report of each).
    peaks: BTreeMap<u32, u64>,
    /// The largest batch size that ran since an out-of-memory error at or below it.
    largest_fit: Option<u32>,
    /// The smallest batch size that ran out of memory.
    smallest_oom: Option<u32>,
}

impl Default for EmulatedAgent {
    fn default() -> Self {
        EmulatedAgent {
            gns: GnsEstimator::new(GNS_SMOOTHING),
            peaks: BTreeMap::new(),
            largest_fit: None,
            smallest_oom: None,
        }
    }
}

impl EmulatedAgent {
    /// The job ran at `batch_size` with a measured peak of `peak_mib` (each report).
    pub fn ran(&mut self, batch_size: u32, peak_mib: u64) {
        let peak = self.peaks.entry(batch_size).or_insert(0);
        *peak = (*peak).max(peak_mib);
        self.largest_fit = self.largest_fit.max(Some(batch_size));
    }

    /// The smallest batch size that ran out of memory so far (what the agent reports).
    pub fn smallest_oom(&self) -> Option<u32> {
        self.smallest_oom
    }

    /// The job's allocation failed at `oom` on a card of `capacity_mib`: the batch size
    /// the agent falls back to, by the rule of the real agent's `Agent::report_oom`
    /// (`MemoryMargin::fallback_batch_size`, which the real agent's fall-back calls): the largest
    /// size below `oom` that ran and whose measured peak leaves the memory margin free
    /// on the card, else the largest size below it that ran, else half of `oom`. The
    /// real agent clamps the half to the job's bounds; here it is the largest of the
    /// job's `allowed` sizes (ascending) at or below the half, else the smallest
    /// allowed. A result not below `oom` means the job cannot run any smaller.
    pub fn out_of_memory(&mut self, oom: u32, capacity_mib: u64, allowed: &[u32]) -> u32 {
        let fallback = MemoryMargin::DEFAULT
            .fallback_batch_size(oom, &self.peaks, self.largest_fit, Some(capacity_mib))
            .unwrap_or_else(|| {
                let half = oom / 2;
                allowed
                    .iter()
                    .rev()
                    .find(|&&b| b <= half)
                    .or(allowed.first())
                    .copied()
                    .unwrap_or(oom)
            });
        // As the real agent's `mark_oom`: the smallest failure is kept, and a size at or
        // above it is no longer known to fit.
        self.smallest_oom = Some(self.smallest_oom.map_or(oom, |s| s.min(oom)));
        if self.largest_fit.is_some_and(|fit| fit >= oom) {
            self.largest_fit = None;
        }
        fallback
    }

    /// Folds in the gradient norms of `steps` steps at `batch_size` (clamped to
    /// `1..=STEPS_PER_REPORT_MAX`) in a world where φ is `true_phi`, and returns the
    /// estimate the agent reports (`None` while the estimator has none, or when the
    /// job has no gradient statistics: `true_phi` is `None`).
    pub fn observe_gradients(
        &mut self,
        rng: &mut impl Rng,
        true_phi: Option<f64>,
        batch_size: u32,
        steps: u64,
    ) -> Option<f64> {
        let phi = true_phi?;
        let big = batch_size.max(4);
        let small = (big / 4).max(1);
        // Scale-free: |G|² = 1, tr Σ = φ.
        let norm = |rng: &mut dyn rand::RngCore, b: u32| -> f64 {
            let noise = phi / f64::from(b);
            let chi = 1.0 + (2.0 / GRADIENT_NOISE_DIMENSIONS).sqrt() * normal(rng);
            let cross = (4.0 * noise / GRADIENT_NOISE_DIMENSIONS).sqrt() * normal(rng);
            (1.0 + noise * chi + cross).max(0.0)
        };
        for _ in 0..steps.clamp(1, STEPS_PER_REPORT_MAX) {
            let small_sq = norm(rng, small);
            let big_sq = norm(rng, big);
            if let Err(why) = self.gns.record(small, small_sq, big, big_sq) {
                tracing::debug!(?why, "emulated gradient norms ignored");
            }
        }
        self.gns.noise_scale()
    }
}

/// A report's step time: the true one with log-normal noise of relative size
/// `noise` and, now and then, a straggler window.
pub fn measured_step_time(rng: &mut impl Rng, true_step_s: f64, noise: f64) -> f64 {
    let mut measured = true_step_s * (noise * normal(rng)).exp();
    if rng.random_bool(STRAGGLER_PROBABILITY) {
        measured *= rng.random_range(STRAGGLER_SLOWDOWN.0..=STRAGGLER_SLOWDOWN.1);
    }
    measured
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn the_estimate_is_noisy_but_unbiased_enough() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for phi in [50.0, 2_000.0] {
            let mut errors = Vec::new();
            for _ in 0..40 {
                let mut agent = EmulatedAgent::default();
                let mut estimate = None;
                for _ in 0..10 {
                    estimate = agent.observe_gradients(&mut rng, Some(phi), 128, 1_000);
                }
                let estimate = estimate.expect("an estimate after 500 steps");
                errors.push(estimate / phi - 1.0);
            }
            let mean = errors.iter().sum::<f64>() / errors.len() as f64;
            let spread = (errors.iter().map(|e| e * e).sum::<f64>() / errors.len() as f64).sqrt();
            // Noisy: never exactly the world's value, spread of a few percent or more.
            assert!(errors.iter().all(|e| e.abs() > 1e-9), "{errors:?}");
            assert!(spread > 0.01, "phi {phi}: spread {spread}");
            // But an estimate of it: no large bias, no wild values.
            assert!(mean.abs() < 0.15, "phi {phi}: bias {mean}");
            assert!(spread < 0.5, "phi {phi}: spread {spread}");
        }
        let mut agent = EmulatedAgent::default();
        assert_eq!(agent.observe_gradients(&mut rng, None, 64, 10), None);
    }

    /// The fall-back is the real agent's (the same case as `iadeep_agent`'s own test of
    /// it): of the sizes that ran below the failed one, the largest whose measured peak
    /// leaves the memory margin free on the card; never a size at or above a failure.
    #[test]
    fn the_out_of_memory_fallback_is_the_real_agents() {
        let sizes = [16, 32, 64, 128, 256];
        let mut agent = EmulatedAgent::default();
        agent.ran(16, 3_000);
        agent.ran(32, 7_000);
        agent.ran(64, 7_900);
        // An 8 GiB card keeps 8192 × 0.95 − 256 = 7526 MiB usable: 64 (7900) does not
        // leave the margin, 32 (7000) does.
        assert_eq!(agent.out_of_memory(128, 8_192, &sizes), 32);
        assert_eq!(agent.smallest_oom(), Some(128));
        assert_eq!(agent.out_of_memory(32, 8_192, &sizes), 16);
        assert_eq!(agent.smallest_oom(), Some(32));
        // On a larger card 64 leaves the margin, but only sizes below the failure count.
        assert_eq!(agent.out_of_memory(64, 16_000, &sizes), 32);
        // A later failure at a larger size keeps the smallest.
        assert_eq!(agent.out_of_memory(256, 16_000, &sizes), 64);
        assert_eq!(agent.smallest_oom(), Some(32));
        // Nothing ran below: half of the failed size, as an allowed size.
        let mut fresh = EmulatedAgent::default();
        assert_eq!(fresh.out_of_memory(256, 16_000, &sizes), 128);
        assert_eq!(fresh.out_of_memory(48, 16_000, &sizes), 16);
        // At the smallest allowed size there is nowhere to go.
        assert_eq!(fresh.out_of_memory(16, 16_000, &sizes), 16);
    }

    #[test]
    fn step_times_carry_noise_and_rare_stragglers() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let draws: Vec<f64> = (0..20_000)
            .map(|_| measured_step_time(&mut rng, 1.0, 0.02))
            .collect();
        let stragglers = draws.iter().filter(|d| **d > 1.3).count() as f64 / draws.len() as f64;
        assert!(
            (stragglers - STRAGGLER_PROBABILITY).abs() < 0.005,
            "{stragglers}"
        );
        let mut usual: Vec<f64> = draws.iter().copied().filter(|d| *d <= 1.3).collect();
        usual.sort_by(f64::total_cmp);
        let median = usual[usual.len() / 2];
        assert!((median - 1.0).abs() < 0.005, "{median}");
        let p84 = usual[usual.len() * 84 / 100];
        assert!((p84 - 1.02).abs() < 0.005, "{p84}");
    }
}
