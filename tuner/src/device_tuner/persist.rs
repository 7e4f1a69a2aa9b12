//! The device tuner's persisted form ([`TunerState`], stored by the daemon at the device's
//! `tuner` key), so a restarted tuner resumes: the round counter (agents ignore rounds they
//! have seen), the sample sequence, what it learnt about each task, and the observations and
//! measured cap violations of the current search.

use std::collections::BTreeMap;

use iadeep_proto::{TunerObservation, TunerOverCap, TunerState, TunerTaskCap};

use super::knowledge::TaskKnowledge;

/// The observations of one co-location: which tasks, at which candidate sizes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Session {
    pub task_ids: Vec<String>,
    pub sizes: Vec<Vec<u32>>,
    pub observations: Vec<TunerObservation>,
    /// Configurations (batch sizes, in task order) measured with a production job above
    /// its slowdown cap: a restarted tuner rules them out again instead of measuring them
    /// (and pushing the job above its cap) once more.
    pub over_cap: Vec<Vec<u32>>,
    /// Each task's slowdown cap (`None`: not production, no cap) when the search started,
    /// in task order: what `over_cap` was measured against. A violation of a cap is no
    /// fact about a looser cap, nor about a job of another class, so `over_cap` is
    /// restored only where the caps are the same. `None`: unknown (a state written before
    /// the caps were kept), and then `over_cap` is not restored.
    pub caps: Option<Vec<Option<f64>>>,
}

/// Everything persisted.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Persisted {
    pub round: u64,
    pub next_sample_seq: u64,
    pub session: Session,
    pub knowledge: BTreeMap<String, TaskKnowledge>,
    /// The search had settled (for views; a restarted tuner settles again from the
    /// observations).
    pub settled: bool,
}

impl Persisted {
    /// From the stored message; a malformed size table drops the session (not the knowledge).
    pub fn from_proto(s: &TunerState) -> Persisted {
        let mut sizes = Vec::new();
        let mut flat = s.candidate_sizes.iter().copied();
        for &n in &s.sizes_per_task {
            sizes.push(flat.by_ref().take(n as usize).collect::<Vec<u32>>());
        }
        let consistent = sizes.len() == s.task_ids.len()
            && sizes
                .iter()
                .zip(&s.sizes_per_task)
                .all(|(v, &n)| v.len() == n as usize)
            && flat.next().is_none();
        let session = if consistent {
            let (over_cap, malformed): (Vec<_>, Vec<_>) = s
                .over_cap
                .iter()
                .map(|c| c.batch_sizes.clone())
                .partition(|c| c.len() == s.task_ids.len());
            if !malformed.is_empty() {
                tracing::warn!(
                    ?malformed,
                    "persisted cap violations without one size per task are ignored"
                );
            }
            let caps: Option<Vec<Option<f64>>> = (!s.task_caps.is_empty()
                && s.task_caps.len() == s.task_ids.len())
            .then(|| s.task_caps.iter().map(|c| c.slowdown_cap).collect());
            if caps.is_none() && !s.task_caps.is_empty() {
                tracing::warn!(
                    caps = s.task_caps.len(),
                    tasks = s.task_ids.len(),
                    "persisted caps without one per task; the cap violations are not restored"
                );
            }
            Session {
                task_ids: s.task_ids.clone(),
                sizes,
                observations: s.observations.clone(),
                over_cap,
                caps,
            }
        } else {
            tracing::warn!(
                "persisted tuner state has an inconsistent size table; its observations are ignored"
            );
            Session::default()
        };
        Persisted {
            round: s.round,
            next_sample_seq: s.next_sample_seq,
            session,
            knowledge: s
                .tasks
                .iter()
                .map(|k| (k.task_id.clone(), TaskKnowledge::from_proto(k)))
                .collect(),
            settled: s.settled,
        }
    }

    /// The stored message, stamped `now_unix_ms`.
    pub fn to_proto(&self, device_id: &str, now_unix_ms: i64) -> TunerState {
        TunerState {
            device_id: device_id.to_owned(),
            round: self.round,
            next_sample_seq: self.next_sample_seq,
            task_ids: self.session.task_ids.clone(),
            candidate_sizes: self.session.sizes.iter().flatten().copied().collect(),
            sizes_per_task: self
                .session
                .sizes
                .iter()
                .map(|s| u32::try_from(s.len()).unwrap_or(u32::MAX))
                .collect(),
            observations: self.session.observations.clone(),
            tasks: self
                .knowledge
                .iter()
                .map(|(id, k)| k.to_proto(id))
                .collect(),
            updated_at_unix_ms: now_unix_ms,
            settled: self.settled,
            over_cap: self
                .session
                .over_cap
                .iter()
                .map(|c| TunerOverCap {
                    batch_sizes: c.clone(),
                })
                .collect(),
            task_caps: self
                .session
                .caps
                .iter()
                .flatten()
                .map(|&slowdown_cap| TunerTaskCap { slowdown_cap })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips() {
        let mut p = Persisted {
            round: 42,
            next_sample_seq: 7,
            session: Session {
                task_ids: vec!["a".into(), "b".into()],
                sizes: vec![vec![8, 16], vec![16, 32, 64]],
                observations: vec![TunerObservation {
                    batch_sizes: vec![8, 32],
                    sum_pd: Some(2.5),
                    round: 41,
                }],
                over_cap: vec![vec![16, 64]],
                caps: Some(vec![None, Some(1.5)]),
            },
            knowledge: BTreeMap::new(),
            settled: true,
        };
        p.knowledge.insert("a".into(), TaskKnowledge::default());
        let back = Persisted::from_proto(&p.to_proto("d", 0));
        assert_eq!(back, p);
        let mut short = p.to_proto("d", 0);
        short.over_cap.push(TunerOverCap {
            batch_sizes: vec![8],
        });
        assert_eq!(Persisted::from_proto(&short).session, p.session);
        // A state written before the caps were kept still decodes; its caps are unknown.
        let mut old = p.to_proto("d", 0);
        old.task_caps.clear();
        let old = Persisted::from_proto(&old);
        assert_eq!(old.session.caps, None);
        assert_eq!(old.session.over_cap, p.session.over_cap);
        assert_eq!(old.session.observations, p.session.observations);
        let mut wrong = p.to_proto("d", 0);
        wrong.task_caps.pop();
        assert_eq!(Persisted::from_proto(&wrong).session.caps, None);
        let mut broken = p.to_proto("d", 0);
        broken.candidate_sizes.pop();
        assert_eq!(Persisted::from_proto(&broken).session, Session::default());
    }
}
