//! GAT's attention walked from row statistics, forward and backward, with no per-edge buffer of
//! probabilities (kernels `gat_row_stats_csr`, `gat_aggregate_*`, `gat_grad_rows_*` in
//! csr_ops.cu). `P_ij = exp(LeakyReLU(s_ij) − lse_i)` is recomputed wherever it is needed from
//! the per-node terms and `lse` (`n_rows × heads` f32), which one light pass over A's column
//! indices leaves ([`gat_row_stats`]):
//!
//! - forward ([`gat_forward_rows`]): the statistics, then `out = P · x` over A's SpMM units;
//! - backward ([`gat_backward_rows`]): the statistics, a pass over A's units that forms each
//!   edge's `dS = L' P (⟨dOut_i, x_j⟩ − D_i)` with `D_i = ⟨dOut_i, out_i⟩` read from the
//!   forward's output (FlashAttention's identity), sums `∂a_dst` per row and writes `dS` in
//!   Aᵀ's order, then a pass over Aᵀ's units: `dx = Pᵀ · dOut` and `∂a_src` = the column sums
//!   of `dS`.
//!
//! Dropout: the kept elements are drawn into bit masks (`dropout_keep_bits`, the same draws as
//! every other kernel's; [`dropout_mask_words`] u32 each, in the caller's workspace), one in
//! the order of each pass: A's by the forward, which the backward takes back
//! ([`KeepBits::Kept`]) or draws again, and Aᵀ's by the backward for its pass over Aᵀ (read
//! there in sequence; gathering A's bits through the edge map cost that pass more than the
//! draw). The `_drop` variants of the feature passes read them (a Philox generator inside them
//! cost more registers than the composed steps save).
//!
//! Every pass is shaped like the SpMM (four edges in flight per lane, units of at most 64
//! edges); split rows' partials are added in order by a finalize kernel: no floating-point
//! atomics, the same bits every run. Device memory beyond the outputs: the caller's `lse` and
//! `nnz × heads` f32 `dS`, and the graph's split-unit scratch (grown once, kept).

use cudarc::driver::LaunchArgs;
use spattn_kernels_sys::CSR_OPS;

use crate::buffer::{grown, DeviceMatrix, DeviceVec};
use crate::csr_ops::{finalize_split_rows, group_grid, UnitWalk};
use crate::device_csr::DeviceCsr;
use crate::dropout::DropoutWords;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{
    check_same_gpu, kernel_named, launch, product, to_u32, LaunchConfig, PushKernelArg,
    PushOptionalArg,
};
use crate::schedule::vector_width;
use crate::shape::Shape;

use super::fused::check_transpose;
use super::keep_bits::{draw_keep_bits, dropout_mask_words};
use super::{DeviceTranspose, GatGrads, GatScoreTerms};

/// The lane layout of the feature passes: `(vec, hl, g, tiles)`: vectors of `vec` features,
/// `hl` lanes a head (a power of two ≥ `head_dim / vec`), groups of `g` lanes holding `g / hl`
/// heads, `tiles` groups a unit (grid y). `None` when a head needs more than 32 lanes.
fn lanes(heads: usize, head_dim: usize, elem_bytes: usize) -> Option<(u32, u32, u32, u32)> {
    if heads == 0 || head_dim == 0 {
        return None;
    }
    let vec = vector_width(head_dim, elem_bytes);
    let hl = (head_dim / vec as usize).next_power_of_two();
    if hl > 32 {
        return None;
    }
    let g = heads.saturating_mul(hl).next_power_of_two().min(32);
    let tiles = heads.div_ceil(g / hl);
    Some((vec, hl as u32, g as u32, u32::try_from(tiles).ok()?))
}

/// The aggregation kernel for `dtype` (a [`DType::NAME`]) in vectors of `vec`, over Aᵀ
/// (the backward's dx) where `transposed`, reading a dropout mask where `drop`; the
/// launch-name test forms it too.
pub(crate) fn aggregate_kernel(dtype: &str, vec: u32, transposed: bool, drop: bool) -> String {
    let t = if transposed { "_t" } else { "" };
    let d = if drop { "_drop" } else { "" };
    format!("gat_aggregate{t}{d}_csr_{dtype}_v{vec}")
}

/// The backward's pass over A for `dtype` in vectors of `vec` (with a dropout mask where
/// `drop`).
pub(crate) fn grad_rows_kernel(dtype: &str, vec: u32, drop: bool) -> String {
    let d = if drop { "_drop" } else { "" };
    format!("gat_grad_rows{d}_csr_{dtype}_v{vec}")
}

/// The dropout masks the rows kernels' backward
/// ([`GatBackward::Rows`](super::GatBackward::Rows)) reads, [`dropout_mask_words`] u32 each:
/// A's order (the pass over A) and Aᵀ's (the pass over Aᵀ, always drawn by the backward).
#[derive(Debug)]
pub enum KeepBits<'a> {
    /// Both drawn by the backward into this workspace (twice the words: A's mask, then Aᵀ's).
    Draw(&'a mut DeviceVec<u32>),
    /// A's mask kept from the rows forward ([`GatForward::Rows`](super::GatForward::Rows)) with
    /// the same graph, heads and dropout;
    /// Aᵀ's drawn into the workspace.
    Kept {
        /// The forward's mask, read.
        a: &'a DeviceVec<u32>,
        /// Aᵀ's mask, written.
        t: &'a mut DeviceVec<u32>,
    },
}

impl<'a> KeepBits<'a> {
    /// The masks of a backward with dropout from its workspace `draw` (`None`: no dropout):
    /// A's kept from the forward where `kept` is given (Aᵀ's drawn into `draw`), else both
    /// drawn into `draw`.
    pub fn of(
        kept: Option<&'a DeviceVec<u32>>,
        draw: Option<&'a mut DeviceVec<u32>>,
    ) -> Option<Self> {
        let draw = draw?;
        Some(match kept {
            Some(a) => Self::Kept { a, t: draw },
            None => Self::Draw(draw),
        })
    }

    /// The u32 words [`of`](Self::of)'s `draw` takes on a graph of `nnz` edges and `heads`:
    /// Aᵀ's mask where A's is `kept`, else both.
    ///
    /// Errors: [`Error::InvalidArgument`] where the count overflows `usize`.
    pub fn draw_words(nnz: usize, heads: usize, kept: bool) -> Result<usize> {
        product(
            "dropout masks",
            &[dropout_mask_words(nnz, heads)?, if kept { 1 } else { 2 }],
        )
    }
}

/// The words a dropout mask holds, or `None` where there is none to draw or read (no
/// dropout, no edge or no head).
fn mask_words(a: &DeviceCsr, heads: usize, terms: &GatScoreTerms<'_>) -> Result<Option<usize>> {
    if DropoutWords::of(terms.dropout).threshold == 0 {
        return Ok(None);
    }
    let words = dropout_mask_words(a.nnz(), heads)?;
    Ok((words > 0).then_some(words))
}

/// `mask` checked (present with dropout, `copies` × [`dropout_mask_words`] long, on `gpu`),
/// or `None` where no mask is needed.
fn checked_mask<M: std::ops::Deref<Target = DeviceVec<u32>>>(
    gpu: &Gpu,
    (a, heads, terms): (&DeviceCsr, usize, &GatScoreTerms<'_>),
    mask: Option<M>,
    copies: usize,
) -> Result<Option<M>> {
    let Some(words) = mask_words(a, heads, terms)? else {
        return Ok(None);
    };
    let expected = product("dropout mask", &[words, copies])?;
    let Some(mask) = mask else {
        return Err(Error::InvalidArgument {
            what: "dropout mask",
            why: format!("dropout needs a mask workspace of {expected} u32 (dropout_mask_words)"),
        });
    };
    if mask.len() != expected {
        return Err(Error::LengthMismatch {
            what: "dropout mask",
            expected,
            actual: mask.len(),
        });
    }
    check_same_gpu(gpu, "dropout mask", &*mask)?;
    Ok(Some(mask))
}

/// Errors unless `lse` holds `n_rows × heads` f32 on `gpu`.
fn check_lse(gpu: &Gpu, a: &DeviceCsr, heads: usize, lse: &DeviceVec<f32>) -> Result<()> {
    let expected = product("rows x heads", &[a.n_rows(), heads])?;
    if lse.len() != expected {
        return Err(Error::LengthMismatch {
            what: "lse",
            expected,
            actual: lse.len(),
        });
    }
    check_same_gpu(gpu, "lse", lse)
}

/// The vector width of the feature passes for `head_dim` features of `elem_bytes`, where they
/// take it (the launch-name test's view of [`lanes`]).
#[cfg(test)]
pub(crate) fn feature_vector(head_dim: usize, elem_bytes: usize) -> Option<u32> {
    lanes(1, head_dim, elem_bytes).map(|l| l.0)
}

/// Whether [`gat_forward_rows`] and [`gat_backward_rows`] take heads of `head_dim` features of
/// `T`: a head's vectors fit one warp (up to 256 features of 16-bit types, 128 of f32, and
/// every odd width up to 32).
pub(crate) fn gat_rows_supports<T: DType>(head_dim: usize) -> bool {
    lanes(1, head_dim, std::mem::size_of::<T>()).is_some()
}

/// The statistics pass's layout for `heads`: `(hl, g, tiles)`, `hl` lanes striding over a
/// unit's edges per head.
fn stats_lanes(heads: usize) -> (u32, u32, u32) {
    let hl = (32 / heads.next_power_of_two().min(32)) as u32;
    let per = 32 / hl as usize;
    (hl, 32, heads.div_ceil(per) as u32)
}

/// Pushes the walk of a CSR's units every pass starts with: unit rows, starts, partials, the
/// count, the order they are walked in (null: as numbered) and the entries' indices.
fn push_walk<'a>(
    args: &mut LaunchArgs<'a>,
    [rows, starts, parts]: [&'a DeviceVec<u32>; 3],
    (n_units, order): (&'a u32, Option<&'a DeviceVec<u32>>),
    entries: &'a DeviceVec<u32>,
) {
    args.arg(rows.slice())
        .arg(starts.slice())
        .arg(parts.slice())
        .arg(n_units)
        .arg_or_null(order)
        .arg(entries.slice());
}

/// Pushes the feature passes' lane layout (`heads, head_dim, g, hl`) and the score terms.
fn push_lanes<'a>(
    args: &mut LaunchArgs<'a>,
    [heads, head_dim, g, hl]: &'a [u32; 4],
    terms: &'a GatScoreTerms<'a>,
    drop: &'a DropoutWords,
) {
    args.arg(heads).arg(head_dim).arg(g).arg(hl);
    push_terms(args, terms, drop);
}

/// Pushes the score terms' kernel arguments (`SPATTN_GAT_SCORES_ARGS`).
fn push_terms<'a>(args: &mut LaunchArgs<'a>, terms: &'a GatScoreTerms<'a>, drop: &'a DropoutWords) {
    args.arg(terms.a_dst.slice())
        .arg(terms.a_src.slice())
        .arg_or_null(terms.bias)
        .arg(&terms.slope);
    drop.push(args);
}

/// Checks the score terms against `a` and `heads`: shapes, the bias's length and the GPU.
fn check_terms(gpu: &Gpu, a: &DeviceCsr, heads: usize, terms: &GatScoreTerms<'_>) -> Result<()> {
    Shape::new(a.n_rows(), heads, 1)?.expect_eq("a_dst", terms.a_dst.shape())?;
    Shape::new(a.n_cols(), heads, 1)?.expect_eq("a_src", terms.a_src.shape())?;
    check_same_gpu(gpu, "A", a)?;
    check_same_gpu(gpu, "a_dst", terms.a_dst)?;
    check_same_gpu(gpu, "a_src", terms.a_src)?;
    if let Some(b) = terms.bias {
        edge_len(a, heads, "bias", b.len())?;
        check_same_gpu(gpu, "bias", b)?;
    }
    Ok(())
}

/// Errors unless `len` is `nnz × heads`.
fn edge_len(a: &DeviceCsr, heads: usize, what: &'static str, len: usize) -> Result<()> {
    let expected = product("edges x heads", &[a.nnz(), heads])?;
    if len == expected {
        return Ok(());
    }
    Err(Error::LengthMismatch {
        what,
        expected,
        actual: len,
    })
}

/// `lse[i, h] = log Σ_j exp(LeakyReLU(s_ij))` over each row of `a` (0 for a row without
/// edges), `lse` being `n_rows × heads` f32: the row statistics the other passes recompute the
/// probabilities from. Reads only A's column indices and the score terms. The units are walked
/// in `walk`'s order (the same bits in any).
///
/// Errors: [`Error::ShapeMismatch`] / [`Error::LengthMismatch`] naming the operand (the walk
/// included), [`Error::ForeignGpu`], [`Error::OutOfMemory`] (the split rows' scratch).
pub(crate) fn gat_row_stats(
    gpu: &Gpu,
    (a, walk): (&DeviceCsr, &UnitWalk),
    terms: GatScoreTerms<'_>,
    lse: &mut DeviceVec<f32>,
) -> Result<()> {
    let heads = terms.a_dst.shape().heads;
    check_terms(gpu, a, heads, &terms)?;
    check_lse(gpu, a, heads, lse)?;
    if heads == 0 || a.n_rows() == 0 {
        return Ok(());
    }
    let s = a.schedule();
    let ([rows, starts, parts, split_rows, part_first], n_parts) = s.units();
    let mut guard = s.scratch().lock();
    let need = product("row-statistics partials", &[n_parts, heads, 2])?;
    let scratch = grown(gpu, &mut guard, "GAT row-statistics partials", need.max(1))?;
    let (hl, g, tiles) = stats_lanes(heads);
    let heads_u = to_u32("heads", heads)?;
    let n_units = to_u32("units", rows.len())?;
    let order = walk.rows(a)?;
    let drop = DropoutWords::of(terms.dropout);
    let name = spattn_kernels_sys::kernel!(CSR_OPS, "gat_row_stats_csr");
    let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, name)?;
    let mut args = gpu.launch_builder(&f);
    push_walk(
        &mut args,
        [rows, starts, parts],
        (&n_units, order),
        a.col_indices(),
    );
    args.arg(&heads_u).arg(&g).arg(&hl);
    push_terms(&mut args, &terms, &drop);
    args.arg(lse.slice_mut()).arg(scratch.slice_mut());
    // SAFETY: the unit arrays have n_units entries (starts n_units + 1), the walk where given
    // n_units (checked; a permutation of 0..n_units, so each names a unit), their edge ranges
    // lie in [0, nnz) (col_indices, bias at (e, head) < nnz·heads, checked); a_dst rows are unit
    // rows < n_rows, a_src rows column indices < n_cols (shapes checked); heads < `heads`
    // (lanes past them read the last head and write nothing). Writes lse at (row, head) <
    // n_rows·heads and float2 partials at (part, head) < n_parts·heads (the scratch holds
    // 2·n_parts·heads f32).
    unsafe { launch(name, &mut args, group_grid(rows.len(), g, tiles)?) }?;
    let n_split = split_rows.len();
    if n_split > 0 {
        let name = spattn_kernels_sys::kernel!(CSR_OPS, "gat_row_stats_finalize");
        let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, name)?;
        let n_split_u = to_u32("split rows", n_split)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(split_rows.slice())
            .arg(part_first.slice())
            .arg(&n_split_u)
            .arg(&heads_u)
            .arg(scratch.slice())
            .arg(lse.slice_mut());
        // SAFETY: reads split_rows[0..n_split) (< n_rows), part_first[0..=n_split] (ascending
        // to n_parts) and the partials at (part, head) < n_parts·heads float2s; writes lse at
        // (split row, head) < n_rows·heads.
        unsafe { launch(name, &mut args, group_grid(n_split * heads, 1, 1)?) }?;
    }
    Ok(())
}

/// The layout for `x`'s heads, or the error naming the head too wide.
fn feature_lanes<T: DType>(heads: usize, head_dim: usize) -> Result<(u32, u32, u32, u32)> {
    lanes(heads, head_dim, std::mem::size_of::<T>()).ok_or_else(|| Error::InvalidArgument {
        what: "head_dim",
        why: format!(
            "{head_dim} features of {} are too wide for GAT's row-statistics kernels (a head \
             must fit 32 lanes); use the composed steps",
            T::NAME
        ),
    })
}

/// GAT attention's forward from row statistics: [`gat_row_stats`] into `lse` (`n_rows ×
/// heads` f32, left for the caller), then `out = P · x` (`x`: `n_cols × heads × head_dim`,
/// `out`: `n_rows × heads × head_dim`; rows without edges get zeros) with `P =
/// softmax_row(LeakyReLU(a_dst[i] + a_src[j] + bias_e))` recomputed per edge. Two launches
/// (four with split rows), no per-edge buffer. With dropout (`terms.dropout`), `P` times the
/// dropout factor of each edge and head (the draws every kernel makes), from a mask drawn into
/// `mask` ([`dropout_mask_words`] u32; unused, and may be `None`, without dropout): one more
/// launch. The passes walk A's units in `walk`'s order (the same bits in any).
///
/// Errors: as [`gat_row_stats`]; [`Error::InvalidArgument`] for a head wider than
/// [`gat_rows_supports`] takes or dropout without `mask`; [`Error::ShapeMismatch`] naming `x`
/// or `out`, [`Error::LengthMismatch`] naming the dropout mask.
pub(crate) fn gat_forward_rows<T: DType>(
    gpu: &Gpu,
    (a, walk): (&DeviceCsr, &UnitWalk),
    terms: GatScoreTerms<'_>,
    x: &DeviceMatrix<T>,
    (lse, mask): (&mut DeviceVec<f32>, Option<&mut DeviceVec<u32>>),
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    let sx = x.shape();
    let (heads, head_dim) = (sx.heads, sx.head_dim);
    Shape::new(a.n_cols(), heads, head_dim)?.expect_eq("x", sx)?;
    Shape::new(a.n_rows(), heads, head_dim)?.expect_eq("out", out.shape())?;
    // The score terms have x's heads (the kernels index them by x's).
    check_terms(gpu, a, heads, &terms)?;
    check_same_gpu(gpu, "x", x)?;
    check_same_gpu(gpu, "out", &*out)?;
    if heads == 0 || head_dim == 0 {
        return Ok(()); // nothing to write
    }
    // A head the kernels do not take, or dropout without its mask, is refused whatever the graph.
    let (vec, hl, g, tiles) = feature_lanes::<T>(heads, head_dim)?;
    let mut mask = checked_mask(gpu, (a, heads, &terms), mask, 1)?;
    if a.n_rows() == 0 {
        return Ok(());
    }
    gat_row_stats(gpu, (a, walk), terms, lse)?;
    if a.nnz() == 0 {
        // Nothing to aggregate (and no entry for the kernel's indices to stand on).
        return out.fill(T::from_f32(0.0));
    }
    let drop = DropoutWords::of(terms.dropout);
    if let Some(m) = &mut mask {
        draw_keep_bits(gpu, a, heads, None, &drop, &mut m.slice_mut().slice_mut(..))?;
    }
    let mask = mask.map(|m| m.slice().slice(..));
    let hd = heads * head_dim;
    let s = a.schedule();
    let ([rows, starts, parts, _, _], n_parts) = s.units();
    let mut guard = s.scratch().lock();
    let need = product("GAT partials", &[n_parts, hd])?;
    let scratch = grown(gpu, &mut guard, "GAT split-row partials", need.max(1))?;
    let name = kernel_named(
        &CSR_OPS,
        aggregate_kernel(T::NAME, vec, false, mask.is_some()),
    )?;
    let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, name)?;
    let (n_units, heads_u, dim_u) = (
        to_u32("units", rows.len())?,
        to_u32("heads", heads)?,
        to_u32("head_dim", head_dim)?,
    );
    let order = walk.rows(a)?;
    let mut args = gpu.launch_builder(&f);
    push_walk(
        &mut args,
        [rows, starts, parts],
        (&n_units, order),
        a.col_indices(),
    );
    args.arg(x.slice());
    let lanes = [heads_u, dim_u, g, hl];
    push_lanes(&mut args, &lanes, &terms, &drop);
    args.view_or_null(mask.as_ref())
        .arg(lse.slice())
        .arg(out.slice_mut())
        .arg(scratch.slice_mut());
    // SAFETY: units, walk and edges as in `gat_row_stats`; x rows are column indices < n_cols
    // and out rows unit rows < n_rows, read and written at features head·head_dim + d, d <
    // head_dim in vectors of `vec` (lanes past the heads or the head's width hold none); lse at
    // (row, head) < n_rows·heads (written above); the mask (the `_drop` kernel only) at word
    // (e·heads + head) / 32 < ⌈nnz·heads / 32⌉ (its length, checked); partials at part·hd +
    // feature < n_parts·hd.
    unsafe { launch(name, &mut args, group_grid(rows.len(), g, tiles)?) }?;
    finalize_split_rows(gpu, a, hd, &scratch.slice().slice(..need), out.slice_mut())
}

/// The row statistics the rows kernels' backward reads (`n_rows × heads` f32).
#[derive(Debug)]
pub enum RowStats<'a> {
    /// Recomputed by the backward into this workspace (one more launch).
    Recompute(&'a mut DeviceVec<f32>),
    /// Kept from the rows forward ([`GatForward::Rows`](super::GatForward::Rows)) with the same
    /// graph and score terms.
    Kept(&'a DeviceVec<f32>),
}

/// The gradients of GAT attention from its forward's output: `(x, out, d_out)` are the
/// aggregated features (`n_cols × heads × head_dim`), the forward's output and its gradient
/// (`n_rows × heads × head_dim`); `grads` as [`super::gat_fused_backward`]'s. Workspaces: the
/// row statistics `lse` (kept from the forward, or recomputed) and `ds` (`nnz × heads` f32:
/// each edge's ∂L/∂s in Aᵀ's order) and, with dropout, the masks ([`KeepBits`]: A's kept
/// from [`gat_forward_rows`] or drawn again, Aᵀ's drawn). Two or three launches (up to six
/// with split rows or columns, one or two more to draw the masks), deterministic; the passes
/// walk A's and Aᵀ's units in `walk`'s order (the same bits in any).
///
/// Errors: as [`gat_forward_rows`]; [`Error::InvalidArgument`] when `t` is not Aᵀ or a bias
/// comes without its gradient's buffer; [`Error::LengthMismatch`] for `ds` or `d_bias`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gat_backward_rows<T: DType>(
    gpu: &Gpu,
    (a, t): (&DeviceCsr, &DeviceTranspose),
    walk: &UnitWalk,
    terms: GatScoreTerms<'_>,
    (x, out, d_out): (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
    (lse, ds, mask): (RowStats<'_>, &mut DeviceVec<f32>, Option<KeepBits<'_>>),
    grads: GatGrads<'_, T>,
) -> Result<()> {
    check_transpose(a, t)?;
    let sx = x.shape();
    let (heads, head_dim) = (sx.heads, sx.head_dim);
    let so = Shape::new(a.n_rows(), heads, head_dim)?;
    Shape::new(a.n_cols(), heads, head_dim)?.expect_eq("x", sx)?;
    so.expect_eq("out", out.shape())?;
    so.expect_eq("d_out", d_out.shape())?;
    sx.expect_eq("dx", grads.dx.shape())?;
    Shape::new(a.n_rows(), heads, 1)?.expect_eq("d_a_dst", grads.d_dst.shape())?;
    Shape::new(a.n_cols(), heads, 1)?.expect_eq("d_a_src", grads.d_src.shape())?;
    edge_len(a, heads, "dS workspace", ds.len())?;
    if terms.bias.is_some() && grads.d_bias.is_none() {
        return Err(Error::InvalidArgument {
            what: "d_bias",
            why: "a bias needs its gradient's buffer".into(),
        });
    }
    if let Some(db) = &grads.d_bias {
        edge_len(a, heads, "d_bias", db.len())?;
        check_same_gpu(gpu, "d_bias", &**db)?;
    }
    for (what, m) in [("x", x), ("out", out), ("d_out", d_out)] {
        check_same_gpu(gpu, what, m)?;
    }
    check_same_gpu(gpu, "transpose", &t.csr)?;
    check_same_gpu(gpu, "dx", &*grads.dx)?;
    check_same_gpu(gpu, "d_a_dst", &*grads.d_dst)?;
    check_same_gpu(gpu, "d_a_src", &*grads.d_src)?;
    check_same_gpu(gpu, "dS workspace", ds)?;
    // The score terms have x's heads (the kernels index them by x's), kept statistics or not.
    check_terms(gpu, a, heads, &terms)?;
    // A head the kernels do not take, or dropout without its mask, is refused whatever the graph.
    let (vec, hl, g, tiles) = match heads * head_dim {
        0 => (1, 1, 1, 1),
        _ => feature_lanes::<T>(heads, head_dim)?,
    };
    // (A's mask to draw into, or None where kept; A's kept mask; Aᵀ's to draw into).
    let on = (a, heads, &terms);
    let (mut draw_a, kept_a, mut draw_t) = match mask {
        Some(KeepBits::Kept { a: ka, t: kt }) => (
            None,
            checked_mask(gpu, on, Some(ka), 1)?,
            checked_mask(gpu, on, Some(kt), 1)?.map(|m| m.slice_mut().slice_mut(..)),
        ),
        Some(KeepBits::Draw(m)) => match checked_mask(gpu, on, Some(m), 2)? {
            Some(m) => {
                let words = m.len() / 2;
                let (in_a, in_t) = m.slice_mut().split_at_mut(words);
                (Some(in_a), None, Some(in_t))
            }
            None => (None, None, None),
        },
        None => {
            checked_mask(gpu, on, None::<&mut DeviceVec<u32>>, 1)?;
            (None, None, None)
        }
    };
    // The walk checked against both passes' units before anything is written.
    let (a_order, t_order) = (walk.rows(a)?, walk.cols(t.csr())?);
    if heads == 0 || head_dim == 0 || a.nnz() == 0 {
        // No edge: nothing aggregated, every gradient zero.
        grads.dx.fill(T::from_f32(0.0))?;
        grads.d_dst.fill(0.0)?;
        return grads.d_src.fill(0.0);
    }
    let lse: &DeviceVec<f32> = match lse {
        RowStats::Recompute(lse) => {
            gat_row_stats(gpu, (a, walk), terms, lse)?;
            lse
        }
        RowStats::Kept(lse) => {
            check_lse(gpu, a, heads, lse)?;
            lse
        }
    };
    let hd = heads * head_dim;
    let (heads_u, dim_u) = (to_u32("heads", heads)?, to_u32("head_dim", head_dim)?);
    let lanes = [heads_u, dim_u, g, hl];
    let drop = DropoutWords::of(terms.dropout);
    let cfg = |units: usize| -> Result<LaunchConfig> { group_grid(units, g, tiles) };
    // The mask in A's order for the pass over A, in Aᵀ's for the pass over Aᵀ (read there in
    // sequence, not gathered through the edge map).
    if let Some(m) = &mut draw_a {
        draw_keep_bits(gpu, a, heads, None, &drop, m)?;
    }
    if let Some(m) = &mut draw_t {
        draw_keep_bits(gpu, a, heads, Some(t.inverse_map(gpu)?), &drop, m)?;
    }
    let mask_a = match (&draw_a, kept_a) {
        (Some(m), _) => Some(m.slice(..)),
        (None, Some(m)) => Some(m.slice().slice(..)),
        (None, None) => None,
    };
    let mask_t = draw_t.as_ref().map(|m| m.slice(..));

    // Over A: dS in Aᵀ's order, ∂a_dst.
    {
        let s = a.schedule();
        let ([rows, starts, parts, _, _], n_parts) = s.units();
        let mut guard = s.scratch().lock();
        let need = product("GAT row partials", &[n_parts, heads])?;
        let scratch = grown(gpu, &mut guard, "GAT split-row partials", need.max(1))?;
        let name = kernel_named(&CSR_OPS, grad_rows_kernel(T::NAME, vec, mask_a.is_some()))?;
        let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, name)?;
        let n_units = to_u32("units", rows.len())?;
        let mut args = gpu.launch_builder(&f);
        push_walk(
            &mut args,
            [rows, starts, parts],
            (&n_units, a_order),
            a.col_indices(),
        );
        args.arg(t.map().slice())
            .arg(x.slice())
            .arg(out.slice())
            .arg(d_out.slice());
        push_lanes(&mut args, &lanes, &terms, &drop);
        args.view_or_null(mask_a.as_ref())
            .arg(lse.slice())
            .arg(ds.slice_mut())
            .arg_or_null_mut(grads.d_bias)
            .arg(grads.d_dst.slice_mut())
            .arg(scratch.slice_mut());
        // SAFETY: units, walk and edges as in `gat_row_stats`; x rows column indices < n_cols,
        // out and d_out rows unit rows < n_rows, at features < heads·head_dim (shapes checked);
        // lse at (row, head) < n_rows·heads; the mask in A's order (`_drop` only) at word
        // (e·heads + head) / 32 < its view's length; writes ds at (map[e], head) with map a
        // permutation of 0..nnz (ds holds nnz·heads, checked), d_bias at (e, head) <
        // nnz·heads (checked), d_dst at (row, head) < n_rows·heads and partials at (part,
        // head) < n_parts·heads.
        unsafe { launch(name, &mut args, cfg(rows.len())?) }?;
        finalize_split_rows(
            gpu,
            a,
            heads,
            &scratch.slice().slice(..need),
            grads.d_dst.slice_mut(),
        )?;
    }

    // Over Aᵀ: dx and ∂a_src.
    let t_to_a = if terms.bias.is_some() {
        Some(t.inverse_map(gpu)?)
    } else {
        None
    };
    let tc = t.csr();
    let s = tc.schedule();
    let ([rows, starts, parts, _, _], n_parts) = s.units();
    let mut guard = s.scratch().lock();
    let need_x = product("GAT column partials", &[n_parts, hd])?;
    let need_s = product("GAT column partials", &[n_parts, heads])?;
    let scratch = grown(
        gpu,
        &mut guard,
        "GAT split-column partials",
        (need_x + need_s).max(1),
    )?;
    let name = kernel_named(
        &CSR_OPS,
        aggregate_kernel(T::NAME, vec, true, mask_t.is_some()),
    )?;
    let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, name)?;
    let n_units = to_u32("units", rows.len())?;
    let (mut part_x, mut part_s) = scratch.slice_mut().split_at_mut(need_x);
    {
        let mut args = gpu.launch_builder(&f);
        push_walk(
            &mut args,
            [rows, starts, parts],
            (&n_units, t_order),
            tc.col_indices(),
        );
        args.arg_or_null(t_to_a).arg(d_out.slice());
        push_lanes(&mut args, &lanes, &terms, &drop);
        args.view_or_null(mask_t.as_ref())
            .arg(lse.slice())
            .arg(ds.slice())
            .arg(grads.dx.slice_mut())
            .arg(grads.d_src.slice_mut())
            .arg(&mut part_x)
            .arg(&mut part_s);
        // SAFETY: Aᵀ's units (rows < n_cols), their walk where given (as in `gat_row_stats`)
        // and entries (rows of A < n_rows: d_out, a_dst and lse rows); an entry's edge
        // t_to_a[e] < nnz (a permutation; null, and unread, without a bias) indexes the bias at
        // (edge, head) < nnz·heads; the mask in Aᵀ's order (`_drop` only) at word
        // (entry·heads + head) / 32 < its view's length; ds at (entry, head) < nnz·heads; dx
        // rows < n_cols at features < hd, d_src at (column, head) < n_cols·heads; partials at
        // part·hd + feature < need_x and (part, head) < need_s in their views.
        unsafe { launch(name, &mut args, cfg(rows.len())?) }?;
    }
    finalize_split_rows(gpu, tc, hd, &part_x.slice(..), grads.dx.slice_mut())?;
    finalize_split_rows(gpu, tc, heads, &part_s.slice(..), grads.d_src.slice_mut())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_fit_heads_in_a_warp() {
        // 8 heads of 32 f16: vectors of 8, 4 lanes a head, one group of 32.
        assert_eq!(lanes(8, 32, 2), Some((8, 4, 32, 1)));
        // 8 heads of 32 f32: vectors of 4, 8 lanes a head, 4 heads a group, two tiles.
        assert_eq!(lanes(8, 32, 4), Some((4, 8, 32, 2)));
        // One head of 40 f16: 5 vectors of 8 on 8 lanes.
        assert_eq!(lanes(1, 40, 2), Some((8, 8, 8, 1)));
        // Odd widths: vectors of 1, up to 32 lanes.
        assert_eq!(lanes(3, 31, 4), Some((1, 32, 32, 3)));
        // 256 f16 fit (32 lanes of 8); 129 f32 do not.
        assert_eq!(lanes(1, 256, 2), Some((8, 32, 32, 1)));
        assert_eq!(lanes(2, 129, 4), None);
        assert_eq!(lanes(0, 8, 4), None);
    }

    #[test]
    fn statistics_lanes_cover_every_head() {
        for heads in [1usize, 2, 3, 8, 31, 32, 33, 100] {
            let (hl, g, tiles) = stats_lanes(heads);
            assert!(hl.is_power_of_two() && g == 32);
            assert!(
                tiles as usize * (32 / hl as usize) >= heads,
                "{heads} heads"
            );
        }
    }
}
