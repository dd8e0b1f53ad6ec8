//! The fused attention kernels, `out = softmax(scale · Q Kᵀ masked by A) · V` in one launch
//! (plus a merge where a row's edges were split), each with the host state it plans once:
//!
//! - [`FusedCsr`]: CUDA cores over CSR, an online softmax per (row unit, head); any
//!   dtype in exact f32 arithmetic.
//! - [`FusedTensorCore`]: tensor cores over BSB 16×8 bitmap blocks (Fused3S style).
//! - [`Hybrid`]: tensor-core and CUDA-core warps of one kernel splitting each
//!   window's blocks by fill (RT-GNN style), the split chosen by timing candidates.
//!
//! `spattn::AttentionPlan` chooses among them; they are public for callers who build their own
//! plans. Each one's `supports` says, before anything is uploaded, whether a shape can run
//! and what to use instead.

pub(crate) mod csr;
pub(crate) mod hybrid;
pub(crate) mod tc;

pub use csr::{CsrExtras, FusedCsr};
pub use hybrid::{Hybrid, HybridInfo, HybridParams};
pub use tc::FusedTensorCore;

use crate::dropout::DropoutWords;
use crate::edge_extras::DeviceBias;
use crate::error::{Error, Result};
use crate::launch::check_same_gpu;
use crate::{DType, Gpu, Shape};

impl<T: DType> CsrExtras<'_, T> {
    /// Checks the extras of one call of `kernel` against a graph of `nnz` edges and `heads ×
    /// head_dim` of `shape` on `gpu`: the bias's length and GPU, and edge features where the
    /// kernel takes them (`features`; else [`Error::Unsupported`] naming those that do) of
    /// `nnz × heads × head_dim`.
    pub(crate) fn check(
        &self,
        gpu: &Gpu,
        kernel: &'static str,
        nnz: usize,
        shape: Shape,
        features: bool,
    ) -> Result<()> {
        if let Some(b) = &self.bias {
            b.check_len(nnz, shape.heads)?;
            check_same_gpu(gpu, "bias", b.values())?;
        }
        if let Some(f) = self.edge_features {
            if !features {
                return Err(Error::Unsupported {
                    kernel,
                    why: "takes a score bias and dropout but not edge features (unfused-csr, \
                          fused-csr, unfused-tc and fused-tc on f16 / bf16 heads of 64 or 128 \
                          features take them)"
                        .into(),
                });
            }
            let expected = Shape::new(nnz, shape.heads, shape.head_dim)?;
            if f.shape() != expected {
                return Err(Error::ShapeMismatch {
                    what: "edge features (nnz × heads × head_dim)",
                    expected,
                    actual: f.shape(),
                });
            }
            check_same_gpu(gpu, "edge features", f)?;
        }
        Ok(())
    }
}

/// The scalar arguments of the `_x` kernels.
pub(crate) struct KernelExtras {
    pub(crate) bias_heads: u32,
    /// The dropout's words (threshold 0 keeps every edge: the kernel skips the generator).
    pub(crate) drop: DropoutWords,
}

impl KernelExtras {
    pub(crate) fn new<T: DType>(e: &CsrExtras<'_, T>, heads: u32) -> Self {
        let shared = e.bias.as_ref().is_some_and(DeviceBias::is_shared);
        Self {
            bias_heads: if shared { 1 } else { heads },
            drop: DropoutWords::of(e.dropout.as_ref()),
        }
    }

    /// Pushes the dropout's words (key, offset, threshold, scale), the `_x` kernels' last
    /// arguments.
    pub(crate) fn push_dropout<'a>(&'a self, args: &mut cudarc::driver::LaunchArgs<'a>) {
        self.drop.push(args);
    }
}
