//! [`GraphCore`]: one graph and its plan-once state, and the attention and GAT calls over it.
//! The state's upkeep (host CSR, device uploads, plan cache) is in `state`, the parsing and
//! checks of the calls' arguments in `args`.
//!
//! # The calls' contract with the Python package
//!
//! Every tensor argument is an address (`data_ptr()`), with the layout implied by the call:
//! Q and the output `n_rows × heads × head_dim`, K and V `n_cols × heads × head_dim`,
//! row-major and contiguous, of the dtype named; GAT's per-node scores `rows × heads` f32 on
//! CUDA (the dtype named on the CPU); workspaces `nnz × heads` f32. The package
//! (`spattn/_tensors.py`) checks device, dtype, shape and contiguity of every tensor before
//! passing its address, keeps every tensor referenced for the whole call, and allocates every
//! output and workspace fresh, so outputs never alias inputs. Per call, the addresses are
//! checked here for what needs no driver (non-null, aligned): the per-call path makes no
//! driver query beyond its launches and the two stream-ordering events (and, for a graph under
//! `Once` whose policy is not fixed, whether the stream captures). An edge list's ids,
//! read once per graph, are also checked against the driver's tables (device memory of the
//! right device, inside one allocation).
//!
//! On CUDA, `stream` is the caller's current stream (`torch.cuda.current_stream(device)
//! .cuda_stream`): spattn's stream waits for it before the first launch, and it waits for
//! spattn's stream after the last ([`spattn::ops::StreamBridge`]), so to PyTorch the
//! call behaves as an op on its current stream, and its caching allocator may recycle the
//! tensors' memory in its own stream order.

mod args;
pub(crate) mod edges;
mod state;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use spattn::ops::ExternalVec;
use spattn::ops::GraphSpec;
use spattn::{Csr, DeviceGraph, PlanPolicy};

use crate::cpu::scale_of;
use crate::cuda::{
    build_on_device, gat_backward_gpu, gat_forward_gpu, gatv2_backward_gpu, gatv2_forward_gpu,
    gpu_backward_call, gpu_forward, parse_gat_kernels,
};
use crate::device;
use crate::errors::{formats_to_py, to_py, value_error};
use crate::extras::{self, ExtrasArgs};
use crate::host::{DTypeName, HostDType};
use spattn::ops::backward::GatKernels;

use args::{
    check_addresses, check_offsets, check_slope, edge_error, first, indices, int64_bytes,
    parse_algorithm, transform,
};
// The CUDA bodies of the calls (`crate::cuda`, `crate::extras`) take a graph's device state.
pub(crate) use state::OnDevice;
use state::PlanKey;

/// One graph (row `i` lists the nodes node `i` attends to) and its plan-once state: per CUDA
/// device the shared [`DeviceGraph`] and the [`AttentionPlan`](spattn::AttentionPlan)s built
/// over it (cached per heads, head_dim, dtype, algorithm, scale, and whether the calls pass
/// extras and edge features), on the CPU the transpose and edge map of the
/// GAT backward. Immutable: derived graphs are new objects.
#[pyclass(module = "spattn._native", frozen)]
#[derive(Debug)]
pub struct GraphCore {
    /// The host CSR: given, or (a graph built on a GPU) downloaded by the first path that
    /// needs it (the CPU ops, the index accessors, another device).
    host: OnceLock<Arc<Csr>>,
    n_rows: usize,
    n_cols: usize,
    nnz: usize,
    /// Edges of the input that repeated an earlier one (merged: a graph is a set of edges).
    duplicates: usize,
    /// The CUDA device the graph was built on (its `DeviceGraph` holds it), if it was.
    origin: Option<usize>,
    /// Aᵀ and, for each of its entries, the index of the same entry in A (CPU GAT backward).
    transpose: OnceLock<(Csr, Vec<u32>)>,
    devices: Mutex<HashMap<usize, Arc<OnDevice>>>,
    /// The plans' policy on every device ([`PlanPolicy::Reuse`] when set).
    reuse: AtomicBool,
    /// Whether the policy is fixed: set by the caller, or pinned by a CUDA-graph capture (a
    /// graph seen again then keeps `Once`).
    fixed: AtomicBool,
    /// Backward calls on CUDA so far (a graph seen again after a backward is one trained on
    /// over several steps: [`GraphCore::reuse_if_seen_again`]).
    backwards: AtomicUsize,
}

#[pymethods]
#[allow(clippy::too_many_arguments)]
impl GraphCore {
    /// A graph from CSR arrays: `crow` (`n_rows + 1` int64 offsets) and `col` (int64 column
    /// indices below `n_cols`), as native-endian bytes. Rows may list their columns in any
    /// order; a column listed twice in a row is an error.
    #[staticmethod]
    fn from_csr(
        py: Python<'_>,
        crow: &[u8],
        col: &[u8],
        n_rows: usize,
        n_cols: usize,
    ) -> PyResult<Self> {
        let col = indices("col", col, n_cols, false)?;
        let crow = indices("crow", crow, col.len(), true)?;
        check_offsets(&crow, n_rows, col.len())?;
        py.detach(
            || match Csr::try_new(n_rows, n_cols, crow.clone(), col.clone(), None) {
                Ok(csr) => Ok(Self::new(csr, 0)),
                Err(spattn::formats::Error::UnsortedRow { .. }) => {
                    // Rows may list their columns in any order: sort them.
                    let rows: Vec<u32> = crow
                        .windows(2)
                        .enumerate()
                        .flat_map(|(i, w)| std::iter::repeat_n(i as u32, (w[1] - w[0]) as usize))
                        .collect();
                    let csr = Csr::from_unsorted(n_rows, n_cols, &rows, &col, None)
                        .map_err(|e| formats_to_py("col", e))?;
                    if csr.nnz() != col.len() {
                        return Err(value_error(
                            "col",
                            format!(
                            "{} entries repeat a column of their row; a graph is a set of edges",
                            col.len() - csr.nnz()
                        ),
                        ));
                    }
                    Ok(Self::new(csr, 0))
                }
                Err(e) => Err(formats_to_py("col", e)),
            },
        )
    }

    /// A `num_nodes × num_nodes` graph from PyG-style edges `src[k] → dst[k]` (int64
    /// native-endian bytes): row `dst` of the graph lists `src` (messages flow from source to
    /// target, and each target's softmax runs over its incoming edges). Repeated edges are
    /// merged (counted in `duplicates`); `symmetrize` adds every reverse edge, `self_loops`
    /// the missing `(i, i)`.
    #[staticmethod]
    #[pyo3(signature = (src, dst, num_nodes, symmetrize=false, self_loops=false))]
    fn from_edges(
        py: Python<'_>,
        src: &[u8],
        dst: &[u8],
        num_nodes: usize,
        symmetrize: bool,
        self_loops: bool,
    ) -> PyResult<Self> {
        let cols = indices("edge_index[0] (sources)", src, num_nodes, false)?;
        let rows = indices("edge_index[1] (targets)", dst, num_nodes, false)?;
        if rows.len() != cols.len() {
            return Err(value_error(
                "edge_index",
                format!("{} sources but {} targets", cols.len(), rows.len()),
            ));
        }
        py.detach(|| {
            let csr = Csr::from_unsorted(num_nodes, num_nodes, &rows, &cols, None)
                .map_err(|e| formats_to_py("edge_index", e))?;
            let duplicates = rows.len() - csr.nnz();
            transform(csr, symmetrize, self_loops).map(|c| Self::new(c, duplicates))
        })
    }

    /// A `num_nodes × num_nodes` graph built on CUDA device `device` from an edge list in its
    /// memory (PyG's `edge_index` rows, never copied to the host): sources at address `src`
    /// and targets at `dst`, `n_edges` ids each of `dtype` (`"int32"` or `"int64"`) at element
    /// strides `src_stride` and `dst_stride`; repeats merged, `symmetrize` / `self_loops` as in
    /// [`from_edges`](Self::from_edges); `transpose`: build the backward's transpose now. With
    /// `positions` (the address of `n_edges` int64, `n_edges + num_nodes` with `self_loops`),
    /// each input edge's position in the graph's CSR order is written there, then each self
    /// loop's. Ordered with `stream` (the caller's current
    /// stream); reads back once (the sizes). An id out of range is a `ValueError` naming the
    /// edge.
    #[staticmethod]
    #[pyo3(signature = (device, dtype, src, src_stride, dst, dst_stride, n_edges, num_nodes,
                        symmetrize, self_loops, transpose, positions, stream))]
    fn from_device_edges(
        py: Python<'_>,
        device: i64,
        dtype: &str,
        src: u64,
        src_stride: usize,
        dst: u64,
        dst_stride: usize,
        n_edges: usize,
        num_nodes: usize,
        symmetrize: bool,
        self_loops: bool,
        transpose: bool,
        positions: u64,
        stream: u64,
    ) -> PyResult<Self> {
        let ordinal = device::ordinal(device)?;
        let spec = GraphSpec {
            n_rows: num_nodes,
            n_cols: num_nodes,
            symmetrize,
            self_loops,
            transpose,
        };
        let strides = (src_stride, dst_stride);
        let built = py.detach(
            || -> spattn::Result<(DeviceGraph, usize, Arc<device::Device>)> {
                let _restore = device::ContextGuard::save();
                let d = device::device(ordinal)?;
                let (graph, report) = match dtype {
                    "int64" => build_on_device::<i64>(
                        &d,
                        (src, dst),
                        strides,
                        n_edges,
                        &spec,
                        positions,
                        stream,
                    )?,
                    "int32" => build_on_device::<i32>(
                        &d,
                        (src, dst),
                        strides,
                        n_edges,
                        &spec,
                        positions,
                        stream,
                    )?,
                    other => {
                        return Err(spattn::Error::Ops(spattn::ops::Error::InvalidArgument {
                            what: "edge_index",
                            why: format!("dtype {other}: expected int32 or int64"),
                        }))
                    }
                };
                Ok((graph, report.duplicates, d))
            },
        );
        let (graph, duplicates, d) = built.map_err(edge_error)?;
        let core = Self {
            n_rows: graph.n_rows(),
            n_cols: graph.n_cols(),
            nnz: graph.nnz(),
            host: OnceLock::new(),
            duplicates,
            origin: Some(ordinal),
            transpose: OnceLock::new(),
            devices: Mutex::new(HashMap::new()),
            reuse: AtomicBool::new(false),
            fixed: AtomicBool::new(false),
            backwards: AtomicUsize::new(0),
        };
        core.devices
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                ordinal,
                Arc::new(OnDevice {
                    device: d,
                    graph: Arc::new(graph),
                    plans: Mutex::new(HashMap::new()),
                }),
            );
        Ok(core)
    }

    /// Whether the graph was built on a CUDA device from an edge list there.
    #[getter]
    fn built_on_device(&self) -> bool {
        self.origin.is_some()
    }

    /// The plans' policy: `"once"` (row orders kept: a graph seen once) or `"reuse"` (`auto`
    /// plans choose a row order on the host).
    #[getter]
    fn policy(&self) -> &'static str {
        match self.policy_value() {
            PlanPolicy::Once => "once",
            PlanPolicy::Reuse => "reuse",
        }
    }

    /// Sets the plans' policy (`"once"` or `"reuse"`) for good; where it changes, the plans
    /// built before are dropped, so the next call of each configuration plans again.
    fn set_policy(&self, policy: &str) -> PyResult<()> {
        let p = match policy {
            "once" => PlanPolicy::Once,
            "reuse" => PlanPolicy::Reuse,
            other => {
                return Err(value_error(
                    "policy",
                    format!("{other:?} is not \"once\" or \"reuse\""),
                ))
            }
        };
        self.fixed.store(true, Ordering::Relaxed);
        self.apply_policy(p);
        Ok(())
    }

    /// Backward calls on CUDA so far.
    #[getter]
    fn backward_calls(&self) -> usize {
        self.backwards.load(Ordering::Relaxed)
    }

    /// Writes the graph's edges into int64 CUDA tensors on device `device` at `src` and `dst`
    /// (`nnz` each: the columns and the rows of the CSR, in its order), ordered with `stream`:
    /// for a graph on that device, with no copy through the host.
    fn edge_index_into(
        &self,
        py: Python<'_>,
        device: i64,
        src: u64,
        dst: u64,
        stream: u64,
    ) -> PyResult<()> {
        let ordinal = device::ordinal(device)?;
        let nnz = self.nnz;
        py.detach(|| -> spattn::Result<()> {
            let _restore = device::ContextGuard::save();
            let d = self.on_device(ordinal)?;
            let gpu = &d.device.gpu;
            // SAFETY: the package passes the rows of a fresh contiguous 2 × nnz int64 CUDA
            // tensor on this device (8-byte aligned: the second row starts 8 · nnz bytes in),
            // alive for the call and ordered by `stream` (the bridge makes it wait for the
            // writes); `widen_to_i64` writes exactly `nnz` of each, element by element.
            unsafe {
                let mut s = ExternalVec::<i64>::new_element_aligned(gpu, "src", src, nnz)?;
                let mut t = ExternalVec::<i64>::new_element_aligned(gpu, "dst", dst, nnz)?;
                d.device.bridge.run(stream, || -> spattn::Result<()> {
                    let a = d.graph.csr()?;
                    spattn::ops::widen_to_i64(gpu, a.col_indices(), &mut s)?;
                    spattn::ops::widen_to_i64(gpu, a.row_indices(), &mut t)?;
                    Ok(())
                })
            }
        })
        .map_err(to_py)
    }

    /// A graph read from a MatrixMarket file (`.mtx` or `.mtx.gz`; its values are ignored),
    /// optionally symmetrized and with self loops.
    #[staticmethod]
    #[pyo3(signature = (path, symmetrize=false, self_loops=false))]
    fn read_matrix_market(
        py: Python<'_>,
        path: std::path::PathBuf,
        symmetrize: bool,
        self_loops: bool,
    ) -> PyResult<Self> {
        py.detach(|| {
            let csr = spattn::read_matrix_market(&path)
                .map_err(|e| formats_to_py("path", e))?
                .into_pattern();
            transform(csr, symmetrize, self_loops).map(|c| Self::new(c, 0))
        })
    }

    /// This graph with every reverse edge added (`symmetrize`) and/or the missing self loops
    /// (`self_loops`): a new graph (its own plans).
    #[pyo3(signature = (symmetrize=false, self_loops=false))]
    fn transformed(&self, py: Python<'_>, symmetrize: bool, self_loops: bool) -> PyResult<Self> {
        py.detach(|| {
            transform((**self.csr_py()?).clone(), symmetrize, self_loops)
                .map(|c| Self::new(c, self.duplicates))
        })
    }

    /// Rows (targets).
    #[getter]
    fn n_rows(&self) -> usize {
        self.n_rows
    }

    /// Columns (sources).
    #[getter]
    fn n_cols(&self) -> usize {
        self.n_cols
    }

    /// Edges.
    #[getter]
    fn nnz(&self) -> usize {
        self.nnz
    }

    /// Repeated input edges merged when the graph was built from an edge list.
    #[getter]
    fn duplicates(&self) -> usize {
        self.duplicates
    }

    /// The row offsets as native-endian int64 bytes (`n_rows + 1`).
    fn crow<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(int64_bytes(py, self.csr_py()?.row_offsets()))
    }

    /// The column indices as native-endian int64 bytes (`nnz`), row by row, sorted.
    fn col<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(int64_bytes(py, self.csr_py()?.col_indices()))
    }

    /// The row of every edge as native-endian int64 bytes (`nnz`), in CSR order.
    fn row<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(int64_bytes(py, &self.csr_py()?.row_indices()))
    }

    /// Builds (or finds) the plan of this configuration on CUDA device `device` and returns
    /// the algorithm it runs and why it was chosen; on the CPU (`device < 0`) says so.
    /// `extras`: the plan of calls with a bias or dropout; `edge_features` (with `extras`): of
    /// calls that also pass edge features (a plan of its own: fused-csr under `auto`).
    #[pyo3(signature = (
        device, dtype, heads, head_dim, scale, algorithm, extras = false, edge_features = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        &self,
        py: Python<'_>,
        device: i64,
        dtype: &str,
        heads: usize,
        head_dim: usize,
        scale: Option<f64>,
        algorithm: &str,
        extras: bool,
        edge_features: bool,
    ) -> PyResult<(String, String)> {
        let dt = DTypeName::parse(dtype)?;
        let algorithm = parse_algorithm(algorithm)?;
        if device < 0 {
            let t = dt.host()?;
            return Ok((
                "cpu".into(),
                format!(
                    "CPU: SDDMM -> edge softmax -> SpMM in {} on rayon threads",
                    if t == HostDType::F64 { "f64" } else { "f32" }
                ),
            ));
        }
        let key = PlanKey {
            edge_features: extras && edge_features,
            ..PlanKey::new(heads, head_dim, dt, algorithm, scale, extras)?
        };
        self.with_plan(py, device, key, |_, plan| {
            Ok((plan.algorithm().name().to_owned(), plan.choice().to_owned()))
        })
    }

    /// Device memory of this graph's uploads on CUDA device `device`, in bytes (0 before the
    /// first call there).
    fn device_bytes(&self, device: i64) -> PyResult<usize> {
        let ordinal = device::ordinal(device)?;
        let map = self.devices.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(map.get(&ordinal).map_or(0, |d| d.graph.device_bytes()))
    }

    /// Attention on CUDA device `device` (through the cached plan) or on the CPU (`device <
    /// 0`; f32 or f64); `problem` is (device, dtype, heads, head_dim). With `backward` false:
    /// `out = softmax_row(scale · Q Kᵀ masked by A) · V`, `ptrs` the addresses of Q, K, V and
    /// out; returns 0. With `backward`: the exact gradients, `ptrs` the addresses of Q, K, V,
    /// out (the forward's output), d_out (its gradient), dQ, dK and dV; returns ∂L/∂scale, or
    /// on CUDA with `d_scale` false NaN (the call then does not wait for the GPU). `lse` (CUDA;
    /// 0 for none): the address of `n_rows × heads` f32 for the row statistics: the forward
    /// keeps them there where its plan can and returns 1.0 (0.0 where it cannot, leaving the
    /// memory unread and unwritten); the backward takes them where the plan keeps them (the
    /// forward returned 1.0) and ignores them otherwise. `step`: whether a forward may begin a
    /// training step (not a recomputation inside a backward pass: `reuse_if_seen_again`).
    /// See the module documentation for the arguments' contract.
    #[pyo3(signature = (problem, scale, algorithm, backward, ptrs, stream, d_scale = true, lse = 0,
                        step = true))]
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        py: Python<'_>,
        problem: (i64, String, usize, usize),
        scale: Option<f64>,
        algorithm: &str,
        backward: bool,
        ptrs: Vec<u64>,
        stream: u64,
        d_scale: bool,
        lse: u64,
        step: bool,
    ) -> PyResult<f64> {
        let (device, dtype, heads, head_dim) = problem;
        let dt = DTypeName::parse(&dtype)?;
        let algorithm = parse_algorithm(algorithm)?;
        let (sq, skv) = self.shapes(heads, head_dim)?;
        check_addresses(&ptrs, if backward { 8 } else { 4 })?;
        let (fwd, bwd) = (first::<4>, first::<8>);
        if device < 0 {
            let t = dt.host()?;
            return py.detach(|| match (t, backward) {
                (HostDType::F32, false) => self
                    .cpu_forward::<f32>(sq, skv, scale, fwd(&ptrs))
                    .map(|()| 0.0),
                (HostDType::F64, false) => self
                    .cpu_forward::<f64>(sq, skv, scale, fwd(&ptrs))
                    .map(|()| 0.0),
                (HostDType::F32, true) => self.cpu_backward::<f32>(sq, skv, scale, bwd(&ptrs)),
                (HostDType::F64, true) => self.cpu_backward::<f64>(sq, skv, scale, bwd(&ptrs)),
            });
        }
        let key = PlanKey::new(heads, head_dim, dt, algorithm, scale, false)?;
        if backward {
            self.backwards.fetch_add(1, Ordering::Relaxed);
        }
        self.reuse_if_seen_again(py, device, stream, !backward && step)?;
        self.with_plan(py, device, key, |d, plan| {
            if backward {
                by_dtype!(
                    key.dtype,
                    gpu_backward_call(d, plan, bwd(&ptrs), stream, d_scale, lse)
                )
            } else {
                by_dtype!(key.dtype, gpu_forward(d, plan, fwd(&ptrs), stream, lse)).map(|kept| {
                    if kept {
                        1.0
                    } else {
                        0.0
                    }
                })
            }
        })
    }

    /// Attention with a per-edge score bias, dropout on the probabilities and/or edge features
    /// added to keys and values (see the `extras` module): `bias` is `"none"`, `"shared"`
    /// (`nnz` values) or `"per_head"` (`nnz × heads`), `dropout` `(rate, seed, offset)` or
    /// `None`, `edge_features` whether features (`nnz × heads × head_dim`) are given. Forward
    /// `ptrs`: `[q, k, v, out, bias, weights, features]` (0 for what is not given or wanted);
    /// backward: `[q, k, v, d_out, bias, dq, dk, dv, d_bias, features, d_features]`, returning
    /// ∂L/∂scale (0.0 for the forward; NaN on CUDA with `d_scale` false, which waits for
    /// nothing). `step` as for `attention`.
    #[pyo3(signature = (problem, scale, algorithm, backward, bias, dropout, edge_features, ptrs,
                        stream, d_scale = true, step = true))]
    #[allow(clippy::too_many_arguments)]
    fn attention_extras(
        &self,
        py: Python<'_>,
        problem: (i64, String, usize, usize),
        scale: Option<f64>,
        algorithm: &str,
        backward: bool,
        bias: &str,
        dropout: Option<(f64, u64, u64)>,
        edge_features: bool,
        ptrs: Vec<u64>,
        stream: u64,
        d_scale: bool,
        step: bool,
    ) -> PyResult<f64> {
        let (device, dtype, heads, head_dim) = problem;
        let dt = DTypeName::parse(&dtype)?;
        let algorithm = parse_algorithm(algorithm)?;
        let mut args = ExtrasArgs::parse(bias, dropout)?;
        args.edge_features = edge_features;
        let shapes = self.shapes(heads, head_dim)?;
        check_addresses(&ptrs, if backward { 11 } else { 7 })?;
        let (fwd, bwd) = (first::<7>, first::<11>);
        if device < 0 {
            let (csr, d) = (&**self.csr_py()?, shapes.0.head_dim);
            return py.detach(|| match (dt.host()?, backward) {
                (HostDType::F32, false) => {
                    let s = scale_of::<f32>(scale, d);
                    extras::cpu_forward(csr, shapes, s, args, fwd(&ptrs)).map(|()| 0.0)
                }
                (HostDType::F64, false) => {
                    let s = scale_of::<f64>(scale, d);
                    extras::cpu_forward(csr, shapes, s, args, fwd(&ptrs)).map(|()| 0.0)
                }
                (HostDType::F32, true) => {
                    extras::cpu_backward(csr, shapes, scale_of::<f32>(scale, d), args, bwd(&ptrs))
                }
                (HostDType::F64, true) => {
                    extras::cpu_backward(csr, shapes, scale_of::<f64>(scale, d), args, bwd(&ptrs))
                }
            });
        }
        let key = PlanKey {
            edge_features,
            ..PlanKey::new(heads, head_dim, dt, algorithm, scale, true)?
        };
        if backward {
            self.backwards.fetch_add(1, Ordering::Relaxed);
        }
        self.reuse_if_seen_again(py, device, stream, !backward && step)?;
        self.with_plan(py, device, key, |d, plan| {
            if backward {
                by_dtype!(
                    key.dtype,
                    extras::gpu_backward(d, plan, args, bwd(&ptrs), stream, d_scale)
                )
            } else {
                by_dtype!(
                    key.dtype,
                    extras::gpu_forward(d, plan, args, fwd(&ptrs), stream)
                )
                .map(|()| 0.0)
            }
        })
    }

    /// GAT attention: scores `s[e, h] = LeakyReLU(a_dst[row(e), h] + a_src[col(e), h])`,
    /// `P = softmax_row(s)`, `out[i, h, :] = Σ_e P[e, h] · x[col(e), h, :]`. `x` and `out` are
    /// `n × heads × dim` of `dtype`; `a_dst`, `a_src` are `n × heads` f32 on CUDA (of `dtype`
    /// on the CPU); `workspace` holds `nnz × heads` f32 on CUDA (unused on the CPU, pass 0).
    /// `dropout`: `(rate, seed, offset)` drops probabilities as `sparse_attention`'s does;
    /// `bias`: the address of `nnz × heads` values (f32 on CUDA, of `dtype` on the CPU) added to
    /// the scores before the LeakyReLU (GAT's edge features), 0 for none. `kernels` (CUDA):
    /// `"composed"` (the CSR ops) or `"rows"` (row statistics, no per-edge buffer: the
    /// workspace then holds `n × heads` f32; [`GatKernels::supports`] heads, their units walked
    /// in fused-csr's row order once the graph is reused). `step`: whether the call may begin a
    /// training step (as [`attention`](Self::attention)'s: a graph seen again after a backward
    /// switches to the `reuse` policy).
    ///
    #[pyo3(signature = (device, dtype, heads, dim, negative_slope, x, a_dst, a_src, out,
                        workspace, stream, dropout = None, bias = 0, kernels = "composed",
                        step = true))]
    #[allow(clippy::too_many_arguments)]
    fn gat_forward(
        &self,
        py: Python<'_>,
        device: i64,
        dtype: &str,
        heads: usize,
        dim: usize,
        negative_slope: f64,
        x: u64,
        a_dst: u64,
        a_src: u64,
        out: u64,
        workspace: u64,
        stream: u64,
        dropout: Option<(f64, u64, u64)>,
        bias: u64,
        kernels: &str,
        step: bool,
    ) -> PyResult<()> {
        let dt = DTypeName::parse(dtype)?;
        let slope = check_slope(negative_slope)?;
        let drop = ExtrasArgs::parse("none", dropout)?.dropout;
        let kernels = parse_gat_kernels(kernels, true).ok_or_else(|| {
            value_error(
                "kernels",
                format!("{kernels:?} is not \"composed\" or \"rows\""),
            )
        })?;
        let (sq, skv) = self.shapes(heads, dim)?;
        if device < 0 {
            let t = dt.host()?;
            let ptrs = [x, a_dst, a_src, out, bias];
            return py.detach(|| match t {
                HostDType::F32 => self.cpu_gat_forward::<f32>(sq, skv, slope, drop, ptrs),
                HostDType::F64 => self.cpu_gat_forward::<f64>(sq, skv, slope, drop, ptrs),
            });
        }
        let kind = dt.device()?;
        let ordinal = device::ordinal(device)?;
        self.reuse_if_seen_again(py, device, stream, step)?;
        let ptrs = [x, a_dst, a_src, out, workspace, bias];
        py.detach(|| -> spattn::Result<()> {
            let _restore = device::ContextGuard::save();
            let d = self.on_device(ordinal)?;
            let slope = slope as f32;
            by_dtype!(
                kind,
                gat_forward_gpu(&d, sq, skv, (slope, drop), kernels, ptrs, stream)
            )
        })
        .map_err(to_py)
    }

    /// The exact gradients of [`gat_forward`](Self::gat_forward) given `d_out`: writes `dx`
    /// (the aggregation's part of ∂L/∂x: the scores' part flows through `da_dst`, `da_src`),
    /// `da_dst` and `da_src` (f32 on CUDA). `dropout`: the forward's; `bias` and `d_bias`: the
    /// forward's score bias and where its gradient goes (`nnz × heads`; both 0 for none).
    /// `kernels` (CUDA): `"rows"` (row statistics and SpMM-shaped passes; the forward's `out`
    /// and, in `workspaces`, `nnz × heads` and `n × heads` f32), `"fused"` (two passes, no
    /// workspace) or `"composed"` (the CSR ops, in three `nnz × heads` f32 workspaces); zeros
    /// for what a path does not take and on the CPU; `lse_kept`: the second workspace holds the
    /// rows forward's statistics. The package chooses ([`gat_supports`]).
    ///
    /// [`gat_supports`]: crate::dense::gat_supports
    #[pyo3(signature = (device, dtype, heads, dim, negative_slope, x, a_dst, a_src, d_out, dx,
                        da_dst, da_src, workspaces, stream, dropout = None, bias = 0, d_bias = 0,
                        kernels = "composed", out = 0, lse_kept = false))]
    #[allow(clippy::too_many_arguments)]
    fn gat_backward(
        &self,
        py: Python<'_>,
        device: i64,
        dtype: &str,
        heads: usize,
        dim: usize,
        negative_slope: f64,
        x: u64,
        a_dst: u64,
        a_src: u64,
        d_out: u64,
        dx: u64,
        da_dst: u64,
        da_src: u64,
        workspaces: (u64, u64, u64),
        stream: u64,
        dropout: Option<(f64, u64, u64)>,
        bias: u64,
        d_bias: u64,
        kernels: &str,
        out: u64,
        lse_kept: bool,
    ) -> PyResult<()> {
        let dt = DTypeName::parse(dtype)?;
        let slope = check_slope(negative_slope)?;
        let drop = ExtrasArgs::parse("none", dropout)?.dropout;
        let kernels = parse_gat_kernels(kernels, false).ok_or_else(|| {
            value_error(
                "kernels",
                format!("{kernels:?} is not \"rows\", \"fused\" or \"composed\""),
            )
        })?;
        if kernels == GatKernels::Rows && out == 0 && device >= 0 {
            return Err(value_error(
                "out",
                "the rows kernels read the forward's output",
            ));
        }
        if (bias == 0) != (d_bias == 0) {
            return Err(value_error(
                "d_bias",
                "given exactly when the forward had a bias",
            ));
        }
        let (sq, skv) = self.shapes(heads, dim)?;
        let ptrs = [x, a_dst, a_src, d_out, dx, da_dst, da_src, bias, d_bias];
        if device < 0 {
            let t = dt.host()?;
            return py.detach(|| match t {
                HostDType::F32 => self.cpu_gat_backward::<f32>(sq, skv, slope, drop, ptrs),
                HostDType::F64 => self.cpu_gat_backward::<f64>(sq, skv, slope, drop, ptrs),
            });
        }
        let kind = dt.device()?;
        let ordinal = device::ordinal(device)?;
        self.backwards.fetch_add(1, Ordering::Relaxed);
        let ws = [workspaces.0, workspaces.1, workspaces.2];
        let slope = slope as f32;
        let [x, a_dst, a_src, d_out, dx, da_dst, da_src, bias, d_bias] = ptrs;
        let ptrs = [
            x, a_dst, a_src, d_out, dx, da_dst, da_src, bias, d_bias, out,
        ];
        py.detach(|| -> spattn::Result<()> {
            let _restore = device::ContextGuard::save();
            let d = self.on_device(ordinal)?;
            by_dtype!(
                kind,
                gat_backward_gpu(
                    &d,
                    sq,
                    skv,
                    (slope, drop),
                    (kernels, lse_kept),
                    ptrs,
                    ws,
                    stream
                )
            )
        })
        .map_err(to_py)
    }

    /// GATv2's forward (PyG's `GATv2Conv`) on CUDA: per edge `j → i` and head `h` the score
    /// `Σ_d att[h, d] · LeakyReLU(x_l[j, h, d] + x_r[i, h, d] (+ ef[e, h, d]))`, its softmax over
    /// each target's edges, dropout, and `out[i, h, :] = Σ_j P · x_l[j, h, :]`. `x_l` is
    /// `n_cols × heads × dim`, `x_r` and `out` `n_rows × heads × dim` of `dtype`, `att`
    /// `heads × dim` f32, `edge_features` `nnz × heads × dim` of `dtype` (0 for none) in CSR
    /// order; `workspace` holds `nnz × heads` f32. (The package computes the CPU path with
    /// torch ops.)
    #[pyo3(signature = (device, dtype, heads, dim, negative_slope, x_l, x_r, att,
                        edge_features, out, workspace, stream, dropout = None))]
    #[allow(clippy::too_many_arguments)]
    fn gatv2_forward(
        &self,
        py: Python<'_>,
        device: i64,
        dtype: &str,
        heads: usize,
        dim: usize,
        negative_slope: f64,
        x_l: u64,
        x_r: u64,
        att: u64,
        edge_features: u64,
        out: u64,
        workspace: u64,
        stream: u64,
        dropout: Option<(f64, u64, u64)>,
    ) -> PyResult<()> {
        let kind = DTypeName::parse(dtype)?.device()?;
        let slope = check_slope(negative_slope)? as f32;
        let drop = ExtrasArgs::parse("none", dropout)?.dropout;
        let (sq, skv) = self.shapes(heads, dim)?;
        let ordinal = device::ordinal(device)?;
        let ptrs = [x_l, x_r, att, edge_features, out, workspace];
        py.detach(|| -> spattn::Result<()> {
            let _restore = device::ContextGuard::save();
            let d = self.on_device(ordinal)?;
            by_dtype!(
                kind,
                gatv2_forward_gpu(&d, sq, skv, (slope, drop), ptrs, stream)
            )
        })
        .map_err(to_py)
    }

    /// The exact gradients of [`gatv2_forward`](Self::gatv2_forward) given `d_out`: writes
    /// `d_x_l`, `d_x_r` (of `dtype`), each row's share of ∂L/∂att into `d_att_rows`
    /// (`n_rows × heads × dim` f32, to be summed over rows) and, with edge features, `d_edge_features`
    /// (0 for none). `workspaces`: three `nnz × heads` f32 buffers; `dropout`: the forward's.
    #[pyo3(signature = (device, dtype, heads, dim, negative_slope, x_l, x_r, att,
                        edge_features, d_out, d_x_l, d_x_r, d_att_rows, d_edge_features,
                        workspaces, stream, dropout = None))]
    #[allow(clippy::too_many_arguments)]
    fn gatv2_backward(
        &self,
        py: Python<'_>,
        device: i64,
        dtype: &str,
        heads: usize,
        dim: usize,
        negative_slope: f64,
        x_l: u64,
        x_r: u64,
        att: u64,
        edge_features: u64,
        d_out: u64,
        d_x_l: u64,
        d_x_r: u64,
        d_att_rows: u64,
        d_edge_features: u64,
        workspaces: (u64, u64, u64),
        stream: u64,
        dropout: Option<(f64, u64, u64)>,
    ) -> PyResult<()> {
        let kind = DTypeName::parse(dtype)?.device()?;
        let slope = check_slope(negative_slope)? as f32;
        let drop = ExtrasArgs::parse("none", dropout)?.dropout;
        if (edge_features == 0) != (d_edge_features == 0) {
            return Err(value_error(
                "d_edge_features",
                "given exactly when the forward had edge features",
            ));
        }
        let (sq, skv) = self.shapes(heads, dim)?;
        let ordinal = device::ordinal(device)?;
        self.backwards.fetch_add(1, Ordering::Relaxed);
        let ptrs = [
            x_l,
            x_r,
            att,
            edge_features,
            d_out,
            d_x_l,
            d_x_r,
            d_att_rows,
            d_edge_features,
        ];
        let ws = [workspaces.0, workspaces.1, workspaces.2];
        py.detach(|| -> spattn::Result<()> {
            let _restore = device::ContextGuard::save();
            let d = self.on_device(ordinal)?;
            by_dtype!(
                kind,
                gatv2_backward_gpu(&d, sq, skv, (slope, drop), ptrs, ws, stream)
            )
        })
        .map_err(to_py)
    }

    fn __repr__(&self) -> String {
        format!(
            "GraphCore(n_rows={}, n_cols={}, nnz={})",
            self.n_rows, self.n_cols, self.nnz
        )
    }
}
