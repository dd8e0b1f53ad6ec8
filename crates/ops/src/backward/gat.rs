//! GAT's and GATv2's attention backward on the GPU: the fused passes and the steps composed of
//! the CSR ops, which [`super::gat_backward`] (every GAT caller's entry: `spattn::layers`'
//! `GatConv`, the Python package) runs by kernel set, and GATv2's composition uses. With the
//! forward's [`crate::csr_ops::gat_scores`], the device twin of [`crate::cpu::gat_attention`]
//! and [`crate::cpu::gat_attention_backward`].
//!
//! Forward ([`super::gat_forward`]'s composed set): [`crate::csr_ops::gat_scores`] (`s =
//! a_dst[i] + a_src[j] + bias`, or GATv2's [`crate::csr_ops::sddmm_gatv2`]), the softmax with
//! the LeakyReLU (`P`), dropout in place where asked (`W`), then [`crate::csr_ops::spmm`]
//! (`out = W · x`): [`super::softmax_aggregate`].
//!
//! Backward, fused ([`gat_fused_backward`], for the heads [`FusedBackward::supports`]): the
//! fused backward's two passes with GAT's additive scores, one gather per edge and pass, no
//! per-edge buffer but the bias's gradient, deterministic. Composed (every other head, and
//! larger graphs): [`gat_score_grad`] (`dS`, the
//! gradient of each pre-activation score: a bias's gradient), [`gat_vector_grads`] (`Σ_row dS`,
//! `Σ_column dS`: the attention vectors' terms), [`gat_aggregation_grad`] (`dx = Wᵀ · dOut`).
//! Each composed step names what it reads and what it overwrites. From row statistics (no
//! per-edge buffer of scores or probabilities, forward and backward): [`super::gat_forward_rows`]
//! and [`super::gat_backward_rows`].

use spattn_kernels_sys::BACKWARD;

use crate::buffer::{DeviceMatrix, DeviceVec};
use crate::csr_ops;
use crate::device_csr::DeviceCsr;
use crate::dropout::{Dropout, DropoutWords};
use crate::dtype::DType;
use crate::edge_extras;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{
    check_same_gpu, kernel_named, launch, product, to_u32, PushKernelArg, PushOptionalArg,
};
use crate::shape::Shape;

use super::fused::{check_transpose, layout, push_units, row_grid, GAT_THREADS, ROW_PARTIAL};
#[cfg(doc)]
use super::FusedBackward;
use super::{
    edge_leaky_relu_backward, edge_row_sum, edge_softmax_backward_in_place, transpose_edge_values,
    DeviceTranspose,
};

/// What GAT's fused backward reads besides the features: the score terms `a_dst`
/// (`n_rows × heads × 1` f32) and `a_src` (`n_cols × heads × 1` f32), the bias added to the
/// scores (`nnz × heads` f32 in A's CSR order, or none), LeakyReLU's slope and the dropout the
/// forward applied to the probabilities.
#[derive(Clone, Copy, Debug)]
pub struct GatScoreTerms<'a> {
    /// Per target node and head.
    pub a_dst: &'a DeviceMatrix<f32>,
    /// Per source node and head.
    pub a_src: &'a DeviceMatrix<f32>,
    /// Per edge and head, in A's CSR order.
    pub bias: Option<&'a DeviceVec<f32>>,
    /// LeakyReLU's negative slope.
    pub slope: f32,
    /// The forward's dropout on the probabilities.
    pub dropout: Option<&'a Dropout>,
}

/// What [`gat_backward`](super::gat_backward) writes: the aggregation's share of ∂L/∂x (`n_cols ×
/// heads × head_dim`, like x), ∂L/∂a_dst and ∂L/∂a_src (f32, like the score terms), and ∂L/∂bias
/// (`nnz × heads` f32, A's order) where the forward had a bias.
#[derive(Debug)]
pub struct GatGrads<'a, T: DType> {
    /// The aggregation's share of ∂L/∂x.
    pub dx: &'a mut DeviceMatrix<T>,
    /// ∂L/∂a_dst.
    pub d_dst: &'a mut DeviceMatrix<f32>,
    /// ∂L/∂a_src.
    pub d_src: &'a mut DeviceMatrix<f32>,
    /// ∂L/∂bias, written where given (it must be given with a bias).
    pub d_bias: Option<&'a mut DeviceVec<f32>>,
}

/// The gradients of GAT attention, `out = W · x` with
/// `W = dropout(softmax_row(LeakyReLU(a_dst[i] + a_src[j] + bias_e)))`, given `d_out`
/// (`n_rows × heads × head_dim`), in two kernels over A and Aᵀ (`gat_backward_rows_*`,
/// `gat_backward_cols_*` in backward.cu): the row pass gathers `x_j` and leaves each row's
/// statistics and ∂L/∂a_dst, the column pass gathers `dOut_i` and writes ∂L/∂x, ∂L/∂a_src and
/// ∂L/∂bias. Nothing from the forward is read but its inputs; no floating-point atomics (the
/// same bits every run); device memory beyond the outputs: the row statistics
/// (`n_rows × heads` pairs) and the split rows' and columns' partials, and with a bias, dropout
/// or the bias's gradient the inverse edge map, made once and kept with `t` (`nnz` u32).
/// Enqueued on `gpu`'s stream.
///
/// Errors: [`Error::InvalidArgument`] when `t`'s sizes are not Aᵀ's, the head is too wide
/// ([`FusedBackward::supports`]; the composed steps above take any), or a bias comes without
/// its gradient's buffer; [`Error::ShapeMismatch`] naming the operand; [`Error::ForeignGpu`];
/// [`Error::OutOfMemory`].
pub(crate) fn gat_fused_backward<T: DType>(
    gpu: &Gpu,
    (a, t): (&DeviceCsr, &DeviceTranspose),
    terms: GatScoreTerms<'_>,
    (x, d_out): (&DeviceMatrix<T>, &DeviceMatrix<T>),
    grads: GatGrads<'_, T>,
) -> Result<()> {
    check_transpose(a, t)?;
    let s_out = d_out.shape();
    let (heads, head_dim) = (s_out.heads, s_out.head_dim);
    Shape::new(a.n_rows(), heads, head_dim)?.expect_eq("d_out", s_out)?;
    let sx = Shape::new(a.n_cols(), heads, head_dim)?;
    sx.expect_eq("x", x.shape())?;
    sx.expect_eq("dx", grads.dx.shape())?;
    let (per_dst, per_src) = (
        Shape::new(a.n_rows(), heads, 1)?,
        Shape::new(a.n_cols(), heads, 1)?,
    );
    per_dst.expect_eq("a_dst", terms.a_dst.shape())?;
    per_src.expect_eq("a_src", terms.a_src.shape())?;
    per_dst.expect_eq("d_a_dst", grads.d_dst.shape())?;
    per_src.expect_eq("d_a_src", grads.d_src.shape())?;
    let edges = product("edges x heads", &[a.nnz(), heads])?;
    let edge_len = |what: &'static str, len: usize| {
        if len == edges {
            return Ok(());
        }
        Err(Error::LengthMismatch {
            what,
            expected: edges,
            actual: len,
        })
    };
    if let Some(b) = terms.bias {
        edge_len("bias", b.len())?;
        if grads.d_bias.is_none() {
            return Err(Error::InvalidArgument {
                what: "d_bias",
                why: "a bias needs its gradient's buffer".into(),
            });
        }
    }
    if let Some(db) = &grads.d_bias {
        edge_len("d_bias", db.len())?;
    }
    check_same_gpu(gpu, "A", a)?;
    check_same_gpu(gpu, "transpose", &t.csr)?;
    check_same_gpu(gpu, "x", x)?;
    check_same_gpu(gpu, "d_out", d_out)?;
    check_same_gpu(gpu, "a_dst", terms.a_dst)?;
    check_same_gpu(gpu, "a_src", terms.a_src)?;
    check_same_gpu(gpu, "dx", &*grads.dx)?;
    check_same_gpu(gpu, "d_a_dst", &*grads.d_dst)?;
    check_same_gpu(gpu, "d_a_src", &*grads.d_src)?;
    if let Some(b) = terms.bias {
        check_same_gpu(gpu, "bias", b)?;
    }
    if let Some(db) = &grads.d_bias {
        check_same_gpu(gpu, "d_bias", &**db)?;
    }
    let (vec, g, nv) =
        layout(head_dim, std::mem::size_of::<T>()).ok_or(Error::InvalidArgument {
            what: "head_dim",
            why: format!(
            "{head_dim} features of {} are too wide for the fused GAT backward; use the composed \
             steps",
            T::NAME
        ),
        })?;
    if a.nnz() == 0 {
        // No edge: every output is zero (rows without edges aggregate nothing).
        grads.dx.fill(T::from_f32(0.0))?;
        grads.d_dst.fill(0.0)?;
        return grads.d_src.fill(0.0);
    }
    let (heads_u, dim_u) = (to_u32("heads", heads)?, to_u32("head_dim", head_dim)?);
    let drop = DropoutWords::of(terms.dropout);
    let ([a_rows, a_starts, a_slots, a_parts, a_first], a_n_parts, a_split) =
        a.schedule().merge_units();
    let ([t_rows, t_starts, t_slots, t_parts, t_first], t_n_parts, t_split) =
        t.csr.schedule().merge_units();
    // The row statistics, the split rows' scalars and the split columns' dx and d_src; the
    // counters start at zero and the merging unit resets each.
    let mut stats =
        DeviceVec::<f32>::zeros(gpu, product("row statistics", &[a.n_rows(), heads, 2])?)?;
    let mut row_parts = DeviceVec::<f32>::zeros(
        gpu,
        product("row partials", &[a_n_parts, heads, ROW_PARTIAL])?,
    )?;
    let mut row_counters =
        DeviceVec::<u32>::zeros(gpu, product("row counters", &[a_split, heads])?)?;
    let col_part_len = product("column partials", &[t_n_parts, heads, head_dim + 1])?;
    let mut col_parts = DeviceVec::<f32>::zeros(gpu, col_part_len)?;
    let mut col_counters =
        DeviceVec::<u32>::zeros(gpu, product("column counters", &[t_split, heads])?)?;
    // A's edge of each entry of Aᵀ, where a bias, dropout or the bias's gradient reads it.
    let t_to_a = if terms.bias.is_some() || grads.d_bias.is_some() || drop.threshold != 0 {
        Some(t.inverse_map(gpu)?)
    } else {
        None
    };

    // Row pass over A.
    let n_units = to_u32("units", a_rows.len())?;
    let name = kernel_named(&BACKWARD, gat_rows_kernel(T::NAME, vec, nv))?;
    let f = gpu.load_function(BACKWARD.name, BACKWARD.ptx, name)?;
    let mut args = gpu.launch_builder(&f);
    let units = [a_rows, a_starts, a_slots, a_parts, a_first];
    push_units(&mut args, (&units, &n_units, None), a.col_indices());
    args.arg(x.slice())
        .arg(d_out.slice())
        .arg(&heads_u)
        .arg(&dim_u)
        .arg(&g);
    push_scores(&mut args, &terms, &drop);
    args.arg(stats.slice_mut())
        .arg(grads.d_dst.slice_mut())
        .arg(row_parts.slice_mut())
        .arg(row_counters.slice_mut());
    let cfg = row_grid(a_rows.len(), heads, g, GAT_THREADS)?;
    // SAFETY: the kernel reads A's schedule (n_units units, starts n_units + 1, slots and
    // partials per unit, first partials per split row + 1; built with the CSR; no walk order:
    // units as numbered) and col_indices[starts[u]..starts[u+1]) ⊂ [0, nnz); x rows
    // col_indices[e] < n_cols and dOut rows < n_rows, each heads·head_dim (shapes checked), in
    // vectors of `vec` inside a head; a_dst at (row, head) < n_rows·heads, a_src at (col, head)
    // < n_cols·heads and the bias at (e, head) < nnz·heads (checked). It writes stats and d_dst
    // at (row, head) < n_rows·heads (stats 2 floats each), partials at (part, head) <
    // a_n_parts·heads (5 floats) and counters at (split row, head) < a_split·heads, all sized
    // above.
    unsafe { launch(name, &mut args, cfg) }?;

    // Column pass over Aᵀ.
    let n_units = to_u32("units", t_rows.len())?;
    let name = kernel_named(&BACKWARD, gat_cols_kernel(T::NAME, vec, nv))?;
    let f = gpu.load_function(BACKWARD.name, BACKWARD.ptx, name)?;
    let mut args = gpu.launch_builder(&f);
    let units = [t_rows, t_starts, t_slots, t_parts, t_first];
    push_units(&mut args, (&units, &n_units, None), t.csr.col_indices());
    args.arg_or_null(t_to_a)
        .arg(x.slice())
        .arg(d_out.slice())
        .arg(&heads_u)
        .arg(&dim_u)
        .arg(&g);
    push_scores(&mut args, &terms, &drop);
    args.arg(stats.slice())
        .arg(grads.dx.slice_mut())
        .arg(grads.d_src.slice_mut())
        .arg_or_null_mut(grads.d_bias)
        .arg(col_parts.slice_mut())
        .arg(col_counters.slice_mut());
    let cfg = row_grid(t_rows.len(), heads, g, GAT_THREADS)?;
    // SAFETY: as the row pass, on Aᵀ's schedule: its entries are rows of A (< n_rows: dOut,
    // a_dst and stats rows), its units' rows columns of A (< n_cols: x, dx, a_src and d_src
    // rows); an entry's edge t_to_a[e] < nnz (the inverse of the edge map, a permutation of
    // 0..nnz; the entry itself where no map is passed, then used only for the dropout's and
    // bias's indices, which are absent) indexes the bias and d_bias at (edge, head) <
    // nnz·heads (checked); partials at (part, head) < t_n_parts·heads of head_dim + 1 floats
    // and counters at (split column, head) < t_split·heads, sized above.
    unsafe { launch(name, &mut args, cfg) }
}

/// Pushes the score terms' arguments of both GAT passes: a_dst, a_src, the bias (or null),
/// the slope and the dropout's words.
fn push_scores<'a>(
    args: &mut cudarc::driver::LaunchArgs<'a>,
    terms: &'a GatScoreTerms<'a>,
    drop: &'a DropoutWords,
) {
    args.arg(terms.a_dst.slice())
        .arg(terms.a_src.slice())
        .arg_or_null(terms.bias)
        .arg(&terms.slope);
    drop.push(args);
}

/// The fused GAT row pass's kernel for `dtype` (a [`DType::NAME`]) and the lane layout's `vec`
/// and `nv` (as the attention's fused backward); the launch-name test forms it too.
pub(crate) fn gat_rows_kernel(dtype: &str, vec: u32, nv: u32) -> String {
    format!("gat_backward_rows_{dtype}_v{vec}_n{nv}")
}

/// The fused GAT column pass's kernel for `dtype`, `vec` and `nv`.
pub(crate) fn gat_cols_kernel(dtype: &str, vec: u32, nv: u32) -> String {
    format!("gat_backward_cols_{dtype}_v{vec}_n{nv}")
}

/// ∂L/∂score before the softmax's LeakyReLU into `ds` (`nnz × heads`, A's order): `dP =
/// ⟨dOut_i, x_j⟩` (times the dropout's factors where `dropout`: the aggregation used `W`),
/// the softmax backward with the probabilities `p` (before dropout), then LeakyReLU's
/// derivative at the pre-activation scores where `leaky` is `(slope, s)` (GAT; GATv2's
/// LeakyReLU sits inside its scores: `None`). Reads `p` and `s`, overwrites `ds`.
///
/// Errors: as the ops it composes ([`csr_ops::sddmm`], [`edge_softmax_backward_in_place`],
/// [`edge_leaky_relu_backward`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gat_score_grad<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    heads: usize,
    dropout: Option<&Dropout>,
    leaky: Option<(f32, &DeviceVec<f32>)>,
    p: &DeviceVec<f32>,
    (d_out, x): (&DeviceMatrix<T>, &DeviceMatrix<T>),
    ds: &mut DeviceVec<f32>,
) -> Result<()> {
    csr_ops::sddmm(gpu, a, d_out, x, 1.0, ds)?;
    if let Some(d) = dropout {
        edge_extras::apply_dropout(gpu, ds, d)?;
    }
    edge_softmax_backward_in_place(gpu, a, p, ds, heads)?;
    if let Some((slope, s)) = leaky {
        edge_leaky_relu_backward(gpu, s, slope, ds)?;
    }
    Ok(())
}

/// The attention vectors' per-node terms from `ds` (A's order): `d_dst[i, h] = Σ_row dS` and
/// `d_src[j, h] = Σ_column dS` (f32 sums: these feed sums over every node whose terms cancel).
/// Reads `ds`, overwrites `scratch` (`nnz × heads`: dS in Aᵀ's order).
///
/// Errors: as [`edge_row_sum`] and [`transpose_edge_values`].
pub(crate) fn gat_vector_grads(
    gpu: &Gpu,
    (a, t): (&DeviceCsr, &DeviceTranspose),
    heads: usize,
    ds: &DeviceVec<f32>,
    scratch: &mut DeviceVec<f32>,
    (d_dst, d_src): (&mut DeviceMatrix<f32>, &mut DeviceMatrix<f32>),
) -> Result<()> {
    edge_row_sum(gpu, a, ds, heads, d_dst)?;
    transpose_edge_values(gpu, t, ds, heads, scratch)?;
    edge_row_sum(gpu, t.csr(), scratch, heads, d_src)
}

/// The aggregation's share of ∂L/∂x: `dx = Wᵀ · dOut`, `w` the weights the forward aggregated
/// with (A's order: `P`, or `P` after dropout). Reads `w`, overwrites `scratch` (`nnz × heads`:
/// `W` in Aᵀ's order) and `dx`.
///
/// Errors: as [`transpose_edge_values`] and [`csr_ops::spmm`].
pub(crate) fn gat_aggregation_grad<T: DType>(
    gpu: &Gpu,
    t: &DeviceTranspose,
    heads: usize,
    w: &DeviceVec<f32>,
    scratch: &mut DeviceVec<f32>,
    d_out: &DeviceMatrix<T>,
    dx: &mut DeviceMatrix<T>,
) -> Result<()> {
    transpose_edge_values(gpu, t, w, heads, scratch)?;
    csr_ops::spmm(gpu, t.csr(), scratch, d_out, dx)
}
