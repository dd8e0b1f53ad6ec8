//! The small dense kernels of the layers and their optimizers (`cuda/layers.cu`): bias add and
//! bias gradient, the per-head dot of GAT's attention vectors and its gradient, activations,
//! row L2 normalization (AGNN), head mean, `y += α·x`, SGD and Adam.
//!
//! Operands are row-major like everything in this crate; sums run in f32; parameter gradients
//! are f32 buffers whatever the feature type, accumulated across rows without atomics (each
//! block's part stored, the parts added in a fixed order: the same bits every run). Every
//! function checks lengths and devices first.

use cudarc::driver::CudaFunction;
use spattn_kernels_sys::LAYERS;

use crate::buffer::{DeviceMatrix, DeviceVec};
use crate::dense::{DenseBuffer, Dims};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{
    blocks_for, check_same_gpu, kernel_named, launch, opt_ptr, product, stride_grid, to_u32,
    warp_grid, LaunchConfig, PushKernelArg, PushOptionalArg,
};
use crate::shape::Shape;

/// An activation of the layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Activation {
    /// max(x, 0).
    Relu,
    /// x for x > 0, eˣ − 1 otherwise (α = 1, as GAT uses).
    Elu,
}

impl Activation {
    fn code(self) -> i32 {
        match self {
            Activation::Relu => 0,
            Activation::Elu => 1,
        }
    }

    /// The activation of one value, in `f64` (the CPU layers' definition).
    pub fn apply(self, x: f64) -> f64 {
        match self {
            Activation::Relu => x.max(0.0),
            Activation::Elu => {
                if x > 0.0 {
                    x
                } else {
                    x.exp_m1()
                }
            }
        }
    }

    /// Its derivative at the pre-activation `x`.
    pub fn derivative(self, x: f64) -> f64 {
        match (self, x > 0.0) {
            (_, true) => 1.0,
            (Activation::Relu, false) => 0.0,
            (Activation::Elu, false) => x.exp(),
        }
    }
}

/// Adam's hyper-parameters (decoupled weight decay: AdamW when `weight_decay > 0`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamHyper {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay (0.9).
    pub beta1: f32,
    /// Second-moment decay (0.999).
    pub beta2: f32,
    /// Denominator guard (1e-8).
    pub eps: f32,
    /// Decoupled weight decay (0 for plain Adam).
    pub weight_decay: f32,
}

impl AdamHyper {
    /// The usual defaults with learning rate `lr`.
    pub fn new(lr: f32) -> Self {
        Self {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// The kernel of `op` for elements of `dtype` (a [`DType::NAME`]); the launch-name test forms
/// it too.
pub(crate) fn dense_kernel(op: &str, dtype: &str) -> String {
    format!("{op}_dense_{dtype}")
}

fn function<T: DType>(gpu: &Gpu, op: &str) -> Result<(&'static str, CudaFunction)> {
    let name = kernel_named(&LAYERS, dense_kernel(op, T::NAME))?;
    Ok((name, gpu.load_function(LAYERS.name, LAYERS.ptx, name)?))
}

fn expect_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(Error::LengthMismatch {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// `y[i, c] += bias[c]` for a `dims.rows × dims.cols` matrix `y`.
pub fn bias_add<T: DType>(
    gpu: &Gpu,
    y: &mut impl DenseBuffer<T>,
    dims: Dims,
    bias: &DeviceVec<T>,
) -> Result<()> {
    expect_len("y", dims.len()?, y.len())?;
    expect_len("bias", dims.cols, bias.len())?;
    check_same_gpu(gpu, "y", &*y)?;
    check_same_gpu(gpu, "bias", bias)?;
    let (name, f) = function::<T>(gpu, "bias_add")?;
    let rows = dims.rows as u64;
    let cols = to_u32("columns", dims.cols)?;
    let cfg = stride_grid(y.len())?;
    let mut args = gpu.launch_builder(&f);
    args.arg(y.slice_mut())
        .arg(bias.slice())
        .arg(&rows)
        .arg(&cols);
    // SAFETY: reads and writes y[0..rows·cols) (length checked) and reads bias[0..cols).
    unsafe { launch(name, &mut args, cfg) }
}

/// `db[c] += Σ_i dy[i, c]`: the gradient of a bias, accumulated into the f32 `db`.
pub fn bias_grad<T: DType>(
    gpu: &Gpu,
    dy: &impl DenseBuffer<T>,
    dims: Dims,
    db: &mut DeviceVec<f32>,
) -> Result<()> {
    expect_len("dy", dims.len()?, dy.len())?;
    expect_len("bias gradient", dims.cols, db.len())?;
    col_sum(gpu, dy, (None, 1), dims.rows, 1, dims.cols, db)
}

/// `out[h, d] += Σ_i w[i, h] · x[i, h, d]` for `x` of `rows × heads × dim` and `w` of
/// `rows × heads × 1` (f32): the gradient of a GAT attention vector (`w` the scores' gradient,
/// kept in f32 because the sum over every node cancels heavily). With `k` ≤ [`HEAD_MAX_ATT`]
/// weight vectors (`w` of `(k · rows) × heads × 1`, `out` of `k · heads · dim`: vector `t`'s
/// weights in rows `t · rows ..`, its sum at `t · heads · dim ..`), every sum from one read of
/// `x`.
pub fn head_weighted_sum<T: DType>(
    gpu: &Gpu,
    x: &DeviceMatrix<T>,
    w: &DeviceMatrix<f32>,
    out: &mut DeviceVec<f32>,
) -> Result<()> {
    let s = x.shape();
    let k = match (s.rows, s.row_len()) {
        (0, 0) => 1,
        (0, len) => out.len() / len,
        (rows, _) => w.shape().rows / rows,
    };
    if !(1..=HEAD_MAX_ATT).contains(&k) {
        return Err(Error::InvalidArgument {
            what: "weights",
            why: format!(
                "{} rows of weights for {} rows of x: expected 1 to {HEAD_MAX_ATT} vectors",
                w.shape().rows,
                s.rows
            ),
        });
    }
    Shape::new(k * s.rows, s.heads, 1)?.expect_eq("weights", w.shape())?;
    expect_len("attention gradient", k * s.row_len(), out.len())?;
    col_sum(
        gpu,
        x,
        (Some(w.as_vec()), k),
        s.rows,
        s.heads,
        s.head_dim,
        out,
    )
}

/// The most blocks of a column sum (its grid's x times y): its parts (row blocks × the columns
/// × the weight vectors, f32) are scratch of each call, so bounded (4 MiB at 256 columns and
/// two vectors) while the grid still fills a GPU many times.
const COL_SUM_BLOCKS: u32 = 2048;

/// `out[t · cols + c] += Σ_i w[t, i, h(c)] · x[i, c]` for the `n_w` weight vectors of `w` (1
/// where `None`, `n_w` = 1) over `x`'s `rows × heads·dim`.
fn col_sum<T: DType>(
    gpu: &Gpu,
    x: &impl DenseBuffer<T>,
    (w, n_w): (Option<&DeviceVec<f32>>, usize),
    rows: usize,
    heads: usize,
    dim: usize,
    out: &mut DeviceVec<f32>,
) -> Result<()> {
    check_same_gpu(gpu, "x", x)?;
    check_same_gpu(gpu, "out", &*out)?;
    let w_ptr = opt_ptr(gpu, "weights", w)?;
    let (name, f) = function::<T>(gpu, "weighted_col_sum")?;
    let cols = heads * dim;
    let rows_u = to_u32("rows", rows)?;
    let (heads_u, dim_u) = (to_u32("heads", heads)?, to_u32("dim", dim)?);
    let n_w_u = to_u32("weight vectors", n_w)?; // at most HEAD_MAX_ATT (callers)
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    // A thread's columns: one 16-byte vector where a head holds whole vectors; a row's
    // threads: enough for its columns, up to a warp (the block walks 256 / tpr rows at once).
    let vw = whole_vectors::<T>(dim);
    let tpr = cols.div_ceil(vw).next_power_of_two().min(32);
    let col_blocks = blocks_for(cols, (tpr * vw) as u32)?;
    // About four rows a thread, within the block budget.
    let row_blocks =
        blocks_for(rows, (256 / tpr * 4) as u32)?.min((COL_SUM_BLOCKS / col_blocks).max(1));
    let mut part = DeviceVec::<f32>::unset(
        gpu,
        product("column sum parts", &[row_blocks as usize, n_w, cols])?,
    )?;
    let cfg = LaunchConfig {
        grid_dim: (col_blocks, row_blocks, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (vw_u, tpr_u) = (vw as u32, tpr as u32); // vw 1, 4 or 8; tpr at most 32
    let mut args = gpu.launch_builder(&f);
    args.arg(x.slice())
        .arg(&w_ptr)
        .arg(&rows_u)
        .arg(&heads_u)
        .arg(&dim_u)
        .arg(&n_w_u)
        .arg(&vw_u)
        .arg(&tpr_u)
        .arg(part.slice_mut());
    // SAFETY: reads x[0..rows·heads·dim) (callers checked x's length or shape; a thread's vw
    // columns lie in one row and head, vw dividing dim), w[0..n_w·rows·heads) where given (shape
    // checked), and writes part[(y·n_w + t)·cols + c] for row block y < row_blocks, t < n_w and
    // column c < cols (part holds row_blocks·n_w·cols); tpr is a power of two ≤ 32 dividing
    // the block's 256 threads.
    unsafe { launch(name, &mut args, cfg) }?;
    sum_parts(gpu, &part, row_blocks, n_w * cols, out)
}

/// `out[c] += Σ_p part[p · cols + c]` for `p < n_parts`, in a fixed order (the partial sums of
/// a reduction split across blocks, added without float atomics).
fn sum_parts(
    gpu: &Gpu,
    part: &DeviceVec<f32>,
    n_parts: u32,
    cols: usize,
    out: &mut DeviceVec<f32>,
) -> Result<()> {
    expect_len(
        "sum parts",
        product("sum parts", &[n_parts as usize, cols])?,
        part.len(),
    )?;
    expect_len("sum", cols, out.len())?;
    let name = spattn_kernels_sys::kernel!(LAYERS, "sum_parts_f32");
    let f = gpu.load_function(LAYERS.name, LAYERS.ptx, name)?;
    let cols_u = to_u32("columns", cols)?;
    let cfg = LaunchConfig {
        grid_dim: (cols_u, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut args = gpu.launch_builder(&f);
    args.arg(part.slice())
        .arg(&n_parts)
        .arg(&cols_u)
        .arg(out.slice_mut());
    // SAFETY: block c reads part[p·cols + c] for p < n_parts (part holds n_parts·cols, checked)
    // and adds into out[c] (cols long, checked).
    unsafe { launch(name, &mut args, cfg) }
}

/// `out[i, h] = ⟨x[i, h, :], att[h, :]⟩`: GAT's per-node score terms (`out` is
/// `rows × heads × 1`, `att` holds `heads × dim`). With `k` ≤ [`HEAD_MAX_ATT`] vectors in `att`
/// (`k × heads × dim`), `out` is `(k · rows) × heads × 1`: vector `t`'s scores in rows
/// `t · rows ..`, every vector's from one read of `x`.
pub fn head_dot<T: DType>(
    gpu: &Gpu,
    x: &DeviceMatrix<T>,
    att: &DeviceVec<T>,
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    let shapes = (x.shape(), out.shape());
    let op = ("head_dot", "out");
    head_kernel::<T, _, _, _>(gpu, op, shapes, ("x", x), att, ("out", out), |s| {
        warp_grid(s.rows * s.heads)
    })
}

/// [`head_dot`] with an f32 attention vector and f32 scores, whatever `x`'s type: the Python
/// layers' score terms (their attention vectors may be f32 beside f16 features, and the scores
/// feed sums over every edge). `out` is `rows × heads × 1` f32, `att` holds `heads × dim` f32.
pub fn head_dot_f32<T: DType>(
    gpu: &Gpu,
    x: &DeviceMatrix<T>,
    att: &DeviceVec<f32>,
    out: &mut DeviceMatrix<f32>,
) -> Result<()> {
    let shapes = (x.shape(), out.shape());
    let op = ("head_dot_f32", "out");
    head_kernel::<T, _, _, _>(gpu, op, shapes, ("x", x), att, ("out", out), head_grid::<T>)
}

/// `dx[i, h, d] += de[i, h] · att[h, d]`: the gradient of [`head_dot`] with respect to `x` (`de`
/// in f32); with `k` vectors (`de` `(k · rows) × heads`), their sum in one pass.
pub fn head_outer_add<T: DType>(
    gpu: &Gpu,
    de: &DeviceMatrix<f32>,
    att: &DeviceVec<T>,
    dx: &mut DeviceMatrix<T>,
) -> Result<()> {
    let shapes = (dx.shape(), de.shape());
    let de = ("score gradient", de);
    let op = ("head_outer_add", "score gradient");
    head_kernel::<T, _, _, _>(gpu, op, shapes, de, att, ("dx", dx), head_grid::<T>)
}

/// `dx[i, h, d] += de[i, h] · att[h, d]` with an f32 attention vector: the gradient of
/// [`head_dot_f32`] with respect to `x`.
pub fn head_outer_add_f32<T: DType>(
    gpu: &Gpu,
    de: &DeviceMatrix<f32>,
    att: &DeviceVec<f32>,
    dx: &mut DeviceMatrix<T>,
) -> Result<()> {
    let shapes = (dx.shape(), de.shape());
    let de = ("score gradient", de);
    let op = ("head_outer_add_f32", "score gradient");
    head_kernel::<T, _, _, _>(gpu, op, shapes, de, att, ("dx", dx), head_grid::<T>)
}

/// The grid of the head kernels that walk a (row, head) with a group of lanes (layers.cu's
/// HeadWalk): a group of up to 32 lanes, one 16-byte vector each where `dim` holds whole
/// vectors, for every (row, head) at once (one at least, which writes zero scores where `dim`
/// is 0). A view the kernel finds unaligned takes wider groups, which its grid-stride loop
/// covers.
fn head_grid<T: DType>(s: Shape) -> Result<LaunchConfig> {
    let lanes = (s.head_dim / whole_vectors::<T>(s.head_dim))
        .next_power_of_two()
        .min(32);
    stride_grid(product("head lanes", &[s.rows, s.heads, lanes])?)
}

/// The elements a lane of layers.cu's vectorized kernels loads at once for heads of `dim`
/// features of `T`: one 16-byte vector where `dim` holds whole ones, else one element (the
/// kernels' rule, for their views aligned as the external checks ask).
fn whole_vectors<T: DType>(dim: usize) -> usize {
    let v = 16 / std::mem::size_of::<T>();
    if dim % v == 0 {
        v
    } else {
        1
    }
}

/// Attention vectors the head kernels take at once (`SPATTN_HEAD_MAX_ATT` in layers.cu).
pub const HEAD_MAX_ATT: usize = 4;

/// A shape's rows, heads and head_dim as the kernels take them.
fn rows_heads_dim(s: Shape) -> Result<(u32, u32, u32)> {
    Ok((
        to_u32("rows", s.rows)?,
        to_u32("heads", s.heads)?,
        to_u32("dim", s.head_dim)?,
    ))
}

/// [`head_dot`], [`head_outer_add`] or their f32 twins (`op`: the kernel and the name of its
/// scores operand; `T` the features' type, which names the kernel): features of shape `s`
/// (`rows × heads × dim`), an attention vector `att` (`heads × dim`) and per-node scores of
/// shape `scores` (`rows × heads × 1`); `input` is read, `output` written, each named. Checks
/// the shapes, then that `input`, `att` and `output` are on `gpu`, and launches `op(input, att,
/// rows, heads, dim, output)` on `cfg(s)`.
fn head_kernel<T: DType, I: DType, A: DType, O: DType>(
    gpu: &Gpu,
    (op, scores_name): (&str, &'static str),
    (s, scores): (Shape, Shape),
    (input_name, input): (&'static str, &DeviceMatrix<I>),
    att: &DeviceVec<A>,
    (output_name, output): (&'static str, &mut DeviceMatrix<O>),
    cfg: impl FnOnce(Shape) -> Result<LaunchConfig>,
) -> Result<()> {
    // k attention vectors at once (att holds k × heads × dim, the scores k × rows × heads).
    let k = match s.row_len() {
        0 => 1,
        len => att.len() / len,
    };
    if !(1..=HEAD_MAX_ATT).contains(&k) || k * s.row_len() != att.len() {
        return Err(Error::InvalidArgument {
            what: "attention vector",
            why: format!(
                "{} values: expected 1 to {HEAD_MAX_ATT} vectors of heads × dim = {}",
                att.len(),
                s.row_len()
            ),
        });
    }
    Shape::new(k * s.rows, s.heads, 1)?.expect_eq(scores_name, scores)?;
    for (what, on) in [
        (input_name, input.gpu()),
        ("attention vector", att.gpu()),
        (output_name, output.gpu()),
    ] {
        check_same_gpu(gpu, what, on)?;
    }
    let (name, f) = function::<T>(gpu, op)?;
    let (rows, heads, dim) = rows_heads_dim(s)?;
    let n_att = k as u32; // at most HEAD_MAX_ATT
    let mut args = gpu.launch_builder(&f);
    args.arg(input.slice())
        .arg(att.slice())
        .arg(&rows)
        .arg(&heads)
        .arg(&dim)
        .arg(&n_att)
        .arg(output.slice_mut());
    // SAFETY: head_dot(_f32) reads x = input (rows·heads·dim, its shape s) and att
    // (k·heads·dim, checked) and writes out = output[0..k·rows·heads) (shape checked);
    // head_outer_add(_f32) reads de = input (k·rows·heads, shape checked) and att, and reads and
    // writes dx = output (rows·heads·dim, its shape s). Each kernel's pointer types are I, A
    // and O as passed (the `_f32` kernels take f32 att and scores).
    unsafe { launch(name, &mut args, cfg(s)?) }
}

/// `y = act(x)` elementwise (`x` and `y` of equal length).
pub fn activation<T: DType>(
    gpu: &Gpu,
    act: Activation,
    x: &impl DenseBuffer<T>,
    y: &mut impl DenseBuffer<T>,
) -> Result<()> {
    expect_len("y", x.len(), y.len())?;
    check_same_gpu(gpu, "x", x)?;
    check_same_gpu(gpu, "y", &*y)?;
    let (name, f) = function::<T>(gpu, "activation")?;
    let (kind, n) = (act.code(), x.len() as u64);
    let mut args = gpu.launch_builder(&f);
    args.arg(&kind).arg(x.slice()).arg(y.slice_mut()).arg(&n);
    // SAFETY: reads x[0..n), writes y[0..n); both hold n elements.
    unsafe { launch(name, &mut args, stride_grid(x.len())?) }
}

/// `dx = dy · act'(x)` elementwise, from the pre-activation `x`.
pub fn activation_backward<T: DType>(
    gpu: &Gpu,
    act: Activation,
    x: &impl DenseBuffer<T>,
    dy: &impl DenseBuffer<T>,
    dx: &mut impl DenseBuffer<T>,
) -> Result<()> {
    expect_len("dy", x.len(), dy.len())?;
    expect_len("dx", x.len(), dx.len())?;
    check_same_gpu(gpu, "x", x)?;
    check_same_gpu(gpu, "dy", dy)?;
    check_same_gpu(gpu, "dx", &*dx)?;
    let (name, f) = function::<T>(gpu, "activation_backward")?;
    let (kind, n) = (act.code(), x.len() as u64);
    let mut args = gpu.launch_builder(&f);
    args.arg(&kind)
        .arg(x.slice())
        .arg(dy.slice())
        .arg(dx.slice_mut())
        .arg(&n);
    // SAFETY: reads x and dy, writes dx, each n elements (checked).
    unsafe { launch(name, &mut args, stride_grid(x.len())?) }
}

/// Row L2 normalization (AGNN): `xhat = x / max(‖x‖, 1e-12)` per row of `x`
/// (`rows × heads·head_dim`), and `q = β · xhat` where `q` is given (`beta` a one-element
/// device scalar; 1 where `None`). `inv_norm` (`rows` f32) keeps `1 / max(‖x‖, 1e-12)` for the
/// backward, negated where the clamp was active.
pub fn row_normalize<T: DType>(
    gpu: &Gpu,
    x: &DeviceMatrix<T>,
    beta: Option<&DeviceVec<T>>,
    xhat: &mut DeviceMatrix<T>,
    q: Option<&mut DeviceMatrix<T>>,
    inv_norm: &mut DeviceVec<f32>,
) -> Result<()> {
    let s = x.shape();
    s.expect_eq("xhat", xhat.shape())?;
    if let Some(q) = &q {
        s.expect_eq("q", q.shape())?;
        check_same_gpu(gpu, "q", &**q)?;
    }
    if let Some(b) = beta {
        expect_len("beta", 1, b.len())?;
    }
    expect_len("inverse norms", s.rows, inv_norm.len())?;
    check_same_gpu(gpu, "x", x)?;
    check_same_gpu(gpu, "xhat", &*xhat)?;
    check_same_gpu(gpu, "inverse norms", &*inv_norm)?;
    let beta_ptr = opt_ptr(gpu, "beta", beta)?;
    let (name, f) = function::<T>(gpu, "row_normalize")?;
    let (rows, cols) = (to_u32("rows", s.rows)?, to_u32("columns", s.row_len())?);
    let mut args = gpu.launch_builder(&f);
    args.arg(x.slice())
        .arg(&rows)
        .arg(&cols)
        .arg(&beta_ptr)
        .arg(xhat.slice_mut())
        .arg_or_null_mut(q.map(DeviceMatrix::as_vec_mut))
        .arg(inv_norm.slice_mut());
    // SAFETY: one warp per row reads x[r·cols..(r+1)·cols), writes the same range of xhat and
    // (where given) q — all of x's shape — and inv_norm[r] (rows long); beta is one element.
    unsafe { launch(name, &mut args, warp_grid(s.rows)?) }
}

/// Backward of [`row_normalize`] where `q = β·xhat` fed one input of a score and `xhat`
/// another: with `g = β·dq + dk` (`dk` may be `None`), `dx += (g − xhat ⟨xhat, g⟩) · inv_norm`
/// per row (no projection where the clamp was active) and `dbeta += Σ dq ⊙ xhat` (f32, summed
/// in a fixed order: the same bits every run).
#[allow(clippy::too_many_arguments)]
pub fn row_normalize_backward<T: DType>(
    gpu: &Gpu,
    xhat: &DeviceMatrix<T>,
    inv_norm: &DeviceVec<f32>,
    dq: &DeviceMatrix<T>,
    dk: Option<&DeviceMatrix<T>>,
    beta: Option<&DeviceVec<T>>,
    dx: &mut DeviceMatrix<T>,
    dbeta: Option<&mut DeviceVec<f32>>,
) -> Result<()> {
    let s = xhat.shape();
    s.expect_eq("dq", dq.shape())?;
    s.expect_eq("dx", dx.shape())?;
    if let Some(dk) = dk {
        s.expect_eq("dk", dk.shape())?;
    }
    if let Some(b) = beta {
        expect_len("beta", 1, b.len())?;
    }
    expect_len("inverse norms", s.rows, inv_norm.len())?;
    check_same_gpu(gpu, "xhat", xhat)?;
    check_same_gpu(gpu, "inverse norms", inv_norm)?;
    check_same_gpu(gpu, "dq", dq)?;
    check_same_gpu(gpu, "dx", &*dx)?;
    let dk_ptr = opt_ptr(gpu, "dk", dk.map(DeviceMatrix::as_vec))?;
    let beta_ptr = opt_ptr(gpu, "beta", beta)?;
    let cfg = warp_grid(s.rows)?;
    let blocks = cfg.grid_dim.0;
    let mut dbeta_part = match &dbeta {
        Some(d) => {
            expect_len("beta gradient", 1, d.len())?;
            check_same_gpu(gpu, "beta gradient", &**d)?;
            Some(DeviceVec::<f32>::unset(gpu, blocks as usize)?)
        }
        None => None,
    };
    let (name, f) = function::<T>(gpu, "row_normalize_backward")?;
    let (rows, cols) = (to_u32("rows", s.rows)?, to_u32("columns", s.row_len())?);
    let mut args = gpu.launch_builder(&f);
    args.arg(xhat.slice())
        .arg(inv_norm.slice())
        .arg(dq.slice())
        .arg(&dk_ptr)
        .arg(&beta_ptr)
        .arg(&rows)
        .arg(&cols)
        .arg(dx.slice_mut())
        .arg_or_null_mut(dbeta_part.as_mut());
    // SAFETY: one warp per row reads row r of xhat, dq, dk (all of xhat's shape, checked) and
    // inv_norm[r], reads and writes row r of dx; thread 0 of block b writes dbeta_part[b]
    // (one per block of the grid, where given); beta is one element.
    unsafe { launch(name, &mut args, cfg) }?;
    drop(args); // its borrow of the parts ends before they are summed
    match (dbeta, dbeta_part) {
        (Some(d), Some(part)) => sum_parts(gpu, &part, blocks, 1, d),
        _ => Ok(()),
    }
}

/// `y += alpha · x` (residual connections, gradient sums).
pub fn axpy<T: DType>(
    gpu: &Gpu,
    alpha: f32,
    x: &impl DenseBuffer<T>,
    y: &mut impl DenseBuffer<T>,
) -> Result<()> {
    expect_len("y", x.len(), y.len())?;
    check_same_gpu(gpu, "x", x)?;
    check_same_gpu(gpu, "y", &*y)?;
    let (name, f) = function::<T>(gpu, "axpy")?;
    let n = x.len() as u64;
    let mut args = gpu.launch_builder(&f);
    args.arg(x.slice()).arg(&alpha).arg(y.slice_mut()).arg(&n);
    // SAFETY: reads x[0..n), reads and writes y[0..n); both n long.
    unsafe { launch(name, &mut args, stride_grid(x.len())?) }
}

/// `y[i, 0, d] = mean_h x[i, h, d]` (GAT with heads averaged): `y` is `rows × 1 × head_dim`.
pub fn head_mean<T: DType>(gpu: &Gpu, x: &DeviceMatrix<T>, y: &mut DeviceMatrix<T>) -> Result<()> {
    let s = x.shape();
    Shape::new(s.rows, 1, s.head_dim)?.expect_eq("y", y.shape())?;
    check_same_gpu(gpu, "x", x)?;
    check_same_gpu(gpu, "y", &*y)?;
    let (name, f) = function::<T>(gpu, "head_mean")?;
    let (rows, heads, dim) = rows_heads_dim(s)?;
    let cfg = stride_grid(y.len())?;
    let mut args = gpu.launch_builder(&f);
    args.arg(x.slice())
        .arg(&rows)
        .arg(&heads)
        .arg(&dim)
        .arg(y.slice_mut());
    // SAFETY: reads x (rows·heads·dim), writes y (rows·dim); shapes checked.
    unsafe { launch(name, &mut args, cfg) }
}

/// The gradient of [`head_mean`]: `dx[i, h, d] = dy[i, 0, d] / heads` (overwrites `dx`).
pub fn head_mean_backward<T: DType>(
    gpu: &Gpu,
    dy: &DeviceMatrix<T>,
    dx: &mut DeviceMatrix<T>,
) -> Result<()> {
    let s = dx.shape();
    Shape::new(s.rows, 1, s.head_dim)?.expect_eq("dy", dy.shape())?;
    check_same_gpu(gpu, "dy", dy)?;
    check_same_gpu(gpu, "dx", &*dx)?;
    let (name, f) = function::<T>(gpu, "head_broadcast")?;
    let (rows, heads, dim) = rows_heads_dim(s)?;
    let scale = 1.0f32 / s.heads as f32;
    let mut args = gpu.launch_builder(&f);
    args.arg(dy.slice())
        .arg(&rows)
        .arg(&heads)
        .arg(&dim)
        .arg(&scale)
        .arg(dx.slice_mut());
    // SAFETY: reads dy (rows·dim), writes dx (rows·heads·dim); shapes checked.
    unsafe { launch(name, &mut args, stride_grid(s.len())?) }
}

/// One Adam step on `param` with gradient `grad` and moments `m`, `v` (all of equal length;
/// moments f32), at step `t ≥ 1` (for the bias corrections).
pub fn adam_step<T: DType>(
    gpu: &Gpu,
    hyper: AdamHyper,
    t: u32,
    param: &mut DeviceVec<T>,
    grad: &DeviceVec<f32>,
    m: &mut DeviceVec<f32>,
    v: &mut DeviceVec<f32>,
) -> Result<()> {
    let n = param.len();
    expect_len("gradient", n, grad.len())?;
    expect_len("first moment", n, m.len())?;
    expect_len("second moment", n, v.len())?;
    if t == 0 {
        return Err(Error::InvalidArgument {
            what: "Adam step",
            why: "the step count starts at 1".into(),
        });
    }
    check_same_gpu(gpu, "parameter", &*param)?;
    check_same_gpu(gpu, "gradient", grad)?;
    check_same_gpu(gpu, "first moment", &*m)?;
    check_same_gpu(gpu, "second moment", &*v)?;
    let (name, f) = function::<T>(gpu, "adam")?;
    let bc1 = 1.0 - hyper.beta1.powi(t.min(i32::MAX as u32) as i32);
    let bc2 = 1.0 - hyper.beta2.powi(t.min(i32::MAX as u32) as i32);
    let n64 = n as u64;
    let mut args = gpu.launch_builder(&f);
    args.arg(param.slice_mut())
        .arg(grad.slice())
        .arg(m.slice_mut())
        .arg(v.slice_mut())
        .arg(&n64)
        .arg(&hyper.lr)
        .arg(&hyper.beta1)
        .arg(&hyper.beta2)
        .arg(&hyper.eps)
        .arg(&bc1)
        .arg(&bc2)
        .arg(&hyper.weight_decay);
    // SAFETY: reads and writes param, m, v and reads grad, each n elements (checked).
    unsafe { launch(name, &mut args, stride_grid(n)?) }
}

/// One SGD step: `param -= lr · (grad + weight_decay · param)`.
pub fn sgd_step<T: DType>(
    gpu: &Gpu,
    lr: f32,
    weight_decay: f32,
    param: &mut DeviceVec<T>,
    grad: &DeviceVec<f32>,
) -> Result<()> {
    expect_len("gradient", param.len(), grad.len())?;
    check_same_gpu(gpu, "parameter", &*param)?;
    check_same_gpu(gpu, "gradient", grad)?;
    let (name, f) = function::<T>(gpu, "sgd")?;
    let n = param.len() as u64;
    let cfg = stride_grid(param.len())?;
    let mut args = gpu.launch_builder(&f);
    args.arg(param.slice_mut())
        .arg(grad.slice())
        .arg(&n)
        .arg(&lr)
        .arg(&weight_decay);
    // SAFETY: reads and writes param[0..n), reads grad[0..n); both n long.
    unsafe { launch(name, &mut args, cfg) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn a_lane_loads_one_vector_where_the_head_holds_whole_ones() {
        assert_eq!(whole_vectors::<f16>(32), 8);
        assert_eq!(whole_vectors::<f16>(40), 8);
        assert_eq!(whole_vectors::<f16>(12), 1);
        assert_eq!(whole_vectors::<f32>(12), 4);
        // The head kernels' grid: rows × heads groups of the lanes a head takes.
        let s = Shape::new(1000, 8, 32).unwrap(); // 4 lanes of 8 f16 a head
        assert_eq!(head_grid::<f16>(s).unwrap().grid_dim.0, 1000 * 8 * 4 / 256);
        let s = Shape::new(1000, 1, 70).unwrap(); // 70 single elements: 32 lanes (the most)
        assert_eq!(head_grid::<f16>(s).unwrap().grid_dim.0, 1000 * 32 / 256);
        let s = Shape::new(300, 3, 1).unwrap(); // one element: a lane a (row, head)
        assert_eq!(
            head_grid::<f32>(s).unwrap().grid_dim.0,
            900_u32.div_ceil(256)
        );
    }
}
