//! The job types of the simulated world and their measured co-location throughputs.
//!
//! Everything here comes from one worker type of a Gavel throughput file: the model
//! families, the batch sizes each family was measured at (the only batch sizes a
//! simulated job can run at, so every step time is a measurement), the solo steps
//! per second, and the normalised throughput of each job type next to each other.
//!
//! **Three or more jobs on one GPU** (Gavel measured pairs only): see
//! [`super::interference`]; the default is a contention model, not the product of
//! pairs.
//!
//! **Pairs Gavel could not measure** (`[0, 0]`, mostly out of memory) but that the
//! world's memory model lets run (see [`super::memory`]) take the ratio measured for
//! the nearest batch size of the co-runner's family, then of the job's own family,
//! then the geometric mean of the job's measured ratios. How many pairs needed this
//! is reported by [`Catalogue::filled_pairs`].

use std::collections::BTreeMap;

use iadeep_datasets::gavel::{JobType, PairOutcome, WorkerThroughputs};

use crate::error::{Result, SimError};
use crate::world::interference::Interference;

/// Index of a job type (family and batch size) in a [`Catalogue`].
pub type TypeId = usize;

/// One model family and the batch sizes it was measured at.
#[derive(Clone, Debug, PartialEq)]
pub struct Family {
    pub name: String,
    /// Ascending. `[1]` for families Gavel lists without a batch size (A3C, CycleGAN),
    /// whose batch size cannot change.
    pub batch_sizes: Vec<u32>,
    /// True when Gavel gives the family no batch size.
    pub fixed: bool,
    /// The type of each batch size, same order as `batch_sizes`.
    pub types: Vec<TypeId>,
}

/// One measured job type.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeInfo {
    pub family: usize,
    pub batch_size: u32,
    /// Steps per second alone on one GPU (Gavel's `null` entry).
    pub solo_steps_per_s: f64,
    /// Gavel's name, e.g. `ResNet-50 (batch size 64)`.
    pub gavel_name: String,
}

/// The measured world of one worker type.
#[derive(Clone, Debug)]
pub struct Catalogue {
    pub worker_type: String,
    pub families: Vec<Family>,
    pub types: Vec<TypeInfo>,
    /// `ratio[i * n + j]`: normalised throughput of type i next to type j.
    ratio: Vec<f64>,
    /// `failed[i * n + j]`: Gavel marks the pair as failed (`[0, 0]`).
    failed: Vec<bool>,
    filled: usize,
}

impl Catalogue {
    /// Builds the catalogue from one worker type's measurements.
    pub fn from_gavel(worker_type: &str, worker: &WorkerThroughputs) -> Result<Catalogue> {
        let mut by_family: BTreeMap<String, Vec<(u32, &JobType, f64)>> = BTreeMap::new();
        for (job, solo) in &worker.solo {
            if !(solo.is_finite() && *solo > 0.0) {
                return Err(SimError::Data(format!(
                    "{worker_type}: {job} has a non-positive solo throughput"
                )));
            }
            by_family.entry(job.family.clone()).or_default().push((
                job.batch_size.unwrap_or(1),
                job,
                *solo,
            ));
        }
        if by_family.is_empty() {
            return Err(SimError::Data(format!(
                "{worker_type}: no single-GPU job types"
            )));
        }
        let mut families = Vec::new();
        let mut types = Vec::new();
        let mut gavel_types = Vec::new();
        for (name, mut sizes) in by_family {
            sizes.sort_by_key(|(size, _, _)| *size);
            let fixed = sizes.iter().all(|(_, job, _)| job.batch_size.is_none());
            if fixed && sizes.len() > 1 {
                return Err(SimError::Data(format!(
                    "{worker_type}: family {name} is listed both with and without batch sizes"
                )));
            }
            let family = families.len();
            let mut family_types = Vec::new();
            for (size, job, solo) in &sizes {
                family_types.push(types.len());
                types.push(TypeInfo {
                    family,
                    batch_size: *size,
                    solo_steps_per_s: *solo,
                    gavel_name: job.to_string(),
                });
                gavel_types.push((*job).clone());
            }
            families.push(Family {
                name,
                batch_sizes: sizes.iter().map(|(size, _, _)| *size).collect(),
                fixed,
                types: family_types,
            });
        }
        let n = types.len();
        let mut ratio = vec![f64::NAN; n * n];
        let mut failed = vec![false; n * n];
        for i in 0..n {
            for j in 0..n {
                match worker.pair(&gavel_types[i], &gavel_types[j]) {
                    // A zero throughput next to a running partner is no usable
                    // measurement: it is filled like an unmeasured pair.
                    Some(PairOutcome::Ran { first, .. }) if first > 0.0 => {
                        ratio[i * n + j] = first / types[i].solo_steps_per_s;
                    }
                    Some(PairOutcome::Ran { .. }) => {}
                    Some(PairOutcome::Failed) => failed[i * n + j] = true,
                    None => {}
                }
            }
        }
        let mut catalogue = Catalogue {
            worker_type: worker_type.to_owned(),
            families,
            types,
            ratio,
            failed,
            filled: 0,
        };
        catalogue.fill_unmeasured()?;
        Ok(catalogue)
    }

    /// Fills pairs without a measurement by the documented nearest-neighbour rule.
    fn fill_unmeasured(&mut self) -> Result<()> {
        let n = self.types.len();
        let measured = self.ratio.clone();
        let nearest = |ratio: &[f64], i: TypeId, j: TypeId, types: &[TypeInfo], fams: &[Family]| {
            let log = |t: TypeId| f64::from(types[t].batch_size).log2();
            // Nearest batch size of j's family, then of i's family.
            let mut best: Option<(f64, f64)> = None;
            for &other in &fams[types[j].family].types {
                let value = ratio[i * n + other];
                if value.is_finite() {
                    let distance = (log(other) - log(j)).abs();
                    if best.is_none_or(|(d, _)| distance < d) {
                        best = Some((distance, value));
                    }
                }
            }
            if best.is_none() {
                for &other in &fams[types[i].family].types {
                    let value = ratio[other * n + j];
                    if value.is_finite() {
                        let distance = (log(other) - log(i)).abs();
                        if best.is_none_or(|(d, _)| distance < d) {
                            best = Some((distance, value));
                        }
                    }
                }
            }
            best.map(|(_, value)| value)
        };
        let geo_mean = |values: Vec<f64>| -> Option<f64> {
            let values: Vec<f64> = values
                .into_iter()
                .filter(|v| v.is_finite() && *v > 0.0)
                .collect();
            iadeep_objective::stats::mean(values.iter().map(|v| v.ln())).map(f64::exp)
        };
        let everything = geo_mean(measured.clone())
            .ok_or_else(|| SimError::Data(format!("{}: no pair ran together", self.worker_type)))?;
        let mut filled = 0;
        for i in 0..n {
            let row = geo_mean((0..n).map(|j| measured[i * n + j]).collect());
            let family = geo_mean(
                self.families[self.types[i].family]
                    .types
                    .iter()
                    .flat_map(|t| (0..n).map(move |j| (t, j)))
                    .map(|(t, j)| measured[t * n + j])
                    .collect(),
            );
            for j in 0..n {
                if self.ratio[i * n + j].is_finite() {
                    continue;
                }
                self.ratio[i * n + j] = nearest(&measured, i, j, &self.types, &self.families)
                    .or(row)
                    .or(family)
                    .unwrap_or(everything);
                filled += 1;
            }
        }
        self.filled = filled;
        Ok(())
    }

    /// Number of job types.
    pub fn len(&self) -> usize {
        self.types.len()
    }

    /// The type of `family` at `batch_size`, if that size was measured.
    pub fn type_of(&self, family: usize, batch_size: u32) -> Option<TypeId> {
        let family = self.families.get(family)?;
        family
            .batch_sizes
            .iter()
            .position(|b| *b == batch_size)
            .map(|index| family.types[index])
    }

    /// Normalised throughput of `job` next to `other` (measured, or filled).
    pub fn ratio(&self, job: TypeId, other: TypeId) -> f64 {
        self.ratio[job * self.types.len() + other]
    }

    /// Whether Gavel marks the pair as failed.
    pub fn gavel_failed(&self, job: TypeId, other: TypeId) -> bool {
        self.failed[job * self.types.len() + other]
    }

    /// Ordered pairs whose ratio was filled by the nearest-neighbour rule.
    pub fn filled_pairs(&self) -> usize {
        self.filled
    }

    /// Steps per second of `job` next to `others`, under the world's `model` for three
    /// or more jobs (a pair is always its measurement).
    pub fn co_located_steps_per_s(
        &self,
        job: TypeId,
        others: impl Iterator<Item = TypeId>,
        model: Interference,
    ) -> f64 {
        let factor = model.normalised_throughput(others.map(|other| self.ratio(job, other)));
        self.types[job].solo_steps_per_s * factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_datasets::gavel::GavelThroughputs;

    fn k80() -> Catalogue {
        let gavel = GavelThroughputs::bundled().expect("bundled");
        Catalogue::from_gavel("k80", gavel.worker("k80").expect("k80")).expect("catalogue")
    }

    #[test]
    fn families_and_sizes_come_from_the_file() {
        let catalogue = k80();
        assert_eq!(catalogue.len(), 26);
        let names: Vec<&str> = catalogue.families.iter().map(|f| f.name.as_str()).collect();
        assert!(
            names.contains(&"ResNet-50") && names.contains(&"A3C"),
            "{names:?}"
        );
        let a3c = catalogue
            .families
            .iter()
            .find(|f| f.name == "A3C")
            .expect("A3C");
        assert!(a3c.fixed && a3c.batch_sizes == [1]);
    }

    #[test]
    fn measured_pairs_are_used_as_is_under_either_model_for_three_jobs() {
        let catalogue = k80();
        let r18 = catalogue
            .families
            .iter()
            .position(|f| f.name == "ResNet-18")
            .expect("r18");
        let lm = catalogue
            .families
            .iter()
            .position(|f| f.name == "LM")
            .expect("lm");
        let a = catalogue.type_of(r18, 16).expect("r18/16");
        let b = catalogue.type_of(lm, 10).expect("lm/10");
        let ratio = catalogue.ratio(a, b);
        assert!(ratio > 0.0 && ratio < 1.5, "{ratio}");
        let solo = catalogue.types[a].solo_steps_per_s;
        for model in [Interference::default(), Interference::Product] {
            let two = catalogue.co_located_steps_per_s(a, [b].into_iter(), model);
            assert!((two - solo * ratio).abs() < 1e-12, "{model}");
        }
        let product =
            catalogue.co_located_steps_per_s(a, [b, b].into_iter(), Interference::Product);
        assert!((product - solo * ratio * ratio).abs() < 1e-12);
        let contention =
            catalogue.co_located_steps_per_s(a, [b, b].into_iter(), Interference::default());
        assert!(
            (contention - product).abs() > 1e-6 * solo,
            "{contention} vs {product}"
        );
        assert!(catalogue.filled_pairs() > 0, "K80 has failed pairs to fill");
        for i in 0..catalogue.len() {
            for j in 0..catalogue.len() {
                assert!(catalogue.ratio(i, j).is_finite() && catalogue.ratio(i, j) > 0.0);
            }
        }
    }
}
