//! [`DeviceBsb`]: a [`Bsb`] attention mask uploaded once, for the fused tensor-core kernels.

use std::sync::OnceLock;

use spattn_formats::{Bsb, Csr, FillStats, Reorder, RowOrder};

use cudarc::driver::LaunchArgs;
use spattn_kernels_sys::FUSED_BSB;

use crate::buffer::{DeviceElement, DeviceVec};
use crate::error::{Error, Result};
use crate::fused::{CsrExtras, KernelExtras};
use crate::gpu::Gpu;
use crate::launch::{
    blocks_for, kernel_named, launch, to_u32, LaunchConfig, OnGpu, PushKernelArg, PushOptionalArg,
};
use crate::DType;

/// Steps (pairs of 16×8 blocks) in flight per warp of the pipelined tensor-core tile loop
/// (`BSB_PIPE_STAGES` in `attention_tiles.cuh`), shared by the fused tensor-core and the hybrid
/// kernels.
pub(crate) const BSB_PIPE_STAGES: usize = 3;
/// Head widths the pipelined tile loop is compiled for (f16 and bf16).
pub(crate) const BSB_PIPE_HEAD_DIMS: [usize; 2] = [64, 128];
/// Fewest blocks a unit of a split window gets by default, in the fused tensor-core and the
/// hybrid schedules. Only graphs with fewer than 32 · 8 · SMs blocks per head see it (the unit
/// bound is otherwise about 1/(8 · SMs) of the work). 16, not 32: mid-size graphs' largest units
/// are the kernel's tail, though the smallest pay a little in merges (docs/kernels/fused-tc.md,
/// "Tried and kept").
pub(crate) const BSB_MIN_UNIT_BLOCKS: usize = 16;
/// Floats of one warp's merge scratch (`BSB_MERGE_FLOATS` in the kernels).
pub(crate) const BSB_MERGE_FLOATS: usize = 64;

/// Whether the pipelined tile loop is compiled for heads of `head_dim` features of `dtype`:
/// f16 or bf16 at one of [`BSB_PIPE_HEAD_DIMS`].
pub(crate) fn bsb_pipe_supports(dtype: crate::DTypeKind, head_dim: usize) -> bool {
    dtype != crate::DTypeKind::F32 && BSB_PIPE_HEAD_DIMS.contains(&head_dim)
}

/// Shared memory of one warp of the pipelined tile loop at `head_dim` features:
/// [`BSB_PIPE_STAGES`] stages of the K and V tiles (16 slots × `head_dim` 2-byte features
/// each; `spmm`: the V tile only), two 16-byte bitmaps and `x_bytes` of the step's extras
/// (fused-tc's `_x` kernels: [`bsb_pipe_x_bytes`]), then the merge scratch (mirrors
/// `bsb_pipe_warp_bytes` in `attention_tiles.cuh`).
pub(crate) const fn bsb_pipe_warp_bytes(head_dim: usize, spmm: bool, x_bytes: usize) -> usize {
    let tiles = if spmm { 1 } else { 2 };
    BSB_PIPE_STAGES * (tiles * 16 * head_dim * 2 + 32 + x_bytes) + BSB_MERGE_FLOATS * 4
}

/// Shared memory of one warp of fused-tc's pipelined `_xf` kernels (edge features; mirrors
/// `bsb_pipe_feat_warp_bytes` in `attention_tiles.cuh`): each stage carries the tile of its
/// step's first 16 edges' feature rows, and after the merge scratch come the features' scratch
/// ([`BSB_FEAT_FLOATS`]) and the tile of a step's chunks past its first.
pub(crate) const fn bsb_pipe_feat_warp_bytes(head_dim: usize) -> usize {
    let tile = 16 * head_dim * 2;
    bsb_pipe_warp_bytes(head_dim, false, tile) + BSB_FEAT_FLOATS * 4 + tile
}

/// Floats of a warp's edge-feature scratch in fused-tc's `_xf` kernels (`BSB_FEAT_FLOATS` in
/// `attention_tiles.cuh`): 256 per-edge values of a step, then 256 bytes of their rows.
pub(crate) const BSB_FEAT_FLOATS: usize = 320;

/// Bytes of a stage's staged extras in fused-tc's pipelined `_x` kernels (`bsb_pipe_x_bytes` in
/// `attention_tiles.cuh`): a step's bias span (256 floats at most) with a bias, its two blocks'
/// keep words (16 bytes each) with dropout.
pub(crate) const fn bsb_pipe_x_bytes(bias: bool, dropout: bool) -> usize {
    (if bias { 4 * 256 } else { 0 }) + if dropout { 32 } else { 0 }
}

/// Rows per BSB window.
pub(crate) const BSB_WINDOW_ROWS: usize = 16;

/// What the host keeps of a BSB to schedule the kernels that read it: its sizes, window offsets
/// and window order. Made from a host [`Bsb`], or from the window offsets read back from a BSB
/// built on the device (`crate::device_plan`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BsbLayout {
    n_rows: usize,
    nnz: usize,
    window_offsets: Vec<u32>,
    window_order: Vec<u32>,
    max_blocks_per_window: usize,
}

impl BsbLayout {
    /// The layout of a BSB of `n_rows` rows and `nnz` edges with these window offsets.
    pub(crate) fn new(n_rows: usize, nnz: usize, window_offsets: Vec<u32>) -> Self {
        let (window_order, max_blocks_per_window) =
            spattn_formats::bsb::order_windows(&window_offsets);
        Self {
            n_rows,
            nnz,
            window_offsets,
            window_order,
            max_blocks_per_window,
        }
    }

    /// The layout of a host BSB.
    pub(crate) fn of(bsb: &Bsb) -> Self {
        Self {
            n_rows: bsb.n_rows(),
            nnz: bsb.nnz(),
            window_offsets: bsb.window_offsets().to_vec(),
            window_order: bsb.window_order().to_vec(),
            max_blocks_per_window: bsb.fill_stats().max_blocks_per_window,
        }
    }

    pub(crate) fn n_rows(&self) -> usize {
        self.n_rows
    }
    pub(crate) fn nnz(&self) -> usize {
        self.nnz
    }
    pub(crate) fn n_windows(&self) -> usize {
        self.window_offsets.len().saturating_sub(1)
    }
    pub(crate) fn n_blocks(&self) -> usize {
        self.window_offsets.last().map_or(0, |&b| b as usize)
    }
    /// Blocks of window `w` (`w < n_windows`).
    pub(crate) fn window_blocks(&self, w: usize) -> std::ops::Range<usize> {
        self.window_offsets[w] as usize..self.window_offsets[w + 1] as usize
    }
    /// Window ids by block count, largest first, ties by id.
    pub(crate) fn window_order(&self) -> &[u32] {
        &self.window_order
    }
    pub(crate) fn max_blocks_per_window(&self) -> usize {
        self.max_blocks_per_window
    }
}

/// A BSB of a graph with its rows renumbered in a chosen order (K/V gathered by the original
/// column ids, Q and the output through the caller row of each window row), as the fused
/// tensor-core plans read it: what the host keeps to schedule it, the upload, and the order.
/// Made once per graph and order by [`crate::DeviceGraph::bsb_in`]: on the host (a host copy
/// kept), or on the device for a graph built there (a host copy downloaded only by the paths
/// that need one: the extras' edge map, a phased schedule).
#[derive(Debug)]
pub(crate) struct OrderedBsb {
    /// Sizes, window offsets and order.
    pub(crate) layout: BsbLayout,
    /// The BSB of the row-renumbered graph on the host: built there, or downloaded on first
    /// use.
    host: OnceLock<Bsb>,
    /// Its upload.
    pub(crate) device: DeviceBsb,
    /// The row order it was built in.
    pub(crate) order: RowOrder,
    /// Per window row, the caller's row, when the rows were renumbered.
    pub(crate) row_ids: Option<DeviceVec<u32>>,
    /// Wall time of the BSB's build and of its upload, ms (the order's is in `order`); `None`
    /// for one built on the device (its time is the first).
    build_ms: (f64, Option<f64>),
    /// [`edge_map`](Self::edge_map) uploaded, made by the first forward or backward with
    /// extras and shared by every plan over this BSB.
    device_edge_map: OnceLock<(DeviceVec<u32>, DeviceVec<u32>)>,
}

impl OrderedBsb {
    /// Chooses the row order `reorder` asks for ([`RowOrder::choose`] over 16-row windows),
    /// builds the BSB of `a` in it and uploads both.
    pub(crate) fn upload(gpu: &Gpu, a: &Csr, reorder: Reorder) -> Result<Self> {
        let order = RowOrder::choose(a, reorder, BSB_WINDOW_ROWS)?;
        let t = std::time::Instant::now();
        let host = match &order.permutation {
            Some(p) => Bsb::from_csr(&p.permute_csr_rows(a)?)?,
            None => Bsb::from_csr(a)?,
        };
        let built = t.elapsed().as_secs_f64() * 1e3;
        let t = std::time::Instant::now();
        let row_ids = order
            .row_ids()
            .map(|ids| DeviceVec::from_host_named(gpu, "BSB caller rows", ids))
            .transpose()?;
        let device = DeviceBsb::upload(gpu, &host)?;
        let uploaded = t.elapsed().as_secs_f64() * 1e3;
        Ok(Self {
            layout: BsbLayout::of(&host),
            device,
            host: OnceLock::from(host),
            order,
            row_ids,
            build_ms: (built, Some(uploaded)),
            device_edge_map: OnceLock::new(),
        })
    }

    /// A BSB built on the device in the graph's row order (`crate::device_plan`), which took
    /// `ms` of wall time.
    pub(crate) fn built_on_device(device: DeviceBsb, layout: BsbLayout, ms: f64) -> Self {
        Self {
            // The graph's own order; its gathers are not counted (the report says so).
            order: RowOrder {
                permutation: None,
                used: Reorder::None,
                window_rows: BSB_WINDOW_ROWS,
                gathers_natural: 0,
                gathers: 0,
                skipped: None,
                choose_ms: 0.0,
            },
            layout,
            host: OnceLock::new(),
            device,
            row_ids: None,
            build_ms: (ms, None),
            device_edge_map: OnceLock::new(),
        }
    }

    /// The BSB on the host: the one it was built from, or downloaded once (a BSB built on the
    /// device).
    pub(crate) fn host(&self) -> Result<&Bsb> {
        if let Some(b) = self.host.get() {
            return Ok(b);
        }
        let b = self.device.to_host()?;
        // Another thread may have set it meanwhile: both downloads are the same BSB.
        let _ = self.host.set(b);
        self.host.get().ok_or_else(|| Error::InvalidArgument {
            what: "BSB",
            why: "the downloaded copy was not kept".into(),
        })
    }

    /// Where the extras of `a`'s edges (the graph this was built from, in the caller's CSR
    /// order) are for the fused kernel's `_x` twins: per block, the index of its first edge in
    /// block-and-bit order (a block's bits row-major), then the edge count (n_blocks + 1
    /// entries), and per edge in that order its index in `a`'s CSR. A window's edges are its
    /// rows' edges, so windows are mapped in parallel.
    ///
    /// Errors: [`crate::Error::InvalidArgument`] where `a` is not the graph of this BSB.
    pub(crate) fn edge_map(&self, a: &Csr) -> Result<(Vec<u32>, Vec<u32>)> {
        bsb_edge_map(a, self.host()?, self.order.row_ids())
    }

    /// Whether the BSB is in its graph's own row order (no caller-row lookup).
    pub(crate) fn in_graph_order(&self) -> bool {
        self.row_ids.is_none()
    }

    /// [`edge_map`](Self::edge_map) of `a` built on the host and uploaded.
    pub(crate) fn uploaded_edge_map(
        &self,
        gpu: &Gpu,
        a: &Csr,
    ) -> Result<(DeviceVec<u32>, DeviceVec<u32>)> {
        let (starts, ids) = self.edge_map(a)?;
        Ok((
            DeviceVec::from_host_named(gpu, "BSB block edge starts", &starts)?,
            DeviceVec::from_host_named(gpu, "BSB edge ids", &ids)?,
        ))
    }

    /// The edge map on the device, made by `make` on the first call and kept
    /// (`DeviceGraph::edge_map_of` makes it from the graph this was built from).
    pub(crate) fn device_edge_map(
        &self,
        make: impl FnOnce(&Self) -> Result<(DeviceVec<u32>, DeviceVec<u32>)>,
    ) -> Result<&(DeviceVec<u32>, DeviceVec<u32>)> {
        if let Some(m) = self.device_edge_map.get() {
            return Ok(m);
        }
        let m = make(self)?;
        // Another thread may have set it meanwhile: both are the same map.
        let _ = self.device_edge_map.set(m);
        self.device_edge_map
            .get()
            .ok_or_else(|| Error::InvalidArgument {
                what: "BSB edge map",
                why: "the uploaded map was not kept".into(),
            })
    }

    /// The device edge map, where a call of [`device_edge_map`](Self::device_edge_map) made it.
    pub(crate) fn cached_edge_map(&self) -> Option<&(DeviceVec<u32>, DeviceVec<u32>)> {
        self.device_edge_map.get()
    }

    /// The row order and its K/V gathers, and how long the order, the BSB's build and its
    /// upload took, for a plan's report.
    pub(crate) fn info(&self) -> String {
        match self.build_ms {
            (built, Some(uploaded)) => format!(
                "{}; BSB built in {built:.0} ms, uploaded in {uploaded:.0} ms",
                self.order.info(),
            ),
            (built, None) => format!(
                "rows in the graph's order (a graph built on the GPU is not reordered); BSB \
                 built on the GPU in {built:.2} ms"
            ),
        }
    }

    /// Bytes of device memory it holds.
    pub(crate) fn device_bytes(&self) -> usize {
        self.device.device_bytes()
            + self.row_ids.as_ref().map_or(0, DeviceVec::allocated_bytes)
            + self
                .device_edge_map
                .get()
                .map_or(0, |(s, i)| s.allocated_bytes() + i.allocated_bytes())
    }
}

/// The tensor-core `_x` kernels' extras, gathered from the caller's CSR order before each
/// launch: the bias times log2 e of each kernel edge in its edge order (per block its first
/// edge, bits row-major; one row per head, or one shared row) by `bsb_bias_gather_*`, and the
/// dropout's keep bits in the blocks' own layout (per head and block 4 words laid out as its
/// bitmap) by `bsb_keep_gather`. The kernels then make one independent load per edge (bias) or
/// per block (keep bits) instead of a dependent id lookup and a Philox draw under a branch.
/// Kept between calls; grown when a call needs more.
#[derive(Debug, Default)]
pub(crate) struct BsbExtrasStage {
    bias: Option<DeviceVec<f32>>,
    keep: Option<DeviceVec<u32>>,
}

/// What one gather left for a `_x` launch: its `SPATTN_BSB_X_PARAMS`.
pub(crate) struct GatheredBsbExtras<'a> {
    bias: Option<&'a DeviceVec<f32>>,
    bias_rows: u32,
    block_edge_start: &'a DeviceVec<u32>,
    keep: Option<&'a DeviceVec<u32>>,
    n_edges: u32,
    n_blocks: u32,
    drop_scale: f32,
}

/// Blocks per CTA of `bsb_keep_gather` (`BSB_KEEP_GROUP` in attention_tiles.cuh).
const KEEP_GATHER_GROUP: u32 = 128;

/// The kernel gathering dropout's keep bits into the blocks' edge order (one for every type).
pub(crate) const KEEP_GATHER_KERNEL: &str = "bsb_keep_gather";

/// The kernel gathering a bias of `dtype` (a [`DType::NAME`]) into the blocks' edge order; the
/// launch-name test forms it too.
pub(crate) fn bias_gather_kernel(dtype: &str) -> String {
    format!("bsb_bias_gather_{dtype}")
}

/// The tensor-core blocks a gather numbers the edges of: per block 16 bytes of bitmap
/// (`bitmaps`, as the kernels read it: 4 words, row-major bits) and its first edge
/// (`block_edge_start`, at least `n_blocks + 1` entries: the last is the edge count, where the
/// tile loop's last step span ends).
pub(crate) struct BsbBlocks<'a, W: DeviceElement> {
    pub(crate) bitmaps: &'a DeviceVec<W>,
    pub(crate) block_edge_start: &'a DeviceVec<u32>,
    pub(crate) n_blocks: usize,
}

impl BsbExtrasStage {
    /// Gathers `extras` for a kernel whose edges are the caller's edges `ids` (per kernel edge
    /// its caller CSR edge, block by block in bit order through `blocks`), `heads` heads. The
    /// gathered arrays are written by kernels on `gpu`'s stream, which orders them before the
    /// `_x` launch that reads them.
    ///
    /// Preconditions (the callers check them: `CsrExtras::check` and the edge-map builders):
    /// every id is below the graph's edges, the bias holds edges × (1 or `heads`) values, each
    /// block's edges lie in `ids` from its start, and everything lives on `gpu`.
    ///
    /// Errors: [`Error::InvalidArgument`] when `blocks` holds fewer bitmaps than its
    /// `n_blocks` or fewer starts than `n_blocks + 1`; sizes past the kernels' u32 indices;
    /// allocation failures.
    pub(crate) fn gather<'a, T: DType, W: DeviceElement>(
        &'a mut self,
        gpu: &Gpu,
        ids: &DeviceVec<u32>,
        blocks: BsbBlocks<'a, W>,
        heads: usize,
        extras: &CsrExtras<'_, T>,
    ) -> Result<GatheredBsbExtras<'a>> {
        let n = ids.len();
        let n_edges = to_u32("tensor-core edges", n)?;
        let n_blocks = to_u32("tensor-core blocks", blocks.n_blocks)?;
        let bitmap_bytes = blocks
            .bitmaps
            .len()
            .saturating_mul(std::mem::size_of::<W>());
        // n_blocks < 2³² (checked above): the sum cannot overflow.
        if bitmap_bytes / 16 < blocks.n_blocks
            || blocks.block_edge_start.len() < blocks.n_blocks + 1
        {
            return Err(Error::InvalidArgument {
                what: "tensor-core blocks",
                why: format!(
                    "{} blocks need 16 bytes of bitmap and a first edge each, and the edge \
                     count after them; given {bitmap_bytes} bytes and {} starts",
                    blocks.n_blocks,
                    blocks.block_edge_start.len()
                ),
            });
        }
        let heads_u = to_u32("heads", heads)?;
        let ex = KernelExtras::new(extras, heads_u);
        // Threshold 0 keeps every edge: no bits to draw. Without edges the kernel reads none.
        let dropout = ex.drop.threshold != 0 && n > 0;
        let bias_rows = match &extras.bias {
            Some(_) if n > 0 => ex.bias_heads,
            _ => 0,
        };
        // n, rows < 2³²: the products fit u64, and usize where memory could hold them.
        let len = |what: &'static str, items: u64, rows: u64| -> Result<usize> {
            let value = items * rows;
            usize::try_from(value).map_err(|_| Error::TooLarge {
                what,
                value,
                limit: usize::MAX as u64,
            })
        };
        let bias_len = len(
            "gathered bias (edges × rows)",
            n as u64,
            u64::from(bias_rows),
        )?;
        let keep_len = len(
            "dropout keep words (4 × blocks × heads)",
            4 * u64::from(n_blocks),
            u64::from(heads_u),
        )?;
        if bias_rows > 0 && self.bias.as_ref().is_none_or(|b| b.len() < bias_len) {
            self.bias = None;
            self.bias = Some(DeviceVec::alloc(gpu, "gathered bias", bias_len, true)?);
        }
        if dropout && self.keep.as_ref().is_none_or(|k| k.len() < keep_len) {
            self.keep = None;
            self.keep = Some(DeviceVec::alloc(gpu, "dropout keep bits", keep_len, true)?);
        }
        let bias_out = if bias_rows > 0 {
            self.bias.as_ref()
        } else {
            None
        };
        let keep_out = if dropout { self.keep.as_ref() } else { None };
        if let (Some(out), Some(bias)) = (bias_out, &extras.bias) {
            let name = kernel_named(&FUSED_BSB, bias_gather_kernel(T::NAME))?;
            let f = gpu.load_function(FUSED_BSB.name, FUSED_BSB.ptx, name)?;
            let mut args = gpu.launch_builder(&f);
            // Written by the kernel, pushed through a shared borrow: the returned struct hands
            // the same buffer to the `_x` launch, after this one on the stream.
            args.arg(ids.slice())
                .arg(&n_edges)
                .arg(bias.values().slice())
                .arg(&ex.bias_heads)
                .arg(out.slice());
            let cfg = LaunchConfig {
                grid_dim: (blocks_for(n, 256)?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: thread p < n reads ids[p] (n entries) and the bias at ids[p] ×
            // bias_heads + h for h < bias_heads (the caller checked the bias holds nnz ×
            // bias_heads and that ids name caller edges < nnz), and writes out[h × n + p]
            // (bias_rows × n floats allocated above, bias_rows = bias_heads).
            unsafe { launch(name, &mut args, cfg) }?;
        }
        if let Some(out) = keep_out {
            let name = kernel_named(&FUSED_BSB, KEEP_GATHER_KERNEL.to_string())?;
            let f = gpu.load_function(FUSED_BSB.name, FUSED_BSB.ptx, name)?;
            let mut args = gpu.launch_builder(&f);
            args.arg(ids.slice())
                .arg(&n_edges)
                .arg(blocks.bitmaps.slice())
                .arg(blocks.block_edge_start.slice())
                .arg(&n_blocks)
                .arg(&heads_u);
            ex.push_dropout(&mut args);
            args.arg(out.slice());
            let cfg = LaunchConfig {
                grid_dim: (blocks_for(blocks.n_blocks, KEEP_GATHER_GROUP)?, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: CTA c takes blocks b < n_blocks from KEEP_GATHER_GROUP × c: it reads 16
            // bytes of bitmap at 16 b (checked above: bitmaps hold 16 × n_blocks bytes) and
            // block_edge_start[b] (n_blocks entries at least; n stands for the start past the
            // last block), then ids[p] for the edges p < n of its blocks (a block's edges lie in
            // ids, the caller's precondition), and writes keep words (h × n_blocks + b) × 4 ..
            // + 4 for h < heads (4 × n_blocks × heads words allocated above).
            unsafe { launch(name, &mut args, cfg) }?;
        }
        Ok(GatheredBsbExtras {
            bias: bias_out,
            bias_rows,
            block_edge_start: blocks.block_edge_start,
            keep: keep_out,
            n_edges,
            n_blocks,
            drop_scale: ex.drop.scale,
        })
    }
}

impl<'a> GatheredBsbExtras<'a> {
    /// Pushes `SPATTN_BSB_X_PARAMS`: the gathered bias, its rows, each block's first edge
    /// (the gather's `block_edge_start`), the keep words, the edges, the blocks and the
    /// dropout's scale.
    pub(crate) fn push(&'a self, args: &mut LaunchArgs<'a>) {
        args.arg_or_null(self.bias)
            .arg(&self.bias_rows)
            .arg(self.block_edge_start.slice())
            .arg_or_null(self.keep)
            .arg(&self.n_edges)
            .arg(&self.n_blocks)
            .arg(&self.drop_scale);
    }

    /// Whether the launch takes a bias and dropout: fused-tc's pipelined kernels have a twin
    /// for each pair (`_xb`, `_xd`, `_x`).
    pub(crate) fn takes(&self) -> (bool, bool) {
        (self.bias.is_some(), self.keep.is_some())
    }

    /// Pushes `SPATTN_BSB_X_PARAMS` for a launch without extras of a kernel whose parameter
    /// list has them (the tensor-core backward's plain passes): nulls and zeros, never read.
    pub(crate) fn push_absent(args: &mut LaunchArgs<'_>) {
        static ZERO_U32: u32 = 0;
        static ZERO_F32: f32 = 0.0;
        let null = None::<&DeviceVec<u32>>;
        args.arg_or_null(null)
            .arg(&ZERO_U32)
            .arg_or_null(null)
            .arg_or_null(null)
            .arg(&ZERO_U32)
            .arg(&ZERO_U32)
            .arg(&ZERO_F32);
    }
}

/// Checks that a graph of `(graph_rows, graph_edges)` is the graph a structure of
/// `(rows, edges)` was built from (the extras' edge maps index per-edge data by its rows and
/// edges); `what` names the operand and the structure in the error.
///
/// Errors: [`Error::InvalidArgument`] naming both sizes.
pub(crate) fn check_structure_graph(
    (what, structure): (&'static str, &str),
    (rows, edges): (usize, usize),
    (graph_rows, graph_edges): (usize, usize),
) -> Result<()> {
    if graph_rows == rows && graph_edges == edges {
        return Ok(());
    }
    Err(Error::InvalidArgument {
        what,
        why: format!(
            "the {structure} has {rows} rows and {edges} edges, the graph {graph_rows} and \
             {graph_edges}"
        ),
    })
}

/// [`OrderedBsb::edge_map`] of `bsb`, the BSB of `a` with its rows renumbered by `row_ids`
/// (per new row its row of `a`; `None`: `a`'s order).
pub(crate) fn bsb_edge_map(
    a: &Csr,
    bsb: &Bsb,
    row_ids: Option<&[u32]>,
) -> Result<(Vec<u32>, Vec<u32>)> {
    use rayon::prelude::*;
    let mismatch = |why: String| crate::Error::InvalidArgument {
        what: "graph of the BSB",
        why,
    };
    check_structure_graph(
        ("graph of the BSB", "BSB"),
        (bsb.n_rows(), bsb.nnz()),
        (a.n_rows(), a.nnz()),
    )?;
    if row_ids.is_some_and(|r| r.len() != a.n_rows()) {
        return Err(mismatch(format!(
            "the row order has {} rows, the graph {}",
            row_ids.map_or(0, <[u32]>::len),
            a.n_rows()
        )));
    }
    let rows = Bsb::WINDOW_ROWS;
    let offsets = a.row_offsets();
    let cols = a.col_indices();
    let caller = |r: usize| row_ids.map_or(r, |ids| ids[r] as usize);
    let block_columns = bsb.block_columns();
    let per_window: Vec<(Vec<u32>, Vec<u32>)> = (0..bsb.n_windows())
        .into_par_iter()
        .map(|w| {
            let first = w * rows;
            let rows_here = rows.min(a.n_rows() - first);
            // Each row's cursor into its caller row's edges (columns ascending, as the BSB's
            // slots of the row are across the window's blocks).
            let mut at: Vec<usize> = (0..rows_here)
                .map(|r| offsets[caller(first + r)] as usize)
                .collect();
            let end: Vec<usize> = (0..rows_here)
                .map(|r| offsets[caller(first + r) + 1] as usize)
                .collect();
            let mut starts = Vec::with_capacity(bsb.blocks_in_window(w));
            let mut ids = Vec::new();
            for b in bsb.window_blocks(w) {
                starts.push(ids.len() as u32);
                let slots = &block_columns[b * Bsb::BLOCK_COLS..(b + 1) * Bsb::BLOCK_COLS];
                let last = slots.iter().copied().filter(|&c| c != Bsb::PADDING).max();
                let Some(last) = last else { continue };
                for r in 0..rows_here {
                    while at[r] < end[r] && cols[at[r]] <= last {
                        // Edge indices are below nnz ≤ MAX_NNZ < 2³².
                        ids.push(at[r] as u32);
                        at[r] += 1;
                    }
                }
            }
            let complete = at == end;
            (starts, if complete { ids } else { Vec::new() })
        })
        .collect();
    let mut starts = Vec::with_capacity(bsb.n_blocks() + 1);
    let mut ids = Vec::with_capacity(a.nnz());
    for (w, (s, i)) in per_window.into_iter().enumerate() {
        let first_edge = ids.len() as u32;
        let expected: usize = bsb
            .window_blocks(w)
            .map(|b| bsb.bitmaps()[b].count_ones() as usize)
            .sum();
        if i.len() != expected {
            return Err(mismatch(format!(
                "window {w} holds {expected} edges in its bitmaps, the graph's rows {}",
                i.len()
            )));
        }
        starts.extend(s.into_iter().map(|x| x + first_edge));
        ids.extend(i);
    }
    // The end of the last block's edges: the pipelined kernel reads the end of a step's span
    // as the start of the block after it.
    starts.push(ids.len() as u32);
    Ok((starts, ids))
}

/// A BSB mask in device memory: window offsets, the column of every block slot (padding slots
/// hold [`Bsb::PADDING`]), the bitmaps as two little-endian `u64` words per block (the byte
/// image of a `u128`: a kernel may read each as one 16-byte `uint4`), the window order
/// (largest first), and the per-edge values where the matrix has them.
///
/// Uploaded once and reused by every launch; the host-side [`FillStats`] stay with it.
#[derive(Debug)]
pub(crate) struct DeviceBsb {
    n_rows: usize,
    n_cols: usize,
    fill: FillStats,
    window_offsets: DeviceVec<u32>,
    block_columns: DeviceVec<u32>,
    bitmap_words: DeviceVec<u64>,
    window_order: DeviceVec<u32>,
    values: Option<DeviceVec<f32>>,
}

impl DeviceBsb {
    /// Uploads `bsb` to `gpu`.
    ///
    /// Errors: [`crate::Error::TooLarge`] where the slots (`8 × blocks`) do not fit the
    /// kernels' 32-bit indices; allocation and copy failures.
    pub(crate) fn upload(gpu: &Gpu, bsb: &Bsb) -> Result<Self> {
        to_u32("BSB block slots", bsb.block_columns().len())?;
        Ok(DeviceBsb {
            n_rows: bsb.n_rows(),
            n_cols: bsb.n_cols(),
            fill: bsb.fill_stats(),
            window_offsets: DeviceVec::from_host_named(
                gpu,
                "BSB window offsets",
                bsb.window_offsets(),
            )?,
            block_columns: DeviceVec::from_host_named(
                gpu,
                "BSB block columns",
                bsb.block_columns(),
            )?,
            bitmap_words: DeviceVec::from_host_named(gpu, "BSB bitmaps", &bsb.bitmap_words())?,
            window_order: DeviceVec::from_host_named(gpu, "BSB window order", bsb.window_order())?,
            values: bsb
                .values()
                .map(|v| DeviceVec::from_host_named(gpu, "BSB values", v))
                .transpose()?,
        })
    }

    /// A BSB built on the device (`crate::device_plan`): `(n_rows, n_cols)`, its fill, window
    /// offsets, block columns, bitmaps (2 u64 a block) and window order.
    pub(crate) fn from_parts(
        (n_rows, n_cols): (usize, usize),
        fill: FillStats,
        window_offsets: DeviceVec<u32>,
        block_columns: DeviceVec<u32>,
        bitmap_words: DeviceVec<u64>,
        window_order: DeviceVec<u32>,
    ) -> Self {
        DeviceBsb {
            n_rows,
            n_cols,
            fill,
            window_offsets,
            block_columns,
            bitmap_words,
            window_order,
            values: None,
        }
    }

    /// The window order, downloaded (tests compare it with the host's).
    #[cfg(test)]
    pub(crate) fn window_order_host(&self) -> Result<Vec<u32>> {
        self.window_order.to_host()
    }

    /// Downloads the matrix back into a [`Bsb`] (checked by [`Bsb::try_new`]).
    pub(crate) fn to_host(&self) -> Result<Bsb> {
        let words = self.bitmap_words.to_host()?;
        let bitmaps = words
            .chunks_exact(2)
            .map(|w| u128::from(w[0]) | u128::from(w[1]) << 64)
            .collect();
        let values = self.values.as_ref().map(DeviceVec::to_host).transpose()?;
        Ok(Bsb::try_new(
            self.n_rows,
            self.n_cols,
            self.window_offsets.to_host()?,
            self.block_columns.to_host()?,
            bitmaps,
            values,
        )?)
    }

    /// Number of rows (query nodes).
    pub(crate) fn n_rows(&self) -> usize {
        self.n_rows
    }

    /// Number of columns (key nodes).
    pub(crate) fn n_cols(&self) -> usize {
        self.n_cols
    }

    /// Number of 16×8 blocks.
    pub(crate) fn n_blocks(&self) -> usize {
        self.fill.blocks
    }

    /// Fill statistics of the matrix, computed on the host at upload.
    #[cfg(test)]
    pub(crate) fn fill_stats(&self) -> &FillStats {
        &self.fill
    }

    /// The window offsets (`n_windows + 1`): window `w` holds blocks `[w]..[w + 1]`.
    pub(crate) fn window_offsets(&self) -> &DeviceVec<u32> {
        &self.window_offsets
    }

    /// The column of every slot, 8 per block; padding slots hold [`Bsb::PADDING`].
    pub(crate) fn block_columns(&self) -> &DeviceVec<u32> {
        &self.block_columns
    }

    /// The bitmaps, 2 little-endian `u64` words per block (word `2b`: rows 0–7 of block `b`,
    /// word `2b + 1`: rows 8–15), as [`Bsb::bitmap_words`].
    pub(crate) fn bitmap_words(&self) -> &DeviceVec<u64> {
        &self.bitmap_words
    }

    /// Device memory the matrix occupies, in bytes.
    pub(crate) fn device_bytes(&self) -> usize {
        self.window_offsets.allocated_bytes()
            + self.block_columns.allocated_bytes()
            + self.bitmap_words.allocated_bytes()
            + self.window_order.allocated_bytes()
            + self.values.as_ref().map_or(0, DeviceVec::allocated_bytes)
    }
}

impl OnGpu for DeviceBsb {
    fn gpu(&self) -> &Gpu {
        self.window_offsets.gpu()
    }
}

#[cfg(test)]
mod tests;
