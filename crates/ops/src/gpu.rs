//! [`Gpu`]: the handle every GPU op takes — one CUDA context, one stream, one module cache —
//! and [`GpuTimer`], CUDA-event timing on that stream.
//!
//! libcuda is loaded at run time (cudarc's `dynamic-loading`), so this module compiles and
//! [`Gpu::new`] returns [`Error::NoCudaDriver`] on a machine without an NVIDIA driver instead
//! of failing to link or panicking.
//!
//! # One stream, stream-ordered memory
//!
//! Everything a `Gpu` does — allocations, copies, memsets, launches, frees — is enqueued on its
//! one non-blocking stream, so the stream's order alone keeps every buffer's uses apart. That is
//! why the handle switches off cudarc's per-buffer event tracking (two events recorded and
//! waited on for every buffer argument of every launch): it costs driver calls on each launch
//! and buys nothing when there is one stream. The price is a rule: device memory of one `Gpu`
//! must not be handed to another (two [`Gpu::new`] calls give two handles, two streams, even on
//! the same device). Ops enforce it with [`crate::launch::check_same_gpu`]; clones of a `Gpu`
//! share everything and may be mixed freely.
//!
//! Two ops step outside the one stream, each inside a single call:
//! [`NcclComm::all_to_all_around_own_gathering`](crate::nccl::NcclComm::all_to_all_around_own_gathering)
//! runs NCCL on the communicator's own stream, and the tensor-core backward runs its dq and
//! dK/dV passes at once on two streams where their grids are small; both are fenced by two
//! events ([`crate::side_stream`]: the side's work starts after the work before the call, the
//! work after the call waits for it), so the rule above still holds for everything the caller
//! sees.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, DriverError, LaunchArgs,
};

use spattn_kernels_sys::PtxModule;

use crate::error::{Error, Result};
use crate::launch::map_driver_error;
use crate::side_stream::SideStream;

/// A handle to one NVIDIA GPU: its CUDA context, the stream every op runs on, and the cache of
/// loaded PTX modules.
///
/// Cheap to clone (one `Arc`), `Send + Sync`. Clones share the stream, so work from clones
/// runs in submission order.
///
/// ```no_run
/// use spattn_ops::{Error, Gpu};
/// match Gpu::new(0) {
///     Ok(gpu) => println!("{} (sm_{}{})", gpu.name(), gpu.compute_capability().0,
///                         gpu.compute_capability().1),
///     Err(Error::NoCudaDriver | Error::NoDevice { .. }) => println!("no GPU: CPU only"),
///     Err(e) => return Err(e),
/// }
/// # Ok::<(), Error>(())
/// ```
#[derive(Clone)]
pub struct Gpu {
    inner: Arc<GpuInner>,
}

struct GpuInner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    name: String,
    compute_capability: (i32, i32),
    sm_count: u32,
    /// The kernels loaded into `ctx`, by module name and kernel name.
    modules: Mutex<HashMap<&'static str, LoadedModule>>,
    /// 16 bytes that empty views of foreign memory point at (kernels never read them), made
    /// once so that an empty operand costs no allocation per call.
    placeholder: std::sync::OnceLock<cudarc::driver::CudaSlice<u64>>,
    /// The side stream of ops that run two kernels at once within a call (made on first use;
    /// the lock held from fork to join, so that two threads never share its events).
    side: Mutex<Option<SideStream>>,
}

/// What a handle has loaded of one PTX module: each kernel from its own piece of the module
/// ([`crate::ptx_split`]), or every kernel from the whole module where it cannot be cut.
struct LoadedModule {
    /// The whole module, where it was loaded whole.
    whole: Option<Arc<CudaModule>>,
    /// Where its entries are (made by its first kernel's load).
    index: Option<crate::ptx_split::Index>,
    functions: HashMap<String, LoadedFunction>,
}

impl LoadedModule {
    /// Whether any of its code is loaded (an index alone, or a failed load, is not).
    #[cfg(test)] // the runtime tests' window into the module cache
    fn has_code(&self) -> bool {
        self.whole.is_some() || !self.functions.is_empty()
    }
}

/// A looked-up kernel and the dynamic shared memory it has been allowed so far.
struct LoadedFunction {
    function: CudaFunction,
    /// Bytes of the last opt-in ([`crate::launch::allow_dynamic_shared`]); 0 for none.
    shared_allowed: usize,
}

/// Loads libcuda (when present), initialises the driver and counts devices.
///
/// Never panics: cudarc panics when libcuda is absent or lacks a symbol, so presence is
/// checked first and the driver calls run under `catch_unwind` (a libcuda so broken that a
/// symbol is missing reads as no driver).
fn probe() -> Result<usize> {
    // SAFETY: `is_culib_present` only tries to `dlopen` libcuda under its usual names and
    // closes what it opened; it has no preconditions. Loading libcuda runs the driver's
    // initialisers, which is what any use of CUDA does.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::NoCudaDriver);
    }
    let counted = std::panic::catch_unwind(|| -> Result<usize> {
        match CudaContext::device_count() {
            Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
            // cuInit reports "no device" as an error; for us it is a count of zero.
            Err(DriverError(CUresult::CUDA_ERROR_NO_DEVICE)) => Ok(0),
            // The toolkit's stub libcuda (…/lib64/stubs) is not a driver.
            Err(DriverError(CUresult::CUDA_ERROR_STUB_LIBRARY)) => Err(Error::NoCudaDriver),
            Err(source) => Err(Error::Driver {
                during: "initialising the CUDA driver",
                source,
            }),
        }
    });
    counted.unwrap_or(Err(Error::NoCudaDriver))
}

impl Gpu {
    /// Opens device `ordinal`: retains its primary context, creates the stream ops run on, and
    /// reads the device's name, compute capability and SM count.
    ///
    /// Errors: [`Error::NoCudaDriver`] where libcuda cannot be loaded (checked first: this
    /// never panics), [`Error::NoDevice`] where the driver reports no device or fewer than
    /// `ordinal + 1`, [`Error::Driver`] for any other driver failure.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        let count = probe()?;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| match e.0 {
            CUresult::CUDA_ERROR_INVALID_DEVICE | CUresult::CUDA_ERROR_NO_DEVICE => {
                Error::NoDevice { ordinal, count }
            }
            _ => map_driver_error("creating the CUDA context", e),
        })?;
        // SAFETY: this `Arc<CudaContext>` is private to the new handle and nothing has been
        // allocated through it yet, so every buffer it will ever hold is untracked. All of
        // them are allocated, used and freed on the one stream created below (see the module
        // documentation; the work of NCCL's exchange and of the tensor-core backward's dK/dV
        // pass on a side stream is fenced by two events within its call, `side_stream`), and
        // ops refuse buffers of another handle (`check_same_gpu`), so stream order provides
        // all the synchronisation the events would.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| map_driver_error("creating the CUDA stream", e))?;
        let name = ctx
            .name()
            .map_err(|e| map_driver_error("reading the device name", e))?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(|e| map_driver_error("reading the compute capability", e))?;
        let attribute = |attr, during| -> Result<i32> {
            ctx.attribute(attr).map_err(|e| map_driver_error(during, e))
        };
        let sm_count = attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "reading the SM count",
        )?;
        Ok(Gpu {
            inner: Arc::new(GpuInner {
                ctx,
                stream,
                ordinal,
                name,
                compute_capability,
                sm_count: u32::try_from(sm_count).unwrap_or(0),
                modules: Mutex::new(HashMap::new()),
                placeholder: std::sync::OnceLock::new(),
                side: Mutex::new(None),
            }),
        })
    }

    /// The device address of 16 bytes kept for the handle's lifetime, which empty views of
    /// foreign memory point at (no kernel reads them).
    pub(crate) fn placeholder(&self) -> Result<u64> {
        use cudarc::driver::DevicePtr;
        if self.inner.placeholder.get().is_none() {
            let slice = self
                .inner
                .stream
                .alloc_zeros::<u64>(2)
                .map_err(|e| map_driver_error("allocating the empty-view placeholder", e))?;
            // Another thread may have set it meanwhile: its allocation serves as well.
            let _ = self.inner.placeholder.set(slice);
        }
        let slice = self.inner.placeholder.get().ok_or(Error::InvalidArgument {
            what: "placeholder",
            why: "was not kept".into(),
        })?;
        let (ptr, _record) = slice.device_ptr(&self.inner.stream);
        Ok(ptr)
    }

    /// Runs `f` with the handle's side stream ([`crate::side_stream`]), made on first use and
    /// held by this call alone until `f` returns (`f` forks onto it and joins it back).
    pub(crate) fn with_side_stream<R>(
        &self,
        f: impl FnOnce(&SideStream) -> Result<R>,
    ) -> Result<R> {
        // A panic inside another call's `f` joined its work (the guard's drop) and dropped the
        // stream with it: the lock may be poisoned and the slot empty, and a new one is made.
        let mut slot = self
            .inner
            .side
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let side = match slot.take() {
            Some(side) => side,
            None => SideStream::new(self, false)?,
        };
        let result = f(&side);
        *slot = Some(side);
        result
    }

    /// Whether a CUDA driver is present and reports at least one device. Never panics.
    #[cfg(test)]
    pub(crate) fn is_available() -> bool {
        matches!(probe(), Ok(n) if n > 0)
    }

    /// The number of CUDA devices: [`Error::NoCudaDriver`] without a driver, `Ok(0)` with a
    /// driver and no device.
    pub fn device_count() -> Result<usize> {
        probe()
    }

    /// The device ordinal this handle was opened with.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The device's name, as the driver reports it (e.g. `"NVIDIA H100 80GB HBM3"`).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Compute capability `(major, minor)`: `(8, 0)` for A100, `(9, 0)` for H100.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.compute_capability
    }

    /// Number of streaming multiprocessors (for sizing persistent grids).
    pub fn sm_count(&self) -> u32 {
        self.inner.sm_count
    }

    /// The most shared memory one block may use, in bytes, with the opt-in of
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` (beyond 48 KiB a kernel must opt in).
    #[cfg(test)]
    pub(crate) fn max_shared_memory_per_block(&self) -> Result<usize> {
        let smem = self
            .inner
            .ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| map_driver_error("reading the shared memory limit", e))?;
        Ok(usize::try_from(smem).unwrap_or(0))
    }

    /// Checks that the device has compute capability `major.minor` or newer; `what` names
    /// the path that needs it (tensor-core paths need 8.0).
    pub fn require_compute_capability(
        &self,
        what: &'static str,
        major: i32,
        minor: i32,
    ) -> Result<()> {
        let (have_major, have_minor) = self.inner.compute_capability;
        if (have_major, have_minor) < (major, minor) {
            return Err(Error::UnsupportedComputeCapability {
                what,
                major: have_major,
                minor: have_minor,
                need_major: major,
                need_minor: minor,
            });
        }
        Ok(())
    }

    /// The driver's CUDA version `(major, minor)`, e.g. `(12, 4)`: the newest PTX ISA it can
    /// JIT follows from it.
    pub fn driver_version(&self) -> Result<(i32, i32)> {
        let mut version: std::ffi::c_int = 0;
        // SAFETY: cuDriverGetVersion writes one int through the pointer, which points to a
        // live local; the driver is loaded (this handle exists).
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| map_driver_error("reading the driver version", e))?;
        Ok((version / 1000, (version % 1000) / 10))
    }

    /// Free and total device memory in bytes, `(free, total)`.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.inner
            .ctx
            .mem_get_info()
            .map_err(|e| map_driver_error("reading device memory info", e))
    }

    /// Device memory this process can still allocate, in bytes: the driver's free memory plus
    /// the freed memory this device's pool keeps for reuse (see
    /// [`keep_freed_memory`](Self::keep_freed_memory)), which [`memory_info`](Self::memory_info)
    /// counts as used.
    ///
    /// # Errors
    /// The driver's.
    pub fn available_memory(&self) -> Result<usize> {
        use sys::CUmemPool_attribute as A;
        let (free, _) = self.memory_info()?;
        let reserved = self.pool_attribute(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        let used = self.pool_attribute(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        Ok(free.saturating_add(usize::try_from(reserved.saturating_sub(used)).unwrap_or(0)))
    }

    /// The memory pool this crate's buffers come from: the device's current pool, which
    /// stream-ordered allocation (`cuMemAllocAsync`) uses.
    ///
    /// # Errors
    /// The driver's.
    pub(crate) fn memory_pool(&self) -> Result<sys::CUmemoryPool> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(|e| map_driver_error("binding the CUDA context", e))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: writes one pool handle through a pointer to a live local; the device handle
        // comes from the live context.
        unsafe { sys::cuDeviceGetMemPool(&mut pool, self.inner.ctx.cu_device()) }
            .result()
            .map_err(|e| map_driver_error("getting the device's memory pool", e))?;
        Ok(pool)
    }

    /// One of the 64-bit attributes of the device's current memory pool, which this crate's
    /// buffers come from (release threshold, reserved and used bytes and their peaks).
    ///
    /// # Errors
    /// The driver's, also for an attribute that is not 64 bits wide.
    pub fn pool_attribute(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        check_u64_attribute(attr)?;
        let pool = self.memory_pool()?;
        let mut value = 0u64;
        // SAFETY: the attribute is one of the cuuint64_t ones (checked): one u64 written
        // through a pointer to a live local; the pool is the device's live pool.
        unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast()) }
            .result()
            .map_err(|e| map_driver_error("reading a memory pool attribute", e))?;
        Ok(value)
    }

    /// Sets one of the 64-bit attributes of the device's current memory pool (the release
    /// threshold; 0 on a peak resets it to the current value).
    ///
    /// # Errors
    /// The driver's, also for an attribute that is not 64 bits wide.
    pub fn set_pool_attribute(&self, attr: sys::CUmemPool_attribute, value: u64) -> Result<()> {
        check_u64_attribute(attr)?;
        let pool = self.memory_pool()?;
        let mut value = value;
        // SAFETY: the attribute is one of the cuuint64_t ones (checked), read through a pointer
        // to a live local; the pool is the device's live pool.
        unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&mut value as *mut u64).cast()) }
            .result()
            .map_err(|e| map_driver_error("setting a memory pool attribute", e))
    }

    /// Keeps up to `bytes` of freed device memory in this device's pool for later allocations
    /// (the pool's release threshold) instead of handing it back to the driver at every
    /// synchronisation, the driver's default (0), after which each large allocation maps fresh
    /// pages. `u64::MAX` keeps everything, as torch's caching allocator does; the memory stays
    /// reserved for this process until [`trim_pool`](Self::trim_pool).
    ///
    /// # Errors
    /// The driver's.
    pub fn keep_freed_memory(&self, bytes: u64) -> Result<()> {
        self.set_pool_attribute(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            bytes,
        )
    }

    /// Hands the freed memory this device's pool keeps (see
    /// [`keep_freed_memory`](Self::keep_freed_memory)) back to the driver, once the work queued
    /// so far has finished.
    ///
    /// # Errors
    /// The driver's.
    pub fn trim_pool(&self) -> Result<()> {
        self.synchronize()?;
        let pool = self.memory_pool()?;
        // SAFETY: trimming an existing pool to 0 bytes releases only unused memory.
        unsafe { sys::cuMemPoolTrimTo(pool, 0) }
            .result()
            .map_err(|e| map_driver_error("trimming the memory pool", e))
    }

    /// The cudarc context (for calls this crate does not wrap).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The stream every op of this handle runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Blocks until all work submitted to the stream has finished. Faults of earlier
    /// asynchronous launches surface here.
    pub fn synchronize(&self) -> Result<()> {
        self.inner
            .stream
            .synchronize()
            .map_err(|e| map_driver_error("synchronizing the stream", e))
    }

    /// Whether `other` is this handle or a clone of it (same context, same stream): the
    /// condition for mixing their buffers in one op (see the module documentation).
    pub fn same_as(&self, other: &Gpu) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether `slice` was allocated on this handle's stream (and so may be used by its ops).
    #[cfg(test)] // the runtime tests' window into the module cache
    pub(crate) fn owns<T>(&self, slice: &cudarc::driver::CudaSlice<T>) -> bool {
        Arc::ptr_eq(slice.stream(), &self.inner.stream)
    }

    /// A kernel-launch builder on this handle's stream; launch it with
    /// [`crate::launch::launch`].
    pub(crate) fn launch_builder<'a>(&'a self, function: &'a CudaFunction) -> LaunchArgs<'a> {
        self.inner.stream.launch_builder(function)
    }

    /// The function `kernel` of `module`, loading the module on first use (see
    /// `load_function`).
    ///
    /// A kernel the module does not list is [`Error::KernelNotFound`] without touching the
    /// driver.
    ///
    /// ```no_run
    /// # use spattn_ops::Gpu;
    /// use spattn_kernels_sys::{kernel, CSR_OPS};
    /// let gpu = Gpu::new(0)?;
    /// let spmm = gpu.function(&CSR_OPS, kernel!(CSR_OPS, "spmm_csr_f32_v1"))?;
    /// # Ok::<(), spattn_ops::Error>(())
    /// ```
    pub fn function(&self, module: &PtxModule, kernel: &str) -> Result<CudaFunction> {
        if !module.kernels.contains(&kernel) {
            return Err(Error::KernelNotFound {
                module: module.name,
                kernel: kernel.to_owned(),
            });
        }
        self.load_function(module.name, module.ptx, kernel)
    }

    /// Loads `module` and looks up all its kernels now, so that later calls (e.g. the timed
    /// ones of a benchmark) do not pay for the driver's JIT compilation.
    #[cfg(test)] // the runtime tests' window into the module cache
    pub(crate) fn preload(&self, module: &PtxModule) -> Result<()> {
        for kernel in module.kernels {
            self.load_function(module.name, module.ptx, kernel)?;
        }
        Ok(())
    }

    /// The function `kernel` of the PTX module `module_name`, loading it on first use.
    ///
    /// Each kernel is loaded (JIT-compiled by the driver) from its own piece of the module, the
    /// module's text without its other entries ([`crate::ptx_split`]): a plan pays for the
    /// kernels it launches, not for the dozens beside them. Each function is loaded once per
    /// handle; later calls are a map lookup under a mutex. Module names must be unique: every
    /// call naming a module must pass the same PTX.
    ///
    /// Errors: [`Error::ModuleLoad`] where the driver rejects the PTX (e.g. an ISA newer than
    /// the driver), [`Error::KernelNotFound`] where the module has no such function.
    pub(crate) fn load_function(
        &self,
        module_name: &'static str,
        ptx: &str,
        kernel: &str,
    ) -> Result<CudaFunction> {
        self.load_function_with_shared(module_name, ptx, kernel, 0, "looking up a kernel")
    }

    /// [`Gpu::load_function`], with the function allowed `shared_bytes` of dynamic shared
    /// memory ([`crate::launch::allow_dynamic_shared`]: the opt-in past 48 KiB). The opt-in is
    /// a driver call (~1 µs) and a property of the function, so it is made only when
    /// `shared_bytes` exceeds every earlier request for this function: a launch path can call
    /// this on every run without paying for it inside the timed launch. `what` names the
    /// kernel in a driver error.
    ///
    /// Errors: as [`Gpu::load_function`]; [`Error::Driver`] where the driver refuses the size.
    pub(crate) fn load_function_with_shared(
        &self,
        module_name: &'static str,
        ptx: &str,
        kernel: &str,
        shared_bytes: usize,
        what: &'static str,
    ) -> Result<CudaFunction> {
        let mut modules = self
            .inner
            .modules
            .lock()
            // Entries are inserted whole, so a panic elsewhere cannot leave one half-built.
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(loaded) = modules
            .get_mut(module_name)
            .and_then(|m| m.functions.get_mut(kernel))
        {
            if shared_bytes > loaded.shared_allowed {
                crate::launch::allow_dynamic_shared(&loaded.function, shared_bytes, what)?;
                loaded.shared_allowed = shared_bytes;
            }
            return Ok(loaded.function.clone());
        }
        let not_found = || Error::KernelNotFound {
            module: module_name,
            kernel: kernel.to_owned(),
        };
        // cudarc builds a C string from the name and panics on an interior NUL.
        if kernel.contains('\0') {
            return Err(not_found());
        }
        let loaded = modules.entry(module_name).or_insert_with(|| LoadedModule {
            whole: None,
            index: None,
            functions: HashMap::new(),
        });
        let (module, loaded_whole) = match loaded.whole.clone() {
            Some(module) => (module, None),
            None => {
                if !loaded.index.as_ref().is_some_and(|i| i.is_of(ptx)) {
                    loaded.index = Some(crate::ptx_split::Index::of(ptx));
                }
                let piece = match &loaded.index {
                    Some(index) => index.piece(ptx, kernel),
                    None => crate::ptx_split::Index::of(ptx).piece(ptx, kernel),
                }
                .ok_or_else(not_found)?;
                let module = self.load_module(module_name, &piece)?;
                // A borrowed piece is the whole module: every later kernel is looked up in it.
                let whole = matches!(piece, std::borrow::Cow::Borrowed(_)).then(|| module.clone());
                (module, whole)
            }
        };
        let function = module.load_function(kernel).map_err(|e| match e.0 {
            CUresult::CUDA_ERROR_NOT_FOUND => not_found(),
            _ => map_driver_error("looking up a kernel", e),
        })?;
        crate::launch::allow_dynamic_shared(&function, shared_bytes, what)?;
        if loaded_whole.is_some() {
            loaded.whole = loaded_whole;
        }
        loaded.functions.insert(
            kernel.to_owned(),
            LoadedFunction {
                function: function.clone(),
                shared_allowed: shared_bytes,
            },
        );
        Ok(function)
    }

    fn load_module(&self, module_name: &'static str, ptx: &str) -> Result<Arc<CudaModule>> {
        // cudarc builds a C string from the PTX and panics on an interior NUL.
        if ptx.contains('\0') {
            return Err(Error::InvalidArgument {
                what: "PTX",
                why: format!("module {module_name} contains a NUL byte"),
            });
        }
        self.inner
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|source| Error::ModuleLoad {
                module: module_name,
                source,
            })
    }

    /// Whether the module `module_name` has been loaded by this handle.
    #[cfg(test)] // the runtime tests' window into the module cache
    pub(crate) fn is_module_loaded(&self, module_name: &str) -> bool {
        self.inner
            .modules
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(module_name)
            .is_some_and(LoadedModule::has_code)
    }

    /// Names of the kernels of `module_name` loaded so far, sorted.
    #[cfg(test)] // the runtime tests' window into the module cache
    pub(crate) fn loaded_kernels(&self, module_name: &str) -> Vec<String> {
        let modules = self
            .inner
            .modules
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut names: Vec<String> = modules
            .get(module_name)
            .map(|m| m.functions.keys().cloned().collect())
            .unwrap_or_default();
        names.sort_unstable();
        names
    }

    /// Names of the modules loaded so far, sorted.
    #[cfg(test)] // the runtime tests' window into the module cache
    pub(crate) fn loaded_modules(&self) -> Vec<&'static str> {
        let mut names: Vec<_> = self
            .inner
            .modules
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|(_, m)| m.has_code())
            .map(|(&name, _)| name)
            .collect();
        names.sort_unstable();
        names
    }

    /// A timer on this handle's stream.
    pub fn timer(&self) -> Result<GpuTimer> {
        GpuTimer::new(self)
    }

    /// GPU time of the work `f` submits to the stream, in milliseconds, by CUDA events
    /// recorded before and after it. Waits for that work to finish.
    ///
    /// Measures device time of what `f` enqueues, not host time: `f` should only submit work.
    pub fn time_ms<F>(&self, f: F) -> Result<f32>
    where
        F: FnOnce() -> Result<()>,
    {
        let mut timer = self.timer()?;
        timer.start()?;
        f()?;
        timer.stop()?;
        timer.elapsed_ms()
    }
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.inner.compute_capability;
        f.debug_struct("Gpu")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .field("compute_capability", &format_args!("{major}.{minor}"))
            .field("sm_count", &self.inner.sm_count)
            .finish_non_exhaustive()
    }
}

/// Times work on a [`Gpu`]'s stream with a pair of CUDA events; reusable.
///
/// ```no_run
/// # use spattn_ops::Gpu;
/// let gpu = Gpu::new(0)?;
/// let mut timer = gpu.timer()?;
/// timer.start()?;
/// // … launch kernels on gpu …
/// timer.stop()?;
/// println!("{:.3} ms", timer.elapsed_ms()?);
/// # Ok::<(), spattn_ops::Error>(())
/// ```
#[derive(Debug)]
pub struct GpuTimer {
    gpu: Gpu,
    start: CudaEvent,
    stop: CudaEvent,
    started: bool,
    stopped: bool,
}

impl GpuTimer {
    /// Two timing events on `gpu`'s context.
    pub(crate) fn new(gpu: &Gpu) -> Result<Self> {
        let ctx = gpu.context();
        // `None` would create events with timing disabled.
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let event = || {
            ctx.new_event(flags)
                .map_err(|e| map_driver_error("creating a timing event", e))
        };
        Ok(GpuTimer {
            gpu: gpu.clone(),
            start: event()?,
            stop: event()?,
            started: false,
            stopped: false,
        })
    }

    /// Records the start event on the stream (after all work submitted so far).
    pub fn start(&mut self) -> Result<()> {
        self.start
            .record(self.gpu.stream())
            .map_err(|e| map_driver_error("recording the start event", e))?;
        self.started = true;
        self.stopped = false;
        Ok(())
    }

    /// Records the stop event on the stream (after all work submitted so far).
    pub fn stop(&mut self) -> Result<()> {
        if !self.started {
            return Err(Error::InvalidArgument {
                what: "GpuTimer",
                why: "stop() called before start()".into(),
            });
        }
        self.stop
            .record(self.gpu.stream())
            .map_err(|e| map_driver_error("recording the stop event", e))?;
        self.stopped = true;
        Ok(())
    }

    /// Waits for the stop event and returns the GPU time between start and stop in
    /// milliseconds (resolution about 0.5 µs).
    pub fn elapsed_ms(&self) -> Result<f32> {
        if !self.stopped {
            return Err(Error::InvalidArgument {
                what: "GpuTimer",
                why: "elapsed_ms() needs start() and then stop()".into(),
            });
        }
        self.start
            .elapsed_ms(&self.stop)
            .map_err(|e| map_driver_error("reading the event timer", e))
    }
}

/// The memory pool attributes that are 64 bits wide (`cuuint64_t`): the others are ints, and
/// passing a u64 for them would let the driver read or write the wrong width.
fn check_u64_attribute(attr: sys::CUmemPool_attribute) -> Result<()> {
    use sys::CUmemPool_attribute as A;
    match attr {
        A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
        | A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT
        | A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH
        | A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT
        | A::CU_MEMPOOL_ATTR_USED_MEM_HIGH => Ok(()),
        other => Err(Error::InvalidArgument {
            what: "memory pool attribute",
            why: format!("{other:?} is not a 64-bit attribute"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_64_bit_pool_attributes_are_read_or_written_as_u64() {
        use sys::CUmemPool_attribute as A;
        assert!(check_u64_attribute(A::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD).is_ok());
        assert!(check_u64_attribute(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH).is_ok());
        let err = check_u64_attribute(A::CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES)
            .unwrap_err()
            .to_string();
        assert!(err.contains("REUSE_FOLLOW_EVENT_DEPENDENCIES"), "{err}");
    }
}
