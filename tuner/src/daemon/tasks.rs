//! Task discovery: which tasks run on this device, and what they last reported.
//!
//! One range over `keys::TASKS` followed by a watch from the snapshot's revision + 1 (no
//! gap, no duplicate), folded into a [`TaskTable`] published through a
//! `tokio::sync::watch` channel, so the closed loop both reads the residents and waits for
//! fresh reports on the same, ordered view of the store. A task is resident when its
//! `Placement.device_id` is this device, its spec is known, its `alive` key exists and its
//! latest report does not say `finished`; it leaves when the alive key is deleted (the
//! agent's lease ended) or it reports finished.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use iadeep_proto::{Placement, TaskReport, TaskSpec};
use iadeep_state::keys::{self, KeyKind};
use iadeep_state::{KeyValue, StateStore, WatchEvent, typed};
use tokio::sync::watch;

/// What the store says about one task.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskEntry {
    pub spec: Option<TaskSpec>,
    pub placement: Option<Placement>,
    pub alive: bool,
    pub report: Option<TaskReport>,
}

/// Every task under `keys::TASKS`, as of `revision`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TaskTable {
    pub tasks: BTreeMap<String, TaskEntry>,
    /// Store revision of the last event folded in.
    pub revision: i64,
}

impl TaskTable {
    /// Ids of the tasks resident on `device`, sorted (the order of the search space).
    pub fn residents(&self, device: &str) -> Vec<String> {
        self.tasks
            .iter()
            .filter(|(_, e)| {
                e.alive
                    && e.spec.is_some()
                    && e.placement.as_ref().is_some_and(|p| p.device_id == device)
                    && !e.report.as_ref().is_some_and(|r| r.finished)
            })
            .map(|(id, _)| id.clone())
            .collect()
    }

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
            _ => {}
        }
        self.revision = self.revision.max(kv.mod_revision);
    }

    fn apply_delete(&mut self, key: &str, revision: i64) {
        let (task, kind) = match KeyKind::parse(key) {
            KeyKind::TaskSpec { task } => (task, 0),
            KeyKind::TaskPlacement { task } => (task, 1),
            KeyKind::TaskAlive { task } => (task, 2),
            KeyKind::TaskReport { task } => (task, 3),
            _ => return,
        };
        if let Some(entry) = self.tasks.get_mut(&task) {
            match kind {
                0 => entry.spec = None,
                1 => entry.placement = None,
                2 => entry.alive = false,
                _ => entry.report = None,
            }
            if entry == &TaskEntry::default() {
                self.tasks.remove(&task);
            }
        }
        self.revision = self.revision.max(revision);
    }
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

/// Keeps a [`TaskTable`] current in the background until the receiver side is dropped.
///
/// Store errors (a broken watch, a compacted revision, an unreachable store) are logged and
/// followed by a fresh range-then-watch after a back-off: the table is then rebuilt from the
/// snapshot, so nothing is lost, and readers keep the last table meanwhile.
pub fn spawn_watcher(
    store: Arc<dyn StateStore>,
) -> (watch::Receiver<TaskTable>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = watch::channel(TaskTable::default());
    let handle = tokio::spawn(async move {
        let mut backoff = Duration::from_millis(100);
        loop {
            match follow(store.as_ref(), &tx).await {
                Ok(()) => return, // every receiver is gone
                Err(err) => {
                    tracing::warn!(%err, retry_in = ?backoff, "task watch failed; re-reading the tasks");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    });
    (rx, handle)
}

async fn follow(
    store: &dyn StateStore,
    tx: &watch::Sender<TaskTable>,
) -> Result<(), iadeep_state::StateError> {
    let snapshot = store.range(keys::TASKS).await?;
    let mut table = TaskTable::default();
    for kv in &snapshot.kvs {
        table.apply_put(kv);
    }
    table.revision = snapshot.revision;
    tracing::debug!(
        tasks = table.tasks.len(),
        revision = table.revision,
        "task snapshot read"
    );
    tx.send_replace(table);
    let mut events = store
        .watch(keys::TASKS, Some(snapshot.revision + 1))
        .await?;
    loop {
        tokio::select! {
            event = events.next() => match event {
                Some(Ok(WatchEvent::Put(kv))) => {
                    tx.send_modify(|t| t.apply_put(&kv));
                }
                Some(Ok(WatchEvent::Delete { key, revision })) => {
                    tx.send_modify(|t| t.apply_delete(&key, revision));
                }
                Some(Err(err)) => return Err(err),
                None => {
                    return Err(iadeep_state::StateError::Backend {
                        op: "watch tasks",
                        target: keys::TASKS.to_owned(),
                        reason: "the store closed the watch".to_owned(),
                    });
                }
            },
            () = tx.closed() => return Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: String, value: Vec<u8>, rev: i64) -> KeyValue {
        KeyValue {
            key,
            value,
            create_revision: rev,
            mod_revision: rev,
            version: 1,
            lease: None,
        }
    }

    #[test]
    fn residents_need_placement_here_spec_and_alive_and_leave_when_finished_or_dead() {
        use prost::Message;
        let mut t = TaskTable::default();
        let spec = TaskSpec {
            task_id: "a".into(),
            ..Default::default()
        };
        let here = Placement {
            task_id: "a".into(),
            device_id: "gpu0".into(),
            ..Default::default()
        };
        t.apply_put(&kv(keys::task_spec("a"), spec.encode_to_vec(), 1));
        t.apply_put(&kv(keys::task_placement("a"), here.encode_to_vec(), 2));
        assert!(t.residents("gpu0").is_empty(), "not alive yet");
        t.apply_put(&kv(keys::task_alive("a"), b"pid 1".to_vec(), 3));
        assert_eq!(t.residents("gpu0"), vec!["a".to_owned()]);
        assert!(t.residents("gpu1").is_empty());
        let finished = TaskReport {
            finished: true,
            ..Default::default()
        };
        t.apply_put(&kv(keys::task_report("a"), finished.encode_to_vec(), 4));
        assert!(t.residents("gpu0").is_empty(), "finished");
        t.apply_put(&kv(
            keys::task_report("a"),
            TaskReport::default().encode_to_vec(),
            5,
        ));
        assert_eq!(t.residents("gpu0").len(), 1);
        t.apply_delete(&keys::task_alive("a"), 6);
        assert!(t.residents("gpu0").is_empty(), "lease gone");
        assert_eq!(t.revision, 6);
    }

    #[test]
    fn undecodable_values_are_ignored() {
        let mut t = TaskTable::default();
        t.apply_put(&kv(keys::task_spec("a"), vec![0xff, 0xff, 0xff], 1));
        assert!(t.tasks.get("a").is_none_or(|e| e.spec.is_none()));
    }
}
