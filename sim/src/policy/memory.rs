//! Most available memory, with a utilisation cap and an out-of-memory recovery
//! queue.
//!
//! Free memory of a GPU is its size minus what its residents' agents report as peak
//! memory (before a resident's first report: its profiled peak at m0 when jobs bring
//! profiles; a GPU with a resident whose memory is unknown takes no job). The new job
//! goes to the GPU with the most free memory whose utilisation (as in [`super::util`])
//! is under the cap and that holds the job: its profiled peak when it has one, else
//! (its memory unknown) a quarter of the card free
//! ([`crate::policy::solo::unknown_memory_free_share`]). A job that crashes out of
//! memory leaves its GPU and waits at the front of the queue for a GPU of its own: the
//! recovery queue. At most [`MAX_RESIDENTS`] jobs share a GPU.

use std::collections::BTreeSet;

use crate::policy::solo::{SoloTimes, resident_mib, room_for_unknown};
use crate::policy::util::MAX_RESIDENTS;
use crate::policy::{OomAction, PlaceOrQueue, Policy};
use crate::view::{PolicyView, Waiting};

/// Most free memory first.
#[derive(Debug)]
pub struct MostMemory {
    pub util_cap: f64,
    /// Tasks that crashed: they only go to idle GPUs.
    recovering: BTreeSet<usize>,
    /// Speeds measured alone, for the utilisation.
    solo: SoloTimes,
}

impl Default for MostMemory {
    fn default() -> Self {
        MostMemory {
            util_cap: 1.5,
            recovering: BTreeSet::new(),
            solo: SoloTimes::default(),
        }
    }
}

impl Policy for MostMemory {
    fn name(&self) -> &str {
        "memory"
    }

    fn place(&mut self, view: &dyn PolicyView, task: Waiting<'_>) -> PlaceOrQueue {
        self.solo.observe(view);
        let recovering = self.recovering.contains(&task.spec.id);
        let capacity = view.capacity_mib();
        let mut best: Option<(u64, usize)> = None;
        for device in 0..view.devices() {
            let residents = view.residents(device);
            if residents.len() >= MAX_RESIDENTS || (recovering && !residents.is_empty()) {
                continue;
            }
            let Some(used) = residents.iter().map(resident_mib).sum::<Option<u64>>() else {
                continue;
            };
            let free = capacity.saturating_sub(used);
            let utilisation: f64 = residents.iter().map(|r| self.solo.share(r)).sum();
            let holds = match task.spec.profile {
                Some(p) => free >= p.peak_mem_mib,
                None => room_for_unknown(used, capacity),
            };
            if holds && utilisation < self.util_cap && best.is_none_or(|(b, _)| free > b) {
                best = Some((free, device));
            }
        }
        match best {
            Some((_, device)) => {
                self.recovering.remove(&task.spec.id);
                PlaceOrQueue::place(device, task.batch_size)
            }
            None => PlaceOrQueue::Queue,
        }
    }

    fn on_oom(&mut self, _device: usize, task: usize, _batch_size: u32) -> OomAction {
        self.recovering.insert(task);
        OomAction::Requeue
    }

    fn on_finish(&mut self, _device: usize, task: usize) {
        self.solo.forget(task);
    }
}
