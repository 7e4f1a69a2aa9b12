//! Compacts the state store's history, so an external etcd does not grow with every
//! write ever made.
//!
//! etcd keeps every revision of every key until it is told to forget them; nothing but
//! `iadeep up`'s own etcd (`--auto-compaction-retention`) was ever told, so an etcd run
//! by an operator grew by about 1.1 KB per Place/Release cycle whatever the retention of
//! released tasks deleted. The reaper therefore runs a [`Compactor`] every
//! [`crate::PlacerParams::compact_every`] (default [`DEFAULT_COMPACT_EVERY`]). Each time
//! it forgets the history older than the revision it read one period before, and in any
//! case older than the last [`crate::PlacerParams::compact_keep_revisions`] (default
//! [`DEFAULT_COMPACT_KEEP_REVISIONS`], the embedded store's own history length): at most
//! one period of history, and at most that many revisions of it. Why both: by count alone
//! an idle store keeps its last 10,000 revisions for ever (36 MB after a burst of
//! Place/Release cycles, measured), by time alone a burst keeps everything written
//! within the period.
//!
//! What the kept history is for: a watcher that falls further behind (a tuner or placer
//! cut off from etcd for longer than that) gets [`iadeep_state::StateError::Compacted`]
//! and reads its prefix afresh (a [`iadeep_state::Follow`] does this itself), so a
//! shorter history costs a re-read, never a lost change. Compaction frees space inside
//! etcd's database file; giving it back to the file system takes `etcdctl defrag` (see
//! the README).
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

/// Compacts a store's history on each [`Compactor::tick`], one period behind.
#[derive(Clone, Debug)]
pub struct Compactor {
    keep: i64,
    /// The store's revision at the last tick: what the next one compacts to.
    previous: Option<Revision>,
}

impl Compactor {
    /// A compactor that keeps at most `keep` revisions (at least 1) of history.
    pub fn new(keep: i64) -> Compactor {
        Compactor {
            keep: keep.max(1),
            previous: None,
        }
    }

    /// Forgets the history before the revision of the previous tick, or before the last
    /// `keep` revisions when that is later; returns the revision compacted to, `None`
    /// when there is nothing to forget yet.
    pub async fn tick(&mut self, store: &dyn StateStore) -> Result<Option<Revision>> {
        // The cheapest read that answers the store's current revision.
        let current = store.range_page(keys::ROOT, None, 1).await?.revision;
        let by_count = current.saturating_sub(self.keep);
        let target = self
            .previous
            .map_or(by_count, |previous| previous.max(by_count));
        self.previous = Some(current);
        if target <= 0 {
            return Ok(None);
        }
        store.compact(target).await?;
        tracing::debug!(revision = target, current, "compacted the store's history");
        Ok(Some(target))
    }
}
