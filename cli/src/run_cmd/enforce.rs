//! Enforcing an eviction on a job that does not leave, the way Kubernetes enforces a
//! preemption: a grace to checkpoint and exit, then SIGTERM, then SIGKILL.
//!
//! Why: the placer evicts an opportunistic job to bring a production job back under its
//! slowdown cap, and the job's agent raises `iadeep.Evicted` in the training loop. A
//! loop that swallows it, a job without an agent, or one hung while checkpointing would
//! keep the GPU, and the production job above its cap, for as long as it runs.
//!
//! The decisions are an [`Enforcer`] over tokio's clock, which `run_job`'s loop feeds
//! (the eviction seen, the deadline reached) and obeys (the signal to send), so they are
//! tested at chosen instants, without a process or a wait.

use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::Instant;

/// `--evict-grace` when not given: time for a job to write its checkpoint (Kubernetes'
/// default termination grace).
///
/// Why not longer: the job's agent revokes its lease as it raises `iadeep.Evicted`, and
/// the placer gives the job's GPU memory to another job once the lease has been gone
/// for its `--dead-task-grace-s` (60 s by default). A job that swallows the eviction
/// keeps using that memory until `iadeep run` stops it, so the grace and
/// [`DEFAULT_KILL_AFTER`] together must stay well under the placer's grace, or a job
/// placed into the freed memory runs out of it.
pub(super) const DEFAULT_GRACE: &str = "30s";
/// `--evict-kill-after` when not given: time for a job to clean up after SIGTERM.
pub(super) const DEFAULT_KILL_AFTER: &str = "10s";
/// The longest grace either flag accepts: the production job the eviction was for stays
/// above its cap meanwhile, so a longer one is more likely a typo (`30m` for `30s`).
const MAX_GRACE: Duration = Duration::from_secs(3600);

/// Parses `--evict-grace` and `--evict-kill-after`: a duration as `humantime` reads it
/// (`30s`, `1m`, `0s` for at once), at most [`MAX_GRACE`].
pub(super) fn parse_grace(text: &str) -> Result<Duration, String> {
    let grace = humantime::parse_duration(text.trim())
        .map_err(|err| format!("{text:?}: not a duration such as 30s, 1m or 0s ({err})"))?;
    if grace > MAX_GRACE {
        return Err(format!(
            "{text:?}: at most {}: the production job the eviction is for stays above its \
             slowdown cap meanwhile",
            humantime::format_duration(MAX_GRACE)
        ));
    }
    Ok(grace)
}

/// Where the enforcement of one run's eviction stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No eviction seen.
    Running,
    /// Evicted: the job may still exit on its own until `term_at`.
    Grace { term_at: Instant },
    /// SIGTERM sent; SIGKILL at `kill_at` unless the job exits first.
    Terminated { kill_at: Instant },
    /// SIGKILL sent: nothing left to do but wait for the exit.
    Killed,
    /// Not stopped after all: its last report says it finished its work, so it is
    /// writing its outputs. `after` is the last signal sent before, if any.
    Spared { after: Option<Signal> },
}

/// What `iadeep run` does to an evicted job that has not exited: nothing during
/// `grace` after the eviction was seen, then SIGTERM, then SIGKILL `kill_after` later.
/// A job that exits meanwhile is not signalled (the loop stops asking).
#[derive(Debug, Clone)]
pub(super) struct Enforcer {
    grace: Duration,
    kill_after: Duration,
    phase: Phase,
}

impl Enforcer {
    pub(super) fn new(grace: Duration, kill_after: Duration) -> Enforcer {
        Enforcer {
            grace,
            kill_after,
            phase: Phase::Running,
        }
    }

    /// The grace before SIGTERM.
    pub(super) fn grace(&self) -> Duration {
        self.grace
    }

    /// The placer's eviction, seen at `now`. True the first time: the grace runs from
    /// the first sighting, and a repeat (a watch re-read after a lost connection) does
    /// not restart it.
    pub(super) fn evicted(&mut self, now: Instant) -> bool {
        if self.phase != Phase::Running {
            return false;
        }
        self.phase = Phase::Grace {
            term_at: now + self.grace,
        };
        true
    }

    /// When the next signal is due, if one is.
    pub(super) fn deadline(&self) -> Option<Instant> {
        match self.phase {
            Phase::Grace { term_at } => Some(term_at),
            Phase::Terminated { kill_at } => Some(kill_at),
            Phase::Running | Phase::Killed | Phase::Spared { .. } => None,
        }
    }

    /// The job's last report says it finished its work: no signal from here on, whatever
    /// the deadlines (it is writing its outputs, and leaves on its own).
    pub(super) fn spare(&mut self) {
        if matches!(self.phase, Phase::Grace { .. } | Phase::Terminated { .. }) {
            self.phase = Phase::Spared { after: self.sent() };
        }
    }

    /// The signal due at `now`, if any, moving on past it: SIGTERM once the grace is
    /// over, SIGKILL once `kill_after` has passed since; nothing before a deadline.
    pub(super) fn due(&mut self, now: Instant) -> Option<Signal> {
        match self.phase {
            Phase::Grace { term_at } if now >= term_at => {
                self.phase = Phase::Terminated {
                    kill_at: now + self.kill_after,
                };
                Some(Signal::SIGTERM)
            }
            Phase::Terminated { kill_at } if now >= kill_at => {
                self.phase = Phase::Killed;
                Some(Signal::SIGKILL)
            }
            _ => None,
        }
    }

    /// The last signal sent because of the eviction; `None` when the job was not
    /// signalled (not evicted, or it exited within the grace).
    pub(super) fn sent(&self) -> Option<Signal> {
        match self.phase {
            Phase::Running | Phase::Grace { .. } => None,
            Phase::Terminated { .. } => Some(Signal::SIGTERM),
            Phase::Killed => Some(Signal::SIGKILL),
            Phase::Spared { after } => after,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(30);
    const KILL_AFTER: Duration = Duration::from_secs(10);

    /// Virtual time: the enforcer is asked at the instants the loop would wake at (its
    /// deadlines), `seen + offset`, without waiting for any of them.
    fn at(seen: Instant, offset: Duration) -> Instant {
        seen + offset
    }

    #[test]
    fn a_job_that_ignores_its_eviction_gets_sigterm_after_the_grace_then_sigkill() {
        let mut enforcer = Enforcer::new(GRACE, KILL_AFTER);
        let seen = Instant::now();
        assert_eq!(enforcer.deadline(), None, "not evicted: nothing due");
        assert_eq!(enforcer.due(at(seen, Duration::from_secs(1000))), None);

        assert!(enforcer.evicted(seen));
        assert_eq!(enforcer.deadline(), Some(at(seen, GRACE)));
        let tick = Duration::from_millis(1);
        assert_eq!(enforcer.due(at(seen, GRACE - tick)), None);
        assert_eq!(enforcer.sent(), None);
        assert_eq!(enforcer.due(at(seen, GRACE)), Some(Signal::SIGTERM));
        assert_eq!(enforcer.sent(), Some(Signal::SIGTERM));
        assert_eq!(enforcer.due(at(seen, GRACE)), None, "SIGTERM once");
        assert_eq!(enforcer.deadline(), Some(at(seen, GRACE + KILL_AFTER)));
        assert_eq!(enforcer.due(at(seen, GRACE + KILL_AFTER - tick)), None);
        assert_eq!(
            enforcer.due(at(seen, GRACE + KILL_AFTER)),
            Some(Signal::SIGKILL)
        );
        assert_eq!(enforcer.sent(), Some(Signal::SIGKILL));
        assert_eq!(enforcer.deadline(), None, "nothing after SIGKILL");
        assert_eq!(enforcer.due(at(seen, Duration::from_secs(10_000))), None);
    }

    /// A late wake-up (a busy machine) sends what is due then, one signal at a time:
    /// SIGKILL still comes `kill_after` after the SIGTERM actually sent.
    #[test]
    fn sigkill_counts_from_the_sigterm_sent() {
        let mut enforcer = Enforcer::new(GRACE, KILL_AFTER);
        let seen = Instant::now();
        enforcer.evicted(seen);
        let late = GRACE + Duration::from_secs(100);
        assert_eq!(enforcer.due(at(seen, late)), Some(Signal::SIGTERM));
        assert_eq!(enforcer.deadline(), Some(at(seen, late + KILL_AFTER)));
    }

    /// The loop asks only while the job runs: within the grace nothing is due, and a
    /// repeated sighting (a watch re-read) does not push SIGTERM back.
    #[test]
    fn the_grace_runs_from_the_first_sighting_and_nothing_is_sent_within_it() {
        let mut enforcer = Enforcer::new(GRACE, KILL_AFTER);
        let seen = Instant::now();
        assert!(enforcer.evicted(seen));
        assert!(!enforcer.evicted(at(seen, GRACE / 2)), "seen again");
        assert_eq!(enforcer.due(at(seen, GRACE / 2)), None);
        assert_eq!(enforcer.deadline(), Some(at(seen, GRACE)));
        // The job exits here: the loop returns without asking again.
        assert_eq!(
            enforcer.sent(),
            None,
            "a job that left in time is not signalled"
        );
    }

    #[test]
    fn a_zero_grace_sends_sigterm_at_once() {
        let mut enforcer = Enforcer::new(Duration::ZERO, KILL_AFTER);
        let seen = Instant::now();
        enforcer.evicted(seen);
        assert_eq!(enforcer.due(seen), Some(Signal::SIGTERM));
    }

    #[test]
    fn graces_are_durations_of_at_most_an_hour() {
        assert_eq!(parse_grace(DEFAULT_GRACE), Ok(GRACE));
        assert_eq!(parse_grace(DEFAULT_KILL_AFTER), Ok(KILL_AFTER));
        assert_eq!(parse_grace("0s"), Ok(Duration::ZERO));
        assert_eq!(parse_grace(" 1s "), Ok(Duration::from_secs(1)));
        assert_eq!(parse_grace("1h"), Ok(MAX_GRACE));
        let err = parse_grace("30").expect_err("no unit");
        assert!(err.contains("not a duration"), "{err}");
        let err = parse_grace("90m").expect_err("too long");
        assert!(err.contains("at most 1h"), "{err}");
        assert!(parse_grace("-1s").is_err());
    }

    /// The memory hole: the agent revokes its lease as it raises `iadeep.Evicted`, and
    /// the placer frees the job's reservation once the lease has been gone for its
    /// `--dead-task-grace-s` (60 s by default, `iadeep placer --help`). A job that
    /// swallows the eviction must be stopped well before, or a job placed into its
    /// memory runs out of it: the defaults leave a third of that grace for the agent
    /// seeing the eviction before `iadeep run` and the driver freeing the memory.
    #[test]
    fn by_default_a_job_is_killed_well_within_the_placers_dead_task_grace() {
        let dead_task_grace = Duration::from_secs(crate::placer_cmd::DEFAULT_DEAD_TASK_GRACE_S);
        let grace = parse_grace(DEFAULT_GRACE).expect("default grace");
        let kill_after = parse_grace(DEFAULT_KILL_AFTER).expect("default kill-after");
        assert!(
            (grace + kill_after) * 3 <= dead_task_grace * 2,
            "{grace:?} + {kill_after:?} against {dead_task_grace:?}"
        );
    }

    /// A job whose last report says it finished is writing its outputs: once spared,
    /// nothing is due, and what was sent before stays said.
    #[test]
    fn a_spared_job_gets_no_further_signal() {
        let mut enforcer = Enforcer::new(GRACE, KILL_AFTER);
        let seen = Instant::now();
        enforcer.evicted(seen);
        enforcer.spare();
        assert_eq!(enforcer.deadline(), None);
        assert_eq!(enforcer.due(at(seen, GRACE * 10)), None);
        assert_eq!(enforcer.sent(), None);

        let mut enforcer = Enforcer::new(GRACE, KILL_AFTER);
        enforcer.evicted(seen);
        assert_eq!(enforcer.due(at(seen, GRACE)), Some(Signal::SIGTERM));
        enforcer.spare();
        assert_eq!(
            enforcer.due(at(seen, GRACE + KILL_AFTER)),
            None,
            "no SIGKILL"
        );
        assert_eq!(enforcer.sent(), Some(Signal::SIGTERM));
        assert!(!enforcer.evicted(at(seen, GRACE * 2)), "not restarted");
    }
}
