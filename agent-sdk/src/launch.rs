//! What a launcher (`iadeep run`) tells the training job it starts, through
//! environment variables, and how the job reads it back.
//!
//! One definition on both sides: `iadeep run` writes [`Launch::vars`], the job's
//! agent (Rust, or Python's `iadeep.Agent.from_env`) reads [`Launch::from_env`].
//! Besides where to report (task id, store), the launcher passes what it asked the
//! placer for (model, batch sizes, learning-rate rule), so the agent registers the
//! same task the placer reserved memory for. A job that `iadeep run --requeue-on-evict`
//! started again after an eviction is told so ([`REQUEUED`], [`EVICTED_REASON`]), so it
//! resumes from its checkpoint.

use iadeep_proto::{LrScalingRule, PriorityClass};

use crate::error::{AgentError, Result};

/// The task's id, as the placer knows it.
pub const TASK_ID: &str = "IADEEP_TASK_ID";
/// The state store URL the agent reports to.
pub const STORE: &str = "IADEEP_STORE";
/// The device the task was placed on (informative: the agent also reads the placement).
pub const DEVICE_ID: &str = "IADEEP_DEVICE_ID";
/// Model name given to the placer.
pub const MODEL: &str = "IADEEP_MODEL";
/// The batch size the job was submitted with (m0).
pub const BATCH_SIZE: &str = "IADEEP_BATCH_SIZE";
/// Smallest batch size the tuner may assign.
pub const MIN_BATCH_SIZE: &str = "IADEEP_MIN_BATCH_SIZE";
/// Largest batch size the tuner may assign.
pub const MAX_BATCH_SIZE: &str = "IADEEP_MAX_BATCH_SIZE";
/// Learning-rate rule, by its short name (see [`lr_rule_from_name`]).
pub const LR_RULE: &str = "IADEEP_LR_RULE";
/// Priority class, by name (`production` or `opportunistic`, see
/// [`iadeep_proto::PRIORITY_CLASS_NAMES`]).
pub const PRIORITY_CLASS: &str = "IADEEP_PRIORITY_CLASS";
/// A production job's slowdown cap (the most PD it accepts, e.g. `1.1`).
pub const MAX_SLOWDOWN: &str = "IADEEP_MAX_SLOWDOWN";
/// How many times `iadeep run` started the job again after an eviction (absent on the
/// first run): a job that sees it resumes from its checkpoint.
pub const REQUEUED: &str = "IADEEP_REQUEUED";
/// Why the job's previous run was evicted (with [`REQUEUED`]).
pub const EVICTED_REASON: &str = "IADEEP_EVICTED_REASON";

/// The launch settings found in the environment. Only the task id and the store
/// are required; the rest is `None` when the launcher did not say.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Launch {
    pub task_id: String,
    pub store: String,
    pub device_id: Option<String>,
    pub model: Option<String>,
    pub initial_batch_size: Option<u32>,
    pub min_batch_size: Option<u32>,
    pub max_batch_size: Option<u32>,
    pub lr_rule: Option<LrScalingRule>,
    pub priority_class: Option<PriorityClass>,
    pub max_slowdown: Option<f64>,
    /// Runs of the job `iadeep run` started again after an eviction (0: the first run).
    pub requeued: u32,
    /// Why the previous run was evicted, when [`Launch::requeued`] > 0.
    pub evicted_reason: Option<String>,
}

impl Launch {
    /// Reads the process environment.
    pub fn from_env() -> Result<Launch> {
        Launch::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the variables through `lookup` (the environment, or a map in tests).
    /// An empty value counts as absent; a malformed one is an error naming it.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Launch> {
        let get = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        let required = |name: &str| {
            get(name).ok_or_else(|| {
                AgentError::InvalidConfig(format!(
                    "{name} is not set: start the job with `iadeep run -- CMD`, \
                     or set {TASK_ID} and {STORE} yourself"
                ))
            })
        };
        let size = |name: &str| -> Result<Option<u32>> {
            get(name)
                .map(|v| {
                    v.trim()
                        .parse::<u32>()
                        .ok()
                        .filter(|&b| b > 0)
                        .ok_or_else(|| {
                            AgentError::InvalidConfig(format!(
                                "{name}={v:?} is not a positive batch size"
                            ))
                        })
                })
                .transpose()
        };
        let lr_rule = get(LR_RULE)
            .map(|v| {
                lr_rule_from_name(v.trim()).ok_or_else(|| {
                    AgentError::InvalidConfig(format!(
                        "{LR_RULE}={v:?} is not one of {}",
                        LR_RULE_NAMES.join(", ")
                    ))
                })
            })
            .transpose()?;
        let priority_class = get(PRIORITY_CLASS)
            .map(|v| {
                iadeep_proto::priority_class_from_name(v.trim()).ok_or_else(|| {
                    AgentError::InvalidConfig(format!(
                        "{PRIORITY_CLASS}={v:?} is not one of {}",
                        iadeep_proto::PRIORITY_CLASS_NAMES.join(", ")
                    ))
                })
            })
            .transpose()?;
        let max_slowdown = get(MAX_SLOWDOWN)
            .map(|v| {
                v.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|cap| cap.is_finite())
                    .ok_or_else(|| {
                        AgentError::InvalidConfig(format!(
                            "{MAX_SLOWDOWN}={v:?} is not a slowdown cap (a number such as 1.1)"
                        ))
                    })
            })
            .transpose()?;
        let (requeued, evicted_reason) = requeue_from_lookup(&lookup)?;
        Ok(Launch {
            task_id: required(TASK_ID)?,
            store: required(STORE)?,
            device_id: get(DEVICE_ID),
            model: get(MODEL),
            initial_batch_size: size(BATCH_SIZE)?,
            min_batch_size: size(MIN_BATCH_SIZE)?,
            max_batch_size: size(MAX_BATCH_SIZE)?,
            lr_rule,
            priority_class,
            max_slowdown,
            requeued,
            evicted_reason,
        })
    }

    /// The variables to set for the job (absent values are left out).
    pub fn vars(&self) -> Vec<(&'static str, String)> {
        let mut vars = vec![(TASK_ID, self.task_id.clone()), (STORE, self.store.clone())];
        let optional = [
            (DEVICE_ID, self.device_id.clone()),
            (MODEL, self.model.clone()),
            (BATCH_SIZE, self.initial_batch_size.map(|b| b.to_string())),
            (MIN_BATCH_SIZE, self.min_batch_size.map(|b| b.to_string())),
            (MAX_BATCH_SIZE, self.max_batch_size.map(|b| b.to_string())),
            (LR_RULE, self.lr_rule.map(|r| lr_rule_name(r).to_owned())),
            (
                PRIORITY_CLASS,
                self.priority_class.map(|c| c.name().to_owned()),
            ),
            (MAX_SLOWDOWN, self.max_slowdown.map(|cap| cap.to_string())),
            (
                REQUEUED,
                Some(self.requeued)
                    .filter(|&n| n > 0)
                    .map(|n| n.to_string()),
            ),
            (EVICTED_REASON, self.evicted_reason.clone()),
        ];
        vars.extend(
            optional
                .into_iter()
                .filter_map(|(name, value)| Some((name, value?))),
        );
        vars
    }
}

/// Whether `iadeep run` started this job again after an eviction: how many times
/// ([`REQUEUED`], 0 on the first run) and why the previous run was evicted
/// ([`EVICTED_REASON`]). Read from the process environment; a malformed count is an
/// error naming the variable.
pub fn requeue_from_env() -> Result<(u32, Option<String>)> {
    requeue_from_lookup(&|name: &str| std::env::var(name).ok())
}

fn requeue_from_lookup(lookup: &dyn Fn(&str) -> Option<String>) -> Result<(u32, Option<String>)> {
    let get = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
    let count = get(REQUEUED)
        .map(|v| {
            v.trim()
                .parse::<u32>()
                .map_err(|_| AgentError::InvalidConfig(format!("{REQUEUED}={v:?} is not a count")))
        })
        .transpose()?
        .unwrap_or(0);
    Ok((count, get(EVICTED_REASON)))
}

/// The short names of the learning-rate rules, as users write them.
pub const LR_RULE_NAMES: [&str; 4] = ["none", "linear", "sqrt", "adascale"];

/// The rule a short name means (`none` leaves the learning rate alone).
pub fn lr_rule_from_name(name: &str) -> Option<LrScalingRule> {
    match name.to_ascii_lowercase().as_str() {
        "none" => Some(LrScalingRule::Unspecified),
        "linear" => Some(LrScalingRule::Linear),
        "sqrt" => Some(LrScalingRule::Sqrt),
        "adascale" => Some(LrScalingRule::Adascale),
        _ => None,
    }
}

/// The short name of a rule (the inverse of [`lr_rule_from_name`]).
pub fn lr_rule_name(rule: LrScalingRule) -> &'static str {
    match rule {
        LrScalingRule::Unspecified => "none",
        LrScalingRule::Linear => "linear",
        LrScalingRule::Sqrt => "sqrt",
        LrScalingRule::Adascale => "adascale",
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn what_the_launcher_writes_the_job_reads_back() {
        let launch = Launch {
            task_id: "job-1".into(),
            store: "etcd://127.0.0.1:2379".into(),
            device_id: Some("gpu0".into()),
            model: Some("resnet50".into()),
            initial_batch_size: Some(64),
            min_batch_size: Some(16),
            max_batch_size: Some(256),
            lr_rule: Some(LrScalingRule::Adascale),
            priority_class: Some(PriorityClass::Production),
            max_slowdown: Some(1.25),
            requeued: 2,
            evicted_reason: Some("job-2 ran at PD 1.31 above its cap 1.10".into()),
        };
        let vars = launch.vars();
        let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(Launch::from_lookup(lookup(&pairs)).ok(), Some(launch));
    }

    #[test]
    fn only_task_and_store_are_required() {
        let got = Launch::from_lookup(lookup(&[(TASK_ID, "t"), (STORE, "memory:")]))
            .expect("minimal launch");
        assert_eq!((got.initial_batch_size, got.lr_rule), (None, None));
        let err = Launch::from_lookup(lookup(&[(TASK_ID, "t")]))
            .expect_err("no store")
            .to_string();
        assert!(err.contains(STORE) && err.contains("iadeep run"), "{err}");
    }

    #[test]
    fn malformed_values_name_their_variable() {
        for (name, value) in [
            (BATCH_SIZE, "big"),
            (MAX_BATCH_SIZE, "0"),
            (LR_RULE, "cubic"),
            (PRIORITY_CLASS, "urgent"),
            (MAX_SLOWDOWN, "fast"),
            (REQUEUED, "-1"),
        ] {
            let err = Launch::from_lookup(lookup(&[(TASK_ID, "t"), (STORE, "s"), (name, value)]))
                .expect_err(name)
                .to_string();
            assert!(err.contains(name), "{name}: {err}");
        }
    }

    #[test]
    fn rule_names_round_trip() {
        for name in LR_RULE_NAMES {
            let rule = lr_rule_from_name(name).expect(name);
            assert_eq!(lr_rule_name(rule), name);
        }
        assert_eq!(lr_rule_from_name("SQRT"), Some(LrScalingRule::Sqrt));
    }
}
