//! The ground truth of the simulated world: what jobs really do, built from measured
//! data (Gavel throughputs, a memory model fitted to Gavel's failed pairs, Pollux
//! gradient statistics) and, where the data ends, from documented models of another
//! form than the ones iadeep learns with (memory that is not affine in the batch
//! size, [`memory`]; a contention model for three or more jobs, [`interference`]).
//! Schedulers never read it; they see the emulated agents' reports.

pub mod catalogue;
pub mod efficiency;
pub mod interference;
pub mod memory;

use iadeep_datasets::gavel::GavelThroughputs;

pub use catalogue::{Catalogue, TypeId};
pub use efficiency::NoiseScaleCurve;
pub use interference::Interference;
pub use memory::MemoryFit;

use crate::error::{Result, SimError};

/// Everything the simulator knows about how jobs behave on one worker type.
#[derive(Clone, Debug)]
pub struct World {
    pub catalogue: Catalogue,
    pub memory: MemoryFit,
    /// φ curve of each family (by family index), `None` without gradient statistics.
    pub noise_scale: Vec<Option<NoiseScaleCurve>>,
    /// How three or more co-located jobs slow each other.
    pub interference: Interference,
}

impl World {
    /// Builds the world of `worker_type` from a Gavel file, on cards of
    /// `capacity_mib` (default: the known size of that worker type).
    pub fn new(
        gavel: &GavelThroughputs,
        worker_type: &str,
        capacity_mib: Option<u64>,
        interference: Interference,
    ) -> Result<World> {
        let catalogue = Catalogue::from_gavel(worker_type, gavel.worker(worker_type)?)?;
        let capacity = capacity_mib
            .or_else(|| memory::default_capacity_mib(worker_type))
            .ok_or_else(|| SimError::InvalidParam {
                field: "gpu memory",
                reason: format!(
                    "worker type {worker_type:?} has no known memory size; give it explicitly"
                ),
            })?;
        let memory = MemoryFit::fit(&catalogue, capacity)?;
        let noise_scale = catalogue
            .families
            .iter()
            .map(|family| match efficiency::pollux_model_for(&family.name) {
                Some(model) => NoiseScaleCurve::bundled(model),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        tracing::info!(
            worker_type,
            capacity_mib = capacity,
            job_types = catalogue.len(),
            memory_agreement = format!("{:.3}", memory.agreement()),
            filled_pairs = catalogue.filled_pairs(),
            %interference,
            "built the simulated world from measured data"
        );
        Ok(World {
            catalogue,
            memory,
            noise_scale,
            interference,
        })
    }

    /// Steps per second of `job` next to `others` in this world.
    pub fn steps_per_s(&self, job: TypeId, others: impl Iterator<Item = TypeId>) -> f64 {
        self.catalogue
            .co_located_steps_per_s(job, others, self.interference)
    }

    /// φ of a job of `family` at a fraction of its work, if it has gradient statistics.
    pub fn phi(&self, family: usize, fraction: f64) -> Option<f64> {
        self.noise_scale
            .get(family)
            .and_then(Option::as_ref)
            .map(|curve| curve.phi_at(fraction))
    }
}
