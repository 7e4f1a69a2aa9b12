//! Where a released task's records go: out of `tasks/`, which the placer's start and
//! every tuner read whole, into `archive/`, where they stay for an operator until the
//! retention deletes them (see [`crate::retention`] and [`iadeep_state::keys`]).

use iadeep_state::keys;
use iadeep_state::{StateStore, TxnOp};

use crate::error::Result;

/// The writes of a Release, besides the reservation's, the placement's and the
/// release marker's: `task`'s spec, report and assignment move from `tasks/` to
/// `archive/` (what is absent there is deleted from the archive, so nothing of an
/// earlier task of that id stays).
///
/// Reads the task's keys, a few small values: a value rewritten between that read and
/// the Release's commit (a last report) is archived as read, and its newer version
/// deleted with the task's other live keys.
pub async fn archive_ops(store: &dyn StateStore, task: &str) -> Result<Vec<TxnOp>> {
    let live = store.range(&keys::task_prefix(task)).await?.kvs;
    let mut ops = Vec::with_capacity(6);
    for (live_key, archived) in keys::archived_task_keys(task) {
        match live.iter().find(|kv| kv.key == live_key) {
            Some(kv) => {
                ops.push(TxnOp::Put {
                    key: archived,
                    value: kv.value.clone(),
                    lease: None,
                });
                ops.push(TxnOp::Delete { key: live_key });
            }
            None => ops.push(TxnOp::Delete { key: archived }),
        }
    }
    Ok(ops)
}
