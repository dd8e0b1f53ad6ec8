//! # spattn
//!
//! Sparse graph attention on NVIDIA GPUs, from Rust:
//!
//! ```text
//! out = softmax_row( scale · (Q Kᵀ) masked by A ) · V
//! ```
//!
//! with A the graph's adjacency (row `i` lists the nodes node `i` attends to) and Q, K, V of
//! `nodes × heads × head_dim`, row-major. Build an [`AttentionPlan`] once per graph and
//! configuration; it chooses an [`Algorithm`] (or takes the one you name), uploads what that
//! algorithm needs, and then runs [`AttentionPlan::forward`] as often as asked. Where there is
//! no GPU, [`AttentionPlan::new_cpu`] computes the same thing on the CPU.
//!
//! Everything a user needs is re-exported here (the graph types and readers of
//! `spattn-formats`, the GPU handle, dtypes and device matrices of `spattn-ops`), so one crate
//! is enough:
//!
//! ```
//! use spattn::{AttentionConfig, AttentionPlan, Csr, DTypeKind, Gpu};
//!
//! // A 4-node ring, symmetrized with self loops (the GAT / graph-transformer convention).
//! let a = Csr::from_edges(4, 4, &[(0, 1), (1, 2), (2, 3), (3, 0)])?.symmetrize_with_self_loops()?;
//! let config = AttentionConfig::new(2, 8, DTypeKind::F32); // 2 heads of 8 features
//! let plan = match Gpu::new(0) {
//!     Ok(gpu) => AttentionPlan::new_gpu(&gpu, &a, config)?,
//!     Err(_) => AttentionPlan::new_cpu(&a, config)?, // no GPU here: same results on the CPU
//! };
//! println!("{}: {}", plan.algorithm(), plan.choice());
//! let x: Vec<f32> = (0..4 * 2 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
//! let out = plan.forward_host(&x, &x, &x)?;
//! assert_eq!(out.len(), 4 * 2 * 8);
//! assert!(out.iter().all(|v| v.is_finite()));
//! # Ok::<(), spattn::Error>(())
//! ```
//!
//! ## A new graph every step (mini-batch training)
//!
//! A sampled subgraph or a batch of molecules is seen once: build it on the GPU from its edge
//! list there ([`DeviceGraph::from_device_edges`]: sorted, merged and laid out by kernels, one
//! read back of its sizes), so that nothing goes through the host, and plan over it with
//! [`AttentionPlan::on_graph`]. Its [`PlanPolicy`] is [`PlanPolicy::Once`]: `Auto` keeps its
//! rows in their order. A graph used for many steps is [`PlanPolicy::Reuse`] (the default of
//! one made from a host [`Csr`]): `Auto` then chooses a row order once, on the host, which the
//! kernels repay over many calls; a named [`Reorder`] in the configuration orders any graph.
//!
//! ```no_run
//! use std::sync::Arc;
//! use spattn::ops::{DeviceEdges, DeviceIds, GraphSpec};
//! use spattn::{AttentionConfig, AttentionPlan, DTypeKind, DeviceGraph, DeviceMatrix, DeviceVec, Gpu, PlanPolicy};
//!
//! let gpu = Gpu::new(0)?;
//! // This step's edges (a sampler's output on the device; PyG's edge_index rows).
//! let (src, dst) = (DeviceVec::from_host(&gpu, &[1i64, 2, 0])?, DeviceVec::from_host(&gpu, &[0i64, 0, 2])?);
//! let edges = DeviceEdges { sources: DeviceIds::contiguous(&src), targets: DeviceIds::contiguous(&dst), len: 3 };
//! let spec = GraphSpec { self_loops: true, transpose: true, ..GraphSpec::square(3) };
//! let (graph, _report) = DeviceGraph::from_device_edges(&gpu, &edges, &spec, None)?;
//! assert_eq!(graph.policy(), PlanPolicy::Once);
//! let graph = Arc::new(graph);
//! let plan = AttentionPlan::on_graph(&graph, AttentionConfig::new(8, 32, DTypeKind::F16))?;
//! let q = DeviceMatrix::<spattn::f16>::zeros(&gpu, plan.shape_q())?;
//! let mut out = DeviceMatrix::zeros(&gpu, plan.shape_q())?;
//! plan.forward(&q, &q, &q, &mut out)?;
//! // The layers bind it too: spattn::layers::GpuGraph::on_device(&ctx, graph.clone()).
//! # Ok::<(), spattn::Error>(())
//! ```
#![forbid(unsafe_code)]

mod backward;
mod config;
mod error;
mod extras;
pub mod layers;
pub mod partition;
mod plan;

pub use backward::{AttentionGradients, BackwardKernels, RowStats};
pub use config::{Algorithm, AttentionConfig, HybridParams, Reorder};
pub use error::{Error, Result};
pub use extras::{Extras, ExtrasGrads, HostExtras};
pub use plan::AttentionPlan;
pub use spattn_ops::edge_extras::DeviceBias;
pub use spattn_ops::HybridInfo;

// What a user of the plans needs from the crates beneath.
/// The 16-bit element types of f16 and bf16 plans (the `half` crate's).
pub use half::{bf16, f16};
pub use spattn_formats::{
    read_edge_list, read_matrix_market, rmat, Coo, Csr, EdgeListOptions, RmatConfig,
};
pub use spattn_ops::{DType, DTypeKind, DeviceMatrix, DeviceVec, Dropout, Gpu, Shape};
pub use spattn_ops::{DeviceGraph, PlanPolicy};

/// The formats crate (`spattn-formats`), for what the re-exports above leave out.
pub use spattn_formats as formats;

/// What the plans and layers are built from (`spattn-ops`), for work they do not cover: the f64 CPU
/// reference ([`cpu`](ops::cpu)), the CUDA-core ops on a CSR and their backward
/// ([`csr_ops`](ops::csr_ops), [`backward`](ops::backward), [`edge_extras`](ops::edge_extras)),
/// graphs built from edge lists on the device ([`GraphSpec`](ops::GraphSpec) and its companions),
/// views of foreign device memory ([`ExternalVec`](ops::ExternalVec),
/// [`ExternalMatrix`](ops::ExternalMatrix), [`StreamBridge`](ops::StreamBridge)), NCCL
/// ([`NcclComm`](ops::NcclComm)), the layers' small kernels ([`elementwise`](ops::elementwise):
/// GAT's score terms for layers built elsewhere, as the Python package's) and the ops' own
/// [`Error`](ops::Error) (what [`Error::Ops`] holds). The rest of `spattn-ops` (the tensor-core
/// ops, the fused kernels, cuBLAS, the tuner) is reached through the plans and layers.
pub mod ops {
    pub use spattn_ops::NcclComm;
    pub use spattn_ops::{backward, cpu, csr_ops, edge_extras, elementwise};
    pub use spattn_ops::{
        widen_to_i64, BuildReport, DeviceEdges, DeviceIds, DeviceIndex, GraphSpec, PlanWorkspace,
    };
    pub use spattn_ops::{DeviceCsr, Error, ExternalMatrix, ExternalVec, Result, StreamBridge};
}
