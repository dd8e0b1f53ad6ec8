//! Backward of [`AttentionPlan`]: the exact gradients of
//! `out = softmax_row(scale · Q Kᵀ masked by A) · V` with respect to Q, K, V and the scale, for
//! every algorithm the plan runs.
//!
//! Every forward algorithm (unfused or fused, CUDA cores or tensor cores) computes the same
//! function, so one backward serves them all: it recomputes the scores rather than storing
//! them. The CUDA-core sets run over CSR with exact f32 arithmetic on every dtype (gradients
//! rounded to `T` once, at the end); the tensor-core set runs on `mma.sync` over BSB with f32
//! accumulation, rounding dS and P to `T` as mma operands. The kernel sets:
//!
//! | [`BackwardKernels`] | kernels | per-edge buffers | deterministic |
//! |---|---|---|---|
//! | `Auto` (default) | `TensorCore` where it runs (on a graph seen once past 2²⁰ edges in its own order not for heads ≤ 32 of ≤ 128 features in all, or with a bias), else `Fused` | none | yes |
//! | `Fused` | a row pass over A (dQ, the row statistics, ∂scale) and a column pass over Aᵀ (dK, dV): [`spattn_ops::backward::FusedBackward`] | none | yes |
//! | `PerEdge` | 2 SDDMMs (`⟨q, k⟩`, `⟨dOut, v⟩`), one fused row kernel (P, dS, Pᵀ, dSᵀ, ∂scale), 3 SpMMs | four `nnz × heads` f32 | yes |
//! | `Unfused` | the spattn-ops building blocks: SDDMM, edge softmax, softmax backward, transposes, dot, scale, SpMM | as `PerEdge` | as `PerEdge` |
//! | `TensorCore` | three passes on tensor cores over A's BSB (row statistics; dQ, ∂scale) and Aᵀ's BSB (dK, dV): [`spattn_ops::backward::TensorCoreBackward`] (f16 / bf16, head_dim a multiple of 8 up to 64, sm_80+; others run `Fused`) | none | yes |
//!
//! `Fused` runs the heads its lanes hold
//! ([`FusedBackward::supports`](spattn_ops::backward::FusedBackward::supports): head_dim ≤ 512
//! in multiples of 4 for f32, of 8 for f16 / bf16, and narrower heads of any width); other heads
//! take `PerEdge`. Its row pass recomputes each row's softmax
//! statistics and `D_i = Σ_row P ⊙ dP` from the scores, not from the forward's `out`: the same
//! quantity for the function computed, without `out`'s rounding to f16 / bf16; `out` is checked
//! for its shape only (`TensorCore` likewise).
//!
//! Lazy state: a plan uploads nothing for the backward until its first call, which asks the
//! plan's shared [`DeviceGraph`](crate::DeviceGraph) for the CSR and the transpose Aᵀ (each with its own
//! schedules, so hub columns split like hub rows) — built once per graph, whatever the number of
//! plans and layers over it — and allocates the kernel set's workspace (`Fused`: `n × heads`
//! row statistics and the split rows' partials; the others: four `nnz × heads` f32 buffers). It
//! stays in the plan for later calls; forward-only users pay nothing on the device.

use std::sync::{Mutex, PoisonError};

use spattn_formats::{Csr, Reorder};
use spattn_ops::backward::{
    self as ops_backward, DeviceSum, EdgeTerms, FusedBackward, TensorCoreBackward,
};
use spattn_ops::cpu::{self, AttentionInputs};
use spattn_ops::{csr_ops, DType, DeviceMatrix, DeviceVec, ExternalVec, Gpu, Shape};
use spattn_ops::{DeviceGraph, PlanPolicy};

use crate::error::{Error, Result};
use crate::extras::Extras;
use crate::plan::{seen_once, AttentionPlan, ONCE_FUSED_CSR_MAX_EDGES};

/// The widest head (the tensor-core backward's 32-feature slice) whose backward takes the fused
/// CUDA-core passes on a large graph seen once
/// ([`AttentionPlan::backward_kernels_with_extras`]).
const ONCE_FUSED_BACKWARD_MAX_HEAD_DIM: usize = 32;

/// The most features of all heads (heads × head_dim) whose backward without a bias takes the
/// fused CUDA-core passes on a large graph seen once: at 8 × 32 they lost to the tensor-core
/// passes on a graph with locality.
const ONCE_FUSED_BACKWARD_MAX_WIDTH: usize = 128;

/// Which kernels compute the backward (all give the same gradients, to f32 rounding; see the
/// `backward` module's table).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackwardKernels {
    /// The default: [`TensorCore`](Self::TensorCore) where it runs (f16 / bf16 heads of a
    /// multiple of 8 up to 64 features, sm_80 and later; its training steps measured 0.99–2.1×
    /// the fused set's there), [`Fused`](Self::Fused) otherwise, and on a graph seen once
    /// whose plan is not fused-tc (`Auto`'s fused-csr there: the BSBs of A and Aᵀ the
    /// tensor-core passes read would be built for one step). Bitwise deterministic either way.
    #[default]
    Auto,
    /// A row pass and a column pass on CUDA cores, no per-edge buffers (with edge features, one
    /// score pair per edge and head), bitwise deterministic
    /// (heads its lanes do not hold run [`PerEdge`](Self::PerEdge)).
    Fused,
    /// Two SDDMMs, one fused per-edge row kernel and three SpMMs over `nnz × heads` buffers;
    /// bitwise deterministic.
    PerEdge,
    /// The composition of the spattn-ops building blocks: SDDMM, edge softmax, SDDMM, softmax
    /// backward, transposes, dot and scale; bitwise deterministic.
    Unfused,
    /// Three passes on tensor cores over BSB and Aᵀ's BSB, no per-edge buffers, bitwise
    /// deterministic ([`TensorCoreBackward`]): f16 / bf16 heads of a multiple of 8 up to 64
    /// features on sm_80 and later; other configurations run [`Fused`](Self::Fused).
    TensorCore,
}

/// The gradients of [`AttentionPlan::backward_host`].
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionGradients<T> {
    /// ∂L/∂Q, `n_rows × heads × head_dim`.
    pub dq: Vec<T>,
    /// ∂L/∂K, `n_cols × heads × head_dim`.
    pub dk: Vec<T>,
    /// ∂L/∂V, `n_cols × heads × head_dim`.
    pub dv: Vec<T>,
    /// ∂L/∂scale, for the plan's configured scale.
    pub d_scale: f32,
}

/// Where a plan's backward runs (from `AttentionPlan::backward_parts`).
pub(crate) enum BackwardParts<'a> {
    /// A GPU plan: its handle, the shared graph, and the lazily built state.
    Gpu {
        gpu: &'a Gpu,
        graph: &'a DeviceGraph,
        state: &'a Mutex<BackwardState>,
    },
    /// A CPU plan: the graph.
    Cpu(&'a Csr),
}

/// Device state of the backward: each kernel set's workspace, built by its first call.
#[derive(Debug, Default)]
pub(crate) struct BackwardState {
    edge: Option<EdgeBuffers>,
    fused: Option<FusedBackward>,
    tc: Option<TensorCoreBackward>,
}

impl BackwardState {
    /// The fused backward's workspace for `shape`'s heads over `graph`, its passes walking
    /// the row order fused-csr's units run in for `reorder` (made by the first call).
    fn fused_workspace(
        &mut self,
        graph: &DeviceGraph,
        reorder: Reorder,
        shape: Shape,
    ) -> Result<&mut FusedBackward> {
        match &mut self.fused {
            Some(ws) => Ok(ws),
            slot => Ok(slot.insert(FusedBackward::on_graph(
                graph,
                shape.heads,
                shape.head_dim,
                reorder,
            )?)),
        }
    }

    /// The tensor-core backward's workspace for `shape`'s heads of `T` over A's BSB in the row
    /// order `reorder` (made by the first call).
    fn tc_workspace<T: DType>(
        &mut self,
        graph: &DeviceGraph,
        shape: Shape,
        reorder: Reorder,
    ) -> Result<&mut TensorCoreBackward> {
        match &mut self.tc {
            Some(ws) => Ok(ws),
            slot => Ok(slot.insert(TensorCoreBackward::new::<T>(
                graph,
                shape.heads,
                shape.head_dim,
                reorder,
            )?)),
        }
    }
}

/// The softmax statistic of each row and head of a forward (its log-sum-exp in the kernels'
/// log2 domain), kept by the caller from the forward to its backward: made by
/// [`AttentionPlan::row_stats`], filled by [`AttentionPlan::forward_keeping_stats`], read by
/// [`AttentionPlan::backward_with_stats`]. One per forward whose backward is pending: a plan
/// serving several layers gives each layer its own. Held in the plan's own allocation
/// ([`AttentionPlan::row_stats`]) or in the caller's ([`AttentionPlan::row_stats_in`]: a
/// framework's tensor saved for its backward).
///
/// ```no_run
/// use spattn::{Algorithm, AttentionConfig, AttentionPlan, BackwardKernels, Csr, DTypeKind};
/// use spattn::{DeviceMatrix, Gpu};
///
/// let gpu = Gpu::new(0)?;
/// let graph = Csr::from_edges(3, 3, &[(0, 1), (1, 2), (2, 0), (2, 2)])?;
/// let config = AttentionConfig::new(8, 64, DTypeKind::F16).with_algorithm(Algorithm::FusedTensorCore);
/// let plan = AttentionPlan::new_gpu(&gpu, &graph, config)?;
/// let q = DeviceMatrix::<spattn::f16>::zeros(&gpu, plan.shape_q())?;
/// let mut out = DeviceMatrix::zeros(&gpu, plan.shape_q())?;
/// let mut stats = plan.row_stats()?;
/// plan.forward_keeping_stats(&q, &q, &q, &mut out, &mut stats)?;
/// assert!(stats.is_kept() == plan.keeps_row_stats::<spattn::f16>());
/// let d_out = DeviceMatrix::zeros(&gpu, plan.shape_q())?;
/// let (mut dq, mut dk, mut dv) = (d_out.try_clone()?, d_out.try_clone()?, d_out.try_clone()?);
/// // No statistics pass where they were kept (else the backward computes its own).
/// let d_scale = plan.backward_with_stats(
///     BackwardKernels::default(), &q, &q, &q, &out, &d_out, &stats, (&mut dq, &mut dk, &mut dv),
/// )?;
/// # Ok::<(), spattn::Error>(())
/// ```
#[derive(Debug)]
pub struct RowStats {
    /// The plan they are for ([`AttentionPlan::row_stats`]).
    plan: u64,
    /// `n_rows × heads` f32.
    lse: StatsMemory,
    /// Whether the last forward kept them (else the backward computes its own).
    kept: bool,
}

/// Where a [`RowStats`] lives.
#[derive(Debug)]
enum StatsMemory {
    Owned(DeviceVec<f32>),
    Caller(ExternalVec<f32>),
}

impl StatsMemory {
    fn vec(&self) -> &DeviceVec<f32> {
        match self {
            Self::Owned(v) => v,
            Self::Caller(v) => v,
        }
    }
    fn vec_mut(&mut self) -> &mut DeviceVec<f32> {
        match self {
            Self::Owned(v) => v,
            Self::Caller(v) => v,
        }
    }
}

impl RowStats {
    /// Whether the last [`AttentionPlan::forward_keeping_stats`] kept the statistics (a
    /// fused-tc plan whose `Auto` backward takes the tensor-core passes).
    pub fn is_kept(&self) -> bool {
        self.kept
    }

    /// The statistics on the host, `n_rows × heads` (row-major by row, then head): each row's
    /// `log2 Σ_j 2^(scale · log2(e) · ⟨q_i, k_j⟩)`, 0 for a row without
    /// edges; meaningful where [`is_kept`](Self::is_kept).
    ///
    /// Errors: the download's (driver).
    pub fn to_host(&self) -> Result<Vec<f32>> {
        Ok(self.lse.vec().to_host()?)
    }
}

/// The per-edge kernel sets' buffers.
#[derive(Debug)]
struct EdgeBuffers {
    /// `⟨q, k⟩` per edge (per-edge), or P then `⟨q, k⟩` (unfused); A's order.
    raw: DeviceVec<f32>,
    /// dP, then `scale · dS`; A's order.
    dp: DeviceVec<f32>,
    /// P in Aᵀ's order.
    p_t: DeviceVec<f32>,
    /// `scale · dS` in Aᵀ's order.
    ds_t: DeviceVec<f32>,
    /// Each (row, head)'s share of the scale's gradient (per-edge kernel).
    dscale_rows: DeviceVec<f32>,
    /// The gradient of the scale.
    d_scale: DeviceSum,
}

impl EdgeBuffers {
    fn new(gpu: &Gpu, graph: &DeviceGraph, heads: usize) -> Result<Self> {
        let per_head = |n: usize, of: &str| {
            n.checked_mul(heads).ok_or(Error::InvalidConfig {
                what: "heads",
                why: format!("{n} {of} x {heads} heads overflows usize"),
            })
        };
        let (edges, rows) = (
            per_head(graph.nnz(), "edges")?,
            per_head(graph.n_rows(), "rows")?,
        );
        Ok(Self {
            raw: DeviceVec::zeros(gpu, edges)?,
            dp: DeviceVec::zeros(gpu, edges)?,
            p_t: DeviceVec::zeros(gpu, edges)?,
            ds_t: DeviceVec::zeros(gpu, edges)?,
            dscale_rows: DeviceVec::zeros(gpu, rows)?,
            d_scale: DeviceSum::new(gpu)?,
        })
    }
}

impl AttentionPlan {
    /// The gradients of the plan's attention on device operands: given the forward's inputs Q,
    /// K, V, its output `out` and the loss gradient `d_out` (shaped like `out`), writes ∂L/∂Q,
    /// ∂L/∂K, ∂L/∂V into `dq`, `dk`, `dv` (every element) and returns ∂L/∂scale for the
    /// configured scale.
    ///
    /// Works for every algorithm (all compute the same function; see the `backward` module's
    /// documentation for how, and for the state the first call uploads). Exact to f32
    /// arithmetic: the gradients are rounded to `T` once, at the end. The returned scalar is
    /// downloaded, so the call waits for the GPU.
    ///
    /// Errors: [`Error::WrongPlanKind`] on a CPU plan (use [`backward_host`](Self::backward_host)),
    /// [`Error::DTypeMismatch`], [`Error::ShapeMismatch`] naming the operand (`"Q"`, `"K"`,
    /// `"V"`, `"out"`, `"d_out"`, `"dQ"`, `"dK"`, `"dV"`), [`Error::Ops`] (driver, memory).
    #[allow(clippy::too_many_arguments)]
    pub fn backward<T: DType>(
        &self,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        out: &DeviceMatrix<T>,
        d_out: &DeviceMatrix<T>,
        dq: &mut DeviceMatrix<T>,
        dk: &mut DeviceMatrix<T>,
        dv: &mut DeviceMatrix<T>,
    ) -> Result<f32> {
        self.backward_with(BackwardKernels::default(), q, k, v, out, d_out, dq, dk, dv)
    }

    /// [`backward`](Self::backward) with the per-edge kernels chosen explicitly (to compare
    /// them; the default is the faster one measured).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_with<T: DType>(
        &self,
        kernels: BackwardKernels,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        out: &DeviceMatrix<T>,
        d_out: &DeviceMatrix<T>,
        dq: &mut DeviceMatrix<T>,
        dk: &mut DeviceMatrix<T>,
        dv: &mut DeviceMatrix<T>,
    ) -> Result<f32> {
        let io = (q, k, v, out, d_out);
        let d_scale = self.backward_impl(kernels, io, None, (dq, dk, dv), true)?;
        Ok(d_scale.unwrap_or(0.0))
    }

    /// A buffer for the row statistics of this plan's forward ([`RowStats`]): `n_rows × heads`
    /// f32 on the plan's GPU, empty until
    /// [`forward_keeping_stats`](Self::forward_keeping_stats) fills it.
    ///
    /// Errors: [`Error::WrongPlanKind`] on a CPU plan; allocation errors.
    pub fn row_stats(&self) -> Result<RowStats> {
        let (gpu, _, _) = self.gpu_backward_parts()?;
        let n = self.shape_q().rows * self.shape_q().heads;
        Ok(RowStats {
            plan: self.id(),
            lse: StatsMemory::Owned(DeviceVec::zeros(gpu, n)?),
            kept: false,
        })
    }

    /// [`row_stats`](Self::row_stats) in the caller's memory: `lse` views `n_rows × heads` f32
    /// on the plan's GPU (a tensor a framework saves from the forward to its backward), empty
    /// until [`forward_keeping_stats`](Self::forward_keeping_stats) fills it. `kept` declares
    /// that the memory already holds the statistics a forward of this graph, scale and heads
    /// kept (its [`RowStats::is_kept`] was true): the backward of a framework whose forward
    /// made an earlier view of the same memory. Declared wrongly, the gradients are wrong
    /// (nothing worse: the kernels read exactly `n_rows × heads` floats, the view's length,
    /// checked here).
    ///
    /// Errors: [`Error::WrongPlanKind`] on a CPU plan; [`Error::Ops`] with a length mismatch
    /// naming `"lse (rows × heads)"` (a view of another GPU: at the forward or backward that
    /// uses it).
    pub fn row_stats_in(&self, lse: ExternalVec<f32>, kept: bool) -> Result<RowStats> {
        // A GPU plan (the ops check the view's GPU where they use it).
        self.gpu_backward_parts()?;
        let expected = self.shape_q().rows * self.shape_q().heads;
        if lse.len() != expected {
            return Err(spattn_ops::Error::LengthMismatch {
                what: "lse (rows × heads)",
                expected,
                actual: lse.len(),
            }
            .into());
        }
        Ok(RowStats {
            plan: self.id(),
            lse: StatsMemory::Caller(lse),
            kept,
        })
    }

    /// Whether [`forward_keeping_stats`](Self::forward_keeping_stats) of `T` operands keeps
    /// the row statistics on this plan (a fused-tc plan whose `Auto` backward takes the
    /// tensor-core passes): a property of the plan and its graph's policy.
    pub fn keeps_row_stats<T: DType>(&self) -> bool {
        T::KIND == self.config().dtype
            && self.tensor_core_backward_auto::<T>(false)
            && self.runs_fused_tensor_core()
    }

    /// [`forward`](Self::forward) that also keeps each row's softmax statistic in `stats`
    /// where the tensor-core backward can take it (a fused-tc plan whose `Auto` backward takes
    /// the tensor-core passes: [`keeps_row_stats`](Self::keeps_row_stats)); otherwise the
    /// plain forward, and `stats` marked empty.
    /// [`backward_with_stats`](Self::backward_with_stats) of the same inputs then skips the
    /// backward's statistics pass.
    ///
    /// Errors: as [`forward`](Self::forward); [`Error::InvalidConfig`] for `stats` made by
    /// another plan.
    pub fn forward_keeping_stats<T: DType>(
        &self,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        out: &mut DeviceMatrix<T>,
        stats: &mut RowStats,
    ) -> Result<()> {
        self.check_stats(stats)?;
        stats.kept = false;
        let lse = self.keeps_row_stats::<T>().then(|| stats.lse.vec_mut());
        stats.kept = self.forward_impl(q, k, v, out, lse)?;
        Ok(())
    }

    /// [`backward_with`](Self::backward_with) from a forward that kept its row statistics in
    /// `stats` ([`forward_keeping_stats`](Self::forward_keeping_stats) of the same Q, K, V and
    /// `out`): the tensor-core backward takes them and each row's `⟨dOut_i, out_i⟩` in place of
    /// its statistics pass (∂L/∂scale stays exact; dQ, dK, dV carry `out`'s rounding at its
    /// size, within the dtype's tolerance). Statistics left empty, or other kernels, run as
    /// [`backward_with`](Self::backward_with).
    ///
    /// `stats` must hold the statistics of the forward that produced `out` (another forward's,
    /// kept in the same buffer since, give wrong gradients: one [`RowStats`] per pending
    /// backward).
    ///
    /// Errors: as [`backward_with`](Self::backward_with); [`Error::InvalidConfig`] for `stats`
    /// made by another plan.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_with_stats<T: DType>(
        &self,
        kernels: BackwardKernels,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        out: &DeviceMatrix<T>,
        d_out: &DeviceMatrix<T>,
        stats: &RowStats,
        (dq, dk, dv): (
            &mut DeviceMatrix<T>,
            &mut DeviceMatrix<T>,
            &mut DeviceMatrix<T>,
        ),
    ) -> Result<f32> {
        let kept = self.kept_stats(stats)?;
        let io = (q, k, v, out, d_out);
        let d_scale = self.backward_impl(kernels, io, kept, (dq, dk, dv), true)?;
        Ok(d_scale.unwrap_or(0.0))
    }

    /// [`backward_grads`](Self::backward_grads) from the statistics a forward kept in `stats`
    /// (as [`backward_with_stats`](Self::backward_with_stats), which also returns ∂L/∂scale):
    /// enqueues its kernels and returns without waiting for the GPU.
    ///
    /// Errors: as [`backward_with_stats`](Self::backward_with_stats).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_grads_with_stats<T: DType>(
        &self,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        out: &DeviceMatrix<T>,
        d_out: &DeviceMatrix<T>,
        stats: &RowStats,
        (dq, dk, dv): (
            &mut DeviceMatrix<T>,
            &mut DeviceMatrix<T>,
            &mut DeviceMatrix<T>,
        ),
    ) -> Result<()> {
        let kept = self.kept_stats(stats)?;
        let io = (q, k, v, out, d_out);
        self.backward_impl(BackwardKernels::default(), io, kept, (dq, dk, dv), false)
            .map(|_| ())
    }

    /// `stats` made by this plan (so sized for its rows and heads, of its graph and scale).
    fn check_stats(&self, stats: &RowStats) -> Result<()> {
        if stats.plan != self.id() {
            return Err(Error::InvalidConfig {
                what: "row statistics",
                why: "made by another plan: use this plan's row_stats()".into(),
            });
        }
        Ok(())
    }

    /// `stats` (checked by [`check_stats`](Self::check_stats)) where a forward kept them.
    fn kept_stats<'s>(&self, stats: &'s RowStats) -> Result<Option<&'s RowStats>> {
        self.check_stats(stats)?;
        Ok(stats.kept.then_some(stats))
    }

    /// [`backward`](Self::backward) without ∂L/∂scale: the gradients of Q, K and V only, so the
    /// call enqueues its kernels and returns without waiting for the GPU (the scale is a
    /// constant of the plan; a learnable temperature multiplies Q instead).
    ///
    /// Errors: as [`backward`](Self::backward).
    #[allow(clippy::too_many_arguments)]
    pub fn backward_grads<T: DType>(
        &self,
        q: &DeviceMatrix<T>,
        k: &DeviceMatrix<T>,
        v: &DeviceMatrix<T>,
        out: &DeviceMatrix<T>,
        d_out: &DeviceMatrix<T>,
        dq: &mut DeviceMatrix<T>,
        dk: &mut DeviceMatrix<T>,
        dv: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        self.backward_impl(
            BackwardKernels::default(),
            (q, k, v, out, d_out),
            None,
            (dq, dk, dv),
            false,
        )
        .map(|_| ())
    }

    /// The backward on the GPU; ∂L/∂scale downloaded where `read_scale` (a wait for the GPU).
    #[allow(clippy::type_complexity)]
    fn backward_impl<T: DType>(
        &self,
        kernels: BackwardKernels,
        (q, k, v, out, d_out): (
            &DeviceMatrix<T>,
            &DeviceMatrix<T>,
            &DeviceMatrix<T>,
            &DeviceMatrix<T>,
            &DeviceMatrix<T>,
        ),
        stats: Option<&RowStats>,
        (dq, dk, dv): (
            &mut DeviceMatrix<T>,
            &mut DeviceMatrix<T>,
            &mut DeviceMatrix<T>,
        ),
        read_scale: bool,
    ) -> Result<Option<f32>> {
        let (gpu, graph, state) = self.gpu_backward_parts()?;
        self.check_kind::<T>()?;
        let (sq, skv) = (self.shape_q(), self.shape_kv());
        for (what, actual, expected) in [
            ("Q", q.shape(), sq),
            ("K", k.shape(), skv),
            ("V", v.shape(), skv),
            ("out", out.shape(), sq),
            ("d_out", d_out.shape(), sq),
            ("dQ", dq.shape(), sq),
            ("dK", dk.shape(), skv),
            ("dV", dv.shape(), skv),
        ] {
            expect_shape(what, actual, expected)?;
        }
        let heads = sq.heads;
        let scale = self.config().scale();
        // The state holds no invariant a panic could break: every buffer is overwritten by
        // each backward before it is read (the fused set's counters are reset by the kernels
        // that raise them).
        let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
        // The uploads the backward reads (once per graph), before any buffer of the plan's; the
        // CSR transpose after the tensor-core passes, which do not read it.
        let a = graph.csr()?;
        let tc_runs = self.tensor_core_backward_runs::<T>();
        let kernels = match kernels {
            BackwardKernels::Auto if self.tensor_core_backward_auto::<T>(false) => {
                BackwardKernels::TensorCore
            }
            BackwardKernels::Auto => BackwardKernels::Fused,
            BackwardKernels::TensorCore if !tc_runs => BackwardKernels::Fused,
            other => other,
        };
        let kernels = match kernels {
            BackwardKernels::Fused if !FusedBackward::supports::<T>(sq.head_dim) => {
                BackwardKernels::PerEdge
            }
            other => other,
        };
        if kernels == BackwardKernels::TensorCore {
            let reorder = graph.effective_reorder(self.config().reorder);
            let ws = st.tc_workspace::<T>(graph, sq, reorder)?;
            let saved = stats.map(|s| (out, s.lse.vec()));
            ws.set_d_scale(read_scale);
            ws.run(gpu, scale, [q, k, v, d_out], saved, [dq, dk, dv])?;
            return read_d_scale(read_scale, ws.d_scale());
        }
        let t = graph.transpose()?;
        if kernels == BackwardKernels::Fused {
            let ws = st.fused_workspace(graph, self.config().reorder, sq)?;
            ws.set_d_scale(read_scale);
            ws.run(gpu, a, t, scale, [q, k, v, d_out], [dq, dk, dv])?;
            return read_d_scale(read_scale, ws.d_scale());
        }
        let st = match &mut st.edge {
            Some(buffers) => buffers,
            slot => slot.insert(EdgeBuffers::new(gpu, graph, heads)?),
        };
        if kernels == BackwardKernels::PerEdge {
            csr_ops::sddmm(gpu, a, q, k, 1.0, &mut st.raw)?;
            csr_ops::sddmm(gpu, a, d_out, v, 1.0, &mut st.dp)?;
            ops_backward::attention_edge_backward(
                gpu,
                a,
                t,
                heads,
                scale,
                &st.raw,
                &mut st.dp,
                &mut st.p_t,
                &mut st.ds_t,
                &mut st.dscale_rows,
                &mut st.d_scale,
            )?;
        } else {
            csr_ops::sddmm(gpu, a, q, k, scale, &mut st.raw)?;
            csr_ops::edge_softmax_in_place(gpu, a, &mut st.raw, heads, None)?;
            csr_ops::sddmm(gpu, a, d_out, v, 1.0, &mut st.dp)?;
            ops_backward::edge_softmax_backward_in_place(gpu, a, &st.raw, &mut st.dp, heads)?;
            ops_backward::transpose_edge_values(gpu, t, &st.raw, heads, &mut st.p_t)?;
            csr_ops::sddmm(gpu, a, q, k, 1.0, &mut st.raw)?;
            ops_backward::edge_dot(gpu, &st.dp, &st.raw, &mut st.d_scale)?;
            ops_backward::edge_scale(gpu, &mut st.dp, scale)?;
            ops_backward::transpose_edge_values(gpu, t, &st.dp, heads, &mut st.ds_t)?;
        }
        csr_ops::spmm(gpu, a, &st.dp, k, dq)?;
        csr_ops::spmm(gpu, t.csr(), &st.ds_t, q, dk)?;
        csr_ops::spmm(gpu, t.csr(), &st.p_t, d_out, dv)?;
        read_d_scale(read_scale, st.d_scale.total())
    }

    /// A GPU plan's handle, graph and backward state; a CPU plan is [`Error::WrongPlanKind`],
    /// naming `backward_host` (what a CPU plan runs).
    fn gpu_backward_parts(&self) -> Result<(&Gpu, &DeviceGraph, &Mutex<BackwardState>)> {
        match self.backward_parts() {
            BackwardParts::Gpu { gpu, graph, state } => Ok((gpu, graph, state)),
            BackwardParts::Cpu(_) => Err(Error::WrongPlanKind {
                plan: "CPU",
                use_instead: "backward_host",
            }),
        }
    }

    /// Whether the tensor-core backward runs this GPU plan's heads of `T` (f16 / bf16, a
    /// multiple of 8 up to 64 features, sm_80 and later).
    pub(crate) fn tensor_core_backward_runs<T: DType>(&self) -> bool {
        let BackwardParts::Gpu { gpu, .. } = self.backward_parts() else {
            return false;
        };
        TensorCoreBackward::supports(T::KIND, self.shape_q().head_dim)
            && gpu.compute_capability() >= (8, 0)
    }

    /// Whether `Auto` takes the tensor-core passes (for a backward with a bias where `bias`):
    /// where they run; on a graph seen once only with the fused-tc plan's BSB (else the BSBs
    /// of A and Aᵀ would be built for one step), and not where
    /// [`once_takes_fused_passes`](Self::once_takes_fused_passes).
    pub(crate) fn tensor_core_backward_auto<T: DType>(&self, bias: bool) -> bool {
        let BackwardParts::Gpu { graph, .. } = self.backward_parts() else {
            return false;
        };
        self.tensor_core_backward_runs::<T>()
            && (self.runs_fused_tensor_core() || !seen_once(graph))
            && !self.once_takes_fused_passes::<T>(graph, bias)
    }

    /// Whether the backward (with a bias where `bias`) takes the fused CUDA-core passes on a
    /// graph seen once ([`PlanPolicy::Once`], its rows in its own order) of more than
    /// [`ONCE_FUSED_CSR_MAX_EDGES`] edges (where `Auto` plans fused-tc; smaller ones plan
    /// fused-csr, whose backward is the fused one already): heads of at most
    /// [`ONCE_FUSED_BACKWARD_MAX_HEAD_DIM`] features, and without a bias at most
    /// [`ONCE_FUSED_BACKWARD_MAX_WIDTH`] features in all. There Aᵀ's BSB, built for one step,
    /// and a bias's staging cost the tensor-core passes more than the CUDA-core passes' whole
    /// difference (docs/kernels/backward.md, "Host-side choices").
    fn once_takes_fused_passes<T: DType>(&self, graph: &DeviceGraph, bias: bool) -> bool {
        let sq = self.shape_q();
        sq.head_dim <= ONCE_FUSED_BACKWARD_MAX_HEAD_DIM
            && (bias || sq.heads * sq.head_dim <= ONCE_FUSED_BACKWARD_MAX_WIDTH)
            && self.nnz() > ONCE_FUSED_CSR_MAX_EDGES
            && graph.policy() == PlanPolicy::Once
            && graph.effective_reorder(self.config().reorder) == Reorder::None
            && FusedBackward::supports::<T>(sq.head_dim)
    }

    /// The backward with a bias (per head or shared) and / or dropout (no edge features) on the
    /// tensor-core passes (the caller checked
    /// [`tensor_core_backward_runs`](Self::tensor_core_backward_runs)): writes dQ, dK, dV and
    /// ∂L/∂bias, and returns ∂L/∂scale where `read_scale`.
    pub(crate) fn tensor_core_extras_backward<T: DType>(
        &self,
        [q, k, v, d_out]: [&DeviceMatrix<T>; 4],
        extras: &Extras<'_, T>,
        [dq, dk, dv]: [&mut DeviceMatrix<T>; 3],
        d_bias: Option<&mut DeviceVec<T>>,
        read_scale: bool,
    ) -> Result<Option<f32>> {
        let (gpu, graph, state) = self.gpu_backward_parts()?;
        let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
        let reorder = graph.effective_reorder(self.config().reorder);
        let ws = st.tc_workspace::<T>(graph, self.shape_q(), reorder)?;
        ws.set_d_scale(read_scale);
        ws.run_with_extras(
            gpu,
            graph,
            self.config().scale(),
            [q, k, v, d_out],
            [dq, dk, dv],
            extras,
            d_bias,
        )?;
        read_d_scale(read_scale, ws.d_scale())
    }

    /// The backward with edge terms (edge features, a bias, the forward's dropout, each with
    /// its gradient's buffer where it has one) on the fused backward's two passes (the caller
    /// checked [`FusedBackward::supports`] for the head): writes dQ, dK, dV and the terms'
    /// gradients, and returns ∂L/∂scale where `read_scale`.
    pub(crate) fn fused_extras_backward<T: DType>(
        &self,
        operands: [&DeviceMatrix<T>; 4],
        terms: EdgeTerms<'_, T>,
        [dq, dk, dv]: [&mut DeviceMatrix<T>; 3],
        read_scale: bool,
    ) -> Result<Option<f32>> {
        let (gpu, graph, state) = self.gpu_backward_parts()?;
        let sq = self.shape_q();
        // As in `backward_impl`: every buffer is overwritten before it is read.
        let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
        let (a, t) = (graph.csr()?, graph.transpose()?);
        let ws = st.fused_workspace(graph, self.config().reorder, sq)?;
        let scale = self.config().scale();
        ws.set_d_scale(read_scale);
        ws.run_with_edge_terms(gpu, a, t, scale, operands, [dq, dk, dv], terms)?;
        read_d_scale(read_scale, ws.d_scale())
    }

    /// The gradients on host slices: Q, K, V, the forward's `out` and `d_out`, all row-major.
    ///
    /// On a GPU plan this uploads, runs [`backward`](Self::backward) and downloads; on a CPU
    /// plan it computes in f32 ([`spattn_ops::cpu::attention_backward`]: f16 / bf16 inputs
    /// widened, the gradients rounded back).
    ///
    /// Errors: [`Error::DTypeMismatch`], [`Error::LengthMismatch`] naming the operand, and
    /// those of [`backward`](Self::backward).
    pub fn backward_host<T: DType>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
        out: &[T],
        d_out: &[T],
    ) -> Result<AttentionGradients<T>> {
        self.check_kind::<T>()?;
        let (sq, skv) = (self.shape_q(), self.shape_kv());
        for (what, len, shape) in [
            ("Q", q.len(), sq),
            ("K", k.len(), skv),
            ("V", v.len(), skv),
            ("out", out.len(), sq),
            ("d_out", d_out.len(), sq),
        ] {
            if len != shape.len() {
                return Err(Error::LengthMismatch {
                    what,
                    expected: shape.len(),
                    actual: len,
                    shape,
                });
            }
        }
        match self.backward_parts() {
            BackwardParts::Gpu { gpu, .. } => {
                let up = |shape, x: &[T]| DeviceMatrix::from_host(gpu, shape, x);
                let (dq_in, dk_in, dv_in) = (up(sq, q)?, up(skv, k)?, up(skv, v)?);
                let (o, d) = (up(sq, out)?, up(sq, d_out)?);
                let mut dq = DeviceMatrix::zeros(gpu, sq)?;
                let mut dk = DeviceMatrix::zeros(gpu, skv)?;
                let mut dv = DeviceMatrix::zeros(gpu, skv)?;
                let d_scale =
                    self.backward(&dq_in, &dk_in, &dv_in, &o, &d, &mut dq, &mut dk, &mut dv)?;
                Ok(AttentionGradients {
                    dq: dq.to_host()?,
                    dk: dk.to_host()?,
                    dv: dv.to_host()?,
                    d_scale,
                })
            }
            BackwardParts::Cpu(a) => {
                let widen = |x: &[T]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
                let (q32, k32, v32) = (widen(q), widen(k), widen(v));
                let inputs = AttentionInputs::new(&q32, sq, &k32, skv, &v32, skv);
                let g = cpu::attention_backward(
                    a,
                    &inputs,
                    self.config().scale(),
                    &widen(out),
                    &widen(d_out),
                )?;
                let narrow = |x: Vec<f32>| x.into_iter().map(T::from_f32).collect::<Vec<T>>();
                Ok(AttentionGradients {
                    dq: narrow(g.dq),
                    dk: narrow(g.dk),
                    dv: narrow(g.dv),
                    d_scale: g.d_scale,
                })
            }
        }
    }

    fn check_kind<T: DType>(&self) -> Result<()> {
        if T::KIND != self.config().dtype {
            return Err(Error::DTypeMismatch {
                planned: self.config().dtype,
                given: T::KIND,
            });
        }
        Ok(())
    }
}

/// ∂L/∂scale downloaded where `read` (a wait for the GPU), else `None`.
pub(crate) fn read_d_scale(read: bool, d_scale: &DeviceVec<f64>) -> Result<Option<f32>> {
    if !read {
        return Ok(None);
    }
    let d_scale = d_scale.to_host()?;
    Ok(Some(d_scale.first().copied().unwrap_or(0.0) as f32))
}

fn expect_shape(what: &'static str, actual: Shape, expected: Shape) -> Result<()> {
    if actual != expected {
        return Err(Error::ShapeMismatch {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}
