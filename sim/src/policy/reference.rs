//! The reference approach, reproduced with its published design choices so iadeep
//! is compared with it honestly:
//!
//! - a random forest predicts a job's slowdown from **job-name patterns** (a one-hot
//!   vector of the job's model name and counts of its co-runners' names), trained
//!   online from the co-locations the agents report;
//! - the new job goes to the GPU with the least predicted slowdown (an idle GPU
//!   first), or waits when every prediction is more than 2× slower;
//! - only the **newly arrived job** is tuned: each batch size from m0/2 to 4·m0 is run
//!   for one reporting interval and the best by the reference objective
//!   `IF · DT · E` is kept (it multiplies by E where iadeep divides, see
//!   docs/design.md, "The objective");
//!   `reference-fixed` is the same approach with PD dividing by E, as iadeep's;
//! - **no memory constraint**: placements and batch sizes ignore memory; a crash stops
//!   the search at the sizes that ran.
//!
//! Slowdowns (the forest's targets) and PD need a job's step time alone: its solo
//! profile at m0 when jobs bring one (`--job-info profiled`), else the step time its
//! agent reported while it ran alone at m0; a co-location of a job never measured
//! alone at m0 is no sample. The searched job is new, so without profiles its solo step
//! time is unknown; its sizes are compared with each other only, where a common
//! stand-in gives the same choice ([`pd_alone_or_shared`]).

use std::collections::{BTreeMap, HashMap};

use iadeep_predictor::{Forest, ForestParams};

use crate::policy::batch_search::{
    BatchSearch, UNKNOWN_SOLO_STEP_S, pd_alone_or_shared, tune_device,
};
use crate::policy::solo::SoloTimes;
use crate::policy::{OomAction, PlaceOrQueue, Policy, TuneStep};
use crate::view::{PolicyView, ResidentJob, Waiting};

/// Name slots of the one-hot encoding (names beyond it share the last slot).
const NAME_SLOTS: usize = 16;
/// Refit after this many new samples.
const REFIT_EVERY: usize = 20;
/// Samples kept for fitting.
const WINDOW: usize = 500;

/// The published forest: 10 trees of depth at most 8, each split searching ⌊√p⌋ of the
/// p columns, as the off-the-shelf random forest it used; fitted with the workspace's one
/// forest (`iadeep_predictor::Forest`), on one thread (the simulator runs policies side
/// by side).
fn forest_params(seed: u64) -> ForestParams {
    let columns = (2 * NAME_SLOTS) as f64;
    ForestParams {
        n_trees: 10,
        max_depth: 8,
        max_features: columns.sqrt().floor() / columns,
        seed,
        fit_threads: 1,
        ..ForestParams::default()
    }
}

/// The reference approach.
pub struct Reference {
    names: HashMap<String, usize>,
    samples: Vec<(Vec<f64>, f64)>,
    new_samples: usize,
    forest: Option<Forest>,
    /// Last report seq used as a sample, per task.
    seen: HashMap<usize, u64>,
    searches: BTreeMap<usize, BatchSearch>,
    seed: u64,
    /// PD divides by E (`reference-fixed`) instead of multiplying (as published).
    divides_by_e: bool,
    /// Step times measured alone.
    solo: SoloTimes,
}

impl std::fmt::Debug for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reference")
            .field("samples", &self.samples.len())
            .field("fitted", &self.forest.is_some())
            .finish()
    }
}

impl Reference {
    /// A reference scheduler with an untrained forest; `divides_by_e` fixes its
    /// objective (`reference-fixed`).
    pub fn new(seed: u64, divides_by_e: bool) -> Reference {
        Reference {
            names: HashMap::new(),
            samples: Vec::new(),
            new_samples: 0,
            forest: None,
            seen: HashMap::new(),
            searches: BTreeMap::new(),
            seed,
            divides_by_e,
            solo: SoloTimes::default(),
        }
    }

    fn slot(&mut self, name: &str) -> usize {
        let next = self.names.len().min(NAME_SLOTS - 1);
        *self.names.entry(name.to_owned()).or_insert(next)
    }

    fn features(&mut self, name: &str, corunners: &[&str]) -> Vec<f64> {
        let mut x = vec![0.0; 2 * NAME_SLOTS];
        x[self.slot(name)] = 1.0;
        for other in corunners {
            x[NAME_SLOTS + self.slot(other)] += 1.0;
        }
        x
    }

    /// Adds a sample for every co-located resident running at its m0 with a fresh report
    /// whose step time alone at m0 is known.
    fn collect(&mut self, view: &dyn PolicyView) {
        self.solo.observe(view);
        for device in 0..view.devices() {
            if view.resident_count(device) < 2 {
                continue;
            }
            let residents = view.residents(device);
            for (index, r) in residents.iter().enumerate() {
                if !r.report.running || r.report.batch_size != r.spec.m0 {
                    continue;
                }
                let Some(solo_step_s) = self.solo.step_s(r.spec, r.spec.m0) else {
                    continue;
                };
                if self.seen.get(&r.spec.id) == Some(&r.report.seq) {
                    continue;
                }
                self.seen.insert(r.spec.id, r.report.seq);
                let others: Vec<&str> = residents
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != index)
                    .map(|(_, o)| o.spec.model.as_str())
                    .collect();
                let x = self.features(&r.spec.model, &others);
                self.samples.push((x, r.report.step_time_s / solo_step_s));
                self.new_samples += 1;
            }
        }
        if self.samples.len() > WINDOW {
            let excess = self.samples.len() - WINDOW;
            self.samples.drain(..excess);
        }
        if self.new_samples >= REFIT_EVERY && self.samples.len() >= 2 * REFIT_EVERY {
            self.new_samples = 0;
            let rows: Vec<Vec<f64>> = self.samples.iter().map(|(x, _)| x.clone()).collect();
            let y: Vec<f64> = self.samples.iter().map(|(_, y)| *y).collect();
            match Forest::fit(&rows, &y, &forest_params(self.seed)) {
                Ok(forest) => self.forest = Some(forest),
                Err(err) => {
                    tracing::warn!(%err, "reference forest refit failed; keeping the old one")
                }
            }
        }
    }

    fn predict(&mut self, name: &str, residents: &[ResidentJob<'_>]) -> f64 {
        let others: Vec<&str> = residents.iter().map(|r| r.spec.model.as_str()).collect();
        let x = self.features(name, &others);
        match &self.forest {
            Some(forest) => forest
                .predict(&x)
                .map_or(1.0 + residents.len() as f64, |(mean, _spread)| mean),
            // Untrained: assume each co-runner costs a full share.
            None => 1.0 + residents.len() as f64,
        }
    }
}

impl Policy for Reference {
    fn name(&self) -> &str {
        if self.divides_by_e {
            "reference-fixed"
        } else {
            "reference"
        }
    }

    fn place(&mut self, view: &dyn PolicyView, task: Waiting<'_>) -> PlaceOrQueue {
        self.collect(view);
        if let Some(device) = (0..view.devices()).find(|d| view.resident_count(*d) == 0) {
            return PlaceOrQueue::place(device, task.batch_size);
        }
        let mut best: Option<(f64, usize)> = None;
        for device in 0..view.devices() {
            let residents = view.residents(device);
            let predicted = self.predict(&task.spec.model, &residents);
            if best.is_none_or(|(b, _)| predicted < b) {
                best = Some((predicted, device));
            }
        }
        match best {
            Some((predicted, device)) if predicted <= 2.0 => {
                let candidates: Vec<u32> = task
                    .spec
                    .batch_sizes
                    .iter()
                    .copied()
                    .filter(|b| *b * 2 >= task.spec.m0 && *b <= task.spec.m0 * 4)
                    .collect();
                if candidates.len() > 1 {
                    self.searches
                        .insert(device, BatchSearch::new(task.spec.id, candidates));
                }
                PlaceOrQueue::place(device, task.batch_size)
            }
            _ => PlaceOrQueue::Queue,
        }
    }

    fn tunes(&self) -> bool {
        true
    }

    fn tune(&mut self, view: &dyn PolicyView, device: usize) -> TuneStep {
        self.collect(view);
        // Score the configuration that just ran (the first call sees m0 or the size
        // the job started at).
        let divides_by_e = self.divides_by_e;
        tune_device(&mut self.searches, view, device, |me| {
            // The searched job is the newly placed one: only a profile can say how fast it
            // runs alone (a fixed stand-in otherwise; one search compares its own sizes).
            let solo_step_s = me
                .spec
                .profile
                .map_or(UNKNOWN_SOLO_STEP_S, |p| p.step_time_s);
            if divides_by_e {
                return pd_alone_or_shared(me, solo_step_s);
            }
            // As published: IF · DT · E.
            let m0 = f64::from(me.spec.m0);
            let m = f64::from(me.report.batch_size);
            let if_dt = me.report.step_time_s * m0 / (solo_step_s * m);
            let e = me
                .report
                .grad_noise_scale
                .map_or(1.0, |phi| (phi + m0) / (phi + m));
            if_dt * e
        })
    }

    fn on_oom(&mut self, device: usize, task: usize, batch_size: u32) -> OomAction {
        if let Some(search) = self.searches.get_mut(&device)
            && search.task == task
        {
            search.out_of_memory_at(batch_size);
        }
        OomAction::RestartHalf
    }

    fn on_finish(&mut self, device: usize, task: usize) {
        if self.searches.get(&device).is_some_and(|s| s.task == task) {
            self.searches.remove(&device);
        }
        self.seen.remove(&task);
        self.solo.forget(task);
    }
}
