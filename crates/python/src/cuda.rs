//! The CUDA bodies of [`GraphCore`](crate::graph::GraphCore)'s calls: views of the package's
//! tensors (the contract is in the `graph` module's documentation), run on spattn's stream
//! ordered with the caller's, and the graph built on a GPU from an edge list there.

use std::sync::Arc;

use spattn::ops::backward::{self as gpu_backward, GatBackward, GatForward, GatKernels};
use spattn::ops::backward::{Gatv2Grads, Gatv2Operands};
use spattn::ops::{BuildReport, DeviceEdges, DeviceIds, DeviceIndex, GraphSpec};
use spattn::ops::{ExternalMatrix, ExternalVec};
use spattn::{AttentionPlan, BackwardKernels, DType, DeviceGraph, Dropout, Gpu, Reorder, Shape};

use crate::device;
use crate::extras;
use crate::graph::OnDevice;

/// The forward of `plan` on CUDA tensors at `[q, k, v, out]`, ordered with `stream`; with
/// `lse` (non-zero) it keeps the row statistics there where the plan can, and says whether it
/// did.
pub(crate) fn gpu_forward<T: DType>(
    d: &OnDevice,
    plan: &AttentionPlan,
    [q, k, v, out]: [u64; 4],
    stream: u64,
    lse: u64,
) -> spattn::Result<bool> {
    let gpu = &d.device.gpu;
    let (sq, skv) = (plan.shape_q(), plan.shape_kv());
    // SAFETY: (views and bridge) the package passes `data_ptr()`s of contiguous CUDA tensors
    // of T on this device with exactly these element counts (checked there on every call;
    // here only null and alignment, sparing the driver's queries per call); the tensors stay
    // referenced by the caller for the call, and their
    // memory is recycled by PyTorch's caching allocator only in the order of `stream`, which
    // `run` makes wait for every launch below. `out` is a fresh tensor: no other reader or
    // writer. The kernels read Q (n_rows·heads·head_dim), K and V (n_cols·heads·head_dim) and
    // write out (n_rows·heads·head_dim): the views' lengths, which `forward` checks against
    // the plan's shapes; lse (where given: a fresh f32 tensor of n_rows·heads, the view's
    // length, which `row_stats_in` checks) is written at (row, head) < n_rows·heads. The views
    // are dropped at the end of this function, never moved out of. `stream` is the current
    // stream of this device's primary context (the caller's
    // `torch.cuda.current_stream(device).cuda_stream`).
    unsafe {
        let (q, k, v) = extras::qkv_views::<T>(d, sq, skv, [q, k, v])?;
        let mut out = ExternalMatrix::<T>::new_trusted(gpu, "out", out, sq)?;
        let mut stats = match lse {
            0 => None,
            at => Some(plan.row_stats_in(lse_view(gpu, plan, at)?, false)?),
        };
        d.device.bridge.run(stream, || match &mut stats {
            None => plan.forward(&q, &k, &v, &mut out).map(|()| false),
            Some(stats) => plan
                .forward_keeping_stats(&q, &k, &v, &mut out, stats)
                .map(|()| stats.is_kept()),
        })
    }
}

/// A view of the `n_rows × heads` f32 of row statistics at `at`.
///
/// # Safety
/// `at` is the address of a contiguous f32 CUDA tensor of that many elements on the plan's
/// device, kept alive by the caller for the call.
unsafe fn lse_view(gpu: &Gpu, plan: &AttentionPlan, at: u64) -> spattn::Result<ExternalVec<f32>> {
    let n = plan.shape_q().rows * plan.shape_q().heads;
    // SAFETY: the caller's contract.
    Ok(unsafe { ExternalVec::<f32>::new_trusted(gpu, "lse", at, n) }?)
}

/// The backward of `plan` on CUDA tensors at `[q, k, v, out, d_out, dq, dk, dv]`, ordered
/// with `stream`; returns ∂L/∂scale where `d_scale` (downloaded: the call waits for spattn's
/// stream), NaN otherwise (nothing waits). `lse`: the row statistics of the forward (0: none;
/// read only where the plan keeps them).
pub(crate) fn gpu_backward_call<T: DType>(
    d: &OnDevice,
    plan: &AttentionPlan,
    [q, k, v, out, d_out, dq, dk, dv]: [u64; 8],
    stream: u64,
    d_scale: bool,
    lse: u64,
) -> spattn::Result<f64> {
    let gpu = &d.device.gpu;
    let (sq, skv) = (plan.shape_q(), plan.shape_kv());
    // SAFETY: as in `gpu_forward`; the kernels read Q, out, d_out (n_rows rows) and K, V
    // (n_cols rows) and write dQ (n_rows rows), dK and dV (n_cols rows), each of heads·head_dim
    // elements: the views' lengths, checked by `backward` against the plan's shapes; lse
    // (where given and the plan keeps statistics: a contiguous f32 tensor of n_rows·heads on
    // this device, checked by the package) is read at (row, head) < n_rows·heads, the view's
    // length. dQ, dK, dV are fresh tensors.
    unsafe {
        let (q, k, v) = extras::qkv_views::<T>(d, sq, skv, [q, k, v])?;
        let out = ExternalMatrix::<T>::new_trusted(gpu, "out", out, sq)?;
        let d_out = ExternalMatrix::<T>::new_trusted(gpu, "d_out", d_out, sq)?;
        let mut dq = ExternalMatrix::<T>::new_trusted(gpu, "dq", dq, sq)?;
        let mut dk = ExternalMatrix::<T>::new_trusted(gpu, "dk", dk, skv)?;
        let mut dv = ExternalMatrix::<T>::new_trusted(gpu, "dv", dv, skv)?;
        // The statistics where this plan keeps them: the forward's plan, or one rebuilt since
        // (whose statistics, by the caller's row, are the same; the package passes `lse` only
        // where the forward kept them).
        let stats = match lse {
            at if at != 0 && plan.keeps_row_stats::<T>() => {
                Some(plan.row_stats_in(lse_view(gpu, plan, at)?, true)?)
            }
            _ => None,
        };
        let grads = (&mut *dq, &mut *dk, &mut *dv);
        d.device.bridge.run(stream, || match (&stats, d_scale) {
            (None, true) => plan
                .backward(&q, &k, &v, &out, &d_out, grads.0, grads.1, grads.2)
                .map(f64::from),
            (None, false) => plan
                .backward_grads(&q, &k, &v, &out, &d_out, grads.0, grads.1, grads.2)
                .map(|()| f64::NAN),
            (Some(s), true) => plan
                .backward_with_stats(
                    BackwardKernels::default(),
                    &q,
                    &k,
                    &v,
                    &out,
                    &d_out,
                    s,
                    grads,
                )
                .map(f64::from),
            (Some(s), false) => plan
                .backward_grads_with_stats(&q, &k, &v, &out, &d_out, s, grads)
                .map(|()| f64::NAN),
        })
    }
}

/// x, alpha_dst, alpha_src viewed in place, and the per-edge workspace length.
type GatViews<T> = (
    ExternalMatrix<T>,
    ExternalMatrix<f32>,
    ExternalMatrix<f32>,
    usize,
);

/// GAT's inputs viewed in place: x (n_cols × heads × dim of T), alpha_dst (n_rows × heads
/// f32), alpha_src (n_cols × heads f32); and the per-edge workspace length, nnz × heads.
///
/// # Safety
/// [`ExternalMatrix::new`]'s contract for the three addresses (see `gat_forward_gpu`).
unsafe fn gat_views<T: DType>(
    d: &OnDevice,
    sq: Shape,
    skv: Shape,
    [x, a_dst, a_src]: [u64; 3],
) -> spattn::Result<GatViews<T>> {
    let gpu = &d.device.gpu;
    let h = sq.heads;
    let (per_dst, per_src) = (Shape::new(sq.rows, h, 1)?, Shape::new(skv.rows, h, 1)?);
    // SAFETY: the caller's contract, for exactly these shapes.
    unsafe {
        Ok((
            ExternalMatrix::new_trusted(gpu, "x", x, skv)?,
            // Read element by element by every GAT kernel: 4-byte aligned suffices (a slice of
            // the layer's two-vector scores tensor).
            ExternalMatrix::new_trusted_element_aligned(gpu, "alpha_dst", a_dst, per_dst)?,
            ExternalMatrix::new_trusted_element_aligned(gpu, "alpha_src", a_src, per_src)?,
            d.graph.nnz() * h,
        ))
    }
}

/// The package's name for a GAT kernel set (`"fused"` names a backward only), checked.
pub(crate) fn parse_gat_kernels(name: &str, forward: bool) -> Option<GatKernels> {
    match name {
        "composed" => Some(GatKernels::Composed),
        "fused" if !forward => Some(GatKernels::Fused),
        "rows" => Some(GatKernels::Rows),
        _ => None,
    }
}

/// The GAT forward on CUDA tensors at `[x, a_dst, a_src, out, workspace, bias]` (bias 0 for
/// none), ordered with `stream`: the workspace holds `nnz × heads` f32 (composed) or the row
/// statistics' `n_rows × heads` f32 (rows), followed with dropout by the rows kernels' mask
/// ([`gpu_backward::dropout_mask_words`] u32).
pub(crate) fn gat_forward_gpu<T: DType>(
    d: &OnDevice,
    sq: Shape,
    skv: Shape,
    (slope, dropout): (f32, Option<Dropout>),
    kernels: GatKernels,
    [x, a_dst, a_src, out, ws, bias]: [u64; 6],
    stream: u64,
) -> spattn::Result<()> {
    let gpu = &d.device.gpu;
    let h = sq.heads;
    let mask_len = match (kernels, &dropout) {
        (GatKernels::Rows, Some(_)) => gpu_backward::dropout_mask_words(d.graph.nnz(), h)?,
        _ => 0,
    };
    let ws_len = match kernels {
        GatKernels::Rows => sq.rows * h,
        _ => d.graph.nnz() * h,
    };
    // SAFETY: as in `gpu_forward`, for x (n_cols × heads × dim of T), a_dst (n_rows × heads
    // f32), a_src (n_cols × heads f32), out (n_rows × heads × dim of T, fresh) and the
    // workspace (ws_len f32 and, for the rows kernels with dropout, mask_len u32 after them,
    // fresh) and the bias (nnz × heads f32 where given, read at
    // [e · heads + h]). The kernels read a_dst / a_src at [row · heads + h]
    // / [col · heads + h] (rows < n_rows, cols < n_cols: the validated CSR), write and read
    // the workspace within ws_len (each op checks its length), read x's rows < n_cols and
    // write out's rows < n_rows: within the views, whose shapes each op checks.
    unsafe {
        let (x, a_dst, a_src, edges) = gat_views::<T>(d, sq, skv, [x, a_dst, a_src])?;
        let mut out = ExternalMatrix::<T>::new_trusted(gpu, "out", out, sq)?;
        let mut p = ExternalVec::<f32>::new_trusted(gpu, "workspace", ws, ws_len)?;
        // Right after the n_rows × heads statistics: only 4-byte aligned, and the rows
        // kernels read and write the mask a u32 at a time.
        let mask_at = ws + 4 * ws_len as u64;
        let mut mask = (mask_len > 0)
            .then(|| {
                ExternalVec::<u32>::new_trusted_element_aligned(
                    gpu,
                    "dropout mask",
                    mask_at,
                    mask_len,
                )
            })
            .transpose()?;
        let bias =
            ExternalVec::<f32>::new_trusted(gpu, "bias", bias, if bias == 0 { 0 } else { edges })?;
        d.device.bridge.run(stream, || -> spattn::Result<()> {
            let a = d.graph.csr()?;
            // A graph seen once walks its units as numbered (no host work).
            let walk = match kernels {
                GatKernels::Rows => d.graph.unit_walk(Reorder::Auto)?,
                _ => Arc::default(),
            };
            let terms = gpu_backward::GatScoreTerms {
                a_dst: &a_dst,
                a_src: &a_src,
                bias: (!bias.is_empty()).then_some(&*bias),
                slope,
                dropout: dropout.as_ref(),
            };
            let ws = match kernels {
                GatKernels::Rows => GatForward::Rows {
                    lse: &mut p,
                    mask: mask.as_deref_mut(),
                    walk: &walk,
                },
                _ => GatForward::Composed(&mut p),
            };
            gpu_backward::gat_forward(gpu, a, terms, &x, ws, &mut out)?;
            Ok(())
        })
    }
}

/// The GAT backward on CUDA tensors at `[x, a_dst, a_src, d_out, dx, da_dst, da_src, bias,
/// d_bias, out]` (the bias's 0 for none; `out`, the forward's output, read by the rows
/// kernels only), ordered with `stream`: the fused backward
/// ([`GatBackward::Fused`]: two passes, no per-edge buffer), the rows kernels
/// ([`GatBackward::Rows`]; `workspaces` = dS's `nnz × heads` f32, the row
/// statistics' `n_rows × heads` f32 (where `lse_kept`, the rows forward's workspace: its
/// statistics and, with dropout, its mask right after them) and with dropout the masks to draw,
/// of [`gpu_backward::dropout_mask_words`] u32 each: A's and Aᵀ's, or Aᵀ's alone where kept),
/// or the
/// composed steps, which recompute the scores and
/// probabilities in the three `nnz × heads` f32 `workspaces`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gat_backward_gpu<T: DType>(
    d: &OnDevice,
    sq: Shape,
    skv: Shape,
    (slope, dropout): (f32, Option<Dropout>),
    (kernels, lse_kept): (GatKernels, bool),
    [x, a_dst, a_src, d_out, dx, da_dst, da_src, bias, d_bias, out]: [u64; 10],
    workspaces: [u64; 3],
    stream: u64,
) -> spattn::Result<()> {
    let gpu = &d.device.gpu;
    let h = sq.heads;
    // SAFETY: as in `gat_forward_gpu`; d_out (and out, for the rows kernels) is n_rows × heads
    // × dim of T; dx (n_cols rows of T), da_dst (n_rows × heads f32), da_src (n_cols × heads
    // f32), the workspaces (their lengths above, by kernels; the rows kernels' third, with
    // dropout, one or two masks' words of u32) and d_bias (nnz × heads f32, where the forward
    // had a bias) are fresh, but for a kept lse (read only), which with dropout holds the
    // mask's words after its n_rows × heads f32 (checked by spattn.functional's
    // gat_backward). The transposed ops index Aᵀ's rows (< n_cols) and its edge map (a
    // permutation of the nnz edges), within the same views.
    unsafe {
        let (x, a_dst, a_src, edges) = gat_views::<T>(d, sq, skv, [x, a_dst, a_src])?;
        let d_out = ExternalMatrix::<T>::new_trusted(gpu, "d_out", d_out, sq)?;
        let mut dx = ExternalMatrix::<T>::new_trusted(gpu, "dx", dx, skv)?;
        // Written element by element by every GAT backward (a lead lane's store per (row,
        // head), the split rows' merge, a 4-byte memset): 4-byte aligned suffices (the halves
        // of the layer's two-vector gradient tensor).
        let mut da_dst = ExternalMatrix::<f32>::new_trusted_element_aligned(
            gpu,
            "d_alpha_dst",
            da_dst,
            a_dst.shape(),
        )?;
        let mut da_src = ExternalMatrix::<f32>::new_trusted_element_aligned(
            gpu,
            "d_alpha_src",
            da_src,
            a_src.shape(),
        )?;
        let blen = if bias == 0 { 0 } else { edges };
        let bias = ExternalVec::<f32>::new_trusted(gpu, "bias", bias, blen)?;
        let mut d_bias = ExternalVec::<f32>::new_trusted(gpu, "d_bias", d_bias, blen)?;
        let view = |at, len| ExternalVec::<f32>::new_trusted(gpu, "workspace", at, len);
        let [w0, w1, w2] = workspaces;
        let (mut ws, mut rows_ws, out) = match kernels {
            GatKernels::Composed => (
                Some([view(w0, edges)?, view(w1, edges)?, view(w2, edges)?]),
                None,
                None,
            ),
            GatKernels::Fused => (None, None, None),
            GatKernels::Rows => (
                None,
                Some([view(w0, edges)?, view(w1, sq.rows * h)?]),
                Some(ExternalMatrix::<T>::new_trusted(gpu, "out", out, sq)?),
            ),
        };
        // With dropout: (the forward's kept mask, the masks to draw).
        let (kept_mask, mut draw_mask) = match (kernels, &dropout) {
            (GatKernels::Rows, Some(_)) => {
                let nnz = d.graph.nnz();
                let draw = gpu_backward::KeepBits::draw_words(nnz, h, lse_kept)?;
                let draw = Some(ExternalVec::<u32>::new_trusted(
                    gpu,
                    "dropout mask",
                    w2,
                    draw,
                )?);
                let kept = match lse_kept {
                    // Right after the forward's n_rows × heads statistics, only 4-byte aligned
                    // (the kernels read it a u32 at a time).
                    true => Some(ExternalVec::<u32>::new_trusted_element_aligned(
                        gpu,
                        "kept dropout mask",
                        w1 + 4 * (sq.rows * h) as u64,
                        gpu_backward::dropout_mask_words(nnz, h)?,
                    )?),
                    false => None,
                };
                (kept, draw)
            }
            _ => (None, None),
        };
        d.device.bridge.run(stream, || -> spattn::Result<()> {
            let (a, t) = (d.graph.csr()?, d.graph.transpose()?);
            let terms = gpu_backward::GatScoreTerms {
                a_dst: &a_dst,
                a_src: &a_src,
                bias: (blen > 0).then_some(&*bias),
                slope,
                dropout: dropout.as_ref(),
            };
            let grads = gpu_backward::GatGrads {
                dx: &mut dx,
                d_dst: &mut da_dst,
                d_src: &mut da_src,
                d_bias: (blen > 0).then_some(&mut *d_bias),
            };
            let walk = match rows_ws {
                Some(_) => d.graph.unit_walk(Reorder::Auto)?,
                None => Arc::default(),
            };
            let ws = match (&mut ws, &mut rows_ws, &out) {
                (Some([s, p, dp]), _, _) => GatBackward::Composed([&mut **s, &mut **p, &mut **dp]),
                (_, Some([ds, lse]), Some(out)) => GatBackward::Rows {
                    out,
                    lse: match lse_kept {
                        true => gpu_backward::RowStats::Kept(lse),
                        false => gpu_backward::RowStats::Recompute(lse),
                    },
                    ds,
                    mask: gpu_backward::KeepBits::of(
                        kept_mask.as_deref(),
                        draw_mask.as_deref_mut(),
                    ),
                    walk: &walk,
                },
                _ => GatBackward::Fused,
            };
            gpu_backward::gat_backward(gpu, (a, t), terms, (&x, &d_out), ws, grads)?;
            Ok(())
        })
    }
}

/// GATv2's operands viewed in place: xl (n_cols × heads × dim of T), xr (n_rows × heads × dim),
/// att (heads · dim f32) and the edge features (nnz × heads × dim; `None` for address 0).
type Gatv2Views<T> = (
    ExternalMatrix<T>,
    ExternalMatrix<T>,
    ExternalVec<f32>,
    Option<ExternalMatrix<T>>,
);

/// # Safety
/// [`ExternalMatrix::new`]'s contract for the addresses, at the shapes named above.
unsafe fn gatv2_views<T: DType>(
    d: &OnDevice,
    sq: Shape,
    skv: Shape,
    [xl, xr, att, ef]: [u64; 4],
) -> spattn::Result<Gatv2Views<T>> {
    let gpu = &d.device.gpu;
    let per_edge = Shape::new(d.graph.nnz(), sq.heads, sq.head_dim)?;
    // SAFETY: the caller's contract, for exactly these shapes.
    unsafe {
        Ok((
            ExternalMatrix::new_trusted(gpu, "x_l", xl, skv)?,
            ExternalMatrix::new_trusted(gpu, "x_r", xr, sq)?,
            ExternalVec::new_trusted(gpu, "att", att, sq.heads * sq.head_dim)?,
            if ef == 0 {
                None
            } else {
                Some(ExternalMatrix::new_trusted(
                    gpu,
                    "edge_features",
                    ef,
                    per_edge,
                )?)
            },
        ))
    }
}

/// GATv2's forward (PyG's `GATv2Conv`) on CUDA tensors at `[xl, xr, att, ef, out, workspace]`
/// (ef 0 for none), ordered with `stream`: scores `att · LeakyReLU(xl[j] + xr[i] (+ ef))` per
/// edge and head (no per-edge feature sum stored), their softmax per target, dropout, and
/// `out[i] = Σ_j P · xl[j]`.
pub(crate) fn gatv2_forward_gpu<T: DType>(
    d: &OnDevice,
    sq: Shape,
    skv: Shape,
    (slope, dropout): (f32, Option<Dropout>),
    [xl, xr, att, ef, out, ws]: [u64; 6],
    stream: u64,
) -> spattn::Result<()> {
    let gpu = &d.device.gpu;
    let h = sq.heads;
    // SAFETY: as in `gpu_forward`, for xl (n_cols × heads × dim of T), xr (n_rows rows), att
    // (heads·dim f32), ef (nnz × heads × dim where given), out (n_rows rows of T, fresh) and
    // the workspace (nnz × heads f32, fresh). The kernels read xl's rows < n_cols, xr's rows
    // < n_rows and ef's rows < nnz (the validated CSR), write and read the workspace at
    // [e · heads + h], e < nnz, and write out's rows < n_rows: within the views, whose shapes
    // each op checks.
    unsafe {
        let (xl, xr, att, ef) = gatv2_views::<T>(d, sq, skv, [xl, xr, att, ef])?;
        let mut out = ExternalMatrix::<T>::new_trusted(gpu, "out", out, sq)?;
        let mut p = ExternalVec::<f32>::new_trusted(gpu, "workspace", ws, d.graph.nnz() * h)?;
        d.device.bridge.run(stream, || -> spattn::Result<()> {
            let ops = Gatv2Operands {
                xl: &xl,
                xr: &xr,
                ef: ef.as_deref(),
                att: &att,
                slope,
            };
            let a = d.graph.csr()?;
            gpu_backward::gatv2_forward(gpu, a, &ops, dropout.as_ref(), &mut p, &mut out)?;
            Ok(())
        })
    }
}

/// GATv2's exact backward on CUDA tensors at `[xl, xr, att, ef, d_out, d_xl, d_xr,
/// d_att_rows, d_ef]` (ef and d_ef 0 for none) with three `nnz × heads` f32 workspaces,
/// ordered with `stream`: the scores and probabilities recomputed, ∂L/∂score by the softmax
/// backward, then one pass over A (∂xr, ∂ef, each row's share of ∂att into `d_att_rows`,
/// `n_rows × heads × dim` f32) and, after the aggregation's `Pᵀ · dOut`, one over Aᵀ (the
/// scores' share of ∂xl). No atomics, no per-edge feature tensor.
pub(crate) fn gatv2_backward_gpu<T: DType>(
    d: &OnDevice,
    sq: Shape,
    skv: Shape,
    (slope, dropout): (f32, Option<Dropout>),
    [xl, xr, att, ef, d_out, d_xl, d_xr, d_att_rows, d_ef]: [u64; 9],
    [w0, w1, w2]: [u64; 3],
    stream: u64,
) -> spattn::Result<()> {
    let gpu = &d.device.gpu;
    let h = sq.heads;
    let edges = d.graph.nnz() * h;
    // SAFETY: as in `gatv2_forward_gpu`; d_out is n_rows × heads × dim of T; d_xl (n_cols
    // rows), d_xr (n_rows rows), d_att_rows (n_rows·heads·dim f32), d_ef (nnz rows where ef
    // is given) and the three workspaces (nnz × heads f32) are fresh. The transposed passes
    // index Aᵀ's rows (< n_cols) and its edge map (a permutation of the nnz edges), within the
    // same views.
    unsafe {
        let (xl, xr, att, ef) = gatv2_views::<T>(d, sq, skv, [xl, xr, att, ef])?;
        let d_out = ExternalMatrix::<T>::new_trusted(gpu, "d_out", d_out, sq)?;
        let mut d_xl = ExternalMatrix::<T>::new_trusted(gpu, "d_x_l", d_xl, skv)?;
        let mut d_xr = ExternalMatrix::<T>::new_trusted(gpu, "d_x_r", d_xr, sq)?;
        let mut d_att = ExternalVec::<f32>::new_trusted(gpu, "d_att_rows", d_att_rows, sq.len())?;
        let mut d_ef = match (&ef, d_ef) {
            (Some(e), p) if p != 0 => Some(ExternalMatrix::<T>::new_trusted(
                gpu,
                "d_edge_features",
                p,
                e.shape(),
            )?),
            _ => None,
        };
        let mut s = ExternalVec::<f32>::new_trusted(gpu, "workspace", w0, edges)?;
        let mut p = ExternalVec::<f32>::new_trusted(gpu, "workspace", w1, edges)?;
        let mut dp = ExternalVec::<f32>::new_trusted(gpu, "workspace", w2, edges)?;
        d.device.bridge.run(stream, || -> spattn::Result<()> {
            let (a, t) = (d.graph.csr()?, d.graph.transpose()?);
            let ops = Gatv2Operands {
                xl: &xl,
                xr: &xr,
                ef: ef.as_deref(),
                att: &att,
                slope,
            };
            let grads = Gatv2Grads {
                d_xl: &mut d_xl,
                d_xr: &mut d_xr,
                d_att_rows: &mut d_att,
                d_ef: d_ef.as_deref_mut(),
            };
            let ws = [&mut *s, &mut *p, &mut *dp];
            let drop = dropout.as_ref();
            gpu_backward::gatv2_backward(gpu, (a, t), &ops, drop, &d_out, ws, grads)?;
            Ok(())
        })
    }
}

/// A graph built on `d` from the edge ids at `(src, dst)` (`n_edges` of `I` each, at the
/// element strides given), positions into `positions` where non-zero, ordered with `stream`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn build_on_device<I: DeviceIndex>(
    d: &device::Device,
    (src, dst): (u64, u64),
    (src_stride, dst_stride): (usize, usize),
    n_edges: usize,
    spec: &GraphSpec,
    positions: u64,
    stream: u64,
) -> spattn::Result<(DeviceGraph, BuildReport)> {
    let gpu = &d.gpu;
    let span = |stride| DeviceIds::<I>::span("edge_index span", n_edges, stride);
    // SAFETY: the package passes the data addresses of `edge_index`'s two rows (a CUDA int32 or
    // int64 tensor on this device, alive for the call; `src_stride` / `dst_stride` its row's
    // element stride, so `span` elements from each address lie in the tensor) and, where
    // non-zero, of a fresh int64 tensor of `n_edges` elements (plus one per node with self
    // loops) for the positions. The build
    // runs on spattn's stream after `stream`'s work (the bridge), and the tensors' memory is
    // recycled only in `stream`'s order, which waits for the build; the views are dropped at
    // the end of this function. The kernels read ids `i · stride` for i < n_edges and write
    // positions[i] for i < n_edges (+ nodes with self loops).
    unsafe {
        let s =
            ExternalVec::<I>::new_element_aligned(gpu, "edge_index[0]", src, span(src_stride)?)?;
        let t =
            ExternalVec::<I>::new_element_aligned(gpu, "edge_index[1]", dst, span(dst_stride)?)?;
        let loops = if spec.self_loops { spec.n_rows } else { 0 };
        let mut pos = if positions == 0 {
            None
        } else {
            Some(ExternalVec::<i64>::new_trusted(
                gpu,
                "positions",
                positions,
                n_edges + loops,
            )?)
        };
        let edges = DeviceEdges {
            sources: DeviceIds::strided(&s, src_stride)?,
            targets: DeviceIds::strided(&t, dst_stride)?,
            len: n_edges,
        };
        d.bridge.run(stream, || {
            DeviceGraph::from_device_edges_in(
                gpu,
                &edges,
                spec,
                pos.as_deref_mut(),
                &d.plan_workspace,
            )
            .map_err(spattn::Error::from)
        })
    }
}
