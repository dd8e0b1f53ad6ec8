//! RT-GNN-style hybrid kernels on [`DeviceHybrid`]: tensor-core warps take each window's dense
//! 16×8 blocks and CUDA-core warps of the same CTA its remaining edges, in one persistent kernel
//! (`crates/kernels-sys/cuda/hybrid.cu`). This module holds the device upload of the tile
//! structure ([`spattn_formats::HybridBlocks`] split at a threshold by
//! [`spattn_formats::HybridSplit`]), the launch shared by the two kernels, and the hybrid SpMM
//! ([`spmm`]); the fused attention on the same structure is `spattn`'s `Algorithm::Hybrid`,
//! which calls `DeviceHybrid::attention`. The attention extras' map from the structure's edges
//! to the caller's is built in `edge_map`.
//!
//! Rows are renumbered by degree inside the structure only: every operand stays in the caller's
//! node order. K and V rows are gathered by original id; Q rows are loaded and output rows
//! stored through the renumbered row's original id ([`spattn_formats::HybridBlocks::row_ids`]).
//!
//! SpMM computes `out[i, h, :] = Σ_j A[i, j] · V[j, h, :]` with `A[i, j]` the matrix's value
//! (1 for a binary matrix), every sum in f32; f32 operands go through tf32 on the tensor-core
//! side (relative error ~1e-3).
//!
//! [`HybridSpmm`](crate::HybridSpmm) plans and runs the SpMM; fused attention is
//! [`Hybrid`](crate::Hybrid)'s.

mod edge_map;
#[cfg(test)]
mod edge_map_tests;
#[cfg(test)]
mod gpu_tests;
#[cfg(test)]
mod tests;

use std::sync::Mutex;

use spattn_formats::{Csr, HybridBlocks, HybridSplit};
use spattn_kernels_sys::HYBRID;

use crate::buffer::{DeviceMatrix, DeviceVec};
use crate::device_bsb::{
    bsb_pipe_supports, bsb_pipe_warp_bytes, check_structure_graph, BsbBlocks, BsbExtrasStage,
    BSB_MIN_UNIT_BLOCKS,
};
use crate::dtype::{DType, DTypeKind};
use crate::edge_extras::DeviceBias;
use crate::error::{Error, Result};
use crate::fused::CsrExtras;
use crate::gpu::Gpu;
use crate::launch::{
    check_same_gpu, kernel_named, launch, map_driver_error, to_u32, LaunchConfig, OnGpu,
    PushKernelArg, PushOptionalArg,
};
use crate::rows::{padded_heads, resize_rows, vec_padded};
use crate::schedule::HybridUnits;
use crate::shape::Shape;

use edge_map::{hybrid_edge_map, HybridEdgeMap};

/// Most warps per CTA (the kernels' launch bound is 256 threads).
pub(crate) const MAX_WARPS: usize = 8;
/// Most tensor-core warps per CTA of the pipelined kernel (`HYB_PIPE_MAX_TC` in hybrid.cu: two
/// hand-off mbarriers each; the plan tries 1..=3).
pub(crate) const MAX_PIPE_TC_WARPS: usize = 4;
/// Rows per window.
const WINDOW_ROWS: usize = 16;
/// Shared memory of the pipelined kernel's hand-off mbarriers, after the tensor-core warps'
/// (hybrid.cu: two 8-byte mbarriers per possible tensor-core warp).
const PIPE_MBAR_BYTES: usize = 2 * MAX_PIPE_TC_WARPS * 8;
/// Shared-memory floats before the per-warp slots (`HYB_HEAD_FLOATS` in the kernel).
const HEAD_FLOATS: usize = 68;
/// Default block cost relative to one edge for the unit schedule (a pair of 16×8 blocks on a
/// tensor-core warp against one edge on a CUDA-core warp); the plan replaces it with measured
/// costs.
pub(crate) const DEFAULT_BLOCK_COST: f64 = 8.0;

/// Feature slices compiled per dtype (`*_hybrid_{dtype}_s{slice}`): one warp covers the head.
fn slices(dtype: DTypeKind) -> &'static [usize] {
    match dtype {
        DTypeKind::F32 => &[32, 64],
        DTypeKind::F16 | DTypeKind::Bf16 => &[32, 64, 128],
    }
}

/// The slice (features per warp) for `head_dim` features of `dtype`, or why there is none:
/// the hybrid kernels hold a whole head in one warp (head_dim ≤ 128 for f16/bf16, ≤ 64 for
/// f32).
pub(crate) fn slice_for(head_dim: usize, dtype: DTypeKind) -> std::result::Result<usize, String> {
    if head_dim == 0 {
        return Err("head_dim must be at least 1".into());
    }
    slices(dtype)
        .iter()
        .copied()
        .find(|&s| s >= head_dim)
        .ok_or_else(|| {
            format!(
                "head_dim {head_dim} is wider than one warp's slice for {dtype} (at most {}); \
                 use fused-tc or fused-csr",
                slices(dtype).last().copied().unwrap_or(0)
            )
        })
}

/// The feature widths the hybrid SpMM can run `heads × head_dim` features of `dtype` in, best
/// guess first.
///
/// A SpMM's weights are shared by every head (`out[i, h, :] = Σ_j A[i, j] · V[j, h, :]`), so
/// each row's `F = heads × head_dim` features are independent columns, and the kernel may cut
/// them into any `F / w` pieces of `w` features (each piece one kernel "head"). The
/// candidates, in this order and without repeats: the pipelined kernel's widths (f16/bf16: 128
/// and 64) or for f32 the general kernel's full slices (64, 32) that divide `F` (widest first:
/// fewer index and bitmap reads per feature); the largest divisor of `F` that one warp's slice
/// holds (1 divides every `F`, so no shape is refused: 200 f16 features run as 2 × 100); and
/// `head_dim` itself when a slice holds it. Empty only for `F = 0`.
pub(crate) fn spmm_widths(dtype: DTypeKind, heads: usize, head_dim: usize) -> Vec<usize> {
    let f = heads.saturating_mul(head_dim);
    if f == 0 {
        return Vec::new();
    }
    let wide: &[usize] = match dtype {
        DTypeKind::F32 => &[64, 32],
        DTypeKind::F16 | DTypeKind::Bf16 => &[128, 64],
    };
    let mut out: Vec<usize> = wide.iter().copied().filter(|w| f % w == 0).collect();
    let max = slices(dtype).last().copied().unwrap_or(32);
    // 1 divides f: the search always finds one.
    let largest = (1..=max.min(f)).rev().find(|w| f % w == 0).unwrap_or(1);
    for w in [largest, head_dim] {
        if !out.contains(&w) && slice_for(w, dtype).is_ok() {
            out.push(w);
        }
    }
    out
}

/// Warps per CTA and how many of them run tensor cores.
///
/// In the general kernel (f32, and f16/bf16 heads other than 64 or 128 features) the CTA's
/// `tc` tensor-core warps and `cd` CUDA-core warps share one window at a time. In the
/// pipelined kernel (f16/bf16 attention and SpMM at exactly 64 or 128 features, see
/// [`DeviceHybrid::pipelined`]) each of the `tc` tensor-core warps (at most
/// 4) owns a window and the one CUDA-core warp (`cd` is 0 or 1) serves
/// them in turn. `cd = 0` is only valid for a split that put every edge on tensor cores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WarpSplit {
    /// Tensor-core warps (≥ 1).
    pub tc: usize,
    /// CUDA-core warps (0 only when no edge is on CUDA cores).
    pub cd: usize,
}

impl WarpSplit {
    /// Checks `1 ≤ tc` and `tc + cd ≤ 8`.
    pub(crate) fn new(tc: usize, cd: usize) -> Result<Self> {
        if tc == 0 || tc + cd > MAX_WARPS {
            return Err(Error::InvalidArgument {
                what: "hybrid warp split",
                why: format!(
                    "{tc} tensor-core + {cd} CUDA-core warps: at least 1 tensor-core warp, \
                     at most {MAX_WARPS} in all"
                ),
            });
        }
        Ok(Self { tc, cd })
    }
    /// Warps per CTA.
    pub(crate) fn warps(&self) -> usize {
        self.tc + self.cd
    }
}

/// Counts of one split, for reporting.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct HybridStats {
    /// The fill threshold.
    pub threshold: f64,
    /// Tensor-core blocks.
    pub tc_blocks: usize,
    /// Edges on tensor cores.
    pub tc_edges: usize,
    /// Edges on CUDA cores.
    pub cd_edges: usize,
    /// Work units (before heads).
    pub units: usize,
}

/// Split-window workspace, grown on demand.
#[derive(Debug)]
struct Workspace {
    part_ml: DeviceVec<f32>,
    part_acc: DeviceVec<f32>,
    counters: DeviceVec<u32>,
}

/// A [`HybridBlocks`] structure split at one threshold, in device memory, with its unit
/// schedule, for the hybrid kernels.
#[derive(Debug)]
pub(crate) struct DeviceHybrid {
    n_rows: usize,
    n_cols: usize,
    stats: HybridStats,
    n_units: usize,
    n_split: usize,
    n_parts: usize,
    row_ids: DeviceVec<u32>,
    block_columns: DeviceVec<u32>,
    bitmap_words: DeviceVec<u32>,
    tc_values: Option<DeviceVec<f32>>,
    cd_row_offsets: DeviceVec<u32>,
    cd_columns: DeviceVec<u32>,
    cd_values: Option<DeviceVec<f32>>,
    units: DeviceVec<u32>,
    split_part_first: DeviceVec<u32>,
    /// The work queue: next item, CTAs exited (the last CTA resets both).
    queue: Mutex<DeviceVec<u32>>,
    workspace: Mutex<Option<Workspace>>,
    /// Block ranges of the windows (host), for the extras' edge map.
    window_offsets: Vec<u32>,
    /// The attention extras' edge map, built by the first call with extras.
    edge_map: Mutex<Option<HybridEdgeMap>>,
}

impl DeviceHybrid {
    /// Uploads `blocks` split at `split`'s threshold, with units of at most a `1 / (8 · SMs)`
    /// share of the work each (block cost 8 edges), but no fewer than
    /// 16 blocks' or 64 edges' worth.
    pub(crate) fn upload(
        gpu: &Gpu,
        blocks: &HybridBlocks,
        split: &HybridSplit,
        heads: usize,
    ) -> Result<Self> {
        Self::upload_with_costs(gpu, blocks, split, heads, DEFAULT_BLOCK_COST, 1.0)
    }

    /// [`Self::upload`] with the unit schedule built from measured costs: `block_cost` per
    /// tensor-core block, `edge_cost` per CUDA-core edge (any unit, both positive).
    pub(crate) fn upload_with_costs(
        gpu: &Gpu,
        blocks: &HybridBlocks,
        split: &HybridSplit,
        heads: usize,
        block_cost: f64,
        edge_cost: f64,
    ) -> Result<Self> {
        let total = split.tc_blocks() as f64 * block_cost + split.cd_edges() as f64 * edge_cost;
        let lanes = f64::from(gpu.sm_count().max(1)) * 8.0 / heads.max(1) as f64;
        // Splits cost a merge: a unit holds at least fused-tc's fewest blocks per unit (the
        // all-tensor-core split then cuts windows as fused-tc does) or a few dozen edges.
        let max_cost = (total / lanes)
            .max(BSB_MIN_UNIT_BLOCKS as f64 * block_cost)
            .max(64.0 * edge_cost);
        let units = HybridUnits::new(blocks, split, block_cost, edge_cost, max_cost)?;
        to_u32("hybrid block slots", blocks.block_columns().len())?;
        to_u32("hybrid units × heads", units.n_units() * heads.max(1))?;
        let up_u32 = |what, x: &[u32]| DeviceVec::from_host_named(gpu, what, x);
        let up_f32 = |what, x: Option<&[f32]>| {
            x.map(|x| DeviceVec::from_host_named(gpu, what, x))
                .transpose()
        };
        Ok(Self {
            n_rows: blocks.n_rows(),
            n_cols: blocks.n_cols(),
            stats: HybridStats {
                threshold: split.threshold(),
                tc_blocks: split.tc_blocks(),
                tc_edges: split.tc_edges(),
                cd_edges: split.cd_edges(),
                units: units.n_units(),
            },
            n_units: units.n_units(),
            n_split: units.n_split(),
            n_parts: units.n_parts(),
            row_ids: up_u32("hybrid row ids", blocks.row_ids())?,
            block_columns: up_u32("hybrid block columns", blocks.block_columns())?,
            bitmap_words: up_u32("hybrid bitmaps", &blocks.bitmap_words_u32())?,
            tc_values: up_f32("hybrid block values", split.tc_values())?,
            cd_row_offsets: up_u32("hybrid edge offsets", split.cd_row_offsets())?,
            cd_columns: up_u32("hybrid edge columns", split.cd_columns())?,
            cd_values: up_f32("hybrid edge values", split.cd_values())?,
            units: up_u32("hybrid units", &units.units)?,
            split_part_first: up_u32("hybrid split parts", &units.split_part_first)?,
            queue: Mutex::new(DeviceVec::alloc(gpu, "hybrid work queue", 2, true)?),
            workspace: Mutex::new(None),
            window_offsets: blocks.window_offsets().to_vec(),
            edge_map: Mutex::new(None),
        })
    }

    /// Number of rows.
    pub(crate) fn n_rows(&self) -> usize {
        self.n_rows
    }
    /// Number of columns.
    pub(crate) fn n_cols(&self) -> usize {
        self.n_cols
    }
    /// The split's counts.
    pub(crate) fn stats(&self) -> HybridStats {
        self.stats
    }

    /// Whether `DeviceHybrid::attention` and [`spmm_with`] run the pipelined kernel for heads
    /// of `head_dim` features of `dtype` ([`Hybrid::pipelined`](crate::Hybrid::pipelined)).
    pub(crate) fn pipelined(dtype: DTypeKind, head_dim: usize) -> bool {
        bsb_pipe_supports(dtype, head_dim)
    }

    /// Checks `warps` against this split and the kernel that will run it (`pipelined`: see
    /// [`Self::pipelined`]): [`Error::InvalidArgument`] for no CUDA-core warp while edges are
    /// on CUDA cores, or, for the pipelined kernel, more than [`MAX_PIPE_TC_WARPS`]
    /// tensor-core warps or more than one CUDA-core warp.
    pub(crate) fn check_warps(&self, warps: WarpSplit, pipelined: bool) -> Result<()> {
        let bad = |why: String| {
            Err(Error::InvalidArgument {
                what: "hybrid warp split",
                why,
            })
        };
        let w = WarpSplit::new(warps.tc, warps.cd)?;
        if w.cd == 0 && self.stats.cd_edges > 0 {
            return bad(format!(
                "no CUDA-core warp, but {} edges are on CUDA cores at threshold {}",
                self.stats.cd_edges, self.stats.threshold
            ));
        }
        if pipelined && (w.tc > MAX_PIPE_TC_WARPS || w.cd > 1) {
            return bad(format!(
                "{} tensor-core + {} CUDA-core warps: the pipelined kernel takes 1..={} \
                 tensor-core warps and at most 1 CUDA-core warp",
                w.tc, w.cd, MAX_PIPE_TC_WARPS
            ));
        }
        Ok(())
    }

    /// Fused attention `out = softmax_row(scale · Q Kᵀ masked by A) · V` with `warps` of each
    /// kind per CTA. Q and out are `n_rows × heads × head_dim`, K and V `n_cols × heads ×
    /// head_dim`; every output element is written (rows without edges: zeros).
    ///
    /// Errors: [`Error::ShapeMismatch`] naming the operand, [`Error::InvalidArgument`] for a
    /// head wider than the compiled slices or a scale not finite in the log2 domain,
    /// [`Error::ForeignGpu`], [`Error::UnsupportedComputeCapability`] below 8.0, launch
    /// failures.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention<T: DType>(
        &self,
        gpu: &Gpu,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        scale: f32,
        warps: WarpSplit,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        let scale_log2 = self.check_attention(gpu, (q, k, v), scale, out)?;
        self.run(
            "fused",
            gpu,
            Some((q, k)),
            v,
            scale_log2,
            warps,
            q.shape().head_dim,
            None,
            out,
        )
    }

    /// Attention's operand checks (shapes against this structure, Q and K on `gpu`; `run`
    /// checks the rest); returns the scale in the kernels' log2 domain.
    fn check_attention<T: DType>(
        &self,
        gpu: &Gpu,
        (q, k, v): (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
        scale: f32,
        out: &DeviceMatrix<T>,
    ) -> Result<f32> {
        let shape = q.shape();
        shape.expect_rows_like("Q", shape, self.n_rows)?;
        shape.expect_rows_like("K", k.shape(), self.n_cols)?;
        shape.expect_rows_like("V", v.shape(), self.n_cols)?;
        shape.expect_rows_like("out", out.shape(), self.n_rows)?;
        check_same_gpu(gpu, "Q", q)?;
        check_same_gpu(gpu, "K", k)?;
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        if !scale_log2.is_finite() {
            return Err(Error::InvalidArgument {
                what: "scale",
                why: format!("{scale} is not finite in the kernel's log2 domain"),
            });
        }
        Ok(scale_log2)
    }

    /// [`attention`](Self::attention) with a score bias and dropout (see `spattn::extras`) in
    /// the same kernel, given in the CSR order of `graph`, the graph this structure was built
    /// from. The first call maps the structure's edges to `graph`'s (host work over the edges
    /// and 4 bytes per edge, per CUDA-core edge and per block on the device, kept); each call
    /// gathers the tensor-core edges' extras into their order (4 bytes per edge and bias row,
    /// 1 bit per edge and head, kept).
    ///
    /// Errors: as [`attention`](Self::attention); [`Error::Unsupported`] for edge features; a
    /// bias that is not `nnz × heads` (or `nnz`, shared); [`Error::InvalidArgument`] where
    /// `graph` is not this structure's.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_with_extras<T: DType>(
        &self,
        gpu: &Gpu,
        graph: &Csr,
        (q, k, v): (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
        scale: f32,
        warps: WarpSplit,
        extras: &CsrExtras<'_, T>,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        let shape = q.shape();
        check_same_gpu(gpu, "hybrid structure", self)?;
        // The structure's graph: the cached map indexes the bias by its rows and edges.
        let nnz = self.stats.tc_edges + self.stats.cd_edges;
        let what = ("graph of the hybrid structure", "structure");
        check_structure_graph(what, (self.n_rows, nnz), (graph.n_rows(), graph.nnz()))?;
        extras.check(gpu, "hybrid", nnz, shape, false)?;
        let scale_log2 = self.check_attention(gpu, (q, k, v), scale, out)?;
        let mut map = self
            .edge_map
            .lock()
            // Replaced whole only.
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.is_none() {
            let (starts, ids, cd_ids) = hybrid_edge_map(
                graph,
                &self.window_offsets,
                &self.row_ids.to_host()?,
                &self.block_columns.to_host()?,
                &self.bitmap_words.to_host()?,
                &self.cd_row_offsets.to_host()?,
                &self.cd_columns.to_host()?,
            )?;
            *map = Some(HybridEdgeMap {
                block_edge_start: DeviceVec::from_host_named(
                    gpu,
                    "hybrid block edge starts",
                    &starts,
                )?,
                edge_ids: DeviceVec::from_host_named(gpu, "hybrid edge ids", &ids)?,
                cd_edge_ids: DeviceVec::from_host_named(gpu, "hybrid CUDA-core edge ids", &cd_ids)?,
                stage: BsbExtrasStage::default(),
            });
        }
        let map = map.as_mut().ok_or(Error::InvalidArgument {
            what: "hybrid edge map",
            why: "not built".into(),
        })?;
        self.run(
            "fused",
            gpu,
            Some((q, k)),
            v,
            scale_log2,
            warps,
            shape.head_dim,
            Some((extras, map)),
            out,
        )
    }

    /// The launch shared by attention (`qk` given; `width` = head_dim) and SpMM (the row's
    /// `heads × head_dim` features cut into pieces of `width`, each a kernel head).
    #[allow(clippy::too_many_arguments)]
    fn run<T: DType>(
        &self,
        op: &str,
        gpu: &Gpu,
        qk: Option<(&DeviceMatrix<T>, &DeviceMatrix<T>)>,
        v: &DeviceMatrix<T>,
        scale_log2: f32,
        warps: WarpSplit,
        width: usize,
        extras: Option<(&CsrExtras<'_, T>, &mut HybridEdgeMap)>,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        let row_len = v.shape().row_len();
        if width == 0 || row_len % width != 0 || (qk.is_some() && width != v.shape().head_dim) {
            return Err(Error::InvalidArgument {
                what: "hybrid feature width",
                why: format!(
                    "{width} features per piece do not tile the {} × {} features of a row{}",
                    v.shape().heads,
                    v.shape().head_dim,
                    if qk.is_some() {
                        " head by head (attention)"
                    } else {
                        ""
                    }
                ),
            });
        }
        // The kernel's view: `row_len / width` heads of `width` features (the caller's shape
        // for attention).
        let shape = Shape::new(v.shape().rows, row_len / width, width)?;
        check_same_gpu(gpu, "hybrid structure", self)?;
        check_same_gpu(gpu, "V", v)?;
        check_same_gpu(gpu, "out", out)?;
        gpu.require_compute_capability("hybrid kernels (mma.sync)", 8, 0)?;
        let slice = slice_for(shape.head_dim, T::KIND).map_err(|why| Error::InvalidArgument {
            what: "head_dim",
            why,
        })?;
        let pipelined = Self::pipelined(T::KIND, shape.head_dim);
        self.check_warps(warps, pipelined)?;
        let x = if extras.is_some() { "_x" } else { "" };
        let name = kernel_named(
            &HYBRID,
            kernel_name(op, T::KIND, shape.head_dim, slice, pipelined, warps.cd) + x,
        )?;
        // Heads (pieces) that are not whole 16-byte vectors run on copies padded with zeros to
        // them (the kernels read and write rows in 16-byte pieces), and the output, every
        // element of which the kernel writes, is cut back.
        let d = shape.head_dim;
        let dp = vec_padded(d, std::mem::size_of::<T>());
        let mut padded = None;
        if dp != d {
            let what = "hybrid operand padded to 16-byte rows";
            padded = Some(match qk {
                Some((q, k)) => {
                    let mats = [(q, true), (k, true), (v, true), (&*out, false)];
                    let [qp, kp, vp, op] = padded_heads(gpu, what, (d, dp), mats)?;
                    (Some((qp, kp)), vp, op)
                }
                None => {
                    let [vp, op] = padded_heads(gpu, what, (d, dp), [(v, true), (&*out, false)])?;
                    (None, vp, op)
                }
            });
        }
        let heads = to_u32("heads", shape.heads)?;
        let head_dim = to_u32("head_dim", dp)?;
        to_u32("heads × head_dim", shape.row_len())?;
        let n_items = self
            .n_units
            .checked_mul(shape.heads)
            .ok_or(Error::TooLarge {
                what: "hybrid units × heads",
                value: self.n_units as u64,
                limit: u64::from(u32::MAX),
            })?;
        let n_items_u = to_u32("hybrid units × heads", n_items)?;
        let n_rows = to_u32("rows", self.n_rows)?;
        let tc_warps = to_u32("tensor-core warps", warps.tc)?;
        let threads = (warps.warps() * 32) as u32;
        let smem = if pipelined {
            // The hand-off's mbarriers follow the tensor-core warps' memory (none in `_tc`).
            let mbar = if warps.cd > 0 { PIPE_MBAR_BYTES } else { 0 };
            warps.tc * bsb_pipe_warp_bytes(shape.head_dim, qk.is_none(), 0) + mbar
        } else {
            (HEAD_FLOATS + warps.warps() * WINDOW_ROWS * (2 + slice)) * 4
        };

        // Split-window partials for this head count.
        let mut ws_guard = self
            .workspace
            .lock()
            // Replaced whole only: a panic elsewhere cannot leave it half-built.
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let rows = self.n_parts * shape.heads * WINDOW_ROWS;
        let need = (rows * 2, rows * slice, self.n_split * shape.heads);
        if ws_guard.as_ref().is_none_or(|w| {
            w.part_ml.len() < need.0 || w.part_acc.len() < need.1 || w.counters.len() < need.2
        }) {
            *ws_guard = Some(Workspace {
                part_ml: DeviceVec::alloc(gpu, "hybrid partial (max, sum)", need.0, true)?,
                part_acc: DeviceVec::alloc(gpu, "hybrid partial accumulators", need.1, true)?,
                counters: DeviceVec::alloc(gpu, "hybrid split counters", need.2, true)?,
            });
        }
        let Some(ws) = ws_guard.as_mut() else {
            return Err(Error::InvalidArgument {
                what: "hybrid workspace",
                why: "not allocated".into(),
            });
        };
        let mut queue = self
            .queue
            .lock()
            // Two counters the kernel leaves at 0: nothing a panic could break.
            .unwrap_or_else(std::sync::PoisonError::into_inner);

        let f = gpu.load_function_with_shared(
            HYBRID.name,
            HYBRID.ptx,
            name,
            smem,
            "setting the hybrid kernel's shared memory",
        )?;
        // The general kernel is persistent (a work queue, as many CTAs as fit); the pipelined
        // one gives each tensor-core warp one item.
        let ctas = if pipelined {
            n_items_u.div_ceil(tc_warps)
        } else {
            let per_sm = f
                .occupancy_max_active_blocks_per_multiprocessor(threads, smem, None)
                .map_err(|e| map_driver_error("hybrid kernel occupancy", e))?
                .max(1);
            (gpu.sm_count().max(1) * per_sm).min(n_items_u.max(1))
        };
        let cfg = LaunchConfig {
            grid_dim: (if n_items == 0 { 0 } else { ctas }, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (q, k, v, out_run) = match padded.as_mut() {
            Some((qkp, vp, op)) => {
                let vp = &*vp;
                let (q, k) = qkp.as_ref().map_or((vp, vp), |(q, k)| (q, k));
                (q, k, vp, op)
            }
            None => {
                let (q, k) = qk.unwrap_or((v, v));
                (q, k, v, &mut *out)
            }
        };
        let mut args = gpu.launch_builder(&f);
        args.arg(self.units.slice())
            .arg(self.split_part_first.slice())
            .arg(&n_items_u)
            .arg(&heads)
            .arg(&head_dim)
            .arg(&n_rows)
            .arg(&tc_warps)
            .arg(self.row_ids.slice())
            .arg(self.block_columns.slice())
            .arg(self.bitmap_words.slice())
            .arg_or_null(self.tc_values.as_ref())
            .arg(self.cd_row_offsets.slice())
            .arg(self.cd_columns.slice())
            .arg_or_null(self.cd_values.as_ref())
            .arg(q.slice())
            .arg(k.slice())
            .arg(v.slice())
            .arg(&scale_log2)
            .arg(out_run.slice_mut())
            .arg(ws.part_ml.slice_mut())
            .arg(ws.part_acc.slice_mut())
            .arg(ws.counters.slice_mut())
            .arg(queue.slice_mut());
        let ex = extras
            .as_ref()
            .map(|(e, _)| crate::fused::KernelExtras::new(e, heads));
        let mut tc_extras = None;
        if let (Some(ex), Some((e, map))) = (&ex, extras) {
            let HybridEdgeMap {
                block_edge_start,
                edge_ids,
                cd_edge_ids,
                stage,
            } = map;
            args.arg_or_null(e.bias.as_ref().map(DeviceBias::values))
                .arg(&ex.bias_heads)
                .arg(cd_edge_ids.slice());
            ex.push_dropout(&mut args);
            let blocks = BsbBlocks {
                bitmaps: &self.bitmap_words,
                block_edge_start,
                // 8 columns a block; gather checks the map's n_blocks + 1 starts.
                n_blocks: self.block_columns.len() / 8,
            };
            tc_extras = Some(stage.gather(gpu, edge_ids, blocks, shape.heads, e)?);
        }
        if let Some(g) = &tc_extras {
            g.push(&mut args);
        }
        // SAFETY: items < n_units × heads; unit u's 8 words lie in `units` (8 × n_units) and
        // its split in `split_part_first` (n_split + 1). Its blocks lie in [0, n_blocks)
        // (block_columns: 8 words, bitmap_words: 4 words per block; tc_values, when passed,
        // 128 floats per tensor-core block at the unit's value base, built with the same
        // split), its CUDA-core edges in [0, cd_edges) of cd_columns / cd_values, and its rows
        // are window rows < n_rows of row_ids and cd_row_offsets (n_rows + 1). Q and out rows
        // are row_ids entries < n_rows, K and V rows real block columns or edge columns
        // < n_cols (padding slots are never loaded), each heads × head_dim long (shapes
        // checked; where padded, those of the copies: heads × head_dim with head_dim the
        // padded length), features < head_dim ≤ slice in 16-byte accesses (head_dim × sizeof(T)
        // is a multiple of 16: the view's, or the padded length, which stays ≤ slice as
        // slices are multiples of 8 features). Partials of part p < n_parts, head h < heads, row
        // < 16 and feature < slice lie in part_ml (n_parts × heads × 16 × 2) and part_acc
        // (× slice); counters n_split × heads; queue 2 words. Shared memory: `smem` bytes as
        // the kernel lays them out for `threads / 32` warps and this slice. Pipelined kernel:
        // head_dim is exactly 64 or 128 (= slice) of f16/bf16, item = CTA × tc + tensor-core
        // warp < n_items (ctas = ⌈n_items / tc⌉; the CUDA-core warp takes the same items),
        // `smem` = tc warps × bsb_pipe_warp_bytes(head_dim, SpMM) (SpMM: stages without the K
        // tile) and, with CUDA-core warps, the 2 × MAX_PIPE_TC_WARPS mbarriers after them
        // (PIPE_MBAR_BYTES, 8-byte aligned: warp bytes are multiples of 16; cd = 0 launches
        // the `_tc` kernel, which has no CUDA-core warp and no mbarriers), and the CUDA-core
        // partial it writes into a warp's stages (4 × (32 + 16 × (head_dim + 8)) bytes) fits
        // them (static_assert in hybrid.cu); cd = 0 only when there are no CUDA-core edges
        // (check_warps). Extras (`_x` kernels): cd_edge_ids holds one caller edge < nnz per
        // CUDA-core edge (hybrid_edge_map of this structure's graph, which checks every lookup)
        // and the bias nnz × bias_heads; block_edge_start holds n_blocks + 1 entries (the
        // edge count last: a step of blocks b, b + 1 reads entries b and min(b + 2, unit end)
        // ≤ n_blocks), a block's bits numbered from its start below the tensor-core edges,
        // whose gathered bias holds bias_rows × tc_edges floats (a step's edges first + lane
        // and first + 32 + lane read at its top, ranks past 64 after S, each only below the
        // step's end first + n) and keep words 4 × n_blocks × heads, 4 per block read at
        // 4 × block (BsbExtrasStage::gather).
        unsafe { launch(name, &mut args, cfg) }?;
        if let Some((_, _, op)) = &padded {
            resize_rows(gpu, (dp, d), &mut [(op.as_vec(), out.as_vec_mut())])?;
        }
        Ok(())
    }
}

/// The kernel [`DeviceHybrid::run`] launches for `op` (`"fused"` or `"spmm"`) on heads of
/// `width` features of `dtype` in warp slices of `slice` features, with `cd_warps` CUDA-core
/// warps: the pipelined kernel where `pipelined` (without CUDA-core warps its `_tc` twin,
/// compiled without their code: a shorter tile loop; see hybrid.cu), else the general kernel
/// of the slice (heads that are not whole 16-byte vectors run padded to them: `run`).
fn kernel_name(
    op: &str,
    dtype: DTypeKind,
    width: usize,
    slice: usize,
    pipelined: bool,
    cd_warps: usize,
) -> String {
    let dt = dtype.name();
    if pipelined {
        let tail = if cd_warps == 0 { "_tc" } else { "" };
        format!("{op}_hybrid_{dt}_d{width}_pipe{tail}")
    } else {
        format!("{op}_hybrid_{dt}_s{slice}")
    }
}

impl OnGpu for DeviceHybrid {
    fn gpu(&self) -> &Gpu {
        self.row_ids.gpu()
    }
}

/// Hybrid SpMM: `out[i, h, :] = Σ_j A[i, j] · V[j, h, :]` over the uploaded matrix (values, or
/// 1 for a binary matrix), dense blocks on tensor cores and the remaining edges on CUDA cores
/// in one kernel, with `warps` per CTA, each row's features run in pieces of `width`
/// ([`HybridSpmm`](crate::HybridSpmm) times the widths and splits). The kernel runs each
/// row's `heads × head_dim` features as pieces of `width` features (see [`spmm_widths`]; the
/// pipelined kernel for f16/bf16 pieces of 64 or 128, which takes the warp splits of
/// `DeviceHybrid::check_warps`).
///
/// Errors: [`Error::ShapeMismatch`] naming the operand; [`Error::InvalidArgument`] for a
/// `width` that does not divide `heads × head_dim` or is wider than one warp's slice (see
/// `slice_for`), or a warp split the kernel does not take; [`Error::ForeignGpu`],
/// [`Error::UnsupportedComputeCapability`] below 8.0, launch failures.
pub(crate) fn spmm_with<T: DType>(
    gpu: &Gpu,
    a: &DeviceHybrid,
    v: &DeviceMatrix<T>,
    warps: WarpSplit,
    width: usize,
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    let shape = v.shape();
    shape.expect_rows_like("V", shape, a.n_cols)?;
    shape.expect_rows_like("out", out.shape(), a.n_rows)?;
    if shape.row_len() == 0 {
        return Ok(());
    }
    a.run("spmm", gpu, None, v, 0.0, warps, width, None, out)
}
