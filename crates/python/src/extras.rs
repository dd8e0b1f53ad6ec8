//! Attention with a per-edge score bias and dropout on the probabilities (`GraphCore.
//! attention_extras`): the CPU reference and the GPU plans' extras path, with their exact
//! backward. The layout contract is `graph`'s (module documentation there); the bias is
//! `nnz` (shared by the heads) or `nnz × heads` values of the features' dtype in the graph's
//! CSR edge order, the attention weights `nnz × heads` (f32 on CUDA, the features' dtype on
//! the CPU) in the same order.

use pyo3::prelude::*;
use spattn::ops::cpu::{self, AttentionInputs, EdgeBias, Extras as CpuExtras, Real};
use spattn::ops::external::{ExternalMatrix, ExternalVec};
use spattn::{AttentionPlan, Csr, DType, DeviceBias, Dropout, Extras, ExtrasGrads, Shape};

use crate::errors::{ops_to_py, to_py, value_error};
use crate::graph::OnDevice;
use crate::host;

/// How the bias is given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BiasKind {
    /// No bias.
    None,
    /// `nnz` values, one per edge for every head.
    Shared,
    /// `nnz × heads` values.
    PerHead,
}

/// The extras of one call: the bias's layout and the dropout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExtrasArgs {
    pub(crate) bias: BiasKind,
    pub(crate) dropout: Option<Dropout>,
}

impl ExtrasArgs {
    /// `bias` is `"none"`, `"shared"` or `"per_head"`; `dropout` is `(rate, seed, offset)`.
    pub(crate) fn parse(bias: &str, dropout: Option<(f64, u64, u64)>) -> PyResult<Self> {
        let bias = match bias {
            "none" => BiasKind::None,
            "shared" => BiasKind::Shared,
            "per_head" => BiasKind::PerHead,
            other => {
                return Err(value_error(
                    "bias",
                    format!("layout {other:?}: expected \"none\", \"shared\" or \"per_head\""),
                ))
            }
        };
        let dropout = match dropout {
            // A rate of 0 draws nothing: no mask to regenerate.
            Some((0.0, _, _)) => None,
            Some((rate, seed, offset)) => Some(
                Dropout::new(rate as f32, seed, offset).map_err(|e| value_error("dropout", e))?,
            ),
            None => None,
        };
        Ok(Self { bias, dropout })
    }

    /// The bias's length on a graph of `nnz` edges and `heads` heads (0 without one).
    fn bias_len(&self, nnz: usize, heads: usize) -> spattn::Result<usize> {
        match self.bias {
            BiasKind::None => Ok(0),
            BiasKind::Shared => Ok(nnz),
            BiasKind::PerHead => nnz.checked_mul(heads).ok_or(spattn::Error::InvalidConfig {
                what: "bias",
                why: format!("nnz × heads = {nnz} × {heads} overflows"),
            }),
        }
    }

    fn cpu<'a, F>(&self, bias: &'a [F]) -> CpuExtras<'a, F> {
        CpuExtras {
            bias: match self.bias {
                BiasKind::None => None,
                BiasKind::Shared => Some(EdgeBias::Shared(bias)),
                BiasKind::PerHead => Some(EdgeBias::PerHead(bias)),
            },
            edge_features: None,
            dropout: self.dropout,
        }
    }

    fn device<'a, T: DType>(&self, bias: &'a spattn::DeviceVec<T>) -> Extras<'a, T> {
        Extras {
            bias: match self.bias {
                BiasKind::None => None,
                BiasKind::Shared => Some(DeviceBias::Shared(bias)),
                BiasKind::PerHead => Some(DeviceBias::PerHead(bias)),
            },
            edge_features: None,
            dropout: self.dropout,
        }
    }
}

/// The CPU forward with extras at `[q, k, v, out, bias, weights]` (bias 0 without one,
/// weights 0 when not wanted).
pub(crate) fn cpu_forward<F: Real>(
    csr: &Csr,
    (sq, skv): (Shape, Shape),
    scale: F,
    args: ExtrasArgs,
    [q, k, v, out, bias, weights]: [u64; 6],
) -> PyResult<()> {
    let edges = csr.nnz() * sq.heads;
    let bias_len = args.bias_len(csr.nnz(), sq.heads).map_err(to_py)?;
    // SAFETY: the package's contract (graph's module documentation): contiguous host tensors
    // of F with these element counts, alive for the call; `out` and `weights` fresh, so
    // unaliased.
    let (q, k, v, out, bias, weights) = unsafe {
        (
            host::slice::<F>("q", q, sq.len())?,
            host::slice::<F>("k", k, skv.len())?,
            host::slice::<F>("v", v, skv.len())?,
            host::slice_mut::<F>("out", out, sq.len())?,
            host::slice::<F>("bias", bias, bias_len)?,
            if weights == 0 {
                None
            } else {
                Some(host::slice_mut::<F>("weights", weights, edges)?)
            },
        )
    };
    let inputs = AttentionInputs::new(q, sq, k, skv, v, skv);
    cpu::attention_extras(csr, &inputs, scale, &args.cpu(bias), out, weights).map_err(ops_to_py)
}

/// The CPU backward with extras at `[q, k, v, d_out, bias, dq, dk, dv, d_bias]` (bias and
/// d_bias 0 without a bias); returns ∂L/∂scale.
pub(crate) fn cpu_backward<F: Real>(
    csr: &Csr,
    (sq, skv): (Shape, Shape),
    scale: F,
    args: ExtrasArgs,
    [q, k, v, d_out, bias, dq, dk, dv, d_bias]: [u64; 9],
) -> PyResult<f64> {
    let bias_len = args.bias_len(csr.nnz(), sq.heads).map_err(to_py)?;
    // SAFETY: as in `cpu_forward`.
    let (q, k, v, d_out, bias) = unsafe {
        (
            host::slice::<F>("q", q, sq.len())?,
            host::slice::<F>("k", k, skv.len())?,
            host::slice::<F>("v", v, skv.len())?,
            host::slice::<F>("d_out", d_out, sq.len())?,
            host::slice::<F>("bias", bias, bias_len)?,
        )
    };
    let inputs = AttentionInputs::new(q, sq, k, skv, v, skv);
    let g = cpu::attention_extras_backward(csr, &inputs, scale, &args.cpu(bias), d_out)
        .map_err(ops_to_py)?;
    // SAFETY: as above: fresh outputs of these lengths.
    let (dq, dk, dv, d_bias) = unsafe {
        (
            host::slice_mut::<F>("dq", dq, sq.len())?,
            host::slice_mut::<F>("dk", dk, skv.len())?,
            host::slice_mut::<F>("dv", dv, skv.len())?,
            host::slice_mut::<F>("d_bias", d_bias, bias_len)?,
        )
    };
    dq.copy_from_slice(&g.dq);
    dk.copy_from_slice(&g.dk);
    dv.copy_from_slice(&g.dv);
    if let Some(db) = &g.d_bias {
        d_bias.copy_from_slice(db);
    }
    Ok(g.d_scale.to_f64())
}

/// The forward of `plan` with extras on CUDA tensors at `[q, k, v, out, bias, weights]`
/// (bias 0 without one, weights 0 when not wanted), ordered with `stream`.
pub(crate) fn gpu_forward<T: DType>(
    d: &OnDevice,
    plan: &AttentionPlan,
    args: ExtrasArgs,
    [q, k, v, out, bias, weights]: [u64; 6],
    stream: u64,
) -> spattn::Result<()> {
    let gpu = &d.device.gpu;
    let (sq, skv) = (plan.shape_q(), plan.shape_kv());
    let edges = plan.nnz() * sq.heads;
    let bias_len = args.bias_len(plan.nnz(), sq.heads)?;
    // SAFETY: as in `graph::gpu_forward`, and: the bias is `bias_len` elements of T (nnz or
    // nnz × heads, what `forward_with` checks against the plan), the weights `nnz × heads`
    // f32 (fresh). The extras' kernels read the bias and write the weights at
    // [e · heads + h] (or [e] shared), e < nnz: within the views.
    unsafe {
        let (q, k, v) = qkv_views::<T>(d, sq, skv, [q, k, v])?;
        let mut out = ExternalMatrix::<T>::new(gpu, "out", out, sq)?;
        let bias = ExternalVec::<T>::new(gpu, "bias", bias, bias_len)?;
        let mut weights = match weights {
            0 => None,
            w => Some(ExternalVec::<f32>::new(gpu, "weights", w, edges)?),
        };
        d.device.bridge.run(stream, || {
            plan.forward_with(
                &q,
                &k,
                &v,
                &args.device(&bias),
                &mut out,
                weights.as_deref_mut(),
            )
        })
    }
}

/// The backward of `plan` with extras on CUDA tensors at `[q, k, v, d_out, bias, dq, dk, dv,
/// d_bias]` (bias and d_bias 0 without a bias), ordered with `stream`; returns ∂L/∂scale.
pub(crate) fn gpu_backward<T: DType>(
    d: &OnDevice,
    plan: &AttentionPlan,
    args: ExtrasArgs,
    [q, k, v, d_out, bias, dq, dk, dv, d_bias]: [u64; 9],
    stream: u64,
) -> spattn::Result<f64> {
    let gpu = &d.device.gpu;
    let (sq, skv) = (plan.shape_q(), plan.shape_kv());
    let bias_len = args.bias_len(plan.nnz(), sq.heads)?;
    // SAFETY: as in `gpu_forward`; the kernels read d_out (n_rows rows) and write dQ (n_rows
    // rows), dK, dV (n_cols rows) and d_bias (the bias's length), all fresh; the lengths are
    // those `backward_with_extras` checks against the plan.
    unsafe {
        let (q, k, v) = qkv_views::<T>(d, sq, skv, [q, k, v])?;
        let d_out = ExternalMatrix::<T>::new(gpu, "d_out", d_out, sq)?;
        let bias = ExternalVec::<T>::new(gpu, "bias", bias, bias_len)?;
        let mut dq = ExternalMatrix::<T>::new(gpu, "dq", dq, sq)?;
        let mut dk = ExternalMatrix::<T>::new(gpu, "dk", dk, skv)?;
        let mut dv = ExternalMatrix::<T>::new(gpu, "dv", dv, skv)?;
        let mut d_bias = ExternalVec::<T>::new(gpu, "d_bias", d_bias, bias_len)?;
        let has_bias = args.bias != BiasKind::None;
        d.device.bridge.run(stream, || {
            let grads = ExtrasGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
                d_bias: has_bias.then_some(&mut *d_bias),
                d_edge_features: None,
            };
            plan.backward_with_extras(&q, &k, &v, &args.device(&bias), &d_out, grads)
                .map(f64::from)
        })
    }
}

/// Q, K and V viewed in place: Q `sq`, K and V `skv` elements of T.
///
/// # Safety
/// [`ExternalMatrix::new`]'s contract for the three addresses (see `graph::gpu_forward`).
pub(crate) unsafe fn qkv_views<T: DType>(
    d: &OnDevice,
    sq: Shape,
    skv: Shape,
    [q, k, v]: [u64; 3],
) -> spattn::Result<(ExternalMatrix<T>, ExternalMatrix<T>, ExternalMatrix<T>)> {
    let gpu = &d.device.gpu;
    // SAFETY: the caller's contract, for exactly these shapes.
    unsafe {
        Ok((
            ExternalMatrix::new(gpu, "q", q, sq)?,
            ExternalMatrix::new(gpu, "k", k, skv)?,
            ExternalMatrix::new(gpu, "v", v, skv)?,
        ))
    }
}
