//! What the tuner learns about each task from its spec and reports: memory samples,
//! out-of-memory sizes and step times measured alone; and what follows from it: the
//! candidate batch sizes, the conservative memory bound per size, the solo step time at m0.
//!
//! Peak memory in a report is the process's peak *since start* (the agent keeps a maximum).
//! Memory grows with the batch size, so that peak is the memory of the largest batch size the
//! task has run so far: a sample is recorded at that size, never at the current one.

use std::collections::BTreeMap;

use iadeep_proto::{TaskReport, TaskSpec, TunerMemorySample, TunerSoloTime, TunerTaskKnowledge};

use crate::memory::{MemoryModel, MemoryModelParams, MemorySample};

/// At most this many candidate sizes per task: the lattice is a product over tasks.
pub const MAX_CANDIDATES: usize = 13;

/// Knowledge about one task (persisted as [`TunerTaskKnowledge`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskKnowledge {
    /// Peak MiB by batch size (the largest peak seen for that size).
    pub memory: BTreeMap<u32, f64>,
    /// Smallest batch size reported out of memory.
    pub smallest_oom: Option<u32>,
    /// Step time alone by batch size (latest measurement).
    pub solo: BTreeMap<u32, f64>,
    /// Largest batch size seen in a report (the one the peak-since-start belongs to).
    pub largest_run: u32,
}

impl TaskKnowledge {
    /// From the persisted form.
    pub fn from_proto(p: &TunerTaskKnowledge) -> TaskKnowledge {
        let mut k = TaskKnowledge::default();
        for m in &p.memory {
            if m.batch_size > 0 && m.peak_mib.is_finite() && m.peak_mib > 0.0 {
                k.memory.insert(m.batch_size, m.peak_mib);
                k.largest_run = k.largest_run.max(m.batch_size);
            }
        }
        k.smallest_oom = p.oom_batch_sizes.iter().copied().filter(|&b| b > 0).min();
        for s in &p.solo {
            if s.batch_size > 0 && s.step_time_s.is_finite() && s.step_time_s > 0.0 {
                k.solo.insert(s.batch_size, s.step_time_s);
            }
        }
        k
    }

    /// The persisted form.
    pub fn to_proto(&self, task_id: &str) -> TunerTaskKnowledge {
        TunerTaskKnowledge {
            task_id: task_id.to_owned(),
            memory: self
                .memory
                .iter()
                .map(|(&batch_size, &peak_mib)| TunerMemorySample {
                    batch_size,
                    peak_mib,
                })
                .collect(),
            oom_batch_sizes: self.smallest_oom.into_iter().collect(),
            solo: self
                .solo
                .iter()
                .map(|(&batch_size, &step_time_s)| TunerSoloTime {
                    batch_size,
                    step_time_s,
                })
                .collect(),
        }
    }

    /// Takes in the spec's solo profile (a measured step time and peak memory at its size).
    pub fn learn_spec(&mut self, spec: &TaskSpec) {
        let Some(p) = &spec.profile else { return };
        if p.batch_size == 0 {
            return;
        }
        if let Some(t) = p.step_time_s.filter(|t| t.is_finite() && *t > 0.0) {
            self.solo.entry(p.batch_size).or_insert(t);
        }
        if let Some(mib) = p.peak_mem_mib.filter(|&m| m > 0) {
            let e = self.memory.entry(p.batch_size).or_insert(0.0);
            *e = e.max(mib as f64);
        }
    }

    /// Takes in a report; `alone` = the task was the only resident when it was measured.
    /// Returns whether the report carried a new out-of-memory size.
    pub fn learn_report(&mut self, r: &TaskReport, alone: bool) -> bool {
        if r.batch_size > 0 {
            self.largest_run = self.largest_run.max(r.batch_size);
        }
        if let Some(mib) = r.peak_mem_mib.filter(|&m| m > 0)
            && self.largest_run > 0
        {
            let e = self.memory.entry(self.largest_run).or_insert(0.0);
            *e = e.max(mib as f64);
        }
        if alone && r.batch_size > 0 && r.step_time_s.is_finite() && r.step_time_s > 0.0 {
            self.solo.insert(r.batch_size, r.step_time_s);
        }
        match r.oom_batch_size.filter(|&b| b > 0) {
            Some(b) if self.smallest_oom.is_none_or(|o| b < o) => {
                self.smallest_oom = Some(b);
                true
            }
            _ => false,
        }
    }

    /// The memory model, if any sample exists.
    pub fn memory_model(&self, params: MemoryModelParams) -> Option<MemoryModel> {
        let samples: Vec<MemorySample> = self
            .memory
            .iter()
            .map(|(&batch_size, &peak_mib)| MemorySample {
                batch_size,
                peak_mib,
            })
            .collect();
        let oom: Vec<u32> = self.smallest_oom.into_iter().collect();
        match MemoryModel::fit_with(&samples, &oom, params) {
            Ok(m) => Some(m),
            Err(err) => {
                if !samples.is_empty() {
                    tracing::warn!(%err, "memory model fit failed; treating memory as unknown");
                }
                None
            }
        }
    }

    /// Conservative MiB at each candidate size; `None` = infeasible.
    ///
    /// Without any memory sample the only sizes allowed are those ≤ m0, bounded by what the
    /// placer reserved for the task at m0 (`reserved_mib`): the placement was made for m0, and
    /// growing past it without a measurement could take the card down with every task on it.
    pub fn upper_bounds(
        &self,
        sizes: &[u32],
        m0: u32,
        reserved_mib: f64,
        params: MemoryModelParams,
    ) -> Vec<Option<f64>> {
        match self.memory_model(params) {
            Some(model) => {
                let model = match self.smallest_oom {
                    Some(b) => model.with_oom(b),
                    None => model,
                };
                sizes.iter().map(|&b| model.upper_bound_mib(b)).collect()
            }
            None => sizes
                .iter()
                .map(|&b| {
                    (b <= m0 && self.smallest_oom.is_none_or(|o| b < o)).then_some(reserved_mib)
                })
                .collect(),
        }
    }

    /// Step time alone at `batch_size`, if it was measured (profile or a report made alone).
    pub fn solo_at(&self, batch_size: u32) -> Option<f64> {
        self.solo.get(&batch_size).copied()
    }
}

/// Candidate batch sizes of a task: a geometric grid with ratio √2 through m0, within
/// [min, max], plus the bounds themselves, thinned to at most [`MAX_CANDIDATES`] around m0.
///
/// √2 steps: step time and memory are smooth in log batch size, so finer steps buy little,
/// and every extra size multiplies the joint lattice. Unset bounds (0) pin the task at m0:
/// a task that did not say how far it may move is not moved.
pub fn candidate_sizes(spec: &TaskSpec) -> Vec<u32> {
    let m0 = spec.initial_batch_size.max(1);
    let min = if spec.min_batch_size == 0 {
        m0
    } else {
        spec.min_batch_size.min(m0)
    };
    let max = if spec.max_batch_size == 0 {
        m0
    } else {
        spec.max_batch_size.max(m0)
    };
    let mut sizes = vec![min, m0, max];
    let step = std::f64::consts::SQRT_2;
    let mut b = f64::from(m0);
    loop {
        b *= step;
        let r = b.round();
        if r > f64::from(max) {
            break;
        }
        sizes.push(r as u32);
    }
    let mut b = f64::from(m0);
    loop {
        b /= step;
        let r = b.round();
        if r < f64::from(min) || r < 1.0 {
            break;
        }
        sizes.push(r as u32);
    }
    sizes.sort_unstable();
    sizes.dedup();
    while sizes.len() > MAX_CANDIDATES {
        // Drop the size farthest from m0 (in log space), keeping m0 itself.
        let far = sizes
            .iter()
            .enumerate()
            .max_by(|(_, a), (_, b)| {
                let d = |x: u32| (f64::from(x) / f64::from(m0)).log2().abs();
                d(**a).total_cmp(&d(**b))
            })
            .map(|(i, _)| i);
        match far {
            Some(i) => {
                sizes.remove(i);
            }
            None => break,
        }
    }
    sizes
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec(m0: u32, min: u32, max: u32) -> TaskSpec {
        TaskSpec {
            initial_batch_size: m0,
            min_batch_size: min,
            max_batch_size: max,
            ..Default::default()
        }
    }

    #[test]
    fn grid_goes_through_m0_and_the_bounds() {
        assert_eq!(
            candidate_sizes(&spec(16, 8, 64)),
            vec![8, 11, 16, 23, 32, 45, 64]
        );
        assert_eq!(candidate_sizes(&spec(32, 0, 0)), vec![32]);
    }

    proptest! {
        #[test]
        fn candidates_are_ascending_bounded_and_contain_m0(m0 in 1u32..4096, lo in 1u32..64, hi in 1u32..8192) {
            let s = candidate_sizes(&spec(m0, lo, hi));
            prop_assert!(s.contains(&m0));
            prop_assert!(s.len() <= MAX_CANDIDATES);
            prop_assert!(s.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(s[0] >= lo.min(m0) && *s.last().expect("non-empty") <= hi.max(m0));
        }
    }

    #[test]
    fn peak_since_start_is_attributed_to_the_largest_size_run() {
        let mut k = TaskKnowledge::default();
        let r = |b: u32, mib: u64| TaskReport {
            batch_size: b,
            step_time_s: 0.01,
            peak_mem_mib: Some(mib),
            ..Default::default()
        };
        k.learn_report(&r(64, 3000), false);
        k.learn_report(&r(16, 3000), true);
        assert_eq!(k.memory.get(&64), Some(&3000.0));
        assert_eq!(k.memory.get(&16), None);
        assert_eq!(k.solo_at(16), Some(0.01));
        assert_eq!(k.solo_at(64), None, "measured co-located");
    }

    #[test]
    fn without_memory_samples_only_sizes_up_to_m0_are_allowed() {
        let k = TaskKnowledge::default();
        let b = k.upper_bounds(&[8, 16, 32], 16, 500.0, MemoryModelParams::default());
        assert_eq!(b, vec![Some(500.0), Some(500.0), None]);
    }

    #[test]
    fn an_oom_makes_that_size_and_larger_infeasible() {
        let mut k = TaskKnowledge::default();
        k.memory.insert(16, 1000.0);
        k.memory.insert(32, 1500.0);
        let oom = TaskReport {
            oom_batch_size: Some(64),
            ..Default::default()
        };
        assert!(k.learn_report(&oom, false));
        let b = k.upper_bounds(&[32, 45, 64, 90], 16, 0.0, MemoryModelParams::default());
        assert!(b[0].is_some_and(|m| m >= 1500.0));
        assert!(b[1].is_some());
        assert_eq!(&b[2..], &[None, None]);
        let back = TaskKnowledge::from_proto(&k.to_proto("t"));
        assert_eq!(back.memory, k.memory);
        assert_eq!(back.smallest_oom, Some(64));
    }
}
