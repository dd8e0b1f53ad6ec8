//! # spattn-ops
//!
//! The sparse ops of graph attention — SDDMM, edge softmax, SpMM — on the CPU and on NVIDIA
//! GPUs, and the GPU runtime they run on.
//!
//! - [`cpu`]: the reference ops on host slices, generic over f32 / f64 (the tests' f64
//!   references, and the CPU path of `spattn`'s plans).
//! - [`Gpu`], [`DeviceVec`], [`DeviceMatrix`]: the runtime (cudarc, libcuda loaded at run time,
//!   so everything builds without CUDA); the kernels' PTX comes from `spattn-kernels-sys`.
//! - [`csr_ops`]: CUDA-core SDDMM, edge softmax and SpMM on CSR; [`tc_ops`]: tensor-core ones on
//!   ME-BCRS ([`DeviceMeBcrs`]); [`graph::DeviceGraph`] picks a backend per call.
//! - [`hybrid_spmm`]: the RT-GNN-style hybrid (dense 16×8 blocks on tensor cores, the other
//!   edges on CUDA cores of the same kernel), and [`HybridSpmm`](hybrid_spmm::HybridSpmm), a
//!   hybrid SpMM planned once by timing its candidates.
//! - [`fused`]: the fused attention kernels; [`backward`]: their gradients and the unfused
//!   backward ops; [`cpu`]: the f64 / f32 reference of everything.
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

// The public API is what this file names: the op families are public modules, each item
// reached through its module only; the runtime types live in private modules, re-exported
// below. `unreachable_pub` keeps it so: a `pub` item that no public path reaches is a warning
// (an error under CI's clippy -D warnings), so the rest of the crate says `pub(crate)`.
#![warn(unreachable_pub)]

pub mod backward;
mod buffer;
pub mod cpu;
pub mod csr_ops;
pub mod dense;
mod device_bsb;
mod device_csr;
mod device_mebcrs;
pub mod device_plan;
mod dropout;
mod dtype;
pub mod edge_extras;
pub mod elementwise;
mod error;
mod external;
pub mod fused;
mod gpu;
pub mod graph;
mod hybrid_plan;
pub mod hybrid_spmm;
mod launch;
pub mod nccl;
mod ptx_split;
pub mod rows;
mod schedule;
mod shape;
mod side_stream;
pub mod tc_ops;
pub mod tune;

#[cfg(test)]
mod launched_tests;
#[cfg(test)]
mod runtime_tests;

pub use buffer::{DeviceElement, DeviceMatrix, DeviceVec};
pub use device_csr::DeviceCsr;
pub use device_mebcrs::DeviceMeBcrs;
pub use dropout::Dropout;
pub use dtype::{DType, DTypeKind, ParseDTypeKindError};
pub use error::{Error, Result};
pub use external::{ExternalMatrix, ExternalVec, StreamBridge};
pub use gpu::{Gpu, GpuTimer};
/// The half-precision element types ([`DType`]), so that a caller needs no `half` of its own.
pub use half::{bf16, f16};
pub use shape::Shape;

// Shorter paths inside the crate.
pub(crate) use graph::DeviceGraph;
pub(crate) use hybrid_spmm::{DeviceHybrid, WarpSplit};
