//! Our own random forest: smartcore regression trees bagged on bootstrap samples.
//!
//! smartcore's `RandomForestRegressor` keeps its trees private, so it can give a
//! mean but not the spread across trees that the placer uses as uncertainty. A
//! forest of `DecisionTreeRegressor`s fitted on bootstrap resamples gives both.
//! Fitting is deterministic for a given seed and row order.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smartcore::linalg::basic::matrix::DenseMatrix;
use smartcore::tree::decision_tree_regressor::{
    DecisionTreeRegressor, DecisionTreeRegressorParameters,
};

use crate::error::PredictorError;

type Tree = DecisionTreeRegressor<f64, f64, DenseMatrix<f64>, Vec<f64>>;

/// Hyper-parameters of the forest.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ForestParams {
    /// Number of trees; more trees give a smoother mean and a better spread estimate.
    pub n_trees: usize,
    /// Maximum depth of a tree (bounds fit and prediction time).
    pub max_depth: u16,
    /// Minimum samples in a leaf (limits over-fitting to single noisy samples).
    pub min_samples_leaf: usize,
    /// Minimum samples to split a node.
    pub min_samples_split: usize,
    /// Seed of the bootstrap and of the trees.
    pub seed: u64,
    /// Threads fitting trees in parallel; 0 = the machine's available parallelism.
    /// The forest is the same whatever the number (each tree's bootstrap is drawn
    /// up front, in order).
    pub fit_threads: usize,
}

impl Default for ForestParams {
    fn default() -> Self {
        ForestParams {
            n_trees: 32,
            max_depth: 12,
            min_samples_leaf: 1,
            min_samples_split: 2,
            seed: 0x001a_dee9,
            fit_threads: 0,
        }
    }
}

impl ForestParams {
    /// Checks the parameters make a usable forest.
    pub fn check(&self) -> Result<(), PredictorError> {
        let bad = |name, reason: &str| {
            Err(PredictorError::InvalidParam {
                name,
                reason: reason.into(),
            })
        };
        if self.n_trees == 0 || self.n_trees > 1024 {
            return bad("n_trees", "must be between 1 and 1024");
        }
        if self.max_depth == 0 {
            return bad("max_depth", "must be at least 1");
        }
        if self.min_samples_leaf == 0 {
            return bad("min_samples_leaf", "must be at least 1");
        }
        if self.min_samples_split < 2 {
            return bad("min_samples_split", "must be at least 2");
        }
        Ok(())
    }
}

/// A fitted bagged forest.
#[derive(Debug)]
pub struct Forest {
    trees: Vec<Tree>,
    /// Columns of the full row the trees were fitted on (those not constant in
    /// the training rows), in order.
    active: Vec<usize>,
    n_features: usize,
}

impl Forest {
    /// Fits `params.n_trees` trees, each on a bootstrap resample of `rows`/`targets`.
    pub fn fit(
        rows: &[Vec<f64>],
        targets: &[f64],
        params: &ForestParams,
    ) -> Result<Forest, PredictorError> {
        params.check()?;
        if rows.is_empty() {
            return Err(PredictorError::NoSamples);
        }
        if rows.len() != targets.len() {
            return Err(PredictorError::Fit(format!(
                "{} rows but {} targets",
                rows.len(),
                targets.len()
            )));
        }
        let n_features = rows[0].len();
        if rows.iter().any(|r| r.len() != n_features) {
            return Err(PredictorError::Fit("rows of different widths".into()));
        }
        let n = rows.len();
        // A column constant over the training rows offers no split, yet smartcore
        // sorts and scans it at every node. Most rows carry several (unknown
        // utilisations, one device kind, one co-runner), so leaving them out cuts the
        // fit time without changing what a tree can learn. At least one column is
        // kept so a tree can always be fitted (as a single leaf).
        let mut active: Vec<usize> = (0..n_features)
            .filter(|&c| rows.iter().any(|r| r[c] != rows[0][c]))
            .collect();
        if active.is_empty() {
            active.push(0);
        }
        let width = active.len();
        let mut rng = ChaCha8Rng::seed_from_u64(params.seed);
        let bootstraps: Vec<Vec<usize>> = (0..params.n_trees)
            .map(|_| (0..n).map(|_| rng.random_range(0..n)).collect())
            .collect();
        let fit_one = |tree_index: usize| -> Result<Tree, PredictorError> {
            let picks = &bootstraps[tree_index];
            let mut flat = Vec::with_capacity(n * width);
            let mut y = Vec::with_capacity(n);
            for &i in picks {
                flat.extend(active.iter().map(|&c| rows[i][c]));
                y.push(targets[i]);
            }
            let x = DenseMatrix::new(n, width, flat, false)
                .map_err(|e| PredictorError::Fit(e.to_string()))?;
            let tree_params = DecisionTreeRegressorParameters {
                max_depth: Some(params.max_depth),
                min_samples_leaf: params.min_samples_leaf,
                min_samples_split: params.min_samples_split,
                seed: Some(params.seed.wrapping_add(tree_index as u64)),
            };
            Tree::fit(&x, &y, tree_params).map_err(|e| PredictorError::Fit(e.to_string()))
        };
        let threads = match params.fit_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            t => t,
        }
        .clamp(1, params.n_trees);
        let mut fitted: Vec<Option<Result<Tree, PredictorError>>> =
            (0..params.n_trees).map(|_| None).collect();
        std::thread::scope(|scope| {
            let fit_one = &fit_one;
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    scope.spawn(move || {
                        (t..params.n_trees)
                            .step_by(threads)
                            .map(|i| (i, fit_one(i)))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for handle in handles {
                match handle.join() {
                    Ok(results) => {
                        for (i, tree) in results {
                            fitted[i] = Some(tree);
                        }
                    }
                    Err(_) => tracing::error!("a tree-fitting thread panicked"),
                }
            }
        });
        let trees = fitted
            .into_iter()
            .map(|t| t.unwrap_or_else(|| Err(PredictorError::Fit("a tree was not fitted".into()))))
            .collect::<Result<Vec<Tree>, PredictorError>>()?;
        Ok(Forest {
            trees,
            active,
            n_features,
        })
    }

    /// Number of trees.
    pub fn n_trees(&self) -> usize {
        self.trees.len()
    }

    /// Width of the rows the forest was fitted on.
    pub fn n_features(&self) -> usize {
        self.n_features
    }

    /// Mean and standard deviation across trees of the prediction for `row`.
    pub fn predict(&self, row: &[f64]) -> Result<(f64, f64), PredictorError> {
        if row.len() != self.n_features {
            return Err(PredictorError::Fit(format!(
                "row has {} features, the forest was fitted on {}",
                row.len(),
                self.n_features
            )));
        }
        let picked: Vec<f64> = self.active.iter().map(|&c| row[c]).collect();
        let x = DenseMatrix::new(1, picked.len(), picked, false)
            .map_err(|e| PredictorError::Fit(e.to_string()))?;
        let mut sum = 0.0;
        let mut sum_sq = 0.0;
        for tree in &self.trees {
            let y = tree
                .predict(&x)
                .map_err(|e| PredictorError::Fit(e.to_string()))?;
            let v = y.first().copied().unwrap_or(f64::NAN);
            sum += v;
            sum_sq += v * v;
        }
        let n = self.trees.len() as f64;
        let mean = sum / n;
        let var = (sum_sq / n - mean * mean).max(0.0);
        Ok((mean, var.sqrt()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_a_step_and_reports_spread() {
        let rows: Vec<Vec<f64>> = (0..60).map(|i| vec![f64::from(i), 1.0]).collect();
        let y: Vec<f64> = (0..60).map(|i| if i < 30 { 1.0 } else { 2.0 }).collect();
        let forest = Forest::fit(&rows, &y, &ForestParams::default()).expect("fit");
        let (lo, lo_sd) = forest.predict(&[5.0, 1.0]).expect("predict");
        let (hi, _) = forest.predict(&[55.0, 1.0]).expect("predict");
        assert!(
            (lo - 1.0).abs() < 0.05 && (hi - 2.0).abs() < 0.05,
            "{lo} {hi}"
        );
        assert!(lo_sd < 0.1);
        // At the boundary the bootstrap trees disagree.
        let (_, mid_sd) = forest.predict(&[29.5, 1.0]).expect("predict");
        assert!(mid_sd > lo_sd);
        assert!(forest.predict(&[1.0]).is_err());
    }

    #[test]
    fn same_seed_same_forest() {
        let rows: Vec<Vec<f64>> = (0..40)
            .map(|i| vec![f64::from(i % 7), f64::from(i)])
            .collect();
        let y: Vec<f64> = (0..40).map(|i| f64::from(i % 5)).collect();
        let p = ForestParams::default();
        let a = Forest::fit(&rows, &y, &p).expect("fit");
        let b = Forest::fit(&rows, &y, &p).expect("fit");
        for probe in [[1.0, 3.0], [6.0, 39.0]] {
            assert_eq!(a.predict(&probe).expect("a"), b.predict(&probe).expect("b"));
        }
    }

    #[test]
    fn thread_count_does_not_change_the_forest() {
        let rows: Vec<Vec<f64>> = (0..50)
            .map(|i| vec![f64::from(i % 9), f64::from(i)])
            .collect();
        let y: Vec<f64> = (0..50).map(|i| f64::from(i % 4)).collect();
        let one = ForestParams {
            fit_threads: 1,
            ..ForestParams::default()
        };
        let three = ForestParams {
            fit_threads: 3,
            ..ForestParams::default()
        };
        let a = Forest::fit(&rows, &y, &one).expect("fit");
        let b = Forest::fit(&rows, &y, &three).expect("fit");
        for probe in [[2.0, 7.0], [8.0, 44.0]] {
            assert_eq!(a.predict(&probe).expect("a"), b.predict(&probe).expect("b"));
        }
    }

    #[test]
    fn constant_columns_change_nothing() {
        let rows: Vec<Vec<f64>> = (0..40)
            .map(|i| vec![f64::from(i % 7), f64::from(i)])
            .collect();
        let padded: Vec<Vec<f64>> = rows.iter().map(|r| vec![3.0, r[0], 1.0, r[1]]).collect();
        let y: Vec<f64> = (0..40).map(|i| f64::from(i % 5)).collect();
        let p = ForestParams::default();
        let a = Forest::fit(&rows, &y, &p).expect("fit");
        let b = Forest::fit(&padded, &y, &p).expect("fit");
        for probe in [[1.0, 3.0], [6.0, 39.0]] {
            let wide = [9.0, probe[0], -4.0, probe[1]];
            assert_eq!(a.predict(&probe).expect("a"), b.predict(&wide).expect("b"));
        }
        // All columns constant: a single-leaf forest predicting the mean.
        let flat = vec![vec![1.0, 2.0]; 10];
        let y: Vec<f64> = (0..10).map(f64::from).collect();
        let f = Forest::fit(&flat, &y, &p).expect("fit");
        assert!(f.predict(&[1.0, 2.0]).expect("predict").0.is_finite());
    }

    #[test]
    fn bad_params_are_rejected() {
        let p = ForestParams {
            n_trees: 0,
            ..ForestParams::default()
        };
        assert!(p.check().is_err());
        assert!(matches!(
            Forest::fit(&[], &[], &ForestParams::default()),
            Err(PredictorError::NoSamples)
        ));
    }
}
