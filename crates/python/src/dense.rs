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

/// The shapes of a call: `x` (`rows × heads × dim`) and its scores (`rows × heads × 1`).
fn shapes(rows: usize, heads: usize, dim: usize) -> spattn::Result<(Shape, Shape)> {
    Ok((Shape::new(rows, heads, dim)?, Shape::new(rows, heads, 1)?))
}

/// `out = ⟨x[i, h, :], att[h, :]⟩` for CUDA tensors on `device`: `x` (`rows × heads × dim`
/// of `dtype`), `att` (`heads × dim` f32), `out` (`rows × heads` f32), ordered with `stream`.
#[pyfunction]
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
) -> PyResult<()> {
    on_device(py, device, dtype, |d, kind| {
        let s = shapes(rows, heads, dim)?;
        by_dtype!(kind, head_dot_gpu(d, s, [x, att, out], stream))
    })
}

/// The gradients of [`head_dot`] given `d_out` (`rows × heads` f32): adds `d_out ⊗ att` into
/// `dx` (like `x`) and `Σ_i d_out[i, h] · x[i, h, :]` into `d_att` (`heads × dim` f32; summed
/// in a fixed order: the same bits every run). The caller zeroes both first.
#[pyfunction]
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
) -> PyResult<()> {
    on_device(py, device, dtype, |d, kind| {
        let s = shapes(rows, heads, dim)?;
        let ptrs = [x, att, d_out, dx, d_att];
        by_dtype!(kind, head_dot_backward_gpu(d, s, ptrs, stream))
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
    [x, att, out]: [u64; 3],
    stream: u64,
) -> spattn::Result<()> {
    let gpu = &d.gpu;
    // SAFETY: the package passes `data_ptr()`s of contiguous CUDA tensors on this device, kept
    // referenced for the call, with exactly these element counts and types (checked on every
    // call by spattn.functional's head_dot_forward, which every path goes through): x (sx of
    // T), att (heads·dim f32), out (se f32, fresh). The kernel reads x
    // and att and writes out within those lengths (elementwise checks them against the
    // views). PyTorch recycles the memory only in `stream`'s order, which `run` makes wait
    // for the launch; the views are dropped at the end of this function.
    unsafe {
        let x = ExternalMatrix::<T>::new_trusted(gpu, "x", x, sx)?;
        let att = ExternalVec::<f32>::new_trusted(gpu, "att", att, sx.row_len())?;
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
    [x, att, d_out, dx, d_att]: [u64; 5],
    stream: u64,
) -> spattn::Result<()> {
    let gpu = &d.gpu;
    // SAFETY: as in `head_dot_gpu` (checked by head_dot_backward), for x and dx (sx of T; dx
    // fresh), att and d_att (heads·dim f32; d_att fresh) and d_out (se f32). The kernels read x, att and d_out and
    // read-modify-write dx and d_att within those lengths (checked against the views).
    unsafe {
        let x = ExternalMatrix::<T>::new_trusted(gpu, "x", x, sx)?;
        let att = ExternalVec::<f32>::new_trusted(gpu, "att", att, sx.row_len())?;
        let d_out = ExternalMatrix::<f32>::new_trusted(gpu, "d_out", d_out, se)?;
        let mut dx = ExternalMatrix::<T>::new_trusted(gpu, "dx", dx, sx)?;
        let mut d_att = ExternalVec::<f32>::new_trusted(gpu, "d_att", d_att, sx.row_len())?;
        d.bridge.run(stream, || {
            elementwise::head_outer_add_f32(gpu, &d_out, &att, &mut dx)?;
            elementwise::head_weighted_sum(gpu, &x, &d_out, &mut d_att)?;
            Ok(())
        })
    }
}

/// Whether GAT's `kernels` (`"fused"`: the fused backward; `"rows"`: the row-statistics
/// forward and backward) take heads of `dim` features of `dtype` on CUDA (the composed steps
/// take every head).
#[pyfunction]
pub(crate) fn gat_supports(kernels: &str, dtype: &str, dim: usize) -> PyResult<bool> {
    use spattn::ops::backward::{gat_rows_supports, FusedBackward};
    let kind = DTypeName::parse(dtype)?.device()?;
    Ok(match kernels {
        "fused" => by_dtype!(kind, FusedBackward::supports(dim)),
        "rows" => by_dtype!(kind, gat_rows_supports(dim)),
        "composed" => true,
        other => {
            return Err(crate::errors::value_error(
                "kernels",
                format!("{other:?} is not \"fused\", \"rows\" or \"composed\""),
            ))
        }
    })
}
