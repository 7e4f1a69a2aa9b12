//! What the tuner learns about each task from its spec and reports: memory samples,
//! out-of-memory sizes of the task alone and step times measured alone; and what follows
//! from it: the candidate batch sizes, the conservative memory bound per size, the solo step
//! time at a batch size (measured, or estimated from the sizes measured alone).
//!
//! Peak memory in a report belongs to the batch size the agent names with it
//! (`peak_mem_batch_size`: the agent restarts its peak when the batch size changes). An older
//! agent reports its peak since start instead; memory grows with the batch size, so that peak
//! is recorded at the largest batch size the task has run so far, never at the current one.
//!
//! A solo profile counts only when it was measured on this device's kind (or names none): a
//! step time measured on another GPU generation says nothing about this one.

use std::collections::BTreeMap;

use iadeep_proto::{TaskReport, TaskSpec, TunerMemorySample, TunerSoloTime, TunerTaskKnowledge};

use crate::memory::{MemoryModel, MemoryModelParams, MemorySample, one_step};

/// At most this many candidate sizes per task: the lattice is a product over tasks.
pub const MAX_CANDIDATES: usize = 13;

/// Knowledge about one task (persisted as [`TunerTaskKnowledge`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskKnowledge {
    /// Peak MiB by batch size (the largest peak seen for that size).
    pub memory: BTreeMap<u32, f64>,
    /// Smallest batch size that ran out of memory while the task ran *alone*: a limit of the
    /// task itself. An out-of-memory crash next to co-runners limits only the joint
    /// configuration, and the search keeps it as such; it also leaves a floor below.
    pub smallest_oom: Option<u32>,
    /// MiB the task needed more than at a batch size, by batch size: what its co-runners left
    /// it when it ran out of memory next to them (see [`MemoryModel::with_floor`]).
    pub oom_floors: BTreeMap<u32, f64>,
    /// Step time alone by batch size (latest measurement).
    pub solo: BTreeMap<u32, f64>,
    /// Step time alone by batch size *estimated* from a co-located round: the measured
    /// step time divided by [`TaskKnowledge::placed_slowdown`]. Used for Σ PD only while
    /// nothing was measured alone at m0, and never for co-location samples (a sample
    /// built on the predictor's own prediction would teach it what it already said).
    pub solo_estimated: BTreeMap<u32, f64>,
    /// The slowdown the placer predicted for the task in the co-location it placed it
    /// into (from its starting assignment).
    pub placed_slowdown: Option<f64>,
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
        for f in &p.oom_floors {
            k.learn_oom_floor(f.batch_size, f.peak_mib);
        }
        for s in &p.solo {
            k.learn_solo(s.batch_size, s.step_time_s);
        }
        for s in &p.solo_estimated {
            k.learn_solo_estimate(s.batch_size, s.step_time_s);
        }
        k.learn_placed_slowdown(p.placed_slowdown);
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
            oom_floors: self
                .oom_floors
                .iter()
                .map(|(&batch_size, &peak_mib)| TunerMemorySample {
                    batch_size,
                    peak_mib,
                })
                .collect(),
            solo: solo_times(&self.solo),
            solo_estimated: solo_times(&self.solo_estimated),
            placed_slowdown: self.placed_slowdown,
        }
    }

    /// Takes in the spec's solo profile (a measured step time and peak memory at its size),
    /// if it was measured on `device_kind` (see the module documentation). Returns whether
    /// it was used.
    pub fn learn_spec(&mut self, spec: &TaskSpec, device_kind: &str) -> bool {
        let Some(p) = &spec.profile else { return false };
        if p.batch_size == 0 || !profile_is_local(&p.device_kind, device_kind) {
            return false;
        }
        if let Some(t) = p.step_time_s.filter(|t| t.is_finite() && *t > 0.0) {
            self.solo.entry(p.batch_size).or_insert(t);
        }
        if let Some(mib) = p.peak_mem_mib.filter(|&m| m > 0) {
            let e = self.memory.entry(p.batch_size).or_insert(0.0);
            *e = e.max(mib as f64);
        }
        true
    }

    /// Takes in a report's peak memory (see the module documentation).
    pub fn learn_report(&mut self, r: &TaskReport) {
        if r.batch_size > 0 {
            self.largest_run = self.largest_run.max(r.batch_size);
        }
        let Some(mib) = r.peak_mem_mib.filter(|&m| m > 0) else {
            return;
        };
        let at = if r.peak_mem_batch_size > 0 {
            r.peak_mem_batch_size
        } else {
            self.largest_run
        };
        if at > 0 {
            let e = self.memory.entry(at).or_insert(0.0);
            *e = e.max(mib as f64);
        }
    }

    /// Records a step time measured while the task ran alone at `batch_size`.
    pub fn learn_solo(&mut self, batch_size: u32, step_time_s: f64) {
        if batch_size > 0 && step_time_s.is_finite() && step_time_s > 0.0 {
            self.solo.insert(batch_size, step_time_s);
        }
    }

    /// Records a step time alone at `batch_size` estimated from a co-located one (see
    /// [`TaskKnowledge::solo_estimated`]).
    pub fn learn_solo_estimate(&mut self, batch_size: u32, step_time_s: f64) {
        if batch_size > 0 && step_time_s.is_finite() && step_time_s > 0.0 {
            self.solo_estimated.insert(batch_size, step_time_s);
        }
    }

    /// Records the placer's predicted slowdown for the task where it was placed; a
    /// slowdown below 1 or not finite is not a slowdown and is ignored.
    pub fn learn_placed_slowdown(&mut self, slowdown: Option<f64>) {
        if let Some(s) = slowdown.filter(|s| s.is_finite() && *s >= 1.0) {
            self.placed_slowdown = Some(s);
        }
    }

    /// Records that the task ran out of memory at `batch_size` while it ran alone. Returns
    /// whether that lowered its limit.
    pub fn learn_oom_alone(&mut self, batch_size: u32) -> bool {
        match Some(batch_size).filter(|&b| b > 0) {
            Some(b) if self.smallest_oom.is_none_or(|o| b < o) => {
                self.smallest_oom = Some(b);
                true
            }
            _ => false,
        }
    }

    /// An out-of-memory report of the task alone at `batch_size`. Past its largest measured
    /// size the bound there was an extrapolation, and the agent fences its allocator at it:
    /// the failure may say only that the extrapolation was too tight, not that the card is
    /// too small. The first such failure lifts the bound at that size and above to the
    /// prior's ([`MemoryModel::prior_bound_mib`]), so the size may be tried again under a
    /// wider fence; a failure where the prior's bound held already (as it does at a size
    /// further than a step past the data, see [`TaskKnowledge::upper_bounds`]), or within
    /// the measured sizes, makes the size the task's limit ([`TaskKnowledge::smallest_oom`]).
    /// Returns whether that changed what is known.
    pub fn learn_oom_alone_past(&mut self, batch_size: u32, params: MemoryModelParams) -> bool {
        let lifted = self.memory_model(params).and_then(|model| {
            let past_data = batch_size > model.largest_observed();
            let prior = model.prior_bound_mib(batch_size)?;
            let tight = model.held_bound_mib(batch_size)?;
            (past_data && prior > tight).then_some(prior)
        });
        match lifted {
            Some(prior) => self.learn_oom_floor(batch_size, prior),
            None => self.learn_oom_alone(batch_size),
        }
    }

    /// Records that the task ran out of memory at `batch_size` next to co-runners that left
    /// it `left_mib`. Returns whether that raised what is known.
    pub fn learn_oom_floor(&mut self, batch_size: u32, left_mib: f64) -> bool {
        if batch_size == 0 || !left_mib.is_finite() || left_mib <= 0.0 {
            return false;
        }
        let known = self
            .oom_floors
            .range(..=batch_size)
            .map(|(_, &mib)| mib)
            .fold(0.0, f64::max);
        if left_mib <= known {
            return false;
        }
        self.oom_floors.insert(batch_size, left_mib);
        true
    }

    /// The memory model, if any sample exists, with the task's limit
    /// ([`TaskKnowledge::smallest_oom`]) and the floors its crashes left.
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
            Ok(m) => Some(
                self.oom_floors
                    .iter()
                    .fold(m, |m, (&batch_size, &mib)| m.with_floor(batch_size, mib)),
            ),
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
    /// Past the largest size with a memory sample only sizes within
    /// [`MemoryModelParams::max_step_past_measured`] of it are allowed, or the next
    /// candidate size when none lies that close: the task approaches unmeasured sizes in
    /// small steps, so no bound is extrapolated far before a report measures it. That next
    /// size, further out than a step, is bounded by the prior
    /// ([`MemoryModel::prior_bound_mib`]) rather than by the measured curvature: the
    /// curvature comes from sizes spaced like the data, and a bend in a stretch longer than
    /// a step past the data is one it could not have seen (a task measured at 16, 32 and 64
    /// on a straight stretch and grown to 128 across a knee, when its sizes double).
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
                let reach = next_size(
                    sizes,
                    model.largest_observed(),
                    params.max_step_past_measured,
                );
                sizes
                    .iter()
                    .map(|&b| (b <= reach).then(|| model.held_bound_mib(b)).flatten())
                    .collect()
            }
            None => sizes
                .iter()
                .map(|&b| {
                    (b <= m0 && self.smallest_oom.is_none_or(|o| b < o)).then_some(reserved_mib)
                })
                .collect(),
        }
    }

    /// The conservative MiB at `batch_size` (with the floors crashes left and any limit),
    /// without [`TaskKnowledge::upper_bounds`]' small steps past the largest measured size
    /// (but with its prior's bound further than a step past it); `None` without a model or
    /// where the model says nothing.
    pub fn bound_ignoring_reach(&self, batch_size: u32, params: MemoryModelParams) -> Option<f64> {
        let model = self.memory_model(params)?;
        model.held_bound_mib(batch_size)
    }

    /// Step time alone at `batch_size`, if it was measured (profile or a round run alone).
    pub fn solo_at(&self, batch_size: u32) -> Option<f64> {
        self.solo.get(&batch_size).copied()
    }

    /// The solo step time at m0 that Σ PD divides by: measured alone at m0 (profile or a
    /// round run alone), else estimated from a co-located round (see
    /// [`TaskKnowledge::solo_estimated`]), scaled to m0 when it was taken at another size.
    pub fn solo_for_pd(&self, m0: u32) -> Option<f64> {
        self.solo_at(m0)
            .or_else(|| estimate_solo_step(&self.solo_estimated, m0).map(|e| e.step_s))
    }

    /// Step time alone at `batch_size`, measured or estimated (see `estimate_solo_step`).
    pub fn solo_estimate(&self, batch_size: u32) -> Option<SoloEstimate> {
        estimate_solo_step(&self.solo, batch_size)
    }
}

/// The largest size a task whose memory was measured up to `largest` may take next: one
/// step past it, or the smallest of `sizes` above `largest` when that is further.
fn next_size(sizes: &[u32], largest: u32, step: f64) -> u32 {
    let within = one_step(largest, step);
    let next = sizes.iter().copied().filter(|&b| b > largest).min();
    next.map_or(within, |n| n.max(within))
}

/// Solo step times in their persisted form.
fn solo_times(times: &BTreeMap<u32, f64>) -> Vec<TunerSoloTime> {
    times
        .iter()
        .map(|(&batch_size, &step_time_s)| TunerSoloTime {
            batch_size,
            step_time_s,
        })
        .collect()
}

/// Whether a profile measured on `profile_kind` describes a device of `device_kind`: the
/// same kind (case-insensitive), or a profile that names none.
pub fn profile_is_local(profile_kind: &str, device_kind: &str) -> bool {
    profile_kind.is_empty() || profile_kind.eq_ignore_ascii_case(device_kind)
}

/// Candidate batch sizes of a task: the sizes it allows (`allowed_batch_sizes`) within
/// [min, max], or else a geometric grid with ratio √2 through m0 within [min, max], plus the
/// bounds themselves; m0 always; thinned to at most `MAX_CANDIDATES` (13) around m0.
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
    let mut sizes = if spec.allowed_batch_sizes.is_empty() {
        geometric_grid(m0, min, max)
    } else {
        let mut allowed: Vec<u32> = spec
            .allowed_batch_sizes
            .iter()
            .copied()
            .filter(|b| (min..=max).contains(b))
            .collect();
        allowed.push(m0);
        allowed
    };
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

/// The bounds, m0, and every √2 step from m0 within them.
fn geometric_grid(m0: u32, min: u32, max: u32) -> Vec<u32> {
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
    sizes
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
    /// (constant samples per second), the placer's own assumption (the placer's `profile_of`).
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

    #[test]
    fn allowed_sizes_replace_the_grid_within_the_bounds() {
        let mut s = spec(32, 16, 128);
        s.allowed_batch_sizes = vec![8, 16, 64, 128, 256];
        assert_eq!(candidate_sizes(&s), vec![16, 32, 64, 128]);
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
        k.learn_report(&r(64, 3000));
        k.learn_report(&r(16, 3000));
        assert_eq!(k.memory.get(&64), Some(&3000.0));
        assert_eq!(k.memory.get(&16), None);
    }

    /// A task that only shrinks still teaches its memory at the smaller
    /// size, so the fixed part (weights, optimiser state) is learned.
    #[test]
    fn a_peak_per_generation_belongs_to_its_own_batch_size() {
        let mut k = TaskKnowledge::default();
        let r = |b: u32, mib: u64| TaskReport {
            batch_size: b,
            peak_mem_mib: Some(mib),
            peak_mem_batch_size: b,
            ..Default::default()
        };
        k.learn_report(&r(64, 6000));
        k.learn_report(&r(32, 4500));
        assert_eq!(k.memory.get(&64), Some(&6000.0));
        assert_eq!(k.memory.get(&32), Some(&4500.0));
        let bounds = k.upper_bounds(&[16, 32, 64], 64, 0.0, MemoryModelParams::default());
        // 1500 MiB per 32 samples on top of 3000 fixed: at 16 no less than at 32.
        assert!(bounds[0].is_some_and(|m| m >= 4500.0), "{bounds:?}");
    }

    #[test]
    fn a_profile_from_another_device_kind_is_not_local() {
        let spec = |kind: &str| TaskSpec {
            initial_batch_size: 32,
            profile: Some(iadeep_proto::SoloProfile {
                batch_size: 32,
                step_time_s: Some(0.1),
                peak_mem_mib: Some(2000),
                device_kind: kind.to_owned(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut k = TaskKnowledge::default();
        assert!(!k.learn_spec(&spec("k80"), "h100"));
        assert_eq!(k, TaskKnowledge::default());
        assert!(k.learn_spec(&spec("H100"), "h100"));
        assert_eq!(k.solo_at(32), Some(0.1));
        let mut unnamed = TaskKnowledge::default();
        assert!(unnamed.learn_spec(&spec(""), "h100"));
    }

    #[test]
    fn without_memory_samples_only_sizes_up_to_m0_are_allowed() {
        let k = TaskKnowledge::default();
        let b = k.upper_bounds(&[8, 16, 32], 16, 500.0, MemoryModelParams::default());
        assert_eq!(b, vec![Some(500.0), Some(500.0), None]);
    }

    #[test]
    fn an_oom_alone_makes_that_size_and_larger_infeasible() {
        let mut k = TaskKnowledge::default();
        k.memory.insert(16, 1000.0);
        k.memory.insert(32, 1500.0);
        assert!(k.learn_oom_alone(64));
        assert!(!k.learn_oom_alone(128), "a larger size says nothing new");
        let b = k.upper_bounds(&[32, 45, 64, 90], 16, 0.0, MemoryModelParams::default());
        assert!(b[0].is_some_and(|m| m >= 1500.0));
        assert!(b[1].is_some());
        assert_eq!(&b[2..], &[None, None]);
        let back = TaskKnowledge::from_proto(&k.to_proto("t"));
        assert_eq!(back.memory, k.memory);
        assert_eq!(back.smallest_oom, Some(64));
    }

    /// A task measured at 32 and 64 may grow to 90 (within 1.5×) but not to 128 on a √2
    /// grid; where its sizes double, 128 is its next size and is allowed, 256 is not.
    #[test]
    fn unmeasured_sizes_are_approached_in_small_steps() {
        let mut k = TaskKnowledge::default();
        k.memory.insert(32, 1320.0);
        k.memory.insert(64, 1640.0);
        let p = MemoryModelParams::default();
        let fine = k.upper_bounds(&[32, 45, 64, 90, 128, 181], 32, 0.0, p);
        assert!(fine[..4].iter().all(Option::is_some), "{fine:?}");
        assert_eq!(&fine[4..], &[None, None]);
        let coarse = k.upper_bounds(&[32, 64, 128, 256], 32, 0.0, p);
        assert!(coarse[2].is_some(), "{coarse:?}");
        assert_eq!(coarse[3], None);
        let far = MemoryModelParams {
            max_step_past_measured: 8.0,
            ..p
        };
        assert!(k.upper_bounds(&[256], 32, 0.0, far)[0].is_some());
    }

    /// Memory measured on a straight stretch (16, 32, 64: ResNet-50 in the simulator's
    /// K80 world) shows no curvature, and the curvature's bound at 128 is below what the
    /// task needs there, past its knee: the whole K80 card, 11,441 MiB. Where the task's
    /// sizes double, 128 is a jump longer than a step and gets the prior's bound, which
    /// covers it; on a √2 grid the next size, 90, keeps the curvature's tighter bound.
    #[test]
    fn a_jump_past_a_step_is_bounded_by_the_prior() {
        let p = MemoryModelParams::default();
        let k = TaskKnowledge {
            memory: points(&[(16, 420.0), (32, 1600.0), (64, 3900.0)]),
            ..TaskKnowledge::default()
        };
        let model = k.memory_model(p).expect("model");
        let curvature = model.upper_bound_mib(128).expect("feasible");
        assert!(curvature < 11_441.0, "{curvature}");
        let coarse = k.upper_bounds(&[64, 128], 16, 0.0, p);
        assert_eq!(coarse[1], model.prior_bound_mib(128));
        assert!(coarse[1].is_some_and(|b| b >= 11_441.0), "{coarse:?}");
        // So is the bound a production job may go back up to m0 under.
        assert_eq!(k.bound_ignoring_reach(128, p), coarse[1]);
        let fine = k.upper_bounds(&[64, 90], 16, 0.0, p);
        assert_eq!(fine[1], model.upper_bound_mib(90));
    }

    /// Alone past its measured sizes (within a step), the first failure under the
    /// curvature's bound lifts the bound to the prior's; a second makes the size the
    /// task's limit, as does a first one at a size jumped to under the prior's bound.
    #[test]
    fn an_oom_alone_past_the_data_first_widens_the_bound() {
        let p = MemoryModelParams::default();
        let measured_below = points(&[(16, 1160.0), (32, 1320.0), (64, 1640.0)]);
        let mut k = TaskKnowledge {
            memory: measured_below.clone(),
            ..TaskKnowledge::default()
        };
        let tight = k.upper_bounds(&[90], 32, 0.0, p)[0].expect("feasible");
        assert!(k.learn_oom_alone_past(90, p));
        assert_eq!(k.smallest_oom, None);
        let wider = k.upper_bounds(&[90], 32, 0.0, p)[0].expect("still feasible");
        assert!(wider > tight, "{wider} ≤ {tight}");
        assert!(k.learn_oom_alone_past(90, p));
        assert_eq!(k.smallest_oom, Some(90));
        // Where the sizes double, 128 was reached in one jump under the prior's bound
        // already: a failure there is the task's limit at once.
        let mut jumped = TaskKnowledge {
            memory: measured_below,
            ..TaskKnowledge::default()
        };
        assert!(jumped.learn_oom_alone_past(128, p));
        assert_eq!(jumped.smallest_oom, Some(128));
        // Within the measured sizes an out-of-memory report is the task's limit at once.
        let mut measured = TaskKnowledge::default();
        measured.memory.insert(32, 1320.0);
        measured.memory.insert(64, 1640.0);
        assert!(measured.learn_oom_alone_past(64, p));
        assert_eq!(measured.smallest_oom, Some(64));
    }

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
