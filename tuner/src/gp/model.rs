//! The Gaussian-process model: fit by maximum (penalised) marginal likelihood, predict.
//!
//! Cost matters: the daemon refits every round and one round on ~50 observations in 4
//! dimensions must stay far below 5 ms. So the pairwise squared input differences, which do
//! not depend on the hyper-parameters, are computed once per fit; each likelihood evaluation
//! factors K once and reuses the factor for the gradient (K⁻¹ for ½ tr((K⁻¹ − ααᵀ) ∂K/∂θ));
//! argmin asks for the cost and the gradient at the same point separately, so the last
//! evaluation is cached; and predictions reuse caller-owned buffers ([`Predictor`]).

use std::cell::RefCell;

use argmin::core::{CostFunction, Executor, Gradient, State};
use argmin::solver::linesearch::MoreThuenteLineSearch;
use argmin::solver::quasinewton::LBFGS;
use nalgebra::{Cholesky, DMatrix, DVector, Dyn};
use rand::Rng;

use super::kernel::{LinearTrend, Matern52};
use super::linalg::{PackedLower, dot};
use super::mean::ConstantMean;
use crate::error::{Result, TunerError};

const SQRT5: f64 = 2.236_067_977_499_79;

/// Bound on every log hyper-parameter: length scales from e⁻⁸ to e⁸ doublings, signal and
/// noise from e⁻⁸ to e⁸ standard deviations of the targets — far beyond anything sensible.
const THETA_BOX: f64 = 8.0;
/// Curvature of the quadratic wall outside the box (nats per unit²).
const WALL: f64 = 100.0;

/// Fitting parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpParams {
    /// Random restarts of L-BFGS besides the default start, for cold fits. A warm-started fit
    /// (the previous round's hyper-parameters) runs one L-BFGS from the better of the warm
    /// and the default start: one more observation moves the optimum little.
    pub restarts: usize,
    /// L-BFGS iterations per start.
    pub max_iters: u64,
    /// L-BFGS stops when the gradient norm (nats per unit of log-parameter) falls below this.
    /// At 0.05 the remaining gain is of the order of 10⁻³ nats and the length scales are
    /// within a few percent of the optimum, which the acquisition cannot tell apart; a warm
    /// start then converges in a handful of iterations instead of running to the cap.
    pub grad_tolerance: f64,
    /// Diagonal jitter added before Cholesky; multiplied by 10 on failure, up to 6 times.
    pub jitter: f64,
    /// Prior median of the variance of the linear trend's slope per log2 unit of batch size,
    /// standardised targets (see [`LinearTrend`]); 0 disables the trend. The variance itself
    /// is a hyper-parameter fitted with the others, so surfaces whose optimum lies inside the
    /// lattice switch the trend off by themselves.
    pub trend_variance: f64,
}

impl Default for GpParams {
    /// Two random restarts (cold fits only), at most 20 iterations stopping at a gradient norm
    /// of 0.05, and a trend whose slope has a prior median standard deviation of 0.5 per
    /// doubling (about ±1 standardised unit over the four doublings of a typical lattice).
    /// On the `round` bench's data (50 observations in 4 dimensions) a warm fit then took
    /// about 12 likelihood evaluations and a cold one about 65 (counted with a temporary counter
    /// in `evaluate_cached`, not committed).
    fn default() -> Self {
        GpParams {
            restarts: 2,
            max_iters: 20,
            grad_tolerance: 0.05,
            jitter: 1e-8,
            trend_variance: 0.25,
        }
    }
}

impl GpParams {
    /// Validates the parameters.
    pub fn check(&self) -> Result<()> {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        let valid = self.max_iters > 0
            && positive(self.jitter)
            && positive(self.grad_tolerance)
            && self.trend_variance.is_finite()
            && self.trend_variance >= 0.0;
        if !valid {
            return Err(TunerError::InvalidParams(format!(
                "GP parameters need max_iters ≥ 1, a positive jitter and gradient tolerance and a finite trend variance ≥ 0, got {self:?}"
            )));
        }
        Ok(())
    }
}

/// Weak log-normal priors on the hyper-parameters (MAP rather than pure ML), so that with a
/// handful of observations the length scales and noise stay in a sensible range instead of
/// running to 0 or ∞. Means: ℓ = 2 (two doublings of the batch size), σ = 1 (targets are
/// standardised), σ_n = 0.1.
const PRIOR_LOG_LENGTH: f64 = std::f64::consts::LN_2;
const PRIOR_LOG_SIGNAL: f64 = 0.0;
const PRIOR_LOG_NOISE: f64 = -std::f64::consts::LN_10;
const PRIOR_SD: f64 = 1.0;

/// Prior mean of θ_j; `log_trend` is the prior mean of ln v (θ_{d+2}, present with a trend).
fn prior_mean(dims: usize, j: usize, log_trend: f64) -> f64 {
    if j < dims {
        PRIOR_LOG_LENGTH
    } else if j == dims {
        PRIOR_LOG_SIGNAL
    } else if j == dims + 1 {
        PRIOR_LOG_NOISE
    } else {
        log_trend
    }
}

/// The default start: the prior means.
fn prior_start(dims: usize, log_trend: Option<f64>) -> DVector<f64> {
    let len = dims + 2 + usize::from(log_trend.is_some());
    DVector::from_fn(len, |j, _| prior_mean(dims, j, log_trend.unwrap_or(0.0)))
}

/// Cholesky of `k` with escalating diagonal jitter.
fn jittered_cholesky(mut k: DMatrix<f64>, jitter: f64) -> Result<Cholesky<f64, Dyn>> {
    let mut added = jitter;
    for i in 0..k.nrows() {
        k[(i, i)] += added;
    }
    for _ in 0..6 {
        if let Some(chol) = Cholesky::new(k.clone()) {
            return Ok(chol);
        }
        let more = added * 9.0;
        for i in 0..k.nrows() {
            k[(i, i)] += more;
        }
        added += more;
    }
    Err(TunerError::Numerical(format!(
        "covariance matrix not positive definite even with jitter {added:e}"
    )))
}

/// The trend's Gram matrix over the rows of `x`, for unit variance.
fn trend_gram(x: &DMatrix<f64>, center: &[f64]) -> DMatrix<f64> {
    let n = x.nrows();
    let centred = DMatrix::from_fn(n, x.ncols(), |i, c| x[(i, c)] - center[c]);
    &centred * centred.transpose()
}

/// A likelihood evaluation with its Cholesky factor and α = K⁻¹y, which conditioning reuses.
struct Factorised {
    cost: f64,
    grad: Option<DVector<f64>>,
    chol: Cholesky<f64, Dyn>,
    alpha: DVector<f64>,
}

/// One likelihood evaluation, kept for the gradient call at the same point.
struct Evaluation {
    theta: DVector<f64>,
    cost: f64,
    grad: DVector<f64>,
}

/// The negative log marginal likelihood (plus the log-prior) over
/// θ = (ln ℓ_1..d, ln σ, ln σ_n[, ln v]), v the trend's slope variance when there is a trend.
struct NegLogMarginal<'a> {
    y: &'a DVector<f64>,
    n: usize,
    d: usize,
    /// The inputs, row-major.
    x_rows: Vec<f64>,
    /// (x_ic − x_jc)² for every pair i > j (pair-major, d per pair): θ-independent.
    sq_diff: Vec<f64>,
    /// The trend's unit-variance Gram matrix (θ-independent) and the prior mean of ln v.
    trend: Option<(DMatrix<f64>, f64)>,
    jitter: f64,
    cache: RefCell<Option<Evaluation>>,
}

impl<'a> NegLogMarginal<'a> {
    /// `trend`: the trend's centre and the prior median of its variance.
    fn new(
        x: &DMatrix<f64>,
        y: &'a DVector<f64>,
        trend: Option<(&[f64], f64)>,
        jitter: f64,
    ) -> NegLogMarginal<'a> {
        let (n, d) = (x.nrows(), x.ncols());
        let mut sq_diff = Vec::with_capacity(n * n.saturating_sub(1) / 2 * d);
        for i in 0..n {
            for j in 0..i {
                for c in 0..d {
                    let t = x[(i, c)] - x[(j, c)];
                    sq_diff.push(t * t);
                }
            }
        }
        NegLogMarginal {
            y,
            n,
            d,
            x_rows: x
                .row_iter()
                .flat_map(|r| r.iter().copied().collect::<Vec<_>>())
                .collect(),
            sq_diff,
            trend: trend.map(|(center, prior)| (trend_gram(x, center), prior.ln())),
            jitter,
            cache: RefCell::new(None),
        }
    }

    /// Cost and (optionally) gradient. Outside the box |θ_j| ≤ [`THETA_BOX`] the cost is
    /// that of the nearest point in the box plus a steep quadratic wall: L-BFGS's first step
    /// from a poor random restart is the raw gradient, which can be huge, and an error there
    /// would end the restart on the spot; the wall makes the line search come back instead.
    fn evaluate(
        &self,
        theta: &DVector<f64>,
        with_grad: bool,
    ) -> Result<(f64, Option<DVector<f64>>)> {
        let len = self.d + 2 + usize::from(self.trend.is_some());
        if theta.len() != len || theta.iter().any(|v| !v.is_finite()) {
            return Err(TunerError::Numerical(format!(
                "expected {len} finite hyper-parameters, got {theta:?}"
            )));
        }
        let inside = theta.map(|v| v.clamp(-THETA_BOX, THETA_BOX));
        let outside = theta - &inside;
        let Factorised {
            mut cost, mut grad, ..
        } = self.evaluate_inside(&inside, with_grad)?;
        cost += 0.5 * WALL * outside.norm_squared();
        if let Some(g) = &mut grad {
            *g += &outside * WALL;
        }
        Ok((cost, grad))
    }

    /// [`Self::evaluate`] for θ inside the box, with the factor it computed.
    fn evaluate_inside(&self, theta: &DVector<f64>, with_grad: bool) -> Result<Factorised> {
        let (n, d) = (self.n, self.d);
        let len = theta.len();
        let inv_len2: Vec<f64> = (0..d).map(|c| (-2.0 * theta[c]).exp()).collect();
        let log_trend = self.trend.as_ref().map_or(0.0, |(_, prior)| *prior);
        let (k, dist) = self.covariance(theta, &inv_len2, with_grad);
        let chol = jittered_cholesky(k, self.jitter)?;
        let alpha = chol.solve(self.y);
        let log_det: f64 = chol.l_dirty().diagonal().iter().map(|v| v.ln()).sum();
        let mut cost =
            0.5 * self.y.dot(&alpha) + log_det + 0.5 * n as f64 * (2.0 * std::f64::consts::PI).ln();
        for (j, v) in theta.iter().enumerate() {
            let z = (v - prior_mean(d, j, log_trend)) / PRIOR_SD;
            cost += 0.5 * z * z;
        }
        if !with_grad {
            return Ok(Factorised {
                cost,
                grad: None,
                chol,
                alpha,
            });
        }
        let mut grad = self.gradient(theta, &inv_len2, &chol, &alpha, &dist);
        for j in 0..len {
            grad[j] += (theta[j] - prior_mean(d, j, log_trend)) / (PRIOR_SD * PRIOR_SD);
        }
        Ok(Factorised {
            cost,
            grad: Some(grad),
            chol,
            alpha,
        })
    }

    /// The covariance matrix K at `theta` (`inv_len2`: its inverse squared length
    /// scales), and per pair (i, j < i) r, exp(−√5 r) and the Matérn term, kept for the
    /// gradient when `with_grad`.
    fn covariance(
        &self,
        theta: &DVector<f64>,
        inv_len2: &[f64],
        with_grad: bool,
    ) -> (DMatrix<f64>, Vec<(f64, f64, f64)>) {
        let (n, d) = (self.n, self.d);
        let signal2 = (2.0 * theta[d]).exp();
        let noise2 = (2.0 * theta[d + 1]).exp();
        let pairs = n * n.saturating_sub(1) / 2;
        let mut dist = Vec::with_capacity(if with_grad { pairs } else { 0 });
        let mut k = match &self.trend {
            Some((gram, _)) => gram * theta[d + 2].exp(),
            None => DMatrix::zeros(n, n),
        };
        let mut p = 0;
        for i in 0..n {
            for j in 0..i {
                let diffs = &self.sq_diff[p * d..(p + 1) * d];
                let r2: f64 = diffs.iter().zip(inv_len2.iter()).map(|(a, b)| a * b).sum();
                let r = r2.sqrt();
                let e = (-SQRT5 * r).exp();
                let v = signal2 * (1.0 + SQRT5 * r + 5.0 / 3.0 * r2) * e;
                k[(i, j)] += v;
                k[(j, i)] += v;
                if with_grad {
                    dist.push((r, e, v));
                }
                p += 1;
            }
            k[(i, i)] += signal2 + noise2;
        }
        (k, dist)
    }

    /// The gradient of the data term of the cost (without the prior's), from the
    /// factor of K and the per-pair terms [`Self::covariance`] kept.
    fn gradient(
        &self,
        theta: &DVector<f64>,
        inv_len2: &[f64],
        chol: &Cholesky<f64, Dyn>,
        alpha: &DVector<f64>,
        dist: &[(f64, f64, f64)],
    ) -> DVector<f64> {
        let (n, d) = (self.n, self.d);
        let signal2 = (2.0 * theta[d]).exp();
        let noise2 = (2.0 * theta[d + 1]).exp();
        // ∂cost/∂θ = ½ tr(W ∂K/∂θ) with W = K⁻¹ − ααᵀ; only the lower triangle is read.
        // K⁻¹, lower triangle packed by rows: (i, j) at i(i+1)/2 + j.
        let w = PackedLower::from_cholesky(chol).inverse_lower();
        let mut grad = DVector::zeros(theta.len());
        let mut p = 0;
        for i in 0..n {
            let row = i * (i + 1) / 2;
            for j in 0..i {
                let (r, e, v) = dist[p];
                // Counted twice by symmetry, × ½ → once.
                let wij = w[row + j] - alpha[i] * alpha[j];
                let f = wij * signal2 * 5.0 / 3.0 * (1.0 + SQRT5 * r) * e;
                let diffs = &self.sq_diff[p * d..(p + 1) * d];
                for c in 0..d {
                    grad[c] += f * diffs[c] * inv_len2[c];
                }
                grad[d] += wij * 2.0 * v;
                p += 1;
            }
            let wii = w[row + i] - alpha[i] * alpha[i];
            grad[d] += wii * signal2;
            grad[d + 1] += wii * noise2;
        }
        if let Some((gram, _)) = &self.trend {
            // ∂K/∂ln v = v G.
            let v = theta[d + 2].exp();
            let mut g = 0.0;
            for i in 0..n {
                let row = i * (i + 1) / 2;
                for j in 0..i {
                    g += (w[row + j] - alpha[i] * alpha[j]) * gram[(i, j)];
                }
                g += 0.5 * (w[row + i] - alpha[i] * alpha[i]) * gram[(i, i)];
            }
            grad[d + 2] += v * g;
        }
        grad
    }

    /// Cost and gradient at `theta`, from the cache when argmin asks again for the same point.
    fn evaluate_cached(&self, theta: &DVector<f64>) -> Result<(f64, DVector<f64>)> {
        if let Some(e) = self.cache.borrow().as_ref()
            && &e.theta == theta
        {
            return Ok((e.cost, e.grad.clone()));
        }
        let (cost, grad) = self.evaluate(theta, true)?;
        let grad = grad.ok_or_else(|| TunerError::Numerical("gradient not computed".to_owned()))?;
        *self.cache.borrow_mut() = Some(Evaluation {
            theta: theta.clone(),
            cost,
            grad: grad.clone(),
        });
        Ok((cost, grad))
    }
}

impl CostFunction for NegLogMarginal<'_> {
    type Param = DVector<f64>;
    type Output = f64;
    fn cost(&self, theta: &Self::Param) -> std::result::Result<f64, argmin::core::Error> {
        self.evaluate_cached(theta)
            .map(|(c, _)| c)
            .map_err(argmin::core::Error::new)
    }
}

impl Gradient for NegLogMarginal<'_> {
    type Param = DVector<f64>;
    type Gradient = DVector<f64>;
    fn gradient(
        &self,
        theta: &Self::Param,
    ) -> std::result::Result<DVector<f64>, argmin::core::Error> {
        self.evaluate_cached(theta)
            .map(|(_, g)| g)
            .map_err(argmin::core::Error::new)
    }
}

/// A fitted Gaussian process.
#[derive(Clone, Debug)]
pub struct GaussianProcess {
    d: usize,
    /// Training inputs row-major, pre-divided by the length scales: prediction is the hot
    /// loop of the acquisition and must not allocate per training point.
    scaled_rows: Vec<f64>,
    /// Training inputs row-major minus the trend's centre (empty without a trend).
    centred_rows: Vec<f64>,
    inv_lengths: Vec<f64>,
    kernel: Matern52,
    trend: Option<LinearTrend>,
    log_noise: f64,
    mean: ConstantMean,
    /// The Cholesky factor of K, packed for fast forward substitution.
    lower: PackedLower,
    alpha: DVector<f64>,
    neg_log_marginal: f64,
}

/// Posterior at one point, in the units of the observations.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    pub mean: f64,
    /// Standard deviation of the latent function (observation noise excluded).
    pub std: f64,
}

/// Predictions with reused buffers: the acquisition evaluates thousands of points per round.
#[derive(Debug)]
pub struct Predictor<'a> {
    gp: &'a GaussianProcess,
    scaled: Vec<f64>,
    kstar: Vec<f64>,
}

impl Predictor<'_> {
    /// Posterior mean and latent standard deviation at `point` (length d).
    pub fn predict(&mut self, point: &[f64]) -> Prediction {
        let gp = self.gp;
        let d = gp.d;
        let signal2 = (2.0 * gp.kernel.log_signal).exp();
        for ((s, v), il) in self.scaled.iter_mut().zip(point).zip(&gp.inv_lengths) {
            *s = v * il;
        }
        let mut prior_var = signal2;
        let kstar = self.kstar.as_mut_slice();
        for (k, row) in kstar.iter_mut().zip(gp.scaled_rows.chunks_exact(d)) {
            let mut r2 = 0.0;
            for (a, b) in row.iter().zip(&self.scaled) {
                r2 += (a - b) * (a - b);
            }
            *k = signal2 * Matern52::shape(r2.sqrt());
        }
        if let Some(trend) = &gp.trend {
            let mut norm2 = 0.0;
            for (c, (p, m)) in point.iter().zip(&trend.center).enumerate() {
                let t = p - m;
                norm2 += t * t;
                let scaled_t = trend.variance * t;
                for (k, row) in kstar.iter_mut().zip(gp.centred_rows.chunks_exact(d)) {
                    *k += scaled_t * row[c];
                }
            }
            prior_var += trend.variance * norm2;
        }
        let mean_z = dot(kstar, gp.alpha.as_slice());
        // v = L⁻¹ k*, in place: σ² = k** − vᵀv.
        gp.lower.forward_substitute(kstar);
        let var_z = (prior_var - dot(kstar, kstar)).max(0.0);
        Prediction {
            mean: gp.mean.restore(mean_z),
            std: var_z.sqrt() * gp.mean.scale,
        }
    }
}

impl GaussianProcess {
    /// Fits on the rows of `x` (n × d, log2 batch sizes) and targets `y`. `warm_start` is a
    /// previous fit's hyper-parameters (θ): one L-BFGS run from the better of it and the
    /// default start replaces the random restarts of a cold fit.
    pub fn fit<R: Rng>(
        x: DMatrix<f64>,
        y: &[f64],
        params: GpParams,
        warm_start: Option<&DVector<f64>>,
        rng: &mut R,
    ) -> Result<GaussianProcess> {
        params.check()?;
        let (n, d) = (x.nrows(), x.ncols());
        Self::check_input(&x, y)?;
        let mean = ConstantMean::fit(y);
        let ys = DVector::from_iterator(n, y.iter().map(|v| mean.standardise(*v)));
        let center = Self::trend_center(&x, params.trend_variance);
        let trend = center.as_deref().map(|c| (c, params.trend_variance));
        let problem = NegLogMarginal::new(&x, &ys, trend, params.jitter);

        let log_trend = trend.map(|(_, v)| v.ln());
        let default_start = prior_start(d, log_trend);
        let len = default_start.len();
        let mut starts = Vec::new();
        match warm_start.filter(|w| w.len() == len) {
            Some(w) => {
                let cost_of =
                    |t: &DVector<f64>| problem.evaluate(t, false).map_or(f64::INFINITY, |(c, _)| c);
                if cost_of(w) <= cost_of(&default_start) {
                    starts.push(w.clone());
                } else {
                    starts.push(default_start);
                }
            }
            None => {
                starts.push(default_start);
                for _ in 0..params.restarts {
                    starts.push(DVector::from_fn(len, |j, _| {
                        prior_mean(d, j, log_trend.unwrap_or(0.0)) + rng.random_range(-1.5..1.5)
                    }));
                }
            }
        }
        let mut best: Option<(f64, DVector<f64>)> = None;
        for start in starts {
            let Ok((start_cost, _)) = problem.evaluate(&start, false) else {
                continue;
            };
            let mut candidate = (start_cost, start.clone());
            let solver = LBFGS::new(MoreThuenteLineSearch::new(), 7)
                .with_tolerance_grad(params.grad_tolerance)
                .map_err(|e| TunerError::InvalidParams(e.to_string()))?;
            match Executor::new(NegLogMarginal::new(&x, &ys, trend, params.jitter), solver)
                .configure(|state| state.param(start).max_iters(params.max_iters))
                .timer(false)
                .run()
            {
                Ok(result) => {
                    let state = result.state();
                    if let Some(p) = state.get_best_param()
                        && state.get_best_cost() < candidate.0
                    {
                        candidate = (state.get_best_cost(), p.clone());
                    }
                }
                Err(err) => {
                    tracing::debug!(%err, "an L-BFGS start failed; keeping its starting point")
                }
            }
            if best.as_ref().is_none_or(|(c, _)| candidate.0 < *c) {
                best = Some(candidate);
            }
        }
        let Some((cost, theta)) = best else {
            return Err(TunerError::Numerical(
                "no hyper-parameter start gave a finite likelihood".to_owned(),
            ));
        };
        tracing::trace!(cost, "hyper-parameters fitted");
        Self::with_hyper(&problem, d, &theta, mean, center)
    }

    fn check_input(x: &DMatrix<f64>, y: &[f64]) -> Result<()> {
        let (n, d) = (x.nrows(), x.ncols());
        if n == 0 || d == 0 || y.len() != n {
            return Err(TunerError::InvalidInput(format!(
                "GP fit needs n ≥ 1 rows, d ≥ 1 columns and one target per row (n = {n}, d = {d}, targets = {})",
                y.len()
            )));
        }
        if x.iter().chain(y).any(|v| !v.is_finite()) {
            return Err(TunerError::InvalidInput(
                "GP inputs and targets must be finite".to_owned(),
            ));
        }
        Ok(())
    }

    /// The trend's centre (the mean input), or `None` when the trend is disabled.
    fn trend_center(x: &DMatrix<f64>, prior_variance: f64) -> Option<Vec<f64>> {
        (prior_variance > 0.0).then(|| (0..x.ncols()).map(|c| x.column(c).mean()).collect())
    }

    /// Conditions on (`x`, `y`) with fixed hyper-parameters θ (no optimisation): one Cholesky.
    /// Used between full refits, when one new observation barely moves the likelihood optimum.
    pub fn with_fixed_hyper(
        x: DMatrix<f64>,
        y: &[f64],
        theta: &DVector<f64>,
        params: GpParams,
    ) -> Result<GaussianProcess> {
        params.check()?;
        let (n, d) = (x.nrows(), x.ncols());
        Self::check_input(&x, y)?;
        let center = Self::trend_center(&x, params.trend_variance);
        let len = d + 2 + usize::from(center.is_some());
        if theta.len() != len {
            return Err(TunerError::InvalidInput(format!(
                "GP conditioning needs {len} hyper-parameters, got {}",
                theta.len()
            )));
        }
        let mean = ConstantMean::fit(y);
        let ys = DVector::from_iterator(n, y.iter().map(|v| mean.standardise(*v)));
        let trend = center.as_deref().map(|c| (c, params.trend_variance));
        let problem = NegLogMarginal::new(&x, &ys, trend, params.jitter);
        Self::with_hyper(&problem, d, theta, mean, center)
    }

    /// The model at θ (clamped to the box): one Cholesky, through the same covariance code
    /// as the likelihood.
    fn with_hyper(
        problem: &NegLogMarginal,
        d: usize,
        theta: &DVector<f64>,
        mean: ConstantMean,
        trend_center: Option<Vec<f64>>,
    ) -> Result<GaussianProcess> {
        let theta = theta.map(|v| v.clamp(-THETA_BOX, THETA_BOX));
        let Factorised {
            cost, chol, alpha, ..
        } = problem.evaluate_inside(&theta, false)?;
        let trend = trend_center.map(|center| LinearTrend {
            variance: theta[d + 2].exp(),
            center,
        });
        let kernel = Matern52 {
            log_lengths: theta.rows(0, d).into_owned(),
            log_signal: theta[d],
        };
        let inv_lengths: Vec<f64> = kernel.log_lengths.iter().map(|l| (-l).exp()).collect();
        let scaled_rows: Vec<f64> = problem
            .x_rows
            .chunks_exact(d)
            .flat_map(|r| r.iter().zip(&inv_lengths).map(|(v, il)| v * il))
            .collect();
        let centred_rows: Vec<f64> = match &trend {
            Some(t) => problem
                .x_rows
                .chunks_exact(d)
                .flat_map(|r| r.iter().zip(&t.center).map(|(v, c)| v - c))
                .collect(),
            None => Vec::new(),
        };
        Ok(GaussianProcess {
            d,
            scaled_rows,
            centred_rows,
            inv_lengths,
            kernel,
            trend,
            log_noise: theta[d + 1],
            mean,
            lower: PackedLower::from_cholesky(&chol),
            alpha,
            neg_log_marginal: cost,
        })
    }

    /// The fitted hyper-parameters θ = (ln ℓ_1..d, ln σ, ln σ_n[, ln v]), for warm starts.
    pub fn hyper_parameters(&self) -> DVector<f64> {
        let d = self.d;
        let len = d + 2 + usize::from(self.trend.is_some());
        DVector::from_fn(len, |j, _| {
            if j < d {
                self.kernel.log_lengths[j]
            } else if j == d {
                self.kernel.log_signal
            } else if j == d + 1 {
                self.log_noise
            } else {
                self.trend.as_ref().map_or(0.0, |t| t.variance.ln())
            }
        })
    }

    /// The minimised negative log marginal likelihood (with the prior), standardised units.
    pub fn neg_log_marginal(&self) -> f64 {
        self.neg_log_marginal
    }

    /// Observation-noise standard deviation in the units of the targets.
    pub fn noise_std(&self) -> f64 {
        self.log_noise.exp() * self.mean.scale
    }

    /// A predictor with its own buffers, for many predictions in a row.
    pub fn predictor(&self) -> Predictor<'_> {
        Predictor {
            gp: self,
            scaled: vec![0.0; self.d],
            kstar: vec![0.0; self.alpha.len()],
        }
    }

    /// Posterior mean and latent standard deviation at `point` (length d).
    pub fn predict(&self, point: &[f64]) -> Prediction {
        self.predictor().predict(point)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn gradient_matches_finite_differences() {
        let x = DMatrix::from_row_slice(5, 2, &[3.0, 4.0, 4.0, 6.0, 5.0, 5.0, 6.0, 3.0, 7.0, 7.0]);
        let y = DVector::from_vec(vec![0.3, -1.0, 0.5, 1.2, -0.4]);
        let center = GaussianProcess::trend_center(&x, 0.3).expect("trend enabled");
        for (trend, theta) in [
            (None, vec![0.4, 0.9, 0.1, -1.5]),
            (
                Some((center.as_slice(), 0.3)),
                vec![0.4, 0.9, 0.1, -1.5, -0.7],
            ),
        ] {
            let p = NegLogMarginal::new(&x, &y, trend, 1e-10);
            let theta = DVector::from_vec(theta);
            let (cost, grad) = p.evaluate(&theta, true).expect("evaluates");
            let grad = grad.expect("asked for it");
            // The cached path agrees with a fresh evaluation.
            assert_eq!(
                p.evaluate_cached(&theta).expect("evaluates"),
                (cost, grad.clone())
            );
            assert_eq!(
                p.evaluate_cached(&theta).expect("cached"),
                (cost, grad.clone())
            );
            assert_finite_differences(&p, &theta, &grad);
        }
    }

    fn assert_finite_differences(p: &NegLogMarginal, theta: &DVector<f64>, grad: &DVector<f64>) {
        for j in 0..theta.len() {
            let h = 1e-6;
            let mut up = theta.clone();
            up[j] += h;
            let mut down = theta.clone();
            down[j] -= h;
            let numeric = (p.evaluate(&up, false).expect("up").0
                - p.evaluate(&down, false).expect("down").0)
                / (2.0 * h);
            assert!(
                (numeric - grad[j]).abs() < 1e-5 * numeric.abs().max(1.0),
                "θ{j}: {numeric} vs {}",
                grad[j]
            );
        }
    }

    #[test]
    fn interpolates_a_smooth_function_and_is_uncertain_far_away() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let xs: Vec<f64> = (0..12).map(|i| 3.0 + 0.5 * f64::from(i)).collect();
        let ys: Vec<f64> = xs.iter().map(|x| (x - 5.0) * (x - 5.0)).collect();
        let gp = GaussianProcess::fit(
            DMatrix::from_column_slice(12, 1, &xs),
            &ys,
            GpParams::default(),
            None,
            &mut rng,
        )
        .expect("fits");
        let inside = gp.predict(&[5.25]);
        assert!((inside.mean - 0.0625).abs() < 0.2, "{inside:?}");
        let far = gp.predict(&[20.0]);
        assert!(far.std > 5.0 * inside.std, "{far:?} vs {inside:?}");
        // The fit improves on the default start.
        let x = DMatrix::from_column_slice(12, 1, &xs);
        let standardised = DVector::from_iterator(
            12,
            ys.iter().map(|v| ConstantMean::fit(&ys).standardise(*v)),
        );
        let prior = GpParams::default().trend_variance;
        let center = GaussianProcess::trend_center(&x, prior).expect("trend enabled");
        let start = NegLogMarginal::new(&x, &standardised, Some((&center, prior)), 1e-8)
            .evaluate(&prior_start(1, Some(prior.ln())), false)
            .expect("evaluates")
            .0;
        assert!(gp.neg_log_marginal() <= start);
    }

    #[test]
    fn rejects_bad_input() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        assert!(
            GaussianProcess::fit(
                DMatrix::zeros(0, 1),
                &[],
                GpParams::default(),
                None,
                &mut rng
            )
            .is_err()
        );
        assert!(
            GaussianProcess::fit(
                DMatrix::zeros(2, 1),
                &[1.0],
                GpParams::default(),
                None,
                &mut rng
            )
            .is_err()
        );
        let bad = GpParams {
            max_iters: 0,
            ..GpParams::default()
        };
        assert!(GaussianProcess::fit(DMatrix::zeros(1, 1), &[1.0], bad, None, &mut rng).is_err());
    }
}
