//! GPU memory of each job type in the simulated world: the ground truth that decides
//! out-of-memory crashes. Distinct from the tuner's learned memory model, which only
//! sees what the emulated agents report.
//!
//! **Model.** The peak memory of a job of a family at batch size `b` is a fixed part
//! (weights, optimiser state, CUDA context: `lo`, the peak at the family's smallest
//! measured batch size) plus an activation part that is **not linear** in `b`, rounded
//! up to the caching allocator's blocks, plus a fragmentation overhead that changes
//! from run to run:
//!
//! `M(b) = block⌈ lo + (hi − lo)·s(x) · (1 + f) ⌉`,  `x = (b − b_min)/(b_max − b_min)`
//!
//! - `s` is piecewise linear and convex with a knee at [`KNEE_AT`] where it has reached
//!   only [`KNEE_SHARE`] of the range: at large batch sizes the convolution libraries
//!   pick workspace-hungry algorithms and activation memory grows faster than the
//!   batch. A model that fits a line through small batch sizes therefore
//!   underestimates large ones, as on real GPUs;
//! - `block` is [`ALLOCATOR_BLOCK_MIB`] = 20 MiB, the segment size in which PyTorch's
//!   caching allocator reserves large allocations;
//! - `f` is drawn uniformly from `[0, FRAGMENTATION_MAX]` ([`FRAGMENTATION_MAX`]) each
//!   time a job allocates its memory anew (start, restart, batch-size change): the
//!   same job at the same batch size peaks a little differently from run to run.
//!   [`MemoryFit::mib`] is the peak without fragmentation.
//!
//! A co-location runs out of memory when the sum of its jobs' peaks exceeds the card.
//!
//! **Fit.** Gavel's `[0, 0]` pairs say which pairs did not fit on the card; the pairs
//! that ran say which did (with the shape `s` and without fragmentation). `lo` and
//! `hi` of every family are chosen on a logarithmic grid (128 MiB up to the card) by
//! coordinate descent to agree with as many of those outcomes as possible, subject to
//! every job fitting alone (it ran alone in Gavel). Among equally good settings the
//! middle one (ordered by total memory) is taken, so the world is neither the most nor
//! the least crowded the measurements allow. Gavel's outcomes are not exactly a
//! threshold relation (on the K80, `Recommendation 8192` failed next to `ResNet-50 16` but ran
//! next to `ResNet-50 32`), so no additive model agrees with all of them; the
//! agreement reached is reported by [`MemoryFit::agreement`] and tested.

use crate::error::{Result, SimError};
use crate::world::catalogue::{Catalogue, TypeId};

/// Where the activation curve bends, as a fraction of the family's batch-size range.
pub const KNEE_AT: f64 = 0.5;
/// Share of the activation range reached at the knee (below [`KNEE_AT`]: convex).
pub const KNEE_SHARE: f64 = 0.35;
/// Allocation granularity of the world's GPU memory, MiB (PyTorch's large segments).
pub const ALLOCATOR_BLOCK_MIB: u64 = 20;
/// Largest fragmentation overhead of one run, as a fraction of its activation part.
pub const FRAGMENTATION_MAX: f64 = 0.08;

/// The activation curve `s(x)`: 0 at the smallest measured batch size, 1 at the
/// largest, piecewise linear through (`KNEE_AT`, `KNEE_SHARE`).
pub fn activation_share(x: f64) -> f64 {
    let x = x.clamp(0.0, 1.0);
    if x <= KNEE_AT {
        x / KNEE_AT * KNEE_SHARE
    } else {
        KNEE_SHARE + (x - KNEE_AT) / (1.0 - KNEE_AT) * (1.0 - KNEE_SHARE)
    }
}

/// `mib` rounded up to whole allocator blocks.
fn to_blocks(mib: f64) -> u64 {
    (mib / ALLOCATOR_BLOCK_MIB as f64).ceil() as u64 * ALLOCATOR_BLOCK_MIB
}

/// Usable memory of the Gavel worker types, MiB, as `nvidia-smi` reports it
/// (K80: 12 GiB per GPU die; P100: the 16 GiB card).
pub fn default_capacity_mib(worker_type: &str) -> Option<u64> {
    match worker_type {
        "k80" => Some(11_441),
        "p100" => Some(16_280),
        "v100" => Some(16_160),
        _ => None,
    }
}

/// The fit's candidate fixed (and top-of-range) MiB: 48 points, log-spaced from 128 MiB
/// to the largest whole number of allocator blocks on a card of `cap` MiB, so that a job
/// at the top of the grid still fits alone after rounding.
fn memory_grid(cap: f64) -> Vec<f64> {
    let steps = 48;
    let top = (cap / ALLOCATOR_BLOCK_MIB as f64).floor() * ALLOCATOR_BLOCK_MIB as f64;
    let (low, high) = (128f64.ln(), top.ln());
    (0..steps)
        .map(|i| {
            (low + (high - low) * i as f64 / (steps - 1) as f64)
                .exp()
                .floor()
        })
        .collect()
}

/// What [`MemoryFit::fit`] searches over: each family's `(lo, hi)` grid indices, judged
/// by how many measured pairs they agree with.
struct Fitter<'a> {
    catalogue: &'a Catalogue,
    grid: Vec<f64>,
    cap: f64,
    /// Unordered pairs with an outcome: (i, j, failed).
    pairs: Vec<(TypeId, TypeId, bool)>,
}

impl Fitter<'_> {
    /// Fixed and activation MiB of job type `t` under `params`.
    fn parts_of(&self, params: &[(usize, usize)], t: TypeId) -> (f64, f64) {
        let info = &self.catalogue.types[t];
        let family = &self.catalogue.families[info.family];
        let (lo, hi) = (
            self.grid[params[info.family].0],
            self.grid[params[info.family].1],
        );
        match (family.batch_sizes.first(), family.batch_sizes.last()) {
            (Some(&min), Some(&max)) if max > min => {
                let x = f64::from(info.batch_size - min) / f64::from(max - min);
                (lo, (hi - lo) * activation_share(x))
            }
            _ => (lo, 0.0),
        }
    }

    /// Peak MiB of job type `t` under `params`, in whole allocator blocks.
    fn memory_of(&self, params: &[(usize, usize)], t: TypeId) -> f64 {
        let (fixed, activation) = self.parts_of(params, t);
        to_blocks(fixed + activation) as f64
    }

    /// The measured pairs (those with a job of family `only`, if given) whose outcome
    /// `params` predicts: over the card exactly when the pair failed.
    fn agreement(&self, params: &[(usize, usize)], only: Option<usize>) -> usize {
        let types = &self.catalogue.types;
        self.pairs
            .iter()
            .filter(|(i, j, _)| only.is_none_or(|f| types[*i].family == f || types[*j].family == f))
            .filter(|(i, j, failed)| {
                let over = self.memory_of(params, *i) + self.memory_of(params, *j) > self.cap;
                over == *failed
            })
            .count()
    }

    /// Of family `f`'s settings (the others as in `params`) that agree with the most
    /// pairs, the middle one: neither the least nor the most memory the measurements
    /// allow.
    fn middle_of_best(&self, params: &[(usize, usize)], f: usize) -> Option<(usize, usize)> {
        let mut best_score = 0;
        let mut tied: Vec<(usize, usize)> = Vec::new();
        let single = self.catalogue.families[f].batch_sizes.len() < 2;
        for lo in 0..self.grid.len() {
            for hi in lo..self.grid.len() {
                if single && hi != lo {
                    continue;
                }
                let mut trial = params.to_vec();
                trial[f] = (lo, hi);
                let score = self.agreement(&trial, Some(f));
                if score > best_score {
                    best_score = score;
                    tied.clear();
                }
                if score == best_score {
                    tied.push((lo, hi));
                }
            }
        }
        tied.sort_by_key(|(lo, hi)| (lo + hi, *lo));
        tied.get(tied.len() / 2).copied()
    }
}

/// The fitted memory model of one worker type.
#[derive(Clone, Debug)]
pub struct MemoryFit {
    pub capacity_mib: u64,
    /// Fixed and activation MiB of each job type (before rounding), by [`TypeId`].
    per_type_parts: Vec<(f64, f64)>,
    /// Peak MiB of each job type without fragmentation, by [`TypeId`].
    per_type_mib: Vec<u64>,
    agreeing: usize,
    judged: usize,
}

impl MemoryFit {
    /// Fits the model to the catalogue's measured pairs on a card of `capacity_mib`.
    pub fn fit(catalogue: &Catalogue, capacity_mib: u64) -> Result<MemoryFit> {
        if capacity_mib < 1024 {
            return Err(SimError::InvalidParam {
                field: "gpu memory",
                reason: format!("{capacity_mib} MiB is too small for any measured job"),
            });
        }
        let cap = capacity_mib as f64;
        let n = catalogue.len();
        // Unordered pairs with an outcome: (i, j, failed).
        let mut pairs = Vec::new();
        for i in 0..n {
            for j in i..n {
                pairs.push((i, j, catalogue.gavel_failed(i, j)));
            }
        }
        let fitter = Fitter {
            catalogue,
            grid: memory_grid(cap),
            cap,
            pairs,
        };
        let families = &catalogue.families;
        let mut params: Vec<(usize, usize)> = vec![(0, 0); families.len()];
        for _sweep in 0..12 {
            let mut changed = false;
            for f in 0..families.len() {
                if let Some(choice) = fitter.middle_of_best(&params, f)
                    && choice != params[f]
                {
                    params[f] = choice;
                    changed = true;
                }
            }
            if !changed {
                break;
            }
        }
        let per_type_parts: Vec<(f64, f64)> = (0..n).map(|t| fitter.parts_of(&params, t)).collect();
        let per_type_mib: Vec<u64> = (0..n)
            .map(|t| fitter.memory_of(&params, t) as u64)
            .collect();
        if let Some(t) = (0..n).find(|t| per_type_mib[*t] > capacity_mib) {
            return Err(SimError::Data(format!(
                "memory fit puts {} alone over the card",
                catalogue.types[t].gavel_name
            )));
        }
        Ok(MemoryFit {
            capacity_mib,
            per_type_parts,
            per_type_mib,
            agreeing: fitter.agreement(&params, None),
            judged: fitter.pairs.len(),
        })
    }

    /// Peak MiB of a job type alone, without fragmentation.
    pub fn mib(&self, job: TypeId) -> u64 {
        self.per_type_mib[job]
    }

    /// Peak MiB of one run of a job type whose fragmentation overhead is
    /// `fragmentation` (a fraction of its activation part, see the module docs).
    /// Never more than the card: every job type ran alone in Gavel, so under memory
    /// pressure the allocator releases its cache rather than fail a job alone.
    pub fn peak_mib(&self, job: TypeId, fragmentation: f64) -> u64 {
        let (fixed, activation) = self.per_type_parts[job];
        to_blocks(fixed + activation * (1.0 + fragmentation.max(0.0)))
            .max(self.per_type_mib[job])
            .min(self.capacity_mib.max(self.per_type_mib[job]))
    }

    /// Whether runs with these peaks (MiB) fit on the card together.
    pub fn fits(&self, peaks_mib: impl Iterator<Item = u64>) -> bool {
        peaks_mib.sum::<u64>() <= self.capacity_mib
    }

    /// Fraction of Gavel's pair outcomes (ran / failed) the model reproduces.
    pub fn agreement(&self) -> f64 {
        self.agreeing as f64 / self.judged.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_datasets::gavel::GavelThroughputs;

    #[test]
    fn fit_agrees_with_most_gavel_outcomes_and_every_job_fits_alone() {
        let gavel = GavelThroughputs::bundled().expect("bundled");
        for worker in ["k80", "p100"] {
            let catalogue =
                Catalogue::from_gavel(worker, gavel.worker(worker).expect("worker")).expect("cat");
            let capacity = default_capacity_mib(worker).expect("known");
            let fit = MemoryFit::fit(&catalogue, capacity).expect("fit");
            eprintln!("{worker}: agreement {:.3}", fit.agreement());
            assert!(fit.agreement() > 0.9, "{worker}: {}", fit.agreement());
            for t in 0..catalogue.len() {
                assert!(fit.fits([fit.mib(t)].into_iter()));
            }
            // Memory grows with the batch size within a family.
            for family in &catalogue.families {
                let mibs: Vec<u64> = family.types.iter().map(|t| fit.mib(*t)).collect();
                assert!(mibs.windows(2).all(|w| w[0] <= w[1]), "{mibs:?}");
            }
            // The pair Gavel reports failed on both cards is over the card.
            let r50 = catalogue
                .families
                .iter()
                .position(|f| f.name == "ResNet-50")
                .expect("r50");
            let big = catalogue.type_of(r50, 128).expect("r50/128");
            assert!(!fit.fits([fit.mib(big), fit.mib(big)].into_iter()));
        }
    }

    #[test]
    fn memory_is_not_affine_in_the_batch_size_and_varies_run_to_run() {
        let gavel = GavelThroughputs::bundled().expect("bundled");
        let catalogue =
            Catalogue::from_gavel("k80", gavel.worker("k80").expect("k80")).expect("cat");
        let fit =
            MemoryFit::fit(&catalogue, default_capacity_mib("k80").expect("k80")).expect("fit");
        let mut bent = 0;
        for family in catalogue
            .families
            .iter()
            .filter(|f| f.batch_sizes.len() >= 3)
        {
            let (min, max) = (
                family.batch_sizes[0],
                family.batch_sizes[family.batch_sizes.len() - 1],
            );
            let (lo, hi) = (
                fit.mib(family.types[0]) as f64,
                fit.mib(family.types[family.types.len() - 1]) as f64,
            );
            for (size, t) in family.batch_sizes.iter().zip(&family.types) {
                // Every peak is a whole number of allocator blocks.
                assert_eq!(fit.mib(*t) % ALLOCATOR_BLOCK_MIB, 0);
                let line = lo + (hi - lo) * f64::from(size - min) / f64::from(max - min);
                // More than rounding below the straight line between the ends.
                if line - fit.mib(*t) as f64 > ALLOCATOR_BLOCK_MIB as f64 {
                    bent += 1;
                }
            }
            // Fragmentation: never less than the base, at most the documented overhead.
            let top = family.types[family.types.len() - 1];
            let worst = fit.peak_mib(top, FRAGMENTATION_MAX);
            assert!(fit.peak_mib(top, 0.0) == fit.mib(top) && worst >= fit.mib(top));
            let (fixed, activation) = fit.per_type_parts[top];
            assert!(
                worst as f64
                    <= fixed + activation * (1.0 + FRAGMENTATION_MAX) + ALLOCATOR_BLOCK_MIB as f64
            );
        }
        assert!(bent >= 3, "only {bent} batch sizes off the straight line");
        assert_eq!(activation_share(0.0), 0.0);
        assert_eq!(activation_share(1.0), 1.0);
        assert!(activation_share(KNEE_AT) < KNEE_AT);
    }

    #[test]
    fn tiny_cards_are_rejected() {
        let gavel = GavelThroughputs::bundled().expect("bundled");
        let catalogue =
            Catalogue::from_gavel("k80", gavel.worker("k80").expect("k80")).expect("cat");
        assert!(MemoryFit::fit(&catalogue, 100).is_err());
    }
}
