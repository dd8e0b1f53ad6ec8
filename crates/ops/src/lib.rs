//! # spattn-ops
//!
//! The sparse ops of graph attention — SDDMM, edge softmax, SpMM — on the CPU and on NVIDIA
//! GPUs, and the GPU runtime they run on.
//!
//! (Crate documentation with a CPU example: being written.)

pub mod backward;
pub mod buffer;
pub mod cpu;
pub mod csr_ops;
pub mod dense;
pub mod device_bsb;
pub mod device_csr;
pub mod device_mebcrs;
pub mod dtype;
pub mod elementwise;
pub mod error;
pub mod gpu;
pub mod graph;
pub mod hybrid_spmm;
pub mod launch;
pub mod schedule;
pub mod shape;
pub mod tc_ops;

pub use backward::DeviceTranspose;
pub use buffer::{DeviceElement, DeviceMatrix, DeviceVec};
pub use csr_ops::CsrSchedule;
pub use device_bsb::DeviceBsb;
pub use device_csr::DeviceCsr;
pub use device_mebcrs::DeviceMeBcrs;
pub use dtype::{DType, DTypeKind};
pub use error::{Error, Result};
pub use gpu::{Gpu, GpuTimer};
pub use graph::{Backend, DeviceGraph, EdgeLayout, EdgeValues};
pub use hybrid_spmm::{DeviceHybrid, HybridStats, WarpSplit};
pub use shape::Shape;
