//! [`FaultStore`]: a [`StateStore`] wrapper that injects the faults a real store shows,
//! on a script, so a test can say exactly which call fails and how.
//!
//! One wrapper for every crate's tests, instead of one hand-written `StateStore` impl
//! per test module: the failures worth testing are few (a call that never reached the
//! store, a write whose answer was lost, the etcd client's re-send of an unanswered
//! request, a call still in flight while others queue, a write that lands between a
//! caller's read and its commit) and each is easy to get subtly wrong.
//!
//! Everything is ordered by events, never by time: a held call waits for
//! [`FaultStore::release`], and a test waits for it to be held with
//! [`FaultStore::until_holding`]. In virtual time (`start_paused`), put a timeout only
//! around waits that involve no store work, such as `until_holding`: the embedded store
//! works on its own thread, and paused time runs out while it does.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;

use crate::{
    EmbeddedStore, KeyValue, LeaseId, RangePage, RangeSnapshot, Result, Revision, StateError,
    StateStore, Txn, TxnOutcome, WatchStream,
};

/// The store calls a [`FaultStore`] can script faults for, one per [`StateStore`] method
/// it forwards (`compare_and_swap` and `compare_and_delete` are transactions).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Get,
    Put,
    Delete,
    Transact,
    Range,
    RangePage,
    Compact,
    Watch,
    GrantLease,
    KeepAlive,
    RevokeLease,
}

impl Op {
    /// Every op, in declaration order (the index of each op's counters).
    pub const ALL: [Op; 11] = [
        Op::Get,
        Op::Put,
        Op::Delete,
        Op::Transact,
        Op::Range,
        Op::RangePage,
        Op::Compact,
        Op::Watch,
        Op::GrantLease,
        Op::KeepAlive,
        Op::RevokeLease,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// What happens to a call a fault is scripted for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The call fails before it reaches the store, which is left untouched: an
    /// unreachable store, a refused connection.
    Fail,
    /// The call reaches the store and takes effect, then fails: its answer was lost (a
    /// member that stopped answering after it committed), so the caller cannot tell
    /// whether it took effect.
    LoseAnswer,
    /// The call is sent twice: the first attempt takes effect and its answer is lost,
    /// and the caller gets the second attempt's answer, as the etcd client's re-send of
    /// an unanswered request gives. The second attempt sees the first one's effect (a
    /// re-sent transaction finds its own writes, a re-sent delete finds nothing).
    Resend,
}

/// How many calls a scripted fault applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Times {
    Next(usize),
    UntilCleared,
}

/// The faults of one op, the first applying to its next call.
type Script = VecDeque<(Fault, Times)>;

#[derive(Debug, Default)]
struct Scripted {
    faults: [Script; Op::ALL.len()],
    /// How many of the next calls of each op are held.
    holds: [usize; Op::ALL.len()],
    /// A put made just before the next transaction reaches the store.
    put_before_transaction: Option<(String, Vec<u8>)>,
    /// The transactions that reached the store, in order.
    sent: Vec<Txn>,
}

/// A [`StateStore`] that forwards every call to an inner store, with the faults a test
/// scripts: fail the next `n` calls of an op ([`FaultStore::fail_next`]), or lose their
/// answers or re-send them ([`FaultStore::inject`]), until cleared if asked
/// ([`FaultStore::inject_until_cleared`]); hold calls in flight until released
/// ([`FaultStore::hold_next`]); write a key between a caller's read and its commit
/// ([`FaultStore::put_before_next_transaction`]). It counts every call of each op and
/// keeps the transactions that reached the store.
///
/// Every call yields to the runtime once before it reaches the store, as a real store's
/// round trip does, so concurrent callers queue behind it (what a group commit needs to
/// be seen merging). Faults are taken after a held call is released, so a fault
/// scripted while a call is held applies to it.
#[derive(Debug)]
pub struct FaultStore {
    inner: Arc<dyn StateStore>,
    scripted: Mutex<Scripted>,
    calls: [AtomicUsize; Op::ALL.len()],
    /// Permits for held calls: each [`FaultStore::release`] lets one more go on.
    open: tokio::sync::Semaphore,
    /// How many calls are held right now.
    holding: tokio::sync::watch::Sender<usize>,
    /// How many calls were held so far.
    held: AtomicUsize,
}

impl FaultStore {
    /// Over a fresh in-memory embedded store, with nothing scripted; panics when the
    /// store cannot be created, because a test cannot go on without its store.
    pub fn in_memory() -> FaultStore {
        let store = EmbeddedStore::in_memory()
            .unwrap_or_else(|err| panic!("cannot create an in-memory store: {err}"));
        FaultStore::over(Arc::new(store))
    }

    /// Over `inner` (an etcd store, a shared embedded one), with nothing scripted.
    pub fn over(inner: Arc<dyn StateStore>) -> FaultStore {
        FaultStore {
            inner,
            scripted: Mutex::default(),
            calls: Default::default(),
            open: tokio::sync::Semaphore::new(0),
            holding: tokio::sync::watch::Sender::new(0),
            held: AtomicUsize::new(0),
        }
    }

    /// The wrapped store: reads and writes through it bypass every fault and count.
    pub fn inner(&self) -> &Arc<dyn StateStore> {
        &self.inner
    }

    /// A panic in one test thread must not hide the script from the assertions after it.
    fn scripted(&self) -> MutexGuard<'_, Scripted> {
        self.scripted.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next `n` calls of `op` fail without reaching the store ([`Fault::Fail`]).
    pub fn fail_next(&self, op: Op, n: usize) {
        self.inject(op, Fault::Fail, n);
    }

    /// The next `n` calls of `op` meet `fault`, after any faults scripted for `op` before.
    pub fn inject(&self, op: Op, fault: Fault, n: usize) {
        if n > 0 {
            self.scripted().faults[op.index()].push_back((fault, Times::Next(n)));
        }
    }

    /// Every call of `op` meets `fault` (once the faults scripted before are used up),
    /// until [`FaultStore::clear`].
    pub fn inject_until_cleared(&self, op: Op, fault: Fault) {
        self.scripted().faults[op.index()].push_back((fault, Times::UntilCleared));
    }

    /// Drops every fault still scripted for `op`; its calls go through again.
    pub fn clear(&self, op: Op) {
        self.scripted().faults[op.index()].clear();
    }

    /// The next `n` calls of `op` wait, before they reach the store, until
    /// [`FaultStore::release`] lets each go on: a call in flight while others queue.
    pub fn hold_next(&self, op: Op, n: usize) {
        self.scripted().holds[op.index()] += n;
    }

    /// Lets `n` held calls go on, the longest held first; a release with no call held
    /// lets the next held call through at once.
    pub fn release(&self, n: usize) {
        self.open.add_permits(n);
    }

    /// Holds no more calls, and lets every call held now go on (a permit left over, when
    /// a held call was going on already, lets a later held call through at once).
    pub fn stop_holding(&self) {
        let mut scripted = self.scripted();
        scripted.holds = Default::default();
        self.open.add_permits(self.holding());
    }

    /// How many calls are held right now.
    pub fn holding(&self) -> usize {
        *self.holding.borrow()
    }

    /// How many calls were held so far, released or not.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    /// Returns once at least `n` calls are held at the same time.
    pub async fn until_holding(&self, n: usize) {
        let mut seen = self.holding.subscribe();
        // The sender lives as long as `self`, so the wait cannot fail.
        let _ = seen.wait_for(|holding| *holding >= n).await;
    }

    /// Writes `value` at `key` just before the next transaction reaches the store (once):
    /// a write that lands between a caller's reads and its commit.
    pub fn put_before_next_transaction(&self, key: impl Into<String>, value: Vec<u8>) {
        self.scripted().put_before_transaction = Some((key.into(), value));
    }

    /// How many calls of `op` were made, whatever became of them.
    pub fn calls(&self, op: Op) -> usize {
        self.calls[op.index()].load(Ordering::SeqCst)
    }

    /// The transactions that reached the store, in order; a re-sent one is kept once, a
    /// failed one ([`Fault::Fail`]) not at all.
    pub fn sent_transactions(&self) -> Vec<Txn> {
        self.scripted().sent.clone()
    }

    /// Counts the call, holds it if asked, yields once, and takes its fault, if any.
    async fn enter(&self, op: Op) -> Option<Fault> {
        self.calls[op.index()].fetch_add(1, Ordering::SeqCst);
        // Counted as holding under the script's lock, so `stop_holding` sees every call
        // it must let go.
        let held = {
            let mut scripted = self.scripted();
            let holds = &mut scripted.holds[op.index()];
            (*holds > 0).then(|| {
                *holds -= 1;
                Held::new(&self.holding)
            })
        };
        if let Some(_held) = held {
            self.held.fetch_add(1, Ordering::SeqCst);
            // The semaphore is never closed, so the acquire cannot fail.
            if let Ok(permit) = self.open.acquire().await {
                permit.forget();
            }
        }
        tokio::task::yield_now().await;
        let mut scripted = self.scripted();
        let script = &mut scripted.faults[op.index()];
        let (fault, times) = *script.front()?;
        match times {
            Times::Next(1) => {
                script.pop_front();
            }
            Times::Next(n) => script[0].1 = Times::Next(n - 1),
            Times::UntilCleared => {}
        }
        Some(fault)
    }

    /// The error a scripted fault answers with.
    fn fault_error(&self, op: Op, fault: Fault) -> StateError {
        let reason = match fault {
            Fault::Fail => "scripted failure before the store",
            _ => "scripted failure: it took effect and its answer was lost",
        };
        StateError::Unavailable {
            endpoints: self.describe(),
            reason: format!("{op:?}: {reason}"),
        }
    }

    /// Runs `op` as scripted: `attempt` sends it to the inner store (twice for a re-send).
    async fn run<'a, T, F>(&'a self, op: Op, attempt: F) -> Result<T>
    where
        F: Fn() -> BoxFuture<'a, Result<T>>,
    {
        let fault = self.enter(op).await;
        self.finish(op, fault, attempt).await
    }

    async fn finish<'a, T, F>(&'a self, op: Op, fault: Option<Fault>, attempt: F) -> Result<T>
    where
        F: Fn() -> BoxFuture<'a, Result<T>>,
    {
        match fault {
            None => attempt().await,
            Some(Fault::Fail) => Err(self.fault_error(op, Fault::Fail)),
            Some(Fault::LoseAnswer) => {
                // Whatever it did stays done; the caller hears only that it failed.
                let _ = attempt().await;
                Err(self.fault_error(op, Fault::LoseAnswer))
            }
            Some(Fault::Resend) => {
                attempt().await?;
                attempt().await
            }
        }
    }
}

/// Counts a held call in [`FaultStore::holding`] until it goes on or is dropped (a caller
/// that gave up on it).
struct Held<'a>(&'a tokio::sync::watch::Sender<usize>);

impl<'a> Held<'a> {
    fn new(holding: &'a tokio::sync::watch::Sender<usize>) -> Held<'a> {
        holding.send_modify(|n| *n += 1);
        Held(holding)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

#[async_trait]
impl StateStore for FaultStore {
    fn describe(&self) -> String {
        format!("fault-injecting {}", self.inner.describe())
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        self.run(Op::Get, || self.inner.get(key)).await
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> Result<Revision> {
        self.run(Op::Put, || self.inner.put(key, value.clone(), lease))
            .await
    }

    async fn delete(&self, key: &str) -> Result<bool> {
        self.run(Op::Delete, || self.inner.delete(key)).await
    }

    async fn transact(&self, txn: Txn) -> Result<TxnOutcome> {
        let fault = self.enter(Op::Transact).await;
        if fault != Some(Fault::Fail) {
            let put_first = {
                let mut scripted = self.scripted();
                scripted.sent.push(txn.clone());
                scripted.put_before_transaction.take()
            };
            if let Some((key, value)) = put_first {
                self.inner.put(&key, value, None).await?;
            }
        }
        self.finish(Op::Transact, fault, || self.inner.transact(txn.clone()))
            .await
    }

    async fn range(&self, prefix: &str) -> Result<RangeSnapshot> {
        self.run(Op::Range, || self.inner.range(prefix)).await
    }

    async fn range_page(
        &self,
        prefix: &str,
        after: Option<&str>,
        limit: usize,
    ) -> Result<RangePage> {
        self.run(Op::RangePage, || {
            self.inner.range_page(prefix, after, limit)
        })
        .await
    }

    async fn compact(&self, revision: Revision) -> Result<()> {
        self.run(Op::Compact, || self.inner.compact(revision)).await
    }

    async fn watch(&self, prefix: &str, start_revision: Option<Revision>) -> Result<WatchStream> {
        self.run(Op::Watch, || self.inner.watch(prefix, start_revision))
            .await
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        self.run(Op::GrantLease, || self.inner.grant_lease(ttl))
            .await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration> {
        self.run(Op::KeepAlive, || self.inner.keep_alive(lease))
            .await
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        self.run(Op::RevokeLease, || self.inner.revoke_lease(lease))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Expect;

    /// Waits until `n` calls are held; in virtual time (`start_paused`), a wait that
    /// nothing will end fails at once instead of hanging the test.
    async fn until_holding(store: &FaultStore, n: usize) {
        tokio::time::timeout(Duration::from_secs(60), store.until_holding(n))
            .await
            .unwrap_or_else(|_| panic!("{n} calls were never held at once"));
    }

    fn create(key: &str) -> Txn {
        Txn::new()
            .compare(key, Expect::Absent)
            .put(key, b"v".to_vec(), None)
    }

    /// `fail_next` fails exactly the next `n` calls of its op, without touching the
    /// store, and no call of another op.
    #[tokio::test]
    async fn the_next_n_calls_of_one_op_fail_before_the_store() {
        let store = FaultStore::in_memory();
        store.fail_next(Op::Put, 2);
        for _ in 0..2 {
            let err = store
                .put("k", b"v".to_vec(), None)
                .await
                .expect_err("fails");
            assert!(matches!(err, StateError::Unavailable { .. }), "{err}");
        }
        assert_eq!(store.get("k").await.expect("get"), None, "nothing written");
        store
            .put("k", b"v".to_vec(), None)
            .await
            .expect("the third goes through");
        assert!(store.get("k").await.expect("get").is_some());
        assert_eq!((store.calls(Op::Put), store.calls(Op::Get)), (3, 2));
    }

    /// A lost answer leaves the write done; the caller sees an error.
    #[tokio::test]
    async fn a_lost_answer_took_effect() {
        let store = FaultStore::in_memory();
        store.inject(Op::Delete, Fault::LoseAnswer, 1);
        store.put("k", b"v".to_vec(), None).await.expect("put");
        store.delete("k").await.expect_err("the answer is lost");
        assert_eq!(store.inner().get("k").await.expect("get"), None);
    }

    /// A re-sent transaction commits once and answers as its second attempt: a create
    /// finds its own write and fails its comparison, as an etcd client's re-send does.
    #[tokio::test]
    async fn a_resent_transaction_commits_once_and_answers_the_second_attempt() {
        let store = FaultStore::in_memory();
        store.inject_until_cleared(Op::Transact, Fault::Resend);
        for key in ["a", "b"] {
            let outcome = store.transact(create(key)).await.expect("transact");
            assert!(
                !outcome.committed(),
                "{key}: the re-send finds the first write"
            );
            let kv = store.get(key).await.expect("get").expect("written");
            assert_eq!(kv.version, 1, "{key} written once");
        }
        store.clear(Op::Transact);
        assert!(store.transact(create("c")).await.expect("c").committed());
        assert_eq!(store.sent_transactions().len(), 3, "each sent once");
    }

    /// Scripted faults apply in order: two failures, then lost answers until cleared.
    #[tokio::test]
    async fn faults_apply_in_the_order_scripted() {
        let store = FaultStore::in_memory();
        store.fail_next(Op::Put, 1);
        store.inject_until_cleared(Op::Put, Fault::LoseAnswer);
        store
            .put("a", b"1".to_vec(), None)
            .await
            .expect_err("fails");
        assert_eq!(store.inner().get("a").await.expect("get"), None);
        for key in ["b", "c"] {
            store.put(key, b"1".to_vec(), None).await.expect_err("lost");
            assert!(
                store.inner().get(key).await.expect("get").is_some(),
                "{key}"
            );
        }
        store.clear(Op::Put);
        store.put("d", b"1".to_vec(), None).await.expect("clear");
    }

    /// A held transaction waits for `release`, others queue meanwhile, and a write
    /// scripted before it lands first; the transactions are kept in the order sent.
    #[tokio::test(start_paused = true)]
    async fn a_held_transaction_waits_for_its_release() {
        let store = Arc::new(FaultStore::in_memory());
        store.hold_next(Op::Transact, 1);
        let first = tokio::spawn({
            let store = store.clone();
            async move { store.transact(create("held")).await }
        });
        until_holding(&store, 1).await;
        assert_eq!((store.holding(), store.held()), (1, 1));
        // Not held: goes through while the first waits.
        assert!(
            store
                .transact(create("free"))
                .await
                .expect("free")
                .committed()
        );
        assert_eq!(store.get("held").await.expect("get"), None);
        store.put_before_next_transaction("held", b"raced".to_vec());
        store.release(1);
        let outcome = first.await.expect("joined").expect("transact");
        assert!(!outcome.committed(), "the write before it won: {outcome:?}");
        assert_eq!(store.holding(), 0);
        let keys: Vec<String> = store
            .sent_transactions()
            .iter()
            .map(|txn| txn.ops[0].key().to_owned())
            .collect();
        assert_eq!(keys, ["free", "held"]);
    }

    /// `stop_holding` lets every held call go on and holds no later one.
    #[tokio::test(start_paused = true)]
    async fn stop_holding_lets_every_held_call_go_on() {
        let store = Arc::new(FaultStore::in_memory());
        store.hold_next(Op::Put, 10);
        let calls: Vec<_> = ["a", "b"]
            .map(|key| {
                let store = store.clone();
                tokio::spawn(async move { store.put(key, b"v".to_vec(), None).await })
            })
            .into();
        until_holding(&store, 2).await;
        store.stop_holding();
        // Not a timeout around the puts themselves: the embedded store works on its own
        // thread, and paused time would run out while it does.
        let mut holding = store.holding.subscribe();
        tokio::time::timeout(Duration::from_secs(60), holding.wait_for(|n| *n == 0))
            .await
            .expect("every held call let go")
            .expect("the store is alive");
        for call in calls {
            call.await.expect("joined").expect("put");
        }
        store.put("c", b"v".to_vec(), None).await.expect("not held");
        assert_eq!((store.holding(), store.held()), (0, 2));
    }

    /// A held call its caller gives up on stops counting as held.
    #[tokio::test(start_paused = true)]
    async fn a_dropped_held_call_is_no_longer_holding() {
        let store = Arc::new(FaultStore::in_memory());
        store.hold_next(Op::Get, 1);
        let call = tokio::spawn({
            let store = store.clone();
            async move { store.get("k").await }
        });
        until_holding(&store, 1).await;
        call.abort();
        assert!(call.await.expect_err("aborted").is_cancelled());
        assert_eq!((store.holding(), store.held()), (0, 1));
    }
}
