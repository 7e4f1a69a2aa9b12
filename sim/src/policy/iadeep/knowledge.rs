//! What iadeep has learned about each task from its agent's reports: peak memory at
//! each batch size it ran, batch sizes that ran out of memory, and step times when it
//! ran alone. Only reports go in; nothing comes from the simulator's ground truth.

use std::collections::{BTreeMap, HashMap};

use iadeep_proto::TaskProfile;
use iadeep_tuner::memory::{MemoryModel, MemoryModelParams, MemorySample};

use crate::view::{Resident, TaskSpec};

/// Reports of one task, aggregated.
#[derive(Debug, Default, Clone)]
pub struct TaskKnowledge {
    /// Largest peak MiB reported at each batch size.
    pub peak_mib: BTreeMap<u32, f64>,
    /// Batch sizes that ran out of memory.
    pub ooms: Vec<u32>,
    /// Step time alone at each batch size (profile at m0, then measured when alone).
    pub solo_step_s: BTreeMap<u32, f64>,
}

/// Knowledge of every task seen.
#[derive(Debug, Default)]
pub struct Knowledge {
    tasks: HashMap<usize, TaskKnowledge>,
}

impl Knowledge {
    /// Seeds a task from its submitted profile (step time and peak memory alone at m0).
    pub fn submit(&mut self, spec: &TaskSpec) {
        self.tasks.entry(spec.id).or_insert_with(|| {
            let mut k = TaskKnowledge::default();
            k.peak_mib.insert(spec.m0, spec.solo_peak_mem_mib as f64);
            k.solo_step_s.insert(spec.m0, spec.solo_step_time_s);
            k
        });
    }

    /// Takes in the current reports of one device's residents.
    pub fn ingest(&mut self, residents: &[Resident<'_>]) {
        let alone = residents.len() == 1;
        for r in residents {
            self.submit(r.spec);
            let Some(k) = self.tasks.get_mut(&r.spec.id) else {
                continue;
            };
            if let Some(oom) = r.report.oom_batch_size
                && !k.ooms.contains(&oom)
            {
                k.ooms.push(oom);
            }
            if !r.report.running {
                continue;
            }
            let peak = k.peak_mib.entry(r.report.batch_size).or_insert(0.0);
            *peak = peak.max(r.report.peak_mem_mib as f64);
            if alone {
                k.solo_step_s
                    .insert(r.report.batch_size, r.report.step_time_s);
            }
        }
    }

    /// Records an out-of-memory crash.
    pub fn oom(&mut self, task: usize, batch_size: u32) {
        let k = self.tasks.entry(task).or_default();
        if !k.ooms.contains(&batch_size) {
            k.ooms.push(batch_size);
        }
    }

    /// Forgets a finished task.
    pub fn forget(&mut self, task: usize) {
        self.tasks.remove(&task);
    }

    /// A task's knowledge, if any.
    pub fn get(&self, task: usize) -> Option<&TaskKnowledge> {
        self.tasks.get(&task)
    }

    /// Conservative peak MiB of `task` at `batch_size` from the tuner's memory model,
    /// `None` when infeasible or unknown.
    ///
    /// Below the smallest observed batch size the bound is the model's bound at that
    /// size: memory does not grow when the batch shrinks, and a fit through one
    /// sample (zero intercept) would otherwise under-estimate there.
    pub fn memory_upper_mib(&self, task: usize, batch_size: u32) -> Option<f64> {
        let k = self.tasks.get(&task)?;
        let samples: Vec<MemorySample> = k
            .peak_mib
            .iter()
            .map(|(b, m)| MemorySample {
                batch_size: *b,
                peak_mib: *m,
            })
            .collect();
        let smallest = *k.peak_mib.keys().next()?;
        let model = MemoryModel::fit_with(&samples, &k.ooms, MemoryModelParams::default()).ok()?;
        if k.ooms.iter().any(|oom| batch_size >= *oom) {
            return None;
        }
        model.upper_bound_mib(batch_size.max(smallest))
    }

    /// The predictor's view of a task at a batch size: its solo step time there as
    /// [`Knowledge::solo_step_estimate`] gives it (measured, interpolated, or the
    /// profile at m0 scaled by the batch size), and the peak memory reported at that
    /// size (else the profile's at m0).
    pub fn profile(&self, spec: &TaskSpec, batch_size: u32) -> TaskProfile {
        let k = self.tasks.get(&spec.id);
        let step = self.solo_step_estimate(spec.id, batch_size).map_or(
            spec.solo_step_time_s * f64::from(batch_size) / f64::from(spec.m0.max(1)),
            |e| e.step_s,
        );
        let mem = k
            .and_then(|k| k.peak_mib.get(&batch_size))
            .copied()
            .unwrap_or(spec.solo_peak_mem_mib as f64);
        TaskProfile {
            model: spec.model.clone(),
            batch_size,
            solo_step_time_s: step,
            sm_util_pct: None,
            mem_bw_util_pct: None,
            gpu_mem_mib: Some(mem.round() as u64),
        }
    }

    /// Solo step time of a task at a batch size, estimated from the step times its
    /// agent reported while it ran alone (and its profile at m0): see
    /// [`estimate_solo_step`]. `None` for a task never seen.
    pub fn solo_step_estimate(&self, task: usize, batch_size: u32) -> Option<SoloEstimate> {
        estimate_solo_step(&self.tasks.get(&task)?.solo_step_s, batch_size)
    }
}

/// How a solo step time was obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SoloSource {
    /// Reported by the agent while the task ran alone at exactly this batch size.
    Measured,
    /// Log-log interpolation between the two nearest measured batch sizes.
    Interpolated,
    /// Log-log extrapolation along the slope of the nearest two measured sizes.
    Extrapolated,
    /// Only one batch size measured: step time proportional to the batch size
    /// (constant samples per second), the placer's own assumption (`profile_of`).
    Proportional,
}

/// A solo step-time estimate and where it came from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SoloEstimate {
    pub step_s: f64,
    pub source: SoloSource,
}

/// Estimates the step time alone at `batch_size` from step times measured alone at
/// other batch sizes, in log-log space, where a GPU's step time is close to a straight
/// line over the batch sizes a job runs at (fixed cost plus per-sample cost, with the
/// per-sample part dominating as the batch grows).
///
/// Why: a co-location sample needs the task's solo step time at the batch size it ran
/// at, and after tuning that size was rarely measured alone; without an estimate the
/// predictor saw about 26 samples in a 300-task run. The estimate only uses what the
/// agents reported, never the simulator's ground truth.
///
/// The slope used to interpolate or extrapolate is clamped to `[0, 1]`: a larger batch
/// never makes a step faster, and never makes the samples per second drop, so a
/// noisy pair of measurements cannot produce an absurd extrapolation.
pub fn estimate_solo_step(measured: &BTreeMap<u32, f64>, batch_size: u32) -> Option<SoloEstimate> {
    let valid = |(b, t): (&u32, &f64)| (*b > 0 && t.is_finite() && *t > 0.0).then_some((*b, *t));
    if let Some(step) = measured
        .get(&batch_size)
        .filter(|t| t.is_finite() && **t > 0.0)
    {
        return Some(SoloEstimate {
            step_s: *step,
            source: SoloSource::Measured,
        });
    }
    if batch_size == 0 {
        return None;
    }
    let below: Vec<(u32, f64)> = measured
        .range(..batch_size)
        .rev()
        .filter_map(valid)
        .take(2)
        .collect();
    let above: Vec<(u32, f64)> = measured
        .range(batch_size..)
        .filter_map(valid)
        .take(2)
        .collect();
    let (a, b, source) = match (below.first(), above.first()) {
        (Some(lo), Some(hi)) => (*lo, *hi, SoloSource::Interpolated),
        (Some(lo), None) => match below.get(1) {
            Some(lo2) => (*lo2, *lo, SoloSource::Extrapolated),
            None => (*lo, *lo, SoloSource::Proportional),
        },
        (None, Some(hi)) => match above.get(1) {
            Some(hi2) => (*hi, *hi2, SoloSource::Extrapolated),
            None => (*hi, *hi, SoloSource::Proportional),
        },
        (None, None) => return None,
    };
    let slope = if source == SoloSource::Proportional {
        1.0
    } else {
        ((b.1.ln() - a.1.ln()) / (f64::from(b.0).ln() - f64::from(a.0).ln())).clamp(0.0, 1.0)
    };
    // Anchored at the nearest measurement, so a clamped slope stays continuous there.
    let anchor = if batch_size > b.0 { b } else { a };
    let step_s = anchor.1 * (f64::from(batch_size) / f64::from(anchor.0)).powf(slope);
    step_s
        .is_finite()
        .then_some(SoloEstimate { step_s, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn points(p: &[(u32, f64)]) -> BTreeMap<u32, f64> {
        p.iter().copied().collect()
    }

    #[test]
    fn a_measured_size_is_returned_as_measured() {
        let e = estimate_solo_step(&points(&[(32, 0.2), (64, 0.3)]), 64).expect("estimate");
        assert_eq!(e.source, SoloSource::Measured);
        assert_eq!(e.step_s, 0.3);
    }

    #[test]
    fn interpolation_is_a_straight_line_in_log_log() {
        // t = 0.01 · b^0.5 at 16 and 64; at 32 the line gives 0.01 · 32^0.5.
        let m = points(&[(16, 0.04), (64, 0.08)]);
        let e = estimate_solo_step(&m, 32).expect("estimate");
        assert_eq!(e.source, SoloSource::Interpolated);
        assert!((e.step_s - 0.01 * 32f64.sqrt()).abs() < 1e-12, "{e:?}");
    }

    #[test]
    fn extrapolation_follows_the_nearest_slope() {
        let m = points(&[(16, 0.04), (64, 0.08)]);
        let up = estimate_solo_step(&m, 256).expect("estimate");
        assert_eq!(up.source, SoloSource::Extrapolated);
        assert!((up.step_s - 0.16).abs() < 1e-12, "{up:?}");
        let down = estimate_solo_step(&m, 4).expect("estimate");
        assert!((down.step_s - 0.02).abs() < 1e-12, "{down:?}");
    }

    #[test]
    fn one_measurement_scales_with_the_batch_size() {
        let e = estimate_solo_step(&points(&[(32, 0.2)]), 64).expect("estimate");
        assert_eq!(e.source, SoloSource::Proportional);
        assert!((e.step_s - 0.4).abs() < 1e-12);
        assert!(estimate_solo_step(&BTreeMap::new(), 64).is_none());
    }

    #[test]
    fn noisy_slopes_are_clamped() {
        // Faster at the larger size (noise): treated as flat, not as getting faster.
        let m = points(&[(16, 0.05), (32, 0.04)]);
        let e = estimate_solo_step(&m, 128).expect("estimate");
        assert!((e.step_s - 0.04).abs() < 1e-12, "{e:?}");
    }

    proptest! {
        /// Between the nearest measured sizes the estimate lies between their step
        /// times, and it never decreases with the batch size.
        #[test]
        fn estimates_are_monotone_and_bracketed(
            times in proptest::collection::vec(0.01f64..1.0, 2..6),
            probe in 1u32..1024,
        ) {
            let mut m = BTreeMap::new();
            let mut t = 0.0;
            for (i, dt) in times.iter().enumerate() {
                t += dt;
                m.insert(8u32 << i, t);
            }
            let e = estimate_solo_step(&m, probe).expect("estimate");
            let next = estimate_solo_step(&m, probe + 1).expect("estimate");
            prop_assert!(e.step_s.is_finite() && e.step_s > 0.0);
            prop_assert!(next.step_s >= e.step_s * (1.0 - 1e-12));
            if let (Some((_, lo)), Some((_, hi))) = (m.range(..=probe).next_back(), m.range(probe..).next()) {
                prop_assert!(e.step_s >= lo * (1.0 - 1e-12) && e.step_s <= hi * (1.0 + 1e-12));
            }
        }
    }
}
