//! Place, release and list over a live store: the policy plus the reservation
//! protocol, shared by the gRPC service and the Kubernetes extender.
//!
//! A placement is decided on the in-memory view, then made real by one store
//! transaction that compares the chosen device's residents record with the
//! revision the decision was based on and, iff it still matches, writes the new
//! record, the task's placement and its spec: one durable commit per decision,
//! and never a reservation without its placement. If another placement got
//! there first the comparison fails, nothing is written, and the transaction
//! returns the record as it is now; the view takes it and the task is decided
//! again, at most `max_reserve_attempts` times. Because every admission goes
//! through that comparison, no interleaving of requests (in this process or in
//! another placer) can admit more than the record said fits. A Release is
//! likewise one transaction: the record without the task (or its deletion)
//! and the placement's deletion.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use iadeep_proto::{
    DeviceInfo, DeviceResidents, DeviceStatus, Explanation, Placement, QueueDecision, Reservation,
    TaskSpec, place_response,
};
use iadeep_state::{Expect, StateStore, Txn, TxnOutcome, keys, typed};
use prost::Message;

use crate::error::{PlacerError, Result};
use crate::metrics::PlacerMetrics;
use crate::policy::{Decision, Placer, Verdict};
use crate::validate;
use crate::view::ClusterView;

/// The outcome of a Place, as both front ends report it.
#[derive(Clone, Debug, PartialEq)]
pub struct PlaceOutcome {
    pub decision: place_response::Decision,
    pub explanation: Explanation,
}

/// The placement service: policy, view and store.
#[derive(Debug, Clone)]
pub struct PlacementService {
    store: Arc<dyn StateStore>,
    view: Arc<RwLock<ClusterView>>,
    placer: Arc<Placer>,
    metrics: Arc<PlacerMetrics>,
}

impl PlacementService {
    /// A service deciding with `placer` on `view`, reserving in `store`.
    pub fn new(
        store: Arc<dyn StateStore>,
        view: Arc<RwLock<ClusterView>>,
        placer: Arc<Placer>,
        metrics: Arc<PlacerMetrics>,
    ) -> PlacementService {
        PlacementService {
            store,
            view,
            placer,
            metrics,
        }
    }

    /// The metrics this service counts into.
    pub fn metrics(&self) -> &Arc<PlacerMetrics> {
        &self.metrics
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

    fn view_mut(&self) -> RwLockWriteGuard<'_, ClusterView> {
        self.view.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Decides where `task` goes and, when placed, reserves the device before returning.
    ///
    /// Placing a task that already holds a reservation answers that reservation again
    /// (a client retrying after a lost answer must not get a second device).
    pub async fn place(&self, task: TaskSpec, restrict: Vec<String>) -> Result<PlaceOutcome> {
        let started = Instant::now();
        let result = self.place_inner(task, restrict).await;
        self.metrics.place_latency.observe(started.elapsed());
        match &result {
            Ok(PlaceOutcome {
                decision: place_response::Decision::Placed(_),
                ..
            }) => self.metrics.placed.inc(),
            Ok(_) => self.metrics.queued.inc(),
            Err(PlacerError::InvalidArgument { .. }) => self.metrics.invalid.inc(),
            Err(_) => self.metrics.failed.inc(),
        }
        result
    }

    async fn place_inner(&self, task: TaskSpec, restrict: Vec<String>) -> Result<PlaceOutcome> {
        validate::task_spec("task", &task)?;
        validate::device_ids("candidate_device_ids", &restrict)?;
        let attempts = self.placer.params().max_reserve_attempts;
        for attempt in 1..=attempts {
            // Decide and build the new record under one read lock, so the expected
            // revision is the one the decision saw.
            let (explanation, plan) = {
                let view = self.view();
                if let Some(device_id) = view.device_of(&task.task_id) {
                    return Ok(self.existing(&view, &task.task_id, device_id));
                }
                let started = Instant::now();
                let Decision {
                    verdict,
                    explanation,
                } = self
                    .placer
                    .decide(&view, &task, &restrict, iadeep_proto::now_unix_ms());
                self.metrics.decision_latency.observe(started.elapsed());
                let plan = match verdict {
                    Verdict::Place {
                        device_id,
                        reserved_mem_mib,
                    } => {
                        let device = view.device(&device_id);
                        let mut record = device
                            .map(|d| d.residents_record(&device_id))
                            .unwrap_or_else(|| DeviceResidents {
                                device_id: device_id.clone(),
                                reservations: Vec::new(),
                            });
                        let reservation = Reservation {
                            task_id: task.task_id.clone(),
                            reserved_mem_mib,
                            placed_at_unix_ms: iadeep_proto::now_unix_ms(),
                            spec: Some(task.clone()),
                        };
                        record.reservations.push(reservation.clone());
                        let expect = match device.and_then(|d| d.residents_revision) {
                            Some(rev) => Expect::ModRevision(rev),
                            None => Expect::Absent,
                        };
                        Ok((device_id, record, reservation, expect))
                    }
                    Verdict::Queue {
                        retry_after,
                        reason,
                    } => Err((retry_after, reason)),
                };
                (explanation, plan)
            };
            let (device_id, record, reservation, expect) = match plan {
                Ok(reserve) => reserve,
                Err((retry_after, reason)) => {
                    self.note_queued(&task, retry_after);
                    tracing::debug!(task = %task.task_id, retry_after_s = retry_after.as_secs(), %reason, "queued");
                    return Ok(PlaceOutcome {
                        decision: place_response::Decision::Queued(QueueDecision {
                            retry_after_ms: u64::try_from(retry_after.as_millis())
                                .unwrap_or(u64::MAX),
                            reason,
                        }),
                        explanation,
                    });
                }
            };
            let key = keys::device_residents(&device_id);
            let placement = Placement {
                task_id: task.task_id.clone(),
                device_id: device_id.clone(),
                reserved_mem_mib: reservation.reserved_mem_mib,
                placed_at_unix_ms: reservation.placed_at_unix_ms,
            };
            // The reservation, the placement and the spec in one durable commit:
            // all three or none, at the cost of one.
            let txn = Txn::new()
                .compare(key.as_str(), expect)
                .put(key.as_str(), record.encode_to_vec(), None)
                .put(
                    keys::task_placement(&task.task_id),
                    placement.encode_to_vec(),
                    None,
                )
                .put(keys::task_spec(&task.task_id), task.encode_to_vec(), None);
            match self.store.transact(txn).await? {
                TxnOutcome::Committed { revision } => {
                    {
                        let mut view = self.view_mut();
                        view.apply_residents(&device_id, Some(record), revision);
                        view.forget_waiting(&task.task_id);
                    }
                    tracing::info!(task = %task.task_id, device = %device_id,
                        reserved_mib = placement.reserved_mem_mib, attempt,
                        summary = %explanation.summary, "placed");
                    return Ok(PlaceOutcome {
                        decision: place_response::Decision::Placed(placement),
                        explanation,
                    });
                }
                TxnOutcome::Failed { mut current } => {
                    self.metrics.cas_conflicts.inc();
                    tracing::debug!(task = %task.task_id, device = %device_id, attempt,
                        "device changed since the decision; deciding again");
                    // The only comparison is the residents record's.
                    self.absorb(&device_id, expect, current.pop().flatten());
                }
            }
        }
        Err(PlacerError::Contention {
            task_id: task.task_id,
            attempts,
        })
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
    pub fn note_queued(&self, task: &TaskSpec, retry_after: std::time::Duration) {
        let now = iadeep_proto::now_unix_ms();
        let hold_ms = i64::try_from(retry_after.as_millis().saturating_mul(2)).unwrap_or(i64::MAX);
        self.view_mut()
            .note_waiting(task, now, now.saturating_add(hold_ms));
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
                    self.metrics.decode_errors.inc();
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

    fn existing(&self, view: &ClusterView, task_id: &str, device_id: &str) -> PlaceOutcome {
        let reservation = view
            .device(device_id)
            .and_then(|d| {
                d.residents
                    .iter()
                    .find(|r| r.reservation.task_id == task_id)
            })
            .map(|r| r.reservation.clone())
            .unwrap_or_default();
        PlaceOutcome {
            decision: place_response::Decision::Placed(Placement {
                task_id: task_id.to_owned(),
                device_id: device_id.to_owned(),
                reserved_mem_mib: reservation.reserved_mem_mib,
                placed_at_unix_ms: reservation.placed_at_unix_ms,
            }),
            explanation: Explanation {
                summary: format!("task {task_id} is already placed on {device_id}"),
                candidates: Vec::new(),
            },
        }
    }

    /// Gives `task_id`'s reservation back. Returns the device it held, or `None` when it
    /// held none (releasing twice is not an error).
    ///
    /// The reservation's removal and the placement's deletion are one transaction.
    /// Since Place writes both in one transaction too, the view's device for the task
    /// is normally all that is needed, so the usual Release costs that one commit and
    /// no read; the placement is read from the store only when the view does not hold
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
                self.store.delete(&placement_key).await?;
            }
        }
        // A task withdrawn while it waited no longer holds the others back.
        self.view_mut().forget_waiting(task_id);
        if had_placement {
            self.metrics.released.inc();
            tracing::debug!(task = %task_id, device = ?released, "released");
        }
        Ok(released)
    }

    /// Removes one task from a device's residents record and deletes `placement_key`
    /// in the same transaction; true when the task was there.
    ///
    /// The first attempt starts from the view's copy of the record (no read from the
    /// store); a lost comparison returns the record as it is now, which the next
    /// attempt uses. The store is read only when the view does not list the task
    /// there (another placer may have placed it and this view not caught up yet).
    async fn remove_reservation(
        &self,
        device_id: &str,
        task_id: &str,
        placement_key: &str,
    ) -> Result<bool> {
        validate::device_ids("device_id", std::slice::from_ref(&device_id.to_owned()))?;
        let key = keys::device_residents(device_id);
        let attempts = self.placer.params().max_reserve_attempts;
        let mut known: Option<(DeviceResidents, i64)> = {
            let view = self.view();
            view.device(device_id).and_then(|d| {
                let holds = d.residents.iter().any(|r| r.reservation.task_id == task_id);
                d.residents_revision
                    .filter(|_| holds)
                    .map(|rev| (d.residents_record(device_id), rev))
            })
        };
        for _ in 0..attempts {
            let (mut record, mod_revision) = match known.take() {
                Some(known) => known,
                None => match typed::get::<DeviceResidents>(self.store.as_ref(), &key).await? {
                    Some((record, kv)) => (record, kv.mod_revision),
                    None => return Ok(false),
                },
            };
            let before = record.reservations.len();
            record.reservations.retain(|r| r.task_id != task_id);
            if record.reservations.len() == before {
                return Ok(false);
            }
            let txn = Txn::new().compare(key.as_str(), Expect::ModRevision(mod_revision));
            let txn = if record.reservations.is_empty() {
                txn.delete(key.as_str())
            } else {
                txn.put(key.as_str(), record.encode_to_vec(), None)
            }
            .delete(placement_key);
            match self.store.transact(txn).await? {
                TxnOutcome::Committed { revision } => {
                    let record = (!record.reservations.is_empty()).then_some(record);
                    self.view_mut().apply_residents(device_id, record, revision);
                    return Ok(true);
                }
                TxnOutcome::Failed { mut current } => {
                    self.metrics.cas_conflicts.inc();
                    match current.pop().flatten() {
                        Some(kv) => {
                            known = Some((typed::decode::<DeviceResidents>(&kv)?, kv.mod_revision))
                        }
                        None => return Ok(false),
                    }
                }
            }
        }
        Err(PlacerError::Contention {
            task_id: task_id.to_owned(),
            attempts,
        })
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
            .dead_residents(iadeep_proto::now_unix_ms(), grace_ms);
        let mut released = Vec::new();
        for task in dead {
            // Re-checked, so an agent that restarted in the meantime keeps its device.
            if self.view().agent_alive(&task.task_id) {
                tracing::debug!(task = %task.task_id, "agent came back; keeps its reservation");
                continue;
            }
            match self.release(&task.task_id).await {
                Ok(Some(device)) => {
                    self.metrics.dead_released.inc();
                    let gone_s =
                        (iadeep_proto::now_unix_ms() - task.gone_since_unix_ms).max(0) / 1000;
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

    /// Releases every resident task whose agent never appeared (no `alive` key, no
    /// report) and that was placed at least `grace` ago, see
    /// [`ClusterView::unstarted_residents`]. Returns the tasks released. A task whose
    /// agent appeared between the check and the release is skipped; one that fails to
    /// release is logged and retried on the next call.
    pub async fn release_unstarted(&self, grace: std::time::Duration) -> Vec<String> {
        let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        let unstarted = self
            .view()
            .unstarted_residents(iadeep_proto::now_unix_ms(), grace_ms);
        let mut released = Vec::new();
        for task in unstarted {
            if self.view().agent_alive(&task.task_id) {
                tracing::debug!(task = %task.task_id, "agent appeared; keeps its reservation");
                continue;
            }
            match self.release(&task.task_id).await {
                Ok(Some(device)) => {
                    self.metrics.unstarted_released.inc();
                    let waited_s =
                        (iadeep_proto::now_unix_ms() - task.placed_at_unix_ms).max(0) / 1000;
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
