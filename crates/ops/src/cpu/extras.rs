//! Attention as graph transformers and GAT use it, on the CPU: a per-edge score bias, edge
//! features added to keys and values, dropout on the probabilities, and the attention weights
//! out, with the exact backward of all of them. The reference of the GPU kernels that take the
//! same extras.
//!
//! Per row `i`, head `h`, edge `e = (i, j)` (CSR order), with `k'_e = k_j + f_e` and
//! `v'_e = v_j + f_e` where edge features `f` are given (else `k_j`, `v_j`):
//!
//! ```text
//! s_e = scale · ⟨q_i, k'_e⟩ + b_e            (b: the bias, per head or shared by the heads)
//! p_e = exp(s_e − max_row s) / Σ_row exp(s − max_row s)
//! w_e = p_e · m_e / (1 − rate)                (m_e ∈ {0, 1}: the dropout mask, else w = p)
//! out_i = Σ_row w_e · v'_e                    (the attention weights out are w)
//! ```
//!
//! and the backward, given `dOut`:
//!
//! ```text
//! dP_e = ⟨dOut_i, v'_e⟩ · m_e / (1 − rate);   dS_e = p_e · (dP_e − Σ_row p · dP)
//! dQ_i = scale · Σ_row dS_e · k'_e;   dK_j = scale · Σ_col dS_e · q_i;   dV_j = Σ_col w_e · dOut_i
//! dF_e = scale · dS_e · q_i + w_e · dOut_i;   db_e = dS_e (Σ over heads for a shared bias)
//! dscale = Σ_e dS_e · ⟨q_i, k'_e⟩
//! ```
//!
//! A bias may be −∞ (the edge is masked, as if absent; a row whose every edge is −∞ outputs
//! zeros) but not NaN: a NaN bias is an error naming the edge, never a silent NaN row.

use rayon::prelude::*;
use spattn_formats::Csr;

use super::attention::AttentionInputs;
use super::check;
use super::error_metric::upcast_f64;
use super::real::Real;
use crate::dropout::Dropout;
use crate::error::{Error, Result};

/// A per-edge additive score bias, in the CSR order of the mask.
#[derive(Clone, Copy, Debug)]
pub enum EdgeBias<'a, F> {
    /// `nnz × heads`: edge `e`, head `h` at `e · heads + h`.
    PerHead(&'a [F]),
    /// `nnz`: one value per edge, shared by every head.
    Shared(&'a [F]),
}

impl<F: Copy> EdgeBias<'_, F> {
    fn at(&self, e: usize, h: usize, heads: usize) -> F {
        match self {
            EdgeBias::PerHead(b) => b[e * heads + h],
            EdgeBias::Shared(b) => b[e],
        }
    }
}

/// What attention takes beyond Q, K, V and the scale (all optional).
#[derive(Clone, Copy, Debug)]
pub struct Extras<'a, F> {
    /// Added to each edge's score.
    pub bias: Option<EdgeBias<'a, F>>,
    /// `nnz × heads × head_dim` (CSR order), added to each edge's key and value.
    pub edge_features: Option<&'a [F]>,
    /// Dropout on the probabilities.
    pub dropout: Option<Dropout>,
}

impl<F> Default for Extras<'_, F> {
    fn default() -> Self {
        Self {
            bias: None,
            edge_features: None,
            dropout: None,
        }
    }
}

/// The gradients of [`attention_extras_backward`].
#[derive(Clone, Debug, PartialEq)]
pub struct ExtrasGrads<F> {
    /// ∂L/∂Q.
    pub dq: Vec<F>,
    /// ∂L/∂K.
    pub dk: Vec<F>,
    /// ∂L/∂V.
    pub dv: Vec<F>,
    /// ∂L/∂bias, shaped like the bias, where one was given.
    pub d_bias: Option<Vec<F>>,
    /// ∂L/∂edge features, where they were given.
    pub d_edge_features: Option<Vec<F>>,
    /// ∂L/∂scale.
    pub d_scale: F,
}

/// Checks the extras against the mask and shapes; returns (heads, head_dim).
fn validate<F: Real>(
    a: &Csr,
    inputs: &AttentionInputs<'_, F>,
    extras: &Extras<'_, F>,
) -> Result<(usize, usize)> {
    let dims = inputs.validate(a, None)?;
    let (heads, head_dim) = (dims.heads, dims.head_dim);
    let nnz = a.nnz();
    if let Some(bias) = &extras.bias {
        let (what, expected, values) = match bias {
            EdgeBias::PerHead(b) => (
                "bias (nnz × heads)",
                check::per_head_len("bias", nnz, heads)?,
                *b,
            ),
            EdgeBias::Shared(b) => ("bias (nnz)", nnz, *b),
        };
        check::len(what, expected, values.len())?;
        if let Some(i) = values.iter().position(|x| x.to_f64().is_nan()) {
            return Err(Error::InvalidArgument {
                what: "bias",
                why: format!(
                    "NaN at element {i} (edge {}); use -inf to mask an edge",
                    match bias {
                        EdgeBias::PerHead(_) => i / heads,
                        EdgeBias::Shared(_) => i,
                    }
                ),
            });
        }
    }
    if let Some(f) = extras.edge_features {
        if inputs.shape_v.head_dim != head_dim {
            return Err(Error::InvalidArgument {
                what: "edge features",
                why: format!(
                    "are added to keys and values, which need one head_dim; K has {head_dim}, V {}",
                    inputs.shape_v.head_dim
                ),
            });
        }
        let per_edge = check::per_head_len("edge features", heads, head_dim)?;
        check::len(
            "edge features (nnz × heads × head_dim)",
            check::per_head_len("edge features", nnz, per_edge)?,
            f.len(),
        )?;
    }
    Ok((heads, head_dim))
}

/// One row's forward state: per edge and head the score's dot product, p and w.
struct RowState<F> {
    /// `⟨q_i, k'_e⟩` (without scale or bias), edge-major.
    dots: Vec<F>,
    /// Probabilities.
    p: Vec<F>,
    /// Probabilities after dropout (the attention weights).
    w: Vec<F>,
}

/// `k'_e` or `v'_e`, feature `d` of head `h`: the node's row plus the edge's features.
fn plus_edge<F: Real>(
    node: &[F],
    node_row: usize,
    f: Option<&[F]>,
    e: usize,
    row_len: usize,
    x: usize,
) -> F {
    let base = node[node_row * row_len + x];
    match f {
        Some(f) => base + f[e * row_len + x],
        None => base,
    }
}

/// Row `i`'s scores, probabilities and weights.
fn row_state<F: Real>(
    a: &Csr,
    inputs: &AttentionInputs<'_, F>,
    scale: F,
    extras: &Extras<'_, F>,
    (heads, head_dim): (usize, usize),
    i: usize,
) -> RowState<F> {
    let range = a.row_range(i);
    let deg = range.len();
    let row_len = heads * head_dim;
    let mut dots = vec![F::ZERO; deg * heads];
    let mut p = vec![F::ZERO; deg * heads];
    let mut w = vec![F::ZERO; deg * heads];
    for h in 0..heads {
        let q = &inputs.q[i * row_len + h * head_dim..i * row_len + (h + 1) * head_dim];
        let mut max = F::NEG_INFINITY;
        for (t, e) in range.clone().enumerate() {
            let j = a.col_indices()[e] as usize;
            let mut dot = F::ZERO;
            for (d, &qd) in q.iter().enumerate() {
                let x = h * head_dim + d;
                dot = dot + qd * plus_edge(inputs.k, j, extras.edge_features, e, row_len, x);
            }
            dots[t * heads + h] = dot;
            let bias = extras.bias.map_or(F::ZERO, |b| b.at(e, h, heads));
            let s = scale * dot + bias;
            p[t * heads + h] = s;
            if s > max {
                max = s;
            }
        }
        // Every score −∞ (or no edge): subtracting 0 leaves the probabilities 0, and a NaN
        // score makes the row NaN, as on the GPU.
        let base = if max == F::NEG_INFINITY { F::ZERO } else { max };
        let mut sum = F::ZERO;
        for t in 0..deg {
            let x = (p[t * heads + h] - base).exp();
            p[t * heads + h] = x;
            sum = sum + x;
        }
        for (t, e) in range.clone().enumerate() {
            let prob = if sum == F::ZERO {
                F::ZERO
            } else {
                p[t * heads + h] / sum
            };
            p[t * heads + h] = prob;
            let factor = extras
                .dropout
                .map_or(1.0, |d| d.factor(e as u64, h as u64, heads as u64));
            w[t * heads + h] = prob * F::from_f64(factor);
        }
    }
    RowState { dots, p, w }
}

/// `values` (per edge and head, `edge · heads + head` in CSR order) times `dropout`'s factors:
/// 0 where dropped, `1 / (1 − rate)` where kept (the mask every kernel draws).
pub fn apply_dropout<F: Real>(values: &mut [F], dropout: &Dropout, heads: usize) {
    let heads = heads.max(1);
    values.par_iter_mut().enumerate().for_each(|(i, x)| {
        let (e, h) = (i / heads, i % heads);
        *x = *x * F::from_f64(dropout.factor(e as u64, h as u64, heads as u64));
    });
}

/// Attention with `extras` (see the module documentation) into `out`
/// (`a.n_rows() × heads × head_dim_v`), and the attention weights `w` (`nnz × heads`, CSR order)
/// into `weights` where given.
///
/// # Errors
/// As [`attention`](super::attention); [`Error::LengthMismatch`] for a bias, edge features or
/// weights buffer of the wrong length (naming it and its expected layout);
/// [`Error::InvalidArgument`] for a NaN bias (naming the edge) or edge features with a V of
/// another head_dim than K.
pub fn attention_extras<F: Real>(
    a: &Csr,
    inputs: &AttentionInputs<'_, F>,
    scale: F,
    extras: &Extras<'_, F>,
    out: &mut [F],
    weights: Option<&mut [F]>,
) -> Result<()> {
    let (heads, head_dim) = validate(a, inputs, extras)?;
    check::finite("scale", scale.to_f64())?;
    let out_shape = inputs.out_shape();
    check::len("out", out_shape.len(), out.len())?;
    if let Some(w) = &weights {
        check::len("weights (nnz × heads)", a.nnz() * heads, w.len())?;
    }
    let (dv, out_row) = (out_shape.head_dim, heads * out_shape.head_dim);
    let states: Vec<RowState<F>> = (0..a.n_rows())
        .into_par_iter()
        .map(|i| row_state(a, inputs, scale, extras, (heads, head_dim), i))
        .collect();
    out.par_chunks_mut(out_row.max(1))
        .enumerate()
        .for_each(|(i, row)| {
            row.fill(F::ZERO);
            for (t, e) in a.row_range(i).enumerate() {
                let j = a.col_indices()[e] as usize;
                for h in 0..heads {
                    let w = states[i].w[t * heads + h];
                    for d in 0..dv {
                        let x = h * dv + d;
                        row[x] = row[x]
                            + w * plus_edge(inputs.v, j, extras.edge_features, e, out_row, x);
                    }
                }
            }
        });
    if let Some(weights) = weights {
        for (i, s) in states.iter().enumerate() {
            let first = a.row_range(i).start * heads;
            weights[first..first + s.w.len()].copy_from_slice(&s.w);
        }
    }
    Ok(())
}

/// The exact gradients of [`attention_extras`] given `d_out` (shaped like the output).
///
/// # Errors
/// As [`attention_extras`]; [`Error::LengthMismatch`] for `"d_out"`.
pub fn attention_extras_backward<F: Real>(
    a: &Csr,
    inputs: &AttentionInputs<'_, F>,
    scale: F,
    extras: &Extras<'_, F>,
    d_out: &[F],
) -> Result<ExtrasGrads<F>> {
    let (heads, head_dim) = validate(a, inputs, extras)?;
    check::finite("scale", scale.to_f64())?;
    let out_shape = inputs.out_shape();
    check::len("d_out", out_shape.len(), d_out.len())?;
    let (dv_dim, row_len) = (out_shape.head_dim, heads * out_shape.head_dim);
    let k_row = heads * head_dim;
    let ef = extras.edge_features;
    // Per row: dS and w per edge and head, dQ_i, and dF for its edges.
    struct RowGrad<F> {
        ds: Vec<F>,
        w: Vec<F>,
        dq: Vec<F>,
        d_edge: Vec<F>,
        d_scale: f64,
    }
    let rows: Vec<RowGrad<F>> = (0..a.n_rows())
        .into_par_iter()
        .map(|i| {
            let st = row_state(a, inputs, scale, extras, (heads, head_dim), i);
            let range = a.row_range(i);
            let deg = range.len();
            let mut ds = vec![F::ZERO; deg * heads];
            let mut dq = vec![F::ZERO; k_row];
            let mut d_edge = vec![F::ZERO; if ef.is_some() { deg * k_row } else { 0 }];
            let mut d_scale = 0.0;
            for h in 0..heads {
                let g = &d_out[i * row_len + h * dv_dim..i * row_len + (h + 1) * dv_dim];
                let mut dp = vec![F::ZERO; deg];
                for (t, e) in range.clone().enumerate() {
                    let j = a.col_indices()[e] as usize;
                    let mut dot = F::ZERO;
                    for (d, &gd) in g.iter().enumerate() {
                        dot = dot + gd * plus_edge(inputs.v, j, ef, e, row_len, h * dv_dim + d);
                    }
                    let factor = extras
                        .dropout
                        .map_or(1.0, |dr| dr.factor(e as u64, h as u64, heads as u64));
                    dp[t] = dot * F::from_f64(factor);
                }
                let sum = dp
                    .iter()
                    .enumerate()
                    .fold(F::ZERO, |acc, (t, &x)| acc + st.p[t * heads + h] * x);
                let q = &inputs.q[i * k_row + h * head_dim..i * k_row + (h + 1) * head_dim];
                for (t, e) in range.clone().enumerate() {
                    let j = a.col_indices()[e] as usize;
                    let s = st.p[t * heads + h] * (dp[t] - sum);
                    ds[t * heads + h] = s;
                    d_scale += (s * st.dots[t * heads + h]).to_f64();
                    for d in 0..head_dim {
                        let x = h * head_dim + d;
                        dq[x] = dq[x] + scale * s * plus_edge(inputs.k, j, ef, e, k_row, x);
                    }
                    if ef.is_some() {
                        let w = st.w[t * heads + h];
                        for d in 0..head_dim {
                            let x = h * head_dim + d;
                            d_edge[t * k_row + x] = scale * s * q[d] + w * g[d];
                        }
                    }
                }
            }
            RowGrad {
                ds,
                w: st.w,
                dq,
                d_edge,
                d_scale,
            }
        })
        .collect();
    // dK and dV scatter to columns: walk Aᵀ, one column a task.
    let (at, from_a) = a.transpose_with_map();
    // Per edge: its row and its position in the row (where the row's state holds it).
    let mut edge_row = vec![(0usize, 0usize); a.nnz()];
    for i in 0..rows.len() {
        for (t, e) in a.row_range(i).enumerate() {
            edge_row[e] = (i, t);
        }
    }
    let mut dk = vec![F::ZERO; inputs.shape_k.len()];
    let mut dv = vec![F::ZERO; inputs.shape_v.len()];
    dk.par_chunks_mut(k_row.max(1))
        .zip(dv.par_chunks_mut(row_len.max(1)))
        .enumerate()
        .for_each(|(j, (dk_j, dv_j))| {
            for t in at.row_range(j) {
                let e = from_a[t] as usize;
                let (i, pos) = edge_row[e];
                for h in 0..heads {
                    let s = rows[i].ds[pos * heads + h];
                    let w = rows[i].w[pos * heads + h];
                    for d in 0..head_dim {
                        let x = h * head_dim + d;
                        dk_j[x] = dk_j[x] + scale * s * inputs.q[i * k_row + x];
                    }
                    for d in 0..dv_dim {
                        let x = h * dv_dim + d;
                        dv_j[x] = dv_j[x] + w * d_out[i * row_len + x];
                    }
                }
            }
        });
    let dq: Vec<F> = rows.iter().flat_map(|r| r.dq.iter().copied()).collect();
    let d_bias = extras.bias.map(|b| {
        let per_head: Vec<F> = rows.iter().flat_map(|r| r.ds.iter().copied()).collect();
        match b {
            EdgeBias::PerHead(_) => per_head,
            EdgeBias::Shared(_) => per_head
                .chunks(heads)
                .map(|c| c.iter().fold(F::ZERO, |s, &x| s + x))
                .collect(),
        }
    });
    let d_edge_features = ef.map(|_| rows.iter().flat_map(|r| r.d_edge.iter().copied()).collect());
    let d_scale = F::from_f64(rows.iter().map(|r| r.d_scale).sum());
    Ok(ExtrasGrads {
        dq,
        dk,
        dv,
        d_bias,
        d_edge_features,
        d_scale,
    })
}

/// The f64 reference of a GPU run with extras: everything upcast to f64, [`attention_extras`]
/// in f64; returns the output and the attention weights.
///
/// # Errors
/// As [`attention_extras`].
pub fn attention_extras_f64_from<T>(
    a: &Csr,
    inputs: &AttentionInputs<'_, T>,
    scale: f64,
    extras: &Extras<'_, T>,
) -> Result<(Vec<f64>, Vec<f64>)>
where
    T: Copy + Into<f64> + Sync,
{
    let (q, k, v) = (
        upcast_f64(inputs.q),
        upcast_f64(inputs.k),
        upcast_f64(inputs.v),
    );
    let up = AttentionInputs::new(&q, inputs.shape_q, &k, inputs.shape_k, &v, inputs.shape_v);
    let owned = UpcastExtras::new(extras);
    let ex = owned.view();
    let heads = inputs.shape_q.heads;
    let mut out = vec![0.0; up.out_shape().len()];
    let mut w = vec![0.0; a.nnz() * heads];
    attention_extras(a, &up, scale, &ex, &mut out, Some(&mut w))?;
    Ok((out, w))
}

/// The f64 reference gradients of a GPU backward with extras (see
/// [`attention_extras_f64_from`]).
///
/// # Errors
/// As [`attention_extras_backward`].
pub fn attention_extras_backward_f64_from<T>(
    a: &Csr,
    inputs: &AttentionInputs<'_, T>,
    scale: f64,
    extras: &Extras<'_, T>,
    d_out: &[T],
) -> Result<ExtrasGrads<f64>>
where
    T: Copy + Into<f64> + Sync,
{
    let (q, k, v, d) = (
        upcast_f64(inputs.q),
        upcast_f64(inputs.k),
        upcast_f64(inputs.v),
        upcast_f64(d_out),
    );
    let up = AttentionInputs::new(&q, inputs.shape_q, &k, inputs.shape_k, &v, inputs.shape_v);
    let owned = UpcastExtras::new(extras);
    let ex = owned.view();
    attention_extras_backward(a, &up, scale, &ex, &d)
}

/// `extras` upcast to f64 and owned, so the f64 references can borrow it as an [`Extras`].
struct UpcastExtras {
    /// The bias, and whether it is per head.
    bias: Option<(bool, Vec<f64>)>,
    edge_features: Option<Vec<f64>>,
    dropout: Option<Dropout>,
}

impl UpcastExtras {
    fn new<T: Copy + Into<f64> + Sync>(extras: &Extras<'_, T>) -> Self {
        Self {
            bias: extras.bias.map(|b| match b {
                EdgeBias::PerHead(x) => (true, upcast_f64(x)),
                EdgeBias::Shared(x) => (false, upcast_f64(x)),
            }),
            edge_features: extras.edge_features.map(upcast_f64),
            dropout: extras.dropout,
        }
    }

    fn view(&self) -> Extras<'_, f64> {
        Extras {
            bias: self.bias.as_ref().map(|(per_head, b)| {
                if *per_head {
                    EdgeBias::PerHead(b.as_slice())
                } else {
                    EdgeBias::Shared(b.as_slice())
                }
            }),
            edge_features: self.edge_features.as_deref(),
            dropout: self.dropout,
        }
    }
}
