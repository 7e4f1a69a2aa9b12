//! The placement decision: a pure function of a [`ClusterView`] and a task.
//!
//! For each device (or each of the devices the caller allows):
//! 1. **Feasibility.** The device must be registered; its residents' footprints
//!    (each at the batch size it is *assigned*, never its smallest allowed one: the
//!    largest of its reservation, its reported peak, its assigner's bound and the
//!    [`MemoryEstimator`](crate::MemoryEstimator)'s bound there, see [`crate::view::Resident::footprint_mib`])
//!    plus the new task's footprint at its submitted batch size, where it starts, must
//!    fit the device's memory less the one memory margin. When they do not, residents
//!    that run above sizes they are known to fit at are shrunk, one candidate size at a
//!    time, the one that frees most first, until the newcomer fits (or it cannot); the
//!    shrinks are written with the placement, before the newcomer starts. The predicted
//!    aggregate SM and DRAM-bandwidth utilisations (sums of the known solo values) must
//!    stay under their caps. An idle device is always a candidate when the task fits the
//!    card at all (nothing shares it, so the margin is not needed).
//!    **Memory of a task nothing is known of** (no request, no profile, no registry
//!    entry): on an idle card it reserves the whole card; on a shared card it is granted
//!    all the free memory, provisionally, when every resident's memory is measured and
//!    at least [`PlacerParams::min_unknown_memory_share`] of the card is free. Its agent
//!    fences its allocator at the grant, so an under-estimate costs that task a step, not
//!    its co-runners their run; its first measured peak settles the reservation
//!    ([`crate::PlacementService::settle_provisional`]). A grant is never made while a
//!    resident's own grant is unmeasured: two guesses on one card could over-pack it.
//!    **Room claims.** A device on which another task holds a live room claim (see
//!    "Room evictions" below) is infeasible, whatever the task's size
//!    ([`Rejection::Claimed`]); the claimant's own claim does not count for it.
//!    **Avoided pairings.** A device where a resident (or a claim's holder) is a task
//!    the newcomer must not share a device with ([`ClusterView::avoids`]: an unexpired
//!    avoid record names the two, in either order, written when one was evicted to
//!    protect the other) is infeasible ([`Rejection::Avoided`]).
//! 2. **Slowdown caps.** A production job promises its owner a PD of at most its cap
//!    (`TaskSpec::slowdown_cap`, 1.10 by default). A shared device is infeasible
//!    ([`Rejection::SlowdownCap`], naming the job, the predicted slowdown and the cap)
//!    when, with the task there, the upper end of the 90 % interval of the predicted
//!    slowdown ([`Prediction::upper_90`]) of any production resident, or of the task
//!    itself if it is production, exceeds that job's cap. At the submitted batch sizes
//!    DT = E = 1, so PD = IF; the upper end, not the point prediction, because the
//!    cap is a promise and the tuner can only shrink the opportunistic co-runners
//!    afterwards. Checked first among the model's rules (before the Σ PD cap and the
//!    throughput guard). Devices where only opportunistic jobs would run are not
//!    affected; an idle device always meets every cap (the task alone: IF 1).
//!
//!    **Score.** The predicted increase of the device's Σ PD if the task joins:
//!    Σ over residents of (predicted IF with the task − predicted IF without it),
//!    plus the new task's own predicted IF. The placer does not change batch sizes,
//!    so at the submitted batch sizes DT = E = 1 and PD = IF; the tuner then
//!    improves on it. An idle device costs exactly 1.0 (the task alone).
//!    **Throughput guard.** A shared device is rejected unless the task joining
//!    raises its predicted combined normalised throughput, Σ 1/IF over its tasks
//!    (each task alone counts 1), by at least
//!    [`PlacerParams::min_throughput_gain`]: if the residents plus the newcomer do
//!    less work per second than the residents alone (plus the margin), running the
//!    task later alone does the same work sooner, however long the queue, so no
//!    queue rule below should place it there.
//!    **Promised devices.** A device among the first `q` predicted to free up (see
//!    step 3) is what a task waiting ahead counts on. Joining it keeps it busy at
//!    least until the newcomer finishes, about its solo duration `D` from now, so
//!    that task waits `delay = max(0, D − R)` longer, `R` being when the device's
//!    residents are predicted to finish. Without this price devices about to free
//!    up were joined before they did, and the real wait ran well above `W` (see
//!    docs/simulator-experiments.md, "Placement audit"). The delay is priced like
//!    the excess below, per second of the newcomer's solo run (`delay / D` added to
//!    the rank), so an unpromised device of similar PD is preferred, and in full in
//!    step 3.
//!    Devices are ranked by `increase + uncertainty_weight × uncertainty + delay / D`;
//!    equal ranks are broken by a hash of (task, device) so that concurrent requests
//!    spread over equally good devices instead of all racing for the first.
//! 3. **Queue or place.** If the best device is not idle, placing costs the excess
//!    `increase₉₀ − 1` units of PD for about the task's solo duration `D`, i.e.
//!    `(increase₉₀ − 1) × D` seconds of solo-speed progress lost across the device's
//!    tasks, plus the `delay` it imposes on a task waiting ahead if the device was
//!    promised to one. `increase₉₀` is the pessimistic increase: each slowdown it
//!    sums at the upper end of the model's 90 % predictive interval
//!    ([`Prediction::upper_90`]). Why pessimistic: a placement holds for the
//!    task's whole run, while `W` comes from measured progress; where the model is
//!    unsure (a model it has never seen, a wide interval) a co-location that merely
//!    looks cheap should not win over a wait that is known. Waiting costs the time `W` until a device frees up *for this task*,
//!    after which it would run alone at PD 1. The `q` tasks waiting ahead of it
//!    (told to queue earlier and submitted before it, see
//!    [`ClusterView::waiting_ahead_of`]) take the first `q` devices that free up, so
//!    `W` is the (q+1)-th smallest predicted idle time (every resident finished, from
//!    their reported progress) among the devices considered that have residents.
//!    That order statistic says when devices empty *if nobody joins them*; tasks keep
//!    joining busy devices meanwhile, and a waiting task is placed as soon as waiting
//!    no longer looks cheaper, so on a busy cluster the real wait is longer (about
//!    twice, in the simulator's audit). `W` is therefore the order statistic scaled by
//!    the ratio of the real waits of the placer's recently queued tasks to the order
//!    statistics their queue decisions weighed ([`ObservedWait`]: the placer's own
//!    decisions and when each queued task was placed, nothing else).
//!    The task queues, with a retry hint of `W`, when `W × wait_cost_factor` is
//!    smaller. `W` is unknown, and the task is placed, when fewer than `q + 1` such
//!    devices have every resident reporting its progress: either nothing says when a
//!    device frees up (as with an empty queue and no reports), or more tasks wait
//!    than devices promise to free up, so waiting would last longer than a whole
//!    round of the residents' work, which no co-location cost is worth predicting
//!    against. Devices that do not report are left out of the order statistic, so
//!    it is what the reporting devices promise. Whatever biases remain (devices that
//!    do not report, tasks ahead that are co-located instead of waiting, tasks that
//!    join) show in the real waits and so in the correction.
//!    When no device can take the task, the queue reason counts the rejections by
//!    kind and names which production job's cap refused which device.
//!
//! **Room held for a task waiting ahead.** Queued clients ask again when they see
//! room, so the first request to arrive after a device frees up is not the task
//! submitted first (on a real GPU one job waited 87 s while five submitted after it
//! were placed, each by a request a moment earlier than its own:
//! `data/measured/h200/README.md`). So when the verdict places the task on a device,
//! the tasks waiting ahead of it are asked, first submitted first, where this policy
//! would place each now (over the devices its own request named, its room claim
//! included, without the side effects of a decision); if one would take the same
//! device, the task queues with the minimum retry hint and a reason naming it
//! ([`Decision::held_for`]). The wait model learns nothing from such an answer: the
//! queue rule did not weigh it. A waiter holds devices only for
//! [`PlacerParams::waiter_hold`] after it was first held while it does not ask again
//! (a client that is gone holds nothing longer), and a task is held back for one such
//! span at most in a row (an ordinary queue answer between two holds starts it
//! afresh), so waiters that do not come back, one after another, cannot keep it
//! waiting a hold each. Each decision that would place asks where the waiters ahead
//! would go: one assessment of the device alone for each, and one of the whole cluster
//! for each that fits it, for the first [`PlacerParams::max_waiters_checked`] (64) of
//! those at most; a waiter behind that many others that fit holds nothing. Without
//! that bound a long queue of tasks that fit but wait by the queue rule makes each such
//! decision cost the queue's length times the cluster's size: 24 ms with 1,000 tasks
//! waiting on 1,000 GPUs (26 ms before each waiter's place in the queue came from its
//! position), 5.2 ms with it (`cargo bench -p iadeep-eval --bench decide`;
//! 82 µs with no queue). An opportunistic waiter never holds a
//! device for a production task, a claimant's own device is never held, and a waiter
//! this view sees placed already (by another placer sharing the store) holds nothing.
//! A waiter that would wait, or go to another device, holds nothing: this is submission
//! order among the tasks that would be placed now, not a strict queue, so a task that
//! fits where a task ahead does not still goes first. The waiting list, and so the
//! hold, is each placer process's own. The Kubernetes extender's filter applies the
//! same hold (every node fails with its reason). Where every waiting task asks in
//! submission order, as in the simulator's engine after a job finishes, the waiters
//! ahead were just told to queue, usually on the same view, so holds are rare there
//! (docs/simulator-world.md says when they happen).
//!
//! **Room evictions.** A production task that no considered device can take (every
//! device assessed, none feasible: memory, caps or anything else) and that has waited
//! [`PlacerParams::room_eviction_patience`] since it was submitted may make room by
//! evicting opportunistic residents of one device ([`Placer::room_eviction`]); before
//! that it queues like any task, its retry hint no later than the end of its patience
//! (an eviction hands the production job's wait to its victims, with their lost work
//! and restart on top). A device
//! qualifies when, without the victims, the task fits its memory (the usable memory
//! less the one margin next to the residents that stay, the whole card when none
//! does) and the utilisation caps, and its own and every staying production
//! resident's predicted slowdown stays under its cap at the upper end of the 90 %
//! interval. Production residents are never victims; opportunistic residents the task
//! must avoid always are (a production one rules the device out); a device another
//! task holds a claim on is not considered. The choice, in order: fewest victims;
//! then least work lost, the victims' summed time since they were placed (all a job
//! without a checkpoint loses, a bound for one with); then the task's least predicted
//! slowdown there (among equal losses, the co-runner that would slow it most goes);
//! then a per-task hash of the device. The verdict is [`Verdict::Evict`]; the caller
//! ([`crate::PlacementService`], or the simulator) then, in one transaction compared
//! on the device's residents record, writes each victim's assignment with `evict` set
//! and a reason naming the task, and a **claim** in the record: the task's footprint
//! held for it until `room_claim_ttl` ([`PlacerParams::room_claim_ttl`], 60 s) from
//! now. The task is answered "queued" with a short retry hint
//! ([`PlacerParams::min_retry_after`]). Memory safety first: the victims' reservations
//! count until their `iadeep run` (or the reaper) releases them, so the retry is told
//! to wait for them while any is resident (never a second eviction); once they are
//! gone, the claimed device is a candidate and the task is placed there whatever the
//! queue rule says (the victims left for it), which spends the claim. A claimant that
//! never comes back holds nothing after the claim expires.
//!
//! **A claimed device takes nobody else** until the claimant is placed or the claim
//! expires ([`Rejection::Claimed`]), not even a task that would fit beside the claimed
//! memory. Holding only the memory was not enough: the eviction plan promised the
//! claimant its cap next to the residents that stay, and a newcomer joining the rest
//! of the card broke that promise, so the claimant, on its retry, found its cap (or a
//! staying production resident's) exceeded and evicted again elsewhere. In the
//! simulator (K80 and P100, seeds 1–5, half the jobs production) that churn made
//! 320–430 room evictions per run, one production job making room about 20 times
//! before it ran (docs/simulator-experiments.md, "Priority classes"). A cap-aware
//! rule (admit a newcomer when the claimant's predicted slowdown with it and the
//! residents, and the newcomer's own next to the claimant, stay under their caps)
//! would keep more of the card busy, but it needs the claimant's profile, which the
//! claim does not carry (a claim is its id, its memory and its expiry; the waiting
//! list that knows its spec is each placer's own), and it would stack a second
//! prediction's error on the promise the eviction made. The whole device is the
//! rule: its cost is the rest of the card left unused while the victims leave and
//! the claimant retries (a few seconds; at most `room_claim_ttl`).
use std::sync::Arc;
use std::time::Duration;

use iadeep_proto::{Explanation, TaskSpec};

use crate::error::Result;
use crate::params::PlacerParams;
use crate::view::ClusterView;
use iadeep_predictor::{Prediction, SlowdownModel};

pub mod evict;
mod explain;
mod feasibility;
mod hold;
mod room;
mod score;
mod shrink;
#[cfg(test)]
mod test_support;
mod verdict;
mod wait;

pub use explain::cap_refusals;
pub use room::{RoomPlan, claim_holds};
pub use wait::{ObservedWait, WaitModel};

/// Why a device cannot take the task.
#[derive(Clone, Debug, PartialEq)]
pub enum Rejection {
    /// The caller named a device the placer does not know.
    UnknownDevice,
    /// The device is not registered (its tuner is gone); it takes no new task.
    NotRegistered,
    /// Nothing is known about the task's memory and a resident's memory is not measured
    /// yet either: granting the newcomer the free memory could stack two guesses. The
    /// resident's first report settles it, seconds after it starts.
    UnknownTaskMemory,
    /// Not enough memory: the task needs `need_mib`, `free_mib` are left of the usable memory.
    Memory { need_mib: u64, free_mib: u64 },
    /// The task needs more than the whole card at the batch size it starts at:
    /// waiting cannot help (see [`Placer::never_fits`]).
    TooLarge { need_mib: u64, usable_mib: u64 },
    /// Predicted aggregate SM utilisation over the cap.
    SmCap { predicted_pct: f64, cap_pct: f64 },
    /// Predicted aggregate DRAM-bandwidth utilisation over the cap.
    MemBwCap { predicted_pct: f64, cap_pct: f64 },
    /// Predicted Σ PD increase over [`PlacerParams::max_pd_increase`].
    PdCap { predicted: f64, cap: f64 },
    /// Joining would not raise the device's predicted combined normalised throughput
    /// (Σ 1/IF over its tasks) by [`PlacerParams::min_throughput_gain`]: running the
    /// task later alone does the same work sooner.
    ThroughputGain {
        before: f64,
        after: f64,
        min_gain: f64,
    },
    /// With the task there, the upper end of the 90 % interval of the predicted
    /// slowdown of production job `task_id` (a resident, or the task itself when
    /// `newcomer`) would exceed that job's cap (`TaskSpec::slowdown_cap`).
    SlowdownCap {
        task_id: String,
        newcomer: bool,
        predicted_upper: f64,
        cap: f64,
    },
    /// The task must not share the device with `task_id` (a resident, or the holder of
    /// a room claim there): an eviction separated the two ([`ClusterView::avoids`]).
    Avoided { task_id: String },
    /// Production task `task_id` holds a room claim of `claimed_mib` on the device until
    /// `until_unix_ms`: its room eviction is under way, and nobody else joins the
    /// device until it is placed or the claim expires (see the module docs).
    Claimed {
        task_id: String,
        claimed_mib: u64,
        until_unix_ms: i64,
    },
}

impl Rejection {
    /// A short stable name, for counting rejections and for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Rejection::UnknownDevice => "unknown_device",
            Rejection::NotRegistered => "not_registered",
            Rejection::UnknownTaskMemory => "unknown_task_memory",
            Rejection::Memory { .. } => "memory",
            Rejection::TooLarge { .. } => "too_large",
            Rejection::SmCap { .. } => "sm_cap",
            Rejection::MemBwCap { .. } => "mem_bw_cap",
            Rejection::PdCap { .. } => "pd_cap",
            Rejection::ThroughputGain { .. } => "throughput_gain",
            Rejection::SlowdownCap { .. } => "slowdown_cap",
            Rejection::Avoided { .. } => "avoided_pairing",
            Rejection::Claimed { .. } => "claimed",
        }
    }
}

/// A device that can take the task, and what it would cost.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate<'v> {
    pub device_id: &'v str,
    /// Predicted increase of the device's Σ PD.
    pub pd_increase: f64,
    /// The same increase with every slowdown of the newcomer and of the residents
    /// next to it at the upper end of its 90 % interval (see the module docs).
    pub pd_increase_upper_90: f64,
    /// Uncertainty of that prediction (root of the summed squared model uncertainties).
    pub uncertainty: f64,
    /// What the ranking sorts by: `pd_increase + uncertainty_weight × uncertainty`.
    pub rank: f64,
    /// MiB to reserve for the task on this device.
    pub reserved_mem_mib: u64,
    /// Residents to shrink, before the task starts, to make room for it.
    pub shrinks: Vec<Shrink>,
    /// The device has no resident.
    pub idle: bool,
    /// The task's own predicted slowdown there (exactly 1 on an idle device), which the
    /// tuner uses to estimate its solo step time until it runs alone.
    pub newcomer: Prediction,
    /// The reservation is provisional: nothing was known of the task's memory, so it is
    /// granted the device's free memory until it reports its peak.
    pub provisional: bool,
    /// Seconds a task waiting ahead, promised this device, would wait longer if the
    /// task joined it (see the module docs); 0 when no waiting task counts on it.
    pub delay_s: f64,
    tiebreak: u64,
}

/// A resident shrunk to make room for a newcomer: written as its assignment in the
/// placement's transaction, applied by its agent before the newcomer's first step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shrink {
    pub task_id: String,
    pub batch_size: u32,
    /// The memory estimator's bound at that size, MiB (the resident's new reservation).
    pub bound_mib: u64,
}

/// Every device considered for one task, split into candidates and rejections.
#[derive(Clone, Debug, Default)]
pub struct Assessment<'v> {
    /// Feasible devices: the first `explain_top_k` (at least one) are the best, in
    /// order; the rest are in no particular order.
    pub candidates: Vec<Candidate<'v>>,
    /// Infeasible devices with the reason, in device order.
    pub rejected: Vec<(&'v str, Rejection)>,
    /// Feasible shared devices not scored because of the pre-screening limit.
    pub unscored: usize,
    /// Seconds until the first considered device is predicted to be idle (all its
    /// residents finished), from the residents' reported progress.
    pub earliest_idle_s: Option<f64>,
    /// Tasks waiting ahead of this one (see [`ClusterView::waiting_ahead_of`]).
    pub waiting_ahead: usize,
    /// Seconds until the (`waiting_ahead` + 1)-th considered device is predicted to be
    /// idle, from its residents' reported progress: the order statistic `W` starts
    /// from (see the module docs). `None` when fewer devices say when they free up.
    pub residents_done_s: Option<f64>,
    /// The wait `W` of the queue-or-place rule: `residents_done_s` as the placer's
    /// [`WaitModel`] corrects it for the tasks that join busy devices meanwhile.
    pub wait_s: Option<f64>,
}

/// What to tell the caller.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Run the task on `device_id`, reserving `reserved_mem_mib`, after shrinking the
    /// residents in `shrinks`.
    Place {
        device_id: String,
        reserved_mem_mib: u64,
        shrinks: Vec<Shrink>,
        /// The task's own predicted slowdown there (see [`Candidate::newcomer`]).
        newcomer: Prediction,
        /// `reserved_mem_mib` is a provisional grant (see [`Candidate::provisional`]).
        provisional: bool,
    },
    /// Ask again after `retry_after`.
    Queue {
        retry_after: Duration,
        reason: String,
    },
    /// A room eviction (see the module docs): the production task fits no device
    /// under the caps, but would fit `device_id` without the opportunistic residents
    /// `victims`. Write their evict assignments and hold `claim_mib` there for the task
    /// until `claim_until_unix_ms` (one transaction), and tell the task to ask again
    /// after `retry_after`: it is placed once the victims have released their
    /// reservations (until then their memory still counts).
    Evict {
        device_id: String,
        victims: Vec<String>,
        claim_mib: u64,
        claim_until_unix_ms: i64,
        retry_after: Duration,
        reason: String,
    },
}

/// A verdict with its explanation.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub verdict: Verdict,
    pub explanation: Explanation,
    /// Devices refused because a production job's slowdown cap would be exceeded
    /// there ([`Rejection::SlowdownCap`]), for `iadeep_placer_cap_refusals_total`.
    pub cap_refusals: usize,
    /// The task waiting ahead the chosen device is held for, when the task was told to
    /// queue for that reason: the caller records the hold with the queue answer
    /// ([`ClusterView::note_waiting`]), so a waiter that does not come back holds nothing
    /// after [`PlacerParams::waiter_hold`], and the task is not held back longer.
    pub held_for: Option<String>,
}

/// The placement policy. Cheap to share: decisions take `&self`.
///
/// Memory footprints come from the view's [`crate::model::MemoryEstimator`]
/// (see [`ClusterView::new`]), slowdowns from the placer's [`SlowdownModel`].
#[derive(Clone, Debug)]
pub struct Placer {
    params: PlacerParams,
    slowdown: Arc<dyn SlowdownModel>,
    /// Where `W` comes from: [`ObservedWait`] unless replaced ([`Placer::with_wait_model`]).
    wait: Arc<dyn WaitModel>,
}

impl Placer {
    /// A policy with checked `params`.
    pub fn new(params: PlacerParams, slowdown: Arc<dyn SlowdownModel>) -> Result<Placer> {
        params.check()?;
        Ok(Placer {
            params,
            slowdown,
            wait: Arc::new(ObservedWait::default()),
        })
    }

    /// The same policy with `W` from `wait` (the simulator's `oracle-wait` gives it the
    /// true wait; everything else stays the production rule).
    pub fn with_wait_model(mut self, wait: Arc<dyn WaitModel>) -> Placer {
        self.wait = wait;
        self
    }

    /// The model `W` comes from.
    pub fn wait_model(&self) -> &Arc<dyn WaitModel> {
        &self.wait
    }

    /// The parameters in force.
    pub fn params(&self) -> &PlacerParams {
        &self.params
    }

    /// The slowdown model (the daemon feeds it samples).
    pub fn slowdown_model(&self) -> &Arc<dyn SlowdownModel> {
        &self.slowdown
    }

    /// Assesses every device of `view` (or only those in `restrict`, when not empty)
    /// for `task`, predicting the degradation of every feasible device.
    pub fn assess<'v>(
        &self,
        view: &'v ClusterView,
        task: &TaskSpec,
        restrict: &'v [String],
        now_unix_ms: i64,
    ) -> Assessment<'v> {
        self.assess_limited(view, task, restrict, now_unix_ms, 0)
    }

    /// Decides where `task` goes (among `restrict`, when not empty), or that it waits.
    pub fn decide(
        &self,
        view: &ClusterView,
        task: &TaskSpec,
        restrict: &[String],
        now_unix_ms: i64,
    ) -> Decision {
        let assessment = self.assess_limited(
            view,
            task,
            restrict,
            now_unix_ms,
            self.params.max_scored_devices,
        );
        let verdict = self.verdict(task, &assessment);
        // A task holding a room claim is placed there, or waits for its victims; a
        // production task that fits no device under the caps (every considered device
        // was assessed and none took it) may make room by evicting.
        let claimed = self.claimant_verdict(view, task, &assessment, &verdict, now_unix_ms);
        let holds_claim = claimed.is_some();
        let verdict = match claimed {
            Some(claimed) => claimed,
            None if matches!(verdict, Verdict::Queue { .. })
                && task.is_production()
                && assessment.candidates.is_empty()
                && assessment.unscored == 0 =>
            {
                match self.patience_left(task, now_unix_ms) {
                    Some(left) => self.patient_verdict(verdict, left),
                    None => match self.room_eviction(view, task, restrict, now_unix_ms) {
                        Some(plan) => self.evict_verdict(task, &plan, &assessment, now_unix_ms),
                        None => verdict,
                    },
                }
            }
            None => verdict,
        };
        // A device a task waiting ahead would take now is held for it (the claimant's
        // own device excepted: its victims left for it).
        let (verdict, held_for) = if holds_claim {
            (verdict, None)
        } else {
            self.with_holds(view, task, verdict, now_unix_ms)
        };
        let explanation = self.explain(&assessment, &verdict);
        // What the wait model learns from: the queue decisions where `W` was weighed
        // against a device the task could join (where it decides), over every device (a
        // decision restricted to some devices is not a task waiting for a device).
        // A held task was not weighed against `W` (the rule would have placed it): its
        // few seconds behind the task ahead are not a wait the model should learn from.
        if restrict.is_empty() && held_for.is_none() {
            match (&verdict, assessment.residents_done_s) {
                (Verdict::Queue { .. }, Some(r)) if !assessment.candidates.is_empty() => {
                    self.wait.queued(&task.task_id, r, now_unix_ms)
                }
                (Verdict::Place { .. }, _) => self.wait.placed(&task.task_id, now_unix_ms),
                (Verdict::Queue { .. } | Verdict::Evict { .. }, _) => {}
            }
        } else if matches!(verdict, Verdict::Place { .. }) {
            // Its wait, if it waited, ends by a decision that was not over every device.
            self.wait.forget(&task.task_id);
        }
        Decision {
            verdict,
            explanation,
            cap_refusals: cap_refusals(&assessment.rejected),
            held_for,
        }
    }

    /// The task's solo duration `D` (see the module docs), or the assumed one when
    /// its spec does not say how much work it has.
    pub fn expected_duration_s(&self, task: &TaskSpec) -> f64 {
        solo_duration_s(task).unwrap_or(self.params.assumed_task_duration.as_secs_f64())
    }
}

/// Solo run time of the whole task: total samples × solo step time ÷ batch size.
pub fn solo_duration_s(task: &TaskSpec) -> Option<f64> {
    let total = task.total_samples? as f64;
    let profile = task.profile.as_ref()?;
    let step = profile.step_time_s?;
    let batch = if profile.batch_size > 0 {
        profile.batch_size
    } else {
        task.initial_batch_size
    };
    (batch > 0 && step.is_finite() && step > 0.0).then(|| total * step / f64::from(batch))
}
