//! GP-LCB over the joint batch-size lattice of the tasks sharing one GPU.
//!
//! The search minimises the device objective Σ_k PD_k. Each round it fits a
//! [`GaussianProcess`] to the observations (inputs: log2 batch sizes) and proposes the
//! memory-feasible configuration minimising μ(x) − √β_t σ(x), with the finite-domain schedule
//! β_t = 2 ln(|D| t² π² / 6δ) of Srinivas et al. (2010). Small lattices are enumerated; large
//! ones are sampled and the best samples refined by coordinate descent.
//!
//! The search never measures anything itself: an [`Evaluator`] runs a configuration and
//! returns its Σ PD (the tuner daemon over the store, the Gavel benchmark, tests).
//! [`Controller`] adds the stopping rule, hysteresis and re-opening on top.

use nalgebra::DMatrix;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Result, TunerError};
use crate::gp::{GaussianProcess, GpParams, Prediction};

/// The world as the search sees it.
pub trait Evaluator {
    /// Applies `batch_sizes` (one per task, in the search space's order), waits for fresh
    /// measurements and returns Σ PD, or `None` when the configuration ran out of memory.
    fn evaluate(&mut self, batch_sizes: &[u32]) -> Result<Option<f64>>;
}

/// The memory limit of the card and each task's conservative memory at each candidate size.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryConstraint {
    /// `upper_mib[task][i]`: upper bound at `sizes[task][i]`; `None` = infeasible.
    pub upper_mib: Vec<Vec<Option<f64>>>,
    /// Memory of the card, MiB.
    pub capacity_mib: f64,
    /// Fraction of the card kept free (e.g. 0.05).
    pub margin: f64,
}

/// The lattice the search runs over.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchSpace {
    /// Candidate batch sizes of each task, ascending, non-empty.
    pub sizes: Vec<Vec<u32>>,
    /// Index (per task) of the first configuration to try, usually the submitted sizes m0.
    pub start: Vec<usize>,
    /// Memory feasibility; `None` when memory is unknown and only OOM reports restrict.
    pub memory: Option<MemoryConstraint>,
}

impl SearchSpace {
    /// Validates the space.
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(TunerError::InvalidInput(m));
        if self.sizes.is_empty() {
            return bad("a search space needs at least one task".to_owned());
        }
        if self.start.len() != self.sizes.len() {
            return bad(format!(
                "start has {} entries for {} tasks",
                self.start.len(),
                self.sizes.len()
            ));
        }
        for (t, sizes) in self.sizes.iter().enumerate() {
            if sizes.is_empty() || sizes.contains(&0) || sizes.windows(2).any(|w| w[0] >= w[1]) {
                return bad(format!(
                    "task {t}: candidate batch sizes must be positive and strictly ascending"
                ));
            }
            if self.start[t] >= sizes.len() {
                return bad(format!("task {t}: start index out of range"));
            }
        }
        if let Some(mem) = &self.memory {
            if mem.upper_mib.len() != self.sizes.len()
                || mem
                    .upper_mib
                    .iter()
                    .zip(&self.sizes)
                    .any(|(u, s)| u.len() != s.len())
            {
                return bad("memory bounds must have one entry per task and size".to_owned());
            }
            if !(mem.capacity_mib > 0.0 && (0.0..1.0).contains(&mem.margin)) {
                return bad(format!(
                    "capacity must be positive and margin in [0, 1), got {} and {}",
                    mem.capacity_mib, mem.margin
                ));
            }
        }
        Ok(())
    }

    /// Number of configurations |D|.
    pub fn cardinality(&self) -> f64 {
        self.sizes.iter().map(|s| s.len() as f64).product()
    }

    /// Batch sizes of a configuration given by indices.
    pub fn batch_sizes(&self, idx: &[usize]) -> Vec<u32> {
        idx.iter().zip(&self.sizes).map(|(&i, s)| s[i]).collect()
    }

    /// log2 batch sizes: the GP's input.
    fn point(&self, idx: &[usize]) -> Vec<f64> {
        idx.iter()
            .zip(&self.sizes)
            .map(|(&i, s)| f64::from(s[i]).log2())
            .collect()
    }

    /// Whether the summed memory upper bounds fit the card with its margin.
    pub fn fits_memory(&self, idx: &[usize]) -> bool {
        let Some(mem) = &self.memory else { return true };
        let mut total = 0.0;
        for (t, &i) in idx.iter().enumerate() {
            match mem.upper_mib[t][i] {
                Some(m) => total += m,
                None => return false,
            }
        }
        total <= mem.capacity_mib * (1.0 - mem.margin)
    }
}

/// Parameters of GP-LCB.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LcbParams {
    /// Confidence parameter δ of β_t, in (0, 1).
    pub delta: f64,
    /// Enumerate the lattice when it has at most this many configurations.
    pub exact_limit: usize,
    /// Random candidates for large lattices.
    pub random_candidates: usize,
    /// Best random candidates refined by coordinate descent.
    pub descent_starts: usize,
    /// Multiplier of β_t. The theoretical β_t is known to over-explore; Srinivas et al.
    /// themselves scale it down by 5 in their experiments, which is the default here.
    pub beta_scale: f64,
    /// Re-optimise the GP hyper-parameters every this many observations (1 = every round);
    /// in between the previous ones are kept and only the Cholesky factor is recomputed.
    pub refit_every: usize,
    /// The GP fit.
    pub gp: GpParams,
}

impl Default for LcbParams {
    /// δ = 0.1 as in Srinivas et al.; 4,096 configurations enumerate in well under a
    /// millisecond-scale budget per 50 observations; 256 samples + 3 descents otherwise.
    fn default() -> Self {
        LcbParams {
            delta: 0.1,
            exact_limit: 4096,
            random_candidates: 256,
            descent_starts: 3,
            beta_scale: 0.2,
            refit_every: 1,
            gp: GpParams::default(),
        }
    }
}

impl LcbParams {
    /// Validates the parameters.
    pub fn check(&self) -> Result<()> {
        let ranges_ok = self.delta > 0.0
            && self.delta < 1.0
            && self.beta_scale > 0.0
            && self.beta_scale.is_finite();
        if !ranges_ok
            || self.random_candidates == 0
            || self.descent_starts == 0
            || self.refit_every == 0
        {
            return Err(TunerError::InvalidParams(format!(
                "GP-LCB needs δ in (0, 1), a positive β scale at least one random candidate and descent start and refit_every ≥ 1, got {self:?}"
            )));
        }
        self.gp.check()
    }
}

/// The GP-LCB search state: observations and out-of-memory configurations.
#[derive(Clone, Debug)]
pub struct GpLcb {
    space: SearchSpace,
    params: LcbParams,
    observations: Vec<(Vec<usize>, f64)>,
    out_of_memory: Vec<Vec<usize>>,
    hyper: Option<nalgebra::DVector<f64>>,
    /// Observation count at the last full hyper-parameter fit.
    fitted_at: usize,
    model: Option<GaussianProcess>,
    rng: ChaCha8Rng,
}

impl GpLcb {
    /// A new search over `space`; `seed` makes restarts and sampling reproducible.
    pub fn new(space: SearchSpace, params: LcbParams, seed: u64) -> Result<GpLcb> {
        space.check()?;
        params.check()?;
        Ok(GpLcb {
            space,
            params,
            observations: Vec::new(),
            out_of_memory: Vec::new(),
            hyper: None,
            fitted_at: 0,
            model: None,
            rng: ChaCha8Rng::seed_from_u64(seed),
        })
    }

    /// The search space.
    pub fn space(&self) -> &SearchSpace {
        &self.space
    }

    /// Changes how often the hyper-parameters are re-optimised (see [`LcbParams::refit_every`]).
    pub fn set_refit_every(&mut self, every: usize) -> Result<()> {
        let params = LcbParams {
            refit_every: every,
            ..self.params
        };
        params.check()?;
        self.params = params;
        Ok(())
    }

    /// Observations so far: (indices, Σ PD).
    pub fn observations(&self) -> &[(Vec<usize>, f64)] {
        &self.observations
    }

    /// Configurations reported out of memory.
    pub fn out_of_memory(&self) -> &[Vec<usize>] {
        &self.out_of_memory
    }

    /// Feasible = fits the memory model and is not at or above (in every task) a
    /// configuration that ran out of memory: memory grows with every task's batch size.
    pub fn feasible(&self, idx: &[usize]) -> bool {
        self.space.fits_memory(idx)
            && !self
                .out_of_memory
                .iter()
                .any(|oom| oom.iter().zip(idx).all(|(o, i)| i >= o))
    }

    /// Records a measurement (`None` = out of memory).
    pub fn observe(&mut self, idx: &[usize], value: Option<f64>) -> Result<()> {
        if idx.len() != self.space.sizes.len()
            || idx
                .iter()
                .zip(&self.space.sizes)
                .any(|(&i, s)| i >= s.len())
        {
            return Err(TunerError::InvalidInput(format!(
                "configuration {idx:?} is not in the search space"
            )));
        }
        match value {
            Some(v) if v.is_finite() => self.observations.push((idx.to_vec(), v)),
            Some(v) => {
                return Err(TunerError::InvalidInput(format!(
                    "objective must be finite, got {v}"
                )));
            }
            None => {
                tracing::info!(config = ?self.space.batch_sizes(idx), "configuration ran out of memory; it and all larger ones are now infeasible");
                self.out_of_memory.push(idx.to_vec());
            }
        }
        self.model = None;
        Ok(())
    }

    /// β_t for the next round t = observations + 1 (times `beta_scale`).
    pub fn beta(&self) -> f64 {
        let t = (self.observations.len() + 1) as f64;
        self.params.beta_scale
            * 2.0
            * (self.space.cardinality() * t * t * std::f64::consts::PI.powi(2)
                / (6.0 * self.params.delta))
                .ln()
    }

    /// Fits (or returns the cached) GP; `None` before the first observation.
    pub fn model(&mut self) -> Result<Option<&GaussianProcess>> {
        if self.model.is_none() && !self.observations.is_empty() {
            let n = self.observations.len();
            let d = self.space.sizes.len();
            let mut x = DMatrix::zeros(n, d);
            for (r, (idx, _)) in self.observations.iter().enumerate() {
                for (c, v) in self.space.point(idx).into_iter().enumerate() {
                    x[(r, c)] = v;
                }
            }
            let y: Vec<f64> = self.observations.iter().map(|(_, v)| *v).collect();
            let gp = match &self.hyper {
                Some(theta) if n - self.fitted_at < self.params.refit_every => {
                    GaussianProcess::with_fixed_hyper(x, &y, theta, self.params.gp.jitter)?
                }
                _ => {
                    self.fitted_at = n;
                    GaussianProcess::fit(x, &y, self.params.gp, self.hyper.as_ref(), &mut self.rng)?
                }
            };
            self.hyper = Some(gp.hyper_parameters());
            self.model = Some(gp);
        }
        Ok(self.model.as_ref())
    }

    /// Posterior at a configuration (`None` before the first observation).
    pub fn predict(&mut self, idx: &[usize]) -> Result<Option<Prediction>> {
        let point = self.space.point(idx);
        Ok(self.model()?.map(|gp| gp.predict(&point)))
    }

    /// The next configuration to measure (indices into the space).
    pub fn suggest(&mut self) -> Result<Vec<usize>> {
        if self.observations.is_empty() {
            if self.feasible(&self.space.start) {
                return Ok(self.space.start.clone());
            }
            let smallest = vec![0; self.space.sizes.len()];
            if self.feasible(&smallest) {
                return Ok(smallest);
            }
            return Err(TunerError::NoFeasibleConfiguration(
                "even the smallest batch sizes do not fit the card".to_owned(),
            ));
        }
        let beta_sqrt = self.beta().sqrt();
        self.model()?;
        let Some(gp) = self.model.as_ref() else {
            return Err(TunerError::Numerical("GP missing after fit".to_owned()));
        };
        let score = |idx: &[usize]| {
            let p = gp.predict(&self.space.point(idx));
            p.mean - beta_sqrt * p.std
        };
        let sizes = &self.space.sizes;
        let mut best: Option<(f64, Vec<usize>)> = None;
        let consider = |idx: &[usize], s: f64, best: &mut Option<(f64, Vec<usize>)>| {
            if best.as_ref().is_none_or(|(b, _)| s < *b) {
                *best = Some((s, idx.to_vec()));
            }
        };
        if self.space.cardinality() <= self.params.exact_limit as f64 {
            let mut idx = vec![0usize; sizes.len()];
            loop {
                if self.feasible(&idx) {
                    let s = score(&idx);
                    consider(&idx, s, &mut best);
                }
                // Odometer increment.
                let mut t = 0;
                loop {
                    if t == idx.len() {
                        return best.map(|(_, i)| i).ok_or_else(|| {
                            TunerError::NoFeasibleConfiguration(
                                "every configuration is infeasible".to_owned(),
                            )
                        });
                    }
                    idx[t] += 1;
                    if idx[t] < sizes[t].len() {
                        break;
                    }
                    idx[t] = 0;
                    t += 1;
                }
            }
        }
        // Large lattice: random feasible candidates, plus the observed ones (the incumbent
        // neighbourhood matters most), then coordinate descent from the best few.
        let mut pool: Vec<(f64, Vec<usize>)> = Vec::new();
        for (idx, _) in &self.observations {
            if self.feasible(idx) {
                pool.push((score(idx), idx.clone()));
            }
        }
        for _ in 0..self.params.random_candidates {
            let idx: Vec<usize> = sizes
                .iter()
                .map(|s| self.rng.random_range(0..s.len()))
                .collect();
            if self.feasible(&idx) {
                pool.push((score(&idx), idx));
            }
        }
        pool.sort_by(|a, b| a.0.total_cmp(&b.0));
        pool.truncate(self.params.descent_starts);
        for (mut s, mut idx) in pool {
            // A few sweeps suffice: the LCB surface is smooth in log2 batch size.
            let mut improved = true;
            let mut sweeps = 0;
            while improved && sweeps < 4 {
                improved = false;
                sweeps += 1;
                for t in 0..sizes.len() {
                    let keep = idx[t];
                    let mut best_i = keep;
                    for i in 0..sizes[t].len() {
                        if i == keep {
                            continue;
                        }
                        idx[t] = i;
                        if self.feasible(&idx) {
                            let v = score(&idx);
                            if v < s {
                                s = v;
                                best_i = i;
                                improved = true;
                            }
                        }
                    }
                    idx[t] = best_i;
                }
            }
            consider(&idx, s, &mut best);
        }
        best.map(|(_, i)| i).ok_or_else(|| {
            TunerError::NoFeasibleConfiguration(
                "no feasible candidate found by sampling".to_owned(),
            )
        })
    }

    /// The observed configuration with the lowest posterior mean (robust to one lucky noisy
    /// measurement), or `None` before any observation.
    pub fn incumbent(&mut self) -> Result<Option<(Vec<usize>, f64)>> {
        let configs: Vec<Vec<usize>> = self.observations.iter().map(|(i, _)| i.clone()).collect();
        let mut best: Option<(Vec<usize>, f64)> = None;
        for idx in configs {
            if let Some(p) = self.predict(&idx)?
                && best.as_ref().is_none_or(|(_, b)| p.mean < *b)
            {
                best = Some((idx, p.mean));
            }
        }
        Ok(best)
    }

    /// Runs one round against `world`: suggest, evaluate, observe. Returns what was tried.
    pub fn step<E: Evaluator + ?Sized>(
        &mut self,
        world: &mut E,
    ) -> Result<(Vec<usize>, Option<f64>)> {
        let idx = self.suggest()?;
        let value = world.evaluate(&self.space.batch_sizes(&idx))?;
        self.observe(&idx, value)?;
        Ok((idx, value))
    }
}

/// Stopping, hysteresis and re-opening around [`GpLcb`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ControllerParams {
    /// Stop after this many rounds without the best observation improving by more than
    /// `min_improvement` (relative).
    pub patience: usize,
    /// Relative improvement that counts (about the measurement noise).
    pub min_improvement: f64,
    /// Change a running configuration only for a predicted relative gain of at least this.
    pub hysteresis: f64,
    /// Re-open when a settled configuration's measured value drifts by more than this
    /// (relative) from what the model expects.
    pub drift: f64,
}

impl Default for ControllerParams {
    /// 5 rounds, 1% noise, 5% hysteresis (flapping batch sizes is a known complaint), 15% drift.
    fn default() -> Self {
        ControllerParams {
            patience: 5,
            min_improvement: 0.01,
            hysteresis: 0.05,
            drift: 0.15,
        }
    }
}

/// What the controller wants the world to run next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Searching: measure this configuration.
    Explore(Vec<usize>),
    /// Settled: keep running this configuration (and report its measurements).
    Settle(Vec<usize>),
}

/// The closed-loop controller of one device.
#[derive(Debug)]
pub struct Controller {
    search: GpLcb,
    params: ControllerParams,
    best: Option<f64>,
    stale_rounds: usize,
    settled: Option<(Vec<usize>, f64)>,
}

impl Controller {
    /// A controller over a fresh search.
    pub fn new(search: GpLcb, params: ControllerParams) -> Controller {
        Controller {
            search,
            params,
            best: None,
            stale_rounds: 0,
            settled: None,
        }
    }

    /// The underlying search.
    pub fn search(&mut self) -> &mut GpLcb {
        &mut self.search
    }

    /// Whether the search has stopped.
    pub fn is_settled(&self) -> bool {
        self.settled.is_some()
    }

    /// The next configuration to run.
    pub fn decide(&mut self) -> Result<Decision> {
        if let Some((idx, _)) = &self.settled {
            return Ok(Decision::Settle(idx.clone()));
        }
        Ok(Decision::Explore(self.search.suggest()?))
    }

    /// Records the measurement of the configuration last decided.
    pub fn record(&mut self, idx: &[usize], value: Option<f64>) -> Result<()> {
        if let Some((settled_idx, expected)) = self.settled.clone() {
            self.search.observe(idx, value)?;
            let drifted = match value {
                None => true,
                Some(v) => (v - expected).abs() > self.params.drift * expected.abs(),
            };
            if drifted && idx == settled_idx.as_slice() {
                tracing::info!(
                    ?value,
                    expected,
                    "measured objective drifted; re-opening the search"
                );
                self.reopen();
            }
            return Ok(());
        }
        self.search.observe(idx, value)?;
        match (value, self.best) {
            (Some(v), Some(b)) if v < b * (1.0 - self.params.min_improvement) => {
                self.best = Some(v);
                self.stale_rounds = 0;
            }
            (Some(v), None) => self.best = Some(v),
            _ => self.stale_rounds += 1,
        }
        if self.stale_rounds >= self.params.patience {
            self.settle()?;
        }
        Ok(())
    }

    /// Stops searching and picks the configuration to keep, with hysteresis against the
    /// one currently settled (if any).
    fn settle(&mut self) -> Result<()> {
        let Some((idx, mean)) = self.search.incumbent()? else {
            return Ok(());
        };
        tracing::info!(config = ?self.search.space().batch_sizes(&idx), predicted = mean, "search settled");
        self.settled = Some((idx, mean));
        Ok(())
    }

    /// Whether moving from `current` to `candidate` is worth it: predicted relative gain ≥ the
    /// hysteresis threshold.
    pub fn worth_switching(&mut self, current: &[usize], candidate: &[usize]) -> Result<bool> {
        if current == candidate {
            return Ok(false);
        }
        match (
            self.search.predict(current)?,
            self.search.predict(candidate)?,
        ) {
            (Some(a), Some(b)) => Ok(b.mean < a.mean * (1.0 - self.params.hysteresis)),
            _ => Ok(true),
        }
    }

    /// Re-opens the search (measured drift), keeping the observations.
    pub fn reopen(&mut self) {
        self.settled = None;
        self.stale_rounds = 0;
        self.best = None;
    }

    /// Replaces the search space (a task joined or left): old observations describe another
    /// set of tasks, so the search starts over.
    pub fn restart(&mut self, space: SearchSpace, params: LcbParams, seed: u64) -> Result<()> {
        self.search = GpLcb::new(space, params, seed)?;
        self.reopen();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A known convex surface in log2 space with its minimum at (64, 32).
    struct Bowl;
    impl Evaluator for Bowl {
        fn evaluate(&mut self, b: &[u32]) -> Result<Option<f64>> {
            let (x, y) = (f64::from(b[0]).log2(), f64::from(b[1]).log2());
            Ok(Some(
                2.0 + 0.3 * (x - 6.0).powi(2) + 0.2 * (y - 5.0).powi(2),
            ))
        }
    }

    fn space(memory: Option<MemoryConstraint>) -> SearchSpace {
        let sizes: Vec<u32> = (3..=9).map(|p| 1 << p).collect();
        SearchSpace {
            sizes: vec![sizes.clone(), sizes],
            start: vec![0, 0],
            memory,
        }
    }

    #[test]
    fn finds_the_bowl_minimum() {
        let mut search = GpLcb::new(space(None), LcbParams::default(), 3).expect("valid");
        for _ in 0..20 {
            search.step(&mut Bowl).expect("round");
        }
        let best = search
            .observations()
            .iter()
            .map(|(_, v)| *v)
            .fold(f64::INFINITY, f64::min);
        assert!(best < 2.0 * 1.02, "best {best}");
    }

    #[test]
    fn never_suggests_over_memory_or_above_an_oom() {
        // Memory: 100 MiB per 8 samples per task, card 1000 MiB with 5% margin.
        let sp = space(None);
        let upper: Vec<Vec<Option<f64>>> = sp
            .sizes
            .iter()
            .map(|s| s.iter().map(|&b| Some(f64::from(b) * 12.5)).collect())
            .collect();
        let sp = space(Some(MemoryConstraint {
            upper_mib: upper,
            capacity_mib: 1000.0,
            margin: 0.05,
        }));
        let mut search = GpLcb::new(sp, LcbParams::default(), 5).expect("valid");
        search.observe(&[0, 1], None).expect("valid");
        for _ in 0..12 {
            let (idx, _) = search.step(&mut Bowl).expect("round");
            assert!(search.space().fits_memory(&idx));
            assert!(idx[1] < 1, "suggested {idx:?} at or above the OOM (8, 16)");
        }
    }

    #[test]
    fn large_lattices_use_sampling_and_descent() {
        let sizes: Vec<u32> = (1..=32).map(|i| i * 8).collect();
        let sp = SearchSpace {
            sizes: vec![sizes.clone(); 4],
            start: vec![3; 4],
            memory: None,
        };
        let params = LcbParams::default();
        assert!(sp.cardinality() > params.exact_limit as f64);
        struct Sum;
        impl Evaluator for Sum {
            fn evaluate(&mut self, b: &[u32]) -> Result<Option<f64>> {
                Ok(Some(
                    b.iter()
                        .map(|&v| (f64::from(v).log2() - 6.0).powi(2))
                        .sum::<f64>()
                        + 4.0,
                ))
            }
        }
        let mut search = GpLcb::new(sp, params, 9).expect("valid");
        for _ in 0..25 {
            search.step(&mut Sum).expect("round");
        }
        let best = search
            .observations()
            .iter()
            .map(|(_, v)| *v)
            .fold(f64::INFINITY, f64::min);
        assert!(best < 5.0, "best {best}");
    }

    #[test]
    fn controller_settles_then_reopens_on_drift() {
        let search = GpLcb::new(space(None), LcbParams::default(), 11).expect("valid");
        let mut ctl = Controller::new(
            search,
            ControllerParams {
                patience: 3,
                ..ControllerParams::default()
            },
        );
        let mut rounds = 0;
        while !ctl.is_settled() {
            let Decision::Explore(idx) = ctl.decide().expect("decides") else {
                panic!("settled early")
            };
            let v = Bowl
                .evaluate(&ctl.search().space().batch_sizes(&idx))
                .expect("evaluates");
            ctl.record(&idx, v).expect("records");
            rounds += 1;
            assert!(rounds < 60, "never settled");
        }
        let Decision::Settle(idx) = ctl.decide().expect("decides") else {
            panic!("not settled")
        };
        assert!(!ctl.worth_switching(&idx, &idx).expect("predicts"));
        ctl.record(&idx, Some(100.0)).expect("records");
        assert!(!ctl.is_settled());
    }

    #[test]
    fn hyper_parameters_are_kept_between_refits() {
        let params = LcbParams {
            refit_every: 3,
            ..LcbParams::default()
        };
        let mut search = GpLcb::new(space(None), params, 4).expect("valid");
        // Round 2 fits on 1 observation; observations 2 and 3 reuse its hyper-parameters.
        for _ in 0..2 {
            search.step(&mut Bowl).expect("round");
        }
        let theta = search
            .model()
            .expect("fits")
            .expect("observed")
            .hyper_parameters();
        search.step(&mut Bowl).expect("round");
        let kept = search
            .model()
            .expect("fits")
            .expect("observed")
            .hyper_parameters();
        assert_eq!(theta, kept);
        assert!(search.set_refit_every(0).is_err());
    }

    #[test]
    fn rejects_bad_spaces() {
        let mut sp = space(None);
        sp.start = vec![0];
        assert!(GpLcb::new(sp, LcbParams::default(), 0).is_err());
        let sp = SearchSpace {
            sizes: vec![vec![8, 8]],
            start: vec![0],
            memory: None,
        };
        assert!(GpLcb::new(sp, LcbParams::default(), 0).is_err());
    }
}
