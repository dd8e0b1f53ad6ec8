//! Edge softmax: per row and head, a softmax over the row's edges.

use spattn_formats::Csr;

use super::check;
use super::real::{kahan_add, Real};
use super::rows::for_each_row_block;
use crate::error::Result;

/// Row softmax of per-edge scores: for every row `i` and head `h`,
/// `out[e * heads + h] = exp(s_e − m) / Σ_{e' in row i} exp(s_e' − m)` over the row's edges `e`,
/// where `s_e = LeakyReLU(scores[e * heads + h])` when `leaky_relu_slope` is given (else the
/// score itself) and `m` is the row's max.
///
/// `scores` and `out` are `a.nnz() × heads`, edge-major, edges in CSR order.
///
/// Numerics (the rules of every spattn backend): the running max starts at −∞ (a row of large
/// negative scores is fine); the sum of exponentials is a compensated (Kahan) sum in `F`, so
/// hub rows of any degree stay within a few ulps; each probability is a division by that sum.
/// Non-finite scores: −∞ is a masked edge (probability 0; a row and head whose scores are all
/// −∞ gets all zeros); NaN and +∞ propagate as NaN, never hidden. A row without edges writes
/// nothing (its part of `out` is empty).
///
/// [`edge_softmax_in_place`] is the same in place.
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when `heads` is 0, a size
/// overflows, or the slope is not finite; [`Error::LengthMismatch`](crate::Error::LengthMismatch)
/// (`"scores"`, `"out"`) when a buffer is not `a.nnz() × heads`. Nothing is written on error.
pub fn edge_softmax<F: Real>(
    a: &Csr,
    scores: &[F],
    heads: usize,
    leaky_relu_slope: Option<F>,
    out: &mut [F],
) -> Result<()> {
    let n = validate(a, scores.len(), heads, leaky_relu_slope)?;
    check::len("out", n, out.len())?;
    out.copy_from_slice(scores);
    edge_softmax_unchecked(a, out, heads, leaky_relu_slope);
    Ok(())
}

/// [`edge_softmax`] in place: `scores` (`a.nnz() × heads`) is replaced by the probabilities.
///
/// # Errors
/// As [`edge_softmax`] (the buffer is named `"scores"`); nothing is written on error.
pub fn edge_softmax_in_place<F: Real>(
    a: &Csr,
    scores: &mut [F],
    heads: usize,
    leaky_relu_slope: Option<F>,
) -> Result<()> {
    validate(a, scores.len(), heads, leaky_relu_slope)?;
    edge_softmax_unchecked(a, scores, heads, leaky_relu_slope);
    Ok(())
}

/// Checks heads, the slope and the scores' length; returns `a.nnz() × heads`.
fn validate<F: Real>(a: &Csr, len: usize, heads: usize, slope: Option<F>) -> Result<usize> {
    check::heads(heads)?;
    if let Some(slope) = slope {
        check::finite("leaky_relu_slope", slope.to_f64())?;
    }
    let n = check::per_head_len("scores", a.nnz(), heads)?;
    check::len("scores", n, len)?;
    Ok(n)
}

/// [`edge_softmax_in_place`] after validation.
pub(super) fn edge_softmax_unchecked<F: Real>(
    a: &Csr,
    scores: &mut [F],
    heads: usize,
    slope: Option<F>,
) {
    let offsets = a.row_offsets();
    for_each_row_block(
        offsets,
        scores,
        &|i| offsets[i] as usize * heads,
        &|rows, block| {
            let base = offsets[rows.start] as usize;
            // Per-head running max and compensated sum, reused across the block's rows.
            let mut max = vec![F::NEG_INFINITY; heads];
            let mut sum = vec![F::ZERO; heads];
            let mut comp = vec![F::ZERO; heads];
            for i in rows {
                let range = a.row_range(i);
                if range.is_empty() {
                    continue;
                }
                let row = &mut block[(range.start - base) * heads..(range.end - base) * heads];
                softmax_row(row, heads, slope, &mut max, &mut sum, &mut comp);
            }
        },
    );
}

/// Softmax of one non-empty row (`deg × heads`, edge-major), in place.
fn softmax_row<F: Real>(
    row: &mut [F],
    heads: usize,
    slope: Option<F>,
    max: &mut [F],
    sum: &mut [F],
    comp: &mut [F],
) {
    max.fill(F::NEG_INFINITY);
    sum.fill(F::ZERO);
    comp.fill(F::ZERO);
    // Pass 1: activation and running max (NaN never wins a comparison, so it does not become
    // the max; it propagates through exp below instead).
    for edge in row.chunks_exact_mut(heads) {
        for (s, m) in edge.iter_mut().zip(max.iter_mut()) {
            if let Some(slope) = slope {
                if *s < F::ZERO {
                    *s = slope * *s;
                }
            }
            if *s > *m {
                *m = *s;
            }
        }
    }
    // Pass 2: exponentials, summed. A head whose max is −∞ has only masked (−∞) or NaN
    // scores: its exponentials subtract 0, so masked ones are 0 and a NaN stays NaN.
    for m in max.iter_mut() {
        if *m == F::NEG_INFINITY {
            *m = F::ZERO;
        }
    }
    for edge in row.chunks_exact_mut(heads) {
        for ((s, m), (sum, comp)) in edge
            .iter_mut()
            .zip(max.iter())
            .zip(sum.iter_mut().zip(comp.iter_mut()))
        {
            let p = (*s - *m).exp();
            *s = p;
            kahan_add(sum, comp, p);
        }
    }
    // Pass 3: normalize. A sum of 0 is a head whose every score is masked: its probabilities
    // stay 0; a NaN sum makes the head's row NaN, as on the GPU.
    for edge in row.chunks_exact_mut(heads) {
        for (s, sum) in edge.iter_mut().zip(sum.iter()) {
            if *sum != F::ZERO {
                *s = *s / *sum;
            }
        }
    }
}
