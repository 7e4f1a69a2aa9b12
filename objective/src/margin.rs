//! The one memory margin of a GPU (docs/design.md, "Memory safety"): what the placer never
//! reserves, what the tuner never assigns, and what the agent's out-of-memory fall-back
//! keeps free, defined once so the three never disagree about what fits.
//!
//! Why both a fraction and a fixed part: the fraction covers what grows with the card
//! and the jobs on it (allocator fragmentation, cuDNN/cuBLAS workspaces, estimation
//! error of the memory model); the fixed part covers what does not (the CUDA context
//! that each new process brings before its first allocation is reported).

use crate::{ObjectiveError, Result};

/// Memory of a card that is never handed out: `fraction` of the card plus `fixed_mib`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryMargin {
    /// Share of the card kept free, in [0, 0.9).
    pub fraction: f64,
    /// MiB kept free on top of the fraction.
    pub fixed_mib: f64,
}

impl MemoryMargin {
    /// The production margin: 5 % of the card plus 256 MiB.
    pub const DEFAULT: MemoryMargin = MemoryMargin {
        fraction: 0.05,
        fixed_mib: 256.0,
    };

    /// Refuses a margin that would make no sense (negative, non-finite, or 90 % or more
    /// of the card).
    pub fn check(&self) -> Result<()> {
        if !(self.fraction.is_finite() && (0.0..0.9).contains(&self.fraction)) {
            return Err(ObjectiveError::InvalidInput(format!(
                "memory margin fraction must be in [0, 0.9), got {}",
                self.fraction
            )));
        }
        if !(self.fixed_mib.is_finite() && self.fixed_mib >= 0.0) {
            return Err(ObjectiveError::InvalidInput(format!(
                "memory margin MiB must be finite and ≥ 0, got {}",
                self.fixed_mib
            )));
        }
        Ok(())
    }

    /// MiB of a card of `capacity_mib` that tasks may use together (never negative).
    pub fn usable_mib(&self, capacity_mib: f64) -> f64 {
        (capacity_mib * (1.0 - self.fraction) - self.fixed_mib).max(0.0)
    }

    /// What one task measured at `peak_mib` is reserved at once its measurement replaces
    /// a provisional reservation: the peak, the fraction of it and the fixed MiB on top.
    /// A peak varies from run to run (allocator fragmentation, cuDNN's workspace choice),
    /// and the agent fences the task there: a reservation at exactly one measured peak
    /// would make the task fail its own allocations.
    pub fn above_peak_mib(&self, peak_mib: f64) -> f64 {
        peak_mib * (1.0 + self.fraction) + self.fixed_mib
    }

    /// The batch size an agent falls back to after running out of memory at `oom`: the
    /// largest size below it that ran and whose measured peak (`peaks`, MiB by batch
    /// size) leaves this margin free on a card of `capacity_mib`, else the largest size
    /// below it known to have run (`largest_fit`, or any size with a peak); `None` when
    /// nothing below it ran. The one rule of the real agent and the simulator's emulated
    /// one, so both fall back alike.
    pub fn fallback_batch_size(
        &self,
        oom: u32,
        peaks: &std::collections::BTreeMap<u32, u64>,
        largest_fit: Option<u32>,
        capacity_mib: Option<u64>,
    ) -> Option<u32> {
        let within_margin = capacity_mib.and_then(|capacity| {
            peaks
                .range(..oom)
                .rev()
                .find(|(_, peak)| self.fits(**peak as f64, capacity as f64))
                .map(|(&b, _)| b)
        });
        within_margin.or_else(|| {
            largest_fit
                .filter(|&fit| fit < oom)
                .into_iter()
                .chain(peaks.range(..oom).map(|(&b, _)| b))
                .max()
        })
    }

    /// The memory fence of a task counted at `bound_mib` (its reservation, or its
    /// assignment's bound): what its agent lets its own allocator use, MiB. The bound
    /// plus the margin's fraction of it: a peak varies a few percent from one run of the
    /// same size to the next (allocator fragmentation), and the card keeps that fraction
    /// of itself free besides a fixed part, so every task on it may overshoot its bound
    /// by the fraction at once without touching another's memory. A fence at the bound
    /// itself would fail a task's allocations for no co-runner's sake.
    pub fn fence_mib(&self, bound_mib: f64) -> u64 {
        (bound_mib * (1.0 + self.fraction)).floor().max(0.0) as u64
    }

    /// Whether tasks needing `total_mib` together fit a card of `capacity_mib`.
    pub fn fits(&self, total_mib: f64, capacity_mib: f64) -> bool {
        total_mib <= self.usable_mib(capacity_mib)
    }

    /// [`MemoryMargin::fits`], except that one task with the card to itself may use the
    /// whole card: the margin protects co-runners from each other's estimation errors,
    /// and the placer places a task alone on an idle card up to its whole memory. Without
    /// this a task placed alone near the card's size could never be re-sized at all, not
    /// even shrunk.
    pub fn fits_on(&self, total_mib: f64, capacity_mib: f64, alone: bool) -> bool {
        if alone {
            total_mib <= capacity_mib
        } else {
            self.fits(total_mib, capacity_mib)
        }
    }
}

impl Default for MemoryMargin {
    fn default() -> Self {
        MemoryMargin::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_lets_a_task_overshoot_its_bound_by_the_fraction_the_card_keeps_free() {
        let m = MemoryMargin::DEFAULT;
        assert_eq!(m.fence_mib(1000.0), 1050);
        // Every task at its fence together still fits a card whose bounds fill it.
        let card = 16_384.0;
        let bounds = [5_000.0, 4_000.0, m.usable_mib(card) - 9_000.0];
        let fenced: u64 = bounds.iter().map(|&b| m.fence_mib(b)).sum();
        assert!((fenced as f64) <= card, "{fenced}");
    }

    #[test]
    fn the_fallback_is_the_largest_size_that_ran_within_the_margin() {
        let m = MemoryMargin::DEFAULT;
        let peaks = std::collections::BTreeMap::from([(16, 3_000), (32, 6_000), (64, 15_500)]);
        // 16 GiB card: 15,308 MiB usable, so 64 ran but not within the margin.
        assert_eq!(
            m.fallback_batch_size(128, &peaks, Some(64), Some(16_384)),
            Some(32)
        );
        // Without the card's size: the largest that ran below the failure.
        assert_eq!(m.fallback_batch_size(128, &peaks, Some(64), None), Some(64));
        assert_eq!(
            m.fallback_batch_size(32, &peaks, None, Some(16_384)),
            Some(16)
        );
        assert_eq!(m.fallback_batch_size(16, &peaks, None, Some(16_384)), None);
    }

    #[test]
    fn usable_memory_keeps_both_parts() {
        let m = MemoryMargin::DEFAULT;
        assert_eq!(m.usable_mib(16384.0), 16384.0 * 0.95 - 256.0);
        assert!(m.fits(15_000.0, 16384.0));
        assert!(!m.fits(15_400.0, 16384.0));
        assert_eq!(m.usable_mib(100.0), 0.0, "never negative");
        assert!(m.fits_on(16_000.0, 16384.0, true));
        assert!(!m.fits_on(16_000.0, 16384.0, false));
        assert!(!m.fits_on(16_385.0, 16384.0, true));
    }

    #[test]
    fn nonsense_is_refused() {
        MemoryMargin::DEFAULT.check().expect("default is valid");
        for bad in [
            MemoryMargin {
                fraction: -0.1,
                fixed_mib: 0.0,
            },
            MemoryMargin {
                fraction: 0.95,
                fixed_mib: 0.0,
            },
            MemoryMargin {
                fraction: 0.05,
                fixed_mib: f64::NAN,
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }
}
