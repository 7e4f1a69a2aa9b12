//! Says when a job runs without its agent. A command that never creates an `iadeep.Agent`
//! (or whose agent cannot reach the store) is never tuned and its PD never measured, and
//! the placer gives its GPU memory back after its unstarted-task grace (ten minutes by
//! default) while the job may still be using it. `iadeep run` cannot tell from outside
//! whether a command will start an agent, so it looks once, `--agent-patience` after the
//! start, and says so in its log.

use std::sync::Arc;
use std::time::Duration;

use iadeep_state::{StateStore, StoreUrl, keys};

use super::timed;

/// How long a job may run before its agent's first sign of life is overdue: a PyTorch
/// script's imports and CUDA start take tens of seconds, rarely minutes. `iadeep status`
/// waits as long before it calls a job's agent overdue.
pub(crate) const AGENT_START_PATIENCE: Duration = Duration::from_secs(120);

/// `--agent-patience` when not given ([`AGENT_START_PATIENCE`]).
pub(super) const DEFAULT_PATIENCE: &str = "2m";

/// Parses `--agent-patience`: a duration as `humantime` reads it (`2m`, `90s`; `0s`
/// never looks).
pub(super) fn parse_patience(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim())
        .map_err(|err| format!("{text:?}: not a duration such as 2m, 90s or 0s ({err})"))
}

/// The look for the agent of one run of the job; dropping it (the job exited) calls it off.
pub(super) struct AgentCheck(Option<tokio::task::JoinHandle<()>>);

impl AgentCheck {
    /// Looks once, `patience` from now, for a sign of `task_id`'s agent in the store (its
    /// `alive` key or a report) and warns when there is none. A zero `patience` never
    /// looks. `store` is the run's open store, else `url` is opened then.
    pub(super) fn start(
        store: Option<Arc<dyn StateStore>>,
        url: StoreUrl,
        task_id: String,
        reserved_mib: u64,
        patience: Duration,
    ) -> AgentCheck {
        if patience.is_zero() {
            return AgentCheck(None);
        }
        AgentCheck(Some(tokio::spawn(async move {
            tokio::time::sleep(patience).await;
            let seen = async {
                let store = match store {
                    Some(store) => store,
                    None => timed("opening the state store", url.open()).await?,
                };
                agent_seen(store.as_ref(), &task_id).await
            };
            match seen.await {
                Ok(true) => {}
                Ok(false) => warn_no_agent(&task_id, reserved_mib, patience),
                Err(err) => tracing::warn!(task = %task_id, err = format!("{err:#}"),
                    "cannot tell whether the job's agent started: the store does not answer"),
            }
        })))
    }
}

/// Whether the store shows a sign of `task_id`'s agent: its `alive` key, or a report (an
/// agent that reported and left), also one archived when the task was released (an
/// agent that finished its work while the process goes on, saving or evaluating).
async fn agent_seen(store: &dyn StateStore, task_id: &str) -> anyhow::Result<bool> {
    let task = timed("reading the task", store.range(&keys::task_prefix(task_id))).await?;
    let signs = [keys::task_alive(task_id), keys::task_report(task_id)];
    if task.kvs.iter().any(|kv| signs.contains(&kv.key)) {
        return Ok(true);
    }
    let archived = keys::archived_report(task_id);
    Ok(timed("reading the task's archive", store.get(&archived))
        .await?
        .is_some())
}

impl Drop for AgentCheck {
    fn drop(&mut self) {
        if let Some(check) = self.0.take() {
            check.abort();
        }
    }
}

fn warn_no_agent(task_id: &str, reserved_mib: u64, patience: Duration) {
    let waited = humantime::format_duration(patience);
    let grace = humantime::format_duration(crate::placer_cmd::DEFAULT_UNSTARTED_TASK_GRACE);
    tracing::warn!(task = %task_id, reserved_mib,
        "no iadeep agent has reported {waited} after the job started: it is not tuned and its \
         PD is not measured; its reservation ({reserved_mib} MiB: all the GPU's free memory \
         when neither a report, --gpu-mem-mib nor the model's registry entry said what it \
         needs) keeps other jobs off its GPU until the placer's unstarted-task grace ends \
         ({grace} by default), and then the job runs on unreserved. Does the script create an \
         agent (`iadeep.Agent.from_env(...)`, README \"In a Python training loop\")? A job \
         that starts slowly: raise --agent-patience (0s: never look)");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_patience_is_the_one_status_uses() {
        assert_eq!(parse_patience(DEFAULT_PATIENCE), Ok(AGENT_START_PATIENCE));
        assert_eq!(parse_patience("0s"), Ok(Duration::ZERO));
        let err = parse_patience("120").expect_err("no unit");
        assert!(err.contains("not a duration"), "{err}");
    }

    /// Whether the agent of `t` is seen in a store holding only `keys`.
    async fn seen_with(keys: &[String]) -> bool {
        let store = iadeep_state::EmbeddedStore::in_memory().expect("store");
        for key in keys {
            store.put(key, b"x".to_vec(), None).await.expect("put");
        }
        agent_seen(&store, "t").await.expect("read")
    }

    /// A placed task whose agent never came shows nothing but what the placer wrote; its
    /// `alive` key or a report (also an archived one) is a sign of the agent.
    #[tokio::test]
    async fn the_agent_is_seen_by_its_alive_key_or_a_report() {
        let placed = [
            keys::task_placement("t"),
            keys::task_assignment("t"),
            keys::task_report("other"),
        ];
        assert!(!seen_with(&placed).await);
        let reported = [placed.as_slice(), &[keys::task_report("t")]].concat();
        assert!(seen_with(&reported).await);
        assert!(seen_with(&[keys::archived_report("t")]).await);
        assert!(seen_with(&[keys::task_alive("t")]).await);
    }
}
