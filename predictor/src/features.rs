//! Features of a task and its co-runners that say something about models never seen.
//!
//! A job name tells a model nothing about a new job; its solo profile does. Every
//! feature below is computed from [`TaskProfile`]s only (never from `model`, the
//! name), so two different models with the same profile look the same to the forest.
//!
//! Missing measurements are explicit: an optional value becomes two columns, an
//! indicator (1 = measured, 0 = unknown) and the value, where unknown is filled with
//! a documented *neutral* constant (the middle of the range), never with 0, which
//! would mean "idle". Trees can split on the indicator to treat unknowns apart.
//!
//! Inputs are sanitised (non-finite or non-positive step times and batch sizes are
//! clamped into a sane range) so that the feature vector is finite for any input:
//! predictions must never become NaN because one report was broken.

use iadeep_proto::TaskProfile;

/// Device kinds with their own one-hot column; anything else maps to `other`.
/// Kinds are compared case-insensitively.
pub const DEVICE_KINDS: [&str; 8] = ["k80", "p100", "v100", "t4", "a100", "h100", "h200", "other"];

/// Fill for an unknown SM or memory-bandwidth utilisation, in percent: the middle of
/// the range, so an unknown task is neither assumed idle nor saturating.
pub const NEUTRAL_UTIL_PCT: f64 = 50.0;
/// Fill for an unknown peak GPU memory, in MiB (log2 = 12): a mid-sized training job.
pub const NEUTRAL_MEM_MIB: f64 = 4096.0;

const MIN_STEP_S: f64 = 1e-6;
const MAX_STEP_S: f64 = 1e6;
/// Added to co-runner sums before a log, so that "no co-runner" stays finite.
const EMPTY_SUM: f64 = 1e-9;

/// Names of the columns, in order; `FEATURE_NAMES.len()` is the width of a row.
pub const FEATURE_NAMES: [&str; 40] = [
    // Device kind, one-hot (8).
    "device=k80",
    "device=p100",
    "device=v100",
    "device=t4",
    "device=a100",
    "device=h100",
    "device=h200",
    "device=other",
    // The task itself (9).
    "task.log2_solo_step_time_s",
    "task.log2_batch_size",
    "task.log2_samples_per_s",
    "task.sm_util_known",
    "task.sm_util_pct",
    "task.mem_bw_util_known",
    "task.mem_bw_util_pct",
    "task.gpu_mem_known",
    "task.log2_gpu_mem_mib",
    // Aggregates over co-runners (16).
    "co.count",
    "co.sum_solo_step_time_s",
    "co.max_solo_step_time_s",
    "co.log2_sum_samples_per_s",
    "co.log2_max_samples_per_s",
    "co.log2_sum_batch_size",
    "co.log2_max_batch_size",
    "co.sm_known_fraction",
    "co.sum_sm_util_pct",
    "co.max_sm_util_pct",
    "co.mem_bw_known_fraction",
    "co.sum_mem_bw_util_pct",
    "co.max_mem_bw_util_pct",
    "co.gpu_mem_known_fraction",
    "co.log2_sum_gpu_mem_mib",
    "co.log2_max_gpu_mem_mib",
    // Relations between the task and its co-runners (3).
    "rel.time_share",
    "rel.total_sm_util_pct",
    "rel.total_mem_bw_util_pct",
    // Logs and log-ratios of the co-runners' totals to the task's own values (4).
    "co.log2_sum_solo_step_time_s",
    "rel.log2_co_step_time_over_task",
    "rel.log2_co_samples_per_s_over_task",
    "rel.log2_co_batch_size_over_task",
];

/// Width of a feature row.
pub const N_FEATURES: usize = FEATURE_NAMES.len();

/// The columns the linear base leaves out (see [`crate::linear`]); it takes the
/// others, whose scale means the same for every model, so that a line through the
/// models seen says something about a new one: the device kind, logs of step times
/// and their ratio, the time share, utilisations and memory. Left to the forest:
/// batch sizes and samples per second (8,192 samples of a recommender are not 16
/// images, and within a family they only re-state the step time), and the
/// co-runner count, linear sums and maxima (the base sees pairs, where a maximum
/// repeats the sum; more co-runners are composed from pairs).
pub const NOT_IN_BASE: [&str; 14] = [
    "task.log2_batch_size",
    "task.log2_samples_per_s",
    "co.count",
    "co.sum_solo_step_time_s",
    "co.max_solo_step_time_s",
    "co.log2_sum_samples_per_s",
    "co.log2_max_samples_per_s",
    "co.log2_sum_batch_size",
    "co.log2_max_batch_size",
    "co.max_sm_util_pct",
    "co.max_mem_bw_util_pct",
    "co.log2_max_gpu_mem_mib",
    "rel.log2_co_samples_per_s_over_task",
    "rel.log2_co_batch_size_over_task",
];

/// The columns whose value changes when the same jobs run on a faster or slower GPU:
/// absolute step times and samples per second. Everything else is a batch size, a
/// utilisation, a memory figure, a count or a ratio between the task and its
/// co-runners, which a uniformly faster card leaves as it is. With
/// [`crate::LearnerParams::speed_free`] the model does not see these, so what it
/// learned on one GPU kind is not keyed by that kind's speed.
pub const SPEED_DEPENDENT: [&str; 7] = [
    "task.log2_solo_step_time_s",
    "task.log2_samples_per_s",
    "co.sum_solo_step_time_s",
    "co.max_solo_step_time_s",
    "co.log2_sum_samples_per_s",
    "co.log2_max_samples_per_s",
    "co.log2_sum_solo_step_time_s",
];

/// Sets the [`SPEED_DEPENDENT`] columns of `row` to 0, a constant no split or
/// coefficient can use.
pub fn mask_speed_dependent(row: &mut [f64]) {
    for (value, name) in row.iter_mut().zip(FEATURE_NAMES) {
        if SPEED_DEPENDENT.contains(&name) {
            *value = 0.0;
        }
    }
}

/// The column of the feature called `name`.
#[cfg(test)]
fn column(name: &str) -> Option<usize> {
    FEATURE_NAMES.iter().position(|n| *n == name)
}

/// The columns of the linear base: every column but [`NOT_IN_BASE`] (and, with
/// `speed_free`, but [`SPEED_DEPENDENT`]).
pub fn base_columns(speed_free: bool) -> Vec<usize> {
    (0..N_FEATURES)
        .filter(|&c| !NOT_IN_BASE.contains(&FEATURE_NAMES[c]))
        .filter(|&c| !(speed_free && SPEED_DEPENDENT.contains(&FEATURE_NAMES[c])))
        .collect()
}

/// A solo profile with every value sanitised and every unknown made explicit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CleanProfile {
    /// Seconds per step alone, clamped to [1e-6, 1e6].
    pub step_time_s: f64,
    /// Batch size, at least 1.
    pub batch_size: f64,
    /// Samples per second alone = batch size ÷ step time.
    pub samples_per_s: f64,
    /// SM utilisation in [0, 100] when measured.
    pub sm_util_pct: Option<f64>,
    /// Memory-bandwidth utilisation in [0, 100] when measured.
    pub mem_bw_util_pct: Option<f64>,
    /// Peak GPU memory in MiB when measured.
    pub gpu_mem_mib: Option<f64>,
}

fn clean_pct(value: Option<f64>) -> Option<f64> {
    value.filter(|v| v.is_finite()).map(|v| v.clamp(0.0, 100.0))
}

impl CleanProfile {
    /// Sanitises `task`: a broken value is clamped or treated as unknown, never NaN.
    pub fn from_profile(task: &TaskProfile) -> CleanProfile {
        let step_time_s = if task.solo_step_time_s.is_finite() {
            task.solo_step_time_s.clamp(MIN_STEP_S, MAX_STEP_S)
        } else {
            MAX_STEP_S
        };
        let batch_size = f64::from(task.batch_size.max(1));
        CleanProfile {
            step_time_s,
            batch_size,
            samples_per_s: batch_size / step_time_s,
            sm_util_pct: clean_pct(task.sm_util_pct),
            mem_bw_util_pct: clean_pct(task.mem_bw_util_pct),
            gpu_mem_mib: task.gpu_mem_mib.map(|m| m as f64),
        }
    }
}

/// The one-hot column of `device_kind`.
pub fn device_column(device_kind: &str) -> usize {
    // Compared in place: lower-casing into a new String cost an allocation per
    // prediction, and the placer makes ~150 per decision.
    let kind = device_kind.trim();
    DEVICE_KINDS
        .iter()
        .position(|k| k.eq_ignore_ascii_case(kind))
        .unwrap_or(DEVICE_KINDS.len() - 1)
}

fn known(value: Option<f64>) -> f64 {
    if value.is_some() { 1.0 } else { 0.0 }
}

/// The feature row of `task` sharing a `device_kind` GPU with `corunners`.
pub fn feature_row(device_kind: &str, task: &TaskProfile, corunners: &[TaskProfile]) -> Vec<f64> {
    let mut row = [0.0; N_FEATURES];
    feature_row_into(device_kind, task, corunners, &mut row);
    row.to_vec()
}

/// [`feature_row`] written into `row` (e.g. on the stack): the same values, without
/// allocating, for the prediction path.
pub fn feature_row_into(
    device_kind: &str,
    task: &TaskProfile,
    corunners: &[TaskProfile],
    row: &mut [f64; N_FEATURES],
) {
    let mut row = RowWriter { row, next: 0 };
    let mut device = [0.0; DEVICE_KINDS.len()];
    device[device_column(device_kind)] = 1.0;
    for d in device {
        row.push(d);
    }

    let t = CleanProfile::from_profile(task);
    row.push(t.step_time_s.log2());
    row.push(t.batch_size.log2());
    row.push(t.samples_per_s.log2());
    row.push(known(t.sm_util_pct));
    row.push(t.sm_util_pct.unwrap_or(NEUTRAL_UTIL_PCT));
    row.push(known(t.mem_bw_util_pct));
    row.push(t.mem_bw_util_pct.unwrap_or(NEUTRAL_UTIL_PCT));
    row.push(known(t.gpu_mem_mib));
    row.push(t.gpu_mem_mib.unwrap_or(NEUTRAL_MEM_MIB).max(1.0).log2());

    // Sanitised again for every aggregate rather than collected: a handful of
    // arithmetic operations per co-runner is cheaper than an allocation.
    let co = || corunners.iter().map(CleanProfile::from_profile);
    let n = corunners.len() as f64;
    let sum = |f: &dyn Fn(&CleanProfile) -> f64| co().map(|c| f(&c)).sum::<f64>();
    let max = |f: &dyn Fn(&CleanProfile) -> f64| co().map(|c| f(&c)).fold(0.0_f64, f64::max);
    let fraction = |f: &dyn Fn(&CleanProfile) -> bool| {
        if corunners.is_empty() {
            1.0
        } else {
            co().filter(|c| f(c)).count() as f64 / n
        }
    };
    let sm = |c: &CleanProfile| c.sm_util_pct.unwrap_or(NEUTRAL_UTIL_PCT);
    let bw = |c: &CleanProfile| c.mem_bw_util_pct.unwrap_or(NEUTRAL_UTIL_PCT);
    let mem = |c: &CleanProfile| c.gpu_mem_mib.unwrap_or(NEUTRAL_MEM_MIB);

    row.push(n);
    row.push(sum(&|c| c.step_time_s));
    row.push(max(&|c| c.step_time_s));
    row.push((1.0 + sum(&|c| c.samples_per_s)).log2());
    row.push((1.0 + max(&|c| c.samples_per_s)).log2());
    row.push((1.0 + sum(&|c| c.batch_size)).log2());
    row.push((1.0 + max(&|c| c.batch_size)).log2());
    row.push(fraction(&|c| c.sm_util_pct.is_some()));
    row.push(sum(&sm));
    row.push(max(&sm));
    row.push(fraction(&|c| c.mem_bw_util_pct.is_some()));
    row.push(sum(&bw));
    row.push(max(&bw));
    row.push(fraction(&|c| c.gpu_mem_mib.is_some()));
    row.push((1.0 + sum(&mem)).log2());
    row.push((1.0 + max(&mem)).log2());

    // Under plain time slicing a task gets its step time's share of the device's
    // round of steps; the closer to 1, the less it waits for others.
    let co_time = sum(&|c| c.step_time_s);
    row.push(t.step_time_s / (t.step_time_s + co_time));
    row.push(t.sm_util_pct.unwrap_or(NEUTRAL_UTIL_PCT) + sum(&sm));
    row.push(t.mem_bw_util_pct.unwrap_or(NEUTRAL_UTIL_PCT) + sum(&bw));
    // Logs and log-ratios of the co-runners' totals against the task's own values:
    // under time slicing the slowdown grows with how much work the others put in
    // per step of the task, a ratio that means the same for a small model on a fast
    // card as for a large one on a slow card. A tree can split on a ratio directly
    // (it cannot form one from two columns), and the linear base (see
    // `crate::linear`) needs them in log form to be additive. Without co-runners
    // the sums are 0; EMPTY_SUM keeps the logs finite (that case never reaches the
    // model: alone, the slowdown is 1 by definition).
    let co_time = co_time.max(EMPTY_SUM);
    row.push(co_time.log2());
    row.push((co_time / t.step_time_s).log2());
    row.push(((sum(&|c| c.samples_per_s) + EMPTY_SUM) / t.samples_per_s).log2());
    row.push(((sum(&|c| c.batch_size) + EMPTY_SUM) / t.batch_size).log2());
    debug_assert_eq!(row.next, N_FEATURES, "FEATURE_NAMES and the row disagree");
}

/// Fills a fixed-width row left to right.
struct RowWriter<'a> {
    row: &'a mut [f64; N_FEATURES],
    next: usize,
}

impl RowWriter<'_> {
    fn push(&mut self, value: f64) {
        if let Some(slot) = self.row.get_mut(self.next) {
            *slot = value;
        }
        self.next += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn profile(model: &str, batch: u32, step: f64) -> TaskProfile {
        TaskProfile {
            model: model.into(),
            batch_size: batch,
            solo_step_time_s: step,
            ..Default::default()
        }
    }

    #[test]
    fn names_match_the_row() {
        let row = feature_row("v100", &profile("a", 32, 0.1), &[profile("b", 64, 0.2)]);
        assert_eq!(row.len(), N_FEATURES);
        assert_eq!(row[device_column("V100")], 1.0);
        assert_eq!(row.iter().take(8).sum::<f64>(), 1.0);
    }

    #[test]
    fn every_column_left_out_of_the_base_is_a_feature() {
        assert!(NOT_IN_BASE.iter().all(|n| column(n).is_some()));
        assert!(SPEED_DEPENDENT.iter().all(|n| column(n).is_some()));
        assert_eq!(base_columns(false).len(), N_FEATURES - NOT_IN_BASE.len());
        assert!(base_columns(true).len() < base_columns(false).len());
    }

    /// The same pair on a card twice as fast (every step time halved) has the same
    /// row once the speed-dependent columns are masked, and a different one before.
    #[test]
    fn a_masked_row_does_not_depend_on_the_gpus_speed() {
        let slow = feature_row("k80", &profile("a", 32, 0.3), &[profile("b", 8, 0.12)]);
        let fast = feature_row("k80", &profile("a", 32, 0.15), &[profile("b", 8, 0.06)]);
        assert_ne!(slow, fast);
        let (mut slow, mut fast) = (slow, fast);
        mask_speed_dependent(&mut slow);
        mask_speed_dependent(&mut fast);
        for (i, (a, b)) in slow.iter().zip(&fast).enumerate() {
            assert!((a - b).abs() < 1e-9, "{}: {a} vs {b}", FEATURE_NAMES[i]);
        }
    }

    #[test]
    fn unknown_utilisation_is_flagged_not_zero() {
        let row = feature_row("k80", &profile("a", 32, 0.1), &[]);
        let idx = |n: &str| FEATURE_NAMES.iter().position(|x| *x == n).expect("name");
        assert_eq!(row[idx("task.sm_util_known")], 0.0);
        assert_eq!(row[idx("task.sm_util_pct")], NEUTRAL_UTIL_PCT);
        let mut measured = profile("a", 32, 0.1);
        measured.sm_util_pct = Some(0.0);
        let row = feature_row("k80", &measured, &[]);
        assert_eq!(row[idx("task.sm_util_known")], 1.0);
        assert_eq!(row[idx("task.sm_util_pct")], 0.0);
    }

    #[test]
    fn the_name_is_not_a_feature() {
        let a = feature_row("k80", &profile("a", 32, 0.1), &[profile("b", 8, 0.3)]);
        let b = feature_row("k80", &profile("zzz", 32, 0.1), &[profile("q", 8, 0.3)]);
        assert_eq!(a, b);
    }

    fn any_profile() -> impl Strategy<Value = TaskProfile> {
        (
            any::<u32>(),
            prop_oneof![any::<f64>(), 1e-4..10.0f64],
            proptest::option::of(any::<f64>()),
            proptest::option::of(any::<f64>()),
            proptest::option::of(any::<u64>()),
        )
            .prop_map(|(b, s, sm, bw, mem)| TaskProfile {
                model: "m".into(),
                batch_size: b,
                solo_step_time_s: s,
                sm_util_pct: sm,
                mem_bw_util_pct: bw,
                gpu_mem_mib: mem,
            })
    }

    proptest! {
        #[test]
        fn features_are_finite_for_any_input(
            task in any_profile(),
            co in proptest::collection::vec(any_profile(), 0..6),
            kind in "[a-zA-Z0-9]{0,6}",
        ) {
            let row = feature_row(&kind, &task, &co);
            prop_assert_eq!(row.len(), N_FEATURES);
            prop_assert!(row.iter().all(|v| v.is_finite()), "{:?}", row);
        }
    }
}
