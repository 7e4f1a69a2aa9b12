//! The control loop of one device: follow the residents, keep a [`Controller`] per
//! co-location, run its decisions through the [`StoreEvaluator`], persist after every round.
//!
//! Runs on a blocking thread: GP fits are CPU work and must not stall the runtime that
//! serves the store watches and the metrics.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use iadeep_proto::{BatchSizeAssignment, DeviceInfo, TaskSpec, TunerObservation};
use iadeep_state::{StateStore, keys, typed};
use tokio::sync::watch;

use super::DaemonParams;
use super::knowledge::candidate_sizes;
use super::metrics::Metrics;
use super::persist::{self, Persisted, Session};
use super::round::{RoundOutcome, StoreEvaluator};
use super::tasks::TaskTable;
use crate::error::{Result, TunerError};
use crate::search::{Controller, Decision, Evaluator, GpLcb, MemoryConstraint, SearchSpace};

/// The search over one set of co-located tasks.
struct Active {
    controller: Controller,
    session: Session,
    /// The configuration last applied and measured.
    applied: Option<Vec<usize>>,
    /// Warned that Σ PD cannot be measured yet (no solo time at m0).
    warned_unmeasurable: bool,
}

/// The loop; see the module documentation.
pub struct ControlLoop {
    eval: StoreEvaluator,
    params: DaemonParams,
    capacity_mib: f64,
    active: Option<Active>,
}

impl std::fmt::Debug for ControlLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlLoop")
            .field("eval", &self.eval)
            .finish_non_exhaustive()
    }
}

impl ControlLoop {
    /// A loop for the device `info`.
    pub fn new(
        handle: tokio::runtime::Handle,
        store: Arc<dyn StateStore>,
        tasks_rx: watch::Receiver<TaskTable>,
        info: &DeviceInfo,
        params: DaemonParams,
        stop: Arc<AtomicBool>,
        metrics: Arc<Metrics>,
    ) -> ControlLoop {
        ControlLoop {
            eval: StoreEvaluator {
                handle,
                store,
                tasks_rx,
                device_id: info.device_id.clone(),
                device_kind: info.kind.clone(),
                task_ids: Vec::new(),
                specs: Vec::new(),
                knowledge: BTreeMap::new(),
                round: 0,
                next_sample_seq: 0,
                params: params.round,
                stop,
                metrics,
                last: None,
            },
            params,
            capacity_mib: info.memory_mib as f64,
            active: None,
        }
    }

    fn stopping(&self) -> bool {
        self.eval.stop.load(Ordering::Relaxed)
    }

    /// Runs until stopped. Store errors are logged, counted and retried; only a failure to
    /// read the persisted state at start is returned (resuming wrongly is worse than not
    /// starting: the operator must look at it).
    pub fn run(mut self) -> Result<()> {
        let device = self.eval.device_id.clone();
        let store = self.eval.store.clone();
        let persisted = self
            .eval
            .handle
            .block_on(persist::load(store.as_ref(), &device))?;
        let seq_floor = self
            .eval
            .handle
            .block_on(persist::next_sample_seq(store.as_ref(), &device))?;
        let mut resumed = Session::default();
        if let Some(p) = persisted {
            tracing::info!(device, round = p.round, observations = p.session.observations.len(),
                tasks = ?p.session.task_ids, "resuming from persisted tuner state");
            self.eval.round = p.round;
            self.eval.next_sample_seq = p.next_sample_seq;
            self.eval.knowledge = p.knowledge;
            resumed = p.session;
        }
        self.eval.next_sample_seq = self.eval.next_sample_seq.max(seq_floor);
        let mut backoff = Duration::from_millis(200);
        while !self.stopping() {
            match self.iterate(&mut resumed) {
                Ok(()) => backoff = Duration::from_millis(200),
                Err(err) => {
                    Metrics::inc(&self.eval.metrics.errors);
                    tracing::warn!(%err, retry_in = ?backoff, "tuner round failed");
                    self.sleep_unless_residents_change(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
            }
        }
        tracing::info!(device, "control loop stopped");
        Ok(())
    }

    /// One pass: refresh the residents, then run one round (or wait).
    fn iterate(&mut self, resumed: &mut Session) -> Result<()> {
        let table = self.eval.tasks_rx.borrow_and_update().clone();
        let residents = table.residents(&self.eval.device_id);
        self.eval
            .metrics
            .residents
            .store(residents.len() as u64, Ordering::Relaxed);
        // Forget tasks whose keys are all gone; learn memory and OOMs from the latest reports.
        self.eval
            .knowledge
            .retain(|task, _| table.tasks.contains_key(task));
        for task in &residents {
            let Some(entry) = table.tasks.get(task) else {
                continue;
            };
            let k = self.eval.knowledge.entry(task.clone()).or_default();
            if let Some(spec) = &entry.spec {
                k.learn_spec(spec);
            }
            if let Some(r) = &entry.report {
                // Not as a solo time: this report may predate the current co-location.
                k.learn_report(r, false);
            }
        }
        if residents.is_empty() {
            if self.active.take().is_some() {
                tracing::info!(device = %self.eval.device_id, "no tasks left on the device");
            }
            self.eval.task_ids.clear();
            self.sleep_unless_residents_change(self.params.idle_poll);
            return Ok(());
        }
        if self
            .active
            .as_ref()
            .is_none_or(|a| a.session.task_ids != residents)
        {
            self.start_session(&residents, &table, resumed)?;
        }
        let memory = self.memory_constraint();
        let Some(active) = self.active.as_mut() else {
            return Ok(());
        };
        active.controller.search().set_memory(Some(memory))?;

        // Σ PD needs each task's solo step time at m0. A lone task measures it in its first
        // round (at m0); co-located tasks without a solo profile cannot be tuned honestly.
        if residents.len() > 1 {
            let unknown: Vec<&String> = residents
                .iter()
                .zip(&self.eval.specs)
                .filter(|(t, s)| {
                    self.eval
                        .knowledge
                        .get(*t)
                        .and_then(|k| k.solo_at(s.initial_batch_size.max(1)))
                        .is_none()
                })
                .map(|(t, _)| t)
                .collect();
            if !unknown.is_empty() {
                if !active.warned_unmeasurable {
                    tracing::warn!(
                        ?unknown,
                        "no solo step time at the submitted batch size (no profile in the TaskSpec, never ran alone here): holding the batch sizes, not tuning"
                    );
                    active.warned_unmeasurable = true;
                }
                self.sleep_unless_residents_change(self.params.idle_poll);
                return Ok(());
            }
        }

        let decision = active.controller.decide();
        let settled = active.controller.is_settled();
        self.eval
            .metrics
            .settled
            .store(u64::from(settled), Ordering::Relaxed);
        let idx = match decision {
            Ok(Decision::Explore(idx)) => idx,
            Ok(Decision::Settle(idx)) => {
                // Hysteresis: keep what runs unless the settled one is predicted clearly better.
                let keep = match &active.applied {
                    Some(current)
                        if current != &idx && active.controller.search().feasible(current) =>
                    {
                        !active.controller.worth_switching(current, &idx)?
                    }
                    _ => false,
                };
                let idx = if keep {
                    active.applied.clone().unwrap_or(idx)
                } else {
                    idx
                };
                if active.applied.as_ref() == Some(&idx) {
                    // Running already: re-measure now and then, to notice drift.
                    self.sleep_unless_residents_change(self.params.settled_interval);
                    if self.stopping() || self.residents_changed() {
                        return Ok(());
                    }
                }
                idx
            }
            Err(TunerError::NoFeasibleConfiguration(why)) => {
                tracing::error!(%why, "no configuration of the resident tasks fits the card; holding");
                Metrics::inc(&self.eval.metrics.errors);
                self.sleep_unless_residents_change(self.params.idle_poll);
                return Ok(());
            }
            Err(err) => return Err(err),
        };
        let Some(active) = self.active.as_mut() else {
            return Ok(());
        };
        // The guard the acceptance test checks: never assign over the memory limit.
        if !active.controller.search().feasible(&idx) {
            tracing::warn!(config = ?active.controller.search().space().batch_sizes(&idx),
                "configuration no longer fits the card's memory; re-opening the search");
            active.controller.reopen();
            return Ok(());
        }
        let sizes = active.controller.search().space().batch_sizes(&idx);
        let started = Instant::now();
        match self.eval.evaluate(&sizes) {
            Ok(value) => {
                let round = self.eval.round;
                active.controller.record(&idx, value)?;
                active.applied = Some(idx);
                active.session.observations.push(TunerObservation {
                    batch_sizes: sizes.clone(),
                    sum_pd: value,
                    round,
                });
                Metrics::inc(&self.eval.metrics.rounds);
                match value {
                    Some(v) => {
                        self.eval.metrics.set_sum_pd(v);
                        tracing::info!(round, batch_sizes = ?sizes, sum_pd = v,
                            took_ms = started.elapsed().as_millis() as u64, "round measured");
                    }
                    None => {
                        Metrics::inc(&self.eval.metrics.out_of_memory);
                        tracing::warn!(round, batch_sizes = ?sizes, "configuration ran out of memory");
                    }
                }
                self.save();
                Ok(())
            }
            Err(err) => {
                match self.eval.last_outcome() {
                    Some(RoundOutcome::Stopped) => {}
                    Some(RoundOutcome::ResidentsChanged { round }) => {
                        Metrics::inc(&self.eval.metrics.rounds_dropped);
                        tracing::info!(round, "tasks joined or left during the round; dropped");
                    }
                    Some(RoundOutcome::TimedOut { round, missing }) => {
                        Metrics::inc(&self.eval.metrics.rounds_dropped);
                        tracing::warn!(
                            round,
                            ?missing,
                            "no fresh report in time; round dropped, retrying"
                        );
                    }
                    Some(RoundOutcome::Unmeasurable { round, tasks }) => {
                        Metrics::inc(&self.eval.metrics.rounds_dropped);
                        tracing::warn!(
                            round,
                            ?tasks,
                            "Σ PD not measurable (no solo time at m0); round dropped"
                        );
                    }
                    _ => return Err(err),
                }
                self.save();
                Ok(())
            }
        }
    }

    /// A new search for a new set of residents, resuming persisted observations when they
    /// describe exactly these tasks at exactly these candidate sizes.
    fn start_session(
        &mut self,
        residents: &[String],
        table: &TaskTable,
        resumed: &mut Session,
    ) -> Result<()> {
        let specs: Vec<TaskSpec> = residents
            .iter()
            .map(|t| {
                table
                    .tasks
                    .get(t)
                    .and_then(|e| e.spec.clone())
                    .ok_or_else(|| TunerError::Daemon(format!("task {t} has no spec")))
            })
            .collect::<Result<_>>()?;
        let sizes: Vec<Vec<u32>> = specs.iter().map(candidate_sizes).collect();
        let start: Vec<usize> = sizes
            .iter()
            .zip(&specs)
            .map(|(s, spec)| {
                s.iter()
                    .position(|&b| b == spec.initial_batch_size.max(1))
                    .unwrap_or(0)
            })
            .collect();
        // Rounds must rise above whatever any earlier tuner assigned: agents ignore old rounds.
        for t in residents {
            let key = keys::task_assignment(t);
            if let Some((a, _)) = self
                .eval
                .handle
                .block_on(typed::get::<BatchSizeAssignment>(
                    self.eval.store.as_ref(),
                    &key,
                ))?
            {
                self.eval.round = self.eval.round.max(a.round);
            }
        }
        self.eval.task_ids = residents.to_vec();
        self.eval.specs = specs;
        let space = SearchSpace {
            sizes: sizes.clone(),
            start,
            memory: Some(self.memory_constraint()),
        };
        let search = GpLcb::new(space, self.params.lcb, self.params.seed)?;
        let mut controller = Controller::new(search, self.params.controller);
        let mut session = Session {
            task_ids: residents.to_vec(),
            sizes: sizes.clone(),
            observations: Vec::new(),
        };
        if resumed.task_ids == residents && resumed.sizes == sizes {
            for o in std::mem::take(&mut resumed.observations) {
                let idx: Option<Vec<usize>> = o
                    .batch_sizes
                    .iter()
                    .zip(&sizes)
                    .map(|(b, s)| s.iter().position(|x| x == b))
                    .collect();
                match idx {
                    Some(idx) if idx.len() == sizes.len() => {
                        controller.record(&idx, o.sum_pd)?;
                        session.observations.push(o);
                    }
                    _ => {
                        tracing::warn!(batch_sizes = ?o.batch_sizes, "persisted observation outside the search space; skipped")
                    }
                }
            }
            tracing::info!(tasks = ?residents, observations = session.observations.len(),
                settled = controller.is_settled(), "search resumed from persisted observations");
        } else {
            tracing::info!(tasks = ?residents, sizes = ?sizes, "new co-location; search starts");
        }
        *resumed = Session::default();
        self.active = Some(Active {
            controller,
            session,
            applied: None,
            warned_unmeasurable: false,
        });
        Ok(())
    }

    /// The card and every resident's conservative memory at each candidate size.
    fn memory_constraint(&self) -> MemoryConstraint {
        let table = self.eval.tasks_rx.borrow().clone();
        let upper_mib = self
            .eval
            .task_ids
            .iter()
            .zip(&self.eval.specs)
            .map(|(task, spec)| {
                let reserved = table
                    .tasks
                    .get(task)
                    .and_then(|e| e.placement.as_ref())
                    .map(|p| p.reserved_mem_mib)
                    .filter(|&m| m > 0)
                    .unwrap_or(spec.gpu_mem_request_mib) as f64;
                let sizes = candidate_sizes(spec);
                let k = self.eval.knowledge.get(task).cloned().unwrap_or_default();
                k.upper_bounds(
                    &sizes,
                    spec.initial_batch_size.max(1),
                    reserved,
                    self.params.memory,
                )
            })
            .collect();
        MemoryConstraint {
            upper_mib,
            capacity_mib: self.capacity_mib,
            margin: self.params.memory_margin,
        }
    }

    fn residents_changed(&self) -> bool {
        self.eval.tasks_rx.borrow().residents(&self.eval.device_id) != self.eval.task_ids
    }

    /// Sleeps up to `wait`, returning early when stopping or when the residents change.
    fn sleep_unless_residents_change(&self, wait: Duration) {
        let deadline = Instant::now() + wait;
        let mut rx = self.eval.tasks_rx.clone();
        rx.borrow_and_update();
        loop {
            if self.stopping() || self.residents_changed() {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            let slice = (deadline - now).min(Duration::from_millis(100));
            let changed = self
                .eval
                .handle
                .block_on(async { tokio::time::timeout(slice, rx.changed()).await });
            if matches!(changed, Ok(Err(_))) {
                // The watcher is gone (stopping): nothing will change any more.
                std::thread::sleep(slice);
            }
        }
    }

    /// Persists the state; a failure is logged and counted (the next round tries again).
    fn save(&self) {
        let state = Persisted {
            round: self.eval.round,
            next_sample_seq: self.eval.next_sample_seq,
            session: self
                .active
                .as_ref()
                .map(|a| a.session.clone())
                .unwrap_or_default(),
            knowledge: self.eval.knowledge.clone(),
        };
        let store = self.eval.store.clone();
        if let Err(err) =
            self.eval
                .handle
                .block_on(persist::save(store.as_ref(), &self.eval.device_id, &state))
        {
            Metrics::inc(&self.eval.metrics.errors);
            tracing::warn!(%err, "cannot persist the tuner state");
        }
    }
}
