//! Per-edge kernels of attention's extras (`cuda/edge_extras.cu`): a score bias added per edge,
//! dropout on per-edge values, the gradient of a shared bias, casts of f32 per-edge values to
//! the features' type, and the edge features' gradient. The unfused attention with extras and
//! its backward are compositions of these with the CSR ops (`spattn::AttentionPlan`).
//!
//! Per-edge values are `nnz × heads` f32 in the CSR's edge order (see [`crate::csr_ops`]);
//! a bias is `nnz × heads` or, shared by the heads, `nnz`, in the features' type.

use spattn_kernels_sys::EDGE_EXTRAS;

use crate::buffer::{expect_len, DeviceMatrix, DeviceVec};
use crate::device_csr::DeviceCsr;
use crate::dropout::{Dropout, DropoutWords};
use crate::dtype::{DType, DTypeKind};
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{
    check_per_edge, check_same_gpu, kernel_named, launch, stride_grid, to_u32, warp_grid,
    PushKernelArg,
};
use crate::shape::Shape;

/// A per-edge score bias on the device, in the CSR order of its graph.
#[derive(Clone, Copy, Debug)]
pub enum DeviceBias<'a, T: DType> {
    /// `nnz × heads`: edge `e`, head `h` at `e · heads + h`.
    PerHead(&'a DeviceVec<T>),
    /// `nnz`: one value per edge for every head.
    Shared(&'a DeviceVec<T>),
}

impl<'a, T: DType> DeviceBias<'a, T> {
    /// The values.
    pub fn values(&self) -> &'a DeviceVec<T> {
        match self {
            DeviceBias::PerHead(b) | DeviceBias::Shared(b) => b,
        }
    }
    /// Whether one value serves every head.
    pub fn is_shared(&self) -> bool {
        matches!(self, DeviceBias::Shared(_))
    }
    /// Checks the length against `nnz` edges of `heads` heads, naming the layout expected.
    pub fn check_len(&self, nnz: usize, heads: usize) -> Result<()> {
        let (what, per_edge) = match self {
            DeviceBias::PerHead(_) => ("bias (nnz × heads)", heads),
            DeviceBias::Shared(_) => ("bias (nnz)", 1),
        };
        check_per_edge(what, nnz, per_edge, self.values().len())
    }
}

/// The dropout kernel (one for every feature type: it scales f32 per-edge values).
pub(crate) const DROPOUT_KERNEL: &str = "edge_dropout";
/// The kernel adding two f32 per-edge arrays.
pub(crate) const ADD_KERNEL: &str = "edge_add";

/// The score-bias kernel for a bias of `dtype` (a [`DType::NAME`]); the launch-name test forms
/// it too.
pub(crate) fn bias_add_kernel(dtype: &str) -> String {
    format!("edge_bias_add_{dtype}")
}

/// The bias-gradient kernel (a sum over heads) writing `dtype`.
pub(crate) fn head_sum_kernel(dtype: &str) -> String {
    format!("edge_head_sum_{dtype}")
}

/// The kernel writing a bias's gradient of `dtype` from the fused backward's pairs.
pub(crate) fn pair_bias_grad_kernel(dtype: &str) -> String {
    format!("edge_pair_bias_grad_{dtype}")
}

/// The kernel casting f32 per-edge values to `dtype`.
pub(crate) fn cast_kernel(dtype: &str) -> String {
    format!("edge_cast_{dtype}")
}

/// The kernel widening `dtype` values to f32.
pub(crate) fn widen_kernel(dtype: &str) -> String {
    format!("edge_widen_{dtype}")
}

/// The edge-features-gradient kernel for features of `dtype`.
pub(crate) fn row_combine_kernel(dtype: &str) -> String {
    format!("edge_row_combine_{dtype}")
}

/// The kernel placing attribute rows of `dtype` in CSR order as `out` (`f32`, or `dtype`).
pub(crate) fn rows_place_kernel(dtype: &str, out: &str) -> String {
    format!("edge_rows_place_{dtype}_{out}")
}

/// The kernel filling the self loops' attribute rows of `dtype` written as `out`.
pub(crate) fn rows_fill_kernel(dtype: &str, out: &str) -> String {
    format!("edge_rows_fill_{dtype}_{out}")
}

fn function(gpu: &Gpu, name: String) -> Result<(&'static str, cudarc::driver::CudaFunction)> {
    let name = kernel_named(&EDGE_EXTRAS, name)?;
    Ok((
        name,
        gpu.load_function(EDGE_EXTRAS.name, EDGE_EXTRAS.ptx, name)?,
    ))
}

/// `scores[e·heads + h] += bias` (the bias's value of edge `e`, head `h`).
///
/// # Errors
/// A bias or scores length that is not `nnz × heads` (or `nnz` for a shared bias); buffers of
/// another GPU.
pub fn bias_add<T: DType>(
    gpu: &Gpu,
    scores: &mut DeviceVec<f32>,
    bias: DeviceBias<'_, T>,
    nnz: usize,
    heads: usize,
) -> Result<()> {
    check_per_edge("scores", nnz, heads, scores.len())?;
    bias.check_len(nnz, heads)?;
    check_same_gpu(gpu, "scores", &*scores)?;
    check_same_gpu(gpu, "bias", bias.values())?;
    let (name, f) = function(gpu, bias_add_kernel(T::NAME))?;
    let (n, h, shared) = (
        nnz as u64,
        to_u32("heads", heads)?,
        u32::from(bias.is_shared()),
    );
    let cfg = stride_grid(scores.len())?;
    let mut args = gpu.launch_builder(&f);
    args.arg(scores.slice_mut())
        .arg(bias.values().slice())
        .arg(&n)
        .arg(&h)
        .arg(&shared);
    // SAFETY: reads and writes scores[0..nnz·heads), reads bias[0..nnz) (shared) or
    // [0..nnz·heads); both lengths checked above.
    unsafe { launch(name, &mut args, cfg) }
}

/// `values[i] *= ` the dropout factor of element `i` (0, or `1 / (1 − rate)`): elements are
/// `edge · heads + head` in the caller's CSR order, so the mask is `dropout`'s everywhere.
///
/// # Errors
/// A buffer of another GPU.
pub fn apply_dropout(gpu: &Gpu, values: &mut DeviceVec<f32>, dropout: &Dropout) -> Result<()> {
    check_same_gpu(gpu, "edge values", &*values)?;
    if dropout.threshold() == 0 {
        return Ok(());
    }
    let (name, f) = function(gpu, DROPOUT_KERNEL.into())?;
    let n = values.len() as u64;
    let words = DropoutWords::of(Some(dropout));
    // A thread per four elements: they share one Philox draw.
    let cfg = stride_grid(values.len().div_ceil(4))?;
    let mut args = gpu.launch_builder(&f);
    args.arg(values.slice_mut()).arg(&n);
    words.push(&mut args);
    // SAFETY: reads and writes values[0..n), n its length.
    unsafe { launch(name, &mut args, cfg) }
}

/// `y[i] += x[i]` on per-edge values.
///
/// # Errors
/// Lengths that differ; buffers of another GPU.
pub fn add(gpu: &Gpu, x: &DeviceVec<f32>, y: &mut DeviceVec<f32>) -> Result<()> {
    if x.len() != y.len() {
        return Err(Error::LengthMismatch {
            what: "edge values",
            expected: x.len(),
            actual: y.len(),
        });
    }
    check_same_gpu(gpu, "x", x)?;
    check_same_gpu(gpu, "y", &*y)?;
    let (name, f) = function(gpu, ADD_KERNEL.into())?;
    let n = x.len() as u64;
    let mut args = gpu.launch_builder(&f);
    args.arg(x.slice()).arg(&n).arg(y.slice_mut());
    // SAFETY: reads x[0..n), reads and writes y[0..n); both n long (checked).
    unsafe { launch(name, &mut args, stride_grid(x.len())?) }
}

/// The gradient of `bias` from the per-edge score gradient `ds` (`nnz × heads` f32): `ds`
/// itself (per head) or its sum over the heads (shared), rounded to `T`, into `out`.
///
/// # Errors
/// Lengths that do not fit `nnz` and `heads`; buffers of another GPU.
pub fn bias_grad<T: DType>(
    gpu: &Gpu,
    ds: &DeviceVec<f32>,
    nnz: usize,
    heads: usize,
    shared: bool,
    out: &mut DeviceVec<T>,
) -> Result<()> {
    check_per_edge("dS", nnz, heads, ds.len())?;
    check_bias_grad_len(nnz, heads, shared, out.len())?;
    check_same_gpu(gpu, "dS", ds)?;
    check_same_gpu(gpu, "d_bias", &*out)?;
    if shared {
        let (name, f) = function(gpu, head_sum_kernel(T::NAME))?;
        let (n, h) = (nnz as u64, to_u32("heads", heads)?);
        let mut args = gpu.launch_builder(&f);
        args.arg(ds.slice()).arg(&n).arg(&h).arg(out.slice_mut());
        // SAFETY: reads ds[0..nnz·heads), writes out[0..nnz); lengths checked above.
        unsafe { launch(name, &mut args, stride_grid(nnz)?) }
    } else {
        cast(gpu, ds, out)
    }
}

/// Checks the length of a bias's gradient: `nnz` where `shared` by the heads, else
/// `nnz × heads`, naming the layout expected.
pub(crate) fn check_bias_grad_len(
    nnz: usize,
    heads: usize,
    shared: bool,
    len: usize,
) -> Result<()> {
    if shared {
        check_per_edge("d_bias (nnz)", nnz, 1, len)
    } else {
        check_per_edge("d_bias (nnz × heads)", nnz, heads, len)
    }
}

/// The gradient of `bias` from the fused backward's row pass: for each entry `x` of Aᵀ, A's
/// edge `t_to_a[x]` of row `rows[x]` (`rows`: Aᵀ's column indices) gets `dS = P (dP − D)` per
/// head from its `(s, dP)` pair (`pairs`: at least `nnz × heads` pairs of f32, A's order) and
/// its row's `(lse, D)` (`stats`: `n_rows × heads` pairs, every `rows[x] < n_rows`: Aᵀ's
/// entries are rows of A), rounded to `T` into `out` per head, or summed over the heads in head
/// order (`shared`).
///
/// # Errors
/// Lengths that do not fit `nnz` and `heads`; buffers of another GPU.
pub(crate) fn bias_grad_from_pairs<T: DType>(
    gpu: &Gpu,
    (rows, t_to_a): (&DeviceVec<u32>, &DeviceVec<u32>),
    (pairs, stats, n_rows): (&DeviceVec<f32>, &DeviceVec<f32>, usize),
    heads: usize,
    shared: bool,
    out: &mut DeviceVec<T>,
) -> Result<()> {
    let nnz = rows.len();
    expect_len("A's edge of each Aᵀ entry", nnz, t_to_a.len())?;
    check_bias_grad_len(nnz, heads, shared, out.len())?;
    let need = nnz.checked_mul(heads).and_then(|n| n.checked_mul(2));
    if need.is_none_or(|n| pairs.len() < n) {
        return Err(Error::LengthMismatch {
            what: "edge score pairs",
            expected: need.unwrap_or(usize::MAX),
            actual: pairs.len(),
        });
    }
    check_per_edge(
        "row statistics (n_rows × heads pairs)",
        n_rows,
        heads * 2,
        stats.len(),
    )?;
    check_same_gpu(gpu, "Aᵀ's rows", rows)?;
    check_same_gpu(gpu, "A's edge of each Aᵀ entry", t_to_a)?;
    check_same_gpu(gpu, "edge score pairs", pairs)?;
    check_same_gpu(gpu, "row statistics", stats)?;
    check_same_gpu(gpu, "d_bias", &*out)?;
    let (name, f) = function(gpu, pair_bias_grad_kernel(T::NAME))?;
    let (n, h, s) = (nnz as u64, to_u32("heads", heads)?, u32::from(shared));
    let mut args = gpu.launch_builder(&f);
    args.arg(rows.slice())
        .arg(t_to_a.slice())
        .arg(pairs.slice())
        .arg(stats.slice())
        .arg(&n)
        .arg(&h)
        .arg(&s)
        .arg(out.slice_mut());
    // SAFETY: reads rows[0..nnz) and t_to_a[0..nnz) (lengths checked), pairs at t_to_a[x]·heads
    // + h < nnz·heads (t_to_a a permutation of 0..nnz, the fused backward's inverse edge map;
    // pairs hold at least nnz·heads, checked), stats at rows[x]·heads + h (rows[x] < n_rows, a
    // row of A; n_rows·heads pairs, checked); writes out at t_to_a[x] (shared) or
    // t_to_a[x]·heads + h, within its length (checked).
    unsafe { launch(name, &mut args, stride_grid(nnz)?) }
}

/// `out[i] = x[i]` in f32 (exact): a layer's per-head vectors of `T` for the kernels that read
/// f32 ones.
///
/// # Errors
/// Lengths that differ; buffers of another GPU.
pub fn widen<T: DType>(gpu: &Gpu, x: &DeviceVec<T>, out: &mut DeviceVec<f32>) -> Result<()> {
    convert(
        gpu,
        widen_kernel(T::NAME),
        ("widen input", "widened output"),
        x,
        out,
    )
}

/// `out[i] = x[i]` rounded to `T`.
///
/// # Errors
/// Lengths that differ; buffers of another GPU.
pub fn cast<T: DType>(gpu: &Gpu, x: &DeviceVec<f32>, out: &mut DeviceVec<T>) -> Result<()> {
    convert(
        gpu,
        cast_kernel(T::NAME),
        ("cast input", "cast output"),
        x,
        out,
    )
}

/// An elementwise conversion kernel `kernel(x, n, out)` over equal lengths.
fn convert<A: DType, B: DType>(
    gpu: &Gpu,
    kernel: String,
    (what_x, what_out): (&'static str, &'static str),
    x: &DeviceVec<A>,
    out: &mut DeviceVec<B>,
) -> Result<()> {
    if x.len() != out.len() {
        return Err(Error::LengthMismatch {
            what: what_out,
            expected: x.len(),
            actual: out.len(),
        });
    }
    check_same_gpu(gpu, what_x, x)?;
    check_same_gpu(gpu, what_out, &*out)?;
    if x.is_empty() {
        return Ok(());
    }
    let (name, f) = function(gpu, kernel)?;
    let n = x.len() as u64;
    let mut args = gpu.launch_builder(&f);
    args.arg(x.slice()).arg(&n).arg(out.slice_mut());
    // SAFETY: reads x[0..n), writes out[0..n); equal lengths (checked above).
    unsafe { launch(name, &mut args, stride_grid(x.len())?) }
}

/// Edges per warp of `edge_row_combine_*` (`SPATTN_COMBINE_EDGES` in `edge_extras.cu`).
const COMBINE_EDGES: usize = 32;

/// The edge features' gradient on `csr`'s edges: per edge `e = (i, j)`, head `h`, feature `d`,
/// `out[e, h, d] = a[e, h] · x[i, h, d] + b[e, h] · y[i, h, d]` (with `a = scale · dS`,
/// `x = Q`, `b` the attention weights, `y = dOut`: `dF = scale · dS · q_i + w · dOut_i`).
///
/// # Errors
/// Shapes that do not fit the graph (`x`, `y`: `n_rows × heads × dim`; `out`:
/// `nnz × heads × dim`), per-edge lengths, buffers of another GPU.
pub fn edge_features_grad<T: DType>(
    gpu: &Gpu,
    csr: &DeviceCsr,
    (a, x): (&DeviceVec<f32>, &DeviceMatrix<T>),
    (b, y): (&DeviceVec<f32>, &DeviceMatrix<T>),
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    let s = x.shape();
    s.expect_rows_like("x", s, csr.n_rows())?;
    s.expect_eq("y", y.shape())?;
    Shape::new(csr.nnz(), s.heads, s.head_dim)?.expect_eq("d_edge_features", out.shape())?;
    check_per_edge("a", csr.nnz(), s.heads, a.len())?;
    check_per_edge("b", csr.nnz(), s.heads, b.len())?;
    for (what, v) in [("a", a), ("b", b)] {
        check_same_gpu(gpu, what, v)?;
    }
    check_same_gpu(gpu, "csr", csr)?;
    check_same_gpu(gpu, "x", x)?;
    check_same_gpu(gpu, "y", y)?;
    check_same_gpu(gpu, "d_edge_features", &*out)?;
    let (name, f) = function(gpu, row_combine_kernel(T::NAME))?;
    let (rows, nnz, heads, dim) = (
        to_u32("rows", csr.n_rows())?,
        to_u32("edges", csr.nnz())?,
        to_u32("heads", s.heads)?,
        to_u32("head_dim", s.head_dim)?,
    );
    let mut args = gpu.launch_builder(&f);
    args.arg(csr.row_offsets().slice())
        .arg(&rows)
        .arg(&nnz)
        .arg(&heads)
        .arg(&dim)
        .arg(a.slice())
        .arg(x.slice())
        .arg(b.slice())
        .arg(y.slice())
        .arg(out.slice_mut());
    // SAFETY: each warp takes edges e < nnz of one chunk (⌈nnz / 32⌉ chunks) and finds their
    // rows < n_rows in row_offsets (n_rows + 1 entries, the last = nnz, so the search and the
    // walk stay below n_rows); reads a, b at e·heads + h < nnz·heads, x and y at row·heads·dim +
    // f < n_rows·heads·dim, writes out at e·heads·dim + f < nnz·heads·dim (all shapes and
    // lengths checked above).
    unsafe {
        launch(
            name,
            &mut args,
            warp_grid(csr.nnz().div_ceil(COMBINE_EDGES))?,
        )
    }
}

/// How [`edge_rows`] fills the added self loops' rows (PyG's `add_self_loops(fill_value=…)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LoopFill {
    /// The mean of the other edges' rows into the same node (0 where there are none).
    Mean,
    /// Their sum.
    Sum,
    /// This value in every feature.
    Value(f32),
}

/// Per-edge attribute rows (`x`: `rows × width` of `T`, in an input's edge order) moved to
/// `a`'s CSR order as `O` (f32, or `T` itself) in `out` (`nnz × width`): input row `e` goes to
/// edge `positions[e]` (a position outside `0..nnz` is skipped: a row whose edge another
/// replaces). With `loops` (each row's self-loop edge, `n_rows` positions, and a fill), every
/// loop's row is then filled from the other edges of its row, in edge order (f32 sums: the same
/// bits every run; rounded to `T`, the attributes' type, before `O`), overwriting what an input
/// loop placed there. `out` is written only where a row lands: every edge of `a` gets one when
/// `a` was built from the input's edges, which repeat none, and (with `loops`) their self loops.
///
/// # Errors
/// `O` neither f32 nor `T`; lengths that do not fit `rows`, `width`, `nnz` and `n_rows`
/// (named); a width of 0; buffers of another GPU.
pub fn edge_rows<T: DType, O: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    (x, width): (&DeviceVec<T>, usize),
    positions: &DeviceVec<i64>,
    loops: Option<(&DeviceVec<i64>, LoopFill)>,
    out: &mut DeviceVec<O>,
) -> Result<()> {
    if O::KIND != DTypeKind::F32 && O::KIND != T::KIND {
        return Err(Error::Unsupported {
            kernel: "edge_rows_place",
            why: format!(
                "rows of {} written as {}: f32 or {} only",
                T::NAME,
                O::NAME,
                T::NAME
            ),
        });
    }
    if width == 0 {
        return Err(Error::InvalidArgument {
            what: "edge attribute width",
            why: "must be at least 1".into(),
        });
    }
    let rows = positions.len();
    check_per_edge("edge attributes (rows × width)", rows, width, x.len())?;
    check_per_edge("edge rows (nnz × width)", a.nnz(), width, out.len())?;
    if let Some((at, _)) = loops {
        check_per_edge("self-loop positions (n_rows)", a.n_rows(), 1, at.len())?;
        check_same_gpu(gpu, "self-loop positions", at)?;
    }
    check_same_gpu(gpu, "csr", a)?;
    check_same_gpu(gpu, "edge attributes", x)?;
    check_same_gpu(gpu, "positions", positions)?;
    check_same_gpu(gpu, "edge rows", &*out)?;
    let (nnz, f) = (a.nnz() as u64, to_u32("edge attribute width", width)?);
    if rows > 0 && nnz > 0 {
        let (name, k) = function(gpu, rows_place_kernel(T::NAME, O::NAME))?;
        let rows_u = rows as u64;
        let mut args = gpu.launch_builder(&k);
        args.arg(x.slice())
            .arg(&rows_u)
            .arg(&f)
            .arg(positions.slice())
            .arg(&nnz)
            .arg(out.slice_mut());
        // SAFETY: reads x[0..rows·width) and positions[0..rows) (lengths checked) and writes
        // out[p·width + k] only for 0 ≤ p < nnz and k < width (the kernel skips the rest):
        // within out's nnz·width (checked).
        unsafe { launch(name, &mut args, stride_grid(x.len())?) }?;
    }
    let Some((at, fill)) = loops else {
        return Ok(());
    };
    if a.n_rows() == 0 || nnz == 0 {
        return Ok(());
    }
    let (mode, value) = match fill {
        LoopFill::Mean => (0u32, 0.0f32),
        LoopFill::Sum => (1, 0.0),
        LoopFill::Value(v) => (2, v),
    };
    let (name, k) = function(gpu, rows_fill_kernel(T::NAME, O::NAME))?;
    let n_rows = to_u32("rows", a.n_rows())?;
    let mut args = gpu.launch_builder(&k);
    args.arg(a.row_offsets().slice())
        .arg(&n_rows)
        .arg(at.slice())
        .arg(&nnz)
        .arg(&f)
        .arg(&mode)
        .arg(&value)
        .arg(out.slice_mut());
    // SAFETY: warp i < n_rows reads row_offsets[i..=i+1] (n_rows + 1 long, a valid CSR whose
    // offsets are at most nnz) and at[i] (n_rows long, checked); it reads and writes out[q·width
    // + k] for q in the row (< nnz) and k < width, only where its loop position lies in the row
    // (the kernel skips the rest): within out's nnz·width (checked).
    unsafe { launch(name, &mut args, warp_grid(a.n_rows())?) }
}
