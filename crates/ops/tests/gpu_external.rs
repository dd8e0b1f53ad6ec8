//! GPU tests of the zero-copy views of foreign device memory and of the stream bridge
//! (`spattn_ops::{ExternalVec, ExternalMatrix, StreamBridge}`): ops write the foreign memory in place, dropping a view never frees
//! it, bad pointers are errors naming the operand, and work is ordered with a foreign stream.
//!
//! `#[ignore]`d where there is no NVIDIA GPU.

use cudarc::driver::sys;
use spattn_ops::{Error, ExternalMatrix, ExternalVec, Gpu, Shape, StreamBridge};
use spattn_test_support::gpu;

/// `bytes` of device memory from the driver itself (not through spattn), freed by `Drop`:
/// a stand-in for PyTorch's allocations.
struct Foreign {
    ptr: sys::CUdeviceptr,
}

impl Foreign {
    fn new(gpu: &Gpu, bytes: usize) -> Self {
        gpu.context().bind_to_thread().unwrap();
        let mut ptr = 0;
        // SAFETY: writes one device pointer through a live local; the context is bound.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }
            .result()
            .unwrap();
        Self { ptr }
    }

    fn read_f32(&self, gpu: &Gpu, len: usize) -> Vec<f32> {
        gpu.synchronize().unwrap();
        let mut host = vec![0f32; len];
        // SAFETY: copies len f32 from the allocation (at least that long) into `host`.
        unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), self.ptr, len * 4) }
            .result()
            .unwrap();
        host
    }
}

impl Drop for Foreign {
    fn drop(&mut self) {
        // A second free (had a view freed it) would fail here.
        // SAFETY: frees the allocation made in `new`, once.
        unsafe { sys::cuMemFree_v2(self.ptr) }
            .result()
            .expect("freed once");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn views_write_in_place_and_never_free() {
    let gpu = gpu();
    let shape = Shape::new(5, 2, 8).unwrap();
    let mem = Foreign::new(&gpu, shape.len() * 4);
    for round in 0..3 {
        // SAFETY: the allocation holds shape.len() f32 and outlives the view; the test reads
        // it only after synchronising.
        let mut view = unsafe { ExternalMatrix::<f32>::new(&gpu, "x", mem.ptr, shape) }.unwrap();
        view.fill(round as f32 + 0.5).unwrap();
        drop(view);
        assert!(mem
            .read_f32(&gpu, shape.len())
            .iter()
            .all(|&v| v == round as f32 + 0.5));
    }
    // An empty view ignores its pointer.
    // SAFETY: no element is read or written.
    let empty = unsafe { ExternalVec::<f32>::new(&gpu, "e", 0, 0) }.unwrap();
    assert!(empty.is_empty());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bad_pointers_are_errors_naming_the_operand() {
    let gpu = gpu();
    // 2 MiB: a whole page of the driver's allocation granularity, so the range it reports is
    // exactly this allocation's.
    let bytes = 2 << 20;
    let mem = Foreign::new(&gpu, bytes);
    let bad = |ptr: u64, len: usize| {
        // SAFETY: every case is refused before the memory is touched (asserted below).
        match unsafe { ExternalVec::<f32>::new(&gpu, "q", ptr, len) } {
            Err(Error::InvalidArgument { what: "q", why }) => why,
            other => panic!("expected an InvalidArgument naming q, got {other:?}"),
        }
    };
    assert!(bad(0, 4).contains("null"));
    assert!(bad(mem.ptr + 4, 4).contains("aligned"));
    assert!(bad(mem.ptr, bytes / 4 + 1).contains("past the end"));
    let host = vec![0f32; 64];
    let why = bad(host.as_ptr() as u64 & !15, 4);
    assert!(
        why.contains("not device memory") || why.contains("device -1"),
        "{why}"
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn bridge_orders_work_with_a_foreign_stream() {
    let gpu = gpu();
    let n = 1 << 20;
    let mem = Foreign::new(&gpu, n * 4);
    let foreign = gpu.context().new_stream().unwrap();
    let ext = foreign.cu_stream() as u64;
    let bridge = StreamBridge::new(&gpu).unwrap();
    for round in 0..4u32 {
        let value = round as f32 + 1.0;
        // On the foreign stream: write the memory.
        // SAFETY: n 32-bit words of the allocation, on a live stream of this context.
        unsafe { sys::cuMemsetD32Async(mem.ptr, value.to_bits(), n, foreign.cu_stream()) }
            .result()
            .unwrap();
        // SAFETY: the allocation holds n f32 and outlives the view; `ext` is a live stream of
        // gpu's context for the whole call.
        let copy = unsafe {
            let view = ExternalVec::<f32>::new(&gpu, "x", mem.ptr, n).unwrap();
            bridge.run(ext, || view.try_clone()).unwrap()
        };
        // On the foreign stream again, after the bridge: overwrite. The copy must hold the
        // value written before the call, the memory the one written after.
        // SAFETY: as above.
        unsafe { sys::cuMemsetD32Async(mem.ptr, 0, n, foreign.cu_stream()) }
            .result()
            .unwrap();
        foreign.synchronize().unwrap();
        assert!(copy.to_host().unwrap().iter().all(|&v| v == value));
        assert!(mem.read_f32(&gpu, 16).iter().all(|&v| v == 0.0));
    }
}
