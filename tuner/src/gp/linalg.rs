//! Small dense kernels on a Cholesky factor, written for contiguous memory.
//!
//! nalgebra's generic triangular solves go through strided views with bounds checks and its
//! `Cholesky::inverse` solves against the identity, n³ multiply-adds plus overhead. The
//! acquisition needs one forward substitution per candidate (about a thousand per round) and
//! the likelihood gradient needs the lower triangle of K⁻¹ per evaluation, so both are done
//! here on packed triangles where every inner loop is a contiguous axpy or dot product
//! (callgrind: about 3× fewer instructions than through nalgebra at n = 50).

use nalgebra::{Cholesky, Dyn};

/// Dot product with four accumulators (lets the compiler keep several FMAs in flight).
#[inline]
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0; 4];
    let mut chunks_a = a.chunks_exact(4);
    let mut chunks_b = b.chunks_exact(4);
    for (x, y) in (&mut chunks_a).zip(&mut chunks_b) {
        acc[0] += x[0] * y[0];
        acc[1] += x[1] * y[1];
        acc[2] += x[2] * y[2];
        acc[3] += x[3] * y[3];
    }
    let tail: f64 = chunks_a
        .remainder()
        .iter()
        .zip(chunks_b.remainder())
        .map(|(x, y)| x * y)
        .sum();
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// `y += a · x` over the common length (vectorises: no reduction).
#[inline]
fn axpy(a: f64, x: &[f64], y: &mut [f64]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// The lower-triangular factor L, packed by rows: row i holds L[i, 0..=i] at offset
/// i(i+1)/2, so that forward substitution is a sequence of contiguous dot products (measured
/// with callgrind: fewer instructions than the column-oriented axpy form at n = 50).
#[derive(Clone, Debug, PartialEq)]
pub struct PackedLower {
    n: usize,
    rows: Vec<f64>,
}

impl PackedLower {
    /// Packs the factor of `chol`.
    pub fn from_cholesky(chol: &Cholesky<f64, Dyn>) -> PackedLower {
        let l = chol.l_dirty();
        let n = l.nrows();
        let mut rows = Vec::with_capacity(n * (n + 1) / 2);
        for i in 0..n {
            rows.extend(l.row(i).iter().take(i + 1));
        }
        PackedLower { n, rows }
    }

    /// Order of the matrix.
    pub fn order(&self) -> usize {
        self.n
    }

    /// L[i, 0..=i].
    fn row(&self, i: usize) -> &[f64] {
        let start = i * (i + 1) / 2;
        &self.rows[start..=start + i]
    }

    /// Solves L v = b in place (forward substitution).
    pub fn forward_substitute(&self, b: &mut [f64]) {
        for i in 0..self.n.min(b.len()) {
            let row = self.row(i);
            let s = b[i] - dot(&row[..i], &b[..i]);
            b[i] = s / row[i];
        }
    }

    /// The lower triangle of (L Lᵀ)⁻¹, packed by rows: (a, b) with b ≤ a at a(a+1)/2 + b.
    ///
    /// M = L⁻¹ is built row by row (row i = −(1/L[i, i]) Σ_{k<i} L[i, k] · row k, plus
    /// 1/L[i, i] on the diagonal), then K⁻¹ = MᵀM = Σ_k (row k)ᵀ(row k) as rank-one updates
    /// of the lower triangle: n³/3 multiply-adds in all, every inner loop a contiguous axpy.
    pub fn inverse_lower(&self) -> Vec<f64> {
        let n = self.n;
        let tri = |i: usize| i * (i + 1) / 2;
        let mut m = vec![0.0; tri(n)];
        for i in 0..n {
            let (done, rest) = m.split_at_mut(tri(i));
            let row_i = &mut rest[..=i];
            let l_row = self.row(i);
            for k in 0..i {
                axpy(l_row[k], &done[tri(k)..tri(k) + k + 1], &mut row_i[..=k]);
            }
            let l_ii = l_row[i];
            for v in row_i.iter_mut() {
                *v = -*v / l_ii;
            }
            row_i[i] = 1.0 / l_ii;
        }
        let mut inv = vec![0.0; tri(n)];
        for k in 0..n {
            let row_k = &m[tri(k)..tri(k) + k + 1];
            for a in 0..=k {
                axpy(row_k[a], &row_k[..=a], &mut inv[tri(a)..tri(a) + a + 1]);
            }
        }
        inv
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nalgebra::{DMatrix, DVector};

    fn spd(n: usize) -> DMatrix<f64> {
        let a = DMatrix::from_fn(n, n, |i, j| ((i * 7 + j * 3) % 11) as f64 / 11.0 - 0.4);
        &a * a.transpose() + DMatrix::identity(n, n) * 0.5
    }

    #[test]
    fn forward_substitution_and_inverse_match_nalgebra() {
        for n in [1, 2, 5, 13] {
            let k = spd(n);
            let chol = Cholesky::new(k.clone()).expect("SPD");
            let packed = PackedLower::from_cholesky(&chol);
            assert_eq!(packed.order(), n);
            let b = DVector::from_fn(n, |i, _| (i as f64).sin() + 0.3);
            let expected = chol.l().solve_lower_triangular(&b).expect("solvable");
            let mut v: Vec<f64> = b.iter().copied().collect();
            packed.forward_substitute(&mut v);
            for i in 0..n {
                assert!(
                    (v[i] - expected[i]).abs() < 1e-10,
                    "n {n}: {v:?} vs {expected}"
                );
            }
            let inverse = chol.inverse();
            let lower = packed.inverse_lower();
            let mut p = 0;
            for a in 0..n {
                for b in 0..=a {
                    assert!(
                        (lower[p] - inverse[(a, b)]).abs() < 1e-9,
                        "n {n} ({a}, {b})"
                    );
                    p += 1;
                }
            }
        }
    }

    #[test]
    fn dot_handles_every_remainder() {
        for n in 0..9 {
            let a: Vec<f64> = (0..n).map(|i| i as f64 + 1.0).collect();
            let expected: f64 = a.iter().map(|v| v * v).sum();
            assert_eq!(dot(&a, &a), expected);
        }
    }
}
