//! Attention with a per-edge score bias and dropout on the probabilities (`GraphCore.
//! attention_extras`): the CPU reference and the GPU plans' extras path, with their exact
//! backward; and edge features added to keys and values (PyG's `TransformerConv(edge_dim)`). The layout contract is `graph`'s (module documentation there); the bias is
//! `nnz` (shared by the heads) or `nnz × heads` values of the features' dtype in the graph's
//! CSR edge order, the attention weights `nnz × heads` (f32 on CUDA, the features' dtype on
//! the CPU) in the same order.

use pyo3::prelude::*;
use spattn::ops::cpu::{self, AttentionInputs, EdgeBias, Extras as CpuExtras, Real};
use spattn::ops::{ExternalMatrix, ExternalVec};
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
    /// Whether edge features (`nnz × heads × head_dim`) are added to keys and values.
    pub(crate) edge_features: bool,
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
        Ok(Self {
            bias,
            dropout,
            edge_features: false,
        })
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

    /// The edge features' shape on a graph of `nnz` edges (`None` without them).
    fn features_shape(
        &self,
        nnz: usize,
        heads: usize,
        head_dim: usize,
    ) -> spattn::Result<Option<Shape>> {
        Ok(if self.edge_features {
            Some(Shape::new(nnz, heads, head_dim)?)
        } else {
            None
        })
    }

    fn cpu<'a, F>(&self, bias: &'a [F], features: Option<&'a [F]>) -> CpuExtras<'a, F> {
        CpuExtras {
            bias: match self.bias {
                BiasKind::None => None,
                BiasKind::Shared => Some(EdgeBias::Shared(bias)),
                BiasKind::PerHead => Some(EdgeBias::PerHead(bias)),
            },
            edge_features: features,
            dropout: self.dropout,
        }
    }

    fn device<'a, T: DType>(
        &self,
        bias: &'a spattn::DeviceVec<T>,
        features: Option<&'a spattn::DeviceMatrix<T>>,
    ) -> Extras<'a, T> {
        Extras {
            bias: match self.bias {
                BiasKind::None => None,
                BiasKind::Shared => Some(DeviceBias::Shared(bias)),
                BiasKind::PerHead => Some(DeviceBias::PerHead(bias)),
            },
            edge_features: features,
            dropout: self.dropout,
        }
    }
}

/// The CPU forward with extras at `[q, k, v, out, bias, weights, features]` (bias and
/// features 0 without them, weights 0 when not wanted).
pub(crate) fn cpu_forward<F: Real>(
    csr: &Csr,
    (sq, skv): (Shape, Shape),
    scale: F,
    args: ExtrasArgs,
    [q, k, v, out, bias, weights, features]: [u64; 7],
) -> PyResult<()> {
    let edges = csr.nnz() * sq.heads;
    let bias_len = args.bias_len(csr.nnz(), sq.heads).map_err(to_py)?;
    let fshape = args
        .features_shape(csr.nnz(), sq.heads, sq.head_dim)
        .map_err(to_py)?;
    // SAFETY: the package's contract (graph's module documentation): contiguous host tensors
    // of F with these element counts, alive for the call; `out` and `weights` fresh, so
    // unaliased.
    let (q, k, v, out, bias, weights, features) = unsafe {
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
            match fshape {
                Some(s) => Some(host::slice::<F>("edge_features", features, s.len())?),
                None => None,
            },
        )
    };
    let inputs = AttentionInputs::new(q, sq, k, skv, v, skv);
    let extras = args.cpu(bias, features);
    cpu::attention_extras(csr, &inputs, scale, &extras, out, weights).map_err(ops_to_py)
}

/// The CPU backward with extras at `[q, k, v, d_out, bias, dq, dk, dv, d_bias, features,
/// d_features]` (the bias's and the features' addresses 0 without them); returns ∂L/∂scale.
pub(crate) fn cpu_backward<F: Real>(
    csr: &Csr,
    (sq, skv): (Shape, Shape),
    scale: F,
    args: ExtrasArgs,
    [q, k, v, d_out, bias, dq, dk, dv, d_bias, features, d_features]: [u64; 11],
) -> PyResult<f64> {
    let bias_len = args.bias_len(csr.nnz(), sq.heads).map_err(to_py)?;
    let flen = args
        .features_shape(csr.nnz(), sq.heads, sq.head_dim)
        .map_err(to_py)?
        .map_or(0, |s| s.len());
    // SAFETY: as in `cpu_forward`.
    let (q, k, v, d_out, bias, features) = unsafe {
        (
            host::slice::<F>("q", q, sq.len())?,
            host::slice::<F>("k", k, skv.len())?,
            host::slice::<F>("v", v, skv.len())?,
            host::slice::<F>("d_out", d_out, sq.len())?,
            host::slice::<F>("bias", bias, bias_len)?,
            host::slice::<F>("edge_features", features, flen)?,
        )
    };
    let inputs = AttentionInputs::new(q, sq, k, skv, v, skv);
    let extras = args.cpu(bias, args.edge_features.then_some(features));
    let g =
        cpu::attention_extras_backward(csr, &inputs, scale, &extras, d_out).map_err(ops_to_py)?;
    // SAFETY: as above: fresh outputs of these lengths.
    let (dq, dk, dv, d_bias, d_features) = unsafe {
        (
            host::slice_mut::<F>("dq", dq, sq.len())?,
            host::slice_mut::<F>("dk", dk, skv.len())?,
            host::slice_mut::<F>("dv", dv, skv.len())?,
            host::slice_mut::<F>("d_bias", d_bias, bias_len)?,
            host::slice_mut::<F>("d_edge_features", d_features, flen)?,
        )
    };
    dq.copy_from_slice(&g.dq);
    dk.copy_from_slice(&g.dk);
    dv.copy_from_slice(&g.dv);
    if let Some(db) = &g.d_bias {
        d_bias.copy_from_slice(db);
    }
    if let Some(df) = &g.d_edge_features {
        d_features.copy_from_slice(df);
    }
    Ok(g.d_scale.to_f64())
}

/// The forward of `plan` with extras on CUDA tensors at `[q, k, v, out, bias, weights,
/// features]` (bias and features 0 without them, weights 0 when not wanted), ordered with
/// `stream`.
pub(crate) fn gpu_forward<T: DType>(
    d: &OnDevice,
    plan: &AttentionPlan,
    args: ExtrasArgs,
    [q, k, v, out, bias, weights, features]: [u64; 7],
    stream: u64,
) -> spattn::Result<()> {
    let gpu = &d.device.gpu;
    let (sq, skv) = (plan.shape_q(), plan.shape_kv());
    let edges = plan.nnz() * sq.heads;
    let bias_len = args.bias_len(plan.nnz(), sq.heads)?;
    let fshape = args.features_shape(plan.nnz(), sq.heads, sq.head_dim)?;
    // SAFETY: as in `cuda::gpu_forward`, and: the bias is `bias_len` elements of T (nnz or
    // nnz × heads), the features `nnz × heads × head_dim` of T, the weights `nnz × heads` f32
    // (fresh): what `forward_with` checks against the plan. The extras' kernels read the bias
    // and features and write the weights per edge e < nnz: within the views.
    unsafe {
        let (q, k, v) = qkv_views::<T>(d, sq, skv, [q, k, v])?;
        let mut out = ExternalMatrix::<T>::new_trusted(gpu, "out", out, sq)?;
        let bias = ExternalVec::<T>::new_trusted(gpu, "bias", bias, bias_len)?;
        let features = match fshape {
            Some(s) => Some(ExternalMatrix::<T>::new_trusted(
                gpu,
                "edge_features",
                features,
                s,
            )?),
            None => None,
        };
        let mut weights = match weights {
            0 => None,
            w => Some(ExternalVec::<f32>::new_trusted(gpu, "weights", w, edges)?),
        };
        d.device.bridge.run(stream, || {
            let extras = args.device(&bias, features.as_deref());
            plan.forward_with(&q, &k, &v, &extras, &mut out, weights.as_deref_mut())
        })
    }
}

/// The backward of `plan` with extras on CUDA tensors at `[q, k, v, d_out, bias, dq, dk, dv,
/// d_bias, features, d_features]` (the bias's and the features' addresses 0 without them),
/// ordered with `stream`; returns ∂L/∂scale where `d_scale` (a wait for the GPU), NaN
/// otherwise.
pub(crate) fn gpu_backward<T: DType>(
    d: &OnDevice,
    plan: &AttentionPlan,
    args: ExtrasArgs,
    [q, k, v, d_out, bias, dq, dk, dv, d_bias, features, d_features]: [u64; 11],
    stream: u64,
    d_scale: bool,
) -> spattn::Result<f64> {
    let gpu = &d.device.gpu;
    let (sq, skv) = (plan.shape_q(), plan.shape_kv());
    let bias_len = args.bias_len(plan.nnz(), sq.heads)?;
    let fshape = args.features_shape(plan.nnz(), sq.heads, sq.head_dim)?;
    // SAFETY: as in `gpu_forward`; the kernels read d_out (n_rows rows) and write dQ (n_rows
    // rows), dK, dV (n_cols rows), d_bias (the bias's length) and d_features (nnz × heads ×
    // head_dim), all fresh; the lengths are those `backward_with_extras` checks.
    unsafe {
        let (q, k, v) = qkv_views::<T>(d, sq, skv, [q, k, v])?;
        let d_out = ExternalMatrix::<T>::new_trusted(gpu, "d_out", d_out, sq)?;
        let bias = ExternalVec::<T>::new_trusted(gpu, "bias", bias, bias_len)?;
        let mut dq = ExternalMatrix::<T>::new_trusted(gpu, "dq", dq, sq)?;
        let mut dk = ExternalMatrix::<T>::new_trusted(gpu, "dk", dk, skv)?;
        let mut dv = ExternalMatrix::<T>::new_trusted(gpu, "dv", dv, skv)?;
        let mut d_bias = ExternalVec::<T>::new_trusted(gpu, "d_bias", d_bias, bias_len)?;
        let (features, mut d_features) = match fshape {
            Some(s) => (
                Some(ExternalMatrix::<T>::new_trusted(
                    gpu,
                    "edge_features",
                    features,
                    s,
                )?),
                Some(ExternalMatrix::<T>::new_trusted(
                    gpu,
                    "d_edge_features",
                    d_features,
                    s,
                )?),
            ),
            None => (None, None),
        };
        let has_bias = args.bias != BiasKind::None;
        d.device.bridge.run(stream, || {
            let grads = ExtrasGrads {
                dq: &mut dq,
                dk: &mut dk,
                dv: &mut dv,
                d_bias: has_bias.then_some(&mut *d_bias),
                d_edge_features: d_features.as_deref_mut(),
            };
            let extras = args.device(&bias, features.as_deref());
            if d_scale {
                plan.backward_with_extras(&q, &k, &v, &extras, &d_out, grads)
                    .map(f64::from)
            } else {
                plan.backward_with_extras_grads(&q, &k, &v, &extras, &d_out, grads)
                    .map(|()| f64::NAN)
            }
        })
    }
}

/// Q, K and V viewed in place: Q `sq`, K and V `skv` elements of T.
///
/// # Safety
/// [`ExternalMatrix::new`]'s contract for the three addresses (see `cuda::gpu_forward`).
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
            ExternalMatrix::new_trusted(gpu, "q", q, sq)?,
            ExternalMatrix::new_trusted(gpu, "k", k, skv)?,
            ExternalMatrix::new_trusted(gpu, "v", v, skv)?,
        ))
    }
}
