//! Room held for a task waiting ahead (see the module docs of [`crate::policy`]).
//!
//! Why: queued clients ask again when they see room, and the first to ask was
//! placed. On a real GPU (`data/measured/h200/README.md`) the job submitted third
//! waited 87 s while five jobs submitted after it were placed first, each by a
//! request that happened to arrive a moment before its own.

use iadeep_proto::TaskSpec;

use super::{Placer, Verdict};
use crate::view::ClusterView;

impl Placer {
    /// `verdict` for `task`, or, when it places the task on a device a task waiting
    /// ahead would take now, the queue answer that says so with that task's id (see
    /// the module docs of [`crate::policy`]). [`Placer::decide`] applies it; a caller
    /// that builds a verdict itself from [`Placer::assess`] and [`Placer::verdict`]
    /// (the simulator's audit) applies it to agree with the decision.
    pub fn with_holds(
        &self,
        view: &ClusterView,
        task: &TaskSpec,
        verdict: Verdict,
        now_unix_ms: i64,
    ) -> (Verdict, Option<String>) {
        let Verdict::Place { device_id, .. } = &verdict else {
            return (verdict, None);
        };
        match self.held_for(view, task, device_id, now_unix_ms) {
            Some(waiter) => {
                let reason = format!(
                    "{device_id} is held for {waiter}, submitted earlier and waiting for a \
                     device, which would be placed there now (for up to {} s while it does \
                     not ask again)",
                    self.params.waiter_hold.as_secs()
                );
                let held = Verdict::Queue {
                    retry_after: self.params.min_retry_after,
                    reason,
                };
                (held, Some(waiter))
            }
            None => (verdict, None),
        }
    }

    /// The first task waiting ahead of `task` that would be placed on `device_id` now,
    /// if any may hold it for `task` (see [`may_hold`]).
    ///
    /// The waiter's decision is this policy's own over the devices its request named,
    /// as if it asked now, without the side effects of a real one (the wait model
    /// learns nothing from it) and without holds of its own (a task further ahead
    /// that would take the same device is found first, as the waiters are tried in
    /// submission order).
    fn held_for(
        &self,
        view: &ClusterView,
        task: &TaskSpec,
        device_id: &str,
        now_unix_ms: i64,
    ) -> Option<String> {
        let hold_ms = i64::try_from(self.params.waiter_hold.as_millis()).unwrap_or(i64::MAX);
        if hold_ms == 0 {
            return None;
        }
        view.waiting_ahead(task, now_unix_ms)
            .into_iter()
            .filter(|(_, w)| may_hold(&w.spec, task))
            .filter(|(_, w)| {
                w.held_since_unix_ms
                    .is_none_or(|since| now_unix_ms.saturating_sub(since) < hold_ms)
            })
            .find(|(_, w)| {
                let assessment = self.assess_limited(
                    view,
                    &w.spec,
                    &w.restrict,
                    now_unix_ms,
                    self.params.max_scored_devices,
                );
                matches!(self.verdict(&w.spec, &assessment),
                    Verdict::Place { device_id: d, .. } if d == device_id)
            })
            .map(|(id, _)| id.to_owned())
    }
}

/// Whether `waiter` may hold a device for `task`: an opportunistic task never holds
/// one for a production task, which a production job's promise ranks first.
fn may_hold(waiter: &TaskSpec, task: &TaskSpec) -> bool {
    waiter.is_production() || !task.is_production()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use iadeep_proto::PriorityClass;

    use super::super::test_support::{device, placer, spec};
    use super::*;
    use crate::model::ModelledMemory;
    use crate::params::PlacerParams;

    /// One idle 32 GB device; "first" (submitted at 1 s) waits for it, "second" asks.
    fn one_free_device() -> (ClusterView, TaskSpec, TaskSpec) {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "d0", 32_000, &[]);
        let mut first = spec("first", 20_000, 60.0, None);
        first.submitted_at_unix_ms = 1_000;
        let mut second = spec("second", 20_000, 60.0, None);
        second.submitted_at_unix_ms = 2_000;
        view.note_waiting(&first, &[], 3_000, 600_000);
        (view, first, second)
    }

    fn queued_reason(verdict: &Verdict) -> &str {
        match verdict {
            Verdict::Queue { reason, .. } => reason,
            other => panic!("expected queue, got {other:?}"),
        }
    }

    #[test]
    fn a_device_a_task_waiting_ahead_would_take_is_held_for_it() {
        let (view, first, second) = one_free_device();
        let d = placer().decide(&view, &second, &[], 4_000);
        let reason = queued_reason(&d.verdict);
        assert!(reason.contains("d0 is held for first"), "{reason}");
        assert_eq!(d.held_for.as_deref(), Some("first"));
        assert!(
            d.explanation.summary.contains("held for first"),
            "{}",
            d.explanation.summary
        );
        // The waiter itself is placed, and nobody is held for a task behind it.
        let d = placer().decide(&view, &first, &[], 4_000);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
        assert_eq!(d.held_for, None);
    }

    #[test]
    fn nothing_is_held_when_the_task_ahead_would_not_be_placed_there() {
        let (mut view, first, second) = one_free_device();
        // Waiting for a device of its own naming: the request was restricted to it.
        view.note_waiting(&first, &["elsewhere".to_owned()], 3_000, 600_000);
        let d = placer().decide(&view, &second, &[], 4_000);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
        // Too large for the card's free memory now that the second one runs there.
        let (mut view, first, _) = one_free_device();
        let resident = spec("resident", 20_000, 60.0, None);
        device(&mut view, "d0", 32_000, &[resident]);
        view.note_waiting(&first, &[], 3_000, 600_000);
        let small = TaskSpec {
            submitted_at_unix_ms: 2_000,
            ..spec("small", 4_000, 10.0, None)
        };
        let d = placer().decide(&view, &small, &[], 4_000);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
    }

    #[test]
    fn a_waiter_that_does_not_come_back_holds_nothing_after_the_hold() {
        let (mut view, _, second) = one_free_device();
        view.note_hold("first", 4_000);
        let hold = PlacerParams::default().waiter_hold;
        let before = 4_000 + i64::try_from(hold.as_millis()).expect("small") - 1;
        let d = placer().decide(&view, &second, &[], before);
        queued_reason(&d.verdict);
        let d = placer().decide(&view, &second, &[], before + 1);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
        // Asking again (and queueing) starts its hold afresh.
        let first = view
            .waiting()
            .find(|(id, _)| *id == "first")
            .map(|(_, w)| w.spec.clone())
            .expect("still waiting");
        view.note_waiting(&first, &[], before + 2, 600_000);
        let d = placer().decide(&view, &second, &[], before + 3);
        queued_reason(&d.verdict);
        // A hold of zero holds nothing.
        let params = PlacerParams {
            waiter_hold: Duration::ZERO,
            ..Default::default()
        };
        let unheld = Placer::new(params, Arc::new(super::super::test_support::TimeShare))
            .expect("valid params");
        let d = unheld.decide(&view, &second, &[], before + 3);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
    }

    #[test]
    fn an_opportunistic_waiter_holds_nothing_for_a_production_task() {
        let (view, _, mut second) = one_free_device();
        second.priority_class = PriorityClass::Production as i32;
        let d = placer().decide(&view, &second, &[], 4_000);
        assert!(
            matches!(d.verdict, Verdict::Place { .. }),
            "{:?}",
            d.verdict
        );
        // A production waiter holds the device for an opportunistic task like any.
        let (mut view, mut first, second) = one_free_device();
        first.priority_class = PriorityClass::Production as i32;
        view.note_waiting(&first, &[], 3_000, 600_000);
        let d = placer().decide(&view, &second, &[], 4_000);
        queued_reason(&d.verdict);
    }
}
