//! A layer's edge attributes moved to the graph's CSR order on CUDA, with the added self loops'
//! rows filled (PyG's `add_self_loops(fill_value=…)`): two launches in place of the package's
//! torch composition of scatters, reductions and gathers.

use pyo3::prelude::*;
use spattn::ops::edge_extras::{self, LoopFill};
use spattn::ops::ExternalVec;
use spattn::{DType, DTypeKind};

use super::GraphCore;
use crate::device;
use crate::errors::{to_py, value_error};
use crate::host::DTypeName;

/// Writes `edge_attr`'s rows (`rows × width` of `dtype`, at `x`) into `out` (`nnz × width` of
/// `out_dtype`: f32, or `dtype`) in the graph's CSR order, on CUDA device `device`, ordered with
/// `stream`: input row `e` at edge `positions[e]` (`rows` int64; a position outside the graph's
/// edges is skipped), then with `loops` (non-zero: `n_rows` int64 positions of each row's self
/// loop) every loop's row filled by `fill`: `"mean"` or `"sum"` of the row's other edges' rows,
/// or `"value"` (`value`, already rounded to `dtype`, in every feature). The package passes the
/// graph build's own positions of the same `edge_index`, so every edge gets a row.
#[pyfunction]
#[pyo3(signature = (graph, device, dtype, out_dtype, width, x, rows, positions, loops, fill,
                    value, out, stream))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn edge_rows(
    py: Python<'_>,
    graph: PyRef<'_, GraphCore>,
    device: i64,
    dtype: &str,
    out_dtype: &str,
    width: usize,
    x: u64,
    rows: usize,
    positions: u64,
    loops: u64,
    fill: &str,
    value: f64,
    out: u64,
    stream: u64,
) -> PyResult<()> {
    let kind = DTypeName::parse(dtype)?.device()?;
    let out_kind = DTypeName::parse(out_dtype)?.device()?;
    if out_kind != DTypeKind::F32 && out_kind != kind {
        return Err(value_error(
            "out_dtype",
            format!("{out_dtype:?}: expected \"f32\" or {dtype:?}"),
        ));
    }
    // `value` comes rounded to the attributes' type (exact in f32).
    let fill = match fill {
        "mean" => LoopFill::Mean,
        "sum" => LoopFill::Sum,
        "value" => LoopFill::Value(value as f32),
        other => {
            return Err(value_error(
                "fill",
                format!("{other:?} is not \"mean\", \"sum\" or \"value\""),
            ))
        }
    };
    let fill = (loops != 0).then_some(fill);
    let ordinal = device::ordinal(device)?;
    let g: &GraphCore = &graph;
    py.detach(|| -> spattn::Result<()> {
        let _restore = device::ContextGuard::save();
        let d = g.on_device(ordinal)?;
        let (nnz, n_rows) = (g.nnz, g.n_rows);
        let gpu = &d.device.gpu;
        // SAFETY: the package passes `data_ptr()`s of contiguous CUDA tensors on this device,
        // referenced for the call: x (rows·width of dtype), positions (rows int64), loops
        // (n_rows int64, where non-zero; a view into the build's positions, so only
        // element-aligned) and out (nnz·width of out_dtype, fresh). `edge_rows` checks these
        // lengths against the graph and reads and writes within them; PyTorch recycles the
        // memory only in `stream`'s order, which `run` makes wait for the launches. The views
        // are dropped at the end of this block.
        unsafe {
            let pos =
                ExternalVec::<i64>::new_trusted_element_aligned(gpu, "positions", positions, rows)?;
            let at = match fill {
                Some(_) => Some(ExternalVec::<i64>::new_trusted_element_aligned(
                    gpu, "loops", loops, n_rows,
                )?),
                None => None,
            };
            let loops = at.as_deref().zip(fill);
            d.device.bridge.run(stream, || {
                let a = d.graph.csr()?;
                let as_f32 = out_kind == DTypeKind::F32;
                by_dtype!(
                    kind,
                    place_as(gpu, a, (x, rows, width), &pos, loops, (out, nnz, as_f32))
                )
            })
        }
    })
    .map_err(to_py)
}

/// The rows at `x` of `T` placed as f32 (`as_f32`) or as `T`.
///
/// # Safety
/// As [`place`], `out` holding elements of the type placed.
unsafe fn place_as<T: DType>(
    gpu: &spattn::Gpu,
    a: &spattn::ops::DeviceCsr,
    x: (u64, usize, usize),
    pos: &ExternalVec<i64>,
    loops: Option<(&spattn::DeviceVec<i64>, LoopFill)>,
    (out, nnz, as_f32): (u64, usize, bool),
) -> spattn::Result<()> {
    // SAFETY: the caller's contract.
    unsafe {
        match as_f32 {
            true => place::<T, f32>(gpu, a, x, pos, loops, (out, nnz)),
            false => place::<T, T>(gpu, a, x, pos, loops, (out, nnz)),
        }
    }
}

/// [`edge_extras::edge_rows`] on the rows at `x` (`rows × width` of `T`) into `out` (`nnz ×
/// width` of `O`).
///
/// # Safety
/// As in [`edge_rows`]: `x` and `out` address contiguous CUDA tensors of `gpu`'s device with
/// those many elements, alive for the call and ordered by the bridge's stream.
unsafe fn place<T: DType, O: DType>(
    gpu: &spattn::Gpu,
    a: &spattn::ops::DeviceCsr,
    (x, rows, width): (u64, usize, usize),
    pos: &ExternalVec<i64>,
    loops: Option<(&spattn::DeviceVec<i64>, LoopFill)>,
    (out, nnz): (u64, usize),
) -> spattn::Result<()> {
    let (len, out_len) = (rows.saturating_mul(width), nnz.saturating_mul(width));
    // SAFETY: the caller's contract: these lengths are the tensors' (the package checks
    // edge_attr's rows against the edge_index; `edge_rows` checks rows · width against the
    // positions and nnz · width against the graph before any launch).
    let (x, mut o) = unsafe {
        (
            ExternalVec::<T>::new_trusted_element_aligned(gpu, "edge_attr", x, len)?,
            ExternalVec::<O>::new_trusted_element_aligned(gpu, "out", out, out_len)?,
        )
    };
    edge_extras::edge_rows(gpu, a, (&x, width), pos, loops, &mut o)?;
    Ok(())
}
