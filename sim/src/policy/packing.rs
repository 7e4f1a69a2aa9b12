//! Naive packing: the first GPU whose residents' memory *requests* leave room for
//! the new job's request. Trusts what users wrote in their job files; knows nothing
//! about interference.

use crate::policy::{Decision, Policy};
use crate::view::{ClusterView, Waiting};

/// First fit by memory request.
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
                    .map(|r| r.spec.mem_request_mib)
                    .sum();
                requested + task.spec.mem_request_mib <= capacity
            })
            .map_or(Decision::Queue, |device| {
                Decision::place(device, task.batch_size)
            })
    }
}
