//! Compacts the state store's history, so an external etcd does not grow with every
//! write ever made.
//!
//! etcd keeps every revision of every key until it is told to forget them; nothing but
//! `iadeep up`'s own etcd (`--auto-compaction-retention`) was ever told, so an etcd run
//! by an operator grew by about 1.1 KB per Place/Release cycle whatever the retention of
//! released tasks deleted. The reaper therefore calls [`compact`] every
//! [`crate::PlacerParams::compact_every`] (default [`DEFAULT_COMPACT_EVERY`]), which
//! forgets the history older than the last
//! [`crate::PlacerParams::compact_keep_revisions`] revisions (default
//! [`DEFAULT_COMPACT_KEEP_REVISIONS`], the embedded store's own history length).
//!
//! What the kept revisions are for: a watcher that falls further behind than them (a
//! tuner or placer cut off from etcd for that many writes) gets
//! [`iadeep_state::StateError::Compacted`] and reads its prefix afresh (a
//! [`iadeep_state::Follow`] does this itself), so a shorter history costs a re-read,
//! never a lost change. Compaction frees space inside etcd's database file; giving it
//! back to the file system takes `etcdctl defrag` (see the README).
//!
//! Every placer compacts: the placer has no leader election, and a compaction to a
//! revision another placer already compacted is not an error, so several placers on
//! one store only repeat the same harmless request.

use std::time::Duration;

use iadeep_state::{DEFAULT_HISTORY_REVISIONS, Revision, StateStore, keys};

use crate::error::Result;

/// Default of [`crate::PlacerParams::compact_every`].
pub const DEFAULT_COMPACT_EVERY: Duration = Duration::from_secs(5 * 60);

/// Default of [`crate::PlacerParams::compact_keep_revisions`]: as many as the embedded
/// store keeps, so both backends let a watcher fall equally far behind.
pub const DEFAULT_COMPACT_KEEP_REVISIONS: i64 = DEFAULT_HISTORY_REVISIONS;

/// Forgets the store's history before its last `keep` revisions; returns the revision
/// compacted to, `None` when the store holds no more than `keep` yet.
pub async fn compact(store: &dyn StateStore, keep: i64) -> Result<Option<Revision>> {
    // The cheapest read that answers the store's current revision.
    let current = store.range_page(keys::ROOT, None, 1).await?.revision;
    let target = current.saturating_sub(keep.max(1));
    if target <= 0 {
        return Ok(None);
    }
    store.compact(target).await?;
    tracing::debug!(revision = target, current, "compacted the store's history");
    Ok(Some(target))
}
