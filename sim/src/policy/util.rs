//! Utilisation-based placement: the GPU with the least utilisation, as the agents'
//! reports show it, while it stays under a cap.
//!
//! A job's share of its GPU is its measured speed relative to its speed alone (a job
//! alone uses the whole GPU: share 1; two jobs slowing each other to 60 % use 0.6 each):
//! with solo profiles its profiled speed at m0, without them the speed its agent
//! reported while it ran alone at the same batch size; a job never measured alone counts
//! as a whole GPU ([`SoloTimes::share`]). The new job is predicted to add a share of 1.
//! The policy ignores memory, which is what makes such schedulers crash jobs; it only
//! remembers not to send a task back to a GPU where it crashed while that GPU
//! is shared (a blocklist).

use std::collections::BTreeSet;

use crate::policy::solo::SoloTimes;
use crate::policy::{OomAction, PlaceOrQueue, Policy};
use crate::view::{PolicyView, Waiting};

/// At most this many jobs per GPU (as iadeep). Shares fall as jobs pile up, so the
/// cap alone would let a badly contended GPU keep taking jobs.
pub const MAX_RESIDENTS: usize = 3;

/// Least predicted utilisation under a cap.
#[derive(Debug)]
pub struct LeastUtilised {
    /// A GPU whose residents' shares add up to this or more takes no new job.
    pub cap: f64,
    /// (task, device) pairs where the task ran out of memory.
    crashed: BTreeSet<(usize, usize)>,
    /// Speeds measured alone.
    solo: SoloTimes,
}

impl Default for LeastUtilised {
    fn default() -> Self {
        LeastUtilised {
            cap: 1.5,
            crashed: BTreeSet::new(),
            solo: SoloTimes::default(),
        }
    }
}

impl Policy for LeastUtilised {
    fn name(&self) -> &str {
        "util"
    }

    fn place(&mut self, view: &dyn PolicyView, task: Waiting<'_>) -> PlaceOrQueue {
        self.solo.observe(view);
        let mut best: Option<(f64, usize)> = None;
        for device in 0..view.devices() {
            let count = view.resident_count(device);
            if count >= MAX_RESIDENTS
                || (count > 0 && self.crashed.contains(&(task.spec.id, device)))
            {
                continue;
            }
            let used: f64 = view
                .residents(device)
                .iter()
                .map(|r| self.solo.share(r))
                .sum();
            if used < self.cap && best.is_none_or(|(b, _)| used < b) {
                best = Some((used, device));
            }
        }
        best.map_or(PlaceOrQueue::Queue, |(_, device)| {
            PlaceOrQueue::place(device, task.batch_size)
        })
    }

    fn on_oom(&mut self, device: usize, task: usize, _batch_size: u32) -> OomAction {
        self.crashed.insert((task, device));
        OomAction::RestartHalf
    }

    fn on_finish(&mut self, _device: usize, task: usize) {
        self.crashed.retain(|(t, _)| *t != task);
        self.solo.forget(task);
    }
}
