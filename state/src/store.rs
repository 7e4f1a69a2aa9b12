//! The [`StateStore`] trait every backend implements, and the values it speaks in.
//!
//! The model is etcd's, because etcd is the production backend and its semantics
//! are the ones the components are written against: one global revision that
//! increases with every write, a mod-revision per key for compare-and-swap,
//! prefix watches that can resume from any revision still in the history, and
//! leases whose expiry deletes the keys bound to them.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::mpsc;

use crate::error::{Result, StateError};
pub use crate::ids::{LeaseId, Revision};

/// One key with its value and metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: String,
    pub value: Vec<u8>,
    /// Revision of the write that created the key (since it last did not exist).
    pub create_revision: Revision,
    /// Revision of the last write to the key; what compare-and-swap compares.
    pub mod_revision: Revision,
    /// Number of writes since creation (1 after the first put).
    pub version: i64,
    pub lease: Option<LeaseId>,
}

impl KeyValue {
    /// The key as a put at `revision` leaves it when it did not exist before (version
    /// 1, no lease): what the writer of a transaction that created it knows of it
    /// without reading it back.
    pub fn created_at(key: impl Into<String>, value: Vec<u8>, revision: Revision) -> KeyValue {
        KeyValue {
            key: key.into(),
            value,
            create_revision: revision,
            mod_revision: revision,
            version: 1,
            lease: None,
        }
    }
}

/// A change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    Put(KeyValue),
    /// The key was deleted, explicitly or because its lease expired.
    Delete {
        key: String,
        revision: Revision,
    },
}

impl WatchEvent {
    /// The key the event is about.
    pub fn key(&self) -> &str {
        match self {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        }
    }

    /// The revision of the write that caused the event.
    pub fn revision(&self) -> Revision {
        match self {
            WatchEvent::Put(kv) => kv.mod_revision,
            WatchEvent::Delete { revision, .. } => *revision,
        }
    }
}

/// What a compare-and-swap expects to find.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// The key must not exist.
    Absent,
    /// The key must exist with exactly this mod-revision.
    ModRevision(Revision),
}

/// Result of a compare-and-swap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CasOutcome {
    /// The expectation held and the value was written at `revision`.
    Swapped { revision: Revision },
    /// The expectation did not hold; nothing was written. `current` is what is there now.
    Conflict { current: Option<KeyValue> },
}

impl CasOutcome {
    /// True when the write happened.
    pub fn swapped(&self) -> bool {
        matches!(self, CasOutcome::Swapped { .. })
    }
}

/// One condition of a [`Txn`]: what `key` must look like for the transaction to apply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnCompare {
    pub key: String,
    pub expect: Expect,
}

/// One write of a [`Txn`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOp {
    /// Writes `value` at `key`, bound to `lease` if given (without one, the key is
    /// detached from any lease it had, as a plain put does).
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    },
    /// Deletes `key` (deleting an absent key is allowed and changes nothing).
    Delete { key: String },
}

impl TxnOp {
    /// The key the operation writes.
    pub fn key(&self) -> &str {
        match self {
            TxnOp::Put { key, .. } | TxnOp::Delete { key } => key,
        }
    }
}

/// An atomic multi-key transaction: every operation applies, in one durable commit
/// at one revision, if and only if every comparison holds; otherwise nothing is
/// written and the revision does not move.
///
/// Why one primitive rather than several compare-and-swaps: a placement touches
/// three keys (the device's residents, the task's placement and its spec), and a
/// durable commit is what a decision costs, so one commit per decision is both
/// cheaper and the only way a crash can never leave half of it behind.
///
/// A key may be written by at most one operation (etcd refuses duplicates, and so
/// does every backend, so code cannot depend on an order between them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Txn {
    pub compares: Vec<TxnCompare>,
    pub ops: Vec<TxnOp>,
}

impl Txn {
    /// An empty transaction (it commits and writes nothing).
    pub fn new() -> Txn {
        Txn::default()
    }

    /// Adds the condition that `key` matches `expect`.
    pub fn compare(mut self, key: impl Into<String>, expect: Expect) -> Txn {
        self.compares.push(TxnCompare {
            key: key.into(),
            expect,
        });
        self
    }

    /// Adds a put of `value` at `key`.
    pub fn put(mut self, key: impl Into<String>, value: Vec<u8>, lease: Option<LeaseId>) -> Txn {
        self.ops.push(TxnOp::Put {
            key: key.into(),
            value,
            lease,
        });
        self
    }

    /// Adds a delete of `key`.
    pub fn delete(mut self, key: impl Into<String>) -> Txn {
        self.ops.push(TxnOp::Delete { key: key.into() });
        self
    }

    /// Adds `ops`, in order.
    pub fn with_ops(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Txn {
        self.ops.extend(ops);
        self
    }

    /// Refuses a transaction that writes one key twice.
    pub fn check(&self) -> Result<()> {
        let mut seen = std::collections::HashSet::with_capacity(self.ops.len());
        for op in &self.ops {
            if !seen.insert(op.key()) {
                return Err(StateError::InvalidTxn {
                    reason: format!("key {:?} is written more than once", op.key()),
                });
            }
        }
        Ok(())
    }

    /// Whether `current` (the key's value now, if any) satisfies `expect`.
    pub fn holds(expect: Expect, current: Option<&KeyValue>) -> bool {
        match (expect, current) {
            (Expect::Absent, None) => true,
            (Expect::ModRevision(rev), Some(kv)) => kv.mod_revision == rev,
            _ => false,
        }
    }
}

/// Result of a [`Txn`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOutcome {
    /// Every comparison held; the operations were committed durably at `revision`
    /// (the current revision, unchanged, when they changed nothing).
    Committed { revision: Revision },
    /// Some comparison failed; nothing was written. `current` holds, for each
    /// compared key in the order of [`Txn::compares`], what is there now, so the
    /// caller can refresh its view and try again without another read.
    Failed { current: Vec<Option<KeyValue>> },
}

impl TxnOutcome {
    /// True when the transaction was applied.
    pub fn committed(&self) -> bool {
        matches!(self, TxnOutcome::Committed { .. })
    }
}

/// A consistent snapshot of a prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeSnapshot {
    /// Keys under the prefix, sorted by key.
    pub kvs: Vec<KeyValue>,
    /// The store revision the snapshot was read at: watch from `revision + 1` to see
    /// every later change without a gap.
    pub revision: Revision,
}

/// Most keys one page of a [`StateStore::range_page`] holds, unless asked otherwise.
///
/// Why a bound at all: etcd answers a range in one gRPC message, and a client refuses
/// any message over 4 MiB, so an unbounded range over a prefix that grew (a day of
/// released tasks once held 82,766 keys, 7.2 MB) fails outright, and with it every
/// component that must read that prefix to start. 500 of iadeep's records (specs,
/// reports, residents records: a few hundred bytes to a few KB each) are well under
/// 1 MiB; a page that is still too large (huge values) is halved until it fits.
///
/// Why not much larger, and when to ask for more: etcd 3.4 counts every key from a
/// page's start to the prefix's end to answer it (its `count`), so a page costs the
/// whole rest of the range (0.1 to 0.4 s for a page at the start of 100,000 keys on a
/// loaded 2-core machine, measured) and walking n keys costs n²/page. Walkers of
/// prefixes that can hold millions of small values (release markers, `state ls`) ask
/// for pages of thousands.
pub const DEFAULT_PAGE_SIZE: usize = 500;

/// One page of keys under a prefix, from [`StateStore::range_page`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangePage {
    /// Keys under the prefix after the page's starting key, sorted, at most the limit.
    pub kvs: Vec<KeyValue>,
    /// The store revision the page was read at.
    pub revision: Revision,
    /// Whether keys under the prefix follow the last one of this page: ask for the
    /// next page after that key.
    pub more: bool,
}

impl RangePage {
    /// The key the next page starts after, when there is one.
    pub fn next_after(&self) -> Option<&str> {
        self.more
            .then(|| self.kvs.last().map(|kv| kv.key.as_str()))
            .flatten()
    }
}

/// A stream of [`WatchEvent`]s in revision order.
///
/// Dropping it cancels the watch. An `Err` item is final (for example
/// [`StateError::Compacted`]); transient disconnections are handled inside the
/// backend and never show up here as lost or repeated events.
pub struct WatchStream {
    rx: mpsc::UnboundedReceiver<Result<WatchEvent>>,
}

impl fmt::Debug for WatchStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WatchStream").finish_non_exhaustive()
    }
}

impl WatchStream {
    /// A stream fed by `tx`; the backend stops feeding once the stream is dropped
    /// (`tx.closed()` resolves, sends fail).
    ///
    /// Unbounded on purpose: a watch must never lose an event, and the backends
    /// must never block a write on a slow reader; a slow reader costs memory.
    pub(crate) fn unbounded() -> (mpsc::UnboundedSender<Result<WatchEvent>>, WatchStream) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, WatchStream { rx })
    }

    /// The next event; `None` when the backend closed the watch.
    pub async fn next(&mut self) -> Option<Result<WatchEvent>> {
        self.rx.recv().await
    }
}

impl futures::Stream for WatchStream {
    type Item = Result<WatchEvent>;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

/// Smallest and largest lease TTL accepted by every backend (etcd counts in whole seconds).
pub const MIN_LEASE_TTL: Duration = Duration::from_secs(1);
/// See [`MIN_LEASE_TTL`].
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

/// Rounds a TTL up to whole seconds and checks it is within bounds.
pub(crate) fn lease_ttl_secs(ttl: Duration) -> Result<i64> {
    if ttl < MIN_LEASE_TTL || ttl > MAX_LEASE_TTL {
        return Err(StateError::InvalidTtl(ttl));
    }
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs).map_err(|_| StateError::InvalidTtl(ttl))
}

/// The cluster-state store: etcd in production, an embedded file on one machine.
///
/// Components hold an `Arc<dyn StateStore>` and never learn which backend it is.
/// Keys are UTF-8 strings laid out by [`crate::keys`]; values are bytes (protobuf
/// messages from `iadeep-proto`, see [`crate::typed`]).
#[async_trait]
pub trait StateStore: Send + Sync + fmt::Debug {
    /// A human-readable name of the store for logs, e.g. `etcd://127.0.0.1:2379`.
    fn describe(&self) -> String;

    /// The value at `key`, if any.
    async fn get(&self, key: &str) -> Result<Option<KeyValue>>;

    /// Writes `value` at `key`, bound to `lease` if given; returns the write's revision.
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision>;

    /// Deletes `key`; returns whether it existed.
    async fn delete(&self, key: &str) -> Result<bool>;

    /// Writes `value` at `key` only if `expect` holds, atomically: a one-key [`Txn`].
    async fn compare_and_swap(
        &self,
        key: &str,
        expect: Expect,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    ) -> Result<CasOutcome> {
        let txn = Txn::new().compare(key, expect).put(key, value, lease);
        Ok(match self.transact(txn).await? {
            TxnOutcome::Committed { revision } => CasOutcome::Swapped { revision },
            TxnOutcome::Failed { mut current } => CasOutcome::Conflict {
                current: current.pop().flatten(),
            },
        })
    }

    /// Deletes `key` only if its mod-revision is `mod_revision`; returns whether it did.
    async fn compare_and_delete(&self, key: &str, mod_revision: Revision) -> Result<bool> {
        let txn = Txn::new()
            .compare(key, Expect::ModRevision(mod_revision))
            .delete(key);
        Ok(self.transact(txn).await?.committed())
    }

    /// Applies `txn` atomically and durably: all of its operations at one new revision
    /// if every comparison holds, nothing otherwise. A transaction that writes one key
    /// twice is refused with [`StateError::InvalidTxn`]; a put bound to a lease that
    /// no longer exists fails with [`StateError::LeaseNotFound`] and writes nothing.
    async fn transact(&self, txn: Txn) -> Result<TxnOutcome>;

    /// Every key starting with `prefix`, sorted, with the revision of the snapshot.
    ///
    /// One consistent snapshot whatever the prefix holds: etcd reads it in pages of
    /// [`DEFAULT_PAGE_SIZE`] keys (or its configured page size), every page at the
    /// first page's revision, so no answer approaches gRPC's message limit. The whole
    /// answer is in memory: a caller that walks a prefix that may hold millions of
    /// keys (the retention sweep, `iadeep state ls`) uses [`StateStore::range_page`].
    async fn range(&self, prefix: &str) -> Result<RangeSnapshot>;

    /// At most `limit` keys (at least 1) starting with `prefix` and sorting after
    /// `after` (from the first with `None`), sorted, read at one revision.
    ///
    /// Successive pages are each consistent but may be read at different revisions:
    /// a walker that needs one snapshot uses [`StateStore::range`].
    ///
    /// The default reads the whole prefix and keeps one page, for wrappers and test
    /// doubles; both backends read only the page.
    async fn range_page(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<RangePage> {
        let snapshot = self.range(prefix).await?;
        let mut kvs: Vec<KeyValue> = snapshot
            .kvs
            .into_iter()
            .filter(|kv| after.is_none_or(|after| kv.key.as_str() > after))
            .collect();
        let more = kvs.len() > limit.max(1);
        kvs.truncate(limit.max(1));
        Ok(RangePage {
            kvs,
            revision: snapshot.revision,
            more,
        })
    }

    /// Forgets the history before `revision`, so the store does not grow with every
    /// write ever made: watches from an earlier revision then fail with
    /// [`StateError::Compacted`] (a [`crate::Follow`] reads afresh). A revision already
    /// compacted is not an error. The embedded store bounds its own history (its last
    /// `DEFAULT_HISTORY_REVISIONS`), so there this does nothing, as by default (for
    /// wrappers and test doubles).
    async fn compact(&self, revision: Revision) -> Result<()> {
        let _ = revision;
        Ok(())
    }

    /// Changes to keys starting with `prefix`, from `start_revision` (inclusive) or,
    /// with `None`, from now on.
    async fn watch(&self, prefix: &str, start_revision: Option<Revision>) -> Result<WatchStream>;

    /// A new lease that expires `ttl` (rounded up to whole seconds) after its last keep-alive.
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId>;

    /// Refreshes the lease; returns its TTL. [`StateError::LeaseNotFound`] once it expired.
    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration>;

    /// Ends the lease now, deleting its keys. Revoking an unknown lease is not an error.
    async fn revoke_lease(&self, lease: LeaseId) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_rounds_up_to_whole_seconds_and_rejects_out_of_range() {
        assert_eq!(lease_ttl_secs(Duration::from_millis(1500)).ok(), Some(2));
        assert_eq!(lease_ttl_secs(Duration::from_secs(3)).ok(), Some(3));
        assert!(lease_ttl_secs(Duration::from_millis(999)).is_err());
        assert!(lease_ttl_secs(MAX_LEASE_TTL + Duration::from_secs(1)).is_err());
    }
}
