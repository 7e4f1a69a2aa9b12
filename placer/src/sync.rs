//! Keeps a [`ClusterView`] fresh from the store: range, then watch from the
//! snapshot's revision + 1, so no change between the two is missed (the state crate's
//! [`Follow`], one per prefix).
//!
//! Four prefixes are followed, each by its own task: devices (registrations,
//! residents records and the tuners' CapBreach records), tasks (reports, assignments
//! and the agents' `alive` keys), co-location samples (fed to the slowdown model so
//! the predictor learns from what the tuners measure) and the AvoidPairings the
//! evictions wrote (see [`crate::eviction`]). A watch
//! that ends (history compacted, store gone) is logged and replaced by a fresh range
//! and watch after a short pause (`RESYNC_PAUSE`); a value that does not decode is
//! logged and skipped, never fatal.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use iadeep_proto::{
    AvoidPairing, BatchSizeAssignment, CapBreach, CoLocationSample, DeviceInfo, DeviceResidents,
    TaskReport,
};
use iadeep_state::keys::{self, KeyKind};
use iadeep_state::{
    Follow, Followed, KeyValue, RangeSnapshot, Revision, StateStore, WatchEvent, typed,
};
use tokio::task::JoinHandle;

use crate::error::Result;
use crate::events::{PlacementEvent, PlacementEvents};
use crate::view::ClusterView;
use iadeep_predictor::SlowdownModel;

/// Pause before re-reading a prefix whose watch ended.
const RESYNC_PAUSE: Duration = Duration::from_millis(500);

/// The background tasks following the store; dropping it stops them.
#[derive(Debug)]
pub struct ViewSync {
    tasks: Vec<JoinHandle<()>>,
}

impl ViewSync {
    /// Stops the tasks and waits until they are gone, so that none of them meets the store
    /// going away after its owner stopped (a watch that breaks then warns it reconnects).
    pub async fn stop(mut self) {
        let tasks = std::mem::take(&mut self.tasks);
        for task in &tasks {
            task.abort();
        }
        for task in tasks {
            let _ = task.await;
        }
    }
}

impl Drop for ViewSync {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Prefix {
    Devices,
    Tasks,
    Samples,
    Avoid,
}

impl Prefix {
    fn key(self) -> &'static str {
        match self {
            Prefix::Devices => keys::DEVICES,
            Prefix::Tasks => keys::TASKS,
            Prefix::Samples => keys::SAMPLES,
            Prefix::Avoid => keys::AVOID,
        }
    }
}

#[derive(Clone, Debug)]
struct Ctx {
    store: Arc<dyn StateStore>,
    view: Arc<RwLock<ClusterView>>,
    model: Arc<dyn SlowdownModel>,
    events: Arc<dyn PlacementEvents>,
}

impl ViewSync {
    /// Loads the current state into `view` (returning once it is loaded, so the first
    /// decision already sees the cluster) and starts following changes.
    pub async fn start(
        store: Arc<dyn StateStore>,
        view: Arc<RwLock<ClusterView>>,
        model: Arc<dyn SlowdownModel>,
        events: Arc<dyn PlacementEvents>,
    ) -> Result<ViewSync> {
        let ctx = Ctx {
            store,
            view,
            model,
            events,
        };
        let mut tasks = Vec::new();
        for prefix in [
            Prefix::Devices,
            Prefix::Tasks,
            Prefix::Samples,
            Prefix::Avoid,
        ] {
            let snapshot = ctx.store.range(prefix.key()).await?;
            let revision = ctx.load(prefix, snapshot, 0);
            let follow =
                Follow::after(Arc::clone(&ctx.store), prefix.key(), revision, RESYNC_PAUSE);
            let ctx = ctx.clone();
            tasks.push(tokio::spawn(async move {
                ctx.follow(prefix, follow, revision).await
            }));
        }
        let view = ctx.view.read().unwrap_or_else(|e| e.into_inner());
        tracing::info!(
            devices = view.len(),
            residents = view.resident_count(),
            store = %ctx.store.describe(),
            "placer view loaded; following changes"
        );
        Ok(ViewSync { tasks })
    }
}

/// Drops from `view` what a devices snapshot (at `revision`) no longer holds: the
/// breaches, residents records and devices whose keys went while the watch was down,
/// which no watch event will report.
fn drop_gone_devices(view: &mut ClusterView, snapshot: &RangeSnapshot, revision: Revision) {
    let mut registered = HashSet::new();
    let mut with_residents = HashSet::new();
    let mut breached = HashSet::new();
    for kv in &snapshot.kvs {
        match KeyKind::parse(&kv.key) {
            KeyKind::DeviceInfo { device } => {
                registered.insert(device);
            }
            KeyKind::DeviceResidents { device } => {
                with_residents.insert(device);
            }
            KeyKind::DeviceBreach { device } => {
                breached.insert(device);
            }
            _ => {}
        }
    }
    // Breaches that ended (or were acted on) while the watch was down.
    let ended: Vec<String> = view
        .breaches()
        .filter(|(id, _, _)| !breached.contains(*id))
        .map(|(id, _, _)| id.to_owned())
        .collect();
    for id in ended {
        view.remove_breach(&id, revision);
    }
    let known: Vec<String> = view.devices().map(|(id, _)| id.to_owned()).collect();
    for id in known {
        if !with_residents.contains(&id) {
            view.apply_residents(&id, None, revision);
        }
        if !registered.contains(&id) {
            view.remove_device(&id);
        }
    }
}

/// The tasks of `held` (what the view holds of one kind of task key) whose key, as
/// `pick` finds it in a key's kind, is not in `snapshot`: deleted while the watch was
/// down.
fn missing_from<'a>(
    snapshot: &RangeSnapshot,
    held: impl Iterator<Item = &'a str>,
    pick: impl Fn(KeyKind) -> Option<String>,
) -> Vec<String> {
    let present: HashSet<String> = snapshot
        .kvs
        .iter()
        .filter_map(|kv| pick(KeyKind::parse(&kv.key)))
        .collect();
    held.filter(|t| !present.contains(*t))
        .map(str::to_owned)
        .collect()
}

impl Ctx {
    /// Puts a snapshot of `prefix` whole into the view, dropping what the view holds
    /// that is gone, and returns its revision. Samples written at or before `seen` were
    /// already learnt from and are skipped.
    fn load(&self, prefix: Prefix, snapshot: RangeSnapshot, seen: Revision) -> Revision {
        let revision = snapshot.revision;
        let mut view = self.view.write().unwrap_or_else(|e| e.into_inner());
        match prefix {
            Prefix::Devices => drop_gone_devices(&mut view, &snapshot, revision),
            Prefix::Tasks => {
                // Agents whose alive key went while the watch was down.
                let gone = missing_from(&snapshot, view.alive_tasks(), |kind| match kind {
                    KeyKind::TaskAlive { task } => Some(task),
                    _ => None,
                });
                let now = iadeep_proto::now_unix_ms();
                for task in gone {
                    view.set_not_alive(&task, now);
                }
                // Reports deleted while the watch was down (archived, swept).
                let deleted = missing_from(&snapshot, view.reported_tasks(), |kind| match kind {
                    KeyKind::TaskReport { task } => Some(task),
                    _ => None,
                });
                for task in deleted {
                    view.remove_report(&task);
                }
            }
            Prefix::Samples => {}
            Prefix::Avoid => {
                let present: HashSet<(String, String)> = snapshot
                    .kvs
                    .iter()
                    .filter_map(|kv| match KeyKind::parse(&kv.key) {
                        KeyKind::AvoidPairing {
                            production,
                            evicted,
                        } => Some((production, evicted)),
                        _ => None,
                    })
                    .collect();
                let gone: Vec<(String, String)> = view
                    .avoid_pairings()
                    .map(|(p, _)| (p.production_task_id.clone(), p.evicted_task_id.clone()))
                    .filter(|pair| !present.contains(pair))
                    .collect();
                for (production, evicted) in gone {
                    view.remove_avoid(&production, &evicted, revision);
                }
            }
        }
        for kv in snapshot.kvs {
            if prefix == Prefix::Samples && kv.mod_revision <= seen {
                continue;
            }
            self.apply_put(&mut view, kv);
        }
        revision
    }

    /// Folds what `follow` yields into the view, forever; `seen` is the revision of the
    /// last snapshot or change applied.
    async fn follow(self, prefix: Prefix, mut follow: Follow, mut seen: Revision) {
        loop {
            match follow.next().await {
                Followed::Snapshot(snapshot) => seen = self.load(prefix, snapshot, seen),
                Followed::Change(event) => {
                    seen = event.revision();
                    self.apply(event);
                }
            }
        }
    }

    fn apply(&self, event: WatchEvent) {
        let key = match &event {
            WatchEvent::Put(kv) => kv.key.as_str(),
            WatchEvent::Delete { key, .. } => key.as_str(),
        };
        // Only what decisions read takes the view's write lock: every writer waits for
        // the decisions in flight and holds back the ones arriving, so the keys each
        // Place and Release write that the view ignores (placements, specs) and the
        // samples (they go to the model) must not queue behind them.
        match KeyKind::parse(key) {
            // Our own reservations and assignments reach the view from the transaction
            // that wrote them; their echo from the watch (the same write: same key, same
            // revision) needs neither the write lock nor decoding.
            KeyKind::DeviceResidents { device } => {
                let view = self.view.read().unwrap_or_else(|e| e.into_inner());
                if view.holds_residents_at(&device, &event) {
                    return;
                }
            }
            KeyKind::TaskAssignment { task } => {
                let view = self.view.read().unwrap_or_else(|e| e.into_inner());
                if let WatchEvent::Put(kv) = &event
                    && view.assignment_revision(&task) == Some(kv.mod_revision)
                {
                    return;
                }
            }
            KeyKind::DeviceInfo { .. }
            | KeyKind::DeviceBreach { .. }
            | KeyKind::AvoidPairing { .. }
            | KeyKind::TaskReport { .. }
            | KeyKind::TaskAlive { .. } => {}
            KeyKind::Sample { .. } => {
                if let WatchEvent::Put(kv) = event {
                    self.learn(&kv);
                }
                return;
            }
            _ => return,
        }
        let mut view = self.view.write().unwrap_or_else(|e| e.into_inner());
        match event {
            WatchEvent::Put(kv) => self.apply_put(&mut view, kv),
            WatchEvent::Delete { key, revision } => match KeyKind::parse(&key) {
                KeyKind::DeviceInfo { device } => view.remove_device(&device),
                KeyKind::DeviceResidents { device } => {
                    view.apply_residents(&device, None, revision);
                }
                KeyKind::DeviceBreach { device } => view.remove_breach(&device, revision),
                KeyKind::AvoidPairing {
                    production,
                    evicted,
                } => view.remove_avoid(&production, &evicted, revision),
                KeyKind::TaskReport { task } => view.remove_report(&task),
                KeyKind::TaskAssignment { task } => view.remove_assignment(&task),
                KeyKind::TaskAlive { task } => {
                    tracing::debug!(%task, "task's agent is gone (alive key deleted)");
                    view.set_not_alive(&task, iadeep_proto::now_unix_ms());
                }
                _ => {}
            },
        }
    }

    fn apply_put(&self, view: &mut ClusterView, kv: KeyValue) {
        let result = match KeyKind::parse(&kv.key) {
            KeyKind::DeviceInfo { device } => typed::decode::<DeviceInfo>(&kv).map(|mut info| {
                // The key is authoritative: a record naming another device is a copy-paste slip.
                info.device_id = device;
                view.upsert_device(info);
            }),
            KeyKind::DeviceResidents { device } => {
                typed::decode::<DeviceResidents>(&kv).map(|record| {
                    view.apply_residents(&device, Some(record), kv.mod_revision);
                })
            }
            KeyKind::DeviceBreach { device } => {
                typed::decode::<CapBreach>(&kv).map(|mut breach| {
                    breach.device_id = device.clone();
                    view.set_breach(&device, breach, kv.mod_revision);
                })
            }
            // The key is authoritative, as for the other records.
            KeyKind::AvoidPairing {
                production,
                evicted,
            } => typed::decode::<AvoidPairing>(&kv).map(|mut pairing| {
                pairing.production_task_id = production;
                pairing.evicted_task_id = evicted;
                view.set_avoid(pairing, kv.mod_revision);
            }),
            KeyKind::TaskReport { task } => typed::decode::<TaskReport>(&kv).map(|mut report| {
                report.task_id = task;
                view.set_report(report);
            }),
            KeyKind::TaskAssignment { task } => {
                typed::decode::<BatchSizeAssignment>(&kv).map(|mut assignment| {
                    assignment.task_id = task;
                    view.set_assignment(assignment, kv.mod_revision);
                })
            }
            // The value is the agent's own note; only the key's existence matters.
            KeyKind::TaskAlive { task } => {
                view.set_alive(&task);
                Ok(())
            }
            KeyKind::Sample { .. } => {
                self.learn(&kv);
                Ok(())
            }
            _ => Ok(()),
        };
        if let Err(err) = result {
            self.events.record(PlacementEvent::DecodeError);
            tracing::warn!(%err, "skipping a stored value that does not decode");
        }
    }

    /// Feeds a co-location sample to the slowdown model (no view lock needed).
    fn learn(&self, kv: &KeyValue) {
        match typed::decode::<CoLocationSample>(kv) {
            Ok(sample) => {
                self.model.observe(&sample);
                self.events.record(PlacementEvent::SampleObserved);
            }
            Err(err) => {
                self.events.record(PlacementEvent::DecodeError);
                tracing::warn!(%err, "skipping a stored value that does not decode");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_predictor::{LearnerParams, OnlinePredictor};
    use iadeep_proto::Reservation;
    use prost::Message;

    fn ctx() -> Ctx {
        Ctx {
            store: Arc::new(iadeep_state::EmbeddedStore::in_memory().expect("in-memory store")),
            view: Arc::new(RwLock::new(ClusterView::new(Arc::new(
                crate::model::ModelledMemory,
            )))),
            model: Arc::new(OnlinePredictor::new(LearnerParams::default()).expect("predictor")),
            events: Arc::new(crate::events::NoEvents),
        }
    }

    fn record(task: &str) -> DeviceResidents {
        DeviceResidents {
            reservations: vec![Reservation {
                task_id: task.into(),
                reserved_mem_mib: 1000,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn assignment(task: &str, batch_size: u32) -> BatchSizeAssignment {
        BatchSizeAssignment {
            task_id: task.into(),
            batch_size,
            ..Default::default()
        }
    }

    fn put(key: String, value: Vec<u8>, revision: Revision) -> WatchEvent {
        WatchEvent::Put(KeyValue::created_at(key, value, revision))
    }

    /// A reload of the tasks after the watch was down (its history compacted) drops the
    /// reports deleted meanwhile, as it drops the `alive` keys: a report the store no
    /// longer holds would otherwise say forever that the task's agent ran.
    #[test]
    fn a_reload_drops_the_reports_deleted_while_the_watch_was_down() {
        let ctx = ctx();
        let report = |task: &str| iadeep_proto::TaskReport {
            task_id: task.into(),
            ..Default::default()
        };
        for task in ["kept", "archived"] {
            ctx.apply(put(
                keys::task_report(task),
                report(task).encode_to_vec(),
                3,
            ));
        }
        let snapshot = RangeSnapshot {
            kvs: vec![KeyValue::created_at(
                keys::task_report("kept"),
                report("kept").encode_to_vec(),
                3,
            )],
            revision: 9,
        };
        ctx.load(Prefix::Tasks, snapshot, 3);
        let view = ctx.view.read().expect("view");
        let mut left: Vec<&str> = view.reported_tasks().collect();
        left.sort_unstable();
        assert_eq!(left, ["kept"]);
    }

    /// The watch's echo of the placer's own commit (same key, same revision: the same
    /// write) is not applied again, so two of the events each Place and Release cause
    /// take neither the view's write lock nor a decode. The echoes here carry other
    /// values than the view holds at that revision (a real echo carries the same ones)
    /// to tell skipping from re-applying; a later revision is applied as before.
    #[test]
    fn an_echo_of_a_revision_the_view_holds_is_not_applied_again() {
        let ctx = ctx();
        {
            let mut view = ctx.view.write().expect("view");
            view.upsert_device(DeviceInfo {
                device_id: "d".into(),
                ..Default::default()
            });
            view.apply_residents("d", Some(record("a")), 7);
            view.set_assignment(assignment("a", 8), 7);
        }
        let residents_key = keys::device_residents("d");
        let assignment_key = keys::task_assignment("a");
        ctx.apply(put(residents_key.clone(), record("b").encode_to_vec(), 7));
        ctx.apply(put(
            assignment_key.clone(),
            assignment("a", 16).encode_to_vec(),
            7,
        ));
        {
            let view = ctx.view.read().expect("view");
            assert_eq!(view.device_of("a"), Some("d"));
            assert_eq!(view.device_of("b"), None);
            let resident = &view.device("d").expect("device").residents[0];
            assert_eq!(resident.batch_size(), 8);
        }
        ctx.apply(put(assignment_key, assignment("a", 16).encode_to_vec(), 8));
        ctx.apply(put(residents_key.clone(), record("b").encode_to_vec(), 9));
        {
            let view = ctx.view.read().expect("view");
            assert_eq!(view.assignment_revision("a"), Some(8));
            assert_eq!(view.device_of("b"), Some("d"));
        }
        // A deletion is held when the view dropped the record at that very revision.
        ctx.view
            .write()
            .expect("view")
            .apply_residents("d", None, 10);
        let deleted = |revision| WatchEvent::Delete {
            key: residents_key.clone(),
            revision,
        };
        let view = ctx.view.read().expect("view");
        assert!(view.holds_residents_at("d", &deleted(10)));
        assert!(!view.holds_residents_at("d", &deleted(11)));
        assert!(!view.holds_residents_at("e", &deleted(10)));
    }
}
