//! The shrink plan: which residents give back memory, and how much, so that a
//! newcomer fits a shared device (see [`shrink_plan`]).
use std::borrow::Cow;

use super::Shrink;
use crate::model::MemoryEstimator;
use crate::view::DeviceState;

/// Shrinks of `device`'s residents after which a newcomer needing `need` MiB fits in
/// `usable`, or `None` when no shrink makes room.
///
/// Each resident may step down its candidate batch sizes (the tuner's lattice, within the
/// sizes it allows); at a smaller size it is counted at the estimator's bound there, which
/// never drops below its bound at the smallest size it was measured at (weights and
/// optimiser state do not shrink), so only what the tuner grew can be given back. Greedy:
/// the step that frees the most memory first, so as few residents move as little as
/// possible.
pub(super) fn shrink_plan(
    device: &DeviceState,
    memory: &dyn MemoryEstimator,
    usable: u64,
    need: u64,
) -> Option<Vec<Shrink>> {
    pub(super) struct Steps<'d> {
        /// (batch size, MiB) from the current size downwards; the first is what it uses now.
        steps: Cow<'d, [(u32, u64)]>,
        at: usize,
    }
    // Computed once per change of the device (see `DeviceSummary::shrink_steps`).
    let cached = &device.summary().shrink_steps;
    let mut options: Vec<Steps> = device
        .residents
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let steps = match cached.get(i) {
                Some(steps) if cached.len() == device.residents.len() => Cow::Borrowed(&steps[..]),
                _ => Cow::Owned(r.shrink_steps(memory)),
            };
            Steps { steps, at: 0 }
        })
        .collect();
    let mut used: u64 = options.iter().map(|o| o.steps[0].1).sum();
    while used + need > usable {
        let (best, saving) = options
            .iter()
            .enumerate()
            .filter_map(|(i, o)| {
                let now = o.steps[o.at].1;
                let next = o.steps.get(o.at + 1)?.1;
                Some((i, now.saturating_sub(next)))
            })
            .max_by_key(|&(i, saving)| (saving, std::cmp::Reverse(i)))?;
        if saving == 0 {
            return None;
        }
        let o = &mut options[best];
        used -= saving;
        o.at += 1;
    }
    Some(
        device
            .residents
            .iter()
            .zip(&options)
            .filter(|(_, o)| o.at > 0)
            .map(|(r, o)| Shrink {
                task_id: r.reservation.task_id.clone(),
                batch_size: o.steps[o.at].0,
                bound_mib: o.steps[o.at].1,
            })
            .collect(),
    )
}
