//! The wait `W` of the queue rule (step 3 of the module docs of [`super`]), corrected
//! by the waits the placer's own queued tasks really had.
//!
//! The order statistic of the devices' idle times (the (q+1)-th device whose residents
//! all finish, from their reported progress) says when the devices *empty if nobody
//! joins them*. Tasks keep joining busy devices while a task waits (later tasks that
//! cost little there, with per-task admission), and a task is placed once waiting no
//! longer looks cheaper, so the real wait is a matter of the whole cluster's traffic,
//! not of the residents' progress alone: in the simulator's audit of K80 seed 1 the
//! order statistic said 1,282 s on average where the tasks really waited 2,480 s
//! (docs/simulator-world.md, "The gap attributed"). [`ObservedWait`] keeps what the
//! placer itself sees, the order statistic of each queue decision and when that task
//! was placed, and scales the order statistic by the ratio of the real waits to it
//! over the recent past, so `W` is the wait this cluster's traffic really gives.
//!
//! The rule asks a [`WaitModel`], so the simulator can give it the true wait instead
//! (`oracle-wait`) through the same code path.
use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;

use iadeep_proto::TaskSpec;

/// Where the queue rule's wait comes from.
pub trait WaitModel: Send + Sync + fmt::Debug {
    /// `W`: seconds `task` would wait for a device if it queued now. `residents_done_s`
    /// is the order statistic (when the (q+1)-th considered device's residents are
    /// predicted to have finished), `None` when fewer devices say when they free up
    /// than tasks wait ahead, in which case `W` is unknown too.
    fn wait_s(
        &self,
        task: &TaskSpec,
        residents_done_s: Option<f64>,
        now_unix_ms: i64,
    ) -> Option<f64>;

    /// The placer told `task_id` to queue, with `residents_done_s` the order statistic
    /// it weighed.
    fn queued(&self, _task_id: &str, _residents_done_s: f64, _now_unix_ms: i64) {}

    /// The placer placed `task_id` (its wait, if it was waiting, is over).
    fn placed(&self, _task_id: &str, _now_unix_ms: i64) {}

    /// `task_id` no longer waits, and its wait says nothing of the traffic: it was
    /// withdrawn (Release), or placed by a decision not over every device.
    fn forget(&self, _task_id: &str) {}
}

/// How many completed waits the correction remembers: each completed task's weight
/// decays by `1 − 1/WAIT_MEMORY_TASKS` with every later one. Fifteen: the waits of a
/// burst change within hours, and with a memory of 50 `W` lagged them (in the
/// simulator's audits it went from a third of the real wait in a burst's first hour to
/// 1.7 times it in the third on the P100, seed 1, and from a quarter to four times over
/// eight hours on the K80, seed 3); the overdue tasks ([`OVERDUE_PROJECTION`]) carry
/// the rest. Chosen on the simulator's K80 seeds 1–5 among 15, 25 and 50
/// (docs/simulator-world.md, "The queue rule's wait").
pub const WAIT_MEMORY_TASKS: f64 = 15.0;

/// What a task still waiting past its prediction is counted as having waited: this many
/// times its wait so far. Its wait is not over, so what it waited so far is only a lower
/// bound, and in a growing queue those are the waits that matter. Why more than once: a
/// wait seen at a random moment of its course is, at the median, half over (Gott's
/// argument), and later than that the longer it has lasted. That is the motivation; the
/// value was chosen with [`WAIT_MEMORY_TASKS`] among 1, 2 and 3 (and 4 for a memory of
/// 15) on the same runs, twice: 2 at first, 3 once the tuner stopped holding devices
/// after a failed start (which let more tasks join busy devices, so their waits grew).
/// Its cost: a task just past its prediction counts as at least three times the
/// prediction, which pushes `W` up under a light load (there the audits over-estimate,
/// by up to +39 %).
pub const OVERDUE_PROJECTION: f64 = 3.0;

/// Completed waits needed before the correction applies: below this, one task's
/// wait would set it.
pub const WAIT_MIN_COMPLETED: u64 = 5;

/// Bounds of the correction: one decade either way of the order statistic, so that
/// a few odd waits early on cannot make `W` meaningless.
pub const WAIT_RATIO_BOUNDS: (f64, f64) = (0.1, 10.0);

/// The production wait: the order statistic scaled by the real waits the placer's
/// queued tasks had against it (see the module docs).
#[derive(Debug, Default)]
pub struct ObservedWait(Mutex<Observed>);

/// Per waiting task: its queue decisions, summed.
#[derive(Clone, Copy, Debug)]
struct Pending {
    decisions: u32,
    /// Σ of the decisions' times, seconds after `first_ms`.
    sum_at_s: f64,
    first_ms: i64,
    last_ms: i64,
    /// Σ of the order statistics the decisions weighed, seconds.
    sum_predicted_s: f64,
}

#[derive(Debug, Default)]
struct Observed {
    pending: HashMap<String, Pending>,
    /// Decayed sums over completed waits: real waits and the order statistics.
    real_s: f64,
    predicted_s: f64,
    completed: u64,
    /// Size of `pending` after its last pruning.
    pruned_len: usize,
    /// When the last pruning ran (Unix ms).
    pruned_at_ms: i64,
}

/// Pending tasks not queued again for this long are forgotten (withdrawn, or placed by
/// another placer): four times the longest retry hint the rule gives.
const PENDING_EXPIRY_MS: i64 = 4 * 600 * 1000;

impl Pending {
    /// Not queued again for [`PENDING_EXPIRY_MS`]: presumably withdrawn or placed by
    /// another placer, so its wait says nothing (and would grow without limit).
    fn expired(&self, now_ms: i64) -> bool {
        now_ms.saturating_sub(self.last_ms) >= PENDING_EXPIRY_MS
    }

    /// Σ over the task's queue decisions of the time waited since each, at `now_ms`.
    fn waited_s(&self, now_ms: i64) -> f64 {
        let now_s = now_ms.saturating_sub(self.first_ms) as f64 / 1000.0;
        (f64::from(self.decisions) * now_s - self.sum_at_s).max(0.0)
    }
}

impl Observed {
    /// Real over predicted waits: the completed ones, and the tasks still waiting that
    /// have already waited longer than predicted. Completed waits alone lag behind a
    /// growing queue (the long waits are the ones not over yet), and a burst of
    /// arrivals is when `W` matters most; a task still waiting past its prediction is
    /// known to have been under-estimated, and is counted with its projected wait
    /// ([`OVERDUE_PROJECTION`]). Tasks still within their prediction say nothing yet, nor
    /// do expired ones (see [`Pending::expired`]).
    fn ratio(&self, now_ms: i64) -> f64 {
        let (mut real, mut predicted) = (self.real_s, self.predicted_s);
        let mut overdue = 0u64;
        for p in self.pending.values().filter(|p| !p.expired(now_ms)) {
            let waited = p.waited_s(now_ms);
            if waited > p.sum_predicted_s {
                real += waited * OVERDUE_PROJECTION;
                predicted += p.sum_predicted_s;
                overdue += 1;
            }
        }
        if self.completed + overdue < WAIT_MIN_COMPLETED || predicted <= 0.0 {
            return 1.0;
        }
        (real / predicted).clamp(WAIT_RATIO_BOUNDS.0, WAIT_RATIO_BOUNDS.1)
    }

    /// Drops tasks not queued again for [`PENDING_EXPIRY_MS`], whenever the map has
    /// doubled since the last pass (so the cost stays linear in the decisions) or an
    /// expiry has passed since it (so a small map does not keep stale tasks either).
    fn prune(&mut self, now_unix_ms: i64) {
        let grown = self.pending.len() > 2 * self.pruned_len + 64;
        let due = now_unix_ms.saturating_sub(self.pruned_at_ms) >= PENDING_EXPIRY_MS;
        if !grown && !due {
            return;
        }
        self.pending.retain(|_, p| !p.expired(now_unix_ms));
        self.pruned_len = self.pending.len();
        self.pruned_at_ms = now_unix_ms;
    }
}

impl ObservedWait {
    fn lock(&self) -> std::sync::MutexGuard<'_, Observed> {
        // Sums only: a panic elsewhere cannot leave them in a state worse than stale.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The factor the order statistic is scaled by at `now_unix_ms` (1 until enough
    /// waits are known).
    pub fn ratio(&self, now_unix_ms: i64) -> f64 {
        self.lock().ratio(now_unix_ms)
    }

    /// Completed waits seen so far.
    pub fn completed(&self) -> u64 {
        self.lock().completed
    }
}

impl WaitModel for ObservedWait {
    fn wait_s(&self, _: &TaskSpec, residents_done_s: Option<f64>, now: i64) -> Option<f64> {
        residents_done_s.map(|r| r * self.ratio(now))
    }

    fn queued(&self, task_id: &str, residents_done_s: f64, now_unix_ms: i64) {
        if !residents_done_s.is_finite() || residents_done_s < 0.0 {
            return;
        }
        let mut observed = self.lock();
        observed.prune(now_unix_ms);
        let p = observed
            .pending
            .entry(task_id.to_owned())
            .or_insert(Pending {
                decisions: 0,
                sum_at_s: 0.0,
                first_ms: now_unix_ms,
                last_ms: now_unix_ms,
                sum_predicted_s: 0.0,
            });
        p.decisions += 1;
        p.sum_at_s += now_unix_ms.saturating_sub(p.first_ms) as f64 / 1000.0;
        p.last_ms = now_unix_ms;
        p.sum_predicted_s += residents_done_s;
    }

    /// Each of the task's queue decisions waited from its time until now.
    fn placed(&self, task_id: &str, now_unix_ms: i64) {
        let mut observed = self.lock();
        let Some(p) = observed.pending.remove(task_id) else {
            return;
        };
        let real = p.waited_s(now_unix_ms);
        let keep = 1.0 - 1.0 / WAIT_MEMORY_TASKS;
        observed.real_s = observed.real_s * keep + real;
        observed.predicted_s = observed.predicted_s * keep + p.sum_predicted_s;
        observed.completed += 1;
    }

    fn forget(&self, task_id: &str) {
        self.lock().pending.remove(task_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: &str) -> TaskSpec {
        TaskSpec {
            task_id: id.into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_order_statistic_is_scaled_by_the_real_waits_once_enough_completed() {
        let w = ObservedWait::default();
        assert_eq!(w.wait_s(&task("x"), Some(100.0), 0), Some(100.0));
        assert_eq!(w.wait_s(&task("x"), None, 0), None);
        // Each task is queued twice (at 0 s and 100 s, predicted 100 s and 50 s) and
        // placed at 300 s: real waits 300 + 200 = 500 s against 150 s predicted.
        for k in 0..WAIT_MIN_COMPLETED {
            let id = format!("t{k}");
            let base = k as i64 * 1_000_000;
            w.queued(&id, 100.0, base);
            w.queued(&id, 50.0, base + 100_000);
            assert_eq!(
                w.ratio(base + 100_000),
                1.0,
                "not enough waits completed yet"
            );
            w.placed(&id, base + 300_000);
        }
        assert_eq!(w.completed(), WAIT_MIN_COMPLETED);
        let expect = 500.0 / 150.0;
        assert!((w.ratio(0) - expect).abs() < 1e-9, "{}", w.ratio(0));
        let scaled = w.wait_s(&task("y"), Some(60.0), 0).expect("a wait");
        assert!((scaled - 60.0 * expect).abs() < 1e-9, "{scaled}");
        // A task placed without waiting, and one never queued, change nothing.
        w.placed("never-queued", 9_000_000);
        assert_eq!(w.completed(), WAIT_MIN_COMPLETED);
    }

    #[test]
    fn recent_waits_outweigh_old_ones_and_the_ratio_is_bounded() {
        let w = ObservedWait::default();
        let mut at = 0i64;
        let mut wait = |w: &ObservedWait, predicted: f64, real_s: i64| {
            w.queued("t", predicted, at);
            w.placed("t", at + real_s * 1000);
            at += 10_000_000;
        };
        for _ in 0..200 {
            wait(&w, 100.0, 200);
        }
        assert!((w.ratio(0) - 2.0).abs() < 1e-9);
        // The traffic changes: waits become half the order statistic.
        for _ in 0..200 {
            wait(&w, 100.0, 50);
        }
        assert!((w.ratio(0) - 0.5).abs() < 0.05, "{}", w.ratio(0));
        for _ in 0..200 {
            wait(&w, 1.0, 1000);
        }
        assert_eq!(w.ratio(0), WAIT_RATIO_BOUNDS.1);
    }

    /// In a burst the long waits are the ones not over yet: tasks still waiting past
    /// their prediction count with their projected wait, those within it do not.
    #[test]
    fn tasks_waiting_past_their_prediction_count_before_they_are_placed() {
        let w = ObservedWait::default();
        for k in 0..WAIT_MIN_COMPLETED {
            w.queued(&format!("t{k}"), 100.0, 0);
        }
        assert_eq!(w.ratio(50_000), 1.0);
        // 300 s waited so far against 100 s predicted, projected to OVERDUE_PROJECTION
        // times that.
        let expect = 3.0 * OVERDUE_PROJECTION;
        assert!(
            (w.ratio(300_000) - expect).abs() < 1e-9,
            "{}",
            w.ratio(300_000)
        );
        let scaled = w.wait_s(&task("new"), Some(10.0), 300_000).expect("a wait");
        assert!((scaled - 10.0 * expect).abs() < 1e-9, "{scaled}");
        // Once placed, a task counts with the wait it really had.
        for k in 0..WAIT_MIN_COMPLETED {
            w.placed(&format!("t{k}"), 300_000);
        }
        assert!(
            (w.ratio(300_000) - 3.0).abs() < 1e-9,
            "{}",
            w.ratio(300_000)
        );
    }

    /// Five tasks that stop asking (withdrawn, placed elsewhere) must not hold the
    /// correction at its bound: past the expiry they no longer count, and a withdrawn
    /// task never again.
    #[test]
    fn expired_and_withdrawn_tasks_do_not_move_the_ratio() {
        let w = ObservedWait::default();
        for k in 0..WAIT_MIN_COMPLETED {
            w.queued(&format!("gone{k}"), 1.0, 0);
        }
        assert_eq!(w.ratio(PENDING_EXPIRY_MS - 1), WAIT_RATIO_BOUNDS.1);
        assert_eq!(w.ratio(PENDING_EXPIRY_MS), 1.0);
        // A later decision prunes them although the map is small.
        w.queued("new", 1.0, PENDING_EXPIRY_MS);
        assert_eq!(w.lock().pending.len(), 1);

        let w = ObservedWait::default();
        for k in 0..WAIT_MIN_COMPLETED {
            w.queued(&format!("t{k}"), 1.0, 0);
        }
        assert_eq!(w.ratio(100_000), WAIT_RATIO_BOUNDS.1);
        w.forget("t0");
        assert_eq!(w.ratio(100_000), 1.0, "a withdrawn task does not count");
        w.placed("t0", 100_000);
        assert_eq!(w.completed(), 0, "nor completes a wait");
    }

    #[test]
    fn tasks_never_placed_are_forgotten() {
        let w = ObservedWait::default();
        for k in 0..200 {
            w.queued(&format!("gone{k}"), 10.0, 0);
        }
        // Much later, new decisions prune the stale ones as the map grows.
        for k in 0..1000 {
            w.queued(&format!("new{k}"), 10.0, PENDING_EXPIRY_MS + 1);
        }
        let observed = w.lock();
        assert!(!observed.pending.contains_key("gone0"));
        assert_eq!(observed.pending.len(), 1000);
    }
}
