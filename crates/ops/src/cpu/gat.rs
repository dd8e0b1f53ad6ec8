//! GAT's attention on the CPU, forward and backward: the one composition the layers' host path
//! (`spattn::layers::GatConv<Host<F>>`) and the Python package's CPU path share.
//!
//! Per edge `e = (i, j)` of A and head `h`, with per-node terms `a_dst` (rows of A) and `a_src`
//! (columns) and an optional per-edge score bias (GAT's edge features):
//!
//! ```text
//! s[e,h] = a_dst[i,h] + a_src[j,h] (+ bias[e,h])
//! P      = softmax over row i of LeakyReLU(s)        W = P, dropped (dropout)
//! out[i,h,:] = Σ_row W[e,h] · x[j,h,:]
//! ```

use spattn_formats::Csr;

use super::{
    apply_dropout, check, edge_row_sum, edge_softmax, edge_softmax_backward, sddmm, sddmm_gat,
    spmm, transpose_edge_values, Real,
};
use crate::dropout::Dropout;
use crate::error::Result;
use crate::shape::Shape;

/// `values` times `dropout`'s factors where given (a copy).
fn dropped<F: Real>(values: &[F], dropout: Option<&Dropout>, heads: usize) -> Vec<F> {
    let mut out = values.to_vec();
    if let Some(d) = dropout {
        apply_dropout(&mut out, d, heads);
    }
    out
}

/// GAT's scores and probabilities (see the module documentation): the pre-activation scores
/// `s` and `P`, the softmax of `LeakyReLU(s)` over each row, before dropout (`a.nnz() × heads`
/// each): what [`gat_attention`] aggregates with and [`gat_attention_backward`] takes.
///
/// # Errors
/// Lengths of `a_dst` and `a_src` against the mask, as [`edge_softmax`] (`slope` not finite);
/// [`crate::Error::LengthMismatch`] for a `bias` that is not `a.nnz() × heads`.
pub fn gat_scores<F: Real>(
    a: &Csr,
    heads: usize,
    slope: F,
    (a_dst, a_src, bias): (&[F], &[F], Option<&[F]>),
) -> Result<(Vec<F>, Vec<F>)> {
    check::heads(heads)?;
    let edges = check::per_head_len("scores", a.nnz(), heads)?;
    if let Some(b) = bias {
        check::len("bias", edges, b.len())?;
    }
    let mut s = vec![F::ZERO; edges];
    sddmm_gat(a, a_dst, a_src, heads, &mut s)?;
    if let Some(b) = bias {
        for (s, &b) in s.iter_mut().zip(b) {
            *s = *s + b;
        }
    }
    let mut p = vec![F::ZERO; edges];
    edge_softmax(a, &s, heads, Some(slope), &mut p)?;
    Ok((s, p))
}

/// GAT's attention forward (see the module documentation) into `out` (`a.n_rows()` rows of
/// `shape_x`'s heads and head_dim); returns [`gat_scores`]' `(s, P)`, which the backward takes.
///
/// # Errors
/// As [`gat_scores`], and [`spmm`]'s (`x`, `out`).
#[allow(clippy::too_many_arguments)]
pub fn gat_attention<F: Real>(
    a: &Csr,
    heads: usize,
    slope: F,
    terms: (&[F], &[F], Option<&[F]>),
    dropout: Option<&Dropout>,
    x: &[F],
    shape_x: Shape,
    out: &mut [F],
) -> Result<(Vec<F>, Vec<F>)> {
    let (s, p) = gat_scores(a, heads, slope, terms)?;
    spmm(a, &dropped(&p, dropout, heads), x, shape_x, out)?;
    Ok((s, p))
}

/// The transpose of A and its map (for each entry of Aᵀ, the same entry's index in A:
/// [`Csr::transpose_with_map`]).
pub type Transposed<'a> = (&'a Csr, &'a [u32]);

/// The backward of [`gat_attention`] given its `(s, P)` and `d_out` (`a.n_rows()` rows of
/// `shape_x`'s heads and head_dim): writes `dx = Wᵀ · d_out` (the aggregation's part of ∂L/∂x),
/// `d_dst[i,h] = Σ_row dS` and `d_src[j,h] = Σ_column dS`, and returns dS (`a.nnz() × heads`:
/// the gradient of each pre-activation score, the bias's gradient).
///
/// # Errors
/// As the ops it composes ([`sddmm`], the softmax backward, [`transpose_edge_values`], row
/// sums, [`spmm`]), naming the operand whose length is wrong.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub fn gat_attention_backward<F: Real>(
    a: &Csr,
    (at, from_a): Transposed<'_>,
    heads: usize,
    slope: F,
    dropout: Option<&Dropout>,
    (s, p): (&[F], &[F]),
    (d_out, x, shape_x): (&[F], &[F], Shape),
    (dx, d_dst, d_src): (&mut [F], &mut [F], &mut [F]),
) -> Result<Vec<F>> {
    check::heads(heads)?;
    let edges = check::per_head_len("scores", a.nnz(), heads)?;
    check::len("scores", edges, s.len())?;
    let shape_out = Shape::new(a.n_rows(), shape_x.heads, shape_x.head_dim)?;
    let mut dp = vec![F::ZERO; edges];
    sddmm(a, d_out, x, shape_out, shape_x, F::ONE, &mut dp)?;
    // Under dropout the aggregation used W = P dropped: dP = dW times the same factors.
    if let Some(d) = dropout {
        apply_dropout(&mut dp, d, heads);
    }
    let mut ds = vec![F::ZERO; edges];
    edge_softmax_backward(a, p, &dp, heads, &mut ds)?;
    // LeakyReLU' at the pre-activation score (the GPU kernel's branch: 1 at s ≥ 0).
    for (d, &pre) in ds.iter_mut().zip(s) {
        if pre < F::ZERO {
            *d = *d * slope;
        }
    }
    edge_row_sum(a, &ds, heads, d_dst)?;
    // dp is free again: dS in Aᵀ's order, then W in Aᵀ's order.
    transpose_edge_values(from_a, &ds, heads, &mut dp)?;
    edge_row_sum(at, &dp, heads, d_src)?;
    transpose_edge_values(from_a, &dropped(p, dropout, heads), heads, &mut dp)?;
    spmm(at, &dp, d_out, shape_out, dx)?;
    Ok(ds)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The forward against a direct computation, and the backward's dS, d_dst, d_src and dx
    /// against central differences of a scalar loss, on a graph with an empty row.
    #[test]
    fn forward_and_backward_match_direct_and_finite_differences() {
        let a = Csr::from_edges(4, 4, &[(0, 0), (0, 1), (0, 3), (1, 2), (3, 0), (3, 3)]).unwrap();
        let (at, map) = a.transpose_with_map();
        let (heads, dim) = (2, 3);
        let shape = Shape::new(4, heads, dim).unwrap();
        let gen = |n: usize, k: f64| (0..n).map(|i| ((i as f64 + 1.0) * k).sin()).collect();
        let x: Vec<f64> = gen(shape.len(), 0.7);
        let a_dst: Vec<f64> = gen(4 * heads, 1.3);
        let a_src: Vec<f64> = gen(4 * heads, 2.1);
        let bias: Vec<f64> = gen(a.nnz() * heads, 0.4);
        let d_out: Vec<f64> = gen(shape.len(), 0.9);
        let slope = 0.2;
        let loss = |a_dst: &[f64], a_src: &[f64], bias: &[f64], x: &[f64]| {
            let mut out = vec![0.0; shape.len()];
            gat_attention(
                &a,
                heads,
                slope,
                (a_dst, a_src, Some(bias)),
                None,
                x,
                shape,
                &mut out,
            )
            .unwrap();
            out.iter().zip(&d_out).map(|(o, g)| o * g).sum::<f64>()
        };
        let mut out = vec![0.0; shape.len()];
        let (s, p) = gat_attention(
            &a,
            heads,
            slope,
            (&a_dst, &a_src, Some(&bias)),
            None,
            &x,
            shape,
            &mut out,
        )
        .unwrap();
        // Row 2 has no edges: zeros.
        assert!(out[2 * heads * dim..3 * heads * dim]
            .iter()
            .all(|&v| v == 0.0));
        // Row 0, head 1 directly.
        let (row, h) = (0usize, 1usize);
        let cols = [0usize, 1, 3];
        let z: Vec<f64> = (0..3)
            .map(|k| {
                let v = a_dst[row * heads + h] + a_src[cols[k] * heads + h] + bias[k * heads + h];
                if v < 0.0 {
                    v * slope
                } else {
                    v
                }
            })
            .collect();
        let m = z.iter().cloned().fold(f64::MIN, f64::max);
        let sum: f64 = z.iter().map(|v| (v - m).exp()).sum();
        for f in 0..dim {
            let want: f64 = (0..3)
                .map(|k| (z[k] - m).exp() / sum * x[(cols[k] * heads + h) * dim + f])
                .sum();
            assert!((out[(row * heads + h) * dim + f] - want).abs() < 1e-12);
        }
        let (mut dx, mut d_dst, mut d_src) = (
            vec![0.0; shape.len()],
            vec![0.0; 4 * heads],
            vec![0.0; 4 * heads],
        );
        let ds = gat_attention_backward(
            &a,
            (&at, &map),
            heads,
            slope,
            None,
            (&s, &p),
            (&d_out, &x, shape),
            (&mut dx, &mut d_dst, &mut d_src),
        )
        .unwrap();
        let eps = 1e-6;
        let fd = |f: &dyn Fn(f64) -> f64| (f(eps) - f(-eps)) / (2.0 * eps);
        let bumped = |v: &[f64], i: usize, d: f64| {
            let mut v = v.to_vec();
            v[i] += d;
            v
        };
        for (i, &got) in ds.iter().enumerate() {
            let g = fd(&|d| loss(&a_dst, &a_src, &bumped(&bias, i, d), &x));
            assert!((got - g).abs() < 1e-6, "dS {i}: {got} vs {g}");
        }
        for i in 0..d_dst.len() {
            let g = fd(&|d| loss(&bumped(&a_dst, i, d), &a_src, &bias, &x));
            assert!((d_dst[i] - g).abs() < 1e-6, "d_dst {i}");
            let g = fd(&|d| loss(&a_dst, &bumped(&a_src, i, d), &bias, &x));
            assert!((d_src[i] - g).abs() < 1e-6, "d_src {i}");
        }
        for (i, &got) in dx.iter().enumerate() {
            let g = fd(&|d| loss(&a_dst, &a_src, &bias, &bumped(&x, i, d)));
            assert!((got - g).abs() < 1e-6, "dx {i}");
        }
    }
}
