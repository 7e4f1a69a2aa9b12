//! The queue rule (step 3 of the module docs of [`super`]): place on the best
//! candidate, or queue when waiting for a device to free up is predicted to cost
//! less, with a retry hint.
use std::cmp::Ordering;
use std::time::Duration;

use iadeep_proto::TaskSpec;

use super::explain::{
    cap_refusals_text, ordinal, rejection_counts, separating_decimals, waiting_ahead_text,
};
use super::{Assessment, Placer, Verdict};

/// Orders devices by when they free up, then by id.
fn by_idle_time(a: &(f64, &str), b: &(f64, &str)) -> Ordering {
    a.0.total_cmp(&b.0).then(a.1.cmp(b.1))
}

/// The wait `W` of the queue rule, and which devices the tasks waiting ahead count
/// on (see the module docs of [`super`], steps 2 and 3).
pub(super) struct Promises<'v> {
    /// Tasks waiting ahead (`q`).
    ahead: usize,
    /// The (q+1)-th device to free up, with when: `W`, and the bound below which a
    /// device is promised to a task ahead.
    bound: Option<(f64, &'v str)>,
}

impl<'v> Promises<'v> {
    /// From the seconds until each considered device with residents is predicted to
    /// be idle (reordered in place) and the tasks waiting ahead.
    pub(super) fn new(idle_in_s: &mut [(f64, &'v str)], ahead: usize) -> Promises<'v> {
        // The (q+1)-th device to free up: W, and the bound below which a device is
        // promised to a task ahead. With fewer such devices than tasks ahead, every
        // device that says when it frees up is promised to one.
        let bound = if ahead < idle_in_s.len() {
            let (_, w, _) = idle_in_s.select_nth_unstable_by(ahead, by_idle_time);
            Some(*w)
        } else {
            None
        };
        Promises { ahead, bound }
    }

    /// `W`: `None` when fewer devices say when they free up than tasks wait ahead.
    pub(super) fn wait_s(&self) -> Option<f64> {
        self.bound.map(|(w, _)| w)
    }

    /// Whether device `id`, predicted to be idle in `idle_in` seconds, is promised to
    /// a task waiting ahead.
    pub(super) fn promised(&self, id: &str, idle_in: Option<f64>) -> bool {
        match (idle_in, self.bound) {
            (None, _) => false,
            (Some(s), Some(bound)) => by_idle_time(&(s, id), &bound) == Ordering::Less,
            (Some(_), None) => self.ahead > 0,
        }
    }
}

impl Placer {
    fn retry_hint(&self, wait_s: Option<f64>) -> Duration {
        let p = &self.params;
        match wait_s {
            Some(w) if w.is_finite() => {
                Duration::from_secs_f64(w.max(0.0)).clamp(p.min_retry_after, p.max_retry_after)
            }
            _ => p.min_retry_after.max(p.max_retry_after / 10),
        }
    }

    /// Queue or place, given the assessment of the devices (see the module docs).
    pub fn verdict(&self, task: &TaskSpec, assessment: &Assessment<'_>) -> Verdict {
        let wait = assessment.wait_s;
        let ahead = assessment.waiting_ahead;
        let Some(best) = assessment.candidates.first() else {
            let reason = if assessment.rejected.is_empty() {
                "no device is registered".to_owned()
            } else {
                let caps = cap_refusals_text(&assessment.rejected, self.params.explain_top_k)
                    .map(|t| format!("; {t}"))
                    .unwrap_or_default();
                format!(
                    "no device can take the task now ({}){caps}",
                    rejection_counts(&assessment.rejected)
                )
            };
            return Verdict::Queue {
                // Something may change when the first device frees up, even with a queue.
                retry_after: self.retry_hint(wait.or(assessment.earliest_idle_s)),
                reason: format!("{reason}; {}", waiting_ahead_text(ahead)),
            };
        };
        let place = Verdict::Place {
            device_id: best.device_id.to_owned(),
            reserved_mem_mib: best.reserved_mem_mib,
            shrinks: best.shrinks.clone(),
            newcomer: best.newcomer,
            provisional: best.provisional,
        };
        if best.idle {
            return place;
        }
        let excess = (best.pd_increase_upper_90 - 1.0).max(0.0);
        let duration_s = self.expected_duration_s(task);
        let cost_place_s = excess * duration_s + best.delay_s;
        match wait {
            Some(w) if w * self.params.wait_cost_factor < cost_place_s => Verdict::Queue {
                retry_after: self.retry_hint(Some(w)),
                reason: QueueReason {
                    wait_s: w,
                    residents_done_s: assessment.residents_done_s.unwrap_or(w),
                    wait_cost_s: w * self.params.wait_cost_factor,
                    ahead,
                    device_id: best.device_id,
                    pd_increase: best.pd_increase,
                    pd_increase_upper_90: best.pd_increase_upper_90,
                    excess,
                    duration_s,
                    delay_s: best.delay_s,
                    cost_place_s,
                }
                .to_string(),
            },
            _ => place,
        }
    }
}

/// Why a task queues: the two costs the rule compared, each with its parts.
struct QueueReason<'a> {
    wait_s: f64,
    residents_done_s: f64,
    /// `wait_s × wait_cost_factor`.
    wait_cost_s: f64,
    ahead: usize,
    device_id: &'a str,
    pd_increase: f64,
    pd_increase_upper_90: f64,
    excess: f64,
    duration_s: f64,
    delay_s: f64,
    /// `excess × duration_s + delay_s`, more than `wait_cost_s`.
    cost_place_s: f64,
}

impl std::fmt::Display for QueueReason<'_> {
    /// The compared costs are printed with as many decimals as it takes to show the
    /// smaller one smaller (at least none): a reason never reads "waiting costs 0 s,
    /// less than 0 s".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = separating_decimals(self.wait_cost_s, self.cost_place_s, 0);
        write!(
            f,
            "waiting about {:.d$} s for a device to become idle ({}, so it waits for the \
             {} device to free up: its residents finish in about {:.0} s, and tasks join \
             busy devices meanwhile) costs {:.d$} s, less than the {:.d$} s that running \
             now on {} costs (predicted summed PD +{:.2}, up to +{:.2} at the upper ends \
             of the 90 % intervals: {:.2} × {:.0} s of solo-speed progress lost, plus {:.0} \
             s of delay to a task waiting ahead that counts on that device)",
            self.wait_s,
            waiting_ahead_text(self.ahead),
            ordinal(self.ahead + 1),
            self.residents_done_s,
            self.wait_cost_s,
            self.cost_place_s,
            self.device_id,
            self.pd_increase,
            self.pd_increase_upper_90,
            self.excess,
            self.duration_s,
            self.delay_s,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::super::*;
    use crate::model::ModelledMemory;
    use iadeep_predictor::PredictionSource;
    use iadeep_proto::{CoLocationSample, TaskProfile, TaskReport};

    #[test]
    fn queues_when_a_device_frees_up_soon_and_places_when_nobody_reports_progress() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        let resident = spec("r1", 4000, 95.0, Some(10_000));
        device(&mut view, "d0", 32_000, std::slice::from_ref(&resident));
        let new = spec("new", 4000, 95.0, Some(1_000_000)); // 1e6 × 0.1 / 32 ≈ 3125 s alone
        // Nobody reports: the wait is unknown, so the task is placed despite the cost.
        let d = queue_rule_placer().decide(&view, &new, &[], 0);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
        // The resident has 9,000 samples left at 900/s: free in 10 s. Placing costs
        // (1.9 + 0.9 − 1) × 3125 s; waiting 10 s is far cheaper.
        view.set_report(TaskReport {
            task_id: "r1".into(),
            samples_done: 1000,
            samples_per_s: 900.0,
            reported_at_unix_ms: 0,
            ..Default::default()
        });
        let d = queue_rule_placer().decide(&view, &new, &[], 0);
        match d.verdict {
            Verdict::Queue {
                retry_after,
                reason,
            } => {
                assert_eq!(retry_after, Duration::from_secs(10));
                assert!(reason.contains("waiting about 10 s"), "{reason}");
            }
            other => panic!("expected queue, got {other:?}"),
        }
        // A light newcomer costs nothing extra: placed even though a device frees soon.
        let d =
            queue_rule_placer().decide(&view, &spec("light", 1000, 4.0, Some(1_000_000)), &[], 0);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
    }

    /// Issue 26, queue reasons that never contradict themselves: with costs below a
    /// second, the reason shows the wait's cost below placing's.
    #[test]
    fn a_queue_reason_shows_the_smaller_cost_smaller() {
        let reason = super::QueueReason {
            wait_s: 0.3,
            residents_done_s: 0.3,
            wait_cost_s: 0.3,
            ahead: 0,
            device_id: "d0",
            pd_increase: 1.0001,
            pd_increase_upper_90: 1.0001,
            excess: 0.0001,
            duration_s: 4000.0,
            delay_s: 0.0,
            cost_place_s: 0.4,
        }
        .to_string();
        assert!(
            reason.contains("costs 0.3 s, less than the 0.4 s that running now on d0"),
            "{reason}"
        );
    }

    /// Issue 25: `W` is the order statistic scaled by the waits the placer's queued
    /// tasks really had. Tasks told to queue when a device was to free up in 10 s were
    /// placed 40 s later: a later task is told to expect 40 s.
    #[test]
    fn the_wait_is_the_order_statistic_scaled_by_the_real_waits_of_queued_tasks() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        let resident = spec("r1", 4000, 95.0, Some(10_000));
        device(&mut view, "d0", 32_000, std::slice::from_ref(&resident));
        // 9,000 samples left at 900/s: free in 10 s.
        let report = TaskReport {
            task_id: "r1".into(),
            samples_done: 1000,
            samples_per_s: 900.0,
            reported_at_unix_ms: 0,
            ..Default::default()
        };
        let placer = queue_rule_placer();
        let heavy = |id: &str| spec(id, 4000, 95.0, Some(1_000_000));
        for k in 0..super::super::wait::WAIT_MIN_COMPLETED {
            let task = heavy(&format!("new{k}"));
            view.set_report(report.clone());
            let d = placer.decide(&view, &task, &[], 0);
            assert!(
                matches!(d.verdict, Verdict::Queue { .. }),
                "{:?}",
                d.verdict
            );
            // Nobody reports any more: W is unknown and the task is placed, 40 s later.
            view.remove_report("r1");
            let d = placer.decide(&view, &task, &[], 40_000);
            assert!(
                matches!(d.verdict, Verdict::Place { .. }),
                "{:?}",
                d.verdict
            );
        }
        view.set_report(report);
        let a = placer.assess(&view, &heavy("late"), &[], 0);
        assert_eq!(a.residents_done_s, Some(10.0));
        let w = a.wait_s.expect("a wait");
        assert!((w - 40.0).abs() < 1e-9, "{w}");
        let d = placer.decide(&view, &heavy("late"), &[], 0);
        let Verdict::Queue {
            reason,
            retry_after,
        } = &d.verdict
        else {
            panic!("expected queue, got {:?}", d.verdict);
        };
        assert_eq!(*retry_after, Duration::from_secs(40));
        assert!(
            reason.contains("waiting about 40 s") && reason.contains("finish in about 10 s"),
            "{reason}"
        );
        // A placer of its own has seen no wait: the order statistic as it is.
        let fresh = queue_rule_placer().assess(&view, &heavy("late"), &[], 0);
        assert_eq!(fresh.wait_s, Some(10.0));
    }

    /// Every task next to company slows down 1.2×, but the model is unsure: the
    /// upper end of its 90 % interval is `upper`.
    #[derive(Debug)]
    struct Unsure {
        upper: f64,
    }

    impl SlowdownModel for Unsure {
        fn predict(&self, _: &str, _: &TaskProfile, co: &[TaskProfile]) -> Prediction {
            if co.is_empty() {
                return Prediction::certain(1.0, PredictionSource::Given);
            }
            Prediction {
                slowdown: 1.2,
                uncertainty: 0.1,
                lower_90: 1.1,
                upper_90: self.upper,
                source: PredictionSource::Given,
            }
        }
        fn observe(&self, _: &CoLocationSample) {}
    }

    /// The queue-or-place rule charges the upper ends of the 90 % intervals: the same
    /// predicted slowdowns place the task when the model is sure and queue it when
    /// the model says they could be much worse.
    #[test]
    fn an_unsure_co_location_is_charged_at_the_upper_end_of_its_interval() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        // Free in (2,701,000 − 1,000) / 900 = 3,000 s.
        let resident = spec("r1", 4000, 50.0, Some(2_701_000));
        device(&mut view, "d0", 32_000, std::slice::from_ref(&resident));
        view.set_report(TaskReport {
            task_id: "r1".into(),
            samples_done: 1000,
            samples_per_s: 900.0,
            reported_at_unix_ms: 0,
            ..Default::default()
        });
        let new = spec("new", 4000, 50.0, Some(1_000_000)); // 3,125 s alone
        let decide = |upper: f64| {
            Placer::new(PlacerParams::default(), Arc::new(Unsure { upper }))
                .expect("valid params")
                .decide(&view, &new, &[], 0)
        };
        // Sure: (1.2 + 0.2 − 1) × 3,125 s = 1,250 s lost < 3,000 s of waiting.
        let sure = decide(1.2);
        assert!(
            matches!(sure.verdict, Verdict::Place { .. }),
            "{:?}",
            sure.verdict
        );
        // Unsure: (2.0 + 1.0 − 1) × 3,125 s = 6,250 s lost > 3,000 s of waiting.
        let unsure = decide(2.0);
        let Verdict::Queue { reason, .. } = &unsure.verdict else {
            panic!("expected queue, got {:?}", unsure.verdict);
        };
        assert!(reason.contains("+1.40, up to +3.00"), "{reason}");
    }

    /// When the only device the newcomer fits is promised to a task ahead, the delay
    /// it would cause outweighs its own wait: it queues although it slows nobody,
    /// whereas without a task ahead it is placed.
    #[test]
    fn the_delay_to_a_task_ahead_can_make_a_free_co_location_wait() {
        // "full" frees up later and has no room for the newcomer.
        let devices = [("soon", 4000, 10), ("full", 31_000, 1000)];
        let new = light_newcomer();
        let d = queue_rule_placer().decide(&freeing_view(&devices, 1), &new, &[], 0);
        match d.verdict {
            Verdict::Queue { reason, .. } => {
                assert!(reason.contains("3115 s of delay"), "{reason}")
            }
            other => panic!("expected queue, got {other:?}"),
        }
        let d = queue_rule_placer().decide(&freeing_view(&devices, 0), &new, &[], 0);
        assert!(
            matches!(&d.verdict, Verdict::Place { device_id, reserved_mem_mib: 1000, shrinks, provisional: false, .. }
                if device_id == "soon" && shrinks.is_empty()),
            "{:?}",
            d.verdict
        );
    }

    /// With more tasks ahead than devices that say when they free up, W is unknown
    /// (the task is placed) but every such device is promised to a task ahead.
    #[test]
    fn every_reporting_device_is_promised_when_more_tasks_wait_than_free_up() {
        let view = freeing_view(&[("soon", 4000, 10)], 2);
        let a = queue_rule_placer().assess(&view, &light_newcomer(), &[], 0);
        assert_eq!((a.waiting_ahead, a.wait_s), (2, None));
        assert!((a.candidates[0].delay_s - 3115.0).abs() < 1e-6);
    }

    /// Three shared devices freeing up in 10, 20 and 30 s: the wait is the time until
    /// the (q+1)-th frees up, with q the tasks waiting ahead.
    #[test]
    fn the_wait_counts_the_tasks_queued_ahead() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        for (i, left_s) in [30u64, 10, 20].into_iter().enumerate() {
            let id = format!("r{i}");
            device(
                &mut view,
                &format!("d{i}"),
                32_000,
                &[spec(&id, 4000, 95.0, Some(1000 + 900 * left_s))],
            );
            view.set_report(TaskReport {
                task_id: id,
                samples_done: 1000,
                samples_per_s: 900.0,
                reported_at_unix_ms: 0,
                ..Default::default()
            });
        }
        // Placing costs (1.9 + 0.9 − 1) × 3125 s, far more than any of these waits.
        let mut new = spec("new", 4000, 95.0, Some(1_000_000));
        new.submitted_at_unix_ms = 5_000;
        let ahead = |view: &mut ClusterView, n: usize| {
            view.clear_waiting();
            for k in 0..n {
                let mut earlier = spec(&format!("early{k}"), 4000, 95.0, None);
                earlier.submitted_at_unix_ms = 1_000;
                view.note_waiting(&earlier, &[], 0, 600_000, None);
            }
        };
        for (q, expect_s) in [(0usize, 10u64), (1, 20), (2, 30)] {
            ahead(&mut view, q);
            let assessment = queue_rule_placer().assess(&view, &new, &[], 0);
            assert_eq!(assessment.waiting_ahead, q);
            assert_eq!(assessment.earliest_idle_s, Some(10.0));
            assert_eq!(assessment.wait_s, Some(expect_s as f64));
            let d = queue_rule_placer().decide(&view, &new, &[], 0);
            match &d.verdict {
                Verdict::Queue {
                    retry_after,
                    reason,
                } => {
                    assert_eq!(*retry_after, Duration::from_secs(expect_s));
                    assert!(
                        reason.contains(&format!("waiting about {expect_s} s")),
                        "{reason}"
                    );
                    let said = match q {
                        0 => "no task waits ahead".to_owned(),
                        1 => "1 task waits ahead".to_owned(),
                        n => format!("{n} tasks wait ahead"),
                    };
                    assert!(reason.contains(&said), "{reason}");
                    assert!(
                        d.explanation.summary.contains(&said),
                        "{}",
                        d.explanation.summary
                    );
                }
                other => panic!("{q} ahead: expected queue, got {other:?}"),
            }
        }
        // Three ahead, three devices reporting: no device frees up for this task within
        // a round of the residents' work, so the wait is unknown and the task is placed.
        ahead(&mut view, 3);
        let assessment = queue_rule_placer().assess(&view, &new, &[], 0);
        assert_eq!((assessment.waiting_ahead, assessment.wait_s), (3, None));
        let d = queue_rule_placer().decide(&view, &new, &[], 0);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
        assert!(
            d.explanation.summary.contains("3 tasks wait ahead"),
            "{}",
            d.explanation.summary
        );
        // Tasks submitted after this one, or expired, do not count.
        view.clear_waiting();
        let mut later = spec("later", 4000, 95.0, None);
        later.submitted_at_unix_ms = 9_000;
        view.note_waiting(&later, &[], 0, 600_000, None);
        view.note_waiting(&spec("gone", 4000, 95.0, None), &[], 0, 1_000, None);
        let assessment = queue_rule_placer().assess(&view, &new, &[], 1_000);
        assert_eq!(
            (assessment.waiting_ahead, assessment.wait_s),
            (0, Some(9.0))
        );
        // The wait is over the devices considered only.
        ahead(&mut view, 1);
        let only = ["d0".to_owned(), "d1".to_owned()];
        let assessment = queue_rule_placer().assess(&view, &new, &only, 0);
        assert_eq!(assessment.wait_s, Some(30.0));
    }
}
