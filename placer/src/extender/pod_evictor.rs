//! Evicts, through the Kubernetes API, the pods of tasks that did not leave when the
//! placer told them to: the thin driver of [`crate::pod_eviction`], which decides.
//!
//! The daemon runs it (see [`spawn`]) only when the extender binds pods through the
//! Kubernetes API (`--kube-api`): a task knows its pod only when the extender's bind
//! placed it. Every [`PERIOD`] a [`PodEvictor::tick`] asks the decision which pods are
//! due and, for each, reads the pod (a pod gone, re-created under the same name, ended
//! or already terminating is left alone and counts as done) and creates its `policy/v1`
//! Eviction with the pod's UID as precondition. Accepted (201) or gone (404): never
//! again. Refused by a PodDisruptionBudget (429): again at the next tick, logged at info
//! when the refusals start and at debug while they go on. Any other
//! failure: again after a backoff. Each outcome is logged with the task, the pod and the
//! eviction's reason, and counted in `iadeep_placer_pod_evictions_total{outcome}`.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::kube_api::{ApiCallError, EvictionAnswer, KubeApi};
use crate::error::Result;
use crate::metrics::PlacerMetrics;
use crate::pod_eviction::{DuePod, KUBELET_TERMINATION_GRACE, Key, PodEvictions};
use crate::service::PlacementService;

/// How often the daemon's driver looks for pods to evict; a pass with none reads the
/// view only.
pub const PERIOD: Duration = Duration::from_secs(1);

/// Longest each call to the Kubernetes API may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// What one tick did with a due pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodEvictionOutcome {
    /// The API server accepted the pod's Eviction.
    Evicted,
    /// Nothing to evict (why): the pod is gone, was re-created, ended or is terminating.
    Gone(String),
    /// A PodDisruptionBudget refused the eviction for now (why); tried again next tick.
    /// `again`: it refused at the last tick too (logged then, so at debug now).
    Blocked { why: String, again: bool },
    /// The eviction failed (why); tried again after `retry_in`.
    Failed { why: String, retry_in: Duration },
}

/// The driver's state: the decision's memory, the API client and the grace.
#[derive(Debug)]
pub struct PodEvictor {
    service: PlacementService,
    kube: KubeApi,
    metrics: Arc<PlacerMetrics>,
    grace: Duration,
    evictions: PodEvictions,
    /// The pods a PodDisruptionBudget refused at the last tick: a budget may refuse for
    /// hours, and one line a second for it would bury the log.
    blocked: HashSet<Key>,
}

impl PodEvictor {
    /// A driver for the tasks in `service`'s view, evicting through `kube` after the
    /// placer's [`crate::PlacerParams::pod_evict_grace`], counting in `metrics`.
    pub fn new(service: PlacementService, kube: KubeApi, metrics: Arc<PlacerMetrics>) -> Self {
        let grace = service.placer().params().pod_evict_grace;
        PodEvictor {
            service,
            kube,
            metrics,
            grace,
            evictions: PodEvictions::default(),
            blocked: HashSet::new(),
        }
    }

    /// The same driver with another grace.
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// One pass at `now_unix_ms`: evicts the pods due then. Returns what it did with each.
    pub async fn tick(&mut self, now_unix_ms: i64) -> Vec<(DuePod, PodEvictionOutcome)> {
        let due = {
            let view = self.service.view();
            self.evictions.due(&view, now_unix_ms, self.grace)
        };
        let mut done = Vec::with_capacity(due.len());
        let mut blocked = HashSet::new();
        for pod in due {
            let outcome = self.evict(&pod, now_unix_ms).await;
            self.report(&pod, &outcome);
            if matches!(outcome, PodEvictionOutcome::Blocked { .. }) {
                blocked.insert(pod.key());
            }
            done.push((pod, outcome));
        }
        // A pod refused at every tick is due at every tick, so this keeps exactly the
        // refusals that go on (and forgets a withdrawn order's).
        self.blocked = blocked;
        done
    }

    async fn evict(&mut self, pod: &DuePod, now_unix_ms: i64) -> PodEvictionOutcome {
        let grace_s = match self.to_evict(pod).await {
            Ok(grace_s) => grace_s,
            Err(why) => {
                self.evictions.done(pod);
                return PodEvictionOutcome::Gone(why);
            }
        };
        let deadline = Instant::now() + CALL_TIMEOUT;
        match self
            .kube
            .evict(&pod.namespace, &pod.name, &pod.uid, grace_s, deadline)
            .await
        {
            EvictionAnswer::Accepted => {
                self.evictions.done(pod);
                PodEvictionOutcome::Evicted
            }
            EvictionAnswer::Gone => {
                self.evictions.done(pod);
                PodEvictionOutcome::Gone("the pod no longer exists".to_owned())
            }
            EvictionAnswer::Blocked(why) => PodEvictionOutcome::Blocked {
                why,
                again: self.blocked.contains(&pod.key()),
            },
            EvictionAnswer::Failed(why) => {
                // From when the calls ended, which may be seconds after the tick began:
                // a pause counted from before them could be over before it is set.
                let now_unix_ms = self.service.now_unix_ms().max(now_unix_ms);
                let retry_in = self.evictions.failed(pod, now_unix_ms);
                PodEvictionOutcome::Failed { why, retry_in }
            }
        }
    }

    /// The termination grace to ask for the pod's eviction, or why it needs none, as
    /// the API server's copy says. A pod that cannot be read is evicted all the same
    /// (the Eviction's own answer settles it).
    async fn to_evict(&self, pod: &DuePod) -> Result<i64, String> {
        let deadline = Instant::now() + CALL_TIMEOUT;
        match self.kube.pod(&pod.namespace, &pod.name, deadline).await {
            Ok(now) => match settled(&now, pod) {
                Some(why) => Err(why),
                None => Ok(termination_grace_s(&now)),
            },
            Err(ApiCallError::Refused { code: 404, .. }) => {
                Err("the pod no longer exists".to_owned())
            }
            Err(_) => Ok(termination_grace_s(&Pod::default())),
        }
    }

    fn report(&self, pod: &DuePod, outcome: &PodEvictionOutcome) {
        let (task, name, device, reason) = (
            pod.task_id.as_str(),
            pod.pod(),
            pod.device_id.as_str(),
            pod.reason.as_str(),
        );
        let grace = self.grace;
        match outcome {
            PodEvictionOutcome::Evicted => {
                self.metrics.pod_evicted.inc();
                tracing::warn!(task, pod = %name, device, reason, ?grace,
                    "evicted the pod of a task still running after it was told to leave");
            }
            PodEvictionOutcome::Gone(why) => {
                self.metrics.pod_eviction_gone.inc();
                tracing::info!(task, pod = %name, device, why = %why,
                    "no pod to evict for a task told to leave");
            }
            PodEvictionOutcome::Blocked { why, again } => {
                self.metrics.pod_eviction_blocked.inc();
                if *again {
                    tracing::debug!(task, pod = %name, device, why = %why,
                        "a PodDisruptionBudget still refuses the pod's eviction");
                } else {
                    tracing::info!(task, pod = %name, device, why = %why,
                        "a PodDisruptionBudget refused the pod's eviction; trying again \
                         every tick (further refusals logged at debug)");
                }
            }
            PodEvictionOutcome::Failed { why, retry_in } => {
                self.metrics.pod_eviction_failed.inc();
                tracing::warn!(task, pod = %name, device, why = %why, ?retry_in,
                    "could not evict the pod of a task told to leave; trying again");
            }
        }
    }
}

/// The termination grace the Eviction asks for: the pod's own, at most kubelet's default
/// ([`KUBELET_TERMINATION_GRACE`]), which [`crate::pod_eviction::check_grace`] counts on
/// to end before the placer gives the pod's memory away (training pods often ask for
/// minutes to checkpoint; they had `--pod-evict-grace` for that already).
fn termination_grace_s(pod: &Pod) -> i64 {
    let most = i64::try_from(KUBELET_TERMINATION_GRACE.as_secs()).unwrap_or(i64::MAX);
    pod.spec
        .as_ref()
        .and_then(|s| s.termination_grace_period_seconds)
        .map_or(most, |own| own.clamp(0, most))
}

/// Why the API server's copy of a pod needs no eviction: it is not the pod the
/// extender bound for `due`'s task on `due`'s device (its `iadeep.io/task-id` and
/// `iadeep.io/device-id` annotations, which the bind writes, say otherwise), it is
/// another pod of the same name (not `due`'s UID), it ended, or it is terminating
/// already. The annotations are the check that matters: the pod a task names comes
/// from its spec in the store, which the task's own agent may write (a readmission
/// places a task again from it), so without them any store writer could have the
/// placer evict any pod.
fn settled(pod: &Pod, due: &DuePod) -> Option<String> {
    let annotation = |key: &str| {
        pod.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .map_or("", String::as_str)
    };
    let task = annotation(&format!("{}task-id", super::pod::ANNOTATION_PREFIX));
    let device = annotation(super::DEVICE_ANNOTATION);
    if task != due.task_id || device != due.device_id {
        return Some(format!(
            "the pod is not the one bound for task {} on {} (its annotations say task \
             {task:?} on {device:?}): not evicted",
            due.task_id, due.device_id
        ));
    }
    let uid = due.uid.as_str();
    let has = pod.metadata.uid.as_deref().unwrap_or("");
    if !uid.is_empty() && has != uid {
        return Some(format!(
            "the pod was re-created under the same name (UID {has}, not {uid})"
        ));
    }
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    if let Some(phase @ ("Succeeded" | "Failed")) = phase {
        return Some(format!("the pod ended ({phase})"));
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Some("the pod is terminating already".to_owned());
    }
    None
}

/// Runs `evictor` every [`PERIOD`], at the service's time, until `stop` turns true (or
/// its sender is dropped).
pub fn spawn(mut evictor: PodEvictor, stop: watch::Receiver<bool>) -> JoinHandle<Result<()>> {
    tokio::spawn(async move {
        let mut every = crate::every::Every::new(PERIOD, stop);
        while every.next().await {
            let now = evictor.service.now_unix_ms();
            evictor.tick(now).await;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).expect("pod")
    }

    #[test]
    fn a_pod_that_ended_was_recreated_or_terminates_needs_no_eviction() {
        let bound = json!({"iadeep.io/task-id": "ml.a", "iadeep.io/device-id": "n1-gpu0"});
        let running = pod(json!({"metadata": {"name": "a", "uid": "u1",
            "annotations": bound}, "status": {"phase": "Running"}}));
        assert_eq!(settled(&running, &due("u1")), None);
        assert_eq!(settled(&running, &due("")), None, "no UID to compare");
        assert!(settled(&running, &due("u0")).is_some_and(|w| w.contains("re-created")));
        for phase in ["Succeeded", "Failed"] {
            let ended = pod(json!({"metadata": {"name": "a", "uid": "u1",
                "annotations": bound}, "status": {"phase": phase}}));
            assert!(settled(&ended, &due("u1")).is_some_and(|w| w.contains(phase)));
        }
        let terminating = pod(json!({"metadata": {"name": "a", "uid": "u1",
            "annotations": bound, "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": "Running"}}));
        assert!(settled(&terminating, &due("u1")).is_some_and(|w| w.contains("terminating")));
    }

    /// A spec in the store can name any pod (the task's agent writes it): only the pod
    /// the extender bound for that task on that device is evicted.
    #[test]
    fn a_pod_not_bound_for_the_task_is_never_evicted() {
        let other = |annotations: serde_json::Value| {
            pod(
                json!({"metadata": {"name": "a", "uid": "u1", "annotations": annotations},
                "status": {"phase": "Running"}}),
            )
        };
        for annotations in [
            json!({}),
            json!({"iadeep.io/task-id": "ml.b", "iadeep.io/device-id": "n1-gpu0"}),
            json!({"iadeep.io/task-id": "ml.a", "iadeep.io/device-id": "n1-gpu1"}),
        ] {
            let verdict = settled(&other(annotations.clone()), &due("u1"));
            assert!(
                verdict
                    .as_deref()
                    .is_some_and(|w| w.contains("not the one bound")),
                "{annotations}: {verdict:?}"
            );
        }
        let unannotated = pod(json!({"metadata": {"name": "a", "uid": "u1"},
            "status": {"phase": "Running"}}));
        assert!(settled(&unannotated, &due("")).is_some());
    }

    /// A pod that asks for minutes to stop gets kubelet's default at most; one asking
    /// for less keeps its own.
    #[test]
    fn the_eviction_asks_for_at_most_kubelets_default_grace() {
        let with = |grace: serde_json::Value| {
            pod(json!({"metadata": {"name": "a"},
                "spec": {"containers": [], "terminationGracePeriodSeconds": grace}}))
        };
        assert_eq!(termination_grace_s(&with(json!(600))), 30);
        assert_eq!(termination_grace_s(&with(json!(5))), 5);
        assert_eq!(
            termination_grace_s(&pod(json!({"metadata": {"name": "a"}}))),
            30
        );
    }

    /// Task `ml.a` on `n1-gpu0`, its pod `ml/a` with UID `uid`.
    fn due(uid: &str) -> DuePod {
        DuePod {
            task_id: "ml.a".into(),
            device_id: "n1-gpu0".into(),
            namespace: "ml".into(),
            name: "a".into(),
            uid: uid.into(),
            reason: "test".into(),
        }
    }
}
