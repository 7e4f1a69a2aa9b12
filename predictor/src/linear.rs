//! Ridge regression on standardised features: the additive base the forest corrects.
//!
//! A forest of axis-aligned trees needs many samples to approximate an additive
//! effect ("a slow co-runner slows everyone a bit more"); with the 100-odd samples
//! the placer has after a cold start it mostly memorises the pairs it saw. A linear
//! model in the (log) profile features captures that additive part from few samples;
//! the forest is then fitted on what the line leaves (the residuals) and only has to
//! learn the interactions. The ridge penalty keeps the solution stable when columns
//! are collinear or constant (e.g. every utilisation unknown, one device kind).

use crate::error::PredictorError;

/// A fitted ridge model on some columns `c_j` of a row:
/// `y ≈ intercept + Σ_j beta_j · (clamp(x[c_j]) − mean_j) / scale_j`, each value
/// clamped into the range the column had in training.
///
/// Why the clamp: a line fitted on the models seen so far is only supported where
/// their values lie; a new model's step time ten times shorter than any seen would
/// otherwise be extrapolated linearly, and on the log target exponentially (one
/// unseen model family was predicted 69× too slow before the clamp).
#[derive(Clone, Debug, PartialEq)]
pub struct Ridge {
    intercept: f64,
    columns: Vec<usize>,
    lows: Vec<f64>,
    highs: Vec<f64>,
    means: Vec<f64>,
    scales: Vec<f64>,
    beta: Vec<f64>,
}

/// Each of the `p` columns' mean and standard deviation over `rows`; a constant
/// column gets scale 1 and, being all zeros once centred, beta 0.
fn standardisation(rows: &[Vec<f64>], p: usize) -> (Vec<f64>, Vec<f64>) {
    let nf = rows.len() as f64;
    let mut means = vec![0.0; p];
    for r in rows {
        for (m, v) in means.iter_mut().zip(r) {
            *m += v / nf;
        }
    }
    let mut scales = vec![0.0; p];
    for r in rows {
        for ((s, v), m) in scales.iter_mut().zip(r).zip(&means) {
            *s += (v - m) * (v - m) / nf;
        }
    }
    for s in &mut scales {
        *s = if *s > 1e-24 { s.sqrt() } else { 1.0 };
    }
    (means, scales)
}

impl Ridge {
    /// Fits on the `columns` of `rows` against `targets` with penalty `lambda` (per
    /// standardised column, relative to the number of rows, so its effect does not
    /// fade as samples grow faster than the data justify).
    pub fn fit(
        rows: &[Vec<f64>],
        targets: &[f64],
        lambda: f64,
        columns: &[usize],
    ) -> Result<Ridge, PredictorError> {
        if rows.is_empty() {
            return Err(PredictorError::NoSamples);
        }
        if !(lambda.is_finite() && lambda > 0.0) {
            return Err(PredictorError::InvalidParam {
                name: "ridge_lambda",
                reason: format!("must be a positive number, got {lambda}"),
            });
        }
        let n = rows.len();
        let p = columns.len();
        if targets.len() != n || rows.iter().any(|r| columns.iter().any(|&c| c >= r.len())) {
            return Err(PredictorError::Fit(
                "ridge: rows, columns and targets do not line up".into(),
            ));
        }
        let rows: Vec<Vec<f64>> = rows
            .iter()
            .map(|r| columns.iter().map(|&c| r[c]).collect())
            .collect();
        let lows: Vec<f64> = (0..p)
            .map(|j| rows.iter().map(|r| r[j]).fold(f64::INFINITY, f64::min))
            .collect();
        let highs: Vec<f64> = (0..p)
            .map(|j| rows.iter().map(|r| r[j]).fold(f64::NEG_INFINITY, f64::max))
            .collect();
        let nf = n as f64;
        let (means, scales) = standardisation(&rows, p);
        let y_mean = targets.iter().sum::<f64>() / nf;
        // Normal equations (ZᵀZ + λ·n·I) β = Zᵀ(y − ȳ) on the standardised Z.
        let mut a = vec![0.0; p * p];
        let mut b = vec![0.0; p];
        let mut z = vec![0.0; p];
        for (r, y) in rows.iter().zip(targets) {
            for j in 0..p {
                z[j] = (r[j] - means[j]) / scales[j];
            }
            for i in 0..p {
                b[i] += z[i] * (y - y_mean);
                for j in 0..=i {
                    a[i * p + j] += z[i] * z[j];
                }
            }
        }
        for i in 0..p {
            a[i * p + i] += lambda * nf;
            for j in 0..i {
                a[j * p + i] = a[i * p + j];
            }
        }
        let beta = solve_spd(&mut a, &b, p)?;
        Ok(Ridge {
            intercept: y_mean,
            columns: columns.to_vec(),
            lows,
            highs,
            means,
            scales,
            beta,
        })
    }

    /// The prediction for `row` (a full row; a column it lacks, or a NaN, counts as
    /// the training mean).
    pub fn predict(&self, row: &[f64]) -> f64 {
        let mut y = self.intercept;
        for (j, &c) in self.columns.iter().enumerate() {
            let Some(&x) = row.get(c).filter(|x| !x.is_nan()) else {
                continue;
            };
            let x = x.clamp(self.lows[j], self.highs[j]);
            y += self.beta[j] * (x - self.means[j]) / self.scales[j];
        }
        y
    }
}

/// Solves `a x = b` for a symmetric positive-definite `a` (row-major, `p`×`p`) by
/// Cholesky decomposition, in place.
fn solve_spd(a: &mut [f64], b: &[f64], p: usize) -> Result<Vec<f64>, PredictorError> {
    for j in 0..p {
        let mut d = a[j * p + j];
        for k in 0..j {
            d -= a[j * p + k] * a[j * p + k];
        }
        if !(d.is_finite() && d > 0.0) {
            return Err(PredictorError::Fit(
                "ridge: normal equations are not positive definite".into(),
            ));
        }
        let d = d.sqrt();
        a[j * p + j] = d;
        for i in j + 1..p {
            let mut s = a[i * p + j];
            for k in 0..j {
                s -= a[i * p + k] * a[j * p + k];
            }
            a[i * p + j] = s / d;
        }
    }
    // L y = b, then Lᵀ x = y.
    let mut x = b.to_vec();
    for i in 0..p {
        for k in 0..i {
            x[i] -= a[i * p + k] * x[k];
        }
        x[i] /= a[i * p + i];
    }
    for i in (0..p).rev() {
        for k in i + 1..p {
            x[i] -= a[k * p + i] * x[k];
        }
        x[i] /= a[i * p + i];
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_a_line_and_ignores_constant_columns() {
        let rows: Vec<Vec<f64>> = (0..50)
            .map(|i| vec![f64::from(i), 7.0, f64::from(i % 5)])
            .collect();
        let y: Vec<f64> = rows.iter().map(|r| 1.0 + 0.5 * r[0] - 2.0 * r[2]).collect();
        let m = Ridge::fit(&rows, &y, 1e-9, &[0, 1, 2]).expect("fit");
        for r in &rows {
            let want = 1.0 + 0.5 * r[0] - 2.0 * r[2];
            assert!(
                (m.predict(r) - want).abs() < 1e-5,
                "{} vs {want}",
                m.predict(r)
            );
        }
    }

    /// Only the chosen columns count, and a value outside the training range is
    /// taken at the nearest end of it.
    #[test]
    fn fits_chosen_columns_and_clamps_to_the_training_range() {
        let rows: Vec<Vec<f64>> = (0..50)
            .map(|i| vec![f64::from(i % 3) * 100.0, f64::from(i)])
            .collect();
        let y: Vec<f64> = rows.iter().map(|r| 2.0 * r[1]).collect();
        let m = Ridge::fit(&rows, &y, 1e-9, &[1]).expect("fit");
        assert!((m.predict(&[1e6, 10.0]) - 20.0).abs() < 1e-4);
        assert!((m.predict(&[0.0, 49.0]) - 98.0).abs() < 1e-4);
        assert_eq!(m.predict(&[0.0, 1e9]), m.predict(&[0.0, 49.0]));
        assert_eq!(m.predict(&[0.0, -1e9]), m.predict(&[0.0, 0.0]));
        assert!(Ridge::fit(&rows, &y, 1.0, &[2]).is_err());
    }

    #[test]
    fn a_large_penalty_shrinks_to_the_mean() {
        let rows: Vec<Vec<f64>> = (0..20).map(|i| vec![f64::from(i)]).collect();
        let y: Vec<f64> = (0..20).map(f64::from).collect();
        let m = Ridge::fit(&rows, &y, 1e9, &[0]).expect("fit");
        assert!((m.predict(&[0.0]) - 9.5).abs() < 1e-3);
        assert!(Ridge::fit(&rows, &y, 0.0, &[0]).is_err());
        assert!(Ridge::fit(&[], &[], 1.0, &[0]).is_err());
    }
}
