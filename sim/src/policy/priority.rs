//! Priority: exclusive GPUs, production jobs first. What a cluster that protects its
//! production jobs without sharing does (TGS's "priority" baseline): no job ever shares a
//! GPU, so no production job is ever slowed, and opportunistic jobs get what is left.
//!
//! Precisely: every GPU runs at most one job at its submitted batch size. A production
//! job takes the first idle GPU. An opportunistic job takes the first idle GPU only while
//! more GPUs are idle than production jobs wait (counting every waiting production job,
//! whether or not the engine offers it in this pass): a GPU a waiting production job could
//! have is never given to an opportunistic one. It is not preemptive: a running
//! opportunistic job is never evicted for a production job, which waits for the next GPU
//! to free up. Within a class, jobs go in the order the engine offers them (submission
//! order). With `--admission fifo` only the head of the queue is offered, so holding an
//! opportunistic head back for the production jobs behind it would stop the queue: there
//! the policy is `exclusive`.

use crate::policy::{Admission, PlaceOrQueue, Policy};
use crate::view::{PolicyView, Waiting};

/// Exclusive GPUs, production jobs first.
#[derive(Debug, Default)]
pub struct Priority {
    /// Waiting production jobs, with the [`PolicyView::waiting_version`] they were
    /// counted at (the queue can be long; it changes far less often than it is asked).
    waiting_production: Option<(u64, usize)>,
}

impl Priority {
    fn waiting_production(&mut self, view: &dyn PolicyView) -> usize {
        let version = view.waiting_version();
        match self.waiting_production {
            Some((at, count)) if at == version => count,
            _ => {
                let count = view.waiting().iter().filter(|s| s.is_production()).count();
                self.waiting_production = Some((version, count));
                count
            }
        }
    }
}

impl Policy for Priority {
    fn name(&self) -> &str {
        "priority"
    }

    fn place(&mut self, view: &dyn PolicyView, task: Waiting<'_>) -> PlaceOrQueue {
        let mut idle = (0..view.devices()).filter(|d| view.resident_count(*d) == 0);
        let Some(first) = idle.next() else {
            return PlaceOrQueue::Queue;
        };
        if !task.spec.is_production() && view.admission() == Admission::EachTask {
            let idle_count = 1 + idle.count();
            if idle_count <= self.waiting_production(view) {
                return PlaceOrQueue::Queue;
            }
        }
        PlaceOrQueue::place(first, task.batch_size)
    }
}
