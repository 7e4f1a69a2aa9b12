//! Our own random forest: our CART regression trees ([`crate::tree`]) bagged on
//! bootstrap samples.
//!
//! The mean of the trees is the prediction and their spread an uncertainty, which
//! is why the forest is ours: a library forest gives a mean but keeps its trees.
//! Fitting is deterministic for a given seed and row order, whatever the number of
//! threads.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::PredictorError;
use crate::tree::{LEAF, Node, TrainingSet, TreeParams, fit_tree};

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
    /// Share of the columns (those not constant in a node) searched for each split,
    /// in (0, 1]; 1 searches all (plain bagging), less decorrelates the trees.
    #[serde(default = "all_features")]
    pub max_features: f64,
    /// Seed of the bootstrap and of the trees.
    pub seed: u64,
    /// Threads fitting trees in parallel; 0 = the machine's available parallelism.
    /// The forest is the same whatever the number (each tree's bootstrap and seed
    /// are drawn up front, in order).
    pub fit_threads: usize,
}

fn all_features() -> f64 {
    1.0
}

impl Default for ForestParams {
    fn default() -> Self {
        ForestParams {
            n_trees: 32,
            max_depth: 12,
            min_samples_leaf: 1,
            min_samples_split: 2,
            max_features: all_features(),
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
        if !(self.max_features > 0.0 && self.max_features <= 1.0) {
            return bad("max_features", "must be in (0, 1]");
        }
        Ok(())
    }

    fn tree_params(&self, width: usize) -> TreeParams {
        TreeParams {
            max_depth: self.max_depth,
            min_samples_leaf: self.min_samples_leaf,
            min_samples_split: self.min_samples_split,
            max_features: ((self.max_features * width as f64).ceil() as usize).max(1),
        }
    }
}

/// Checks the training rows and targets [`Forest::fit`] takes; returns the rows'
/// width.
fn check_training_data(rows: &[Vec<f64>], targets: &[f64]) -> Result<usize, PredictorError> {
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
    if let Some(i) = rows
        .iter()
        .zip(targets)
        .position(|(r, t)| !t.is_finite() || r.iter().any(|v| !v.is_finite()))
    {
        return Err(PredictorError::Fit(format!(
            "row {i} has a value that is not a finite number"
        )));
    }
    Ok(n_features)
}

/// Every tree's bootstrap of `n` rows (how often it draws each) and its own seed,
/// all drawn from `params.seed` in tree order.
fn draw_bags(n: usize, params: &ForestParams) -> Vec<(Vec<u32>, u64)> {
    let mut rng = ChaCha8Rng::seed_from_u64(params.seed);
    (0..params.n_trees)
        .map(|_| {
            let mut weights = vec![0_u32; n];
            for _ in 0..n {
                weights[rng.random_range(0..n)] += 1;
            }
            (weights, rng.random())
        })
        .collect()
}

/// Runs `fit_one` for trees `0..n_trees` on `threads` threads, this one included
/// (tree `i` on thread `i % threads`); a tree is `None` if its thread panicked.
fn fit_in_threads(
    n_trees: usize,
    threads: usize,
    fit_one: &(impl Fn(usize) -> Vec<Node> + Sync),
) -> Vec<Option<Vec<Node>>> {
    let mut fitted: Vec<Option<Vec<Node>>> = vec![None; n_trees];
    std::thread::scope(|scope| {
        let handles: Vec<_> = (1..threads)
            .map(|t| {
                scope.spawn(move || {
                    (t..n_trees)
                        .step_by(threads)
                        .map(|i| (i, fit_one(i)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        // This thread fits its share too rather than waiting idle.
        for i in (0..n_trees).step_by(threads) {
            fitted[i] = Some(fit_one(i));
        }
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
    fitted
}

/// For every row, the mean answer of the trees whose bootstrap did not draw it.
fn out_of_bag(trees: &FlatForest, bags: &[(Vec<u32>, u64)], rows: &[Vec<f64>]) -> Vec<Option<f64>> {
    rows.iter()
        .enumerate()
        .map(|(i, row)| {
            let mut sum = 0.0;
            let mut count = 0;
            for (&root, (weights, _)) in trees.roots.iter().zip(bags) {
                if weights[i] == 0 {
                    sum += trees.leaf(root, row);
                    count += 1;
                }
            }
            (count > 0).then(|| sum / f64::from(count))
        })
        .collect()
}

/// A fitted bagged forest.
#[derive(Clone, Debug, PartialEq)]
pub struct Forest {
    /// Every tree's nodes in one array, features as columns of the full row.
    trees: FlatForest,
    n_features: usize,
}

impl Forest {
    /// Fits `params.n_trees` trees, each on a bootstrap resample of `rows`/`targets`.
    /// Every value must be finite (the predictor's features always are).
    pub fn fit(
        rows: &[Vec<f64>],
        targets: &[f64],
        params: &ForestParams,
    ) -> Result<Forest, PredictorError> {
        Ok(Forest::fit_with_out_of_bag(rows, targets, params)?.0)
    }

    /// [`Forest::fit`], and for every row the mean answer of the trees whose
    /// bootstrap did not draw it (`None` for a row every tree drew): a prediction
    /// for each training row by trees that never saw it, for calibration.
    pub fn fit_with_out_of_bag(
        rows: &[Vec<f64>],
        targets: &[f64],
        params: &ForestParams,
    ) -> Result<(Forest, Vec<Option<f64>>), PredictorError> {
        params.check()?;
        let n_features = check_training_data(rows, targets)?;
        let n = rows.len();
        // A column constant over the training rows offers no split, yet every tree
        // would carry it through every partition. Most rows carry several (unknown
        // utilisations, one device kind, one co-runner), so they are left out; a
        // tree without columns is a single leaf.
        let active: Vec<usize> = (0..n_features)
            .filter(|&c| rows.iter().any(|r| r[c] != rows[0][c]))
            .collect();
        let set = TrainingSet::new(rows, &active, targets);
        let tree_params = params.tree_params(active.len());
        let bags = draw_bags(n, params);
        let fit_one = |tree: usize| {
            let (weights, seed) = &bags[tree];
            fit_tree(
                &set,
                weights,
                &tree_params,
                &mut ChaCha8Rng::seed_from_u64(*seed),
            )
        };
        let threads = match params.fit_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            t => t,
        }
        .clamp(1, params.n_trees);
        let fitted = fit_in_threads(params.n_trees, threads, &fit_one);
        let mut trees = FlatForest::default();
        for tree in fitted {
            let tree = tree.ok_or_else(|| PredictorError::Fit("a tree was not fitted".into()))?;
            trees.push_tree(&tree, &active);
        }
        let out_of_bag = out_of_bag(&trees, &bags, rows);
        Ok((Forest { trees, n_features }, out_of_bag))
    }

    /// Number of trees.
    pub fn n_trees(&self) -> usize {
        self.trees.roots.len()
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
        Ok(self.trees.mean_and_sd(row))
    }
}

/// Running sums of the trees' answers, added in tree order.
#[derive(Default)]
struct Sums {
    sum: f64,
    sum_sq: f64,
}

impl Sums {
    fn add(&mut self, v: f64) {
        self.sum += v;
        self.sum_sq += v * v;
    }

    fn mean_and_sd(&self, n_trees: usize) -> (f64, f64) {
        let n = n_trees as f64;
        let mean = self.sum / n;
        let var = (self.sum_sq / n - mean * mean).max(0.0);
        (mean, var.sqrt())
    }
}

/// The forest's trees as one contiguous node array, for allocation-free inference
/// (the placer predicts ~150 rows per decision).
#[derive(Clone, Debug, Default, PartialEq)]
struct FlatForest {
    nodes: Vec<Node>,
    roots: Vec<u32>,
}

/// Trees walked side by side by [`FlatForest::mean_and_sd`] (8 measured fastest
/// of 4, 8 and 16 in the placer's `decide` bench).
const LANES: usize = 8;

impl FlatForest {
    /// Appends a tree from [`fit_tree`], mapping its columns (indices into
    /// `active`) back to full-row columns and its children to absolute indices.
    fn push_tree(&mut self, nodes: &[Node], active: &[usize]) {
        let base = self.nodes.len() as u32;
        self.roots.push(base);
        self.nodes.extend(nodes.iter().map(|n| {
            if n.feature == LEAF {
                *n
            } else {
                Node {
                    value: n.value,
                    // `fit_tree` splits only on the columns it was given.
                    feature: active
                        .get(n.feature as usize)
                        .map_or(LEAF - 1, |&c| c as u32),
                    left: base + n.left,
                    right: base + n.right,
                }
            }
        }));
    }

    /// The value of the leaf `row` reaches from `root`.
    fn leaf(&self, root: u32, row: &[f64]) -> f64 {
        let mut node = root;
        while let Some(next) = self.step(node, row) {
            node = next;
        }
        self.nodes[node as usize].value
    }

    /// The child of `node` that `row` goes to, or `None` at a leaf.
    #[inline]
    fn step(&self, node: u32, row: &[f64]) -> Option<u32> {
        let n = &self.nodes[node as usize];
        if n.feature == LEAF {
            return None;
        }
        let x = row.get(n.feature as usize).copied().unwrap_or(f64::NAN);
        Some(if x <= n.value { n.left } else { n.right })
    }

    /// Mean and standard deviation of the trees' answers for `row`, added in tree
    /// order. A walk is a chain of dependent loads that mostly waits on memory, so
    /// [`LANES`] trees are walked in lockstep to overlap those waits.
    fn mean_and_sd(&self, row: &[f64]) -> (f64, f64) {
        // A plain loop: chaining `flat_map` iterators measured ~10% slower on the
        // placer's `decide` bench.
        let mut sums = Sums::default();
        let mut groups = self.roots.chunks_exact(LANES);
        for group in &mut groups {
            for v in self.lockstep_leaves(group, row) {
                sums.add(v);
            }
        }
        for &root in groups.remainder() {
            sums.add(self.leaf(root, row));
        }
        sums.mean_and_sd(self.roots.len())
    }

    /// The leaves `row` reaches from the [`LANES`] roots of `group`, walked together.
    fn lockstep_leaves(&self, group: &[u32], row: &[f64]) -> [f64; LANES] {
        let mut at = [0_u32; LANES];
        at.copy_from_slice(group);
        loop {
            let mut moved = false;
            for node in &mut at {
                if let Some(next) = self.step(*node, row) {
                    *node = next;
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        at.map(|node| self.nodes[node as usize].value)
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
    fn same_seed_same_forest_and_another_seed_another() {
        let rows: Vec<Vec<f64>> = (0..40)
            .map(|i| vec![f64::from(i % 7), f64::from(i)])
            .collect();
        let y: Vec<f64> = (0..40).map(|i| f64::from(i % 5)).collect();
        let p = ForestParams {
            max_features: 0.5,
            ..ForestParams::default()
        };
        let a = Forest::fit(&rows, &y, &p).expect("fit");
        let b = Forest::fit(&rows, &y, &p).expect("fit");
        assert_eq!(a, b);
        let other = ForestParams {
            seed: p.seed + 1,
            ..p.clone()
        };
        assert_ne!(a, Forest::fit(&rows, &y, &other).expect("fit"));
    }

    #[test]
    fn thread_count_does_not_change_the_forest() {
        let rows: Vec<Vec<f64>> = (0..50)
            .map(|i| vec![f64::from(i % 9), f64::from(i)])
            .collect();
        let y: Vec<f64> = (0..50).map(|i| f64::from(i % 4)).collect();
        let forests: Vec<Forest> = [1, 3, 0]
            .into_iter()
            .map(|fit_threads| {
                let p = ForestParams {
                    fit_threads,
                    max_features: 0.5,
                    ..ForestParams::default()
                };
                Forest::fit(&rows, &y, &p).expect("fit")
            })
            .collect();
        assert_eq!(forests[0], forests[1]);
        assert_eq!(forests[0], forests[2]);
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
        // All columns constant: single-leaf trees predicting their bootstrap's mean.
        let flat = vec![vec![1.0, 2.0]; 10];
        let y: Vec<f64> = (0..10).map(f64::from).collect();
        let f = Forest::fit(&flat, &y, &p).expect("fit");
        assert!(f.trees.nodes.iter().all(|n| n.feature == LEAF));
        let (mean, _) = f.predict(&[1.0, 2.0]).expect("predict");
        assert!((mean - 4.5).abs() < 1.5, "{mean}");
    }

    /// The lockstep walk gives the bits of walking each tree alone, in order.
    #[test]
    fn the_lockstep_walk_matches_tree_by_tree() {
        let rows: Vec<Vec<f64>> = (0..300)
            .map(|i| {
                let i = f64::from(i);
                vec![(i * 0.37).sin(), (i * 0.11).cos() * 50.0, i % 5.0]
            })
            .collect();
        let y: Vec<f64> = rows
            .iter()
            .map(|r| r[0] * 3.0 + r[1] / 10.0 + r[2])
            .collect();
        // 11 trees: a group of lanes and a remainder walked alone.
        let p = ForestParams {
            n_trees: 11,
            ..ForestParams::default()
        };
        let forest = Forest::fit(&rows, &y, &p).expect("fit");
        for probe in rows.iter().step_by(7) {
            let mut sums = Sums::default();
            for &root in &forest.trees.roots {
                sums.add(forest.trees.leaf(root, probe));
            }
            let want = sums.mean_and_sd(11);
            let got = forest.predict(probe).expect("predict");
            assert_eq!(
                (got.0.to_bits(), got.1.to_bits()),
                (want.0.to_bits(), want.1.to_bits())
            );
        }
    }

    /// A row's out-of-bag answer comes from the trees that did not draw it: on
    /// pure noise they cannot have memorised it, so it is far from the row's own
    /// target, where the whole forest (which mostly did draw it) is close.
    #[test]
    fn out_of_bag_answers_come_from_trees_that_never_saw_the_row() {
        let rows: Vec<Vec<f64>> = (0..200).map(|i| vec![f64::from(i)]).collect();
        let y: Vec<f64> = (0..200).map(|i| f64::from((i * 7919) % 101)).collect();
        let (forest, oob) =
            Forest::fit_with_out_of_bag(&rows, &y, &ForestParams::default()).expect("fit");
        assert_eq!(oob.len(), 200);
        let (mut in_bag_error, mut oob_error) = (0.0, 0.0);
        for ((r, t), o) in rows.iter().zip(&y).zip(&oob) {
            in_bag_error += (forest.predict(r).expect("predict").0 - t).abs();
            oob_error += (o.expect("32 trees leave every row out of some bag") - t).abs();
        }
        assert!(
            oob_error > 2.0 * in_bag_error,
            "{oob_error} vs {in_bag_error}"
        );
        let (again, _) =
            Forest::fit_with_out_of_bag(&rows, &y, &ForestParams::default()).expect("fit");
        assert_eq!(again, forest, "the same forest as Forest::fit");
    }

    #[test]
    fn bad_params_and_rows_are_rejected() {
        for p in [
            ForestParams {
                n_trees: 0,
                ..ForestParams::default()
            },
            ForestParams {
                max_features: 0.0,
                ..ForestParams::default()
            },
            ForestParams {
                max_features: f64::NAN,
                ..ForestParams::default()
            },
        ] {
            assert!(p.check().is_err(), "{p:?}");
        }
        let p = ForestParams::default();
        assert!(matches!(
            Forest::fit(&[], &[], &p),
            Err(PredictorError::NoSamples)
        ));
        assert!(Forest::fit(&[vec![1.0], vec![f64::NAN]], &[1.0, 2.0], &p).is_err());
        assert!(Forest::fit(&[vec![1.0], vec![2.0]], &[1.0, f64::INFINITY], &p).is_err());
        assert!(Forest::fit(&[vec![1.0], vec![2.0, 3.0]], &[1.0, 2.0], &p).is_err());
    }
}
