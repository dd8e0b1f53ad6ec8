//! `spattn._native`: the compiled half of the `spattn` Python package.
//!
//! The Python package (`python/spattn/`) is what users import: it validates every tensor
//! (device, dtype, shape, contiguity), allocates outputs and workspaces with PyTorch (or
//! numpy), wraps the calls in `torch.autograd.Function`s and builds the PyG-style layers. This
//! module does the rest, over raw data pointers the package has validated:
//!
//! - `graph::GraphCore`: one graph (a [`spattn::Csr`], square or not) with its plan-once state:
//!   per CUDA device a shared [`spattn::DeviceGraph`] and the attention plans built over it,
//!   cached per (heads, head_dim, dtype, algorithm, scale); on the CPU the transpose the GAT
//!   backward needs.
//! - Attention forward and exact backward ([`spattn::AttentionPlan`]) and the GAT attention
//!   (`LeakyReLU(a_dst[i] + a_src[j])` scores, softmax, aggregation) forward and exact backward
//!   (the CSR ops of `spattn::ops`), on CUDA tensors in place (zero-copy views,
//!   [`spattn::ops::ExternalMatrix`]) ordered with the caller's CUDA stream by events
//!   ([`spattn::ops::StreamBridge`]), or on CPU memory with the f32 / f64 reference
//!   ops. The CUDA bodies of the calls are in `cuda`.
//! - GAT's score terms `⟨x[i, h, :], att[h, :]⟩` in f32 and their gradients on CUDA tensors
//!   (`dense`).
//!
//! Errors become Python exceptions naming the operand (`errors`).

/// Calls the generic `f::<T>(args)` for the device dtype `dtype` (f32, f16 or bf16).
macro_rules! by_dtype {
    ($dtype:expr, $($f:ident)::+($($arg:expr),*)) => {
        match $dtype {
            ::spattn::DTypeKind::F32 => $($f)::+::<f32>($($arg),*),
            ::spattn::DTypeKind::F16 => $($f)::+::<::spattn::f16>($($arg),*),
            ::spattn::DTypeKind::Bf16 => $($f)::+::<::spattn::bf16>($($arg),*),
        }
    };
}

mod cpu;
mod cuda;
mod dense;
mod device;
mod errors;
mod extras;
mod graph;
mod host;

use pyo3::prelude::*;

/// The Python module `spattn._native`.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("SpattnError", m.py().get_type::<errors::SpattnError>())?;
    m.add_class::<graph::GraphCore>()?;
    m.add_function(wrap_pyfunction!(device::cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(device::device_info, m)?)?;
    m.add_function(wrap_pyfunction!(device::memory_pool_stats, m)?)?;
    m.add_function(wrap_pyfunction!(device::reset_memory_pool_peak, m)?)?;
    m.add_function(wrap_pyfunction!(device::empty_memory_pool, m)?)?;
    m.add_function(wrap_pyfunction!(dense::head_dot, m)?)?;
    m.add_function(wrap_pyfunction!(dense::head_dot_backward, m)?)?;
    m.add_function(wrap_pyfunction!(dense::gat_supports, m)?)?;
    m.add_function(wrap_pyfunction!(dense::gat_auto_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(graph::edges::edge_rows, m)?)?;
    m.add(
        "GAT_FUSED_MAX_EDGES",
        spattn::ops::backward::GatKernels::FUSED_MAX_EDGES,
    )?;
    m.add(
        "GAT_ROWS_MIN_HEADS",
        spattn::ops::backward::GatKernels::ROWS_MIN_HEADS,
    )?;
    m.add(
        "GAT_ROWS_SMALL_MAX_EDGES",
        spattn::ops::backward::GatKernels::ROWS_SMALL_MAX_EDGES,
    )?;
    Ok(())
}
