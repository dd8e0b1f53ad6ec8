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
//! (`BsbExtrasStage`), where the kernel reads them.

use super::CsrExtras;
use crate::device_bsb::{
    bsb_pipe_supports, bsb_pipe_warp_bytes, bsb_pipe_x_bytes, BSB_MERGE_FLOATS,
};
use crate::device_bsb::{
    check_structure_graph, BsbBlocks, BsbExtrasStage, BsbLayout, GatheredBsbExtras, OrderedBsb,
    BSB_WINDOW_ROWS,
};
use crate::launch::{
    blocks_for, check_same_gpu, kernel_named, launch, to_u32, LaunchConfig, PushKernelArg,
    PushOptionalArg,
};
use crate::{DType, DTypeKind, DeviceGraph, DeviceMatrix, DeviceVec, Gpu, Shape};
use spattn_formats::{Bsb, Csr};
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
/// Fewest blocks a unit of a split window gets by default (shared with the hybrid schedule).
const DEFAULT_MIN_CHUNK: usize = crate::device_bsb::BSB_MIN_UNIT_BLOCKS;
/// Rows per BSB window (the kernel's tile height).
const WINDOW_ROWS: usize = BSB_WINDOW_ROWS;
/// Fewest blocks a unit of a split window can get.
const MIN_CHUNK: usize = 4;
/// Most units one window is cut into (the in-kernel merge reads every part).
const MAX_PARTS: usize = crate::schedule::MAX_WINDOW_PARTS;
/// Floats of a group's merge scratch in shared memory (`BSB_MERGE_FLOATS` in the kernel).
const MERGE_FLOATS: usize = BSB_MERGE_FLOATS;
/// Marks a unit whose window is not split (`SPATTN_NONE` in the kernel).
const NONE: u32 = u32::MAX;
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
    /// Whether rows allow 16-byte accesses (`head_dim × sizeof(T)` a multiple of 16).
    pub vec: bool,
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
fn layout_with(
    head_dim: usize,
    dtype: DTypeKind,
    slice: Option<usize>,
    pipelined: bool,
) -> Result<Layout> {
    let bytes = dtype.size_bytes();
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
            vec: true,
            pipelined: true,
        });
    }
    let candidates = slices(dtype);
    let fit = |s: usize| Layout {
        slice: s,
        group: head_dim.div_ceil(s),
        vec: (head_dim * bytes) % 16 == 0,
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

/// Whether the fused tensor-core kernel can run heads of `head_dim` features of `dtype`; the
/// error says why not and what to use instead.
pub fn supports(head_dim: usize, dtype: DTypeKind) -> Result<()> {
    layout_with(head_dim, dtype, None, true).map(|_| ())
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

/// The units of work, largest first, and how split windows are merged.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Schedule {
    /// 4 per unit: window, first block, end block, part (or [`NONE`]).
    pub units: Vec<u32>,
    /// Per unit: its split window's index, or [`NONE`].
    pub unit_split: Vec<u32>,
    /// Per split window `s`, its parts are `split_part_first[s]..split_part_first[s + 1]`.
    pub split_part_first: Vec<u32>,
}

impl Schedule {
    /// Cuts every window of `bsb` into units of at most `chunk` blocks (an even number, at
    /// least [`MIN_CHUNK`], and at most [`MAX_PARTS`] units per window); windows without
    /// blocks get one unit (which writes zeros). Units are sorted by size, largest first.
    pub(crate) fn new(bsb: &BsbLayout, chunk: usize) -> Result<Self> {
        let chunk = chunk.max(MIN_CHUNK).next_multiple_of(2);
        // (blocks, window, first, end, split-or-NONE, part-or-NONE)
        let mut units: Vec<(usize, u32, u32, u32, u32, u32)> = Vec::with_capacity(bsb.n_windows());
        let mut split_part_first = vec![0u32];
        let mut n_parts = 0usize;
        for &w in bsb.window_order() {
            let blocks = bsb.window_blocks(w as usize);
            let nb = blocks.len();
            let (start, end) = (
                to_u32("BSB blocks", blocks.start)?,
                to_u32("BSB blocks", blocks.end)?,
            );
            if nb <= chunk {
                units.push((nb, w, start, end, NONE, NONE));
                continue;
            }
            let parts = nb.div_ceil(chunk).min(MAX_PARTS);
            let per = nb.div_ceil(parts).next_multiple_of(2);
            let parts = nb.div_ceil(per);
            let split = to_u32("split windows", split_part_first.len() - 1)?;
            for i in 0..parts {
                let first = blocks.start + i * per;
                let last = (first + per).min(blocks.end);
                units.push((
                    last - first,
                    w,
                    to_u32("BSB blocks", first)?,
                    to_u32("BSB blocks", last)?,
                    split,
                    to_u32("partials", n_parts + i)?,
                ));
            }
            n_parts += parts;
            split_part_first.push(to_u32("partials", n_parts)?);
        }
        // Largest first; stable, so equal sizes keep the window order.
        units.sort_by_key(|u| std::cmp::Reverse(u.0));
        Ok(Self::flatten(&units, split_part_first))
    }

    /// The schedule of `units` (blocks, window, first, end, split, part) in their order.
    fn flatten(units: &[(usize, u32, u32, u32, u32, u32)], split_part_first: Vec<u32>) -> Self {
        let mut flat = Vec::with_capacity(units.len() * 4);
        let mut unit_split = Vec::with_capacity(units.len());
        for &(_, w, first, end, split, part) in units {
            flat.extend_from_slice(&[w, first, end, part]);
            unit_split.push(split);
        }
        Self {
            units: flat,
            unit_split,
            split_part_first,
        }
    }

    /// A schedule in two phases for overlapping a partitioned plan's halo exchange: the blocks
    /// whose columns all lie in `own` (a rank's own K/V rows, one range of its halo) form the
    /// units of phase 0, which can run before the other rows arrive; the rest (blocks with a
    /// remote column) phase 1. Columns increase across a window's blocks, so a window holds at
    /// most a remote range, an own range and a remote range; each is cut into parts of at
    /// most `chunk` blocks (more where a window would pass [`MAX_PARTS`]), and a window of
    /// more than one part is a split window whose parts, in either phase, merge in-kernel
    /// (the last to finish merges, so phase 1 after phase 0 finishes every window). Windows
    /// without blocks are phase 0. Returns the schedule, phase 0's units first (each phase
    /// largest first), and phase 0's unit count.
    pub(crate) fn phased(
        bsb: &Bsb,
        chunk: usize,
        own: std::ops::Range<u32>,
    ) -> Result<(Self, usize)> {
        let chunk = chunk.max(MIN_CHUNK).next_multiple_of(2);
        let columns = bsb.block_columns();
        let first_col = |b: usize| columns[b * 8];
        // The last real column (padding only ends a window's last block).
        let last_col = |b: usize| {
            columns[b * 8..b * 8 + 8]
                .iter()
                .rev()
                .copied()
                .find(|&c| c != Bsb::PADDING)
                .unwrap_or(Bsb::PADDING)
        };
        // (phase, blocks, window, first, end, split, part)
        let mut units: Vec<(u8, usize, u32, u32, u32, u32, u32)> = Vec::new();
        let mut split_part_first = vec![0u32];
        let mut n_parts = 0usize;
        for &w in bsb.window_order() {
            let blocks = bsb.window_blocks(w as usize);
            let (s, e) = (blocks.start, blocks.end);
            // Own blocks: from the first starting at or past own.start, to the first ending at
            // or past own.end (both monotone in the block index).
            let a = partition_index(s, e, |b| first_col(b) < own.start);
            let b = partition_index(a, e, |b| last_col(b) < own.end);
            let ranges = [(1u8, s, a), (0u8, a, b), (1u8, b, e)];
            let nb = e - s;
            let per = chunk
                .max(nb.div_ceil(MAX_PARTS.saturating_sub(ranges.len()).max(1)))
                .next_multiple_of(2);
            let pieces: usize = ranges.iter().map(|&(_, x, y)| (y - x).div_ceil(per)).sum();
            let u32_of = |x: usize| to_u32("BSB blocks", x);
            if pieces <= 1 {
                // One unit (or an empty window): its phase is that of its blocks.
                let phase = ranges
                    .iter()
                    .find(|&&(_, x, y)| y > x)
                    .map_or(0, |&(p, _, _)| p);
                units.push((phase, nb, w, u32_of(s)?, u32_of(e)?, NONE, NONE));
                continue;
            }
            let split = to_u32("split windows", split_part_first.len() - 1)?;
            let mut i = 0usize;
            for &(phase, x, y) in &ranges {
                let mut f = x;
                while f < y {
                    let l = (f + per).min(y);
                    let part = to_u32("partials", n_parts + i)?;
                    units.push((phase, l - f, w, u32_of(f)?, u32_of(l)?, split, part));
                    i += 1;
                    f = l;
                }
            }
            n_parts += i;
            split_part_first.push(to_u32("partials", n_parts)?);
        }
        // Phase 0 first, then largest first (stable: equal sizes keep the window order).
        units.sort_by_key(|u| (u.0, std::cmp::Reverse(u.1)));
        let first_phase = units.iter().take_while(|u| u.0 == 0).count();
        let plain: Vec<_> = units
            .iter()
            .map(|&(_, n, w, f, l, sp, p)| (n, w, f, l, sp, p))
            .collect();
        Ok((Self::flatten(&plain, split_part_first), first_phase))
    }

    /// Number of units.
    pub(crate) fn n_units(&self) -> usize {
        self.unit_split.len()
    }

    /// Number of split windows.
    pub(crate) fn n_split(&self) -> usize {
        self.split_part_first.len() - 1
    }

    /// Number of partials (units of split windows).
    pub(crate) fn n_parts(&self) -> usize {
        self.split_part_first.last().map_or(0, |&p| p as usize)
    }

    /// The 128-feature pipelined kernel's prologue records, [`PRE_WORDS`] per unit, so that a
    /// warp's first copies and Q loads wait for one load indexed by the unit alone (the host
    /// reference of `plan_tc_prologue`, which builds them on the device: [`device_prologue`]):
    /// words `16 s + l` hold
    /// slot `l` of step `s` < 2 (block `first + 2 s + l / 8`, column `l % 8`; [`NONE`] past the
    /// unit), words 32 + r the caller row of window row r (`row_ids[16 w + r]`, or the row
    /// itself without renumbering; [`NONE`] past the matrix).
    #[cfg(test)]
    pub(crate) fn prologue(&self, bsb: &Bsb, row_ids: Option<&[u32]>) -> Vec<u32> {
        let columns = bsb.block_columns();
        let mut pre = Vec::with_capacity(self.n_units() * PRE_WORDS);
        for u in self.units.chunks_exact(4) {
            let (w, first, end) = (u[0] as usize, u[1] as usize, u[2] as usize);
            for j in 0..32 {
                let blk = first + 2 * (j / 16) + (j % 16) / 8;
                pre.push(if blk < end {
                    columns[blk * 8 + j % 8]
                } else {
                    NONE
                });
            }
            for r in 0..WINDOW_ROWS {
                let row = w * WINDOW_ROWS + r;
                pre.push(match (row < bsb.n_rows(), row_ids) {
                    (false, _) => NONE,
                    (true, Some(ids)) => ids[row],
                    // Rows fit u32: `with_options` checks n_rows before building the records.
                    (true, None) => row as u32,
                });
            }
        }
        pre
    }
}

/// The first index of `lo..hi` where `pred` (true, then false along the range) is false.
fn partition_index(mut lo: usize, mut hi: usize, pred: impl Fn(usize) -> bool) -> usize {
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The chunk for a BSB of `n_blocks` blocks with `heads` heads on `sm_count` SMs: no unit holds
/// more than about 1/(8 · SMs) of all the work, so the largest-first grid ends evenly.
pub(crate) fn default_chunk(n_blocks: usize, heads: usize, group: usize, sm_count: u32) -> usize {
    let work = n_blocks * heads * group;
    let lanes = (sm_count.max(1) as usize) * 8;
    work.div_ceil(lanes).max(DEFAULT_MIN_CHUNK)
}

/// The fused tensor-core algorithm for one plan: the BSB mask on the device, the schedule, and
/// the workspace of split windows.
#[derive(Debug)]
pub struct FusedTensorCore {
    /// The mask in the plan's row order, shared through the graph's cache.
    ordered: Arc<OrderedBsb>,
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
    /// Per block its first edge, and per edge in block-and-bit order its caller CSR edge
    /// ([`OrderedBsb::edge_map`]): built by the first forward with extras.
    edge_map: Option<(DeviceVec<u32>, DeviceVec<u32>)>,
    /// The extras of each call in the kernel's edge order.
    stage: BsbExtrasStage,
}

impl FusedTensorCore {
    /// Plans for `heads × head_dim` of `T` over `graph`'s BSB with its rows renumbered as
    /// `reorder` says (made once per graph and order, [`DeviceGraph::bsb_in`]).
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
        Self::with_options::<T>(graph.gpu(), ordered, heads, head_dim, Options::default())
    }

    /// The row order and the kernel the plan uses, for its report.
    pub fn info(&self) -> &str {
        &self.order_info
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
            order_info: format!("{}; kernel {kernel}", ordered.info()),
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
            edge_map: None,
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
        self.run(gpu, (q, k, v), scale, None, 0..self.n_units, out)
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
        self.run(gpu, (q, k, v), scale, None, units, out)
    }

    /// [`forward`](Self::forward) with a score bias and dropout (see `spattn::extras`) in the
    /// same kernel, given in the CSR order of `graph`, the graph this plan was built from. The
    /// first call maps the BSB's edges to `graph`'s (host work linear in the edges, and 4 bytes
    /// per edge and per block on the device, kept); each call gathers the extras into the
    /// kernel's edge order (4 bytes per edge and bias row, 1 bit per edge and head, kept).
    ///
    /// Errors: as [`forward`](Self::forward); [`Error::Unsupported`] for edge features (the
    /// CUDA-core algorithms take them); a bias that is not `nnz × heads` (or `nnz`, shared);
    /// [`Error::InvalidArgument`] where `graph` is not the plan's.
    pub fn forward_with_extras<T: DType>(
        &mut self,
        gpu: &Gpu,
        graph: &Csr,
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
            graph,
        )?;
        extras.check(gpu, KERNEL, graph.nnz(), q.shape(), false)?;
        if self.edge_map.is_none() {
            let (starts, ids) = self.ordered.edge_map(graph)?;
            self.edge_map = Some((
                DeviceVec::from_host_named(gpu, "BSB block edge starts", &starts)?,
                DeviceVec::from_host_named(gpu, "BSB edge ids", &ids)?,
            ));
        }
        self.run(gpu, (q, k, v), scale, Some(extras), 0..self.n_units, out)
    }

    /// Launches the units `units` (a range of the schedule's, all of them but for a phase).
    fn run<T: DType>(
        &mut self,
        gpu: &Gpu,
        (q, k, v): (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
        scale: f32,
        extras: Option<&CsrExtras<'_, T>>,
        units: std::ops::Range<usize>,
        out: &mut DeviceMatrix<T>,
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

        let Layout {
            slice,
            group,
            pipelined,
            ..
        } = self.layout;
        // The extras first: which of them a launch takes picks the pipelined kernel and its
        // stages.
        let gathered = match (extras, &self.edge_map) {
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
        let gathered = gathered.filter(|_| !pipelined || takes != (false, false));
        let groups_per_cta = (self.cta_warps / group).max(1);
        let threads = (groups_per_cta * group * 32) as u32;
        let xs_floats = if group > 1 { 2 * group * 256 } else { 0 };
        let smem = if pipelined {
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
        let head_dim = to_u32("head_dim", self.head_dim)?;
        let fs = to_u32("warps per group", group)?;
        let n_rows = to_u32("rows", bsb.n_rows())?;
        if let Some(ids) = &self.ordered.row_ids {
            check_same_gpu(gpu, "row ids", ids)?;
        }
        if let Some(pre) = &self.unit_pre {
            check_same_gpu(gpu, "unit records", pre)?;
        }
        let kernel = match (&gathered, pipelined, takes) {
            (None, ..) => self.kernel,
            (Some(_), true, (true, false)) => {
                kernel_named(&FUSED_BSB, format!("{}_xb", self.kernel))?
            }
            (Some(_), true, (false, true)) => {
                kernel_named(&FUSED_BSB, format!("{}_xd", self.kernel))?
            }
            (Some(_), ..) => kernel_named(&FUSED_BSB, format!("{}_x", self.kernel))?,
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
            .arg(out.slice_mut())
            .arg(self.part_ml.slice_mut())
            .arg(self.part_acc.slice_mut())
            .arg(self.counters.slice_mut());
        if let Some(g) = &gathered {
            g.push(&mut args);
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
        // Q and out rows read and written are window rows < n_rows, K and V rows are real
        // block columns < n_cols (padding slots are never loaded), each heads × head_dim long
        // (shapes checked above), at features < head_dim (16-byte accesses only when
        // head_dim × sizeof(T) is a multiple of 16, which `Layout::vec` selects). Partials
        // (max, sum) and accumulators of part p < n_parts, head h, row r < 16 and feature
        // < slice × group lie in part_ml (n_parts × heads × 16 × 2) and part_acc
        // (n_parts × heads × 16 × slice × group); counters are per split window and head
        // (n_split × heads). Shared memory: `smem` bytes, as the kernel lays it out for
        // `groups_per_cta` groups of `group` warps (pipelined: `bsb_pipe_warp_bytes(head_dim,
        // false, extras)` per warp, the kernel's stages and merge scratch; its cp.async copies
        // read whole 16-byte chunks of K and V rows of head_dim = 64 or 128 2-byte features,
        // inside the row). Extras: block_edge_start holds n_blocks + 1 entries, a block's bits
        // numbered from its start below nnz and the last entry nnz (OrderedBsb::edge_map of
        // this plan's graph, checked against its sizes); the pipelined kernels with a bias
        // read entries blk and min(blk + 2, unit end) ≤ n_blocks and copy the edges' bias
        // between them (at most two blocks' 256 floats), those with dropout the 4 keep words
        // of blocks blk, blk + 1 < unit end, into the stage's extras (sized for the kernel's
        // pair by bsb_pipe_x_bytes); the gathered bias holds bias_rows × nnz floats and the keep
        // words 4 × n_blocks × heads (BsbExtrasStage::gather); the `_xb` kernel is launched
        // only with a bias, `_xd` only with keep words, `_x` with both.
        unsafe { launch(kernel, &mut args, cfg) }?;
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
    let name = spattn_kernels_sys::PLAN_TC_PROLOGUE;
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
fn kernel_name(dtype: &str, layout: Layout) -> Result<&'static str> {
    if layout.pipelined {
        let name = format!("fused_bsb_{dtype}_d{}_pipe", layout.slice);
        return kernel_named(&FUSED_BSB, name);
    }
    let suffix = if layout.vec { "" } else { "_scalar" };
    let name = format!("fused_bsb_{dtype}_s{}{suffix}", layout.slice);
    kernel_named(&FUSED_BSB, name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use spattn_formats::{Csr, RowOrder};

    /// Deterministic f16 operands in [-1, 1) of `shape` on `gpu`, one pattern per seed.
    fn draw_f16(gpu: &Gpu, shape: crate::Shape, seed: usize) -> DeviceMatrix<half::f16> {
        let host: Vec<half::f16> = (0..shape.len())
            .map(|i| {
                let x = (i * 7919 + seed * 104_729) % 1000;
                half::f16::from_f32(x as f32 / 500.0 - 1.0)
            })
            .collect();
        DeviceMatrix::from_host(gpu, shape, &host).unwrap()
    }

    #[test]
    fn layouts_cover_the_head_with_least_padding() {
        for dtype in DTypeKind::ALL {
            for d in [1, 3, 8, 24, 64, 96, 100, 128, 200, 256, 512] {
                let l = layout_with(d, dtype, None, false).unwrap();
                assert!(
                    l.padded() >= d && l.group <= MAX_GROUP_WARPS,
                    "{dtype} d={d}"
                );
                let fewest = d.div_ceil(*slices(dtype).iter().max().unwrap());
                assert_eq!(l.group, fewest, "{dtype} d={d}: {l:?}");
                assert_eq!(l.vec, (d * dtype.size_bytes()) % 16 == 0);
                kernel_name(dtype.name(), l).unwrap();
            }
        }
        let l = layout_with(128, DTypeKind::F16, None, false).unwrap();
        assert_eq!(
            (l.slice, l.group, l.vec, l.pipelined),
            (128, 1, true, false)
        );
        for (d, dtype, pipelined) in [
            (128, DTypeKind::F16, true),
            (64, DTypeKind::Bf16, true),
            (96, DTypeKind::F16, false),
            (256, DTypeKind::F16, false),
            (128, DTypeKind::F32, false),
        ] {
            let l = layout_with(d, dtype, None, true).unwrap();
            assert_eq!(l.pipelined, pipelined, "{dtype} d={d}");
            if pipelined {
                assert_eq!((l.slice, l.group), (d, 1));
            }
            kernel_name(dtype.name(), l).unwrap();
        }
        // A slice asked for (tuning) runs the register kernel.
        assert!(
            !layout_with(128, DTypeKind::F16, Some(128), true)
                .unwrap()
                .pipelined
        );
        // Two CTAs of 4 warps with 128-feature stages fit an H100 SM's 228 KiB.
        assert!(2 * CTA_WARPS * bsb_pipe_warp_bytes(128, false, 0) <= 228 * 1024);
        assert!(PIPE_CTA_WARPS * bsb_pipe_warp_bytes(128, false, 0) > 48 * 1024);
        // The `_x` kernels' staged extras keep 8 warps of 128 features per H100 SM (4 CTAs of
        // PIPE_CTA_WARPS, each reserving 1 KiB of the SM's 228 KiB), as the plain kernel has;
        // at 64 features the dropout-only kernel keeps the plain kernel's 8 CTAs of 2 warps,
        // those with a bias 7.
        let sm = |warps_per_cta: usize, head_dim: usize, x: usize, ctas: usize| {
            ctas * (warps_per_cta * bsb_pipe_warp_bytes(head_dim, false, x) + 1024) <= 228 * 1024
        };
        for (bias, dropout) in [(true, false), (false, true), (true, true)] {
            let x = bsb_pipe_x_bytes(bias, dropout);
            assert!(sm(PIPE_CTA_WARPS, 128, x, 8 / PIPE_CTA_WARPS));
            let ctas64 = if bias { 7 } else { 8 };
            assert!(sm(PIPE_CTA_WARPS, 64, x, ctas64) && !sm(PIPE_CTA_WARPS, 64, x, ctas64 + 1));
        }
        let l = layout_with(24, DTypeKind::Bf16, None, false).unwrap();
        assert_eq!((l.slice, l.group), (32, 1));
        let l = layout_with(96, DTypeKind::Bf16, None, false).unwrap();
        assert_eq!((l.slice, l.group), (128, 1));
        let l = layout_with(256, DTypeKind::F32, None, false).unwrap();
        assert_eq!((l.slice, l.group), (64, 4));
        assert!(supports(1024, DTypeKind::F16).is_ok());
        assert!(matches!(
            supports(1025, DTypeKind::F16),
            Err(Error::Unsupported { .. })
        ));
        assert!(supports(512, DTypeKind::F32).is_ok());
        assert!(supports(513, DTypeKind::F32).is_err());
        assert!(supports(0, DTypeKind::F32).is_err());
        assert!(layout_with(64, DTypeKind::F32, Some(128), false).is_err());
    }

    #[test]
    fn schedule_covers_every_block_once_largest_first() {
        // Window 0: a hub row with 300 columns; window 1: empty; window 2: 3 rows of 5.
        let mut edges: Vec<(u32, u32)> = (0..300).map(|c| (3, c)).collect();
        for r in 32..35 {
            edges.extend((0..5).map(|c| (r, c * 7)));
        }
        let a = Csr::from_edges(40, 300, &edges).unwrap();
        let bsb = Bsb::from_csr(&a).unwrap();
        assert_eq!(bsb.window_blocks(0).len(), 38);
        let s = Schedule::new(&BsbLayout::of(&bsb), 16).unwrap();
        // 38 blocks in units of 16: 3 parts; windows 1 and 2 whole.
        assert_eq!(s.n_units(), 5);
        assert_eq!(s.n_split(), 1);
        assert_eq!(s.n_parts(), 3);
        assert_eq!(s.split_part_first, vec![0, 3]);
        let units: Vec<[u32; 4]> = s
            .units
            .chunks(4)
            .map(|u| [u[0], u[1], u[2], u[3]])
            .collect();
        let sizes: Vec<u32> = units.iter().map(|u| u[2] - u[1]).collect();
        assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "{sizes:?}");
        let mut covered = vec![0u32; bsb.n_blocks()];
        for u in &units {
            for b in u[1]..u[2] {
                covered[b as usize] += 1;
            }
        }
        assert!(covered.iter().all(|&c| c == 1));
        // The empty window still has its unit (it writes zeros).
        assert!(units.iter().any(|u| u[0] == 1 && u[1] == u[2]));
        let parts: Vec<u32> = units
            .iter()
            .zip(&s.unit_split)
            .filter(|(_, &sp)| sp != NONE)
            .map(|(u, _)| u[3])
            .collect();
        assert_eq!(parts.len(), 3);
        // A chunk of 2 blocks is raised to MIN_CHUNK; parts are capped at MAX_PARTS.
        assert_eq!(
            Schedule::new(&BsbLayout::of(&bsb), 2).unwrap(),
            Schedule::new(&BsbLayout::of(&bsb), MIN_CHUNK).unwrap()
        );
        let wide: Vec<(u32, u32)> = (0..20_000).map(|c| (0, c)).collect();
        let hub = Bsb::from_csr(&Csr::from_edges(1, 20_000, &wide).unwrap()).unwrap();
        let s = Schedule::new(&BsbLayout::of(&hub), 16).unwrap();
        assert!(s.n_parts() <= MAX_PARTS && s.n_parts() > 1);
    }

    #[test]
    fn phased_schedule_runs_own_blocks_first_and_every_block_once() {
        // 64 rows × 2,000 columns; own columns 700..1300. Window 0: a hub row over every
        // column; window 1: only own columns; window 2: only remote; window 3: empty.
        let mut edges: Vec<(u32, u32)> = (0..2000).map(|c| (3, c)).collect();
        edges.extend((0..40).map(|c| (17, 800 + 3 * c)));
        edges.extend((0..40).map(|c| (33, 5 * c)));
        let a = Csr::from_edges(64, 2000, &edges).unwrap();
        let bsb = Bsb::from_csr(&a).unwrap();
        let own = 700u32..1300;
        let columns = bsb.block_columns();
        let real = |b: usize| {
            columns[b * 8..b * 8 + 8]
                .iter()
                .copied()
                .filter(|&c| c != Bsb::PADDING)
        };
        for chunk in [4, 16, 1000] {
            let (s, first) = Schedule::phased(&bsb, chunk, own.clone()).unwrap();
            let units: Vec<[u32; 4]> = s
                .units
                .chunks(4)
                .map(|u| [u[0], u[1], u[2], u[3]])
                .collect();
            let mut covered = vec![0u32; bsb.n_blocks()];
            for (i, u) in units.iter().enumerate() {
                let range = u[1] as usize..u[2] as usize;
                for (b, c) in covered
                    .iter_mut()
                    .enumerate()
                    .take(range.end)
                    .skip(range.start)
                {
                    *c += 1;
                    let all_own = real(b).all(|c| own.contains(&c));
                    // Phase 0 holds exactly the blocks whose columns are all own.
                    assert_eq!(i < first, all_own, "chunk {chunk}, unit {i}, block {b}");
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "chunk {chunk}");
            // Each split window's parts are numbered once, from either phase.
            let mut parts: Vec<u32> = units
                .iter()
                .zip(&s.unit_split)
                .filter(|(_, &sp)| sp != NONE)
                .map(|(u, _)| u[3])
                .collect();
            parts.sort_unstable();
            assert!(
                parts.iter().copied().eq(0..s.n_parts() as u32),
                "chunk {chunk}"
            );
            for w in s.split_part_first.windows(2) {
                assert!(w[1] - w[0] >= 2 && (w[1] - w[0]) as usize <= MAX_PARTS);
            }
            // The hub window mixes phases, so it is split whatever the chunk; the own-only and
            // remote-only windows are whole once the chunk holds them.
            assert!(s.n_split() >= 1);
            if chunk == 1000 {
                assert_eq!(s.n_split(), 1, "{:?}", s.split_part_first);
                assert!(units.iter().any(|u| u[0] == 3 && u[1] == u[2]));
            }
        }
        // Everything own: one phase.
        let (s, first) = Schedule::phased(&bsb, 16, 0..2000).unwrap();
        assert_eq!(first, s.n_units());
        // A 20,000-column hub row is capped at MAX_PARTS parts.
        let wide: Vec<(u32, u32)> = (0..20_000).map(|c| (0, c)).collect();
        let hub = Bsb::from_csr(&Csr::from_edges(1, 20_000, &wide).unwrap()).unwrap();
        let (s, first) = Schedule::phased(&hub, 4, 5_000..15_000).unwrap();
        assert!(s.n_parts() <= MAX_PARTS && first > 0 && first < s.n_units());
    }

    #[test]
    fn prologue_records_hold_the_first_two_steps_and_the_caller_rows() {
        // Window 0: row 3 with 20 columns (3 blocks); window 1 (rows 16..18 of 18): 1 block.
        let mut edges: Vec<(u32, u32)> = (0..20).map(|c| (3, c * 2)).collect();
        edges.extend([(16, 5), (17, 6)]);
        let a = Csr::from_edges(18, 40, &edges).unwrap();
        let bsb = Bsb::from_csr(&a).unwrap();
        let s = Schedule::new(&BsbLayout::of(&bsb), 16).unwrap();
        let ids: Vec<u32> = (0..18).rev().collect();
        for row_ids in [None, Some(&ids[..])] {
            let pre = s.prologue(&bsb, row_ids);
            assert_eq!(pre.len(), s.n_units() * PRE_WORDS);
            for (u, rec) in s.units.chunks(4).zip(pre.chunks(PRE_WORDS)) {
                let (w, first, end) = (u[0] as usize, u[1] as usize, u[2] as usize);
                for (j, &got) in rec[..32].iter().enumerate() {
                    let blk = first + 2 * (j / 16) + (j % 16) / 8;
                    let want = if blk < end {
                        bsb.block_columns()[blk * 8 + j % 8]
                    } else {
                        NONE
                    };
                    assert_eq!(got, want, "unit {u:?} word {j}");
                }
                for r in 0..16 {
                    let row = w * 16 + r;
                    let want = match row_ids {
                        _ if row >= 18 => NONE,
                        Some(ids) => ids[row],
                        None => row as u32,
                    };
                    assert_eq!(rec[32 + r], want, "window {w} row {r}");
                }
            }
            // Window 0's unit: its first two steps cover blocks 0..3, all 16 slots of step 0.
            let w0 = s.units.chunks(4).position(|u| u[0] == 0).unwrap();
            let rec = &pre[w0 * PRE_WORDS..(w0 + 1) * PRE_WORDS];
            assert!(rec[..16].iter().all(|&c| c != NONE));
            // Window 1's unit: one block, so step 1 is all NONE, rows 18.. are NONE.
            let w1 = s.units.chunks(4).position(|u| u[0] == 1).unwrap();
            let rec = &pre[w1 * PRE_WORDS..(w1 + 1) * PRE_WORDS];
            assert!(rec[16..32].iter().all(|&c| c == NONE));
            assert!(rec[32 + 2..].iter().all(|&r| r == NONE));
        }
    }

    #[test]
    fn row_order_follows_the_request_and_auto_counts_gathers() {
        // A 24 × 24 grid numbered column-major in pairs of rows scrambled: a locality order
        // gathers fewer rows than the scrambled one.
        let (w, h) = (24u32, 24u32);
        let mut edges = Vec::new();
        for y in 0..h {
            for x in 0..w {
                let i = (x * 7919 + y * 104_729) % (w * h);
                let right = ((x + 1) % w * 7919 + y * 104_729) % (w * h);
                let down = (x * 7919 + (y + 1) % h * 104_729) % (w * h);
                edges.extend([(i, right), (i, down)]);
            }
        }
        let n = (w * h) as usize;
        let a = Csr::from_edges(n, n, &edges)
            .unwrap()
            .symmetrize_with_self_loops()
            .unwrap();
        let none = RowOrder::choose(&a, Reorder::None, WINDOW_ROWS).unwrap();
        assert!(none.permutation.is_none());
        assert_eq!(none.gathers, none.gathers_natural);
        let loc = RowOrder::choose(&a, Reorder::Locality, WINDOW_ROWS).unwrap();
        assert_eq!(loc.used, Reorder::Locality);
        assert!(loc.gathers < none.gathers, "{loc:?}");
        let auto = RowOrder::choose(&a, Reorder::Auto, WINDOW_ROWS).unwrap();
        assert_ne!(auto.used, Reorder::None);
        assert!(auto.gathers <= loc.gathers);
        assert!(auto.info().contains("-ordered"), "{}", auto.info());
        // A rectangular graph: the bipartite locality order when asked; Auto keeps its own
        // order where one window holds every row (nothing to save).
        let r = Csr::from_edges(3, 5, &[(0, 4), (2, 1), (2, 3)]).unwrap();
        let rl = RowOrder::choose(&r, Reorder::Locality, WINDOW_ROWS).unwrap();
        assert_eq!(rl.used, Reorder::Locality);
        assert_eq!(rl.gathers, rl.gathers_natural);
        assert_eq!(
            RowOrder::choose(&r, Reorder::Auto, WINDOW_ROWS)
                .unwrap()
                .used,
            Reorder::None
        );
        let d = RowOrder::choose(&r, Reorder::Degree, WINDOW_ROWS).unwrap();
        assert_eq!(d.used, Reorder::Degree);
        assert_eq!(d.permutation.unwrap().old_of_new()[0], 2);
    }

    /// Times the kernels, row orders, chunk sizes and CTA sizes (`SPATTN_DATA_DIR`;
    /// `SPATTN_TUNE_GRAPHS` a comma list of graph names or `rmatSCALE`, default pubmed and
    /// ogbn-arxiv; `SPATTN_TUNE_SHAPES` a comma list of HEADSxHEAD_DIM, default 1x128,1x64,8x64);
    /// prints only. Q, K and V are separate random buffers (one buffer for all three would let
    /// the kernel's evict-first Q loads evict K/V rows). "single" is the median of events
    /// around one forward (launch latency included, as spattn-bench measures), "batched" the
    /// mean of 20 back-to-back forwards.
    /// A rank-like rectangular graph (its rows × 1,000 halo columns, own columns 400..700)
    /// in two phases gives the one-launch forward's output, twice in a row (the split windows'
    /// counters are left at 0), with and without a row order, on the register and the
    /// pipelined kernels (the 128-feature one reads the unit records through the phase's view).
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_phased_forward_equals_the_one_launch_forward() {
        use crate::Shape;
        let gpu = Gpu::new(0).expect("an NVIDIA GPU");
        let (rows, cols) = (300u32, 1000u32);
        let mut edges: Vec<(u32, u32)> = (0..cols).map(|c| (5, c)).collect(); // a hub row
        let mut x = 12345u64;
        for r in 0..rows {
            for _ in 0..12 {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                // Mostly near the row's own column, some anywhere (the halo).
                let c = if (x >> 60) < 12 {
                    (400 + r + ((x >> 33) % 40) as u32) % cols
                } else {
                    ((x >> 33) % u64::from(cols)) as u32
                };
                edges.push((r, c));
            }
        }
        edges.sort_unstable();
        edges.dedup();
        let a = Csr::from_edges(rows as usize, cols as usize, &edges).unwrap();
        for reorder in [Reorder::None, Reorder::Locality] {
            let ordered = Arc::new(OrderedBsb::upload(&gpu, &a, reorder).unwrap());
            for (heads, d) in [(2, 64), (1, 128)] {
                let draw =
                    |n: usize, seed: usize| draw_f16(&gpu, Shape::new(n, heads, d).unwrap(), seed);
                let (q, k, v) = (
                    draw(rows as usize, 1),
                    draw(cols as usize, 2),
                    draw(cols as usize, 3),
                );
                let sq = Shape::new(rows as usize, heads, d).unwrap();
                let scale = 1.0 / (d as f32).sqrt();
                let mut plain = FusedTensorCore::with_options::<half::f16>(
                    &gpu,
                    ordered.clone(),
                    heads,
                    d,
                    Options::default(),
                )
                .unwrap();
                let mut want = DeviceMatrix::zeros(&gpu, sq).unwrap();
                plain.forward(&gpu, &q, &k, &v, scale, &mut want).unwrap();
                let want = want.to_host().unwrap();
                let options = Options {
                    own_columns: Some((400, 700)),
                    chunk: Some(4),
                    ..Options::default()
                };
                let mut phased = FusedTensorCore::with_options::<half::f16>(
                    &gpu,
                    ordered.clone(),
                    heads,
                    d,
                    options,
                )
                .unwrap();
                assert!(phased.phase0_units > 0 && phased.phase0_units < phased.n_units);
                // Phase 0 sees only the own rows (400..700) of K and V, the others NaN, as in a
                // halo still being received: a read of any of them would poison the output.
                let own_only = |m: &DeviceMatrix<half::f16>| {
                    let row = heads * d;
                    let mut h = m.to_host().unwrap();
                    for (r, x) in h.chunks_mut(row).enumerate() {
                        if !(400..700).contains(&r) {
                            x.fill(half::f16::NAN);
                        }
                    }
                    DeviceMatrix::from_host(&gpu, m.shape(), &h).unwrap()
                };
                let (k0, v0) = (own_only(&k), own_only(&v));
                for round in 0..2 {
                    let mut got = DeviceMatrix::zeros(&gpu, sq).unwrap();
                    got.fill_nan().unwrap();
                    phased
                        .forward_phase(&gpu, (&q, &k0, &v0), scale, 0, &mut got)
                        .unwrap();
                    phased
                        .forward_phase(&gpu, (&q, &k, &v), scale, 1, &mut got)
                        .unwrap();
                    let got = got.to_host().unwrap();
                    let (mut num, mut den) = (0.0f64, 0.0f64);
                    for (g, w) in got.iter().zip(&want) {
                        let (g, w) = (g.to_f64(), w.to_f64());
                        num += (g - w) * (g - w);
                        den += w * w;
                    }
                    let err = (num / den.max(1e-30)).sqrt();
                    // Only the split windows' merge order differs: f16 rounding of the output.
                    assert!(
                        err <= 2e-3,
                        "{reorder:?} H{heads} D{d} round {round}: rel L2 {err:e}"
                    );
                }
                assert!(phased
                    .forward_phase(
                        &gpu,
                        (&q, &k, &v),
                        scale,
                        2,
                        &mut DeviceMatrix::zeros(&gpu, sq).unwrap()
                    )
                    .is_err());
            }
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn tune() {
        use crate::Shape;
        let gpu = Gpu::new(0).expect("an NVIDIA GPU");
        let dir =
            std::env::var("SPATTN_DATA_DIR").unwrap_or_else(|_| "../../../shared/data/mtx".into());
        let graphs =
            std::env::var("SPATTN_TUNE_GRAPHS").unwrap_or_else(|_| "pubmed,ogbn-arxiv".into());
        let shapes: Vec<(usize, usize)> = std::env::var("SPATTN_TUNE_SHAPES")
            .unwrap_or_else(|_| "1x128,1x64,8x64".into())
            .split(',')
            .map(|hd| {
                let (h, d) = hd.split_once('x').expect("HEADSxHEAD_DIM");
                (h.parse().expect("heads"), d.parse().expect("head_dim"))
            })
            .collect();
        for name in graphs.split(',') {
            let a = match name.strip_prefix("rmat") {
                Some(scale) => spattn_formats::rmat(&spattn_formats::RmatConfig::benchmark(
                    scale.parse().expect("rmatSCALE"),
                ))
                .unwrap(),
                None => spattn_formats::read_matrix_market(format!("{dir}/{name}.mtx.gz"))
                    .unwrap()
                    .symmetrize_with_self_loops()
                    .unwrap(),
            };
            println!("tune {name}: n={} nnz={}", a.n_rows(), a.nnz());
            // Each row order and its BSB once, for every variant below.
            let orders: Vec<(Reorder, Arc<OrderedBsb>)> = [
                Reorder::None,
                Reorder::Degree,
                Reorder::Locality,
                Reorder::Cluster,
            ]
            .into_iter()
            .map(|r| (r, Arc::new(OrderedBsb::upload(&gpu, &a, r).unwrap())))
            .collect();
            for &(heads, d) in &shapes {
                let sq = Shape::new(a.n_rows(), heads, d).unwrap();
                let draw = |seed: usize| draw_f16(&gpu, sq, seed);
                let (q, k, v) = (draw(1), draw(2), draw(3));
                let mut out = DeviceMatrix::<half::f16>::zeros(&gpu, sq).unwrap();
                for (reorder, ordered) in &orders {
                    let mut variants = vec![Options {
                        pipelined: false,
                        ..Options::default()
                    }];
                    for cta_warps in [None, Some(1), Some(4)] {
                        for chunk in [None, Some(8), Some(16), Some(32), Some(64)] {
                            variants.push(Options {
                                chunk,
                                cta_warps,
                                ..Options::default()
                            });
                        }
                    }
                    for options in variants {
                        let Ok(mut f) = FusedTensorCore::with_options::<half::f16>(
                            &gpu,
                            ordered.clone(),
                            heads,
                            d,
                            options,
                        ) else {
                            continue;
                        };
                        let mut run = |n: usize| {
                            gpu.time_ms(|| {
                                for _ in 0..n {
                                    f.forward(&gpu, &q, &k, &v, 0.1, &mut out).map_err(|e| {
                                        crate::Error::InvalidArgument {
                                            what: "forward",
                                            why: e.to_string(),
                                        }
                                    })?;
                                }
                                Ok(())
                            })
                            .unwrap()
                        };
                        run(3);
                        let mut t: Vec<f32> = (0..25).map(|_| run(1)).collect();
                        t.sort_by(f32::total_cmp);
                        let batched = run(20) / 20.0;
                        println!(
                            "tune {name:>10} h={heads} d={d} {reorder:>8} {:>22} chunk={:<8} \
                             cta={:<8} units={:>6}: {:.4} ms single, {:.4} ms batched",
                            f.kernel,
                            format!("{:?}", options.chunk),
                            format!("{:?}", options.cta_warps),
                            f.n_units,
                            t[t.len() / 2],
                            batched
                        );
                    }
                }
            }
        }
    }
}
