//! What the policy needs to know about a task's memory, behind one small trait.
//!
//! The policy must not care *how* a memory footprint (or a slowdown: the predictor's
//! [`iadeep_predictor::SlowdownModel`]) is estimated: the daemon plugs in the tuner's
//! memory model ([`ModelledMemory`]) and the online predictor, and tests and the
//! simulator plug in whatever they need.

use std::fmt;

use iadeep_proto::{TaskReport, TaskSpec};
use iadeep_tuner::{MemoryModel, MemoryModelParams, MemorySample};

/// Estimates the GPU memory of a task.
pub trait MemoryEstimator: Send + Sync + fmt::Debug {
    /// A conservative bound on the task's peak MiB at `batch_size`, from its spec and
    /// latest report (if it runs already), never below what the user asked for; `None`
    /// when nothing is known about its memory.
    fn bound_mib(
        &self,
        spec: &TaskSpec,
        report: Option<&TaskReport>,
        batch_size: u32,
    ) -> Option<u64>;
}

/// Bounds from the tuner's conservative memory model ([`iadeep_tuner::MemoryModel`]), fitted on
/// what the placer knows of the task: its solo profile (peak memory at its size) and its
/// latest report (the peak at the batch size the agent names with it). Below the smallest
/// measured size the model keeps its bound there (weights and optimiser state do not
/// shrink), above the largest it extrapolates as the tuner does (by the task's own measured
/// curvature times a safety factor, or twice the top slope with fewer than three sizes) and
/// refuses to guess past 8×. Never below the user's request (`gpu_mem_request_mib`);
/// `None` when nothing is known.
#[derive(Clone, Copy, Debug, Default)]
pub struct ModelledMemory;

impl MemoryEstimator for ModelledMemory {
    fn bound_mib(
        &self,
        spec: &TaskSpec,
        report: Option<&TaskReport>,
        batch_size: u32,
    ) -> Option<u64> {
        let declared = Some(spec.gpu_mem_request_mib).filter(|&m| m > 0);
        let mut samples: Vec<MemorySample> = Vec::with_capacity(2);
        if let Some(p) = &spec.profile
            && let Some(peak) = p.peak_mem_mib
        {
            let batch = if p.batch_size > 0 {
                p.batch_size
            } else {
                spec.initial_batch_size
            };
            samples.push(MemorySample {
                batch_size: batch,
                peak_mib: peak as f64,
            });
        }
        if let Some(r) = report
            && let Some(peak) = r.peak_mem_mib
        {
            let batch = if r.peak_mem_batch_size > 0 {
                r.peak_mem_batch_size
            } else {
                r.batch_size
            };
            samples.push(MemorySample {
                batch_size: batch,
                peak_mib: peak as f64,
            });
        }
        samples.retain(|s| s.batch_size > 0 && s.peak_mib > 0.0);
        let modelled = if samples.is_empty() {
            None
        } else {
            MemoryModel::fit_with(&samples, &[], MemoryModelParams::default())
                .ok()
                .and_then(|m| m.upper_bound_mib(batch_size.max(1)))
                .map(|mib| mib.ceil() as u64)
        };
        [declared, modelled].into_iter().flatten().max()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_proto::SoloProfile;

    fn spec(request: u64, profile: Option<(u32, u64)>) -> TaskSpec {
        TaskSpec {
            initial_batch_size: 64,
            min_batch_size: 16,
            max_batch_size: 256,
            gpu_mem_request_mib: request,
            profile: profile.map(|(batch_size, peak)| SoloProfile {
                batch_size,
                peak_mem_mib: Some(peak),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn report(batch_size: u32, peak: u64) -> TaskReport {
        TaskReport {
            batch_size,
            peak_mem_mib: Some(peak),
            peak_mem_batch_size: batch_size,
            ..Default::default()
        }
    }

    #[test]
    fn memory_is_declared_or_modelled_and_never_below_the_request() {
        let m = ModelledMemory;
        assert_eq!(m.bound_mib(&spec(0, None), None, 64), None);
        assert_eq!(m.bound_mib(&spec(4000, None), None, 64), Some(4000));
        // One measured size: it bounds every smaller size (weights do not shrink)...
        assert_eq!(
            m.bound_mib(&spec(0, Some((64, 6000))), None, 16),
            Some(6000)
        );
        assert_eq!(
            m.bound_mib(&spec(7000, Some((64, 6000))), None, 16),
            Some(7000)
        );
        // ... and a larger one grows at least proportionally.
        assert!(
            m.bound_mib(&spec(0, Some((64, 6000))), None, 128)
                .is_some_and(|b| b >= 12_000)
        );
        // Two sizes: the tuner's model, 2000 + 50·b through (64, 5200) and (128, 8400);
        // at the size the task is assigned, 128: 8400 (rounded up).
        let fitted = m
            .bound_mib(&spec(0, Some((64, 5200))), Some(&report(128, 8400)), 128)
            .expect("known");
        assert!((8400..=8401).contains(&fitted), "{fitted}");
        // Below the smallest measured size, its bound there.
        let below = m
            .bound_mib(&spec(0, Some((64, 5200))), Some(&report(128, 8400)), 16)
            .expect("known");
        assert!((5200..=5201).contains(&below), "{below}");
    }
}
