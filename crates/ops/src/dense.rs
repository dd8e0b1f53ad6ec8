//! Dense matrix products of the layers (projections `Y = X·W + b` and their gradients) on the
//! GPU through cuBLAS, and the same on the CPU.
//!
//! Matrices are row-major, as every dense operand of this crate: a [`DeviceMatrix`] of shape
//! `rows × heads × head_dim` is, for a GEMM, a `rows × (heads·head_dim)` matrix ([`Dims`]).
//! cuBLAS is column-major; a row-major `C = op(A)·op(B)` is the column-major
//! `Cᵀ = op(B)ᵀ·op(A)ᵀ`, and a row-major buffer read column-major *is* its transpose, so
//! [`gemm`] swaps the operands and passes each buffer as it is (leading dimension = its row
//! length) — no copy, no transpose kernel.
//!
//! libcublas is loaded at run time (cudarc's `dynamic-loading`), only when [`Blas::new`] is
//! called: everything else in the crate works without it, and a machine without it gets
//! [`Error::NoCublas`] instead of a panic. cudarc's bindings are those of CUDA 12.4; the symbols
//! used here (`cublasCreate_v2`, `cublasSetStream_v2`, `cublasGemmEx`, `cublasDestroy_v2`) have
//! the same signatures in cuBLAS 12 and 13, so either works (the loader tries `libcublas.so`,
//! then `libcublas.so.12`, …; see the README for `LD_LIBRARY_PATH`).
//!
//! Numerics: f32 operands run as true SGEMM (`CUBLAS_COMPUTE_32F`, no TF32: cuBLAS's default
//! math mode); f16 / bf16 operands through `cublasGemmEx` with f32 accumulation. The output
//! type may differ from the operands' (weight gradients of f16 layers are f32).
//!
//! ```no_run
//! use spattn_ops::{gemm, Blas, Dims};
//! use spattn_ops::{DeviceVec, Gpu};
//! let gpu = Gpu::new(0)?;
//! let blas = Blas::new(&gpu)?;
//! let x = DeviceVec::from_host(&gpu, &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?; // 2 x 3
//! let w = DeviceVec::from_host(&gpu, &[1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0])?; // 3 x 2
//! let mut y = DeviceVec::<f32>::zeros(&gpu, 4)?; // 2 x 2
//! gemm(&blas, 1.0, (&x, Dims::new(2, 3), false), (&w, Dims::new(3, 2), false), 0.0,
//!      (&mut y, Dims::new(2, 2)))?;
//! assert_eq!(y.to_host()?, vec![4.0, 5.0, 10.0, 11.0]);
//! # Ok::<(), spattn_ops::Error>(())
//! ```

use std::ffi::c_void;

use cudarc::cublas::result::{self as blas_result, CublasError};
use cudarc::cublas::sys::{self as blas_sys, cublasOperation_t, cudaDataType_t};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use rayon::prelude::*;

use crate::buffer::DeviceMatrix;
use crate::buffer::{DeviceElement, DeviceVec};
use crate::cpu::Real;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{check_same_gpu, map_driver_error, OnGpu};

/// A device buffer that the dense ops read as a flat row-major matrix: a [`DeviceVec`] or a
/// [`DeviceMatrix`] (whose `rows × heads × head_dim` is `rows × (heads·head_dim)` here).
pub trait DenseBuffer<T>: OnGpu {
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether there are no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The cudarc slice (at least `len` elements).
    fn slice(&self) -> &cudarc::driver::CudaSlice<T>;
    /// The cudarc slice, mutably.
    fn slice_mut(&mut self) -> &mut cudarc::driver::CudaSlice<T>;
}

impl<T: DeviceElement> DenseBuffer<T> for DeviceVec<T> {
    fn len(&self) -> usize {
        DeviceVec::len(self)
    }
    fn slice(&self) -> &cudarc::driver::CudaSlice<T> {
        DeviceVec::slice(self)
    }
    fn slice_mut(&mut self) -> &mut cudarc::driver::CudaSlice<T> {
        DeviceVec::slice_mut(self)
    }
}

impl<T: DType> DenseBuffer<T> for DeviceMatrix<T> {
    fn len(&self) -> usize {
        DeviceMatrix::len(self)
    }
    fn slice(&self) -> &cudarc::driver::CudaSlice<T> {
        DeviceMatrix::slice(self)
    }
    fn slice_mut(&mut self) -> &mut cudarc::driver::CudaSlice<T> {
        DeviceMatrix::slice_mut(self)
    }
}

/// The dimensions of a row-major matrix: `rows × cols`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Dims {
    /// Number of rows.
    pub rows: usize,
    /// Number of columns (the row length).
    pub cols: usize,
}

impl Dims {
    /// `rows × cols`.
    pub const fn new(rows: usize, cols: usize) -> Self {
        Self { rows, cols }
    }

    /// The dimensions after an optional transpose.
    pub const fn op(self, transpose: bool) -> Self {
        if transpose {
            Self::new(self.cols, self.rows)
        } else {
            self
        }
    }

    /// Whether the matrix has no elements.
    pub const fn is_empty(self) -> bool {
        self.rows == 0 || self.cols == 0
    }

    /// Number of elements, or [`Error::TooLarge`] when it overflows.
    pub fn len(self) -> Result<usize> {
        self.rows.checked_mul(self.cols).ok_or(Error::TooLarge {
            what: "matrix elements",
            value: self.rows as u64,
            limit: (usize::MAX / self.cols.max(1)) as u64,
        })
    }
}

/// The checked sizes of `C (m × n) = op(A) (m × k) · op(B) (k × n)`.
struct GemmDims {
    m: usize,
    n: usize,
    k: usize,
}

/// Checks the three operands' dimensions and buffer lengths, naming the one that is wrong.
fn check_gemm(
    a: (usize, Dims, bool),
    b: (usize, Dims, bool),
    c: (usize, Dims),
) -> Result<GemmDims> {
    let (op_a, op_b) = (a.1.op(a.2), b.1.op(b.2));
    for (what, len, dims) in [("A", a.0, a.1), ("B", b.0, b.1), ("C", c.0, c.1)] {
        let expected = dims.len()?;
        if len != expected {
            return Err(Error::LengthMismatch {
                what,
                expected,
                actual: len,
            });
        }
    }
    if op_b.rows != op_a.cols {
        return Err(Error::DimsMismatch {
            what: "op(B)",
            expected: (op_a.cols, op_b.cols),
            actual: (op_b.rows, op_b.cols),
        });
    }
    if c.1 != Dims::new(op_a.rows, op_b.cols) {
        return Err(Error::DimsMismatch {
            what: "C",
            expected: (op_a.rows, op_b.cols),
            actual: (c.1.rows, c.1.cols),
        });
    }
    Ok(GemmDims {
        m: op_a.rows,
        n: op_b.cols,
        k: op_a.cols,
    })
}

/// A cuBLAS handle bound to one [`Gpu`]'s stream: every GEMM it runs is ordered with that
/// handle's kernels, copies and frees.
pub struct Blas {
    gpu: Gpu,
    handle: blas_sys::cublasHandle_t,
}

// SAFETY: a cuBLAS handle may be used from any thread as long as calls on it do not overlap;
// every call below holds `&self` only for the duration of one enqueue, and cuBLAS documents
// handles as thread-safe for enqueueing on their stream when not reconfigured concurrently
// (`Blas` never changes the stream or mode after `new`).
unsafe impl Send for Blas {}
// SAFETY: as for `Send`: the handle is only read (enqueue calls) after construction.
unsafe impl Sync for Blas {}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas")
            .field("gpu", &self.gpu)
            .finish_non_exhaustive()
    }
}

fn cublas_error(during: &'static str) -> impl FnOnce(CublasError) -> Error {
    move |source| Error::Cublas { during, source }
}

impl Blas {
    /// Loads libcublas (once per process), creates a handle and binds it to `gpu`'s stream.
    ///
    /// Errors: [`Error::NoCublas`] where libcublas cannot be loaded (checked first: this never
    /// panics), [`Error::Cublas`] where the handle cannot be created.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        // SAFETY: `is_culib_present` only tries to dlopen libcublas under its usual names and
        // closes what it opened.
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(Error::NoCublas);
        }
        gpu.context()
            .bind_to_thread()
            .map_err(|e| map_driver_error("binding the CUDA context", e))?;
        // cudarc panics where a symbol is missing from the library it loaded: read that as
        // "no usable cuBLAS".
        let handle = std::panic::catch_unwind(blas_result::create_handle)
            .map_err(|_| Error::NoCublas)?
            .map_err(cublas_error("creating the cuBLAS handle"))?;
        let blas = Blas {
            gpu: gpu.clone(),
            handle,
        };
        // SAFETY: the handle was just created and the stream is alive as long as `gpu` (held
        // by `blas`).
        unsafe { blas_result::set_stream(handle, gpu.stream().cu_stream() as _) }
            .map_err(cublas_error("binding cuBLAS to the stream"))?;
        Ok(blas)
    }

    /// The handle whose stream the GEMMs run on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `new` and is destroyed once, here; work enqueued
        // on it stays valid (cuBLAS synchronises the destroy with the handle's stream).
        let _ = unsafe { blas_result::destroy_handle(self.handle) };
    }
}

/// An element type of a GEMM operand or output, with its cuBLAS data type.
pub trait GemmElement: DType {
    /// `CUDA_R_32F`, `CUDA_R_16F` or `CUDA_R_16BF`.
    const CUDA: cudaDataType_t;
}

impl GemmElement for f32 {
    const CUDA: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
}
impl GemmElement for half::f16 {
    const CUDA: cudaDataType_t = cudaDataType_t::CUDA_R_16F;
}
impl GemmElement for half::bf16 {
    const CUDA: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
}

fn to_i32(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::TooLarge {
        what,
        value: v as u64,
        limit: i32::MAX as u64,
    })
}

/// Row-major `C = alpha · op(A) · op(B) + beta · C` on the GPU (cuBLAS GEMM, f32 accumulation).
///
/// `A` and `B` share their element type `T`; `C` may be `T` or another type (f32 gradients of
/// f16 layers). `beta = 1` accumulates into `C`. Errors: [`Error::LengthMismatch`] where a
/// buffer's length is not its dimensions' product, [`Error::DimsMismatch`] where the inner
/// dimensions or `C` do not match, [`Error::ForeignGpu`], [`Error::TooLarge`] for dimensions
/// beyond cuBLAS's 32-bit ints.
pub fn gemm<T, C, A, B, O>(
    blas: &Blas,
    alpha: f32,
    a: (&A, Dims, bool),
    b: (&B, Dims, bool),
    beta: f32,
    c: (&mut O, Dims),
) -> Result<()>
where
    T: GemmElement,
    C: GemmElement,
    A: DenseBuffer<T>,
    B: DenseBuffer<T>,
    O: DenseBuffer<C>,
{
    let gpu = &blas.gpu;
    let d = check_gemm(
        (a.0.len(), a.1, a.2),
        (b.0.len(), b.1, b.2),
        (c.0.len(), c.1),
    )?;
    check_same_gpu(gpu, "A", a.0)?;
    check_same_gpu(gpu, "B", b.0)?;
    check_same_gpu(gpu, "C", &*c.0)?;
    if d.m == 0 || d.n == 0 {
        return Ok(());
    }
    if d.k == 0 {
        // cuBLAS would scale C by beta; do the same without it for the degenerate case.
        return scale_in_place(c.0, beta);
    }
    // Column-major view: Cᵀ (n × m) = op(B)ᵀ (n × k) · op(A)ᵀ (k × m).
    let op = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (m, n, k) = (
        to_i32("GEMM n", d.n)?,
        to_i32("GEMM m", d.m)?,
        to_i32("GEMM k", d.k)?,
    );
    let lda = to_i32("B row length", b.1.cols.max(1))?;
    let ldb = to_i32("A row length", a.1.cols.max(1))?;
    let ldc = to_i32("C row length", c.1.cols.max(1))?;
    gpu.context()
        .bind_to_thread()
        .map_err(|e| map_driver_error("binding the CUDA context", e))?;
    let stream = gpu.stream().clone();
    let (pa, _ga) = a.0.slice().device_ptr(&stream);
    let (pb, _gb) = b.0.slice().device_ptr(&stream);
    let (pc, _gc) = c.0.slice_mut().device_ptr_mut(&stream);
    // SAFETY: the lengths were checked above: A holds a.rows·a.cols elements read with leading
    // dimension a.cols (≥ its column-major row count), B likewise, C holds m·n elements written
    // with leading dimension n; alpha and beta point to live f32 locals, which is what
    // CUBLAS_COMPUTE_32F reads. All three buffers belong to the handle's stream.
    unsafe {
        blas_result::gemm_ex(
            blas.handle,
            op(b.2),
            op(a.2),
            m,
            n,
            k,
            (&alpha as *const f32).cast::<c_void>(),
            pb as *const c_void,
            T::CUDA,
            lda,
            pa as *const c_void,
            T::CUDA,
            ldb,
            (&beta as *const f32).cast::<c_void>(),
            pc as *mut c_void,
            C::CUDA,
            ldc,
            blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(cublas_error("cublasGemmEx"))
}

/// `c *= beta` (the k = 0 GEMM): a fill for 0, a download-scale-upload otherwise (never on a
/// hot path).
fn scale_in_place<C: DType, O: DenseBuffer<C>>(c: &mut O, beta: f32) -> Result<()> {
    if beta == 1.0 || c.is_empty() {
        return Ok(());
    }
    let gpu = c.gpu().clone();
    let mut host = vec![C::from_f32(0.0); c.len()];
    gpu.stream()
        .memcpy_dtoh(&c.slice().slice(..host.len()), &mut host)
        .map_err(|e| map_driver_error("copying device to host", e))?;
    for x in &mut host {
        *x = C::from_f32(x.to_f32() * beta);
    }
    gpu.stream()
        .memcpy_htod(&host, &mut c.slice_mut().slice_mut(..host.len()))
        .map_err(|e| map_driver_error("copying host to device", e))
}

/// Row-major `C = alpha · op(A) · op(B) + beta · C` on the CPU, in `F` (the reference of
/// [`gemm`] and the CPU layers' projections). Rows of `C` run in parallel (rayon).
///
/// Same checks and errors as [`gemm`].
pub fn host_gemm<F: Real>(
    alpha: F,
    a: (&[F], Dims, bool),
    b: (&[F], Dims, bool),
    beta: F,
    c: (&mut [F], Dims),
) -> Result<()> {
    let d = check_gemm(
        (a.0.len(), a.1, a.2),
        (b.0.len(), b.1, b.2),
        (c.0.len(), c.1),
    )?;
    if d.m == 0 || d.n == 0 {
        return Ok(());
    }
    let (ta, tb) = (a.2, b.2);
    let (ac, bc) = (a.1.cols, b.1.cols);
    let at = |i: usize, p: usize| if ta { a.0[p * ac + i] } else { a.0[i * ac + p] };
    let bt = |p: usize, j: usize| if tb { b.0[j * bc + p] } else { b.0[p * bc + j] };
    c.0.par_chunks_mut(d.n).enumerate().for_each(|(i, row)| {
        let mut acc = vec![F::ZERO; d.n];
        for p in 0..d.k {
            let x = at(i, p);
            if x == F::ZERO {
                continue;
            }
            for (j, s) in acc.iter_mut().enumerate() {
                *s = *s + x * bt(p, j);
            }
        }
        for (out, s) in row.iter_mut().zip(acc) {
            *out = if beta == F::ZERO {
                alpha * s
            } else {
                alpha * s + beta * *out
            };
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_gemm_matches_the_definition_with_every_transpose() {
        // A 2 x 3, B 3 x 2.
        let a = [1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [7.0f64, 8.0, 9.0, 10.0, 11.0, 12.0];
        let mut c = [0.0f64; 4];
        host_gemm(
            1.0,
            (&a, Dims::new(2, 3), false),
            (&b, Dims::new(3, 2), false),
            0.0,
            (&mut c, Dims::new(2, 2)),
        )
        .unwrap();
        assert_eq!(c, [58.0, 64.0, 139.0, 154.0]);
        // Aᵀ stored as 3 x 2, Bᵀ stored as 2 x 3: same product, accumulated on top (beta 1).
        let at = [1.0f64, 4.0, 2.0, 5.0, 3.0, 6.0];
        let bt = [7.0f64, 9.0, 11.0, 8.0, 10.0, 12.0];
        host_gemm(
            1.0,
            (&at, Dims::new(3, 2), true),
            (&bt, Dims::new(2, 3), true),
            1.0,
            (&mut c, Dims::new(2, 2)),
        )
        .unwrap();
        assert_eq!(c, [116.0, 128.0, 278.0, 308.0]);
    }

    #[test]
    fn gemm_shapes_are_checked() {
        let a = [0.0f32; 6];
        let mut c = [0.0f32; 4];
        let err = host_gemm(
            1.0,
            (&a, Dims::new(2, 3), false),
            (&a, Dims::new(2, 3), false),
            0.0,
            (&mut c, Dims::new(2, 2)),
        )
        .unwrap_err();
        assert!(matches!(err, Error::DimsMismatch { what: "op(B)", .. }));
        let err = host_gemm(
            1.0,
            (&a[..5], Dims::new(2, 3), false),
            (&a, Dims::new(3, 2), false),
            0.0,
            (&mut c, Dims::new(2, 2)),
        )
        .unwrap_err();
        assert!(matches!(err, Error::LengthMismatch { what: "A", .. }));
        let err = host_gemm(
            1.0,
            (&a, Dims::new(2, 3), false),
            (&a, Dims::new(3, 2), false),
            0.0,
            (&mut c[..3], Dims::new(3, 1)),
        )
        .unwrap_err();
        assert!(matches!(err, Error::DimsMismatch { what: "C", .. }));
    }
}
