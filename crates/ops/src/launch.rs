//! Launch plumbing shared by every op wrapper: checked narrowing of sizes to the `u32` the
//! kernels take, grid sizing within CUDA's limits, the same-GPU check on operands, and a
//! launch that reports failures with the kernel's name.
//!
//! A wrapper typically reads:
//!
//! ```ignore
//! check_same_gpu(gpu, "Q", q)?;
//! let n = to_u32("rows", q.shape().rows)?;
//! let cfg = grid_1d(q.len(), 256)?;
//! let f = gpu.load_function(MODULE.name, MODULE.ptx, "fill_f32")?;
//! let mut args = gpu.launch_builder(&f);
//! args.arg(out.slice_mut()).arg(&n);
//! // SAFETY: fill_f32 writes out[0..n) and reads nothing else; out holds n elements.
//! unsafe { launch("fill_f32", &mut args, cfg) }?;
//! ```

use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut, DriverError};
pub(crate) use cudarc::driver::{LaunchArgs, LaunchConfig, PushKernelArg};

use crate::buffer::{DeviceElement, DeviceMatrix, DeviceVec};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::shape::Shape;

/// A null device pointer, pushed for an optional array that is absent.
static NULL_DEVICE_PTR: u64 = 0;

/// Pushes an optional device array onto a launch: its pointer, or a null pointer where it is
/// `None`. The kernels test such an argument against `nullptr` (no row renumbering, no edge
/// values, ...).
pub(crate) trait PushOptionalArg<'a> {
    /// Pushes `buffer`'s device pointer, or null.
    fn arg_or_null<T: DeviceElement>(&mut self, buffer: Option<&'a DeviceVec<T>>) -> &mut Self;
    /// Pushes `buffer`'s device pointer for the kernel to write, or null.
    fn arg_or_null_mut<T: DeviceElement>(
        &mut self,
        buffer: Option<&'a mut DeviceVec<T>>,
    ) -> &mut Self;
    /// Pushes `view`'s device pointer (a range of a buffer), or null.
    fn view_or_null<T: DeviceElement>(&mut self, view: Option<&'a CudaView<'a, T>>) -> &mut Self;
}

impl<'a> PushOptionalArg<'a> for LaunchArgs<'a> {
    fn arg_or_null<T: DeviceElement>(&mut self, buffer: Option<&'a DeviceVec<T>>) -> &mut Self {
        match buffer {
            Some(b) => self.arg(b.slice()),
            None => self.arg(&NULL_DEVICE_PTR),
        }
    }

    fn arg_or_null_mut<T: DeviceElement>(
        &mut self,
        buffer: Option<&'a mut DeviceVec<T>>,
    ) -> &mut Self {
        match buffer {
            Some(b) => self.arg(b.slice_mut()),
            None => self.arg(&NULL_DEVICE_PTR),
        }
    }

    fn view_or_null<T: DeviceElement>(&mut self, view: Option<&'a CudaView<'a, T>>) -> &mut Self {
        match view {
            Some(v) => self.arg(v),
            None => self.arg(&NULL_DEVICE_PTR),
        }
    }
}

/// Largest `grid.x`: 2³¹ − 1 blocks.
pub(crate) const MAX_GRID_X: u32 = i32::MAX as u32;
/// Largest `grid.y` and `grid.z`.
pub(crate) const MAX_GRID_YZ: u32 = 65_535;
/// Largest number of threads in one block.
pub(crate) const MAX_THREADS_PER_BLOCK: u32 = 1024;
/// Largest `block.z`.
pub(crate) const MAX_BLOCK_Z: u32 = 64;

/// Maps a driver error to [`Error::Driver`], naming what was being done (for a launch: the
/// kernel's name).
pub(crate) fn map_driver_error(during: &'static str, source: DriverError) -> Error {
    Error::Driver { during, source }
}

/// Dynamic shared memory a block may use without opting in.
pub(crate) const DEFAULT_DYNAMIC_SHARED_BYTES: usize = 48 * 1024;

/// Lets launches of `f` use `bytes` of dynamic shared memory: beyond
/// [`DEFAULT_DYNAMIC_SHARED_BYTES`] a kernel must opt in
/// (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`); below it this does nothing. `what` names
/// the kernel in the error. Launch paths call it through [`crate::Gpu::load_function_with_shared`],
/// which remembers the largest size set per function and skips the driver call after that (a
/// smaller size set here directly would lower that limit under it).
pub(crate) fn allow_dynamic_shared(
    f: &cudarc::driver::CudaFunction,
    bytes: usize,
    what: &'static str,
) -> Result<()> {
    if bytes <= DEFAULT_DYNAMIC_SHARED_BYTES {
        return Ok(());
    }
    let bytes = i32::try_from(bytes).map_err(|_| Error::TooLarge {
        what: "dynamic shared memory (bytes)",
        value: bytes as u64,
        limit: i32::MAX as u64,
    })?;
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes,
    )
    .map_err(|e| map_driver_error(what, e))
}

/// `value` as the `u32` a kernel takes, or [`Error::TooLarge`] naming `what`.
pub(crate) fn to_u32(what: &'static str, value: usize) -> Result<u32> {
    u32::try_from(value).map_err(|_| Error::TooLarge {
        what,
        value: value as u64,
        limit: u64::from(u32::MAX),
    })
}

/// Blocks needed for `items` work items at `per_block` items per block: `⌈items / per_block⌉`,
/// at most [`MAX_GRID_X`]. Zero items need zero blocks (and [`launch`] then launches nothing).
pub(crate) fn blocks_for(items: usize, per_block: u32) -> Result<u32> {
    if per_block == 0 {
        return Err(Error::InvalidArgument {
            what: "items per block",
            why: "must be at least 1".into(),
        });
    }
    let blocks = items.div_ceil(per_block as usize);
    if blocks > MAX_GRID_X as usize {
        return Err(Error::TooLarge {
            what: "grid blocks (grid.x)",
            value: blocks as u64,
            limit: u64::from(MAX_GRID_X),
        });
    }
    Ok(blocks as u32)
}

/// A one-dimensional launch with one thread per item: `threads_per_block` threads per block,
/// as many blocks as `items` needs, no dynamic shared memory.
pub(crate) fn grid_1d(items: usize, threads_per_block: u32) -> Result<LaunchConfig> {
    check_block(threads_per_block, 1, 1)?;
    Ok(LaunchConfig {
        grid_dim: (blocks_for(items, threads_per_block)?, 1, 1),
        block_dim: (threads_per_block, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Threads per block of the grid-stride kernels ([`stride_grid`]).
pub(crate) const STRIDE_THREADS: u32 = 256;
/// Grid-stride kernels need no more blocks than this to fill any current GPU.
const STRIDE_MAX_BLOCKS: u32 = 1 << 16;

/// A grid-stride launch over `items` threads (blocks of [`STRIDE_THREADS`], at most 2¹⁶ of
/// them: the kernel's loop covers the rest).
pub(crate) fn stride_grid(items: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (
            blocks_for(items, STRIDE_THREADS)?.min(STRIDE_MAX_BLOCKS),
            1,
            1,
        ),
        block_dim: (STRIDE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// The product of `factors` in usize, or an error naming `what` where it overflows.
pub(crate) fn product(what: &'static str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or_else(|| Error::InvalidArgument {
            what,
            why: format!("the size {factors:?} overflows usize"),
        })
}

/// A grid-stride launch with one warp per item.
pub(crate) fn warp_grid(items: usize) -> Result<LaunchConfig> {
    stride_grid(items.checked_mul(32).ok_or(Error::TooLarge {
        what: "warps",
        value: items as u64,
        limit: (usize::MAX / 32) as u64,
    })?)
}

fn check_block(x: u32, y: u32, z: u32) -> Result<()> {
    let threads = u64::from(x) * u64::from(y) * u64::from(z);
    if threads == 0 || threads > u64::from(MAX_THREADS_PER_BLOCK) || z > MAX_BLOCK_Z {
        return Err(Error::InvalidArgument {
            what: "block shape",
            why: format!(
                "{x} x {y} x {z}: needs 1 to {MAX_THREADS_PER_BLOCK} threads and z <= {MAX_BLOCK_Z}"
            ),
        });
    }
    Ok(())
}

/// Whether `cfg` has no blocks (a zero grid dimension): nothing to launch.
pub(crate) fn is_empty_grid(cfg: &LaunchConfig) -> bool {
    let (x, y, z) = cfg.grid_dim;
    x == 0 || y == 0 || z == 0
}

/// Checks a launch configuration against CUDA's grid and block limits.
///
/// Limits that depend on the device or the kernel (shared memory, registers) are left to the
/// driver, whose error [`launch`] reports with the kernel's name.
pub(crate) fn check_launch_config(cfg: &LaunchConfig) -> Result<()> {
    let (bx, by, bz) = cfg.block_dim;
    check_block(bx, by, bz)?;
    let (gx, gy, gz) = cfg.grid_dim;
    if gx > MAX_GRID_X || gy > MAX_GRID_YZ || gz > MAX_GRID_YZ {
        return Err(Error::InvalidArgument {
            what: "grid shape",
            why: format!(
                "{gx} x {gy} x {gz}: the limits are {MAX_GRID_X} x {MAX_GRID_YZ} x {MAX_GRID_YZ}"
            ),
        });
    }
    Ok(())
}

/// Launches the kernel `args` was built for, with `cfg`, and names `kernel` in any error.
///
/// A grid with no blocks launches nothing and returns `Ok` (an empty graph has no work; CUDA
/// would reject the launch). The configuration is checked with [`check_launch_config`] first.
/// The launch is asynchronous: faults inside the kernel surface at the next synchronising call
/// (e.g. [`Gpu::synchronize`] or a download).
///
/// # Safety
///
/// As for cudarc's `LaunchArgs::launch`: the arguments pushed must match the kernel's
/// parameters in number, order and type, every buffer passed must belong to the same [`Gpu`]
/// as the builder's stream (check with [`check_same_gpu`]), and the kernel must read and write
/// only within the buffers' lengths for the sizes passed — the caller's `// SAFETY:` comment
/// should say which lengths the kernel touches.
pub(crate) unsafe fn launch(
    kernel: &'static str,
    args: &mut LaunchArgs<'_>,
    cfg: LaunchConfig,
) -> Result<()> {
    if is_empty_grid(&cfg) {
        return Ok(());
    }
    check_launch_config(&cfg)?;
    // SAFETY: forwarded to the caller (see `# Safety`).
    unsafe { args.launch(cfg) }
        .map(|_| ())
        .map_err(|e| map_driver_error(kernel, e))
}

/// The kernel `name` of `module`, as the `&'static str` the module lists (launch errors name
/// it), or [`Error::KernelNotFound`]. Wrappers build the name from the dtype and variant they
/// chose (`format!("spmm_csr_{}_v{vec}", T::NAME)`) and look it up here.
pub(crate) fn kernel_named(
    module: &spattn_kernels_sys::PtxModule,
    name: String,
) -> Result<&'static str> {
    module
        .kernels
        .iter()
        .copied()
        .find(|k| *k == name)
        .ok_or(Error::KernelNotFound {
            module: module.name,
            kernel: name,
        })
}

/// Checks that `len` is `heads × n` (`n` slots, edges or rows), naming `what`.
pub(crate) fn check_per_edge(what: &'static str, n: usize, heads: usize, len: usize) -> Result<()> {
    if heads == 0 {
        return Err(Error::InvalidArgument {
            what: "heads",
            why: "must be at least 1".into(),
        });
    }
    let expected = n.checked_mul(heads).ok_or(Error::TooLarge {
        what,
        value: n as u64,
        limit: (usize::MAX / heads) as u64,
    })?;
    if len != expected {
        return Err(Error::LengthMismatch {
            what,
            expected,
            actual: len,
        });
    }
    Ok(())
}

/// Device data that belongs to one [`Gpu`] handle.
pub trait OnGpu {
    /// The handle the data was allocated with.
    fn gpu(&self) -> &Gpu;
}

impl OnGpu for Gpu {
    fn gpu(&self) -> &Gpu {
        self
    }
}

/// Checks that `operand` belongs to `gpu` (the handle running the op, or a clone of it);
/// otherwise [`Error::ForeignGpu`] naming `what`.
///
/// Buffers of another handle — another device, or another `Gpu::new` on the same device —
/// run on another stream, and the stream is what orders their uses (see [`crate::gpu`]).
pub(crate) fn check_same_gpu(
    gpu: &Gpu,
    what: &'static str,
    operand: &(impl OnGpu + ?Sized),
) -> Result<()> {
    if gpu.same_as(operand.gpu()) {
        Ok(())
    } else {
        Err(Error::ForeignGpu { what })
    }
}

/// A sparse matrix on the GPU as the op wrappers check their other operands against it.
pub(crate) trait SparseOperand: OnGpu {
    /// Rows and columns of the matrix.
    fn dims(&self) -> (usize, usize);
    /// Values a head of its per-edge arrays (edges, or slots of a blocked layout).
    fn per_head(&self) -> usize;
}

/// The op whose operands [`check_operands`] checks.
#[derive(Clone, Copy)]
pub(crate) enum Op {
    /// `x` = Q with A's rows, `y` = K with its columns, the values are the scores.
    Sddmm,
    /// `x` = V with A's columns, `y` = the output with its rows, the values are the
    /// probabilities.
    Spmm,
}

/// The operand checks of `op` on `a`: `x` fixes the shape and has its rows, `y` has the same
/// heads and head_dim and its rows, `values` holds `a.per_head() × heads`; then every operand
/// is on `gpu`, in that order. Returns `x`'s shape.
pub(crate) fn check_operands<T: DType>(
    gpu: &Gpu,
    a: &impl SparseOperand,
    op: Op,
    [x, y]: [&DeviceMatrix<T>; 2],
    values: &DeviceVec<f32>,
) -> Result<Shape> {
    let (rows, cols) = a.dims();
    let ((x_name, x_rows), (y_name, y_rows), values_name) = match op {
        Op::Sddmm => (("Q", rows), ("K", cols), "scores"),
        Op::Spmm => (("V", cols), ("out", rows), "probabilities"),
    };
    let shape = x.shape();
    shape.expect_rows_like(x_name, shape, x_rows)?;
    shape.expect_rows_like(y_name, y.shape(), y_rows)?;
    check_per_edge(values_name, a.per_head(), shape.heads, values.len())?;
    for (what, on) in [("A", a.gpu()), (x_name, x.gpu()), (y_name, y.gpu())] {
        check_same_gpu(gpu, what, on)?;
    }
    check_same_gpu(gpu, values_name, values.gpu())?;
    Ok(shape)
}

/// One edge-softmax launch's operands as its kernels take them: the scores and output device
/// pointers (the same in place), the heads, and LeakyReLU as a flag and a slope.
pub(crate) struct SoftmaxArgs {
    pub(crate) scores: u64,
    pub(crate) out: u64,
    pub(crate) heads: usize,
    /// 1: LeakyReLU(scores, slope) before the softmax; 0: the scores as they are.
    pub(crate) leaky: i32,
    pub(crate) slope: f32,
}

impl SoftmaxArgs {
    fn new(scores: u64, out: u64, heads: usize, leaky_relu: Option<f32>) -> Self {
        Self {
            scores,
            out,
            heads,
            leaky: i32::from(leaky_relu.is_some()),
            slope: leaky_relu.unwrap_or(0.0),
        }
    }
}

/// The operand checks and device pointers of an edge softmax out of place: `scores` and `out`
/// hold `n × heads` values (`n`: edges or slots) on `gpu`; `launch` runs with both pointers
/// valid (their buffers borrowed) until it returns.
pub(crate) fn softmax_out_of_place(
    gpu: &Gpu,
    n: usize,
    heads: usize,
    leaky_relu: Option<f32>,
    scores: &DeviceVec<f32>,
    out: &mut DeviceVec<f32>,
    launch: impl FnOnce(SoftmaxArgs) -> Result<()>,
) -> Result<()> {
    check_per_edge("scores", n, heads, scores.len())?;
    check_per_edge("probabilities", n, heads, out.len())?;
    check_same_gpu(gpu, "scores", scores.gpu())?;
    check_same_gpu(gpu, "probabilities", out.gpu())?;
    let stream = gpu.stream().clone();
    let (s_ptr, _s) = scores.slice().device_ptr(&stream);
    let (o_ptr, _o) = out.slice_mut().device_ptr_mut(&stream);
    launch(SoftmaxArgs::new(s_ptr, o_ptr, heads, leaky_relu))
}

/// [`softmax_out_of_place`] in place: the output pointer is the scores'.
pub(crate) fn softmax_in_place(
    gpu: &Gpu,
    n: usize,
    heads: usize,
    leaky_relu: Option<f32>,
    scores: &mut DeviceVec<f32>,
    launch: impl FnOnce(SoftmaxArgs) -> Result<()>,
) -> Result<()> {
    check_per_edge("scores", n, heads, scores.len())?;
    check_same_gpu(gpu, "scores", scores.gpu())?;
    let stream = gpu.stream().clone();
    let (ptr, _g) = scores.slice_mut().device_ptr_mut(&stream);
    launch(SoftmaxArgs::new(ptr, ptr, heads, leaky_relu))
}

/// The public `edge_softmax_in_place` of an op family over device format `$format` whose score
/// arrays hold `$n` values a head (`$a` names the format in `$n`), through the module's
/// `softmax_launch(gpu, a, SoftmaxArgs)`, with the doc comment written before `in_place`.
macro_rules! edge_softmax_fns {
    (
        $format:ty, |$a:ident| $n:expr;
        $(#[$in_doc:meta])* in_place;
    ) => {
        $(#[$in_doc])*
        pub fn edge_softmax_in_place(
            gpu: &Gpu,
            a: &$format,
            scores: &mut DeviceVec<f32>,
            heads: usize,
            leaky_relu: Option<f32>,
        ) -> Result<()> {
            let $a = a;
            $crate::launch::softmax_in_place(gpu, $n, heads, leaky_relu, scores, |x| {
                softmax_launch(gpu, a, x)
            })
        }
    };
}
pub(crate) use edge_softmax_fns;

/// The device address of an optional buffer (0 = the kernel's null), with the guard that keeps
/// the stream ordering alive for the launch.
pub(crate) fn opt_ptr<T: DeviceElement>(
    gpu: &Gpu,
    what: &'static str,
    v: Option<&DeviceVec<T>>,
) -> Result<u64> {
    match v {
        None => Ok(0),
        Some(v) => {
            check_same_gpu(gpu, what, v)?;
            let stream = gpu.stream().clone();
            let (p, _guard) = v.slice().device_ptr(&stream);
            Ok(p)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn to_u32_example() -> std::result::Result<(), Box<dyn std::error::Error>> {
        use crate::launch::to_u32;
        assert_eq!(to_u32("nnz", 7)?, 7);
        assert!(to_u32("nnz", 1 << 40).is_err());
        Ok(())
    }

    #[test]
    fn blocks_for_example() -> std::result::Result<(), Box<dyn std::error::Error>> {
        use crate::launch::blocks_for;
        assert_eq!(blocks_for(1000, 256)?, 4);
        assert_eq!(blocks_for(0, 256)?, 0);
        Ok(())
    }

    #[test]
    fn blocks_round_up_and_respect_the_grid_limit() {
        assert_eq!(blocks_for(1, 256).unwrap(), 1);
        assert_eq!(blocks_for(256, 256).unwrap(), 1);
        assert_eq!(blocks_for(257, 256).unwrap(), 2);
        assert_eq!(blocks_for(MAX_GRID_X as usize, 1).unwrap(), MAX_GRID_X);
        assert!(matches!(
            blocks_for(MAX_GRID_X as usize + 1, 1),
            Err(Error::TooLarge { .. })
        ));
        assert!(matches!(
            blocks_for(usize::MAX, 1024),
            Err(Error::TooLarge { .. })
        ));
        assert!(matches!(
            blocks_for(10, 0),
            Err(Error::InvalidArgument { .. })
        ));
    }

    #[test]
    fn configs_are_checked() {
        let cfg = grid_1d(1000, 128).unwrap();
        assert_eq!(cfg.grid_dim, (8, 1, 1));
        assert_eq!(cfg.block_dim, (128, 1, 1));
        check_launch_config(&cfg).unwrap();
        assert!(grid_1d(10, 0).is_err());
        assert!(grid_1d(10, 2048).is_err());
        assert!(is_empty_grid(&grid_1d(0, 128).unwrap()));
        let mut bad = cfg;
        bad.grid_dim = (1, 70_000, 1);
        assert!(check_launch_config(&bad).is_err());
        bad = cfg;
        bad.block_dim = (32, 32, 2);
        assert!(check_launch_config(&bad).is_err());
        bad.block_dim = (1, 1, 65);
        assert!(check_launch_config(&bad).is_err());
    }

    #[test]
    fn per_edge_lengths() {
        assert!(check_per_edge("x", 5, 2, 10).is_ok());
        assert!(matches!(
            check_per_edge("x", 5, 2, 9),
            Err(Error::LengthMismatch { what: "x", .. })
        ));
        assert!(matches!(
            check_per_edge("x", 5, 0, 0),
            Err(Error::InvalidArgument { .. })
        ));
    }
}
