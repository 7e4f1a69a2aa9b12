//! GPU memory of each job type in the simulated world: the ground truth that decides
//! out-of-memory crashes. Distinct from the tuner's learned memory model, which only
//! sees what the emulated agents report.
//!
//! **Model.** The peak memory of a family is linear in the batch size between its
//! smallest and largest measured batch sizes, `M(b) = lo + (hi − lo)·(b − b_min)/(b_max −
//! b_min)` (activations grow linearly with the batch; weights, optimiser state and
//! workspace are the constant part). A co-location runs out of memory when the sum of
//! its jobs' `M` exceeds the card.
//!
//! **Fit.** Gavel's `[0, 0]` pairs say which pairs did not fit on the card; the pairs
//! that ran say which did. `lo` and `hi` of every family are chosen on a logarithmic
//! grid (128 MiB up to the card) by coordinate descent to agree with as many of those
//! outcomes as possible, subject to every job fitting alone (it ran alone in Gavel).
//! Among equally good settings the middle one (ordered by total memory) is taken, so
//! the world is neither the most nor the least crowded the measurements allow.
//! Gavel's outcomes are not exactly a threshold
//! relation (on the K80, `Recommendation 8192` failed next to `ResNet-50 16` but ran
//! next to `ResNet-50 32`), so no additive model agrees with all of them; the
//! agreement reached is reported by [`MemoryFit::agreement`] and tested.

use crate::error::{Result, SimError};
use crate::world::catalogue::{Catalogue, TypeId};

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

/// The fitted memory model of one worker type.
#[derive(Clone, Debug)]
pub struct MemoryFit {
    pub capacity_mib: u64,
    /// Peak MiB of each job type, indexed by [`TypeId`].
    per_type_mib: Vec<u64>,
    /// `(lo, hi)` of each family, MiB.
    pub family_range_mib: Vec<(u64, u64)>,
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
        let grid: Vec<f64> = {
            let steps = 48;
            let (low, high) = (128f64.ln(), cap.ln());
            (0..steps)
                .map(|i| {
                    (low + (high - low) * i as f64 / (steps - 1) as f64)
                        .exp()
                        .floor()
                })
                .collect()
        };
        let families = &catalogue.families;
        let mut params: Vec<(usize, usize)> = vec![(0, 0); families.len()];
        let n = catalogue.len();
        let memory_of = |params: &[(usize, usize)], t: TypeId| -> f64 {
            let info = &catalogue.types[t];
            let family = &families[info.family];
            let (lo, hi) = (grid[params[info.family].0], grid[params[info.family].1]);
            match (family.batch_sizes.first(), family.batch_sizes.last()) {
                (Some(&min), Some(&max)) if max > min => {
                    lo + (hi - lo) * f64::from(info.batch_size - min) / f64::from(max - min)
                }
                _ => lo,
            }
        };
        // Unordered pairs with an outcome: (i, j, failed).
        let mut pairs = Vec::new();
        for i in 0..n {
            for j in i..n {
                pairs.push((i, j, catalogue.gavel_failed(i, j)));
            }
        }
        let agreement = |params: &[(usize, usize)], only: Option<usize>| -> usize {
            pairs
                .iter()
                .filter(|(i, j, _)| {
                    only.is_none_or(|f| {
                        catalogue.types[*i].family == f || catalogue.types[*j].family == f
                    })
                })
                .filter(|(i, j, failed)| {
                    let over = memory_of(params, *i) + memory_of(params, *j) > cap;
                    over == *failed
                })
                .count()
        };
        for _sweep in 0..12 {
            let mut changed = false;
            for f in 0..families.len() {
                let mut best_score = 0;
                let mut tied: Vec<(usize, usize)> = Vec::new();
                for lo in 0..grid.len() {
                    for hi in lo..grid.len() {
                        if families[f].batch_sizes.len() < 2 && hi != lo {
                            continue;
                        }
                        let mut trial = params.clone();
                        trial[f] = (lo, hi);
                        let score = agreement(&trial, Some(f));
                        if score > best_score {
                            best_score = score;
                            tied.clear();
                        }
                        if score == best_score {
                            tied.push((lo, hi));
                        }
                    }
                }
                // The middle of the agreeing settings: neither the least nor the most
                // memory the measurements allow.
                tied.sort_by_key(|(lo, hi)| (lo + hi, *lo));
                if let Some(&choice) = tied.get(tied.len() / 2)
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
        let per_type_mib: Vec<u64> = (0..n)
            .map(|t| memory_of(&params, t).ceil() as u64)
            .collect();
        if let Some(t) = (0..n).find(|t| per_type_mib[*t] > capacity_mib) {
            return Err(SimError::Data(format!(
                "memory fit puts {} alone over the card",
                catalogue.types[t].gavel_name
            )));
        }
        Ok(MemoryFit {
            capacity_mib,
            per_type_mib,
            family_range_mib: params
                .iter()
                .map(|(lo, hi)| (grid[*lo] as u64, grid[*hi] as u64))
                .collect(),
            agreeing: agreement(&params, None),
            judged: pairs.len(),
        })
    }

    /// Peak MiB of a job type alone.
    pub fn mib(&self, job: TypeId) -> u64 {
        self.per_type_mib[job]
    }

    /// Whether jobs of these types fit on the card together.
    pub fn fits(&self, jobs: impl Iterator<Item = TypeId>) -> bool {
        jobs.map(|t| self.per_type_mib[t]).sum::<u64>() <= self.capacity_mib
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
            eprintln!(
                "{worker}: agreement {:.3} ranges {:?}",
                fit.agreement(),
                fit.family_range_mib
            );
            assert!(fit.agreement() > 0.9, "{worker}: {}", fit.agreement());
            for t in 0..catalogue.len() {
                assert!(fit.fits([t].into_iter()));
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
            assert!(!fit.fits([big, big].into_iter()));
        }
    }

    #[test]
    fn tiny_cards_are_rejected() {
        let gavel = GavelThroughputs::bundled().expect("bundled");
        let catalogue =
            Catalogue::from_gavel("k80", gavel.worker("k80").expect("k80")).expect("cat");
        assert!(MemoryFit::fit(&catalogue, 100).is_err());
    }
}
