//! What iadeep has learned about each task from its agent's reports: peak memory at
//! each batch size it ran, batch sizes that ran out of memory, and step times when it
//! ran alone. Only reports go in; nothing comes from the simulator's ground truth.

use std::collections::{BTreeMap, HashMap};

use iadeep_proto::TaskProfile;
use iadeep_tuner::memory::{MemoryModel, MemoryModelParams, MemorySample};

use crate::view::{Resident, TaskSpec};

/// Reports of one task, aggregated.
#[derive(Debug, Default, Clone)]
pub struct TaskKnowledge {
    /// Largest peak MiB reported at each batch size.
    pub peak_mib: BTreeMap<u32, f64>,
    /// Batch sizes that ran out of memory.
    pub ooms: Vec<u32>,
    /// Step time alone at each batch size (profile at m0, then measured when alone).
    pub solo_step_s: BTreeMap<u32, f64>,
}

/// Knowledge of every task seen.
#[derive(Debug, Default)]
pub struct Knowledge {
    tasks: HashMap<usize, TaskKnowledge>,
}

impl Knowledge {
    /// Seeds a task from its submitted profile (step time and peak memory alone at m0).
    pub fn submit(&mut self, spec: &TaskSpec) {
        self.tasks.entry(spec.id).or_insert_with(|| {
            let mut k = TaskKnowledge::default();
            k.peak_mib.insert(spec.m0, spec.solo_peak_mem_mib as f64);
            k.solo_step_s.insert(spec.m0, spec.solo_step_time_s);
            k
        });
    }

    /// Takes in the current reports of one device's residents.
    pub fn ingest(&mut self, residents: &[Resident<'_>]) {
        let alone = residents.len() == 1;
        for r in residents {
            self.submit(r.spec);
            let Some(k) = self.tasks.get_mut(&r.spec.id) else {
                continue;
            };
            if let Some(oom) = r.report.oom_batch_size
                && !k.ooms.contains(&oom)
            {
                k.ooms.push(oom);
            }
            if !r.report.running {
                continue;
            }
            let peak = k.peak_mib.entry(r.report.batch_size).or_insert(0.0);
            *peak = peak.max(r.report.peak_mem_mib as f64);
            if alone {
                k.solo_step_s
                    .insert(r.report.batch_size, r.report.step_time_s);
            }
        }
    }

    /// Records an out-of-memory crash.
    pub fn oom(&mut self, task: usize, batch_size: u32) {
        let k = self.tasks.entry(task).or_default();
        if !k.ooms.contains(&batch_size) {
            k.ooms.push(batch_size);
        }
    }

    /// Forgets a finished task.
    pub fn forget(&mut self, task: usize) {
        self.tasks.remove(&task);
    }

    /// A task's knowledge, if any.
    pub fn get(&self, task: usize) -> Option<&TaskKnowledge> {
        self.tasks.get(&task)
    }

    /// Conservative peak MiB of `task` at `batch_size` from the tuner's memory model,
    /// `None` when infeasible or unknown.
    ///
    /// Below the smallest observed batch size the bound is the model's bound at that
    /// size: memory does not grow when the batch shrinks, and a fit through one
    /// sample (zero intercept) would otherwise under-estimate there.
    pub fn memory_upper_mib(&self, task: usize, batch_size: u32) -> Option<f64> {
        let k = self.tasks.get(&task)?;
        let samples: Vec<MemorySample> = k
            .peak_mib
            .iter()
            .map(|(b, m)| MemorySample {
                batch_size: *b,
                peak_mib: *m,
            })
            .collect();
        let smallest = *k.peak_mib.keys().next()?;
        let model = MemoryModel::fit_with(&samples, &k.ooms, MemoryModelParams::default()).ok()?;
        if k.ooms.iter().any(|oom| batch_size >= *oom) {
            return None;
        }
        model.upper_bound_mib(batch_size.max(smallest))
    }

    /// The predictor's view of a task at a batch size: its solo step time there when
    /// known, else its profile at m0 (the closest measurement there is).
    pub fn profile(&self, spec: &TaskSpec, batch_size: u32) -> TaskProfile {
        let k = self.tasks.get(&spec.id);
        let (batch, step) = match k.and_then(|k| k.solo_step_s.get(&batch_size)) {
            Some(step) => (batch_size, *step),
            None => (spec.m0, spec.solo_step_time_s),
        };
        let mem = k
            .and_then(|k| k.peak_mib.get(&batch))
            .copied()
            .unwrap_or(spec.solo_peak_mem_mib as f64);
        TaskProfile {
            model: spec.model.clone(),
            batch_size: batch,
            solo_step_time_s: step,
            sm_util_pct: None,
            mem_bw_util_pct: None,
            gpu_mem_mib: Some(mem.round() as u64),
        }
    }

    /// Solo step time of a task at a batch size, when known.
    pub fn solo_step_s(&self, task: usize, batch_size: u32) -> Option<f64> {
        self.tasks
            .get(&task)
            .and_then(|k| k.solo_step_s.get(&batch_size))
            .copied()
    }
}
