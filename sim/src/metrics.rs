//! What a run measured, and its summary.

use iadeep_objective::stats;
use serde::Serialize;

/// One task's fate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TaskOutcome {
    pub id: usize,
    pub model: String,
    pub m0: u32,
    pub submit_s: f64,
    pub start_s: f64,
    pub finish_s: f64,
    /// Out-of-memory crashes: the card's memory ran out (see [`RunMetrics::ooms`]).
    pub ooms: u32,
    /// Fenced out-of-memory errors: its run needed more than its fence.
    pub fenced_ooms: u32,
    /// Work the task had to do and did, samples at m0 (equal when it finished).
    pub work_samples: f64,
    pub done_samples: f64,
    /// The GPU it finished on.
    pub device: usize,
    /// Batch size it finished at.
    pub final_batch_size: u32,
    /// Its slowdown cap when it is production; `None` for an opportunistic job.
    pub max_slowdown: Option<f64>,
    /// Seconds it ran on a device, and the part of them during which its true PD was above
    /// its cap (the production default for an opportunistic job; see `crate::engine`).
    pub running_s: f64,
    pub above_cap_s: f64,
    /// Where `above_cap_s` was spent, to tell its causes apart.
    pub above_cap_where: AboveCapWhere,
    /// Times it was evicted, and the work those evictions cost: seconds of progress alone
    /// at m0 lost since its last checkpoints.
    pub evictions: u32,
    pub evicted_work_s: f64,
}

/// Where a task's time above its cap was spent (each a part of
/// [`TaskOutcome::above_cap_s`]; the first two do not overlap, the third overlaps both).
/// Alone at its m0 a job's PD is 1, so time above the cap there is always shared: the
/// interference placement predicted wrong (or a co-runner the tuner had not shrunk yet);
/// time at another size is the tuner's (its search exploring, or a size whose PD drifted
/// as the job's noise scale grew).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct AboveCapWhere {
    /// At a batch size below its m0.
    pub below_m0_s: f64,
    /// At a batch size above its m0.
    pub above_m0_s: f64,
    /// With another job active on its device.
    pub shared_s: f64,
}

impl TaskOutcome {
    /// Completion time: submit to end.
    pub fn completion_s(&self) -> f64 {
        self.finish_s - self.submit_s
    }
}

/// Everything recorded during one run.
#[derive(Clone, Debug, Default)]
pub struct RunMetrics {
    pub policy: String,
    pub gpus: usize,
    pub tasks: Vec<TaskOutcome>,
    /// Out-of-memory crashes: a card's memory ran out, so the allocation of whichever
    /// job asked next failed, a co-runner's as likely as the job that grew (jobs whose
    /// agent has no fence, or fences that together exceed the card). The crashed job
    /// restarts after `EngineParams::restart_s`.
    pub ooms: u64,
    /// Fenced out-of-memory errors: a fenced job's run needed more than its fence, so its
    /// own allocation failed and it fell back, its co-runners untouched (contained; see
    /// the engine's module docs).
    pub fenced_ooms: u64,
    /// Evictions of running tasks by the policy (see `crate::engine`).
    pub evictions: u64,
    /// Tuning rounds that applied a configuration.
    pub tuning_rounds: u64,
    /// Batch-size changes applied by tuning.
    pub batch_changes: u64,
    /// Wall time of each placement decision, µs (not deterministic; not in JSON).
    pub decision_latency_us: Vec<f64>,
    /// Wall time of each tuning call, µs.
    pub tune_latency_us: Vec<f64>,
    /// `(time s, busy devices, work rate in GPU-equivalents)` after each change.
    pub util: Vec<(f64, usize, f64)>,
    pub events: u64,
    /// Each job's batch size and true PD from each change of its device on (a job joined
    /// or left, or a tuning round applied): what `tuner.svg` draws per GPU.
    pub batch_trace: Vec<BatchPoint>,
}

/// One job's batch size and PD on its device from `at_s` until its next point (or its end).
#[derive(Clone, Debug, PartialEq)]
pub struct BatchPoint {
    pub at_s: f64,
    pub device: usize,
    pub task: usize,
    pub batch_size: u32,
    /// The world's PD of the job then: goodput alone at m0 over its goodput now.
    pub pd: f64,
}

impl RunMetrics {
    /// Records the utilisation after a change at `now` (one point per instant).
    pub fn record_util(&mut self, now: f64, busy: usize, work_rate: f64) {
        match self.util.last_mut() {
            Some(last) if last.0 == now => *last = (now, busy, work_rate),
            _ => self.util.push((now, busy, work_rate)),
        }
    }

    /// The summary numbers.
    pub fn summary(&self) -> Summary {
        let mut completion: Vec<f64> = self.tasks.iter().map(TaskOutcome::completion_s).collect();
        completion.sort_by(f64::total_cmp);
        let first_submit = self
            .tasks
            .iter()
            .map(|t| t.submit_s)
            .fold(f64::INFINITY, f64::min);
        let last_finish = self.tasks.iter().map(|t| t.finish_s).fold(0.0, f64::max);
        let makespan = if self.tasks.is_empty() {
            0.0
        } else {
            last_finish - first_submit
        };
        Summary {
            policy: self.policy.clone(),
            tasks: self.tasks.len(),
            avg_ct_s: mean_or_zero(&completion),
            p50_ct_s: quantile_or_zero(&completion, 0.5),
            p99_ct_s: quantile_or_zero(&completion, 0.99),
            makespan_s: makespan,
            ooms: self.ooms,
            fenced_ooms: self.fenced_ooms,
            avg_util: self.average_busy_fraction(first_submit, last_finish),
            avg_work_rate: self.average_work_rate(first_submit, last_finish),
            tuning_rounds: self.tuning_rounds,
            batch_changes: self.batch_changes,
            decision_latency_us: mean_or_zero(&self.decision_latency_us),
            decision_latency_p99_us: quantile_or_zero(&self.decision_latency_us, 0.99),
            tune_latency_us: mean_or_zero(&self.tune_latency_us),
            classes: Classes {
                production: ClassSummary::of(
                    self.tasks.iter().filter(|t| t.max_slowdown.is_some()),
                ),
                opportunistic: ClassSummary::of(
                    self.tasks.iter().filter(|t| t.max_slowdown.is_none()),
                ),
            },
        }
    }

    /// Time-weighted means of the busy GPUs and the work rate over `bins` equal
    /// windows of `[from, to]`, in one pass over the step function `util` (each value
    /// holds until the next change). A run of 10,000 jobs has hundreds of thousands of
    /// changes; its CSV and plot use a few thousand bins of these.
    pub fn util_bins(&self, from: f64, to: f64, bins: usize) -> Vec<UtilBin> {
        if to.partial_cmp(&from) != Some(std::cmp::Ordering::Greater) || bins == 0 {
            return Vec::new();
        }
        let width = (to - from) / bins as f64;
        let mut out: Vec<UtilBin> = (0..bins)
            .map(|i| UtilBin {
                start_s: from + i as f64 * width,
                end_s: if i + 1 == bins {
                    to
                } else {
                    from + (i + 1) as f64 * width
                },
                busy_gpus: 0.0,
                work_rate: 0.0,
            })
            .collect();
        for (index, &(at, busy, rate)) in self.util.iter().enumerate() {
            let mut start = at.max(from);
            let end = self.util.get(index + 1).map_or(to, |next| next.0).min(to);
            if end <= start {
                continue;
            }
            let mut bin = (((start - from) / width) as usize).min(bins - 1);
            loop {
                let piece_end = end.min(out[bin].end_s);
                if piece_end > start {
                    out[bin].busy_gpus += busy as f64 * (piece_end - start);
                    out[bin].work_rate += rate * (piece_end - start);
                    start = piece_end;
                }
                if start >= end || bin + 1 == bins {
                    break;
                }
                bin += 1;
            }
        }
        for bin in &mut out {
            let span = bin.end_s - bin.start_s;
            if span > 0.0 {
                bin.busy_gpus /= span;
                bin.work_rate /= span;
            }
        }
        out
    }

    /// Mean fraction of GPUs with at least one task, from first submit to last end.
    pub fn average_busy_fraction(&self, from: f64, to: f64) -> f64 {
        let gpus = self.gpus.max(1) as f64;
        self.util_bins(from, to, 1)
            .first()
            .map_or(0.0, |b| b.busy_gpus / gpus)
    }

    /// Mean useful work per GPU (1 = every GPU running one job alone at full speed).
    pub fn average_work_rate(&self, from: f64, to: f64) -> f64 {
        let gpus = self.gpus.max(1) as f64;
        self.util_bins(from, to, 1)
            .first()
            .map_or(0.0, |b| b.work_rate / gpus)
    }
}

/// Time-weighted means over one window of a run (see [`RunMetrics::util_bins`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UtilBin {
    pub start_s: f64,
    pub end_s: f64,
    /// Mean number of GPUs with at least one task.
    pub busy_gpus: f64,
    /// Mean useful work, GPU-equivalents of solo progress.
    pub work_rate: f64,
}

/// The mean of a run's values; an empty run reports 0.
fn mean_or_zero(values: &[f64]) -> f64 {
    stats::mean(values.iter().copied()).unwrap_or(0.0)
}

/// The nearest-rank quantile of a run's values; an empty run reports 0.
fn quantile_or_zero(values: &[f64], q: f64) -> f64 {
    stats::quantile(values, q).unwrap_or(0.0)
}

/// The numbers a run is judged by.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub policy: String,
    pub tasks: usize,
    pub avg_ct_s: f64,
    pub p50_ct_s: f64,
    pub p99_ct_s: f64,
    pub makespan_s: f64,
    /// Out-of-memory crashes that reach the card (see [`RunMetrics::ooms`]).
    pub ooms: u64,
    /// Fenced out-of-memory errors, contained to their job (see [`RunMetrics::fenced_ooms`]).
    pub fenced_ooms: u64,
    /// Mean fraction of GPUs busy (at least one task) over the makespan.
    pub avg_util: f64,
    /// Mean useful work per GPU over the makespan (GPU-equivalents of solo progress).
    pub avg_work_rate: f64,
    pub tuning_rounds: u64,
    pub batch_changes: u64,
    pub decision_latency_us: f64,
    pub decision_latency_p99_us: f64,
    pub tune_latency_us: f64,
    /// The same jobs by class.
    pub classes: Classes,
}

/// A run's results per job class (`classes` in `--json`).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Classes {
    pub production: ClassSummary,
    pub opportunistic: ClassSummary,
}

/// The results of one class of jobs in a run; all zero for a class without jobs.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClassSummary {
    pub tasks: usize,
    pub avg_ct_s: f64,
    pub p99_ct_s: f64,
    /// Share of the class's running time during which a job's true PD was above its cap
    /// (for opportunistic jobs, which have none, above the production default: how often
    /// they ran slower than a production job may).
    pub above_cap_frac: f64,
    /// Evictions of the class's jobs, and the work they cost (seconds of progress alone
    /// at m0).
    pub evictions: u64,
    pub evicted_work_s: f64,
}

impl ClassSummary {
    /// The summary of `tasks`.
    pub fn of<'a>(tasks: impl Iterator<Item = &'a TaskOutcome>) -> ClassSummary {
        let tasks: Vec<&TaskOutcome> = tasks.collect();
        let mut completion: Vec<f64> = tasks.iter().map(|t| t.completion_s()).collect();
        completion.sort_by(f64::total_cmp);
        let running: f64 = tasks.iter().map(|t| t.running_s).sum();
        let above: f64 = tasks.iter().map(|t| t.above_cap_s).sum();
        ClassSummary {
            tasks: tasks.len(),
            avg_ct_s: mean_or_zero(&completion),
            p99_ct_s: quantile_or_zero(&completion, 0.99),
            above_cap_frac: if running > 0.0 { above / running } else { 0.0 },
            evictions: tasks.iter().map(|t| u64::from(t.evictions)).sum(),
            evicted_work_s: tasks.iter().map(|t| t.evicted_work_s).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_and_time_averages() {
        let sorted: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile_or_zero(&sorted, 0.5), 50.0);
        assert_eq!(quantile_or_zero(&sorted, 0.99), 99.0);
        assert_eq!(quantile_or_zero(&[], 0.5), 0.0);
        let mut metrics = RunMetrics {
            gpus: 2,
            ..RunMetrics::default()
        };
        metrics.record_util(0.0, 2, 2.0);
        metrics.record_util(10.0, 1, 1.0);
        metrics.record_util(10.0, 0, 0.0);
        assert_eq!(metrics.util.len(), 2);
        // 10 s at 100 %, 10 s at 0 %.
        assert!((metrics.average_busy_fraction(0.0, 20.0) - 0.5).abs() < 1e-12);
        let bins = metrics.util_bins(0.0, 20.0, 4);
        let busy: Vec<f64> = bins.iter().map(|b| b.busy_gpus).collect();
        assert_eq!(busy, [2.0, 2.0, 0.0, 0.0]);
        // A bin straddling the change averages it.
        let bins = metrics.util_bins(5.0, 15.0, 1);
        assert!((bins[0].busy_gpus - 1.0).abs() < 1e-12, "{bins:?}");
        assert!((bins[0].work_rate - 1.0).abs() < 1e-12, "{bins:?}");
        assert!(metrics.util_bins(3.0, 3.0, 10).is_empty());
    }
}
