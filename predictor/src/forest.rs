//! Our own random forest: smartcore regression trees bagged on bootstrap samples.
//!
//! smartcore's `RandomForestRegressor` keeps its trees private, so it can give a
//! mean but not the spread across trees that the placer uses as uncertainty. A
//! forest of `DecisionTreeRegressor`s fitted on bootstrap resamples gives both.
//! Fitting is deterministic for a given seed and row order.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use smartcore::linalg::basic::arrays::Array;
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
    /// The same trees flattened for allocation-free inference, features mapped back
    /// to full-row columns; `None` when reading smartcore's nodes failed (the trees
    /// themselves answer then, and a warning said so).
    flat: Option<FlatForest>,
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
        let fit_one = |tree_index: usize| -> Result<FittedTree, PredictorError> {
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
            let tree =
                Tree::fit(&x, &y, tree_params).map_err(|e| PredictorError::Fit(e.to_string()))?;
            let flat = flatten_checked(&tree, &x);
            Ok((tree, flat))
        };
        let threads = match params.fit_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            t => t,
        }
        .clamp(1, params.n_trees);
        let mut fitted: Vec<Option<Result<FittedTree, PredictorError>>> =
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
        let fitted = fitted
            .into_iter()
            .map(|t| t.unwrap_or_else(|| Err(PredictorError::Fit("a tree was not fitted".into()))))
            .collect::<Result<Vec<FittedTree>, PredictorError>>()?;
        let mut trees = Vec::with_capacity(fitted.len());
        let mut flat = Some(FlatForest::default());
        for (tree, nodes) in fitted {
            trees.push(tree);
            match (nodes, flat.as_mut()) {
                (Ok(nodes), Some(forest)) => forest.push_tree(&nodes, &active),
                (Err(reason), Some(_)) => {
                    tracing::warn!(
                        %reason,
                        "could not flatten a smartcore tree; the forest predicts through smartcore (slower)"
                    );
                    flat = None;
                }
                (_, None) => {}
            }
        }
        Ok(Forest {
            trees,
            active,
            n_features,
            flat,
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
        if let Some(flat) = &self.flat {
            return Ok(flat.mean_and_sd(row));
        }
        self.predict_through_smartcore(row)
    }

    /// [`Forest::predict`] through smartcore's own trees: the path before the
    /// flattened forest, kept as the fallback and as the reference the flattened
    /// trees are tested against.
    fn predict_through_smartcore(&self, row: &[f64]) -> Result<(f64, f64), PredictorError> {
        let picked: Vec<f64> = self.active.iter().map(|&c| row[c]).collect();
        let x = DenseMatrix::new(1, picked.len(), picked, false)
            .map_err(|e| PredictorError::Fit(e.to_string()))?;
        let mut leaves = Vec::with_capacity(self.trees.len());
        for tree in &self.trees {
            let y = tree
                .predict(&x)
                .map_err(|e| PredictorError::Fit(e.to_string()))?;
            leaves.push(y.first().copied().unwrap_or(f64::NAN));
        }
        Ok(mean_and_sd(leaves.into_iter(), self.trees.len()))
    }
}

/// A fitted tree and its flattened nodes (or why they could not be read).
type FittedTree = (Tree, Result<Vec<FlatNode>, String>);

/// Mean and standard deviation of the trees' answers (the same sums, in the same
/// order, whichever path produced them, so both give the same bits).
fn mean_and_sd(leaves: impl Iterator<Item = f64>, n_trees: usize) -> (f64, f64) {
    let mut sums = Sums::default();
    for v in leaves {
        sums.add(v);
    }
    sums.mean_and_sd(n_trees)
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

/// Flattens `tree` and checks that the flat nodes give exactly smartcore's answer on
/// every row of `x` (the tree's training rows, which reach every leaf).
fn flatten_checked(tree: &Tree, x: &DenseMatrix<f64>) -> Result<Vec<FlatNode>, String> {
    let nodes = flatten_tree(tree)?;
    let (n_rows, width) = x.shape();
    if nodes
        .iter()
        .any(|n| n.feature != LEAF && n.feature as usize >= width)
    {
        return Err("a split on a column the tree was not fitted on".into());
    }
    let expected = tree.predict(x).map_err(|e| e.to_string())?;
    let mut row = vec![0.0; width];
    let forest = FlatForest {
        nodes: nodes.clone(),
        roots: vec![0],
    };
    for (i, want) in expected.iter().enumerate().take(n_rows) {
        for (c, v) in row.iter_mut().enumerate() {
            *v = *x.get((i, c));
        }
        let got = forest.leaves(&row).next().unwrap_or(f64::NAN);
        if got.to_bits() != want.to_bits() {
            return Err(format!(
                "the flattened tree answers {got} on training row {i}, smartcore {want}"
            ));
        }
    }
    Ok(nodes)
}

/// One node of a [`FlatForest`]: a split (`feature` < [`LEAF`]) sends a row to
/// `left` when `row[feature] <= value` (smartcore's rule, NaN going right), a leaf
/// answers `value`.
#[derive(Clone, Copy, Debug, PartialEq)]
struct FlatNode {
    /// Split threshold, or the leaf's output.
    value: f64,
    /// Column of the full feature row, or [`LEAF`].
    feature: u32,
    /// Absolute index of the child for `row[feature] <= value`.
    left: u32,
    /// Absolute index of the other child.
    right: u32,
}

const LEAF: u32 = u32::MAX;

/// The forest's trees as one contiguous node array, for allocation-free inference.
///
/// smartcore's `predict` wants a matrix and returns a vector per tree, so a single
/// row through 32 trees cost 34 allocations, and its generic accessors made the
/// walk itself slow; the placer predicts ~150 rows per decision. The nodes are read
/// once per fit (see [`flatten_tree`]) and every flattened tree is checked against
/// smartcore's own predictions on its training rows before it is used.
#[derive(Clone, Debug, Default, PartialEq)]
struct FlatForest {
    nodes: Vec<FlatNode>,
    roots: Vec<u32>,
}

/// Trees walked side by side by [`FlatForest::mean_and_sd`] (8 measured fastest
/// of 4, 8 and 16 in the placer's `decide` bench).
const LANES: usize = 8;

impl FlatForest {
    /// The leaf value of every tree for `row` (a full-width row), in tree order.
    fn leaves<'a>(&'a self, row: &'a [f64]) -> impl Iterator<Item = f64> + 'a {
        self.roots.iter().map(move |&root| self.leaf(root, row))
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

    /// [`mean_and_sd`] of the trees' answers for `row`, the same bits as summing
    /// [`FlatForest::leaves`] in order. A walk is a chain of dependent loads that
    /// mostly waits on memory, so [`LANES`] trees are walked in lockstep to overlap
    /// those waits; their leaves are still added in tree order.
    fn mean_and_sd(&self, row: &[f64]) -> (f64, f64) {
        // A plain loop: chaining `flat_map` iterators into [`mean_and_sd`] measured
        // ~10% slower on the placer's `decide` bench.
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

/// Reads the nodes of a fitted smartcore tree.
///
/// smartcore 0.7 keeps them private and exposes them only through `Debug` (its
/// `serde` feature would pull in `typetag`); the derived `Debug` prints every node
/// as `Node { output: …, split_feature: …, split_value: Some(…)|None, split_score:
/// …, true_child: Some(…)|None, false_child: … }`, and Rust prints an `f64` so that
/// parsing gives back the same bits. The result is in tree-local node indices with
/// features in the tree's own (active) columns. Any surprise in the format is an
/// error, and the caller also compares predictions, so a format change in a newer
/// smartcore cannot silently change a prediction.
fn flatten_tree(tree: &Tree) -> Result<Vec<FlatNode>, String> {
    parse_nodes(&format!("{tree:?}"))
}

/// The nodes in a tree's `Debug` text (see [`flatten_tree`]).
fn parse_nodes(text: &str) -> Result<Vec<FlatNode>, String> {
    let start = text
        .find("nodes: [")
        .ok_or("no node list in the tree's Debug output")?;
    let mut rest = &text[start..];
    let mut nodes = Vec::new();
    while let Some(open) = rest.find("Node {") {
        let body_start = open + "Node {".len();
        let close = rest[body_start..].find('}').ok_or("an unterminated node")? + body_start;
        let body = &rest[body_start..close];
        rest = &rest[close + 1..];
        let mut output = None;
        let mut split_feature = None;
        let mut split_value = None;
        let mut split_score = None;
        let mut true_child = None;
        let mut false_child = None;
        for field in body.split(',') {
            let Some((name, value)) = field.split_once(':') else {
                return Err(format!("unexpected node field {field:?}"));
            };
            let value = value.trim();
            let some = |v: &str| -> Result<Option<String>, String> {
                if v == "None" {
                    Ok(None)
                } else if let Some(inner) =
                    v.strip_prefix("Some(").and_then(|v| v.strip_suffix(')'))
                {
                    Ok(Some(inner.to_string()))
                } else {
                    Err(format!("unexpected optional value {v:?}"))
                }
            };
            let float = |v: &str| v.parse::<f64>().map_err(|e| format!("{v:?}: {e}"));
            let index = |v: &str| v.parse::<u32>().map_err(|e| format!("{v:?}: {e}"));
            match name.trim() {
                "output" => output = Some(float(value)?),
                "split_feature" => split_feature = Some(index(value)?),
                "split_value" => split_value = Some(some(value)?.map(|v| float(&v)).transpose()?),
                "split_score" => split_score = Some(()),
                "true_child" => true_child = Some(some(value)?.map(|v| index(&v)).transpose()?),
                "false_child" => false_child = Some(some(value)?.map(|v| index(&v)).transpose()?),
                other => return Err(format!("unexpected node field {other:?}")),
            }
        }
        let (
            Some(output),
            Some(feature),
            Some(split_value),
            Some(()),
            Some(true_child),
            Some(false_child),
        ) = (
            output,
            split_feature,
            split_value,
            split_score,
            true_child,
            false_child,
        )
        else {
            return Err(format!("a node lacks a field: {body:?}"));
        };
        nodes.push(match (true_child, false_child) {
            (None, _) => FlatNode {
                value: output,
                feature: LEAF,
                left: 0,
                right: 0,
            },
            (Some(left), Some(right)) => FlatNode {
                // smartcore compares with `split_value.unwrap_or(NaN)`.
                value: split_value.unwrap_or(f64::NAN),
                feature,
                left,
                right,
            },
            (Some(_), None) => return Err("a split node without a second child".into()),
        });
    }
    if nodes.is_empty() {
        return Err("a tree without nodes".into());
    }
    // Children come after their parent in smartcore's node list; requiring it
    // here also guarantees that a walk ends.
    let n = nodes.len() as u32;
    if nodes.iter().enumerate().any(|(i, node)| {
        let i = i as u32;
        node.feature != LEAF
            && !(i < node.left && node.left < n && i < node.right && node.right < n)
    }) {
        return Err("a child index out of order or out of range".into());
    }
    Ok(nodes)
}

impl FlatForest {
    /// Appends a tree flattened by [`flatten_tree`], mapping its columns (indices
    /// into `active`) back to full-row columns.
    fn push_tree(&mut self, nodes: &[FlatNode], active: &[usize]) {
        let base = self.nodes.len() as u32;
        self.roots.push(base);
        self.nodes.extend(nodes.iter().map(|n| {
            if n.feature == LEAF {
                *n
            } else {
                FlatNode {
                    value: n.value,
                    feature: active
                        .get(n.feature as usize)
                        .map_or(LEAF - 1, |&c| c as u32),
                    left: base + n.left,
                    right: base + n.right,
                }
            }
        }));
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

    /// Deterministic pseudo-random rows with repeated values (so trees split on ties)
    /// and wide ranges.
    fn random_rows(n: usize, width: usize, seed: u64) -> Vec<Vec<f64>> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                (0..width)
                    .map(|c| match c % 3 {
                        0 => f64::from(rng.random_range(0..5_u8)),
                        1 => rng.random_range(-100.0..100.0),
                        _ => rng.random_range(0.0..1.0_f64).powi(3) * 1e3,
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn the_flattened_forest_gives_smartcores_exact_answers() {
        // 11 trees: a group of lanes and a remainder walked alone.
        for (seed, n, width, n_trees) in [(1_u64, 300, 7, 32), (2, 1000, 12, 32), (3, 40, 3, 11)] {
            let rows = random_rows(n, width, seed);
            let y: Vec<f64> = rows
                .iter()
                .map(|r| r[0] * 0.3 + (r[1] / 10.0).sin() + r[2].ln_1p())
                .collect();
            let mut padded = rows.clone();
            for r in &mut padded {
                r.push(7.0); // a constant column, left out of the fit
            }
            let params = ForestParams {
                n_trees,
                ..ForestParams::default()
            };
            let forest = Forest::fit(&padded, &y, &params).expect("fit");
            assert!(forest.flat.is_some(), "the trees were flattened");
            let probes = random_rows(2000, width, seed + 100);
            for (i, probe) in probes.iter().chain(rows.iter()).enumerate() {
                let mut probe = probe.clone();
                // The constant column varies at prediction time; NaN and infinities
                // take smartcore's branches too.
                probe.push(match i % 4 {
                    0 => 7.0,
                    1 => -3.0,
                    2 => f64::INFINITY,
                    _ => 1e9,
                });
                if i % 97 == 0 {
                    probe[1] = f64::NAN;
                }
                let fast = forest.predict(&probe).expect("flat");
                let slow = forest.predict_through_smartcore(&probe).expect("smartcore");
                assert_eq!(
                    (fast.0.to_bits(), fast.1.to_bits()),
                    (slow.0.to_bits(), slow.1.to_bits()),
                    "seed {seed}, probe {i}: {fast:?} vs {slow:?}"
                );
            }
        }
    }

    #[test]
    fn a_single_leaf_tree_flattens() {
        let flat = vec![vec![1.0, 2.0]; 10];
        let y: Vec<f64> = (0..10).map(f64::from).collect();
        let f = Forest::fit(&flat, &y, &ForestParams::default()).expect("fit");
        let nodes = f.flat.as_ref().expect("flattened");
        assert!(nodes.nodes.iter().all(|n| n.feature == LEAF));
        assert_eq!(
            f.predict(&[1.0, 2.0]).expect("flat"),
            f.predict_through_smartcore(&[1.0, 2.0]).expect("smartcore")
        );
    }

    #[test]
    fn flattened_children_follow_their_parents() {
        let rows: Vec<Vec<f64>> = (0..30).map(|i| vec![f64::from(i)]).collect();
        let y: Vec<f64> = (0..30).map(|i| f64::from(i % 3)).collect();
        let f = Forest::fit(&rows, &y, &ForestParams::default()).expect("fit");
        let nodes = flatten_tree(&f.trees[0]).expect("flatten");
        assert!(nodes.len() > 1 && nodes[0].feature != LEAF);
        // Children always follow their parents, so every walk ends.
        for (i, n) in nodes.iter().enumerate() {
            if n.feature != LEAF {
                assert!(n.left as usize > i && n.right as usize > i);
            }
        }
    }

    #[test]
    fn a_malformed_tree_text_is_refused() {
        let node =
            |rest: &str| format!("nodes: [Node {{ output: 1.5, split_feature: 0, {rest} }}]");
        let leaf =
            node("split_value: None, split_score: None, true_child: None, false_child: None");
        assert_eq!(
            parse_nodes(&leaf).expect("a leaf"),
            vec![FlatNode {
                value: 1.5,
                feature: LEAF,
                left: 0,
                right: 0
            }]
        );
        for bad in [
            "no nodes here".to_string(),
            "nodes: []".to_string(),
            node(
                "split_value: Some(2.0), split_score: None, true_child: Some(1), false_child: None",
            ),
            node(
                "split_value: Some(2.0), split_score: None, true_child: Some(0), false_child: Some(0)",
            ),
            node("split_value: Some(x), split_score: None, true_child: None, false_child: None"),
            node("split_value: None, true_child: None, false_child: None"),
            node(
                "split_value: None, split_score: None, true_child: None, false_child: None, depth: 3",
            ),
        ] {
            assert!(parse_nodes(&bad).is_err(), "{bad}");
        }
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
