//! Host memory handed over by the Python package as (address, length): CPU torch tensors and
//! numpy arrays, already checked there to be contiguous, of the dtype named, with that many
//! elements, alive for the whole call, and (for outputs) freshly allocated, so distinct from
//! every input.

use pyo3::PyResult;

use crate::errors::value_error;

/// The element types of the CPU path (the reference ops compute in f32 or f64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HostDType {
    F32,
    F64,
}

/// The run-time dtype names the package passes: `"f32"`, `"f16"`, `"bf16"`, `"f64"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DTypeName {
    /// One of the GPU kernels' types.
    Device(spattn::DTypeKind),
    /// f64: the CPU path only.
    F64,
}

impl DTypeName {
    pub(crate) fn parse(dtype: &str) -> PyResult<Self> {
        match dtype {
            "f64" => Ok(DTypeName::F64),
            other => other.parse().map(DTypeName::Device).map_err(|_| {
                pyo3::exceptions::PyTypeError::new_err(format!(
                    "dtype: unsupported element type {other:?} (f32, f16, bf16; f64 on the CPU)"
                ))
            }),
        }
    }

    /// The CPU path's type: f32 and f64 run as is; f16 and bf16 are widened by the package
    /// before the call, so they are an error here.
    pub(crate) fn host(self) -> PyResult<HostDType> {
        match self {
            DTypeName::F64 => Ok(HostDType::F64),
            DTypeName::Device(spattn::DTypeKind::F32) => Ok(HostDType::F32),
            DTypeName::Device(k) => Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "dtype: the CPU path computes in f32 or f64, not {k} (convert first)"
            ))),
        }
    }

    /// The GPU kernels' type (f64 is an error).
    pub(crate) fn device(self) -> PyResult<spattn::DTypeKind> {
        match self {
            DTypeName::Device(k) => Ok(k),
            DTypeName::F64 => Err(pyo3::exceptions::PyTypeError::new_err(
                "dtype: float64 runs on the CPU only; on CUDA use float32, float16 or bfloat16",
            )),
        }
    }
}

/// Checks a host address for `len` elements of `F`: non-null and aligned (the package passes
/// `data_ptr()` of contiguous tensors, which always are, except for an empty tensor).
fn check<F>(what: &str, ptr: u64, len: usize) -> PyResult<()> {
    if len == 0 {
        return Ok(());
    }
    if ptr == 0 {
        return Err(value_error(what, "null data pointer"));
    }
    if ptr % std::mem::align_of::<F>() as u64 != 0 {
        return Err(value_error(
            what,
            format!(
                "data pointer {ptr:#x} is not aligned to its {}-byte elements",
                std::mem::align_of::<F>()
            ),
        ));
    }
    len.checked_mul(std::mem::size_of::<F>())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| value_error(what, format!("{len} elements overflow the address space")))?;
    Ok(())
}

/// `len` elements of `F` at `ptr`, read-only.
///
/// # Safety
/// `ptr` addresses `len` initialised elements of `F` that stay alive and unwritten for `'a`
/// (the package's contract, see the module documentation).
pub(crate) unsafe fn slice<'a, F>(what: &str, ptr: u64, len: usize) -> PyResult<&'a [F]> {
    check::<F>(what, ptr, len)?;
    if len == 0 {
        return Ok(&[]);
    }
    // SAFETY: non-null and aligned (checked), `len` elements alive and not written for 'a
    // (the caller's contract); the byte size fits isize (checked).
    Ok(unsafe { std::slice::from_raw_parts(ptr as *const F, len) })
}

/// `len` elements of `F` at `ptr`, writable.
///
/// # Safety
/// `ptr` addresses `len` elements of `F` that stay alive for `'a` and that nothing else reads
/// or writes for `'a` (a fresh output of the package, distinct from every input).
pub(crate) unsafe fn slice_mut<'a, F>(what: &str, ptr: u64, len: usize) -> PyResult<&'a mut [F]> {
    check::<F>(what, ptr, len)?;
    if len == 0 {
        return Ok(&mut []);
    }
    // SAFETY: non-null and aligned (checked), `len` elements alive and not aliased for 'a
    // (the caller's contract); the byte size fits isize (checked). Any bit pattern is a valid
    // f32 / f64, so the memory needs no initialisation.
    Ok(unsafe { std::slice::from_raw_parts_mut(ptr as *mut F, len) })
}
