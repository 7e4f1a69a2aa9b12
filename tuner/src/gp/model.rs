//! The Gaussian-process model: fit by maximum (penalised) marginal likelihood, predict.

use argmin::core::{CostFunction, Executor, Gradient, State};
use argmin::solver::linesearch::MoreThuenteLineSearch;
use argmin::solver::quasinewton::LBFGS;
use nalgebra::{Cholesky, DMatrix, DVector, Dyn};
use rand::Rng;

use super::kernel::Matern52;
use super::mean::ConstantMean;
use crate::error::{Result, TunerError};

/// Fitting parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpParams {
    /// Random restarts of L-BFGS besides the default (and warm) start.
    pub restarts: usize,
    /// L-BFGS iterations per start.
    pub max_iters: u64,
    /// Diagonal jitter added before Cholesky; multiplied by 10 on failure, up to 6 times.
    pub jitter: f64,
}

impl Default for GpParams {
    /// Two random restarts (cold fits only) and 10 iterations: on 50 observations in 4
    /// dimensions, iterations 10–30 improved the penalised likelihood by ~0.6 nats but cost
    /// ~20× the time (More–Thuente line searches near the optimum), and warm starts recover
    /// the rest over the following rounds (measured with `--example fit_timing`).
    fn default() -> Self {
        GpParams {
            restarts: 2,
            max_iters: 10,
            jitter: 1e-8,
        }
    }
}

impl GpParams {
    /// Validates the parameters.
    pub fn check(&self) -> Result<()> {
        if self.max_iters == 0 || !(self.jitter.is_finite() && self.jitter > 0.0) {
            return Err(TunerError::InvalidParams(format!(
                "GP parameters need max_iters ≥ 1 and a positive jitter, got {self:?}"
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

fn prior_mean(dims: usize, j: usize) -> f64 {
    if j < dims {
        PRIOR_LOG_LENGTH
    } else if j == dims {
        PRIOR_LOG_SIGNAL
    } else {
        PRIOR_LOG_NOISE
    }
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

/// The negative log marginal likelihood (plus the log-prior) over θ = (ln ℓ_1..d, ln σ, ln σ_n).
struct NegLogMarginal<'a> {
    x: &'a DMatrix<f64>,
    y: &'a DVector<f64>,
    jitter: f64,
}

impl NegLogMarginal<'_> {
    fn dims(&self) -> usize {
        self.x.ncols()
    }

    /// Cost and (optionally) gradient.
    fn evaluate(
        &self,
        theta: &DVector<f64>,
        with_grad: bool,
    ) -> Result<(f64, Option<DVector<f64>>)> {
        let (n, d) = (self.x.nrows(), self.dims());
        if theta.iter().any(|v| !v.is_finite() || v.abs() > 30.0) {
            return Err(TunerError::Numerical(
                "hyper-parameters left the representable range".to_owned(),
            ));
        }
        let signal2 = (2.0 * theta[d]).exp();
        let noise2 = (2.0 * theta[d + 1]).exp();
        let inv_len: Vec<f64> = (0..d).map(|k| (-theta[k]).exp()).collect();
        // Per-pair squared scaled differences, kept for the gradient.
        let mut diff2 = vec![0.0; n * n * d];
        let mut r = DMatrix::zeros(n, n);
        let mut k = DMatrix::zeros(n, n);
        for i in 0..n {
            for j in 0..i {
                let mut r2 = 0.0;
                for c in 0..d {
                    let t = (self.x[(i, c)] - self.x[(j, c)]) * inv_len[c];
                    diff2[(i * n + j) * d + c] = t * t;
                    r2 += t * t;
                }
                let rij = r2.sqrt();
                r[(i, j)] = rij;
                let v = signal2 * Matern52::shape(rij);
                k[(i, j)] = v;
                k[(j, i)] = v;
            }
            k[(i, i)] = signal2 + noise2;
        }
        let chol = jittered_cholesky(k.clone(), self.jitter)?;
        let alpha = chol.solve(self.y);
        let log_det: f64 = chol.l_dirty().diagonal().iter().map(|v| v.ln()).sum();
        let mut cost =
            0.5 * self.y.dot(&alpha) + log_det + 0.5 * n as f64 * (2.0 * std::f64::consts::PI).ln();
        for (j, v) in theta.iter().enumerate() {
            let z = (v - prior_mean(d, j)) / PRIOR_SD;
            cost += 0.5 * z * z;
        }
        if !with_grad {
            return Ok((cost, None));
        }
        // ∂cost/∂θ = ½ tr(W ∂K/∂θ) with W = K⁻¹ − ααᵀ.
        let w = chol.inverse() - &alpha * alpha.transpose();
        let mut grad = DVector::zeros(d + 2);
        for i in 0..n {
            for j in 0..i {
                let f = Matern52::length_derivative_factor(signal2, r[(i, j)]);
                let wij = w[(i, j)]; // counted twice by symmetry, × ½ → once
                for c in 0..d {
                    grad[c] += wij * f * diff2[(i * n + j) * d + c];
                }
                grad[d] += wij * 2.0 * k[(i, j)];
            }
            grad[d] += 0.5 * w[(i, i)] * 2.0 * signal2;
            grad[d + 1] += 0.5 * w[(i, i)] * 2.0 * noise2;
        }
        for j in 0..d + 2 {
            grad[j] += (theta[j] - prior_mean(d, j)) / (PRIOR_SD * PRIOR_SD);
        }
        Ok((cost, Some(grad)))
    }
}

impl CostFunction for NegLogMarginal<'_> {
    type Param = DVector<f64>;
    type Output = f64;
    fn cost(&self, theta: &Self::Param) -> std::result::Result<f64, argmin::core::Error> {
        self.evaluate(theta, false)
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
        match self.evaluate(theta, true) {
            Ok((_, Some(g))) => Ok(g),
            Ok((_, None)) => Err(argmin::core::Error::msg("gradient not computed")),
            Err(e) => Err(argmin::core::Error::new(e)),
        }
    }
}

/// A fitted Gaussian process.
#[derive(Clone, Debug)]
pub struct GaussianProcess {
    x: DMatrix<f64>,
    /// Training inputs row-major, pre-divided by the length scales: prediction is the hot
    /// loop of the acquisition and must not allocate per training point.
    scaled_rows: Vec<f64>,
    inv_lengths: Vec<f64>,
    kernel: Matern52,
    log_noise: f64,
    mean: ConstantMean,
    chol: Cholesky<f64, Dyn>,
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

impl GaussianProcess {
    /// Fits on the rows of `x` (n × d, log2 batch sizes) and targets `y`. `warm_start` is a
    /// previous fit's hyper-parameters (θ), tried first; the best of all starts wins.
    pub fn fit<R: Rng>(
        x: DMatrix<f64>,
        y: &[f64],
        params: GpParams,
        warm_start: Option<&DVector<f64>>,
        rng: &mut R,
    ) -> Result<GaussianProcess> {
        params.check()?;
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
        let mean = ConstantMean::fit(y);
        let ys = DVector::from_iterator(n, y.iter().map(|v| mean.standardise(*v)));
        let problem = NegLogMarginal {
            x: &x,
            y: &ys,
            jitter: params.jitter,
        };

        let default_start = DVector::from_fn(d + 2, |j, _| prior_mean(d, j));
        let mut starts = vec![default_start];
        if let Some(w) = warm_start
            && w.len() == d + 2
        {
            starts.insert(0, w.clone());
        }
        // With a previous fit to start from, one more observation moves the optimum little:
        // random restarts are for cold fits only (they dominate the round's cost).
        let restarts = if warm_start.is_some() {
            0
        } else {
            params.restarts
        };
        for _ in 0..restarts {
            starts.push(DVector::from_fn(d + 2, |j, _| {
                prior_mean(d, j) + rng.random_range(-1.5..1.5)
            }));
        }
        let mut best: Option<(f64, DVector<f64>)> = None;
        for start in starts {
            let Ok((start_cost, _)) = problem.evaluate(&start, false) else {
                continue;
            };
            let mut candidate = (start_cost, start.clone());
            let solver = LBFGS::new(MoreThuenteLineSearch::new(), 7);
            match Executor::new(
                NegLogMarginal {
                    x: &x,
                    y: &ys,
                    jitter: params.jitter,
                },
                solver,
            )
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
        Self::with_hyper(x, y, &theta, mean, params.jitter, cost)
    }

    /// Conditions on (`x`, `y`) with fixed hyper-parameters θ (no optimisation): one Cholesky.
    /// Used between full refits, when one new observation barely moves the likelihood optimum.
    pub fn with_fixed_hyper(
        x: DMatrix<f64>,
        y: &[f64],
        theta: &DVector<f64>,
        jitter: f64,
    ) -> Result<GaussianProcess> {
        let (n, d) = (x.nrows(), x.ncols());
        if n == 0 || d == 0 || y.len() != n || theta.len() != d + 2 {
            return Err(TunerError::InvalidInput(format!(
                "GP conditioning needs n ≥ 1 rows, one target per row and d + 2 hyper-parameters (n = {n}, d = {d}, targets = {}, θ = {})",
                y.len(),
                theta.len()
            )));
        }
        let mean = ConstantMean::fit(y);
        let ys = DVector::from_iterator(n, y.iter().map(|v| mean.standardise(*v)));
        let (cost, _) = NegLogMarginal {
            x: &x,
            y: &ys,
            jitter,
        }
        .evaluate(theta, false)?;
        Self::with_hyper(x, y, theta, mean, jitter, cost)
    }

    fn with_hyper(
        x: DMatrix<f64>,
        y: &[f64],
        theta: &DVector<f64>,
        mean: ConstantMean,
        jitter: f64,
        neg_log_marginal: f64,
    ) -> Result<GaussianProcess> {
        let (n, d) = (x.nrows(), x.ncols());
        let kernel = Matern52 {
            log_lengths: theta.rows(0, d).into_owned(),
            log_signal: theta[d],
        };
        let noise2 = (2.0 * theta[d + 1]).exp();
        let rows: Vec<Vec<f64>> = (0..n).map(|i| x.row(i).iter().copied().collect()).collect();
        let mut k = DMatrix::from_fn(n, n, |i, j| kernel.value(&rows[i], &rows[j]));
        for i in 0..n {
            k[(i, i)] += noise2;
        }
        let chol = jittered_cholesky(k, jitter)?;
        let ys = DVector::from_iterator(n, y.iter().map(|v| mean.standardise(*v)));
        let alpha = chol.solve(&ys);
        let inv_lengths: Vec<f64> = kernel.log_lengths.iter().map(|l| (-l).exp()).collect();
        let scaled_rows: Vec<f64> = rows
            .iter()
            .flat_map(|r| r.iter().zip(&inv_lengths).map(|(v, il)| v * il))
            .collect();
        Ok(GaussianProcess {
            x,
            scaled_rows,
            inv_lengths,
            kernel,
            log_noise: theta[d + 1],
            mean,
            chol,
            alpha,
            neg_log_marginal,
        })
    }

    /// The fitted hyper-parameters θ = (ln ℓ_1..d, ln σ, ln σ_n), for warm starts.
    pub fn hyper_parameters(&self) -> DVector<f64> {
        let d = self.x.ncols();
        DVector::from_fn(d + 2, |j, _| {
            if j < d {
                self.kernel.log_lengths[j]
            } else if j == d {
                self.kernel.log_signal
            } else {
                self.log_noise
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

    /// Posterior mean and latent standard deviation at `point` (length d).
    pub fn predict(&self, point: &[f64]) -> Prediction {
        let (n, d) = (self.x.nrows(), self.x.ncols());
        let signal2 = (2.0 * self.kernel.log_signal).exp();
        let scaled: Vec<f64> = point
            .iter()
            .zip(&self.inv_lengths)
            .map(|(v, il)| v * il)
            .collect();
        let kstar = DVector::from_fn(n, |i, _| {
            let row = &self.scaled_rows[i * d..(i + 1) * d];
            let r2: f64 = row
                .iter()
                .zip(&scaled)
                .map(|(a, b)| (a - b) * (a - b))
                .sum();
            signal2 * Matern52::shape(r2.sqrt())
        });
        let mean_z = kstar.dot(&self.alpha);
        let v = self
            .chol
            .l_dirty()
            .solve_lower_triangular(&kstar)
            .unwrap_or_else(|| DVector::zeros(n));
        let prior_var = (2.0 * self.kernel.log_signal).exp();
        let var_z = (prior_var - v.dot(&v)).max(0.0);
        Prediction {
            mean: self.mean.restore(mean_z),
            std: var_z.sqrt() * self.mean.scale,
        }
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
        let p = NegLogMarginal {
            x: &x,
            y: &y,
            jitter: 1e-10,
        };
        let theta = DVector::from_vec(vec![0.4, 0.9, 0.1, -1.5]);
        let (_, grad) = p.evaluate(&theta, true).expect("evaluates");
        let grad = grad.expect("asked for it");
        for j in 0..4 {
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
        let start = NegLogMarginal {
            x: &DMatrix::from_column_slice(12, 1, &xs),
            y: &DVector::from_iterator(
                12,
                ys.iter().map(|v| ConstantMean::fit(&ys).standardise(*v)),
            ),
            jitter: 1e-8,
        }
        .evaluate(&DVector::from_fn(3, |j, _| prior_mean(1, j)), false)
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
