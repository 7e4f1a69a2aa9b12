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
    /// (the Kubernetes extender's filter, the simulator's audit) applies it to agree
    /// with the decision.
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
                     device, which would be placed there now (for up to {:?} while it does \
                     not ask again)",
                    self.params.waiter_hold
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
    /// if any may hold it for `task` (see [`may_hold`]); none once `task` itself has
    /// been held back for [`crate::PlacerParams::waiter_hold`].
    ///
    /// The waiter's decision is this policy's own over the devices its request named,
    /// as if it asked now (its room claim included), without the side effects of a
    /// real one (the wait model learns nothing from it) and without holds of its own (a
    /// task further ahead that would take the same device is found first, as the
    /// waiters are tried in submission order). A waiter the device cannot take at all
    /// is passed over after assessing that device alone, so a long queue of tasks that
    /// do not fit costs one device's assessment each, not the whole cluster's; of those
    /// it can take, the first [`crate::PlacerParams::max_waiters_checked`] are worked
    /// out.
    fn held_for(
        &self,
        view: &ClusterView,
        task: &TaskSpec,
        device_id: &str,
        now_unix_ms: i64,
    ) -> Option<String> {
        let hold_ms = i64::try_from(self.params.waiter_hold.as_millis()).unwrap_or(i64::MAX);
        let held_back_since = view
            .waiting_entry(&task.task_id)
            .and_then(|w| w.held_back_since_unix_ms);
        let within = |since: Option<i64>| {
            since.is_none_or(|since| now_unix_ms.saturating_sub(since) < hold_ms)
        };
        if hold_ms == 0 || !within(held_back_since) {
            return None;
        }
        let only_this = [device_id.to_owned()];
        // The waiters are in submission order, so each one's place in the queue is its
        // index: counting it over the queue for every waiter made a decision cost the
        // square of the queue's length.
        view.waiting_ahead(task, now_unix_ms)
            .into_iter()
            .enumerate()
            .filter(|(_, (id, w))| {
                view.device_of(id).is_none()
                    && within(w.held_since_unix_ms)
                    && may_hold(&w.spec, task)
                    && (w.restrict.is_empty() || w.restrict.iter().any(|d| d == device_id))
            })
            .filter(|(ahead, (_, w))| {
                debug_assert_eq!(*ahead, view.waiting_ahead_of(&w.spec, now_unix_ms));
                !self
                    .assess_in_queue(view, &w.spec, &only_this, now_unix_ms, 0, *ahead)
                    .candidates
                    .is_empty()
            })
            .take(match self.params.max_waiters_checked {
                0 => usize::MAX,
                most => most,
            })
            .find(|(ahead, (_, w))| {
                let assessment = self.assess_in_queue(
                    view,
                    &w.spec,
                    &w.restrict,
                    now_unix_ms,
                    self.params.max_scored_devices,
                    *ahead,
                );
                let verdict = self.verdict(&w.spec, &assessment);
                let verdict = self
                    .claimant_verdict(view, &w.spec, &assessment, &verdict, now_unix_ms)
                    .unwrap_or(verdict);
                matches!(verdict, Verdict::Place { device_id: d, .. } if d == device_id)
            })
            .map(|(_, (id, _))| id.to_owned())
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
        view.note_waiting(&first, &[], 3_000, 600_000, None);
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
        placed(&d.verdict);
        assert_eq!(d.held_for, None);
    }

    #[test]
    fn nothing_is_held_when_the_task_ahead_would_not_be_placed_there() {
        let (mut view, first, second) = one_free_device();
        // Waiting for another device: its request was restricted to one.
        view.note_waiting(&first, &["d1".to_owned()], 3_000, 600_000, None);
        placed(&placer().decide(&view, &second, &[], 4_000).verdict);
        // Too large for the card's free memory now that the second one runs there.
        let (mut view, first, _) = one_free_device();
        let resident = spec("resident", 20_000, 60.0, None);
        device(&mut view, "d0", 32_000, &[resident]);
        view.note_waiting(&first, &[], 3_000, 600_000, None);
        let small = TaskSpec {
            submitted_at_unix_ms: 2_000,
            ..spec("small", 4_000, 10.0, None)
        };
        placed(&placer().decide(&view, &small, &[], 4_000).verdict);
        // It would go to another device: an idle one rather than next to a resident.
        let (mut view, first, _) = one_free_device();
        device(&mut view, "d0", 32_000, &[spec("light", 2_000, 50.0, None)]);
        device(&mut view, "d1", 32_000, &[]);
        view.note_waiting(&first, &[], 3_000, 600_000, None);
        let d = placer().decide(&view, &small, &["d0".to_owned()], 4_000);
        assert_eq!(d.held_for, None);
        placed(&d.verdict);
    }

    /// d0 shared with a light resident, d1 idle; first "huge", which fits neither, then
    /// `ahead` small tasks wait that would go to d1 (alone there, not slowed down by the
    /// resident), then "last", kept to d0, which would take d0; "new", submitted after
    /// them all, asks for d0 only.
    fn behind_others_that_go_elsewhere(ahead: usize) -> (ClusterView, TaskSpec) {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        device(&mut view, "d0", 32_000, &[spec("light", 2_000, 50.0, None)]);
        device(&mut view, "d1", 32_000, &[]);
        let small = |id: &str, at: i64| TaskSpec {
            submitted_at_unix_ms: at,
            ..spec(id, 4_000, 60.0, None)
        };
        let huge = TaskSpec {
            submitted_at_unix_ms: 500,
            ..spec("huge", 40_000, 60.0, None)
        };
        view.note_waiting(&huge, &[], 3_000, 600_000, None);
        for k in 0..ahead {
            view.note_waiting(
                &small(&format!("w{k}"), 1_000 + k as i64),
                &[],
                3_000,
                600_000,
                None,
            );
        }
        view.note_waiting(
            &small("last", 2_000),
            &["d0".to_owned()],
            3_000,
            600_000,
            None,
        );
        (view, small("new", 2_500))
    }

    /// The hold works out at most `max_waiters_checked` waiters' own decisions: a
    /// waiter behind that many others that the device could take holds nothing. One the
    /// device cannot take at all ("huge") does not count.
    #[test]
    fn a_decision_works_out_the_first_waiters_that_fit_only() {
        let (view, new) = behind_others_that_go_elsewhere(3);
        let d0 = ["d0".to_owned()];
        let checking = |most| {
            let params = PlacerParams {
                max_waiters_checked: most,
                ..Default::default()
            };
            Placer::new(params, Arc::new(super::super::test_support::TimeShare))
                .expect("valid params")
                .decide(&view, &new, &d0, 4_000)
        };
        for most in [0, 4, PlacerParams::default().max_waiters_checked] {
            assert_eq!(checking(most).held_for.as_deref(), Some("last"), "{most}");
        }
        let d = checking(3);
        assert_eq!(d.held_for, None);
        placed(&d.verdict);
    }

    /// Each waiter's own decision is worked out with its place in the queue (the first
    /// devices to free up are promised to the tasks ahead of it), which the hold takes
    /// from the waiter's position in the queue rather than counting it again: the two
    /// agree, same submission times (ordered by id) and expired entries included.
    #[test]
    fn a_waiters_position_is_its_place_in_the_queue() {
        let (mut view, _) = behind_others_that_go_elsewhere(4);
        let tie = TaskSpec {
            submitted_at_unix_ms: 1_001,
            ..spec("w1-tie", 4_000, 60.0, None)
        };
        view.note_waiting(&tie, &[], 3_000, 600_000, None);
        let gone = TaskSpec {
            submitted_at_unix_ms: 1_002,
            ..spec("gone", 4_000, 60.0, None)
        };
        view.note_waiting(&gone, &[], 3_000, 3_500, None);
        let newest = TaskSpec {
            submitted_at_unix_ms: 9_000,
            ..spec("newest", 4_000, 10.0, None)
        };
        // First of all, one the hold passes over: it waits for d1 only.
        let elsewhere = TaskSpec {
            submitted_at_unix_ms: 500,
            ..spec("elsewhere", 4_000, 10.0, None)
        };
        view.note_waiting(&elsewhere, &["d1".to_owned()], 3_000, 600_000, None);
        let queue = view.waiting_ahead(&newest, 4_000);
        assert_eq!(queue.len(), 8, "{queue:?}");
        for (position, (id, w)) in queue.iter().enumerate() {
            assert_eq!(view.waiting_ahead_of(&w.spec, 4_000), position, "{id}");
        }
        // The hold's own use of the position: checked against the count by a
        // `debug_assert` in `held_for`, so only where tests are built with debug
        // assertions (as `cargo test` builds them).
        let d = placer().decide(&view, &newest, &["d0".to_owned()], 4_000);
        assert_eq!(d.held_for.as_deref(), Some("last"));
    }

    fn hold_ms() -> i64 {
        i64::try_from(PlacerParams::default().waiter_hold.as_millis()).expect("small")
    }

    fn placed(verdict: &Verdict) {
        assert!(matches!(verdict, Verdict::Place { .. }), "{verdict:?}");
    }

    #[test]
    fn a_waiter_that_does_not_come_back_holds_nothing_after_the_hold() {
        let (mut view, first, second) = one_free_device();
        // Another task was held back for "first" at 4 s; "second" was not (yet).
        let other = TaskSpec {
            submitted_at_unix_ms: 2_500,
            ..spec("other", 20_000, 60.0, None)
        };
        view.note_waiting(&other, &[], 4_000, 600_000, Some("first"));
        let end = 4_000 + hold_ms();
        queued_reason(&placer().decide(&view, &second, &[], end - 1).verdict);
        placed(&placer().decide(&view, &second, &[], end).verdict);
        // Asking again (and queueing) starts its hold afresh.
        view.note_waiting(&first, &[], end + 1, 600_000, None);
        queued_reason(&placer().decide(&view, &second, &[], end + 2).verdict);
        // A hold of zero holds nothing.
        let params = PlacerParams {
            waiter_hold: Duration::ZERO,
            ..Default::default()
        };
        let unheld = Placer::new(params, Arc::new(super::super::test_support::TimeShare))
            .expect("valid params");
        placed(&unheld.decide(&view, &second, &[], end + 2).verdict);
    }

    /// Tasks ahead that do not come back cannot hold a task back a hold each: once it
    /// has been held back for the hold, nothing holds it.
    #[test]
    fn a_task_is_held_back_for_one_hold_at_most() {
        let (mut view, _, second) = one_free_device();
        let zeroth = TaskSpec {
            submitted_at_unix_ms: 500,
            ..spec("zeroth", 20_000, 60.0, None)
        };
        view.note_waiting(&zeroth, &[], 3_000, 600_000, None);
        let d = placer().decide(&view, &second, &[], 4_000);
        assert_eq!(d.held_for.as_deref(), Some("zeroth"));
        view.note_waiting(&second, &[], 4_000, 600_000, Some("zeroth"));
        let end = 4_000 + hold_ms();
        let d = placer().decide(&view, &second, &[], end - 1);
        assert_eq!(d.held_for.as_deref(), Some("zeroth"));
        // "zeroth" has not come back and "first" would take the device too: without the
        // limit "second" would now wait a second hold, for "first".
        let d = placer().decide(&view, &second, &[], end);
        assert_eq!(d.held_for, None);
        placed(&d.verdict);
    }

    /// A waiter that is placed already (by another placer sharing the store, whose
    /// placement this view has seen) holds nothing.
    #[test]
    fn a_waiter_placed_meanwhile_holds_nothing() {
        let (mut view, first, second) = one_free_device();
        device(&mut view, "d1", 32_000, &[first]);
        placed(
            &placer()
                .decide(&view, &second, &["d0".to_owned()], 4_000)
                .verdict,
        );
    }

    /// Remembers which tasks the wait model was told were queued.
    #[derive(Debug, Default)]
    struct Recording(std::sync::Mutex<Vec<String>>);

    impl crate::policy::WaitModel for Recording {
        fn wait_s(&self, _: &TaskSpec, residents_done_s: Option<f64>, _: i64) -> Option<f64> {
            residents_done_s
        }
        fn queued(&self, task_id: &str, _: f64, _: i64) {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(task_id.to_owned());
        }
    }

    /// A held task was never weighed against the wait: the wait model does not learn
    /// from it as from a task the queue rule kept waiting.
    #[test]
    fn a_hold_teaches_the_wait_model_nothing() {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        // Two shared devices whose residents report when they finish (10 s and 20 s);
        // the second one's resident is busier, so both light tasks prefer the first.
        for (id, sm, left_s) in [("d0", 40.0, 10u64), ("d1", 90.0, 20)] {
            let resident = format!("r-{id}");
            device(
                &mut view,
                id,
                32_000,
                &[spec(&resident, 4_000, sm, Some(1_000 + 900 * left_s))],
            );
            view.set_report(iadeep_proto::TaskReport {
                task_id: resident,
                samples_done: 1_000,
                samples_per_s: 900.0,
                ..Default::default()
            });
        }
        let light = |id: &str, at: i64, samples: u64| TaskSpec {
            submitted_at_unix_ms: at,
            ..spec(id, 1_000, 20.0, Some(samples))
        };
        let first = light("first", 1_000, 1_000_000);
        view.note_waiting(&first, &["d0".to_owned()], 0, 600_000, None);
        let recording = Arc::new(Recording::default());
        let placer = super::super::test_support::placer().with_wait_model(recording.clone());
        // 10 s of work alone: joining d0, which "first" counts on, delays it by nothing.
        let d = placer.decide(&view, &light("second", 2_000, 3_200), &[], 0);
        assert_eq!(d.held_for.as_deref(), Some("first"), "{:?}", d.verdict);
        let queued = recording
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        assert!(queued.is_empty(), "{queued:?}");
    }

    #[test]
    fn an_opportunistic_waiter_holds_nothing_for_a_production_task() {
        let (view, _, mut second) = one_free_device();
        second.priority_class = PriorityClass::Production as i32;
        placed(&placer().decide(&view, &second, &[], 4_000).verdict);
        // A production waiter holds the device for an opportunistic task like any.
        let (mut view, mut first, second) = one_free_device();
        first.priority_class = PriorityClass::Production as i32;
        view.note_waiting(&first, &[], 3_000, 600_000, None);
        let d = placer().decide(&view, &second, &[], 4_000);
        queued_reason(&d.verdict);
    }
}
