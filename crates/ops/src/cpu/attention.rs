//! Unfused attention: SDDMM → edge softmax → SpMM, the reference of every fused kernel.

use spattn_formats::Csr;

use super::check;
use super::error_metric::upcast_f64;
use super::real::Real;
use super::sddmm::sddmm_unchecked;
use super::softmax::edge_softmax_unchecked;
use super::spmm::spmm_unchecked;
use crate::error::Result;
use crate::shape::Shape;

/// The dense operands of [`attention`]: Q, K, V with their shapes, borrowed.
///
/// Q is `a.n_rows() × heads × head_dim`, K is `a.n_cols() × heads × head_dim`, V is
/// `a.n_cols() × heads × head_dim_v` (`head_dim_v` may differ from Q's and K's); all row-major.
#[derive(Clone, Copy, Debug)]
pub struct AttentionInputs<'a, T> {
    /// Queries, `a.n_rows() × heads × head_dim`.
    pub q: &'a [T],
    /// Keys, `a.n_cols() × heads × head_dim`.
    pub k: &'a [T],
    /// Values, `a.n_cols() × heads × head_dim_v`.
    pub v: &'a [T],
    /// Shape of `q`.
    pub shape_q: Shape,
    /// Shape of `k`.
    pub shape_k: Shape,
    /// Shape of `v`.
    pub shape_v: Shape,
}

impl<'a, T> AttentionInputs<'a, T> {
    /// Bundles the operands (checked only when an op runs, which names the bad one).
    pub fn new(
        q: &'a [T],
        shape_q: Shape,
        k: &'a [T],
        shape_k: Shape,
        v: &'a [T],
        shape_v: Shape,
    ) -> Self {
        Self {
            q,
            k,
            v,
            shape_q,
            shape_k,
            shape_v,
        }
    }

    /// The output's shape: `shape_q.rows × shape_v.heads × shape_v.head_dim`.
    pub fn out_shape(&self) -> Shape {
        Shape {
            rows: self.shape_q.rows,
            ..self.shape_v
        }
    }

    /// Checks every operand against `a` (and `out_len` when given) as [`attention`] does.
    pub(super) fn validate(&self, a: &Csr, out_len: Option<usize>) -> Result<check::SddmmDims> {
        let dims = check::sddmm(
            a,
            self.q.len(),
            self.k.len(),
            self.shape_q,
            self.shape_k,
            "scores",
            None,
        )?;
        check::per_head_len("scores", a.nnz(), dims.heads)?;
        check::shape("v", self.shape_v)?;
        let expected_v = Shape {
            rows: a.n_cols(),
            heads: dims.heads,
            head_dim: self.shape_v.head_dim,
        };
        check::shape_eq("v", expected_v, self.shape_v)?;
        check::spmm(a, None, self.v.len(), self.shape_v, out_len)?;
        Ok(dims)
    }
}

/// Sparse attention, unfused: `out = softmax_row(scale · (Q Kᵀ) masked by A) · V`, computed as
/// [`sddmm`](super::sddmm) → [`edge_softmax_in_place`](super::edge_softmax_in_place) →
/// [`spmm`](super::spmm) in `F`, with one `a.nnz() × heads` buffer of scores in between.
///
/// `out` is `a.n_rows() × heads × head_dim_v` ([`AttentionInputs::out_shape`]); a row of `a`
/// without edges outputs zeros.
///
/// # Errors
/// Every check of the three ops, made before anything runs: [`Error::InvalidArgument`]
/// (`heads` or a `head_dim` 0, `scale` not finite, a size overflowing),
/// [`Error::ShapeMismatch`] (`"q"`, `"k"`, `"v"`: rows not matching `a`, or heads / head_dim
/// not matching Q's), [`Error::LengthMismatch`] (`"q"`, `"k"`, `"v"`, `"out"`). Nothing is
/// written on error.
///
/// [`Error::InvalidArgument`]: crate::Error::InvalidArgument
/// [`Error::ShapeMismatch`]: crate::Error::ShapeMismatch
/// [`Error::LengthMismatch`]: crate::Error::LengthMismatch
pub fn attention<F: Real>(
    a: &Csr,
    inputs: &AttentionInputs<'_, F>,
    scale: F,
    out: &mut [F],
) -> Result<()> {
    let dims = inputs.validate(a, Some(out.len()))?;
    check::finite("scale", scale.to_f64())?;
    let mut scores = vec![F::ZERO; a.nnz() * dims.heads];
    sddmm_unchecked(a, inputs.q, inputs.k, dims, scale, &mut scores);
    edge_softmax_unchecked(a, &mut scores, dims.heads, None);
    let heads = dims.heads;
    spmm_unchecked(
        a,
        |e, h| scores[e * heads + h],
        inputs.v,
        inputs.shape_v,
        out,
    );
    Ok(())
}

/// The f64 reference of a GPU attention run: upcasts Q, K, V (f32, f64, `half::f16`,
/// `half::bf16`, or any type converting to f64 losslessly) to f64, runs [`attention`] in f64
/// and returns the `a.n_rows() × heads × head_dim_v` output.
///
/// Compare a device result with it through [`rel_l2_error`](super::rel_l2_error).
///
/// # Errors
/// As [`attention`] (without `"out"`); nothing is allocated for the output on error.
pub fn attention_f64_from<T>(
    a: &Csr,
    inputs: &AttentionInputs<'_, T>,
    scale: f64,
) -> Result<Vec<f64>>
where
    T: Copy + Into<f64> + Sync,
{
    inputs.validate(a, None)?;
    check::finite("scale", scale)?;
    let (q, k, v) = (
        upcast_f64(inputs.q),
        upcast_f64(inputs.k),
        upcast_f64(inputs.v),
    );
    let up = AttentionInputs::new(&q, inputs.shape_q, &k, inputs.shape_k, &v, inputs.shape_v);
    let mut out = vec![0.0; inputs.out_shape().len()];
    attention(a, &up, scale, &mut out)?;
    Ok(out)
}
