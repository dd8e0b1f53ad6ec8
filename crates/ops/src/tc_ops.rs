//! The tensor-core ops on ME-BCRS (FlashSparse's swap-and-transpose): SDDMM, edge softmax and
//! SpMM, for f16 and bf16 features (`mma.sync` m16n8k16) and f32 features (through tf32,
//! m16n8k8, operands rounded with `cvt.rna`), every sum accumulated in f32.
//!
//! # Layouts
//!
//! Dense operands are `rows × heads × head_dim` row-major ([`DeviceMatrix`]), as everywhere.
//! Per-edge values (scores, probabilities) live in the **slot layout** of the
//! [`DeviceMeBcrs`], f32, **head-major**: `heads × n_slots`, the value of head `h` at slot
//! `vector · 8 + row_in_window` is element `h · n_slots + slot`. Head-major keeps the 16 × 8
//! tile of one head that a warp computes in 512 contiguous bytes, so SDDMM's stores and SpMM's
//! loads are fully coalesced. SDDMM writes this layout and SpMM reads it: no re-layout between
//! them. [`EdgeValues::to_layout`](crate::EdgeValues::to_layout) converts to and from the CSR
//! edge order of [`crate::csr_ops`] (`nnz × heads`, element `e · heads + h`).
//!
//! **Padding slots** (a slot whose mask bit is clear: the row has no edge to that vector's
//! column) carry no data. SDDMM writes −∞ there (so a softmax gives them probability exactly 0,
//! never `exp(0)`), edge softmax writes 0, and every op here ignores whatever they hold.
//!
//! # Shapes
//!
//! Any `n_rows`, `n_cols` (the last window is partial), any `heads ≥ 1` up to 65 535 and any
//! `head_dim ≥ 1`: features past `head_dim` are zero in registers and never read. Fast paths:
//! SDDMM when `head_dim` is a multiple of 8 (f16/bf16) or 4 (f32) — 16-byte gathers —, SpMM when
//! `head_dim` is a multiple of 16 (whole tiles, 4- to 32-byte gathers per lane).
//!
//! Every op needs compute capability 8.0 ([`Error::UnsupportedComputeCapability`] otherwise).
//!
//! ```no_run
//! use spattn_formats::Csr;
//! use spattn_ops::{tc_ops, DeviceMatrix, DeviceMeBcrs, DeviceVec, Gpu, Shape};
//! use half::f16;
//!
//! let gpu = Gpu::new(0)?;
//! let a = Csr::from_edges(3, 3, &[(0, 1), (0, 2), (1, 0), (2, 2)])?;
//! let me = DeviceMeBcrs::from_csr(&gpu, &a)?;
//! let shape = Shape::new(3, 2, 64)?; // 3 nodes, 2 heads, head_dim 64
//! let x: Vec<f16> = (0..shape.len()).map(|i| f16::from_f32((i % 7) as f32 / 7.0)).collect();
//! let q = DeviceMatrix::from_host(&gpu, shape, &x)?;
//! let mut scores = DeviceVec::<f32>::zeros(&gpu, 2 * me.n_slots())?;
//! tc_ops::sddmm(&gpu, &me, &q, &q, 0.125, &mut scores)?;
//! tc_ops::edge_softmax_in_place(&gpu, &me, &mut scores, 2, None)?;
//! let mut out = DeviceMatrix::<f16>::zeros(&gpu, shape)?;
//! tc_ops::spmm(&gpu, &me, &scores, &q, &mut out)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use spattn_kernels_sys::MEBCRS_OPS;

use crate::buffer::{grown, DeviceMatrix, DeviceVec};
use crate::device_mebcrs::DeviceMeBcrs;
use crate::dtype::{DType, DTypeKind};
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{
    blocks_for, check_per_edge, check_same_gpu, grid_1d, kernel_named, launch, to_u32,
    PushOptionalArg, MAX_GRID_YZ,
};
use crate::launch::{
    check_operands, edge_softmax_fns, LaunchArgs, LaunchConfig, Op, PushKernelArg, SoftmaxArgs,
    SparseOperand,
};

/// Warps per block of the SDDMM, SpMM and window-softmax kernels (each warp works alone).
const WARPS: u32 = 4;
/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;
/// Threads per block of the long-window softmax: one vector each per step, so a hub window of
/// 10^5 vectors takes about 100 steps per pass.
const LONG_WINDOW_THREADS: u32 = 1024;

/// The path name in [`Error::UnsupportedComputeCapability`].
const TC_PATH: &str = "tensor-core ops";

fn require_tensor_cores(gpu: &Gpu) -> Result<()> {
    gpu.require_compute_capability(TC_PATH, 8, 0)
}

/// The kernel-name suffix of `kind`: f32 operands run through tf32 mma, and say so.
fn suffix(kind: DTypeKind) -> &'static str {
    match kind {
        DTypeKind::F32 => "tf32",
        DTypeKind::F16 => "f16",
        DTypeKind::Bf16 => "bf16",
    }
}

/// One warp per work item (`grid.x`), `grid_y` along y.
fn warp_grid(items: usize, grid_y: usize, what: &'static str) -> Result<LaunchConfig> {
    if grid_y > MAX_GRID_YZ as usize {
        return Err(Error::TooLarge {
            what,
            value: grid_y as u64,
            limit: u64::from(MAX_GRID_YZ),
        });
    }
    Ok(LaunchConfig {
        grid_dim: (blocks_for(items, WARPS)?, grid_y as u32, 1),
        block_dim: (WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The format arguments the SDDMM and SpMM kernels take after their work items: the vectors'
/// columns and row masks, the row count, the row renumbering (null in the graph's order) and
/// the slot count.
struct FormatArgs {
    n_rows: u32,
    n_slots: u64,
}

impl FormatArgs {
    fn of(a: &DeviceMeBcrs) -> Result<Self> {
        Ok(Self {
            n_rows: to_u32("rows", a.n_rows())?,
            n_slots: a.n_slots() as u64,
        })
    }

    fn push<'a>(&'a self, args: &mut LaunchArgs<'a>, a: &'a DeviceMeBcrs) {
        args.arg(a.column_indices().slice())
            .arg(a.row_masks().slice())
            .arg(&self.n_rows)
            .arg_or_null(a.row_ids())
            .arg(&self.n_slots);
    }
}

impl SparseOperand for DeviceMeBcrs {
    fn dims(&self) -> (usize, usize) {
        (self.n_rows(), self.n_cols())
    }

    /// One value a slot.
    fn per_head(&self) -> usize {
        self.n_slots()
    }
}

/// SDDMM on tensor cores: `scores[h, slot(v, r)] = scale · ⟨Q[8w + r, h, :], K[col(v), h, :]⟩`
/// for every slot of `a` that is an edge, −∞ at every padding slot.
///
/// Shapes: `q` is `a.n_rows() × heads × head_dim`, `k` is `a.n_cols() × heads × head_dim`,
/// `scores` has `heads × a.n_slots()` elements (head-major slot layout, see the
/// [module documentation](self)). Every element of `scores` is written.
///
/// Errors: [`Error::ShapeMismatch`] / [`Error::LengthMismatch`] naming the operand,
/// [`Error::ForeignGpu`], [`Error::UnsupportedComputeCapability`] below 8.0,
/// [`Error::TooLarge`] past the kernels' 32-bit sizes or 65 535 heads.
pub fn sddmm<T: DType>(
    gpu: &Gpu,
    a: &DeviceMeBcrs,
    q: &DeviceMatrix<T>,
    k: &DeviceMatrix<T>,
    scale: f32,
    scores: &mut DeviceVec<f32>,
) -> Result<()> {
    let shape = check_operands(gpu, a, Op::Sddmm, [q, k], scores)?;
    require_tensor_cores(gpu)?;
    let name = kernel_named(&MEBCRS_OPS, sddmm_kernel(T::KIND, shape.head_dim))?;
    let f = gpu.load_function(MEBCRS_OPS.name, MEBCRS_OPS.ptx, name)?;
    let s = a.schedule();
    let n_items = to_u32("ME-BCRS work items", s.sddmm_items.len())?;
    let format = FormatArgs::of(a)?;
    let heads = to_u32("heads", shape.heads)?;
    let head_dim = to_u32("head_dim", shape.head_dim)?;
    to_u32("heads x head_dim", shape.row_len())?;
    let cfg = warp_grid(s.sddmm_items.len(), shape.heads, "heads (grid.y)")?;
    let mut args = gpu.launch_builder(&f);
    args.arg(s.sddmm_items.windows.slice())
        .arg(s.sddmm_items.starts.slice())
        .arg(s.sddmm_items.ends.slice())
        .arg(&n_items);
    format.push(&mut args, a);
    args.arg(q.slice())
        .arg(k.slice())
        .arg(&heads)
        .arg(&head_dim)
        .arg(&scale)
        .arg(scores.slice_mut());
    // SAFETY: warp i < n_items reads items[i] (each item array holds n_items entries) and the
    // vectors start..end of its item, which lie in [0, n_vectors) (the schedule was built from
    // the validated row pointers), so column_indices and row_masks (n_vectors each) are in
    // bounds. It reads Q rows only for window rows 8w + r < n_rows, through row_ids when given
    // (n_rows entries, a permutation of 0..n_rows), and K rows col(v) < n_cols (validated
    // format), features < head_dim of head h < heads (shapes checked above); aligned 16-byte
    // gathers are used only when head_dim is a multiple of their width. It writes
    // scores[h * n_slots + slot] for slots of its vectors, < heads * n_slots = scores.len().
    unsafe { launch(name, &mut args, cfg) }
}

edge_softmax_fns! {
    DeviceMeBcrs, |a| a.n_slots();
    /// Edge softmax over the slot layout, in place: for every row and head, `scores[h, slot]`
    /// becomes `exp(x − max) / Σ exp(x − max)` over the row's edge slots (what [`spmm`] reads),
    /// where `x = scores` or `LeakyReLU(scores, slope)` when `leaky_relu` is given; 0 at
    /// padding slots.
    ///
    /// `scores` has `heads × a.n_slots()` elements. Rows without edges have only padding slots
    /// (all written 0).
    in_place;
}

fn softmax_launch(gpu: &Gpu, a: &DeviceMeBcrs, x: SoftmaxArgs) -> Result<()> {
    check_same_gpu(gpu, "A", a.gpu())?;
    require_tensor_cores(gpu)?;
    let s = a.schedule();
    let n_windows = to_u32("windows", a.n_windows())?;
    let n_slots = a.n_slots() as u64;
    let long_threshold = crate::device_mebcrs::SOFTMAX_LONG_WINDOW;

    let name = spattn_kernels_sys::kernel!(MEBCRS_OPS, "edge_softmax_mebcrs_windows");
    let f = gpu.load_function(MEBCRS_OPS.name, MEBCRS_OPS.ptx, name)?;
    let cfg = warp_grid(a.n_windows(), x.heads, "heads (grid.y)")?;
    let mut args = gpu.launch_builder(&f);
    args.arg(a.row_pointers().slice())
        .arg(&n_windows)
        .arg(a.row_masks().slice())
        .arg(&n_slots)
        .arg(&long_threshold)
        .arg(&x.scores)
        .arg(&x.leaky)
        .arg(&x.slope)
        .arg(&x.out);
    // SAFETY: warp w < n_windows reads row_pointers[w..=w+1] (n_windows + 1 entries) and, for
    // windows of at most long_threshold vectors, row_masks[v] for the window's vectors
    // (< n_vectors) and reads/writes elements h * n_slots + 8v .. + 8 (h < heads = grid.y)
    // of scores/out as two 16-byte accesses (aligned: n_slots is a multiple of 8 and both
    // buffers start allocations), both heads * n_slots long (checked by the callers, which
    // hold their pointer guards for the launch).
    unsafe { launch(name, &mut args, cfg) }?;

    let n_long = s.long_windows.len();
    if n_long > 0 {
        let name = spattn_kernels_sys::kernel!(MEBCRS_OPS, "edge_softmax_mebcrs_long_windows");
        let f = gpu.load_function(MEBCRS_OPS.name, MEBCRS_OPS.ptx, name)?;
        let cfg = LaunchConfig {
            grid_dim: (to_u32("long windows", n_long)?, cfg.grid_dim.1, 1),
            block_dim: (LONG_WINDOW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = gpu.launch_builder(&f);
        args.arg(a.row_pointers().slice())
            .arg(s.long_windows.slice())
            .arg(a.row_masks().slice())
            .arg(&n_slots)
            .arg(&x.scores)
            .arg(&x.leaky)
            .arg(&x.slope)
            .arg(&x.out);
        // SAFETY: block (i, h) reads long_windows[i] (i < n_long), that window's pointers and
        // masks, and reads/writes elements h * n_slots + 8v .. + 8 of scores/out for its
        // vectors (< heads * n_slots; 32-byte aligned: n_slots is a multiple of 8 and the
        // buffers start allocations); 1024 threads = 32 warps fit its 32-warp shared arrays.
        unsafe { launch(name, &mut args, cfg) }?;
    }
    Ok(())
}

/// Tiles of 16 features per SpMM warp for `head_dim`: the largest of 8, 4, 2, 1 whose slab
/// (16 · tiles features) divides `head_dim` (no idle lanes, fewest re-reads of P); for other
/// head dims the fewest tiles (a power of two, at most 8) that cover it.
fn spmm_tiles(head_dim: usize) -> usize {
    if let Some(ft) = [8, 4, 2, 1]
        .into_iter()
        .find(|ft| head_dim % (16 * ft) == 0)
    {
        return ft;
    }
    head_dim.div_ceil(16).next_power_of_two().min(8)
}

/// Stages (k-steps in flight per warp) of the pipelined SpMM kernel.
const SPMM_PIPE_STAGES: usize = 3;

/// Tiles of 16 features per warp of the pipelined SpMM kernel (its one instantiation).
const SPMM_PIPE_TILES: usize = 8;

/// Shared memory of one warp's stage of the pipelined SpMM (mirrors `spmm_pipe_stage_bytes` in
/// mebcrs_ops.cu): the V tile (16 vectors × 16 · tiles features, 2 bytes each), the 16 vectors'
/// probabilities (16 × 8 f32) and their masks (16 bytes).
const fn spmm_pipe_stage_bytes(tiles: usize) -> usize {
    512 * tiles + 512 + 16
}

/// Whether [`spmm`] takes the pipelined kernel for `a` at `head_dim` with operands `T`: f16 or
/// bf16, `head_dim` a multiple of 128 (whole 128-feature slabs), and on average more than one
/// k-step (16 vectors) per window, so that a warp has gathers to overlap. The V rows and
/// probabilities of the next k-steps are copied into shared memory (`cp.async`) while the
/// current one is multiplied, so registers hold only accumulators; with one k-step per window
/// there is nothing to overlap (docs/kernels/tc-ops.md, "Tried and kept"). Otherwise the
/// register kernel runs. Both give the same sums in the same order up to the mma's internal
/// accumulation order.
pub(crate) fn spmm_pipelined<T: DType>(a: &DeviceMeBcrs, head_dim: usize) -> bool {
    spmm_pipe_shape(T::KIND, head_dim) && a.n_vectors() > 16 * a.n_windows()
}

/// Whether the pipelined SpMM kernel is compiled for `kind` at `head_dim` ([`spmm_pipelined`]'s
/// condition without the graph's).
pub(crate) fn spmm_pipe_shape(kind: DTypeKind, head_dim: usize) -> bool {
    // A multiple of 128 is also where spmm_tiles picks 8 tiles (the kernel's one instantiation).
    kind != DTypeKind::F32 && head_dim % (16 * SPMM_PIPE_TILES) == 0
}

/// The SDDMM kernel for operands of `kind` at `head_dim`: 16-byte gathers of
/// 16 / `size_bytes` features need `head_dim` a multiple of that, else the `_unaligned` one.
/// The launch-name test forms it too.
pub(crate) fn sddmm_kernel(kind: DTypeKind, head_dim: usize) -> String {
    let aligned = head_dim % (16 / kind.size_bytes()) == 0;
    let unaligned = if aligned { "" } else { "_unaligned" };
    format!("sddmm_mebcrs_{}{unaligned}", suffix(kind))
}

/// The SpMM kernel for operands of `kind` at `head_dim` ([`spmm_tiles`] tiles a warp, aligned
/// gathers where `head_dim` allows), or the pipelined one (`pipe`).
pub(crate) fn spmm_kernel(kind: DTypeKind, head_dim: usize, pipe: bool) -> String {
    if pipe {
        return format!("spmm_mebcrs_{}_t8_pipe", suffix(kind));
    }
    let ft = spmm_tiles(head_dim);
    let aligned = head_dim % (2 * ft) == 0;
    let unaligned = if aligned { "" } else { "_unaligned" };
    format!("spmm_mebcrs_{}_t{ft}{unaligned}", suffix(kind))
}

/// The kernel writing SpMM's split windows of `kind` from their f32 partials.
pub(crate) fn spmm_finalize_kernel(kind: DTypeKind) -> String {
    format!("spmm_mebcrs_finalize_{}", suffix(kind))
}

/// SpMM on tensor cores: `out[i, h, :] = Σ_v p[h, slot(v, i % 8)] · V[col(v), h, :]` over the
/// vectors `v` of row `i`'s window that hold an edge of row `i` (padding slots of `p` are
/// ignored, whatever they hold).
///
/// Shapes: `v` is `a.n_cols() × heads × head_dim`, `out` is `a.n_rows() × heads × head_dim`,
/// `p` has `heads × a.n_slots()` f32 elements (head-major slot layout). Every element of `out`
/// is written (rows without edges get zeros). Windows split across warps (hub rows) are summed
/// in a fixed order: the result is the same on every run.
pub fn spmm<T: DType>(
    gpu: &Gpu,
    a: &DeviceMeBcrs,
    p: &DeviceVec<f32>,
    v: &DeviceMatrix<T>,
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    let shape = check_operands(gpu, a, Op::Spmm, [v, out], p)?;
    require_tensor_cores(gpu)?;
    let s = a.schedule();
    let hd = shape.row_len();
    let hd_u = to_u32("heads x head_dim", hd)?;
    let ft = spmm_tiles(shape.head_dim);
    let slabs = shape.head_dim.div_ceil(16 * ft);
    let pipe = spmm_pipelined::<T>(a, shape.head_dim);
    let name = kernel_named(&MEBCRS_OPS, spmm_kernel(T::KIND, shape.head_dim, pipe))?;
    let smem = if pipe {
        WARPS as usize * SPMM_PIPE_STAGES * spmm_pipe_stage_bytes(SPMM_PIPE_TILES)
    } else {
        0
    };
    let f = gpu.load_function_with_shared(
        MEBCRS_OPS.name,
        MEBCRS_OPS.ptx,
        name,
        smem,
        "setting the SpMM kernel's shared memory",
    )?;
    let grid_y = shape.heads.saturating_mul(slabs);
    let mut cfg = warp_grid(s.spmm_items.len(), grid_y, "heads x feature slabs (grid.y)")?;
    cfg.shared_mem_bytes = smem as u32;

    // Partial rows of split windows: n_partials x 8 rows x hd, grown on demand (zeroed once
    // at allocation; every element a launch reads is written by it first).
    let mut scratch_guard = s.scratch.lock();
    let need = s.n_partials.checked_mul(8 * hd).ok_or(Error::TooLarge {
        what: "SpMM partial rows",
        value: s.n_partials as u64,
        limit: (usize::MAX / (8 * hd)) as u64,
    })?;
    let scratch = grown(gpu, &mut scratch_guard, "ME-BCRS SpMM partials", need)?;

    let n_items = to_u32("ME-BCRS work items", s.spmm_items.len())?;
    let format = FormatArgs::of(a)?;
    let heads = to_u32("heads", shape.heads)?;
    let head_dim = to_u32("head_dim", shape.head_dim)?;
    let slabs_u = to_u32("feature slabs", slabs)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(s.spmm_items.windows.slice())
        .arg(s.spmm_items.starts.slice())
        .arg(s.spmm_items.ends.slice())
        .arg(s.item_partials.slice())
        .arg(&n_items);
    format.push(&mut args, a);
    args.arg(p.slice())
        .arg(v.slice())
        .arg(&heads)
        .arg(&head_dim)
        .arg(&slabs_u)
        .arg(out.slice_mut())
        .arg(scratch.slice_mut());
    // SAFETY: warp i < n_items reads items[i] (four arrays of n_items) and vectors
    // start..end < n_vectors of column_indices / row_masks; p[h * n_slots + 8v + r] only where
    // bit r of mask(v) is set (< heads * n_slots = p.len(), checked); V rows col(v) < n_cols,
    // features < head_dim of head h = blockIdx.y / slabs < heads (grid.y = heads * slabs);
    // aligned gathers only when head_dim is a multiple of their width. It writes out rows
    // row_ids[8w + r] (8w + r without row_ids) for 8w + r < n_rows — row_ids holds n_rows
    // entries, a permutation of 0..n_rows — (features < head_dim of head h; out is
    // n_rows x hd), or, for items of
    // split windows, scratch rows (partial * 8 + r) with partial < n_partials: scratch holds
    // at least n_partials * 8 * hd f32.
    unsafe { launch(name, &mut args, cfg) }?;

    let n_split = s.split_windows.len();
    if n_split > 0 {
        let fin = kernel_named(&MEBCRS_OPS, spmm_finalize_kernel(T::KIND))?;
        let f = gpu.load_function(MEBCRS_OPS.name, MEBCRS_OPS.ptx, fin)?;
        let n_split_u = to_u32("split windows", n_split)?;
        let cfg = grid_1d(n_split * 8 * hd, THREADS)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(s.split_windows.slice())
            .arg(s.partial_first.slice())
            .arg(&n_split_u)
            .arg(&format.n_rows)
            .arg_or_null(a.row_ids())
            .arg(&hd_u)
            .arg(scratch.slice())
            .arg(out.slice_mut());
        // SAFETY: reads split_windows[0..n_split), partial_first[0..=n_split] and scratch rows
        // (partial * 8 + r) for the partials of each split window (< n_partials, all written
        // by the SpMM launch before it on the stream); writes out rows row_ids[8w + r] (or
        // 8w + r) for 8w + r < n_rows, as the SpMM launch.
        unsafe { launch(fin, &mut args, cfg) }?;
    }
    Ok(())
}

/// Moves per-edge values from CSR edge order (`values`: `nnz × heads`, element `e · heads + h`,
/// as [`crate::csr_ops`] uses) into the slot layout (`out`: `heads × n_slots`); padding slots
/// get `fill`.
pub(crate) fn csr_to_slots(
    gpu: &Gpu,
    a: &DeviceMeBcrs,
    values: &DeviceVec<f32>,
    heads: usize,
    fill: f32,
    out: &mut DeviceVec<f32>,
) -> Result<()> {
    check_per_edge("CSR-order values", a.nnz(), heads, values.len())?;
    check_per_edge("slot values", a.n_slots(), heads, out.len())?;
    for (what, on) in [("A", a.gpu()), ("CSR-order values", values.gpu())] {
        check_same_gpu(gpu, what, on)?;
    }
    check_same_gpu(gpu, "slot values", out.gpu())?;
    require_tensor_cores(gpu)?;
    out.fill(fill)?;
    let name = spattn_kernels_sys::kernel!(MEBCRS_OPS, "csr_to_slots_mebcrs");
    move_through_slot_map(gpu, a, name, heads, values.len(), values, out)
}

/// Moves per-slot values (`slots`: `heads × n_slots`) into CSR edge order (`out`:
/// `nnz × heads`, element `e · heads + h`). Padding slots are dropped.
pub(crate) fn slots_to_csr(
    gpu: &Gpu,
    a: &DeviceMeBcrs,
    slots: &DeviceVec<f32>,
    heads: usize,
    out: &mut DeviceVec<f32>,
) -> Result<()> {
    check_per_edge("slot values", a.n_slots(), heads, slots.len())?;
    check_per_edge("CSR-order values", a.nnz(), heads, out.len())?;
    for (what, on) in [("A", a.gpu()), ("slot values", slots.gpu())] {
        check_same_gpu(gpu, what, on)?;
    }
    check_same_gpu(gpu, "CSR-order values", out.gpu())?;
    require_tensor_cores(gpu)?;
    let name = spattn_kernels_sys::kernel!(MEBCRS_OPS, "slots_to_csr_mebcrs");
    move_through_slot_map(gpu, a, name, heads, out.len(), slots, out)
}

/// Launches `name`, [`csr_to_slots`]'s or [`slots_to_csr`]'s kernel: one thread per
/// CSR-order value (`csr_len = nnz × heads`) moves it between `input` and `out` through `a`'s
/// edge → slot map. The callers checked both buffers' lengths and GPUs.
fn move_through_slot_map(
    gpu: &Gpu,
    a: &DeviceMeBcrs,
    name: &'static str,
    heads: usize,
    csr_len: usize,
    input: &DeviceVec<f32>,
    out: &mut DeviceVec<f32>,
) -> Result<()> {
    let f = gpu.load_function(MEBCRS_OPS.name, MEBCRS_OPS.ptx, name)?;
    let nnz = to_u32("nnz", a.nnz())?;
    let heads_u = to_u32("heads", heads)?;
    let n_slots = a.n_slots() as u64;
    let cfg = grid_1d(csr_len, THREADS)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(a.edge_to_slot().slice())
        .arg(&nnz)
        .arg(&heads_u)
        .arg(&n_slots)
        .arg(input.slice())
        .arg(out.slice_mut());
    // SAFETY: thread i < nnz * heads reads edge_to_slot[i / heads] (nnz entries), a slot
    // < n_slots. CSR_TO_SLOTS reads input[i] (nnz * heads, checked) and writes
    // out[h * n_slots + slot] < heads * n_slots = out.len() (checked); SLOTS_TO_CSR reads
    // input[h * n_slots + slot] < heads * n_slots = input.len() and writes out[i] (nnz * heads,
    // checked).
    unsafe { launch(name, &mut args, cfg) }
}

#[cfg(test)]
mod gpu_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_per_warp() {
        assert_eq!(spmm_tiles(128), 8);
        assert_eq!(spmm_tiles(256), 8);
        assert_eq!(spmm_tiles(64), 4);
        assert_eq!(spmm_tiles(96), 2);
        assert_eq!(spmm_tiles(16), 1);
        assert_eq!(spmm_tiles(48), 1);
        assert_eq!(spmm_tiles(24), 2);
        assert_eq!(spmm_tiles(3), 1);
        assert_eq!(spmm_tiles(1), 1);
        assert_eq!(spmm_tiles(200), 8);
        for hd in 1..600 {
            let ft = spmm_tiles(hd);
            assert!([1, 2, 4, 8].contains(&ft));
            assert!(hd.div_ceil(16 * ft) * 16 * ft >= hd);
        }
    }

    #[test]
    fn every_kernel_exists() {
        for sfx in ["f16", "bf16", "tf32"] {
            for al in ["", "_unaligned"] {
                assert!(kernel_named(&MEBCRS_OPS, format!("sddmm_mebcrs_{sfx}{al}")).is_ok());
                for ft in [1, 2, 4, 8] {
                    assert!(
                        kernel_named(&MEBCRS_OPS, format!("spmm_mebcrs_{sfx}_t{ft}{al}")).is_ok()
                    );
                }
            }
            assert!(kernel_named(&MEBCRS_OPS, format!("spmm_mebcrs_finalize_{sfx}")).is_ok());
        }
        assert!(kernel_named(&MEBCRS_OPS, "nope".into()).is_err());
    }
}
