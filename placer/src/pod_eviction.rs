//! Which Kubernetes pods to evict: those of tasks the placer told to leave that are
//! still there `grace` after this placer first saw the order.
//!
//! Why: the placer evicts an opportunistic job by writing its assignment with `evict`
//! set (a room eviction, or [`crate::eviction`] on a cap breach). The job's agent raises
//! `iadeep.Evicted` and gives up its lease, and the reaper gives the job's GPU memory to
//! others `--dead-task-grace-s` (60 s) after that. Outside Kubernetes `iadeep run` stops
//! a job that ignores the order; inside, nothing would: a training loop that swallows
//! `iadeep.Evicted`, hangs checkpointing or has no agent keeps its pod running on the GPU
//! after its memory was given away. So the placer's Kubernetes driver
//! (`extender::pod_evictor`) asks the API server to evict such a pod (a `policy/v1`
//! Eviction, which honours PodDisruptionBudgets), and kubelet then gives it its
//! `terminationGracePeriodSeconds` to stop ([`KUBELET_TERMINATION_GRACE`] by default).
//! [`check_grace`] keeps the two under the dead-task grace; the daemon refuses to start
//! otherwise (`Daemon::start`).
//!
//! This module is the decision alone, without a clock or I/O (raft-rs style): the
//! driver hands it the view and the time at each tick and tells it what the API
//! answered. A task's pod is the one its extender-built spec names
//! (`TaskSpec.kubernetes_pod`); a task placed over gRPC names none and is never acted on.
//!
//! **Grace.** It starts when *this* placer first sees the order, not at the order's
//! write time: a placer restarted meanwhile starts it again, so a pod is only ever
//! evicted later than `grace` after the order, never earlier (a skewed clock or a stale
//! `assigned_at_unix_ms` cannot cut the job's time to checkpoint short).
//!
//! **Once.** A pod the API accepted an Eviction for (or that was found gone) is never
//! evicted again while its task holds its reservation. An order that was withdrawn (the
//! assignment no longer says `evict`), or a task that was released, is forgotten: a new
//! order starts a new grace.
//!
//! **Retries.** A PodDisruptionBudget that refuses the eviction (HTTP 429) is asked
//! again at the next tick (the decision records nothing of it: the budget frees up
//! when another pod becomes ready); any other failure backs off, doubling from [`FIRST_BACKOFF`] up to [`MAX_BACKOFF`].

use std::collections::BTreeMap;
use std::time::Duration;

use iadeep_state::Backoff;

use crate::error::{PlacerError, Result};
use crate::view::ClusterView;

/// Default of [`crate::PlacerParams::pod_evict_grace`]: with kubelet's default
/// termination grace ([`KUBELET_TERMINATION_GRACE`]) 50 s, under the 60 s default
/// dead-task grace, and the same order as `iadeep run --evict-grace` (30 s).
pub const DEFAULT_POD_EVICT_GRACE: Duration = Duration::from_secs(20);

/// Kubernetes' default `terminationGracePeriodSeconds`: how long kubelet lets an evicted
/// pod stop after SIGTERM before it kills it.
pub const KUBELET_TERMINATION_GRACE: Duration = Duration::from_secs(30);

/// First wait after an eviction failed for a reason other than a disruption budget.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Longest wait between two tries of a failing eviction.
pub const MAX_BACKOFF: Duration = Duration::from_secs(8);

/// Refuses a pod-eviction grace that, with kubelet's default termination grace, is not
/// under the dead-task grace (`None`: never released, anything goes): the placer gives
/// an evicted job's memory away that long after its agent gave up its lease, and the
/// pod must be gone by then.
pub fn check_grace(pod_evict_grace: Duration, dead_task_grace: Option<Duration>) -> Result<()> {
    let Some(dead) = dead_task_grace else {
        return Ok(());
    };
    let total = pod_evict_grace.saturating_add(KUBELET_TERMINATION_GRACE);
    if total >= dead {
        return Err(PlacerError::InvalidParams {
            name: "pod_evict_grace",
            reason: format!(
                "{pod_evict_grace:?} plus kubelet's default termination grace \
                 ({KUBELET_TERMINATION_GRACE:?}) is {total:?}, not under the dead-task grace \
                 ({dead:?}): an evicted pod could still run on the GPU after its memory was \
                 given to another job; lower --pod-evict-grace or raise --dead-task-grace-s"
            ),
        });
    }
    Ok(())
}

/// A pod to evict, and why.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DuePod {
    pub task_id: String,
    pub device_id: String,
    pub namespace: String,
    pub name: String,
    /// The pod's UID when the spec carried one: the Eviction's precondition.
    pub uid: String,
    /// The eviction's reason, as the assignment gives it.
    pub reason: String,
}

impl DuePod {
    /// `namespace/name`, for logs.
    pub fn pod(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    pub(crate) fn key(&self) -> Key {
        (
            self.task_id.clone(),
            self.namespace.clone(),
            self.name.clone(),
            self.uid.clone(),
        )
    }
}

/// A task and its pod: a task placed again in a new pod is a new entry.
pub(crate) type Key = (String, String, String, String);

#[derive(Clone, Debug, PartialEq)]
enum State {
    /// Not evicted yet; the next try not before `next_try_ms`, `last_pause` after the
    /// last failure in a row (`None` before any).
    Pending {
        last_pause: Option<Duration>,
        next_try_ms: i64,
    },
    /// The API accepted its Eviction, or the pod was gone: never again.
    Done,
}

#[derive(Clone, Debug, PartialEq)]
struct Tracked {
    first_seen_ms: i64,
    state: State,
}

/// What this placer knows of the eviction orders it has seen (see the module's
/// documentation). Starts empty: a new placer starts every grace again.
#[derive(Clone, Debug, Default)]
pub struct PodEvictions {
    tracked: BTreeMap<Key, Tracked>,
}

impl PodEvictions {
    /// Notes the orders in `view` (first seen at `now_unix_ms`), forgets those gone from
    /// it, and returns the pods to evict now: ordered at least `grace` ago as this placer
    /// saw it, not evicted yet, and not backing off.
    pub fn due(&mut self, view: &ClusterView, now_unix_ms: i64, grace: Duration) -> Vec<DuePod> {
        let ordered = ordered_pods(view);
        self.tracked
            .retain(|key, _| ordered.iter().any(|pod| &pod.key() == key));
        let grace_ms = i64::try_from(grace.as_millis()).unwrap_or(i64::MAX);
        let mut due = Vec::new();
        for pod in ordered {
            let tracked = self.tracked.entry(pod.key()).or_insert(Tracked {
                first_seen_ms: now_unix_ms,
                state: State::Pending {
                    last_pause: None,
                    next_try_ms: i64::MIN,
                },
            });
            let State::Pending { next_try_ms, .. } = tracked.state else {
                continue;
            };
            if now_unix_ms.saturating_sub(tracked.first_seen_ms) >= grace_ms
                && now_unix_ms >= next_try_ms
            {
                due.push(pod);
            }
        }
        due
    }

    /// The API accepted the pod's Eviction, or the pod is gone: it is never evicted again.
    pub fn done(&mut self, pod: &DuePod) {
        if let Some(tracked) = self.tracked.get_mut(&pod.key()) {
            tracked.state = State::Done;
        }
    }

    /// The eviction failed otherwise at `now_unix_ms`: the pod waits before the next
    /// try, twice as long as after the previous failure (from [`FIRST_BACKOFF`], at
    /// most [`MAX_BACKOFF`]). Returns the wait.
    pub fn failed(&mut self, pod: &DuePod, now_unix_ms: i64) -> Duration {
        let Some(tracked) = self.tracked.get_mut(&pod.key()) else {
            return Duration::ZERO;
        };
        let State::Pending { last_pause, .. } = tracked.state else {
            return Duration::ZERO;
        };
        let backoff = Backoff::doubling(FIRST_BACKOFF, MAX_BACKOFF);
        let wait = last_pause.map_or(backoff.first(), |p| backoff.after(p));
        tracked.state = State::Pending {
            last_pause: Some(wait),
            next_try_ms: now_unix_ms
                .saturating_add(i64::try_from(wait.as_millis()).unwrap_or(i64::MAX)),
        };
        wait
    }

    /// How many orders are being followed (done ones included), for tests and logs.
    pub fn len(&self) -> usize {
        self.tracked.len()
    }

    /// Whether no order is being followed.
    pub fn is_empty(&self) -> bool {
        self.tracked.is_empty()
    }
}

/// The pods of the residents told to leave: their assignment says `evict`, their spec
/// names a pod, and they have not reported finishing (a finished job's pod ends on its
/// own, and the reaper releases it as soon as its agent is gone).
fn ordered_pods(view: &ClusterView) -> Vec<DuePod> {
    let mut out = Vec::new();
    for (device_id, device) in view.devices() {
        for resident in &device.residents {
            let Some((assignment, _)) = resident.assignment.as_ref().filter(|(a, _)| a.evict)
            else {
                continue;
            };
            let Some(pod) = resident.spec().kubernetes_pod.as_ref() else {
                continue;
            };
            if resident.report.as_ref().is_some_and(|r| r.finished) {
                continue;
            }
            out.push(DuePod {
                task_id: resident.reservation.task_id.clone(),
                device_id: device_id.to_owned(),
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                uid: pod.uid.clone(),
                reason: assignment.evict_reason.clone(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::model::ModelledMemory;
    use iadeep_proto::{
        BatchSizeAssignment, DeviceInfo, DeviceResidents, KubernetesPod, Reservation, TaskReport,
        TaskSpec,
    };

    const GRACE: Duration = Duration::from_secs(20);
    /// When the order is first seen in these tests, Unix ms.
    const T0: i64 = 1_700_000_000_000;

    fn pod(name: &str) -> KubernetesPod {
        KubernetesPod {
            namespace: "ml".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    /// A device `d0` with one resident per entry: (task, its pod, evict flag).
    fn view(residents: &[(&str, Option<KubernetesPod>, bool)]) -> ClusterView {
        let mut view = ClusterView::new(Arc::new(ModelledMemory));
        view.upsert_device(DeviceInfo {
            device_id: "d0".into(),
            node: "n0".into(),
            memory_mib: 16_000,
            ..Default::default()
        });
        let record = DeviceResidents {
            device_id: "d0".into(),
            reservations: residents
                .iter()
                .map(|(task, pod, _)| Reservation {
                    task_id: (*task).into(),
                    reserved_mem_mib: 1000,
                    placed_at_unix_ms: T0 - 60_000,
                    spec: Some(TaskSpec {
                        task_id: (*task).into(),
                        initial_batch_size: 32,
                        kubernetes_pod: pod.clone(),
                        ..Default::default()
                    }),
                    provisional: false,
                })
                .collect(),
            claims: Vec::new(),
        };
        view.apply_residents("d0", Some(record), 1);
        for (task, _, evict) in residents {
            view.set_assignment(
                BatchSizeAssignment {
                    task_id: (*task).into(),
                    batch_size: 32,
                    round: 3,
                    evict: *evict,
                    evict_reason: if *evict {
                        "prod-1 at PD 1.31 above its cap 1.10".into()
                    } else {
                        String::new()
                    },
                    ..Default::default()
                },
                2,
            );
        }
        view
    }

    fn names(due: &[DuePod]) -> Vec<String> {
        due.iter().map(DuePod::pod).collect()
    }

    #[test]
    fn an_evicted_pod_is_due_only_once_its_grace_has_passed() {
        let v = view(&[
            ("a", Some(pod("a-0")), true),
            ("b", Some(pod("b-0")), false),
        ]);
        let mut evictions = PodEvictions::default();
        assert!(evictions.due(&v, T0, GRACE).is_empty(), "first seen now");
        assert!(
            evictions.due(&v, T0 + 19_999, GRACE).is_empty(),
            "a millisecond before the grace ends"
        );
        let due = evictions.due(&v, T0 + 20_000, GRACE);
        assert_eq!(names(&due), ["ml/a-0"]);
        assert_eq!(due[0].uid, "uid-a-0");
        assert_eq!(due[0].device_id, "d0");
        assert!(due[0].reason.contains("prod-1"), "{:?}", due[0].reason);
    }

    #[test]
    fn a_pod_the_api_accepted_is_never_evicted_again() {
        let v = view(&[("a", Some(pod("a-0")), true)]);
        let mut evictions = PodEvictions::default();
        evictions.due(&v, T0, GRACE);
        let due = evictions.due(&v, T0 + 20_000, GRACE);
        assert_eq!(names(&due), ["ml/a-0"]);
        evictions.done(&due[0]);
        assert!(evictions.due(&v, T0 + 21_000, GRACE).is_empty());
        assert!(evictions.due(&v, T0 + 600_000, GRACE).is_empty());
    }

    #[test]
    fn a_task_without_a_pod_is_left_to_its_launcher() {
        let v = view(&[("grpc-task", None, true)]);
        let mut evictions = PodEvictions::default();
        evictions.due(&v, T0, GRACE);
        assert!(evictions.due(&v, T0 + 600_000, GRACE).is_empty());
        assert!(evictions.is_empty());
    }

    #[test]
    fn a_withdrawn_order_or_a_released_task_is_forgotten() {
        let mut evictions = PodEvictions::default();
        let ordered = view(&[("a", Some(pod("a-0")), true)]);
        evictions.due(&ordered, T0, GRACE);
        // The order is withdrawn before the grace ends: nothing, now or later.
        let withdrawn = view(&[("a", Some(pod("a-0")), false)]);
        assert!(evictions.due(&withdrawn, T0 + 10_000, GRACE).is_empty());
        assert!(evictions.is_empty());
        assert!(evictions.due(&withdrawn, T0 + 30_000, GRACE).is_empty());
        // Ordered again: a new grace from when it is seen again.
        assert!(evictions.due(&ordered, T0 + 40_000, GRACE).is_empty());
        assert!(evictions.due(&ordered, T0 + 59_999, GRACE).is_empty());
        assert_eq!(
            names(&evictions.due(&ordered, T0 + 60_000, GRACE)),
            ["ml/a-0"]
        );
        // Released (gone from the device): forgotten.
        let released = view(&[]);
        assert!(evictions.due(&released, T0 + 61_000, GRACE).is_empty());
        assert!(evictions.is_empty());
    }

    #[test]
    fn a_finished_job_is_not_evicted() {
        let mut v = view(&[("a", Some(pod("a-0")), true)]);
        v.set_report(TaskReport {
            task_id: "a".into(),
            device_id: "d0".into(),
            finished: true,
            ..Default::default()
        });
        let mut evictions = PodEvictions::default();
        evictions.due(&v, T0, GRACE);
        assert!(evictions.due(&v, T0 + 600_000, GRACE).is_empty());
    }

    /// A restarted placer (a fresh `PodEvictions`) starts the grace again: later, never
    /// earlier, whatever the order's write time says.
    #[test]
    fn a_restarted_placer_starts_the_grace_again() {
        let v = view(&[("a", Some(pod("a-0")), true)]);
        let mut before = PodEvictions::default();
        before.due(&v, T0, GRACE);
        let mut restarted = PodEvictions::default();
        assert!(restarted.due(&v, T0 + 15_000, GRACE).is_empty());
        assert!(restarted.due(&v, T0 + 34_999, GRACE).is_empty());
        assert_eq!(names(&restarted.due(&v, T0 + 35_000, GRACE)), ["ml/a-0"]);
    }

    #[test]
    fn a_disruption_budget_retries_at_once_and_other_failures_back_off() {
        let v = view(&[("a", Some(pod("a-0")), true)]);
        let mut evictions = PodEvictions::default();
        evictions.due(&v, T0, GRACE);
        let at = T0 + 20_000;
        let due = evictions.due(&v, at, GRACE);
        // A disruption budget refused it: nothing is recorded, so it is due again.
        assert_eq!(names(&evictions.due(&v, at + 1, GRACE)), ["ml/a-0"]);
        // Other failures: 1 s, 2 s, 4 s, 8 s, 8 s.
        let mut now = at + 1;
        for expected in [1, 2, 4, 8, 8] {
            let wait = evictions.failed(&due[0], now);
            assert_eq!(wait, Duration::from_secs(expected));
            let wait_ms = (expected * 1000) as i64;
            assert!(evictions.due(&v, now + wait_ms - 1, GRACE).is_empty());
            now += wait_ms;
            assert_eq!(names(&evictions.due(&v, now, GRACE)), ["ml/a-0"]);
        }
    }

    #[test]
    fn the_graces_must_end_before_the_memory_is_given_away() {
        let dead = Some(Duration::from_secs(60));
        check_grace(DEFAULT_POD_EVICT_GRACE, dead).expect("the defaults");
        check_grace(Duration::from_secs(29), dead).expect("59 s");
        let err = check_grace(Duration::from_secs(30), dead).expect_err("60 s is not under 60 s");
        assert!(err.to_string().contains("pod_evict_grace"), "{err}");
        check_grace(Duration::from_secs(3600), None).expect("never released");
        check_grace(Duration::from_secs(20), Some(Duration::from_secs(40)))
            .expect_err("a short dead-task grace");
    }
}
