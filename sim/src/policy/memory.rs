//! Most available memory, with a utilisation cap and an out-of-memory recovery
//! queue.
//!
//! Free memory of a GPU is its size minus what its residents' agents report as peak
//! memory (their profiled peak at m0 while they have not reported: the same figure every
//! policy gets). The new job goes to the GPU with the most free memory that holds its
//! profiled peak and whose utilisation (as in
//! [`super::util`]) is under the cap. A job that crashes out of memory leaves its GPU
//! and waits at the front of the queue for a GPU of its own: the recovery queue. At
//! most [`MAX_RESIDENTS`] jobs share a GPU.

use std::collections::BTreeSet;

use crate::policy::util::{MAX_RESIDENTS, share};
use crate::policy::{Decision, OomAction, Policy};
use crate::view::{ClusterView, Waiting};

/// Most free memory first.
#[derive(Debug)]
pub struct MostMemory {
    pub util_cap: f64,
    /// Tasks that crashed: they only go to idle GPUs.
    recovering: BTreeSet<usize>,
}

impl Default for MostMemory {
    fn default() -> Self {
        MostMemory {
            util_cap: 1.5,
            recovering: BTreeSet::new(),
        }
    }
}

impl Policy for MostMemory {
    fn name(&self) -> &str {
        "memory"
    }

    fn place(&mut self, view: &dyn ClusterView, task: Waiting<'_>) -> Decision {
        let recovering = self.recovering.contains(&task.spec.id);
        let capacity = view.capacity_mib();
        let mut best: Option<(u64, usize)> = None;
        for device in 0..view.devices() {
            let residents = view.residents(device);
            if residents.len() >= MAX_RESIDENTS || (recovering && !residents.is_empty()) {
                continue;
            }
            let used: u64 = residents
                .iter()
                .map(|r| {
                    if r.report.running {
                        r.report.peak_mem_mib
                    } else {
                        r.spec.solo_peak_mem_mib
                    }
                })
                .sum();
            let free = capacity.saturating_sub(used);
            let utilisation: f64 = residents.iter().map(share).sum();
            if free >= task.spec.solo_peak_mem_mib
                && utilisation < self.util_cap
                && best.is_none_or(|(b, _)| free > b)
            {
                best = Some((free, device));
            }
        }
        match best {
            Some((_, device)) => {
                self.recovering.remove(&task.spec.id);
                Decision::place(device, task.batch_size)
            }
            None => Decision::Queue,
        }
    }

    fn on_oom(&mut self, _device: usize, task: usize, _batch_size: u32) -> OomAction {
        self.recovering.insert(task);
        OomAction::Requeue
    }
}
