//! [`DeviceGraph`]: one graph on one GPU, shared (`Arc`) by every plan, backward and layer
//! built over it, holding the host CSR once and uploading each device format lazily, once: the
//! CSR with its schedules, Aᵀ with the edge map (the backward's), ME-BCRS and BSB in each row
//! order asked for.
//!
//! It also runs the unfused ops on either [`Engine`] behind one set of signatures:
//! [`EdgeValues`] are per-edge f32 values (scores, probabilities) tagged with their layout, CSR
//! edge order (`nnz × heads`) or ME-BCRS slots (`heads × n_slots`). Outputs come in the
//! engine's layout, inputs in the other layout are converted first (one gather or scatter over
//! the edges — cheap next to the op, but free only when the layouts already agree, so keep a
//! chain of ops on one engine).
//!
//! ```no_run
//! use spattn_formats::Csr;
//! use spattn_ops::{edge_softmax_in_place, sddmm, spmm, DeviceGraph, EdgeValues, Engine};
//! use spattn_ops::{DeviceMatrix, Gpu, Shape};
//! use half::f16;
//!
//! let gpu = Gpu::new(0)?;
//! let a = Csr::from_edges(3, 3, &[(0, 1), (0, 2), (1, 0), (2, 2)])?;
//! let g = DeviceGraph::new(&gpu, a); // nothing uploaded yet
//! let shape = Shape::new(3, 2, 64)?;
//! let x: Vec<f16> = (0..shape.len()).map(|i| f16::from_f32((i % 7) as f32 / 7.0)).collect();
//! let q = DeviceMatrix::from_host(&gpu, shape, &x)?;
//! let mut out = DeviceMatrix::<f16>::zeros(&gpu, shape)?;
//! for engine in [Engine::CudaCore, Engine::TensorCore] {
//!     let mut s = EdgeValues::zeros(&gpu, &g, engine.layout(), 2)?; // uploads what it reads
//!     sddmm(&gpu, &g, engine, &q, &q, 0.125, &mut s)?;
//!     edge_softmax_in_place(&gpu, &g, engine, &mut s, None)?;
//!     spmm(&gpu, &g, engine, &s, &q, &mut out)?;
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use spattn_formats::{Csr, DegreeStats, Reorder, RowOrder};

use crate::backward::DeviceTranspose;
use crate::buffer::{DeviceMatrix, DeviceVec};
use crate::csr_ops::UnitWalk;
use crate::device_bsb::{DeviceBsb, OrderedBsb};
use crate::device_csr::DeviceCsr;
use crate::device_mebcrs::DeviceMeBcrs;
use crate::device_plan::{self, BuildReport, DeviceEdges, DeviceIndex, GraphSpec, PlanWorkspace};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::launch::{check_per_edge, check_same_gpu, OnGpu};
use crate::{csr_ops, tc_ops};

/// Which cores run an unfused op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Engine {
    /// CUDA cores on CSR ([`crate::csr_ops`]): any GPU, exact f32 arithmetic on every dtype.
    CudaCore,
    /// Tensor cores on ME-BCRS ([`crate::tc_ops`]): compute capability 8.0+, f16/bf16 `mma`
    /// (f32 operands through tf32), f32 accumulation.
    TensorCore,
}

impl Engine {
    /// Both engines.
    pub const ALL: [Engine; 2] = [Engine::CudaCore, Engine::TensorCore];

    /// The layout of the per-edge values the engine's ops read and write.
    pub const fn layout(self) -> EdgeLayout {
        match self {
            Engine::CudaCore => EdgeLayout::Csr,
            Engine::TensorCore => EdgeLayout::Slots,
        }
    }

    /// A short name: `"cuda-core"` or `"tensor-core"`.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            Engine::CudaCore => "cuda-core",
            Engine::TensorCore => "tensor-core",
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a graph's plans treat [`Reorder::Auto`]: whether choosing a row order (host work of
/// seconds on 10⁶-edge graphs, which the kernels repay only over many calls) is worth it for
/// this graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlanPolicy {
    /// A graph seen once or a few times (a mini-batch's): `Auto` keeps the rows in their
    /// order, and a graph built on the device needs nothing from the host. The default of a
    /// graph built on the device.
    Once,
    /// A graph used for many steps (full-graph training, serving one graph): `Auto` chooses a
    /// row order on the host when a plan is built. The default of a graph made from a host
    /// CSR.
    Reuse,
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

/// A graph on one GPU: the host CSR (one copy, shared) and its device formats, each uploaded
/// by the first call that needs it and then kept. Share it with `Arc` between the plans, their
/// backward and the layers built over one graph, so that nothing is uploaded twice.
///
/// A graph may also be built on the GPU from an edge list already there
/// ([`from_device_edges`](Self::from_device_edges)): its CSR, transpose and BSB are then made
/// by kernels (`crate::device_plan`), never copied from or to the host, and its
/// [`PlanPolicy`] starts as [`PlanPolicy::Once`]: [`Reorder::Auto`] keeps its rows in their
/// order (a graph seen once does not repay a row order). The host CSR is downloaded only by a
/// path that needs it (a row order, the ME-BCRS and hybrid formats, [`host`](Self::host)).
///
/// The uploads are guarded for concurrent first use; every accessor returns the same upload
/// afterwards. [`device_bytes`](Self::device_bytes) says what is held.
pub struct DeviceGraph {
    gpu: Gpu,
    n_rows: usize,
    n_cols: usize,
    nnz: usize,
    /// The host CSR: given, or downloaded on first need for a graph built on the device.
    host: OnceLock<Arc<Csr>>,
    /// [`PlanPolicy::Reuse`] when set.
    reuse: AtomicBool,
    /// The row order of the ME-BCRS the per-call tensor-core ops read.
    op_reorder: Reorder,
    csr: OnceLock<DeviceCsr>,
    /// The edge CSR: A's rows with column `e` at edge `e` (per-edge operands as SDDMM/SpMM
    /// operands, e.g. edge features).
    edge_csr: OnceLock<DeviceCsr>,
    transpose: OnceLock<DeviceTranspose>,
    /// Aᵀ's BSB in Aᵀ's own row order (the tensor-core backward's dK/dV pass).
    transpose_bsb: OnceLock<Arc<OrderedBsb>>,
    /// Whether the pattern equals its transpose: set by a build on the device that added the
    /// reverse edges, found on the host CSR at first need for a graph made from one; other
    /// graphs built on the device are treated as directed.
    symmetric: OnceLock<bool>,
    /// This graph's number among the graphs of the process (`graph_id`).
    id: u64,
    mebcrs: Mutex<Vec<(Reorder, Arc<DeviceMeBcrs>)>>,
    bsb: Mutex<Vec<(Reorder, Arc<OrderedBsb>)>>,
    /// The row orders fused-csr's units and the fused backward's passes walk, per order asked.
    csr_orders: Mutex<Vec<(Reorder, Arc<RowOrder>)>>,
    /// The walks of A's and Aᵀ's units in those orders (the fused backward's passes, GAT's rows
    /// kernels), per order asked.
    unit_walks: Mutex<Vec<(Reorder, Arc<UnitWalk>)>>,
    /// Held while a lazily built upload is made (so two threads never make the same one).
    building: Mutex<()>,
    /// The temporaries of the builds on the device (shared with the graphs built beside it);
    /// `Some` exactly for a graph built on the device.
    workspace: Option<Arc<Mutex<PlanWorkspace>>>,
}

impl fmt::Debug for DeviceGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceGraph")
            .field("gpu", &self.gpu.name())
            .field("n_rows", &self.n_rows)
            .field("n_cols", &self.n_cols)
            .field("nnz", &self.nnz)
            .field("built_on_device", &self.built_on_device())
            .field("device_bytes", &self.device_bytes())
            .finish()
    }
}

/// A number no other graph of the process has: state made for one graph (a backward's edge
/// maps) checks that it is handed the same graph again.
fn next_graph_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Locks `m`, whatever a panic elsewhere left: the caches hold finished uploads only.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl DeviceGraph {
    /// A graph on `gpu`; nothing is uploaded until an op, plan or layer needs it. Takes the
    /// host CSR by value (or an `Arc` of it): no copy.
    pub fn new(gpu: &Gpu, csr: impl Into<Arc<Csr>>) -> Self {
        let host: Arc<Csr> = csr.into();
        Self {
            gpu: gpu.clone(),
            n_rows: host.n_rows(),
            n_cols: host.n_cols(),
            nnz: host.nnz(),
            host: OnceLock::from(host),
            workspace: None,
            reuse: AtomicBool::new(true),
            op_reorder: Reorder::None,
            csr: OnceLock::new(),
            edge_csr: OnceLock::new(),
            transpose: OnceLock::new(),
            transpose_bsb: OnceLock::new(),
            symmetric: OnceLock::new(),
            id: next_graph_id(),
            mebcrs: Mutex::new(Vec::new()),
            bsb: Mutex::new(Vec::new()),
            csr_orders: Mutex::new(Vec::new()),
            unit_walks: Mutex::new(Vec::new()),
            building: Mutex::new(()),
        }
    }

    /// A graph built on `gpu` from an edge list in its memory, as `spec` says: edge `i` from
    /// source `edges.sources[i]` (a column: the K/V side) to target `edges.targets[i]` (a row:
    /// the Q side); repeated edges merged; the reverse edges and missing self loops added where
    /// asked; its CSR with the CUDA-core schedules, and its transpose with `spec.transpose`,
    /// made by kernels with one read back at the end (`crate::device_plan`). `positions`,
    /// where given (`edges.len` elements), receives each input edge's entry in the CSR (its
    /// place in [`EdgeLayout::Csr`] order; a repeated edge its one entry), so per-edge data in
    /// the input's order can be moved to the graph's; with `spec.self_loops` it may hold one
    /// more element per node, which receives the entry of self loop `(i, i)` at `edges.len + i`
    /// (GAT's per-edge data of the loops, PyG's `fill_value`).
    ///
    /// ```no_run
    /// use spattn_ops::{DeviceEdges, DeviceIds, GraphSpec};
    /// use spattn_ops::DeviceGraph;
    /// use spattn_ops::{DeviceVec, Gpu};
    /// let gpu = Gpu::new(0)?;
    /// // PyG's edge_index of 0 -> 1, 2 -> 1, 1 -> 0: its sources and its targets, on the device.
    /// let src = DeviceVec::from_host(&gpu, &[0i64, 2, 1])?;
    /// let dst = DeviceVec::from_host(&gpu, &[1i64, 1, 0])?;
    /// let edges = DeviceEdges {
    ///     sources: DeviceIds::contiguous(&src),
    ///     targets: DeviceIds::contiguous(&dst),
    ///     len: 3,
    /// };
    /// let spec = GraphSpec { self_loops: true, transpose: true, ..GraphSpec::square(3) };
    /// let (graph, report) = DeviceGraph::from_device_edges(&gpu, &edges, &spec, None)?;
    /// assert_eq!((graph.nnz(), report.duplicates), (6, 0));
    /// // Row 0: {0, 1}; row 1: {0, 1, 2}; row 2: {2}.
    /// assert_eq!(graph.csr()?.row_offsets().to_host()?, vec![0, 2, 5, 6]);
    /// # Ok::<(), spattn_ops::Error>(())
    /// ```
    ///
    /// Errors: [`Error::EdgeOutOfRange`] naming the first edge whose ids fall outside the
    /// graph (negative ones included); [`Error::InvalidArgument`] for id buffers shorter than
    /// `len` at their stride, a `positions` of another length, symmetrizing a rectangular
    /// graph; [`Error::ForeignGpu`]; [`Error::TooLarge`] past the 32-bit formats; the driver's.
    pub fn from_device_edges<I: DeviceIndex>(
        gpu: &Gpu,
        edges: &DeviceEdges<'_, I>,
        spec: &GraphSpec,
        positions: Option<&mut DeviceVec<i64>>,
    ) -> Result<(Self, BuildReport)> {
        let workspace = Arc::new(Mutex::new(PlanWorkspace::new()));
        Self::from_device_edges_in(gpu, edges, spec, positions, &workspace)
    }

    /// [`from_device_edges`](Self::from_device_edges) with the build's temporaries taken from
    /// `workspace` and left there for the next build: a training loop that builds a graph
    /// every step keeps one per GPU and passes it to every build, and each graph keeps it for
    /// its own later builds (the transpose, the BSB) too.
    ///
    /// Errors: as [`from_device_edges`](Self::from_device_edges).
    pub fn from_device_edges_in<I: DeviceIndex>(
        gpu: &Gpu,
        edges: &DeviceEdges<'_, I>,
        spec: &GraphSpec,
        positions: Option<&mut DeviceVec<i64>>,
        workspace: &Arc<Mutex<PlanWorkspace>>,
    ) -> Result<(Self, BuildReport)> {
        let built =
            device_plan::build_from_edges(gpu, edges, spec, positions, &mut lock(workspace))?;
        let csr = built.csr;
        let graph = Self {
            gpu: gpu.clone(),
            n_rows: csr.n_rows(),
            n_cols: csr.n_cols(),
            nnz: csr.nnz(),
            host: OnceLock::new(),
            reuse: AtomicBool::new(false),
            op_reorder: Reorder::None,
            csr: OnceLock::from(csr),
            edge_csr: OnceLock::new(),
            transpose: built.transpose.map_or_else(OnceLock::new, OnceLock::from),
            transpose_bsb: OnceLock::new(),
            // Reverse edges added: symmetric by construction (square is checked by the build).
            symmetric: if spec.symmetrize {
                OnceLock::from(true)
            } else {
                OnceLock::new()
            },
            id: next_graph_id(),
            mebcrs: Mutex::new(Vec::new()),
            bsb: Mutex::new(Vec::new()),
            csr_orders: Mutex::new(Vec::new()),
            unit_walks: Mutex::new(Vec::new()),
            building: Mutex::new(()),
            workspace: Some(workspace.clone()),
        };
        Ok((graph, built.report))
    }

    /// Sets the row order of the ME-BCRS that the per-call tensor-core ops ([`sddmm`],
    /// [`edge_softmax_in_place`], [`spmm`]) read (default [`Reorder::None`]; any order gives
    /// the same results in the caller's order, see [`DeviceMeBcrs::from_csr_reordered`]).
    pub fn with_op_reorder(mut self, reorder: Reorder) -> Self {
        self.op_reorder = reorder;
        self
    }

    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The host CSR: the one the graph was made from, or, for a graph built on the device,
    /// downloaded at the first call (and kept).
    ///
    /// Errors: the download's (driver) for a graph built on the device.
    pub fn host(&self) -> Result<&Csr> {
        Ok(self.host_shared()?)
    }

    /// The host CSR, shared ([`host`](Self::host)).
    pub fn host_shared(&self) -> Result<&Arc<Csr>> {
        if let Some(h) = self.host.get() {
            return Ok(h);
        }
        let csr = Arc::new(self.csr()?.to_host()?);
        // Another thread may have set it meanwhile: both downloads are the same CSR.
        let _ = self.host.set(csr);
        self.host.get().ok_or_else(|| Error::InvalidArgument {
            what: "graph",
            why: "the downloaded CSR was not kept".into(),
        })
    }

    /// Whether the graph was built on the device ([`from_device_edges`](Self::from_device_edges)).
    pub fn built_on_device(&self) -> bool {
        self.workspace.is_some()
    }

    /// The graph's [`PlanPolicy`].
    pub fn policy(&self) -> PlanPolicy {
        if self.reuse.load(Ordering::Relaxed) {
            PlanPolicy::Reuse
        } else {
            PlanPolicy::Once
        }
    }

    /// Sets the graph's [`PlanPolicy`] for the plans built from now on (plans built before
    /// keep their order: rebuild them to change it).
    pub fn set_policy(&self, policy: PlanPolicy) {
        self.reuse
            .store(policy == PlanPolicy::Reuse, Ordering::Relaxed);
    }

    /// The row order a plan asking for `reorder` gets on this graph: under
    /// [`PlanPolicy::Once`], [`Reorder::Auto`] keeps the rows in their order (a graph seen once
    /// does not repay an order, and choosing one needs the graph on the host); every other
    /// request is kept.
    pub fn effective_reorder(&self, reorder: Reorder) -> Reorder {
        if reorder == Reorder::Auto && self.policy() == PlanPolicy::Once {
            Reorder::None
        } else {
            reorder
        }
    }

    /// Degree statistics of the rows: the host CSR's, or those computed on the device.
    pub fn degree_stats(&self) -> Result<DegreeStats> {
        match self.host.get() {
            Some(h) => Ok(h.degree_stats()),
            None => Ok(self.csr()?.degree_stats().clone()),
        }
    }

    /// Number of rows (query nodes).
    pub fn n_rows(&self) -> usize {
        self.n_rows
    }
    /// Number of columns (key nodes).
    pub fn n_cols(&self) -> usize {
        self.n_cols
    }
    /// Number of edges.
    pub fn nnz(&self) -> usize {
        self.nnz
    }

    /// `cell`'s value, made by `make` on first use.
    fn once<'a, T>(
        &self,
        cell: &'a OnceLock<T>,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<&'a T> {
        if let Some(v) = cell.get() {
            return Ok(v);
        }
        let _building = lock(&self.building);
        if cell.get().is_none() {
            // Only this thread sets it: others wait on `building` above.
            let _ = cell.set(make()?);
        }
        // Set just above, or by the thread that held `building` before us.
        cell.get().ok_or_else(|| Error::InvalidArgument {
            what: "graph upload",
            why: "a lazily built upload was not kept".into(),
        })
    }

    /// The entry of `cache` for `reorder`, made by `make` on first use.
    fn cached<T>(
        &self,
        cache: &Mutex<Vec<(Reorder, Arc<T>)>>,
        reorder: Reorder,
        make: impl FnOnce() -> Result<T>,
    ) -> Result<Arc<T>> {
        let find = |c: &Vec<(Reorder, Arc<T>)>| {
            c.iter()
                .find(|(r, _)| *r == reorder)
                .map(|(_, v)| v.clone())
        };
        if let Some(v) = find(&lock(cache)) {
            return Ok(v);
        }
        let _building = lock(&self.building);
        if let Some(v) = find(&lock(cache)) {
            return Ok(v);
        }
        let v = Arc::new(make()?);
        lock(cache).push((reorder, v.clone()));
        Ok(v)
    }

    /// The CSR upload with its schedules (CUDA-core ops, the fused CSR kernel's K/V side, the
    /// backward).
    pub fn csr(&self) -> Result<&DeviceCsr> {
        if let Some(c) = self.csr.get() {
            return Ok(c);
        }
        let host = self.host_shared()?.clone();
        self.once(&self.csr, || DeviceCsr::upload(&self.gpu, &host))
    }

    /// The edge CSR: A's rows, edge `e` at column `e` (`n_rows × nnz`), so that an `nnz`-row
    /// operand indexed by edge (edge features) is an SDDMM or SpMM operand of the CSR ops.
    pub fn edge_csr(&self) -> Result<&DeviceCsr> {
        if let Some(c) = self.edge_csr.get() {
            return Ok(c);
        }
        let a = self.csr()?;
        self.once(&self.edge_csr, || device_plan::build_edge_csr(&self.gpu, a))
    }

    /// Aᵀ with its schedules and the map of edges between A and Aᵀ (the backward's dK, dV):
    /// transposed on the host, or on the device for a graph built there.
    pub fn transpose(&self) -> Result<&DeviceTranspose> {
        if let Some(t) = self.transpose.get() {
            return Ok(t);
        }
        if let Some(ws) = &self.workspace {
            let a = self.csr()?;
            return self.once(&self.transpose, || {
                device_plan::build_transpose(&self.gpu, a, &mut lock(ws))
            });
        }
        let host = self.host_shared()?.clone();
        self.once(&self.transpose, || {
            DeviceTranspose::upload(&self.gpu, &host)
        })
    }

    /// Aᵀ's BSB (16-row windows of Aᵀ, i.e. of A's columns, in their own order), built on the
    /// device from [`transpose`](Self::transpose) once per graph: the tensor-core backward's
    /// dK/dV pass reads it, for every plan and layer over the graph.
    pub(crate) fn transpose_bsb(&self) -> Result<Arc<OrderedBsb>> {
        if let Some(b) = self.transpose_bsb.get() {
            return Ok(b.clone());
        }
        let t = self.transpose()?;
        self.once(&self.transpose_bsb, || {
            let bsb = match &self.workspace {
                Some(ws) => device_plan::ordered_bsb(&self.gpu, t.csr(), &mut lock(ws))?,
                None => device_plan::ordered_bsb(&self.gpu, t.csr(), &mut PlanWorkspace::new())?,
            };
            Ok(Arc::new(bsb))
        })
        .cloned()
    }

    /// fused-tc's extras edge map of `bsb`, one of this graph's BSBs in its own row order, made
    /// on the device: over A, or (`transposed`) over Aᵀ with each entry named by its edge of A
    /// (the backward's Aᵀ BSB, or A's BSB standing for it on a symmetric pattern). No download.
    pub(crate) fn bsb_edge_map(
        &self,
        bsb: &DeviceBsb,
        transposed: bool,
    ) -> Result<(DeviceVec<u32>, DeviceVec<u32>)> {
        // The CSR and transpose first: building them takes the workspace's lock.
        let (csr, ids_of) = if transposed {
            let t = self.transpose()?;
            (t.csr(), Some(t.inverse_map(&self.gpu)?))
        } else {
            (self.csr()?, None)
        };
        match &self.workspace {
            Some(ws) => device_plan::bsb_edge_map(&self.gpu, bsb, csr, ids_of, &mut lock(ws)),
            None => {
                device_plan::bsb_edge_map(&self.gpu, bsb, csr, ids_of, &mut PlanWorkspace::new())
            }
        }
    }

    /// The extras edge map of `bsb`, one of this graph's BSBs ([`bsb_in`](Self::bsb_in)), made
    /// on its first use and kept with it: on the device where the BSB is in the graph's own row
    /// order ([`bsb_edge_map`](Self::bsb_edge_map)), else on the host from the graph's CSR.
    pub(crate) fn edge_map_of<'b>(
        &self,
        bsb: &'b OrderedBsb,
    ) -> Result<&'b (DeviceVec<u32>, DeviceVec<u32>)> {
        bsb.device_edge_map(|b| {
            if b.in_graph_order() {
                self.bsb_edge_map(&b.device, false)
            } else {
                b.uploaded_edge_map(&self.gpu, self.host()?)
            }
        })
    }

    /// This graph's number, unique in the process (state made for a graph checks it).
    pub(crate) fn graph_id(&self) -> u64 {
        self.id
    }

    /// The BSB the tensor-core backward's dK/dV pass reads beside A's BSB `a` (one of
    /// [`bsb_in`](Self::bsb_in)'s): `a` itself where the pattern is symmetric (Aᵀ = A, so A's
    /// BSB in A's row order is Aᵀ's BSB in that order, with the forward's gather locality), else
    /// [`transpose_bsb`](Self::transpose_bsb). Symmetry is known for a graph built on the
    /// device with the reverse edges, checked once on the host CSR of a graph made from one,
    /// and not looked for in other graphs built on the device (their CSR stays there).
    pub(crate) fn transpose_bsb_beside(&self, a: &Arc<OrderedBsb>) -> Result<Arc<OrderedBsb>> {
        let symmetric = match self.symmetric.get() {
            Some(&s) => s,
            None if self.workspace.is_some() => false,
            None => *self
                .symmetric
                .get_or_init(|| self.host.get().is_some_and(|h| h.is_pattern_symmetric())),
        };
        if symmetric {
            Ok(a.clone())
        } else {
            self.transpose_bsb()
        }
    }

    /// The ME-BCRS with its rows renumbered as `reorder` says
    /// ([`DeviceMeBcrs::from_csr_reordered`]); needs compute capability 8.0. A graph built on
    /// the device gets its ME-BCRS in its own order from the device too.
    ///
    /// Errors: an older device; slots (8 per vector) past u32 (`Error::Format` from the host
    /// build, `Error::TooLarge` from the device's); driver and memory failures.
    pub fn mebcrs_in(&self, reorder: Reorder) -> Result<Arc<DeviceMeBcrs>> {
        self.gpu
            .require_compute_capability("tensor-core ops (mma.sync)", 8, 0)?;
        let reorder = self.effective_reorder(reorder);
        if let (Some(ws), Reorder::None) = (&self.workspace, reorder) {
            let a = self.csr()?;
            return self.cached(&self.mebcrs, reorder, || {
                device_plan::build_mebcrs(&self.gpu, a, &mut lock(ws))
            });
        }
        self.cached(&self.mebcrs, reorder, || {
            DeviceMeBcrs::from_csr_reordered(&self.gpu, self.host()?, reorder)
        })
    }

    /// The ME-BCRS the per-call tensor-core ops read (see [`with_op_reorder`](Self::with_op_reorder)).
    pub fn mebcrs(&self) -> Result<Arc<DeviceMeBcrs>> {
        self.mebcrs_in(self.op_reorder)
    }

    /// The BSB (16-row windows of 16×8 bitmap blocks) with its rows renumbered as `reorder`
    /// says ([`effective_reorder`](Self::effective_reorder)), what the host keeps to schedule
    /// it, and the caller row of each window row. A graph built on the device gets its BSB in
    /// its own order from the device too.
    pub(crate) fn bsb_in(&self, reorder: Reorder) -> Result<Arc<OrderedBsb>> {
        let reorder = self.effective_reorder(reorder);
        if let (Some(ws), Reorder::None) = (&self.workspace, reorder) {
            let a = self.csr()?;
            return self.cached(&self.bsb, reorder, || {
                device_plan::ordered_bsb(&self.gpu, a, &mut lock(ws))
            });
        }
        self.cached(&self.bsb, reorder, || {
            OrderedBsb::upload(&self.gpu, self.host()?, reorder)
        })
    }

    /// The row order fused-csr's units run in for `reorder` (the effective one: the caller
    /// applied [`effective_reorder`](Self::effective_reorder)), chosen on the host CSR on first
    /// use and kept, so that the fused backward's passes walk their units in it without
    /// choosing it again.
    pub(crate) fn csr_order(&self, reorder: Reorder) -> Result<Arc<RowOrder>> {
        self.cached(&self.csr_orders, reorder, || {
            crate::fused::csr::csr_order(self.host()?, reorder)
        })
    }

    /// The order the passes over A's and Aᵀ's CSR units (the fused backward's, GAT's rows
    /// kernels') walk them in for a plan asking for `reorder`: fused-csr's row order
    /// ([`effective_reorder`](Self::effective_reorder) applied: a graph seen once keeps its
    /// order under [`Reorder::Auto`], with no host work), made on first use and kept, so that
    /// the forward's and the backward's passes choose it once. The walk changes where the
    /// passes' gathers hit, not their results ([`csr_ops::UnitWalk`]).
    ///
    /// Errors: those of choosing the order (the host CSR's download for a graph built on the
    /// device) and of the upload.
    pub fn unit_walk(&self, reorder: Reorder) -> Result<Arc<UnitWalk>> {
        let reorder = self.effective_reorder(reorder);
        if reorder == Reorder::None {
            return Ok(Arc::default());
        }
        // Chosen before the walk's cache entry (both caches hold `building` while they make).
        let order = self.csr_order(reorder)?;
        self.cached(&self.unit_walks, reorder, || match &order.permutation {
            Some(p) => {
                let (lens, col_lens) = crate::schedule::row_and_column_lens(self.host()?)?;
                UnitWalk::in_row_order(&self.gpu, &lens, &col_lens, p)
            }
            None => Ok(UnitWalk::default()),
        })
    }

    /// Whether `engine` can run on this graph's GPU.
    pub fn supports(&self, engine: Engine) -> bool {
        match engine {
            Engine::CudaCore => true,
            Engine::TensorCore => self.gpu.compute_capability() >= (8, 0),
        }
    }

    /// Bytes of device memory the uploads made so far hold.
    pub fn device_bytes(&self) -> usize {
        self.csr.get().map_or(0, DeviceCsr::device_bytes)
            + self
                .transpose
                .get()
                .map_or(0, DeviceTranspose::device_bytes)
            + lock(&self.mebcrs)
                .iter()
                .map(|(_, m)| m.device_bytes())
                .sum::<usize>()
            + lock(&self.bsb)
                .iter()
                .map(|(_, b)| b.device_bytes())
                .sum::<usize>()
            + self.transpose_bsb.get().map_or(0, |b| b.device_bytes())
            + lock(&self.unit_walks)
                .iter()
                .map(|(_, w)| w.device_bytes())
                .sum::<usize>()
    }

    /// Elements of `heads` values per edge in `layout`.
    pub(crate) fn edge_values_len(&self, layout: EdgeLayout, heads: usize) -> Result<usize> {
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
        &self.gpu
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
                tc_ops::csr_to_slots(gpu, &me, &self.values, self.heads, 0.0, &mut out)?;
                out
            }
            (EdgeLayout::Slots, EdgeLayout::Csr) => {
                let me = graph.mebcrs()?;
                let mut out = DeviceVec::zeros(gpu, me.nnz() * self.heads)?;
                tc_ops::slots_to_csr(gpu, &me, &self.values, self.heads, &mut out)?;
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

/// SDDMM on `engine` ([`csr_ops::sddmm`] or [`tc_ops::sddmm`]). `scores` is overwritten: it
/// ends in `engine`'s layout with `q`'s number of heads (its buffer is replaced when it had
/// another layout or head count).
pub fn sddmm<T: DType>(
    gpu: &Gpu,
    graph: &DeviceGraph,
    engine: Engine,
    q: &DeviceMatrix<T>,
    k: &DeviceMatrix<T>,
    scale: f32,
    scores: &mut EdgeValues,
) -> Result<()> {
    let heads = q.shape().heads;
    let layout = engine.layout();
    if scores.layout != layout || scores.heads != heads {
        *scores = EdgeValues::zeros(gpu, graph, layout, heads)?;
    }
    match engine {
        Engine::CudaCore => csr_ops::sddmm(gpu, graph.csr()?, q, k, scale, &mut scores.values),
        Engine::TensorCore => {
            tc_ops::sddmm(gpu, &*graph.mebcrs()?, q, k, scale, &mut scores.values)
        }
    }
}

/// Edge softmax in place on `engine` (optionally after LeakyReLU(`slope`)); `scores` is first
/// converted to `engine`'s layout if it is in the other one.
pub fn edge_softmax_in_place(
    gpu: &Gpu,
    graph: &DeviceGraph,
    engine: Engine,
    scores: &mut EdgeValues,
    leaky_relu: Option<f32>,
) -> Result<()> {
    let layout = engine.layout();
    if scores.layout != layout {
        *scores = scores.to_layout(gpu, graph, layout)?;
    }
    let heads = scores.heads;
    match engine {
        Engine::CudaCore => {
            csr_ops::edge_softmax_in_place(gpu, graph.csr()?, &mut scores.values, heads, leaky_relu)
        }
        Engine::TensorCore => tc_ops::edge_softmax_in_place(
            gpu,
            &*graph.mebcrs()?,
            &mut scores.values,
            heads,
            leaky_relu,
        ),
    }
}

/// SpMM on `engine`: `out = P · V` with `p` the per-edge probabilities (converted to a
/// temporary in `engine`'s layout if they are in the other one).
pub fn spmm<T: DType>(
    gpu: &Gpu,
    graph: &DeviceGraph,
    engine: Engine,
    p: &EdgeValues,
    v: &DeviceMatrix<T>,
    out: &mut DeviceMatrix<T>,
) -> Result<()> {
    let converted;
    let p = if p.layout == engine.layout() {
        p
    } else {
        converted = p.to_layout(gpu, graph, engine.layout())?;
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
    match engine {
        Engine::CudaCore => csr_ops::spmm(gpu, graph.csr()?, &p.values, v, out),
        Engine::TensorCore => tc_ops::spmm(gpu, &*graph.mebcrs()?, &p.values, v, out),
    }
}
