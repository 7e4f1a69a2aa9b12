//! Exclusive FIFO: one job per GPU, the first idle GPU, the submitted batch size.
//! What most clusters do today; never out of memory, never interfered with.

use crate::policy::{PlaceOrQueue, Policy};
use crate::view::{PolicyView, Waiting};

/// One job per GPU.
#[derive(Debug, Default)]
pub struct Exclusive;

impl Policy for Exclusive {
    fn name(&self) -> &str {
        "exclusive"
    }

    fn place(&mut self, view: &dyn PolicyView, task: Waiting<'_>) -> PlaceOrQueue {
        (0..view.devices())
            .find(|d| view.resident_count(*d) == 0)
            .map_or(PlaceOrQueue::Queue, |device| {
                PlaceOrQueue::place(device, task.batch_size)
            })
    }
}
