//! GAT's attention on the GPU by kernel set, written once for every caller (`spattn::layers`'
//! `GatConv`, the Python package's GAT): [`gat_forward`] and [`gat_backward`] run the set their
//! workspace names, [`GatKernels::auto`] says which set suits a head and a graph.
//!
//! | set | forward | backward | per-edge buffers |
//! |---|---|---|---|
//! | [`GatKernels::Rows`] | row statistics, then an SpMM-shaped pass ([`super::gat_forward_rows`]) | a pass over A, one over Aᵀ ([`super::gat_backward_rows`]) | dS (`nnz × heads` f32) in the backward |
//! | [`GatKernels::Fused`] | — | two passes ([`super::gat_fused_backward`]) | none |
//! | [`GatKernels::Composed`] | scores, softmax, SpMM | the CSR ops ([`super::gat_score_grad`] …) | one (forward), three (backward) `nnz × heads` f32 |
//!
//! GATv2's ([`gatv2_forward`], [`gatv2_backward`]) has one set: the CSR ops, its scores'
//! LeakyReLU inside the SDDMM, the backward's edge gradients in a pass over A and one over Aᵀ.

use crate::buffer::{DeviceMatrix, DeviceVec};
use crate::csr_ops::{self, UnitWalk};
use crate::device_csr::DeviceCsr;
use crate::dropout::Dropout;
use crate::dtype::DType;
use crate::edge_extras;
use crate::error::{Error, Result};
use crate::gatv2::Gatv2Operands;
use crate::gpu::Gpu;

use super::gat::{
    gat_aggregation_grad, gat_fused_backward, gat_score_grad, gat_vector_grads, GatGrads,
    GatScoreTerms,
};
use super::gat_rows::{gat_backward_rows, gat_forward_rows, gat_rows_supports, KeepBits, RowStats};
use super::{gatv2_edge_grad, gatv2_edge_grad_transposed, DeviceTranspose, FusedBackward};

/// Which kernels run GAT's attention ([`gat_forward`], [`gat_backward`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GatKernels {
    /// The CSR ops: scores, softmax and probabilities in `nnz × heads` f32 workspaces.
    Composed,
    /// The fused backward's two passes (backward only; no per-edge buffer).
    Fused,
    /// Row statistics and SpMM-shaped passes: no per-edge probabilities.
    Rows,
}

impl GatKernels {
    /// Heads from which [`GatKernels::auto`] takes the rows kernels on any graph: below, their
    /// per-edge score gathers are a large share of the traffic and on large graphs the composed
    /// steps run faster (rows at 0.85–0.93× on ogbn-arxiv at 1 × 40; docs/kernels/csr-ops.md,
    /// "GAT from row statistics").
    pub const ROWS_MIN_HEADS: usize = 4;

    /// Edges up to which [`GatKernels::auto`] takes the rows kernels at any head count. A
    /// mini-batch's graph (10⁴–1.2·10⁵ edges) makes a step that waits on the host: there the rows
    /// kernels' fewer launches take 35–60 µs less host time a layer, at 0.84–1.22× the speed of
    /// the composed steps (with the fused backward up to 2¹⁵ edges) at 1–3 heads of 8–128; from
    /// ~2.5·10⁵ edges the composed steps win at one head of 40 or more (docs/kernels/csr-ops.md,
    /// "GAT from row statistics").
    pub const ROWS_SMALL_MAX_EDGES: usize = 1 << 17;

    /// Edges up to which [`GatKernels::auto`] takes the fused backward: its two launches and no
    /// per-edge buffers save launches and host time on small graphs (a batch of molecules: 1.7–2.4×
    /// the composed steps' GPU time); from about 10⁵ edges the composed steps' edge-parallel
    /// passes run as fast or faster (docs/kernels/csr-ops.md, "GAT's backward").
    pub const FUSED_MAX_EDGES: usize = 1 << 15;

    /// The set for `heads × head_dim` of `T` on a graph of `nnz` edges: the rows kernels for
    /// [`Self::ROWS_MIN_HEADS`] heads or more, or up to [`Self::ROWS_SMALL_MAX_EDGES`] edges, where
    /// they take the head (`gat_rows_supports`; for a backward, only where `rows`: the rows
    /// forward's output and statistics are at hand), else for a backward the fused passes on
    /// small graphs where they take the head ([`FusedBackward::supports`]), else the composed
    /// steps.
    pub fn auto<T: DType>(
        heads: usize,
        head_dim: usize,
        nnz: usize,
        backward: bool,
        rows: bool,
    ) -> Self {
        let rows_fit = heads >= Self::ROWS_MIN_HEADS || nnz <= Self::ROWS_SMALL_MAX_EDGES;
        if rows && rows_fit && gat_rows_supports::<T>(head_dim) {
            return Self::Rows;
        }
        if backward && nnz <= Self::FUSED_MAX_EDGES && FusedBackward::supports::<T>(head_dim) {
            return Self::Fused;
        }
        Self::Composed
    }

    /// Whether this set runs `head_dim` features of `T` (the composed steps run any).
    pub fn supports<T: DType>(self, head_dim: usize) -> bool {
        match self {
            Self::Composed => true,
            Self::Fused => FusedBackward::supports::<T>(head_dim),
            Self::Rows => gat_rows_supports::<T>(head_dim),
        }
    }
}

/// [`gat_forward`]'s workspace, which names its kernels.
#[derive(Debug)]
pub enum GatForward<'w> {
    /// The composed steps: `nnz × heads` f32 (the probabilities, overwritten).
    Composed(&'w mut DeviceVec<f32>),
    /// The rows kernels: the row statistics (`n_rows × heads` f32, left for
    /// [`GatBackward::Rows`]'s [`RowStats::Kept`]) and, with dropout, the kept bits
    /// ([`super::dropout_mask_words`] u32), walking A's units in `walk`'s order.
    Rows {
        /// The row statistics, written.
        lse: &'w mut DeviceVec<f32>,
        /// The dropout mask's workspace (with dropout).
        mask: Option<&'w mut DeviceVec<u32>>,
        /// The order the passes walk the units in ([`DeviceGraph::unit_walk`], or
        /// [`UnitWalk::default`]: as numbered); the same bits in any.
        ///
        /// [`DeviceGraph::unit_walk`]: crate::graph::DeviceGraph::unit_walk
        walk: &'w UnitWalk,
    },
}

/// [`gat_backward`]'s workspace, which names its kernels.
#[derive(Debug)]
pub enum GatBackward<'w, T: DType> {
    /// The composed steps, which recompute the scores and probabilities: three `nnz × heads` f32
    /// buffers, overwritten.
    Composed([&'w mut DeviceVec<f32>; 3]),
    /// The fused backward's two passes: no workspace.
    Fused,
    /// The rows kernels: the forward's output, its row statistics (kept or recomputed), dS's
    /// `nnz × heads` f32 and, with dropout, the masks (A's kept from the forward or drawn
    /// again, Aᵀ's drawn), walking A's and Aᵀ's units in `walk`'s order.
    Rows {
        /// The forward's output (`n_rows × heads × head_dim`).
        out: &'w DeviceMatrix<T>,
        /// The row statistics.
        lse: RowStats<'w>,
        /// dS in Aᵀ's order, overwritten.
        ds: &'w mut DeviceVec<f32>,
        /// The dropout masks (with dropout).
        mask: Option<KeepBits<'w>>,
        /// The order the passes walk the units in (as [`GatForward::Rows`]'s).
        walk: &'w UnitWalk,
    },
}

/// GAT's attention `out = W · x`, `W = dropout(softmax_row(LeakyReLU(a_dst[i] + a_src[j] +
/// bias_e)))`, on the kernels `ws` names; `x` is `n_cols × heads × head_dim`, `out`
/// `n_rows × heads × head_dim`. Enqueued on `gpu`'s stream.
///
/// Errors: those of the kernels' functions (shapes and lengths named, [`Error::ForeignGpu`],
/// a head the rows kernels do not take).
///
/// [`Error::ForeignGpu`]: crate::Error::ForeignGpu
pub fn gat_forward<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    terms: GatScoreTerms<'_>,
    x: &DeviceMatrix<T>,
    ws: GatForward<'_>,
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    match ws {
        GatForward::Rows { lse, mask, walk } => {
            gat_forward_rows(gpu, (a, walk), terms, x, (lse, mask), out)
        }
        GatForward::Composed(p) => {
            csr_ops::gat_scores(gpu, a, (terms.a_dst, terms.a_src), terms.bias, p)?;
            let heads = x.shape().heads;
            softmax_aggregate(gpu, a, heads, Some(terms.slope), terms.dropout, p, x, out)
        }
    }
}

/// The steps GAT and GATv2 share after their scores: `p` (the scores, `nnz × heads` f32)
/// becomes the softmax per row (of their LeakyReLU where `slope`), dropped where `dropout`, and
/// `out = P · x`.
///
/// Errors: those of [`csr_ops::edge_softmax_in_place`], [`edge_extras::apply_dropout`] and
/// [`csr_ops::spmm`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn softmax_aggregate<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    heads: usize,
    slope: Option<f32>,
    dropout: Option<&Dropout>,
    p: &mut DeviceVec<f32>,
    x: &DeviceMatrix<T>,
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    csr_ops::edge_softmax_in_place(gpu, a, p, heads, slope)?;
    if let Some(dr) = dropout {
        edge_extras::apply_dropout(gpu, p, dr)?;
    }
    csr_ops::spmm(gpu, a, p, x, out)
}

/// The gradients of [`gat_forward`] given `d_out` (`n_rows × heads × head_dim`), on the kernels
/// `ws` names: the aggregation's share of ∂L/∂x, ∂L/∂a_dst, ∂L/∂a_src and, with a bias, its
/// gradient (`grads`). Enqueued on `gpu`'s stream; the same bits every run.
///
/// Errors: those of the kernels' functions (shapes and lengths named, `t` not Aᵀ, a bias
/// without its gradient's buffer, a head the chosen kernels do not take).
pub fn gat_backward<T: DType>(
    gpu: &Gpu,
    (a, t): (&DeviceCsr, &DeviceTranspose),
    terms: GatScoreTerms<'_>,
    (x, d_out): (&DeviceMatrix<T>, &DeviceMatrix<T>),
    ws: GatBackward<'_, T>,
    grads: GatGrads<'_, T>,
) -> Result<()> {
    let [s, p, dp] = match ws {
        GatBackward::Rows {
            out,
            lse,
            ds,
            mask,
            walk,
        } => {
            let ws = (lse, ds, mask);
            return gat_backward_rows(gpu, (a, t), walk, terms, (x, out, d_out), ws, grads);
        }
        GatBackward::Fused => return gat_fused_backward(gpu, (a, t), terms, (x, d_out), grads),
        GatBackward::Composed(ws) => ws,
    };
    if terms.bias.is_some() && grads.d_bias.is_none() {
        return Err(Error::InvalidArgument {
            what: "d_bias",
            why: "a bias needs its gradient's buffer".into(),
        });
    }
    let heads = d_out.shape().heads;
    let drop = terms.dropout;
    csr_ops::gat_scores(gpu, a, (terms.a_dst, terms.a_src), terms.bias, s)?;
    csr_ops::edge_softmax(gpu, a, s, heads, Some(terms.slope), p)?;
    let leaky = Some((terms.slope, &*s));
    gat_score_grad(gpu, a, heads, drop, leaky, p, (d_out, x), dp)?;
    if let Some(db) = grads.d_bias {
        db.copy_from(dp)?;
    }
    // s is free again: dS in Aᵀ's order; then dp: W in Aᵀ's order.
    gat_vector_grads(gpu, (a, t), heads, dp, s, (grads.d_dst, grads.d_src))?;
    if let Some(dr) = drop {
        edge_extras::apply_dropout(gpu, p, dr)?;
    }
    gat_aggregation_grad(gpu, t, heads, p, dp, d_out, grads.dx)
}

/// What [`gatv2_backward`] writes: ∂L/∂xl and ∂L/∂xr (shaped as [`Gatv2Operands`]' `xl` and
/// `xr`), each target row's share of ∂L/∂att (`n_rows × heads × dim` f32, summed over rows by
/// the caller: no atomics) and ∂L/∂ef where the operands have edge features.
#[derive(Debug)]
pub struct Gatv2Grads<'a, T: DType> {
    /// ∂L/∂xl: the aggregation's share and the scores'.
    pub d_xl: &'a mut DeviceMatrix<T>,
    /// ∂L/∂xr.
    pub d_xr: &'a mut DeviceMatrix<T>,
    /// Each row's share of ∂L/∂att.
    pub d_att_rows: &'a mut DeviceVec<f32>,
    /// ∂L/∂ef, written where given (only with edge features).
    pub d_ef: Option<&'a mut DeviceMatrix<T>>,
}

/// GATv2's attention (PyG's `GATv2Conv`): scores `att · LeakyReLU(xl[j] + xr[i] (+ ef[e]))`
/// per edge and head (the per-edge feature sum never stored), their softmax per row, dropout
/// where given, and `out[i] = Σ_j W[e] · xl[j]` (`n_rows × heads × dim`). `p` (`nnz × heads`
/// f32) is the workspace, overwritten. Enqueued on `gpu`'s stream.
///
/// Errors: shapes and lengths named ([`Gatv2Operands`] against A, `p`, `out`),
/// [`Error::ForeignGpu`].
///
/// [`Error::ForeignGpu`]: crate::Error::ForeignGpu
pub fn gatv2_forward<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    ops: &Gatv2Operands<'_, T>,
    dropout: Option<&Dropout>,
    p: &mut DeviceVec<f32>,
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    csr_ops::sddmm_gatv2(gpu, a, ops, p)?;
    let heads = ops.xr.shape().heads;
    softmax_aggregate(gpu, a, heads, None, dropout, p, ops.xl, out)
}

/// The exact gradients of [`gatv2_forward`] given `d_out` (`n_rows × heads × dim`), with three
/// `nnz × heads` f32 workspaces (overwritten): the scores and probabilities recomputed,
/// ∂L/∂score by the softmax backward, one pass over A (∂xr, ∂ef, the rows' shares of ∂att)
/// and, after the aggregation's `Wᵀ · dOut`, one over Aᵀ (the scores' share of ∂xl). No
/// atomics, no per-edge feature tensor: the same bits every run. Enqueued on `gpu`'s stream.
///
/// Errors: shapes and lengths named, `t` not Aᵀ, `d_ef` without edge features,
/// [`Error::ForeignGpu`].
///
/// [`Error::ForeignGpu`]: crate::Error::ForeignGpu
pub fn gatv2_backward<T: DType>(
    gpu: &Gpu,
    (a, t): (&DeviceCsr, &DeviceTranspose),
    ops: &Gatv2Operands<'_, T>,
    dropout: Option<&Dropout>,
    d_out: &DeviceMatrix<T>,
    [s, p, dp]: [&mut DeviceVec<f32>; 3],
    grads: Gatv2Grads<'_, T>,
) -> Result<()> {
    let heads = ops.xr.shape().heads;
    csr_ops::sddmm_gatv2(gpu, a, ops, s)?;
    csr_ops::edge_softmax(gpu, a, s, heads, None, p)?;
    gat_score_grad(gpu, a, heads, dropout, None, p, (d_out, ops.xl), dp)?;
    let Gatv2Grads {
        d_xl,
        d_xr,
        d_att_rows,
        d_ef,
    } = grads;
    gatv2_edge_grad(gpu, a, ops, dp, d_xr, d_ef, d_att_rows)?;
    // s is free again: W in Aᵀ's order, for the aggregation's share of ∂xl.
    if let Some(dr) = dropout {
        edge_extras::apply_dropout(gpu, p, dr)?;
    }
    gat_aggregation_grad(gpu, t, heads, p, s, d_out, d_xl)?;
    gatv2_edge_grad_transposed(gpu, a, t, ops, dp, d_xl)
}
