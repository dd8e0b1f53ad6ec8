//! Zero-copy interop with device memory and CUDA streams owned by someone else: PyTorch's
//! caching allocator and current stream, CuPy, another CUDA library.
//!
//! - [`ExternalVec`] and [`ExternalMatrix`] are non-owning views of a raw device pointer as a
//!   [`DeviceVec`] / [`DeviceMatrix`] of a [`Gpu`] handle, so every op of this crate (and every
//!   plan of `spattn`) runs on them unchanged. Building one checks what the driver can check
//!   (the pointer is non-null, 16-byte aligned, device memory of the handle's device, and the
//!   bytes lie inside one allocation); dropping one never frees the memory.
//! - [`StreamBridge`] orders a handle's stream with an external stream by events: the
//!   handle's stream first waits for everything enqueued so far on the external stream, then
//!   the external stream waits for everything the handle enqueued. No host synchronisation.
//!
//! # Why a bridge and not the external stream itself
//!
//! A [`Gpu`] enqueues everything — allocations, workspaces, launches, frees — on its one
//! stream, and that order alone keeps its buffers' uses apart ([`crate::gpu`]). Launching on a
//! foreign stream instead would need every workspace a plan keeps between calls to be ordered
//! by hand. Two event waits per call (a few microseconds of driver time) keep both orders
//! intact: to the owner of the external stream the ops behave exactly as if they had run on
//! it, so its allocator may free or reuse the memory of a view as soon as its own stream
//! order allows.
//!
//! ```no_run
//! use spattn_ops::{ExternalMatrix, Gpu, Shape, StreamBridge};
//! # fn torch_pointers() -> (u64, u64) { (0, 0) }
//! let gpu = Gpu::new(0)?;
//! let bridge = StreamBridge::new(&gpu)?;
//! let (y_ptr, stream) = torch_pointers(); // y.data_ptr(), torch.cuda.current_stream().cuda_stream
//! let shape = Shape::new(1024, 8, 64)?;
//! // SAFETY: y_ptr addresses 1024·8·64 live f32 owned by the caller, which keeps them
//! // allocated until its stream has waited for the bridge; `stream` is a live stream of the
//! // device's primary context.
//! unsafe {
//!     let mut y = ExternalMatrix::<f32>::new(&gpu, "y", y_ptr, shape)?;
//!     bridge.run(stream, || y.fill(0.0))?; // y is zeroed in place, in torch's stream order
//! }
//! # Ok::<(), spattn_ops::Error>(())
//! ```

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, PoisonError};

use cudarc::driver::sys::{self, CUpointer_attribute, CUresult};
use cudarc::driver::CudaEvent;

use crate::buffer::{DeviceElement, DeviceMatrix, DeviceVec};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::map_driver_error;
use crate::shape::Shape;

/// The alignment, in bytes, every external pointer must have: the kernels move up to 16 bytes
/// per vector access and assume buffers start where `cuMemAlloc` would put them.
pub(crate) const EXTERNAL_ALIGN: u64 = 16;

/// Checks that `bytes` bytes at `ptr` can be handed to the kernels of `gpu`: non-null, aligned
/// to `align` bytes ([`EXTERNAL_ALIGN`], or less for arrays the kernels read element by element
/// (edge ids), which may start anywhere a tensor's elements can: a row of a `2 × E` tensor),
/// device memory of `gpu`'s device, and (where the driver reports the allocation holding `ptr`,
/// which it does for `cuMemAlloc` and stream-ordered allocations) not past the end of that
/// allocation.
///
/// `bytes` must be at least 1. Errors are [`Error::InvalidArgument`] naming `what`, or
/// [`Error::Driver`] for a context that cannot be bound.
pub(crate) fn check_device_pointer_aligned(
    gpu: &Gpu,
    what: &'static str,
    ptr: u64,
    bytes: usize,
    align: u64,
) -> Result<()> {
    let end = check_alignment(what, ptr, bytes, align)?;
    let bad = |why: String| Error::InvalidArgument { what, why };
    gpu.context()
        .bind_to_thread()
        .map_err(|e| map_driver_error("binding the CUDA context", e))?;
    let mut ordinal: std::ffi::c_int = -1;
    // SAFETY: cuPointerGetAttribute writes one int (the attribute's documented type) through a
    // pointer to a live local; it only queries the driver's tables and accepts any address.
    let status = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut std::ffi::c_int).cast(),
            CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    if status != CUresult::CUDA_SUCCESS {
        return Err(bad(format!(
            "{ptr:#x} is not device memory the CUDA driver knows ({status:?}): a CPU tensor?"
        )));
    }
    if usize::try_from(ordinal).ok() != Some(gpu.ordinal()) {
        return Err(bad(format!(
            "is memory of CUDA device {ordinal}, and the op runs on device {}",
            gpu.ordinal()
        )));
    }
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: writes the allocation's base and size through pointers to live locals; any
    // address is accepted (an unknown one is an error status, handled below).
    let range = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
    // Memory mapped by the virtual memory management API (e.g. PyTorch's expandable
    // segments) may not report a range: then only the checks above apply.
    if range == CUresult::CUDA_SUCCESS && end > base.saturating_add(size as u64) {
        return Err(bad(format!(
            "{bytes} bytes at {ptr:#x} run {} bytes past the end of their allocation \
             ({size} bytes at {base:#x})",
            end - (base + size as u64)
        )));
    }
    Ok(())
}

/// A one-dimensional view of device memory owned by someone else, usable wherever a
/// [`DeviceVec`] of its [`Gpu`] is (it dereferences to one). Dropping the view leaves the
/// memory alone.
#[derive(Debug)]
pub struct ExternalVec<T: DeviceElement> {
    inner: ManuallyDrop<DeviceVec<T>>,
}

/// How much of a foreign pointer a view checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Check {
    /// [`check_device_pointer_aligned`]: null, alignment, and the driver's tables (device,
    /// allocation bounds): two driver queries.
    Driver,
    /// Null and alignment only, for callers that validated the memory themselves.
    Alignment,
}

/// A device vector over `len` elements at `ptr` (checked as `check` says), which borrows them
/// (an empty one points at the handle's placeholder instead, never read): never free it.
///
/// # Safety
/// As [`ExternalVec::new`].
unsafe fn borrow_vec<T: DeviceElement>(
    gpu: &Gpu,
    what: &'static str,
    ptr: u64,
    len: usize,
    (align, check): (u64, Check),
) -> Result<DeviceVec<T>> {
    if len == 0 {
        // CUDA has no zero-byte allocations and torch reports null or anything for empty
        // tensors: an empty view points at the handle's 16-byte placeholder (one element of
        // T, checked to fit), which the kernels never read.
        if std::mem::size_of::<T>() > 16 {
            return Err(Error::InvalidArgument {
                what,
                why: format!(
                    "an empty view of {}-byte elements (the placeholder holds 16 bytes)",
                    std::mem::size_of::<T>()
                ),
            });
        }
        let at = gpu.placeholder()?;
        // SAFETY: the placeholder is 16 bytes of this handle's device memory, alive as long
        // as the handle (the view holds a clone); the view is never freed (Drop leaks it).
        let slice = unsafe { gpu.stream().upgrade_device_ptr::<T>(at, 1) };
        return Ok(DeviceVec::from_slice_parts(gpu, slice, 0));
    }
    let bytes = crate::buffer::byte_len::<T>(what, len)?;
    match check {
        Check::Driver => check_device_pointer_aligned(gpu, what, ptr, bytes, align)?,
        Check::Alignment => {
            check_alignment(what, ptr, bytes, align)?;
        }
    }
    // SAFETY: `ptr` addresses `len` elements of `T` inside one allocation of this device
    // (checked above as far as `check` goes, and promised by the caller); any bit pattern is
    // a valid `T` (`T: Pod`). The slice is tied to `gpu`'s stream, so ops order their uses of
    // it like any buffer of the handle; with event tracking off (`Gpu::new`) it carries no
    // events. It is never freed: the view's `Drop` leaks it back.
    let slice = unsafe { gpu.stream().upgrade_device_ptr::<T>(ptr, len) };
    Ok(DeviceVec::from_slice_parts(gpu, slice, len))
}

/// The checks of a pointer that need no driver: non-null, aligned to `align`, no overflow.
/// Returns the end address.
fn check_alignment(what: &'static str, ptr: u64, bytes: usize, align: u64) -> Result<u64> {
    let bad = |why: String| Error::InvalidArgument { what, why };
    if ptr == 0 {
        return Err(bad(format!("null device pointer for {bytes} bytes")));
    }
    if ptr % align.max(1) != 0 {
        return Err(bad(format!(
            "device pointer {ptr:#x} is not {align}-byte aligned (a view at an offset into a \
             larger buffer?); pass a copy"
        )));
    }
    ptr.checked_add(bytes as u64).ok_or_else(|| {
        bad(format!(
            "{ptr:#x} + {bytes} bytes overflows the address space"
        ))
    })
}

impl<T: DeviceElement> ExternalVec<T> {
    /// Views `len` elements of `T` at device address `ptr` as a vector of `gpu`; `what` names
    /// the operand in errors. A view of no elements ignores `ptr`.
    ///
    /// # Safety
    /// - `ptr` is the start of at least `len · size_of::<T>()` bytes of device memory of
    ///   `gpu`'s device, valid in its primary context (any allocation of the CUDA runtime or
    ///   driver on that device qualifies: PyTorch's, CuPy's, `cuMemAlloc`'s).
    /// - That memory stays allocated, and nothing else writes it (or, for memory an op writes,
    ///   reads it) concurrently, until every operation enqueued on `gpu`'s stream that uses
    ///   the view has completed. With memory of a caching allocator ordered by a stream
    ///   (PyTorch's), [`StreamBridge::run`] on that stream around the ops gives exactly this.
    /// - The [`DeviceVec`] the view dereferences to is never moved out of it (no
    ///   `std::mem::swap` / `replace` through `DerefMut`): a moved-out buffer would free the
    ///   memory when dropped.
    ///
    /// What can be checked is checked (the driver's tables, 16-byte alignment): a null,
    /// misaligned, host or other-device pointer, or one whose `len` elements overrun its
    /// allocation, is an [`Error::InvalidArgument`] naming `what`, not undefined behaviour.
    pub unsafe fn new(gpu: &Gpu, what: &'static str, ptr: u64, len: usize) -> Result<Self> {
        // SAFETY: the caller's contract.
        unsafe { Self::view(gpu, what, ptr, len, (EXTERNAL_ALIGN, Check::Driver)) }
    }

    /// [`new`](Self::new) without the driver's queries (device and allocation bounds): only
    /// null and alignment are checked. For callers that validated the memory themselves on
    /// every call (the Python package checks each tensor's device, dtype, shape and
    /// contiguity before passing its address), sparing two driver calls per operand.
    ///
    /// # Safety
    /// As [`new`](Self::new); nothing but null and alignment is checked.
    pub unsafe fn new_trusted(gpu: &Gpu, what: &'static str, ptr: u64, len: usize) -> Result<Self> {
        // SAFETY: the caller's contract.
        unsafe { Self::view(gpu, what, ptr, len, (EXTERNAL_ALIGN, Check::Alignment)) }
    }

    /// [`new`](Self::new) for memory only `T`-aligned (the same checks at `T`'s alignment):
    /// for a buffer the kernels read element by element, never by wider vectors (a device
    /// edge list's ids).
    ///
    /// # Safety
    /// As [`new`](Self::new).
    pub unsafe fn new_element_aligned(
        gpu: &Gpu,
        what: &'static str,
        ptr: u64,
        len: usize,
    ) -> Result<Self> {
        let align = std::mem::align_of::<T>() as u64;
        // SAFETY: the caller's contract.
        unsafe { Self::view(gpu, what, ptr, len, (align, Check::Driver)) }
    }

    /// [`new_element_aligned`](Self::new_element_aligned) with only null and alignment checked
    /// ([`new_trusted`](Self::new_trusted)'s checks at `T`'s alignment).
    ///
    /// # Safety
    /// As [`new`](Self::new); nothing but null and `T`'s alignment is checked, and the view may
    /// go only to ops that access it element by element (as
    /// [`ExternalMatrix::new_trusted_element_aligned`]).
    pub unsafe fn new_trusted_element_aligned(
        gpu: &Gpu,
        what: &'static str,
        ptr: u64,
        len: usize,
    ) -> Result<Self> {
        let align = std::mem::align_of::<T>() as u64;
        // SAFETY: the caller's contract.
        unsafe { Self::view(gpu, what, ptr, len, (align, Check::Alignment)) }
    }

    /// The view, its pointer checked as `checks` say.
    ///
    /// # Safety
    /// As [`new`](Self::new).
    unsafe fn view(
        gpu: &Gpu,
        what: &'static str,
        ptr: u64,
        len: usize,
        checks: (u64, Check),
    ) -> Result<Self> {
        // SAFETY: the caller's contract is `borrow_vec`'s.
        let vec = unsafe { borrow_vec(gpu, what, ptr, len, checks) }?;
        Ok(Self {
            inner: ManuallyDrop::new(vec),
        })
    }
}

/// A view's `Deref`/`DerefMut` to the buffer it wraps, and its `Drop`, which hands borrowed
/// memory back to its owner (the cudarc slice is leaked, not freed).
macro_rules! external_view {
    ($view:ident, $bound:ident, $inner:ident, |$buf:ident| $into_slice:expr) => {
        impl<T: $bound> Deref for $view<T> {
            type Target = $inner<T>;
            fn deref(&self) -> &$inner<T> {
                &self.inner
            }
        }

        impl<T: $bound> DerefMut for $view<T> {
            fn deref_mut(&mut self) -> &mut $inner<T> {
                &mut self.inner
            }
        }

        impl<T: $bound> Drop for $view<T> {
            fn drop(&mut self) {
                // SAFETY: `inner` is taken once, here, and never touched again.
                let $buf = unsafe { ManuallyDrop::take(&mut self.inner) };
                let _ = $into_slice.leak();
            }
        }
    };
}

external_view!(ExternalVec, DeviceElement, DeviceVec, |buf| buf
    .into_slice());

/// A `rows × heads × head_dim` view of device memory owned by someone else, usable wherever a
/// [`DeviceMatrix`] of its [`Gpu`] is (it dereferences to one). Dropping the view leaves the
/// memory alone.
#[derive(Debug)]
pub struct ExternalMatrix<T: DType> {
    inner: ManuallyDrop<DeviceMatrix<T>>,
}

impl<T: DType> ExternalMatrix<T> {
    /// Views the `shape.len()` elements of `T` at device address `ptr` (row-major, contiguous)
    /// as a matrix of `gpu`; `what` names the operand in errors.
    ///
    /// # Safety
    /// As [`ExternalVec::new`] with `len = shape.len()`; the [`DeviceMatrix`] the view
    /// dereferences to must not be moved out of it either.
    pub unsafe fn new(gpu: &Gpu, what: &'static str, ptr: u64, shape: Shape) -> Result<Self> {
        // SAFETY: the caller's contract.
        unsafe { Self::view(gpu, what, ptr, shape, (EXTERNAL_ALIGN, Check::Driver)) }
    }

    /// [`new`](Self::new) with only null and alignment checked
    /// ([`ExternalVec::new_trusted`]).
    ///
    /// # Safety
    /// As [`new`](Self::new); nothing but null and alignment is checked.
    pub unsafe fn new_trusted(
        gpu: &Gpu,
        what: &'static str,
        ptr: u64,
        shape: Shape,
    ) -> Result<Self> {
        // SAFETY: the caller's contract.
        unsafe { Self::view(gpu, what, ptr, shape, (EXTERNAL_ALIGN, Check::Alignment)) }
    }

    /// [`new_trusted`](Self::new_trusted) for memory only `T`-aligned: for a matrix the kernels
    /// read element by element, never by wider vectors (GAT's per-node score terms, which may
    /// be one slice of a larger scores tensor).
    ///
    /// # Safety
    /// As [`new`](Self::new); nothing but null and `T`'s alignment is checked, and the view may
    /// go only to ops that access it element by element: the vector ops (`spmm`, the fused
    /// kernels, ...) assume 16-byte-aligned buffers and would fault on it.
    pub unsafe fn new_trusted_element_aligned(
        gpu: &Gpu,
        what: &'static str,
        ptr: u64,
        shape: Shape,
    ) -> Result<Self> {
        let align = std::mem::align_of::<T>() as u64;
        // SAFETY: the caller's contract.
        unsafe { Self::view(gpu, what, ptr, shape, (align, Check::Alignment)) }
    }

    /// The view, its pointer checked as `checks` say (alignment in bytes, and how).
    ///
    /// # Safety
    /// As [`new`](Self::new).
    unsafe fn view(
        gpu: &Gpu,
        what: &'static str,
        ptr: u64,
        shape: Shape,
        checks: (u64, Check),
    ) -> Result<Self> {
        let len = shape.len();
        // SAFETY: the caller's contract is `borrow_vec`'s for `len` elements.
        let vec = unsafe { borrow_vec::<T>(gpu, what, ptr, len, checks) }?;
        // Cannot fail: the vector holds exactly `shape.len()` elements. (Were it to, the
        // vector would be dropped and free borrowed memory, hence the check before it.)
        if vec.len() != len {
            let _ = vec.into_slice().leak();
            return Err(Error::LengthMismatch {
                what,
                expected: len,
                actual: 0,
            });
        }
        let matrix = DeviceMatrix::from_vec(vec, shape)?;
        Ok(Self {
            inner: ManuallyDrop::new(matrix),
        })
    }
}

external_view!(ExternalMatrix, DType, DeviceMatrix, |buf| buf
    .into_vec()
    .into_slice());

/// Orders a [`Gpu`]'s stream with an external CUDA stream (e.g. PyTorch's current stream) by
/// a pair of events; see the module documentation.
///
/// `Send + Sync`; calls from several threads are serialised (each [`run`](Self::run) holds the
/// events for its whole duration).
#[derive(Debug)]
pub struct StreamBridge {
    gpu: Gpu,
    /// (`ready`: recorded on the external stream, waited on by the handle's; `done`: recorded
    /// on the handle's stream, waited on by the external one.)
    events: Mutex<(CudaEvent, CudaEvent)>,
}

impl StreamBridge {
    /// Two events (timing disabled) in `gpu`'s context.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let ctx = gpu.context();
        let event = || {
            ctx.new_event(None)
                .map_err(|e| map_driver_error("creating a stream-ordering event", e))
        };
        Ok(Self {
            gpu: gpu.clone(),
            events: Mutex::new((event()?, event()?)),
        })
    }

    /// The handle whose stream the bridge orders.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Whether the stream `external` is capturing a CUDA graph (a capture that was
    /// invalidated counts as capturing: the caller must still not change what it replays).
    ///
    /// # Safety
    /// `external` is a `CUstream` valid in `gpu`'s context, as for [`run`](Self::run).
    pub unsafe fn is_capturing(&self, external: u64) -> Result<bool> {
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| map_driver_error("binding the CUDA context", e))?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: `external` is a valid stream of this context (the caller's contract);
        // the query writes one status through a pointer to a live local.
        unsafe { sys::cuStreamIsCapturing(external as sys::CUstream, &mut status) }
            .result()
            .map_err(|e| map_driver_error("asking whether a stream captures", e))?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Runs `f` — which enqueues work on the handle's stream — ordered after everything
    /// enqueued so far on the stream `external`, and makes `external` wait for what `f`
    /// enqueued (also when `f` fails half-way, so that work enqueued before the failure is
    /// still waited for). Nothing blocks the host. `f`'s error type is any that a spattn-ops
    /// [`Error`] converts into (`spattn::Error` included).
    ///
    /// # Safety
    /// `external` is a `CUstream` valid in `gpu`'s context (its device's primary context) for
    /// the whole call: a live stream created in that context (`torch.cuda.current_stream(device)
    /// .cuda_stream`), or `0` (the legacy default stream), or `2` (`CU_STREAM_PER_THREAD`).
    pub unsafe fn run<R, E: From<Error>>(
        &self,
        external: u64,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        // The events hold no invariant a panic could break: each use re-records them.
        let events = self.events.lock().unwrap_or_else(PoisonError::into_inner);
        let (ready, done) = &*events;
        let ext = external as sys::CUstream;
        self.gpu
            .context()
            .bind_to_thread()
            .map_err(|e| map_driver_error("binding the CUDA context", e))?;
        // SAFETY: `ready` is a live event of this context; `ext` is a valid stream of this
        // context (the caller's contract). Recording only enqueues a marker.
        unsafe { sys::cuEventRecord(ready.cu_event(), ext) }
            .result()
            .map_err(|e| map_driver_error("recording an event on the external stream", e))?;
        self.gpu
            .stream()
            .wait(ready)
            .map_err(|e| map_driver_error("waiting for the external stream", e))?;
        let result = f();
        let joined = done
            .record(self.gpu.stream())
            .map_err(|e| map_driver_error("recording the end of spattn's work", e))
            .and_then(|()| {
                // SAFETY: `ext` is valid (as above) and `done` is a live event of this
                // context, just recorded on the handle's stream.
                unsafe { sys::cuStreamWaitEvent(ext, done.cu_event(), 0) }
                    .result()
                    .map_err(|e| map_driver_error("making the external stream wait", e))
            });
        let value = result?;
        joined?;
        Ok(value)
    }
}
