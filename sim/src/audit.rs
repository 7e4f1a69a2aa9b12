//! Placement audit: every decision of iadeep's placer next to what the simulated world
//! says would really have happened, to find out where predicted slowdowns lead the
//! placer astray (what it found: docs/simulator-experiments.md, "Placement audit").
//!
//! The policy records what it knew when it decided ([`AuditRecord`]: the scored
//! candidates with the predicted slowdowns of the newcomer and of each resident, the
//! same numbers under the cold-start heuristic, the samples its model was fitted on,
//! the queue-or-place inputs). It never sees the ground truth: after the run,
//! [`fill_truth`] adds the world's slowdowns for exactly those co-locations and batch
//! sizes, the time each queued task really waited, and when the devices its wait W
//! counted on truly freed up (their residents done, and truly empty: the order
//! statistic W starts from assumes nobody joins a device before it frees up, which the
//! placer corrects with the waits its queued tasks really had). [`AuditSummary`]
//! condenses a run into the few numbers that say whether the predictions, the ranking
//! and the queue-or-place rule were right, W's bias among them.
//!
//! Off by default (`iadeep sim --audit`): recording costs a few predictions per
//! decision, and the records are only for diagnosis.

use iadeep_objective::stats;
use serde::Serialize;

use crate::metrics::TaskOutcome;
use crate::workload::TaskTemplate;
use crate::world::World;

/// Predicted or true slowdowns of one candidate co-location.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Slowdowns {
    /// Slowdown of the newcomer next to the residents.
    pub own: f64,
    /// Each resident's slowdown with the newcomer.
    pub with: Vec<f64>,
    /// Each resident's slowdown among the residents alone.
    pub without: Vec<f64>,
}

impl Slowdowns {
    /// Increase of the device's Σ PD at fixed batch sizes (PD = IF): the placer's score.
    pub fn pd_increase(&self) -> f64 {
        self.own
            + self
                .with
                .iter()
                .zip(&self.without)
                .map(|(w, o)| w - o)
                .sum::<f64>()
    }

    /// Gain of the device's combined normalised throughput Σ 1/IF when the newcomer
    /// joins: the placer's throughput guard.
    pub fn throughput_gain(&self) -> f64 {
        1.0 / self.own + self.with.iter().map(|s| 1.0 / s).sum::<f64>()
            - self.without.iter().map(|s| 1.0 / s).sum::<f64>()
    }
}

/// One shared device the placer scored for a task.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AuditCandidate {
    pub device: usize,
    /// The residents as the placer saw them: (task id, batch size).
    pub residents: Vec<(usize, u32)>,
    /// What the placer's slowdown model predicted.
    pub predicted: Slowdowns,
    /// The model's uncertainty of the Σ PD increase, as the placer combined it.
    pub uncertainty: f64,
    /// The placer's rank (increase + weight × uncertainty); the lowest is chosen.
    pub rank: f64,
    /// What the predictor's cold-start heuristic predicts for the same co-location.
    pub heuristic: Slowdowns,
    /// The simulated world's slowdowns (filled after the run).
    pub truth: Option<Slowdowns>,
}

/// One placement decision.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AuditRecord {
    /// Simulated time of the decision, s.
    pub at_s: f64,
    pub task: usize,
    /// Batch size the task would start at.
    pub batch_size: u32,
    /// `place`, `queue`, `held` (told to queue because the device it would be placed on
    /// is held for a task waiting ahead: the queue rule did not weigh it), or `evict` (a
    /// production job making room by evicting opportunistic residents, which it then
    /// waits for).
    pub verdict: &'static str,
    /// Where it was placed.
    pub device: Option<usize>,
    /// The chosen device was idle.
    pub placed_idle: bool,
    /// An idle device could take the task.
    pub idle_available: bool,
    /// Samples the predictor's current model was fitted on (0: cold-start heuristic).
    pub model_samples: usize,
    /// Co-location samples the predictor had accepted so far.
    pub samples_seen: u64,
    /// Tasks waiting ahead of this one.
    pub waiting_ahead: usize,
    /// The wait W the queue-or-place rule weighed, s.
    pub wait_s: Option<f64>,
    /// The task's solo duration D the rule used, s.
    pub duration_s: f64,
    /// The scored shared devices, best first (at most the placer's explanation size).
    pub candidates: Vec<AuditCandidate>,
    /// Devices the placer rejected, counted by reason (`Rejection::kind`).
    pub rejected: std::collections::BTreeMap<&'static str, usize>,
    /// When the task really started (filled after the run), s.
    pub started_s: Option<f64>,
    /// For a decision with a W: seconds until the (`waiting_ahead` + 1)-th of the
    /// devices busy at the decision truly saw the residents it had then all finish,
    /// which is what W predicts from their progress (filled after the run).
    pub residents_done_s: Option<f64>,
    /// For a decision with a W: seconds until the (`waiting_ahead` + 1)-th of those
    /// devices truly became empty, tasks placed on it while it was still busy keeping
    /// it busy (filled after the run). The gap to `residents_done_s` is the part of
    /// W's error due to co-location onto devices about to free up, not to the
    /// residents' progress.
    pub drained_s: Option<f64>,
}

/// Adds each task's real start time and, to every queue decision that weighed a W,
/// the true freeing times W tried to predict.
fn fill_waits(records: &mut [AuditRecord], outcomes: &[TaskOutcome]) {
    let occupancy = occupancy(outcomes);
    let start_of: std::collections::HashMap<usize, f64> =
        outcomes.iter().map(|o| (o.id, o.start_s)).collect();
    for record in records.iter_mut() {
        record.started_s = start_of.get(&record.task).copied();
        if record.verdict == "queue" && record.wait_s.is_some() {
            let (done, drained) = freeing_times(&occupancy, record.at_s);
            record.residents_done_s = kth_smallest(done, record.waiting_ahead);
            record.drained_s = kth_smallest(drained, record.waiting_ahead);
        }
    }
}

/// Each device's occupancy from the outcomes: (start, finish) of every task, s.
fn occupancy(outcomes: &[TaskOutcome]) -> std::collections::BTreeMap<usize, Vec<(f64, f64)>> {
    let mut by_device = std::collections::BTreeMap::<usize, Vec<(f64, f64)>>::new();
    for o in outcomes {
        by_device
            .entry(o.device)
            .or_default()
            .push((o.start_s, o.finish_s));
    }
    by_device
}

/// For the devices busy at `at_s`: seconds until the residents they had then all
/// finish, and seconds until each next became empty (a task starting on it while it is
/// busy extends that; one starting the moment it frees up took an empty device).
fn freeing_times(
    occupancy: &std::collections::BTreeMap<usize, Vec<(f64, f64)>>,
    at_s: f64,
) -> (Vec<f64>, Vec<f64>) {
    let (mut done, mut drained) = (Vec::new(), Vec::new());
    for spans in occupancy.values() {
        let Some(first) = spans
            .iter()
            .filter(|(start, finish)| *start <= at_s && at_s < *finish)
            .map(|(_, finish)| *finish)
            .reduce(f64::max)
        else {
            continue;
        };
        let mut until = first;
        while let Some(later) = spans
            .iter()
            .filter(|(start, finish)| *start < until && *finish > until)
            .map(|(_, finish)| *finish)
            .reduce(f64::max)
        {
            until = later;
        }
        done.push(first - at_s);
        drained.push(until - at_s);
    }
    (done, drained)
}

/// The `k`-th smallest (from 0) of `values`, if there are that many.
fn kth_smallest(mut values: Vec<f64>, k: usize) -> Option<f64> {
    (k < values.len()).then(|| *values.select_nth_unstable_by(k, f64::total_cmp).1)
}

/// Adds the world's slowdowns to every candidate and each task's real start time.
///
/// `workload` gives each task id's family; the batch sizes are those recorded, so the
/// truth is for exactly the co-location the placer scored.
pub fn fill_truth(
    records: &mut [AuditRecord],
    world: &World,
    workload: &[TaskTemplate],
    outcomes: &[TaskOutcome],
) {
    let catalogue = &world.catalogue;
    let type_of = |task: usize, batch: u32| {
        workload
            .get(task)
            .and_then(|t| catalogue.type_of(t.family, batch))
    };
    let slowdown = |job: usize, others: &[usize]| {
        world.catalogue.types[job].solo_steps_per_s / world.steps_per_s(job, others.iter().copied())
    };
    fill_waits(records, outcomes);
    for record in records.iter_mut() {
        let Some(new) = type_of(record.task, record.batch_size) else {
            continue;
        };
        for c in &mut record.candidates {
            let residents: Option<Vec<usize>> =
                c.residents.iter().map(|(t, b)| type_of(*t, *b)).collect();
            let Some(residents) = residents else {
                continue;
            };
            let others = |i: usize| -> Vec<usize> {
                residents
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, t)| *t)
                    .collect()
            };
            c.truth = Some(Slowdowns {
                own: slowdown(new, &residents),
                with: (0..residents.len())
                    .map(|i| {
                        let mut o = others(i);
                        o.push(new);
                        slowdown(residents[i], &o)
                    })
                    .collect(),
                without: (0..residents.len())
                    .map(|i| slowdown(residents[i], &others(i)))
                    .collect(),
            });
        }
    }
}

/// Mean of a list (NaN when empty, printed as such).
fn mean_or_nan(values: &[f64]) -> f64 {
    stats::mean(values.iter().copied()).unwrap_or(f64::NAN)
}

/// Error statistics of one predictor against the truth over some candidates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ErrorStats {
    pub n: usize,
    /// Mean absolute percentage error of the newcomer's slowdown.
    pub own_mape: f64,
    /// Mean of predicted / true − 1 of the newcomer's slowdown (negative: optimistic).
    pub own_bias: f64,
    /// Mean of predicted − true Σ PD increase.
    pub pd_increase_bias: f64,
    /// Mean of predicted − true throughput gain (positive: co-location looks better).
    pub gain_bias: f64,
}

fn errors(pairs: &[(&Slowdowns, &Slowdowns)]) -> ErrorStats {
    let own: Vec<f64> = pairs.iter().map(|(p, t)| p.own / t.own - 1.0).collect();
    ErrorStats {
        n: pairs.len(),
        own_mape: mean_or_nan(&own.iter().map(|e| e.abs()).collect::<Vec<_>>()),
        own_bias: mean_or_nan(&own),
        pd_increase_bias: mean_or_nan(
            &pairs
                .iter()
                .map(|(p, t)| p.pd_increase() - t.pd_increase())
                .collect::<Vec<_>>(),
        ),
        gain_bias: mean_or_nan(
            &pairs
                .iter()
                .map(|(p, t)| p.throughput_gain() - t.throughput_gain())
                .collect::<Vec<_>>(),
        ),
    }
}

/// One run's audit condensed.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AuditSummary {
    pub decisions: usize,
    pub placed_idle: usize,
    pub placed_shared: usize,
    pub queued: usize,
    /// Tasks told to queue because their device was held for a task waiting ahead; not
    /// among `queued`, whose statistics are the queue rule's.
    pub held: usize,
    /// Queue decisions with an idle device free (never: an idle device always wins).
    pub queued_with_idle: usize,
    /// Every scored candidate: the placer's model, with the model fitted (≥ 1 sample).
    pub model_fitted: ErrorStats,
    /// Every scored candidate while the model was the cold-start heuristic.
    pub model_cold: ErrorStats,
    /// The heuristic on the very same candidates as `model_fitted`.
    pub heuristic_on_fitted: ErrorStats,
    /// Shared placements whose true throughput gain was below the placer's minimum
    /// (the guard would have rejected them had it known the truth).
    pub shared_bad_gain: usize,
    /// Shared placements: mean true throughput gain.
    pub shared_true_gain: f64,
    /// Shared placements: mean Σ PD increase of the chosen device (at the batch sizes of
    /// the decision) as the placer predicted it, and as the world says it was.
    pub shared_pd_increase_pred: f64,
    pub shared_pd_increase_true: f64,
    /// Decisions with ≥ 2 scored candidates whose chosen candidate had the lowest true
    /// Σ PD increase among them.
    pub ranked: usize,
    pub ranked_best: usize,
    /// Queue decisions where placing on the best candidate would truly have cost less
    /// (true excess × D) than the wait that followed (start − decision).
    pub queue_regretted: usize,
    /// Queue decisions: mean predicted W, mean real wait, mean true cost of placing, s.
    pub queue_wait_pred_s: f64,
    pub queue_wait_real_s: f64,
    pub queue_place_cost_true_s: f64,
    pub queue_place_cost_pred_s: f64,
    /// Queue decisions: the bias of W, mean predicted over mean real wait − 1
    /// (negative: W promised shorter waits than the tasks had).
    pub queue_wait_bias: f64,
    /// Queue decisions: mean true time until the (q+1)-th busy device's residents at
    /// the decision all finished, and until it truly became empty, s (over the
    /// decisions where both are known).
    pub queue_residents_done_s: f64,
    pub queue_drained_s: f64,
    /// Shared placements with a known W whose true cost of placing was above W.
    pub shared_regretted: usize,
}

/// What [`AuditSummary::of`] collects from the records before it averages.
#[derive(Default)]
struct Tally<'a> {
    summary: AuditSummary,
    fitted: Vec<(&'a Slowdowns, &'a Slowdowns)>,
    cold: Vec<(&'a Slowdowns, &'a Slowdowns)>,
    heuristic: Vec<(&'a Slowdowns, &'a Slowdowns)>,
    shared_gain: Vec<f64>,
    pd_pred: Vec<f64>,
    pd_true: Vec<f64>,
    w_pred: Vec<f64>,
    w_real: Vec<f64>,
    c_true: Vec<f64>,
    c_pred: Vec<f64>,
    w_done: Vec<f64>,
    w_drained: Vec<f64>,
}

/// The true cost of joining `c`: its true Σ PD increase above 1, per second.
fn true_cost(c: &AuditCandidate) -> Option<f64> {
    c.truth.as_ref().map(|t| (t.pd_increase() - 1.0).max(0.0))
}

impl<'a> Tally<'a> {
    /// The model's and the heuristic's errors on every candidate with a known truth.
    fn model_errors(&mut self, r: &'a AuditRecord) {
        for c in &r.candidates {
            if let Some(t) = &c.truth {
                if r.model_samples > 0 {
                    self.fitted.push((&c.predicted, t));
                    self.heuristic.push((&c.heuristic, t));
                } else {
                    self.cold.push((&c.predicted, t));
                }
            }
        }
    }

    /// A placement on a shared device: its true gain and Σ PD increase against the
    /// predicted, and whether waiting would truly have cost less.
    fn shared(&mut self, r: &AuditRecord, min_gain: f64) {
        self.summary.placed_shared += 1;
        let best = r.candidates.first();
        if let Some(c) = best
            && let Some(t) = &c.truth
        {
            self.pd_pred.push(c.predicted.pd_increase());
            self.pd_true.push(t.pd_increase());
            let gain = t.throughput_gain();
            self.shared_gain.push(gain);
            if gain < min_gain {
                self.summary.shared_bad_gain += 1;
            }
        }
        if let (Some(w), Some(cost)) = (r.wait_s, best.and_then(true_cost))
            && cost * r.duration_s > w
        {
            self.summary.shared_regretted += 1;
        }
    }

    /// A queue decision: the wait it predicted against the real one, and whether placing
    /// on the best candidate would truly have cost less than the wait.
    fn queued(&mut self, r: &AuditRecord) {
        self.summary.queued += 1;
        if r.idle_available {
            self.summary.queued_with_idle += 1;
        }
        let (Some(best), Some(started)) = (r.candidates.first(), r.started_s) else {
            return;
        };
        let waited = started - r.at_s;
        let Some(cost) = true_cost(best) else {
            return;
        };
        let cost = cost * r.duration_s;
        if cost < waited {
            self.summary.queue_regretted += 1;
        }
        self.c_true.push(cost);
        self.c_pred
            .push((best.predicted.pd_increase() - 1.0).max(0.0) * r.duration_s);
        self.w_real.push(waited);
        self.w_pred.push(r.wait_s.unwrap_or(f64::NAN));
        if let (Some(done), Some(drained)) = (r.residents_done_s, r.drained_s) {
            self.w_done.push(done);
            self.w_drained.push(drained);
        }
    }

    /// A decision among two or more shared candidates, all with a known truth and no
    /// idle device: whether the first ranked is truly the best.
    fn ranking(&mut self, r: &AuditRecord) {
        if r.candidates.len() < 2
            || !r.candidates.iter().all(|c| c.truth.is_some())
            || r.idle_available
        {
            return;
        }
        self.summary.ranked += 1;
        let truth = |c: &AuditCandidate| {
            c.truth
                .as_ref()
                .map_or(f64::INFINITY, Slowdowns::pd_increase)
        };
        let lowest = r.candidates.iter().map(truth).fold(f64::INFINITY, f64::min);
        if truth(&r.candidates[0]) <= lowest + 1e-9 {
            self.summary.ranked_best += 1;
        }
    }

    fn finish(self) -> AuditSummary {
        let mut s = self.summary;
        s.model_fitted = errors(&self.fitted);
        s.model_cold = errors(&self.cold);
        s.heuristic_on_fitted = errors(&self.heuristic);
        s.shared_true_gain = mean_or_nan(&self.shared_gain);
        s.shared_pd_increase_pred = mean_or_nan(&self.pd_pred);
        s.shared_pd_increase_true = mean_or_nan(&self.pd_true);
        s.queue_wait_pred_s = mean_or_nan(&self.w_pred);
        s.queue_wait_real_s = mean_or_nan(&self.w_real);
        s.queue_wait_bias = s.queue_wait_pred_s / s.queue_wait_real_s - 1.0;
        s.queue_place_cost_true_s = mean_or_nan(&self.c_true);
        s.queue_place_cost_pred_s = mean_or_nan(&self.c_pred);
        s.queue_residents_done_s = mean_or_nan(&self.w_done);
        s.queue_drained_s = mean_or_nan(&self.w_drained);
        s
    }
}

impl AuditSummary {
    /// Condenses records with the truth filled in; `min_gain` is the placer's
    /// throughput-gain guard.
    pub fn of(records: &[AuditRecord], min_gain: f64) -> AuditSummary {
        let mut tally = Tally {
            summary: AuditSummary {
                decisions: records.len(),
                ..AuditSummary::default()
            },
            ..Tally::default()
        };
        for r in records {
            tally.model_errors(r);
            match (r.verdict, r.placed_idle) {
                ("place", true) => tally.summary.placed_idle += 1,
                ("place", false) => tally.shared(r, min_gain),
                ("held", _) => tally.summary.held += 1,
                _ => tally.queued(r),
            }
            tally.ranking(r);
        }
        tally.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(id: usize, device: usize, start_s: f64, finish_s: f64) -> TaskOutcome {
        TaskOutcome {
            id,
            model: String::new(),
            m0: 1,
            submit_s: 0.0,
            start_s,
            finish_s,
            ooms: 0,
            fenced_ooms: 0,
            work_samples: 1.0,
            done_samples: 1.0,
            device,
            final_batch_size: 1,
            max_slowdown: None,
            running_s: finish_s - start_s,
            above_cap_s: 0.0,
            above_cap_where: Default::default(),
            evictions: 0,
            evicted_work_s: 0.0,
        }
    }

    #[test]
    fn a_device_joined_while_busy_frees_up_later_than_its_residents_finish() {
        let outcomes = [
            // GPU 0: busy until 100 s, but a task joins at 50 s and runs to 300 s.
            outcome(0, 0, 0.0, 100.0),
            outcome(1, 0, 50.0, 300.0),
            // GPU 1: busy until 200 s; the task starting the moment it frees took an
            // empty device, so GPU 1 counts as free at 200 s.
            outcome(2, 1, 0.0, 200.0),
            outcome(3, 1, 200.0, 900.0),
            // GPU 2: idle at the decision (its task starts later), so not counted.
            outcome(4, 2, 20.0, 60.0),
        ];
        let occupancy = occupancy(&outcomes);
        let (mut done, mut drained) = freeing_times(&occupancy, 10.0);
        done.sort_by(f64::total_cmp);
        drained.sort_by(f64::total_cmp);
        assert_eq!(done, vec![90.0, 190.0]);
        assert_eq!(drained, vec![190.0, 290.0]);
        assert_eq!(kth_smallest(drained.clone(), 0), Some(190.0));
        assert_eq!(kth_smallest(drained, 2), None);
    }

    #[test]
    fn the_freeing_times_go_to_queue_decisions_with_a_wait_only() {
        let outcomes = [
            outcome(0, 0, 0.0, 100.0),
            outcome(1, 0, 50.0, 300.0),
            outcome(2, 1, 400.0, 500.0),
        ];
        let queued = AuditRecord {
            verdict: "queue",
            at_s: 10.0,
            task: 2,
            wait_s: Some(90.0),
            ..AuditRecord::default()
        };
        let no_wait = AuditRecord {
            wait_s: None,
            ..queued.clone()
        };
        let placed = AuditRecord {
            verdict: "place",
            ..queued.clone()
        };
        let mut records = [queued, no_wait, placed];
        fill_waits(&mut records, &outcomes);
        assert_eq!(records[0].started_s, Some(400.0));
        assert_eq!(
            (records[0].residents_done_s, records[0].drained_s),
            (Some(90.0), Some(290.0))
        );
        for r in &records[1..] {
            assert_eq!((r.residents_done_s, r.drained_s), (None, None));
        }
    }

    #[test]
    fn pd_increase_and_gain_follow_the_placer_formulas() {
        // Two residents at 1.2 each; the newcomer makes them 1.5 and runs at 1.6.
        let s = Slowdowns {
            own: 1.6,
            with: vec![1.5, 1.5],
            without: vec![1.2, 1.2],
        };
        assert!((s.pd_increase() - (1.6 + 0.6)).abs() < 1e-12);
        let gain = 1.0 / 1.6 + 2.0 / 1.5 - 2.0 / 1.2;
        assert!((s.throughput_gain() - gain).abs() < 1e-12);
    }

    #[test]
    fn the_summary_counts_verdicts_and_judges_the_ranking_by_the_truth() {
        let cand = |device, pred: f64, truth: f64| AuditCandidate {
            device,
            residents: vec![(9, 32)],
            predicted: Slowdowns {
                own: pred,
                with: vec![pred],
                without: vec![1.0],
            },
            heuristic: Slowdowns {
                own: 1.2,
                with: vec![1.2],
                without: vec![1.0],
            },
            truth: Some(Slowdowns {
                own: truth,
                with: vec![truth],
                without: vec![1.0],
            }),
            ..AuditCandidate::default()
        };
        let placed = AuditRecord {
            verdict: "place",
            device: Some(0),
            model_samples: 50,
            // Chosen by prediction (1.3 < 1.4) but truly worse (1.9 > 1.5).
            candidates: vec![cand(0, 1.3, 1.9), cand(1, 1.4, 1.5)],
            wait_s: Some(100.0),
            duration_s: 1000.0,
            ..AuditRecord::default()
        };
        let queued = AuditRecord {
            verdict: "queue",
            at_s: 10.0,
            started_s: Some(5000.0),
            candidates: vec![cand(0, 2.0, 1.1)],
            duration_s: 1000.0,
            wait_s: Some(50.0),
            residents_done_s: Some(60.0),
            drained_s: Some(4990.0),
            ..AuditRecord::default()
        };
        // Held for a task ahead: not the queue rule's answer, and it weighed no W.
        let held = AuditRecord {
            verdict: "held",
            wait_s: None,
            ..queued.clone()
        };
        let s = AuditSummary::of(&[placed, queued, held], 0.1);
        assert_eq!(
            (s.decisions, s.placed_shared, s.queued, s.held),
            (3, 1, 1, 1)
        );
        assert_eq!((s.ranked, s.ranked_best), (1, 0));
        // True gain of the chosen pair: 2 / 1.9 − 1 < 0.1.
        assert_eq!(s.shared_bad_gain, 1);
        // True cost 0.8 × 1000 s > W = 100 s.
        assert_eq!(s.shared_regretted, 1);
        // Placing would have cost 0.2 × 1000 s, the wait was 4990 s.
        assert_eq!(s.queue_regretted, 1);
        assert_eq!(
            (
                s.queue_wait_pred_s,
                s.queue_residents_done_s,
                s.queue_drained_s
            ),
            (50.0, 60.0, 4990.0)
        );
        // W said 50 s where the task waited 4,990 s.
        assert!((s.queue_wait_bias - (50.0 / 4990.0 - 1.0)).abs() < 1e-12);
        assert_eq!(s.model_fitted.n, 2);
        // The queued and the held decisions' candidate, predicted cold.
        assert_eq!(s.model_cold.n, 2);
        assert!(s.model_fitted.own_bias < 0.0);
    }
}
