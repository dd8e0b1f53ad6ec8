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
