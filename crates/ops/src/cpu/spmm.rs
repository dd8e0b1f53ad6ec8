//! SpMM: `O[i, h, :] = Σ_{e in row i} w(e, h) · V[col(e), h, :]`, with per-edge-and-head
//! weights (attention probabilities) or the mask's own values.

use spattn_formats::Csr;

use super::check;
use super::real::{kahan_add, Real};
use super::rows::for_each_row_block;
use crate::error::Result;
use crate::shape::Shape;

/// Sparse × dense product with one weight per edge and head: for every row `i` and head `h`,
/// `O[i, h, :] = Σ_{e in row i} P[e, h] · V[col(e), h, :]`.
///
/// - `p`: `a.nnz() × heads`, edge-major, edges in CSR order (the probabilities of
///   [`edge_softmax`](super::edge_softmax));
/// - `v`: `a.n_cols() × heads × head_dim`, described by `shape_v` (which gives `heads`);
/// - `out`: `a.n_rows() × heads × head_dim`, overwritten; rows without edges get zeros.
///
/// The sum over a row's edges is compensated (Kahan) per output coordinate, so its error does
/// not grow with the degree.
///
/// # Errors
/// - [`Error::InvalidArgument`](crate::Error::InvalidArgument): `heads` or `head_dim` is 0, or
///   a size overflows;
/// - [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) (`"v"`): `shape_v.rows !=
///   a.n_cols()`;
/// - [`Error::LengthMismatch`](crate::Error::LengthMismatch) (`"p"`, `"v"`, `"out"`): a buffer
///   has the wrong length.
///
/// Nothing is written on error.
pub fn spmm<F: Real>(a: &Csr, p: &[F], v: &[F], shape_v: Shape, out: &mut [F]) -> Result<()> {
    check::spmm(a, Some(p.len()), v.len(), shape_v, Some(out.len()))?;
    let heads = shape_v.heads;
    spmm_unchecked(a, |e, h| p[e * heads + h], v, shape_v, out);
    Ok(())
}

/// [`spmm`] after validation, with the weight of edge `e`, head `h` given by `weight(e, h)`.
pub(super) fn spmm_unchecked<F, W>(a: &Csr, weight: W, v: &[F], shape_v: Shape, out: &mut [F])
where
    F: Real,
    W: Fn(usize, usize) -> F + Sync,
{
    let (heads, d) = (shape_v.heads, shape_v.head_dim);
    let row_len = heads * d;
    let offsets = a.row_offsets();
    let cols = a.col_indices();
    for_each_row_block(offsets, out, &|i| i * row_len, &|rows, block| {
        let first = rows.start;
        // Kahan compensation of the output row, reused across the block's rows.
        let mut comp = vec![F::ZERO; row_len];
        for i in rows {
            let o_row = &mut block[(i - first) * row_len..(i - first + 1) * row_len];
            o_row.fill(F::ZERO);
            comp.fill(F::ZERO);
            for e in a.row_range(i) {
                let j = cols[e] as usize;
                let v_row = &v[j * row_len..(j + 1) * row_len];
                for h in 0..heads {
                    let w = weight(e, h);
                    let span = h * d..(h + 1) * d;
                    for ((o, c), &x) in o_row[span.clone()]
                        .iter_mut()
                        .zip(&mut comp[span.clone()])
                        .zip(&v_row[span])
                    {
                        kahan_add(o, c, w * x);
                    }
                }
            }
        }
    });
}
