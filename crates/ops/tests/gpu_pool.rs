//! The device pool's release threshold: freed memory kept for later allocations, and handed
//! back by `trim_pool`.
//!
//! `#[ignore]`d on machines without an NVIDIA GPU; run it with
//! `cargo test -- --include-ignored` or from the GPU bundle (`cargo xtask gpu-bundle`).

use spattn_ops::DeviceVec;
use spattn_test_support::gpu;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_freed_memory_stays_in_the_pool_until_trimmed() {
    const BYTES: usize = 512 << 20;
    let gpu = gpu();
    gpu.keep_freed_memory(u64::MAX).unwrap();
    gpu.trim_pool().unwrap();
    let (free_before, _) = gpu.memory_info().unwrap();
    drop(DeviceVec::<u8>::zeros(&gpu, BYTES).unwrap());
    gpu.synchronize().unwrap();
    let (free_kept, _) = gpu.memory_info().unwrap();
    assert!(
        free_kept + BYTES / 2 <= free_before,
        "the pool kept {} of {BYTES} freed bytes",
        free_before.saturating_sub(free_kept)
    );
    gpu.trim_pool().unwrap();
    let (free_trimmed, _) = gpu.memory_info().unwrap();
    assert!(
        free_trimmed >= free_kept + BYTES / 2,
        "trimming handed back {} of {BYTES} bytes",
        free_trimmed.saturating_sub(free_kept)
    );
    // The driver's default again: freed memory goes back at the next synchronisation.
    gpu.keep_freed_memory(0).unwrap();
    drop(DeviceVec::<u8>::zeros(&gpu, BYTES).unwrap());
    gpu.synchronize().unwrap();
    let (free_released, _) = gpu.memory_info().unwrap();
    assert!(
        free_released + BYTES / 2 > free_trimmed,
        "a release threshold of 0 kept {} bytes",
        free_trimmed.saturating_sub(free_released)
    );
}
