//! The in-memory picture of the cluster that decisions are made on.
//!
//! Decisions must be fast and must never wait for the store, so the daemon keeps
//! this view up to date from a watch (see [`crate::sync`]) and the simulator
//! builds one directly. The view is plain data: applying an event is a map
//! update, and stale events (older than what the view holds) are ignored, so the
//! same record may arrive twice (from our own compare-and-swap and from the
//! watch) without harm.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use iadeep_objective::MemoryMargin;
use iadeep_proto::{
    AvoidPairing, BatchSizeAssignment, CapBreach, Claim, DeviceInfo, DeviceResidents, Reservation,
    TaskProfile, TaskReport, TaskSpec,
};
use iadeep_state::{Revision, WatchEvent};

use crate::model::MemoryEstimator;

/// One task holding part of a device, with what the placer knows of how it runs.
#[derive(Clone, Debug, PartialEq)]
pub struct Resident {
    pub reservation: Reservation,
    /// The task's latest report, if its agent has reported yet.
    pub report: Option<TaskReport>,
    /// The task's current batch-size assignment (the tuner's, or the placer's starting or
    /// shrinking one) and its key's mod-revision, which a placement on the device compares.
    pub assignment: Option<(BatchSizeAssignment, Revision)>,
    /// The task as the slowdown model sees it, derived from spec and report.
    pub profile: TaskProfile,
    /// When the task is predicted to finish (Unix ms), from its last report; computed
    /// once per report because every decision asks.
    finish_at_unix_ms: Option<i64>,
}

impl Resident {
    /// A resident from its reservation, latest report and current assignment.
    pub fn new(
        reservation: Reservation,
        report: Option<TaskReport>,
        assignment: Option<(BatchSizeAssignment, Revision)>,
    ) -> Resident {
        let spec = reservation.spec.clone().unwrap_or_default();
        let profile = profile_of(&spec, report.as_ref());
        let finish_at_unix_ms = report.as_ref().and_then(|r| finish_at(&spec, r));
        Resident {
            reservation,
            report,
            assignment,
            profile,
            finish_at_unix_ms,
        }
    }

    /// The batch size the task runs at, or is about to: its assignment's, else the one it
    /// last reported, else its submitted m0.
    pub fn batch_size(&self) -> u32 {
        self.assignment
            .as_ref()
            .map(|(a, _)| a.batch_size)
            .filter(|&b| b > 0)
            .or_else(|| {
                self.report
                    .as_ref()
                    .map(|r| r.batch_size)
                    .filter(|&b| b > 0)
            })
            .unwrap_or_else(|| self.spec().initial_batch_size.max(1))
    }

    /// The memory the task is counted at (docs/design.md, "Memory safety"): the largest of what
    /// was reserved for it, the peak it reported, its assigner's bound at the batch size
    /// it is assigned, and the estimator's bound there. Never its smallest allowed size:
    /// the tuner may have grown it.
    pub fn footprint_mib(&self, memory: &dyn MemoryEstimator) -> u64 {
        let reported = self.report.as_ref().and_then(|r| r.peak_mem_mib);
        let assigned = self
            .assignment
            .as_ref()
            .and_then(|(a, _)| a.memory_bound_mib)
            .filter(|m| m.is_finite() && *m > 0.0)
            .map(|m| m.ceil() as u64);
        let modelled = memory.bound_mib(self.spec(), self.report.as_ref(), self.batch_size());
        [
            Some(self.reservation.reserved_mem_mib),
            reported,
            assigned,
            modelled,
        ]
        .into_iter()
        .flatten()
        .max()
        .unwrap_or(0)
    }

    /// The sizes the task could be shrunk to, each with the MiB it would be counted at
    /// there: first the size it runs at with its footprint ([`Resident::footprint_mib`]),
    /// then its smaller candidate sizes ([`iadeep_tuner::candidate_sizes`], the tuner's
    /// lattice) downwards at the estimator's bound, as far as the estimator gives one.
    ///
    /// A task that is leaving ([`Resident::leaving`]) has only the first: its agent
    /// applies no assignment any more, so a shrink written for it would count it at a
    /// size it never runs at and let a newcomer into memory it still holds.
    pub fn shrink_steps(&self, memory: &dyn MemoryEstimator) -> Vec<(u32, u64)> {
        let current = self.batch_size();
        let mut steps = vec![(current, self.footprint_mib(memory))];
        if self.leaving() {
            return steps;
        }
        let mut sizes = iadeep_tuner::candidate_sizes(self.spec());
        sizes.retain(|&b| b < current);
        for b in sizes.into_iter().rev() {
            match memory.bound_mib(self.spec(), self.report.as_ref(), b) {
                Some(mib) => steps.push((b, mib)),
                None => break,
            }
        }
        steps
    }

    /// Whether the placer evicted the task (its assignment says `evict`): it runs on at its
    /// size until it has checkpointed and its launcher releases it.
    pub fn leaving(&self) -> bool {
        self.assignment.as_ref().is_some_and(|(a, _)| a.evict)
    }

    /// Whether nothing measured is known of the task's memory yet: its reservation is a
    /// provisional grant (see [`crate::policy`]) and it has not reported a peak.
    pub fn memory_unmeasured(&self) -> bool {
        self.reservation.provisional && self.measured_peak_mib().is_none()
    }

    /// The peak the task reported at the batch size it runs at (or, from an agent that
    /// does not say, its peak since start), MiB.
    fn measured_peak_mib(&self) -> Option<u64> {
        let report = self.report.as_ref()?;
        let at = report.peak_mem_batch_size;
        report
            .peak_mem_mib
            .filter(|&p| p > 0 && (at == 0 || at == self.batch_size()))
    }

    /// What a provisional reservation becomes once the task reported its peak at the
    /// batch size it runs at: that peak plus the one margin ([`MemoryMargin::DEFAULT`],
    /// [`MemoryMargin::above_peak_mib`]), never more than the grant itself: the grant was
    /// what the card had free, and raising it could let the fences of the card's tasks
    /// add up to more than the card. `None` when the reservation is not provisional or no
    /// such peak was reported.
    pub fn settled_reservation_mib(&self) -> Option<u64> {
        if !self.reservation.provisional {
            return None;
        }
        let peak = self.measured_peak_mib()? as f64;
        let settled = MemoryMargin::DEFAULT.above_peak_mib(peak).ceil() as u64;
        Some(settled.min(self.reservation.reserved_mem_mib))
    }

    /// The submitted spec (empty if the stored reservation carried none).
    pub fn spec(&self) -> &TaskSpec {
        static EMPTY: std::sync::OnceLock<TaskSpec> = std::sync::OnceLock::new();
        self.reservation
            .spec
            .as_ref()
            .unwrap_or_else(|| EMPTY.get_or_init(TaskSpec::default))
    }

    /// Seconds until the task is predicted to finish, from its reported progress:
    /// `(total_samples − samples_done) / samples_per_s` after the report was written.
    /// `None` when the task did not say how much work it has or has not reported a rate.
    pub fn remaining_s(&self, now_unix_ms: i64) -> Option<f64> {
        self.finish_at_unix_ms
            .map(|at| (at - now_unix_ms).max(0) as f64 / 1000.0)
    }
}

/// Predicted finish time (Unix ms) of a task from one of its reports.
fn finish_at(spec: &TaskSpec, report: &TaskReport) -> Option<i64> {
    let total = spec.total_samples?;
    if report.finished {
        return Some(report.reported_at_unix_ms);
    }
    if !(report.samples_per_s.is_finite() && report.samples_per_s > 0.0) {
        return None;
    }
    let left_s = total.saturating_sub(report.samples_done) as f64 / report.samples_per_s;
    // Saturating float-to-int conversion: an absurd rate cannot overflow.
    Some(
        report
            .reported_at_unix_ms
            .saturating_add((left_s * 1000.0) as i64),
    )
}

/// The profile of a task for the slowdown model: its solo profile, at the batch
/// size it currently runs at if it has reported (scaling the solo step time
/// linearly in the batch size, the best a placer can do without a model of it).
///
/// The model name goes with it: it is never a tree or line feature (a name says
/// nothing about a model never seen before), but the predictor's per-job effects
/// are keyed by it (a model it has samples of is corrected by how much more it
/// slows and is slowed than its profile says; an unknown name gets no
/// correction), and the tuners write their samples with it. The hot path copies
/// it into reused buffers (`copy_profile` in `policy.rs`), so it costs no
/// allocation per evaluated co-location.
pub fn profile_of(spec: &TaskSpec, report: Option<&TaskReport>) -> TaskProfile {
    let solo = spec.profile.clone().unwrap_or_default();
    let profile_batch = if solo.batch_size > 0 {
        solo.batch_size
    } else {
        spec.initial_batch_size
    };
    let batch_size = report
        .map(|r| r.batch_size)
        .filter(|&b| b > 0)
        .unwrap_or(profile_batch);
    let solo_step_time_s = match (solo.step_time_s, profile_batch) {
        (Some(t), b) if b > 0 => t * f64::from(batch_size) / f64::from(b),
        (Some(t), _) => t,
        (None, _) => 0.0,
    };
    TaskProfile {
        model: spec.model.clone(),
        batch_size,
        solo_step_time_s,
        sm_util_pct: solo.sm_util_pct,
        mem_bw_util_pct: solo.mem_bw_util_pct,
        gpu_mem_mib: report.and_then(|r| r.peak_mem_mib).or(solo.peak_mem_mib),
    }
}

/// What every decision reads about a device, aggregated once per change of the device
/// (a reservation or a resident's report) rather than once per decision: at 1,000
/// devices, walking every resident's spec and report dominated the decision time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceSummary {
    /// Σ over residents of their footprints ([`Resident::footprint_mib`]), MiB.
    pub used_mib: u64,
    /// Σ of the residents' known solo SM utilisations, percent.
    pub sm_util_pct: f64,
    /// Σ of the residents' known solo DRAM-bandwidth utilisations, percent.
    pub mem_bw_util_pct: f64,
    /// When the device is predicted to be idle (Unix ms): the last predicted finish of
    /// its residents, `None` when some resident does not report its progress.
    pub idle_at_unix_ms: Option<i64>,
    /// The residents' profiles, contiguous, in resident order.
    pub profiles: Vec<TaskProfile>,
    /// Each resident's [`Resident::shrink_steps`], in resident order: a decision on a
    /// full cluster asks every device that lacks room whether shrinking its residents
    /// makes room, and each step is a fit of the memory model, which made shrink plans
    /// most of a decision's time.
    pub shrink_steps: Vec<Vec<(u32, u64)>>,
}

/// One device: its registration and its reservations.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DeviceState {
    /// `None` while the device is not registered (its tuner's lease expired): such a
    /// device keeps its reservations but takes no new task.
    pub info: Option<DeviceInfo>,
    pub residents: Vec<Resident>,
    /// Mod-revision of the device's residents record, `None` when there is none: what
    /// a reservation's compare-and-swap expects.
    pub residents_revision: Option<Revision>,
    /// The room claims of the device's residents record (expired ones included until
    /// the record is rewritten): memory held for a production task whose room eviction
    /// is under way, which other tasks' placements count as taken (see [`crate::policy`]).
    pub claims: Vec<Claim>,
    /// Revision of the last residents event applied (a put or a delete), to ignore older ones.
    seen_revision: Revision,
    /// Hash of the device id, for cheap per-task tie-breaking.
    pub(crate) id_hash: u64,
    summary: DeviceSummary,
    /// The residents' predicted slowdowns among themselves, reused across decisions.
    pub(crate) alone_together: SlowdownCache,
}

/// Each resident's predicted slowdown next to the other residents (without any
/// newcomer), and the model version they came from. They change only when the
/// residents, their reports or the model change, yet every decision scoring the device
/// needs them: computing them once per change instead of once per decision saves
/// `n` of the `2n + 1` predictions of an `n`-resident device.
///
/// Filled lazily by the first decision that scores the device (decisions share the
/// view through a read lock, hence the mutex) and emptied whenever the device's
/// residents or their reports change ([`DeviceState`] refresh).
#[derive(Debug, Default)]
pub(crate) struct SlowdownCache(std::sync::Mutex<Option<CachedSlowdowns>>);

#[derive(Clone, Debug)]
pub(crate) struct CachedSlowdowns {
    pub(crate) model_version: u64,
    pub(crate) slowdowns: Arc<AloneTogether>,
}

/// What is cached per device and model version.
#[derive(Debug)]
pub(crate) struct AloneTogether {
    /// Resident `i`'s predicted slowdown next to the other residents.
    pub(crate) slowdowns: Vec<f64>,
    /// Resident `i`'s pairwise predictions next to each other resident, composed
    /// ([`crate::model::SlowdownModel::pairwise_prefix`]); empty when the model
    /// does not compose pairwise or the device has one resident.
    pub(crate) prefixes: Vec<iadeep_predictor::PairwiseFold>,
}

impl SlowdownCache {
    /// The cached slowdowns if they came from `model_version`.
    pub(crate) fn get(&self, model_version: u64) -> Option<Arc<AloneTogether>> {
        let guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        guard
            .as_ref()
            .filter(|c| c.model_version == model_version)
            .map(|c| c.slowdowns.clone())
    }

    pub(crate) fn put(&self, model_version: u64, slowdowns: Arc<AloneTogether>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(CachedSlowdowns {
            model_version,
            slowdowns,
        });
    }

    fn clear(&mut self) {
        *self.0.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

/// A copy starts empty: it is a cache, refilled on demand.
impl Clone for SlowdownCache {
    fn clone(&self) -> Self {
        SlowdownCache::default()
    }
}

/// A cache never makes two devices different.
impl PartialEq for SlowdownCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl DeviceState {
    /// The aggregates decisions read.
    pub fn summary(&self) -> &DeviceSummary {
        &self.summary
    }

    /// How many residents' composed pairwise predictions the device's cache holds for
    /// the model at `model_version`, `None` when nothing is cached for it: for the
    /// tests (outside this crate) that decisions reuse them.
    #[doc(hidden)]
    pub fn cached_pairwise_prefixes(&self, model_version: u64) -> Option<usize> {
        self.alone_together
            .get(model_version)
            .map(|cached| cached.prefixes.len())
    }

    fn refresh(&mut self, memory: &dyn MemoryEstimator) {
        let mut summary = DeviceSummary {
            profiles: Vec::with_capacity(self.residents.len()),
            shrink_steps: Vec::with_capacity(self.residents.len()),
            ..DeviceSummary::default()
        };
        let mut idle_at = Some(i64::MIN);
        for r in &self.residents {
            idle_at = match (idle_at, r.finish_at_unix_ms) {
                (Some(a), Some(b)) => Some(a.max(b)),
                _ => None,
            };
            let steps = r.shrink_steps(memory);
            summary.used_mib += steps[0].1;
            summary.shrink_steps.push(steps);
            summary.sm_util_pct += r.profile.sm_util_pct.unwrap_or(0.0);
            summary.mem_bw_util_pct += r.profile.mem_bw_util_pct.unwrap_or(0.0);
            summary.profiles.push(r.profile.clone());
        }
        summary.idle_at_unix_ms = idle_at.filter(|_| !self.residents.is_empty());
        self.summary = summary;
        self.alone_together.clear();
    }

    /// MiB reserved by the residents.
    pub fn reserved_mem_mib(&self) -> u64 {
        self.residents
            .iter()
            .map(|r| r.reservation.reserved_mem_mib)
            .sum()
    }

    /// The stored record these residents came from.
    pub fn residents_record(&self, device_id: &str) -> DeviceResidents {
        DeviceResidents {
            device_id: device_id.to_owned(),
            reservations: self
                .residents
                .iter()
                .map(|r| r.reservation.clone())
                .collect(),
            claims: self.claims.clone(),
        }
    }
}

/// Every device the placer knows and the latest report of every task.
///
/// The view owns the [`MemoryEstimator`]: residents' footprints are estimated when
/// a resident or its report changes, and the placer asks the same estimator about
/// the arriving task (see [`ClusterView::memory`]), so both sides always agree.
#[derive(Clone, Debug)]
pub struct ClusterView {
    memory: Arc<dyn MemoryEstimator>,
    devices: BTreeMap<String, DeviceState>,
    reports: HashMap<String, TaskReport>,
    /// Every task's current assignment and its key's mod-revision.
    assignments: HashMap<String, (BatchSizeAssignment, Revision)>,
    /// Where each resident task is, for release and duplicate checks.
    task_device: HashMap<String, String>,
    /// Tasks told to queue that are expected back (see [`ClusterView::note_waiting`]).
    waiting: HashMap<String, WaitingTask>,
    /// Tasks whose `alive` key exists (their agent holds its lease).
    alive: HashSet<String>,
    /// Tasks noticed without an `alive` key after their agent had run, and since when
    /// (Unix ms); see [`ClusterView::dead_residents`] and
    /// [`ClusterView::dead_unreserved`]. A task placed anew starts without one.
    gone_since: HashMap<String, i64>,
    /// Tasks [`ClusterView::dead_unreserved`] leaves out (see
    /// [`ClusterView::skip_archiving`]).
    not_archivable: HashSet<String>,
    /// Each device's pending CapBreach (written by its tuner, acted on by
    /// [`crate::eviction`]) with its key's mod-revision, which the eviction compares.
    breaches: BTreeMap<String, (CapBreach, Revision)>,
    /// The AvoidPairing records by (production, evicted) task, with their mod-revisions.
    avoid_records: BTreeMap<(String, String), (AvoidPairing, Revision)>,
    /// Each task named by an avoid record, with the other task and until when (Unix
    /// ms): both directions, so [`ClusterView::avoids`] is one lookup of a task that
    /// has none (every newcomer but the evicted ones) and allocates nothing.
    avoid_index: HashMap<String, Vec<(String, i64)>>,
}

/// A resident task whose agent is gone, as [`ClusterView::dead_residents`] reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadResident {
    pub task_id: String,
    pub device_id: String,
    /// Since when (Unix ms) the task has been seen without its `alive` key.
    pub gone_since_unix_ms: i64,
    /// Its last report said it finished.
    pub finished: bool,
}

/// A task without a reservation whose agent is gone, as
/// [`ClusterView::dead_unreserved`] reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadUnreserved {
    pub task_id: String,
    /// Since when (Unix ms) the task has been seen without its `alive` key.
    pub gone_since_unix_ms: i64,
    /// Its last report said it finished.
    pub finished: bool,
    /// The sequence number of that report, to tell it from a newer one later (see
    /// [`ClusterView::remove_report_if_seq`]).
    pub report_seq: u64,
}

/// A resident task whose agent never showed up, as
/// [`ClusterView::unstarted_residents`] reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct UnstartedResident {
    pub task_id: String,
    pub device_id: String,
    /// When the reservation was made (Unix ms).
    pub placed_at_unix_ms: i64,
}

/// A task whose agent runs without a reservation, as
/// [`ClusterView::unreserved_running`] reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct UnreservedRunning {
    pub task_id: String,
    /// The device the task's last report names (where it runs), if it reported.
    pub device_id: Option<String>,
}

impl UnreservedRunning {
    /// Whether a task runs without a reservation: its agent holds its `alive` key, it
    /// holds no reservation, and its last report does not say it finished (its agent
    /// is about to stop). The one definition that the placer's reaper
    /// ([`ClusterView::unreserved_running`]) and `iadeep status` both apply.
    pub fn applies(alive: bool, reserved: bool, report: Option<&TaskReport>) -> bool {
        alive && !reserved && !report.is_some_and(|r| r.finished)
    }
}

/// A task waiting for a device: one that was answered "queue" and is expected to ask
/// again. Decisions count the ones submitted before the task they decide on, because
/// each of those will take a device that frees up before this one gets its turn.
#[derive(Clone, Debug, PartialEq)]
pub struct WaitingTask {
    /// Submission time (Unix ms): the task's `submitted_at_unix_ms`, or when the placer
    /// first saw it if the submitter did not say. Orders the queue, with the task id
    /// breaking ties.
    pub submitted_at_unix_ms: i64,
    /// Until when the task counts as waiting (Unix ms): a client that does not come
    /// back by then has given up, and must not hold others back forever.
    pub expires_at_unix_ms: i64,
    /// The task as it was decided on when last told to queue (its profile from the
    /// registry included), so a decision for a task submitted later can ask where this
    /// one would go now (see [`crate::policy`], "Room held for a task waiting ahead").
    pub spec: TaskSpec,
    /// The devices its request was restricted to (empty: every device).
    pub restrict: Vec<String>,
    /// Since when (Unix ms) a device has been held for it while it did not ask again,
    /// if one has: a client that stays away longer than the hold allows stops holding
    /// devices until it asks again.
    pub held_since_unix_ms: Option<i64>,
    /// Since when (Unix ms) this task itself has been told to queue, answer after
    /// answer, because a device was held for a task ahead of it: past the hold it is
    /// held back no more, so tasks ahead that do not come back, one after another,
    /// cannot keep it waiting a hold each.
    pub held_back_since_unix_ms: Option<i64>,
}

impl ClusterView {
    /// An empty view estimating memory footprints with `memory`.
    pub fn new(memory: Arc<dyn MemoryEstimator>) -> ClusterView {
        ClusterView {
            memory,
            devices: BTreeMap::new(),
            reports: HashMap::new(),
            assignments: HashMap::new(),
            task_device: HashMap::new(),
            waiting: HashMap::new(),
            alive: HashSet::new(),
            gone_since: HashMap::new(),
            not_archivable: HashSet::new(),
            breaches: BTreeMap::new(),
            avoid_records: BTreeMap::new(),
            avoid_index: HashMap::new(),
        }
    }

    /// Records `device`'s CapBreach as stored at `revision` (its key's mod-revision); an
    /// older one than the view holds is ignored.
    pub fn set_breach(&mut self, device_id: &str, breach: CapBreach, revision: Revision) {
        if self
            .breaches
            .get(device_id)
            .is_some_and(|(_, seen)| *seen > revision)
        {
            return;
        }
        self.breaches
            .insert(device_id.to_owned(), (breach, revision));
    }

    /// Forgets `device`'s CapBreach, deleted at `revision`: a breach written after
    /// that (the tuner's next one, reaching the view before the deletion's echo) stays.
    pub fn remove_breach(&mut self, device_id: &str, revision: Revision) {
        if self
            .breaches
            .get(device_id)
            .is_some_and(|(_, seen)| *seen < revision)
        {
            self.breaches.remove(device_id);
        }
    }

    /// The pending CapBreach records, by device id, each with its key's mod-revision:
    /// what [`crate::eviction`] acts on.
    pub fn breaches(&self) -> impl Iterator<Item = (&str, &CapBreach, Revision)> {
        self.breaches
            .iter()
            .map(|(id, (breach, rev))| (id.as_str(), breach, *rev))
    }

    /// `device`'s pending CapBreach and its key's mod-revision.
    pub fn breach(&self, device_id: &str) -> Option<(&CapBreach, Revision)> {
        self.breaches.get(device_id).map(|(b, rev)| (b, *rev))
    }

    /// Records an AvoidPairing as stored at `revision`, keyed by its two task ids; an
    /// older one than the view holds is ignored.
    pub fn set_avoid(&mut self, pairing: AvoidPairing, revision: Revision) {
        let key = (
            pairing.production_task_id.clone(),
            pairing.evicted_task_id.clone(),
        );
        if self
            .avoid_records
            .get(&key)
            .is_some_and(|(_, seen)| *seen > revision)
        {
            return;
        }
        self.unindex_avoid(&key.0, &key.1);
        for (one, other) in [(&key.0, &key.1), (&key.1, &key.0)] {
            self.avoid_index
                .entry(one.clone())
                .or_default()
                .push((other.clone(), pairing.until_unix_ms));
        }
        self.avoid_records.insert(key, (pairing, revision));
    }

    /// Forgets the AvoidPairing of `production` and `evicted`, deleted at `revision`: a
    /// record written after that (a later eviction's, reaching the view before the
    /// deletion's echo) stays.
    pub fn remove_avoid(&mut self, production: &str, evicted: &str, revision: Revision) {
        let key = (production.to_owned(), evicted.to_owned());
        if self
            .avoid_records
            .get(&key)
            .is_some_and(|(_, seen)| *seen < revision)
        {
            self.avoid_records.remove(&key);
            self.unindex_avoid(production, evicted);
        }
    }

    /// Drops the index entries of the pairing of `production` and `evicted` (both ways).
    fn unindex_avoid(&mut self, production: &str, evicted: &str) {
        for (one, other) in [(production, evicted), (evicted, production)] {
            if let Some(list) = self.avoid_index.get_mut(one) {
                list.retain(|(t, _)| t != other);
                if list.is_empty() {
                    self.avoid_index.remove(one);
                }
            }
        }
        // A record naming the two the other way round keeps its entries.
        let reverse = (evicted.to_owned(), production.to_owned());
        if let Some((p, _)) = self.avoid_records.get(&reverse) {
            let until = p.until_unix_ms;
            for (one, other) in [(&reverse.0, &reverse.1), (&reverse.1, &reverse.0)] {
                self.avoid_index
                    .entry(one.clone())
                    .or_default()
                    .push((other.clone(), until));
            }
        }
    }

    /// Whether tasks `a` and `b` must not share a device at `now_unix_ms`: an
    /// AvoidPairing names the two (in either order: which of them is the production
    /// job does not matter to placement) and has not expired. An expired record
    /// counts for nothing even before the retention sweep deletes it.
    pub fn avoids(&self, a: &str, b: &str, now_unix_ms: i64) -> bool {
        self.avoid_index.get(a).is_some_and(|list| {
            list.iter()
                .any(|(other, until)| other == b && *until > now_unix_ms)
        })
    }

    /// The AvoidPairing records the view holds (expired ones included until they are
    /// deleted), each with its key's mod-revision.
    pub fn avoid_pairings(&self) -> impl Iterator<Item = (&AvoidPairing, Revision)> {
        self.avoid_records.values().map(|(p, rev)| (p, *rev))
    }

    /// How many AvoidPairings are in force at `now_unix_ms` (the
    /// `iadeep_placer_avoided_pairings` gauge).
    pub fn avoided_pairings(&self, now_unix_ms: i64) -> usize {
        self.avoid_records
            .values()
            .filter(|(p, _)| p.until_unix_ms > now_unix_ms)
            .count()
    }

    /// The task's `alive` key exists: its agent runs (again).
    pub fn set_alive(&mut self, task_id: &str) {
        self.gone_since.remove(task_id);
        self.not_archivable.remove(task_id);
        self.alive.insert(task_id.to_owned());
    }

    /// The task's `alive` key was deleted (lease revoked or expired) at `now_unix_ms`.
    pub fn set_not_alive(&mut self, task_id: &str, now_unix_ms: i64) {
        if self.alive.remove(task_id) {
            self.gone_since.insert(task_id.to_owned(), now_unix_ms);
        }
    }

    /// The task's `alive` key exists.
    pub fn agent_alive(&self, task_id: &str) -> bool {
        self.alive.contains(task_id)
    }

    /// Tasks whose report the view holds, for re-reading the store.
    pub fn reported_tasks(&self) -> impl Iterator<Item = &str> {
        self.reports.keys().map(String::as_str)
    }

    /// Tasks whose `alive` key the view holds, for re-reading the store.
    pub fn alive_tasks(&self) -> impl Iterator<Item = &str> {
        self.alive.iter().map(String::as_str)
    }

    /// Tasks whose agent runs (their `alive` key exists) but that hold no reservation:
    /// released while their agent still ran (a Release by hand, or the reaper's after
    /// the agent's lease expired and before it re-created its key). Their memory is
    /// not counted on any device, so a placement could over-pack theirs. Tasks whose
    /// last report said they finished are left out (their agent is about to stop).
    pub fn unreserved_running(&self) -> Vec<UnreservedRunning> {
        let mut found: Vec<UnreservedRunning> = self
            .alive
            .iter()
            .filter(|task| {
                let reserved = self.task_device.contains_key(*task);
                UnreservedRunning::applies(true, reserved, self.reports.get(*task))
            })
            .map(|task| UnreservedRunning {
                task_id: task.clone(),
                device_id: self
                    .reports
                    .get(task)
                    .map(|r| r.device_id.clone())
                    .filter(|d| !d.is_empty()),
            })
            .collect();
        found.sort_by(|a, b| a.task_id.cmp(&b.task_id));
        found
    }

    /// Resident tasks whose agent has gone: no `alive` key now, although one was seen
    /// or the task reported (an agent writes its `alive` key before its first report,
    /// so a report without the key means the agent ran and stopped, also when that
    /// happened while this placer was not watching). A task just placed, whose agent
    /// has not started yet, has neither and is never counted.
    ///
    /// The first call that notices a task starts its clock at `now_unix_ms`; a task
    /// is returned once `grace_ms` have passed since, or at once when its last report
    /// said it finished (its agent will not come back for it).
    pub fn dead_residents(&mut self, now_unix_ms: i64, grace_ms: i64) -> Vec<DeadResident> {
        let mut dead = Vec::new();
        let mut clocks = AgentClocks {
            alive: &self.alive,
            reports: &self.reports,
            gone_since: &mut self.gone_since,
        };
        for (task_id, device_id) in &self.task_device {
            let Some((since, finished)) = clocks.gone_past(task_id, now_unix_ms, grace_ms) else {
                continue;
            };
            dead.push(DeadResident {
                task_id: task_id.clone(),
                device_id: device_id.clone(),
                gone_since_unix_ms: since,
                finished,
            });
        }
        self.forget_idle_clocks();
        dead.sort_by(|a, b| a.task_id.cmp(&b.task_id));
        dead
    }

    /// Tasks that hold no reservation, whose agent ran (their report is under
    /// `tasks/`) and is gone, by the same clock and grace as
    /// [`ClusterView::dead_residents`], less those [`ClusterView::skip_archiving`]
    /// set aside: mostly jobs whose agent ran without ever being placed (started
    /// outside `iadeep run`), whose keys nothing else would ever take out of `tasks/`,
    /// which the placer's start and every tuner read whole.
    /// [`crate::PlacementService::archive_dead_unreserved`] archives them with a
    /// release marker.
    pub fn dead_unreserved(&mut self, now_unix_ms: i64, grace_ms: i64) -> Vec<DeadUnreserved> {
        let mut dead = Vec::new();
        let mut clocks = AgentClocks {
            alive: &self.alive,
            reports: &self.reports,
            gone_since: &mut self.gone_since,
        };
        let unreserved = self.reports.keys().filter(|task| {
            !self.task_device.contains_key(*task) && !self.not_archivable.contains(*task)
        });
        for task_id in unreserved {
            if let Some((since, finished)) = clocks.gone_past(task_id, now_unix_ms, grace_ms) {
                dead.push(DeadUnreserved {
                    task_id: task_id.clone(),
                    gone_since_unix_ms: since,
                    finished,
                    report_seq: self.reports.get(task_id).map_or(0, |r| r.seq),
                });
            }
        }
        self.forget_idle_clocks();
        dead.sort_by(|a, b| a.task_id.cmp(&b.task_id));
        dead
    }

    /// Sets `task_id` aside from [`ClusterView::dead_unreserved`] until its agent
    /// runs again, it reports, it is reserved or its report is deleted: the reaper
    /// found nothing for it to archive (its keys are already marked for the
    /// retention, or it holds a placement without a reservation).
    pub fn skip_archiving(&mut self, task_id: &str) {
        self.not_archivable.insert(task_id.to_owned());
    }

    /// Drops the clocks of tasks that neither hold a reservation nor left a report:
    /// nothing of theirs is left to release or archive.
    fn forget_idle_clocks(&mut self) {
        let (task_device, reports) = (&self.task_device, &self.reports);
        self.gone_since
            .retain(|task, _| task_device.contains_key(task) || reports.contains_key(task));
    }

    /// Resident tasks whose agent never appeared: no `alive` key now, none seen
    /// since this view started (a task whose key was seen and then deleted is
    /// [`ClusterView::dead_residents`]'s), and no report, reserved at least `grace_ms`
    /// before `now_unix_ms`. A task that was placed but never started (the job was
    /// never launched, its pod never scheduled) would otherwise hold its device
    /// forever, because no lease of its ever expires.
    pub fn unstarted_residents(&self, now_unix_ms: i64, grace_ms: i64) -> Vec<UnstartedResident> {
        let mut unstarted = Vec::new();
        for (device_id, device) in &self.devices {
            for resident in &device.residents {
                let reservation = &resident.reservation;
                let task_id = &reservation.task_id;
                if self.alive.contains(task_id)
                    || self.gone_since.contains_key(task_id)
                    || self.reports.contains_key(task_id)
                {
                    continue;
                }
                if now_unix_ms.saturating_sub(reservation.placed_at_unix_ms) >= grace_ms {
                    unstarted.push(UnstartedResident {
                        task_id: task_id.clone(),
                        device_id: device_id.clone(),
                        placed_at_unix_ms: reservation.placed_at_unix_ms,
                    });
                }
            }
        }
        unstarted.sort_by(|a, b| a.task_id.cmp(&b.task_id));
        unstarted
    }

    /// Records that `task`, decided on over `restrict` (empty: every device), waits for
    /// a device until `expires_at_unix_ms` (or refreshes the entry of a task already
    /// waiting, keeping its place in the queue: it asked again, so any hold for it
    /// starts afresh). `held_for`: the task ahead a device was held for, when that is
    /// why this task queues (its hold's clock starts now unless it runs already, and so
    /// does this task's time held back); otherwise this task is not held back. Its
    /// submission time is the spec's, or `now_unix_ms` when the spec has none. Expired
    /// entries are dropped on the way, so the set stays as small as the real queue.
    pub fn note_waiting(
        &mut self,
        task: &TaskSpec,
        restrict: &[String],
        now_unix_ms: i64,
        expires_at_unix_ms: i64,
        held_for: Option<&str>,
    ) {
        self.waiting
            .retain(|_, w| w.expires_at_unix_ms > now_unix_ms);
        let submitted = if task.submitted_at_unix_ms > 0 {
            task.submitted_at_unix_ms
        } else {
            now_unix_ms
        };
        let held_back = |was: Option<i64>| held_for.map(|_| was.unwrap_or(now_unix_ms));
        self.waiting
            .entry(task.task_id.clone())
            .and_modify(|w| {
                w.expires_at_unix_ms = w.expires_at_unix_ms.max(expires_at_unix_ms);
                w.spec = task.clone();
                w.restrict = restrict.to_vec();
                w.held_since_unix_ms = None;
                w.held_back_since_unix_ms = held_back(w.held_back_since_unix_ms);
            })
            .or_insert_with(|| WaitingTask {
                submitted_at_unix_ms: submitted,
                expires_at_unix_ms,
                spec: task.clone(),
                restrict: restrict.to_vec(),
                held_since_unix_ms: None,
                held_back_since_unix_ms: held_back(None),
            });
        if let Some(w) = held_for.and_then(|id| self.waiting.get_mut(id)) {
            w.held_since_unix_ms.get_or_insert(now_unix_ms);
        }
    }

    /// Forgets a waiting task (it was placed, released or withdrawn). True when it was there.
    pub fn forget_waiting(&mut self, task_id: &str) -> bool {
        self.waiting.remove(task_id).is_some()
    }

    /// Forgets every waiting task (for a caller that re-declares its whole queue).
    pub fn clear_waiting(&mut self) {
        self.waiting.clear();
    }

    /// The waiting entry of `task_id`, expired or not, if it has one.
    pub fn waiting_entry(&self, task_id: &str) -> Option<&WaitingTask> {
        self.waiting.get(task_id)
    }

    /// The waiting tasks by id, expired ones included until the next [`Self::note_waiting`].
    pub fn waiting(&self) -> impl Iterator<Item = (&str, &WaitingTask)> {
        self.waiting.iter().map(|(id, w)| (id.as_str(), w))
    }

    /// How many unexpired waiting tasks were submitted before `task` (by submission time,
    /// then task id). `task` itself never counts; when it is not waiting yet, it is
    /// ordered by its spec's submission time, or as the newest when it has none.
    pub fn waiting_ahead_of(&self, task: &TaskSpec, now_unix_ms: i64) -> usize {
        let ahead = self.ahead_of(task, now_unix_ms);
        self.waiting.iter().filter(|(id, w)| ahead(id, w)).count()
    }

    /// The unexpired waiting tasks submitted before `task`, first submitted first (see
    /// [`Self::waiting_ahead_of`]).
    pub fn waiting_ahead(&self, task: &TaskSpec, now_unix_ms: i64) -> Vec<(&str, &WaitingTask)> {
        let ahead = self.ahead_of(task, now_unix_ms);
        let mut tasks: Vec<(&str, &WaitingTask)> = self
            .waiting
            .iter()
            .filter(|(id, w)| ahead(id, w))
            .map(|(id, w)| (id.as_str(), w))
            .collect();
        tasks.sort_unstable_by_key(|(id, w)| (w.submitted_at_unix_ms, *id));
        tasks
    }

    /// Whether a waiting entry is ahead of `task` in the queue (see
    /// [`Self::waiting_ahead_of`]).
    fn ahead_of<'t>(
        &self,
        task: &'t TaskSpec,
        now_unix_ms: i64,
    ) -> impl Fn(&String, &WaitingTask) -> bool + 't {
        let mine = match self.waiting.get(&task.task_id) {
            Some(w) => w.submitted_at_unix_ms,
            None if task.submitted_at_unix_ms > 0 => task.submitted_at_unix_ms,
            None => i64::MAX,
        };
        move |id: &String, w: &WaitingTask| {
            w.expires_at_unix_ms > now_unix_ms
                && *id != task.task_id
                && (w.submitted_at_unix_ms, id.as_str()) < (mine, task.task_id.as_str())
        }
    }

    /// The memory estimator of this view.
    pub fn memory(&self) -> &dyn MemoryEstimator {
        self.memory.as_ref()
    }

    /// Devices by id, sorted.
    pub fn devices(&self) -> impl Iterator<Item = (&str, &DeviceState)> {
        self.devices.iter().map(|(id, d)| (id.as_str(), d))
    }

    /// One device.
    pub fn device(&self, id: &str) -> Option<&DeviceState> {
        self.devices.get(id)
    }

    /// Number of devices (registered or holding reservations).
    pub fn len(&self) -> usize {
        self.devices.len()
    }

    /// True when the view knows no device.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Number of resident tasks over all devices.
    pub fn resident_count(&self) -> usize {
        self.task_device.len()
    }

    /// The device a task holds a reservation on.
    pub fn device_of(&self, task_id: &str) -> Option<&str> {
        self.task_device.get(task_id).map(String::as_str)
    }

    fn entry(&mut self, device_id: &str) -> &mut DeviceState {
        Self::entry_in(&mut self.devices, device_id)
    }

    fn entry_in<'a>(
        devices: &'a mut BTreeMap<String, DeviceState>,
        device_id: &str,
    ) -> &'a mut DeviceState {
        devices
            .entry(device_id.to_owned())
            .or_insert_with(|| DeviceState {
                id_hash: fnv1a(device_id.as_bytes()),
                ..DeviceState::default()
            })
    }

    /// Registers or updates a device.
    pub fn upsert_device(&mut self, info: DeviceInfo) {
        let id = info.device_id.clone();
        self.entry(&id).info = Some(info);
    }

    /// Forgets a device's registration (its reservations stay until released).
    pub fn remove_device(&mut self, device_id: &str) {
        if let Some(device) = self.devices.get_mut(device_id) {
            device.info = None;
            if device.residents.is_empty() {
                self.devices.remove(device_id);
            }
        }
    }

    /// Applies a residents record read or written at `revision` (its mod-revision), or
    /// its deletion at `revision` when `record` is `None`. Returns false (and changes
    /// nothing) when the view already holds a newer state of that record.
    pub fn apply_residents(
        &mut self,
        device_id: &str,
        record: Option<DeviceResidents>,
        revision: Revision,
    ) -> bool {
        // Placed anew: the view holds no reservation of that id, or one from another
        // placement (a release and a new placement of the same id may both fall in a
        // compacted watch gap, so only the placement time tells them apart).
        let placed_anew: HashSet<String> = record
            .iter()
            .flat_map(|r| &r.reservations)
            .filter(|r| self.placed_at(&r.task_id) != Some(r.placed_at_unix_ms))
            .map(|r| r.task_id.clone())
            .collect();
        let device = Self::entry_in(&mut self.devices, device_id);
        if revision < device.seen_revision {
            return false;
        }
        for old in device.residents.drain(..) {
            if self
                .task_device
                .get(&old.reservation.task_id)
                .map(String::as_str)
                == Some(device_id)
            {
                self.task_device.remove(&old.reservation.task_id);
            }
        }
        device.seen_revision = revision;
        match record {
            Some(record) => {
                device.residents_revision = Some(revision);
                device.claims = record.claims;
                for reservation in record.reservations {
                    let task_id = &reservation.task_id;
                    if placed_anew.contains(task_id) {
                        // A clock left by an earlier run of the same id (its
                        // report still under `tasks/`) must not shorten this one's grace,
                        // nor may that run's report, written before this placement while
                        // no agent runs, say this run's agent ran and went (or finished).
                        self.gone_since.remove(task_id);
                        self.not_archivable.remove(task_id);
                        let stale = self
                            .reports
                            .get(task_id)
                            .is_some_and(|r| r.reported_at_unix_ms < reservation.placed_at_unix_ms);
                        if stale && !self.alive.contains(task_id) {
                            self.reports.remove(task_id);
                        }
                    }
                    let report = self.reports.get(&reservation.task_id).cloned();
                    let assignment = self.assignments.get(&reservation.task_id).cloned();
                    self.task_device
                        .insert(reservation.task_id.clone(), device_id.to_owned());
                    device
                        .residents
                        .push(Resident::new(reservation, report, assignment));
                }
            }
            None => {
                device.residents_revision = None;
                device.claims.clear();
            }
        }
        device.refresh(self.memory.as_ref());
        if device.info.is_none() && device.residents.is_empty() {
            self.devices.remove(device_id);
        }
        true
    }

    /// When the reservation the view holds for `task_id` was placed.
    fn placed_at(&self, task_id: &str) -> Option<i64> {
        let device = self.devices.get(self.task_device.get(task_id)?)?;
        device
            .residents
            .iter()
            .find(|r| r.reservation.task_id == task_id)
            .map(|r| r.reservation.placed_at_unix_ms)
    }

    /// Rebuilds a resident's entry from what the view holds about it now.
    fn refresh_resident(&mut self, task_id: &str) {
        if let Some(device_id) = self.task_device.get(task_id)
            && let Some(device) = self.devices.get_mut(device_id)
            && let Some(resident) = device
                .residents
                .iter_mut()
                .find(|r| r.reservation.task_id == task_id)
        {
            *resident = Resident::new(
                resident.reservation.clone(),
                self.reports.get(task_id).cloned(),
                self.assignments.get(task_id).cloned(),
            );
            device.refresh(self.memory.as_ref());
        }
    }

    /// Records a task's latest report (and refreshes its resident entry).
    pub fn set_report(&mut self, report: TaskReport) {
        let task_id = report.task_id.clone();
        self.not_archivable.remove(&task_id);
        self.reports.insert(task_id.clone(), report);
        self.refresh_resident(&task_id);
    }

    /// Forgets a task's report (its keys were deleted).
    pub fn remove_report(&mut self, task_id: &str) {
        self.not_archivable.remove(task_id);
        self.reports.remove(task_id);
        self.refresh_resident(task_id);
    }

    /// [`ClusterView::remove_report`], only while the task's report is still the one
    /// numbered `seq`: a newer one (an agent of the same id that started since the
    /// caller looked) is kept.
    pub fn remove_report_if_seq(&mut self, task_id: &str, seq: u64) {
        if self.reports.get(task_id).is_some_and(|r| r.seq == seq) {
            self.remove_report(task_id);
        }
    }

    /// Records a task's assignment as stored at `revision` (its key's mod-revision);
    /// an older one than the view holds is ignored.
    pub fn set_assignment(&mut self, assignment: BatchSizeAssignment, revision: Revision) {
        let task_id = assignment.task_id.clone();
        if self
            .assignments
            .get(&task_id)
            .is_some_and(|(_, seen)| *seen > revision)
        {
            return;
        }
        self.assignments
            .insert(task_id.clone(), (assignment, revision));
        self.refresh_resident(&task_id);
    }

    /// The revision of the task's assignment the view holds, if any.
    pub(crate) fn assignment_revision(&self, task_id: &str) -> Option<Revision> {
        self.assignments.get(task_id).map(|(_, revision)| *revision)
    }

    /// Whether the view already holds what `event` on `device_id`'s residents key says:
    /// the record put at that very revision, or the record deleted at it. Applying such
    /// an event again would change nothing.
    pub(crate) fn holds_residents_at(&self, device_id: &str, event: &WatchEvent) -> bool {
        let Some(device) = self.devices.get(device_id) else {
            return false;
        };
        match event {
            WatchEvent::Put(kv) => device.residents_revision == Some(kv.mod_revision),
            WatchEvent::Delete { revision, .. } => {
                device.residents_revision.is_none() && device.seen_revision == *revision
            }
        }
    }

    /// Forgets a task's assignment (its key was deleted).
    pub fn remove_assignment(&mut self, task_id: &str) {
        if self.assignments.remove(task_id).is_some() {
            self.refresh_resident(task_id);
        }
    }
}

/// The view's fields that say whether and since when a task's agent is gone, borrowed
/// apart from the rest so that callers may iterate another field meanwhile.
struct AgentClocks<'a> {
    alive: &'a HashSet<String>,
    reports: &'a HashMap<String, TaskReport>,
    gone_since: &'a mut HashMap<String, i64>,
}

impl AgentClocks<'_> {
    /// Since when `task_id`'s agent has been gone and whether its last report said it
    /// finished, once it has been gone `grace_ms` by `now_unix_ms` (at once when it
    /// finished); `None` while its agent runs, before the grace, or when it never ran
    /// (no `alive` key seen, no report). The first call that notices a task with a
    /// report but no clock starts its clock at `now_unix_ms`.
    fn gone_past(&mut self, task_id: &str, now_unix_ms: i64, grace_ms: i64) -> Option<(i64, bool)> {
        if self.alive.contains(task_id) {
            return None;
        }
        let report = self.reports.get(task_id);
        let since = match self.gone_since.get(task_id) {
            Some(&since) => since,
            None => {
                report?;
                self.gone_since.insert(task_id.to_owned(), now_unix_ms);
                now_unix_ms
            }
        };
        let finished = report.is_some_and(|r| r.finished);
        (finished || now_unix_ms.saturating_sub(since) >= grace_ms).then_some((since, finished))
    }
}

/// FNV-1a: cheap, stable across runs and platforms.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reservation(task: &str, mib: u64) -> Reservation {
        Reservation {
            task_id: task.into(),
            reserved_mem_mib: mib,
            spec: Some(TaskSpec {
                task_id: task.into(),
                total_samples: Some(1000),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The shrink steps decisions read are those of the residents as they are now: after
    /// a report (a measured peak) and after an assignment (a grown batch size).
    #[test]
    fn cached_shrink_steps_follow_reports_and_assignments() {
        let memory = crate::model::ModelledMemory;
        let mut view = ClusterView::new(Arc::new(memory));
        let spec = TaskSpec {
            task_id: "t".into(),
            initial_batch_size: 64,
            min_batch_size: 8,
            max_batch_size: 256,
            profile: Some(iadeep_proto::SoloProfile {
                batch_size: 64,
                peak_mem_mib: Some(6_000),
                ..Default::default()
            }),
            ..Default::default()
        };
        let record = DeviceResidents {
            device_id: "d0".into(),
            reservations: vec![Reservation {
                task_id: "t".into(),
                reserved_mem_mib: 6_000,
                spec: Some(spec),
                ..Default::default()
            }],
            ..Default::default()
        };
        view.apply_residents("d0", Some(record), 1);
        let check = |view: &ClusterView, what: &str| {
            let device = view.device("d0").expect("device");
            let fresh: Vec<_> = device
                .residents
                .iter()
                .map(|r| r.shrink_steps(&memory))
                .collect();
            assert_eq!(device.summary().shrink_steps, fresh, "{what}");
            fresh
        };
        let placed = check(&view, "placed");
        assert!(placed[0].len() > 1, "64 can step down: {placed:?}");
        view.set_assignment(
            BatchSizeAssignment {
                task_id: "t".into(),
                batch_size: 128,
                ..Default::default()
            },
            2,
        );
        let grown = check(&view, "grown");
        assert_eq!(grown[0][0].0, 128);
        view.set_report(TaskReport {
            task_id: "t".into(),
            batch_size: 128,
            peak_mem_mib: Some(11_000),
            peak_mem_batch_size: 128,
            ..Default::default()
        });
        let measured = check(&view, "measured");
        assert_ne!(measured, grown, "a measured peak changes the bounds");
    }

    fn pairing(production: &str, evicted: &str, until: i64) -> AvoidPairing {
        AvoidPairing {
            production_task_id: production.into(),
            evicted_task_id: evicted.into(),
            until_unix_ms: until,
            reason: String::new(),
        }
    }

    /// A pairing is avoided in either order until it expires, and an older record
    /// arriving late does not move its expiry back.
    #[test]
    fn a_leaving_resident_is_never_a_shrink_step_below_its_size() {
        let spec = TaskSpec {
            task_id: "b".into(),
            initial_batch_size: 64,
            min_batch_size: 8,
            max_batch_size: 64,
            gpu_mem_request_mib: 4_000,
            ..Default::default()
        };
        let reservation = Reservation {
            task_id: "b".into(),
            reserved_mem_mib: 4_000,
            spec: Some(spec),
            ..Default::default()
        };
        let assignment = |evict| BatchSizeAssignment {
            task_id: "b".into(),
            batch_size: 64,
            lr_factor: 1.0,
            round: 3,
            evict,
            ..Default::default()
        };
        let memory = crate::model::ModelledMemory;
        let staying = Resident::new(reservation.clone(), None, Some((assignment(false), 7)));
        assert!(staying.shrink_steps(&memory).len() > 1, "it could shrink");
        let leaving = Resident::new(reservation, None, Some((assignment(true), 7)));
        let steps = leaving.shrink_steps(&memory);
        assert_eq!(steps.len(), 1, "{steps:?}");
        assert_eq!(steps[0].0, 64);
    }

    #[test]
    fn avoids_names_the_two_tasks_either_way_until_the_pairing_expires() {
        let mut view = ClusterView::new(Arc::new(crate::model::ModelledMemory));
        assert!(!view.avoids("prod", "opp", 0));
        view.set_avoid(pairing("prod", "opp", 2_000), 5);
        assert!(view.avoids("prod", "opp", 1_999));
        assert!(view.avoids("opp", "prod", 1_999), "either order");
        assert!(!view.avoids("prod", "other", 1_999));
        assert!(!view.avoids("prod", "opp", 2_000), "expired");
        assert_eq!(view.avoided_pairings(1_999), 1);
        assert_eq!(view.avoided_pairings(2_000), 0);
        // Renewed by a later eviction; a stale copy of the first record changes nothing.
        view.set_avoid(pairing("prod", "opp", 9_000), 8);
        view.set_avoid(pairing("prod", "opp", 2_000), 5);
        assert!(view.avoids("opp", "prod", 8_999));
        // The reverse record (its own pairing) survives the first's deletion.
        view.set_avoid(pairing("opp", "prod", 4_000), 9);
        view.remove_avoid("prod", "opp", 8);
        assert!(
            view.avoids("opp", "prod", 8_999),
            "renewed after that deletion"
        );
        view.remove_avoid("prod", "opp", 10);
        assert!(view.avoids("prod", "opp", 3_999));
        assert!(!view.avoids("prod", "opp", 4_000));
        view.remove_avoid("opp", "prod", 11);
        assert!(!view.avoids("prod", "opp", 0));
        assert!(view.avoid_index.is_empty(), "{:?}", view.avoid_index);
    }

    /// A breach's deletion removes only the breach it came after: a new one the tuner
    /// wrote later stays pending.
    #[test]
    fn a_breach_deleted_before_a_newer_one_leaves_the_newer_one() {
        let mut view = ClusterView::new(Arc::new(crate::model::ModelledMemory));
        let breach = CapBreach {
            device_id: "d0".into(),
            task_id: "prod".into(),
            ..Default::default()
        };
        view.set_breach("d0", breach.clone(), 7);
        view.set_breach("d0", CapBreach::default(), 6);
        assert_eq!(view.breach("d0"), Some((&breach, 7)), "older ignored");
        view.remove_breach("d0", 7);
        assert!(view.breach("d0").is_some(), "deleted at or before it");
        view.remove_breach("d0", 8);
        assert_eq!(view.breaches().count(), 0);
    }

    #[test]
    fn stale_residents_records_are_ignored_and_index_follows() {
        let mut view = ClusterView::new(Arc::new(crate::model::ModelledMemory));
        view.upsert_device(DeviceInfo {
            device_id: "d0".into(),
            memory_mib: 16000,
            ..Default::default()
        });
        let two = DeviceResidents {
            device_id: "d0".into(),
            reservations: vec![reservation("a", 100), reservation("b", 200)],
            ..Default::default()
        };
        assert!(view.apply_residents("d0", Some(two), 10));
        assert_eq!(view.device_of("b"), Some("d0"));
        assert_eq!(
            view.device("d0").map(DeviceState::reserved_mem_mib),
            Some(300)
        );
        let one = DeviceResidents {
            device_id: "d0".into(),
            reservations: vec![reservation("a", 100)],
            ..Default::default()
        };
        assert!(
            !view.apply_residents("d0", Some(one.clone()), 9),
            "older record"
        );
        assert_eq!(view.resident_count(), 2);
        assert!(view.apply_residents("d0", Some(one), 12));
        assert_eq!(view.device_of("b"), None);
        assert!(view.apply_residents("d0", None, 13));
        assert_eq!(view.resident_count(), 0);
        assert_eq!(view.device("d0").and_then(|d| d.residents_revision), None);
    }

    #[test]
    fn waiting_tasks_are_ordered_by_submission_and_expire() {
        let mut view = ClusterView::new(Arc::new(crate::model::ModelledMemory));
        let at = |id: &str, ms: i64| TaskSpec {
            task_id: id.into(),
            submitted_at_unix_ms: ms,
            ..Default::default()
        };
        view.note_waiting(&at("b", 200), &[], 1_000, 5_000, None);
        view.note_waiting(&at("a", 200), &[], 1_000, 5_000, None);
        view.note_waiting(&at("c", 100), &[], 1_000, 2_000, None);
        // No submission time: ordered by when the placer first saw it.
        view.note_waiting(&at("d", 0), &[], 1_500, 5_000, None);
        assert_eq!(view.waiting_ahead_of(&at("c", 100), 1_000), 0);
        // Ties by id: "a" is ahead of "b".
        assert_eq!(view.waiting_ahead_of(&at("a", 200), 1_000), 1);
        assert_eq!(view.waiting_ahead_of(&at("b", 200), 1_000), 2);
        assert_eq!(view.waiting_ahead_of(&at("d", 0), 1_000), 3);
        // Not waiting and no submission time: the newest, behind everyone.
        assert_eq!(view.waiting_ahead_of(&at("new", 0), 1_000), 4);
        assert_eq!(view.waiting_ahead_of(&at("early", 50), 1_000), 0);
        // "c" expires at 2,000 ms; refreshing "a" keeps its place in the queue.
        view.note_waiting(&at("a", 900), &[], 1_800, 9_000, None);
        assert_eq!(view.waiting_ahead_of(&at("b", 200), 2_000), 1);
        assert_eq!(view.waiting_ahead_of(&at("new", 0), 2_000), 3);
        assert!(view.forget_waiting("a"));
        assert!(!view.forget_waiting("a"));
        assert_eq!(view.waiting_ahead_of(&at("new", 0), 2_000), 2);
        // Noting drops expired entries.
        view.note_waiting(&at("e", 300), &[], 6_000, 7_000, None);
        let mut left: Vec<&str> = view.waiting().map(|(id, _)| id).collect();
        left.sort_unstable();
        assert_eq!(left, ["e"]);
    }

    #[test]
    fn dead_residents_are_those_whose_agent_ran_and_went_past_the_grace() {
        let mut view = ClusterView::new(Arc::new(crate::model::ModelledMemory));
        let record = DeviceResidents {
            device_id: "d0".into(),
            reservations: ["crashed", "restarted", "unstarted", "reported", "done"]
                .into_iter()
                .map(|t| reservation(t, 100))
                .collect(),
            ..Default::default()
        };
        view.apply_residents("d0", Some(record), 1);
        for task in ["crashed", "restarted", "done"] {
            view.set_alive(task);
        }
        // "reported" ran before this placer watched: a report, no alive key.
        for (task, finished) in [("reported", false), ("done", true)] {
            view.set_report(TaskReport {
                task_id: task.into(),
                finished,
                ..Default::default()
            });
        }
        view.set_not_alive("crashed", 1_000);
        view.set_not_alive("restarted", 1_000);
        view.set_not_alive("done", 1_000);
        // Not an agent we saw: nothing to start a clock for.
        view.set_not_alive("stranger", 1_000);
        let ids = |dead: Vec<DeadResident>| -> Vec<String> {
            dead.into_iter().map(|d| d.task_id).collect()
        };
        // The finished one at once; the others wait for the grace.
        assert_eq!(ids(view.dead_residents(1_500, 5_000)), ["done"]);
        view.set_alive("restarted");
        assert!(view.agent_alive("restarted"));
        assert_eq!(ids(view.dead_residents(5_999, 5_000)), ["done"]);
        let dead = view.dead_residents(6_000, 5_000);
        assert_eq!(ids(dead.clone()), ["crashed", "done"]);
        assert_eq!(dead[0].device_id, "d0");
        assert_eq!(
            (dead[0].gone_since_unix_ms, dead[0].finished),
            (1_000, false)
        );
        // "reported" was first noticed at 1,500 ms.
        assert_eq!(
            ids(view.dead_residents(6_500, 5_000)),
            ["crashed", "done", "reported"]
        );
        // Released (its reservation gone): no longer reported, its clock dropped.
        let record = DeviceResidents {
            device_id: "d0".into(),
            reservations: vec![reservation("restarted", 100), reservation("unstarted", 100)],
            ..Default::default()
        };
        view.apply_residents("d0", Some(record), 2);
        assert!(view.dead_residents(60_000, 5_000).is_empty());
        // Their reports stay until the Release's archive move deletes them: until then
        // the clocks are kept (for `dead_unreserved`), then dropped.
        assert_eq!(view.gone_since.len(), 2, "{:?}", view.gone_since);
        view.remove_report("reported");
        view.remove_report("done");
        assert!(view.dead_residents(60_000, 5_000).is_empty());
        assert!(view.gone_since.is_empty());
    }

    /// An id placed again while an earlier run's report is still under `tasks/` starts
    /// its grace afresh: the clock the earlier run left must not release the new
    /// placement early.
    #[test]
    fn a_task_placed_anew_does_not_inherit_an_earlier_runs_clock() {
        let mut view = ClusterView::new(Arc::new(crate::model::ModelledMemory));
        view.set_alive("again");
        view.set_report(TaskReport {
            task_id: "again".into(),
            ..Default::default()
        });
        view.set_not_alive("again", 1_000);
        assert!(view.dead_unreserved(1_500, 5_000).is_empty());
        view.skip_archiving("again");
        let record = DeviceResidents {
            device_id: "d0".into(),
            reservations: vec![reservation("again", 100)],
            ..Default::default()
        };
        view.apply_residents("d0", Some(record.clone()), 1);
        // Its clock starts when first noticed now, not at 1,000 ms.
        assert!(view.dead_residents(10_000, 5_000).is_empty());
        assert!(view.dead_residents(14_999, 5_000).is_empty());
        assert_eq!(view.dead_residents(15_000, 5_000).len(), 1);
        // The same record again (its own echo) keeps the clock running.
        view.apply_residents("d0", Some(record), 2);
        assert_eq!(view.dead_residents(15_000, 5_000).len(), 1);
        assert!(!view.not_archivable.contains("again"));

        // An earlier run's last report, written before this placement ("finished"), is
        // not this run's: it would release the placement before its agent started.
        view.set_report(TaskReport {
            task_id: "reused".into(),
            finished: true,
            reported_at_unix_ms: 100,
            ..Default::default()
        });
        let placed = Reservation {
            placed_at_unix_ms: 200,
            ..reservation("reused", 100)
        };
        let record = DeviceResidents {
            device_id: "d1".into(),
            reservations: vec![placed],
            ..Default::default()
        };
        view.apply_residents("d1", Some(record), 3);
        let dead: Vec<String> = view
            .dead_residents(16_000, 5_000)
            .into_iter()
            .map(|d| d.task_id)
            .collect();
        assert_eq!(dead, ["again"], "not the re-used id");
    }

    /// A release and a new placement of the same id that both fell in a compacted watch
    /// gap reach the view as one record that still lists the id: the placement time,
    /// not the id, says it was placed anew, so the earlier run's clock and its stale
    /// report go as they do when each write is seen.
    #[test]
    fn a_placement_missed_in_a_watch_gap_does_not_inherit_the_earlier_runs_clock() {
        let mut view = ClusterView::new(Arc::new(crate::model::ModelledMemory));
        let placed = |at: i64| Reservation {
            placed_at_unix_ms: at,
            ..reservation("again", 100)
        };
        let record = |at: i64| DeviceResidents {
            device_id: "d0".into(),
            reservations: vec![placed(at)],
            ..Default::default()
        };
        view.apply_residents("d0", Some(record(100)), 1);
        view.set_alive("again");
        view.set_report(TaskReport {
            task_id: "again".into(),
            finished: true,
            reported_at_unix_ms: 500,
            ..Default::default()
        });
        view.set_not_alive("again", 1_000);
        // Its own record again (an echo, or a shrink) keeps the clock and the report.
        view.apply_residents("d0", Some(record(100)), 2);
        assert_eq!(view.dead_residents(6_000, 5_000).len(), 1);
        assert!(view.reports.contains_key("again"));

        // Released and placed again at 2,000 ms, both missed: the view reloads.
        view.apply_residents("d0", Some(record(2_000)), 5);
        assert!(
            view.dead_residents(6_000, 5_000).is_empty(),
            "the new placement's grace starts when it is seen"
        );
        assert!(
            !view.reports.contains_key("again"),
            "the earlier run's finished report is not this run's"
        );
        assert_eq!(
            view.dead_residents(11_000, 5_000).len(),
            0,
            "no agent seen yet"
        );
    }

    /// A task that never held a reservation (or lost it) and whose agent is gone is
    /// found on the same clock as a dead resident; one whose agent runs, or that
    /// left no report, is not, and one that holds a reservation is the other list's.
    #[test]
    fn dead_unreserved_are_those_without_a_reservation_whose_agent_ran_and_went() {
        let mut view = ClusterView::new(Arc::new(crate::model::ModelledMemory));
        let record = DeviceResidents {
            device_id: "d0".into(),
            reservations: vec![reservation("resident", 100)],
            ..Default::default()
        };
        view.apply_residents("d0", Some(record), 1);
        for (task, finished) in [
            ("never-placed", false),
            ("finished", true),
            ("running", false),
            ("resident", false),
        ] {
            view.set_alive(task);
            view.set_report(TaskReport {
                task_id: task.into(),
                finished,
                ..Default::default()
            });
        }
        // An agent that ran and stopped before it ever reported leaves no report.
        view.set_alive("no-report");
        for task in ["never-placed", "finished", "resident", "no-report"] {
            view.set_not_alive(task, 1_000);
        }
        let ids = |dead: Vec<DeadUnreserved>| -> Vec<String> {
            dead.into_iter().map(|d| d.task_id).collect()
        };
        assert_eq!(ids(view.dead_unreserved(1_500, 5_000)), ["finished"]);
        let dead = view.dead_unreserved(6_000, 5_000);
        assert_eq!(ids(dead.clone()), ["finished", "never-placed"]);
        assert_eq!(
            (dead[1].gone_since_unix_ms, dead[1].finished),
            (1_000, false)
        );
        // The resident's clock is shared with `dead_residents`, which reports it.
        assert_eq!(
            view.dead_residents(6_000, 5_000)
                .into_iter()
                .map(|d| d.task_id)
                .collect::<Vec<_>>(),
            ["resident"]
        );
        // Archived (the report deleted): no longer found, its clock dropped.
        view.remove_report("never-placed");
        view.remove_report("finished");
        assert!(view.dead_unreserved(7_000, 5_000).is_empty());
        assert!(!view.gone_since.contains_key("never-placed"));
        assert!(!view.gone_since.contains_key("no-report"));
    }

    #[test]
    fn unstarted_residents_are_those_never_seen_alive_nor_reporting_past_the_grace() {
        let mut view = ClusterView::new(Arc::new(crate::model::ModelledMemory));
        let placed = |task: &str, at: i64| {
            let mut r = reservation(task, 100);
            r.placed_at_unix_ms = at;
            r
        };
        let record = DeviceResidents {
            device_id: "d0".into(),
            reservations: vec![
                placed("never", 1_000),
                placed("late", 4_000),
                placed("running", 1_000),
                placed("crashed", 1_000),
                placed("reported", 1_000),
            ],
            ..Default::default()
        };
        view.apply_residents("d0", Some(record), 1);
        view.set_alive("running");
        view.set_alive("crashed");
        view.set_not_alive("crashed", 2_000);
        view.set_report(TaskReport {
            task_id: "reported".into(),
            ..Default::default()
        });
        let ids = |found: Vec<UnstartedResident>| -> Vec<String> {
            found.into_iter().map(|u| u.task_id).collect()
        };
        assert!(view.unstarted_residents(5_999, 5_000).is_empty());
        let found = view.unstarted_residents(6_000, 5_000);
        assert_eq!(
            found,
            [UnstartedResident {
                task_id: "never".into(),
                device_id: "d0".into(),
                placed_at_unix_ms: 1_000
            }]
        );
        assert_eq!(
            ids(view.unstarted_residents(9_000, 5_000)),
            ["late", "never"]
        );
        // Its agent starts after all: no longer a candidate.
        view.set_alive("late");
        assert_eq!(ids(view.unstarted_residents(9_000, 5_000)), ["never"]);
    }

    #[test]
    fn reports_reach_residents_whichever_arrives_first() {
        let mut view = ClusterView::new(Arc::new(crate::model::ModelledMemory));
        view.set_report(TaskReport {
            task_id: "a".into(),
            samples_done: 400,
            samples_per_s: 100.0,
            reported_at_unix_ms: 1_000,
            ..Default::default()
        });
        let record = DeviceResidents {
            device_id: "d0".into(),
            reservations: vec![reservation("a", 100)],
            ..Default::default()
        };
        view.apply_residents("d0", Some(record), 5);
        let resident = &view.device("d0").expect("device").residents[0];
        // 600 samples left at 100/s, report 2 s old.
        assert_eq!(resident.remaining_s(3_000), Some(4.0));
        view.remove_report("a");
        let resident = &view.device("d0").expect("device").residents[0];
        assert_eq!(resident.remaining_s(3_000), None);
    }
}
