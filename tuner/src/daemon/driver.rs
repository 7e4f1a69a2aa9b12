//! The daemon's driver of the [`DeviceTuner`]: the store's watches in, the tuner's actions
//! out, in real time.
//!
//! The driver only translates. It diffs what the watches say (the device's reservations
//! and room claims, every task's `alive` key, report and assignment) against what it last
//! told the tuner, turns the difference into [`Input`]s stamped with the wall clock, steps
//! the tuner on a blocking thread (a step may fit a Gaussian process), and carries out the
//! [`Action`]s:
//! - a round's assignments in one transaction that compares the device's residents record
//!   and each of the round's assignment keys with the revisions the inputs came from, so a
//!   round decided before a placement changed the device, or before another writer's
//!   assignment (the placer's shrink, written with the record but seen through another
//!   watch) reached the tuner, is never written over it (the placer compares the
//!   residents' assignments in turn). A round that failed so is told to the tuner as lost
//!   once the watches show what beat it, with the assignments the store holds, and the
//!   tuner decides again at once rather than wait out the round's timeout;
//! - each co-location sample under the device's sample sequence;
//! - a production job's cap breach at `devices/{device}/breach` for the placer, deleted
//!   when the breach ends (if the record still names that job);
//! - the tuner's state, once per step.
//!
//! Every decision is the tuner's: replaying the [`JournalEntry`]s of a run into a fresh
//! [`DeviceTuner`] gives the same actions (the integration tests check this over a real
//! etcd).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use iadeep_proto::{BatchSizeAssignment, DeviceInfo, TunerState};
use iadeep_state::{Expect, Revision, StateStore, Txn, TxnOutcome, keys, typed};
use prost::Message;
use tokio::sync::{mpsc, watch};

use super::metrics::Metrics;
use super::tasks::{ResidentsRecord, TaskTable};
use crate::device_tuner::{
    Action, Counters, DeviceTask, DeviceTuner, DeviceTunerParams, Input, RunningTask, Translator,
};
use crate::error::{Result, TunerError};

/// One step of the tuner as the driver ran it: for diagnosis and replay.
#[derive(Clone, Debug, PartialEq)]
pub struct JournalEntry {
    pub now_ms: i64,
    pub inputs: Vec<Input>,
    pub actions: Vec<Action>,
}

/// See the module documentation.
pub(crate) struct Driver {
    pub store: Arc<dyn StateStore>,
    pub info: DeviceInfo,
    pub tasks_rx: watch::Receiver<TaskTable>,
    pub residents_rx: watch::Receiver<ResidentsRecord>,
    pub metrics: Arc<Metrics>,
    pub journal: Option<mpsc::UnboundedSender<JournalEntry>>,
    /// See [`super::DaemonParams::samples_kept`].
    samples_kept: u64,
    told: Translator,
    /// The revisions the tuner's view came from, which a round's transaction compares.
    decided_on: DecidedOn,
    /// Assignment keys this driver wrote, with the revision of the commit: what is there
    /// until the task table shows a newer write (its watch may not have delivered ours yet).
    own_writes: BTreeMap<String, Revision>,
    /// The residents record did not decode when last looked at (logged once).
    warned_undecodable: bool,
    counters: Counters,
    /// When the metrics were last brought up to the tuner's status, and how many production
    /// jobs were above their caps then (what the time since counts for).
    above_cap_since: Option<(i64, usize)>,
    /// A breach the tuner reported whose record could not be written: written again at
    /// every later step until a write succeeds or its end is reported. The tuner reports a
    /// breach once per co-location, so without this a lost write would leave the job above
    /// its cap with no one evicted.
    pending_breach: Option<iadeep_proto::CapBreach>,
    /// The last round whose transaction failed its comparison, until the watches show what
    /// beat it (see [`LostRound`]); a later round replaces it.
    lost_round: Option<LostRound>,
}

/// A round the tuner assigned that was never written: another writer changed a compared
/// key first. The tuner is told ([`Input::RoundLost`]) once the driver's view shows that
/// write, so it decides again on it at once; told earlier, it would decide on the view that
/// lost and lose again, and not told at all, it would wait out the round's timeout.
#[derive(Clone, Debug)]
struct LostRound {
    round: u64,
    /// The residents record's mod-revision when the round failed (`None`: absent).
    residents_now: Option<Revision>,
    /// Each task of the round, with its assignment key's mod-revision then.
    assignments_now: Vec<(String, Option<Revision>)>,
}

impl LostRound {
    /// Whether a view of the residents record at `residents` and of `table` shows every
    /// compared key as it was when the round failed, or later. Key by key: the task table
    /// folds a transaction's events one at a time, so its revision may reach a commit
    /// before every key that commit wrote is in it. A key absent then counts as seen while
    /// the view has it absent too, or written after every key the failure showed; a
    /// residents record gone since counts as seen (its tasks leave the tuner anyway).
    fn seen_in(&self, residents: Option<Revision>, table: &TaskTable) -> bool {
        let latest = self
            .assignments_now
            .iter()
            .filter_map(|(_, now)| *now)
            .chain(self.residents_now)
            .max()
            .unwrap_or(0);
        let residents_seen = match (self.residents_now, residents) {
            (Some(now), Some(seen)) => seen >= now,
            (None, Some(seen)) => seen > latest,
            (_, None) => true,
        };
        residents_seen
            && self.assignments_now.iter().all(|(id, now)| {
                let seen = table.tasks.get(id).and_then(|t| t.assignment_revision);
                match (now, seen) {
                    (Some(now), Some(seen)) => seen >= *now,
                    // Deleted since: the table has folded events past the failure.
                    (Some(now), None) => table.revision > *now,
                    (None, Some(seen)) => seen > latest,
                    (None, None) => true,
                }
            })
    }
}

/// The revisions a round is decided on: the device's residents record's, and each task's
/// assignment key's (a task missing here had none).
#[derive(Clone, Debug, Default)]
struct DecidedOn {
    residents: Option<Revision>,
    assignments: BTreeMap<String, Revision>,
}

/// Wakes at least this often while waiting, to notice a stop.
const STOP_POLL: Duration = Duration::from_millis(200);

impl Driver {
    pub fn new(
        store: Arc<dyn StateStore>,
        info: DeviceInfo,
        tasks_rx: watch::Receiver<TaskTable>,
        residents_rx: watch::Receiver<ResidentsRecord>,
        metrics: Arc<Metrics>,
        journal: Option<mpsc::UnboundedSender<JournalEntry>>,
        samples_kept: u64,
    ) -> Driver {
        Driver {
            store,
            info,
            tasks_rx,
            residents_rx,
            metrics,
            journal,
            samples_kept,
            told: Translator::default(),
            decided_on: DecidedOn::default(),
            own_writes: BTreeMap::new(),
            warned_undecodable: false,
            counters: Counters::default(),
            above_cap_since: None,
            pending_breach: None,
            lost_round: None,
        }
    }

    /// The tuner, resumed from the device's persisted state if there is one. A state that
    /// does not decode is moved aside (see [`set_aside_corrupt_state`]) and the tuner
    /// starts fresh: its observations are lost, the device is not.
    ///
    /// Called when this daemon takes the device over, it also withdraws any breach record
    /// left by an earlier tuner: which breaches were reported is not persisted, so such a
    /// record would never be ended, and the placer would act on it whatever its age. The
    /// new tuner measures again and reports a breach that still holds.
    pub async fn tuner(&self, params: DeviceTunerParams) -> Result<DeviceTuner> {
        let device = &self.info.device_id;
        let breach = keys::device_breach(device);
        if self.store.delete(&breach).await? {
            tracing::info!(device, key = %breach,
                "withdrew the breach record of an earlier tuner of the device; it is measured again");
        }
        let key = keys::device_tuner(device);
        let persisted: Option<TunerState> = match self.store.get(&key).await? {
            None => None,
            Some(kv) => match typed::decode::<TunerState>(&kv) {
                Ok(state) => Some(state),
                Err(err) => {
                    Metrics::inc(&self.metrics.errors);
                    set_aside_corrupt_state(self.store.as_ref(), device, &kv, &err).await?;
                    None
                }
            },
        };
        if let Some(s) = &persisted {
            tracing::info!(device, round = s.round, observations = s.observations.len(),
                tasks = ?s.task_ids, "resuming from persisted tuner state");
        }
        let mut tuner = DeviceTuner::new(&self.info, params, persisted.as_ref())?;
        tuner.ensure_next_sample_seq(self.next_sample_seq().await?);
        Ok(tuner)
    }

    /// One past the last sample key of the device, so a tuner whose state write was lost
    /// never overwrites a sample.
    async fn next_sample_seq(&self) -> Result<u64> {
        let snapshot = self
            .store
            .range(&keys::device_samples_prefix(&self.info.device_id))
            .await?;
        Ok(snapshot
            .kvs
            .iter()
            .filter_map(|kv| match keys::KeyKind::parse(&kv.key) {
                keys::KeyKind::Sample { seq, .. } => Some(seq + 1),
                _ => None,
            })
            .max()
            .unwrap_or(0))
    }

    /// Runs the tuner until `stop` says so; returns it (to persist its last state).
    pub async fn run(
        mut self,
        mut tuner: DeviceTuner,
        mut stop: watch::Receiver<bool>,
    ) -> Result<DeviceTuner> {
        loop {
            if *stop.borrow() {
                return Ok(tuner);
            }
            let mut inputs = self.diff();
            let now_ms = iadeep_proto::now_unix_ms();
            let due = tuner.next_wakeup_ms().is_some_and(|w| w <= now_ms);
            if inputs.is_empty() && !due {
                let wait = tuner
                    .next_wakeup_ms()
                    .map(|w| Duration::from_millis(u64::try_from(w - now_ms).unwrap_or(0)))
                    .unwrap_or(STOP_POLL)
                    .min(STOP_POLL);
                tokio::select! {
                    _ = self.tasks_rx.changed() => {}
                    _ = self.residents_rx.changed() => {}
                    _ = stop.changed() => {}
                    () = tokio::time::sleep(wait) => {}
                }
                continue;
            }
            if inputs.is_empty() {
                inputs.push(Input::Tick);
            }
            let decided_on = self.decided_on.clone();
            let journal_inputs = self.journal.is_some().then(|| inputs.clone());
            let (back, actions) = tokio::task::spawn_blocking(move || {
                let actions = tuner.step(now_ms, inputs);
                (tuner, actions)
            })
            .await
            .map_err(|e| TunerError::Daemon(format!("tuner step panicked: {e}")))?;
            tuner = back;
            if let (Some(journal), Some(inputs)) = (&self.journal, journal_inputs) {
                let _ = journal.send(JournalEntry {
                    now_ms,
                    inputs,
                    actions: actions.clone(),
                });
            }
            self.execute(actions, &decided_on).await;
            self.update_metrics(&tuner, now_ms);
        }
    }

    /// What changed since the tuner was last told, as inputs: a lost round the view now
    /// explains first (with the assignments the store holds for its tasks), then
    /// departures, then arrivals and holds, then assignments, then reports.
    fn diff(&mut self) -> Vec<Input> {
        let record = self.residents_rx.borrow_and_update().clone();
        let table = self.tasks_rx.borrow_and_update().clone();
        if record.undecodable {
            if !self.warned_undecodable {
                Metrics::inc(&self.metrics.errors);
                tracing::error!(device = %self.info.device_id,
                    "the device's residents record does not decode; keeping the residents as they were until the placer rewrites it");
                self.warned_undecodable = true;
            }
            return Vec::new();
        }
        self.warned_undecodable = false;
        let mut now: BTreeMap<String, DeviceTask> = BTreeMap::new();
        for r in record.record.iter().flat_map(|r| &r.reservations) {
            let entry = table.tasks.get(&r.task_id);
            let spec = r
                .spec
                .clone()
                .or_else(|| entry.and_then(|e| e.spec.clone()));
            let resident = match (entry, spec) {
                (Some(e), Some(spec)) if e.running() => {
                    DeviceTask::Running(Box::new(RunningTask {
                        spec,
                        reserved_mib: r.reserved_mem_mib,
                        report: e.report.clone(),
                        assignment: e.assignment.clone(),
                    }))
                }
                _ => DeviceTask::Held {
                    mib: r.reserved_mem_mib,
                },
            };
            now.insert(r.task_id.clone(), resident);
        }
        // Room a production task's placement evicted residents for is the claimant's until
        // it is placed or the claim expires (the placer counts it as a resident would): the
        // tuner keeps it free too, so no resident grows into it meanwhile.
        let now_ms = iadeep_proto::now_unix_ms();
        for claim in record.record.iter().flat_map(|r| &r.claims) {
            if claim.until_unix_ms > now_ms && !now.contains_key(&claim.task_id) {
                now.insert(
                    claim.task_id.clone(),
                    DeviceTask::Held { mib: claim.mem_mib },
                );
            }
        }
        self.decided_on = self.decided_on_now(record.mod_revision, &table);
        let mut inputs = self.lost_round_seen(record.mod_revision, &table, &now);
        inputs.extend(self.told.diff(now));
        inputs
    }

    /// The lost round, once this view shows what beat it: [`Input::RoundLost`], then the
    /// assignment the store holds for each of its tasks still on the device (what the tuner
    /// takes for what runs in place of the round).
    fn lost_round_seen(
        &mut self,
        residents: Option<Revision>,
        table: &TaskTable,
        on_device: &BTreeMap<String, DeviceTask>,
    ) -> Vec<Input> {
        let Some(lost) = self
            .lost_round
            .take_if(|lost| lost.seen_in(residents, table))
        else {
            return Vec::new();
        };
        let held = lost
            .assignments_now
            .iter()
            .filter(|(id, _)| on_device.contains_key(id))
            .filter_map(|(id, _)| table.tasks.get(id)?.assignment.clone())
            .map(Input::Assigned);
        let task_ids = lost
            .assignments_now
            .iter()
            .map(|(id, _)| id.clone())
            .collect();
        std::iter::once(Input::RoundLost {
            round: lost.round,
            task_ids,
        })
        .chain(held)
        .collect()
    }

    /// The revisions of the residents record and of every assignment key as this step sees
    /// them: the table's, or this driver's own later write that the table has not shown yet.
    fn decided_on_now(&mut self, residents: Option<Revision>, table: &TaskTable) -> DecidedOn {
        let mut assignments: BTreeMap<String, Revision> = table
            .tasks
            .iter()
            .filter_map(|(id, t)| Some((id.clone(), t.assignment_revision?)))
            .collect();
        self.own_writes.retain(|id, own| {
            table.tasks.contains_key(id) && assignments.get(id).is_none_or(|seen| *seen < *own)
        });
        for (id, own) in &self.own_writes {
            assignments.insert(id.clone(), *own);
        }
        DecidedOn {
            residents,
            assignments,
        }
    }

    async fn execute(&mut self, actions: Vec<Action>, decided_on: &DecidedOn) {
        // A breach whose write failed at an earlier step (see `pending_breach`); one
        // reported by this step writes itself.
        if !actions.iter().any(|a| matches!(a, Action::CapBreached(_))) {
            self.write_pending_breach().await;
        }
        let mut persist = None;
        for action in actions {
            match action {
                Action::Assign(assignments) => self.assign(assignments, decided_on).await,
                Action::Sample { seq, sample } => {
                    let key = keys::sample(&self.info.device_id, seq);
                    let mut txn = Txn::new().put(key.as_str(), sample.encode_to_vec(), None);
                    // Keeps the newest `samples_kept`: sequences are contiguous per device.
                    if let Some(oldest) = seq.checked_sub(self.samples_kept) {
                        txn = txn.delete(keys::sample(&self.info.device_id, oldest));
                    }
                    if let Err(err) = self.store.transact(txn).await {
                        Metrics::inc(&self.metrics.errors);
                        tracing::warn!(%err, %key, "cannot write a co-location sample");
                    }
                }
                Action::Persist(state) => persist = Some(state),
                Action::CapBreached(breach) => self.breached(breach).await,
                Action::CapRestored { task_id } => self.restored(&task_id).await,
                Action::Profile {
                    model,
                    device_kind,
                    points,
                } => {
                    if let Err(err) = iadeep_state::registry::record(
                        self.store.as_ref(),
                        &model,
                        &device_kind,
                        &points,
                    )
                    .await
                    {
                        Metrics::inc(&self.metrics.errors);
                        tracing::warn!(%err, %model, "cannot record a measurement in the profile registry");
                    }
                }
            }
        }
        if let Some(state) = persist {
            save(
                self.store.as_ref(),
                &self.info.device_id,
                &state,
                &self.metrics,
            )
            .await;
        }
    }

    /// Writes one round in one transaction, compared with the residents record and the
    /// assignment keys the round was decided on.
    async fn assign(&mut self, assignments: Vec<BatchSizeAssignment>, decided_on: &DecidedOn) {
        let expect = |revision: Option<Revision>| match revision {
            Some(rev) => Expect::ModRevision(rev),
            None => Expect::Absent,
        };
        let key = keys::device_residents(&self.info.device_id);
        let mut txn = Txn::new().compare(key.as_str(), expect(decided_on.residents));
        for a in &assignments {
            let key = keys::task_assignment(&a.task_id);
            let seen = decided_on.assignments.get(&a.task_id).copied();
            txn = txn
                .compare(key.as_str(), expect(seen))
                .put(key, a.encode_to_vec(), None);
        }
        // A newer round supersedes a lost one the tuner was not told of yet: counted here,
        // since the tuner, which counts the rounds it drops, never learns of it.
        if self.lost_round.take().is_some() {
            Metrics::inc(&self.metrics.rounds_dropped);
        }
        match self.store.transact(txn).await {
            Ok(TxnOutcome::Committed { revision }) => {
                let revisions = vec![Some(revision); assignments.len()];
                self.written(&assignments, &revisions);
            }
            Ok(TxnOutcome::Failed { current }) => {
                // What each compared key holds now: the residents record at 0, then the
                // round's assignment keys in order.
                let now = |i: usize| current.get(i).and_then(Option::as_ref);
                // A transaction the etcd client sent again after a member failed may have
                // committed the first time and fail its comparisons the second, against its
                // own writes (`iadeep_state::etcd`): the keys hold exactly what it wrote.
                let own = assignments
                    .iter()
                    .enumerate()
                    .all(|(i, a)| now(i + 1).is_some_and(|kv| kv.value == a.encode_to_vec()));
                let revisions: Vec<Option<Revision>> = (0..assignments.len())
                    .map(|i| now(i + 1).map(|kv| kv.mod_revision))
                    .collect();
                if own {
                    self.written(&assignments, &revisions);
                    return;
                }
                let Some(round) = assignments.first().map(|a| a.round) else {
                    return;
                };
                tracing::info!(device = %self.info.device_id, round,
                    "the device's reservations or a task's assignment changed since the round was decided; round not written");
                self.lost_round = Some(LostRound {
                    round,
                    residents_now: now(0).map(|kv| kv.mod_revision),
                    assignments_now: assignments
                        .iter()
                        .map(|a| a.task_id.clone())
                        .zip(revisions)
                        .collect(),
                });
            }
            Err(err) => {
                Metrics::inc(&self.metrics.errors);
                tracing::warn!(%err, "cannot write the round's assignments; the round will time out and be tried again");
            }
        }
    }

    /// Notes the round's assignments as written, each at its commit's revision.
    fn written(&mut self, assignments: &[BatchSizeAssignment], revisions: &[Option<Revision>]) {
        for (a, revision) in assignments.iter().zip(revisions) {
            if let Some(revision) = revision {
                self.own_writes.insert(a.task_id.clone(), *revision);
            }
            Metrics::inc(&self.metrics.assignments);
            tracing::debug!(task = %a.task_id, round = a.round, batch_size = a.batch_size,
                lr_factor = a.lr_factor, "assignment written");
        }
    }

    /// Publishes a breach for the placer (it evicts one of the opportunistic co-runners and
    /// deletes the record in the same transaction). A failed write is logged and counted,
    /// and tried again at every later step until it succeeds or the breach ends (see
    /// `pending_breach`).
    async fn breached(&mut self, breach: iadeep_proto::CapBreach) {
        Metrics::inc(&self.metrics.cap_breaches);
        tracing::warn!(device = %self.info.device_id, task = %breach.task_id,
            measured_pd = breach.measured_pd, max_slowdown = breach.max_slowdown,
            rounds_above = breach.rounds_above, opportunistic = ?breach.opportunistic_task_ids,
            round = breach.round,
            "production job above its slowdown cap with every opportunistic co-runner at its smallest size; asking the placer to evict one");
        self.pending_breach = Some(breach);
        self.write_pending_breach().await;
    }

    /// Writes the breach not yet written, if any; it stays pending when the write fails.
    async fn write_pending_breach(&mut self) {
        let Some(breach) = &self.pending_breach else {
            return;
        };
        let key = keys::device_breach(&self.info.device_id);
        match typed::put(self.store.as_ref(), &key, breach, None).await {
            Ok(_) => self.pending_breach = None,
            Err(err) => {
                Metrics::inc(&self.metrics.errors);
                tracing::warn!(%err, %key, "cannot write the breach record; trying again at the next step");
            }
        }
    }

    /// The breach of `task_id` is over: deletes the device's breach record if it still
    /// names that job (compared on its revision, so a newer breach of another job, or the
    /// placer's deletion, is never undone).
    async fn restored(&mut self, task_id: &str) {
        tracing::info!(device = %self.info.device_id, task = %task_id,
            "production job back under its slowdown cap (or gone); breach over");
        if self
            .pending_breach
            .as_ref()
            .is_some_and(|b| b.task_id == task_id)
        {
            self.pending_breach = None;
        }
        let key = keys::device_breach(&self.info.device_id);
        let found = match typed::get::<iadeep_proto::CapBreach>(self.store.as_ref(), &key).await {
            Ok(found) => found,
            Err(err) => {
                Metrics::inc(&self.metrics.errors);
                tracing::warn!(%err, %key, "cannot read the breach record to delete it");
                return;
            }
        };
        let Some((breach, kv)) = found else {
            return;
        };
        if breach.task_id != task_id {
            return;
        }
        let txn = Txn::new()
            .compare(key.as_str(), Expect::ModRevision(kv.mod_revision))
            .delete(key.as_str());
        match self.store.transact(txn).await {
            Ok(TxnOutcome::Committed { .. }) => {}
            Ok(TxnOutcome::Failed { .. }) => {
                tracing::debug!(%key, "breach record changed meanwhile; left as it is");
            }
            Err(err) => {
                Metrics::inc(&self.metrics.errors);
                tracing::warn!(%err, %key, "cannot delete the breach record");
            }
        }
    }

    /// Brings the metrics up to the tuner's status.
    fn update_metrics(&mut self, tuner: &DeviceTuner, now_ms: i64) {
        use std::sync::atomic::Ordering;
        let status = tuner.status();
        let m = &self.metrics;
        let before = std::mem::replace(&mut self.counters, status.counters);
        let add = |counter: &std::sync::atomic::AtomicU64, now: u64, was: u64| {
            for _ in was..now {
                Metrics::inc(counter);
            }
        };
        add(
            &m.rounds,
            status.counters.measured + status.counters.out_of_memory,
            before.measured + before.out_of_memory,
        );
        add(&m.rounds_dropped, status.counters.dropped, before.dropped);
        add(
            &m.out_of_memory,
            status.counters.out_of_memory,
            before.out_of_memory,
        );
        add(&m.samples, status.counters.samples, before.samples);
        m.residents
            .store(status.residents as u64, Ordering::Relaxed);
        m.round.store(status.round, Ordering::Relaxed);
        m.settled
            .store(u64::from(status.settled), Ordering::Relaxed);
        if let Some(v) = status.last_sum_pd {
            m.set_sum_pd(v);
        }
        // A job counts as above its cap from the step that measured it there until the
        // step that measured it back under (or saw it leave).
        if let Some((since_ms, above)) = self.above_cap_since {
            let elapsed = u64::try_from(now_ms.saturating_sub(since_ms)).unwrap_or(0);
            m.above_cap_ms
                .fetch_add(elapsed * above as u64, Ordering::Relaxed);
        }
        self.above_cap_since = Some((now_ms, status.above_cap));
        m.set_task_pds(
            tuner
                .measured_pds()
                .into_iter()
                .map(|p| (p.task_id, p.class, p.pd))
                .collect(),
        );
    }
}

/// Moves an undecodable tuner state `kv` to `devices/{d}/tuner.corrupt` (the bytes kept for
/// diagnosis) in one transaction compared with the state's revision, so a state a newer
/// tuner wrote meanwhile is never lost; warns naming both keys.
async fn set_aside_corrupt_state(
    store: &dyn StateStore,
    device: &str,
    kv: &iadeep_state::KeyValue,
    err: &iadeep_state::StateError,
) -> Result<()> {
    let aside = keys::device_tuner_corrupt(device);
    let txn = Txn::new()
        .compare(kv.key.as_str(), Expect::ModRevision(kv.mod_revision))
        .put(aside.as_str(), kv.value.clone(), None)
        .delete(kv.key.as_str());
    match store.transact(txn).await? {
        TxnOutcome::Committed { .. } => {
            tracing::warn!(device, key = %kv.key, %aside, %err,
                "the persisted tuner state does not decode; its bytes are kept aside and the tuner starts fresh");
            Ok(())
        }
        TxnOutcome::Failed { .. } => Err(TunerError::Daemon(format!(
            "{} changed while the tuner was moving its undecodable value aside; is another \
             tuner running for device {device}?",
            kv.key
        ))),
    }
}

/// Persists the tuner's state; a failure is logged and counted (the next step tries again).
pub(crate) async fn save(
    store: &dyn StateStore,
    device_id: &str,
    state: &TunerState,
    metrics: &Metrics,
) {
    let key = keys::device_tuner(device_id);
    if let Err(err) = typed::put(store, &key, state, None).await {
        Metrics::inc(&metrics.errors);
        tracing::warn!(%err, "cannot persist the tuner state");
    }
}

#[cfg(test)]
mod tests {
    use iadeep_proto::CoLocationSample;
    use iadeep_state::EmbeddedStore;
    use iadeep_state::testing::{FaultStore, Op};

    use super::super::tasks::TaskEntry;
    use super::*;

    /// A driver of device d0 over `store`, keeping 3 samples.
    fn driver(store: &Arc<dyn StateStore>) -> Driver {
        let info = DeviceInfo {
            device_id: "d0".into(),
            ..Default::default()
        };
        let (_tasks_tx, tasks_rx) = watch::channel(TaskTable::default());
        let (_residents_tx, residents_rx) = watch::channel(ResidentsRecord::default());
        Driver::new(
            store.clone(),
            info,
            tasks_rx,
            residents_rx,
            Arc::new(Metrics::default()),
            None,
            3,
        )
    }

    /// An unexpired room claim holds its memory on the device as a placed task that does
    /// not run yet would; an expired one holds nothing.
    #[test]
    fn room_claims_hold_their_memory_until_they_expire() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let mut driver = driver(&store);
        let now_ms = iadeep_proto::now_unix_ms();
        let claim = |task: &str, until_unix_ms: i64| iadeep_proto::Claim {
            task_id: task.into(),
            mem_mib: 4000,
            until_unix_ms,
            evicting: vec!["victim".into()],
        };
        let (tx, rx) = watch::channel(ResidentsRecord {
            record: Some(iadeep_proto::DeviceResidents {
                device_id: "d0".into(),
                reservations: Vec::new(),
                claims: vec![claim("prod", now_ms + 60_000), claim("old", now_ms - 1)],
            }),
            mod_revision: Some(7),
            undecodable: false,
        });
        driver.residents_rx = rx;
        assert_eq!(
            driver.diff(),
            [Input::Reserved {
                task_id: "prod".into(),
                mib: 4000
            }]
        );
        // The claim expires (or the claimant is placed and the record drops it).
        tx.send_modify(|r| {
            if let Some(record) = &mut r.record {
                record.claims.clear();
            }
        });
        assert_eq!(
            driver.diff(),
            [Input::Left {
                task_id: "prod".into()
            }]
        );
    }

    /// Task a's assignment at `batch_size` under `round`.
    fn assignment(batch_size: u32, round: u64) -> BatchSizeAssignment {
        BatchSizeAssignment {
            task_id: "a".into(),
            batch_size,
            round,
            ..Default::default()
        }
    }

    /// The placer writes d0's residents record and a's shrink to 45 under round 4 in one
    /// transaction; returns its revision.
    async fn placer_shrinks_a(store: &Arc<dyn StateStore>) -> Revision {
        let record = iadeep_proto::DeviceResidents {
            device_id: "d0".into(),
            ..Default::default()
        };
        let placed = store
            .transact(
                Txn::new()
                    .put(keys::device_residents("d0"), record.encode_to_vec(), None)
                    .put(
                        keys::task_assignment("a"),
                        assignment(45, 4).encode_to_vec(),
                        None,
                    ),
            )
            .await
            .expect("the placer's commit");
        let TxnOutcome::Committed { revision } = placed else {
            panic!("{placed:?}")
        };
        revision
    }

    /// The task watch shows [`placer_shrinks_a`]'s write, committed at `revision`.
    fn shrink_seen(table: &mut TaskTable, revision: Revision) {
        table.revision = table.revision.max(revision);
        table.tasks.insert(
            "a".into(),
            TaskEntry {
                assignment: Some(assignment(45, 4)),
                assignment_revision: Some(revision),
                ..Default::default()
            },
        );
    }

    /// The placer writes the device's residents record and a resident's shrink in one
    /// transaction; the tuner, whose task watch has not delivered the shrink yet, decides
    /// a round on the new record. That round is not written over the shrink (its agent
    /// would never run what the key then says); decided on what the store holds, or on the
    /// driver's own last write that its watch has not shown yet, it is.
    #[tokio::test]
    async fn a_round_is_never_written_over_an_assignment_the_tuner_has_not_seen() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let mut driver = driver(&store);
        let revision = placer_shrinks_a(&store).await;
        let stored = async || {
            typed::get::<BatchSizeAssignment>(store.as_ref(), &keys::task_assignment("a"))
                .await
                .expect("read")
                .map(|(a, _)| (a.batch_size, a.round))
        };
        let mut table = TaskTable::default();
        table.tasks.insert("a".into(), TaskEntry::default());
        // The record seen, the shrink not yet.
        let lagging = driver.decided_on_now(Some(revision), &table);
        let round = |b| vec![Action::Assign(vec![assignment(b, 4)])];
        driver.execute(round(64), &lagging).await;
        assert_eq!(stored().await, Some((45, 4)), "the placer's shrink stays");

        // Once the watch has shown it, the tuner's next round is written.
        shrink_seen(&mut table, revision);
        let seen = driver.decided_on_now(Some(revision), &table);
        driver
            .execute(vec![Action::Assign(vec![assignment(64, 5)])], &seen)
            .await;
        assert_eq!(stored().await, Some((64, 5)));
        // And the one after, though the watch has not shown the driver's own write yet.
        let own = driver.decided_on_now(Some(revision), &table);
        driver
            .execute(vec![Action::Assign(vec![assignment(90, 6)])], &own)
            .await;
        assert_eq!(stored().await, Some((90, 6)));
    }

    /// A round that lost its transaction is told to the tuner as lost, with the assignment
    /// the store holds, once the view shows the write that beat it (told on the view that
    /// lost, the tuner would decide on it again and lose again), and only once. A round
    /// written later supersedes it.
    #[tokio::test]
    async fn a_lost_round_is_told_once_the_view_shows_what_beat_it() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let mut driver = driver(&store);
        let revision = placer_shrinks_a(&store).await;
        let on_device = BTreeMap::from([("a".to_owned(), DeviceTask::Held { mib: 0 })]);
        let told = |driver: &mut Driver, table: &TaskTable| {
            driver.lost_round_seen(Some(revision), table, &on_device)
        };
        let mut table = TaskTable::default();
        table.tasks.insert("a".into(), TaskEntry::default());
        let lagging = driver.decided_on_now(Some(revision), &table);
        driver
            .execute(vec![Action::Assign(vec![assignment(64, 4)])], &lagging)
            .await;
        assert!(
            told(&mut driver, &table).is_empty(),
            "not told before the view shows the placer's write"
        );
        // The table's revision has reached the placer's commit, but its fold has not taken
        // in a's key yet (it applies a commit's events one at a time).
        table.revision = revision;
        assert!(
            told(&mut driver, &table).is_empty(),
            "not told before the view holds the key that beat the round"
        );
        shrink_seen(&mut table, revision);
        assert_eq!(
            told(&mut driver, &table),
            vec![
                Input::RoundLost {
                    round: 4,
                    task_ids: vec!["a".into()]
                },
                Input::Assigned(assignment(45, 4))
            ]
        );
        assert!(told(&mut driver, &table).is_empty(), "told once");

        // Lost again, then a later round written: nothing is told of the lost one, which
        // counts as dropped.
        driver
            .execute(vec![Action::Assign(vec![assignment(64, 5)])], &lagging)
            .await;
        let seen = driver.decided_on_now(Some(revision), &table);
        driver
            .execute(vec![Action::Assign(vec![assignment(64, 6)])], &seen)
            .await;
        assert!(told(&mut driver, &table).is_empty());
        assert_eq!(driver_metric(&driver.metrics.rounds_dropped), 1);
    }

    fn driver_metric(counter: &std::sync::atomic::AtomicU64) -> u64 {
        counter.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A round whose transaction committed but came back failed (the etcd client sent it
    /// again after a member failed, and the second attempt met its own writes) is taken as
    /// written: the store holds exactly what it wrote.
    #[tokio::test]
    async fn a_round_that_failed_against_its_own_writes_was_written() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let mut driver = driver(&store);
        let revision = placer_shrinks_a(&store).await;
        let mut table = TaskTable::default();
        shrink_seen(&mut table, revision);
        let seen = driver.decided_on_now(Some(revision), &table);
        let round = vec![Action::Assign(vec![assignment(64, 5)])];
        driver.execute(round.clone(), &seen).await;
        // The same transaction again, as the client's second attempt.
        driver.own_writes.clear();
        driver.execute(round, &seen).await;
        assert!(driver.lost_round.is_none(), "{:?}", driver.lost_round);
        assert!(driver.own_writes.contains_key("a"), "noted as written");
        assert_eq!(driver_metric(&driver.metrics.rounds_dropped), 0);
    }

    /// Device d0's cap breach of `task`.
    fn breach(task: &str) -> iadeep_proto::CapBreach {
        iadeep_proto::CapBreach {
            device_id: "d0".into(),
            task_id: task.into(),
            ..Default::default()
        }
    }

    /// The job device d0's stored breach record names, if there is one.
    async fn breach_of(store: &dyn StateStore) -> Option<String> {
        typed::get::<iadeep_proto::CapBreach>(store, &keys::device_breach("d0"))
            .await
            .expect("read")
            .map(|(b, _)| b.task_id)
    }

    /// A breach's end deletes the device's breach record only while it names that job: a
    /// newer breach of another job stays for the placer.
    #[tokio::test]
    async fn a_breach_ends_only_its_own_record() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let mut driver = driver(&store);
        driver
            .execute(
                vec![Action::CapBreached(breach("p1"))],
                &DecidedOn::default(),
            )
            .await;
        assert_eq!(
            driver
                .metrics
                .cap_breaches
                .load(std::sync::atomic::Ordering::Relaxed),
            1
        );
        driver
            .execute(
                vec![Action::CapBreached(breach("p2"))],
                &DecidedOn::default(),
            )
            .await;
        assert_eq!(breach_of(store.as_ref()).await.as_deref(), Some("p2"));
        driver
            .execute(
                vec![Action::CapRestored {
                    task_id: "p1".into(),
                }],
                &DecidedOn::default(),
            )
            .await;
        assert_eq!(
            breach_of(store.as_ref()).await.as_deref(),
            Some("p2"),
            "not p1's record"
        );
        driver
            .execute(
                vec![Action::CapRestored {
                    task_id: "p2".into(),
                }],
                &DecidedOn::default(),
            )
            .await;
        assert_eq!(breach_of(store.as_ref()).await, None);
        // Nothing to delete: nothing happens.
        driver
            .execute(
                vec![Action::CapRestored {
                    task_id: "p2".into(),
                }],
                &DecidedOn::default(),
            )
            .await;
        assert_eq!(
            driver
                .metrics
                .errors
                .load(std::sync::atomic::Ordering::Relaxed),
            0
        );
    }

    /// An in-memory store whose next put fails, as a store that is briefly unreachable does.
    fn failing_one_put() -> Arc<FaultStore> {
        let store = FaultStore::in_memory();
        store.fail_next(Op::Put, 1);
        Arc::new(store)
    }

    /// A breach whose write failed is written at the next step (the tuner reports it only
    /// once), and not once its end was reported.
    #[tokio::test]
    async fn a_failed_breach_write_is_tried_again() {
        let store: Arc<dyn StateStore> = failing_one_put();
        let mut driver = driver(&store);
        let key = keys::device_breach("d0");
        driver
            .execute(
                vec![Action::CapBreached(breach("p1"))],
                &DecidedOn::default(),
            )
            .await;
        assert_eq!(
            breach_of(store.as_ref()).await,
            None,
            "the first write fails"
        );
        driver.execute(Vec::new(), &DecidedOn::default()).await;
        assert_eq!(
            breach_of(store.as_ref()).await.as_deref(),
            Some("p1"),
            "written at the next step"
        );
        // The placer evicts and deletes it: it is not written again.
        store.delete(&key).await.expect("delete");
        driver.execute(Vec::new(), &DecidedOn::default()).await;
        assert_eq!(breach_of(store.as_ref()).await, None);
        // A breach that ends before its write succeeded is not written afterwards.
        let store: Arc<dyn StateStore> = failing_one_put();
        let mut driver = self::driver(&store);
        driver
            .execute(
                vec![Action::CapBreached(breach("p1"))],
                &DecidedOn::default(),
            )
            .await;
        driver
            .execute(
                vec![Action::CapRestored {
                    task_id: "p1".into(),
                }],
                &DecidedOn::default(),
            )
            .await;
        driver.execute(Vec::new(), &DecidedOn::default()).await;
        assert_eq!(store.get(&key).await.expect("read"), None);
    }

    /// A daemon taking the device over withdraws the breach record an earlier tuner left
    /// (its end would never be reported).
    #[tokio::test]
    async fn taking_a_device_over_withdraws_an_old_breach() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let key = keys::device_breach("d0");
        let old = iadeep_proto::CapBreach {
            device_id: "d0".into(),
            task_id: "p1".into(),
            ..Default::default()
        };
        typed::put(store.as_ref(), &key, &old, None)
            .await
            .expect("put");
        let other = keys::device_breach("d1");
        typed::put(store.as_ref(), &other, &old, None)
            .await
            .expect("put");
        let mut driver = driver(&store);
        driver.info.memory_mib = 16_384;
        driver
            .tuner(DeviceTunerParams::default())
            .await
            .expect("tuner");
        assert_eq!(store.get(&key).await.expect("read"), None);
        assert!(
            store.get(&other).await.expect("read").is_some(),
            "another device's record stays"
        );
    }

    /// Writing sample `seq` deletes sample `seq - samples_kept`: the device's samples
    /// stay at the newest `samples_kept`, however long the tuner runs.
    #[tokio::test]
    async fn only_the_newest_samples_are_kept() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let mut driver = driver(&store);
        let actions = (0..10)
            .map(|seq| Action::Sample {
                seq,
                sample: CoLocationSample {
                    device_id: "d0".into(),
                    ..Default::default()
                },
            })
            .collect();
        driver.execute(actions, &DecidedOn::default()).await;
        let kept: Vec<String> = store
            .range(&keys::device_samples_prefix("d0"))
            .await
            .expect("range")
            .kvs
            .into_iter()
            .map(|kv| kv.key)
            .collect();
        let newest: Vec<String> = (7..10).map(|seq| keys::sample("d0", seq)).collect();
        assert_eq!(kept, newest);
    }
}
