//! The GAT layers' score terms on CUDA tensors: `out[i, h] = ⟨x[i, h, :], att[h, :]⟩` in f32
//! (per node, or per edge for edge features) and its gradients, by the layers' kernels
//! (`spattn::ops::elementwise`), ordered with the caller's stream. One read of `x` in its own
//! type, where the torch composition `(x.float() * att).sum(-1)` writes and reads `x` in f32
//! twice over, and twice again in its backward.

use pyo3::prelude::*;
use spattn::ops::elementwise;
use spattn::ops::{ExternalMatrix, ExternalVec};
use spattn::{DType, DTypeKind, Shape};

use crate::device;
use crate::errors::to_py;
use crate::host::DTypeName;

/// The shapes of a call with `k` attention vectors: `x` (`rows × heads × dim`) and its scores
/// (`k · rows × heads × 1`: vector `t`'s in rows `t · rows ..`).
fn shapes(rows: usize, heads: usize, dim: usize, k: usize) -> spattn::Result<(Shape, Shape)> {
    if !(1..=elementwise::HEAD_MAX_ATT).contains(&k) {
        return Err(spattn::ops::Error::InvalidArgument {
            what: "n_att",
            why: format!("{k}: expected 1 to {} vectors", elementwise::HEAD_MAX_ATT),
        }
        .into());
    }
    Ok((
        Shape::new(rows, heads, dim)?,
        Shape::new(k * rows, heads, 1)?,
    ))
}

/// `out[t] = ⟨x[i, h, :], att[t, h, :]⟩` for CUDA tensors on `device`: `x` (`rows × heads ×
/// dim` of `dtype`), `att` (`n_att × heads × dim` f32), `out` (`n_att × rows × heads` f32),
/// ordered with `stream`; every vector's scores from one read of `x`.
#[pyfunction]
#[pyo3(signature = (device, dtype, rows, heads, dim, x, att, out, stream, n_att = 1))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_dot(
    py: Python<'_>,
    device: i64,
    dtype: &str,
    rows: usize,
    heads: usize,
    dim: usize,
    x: u64,
    att: u64,
    out: u64,
    stream: u64,
    n_att: usize,
) -> PyResult<()> {
    on_device(py, device, dtype, |d, kind| {
        let s = shapes(rows, heads, dim, n_att)?;
        by_dtype!(kind, head_dot_gpu(d, s, n_att, [x, att, out], stream))
    })
}

/// The gradients of [`head_dot`] given `d_out` (`n_att × rows × heads` f32): adds `Σ_t d_out[t]
/// ⊗ att[t]` into `dx` (like `x`) and `Σ_i d_out[t, i, h] · x[i, h, :]` into `d_att[t]`
/// (`n_att × heads × dim` f32; summed in a fixed order: the same bits every run). The caller
/// zeroes both first.
#[pyfunction]
#[pyo3(signature = (device, dtype, rows, heads, dim, x, att, d_out, dx, d_att, stream, n_att = 1))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn head_dot_backward(
    py: Python<'_>,
    device: i64,
    dtype: &str,
    rows: usize,
    heads: usize,
    dim: usize,
    x: u64,
    att: u64,
    d_out: u64,
    dx: u64,
    d_att: u64,
    stream: u64,
    n_att: usize,
) -> PyResult<()> {
    on_device(py, device, dtype, |d, kind| {
        let s = shapes(rows, heads, dim, n_att)?;
        let ptrs = [x, att, d_out, dx, d_att];
        by_dtype!(kind, head_dot_backward_gpu(d, s, n_att, ptrs, stream))
    })
}

/// Runs `f` with CUDA device `device`'s handle and `dtype`'s kernel type, without the GIL, the
/// thread's CUDA context restored afterwards.
fn on_device(
    py: Python<'_>,
    device: i64,
    dtype: &str,
    f: impl FnOnce(&device::Device, DTypeKind) -> spattn::Result<()> + Send,
) -> PyResult<()> {
    let kind = DTypeName::parse(dtype)?.device()?;
    let ordinal = device::ordinal(device)?;
    py.detach(|| -> spattn::Result<()> {
        let _restore = device::ContextGuard::save();
        f(&*device::device(ordinal)?, kind)
    })
    .map_err(to_py)
}

fn head_dot_gpu<T: DType>(
    d: &device::Device,
    (sx, se): (Shape, Shape),
    k: usize,
    [x, att, out]: [u64; 3],
    stream: u64,
) -> spattn::Result<()> {
    let gpu = &d.gpu;
    // SAFETY: the package passes `data_ptr()`s of contiguous CUDA tensors on this device, kept
    // referenced for the call, with exactly these element counts and types (checked on every
    // call by spattn.functional's head_dot_forward, which every path goes through): x (sx of
    // T), att (k·heads·dim f32), out (se f32: k·rows·heads, fresh). The kernel reads x
    // and att and writes out within those lengths (elementwise checks them against the
    // views). PyTorch recycles the memory only in `stream`'s order, which `run` makes wait
    // for the launch; the views are dropped at the end of this function.
    unsafe {
        let x = ExternalMatrix::<T>::new_trusted(gpu, "x", x, sx)?;
        let att = ExternalVec::<f32>::new_trusted(gpu, "att", att, k * sx.row_len())?;
        let mut out = ExternalMatrix::<f32>::new_trusted(gpu, "out", out, se)?;
        d.bridge.run(stream, || {
            elementwise::head_dot_f32(gpu, &x, &att, &mut out)?;
            Ok(())
        })
    }
}

fn head_dot_backward_gpu<T: DType>(
    d: &device::Device,
    (sx, se): (Shape, Shape),
    k: usize,
    [x, att, d_out, dx, d_att]: [u64; 5],
    stream: u64,
) -> spattn::Result<()> {
    let gpu = &d.gpu;
    let len = sx.row_len();
    // SAFETY: as in `head_dot_gpu` (checked by head_dot_backward), for x and dx (sx of T; dx
    // fresh), att and d_att (k·heads·dim f32; d_att fresh) and d_out (se f32: k·rows·heads).
    // The kernels read x, att and d_out and read-modify-write dx and d_att within those
    // lengths (checked against the views).
    unsafe {
        let x = ExternalMatrix::<T>::new_trusted(gpu, "x", x, sx)?;
        let att = ExternalVec::<f32>::new_trusted(gpu, "att", att, k * len)?;
        let all = ExternalMatrix::<f32>::new_trusted(gpu, "d_out", d_out, se)?;
        let mut dx = ExternalMatrix::<T>::new_trusted(gpu, "dx", dx, sx)?;
        let mut d_att = ExternalVec::<f32>::new_trusted(gpu, "d_att", d_att, k * len)?;
        d.bridge.run(stream, || {
            elementwise::head_outer_add_f32(gpu, &all, &att, &mut dx)?;
            elementwise::head_weighted_sum(gpu, &x, &all, &mut d_att)?;
            Ok(())
        })
    }
}

/// The GAT kernels `"auto"` stands for on CUDA (`GatKernels::auto`, the Rust layer's rule too):
/// `"rows"`, `"fused"` (a backward only) or `"composed"`, for `heads × dim` of `dtype` on a graph
/// of `nnz` edges; a backward takes the rows kernels only where `rows` (the rows forward's
/// output is at hand).
#[pyfunction]
pub(crate) fn gat_auto_kernels(
    dtype: &str,
    heads: usize,
    dim: usize,
    nnz: usize,
    backward: bool,
    rows: bool,
) -> PyResult<&'static str> {
    use spattn::ops::backward::GatKernels;
    let kind = DTypeName::parse(dtype)?.device()?;
    Ok(
        match by_dtype!(kind, GatKernels::auto(heads, dim, nnz, backward, rows)) {
            GatKernels::Rows => "rows",
            GatKernels::Fused => "fused",
            GatKernels::Composed => "composed",
        },
    )
}

/// Whether GAT's `kernels` (`"fused"`: the fused backward; `"rows"`: the row-statistics
/// forward and backward) take heads of `dim` features of `dtype` on CUDA (the composed steps
/// take every head).
#[pyfunction]
pub(crate) fn gat_supports(kernels: &str, dtype: &str, dim: usize) -> PyResult<bool> {
    use spattn::ops::backward::GatKernels;
    let kind = DTypeName::parse(dtype)?.device()?;
    let Some(set) = crate::cuda::parse_gat_kernels(kernels, false) else {
        return Err(crate::errors::value_error(
            "kernels",
            format!("{kernels:?} is not \"fused\", \"rows\" or \"composed\""),
        ));
    };
    Ok(by_dtype!(kind, GatKernels::supports(set, dim)))
}
