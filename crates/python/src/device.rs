//! One spattn [`Gpu`] handle per CUDA device for the whole process, with the bridge that orders
//! its stream with the caller's ([`StreamBridge`]), and the device-level functions of the
//! module (device count, the memory pool's statistics).
//!
//! One handle per device, not one per graph: buffers of two handles cannot be mixed
//! ([`spattn::Gpu`]), and every graph and plan of the process shares the handle's stream,
//! module cache and memory pool.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use cudarc::driver::sys;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use spattn::ops::PlanWorkspace;
use spattn::ops::StreamBridge;
use spattn::Gpu;

use crate::errors::ops_to_py;

/// A device's handle and stream bridge.
#[derive(Debug)]
pub(crate) struct Device {
    /// The handle every graph and plan on this device uses.
    pub(crate) gpu: Gpu,
    /// Orders the handle's stream with the caller's (PyTorch's current stream).
    pub(crate) bridge: StreamBridge,
    /// The temporaries of graphs built on this device (kept across steps).
    pub(crate) plan_workspace: Arc<Mutex<PlanWorkspace>>,
}

/// The process's handles, by device ordinal.
fn registry() -> &'static Mutex<HashMap<usize, Arc<Device>>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<Device>>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The handle of CUDA device `ordinal`, opened on first use.
pub(crate) fn device(ordinal: usize) -> spattn::ops::Result<Arc<Device>> {
    // Entries are inserted whole, so a panic elsewhere cannot leave the map half-built.
    let mut map = registry().lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let gpu = Gpu::new(ordinal)?;
    // Freed memory stays in the pool, as in torch's caching allocator: with the driver's
    // default, every synchronisation (a graph build's read back) hands it back, and the next
    // step's allocations map fresh pages (tens of microseconds each).
    gpu.keep_freed_memory(u64::MAX)?;
    let bridge = StreamBridge::new(&gpu)?;
    let d = Arc::new(Device {
        gpu,
        bridge,
        plan_workspace: Arc::new(Mutex::new(PlanWorkspace::new())),
    });
    map.insert(ordinal, d.clone());
    Ok(d)
}

/// Restores the calling thread's current CUDA context when dropped.
///
/// spattn binds its device's primary context to the thread for its driver calls; the CUDA
/// runtime (PyTorch) reads the current device from that same binding. Every entry point that
/// touches a device saves the binding first and puts it back on the way out, so that a call
/// for `cuda:1` does not leave `cuda:1` current for PyTorch's next op.
pub(crate) struct ContextGuard {
    prev: sys::CUcontext,
}

impl ContextGuard {
    /// Saves the current binding; `None` where there is no CUDA driver (nothing to restore,
    /// and no driver call may be made).
    pub(crate) fn save() -> Option<Self> {
        static DRIVER: OnceLock<bool> = OnceLock::new();
        if !*DRIVER.get_or_init(|| Gpu::device_count().is_ok()) {
            return None;
        }
        let mut prev: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the driver is loaded and initialised (the probe above succeeded); writes one
        // handle through a pointer to a live local.
        let status = unsafe { sys::cuCtxGetCurrent(&mut prev) };
        (status == sys::CUresult::CUDA_SUCCESS).then_some(Self { prev })
    }
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        // SAFETY: `prev` was the thread's binding (a live context, or null for none) when the
        // guard was made, and spattn never destroys a context (primary contexts are retained
        // for the process's lifetime by its handles).
        let _ = unsafe { sys::cuCtxSetCurrent(self.prev) };
    }
}

/// The ordinal of a device argument: a CUDA device index (≥ 0).
pub(crate) fn ordinal(device: i64) -> PyResult<usize> {
    usize::try_from(device).map_err(|_| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "device: {device} is not a CUDA device index"
        ))
    })
}

/// The number of CUDA devices the driver reports; 0 where there is no driver. Never raises.
#[pyfunction]
pub(crate) fn cuda_device_count() -> usize {
    Gpu::device_count().unwrap_or(0)
}

/// A dict describing CUDA device `device` as spattn sees it: `name`, `compute_capability`,
/// `sm_count`, `driver_version`.
#[pyfunction]
pub(crate) fn device_info<'py>(py: Python<'py>, device: i64) -> PyResult<Bound<'py, PyDict>> {
    let _restore = ContextGuard::save();
    let d = self::device(ordinal(device)?).map_err(ops_to_py)?;
    let info = PyDict::new(py);
    info.set_item("name", d.gpu.name())?;
    info.set_item("compute_capability", d.gpu.compute_capability())?;
    info.set_item("sm_count", d.gpu.sm_count())?;
    info.set_item("driver_version", d.gpu.driver_version().map_err(ops_to_py)?)?;
    Ok(info)
}

/// Device memory spattn holds on `device`, in bytes: a dict with `used` and `used_peak`
/// (memory handed out by the pool spattn allocates from: graph uploads, plans' workspaces),
/// and `reserved`, `reserved_peak` (what the pool holds from the driver). PyTorch's
/// `torch.cuda.max_memory_allocated` does not see these (its caching allocator does not use the
/// pool); the peak is reset by `reset_memory_pool_peak`.
#[pyfunction]
pub(crate) fn memory_pool_stats<'py>(py: Python<'py>, device: i64) -> PyResult<Bound<'py, PyDict>> {
    let _restore = ContextGuard::save();
    let d = self::device(ordinal(device)?).map_err(ops_to_py)?;
    use sys::CUmemPool_attribute as A;
    let stats = PyDict::new(py);
    for (key, attr) in [
        ("used", A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT),
        ("used_peak", A::CU_MEMPOOL_ATTR_USED_MEM_HIGH),
        ("reserved", A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT),
        ("reserved_peak", A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH),
    ] {
        stats.set_item(key, d.gpu.pool_attribute(attr).map_err(ops_to_py)?)?;
    }
    Ok(stats)
}

/// Hands the freed memory spattn's pool on `device` keeps back to the driver (as
/// `torch.cuda.empty_cache` does for PyTorch's).
#[pyfunction]
pub(crate) fn empty_memory_pool(device: i64) -> PyResult<()> {
    let _restore = ContextGuard::save();
    let d = self::device(ordinal(device)?).map_err(ops_to_py)?;
    d.gpu.trim_pool().map_err(ops_to_py)
}

/// Resets the peaks of `memory_pool_stats` to the current values.
#[pyfunction]
pub(crate) fn reset_memory_pool_peak(device: i64) -> PyResult<()> {
    let _restore = ContextGuard::save();
    let d = self::device(ordinal(device)?).map_err(ops_to_py)?;
    use sys::CUmemPool_attribute as A;
    for attr in [
        A::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
    ] {
        // 0 on a peak resets it to the current value.
        d.gpu.set_pool_attribute(attr, 0).map_err(ops_to_py)?;
    }
    Ok(())
}
