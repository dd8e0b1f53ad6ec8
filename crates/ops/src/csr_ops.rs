//! The CUDA-core ops on CSR: SDDMM (dot, GAT and GATv2 forms), edge softmax and SpMM, for f32, f16
//! and bf16 features, every sum accumulated in f32.
//!
//! Layouts (as in [`crate::cpu`]): dense operands `rows × heads × head_dim` row-major
//! ([`DeviceMatrix`]); per-edge values `nnz × heads` f32 in CSR edge order ([`DeviceVec<f32>`]).
//!
//! Load balance: SDDMM is edge-parallel (a group of lanes per edge), so its cost does not
//! depend on the degree distribution. SpMM and edge softmax walk rows; their schedules
//! are built once when the graph is uploaded ([`DeviceCsr::upload`]) and
//! split hub rows across many groups or give them a whole block.
//!
//! ```no_run
//! use spattn_formats::Csr;
//! use spattn_ops::{csr_ops, DeviceCsr, DeviceMatrix, DeviceVec, Gpu, Shape};
//! use half::f16;
//!
//! let gpu = Gpu::new(0)?;
//! let a = Csr::from_edges(3, 3, &[(0, 1), (0, 2), (1, 0), (2, 2)])?;
//! let a_dev = DeviceCsr::upload(&gpu, &a)?;
//! let shape = Shape::new(3, 2, 64)?; // 3 nodes, 2 heads, head_dim 64
//! let x: Vec<f16> = (0..shape.len()).map(|i| f16::from_f32((i % 7) as f32 / 7.0)).collect();
//! let q = DeviceMatrix::from_host(&gpu, shape, &x)?;
//! let mut scores = DeviceVec::<f32>::zeros(&gpu, a.nnz() * 2)?;
//! csr_ops::sddmm(&gpu, &a_dev, &q, &q, 0.125, &mut scores)?;
//! csr_ops::edge_softmax_in_place(&gpu, &a_dev, &mut scores, 2, None)?;
//! let mut out = DeviceMatrix::<f16>::zeros(&gpu, shape)?;
//! csr_ops::spmm(&gpu, &a_dev, &scores, &q, &mut out)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use spattn_formats::{Csr, Permutation};
use spattn_kernels_sys::CSR_OPS;

use crate::buffer::{grown, DeviceMatrix, DeviceVec, Scratch};
use crate::device_csr::DeviceCsr;
use crate::dtype::DType;
use crate::edge_extras::{self, DeviceBias};
use crate::error::{Error, Result};
use crate::gatv2::Gatv2Operands;
use crate::gpu::Gpu;
use crate::launch::{
    blocks_for, check_per_edge, check_same_gpu, kernel_named, launch, opt_ptr, to_u32,
};
use crate::launch::{
    check_operands, edge_softmax_fns, LaunchConfig, Op, PushKernelArg, SoftmaxArgs, SparseOperand,
};
use crate::schedule::{group_for, units_in_row_order, vector_width, RowUnits, SoftmaxSchedule};
use crate::shape::Shape;

/// Threads per block of the CSR kernels.
const THREADS: u32 = 256;
/// Rows longer than this are split into units of this many edges (SpMM and the fused CSR
/// kernel). A unit is walked by one group of lanes, four edges per dependent step, so the
/// longest unit bounds the kernel's critical path; 64 keeps every path short, for the small
/// price of merging split rows' partials in f32 (docs/kernels/csr-ops.md, "Tried and kept").
pub(crate) const UNIT_CHUNK: u32 = 64;

/// The device side of the CSR schedules ([`RowUnits`], [`SoftmaxSchedule`]), built once per
/// uploaded graph by [`DeviceCsr::upload`]. The fused CSR kernel walks the same units.
#[derive(Debug)]
pub(crate) struct CsrSchedule {
    unit_rows: DeviceVec<u32>,
    unit_starts: DeviceVec<u32>,
    unit_slots: DeviceVec<u32>,
    unit_parts: DeviceVec<u32>,
    split_rows: DeviceVec<u32>,
    part_first: DeviceVec<u32>,
    pub(crate) long_rows: DeviceVec<u32>,
    pub(crate) long_threshold: u32,
    pub(crate) softmax_group: u32,
    /// Partials of the units of split rows (`part_first`'s last entry, kept on the host).
    n_parts: usize,
    /// f32 partial sums of split SpMM rows' units (`n_parts × heads × head_dim`), grown on
    /// demand.
    scratch: Scratch,
}

impl CsrSchedule {
    /// Computes the schedules of `csr` on the host and uploads them.
    pub(crate) fn upload(gpu: &Gpu, csr: &Csr) -> Result<Self> {
        let units = RowUnits::new(csr, UNIT_CHUNK);
        let softmax = SoftmaxSchedule::new(csr, SoftmaxSchedule::DEFAULT_LONG_THRESHOLD);
        Ok(Self {
            unit_rows: DeviceVec::from_host_named(gpu, "SpMM unit rows", &units.rows)?,
            unit_starts: DeviceVec::from_host_named(gpu, "SpMM unit starts", &units.starts)?,
            unit_slots: DeviceVec::from_host_named(gpu, "SpMM unit slots", &units.slots)?,
            unit_parts: DeviceVec::from_host_named(gpu, "unit partials", &units.parts)?,
            split_rows: DeviceVec::from_host_named(gpu, "SpMM split rows", &units.split_rows)?,
            part_first: DeviceVec::from_host_named(gpu, "split-row partials", &units.part_first)?,
            long_rows: DeviceVec::from_host_named(gpu, "softmax long rows", &softmax.long_rows)?,
            long_threshold: softmax.long_threshold,
            softmax_group: softmax.group,
            n_parts: units.part_first.last().copied().unwrap_or(0) as usize,
            scratch: Scratch::default(),
        })
    }

    /// The schedules from buffers built on the device (`crate::device_plan`), as
    /// [`upload`](Self::upload) lays them out: `[unit rows, unit starts, unit slots, unit
    /// partials, split rows, split-row first partials, long rows]`, `n_parts` partials, the
    /// softmax's lane group for the mean degree, rows of
    /// [`SoftmaxSchedule::DEFAULT_LONG_THRESHOLD`] edges long.
    ///
    /// Errors: [`Error::InvalidArgument`] where the lengths do not fit together.
    pub(crate) fn from_parts(
        [unit_rows, unit_starts, unit_slots, unit_parts, split_rows, part_first, long_rows]: [DeviceVec<u32>;
            7],
        n_parts: usize,
        softmax_group: u32,
    ) -> Result<Self> {
        let units = unit_rows.len();
        if unit_starts.len() != units + 1
            || unit_slots.len() != units
            || unit_parts.len() != units
            || part_first.len() != split_rows.len() + 1
        {
            return Err(Error::InvalidArgument {
                what: "CSR schedule",
                why: format!(
                    "{units} units with {} starts, {} slots, {} partials; {} split rows with {} \
                     first partials",
                    unit_starts.len(),
                    unit_slots.len(),
                    unit_parts.len(),
                    split_rows.len(),
                    part_first.len()
                ),
            });
        }
        Ok(Self {
            unit_rows,
            unit_starts,
            unit_slots,
            unit_parts,
            split_rows,
            part_first,
            long_rows,
            long_threshold: SoftmaxSchedule::DEFAULT_LONG_THRESHOLD,
            softmax_group,
            n_parts,
            scratch: Scratch::default(),
        })
    }

    /// A copy on the device (the edge CSR's: the same rows, so the same schedule).
    pub(crate) fn try_clone(&self) -> Result<Self> {
        Ok(Self {
            unit_rows: self.unit_rows.try_clone()?,
            unit_starts: self.unit_starts.try_clone()?,
            unit_slots: self.unit_slots.try_clone()?,
            unit_parts: self.unit_parts.try_clone()?,
            split_rows: self.split_rows.try_clone()?,
            part_first: self.part_first.try_clone()?,
            long_rows: self.long_rows.try_clone()?,
            long_threshold: self.long_threshold,
            softmax_group: self.softmax_group,
            n_parts: self.n_parts,
            scratch: Scratch::default(),
        })
    }

    /// Every array downloaded, with the host fields, for comparing two schedules in tests:
    /// unit rows, starts, slots, partials, split rows, their first partials, long rows; then
    /// `[long_threshold, softmax_group, n_parts]`.
    #[cfg(test)]
    pub(crate) fn to_host(&self) -> Result<Vec<Vec<u32>>> {
        let mut all = Vec::new();
        for v in [
            &self.unit_rows,
            &self.unit_starts,
            &self.unit_slots,
            &self.unit_parts,
            &self.split_rows,
            &self.part_first,
            &self.long_rows,
        ] {
            all.push(v.to_host()?);
        }
        all.push(vec![
            self.long_threshold,
            self.softmax_group,
            self.n_parts as u32,
        ]);
        Ok(all)
    }

    /// The SpMM units (rows, starts, partials), the split rows and their first partials, and
    /// the number of partials: the fused CSR kernel's work units in the graph's row order.
    #[allow(clippy::type_complexity)]
    pub(crate) fn units(&self) -> ([&DeviceVec<u32>; 5], usize) {
        (
            [
                &self.unit_rows,
                &self.unit_starts,
                &self.unit_parts,
                &self.split_rows,
                &self.part_first,
            ],
            self.n_parts,
        )
    }

    /// The number of SpMM units.
    pub(crate) fn n_units(&self) -> usize {
        self.unit_rows.len()
    }

    /// The split units' f32 partials, grown on demand (shared by the launches on this graph,
    /// which the stream orders).
    pub(crate) fn scratch(&self) -> &Scratch {
        &self.scratch
    }

    /// The units with both of a split row's indices, for kernels that merge partials without
    /// atomics (the fused backward): `[rows, starts, slots, partials, first partials]`, the
    /// number of partials and the number of split rows.
    pub(crate) fn merge_units(&self) -> ([&DeviceVec<u32>; 5], usize, usize) {
        (
            [
                &self.unit_rows,
                &self.unit_starts,
                &self.unit_slots,
                &self.unit_parts,
                &self.part_first,
            ],
            self.n_parts,
            self.split_rows.len(),
        )
    }

    /// Bytes of device memory the schedules hold.
    pub(crate) fn device_bytes(&self) -> usize {
        self.unit_rows.allocated_bytes()
            + self.unit_starts.allocated_bytes()
            + self.unit_slots.allocated_bytes()
            + self.unit_parts.allocated_bytes()
            + self.split_rows.allocated_bytes()
            + self.part_first.allocated_bytes()
            + self.long_rows.allocated_bytes()
            + self.scratch.num_bytes()
    }
}

/// The order the passes over a graph's CSR units walk them in: A's units (rows) and Aᵀ's
/// (columns), as `RowUnits` numbers them with 64-edge units. A
/// locality order of the rows (fused-csr's, [`DeviceGraph::unit_walk`]) keeps the rows in flight
/// at one time graph neighbours, so the rows they gather meet in L2; every sum keeps its unit's
/// order, so results are the same bits in any walk (the fused backward's for finite inputs: a
/// warp's padding steps depend on which units share it). [`Default`]: units as numbered (the
/// graph's own row order), with no device memory.
///
/// [`DeviceGraph::unit_walk`]: crate::graph::DeviceGraph::unit_walk
#[derive(Debug, Default)]
pub struct UnitWalk {
    /// A's units in the walk's order (a permutation of them), or `None`: as numbered.
    rows: Option<DeviceVec<u32>>,
    /// Aᵀ's units with A's columns in the same order (square graphs), or `None`: as numbered.
    cols: Option<DeviceVec<u32>>,
}

impl UnitWalk {
    /// The walk of the units of a graph whose rows have `lens` edges and whose columns
    /// `col_lens`, rows (and, on a square graph, columns) taken in `order`.
    ///
    /// Errors: [`Error::LengthMismatch`] when `order` is not over the rows, out of memory.
    pub(crate) fn in_row_order(
        gpu: &Gpu,
        lens: &[u32],
        col_lens: &[u32],
        order: &Permutation,
    ) -> Result<Self> {
        let rows = units_in_row_order(lens, UNIT_CHUNK, order)?;
        let cols = if col_lens.len() == lens.len() {
            Some(units_in_row_order(col_lens, UNIT_CHUNK, order)?)
        } else {
            None
        };
        let upload = |v: &[u32]| DeviceVec::from_host_named(gpu, "unit walk", v);
        Ok(Self {
            rows: Some(upload(&rows)?),
            cols: cols.as_deref().map(upload).transpose()?,
        })
    }

    /// The walk of `a`'s units (`None`: as numbered).
    ///
    /// Errors: [`Error::LengthMismatch`] when the walk lists another number of units (made
    /// for another graph).
    pub(crate) fn rows(&self, a: &DeviceCsr) -> Result<Option<&DeviceVec<u32>>> {
        checked_walk(self.rows.as_ref(), a.schedule().n_units())
    }

    /// The walk of `t`'s units (Aᵀ's CSR), as [`rows`](Self::rows).
    pub(crate) fn cols(&self, t: &DeviceCsr) -> Result<Option<&DeviceVec<u32>>> {
        checked_walk(self.cols.as_ref(), t.schedule().n_units())
    }

    /// Bytes of device memory the walk holds.
    pub fn device_bytes(&self) -> usize {
        [&self.rows, &self.cols]
            .into_iter()
            .flatten()
            .map(DeviceVec::allocated_bytes)
            .sum()
    }
}

/// `walk` where it lists `n_units` units (each a unit index below that: a permutation).
fn checked_walk(walk: Option<&DeviceVec<u32>>, n_units: usize) -> Result<Option<&DeviceVec<u32>>> {
    match walk {
        Some(w) if w.len() != n_units => Err(Error::LengthMismatch {
            what: "unit walk",
            expected: n_units,
            actual: w.len(),
        }),
        w => Ok(w),
    }
}

impl SparseOperand for DeviceCsr {
    fn dims(&self) -> (usize, usize) {
        (self.n_rows(), self.n_cols())
    }

    /// One value an edge.
    fn per_head(&self) -> usize {
        self.nnz()
    }
}

/// The dot-form SDDMM kernel for operands of `dtype` (a [`DType::NAME`]) in vectors of `vec`
/// ([`vector_width`]); the launch-name test forms it too.
pub(crate) fn sddmm_kernel(dtype: &str, vec: u32) -> String {
    format!("sddmm_csr_{dtype}_v{vec}")
}

/// The GATv2 SDDMM kernel for operands of `dtype` in vectors of `vec`.
pub(crate) fn sddmm_gatv2_kernel(dtype: &str, vec: u32) -> String {
    format!("sddmm_gatv2_csr_{dtype}_v{vec}")
}

/// The GAT (`u_add_v`) SDDMM kernel for operands of `dtype`.
pub(crate) fn sddmm_gat_kernel(dtype: &str) -> String {
    format!("sddmm_gat_csr_{dtype}")
}

/// The SpMM kernel for features of `dtype` in vectors of `vec`.
pub(crate) fn spmm_kernel(dtype: &str, vec: u32) -> String {
    format!("spmm_csr_{dtype}_v{vec}")
}

/// The kernel writing SpMM's split rows of `dtype` from their f32 scratch.
pub(crate) fn spmm_finalize_kernel(dtype: &str) -> String {
    format!("spmm_csr_finalize_{dtype}")
}

/// A grid of `groups` groups of `g` lanes (grid-stride kernels; at most 2^31 − 1 blocks).
pub(crate) fn group_grid(groups: usize, g: u32, grid_y: u32) -> Result<LaunchConfig> {
    let per_block = THREADS / g;
    let blocks = blocks_for(groups, per_block)?;
    Ok(LaunchConfig {
        grid_dim: (blocks, grid_y, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// SDDMM, dot form: `scores[e, h] = scale · ⟨Q[row(e), h, :], K[col(e), h, :]⟩` for every
/// edge `e` of `a`.
///
/// Shapes: `q` is `a.n_rows() × heads × head_dim`, `k` is `a.n_cols() × heads × head_dim`,
/// `scores` has `nnz × heads` elements. Every element of `scores` is written.
pub fn sddmm<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    q: &DeviceMatrix<T>,
    k: &DeviceMatrix<T>,
    scale: f32,
    scores: &mut DeviceVec<f32>,
) -> Result<()> {
    let shape = check_operands(gpu, a, Op::Sddmm, [q, k], scores)?;
    let vec = vector_width(shape.head_dim, std::mem::size_of::<T>());
    let g = group_for((shape.head_dim / vec as usize) as u64, 1);
    let name = kernel_named(&CSR_OPS, sddmm_kernel(T::NAME, vec))?;
    let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, name)?;
    let nnz = to_u32("nnz", a.nnz())?;
    let heads = to_u32("heads", shape.heads)?;
    let head_dim = to_u32("head_dim", shape.head_dim)?;
    let cfg = group_grid(a.nnz(), g, 1)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(a.row_indices().slice())
        .arg(a.col_indices().slice())
        .arg(&nnz)
        .arg(q.slice())
        .arg(k.slice())
        .arg(&heads)
        .arg(&head_dim)
        .arg(&scale)
        .arg(&g)
        .arg(scores.slice_mut());
    // SAFETY: the kernel reads row_indices/col_indices[0..nnz) (both nnz long), Q rows
    // row_indices[e] < n_rows and K rows col_indices[e] < n_cols (the CSR was validated on the
    // host), each heads*head_dim elements (shapes checked above), and writes
    // scores[0..nnz*heads) (length checked). Vector loads of `vec` elements stay inside a
    // head because vec divides head_dim.
    unsafe { launch(name, &mut args, cfg) }
}

/// SDDMM, GATv2 form: `scores[e, h] = Σ_d att[h, d] · LeakyReLU(xl[col(e), h, d] +
/// xr[row(e), h, d] (+ ef[e, h, d]))`, the per-edge sum `x_i + x_j` never stored (f32 sums).
pub(crate) fn sddmm_gatv2<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    ops: &Gatv2Operands<'_, T>,
    scores: &mut DeviceVec<f32>,
) -> Result<()> {
    let (heads, dim) = ops.check(gpu, a)?;
    check_per_edge("scores", a.nnz(), heads, scores.len())?;
    check_same_gpu(gpu, "scores", scores.gpu())?;
    let vec = vector_width(dim, std::mem::size_of::<T>());
    let g = group_for((dim / vec as usize) as u64, 1);
    let name = kernel_named(&CSR_OPS, sddmm_gatv2_kernel(T::NAME, vec))?;
    let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, name)?;
    let nnz = to_u32("nnz", a.nnz())?;
    let (heads_u, dim_u) = (to_u32("heads", heads)?, to_u32("head_dim", dim)?);
    let ef = opt_ptr(gpu, "edge features", ops.ef.map(DeviceMatrix::as_vec))?;
    let cfg = group_grid(a.nnz(), g, 1)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(a.row_indices().slice())
        .arg(a.col_indices().slice())
        .arg(&nnz)
        .arg(ops.xl.slice())
        .arg(ops.xr.slice())
        .arg(&ef)
        .arg(ops.att.slice())
        .arg(&ops.slope)
        .arg(&heads_u)
        .arg(&dim_u)
        .arg(&g)
        .arg(scores.slice_mut());
    // SAFETY: reads row/col indices [0..nnz), xl rows col < n_cols and xr rows row < n_rows
    // (the validated CSR; shapes checked), ef rows e < nnz where given (shape checked),
    // att[0..heads·dim) (length checked), and writes scores[0..nnz·heads) (length checked).
    // Vectors of `vec` elements stay inside a head (vec divides dim).
    unsafe { launch(name, &mut args, cfg) }
}

/// SDDMM, GAT form (`u_add_v`): `scores[e, h] = a_dst[row(e), h] + a_src[col(e), h]`.
///
/// Shapes: `a_dst` is `a.n_rows() × heads × 1`, `a_src` is `a.n_cols() × heads × 1`.
pub(crate) fn sddmm_gat<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    a_dst: &DeviceMatrix<T>,
    a_src: &DeviceMatrix<T>,
    scores: &mut DeviceVec<f32>,
) -> Result<()> {
    let heads = a_dst.shape().heads;
    let one = Shape::new(a.n_rows(), heads, 1)?;
    one.expect_eq("a_dst", a_dst.shape())?;
    one.expect_rows_like("a_src", a_src.shape(), a.n_cols())?;
    check_per_edge("scores", a.nnz(), heads, scores.len())?;
    for (what, on) in [
        ("A", a.gpu()),
        ("a_dst", a_dst.gpu()),
        ("a_src", a_src.gpu()),
    ] {
        check_same_gpu(gpu, what, on)?;
    }
    check_same_gpu(gpu, "scores", scores.gpu())?;
    let name = kernel_named(&CSR_OPS, sddmm_gat_kernel(T::NAME))?;
    let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, name)?;
    let nnz = to_u32("nnz", a.nnz())?;
    let heads_u = to_u32("heads", heads)?;
    let cfg = group_grid(scores.len(), 1, 1)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(a.row_indices().slice())
        .arg(a.col_indices().slice())
        .arg(&nnz)
        .arg(a_dst.slice())
        .arg(a_src.slice())
        .arg(&heads_u)
        .arg(scores.slice_mut());
    // SAFETY: reads row/col indices [0..nnz), a_dst[row*heads + h] with row < n_rows and
    // a_src[col*heads + h] with col < n_cols (shapes checked), writes scores[0..nnz*heads).
    unsafe { launch(name, &mut args, cfg) }
}

/// GAT's pre-activation scores into `scores` (`nnz × heads`, A's order): `a_dst[i, h] +
/// a_src[j, h]` per edge `(i, j)`, plus `bias[e · heads + h]` where given (per head; the
/// layers' edge-feature term, a user's bias).
///
/// Errors: as [`sddmm_gat`] and [`edge_extras::bias_add`] (shapes and lengths, named).
pub(crate) fn gat_scores<A: DType, B: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    (a_dst, a_src): (&DeviceMatrix<A>, &DeviceMatrix<A>),
    bias: Option<&DeviceVec<B>>,
    scores: &mut DeviceVec<f32>,
) -> Result<()> {
    sddmm_gat(gpu, a, a_dst, a_src, scores)?;
    if let Some(b) = bias {
        let heads = a_dst.shape().heads;
        edge_extras::bias_add(gpu, scores, DeviceBias::PerHead(b), a.nnz(), heads)?;
    }
    Ok(())
}

/// [`edge_softmax_in_place`] into `out`, leaving `scores` as they are (GAT's and GATv2's
/// backward keep the scores and the probabilities both).
pub(crate) fn edge_softmax(
    gpu: &Gpu,
    a: &DeviceCsr,
    scores: &DeviceVec<f32>,
    heads: usize,
    leaky_relu: Option<f32>,
    out: &mut DeviceVec<f32>,
) -> Result<()> {
    crate::launch::softmax_out_of_place(gpu, a.nnz(), heads, leaky_relu, scores, out, |x| {
        softmax_launch(gpu, a, x)
    })
}

edge_softmax_fns! {
    DeviceCsr, |a| a.nnz();
    /// Edge softmax in place: for every row and head, `scores[e, h]` becomes
    /// `exp(x_e − max) / Σ exp(x − max)` over the row's edges, where `x = scores` or
    /// `LeakyReLU(scores, slope)` when `leaky_relu` is given.
    ///
    /// Rows without edges have nothing to write. `scores` has `nnz × heads` elements.
    in_place;
}

fn softmax_launch(gpu: &Gpu, a: &DeviceCsr, x: SoftmaxArgs) -> Result<()> {
    check_same_gpu(gpu, "A", a.gpu())?;
    let s = a.schedule();
    let n_rows = to_u32("rows", a.n_rows())?;
    let heads = x.heads;
    let heads_u = to_u32("heads", heads)?;
    let g = s.softmax_group;
    let rows_name = spattn_kernels_sys::kernel!(CSR_OPS, "edge_softmax_csr_rows");
    let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, rows_name)?;
    let cfg = group_grid(a.n_rows() * heads, g, 1)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(a.row_offsets().slice())
        .arg(&n_rows)
        .arg(&heads_u)
        .arg(&x.scores)
        .arg(&x.leaky)
        .arg(&x.slope)
        .arg(&g)
        .arg(&s.long_threshold)
        .arg(&x.out);
    // SAFETY: reads row_offsets[0..=n_rows]; for rows shorter than long_threshold reads and
    // writes elements e*heads + h of `scores` / `out` for e in the row's range (< nnz) and
    // h < heads; both buffers hold nnz*heads f32 (checked by the callers) and stay borrowed
    // (their pointer guards live in the caller) for the launch.
    unsafe { launch(rows_name, &mut args, cfg) }?;

    let n_long = s.long_rows.len();
    if n_long > 0 {
        let long_name = spattn_kernels_sys::kernel!(CSR_OPS, "edge_softmax_csr_long_rows");
        let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, long_name)?;
        let cfg = LaunchConfig {
            grid_dim: (to_u32("long rows", n_long)?, heads_u, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = gpu.launch_builder(&f);
        args.arg(a.row_offsets().slice())
            .arg(s.long_rows.slice())
            .arg(&heads_u)
            .arg(&x.scores)
            .arg(&x.leaky)
            .arg(&x.slope)
            .arg(&x.out);
        // SAFETY: block (i, h) reads long_rows[i] (i < n_long), that row's offsets, and
        // reads/writes elements e*heads + h of scores/out for the row's edges (< nnz*heads).
        unsafe { launch(long_name, &mut args, cfg) }?;
    }
    Ok(())
}

/// SpMM: `out[i, h, :] = Σ_{e ∈ row i} p[e, h] · V[col(e), h, :]`.
///
/// Shapes: `v` is `a.n_cols() × heads × head_dim`, `out` is `a.n_rows() × heads × head_dim`,
/// `p` has `nnz × heads` f32 elements. Every element of `out` is written (rows without edges
/// get zeros).
pub fn spmm<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    p: &DeviceVec<f32>,
    v: &DeviceMatrix<T>,
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    let shape = check_operands(gpu, a, Op::Spmm, [v, out], p)?;
    let s = a.schedule();
    let hd = shape.row_len();
    let vec = vector_width(shape.head_dim, std::mem::size_of::<T>());
    let g = group_for((hd / vec as usize) as u64, 1);
    let tiles = to_u32("feature tiles", hd.div_ceil(g as usize * vec as usize))?;

    // Each unit of a split row stores its f32 partial (every one written: no zeroing), and
    // the finalize adds a row's partials in order (growing the scratch if this head shape
    // needs more).
    let mut scratch_guard = s.scratch.lock();
    let need = s.n_parts.checked_mul(hd).ok_or(Error::TooLarge {
        what: "SpMM partials × heads × head_dim",
        value: (s.n_parts as u64).saturating_mul(hd as u64),
        limit: usize::MAX as u64,
    })?;
    let scratch = grown(gpu, &mut scratch_guard, "SpMM split-row scratch", need)?;

    let name = kernel_named(&CSR_OPS, spmm_kernel(T::NAME, vec))?;
    let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, name)?;
    let n_units = to_u32("SpMM units", s.unit_rows.len())?;
    let heads = to_u32("heads", shape.heads)?;
    let head_dim = to_u32("head_dim", shape.head_dim)?;
    if tiles > crate::launch::MAX_GRID_YZ {
        return Err(Error::TooLarge {
            what: "feature tiles (heads x head_dim / tile)",
            value: tiles as u64,
            limit: crate::launch::MAX_GRID_YZ as u64,
        });
    }
    let cfg = group_grid(s.unit_rows.len(), g, tiles)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(s.unit_rows.slice())
        .arg(s.unit_starts.slice())
        .arg(s.unit_parts.slice())
        .arg(&n_units)
        .arg(a.col_indices().slice())
        .arg(p.slice())
        .arg(v.slice())
        .arg(&heads)
        .arg(&head_dim)
        .arg(&g)
        .arg(out.slice_mut())
        .arg(scratch.slice_mut());
    // SAFETY: unit arrays have n_units (+1 for starts) entries; unit edge ranges lie in
    // [0, nnz) so col_indices and p[e*heads + h] (nnz*heads, checked) are in bounds; V rows are
    // column indices < n_cols; out rows are unit rows < n_rows; features col < heads*head_dim
    // (lanes past it are inactive); unit partials < n_parts and scratch holds n_parts*hd f32.
    unsafe { launch(name, &mut args, cfg) }?;

    finalize_split_rows(gpu, a, hd, &scratch.slice().slice(..), out.slice_mut())
}

/// Adds the split rows' unit partials of `a`'s SpMM units in order: `out[split_rows[s]] = Σ`
/// of its partials, `width` f32 each (`spmm_csr_finalize_{dtype}`): the SpMM's and GAT's
/// passes over the same units.
pub(crate) fn finalize_split_rows<O: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    width: usize,
    partials: &cudarc::driver::CudaView<'_, f32>,
    out: &mut cudarc::driver::CudaSlice<O>,
) -> Result<()> {
    let ([_, _, _, split_rows, part_first], _) = a.schedule().units();
    let n_split = split_rows.len();
    if n_split == 0 {
        return Ok(());
    }
    let name = kernel_named(&CSR_OPS, spmm_finalize_kernel(O::NAME))?;
    let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, name)?;
    let n_split_u = to_u32("split rows", n_split)?;
    let width_u = to_u32("partial width", width)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(split_rows.slice())
        .arg(part_first.slice())
        .arg(&n_split_u)
        .arg(&width_u)
        .arg(partials)
        .arg(out);
    // SAFETY: reads split_rows[0..n_split) (< the rows of `out`, whose callers size it rows ×
    // width), part_first[0..=n_split] (ascending to n_parts) and partials[0..n_parts·width)
    // (the callers' view holds that many); writes those rows of `out`.
    unsafe { launch(name, &mut args, group_grid(n_split * width, 1, 1)?) }
}

#[cfg(test)]
mod gpu_tests;
