//! From "what the device holds now" to the tuner's [`Input`]s: the one translation both
//! drivers use (the daemon from the store's watches, the simulator from its emulated
//! agents), so they cannot tell the tuner different things about the same situation.
//!
//! A driver describes every task the placer has reserved on the device as a
//! [`DeviceTask`]: running (its spec, the MiB reserved for it, its latest report and
//! assignment) or only held (placed, its agent not started or restarting). The
//! [`Translator`] remembers what it last told the tuner and emits only the difference:
//! departures first, then arrivals and holds, then assignments, then reports, each
//! assignment and report once.

use std::collections::BTreeMap;

use iadeep_proto::{BatchSizeAssignment, TaskReport, TaskSpec};

use super::Input;

/// One task reserved on the device, as the driver sees it now.
#[derive(Clone, Debug, PartialEq)]
pub enum DeviceTask {
    /// Its agent runs.
    Running(Box<RunningTask>),
    /// Placed but not running: `mib` are kept free for it.
    Held { mib: u64 },
}

/// A running task as the driver sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct RunningTask {
    pub spec: TaskSpec,
    /// What the placer reserved for it (0 when unknown).
    pub reserved_mib: u64,
    pub report: Option<TaskReport>,
    pub assignment: Option<BatchSizeAssignment>,
}

/// Remembers what the tuner was told; see the module documentation.
#[derive(Clone, Debug, Default)]
pub struct Translator {
    told: BTreeMap<String, DeviceTask>,
}

impl Translator {
    /// The inputs that bring the tuner from what it was last told to `now` (every task
    /// reserved on the device, by id).
    pub fn diff(&mut self, now: BTreeMap<String, DeviceTask>) -> Vec<Input> {
        let mut left = Vec::new();
        let mut joined = Vec::new();
        let mut assigned = Vec::new();
        let mut reported = Vec::new();
        for task in self.told.keys() {
            if !now.contains_key(task) {
                left.push(Input::Left {
                    task_id: task.clone(),
                });
            }
        }
        for (task, resident) in &now {
            let before = self.told.get(task);
            match resident {
                DeviceTask::Held { mib } => {
                    if before != Some(resident) {
                        joined.push(Input::Reserved {
                            task_id: task.clone(),
                            mib: *mib,
                        });
                    }
                }
                DeviceTask::Running(running) => {
                    let RunningTask {
                        spec,
                        reserved_mib,
                        report,
                        assignment,
                    } = running.as_ref();
                    let (was_spec, was_report, was_assignment) = match before {
                        Some(DeviceTask::Running(was)) => (
                            Some((&was.spec, was.reserved_mib)),
                            was.report.as_ref(),
                            was.assignment.as_ref(),
                        ),
                        _ => (None, None, None),
                    };
                    if was_spec != Some((spec, *reserved_mib)) {
                        joined.push(Input::Joined {
                            spec: spec.clone(),
                            reserved_mib: *reserved_mib,
                        });
                    }
                    if let Some(a) = assignment
                        && was_assignment != Some(a)
                    {
                        assigned.push(Input::Assigned(a.clone()));
                    }
                    if let Some(r) = report
                        && was_report != Some(r)
                    {
                        reported.push(Input::Report(r.clone()));
                    }
                }
            }
        }
        self.told = now;
        let mut inputs = left;
        inputs.extend(joined);
        inputs.extend(assigned);
        inputs.extend(reported);
        inputs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running(task: &str, reserved_mib: u64, seq: Option<u64>, round: Option<u64>) -> DeviceTask {
        DeviceTask::Running(Box::new(RunningTask {
            spec: TaskSpec {
                task_id: task.into(),
                initial_batch_size: 32,
                ..Default::default()
            },
            reserved_mib,
            report: seq.map(|seq| TaskReport {
                task_id: task.into(),
                seq,
                ..Default::default()
            }),
            assignment: round.map(|round| BatchSizeAssignment {
                task_id: task.into(),
                round,
                ..Default::default()
            }),
        }))
    }

    fn kinds(inputs: &[Input]) -> Vec<String> {
        inputs
            .iter()
            .map(|i| match i {
                Input::Joined { spec, reserved_mib } => {
                    format!("joined {} {reserved_mib}", spec.task_id)
                }
                Input::Reserved { task_id, mib } => format!("held {task_id} {mib}"),
                Input::Left { task_id } => format!("left {task_id}"),
                Input::Report(r) => format!("report {} {}", r.task_id, r.seq),
                Input::Assigned(a) => format!("assigned {} {}", a.task_id, a.round),
                Input::RoundLost { round, .. } => format!("lost {round}"),
                Input::Tick => "tick".into(),
            })
            .collect()
    }

    #[test]
    fn only_what_changed_is_told_in_order_and_once() {
        let mut t = Translator::default();
        let first = t.diff(BTreeMap::from([
            ("a".to_owned(), running("a", 900, Some(1), Some(1))),
            ("b".to_owned(), DeviceTask::Held { mib: 500 }),
        ]));
        assert_eq!(
            kinds(&first),
            ["joined a 900", "held b 500", "assigned a 1", "report a 1"]
        );
        // The same again: nothing to say.
        let same = t.diff(BTreeMap::from([
            ("a".to_owned(), running("a", 900, Some(1), Some(1))),
            ("b".to_owned(), DeviceTask::Held { mib: 500 }),
        ]));
        assert!(same.is_empty(), "{:?}", kinds(&same));
        // A settled reservation, a new report, b starting, then a leaving.
        let next = t.diff(BTreeMap::from([
            ("a".to_owned(), running("a", 840, Some(2), Some(1))),
            ("b".to_owned(), running("b", 500, None, None)),
        ]));
        assert_eq!(kinds(&next), ["joined a 840", "joined b 500", "report a 2"]);
        let gone = t.diff(BTreeMap::from([(
            "b".to_owned(),
            running("b", 500, None, Some(3)),
        )]));
        assert_eq!(kinds(&gone), ["left a", "assigned b 3"]);
    }
}
