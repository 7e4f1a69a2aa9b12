//! The cold-start rule, used until the forest has enough samples.
//!
//! Transparent on purpose, so an operator can check any number by hand:
//!
//! ```text
//! demand_r  = u_r(task) + Σ_corunners u_r(c)           for r in {SM, memory bandwidth}
//! slowdown  = max(1 + PER_CORUNNER_OVERHEAD · n,  max_r demand_r / 100)
//! ```
//!
//! i.e. a GPU resource asked for more than 100 % is time-shared in proportion to the
//! demand, and every co-runner costs at least a small context-switch overhead. An
//! unknown utilisation counts as [`ASSUMED_UTIL_PCT`] (a busy training job), not 0.
//! Peak memory does not slow a task down while it fits; if the known memory of all
//! tasks exceeds the card, the placer's memory model rejects the placement, so the
//! heuristic does not try to price it.
//!
//! Every co-runner adds a non-negative demand and one overhead term, so adding a
//! co-runner never lowers the prediction (a property test checks it). The 90 %
//! interval reads the stated width as a log-normal spread, `slowdown ·
//! exp(±1.645 · 0.5)`: a rule nothing was fitted on can only state its doubt.

use iadeep_proto::TaskProfile;

use crate::features::CleanProfile;
use crate::{Prediction, PredictionSource};

/// Utilisation assumed for a task whose utilisation is unknown, in percent.
pub const ASSUMED_UTIL_PCT: f64 = 60.0;
/// Minimum slowdown added by each co-runner (context switches, cache sharing).
pub const PER_CORUNNER_OVERHEAD: f64 = 0.05;
/// Relative width reported as uncertainty: the rule is a rough guess.
pub const RELATIVE_UNCERTAINTY: f64 = 0.5;

fn util(value: Option<f64>) -> f64 {
    value.unwrap_or(ASSUMED_UTIL_PCT)
}

/// The cold-start prediction for `task` sharing a GPU with `corunners`.
pub fn predict(task: &TaskProfile, corunners: &[TaskProfile]) -> Prediction {
    let t = CleanProfile::from_profile(task);
    let co: Vec<CleanProfile> = corunners.iter().map(CleanProfile::from_profile).collect();
    let sm = util(t.sm_util_pct) + co.iter().map(|c| util(c.sm_util_pct)).sum::<f64>();
    let bw = util(t.mem_bw_util_pct) + co.iter().map(|c| util(c.mem_bw_util_pct)).sum::<f64>();
    let overhead = 1.0 + PER_CORUNNER_OVERHEAD * co.len() as f64;
    let slowdown = overhead.max(sm.max(bw) / 100.0);
    if co.is_empty() {
        // Alone there is nothing to guess.
        return Prediction::certain(slowdown, PredictionSource::ColdStart);
    }
    Prediction::with_stated_spread(
        slowdown,
        RELATIVE_UNCERTAINTY * slowdown,
        PredictionSource::ColdStart,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(sm: Option<f64>, bw: Option<f64>) -> TaskProfile {
        TaskProfile {
            model: "m".into(),
            batch_size: 32,
            solo_step_time_s: 0.1,
            sm_util_pct: sm,
            mem_bw_util_pct: bw,
            gpu_mem_mib: None,
        }
    }

    #[test]
    fn alone_is_no_slowdown_and_saturation_time_shares() {
        assert_eq!(predict(&p(Some(90.0), None), &[]).slowdown, 1.0);
        let two_busy = predict(&p(Some(90.0), Some(10.0)), &[p(Some(90.0), Some(10.0))]);
        assert!((two_busy.slowdown - 1.8).abs() < 1e-12);
        let two_light = predict(&p(Some(20.0), Some(10.0)), &[p(Some(30.0), Some(10.0))]);
        assert!((two_light.slowdown - 1.05).abs() < 1e-12);
        assert_eq!(two_light.source, PredictionSource::ColdStart);
    }

    fn any_profile() -> impl Strategy<Value = TaskProfile> {
        (
            proptest::option::of(any::<f64>()),
            proptest::option::of(any::<f64>()),
            any::<u32>(),
            any::<f64>(),
        )
            .prop_map(|(sm, bw, b, s)| TaskProfile {
                batch_size: b,
                solo_step_time_s: s,
                ..p(sm, bw)
            })
    }

    proptest! {
        #[test]
        fn adding_a_corunner_never_lowers_the_prediction(
            task in any_profile(),
            co in proptest::collection::vec(any_profile(), 0..5),
            extra in any_profile(),
        ) {
            let before = predict(&task, &co);
            let mut more = co.clone();
            more.push(extra);
            let after = predict(&task, &more);
            prop_assert!(before.slowdown.is_finite() && after.slowdown.is_finite());
            prop_assert!(after.slowdown >= before.slowdown, "{} < {}", after.slowdown, before.slowdown);
            prop_assert!(before.slowdown >= 1.0);
        }
    }
}
