//! What the store says about the device's tasks, kept current by watches.
//!
//! Two folds, each over a [`Follow`] of its prefix (a range followed by a watch from the
//! snapshot's revision + 1: no gap, no duplicate), published through `tokio::sync::watch`
//! channels:
//! - [`TaskTable`] over `keys::TASKS`: every task's spec, placement, `alive` key, latest
//!   report and assignment;
//! - [`ResidentsRecord`]: the device's `residents` key, the placer's reservations. It says
//!   which tasks hold memory on the device, and its mod-revision is what the tuner's
//!   assignment transaction compares: a placement decided meanwhile changes it, so a round
//!   decided without the newcomer is never written.
//!
//! A reserved task *runs* when its `alive` key exists and its latest report does not say
//! `finished`; a reserved task that does not run still holds its memory.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use iadeep_proto::{BatchSizeAssignment, DeviceResidents, Placement, TaskReport, TaskSpec};
use iadeep_state::keys::KeyKind;
use iadeep_state::{Backoff, Follow, Followed, KeyValue, Revision, StateStore, WatchEvent, typed};
use tokio::sync::watch;

/// What the store says about one task.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskEntry {
    pub spec: Option<TaskSpec>,
    pub placement: Option<Placement>,
    pub alive: bool,
    pub report: Option<TaskReport>,
    pub assignment: Option<BatchSizeAssignment>,
    /// The assignment key's mod-revision: what the tuner's round compares it with.
    pub assignment_revision: Option<Revision>,
}

impl TaskEntry {
    /// The task's agent holds its lease and has not reported finishing.
    pub fn running(&self) -> bool {
        self.alive && !self.report.as_ref().is_some_and(|r| r.finished)
    }
}

/// Every task under `keys::TASKS`, as of `revision`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskTable {
    pub tasks: BTreeMap<String, TaskEntry>,
    /// Store revision of the last event folded in.
    pub revision: i64,
}

impl Fold for TaskTable {
    const WHAT: &'static str = "tasks";

    /// Folds one stored key in. Values that do not decode are logged and ignored: one bad
    /// writer must not stop the tuner of every other task on the device.
    fn apply_put(&mut self, kv: &KeyValue) {
        match KeyKind::parse(&kv.key) {
            KeyKind::TaskSpec { task } => {
                if let Some(spec) = decode::<TaskSpec>(kv) {
                    self.tasks.entry(task).or_default().spec = Some(spec);
                }
            }
            KeyKind::TaskPlacement { task } => {
                if let Some(p) = decode::<Placement>(kv) {
                    self.tasks.entry(task).or_default().placement = Some(p);
                }
            }
            KeyKind::TaskAlive { task } => self.tasks.entry(task).or_default().alive = true,
            KeyKind::TaskReport { task } => {
                if let Some(r) = decode::<TaskReport>(kv) {
                    self.tasks.entry(task).or_default().report = Some(r);
                }
            }
            KeyKind::TaskAssignment { task } => {
                let entry = self.tasks.entry(task).or_default();
                entry.assignment_revision = Some(kv.mod_revision);
                if let Some(a) = decode::<BatchSizeAssignment>(kv) {
                    entry.assignment = Some(a);
                }
            }
            _ => {}
        }
        self.revision = self.revision.max(kv.mod_revision);
    }

    fn apply_delete(&mut self, key: &str, revision: i64) {
        let kind = KeyKind::parse(key);
        let task = match &kind {
            KeyKind::TaskSpec { task }
            | KeyKind::TaskPlacement { task }
            | KeyKind::TaskAlive { task }
            | KeyKind::TaskReport { task }
            | KeyKind::TaskAssignment { task } => task.clone(),
            _ => return,
        };
        if let Some(entry) = self.tasks.get_mut(&task) {
            match kind {
                KeyKind::TaskSpec { .. } => entry.spec = None,
                KeyKind::TaskPlacement { .. } => entry.placement = None,
                KeyKind::TaskAlive { .. } => entry.alive = false,
                KeyKind::TaskReport { .. } => entry.report = None,
                _ => {
                    entry.assignment = None;
                    entry.assignment_revision = None;
                }
            }
            if entry == &TaskEntry::default() {
                self.tasks.remove(&task);
            }
        }
        self.revision = self.revision.max(revision);
    }

    fn set_revision(&mut self, revision: Revision) {
        self.revision = revision;
    }
}

/// The device's reservations as the placer wrote them, and the key's mod-revision
/// (`None` when there is no record).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ResidentsRecord {
    pub record: Option<DeviceResidents>,
    pub mod_revision: Option<Revision>,
    /// The record's key exists but does not decode: nothing may be assumed about the
    /// device's memory until the placer rewrites it.
    pub undecodable: bool,
}

impl Fold for ResidentsRecord {
    const WHAT: &'static str = "residents record";

    fn apply_put(&mut self, kv: &KeyValue) {
        if !matches!(KeyKind::parse(&kv.key), KeyKind::DeviceResidents { .. }) {
            return;
        }
        self.mod_revision = Some(kv.mod_revision);
        self.record = decode::<DeviceResidents>(kv);
        self.undecodable = self.record.is_none();
    }

    fn apply_delete(&mut self, key: &str, _revision: i64) {
        if matches!(KeyKind::parse(key), KeyKind::DeviceResidents { .. }) {
            *self = ResidentsRecord::default();
        }
    }

    fn set_revision(&mut self, _revision: Revision) {}
}

/// A value kept current from the puts and deletes under one prefix.
pub trait Fold: Default + Clone + Send + Sync + 'static {
    /// What it follows, for logs.
    const WHAT: &'static str;
    fn apply_put(&mut self, kv: &KeyValue);
    fn apply_delete(&mut self, key: &str, revision: Revision);
    /// The revision of the snapshot it was built from.
    fn set_revision(&mut self, revision: Revision);
}

fn decode<M: prost::Message + Default>(kv: &KeyValue) -> Option<M> {
    match typed::decode::<M>(kv) {
        Ok(m) => Some(m),
        Err(err) => {
            tracing::warn!(%err, "ignoring a task value that does not decode");
            None
        }
    }
}

/// Keeps a [`Fold`] of everything under `prefix` current in the background until every
/// receiver is dropped.
///
/// Store errors (a broken watch, a compacted revision, an unreachable store) are logged by
/// the [`Follow`] and followed by a fresh range-then-watch after a back-off (100 ms,
/// doubling to 5 s): the value is then rebuilt from the snapshot, so nothing is lost, and
/// readers keep the last value meanwhile.
pub fn spawn_watcher<F: Fold>(
    store: Arc<dyn StateStore>,
    prefix: String,
) -> (watch::Receiver<F>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(F::default());
    let backoff = Backoff::doubling(Duration::from_millis(100), Duration::from_secs(5));
    let follow = Follow::new(store, prefix, backoff);
    let handle = tokio::spawn(fold(follow, tx));
    (rx, handle)
}

/// Publishes the fold of what `follow` yields through `tx` until every receiver is gone.
async fn fold<F: Fold>(mut follow: Follow, tx: watch::Sender<F>) {
    loop {
        tokio::select! {
            item = follow.next() => match item {
                Followed::Snapshot(snapshot) => {
                    let mut value = F::default();
                    for kv in &snapshot.kvs {
                        value.apply_put(kv);
                    }
                    value.set_revision(snapshot.revision);
                    tracing::debug!(
                        what = F::WHAT,
                        keys = snapshot.kvs.len(),
                        revision = snapshot.revision,
                        "snapshot read"
                    );
                    tx.send_replace(value);
                }
                Followed::Change(WatchEvent::Put(kv)) => {
                    tx.send_modify(|t| t.apply_put(&kv));
                }
                Followed::Change(WatchEvent::Delete { key, revision }) => {
                    tx.send_modify(|t| t.apply_delete(&key, revision));
                }
            },
            () = tx.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_state::keys;

    fn kv(key: String, value: Vec<u8>, rev: i64) -> KeyValue {
        KeyValue::created_at(key, value, rev)
    }

    #[test]
    fn a_task_runs_while_alive_and_not_finished_and_its_keys_fold_in() {
        use prost::Message;
        let mut t = TaskTable::default();
        let spec = TaskSpec {
            task_id: "a".into(),
            ..Default::default()
        };
        t.apply_put(&kv(keys::task_spec("a"), spec.encode_to_vec(), 1));
        assert!(!t.tasks["a"].running(), "not alive yet");
        t.apply_put(&kv(keys::task_alive("a"), b"pid 1".to_vec(), 3));
        assert!(t.tasks["a"].running());
        let assignment = BatchSizeAssignment {
            task_id: "a".into(),
            batch_size: 64,
            round: 7,
            ..Default::default()
        };
        t.apply_put(&kv(
            keys::task_assignment("a"),
            assignment.encode_to_vec(),
            4,
        ));
        assert_eq!(t.tasks["a"].assignment.as_ref().map(|a| a.round), Some(7));
        let finished = TaskReport {
            finished: true,
            ..Default::default()
        };
        t.apply_put(&kv(keys::task_report("a"), finished.encode_to_vec(), 5));
        assert!(!t.tasks["a"].running(), "finished");
        t.apply_put(&kv(
            keys::task_report("a"),
            TaskReport::default().encode_to_vec(),
            6,
        ));
        assert!(t.tasks["a"].running());
        t.apply_delete(&keys::task_alive("a"), 7);
        assert!(!t.tasks["a"].running(), "lease gone");
        assert_eq!(t.revision, 7);
    }

    #[test]
    fn the_residents_record_keeps_its_revision_and_says_when_it_does_not_decode() {
        use prost::Message;
        let mut r = ResidentsRecord::default();
        let record = DeviceResidents {
            device_id: "gpu0".into(),
            reservations: Vec::new(),
            ..Default::default()
        };
        r.apply_put(&kv(
            keys::device_residents("gpu0"),
            record.encode_to_vec(),
            9,
        ));
        assert_eq!(r.mod_revision, Some(9));
        assert!(r.record.is_some() && !r.undecodable);
        r.apply_put(&kv(keys::device_residents("gpu0"), vec![0xff, 0xff], 10));
        assert!(r.record.is_none() && r.undecodable);
        r.apply_delete(&keys::device_residents("gpu0"), 11);
        assert_eq!(r, ResidentsRecord::default());
    }

    #[test]
    fn undecodable_values_are_ignored() {
        let mut t = TaskTable::default();
        t.apply_put(&kv(keys::task_spec("a"), vec![0xff, 0xff, 0xff], 1));
        assert!(t.tasks.get("a").is_none_or(|e| e.spec.is_none()));
    }
}
