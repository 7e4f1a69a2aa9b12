//! When a queued `iadeep run` asks the placer again: as soon as ListDevices shows a
//! change that can make room for it, and within a few seconds while a resident's
//! reservation may still shrink; the placer's hint (up to a minute) only when nothing
//! like that is possible.
//!
//! Pure: the caller polls ListDevices and passes the time in, so the tests need no
//! clock.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::time::{Duration, Instant};

use iadeep_proto::DeviceStatus;

/// Bounds on the placer's hint of when to ask again.
pub const MIN_RETRY: Duration = Duration::from_millis(500);
pub const MAX_RETRY: Duration = Duration::from_secs(60);
/// The longest wait between two asks while a candidate device has a resident whose
/// reservation may still shrink (see [`SETTLING`]).
pub const SETTLING_RETRY: Duration = Duration::from_secs(5);
/// How long after this job first sees a resident its reservation may still shrink: a
/// job starts on a provisional reservation (its memory figure, an estimate, or the
/// whole card) that the placer cuts to the measured peak on its first report with one,
/// after its first training step: about 10 s after it starts on a warm machine (8 to 13 s
/// on the H200 of `data/measured/h200/`), later on a slow one.
pub const SETTLING: Duration = Duration::from_secs(60);

/// What a queued job sees of a device at one ListDevices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    pub residents: BTreeSet<String>,
    /// Memory reserved by the residents, MiB.
    pub reserved_mib: u64,
    /// The device's memory, MiB.
    pub memory_mib: u64,
}

impl Seen {
    fn free_mib(&self) -> u64 {
        self.memory_mib.saturating_sub(self.reserved_mib)
    }
}

/// The devices ListDevices lists, by id.
pub type Snapshot = BTreeMap<String, Seen>;

pub fn snapshot(statuses: &[DeviceStatus]) -> Snapshot {
    statuses
        .iter()
        .filter_map(|s| {
            let device = s.device.as_ref()?;
            Some((
                device.device_id.clone(),
                Seen {
                    residents: s.resident_task_ids.iter().cloned().collect(),
                    reserved_mib: s.reserved_mem_mib,
                    memory_mib: device.memory_mib,
                },
            ))
        })
        .collect()
}

/// Why a queued job asks the placer again before its hint ran out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// A device the job had not seen was registered.
    Appeared { device: String },
    /// A task left one of the job's candidate devices.
    Left { device: String, task: String },
    /// A candidate device has no resident.
    Idle { device: String },
    /// The memory reserved on a candidate went down: a resident's reservation shrank
    /// (e.g. to its measured peak).
    Shrunk {
        device: String,
        from_mib: u64,
        to_mib: u64,
    },
    /// A candidate's free memory went up otherwise (its memory grew).
    MoreFree {
        device: String,
        from_mib: u64,
        to_mib: u64,
    },
}

impl fmt::Display for Wake {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Wake::Appeared { device } => write!(f, "{device} was registered"),
            Wake::Left { device, task } => write!(f, "{task} left {device}"),
            Wake::Idle { device } => write!(f, "{device} is idle"),
            Wake::Shrunk {
                device,
                from_mib,
                to_mib,
            } => write!(
                f,
                "the memory reserved on {device} went down from {from_mib} to {to_mib} MiB"
            ),
            Wake::MoreFree {
                device,
                from_mib,
                to_mib,
            } => write!(
                f,
                "the free memory of {device} went up from {from_mib} to {to_mib} MiB"
            ),
        }
    }
}

/// When a queued job asks again without a wake, and why ([`QueueWatch::ask_again_after`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    pub after: Duration,
    pub why: RetryWhy,
}

/// Why a queued job asks again after [`Retry::after`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryWhy {
    /// The placer's hint, within the bounds.
    Hint,
    /// The hint was below [`MIN_RETRY`]: iadeep run asks at most that often.
    AtMostEvery,
    /// The hint was above [`MAX_RETRY`]: iadeep run asks at least that often.
    AtLeastEvery,
    /// A resident of a candidate arrived less than [`SETTLING`] ago and may still
    /// shrink its reservation: at most [`SETTLING_RETRY`].
    Settling,
}

/// What a queued job knows between its asks.
///
/// Each poll is compared with the one before (the first with the snapshot taken just
/// before the Place call). That snapshot can miss the task the job was queued behind:
/// one placed by someone else between the snapshot and the decision. If it leaves
/// before the first poll, no poll shows it, so nothing looks freed; but a queued answer
/// means no candidate was idle when the placer decided (an idle GPU is always a
/// candidate), so an idle candidate at a poll is worth asking again. If its reservation
/// shrinks before the first poll, the poll shows more reserved than the snapshot, not
/// less; the job was new to this job's eyes, so the next ask is [`SETTLING_RETRY`] away
/// at most anyway.
#[derive(Debug, Default)]
pub struct QueueWatch {
    last: Snapshot,
    candidates: BTreeSet<String>,
    /// When this job first saw each resident of a candidate device.
    first_seen: BTreeMap<String, Instant>,
}

impl QueueWatch {
    pub fn new() -> QueueWatch {
        QueueWatch::default()
    }

    /// The job asked at `at`, queued: `before` is what ListDevices showed just before,
    /// `candidates` the devices the job may go to.
    pub fn asked(&mut self, before: Snapshot, candidates: BTreeSet<String>, at: Instant) {
        self.candidates = candidates;
        self.note_residents(&before, at);
        self.last = before;
    }

    /// A poll at `at`: why to ask the placer again now, if anything.
    pub fn observe(&mut self, now: Snapshot, at: Instant) -> Option<Wake> {
        self.note_residents(&now, at);
        let wake = self.wake(&now);
        self.last = now;
        wake
    }

    fn wake(&self, now: &Snapshot) -> Option<Wake> {
        if let Some(device) = now.keys().find(|d| !self.last.contains_key(*d)) {
            return Some(Wake::Appeared {
                device: device.clone(),
            });
        }
        let candidates = now
            .iter()
            .filter(|(device, _)| self.candidates.contains(*device));
        for (device, seen) in candidates {
            let device = device.clone();
            if seen.residents.is_empty() {
                return Some(Wake::Idle { device });
            }
            let Some(was) = self.last.get(&device) else {
                continue;
            };
            if let Some(task) = was.residents.difference(&seen.residents).next() {
                let task = task.clone();
                return Some(Wake::Left { device, task });
            }
            if seen.reserved_mib < was.reserved_mib {
                return Some(Wake::Shrunk {
                    device,
                    from_mib: was.reserved_mib,
                    to_mib: seen.reserved_mib,
                });
            }
            if seen.free_mib() > was.free_mib() {
                return Some(Wake::MoreFree {
                    device,
                    from_mib: was.free_mib(),
                    to_mib: seen.free_mib(),
                });
            }
        }
        None
    }

    /// How long after an ask the job asks again without a wake, given the placer's
    /// `hint`, at `at`, and why: the hint within [`MIN_RETRY`, `MAX_RETRY`], but at most
    /// [`SETTLING_RETRY`] while a candidate has a resident first seen less than
    /// [`SETTLING`] ago (its reservation may shrink, and what the placer learns from its
    /// first reports may change its answer). The one definition of the rule: the
    /// message that explains it ([`QueueWatch::next_ask`]) takes the reason from here.
    pub fn ask_again_after(&self, hint: Duration, at: Instant) -> Retry {
        let bounded = hint.clamp(MIN_RETRY, MAX_RETRY);
        let (after, why) = if self.settling(at) && bounded > SETTLING_RETRY {
            (SETTLING_RETRY, RetryWhy::Settling)
        } else if hint < MIN_RETRY {
            (MIN_RETRY, RetryWhy::AtMostEvery)
        } else if hint > MAX_RETRY {
            (MAX_RETRY, RetryWhy::AtLeastEvery)
        } else {
            (hint, RetryWhy::Hint)
        };
        Retry { after, why }
    }

    /// When the job asks again after an ask at `at` answered with the placer's `hint`,
    /// in words: as soon as a poll shows a reason to ([`Wake`]), else after
    /// [`QueueWatch::ask_again_after`], and why that is not the hint when it is not.
    /// The placer's own reason says "retry after N s"; without the why, "asking again
    /// in 5 s" beside it reads as a contradiction.
    pub fn next_ask(&self, hint: Duration, at: Instant) -> String {
        let retry = self.ask_again_after(hint, at);
        let because = match retry.why {
            RetryWhy::Hint => None,
            RetryWhy::AtMostEvery => Some(format!(
                ": iadeep run asks at most every {}",
                secs(MIN_RETRY)
            )),
            RetryWhy::Settling => Some(format!(
                ", because a job that arrived on a GPU this job may use less than {} ago \
                 may still shrink its reservation or change what the placer predicts",
                secs(SETTLING)
            )),
            RetryWhy::AtLeastEvery => Some(format!(
                ": iadeep run asks at least every {}",
                secs(MAX_RETRY)
            )),
        };
        let why = match because {
            None => ", as the placer suggests".to_owned(),
            Some(because) => format!(
                " rather than the {} the placer suggests{because}",
                secs(hint)
            ),
        };
        format!(
            "asking again as soon as a GPU is registered or one this job may use has more \
             room, else in {}{why}",
            secs(retry.after)
        )
    }

    /// Whether a candidate has a resident this job first saw less than [`SETTLING`]
    /// before `at`.
    pub fn settling(&self, at: Instant) -> bool {
        self.first_seen
            .values()
            .any(|&seen| at.saturating_duration_since(seen) < SETTLING)
    }

    /// Records when each resident of a candidate was first seen; forgets the gone.
    fn note_residents(&mut self, now: &Snapshot, at: Instant) {
        let residents: BTreeSet<&String> = now
            .iter()
            .filter(|(device, _)| self.candidates.contains(*device))
            .flat_map(|(_, seen)| &seen.residents)
            .collect();
        self.first_seen.retain(|task, _| residents.contains(task));
        for task in residents {
            self.first_seen.entry(task.clone()).or_insert(at);
        }
    }
}

/// `d` in seconds for a message: "60 s", "0.5 s".
fn secs(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

/// How often a wait whose reason has not changed is said again.
const SAY_AGAIN: Duration = Duration::from_secs(60);

/// What `iadeep run` says of the placer's "wait" answers: each new reason at once, with
/// the GPUs' own reasons; the same reason again only after [`SAY_AGAIN`] (a job asks
/// every few seconds while a neighbour settles, and a 400-character line every 5 s
/// buried the log).
#[derive(Debug, Default)]
pub struct QueueLog {
    last: Option<(String, Instant)>,
}

impl QueueLog {
    /// Whether the answer whose reason is `reason` is to be said at `at`: a new reason,
    /// or the same one [`SAY_AGAIN`] after it was last said. Reasons are compared without
    /// their figures, which move at every ask (a predicted wait, a PD).
    pub fn say(&mut self, reason: &str, at: Instant) -> bool {
        let reason = without_figures(reason);
        let reason = reason.as_str();
        let due = match &self.last {
            Some((said, when)) => {
                said != reason || at.saturating_duration_since(*when) >= SAY_AGAIN
            }
            None => true,
        };
        if due {
            self.last = Some((reason.to_owned(), at));
        }
        due
    }
}

/// What `iadeep run` says of one "wait" answer ([`QueueLog::answer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Said {
    /// The reason, in full.
    Reason,
    /// That the answer stayed the same: the job said it asks again because a GPU had
    /// more room, and the reason is not said again.
    Same,
    /// Nothing: the reason was said less than a minute ago.
    Nothing,
}

impl QueueLog {
    /// What to say of a wait answer whose reason is `reason`, at `at`, after an ask that a
    /// wake caused (`woken`, which the log said) or not: after "asking the placer again",
    /// silence read as if the job had stopped asking.
    pub fn answer(&mut self, reason: &str, at: Instant, woken: bool) -> Said {
        match (self.say(reason, at), woken) {
            (true, _) => Said::Reason,
            (false, true) => Said::Same,
            (false, false) => Said::Nothing,
        }
    }
}

/// `text` without its figures: the runs of digits that begin a word (`120 s`, `+0.12`),
/// not those inside one (`gpu0`, `lab1`), which name things.
fn without_figures(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut previous: Option<char> = None;
    let mut in_figure = false;
    for c in text.chars() {
        if c.is_ascii_digit() {
            in_figure = in_figure || !previous.is_some_and(|p| p.is_alphanumeric());
            if !in_figure {
                out.push(c);
            }
        } else {
            in_figure = false;
            out.push(c);
        }
        previous = Some(c);
    }
    out
}

/// The rejected GPUs' own reasons in the placer's explanation, the first `most` of
/// them: "GPU: why; GPU: why". The placer's summary only counts them by kind
/// (`throughput_gain: 1`), which says little to someone who has not read its code.
pub fn rejections(candidates: &[iadeep_proto::CandidateScore], most: usize) -> Option<String> {
    let named: Vec<String> = candidates
        .iter()
        .filter(|c| !c.feasible && !c.rejected_because.is_empty())
        .take(most)
        .map(|c| format!("{}: {}", c.device_id, c.rejected_because))
        .collect();
    (!named.is_empty()).then(|| named.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(residents: &[&str], reserved_mib: u64, memory_mib: u64) -> Seen {
        Seen {
            residents: residents.iter().map(|t| t.to_string()).collect(),
            reserved_mib,
            memory_mib,
        }
    }

    fn one(device: &str, seen: Seen) -> Snapshot {
        [(device.to_owned(), seen)].into()
    }

    fn candidates(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|d| d.to_string()).collect()
    }

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    /// A job that may use gpu0 only, told to wait at `t0` while resident `a` holds
    /// `reserved_mib` of gpu0's `memory_mib`.
    fn asked_beside_a(reserved_mib: u64, memory_mib: u64, t0: Instant) -> QueueWatch {
        let mut watch = QueueWatch::new();
        watch.asked(
            one("gpu0", seen(&["a"], reserved_mib, memory_mib)),
            candidates(&["gpu0"]),
            t0,
        );
        watch
    }

    #[test]
    fn a_shrinking_reservation_wakes_the_job() {
        let t0 = Instant::now();
        let mut watch = asked_beside_a(16_384, 16_384, t0);
        assert_eq!(
            watch.observe(one("gpu0", seen(&["a"], 16_384, 16_384)), t0 + s(2)),
            None
        );
        // The placer cut a's provisional reservation (the whole card) to its peak.
        assert_eq!(
            watch.observe(one("gpu0", seen(&["a"], 1_200, 16_384)), t0 + s(4)),
            Some(Wake::Shrunk {
                device: "gpu0".into(),
                from_mib: 16_384,
                to_mib: 1_200
            })
        );
        // Compared with the poll before, not with the ask: no second wake.
        assert_eq!(
            watch.observe(one("gpu0", seen(&["a"], 1_200, 16_384)), t0 + s(6)),
            None
        );
    }

    #[test]
    fn more_free_memory_wakes_the_job_and_more_reserved_does_not() {
        let t0 = Instant::now();
        let mut watch = asked_beside_a(8_000, 10_000, t0);
        // Another job joined: more reserved, not a reason to ask.
        assert_eq!(
            watch.observe(one("gpu0", seen(&["a", "b"], 9_000, 10_000)), t0 + s(2)),
            None
        );
        // The device was registered again with more memory.
        assert_eq!(
            watch.observe(one("gpu0", seen(&["a", "b"], 9_000, 16_000)), t0 + s(4)),
            Some(Wake::MoreFree {
                device: "gpu0".into(),
                from_mib: 1_000,
                to_mib: 7_000
            })
        );
    }

    #[test]
    fn only_candidate_devices_count_except_a_new_device() {
        let t0 = Instant::now();
        let mut watch = QueueWatch::new();
        let before: Snapshot = [
            ("gpu0".to_owned(), seen(&["a"], 8_000, 16_000)),
            ("far0".to_owned(), seen(&["x", "y"], 12_000, 16_000)),
        ]
        .into();
        watch.asked(before, candidates(&["gpu0"]), t0);
        let mut now: Snapshot = [
            ("gpu0".to_owned(), seen(&["a"], 8_000, 16_000)),
            ("far0".to_owned(), seen(&[], 0, 16_000)),
        ]
        .into();
        // Another machine's GPU emptied: not one this job may use.
        assert_eq!(watch.observe(now.clone(), t0 + s(2)), None);
        now.insert("gpu1".to_owned(), seen(&[], 0, 16_000));
        assert_eq!(
            watch.observe(now, t0 + s(4)),
            Some(Wake::Appeared {
                device: "gpu1".into()
            })
        );
    }

    #[test]
    fn a_queued_job_asks_again_when_the_job_ahead_leaves_or_a_candidate_is_idle() {
        let t0 = Instant::now();
        let gpu0 = |tasks: &[&str]| one("gpu0", seen(tasks, 1_000 * tasks.len() as u64, 16_000));
        // The snapshot before Place saw an empty GPU; another job was placed before
        // the decision, so this one was queued behind it.
        let mut watch = QueueWatch::new();
        watch.asked(gpu0(&[]), candidates(&["gpu0"]), t0);
        assert_eq!(watch.observe(gpu0(&["other"]), t0 + s(2)), None);
        assert_eq!(watch.observe(gpu0(&["other"]), t0 + s(4)), None);
        assert_eq!(watch.observe(gpu0(&["other", "third"]), t0 + s(6)), None);
        assert_eq!(
            watch.observe(gpu0(&["third"]), t0 + s(8)),
            Some(Wake::Left {
                device: "gpu0".into(),
                task: "other".into()
            })
        );
        // The other job came and went between two polls: the GPU is idle.
        let mut watch = QueueWatch::new();
        watch.asked(gpu0(&[]), candidates(&["gpu0"]), t0);
        assert_eq!(
            watch.observe(gpu0(&[]), t0 + s(2)),
            Some(Wake::Idle {
                device: "gpu0".into()
            })
        );
        // An idle GPU the job may not use is no reason to ask.
        let mut watch = QueueWatch::new();
        watch.asked(gpu0(&[]), candidates(&["gpu1"]), t0);
        assert_eq!(watch.observe(gpu0(&[]), t0 + s(2)), None);
    }

    #[test]
    fn asks_again_within_seconds_while_a_reservation_may_shrink() {
        let t0 = Instant::now();
        let mut watch = asked_beside_a(16_000, 16_000, t0);
        // a is new to this job: its reservation may still shrink.
        assert_eq!(watch.ask_again_after(s(60), t0).after, SETTLING_RETRY);
        assert_eq!(
            watch.ask_again_after(s(2), t0).after,
            s(2),
            "a shorter hint stands"
        );
        // A minute on, a's reservation is what it will be: the placer's hint stands.
        let later = t0 + SETTLING + s(1);
        watch.asked(
            one("gpu0", seen(&["a"], 1_000, 16_000)),
            candidates(&["gpu0"]),
            later,
        );
        assert_eq!(watch.ask_again_after(s(60), later).after, s(60));
        assert_eq!(watch.ask_again_after(s(600), later).after, MAX_RETRY);
        assert_eq!(
            watch.ask_again_after(Duration::ZERO, later).after,
            MIN_RETRY
        );
        // A new resident arrives: asks within seconds again, for a while.
        let b_at = later + s(3);
        assert_eq!(
            watch.observe(one("gpu0", seen(&["a", "b"], 17_000, 16_000)), b_at),
            None
        );
        assert_eq!(watch.ask_again_after(s(60), b_at).after, SETTLING_RETRY);
        assert_eq!(watch.ask_again_after(s(60), b_at + SETTLING).after, s(60));
    }

    /// Each wait comes with its reason, the one the message gives.
    #[test]
    fn the_wait_comes_with_its_reason() {
        let t0 = Instant::now();
        let watch = asked_beside_a(16_000, 16_000, t0);
        let retry = |hint, at| watch.ask_again_after(hint, at);
        let later = t0 + SETTLING;
        assert_eq!(retry(s(60), t0).why, RetryWhy::Settling);
        assert_eq!(retry(s(600), t0).why, RetryWhy::Settling);
        assert_eq!(retry(s(3), t0).why, RetryWhy::Hint);
        assert_eq!(retry(SETTLING_RETRY, t0).why, RetryWhy::Hint);
        assert_eq!(
            retry(Duration::from_millis(100), t0),
            Retry {
                after: MIN_RETRY,
                why: RetryWhy::AtMostEvery
            }
        );
        assert_eq!(
            retry(s(595), later),
            Retry {
                after: MAX_RETRY,
                why: RetryWhy::AtLeastEvery
            }
        );
        assert_eq!(
            retry(s(60), later),
            Retry {
                after: s(60),
                why: RetryWhy::Hint
            }
        );
    }

    /// The placer's reason says "retry after N s": the message says when the job
    /// asks again, and why that is not N s when it is not.
    #[test]
    fn says_when_it_asks_again_and_why_not_when_the_placer_suggests() {
        let t0 = Instant::now();
        let watch = asked_beside_a(16_000, 16_000, t0);
        let sooner = "asking again as soon as a GPU is registered or one this job may use \
                      has more room, else in";
        assert_eq!(
            watch.next_ask(s(60), t0),
            format!(
                "{sooner} 5 s rather than the 60 s the placer suggests, because a job that \
                 arrived on a GPU this job may use less than 60 s ago may still shrink its \
                 reservation or change what the placer predicts"
            )
        );
        assert_eq!(
            watch.next_ask(s(3), t0),
            format!("{sooner} 3 s, as the placer suggests")
        );
        let later = t0 + SETTLING;
        assert_eq!(
            watch.next_ask(s(60), later),
            format!("{sooner} 60 s, as the placer suggests")
        );
        assert_eq!(
            watch.next_ask(s(595), later),
            format!(
                "{sooner} 60 s rather than the 595 s the placer suggests: iadeep run asks \
                 at least every 60 s"
            )
        );
        assert_eq!(
            watch.next_ask(Duration::from_millis(100), later),
            format!(
                "{sooner} 0.5 s rather than the 0.1 s the placer suggests: iadeep run asks \
                 at most every 0.5 s"
            )
        );
    }

    #[test]
    fn a_resident_seen_again_after_it_left_is_new() {
        let t0 = Instant::now();
        let mut watch = asked_beside_a(1_000, 16_000, t0);
        let t1 = t0 + SETTLING * 2;
        watch.observe(one("gpu0", seen(&["b"], 1_000, 16_000)), t1);
        assert!(watch.settling(t1), "b is new");
        let t2 = t1 + SETTLING;
        watch.observe(one("gpu0", seen(&["a"], 1_000, 16_000)), t2);
        assert!(watch.settling(t2), "a came back: a new start");
        assert!(!watch.settling(t2 + SETTLING));
    }

    #[test]
    fn a_list_becomes_a_snapshot() {
        let status = DeviceStatus {
            device: Some(iadeep_proto::DeviceInfo {
                device_id: "gpu0".into(),
                memory_mib: 16_000,
                ..Default::default()
            }),
            resident_task_ids: vec!["a".into(), "b".into()],
            reserved_mem_mib: 3_000,
        };
        let nameless = DeviceStatus {
            device: None,
            ..Default::default()
        };
        assert_eq!(
            snapshot(&[status, nameless]),
            one("gpu0", seen(&["a", "b"], 3_000, 16_000))
        );
    }

    /// A reason is said when new, and the same one again only a minute later.
    #[test]
    fn a_wait_is_said_when_its_reason_changes_and_once_a_minute() {
        let t0 = Instant::now();
        let mut log = QueueLog::default();
        assert!(log.say("full", t0));
        assert!(!log.say("full", t0 + s(5)));
        assert!(log.say("capped", t0 + s(10)));
        assert!(!log.say("capped", t0 + s(69)));
        assert!(log.say("capped", t0 + s(70)));
        assert!(log.say("waiting about 120 s", t0 + s(71)));
        assert!(
            !log.say("waiting about 95 s", t0 + s(76)),
            "only its figure moved"
        );
        assert!(log.say("waiting about 95 s for lab1-gpu1", t0 + s(77)));
        assert!(
            log.say("waiting about 95 s for lab1-gpu2", t0 + s(78)),
            "another GPU"
        );
        assert_eq!(
            without_figures("PD +0.12 on gpu10, 3 ahead"),
            "PD +. on gpu10,  ahead"
        );
    }

    #[test]
    fn an_ask_a_wake_caused_says_when_the_answer_stayed_the_same() {
        let t0 = Instant::now();
        let mut log = QueueLog::default();
        assert_eq!(log.answer("full", t0, false), Said::Reason);
        assert_eq!(log.answer("full", t0 + s(5), false), Said::Nothing);
        assert_eq!(log.answer("full", t0 + s(7), true), Said::Same);
        assert_eq!(log.answer("capped", t0 + s(9), true), Said::Reason);
        assert_eq!(log.answer("capped", t0 + s(70), true), Said::Reason);
    }

    #[test]
    fn the_rejected_gpus_are_named_with_their_reasons() {
        let candidate = |id: &str, feasible, why: &str| iadeep_proto::CandidateScore {
            device_id: id.into(),
            feasible,
            rejected_because: why.into(),
            ..Default::default()
        };
        let all = [
            candidate("gpu0", true, ""),
            candidate("gpu1", false, "sharing gains too little"),
            candidate("gpu2", false, "memory"),
            candidate("gpu3", false, "claimed"),
        ];
        assert_eq!(
            rejections(&all, 2).as_deref(),
            Some("gpu1: sharing gains too little; gpu2: memory")
        );
        assert_eq!(rejections(&all[..1], 2), None);
    }
}
