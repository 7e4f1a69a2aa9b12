//! [`Follow`]: everything under a prefix, then every change to it, for as long as the
//! caller wants, with the lost watches handled once for every component.
//!
//! The loop is etcd's "range, then watch from the snapshot's revision + 1", which never
//! misses nor repeats a change; when the watch fails or the store closes it (history
//! compacted, store unreachable) the follower logs it, waits a [`Backoff`] and reads the
//! prefix afresh, so a consumer is a fold over [`Followed`] items and never writes the
//! loop itself.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::StateError;
use crate::store::{RangeSnapshot, Revision, StateStore, WatchEvent, WatchStream};

/// One item of a [`Follow`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Followed {
    /// Everything under the prefix now: the first item of [`Follow::new`], and the first
    /// after every lost watch. It replaces what the consumer held: a key it had that is
    /// not in the snapshot was deleted meanwhile.
    Snapshot(RangeSnapshot),
    /// One change after the last snapshot or change, in revision order.
    Change(WatchEvent),
}

/// How long a [`Follow`] waits after losing its watch (or failing to read) before it
/// reads the prefix again: `first`, doubling on every failure in a row up to `max`,
/// and `first` again once a watch is open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    max: Duration,
}

impl Backoff {
    /// The same pause after every failure.
    pub const fn fixed(pause: Duration) -> Backoff {
        Backoff {
            first: pause,
            max: pause,
        }
    }

    /// `first`, doubling on every failure in a row up to `max`.
    pub fn doubling(first: Duration, max: Duration) -> Backoff {
        Backoff {
            first,
            max: max.max(first),
        }
    }

    /// The pause after the first failure (and after a success).
    pub fn first(&self) -> Duration {
        self.first
    }

    /// The pause after the next failure in a row, `pause` being the last one.
    pub fn after(&self, pause: Duration) -> Duration {
        pause.saturating_mul(2).min(self.max)
    }
}

impl From<Duration> for Backoff {
    fn from(pause: Duration) -> Backoff {
        Backoff::fixed(pause)
    }
}

/// What the follower does next.
#[derive(Debug)]
enum Phase {
    /// Read the prefix.
    Range,
    /// Open a watch from this revision on (one past the snapshot's).
    Watch {
        from: Revision,
    },
    Watching(WatchStream),
    /// Wait until then, then read the prefix.
    Pause {
        until: Instant,
    },
}

/// Follows a prefix: yields, in order, a snapshot of everything under it and then each
/// change, forever. When the watch fails or the store closes it, it logs the prefix and
/// the error, waits its [`Backoff`] (in tokio time, so a test under
/// `tokio::time::pause()` waits none) and yields a fresh snapshot.
///
/// [`Follow::next`] is cancel-safe: a call dropped before it returns (a `select!` that
/// took another branch) loses no item and restarts no pause.
#[derive(Debug)]
pub struct Follow {
    store: Arc<dyn StateStore>,
    prefix: String,
    backoff: Backoff,
    /// The pause after the next failure.
    pause: Duration,
    phase: Phase,
}

impl Follow {
    /// Follows `prefix`; the first item is a [`Followed::Snapshot`] (read by the first
    /// call to [`Follow::next`], retried after `backoff` while reading fails).
    pub fn new(
        store: Arc<dyn StateStore>,
        prefix: impl Into<String>,
        backoff: impl Into<Backoff>,
    ) -> Follow {
        Follow::starting(store, prefix.into(), backoff.into(), Phase::Range)
    }

    /// Follows `prefix` for a caller that read it itself, at `revision` (one that must
    /// fail when the first read fails, say): the first item is the first change after
    /// that snapshot.
    pub fn after(
        store: Arc<dyn StateStore>,
        prefix: impl Into<String>,
        revision: Revision,
        backoff: impl Into<Backoff>,
    ) -> Follow {
        let phase = Phase::Watch { from: revision + 1 };
        Follow::starting(store, prefix.into(), backoff.into(), phase)
    }

    fn starting(
        store: Arc<dyn StateStore>,
        prefix: String,
        backoff: Backoff,
        phase: Phase,
    ) -> Follow {
        Follow {
            store,
            prefix,
            backoff,
            pause: backoff.first,
            phase,
        }
    }

    /// The prefix followed.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The next snapshot or change. It never fails: a failed read or watch is logged
    /// (with the prefix and the error), waited out and followed by a fresh snapshot.
    pub async fn next(&mut self) -> Followed {
        loop {
            match &mut self.phase {
                Phase::Range => match self.store.range(&self.prefix).await {
                    Ok(snapshot) => {
                        self.phase = Phase::Watch {
                            from: snapshot.revision + 1,
                        };
                        return Followed::Snapshot(snapshot);
                    }
                    Err(err) => self.lost(&err, "cannot read; retrying"),
                },
                Phase::Watch { from } => {
                    let from = *from;
                    match self.store.watch(&self.prefix, Some(from)).await {
                        Ok(stream) => {
                            self.pause = self.backoff.first;
                            self.phase = Phase::Watching(stream);
                        }
                        Err(err) => self.lost(&err, "cannot watch; re-reading"),
                    }
                }
                Phase::Watching(stream) => match stream.next().await {
                    Some(Ok(event)) => return Followed::Change(event),
                    Some(Err(err)) => self.lost(&err, "watch ended; re-reading"),
                    None => {
                        let err = StateError::Backend {
                            op: "watch",
                            target: self.prefix.clone(),
                            reason: "the store closed the watch".to_owned(),
                        };
                        self.lost(&err, "watch ended; re-reading");
                    }
                },
                Phase::Pause { until } => {
                    tokio::time::sleep_until(*until).await;
                    self.phase = Phase::Range;
                }
            }
        }
    }

    /// Logs a failure and schedules the pause before the next read.
    fn lost(&mut self, err: &StateError, what: &str) {
        let pause = self.pause;
        tracing::warn!(prefix = %self.prefix, %err, retry_in = ?pause, "{what}");
        self.pause = self.backoff.after(pause);
        self.phase = Phase::Pause {
            until: Instant::now() + pause,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EmbeddedStore;

    const PAUSE: Duration = Duration::from_millis(500);

    fn memory() -> Arc<EmbeddedStore> {
        Arc::new(EmbeddedStore::in_memory().expect("in-memory store"))
    }

    fn keys_of(snapshot: &RangeSnapshot) -> Vec<&str> {
        snapshot.kvs.iter().map(|kv| kv.key.as_str()).collect()
    }

    async fn snapshot(follow: &mut Follow) -> RangeSnapshot {
        match follow.next().await {
            Followed::Snapshot(snapshot) => snapshot,
            other => panic!("expected a snapshot, got {other:?}"),
        }
    }

    async fn change(follow: &mut Follow) -> WatchEvent {
        match follow.next().await {
            Followed::Change(event) => event,
            other => panic!("expected a change, got {other:?}"),
        }
    }

    /// Nothing more comes: in virtual time the runtime idles, the clock jumps and the
    /// timeout fires (a repeated change would come first).
    async fn nothing_more(follow: &mut Follow) {
        let more = tokio::time::timeout(Duration::from_secs(60), follow.next()).await;
        assert!(more.is_err(), "nothing more was written, yet got {more:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_snapshot_then_each_change_in_order() {
        let store = memory();
        store
            .put("p/a", b"1".to_vec(), None)
            .await
            .expect("store call");
        store
            .put("q/elsewhere", b"x".to_vec(), None)
            .await
            .expect("store call");
        let mut follow = Follow::new(store.clone(), "p/", PAUSE);
        let first = snapshot(&mut follow).await;
        assert_eq!(keys_of(&first), ["p/a"]);
        let put = store
            .put("p/b", b"2".to_vec(), None)
            .await
            .expect("store call");
        store.delete("p/a").await.expect("store call");
        store
            .put("q/other", b"y".to_vec(), None)
            .await
            .expect("store call");
        let event = change(&mut follow).await;
        assert_eq!((event.key(), event.revision()), ("p/b", put));
        assert!(
            matches!(change(&mut follow).await, WatchEvent::Delete { key, .. } if key == "p/a")
        );
        nothing_more(&mut follow).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_between_the_read_and_the_watch_comes_once() {
        let store = memory();
        store
            .put("p/a", b"1".to_vec(), None)
            .await
            .expect("store call");
        let mut follow = Follow::new(store.clone(), "p/", PAUSE);
        let first = snapshot(&mut follow).await;
        // The watch opens on the next call: this write falls between the two.
        let between = store
            .put("p/a", b"2".to_vec(), None)
            .await
            .expect("store call");
        assert_eq!(between, first.revision + 1);
        let event = change(&mut follow).await;
        assert_eq!(event.revision(), between);
        assert!(matches!(event, WatchEvent::Put(kv) if kv.value == b"2"));
        nothing_more(&mut follow).await;

        // The same for a caller that read the prefix itself.
        let read = store.range("p/").await.expect("store call");
        let mut follow = Follow::after(store.clone(), "p/", read.revision, PAUSE);
        let between = store
            .put("p/b", b"3".to_vec(), None)
            .await
            .expect("store call");
        assert_eq!(change(&mut follow).await.revision(), between);
        nothing_more(&mut follow).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_watch_is_followed_after_the_pause_by_a_fresh_snapshot() {
        let store = memory();
        let mut follow = Follow::new(store.clone(), "p/", PAUSE);
        assert!(snapshot(&mut follow).await.kvs.is_empty());
        store
            .put("p/a", b"1".to_vec(), None)
            .await
            .expect("store call");
        assert_eq!(change(&mut follow).await.key(), "p/a");

        store.close_watches();
        // Written while no watch is open: the fresh snapshot has them.
        store
            .put("p/b", b"2".to_vec(), None)
            .await
            .expect("store call");
        store.delete("p/a").await.expect("store call");
        let lost = Instant::now();
        let fresh = snapshot(&mut follow).await;
        let waited = lost.elapsed();
        assert!(
            waited >= PAUSE && waited < PAUSE + Duration::from_millis(10),
            "waited {waited:?}"
        );
        assert_eq!(keys_of(&fresh), ["p/b"]);
        assert_eq!(
            fresh.revision,
            store.range("p/").await.expect("store call").revision
        );
        // And the new watch goes on from it.
        store
            .put("p/c", b"3".to_vec(), None)
            .await
            .expect("store call");
        assert_eq!(change(&mut follow).await.key(), "p/c");
        nothing_more(&mut follow).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_compacted_history_is_read_again() {
        let store = Arc::new(EmbeddedStore::in_memory_with_history(2).expect("in-memory store"));
        let mut follow = Follow::new(store.clone(), "p/", PAUSE);
        assert!(snapshot(&mut follow).await.kvs.is_empty());
        for key in ["p/a", "p/b", "p/c", "p/d"] {
            store
                .put(key, b"1".to_vec(), None)
                .await
                .expect("store call");
        }
        // The watch cannot start where the snapshot ended: read everything again.
        let lost = Instant::now();
        let fresh = snapshot(&mut follow).await;
        assert!(lost.elapsed() >= PAUSE);
        assert_eq!(keys_of(&fresh), ["p/a", "p/b", "p/c", "p/d"]);
        store
            .put("p/e", b"1".to_vec(), None)
            .await
            .expect("store call");
        assert_eq!(change(&mut follow).await.key(), "p/e");
    }

    #[tokio::test(start_paused = true)]
    async fn the_backoff_doubles_to_its_bound_and_starts_over_once_a_watch_opens() {
        let ms = Duration::from_millis;
        let backoff = Backoff::doubling(ms(100), ms(500));
        let mut follow = Follow::new(memory(), "p/", backoff);
        let err = StateError::Backend {
            op: "range",
            target: "p/".into(),
            reason: "test".into(),
        };
        let mut pauses = Vec::new();
        for _ in 0..5 {
            let before = Instant::now();
            follow.lost(&err, "test");
            let Phase::Pause { until } = follow.phase else {
                panic!("not paused");
            };
            pauses.push(until - before);
        }
        assert_eq!(pauses, [ms(100), ms(200), ms(400), ms(500), ms(500)]);
        snapshot(&mut follow).await;
        nothing_more(&mut follow).await;
        assert_eq!(follow.pause, ms(100), "a watch opened");
        assert_eq!(Backoff::from(ms(500)), Backoff::doubling(ms(500), ms(100)));
    }
}
