//! Backward of sparse attention on the CPU: the exact gradients of
//! `out = softmax_row(scale · (Q Kᵀ) masked by A) · V`, the reference of every GPU backward.
//!
//! Per head `h`, with `s_e = scale · r_e`, `r_e = ⟨Q_row(e), K_col(e)⟩`, `P` the row softmax of
//! `s` and `dOut` the gradient of the output:
//!
//! ```text
//! dP_e  = ⟨dOut_row(e), V_col(e)⟩            (an SDDMM of dOut and V)
//! D_i   = Σ_{e ∈ row i} P_e dP_e = ⟨dOut_i, Out_i⟩
//! dS_e  = P_e (dP_e − D_row(e))               (the softmax backward, per edge)
//! dQ    = scale · dS · K                      (SpMM on A)
//! dK    = scale · dSᵀ · Q,  dV = Pᵀ · dOut    (SpMM on Aᵀ)
//! dscale = Σ_e dS_e · r_e
//! ```
//!
//! The building blocks ([`edge_softmax_backward`], [`transpose_edge_values`], [`edge_row_sum`])
//! are public for layers that compose their own backward (GAT's LeakyReLU scores, AGNN's
//! cosine scores); [`attention_backward`] is the whole thing, and
//! [`attention_backward_f64_from`] its f64 reference from f32 / f16 / bf16 data.
//!
//! Layouts are those of [the module](super): per-edge values `a.nnz() × heads` in CSR order,
//! dense operands `rows × heads × head_dim`. Sums over a row's edges are compensated (Kahan).

use rayon::prelude::*;
use spattn_formats::Csr;

use super::attention::{attention, AttentionInputs};
use super::check;
use super::error_metric::upcast_f64;
use super::real::{dot, kahan_add, Real};
use super::rows::for_each_row_block;
use super::sddmm::sddmm_unchecked;
use super::softmax::edge_softmax_unchecked;
use super::spmm::spmm_unchecked;
use crate::error::{Error, Result};
use crate::shape::Shape;

/// The gradients of sparse attention with respect to its inputs, from [`attention_backward`].
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionGrads<F> {
    /// ∂L/∂Q, shaped like Q (`a.n_rows() × heads × head_dim`).
    pub dq: Vec<F>,
    /// ∂L/∂K, shaped like K (`a.n_cols() × heads × head_dim`).
    pub dk: Vec<F>,
    /// ∂L/∂V, shaped like V (`a.n_cols() × heads × head_dim_v`).
    pub dv: Vec<F>,
    /// ∂L/∂scale: `Σ_e dS_e · ⟨Q_row(e), K_col(e)⟩` over every edge and head.
    pub d_scale: F,
    /// `Σ_e |dS_e · ⟨Q_row(e), K_col(e)⟩|`: the size of the terms `d_scale` sums, which can
    /// cancel to far less; a sum of them in a precision of unit roundoff `u` is off by up to
    /// about `u` times this (a tolerance for other implementations' `d_scale`).
    pub d_scale_terms: F,
}

/// Softmax backward over each row's edges: `ds[e, h] = p[e, h] · (dp[e, h] − Σ_{e' ∈ row}
/// p[e', h] · dp[e', h])`, the gradient of the scores from the gradient `dp` of the
/// probabilities `p` (the output of [`edge_softmax`](super::edge_softmax)).
///
/// All three buffers are `a.nnz() × heads`, edges in CSR order. For a softmax taken after a
/// LeakyReLU, multiply `ds` by the activation's derivative afterwards.
///
/// # Errors
/// [`Error::InvalidArgument`] (`heads` 0, a size overflowing); [`Error::LengthMismatch`]
/// (`"p"`, `"dp"`, `"ds"`) when a buffer is not `a.nnz() × heads`. Nothing is written on error.
pub(crate) fn edge_softmax_backward<F: Real>(
    a: &Csr,
    p: &[F],
    dp: &[F],
    heads: usize,
    ds: &mut [F],
) -> Result<()> {
    check::heads(heads)?;
    let n = check::per_head_len("p", a.nnz(), heads)?;
    check::len("p", n, p.len())?;
    check::len("dp", n, dp.len())?;
    check::len("ds", n, ds.len())?;
    softmax_backward_unchecked(a, p, dp, heads, ds);
    Ok(())
}

/// [`edge_softmax_backward`] after validation.
fn softmax_backward_unchecked<F: Real>(a: &Csr, p: &[F], dp: &[F], heads: usize, ds: &mut [F]) {
    let offsets = a.row_offsets();
    for_each_row_block(
        offsets,
        ds,
        &|i| offsets[i] as usize * heads,
        &|rows, block| {
            let base = offsets[rows.start] as usize;
            let mut sum = vec![F::ZERO; heads];
            let mut comp = vec![F::ZERO; heads];
            for i in rows {
                let range = a.row_range(i);
                sum.fill(F::ZERO);
                comp.fill(F::ZERO);
                for e in range.clone() {
                    for h in 0..heads {
                        let x = e * heads + h;
                        kahan_add(&mut sum[h], &mut comp[h], p[x] * dp[x]);
                    }
                }
                for e in range {
                    for (h, &row_sum) in sum.iter().enumerate() {
                        let x = e * heads + h;
                        block[x - base * heads] = p[x] * (dp[x] - row_sum);
                    }
                }
            }
        },
    );
}

/// Moves per-edge values from A's edge order to Aᵀ's: `dst[t · heads + h] = src[from_a[t] ·
/// heads + h]`, where `from_a` is the map of [`Csr::transpose_with_map`] (for each entry of Aᵀ,
/// the index of the same entry in A). Column sums of A's values are then row sums on Aᵀ
/// (a sum over each row's edges), and `Pᵀ · X` an SpMM on Aᵀ.
///
/// (The GPU twin, `backward::transpose_edge_values`, scatters through the inverse map.)
///
/// # Errors
/// [`Error::InvalidArgument`] (`heads` 0, a map entry out of range); [`Error::LengthMismatch`]
/// (`"src"`, `"dst"`: not `from_a.len() × heads`).
pub fn transpose_edge_values<F: Real>(
    from_a: &[u32],
    src: &[F],
    heads: usize,
    dst: &mut [F],
) -> Result<()> {
    check::heads(heads)?;
    let n = check::per_head_len("src", from_a.len(), heads)?;
    check::len("src", n, src.len())?;
    check::len("dst", n, dst.len())?;
    if let Some((t, &e)) = from_a
        .iter()
        .enumerate()
        .find(|&(_, &e)| e as usize >= from_a.len())
    {
        return Err(Error::InvalidArgument {
            what: "transpose map",
            why: format!(
                "entry {t} is {e}, past the {} edges of the matrix",
                from_a.len()
            ),
        });
    }
    dst.par_chunks_mut(heads)
        .zip(from_a.par_iter())
        .with_min_len(1 << 12)
        .for_each(|(d, &e)| {
            let e = e as usize;
            d.copy_from_slice(&src[e * heads..(e + 1) * heads]);
        });
    Ok(())
}

/// Per row and head, the sum of a row's per-edge values: `out[i · heads + h] = Σ_{e ∈ row i}
/// values[e · heads + h]` (compensated). Rows without edges get 0. On Aᵀ (after
/// [`transpose_edge_values`]) this is the column sum of A's values (GAT's ∂a_src).
///
/// # Errors
/// [`Error::InvalidArgument`] (`heads` 0); [`Error::LengthMismatch`] (`"values"`:
/// not `a.nnz() × heads`; `"out"`: not `a.n_rows() × heads`).
pub(crate) fn edge_row_sum<F: Real>(
    a: &Csr,
    values: &[F],
    heads: usize,
    out: &mut [F],
) -> Result<()> {
    check::heads(heads)?;
    check::per_head("values", a.nnz(), heads, values.len())?;
    check::per_head("out", a.n_rows(), heads, out.len())?;
    let offsets = a.row_offsets();
    for_each_row_block(offsets, out, &|i| i * heads, &|rows, block| {
        let first = rows.start;
        let mut comp = vec![F::ZERO; heads];
        for i in rows {
            let o = &mut block[(i - first) * heads..(i - first + 1) * heads];
            o.fill(F::ZERO);
            comp.fill(F::ZERO);
            for e in a.row_range(i) {
                for h in 0..heads {
                    kahan_add(&mut o[h], &mut comp[h], values[e * heads + h]);
                }
            }
        }
    });
    Ok(())
}

/// The exact gradients of [`attention`] at `inputs` and `scale`, given the forward's output
/// `out` and the gradient `d_out` of the loss with respect to it (both `a.n_rows() × heads ×
/// head_dim_v`, [`AttentionInputs::out_shape`]), computed in `F`:
/// `D_i = ⟨dOut_i, Out_i⟩` per head, then the formulas of the `cpu::backward` module's
/// documentation.
///
/// Rows without edges contribute nothing (their dQ row is zero); so do columns no row attends
/// to (their dK and dV rows are zero).
///
/// # Errors
/// As [`attention`] for Q, K, V and `scale`; [`Error::LengthMismatch`] (`"out"`, `"d_out"`)
/// when those are not the output's length.
pub fn attention_backward<F: Real>(
    a: &Csr,
    inputs: &AttentionInputs<'_, F>,
    scale: F,
    out: &[F],
    d_out: &[F],
) -> Result<AttentionGrads<F>> {
    let dims = inputs.validate(a, Some(out.len()))?;
    check::len("d_out", inputs.out_shape().len(), d_out.len())?;
    check::finite("scale", scale.to_f64())?;
    let heads = dims.heads;
    let out_shape = inputs.out_shape();
    let edges = a.nnz() * heads;

    // Raw dot products r = ⟨q, k⟩ (kept for dscale), then P = softmax(scale · r).
    let mut raw = vec![F::ZERO; edges];
    sddmm_unchecked(a, inputs.q, inputs.k, dims, F::ONE, &mut raw);
    let mut p: Vec<F> = raw.par_iter().map(|&r| scale * r).collect();
    edge_softmax_unchecked(a, &mut p, heads, None);

    // dP = ⟨dOut_row, V_col⟩ per edge and head.
    let v_dims = check::SddmmDims {
        heads,
        head_dim: out_shape.head_dim,
    };
    let mut ds = vec![F::ZERO; edges];
    sddmm_unchecked(a, d_out, inputs.v, v_dims, F::ONE, &mut ds);

    // dS = P (dP − D), D_i = ⟨dOut_i, Out_i⟩.
    let dv_dim = out_shape.head_dim;
    let row_len = heads * dv_dim;
    let d_row: Vec<F> = (0..a.n_rows() * heads)
        .into_par_iter()
        .with_min_len(1 << 10)
        .map(|ih| {
            let (i, h) = (ih / heads, ih % heads);
            let span = i * row_len + h * dv_dim..i * row_len + (h + 1) * dv_dim;
            dot(&d_out[span.clone()], &out[span])
        })
        .collect();
    let offsets = a.row_offsets();
    for_each_row_block(
        offsets,
        &mut ds,
        &|i| offsets[i] as usize * heads,
        &|rows, block| {
            let base = offsets[rows.start] as usize;
            for i in rows {
                for e in a.row_range(i) {
                    for h in 0..heads {
                        let x = e * heads + h;
                        let dp = block[x - base * heads];
                        block[x - base * heads] = p[x] * (dp - d_row[i * heads + h]);
                    }
                }
            }
        },
    );

    // (Σ dS·raw, Σ |dS·raw|), each compensated.
    let [d_scale, _, d_scale_terms, _] = ds
        .par_chunks(1 << 12)
        .zip(raw.par_chunks(1 << 12))
        .map(|(d, r)| {
            let (mut s, mut c, mut t, mut ct) = (F::ZERO, F::ZERO, F::ZERO, F::ZERO);
            for (&d, &r) in d.iter().zip(r) {
                kahan_add(&mut s, &mut c, d * r);
                kahan_add(&mut t, &mut ct, (d * r).abs());
            }
            (s, t)
        })
        .collect::<Vec<(F, F)>>()
        .into_iter()
        .fold([F::ZERO; 4], |[mut s, mut c, mut t, mut ct], (x, y)| {
            kahan_add(&mut s, &mut c, x);
            kahan_add(&mut t, &mut ct, y);
            [s, c, t, ct]
        });

    // dQ = scale · dS · K on A; dK = scale · dSᵀ · Q and dV = Pᵀ · dOut on Aᵀ.
    let mut dq = vec![F::ZERO; inputs.shape_q.len()];
    spmm_unchecked(
        a,
        |e, h| scale * ds[e * heads + h],
        inputs.k,
        inputs.shape_k,
        &mut dq,
    );
    let (at, from_a) = a.transpose_with_map();
    let mut dk = vec![F::ZERO; inputs.shape_k.len()];
    spmm_unchecked(
        &at,
        |t, h| scale * ds[from_a[t] as usize * heads + h],
        inputs.q,
        inputs.shape_q,
        &mut dk,
    );
    let mut dv = vec![F::ZERO; inputs.shape_v.len()];
    let d_out_shape = Shape {
        rows: a.n_rows(),
        ..out_shape
    };
    spmm_unchecked(
        &at,
        |t, h| p[from_a[t] as usize * heads + h],
        d_out,
        d_out_shape,
        &mut dv,
    );
    Ok(AttentionGrads {
        dq,
        dk,
        dv,
        d_scale,
        d_scale_terms,
    })
}

/// The f64 reference of a GPU backward: upcasts Q, K, V and `d_out` (f32, f64, `half::f16`,
/// `half::bf16`, …) to f64, runs the forward ([`attention`]) and [`attention_backward`] in
/// f64, and returns the gradients. Compare each with [`rel_l2_error`](super::rel_l2_error).
///
/// # Errors
/// As [`attention_backward`] (without `"out"`).
pub fn attention_backward_f64_from<T>(
    a: &Csr,
    inputs: &AttentionInputs<'_, T>,
    scale: f64,
    d_out: &[T],
) -> Result<AttentionGrads<f64>>
where
    T: Copy + Into<f64> + Sync,
{
    inputs.validate(a, None)?;
    check::len("d_out", inputs.out_shape().len(), d_out.len())?;
    check::finite("scale", scale)?;
    let (q, k, v, d) = (
        upcast_f64(inputs.q),
        upcast_f64(inputs.k),
        upcast_f64(inputs.v),
        upcast_f64(d_out),
    );
    let up = AttentionInputs::new(&q, inputs.shape_q, &k, inputs.shape_k, &v, inputs.shape_v);
    let mut out = vec![0.0; up.out_shape().len()];
    attention(a, &up, scale, &mut out)?;
    attention_backward(a, &up, scale, &out, &d)
}
