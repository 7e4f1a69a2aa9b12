//! One round's measurement: the fresh reports of every co-located task under the round,
//! turned into a robust step time per task and Σ PD.
//!
//! Why robust: one slow step (a checkpoint, a data-loader stall, a neighbour's burst) must
//! not decide a round. The agent already reports the median of its recent timing windows;
//! here the first fresh report of each task is dropped (it may have been timed while a
//! co-runner still ran its previous batch size) and the median of the next ones is taken.

use iadeep_proto::TaskReport;

use iadeep_objective::stats::median;

/// What the round is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// A configuration the search chose: its Σ PD becomes an observation.
    Explore,
    /// A check of the settled configuration (drift): compared, not observed.
    Check,
    /// A production job is above its slowdown cap: a round that shrinks its opportunistic
    /// co-runners once the search holds its most observations, or that measures again what
    /// runs with nothing left to shrink (counting rounds towards a breach). Its PDs are
    /// checked against the caps, its Σ PD is not observed.
    Guard,
}

/// The reports of one task under the round.
#[derive(Clone, Debug, Default, PartialEq)]
struct Series {
    /// Sequence number of the last report taken (reports at or below it are not fresh).
    last_seq: Option<u64>,
    /// Fresh reports seen, the dropped first one included.
    fresh: u32,
    /// Step times of the fresh reports after the first.
    step_times: Vec<f64>,
    /// The latest gradient noise scale reported under the round.
    noise_scale: Option<f64>,
    /// Out of memory at the assigned size under the round.
    out_of_memory: bool,
}

/// A round being measured.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Measurement {
    /// The round each task runs under: the same for a round the tuner assigned; the
    /// rounds of their current assignments when what runs is measured as it is (a
    /// newcomer's starting assignment has a round of its own).
    pub rounds: Vec<u64>,
    /// The configuration (indices into the search's sizes) and its batch sizes.
    pub config: Vec<usize>,
    pub batch_sizes: Vec<u32>,
    pub purpose: Purpose,
    /// When the round started (driver's clock, ms): it is dropped after the timeout.
    pub started_ms: i64,
    series: Vec<Series>,
}

/// How a complete round came out, per task in the search's order.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Outcome {
    /// Robust step time and latest noise scale of every task.
    Measured {
        step_times: Vec<f64>,
        noise_scales: Vec<Option<f64>>,
    },
    /// These tasks (indices) ran out of memory at their assigned sizes.
    OutOfMemory(Vec<usize>),
}

impl Measurement {
    /// A round of `batch_sizes`, each task under its round in `rounds`, that counts
    /// reports newer than `seen_seq` (per task: the sequence of the report each task had
    /// published when the round began, if any).
    pub fn new(
        rounds: Vec<u64>,
        config: Vec<usize>,
        batch_sizes: Vec<u32>,
        purpose: Purpose,
        started_ms: i64,
        seen_seq: &[Option<u64>],
    ) -> Measurement {
        let series = seen_seq
            .iter()
            .map(|&last_seq| Series {
                last_seq,
                ..Series::default()
            })
            .collect();
        Measurement {
            rounds,
            config,
            batch_sizes,
            purpose,
            started_ms,
            series,
        }
    }

    /// The task at `index` runs the same batch size under a newer `round` (another writer
    /// re-issued its assignment, e.g. the placer settling its reservation): its reports
    /// under that round count from now on, those already taken stay.
    pub fn follow_round(&mut self, index: usize, round: u64) {
        if let Some(r) = self.rounds.get_mut(index) {
            *r = round;
        }
    }

    /// Takes in a report of the task at `index`. Only a report made under this round, at the
    /// assigned batch size and newer than any taken before counts; an out-of-memory report
    /// at or below the assigned size marks the round, and so does a report under this round
    /// at a smaller size: the agent applied the assigned size and fell back from it, which
    /// it does only when it ran out of memory. The second is what shows a crash the agent's
    /// report does not name: it repeats the *smallest* size that ever failed, so a job that
    /// once crashed at a small size and now crashes at a larger one reports the old size
    /// (which the tuner sets aside for a fenced production job running above it); without
    /// it, such a round waited for reports at the assigned size that never came, was
    /// dropped, and the same size was assigned again (in the simulator, P100 seed 4: a
    /// Transformer assigned 256 over its fence 1,536 times in 12 hours, running at 128
    /// above its cap meanwhile).
    pub fn add(&mut self, index: usize, report: &TaskReport) {
        let (Some(series), Some(&assigned), Some(&round)) = (
            self.series.get_mut(index),
            self.batch_sizes.get(index),
            self.rounds.get(index),
        ) else {
            return;
        };
        if report.assignment_round != round || series.last_seq.is_some_and(|s| report.seq <= s) {
            return;
        }
        series.last_seq = Some(report.seq);
        if report
            .oom_batch_size
            .is_some_and(|oom| oom > 0 && oom <= assigned)
        {
            series.out_of_memory = true;
            return;
        }
        if report.batch_size > 0 && report.batch_size < assigned {
            series.out_of_memory = true;
            return;
        }
        if report.batch_size != assigned
            || !(report.step_time_s.is_finite() && report.step_time_s > 0.0)
        {
            return;
        }
        series.fresh += 1;
        if series.fresh > 1 {
            series.step_times.push(report.step_time_s);
        }
        if let Some(phi) = report
            .grad_noise_scale
            .filter(|p| p.is_finite() && *p >= 0.0)
        {
            series.noise_scale = Some(phi);
        }
    }

    /// The outcome once every task has `reports_per_round` fresh reports (the first of
    /// which is dropped), or as soon as one ran out of memory; `None` while incomplete.
    pub fn outcome(&self, reports_per_round: u32) -> Option<Outcome> {
        let oom: Vec<usize> = (0..self.series.len())
            .filter(|&i| self.series[i].out_of_memory)
            .collect();
        if !oom.is_empty() {
            return Some(Outcome::OutOfMemory(oom));
        }
        if self.series.iter().any(|s| s.fresh < reports_per_round) {
            return None;
        }
        let step_times = self
            .series
            .iter()
            .map(|s| median(&s.step_times))
            .collect::<Option<Vec<f64>>>()?;
        Some(Outcome::Measured {
            step_times,
            noise_scales: self.series.iter().map(|s| s.noise_scale).collect(),
        })
    }

    /// Tasks (indices) still short of fresh reports, for the log of a dropped round.
    pub fn missing(&self, reports_per_round: u32) -> Vec<usize> {
        (0..self.series.len())
            .filter(|&i| self.series[i].fresh < reports_per_round)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(round: u64, seq: u64, batch_size: u32, step: f64) -> TaskReport {
        TaskReport {
            assignment_round: round,
            seq,
            batch_size,
            step_time_s: step,
            ..Default::default()
        }
    }

    #[test]
    fn the_median_after_the_first_report_ignores_one_straggler() {
        let mut m = Measurement::new(vec![3], vec![0], vec![32], Purpose::Explore, 0, &[Some(9)]);
        m.add(0, &report(3, 9, 32, 0.1)); // not fresh
        m.add(0, &report(2, 10, 32, 0.1)); // another round
        m.add(0, &report(3, 11, 64, 0.1)); // another size
        m.add(0, &report(3, 12, 32, 0.5)); // first fresh: dropped
        m.add(0, &report(3, 13, 32, 0.10));
        m.add(0, &report(3, 14, 32, 2.39)); // a straggler
        assert_eq!(m.outcome(4), None);
        assert_eq!(m.missing(4), vec![0]);
        m.add(0, &report(3, 15, 32, 0.11));
        match m.outcome(4) {
            Some(Outcome::Measured { step_times, .. }) => assert_eq!(step_times, vec![0.11]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_oom_at_or_below_the_assigned_size_ends_the_round() {
        let mut m = Measurement::new(
            vec![1, 1],
            vec![0, 0],
            vec![32, 64],
            Purpose::Explore,
            0,
            &[None, None],
        );
        let mut r = report(1, 1, 16, 0.0);
        r.oom_batch_size = Some(64);
        m.add(1, &r);
        assert_eq!(m.outcome(2), Some(Outcome::OutOfMemory(vec![1])));
        // An OOM above the assigned size is old news, not this round's.
        let mut m = Measurement::new(vec![1], vec![0], vec![32], Purpose::Explore, 0, &[None]);
        let mut r = report(1, 1, 32, 0.1);
        r.oom_batch_size = Some(64);
        m.add(0, &r);
        assert_eq!(m.outcome(2), None);
    }

    /// The agent fell back from the assigned size under this round: a crash there, even
    /// when its report repeats an older, smaller failure (or, set aside, none at all).
    #[test]
    fn a_report_under_the_round_below_the_assigned_size_is_an_oom() {
        let mut m = Measurement::new(vec![28], vec![4], vec![256], Purpose::Explore, 0, &[None]);
        m.add(0, &report(28, 1, 128, 0.2));
        assert_eq!(m.outcome(2), Some(Outcome::OutOfMemory(vec![0])));
        // Under an older round, a smaller size is what ran before: not this round's.
        let mut m = Measurement::new(vec![28], vec![4], vec![256], Purpose::Explore, 0, &[None]);
        m.add(0, &report(27, 1, 128, 0.2));
        assert_eq!(m.outcome(2), None);
    }
}
