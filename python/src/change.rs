//! `BatchSizeChange`: a batch size to train at from the next step on, with its
//! learning-rate factor.

use iadeep_agent::ChangeReason;
use pyo3::prelude::*;

/// A batch-size change to apply before the next step.
///
/// `lr_factor` multiplies the learning rate *at the submitted batch size*; `reason`
/// is `"assignment"` (the tuner), `"out_of_memory"` (the agent fell back),
/// `"reservation_lost"` (the job's GPU memory is no longer reserved while it runs:
/// the batch size is unchanged), `"reservation_restored"` (reserved again) or
/// `"evicted"` (only from `poll_change(raise_evicted=False)`: the placer evicted the job).
/// `memory_bound_mib` is the assignment's bound on the task's GPU memory at the new
/// size (`None` when the change brings none): the agent's memory limit from then on.
#[pyclass(frozen, eq, module = "iadeep", get_all)]
#[derive(Clone, Debug, PartialEq)]
pub struct BatchSizeChange {
    /// The batch size to train at from the next step on.
    pub batch_size: u32,
    /// Multiply the learning rate at the submitted batch size by this.
    pub lr_factor: f64,
    /// The tuner's round (unchanged by an out-of-memory fall-back).
    pub round: u64,
    /// `"assignment"`, `"out_of_memory"`, `"reservation_lost"`, `"reservation_restored"`
    /// or `"evicted"`.
    pub reason: &'static str,
    /// The assigner's bound on the task's GPU memory at `batch_size`, MiB, if any.
    pub memory_bound_mib: Option<f64>,
}

#[pymethods]
impl BatchSizeChange {
    fn __repr__(&self) -> String {
        let bound = self
            .memory_bound_mib
            .map_or_else(|| "None".to_owned(), |mib| mib.to_string());
        format!(
            "BatchSizeChange(batch_size={}, lr_factor={}, round={}, reason={:?}, memory_bound_mib={bound})",
            self.batch_size, self.lr_factor, self.round, self.reason
        )
    }
}

impl From<iadeep_agent::BatchSizeChange> for BatchSizeChange {
    fn from(change: iadeep_agent::BatchSizeChange) -> Self {
        BatchSizeChange {
            batch_size: change.batch_size,
            lr_factor: change.lr_factor,
            round: change.round,
            reason: match change.reason {
                ChangeReason::Assignment => "assignment",
                ChangeReason::OutOfMemory => "out_of_memory",
                ChangeReason::ReservationLost => "reservation_lost",
                ChangeReason::ReservationRestored => "reservation_restored",
                ChangeReason::Evicted => "evicted",
            },
            memory_bound_mib: change.memory_bound_mib,
        }
    }
}
