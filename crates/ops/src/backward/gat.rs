//! GAT's and GATv2's attention backward on the GPU, written once for every caller
//! (`spattn::layers`' `GatConv`, the Python package's GAT and GATv2): three steps composed of the
//! CSR ops. With the forward's [`crate::csr_ops::gat_scores`], the device twin of
//! [`crate::cpu::gat_attention`] and [`crate::cpu::gat_attention_backward`].
//!
//! Forward (the caller's): [`crate::csr_ops::gat_scores`] (`s = a_dst[i] + a_src[j] + bias`, or GATv2's
//! [`crate::csr_ops::sddmm_gatv2`]), [`crate::csr_ops::edge_softmax`] with the LeakyReLU (`P`),
//! [`crate::edge_extras::apply_dropout`] on a copy of `P` where dropout (`W`), then
//! [`crate::csr_ops::spmm`] (`out = W · x`).
//!
//! Backward: [`gat_score_grad`] (`dS`, the gradient of each pre-activation score: a bias's
//! gradient), [`gat_vector_grads`] (`Σ_row dS`, `Σ_column dS`: the attention vectors' terms),
//! [`gat_aggregation_grad`] (`dx = Wᵀ · dOut`). The caller chooses which buffers it keeps
//! (the layers keep `s` and `P` from the forward, the Python package recomputes them): every
//! step names what it reads and what it overwrites.

use crate::buffer::{DeviceMatrix, DeviceVec};
use crate::csr_ops;
use crate::device_csr::DeviceCsr;
use crate::dropout::Dropout;
use crate::dtype::DType;
use crate::edge_extras;
use crate::error::Result;
use crate::gpu::Gpu;

use super::{
    edge_leaky_relu_backward, edge_row_sum, edge_softmax_backward_in_place, transpose_edge_values,
    DeviceTranspose,
};

/// ∂L/∂score before the softmax's LeakyReLU into `ds` (`nnz × heads`, A's order): `dP =
/// ⟨dOut_i, x_j⟩` (times the dropout's factors where `dropout`: the aggregation used `W`),
/// the softmax backward with the probabilities `p` (before dropout), then LeakyReLU's
/// derivative at the pre-activation scores where `leaky` is `(slope, s)` (GAT; GATv2's
/// LeakyReLU sits inside its scores: `None`). Reads `p` and `s`, overwrites `ds`.
///
/// Errors: as the ops it composes ([`csr_ops::sddmm`], [`edge_softmax_backward_in_place`],
/// [`edge_leaky_relu_backward`]).
#[allow(clippy::too_many_arguments)]
pub fn gat_score_grad<T: DType>(
    gpu: &Gpu,
    a: &DeviceCsr,
    heads: usize,
    dropout: Option<&Dropout>,
    leaky: Option<(f32, &DeviceVec<f32>)>,
    p: &DeviceVec<f32>,
    (d_out, x): (&DeviceMatrix<T>, &DeviceMatrix<T>),
    ds: &mut DeviceVec<f32>,
) -> Result<()> {
    csr_ops::sddmm(gpu, a, d_out, x, 1.0, ds)?;
    if let Some(d) = dropout {
        edge_extras::apply_dropout(gpu, ds, d)?;
    }
    edge_softmax_backward_in_place(gpu, a, p, ds, heads)?;
    if let Some((slope, s)) = leaky {
        edge_leaky_relu_backward(gpu, s, slope, ds)?;
    }
    Ok(())
}

/// The attention vectors' per-node terms from `ds` (A's order): `d_dst[i, h] = Σ_row dS` and
/// `d_src[j, h] = Σ_column dS` (f32 sums: these feed sums over every node whose terms cancel).
/// Reads `ds`, overwrites `scratch` (`nnz × heads`: dS in Aᵀ's order).
///
/// Errors: as [`edge_row_sum`] and [`transpose_edge_values`].
pub fn gat_vector_grads(
    gpu: &Gpu,
    (a, t): (&DeviceCsr, &DeviceTranspose),
    heads: usize,
    ds: &DeviceVec<f32>,
    scratch: &mut DeviceVec<f32>,
    (d_dst, d_src): (&mut DeviceMatrix<f32>, &mut DeviceMatrix<f32>),
) -> Result<()> {
    edge_row_sum(gpu, a, ds, heads, d_dst)?;
    transpose_edge_values(gpu, t, ds, heads, scratch)?;
    edge_row_sum(gpu, t.csr(), scratch, heads, d_src)
}

/// The aggregation's share of ∂L/∂x: `dx = Wᵀ · dOut`, `w` the weights the forward aggregated
/// with (A's order: `P`, or `P` after dropout). Reads `w`, overwrites `scratch` (`nnz × heads`:
/// `W` in Aᵀ's order) and `dx`.
///
/// Errors: as [`transpose_edge_values`] and [`csr_ops::spmm`].
pub fn gat_aggregation_grad<T: DType>(
    gpu: &Gpu,
    t: &DeviceTranspose,
    heads: usize,
    w: &DeviceVec<f32>,
    scratch: &mut DeviceVec<f32>,
    d_out: &DeviceMatrix<T>,
    dx: &mut DeviceMatrix<T>,
) -> Result<()> {
    transpose_edge_values(gpu, t, w, heads, scratch)?;
    csr_ops::spmm(gpu, t.csr(), scratch, d_out, dx)
}
