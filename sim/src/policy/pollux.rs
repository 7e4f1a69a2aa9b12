//! `pollux`: the strongest single-job adaptive alternative to sharing GPUs. Every job
//! gets a GPU of its own (first idle GPU, as exclusive FIFO) and runs at its
//! goodput-optimal batch size: each allowed batch size runs for one reporting interval
//! and the job settles at the one with the lowest PD, the tuner's objective
//! (`iadeep_objective::PdInput`) with no co-location (IF = 1), computed from the
//! agent's reports (measured step time, estimated φ) and the job's solo profile.
//! Like Pollux it adapts the batch size to the job's statistics; unlike iadeep it
//! never shares a GPU, so it never runs out of memory (a job alone fits the card).

use std::collections::BTreeMap;

use crate::policy::batch_search::{BatchSearch, pd_alone_or_shared, tune_device};
use crate::policy::{Decision, Policy, TuneStep};
use crate::view::{ClusterView, Waiting};

/// Exclusive GPUs, goodput-optimal batch sizes.
#[derive(Debug, Default)]
pub struct Pollux {
    /// The search of the job on each device.
    searches: BTreeMap<usize, BatchSearch>,
}

impl Policy for Pollux {
    fn name(&self) -> &str {
        "pollux"
    }

    fn place(&mut self, view: &dyn ClusterView, task: Waiting<'_>) -> Decision {
        let Some(device) = (0..view.devices()).find(|d| view.resident_count(*d) == 0) else {
            return Decision::Queue;
        };
        if task.spec.batch_sizes.len() > 1 {
            self.searches.insert(
                device,
                BatchSearch::new(task.spec.id, task.spec.batch_sizes.clone()),
            );
        }
        Decision::place(device, task.batch_size)
    }

    fn tunes(&self) -> bool {
        true
    }

    fn tune(&mut self, view: &dyn ClusterView, device: usize) -> TuneStep {
        tune_device(&mut self.searches, view, device, pd_alone_or_shared)
    }

    fn on_finish(&mut self, device: usize, task: usize) {
        if self.searches.get(&device).is_some_and(|s| s.task == task) {
            self.searches.remove(&device);
        }
    }
}
