//! # spattn-ops
//!
//! The sparse ops of graph attention — SDDMM, edge softmax, SpMM — on the CPU and on NVIDIA
//! GPUs, and the GPU runtime they run on.
//!
//! - [`cpu`]: the reference ops on host slices, generic over f32 / f64 (the tests' f64
//!   references, and the CPU path of `spattn`'s plans).
//! - [`Gpu`], [`DeviceVec`], [`DeviceMatrix`]: the runtime (cudarc, libcuda loaded at run time,
//!   so everything builds without CUDA); the kernels' PTX comes from `spattn-kernels-sys`.
//! - [`csr_ops`]: CUDA-core SDDMM, edge softmax and SpMM on a [`DeviceCsr`]; [`tc_ops`]:
//!   tensor-core ones on ME-BCRS ([`DeviceMeBcrs`]); [`sddmm`], [`edge_softmax_in_place`] and
//!   [`spmm`] on a [`DeviceGraph`] take the [`Engine`] per call.
//! - The fused attention kernels: [`FusedCsr`], [`FusedTensorCore`] and [`Hybrid`] (RT-GNN's
//!   split: dense 16×8 blocks on tensor cores, the other edges on CUDA cores of the same
//!   kernel); [`HybridSpmm`], that split for SpMM, planned once by timing its candidates.
//! - [`backward`]: the gradients (fused, and the unfused ops), with GAT's and GATv2's attention;
//!   [`edge_extras`] and [`elementwise`]: score biases, edge features, dropout and the layers'
//!   small kernels; [`cpu`]: the f64 / f32 reference of everything.
//! - Graphs built on the device from edge lists ([`GraphSpec`],
//!   [`DeviceGraph::from_device_edges`]), rows gathered and scattered ([`gather_rows`]), cuBLAS
//!   GEMMs ([`Blas`]), NCCL ([`NcclComm`]), and the timing helpers of plans built by measuring
//!   ([`Fastest`], [`median_ms`]).
//!
//! Shapes are `rows × heads × head_dim`, row-major ([`Shape`]); per-edge values are
//! `nnz × heads` in the CSR's edge order. Errors are one [`Error`] enum naming the operand.
//!
//! On the CPU, attention is SDDMM → edge softmax → SpMM:
//!
//! ```
//! use spattn_formats::Csr;
//! use spattn_ops::{cpu, Shape};
//!
//! // Node 0 attends to nodes 0 and 1, node 1 to node 1; one head of 2 features.
//! let a = Csr::from_edges(2, 2, &[(0, 0), (0, 1), (1, 1)])?;
//! let shape = Shape::new(2, 1, 2)?;
//! let q = [1.0f64, 0.0, 0.0, 1.0];
//! let k = [1.0f64, 0.0, 0.0, 1.0];
//! let v = [1.0f64, 2.0, 3.0, 4.0];
//! let mut scores = vec![0.0f64; a.nnz()];
//! cpu::sddmm(&a, &q, &k, shape, shape, 1.0, &mut scores)?; // q_i · k_j per edge
//! assert_eq!(scores, [1.0, 0.0, 1.0]);
//! cpu::edge_softmax_in_place(&a, &mut scores, 1, None)?; // per row
//! let mut out = vec![0.0f64; 4];
//! cpu::spmm(&a, &scores, &v, shape, &mut out)?;
//! // Row 1 has one neighbour: its output is V[1]. Row 0 mixes V[0] and V[1].
//! assert_eq!(&out[2..], &[3.0, 4.0]);
//! let w0 = 1.0f64.exp() / (1.0f64.exp() + 1.0);
//! assert!((out[0] - (w0 * 1.0 + (1.0 - w0) * 3.0)).abs() < 1e-12);
//!
//! // The same in one call.
//! let inputs = cpu::AttentionInputs::new(&q, shape, &k, shape, &v, shape);
//! let mut fused = vec![0.0f64; 4];
//! cpu::attention(&a, &inputs, 1.0, &mut fused)?;
//! assert!(fused.iter().zip(&out).all(|(x, y)| (x - y).abs() < 1e-12));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

// The public API is what this file names: public modules only for the op families whose names
// would collide at the root (three `sddmm`s), everything else re-exported from private modules
// below. `unreachable_pub` keeps it so: a `pub` item that no public path reaches is a warning
// (an error under CI's clippy -D warnings), so the rest of the crate says `pub(crate)`.
#![warn(unreachable_pub)]

pub mod backward;
mod buffer;
pub mod cpu;
pub mod csr_ops;
mod dense;
mod device_bsb;
mod device_csr;
mod device_mebcrs;
mod device_plan;
mod dropout;
mod dtype;
pub mod edge_extras;
pub mod elementwise;
mod error;
mod external;
mod fused;
mod gatv2;
mod gpu;
mod graph;
mod hybrid_plan;
mod hybrid_spmm;
mod launch;
mod nccl;
mod ptx_split;
mod rows;
mod schedule;
mod shape;
mod side_stream;
pub mod tc_ops;
mod tune;

#[cfg(test)]
mod launched_tests;
#[cfg(test)]
mod probes;
#[cfg(test)]
mod runtime_tests;
#[cfg(test)]
mod test_util;
// The unit tests that moved from tests/ name this crate as its users do.
#[cfg(test)]
extern crate self as spattn_ops;

pub use buffer::{DeviceElement, DeviceMatrix, DeviceVec};
pub use dense::{gemm, host_gemm, Blas, Dims, GemmElement};
pub use device_csr::DeviceCsr;
pub use device_mebcrs::DeviceMeBcrs;
pub use device_plan::{
    widen_to_i64, BuildReport, DeviceEdges, DeviceIds, DeviceIndex, GraphSpec, PlanWorkspace,
};
pub use dropout::Dropout;
pub use dtype::{DType, DTypeKind};
pub use error::{Error, Result};
pub use external::{ExternalMatrix, ExternalVec, StreamBridge};
pub use fused::{CsrExtras, FusedCsr, FusedTensorCore, Hybrid, HybridInfo, HybridParams};
pub use gpu::{Gpu, GpuTimer};
pub use graph::{
    edge_softmax_in_place, sddmm, spmm, DeviceGraph, EdgeLayout, EdgeValues, Engine, PlanPolicy,
};
/// The half-precision element types ([`DType`]), so that a caller needs no `half` of its own.
pub use half::{bf16, f16};
pub use hybrid_plan::HybridSpmm;
pub use nccl::{check_blocks, check_own_block, share_pools, AroundOwn, NcclComm, NcclId};
pub use rows::{gather_rows, gather_rows_into, scatter_add_rows, RowIndex};
pub use shape::Shape;
pub use tune::{median_ms, median_of_runs, Fastest};

// Shorter paths inside the crate.
pub(crate) use hybrid_spmm::{DeviceHybrid, WarpSplit};
