//! What the placement service counts, without saying where the counts go.
//!
//! [`PlacementService`](crate::PlacementService) and the view's sync report each
//! event to a [`PlacementEvents`] observer. The daemon's observer is its Prometheus
//! metrics (the `daemon` feature: `PlacerMetrics`, one metric per event); the
//! simulator and other users of the core keep the default [`NoEvents`], so the
//! core links no metrics library.

use std::fmt;
use std::time::Duration;

/// One thing the placement service did.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum PlacementEvent {
    /// A Place was answered "placed".
    Placed,
    /// A Place was answered "queued".
    Queued,
    /// A Place was refused as malformed, or as never satisfiable.
    Invalid,
    /// A Place failed (store errors, contention).
    Failed,
    /// A whole Place took this long, reservation in the store included.
    PlaceTime(Duration),
    /// One pure decision (policy over the in-memory view) took this long.
    DecisionTime(Duration),
    /// A reservation was lost to a concurrent writer (a fresh decision follows).
    CasConflict,
    /// A Place waited for another request's commit on its chosen device and decided
    /// again, instead of sending a transaction certain to lose.
    GateWait,
    /// A Release removed a reservation.
    Released,
    /// A reservation was given back because the task's agent was gone.
    DeadReleased,
    /// A reservation was given back because the task's agent never started.
    UnstartedReleased,
    /// The keys of a task that held no placement were archived and marked for the
    /// retention (a Release of it, or the reaper once its agent was gone).
    UnplacedArchived,
    /// A released task's keys were deleted after its retention.
    RetentionDeleted,
    /// A task released while its agent kept running was admitted again on its device.
    Readmitted,
    /// Tasks whose agent runs without a reservation and that could not be admitted
    /// again (their device has no room), as the last reaper pass found them.
    UnreservedRunning(usize),
    /// An opportunistic job was told to leave its device (its assignment says evict):
    /// `Cap` for a production job's measured cap breach ([`crate::eviction`]), `Room`
    /// for a production job's placement that made room.
    Evicted(EvictionTrigger),
    /// A placement refused a device because a production job's slowdown cap (the
    /// newcomer's or a resident's) would be exceeded there.
    CapRefusal,
    /// A Place was answered "queued" because its device was held for a task waiting
    /// ahead of it (see [`crate::policy`], "Room held for a task waiting ahead"); it is
    /// counted as `Queued` too.
    Held,
    /// AvoidPairings in force (unexpired), as the last eviction pass counted them.
    AvoidedPairings(usize),
    /// A co-location sample was handed to the slowdown model.
    SampleObserved,
    /// A stored value could not be decoded (and was skipped).
    DecodeError,
}

/// Why an opportunistic job was evicted (the `trigger` label of
/// `iadeep_placer_evictions_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionTrigger {
    /// A production job stayed measured above its cap on the victim's device.
    Cap,
    /// A production job's placement evicted it to make room.
    Room,
}

impl EvictionTrigger {
    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            EvictionTrigger::Cap => "cap",
            EvictionTrigger::Room => "room",
        }
    }
}

/// Receives the service's [`PlacementEvent`]s; called on the hot path, so it should
/// be as cheap as an atomic add.
pub trait PlacementEvents: Send + Sync + fmt::Debug {
    /// Takes note of `event`.
    fn record(&self, event: PlacementEvent);
}

/// Ignores every event: the observer of a service nobody scrapes.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoEvents;

impl PlacementEvents for NoEvents {
    fn record(&self, _event: PlacementEvent) {}
}

/// An observer that keeps every event, for the unit tests' counts.
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct Recorded(std::sync::Mutex<Vec<PlacementEvent>>);

#[cfg(test)]
impl Recorded {
    /// How many times `event` was recorded.
    pub(crate) fn count(&self, event: PlacementEvent) -> usize {
        let events = self.0.lock().unwrap_or_else(|e| e.into_inner());
        events.iter().filter(|e| **e == event).count()
    }

    /// The last [`PlacementEvent::UnreservedRunning`] value (0 before the first).
    pub(crate) fn unreserved_running(&self) -> usize {
        let events = self.0.lock().unwrap_or_else(|e| e.into_inner());
        events
            .iter()
            .rev()
            .find_map(|e| match e {
                PlacementEvent::UnreservedRunning(n) => Some(*n),
                _ => None,
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
impl PlacementEvents for Recorded {
    fn record(&self, event: PlacementEvent) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(event);
    }
}
