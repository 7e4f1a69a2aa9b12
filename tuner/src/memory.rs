//! Conservative, monotone memory model of one task: batch size → peak GPU memory (MiB).
//!
//! Peak training memory is, to first order, a constant (weights, gradients, optimiser state,
//! CUDA context, workspaces) plus activations proportional to the batch size. The model is
//! therefore an affine least-squares fit with a non-negative slope (so it is monotone), shifted
//! up to an *upper envelope* so it never predicts less than any sample it was fit on, plus a
//! residual-based band, plus an optional margin that grows with every doubling past the largest
//! observed batch size (none by default). Extrapolating further than `max_extrapolation` × the
//! largest observed size is refused. An out-of-memory report is a hard sample: that size and
//! every larger one are infeasible. A cubic fit is deliberately not used: it extrapolates
//! wildly.
//!
//! Past the largest observed size the bound grows faster than the data's top secant (the
//! slope through the two largest observed sizes) by as much as the task's own data bends:
//! on real GPUs memory is often convex in the batch size (cuDNN picks workspace-hungry
//! algorithms at large batches, the allocator rounds up to larger segments), so a line
//! fitted below a bend underestimates above it. With three or more observed sizes the
//! growth of the secant's slope per doubling of the batch (the *curvature*, at least 1) is
//! measured on the top three and carried forward to the extrapolated step, times a modest
//! `curvature_safety`; with fewer sizes nothing shows the bend and the slope is multiplied
//! by the prior `extrapolation_slope_factor` (with one observed size, the slope of the line
//! through the origin). Why not a fixed factor for every task: a factor large enough for
//! the sharpest bend the tuner might meet over-estimates every curve that does not bend, by
//! a median 63 % one doubling past the data on measured GPUs, and every over-estimate is a
//! co-runner that does not fit. An under-estimate is no longer fatal to co-runners: the agent
//! fences its allocator at the bound, so it costs the task one caught out-of-memory, and the
//! tuner approaches unmeasured sizes in small steps
//! ([`MemoryModelParams::max_step_past_measured`]) so no bound extrapolates far; where a
//! task's sizes are coarser, the next one is a longer jump and gets the prior's growth
//! ([`MemoryModel::prior_bound_mib`]), which no curvature measured below it can lower.
//! Inside the observed range a convex curve lies below its chords, so the envelope of a line
//! is safe there.
//!
//! An out-of-memory crash next to co-runners does not make a size infeasible for the task,
//! but it says the task needed more than the memory the others left it: a *floor* on its peak
//! at that size and, memory being monotone, at every larger size ([`MemoryModel::with_floor`]).
//!
//! Below the smallest observed batch size the bound stays at its value there: weights,
//! gradients, optimiser state and the CUDA context do not shrink with the batch, so a line
//! through one sample (or a steep fitted slope) would promise memory that a smaller batch
//! does not give back. Shrinking a task below what was measured therefore never makes room
//! on paper that it may not make on the card.

use nalgebra::{DMatrix, DVector};

use crate::error::{Result, TunerError};

/// One observation: the peak memory of a task at one batch size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemorySample {
    pub batch_size: u32,
    pub peak_mib: f64,
}

/// How conservative the model is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MemoryModelParams {
    /// Multiples of the residual standard deviation added on top of the envelope.
    pub residual_sigmas: f64,
    /// Relative padding per doubling past the largest observed batch size.
    pub margin_per_doubling: f64,
    /// Refuse predictions beyond this factor × the largest observed batch size.
    pub max_extrapolation: f64,
    /// With fewer than three observed sizes (no curvature to measure), past the largest the
    /// bound grows this many times as fast as the top secant (see the module documentation).
    pub extrapolation_slope_factor: f64,
    /// With three or more observed sizes, past the largest the bound grows this many times
    /// as fast as the task's own curvature extrapolates the top secant.
    pub curvature_safety: f64,
    /// The most a measured curvature may multiply the slope per doubling of the batch size:
    /// small batches often sit on a flat allocator plateau, where a secant of almost zero
    /// would make any later slope look like an explosion.
    pub max_curvature: f64,
    /// How far past a task's largest measured size the tuner lets it grow in one step
    /// (`TaskKnowledge::upper_bounds` refuses bounds further out, except for the next
    /// candidate size when the task's sizes are coarser, which it bounds with the prior's
    /// growth): a bound is never trusted far past the data before a report at the larger
    /// size replaces it with a measurement.
    pub max_step_past_measured: f64,
}

impl Default for MemoryModelParams {
    /// 2σ of the residuals; no relative padding (the fixed part, weights and optimiser
    /// state, does not grow with the batch, so padding it per doubling only over-estimates);
    /// with curvature measured, 1.25 × what it predicts, else the prior twice the top secant;
    /// a curvature of at most 2 per doubling; no prediction past 8× the largest observed size;
    /// and steps of at most 1.5× past what was measured (a longer jump to a task's next
    /// allowed size is bounded with the prior's growth). The safety factor was chosen on the
    /// derived transformer set; the figures on measured data and in the simulator were
    /// taken after (docs/tuner-experiments.md, "Memory bound").
    fn default() -> Self {
        MemoryModelParams {
            residual_sigmas: 2.0,
            margin_per_doubling: 0.0,
            max_extrapolation: 8.0,
            extrapolation_slope_factor: 2.0,
            curvature_safety: 1.25,
            max_curvature: 2.0,
            max_step_past_measured: 1.5,
        }
    }
}

impl MemoryModelParams {
    /// Validates the parameters.
    pub fn check(&self) -> Result<()> {
        let at_least = |x: f64, lo: f64| x.is_finite() && x >= lo;
        let ok = at_least(self.residual_sigmas, 0.0)
            && at_least(self.margin_per_doubling, 0.0)
            && at_least(self.max_extrapolation, 1.0)
            && at_least(self.extrapolation_slope_factor, 1.0)
            && at_least(self.curvature_safety, 1.0)
            && at_least(self.max_curvature, 1.0)
            && at_least(self.max_step_past_measured, 1.0);
        if ok {
            Ok(())
        } else {
            Err(TunerError::InvalidParams(format!(
                "memory model parameters out of range: {self:?} (sigmas ≥ 0, margin ≥ 0, \
                 every factor and max_extrapolation ≥ 1)"
            )))
        }
    }
}

/// A fitted memory model (see the module documentation).
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryModel {
    params: MemoryModelParams,
    intercept: f64,
    slope: f64,
    band: f64,
    smallest_observed: u32,
    largest_observed: u32,
    /// Slope of the secant through the two largest observed sizes (with one observed size,
    /// of the line through the origin), at least the fitted slope.
    top_slope: f64,
    /// With three or more observed sizes, how the data bends at its top.
    curvature: Option<Curvature>,
    smallest_oom: Option<u32>,
    /// `(batch size, MiB)`: the task needed more than MiB at that size (see
    /// [`MemoryModel::with_floor`]).
    floors: Vec<(u32, f64)>,
}

/// The largest size one step of `step` (a factor) past `largest` reaches.
pub(crate) fn one_step(largest: u32, step: f64) -> u32 {
    (f64::from(largest) * step).floor().min(f64::from(u32::MAX)) as u32
}

/// Least-squares affine fit through nalgebra's SVD; returns (intercept, slope).
fn affine_least_squares(xs: &[f64], ys: &[f64]) -> Result<(f64, f64)> {
    let design = DMatrix::from_fn(xs.len(), 2, |i, j| if j == 0 { 1.0 } else { xs[i] });
    let target = DVector::from_column_slice(ys);
    let coef = design
        .svd(true, true)
        .solve(&target, 1e-12)
        .map_err(|e| TunerError::Numerical(format!("memory least squares failed: {e}")))?;
    Ok((coef[0], coef[1]))
}

/// Rejects an empty sample set and any sample that is not a positive batch size with a
/// positive, finite peak.
fn check_samples(samples: &[MemorySample]) -> Result<()> {
    if samples.is_empty() {
        return Err(TunerError::InvalidInput(
            "a memory model needs at least one (batch size, peak MiB) sample".to_owned(),
        ));
    }
    for s in samples {
        if s.batch_size == 0 || !s.peak_mib.is_finite() || s.peak_mib <= 0.0 {
            return Err(TunerError::InvalidInput(format!(
                "bad memory sample: batch size {} with {} MiB",
                s.batch_size, s.peak_mib
            )));
        }
    }
    Ok(())
}

/// The (intercept, slope) of the best non-decreasing affine fit of peak MiB `ys` on batch
/// size `xs`.
fn monotone_affine(samples: &[MemorySample], xs: &[f64], ys: &[f64]) -> Result<(f64, f64)> {
    let distinct = {
        let mut b: Vec<u32> = samples.iter().map(|s| s.batch_size).collect();
        b.sort_unstable();
        b.dedup();
        b.len()
    };
    Ok(if distinct < 2 {
        // One batch size says nothing about the slope: assume all memory scales with the
        // batch (zero intercept), the most pessimistic affine model through the sample.
        let peak = ys.iter().copied().fold(0.0, f64::max);
        (0.0, peak / xs[0])
    } else {
        let (a, b) = affine_least_squares(xs, ys)?;
        if b >= 0.0 {
            (a, b)
        } else {
            // Decreasing data (noise around a flat profile): the best monotone affine fit
            // is the constant mean.
            (
                iadeep_objective::stats::mean(ys.iter().copied()).unwrap_or(f64::NAN),
                0.0,
            )
        }
    })
}

/// How the task's own data bends at its top (see the module documentation).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Curvature {
    /// Growth of the secant's slope per doubling of the batch size, from the secant through
    /// the second and third largest observed sizes to the top one, in [1, `max_curvature`].
    rate: f64,
    /// Midpoint (batch size) of the top secant, where its slope holds.
    top_mid: f64,
}

/// The largest peak at each observed batch size, ascending by size.
fn peaks_by_size(samples: &[MemorySample]) -> Vec<(f64, f64)> {
    let mut peaks: Vec<(u32, f64)> = Vec::with_capacity(samples.len());
    let mut sorted = samples.to_vec();
    sorted.sort_by_key(|s| s.batch_size);
    for s in sorted {
        match peaks.last_mut() {
            Some((b, p)) if *b == s.batch_size => *p = p.max(s.peak_mib),
            _ => peaks.push((s.batch_size, s.peak_mib)),
        }
    }
    peaks.into_iter().map(|(b, p)| (f64::from(b), p)).collect()
}

/// The growth past the largest observed size, at least the fitted `slope`: the secant
/// between the two largest observed sizes' peaks; and, with three or more sizes, how fast
/// the secants' slope grows at the top.
///
/// One observed size gives no secant; its growth is the line through the origin (every
/// MiB scales with the batch), the steepest affine growth. A secant below a flat stretch
/// (allocator plateau, noise) says nothing of the rate, so it counts as the largest
/// curvature allowed; a falling top secant as none.
fn top_shape(samples: &[MemorySample], slope: f64, max_curvature: f64) -> (f64, Option<Curvature>) {
    let peaks = peaks_by_size(samples);
    let n = peaks.len();
    if n < 2 {
        return (slope, None);
    }
    let secant = |i: usize| (peaks[i + 1].1 - peaks[i].1) / (peaks[i + 1].0 - peaks[i].0);
    let mid = |i: usize| (peaks[i].0 + peaks[i + 1].0) / 2.0;
    let top = secant(n - 2);
    let top_slope = top.max(slope);
    if n < 3 {
        return (top_slope, None);
    }
    let below = secant(n - 3);
    let rate = if top <= 0.0 {
        1.0
    } else if below <= 0.0 {
        max_curvature
    } else {
        let doublings = (mid(n - 2) / mid(n - 3)).log2();
        (top / below)
            .powf(1.0 / doublings)
            .clamp(1.0, max_curvature)
    };
    (
        top_slope,
        Some(Curvature {
            rate,
            top_mid: mid(n - 2),
        }),
    )
}

impl MemoryModel {
    /// Fits with the default parameters.
    pub fn fit(samples: &[MemorySample]) -> Result<MemoryModel> {
        Self::fit_with(samples, &[], MemoryModelParams::default())
    }

    /// Fits on successful `samples`; `oom_batch_sizes` are batch sizes that ran out of memory.
    pub fn fit_with(
        samples: &[MemorySample],
        oom_batch_sizes: &[u32],
        params: MemoryModelParams,
    ) -> Result<MemoryModel> {
        params.check()?;
        check_samples(samples)?;
        let xs: Vec<f64> = samples.iter().map(|s| f64::from(s.batch_size)).collect();
        let ys: Vec<f64> = samples.iter().map(|s| s.peak_mib).collect();
        let (intercept, slope) = monotone_affine(samples, &xs, &ys)?;
        // Upper envelope: lift the line until no sample lies above it.
        let residuals: Vec<f64> = xs
            .iter()
            .zip(&ys)
            .map(|(x, y)| y - (intercept + slope * x))
            .collect();
        let lift = residuals.iter().copied().fold(0.0, f64::max);
        let n = residuals.len() as f64;
        let sigma = if residuals.len() > 2 {
            (residuals.iter().map(|r| r * r).sum::<f64>() / (n - 2.0)).sqrt()
        } else {
            0.0
        };
        let largest_observed = samples.iter().map(|s| s.batch_size).max().unwrap_or(1);
        let smallest_observed = samples.iter().map(|s| s.batch_size).min().unwrap_or(1);
        let (top_slope, curvature) = top_shape(samples, slope, params.max_curvature);
        let smallest_oom = oom_batch_sizes.iter().copied().filter(|&b| b > 0).min();
        if let Some(oom) = smallest_oom
            && oom <= largest_observed
        {
            // Debug, not a warning: the tuner fits a task's model at every decision, so a
            // warning here repeated itself all the task's life (80 times in one simulated
            // day), while the crash itself is warned of once, when the tuner learns it.
            tracing::debug!(
                oom,
                largest_observed,
                "an out-of-memory batch size is not above a successful one; the OOM wins"
            );
        }
        Ok(MemoryModel {
            params,
            intercept: intercept + lift,
            slope,
            band: params.residual_sigmas * sigma,
            smallest_observed,
            largest_observed,
            top_slope,
            curvature,
            smallest_oom,
            floors: Vec::new(),
        })
    }

    /// A copy that also knows the task needed more than `mib` at `batch_size` (an
    /// out-of-memory crash next to co-runners that left it `mib`): the bound at that size and
    /// above is at least `mib`.
    pub fn with_floor(&self, batch_size: u32, mib: f64) -> MemoryModel {
        let mut model = self.clone();
        if batch_size > 0 && mib.is_finite() && mib > 0.0 {
            model.floors.push((batch_size, mib));
        }
        model
    }

    /// A copy that also treats `batch_size` and everything above as out of memory.
    pub fn with_oom(&self, batch_size: u32) -> MemoryModel {
        let mut model = self.clone();
        model.smallest_oom = Some(self.smallest_oom.map_or(batch_size, |b| b.min(batch_size)));
        model
    }

    /// The largest batch size the model was fit on.
    pub fn largest_observed(&self) -> u32 {
        self.largest_observed
    }

    /// The smallest batch size the model was fit on: below it the bound stays constant.
    pub fn smallest_observed(&self) -> u32 {
        self.smallest_observed
    }

    /// Conservative peak MiB at `batch_size`; `None` when known or assumed infeasible (at or
    /// above an out-of-memory size, or too far past the observed sizes to say). Never less
    /// below the smallest observed size than at it (see the module documentation).
    pub fn upper_bound_mib(&self, batch_size: u32) -> Option<f64> {
        self.bound_mib(batch_size, false)
    }

    /// [`MemoryModel::upper_bound_mib`] with the growth past the data at least the prior
    /// `extrapolation_slope_factor` times the top secant, whatever the measured curvature:
    /// the bound for a jump further than the curvature can speak for, and to fall back to
    /// where the curvature's tighter one was outgrown (see `TaskKnowledge::upper_bounds`
    /// and `TaskKnowledge::learn_oom_alone_past`).
    pub fn prior_bound_mib(&self, batch_size: u32) -> Option<f64> {
        self.bound_mib(batch_size, true)
    }

    /// The bound the tuner holds a task to at `batch_size`: this model's
    /// ([`MemoryModel::upper_bound_mib`]) within one step
    /// ([`MemoryModelParams::max_step_past_measured`]) of the largest observed size, the
    /// prior's ([`MemoryModel::prior_bound_mib`]) further out, where a jump to a task's
    /// next allowed size crosses a stretch longer than a step, in which the measured
    /// curvature cannot have seen a bend. Never below the model's, and monotone in the
    /// size as both bounds are.
    pub fn held_bound_mib(&self, batch_size: u32) -> Option<f64> {
        let step = one_step(self.largest_observed, self.params.max_step_past_measured);
        self.bound_mib(batch_size, batch_size > step)
    }

    fn bound_mib(&self, batch_size: u32, prior: bool) -> Option<f64> {
        if batch_size == 0 {
            return None;
        }
        if self.smallest_oom.is_some_and(|oom| batch_size >= oom) {
            return None;
        }
        let b = f64::from(batch_size);
        let ratio = b / f64::from(self.largest_observed);
        if ratio > self.params.max_extrapolation {
            return None;
        }
        let line = |b: f64| self.intercept + self.slope * b + self.band;
        let mut base = line(b.max(f64::from(self.smallest_observed)));
        let top = f64::from(self.largest_observed);
        if b > top {
            let factor = if prior {
                self.growth_factor(b)
                    .max(self.params.extrapolation_slope_factor)
            } else {
                self.growth_factor(b)
            };
            let steeper = line(top) + factor * self.top_slope * (b - top);
            base = base.max(steeper);
        }
        let margin = if ratio > 1.0 {
            1.0 + self.params.margin_per_doubling * ratio.log2()
        } else {
            1.0
        };
        let floor = self
            .floors
            .iter()
            .filter(|(at, _)| *at <= batch_size)
            .map(|(_, mib)| *mib)
            .fold(0.0, f64::max);
        Some((base.max(0.0) * margin).max(floor))
    }

    /// How many times the top secant's slope the bound grows by from the largest observed
    /// size up to `b`: the measured curvature carried to the middle of that stretch, times
    /// the safety factor; the prior factor when no curvature was measured. Non-decreasing
    /// in `b`, so the bound stays monotone.
    fn growth_factor(&self, b: f64) -> f64 {
        match self.curvature {
            None => self.params.extrapolation_slope_factor,
            Some(c) => {
                let mid = (f64::from(self.largest_observed) + b) / 2.0;
                let doublings = (mid / c.top_mid).log2().max(0.0);
                self.params.curvature_safety * c.rate.powf(doublings)
            }
        }
    }

    /// The largest batch size in `[lo, hi]` whose upper bound fits `budget_mib`, if any.
    /// Monotonicity makes this a binary search.
    pub fn max_feasible_batch(&self, budget_mib: f64, lo: u32, hi: u32) -> Option<u32> {
        let fits = |b: u32| self.upper_bound_mib(b).is_some_and(|m| m <= budget_mib);
        if lo == 0 || lo > hi || !fits(lo) {
            return None;
        }
        let (mut good, mut bad) = (lo, hi.saturating_add(1));
        if fits(hi) {
            return Some(hi);
        }
        bad = bad.min(hi);
        while bad - good > 1 {
            let mid = good + (bad - good) / 2;
            if fits(mid) {
                good = mid;
            } else {
                bad = mid;
            }
        }
        Some(good)
    }
}

/// The plain least-squares cubic in the batch size — the baseline the issue rejects, kept
/// only so `iadeep memory eval` can show why. Falls back to a lower degree when there are
/// fewer than four distinct sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct CubicBaseline {
    coef: Vec<f64>,
    scale: f64,
}

impl CubicBaseline {
    /// Fits the polynomial by SVD least squares on batch sizes scaled to [0, 1].
    pub fn fit(samples: &[MemorySample]) -> Result<CubicBaseline> {
        if samples.is_empty() {
            return Err(TunerError::InvalidInput(
                "the cubic baseline needs samples".to_owned(),
            ));
        }
        let mut distinct: Vec<u32> = samples.iter().map(|s| s.batch_size).collect();
        distinct.sort_unstable();
        distinct.dedup();
        let degree = (distinct.len().saturating_sub(1)).min(3);
        let scale = f64::from(distinct.last().copied().unwrap_or(1)).max(1.0);
        let design = DMatrix::from_fn(samples.len(), degree + 1, |i, j| {
            (f64::from(samples[i].batch_size) / scale).powi(j as i32)
        });
        let target = DVector::from_iterator(samples.len(), samples.iter().map(|s| s.peak_mib));
        let coef = design
            .svd(true, true)
            .solve(&target, 1e-12)
            .map_err(|e| TunerError::Numerical(format!("cubic least squares failed: {e}")))?;
        Ok(CubicBaseline {
            coef: coef.iter().copied().collect(),
            scale,
        })
    }

    /// The polynomial's value at `batch_size`.
    pub fn predict(&self, batch_size: u32) -> f64 {
        let x = f64::from(batch_size) / self.scale;
        self.coef.iter().rev().fold(0.0, |acc, c| acc * x + c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn s(batch_size: u32, peak_mib: f64) -> MemorySample {
        MemorySample {
            batch_size,
            peak_mib,
        }
    }

    #[test]
    fn affine_data_is_recovered_and_padded_past_the_data() {
        let samples: Vec<_> = [8, 16, 32, 64]
            .iter()
            .map(|&b| s(b, 1000.0 + 10.0 * f64::from(b)))
            .collect();
        let model = MemoryModel::fit(&samples).expect("fits");
        assert!((model.upper_bound_mib(32).expect("feasible") - 1320.0).abs() < 1e-6);
        // No curvature: from 1640 at 64 the slope grows by the safety factor alone,
        // 1.25 × 10 MiB per sample over 192 samples.
        assert!((model.upper_bound_mib(256).expect("feasible") - 4040.0).abs() < 1e-6);
        assert_eq!(model.upper_bound_mib(64 * 8 + 1), None);
        // One doubling past the data: 7 % over the truth (2280), where the fixed factor of
        // 2 with 10 % per doubling gave 3212 MiB, 41 % over.
        let next = model.upper_bound_mib(128).expect("feasible");
        assert!((2280.0..2280.0 * 1.1).contains(&next), "{next}");
    }

    /// The model as it was before the steeper extrapolation: past the data, the fitted line.
    fn without_steeper_extrapolation(samples: &[MemorySample]) -> MemoryModel {
        let params = MemoryModelParams {
            extrapolation_slope_factor: 1.0,
            curvature_safety: 1.0,
            max_curvature: 1.0,
            ..MemoryModelParams::default()
        };
        MemoryModel::fit_with(samples, &[], params).expect("fits")
    }

    /// Memory that bends upwards inside the data (10 MiB per sample plus 0.05 b²): the
    /// secants' slope grows 1.19× per doubling, and the bound one doubling past the data
    /// carries that growth forward. The safety factor alone (curvature capped at 1) or the
    /// fitted line under-estimates it.
    #[test]
    fn a_bend_in_the_data_is_carried_past_it() {
        let truth = |b: u32| {
            let b = f64::from(b);
            1000.0 + 10.0 * b + 0.05 * b * b
        };
        let samples: Vec<_> = [16, 32, 64].iter().map(|&b| s(b, truth(b))).collect();
        let model = MemoryModel::fit(&samples).expect("fits");
        let bound = model.upper_bound_mib(128).expect("feasible");
        assert!(
            bound >= truth(128),
            "bound {bound} under the truth {}",
            truth(128)
        );
        assert!(
            bound <= 1.15 * truth(128),
            "bound {bound} far over {}",
            truth(128)
        );
        let flat = MemoryModel::fit_with(
            &samples,
            &[],
            MemoryModelParams {
                max_curvature: 1.0,
                ..MemoryModelParams::default()
            },
        )
        .expect("fits");
        assert!(flat.upper_bound_mib(128).expect("feasible") < truth(128));
        let plain = without_steeper_extrapolation(&samples);
        assert!(plain.upper_bound_mib(128).expect("feasible") < truth(128));
    }

    /// A flat stretch below the top (an allocator plateau) gives no rate to measure: the
    /// bound takes the largest curvature allowed rather than an infinite one.
    #[test]
    fn growth_after_a_plateau_takes_the_largest_curvature() {
        let samples = [s(8, 1000.0), s(16, 1000.0), s(32, 1160.0)];
        let model = MemoryModel::fit(&samples).expect("fits");
        // Top secant 10 MiB per sample; at 64 the middle (48) is 1.26 doublings past the
        // secant's middle (24): 1.25 × 2^1.26 ≈ 2.99 times that slope over 32 samples,
        // on top of the envelope at 32.
        let at_32 = model.upper_bound_mib(32).expect("feasible");
        let at_64 = model.upper_bound_mib(64).expect("feasible");
        let factor = 1.25 * 2f64.powf((48.0f64 / 24.0).log2());
        assert!(
            (at_64 - (at_32 + factor * 10.0 * 32.0)).abs() < 1e-6,
            "{at_64}"
        );
    }

    /// The simulated world's ResNet-50 on a K80: measured once at its submitted 64
    /// (3,840 MiB, mostly activations below the knee), it needs the whole card (11,441 MiB)
    /// at 128. The line through the origin promises 7,680 MiB there (8,448 with the margin
    /// per doubling), room for a co-runner that then crashed it twice.
    #[test]
    fn one_measured_size_is_extrapolated_with_the_steeper_slope_too() {
        let samples = [s(64, 3840.0)];
        let model = MemoryModel::fit(&samples).expect("fits");
        let bound = model.upper_bound_mib(128).expect("feasible");
        assert!(bound >= 11_441.0, "bound {bound} under the truth 11441");
        assert_eq!(model.upper_bound_mib(64), Some(3840.0));
        assert_eq!(model.upper_bound_mib(32), Some(3840.0));
        let plain = without_steeper_extrapolation(&samples);
        assert!(plain.upper_bound_mib(128).expect("feasible") < 11_441.0);
    }

    #[test]
    fn a_floor_from_a_shared_out_of_memory_crash_lifts_that_size_and_above() {
        let model = MemoryModel::fit(&[s(16, 1160.0), s(32, 1320.0)]).expect("fits");
        let lifted = model.with_floor(64, 5000.0);
        assert_eq!(lifted.upper_bound_mib(32), model.upper_bound_mib(32));
        assert_eq!(lifted.upper_bound_mib(64), Some(5000.0));
        assert!(lifted.upper_bound_mib(128).expect("feasible") >= 5000.0);
        assert_eq!(model.with_floor(64, f64::NAN), model);
    }

    #[test]
    fn max_feasible_batch_finds_the_boundary() {
        let model = MemoryModel::fit(&[s(8, 180.0), s(16, 260.0)]).expect("fits"); // 100 + 10 b
        assert_eq!(model.max_feasible_batch(260.001, 1, 16), Some(16));
        assert_eq!(model.max_feasible_batch(255.0, 1, 16), Some(15));
        assert_eq!(model.max_feasible_batch(50.0, 1, 16), None);
    }

    #[test]
    fn single_sample_assumes_proportional_growth_and_rejects_bad_input() {
        let model = MemoryModel::fit(&[s(10, 1000.0)]).expect("fits");
        assert!(model.upper_bound_mib(20).expect("feasible") >= 2000.0);
        assert!(MemoryModel::fit(&[]).is_err());
        assert!(MemoryModel::fit(&[s(0, 10.0)]).is_err());
        assert!(MemoryModel::fit(&[s(1, f64::NAN)]).is_err());
    }

    /// With one sample the line goes through the origin, and half the
    /// batch used to get half the memory, though weights and optimiser state do not shrink.
    #[test]
    fn below_the_smallest_observed_size_the_bound_does_not_shrink() {
        let one = MemoryModel::fit(&[s(64, 6000.0)]).expect("fits");
        assert_eq!(one.smallest_observed(), 64);
        for b in [1, 8, 32, 63, 64] {
            assert!(
                one.upper_bound_mib(b).expect("feasible") >= 6000.0,
                "bound at {b} must cover the peak measured at 64"
            );
        }
        // A steep fit through two samples: below 32 the bound stays at its value at 32.
        let two = MemoryModel::fit(&[s(32, 4000.0), s(64, 7000.0)]).expect("fits");
        let at_32 = two.upper_bound_mib(32).expect("feasible");
        assert_eq!(two.upper_bound_mib(8), Some(at_32));
        assert!(at_32 >= 4000.0);
    }

    #[test]
    fn cubic_baseline_interpolates_a_cubic() {
        let samples: Vec<_> = (1..=6).map(|b| s(b, f64::from(b * b * b) + 2.0)).collect();
        let cubic = CubicBaseline::fit(&samples).expect("fits");
        assert!((cubic.predict(10) - 1002.0).abs() < 1e-6);
    }

    proptest! {
        #[test]
        fn monotone_and_never_below_a_sample(points in proptest::collection::vec((1u32..512, 100.0f64..20_000.0), 1..12)) {
            let samples: Vec<_> = points.iter().map(|&(b, m)| s(b, m)).collect();
            let model = MemoryModel::fit(&samples).expect("fits");
            for sample in &samples {
                let bound = model.upper_bound_mib(sample.batch_size).expect("observed sizes are feasible");
                prop_assert!(bound >= sample.peak_mib - 1e-6);
            }
            // Below the smallest observed size the bound is the bound there.
            let smallest = model.smallest_observed();
            let floor = model.upper_bound_mib(smallest).expect("observed sizes are feasible");
            for smaller in [1, smallest / 2, smallest.saturating_sub(1)] {
                if smaller > 0 {
                    prop_assert_eq!(model.upper_bound_mib(smaller), Some(floor));
                }
            }
            let mut last = 0.0;
            let top = model.largest_observed() * 8;
            for b in (1..=top).step_by((top as usize / 64).max(1)) {
                let bound = model.upper_bound_mib(b).expect("within the extrapolation limit");
                prop_assert!(bound >= last - 1e-9);
                last = bound;
            }
        }
    }
}
