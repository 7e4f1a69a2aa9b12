//! State shared by the training loop and the reporter.
//!
//! The hot path (`batch_size`, `record_step`) touches only atomics with relaxed
//! ordering: a load, and three `fetch_add`s on counters only the loop writes, so
//! the cache lines stay with the loop's core except when the reporter samples
//! them a few times per second. Everything that needs a lock (a pending
//! assignment, gradient statistics) sits behind a flag or is off the hot path.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use iadeep_objective::GnsEstimator;

/// Why the batch size changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeReason {
    /// The tuner assigned a new batch size.
    Assignment,
    /// The trainer reported an out-of-memory error; the agent fell back.
    OutOfMemory,
}

/// A batch-size change for the trainer to apply between steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchSizeChange {
    /// The batch size to train at from the next step on.
    pub batch_size: u32,
    /// Multiply the learning rate *at the submitted batch size* by this.
    pub lr_factor: f64,
    /// The tuner's round (unchanged by an out-of-memory fall-back).
    pub round: u64,
    pub reason: ChangeReason,
}

/// Counters as the reporter reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub generation: u64,
    pub steps: u64,
    pub samples: u64,
    pub nanos: u64,
    pub batch_size: u32,
    pub round: u64,
}

#[derive(Debug)]
pub(crate) struct Shared {
    // Hot path.
    batch_size: AtomicU32,
    steps: AtomicU64,
    samples: AtomicU64,
    nanos: AtomicU64,
    largest_fit: AtomicU32,
    // Bumped whenever the batch size or round the loop trains under changes, so
    // the reporter never mixes steps of two configurations in one measurement.
    generation: AtomicU64,
    round: AtomicU64,
    lr_factor_bits: AtomicU64,
    /// Smallest batch size that ran out of memory; 0 = none.
    oom_batch_size: AtomicU32,
    /// Largest peak memory the trainer recorded itself since the reporter last
    /// looked, MiB; 0 = none.
    recorded_peak_mib: AtomicU64,
    pending_flag: AtomicBool,
    pending: Mutex<Option<BatchSizeChange>>,
    pub(crate) gns: Mutex<GnsEstimator>,
    // Reporter status, for callers and tests.
    pub(crate) registered: AtomicBool,
    pub(crate) reports_published: AtomicU64,
}

impl Shared {
    /// The smoothed gradient noise scale, if the trainer has reported gradient norms.
    ///
    /// A panic elsewhere while holding the estimator's lock cannot leave it half
    /// updated in a way that matters here, so a poisoned lock is read anyway.
    pub(crate) fn noise_scale(&self) -> Option<f64> {
        self.gns
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .noise_scale()
    }

    pub(crate) fn new(initial_batch_size: u32, gns_smoothing: f64) -> Shared {
        Shared {
            batch_size: AtomicU32::new(initial_batch_size),
            steps: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
            largest_fit: AtomicU32::new(0),
            generation: AtomicU64::new(0),
            round: AtomicU64::new(0),
            lr_factor_bits: AtomicU64::new(1.0f64.to_bits()),
            oom_batch_size: AtomicU32::new(0),
            recorded_peak_mib: AtomicU64::new(0),
            pending_flag: AtomicBool::new(false),
            pending: Mutex::new(None),
            gns: Mutex::new(GnsEstimator::new(gns_smoothing)),
            registered: AtomicBool::new(false),
            reports_published: AtomicU64::new(0),
        }
    }

    #[inline]
    pub(crate) fn batch_size(&self) -> u32 {
        self.batch_size.load(Ordering::Relaxed)
    }

    #[inline]
    pub(crate) fn record_step(&self, batch_size: u32, elapsed: Duration) {
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.samples
            .fetch_add(u64::from(batch_size), Ordering::Relaxed);
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
        // A completed step proves the size fits; the RMW happens only on a new maximum.
        if batch_size > self.largest_fit.load(Ordering::Relaxed) {
            self.largest_fit.fetch_max(batch_size, Ordering::Relaxed);
        }
    }

    pub(crate) fn lr_factor(&self) -> f64 {
        f64::from_bits(self.lr_factor_bits.load(Ordering::Relaxed))
    }

    pub(crate) fn round(&self) -> u64 {
        self.round.load(Ordering::Relaxed)
    }

    pub(crate) fn oom_batch_size(&self) -> Option<u32> {
        Some(self.oom_batch_size.load(Ordering::Relaxed)).filter(|&b| b > 0)
    }

    pub(crate) fn largest_fit(&self) -> Option<u32> {
        Some(self.largest_fit.load(Ordering::Relaxed)).filter(|&b| b > 0)
    }

    /// The counters, with the generation read before and after: `None` when a
    /// change was applied while reading (the reporter then simply retries later).
    pub(crate) fn snapshot(&self) -> Option<Snapshot> {
        let generation = self.generation.load(Ordering::Acquire);
        let snapshot = Snapshot {
            generation,
            steps: self.steps.load(Ordering::Relaxed),
            samples: self.samples.load(Ordering::Relaxed),
            nanos: self.nanos.load(Ordering::Relaxed),
            batch_size: self.batch_size.load(Ordering::Relaxed),
            round: self.round.load(Ordering::Relaxed),
        };
        (self.generation.load(Ordering::Acquire) == generation).then_some(snapshot)
    }

    /// Offers a change to the loop; a later offer replaces an unapplied one.
    pub(crate) fn offer(&self, change: BatchSizeChange) {
        let mut slot = self
            .pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *slot = Some(change);
        self.pending_flag.store(true, Ordering::Release);
    }

    /// Takes the pending change, if any (one relaxed load when there is none).
    pub(crate) fn take_pending(&self) -> Option<BatchSizeChange> {
        if !self.pending_flag.load(Ordering::Relaxed) {
            return None;
        }
        self.pending_flag.store(false, Ordering::Relaxed);
        self.pending
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// Makes `change` the configuration the loop trains under.
    pub(crate) fn apply(&self, change: &BatchSizeChange) {
        self.batch_size.store(change.batch_size, Ordering::Relaxed);
        self.round.store(change.round, Ordering::Relaxed);
        self.lr_factor_bits
            .store(change.lr_factor.to_bits(), Ordering::Relaxed);
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// Keeps the largest peak the trainer measured itself until the reporter takes it.
    pub(crate) fn record_peak(&self, mib: u64) {
        if mib > 0 {
            self.recorded_peak_mib.fetch_max(mib, Ordering::Relaxed);
        }
    }

    /// The trainer's recorded peak since the last call, if it recorded one.
    pub(crate) fn take_recorded_peak(&self) -> Option<u64> {
        Some(self.recorded_peak_mib.swap(0, Ordering::Relaxed)).filter(|&m| m > 0)
    }

    /// Records that `batch_size` ran out of memory, keeping the smallest such size.
    pub(crate) fn mark_oom(&self, batch_size: u32) {
        let current = self.oom_batch_size.load(Ordering::Relaxed);
        let next = if current == 0 {
            batch_size
        } else {
            current.min(batch_size)
        };
        self.oom_batch_size.store(next, Ordering::Relaxed);
        // Sizes at or above the OOM size are no longer known to fit.
        if self.largest_fit.load(Ordering::Relaxed) >= batch_size {
            self.largest_fit.store(0, Ordering::Relaxed);
        }
    }
}
