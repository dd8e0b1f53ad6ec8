//! SDDMM: one score per edge and head, `S[e, h] = scale · ⟨Q[row(e), h, :], K[col(e), h, :]⟩`,
//! and its GAT twin `S[e, h] = a_dst[row(e), h] + a_src[col(e), h]`.

use spattn_formats::Csr;

use super::check;
use super::real::{dot, Real};
use super::rows::for_each_row_block;
use crate::error::Result;
use crate::shape::Shape;

/// Sampled dense-dense matrix product: for every edge `e = (i, j)` of `a` and head `h`,
/// `out[e * heads + h] = scale · ⟨Q[i, h, :], K[j, h, :]⟩`.
///
/// - `q`: `a.n_rows() × heads × head_dim`, row-major, described by `shape_q`;
/// - `k`: `a.n_cols() × heads × head_dim` (rectangular masks allowed), described by `shape_k`;
/// - `out`: `a.nnz() × heads`, edge-major, edges in CSR order.
///
/// The dot product keeps eight partial sums (error growing with `head_dim / 8`).
///
/// # Errors
/// - [`Error::InvalidArgument`](crate::Error::InvalidArgument): `heads` or `head_dim` is 0, a
///   size overflows `usize`, or `scale` is not finite;
/// - [`Error::ShapeMismatch`](crate::Error::ShapeMismatch) (`"q"`, `"k"`): `shape_q.rows !=
///   a.n_rows()`, or `shape_k` is not `a.n_cols() × heads × head_dim` of `shape_q`;
/// - [`Error::LengthMismatch`](crate::Error::LengthMismatch) (`"q"`, `"k"`, `"out"`): a buffer
///   does not hold exactly its shape's number of elements.
///
/// Nothing is written on error.
pub fn sddmm<F: Real>(
    a: &Csr,
    q: &[F],
    k: &[F],
    shape_q: Shape,
    shape_k: Shape,
    scale: F,
    out: &mut [F],
) -> Result<()> {
    let dims = check::sddmm(
        a,
        q.len(),
        k.len(),
        shape_q,
        shape_k,
        "out",
        Some(out.len()),
    )?;
    check::finite("scale", scale.to_f64())?;
    sddmm_unchecked(a, q, k, dims, scale, out);
    Ok(())
}

/// [`sddmm`] after validation.
pub(super) fn sddmm_unchecked<F: Real>(
    a: &Csr,
    q: &[F],
    k: &[F],
    dims: check::SddmmDims,
    scale: F,
    out: &mut [F],
) {
    let (heads, d) = (dims.heads, dims.head_dim);
    let row_len = heads * d;
    for_each_edge_scores(a, heads, out, &|i, j, s| {
        let q_row = &q[i * row_len..(i + 1) * row_len];
        let k_row = &k[j * row_len..(j + 1) * row_len];
        for (h, s) in s.iter_mut().enumerate() {
            let span = h * d..(h + 1) * d;
            *s = scale * dot(&q_row[span.clone()], &k_row[span]);
        }
    });
}

/// Calls `f(i, j, s)` for every edge `e = (i, j)` of `a`, with `s` its `heads` scores
/// (`out[e · heads..(e + 1) · heads]`); blocks of rows in parallel.
fn for_each_edge_scores<F: Real>(
    a: &Csr,
    heads: usize,
    out: &mut [F],
    f: &(impl Fn(usize, usize, &mut [F]) + Sync),
) {
    let offsets = a.row_offsets();
    let cols = a.col_indices();
    for_each_row_block(
        offsets,
        out,
        &|i| offsets[i] as usize * heads,
        &|rows, block| {
            let base = offsets[rows.start] as usize;
            for i in rows {
                for e in a.row_range(i) {
                    f(
                        i,
                        cols[e] as usize,
                        &mut block[(e - base) * heads..(e - base + 1) * heads],
                    );
                }
            }
        },
    );
}

/// GAT's additive scores: for every edge `e = (i, j)` of `a` and head `h`,
/// `out[e * heads + h] = a_dst[i * heads + h] + a_src[j * heads + h]`.
///
/// - `a_dst`: `a.n_rows() × heads` (the destination node's term, ⟨a_l, W x_i⟩ in GAT);
/// - `a_src`: `a.n_cols() × heads` (the source node's term);
/// - `out`: `a.nnz() × heads`, edge-major, edges in CSR order.
///
/// Follow it with [`edge_softmax`](super::edge_softmax) with a LeakyReLU slope (0.2 in GAT).
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when `heads` is 0 (or a size
/// overflows); [`Error::LengthMismatch`](crate::Error::LengthMismatch) (`"a_dst"`, `"a_src"`,
/// `"out"`) when a buffer has the wrong length. Nothing is written on error.
pub(crate) fn sddmm_gat<F: Real>(
    a: &Csr,
    a_dst: &[F],
    a_src: &[F],
    heads: usize,
    out: &mut [F],
) -> Result<()> {
    check::heads(heads)?;
    check::per_head("a_dst", a.n_rows(), heads, a_dst.len())?;
    check::per_head("a_src", a.n_cols(), heads, a_src.len())?;
    check::per_head("out", a.nnz(), heads, out.len())?;
    for_each_edge_scores(a, heads, out, &|i, j, s| {
        let dst = &a_dst[i * heads..(i + 1) * heads];
        let src = &a_src[j * heads..(j + 1) * heads];
        for ((s, &d), &r) in s.iter_mut().zip(dst).zip(src) {
            *s = d + r;
        }
    });
    Ok(())
}
