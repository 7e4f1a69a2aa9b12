//! GP-LCB over the joint batch-size lattice of the tasks sharing one GPU.
//!
//! The search minimises the device objective Σ_k PD_k. Each round it fits a
//! [`GaussianProcess`] to ln Σ PD (inputs: log2 batch sizes) and proposes the memory-feasible
//! configuration minimising μ(x) − √β_t σ(x), with the finite-domain schedule
//! β_t = 2 ln(|D| t² π² / 6δ) of Srinivas et al. (2010) scaled as [`LcbParams::beta_scale`]
//! explains. The first configuration is the submitted m0; later ones lie within
//! [`LcbParams::max_step_log2`] doublings of the incumbent if possible, else of a measured one
//! ([`LcbParams::local_first`]), and are not re-measurements while the fitted noise is small.
//! While memory is unknown the acquisition is weighted by the probability that a configuration
//! runs at all, learned from the probes ([`LcbParams::feasibility`], [`crate::feasibility`]).
//! Small lattices are enumerated; large ones are sampled and the best samples refined by
//! coordinate descent.
//!
//! The search never measures anything itself: an [`Evaluator`] runs a configuration and
//! returns its Σ PD (the tuner daemon over the store, the Gavel benchmark, tests).
//! [`Controller`] adds the stopping rule, hysteresis and re-opening on top.

use std::collections::HashSet;

use iadeep_objective::MemoryMargin;
use nalgebra::DMatrix;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Result, TunerError};
use crate::feasibility::{Feasibility, FeasibilityParams, excess_over, shortfall_below};
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
    /// MiB held on the card by tasks outside the search (placed, not running yet).
    pub held_mib: f64,
    /// What is kept free of the card: the one margin the placer and the agent keep too.
    pub margin: MemoryMargin,
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
            if !(mem.capacity_mib.is_finite() && mem.capacity_mib > 0.0) {
                return bad(format!(
                    "card capacity must be positive, got {} MiB",
                    mem.capacity_mib
                ));
            }
            if !(mem.held_mib.is_finite() && mem.held_mib >= 0.0) {
                return bad(format!(
                    "memory held by others must be finite and ≥ 0, got {} MiB",
                    mem.held_mib
                ));
            }
            mem.margin.check()?;
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

    /// Whether the summed memory upper bounds fit the card with its margin (a task alone on
    /// the card, nothing held for others: the whole card, see [`MemoryMargin::fits_on`]).
    pub fn fits_memory(&self, idx: &[usize]) -> bool {
        let Some(mem) = &self.memory else { return true };
        let mut total = mem.held_mib;
        for (t, &i) in idx.iter().enumerate() {
            match mem.upper_mib[t][i] {
                Some(m) => total += m,
                None => return false,
            }
        }
        let alone = idx.len() == 1 && mem.held_mib <= 0.0;
        mem.margin.fits_on(total, mem.capacity_mib, alone)
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
    /// Multiplier of β_t. The theoretical β_t is known to over-explore (Srinivas et al. scale
    /// it down by 5 in their own experiments). The default 0.05 keeps the finite-domain form
    /// but puts β_t within a factor of about 1.6 of the practical schedule
    /// β_t = 0.2·d·ln(2t) of Kandasamy et al. ("High dimensional Bayesian optimisation and
    /// bandits via additive models", ICML 2015) for t ≤ 50, both on two-task lattices of 25
    /// configurations and on four tasks × 32 sizes. Chosen on the Gavel benchmark's tuning
    /// seeds (see docs/tuner-experiments.md, "β scale").
    pub beta_scale: f64,
    /// Re-optimise the GP hyper-parameters every this many observations (1 = every round);
    /// in between the previous ones are kept and only the Cholesky factor is recomputed.
    pub refit_every: usize,
    /// Model ln(Σ PD) rather than Σ PD. PD is a ratio of throughputs: a co-location that
    /// halves throughput doubles it, so small batch sizes produce values 5–10× the optimum
    /// which, on the raw scale, dominate the standardised targets and flatten the region that
    /// matters. On the log scale the surface is closer to stationary and the measurement noise
    /// (multiplicative) is homoscedastic. Used only while every observation is positive.
    pub log_objective: bool,
    /// Re-measure an already observed configuration only when the fitted measurement noise
    /// (relative standard deviation) exceeds this. Below it a repeat cannot reveal a gain
    /// worth having (the controller ignores gains under its 1% `min_improvement`), so the
    /// round is better spent on a configuration never tried. 0 always allows repeats.
    pub repeat_noise: f64,
    /// How far (in doublings of any task's batch size, Chebyshev distance in log2) a
    /// suggestion may lie from the nearest measured configuration; ∞ = anywhere.
    ///
    /// Every exploration round runs real training jobs at the suggested sizes, so a jump from
    /// the submitted m0 to the far corners of the lattice costs real throughput (the smallest
    /// sizes are often 3–5× slower) or an out-of-memory crash, and the optimum of Σ PD is
    /// usually a few doublings from m0. Restricting each step to the neighbourhood of what was
    /// measured is the expansion scheme of safe Bayesian optimisation (Sui et al., "Safe
    /// exploration for optimization with Gaussian processes", ICML 2015) with a geometric
    /// rather than a model-based safe set; the reachable set grows with every measurement, so
    /// every feasible configuration stays reachable.
    ///
    /// The default is one doubling: with two, the second round (the GP knows m0 alone, so the
    /// LCB is lowest where σ is largest) goes to a corner two doublings away in both tasks —
    /// the slowest or the likeliest to crash. Chosen together with
    /// [`LcbParams::local_first`] (see docs/tuner-experiments.md, "Step limit").
    pub max_step_log2: f64,
    /// Look first within [`LcbParams::max_step_log2`] of the incumbent (the measured
    /// configuration with the lowest posterior mean), and within the step limit of any other
    /// measured configuration only when that neighbourhood holds no allowed configuration
    /// left to measure (measured ones count as left to measure while repeats are allowed, see
    /// [`LcbParams::repeat_noise`]).
    ///
    /// A trust region centred on the incumbent (Eriksson et al., "Scalable global optimization
    /// via local Bayesian optimization", NeurIPS 2019): the optimum of Σ PD is usually a
    /// doubling or two from a good configuration, and a global LCB with few observations keeps
    /// spending rounds on the far corners of what was measured, where σ is largest (it cuts
    /// the p90 rounds to the target, see docs/tuner-experiments.md, "Trust region around the
    /// incumbent").
    pub local_first: bool,
    /// The feasibility model used while memory is unknown (`SearchSpace::memory` is `None`);
    /// `None` = plain GP-LCB, every configuration not ruled out by an out-of-memory report
    /// counts as feasible.
    ///
    /// Without a memory model an exploratory probe can crash: a round spent, and in the
    /// daemon real jobs restarted. With it the acquisition becomes constrained: among the
    /// configurations whose lower confidence bound promises an improvement on the incumbent's
    /// posterior mean, the search maximises P(runs) × (incumbent − LCB), the expected
    /// optimistic gain of the round, which is how constrained Bayesian optimisation weighs
    /// expected improvement by the probability that the constraint holds (see
    /// `feasibility.rs`). Where nothing promises an improvement it minimises the LCB as
    /// before. With a memory model (`memory: Some`) P(runs) = 1 for everything that fits it
    /// (the model is fit on measured peaks, takes out-of-memory reports in and keeps a
    /// margin, so it knows more than a few probes), and the rule reduces to plain GP-LCB.
    ///
    /// It reaches the target in fewer rounds by ordering, not by avoiding crashes: early on
    /// the only configurations certain to run lie below what ran, and measuring one reveals
    /// the slope of the surface (figures in docs/tuner-experiments.md, "Feasibility-weighted
    /// acquisition").
    pub feasibility: Option<FeasibilityParams>,
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
            beta_scale: 0.05,
            refit_every: 1,
            log_objective: true,
            repeat_noise: 0.02,
            max_step_log2: 1.0,
            local_first: true,
            feasibility: Some(FeasibilityParams::default()),
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
            && self.beta_scale.is_finite()
            && self.repeat_noise >= 0.0
            && self.repeat_noise.is_finite()
            && self.max_step_log2 > 0.0;
        if !ranges_ok
            || self.random_candidates == 0
            || self.descent_starts == 0
            || self.refit_every == 0
        {
            return Err(TunerError::InvalidParams(format!(
                "GP-LCB needs δ in (0, 1), a positive β scale, at least one random candidate and descent start, refit_every ≥ 1, a finite repeat_noise ≥ 0 and a positive max_step_log2, got {self:?}"
            )));
        }
        if let Some(f) = &self.feasibility {
            f.check()?;
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
    /// Configurations measured with a production job above its slowdown cap, and what
    /// else they rule out (see [`OverCap`]).
    over_cap: OverCap,
    /// P(runs) learned from the probes (see [`LcbParams::feasibility`]).
    feasibility: Option<Feasibility>,
    hyper: Option<nalgebra::DVector<f64>>,
    /// Observation count at the last full hyper-parameter fit.
    fitted_at: usize,
    model: Option<GaussianProcess>,
    /// Whether `model` was fitted on ln(Σ PD) (see [`LcbParams::log_objective`]).
    log_space: bool,
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
            over_cap: OverCap::default(),
            feasibility: params.feasibility.map(Feasibility::new).transpose()?,
            hyper: None,
            fitted_at: 0,
            model: None,
            log_space: false,
            rng: ChaCha8Rng::seed_from_u64(seed),
        })
    }

    /// The search space.
    pub fn space(&self) -> &SearchSpace {
        &self.space
    }

    /// Replaces the memory constraint (the closed loop learns memory as reports arrive).
    /// Observations stay valid: they describe the same tasks at the same sizes.
    pub fn set_memory(&mut self, memory: Option<MemoryConstraint>) -> Result<()> {
        let space = SearchSpace {
            memory,
            ..self.space.clone()
        };
        space.check()?;
        self.space = space;
        Ok(())
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

    /// Feasible = fits the memory model, is not at or above (in every task) a
    /// configuration that ran out of memory (memory grows with every task's batch size),
    /// and is not ruled out by a configuration measured with a production job above its
    /// slowdown cap (see [`GpLcb::rule_out_over_cap`]).
    pub fn feasible(&self, idx: &[usize]) -> bool {
        feasible(&self.space, &self.out_of_memory, &self.over_cap, idx)
    }

    /// Says which tasks are opportunistic (may be shrunk for a production job's cap), in the
    /// space's order; the others are production. Until it is called every task counts as
    /// production, so a configuration over a cap rules out only itself.
    pub fn set_opportunistic(&mut self, opportunistic: Vec<bool>) -> Result<()> {
        if opportunistic.len() != self.space.sizes.len() {
            return Err(TunerError::InvalidInput(format!(
                "{} class flags for {} tasks",
                opportunistic.len(),
                self.space.sizes.len()
            )));
        }
        self.over_cap.opportunistic = opportunistic;
        Ok(())
    }

    /// Records that `idx` was measured with a production job's PD above its cap: it is
    /// infeasible from now on, and so is every configuration with the same production
    /// sizes and opportunistic sizes at least as large (see `OverCap`). Its Σ PD, if it
    /// was observed, stays in the model: it is a true measurement, only not a choice.
    pub fn rule_out_over_cap(&mut self, idx: &[usize]) -> Result<()> {
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
        if !self.over_cap.rules_out(idx) {
            tracing::info!(config = ?self.space.batch_sizes(idx),
                "a production job ran above its slowdown cap here; it and larger opportunistic sizes beside the same production sizes are now infeasible");
            self.over_cap.configs.push(idx.to_vec());
        }
        Ok(())
    }

    /// The configurations measured above a production job's cap.
    pub fn over_cap(&self) -> &[Vec<usize>] {
        &self.over_cap.configs
    }

    /// Whether a configuration measured above a production job's cap rules `idx` out.
    pub fn over_cap_rules_out(&self, idx: &[usize]) -> bool {
        self.over_cap.rules_out(idx)
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
        if let Some(f) = &mut self.feasibility
            && !self.observations.is_empty()
            && value.is_none_or(f64::is_finite)
        {
            // How far past what was known to run this probe went, before it is recorded.
            let measured: Vec<f64> = self
                .observations
                .iter()
                .flat_map(|(o, _)| self.space.point(o))
                .collect();
            if let Some(excess) = excess_over(&measured, &self.space.point(idx)) {
                f.record(excess, value.is_some());
            }
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
            let log_space =
                self.params.log_objective && self.observations.iter().all(|(_, v)| *v > 0.0);
            let y: Vec<f64> = self
                .observations
                .iter()
                .map(|(_, v)| if log_space { v.ln() } else { *v })
                .collect();
            let gp = match &self.hyper {
                Some(theta) if n - self.fitted_at < self.params.refit_every => {
                    GaussianProcess::with_fixed_hyper(x, &y, theta, self.params.gp)?
                }
                _ => {
                    self.fitted_at = n;
                    GaussianProcess::fit(x, &y, self.params.gp, self.hyper.as_ref(), &mut self.rng)?
                }
            };
            self.hyper = Some(gp.hyper_parameters());
            self.model = Some(gp);
            self.log_space = log_space;
        }
        Ok(self.model.as_ref())
    }

    /// Posterior at a configuration in the units of the objective (`None` before the first
    /// observation). On the log scale the mean is exp(μ) (the posterior median) and the
    /// standard deviation exp(μ)·σ (first order).
    pub fn predict(&mut self, idx: &[usize]) -> Result<Option<Prediction>> {
        let point = self.space.point(idx);
        let log_space = self.log_space_after_fit()?;
        Ok(self.model.as_ref().map(|gp| {
            let p = gp.predict(&point);
            if log_space {
                let mean = p.mean.exp();
                Prediction {
                    mean,
                    std: mean * p.std,
                }
            } else {
                p
            }
        }))
    }

    /// Fits the model if needed and says whether it models ln(Σ PD).
    fn log_space_after_fit(&mut self) -> Result<bool> {
        self.model()?;
        Ok(self.log_space)
    }

    /// The fitted measurement noise as a relative standard deviation (`None` before a fit).
    fn relative_noise(&self) -> Option<f64> {
        let gp = self.model.as_ref()?;
        if self.log_space {
            return Some(gp.noise_std());
        }
        let scale = iadeep_objective::stats::mean(self.observations.iter().map(|(_, v)| v.abs()))?;
        (scale > 0.0).then(|| gp.noise_std() / scale)
    }

    /// The next configuration to measure (indices into the space).
    pub fn suggest(&mut self) -> Result<Vec<usize>> {
        if self.observations.is_empty() {
            // m0, else m0 halved in every task, halved again…, down to the smallest sizes:
            // the agent's own out-of-memory fall-back halves the batch size, and the halved
            // configuration is the closest to what the user submitted that has a fair chance
            // to fit (the smallest sizes are often several times slower).
            let mut divisor = 1u32;
            loop {
                let idx: Vec<usize> = self
                    .space
                    .sizes
                    .iter()
                    .zip(&self.space.start)
                    .map(|(s, &i)| {
                        let target = s[i] / divisor;
                        s.partition_point(|&b| b <= target).saturating_sub(1)
                    })
                    .collect();
                if self.feasible(&idx) {
                    return Ok(idx);
                }
                if idx.iter().all(|&i| i == 0) || divisor >= 1 << 30 {
                    return Err(TunerError::NoFeasibleConfiguration(
                        "even the smallest batch sizes do not fit the card".to_owned(),
                    ));
                }
                divisor *= 2;
            }
        }
        let beta_sqrt = self.beta().sqrt();
        self.model()?;
        let skip_observed = self
            .relative_noise()
            .is_some_and(|noise| noise <= self.params.repeat_noise);
        let exclude: HashSet<Vec<usize>> = if skip_observed {
            self.observations.iter().map(|(i, _)| i.clone()).collect()
        } else {
            HashSet::new()
        };
        if self.params.local_first
            && let Some((incumbent, _)) = self.incumbent()?
            && let Some(idx) = self.minimise_lcb(beta_sqrt, &exclude, Some(&incumbent))
        {
            return Ok(idx);
        }
        if let Some(idx) = self.minimise_lcb(beta_sqrt, &exclude, None) {
            return Ok(idx);
        }
        if skip_observed {
            tracing::debug!("every feasible configuration was measured; allowing repeats");
        }
        self.minimise_lcb(beta_sqrt, &HashSet::new(), None)
            .ok_or_else(|| {
                TunerError::NoFeasibleConfiguration("every configuration is infeasible".to_owned())
            })
    }

    /// The feasible configuration outside `exclude` minimising μ − √β σ (model scale; the
    /// constrained form of [`LcbParams::feasibility`] while memory is unknown), within the
    /// step limit of `centre` if given, else of any measured configuration; `None` when there
    /// is none (or sampling found none).
    fn minimise_lcb(
        &mut self,
        beta_sqrt: f64,
        exclude: &HashSet<Vec<usize>>,
        centre: Option<&[usize]>,
    ) -> Option<Vec<usize>> {
        let gp = self.model.as_ref()?;
        let space = &self.space;
        let out_of_memory = &self.out_of_memory;
        let over_cap = &self.over_cap;
        let rng = &mut self.rng;
        let log2: Vec<Vec<f64>> = space
            .sizes
            .iter()
            .map(|s| s.iter().map(|&b| f64::from(b).log2()).collect())
            .collect();
        let measured = &self.observations;
        let d = space.sizes.len();
        // Measured configurations as log2 points, row-major: the reach test runs for every
        // candidate of the acquisition.
        let measured_log2 = log2_points(measured.iter().map(|(o, _)| o.as_slice()), &log2);
        let centres: Vec<f64> = match centre {
            Some(c) => log2_points([c], &log2),
            None => measured_log2.clone(),
        };
        let reach = Reach {
            log2,
            centres,
            radius: self.params.max_step_log2 + 1e-9,
        };
        let log2 = &reach.log2;
        let allowed = |idx: &[usize]| {
            feasible(space, out_of_memory, over_cap, idx)
                && reach.contains(idx)
                && (exclude.is_empty() || !exclude.contains(idx))
        };
        let mut point = vec![0.0; d];
        let mut predictor = gp.predictor();
        // The constrained acquisition (see `LcbParams::feasibility`): only while memory is
        // unknown, against the incumbent's posterior mean (model scale).
        let feasibility = self.feasibility.as_ref().filter(|_| space.memory.is_none());
        let oom_log2 = log2_points(out_of_memory.iter().map(Vec::as_slice), log2);
        let incumbent = measured_log2
            .chunks_exact(d)
            .map(|m| predictor.predict(m).mean)
            .fold(f64::INFINITY, f64::min);
        let score = |idx: &[usize]| {
            for ((p, &i), l) in point.iter_mut().zip(idx).zip(log2) {
                *p = l[i];
            }
            let p = predictor.predict(&point);
            let lcb = p.mean - beta_sqrt * p.std;
            match feasibility {
                Some(f) if lcb < incumbent => {
                    let excess = excess_over(&measured_log2, &point).unwrap_or(0.0);
                    let runs = f.probability(excess, shortfall_below(&oom_log2, &point));
                    // Negative: a larger expected gain is better. Continuous with the branch
                    // below at lcb = incumbent.
                    -runs * (incumbent - lcb)
                }
                Some(_) => lcb - incumbent,
                None => lcb,
            }
        };
        if space.cardinality() <= self.params.exact_limit as f64 {
            return exhaustive_argmin(&space.sizes, allowed, score, rng);
        }
        let sizes = &space.sizes;
        sampled_argmin(measured, sizes, &reach, &self.params, allowed, score, rng)
    }

    /// The observed configuration with the lowest posterior mean (robust to one lucky noisy
    /// measurement), or `None` before any observation. A configuration measured above a
    /// production job's cap is never the incumbent, however low its Σ PD.
    pub fn incumbent(&mut self) -> Result<Option<(Vec<usize>, f64)>> {
        let configs: Vec<Vec<usize>> = self
            .observations
            .iter()
            .map(|(i, _)| i.clone())
            .filter(|i| !self.over_cap.rules_out(i))
            .collect();
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

/// See [`GpLcb::feasible`]; a free function so that the acquisition can borrow the search's
/// fields separately.
/// The configurations as log2 batch-size points, one after another (row-major).
fn log2_points<'a>(configs: impl IntoIterator<Item = &'a [usize]>, log2: &[Vec<f64>]) -> Vec<f64> {
    configs
        .into_iter()
        .flat_map(|o| o.iter().zip(log2).map(|(&i, l)| l[i]))
        .collect()
}

/// The allowed configuration of the whole lattice with the lowest score, every one
/// scored in odometer order (first index fastest).
fn exhaustive_argmin(
    sizes: &[Vec<u32>],
    allowed: impl Fn(&[usize]) -> bool,
    mut score: impl FnMut(&[usize]) -> f64,
    rng: &mut ChaCha8Rng,
) -> Option<Vec<usize>> {
    let mut best = Argmin::default();
    let mut idx = vec![0usize; sizes.len()];
    loop {
        if allowed(&idx) {
            let s = score(&idx);
            best.consider(&idx, s, rng);
        }
        // Odometer increment.
        let mut t = 0;
        loop {
            if t == idx.len() {
                return best.into_idx();
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

/// The step limit of [`GpLcb`]'s acquisition: the configurations within `radius` (in
/// log2 batch size, every task) of one of the centres.
struct Reach {
    /// Every task's sizes, log2.
    log2: Vec<Vec<f64>>,
    /// The centres as log2 points, row-major.
    centres: Vec<f64>,
    radius: f64,
}

impl Reach {
    fn contains(&self, idx: &[usize]) -> bool {
        self.radius.is_infinite()
            || self.centres.chunks_exact(self.log2.len()).any(|m| {
                m.iter()
                    .zip(idx)
                    .zip(&self.log2)
                    .all(|((&a, &i), l)| (a - l[i]).abs() <= self.radius)
            })
    }

    /// A random candidate within reach: a random centre (the incumbent, or a measured
    /// configuration), each task's size drawn among those within the radius of it.
    fn sample(&self, rng: &mut ChaCha8Rng) -> Vec<usize> {
        let d = self.log2.len();
        let origins = self.centres.len() / d;
        let origin = &self.centres[rng.random_range(0..origins) * d..][..d];
        origin
            .iter()
            .zip(&self.log2)
            .map(|(&o, l)| {
                let lo = l.partition_point(|v| *v < o - self.radius);
                let hi = l.partition_point(|v| *v <= o + self.radius);
                rng.random_range(lo..hi.max(lo + 1))
            })
            .collect()
    }
}

/// The search on a lattice too large to score whole: the observed configurations and
/// `random_candidates` random ones within reach, then coordinate descent from the best
/// `descent_starts` of them.
fn sampled_argmin(
    measured: &[(Vec<usize>, f64)],
    sizes: &[Vec<u32>],
    reach: &Reach,
    params: &LcbParams,
    allowed: impl Fn(&[usize]) -> bool + Copy,
    mut score: impl FnMut(&[usize]) -> f64,
    rng: &mut ChaCha8Rng,
) -> Option<Vec<usize>> {
    let mut pool: Vec<(f64, Vec<usize>)> = Vec::new();
    for (idx, _) in measured {
        if allowed(idx) {
            pool.push((score(idx), idx.clone()));
        }
    }
    for _ in 0..params.random_candidates {
        let idx = reach.sample(rng);
        if allowed(&idx) {
            pool.push((score(&idx), idx));
        }
    }
    pool.sort_by(|a, b| a.0.total_cmp(&b.0));
    pool.truncate(params.descent_starts);
    let mut best = Argmin::default();
    for (s, mut idx) in pool {
        let s = coordinate_descent(&mut idx, s, sizes, allowed, &mut score);
        best.consider(&idx, s, rng);
    }
    best.into_idx()
}

/// Improves `idx` (of score `s`) by cyclic coordinate descent over the allowed
/// configurations; returns its final score.
///
/// At most four sweeps (the LCB surface is smooth in log2 batch size). It stops as soon
/// as d lines in a row brought no improvement: the point is then a coordinate-wise
/// minimum, and finishing the sweep would only re-scan lines already known not to
/// improve.
fn coordinate_descent(
    idx: &mut [usize],
    mut s: f64,
    sizes: &[Vec<u32>],
    allowed: impl Fn(&[usize]) -> bool,
    mut score: impl FnMut(&[usize]) -> f64,
) -> f64 {
    let mut unchanged = 0;
    for t in (0..sizes.len()).cycle().take(4 * sizes.len()) {
        let keep = idx[t];
        let mut best_i = keep;
        for i in 0..sizes[t].len() {
            if i == keep {
                continue;
            }
            idx[t] = i;
            if allowed(idx) {
                let v = score(idx);
                if v < s {
                    s = v;
                    best_i = i;
                }
            }
        }
        idx[t] = best_i;
        unchanged = if best_i == keep { unchanged + 1 } else { 1 };
        if unchanged >= sizes.len() {
            break;
        }
    }
    s
}

fn feasible(
    space: &SearchSpace,
    out_of_memory: &[Vec<usize>],
    over_cap: &OverCap,
    idx: &[usize],
) -> bool {
    space.fits_memory(idx) && !at_or_above_an_oom(out_of_memory, idx) && !over_cap.rules_out(idx)
}

/// Configurations measured with a production job's PD above its slowdown cap, and the
/// rule of what else each one rules out.
///
/// The assumption: a co-runner's interference does not fall as its batch size grows
/// (larger batches run longer kernels that occupy the SMs and memory bandwidth for longer,
/// the usual finding of co-location studies, and the shape the predictor learns). A
/// production job's PD = IF·DT/E at its own fixed batch size changes only through IF, so
/// beside the same production sizes, opportunistic sizes at least as large in every
/// opportunistic task are at least as bad. Nothing is assumed across production sizes: a
/// production job's own size changes its DT and E, and so its PD, either way.
#[derive(Clone, Debug, Default)]
struct OverCap {
    configs: Vec<Vec<usize>>,
    /// Per task, in the space's order: opportunistic (true) or production; empty = all
    /// production (only the configuration itself is ruled out).
    opportunistic: Vec<bool>,
}

impl OverCap {
    fn rules_out(&self, idx: &[usize]) -> bool {
        self.configs.iter().any(|c| {
            c.len() == idx.len()
                && c.iter().zip(idx).enumerate().all(|(t, (&c, &i))| {
                    if self.opportunistic.get(t).copied().unwrap_or(false) {
                        i >= c
                    } else {
                        i == c
                    }
                })
        })
    }
}

/// Whether `idx` is at least as large, in every task's batch size, as some configuration in
/// `out_of_memory` (indices into ascending candidate sizes): then it cannot fit either, since
/// each task's memory grows with its batch size. The one definition of this rule, used by
/// [`GpLcb`] and by any baseline that must share the same world knowledge (the Gavel
/// benchmark's random search).
pub fn at_or_above_an_oom(out_of_memory: &[Vec<usize>], idx: &[usize]) -> bool {
    out_of_memory
        .iter()
        .any(|oom| oom.len() == idx.len() && oom.iter().zip(idx).all(|(o, i)| i >= o))
}

/// The lowest acquisition value seen so far, ties broken uniformly at random (reservoir
/// sampling). With few observations the LCB is often exactly symmetric — after m0 alone every
/// corner of the lattice is equally far and equally uncertain — and always taking the first
/// in enumeration order would bias every search towards the smallest batch sizes.
#[derive(Default)]
struct Argmin {
    best: Option<(f64, Vec<usize>)>,
    ties: u32,
}

impl Argmin {
    fn consider(&mut self, idx: &[usize], score: f64, rng: &mut ChaCha8Rng) {
        match &mut self.best {
            Some((b, _)) if (score - *b).abs() <= 1e-9 * b.abs().max(1.0) => {
                self.ties += 1;
                if rng.random_range(0..self.ties) == 0 {
                    self.best = Some((score.min(*b), idx.to_vec()));
                }
            }
            Some((b, _)) if score > *b => {}
            _ => {
                self.best = Some((score, idx.to_vec()));
                self.ties = 1;
            }
        }
    }

    fn into_idx(self) -> Option<Vec<usize>> {
        self.best.map(|(_, idx)| idx)
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
pub enum NextRun {
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

    /// The search space (immutably, unlike [`Controller::search`]).
    pub fn space(&self) -> &SearchSpace {
        self.search.space()
    }

    /// Whether a configuration measured above a production job's cap rules `idx` out.
    pub fn over_cap_rules_out(&self, idx: &[usize]) -> bool {
        self.search.over_cap_rules_out(idx)
    }

    /// The configurations measured above a production job's cap (immutably, unlike
    /// [`Controller::search`]): what the device tuner persists.
    pub fn over_cap(&self) -> &[Vec<usize>] {
        self.search.over_cap()
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
    pub fn decide(&mut self) -> Result<NextRun> {
        if let Some((idx, _)) = &self.settled {
            return Ok(NextRun::Settle(idx.clone()));
        }
        Ok(NextRun::Explore(self.search.suggest()?))
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
        // A value measured above a production job's cap (ruled out before it is recorded)
        // is no improvement: the search cannot settle there.
        let value = value.filter(|_| !self.search.over_cap.rules_out(idx));
        match (value, self.best) {
            (Some(v), Some(b)) if v < b * (1.0 - self.params.min_improvement) => {
                self.best = Some(v);
                self.stale_rounds = 0;
            }
            (Some(v), None) => self.best = Some(v),
            _ => self.stale_rounds += 1,
        }
        if self.stale_rounds >= self.params.patience {
            self.stop()?;
        }
        Ok(())
    }

    /// Stops searching now and settles on the incumbent (the observed configuration with
    /// the lowest posterior mean): the stopping rule calls it, and so does an owner that
    /// bounds the rounds of one search. Does nothing before the first observation.
    pub fn stop(&mut self) -> Result<()> {
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

    /// Records a configuration measured above a production job's cap (see
    /// [`GpLcb::rule_out_over_cap`]); a settled configuration it rules out is given up
    /// (the search re-opens, keeping its observations).
    pub fn rule_out_over_cap(&mut self, idx: &[usize]) -> Result<()> {
        self.search.rule_out_over_cap(idx)?;
        if let Some((settled, _)) = &self.settled
            && !self.search.feasible(settled)
        {
            self.reopen();
        }
        Ok(())
    }

    /// Re-opens the search (measured drift), keeping the observations.
    pub fn reopen(&mut self) {
        self.settled = None;
        self.stale_rounds = 0;
        self.best = None;
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
            held_mib: 0.0,
            margin: MemoryMargin {
                fraction: 0.05,
                fixed_mib: 0.0,
            },
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
    fn the_controller_never_decides_at_or_above_a_recorded_oom() {
        // The daemon's path: StoreEvaluator reports an OOM as `None`, the control loop
        // records it through the controller, and no later decision may be at or above it.
        let search = GpLcb::new(space(None), LcbParams::default(), 7).expect("valid");
        let mut ctl = Controller::new(search, ControllerParams::default());
        ctl.record(&[0, 0], Some(5.0)).expect("records");
        ctl.record(&[2, 3], None).expect("records");
        for (i, j) in (2..7).flat_map(|i| (3..7).map(move |j| (i, j))) {
            assert!(!ctl.search().feasible(&[i, j]), "({i}, {j}) still feasible");
        }
        for _ in 0..15 {
            let (NextRun::Explore(idx) | NextRun::Settle(idx)) = ctl.decide().expect("decides");
            assert!(
                !(idx[0] >= 2 && idx[1] >= 3),
                "decided {idx:?} above the OOM (2, 3)"
            );
            let v = Bowl
                .evaluate(&ctl.search().space().batch_sizes(&idx))
                .expect("evaluates");
            ctl.record(&idx, v).expect("records");
        }
    }

    /// Task 1 is opportunistic: a cap violation at (2, 3) rules out (2, ≥ 3), nothing at
    /// another production size, nothing below; such a configuration is never the incumbent
    /// (however low its Σ PD) nor suggested again.
    #[test]
    fn a_cap_violation_rules_out_larger_opportunistic_sizes_beside_the_same_production_sizes() {
        let mut search = GpLcb::new(space(None), LcbParams::default(), 3).expect("valid");
        search
            .set_opportunistic(vec![false, true])
            .expect("two tasks");
        assert!(search.set_opportunistic(vec![true]).is_err());
        search.observe(&[2, 4], Some(1.0)).expect("valid");
        search.observe(&[2, 1], Some(3.0)).expect("valid");
        search.rule_out_over_cap(&[2, 3]).expect("valid");
        for ruled_out in [[2, 3], [2, 4], [2, 6]] {
            assert!(!search.feasible(&ruled_out), "{ruled_out:?}");
        }
        for allowed in [[2, 2], [1, 3], [3, 6], [0, 0]] {
            assert!(search.feasible(&allowed), "{allowed:?}");
        }
        let (incumbent, _) = search.incumbent().expect("fits").expect("observed");
        assert_eq!(incumbent, [2, 1]);
        for _ in 0..15 {
            let (idx, _) = search.step(&mut Bowl).expect("round");
            assert!(!(idx[0] == 2 && idx[1] >= 3), "suggested {idx:?}");
        }
        // Every task production: only the configuration itself.
        let mut search = GpLcb::new(space(None), LcbParams::default(), 3).expect("valid");
        search.rule_out_over_cap(&[2, 3]).expect("valid");
        assert!(!search.feasible(&[2, 3]));
        assert!(search.feasible(&[2, 4]));
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
            let NextRun::Explore(idx) = ctl.decide().expect("decides") else {
                panic!("settled early")
            };
            let v = Bowl
                .evaluate(&ctl.search().space().batch_sizes(&idx))
                .expect("evaluates");
            ctl.record(&idx, v).expect("records");
            rounds += 1;
            assert!(rounds < 60, "never settled");
        }
        let NextRun::Settle(idx) = ctl.decide().expect("decides") else {
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
        for bad in [
            LcbParams {
                max_step_log2: 0.0,
                ..LcbParams::default()
            },
            LcbParams {
                repeat_noise: f64::NAN,
                ..LcbParams::default()
            },
        ] {
            assert!(GpLcb::new(space(None), bad, 0).is_err());
        }
    }

    #[test]
    fn predictions_are_in_objective_units_on_the_log_scale() {
        let mut search = GpLcb::new(space(None), LcbParams::default(), 2).expect("valid");
        for _ in 0..8 {
            search.step(&mut Bowl).expect("round");
        }
        let observed = search.observations().to_vec();
        for (idx, v) in observed {
            let p = search.predict(&idx).expect("fits").expect("observed");
            assert!((p.mean - v).abs() < 0.05 * v, "{p:?} vs {v}");
            assert!(p.std >= 0.0 && p.std < 0.5 * v, "{p:?}");
        }
        let raw = LcbParams {
            log_objective: false,
            ..LcbParams::default()
        };
        let mut search = GpLcb::new(space(None), raw, 2).expect("valid");
        search.step(&mut Bowl).expect("round");
        search.step(&mut Bowl).expect("round");
        let (idx, v) = search.observations()[1].clone();
        let p = search.predict(&idx).expect("fits").expect("observed");
        assert!((p.mean - v).abs() < 0.05 * v, "{p:?} vs {v}");
    }

    #[test]
    fn no_repeats_until_every_reachable_configuration_was_measured() {
        // 3 × 3 lattice, noise-free surface: nine distinct suggestions, then repeats.
        let sizes = vec![vec![16, 32, 64], vec![16, 32, 64]];
        let sp = SearchSpace {
            sizes,
            start: vec![1, 1],
            memory: None,
        };
        let params = LcbParams {
            repeat_noise: 1.0,
            ..LcbParams::default()
        };
        let mut search = GpLcb::new(sp, params, 8).expect("valid");
        let mut seen = HashSet::new();
        for _ in 0..9 {
            let (idx, _) = search.step(&mut Bowl).expect("round");
            assert!(seen.insert(idx.clone()), "{idx:?} suggested twice");
        }
        let (idx, _) = search
            .step(&mut Bowl)
            .expect("a repeat once all were measured");
        assert!(seen.contains(&idx));
    }

    #[test]
    fn each_suggestion_is_within_the_step_limit_of_a_measured_one() {
        // Ten doublings per task, start at the smallest: the search must walk, not jump.
        let sizes: Vec<u32> = (0..10).map(|p| 8 << p).collect();
        let sp = SearchSpace {
            sizes: vec![sizes.clone(), sizes],
            start: vec![0, 0],
            memory: None,
        };
        for (max_step_log2, large) in [(1.0, false), (2.0, false), (1.0, true)] {
            let params = LcbParams {
                max_step_log2,
                // The sampling path (large lattices) must respect the limit too.
                exact_limit: if large { 1 } else { 4096 },
                ..LcbParams::default()
            };
            let mut search = GpLcb::new(sp.clone(), params, 6).expect("valid");
            for _ in 0..12 {
                let measured: Vec<Vec<usize>> = search
                    .observations()
                    .iter()
                    .map(|(i, _)| i.clone())
                    .collect();
                let (idx, _) = search.step(&mut Bowl).expect("round");
                let reach = max_step_log2 as usize; // sizes double per index
                assert!(
                    measured.is_empty()
                        || measured
                            .iter()
                            .any(|m| m.iter().zip(&idx).all(|(a, b)| a.abs_diff(*b) <= reach)),
                    "{idx:?} is more than {reach} doublings from every measured configuration"
                );
            }
        }
    }

    /// The second suggestion on a 3 × 3 lattice after m0 = (1, 1) alone, for 12 seeds.
    fn second_suggestions(params: LcbParams) -> HashSet<Vec<usize>> {
        (0..12)
            .map(|seed| {
                let sizes = vec![vec![16, 32, 64], vec![16, 32, 64]];
                let sp = SearchSpace {
                    sizes,
                    start: vec![1, 1],
                    memory: None,
                };
                let mut search = GpLcb::new(sp, params, seed).expect("valid");
                search.observe(&[1, 1], Some(3.0)).expect("valid");
                search.suggest().expect("suggests")
            })
            .collect()
    }

    #[test]
    fn symmetric_ties_are_broken_at_random() {
        // After m0 alone every corner of a symmetric lattice is equally far and uncertain: the
        // second suggestion of plain GP-LCB must not always be the first corner in
        // enumeration order.
        let seconds = second_suggestions(LcbParams {
            feasibility: None,
            ..LcbParams::default()
        });
        assert!(seconds.len() > 1, "always {seconds:?}");
        assert!(
            seconds.iter().all(|s| s.iter().all(|&i| i != 1)),
            "{seconds:?}"
        );
    }

    #[test]
    fn with_memory_unknown_the_tie_goes_to_the_corner_known_to_run() {
        // The same tie, weighted by P(runs): only (0, 0) lies below the measured m0 in both
        // tasks, so it is the one corner certain not to crash.
        let seconds = second_suggestions(LcbParams::default());
        assert_eq!(seconds, HashSet::from([vec![0, 0]]));
    }

    #[test]
    fn with_a_memory_model_the_feasibility_model_changes_nothing() {
        // Memory known and fitting everything: the constrained acquisition must reduce to
        // plain GP-LCB, suggestion for suggestion.
        let sp = space(None);
        let upper = sp.sizes.iter().map(|s| vec![Some(1.0); s.len()]).collect();
        let sp = space(Some(MemoryConstraint {
            upper_mib: upper,
            capacity_mib: 100.0,
            held_mib: 0.0,
            margin: MemoryMargin {
                fraction: 0.05,
                fixed_mib: 0.0,
            },
        }));
        let plain = LcbParams {
            feasibility: None,
            ..LcbParams::default()
        };
        let mut a = GpLcb::new(sp.clone(), LcbParams::default(), 13).expect("valid");
        let mut b = GpLcb::new(sp, plain, 13).expect("valid");
        for _ in 0..10 {
            assert_eq!(
                a.step(&mut Bowl).expect("round"),
                b.step(&mut Bowl).expect("round")
            );
        }
    }

    #[test]
    fn an_out_of_memory_start_falls_back_to_halved_sizes() {
        // Sizes 8 … 512 per task, m0 = (128, 64): the agent halves on OOM, so does the search.
        let mut sp = space(None);
        sp.start = vec![4, 3];
        let mut search = GpLcb::new(sp, LcbParams::default(), 1).expect("valid");
        assert_eq!(search.suggest().expect("m0"), vec![4, 3]);
        search.observe(&[4, 3], None).expect("valid");
        assert_eq!(search.suggest().expect("halved"), vec![3, 2]);
        search.observe(&[3, 2], None).expect("valid");
        assert_eq!(search.suggest().expect("quartered"), vec![2, 1]);
        search.observe(&[0, 0], None).expect("valid");
        assert!(matches!(
            search.suggest(),
            Err(TunerError::NoFeasibleConfiguration(_))
        ));
    }

    #[test]
    fn suggestions_stay_near_the_incumbent_while_its_neighbourhood_is_open() {
        let mut search = GpLcb::new(space(None), LcbParams::default(), 21).expect("valid");
        for _ in 0..8 {
            let incumbent = search.incumbent().expect("fits").map(|(i, _)| i);
            let (idx, _) = search.step(&mut Bowl).expect("round");
            if let Some(inc) = incumbent {
                assert!(
                    inc.iter().zip(&idx).all(|(a, b)| a.abs_diff(*b) <= 1),
                    "{idx:?} is more than a doubling from the incumbent {inc:?}"
                );
            }
        }
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
