//! Per-call choice between the CUDA-core ops on CSR ([`crate::csr_ops`]) and the tensor-core ops
//! on ME-BCRS ([`crate::tc_ops`]), behind one set of signatures.
//!
//! A [`DeviceGraph`] holds the graph in the formats its backends read; [`EdgeValues`] are
//! per-edge f32 values (scores, probabilities) tagged with their layout: CSR edge order
//! (`nnz × heads`) or ME-BCRS slots (`heads × n_slots`). Each op takes a [`Backend`]: outputs come
//! in that backend's layout, inputs in another layout are converted first (one gather or
//! scatter over the edges — cheap next to the op, but free only when the layouts already
//! agree, so keep a chain of ops on one backend).
//!
//! ```no_run
//! use spattn_formats::Csr;
//! use spattn_ops::graph::{self, Backend, DeviceGraph, EdgeValues};
//! use spattn_ops::{DeviceMatrix, Gpu, Shape};
//! use half::f16;
//!
//! let gpu = Gpu::new(0)?;
//! let a = Csr::from_edges(3, 3, &[(0, 1), (0, 2), (1, 0), (2, 2)])?;
//! let g = DeviceGraph::upload(&gpu, &a)?;
//! let shape = Shape::new(3, 2, 64)?;
//! let x: Vec<f16> = (0..shape.len()).map(|i| f16::from_f32((i % 7) as f32 / 7.0)).collect();
//! let q = DeviceMatrix::from_host(&gpu, shape, &x)?;
//! let mut out = DeviceMatrix::<f16>::zeros(&gpu, shape)?;
//! for backend in [Backend::CudaCore, Backend::TensorCore] {
//!     let mut s = EdgeValues::zeros(&gpu, &g, backend.layout(), 2)?;
//!     graph::sddmm(&gpu, &g, backend, &q, &q, 0.125, &mut s)?;
//!     graph::edge_softmax_in_place(&gpu, &g, backend, &mut s, None)?;
//!     graph::spmm(&gpu, &g, backend, &s, &q, &mut out)?;
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;

use spattn_formats::{Csr, Reorder};

use crate::buffer::{DeviceMatrix, DeviceVec};
use crate::device_csr::DeviceCsr;
use crate::device_mebcrs::DeviceMeBcrs;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{check_per_edge, check_same_gpu, OnGpu};
use crate::{csr_ops, tc_ops};

/// Which kernels run an op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// CUDA cores on CSR ([`crate::csr_ops`]): any GPU, exact f32 arithmetic on every dtype.
    CudaCore,
    /// Tensor cores on ME-BCRS ([`crate::tc_ops`]): compute capability 8.0+, f16/bf16 `mma`
    /// (f32 operands through tf32), f32 accumulation.
    TensorCore,
}

impl Backend {
    /// Both backends.
    pub const ALL: [Backend; 2] = [Backend::CudaCore, Backend::TensorCore];

    /// The layout of the per-edge values the backend's ops read and write.
    pub const fn layout(self) -> EdgeLayout {
        match self {
            Backend::CudaCore => EdgeLayout::Csr,
            Backend::TensorCore => EdgeLayout::Slots,
        }
    }

    /// A short name: `"cuda-core"` or `"tensor-core"`.
    pub const fn name(self) -> &'static str {
        match self {
            Backend::CudaCore => "cuda-core",
            Backend::TensorCore => "tensor-core",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How per-edge values are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EdgeLayout {
    /// CSR edge order, heads inner: `nnz × heads`, element `e · heads + h`.
    Csr,
    /// ME-BCRS slots, head-major: `heads × n_slots`, element `h · n_slots + slot`; padding
    /// slots carry no data (see [`crate::tc_ops`]).
    Slots,
}

/// A graph in device memory, in the formats of the backends it was uploaded for: always CSR,
/// and ME-BCRS for [`Backend::TensorCore`].
#[derive(Debug)]
pub struct DeviceGraph {
    csr: DeviceCsr,
    mebcrs: Option<DeviceMeBcrs>,
}

impl DeviceGraph {
    /// Uploads `csr` for every backend the device supports: CSR, and ME-BCRS where the compute
    /// capability is 8.0 or newer (converted on the host once, here).
    pub fn upload(gpu: &Gpu, csr: &Csr) -> Result<Self> {
        let tc = gpu
            .require_compute_capability("tensor-core ops", 8, 0)
            .is_ok();
        let backends: &[Backend] = if tc {
            &Backend::ALL
        } else {
            &[Backend::CudaCore]
        };
        Self::upload_for(gpu, csr, backends)
    }

    /// Uploads `csr` for the listed backends only (CSR is always uploaded: the edge order of
    /// [`EdgeLayout::Csr`] is defined by it). The ME-BCRS keeps the graph's row order.
    pub fn upload_for(gpu: &Gpu, csr: &Csr, backends: &[Backend]) -> Result<Self> {
        Self::upload_for_reordered(gpu, csr, backends, Reorder::None)
    }

    /// [`Self::upload_for`] with the ME-BCRS rows renumbered as `reorder` says
    /// ([`DeviceMeBcrs::from_csr_reordered`]): fewer vectors for the tensor-core ops, the same
    /// arrays in and out (the edge order of [`EdgeLayout::Csr`] stays the graph's).
    pub fn upload_for_reordered(
        gpu: &Gpu,
        csr: &Csr,
        backends: &[Backend],
        reorder: Reorder,
    ) -> Result<Self> {
        let mebcrs = if backends.contains(&Backend::TensorCore) {
            Some(DeviceMeBcrs::from_csr_reordered(gpu, csr, reorder)?)
        } else {
            None
        };
        Ok(DeviceGraph {
            csr: DeviceCsr::upload(gpu, csr)?,
            mebcrs,
        })
    }

    /// A graph from uploads made elsewhere; `mebcrs`, when given, must hold the same matrix as
    /// `csr` on the same handle (its dimensions and edge count are checked).
    pub fn from_parts(csr: DeviceCsr, mebcrs: Option<DeviceMeBcrs>) -> Result<Self> {
        if let Some(me) = &mebcrs {
            check_same_gpu(csr.gpu(), "ME-BCRS", me)?;
            let same =
                (me.n_rows(), me.n_cols(), me.nnz()) == (csr.n_rows(), csr.n_cols(), csr.nnz());
            if !same {
                return Err(Error::InvalidArgument {
                    what: "ME-BCRS",
                    why: format!(
                        "{} x {} with {} edges, but the CSR is {} x {} with {} edges",
                        me.n_rows(),
                        me.n_cols(),
                        me.nnz(),
                        csr.n_rows(),
                        csr.n_cols(),
                        csr.nnz()
                    ),
                });
            }
        }
        Ok(DeviceGraph { csr, mebcrs })
    }

    /// The CSR upload (CUDA-core backend).
    pub fn csr(&self) -> &DeviceCsr {
        &self.csr
    }

    /// The ME-BCRS upload (tensor-core backend), or [`Error::InvalidArgument`] if the graph was
    /// uploaded without it.
    pub fn mebcrs(&self) -> Result<&DeviceMeBcrs> {
        self.mebcrs.as_ref().ok_or_else(|| Error::InvalidArgument {
            what: "backend",
            why: "the graph was uploaded without ME-BCRS: the tensor-core backend needs \
                  DeviceGraph::upload on a GPU of compute capability 8.0+, or upload_for with \
                  Backend::TensorCore"
                .into(),
        })
    }

    /// Whether the graph holds the format `backend` reads.
    pub fn supports(&self, backend: Backend) -> bool {
        match backend {
            Backend::CudaCore => true,
            Backend::TensorCore => self.mebcrs.is_some(),
        }
    }

    /// Number of rows (query nodes).
    pub fn n_rows(&self) -> usize {
        self.csr.n_rows()
    }
    /// Number of columns (key nodes).
    pub fn n_cols(&self) -> usize {
        self.csr.n_cols()
    }
    /// Number of edges.
    pub fn nnz(&self) -> usize {
        self.csr.nnz()
    }

    /// Elements of `heads` values per edge in `layout`.
    pub fn edge_values_len(&self, layout: EdgeLayout, heads: usize) -> Result<usize> {
        let per_head = match layout {
            EdgeLayout::Csr => self.nnz(),
            EdgeLayout::Slots => self.mebcrs()?.n_slots(),
        };
        per_head.checked_mul(heads).ok_or(Error::TooLarge {
            what: "edge values",
            value: per_head as u64,
            limit: (usize::MAX / heads.max(1)) as u64,
        })
    }
}

impl OnGpu for DeviceGraph {
    fn gpu(&self) -> &Gpu {
        self.csr.gpu()
    }
}

/// Per-edge f32 values (`heads` per edge) of one [`DeviceGraph`], tagged with their layout.
#[derive(Debug)]
pub struct EdgeValues {
    values: DeviceVec<f32>,
    layout: EdgeLayout,
    heads: usize,
}

impl EdgeValues {
    /// Zeros, `heads` per edge, in `layout` (padding slots included for
    /// [`EdgeLayout::Slots`]).
    pub fn zeros(gpu: &Gpu, graph: &DeviceGraph, layout: EdgeLayout, heads: usize) -> Result<Self> {
        check_heads(heads)?;
        let len = graph.edge_values_len(layout, heads)?;
        Ok(EdgeValues {
            values: DeviceVec::zeros(gpu, len)?,
            layout,
            heads,
        })
    }

    /// Wraps `values` laid out as `layout` with `heads` values per edge of `graph`
    /// ([`Error::LengthMismatch`] if the length does not fit).
    pub fn from_vec(
        graph: &DeviceGraph,
        layout: EdgeLayout,
        heads: usize,
        values: DeviceVec<f32>,
    ) -> Result<Self> {
        check_heads(heads)?;
        let expected = graph.edge_values_len(layout, heads)?;
        check_per_edge("edge values", expected / heads, heads, values.len())?;
        Ok(EdgeValues {
            values,
            layout,
            heads,
        })
    }

    /// The layout.
    pub fn layout(&self) -> EdgeLayout {
        self.layout
    }
    /// Values per edge.
    pub fn heads(&self) -> usize {
        self.heads
    }
    /// The values, in [`layout`](Self::layout).
    pub fn values(&self) -> &DeviceVec<f32> {
        &self.values
    }
    /// The values, mutably (the length is fixed).
    pub fn values_mut(&mut self) -> &mut DeviceVec<f32> {
        &mut self.values
    }
    /// The values, dropping the tag.
    pub fn into_vec(self) -> DeviceVec<f32> {
        self.values
    }

    /// A copy in `layout`: a gather or scatter through the edge → slot map, or a plain copy
    /// when the layout is already `layout`. Padding slots of a [`EdgeLayout::Slots`] result
    /// are 0.
    pub fn to_layout(&self, gpu: &Gpu, graph: &DeviceGraph, layout: EdgeLayout) -> Result<Self> {
        check_same_gpu(gpu, "edge values", &self.values)?;
        check_same_gpu(gpu, "graph", graph)?;
        let len = graph.edge_values_len(self.layout, self.heads)?;
        check_per_edge(
            "edge values",
            len / self.heads,
            self.heads,
            self.values.len(),
        )?;
        let values = match (self.layout, layout) {
            (EdgeLayout::Csr, EdgeLayout::Csr) | (EdgeLayout::Slots, EdgeLayout::Slots) => {
                self.values.try_clone()?
            }
            (EdgeLayout::Csr, EdgeLayout::Slots) => {
                let me = graph.mebcrs()?;
                let mut out = DeviceVec::zeros(gpu, me.n_slots() * self.heads)?;
                tc_ops::csr_to_slots(gpu, me, &self.values, self.heads, 0.0, &mut out)?;
                out
            }
            (EdgeLayout::Slots, EdgeLayout::Csr) => {
                let me = graph.mebcrs()?;
                let mut out = DeviceVec::zeros(gpu, me.nnz() * self.heads)?;
                tc_ops::slots_to_csr(gpu, me, &self.values, self.heads, &mut out)?;
                out
            }
        };
        Ok(EdgeValues {
            values,
            layout,
            heads: self.heads,
        })
    }

    /// `self` in `layout`, converted only if it is not already.
    pub fn into_layout(self, gpu: &Gpu, graph: &DeviceGraph, layout: EdgeLayout) -> Result<Self> {
        if self.layout == layout {
            Ok(self)
        } else {
            self.to_layout(gpu, graph, layout)
        }
    }
}

fn check_heads(heads: usize) -> Result<()> {
    if heads == 0 {
        return Err(Error::InvalidArgument {
            what: "heads",
            why: "must be at least 1".into(),
        });
    }
    Ok(())
}

/// SDDMM on `backend` ([`csr_ops::sddmm`] or [`tc_ops::sddmm`]). `scores` is overwritten: it
/// ends in `backend`'s layout with `q`'s number of heads (its buffer is replaced when it had
/// another layout or head count).
pub fn sddmm<T: DType>(
    gpu: &Gpu,
    graph: &DeviceGraph,
    backend: Backend,
    q: &DeviceMatrix<T>,
    k: &DeviceMatrix<T>,
    scale: f32,
    scores: &mut EdgeValues,
) -> Result<()> {
    let heads = q.shape().heads;
    let layout = backend.layout();
    if scores.layout != layout || scores.heads != heads {
        *scores = EdgeValues::zeros(gpu, graph, layout, heads)?;
    }
    match backend {
        Backend::CudaCore => csr_ops::sddmm(gpu, graph.csr(), q, k, scale, &mut scores.values),
        Backend::TensorCore => tc_ops::sddmm(gpu, graph.mebcrs()?, q, k, scale, &mut scores.values),
    }
}

/// Edge softmax in place on `backend` (optionally after LeakyReLU(`slope`)); `scores` is first
/// converted to `backend`'s layout if it is in the other one.
pub fn edge_softmax_in_place(
    gpu: &Gpu,
    graph: &DeviceGraph,
    backend: Backend,
    scores: &mut EdgeValues,
    leaky_relu: Option<f32>,
) -> Result<()> {
    let layout = backend.layout();
    if scores.layout != layout {
        *scores = scores.to_layout(gpu, graph, layout)?;
    }
    let heads = scores.heads;
    match backend {
        Backend::CudaCore => {
            csr_ops::edge_softmax_in_place(gpu, graph.csr(), &mut scores.values, heads, leaky_relu)
        }
        Backend::TensorCore => tc_ops::edge_softmax_in_place(
            gpu,
            graph.mebcrs()?,
            &mut scores.values,
            heads,
            leaky_relu,
        ),
    }
}

/// SpMM on `backend`: `out = P · V` with `p` the per-edge probabilities (converted to a
/// temporary in `backend`'s layout if they are in the other one).
pub fn spmm<T: DType>(
    gpu: &Gpu,
    graph: &DeviceGraph,
    backend: Backend,
    p: &EdgeValues,
    v: &DeviceMatrix<T>,
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    let converted;
    let p = if p.layout == backend.layout() {
        p
    } else {
        converted = p.to_layout(gpu, graph, backend.layout())?;
        &converted
    };
    if p.heads != v.shape().heads {
        return Err(Error::InvalidArgument {
            what: "probabilities",
            why: format!(
                "{} values per edge for V of {} heads",
                p.heads,
                v.shape().heads
            ),
        });
    }
    match backend {
        Backend::CudaCore => csr_ops::spmm(gpu, graph.csr(), &p.values, v, out),
        Backend::TensorCore => tc_ops::spmm(gpu, graph.mebcrs()?, &p.values, v, out),
    }
}
