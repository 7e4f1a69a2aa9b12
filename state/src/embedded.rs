//! The embedded backend: a single redb file, for running iadeep on one machine
//! with no server.
//!
//! It mirrors etcd's semantics so components cannot tell the difference:
//! a global revision, per-key create/mod revisions and versions, compare-and-swap,
//! a bounded event history that prefix watches replay from any revision still
//! kept, and leases whose expiry deletes their keys and emits delete events.
//!
//! What differs, by design:
//! - Leases live in this process. When the process ends, its leases end with it,
//!   so on the next open every key that was bound to a lease is deleted (and the
//!   deletion recorded in the history). Keys without a lease survive restarts:
//!   every write is committed durably before the call returns.
//! - One process at a time may open a file (redb locks it). Several processes
//!   sharing state need etcd.
//! - Watches are delivered in-process through unbounded channels; a slow reader
//!   costs memory, never a lost event.
//!
//! A damaged file is an error, never a crash: an existing file must be a redb
//! database holding iadeep's tables (a 0-byte or foreign file is refused, not
//! overwritten), and every call into redb goes through [`contain`], which turns a
//! panic inside redb on corrupt pages into [`StateError::Embedded`]. Read-only
//! opens ([`EmbeddedStore::open_read_only`], for `iadeep state get/ls/watch`) never
//! create, repair or write the file (one not closed cleanly is repaired in memory,
//! see [`overlay`]).
//!
//! Writes use group commit: concurrent transactions are queued to one writer
//! thread that commits all of those waiting in one redb write transaction, i.e.
//! one fsync, and answers each caller once that commit is durable (see
//! [`spawn_writer`]).

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redb::{
    Database, ReadOnlyDatabase, ReadableDatabase, ReadableTable, TableDefinition, TableHandle,
};
use tokio::sync::mpsc;

mod overlay;

use crate::error::{Result, StateError};
use crate::store::{
    KeyValue, LeaseId, RangePage, RangeSnapshot, Revision, StateStore, Txn, TxnOp, TxnOutcome,
    WatchEvent, WatchStream, lease_ttl_secs,
};

/// key → encoded [`Record`].
const KV: TableDefinition<&str, &[u8]> = TableDefinition::new("kv");
/// (revision, index within the revision) → encoded event.
const EVENTS: TableDefinition<(i64, u32), &[u8]> = TableDefinition::new("events");
/// Counters: current revision, oldest revision still in the event history.
const META: TableDefinition<&str, i64> = TableDefinition::new("meta");

const META_REVISION: &str = "revision";
const META_OLDEST: &str = "oldest_event_revision";

/// Revisions of history kept for resuming watches.
pub const DEFAULT_HISTORY_REVISIONS: i64 = 10_000;
/// How often expired leases are looked for.
const REAPER_INTERVAL: Duration = Duration::from_millis(50);

/// The embedded single-file store. Cheap to clone; clones share one database.
#[derive(Clone)]
pub struct EmbeddedStore {
    /// Declared before `inner` so it drops first (see [`Owner`]); `None` in the
    /// background threads' temporary handles.
    owner: Option<Arc<Owner>>,
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore")
            .field("location", &self.inner.location)
            .finish_non_exhaustive()
    }
}

/// Shared by every handle given to callers, not by the background threads: when
/// the last such handle is dropped, the threads are told to stop and joined before
/// that handle's reference to the database goes, so the database is closed (and
/// its file left clean) on the caller's thread.
///
/// Why: a background thread briefly holding the last reference would otherwise
/// close the database itself, and a short-lived process (`iadeep state put`) can
/// exit before it does, leaving a file that needs a repair at the next open.
struct Owner {
    /// The queue of the group-commit writer (see [`spawn_writer`]); `None` when
    /// read-only. Dropping it is what stops the writer.
    writer: Option<std::sync::mpsc::Sender<WriteRequest>>,
    stop: Arc<AtomicBool>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        self.writer = None;
        self.stop.store(true, Ordering::Relaxed);
        let threads = std::mem::take(
            &mut *self
                .threads
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        for thread in threads {
            if thread.thread().id() != std::thread::current().id() {
                thread.thread().unpark();
                let _ = thread.join();
            }
        }
    }
}

/// The redb database, writable or not.
enum Db {
    Writable(Database),
    ReadOnly(ReadOnlyDatabase),
    /// A file that was not closed cleanly, opened read-only: redb repaired it through
    /// an [`overlay::CopyOnWrite`], in memory; the file itself is never written.
    Repaired(Database),
}

impl Db {
    fn begin_read(&self) -> std::result::Result<redb::ReadTransaction, redb::TransactionError> {
        match self {
            Db::Writable(db) | Db::Repaired(db) => db.begin_read(),
            Db::ReadOnly(db) => db.begin_read(),
        }
    }
}

struct Inner {
    db: Db,
    /// The file path, or `:memory:`.
    location: String,
    history_revisions: i64,
    /// Serialises every write and guards the in-process parts (leases, watchers).
    shared: Mutex<Shared>,
    /// Durable commits so far (each may carry many transactions).
    commits: std::sync::atomic::AtomicU64,
}

/// A transaction waiting for the group-commit writer, with where to send its outcome.
struct WriteRequest {
    txn: Txn,
    reply: tokio::sync::oneshot::Sender<Result<Applied>>,
}

/// Most transactions the writer commits at once: bounds the time one commit holds
/// the store's lock, while concurrency in practice stays far below it.
const MAX_GROUP_COMMIT: usize = 256;

struct Shared {
    revision: Revision,
    oldest_event_revision: Revision,
    next_lease: i64,
    leases: HashMap<LeaseId, LeaseState>,
    watchers: Vec<Watcher>,
}

struct LeaseState {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

struct Watcher {
    prefix: String,
    /// Events below this revision were asked not to be seen (a start revision in the future).
    min_revision: Revision,
    tx: mpsc::UnboundedSender<Result<WatchEvent>>,
}

/// The metadata stored beside each value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Record {
    create_revision: Revision,
    mod_revision: Revision,
    version: i64,
    lease: Option<LeaseId>,
}

const RECORD_FORMAT: u8 = 1;
const RECORD_HEADER: usize = 1 + 8 * 4;

impl Record {
    fn encode(&self, value: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(RECORD_HEADER + value.len());
        out.push(RECORD_FORMAT);
        for n in [
            self.create_revision,
            self.mod_revision,
            self.version,
            self.lease.map_or(0, |l| l.0),
        ] {
            out.extend_from_slice(&n.to_le_bytes());
        }
        out.extend_from_slice(value);
        out
    }

    fn decode(key: &str, bytes: &[u8]) -> Result<(Record, Vec<u8>)> {
        let corrupt = |reason: &str| StateError::Corrupt {
            key: key.to_owned(),
            reason: reason.to_owned(),
        };
        if bytes.len() < RECORD_HEADER {
            return Err(corrupt("record shorter than its header"));
        }
        if bytes[0] != RECORD_FORMAT {
            return Err(corrupt("unknown record format"));
        }
        let field = |i: usize| {
            let start = 1 + 8 * i;
            let mut buf = [0u8; 8];
            buf.copy_from_slice(&bytes[start..start + 8]);
            i64::from_le_bytes(buf)
        };
        let lease = field(3);
        Ok((
            Record {
                create_revision: field(0),
                mod_revision: field(1),
                version: field(2),
                lease: (lease != 0).then_some(LeaseId(lease)),
            },
            bytes[RECORD_HEADER..].to_vec(),
        ))
    }

    fn into_kv(self, key: String, value: Vec<u8>) -> KeyValue {
        KeyValue {
            key,
            value,
            create_revision: self.create_revision,
            mod_revision: self.mod_revision,
            version: self.version,
            lease: self.lease,
        }
    }
}

/// Events are stored as: kind (0 put, 1 delete), key length (u32 LE), key, then
/// for a put the encoded record of the new value.
fn encode_event(event: &WatchEvent) -> Vec<u8> {
    let (kind, key) = match event {
        WatchEvent::Put(kv) => (0u8, kv.key.as_str()),
        WatchEvent::Delete { key, .. } => (1u8, key.as_str()),
    };
    let mut out = vec![kind];
    out.extend_from_slice(&u32::try_from(key.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    if let WatchEvent::Put(kv) = event {
        let record = Record {
            create_revision: kv.create_revision,
            mod_revision: kv.mod_revision,
            version: kv.version,
            lease: kv.lease,
        };
        out.extend_from_slice(&record.encode(&kv.value));
    }
    out
}

fn decode_event(revision: Revision, bytes: &[u8]) -> Result<WatchEvent> {
    let corrupt = |reason: &str| StateError::Corrupt {
        key: format!("<event at revision {revision}>"),
        reason: reason.to_owned(),
    };
    if bytes.len() < 5 {
        return Err(corrupt("event shorter than its header"));
    }
    let mut len = [0u8; 4];
    len.copy_from_slice(&bytes[1..5]);
    let key_end = 5 + u32::from_le_bytes(len) as usize;
    let key_bytes = bytes
        .get(5..key_end)
        .ok_or_else(|| corrupt("key runs past the event"))?;
    let key = std::str::from_utf8(key_bytes)
        .map_err(|_| corrupt("key is not UTF-8"))?
        .to_owned();
    match bytes[0] {
        0 => {
            let (record, value) = Record::decode(&key, &bytes[key_end..])?;
            Ok(WatchEvent::Put(record.into_kv(key, value)))
        }
        1 => Ok(WatchEvent::Delete { key, revision }),
        _ => Err(corrupt("unknown event kind")),
    }
}

/// What applying one [`Txn`] inside a batch did.
#[derive(Clone, Debug)]
struct Applied {
    outcome: TxnOutcome,
    /// Whether it wrote anything (a committed transaction of deletes of absent keys
    /// does not advance the revision, as in etcd).
    changed: bool,
}

/// A key whose lease changed in a batch: the key, its lease before and after.
type LeaseMove = (String, Option<LeaseId>, Option<LeaseId>);

/// After a batch's commit: moves its keys between leases' bookkeeping and tells the
/// watchers its events (dropping those whose stream is gone).
fn publish(shared: &mut Shared, lease_moves: Vec<LeaseMove>, events: &[WatchEvent]) {
    for (key, old, new) in lease_moves {
        if old == new {
            continue;
        }
        if let Some(state) = old.and_then(|l| shared.leases.get_mut(&l)) {
            state.keys.remove(&key);
        }
        if let Some(state) = new.and_then(|l| shared.leases.get_mut(&l)) {
            state.keys.insert(key);
        }
    }
    shared.watchers.retain(|w| {
        events
            .iter()
            .filter(|e| e.revision() >= w.min_revision && e.key().starts_with(&w.prefix))
            .all(|e| w.tx.send(Ok(e.clone())).is_ok())
    });
}

/// A transaction whose comparisons held, with the records its operations replace,
/// read before anything is written so a corrupt record fails only its own
/// transaction and never leaves one half-applied.
struct Prepared {
    ops: Vec<(TxnOp, Option<Record>)>,
}

impl EmbeddedStore {
    /// Opens (creating if needed) the store at `path`, creating parent directories.
    ///
    /// Keys bound to leases of a previous process are deleted: those leases ended
    /// when that process did. An existing file that is empty, not a redb database,
    /// or a redb database without iadeep's tables is refused and left untouched.
    pub fn open(path: impl AsRef<Path>) -> Result<EmbeddedStore> {
        let path = path.as_ref();
        let location = path.display().to_string();
        let fail = |reason: String| StateError::Embedded {
            path: location.clone(),
            reason,
        };
        let existed = check_existing_file(path).map_err(&fail)?;
        if !existed && let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|e| fail(format!("cannot create directory {}: {e}", parent.display())))?;
        }
        if existed {
            // Checked read-only first: opening a redb file for writing marks it,
            // and another program's database must be left exactly as it was.
            contain(&location, "checking the file", || {
                match open_retrying_briefly(|| ReadOnlyDatabase::open(path)) {
                    Ok(db) => {
                        let txn = db.begin_read().map_err(|e| fail(e.to_string()))?;
                        check_tables(&txn).map_err(&fail)
                    }
                    // Not closed cleanly (a crash): only a read-write open can repair
                    // it, and a crashed iadeep process is by far the likeliest writer.
                    Err(redb::DatabaseError::RepairAborted) => Ok(()),
                    Err(redb::DatabaseError::DatabaseAlreadyOpen) => Ok(()),
                    Err(other) => Err(fail(format!(
                        "{other} (the file is damaged or not an iadeep store)"
                    ))),
                }
            })?;
        }
        let db = contain(&location, "opening the file", || {
            open_retrying_briefly(|| {
                if existed {
                    Database::open(path)
                } else {
                    Database::create(path)
                }
            })
            .map_err(|e| match e {
                redb::DatabaseError::DatabaseAlreadyOpen => fail(
                    "the file is already open in another process (an embedded store serves \
                     one process at a time; use etcd to share state between processes)"
                        .to_owned(),
                ),
                other => fail(format!(
                    "{other} (the file is damaged or not an iadeep store)"
                )),
            })
        })?;
        let (store, queue) = contain(&location, "reading the store's counters", || {
            Self::from_database(
                Db::Writable(db),
                location.clone(),
                DEFAULT_HISTORY_REVISIONS,
                existed,
            )
        })?;
        contain(&location, "dropping keys of ended leases", || {
            store.drop_orphaned_leased_keys()
        })?;
        store.spawn_background(queue)?;
        Ok(store)
    }

    /// Opens the existing store at `path` for reading only: nothing is created,
    /// repaired or written, and every write fails. Keys bound to leases are hidden,
    /// since the process that held their leases is gone (a live one would hold the
    /// file and this open would fail): reads show what a read-write open would.
    ///
    /// A file left by a process that was killed (or by a commit the full disk cut
    /// short) needs a repair, which is a write: it is repaired in memory only (see
    /// [`overlay`]), so the file is read as the next read-write open will find it, and
    /// it can be read when the disk is full.
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<EmbeddedStore> {
        let path = path.as_ref();
        let location = path.display().to_string();
        let fail = |reason: String| StateError::Embedded {
            path: location.clone(),
            reason,
        };
        if !check_existing_file(path).map_err(&fail)? {
            return Err(fail(
                "no store there (read-only commands never create one; check --store)".into(),
            ));
        }
        let opened = contain(&location, "opening the file", || {
            match open_retrying_briefly(|| ReadOnlyDatabase::open(path)) {
                Ok(db) => Ok(Some(db)),
                Err(redb::DatabaseError::DatabaseAlreadyOpen) => Err(fail(
                    "the file is open in another process (an embedded store serves one process \
                     at a time; stop it, or use etcd to share state between processes)"
                        .into(),
                )),
                // Not closed cleanly: repaired in memory below.
                Err(redb::DatabaseError::RepairAborted) => Ok(None),
                Err(other) => Err(fail(format!(
                    "{other} (the file is damaged or not an iadeep store)"
                ))),
            }
        })?;
        let db = match opened {
            Some(db) => Db::ReadOnly(db),
            None => contain(&location, "repairing the file in memory", || {
                repaired_in_memory(path).map_err(&fail)
            })?,
        };
        // No writer: the queue is dropped and writes are refused in `submit`.
        contain(&location, "reading the store's counters", || {
            Self::from_database(db, location.clone(), DEFAULT_HISTORY_REVISIONS, true)
        })
        .map(|(store, _queue)| store)
    }

    /// A store that lives in memory only, for tests and the simulator.
    pub fn in_memory() -> Result<EmbeddedStore> {
        Self::in_memory_with_history(DEFAULT_HISTORY_REVISIONS)
    }

    /// Like [`EmbeddedStore::in_memory`] with a chosen history length (tests of compaction).
    pub fn in_memory_with_history(history_revisions: i64) -> Result<EmbeddedStore> {
        let db = Database::builder()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .map_err(|e| StateError::Embedded {
                path: ":memory:".into(),
                reason: e.to_string(),
            })?;
        let (store, queue) = Self::from_database(
            Db::Writable(db),
            ":memory:".into(),
            history_revisions.max(1),
            false,
        )?;
        store.spawn_background(queue)?;
        Ok(store)
    }

    /// Ends every open watch, as a store that lost its clients would (tests of the
    /// watchers' recovery): each stream then ends with `None`.
    #[cfg(test)]
    pub(crate) fn close_watches(&self) {
        self.lock().watchers.clear();
    }

    /// The file path of the store, or `:memory:`.
    pub fn location(&self) -> &str {
        &self.inner.location
    }

    /// Whether the store was opened with [`EmbeddedStore::open_read_only`].
    pub fn is_read_only(&self) -> bool {
        matches!(self.inner.db, Db::ReadOnly(_) | Db::Repaired(_))
    }

    /// How many durable commits this handle's database has made since it was opened;
    /// with group commit, fewer than the writes when writes overlap.
    pub fn durable_commits(&self) -> u64 {
        self.inner
            .commits
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reads the counters (creating the tables of a new writable store) and builds
    /// the handle, with the queue its group-commit writer will read. `existing`
    /// files must already hold iadeep's tables.
    fn from_database(
        db: Db,
        location: String,
        history_revisions: i64,
        existing: bool,
    ) -> Result<(Self, std::sync::mpsc::Receiver<WriteRequest>)> {
        let err = |e: redb::Error| StateError::Embedded {
            path: location.clone(),
            reason: e.to_string(),
        };
        let (revision, oldest) = {
            if existing {
                let txn = db.begin_read().map_err(|e| err(e.into()))?;
                check_tables(&txn).map_err(|reason| StateError::Embedded {
                    path: location.clone(),
                    reason,
                })?;
                read_counters(&txn.open_table(META).map_err(|e| err(e.into()))?)
                    .map_err(|e| err(e.into()))?
            } else {
                let Db::Writable(writable) = &db else {
                    return Err(err(redb::Error::DatabaseClosed));
                };
                let txn = writable.begin_write().map_err(|e| err(e.into()))?;
                let counters = {
                    // Creating the tables here means every later read finds them.
                    txn.open_table(KV).map_err(|e| err(e.into()))?;
                    txn.open_table(EVENTS).map_err(|e| err(e.into()))?;
                    read_counters(&txn.open_table(META).map_err(|e| err(e.into()))?)
                        .map_err(|e| err(e.into()))?
                };
                txn.commit().map_err(|e| err(e.into()))?;
                counters
            }
        };
        let (writer, queue) = std::sync::mpsc::channel();
        let store = EmbeddedStore {
            owner: Some(Arc::new(Owner {
                writer: matches!(db, Db::Writable(_)).then_some(writer),
                stop: Arc::new(AtomicBool::new(false)),
                threads: Mutex::new(Vec::new()),
            })),
            inner: Arc::new(Inner {
                db,
                location,
                history_revisions,
                commits: std::sync::atomic::AtomicU64::new(0),
                shared: Mutex::new(Shared {
                    revision,
                    oldest_event_revision: oldest,
                    next_lease: 1,
                    leases: HashMap::new(),
                    watchers: Vec::new(),
                }),
            }),
        };
        Ok((store, queue))
    }

    /// Starts the group-commit writer and the lease reaper of a writable store.
    fn spawn_background(&self, queue: std::sync::mpsc::Receiver<WriteRequest>) -> Result<()> {
        let Some(owner) = &self.owner else {
            return Err(self.impossible("background threads started from a background handle"));
        };
        let mut threads = owner
            .threads
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let weak = Arc::downgrade(&self.inner);
        threads.push(spawn_writer(weak.clone(), queue)?);
        threads.extend(spawn_lease_reaper(weak, owner.stop.clone()));
        Ok(())
    }

    fn drop_orphaned_leased_keys(&self) -> Result<()> {
        let mut orphans = Vec::new();
        {
            let txn = self.inner.db.begin_read().map_err(|e| self.db_err(e))?;
            let table = txn.open_table(KV).map_err(|e| self.db_err(e))?;
            for entry in table.range::<&str>(..).map_err(|e| self.db_err(e))? {
                let (key, bytes) = entry.map_err(|e| self.db_err(e))?;
                let (record, _) = Record::decode(key.value(), bytes.value())?;
                if record.lease.is_some() {
                    orphans.push(TxnOp::Delete {
                        key: key.value().to_owned(),
                    });
                }
            }
        }
        if !orphans.is_empty() {
            let count = orphans.len();
            let mut shared = self.lock();
            let txn = Txn {
                compares: Vec::new(),
                ops: orphans,
            };
            self.apply_one(&mut shared, txn)?;
            tracing::info!(
                store = %self.inner.location,
                keys = count,
                "deleted keys whose leases ended with the previous process"
            );
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // A panic while holding the lock cannot leave the database half-written
        // (redb transactions are atomic), so the in-memory state is still usable.
        self.inner
            .shared
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn db_err(&self, e: impl Into<redb::Error>) -> StateError {
        StateError::Embedded {
            path: self.inner.location.clone(),
            reason: e.into().to_string(),
        }
    }

    fn read_record(&self, key: &str) -> Result<Option<KeyValue>> {
        let txn = self.inner.db.begin_read().map_err(|e| self.db_err(e))?;
        let table = txn.open_table(KV).map_err(|e| self.db_err(e))?;
        match table.get(key).map_err(|e| self.db_err(e))? {
            Some(bytes) => {
                let (record, value) = Record::decode(key, bytes.value())?;
                Ok(self
                    .visible(&record)
                    .then(|| record.into_kv(key.to_owned(), value)))
            }
            None => Ok(None),
        }
    }

    /// Whether a record is part of the store's state: in a read-only store, keys of
    /// leases are not (their process is gone; see [`EmbeddedStore::open_read_only`]).
    fn visible(&self, record: &Record) -> bool {
        !(self.is_read_only() && record.lease.is_some())
    }

    /// Applies one transaction on its own (one commit).
    fn apply_one(&self, shared: &mut Shared, txn: Txn) -> Result<Applied> {
        let mut results = self.apply_batch(shared, vec![txn])?;
        results.pop().unwrap_or_else(|| {
            Err(StateError::Embedded {
                path: self.inner.location.clone(),
                reason: "a batch of one transaction produced no outcome".into(),
            })
        })
    }

    /// Applies `txns` in order in ONE redb write transaction, i.e. one durable
    /// commit; each committed transaction gets its own revision, and each one's
    /// comparisons are evaluated against the state the earlier ones left (reads
    /// inside a redb write transaction see its own uncommitted writes), exactly as
    /// if they had been committed one by one. Events are recorded, lease
    /// bookkeeping updated and watchers told only once the commit is durable.
    ///
    /// The outer error means the commit itself failed: nothing of the batch was
    /// written. An inner error (a duplicate key, a lease that is gone, a corrupt
    /// record among the keys a transaction reads) fails that transaction only,
    /// before it wrote anything.
    fn apply_batch(&self, shared: &mut Shared, txns: Vec<Txn>) -> Result<Vec<Result<Applied>>> {
        let mut revision = shared.revision;
        let mut results = Vec::with_capacity(txns.len());
        let mut events: Vec<WatchEvent> = Vec::new();
        // Lease bookkeeping is only touched after the commit succeeded.
        let mut lease_moves: Vec<LeaseMove> = Vec::new();
        let mut oldest = shared.oldest_event_revision;
        let Db::Writable(db) = &self.inner.db else {
            return Err(self.read_only());
        };
        let write = db.begin_write().map_err(|e| self.db_err(e))?;
        {
            let mut kv = write.open_table(KV).map_err(|e| self.db_err(e))?;
            let mut log = write.open_table(EVENTS).map_err(|e| self.db_err(e))?;
            for txn in txns {
                let prepared = match self.prepare(shared, &kv, txn) {
                    Ok(Ok(prepared)) => prepared,
                    Ok(Err(current)) => {
                        results.push(Ok(Applied {
                            outcome: TxnOutcome::Failed { current },
                            changed: false,
                        }));
                        continue;
                    }
                    Err(err) => {
                        results.push(Err(err));
                        continue;
                    }
                };
                let at = revision + 1;
                let changed = self.write_ops(
                    &mut kv,
                    &mut log,
                    prepared,
                    at,
                    &mut events,
                    &mut lease_moves,
                )?;
                if changed {
                    revision = at;
                }
                results.push(Ok(Applied {
                    outcome: TxnOutcome::Committed { revision },
                    changed,
                }));
            }
            if revision == shared.revision {
                drop((kv, log));
                write.abort().map_err(|e| self.db_err(e))?;
                return Ok(results);
            }
            let mut meta = write.open_table(META).map_err(|e| self.db_err(e))?;
            meta.insert(META_REVISION, revision)
                .map_err(|e| self.db_err(e))?;
            oldest = self.trim_history(&mut log, &mut meta, revision, oldest)?;
        }
        write.commit().map_err(|e| self.db_err(e))?;
        self.inner
            .commits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        shared.revision = revision;
        shared.oldest_event_revision = oldest;
        publish(shared, lease_moves, &events);
        Ok(results)
    }

    /// Writes one prepared transaction's operations at revision `at` into `kv` and the
    /// event `log`, noting the events and lease moves for after the commit; returns
    /// whether any operation changed something.
    fn write_ops(
        &self,
        kv: &mut redb::Table<'_, &'static str, &'static [u8]>,
        log: &mut redb::Table<'_, (i64, u32), &'static [u8]>,
        prepared: Prepared,
        at: Revision,
        events: &mut Vec<WatchEvent>,
        lease_moves: &mut Vec<LeaseMove>,
    ) -> Result<bool> {
        let mut index = 0u32;
        for (op, previous) in prepared.ops {
            let event = match op {
                TxnOp::Put { key, value, lease } => {
                    let record = Record {
                        create_revision: previous.map_or(at, |p| p.create_revision),
                        mod_revision: at,
                        version: previous.map_or(1, |p| p.version + 1),
                        lease,
                    };
                    kv.insert(key.as_str(), record.encode(&value).as_slice())
                        .map_err(|e| self.db_err(e))?;
                    lease_moves.push((key.clone(), previous.and_then(|p| p.lease), lease));
                    WatchEvent::Put(record.into_kv(key, value))
                }
                TxnOp::Delete { key } => {
                    let Some(previous) = previous else {
                        continue; // deleting an absent key changes nothing
                    };
                    kv.remove(key.as_str()).map_err(|e| self.db_err(e))?;
                    lease_moves.push((key.clone(), previous.lease, None));
                    WatchEvent::Delete { key, revision: at }
                }
            };
            log.insert((at, index), encode_event(&event).as_slice())
                .map_err(|e| self.db_err(e))?;
            index += 1;
            events.push(event);
        }
        Ok(index > 0)
    }

    /// Trims the event history to the last `history_revisions` before `revision`, in
    /// batches so the cost is amortised over many writes; returns the oldest revision
    /// kept (`oldest` when it did not trim).
    fn trim_history(
        &self,
        log: &mut redb::Table<'_, (i64, u32), &'static [u8]>,
        meta: &mut redb::Table<'_, &'static str, i64>,
        revision: Revision,
        oldest: Revision,
    ) -> Result<Revision> {
        let keep_from = revision - self.inner.history_revisions + 1;
        if keep_from - oldest < (self.inner.history_revisions / 10).max(1) {
            return Ok(oldest);
        }
        let stale: Vec<(i64, u32)> = log
            .range(..(keep_from, 0))
            .map_err(|e| self.db_err(e))?
            .map(|entry| entry.map(|(k, _)| k.value()))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| self.db_err(e))?;
        for key in stale {
            log.remove(key).map_err(|e| self.db_err(e))?;
        }
        meta.insert(META_OLDEST, keep_from)
            .map_err(|e| self.db_err(e))?;
        Ok(keep_from)
    }

    /// Checks `txn` against the state in `kv` (which includes the earlier
    /// transactions of the batch): `Ok(Ok(_))` with the records its operations
    /// replace when every comparison holds, `Ok(Err(current))` with the compared
    /// keys' values when one does not.
    fn prepare(
        &self,
        shared: &Shared,
        kv: &redb::Table<&str, &[u8]>,
        txn: Txn,
    ) -> Result<std::result::Result<Prepared, Vec<Option<KeyValue>>>> {
        txn.check()?;
        let read = |key: &str| -> Result<Option<(Record, Vec<u8>)>> {
            match kv.get(key).map_err(|e| self.db_err(e))? {
                Some(bytes) => Ok(Some(Record::decode(key, bytes.value())?)),
                None => Ok(None),
            }
        };
        let mut current = Vec::with_capacity(txn.compares.len());
        let mut holds = true;
        for compare in &txn.compares {
            let found = read(&compare.key)?.map(|(r, v)| r.into_kv(compare.key.clone(), v));
            holds &= Txn::holds(compare.expect, found.as_ref());
            current.push(found);
        }
        if !holds {
            return Ok(Err(current));
        }
        let mut ops = Vec::with_capacity(txn.ops.len());
        for op in txn.ops {
            if let TxnOp::Put {
                lease: Some(lease), ..
            } = &op
            {
                Self::check_lease(shared, Some(*lease))?;
            }
            let previous = read(op.key())?.map(|(record, _)| record);
            ops.push((op, previous));
        }
        Ok(Ok(Prepared { ops }))
    }

    /// Ends `lease` now: deletes its keys at one revision and forgets it.
    fn end_lease(&self, shared: &mut Shared, lease: LeaseId) -> Result<()> {
        if let Some(state) = shared.leases.remove(&lease) {
            let count = state.keys.len();
            let ops = state
                .keys
                .into_iter()
                .map(|key| TxnOp::Delete { key })
                .collect();
            let txn = Txn {
                compares: Vec::new(),
                ops,
            };
            self.apply_one(shared, txn)?;
            tracing::debug!(store = %self.inner.location, %lease, keys = count, "lease ended");
        }
        Ok(())
    }

    /// Applies `txn` durably (one commit) and returns what it did.
    ///
    /// The transaction goes to the group-commit writer and this waits for its
    /// outcome, which arrives only once the commit that carried it is durable. The
    /// caller's thread never blocks on the disk, so an async runtime keeps serving
    /// other requests meanwhile (they queue up behind the commit and share the next).
    async fn submit(&self, txn: Txn) -> Result<Applied> {
        if self.is_read_only() {
            return Err(self.read_only());
        }
        let (reply, outcome) = tokio::sync::oneshot::channel();
        self.owner
            .as_ref()
            .and_then(|owner| owner.writer.as_ref())
            .ok_or_else(|| self.impossible("a write through a background handle"))?
            .send(WriteRequest { txn, reply })
            .map_err(|_| self.impossible("the writer thread has stopped"))?;
        outcome
            .await
            .map_err(|_| self.impossible("the writer thread dropped a transaction"))?
    }

    fn read_only(&self) -> StateError {
        StateError::Embedded {
            path: self.inner.location.clone(),
            reason: "opened read-only: writes are refused".into(),
        }
    }

    fn impossible(&self, what: &str) -> StateError {
        StateError::Embedded {
            path: self.inner.location.clone(),
            reason: format!("internal error: {what}"),
        }
    }

    fn check_lease(shared: &Shared, lease: Option<LeaseId>) -> Result<()> {
        match lease {
            Some(id) if !shared.leases.contains_key(&id) => Err(StateError::LeaseNotFound(id)),
            _ => Ok(()),
        }
    }

    fn reap_expired(&self) {
        let mut shared = self.lock();
        let now = Instant::now();
        let expired: Vec<LeaseId> = shared
            .leases
            .iter()
            .filter(|(_, s)| s.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for lease in expired {
            if let Err(err) = self.end_lease(&mut shared, lease) {
                tracing::error!(store = %self.inner.location, %lease, %err, "could not expire lease");
            }
        }
    }
}

/// Opens the file, retrying "already open" for a moment.
///
/// Why: the lease reaper thread briefly holds a strong handle while it works, so a
/// store dropped and reopened at once in this process (a restart of a component)
/// can find the previous handle not yet released. Another process holding the
/// file still fails, just [`OPEN_RETRY`] later.
fn open_retrying_briefly<D>(
    mut open: impl FnMut() -> std::result::Result<D, redb::DatabaseError>,
) -> std::result::Result<D, redb::DatabaseError> {
    let deadline = Instant::now() + OPEN_RETRY;
    loop {
        match open() {
            Err(redb::DatabaseError::DatabaseAlreadyOpen) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

/// Opens the file at `path`, which needs a repair, with the repair's writes kept in
/// memory (see [`overlay`]): the file is only read.
fn repaired_in_memory(path: &Path) -> std::result::Result<Db, String> {
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read the file: {e}"))?;
    let layer =
        overlay::CopyOnWrite::new(file).map_err(|e| format!("cannot read the file: {e}"))?;
    Database::builder()
        .create_with_backend(layer)
        .map(Db::Repaired)
        .map_err(|e| {
            format!(
                "{e} (the store was not closed cleanly and cannot be repaired, even in memory: \
                 the file is damaged or not an iadeep store)"
            )
        })
}

/// How long [`open_retrying_briefly`] keeps trying.
const OPEN_RETRY: Duration = Duration::from_millis(300);

/// Starts the group-commit writer: a thread that takes every transaction queued by
/// [`EmbeddedStore::submit`] while the previous commit was in flight and applies
/// them, in arrival order, in ONE redb write transaction: one fsync for the whole
/// group instead of one per transaction. This is the classic group commit of
/// databases (and what etcd does with its raft batches); each transaction still
/// gets its own revision and its comparisons see what the earlier ones in the
/// group wrote (see [`EmbeddedStore::apply_batch`]), so the outcome is exactly
/// that of committing them one by one in that order. Each caller is answered only
/// after the group's commit returned, i.e. once its write is durable; if the commit
/// fails, every transaction of the group fails and none was written.
///
/// Under light load a group is one transaction and nothing waits for a batch to
/// fill: the writer commits as soon as it has something, and whatever arrives
/// during that commit forms the next group.
///
/// The thread holds the store weakly and stops when the last handle is dropped
/// (the queue's sender lives in the callers' handles' [`Owner`]).
fn spawn_writer(
    inner: Weak<Inner>,
    queue: std::sync::mpsc::Receiver<WriteRequest>,
) -> Result<std::thread::JoinHandle<()>> {
    let location = inner
        .upgrade()
        .map(|i| i.location.clone())
        .unwrap_or_default();
    std::thread::Builder::new()
        .name("iadeep-store-writer".into())
        .spawn(move || {
            // Ends when the last caller's handle drops the queue's sender.
            while let Ok(first) = queue.recv() {
                let mut group = vec![first];
                while group.len() < MAX_GROUP_COMMIT {
                    match queue.try_recv() {
                        Ok(next) => group.push(next),
                        Err(_) => break,
                    }
                }
                let Some(inner) = inner.upgrade() else {
                    return;
                };
                let store = EmbeddedStore { owner: None, inner };
                let (txns, replies): (Vec<Txn>, Vec<_>) =
                    group.into_iter().map(|r| (r.txn, r.reply)).unzip();
                let size = txns.len();
                let results = {
                    let mut shared = store.lock();
                    contain(&store.inner.location, "committing", || {
                        store.apply_batch(&mut shared, txns)
                    })
                };
                let location = store.inner.location.clone();
                // Released before anyone is answered: see `Owner`.
                drop(store);
                match results {
                    Ok(results) => {
                        tracing::trace!(store = %location, size, "group committed");
                        for (reply, result) in replies.into_iter().zip(results) {
                            // A caller that gave up waiting does not stop the others.
                            let _ = reply.send(result);
                        }
                    }
                    Err(err) => {
                        tracing::error!(store = %location, size, %err,
                            "group commit failed; none of its transactions was written");
                        for reply in replies {
                            let _ = reply.send(Err(StateError::Embedded {
                                path: location.clone(),
                                reason: format!("commit failed: {err}"),
                            }));
                        }
                    }
                }
            }
        })
        .map_err(|e| StateError::Embedded {
            path: location,
            reason: format!("cannot start the writer thread: {e}"),
        })
}

/// A thread (not a task, so the store works under any runtime or none) that
/// expires leases. It stops once the last handle to the store is dropped.
fn spawn_lease_reaper(
    inner: Weak<Inner>,
    stop: Arc<AtomicBool>,
) -> Option<std::thread::JoinHandle<()>> {
    let spawned = std::thread::Builder::new()
        .name("iadeep-lease-reaper".into())
        .spawn(move || {
            loop {
                // Woken early by `Owner` when the store is dropped.
                std::thread::park_timeout(REAPER_INTERVAL);
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                match inner.upgrade() {
                    Some(inner) => {
                        let store = EmbeddedStore { owner: None, inner };
                        let expired = contain(&store.inner.location, "expiring leases", || {
                            store.reap_expired();
                            Ok(())
                        });
                        if let Err(err) = expired {
                            tracing::error!(%err, "could not expire leases");
                        }
                    }
                    None => return,
                }
            }
        });
    match spawned {
        Ok(thread) => Some(thread),
        Err(err) => {
            tracing::error!(%err, "could not start the lease reaper: leases will only expire on keep-alive");
            None
        }
    }
}

#[async_trait]
impl StateStore for EmbeddedStore {
    fn describe(&self) -> String {
        format!("embedded store {}", self.inner.location)
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        contain(&self.inner.location, "reading", || self.read_record(key))
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        let txn = Txn::new().put(key, value, lease);
        match self.submit(txn).await?.outcome {
            TxnOutcome::Committed { revision } => Ok(revision),
            TxnOutcome::Failed { .. } => Err(self.impossible("a put without comparisons failed")),
        }
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.submit(Txn::new().delete(key)).await?.changed)
    }

    async fn transact(&self, txn: Txn) -> Result<TxnOutcome> {
        Ok(self.submit(txn).await?.outcome)
    }

    async fn range(&self, prefix: &str) -> Result<RangeSnapshot> {
        contain(&self.inner.location, "reading", || self.read_range(prefix))
    }

    async fn range_page(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<RangePage> {
        contain(&self.inner.location, "reading", || {
            self.read_page(prefix, after, limit.max(1))
        })
    }

    /// Nothing to do: the store keeps its last `history_revisions` by itself.
    async fn compact(&self, _revision: Revision) -> Result<()> {
        Ok(())
    }

    async fn watch(&self, prefix: &str, start_revision: Option<Revision>) -> Result<WatchStream> {
        contain(&self.inner.location, "replaying history", || {
            self.start_watch(prefix, start_revision)
        })
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        let ttl = Duration::from_secs(lease_ttl_secs(ttl)?.unsigned_abs());
        let mut shared = self.lock();
        let id = LeaseId(shared.next_lease);
        shared.next_lease += 1;
        shared.leases.insert(
            id,
            LeaseState {
                ttl,
                deadline: Instant::now() + ttl,
                keys: BTreeSet::new(),
            },
        );
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration> {
        contain(&self.inner.location, "expiring a lease", || {
            self.refresh_lease(lease)
        })
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        contain(&self.inner.location, "revoking a lease", || {
            let mut shared = self.lock();
            self.end_lease(&mut shared, lease)
        })
    }
}

/// The bodies of the trait's calls that touch redb, each run inside [`contain`].
impl EmbeddedStore {
    fn read_range(&self, prefix: &str) -> Result<RangeSnapshot> {
        // Holding the write lock while reading pins the revision to the snapshot.
        let shared = self.lock();
        let txn = self.inner.db.begin_read().map_err(|e| self.db_err(e))?;
        let revision = shared.revision;
        drop(shared);
        let table = txn.open_table(KV).map_err(|e| self.db_err(e))?;
        let mut kvs = Vec::new();
        for entry in table.range::<&str>(prefix..).map_err(|e| self.db_err(e))? {
            let (key, bytes) = entry.map_err(|e| self.db_err(e))?;
            let key = key.value();
            if !key.starts_with(prefix) {
                break;
            }
            let (record, value) = Record::decode(key, bytes.value())?;
            if self.visible(&record) {
                kvs.push(record.into_kv(key.to_owned(), value));
            }
        }
        Ok(RangeSnapshot { kvs, revision })
    }

    fn read_page(&self, prefix: &str, after: Option<&str>, limit: usize) -> Result<RangePage> {
        let shared = self.lock();
        let txn = self.inner.db.begin_read().map_err(|e| self.db_err(e))?;
        let revision = shared.revision;
        drop(shared);
        let table = txn.open_table(KV).map_err(|e| self.db_err(e))?;
        let start = match after {
            Some(after) if after >= prefix => after,
            _ => prefix,
        };
        let mut kvs = Vec::new();
        let mut more = false;
        for entry in table.range::<&str>(start..).map_err(|e| self.db_err(e))? {
            let (key, bytes) = entry.map_err(|e| self.db_err(e))?;
            let key = key.value();
            if !key.starts_with(prefix) {
                break;
            }
            if after == Some(key) {
                continue;
            }
            let (record, value) = Record::decode(key, bytes.value())?;
            if !self.visible(&record) {
                continue;
            }
            if kvs.len() == limit {
                more = true;
                break;
            }
            kvs.push(record.into_kv(key.to_owned(), value));
        }
        Ok(RangePage {
            kvs,
            revision,
            more,
        })
    }

    fn start_watch(&self, prefix: &str, start_revision: Option<Revision>) -> Result<WatchStream> {
        let (tx, stream) = WatchStream::unbounded();
        let mut shared = self.lock();
        if let Some(start) = start_revision.filter(|&s| s <= shared.revision) {
            if start < shared.oldest_event_revision {
                return Err(StateError::Compacted {
                    prefix: prefix.to_owned(),
                    requested: start,
                    oldest: shared.oldest_event_revision,
                });
            }
            let txn = self.inner.db.begin_read().map_err(|e| self.db_err(e))?;
            let log = txn.open_table(EVENTS).map_err(|e| self.db_err(e))?;
            for entry in log.range((start, 0)..).map_err(|e| self.db_err(e))? {
                let (key, bytes) = entry.map_err(|e| self.db_err(e))?;
                let event = decode_event(key.value().0, bytes.value())?;
                if event.key().starts_with(prefix) && tx.send(Ok(event)).is_err() {
                    break;
                }
            }
        }
        shared.watchers.push(Watcher {
            prefix: prefix.to_owned(),
            min_revision: start_revision.unwrap_or(0),
            tx,
        });
        Ok(stream)
    }

    fn refresh_lease(&self, lease: LeaseId) -> Result<Duration> {
        let mut shared = self.lock();
        let now = Instant::now();
        match shared.leases.get_mut(&lease) {
            Some(state) if state.deadline > now => {
                state.deadline = now + state.ttl;
                Ok(state.ttl)
            }
            Some(_) => {
                // Expired but not reaped yet: it is gone all the same.
                self.end_lease(&mut shared, lease)?;
                Err(StateError::LeaseNotFound(lease))
            }
            None => Err(StateError::LeaseNotFound(lease)),
        }
    }
}

/// The first bytes of every redb file (redb's own magic number, which it does not
/// export): how a file that is not a store is told apart before redb touches it.
const REDB_MAGIC: [u8; 9] = [b'r', b'e', b'd', b'b', 0x1A, 0x0A, 0xA9, 0x0D, 0x0A];

/// Whether a store file exists at `path`; an error (the reason) when something is
/// there that is not a redb file: a directory, an empty file, anything else.
///
/// Why an empty file is refused rather than initialised: it is what a full disk or
/// a truncation leaves behind, and starting afresh there would silently drop the
/// cluster's state; an operator who wants a new store deletes the file.
fn check_existing_file(path: &Path) -> std::result::Result<bool, String> {
    use std::io::Read;
    let meta = match std::fs::metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(format!("cannot inspect the file: {e}")),
    };
    if meta.is_dir() {
        return Err("is a directory, not a store file".into());
    }
    if meta.len() == 0 {
        return Err(
            "the file is empty (0 bytes), not an iadeep store; refusing to start a new store \
             over it (delete it to start afresh)"
                .into(),
        );
    }
    let mut head = [0u8; REDB_MAGIC.len()];
    let read = std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut head))
        .map_err(|e| format!("cannot read the file: {e}"));
    match read {
        Ok(()) if head == REDB_MAGIC => Ok(true),
        Ok(()) | Err(_) => Err(
            "not an iadeep store (not a redb database file); refusing to open or overwrite it"
                .into(),
        ),
    }
}

/// The current revision and the oldest one kept in the history (a new store's defaults).
fn read_counters(
    meta: &impl ReadableTable<&'static str, i64>,
) -> std::result::Result<(i64, i64), redb::StorageError> {
    let read = |name: &str| -> std::result::Result<Option<i64>, redb::StorageError> {
        Ok(meta.get(name)?.map(|g| g.value()))
    };
    Ok((
        read(META_REVISION)?.unwrap_or(0),
        read(META_OLDEST)?.unwrap_or(1),
    ))
}

/// Checks that a database holds iadeep's tables (the reason when it does not).
fn check_tables(txn: &redb::ReadTransaction) -> std::result::Result<(), String> {
    let tables: Vec<String> = txn
        .list_tables()
        .map_err(|e| e.to_string())?
        .map(|t| t.name().to_owned())
        .collect();
    for table in [KV.name(), EVENTS.name(), META.name()] {
        if !tables.iter().any(|t| t == table) {
            return Err(format!(
                "a redb database without iadeep's table {table:?}: not an iadeep store \
                 (refusing to write into it)"
            ));
        }
    }
    Ok(())
}

/// Runs `work`, which calls into redb, turning a panic into an error.
///
/// Why: redb trusts its file; on corrupt pages some of its code paths panic
/// instead of returning an error. A damaged file must be reported as one (and a
/// daemon keep serving what it can), never abort the process, so every call into
/// redb from the store's public surface goes through here.
fn contain<T>(location: &str, what: &str, work: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        tracing::error!(store = %location, what, %message, "redb panicked: the store file is damaged");
        Err(StateError::Embedded {
            path: location.to_owned(),
            reason: format!(
                "the file is damaged ({what} failed inside redb: {message}); restore it from a \
                 backup or move it aside to start a new store"
            ),
        })
    })
}

/// The default location of the embedded store: `$XDG_DATA_HOME/iadeep/state.redb`
/// (or the platform's data directory), falling back to `./.iadeep/state.redb`.
pub fn default_path() -> PathBuf {
    data_dir().join("state.redb")
}

/// iadeep's folder in the user's data directory (`$XDG_DATA_HOME/iadeep`, or the
/// platform's equivalent), falling back to `./.iadeep`: where local state lives by
/// default (the embedded store, `iadeep up`'s cluster).
pub fn data_dir() -> PathBuf {
    dirs::data_dir()
        .map(|d| d.join("iadeep"))
        .unwrap_or_else(|| PathBuf::from(".iadeep"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Expect;

    #[test]
    fn records_round_trip_and_reject_garbage() {
        let record = Record {
            create_revision: 3,
            mod_revision: 9,
            version: 4,
            lease: Some(LeaseId(77)),
        };
        let bytes = record.encode(b"hello");
        let (back, value) = Record::decode("k", &bytes).expect("decodes");
        assert_eq!(back, record);
        assert_eq!(value, b"hello");
        assert!(Record::decode("k", &bytes[..5]).is_err());
        let mut wrong_format = bytes.clone();
        wrong_format[0] = 42;
        assert!(Record::decode("k", &wrong_format).is_err());
    }

    /// Transactions queued while a commit is in flight share the next one, and each
    /// is evaluated against what the earlier ones of its group wrote: of many racing
    /// "create if absent", exactly one wins and the others see its value.
    ///
    /// Ordered, not timed: while the test holds the store's lock the writer cannot
    /// commit, and each transaction is polled once, which queues its request before
    /// the poll returns `Pending`; so all of them are queued before the lock is
    /// released, however slow the machine. Each racer is followed by a write that
    /// always commits, so that committing the queue one by one would show in the
    /// count of commits (a racer that loses writes nothing and commits nothing).
    #[tokio::test]
    async fn queued_transactions_share_one_commit_in_order() {
        use std::task::{Context, Poll, Waker};

        /// Hands `txn` to the writer's queue and returns the wait for its outcome.
        fn queue(
            store: &EmbeddedStore,
            txn: Txn,
        ) -> impl Future<Output = Result<TxnOutcome>> + Unpin + '_ {
            let mut outcome = store.transact(txn);
            // The first poll queues the request, then waits for the outcome, which
            // cannot come while the caller holds the store's lock.
            let polled = outcome
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()));
            assert!(matches!(polled, Poll::Pending), "answered under the lock");
            outcome
        }

        const RACERS: usize = 16;
        let dir = tempfile::tempdir().expect("temp dir");
        let store = EmbeddedStore::open(dir.path().join("s.redb")).expect("open");
        store.put("/g/warm", vec![], None).await.expect("put");
        let before = store.durable_commits();
        let mut racers = Vec::new();
        let mut writes = Vec::new();
        {
            // Holding the store's lock stalls the writer, so everything queues up.
            let _stall = store.lock();
            for i in 0..RACERS {
                let race = Txn::new()
                    .compare("/g/k", Expect::Absent)
                    .put("/g/k", vec![u8::try_from(i).expect("small")], None)
                    .put(format!("/g/by/{i}"), vec![], None);
                racers.push(queue(&store, race));
                writes.push(queue(
                    &store,
                    Txn::new().put(format!("/g/plain/{i}"), vec![], None),
                ));
            }
            assert_eq!(store.durable_commits(), before, "committed under the lock");
        }
        let mut winners = Vec::new();
        for (i, racer) in racers.into_iter().enumerate() {
            match racer.await.expect("transact") {
                TxnOutcome::Committed { revision } => winners.push((i, revision)),
                TxnOutcome::Failed { current } => {
                    let kv = current[0].as_ref().expect("the winner's value");
                    assert_eq!(kv.version, 1);
                }
            }
        }
        for write in writes {
            assert!(write.await.expect("transact").committed());
        }
        assert_eq!(winners.len(), 1, "{winners:?}");
        let (winner, revision) = winners[0];
        let kv = store.get("/g/k").await.expect("get").expect("k");
        assert_eq!((kv.value, kv.mod_revision), (vec![winner as u8], revision));
        assert_eq!(store.range("/g/by/").await.expect("range").kvs.len(), 1);
        let plain = store.range("/g/plain/").await.expect("range").kvs.len();
        assert_eq!(plain, RACERS);
        // The writer may have taken the first few requests before it blocked on the
        // lock (one group), and takes all the others at once after (a second).
        let commits = store.durable_commits() - before;
        assert!(
            commits <= 2,
            "{} queued transactions took {commits} commits",
            2 * RACERS
        );
    }

    #[test]
    fn events_round_trip() {
        let put = WatchEvent::Put(KeyValue {
            key: "/a".into(),
            value: vec![1, 2],
            create_revision: 1,
            mod_revision: 5,
            version: 2,
            lease: None,
        });
        assert_eq!(decode_event(5, &encode_event(&put)).ok(), Some(put));
        let del = WatchEvent::Delete {
            key: "/b".into(),
            revision: 6,
        };
        assert_eq!(decode_event(6, &encode_event(&del)).ok(), Some(del));
        assert!(decode_event(6, &[1, 200, 0, 0, 0]).is_err());
    }
}
