//! Where a released task's records go: out of `tasks/`, which the placer's start and
//! every tuner read whole, into `archive/`, where they stay for an operator until the
//! retention deletes them (see [`crate::retention`] and [`iadeep_state::keys`]).

use iadeep_state::keys;
use iadeep_state::{Expect, KeyValue, StateStore, Txn, TxnCompare, TxnOp};

use crate::error::Result;

/// The comparisons and writes of a Release, besides the reservation's, the
/// placement's and the release marker's: `task`'s spec, report and assignment move
/// from `tasks/` to `archive/` (what is absent there is deleted from the archive, so
/// nothing of an earlier task of that id stays).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArchiveOps {
    /// Each moved key as read (its mod revision, or absent): a value written between
    /// the read and the Release's commit (the agent's last report) fails the Release,
    /// which reads again, rather than being deleted with the older one archived.
    pub compares: Vec<TxnCompare>,
    pub ops: Vec<TxnOp>,
}

impl ArchiveOps {
    /// `txn` with these comparisons and writes added after its own.
    pub fn add_to(&self, mut txn: Txn) -> Txn {
        txn.compares.extend(self.compares.iter().cloned());
        txn.with_ops(self.ops.iter().cloned())
    }
}

/// Reads the task's keys (a few small values) and builds [`ArchiveOps`] from them.
pub async fn archive_ops(store: &dyn StateStore, task: &str) -> Result<ArchiveOps> {
    let live = store.range(&keys::task_prefix(task)).await?.kvs;
    Ok(archive_ops_from(&live, task))
}

/// [`ArchiveOps`] for `task` whose keys under `tasks/` are `live`.
pub fn archive_ops_from(live: &[KeyValue], task: &str) -> ArchiveOps {
    let mut archive = ArchiveOps::default();
    for (live_key, archived) in keys::archived_task_keys(task) {
        let expect = match live.iter().find(|kv| kv.key == live_key) {
            Some(kv) => {
                archive.ops.push(TxnOp::Put {
                    key: archived,
                    value: kv.value.clone(),
                    lease: None,
                });
                archive.ops.push(TxnOp::Delete {
                    key: live_key.clone(),
                });
                Expect::ModRevision(kv.mod_revision)
            }
            None => {
                archive.ops.push(TxnOp::Delete { key: archived });
                Expect::Absent
            }
        };
        archive.compares.push(TxnCompare {
            key: live_key,
            expect,
        });
    }
    archive
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: String, value: &[u8], mod_revision: i64) -> KeyValue {
        KeyValue::created_at(key, value.to_vec(), mod_revision)
    }

    /// Every moved key is compared as read: present ones at their mod revision, absent
    /// ones as absent, so a report written after the read fails the transaction.
    #[test]
    fn each_key_is_compared_as_it_was_read() {
        let live = [kv(keys::task_report("t"), b"r", 7)];
        let archive = archive_ops_from(&live, "t");
        let expect = |key: String| {
            archive
                .compares
                .iter()
                .find(|c| c.key == key)
                .map(|c| c.expect)
        };
        assert_eq!(archive.compares.len(), 3);
        assert_eq!(expect(keys::task_report("t")), Some(Expect::ModRevision(7)));
        assert_eq!(expect(keys::task_spec("t")), Some(Expect::Absent));
        assert_eq!(expect(keys::task_assignment("t")), Some(Expect::Absent));
        assert!(archive.ops.contains(&TxnOp::Put {
            key: keys::archived_report("t"),
            value: b"r".to_vec(),
            lease: None,
        }));
        assert!(archive.ops.contains(&TxnOp::Delete {
            key: keys::task_report("t"),
        }));
        assert!(archive.ops.contains(&TxnOp::Delete {
            key: keys::archived_spec("t"),
        }));
        let txn = archive.add_to(Txn::new().compare("first", Expect::Absent));
        assert_eq!(
            txn.compares[0].key, "first",
            "the caller's compares come first"
        );
        assert_eq!(txn.compares.len(), 4);
    }
}
