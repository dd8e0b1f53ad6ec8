//! Typed device buffers: [`DeviceVec`] (one-dimensional: per-edge scores, index arrays) and
//! [`DeviceMatrix`] (a [`DeviceVec`] with a [`Shape`]: Q, K, V, out).
//!
//! Two types rather than one: per-edge data (`nnz × heads` scores, CSR arrays of `u32`) has no
//! `rows × heads × head_dim` shape, and forcing one on it would make every shape check
//! meaningless. A matrix is a vector plus a shape checked against its length, so the two share
//! all their code and convert freely ([`DeviceMatrix::from_vec`], [`DeviceMatrix::into_vec`]).
//!
//! Every buffer keeps the [`Gpu`] it was allocated with; copies and fills run on that handle's
//! stream, in order with its launches.
//!
//! CUDA refuses zero-byte allocations, so an empty buffer still allocates one element: the
//! cudarc slice behind a buffer ([`DeviceVec::slice`]) may be longer than [`DeviceVec::len`].
//! Kernels take their sizes as arguments and never read the spare element.

use std::sync::{Mutex, MutexGuard, PoisonError};

use cudarc::driver::sys;
use cudarc::driver::{CudaSlice, DevicePtrMut, DriverError};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{map_driver_error, OnGpu};
use crate::shape::Shape;

mod sealed {
    use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

    /// Keeps [`DeviceElement`](super::DeviceElement) closed, and what it needs of cudarc and
    /// bytemuck (a type the driver copies, valid as zero bits, plain old data) out of the
    /// crate's API.
    pub trait Element: DeviceRepr + ValidAsZeroBits + bytemuck::Pod {}
    impl Element for u8 {}
    impl Element for u16 {}
    impl Element for u32 {}
    impl Element for u64 {}
    impl Element for usize {}
    impl Element for i8 {}
    impl Element for i16 {}
    impl Element for i32 {}
    impl Element for i64 {}
    impl Element for isize {}
    impl Element for f32 {}
    impl Element for f64 {}
    impl Element for half::f16 {}
    impl Element for half::bf16 {}
}

/// An element a [`DeviceVec`] can hold: the integers, `f32`, `f64`, [`f16`](crate::f16) and
/// [`bf16`](crate::bf16). Sealed.
pub trait DeviceElement: sealed::Element + Send + Sync + std::fmt::Debug + 'static {}

impl<T: sealed::Element + Send + Sync + std::fmt::Debug + 'static> DeviceElement for T {}

/// Maps an allocation failure: out of memory becomes [`Error::OutOfMemory`] with the size.
fn alloc_error(what: &'static str, bytes: usize) -> impl FnOnce(DriverError) -> Error {
    move |e| match e.0 {
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory { what, bytes },
        _ => map_driver_error(what, e),
    }
}

pub(crate) fn expect_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(Error::LengthMismatch {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// A one-dimensional typed buffer in device memory, on one [`Gpu`].
#[derive(Debug)]
pub struct DeviceVec<T: DeviceElement> {
    gpu: Gpu,
    /// At least `max(len, 1)` elements (see the module documentation).
    data: CudaSlice<T>,
    len: usize,
}

/// The workspace buffer in `slot`, first replaced by a zeroed one of `len` elements if it is
/// missing or shorter (grow on demand: a buffer is only ever replaced whole).
pub(crate) fn grown<'a, T: DeviceElement>(
    gpu: &Gpu,
    slot: &'a mut Option<DeviceVec<T>>,
    what: &'static str,
    len: usize,
) -> Result<&'a mut DeviceVec<T>> {
    match slot {
        Some(b) if b.len() >= len => {}
        _ => *slot = Some(DeviceVec::alloc(gpu, what, len, true)?),
    }
    // Both arms above leave `slot` set.
    slot.as_mut().ok_or(Error::InvalidArgument {
        what,
        why: "workspace not allocated".into(),
    })
}

/// An f32 workspace of a schedule's launches ([`grown`] on demand, only ever replaced whole),
/// shared by the launches on one uploaded graph.
#[derive(Debug, Default)]
pub(crate) struct Scratch(Mutex<Option<DeviceVec<f32>>>);

impl Scratch {
    /// The workspace, locked for one launch.
    pub(crate) fn lock(&self) -> MutexGuard<'_, Option<DeviceVec<f32>>> {
        // Only ever replaced whole, so a panic elsewhere cannot leave it half-built.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes of device memory it holds (0 if a panic poisoned its lock).
    pub(crate) fn num_bytes(&self) -> usize {
        self.0
            .lock()
            .map(|s| s.as_ref().map_or(0, DeviceVec::num_bytes))
            .unwrap_or(0)
    }
}

/// The bytes of `len` elements of `T`, or [`Error::TooLarge`] naming `what` where that
/// overflows.
pub(crate) fn byte_len<T>(what: &'static str, len: usize) -> Result<usize> {
    let size = std::mem::size_of::<T>().max(1);
    len.checked_mul(size).ok_or(Error::TooLarge {
        what,
        value: len as u64,
        limit: (usize::MAX / size) as u64,
    })
}

impl<T: DeviceElement> DeviceVec<T> {
    /// Allocates `len` elements; zeroed when `zeroed`, else left unset for the caller to
    /// overwrite before anything reads them.
    pub(crate) fn alloc(gpu: &Gpu, what: &'static str, len: usize, zeroed: bool) -> Result<Self> {
        let bytes = byte_len::<T>(what, len)?;
        let stream = gpu.stream();
        let slots = len.max(1);
        let data = if zeroed || len == 0 {
            stream.alloc_zeros::<T>(slots)
        } else {
            // SAFETY: the memory is left unset. Every element type is plain bits (any pattern
            // is a valid `T`), so reading it before a write gives unspecified values, never
            // undefined behaviour; `unset` says so, and its other callers (`from_host_named`,
            // `try_clone`) overwrite every element before returning.
            unsafe { stream.alloc::<T>(slots) }
        }
        .map_err(alloc_error(what, bytes))?;
        Ok(DeviceVec {
            gpu: gpu.clone(),
            data,
            len,
        })
    }

    pub(crate) fn from_host_named(gpu: &Gpu, what: &'static str, host: &[T]) -> Result<Self> {
        let mut vec = Self::alloc(gpu, what, host.len(), false)?;
        vec.copy_from_host(host)?;
        Ok(vec)
    }

    /// Uploads `host` to a new buffer on `gpu`.
    pub fn from_host(gpu: &Gpu, host: &[T]) -> Result<Self> {
        Self::from_host_named(gpu, "device vector", host)
    }

    /// A buffer of `len` zeros on `gpu`.
    pub fn zeros(gpu: &Gpu, len: usize) -> Result<Self> {
        Self::alloc(gpu, "device vector", len, true)
    }

    /// A buffer of `len` elements on `gpu` whose values are unspecified (whatever the memory
    /// pool held): for a buffer the caller overwrites whole before reading it, which saves
    /// [`zeros`](Self::zeros)' pass over the memory.
    pub fn unset(gpu: &Gpu, len: usize) -> Result<Self> {
        Self::alloc(gpu, "device vector", len, false)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size of the elements in bytes (`len × size_of::<T>()`).
    pub(crate) fn num_bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The handle the buffer was allocated with.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Bytes of device memory the buffer's allocation holds: [`num_bytes`](Self::num_bytes),
    /// or more for a buffer sized by an upper bound and cut to its length on the device
    /// (a graph built on the GPU), or the one element of an empty buffer.
    pub(crate) fn allocated_bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<T>()
    }

    /// The cudarc slice, to pass to a kernel (`args.arg(v.slice())`). It holds at least
    /// [`len`](Self::len) elements, and one when the buffer is empty.
    pub fn slice(&self) -> &CudaSlice<T> {
        &self.data
    }

    /// The cudarc slice, mutably, to pass to a kernel that writes it.
    pub fn slice_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.data
    }

    /// Downloads the elements. Waits for all work submitted to the stream before it.
    pub fn to_host(&self) -> Result<Vec<T>> {
        let mut host = vec![T::zeroed(); self.len];
        self.copy_to_host(&mut host)?;
        Ok(host)
    }

    /// Downloads into `host`, which must hold exactly [`len`](Self::len) elements.
    pub(crate) fn copy_to_host(&self, host: &mut [T]) -> Result<()> {
        expect_len("host buffer", self.len, host.len())?;
        if self.len == 0 {
            return Ok(());
        }
        let stream = self.gpu.stream();
        // A copy into pageable memory returns once the data has arrived. The slice may be
        // longer than `len` (an empty or truncated buffer): copy `len`.
        stream
            .memcpy_dtoh(&self.data.slice(..self.len), host)
            .map_err(|e| map_driver_error("copying device to host", e))
    }

    /// Overwrites the elements with `host`, which must hold exactly [`len`](Self::len).
    pub fn copy_from_host(&mut self, host: &[T]) -> Result<()> {
        expect_len("host data", self.len, host.len())?;
        if self.len == 0 {
            return Ok(());
        }
        let stream = self.gpu.stream();
        let len = self.len;
        // A copy from pageable memory returns once `host` has been staged, so `host` may be
        // dropped right after; the device side stays ordered on the stream.
        stream
            .memcpy_htod(host, &mut self.data.slice_mut(..len))
            .map_err(|e| map_driver_error("copying host to device", e))
    }

    /// Overwrites elements `at..at + host.len()` with `host` and leaves the others alone.
    ///
    /// Errors: [`Error::InvalidArgument`] when that range ends past [`len`](Self::len); the
    /// driver's.
    pub fn copy_from_host_at(&mut self, at: usize, host: &[T]) -> Result<()> {
        let end = at.checked_add(host.len()).filter(|&e| e <= self.len);
        let Some(end) = end else {
            return Err(Error::InvalidArgument {
                what: "host data",
                why: format!(
                    "{} elements at offset {at} end past the buffer's {} elements",
                    host.len(),
                    self.len
                ),
            });
        };
        if host.is_empty() {
            return Ok(());
        }
        let stream = self.gpu.stream();
        let mut view = self.data.slice_mut(at..end);
        // As copy_from_host: `host` is staged before the call returns.
        stream
            .memcpy_htod(host, &mut view)
            .map_err(|e| map_driver_error("copying host to device", e))
    }

    /// A device-to-device copy on the same handle.
    pub fn try_clone(&self) -> Result<Self> {
        let mut copy = Self::alloc(&self.gpu, "device vector copy", self.len, self.len == 0)?;
        if self.len > 0 {
            let stream = self.gpu.stream();
            stream
                .memcpy_dtod(&self.data.slice(..self.len), &mut copy.data)
                .map_err(|e| map_driver_error("copying device to device", e))?;
        }
        Ok(copy)
    }

    /// Overwrites the elements with `src`'s (a device-to-device copy on the stream), which
    /// must be as long and on the same handle.
    pub fn copy_from(&mut self, src: &DeviceVec<T>) -> Result<()> {
        expect_len("source", self.len, src.len)?;
        if !self.gpu.same_as(&src.gpu) {
            return Err(Error::ForeignGpu { what: "source" });
        }
        if self.len == 0 {
            return Ok(());
        }
        let len = self.len;
        self.gpu
            .stream()
            .memcpy_dtod(&src.data.slice(..len), &mut self.data.slice_mut(..len))
            .map_err(|e| map_driver_error("copying device to device", e))
    }

    /// Sets every element to `value`, asynchronously on the stream.
    ///
    /// A `cuMemsetD32/D16/D8Async` where `value`'s bytes are one repeated 4-, 2- or 1-byte word
    /// (any 4- or 2-byte type qualifies); otherwise an upload of `len` copies of `value`.
    pub fn fill(&mut self, value: T) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let bytes = bytemuck::bytes_of(&value);
        let Some(word) = MemsetWord::of(bytes) else {
            return self.copy_from_host(&vec![value; self.len]);
        };
        let count = self.num_bytes() / word.width();
        let stream = self.gpu.stream().clone();
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| map_driver_error("binding the CUDA context", e))?;
        let (ptr, _record) = self.data.device_ptr_mut(&stream);
        let cu_stream = stream.cu_stream();
        // SAFETY: `ptr` is the start of this buffer's live allocation of at least `len`
        // elements, borrowed mutably so nothing else writes it; `count` words of
        // `word.width()` bytes cover exactly `len × size_of::<T>()` bytes. The memset is
        // enqueued on the stream the allocation belongs to, so it is ordered after earlier
        // work and before the (stream-ordered) free. The bytes written are `value`'s, a valid
        // `T` because `T: Pod`.
        let status = unsafe {
            match word {
                MemsetWord::W32(w) => sys::cuMemsetD32Async(ptr, w, count, cu_stream),
                MemsetWord::W16(w) => sys::cuMemsetD16Async(ptr, w, count, cu_stream),
                MemsetWord::W8(w) => sys::cuMemsetD8Async(ptr, w, count, cu_stream),
            }
        };
        status
            .result()
            .map_err(|e| map_driver_error("filling device memory", e))
    }
}

impl<T: DeviceElement> DeviceVec<T> {
    /// A buffer over a cudarc slice of `gpu`'s stream holding at least `len` elements: the
    /// views of [`crate::external`], which hand the slice back with [`into_slice`](Self::into_slice)
    /// and leak it instead of freeing memory they do not own.
    pub(crate) fn from_slice_parts(gpu: &Gpu, data: CudaSlice<T>, len: usize) -> Self {
        debug_assert!(data.len() >= len.max(1));
        DeviceVec {
            gpu: gpu.clone(),
            data,
            len,
        }
    }

    /// Shortens the buffer to its first `len` elements, keeping the allocation (a buffer sized
    /// by an upper bound on the device, cut to the size read back). The spare elements stay
    /// allocated, never read: kernels take their sizes from [`len`](Self::len).
    ///
    /// Errors: [`Error::InvalidArgument`] for a `len` past the current length.
    pub(crate) fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::InvalidArgument {
                what: "buffer length",
                why: format!("cannot grow {} elements to {len} by truncating", self.len),
            });
        }
        self.len = len;
        Ok(())
    }

    /// The cudarc slice behind the buffer, giving the buffer up.
    pub(crate) fn into_slice(self) -> CudaSlice<T> {
        self.data
    }
}

impl<T: DeviceElement + DType> DeviceVec<T> {
    /// Sets every element to the canonical NaN of `T` (poisons an output before a launch, so
    /// an element the kernel fails to write cannot pass a test).
    pub fn fill_nan(&mut self) -> Result<()> {
        self.fill(T::nan())
    }
}

impl<T: DeviceElement> OnGpu for DeviceVec<T> {
    fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

/// The word a memset repeats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MemsetWord {
    W32(u32),
    W16(u16),
    W8(u8),
}

impl MemsetWord {
    /// The widest word whose repetition gives `bytes`, if any.
    fn of(bytes: &[u8]) -> Option<MemsetWord> {
        fn repeats<const N: usize>(bytes: &[u8]) -> Option<[u8; N]> {
            if bytes.is_empty() || bytes.len() % N != 0 {
                return None;
            }
            let first: [u8; N] = bytes[..N].try_into().ok()?;
            bytes.chunks_exact(N).all(|c| c == first).then_some(first)
        }
        if let Some(w) = repeats::<4>(bytes) {
            Some(MemsetWord::W32(u32::from_ne_bytes(w)))
        } else if let Some(w) = repeats::<2>(bytes) {
            Some(MemsetWord::W16(u16::from_ne_bytes(w)))
        } else {
            repeats::<1>(bytes).map(|w| MemsetWord::W8(w[0]))
        }
    }

    fn width(self) -> usize {
        match self {
            MemsetWord::W32(_) => 4,
            MemsetWord::W16(_) => 2,
            MemsetWord::W8(_) => 1,
        }
    }
}

/// A dense `rows × heads × head_dim` matrix in device memory, row-major (Q, K, V, out).
///
/// ```no_run
/// use spattn_ops::{DeviceMatrix, Gpu, Shape};
/// let gpu = Gpu::new(0)?;
/// let shape = Shape::new(3, 2, 4)?;
/// let host: Vec<f32> = (0..shape.len()).map(|i| i as f32).collect();
/// let mut q = DeviceMatrix::from_host(&gpu, shape, &host)?;
/// assert_eq!(q.to_host()?, host);
/// q.fill_nan()?;
/// assert!(q.to_host()?.iter().all(|x| x.is_nan()));
/// # Ok::<(), spattn_ops::Error>(())
/// ```
#[derive(Debug)]
pub struct DeviceMatrix<T: DType> {
    data: DeviceVec<T>,
    shape: Shape,
}

impl<T: DType> DeviceMatrix<T> {
    /// Uploads `host` (exactly `shape.len()` elements, row-major) to a new matrix on `gpu`.
    pub fn from_host(gpu: &Gpu, shape: Shape, host: &[T]) -> Result<Self> {
        shape.expect_len("host data", host.len())?;
        Ok(DeviceMatrix {
            data: DeviceVec::from_host_named(gpu, "device matrix", host)?,
            shape,
        })
    }

    /// A matrix of zeros on `gpu`.
    pub fn zeros(gpu: &Gpu, shape: Shape) -> Result<Self> {
        Ok(DeviceMatrix {
            data: DeviceVec::alloc(gpu, "device matrix", shape.len(), true)?,
            shape,
        })
    }

    /// A matrix on `gpu` whose values are unspecified, for one the caller overwrites whole
    /// before reading it (see [`DeviceVec::unset`]).
    pub fn unset(gpu: &Gpu, shape: Shape) -> Result<Self> {
        Ok(DeviceMatrix {
            data: DeviceVec::alloc(gpu, "device matrix", shape.len(), false)?,
            shape,
        })
    }

    /// Views a vector of exactly `shape.len()` elements as a matrix.
    pub fn from_vec(data: DeviceVec<T>, shape: Shape) -> Result<Self> {
        shape.expect_len("device vector", data.len())?;
        Ok(DeviceMatrix { data, shape })
    }

    /// The elements as a vector, dropping the shape.
    pub fn into_vec(self) -> DeviceVec<T> {
        self.data
    }

    /// The elements as a vector.
    pub fn as_vec(&self) -> &DeviceVec<T> {
        &self.data
    }

    /// The elements as a vector, mutably (its length, and so the shape, cannot change).
    pub fn as_vec_mut(&mut self) -> &mut DeviceVec<T> {
        &mut self.data
    }

    /// The same elements under another shape with as many elements.
    pub fn reshape(&mut self, shape: Shape) -> Result<()> {
        shape.expect_len("device matrix", self.data.len())?;
        self.shape = shape;
        Ok(())
    }

    /// The shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// Number of elements (`shape().len()`).
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the matrix has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The handle the matrix was allocated with.
    pub fn gpu(&self) -> &Gpu {
        self.data.gpu()
    }

    /// The cudarc slice, to pass to a kernel (see [`DeviceVec::slice`]).
    pub(crate) fn slice(&self) -> &CudaSlice<T> {
        self.data.slice()
    }

    /// The cudarc slice, mutably, to pass to a kernel that writes it.
    pub(crate) fn slice_mut(&mut self) -> &mut CudaSlice<T> {
        self.data.slice_mut()
    }

    /// Downloads the elements, row-major. Waits for all work submitted before it.
    pub fn to_host(&self) -> Result<Vec<T>> {
        self.data.to_host()
    }

    /// Downloads into `host`, which must hold exactly `shape().len()` elements.
    #[cfg(test)]
    pub(crate) fn copy_to_host(&self, host: &mut [T]) -> Result<()> {
        self.data.copy_to_host(host)
    }

    /// Overwrites the elements with `host`, which must hold exactly `shape().len()` elements.
    pub fn copy_from_host(&mut self, host: &[T]) -> Result<()> {
        self.data.copy_from_host(host)
    }

    /// Sets every element to `value` (a memset on the stream).
    pub fn fill(&mut self, value: T) -> Result<()> {
        self.data.fill(value)
    }

    /// Sets every element to NaN: poisons an output before a launch in tests.
    pub fn fill_nan(&mut self) -> Result<()> {
        self.data.fill_nan()
    }

    /// A device-to-device copy on the same handle.
    pub fn try_clone(&self) -> Result<Self> {
        Ok(DeviceMatrix {
            data: self.data.try_clone()?,
            shape: self.shape,
        })
    }
}

impl<T: DType> OnGpu for DeviceMatrix<T> {
    fn gpu(&self) -> &Gpu {
        self.data.gpu()
    }
}

#[cfg(test)]
mod tests {
    use super::MemsetWord;

    #[test]
    fn memset_words() {
        let nan32 = 0x7fc0_0000u32.to_ne_bytes();
        assert_eq!(MemsetWord::of(&nan32), Some(MemsetWord::W32(0x7fc0_0000)));
        assert_eq!(
            MemsetWord::of(&0x7e00u16.to_ne_bytes()),
            Some(MemsetWord::W16(0x7e00))
        );
        assert_eq!(MemsetWord::of(&[7u8]), Some(MemsetWord::W8(7)));
        // An f64 whose halves repeat is a 32-bit memset of twice the count …
        let rep = [1u8, 2, 3, 4, 1, 2, 3, 4];
        let w = MemsetWord::of(&rep).unwrap();
        assert_eq!(
            (w, w.width()),
            (MemsetWord::W32(u32::from_ne_bytes([1, 2, 3, 4])), 4)
        );
        // … but 1.0f64 is not a repetition of any word.
        assert_eq!(MemsetWord::of(&1.0f64.to_ne_bytes()), None);
        assert_eq!(MemsetWord::of(&[]), None);
    }
}
