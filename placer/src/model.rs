//! What the policy needs to know about tasks, behind two small traits.
//!
//! The policy must not care *how* a slowdown or a memory footprint is
//! estimated: the daemon plugs in the online predictor and the tuner's memory
//! model, tests and the simulator plug in whatever they need. The two
//! implementations here are the transparent fallbacks the daemon uses when
//! nothing better is configured.

use std::fmt;

use iadeep_proto::{CoLocationSample, TaskProfile, TaskReport, TaskSpec};

/// A predicted interference factor IF (co-located step time ÷ solo step time).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlowdownEstimate {
    /// Predicted IF, ≥ 1 for any sensible model.
    pub slowdown: f64,
    /// Spread of the prediction (e.g. the standard deviation across a forest's trees),
    /// in the same unit; 0 when the model claims certainty.
    pub uncertainty: f64,
}

/// Predicts how much a task slows down next to co-runners.
pub trait SlowdownModel: Send + Sync + fmt::Debug {
    /// IF of `task` on a device of `device_kind` shared with `corunners`
    /// (an empty slice means "alone", which must give 1.0).
    fn predict(
        &self,
        device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> SlowdownEstimate;

    /// Learns from a measured co-location. Models that do not learn ignore it; the
    /// daemon feeds every sample the tuners write here.
    fn observe(&self, sample: &CoLocationSample);
}

/// Estimates how much GPU memory a task needs at least.
pub trait MemoryEstimator: Send + Sync + fmt::Debug {
    /// MiB the task needs at its smallest allowed batch size, given its latest
    /// report if it runs already; `None` when nothing is known about its memory.
    fn min_footprint_mib(&self, spec: &TaskSpec, report: Option<&TaskReport>) -> Option<u64>;
}

/// Interference from utilisations: a GPU time-slices between its tasks, so when
/// the solo SM (or DRAM-bandwidth) utilisations of the tasks on a device add up to
/// more than 100%, each task runs about `sum / 100` times slower, and not slower
/// than that when they add up to less.
///
/// `IF = max(1, ΣSM / 100, ΣBW / 100)`, with an unknown utilisation taken as 100%
/// (a task that was never profiled is assumed to saturate the GPU, so the
/// heuristic never promises a free lunch). The uncertainty is 0.5 per unknown
/// utilisation involved, so the policy prefers co-locations it knows about.
///
/// It does not learn: [`SlowdownModel::observe`] ignores samples (the online
/// predictor is what learns).
#[derive(Clone, Copy, Debug, Default)]
pub struct UtilisationHeuristic;

/// Utilisation assumed for a task that does not report one.
const UNKNOWN_UTIL_PCT: f64 = 100.0;
/// Uncertainty added per unknown utilisation.
const UNKNOWN_UTIL_UNCERTAINTY: f64 = 0.5;

impl SlowdownModel for UtilisationHeuristic {
    fn predict(
        &self,
        _device_kind: &str,
        task: &TaskProfile,
        corunners: &[TaskProfile],
    ) -> SlowdownEstimate {
        if corunners.is_empty() {
            return SlowdownEstimate {
                slowdown: 1.0,
                uncertainty: 0.0,
            };
        }
        let mut sm = 0.0;
        let mut bw = 0.0;
        let mut unknown = 0u32;
        for profile in std::iter::once(task).chain(corunners) {
            for value in [profile.sm_util_pct, profile.mem_bw_util_pct] {
                if value.is_none() {
                    unknown += 1;
                }
            }
            sm += profile
                .sm_util_pct
                .unwrap_or(UNKNOWN_UTIL_PCT)
                .clamp(0.0, 100.0);
            bw += profile
                .mem_bw_util_pct
                .unwrap_or(UNKNOWN_UTIL_PCT)
                .clamp(0.0, 100.0);
        }
        SlowdownEstimate {
            slowdown: (sm / 100.0).max(bw / 100.0).max(1.0),
            uncertainty: f64::from(unknown) * UNKNOWN_UTIL_UNCERTAINTY,
        }
    }

    fn observe(&self, _sample: &CoLocationSample) {}
}

/// Memory from what is declared or measured: the larger of the user's request
/// (`gpu_mem_request_mib`), the solo profile's peak and the latest reported peak.
///
/// A reported peak at the current batch size is an upper bound of the footprint at
/// the smallest batch size (memory grows with batch size), so this never
/// under-estimates a measured task; it over-estimates a task that could shrink its
/// batch, which only costs packing density, never an out-of-memory crash.
#[derive(Clone, Copy, Debug, Default)]
pub struct DeclaredOrPeakMemory;

impl MemoryEstimator for DeclaredOrPeakMemory {
    fn min_footprint_mib(&self, spec: &TaskSpec, report: Option<&TaskReport>) -> Option<u64> {
        let declared = Some(spec.gpu_mem_request_mib).filter(|&m| m > 0);
        let profiled = spec.profile.as_ref().and_then(|p| p.peak_mem_mib);
        let reported = report.and_then(|r| r.peak_mem_mib);
        [declared, profiled, reported].into_iter().flatten().max()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_proto::SoloProfile;

    fn util(sm: Option<f64>, bw: Option<f64>) -> TaskProfile {
        TaskProfile {
            sm_util_pct: sm,
            mem_bw_util_pct: bw,
            ..Default::default()
        }
    }

    #[test]
    fn alone_is_exactly_one() {
        let e = UtilisationHeuristic.predict("k80", &util(None, None), &[]);
        assert_eq!((e.slowdown, e.uncertainty), (1.0, 0.0));
    }

    #[test]
    fn light_tasks_do_not_slow_each_other_and_heavy_ones_time_share() {
        let light = UtilisationHeuristic.predict(
            "k80",
            &util(Some(30.0), Some(20.0)),
            &[util(Some(40.0), Some(30.0))],
        );
        assert_eq!(light.slowdown, 1.0);
        assert_eq!(light.uncertainty, 0.0);
        let heavy = UtilisationHeuristic.predict(
            "k80",
            &util(Some(90.0), Some(20.0)),
            &[util(Some(90.0), Some(30.0))],
        );
        assert!((heavy.slowdown - 1.8).abs() < 1e-12);
        let unknown =
            UtilisationHeuristic.predict("k80", &util(None, Some(10.0)), &[util(None, None)]);
        assert_eq!(unknown.slowdown, 2.0);
        assert_eq!(unknown.uncertainty, 1.5);
    }

    #[test]
    fn memory_is_the_largest_known_value() {
        let mut spec = TaskSpec::default();
        assert_eq!(DeclaredOrPeakMemory.min_footprint_mib(&spec, None), None);
        spec.gpu_mem_request_mib = 4000;
        assert_eq!(
            DeclaredOrPeakMemory.min_footprint_mib(&spec, None),
            Some(4000)
        );
        spec.profile = Some(SoloProfile {
            peak_mem_mib: Some(5000),
            ..Default::default()
        });
        let report = TaskReport {
            peak_mem_mib: Some(4500),
            ..Default::default()
        };
        assert_eq!(
            DeclaredOrPeakMemory.min_footprint_mib(&spec, Some(&report)),
            Some(5000)
        );
    }
}
