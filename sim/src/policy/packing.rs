//! Naive packing: first fit by memory. With solo profiles (`--job-info profiled`) the
//! first GPU whose residents' profiled peaks at m0 leave room for the new job's profiled
//! peak; without them (the default) the first GPU whose residents all reported their
//! peaks and leave a quarter of the card free
//! ([`crate::policy::solo::unknown_memory_free_share`]), since the new job's
//! memory is unknown. Ignores batch-size changes after a crash and knows nothing about
//! interference.

use crate::policy::solo::{reported_peak_mib, room_for_unknown};
use crate::policy::{PlaceOrQueue, Policy};
use crate::view::{PolicyView, Waiting};

/// First fit by memory.
#[derive(Debug, Default)]
pub struct Packing;

impl Policy for Packing {
    fn name(&self) -> &str {
        "packing"
    }

    fn place(&mut self, view: &dyn PolicyView, task: Waiting<'_>) -> PlaceOrQueue {
        let capacity = view.capacity_mib();
        (0..view.devices())
            .find(|d| {
                let residents = view.residents(*d);
                match task.spec.profile {
                    Some(new) => {
                        // Every job brings a profile: the residents' profiled peaks.
                        let requested: u64 = residents
                            .iter()
                            .map(|r| r.spec.profile.map_or(0, |p| p.peak_mem_mib))
                            .sum();
                        requested + new.peak_mem_mib <= capacity
                    }
                    None => residents
                        .iter()
                        .map(reported_peak_mib)
                        .sum::<Option<u64>>()
                        .is_some_and(|used| room_for_unknown(used, capacity)),
                }
            })
            .map_or(PlaceOrQueue::Queue, |device| {
                PlaceOrQueue::place(device, task.batch_size)
            })
    }
}
