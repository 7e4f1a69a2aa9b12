//! Naive packing: the first GPU whose residents' profiled peak memory at m0 (the same
//! figure every policy gets) leaves room for the new job's. Trusts the profiles, ignores
//! batch-size changes after a crash and knows nothing about interference.

use crate::policy::{Decision, Policy};
use crate::view::{ClusterView, Waiting};

/// First fit by profiled peak memory.
#[derive(Debug, Default)]
pub struct Packing;

impl Policy for Packing {
    fn name(&self) -> &str {
        "packing"
    }

    fn place(&mut self, view: &dyn ClusterView, task: Waiting<'_>) -> Decision {
        let capacity = view.capacity_mib();
        (0..view.devices())
            .find(|d| {
                let requested: u64 = view
                    .residents(*d)
                    .iter()
                    .map(|r| r.spec.solo_peak_mem_mib)
                    .sum();
                requested + task.spec.solo_peak_mem_mib <= capacity
            })
            .map_or(Decision::Queue, |device| {
                Decision::place(device, task.batch_size)
            })
    }
}
