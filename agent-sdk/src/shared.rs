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
    /// The task's placement was deleted while it runs (released by hand, or by the
    /// placer after the agent's lease expired): its GPU memory is no longer reserved,
    /// so other jobs may be placed onto its memory. The batch size is unchanged. The
    /// placer admits it again on its device if it fits (a
    /// [`ChangeReason::ReservationRestored`] follows), else reports it; a loop may
    /// checkpoint, or stop and be placed again.
    ReservationLost,
    /// The task holds a reservation again after [`ChangeReason::ReservationLost`].
    ReservationRestored,
    /// The placer evicted the task (its assignment says `evict`): a production job on
    /// its device stayed above its slowdown cap with this job at its smallest size, and
    /// the measurements blame it most. The batch size is unchanged; the loop should
    /// checkpoint, end the agent with [`crate::Agent::leave`] and exit (the reason is
    /// [`crate::Agent::evicted`]). `iadeep run --requeue-on-evict` places the job again
    /// and restarts it. Delivered once, and never replaced by a later assignment.
    Evicted,
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
    /// The assigner's bound on the task's GPU memory at `batch_size`, MiB (an
    /// assignment's `memory_bound_mib`): what the task may use from this change on.
    /// `None` when the change brings none (a fall-back, a reservation event), which
    /// leaves [`crate::Agent::memory_limit_mib`] as it was.
    pub memory_bound_mib: Option<f64>,
}

/// What the owner (the agent handle, or a stop signal) wants the reporter to do.
///
/// It lives here, below the reporter and the signal handling, because both use it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Control {
    Run,
    /// Publish a final report with `finished = true`, then revoke the lease.
    Finish,
    /// The agent was dropped without `finish()`: revoke the lease, not finished.
    Abandon,
}

/// How the reporter ended.
pub(crate) type Outcome = Result<(), String>;

/// What the agent knows about the memory of the sizes it ran (off the hot path).
#[derive(Debug, Default)]
pub(crate) struct FitMemory {
    /// Peak MiB measured at each batch size that ran.
    pub peaks: std::collections::BTreeMap<u32, u64>,
    /// The card's memory, MiB, when known.
    pub capacity_mib: Option<u64>,
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
    /// `steps` when the generation began: a peak is measured only once a step of the
    /// generation ended (see [`crate::memory::PeakMemory::sample`]).
    generation_start_steps: AtomicU64,
    round: AtomicU64,
    lr_factor_bits: AtomicU64,
    /// Smallest batch size that ran out of memory; 0 = none.
    oom_batch_size: AtomicU32,
    /// Largest peak memory the trainer recorded itself since the reporter last
    /// looked, MiB; 0 = none.
    recorded_peak_mib: AtomicU64,
    /// The GPU memory the task may use, MiB, from the latest news of it: its placement's
    /// reservation as written, or the bound of an applied change; 0 = unknown.
    limit_mib: AtomicU64,
    pending_flag: AtomicBool,
    pending: Mutex<Option<BatchSizeChange>>,
    /// Set once, when the reporter sees an evict assignment; the reason is `evict_reason`.
    evicted_flag: AtomicBool,
    /// The eviction is set and the loop has not been told through `poll_change` yet.
    evict_unseen: AtomicBool,
    evict_reason: Mutex<Option<String>>,
    /// Peak MiB measured at each batch size the loop ran (the reporter fills it), and the
    /// card's memory when known (0 = unknown): what the out-of-memory fall-back weighs.
    fits: Mutex<FitMemory>,
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
            generation_start_steps: AtomicU64::new(0),
            round: AtomicU64::new(0),
            lr_factor_bits: AtomicU64::new(1.0f64.to_bits()),
            oom_batch_size: AtomicU32::new(0),
            recorded_peak_mib: AtomicU64::new(0),
            limit_mib: AtomicU64::new(0),
            pending_flag: AtomicBool::new(false),
            pending: Mutex::new(None),
            evicted_flag: AtomicBool::new(false),
            evict_unseen: AtomicBool::new(false),
            evict_reason: Mutex::new(None),
            fits: Mutex::new(FitMemory::default()),
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

    /// Steps recorded so far.
    pub(crate) fn steps(&self) -> u64 {
        self.steps.load(Ordering::Relaxed)
    }

    /// Whether a step ended under the generation the loop trains under now.
    pub(crate) fn stepped_in_generation(&self) -> bool {
        self.steps() > self.generation_start_steps.load(Ordering::Relaxed)
    }

    /// The generation the loop trains under (bumped by every applied change).
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub(crate) fn oom_batch_size(&self) -> Option<u32> {
        Some(self.oom_batch_size.load(Ordering::Relaxed)).filter(|&b| b > 0)
    }

    pub(crate) fn largest_fit(&self) -> Option<u32> {
        Some(self.largest_fit.load(Ordering::Relaxed)).filter(|&b| b > 0)
    }

    fn fits(&self) -> std::sync::MutexGuard<'_, FitMemory> {
        self.fits
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records the peak measured at `batch_size` (the reporter, off the hot path).
    pub(crate) fn record_fit_peak(&self, batch_size: u32, mib: u64) {
        let mut fits = self.fits();
        let peak = fits.peaks.entry(batch_size).or_insert(0);
        *peak = (*peak).max(mib);
    }

    /// Records the card's memory.
    pub(crate) fn set_capacity(&self, capacity_mib: u64) {
        self.fits().capacity_mib = Some(capacity_mib).filter(|&m| m > 0);
    }

    /// The size to fall back to after running out of memory at `oom`: the largest size
    /// below it that ran and whose measured peak leaves the card's margin free (the margin
    /// the placer and the tuner keep), else the largest size below it that ran; `None`
    /// when nothing below it ran.
    pub(crate) fn fallback(
        &self,
        oom: u32,
        margin: &iadeep_objective::MemoryMargin,
    ) -> Option<u32> {
        let fits = self.fits();
        margin.fallback_batch_size(oom, &fits.peaks, self.largest_fit(), fits.capacity_mib)
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

    /// Records the task's eviction (the first one only: an eviction is final); returns
    /// whether this call set it.
    pub(crate) fn set_evicted(&self, reason: String) -> bool {
        let mut slot = self
            .evict_reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if slot.is_some() {
            return false;
        }
        *slot = Some(reason);
        self.evicted_flag.store(true, Ordering::Release);
        self.evict_unseen.store(true, Ordering::Release);
        true
    }

    /// Why the task was evicted, once it was (one relaxed load before that).
    pub(crate) fn evicted(&self) -> Option<String> {
        if !self.evicted_flag.load(Ordering::Acquire) {
            return None;
        }
        self.evict_reason
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Whether the loop is yet to be told of the eviction; true once (one relaxed load
    /// when not evicted).
    pub(crate) fn take_evict_notice(&self) -> bool {
        self.evict_unseen.load(Ordering::Relaxed) && self.evict_unseen.swap(false, Ordering::AcqRel)
    }

    /// Makes `change` the configuration the loop trains under.
    pub(crate) fn apply(&self, change: &BatchSizeChange) {
        self.batch_size.store(change.batch_size, Ordering::Relaxed);
        self.round.store(change.round, Ordering::Relaxed);
        self.lr_factor_bits
            .store(change.lr_factor.to_bits(), Ordering::Relaxed);
        if let Some(bound) = change
            .memory_bound_mib
            .filter(|b| b.is_finite() && *b >= 1.0)
        {
            self.limit_mib.store(bound as u64, Ordering::Relaxed);
        }
        self.generation_start_steps
            .store(self.steps(), Ordering::Relaxed);
        self.generation.fetch_add(1, Ordering::Release);
    }

    /// Records a reservation the task's placement was written with (the reporter, when
    /// it first sees the placement or sees it rewritten with another figure).
    pub(crate) fn set_reserved(&self, mib: u64) {
        if mib > 0 {
            self.limit_mib.store(mib, Ordering::Relaxed);
        }
    }

    /// The GPU memory the task may use now, MiB: the latest of its placement's
    /// reservation and the bounds of the changes applied; `None` when neither is known.
    pub(crate) fn memory_limit_mib(&self) -> Option<u64> {
        Some(self.limit_mib.load(Ordering::Relaxed)).filter(|&mib| mib > 0)
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

#[cfg(test)]
mod tests {
    use super::*;
    use iadeep_objective::MemoryMargin;

    /// The fall-back keeps the one memory margin: of the sizes that ran below the failed
    /// one, the largest whose measured peak leaves the margin free on the card.
    #[test]
    fn the_fallback_leaves_the_margin_free() {
        let shared = Shared::new(64, 0.05);
        shared.record_step(64, Duration::from_millis(1));
        shared.record_fit_peak(16, 3_000);
        shared.record_fit_peak(32, 7_000);
        shared.record_fit_peak(64, 7_900);
        let margin = MemoryMargin::DEFAULT;
        // Without the card's size: the largest size below the failure that ran.
        assert_eq!(shared.fallback(128, &margin), Some(64));
        // An 8 GiB card keeps 8192 × 0.95 − 256 = 7526 MiB usable: 64 (7900) does not
        // leave the margin, 32 (7000) does.
        shared.set_capacity(8_192);
        assert_eq!(shared.fallback(128, &margin), Some(32));
        assert_eq!(shared.fallback(32, &margin), Some(16));
        assert_eq!(Shared::new(64, 0.05).fallback(64, &margin), None);
    }
}
