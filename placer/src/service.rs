//! Place, release and list over a live store: the policy plus the reservation
//! protocol, shared by the gRPC service and the Kubernetes extender.
//!
//! A placement is decided on the in-memory view, then made real by one store
//! transaction that compares the chosen device's residents record with the
//! revision the decision was based on, and each resident's assignment with the one
//! the decision counted it at (a tuner growing a resident meanwhile must not be
//! over-packed), and, iff all still match, writes the new record, the task's
//! placement, its spec and its starting assignment, and the assignments of any
//! residents shrunk to make room for it (their agents apply them before the
//! newcomer's first step, which waits for the placement): one durable commit per
//! decision, and never a reservation without its placement. The assignments of one
//! placement share a round above every round the device's residents have seen, so
//! agents take them and the device's tuner continues above them. If another placement got
//! there first the comparison fails, nothing is written, and the transaction
//! returns the record as it is now; the view takes it and the task is decided
//! again, at most `max_reserve_attempts` times. Because every admission goes
//! through that comparison, no interleaving of requests (in this process or in
//! another placer) can admit more than the record said fits. A Release is
//! likewise one transaction: the record without the task (or its deletion),
//! the placement's deletion and the release marker from which the task's other keys
//! are deleted after their retention (see [`crate::retention`]). Concurrent Places
//! and Releases on different devices send their transactions together, as one
//! ([`crate::group_commit`]), each still committing iff its own comparisons hold.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use iadeep_proto::{
    BatchSizeAssignment, Claim, DeviceInfo, DeviceResidents, DeviceStatus, Explanation,
    LrScalingRule, Placement, QueueDecision, Reservation, TaskSpec, place_response,
};
use iadeep_state::{Expect, StateStore, Txn, TxnOutcome, keys, typed};
use prost::Message;

use crate::error::{PlacerError, Result};
use crate::events::{EvictionTrigger, NoEvents, PlacementEvent, PlacementEvents};
use crate::group_commit::GroupCommit;
use crate::policy::{Decision, Placer, Verdict, claim_holds};
use crate::validate;
use crate::view::ClusterView;
use iadeep_predictor::Prediction;

/// The outcome of a Place, as both front ends report it.
#[derive(Clone, Debug, PartialEq)]
pub struct PlaceOutcome {
    pub decision: place_response::Decision,
    pub explanation: Explanation,
    /// The assignments this placement wrote: the task's starting one first, then those of
    /// residents shrunk to make room (empty when queued or already placed).
    pub assignments: Vec<BatchSizeAssignment>,
}

/// A placement to commit: the device's new record and what else the transaction writes.
struct Plan {
    device_id: String,
    record: DeviceResidents,
    reservation: Reservation,
    expect: Expect,
    /// Each resident's assignment key and what the decision saw there.
    assignment_compares: Vec<(String, Expect)>,
    assignments: Vec<BatchSizeAssignment>,
}

impl Plan {
    /// The transaction that makes the plan real for `task`, placed as `placement`.
    ///
    /// The reservation, the placement, the spec and the assignments in one durable
    /// commit: all or none, at the cost of one. The placement must not exist yet:
    /// two requests for the same task decided at once (on two devices, or by two
    /// placer processes sharing the store) must not both reserve.
    fn txn(&self, task: &TaskSpec, placement: &Placement) -> Txn {
        let key = keys::device_residents(&self.device_id);
        let placement_key = keys::task_placement(&task.task_id);
        let mut txn = Txn::new()
            .compare(key.as_str(), self.expect)
            .compare(placement_key.as_str(), Expect::Absent);
        for (assignment_key, expect) in &self.assignment_compares {
            txn = txn.compare(assignment_key.as_str(), *expect);
        }
        txn = txn
            .put(key.as_str(), self.record.encode_to_vec(), None)
            .put(placement_key.as_str(), placement.encode_to_vec(), None)
            .put(keys::task_spec(&task.task_id), task.encode_to_vec(), None)
            // A re-used id: the keys are the new task's now, not a released one's.
            .delete(keys::task_released(&task.task_id))
            .delete(keys::archived_spec(&task.task_id))
            .delete(keys::archived_report(&task.task_id))
            .delete(keys::archived_assignment(&task.task_id));
        for a in &self.assignments {
            txn = txn.put(keys::task_assignment(&a.task_id), a.encode_to_vec(), None);
        }
        txn
    }
}

/// The copy of `task` its reservation carries: what the device's tuner and the placer's
/// view read from a residents record, and nothing more.
///
/// Why: the record holds every resident of the device and is rewritten with each
/// placement and release there, compared by each, and sent to the device's tuner on
/// every change, so each byte of it is paid many times; the task's whole spec is kept
/// once at its `spec` key. Of the allowed batch sizes, the tuner and the placer's shrink
/// only ever use the task's [`iadeep_tuner::candidate_sizes`] (at most
/// `MAX_CANDIDATES`, around the initial size), so the copy lists those, from which the
/// same candidates follow; the submission time orders waiting tasks only.
pub(crate) fn resident_spec(task: &TaskSpec) -> TaskSpec {
    let allowed_batch_sizes = if task.allowed_batch_sizes.is_empty() {
        Vec::new()
    } else {
        iadeep_tuner::candidate_sizes(task)
    };
    TaskSpec {
        task_id: task.task_id.clone(),
        model: task.model.clone(),
        profile: task.profile.clone(),
        allowed_batch_sizes,
        submitted_at_unix_ms: 0,
        kubernetes_pod: task.kubernetes_pod.clone(),
        ..*task
    }
}

/// The round a placer-written assignment on a device takes: one above every round its
/// residents' assignments have seen, so every agent applies it.
pub(crate) fn next_round(residents: &[crate::view::Resident]) -> u64 {
    residents
        .iter()
        .filter_map(|r| r.assignment.as_ref().map(|(a, _)| a.round))
        .max()
        .unwrap_or(0)
        + 1
}

/// The starting assignment of a newcomer and the shrinks of residents, in one round above
/// every round the device's residents have seen.
fn placement_assignments(
    device: Option<&crate::view::DeviceState>,
    task: &TaskSpec,
    reserved_mem_mib: u64,
    newcomer: Prediction,
    shrinks: &[crate::policy::Shrink],
    now_unix_ms: i64,
) -> Vec<BatchSizeAssignment> {
    let residents = device.map(|d| d.residents.as_slice()).unwrap_or_default();
    let round = next_round(residents);
    let m0 = task.initial_batch_size.max(1);
    let mut out = vec![BatchSizeAssignment {
        task_id: task.task_id.clone(),
        batch_size: m0,
        lr_factor: 1.0,
        lr_rule: task.lr_rule,
        round,
        assigned_at_unix_ms: now_unix_ms,
        memory_bound_mib: Some(reserved_mem_mib as f64),
        predicted_slowdown: Some(newcomer.slowdown),
        predicted_slowdown_upper_90: Some(newcomer.upper_90.max(newcomer.slowdown)),
        evict: false,
        evict_reason: String::new(),
        evicted_by: String::new(),
    }];
    for shrink in shrinks {
        let Some(r) = residents
            .iter()
            .find(|r| r.reservation.task_id == shrink.task_id)
        else {
            continue;
        };
        let spec = r.spec();
        let rule = LrScalingRule::try_from(spec.lr_rule).unwrap_or(LrScalingRule::Unspecified);
        let phi = r
            .report
            .as_ref()
            .and_then(|rep| rep.grad_noise_scale)
            .filter(|p| p.is_finite() && *p >= 0.0);
        out.push(BatchSizeAssignment {
            task_id: shrink.task_id.clone(),
            batch_size: shrink.batch_size,
            lr_factor: iadeep_objective::lr_factor(
                rule,
                spec.initial_batch_size,
                shrink.batch_size,
                phi,
            ),
            lr_rule: spec.lr_rule,
            round,
            assigned_at_unix_ms: now_unix_ms,
            memory_bound_mib: Some(shrink.bound_mib as f64),
            ..BatchSizeAssignment::default()
        });
    }
    out
}

/// What one decision asks of a Place.
enum Step {
    /// The task holds a placement already: answer it.
    Answer(PlaceOutcome),
    /// Commit this placement, or this room eviction.
    Commit(Explanation, Work),
    /// Tell the caller to ask again after this long, and why; with the task waiting
    /// ahead a device was held for, when that is why.
    Queue(Explanation, Duration, String, Option<String>),
}

/// A queue answer on its way to the caller.
struct Queued {
    retry_after: Duration,
    reason: String,
    explanation: Explanation,
    /// The task waiting ahead a device was held for, when that is why.
    held_for: Option<String>,
}

/// What a Place commits on one device.
enum Work {
    Place(Box<Plan>),
    Evict(Box<EvictPlan>),
}

impl Work {
    fn device_id(&self) -> &str {
        match self {
            Work::Place(p) => &p.device_id,
            Work::Evict(e) => &e.device_id,
        }
    }

    /// The residents record's revision the decision saw.
    fn expect(&self) -> Expect {
        match self {
            Work::Place(p) => p.expect,
            Work::Evict(e) => e.expect,
        }
    }
}

/// A room eviction to commit (see [`crate::policy`], "Room evictions"): the device's
/// record with the production task's claim, and the victims' evict assignments.
struct EvictPlan {
    device_id: String,
    record: DeviceResidents,
    expect: Expect,
    /// Each victim's assignment key and what the decision saw there.
    assignment_compares: Vec<(String, Expect)>,
    /// The victims' assignments, evict set.
    assignments: Vec<BatchSizeAssignment>,
    retry_after: Duration,
    reason: String,
}

impl EvictPlan {
    /// One transaction: the residents record is as the decision saw it, the task holds
    /// no placement (one made meanwhile needs no room), and each victim's assignment is
    /// as the decision saw it (a tuner's newer one is repeated, not overwritten); then
    /// the record with the claim and the victims' evict assignments. The victims'
    /// reservations stay: their memory counts until they release it.
    fn txn(&self, task: &TaskSpec) -> Txn {
        let key = keys::device_residents(&self.device_id);
        let mut txn = Txn::new()
            .compare(key.as_str(), self.expect)
            .compare(keys::task_placement(&task.task_id), Expect::Absent);
        for (assignment_key, expect) in &self.assignment_compares {
            txn = txn.compare(assignment_key.as_str(), *expect);
        }
        txn = txn.put(key.as_str(), self.record.encode_to_vec(), None);
        for a in &self.assignments {
            txn = txn.put(keys::task_assignment(&a.task_id), a.encode_to_vec(), None);
        }
        txn
    }
}

/// The evict assignment of `device`'s resident `task_id` (see [`BatchSizeAssignment`]'s
/// `evict`): its last assignment (batch size and learning rate repeated) with `evict`
/// set, `reason`, and the next round of the device, with what its key held; a fresh
/// one at the size it runs at when it has none. `None` when it is not resident there.
pub(crate) fn evict_assignment(
    device: &crate::view::DeviceState,
    task_id: &str,
    reason: &str,
    by: &str,
    now_unix_ms: i64,
) -> Option<(BatchSizeAssignment, Expect)> {
    let resident = device
        .residents
        .iter()
        .find(|r| r.reservation.task_id == task_id)?;
    let (mut assignment, expect) = match &resident.assignment {
        Some((a, rev)) => (a.clone(), Expect::ModRevision(*rev)),
        None => (
            BatchSizeAssignment {
                task_id: task_id.to_owned(),
                batch_size: resident.batch_size(),
                lr_factor: 1.0,
                lr_rule: resident.spec().lr_rule,
                ..BatchSizeAssignment::default()
            },
            Expect::Absent,
        ),
    };
    assignment.task_id = task_id.to_owned();
    assignment.round = next_round(&device.residents);
    assignment.assigned_at_unix_ms = now_unix_ms;
    assignment.evict = true;
    assignment.evict_reason = reason.to_owned();
    assignment.evicted_by = by.to_owned();
    Some((assignment, expect))
}

/// `device`'s residents record as the view holds it (an empty one for a device without
/// one), with each resident in `shrinks` reserved at its bound at the new size.
fn shrunk_record(
    device: Option<&crate::view::DeviceState>,
    device_id: &str,
    shrinks: &[crate::policy::Shrink],
) -> DeviceResidents {
    let mut record = device
        .map(|d| d.residents_record(device_id))
        .unwrap_or_else(|| DeviceResidents {
            device_id: device_id.to_owned(),
            reservations: Vec::new(),
            ..Default::default()
        });
    // A shrunk resident is reserved at its bound at the new size.
    for shrink in shrinks {
        if let Some(r) = record
            .reservations
            .iter_mut()
            .find(|r| r.task_id == shrink.task_id)
        {
            r.reserved_mem_mib = shrink.bound_mib;
        }
    }
    record
}

/// What a Place's lost transaction compared, for [`PlacementService::lost_commit`].
struct LostCommit<'a> {
    device_id: &'a str,
    expect: Expect,
    assignment_compares: &'a [(String, Expect)],
    attempt: u32,
    /// Since when the device changed, for the log ("the decision", ...).
    what: &'static str,
}

/// Each resident's assignment key and what the decision saw there, for the placement's
/// transaction to compare: a tuner growing a resident meanwhile must not be over-packed.
fn assignment_compares(device: Option<&crate::view::DeviceState>) -> Vec<(String, Expect)> {
    device
        .map(|d| {
            d.residents
                .iter()
                .map(|r| {
                    let expect = match &r.assignment {
                        Some((_, rev)) => Expect::ModRevision(*rev),
                        None => Expect::Absent,
                    };
                    (keys::task_assignment(&r.reservation.task_id), expect)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// One device's provisional reservations to settle: its new residents record, the
/// revision the record was read at, and the settled tasks' new assignments with what
/// their keys held.
type Settlement = (
    String,
    DeviceResidents,
    Expect,
    Vec<(BatchSizeAssignment, Expect)>,
);

/// The settlement of `device`'s provisional reservations whose tasks have reported
/// their peak, or `None` when there is none (or the view has no revision of its
/// record to compare).
fn settlement(id: &str, device: &crate::view::DeviceState, now: i64) -> Option<Settlement> {
    let settled: Vec<(&crate::view::Resident, u64)> = device
        .residents
        .iter()
        .filter_map(|r| Some((r, r.settled_reservation_mib()?)))
        .collect();
    let revision = device.residents_revision?;
    if settled.is_empty() {
        return None;
    }
    let mut record = device.residents_record(id);
    let round = next_round(&device.residents);
    let mut assignments = Vec::with_capacity(settled.len());
    for (resident, mib) in settled {
        let task_id = &resident.reservation.task_id;
        if let Some(r) = record
            .reservations
            .iter_mut()
            .find(|r| r.task_id == *task_id)
        {
            r.reserved_mem_mib = mib;
            r.provisional = false;
        }
        let (mut assignment, expect) = match &resident.assignment {
            Some((a, rev)) => (a.clone(), Expect::ModRevision(*rev)),
            None => (
                BatchSizeAssignment {
                    task_id: task_id.clone(),
                    batch_size: resident.batch_size(),
                    lr_factor: 1.0,
                    lr_rule: resident.spec().lr_rule,
                    ..BatchSizeAssignment::default()
                },
                Expect::Absent,
            ),
        };
        assignment.round = round;
        assignment.assigned_at_unix_ms = now;
        assignment.memory_bound_mib = Some(mib as f64);
        assignments.push((assignment, expect));
    }
    Some((
        id.to_owned(),
        record,
        Expect::ModRevision(revision),
        assignments,
    ))
}

/// The transaction that settles a device: compares its residents record and the
/// settled tasks' assignments, and writes the record, the assignments and the
/// placements with the settled reservations.
fn settlement_txn(
    device_id: &str,
    record: &DeviceResidents,
    expect: Expect,
    assignments: &[(BatchSizeAssignment, Expect)],
) -> Txn {
    let key = keys::device_residents(device_id);
    let mut txn = Txn::new().compare(key.as_str(), expect);
    for (a, expect) in assignments {
        txn = txn.compare(keys::task_assignment(&a.task_id), *expect);
    }
    txn = txn.put(key.as_str(), record.encode_to_vec(), None);
    for (a, _) in assignments {
        txn = txn.put(keys::task_assignment(&a.task_id), a.encode_to_vec(), None);
        // The placement says what is reserved too (its agent and `state get`
        // read it there).
        if let Some(r) = record.reservations.iter().find(|r| r.task_id == a.task_id) {
            let placement = Placement {
                task_id: r.task_id.clone(),
                device_id: device_id.to_owned(),
                reserved_mem_mib: r.reserved_mem_mib,
                placed_at_unix_ms: r.placed_at_unix_ms,
                batch_size: r
                    .spec
                    .as_ref()
                    .map_or(a.batch_size, |s| s.initial_batch_size.max(1)),
            };
            txn = txn.put(
                keys::task_placement(&r.task_id),
                placement.encode_to_vec(),
                None,
            );
        }
    }
    txn
}

/// The record, compares and assignments of a room eviction decided on `view`: the
/// device's record with the claim of `task` (replacing an earlier one of it, expired
/// claims dropped), each victim's key and what the decision saw there, and its evict
/// assignment, whose reason names the task and which names `by` as its writer; a victim
/// leaving already (its assignment says evict) keeps the assignment it has. `None` when
/// a victim is not resident there (the view changed under the decision).
#[allow(clippy::type_complexity)]
fn evict_plan(
    view: &ClusterView,
    task: &TaskSpec,
    device_id: &str,
    victims: &[String],
    (claim_mib, claim_until_unix_ms): (u64, i64),
    by: &str,
    now: i64,
) -> Option<(
    DeviceResidents,
    Expect,
    Vec<(String, Expect)>,
    Vec<BatchSizeAssignment>,
)> {
    let device = view.device(device_id)?;
    let reason = format!(
        "evicted to make room for production job {} on {device_id}",
        task.task_id
    );
    let mut compares = Vec::with_capacity(victims.len());
    let mut assignments = Vec::with_capacity(victims.len());
    for victim in victims {
        let resident = device
            .residents
            .iter()
            .find(|r| r.reservation.task_id == *victim)?;
        if resident.assignment.as_ref().is_some_and(|(a, _)| a.evict) {
            continue;
        }
        let (assignment, expect) = evict_assignment(device, victim, &reason, by, now)?;
        compares.push((keys::task_assignment(victim), expect));
        assignments.push(assignment);
    }
    let mut record = device.residents_record(device_id);
    record
        .claims
        .retain(|c| c.task_id != task.task_id && claim_holds(c, now));
    record.claims.push(Claim {
        task_id: task.task_id.clone(),
        mem_mib: claim_mib,
        until_unix_ms: claim_until_unix_ms,
        evicting: victims.to_vec(),
    });
    let expect = match device.residents_revision {
        Some(rev) => Expect::ModRevision(rev),
        None => Expect::Absent,
    };
    Some((record, expect, compares, assignments))
}

/// The placement service: policy, view and store.
#[derive(Debug, Clone)]
pub struct PlacementService {
    store: Arc<dyn StateStore>,
    /// Where Place and Release commit: concurrent ones on different devices share one
    /// store transaction (see [`crate::group_commit`]).
    commits: Arc<GroupCommit>,
    view: Arc<RwLock<ClusterView>>,
    placer: Arc<Placer>,
    events: Arc<dyn PlacementEvents>,
    gates: Arc<DeviceGates>,
    clock: Clock,
    /// The task keys this process's Places wrote (the spec and the task's starting
    /// assignment, at the commit's revision), until the task's Release: from them the
    /// Release builds its archive moves without reading the store (see
    /// [`PlacementService::release`]).
    written: Arc<std::sync::Mutex<std::collections::HashMap<String, Vec<iadeep_state::KeyValue>>>>,
    /// Tasks running without a reservation already warned about (see
    /// [`PlacementService::readmit_running`]), so each is logged once, not every pass.
    unreserved: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    /// Who this service is among the placers sharing the store (see
    /// [`PlacementService::with_instance`]).
    instance: Arc<str>,
}

/// A name for a service that was given none: unique within this process.
fn next_instance() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("placer service {n}")
}

/// Where the service reads the time (Unix ms): the wall clock in the daemon, the
/// simulated clock in the simulator, which drives this very service in virtual time.
#[derive(Clone)]
pub struct Clock(Arc<dyn Fn() -> i64 + Send + Sync>);

impl Clock {
    /// The system's wall clock.
    pub fn wall() -> Clock {
        Clock(Arc::new(iadeep_proto::now_unix_ms))
    }

    /// A clock that reads `now`.
    pub fn from_fn(now: impl Fn() -> i64 + Send + Sync + 'static) -> Clock {
        Clock(Arc::new(now))
    }

    /// The time now, Unix ms.
    pub fn now_unix_ms(&self) -> i64 {
        (self.0)()
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Clock").field(&self.now_unix_ms()).finish()
    }
}

/// The most tasks whose Place-written keys are kept for their Release (see
/// `PlacementService::written`): about a hundred bytes to a few KiB each.
const MAX_WRITTEN: usize = 100_000;

/// How many times per allowed store conflict a Place may wait for another request's
/// commit on its chosen device before giving up: each wait means another request
/// made progress, so this only bounds a request that keeps losing to a busy stream.
const WAITS_PER_ATTEMPT: u32 = 4;

/// The most tasks one [`PlacementService::archive_dead_unreserved`] archives: a placer
/// started on a store full of ended jobs clears them over a few reaper ticks instead of
/// holding the reaper's other work for one long pass.
const ARCHIVE_PER_PASS: usize = 100;

/// What [`PlacementService::archive_unplaced`] did with a task's keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum UnplacedArchive {
    /// Moved to the archive and marked for the retention.
    Archived,
    /// Its agent runs.
    Running,
    /// Nothing of it is left under `tasks/` to move.
    NothingLeft,
    /// Left where it is, and why: nothing for this path to do.
    Kept(&'static str),
    /// One of its keys changed between the read and the commit: tried again later.
    Changed,
}

/// The revision a decision expected, as the view stores it.
fn expected_revision(expect: Expect) -> Option<iadeep_state::Revision> {
    match expect {
        Expect::ModRevision(rev) => Some(rev),
        Expect::Absent => None,
    }
}

/// The answer to a Place for a task that already holds `placement`: that placement
/// again, so a client retrying (or racing itself) never gets a second device.
fn already_placed(placement: Placement) -> PlaceOutcome {
    PlaceOutcome {
        explanation: Explanation {
            summary: format!(
                "task {} is already placed on {}",
                placement.task_id, placement.device_id
            ),
            candidates: Vec::new(),
        },
        decision: place_response::Decision::Placed(placement),
        assignments: Vec::new(),
    }
}

/// Which devices have a reservation change being committed by this process.
///
/// Why: concurrent Places decide on the same view, and the best device for one is
/// often the best for the next; the second transaction, built on the revision the
/// first is about to replace, is certain to fail its comparison, and costs a durable
/// commit and a round trip for nothing before the task is re-decided. With a gate,
/// the second request instead waits for the first's commit to reach the view and
/// decides again on it. The store's comparison still guards every admission (other
/// placer processes have their own gates); this only avoids conflicts that are known
/// in advance.
#[derive(Debug, Default)]
struct DeviceGates {
    busy: std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Notify>>>,
}

/// Held while a device's reservation change is committed; opens the gate when dropped.
struct Gate<'a> {
    gates: &'a DeviceGates,
    device_id: String,
}

impl DeviceGates {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, Arc<tokio::sync::Notify>>>
    {
        self.busy.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether another request holds the device's gate.
    fn is_shut(&self, device_id: &str) -> bool {
        self.lock().contains_key(device_id)
    }

    /// The devices whose gates are held.
    fn shut(&self) -> std::collections::HashSet<String> {
        self.lock().keys().cloned().collect()
    }

    /// Takes the device's gate, or `None` when another request holds it.
    fn try_enter(&self, device_id: &str) -> Option<Gate<'_>> {
        let mut busy = self.lock();
        if busy.contains_key(device_id) {
            return None;
        }
        busy.insert(device_id.to_owned(), Arc::new(tokio::sync::Notify::new()));
        Some(Gate {
            gates: self,
            device_id: device_id.to_owned(),
        })
    }

    /// Takes the device's gate, waiting while others hold it, at most `max_waits`
    /// times; `None` after that (the caller goes ahead ungated: the store's comparison
    /// still decides).
    async fn enter(&self, device_id: &str, max_waits: u32) -> Option<Gate<'_>> {
        for _ in 0..max_waits {
            if let Some(gate) = self.try_enter(device_id) {
                return Some(gate);
            }
            self.wait(device_id).await;
        }
        self.try_enter(device_id)
    }

    /// Waits until the device's gate is open (at once if it is).
    async fn wait(&self, device_id: &str) {
        let notify = self.lock().get(device_id).cloned();
        if let Some(notify) = notify {
            let opened = notify.notified();
            tokio::pin!(opened);
            // Registered before re-checking, so an opening in between is not missed;
            // the re-check is on this very gate, not the device: if it opened and
            // another request took the device meanwhile, this one's wait is over.
            opened.as_mut().enable();
            let still_shut = self
                .lock()
                .get(device_id)
                .is_some_and(|current| Arc::ptr_eq(current, &notify));
            if still_shut {
                opened.await;
            }
        }
    }
}

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        if let Some(notify) = self.gates.lock().remove(&self.device_id) {
            notify.notify_waiters();
        }
    }
}

impl PlacementService {
    /// A service deciding with `placer` on `view`, reserving in `store`, counting
    /// nothing (see [`PlacementService::with_events`]).
    pub fn new(
        store: Arc<dyn StateStore>,
        view: Arc<RwLock<ClusterView>>,
        placer: Arc<Placer>,
    ) -> PlacementService {
        PlacementService {
            commits: Arc::new(GroupCommit::new(store.clone())),
            store,
            view,
            placer,
            events: Arc::new(NoEvents),
            gates: Arc::new(DeviceGates::default()),
            clock: Clock::wall(),
            written: Arc::default(),
            unreserved: Arc::default(),
            instance: next_instance().into(),
        }
    }

    /// The same service named `instance` among the placers sharing the store (the
    /// daemon: `host:pid`). Each eviction it writes carries the name
    /// (`BatchSizeAssignment::evicted_by`). Why: two placers deciding one eviction in
    /// the same millisecond would otherwise write identical bytes, and each would take
    /// the store's copy for its own committed write (a re-sent transaction is recognised
    /// that way), counting one eviction twice. Without a name, services are numbered
    /// within the process, which tells apart those of one process only.
    pub fn with_instance(mut self, instance: impl Into<String>) -> PlacementService {
        self.instance = instance.into().into();
        self
    }

    /// This service's name among the placers sharing the store.
    pub fn instance(&self) -> &str {
        &self.instance
    }

    /// The same service reading the time from `clock` (the simulator's virtual time).
    pub fn with_clock(mut self, clock: Clock) -> PlacementService {
        self.clock = clock;
        self
    }

    /// The store the service reserves in.
    pub(crate) fn store(&self) -> &Arc<dyn StateStore> {
        &self.store
    }

    /// The time now, Unix ms, from the service's clock.
    pub(crate) fn now_unix_ms(&self) -> i64 {
        self.clock.now_unix_ms()
    }

    /// The same service reporting what it does to `events` (the daemon's metrics).
    pub fn with_events(mut self, events: Arc<dyn PlacementEvents>) -> PlacementService {
        self.events = events;
        self
    }

    /// Takes note of `event` (see [`PlacementService::with_events`]).
    pub(crate) fn record(&self, event: PlacementEvent) {
        self.events.record(event);
    }

    /// The policy.
    pub fn placer(&self) -> &Placer {
        &self.placer
    }

    /// Read access to the view (never held across an await).
    pub fn view(&self) -> RwLockReadGuard<'_, ClusterView> {
        // A panic while holding the lock leaves a view that is still a consistent map.
        self.view.read().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn view_mut(&self) -> RwLockWriteGuard<'_, ClusterView> {
        self.view.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Decides where `task` goes and, when placed, reserves the device before returning.
    ///
    /// Placing a task that already holds a reservation answers that reservation again
    /// (a client retrying after a lost answer must not get a second device).
    pub async fn place(&self, task: TaskSpec, restrict: Vec<String>) -> Result<PlaceOutcome> {
        let started = Instant::now();
        let result = self.place_inner(task, restrict).await;
        self.record(PlacementEvent::PlaceTime(started.elapsed()));
        self.record(match &result {
            Ok(PlaceOutcome {
                decision: place_response::Decision::Placed(_),
                ..
            }) => PlacementEvent::Placed,
            Ok(_) => PlacementEvent::Queued,
            Err(PlacerError::InvalidArgument { .. }) => PlacementEvent::Invalid,
            Err(_) => PlacementEvent::Failed,
        });
        result
    }

    async fn place_inner(&self, task: TaskSpec, restrict: Vec<String>) -> Result<PlaceOutcome> {
        validate::task_spec("task", &task)?;
        validate::device_ids("candidate_device_ids", &restrict)?;
        let task = self.with_registry_profile(task, &restrict).await;
        let attempts = self.placer.params().max_reserve_attempts;
        let mut attempt = 0;
        let mut waits = 0;
        loop {
            let (explanation, work) = match self.decide_step(&task, &restrict) {
                Step::Answer(outcome) => return Ok(outcome),
                Step::Queue(explanation, retry_after, reason, held_for) => {
                    let queued = Queued {
                        retry_after,
                        reason,
                        explanation,
                        held_for,
                    };
                    return Ok(self.queued(&task, &restrict, queued));
                }
                Step::Commit(explanation, work) => (explanation, work),
            };
            let (explanation, work) =
                if matches!(work, Work::Place(_)) && self.gates.is_shut(work.device_id()) {
                    self.decide_elsewhere(&task, &restrict)
                        .unwrap_or((explanation, work))
                } else {
                    (explanation, work)
                };
            // One commit at a time per device from this process: a second one, decided
            // on the same revision, could only lose (see `DeviceGates`).
            let Some(_gate) = self.gates.try_enter(work.device_id()) else {
                waits += 1;
                if waits > attempts.saturating_mul(WAITS_PER_ATTEMPT) {
                    return Err(PlacerError::contention(task.task_id, attempt, waits - 1));
                }
                self.record(PlacementEvent::GateWait);
                tracing::debug!(task = %task.task_id, device = %work.device_id(),
                    "device being reserved by another request; deciding again after it");
                self.gates.wait(work.device_id()).await;
                continue;
            };
            if self
                .view()
                .device(work.device_id())
                .and_then(|d| d.residents_revision)
                != expected_revision(work.expect())
            {
                // A commit landed between the decision and the gate: decide on it.
                waits += 1;
                continue;
            }
            attempt += 1;
            let outcome = match work {
                Work::Place(plan) => self.commit(&task, plan, explanation, attempt).await?,
                Work::Evict(plan) => {
                    self.commit_evict(&task, &restrict, plan, explanation, attempt)
                        .await?
                }
            };
            if let Some(outcome) = outcome {
                return Ok(outcome);
            }
            if attempt >= attempts {
                return Err(PlacerError::contention(task.task_id, attempt, waits));
            }
        }
    }

    /// The placement `task` gets among the devices no other request of this process is
    /// committing on (within `restrict`, when not empty), when it gets one there.
    ///
    /// Why: concurrent requests decide on the same view, so requests for similar tasks
    /// choose the same best device; waiting at its gate and deciding again after each
    /// commit made them commit one at a time, each a store round trip (on etcd, a raft
    /// commit), whatever the concurrency. Deciding among the devices not being written
    /// lets their commits proceed side by side. The choice is the policy's own among
    /// those devices (the same feasibility, scores and thresholds); `None` when it would
    /// rather queue there, and the request then waits for the busy device after all.
    fn decide_elsewhere(
        &self,
        task: &TaskSpec,
        restrict: &[String],
    ) -> Option<(Explanation, Work)> {
        let busy = self.gates.shut();
        let open: Vec<String> = if restrict.is_empty() {
            self.view()
                .devices()
                .map(|(id, _)| id)
                .filter(|id| !busy.contains(*id))
                .map(str::to_owned)
                .collect()
        } else {
            restrict
                .iter()
                .filter(|id| !busy.contains(id.as_str()))
                .cloned()
                .collect()
        };
        if open.is_empty() {
            return None;
        }
        match self.decide_step(task, &open) {
            Step::Commit(explanation, work @ Work::Place(_)) => Some((explanation, work)),
            Step::Commit(_, Work::Evict(_)) | Step::Answer(_) | Step::Queue(..) => None,
        }
    }

    /// Decides where `task` goes and builds the new record under one read lock, so the
    /// expected revision is the one the decision saw.
    fn decide_step(&self, task: &TaskSpec, restrict: &[String]) -> Step {
        let view = self.view();
        if let Some(device_id) = view.device_of(&task.task_id) {
            return Step::Answer(self.existing(&view, &task.task_id, device_id));
        }
        let started = Instant::now();
        let now = self.clock.now_unix_ms();
        let Decision {
            verdict,
            explanation,
            cap_refusals,
            held_for,
        } = self.placer.decide(&view, task, restrict, now);
        self.record(PlacementEvent::DecisionTime(started.elapsed()));
        for _ in 0..cap_refusals {
            self.record(PlacementEvent::CapRefusal);
        }
        if let (
            Some(_),
            Verdict::Queue {
                retry_after,
                reason,
            },
        ) = (&held_for, &verdict)
        {
            return Step::Queue(explanation, *retry_after, reason.clone(), held_for);
        }
        if let Verdict::Evict {
            device_id,
            victims,
            claim_mib,
            claim_until_unix_ms,
            retry_after,
            reason,
        } = verdict
        {
            return match evict_plan(
                &view,
                task,
                &device_id,
                &victims,
                (claim_mib, claim_until_unix_ms),
                &self.instance,
                now,
            ) {
                Some((record, expect, assignment_compares, assignments)) => Step::Commit(
                    explanation,
                    Work::Evict(Box::new(EvictPlan {
                        device_id,
                        record,
                        expect,
                        assignment_compares,
                        assignments,
                        retry_after,
                        reason,
                    })),
                ),
                None => Step::Queue(explanation, retry_after, reason, None),
            };
        }
        match self.plan(&view, task, verdict) {
            Ok(plan) => Step::Commit(explanation, Work::Place(Box::new(plan))),
            Err((retry_after, reason)) => Step::Queue(explanation, retry_after, reason, None),
        }
    }

    /// The placement a place `verdict` asks for, built on the `view` it was decided on:
    /// the device's record with the task's reservation (and shrunk residents at their
    /// new bounds), and what the transaction compares and writes besides. A queue
    /// verdict's retry hint and reason, as they are.
    fn plan(
        &self,
        view: &ClusterView,
        task: &TaskSpec,
        verdict: Verdict,
    ) -> std::result::Result<Plan, (Duration, String)> {
        let (device_id, reserved_mem_mib, shrinks, newcomer, provisional) = match verdict {
            Verdict::Place {
                device_id,
                reserved_mem_mib,
                shrinks,
                newcomer,
                provisional,
            } => (device_id, reserved_mem_mib, shrinks, newcomer, provisional),
            Verdict::Queue {
                retry_after,
                reason,
            }
            | Verdict::Evict {
                retry_after,
                reason,
                ..
            } => return Err((retry_after, reason)),
        };
        let device = view.device(&device_id);
        let now = self.clock.now_unix_ms();
        let mut record = shrunk_record(device, &device_id, &shrinks);
        // The task's own claim is spent, and expired ones hold nothing: the record
        // carries neither further.
        record
            .claims
            .retain(|c| c.task_id != task.task_id && claim_holds(c, now));
        let reservation = Reservation {
            task_id: task.task_id.clone(),
            reserved_mem_mib,
            placed_at_unix_ms: now,
            spec: Some(resident_spec(task)),
            provisional,
        };
        record.reservations.push(reservation.clone());
        let expect = match device.and_then(|d| d.residents_revision) {
            Some(rev) => Expect::ModRevision(rev),
            None => Expect::Absent,
        };
        let assignment_compares = assignment_compares(device);
        let assignments =
            placement_assignments(device, task, reserved_mem_mib, newcomer, &shrinks, now);
        Ok(Plan {
            device_id,
            record,
            reservation,
            expect,
            assignment_compares,
            assignments,
        })
    }

    /// Tells the caller to ask again after `queued.retry_after`, counting the task as
    /// waiting meanwhile (see [`PlacementService::note_queued`]).
    fn queued(&self, task: &TaskSpec, restrict: &[String], queued: Queued) -> PlaceOutcome {
        let Queued {
            retry_after,
            reason,
            explanation,
            held_for,
        } = queued;
        self.note_queued(task, restrict, retry_after, held_for.as_deref());
        tracing::debug!(task = %task.task_id, retry_after_s = retry_after.as_secs(), %reason, "queued");
        PlaceOutcome {
            decision: place_response::Decision::Queued(QueueDecision {
                retry_after_ms: u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX),
                reason,
            }),
            explanation,
            assignments: Vec::new(),
        }
    }

    /// Makes `plan` real in one transaction. The answer to the Place, or `None` when the
    /// device or a resident's assignment changed since the decision: what the
    /// transaction found is in the view then, for the next decision.
    async fn commit(
        &self,
        task: &TaskSpec,
        plan: Box<Plan>,
        explanation: Explanation,
        attempt: u32,
    ) -> Result<Option<PlaceOutcome>> {
        let placement = Placement {
            task_id: task.task_id.clone(),
            device_id: plan.device_id.clone(),
            reserved_mem_mib: plan.reservation.reserved_mem_mib,
            placed_at_unix_ms: plan.reservation.placed_at_unix_ms,
            batch_size: task.initial_batch_size.max(1),
        };
        let txn = plan.txn(task, &placement);
        let Plan {
            device_id,
            record,
            expect,
            assignment_compares,
            assignments,
            ..
        } = *plan;
        match self.commits.transact(txn).await? {
            TxnOutcome::Committed { revision } => {
                {
                    let mut view = self.view_mut();
                    view.apply_residents(&device_id, Some(record), revision);
                    for a in &assignments {
                        view.set_assignment(a.clone(), revision);
                    }
                    view.forget_waiting(&task.task_id);
                }
                self.note_written(task, &assignments, revision);
                tracing::info!(task = %task.task_id, device = %device_id,
                    reserved_mib = placement.reserved_mem_mib, attempt,
                    shrunk = assignments.len() - 1,
                    summary = %explanation.summary, "placed");
                Ok(Some(PlaceOutcome {
                    decision: place_response::Decision::Placed(placement),
                    explanation,
                    assignments,
                }))
            }
            TxnOutcome::Failed { current } => self.lost_commit(
                task,
                LostCommit {
                    device_id: &device_id,
                    expect,
                    assignment_compares: &assignment_compares,
                    attempt,
                    what: "the decision",
                },
                current,
            ),
        }
    }

    /// A Place's transaction (a placement or a room eviction) lost its comparisons:
    /// the placement when another request placed the task meanwhile (answered as a
    /// retry after a lost answer gets it), else `None` with what the transaction found
    /// (the residents record, then the compared assignments) absorbed into the view for
    /// the next decision.
    fn lost_commit(
        &self,
        task: &TaskSpec,
        lost: LostCommit<'_>,
        current: Vec<Option<iadeep_state::KeyValue>>,
    ) -> Result<Option<PlaceOutcome>> {
        let mut current = current.into_iter();
        let residents_now = current.next().flatten();
        if let Some(existing) = current.next().flatten() {
            let placement = typed::decode::<Placement>(&existing)?;
            tracing::info!(task = %task.task_id, device = %placement.device_id,
                "placed meanwhile by another request; answering that placement");
            return Ok(Some(already_placed(placement)));
        }
        self.record(PlacementEvent::CasConflict);
        tracing::debug!(task = %task.task_id, device = %lost.device_id, attempt = lost.attempt,
            "device changed since {}; deciding again", lost.what);
        self.absorb(lost.device_id, lost.expect, residents_now);
        self.absorb_assignments(lost.assignment_compares.iter().zip(current));
        Ok(None)
    }

    /// Makes a room eviction real in one transaction ([`EvictPlan::txn`]). The answer
    /// to the Place ("queued", with the plan's retry hint and reason), or `None` when the
    /// device or a victim's assignment changed since the decision: what the transaction
    /// found is in the view then, for the next decision.
    async fn commit_evict(
        &self,
        task: &TaskSpec,
        restrict: &[String],
        plan: Box<EvictPlan>,
        explanation: Explanation,
        attempt: u32,
    ) -> Result<Option<PlaceOutcome>> {
        let txn = plan.txn(task);
        let EvictPlan {
            device_id,
            record,
            expect,
            assignment_compares,
            assignments,
            retry_after,
            reason,
        } = *plan;
        match self.commits.transact(txn).await? {
            TxnOutcome::Committed { revision } => {
                {
                    let mut view = self.view_mut();
                    view.apply_residents(&device_id, Some(record), revision);
                    for a in &assignments {
                        view.set_assignment(a.clone(), revision);
                    }
                }
                for a in &assignments {
                    self.record(PlacementEvent::Evicted(EvictionTrigger::Room));
                    tracing::info!(task = %task.task_id, device = %device_id,
                        victim = %a.task_id, attempt, reason = %a.evict_reason,
                        "evicting an opportunistic job to make room for a production job");
                }
                let queued = Queued {
                    retry_after,
                    reason,
                    explanation,
                    held_for: None,
                };
                Ok(Some(self.queued(task, restrict, queued)))
            }
            TxnOutcome::Failed { current } => self.lost_commit(
                task,
                LostCommit {
                    device_id: &device_id,
                    expect,
                    assignment_compares: &assignment_compares,
                    attempt,
                    what: "the room eviction was decided",
                },
                current,
            ),
        }
    }

    /// `task` with the profile registry's entry of its model as its solo profile
    /// (marked `from_registry`), when its submitter gave neither a profile nor a memory
    /// figure and an earlier job of that model recorded one; as given otherwise. The
    /// registry is one store read, made only for such tasks; when it cannot be read,
    /// the task is decided without it (a provisional grant, see [`crate::policy`]).
    ///
    /// Public so that a diagnosis of a decision (the simulator's placement audit)
    /// assesses the task exactly as [`PlacementService::place`] decides it.
    pub async fn with_registry_profile(&self, mut task: TaskSpec, restrict: &[String]) -> TaskSpec {
        if task.profile.is_some() || task.gpu_mem_request_mib > 0 || task.model.is_empty() {
            return task;
        }
        match iadeep_state::registry::load(self.store.as_ref(), &task.model).await {
            Ok(Some(entry)) => {
                task.profile =
                    iadeep_state::registry::solo_profile(&entry, task.initial_batch_size.max(1));
                // Another run's figure must not make a task the user said nothing about
                // impossible to place: it is decided as one nothing is known of instead.
                if task.profile.is_some()
                    && self
                        .placer
                        .never_fits_any(&self.view(), &task, restrict)
                        .is_some()
                {
                    tracing::info!(task = %task.task_id, model = %task.model,
                        "the registry's profile fits no card; deciding without it");
                    task.profile = None;
                }
                if let Some(p) = &task.profile {
                    tracing::info!(task = %task.task_id, model = %task.model,
                        batch_size = p.batch_size, peak_mem_mib = p.peak_mem_mib,
                        step_time_s = p.step_time_s, device_kind = %p.device_kind,
                        "profile from the registry (an earlier job of the same model)");
                }
            }
            Ok(None) => {}
            Err(err) => tracing::warn!(task = %task.task_id, %err,
                "cannot read the profile registry; deciding without it"),
        }
        task
    }

    /// Counts `task` as waiting for a device, so the tasks submitted after it see it
    /// ahead of them (see [`crate::policy`], step 3), until twice its retry hint has
    /// passed: the client was told to come back after `retry_after`, and one more hint
    /// of slack covers a client that polls late; one that stays away longer has given
    /// up and stops holding the others back. Placing or releasing the task forgets it.
    ///
    /// The queue is this process's: placers sharing a store do not see each other's
    /// waiting tasks (a task that is refused by one and retries on another is counted
    /// by both until it expires, which errs towards placing).
    ///
    /// `held_for`: the task waiting ahead whose hold is why `task` queues, if that is
    /// why (see [`ClusterView::note_waiting`]); each such answer counts as a hold
    /// (`iadeep_placer_holds_total`), whichever interface gave it.
    pub fn note_queued(
        &self,
        task: &TaskSpec,
        restrict: &[String],
        retry_after: std::time::Duration,
        held_for: Option<&str>,
    ) {
        if held_for.is_some() {
            self.record(PlacementEvent::Held);
        }
        let now = self.clock.now_unix_ms();
        let hold_ms = i64::try_from(retry_after.as_millis().saturating_mul(2)).unwrap_or(i64::MAX);
        self.view_mut()
            .note_waiting(task, restrict, now, now.saturating_add(hold_ms), held_for);
    }

    /// Keeps the task keys `task`'s Place wrote at `revision` for its Release (see
    /// `written`); at most [`MAX_WRITTEN`] tasks (tasks released by another placer are
    /// never taken out), beyond which a Release reads the store as before.
    fn note_written(&self, task: &TaskSpec, assignments: &[BatchSizeAssignment], revision: i64) {
        let kv =
            |key: String, value: Vec<u8>| iadeep_state::KeyValue::created_at(key, value, revision);
        let mut live = vec![kv(keys::task_spec(&task.task_id), task.encode_to_vec())];
        if let Some(own) = assignments.iter().find(|a| a.task_id == task.task_id) {
            live.push(kv(
                keys::task_assignment(&task.task_id),
                own.encode_to_vec(),
            ));
        }
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        if written.len() < MAX_WRITTEN {
            written.insert(task.task_id.clone(), live);
        }
    }

    /// The archive moves of `task_id`'s Release: from the keys its Place wrote when this
    /// process placed it and the view has seen neither a report of the task nor another
    /// assignment since (the transaction compares each key at that revision, so a key
    /// changed meanwhile fails it, and the failure reads back what is there); else from a
    /// read of the task's keys, as for any task whose agent reported.
    async fn first_archive_ops(
        &self,
        device_id: &str,
        task_id: &str,
    ) -> Result<crate::archive::ArchiveOps> {
        let written = self
            .written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(task_id);
        let untouched = |live: &[iadeep_state::KeyValue]| {
            let assignment_key = keys::task_assignment(task_id);
            let wrote = live
                .iter()
                .find(|kv| kv.key == assignment_key)
                .map(|kv| kv.mod_revision);
            let view = self.view();
            view.device(device_id)
                .and_then(|d| {
                    d.residents
                        .iter()
                        .find(|r| r.reservation.task_id == task_id)
                })
                .is_some_and(|r| {
                    r.report.is_none() && r.assignment.as_ref().map(|(_, rev)| *rev) == wrote
                })
        };
        match written {
            Some(live) if untouched(&live) => Ok(crate::archive::archive_ops_from(&live, task_id)),
            _ => crate::archive::archive_ops(self.store.as_ref(), task_id).await,
        }
    }

    /// Puts what a lost compare-and-swap found into the view.
    fn absorb(&self, device_id: &str, expected: Expect, current: Option<iadeep_state::KeyValue>) {
        let mut view = self.view_mut();
        match current {
            Some(kv) => match typed::decode::<DeviceResidents>(&kv) {
                Ok(record) => {
                    view.apply_residents(device_id, Some(record), kv.mod_revision);
                }
                Err(err) => {
                    self.record(PlacementEvent::DecodeError);
                    tracing::warn!(%err, "residents record does not decode; device skipped until rewritten");
                }
            },
            None => {
                // Deleted after the revision we expected: any later write is newer still.
                let after = match expected {
                    Expect::ModRevision(rev) => rev + 1,
                    Expect::Absent => 0,
                };
                view.apply_residents(device_id, None, after);
            }
        }
    }

    /// Puts the residents' assignments a lost transaction found into the view (a tuner
    /// grew or shrank one meanwhile: the next decision counts it at its new size).
    fn absorb_assignments<'a>(
        &self,
        found: impl Iterator<Item = (&'a (String, Expect), Option<iadeep_state::KeyValue>)>,
    ) {
        let mut view = self.view_mut();
        for ((key, _), current) in found {
            match current {
                Some(kv) => match typed::decode::<iadeep_proto::BatchSizeAssignment>(&kv) {
                    Ok(a) => view.set_assignment(a, kv.mod_revision),
                    Err(err) => {
                        self.record(PlacementEvent::DecodeError);
                        tracing::warn!(%err, "assignment does not decode; ignored");
                    }
                },
                None => {
                    if let iadeep_state::keys::KeyKind::TaskAssignment { task } =
                        iadeep_state::keys::KeyKind::parse(key)
                    {
                        view.remove_assignment(&task);
                    }
                }
            }
        }
    }

    fn existing(&self, view: &ClusterView, task_id: &str, device_id: &str) -> PlaceOutcome {
        let resident = view.device(device_id).and_then(|d| {
            d.residents
                .iter()
                .find(|r| r.reservation.task_id == task_id)
        });
        already_placed(Placement {
            task_id: task_id.to_owned(),
            device_id: device_id.to_owned(),
            reserved_mem_mib: resident.map_or(0, |r| r.reservation.reserved_mem_mib),
            placed_at_unix_ms: resident.map_or(0, |r| r.reservation.placed_at_unix_ms),
            batch_size: resident.map_or(0, |r| r.batch_size()),
        })
    }

    /// Gives `task_id`'s reservation back. Returns the device it held, or `None` when it
    /// held none (releasing twice is not an error).
    ///
    /// The reservation's removal and the placement's deletion are one transaction.
    /// Since Place writes both in one transaction too, the view's device for the task
    /// is normally all that is needed: the usual Release costs one range read of the
    /// task's keys (to move them to the archive, see `archive.rs`; none when this
    /// process placed the task and its agent never reported) and that one commit
    /// (shared with concurrent ones, see `group_commit.rs`); the placement is read from the store only when the view does not hold
    /// the task (not synced yet, or a record written by hand or by an older placer).
    pub async fn release(&self, task_id: &str) -> Result<Option<String>> {
        validate::task_id("task_id", task_id)?;
        let placement_key = keys::task_placement(task_id);
        let from_view = self.view().device_of(task_id).map(str::to_owned);
        let mut released = None;
        if let Some(device_id) = from_view
            && self
                .remove_reservation(&device_id, task_id, &placement_key)
                .await?
        {
            released = Some(device_id);
        }
        let mut had_placement = released.is_some();
        if released.is_none() {
            let from_store = typed::get::<Placement>(self.store.as_ref(), &placement_key)
                .await?
                .map(|(p, _)| p.device_id);
            had_placement = from_store.is_some();
            if let Some(device_id) = from_store
                && self
                    .remove_reservation(&device_id, task_id, &placement_key)
                    .await?
            {
                released = Some(device_id);
            }
            if released.is_none() && had_placement {
                // A placement without a reservation: nothing else to take it away with.
                self.release_placement_only(task_id, &placement_key).await?;
            }
        }
        if !had_placement {
            // Best effort: what a task that held nothing left behind must not fail its
            // Release (the reaper archives it once its agent is gone).
            match self.archive_unplaced(task_id).await {
                Ok(UnplacedArchive::Archived) => {
                    self.record(PlacementEvent::UnplacedArchived);
                    tracing::debug!(task = %task_id,
                        "archived the keys of a task that held no placement");
                }
                Ok(_) => {}
                Err(err) => tracing::warn!(task = %task_id, %err,
                    "cannot archive the keys of a released task that held no placement"),
            }
        }
        // A task withdrawn while it waited no longer holds the others back.
        self.view_mut().forget_waiting(task_id);
        self.placer.wait_model().forget(task_id);
        if had_placement {
            self.record(PlacementEvent::Released);
            tracing::debug!(task = %task_id, device = ?released, "released");
        }
        Ok(released)
    }

    /// Moves the keys an agent left under `tasks/` for a task that holds no placement to
    /// the archive and writes its release marker, as a Release of a placed task does,
    /// so the retention deletes them in time (see [`crate::retention`]). Nothing is
    /// done while the task's agent runs (its `alive` key exists: the reaper may admit
    /// it again), when it left nothing there (a task withdrawn while it waited, the
    /// usual case, costs this one read), when it holds a placement, or when it has a
    /// release marker already: then it was released while its agent ran, its archive
    /// holds what the Release moved (a second move would replace that with nothing,
    /// see [`crate::archive::archive_ops_from`]) and the retention deletes what the
    /// agent wrote since. The transaction holds only if no placement, `alive` key or
    /// marker appeared and the moved keys are as read.
    async fn archive_unplaced(&self, task_id: &str) -> Result<UnplacedArchive> {
        let live = self.store.range(&keys::task_prefix(task_id)).await?.kvs;
        let alive_key = keys::task_alive(task_id);
        let placement_key = keys::task_placement(task_id);
        let moved = keys::archived_task_keys(task_id);
        let holds = |key: &str| live.iter().any(|kv| kv.key == key);
        if holds(&alive_key) {
            return Ok(UnplacedArchive::Running);
        }
        if !moved.iter().any(|(key, _)| holds(key)) {
            return Ok(UnplacedArchive::NothingLeft);
        }
        if holds(&placement_key) {
            return Ok(UnplacedArchive::Kept(
                "it holds a placement without a reservation",
            ));
        }
        let marker = keys::task_released(task_id);
        if self.store.get(&marker).await?.is_some() {
            return Ok(UnplacedArchive::Kept(
                "it is marked for the retention already",
            ));
        }
        let archive = crate::archive::archive_ops_from(&live, task_id);
        let txn = Txn::new()
            .compare(placement_key, Expect::Absent)
            .compare(alive_key, Expect::Absent)
            .compare(marker, Expect::Absent);
        let committed = self
            .commits
            .transact(self.marked_archive(task_id, &archive, txn))
            .await?
            .committed();
        Ok(if committed {
            UnplacedArchive::Archived
        } else {
            UnplacedArchive::Changed
        })
    }

    /// `txn` with `archive`'s moves of the task's keys and the task's release marker
    /// (now): what every Release writes besides its own changes.
    fn marked_archive(&self, task_id: &str, archive: &crate::archive::ArchiveOps, txn: Txn) -> Txn {
        let txn = txn.put(
            keys::task_released(task_id),
            typed::encode_released_at(self.clock.now_unix_ms()),
            None,
        );
        archive.add_to(txn)
    }

    /// Deletes `placement_key` (a placement without a reservation) with the task's
    /// archive moves, reading the task's keys again while one changed since the read.
    async fn release_placement_only(&self, task_id: &str, placement_key: &str) -> Result<()> {
        let attempts = self.placer.params().max_reserve_attempts;
        for _ in 0..attempts {
            let archive = crate::archive::archive_ops(self.store.as_ref(), task_id).await?;
            let txn = self.marked_archive(task_id, &archive, Txn::new().delete(placement_key));
            if self.commits.transact(txn).await?.committed() {
                return Ok(());
            }
            self.record(PlacementEvent::CasConflict);
        }
        Err(PlacerError::contention(task_id, attempts, 0))
    }

    /// Removes one task from a device's residents record and deletes `placement_key`
    /// in the same transaction; true when the task was there.
    ///
    /// The first attempt starts from the view's copy of the record (no read from the
    /// store); a lost comparison returns the record as it is now, which the next
    /// attempt uses. The store is read only when the view does not list the task
    /// there (another placer may have placed it and this view not caught up yet).
    ///
    /// The task's archived keys are compared as read too (after the record's compare,
    /// whose current value comes first in a failed outcome); a lost comparison reads
    /// them again, so a report written meanwhile is archived, not deleted.
    async fn remove_reservation(
        &self,
        device_id: &str,
        task_id: &str,
        placement_key: &str,
    ) -> Result<bool> {
        validate::device_ids("device_id", std::slice::from_ref(&device_id.to_owned()))?;
        let key = keys::device_residents(device_id);
        let attempts = self.placer.params().max_reserve_attempts;
        // Behind any Place committing on this device, so the view's record is current.
        let _gate = self
            .gates
            .enter(device_id, attempts.saturating_mul(WAITS_PER_ATTEMPT))
            .await;
        let mut known = self.view_record_holding(device_id, task_id);
        // The spec, report and assignment move to the archive (see `crate::archive`).
        let mut archive = self.first_archive_ops(device_id, task_id).await?;
        // The release marker of the last transaction sent: finding it in the store
        // after a lost comparison means that transaction committed after all.
        let mut sent: Option<Vec<u8>> = None;
        for _ in 0..attempts {
            let (mut record, mod_revision) = match known.take() {
                Some(known) => known,
                None => match typed::get::<DeviceResidents>(self.store.as_ref(), &key).await? {
                    Some((record, kv)) => (record, kv.mod_revision),
                    None => {
                        return self
                            .released_earlier(device_id, task_id, sent, (None, 0))
                            .await;
                    }
                },
            };
            let before = record.reservations.len();
            record.reservations.retain(|r| r.task_id != task_id);
            if record.reservations.len() == before {
                let found = (Some(record), mod_revision);
                return self.released_earlier(device_id, task_id, sent, found).await;
            }
            // When it was released, for the retention (see `crate::retention`).
            let now = self.clock.now_unix_ms();
            let marker = typed::encode_released_at(now);
            // A room claim outlives the residents it evicted (the claimant comes back for
            // the room): the record goes only with the last reservation and live claim.
            record.claims.retain(|c| claim_holds(c, now));
            let keep = !(record.reservations.is_empty() && record.claims.is_empty());
            let txn = Txn::new().compare(key.as_str(), Expect::ModRevision(mod_revision));
            let txn = if !keep {
                txn.delete(key.as_str())
            } else {
                txn.put(key.as_str(), record.encode_to_vec(), None)
            }
            .delete(placement_key)
            .put(keys::task_released(task_id), marker.clone(), None);
            let txn = archive.add_to(txn);
            sent = Some(marker);
            match self.commits.transact(txn).await? {
                TxnOutcome::Committed { revision } => {
                    let record = keep.then_some(record);
                    self.view_mut().apply_residents(device_id, record, revision);
                    return Ok(true);
                }
                TxnOutcome::Failed { current } => {
                    self.record(PlacementEvent::CasConflict);
                    let compares = archive.compares.len();
                    let Some((found, next)) = after_lost_release(current, compares, task_id)?
                    else {
                        let deleted = (None, mod_revision);
                        return self
                            .released_earlier(device_id, task_id, sent, deleted)
                            .await;
                    };
                    known = Some(found);
                    archive = next;
                }
            }
        }
        Err(PlacerError::contention(task_id, attempts, 0))
    }

    /// The view's copy of `device_id`'s residents record and its revision, when the
    /// view lists `task_id` there: a release's first attempt starts from it, no read.
    fn view_record_holding(
        &self,
        device_id: &str,
        task_id: &str,
    ) -> Option<(DeviceResidents, i64)> {
        let view = self.view();
        view.device(device_id).and_then(|d| {
            let holds = d.residents.iter().any(|r| r.reservation.task_id == task_id);
            d.residents_revision
                .filter(|_| holds)
                .map(|rev| (d.residents_record(device_id), rev))
        })
    }

    /// Whether a Release transaction this request sent, with release marker `sent`,
    /// committed although its answer said otherwise; if so, the view takes the device's
    /// record as found without the task (`found` at `revision`; `None`: deleted after it).
    ///
    /// Why: the store re-sends a transaction whose answer was lost (an etcd member that
    /// stopped answering, see `iadeep_state`'s failover); when the lost attempt had
    /// committed, the re-sent one fails its comparison and finds the task already gone.
    /// Answering "held no reservation" then would tell the client its release did
    /// nothing. The marker that attempt wrote is this request's own (the same bytes,
    /// since the store re-sends the transaction unchanged), so finding exactly it tells
    /// the two apart; only a concurrent Release of the same task in the same millisecond
    /// could leave the same marker, and it released the same reservation.
    async fn released_earlier(
        &self,
        device_id: &str,
        task_id: &str,
        sent: Option<Vec<u8>>,
        (found, revision): (Option<DeviceResidents>, iadeep_state::Revision),
    ) -> Result<bool> {
        let Some(sent) = sent else {
            return Ok(false);
        };
        let marker = self.store.get(&keys::task_released(task_id)).await?;
        let ours = marker.is_some_and(|kv| kv.value == sent);
        if ours {
            tracing::info!(task = %task_id,
                "an earlier attempt of this release committed (its answer was lost); answering released");
            match found {
                Some(record) => {
                    self.view_mut()
                        .apply_residents(device_id, Some(record), revision);
                }
                None => self.absorb(device_id, Expect::ModRevision(revision), None),
            }
        }
        Ok(ours)
    }

    /// Releases every resident task whose agent has been gone for `grace` (at once when
    /// it reported finishing), see [`ClusterView::dead_residents`]. Returns the tasks
    /// released. A task that came back (its `alive` key reappeared) between the check
    /// and the release is skipped; one that fails to release is logged and retried on
    /// the next call.
    pub async fn release_dead(&self, grace: std::time::Duration) -> Vec<String> {
        let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        let dead = self
            .view_mut()
            .dead_residents(self.clock.now_unix_ms(), grace_ms);
        let mut released = Vec::new();
        for task in dead {
            // Re-checked, so an agent that restarted in the meantime keeps its device.
            if self.view().agent_alive(&task.task_id) {
                tracing::debug!(task = %task.task_id, "agent came back; keeps its reservation");
                continue;
            }
            match self.release(&task.task_id).await {
                Ok(Some(device)) => {
                    self.record(PlacementEvent::DeadReleased);
                    let gone_s = (self.clock.now_unix_ms() - task.gone_since_unix_ms).max(0) / 1000;
                    tracing::info!(task = %task.task_id, %device, finished = task.finished, gone_s,
                        "released the reservation of a task whose agent is gone");
                    released.push(task.task_id);
                }
                Ok(None) => {}
                Err(err) => tracing::warn!(task = %task.task_id, device = %task.device_id, %err,
                    "cannot release a dead task's reservation; retrying later"),
            }
        }
        released
    }

    /// Archives, with a release marker, the keys left under `tasks/` by every task that
    /// holds no reservation and whose agent has been gone for `grace` (at once when it
    /// reported finishing), see [`ClusterView::dead_unreserved`], so the retention
    /// deletes them as it does a released task's; at most `ARCHIVE_PER_PASS` a call.
    /// Returns the tasks archived. One that fails (a store error, or a key that changed
    /// meanwhile) is retried on the next call; one with nothing to archive (see
    /// `archive_unplaced`) is set aside until it changes.
    pub async fn archive_dead_unreserved(&self, grace: std::time::Duration) -> Vec<String> {
        let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        let dead = self
            .view_mut()
            .dead_unreserved(self.clock.now_unix_ms(), grace_ms);
        let mut archived = Vec::new();
        for task in dead.into_iter().take(ARCHIVE_PER_PASS) {
            let id = task.task_id.as_str();
            match self.archive_unplaced(id).await {
                Ok(UnplacedArchive::Archived) => {
                    self.record(PlacementEvent::UnplacedArchived);
                    let gone_s = (self.clock.now_unix_ms() - task.gone_since_unix_ms).max(0) / 1000;
                    tracing::info!(task = %id, finished = task.finished, gone_s,
                        "archived the keys of a task that ran without a reservation and is gone");
                    archived.push(task.task_id);
                }
                // The view's report outlived the store's (a Release or the retention
                // took it; its deletion not yet seen, or missed while a watch was down).
                // Only that report goes: one written since the read (an agent of the
                // same id starting) may be in the view by now.
                Ok(UnplacedArchive::NothingLeft) => {
                    self.view_mut().remove_report_if_seq(id, task.report_seq);
                }
                Ok(UnplacedArchive::Kept(why)) => {
                    tracing::debug!(task = %id, why, "left a gone task's keys where they are");
                    self.view_mut().skip_archiving(id);
                }
                Ok(UnplacedArchive::Running | UnplacedArchive::Changed) => {}
                Err(err) => tracing::warn!(task = %id, %err,
                    "cannot archive the keys of a task that ran without a reservation; retrying later"),
            }
        }
        archived
    }

    /// Releases every resident task whose agent never appeared (no `alive` key, no
    /// report) and that was placed at least `grace` ago, see
    /// [`ClusterView::unstarted_residents`]. Returns the tasks released. A task whose
    /// agent appeared between the check and the release is skipped; one that fails to
    /// release is logged and retried on the next call.
    pub async fn release_unstarted(&self, grace: std::time::Duration) -> Vec<String> {
        let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        let unstarted = self
            .view()
            .unstarted_residents(self.clock.now_unix_ms(), grace_ms);
        let mut released = Vec::new();
        for task in unstarted {
            if self.view().agent_alive(&task.task_id) {
                tracing::debug!(task = %task.task_id, "agent appeared; keeps its reservation");
                continue;
            }
            match self.release(&task.task_id).await {
                Ok(Some(device)) => {
                    self.record(PlacementEvent::UnstartedReleased);
                    let waited_s =
                        (self.clock.now_unix_ms() - task.placed_at_unix_ms).max(0) / 1000;
                    tracing::info!(task = %task.task_id, %device, waited_s,
                        "released the reservation of a task whose agent never started");
                    released.push(task.task_id);
                }
                Ok(None) => {}
                Err(err) => tracing::warn!(task = %task.task_id, device = %task.device_id, %err,
                    "cannot release a never-started task's reservation; retrying later"),
            }
        }
        released
    }

    /// Gives a reservation back to every task whose agent runs without one (see
    /// [`ClusterView::unreserved_running`]), on the device it runs on, through
    /// [`PlacementService::place`] restricted to that device: the same decision and the
    /// same reservation transaction as any Place, so it is admitted only if it fits
    /// there. One that cannot be (no room, no report naming its device, no spec) is
    /// reported: a warning naming the task and device when first found, and the
    /// `iadeep_placer_unreserved_running_tasks` gauge; its agent tells its training loop
    /// itself (it sees its placement deleted). Returns the tasks admitted again.
    pub async fn readmit_running(&self) -> Vec<String> {
        let found = self.view().unreserved_running();
        let mut readmitted = Vec::new();
        let mut unreserved = std::collections::HashSet::new();
        for task in found {
            match self.readmit(&task).await {
                Ok(()) => {
                    self.record(PlacementEvent::Readmitted);
                    tracing::info!(task = %task.task_id, device = ?task.device_id,
                        "a task released while its agent ran holds a reservation again");
                    readmitted.push(task.task_id);
                }
                Err(reason) => {
                    let first = !self.unreserved_lock().contains(&task.task_id);
                    if first {
                        tracing::warn!(task = %task.task_id,
                            device = task.device_id.as_deref().unwrap_or("unknown"), %reason,
                            "a task runs without a reservation and cannot be admitted again: \
                             its memory is not counted on its device");
                    }
                    unreserved.insert(task.task_id);
                }
            }
        }
        self.record(PlacementEvent::UnreservedRunning(unreserved.len()));
        *self.unreserved_lock() = unreserved;
        readmitted
    }

    /// Places `task` again on the device it runs on; why not, when it is not.
    async fn readmit(&self, task: &crate::view::UnreservedRunning) -> Result<(), String> {
        let device = task
            .device_id
            .clone()
            .ok_or("its agent has not reported which device it runs on")?;
        // Its Release moved the spec to the archive, unless the agent wrote it again.
        let mut spec = None;
        for key in [
            keys::task_spec(&task.task_id),
            keys::archived_spec(&task.task_id),
        ] {
            spec = typed::get::<TaskSpec>(self.store.as_ref(), &key)
                .await
                .map_err(|err| err.to_string())?
                .map(|(spec, _)| spec);
            if spec.is_some() {
                break;
            }
        }
        let spec = spec.ok_or("its spec is not in the store")?;
        match self.place(spec, vec![device]).await {
            Ok(PlaceOutcome {
                decision: place_response::Decision::Placed(_),
                ..
            }) => Ok(()),
            Ok(PlaceOutcome { explanation, .. }) => {
                // It runs already: it must not count as waiting ahead of new tasks.
                self.view_mut().forget_waiting(&task.task_id);
                Err(explanation.summary)
            }
            Err(err) => Err(err.to_string()),
        }
    }

    /// Replaces every provisional reservation whose task has reported its peak at the
    /// batch size it runs at with that peak plus the margin
    /// ([`crate::view::Resident::settled_reservation_mib`]), and writes the task an
    /// assignment at the same batch size with that bound, so its agent moves its memory
    /// fence there (docs/design.md, "Memory of a new job"). One transaction per device,
    /// comparing its residents record and the settled tasks' assignments; a device whose
    /// record changed meanwhile is settled on a later call. The daemon calls this every
    /// second ([`crate::reaper`]), the simulator after each batch of reports, so tasks
    /// waiting for room are offered it within seconds of the measurement. Returns the
    /// assignments written.
    pub async fn settle_provisional(&self) -> Vec<BatchSizeAssignment> {
        let now = self.clock.now_unix_ms();
        let plans: Vec<Settlement> = {
            let view = self.view();
            view.devices()
                .filter_map(|(id, device)| settlement(id, device, now))
                .collect()
        };
        let mut written = Vec::new();
        for (device_id, record, expect, assignments) in plans {
            let Some(_gate) = self.gates.try_enter(&device_id) else {
                continue;
            };
            let txn = settlement_txn(&device_id, &record, expect, &assignments);
            match self.store.transact(txn).await {
                Ok(TxnOutcome::Committed { revision }) => {
                    let mut view = self.view_mut();
                    view.apply_residents(&device_id, Some(record), revision);
                    for (a, _) in assignments {
                        tracing::info!(task = %a.task_id, device = %device_id,
                            reserved_mib = a.memory_bound_mib, batch_size = a.batch_size,
                            "provisional reservation settled at the measured peak plus the margin");
                        view.set_assignment(a.clone(), revision);
                        written.push(a);
                    }
                }
                Ok(TxnOutcome::Failed { .. }) => {
                    self.record(PlacementEvent::CasConflict);
                    tracing::debug!(device = %device_id,
                        "residents or assignments changed while settling a provisional reservation; next pass");
                }
                Err(err) => tracing::warn!(device = %device_id, %err,
                    "cannot settle a provisional reservation; retrying on the next pass"),
            }
        }
        written
    }

    fn unreserved_lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.unreserved.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every device in the view with its residents.
    pub fn list_devices(&self) -> Vec<DeviceStatus> {
        let view = self.view();
        view.devices()
            .map(|(id, device)| DeviceStatus {
                device: Some(device.info.clone().unwrap_or_else(|| DeviceInfo {
                    device_id: id.to_owned(),
                    ..Default::default()
                })),
                resident_task_ids: device
                    .residents
                    .iter()
                    .map(|r| r.reservation.task_id.clone())
                    .collect(),
                reserved_mem_mib: device.reserved_mem_mib(),
            })
            .collect()
    }
}

/// What a Release's lost comparison returned (`current`): the device's residents
/// record as it is now, with its revision, and the archive ops rebuilt from the task's
/// keys as they are now (`compares` of them follow the record, in the order of the
/// archive's compares), so the next attempt needs no read. `None`: the record is gone.
fn after_lost_release(
    current: Vec<Option<iadeep_state::KeyValue>>,
    compares: usize,
    task_id: &str,
) -> Result<Option<((DeviceResidents, i64), crate::archive::ArchiveOps)>> {
    let mut current = current.into_iter();
    let Some(kv) = current.next().flatten() else {
        return Ok(None);
    };
    let record = (typed::decode::<DeviceResidents>(&kv)?, kv.mod_revision);
    let live: Vec<iadeep_state::KeyValue> = current.take(compares).flatten().collect();
    Ok(Some((
        record,
        crate::archive::archive_ops_from(&live, task_id),
    )))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::events::Recorded;
    use crate::model::ModelledMemory;
    use crate::params::PlacerParams;
    use iadeep_predictor::{LearnerParams, OnlinePredictor};
    use iadeep_proto::{DeviceInfo, SoloProfile};
    use iadeep_state::EmbeddedStore;
    use iadeep_state::testing::{Fault, FaultStore, Op};

    /// A placer process of its own over `store`: its own view (two idle devices, no
    /// sync), policy and gates, counting nothing.
    pub(crate) fn service(store: Arc<dyn StateStore>) -> PlacementService {
        service_with(store, PlacerParams::default())
    }

    /// [`service`] deciding with `params`.
    fn service_with(store: Arc<dyn StateStore>, params: PlacerParams) -> PlacementService {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        for id in ["d0", "d1"] {
            view.upsert_device(DeviceInfo {
                device_id: id.into(),
                node: "n".into(),
                memory_mib: 16_384,
                kind: "v100".into(),
                ..Default::default()
            });
        }
        let slowdown =
            Arc::new(OnlinePredictor::new(LearnerParams::default()).expect("cold predictor"));
        let placer = Placer::new(params, slowdown).expect("valid params");
        PlacementService::new(store, Arc::new(RwLock::new(view)), Arc::new(placer))
    }

    #[tokio::test]
    async fn a_task_placed_by_another_placer_is_not_placed_twice() {
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        // Two processes whose views do not know of each other's placements yet (as
        // when both decide before either's watch delivers the other's commit).
        let (one, two) = (service(store.clone()), service(store.clone()));
        let spec = TaskSpec {
            task_id: "t".into(),
            model: "resnet50".into(),
            initial_batch_size: 64,
            gpu_mem_request_mib: 4_000,
            profile: Some(SoloProfile {
                batch_size: 64,
                step_time_s: Some(0.2),
                ..Default::default()
            }),
            ..Default::default()
        };
        let first = one
            .place(spec.clone(), vec!["d0".into()])
            .await
            .expect("first place");
        let second = two
            .place(spec, vec!["d1".into()])
            .await
            .expect("second place");
        for outcome in [&first, &second] {
            match &outcome.decision {
                place_response::Decision::Placed(p) => assert_eq!(p.device_id, "d0"),
                other => panic!("expected the placement on d0, got {other:?}"),
            }
        }
        assert!(
            store
                .get(&keys::device_residents("d1"))
                .await
                .expect("read d1")
                .is_none(),
            "the second request reserved d1 as well"
        );
    }

    /// A task this process placed, whose agent never reported, is released without a
    /// read of its keys (its Place wrote them), and they are archived all the same; once
    /// the view holds a report of the task, the Release reads them first.
    #[tokio::test]
    async fn a_release_of_keys_this_process_wrote_reads_nothing_unless_the_task_reported() {
        let (store, one) = three_placed_over_a_fault_store().await;
        let before = store.calls(Op::Range);
        assert_eq!(
            one.release("a").await.expect("release").as_deref(),
            Some("d0")
        );
        assert_eq!(store.calls(Op::Range), before, "a's keys were read");
        for key in [keys::archived_spec("a"), keys::archived_assignment("a")] {
            assert!(store.get(&key).await.expect("read").is_some(), "{key}");
        }
        assert!(
            store
                .range(&keys::task_prefix("a"))
                .await
                .expect("range")
                .kvs
                .is_empty()
        );
        // b reported (the view has it): its Release reads its keys first.
        store
            .put(&keys::task_report("b"), b"r".to_vec(), None)
            .await
            .expect("report");
        one.view_mut().set_report(iadeep_proto::TaskReport {
            task_id: "b".into(),
            ..Default::default()
        });
        let before = store.calls(Op::Range);
        assert_eq!(
            one.release("b").await.expect("release").as_deref(),
            Some("d0")
        );
        assert_eq!(store.calls(Op::Range), before + 1);
        let archived = store.get(&keys::archived_report("b")).await.expect("read");
        assert_eq!(archived.map(|kv| kv.value), Some(b"r".to_vec()));
    }

    fn resident(id: &str) -> TaskSpec {
        TaskSpec {
            task_id: id.into(),
            model: "resnet50".into(),
            initial_batch_size: 64,
            gpu_mem_request_mib: 2_000,
            profile: Some(SoloProfile {
                batch_size: 64,
                step_time_s: Some(0.2),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// A service over a [`FaultStore`] (nothing injected) with `a` and `b` placed on `d0`
    /// (a Release rewrites its residents record) and `c` alone on `d1` (a Release deletes
    /// it).
    async fn three_placed_over_a_fault_store() -> (Arc<FaultStore>, PlacementService) {
        let store = Arc::new(FaultStore::in_memory());
        let one = service(store.clone());
        for (id, device) in [("a", "d0"), ("b", "d0"), ("c", "d1")] {
            let outcome = one
                .place(resident(id), vec![device.into()])
                .await
                .expect("place");
            assert_eq!(placed(&outcome).device_id, device);
        }
        (store, one)
    }

    /// The agent's last report, written between Release's read of the task's keys and
    /// its commit, is the one archived, and nothing of the task stays under `tasks/`.
    #[tokio::test]
    async fn a_report_written_during_a_release_is_archived_not_lost() {
        let (store, one) = three_placed_over_a_fault_store().await;
        store
            .put(&keys::task_report("a"), b"old".to_vec(), None)
            .await
            .expect("report");
        // `a`: the report is rewritten; `c`: one appears that the read did not see.
        for id in ["a", "c"] {
            store.put_before_next_transaction(keys::task_report(id), b"last".to_vec());
            one.release(id).await.expect("release");
            let archived = store.get(&keys::archived_report(id)).await.expect("read");
            assert_eq!(archived.map(|kv| kv.value), Some(b"last".to_vec()), "{id}");
            let live = store
                .range(&keys::task_prefix(id))
                .await
                .expect("range")
                .kvs;
            let left: Vec<_> = live.iter().map(|kv| kv.key.as_str()).collect();
            assert!(
                !left.contains(&keys::task_report(id).as_str()),
                "{id}: {left:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_release_whose_first_attempt_committed_answers_released() {
        let (store, one) = three_placed_over_a_fault_store().await;
        store.inject_until_cleared(Op::Transact, Fault::Resend);
        for (id, device) in [("a", "d0"), ("c", "d1")] {
            let released = one.release(id).await.expect("release");
            assert_eq!(released.as_deref(), Some(device), "release of {id}");
            assert!(
                store
                    .get(&keys::task_placement(id))
                    .await
                    .expect("read")
                    .is_none()
            );
            assert_eq!(one.view().device_of(id), None, "{id} still in the view");
        }
        store.clear(Op::Transact);
        // A task that held nothing (released before) still answers "not released".
        assert_eq!(one.release("a").await.expect("release again"), None);
        // So does one released by another request: its marker is not this request's.
        let two = service(store.clone()).with_clock(Clock::from_fn(|| 1_234));
        two.view_mut().apply_residents(
            "d0",
            Some(DeviceResidents {
                device_id: "d0".into(),
                reservations: vec![Reservation {
                    task_id: "b".into(),
                    reserved_mem_mib: 2_000,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            1,
        );
        one.release("b").await.expect("release b");
        assert_eq!(two.release("b").await.expect("stale release of b"), None);
    }

    /// Yields to the other tasks until `done` says so.
    async fn until(done: impl Fn() -> bool) {
        while !done() {
            tokio::task::yield_now().await;
        }
    }

    /// Requests queued while a commit is in flight go out as one transaction; when the
    /// store re-sends it after its committed first attempt, each request still tells
    /// its own earlier commit from a competitor's: both Releases answer released, both
    /// Places answer their placement, and the view holds each device's own record.
    #[tokio::test]
    async fn a_group_whose_first_attempt_committed_answers_each_request_as_done() {
        let (store, one) = three_placed_over_a_fault_store().await;
        for id in ["d2", "d3", "d4"] {
            one.view_mut().upsert_device(DeviceInfo {
                device_id: id.into(),
                node: "n".into(),
                memory_mib: 16_384,
                kind: "v100".into(),
                ..Default::default()
            });
        }
        let x = one
            .place(resident("x"), vec!["d2".into()])
            .await
            .expect("place x");
        assert_eq!(placed(&x).device_id, "d2");
        // x's release is in flight (held in the store) while the others queue.
        store.hold_next(Op::Transact, 1);
        let first = tokio::spawn({
            let one = one.clone();
            async move { one.release("x").await }
        });
        store.until_holding(1).await;
        store.inject_until_cleared(Op::Transact, Fault::Resend);
        let releases = ["a", "c"].map(|id| {
            let one = one.clone();
            tokio::spawn(async move { one.release(id).await })
        });
        let places = [("p", "d3"), ("q", "d4")].map(|(id, device)| {
            let one = one.clone();
            tokio::spawn(async move { one.place(resident(id), vec![device.into()]).await })
        });
        until(|| one.commits.queued() == 4).await;
        store.release(1);
        assert_eq!(
            first.await.expect("joined").expect("release x").as_deref(),
            Some("d2")
        );
        for (release, device) in releases.into_iter().zip(["d0", "d1"]) {
            let released = release.await.expect("joined").expect("release");
            assert_eq!(released.as_deref(), Some(device));
        }
        for (place, device) in places.into_iter().zip(["d3", "d4"]) {
            let outcome = place.await.expect("joined").expect("place");
            assert_eq!(placed(&outcome).device_id, device);
        }
        let sent: Vec<Vec<String>> = store
            .sent_transactions()
            .iter()
            .map(|txn| txn.ops.iter().map(|op| op.key().to_owned()).collect())
            .collect();
        assert!(
            sent.iter().any(|keys| {
                ["a", "c", "p", "q"]
                    .iter()
                    .all(|id| keys.contains(&keys::task_placement(id)))
            }),
            "the four queued requests were sent as one transaction: {sent:?}"
        );
        {
            let view = one.view();
            let residents = |device: &str| -> Vec<String> {
                view.device(device)
                    .map(|d| {
                        d.residents
                            .iter()
                            .map(|r| r.reservation.task_id.clone())
                            .collect()
                    })
                    .unwrap_or_default()
            };
            assert_eq!(residents("d0"), ["b"]);
            assert!(residents("d1").is_empty(), "{:?}", residents("d1"));
        }
        for (task, device) in [("p", "d3"), ("q", "d4")] {
            let stored = store
                .get(&keys::task_placement(task))
                .await
                .expect("read")
                .map(|kv| typed::decode::<Placement>(&kv).expect("decodes").device_id);
            assert_eq!(stored.as_deref(), Some(device));
        }
    }

    #[tokio::test]
    async fn losing_every_reservation_attempt_says_how_often_and_when_to_retry() {
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let one = service_with(
            store.clone(),
            PlacerParams {
                max_reserve_attempts: 1,
                ..PlacerParams::default()
            },
        );
        // Another placer reserved part of d0; this one's view has not seen it yet, so its
        // one attempt is decided on an empty device and loses the comparison.
        let other = DeviceResidents {
            device_id: "d0".into(),
            reservations: vec![Reservation {
                task_id: "other".into(),
                reserved_mem_mib: 1_000,
                spec: Some(resident("other")),
                ..Default::default()
            }],
            ..Default::default()
        };
        typed::put(store.as_ref(), &keys::device_residents("d0"), &other, None)
            .await
            .expect("seed d0");
        let err = one
            .place(resident("t"), vec!["d0".into()])
            .await
            .expect_err("the only attempt loses");
        let PlacerError::Contention {
            lost,
            waits,
            retry_after_ms,
            ..
        } = &err
        else {
            panic!("expected contention, got {err}");
        };
        assert_eq!((*lost, *waits), (1, 0), "{err}");
        assert!(
            (crate::error::CONTENTION_RETRY_MS..2 * crate::error::CONTENTION_RETRY_MS)
                .contains(retry_after_ms),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("1 reservation attempts lost, 0 waits")
                && text.contains(&format!("retry after {retry_after_ms} ms")),
            "{text}"
        );
        // What it lost to is in the view now: asking again places it next to the other.
        let again = one.place(resident("t"), vec!["d0".into()]).await;
        assert_eq!(placed(&again.expect("retry")).device_id, "d0");
    }

    #[tokio::test]
    async fn a_reservation_carries_only_the_batch_sizes_the_tuner_can_choose() {
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let one = service(store.clone());
        let task = TaskSpec {
            min_batch_size: 1,
            max_batch_size: 4096,
            allowed_batch_sizes: (1..=validate::MAX_ALLOWED_BATCH_SIZES as u32)
                .map(|i| i * 4)
                .collect(),
            submitted_at_unix_ms: iadeep_proto::now_unix_ms(),
            ..resident("many-sizes")
        };
        let outcome = one
            .place(task.clone(), vec!["d0".into()])
            .await
            .expect("place");
        assert_eq!(placed(&outcome).device_id, "d0");
        let (record, _) =
            typed::get::<DeviceResidents>(store.as_ref(), &keys::device_residents("d0"))
                .await
                .expect("read")
                .expect("reserved");
        let copy = record.reservations[0].spec.clone().expect("spec copy");
        let candidates = iadeep_tuner::candidate_sizes(&task);
        assert_eq!(copy.allowed_batch_sizes, candidates);
        assert_eq!(iadeep_tuner::candidate_sizes(&copy), candidates);
        assert!(candidates.len() < 20, "{candidates:?}");
        assert_eq!(copy.submitted_at_unix_ms, 0);
        assert_eq!(
            copy,
            TaskSpec {
                allowed_batch_sizes: candidates,
                submitted_at_unix_ms: 0,
                ..task.clone()
            }
        );
        // The task's own spec key keeps the whole spec.
        let (kept, _) = typed::get::<TaskSpec>(store.as_ref(), &keys::task_spec("many-sizes"))
            .await
            .expect("read")
            .expect("spec");
        assert_eq!(kept, task);
    }

    /// A job as `iadeep run` submits it from the README's quick start: a model name and
    /// batch sizes, no memory figure, no profile.
    fn cold_job(id: &str) -> TaskSpec {
        TaskSpec {
            task_id: id.into(),
            model: "mnist-like".into(),
            initial_batch_size: 64,
            min_batch_size: 16,
            max_batch_size: 512,
            ..Default::default()
        }
    }

    fn report_peak(service: &PlacementService, task: &str, device: &str, peak_mib: u64) {
        service.view_mut().set_report(iadeep_proto::TaskReport {
            task_id: task.into(),
            device_id: device.into(),
            batch_size: 64,
            step_time_s: 0.1,
            peak_mem_mib: Some(peak_mib),
            peak_mem_batch_size: 64,
            seq: 1,
            ..Default::default()
        });
    }

    fn reserved(service: &PlacementService, device: &str) -> Vec<(String, u64, bool)> {
        service
            .view()
            .device(device)
            .map(|d| {
                d.residents
                    .iter()
                    .map(|r| {
                        let r = &r.reservation;
                        (r.task_id.clone(), r.reserved_mem_mib, r.provisional)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The quick start's two jobs, neither with a memory figure: the first takes the idle
    /// card provisionally; its measured peak settles its reservation (and moves its fence,
    /// its assignment's bound, in a new round); the second is then granted the free
    /// memory on the same card, provisionally, with its predicted slowdown for the tuner.
    #[tokio::test]
    async fn jobs_without_a_memory_figure_share_a_card_once_the_first_is_measured() {
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let service = service(store.clone());
        let only = vec!["d0".to_owned()];
        let first = service
            .place(cold_job("a"), only.clone())
            .await
            .expect("place a");
        // Alone on the card: the whole card, provisionally.
        assert_eq!(placed(&first).reserved_mem_mib, 16_384);
        assert_eq!(reserved(&service, "d0"), vec![("a".into(), 16_384, true)]);
        let start = &first.assignments[0];
        assert_eq!(start.predicted_slowdown, Some(1.0));
        assert_eq!(start.memory_bound_mib, Some(16_384.0));
        let usable = PlacerParams::default().usable_memory_mib(16_384);

        // Not measured yet: a second guess would stack on the first.
        let early = service
            .place(cold_job("b"), only.clone())
            .await
            .expect("place b early");
        assert!(
            early.explanation.summary.contains("unknown_task_memory: 1"),
            "{}",
            early.explanation.summary
        );
        assert!(service.settle_provisional().await.is_empty());

        report_peak(&service, "a", "d0", 800);
        let settled = service.settle_provisional().await;
        assert_eq!(settled.len(), 1);
        assert_eq!(settled[0].batch_size, 64);
        // 800 MiB plus the one margin: 5 % and 256 MiB.
        assert_eq!(settled[0].memory_bound_mib, Some(1096.0));
        assert!(settled[0].round > start.round);
        assert_eq!(reserved(&service, "d0"), vec![("a".into(), 1096, false)]);
        let stored = typed::get::<DeviceResidents>(store.as_ref(), &keys::device_residents("d0"))
            .await
            .expect("read")
            .expect("record");
        assert_eq!(stored.0.reservations[0].reserved_mem_mib, 1096);
        let fence = typed::get::<BatchSizeAssignment>(store.as_ref(), &keys::task_assignment("a"))
            .await
            .expect("read")
            .expect("assignment");
        assert_eq!(fence.0.memory_bound_mib, Some(1096.0));
        let (placement, _) = typed::get::<Placement>(store.as_ref(), &keys::task_placement("a"))
            .await
            .expect("read")
            .expect("placement");
        assert_eq!(placement.reserved_mem_mib, 1096);
        // Settled once: nothing left to do.
        assert!(service.settle_provisional().await.is_empty());

        let second = service.place(cold_job("b"), only).await.expect("place b");
        let grant = placed(&second).reserved_mem_mib;
        assert_eq!(placed(&second).device_id, "d0");
        // Everything the first job (at its settled reservation) and the card's margin
        // leave.
        assert_eq!(grant, usable - 1096, "granted {grant} of {usable}");
        assert_eq!(
            reserved(&service, "d0"),
            vec![("a".into(), 1096, false), ("b".into(), grant, true)]
        );
        let start_b = &second.assignments[0];
        assert_eq!(start_b.memory_bound_mib, Some(grant as f64));
        assert!(start_b.predicted_slowdown.is_some_and(|s| s >= 1.0));
    }

    /// A job of a model an earlier job measured starts with that profile (filled by the
    /// placer, marked as from the registry), so it is sized by it, not granted a guess.
    #[tokio::test]
    async fn a_job_of_a_known_model_starts_with_the_registry_profile() {
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let service = service(store.clone());
        iadeep_state::registry::record(
            store.as_ref(),
            "mnist-like",
            "v100",
            &[iadeep_proto::ProfilePoint {
                batch_size: 64,
                solo_step_time_s: Some(0.05),
                peak_mem_mib: Some(900),
                measured_at_unix_ms: 1,
            }],
        )
        .await
        .expect("record");
        let outcome = service
            .place(cold_job("a"), vec!["d0".into()])
            .await
            .expect("place");
        // Sized by the registry's peak (alone on the card: its bound, not the card).
        assert!(placed(&outcome).reserved_mem_mib < 2_000, "{outcome:?}");
        let (spec, _) = typed::get::<TaskSpec>(store.as_ref(), &keys::task_spec("a"))
            .await
            .expect("read")
            .expect("spec");
        let profile = spec.profile.expect("filled from the registry");
        assert!(profile.from_registry);
        assert_eq!(
            (
                profile.batch_size,
                profile.peak_mem_mib,
                profile.step_time_s
            ),
            (64, Some(900), Some(0.05))
        );
        assert!(!reserved(&service, "d0")[0].2, "not provisional");
    }

    /// Settling never raises a grant: a job that used nearly all it was granted keeps the
    /// grant, so the fences of a card's jobs never add up to more than the card.
    #[tokio::test]
    async fn a_settled_reservation_is_never_above_the_grant() {
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let service = service(store);
        service
            .place(cold_job("a"), vec!["d0".into()])
            .await
            .expect("place a");
        report_peak(&service, "a", "d0", 16_000);
        let settled = service.settle_provisional().await;
        assert_eq!(settled[0].memory_bound_mib, Some(16_384.0));
        assert_eq!(reserved(&service, "d0"), vec![("a".into(), 16_384, false)]);
    }

    /// A card with less than the minimum share free takes no job it knows nothing of.
    #[tokio::test]
    async fn an_unknown_job_needs_a_share_of_the_card_free() {
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let service = service(store);
        let only = vec!["d0".to_owned()];
        service
            .place(cold_job("a"), only.clone())
            .await
            .expect("place a");
        report_peak(&service, "a", "d0", 12_000);
        assert_eq!(service.settle_provisional().await.len(), 1);
        let b = service.place(cold_job("b"), only).await.expect("place b");
        assert!(
            matches!(b.decision, place_response::Decision::Queued(_)),
            "{:?}",
            b.decision
        );
        assert!(
            b.explanation.summary.contains("memory: 1"),
            "{}",
            b.explanation.summary
        );
    }

    /// A 12 GB job: 6 GB at its m0 = 64 (measured alone), 12 GB at 128.
    fn twelve_gb_job(id: &str) -> TaskSpec {
        TaskSpec {
            task_id: id.into(),
            model: "big".into(),
            initial_batch_size: 64,
            min_batch_size: 32,
            max_batch_size: 256,
            lr_rule: iadeep_proto::LrScalingRule::Linear as i32,
            profile: Some(SoloProfile {
                batch_size: 64,
                step_time_s: Some(0.2),
                peak_mem_mib: Some(6_000),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn placed(outcome: &PlaceOutcome) -> &Placement {
        match &outcome.decision {
            place_response::Decision::Placed(p) => p,
            other => panic!("expected a placement, got {other:?}"),
        }
    }

    /// Memory safety (docs/design.md): the tuner grew a resident to 128 (12 GB); a second
    /// job must not land next to it as if it still ran at its smallest size. The placement
    /// makes room first: the resident's shrink back to 64 is in the same transaction as the
    /// newcomer's reservation and starting assignment, in one round above the tuner's.
    #[tokio::test]
    async fn a_grown_resident_is_counted_at_its_size_and_shrunk_to_make_room() {
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let placer = service(store.clone());
        let first = placer
            .place(twelve_gb_job("a"), vec!["d0".into()])
            .await
            .expect("first place");
        assert_eq!(placed(&first).batch_size, 64);
        assert_eq!(first.assignments.len(), 1, "the starting assignment");
        assert_eq!(first.assignments[0].batch_size, 64);
        // The tuner grows `a` to 128 and its agent reports 12 GB there.
        let grown = BatchSizeAssignment {
            task_id: "a".into(),
            batch_size: 128,
            lr_factor: 2.0,
            round: 7,
            memory_bound_mib: Some(12_300.0),
            ..Default::default()
        };
        let rev = store
            .put(&keys::task_assignment("a"), grown.encode_to_vec(), None)
            .await
            .expect("tuner's assignment");
        placer.view_mut().set_assignment(grown, rev);
        placer.view_mut().set_report(iadeep_proto::TaskReport {
            task_id: "a".into(),
            batch_size: 128,
            peak_mem_mib: Some(12_000),
            peak_mem_batch_size: 128,
            ..Default::default()
        });
        let used = placer.view().device("d0").expect("d0").summary().used_mib;
        assert!(used >= 12_300, "the resident counts at 128: {used} MiB");
        let second = placer
            .place(twelve_gb_job("b"), vec!["d0".into()])
            .await
            .expect("second place");
        assert_eq!(placed(&second).device_id, "d0");
        let shrink = second
            .assignments
            .iter()
            .find(|a| a.task_id == "a")
            .expect("`a` shrunk to make room");
        assert!(shrink.batch_size < 128, "{shrink:?}");
        assert!(shrink.round > 7, "above the tuner's round");
        // What the store holds now fits the card with the margin.
        let stored = typed::get::<BatchSizeAssignment>(store.as_ref(), &keys::task_assignment("a"))
            .await
            .expect("read")
            .expect("assignment");
        assert_eq!(stored.0.batch_size, shrink.batch_size);
        let usable = PlacerParams::default().usable_memory_mib(16_384);
        let total: f64 = second
            .assignments
            .iter()
            .map(|a| a.memory_bound_mib.expect("bound"))
            .sum();
        assert!(total <= usable as f64, "{total} MiB > {usable}");
    }

    /// A tuner's assignment committed between a decision and its transaction: the
    /// transaction compares the residents' assignments, fails, and the task is decided
    /// again with the resident at its new size.
    #[tokio::test]
    async fn a_resident_grown_after_the_decision_makes_the_placement_decide_again() {
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let events = Arc::new(Recorded::default());
        let placer = service(store.clone()).with_events(events.clone());
        placer
            .place(twelve_gb_job("a"), vec!["d0".into()])
            .await
            .expect("first place");
        // The store moves on without the view: the tuner grows `a` (its watch is late).
        let grown = BatchSizeAssignment {
            task_id: "a".into(),
            batch_size: 256,
            round: 9,
            memory_bound_mib: Some(15_000.0),
            ..Default::default()
        };
        store
            .put(&keys::task_assignment("a"), grown.encode_to_vec(), None)
            .await
            .expect("tuner's assignment");
        let second = placer
            .place(twelve_gb_job("b"), vec!["d0".into()])
            .await
            .expect("second place");
        // Decided again on the grown resident: `a` must give memory back for `b`.
        let shrink = second.assignments.iter().find(|a| a.task_id == "a");
        assert!(
            shrink.is_some_and(|a| a.batch_size < 256 && a.round > 9),
            "{:?}",
            second.assignments
        );
        assert!(events.count(PlacementEvent::CasConflict) >= 1);
    }

    /// Task `a` placed on `device`, its agent running and reporting from there (what the
    /// sync tells the view in the daemon), then released.
    async fn released_while_it_runs(device: &str) -> (Arc<dyn StateStore>, PlacementService) {
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let placer = service(store.clone());
        placer
            .place(twelve_gb_job("a"), vec![device.into()])
            .await
            .expect("place");
        {
            let mut view = placer.view_mut();
            view.set_alive("a");
            view.set_report(iadeep_proto::TaskReport {
                task_id: "a".into(),
                device_id: device.into(),
                batch_size: 64,
                ..Default::default()
            });
        }
        placer.release("a").await.expect("release");
        assert_eq!(placer.view().device_of("a"), None);
        (store, placer)
    }

    /// A task released while its agent runs is admitted again on its
    /// device by the same reservation transaction as a Place, when it fits there.
    #[tokio::test]
    async fn a_task_released_while_it_runs_is_admitted_again_on_its_device() {
        let (store, placer) = released_while_it_runs("d1").await;
        let events = Arc::new(Recorded::default());
        let placer = placer.with_events(events.clone());

        assert_eq!(placer.readmit_running().await, vec!["a".to_owned()]);
        let (placement, _) = typed::get::<Placement>(store.as_ref(), &keys::task_placement("a"))
            .await
            .expect("read")
            .expect("placed again");
        assert_eq!(placement.device_id, "d1", "on the device it runs on");
        let (record, _) =
            typed::get::<DeviceResidents>(store.as_ref(), &keys::device_residents("d1"))
                .await
                .expect("read")
                .expect("reserved");
        assert!(record.reservations.iter().any(|r| r.task_id == "a"));
        assert_eq!(events.count(PlacementEvent::Readmitted), 1);
        assert_eq!(events.unreserved_running(), 0);
        // Holding its reservation, it is not found again.
        assert!(placer.readmit_running().await.is_empty());
    }

    /// ... and reported (the gauge) when its device has no room for it any more.
    #[tokio::test]
    async fn a_task_running_without_room_on_its_device_is_reported() {
        let (store, placer) = released_while_it_runs("d0").await;
        let events = Arc::new(Recorded::default());
        let placer = placer.with_events(events.clone());
        // Its memory, no longer reserved, goes to a job that takes the whole card.
        let mut whole_card = twelve_gb_job("b");
        whole_card.min_batch_size = 256;
        whole_card.initial_batch_size = 256;
        whole_card.max_batch_size = 256;
        whole_card.profile = Some(SoloProfile {
            batch_size: 256,
            step_time_s: Some(0.2),
            peak_mem_mib: Some(14_500),
            ..Default::default()
        });
        let b = placer
            .place(whole_card, vec!["d0".into()])
            .await
            .expect("place b");
        assert_eq!(placed(&b).device_id, "d0");

        assert!(placer.readmit_running().await.is_empty());
        assert_eq!(events.unreserved_running(), 1);
        assert_eq!(events.count(PlacementEvent::Readmitted), 0);
        assert!(
            store
                .get(&keys::task_placement("a"))
                .await
                .expect("read")
                .is_none()
        );
        assert_eq!(
            placer.view().waiting().count(),
            0,
            "a running task does not wait ahead of new ones"
        );
        // Once its agent is gone, it is no longer counted.
        placer.view_mut().set_not_alive("a", 0);
        placer.readmit_running().await;
        assert_eq!(events.unreserved_running(), 0);
    }

    /// Concurrent requests for similar tasks choose the same device; one committing
    /// there must not make the others queue behind it while another device takes them.
    #[tokio::test]
    async fn a_device_being_reserved_by_another_request_is_passed_over() {
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let events = Arc::new(Recorded::default());
        let one = service(store).with_events(events.clone());
        let task = resident("t");
        let Verdict::Place { device_id, .. } =
            one.placer().decide(&one.view(), &task, &[], 0).verdict
        else {
            panic!("an idle cluster places the task");
        };
        let other = if device_id == "d0" { "d1" } else { "d0" };
        let _held = one.gates.try_enter(&device_id).expect("open gate");
        // The gate stays shut for the whole test: a request waiting at it never returns
        // (the timeout only keeps a failing test from hanging).
        let outcome = tokio::time::timeout(Duration::from_secs(30), one.place(task, vec![]))
            .await
            .expect("placed without waiting for the busy device")
            .expect("place");
        assert_eq!(placed(&outcome).device_id, other);
        // Restricted to the busy device, a request still waits for it: driven until it
        // says it waits at the busy device's gate, it has neither answered nor reserved
        // the other device (a request that went elsewhere would answer before waiting).
        let waiting = one.place(resident("u"), vec![device_id.clone()]);
        tokio::pin!(waiting);
        let until_gate_wait = async {
            while events.count(PlacementEvent::GateWait) == 0 {
                tokio::select! {
                    biased;
                    answered = &mut waiting => {
                        panic!("a request that may only use the busy device answered: {answered:?}")
                    }
                    () = tokio::task::yield_now() => {}
                }
            }
        };
        // The timeout only keeps a failing test from hanging.
        tokio::time::timeout(Duration::from_secs(30), until_gate_wait)
            .await
            .expect("the restricted request waits at the busy device's gate");
        let record = one
            .store
            .get(&keys::device_residents(other))
            .await
            .expect("read");
        let record = record.map(|kv| typed::decode::<DeviceResidents>(&kv).expect("decode"));
        let holds_u = record.is_some_and(|r| r.reservations.iter().any(|r| r.task_id == "u"));
        assert!(!holds_u, "the restricted request reserved the other device");
        let placement = one.store.get(&keys::task_placement("u")).await;
        assert!(placement.expect("read").is_none(), "u was placed");
    }

    #[tokio::test]
    async fn a_device_gate_admits_one_and_wakes_the_waiters_when_it_opens() {
        let gates = Arc::new(DeviceGates::default());
        let held = gates.try_enter("d0").expect("open gate");
        assert!(gates.try_enter("d0").is_none(), "one holder at a time");
        assert!(gates.try_enter("d1").is_some(), "gates are per device");
        // The waiter, polled by hand: no time to wait out for it to have run, and the
        // wake itself is seen, not inferred from a task finishing in time.
        struct Woken(std::sync::atomic::AtomicBool);
        impl std::task::Wake for Woken {
            fn wake(self: Arc<Self>) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let woken = Arc::new(Woken(false.into()));
        let waker = std::task::Waker::from(woken.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        let mut waiter = Box::pin(async {
            gates.wait("d0").await;
            gates.try_enter("d0").is_some()
        });
        assert!(
            waiter.as_mut().poll(&mut cx).is_pending(),
            "waits while the gate is held"
        );
        drop(held);
        assert!(
            woken.0.load(std::sync::atomic::Ordering::SeqCst),
            "woken when the gate opens"
        );
        assert_eq!(waiter.as_mut().poll(&mut cx), std::task::Poll::Ready(true));
        drop(waiter);
        // An open gate does not make anyone wait.
        tokio::time::timeout(std::time::Duration::from_secs(1), gates.wait("d0"))
            .await
            .expect("no wait on an open gate");
    }

    /// Every task with company slows down by 0.1 per co-runner (certain): a
    /// production job with a cap of 1.1 shares its card with one job, not two.
    #[derive(Debug)]
    struct PerCoRunner;

    impl iadeep_predictor::SlowdownModel for PerCoRunner {
        fn predict(
            &self,
            _: &str,
            _: &iadeep_proto::TaskProfile,
            co: &[iadeep_proto::TaskProfile],
        ) -> Prediction {
            Prediction::certain(
                1.0 + 0.1 * co.len() as f64,
                iadeep_predictor::PredictionSource::Given,
            )
        }
        fn observe(&self, _: &iadeep_proto::CoLocationSample) {}
    }

    /// A service over `store` deciding with [`PerCoRunner`] on the two idle devices
    /// of [`service`], reading the time from `now` and recording its events.
    fn capped_service(
        store: Arc<dyn StateStore>,
        now: Arc<std::sync::atomic::AtomicI64>,
    ) -> (PlacementService, Arc<Recorded>) {
        capped_service_with(store, now, PlacerParams::default())
    }

    /// [`capped_service`] deciding with `params`.
    fn capped_service_with(
        store: Arc<dyn StateStore>,
        now: Arc<std::sync::atomic::AtomicI64>,
        params: PlacerParams,
    ) -> (PlacementService, Arc<Recorded>) {
        let base = service(store.clone());
        let view = base.view().clone();
        let placer = Placer::new(params, Arc::new(PerCoRunner)).expect("valid");
        let events = Arc::new(Recorded::default());
        let service = PlacementService::new(store, Arc::new(RwLock::new(view)), Arc::new(placer))
            .with_clock(Clock::from_fn(move || {
                now.load(std::sync::atomic::Ordering::SeqCst)
            }))
            .with_events(events.clone());
        (service, events)
    }

    /// A task of `mib` MiB (its request), production with a cap of 1.1 when `production`.
    fn job(id: &str, mib: u64, production: bool) -> TaskSpec {
        TaskSpec {
            task_id: id.into(),
            initial_batch_size: 32,
            gpu_mem_request_mib: mib,
            priority_class: if production {
                iadeep_proto::PriorityClass::Production as i32
            } else {
                iadeep_proto::PriorityClass::Opportunistic as i32
            },
            max_slowdown: production.then_some(1.1),
            profile: Some(SoloProfile {
                batch_size: 32,
                step_time_s: Some(0.1),
                sm_util_pct: Some(10.0),
                mem_bw_util_pct: Some(5.0),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn queued(outcome: &PlaceOutcome) -> &QueueDecision {
        match &outcome.decision {
            place_response::Decision::Queued(q) => q,
            other => panic!("expected queued, got {other:?}"),
        }
    }

    async fn stored_record(store: &dyn StateStore, device: &str) -> (DeviceResidents, i64) {
        let kv = store
            .get(&keys::device_residents(device))
            .await
            .expect("read")
            .expect("a residents record");
        (
            typed::decode::<DeviceResidents>(&kv).expect("decode"),
            kv.mod_revision,
        )
    }

    /// Issue 27, room evictions: a production job that fits no device under the caps
    /// evicts the opportunistic job that ran least, in one transaction with its claim,
    /// and is told to come back; until the victim releases, nothing is placed on its
    /// memory (the claimant waits, without evicting again, and others find the room
    /// claimed), and once it has, the claimant takes the room and the claim is gone.
    #[tokio::test]
    async fn a_room_eviction_evicts_claims_and_places_the_claimant_after_the_victim_leaves() {
        use std::sync::atomic::{AtomicI64, Ordering};
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let now = Arc::new(AtomicI64::new(1_000));
        let (placer, events) = capped_service(store.clone(), now.clone());
        let d0 = || vec!["d0".to_owned()];
        placer
            .place(job("old", 6_000, false), d0())
            .await
            .expect("old");
        now.store(2_000, Ordering::SeqCst);
        placer
            .place(job("young", 6_000, false), d0())
            .await
            .expect("young");
        now.store(10_000, Ordering::SeqCst);
        // 12,000 MiB of 16,384 are taken: 6,000 more do not fit with the margin.
        let first = placer
            .place(job("prod", 6_000, true), d0())
            .await
            .expect("prod");
        let q = queued(&first);
        assert!(
            q.reason.contains("evicting opportunistic young on d0"),
            "{}",
            q.reason
        );
        assert_eq!(q.retry_after_ms, 5_000);
        assert_eq!(
            events.count(PlacementEvent::Evicted(EvictionTrigger::Room)),
            1
        );
        // One transaction: the record with the claim and the victim's evict assignment.
        let (record, record_rev) = stored_record(store.as_ref(), "d0").await;
        assert_eq!(
            record.reservations.len(),
            2,
            "the victim's memory still counts"
        );
        assert_eq!(
            record.claims,
            vec![Claim {
                task_id: "prod".into(),
                mem_mib: 6_000,
                until_unix_ms: 70_000,
                evicting: vec!["young".into()],
            }]
        );
        let kv = store
            .get(&keys::task_assignment("young"))
            .await
            .expect("read")
            .expect("young's assignment");
        assert_eq!(
            kv.mod_revision, record_rev,
            "written in the same transaction"
        );
        let evict = typed::decode::<BatchSizeAssignment>(&kv).expect("decode");
        assert!(evict.evict, "{evict:?}");
        assert!(
            evict.evict_reason.contains("production job prod"),
            "{evict:?}"
        );
        assert_eq!(evict.batch_size, 32, "its size repeated");
        let old = typed::get::<BatchSizeAssignment>(store.as_ref(), &keys::task_assignment("old"))
            .await
            .expect("read")
            .expect("old's assignment");
        assert!(!old.0.evict);

        // The victim has not left: the claimant waits for it, evicting nobody else.
        now.store(15_000, Ordering::SeqCst);
        let again = placer
            .place(job("prod", 6_000, true), d0())
            .await
            .expect("retry");
        assert!(
            queued(&again).reason.contains("waiting for young to leave"),
            "{:?}",
            again
        );
        assert_eq!(
            events.count(PlacementEvent::Evicted(EvictionTrigger::Room)),
            1
        );

        // The victim releases: the record keeps the claim.
        placer.release("young").await.expect("release");
        let (record, _) = stored_record(store.as_ref(), "d0").await;
        assert_eq!(record.claims.len(), 1);
        // Another job of the same size finds the room claimed.
        let other = placer
            .place(job("other", 6_000, false), d0())
            .await
            .expect("other");
        assert!(queued(&other).reason.contains("claimed: 1"), "{other:?}");
        // The claimant takes it, and its claim is spent.
        now.store(20_000, Ordering::SeqCst);
        let placed_prod = placer
            .place(job("prod", 6_000, true), d0())
            .await
            .expect("prod placed");
        assert_eq!(placed(&placed_prod).device_id, "d0");
        let (record, _) = stored_record(store.as_ref(), "d0").await;
        assert!(record.claims.is_empty(), "{record:?}");
        assert_eq!(record.reservations.len(), 2);
    }

    /// Queued tasks are placed in the order they were submitted, whichever asks first
    /// when room appears; a waiter that does not come back holds the room only for
    /// [`PlacerParams::waiter_hold`].
    #[tokio::test]
    async fn room_that_appears_goes_to_the_task_submitted_first() {
        use std::sync::atomic::{AtomicI64, Ordering};
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        // Submission times must be real ones: a day ago is the start.
        let t0 = iadeep_proto::now_unix_ms() - 86_400_000;
        let now = Arc::new(AtomicI64::new(t0));
        // A hold shorter than the 10 s a held answer keeps a task waiting (twice the
        // 5 s retry hint), so the end of the hold is what the last step sees.
        let hold = 3_000;
        let params = PlacerParams {
            waiter_hold: Duration::from_millis(3_000),
            ..PlacerParams::default()
        };
        let (placer, events) = capped_service_with(store.clone(), now.clone(), params);
        let d0 = || vec!["d0".to_owned()];
        let submitted = |id: &str, at: i64| TaskSpec {
            submitted_at_unix_ms: at,
            ..job(id, 12_000, false)
        };
        placer
            .place(job("resident", 12_000, false), d0())
            .await
            .expect("resident");
        for (id, at) in [("early", 2_000), ("late", 3_000), ("later", 3_500)] {
            let at = t0 + at;
            now.store(at, Ordering::SeqCst);
            let q = placer.place(submitted(id, at), d0()).await.expect(id);
            assert!(queued(&q).reason.contains("memory"), "{id}: {q:?}");
        }
        placer.release("resident").await.expect("release");
        // The later tasks ask first: the room is held for the earliest.
        now.store(t0 + 5_000, Ordering::SeqCst);
        for id in ["later", "late"] {
            let q = placer.place(submitted(id, 0), d0()).await.expect(id);
            assert!(
                queued(&q).reason.contains("d0 is held for early"),
                "{id}: {q:?}"
            );
        }
        let p = placer
            .place(submitted("early", t0 + 2_000), d0())
            .await
            .expect("early");
        assert_eq!(placed(&p).device_id, "d0");
        assert_eq!(events.count(PlacementEvent::Held), 2);
        // Without a word from the task ahead, its hold ends `waiter_hold` after it began,
        // however recently the task held back started waiting behind it.
        placer.release("early").await.expect("release early");
        now.store(t0 + 6_000, Ordering::SeqCst);
        let q = placer
            .place(submitted("later", 0), d0())
            .await
            .expect("later");
        assert!(queued(&q).reason.contains("held for late"), "{q:?}");
        placer.release("later").await.expect("later gives up");
        now.store(t0 + 8_000, Ordering::SeqCst);
        let latest = submitted("latest", t0 + 7_000);
        let q = placer.place(latest.clone(), d0()).await.expect("latest");
        assert!(queued(&q).reason.contains("held for late"), "{q:?}");
        now.store(t0 + 6_000 + hold, Ordering::SeqCst);
        let p = placer.place(latest, d0()).await.expect("latest again");
        assert_eq!(placed(&p).device_id, "d0");
    }

    /// A claim whose claimant does not come back holds its room only until it expires,
    /// also on a device its victims left empty; a production job that fits does not
    /// evict, and an opportunistic one never does.
    #[tokio::test]
    async fn a_room_claim_expires_and_only_production_jobs_evict() {
        use std::sync::atomic::{AtomicI64, Ordering};
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let now = Arc::new(AtomicI64::new(1_000));
        let (placer, events) = capped_service(store.clone(), now.clone());
        let d0 = || vec!["d0".to_owned()];
        placer
            .place(job("opp", 12_000, false), d0())
            .await
            .expect("opp");
        // An opportunistic job that does not fit just queues.
        let q = placer
            .place(job("opp2", 6_000, false), d0())
            .await
            .expect("opp2");
        assert!(!queued(&q).reason.contains("evicting"), "{q:?}");
        // It gives up (its `iadeep run` is stopped), so it holds no room for later jobs.
        placer.release("opp2").await.expect("withdraw opp2");
        // A production job evicts the only resident.
        let q = placer
            .place(job("prod", 6_000, true), d0())
            .await
            .expect("prod");
        assert!(
            queued(&q)
                .reason
                .contains("evicting opportunistic opp on d0"),
            "{q:?}"
        );
        assert_eq!(
            events.count(PlacementEvent::Evicted(EvictionTrigger::Room)),
            1
        );
        placer.release("opp").await.expect("release");
        // The record stays for the claim, although nobody is resident.
        let (record, _) = stored_record(store.as_ref(), "d0").await;
        assert!(record.reservations.is_empty());
        assert_eq!(record.claims.len(), 1);
        // Before expiry the claimed room is not another's (6,000 + 12,000 > usable) ...
        now.store(60_000, Ordering::SeqCst);
        let q = placer
            .place(job("big", 12_000, false), d0())
            .await
            .expect("big");
        assert!(queued(&q).reason.contains("claimed: 1"), "{q:?}");
        // ... after it, it is, and the expired claim is dropped with the rewrite.
        now.store(61_001, Ordering::SeqCst);
        let p = placer
            .place(job("big", 12_000, false), d0())
            .await
            .expect("big later");
        assert_eq!(placed(&p).device_id, "d0");
        let (record, _) = stored_record(store.as_ref(), "d0").await;
        assert!(record.claims.is_empty(), "{record:?}");
    }

    /// The cap rule over the store: a production resident with a cap of 1.1 takes one
    /// co-runner (1.1) but not a second (1.2), and the refusals are counted.
    #[tokio::test]
    async fn a_production_resident_is_protected_and_refusals_are_counted() {
        use std::sync::atomic::AtomicI64;
        let store: Arc<dyn StateStore> =
            Arc::new(EmbeddedStore::in_memory().expect("in-memory store"));
        let (placer, events) = capped_service(store, Arc::new(AtomicI64::new(1_000)));
        let d0 = || vec!["d0".to_owned()];
        placer
            .place(job("prod", 2_000, true), d0())
            .await
            .expect("prod");
        let one = placer.place(job("a", 2_000, false), d0()).await.expect("a");
        assert_eq!(placed(&one).device_id, "d0");
        let two = placer.place(job("b", 2_000, false), d0()).await.expect("b");
        let reason = &queued(&two).reason;
        assert!(
            reason.contains("slowdown caps refused d0 (production job prod up to 1.20 > cap 1.10)"),
            "{reason}"
        );
        assert_eq!(events.count(PlacementEvent::CapRefusal), 1);
    }
}
