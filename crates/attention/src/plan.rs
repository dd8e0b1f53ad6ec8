//! [`AttentionPlan`]: built once per graph and configuration, run many times.

use std::sync::{Arc, Mutex};

use spattn_formats::{Csr, DegreeStats};
use spattn_ops::cpu::{self, AttentionInputs};
use spattn_ops::{
    csr_ops, tc_ops, DType, DTypeKind, DeviceMatrix, DeviceMeBcrs, DeviceVec, Gpu, Shape,
};
use spattn_ops::{DeviceGraph, PlanPolicy};

use crate::config::{Algorithm, AttentionConfig};
use crate::error::{Error, Result};
use spattn_ops::{median_ms, Fastest};
use spattn_ops::{FusedCsr, FusedTensorCore, Hybrid, HybridInfo};

/// Sparse attention over one graph, planned once and run many times:
/// `out = softmax_row(scale · Q Kᵀ masked by A) · V` with Q of `n_rows × heads × head_dim`, K
/// and V of `n_cols × heads × head_dim`.
///
/// Building the plan validates the configuration, chooses the algorithm (for
/// [`Algorithm::Auto`]), and uploads everything the algorithm needs; [`forward`](Self::forward)
/// then only launches kernels. A plan built with [`new_cpu`](Self::new_cpu) runs the same
/// computation on the CPU (rayon) where there is no GPU.
///
/// ```
/// use spattn::{AttentionConfig, AttentionPlan};
/// use spattn_formats::Csr;
/// use spattn_ops::DTypeKind;
///
/// // Node 0 attends to 0 and 1; node 1 to itself.
/// let a = Csr::from_edges(2, 2, &[(0, 0), (0, 1), (1, 1)])?;
/// let plan = AttentionPlan::new_cpu(&a, AttentionConfig::new(1, 2, DTypeKind::F32))?;
/// let q = [1.0f32, 0.0, 0.0, 1.0];
/// let k = [1.0f32, 0.0, 0.0, 1.0];
/// let v = [1.0f32, 2.0, 3.0, 4.0];
/// let out = plan.forward_host(&q, &k, &v)?;
/// assert_eq!(&out[2..], &[3.0, 4.0]); // a single neighbour gets all the weight
/// # Ok::<(), spattn::Error>(())
/// ```
#[derive(Debug)]
pub struct AttentionPlan {
    config: AttentionConfig,
    algorithm: Algorithm,
    choice: String,
    shape_q: Shape,
    shape_kv: Shape,
    nnz: usize,
    runner: Runner,
    /// A number no other plan of the process has (row statistics name the plan they are for).
    id: u64,
}

/// Where a plan runs.
#[derive(Debug)]
enum Runner {
    /// On the CPU, over the graph (shared with whoever built the plan).
    Cpu(Arc<Csr>),
    Gpu(Box<GpuPlan>),
}

#[derive(Debug)]
struct GpuPlan {
    gpu: Gpu,
    /// The graph and its uploads, shared with the other plans and layers over it; the
    /// backward's uploads (CSR, Aᵀ) are made by its first call.
    graph: Arc<DeviceGraph>,
    state: Mutex<GpuState>,
    /// The backward's workspace, allocated by the first backward (forward-only plans never
    /// allocate it); independent of the forward algorithm.
    backward: Mutex<crate::backward::BackwardState>,
    /// The extras' per-edge buffers, allocated by the first call with extras.
    extras: Mutex<Option<Box<crate::extras::ExtrasState>>>,
}

impl GpuPlan {
    /// The forward state; the workspace holds no invariant a panic could break (each forward
    /// overwrites it).
    fn lock_state(&self) -> std::sync::MutexGuard<'_, GpuState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Per-algorithm device state: the graph in the format the algorithm reads (uploaded once, at
/// plan time, and only that format) and its workspace (mutated by each forward; one at a time).
#[derive(Debug)]
enum GpuState {
    /// The scores (`nnz × heads`) of the CUDA-core ops, which read the graph's CSR upload.
    Unfused {
        scores: DeviceVec<f32>,
    },
    /// ME-BCRS (shared through the graph's cache) and the slot-layout scores
    /// (`n_slots × heads`) of the tensor-core ops.
    UnfusedTensorCore {
        mebcrs: Arc<DeviceMeBcrs>,
        scores: DeviceVec<f32>,
    },
    /// The fused CSR kernel's mask (rows in its order) and workspace.
    FusedCsr(Box<FusedCsr>),
    FusedTensorCore(Box<FusedTensorCore>),
    /// The hybrid tile structure (degree-ordered, split at the calibrated threshold).
    Hybrid(Box<Hybrid>),
}

impl AttentionPlan {
    /// Plans attention over `graph` on `gpu`: validates `config`, chooses the algorithm and
    /// uploads the graph in the format it needs.
    ///
    /// Errors: [`Error::InvalidConfig`] (heads or head_dim 0, scale not finite),
    /// [`Error::Unsupported`] (an algorithm asked for explicitly that cannot run this shape, or
    /// one this build does not implement yet), [`Error::Ops`] (driver, memory).
    pub fn new_gpu(gpu: &Gpu, graph: &Csr, config: AttentionConfig) -> Result<Self> {
        config.validate()?;
        Self::on_graph(&Arc::new(DeviceGraph::new(gpu, graph.clone())), config)
    }

    /// Plans attention over a graph already on the GPU, sharing its uploads (CSR, Aᵀ, ME-BCRS,
    /// BSB) with every other plan and layer built over the same [`DeviceGraph`]: build one per
    /// graph, plan as many configurations over it as needed.
    ///
    /// Errors: as [`new_gpu`](Self::new_gpu).
    pub fn on_graph(graph: &Arc<DeviceGraph>, config: AttentionConfig) -> Result<Self> {
        config.validate()?;
        let gpu = graph.gpu();
        let stats = graph.degree_stats()?;
        let cc = gpu.compute_capability();
        let (algorithm, mut choice) = choose(&stats, &config, cc, graph.policy())?;
        let state = GpuState::new(graph, &config, algorithm)?;
        if let GpuState::Hybrid(h) = &state {
            choice = format!("{choice}; {}", h.info());
        }
        if let GpuState::FusedTensorCore(f) = &state {
            choice = format!("{choice}; {}", f.info());
        }
        if let GpuState::FusedCsr(f) = &state {
            choice = format!("{choice}; {}", f.info());
        }
        if let GpuState::UnfusedTensorCore { mebcrs, .. } = &state {
            let o = mebcrs.row_order();
            choice = format!(
                "{choice}; rows {}-ordered: {} ME-BCRS vectors ({:.2}x fewer than the graph's \
                 order)",
                o.used,
                o.vectors,
                o.vectors_natural as f64 / o.vectors.max(1) as f64
            );
        }
        let runner = Runner::Gpu(Box::new(GpuPlan {
            gpu: gpu.clone(),
            graph: graph.clone(),
            state: Mutex::new(state),
            backward: Mutex::default(),
            extras: Mutex::new(None),
        }));
        let dims = (graph.n_rows(), graph.n_cols(), graph.nnz());
        let mut plan = Self::assemble(dims, config, algorithm, choice, runner);
        if plan.config.algorithm == Algorithm::Auto && plan.config.autotune {
            plan.autotune()?;
        }
        Ok(plan)
    }

    /// Plans attention over `graph` on the CPU: the f32 reference composition (SDDMM → edge
    /// softmax → SpMM) on rayon threads, whatever the algorithm asked for.
    pub fn new_cpu(graph: &Csr, config: AttentionConfig) -> Result<Self> {
        Self::new_cpu_shared(&Arc::new(graph.clone()), config)
    }

    /// [`new_cpu`](Self::new_cpu) over a shared graph (no copy).
    pub fn new_cpu_shared(graph: &Arc<Csr>, config: AttentionConfig) -> Result<Self> {
        config.validate()?;
        let choice = format!(
            "CPU: SDDMM -> edge softmax -> SpMM in f32 on {} rayon threads",
            rayon_threads()
        );
        let runner = Runner::Cpu(graph.clone());
        Ok(Self::assemble(
            (graph.n_rows(), graph.n_cols(), graph.nnz()),
            config,
            Algorithm::UnfusedCsr,
            choice,
            runner,
        ))
    }

    fn assemble(
        (n_rows, n_cols, nnz): (usize, usize, usize),
        config: AttentionConfig,
        algorithm: Algorithm,
        choice: String,
        runner: Runner,
    ) -> Self {
        let shape_q = Shape {
            rows: n_rows,
            heads: config.heads,
            head_dim: config.head_dim,
        };
        let shape_kv = Shape {
            rows: n_cols,
            ..shape_q
        };
        Self {
            runner,
            config,
            algorithm,
            choice,
            shape_q,
            shape_kv,
            nnz,
            id: {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
        }
    }

    /// This plan's number, unique in the process.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The algorithm the plan runs (the resolved choice for [`Algorithm::Auto`]).
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }
    /// Why that algorithm was chosen.
    pub fn choice(&self) -> &str {
        &self.choice
    }
    /// The configuration the plan was built with.
    pub fn config(&self) -> &AttentionConfig {
        &self.config
    }
    /// Shape of Q and of the output: `n_rows × heads × head_dim`.
    pub fn shape_q(&self) -> Shape {
        self.shape_q
    }
    /// Shape of K and V: `n_cols × heads × head_dim`.
    pub fn shape_kv(&self) -> Shape {
        self.shape_kv
    }
    /// Number of edges of the graph.
    pub fn nnz(&self) -> usize {
        self.nnz
    }
    /// For a plan running [`Algorithm::Hybrid`]: the threshold, warp split and edge fractions
    /// it chose (also in [`choice`](Self::choice)); `None` for other algorithms.
    pub fn hybrid_info(&self) -> Option<HybridInfo> {
        let Runner::Gpu(g) = &self.runner else {
            return None;
        };
        match &*g.lock_state() {
            GpuState::Hybrid(h) => Some(h.info()),
            _ => None,
        }
    }
    /// Whether the plan runs on a GPU.
    pub fn is_gpu(&self) -> bool {
        matches!(self.runner, Runner::Gpu(_))
    }

    /// The graph on the GPU this plan runs over (shared with the plans and layers built on
    /// it); `None` for a CPU plan.
    pub fn device_graph(&self) -> Option<&Arc<DeviceGraph>> {
        match &self.runner {
            Runner::Gpu(g) => Some(&g.graph),
            Runner::Cpu(_) => None,
        }
    }

    /// Whether `algorithm` can run `config` on `gpu` in this build.
    pub fn supports(gpu: &Gpu, algorithm: Algorithm, config: &AttentionConfig) -> bool {
        let _ = gpu;
        config.validate().is_ok()
            && match algorithm {
                Algorithm::Auto | Algorithm::UnfusedCsr => true,
                Algorithm::FusedCsr => {
                    FusedCsr::supports(config.head_dim, config.dtype.size_bytes()).is_ok()
                }
                Algorithm::FusedTensorCore => {
                    gpu.compute_capability() >= (8, 0)
                        && FusedTensorCore::supports(config.head_dim, config.dtype).is_ok()
                }
                Algorithm::UnfusedTensorCore => gpu.compute_capability() >= (8, 0),
                Algorithm::Hybrid => {
                    gpu.compute_capability() >= (8, 0)
                        && Hybrid::supports(config.head_dim, config.dtype).is_ok()
                }
            }
    }

    /// Runs the plan on device operands: `out = softmax(scale · Q Kᵀ masked by A) · V`.
    ///
    /// Every element of `out` is written (rows without edges get zeros). Errors:
    /// [`Error::DTypeMismatch`], [`Error::ShapeMismatch`] naming the operand,
    /// [`Error::WrongPlanKind`] for a CPU plan.
    pub fn forward<T: DType>(
        &self,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        out: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        self.forward_impl(q, k, v, out, None).map(|_| ())
    }

    /// [`forward`](Self::forward), on a fused-tc plan also writing each row's log2-domain
    /// log-sum-exp into `lse` where given (`n_rows × heads`): whether it did (other
    /// algorithms run their plain forward and leave `lse` alone).
    pub(crate) fn forward_impl<T: DType>(
        &self,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        out: &mut DeviceMatrix<T>,
        lse: Option<&mut DeviceVec<f32>>,
    ) -> Result<bool> {
        let Runner::Gpu(g) = &self.runner else {
            return Err(Error::WrongPlanKind {
                plan: "CPU",
                use_instead: "forward_host",
            });
        };
        self.check_forward_operands(q, k, v)?;
        self.check_out("out", out.shape())?;
        let scale = self.config.scale();
        let mut state = g.lock_state();
        match (&mut *state, lse) {
            (GpuState::FusedTensorCore(f), Some(lse)) => {
                f.forward_with_lse(&g.gpu, q, k, v, scale, out, lse)?;
                return Ok(true);
            }
            (GpuState::Unfused { scores }, _) => {
                let csr = g.graph.csr()?;
                csr_ops::sddmm(&g.gpu, csr, q, k, scale, scores)?;
                csr_ops::edge_softmax_in_place(&g.gpu, csr, scores, self.config.heads, None)?;
                csr_ops::spmm(&g.gpu, csr, scores, v, out)?;
            }
            (GpuState::UnfusedTensorCore { mebcrs, scores }, _) => {
                tc_ops::sddmm(&g.gpu, mebcrs, q, k, scale, scores)?;
                tc_ops::edge_softmax_in_place(&g.gpu, mebcrs, scores, self.config.heads, None)?;
                tc_ops::spmm(&g.gpu, mebcrs, scores, v, out)?;
            }
            (GpuState::FusedCsr(f), _) => f.forward(&g.gpu, q, k, v, scale, out)?,
            (GpuState::FusedTensorCore(f), None) => f.forward(&g.gpu, q, k, v, scale, out)?,
            (GpuState::Hybrid(h), _) => h.forward(&g.gpu, q, k, v, scale, out)?,
        }
        Ok(false)
    }

    /// Whether the GPU state is fused-tc's (fixed once the plan is built: autotuning runs in
    /// the constructor).
    pub(crate) fn runs_fused_tensor_core(&self) -> bool {
        match &self.runner {
            Runner::Gpu(g) => matches!(&*g.lock_state(), GpuState::FusedTensorCore(_)),
            Runner::Cpu(_) => false,
        }
    }

    /// Runs the plan on host slices and returns the output (`n_rows × heads × head_dim`).
    ///
    /// On a GPU plan this uploads, runs [`forward`](Self::forward) and downloads; on a CPU plan
    /// it computes in f32 (f16 / bf16 inputs are widened, the output rounded back).
    pub fn forward_host<T: DType>(&self, q: &[T], k: &[T], v: &[T]) -> Result<Vec<T>> {
        self.check_dtype::<T>()?;
        self.check_len("Q", q.len(), self.shape_q)?;
        self.check_len("K", k.len(), self.shape_kv)?;
        self.check_len("V", v.len(), self.shape_kv)?;
        match &self.runner {
            Runner::Gpu(g) => {
                let dq = DeviceMatrix::from_host(&g.gpu, self.shape_q, q)?;
                let dk = DeviceMatrix::from_host(&g.gpu, self.shape_kv, k)?;
                let dv = DeviceMatrix::from_host(&g.gpu, self.shape_kv, v)?;
                let mut out = DeviceMatrix::zeros(&g.gpu, self.shape_q)?;
                self.forward(&dq, &dk, &dv, &mut out)?;
                Ok(out.to_host()?)
            }
            Runner::Cpu(a) => {
                let widen = |x: &[T]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
                let (q32, k32, v32) = (widen(q), widen(k), widen(v));
                let inputs = AttentionInputs::new(
                    &q32,
                    self.shape_q,
                    &k32,
                    self.shape_kv,
                    &v32,
                    self.shape_kv,
                );
                let mut out = vec![0.0f32; self.shape_q.len()];
                cpu::attention(a, &inputs, self.config.scale(), &mut out)?;
                Ok(out.into_iter().map(T::from_f32).collect())
            }
        }
    }

    /// Where the backward runs: on a GPU plan the handle, the shared graph and the lazily
    /// allocated backward workspace; on a CPU plan the graph.
    pub(crate) fn backward_parts(&self) -> crate::backward::BackwardParts<'_> {
        match &self.runner {
            Runner::Gpu(g) => crate::backward::BackwardParts::Gpu {
                gpu: &g.gpu,
                graph: &g.graph,
                state: &g.backward,
            },
            Runner::Cpu(a) => crate::backward::BackwardParts::Cpu(a),
        }
    }

    /// A GPU plan's handle, graph and extras state; `None` for a CPU plan.
    #[allow(clippy::type_complexity)]
    pub(crate) fn gpu_extras_parts(
        &self,
    ) -> Option<(
        &Gpu,
        &DeviceGraph,
        &Mutex<Option<Box<crate::extras::ExtrasState>>>,
    )> {
        match &self.runner {
            Runner::Gpu(g) => Some((&g.gpu, &g.graph, &g.extras)),
            Runner::Cpu(_) => None,
        }
    }

    /// Runs the plan's fused kernel with `extras` where its algorithm is fused-csr, fused-tc or
    /// hybrid; `None` for any other (the caller composes the unfused ops instead). Operands are
    /// checked by the caller.
    pub(crate) fn fused_with_extras<T: DType>(
        &self,
        (q, k, v): (&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>),
        extras: &spattn_ops::CsrExtras<'_, T>,
        out: &mut DeviceMatrix<T>,
    ) -> Option<Result<()>> {
        let Runner::Gpu(g) = &self.runner else {
            return None;
        };
        let scale = self.config.scale();
        let mut state = g.lock_state();
        let done = match &mut *state {
            GpuState::FusedCsr(f) => f.forward_with_extras(&g.gpu, (q, k, v), scale, extras, out),
            // Edge features: fused-tc's kernel where it takes them (f16 / bf16 heads of 64 or
            // 128 features), else the composition.
            GpuState::FusedTensorCore(f)
                if extras.edge_features.is_none() || f.takes_edge_features() =>
            {
                f.forward_with_extras(&g.gpu, &g.graph, (q, k, v), scale, extras, out)
            }
            GpuState::Hybrid(h) if extras.edge_features.is_none() => g
                .graph
                .host()
                .and_then(|a| h.forward_with_extras(&g.gpu, a, (q, k, v), scale, extras, out)),
            _ => return None,
        };
        Some(done.map_err(Error::from))
    }

    /// The GPU a GPU plan runs on; `None` for a CPU plan.
    pub fn gpu(&self) -> Option<&Gpu> {
        match &self.runner {
            Runner::Gpu(g) => Some(&g.gpu),
            Runner::Cpu(_) => None,
        }
    }

    /// A CPU plan's graph; `None` for a GPU plan.
    pub(crate) fn cpu_graph(&self) -> Option<&Csr> {
        match &self.runner {
            Runner::Cpu(a) => Some(a),
            Runner::Gpu(_) => None,
        }
    }

    /// Checks the dtype and the shapes of the forward's Q, K, V.
    pub(crate) fn check_forward_operands<T: DType>(
        &self,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
    ) -> Result<()> {
        self.check_dtype::<T>()?;
        self.check_shape("Q", q.shape(), self.shape_q)?;
        self.check_shape("K", k.shape(), self.shape_kv)?;
        self.check_shape("V", v.shape(), self.shape_kv)
    }

    /// Checks an output-shaped operand (`out`, `d_out`).
    pub(crate) fn check_out(&self, what: &'static str, shape: Shape) -> Result<()> {
        self.check_shape(what, shape, self.shape_q)
    }

    /// Checks the dtype and the lengths of host Q, K, V.
    pub(crate) fn check_host_operands<T: DType>(&self, q: &[T], k: &[T], v: &[T]) -> Result<()> {
        self.check_dtype::<T>()?;
        self.check_len("Q", q.len(), self.shape_q)?;
        self.check_len("K", k.len(), self.shape_kv)?;
        self.check_len("V", v.len(), self.shape_kv)
    }

    fn check_dtype<T: DType>(&self) -> Result<()> {
        if T::KIND != self.config.dtype {
            return Err(Error::DTypeMismatch {
                planned: self.config.dtype,
                given: T::KIND,
            });
        }
        Ok(())
    }

    fn check_shape(&self, what: &'static str, actual: Shape, expected: Shape) -> Result<()> {
        if actual != expected {
            return Err(Error::ShapeMismatch {
                what,
                expected,
                actual,
            });
        }
        Ok(())
    }

    fn check_len(&self, what: &'static str, actual: usize, shape: Shape) -> Result<()> {
        if actual != shape.len() {
            return Err(Error::LengthMismatch {
                what,
                expected: shape.len(),
                actual,
                shape,
            });
        }
        Ok(())
    }

    /// Times every candidate ([`spattn_ops::median_ms`]: the median of three after a
    /// warm-up) and keeps the fastest. Candidates keep the dtype's precision: for f32 the
    /// tensor-core algorithms (tf32) are left out.
    fn autotune(&mut self) -> Result<()> {
        let Runner::Gpu(g) = &self.runner else {
            return Ok(());
        };
        let exact_f32 = self.config.dtype == DTypeKind::F32;
        let candidates: Vec<Algorithm> = [
            Algorithm::UnfusedCsr,
            Algorithm::FusedCsr,
            Algorithm::UnfusedTensorCore,
            Algorithm::FusedTensorCore,
            Algorithm::Hybrid,
        ]
        .into_iter()
        .filter(|&a| !(exact_f32 && uses_tensor_cores(a)))
        .filter(|&a| Self::supports(&g.gpu, a, &self.config))
        .collect();
        // The installed state is the fastest so far after every candidate, so the winner is
        // never built twice (a plan's formats and row order can take seconds on large graphs).
        let mut fastest = Fastest::new();
        for &alg in &candidates {
            let candidate = GpuState::new(&g.graph, &self.config, alg)?;
            let previous = std::mem::replace(&mut *g.lock_state(), candidate);
            let ms = match self.config.dtype {
                DTypeKind::F32 => self.time_forward::<f32>(&g.gpu)?,
                DTypeKind::F16 => self.time_forward::<half::f16>(&g.gpu)?,
                DTypeKind::Bf16 => self.time_forward::<half::bf16>(&g.gpu)?,
            };
            if !fastest.offer(alg.name(), alg, ms, 0.0) {
                // Not faster than the best so far: that one goes back in.
                *g.lock_state() = previous;
            }
        }
        let Some((&best, best_ms)) = fastest.best() else {
            return Ok(());
        };
        self.algorithm = best;
        self.choice = format!(
            "autotuned: {best} ({best_ms:.4} ms) of {}",
            fastest.report()
        );
        Ok(())
    }

    /// The installed state's forward time on scratch inputs (random, not zeros: some kernels
    /// run faster on zeros), ms.
    fn time_forward<T: DType>(&self, gpu: &Gpu) -> Result<f64> {
        let draw = |shape: Shape| -> Result<DeviceMatrix<T>> {
            let host: Vec<T> = (0..shape.len())
                .map(|i| {
                    T::from_f32(
                        ((i as u32).wrapping_mul(2_654_435_761) >> 8) as f32 / 16_777_216.0 - 0.5,
                    )
                })
                .collect();
            Ok(DeviceMatrix::from_host(gpu, shape, &host)?)
        };
        let q = draw(self.shape_q)?;
        let kv = draw(self.shape_kv)?;
        let mut out = DeviceMatrix::<T>::zeros(gpu, self.shape_q)?;
        let mut err = None;
        let ms = median_ms(gpu, || {
            if let Err(e) = self.forward(&q, &kv, &kv, &mut out) {
                err = Some(e);
            }
            Ok(())
        })?;
        match err {
            Some(e) => Err(e),
            None => Ok(ms),
        }
    }
}

impl GpuState {
    /// The state of `alg` over `dg`. A graph built on the device keeps its row order under
    /// `Reorder::Auto` ([`DeviceGraph::effective_reorder`]) and gets its formats from the
    /// device where they are built there (CSR, BSB); the other formats read its host CSR.
    fn new(dg: &Arc<DeviceGraph>, config: &AttentionConfig, alg: Algorithm) -> Result<Self> {
        let gpu = dg.gpu();
        let (h, d, r) = (
            config.heads,
            config.head_dim,
            dg.effective_reorder(config.reorder),
        );
        Ok(match alg {
            Algorithm::FusedCsr => GpuState::FusedCsr(Box::new(match config.dtype {
                DTypeKind::F32 => FusedCsr::on_graph::<f32>(dg, h, d, r)?,
                DTypeKind::F16 => FusedCsr::on_graph::<half::f16>(dg, h, d, r)?,
                DTypeKind::Bf16 => FusedCsr::on_graph::<half::bf16>(dg, h, d, r)?,
            })),
            Algorithm::FusedTensorCore => GpuState::FusedTensorCore(Box::new(match config.dtype {
                DTypeKind::F32 => FusedTensorCore::new::<f32>(dg, h, d, r)?,
                DTypeKind::F16 => FusedTensorCore::new::<half::f16>(dg, h, d, r)?,
                DTypeKind::Bf16 => FusedTensorCore::new::<half::bf16>(dg, h, d, r)?,
            })),
            Algorithm::Hybrid => {
                let (s, p) = (config.scale(), config.hybrid);
                let graph = dg.host()?;
                GpuState::Hybrid(Box::new(match config.dtype {
                    DTypeKind::F32 => Hybrid::new::<f32>(gpu, graph, h, d, s, p, r)?,
                    DTypeKind::F16 => Hybrid::new::<half::f16>(gpu, graph, h, d, s, p, r)?,
                    DTypeKind::Bf16 => Hybrid::new::<half::bf16>(gpu, graph, h, d, s, p, r)?,
                }))
            }
            Algorithm::UnfusedTensorCore => {
                gpu.require_compute_capability("unfused-tc", 8, 0)?;
                let mebcrs = dg.mebcrs_in(r)?;
                let scores = DeviceVec::zeros(gpu, mebcrs.n_slots() * h)?;
                GpuState::UnfusedTensorCore { mebcrs, scores }
            }
            _ => {
                dg.csr()?;
                GpuState::Unfused {
                    scores: DeviceVec::zeros(gpu, dg.nnz() * h)?,
                }
            }
        })
    }
}

/// Whether `alg` computes on tensor cores (f32 operands then go through tf32).
fn uses_tensor_cores(alg: Algorithm) -> bool {
    matches!(
        alg,
        Algorithm::UnfusedTensorCore | Algorithm::FusedTensorCore | Algorithm::Hybrid
    )
}

/// Edges up to which `Auto` plans f16 and bf16 on fused-csr for a graph seen once. One new
/// graph's attention forward + backward with its plan (8 × 32, 1 × 40, 8 × 64 f16, H200) took
/// 0.80–1.14× fused-tc's wall time on fused-csr up to ~6·10⁵ edges, and 1.24× on ogbn-arxiv's
/// 2.5·10⁶ at 8 × 64: fused-tc's plan is repaid from about 10⁶ edges (docs/kernels/README.md).
pub(crate) const ONCE_FUSED_CSR_MAX_EDGES: usize = 1 << 20;

/// Whether a graph of `nnz` edges under `policy` is one whose tensor-core plan would not be
/// repaid: seen once, at most [`ONCE_FUSED_CSR_MAX_EDGES`] edges.
fn small_once(policy: PlanPolicy, nnz: usize) -> bool {
    policy == PlanPolicy::Once && nnz <= ONCE_FUSED_CSR_MAX_EDGES
}

/// [`small_once`] of a device graph: `Auto` plans it on fused-csr in f16 / bf16, and its
/// backward's `Auto` keeps off the tensor-core passes (their BSBs) unless the plan is fused-tc.
pub(crate) fn seen_once(graph: &DeviceGraph) -> bool {
    small_once(graph.policy(), graph.nnz())
}

/// Resolves the algorithm for `graph` and `config` on a device of compute capability `cc`,
/// with the reason.
///
/// `Auto` takes the fastest measured algorithm for the dtype: fused-tc for f16 and bf16,
/// fused-csr for f32, the fastest of those that keep f32 exact (the tensor-core ones round
/// operands to tf32 — ask for them by name); docs/kernels/README.md, "Which kernel runs". On a
/// graph seen once ([`PlanPolicy::Once`]: a mini-batch's) of at most
/// [`ONCE_FUSED_CSR_MAX_EDGES`] edges f16 and bf16 take fused-csr too: fused-tc's plan (the
/// BSB of A and of Aᵀ, their schedules read back to the host) costs such a step more than its
/// faster kernel saves. A plan made for extras that may include edge features gets fused-csr,
/// which runs every extra in its kernel (unfused-csr where fused-csr cannot hold the head);
/// without edge features the plain choice stands (every algorithm's kernel takes a bias and
/// dropout).
fn choose(
    stats: &DegreeStats,
    config: &AttentionConfig,
    cc: (i32, i32),
    policy: PlanPolicy,
) -> Result<(Algorithm, String)> {
    let fused_csr_ok = FusedCsr::supports(config.head_dim, config.dtype.size_bytes());
    let tensor_cores = cc >= (8, 0);
    let fused_tc_ok = FusedTensorCore::supports(config.head_dim, config.dtype);
    let needs_tc = |alg: Algorithm| -> Result<()> {
        if tensor_cores {
            Ok(())
        } else {
            Err(Error::Unsupported {
                algorithm: alg,
                why: format!(
                    "needs compute capability 8.0 or newer; the device has {}.{}",
                    cc.0, cc.1
                ),
            })
        }
    };
    // Extras without edge features take Auto's plain choice: every algorithm's kernel runs a
    // bias and dropout.
    if config.edge_extras && config.edge_features && config.algorithm == Algorithm::Auto {
        // fused-csr runs every extra in its one kernel; with edge features it beat unfused-csr
        // everywhere measured, and fused-tc's `_xf` kernels forward + backward on power-law
        // graphs (1.18x on R-MAT 18; they lead by 1.03-1.15x elsewhere; see
        // docs/kernels/edge-extras.md).
        return Ok(match fused_csr_ok {
            Ok(_) => (
                Algorithm::FusedCsr,
                format!(
                    "auto: fused-csr — planned for extras (score bias, edge features, dropout), \
                     which its one kernel runs; exact {} on CUDA cores",
                    config.dtype
                ),
            ),
            Err(e) => (
                Algorithm::UnfusedCsr,
                format!(
                    "auto: unfused-csr — planned for extras, which its composition runs; \
                     fused-csr unavailable ({e})"
                ),
            ),
        });
    }
    match config.algorithm {
        Algorithm::Auto => {
            let mut why = format!("mean degree {:.1}, max {}", stats.mean, stats.max);
            if config.edge_extras {
                why += "; planned for a score bias and dropout without edge features";
            }
            let once = small_once(policy, stats.nnz) && fused_csr_ok.is_ok();
            if once && config.dtype != DTypeKind::F32 {
                return Ok((
                    Algorithm::FusedCsr,
                    format!(
                        "auto: fused-csr — a graph seen once (policy once) of at most {} \
                         edges, which fused-tc's plan would not repay; exact {} on CUDA cores \
                         ({why})",
                        ONCE_FUSED_CSR_MAX_EDGES, config.dtype
                    ),
                ));
            }
            if config.dtype != DTypeKind::F32 && tensor_cores && fused_tc_ok.is_ok() {
                return Ok((
                    Algorithm::FusedTensorCore,
                    format!(
                        "auto: fused-tc — {} on tensor cores, one kernel, K/V rows shared by the 16 rows of a window ({why})",
                        config.dtype
                    ),
                ));
            }
            match fused_csr_ok {
                Ok(_) => Ok((
                    Algorithm::FusedCsr,
                    format!(
                        "auto: fused-csr — exact {} on CUDA cores, one pass over each row's edges, scores never reach device memory ({why})",
                        config.dtype
                    ),
                )),
                Err(e) => Ok((
                    Algorithm::UnfusedCsr,
                    format!("auto: unfused-csr — fused-csr unavailable ({e}; {why})"),
                )),
            }
        }
        Algorithm::UnfusedCsr => Ok((Algorithm::UnfusedCsr, "requested".into())),
        Algorithm::FusedCsr => {
            fused_csr_ok?;
            Ok((Algorithm::FusedCsr, "requested".into()))
        }
        Algorithm::UnfusedTensorCore => {
            needs_tc(Algorithm::UnfusedTensorCore)?;
            Ok((Algorithm::UnfusedTensorCore, "requested".into()))
        }
        Algorithm::FusedTensorCore => {
            needs_tc(Algorithm::FusedTensorCore)?;
            fused_tc_ok?;
            Ok((Algorithm::FusedTensorCore, "requested".into()))
        }
        Algorithm::Hybrid => {
            needs_tc(Algorithm::Hybrid)?;
            Hybrid::supports(config.head_dim, config.dtype)?;
            Ok((Algorithm::Hybrid, "requested".into()))
        }
    }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests;
