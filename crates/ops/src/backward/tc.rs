//! The tensor-core backward of sparse attention (f16 / bf16): every gradient in three passes
//! over BSB, on `mma.sync`, without per-edge buffers and without floating-point atomics
//! (kernels: `backward_tc_*` in `crates/kernels-sys/cuda/backward_tc.cu`).
//!
//! With `s = ⟨q_i, k_j⟩`, `P` the row softmax of `scale · s`, `dP = ⟨dOut_i, v_j⟩` and
//! `dS = P ⊙ (dP − D_i)`:
//!
//! | pass | over | rows copied per 16 × 8 block | computes |
//! |---|---|---|---|
//! | stats | A's BSB (the forward's, in its row order) | K, V rows | S and dP by mma; each row's log-sum-exp and `D_i = Σ_j P dP` |
//! | dq | A's BSB | K, V rows | P, dS; `dQ = scale · dS K` by mma; each row's share of ∂scale |
//! | dkv | Aᵀ's BSB: A's own where the pattern is symmetric (in the forward's row order), else built on the device once per graph in Aᵀ's order ([`DeviceGraph::transpose_bsb`]) | Q, dOut rows | `dV = Pᵀ dOut`, `dK = scale · dSᵀ Q` by mma |
//!
//! and a fixed-order sum of the rows' ∂scale shares. Each step's rows are copied into shared
//! memory by `cp.async` two steps ahead and read there in both layouts a pass needs (the
//! pipelined forward's tile loop). dS and P are rounded to the dtype once, as
//! the A operand of an mma (FlashAttention-2 does the same); scores and sums are f32. `D_i`
//! comes from the recomputed P and dP, not from FlashAttention-2's `⟨dOut_i, out_i⟩`: an f16 /
//! bf16 `out`'s rounding would reach dS where `dP ≈ D` and ∂scale, a cancelling sum.
//!
//! **Passes at once**: where the dq and dK/dV grids together fill the GPU only a few times
//! over, the dK/dV pass runs on a side stream at once with the dq pass (forked from the GPU's
//! stream and joined back before `run` returns; `crate::side_stream`), so that neither pass's
//! last wave leaves SMs idle. Both then read statistics written before them: the stats pass's,
//! or, from the forward's, `(lse2, ⟨dOut_i, out_i⟩)` written by a row kernel. The results are
//! the same bit for bit either way.
//!
//! **Deterministic**: a window split into units leaves a partial per unit and the last unit to
//! finish merges them in part order; ∂scale is summed in a fixed order. Two calls on the same
//! inputs give bitwise-equal gradients.
//!
//! **No host synchronization**: ∂scale stays on the device ([`TensorCoreBackward::d_scale`]).
//!
//! **Extras** ([`TensorCoreBackward::run_with_extras`]): a score bias per head or shared by
//! the heads (with its gradient, dBias = dS, written once per edge and head by the dq pass in
//! A's BSB's edge order, then moved to the caller's order, a shared bias's per-head dS summed
//! in head order on the way) and dropout (the
//! forward's keep bits, drawn again), as fused-tc's forward takes them: gathered into each BSB's
//! block-and-bit order before the passes and carried into each step's stage with its tiles.
//! The dkv pass reads them in Aᵀ's order (its own edge map, through Aᵀ's edges of A).
//!
//! Shapes ([`TensorCoreBackward::supports`]): f16 and bf16, head_dim a multiple of 8 up to 64 (at
//! 128 the dK/dV pass spills, and it lost to the fused CUDA-core backward at 8 heads);
//! other heads take [`super::FusedBackward`]. Needs compute capability 8.0.
//!
//! ```no_run
//! use half::f16;
//! use spattn_formats::{Csr, Reorder};
//! use spattn_ops::backward::TensorCoreBackward;
//! use spattn_ops::DeviceGraph;
//! use spattn_ops::{DeviceMatrix, Gpu, Shape};
//!
//! let gpu = Gpu::new(0)?;
//! let a = Csr::from_edges(3, 3, &[(0, 1), (0, 2), (1, 0), (2, 2)])?;
//! let graph = DeviceGraph::new(&gpu, a);
//! let shape = Shape::new(3, 2, 16)?;
//! let x: Vec<f16> = (0..shape.len()).map(|i| f16::from_f32((i % 5) as f32 / 5.0)).collect();
//! let q = DeviceMatrix::from_host(&gpu, shape, &x)?;
//! let (mut dq, mut dk, mut dv) = (
//!     DeviceMatrix::<f16>::zeros(&gpu, shape)?,
//!     DeviceMatrix::<f16>::zeros(&gpu, shape)?,
//!     DeviceMatrix::<f16>::zeros(&gpu, shape)?,
//! );
//! let mut bwd = TensorCoreBackward::new::<f16>(&graph, 2, 16, Reorder::None)?;
//! // Q = K = V = dOut = x here.
//! bwd.run(&gpu, 0.25, [&q, &q, &q, &q], None, [&mut dq, &mut dk, &mut dv])?;
//! let d_scale = bwd.d_scale().to_host()?[0];
//! assert!(d_scale.is_finite());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::Arc;

use spattn_formats::Reorder;
use spattn_kernels_sys::BACKWARD_TC;

use crate::buffer::{DeviceMatrix, DeviceVec};
use crate::device_bsb::{
    bsb_pipe_x_bytes, BsbBlocks, BsbExtrasStage, BsbLayout, GatheredBsbExtras, OrderedBsb,
    BSB_PIPE_STAGES,
};
use crate::dtype::{DType, DTypeKind};
use crate::edge_extras::check_bias_grad_len;
use crate::error::{Error, Result};
use crate::fused::tc::{default_chunk, extras_kernel, Schedule};
use crate::fused::CsrExtras;
use crate::gpu::Gpu;
use crate::graph::DeviceGraph;
use crate::launch::{
    blocks_for, check_per_edge, check_same_gpu, kernel_named, launch, product, stride_grid, to_u32,
    LaunchConfig, PushKernelArg, PushOptionalArg,
};
use crate::shape::Shape;
use crate::side_stream::{JoinOnDrop, SideStream};

use super::DeviceSum;

/// The kernel family, for errors.
const KERNEL: &str = "tensor-core backward";
/// Warps per CTA (one warp per unit and head).
const CTA_WARPS: usize = 4;
/// Bytes of a row of a stage's tiles (`BWD_TC_ROW`: 64 features of two bytes).
const TILE_ROW_BYTES: usize = 128;
/// Rows of a BSB window.
const WINDOW_ROWS: usize = 16;
/// The widest head the kernels hold.
const MAX_HEAD_DIM: usize = 64;

/// One BSB's schedule on the device and the partials of its split windows.
#[derive(Debug)]
struct Side {
    n_rows: usize,
    n_units: usize,
    units: DeviceVec<u32>,
    unit_split: DeviceVec<u32>,
    split_part_first: DeviceVec<u32>,
    /// `floats` f32 per (partial, head, window row).
    part: DeviceVec<f32>,
    /// Per (split window, head): units finished (reset by the merging unit).
    counters: DeviceVec<u32>,
}

impl Side {
    fn new(gpu: &Gpu, layout: &BsbLayout, heads: usize, floats: usize) -> Result<Self> {
        let chunk = default_chunk(layout.n_blocks(), heads, 1, gpu.sm_count());
        let s = Schedule::new(layout, chunk)?;
        to_u32(
            "units × heads",
            product("units × heads", &[s.n_units(), heads])?,
        )?;
        to_u32("BSB rows", layout.n_rows().next_multiple_of(WINDOW_ROWS))?;
        let part_len = product(
            "partials",
            &[s.n_parts(), heads, WINDOW_ROWS, floats.max(1)],
        )?;
        Ok(Self {
            n_rows: layout.n_rows(),
            n_units: s.n_units(),
            units: DeviceVec::from_host_named(gpu, "backward units", &s.units)?,
            unit_split: DeviceVec::from_host_named(gpu, "backward unit splits", &s.unit_split)?,
            split_part_first: DeviceVec::from_host_named(
                gpu,
                "backward split parts",
                &s.split_part_first,
            )?,
            part: DeviceVec::zeros(gpu, part_len)?,
            counters: DeviceVec::zeros(gpu, product("counters", &[s.n_split(), heads])?)?,
        })
    }

    fn device_bytes(&self) -> usize {
        self.units.allocated_bytes()
            + self.unit_split.allocated_bytes()
            + self.split_part_first.allocated_bytes()
            + self.part.allocated_bytes()
            + self.counters.allocated_bytes()
    }
}

/// The extras' state of the pass over Aᵀ: its BSB's edge map (per block its first edge in
/// block-and-bit order, then the edge count; per edge in that order its edge of A in the
/// caller's CSR order) and the gathers' buffers.
#[derive(Debug)]
struct TransposeExtras {
    starts: DeviceVec<u32>,
    ids: DeviceVec<u32>,
    stage: BsbExtrasStage,
}

impl TransposeExtras {
    fn new((starts, ids): (DeviceVec<u32>, DeviceVec<u32>)) -> Self {
        Self {
            starts,
            ids,
            stage: BsbExtrasStage::default(),
        }
    }

    fn device_bytes(&self) -> usize {
        self.starts.allocated_bytes() + self.ids.allocated_bytes()
    }
}

/// The tensor-core backward's state for one graph and one `heads × head_dim` of one dtype: A's
/// BSB (shared with the graph's cache), Aᵀ's BSB, both schedules, the row statistics and the
/// split windows' partials (see the module documentation).
#[derive(Debug)]
pub struct TensorCoreBackward {
    dtype: DTypeKind,
    heads: usize,
    head_dim: usize,
    /// Features of a head as the kernels pad it (32 or 64).
    slice: usize,
    /// The graph the state was made for ([`DeviceGraph::graph_id`]).
    graph_id: u64,
    /// A's BSB and Aᵀ's, both cached by the graph.
    a: Arc<OrderedBsb>,
    t: Arc<OrderedBsb>,
    a_side: Side,
    t_side: Side,
    /// `(lse2, D)` per (row of A, head).
    stats: DeviceVec<f32>,
    /// ∂scale's share per (row of A, head).
    ds_rows: DeviceVec<f32>,
    d_scale: DeviceSum,
    /// Whether a run sums the rows' shares into `d_scale` ([`set_d_scale`](Self::set_d_scale)).
    take_d_scale: bool,
    /// The extras' gathers over A's BSB (whose edge map the BSB caches for the forward and
    /// this backward alike) and Aᵀ's edge map and gathers, made by the first run with extras.
    extras: Option<Box<(BsbExtrasStage, TransposeExtras)>>,
    /// Whether the dq and dK/dV passes run at once; `None`: as [`Self::overlaps`] decides
    /// (tests set it, to compare the two).
    overlap: Option<bool>,
}

impl TensorCoreBackward {
    /// Whether the kernels run `head_dim` features of `dtype`: f16 or bf16, a multiple of 8 up
    /// to 64.
    pub fn supports(dtype: DTypeKind, head_dim: usize) -> bool {
        matches!(dtype, DTypeKind::F16 | DTypeKind::Bf16)
            && head_dim > 0
            && head_dim % 8 == 0
            && head_dim <= MAX_HEAD_DIM
    }

    /// The state for `graph` at `heads × head_dim` of `T`, over A's BSB in the row order
    /// `reorder` gives (the forward's, when it ran fused-tc: the graph caches one per order)
    /// and Aᵀ's BSB: A's own where the pattern is symmetric, else
    /// `DeviceGraph::transpose_bsb` (built on the device once per graph, one read of its
    /// window offsets).
    ///
    /// Errors: [`Error::Unsupported`] for a dtype or head the kernels do not hold or a device
    /// older than sm_80, [`Error::InvalidArgument`] for zero heads or sizes past the kernels'
    /// 32-bit indices, driver and memory errors.
    pub fn new<T: DType>(
        graph: &DeviceGraph,
        heads: usize,
        head_dim: usize,
        reorder: Reorder,
    ) -> Result<Self> {
        if !Self::supports(T::KIND, head_dim) {
            return Err(Error::Unsupported {
                kernel: KERNEL,
                why: format!(
                    "{head_dim} features of {}: needs f16 or bf16 and a multiple of 8 up to \
                     {MAX_HEAD_DIM}; use the fused CUDA-core backward",
                    T::KIND
                ),
            });
        }
        if heads == 0 {
            return Err(Error::InvalidArgument {
                what: "heads",
                why: "must be at least 1".into(),
            });
        }
        let gpu = graph.gpu();
        gpu.require_compute_capability("the tensor-core backward (mma.sync)", 8, 0)
            .map_err(|e| Error::Unsupported {
                kernel: KERNEL,
                why: format!("{e}; use the fused CUDA-core backward"),
            })?;
        to_u32(
            "heads × head_dim",
            product("heads × head_dim", &[heads, head_dim])?,
        )?;
        let slice = head_dim.next_power_of_two().max(SLICES[0]);
        let a = graph.bsb_in(reorder)?;
        let t = graph.transpose_bsb_beside(&a)?;
        // Partial rows over A: the dq pass's accumulator, ∂scale share, c and b.
        let a_side = Side::new(gpu, &a.layout, heads, slice + 3)?;
        let t_side = Side::new(gpu, &t.layout, heads, 2 * slice)?;
        let rows = product("rows × heads", &[graph.n_rows(), heads])?;
        Ok(Self {
            dtype: T::KIND,
            heads,
            head_dim,
            slice,
            graph_id: graph.graph_id(),
            a,
            t,
            a_side,
            t_side,
            stats: DeviceVec::zeros(gpu, product("row statistics", &[rows, 2])?)?,
            ds_rows: DeviceVec::zeros(gpu, rows)?,
            d_scale: DeviceSum::new(gpu)?,
            take_d_scale: true,
            extras: None,
            overlap: None,
        })
    }

    /// `(heads, head_dim)` the state was made for.
    pub fn dims(&self) -> (usize, usize) {
        (self.heads, self.head_dim)
    }

    /// ∂L/∂scale of the last [`run`](Self::run) that took it, on the device (one f64).
    pub fn d_scale(&self) -> &DeviceVec<f64> {
        self.d_scale.total()
    }

    /// Whether the runs take ∂L/∂scale (true for a new state). False skips its sum, one launch
    /// a run, for callers that never read it (a scale that is a constant);
    /// [`d_scale`](Self::d_scale) then keeps the last run's that took it. The gradients are the
    /// same bits either way.
    pub fn set_d_scale(&mut self, take: bool) {
        self.take_d_scale = take;
    }

    /// Device memory the state holds beyond A's and Aᵀ's BSB (which the graph caches), in
    /// bytes.
    pub fn device_bytes(&self) -> usize {
        self.a_side.device_bytes()
            + self.t_side.device_bytes()
            + self.stats.allocated_bytes()
            + self.ds_rows.allocated_bytes()
            + self.d_scale.allocated_bytes()
            + self.extras.as_ref().map_or(0, |x| x.1.device_bytes())
    }

    /// The gradients of `out = softmax_row(scale · Q Kᵀ masked by A) · V`: from `[Q, K, V,
    /// dOut]` writes every element of `[dQ, dK, dV]`, and ∂L/∂scale into
    /// [`d_scale`](Self::d_scale) (unless [`set_d_scale`](Self::set_d_scale) turned it off).
    /// Enqueued on `gpu`'s stream; nothing waits for the GPU.
    ///
    /// Shapes: Q, dOut, dQ are `n_rows × heads × head_dim`; K, V, dK, dV are
    /// `n_cols × heads × head_dim` (the graph's sizes and the state's heads).
    ///
    /// `saved`: the forward's output and the row statistics it left (`lse`, n_rows × heads,
    /// [`crate::fused::FusedTensorCore::forward_with_lse`] of the same inputs): the statistics pass is
    /// skipped, each row's `D = ⟨dOut_i, out_i⟩` (FlashAttention-2's) and ∂L/∂scale stays
    /// exact (its share is corrected by the dq pass's own `Σ P dP`); dQ, dK and dV carry
    /// `out`'s rounding at its size. A stale `lse` gives wrong gradients: it must come from
    /// the forward of these Q, K (and scale).
    ///
    /// Errors: [`Error::InvalidArgument`] for another dtype than the state's or a scale that is
    /// not finite in the kernels' log2 domain, [`Error::ShapeMismatch`] naming the operand,
    /// [`Error::LengthMismatch`] for an `lse` that is not n_rows × heads,
    /// [`Error::ForeignGpu`], driver errors.
    pub fn run<T: DType>(
        &mut self,
        gpu: &Gpu,
        scale: f32,
        operands: [&DeviceMatrix<T>; 4],
        saved: Option<(&DeviceMatrix<T>, &DeviceVec<f32>)>,
        grads: [&mut DeviceMatrix<T>; 3],
    ) -> Result<()> {
        self.run_inner(gpu, scale, operands, saved, grads, None)
    }

    /// [`run`](Self::run) for the forward `out = softmax_row(scale · Q Kᵀ + bias, masked by A)
    /// ⊙ dropout · V` (fused-tc's with `extras`; `graph` the state's): also writes ∂L/∂bias into
    /// `d_bias` (shaped like the bias: nnz × heads, the caller's edge order) where the extras
    /// have a bias. The first call with extras builds both BSBs' edge maps: on the device for
    /// BSBs in the graph's own row order, else on the host (A's CSR and its transpose) and
    /// uploaded. Extras that change nothing (no bias, dropout at rate
    /// 0) run [`run`](Self::run).
    ///
    /// The dq pass writes dS per head into a scratch buffer in A's BSB's edge order (nnz ×
    /// heads of `T`, allocated by the call), which a last kernel moves to the caller's order. A
    /// bias shared by the heads takes a `d_bias` of nnz: that kernel sums the heads' dS in head
    /// order, in f32; each head's dS is rounded to `T` before that sum (the composition rounds
    /// the sum once).
    ///
    /// Errors: as [`run`](Self::run); [`Error::Unsupported`] for edge features (the fused
    /// CUDA-core backward and the composition take them); [`Error::InvalidArgument`] for a bias
    /// without `d_bias`, or a `graph` that is not the state's; [`Error::LengthMismatch`] for a
    /// bias or `d_bias` of another length.
    #[allow(clippy::too_many_arguments)]
    pub fn run_with_extras<T: DType>(
        &mut self,
        gpu: &Gpu,
        graph: &DeviceGraph,
        scale: f32,
        operands: [&DeviceMatrix<T>; 4],
        grads: [&mut DeviceMatrix<T>; 3],
        extras: &CsrExtras<'_, T>,
        d_bias: Option<&mut DeviceVec<T>>,
    ) -> Result<()> {
        let shape = Shape::new(self.a_side.n_rows, self.heads, self.head_dim)?;
        extras.check(gpu, KERNEL, graph.nnz(), shape, false)?;
        // The state's own graph: the edge maps built below are cached for it.
        if graph.graph_id() != self.graph_id {
            return Err(Error::InvalidArgument {
                what: "graph",
                why: format!(
                    "the backward was made for another graph ({} rows, {} columns, {} edges); \
                     given {} × {} with {}",
                    self.a_side.n_rows,
                    self.t_side.n_rows,
                    self.a.layout.nnz(),
                    graph.n_rows(),
                    graph.n_cols(),
                    graph.nnz()
                ),
            });
        }
        let shared = extras.bias.as_ref().is_some_and(|b| b.is_shared());
        let d_bias = match (&extras.bias, d_bias) {
            (None, _) => None,
            (Some(_), None) => {
                return Err(Error::InvalidArgument {
                    what: "d_bias",
                    why: "the extras have a bias: pass its gradient's buffer".into(),
                })
            }
            (Some(_), Some(db)) => {
                check_bias_grad_len(graph.nnz(), self.heads, shared, db.len())?;
                check_same_gpu(gpu, "d_bias", &*db)?;
                Some(db)
            }
        };
        // Extras that change nothing (no bias, dropout at rate 0) need no edge maps.
        if extras.bias.is_none() && extras.dropout.is_none_or(|d| d.threshold() == 0) {
            return self.run_inner(gpu, scale, operands, None, grads, None);
        }
        let mut sides = match self.extras.take() {
            Some(x) => x,
            None => Box::new((
                BsbExtrasStage::default(),
                TransposeExtras::new(self.transpose_edge_map(gpu, graph)?),
            )),
        };
        // The BSBs borrowed apart from the state, which the launches write.
        let (a_bsb, t_bsb) = (Arc::clone(&self.a), Arc::clone(&self.t));
        let result = (|| {
            let (a_stage, tx) = &mut *sides;
            let (a_starts, a_ids) = graph.edge_map_of(&a_bsb)?;
            let a_blocks = BsbBlocks {
                bitmaps: a_bsb.device.bitmap_words(),
                block_edge_start: a_starts,
                n_blocks: a_bsb.device.n_blocks(),
            };
            let t_blocks = BsbBlocks {
                bitmaps: t_bsb.device.bitmap_words(),
                block_edge_start: &tx.starts,
                n_blocks: t_bsb.device.n_blocks(),
            };
            // The dq pass writes dS per head in A's BSB's edge order (consecutive stores), one
            // row of the edge map's length per head, moved to the caller's order (a shared
            // bias's heads summed in head order) afterwards. Left unset: the pass writes every
            // edge of every block for every head. Allocated per call from the stream's pool.
            let mut per_head = match &d_bias {
                Some(_) => Some(DeviceVec::<T>::alloc(
                    gpu,
                    "dBias in the blocks' edge order (edges × heads)",
                    product("edges × heads", &[a_ids.len(), self.heads])?,
                    false,
                )?),
                None => None,
            };
            let ga = a_stage.gather(gpu, a_ids, a_blocks, self.heads, extras)?;
            let gt = tx
                .stage
                .gather(gpu, &tx.ids, t_blocks, self.heads, extras)?;
            if ga.takes() == (false, false) {
                return self.run_inner(gpu, scale, operands, None, grads, None);
            }
            let x = LaunchExtras {
                a: &ga,
                t: &gt,
                d_bias: per_head.as_mut(),
            };
            self.run_inner(gpu, scale, operands, None, grads, Some(x))?;
            if let (Some(ph), Some(db)) = (&per_head, d_bias) {
                bias_grad_to_caller(gpu, a_ids, self.heads, shared, ph, db)?;
            }
            Ok(())
        })();
        self.extras = Some(sides);
        result
    }

    /// The edge map of Aᵀ's BSB with its entries named by their edges of A (the extras are
    /// indexed by A's): made on the device where that BSB is in its own row order (always for
    /// Aᵀ's own; A's standing for it on a symmetric pattern unless A's rows were reordered),
    /// else on the host from A's CSR transposed, and uploaded.
    fn transpose_edge_map(
        &self,
        gpu: &Gpu,
        graph: &DeviceGraph,
    ) -> Result<(DeviceVec<u32>, DeviceVec<u32>)> {
        if self.t.in_graph_order() {
            return graph.bsb_edge_map(&self.t.device, true);
        }
        let (at, from_a) = graph.host()?.transpose_with_map();
        let (starts, ids) = self.t.edge_map(&at)?;
        let ids: Vec<u32> = ids.iter().map(|&e| from_a[e as usize]).collect();
        Ok((
            DeviceVec::from_host_named(gpu, "backward BSB edge starts", &starts)?,
            DeviceVec::from_host_named(gpu, "backward BSB edge ids", &ids)?,
        ))
    }

    /// Whether the dq and dK/dV passes run at once on two streams: where their grids together
    /// are at most [`OVERLAP_WAVES`] waves of the GPU (the dK/dV pass's CTAs a SM, the fewer),
    /// which one after the other leave SMs idle at each pass's end.
    fn overlaps(&self, gpu: &Gpu) -> Result<bool> {
        if let Some(on) = self.overlap {
            return Ok(on);
        }
        let ctas = |n_units: usize| -> Result<usize> {
            Ok(product("units × heads", &[n_units, self.heads])?.div_ceil(CTA_WARPS))
        };
        let both = ctas(self.a_side.n_units)? + ctas(self.t_side.n_units)?;
        let wave = gpu.sm_count() as usize * RESIDENT_CTAS;
        Ok((both as f64) <= OVERLAP_WAVES * wave as f64)
    }

    /// Writes `(lse2, ⟨dOut_i, out_i⟩)` per (row of A, head) into the statistics
    /// (`backward_tc_row_stats`): the forward's statistics for the dq and dK/dV passes at once.
    fn row_stats<T: DType>(
        &mut self,
        gpu: &Gpu,
        d_out: &DeviceMatrix<T>,
        out: &DeviceMatrix<T>,
        lse: &DeviceVec<f32>,
    ) -> Result<()> {
        let kernel = kernel_named(&BACKWARD_TC, row_stats_name(T::NAME))?;
        let f = gpu.load_function(BACKWARD_TC.name, BACKWARD_TC.ptx, kernel)?;
        let groups = product("rows × heads", &[self.a_side.n_rows, self.heads])?;
        let cfg = stride_grid(product("rows × heads × 4 lanes", &[groups, 4])?)?;
        let (rows, heads) = (
            to_u32("rows", self.a_side.n_rows)?,
            to_u32("heads", self.heads)?,
        );
        let head_dim = to_u32("head_dim", self.head_dim)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(&rows)
            .arg(&heads)
            .arg(&head_dim)
            .arg(d_out.slice())
            .arg(out.slice())
            .arg(lse.slice())
            .arg(self.stats.slice_mut());
        // SAFETY: (row, head) < rows × heads: reads dOut and out (rows × heads × head_dim, the
        // shapes `run_inner` checked) at features < head_dim in 16-byte chunks (head_dim a
        // multiple of 8 two-byte elements: `supports`), lse (rows × heads, checked) and
        // writes stats at (row, head) (2 × rows × heads floats, `new`).
        unsafe { launch(kernel, &mut args, cfg) }
    }

    /// [`run`](Self::run), with the extras' gathers where given.
    fn run_inner<T: DType>(
        &mut self,
        gpu: &Gpu,
        scale: f32,
        operands: [&DeviceMatrix<T>; 4],
        saved: Option<(&DeviceMatrix<T>, &DeviceVec<f32>)>,
        [dq, dk, dv]: [&mut DeviceMatrix<T>; 3],
        mut extras: Option<LaunchExtras<'_, T>>,
    ) -> Result<()> {
        if T::KIND != self.dtype {
            return Err(Error::InvalidArgument {
                what: "dtype",
                why: format!(
                    "the backward was made for {}, run with {}",
                    self.dtype,
                    T::KIND
                ),
            });
        }
        let [q, k, v, d_out] = operands;
        let sq = Shape::new(self.a_side.n_rows, self.heads, self.head_dim)?;
        let skv = Shape::new(self.t_side.n_rows, self.heads, self.head_dim)?;
        for (what, actual, expected) in [
            ("Q", q.shape(), sq),
            ("K", k.shape(), skv),
            ("V", v.shape(), skv),
            ("dOut", d_out.shape(), sq),
            ("dQ", dq.shape(), sq),
            ("dK", dk.shape(), skv),
            ("dV", dv.shape(), skv),
        ] {
            expected.expect_eq(what, actual)?;
        }
        for (what, m) in [("Q", q), ("K", k), ("V", v), ("dOut", d_out)] {
            check_same_gpu(gpu, what, m)?;
        }
        if let Some((out, lse)) = saved {
            sq.expect_eq("out", out.shape())?;
            check_same_gpu(gpu, "out", out)?;
            check_per_edge("lse (rows × heads)", sq.rows, self.heads, lse.len())?;
            check_same_gpu(gpu, "lse", lse)?;
        }
        for (what, m) in [("dQ", &*dq), ("dK", &*dk), ("dV", &*dv)] {
            check_same_gpu(gpu, what, m)?;
        }
        check_same_gpu(gpu, "BSB of A", &self.a.device)?;
        check_same_gpu(gpu, "BSB of Aᵀ", &self.t.device)?;
        check_same_gpu(gpu, "workspace", &self.stats)?;
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        if !scale_log2.is_finite() {
            return Err(Error::InvalidArgument {
                what: "scale",
                why: format!("{scale} is not finite in the kernels' log2 domain"),
            });
        }
        let heads = to_u32("heads", self.heads)?;
        let head_dim = to_u32("head_dim", self.head_dim)?;
        let takes = extras.as_ref().map_or((false, false), |x| x.a.takes());
        let slice = self.slice;
        let name = |pass: &str| kernel_named(&BACKWARD_TC, pass_name(pass, T::NAME, slice, takes));
        let null = None::<&DeviceVec<u32>>;

        // Passes over A's BSB: the statistics, then dQ and the rows' ∂scale shares; then the
        // pass over Aᵀ's BSB: dK and dV. Where their grids leave the GPU partly idle
        // (`overlaps`), the dK/dV pass runs on the side stream at once with the dq pass, both
        // reading the statistics written before them (the stats pass's, or the forward's lse
        // beside each row's D from the row kernel).
        let overlap = self.overlaps(gpu)?;
        if let (true, Some((out, lse))) = (overlap, saved) {
            self.row_stats(gpu, d_out, out, lse)?;
        }
        let (a_bsb, a_rows) = (&self.a.device, self.a.row_ids.as_ref());
        let stats_pass = (PASSES[0], Pass::A, [q, d_out, k, v], [None, None]);
        let dq_pass = (PASSES[1], Pass::A, [q, d_out, k, v], [Some(dq), None]);
        let dkv_pass = (PASSES[2], Pass::T, [k, v, q, d_out], [Some(dk), Some(dv)]);
        let passes = if overlap {
            [stats_pass, dkv_pass, dq_pass]
        } else {
            [stats_pass, dq_pass, dkv_pass]
        };
        let run_passes = |side: Option<&SideStream>| -> Result<()> {
            // Set once the dK/dV pass is forked onto the side stream; joined at the end.
            let mut joined = None;
            for (pass, over, [x1, x2, y1, y2], [g1, g2]) in passes {
                let (side_bsb, bsb, row_ids) = match over {
                    Pass::A => (&mut self.a_side, a_bsb, a_rows),
                    Pass::T => (&mut self.t_side, &self.t.device, self.t.row_ids.as_ref()),
                };
                // The forward's statistics replace the stats pass; the dq pass reads them.
                if saved.is_some() && pass == PASSES[0] {
                    continue;
                }
                let from_fwd = saved.filter(|_| pass == PASSES[1]);
                // At once with dK/dV, the row kernel has written D: the dq pass reads no out.
                let out = from_fwd.filter(|_| !overlap).map(|(o, _)| o.as_vec());
                let Some((cfg, n_items)) = grid(side_bsb.n_units, self.heads, pass, takes)? else {
                    continue;
                };
                let kernel = name(pass)?;
                let f = gpu.load_function_with_shared(
                    BACKWARD_TC.name,
                    BACKWARD_TC.ptx,
                    kernel,
                    cfg.shared_mem_bytes as usize,
                    KERNEL,
                )?;
                let stream = match side.filter(|_| pass == PASSES[2]) {
                    Some(side) => {
                        joined = Some(side.fork(gpu.stream())?);
                        side.stream()
                    }
                    None => gpu.stream(),
                };
                let n_rows = to_u32("rows", side_bsb.n_rows)?;
                let mut args = stream.launch_builder(&f);
                args.arg(side_bsb.units.slice())
                    .arg(side_bsb.unit_split.slice())
                    .arg(side_bsb.split_part_first.slice())
                    .arg(&n_items)
                    .arg(&heads)
                    .arg(&head_dim)
                    .arg(&n_rows)
                    .arg_or_null(row_ids)
                    .arg(bsb.block_columns().slice())
                    .arg(bsb.bitmap_words().slice())
                    .arg(x1.slice())
                    .arg(x2.slice())
                    .arg(y1.slice())
                    .arg(y2.slice())
                    .arg_or_null(out)
                    .arg_or_null(from_fwd.map(|(_, l)| l))
                    .arg(&scale_log2)
                    .arg(&scale)
                    .arg(self.stats.slice_mut());
                args.arg_or_null_mut(g1.map(DeviceMatrix::as_vec_mut))
                    .arg_or_null_mut(g2.map(DeviceMatrix::as_vec_mut))
                    .arg(self.ds_rows.slice_mut())
                    .arg(side_bsb.part.slice_mut())
                    .arg(side_bsb.counters.slice_mut());
                match &mut extras {
                    Some(x) => {
                        let gathered = match over {
                            Pass::A => x.a,
                            Pass::T => x.t,
                        };
                        gathered.push(&mut args);
                        // dBias: the dq pass, where there is a bias.
                        match (pass == PASSES[1], x.d_bias.as_deref_mut()) {
                            (true, Some(db)) => args.arg(db.slice_mut()),
                            _ => args.arg_or_null(null),
                        };
                    }
                    None => {
                        GatheredBsbExtras::push_absent(&mut args);
                        args.arg_or_null(null);
                    }
                }
                // SAFETY: items < n_units × heads of the pass's BSB; each reads its unit's 4
                // words (units: 4 × n_units), split (n_units) and the split's part range
                // (split_part_first: n_split + 1), blocks of its window below the unit's end ≤
                // n_blocks (block_columns 8 and bitmap words 2 u64 per block), row_ids (a
                // renumbered BSB's: its n_rows entries, a permutation's old_of_new) at window
                // rows < n_rows.
                // Window-side rows (x1, x2, g1, g2: Q, dOut, dQ over A; K, V, dK, dV over Aᵀ;
                // the dq pass's out, shaped as Q, and lse, n_rows × heads: checked) are caller
                // rows < the BSB's rows, gathered rows (y1, y2) real block columns < the other
                // side's rows, each heads × head_dim (shapes checked), read and written at
                // features < head_dim in 16-byte chunks (the dq pass's D reads out and dOut so
                // too) (head_dim a multiple of 8 two-byte elements: `supports`). stats and
                // ds_rows are indexed by (row of A, head): 2 × n_rows × heads and n_rows ×
                // heads floats. Partials at (part < n_parts, head, window row < 16) × (slice +
                // 3) floats over A, 2 × slice over Aᵀ, and counters at (split, head): sized by
                // `Side::new` from these schedules. Extras (`_x*` kernels only): the gathered
                // bias (one row of the BSB's edges per head) at a step's span of edges,
                // block_edge_start[blk] and [min(blk + 2, n_blocks)] (n_blocks + 1 entries),
                // the keep words at 4 per (head, block) (BsbExtrasStage::gather sized them for
                // this BSB and heads); the dq pass with a bias writes d_bias at h × n_edges +
                // its block's first edge + the bit's rank among the block's (A's BSB's edge
                // order: below n_edges, the edge map's length) < n_edges × heads (allocated so
                // by run_with_extras). On the side stream (the dK/dV pass), everything it
                // touches is written before the fork on the GPU's stream (the statistics) or by
                // it alone (dK, dV, Aᵀ's partials and counters); the dq pass beside it only
                // reads what both read, and the join orders everything after.
                unsafe { launch(kernel, &mut args, cfg) }?;
            }
            joined.map_or(Ok(()), JoinOnDrop::join)
        };
        if overlap {
            gpu.with_side_stream(|side| run_passes(Some(side)))?;
        } else {
            run_passes(None)?;
        }

        // ∂scale: the rows' shares in a fixed order.
        if self.take_d_scale {
            self.d_scale.take(gpu, &self.ds_rows, None)?;
        }
        Ok(())
    }
}

/// What a run with extras hands each launch: both BSBs' gathers and dBias in A's BSB's edge
/// order (nnz × heads).
struct LaunchExtras<'a, T: DType> {
    a: &'a GatheredBsbExtras<'a>,
    t: &'a GatheredBsbExtras<'a>,
    d_bias: Option<&'a mut DeviceVec<T>>,
}

/// dBias from the dq pass's `per_head` (nnz × heads in A's BSB's edge order, head by head) into
/// `out` in the caller's edge order through `ids` (A's BSB edge to caller edge, nnz entries):
/// nnz × heads values, or for a `shared` bias nnz sums over the heads in head order.
fn bias_grad_to_caller<T: DType>(
    gpu: &Gpu,
    ids: &DeviceVec<u32>,
    heads: usize,
    shared: bool,
    per_head: &DeviceVec<T>,
    out: &mut DeviceVec<T>,
) -> Result<()> {
    let nnz = ids.len();
    check_per_edge(
        "dBias in the blocks' order (nnz × heads)",
        nnz,
        heads,
        per_head.len(),
    )?;
    check_per_edge("dBias", nnz, if shared { 1 } else { heads }, out.len())?;
    if nnz == 0 {
        return Ok(());
    }
    let name = kernel_named(&BACKWARD_TC, bias_grad_name(T::NAME))?;
    let f = gpu.load_function(BACKWARD_TC.name, BACKWARD_TC.ptx, name)?;
    let (n, h, flag) = (
        to_u32("edges", nnz)?,
        to_u32("heads", heads)?,
        u32::from(shared),
    );
    // A thread an edge for a shared bias (it sums the heads), else one per edge and head.
    let items = if shared {
        nnz
    } else {
        product("edges × heads", &[nnz, heads])?
    };
    let mut args = gpu.launch_builder(&f);
    args.arg(ids.slice())
        .arg(&n)
        .arg(&h)
        .arg(&flag)
        .arg(per_head.slice())
        .arg(out.slice_mut());
    // SAFETY: thread k < nnz (shared) or (k, h) < nnz × heads reads ids[k] (nnz entries),
    // per_head at h × nnz + k < nnz × heads (checked above), and writes out at ids[k] (shared)
    // or ids[k] × heads + h, within out's nnz or nnz × heads (checked) since ids names caller
    // edges < nnz (the edge map's builders).
    unsafe { launch(name, &mut args, stride_grid(items)?) }
}

/// CTAs of the dK/dV pass one SM holds (168 registers a lane at 64 features, 4 warps a CTA).
const RESIDENT_CTAS: usize = 3;
/// The waves of the GPU up to which the dq and dK/dV passes run at once ([`TensorCoreBackward::overlaps`]).
const OVERLAP_WAVES: f64 = 8.0;

/// The passes, in launch order.
const PASSES: [&str; 3] = ["stats", "dq", "dkv"];
/// The feature slices the kernels are instantiated for.
const SLICES: [usize; 2] = [32, 64];

/// The kernel of `pass` for dtype `dtype` (a kernel-name suffix) at feature slice `slice`,
/// taking a bias and dropout as `takes` says (the pipelined forward's `_xb`, `_xd`, `_x` twins).
fn pass_name(pass: &str, dtype: &str, slice: usize, takes: (bool, bool)) -> String {
    let base = format!("backward_tc_{pass}_{dtype}_s{slice}");
    match takes {
        (false, false) => base,
        _ => extras_kernel(&base, true, takes),
    }
}

/// The kernel moving dBias to the caller's edge order for dtype `dtype` (a kernel-name suffix).
fn bias_grad_name(dtype: &str) -> String {
    format!("backward_tc_bias_grad_{dtype}")
}

/// The row-statistics kernel for dtype `dtype` (a kernel-name suffix).
fn row_stats_name(dtype: &str) -> String {
    format!("backward_tc_row_stats_{dtype}")
}

/// Which BSB a pass runs over.
#[derive(Clone, Copy)]
enum Pass {
    /// A's (window rows: rows of A).
    A,
    /// Aᵀ's (window rows: columns of A).
    T,
}

/// Shared memory of one warp of `pass` (`bwd_tc_warp_bytes` in the kernels):
/// [`BSB_PIPE_STAGES`] stages of two tiles of 16 rows, the step's two bitmaps (32 bytes), in the
/// dkv pass the 16 columns' statistics (an f32 pair each), then the staged extras
/// ([`bsb_pipe_x_bytes`]).
fn warp_shared_bytes(pass: &str, (bias, drop): (bool, bool)) -> usize {
    let stats = if pass == "dkv" { 16 * 8 } else { 0 };
    BSB_PIPE_STAGES * (2 * 16 * TILE_ROW_BYTES + 32 + stats + bsb_pipe_x_bytes(bias, drop))
}

/// The grid of a pass: a warp per (unit, head) in CTAs of [`CTA_WARPS`], each warp with its
/// [`warp_shared_bytes`], and the item count; `None` when there is nothing to launch.
fn grid(
    n_units: usize,
    heads: usize,
    pass: &str,
    takes: (bool, bool),
) -> Result<Option<(LaunchConfig, u32)>> {
    let items = product("units × heads", &[n_units, heads])?;
    if items == 0 {
        return Ok(None);
    }
    let cfg = LaunchConfig {
        grid_dim: (blocks_for(items, CTA_WARPS as u32)?, 1, 1),
        block_dim: ((CTA_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: (CTA_WARPS * warp_shared_bytes(pass, takes)) as u32,
    };
    Ok(Some((cfg, to_u32("units × heads", items)?)))
}

#[cfg(test)]
mod tests;
