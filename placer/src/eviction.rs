//! Acts on cap breaches: evicts the opportunistic job the measurements blame most.
//!
//! A device's tuner writes a [`CapBreach`] at `devices/{device}/breach` when a
//! production job stayed measured above its slowdown cap for several rounds with every
//! opportunistic co-runner already at its smallest batch size. The view follows those
//! records ([`ClusterView::breaches`]); every [`PERIOD`] the daemon's eviction loop
//! ([`spawn`]) hands each one to [`act_on_breach`], which:
//!
//! 1. chooses the victim with [`choose_victim`] (the pure choice the simulator shares,
//!    see [`crate::policy::evict`]);
//! 2. makes the eviction real in **one transaction** that compares the device's
//!    residents record, the breach record and the victim's assignment with the
//!    revisions the choice was made on, and writes the victim's assignment (its last one,
//!    batch size and learning rate unchanged, with `evict` set, a reason naming the
//!    production job with its measured PD and cap, and a round above every round the
//!    device's residents have seen, so its agent applies it), writes the
//!    [`AvoidPairing`] of the two jobs (until now + [`PlacerParams::avoid_pairing_for`])
//!    and deletes the breach record.
//!
//! The victim's reservation is *not* touched: its memory stays counted until its
//! `iadeep run` releases it after the job exits (or the reaper does, when its agent's
//! lease ends), so no placement can over-pack the device while the evicted job is
//! still checkpointing.
//!
//! **Idempotence.** A breach record is acted on once: the transaction deletes it, and
//! compares it, so a second placer (or a second pass) that chose on the same record
//! loses its comparison and finds it gone. A lost comparison puts what the store holds
//! now into the view and decides again. A transaction the store re-sent after its answer
//! was lost (see `iadeep_state`'s failover) finds the victim's assignment exactly as it
//! sent it, and counts as done. A breach whose production job or co-runners left is
//! deleted without eviction (stale), and so is one written while a job on the device is
//! still leaving after an eviction (its assignment says evict): the victim is not
//! evicted twice, and nobody else is evicted before the tuner has measured the device
//! without it (it writes a new breach then, if the job stays above its cap).
//!
//! Expired avoid records are deleted by the retention sweep ([`crate::retention`]);
//! placement ignores them from their expiry on ([`ClusterView::avoids`]).

use std::time::Duration;

use iadeep_proto::{AvoidPairing, BatchSizeAssignment, CapBreach, DeviceResidents};
use iadeep_state::{Expect, KeyValue, Revision, Txn, TxnOutcome, keys, typed};
use prost::Message;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::error::Result;
use crate::events::{EvictionTrigger, PlacementEvent};
use crate::params::PlacerParams;
use crate::policy::evict::{Victim, choose_victim};
use crate::service::{PlacementService, evict_assignment};
use crate::view::ClusterView;

/// How often the daemon's eviction loop looks for breaches: a pass without one reads
/// the view only. A second is nothing next to the rounds a breach takes to be measured.
pub const PERIOD: Duration = Duration::from_secs(1);

/// One eviction made.
#[derive(Clone, Debug, PartialEq)]
pub struct Eviction {
    pub device_id: String,
    /// The production job above its cap.
    pub production_task_id: String,
    pub victim: Victim,
    /// The victim's assignment as written (evict set).
    pub assignment: BatchSizeAssignment,
    /// The avoid record as written.
    pub avoid: AvoidPairing,
}

/// What [`act_on_breach`] did with one device's breach.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// The victim was told to leave.
    Evicted(Box<Eviction>),
    /// The breach record was deleted without an eviction, for this reason.
    Dropped(String),
    /// No breach record (any more): another placer, or an earlier pass, acted on it,
    /// or the tuner withdrew it.
    Gone,
    /// The device kept changing under every attempt
    /// ([`PlacerParams::max_reserve_attempts`]); the next pass tries again.
    Deferred,
}

/// What the transaction for a breach writes, decided on the view.
enum Plan {
    Evict(Box<Evicting>),
    Drop(String),
}

/// An eviction to write: the victim, its evict assignment with what its key held, and
/// the avoid record.
#[derive(Clone)]
struct Evicting {
    victim: Victim,
    assignment: BatchSizeAssignment,
    assignment_expect: Expect,
    avoid: AvoidPairing,
    /// The device's residents record as the view holds it, written again unchanged.
    residents_record: DeviceResidents,
}

/// The decision on `device_id`'s breach, with the revisions it was made on: the
/// breach's and the residents record's.
struct Decided {
    breach: CapBreach,
    breach_revision: Revision,
    residents_expect: Expect,
    plan: Plan,
}

/// Decides what to do with `device_id`'s breach on `view`; `None` when there is none.
fn decide(
    view: &ClusterView,
    device_id: &str,
    model: &dyn iadeep_predictor::SlowdownModel,
    params: &PlacerParams,
    by: &str,
    now_unix_ms: i64,
) -> Option<Decided> {
    let (breach, breach_revision) = view.breach(device_id)?;
    let breach = breach.clone();
    let device = view.device(device_id);
    let residents_expect = match device.and_then(|d| d.residents_revision) {
        Some(rev) => Expect::ModRevision(rev),
        None => Expect::Absent,
    };
    let leaving = device.and_then(|d| {
        d.residents
            .iter()
            .find(|r| r.reservation.task_id != breach.task_id && r.leaving())
    });
    let plan = if let Some(leaving) = leaving {
        Plan::Drop(format!(
            "{} on the device is still leaving after an eviction; the tuner measures again without it",
            leaving.reservation.task_id
        ))
    } else {
        match choose_victim(view, device_id, &breach, model) {
            None => Plan::Drop(format!(
                "stale: production job {} or every co-runner it names ({:?}) left the device",
                breach.task_id, breach.opportunistic_task_ids
            )),
            Some(victim) => match device
                .and_then(|d| evict_assignment(d, &victim.task_id, &victim.reason, by, now_unix_ms))
            {
                None => Plan::Drop(format!("stale: {} left the device", victim.task_id)),
                Some((assignment, assignment_expect)) => {
                    let for_ms =
                        i64::try_from(params.avoid_pairing_for.as_millis()).unwrap_or(i64::MAX);
                    let avoid = AvoidPairing {
                        production_task_id: breach.task_id.clone(),
                        evicted_task_id: victim.task_id.clone(),
                        until_unix_ms: now_unix_ms.saturating_add(for_ms),
                        reason: victim.reason.clone(),
                    };
                    Plan::Evict(Box::new(Evicting {
                        victim,
                        assignment,
                        assignment_expect,
                        avoid,
                        residents_record: device
                            .map(|d| d.residents_record(device_id))
                            .unwrap_or_default(),
                    }))
                }
            },
        }
    };
    Some(Decided {
        breach,
        breach_revision,
        residents_expect,
        plan,
    })
}

/// The transaction of a decision (see the module docs). The compares come in this
/// order, which a failed outcome's current values follow: residents record, breach,
/// then (an eviction's) the victim's assignment.
fn txn(device_id: &str, decided: &Decided) -> Txn {
    let breach_key = keys::device_breach(device_id);
    let txn = Txn::new()
        .compare(keys::device_residents(device_id), decided.residents_expect)
        .compare(
            breach_key.as_str(),
            Expect::ModRevision(decided.breach_revision),
        );
    match &decided.plan {
        Plan::Evict(evicting) => {
            let Evicting {
                assignment,
                assignment_expect,
                avoid,
                residents_record,
                ..
            } = evicting.as_ref();
            txn.compare(
                keys::task_assignment(&assignment.task_id),
                *assignment_expect,
            )
            // The record written again, unchanged: a tuner round decided before the
            // eviction compares it, so it cannot commit afterwards and write the victim
            // an assignment without `evict`.
            .put(
                keys::device_residents(device_id),
                residents_record.encode_to_vec(),
                None,
            )
            .put(
                keys::task_assignment(&assignment.task_id),
                assignment.encode_to_vec(),
                None,
            )
            .put(
                keys::avoid_pairing(&avoid.production_task_id, &avoid.evicted_task_id),
                avoid.encode_to_vec(),
                None,
            )
            .delete(breach_key)
        }
        Plan::Drop(_) => txn.delete(breach_key),
    }
}

/// Acts on `device_id`'s breach record as the view holds it (see the module docs), at
/// most [`PlacerParams::max_reserve_attempts`] times when comparisons are lost.
pub async fn act_on_breach(service: &PlacementService, device_id: &str) -> Result<Outcome> {
    let params = service.placer().params().clone();
    let model = service.placer().slowdown_model().clone();
    for _ in 0..params.max_reserve_attempts {
        let now = service.now_unix_ms();
        let Some(decided) = decide(
            &service.view(),
            device_id,
            model.as_ref(),
            &params,
            service.instance(),
            now,
        ) else {
            return Ok(Outcome::Gone);
        };
        let sent = txn(device_id, &decided);
        match service.store().transact(sent).await? {
            TxnOutcome::Committed { revision } => {
                return Ok(committed(service, device_id, decided, revision));
            }
            TxnOutcome::Failed { current } => {
                service.record(PlacementEvent::CasConflict);
                if let Some(outcome) = absorb(service, device_id, &decided, current)? {
                    return Ok(outcome);
                }
            }
        }
    }
    tracing::debug!(device = %device_id, attempts = params.max_reserve_attempts,
        "the device kept changing while acting on its cap breach; next pass");
    Ok(Outcome::Deferred)
}

/// Puts a committed decision into the view, counts and logs it.
fn committed(
    service: &PlacementService,
    device_id: &str,
    decided: Decided,
    revision: Revision,
) -> Outcome {
    let Decided { breach, plan, .. } = decided;
    let mut view = service.view_mut();
    view.remove_breach(device_id, revision);
    match plan {
        Plan::Drop(reason) => {
            drop(view);
            tracing::info!(device = %device_id, production = %breach.task_id, %reason,
                "cap breach deleted without an eviction");
            Outcome::Dropped(reason)
        }
        Plan::Evict(evicting) => {
            let Evicting {
                victim,
                assignment,
                avoid,
                ..
            } = *evicting;
            view.set_assignment(assignment.clone(), revision);
            view.set_avoid(avoid.clone(), revision);
            let now = service.now_unix_ms();
            let avoided = view.avoided_pairings(now);
            drop(view);
            service.record(PlacementEvent::Evicted(EvictionTrigger::Cap));
            service.record(PlacementEvent::AvoidedPairings(avoided));
            tracing::warn!(device = %device_id, production = %breach.task_id,
                victim = %victim.task_id, measured_pd = breach.measured_pd,
                max_slowdown = breach.max_slowdown, blame = victim.blame,
                round = assignment.round, avoid_until_unix_ms = avoid.until_unix_ms,
                reason = %victim.reason, by = %assignment.evicted_by,
                "evicting an opportunistic job for a production job's slowdown cap");
            Outcome::Evicted(Box::new(Eviction {
                device_id: device_id.to_owned(),
                production_task_id: breach.task_id,
                victim,
                assignment,
                avoid,
            }))
        }
    }
}

/// Puts what a lost transaction found into the view: the residents record, the breach
/// record and (an eviction's) the victim's assignment. When that assignment is exactly
/// the one this decision sent, an earlier attempt of the same transaction committed
/// (the store re-sent it after losing its answer): that eviction is the outcome.
/// `None`: decide again.
fn absorb(
    service: &PlacementService,
    device_id: &str,
    decided: &Decided,
    current: Vec<Option<KeyValue>>,
) -> Result<Option<Outcome>> {
    let mut current = current.into_iter();
    let residents = current.next().flatten();
    let breach = current.next().flatten();
    let assignment = current.next().flatten();
    let mut view = service.view_mut();
    match residents {
        Some(kv) => {
            let record = typed::decode::<DeviceResidents>(&kv)?;
            view.apply_residents(device_id, Some(record), kv.mod_revision);
        }
        None => {
            // Deleted after the revision expected: any later write is newer still.
            let after = match decided.residents_expect {
                Expect::ModRevision(rev) => rev + 1,
                Expect::Absent => 0,
            };
            view.apply_residents(device_id, None, after);
        }
    }
    match breach {
        Some(kv) => {
            let mut breach = typed::decode::<CapBreach>(&kv)?;
            breach.device_id = device_id.to_owned();
            view.set_breach(device_id, breach, kv.mod_revision);
        }
        None => view.remove_breach(device_id, decided.breach_revision + 1),
    }
    if let Plan::Evict(evicting) = &decided.plan {
        let Evicting {
            assignment: sent,
            avoid,
            victim,
            ..
        } = evicting.as_ref();
        match assignment {
            Some(kv) if kv.value == sent.encode_to_vec() => {
                view.set_assignment(sent.clone(), kv.mod_revision);
                view.set_avoid(avoid.clone(), kv.mod_revision);
                view.remove_breach(device_id, kv.mod_revision);
                drop(view);
                tracing::info!(device = %device_id, victim = %victim.task_id,
                    "an earlier attempt of this eviction committed (its answer was lost)");
                let decided = Decided {
                    breach: decided.breach.clone(),
                    breach_revision: decided.breach_revision,
                    residents_expect: decided.residents_expect,
                    plan: Plan::Evict(evicting.clone()),
                };
                return Ok(Some(committed(
                    service,
                    device_id,
                    decided,
                    kv.mod_revision,
                )));
            }
            Some(kv) => {
                let mut a = typed::decode::<BatchSizeAssignment>(&kv)?;
                a.task_id = sent.task_id.clone();
                view.set_assignment(a, kv.mod_revision);
            }
            None => view.remove_assignment(&sent.task_id),
        }
    }
    Ok(None)
}

/// Acts on every breach record the view holds, one device at a time; a device whose
/// breach cannot be acted on now (store errors, contention) is logged and tried again
/// on the next pass. Returns what was done, by device, and counts the avoid records in
/// force for the `iadeep_placer_avoided_pairings` gauge.
pub async fn evict_on_breaches(service: &PlacementService) -> Vec<(String, Outcome)> {
    let devices: Vec<String> = service
        .view()
        .breaches()
        .map(|(id, _, _)| id.to_owned())
        .collect();
    let mut done = Vec::with_capacity(devices.len());
    for device_id in devices {
        match act_on_breach(service, &device_id).await {
            Ok(outcome) => done.push((device_id, outcome)),
            Err(err) => tracing::warn!(device = %device_id, %err,
                "cannot act on the device's cap breach; retrying on the next pass"),
        }
    }
    let avoided = service.view().avoided_pairings(service.now_unix_ms());
    service.record(PlacementEvent::AvoidedPairings(avoided));
    done
}

/// Runs [`evict_on_breaches`] every [`PERIOD`] until `stop` turns true (or its sender
/// is dropped).
pub fn spawn(service: PlacementService, stop: watch::Receiver<bool>) -> JoinHandle<Result<()>> {
    tokio::spawn(async move {
        let mut every = crate::every::Every::new(PERIOD, stop);
        while every.next().await {
            evict_on_breaches(&service).await;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicI64, Ordering};
    use std::sync::{Arc, RwLock};

    use iadeep_predictor::{Prediction, PredictionSource, SlowdownModel};
    use iadeep_proto::{
        DeviceInfo, PriorityClass, Reservation, SoloProfile, TaskProfile, TaskSpec,
    };
    use iadeep_state::{EmbeddedStore, StateStore};

    use super::*;
    use crate::events::Recorded;
    use crate::model::ModelledMemory;
    use crate::policy::Placer;
    use crate::service::Clock;
    use crate::sync::ViewSync;
    use iadeep_state::testing::{Fault, FaultStore, Op};

    const T0: i64 = 1_700_000_000_000;

    /// Co-runners each add a fixed slowdown by model name: what the online model's
    /// per-job effects come to once it has measured the jobs.
    #[derive(Debug)]
    struct Additive;

    impl SlowdownModel for Additive {
        fn predict(&self, _: &str, _: &TaskProfile, corunners: &[TaskProfile]) -> Prediction {
            let extra: f64 = corunners
                .iter()
                .map(|p| match p.model.as_str() {
                    "heavy" => 0.30,
                    "medium" => 0.10,
                    _ => 0.02,
                })
                .sum();
            Prediction::certain(1.0 + extra, PredictionSource::Given)
        }
    }

    fn spec(id: &str, model: &str, production: bool) -> TaskSpec {
        TaskSpec {
            task_id: id.into(),
            model: model.into(),
            initial_batch_size: 32,
            min_batch_size: 8,
            max_batch_size: 64,
            priority_class: if production {
                PriorityClass::Production as i32
            } else {
                PriorityClass::Opportunistic as i32
            },
            max_slowdown: production.then_some(1.1),
            profile: Some(SoloProfile {
                batch_size: 32,
                step_time_s: Some(0.1),
                peak_mem_mib: Some(2_000),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// `d0` with a production job `prod` and opportunistic `a` (light), `b` (heavy, the
    /// tuner shrank it to 8 in round 4) and `c` (medium), and the tuner's breach naming
    /// `a`, `b` and `c`.
    async fn seed(store: &dyn StateStore) {
        typed::put(
            store,
            &keys::device_info("d0"),
            &DeviceInfo {
                device_id: "d0".into(),
                memory_mib: 32_000,
                kind: "v100".into(),
                ..Default::default()
            },
            None,
        )
        .await
        .expect("device");
        let residents = DeviceResidents {
            device_id: "d0".into(),
            reservations: [
                ("prod", "resnet", true),
                ("a", "light", false),
                ("b", "heavy", false),
                ("c", "medium", false),
            ]
            .into_iter()
            .map(|(id, model, production)| Reservation {
                task_id: id.into(),
                reserved_mem_mib: 2_000,
                spec: Some(spec(id, model, production)),
                ..Default::default()
            })
            .collect(),
            ..Default::default()
        };
        typed::put(store, &keys::device_residents("d0"), &residents, None)
            .await
            .expect("residents");
        let shrunk = BatchSizeAssignment {
            task_id: "b".into(),
            batch_size: 8,
            lr_factor: 0.25,
            round: 4,
            memory_bound_mib: Some(900.0),
            ..Default::default()
        };
        typed::put(store, &keys::task_assignment("b"), &shrunk, None)
            .await
            .expect("assignment");
        put_breach(store, &["a", "b", "c"]).await;
    }

    async fn put_breach(store: &dyn StateStore, candidates: &[&str]) -> Revision {
        let breach = CapBreach {
            device_id: "d0".into(),
            task_id: "prod".into(),
            measured_pd: 1.42,
            max_slowdown: 1.1,
            rounds_above: 3,
            opportunistic_task_ids: candidates.iter().map(|&c| c.to_owned()).collect(),
            round: 7,
            at_unix_ms: T0,
        };
        typed::put(store, &keys::device_breach("d0"), &breach, None)
            .await
            .expect("breach")
    }

    /// One placer process over `store`: its view loaded (and followed) from the store,
    /// blaming with [`Additive`], at virtual time `now`, counting into `events`.
    struct Placer1 {
        service: PlacementService,
        events: Arc<Recorded>,
        now: Arc<AtomicI64>,
        _sync: ViewSync,
    }

    async fn placer_over(store: Arc<dyn StateStore>) -> Placer1 {
        let view = Arc::new(RwLock::new(ClusterView::new(Arc::new(ModelledMemory))));
        let model: Arc<dyn SlowdownModel> = Arc::new(Additive);
        let events = Arc::new(Recorded::default());
        let sync = ViewSync::start(store.clone(), view.clone(), model.clone(), events.clone())
            .await
            .expect("view sync");
        let placer = Placer::new(PlacerParams::default(), model).expect("params");
        let now = Arc::new(AtomicI64::new(T0));
        let clock = {
            let now = now.clone();
            Clock::from_fn(move || now.load(Ordering::SeqCst))
        };
        let service = PlacementService::new(store, view, Arc::new(placer))
            .with_clock(clock)
            .with_events(events.clone());
        Placer1 {
            service,
            events,
            now,
            _sync: sync,
        }
    }

    fn evictions(events: &Recorded) -> usize {
        events.count(PlacementEvent::Evicted(EvictionTrigger::Cap))
    }

    async fn assignment(
        store: &dyn StateStore,
        task: &str,
    ) -> Option<(BatchSizeAssignment, KeyValue)> {
        typed::get::<BatchSizeAssignment>(store, &keys::task_assignment(task))
            .await
            .expect("read assignment")
    }

    async fn avoid_records(store: &dyn StateStore) -> Vec<(AvoidPairing, KeyValue)> {
        typed::list::<AvoidPairing>(store, keys::AVOID, |_| true)
            .await
            .expect("avoid records")
            .0
    }

    /// The breach evicts the co-runner the model blames most (`b`, not the first listed
    /// nor the last), and its assignment, the avoid record and the breach's deletion are
    /// one commit; the victim's reservation stays until it is released.
    #[tokio::test]
    async fn a_breach_evicts_the_most_blamed_co_runner_in_one_commit() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        seed(store.as_ref()).await;
        let one = placer_over(store.clone()).await;
        let residents_before = store
            .get(&keys::device_residents("d0"))
            .await
            .expect("read")
            .expect("residents");

        let done = evict_on_breaches(&one.service).await;
        let [(device, Outcome::Evicted(eviction))] = done.as_slice() else {
            panic!("one eviction expected: {done:?}");
        };
        assert_eq!(device, "d0");
        assert_eq!(eviction.victim.task_id, "b");
        assert_eq!(evictions(&one.events), 1);

        let (written, kv) = assignment(store.as_ref(), "b")
            .await
            .expect("b's assignment");
        assert!(written.evict);
        assert_eq!(
            (written.batch_size, written.lr_factor),
            (8, 0.25),
            "sizes kept"
        );
        assert_eq!(written.round, 5, "above every round the device has seen");
        for part in ["prod", "1.420", "1.10"] {
            assert!(
                written.evict_reason.contains(part),
                "{part}: {}",
                written.evict_reason
            );
        }
        let avoids = avoid_records(store.as_ref()).await;
        let [(avoid, avoid_kv)] = avoids.as_slice() else {
            panic!("one avoid record expected: {avoids:?}");
        };
        assert_eq!(
            (
                avoid.production_task_id.as_str(),
                avoid.evicted_task_id.as_str()
            ),
            ("prod", "b")
        );
        assert_eq!(avoid.until_unix_ms, T0 + 30 * 60 * 1000);
        assert!(
            store
                .get(&keys::device_breach("d0"))
                .await
                .expect("read")
                .is_none()
        );
        // One commit: the assignment and the avoid record share its revision, and it is
        // the store's last.
        let revision = store.range(keys::DEVICES).await.expect("range").revision;
        assert_eq!(kv.mod_revision, avoid_kv.mod_revision);
        assert_eq!(kv.mod_revision, revision);
        // The victim still holds its memory: the residents record is written again
        // unchanged in the same commit (so a tuner round decided before it, which
        // compares the record, cannot write the victim an assignment without `evict`);
        // nobody else was touched.
        let residents_after = store
            .get(&keys::device_residents("d0"))
            .await
            .expect("read")
            .expect("residents");
        assert_eq!(residents_after.value, residents_before.value);
        assert_eq!(residents_after.mod_revision, kv.mod_revision);
        for other in ["prod", "a", "c"] {
            assert!(assignment(store.as_ref(), other).await.is_none(), "{other}");
        }
        let view = one.service.view();
        assert!(view.avoids("b", "prod", T0 + 1));
        assert!(view.breach("d0").is_none());
        assert_eq!(view.device_of("b"), Some("d0"));
    }

    /// A breach whose production job or listed co-runners left evicts nobody, and is
    /// deleted.
    #[tokio::test]
    async fn a_stale_breach_is_deleted_without_an_eviction() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        seed(store.as_ref()).await;
        // Only a co-runner that has left is named (a, b and c are not).
        put_breach(store.as_ref(), &["gone"]).await;
        let one = placer_over(store.clone()).await;
        let b_before = assignment(store.as_ref(), "b").await.expect("b").1;

        let done = evict_on_breaches(&one.service).await;
        assert!(
            matches!(done.as_slice(), [(_, Outcome::Dropped(reason))] if reason.contains("stale")),
            "{done:?}"
        );
        assert!(
            store
                .get(&keys::device_breach("d0"))
                .await
                .expect("read")
                .is_none()
        );
        assert_eq!(evictions(&one.events), 0);
        assert!(avoid_records(store.as_ref()).await.is_empty());
        assert_eq!(
            assignment(store.as_ref(), "b").await.expect("b").1,
            b_before
        );
        for other in ["a", "c"] {
            assert!(assignment(store.as_ref(), other).await.is_none(), "{other}");
        }
    }

    /// A re-sent transaction (its first attempt committed, its answer lost) is one
    /// eviction, reported as done, not a breach that vanished.
    #[tokio::test]
    async fn an_eviction_whose_first_attempt_committed_counts_once() {
        let resending = Arc::new(FaultStore::in_memory());
        let store: Arc<dyn StateStore> = resending.clone();
        seed(store.as_ref()).await;
        let one = placer_over(store.clone()).await;
        resending.inject_until_cleared(Op::Transact, Fault::Resend);

        let outcome = act_on_breach(&one.service, "d0").await.expect("act");
        let Outcome::Evicted(eviction) = outcome else {
            panic!("the eviction committed: {outcome:?}");
        };
        assert_eq!(eviction.victim.task_id, "b");
        assert_eq!(evictions(&one.events), 1);
        let (written, kv) = assignment(store.as_ref(), "b").await.expect("b");
        assert!(written.evict);
        assert_eq!(kv.version, 2, "the seed's write and the eviction's, once");
        assert_eq!(avoid_records(store.as_ref()).await.len(), 1);
        // Acting again finds nothing to do.
        assert_eq!(
            act_on_breach(&one.service, "d0").await.expect("act"),
            Outcome::Gone
        );
        assert_eq!(evictions(&one.events), 1);
    }

    /// A breach the tuner writes again while the victim is still leaving evicts nobody:
    /// neither the victim a second time nor the next co-runner before the device was
    /// measured without it.
    #[tokio::test]
    async fn a_job_still_leaving_is_not_evicted_twice() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        seed(store.as_ref()).await;
        let one = placer_over(store.clone()).await;
        let first = act_on_breach(&one.service, "d0").await.expect("act");
        assert!(matches!(first, Outcome::Evicted(_)), "{first:?}");
        let evicted_at = assignment(store.as_ref(), "b").await.expect("b").1;

        let rev = put_breach(store.as_ref(), &["a", "b", "c"]).await;
        one.service.view_mut().set_breach(
            "d0",
            CapBreach {
                device_id: "d0".into(),
                task_id: "prod".into(),
                opportunistic_task_ids: vec!["a".into(), "b".into(), "c".into()],
                ..Default::default()
            },
            rev,
        );
        one.now.fetch_add(60_000, Ordering::SeqCst);
        let again = act_on_breach(&one.service, "d0").await.expect("act");
        assert!(
            matches!(&again, Outcome::Dropped(reason) if reason.contains("still leaving")),
            "{again:?}"
        );
        assert_eq!(
            assignment(store.as_ref(), "b").await.expect("b").1,
            evicted_at
        );
        for other in ["a", "c"] {
            assert!(assignment(store.as_ref(), other).await.is_none(), "{other}");
        }
        assert_eq!(evictions(&one.events), 1);
        assert!(
            store
                .get(&keys::device_breach("d0"))
                .await
                .expect("read")
                .is_none()
        );
    }

    /// Two placers acting on the same breach at once, each on its own view: one evicts,
    /// the other loses its comparison and finds the breach gone.
    #[tokio::test]
    async fn two_placers_racing_on_a_breach_evict_once() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        seed(store.as_ref()).await;
        let one = placer_over(store.clone()).await;
        let two = placer_over(store.clone()).await;
        // Later by a millisecond: the two would write different bytes.
        two.now.fetch_add(1, Ordering::SeqCst);
        let (first, second) = tokio::join!(
            act_on_breach(&one.service, "d0"),
            act_on_breach(&two.service, "d0")
        );
        let outcomes = [first.expect("one"), second.expect("two")];
        let evicted = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Evicted(_)))
            .count();
        assert_eq!(evicted, 1, "{outcomes:?}");
        assert!(outcomes.contains(&Outcome::Gone), "{outcomes:?}");
        assert_eq!(evictions(&one.events) + evictions(&two.events), 1);
        let (_, kv) = assignment(store.as_ref(), "b").await.expect("b");
        assert_eq!(kv.version, 2, "the seed's write and one eviction");
        let avoids = avoid_records(store.as_ref()).await;
        assert_eq!(avoids.len(), 1);
        assert_eq!(avoids[0].1.version, 1, "written once");
    }

    /// The daemon's loop acts on a breach at its first tick, and stops when told.
    #[tokio::test]
    async fn the_eviction_loop_acts_on_breaches_and_stops() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        seed(store.as_ref()).await;
        let one = placer_over(store.clone()).await;
        let (stop, stopped) = watch::channel(false);
        let evictor = spawn(one.service.clone(), stopped);
        let mut polls = 0;
        while store
            .get(&keys::device_breach("d0"))
            .await
            .expect("read")
            .is_some()
        {
            polls += 1;
            assert!(polls < 1_000, "the loop did not act on the breach");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.send(true).expect("loop listening");
        evictor
            .await
            .expect("loop task")
            .expect("loop ends cleanly");
        assert_eq!(evictions(&one.events), 1);
        assert!(assignment(store.as_ref(), "b").await.expect("b").0.evict);
    }

    /// The view follows breach and avoid records through the store's watch, and a
    /// pass counts the avoid records in force.
    #[tokio::test]
    async fn the_view_follows_breaches_and_avoid_records() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        seed(store.as_ref()).await;
        let pairing = AvoidPairing {
            production_task_id: "p".into(),
            evicted_task_id: "e".into(),
            until_unix_ms: T0 + 1_000,
            reason: String::new(),
        };
        typed::put(
            store.as_ref(),
            &keys::avoid_pairing("p", "e"),
            &pairing,
            None,
        )
        .await
        .expect("avoid");
        let one = placer_over(store.clone()).await;
        {
            let view = one.service.view();
            assert!(view.breach("d0").is_some(), "loaded");
            assert!(view.avoids("e", "p", T0));
            assert!(!view.avoids("e", "p", T0 + 1_000), "expired");
        }
        store
            .delete(&keys::device_breach("d0"))
            .await
            .expect("delete");
        store
            .delete(&keys::avoid_pairing("p", "e"))
            .await
            .expect("delete");
        let mut polls = 0;
        while {
            let view = one.service.view();
            view.breach("d0").is_some() || view.avoids("e", "p", T0)
        } {
            polls += 1;
            assert!(polls < 1_000, "the watch did not deliver the deletions");
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        typed::put(
            store.as_ref(),
            &keys::avoid_pairing("p", "e"),
            &pairing,
            None,
        )
        .await
        .expect("avoid");
        let mut polls = 0;
        while !one.service.view().avoids("p", "e", T0) {
            polls += 1;
            assert!(polls < 1_000, "the watch did not deliver the put");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        evict_on_breaches(&one.service).await;
        assert_eq!(
            one.events.count(PlacementEvent::AvoidedPairings(1)),
            1,
            "the gauge counts the record in force"
        );
    }
}
