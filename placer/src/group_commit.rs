//! Group commit: the transactions of concurrent Place and Release calls that touch
//! different keys go to the store together, as one transaction.
//!
//! Why: each placement and each release is one durable store transaction, and on a
//! replicated etcd a transaction's fixed cost (a gRPC request, a raft proposal, its
//! apply and fsync on every member) dwarfs the few keys it writes; with many requests
//! in flight the members spend their CPU on that overhead, not on the writes.
//! Committing what is queued as one transaction pays the overhead once for all of
//! them, while a request that arrives when nothing is in flight goes out at once.
//!
//! The protocol is unchanged for each request: [`GroupCommit::transact`] answers
//! exactly as [`StateStore::transact`] would for that request's own transaction.
//! - Only transactions with disjoint keys (compared or written) are merged, so the
//!   merged one commits iff every member's comparisons hold, and then commits each
//!   member as if alone at that revision; a request whose keys overlap an earlier
//!   queued one waits for the next round (requests of one key keep their order).
//! - A merged transaction that fails reads back every compared key (the store's
//!   [`TxnOutcome::Failed`]), all at one revision: a member whose own comparison fails
//!   there is answered `Failed` with its own keys' values, exactly what its transaction
//!   alone would have been answered at that revision; the rest are sent again as a
//!   group (so one lost compare does not fail the others). Should no member's
//!   comparison be found failing, or the store answer an error, each member is sent
//!   alone, which is what it would have been without the grouping.
//! - A group holds at most [`MAX_GROUP_OPS`] comparisons and at most that many writes
//!   (etcd refuses a transaction with more than `--max-txn-ops`, 128 by default, of
//!   either) and at most [`MAX_GROUP_BYTES`] of keys and values (etcd's
//!   `--max-request-bytes` is 1.5 MiB by default); a transaction larger than that
//!   alone goes alone, as it did before.
//!
//! Idempotency across the store's own re-sends is the members' as before: the etcd
//! store re-sends a whole (merged) transaction whose answer was lost, and when the
//! lost attempt had committed, the re-sent one fails on every member's comparison and
//! each member finds its own writes (a Place its placement, a Release its marker).

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use iadeep_state::{KeyValue, StateError, StateStore, Txn, TxnOp, TxnOutcome};
use tokio::sync::oneshot;

/// The most comparisons, and separately the most writes, of one merged transaction:
/// etcd's default `--max-txn-ops`.
pub(crate) const MAX_GROUP_OPS: usize = 128;

/// The most bytes of keys and values of one merged transaction, well under etcd's
/// default `--max-request-bytes` (1.5 MiB).
pub(crate) const MAX_GROUP_BYTES: usize = 1 << 20;

type Answer = iadeep_state::Result<TxnOutcome>;

/// What a queued request is told.
enum Reply {
    /// Its transaction's answer.
    Done(Answer),
    /// Commit the queue from now on: the previous committer got its own answer (its
    /// entry was taken off the queue; it queues its transaction again, first).
    Lead,
}

/// A queued transaction and where its answer goes.
struct Pending {
    txn: Txn,
    reply: oneshot::Sender<Reply>,
}

#[derive(Default)]
struct Queue {
    pending: VecDeque<Pending>,
    /// Whether a request is committing the queue (the leader).
    leading: bool,
}

/// The group committer of one placer process (see the module's documentation).
pub(crate) struct GroupCommit {
    store: Arc<dyn StateStore>,
    queue: Mutex<Queue>,
    max_ops: usize,
    max_bytes: usize,
}

impl std::fmt::Debug for GroupCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCommit")
            .field("store", &self.store.describe())
            .field("max_ops", &self.max_ops)
            .finish_non_exhaustive()
    }
}

fn lock(queue: &Mutex<Queue>) -> std::sync::MutexGuard<'_, Queue> {
    // The queue is a plain list; a panic while holding it leaves it consistent.
    queue.lock().unwrap_or_else(|e| e.into_inner())
}

/// Held by the request committing the queue; when it is dropped (the request got its
/// answer, or its caller went away mid-round) the queue's first waiting request leads.
struct Leading<'a> {
    queue: &'a Mutex<Queue>,
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        let mut queue = lock(self.queue);
        while let Some(next) = queue.pending.pop_front() {
            if next.reply.send(Reply::Lead).is_ok() {
                return;
            }
            // That request's caller went away: its transaction goes unsent, as it
            // would have had it not been queued.
        }
        queue.leading = false;
    }
}

impl GroupCommit {
    /// A committer writing to `store`.
    pub(crate) fn new(store: Arc<dyn StateStore>) -> GroupCommit {
        GroupCommit {
            store,
            queue: Mutex::default(),
            max_ops: MAX_GROUP_OPS,
            max_bytes: MAX_GROUP_BYTES,
        }
    }

    /// Commits `txn`, together with whatever else is queued meanwhile, and answers as
    /// [`StateStore::transact`] does for `txn` alone.
    ///
    /// No task of its own: the request that finds nobody committing commits the queue,
    /// round after round, until its own answer is in; then the first request still
    /// queued takes over. So it runs on any executor (the simulator polls the service
    /// on its own), and every request's wait is bounded by the rounds ahead of it.
    /// A request whose round was abandoned (the leader's caller went away mid-round)
    /// sends its transaction again alone, as the store re-sends a transaction whose
    /// answer was lost: the callers tell an earlier commit of their own apart.
    pub(crate) async fn transact(&self, txn: Txn) -> Answer {
        // Refused alone, as the store would refuse it, rather than failing a group.
        txn.check()?;
        let (reply, mut answer) = oneshot::channel();
        let lead = {
            let mut queue = lock(&self.queue);
            queue.pending.push_back(Pending {
                txn: txn.clone(),
                reply,
            });
            !std::mem::replace(&mut queue.leading, true)
        };
        if !lead {
            match (&mut answer).await {
                Ok(Reply::Done(done)) => return done,
                Ok(Reply::Lead) => {
                    let (reply, again) = oneshot::channel();
                    lock(&self.queue).pending.push_front(Pending {
                        txn: txn.clone(),
                        reply,
                    });
                    answer = again;
                }
                Err(_) => return self.store.transact(txn).await,
            }
        }
        let leading = Leading { queue: &self.queue };
        loop {
            let taken: Vec<Pending> = lock(&self.queue).pending.drain(..).collect();
            let (groups, later) = form_groups(taken, self.max_ops, self.max_bytes);
            if !later.is_empty() {
                // Overlapping an earlier request's keys: next round, before newer ones.
                let mut queue = lock(&self.queue);
                for pending in later.into_iter().rev() {
                    queue.pending.push_front(pending);
                }
            }
            // Disjoint from each other too: side by side.
            let store = self.store.as_ref();
            join_all(groups.into_iter().map(|group| commit_group(store, group))).await;
            match answer.try_recv() {
                Ok(Reply::Done(done)) => {
                    drop(leading);
                    return done;
                }
                // Its own transaction waits for the next round (an earlier one shares
                // a key); a leader is never told to lead.
                Ok(Reply::Lead) | Err(oneshot::error::TryRecvError::Empty) => {}
                Err(oneshot::error::TryRecvError::Closed) => {
                    drop(leading);
                    return Err(StateError::Backend {
                        op: "transaction",
                        target: "the placer's group commit".to_owned(),
                        reason: "the transaction was dropped unanswered".to_owned(),
                    });
                }
            }
        }
    }

    /// How many transactions wait for the next round (tests only).
    #[cfg(test)]
    pub(crate) fn queued(&self) -> usize {
        lock(&self.queue).pending.len()
    }
}

/// The keys `txn` compares or writes.
fn keys_of(txn: &Txn) -> impl Iterator<Item = &str> {
    txn.compares
        .iter()
        .map(|c| c.key.as_str())
        .chain(txn.ops.iter().map(TxnOp::key))
}

/// Bytes of keys and values `txn` sends.
fn bytes_of(txn: &Txn) -> usize {
    let values: usize = txn
        .ops
        .iter()
        .map(|op| match op {
            TxnOp::Put { key, value, .. } => key.len() + value.len(),
            TxnOp::Delete { key } => key.len(),
        })
        .sum();
    values + txn.compares.iter().map(|c| c.key.len()).sum::<usize>()
}

/// Splits `taken` (in arrival order) into groups whose members' keys are disjoint
/// from every other taken member's, each within the caps, and those that overlap an
/// earlier one's keys, for the next round.
///
/// A transaction is committed this round only when none of its keys is a key of an
/// earlier taken transaction (committed this round or not): two requests on one key
/// are never in flight together, and keep their order.
fn form_groups(
    taken: Vec<Pending>,
    max_ops: usize,
    max_bytes: usize,
) -> (Vec<Vec<Pending>>, Vec<Pending>) {
    let mut seen: HashSet<String> = HashSet::new();
    let mut groups: Vec<(Vec<Pending>, usize, usize, usize)> = Vec::new();
    let mut later = Vec::new();
    for pending in taken {
        let overlaps = keys_of(&pending.txn).any(|k| seen.contains(k));
        seen.extend(keys_of(&pending.txn).map(str::to_owned));
        if overlaps {
            later.push(pending);
            continue;
        }
        let (compares, ops, bytes) = (
            pending.txn.compares.len(),
            pending.txn.ops.len(),
            bytes_of(&pending.txn),
        );
        let fits = |g: &(Vec<Pending>, usize, usize, usize)| {
            g.1 + compares <= max_ops && g.2 + ops <= max_ops && g.3 + bytes <= max_bytes
        };
        match groups.iter_mut().find(|g| fits(g)) {
            Some(group) => {
                group.0.push(pending);
                group.1 += compares;
                group.2 += ops;
                group.3 += bytes;
            }
            None => groups.push((vec![pending], compares, ops, bytes)),
        }
    }
    (groups.into_iter().map(|g| g.0).collect(), later)
}

/// Commits `group` (disjoint keys) as one transaction, answering each member (see the
/// module's documentation for a failed or refused one).
async fn commit_group(store: &dyn StateStore, mut group: Vec<Pending>) {
    while group.len() > 1 {
        let mut merged = Txn::new();
        for member in &group {
            merged.compares.extend(member.txn.compares.iter().cloned());
            merged.ops.extend(member.txn.ops.iter().cloned());
        }
        tracing::trace!(members = group.len(), "group commit");
        match store.transact(merged).await {
            Ok(TxnOutcome::Committed { revision }) => {
                for member in group {
                    let _ = member
                        .reply
                        .send(Reply::Done(Ok(TxnOutcome::Committed { revision })));
                }
                return;
            }
            Ok(TxnOutcome::Failed { current }) => {
                let (held, lost) = split_losers(group, current);
                if lost == 0 {
                    // Nothing to tell the members apart by: each on its own.
                    return commit_alone(store, held).await;
                }
                group = held;
            }
            Err(err) => {
                tracing::debug!(%err, members = group.len(),
                    "a group commit failed; committing its members one by one");
                return commit_alone(store, group).await;
            }
        }
    }
    commit_alone(store, group).await;
}

/// Answers the members of a failed merged transaction whose own comparisons failed
/// against `current` (every compared key, in the members' order) with `Failed` and
/// their own keys' values; returns the others, and how many were answered.
fn split_losers(group: Vec<Pending>, current: Vec<Option<KeyValue>>) -> (Vec<Pending>, usize) {
    let mut current = current.into_iter();
    let mut held = Vec::new();
    let mut lost = 0;
    for member in group {
        let mine: Vec<Option<KeyValue>> =
            current.by_ref().take(member.txn.compares.len()).collect();
        let holds = mine.len() == member.txn.compares.len()
            && member
                .txn
                .compares
                .iter()
                .zip(&mine)
                .all(|(c, kv)| Txn::holds(c.expect, kv.as_ref()));
        if holds {
            held.push(member);
        } else {
            lost += 1;
            let _ = member
                .reply
                .send(Reply::Done(Ok(TxnOutcome::Failed { current: mine })));
        }
    }
    (held, lost)
}

/// Commits each member as its own transaction, side by side (their keys are disjoint).
async fn commit_alone(store: &dyn StateStore, group: Vec<Pending>) {
    let sends = group.into_iter().map(|member| async move {
        let answer = store.transact(member.txn).await;
        let _ = member.reply.send(Reply::Done(answer));
    });
    join_all(sends).await;
}

/// Awaits every future of `futures` side by side (on the current task).
async fn join_all<F: std::future::Future<Output = ()>>(futures: impl IntoIterator<Item = F>) {
    let mut futures: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    std::future::poll_fn(|cx| {
        futures.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if futures.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_state::Expect;
    use iadeep_state::testing::{FaultStore, Op};

    /// An in-memory store that counts the transactions it is sent, holds them when told.
    fn counting() -> Arc<FaultStore> {
        Arc::new(FaultStore::in_memory())
    }

    /// How many comparisons each transaction the store was sent carried, in order.
    fn compares_sent(store: &FaultStore) -> Vec<usize> {
        store
            .sent_transactions()
            .iter()
            .map(|txn| txn.compares.len())
            .collect()
    }

    /// Yields to the other tasks until `done` says so.
    async fn until(done: impl Fn() -> bool) {
        while !done() {
            tokio::task::yield_now().await;
        }
    }

    /// A transaction that writes `key` iff it is absent.
    fn create(key: &str) -> Txn {
        Txn::new()
            .compare(key, Expect::Absent)
            .put(key, b"v".to_vec(), None)
    }

    fn pending(txn: Txn) -> (Pending, oneshot::Receiver<Reply>) {
        let (reply, answer) = oneshot::channel();
        (Pending { txn, reply }, answer)
    }

    async fn answer(reply: oneshot::Receiver<Reply>) -> Answer {
        match reply.await.expect("answered") {
            Reply::Done(answer) => answer,
            Reply::Lead => panic!("told to lead"),
        }
    }

    /// Three requests in one group, the middle one's comparison stale: it alone is
    /// answered `Failed` (with what its key holds), and the other two commit together,
    /// in one more transaction, at one revision.
    #[tokio::test]
    async fn a_member_whose_compare_fails_does_not_fail_the_others() {
        let store = counting();
        store.put("b", b"there".to_vec(), None).await.expect("put");
        let (a, a_answer) = pending(create("a"));
        let (b, b_answer) = pending(create("b"));
        let (c, c_answer) = pending(create("c"));
        commit_group(store.as_ref(), vec![a, b, c]).await;
        let a = answer(a_answer).await.expect("a");
        let c = answer(c_answer).await.expect("c");
        match (a, c) {
            (TxnOutcome::Committed { revision: ra }, TxnOutcome::Committed { revision: rc }) => {
                assert_eq!(ra, rc, "a and c commit in one transaction")
            }
            other => panic!("a and c must commit: {other:?}"),
        }
        match answer(b_answer).await.expect("b") {
            TxnOutcome::Failed { current } => {
                assert_eq!(current.len(), 1, "only b's own compared keys");
                assert_eq!(
                    current[0].as_ref().map(|kv| kv.value.clone()),
                    Some(b"there".to_vec())
                );
            }
            other => panic!("b's comparison failed: {other:?}"),
        }
        for key in ["a", "c"] {
            assert!(store.get(key).await.expect("get").is_some(), "{key}");
        }
        assert_eq!(
            compares_sent(&store),
            vec![3, 2],
            "the merged three, then a and c together"
        );
    }

    /// Requests on a common key are never merged or in flight together, and the later
    /// waits for the next round in its order; a group stays within etcd's op limit.
    #[test]
    fn overlapping_keys_wait_and_groups_stay_within_the_op_limit() {
        let (first, _a) = pending(create("k"));
        let (second, _b) = pending(create("k"));
        let (other, _c) = pending(create("x"));
        let (groups, later) =
            form_groups(vec![first, second, other], MAX_GROUP_OPS, MAX_GROUP_BYTES);
        assert_eq!(groups.len(), 1);
        let keys: Vec<&str> = groups[0].iter().map(|p| p.txn.ops[0].key()).collect();
        assert_eq!(keys, ["k", "x"]);
        assert_eq!(later.len(), 1, "the second request on k waits");

        let many: Vec<Pending> = (0..300)
            .map(|i| pending(create(&format!("k{i}"))).0)
            .collect();
        let (groups, later) = form_groups(many, MAX_GROUP_OPS, MAX_GROUP_BYTES);
        assert!(later.is_empty());
        assert_eq!(groups.iter().map(Vec::len).sum::<usize>(), 300);
        for group in &groups {
            let compares: usize = group.iter().map(|p| p.txn.compares.len()).sum();
            let ops: usize = group.iter().map(|p| p.txn.ops.len()).sum();
            assert!(
                compares <= MAX_GROUP_OPS && ops <= MAX_GROUP_OPS,
                "{compares} {ops}"
            );
        }
        assert_eq!(groups.len(), 3, "128 + 128 + 44");
    }

    /// Through the committer: requests queued while a commit is in flight go out
    /// together in the next one, and each is answered.
    #[tokio::test]
    async fn requests_queued_during_a_commit_go_out_together() {
        let store = counting();
        let commit = Arc::new(GroupCommit::new(store.clone()));
        let calls: Vec<_> = (0..5)
            .map(|i| {
                let commit = commit.clone();
                tokio::spawn(async move { commit.transact(create(&format!("t{i}"))).await })
            })
            .collect();
        for call in calls {
            let answer = call.await.expect("joined").expect("answered");
            assert!(answer.committed(), "{answer:?}");
        }
        assert_eq!(commit.queued(), 0);
        let sent = compares_sent(&store);
        assert_eq!(sent.iter().sum::<usize>(), 5, "{sent:?}");
        assert!(sent.len() < 5, "merged into fewer transactions: {sent:?}");
    }

    /// The committing request's caller goes away while its round is in flight: the
    /// requests queued behind it are still committed (the next one takes over), and
    /// one of the abandoned round is sent again alone.
    #[tokio::test]
    async fn a_committer_whose_caller_goes_away_hands_the_queue_on() {
        let store = counting();
        let commit = Arc::new(GroupCommit::new(store.clone()));
        store.hold_next(Op::Transact, 1);
        let call = |key: &'static str| {
            let commit = commit.clone();
            tokio::spawn(async move { commit.transact(create(key)).await })
        };
        let gone = call("gone");
        store.until_holding(1).await;
        let waiting = [call("w1"), call("w2")];
        until(|| commit.queued() == 2).await;
        gone.abort();
        assert!(gone.await.expect_err("aborted").is_cancelled());
        for call in waiting {
            let answer = call.await.expect("joined").expect("answered");
            assert!(answer.committed(), "{answer:?}");
        }
        assert!(store.get("gone").await.expect("get").is_none());
        assert_eq!(commit.queued(), 0);

        // Now the leader's round holds two: x (the new leader) and y. x's caller goes
        // away mid-round; y, its round abandoned, is sent again alone.
        store.hold_next(Op::Transact, 1);
        let leader = call("leader");
        until(|| store.held() == 2).await;
        let (x, y) = (call("x"), call("y"));
        until(|| commit.queued() == 2).await;
        store.hold_next(Op::Transact, 1);
        store.release(1);
        assert!(leader.await.expect("joined").expect("leader").committed());
        until(|| store.held() == 3).await;
        x.abort();
        assert!(x.await.expect_err("aborted").is_cancelled());
        let y = y.await.expect("joined").expect("y");
        assert!(y.committed(), "{y:?}");
        assert!(store.get("x").await.expect("get").is_none());
        assert!(store.get("y").await.expect("get").is_some());
        // Nobody is left committing: the next request commits at once.
        assert!(
            commit
                .transact(create("later"))
                .await
                .expect("later")
                .committed()
        );
    }
}
