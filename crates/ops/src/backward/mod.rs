//! The backward ops of graph attention on the GPU (kernels: `crates/kernels-sys/cuda/backward.cu`):
//! what the gradients of SDDMM → edge softmax → SpMM need beyond the forward ops of
//! [`crate::csr_ops`].
//!
//! Per head, with `s = scale · ⟨q, k⟩` per edge, `P` its row softmax and `dOut` the gradient of
//! `out = P · V`:
//!
//! | gradient | computed as | ops |
//! |---|---|---|
//! | `dP_e = ⟨dOut_row, V_col⟩` | SDDMM of dOut and V | [`csr_ops::sddmm`](crate::csr_ops::sddmm) (scale 1) |
//! | `dS = P ⊙ (dP − rowsum(P ⊙ dP))` | softmax backward | [`edge_softmax_backward_in_place`] |
//! | `dQ = scale · dS · K` | SpMM on A | [`edge_scale`], [`csr_ops::spmm`](crate::csr_ops::spmm) |
//! | `dK = scale · dSᵀ · Q`, `dV = Pᵀ · dOut` | SpMM on Aᵀ | [`transpose_edge_values`], `spmm` on [`DeviceTranspose::csr`] |
//! | `dscale = Σ dS ⊙ ⟨q, k⟩` | a dot product of edge values, in a fixed order | [`edge_dot`] into a [`DeviceSum`] |
//! | all of dS, Pᵀ, dSᵀ, dscale at once | one fused row kernel | [`attention_edge_backward`] |
//! | every gradient, no per-edge buffer (with edge features: a score pair per edge and head), deterministic | a row pass and a column pass | [`FusedBackward`] |
//!
//! and, for GAT's and GATv2's additive scores, their attention forward and backward in one
//! call each by kernel set ([`gat_forward`], [`gat_backward`], [`GatKernels`]; [`gatv2_forward`],
//! [`gatv2_backward`]).
//!
//! Layouts are those of [`crate::csr_ops`]: per-edge values `nnz × heads` f32 (edge `e`, head
//! `h` at `e · heads + h`) in the CSR order of A, or of Aᵀ after [`transpose_edge_values`].
//!
//! ```no_run
//! use spattn_formats::Csr;
//! use spattn_ops::{backward, csr_ops, DeviceCsr, DeviceVec, Gpu};
//!
//! let gpu = Gpu::new(0)?;
//! let a = Csr::from_edges(3, 3, &[(0, 1), (0, 2), (1, 0), (2, 2)])?;
//! let (a_dev, t) = (DeviceCsr::upload(&gpu, &a)?, backward::DeviceTranspose::upload(&gpu, &a)?);
//! let heads = 2;
//! let p = DeviceVec::from_host(&gpu, &[0.5f32, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0])?;
//! let mut dp = DeviceVec::from_host(&gpu, &[1.0f32, 0.0, -1.0, 0.0, 2.0, 2.0, 3.0, 3.0])?;
//! backward::edge_softmax_backward_in_place(&gpu, &a_dev, &p, &mut dp, heads)?; // dp is dS now
//! let mut ds_t = DeviceVec::<f32>::zeros(&gpu, a.nnz() * heads)?;
//! backward::transpose_edge_values(&gpu, &t, &dp, heads, &mut ds_t)?;
//! assert_eq!(dp.to_host()?[..4], [0.5, 0.0, -0.5, 0.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::sync::OnceLock;

use cudarc::driver::DevicePtrMut;
use spattn_formats::Csr;
use spattn_kernels_sys::BACKWARD;

use crate::buffer::{expect_len, DeviceMatrix, DeviceVec};
use crate::csr_ops::group_grid;
use crate::device_csr::DeviceCsr;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{
    check_per_edge, check_same_gpu, grid_1d, kernel_named, launch, opt_ptr, product, to_u32,
};
use crate::launch::{LaunchConfig, PushKernelArg};
use crate::schedule::{group_for, vector_width};
use crate::shape::Shape;

pub(crate) mod fused;
pub(crate) mod gat;
#[cfg(test)]
mod gat_gpu_tests;
mod gat_kernels;
pub(crate) mod gat_rows;
#[cfg(test)]
mod gpu_tests;
mod keep_bits;
mod tc;
pub use crate::gatv2::Gatv2Operands;
pub use fused::{EdgeTerms, FusedBackward};
pub use gat::{GatGrads, GatScoreTerms};
pub use gat_kernels::{
    gat_backward, gat_forward, gatv2_backward, gatv2_forward, GatBackward, GatForward, GatKernels,
    Gatv2Grads,
};
pub use gat_rows::{KeepBits, RowStats};
pub use keep_bits::dropout_mask_words;
pub use tc::TensorCoreBackward;

/// Threads per block of the elementwise and reduction kernels.
const THREADS: u32 = 256;
/// The most blocks of [`DeviceSum`]'s kernel (each sums a contiguous chunk of the values, and the
/// last to finish adds the chunk sums): enough to fill an H100 several times over.
const SUM_BLOCKS: usize = 1024;
/// Values a block of [`DeviceSum`]'s kernel sums at least (fewer blocks for short inputs).
const SUM_CHUNK_MIN: usize = 8 * THREADS as usize;
/// Threads of the one-block-per-long-row kernels (as the edge softmax's).
const LONG_ROW_THREADS: u32 = 512;

/// A sum of f32 values taken on the device in a fixed order: the same values give the same
/// bits on every run (no float atomics). The total, one f64, stays on the device
/// ([`total`](Self::total)) beside the chunk sums and the counter its kernel uses.
/// [`edge_dot`] and [`attention_edge_backward`] write theirs into one.
#[derive(Debug)]
pub struct DeviceSum {
    total: DeviceVec<f64>,
    block_sums: DeviceVec<f64>,
    counter: DeviceVec<u32>,
}

impl DeviceSum {
    /// A sum on `gpu`, its total 0.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Self {
            total: DeviceVec::zeros(gpu, 1)?,
            block_sums: DeviceVec::zeros(gpu, SUM_BLOCKS)?,
            counter: DeviceVec::zeros(gpu, 1)?,
        })
    }

    /// The total of the last sum taken into it: one f64, on the device (read it with
    /// [`DeviceVec::to_host`], a wait for the GPU).
    pub fn total(&self) -> &DeviceVec<f64> {
        &self.total
    }

    /// Device memory it holds, in bytes.
    pub fn allocated_bytes(&self) -> usize {
        self.total.allocated_bytes()
            + self.block_sums.allocated_bytes()
            + self.counter.allocated_bytes()
    }

    /// `total = Σ_i x[i]` (times `y[i]` where `y` is given): block `b` sums the `b`-th of up to
    /// [`SUM_BLOCKS`] contiguous chunks in f64, and the last block to finish adds the chunk
    /// sums (the grid depends only on the length: the same order every run).
    pub(crate) fn take(
        &mut self,
        gpu: &Gpu,
        x: &DeviceVec<f32>,
        y: Option<&DeviceVec<f32>>,
    ) -> Result<()> {
        if let Some(y) = y {
            expect_len("y", x.len(), y.len())?;
        }
        check_same_gpu(gpu, "x", x)?;
        check_same_gpu(gpu, "sum", &self.total)?;
        let y_ptr = opt_ptr(gpu, "y", y)?;
        let name = spattn_kernels_sys::kernel!(BACKWARD, "sum_in_order_f32");
        let f = function(gpu, name)?;
        let n = x.len() as u64;
        let mut args = gpu.launch_builder(&f);
        args.arg(x.slice())
            .arg(&y_ptr)
            .arg(&n)
            .arg(self.block_sums.slice_mut())
            .arg(self.counter.slice_mut())
            .arg(self.total.slice_mut());
        let blocks = x.len().div_ceil(SUM_CHUNK_MIN).clamp(1, SUM_BLOCKS);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: block b reads x (and y, the same length, checked) in its chunk of [0, n),
        // n = x's length; it writes block_sums[b] (SUM_BLOCKS entries, at least the grid), and the last
        // block reads them and writes total[0] and counter[0] (one element each).
        unsafe { launch(name, &mut args, cfg) }
    }
}

/// Aᵀ of a [`Csr`] mask in device memory, with the map that moves per-edge values from A's
/// edge order to Aᵀ's: `map()[e]` is the position in Aᵀ of A's edge `e`.
///
/// Built on the host by [`Csr::transpose_with_map`] (whose map goes the other way; this one
/// is its inverse) and uploaded once; Aᵀ carries its own SpMM schedules, so hub *columns* of A
/// (hub rows of Aᵀ) are split like hub rows.
#[derive(Debug)]
pub struct DeviceTranspose {
    csr: DeviceCsr,
    map: DeviceVec<u32>,
    /// The inverse map (Aᵀ's entries' edges of A), made on the first call that needs it.
    inverse: OnceLock<DeviceVec<u32>>,
}

impl DeviceTranspose {
    /// Transposes `a` on the host and uploads Aᵀ (with its schedules) and the edge map.
    pub fn upload(gpu: &Gpu, a: &Csr) -> Result<Self> {
        let (at, from_a) = a.transpose_with_map();
        let mut to_t = vec![0u32; from_a.len()];
        for (t, &e) in from_a.iter().enumerate() {
            // Positions fit u32: the number of edges does (Csr's invariant).
            to_t[e as usize] = t as u32;
        }
        Ok(Self {
            csr: DeviceCsr::upload(gpu, &at)?,
            map: DeviceVec::from_host_named(gpu, "transpose edge map", &to_t)?,
            inverse: OnceLock::new(),
        })
    }

    /// Aᵀ and the map built on the device (`crate::device_plan`).
    pub(crate) fn from_parts(csr: DeviceCsr, map: DeviceVec<u32>) -> Self {
        Self {
            csr,
            map,
            inverse: OnceLock::new(),
        }
    }

    /// Aᵀ: `a.n_cols()` rows, `a.n_rows()` columns, the same edges.
    pub fn csr(&self) -> &DeviceCsr {
        &self.csr
    }

    /// For each edge `e` of A (CSR order), its position in Aᵀ (`nnz` entries).
    pub fn map(&self) -> &DeviceVec<u32> {
        &self.map
    }

    /// For each entry of Aᵀ (CSR order), its edge of A: the inverse of [`map`](Self::map),
    /// made by one `nnz` kernel on the first call and kept (GATv2's transposed gradient pass
    /// reads it every backward).
    pub(crate) fn inverse_map(&self, gpu: &Gpu) -> Result<&DeviceVec<u32>> {
        if let Some(inv) = self.inverse.get() {
            return Ok(inv);
        }
        let nnz = self.map.len();
        let mut inv = DeviceVec::<u32>::zeros(gpu, nnz)?;
        if nnz > 0 {
            check_same_gpu(gpu, "transpose", &self.csr)?;
            let name = spattn_kernels_sys::kernel!(BACKWARD, "invert_edge_map_u32");
            let f = function(gpu, name)?;
            let nnz_u = to_u32("nnz", nnz)?;
            let cfg = grid_1d(nnz, THREADS)?;
            let mut args = gpu.launch_builder(&f);
            args.arg(self.map.slice()).arg(&nnz_u).arg(inv.slice_mut());
            // SAFETY: reads map[0..nnz) (nnz long: a permutation of 0..nnz, the transpose's
            // invariant) and writes inv[map[e]] < nnz (inv is nnz long).
            unsafe { launch(name, &mut args, cfg) }?;
        }
        // Another thread may have set it first: both are the same map; keep the first.
        let _ = self.inverse.set(inv);
        // The cell was set just above (by this call or another).
        Ok(self.inverse.get().expect("set above"))
    }

    /// Device memory held, in bytes (the inverse map once made).
    pub fn device_bytes(&self) -> usize {
        self.csr.device_bytes()
            + self.map.allocated_bytes()
            + self.inverse.get().map_or(0, DeviceVec::allocated_bytes)
    }
}

/// The per-row sum kernel (rows below the long threshold) writing `dtype` (a
/// [`DType::NAME`]); the launch-name test forms it too.
pub(crate) fn row_sum_kernel(dtype: &str) -> String {
    format!("edge_row_sum_csr_rows_{dtype}")
}

/// The per-row sum kernel of the long rows (a block each) writing `dtype`.
pub(crate) fn long_row_sum_kernel(dtype: &str) -> String {
    format!("edge_row_sum_csr_long_rows_{dtype}")
}

/// GATv2's edge-gradient kernel for features of `dtype` in vectors of `vec`
/// ([`vector_width`]).
pub(crate) fn gatv2_grad_kernel(dtype: &str, vec: u32) -> String {
    format!("gatv2_edge_grad_csr_{dtype}_v{vec}")
}

fn function(gpu: &Gpu, name: &'static str) -> Result<cudarc::driver::CudaFunction> {
    gpu.load_function(BACKWARD.name, BACKWARD.ptx, name)
}

/// Moves per-edge values from A's edge order to Aᵀ's:
/// `dst[map[e] · heads + h] = src[e · heads + h]` ([`DeviceTranspose::map`]).
///
/// `src` and `dst` hold `nnz × heads` f32 and must be different buffers (Rust's borrows
/// ensure it).
pub fn transpose_edge_values(
    gpu: &Gpu,
    t: &DeviceTranspose,
    src: &DeviceVec<f32>,
    heads: usize,
    dst: &mut DeviceVec<f32>,
) -> Result<()> {
    let nnz = t.csr.nnz();
    check_per_edge("src", nnz, heads, src.len())?;
    check_per_edge("dst", nnz, heads, dst.len())?;
    check_same_gpu(gpu, "transpose", &t.csr)?;
    check_same_gpu(gpu, "src", src)?;
    check_same_gpu(gpu, "dst", dst)?;
    let name = spattn_kernels_sys::kernel!(BACKWARD, "transpose_edge_values_csr_f32");
    let f = function(gpu, name)?;
    let (nnz_u, heads_u) = (to_u32("nnz", nnz)?, to_u32("heads", heads)?);
    let cfg = grid_1d(src.len(), THREADS)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(t.map.slice())
        .arg(&nnz_u)
        .arg(&heads_u)
        .arg(src.slice())
        .arg(dst.slice_mut());
    // SAFETY: reads map[0..nnz) (nnz entries, each < nnz: a permutation built on the host)
    // and src[0..nnz*heads); writes dst[map[e]*heads + h] < nnz*heads (lengths checked).
    unsafe { launch(name, &mut args, cfg) }
}

/// Softmax backward over each row's edges, in place: `ds = p ⊙ (dp − rowsum(p ⊙ dp))` per
/// head, the gradient of the scores given the probabilities `p` (from
/// [`csr_ops::edge_softmax_in_place`](crate::csr_ops::edge_softmax_in_place)) and their
/// gradient `dp`; `dp_ds` holds dP on entry and dS on return.
///
/// All are `nnz × heads` f32 in A's edge order. Rows without edges write nothing.
pub fn edge_softmax_backward_in_place(
    gpu: &Gpu,
    a: &DeviceCsr,
    p: &DeviceVec<f32>,
    dp_ds: &mut DeviceVec<f32>,
    heads: usize,
) -> Result<()> {
    check_per_edge("dp", a.nnz(), heads, dp_ds.len())?;
    check_same_gpu(gpu, "dp", dp_ds)?;
    let stream = gpu.stream().clone();
    let (ptr, _g) = dp_ds.slice_mut().device_ptr_mut(&stream);
    softmax_backward_launch(gpu, a, p, ptr, ptr, heads)
}

fn softmax_backward_launch(
    gpu: &Gpu,
    a: &DeviceCsr,
    p: &DeviceVec<f32>,
    dp: u64,
    ds: u64,
    heads: usize,
) -> Result<()> {
    check_per_edge("p", a.nnz(), heads, p.len())?;
    check_same_gpu(gpu, "A", a)?;
    check_same_gpu(gpu, "p", p)?;
    let s = a.schedule();
    let n_rows = to_u32("rows", a.n_rows())?;
    let heads_u = to_u32("heads", heads)?;
    let g = s.softmax_group;
    let name = spattn_kernels_sys::kernel!(BACKWARD, "edge_softmax_backward_csr_rows");
    let f = function(gpu, name)?;
    let cfg = group_grid(a.n_rows() * heads, g, 1)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(a.row_offsets().slice())
        .arg(&n_rows)
        .arg(&heads_u)
        .arg(p.slice())
        .arg(&dp)
        .arg(&g)
        .arg(&s.long_threshold)
        .arg(&ds);
    // SAFETY: reads row_offsets[0..=n_rows]; for each short row reads p/dp and writes ds at
    // e*heads + h for the row's edges e < nnz and h < heads; all three hold nnz*heads f32
    // (checked by the callers), and the dp/ds pointer guards live in the caller.
    unsafe { launch(name, &mut args, cfg) }?;
    let n_long = s.long_rows.len();
    if n_long > 0 {
        let name = spattn_kernels_sys::kernel!(BACKWARD, "edge_softmax_backward_csr_long_rows");
        let f = function(gpu, name)?;
        let cfg = long_rows_grid(n_long, heads)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(a.row_offsets().slice())
            .arg(s.long_rows.slice())
            .arg(&heads_u)
            .arg(p.slice())
            .arg(&dp)
            .arg(&ds);
        // SAFETY: block (i, h) reads long_rows[i] (i < n_long) and that row's offsets, and
        // reads p/dp and writes ds at e*heads + h for the row's edges (< nnz*heads).
        unsafe { launch(name, &mut args, cfg) }?;
    }
    Ok(())
}

fn long_rows_grid(n_long: usize, heads: usize) -> Result<LaunchConfig> {
    let heads_u = to_u32("heads", heads)?;
    if heads_u > crate::launch::MAX_GRID_YZ {
        return Err(Error::TooLarge {
            what: "heads (grid.y of the long-row kernels)",
            value: u64::from(heads_u),
            limit: u64::from(crate::launch::MAX_GRID_YZ),
        });
    }
    Ok(LaunchConfig {
        grid_dim: (to_u32("long rows", n_long)?, heads_u, 1),
        block_dim: (LONG_ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The fused per-edge backward of attention, from `raw = ⟨q, k⟩` and `dp = ⟨dOut, V⟩` (both
/// `nnz × heads` f32 in A's edge order, e.g. [`csr_ops::sddmm`](crate::csr_ops::sddmm) with
/// scale 1): per row and head, one kernel recomputes `P = softmax_row(scale · raw)` and
/// `D = Σ_row P ⊙ dp`, and writes, per edge,
///
/// - `scale · dS` over `dp` (A's order: the weights of `dQ = scale · dS · K`),
/// - `P` into `p_t` and `scale · dS` into `ds_t` at Aᵀ's positions (the weights of
///   `dV = Pᵀ · dOut` and `dK = scale · dSᵀ · Q`: no separate transposes),
///
/// with `dS = P ⊙ (dp − D)`, and writes `Σ dS ⊙ raw` (the gradient of the scale) into
/// `d_scale`: each (row, head) its share into `dscale_rows` (`n_rows × heads` f32), then their
/// sum in a fixed order (bitwise the same on every run).
///
/// Rows without edges write no per-edge value (their positions do not exist in those buffers)
/// and a share of 0.
#[allow(clippy::too_many_arguments)]
pub fn attention_edge_backward(
    gpu: &Gpu,
    a: &DeviceCsr,
    t: &DeviceTranspose,
    heads: usize,
    scale: f32,
    raw: &DeviceVec<f32>,
    dp: &mut DeviceVec<f32>,
    p_t: &mut DeviceVec<f32>,
    ds_t: &mut DeviceVec<f32>,
    dscale_rows: &mut DeviceVec<f32>,
    d_scale: &mut DeviceSum,
) -> Result<()> {
    let nnz = a.nnz();
    fused::check_transpose(a, t)?;
    for (what, len) in [
        ("raw", raw.len()),
        ("dp", dp.len()),
        ("p_t", p_t.len()),
        ("ds_t", ds_t.len()),
    ] {
        check_per_edge(what, nnz, heads, len)?;
    }
    let rows = product("rows × heads", &[a.n_rows(), heads])?;
    expect_len("dscale_rows", rows, dscale_rows.len())?;
    check_same_gpu(gpu, "A", a)?;
    check_same_gpu(gpu, "transpose", &t.csr)?;
    check_same_gpu(gpu, "raw", raw)?;
    check_same_gpu(gpu, "dp", dp)?;
    check_same_gpu(gpu, "p_t", p_t)?;
    check_same_gpu(gpu, "ds_t", ds_t)?;
    check_same_gpu(gpu, "dscale_rows", dscale_rows)?;
    let s = a.schedule();
    let n_rows = to_u32("rows", a.n_rows())?;
    let heads_u = to_u32("heads", heads)?;
    let g = s.softmax_group;
    let name = spattn_kernels_sys::kernel!(BACKWARD, "attention_backward_csr_rows");
    let f = function(gpu, name)?;
    let cfg = group_grid(rows, g, 1)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(a.row_offsets().slice())
        .arg(&n_rows)
        .arg(&heads_u)
        .arg(&scale)
        .arg(raw.slice())
        .arg(dp.slice_mut())
        .arg(t.map.slice())
        .arg(p_t.slice_mut())
        .arg(ds_t.slice_mut())
        .arg(&g)
        .arg(&s.long_threshold)
        .arg(dscale_rows.slice_mut());
    // SAFETY: reads row_offsets[0..=n_rows]; for the edges e < nnz of each short row, reads
    // raw/dp and writes dp at e*heads + h, reads map[e] (< nnz: a permutation) and writes
    // p_t/ds_t at map[e]*heads + h; every per-edge buffer holds nnz*heads f32 (checked), and
    // each short row's group writes dscale_rows[row*heads + h] (n_rows*heads long, checked).
    unsafe { launch(name, &mut args, cfg) }?;
    let n_long = s.long_rows.len();
    if n_long > 0 {
        let name = spattn_kernels_sys::kernel!(BACKWARD, "attention_backward_csr_long_rows");
        let f = function(gpu, name)?;
        let cfg = long_rows_grid(n_long, heads)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(a.row_offsets().slice())
            .arg(s.long_rows.slice())
            .arg(&heads_u)
            .arg(&scale)
            .arg(raw.slice())
            .arg(dp.slice_mut())
            .arg(t.map.slice())
            .arg(p_t.slice_mut())
            .arg(ds_t.slice_mut())
            .arg(dscale_rows.slice_mut());
        // SAFETY: as above for the row long_rows[i] (i < n_long) of block (i, h).
        unsafe { launch(name, &mut args, cfg) }?;
    }
    d_scale.take(gpu, dscale_rows, None)
}

/// The derivative of the LeakyReLU applied before a softmax (GAT):
/// `grad[i] *= pre[i] ≥ 0 ? 1 : slope`, in place, where `pre` holds the scores *before* the
/// activation (the branch taken at 0 is the forward's, which keeps `x ≥ 0`).
pub(crate) fn edge_leaky_relu_backward(
    gpu: &Gpu,
    pre: &DeviceVec<f32>,
    slope: f32,
    grad: &mut DeviceVec<f32>,
) -> Result<()> {
    expect_len("grad", pre.len(), grad.len())?;
    check_same_gpu(gpu, "pre", pre)?;
    check_same_gpu(gpu, "grad", grad)?;
    let name = spattn_kernels_sys::kernel!(BACKWARD, "edge_leaky_relu_backward_f32");
    let f = function(gpu, name)?;
    let n = grad.len() as u64;
    let cfg = grid_1d(grad.len(), THREADS)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(pre.slice())
        .arg(&n)
        .arg(&slope)
        .arg(grad.slice_mut());
    // SAFETY: reads pre[0..n) and reads/writes grad[0..n); both hold n elements (checked).
    unsafe { launch(name, &mut args, cfg) }
}

/// `x *= alpha`, in place (e.g. the `scale` of `dQ = scale · dS · K`).
pub fn edge_scale(gpu: &Gpu, x: &mut DeviceVec<f32>, alpha: f32) -> Result<()> {
    check_same_gpu(gpu, "x", x)?;
    let name = spattn_kernels_sys::kernel!(BACKWARD, "edge_scale_f32");
    let f = function(gpu, name)?;
    let n = x.len() as u64;
    let cfg = grid_1d(x.len(), THREADS)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(x.slice_mut()).arg(&n).arg(&alpha);
    // SAFETY: reads and writes x[0..n); x holds n elements.
    unsafe { launch(name, &mut args, cfg) }
}

/// `acc = Σ_i x[i] · y[i]`, summed in f64 in a fixed order (bitwise the same on every run).
/// Nothing is downloaded: read [`DeviceSum::total`] when needed.
pub fn edge_dot(
    gpu: &Gpu,
    x: &DeviceVec<f32>,
    y: &DeviceVec<f32>,
    acc: &mut DeviceSum,
) -> Result<()> {
    acc.take(gpu, x, Some(y))
}

/// Per row and head, the sum of the row's per-edge values:
/// `out[i, h, 0] = Σ_{e ∈ row i} values[e · heads + h]` (f32 sums, stored as `T`); rows
/// without edges get 0. `out` is `a.n_rows() × heads × 1`.
///
/// On Aᵀ ([`DeviceTranspose::csr`], after [`transpose_edge_values`]) this gives the column
/// sums of A's values: GAT's ∂a_src, where the row sums on A give ∂a_dst.
pub(crate) fn edge_row_sum<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    values: &DeviceVec<f32>,
    heads: usize,
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    check_per_edge("values", a.nnz(), heads, values.len())?;
    Shape::new(a.n_rows(), heads, 1)?.expect_eq("out", out.shape())?;
    check_same_gpu(gpu, "A", a)?;
    check_same_gpu(gpu, "values", values)?;
    check_same_gpu(gpu, "out", out)?;
    let s = a.schedule();
    let n_rows = to_u32("rows", a.n_rows())?;
    let heads_u = to_u32("heads", heads)?;
    let g = s.softmax_group;
    let name = kernel_named(&BACKWARD, row_sum_kernel(T::NAME))?;
    let f = function(gpu, name)?;
    let cfg = group_grid(a.n_rows() * heads, g, 1)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(a.row_offsets().slice())
        .arg(&n_rows)
        .arg(&heads_u)
        .arg(values.slice())
        .arg(&g)
        .arg(&s.long_threshold)
        .arg(out.slice_mut());
    // SAFETY: reads row_offsets[0..=n_rows] and values[e*heads + h] for the edges of short
    // rows (< nnz*heads, checked); writes out[row*heads + h] < n_rows*heads (shape checked).
    unsafe { launch(name, &mut args, cfg) }?;
    let n_long = s.long_rows.len();
    if n_long > 0 {
        let name = kernel_named(&BACKWARD, long_row_sum_kernel(T::NAME))?;
        let f = function(gpu, name)?;
        let cfg = long_rows_grid(n_long, heads)?;
        let mut args = gpu.launch_builder(&f);
        args.arg(a.row_offsets().slice())
            .arg(s.long_rows.slice())
            .arg(&heads_u)
            .arg(values.slice())
            .arg(out.slice_mut());
        // SAFETY: as above, for the row long_rows[i] (i < n_long) of block (i, h).
        unsafe { launch(name, &mut args, cfg) }?;
    }
    Ok(())
}

/// GATv2's edge gradients on A (PyG's `GATv2Conv`): with `ds` = ∂L/∂score per edge and head
/// (`nnz × heads` f32, after the softmax backward) and `z = xl[j] + xr[i] (+ ef[e])` per edge
/// `e = j → i`, writes `d_xr[i, h, :] = Σ_{e ∈ row i} ds[e, h] · att[h, :] ⊙ LeakyReLU'(z)`,
/// each edge's term into `d_ef` where given, and each row's `Σ_e ds[e, h] · LeakyReLU(z)` into
/// `d_att_rows` (`n_rows × heads × dim` f32: ∂L/∂att summed over rows by the caller, with no
/// atomics). Nothing per edge and feature is stored but `d_ef`.
pub(crate) fn gatv2_edge_grad<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    ops: &Gatv2Operands<'_, T>,
    ds: &DeviceVec<f32>,
    d_xr: &mut DeviceMatrix<T>,
    d_ef: Option<&mut DeviceMatrix<T>>,
    d_att_rows: &mut DeviceVec<f32>,
) -> Result<()> {
    let (heads, dim) = ops.check(gpu, a)?;
    check_per_edge("ds", a.nnz(), heads, ds.len())?;
    ops.xr.shape().expect_eq("d_xr", d_xr.shape())?;
    if let Some(d) = &d_ef {
        match ops.ef {
            Some(ef) => ef.shape().expect_eq("d_ef", d.shape())?,
            None => {
                return Err(Error::InvalidArgument {
                    what: "d_ef",
                    why: "given without edge features".into(),
                })
            }
        }
    }
    let want = a.n_rows() * heads * dim;
    expect_len("d_att_rows", want, d_att_rows.len())?;
    let d_ef = d_ef.map(|d| d.as_vec_mut());
    let sides = Gatv2Sides {
        m: a,
        edge_ids: None,
        x_self: ops.xr,
        x_other: ops.xl,
    };
    gatv2_grad_launch(gpu, &sides, ops, ds, false, d_xr, d_ef, Some(d_att_rows))
}

/// GATv2's edge gradients on Aᵀ: adds the scores' share of ∂L/∂xl,
/// `d_xl[j, h, :] += Σ_{e ∈ column j of A} ds[e, h] · att[h, :] ⊙ LeakyReLU'(z)`, to `d_xl`
/// (which holds the aggregation's share, `Pᵀ · dOut`), walking Aᵀ's rows (no atomics). The
/// entries' edges of A come from the transpose's inverse edge map (made once per transpose).
pub(crate) fn gatv2_edge_grad_transposed<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    t: &DeviceTranspose,
    ops: &Gatv2Operands<'_, T>,
    ds: &DeviceVec<f32>,
    d_xl: &mut DeviceMatrix<T>,
) -> Result<()> {
    let (heads, _) = ops.check(gpu, a)?;
    check_per_edge("ds", a.nnz(), heads, ds.len())?;
    ops.xl.shape().expect_eq("d_xl", d_xl.shape())?;
    let tc = t.csr();
    if tc.n_rows() != a.n_cols() || tc.n_cols() != a.n_rows() || tc.nnz() != a.nnz() {
        return Err(Error::InvalidArgument {
            what: "transpose",
            why: format!(
                "{} x {} with {} edges is not the transpose of A ({} x {}, {} edges)",
                tc.n_rows(),
                tc.n_cols(),
                tc.nnz(),
                a.n_rows(),
                a.n_cols(),
                a.nnz()
            ),
        });
    }
    check_same_gpu(gpu, "transpose", tc)?;
    let sides = Gatv2Sides {
        m: tc,
        edge_ids: Some(t.inverse_map(gpu)?),
        x_self: ops.xl,
        x_other: ops.xr,
    };
    gatv2_grad_launch(gpu, &sides, ops, ds, true, d_xl, None, None)
}

/// The CSR a GATv2 gradient pass walks: A (targets' rows) or Aᵀ (sources' rows, with each
/// entry's edge of A).
struct Gatv2Sides<'a, T: DType> {
    m: &'a DeviceCsr,
    edge_ids: Option<&'a DeviceVec<u32>>,
    x_self: &'a DeviceMatrix<T>,
    x_other: &'a DeviceMatrix<T>,
}

#[allow(clippy::too_many_arguments)]
fn gatv2_grad_launch<T: DType>(
    gpu: &Gpu,
    sides: &Gatv2Sides<'_, T>,
    ops: &Gatv2Operands<'_, T>,
    ds: &DeviceVec<f32>,
    accumulate: bool,
    out: &mut DeviceMatrix<T>,
    d_ef: Option<&mut DeviceVec<T>>,
    d_att_rows: Option<&mut DeviceVec<f32>>,
) -> Result<()> {
    let m = sides.m;
    let s = sides.x_self.shape();
    let (heads, dim) = (s.heads, s.head_dim);
    if m.n_rows() == 0 || heads == 0 || dim == 0 {
        return Ok(());
    }
    check_same_gpu(gpu, "ds", ds)?;
    check_same_gpu(gpu, "out", &*out)?;
    let vec = vector_width(dim, std::mem::size_of::<T>());
    // Lanes over the features (a power of two <= 32); a warp per (row, head).
    let g = group_for((dim / vec as usize) as u64, 1);
    let name = kernel_named(&BACKWARD, gatv2_grad_kernel(T::NAME, vec))?;
    let f = function(gpu, name)?;
    let n_rows = to_u32("rows", m.n_rows())?;
    let (heads_u, dim_u) = (to_u32("heads", heads)?, to_u32("head_dim", dim)?);
    let ids = opt_ptr(gpu, "edge ids", sides.edge_ids)?;
    let ef = opt_ptr(gpu, "edge features", ops.ef.map(DeviceMatrix::as_vec))?;
    let d_ef = opt_ptr(gpu, "d_ef", d_ef.map(|d| &*d))?;
    let d_att = opt_ptr(gpu, "d_att_rows", d_att_rows.map(|d| &*d))?;
    let acc = i32::from(accumulate);
    let cfg = group_grid(m.n_rows() * heads, 32, 1)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(m.row_offsets().slice())
        .arg(&n_rows)
        .arg(m.col_indices().slice())
        .arg(&ids)
        .arg(&heads_u)
        .arg(&dim_u)
        .arg(sides.x_self.slice())
        .arg(sides.x_other.slice())
        .arg(&ef)
        .arg(ops.att.slice())
        .arg(&ops.slope)
        .arg(ds.slice())
        .arg(&g)
        .arg(&acc)
        .arg(out.slice_mut())
        .arg(&d_ef)
        .arg(&d_att);
    // SAFETY: reads row_offsets[0..=n_rows] and col_indices of M's edges (a validated CSR of
    // n_rows x n_cols: x_self has n_rows rows and x_other n_cols, checked by the callers);
    // each entry's edge id (e, or the inverse edge map: a permutation of 0..nnz) indexes
    // ds (nnz·heads, checked), ef and d_ef (nnz rows, shapes checked); writes out's rows
    // < n_rows (shape of x_self, checked) and d_att_rows[0..n_rows·heads·dim) (length
    // checked). Vectors of `vec` elements stay inside a head (vec divides dim).
    unsafe { launch(name, &mut args, cfg) }
}
