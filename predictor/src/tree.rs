//! Our own CART regression tree: the tree the forest bags.
//!
//! Why our own: the forest needs each tree's nodes (to walk many trees without
//! allocating, and for the spread across trees), and smartcore keeps them private;
//! reading them back from its derived `Debug` text meant a dependency upgrade could
//! silently change the model. This tree is small, exact and ours:
//!
//! - **Split rule**: the split of a node maximises the reduction of the weighted
//!   squared error, i.e. `S_L² / W_L + S_R² / W_R` (sums `S` of the targets and
//!   weights `W` on each side), over every column and every threshold between two
//!   consecutive distinct values. A row goes left when `x <= threshold` (NaN goes
//!   right), the threshold being the midpoint of the two values.
//! - **Weights** are bootstrap multiplicities: a row drawn k times counts k times in
//!   every sum and in the leaf-size limits, exactly as k copies would, without
//!   copying it.
//! - **Pre-sorted columns**: each column's rows are sorted once per forest; a tree
//!   keeps, for every column, its in-bag rows in that order and partitions those
//!   lists stably at each split, so finding a split costs one pass per column
//!   instead of a sort.
//! - **Column sampling** (`max_features`): at each node the columns are visited in
//!   a random order and the search stops after `max_features` columns that are not
//!   constant in the node (constant ones cannot split, so they do not count).
//! - A node becomes a leaf at `max_depth`, below `min_samples_split`, when no split
//!   leaves `min_samples_leaf` on both sides, or when no split reduces the error.
//!
//! Ties are broken deterministically (the first best column in visiting order, the
//! lowest threshold), so a tree depends only on its rows, weights, parameters and seed.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// One node of a fitted tree: a split (`feature` != [`LEAF`]) sends a row to `left`
/// when `row[feature] <= value` (NaN goes right); a leaf answers `value`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Node {
    /// Split threshold, or the leaf's output.
    pub value: f64,
    /// Column of the row, or [`LEAF`].
    pub feature: u32,
    /// Index of the child for `row[feature] <= value`.
    pub left: u32,
    /// Index of the other child.
    pub right: u32,
}

/// The `feature` of a leaf.
pub(crate) const LEAF: u32 = u32::MAX;

impl Node {
    fn leaf(value: f64) -> Node {
        Node {
            value,
            feature: LEAF,
            left: 0,
            right: 0,
        }
    }
}

/// Limits of one tree.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct TreeParams {
    pub max_depth: u16,
    /// Least (weighted) rows in a leaf.
    pub min_samples_leaf: usize,
    /// Least (weighted) rows in a node for it to be split.
    pub min_samples_split: usize,
    /// Columns, not constant in the node, searched per split (at least 1).
    pub max_features: usize,
}

/// The training rows column by column, each column's rows sorted once, shared by
/// every tree of a forest. Every value must be finite (the forest checks).
#[derive(Debug)]
pub(crate) struct TrainingSet {
    /// `columns[c][row]`.
    columns: Vec<Vec<f64>>,
    /// `order[c]`: the rows sorted by `columns[c]` (ties by row index).
    order: Vec<Vec<u32>>,
    targets: Vec<f64>,
}

impl TrainingSet {
    /// The set of `rows` restricted to the columns `picked`, with their `targets`
    /// (same length as `rows`; every row at least as wide as the largest pick).
    pub fn new(rows: &[Vec<f64>], picked: &[usize], targets: &[f64]) -> TrainingSet {
        let columns: Vec<Vec<f64>> = picked
            .iter()
            .map(|&c| rows.iter().map(|r| r[c]).collect())
            .collect();
        let order = columns
            .iter()
            .map(|values| {
                let mut idx: Vec<u32> = (0..values.len() as u32).collect();
                idx.sort_by(|&a, &b| {
                    values[a as usize]
                        .total_cmp(&values[b as usize])
                        .then(a.cmp(&b))
                });
                idx
            })
            .collect();
        TrainingSet {
            columns,
            order,
            targets: targets.to_vec(),
        }
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    /// Number of columns.
    pub fn width(&self) -> usize {
        self.columns.len()
    }
}

/// Running weighted sums of one side of a split.
#[derive(Clone, Copy, Default)]
struct Side {
    weight: f64,
    sum: f64,
}

impl Side {
    /// `S² / W`: the part of the error reduction this side contributes.
    fn score(&self) -> f64 {
        if self.weight > 0.0 {
            self.sum * self.sum / self.weight
        } else {
            0.0
        }
    }
}

/// The best split found so far in a node.
#[derive(Clone, Copy)]
struct Split {
    column: usize,
    threshold: f64,
    score: f64,
    /// Position in the node's sorted segment of the first row that goes right.
    left_len: usize,
}

/// A node waiting to be fitted: rows `start..end` of every column's segment.
struct Pending {
    node: usize,
    start: usize,
    end: usize,
    depth: u16,
}

/// Fits one tree on `set` with the bootstrap `weights` (one per row; rows of weight
/// 0 are out of the bag). Node 0 is the root; children always follow their parent.
pub(crate) fn fit_tree(
    set: &TrainingSet,
    weights: &[u32],
    params: &TreeParams,
    rng: &mut ChaCha8Rng,
) -> Vec<Node> {
    let Some(mut grower) = Grower::new(set, weights, params) else {
        let mean = set.targets.iter().sum::<f64>() / set.len().max(1) as f64;
        return vec![Node::leaf(if mean.is_finite() { mean } else { 0.0 })];
    };
    let width = set.width();
    let mut visit: Vec<usize> = (0..width).collect();
    let mut nodes = vec![Node::leaf(0.0)];
    let mut stack = vec![Pending {
        node: 0,
        start: 0,
        end: grower.m,
        depth: 0,
    }];
    while let Some(Pending {
        node,
        start,
        end,
        depth,
    }) = stack.pop()
    {
        let total = grower.total(start, end);
        nodes[node] = Node::leaf(total.sum / total.weight);
        let min_leaf = params.min_samples_leaf as f64;
        if depth >= params.max_depth
            || total.weight < params.min_samples_split as f64
            || total.weight < 2.0 * min_leaf
        {
            continue;
        }
        // Columns in a random order; stop after `max_features` that can split.
        for i in 0..width.saturating_sub(1) {
            let j = rng.random_range(i..width);
            visit.swap(i, j);
        }
        // A split must reduce the error by more than rounding.
        let parent = total.score();
        let Some(split) = grower
            .best_split(&visit, start, end, total)
            .filter(|b| b.score > parent + 1e-12 * (parent.abs() + total.weight))
        else {
            continue;
        };
        grower.partition(&split, start, end);
        let mid = start + split.left_len;
        let left = nodes.len();
        nodes.push(Node::leaf(0.0));
        nodes.push(Node::leaf(0.0));
        nodes[node] = Node {
            value: split.threshold,
            feature: split.column as u32,
            left: left as u32,
            right: left as u32 + 1,
        };
        stack.push(Pending {
            node: left + 1,
            start: mid,
            end,
            depth: depth + 1,
        });
        stack.push(Pending {
            node: left,
            start,
            end: mid,
            depth: depth + 1,
        });
    }
    nodes
}

/// The working state of one tree's fit: every column's in-bag rows in sorted
/// order, one segment of `m` per column, which splits partition in place.
struct Grower<'a> {
    set: &'a TrainingSet,
    min_leaf: f64,
    max_features: usize,
    /// In-bag rows.
    m: usize,
    lists: Vec<u32>,
    /// Each row's weight and weighted target, looked up in every scan.
    weight: Vec<f64>,
    weighted: Vec<f64>,
    /// Per row: whether the split being applied sends it left.
    goes_left: Vec<bool>,
    /// The right side of a segment while it is partitioned.
    scratch: Vec<u32>,
}

impl<'a> Grower<'a> {
    /// `None` when no row is in the bag.
    fn new(set: &'a TrainingSet, weights: &[u32], params: &TreeParams) -> Option<Self> {
        let m = set.order.first().map_or(0, |o| {
            o.iter().filter(|&&r| weights[r as usize] > 0).count()
        });
        let mut lists: Vec<u32> = Vec::with_capacity(set.width() * m);
        for order in &set.order {
            lists.extend(order.iter().copied().filter(|&r| weights[r as usize] > 0));
        }
        if m == 0 {
            return None;
        }
        let weight: Vec<f64> = weights.iter().map(|&w| f64::from(w)).collect();
        let weighted: Vec<f64> = weight
            .iter()
            .zip(&set.targets)
            .map(|(w, y)| w * y)
            .collect();
        Some(Grower {
            set,
            min_leaf: params.min_samples_leaf as f64,
            max_features: params.max_features,
            m,
            lists,
            weight,
            weighted,
            goes_left: vec![false; set.len()],
            scratch: vec![0; m],
        })
    }

    /// The weighted sums over the node's rows `start..end` (any column's segment
    /// holds them).
    fn total(&self, start: usize, end: usize) -> Side {
        let mut total = Side::default();
        for &r in &self.lists[start..end] {
            total.weight += self.weight[r as usize];
            total.sum += self.weighted[r as usize];
        }
        total
    }

    /// The best split of the node's rows over the columns in `visit` order, after
    /// at most `max_features` columns that are not constant there.
    fn best_split(&self, visit: &[usize], start: usize, end: usize, total: Side) -> Option<Split> {
        let m = self.m;
        let mut best: Option<Split> = None;
        let mut searched = 0;
        for &c in visit {
            if searched >= self.max_features {
                break;
            }
            let segment = &self.lists[c * m + start..c * m + end];
            let values = &self.set.columns[c];
            let (Some(&first), Some(&last)) = (segment.first(), segment.last()) else {
                continue;
            };
            // Sorted, so equal ends mean a constant column: no split.
            if values[first as usize] == values[last as usize] {
                continue;
            }
            searched += 1;
            self.scan_column(c, segment, total, &mut best);
        }
        best
    }

    /// Tries every threshold of column `c` over its sorted `segment`, keeping the
    /// best in `best`.
    fn scan_column(&self, c: usize, segment: &[u32], total: Side, best: &mut Option<Split>) {
        let values = &self.set.columns[c];
        let mut left = Side::default();
        for k in 0..segment.len() - 1 {
            let r = segment[k] as usize;
            left.weight += self.weight[r];
            left.sum += self.weighted[r];
            let x = values[r];
            let next = values[segment[k + 1] as usize];
            // A threshold only between two distinct values.
            if x == next {
                continue;
            }
            let right = Side {
                weight: total.weight - left.weight,
                sum: total.sum - left.sum,
            };
            if left.weight < self.min_leaf || right.weight < self.min_leaf {
                continue;
            }
            let score = left.score() + right.score();
            if best.is_none_or(|b| score > b.score) {
                let mid = 0.5 * x + 0.5 * next;
                *best = Some(Split {
                    column: c,
                    threshold: if x <= mid && mid < next { mid } else { x },
                    score,
                    left_len: k + 1,
                });
            }
        }
    }

    /// Partitions every column's segment `start..end` by `split`, left rows first,
    /// each side keeping its sorted order.
    fn partition(&mut self, split: &Split, start: usize, end: usize) {
        let m = self.m;
        let chosen = &self.lists[split.column * m + start..split.column * m + end];
        for (k, &r) in chosen.iter().enumerate() {
            self.goes_left[r as usize] = k < split.left_len;
        }
        for c in 0..self.set.width() {
            let segment = &mut self.lists[c * m + start..c * m + end];
            // Stable and branch-free: every row is written to both sides and only
            // the side it belongs to advances (the left side never overtakes the
            // row being read).
            let (mut l, mut right) = (0, 0);
            for k in 0..segment.len() {
                let r = segment[k];
                let left = usize::from(self.goes_left[r as usize]);
                segment[l] = r;
                self.scratch[right] = r;
                l += left;
                right += 1 - left;
            }
            segment[l..].copy_from_slice(&self.scratch[..right]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params() -> TreeParams {
        TreeParams {
            max_depth: 12,
            min_samples_leaf: 1,
            min_samples_split: 2,
            max_features: usize::MAX,
        }
    }

    fn predict(nodes: &[Node], row: &[f64]) -> f64 {
        let mut n = 0;
        loop {
            let node = nodes[n];
            if node.feature == LEAF {
                return node.value;
            }
            n = if row[node.feature as usize] <= node.value {
                node.left
            } else {
                node.right
            } as usize;
        }
    }

    fn fit(rows: &[Vec<f64>], y: &[f64], weights: &[u32], p: &TreeParams) -> Vec<Node> {
        let picked: Vec<usize> = (0..rows[0].len()).collect();
        let set = TrainingSet::new(rows, &picked, y);
        fit_tree(&set, weights, p, &mut ChaCha8Rng::seed_from_u64(1))
    }

    #[test]
    fn a_deep_tree_reproduces_its_training_rows() {
        let rows: Vec<Vec<f64>> = (0..50)
            .map(|i| vec![f64::from(i % 7), f64::from(i)])
            .collect();
        let y: Vec<f64> = (0..50).map(|i| f64::from((i * 37) % 11)).collect();
        // Greedy splits need not be balanced: leave the depth unbounded.
        let unbounded = TreeParams {
            max_depth: 64,
            ..params()
        };
        let nodes = fit(&rows, &y, &[1; 50], &unbounded);
        for (r, want) in rows.iter().zip(&y) {
            assert_eq!(predict(&nodes, r), *want);
        }
        for (i, n) in nodes.iter().enumerate() {
            if n.feature != LEAF {
                assert!(n.left as usize > i && n.right as usize > i);
            }
        }
    }

    #[test]
    fn the_split_is_at_the_midpoint_of_the_best_gap() {
        let rows: Vec<Vec<f64>> = [1.0, 2.0, 3.0, 10.0, 11.0, 12.0]
            .iter()
            .map(|&x| vec![x])
            .collect();
        let y = [0.0, 0.0, 0.0, 5.0, 5.0, 5.0];
        let nodes = fit(&rows, &y, &[1; 6], &params());
        assert_eq!(nodes.len(), 3);
        assert_eq!((nodes[0].feature, nodes[0].value), (0, 6.5));
        assert_eq!(predict(&nodes, &[6.5]), 0.0);
        assert_eq!(predict(&nodes, &[6.6]), 5.0);
        assert_eq!(predict(&nodes, &[f64::NAN]), 5.0);
    }

    /// A row drawn twice weighs what two copies of it weigh.
    #[test]
    fn weights_count_like_copies() {
        let rows: Vec<Vec<f64>> = (0..12)
            .map(|i| vec![f64::from(i % 4), f64::from(i)])
            .collect();
        let y: Vec<f64> = (0..12).map(|i| f64::from(i * i % 5)).collect();
        let weights: Vec<u32> = (0..12).map(|i| i % 3).collect();
        let mut copied_rows = Vec::new();
        let mut copied_y = Vec::new();
        for ((r, t), &w) in rows.iter().zip(&y).zip(&weights) {
            for _ in 0..w {
                copied_rows.push(r.clone());
                copied_y.push(*t);
            }
        }
        let p = TreeParams {
            max_depth: 3,
            min_samples_leaf: 2,
            ..params()
        };
        let weighted = fit(&rows, &y, &weights, &p);
        let copied = fit(&copied_rows, &copied_y, &vec![1; copied_y.len()], &p);
        for probe in 0..40 {
            let row = [f64::from(probe % 5) - 0.5, f64::from(probe) * 0.3];
            assert_eq!(predict(&weighted, &row), predict(&copied, &row), "{row:?}");
        }
    }

    #[test]
    fn limits_make_leaves() {
        let rows: Vec<Vec<f64>> = (0..64).map(|i| vec![f64::from(i)]).collect();
        let y: Vec<f64> = (0..64).map(f64::from).collect();
        let stump = fit(
            &rows,
            &y,
            &[1; 64],
            &TreeParams {
                max_depth: 1,
                ..params()
            },
        );
        assert_eq!(stump.len(), 3);
        let big_leaves = fit(
            &rows,
            &y,
            &[1; 64],
            &TreeParams {
                min_samples_leaf: 20,
                ..params()
            },
        );
        let leaves = big_leaves.iter().filter(|n| n.feature == LEAF).count();
        assert!(leaves <= 3, "{leaves}");
        // Constant targets: nothing to reduce.
        let flat = fit(&rows, &[2.0; 64], &[1; 64], &params());
        assert_eq!(flat, vec![Node::leaf(2.0)]);
        // Everything out of the bag: one leaf at the mean.
        let empty = fit(&rows, &y, &[0; 64], &params());
        assert_eq!(empty, vec![Node::leaf(31.5)]);
    }

    #[test]
    fn column_sampling_still_finds_a_split_past_constant_columns() {
        let rows: Vec<Vec<f64>> = (0..20).map(|i| vec![1.0, 1.0, 1.0, f64::from(i)]).collect();
        let y: Vec<f64> = (0..20).map(|i| if i < 10 { 0.0 } else { 1.0 }).collect();
        let nodes = fit(
            &rows,
            &y,
            &[1; 20],
            &TreeParams {
                max_features: 1,
                ..params()
            },
        );
        assert_eq!(nodes[0].feature, 3);
        assert_eq!(nodes[0].value, 9.5);
    }
}
