//! Turning cumulative step counters into a robust step time.
//!
//! The reporter samples the loop's counters several times per report interval. A window
//! between two samples counts only when no batch-size change happened in it (same
//! generation at both ends), so a report never mixes two configurations. The reported step
//! time is the *median* of the last [`WINDOWS`] clean windows' mean step times under the
//! current configuration: one slow step (a checkpoint, a data-loader stall) inflates one
//! window and moves a mean, not a median. The windows restart with each new configuration,
//! and the last measurement is kept (with the batch size and round it was taken under)
//! until a new one exists.

use std::collections::VecDeque;

use iadeep_objective::stats::median;

use crate::shared::Snapshot;

/// Windows the reported step time is the median of.
pub(crate) const WINDOWS: usize = 8;

/// The step time and what it was measured under.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Measured {
    pub step_time_s: f64,
    pub batch_size: u32,
    pub round: u64,
    pub generation: u64,
}

#[derive(Debug)]
pub(crate) struct StepTimer {
    prev: Option<Snapshot>,
    /// Mean step time of the latest clean windows of the current configuration.
    windows: VecDeque<f64>,
    measured: Option<Measured>,
}

impl StepTimer {
    pub(crate) fn new() -> StepTimer {
        StepTimer {
            prev: None,
            windows: VecDeque::with_capacity(WINDOWS),
            measured: None,
        }
    }

    /// Adds a sample; true when it gave the first measurement of a new configuration.
    pub(crate) fn sample(&mut self, now: Snapshot) -> bool {
        let Some(prev) = self.prev.replace(now) else {
            return false;
        };
        if prev.generation != now.generation || now.steps <= prev.steps {
            return false;
        }
        let steps = (now.steps - prev.steps) as f64;
        let window = now.nanos.saturating_sub(prev.nanos) as f64 / steps / 1e9;
        let first = self.measured.is_none_or(|m| m.generation != now.generation);
        if first {
            self.windows.clear();
        }
        if self.windows.len() == WINDOWS {
            self.windows.pop_front();
        }
        self.windows.push_back(window);
        let step_time_s = median(self.windows.make_contiguous()).unwrap_or(window);
        self.measured = Some(Measured {
            step_time_s,
            batch_size: now.batch_size,
            round: now.round,
            generation: now.generation,
        });
        first
    }

    /// The latest measurement, if any.
    pub(crate) fn measured(&self) -> Option<Measured> {
        self.measured
    }

    /// The latest counters seen.
    pub(crate) fn last(&self) -> Option<Snapshot> {
        self.prev
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(generation: u64, steps: u64, secs: f64, batch_size: u32) -> Snapshot {
        Snapshot {
            generation,
            steps,
            samples: steps * u64::from(batch_size),
            nanos: (secs * 1e9) as u64,
            batch_size,
            round: generation,
        }
    }

    #[test]
    fn windows_across_a_change_are_discarded_and_the_median_restarts() {
        let mut timer = StepTimer::new();
        assert!(!timer.sample(snap(0, 0, 0.0, 32)));
        assert!(timer.sample(snap(0, 10, 1.0, 32)));
        assert_eq!(timer.measured().map(|m| m.step_time_s), Some(0.1));
        assert!(!timer.sample(snap(0, 20, 3.0, 32)));
        // Median (lower middle) of 0.1 and 0.2.
        let median = timer.measured().expect("measured").step_time_s;
        assert!((median - 0.1).abs() < 1e-12, "{median}");
        // The change to 64 happens inside this window: it is ignored and the old
        // measurement stays, labelled with its own batch size and round.
        assert!(!timer.sample(snap(1, 25, 4.0, 64)));
        assert_eq!(
            timer.measured().map(|m| (m.batch_size, m.round)),
            Some((32, 0))
        );
        assert!(timer.sample(snap(1, 35, 8.0, 64)));
        let m = timer.measured().expect("measured");
        assert_eq!((m.batch_size, m.round), (64, 1));
        assert!((m.step_time_s - 0.4).abs() < 1e-12);
    }

    /// One slow step inflates one window; the reported step time is
    /// the median of the windows, so it does not move.
    #[test]
    fn one_slow_window_does_not_move_the_step_time() {
        let mut timer = StepTimer::new();
        let mut secs = 0.0;
        timer.sample(snap(0, 0, secs, 32));
        for i in 1..=6u64 {
            // Ten steps per window, 0.1 s each; the fourth window holds a 10 s stall.
            secs += if i == 4 { 10.9 } else { 1.0 };
            timer.sample(snap(0, i * 10, secs, 32));
        }
        let step = timer.measured().expect("measured").step_time_s;
        assert!((step - 0.1).abs() < 1e-9, "{step}");
    }

    #[test]
    fn idle_windows_change_nothing() {
        let mut timer = StepTimer::new();
        timer.sample(snap(0, 5, 1.0, 8));
        timer.sample(snap(0, 5, 1.0, 8));
        assert_eq!(timer.measured(), None);
    }
}
