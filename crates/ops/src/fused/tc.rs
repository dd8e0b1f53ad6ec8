//! `FusedTensorCore`: one tensor-core kernel per forward over BSB, Fused3S style
//! (kernel: `crates/kernels-sys/cuda/fused_bsb.cu`).
//!
//! Per 16-row window: S = Q Kᵀ of two 16×8 blocks at a time by `mma.sync` (f16/bf16, or f32 as
//! 3xTF32), the blocks' bitmaps masking S to −∞, an online softmax (running max from −∞,
//! running sum, f32 accumulator), and O += P V by `mma.sync` with P straight from S's
//! registers (f16/bf16, or tf32 for f32). No score reaches device memory.
//!
//! Work is a list of units (a window's block range) in largest-first order; each (unit, head)
//! is taken by a group of warps splitting the head's features into slices. Windows with more
//! blocks than a chunk are cut into several units, each leaving an exact (max, sum, f32
//! accumulator) partial per row; the last unit of a window to finish merges them in the same
//! launch (an atomic counter per split window and head). No per-row buffer, so no degree limit.
//!
//! The rows may be renumbered first ([`Reorder`]: a locality or degree order, chosen by
//! counting K/V row gathers at plan time), zero-copy: the BSB is built from the row-permuted
//! graph with the original column ids (so K and V are gathered from the caller's arrays), and
//! the kernel loads Q and stores out through the per-row original-id array.
//!
//! [`FusedTensorCore::forward_with_extras`] adds a score bias and dropout in the caller's CSR
//! order (the `_x` kernels): each block's edges are numbered in bit order from the block's first
//! edge; a per-edge array names each one's caller edge ([`OrderedBsb::edge_map`]), through which
//! the bias and the dropout's keep bits are gathered into that numbering before each launch
//! (`BsbExtrasStage`), where the kernel reads them. Edge features (f16 / bf16 heads of 64 or
//! 128 features, the pipelined kernels' `_xf` twins) are read in the kernel through the same
//! array, without a copy.
//!
//! The units and their order are built in `schedule`.

#[cfg(test)]
mod probes;
mod schedule;
#[cfg(test)]
pub(crate) mod tests;

// The schedule is also the tensor-core backward's (`crate::backward::tc`).
pub(crate) use schedule::{default_chunk, Schedule};

use super::CsrExtras;
use crate::device_bsb::{
    bsb_pipe_feat_warp_bytes, bsb_pipe_supports, bsb_pipe_warp_bytes, bsb_pipe_x_bytes,
    BSB_MERGE_FLOATS,
};
use crate::device_bsb::{
    check_structure_graph, BsbBlocks, BsbExtrasStage, GatheredBsbExtras, OrderedBsb,
    BSB_WINDOW_ROWS,
};
use crate::launch::{
    blocks_for, check_per_edge, check_same_gpu, kernel_named, launch, to_u32, LaunchConfig,
    PushKernelArg, PushOptionalArg,
};
use crate::rows::{padded_heads, resize_rows, vec_padded};
use crate::{DType, DTypeKind, DeviceGraph, DeviceMatrix, DeviceVec, Gpu, Shape};
use spattn_kernels_sys::FUSED_BSB;
use std::sync::Arc;

use crate::error::{Error, Result};
use spattn_formats::Reorder;

/// The name in errors and reports.
const KERNEL: &str = "fused-tc";

/// Largest number of warps sharing one (unit, head): CTAs stay within the kernels' launch
/// bound of 256 threads.
const MAX_GROUP_WARPS: usize = 8;
/// Warps per CTA the launcher aims for (several groups per CTA when a group is small).
const CTA_WARPS: usize = 4;
/// Warps per CTA of the pipelined kernel: at 128 features shared memory holds only two 4-warp
/// CTAs per SM, and 2-warp CTAs fill it more finely (docs/kernels/fused-tc.md, "Tried and kept").
const PIPE_CTA_WARPS: usize = 2;
/// Rows per BSB window (the kernel's tile height).
const WINDOW_ROWS: usize = BSB_WINDOW_ROWS;
/// Floats of a group's merge scratch in shared memory (`BSB_MERGE_FLOATS` in the kernel).
const MERGE_FLOATS: usize = BSB_MERGE_FLOATS;
/// Words of a unit's prologue record for the 128-feature pipelined kernel (`BSB_PIPE_PRE_WORDS` in
/// attention_tiles.cuh, 48): the 16 slots' columns of its first two steps, then its window's
/// caller rows.
const PRE_WORDS: usize = 2 * 16 + WINDOW_ROWS;

/// Feature slices compiled per warp (`fused_bsb_{dtype}_s{slice}`).
fn slices(dtype: DTypeKind) -> &'static [usize] {
    match dtype {
        DTypeKind::F32 => &[32, 64],
        DTypeKind::F16 | DTypeKind::Bf16 => &[32, 64, 128],
    }
}

/// How the kernel covers one head: `group` warps of `slice` features each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Features per warp (32, 64 or 128).
    pub slice: usize,
    /// Warps per (unit, head).
    pub group: usize,
    /// Whether the pipelined kernel runs (K and V tiles through shared memory; f16/bf16 heads
    /// of exactly 64 or 128 features, one warp per head).
    pub pipelined: bool,
}

impl Layout {
    /// Features of the head the group covers (`head_dim` rounded up to whole slices).
    fn padded(&self) -> usize {
        self.slice * self.group
    }
}

/// The layout for `head_dim` features of `dtype`: `slice` if given (for tuning), else the one
/// with the fewest warps per head, then the least padding: warps exchanging partial scores
/// every step cost more than one warp's padding (docs/kernels/fused-tc.md, "Host-side choices").
///
/// f16/bf16 heads of exactly 64 or 128 features get the pipelined kernel unless `pipelined` is
/// false or a slice is asked for (docs/kernels/fused-tc.md, "Tried and kept").
pub(crate) fn layout_with(
    head_dim: usize,
    dtype: DTypeKind,
    slice: Option<usize>,
    pipelined: bool,
) -> Result<Layout> {
    let unsupported = |why: String| Error::Unsupported {
        kernel: KERNEL,
        why,
    };
    if head_dim == 0 {
        return Err(unsupported("head_dim must be at least 1".into()));
    }
    if pipelined && slice.is_none() && bsb_pipe_supports(dtype, head_dim) {
        return Ok(Layout {
            slice: head_dim,
            group: 1,
            pipelined: true,
        });
    }
    let candidates = slices(dtype);
    let fit = |s: usize| Layout {
        slice: s,
        group: head_dim.div_ceil(s),
        pipelined: false,
    };
    let chosen = match slice {
        Some(s) if candidates.contains(&s) => Some(fit(s)),
        Some(s) => {
            return Err(unsupported(format!(
                "no kernel with {s} features per warp for {dtype} (compiled: {candidates:?})"
            )))
        }
        None => candidates
            .iter()
            .map(|&s| fit(s))
            .filter(|l| l.group <= MAX_GROUP_WARPS)
            .min_by_key(|l| (l.group, l.padded())),
    };
    match chosen {
        Some(l) if l.group <= MAX_GROUP_WARPS => Ok(l),
        _ => {
            let widest = candidates.iter().max().copied().unwrap_or(0);
            Err(unsupported(format!(
                "head_dim {head_dim} needs more than {MAX_GROUP_WARPS} warps of at most \
                 {widest} features for {dtype} (head_dim ≤ {}); use fused-csr or unfused-csr",
                MAX_GROUP_WARPS * widest
            )))
        }
    }
}

/// Tuning knobs (defaults: [`layout_with`]'s layout, the chunk from the graph, the kernel's
/// warps per CTA).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Options {
    /// Features per warp.
    pub slice: Option<usize>,
    /// Most blocks per unit before a window is split.
    pub chunk: Option<usize>,
    /// Warps per CTA (at least one group); `None`: [`CTA_WARPS`], or [`PIPE_CTA_WARPS`] for the
    /// pipelined kernel.
    pub cta_warps: Option<usize>,
    /// Whether the pipelined kernel may run where it applies (false: the register kernels).
    pub pipelined: bool,
    /// A two-phase schedule ([`Schedule::phased`]) whose phase 0 takes the blocks whose
    /// columns all lie in `start..end` (a rank's own K/V rows); `None`: one phase.
    pub own_columns: Option<(u32, u32)>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            slice: None,
            chunk: None,
            cta_warps: None,
            pipelined: true,
            own_columns: None,
        }
    }
}

/// The fused tensor-core algorithm for one plan: the BSB mask on the device, the schedule, and
/// the workspace of split windows.
#[derive(Debug)]
pub struct FusedTensorCore {
    /// The mask in the plan's row order, shared through the graph's cache.
    ordered: Arc<OrderedBsb>,
    /// The graph the plan was made for ([`DeviceGraph::graph_id`]), where [`new`](Self::new)
    /// made it: its extras' edge map is the graph's.
    graph_id: Option<u64>,
    /// The 128-feature pipelined kernel's prologue records ([`Schedule::prologue`]); `None`
    /// for the other kernels.
    unit_pre: Option<DeviceVec<u32>>,
    /// The row order and its report line.
    order_info: String,
    dtype: DTypeKind,
    heads: usize,
    head_dim: usize,
    layout: Layout,
    kernel: &'static str,
    cta_warps: usize,
    n_units: usize,
    /// Units of phase 0 (all of them for a one-phase schedule): `units[..phase0_units]`.
    #[cfg_attr(not(test), allow(dead_code))] // Read by forward_phase.
    phase0_units: usize,
    units: DeviceVec<u32>,
    unit_split: DeviceVec<u32>,
    split_part_first: DeviceVec<u32>,
    /// (max, sum) per partial, head and window row.
    part_ml: DeviceVec<f32>,
    /// Accumulator per partial, head, window row and padded feature.
    part_acc: DeviceVec<f32>,
    /// Arrivals per split window and head; every launch leaves them at 0.
    counters: DeviceVec<u32>,
    /// The extras of each call in the kernel's edge order.
    stage: BsbExtrasStage,
}

impl FusedTensorCore {
    /// Whether the fused tensor-core kernel can run heads of `head_dim` features of `dtype`; the
    /// error says why not and what to use instead.
    pub fn supports(head_dim: usize, dtype: DTypeKind) -> Result<()> {
        layout_with(head_dim, dtype, None, true).map(|_| ())
    }

    /// Plans for `heads × head_dim` of `T` over `graph`'s BSB with its rows renumbered as
    /// `reorder` says (made once per graph and order, `DeviceGraph::bsb_in`).
    ///
    /// Errors: [`Error::Unsupported`] for a head too wide or a device older than sm_80;
    /// [`Error::TooLarge`] for sizes past the kernels' 32-bit indices, driver and memory
    /// failures.
    pub fn new<T: DType>(
        graph: &DeviceGraph,
        heads: usize,
        head_dim: usize,
        reorder: Reorder,
    ) -> Result<Self> {
        // The head's layout and the device before the BSB is built.
        layout_with(head_dim, T::KIND, None, true)?;
        require_tensor_cores(graph.gpu())?;
        let ordered = graph.bsb_in(reorder)?;
        let mut plan =
            Self::with_options::<T>(graph.gpu(), ordered, heads, head_dim, Options::default())?;
        plan.graph_id = Some(graph.graph_id());
        Ok(plan)
    }

    /// The row order and the kernel the plan uses, for its report.
    pub fn info(&self) -> &str {
        &self.order_info
    }

    /// Whether the plan's kernel takes edge features ([`forward_with_extras`]: f16 / bf16 heads
    /// of 64 or 128 features, its pipelined kernel).
    ///
    /// [`forward_with_extras`]: Self::forward_with_extras
    pub fn takes_edge_features(&self) -> bool {
        self.layout.pipelined
    }

    /// Builds the schedule of `ordered` and sizes the workspace for `heads × head_dim` of `T`,
    /// with the layout, chunk and CTA size of `options` where given.
    pub(crate) fn with_options<T: DType>(
        gpu: &Gpu,
        ordered: Arc<OrderedBsb>,
        heads: usize,
        head_dim: usize,
        options: Options,
    ) -> Result<Self> {
        let layout = layout_with(head_dim, T::KIND, options.slice, options.pipelined)?;
        require_tensor_cores(gpu)?;
        let bsb = &ordered.layout;
        let order = &ordered.order;
        if heads == 0 {
            return Err(Error::InvalidArgument {
                what: "heads",
                why: "must be at least 1".into(),
            });
        }
        let kernel = kernel_name(T::NAME, layout)?;
        let cta_warps = options
            .cta_warps
            .unwrap_or(if layout.pipelined {
                PIPE_CTA_WARPS
            } else {
                CTA_WARPS
            })
            .max(1);
        if layout.pipelined {
            // The opt-in past 48 KiB is a property of the function: set once, here.
            gpu.load_function_with_shared(
                FUSED_BSB.name,
                FUSED_BSB.ptx,
                kernel,
                cta_warps * bsb_pipe_warp_bytes(head_dim, false, 0),
                "setting the fused tensor-core kernel's shared memory",
            )?;
        }
        let chunk = options
            .chunk
            .unwrap_or_else(|| default_chunk(bsb.n_blocks(), heads, layout.group, gpu.sm_count()));
        let (schedule, phase0_units) = match options.own_columns {
            Some((start, end)) => Schedule::phased(ordered.host()?, chunk, start..end)?,
            None => {
                let s = Schedule::new(bsb, chunk)?;
                let n = s.n_units();
                (s, n)
            }
        };
        // The kernel indexes items and window rows in 32 bits.
        to_u32("units × heads", schedule.n_units() * heads)?;
        to_u32("heads × head_dim", heads * head_dim)?;
        let rows = schedule.n_parts() * heads * WINDOW_ROWS;
        to_u32("rows", bsb.n_rows())?;
        let row_ids = order.row_ids();
        if row_ids.is_some_and(|ids| ids.len() != bsb.n_rows()) {
            return Err(Error::InvalidArgument {
                what: "row order",
                why: format!(
                    "{} caller rows for a BSB of {} rows",
                    row_ids.map_or(0, <[u32]>::len),
                    bsb.n_rows()
                ),
            });
        }
        let units = DeviceVec::from_host(gpu, &schedule.units)?;
        // Only the 128-feature pipelined kernel reads them (fused_bsb.cu says why).
        let unit_pre = if layout.pipelined && layout.slice == 128 {
            Some(device_prologue(gpu, &units, &ordered)?)
        } else {
            None
        };
        Ok(Self {
            graph_id: None,
            order_info: match vec_padded(head_dim, T::KIND.size_bytes()) {
                padded if padded == head_dim => format!("{}; kernel {kernel}", ordered.info()),
                padded => format!(
                    "{}; kernel {kernel} (heads padded to {padded})",
                    ordered.info()
                ),
            },
            ordered,
            unit_pre,
            dtype: T::KIND,
            heads,
            head_dim,
            layout,
            kernel,
            cta_warps,
            n_units: schedule.n_units(),
            phase0_units,
            units,
            unit_split: DeviceVec::from_host(gpu, &schedule.unit_split)?,
            split_part_first: DeviceVec::from_host(gpu, &schedule.split_part_first)?,
            part_ml: DeviceVec::zeros(gpu, rows * 2)?,
            part_acc: DeviceVec::zeros(gpu, rows * layout.padded())?,
            counters: DeviceVec::zeros(gpu, schedule.n_split() * heads)?,
            stage: BsbExtrasStage::default(),
        })
    }

    /// `out = softmax(scale · Q Kᵀ ⊙ A) · V` in one kernel. Q and out are
    /// `n_rows × heads × head_dim`, K and V `n_cols × heads × head_dim`.
    ///
    /// Errors: [`Error::InvalidArgument`] for another dtype than planned or a scale whose
    /// log2-domain value is not finite, [`Error::ShapeMismatch`] naming the operand,
    /// [`Error::ForeignGpu`] for an operand of another GPU handle, a failed launch.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<T: DType>(
        &mut self,
        gpu: &Gpu,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        scale: f32,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        self.run(gpu, (q, k, v), scale, None, 0..self.n_units, out, None)
    }

    /// [`forward`](Self::forward) that also writes each row's softmax statistic into `lse`
    /// (`n_rows × heads` f32, row-major by row then head): the log-sum-exp of the row's scores
    /// in the kernels' log2 domain, `log2 Σ_j 2^(scale · log2(e) · ⟨q_i, k_j⟩)` (0 for a row
    /// without edges). [`crate::backward::TensorCoreBackward::run`] takes it with the output
    /// in place of its statistics pass.
    ///
    /// Errors: as [`forward`](Self::forward); [`Error::LengthMismatch`] for an `lse` of
    /// another length, [`Error::ForeignGpu`]; [`Error::Unsupported`] for f16 / bf16 heads of
    /// exactly 128 features (their pipelined kernel has no `lse` twin: nothing takes them).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_with_lse<T: DType>(
        &mut self,
        gpu: &Gpu,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        scale: f32,
        out: &mut DeviceMatrix<T>,
        lse: &mut DeviceVec<f32>,
    ) -> Result<()> {
        if self.layout.pipelined && self.layout.slice != LSE_PIPE_SLICE {
            return Err(Error::Unsupported {
                kernel: KERNEL,
                why: format!(
                    "row statistics from the {}-feature pipelined kernel (the tensor-core \
                     backward that takes them holds heads up to {LSE_PIPE_SLICE})",
                    self.layout.slice
                ),
            });
        }
        let rows = self.ordered.device.n_rows();
        check_per_edge("lse (rows × heads)", rows, self.heads, lse.len())?;
        check_same_gpu(gpu, "lse", &*lse)?;
        self.run(gpu, (q, k, v), scale, None, 0..self.n_units, out, Some(lse))
    }

    /// One phase of a plan built with [`Options::own_columns`]: phase 0 runs the blocks whose
    /// columns are all the rank's own (their K/V rows may be all that has arrived), phase 1
    /// the rest, and the parts of each split window merge in whichever launch finishes them;
    /// phase 0 then phase 1 on one stream is [`forward`](Self::forward). A one-phase plan runs
    /// everything in phase 0 and nothing in phase 1.
    ///
    /// Errors: as [`forward`](Self::forward); [`Error::InvalidArgument`] for a phase past 1.
    #[cfg_attr(not(test), allow(dead_code))] // The overlapped partitioned forward is its user.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_phase<T: DType>(
        &mut self,
        gpu: &Gpu,
        (q, k, v): (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
        scale: f32,
        phase: usize,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        let units = match phase {
            0 => 0..self.phase0_units,
            1 => self.phase0_units..self.n_units,
            _ => {
                return Err(Error::InvalidArgument {
                    what: "phase",
                    why: format!("{phase}: a schedule has phases 0 and 1"),
                })
            }
        };
        self.run(gpu, (q, k, v), scale, None, units, out, None)
    }

    /// [`forward`](Self::forward) with a score bias and dropout (see `spattn::extras`) in the
    /// same kernel, given in the CSR order of `graph`, the graph this plan was built from. The
    /// first call maps the BSB's edges to `graph`'s (4 bytes per edge and per block on the
    /// device, kept with the BSB: made on the device for a BSB in the graph's own row order,
    /// on the host from its CSR for a reordered one); each call gathers the extras into the
    /// kernel's edge order (4 bytes per edge and bias row, 1 bit per edge and head, kept).
    ///
    /// Edge features (`nnz × heads × head_dim`, added to K and V; f16 / bf16 heads of 64 or 128
    /// features, [`takes_edge_features`](Self::takes_edge_features)) run the pipelined kernel's
    /// `_xf` twin: both of their products, with the scores and with the probabilities, go
    /// through tensor cores 16 edges at a time, each step's feature rows staged with its K and V
    /// rows, read through the edge map from the caller's order without a copy.
    ///
    /// Errors: as [`forward`](Self::forward); [`Error::Unsupported`] for edge features on
    /// another head or dtype (fused-csr takes them); a bias that is not `nnz × heads` (or
    /// `nnz`, shared) or features that are not `nnz × heads × head_dim`;
    /// [`Error::InvalidArgument`] where `graph` is not the plan's.
    pub fn forward_with_extras<T: DType>(
        &mut self,
        gpu: &Gpu,
        graph: &DeviceGraph,
        (q, k, v): (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
        scale: f32,
        extras: &CsrExtras<'_, T>,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        check_same_gpu(gpu, "BSB mask", &self.ordered.device)?;
        // The plan's graph: the cached map indexes the bias by its rows and edges.
        let bsb = &self.ordered.layout;
        check_structure_graph(
            ("graph of the BSB", "BSB"),
            (bsb.n_rows(), bsb.nnz()),
            (graph.n_rows(), graph.nnz()),
        )?;
        if self.graph_id.is_some_and(|id| id != graph.graph_id()) {
            return Err(Error::InvalidArgument {
                what: "graph",
                why: "the plan was made for another graph of the same size".into(),
            });
        }
        if extras.edge_features.is_some() {
            check_feature_layout(self.layout, self.dtype, self.head_dim)?;
        }
        extras.check(gpu, KERNEL, graph.nnz(), q.shape(), true)?;
        // Per block its first edge, and per edge in block-and-bit order its caller CSR edge:
        // built once per BSB (the backward's passes over A share it).
        graph.edge_map_of(&self.ordered)?;
        self.run(
            gpu,
            (q, k, v),
            scale,
            Some(extras),
            0..self.n_units,
            out,
            None,
        )
    }

    /// Launches the units `units` (a range of the schedule's, all of them but for a phase),
    /// writing the rows' lse where given (its length checked by the caller).
    #[allow(clippy::too_many_arguments)]
    fn run<T: DType>(
        &mut self,
        gpu: &Gpu,
        (q, k, v): (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
        scale: f32,
        extras: Option<&CsrExtras<'_, T>>,
        units: std::ops::Range<usize>,
        out: &mut DeviceMatrix<T>,
        lse: Option<&mut DeviceVec<f32>>,
    ) -> Result<()> {
        if T::KIND != self.dtype {
            return Err(Error::InvalidArgument {
                what: "dtype",
                why: format!("planned for {}, run with {}", self.dtype, T::KIND),
            });
        }
        let bsb = &self.ordered.device;
        let shape_q = Shape {
            rows: bsb.n_rows(),
            heads: self.heads,
            head_dim: self.head_dim,
        };
        let shape_kv = Shape {
            rows: bsb.n_cols(),
            ..shape_q
        };
        for (what, actual, expected) in [
            ("Q", q.shape(), shape_q),
            ("K", k.shape(), shape_kv),
            ("V", v.shape(), shape_kv),
            ("out", out.shape(), shape_q),
        ] {
            if actual != expected {
                return Err(Error::ShapeMismatch {
                    what,
                    expected,
                    actual,
                });
            }
        }
        check_same_gpu(gpu, "BSB mask", bsb)?;
        check_same_gpu(gpu, "Q", q)?;
        check_same_gpu(gpu, "K", k)?;
        check_same_gpu(gpu, "V", v)?;
        check_same_gpu(gpu, "out", out)?;
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        if !scale_log2.is_finite() {
            return Err(Error::InvalidArgument {
                what: "scale",
                why: format!("{scale} is not finite in the kernel's log2 domain"),
            });
        }

        // Heads of other lengths run on copies padded with zeros to whole 16-byte vectors (the
        // kernels read and write rows in 16-byte pieces), and the output is cut back. A phase
        // copies out's rows in too: the rows the other phase writes keep their values (a whole
        // schedule writes every row: empty windows have a unit that writes zeros).
        if units.is_empty() {
            return Ok(()); // nothing to launch (phase 1 of a one-phase plan)
        }
        let whole = units == (0..self.n_units);
        // (Phase 0's copies of K and V take halo rows that may still be arriving on another
        // stream: its blocks read none of them, and phase 1 copies them again once they are in.)
        let d = self.head_dim;
        let dp = vec_padded(d, std::mem::size_of::<T>());
        let mut padded = None;
        if dp != d {
            let what = "fused-tc operand padded to 16-byte rows";
            let mats = [(q, true), (k, true), (v, true), (&*out, !whole)];
            let [qp, kp, vp, op] = padded_heads(gpu, what, (d, dp), mats)?;
            padded = Some((qp, kp, vp, op));
        }
        let (q, k, v, run_dim, out_run) = match padded.as_mut() {
            Some((qp, kp, vp, op)) => (&*qp, &*kp, &*vp, dp, op),
            None => (q, k, v, d, &mut *out),
        };
        // Edge features: the pipelined kernel's `_xf` twin (forward_with_extras checked that the
        // plan runs it; its heads are whole vectors, never padded).
        let feats = extras.and_then(|e| e.edge_features);

        let Layout {
            slice,
            group,
            pipelined,
            ..
        } = self.layout;
        // The extras first: which of them a launch takes picks the pipelined kernel and its
        // stages.
        let gathered = match (extras, self.ordered.cached_edge_map()) {
            (Some(e), Some((starts, ids))) => {
                let blocks = BsbBlocks {
                    bitmaps: bsb.bitmap_words(),
                    block_edge_start: starts,
                    n_blocks: bsb.n_blocks(),
                };
                Some(self.stage.gather(gpu, ids, blocks, self.heads, e)?)
            }
            (Some(_), None) => {
                return Err(Error::InvalidArgument {
                    what: "extras",
                    why: "the BSB edge map was not built".into(),
                })
            }
            (None, _) => None,
        };
        // Extras that change nothing (no bias, dropout at rate 0) run the plain kernel.
        let takes = gathered
            .as_ref()
            .map_or((false, false), GatheredBsbExtras::takes);
        let gathered =
            gathered.filter(|_| !pipelined || takes != (false, false) || feats.is_some());
        let groups_per_cta = (self.cta_warps / group).max(1);
        let threads = (groups_per_cta * group * 32) as u32;
        let xs_floats = if group > 1 { 2 * group * 256 } else { 0 };
        let smem = if pipelined && feats.is_some() {
            groups_per_cta * bsb_pipe_feat_warp_bytes(self.head_dim)
        } else if pipelined {
            groups_per_cta
                * bsb_pipe_warp_bytes(self.head_dim, false, bsb_pipe_x_bytes(takes.0, takes.1))
        } else {
            groups_per_cta * (xs_floats + MERGE_FLOATS) * std::mem::size_of::<f32>()
        };
        let n_items = units.len() * self.heads;
        if n_items == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks_for(n_items, groups_per_cta as u32)?, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let n_items_u = to_u32("units × heads", n_items)?;
        let heads = to_u32("heads", self.heads)?;
        let head_dim = to_u32("head_dim", run_dim)?;
        let fs = to_u32("warps per group", group)?;
        let n_rows = to_u32("rows", bsb.n_rows())?;
        if let Some(ids) = &self.ordered.row_ids {
            check_same_gpu(gpu, "row ids", ids)?;
        }
        if let Some(pre) = &self.unit_pre {
            check_same_gpu(gpu, "unit records", pre)?;
        }
        if gathered.is_some() && lse.is_some() {
            return Err(Error::InvalidArgument {
                what: "lse",
                why: "the kernels with extras do not write row statistics".into(),
            });
        }
        let kernel = match (&gathered, &lse) {
            (Some(_), _) if feats.is_some() => {
                kernel_named(&FUSED_BSB, feature_kernel(self.kernel))?
            }
            (Some(_), _) => kernel_named(&FUSED_BSB, extras_kernel(self.kernel, pipelined, takes))?,
            (None, Some(_)) if pipelined => kernel_named(&FUSED_BSB, lse_kernel(self.kernel))?,
            (None, _) => self.kernel,
        };
        // The pipelined kernels' stages may pass 48 KiB: the opt-in is per function (made once).
        let f = if pipelined {
            gpu.load_function_with_shared(
                FUSED_BSB.name,
                FUSED_BSB.ptx,
                kernel,
                smem,
                "setting the fused tensor-core kernel's shared memory",
            )?
        } else {
            gpu.load_function(FUSED_BSB.name, FUSED_BSB.ptx, kernel)?
        };
        // The kernel reads unit u of its launch at units[u], unit_split[u] and unit_pre[u]:
        // views from the range's first unit.
        let units_v = self.units.slice().slice(4 * units.start..4 * units.end);
        let split_v = self.unit_split.slice().slice(units.clone());
        let pre_v = self.unit_pre.as_ref().map(|p| {
            p.slice()
                .slice(PRE_WORDS * units.start..PRE_WORDS * units.end)
        });
        let mut args = gpu.launch_builder(&f);
        args.arg(&units_v)
            .arg(&split_v)
            .arg(self.split_part_first.slice())
            .arg(&n_items_u)
            .arg(&heads)
            .arg(&head_dim)
            .arg(&fs)
            .arg(&n_rows)
            .arg_or_null(self.ordered.row_ids.as_ref())
            .view_or_null(pre_v.as_ref())
            .arg(bsb.block_columns().slice())
            .arg(bsb.bitmap_words().slice())
            .arg(q.slice())
            .arg(k.slice())
            .arg(v.slice())
            .arg(&scale_log2)
            .arg(out_run.slice_mut())
            .arg_or_null_mut(lse)
            .arg(self.part_ml.slice_mut())
            .arg(self.part_acc.slice_mut())
            .arg(self.counters.slice_mut());
        if let Some(g) = &gathered {
            g.push(&mut args);
        }
        // Features come with extras, whose gather above built the edge map; the `_xf` kernel
        // takes both, so a missing map is an error, never a launch short of two arguments.
        if let Some(f) = feats {
            let (_, ids) =
                self.ordered
                    .cached_edge_map()
                    .ok_or_else(|| Error::InvalidArgument {
                        what: "edge features",
                        why: "the BSB's edge map was not built before the launch".into(),
                    })?;
            args.arg(f.slice()).arg(ids.slice());
        }
        debug_assert_eq!(slice * group, self.layout.padded());
        // SAFETY: items < (units in the range) × heads, each reading its unit through the views
        // that start at the range's first unit (4 words, 1 and PRE_WORDS a unit); row_ids, when given, holds one caller row < n_rows
        // per row of the (row-permuted) BSB (n_rows entries, a permutation's old_of_new), and
        // only rows < n_rows are looked up; the 128-feature pipelined kernels read PRE_WORDS
        // records of units < n_units from unit_pre (given exactly for those kernels), whose
        // columns are block columns or NONE and whose rows are caller rows < n_rows or NONE
        // (`Schedule::prologue`); each unit's 4 entries lie in `units` (4 × n_units),
        // its split in `unit_split` (n_units) and `split_part_first` (n_split + 1). A unit's
        // blocks lie in [0, n_blocks): block_columns holds 8 and bitmap_words 2 u64 per block.
        // Q and out rows read and written are window rows < n_rows (lse, where given, at
        // (caller row < n_rows) × heads + head: n_rows × heads floats, checked by the caller), K and V rows are real
        // block columns < n_cols (padding slots are never loaded), each heads × head_dim long
        // (shapes checked above; for heads that are not whole 16-byte vectors those of the
        // padded copies: heads × head_dim with head_dim the padded length), at features
        // < head_dim in 16-byte accesses: head_dim × sizeof(T) is a multiple of 16 (the plan's
        // where vec_padded leaves it, else the padded length). Partials (max, sum) and accumulators of part p < n_parts, head h, row r < 16 and feature
        // < slice × group lie in part_ml (n_parts × heads × 16 × 2) and part_acc
        // (n_parts × heads × 16 × slice × group); counters are per split window and head
        // (n_split × heads). Shared memory: `smem` bytes, as the kernel lays it out for
        // `groups_per_cta` groups of `group` warps (pipelined: `bsb_pipe_warp_bytes(head_dim,
        // false, extras)` per warp, the kernel's stages and merge scratch; its cp.async copies
        // read whole 16-byte chunks of K and V rows of head_dim = 64 or 128 2-byte features,
        // inside the row). Extras: block_edge_start holds n_blocks + 1 entries, a block's bits
        // numbered from its start below nnz and the last entry nnz (OrderedBsb::edge_map of
        // this plan's graph, checked against its sizes); the `_x` kernels with a bias read
        // entries blk and min(blk + 2, unit end) ≤ n_blocks and the edges' bias between them
        // (at most two blocks' 256 floats; the register kernels also the 16-byte bitmap words
        // of blocks blk, blk + 1 < unit end), the pipelined ones with dropout the 4 keep words
        // of blocks blk, blk + 1 < unit end, into the stage's extras (sized for the kernel's
        // pair by bsb_pipe_x_bytes); the gathered bias holds bias_rows × nnz floats and the keep
        // words 4 × n_blocks × heads (BsbExtrasStage::gather); the `_xb` kernel is launched
        // only with a bias, `_xd` only with keep words, `_x` with both. The `_xf` kernels
        // (edge features) read ids[p] for the kernel edges p < nnz of their steps (the edge
        // map's nnz entries, each a caller edge < nnz) and that edge's feature row at
        // id × heads × head_dim + head offset, features < head_dim in 16-byte accesses (the
        // features' shape nnz × heads × head_dim checked by CsrExtras::check, head_dim 64 or
        // 128: whole 16-byte vectors);
        // their shared memory is bsb_pipe_feat_warp_bytes(head_dim) per warp (stages with a
        // feature tile each, whose cp.async copies read whole 16-byte chunks of the rows as K's
        // do, then the features' scratch and overflow tile).
        unsafe { launch(kernel, &mut args, cfg) }?;
        if let Some((_, _, _, op)) = &padded {
            resize_rows(gpu, (dp, d), &mut [(op.as_vec(), out.as_vec_mut())])?;
        }
        Ok(())
    }
}

/// The 128-feature pipelined kernel's prologue records of the `units` (4 words each) of a
/// schedule over `ordered`, built on the device by `plan_tc_prologue` ([`PRE_WORDS`] a unit:
/// [`Schedule::prologue`] says what they hold).
fn device_prologue(
    gpu: &Gpu,
    units: &DeviceVec<u32>,
    ordered: &OrderedBsb,
) -> Result<DeviceVec<u32>> {
    let n_units = units.len() / 4;
    let len = n_units * PRE_WORDS;
    let pre = DeviceVec::<u32>::alloc(gpu, "fused-tc unit records", len, false)?;
    let bsb = &ordered.device;
    check_same_gpu(gpu, "BSB mask", bsb)?;
    if let Some(ids) = &ordered.row_ids {
        check_same_gpu(gpu, "row ids", ids)?;
    }
    let (n_units32, n_rows) = (to_u32("units", n_units)?, to_u32("rows", bsb.n_rows())?);
    let name = spattn_kernels_sys::kernel!(PLAN, "plan_tc_prologue");
    let f = gpu.load_function(
        spattn_kernels_sys::PLAN.name,
        spattn_kernels_sys::PLAN.ptx,
        name,
    )?;
    let mut args = gpu.launch_builder(&f);
    args.arg(units.slice())
        .arg(&n_units32)
        .arg(bsb.block_columns().slice())
        .arg_or_null(ordered.row_ids.as_ref())
        .arg(&n_rows)
        .arg(pre.slice());
    // SAFETY: thread i < n_units · 48 reads unit i / 48's 4 words (4 × n_units), block columns
    // of blocks below the unit's end (≤ n_blocks: 8 per block), row_ids below n_rows (n_rows
    // entries where given) and writes pre[i] (n_units · 48 allocated).
    unsafe { launch(name, &mut args, crate::launch::stride_grid(len)?) }?;
    Ok(pre)
}

/// [`Error::Unsupported`] on a device older than sm_80 (`mma.sync`).
fn require_tensor_cores(gpu: &Gpu) -> Result<()> {
    gpu.require_compute_capability("fused-tc (mma.sync)", 8, 0)
        .map_err(|e| Error::Unsupported {
            kernel: KERNEL,
            why: format!("{e}; use fused-csr"),
        })
}

/// The kernel for `dtype` (a kernel-name suffix) and `layout`, as listed in the module.
pub(crate) fn kernel_name(dtype: &str, layout: Layout) -> Result<&'static str> {
    if layout.pipelined {
        let name = format!("fused_bsb_{dtype}_d{}_pipe", layout.slice);
        return kernel_named(&FUSED_BSB, name);
    }
    // Heads that are not whole 16-byte vectors run padded to them (`run`): one kernel a slice.
    let name = format!("fused_bsb_{dtype}_s{}", layout.slice);
    kernel_named(&FUSED_BSB, name)
}

/// The slice of the one pipelined kernel with an `lse` twin.
pub(crate) const LSE_PIPE_SLICE: usize = 64;

/// The twin of the pipelined kernel `base` (of slice [`LSE_PIPE_SLICE`]) that also writes each
/// row's lse (the register kernels write it where given a non-null pointer).
pub(crate) fn lse_kernel(base: &str) -> String {
    format!("{base}_lse")
}

/// Whether a plan's `layout` (of `head_dim` features of `dtype`, for the error) has an `_xf`
/// twin (edge features): the pipelined kernels (f16 / bf16 heads of 64 or 128 features). A
/// register-kernel twin ran the forward at 0.56–0.95× the per-edge composition's speed at 8
/// heads (docs/kernels/edge-extras.md), so other heads take the composition.
pub(crate) fn check_feature_layout(
    layout: Layout,
    dtype: DTypeKind,
    head_dim: usize,
) -> Result<()> {
    if layout.pipelined {
        return Ok(());
    }
    let why = if bsb_pipe_supports(dtype, head_dim) {
        "the plan runs the register kernels (a slice asked for, or pipelining off)".to_string()
    } else {
        format!("a {dtype} head of {head_dim} features")
    };
    Err(Error::Unsupported {
        kernel: KERNEL,
        why: format!(
            "takes edge features on its pipelined kernels only (f16 / bf16 heads of 64 or 128 \
             features), not here: {why}; fused-csr takes them on any head"
        ),
    })
}

/// The `_xf` twin (edge features) of the pipelined kernel `base` ([`check_feature_layout`]);
/// the launch-name test forms it too.
pub(crate) fn feature_kernel(base: &str) -> String {
    format!("{base}_xf")
}

/// The `_x` twin of the kernel `base` that a launch with gathered extras runs: the pipelined
/// kernels have one per extra taken (`takes`: bias, dropout; `_x` for both), the others one
/// `_x`; the launch-name test forms it too.
pub(crate) fn extras_kernel(base: &str, pipelined: bool, takes: (bool, bool)) -> String {
    let suffix = match (pipelined, takes) {
        (true, (true, false)) => "_xb",
        (true, (false, true)) => "_xd",
        _ => "_x",
    };
    format!("{base}{suffix}")
}
