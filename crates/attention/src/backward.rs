//! Backward of [`AttentionPlan`]: the exact gradients of
//! `out = softmax_row(scale · Q Kᵀ masked by A) · V` with respect to Q, K, V and the scale, for
//! every algorithm the plan runs.
//!
//! Every forward algorithm (unfused or fused, CUDA cores or tensor cores) computes the same
//! function, so one backward serves them all: it recomputes the scores rather than storing
//! anything from the forward, and runs on CUDA cores over CSR (exact f32 arithmetic on every
//! dtype, f32 sums):
//!
//! | step | kernels | [`BackwardKernels::Fused`] | [`BackwardKernels::Unfused`] |
//! |---|---|---|---|
//! | `r = ⟨q, k⟩`, `dP = ⟨dOut, V⟩` per edge | SDDMM | 2 | 3 (plus `scale · r`) |
//! | `P`, `dS = P ⊙ (dP − Σ_row P ⊙ dP)`, `dscale = Σ dS ⊙ r`, Pᵀ and dSᵀ | | 1 fused row kernel | softmax, softmax backward, 2 transposes, a dot, a scale |
//! | `dQ = scale · dS · K` (A), `dK = scale · dSᵀ · Q`, `dV = Pᵀ · dOut` (Aᵀ) | SpMM | 3 | 3 |
//!
//! The fused row kernel ([`spattn_ops::backward::attention_edge_backward`]) recomputes each
//! row's softmax statistics (max, sum) and `D_i = Σ_row P ⊙ dP = ⟨dOut_i, Out_i⟩` from the
//! per-edge values, and writes P and dS straight into Aᵀ's edge order through the transpose
//! map. `D_i` is taken from the recomputed probabilities, not from the forward's `out`: it is
//! the same quantity for the function computed, and it does not inherit `out`'s rounding to
//! f16 / bf16; `out` is checked for its shape only.
//!
//! Lazy state: a plan uploads nothing for the backward until the first call of
//! [`AttentionPlan::backward`]; that call asks the plan's shared
//! [`spattn_ops::DeviceGraph`] for the CSR (with its schedules) and the transpose Aᵀ (with its
//! own schedules, so hub columns split like hub rows) with the map of edges between them —
//! uploaded once per graph, whatever the number of plans and layers over it — and allocates
//! four `nnz × heads` f32 buffers. They stay in the plan for later calls; forward-only users
//! pay nothing on the device.

use std::sync::{Mutex, PoisonError};

use spattn_formats::Csr;
use spattn_ops::backward as ops_backward;
use spattn_ops::cpu::{self, AttentionInputs};
use spattn_ops::{csr_ops, DType, DeviceGraph, DeviceMatrix, DeviceVec, Gpu, Shape};

use crate::error::{Error, Result};
use crate::plan::AttentionPlan;

/// Which kernels compute the per-edge part of the backward (both give the same gradients, to
/// f32 rounding).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackwardKernels {
    /// One fused row kernel after two SDDMMs (the default: fewer passes over the edges; see
    /// docs/kernels/backward.md, "Tried and kept").
    #[default]
    Fused,
    /// The composition of the spattn-ops building blocks: SDDMM, edge softmax, SDDMM, softmax
    /// backward, transposes, dot and scale.
    Unfused,
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
        state: &'a Mutex<Option<Box<BackwardState>>>,
    },
    /// A CPU plan: the graph.
    Cpu(&'a Csr),
}

/// Device state of the backward, built by the first call.
#[derive(Debug)]
pub(crate) struct BackwardState {
    /// `⟨q, k⟩` per edge (fused), or P then `⟨q, k⟩` (unfused); A's order.
    raw: DeviceVec<f32>,
    /// dP, then `scale · dS`; A's order.
    dp: DeviceVec<f32>,
    /// P in Aᵀ's order.
    p_t: DeviceVec<f32>,
    /// `scale · dS` in Aᵀ's order.
    ds_t: DeviceVec<f32>,
    /// The gradient of the scale (one f64).
    d_scale: DeviceVec<f64>,
}

impl BackwardState {
    fn new(gpu: &Gpu, graph: &DeviceGraph, heads: usize) -> Result<Self> {
        let edges = graph.nnz().checked_mul(heads).ok_or(Error::InvalidConfig {
            what: "heads",
            why: format!("{} edges x {heads} heads overflows usize", graph.nnz()),
        })?;
        // The uploads the backward reads, made now (once per graph) so a first backward fails
        // here rather than half-way.
        graph.csr()?;
        graph.transpose()?;
        Ok(Self {
            raw: DeviceVec::zeros(gpu, edges)?,
            dp: DeviceVec::zeros(gpu, edges)?,
            p_t: DeviceVec::zeros(gpu, edges)?,
            ds_t: DeviceVec::zeros(gpu, edges)?,
            d_scale: DeviceVec::zeros(gpu, 1)?,
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
        let d_scale = self.backward_impl(kernels, (q, k, v, out, d_out), (dq, dk, dv), true)?;
        Ok(d_scale.unwrap_or(0.0))
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
        (dq, dk, dv): (
            &mut DeviceMatrix<T>,
            &mut DeviceMatrix<T>,
            &mut DeviceMatrix<T>,
        ),
        read_scale: bool,
    ) -> Result<Option<f32>> {
        let BackwardParts::Gpu { gpu, graph, state } = self.backward_parts() else {
            return Err(Error::WrongPlanKind {
                plan: "CPU",
                use_instead: "backward_host",
            });
        };
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
        // each backward before it is read.
        let mut guard = state.lock().unwrap_or_else(PoisonError::into_inner);
        if guard.is_none() {
            *guard = Some(Box::new(BackwardState::new(gpu, graph, heads)?));
        }
        let st = guard.as_deref_mut().ok_or(Error::InvalidConfig {
            what: "backward state",
            why: "was not built".into(),
        })?;
        st.d_scale.fill(0.0)?;
        let (a, t) = (graph.csr()?, graph.transpose()?);
        match kernels {
            BackwardKernels::Fused => {
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
                    &mut st.d_scale,
                )?;
            }
            BackwardKernels::Unfused => {
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
        }
        csr_ops::spmm(gpu, a, &st.dp, k, dq)?;
        csr_ops::spmm(gpu, t.csr(), &st.ds_t, q, dk)?;
        csr_ops::spmm(gpu, t.csr(), &st.p_t, d_out, dv)?;
        if !read_scale {
            return Ok(None);
        }
        let d_scale = st.d_scale.to_host()?;
        Ok(Some(d_scale.first().copied().unwrap_or(0.0) as f32))
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
