//! The fused attention kernels, `out = softmax(scale · Q Kᵀ masked by A) · V` in one launch
//! (plus a merge where a row's edges were split), each with the host state it plans once:
//!
//! - [`FusedCsr`] ([`csr`]): CUDA cores over CSR, an online softmax per (row unit, head); any
//!   dtype in exact f32 arithmetic.
//! - [`FusedTensorCore`] ([`tc`]): tensor cores over BSB 16×8 bitmap blocks (Fused3S style).
//! - [`Hybrid`] ([`hybrid`]): tensor-core and CUDA-core warps of one kernel splitting each
//!   window's blocks by fill (RT-GNN style), the split chosen by timing candidates.
//!
//! `spattn::AttentionPlan` chooses among them; they are public for callers who build their own
//! plans. Each `supports` function says, before anything is uploaded, whether a shape can run
//! and what to use instead.

pub mod csr;
pub mod hybrid;
pub mod tc;

pub use csr::{CsrExtras, FusedCsr};
pub use hybrid::{Hybrid, HybridInfo, HybridParams};
pub use tc::FusedTensorCore;

use crate::edge_extras::DeviceBias;
use crate::DType;

/// The scalar arguments of the `_x` kernels.
pub(crate) struct KernelExtras {
    pub(crate) bias_heads: u32,
    pub(crate) key: [u32; 2],
    pub(crate) offset: [u32; 2],
    pub(crate) threshold: u32,
    pub(crate) scale: f32,
}

impl KernelExtras {
    pub(crate) fn new<T: DType>(e: &CsrExtras<'_, T>, heads: u32) -> Self {
        let shared = e.bias.as_ref().is_some_and(DeviceBias::is_shared);
        let (key, offset, threshold, scale) = match &e.dropout {
            // Threshold 0 keeps every edge: the kernel skips the generator.
            Some(d) => (
                d.key(),
                [d.offset() as u32, (d.offset() >> 32) as u32],
                d.threshold(),
                d.scale(),
            ),
            None => ([0; 2], [0; 2], 0, 1.0),
        };
        Self {
            bias_heads: if shared { 1 } else { heads },
            key,
            offset,
            threshold,
            scale,
        }
    }
}
