//! Dropout masks of kept bits, drawn once per call by `dropout_keep_bits` (csr_ops.cu) from
//! the same Philox draws as every kernel's `dropout_factor`, in the order a pass walks: read by
//! GAT's row-statistics kernels (`gat_rows.rs`) and the fused backward with edge features
//! (`fused.rs`).

use cudarc::driver::CudaViewMut;
use spattn_kernels_sys::CSR_OPS;

use crate::buffer::DeviceVec;
use crate::csr_ops::group_grid;
use crate::device_csr::DeviceCsr;
use crate::dropout::DropoutWords;
use crate::error::Result;
use crate::gpu::Gpu;
use crate::launch::{launch, product, to_u32, PushKernelArg, PushOptionalArg};

/// The u32 words of one dropout mask: a bit per edge and head, `⌈nnz·heads / 32⌉`.
/// The rows forward ([`GatForward::Rows`](super::GatForward::Rows)) takes one mask's
/// workspace, the rows backward one or two ([`super::KeepBits`]: Aᵀ's, and A's unless kept from
/// the forward).
///
/// Errors: [`crate::Error::InvalidArgument`] where `nnz·heads` overflows `usize`.
pub fn dropout_mask_words(nnz: usize, heads: usize) -> Result<usize> {
    Ok(product("edges x heads", &[nnz, heads])?.div_ceil(32))
}

/// Draws `a`'s dropout mask into `bits` (one mask's words): bit `k` of word `w`, element
/// `i = 32w + k = p·heads + h` of the order a pass walks, is whether A's element
/// `order[p]·heads + h` is kept (`order` `None`: `p` itself, A's order).
pub(super) fn draw_keep_bits(
    gpu: &Gpu,
    a: &DeviceCsr,
    heads: usize,
    order: Option<&DeviceVec<u32>>,
    drop: &DropoutWords,
    bits: &mut CudaViewMut<'_, u32>,
) -> Result<()> {
    let words = bits.len();
    if words == 0 {
        return Ok(());
    }
    let n = product("edges x heads", &[a.nnz(), heads])? as u64;
    let heads_u = to_u32("heads", heads)?;
    let name = spattn_kernels_sys::kernel!(CSR_OPS, "dropout_keep_bits");
    let f = gpu.load_function(CSR_OPS.name, CSR_OPS.ptx, name)?;
    let mut args = gpu.launch_builder(&f);
    args.arg(&n).arg(&heads_u).arg_or_null(order);
    drop.push(&mut args);
    args.arg(bits);
    // SAFETY: writes bits[w] for w < ⌈n / 32⌉ = words (the view's length: one mask of
    // dropout_mask_words, checked by the caller); reads order[p] for p = i / heads < nnz,
    // order being None or Aᵀ's edge map (nnz long).
    unsafe { launch(name, &mut args, group_grid(words, 1, 1)?) }
}
