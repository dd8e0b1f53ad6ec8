//! Trainable layers over sparse attention — the graph-transformer attention layer, GATConv and
//! AGNNConv — each with a forward and an exact backward on the GPU and on the CPU.
//!
//! No autograd: parameters and their gradients are plain buffers ([`Param`]), each layer's
//! `forward` returns its output and a cache, `backward` takes the cache and the output's
//! gradient, accumulates the parameters' gradients and returns the input's, and an optimizer
//! ([`Adam`], [`Sgd`]) updates the parameters and clears the gradients. A training step:
//!
//! ```
//! use spattn::layers::{Adam, GatConfig, GatConv, Host, HostGraph};
//! use spattn_formats::Csr;
//!
//! let a = Csr::from_edges(4, 4, &[(0, 1), (1, 2), (2, 3), (3, 0)])?.symmetrize_with_self_loops()?;
//! let graph = HostGraph::new(&a)?;
//! let mut gat = GatConv::<Host<f32>>::new(GatConfig::new(3, 2, 2), &graph, 7)?;
//! let mut adam = Adam::new(0.01);
//! let x: Vec<f32> = (0..4 * 3).map(|i| (i as f32).sin()).collect();
//! let (y, cache) = gat.forward(&x)?;                 // 4 × (2 heads · 2)
//! let dy: Vec<f32> = y.iter().map(|v| 2.0 * v).collect(); // d(Σ y²)/dy
//! let _dx = gat.backward(&cache, &dy)?;              // gradients accumulate in the params
//! adam.step(gat.params_mut())?;                       // update, and zero the gradients
//! # Ok::<(), spattn::Error>(())
//! ```
//!
//! The GPU twin of a host layer comes from `to_device::<T>(&gpu_graph)` ([`GpuGraph`]) (parameters rounded
//! to `T` = f32, f16 or bf16; gradients of parameters kept in f32); it runs the same API on
//! [`DeviceMatrix`](spattn_ops::DeviceMatrix) activations. Dense projections go through cuBLAS
//! ([`spattn_ops::Blas`]), the sparse parts through [`AttentionPlan`](crate::AttentionPlan)
//! and the CSR ops.

mod agnn;
mod gat;
mod params;
mod transformer;

pub use agnn::{AgnnCache, AgnnConv};
pub use gat::{GatCache, GatConfig, GatConv};
pub use params::{
    Adam, Device, DeviceParam, GpuContext, GpuGraph, Host, HostGraph, HostParam, Linear,
    Optimizable, Param, Sgd,
};
pub use spattn_ops::elementwise::{Activation, AdamHyper};
pub use transformer::{GraphTransformerLayer, TransformerCache, TransformerConfig};
