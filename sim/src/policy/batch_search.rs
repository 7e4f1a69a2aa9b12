//! Trying a job's batch sizes one reporting interval each and keeping the best: the
//! search of the reference approach (its newly placed job) and of `pollux` (each job on
//! its own GPU). The score is the caller's, lower is better.

use iadeep_objective::PdInput;

use std::collections::BTreeMap;

use crate::policy::{Assignment, TuneStep};
use crate::view::{PolicyView, ResidentJob};

/// One tuning call on `device` for policies that keep one search per device: scores
/// the searched job's last interval with `score` (when it ran) and says what runs next.
/// The search is dropped once it is over or its job left the device.
pub fn tune_device(
    searches: &mut BTreeMap<usize, BatchSearch>,
    view: &dyn PolicyView,
    device: usize,
    score: impl Fn(&ResidentJob<'_>) -> f64,
) -> TuneStep {
    let Some(search) = searches.get_mut(&device) else {
        return TuneStep::Done;
    };
    let residents = view.residents(device);
    let Some(me) = residents.iter().find(|r| r.spec.id == search.task) else {
        searches.remove(&device);
        return TuneStep::Done;
    };
    let ran = me.report.running.then(|| (me.report.batch_size, score(me)));
    let (step, over) = search.tune_step(ran, me.report.batch_size);
    if over {
        searches.remove(&device);
    }
    step
}

/// PD (the tuner's objective, docs/design.md, "The objective") of a resident's last
/// reported interval: its measured step time at its batch size against `solo_step_s_m0`,
/// its step time alone at m0, with the φ its agent estimated. Infinite when the report
/// cannot give one.
///
/// The scores of one search compare one job's sizes with each other, so a solo step
/// time common to all of them only scales them: where it is unknown any fixed stand-in
/// ([`UNKNOWN_SOLO_STEP_S`]) gives the same choice.
pub fn pd_alone_or_shared(me: &ResidentJob<'_>, solo_step_s_m0: f64) -> f64 {
    PdInput {
        m0: f64::from(me.spec.m0),
        solo_step_s_m0,
        m: f64::from(me.report.batch_size),
        co_step_s: me.report.step_time_s,
        noise_scale: me.report.grad_noise_scale,
    }
    .pd()
    .unwrap_or(f64::INFINITY)
}

/// The stand-in for a job's unknown step time alone at m0 in scores that compare only
/// the job's own sizes (see [`pd_alone_or_shared`]).
pub const UNKNOWN_SOLO_STEP_S: f64 = 1.0;

/// What to do after a measured interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SearchStep {
    /// Run this size for the next interval.
    Try(u32),
    /// Every candidate ran: settle at the best-scored size.
    Settle(u32),
    /// Nothing was scored (no candidate ran).
    Done,
}

/// Exhaustive search over a job's candidate batch sizes.
#[derive(Clone, Debug)]
pub struct BatchSearch {
    /// The task searched.
    pub task: usize,
    candidates: Vec<u32>,
    next: usize,
    tried: Vec<(u32, f64)>,
}

impl BatchSearch {
    /// A search of `task` over `candidates` (tried in order).
    pub fn new(task: usize, candidates: Vec<u32>) -> BatchSearch {
        BatchSearch {
            task,
            candidates,
            next: 0,
            tried: Vec::new(),
        }
    }

    /// Records the score of the size that just ran (`None` when nothing was measured)
    /// and says what runs next.
    pub fn step(&mut self, ran: Option<(u32, f64)>) -> SearchStep {
        if let Some((size, score)) = ran
            && score.is_finite()
        {
            self.tried.push((size, score));
        }
        while self.next < self.candidates.len()
            && self
                .tried
                .iter()
                .any(|(b, _)| *b == self.candidates[self.next])
        {
            self.next += 1;
        }
        if let Some(&size) = self.candidates.get(self.next) {
            self.next += 1;
            return SearchStep::Try(size);
        }
        self.tried
            .iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(SearchStep::Done, |(b, _)| SearchStep::Settle(*b))
    }

    /// [`BatchSearch::step`] as the engine's tuning step for a job now at `current`;
    /// `true` when the search is over.
    pub fn tune_step(&mut self, ran: Option<(u32, f64)>, current: u32) -> (TuneStep, bool) {
        let task = self.task;
        let apply = |size| TuneStep::Apply {
            assignments: vec![Assignment::new(task, size)],
            again_in_s: None,
        };
        match self.step(ran) {
            SearchStep::Try(size) => (apply(size), false),
            SearchStep::Settle(size) if size != current => (apply(size), true),
            SearchStep::Settle(_) | SearchStep::Done => (TuneStep::Done, true),
        }
    }

    /// The job ran out of memory at `batch_size`: larger candidates are off.
    pub fn out_of_memory_at(&mut self, batch_size: u32) {
        self.candidates.retain(|b| *b < batch_size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tries_every_candidate_once_then_settles_at_the_best() {
        let mut search = BatchSearch::new(7, vec![16, 32, 64]);
        assert_eq!(search.step(Some((32, 2.0))), SearchStep::Try(16));
        assert_eq!(search.step(Some((16, 1.5))), SearchStep::Try(64));
        search.out_of_memory_at(64);
        assert_eq!(search.step(None), SearchStep::Settle(16));
        assert_eq!(BatchSearch::new(1, vec![]).step(None), SearchStep::Done);
    }
}
