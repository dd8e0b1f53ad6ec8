//! GATConv (Veličković et al.; PyG's `GATConv`): `Wh = X·W`, per-node scores
//! `e_src[j, h] = ⟨Wh[j, h], a_src[h]⟩` and `e_dst[i, h] = ⟨Wh[i, h], a_dst[h]⟩`, edge scores
//! `LeakyReLU(e_dst[i] + e_src[j] (+ ⟨W_e·f_ij, a_edge⟩ with edge features), 0.2)` (a
//! `u_add_v` SDDMM), edge softmax over each row,
//! `out[i, h] = Σ_j P[e, h] · Wh[j, h]` (SpMM), heads concatenated or averaged, optional bias.
//!
//! Backward, per head (`dAgg` the gradient of the aggregation):
//!
//! ```text
//! dP    = SDDMM(dAgg, Wh)                      dS = softmax_backward(P, dP) ⊙ LeakyReLU'(S)
//! de_dst = rowsum_A(dS)   de_src = rowsum_Aᵀ(dSᵀ)
//! dWh   = Pᵀ · dAgg (SpMM on Aᵀ) + de_src ⊗ a_src + de_dst ⊗ a_dst
//! da_src = Σ_j de_src[j] Wh[j]    da_dst = Σ_i de_dst[i] Wh[i]
//! dW    = Xᵀ · dWh                 dX = dWh · Wᵀ
//! dE    = dS ⊗ a_edge   da_edge = Σ_e dS[e] E[e]   dW_e = Fᵀ · dE   (E = F·W_e, edge features)
//! ```
//!
//! The host layer keeps the scores and probabilities for its backward. The device layer keeps
//! only the score terms and runs the attention through `spattn_ops::backward::{gat_forward,
//! gat_backward}` (the Python package's GAT goes through the same two functions) on the kernels
//! `GatKernels::auto` picks: for four heads or more, or up to 2¹⁷ edges, the row-statistics
//! kernels (no per-edge buffer of probabilities; the forward's `lse`, output and dropout mask
//! kept for the backward; their units walked in the graph's `DeviceGraph::unit_walk` for
//! `Reorder::Auto`), else the composed CSR ops.

use spattn_ops::backward::{
    self as gpu_backward, dropout_mask_words, GatBackward, GatForward, GatGrads, GatKernels,
    GatScoreTerms, KeepBits, RowStats,
};
use spattn_ops::cpu::{self, Real};
use spattn_ops::elementwise;
use spattn_ops::Dropout;
use spattn_ops::{edge_extras, DType, DeviceMatrix, DeviceVec, Shape};
use spattn_ops::{Dims, GemmElement};

use super::params::{
    flat, host, init_rng, Device, DropoutState, GpuGraph, Host, HostGraph, HostParam, Linear,
    Placement,
};
use crate::error::{Error, Result};
use crate::Reorder;

/// The shape of a [`GatConv`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GatConfig {
    /// Input features per node.
    pub in_dim: usize,
    /// Output features per node and head.
    pub out_dim: usize,
    /// Number of heads.
    pub heads: usize,
    /// Concatenate the heads (`heads · out_dim` outputs) or average them (`out_dim`).
    pub concat: bool,
    /// Add a learnable bias to the output.
    pub bias: bool,
    /// LeakyReLU's negative slope (0.2).
    pub negative_slope: f32,
    /// Dropout on the attention coefficients in training (the GAT paper uses 0.6; PyG's
    /// `GATConv(dropout=…)`), in `[0, 1)`; 0 by default.
    pub dropout: f32,
    /// Edge features per edge, where the layer takes them (PyG's `GATConv(edge_dim=…)`): each
    /// edge's score gets `⟨W_e·f_e, a_edge⟩` per head.
    pub edge_dim: Option<usize>,
}

impl GatConfig {
    /// `in_dim → heads × out_dim`, heads concatenated, with bias, slope 0.2 (PyG's defaults).
    pub fn new(in_dim: usize, out_dim: usize, heads: usize) -> Self {
        Self {
            in_dim,
            out_dim,
            heads,
            concat: true,
            bias: true,
            negative_slope: 0.2,
            dropout: 0.0,
            edge_dim: None,
        }
    }
    /// Concatenate (true) or average (false) the heads.
    pub fn with_concat(mut self, concat: bool) -> Self {
        self.concat = concat;
        self
    }
    /// With or without the output bias.
    pub fn with_bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }
    /// Dropout on the attention coefficients in training (see [`GatConfig::dropout`]).
    pub fn with_dropout(mut self, rate: f32) -> Self {
        self.dropout = rate;
        self
    }
    /// With edge features of `edge_dim` values per edge (see [`GatConfig::edge_dim`]).
    pub fn with_edge_dim(mut self, edge_dim: usize) -> Self {
        self.edge_dim = Some(edge_dim);
        self
    }
    /// Features per node of the output.
    pub fn output_dim(&self) -> usize {
        if self.concat {
            self.heads * self.out_dim
        } else {
            self.out_dim
        }
    }
    fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("in_dim", self.in_dim),
            ("out_dim", self.out_dim),
            ("heads", self.heads),
            ("edge_dim", self.edge_dim.unwrap_or(1)),
        ] {
            if v == 0 {
                return Err(Error::InvalidConfig {
                    what,
                    why: "must be at least 1".into(),
                });
            }
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::InvalidConfig {
                what: "dropout",
                why: format!("{} is not in [0, 1)", self.dropout),
            });
        }
        if !self.negative_slope.is_finite() {
            return Err(Error::InvalidConfig {
                what: "negative_slope",
                why: format!("{} is not finite", self.negative_slope),
            });
        }
        Ok(())
    }
}

/// A GAT layer on backend `B` ([`Host`] or [`Device`]), bound to one graph.
pub struct GatConv<B: Placement> {
    config: GatConfig,
    /// `W` (`in_dim × heads·out_dim`, no bias).
    pub lin: Linear<B>,
    /// `a_src`, `heads × out_dim`.
    pub att_src: B::Param,
    /// `a_dst`, `heads × out_dim`.
    pub att_dst: B::Param,
    /// The output bias (`1 × output_dim`), where configured.
    pub bias: Option<B::Param>,
    /// `W_e` (`edge_dim × heads·out_dim`, no bias) and `a_edge` (`heads × out_dim`), with edge
    /// features.
    pub edge: Option<(Linear<B>, B::Param)>,
    graph: B::Graph,
    /// Training mode (dropout on) or not; and the seed and next offset of the dropout masks.
    dropout_state: DropoutState,
}

/// What [`GatConv`]'s forward keeps for its backward.
pub struct GatCache<B: Placement> {
    x: B::Dense,
    wh: B::Dense,
    /// What the attention's backward reads beyond `x` and `Wh`.
    kept: GatKept<B>,
    /// The dropout the forward applied (its mask regenerated by the backward, but for the rows
    /// kernels' A-order mask, kept in `kept`).
    dropout: Option<Dropout>,
    /// The edge features and their projection `F·W_e`, with edge features.
    edge: Option<(B::Dense, B::Dense)>,
}

/// The attention's share of [`GatCache`]: the host's per-edge scores and probabilities; the
/// device's score terms (its backward recomputes the rest from them, on the kernels
/// [`GatKernels::auto`] picks) and, where the rows kernels ran the forward, their row
/// statistics, output and dropout mask.
enum GatKept<B: Placement> {
    Host {
        scores: B::Edges,
        p: B::Edges,
    },
    Device {
        a_dst: B::Terms,
        a_src: B::Terms,
        /// The edge features' term (`nnz × heads` f32), with edge features.
        bias: Option<B::Edges>,
        /// What the rows kernels' backward takes from their forward.
        rows: Option<RowsKept<B>>,
    },
}

/// What GAT's rows kernels keep from the forward for the backward.
#[derive(Debug)]
struct RowsKept<B: Placement> {
    /// The row statistics (`n × heads` f32, held as an f32 vector).
    lse: B::Edges,
    /// The forward's output (`n × heads × out_dim`).
    out: B::Dense,
    /// With dropout, A's mask as the forward drew it (the backward then draws only Aᵀ's).
    mask: Option<B::Mask>,
}

/// The error of a cache made by the other placement's forward (the types rule it out; no
/// panic all the same).
fn foreign_cache() -> Error {
    Error::InvalidConfig {
        what: "cache",
        why: "was not made by this layer's placement".into(),
    }
}

impl<B: Placement> GatConv<B> {
    /// The configuration.
    pub fn config(&self) -> &GatConfig {
        &self.config
    }
    /// Training mode (dropout on the attention coefficients, a new mask each forward) or
    /// evaluation (no dropout). Layers start in training mode, as torch modules do.
    pub fn set_training(&mut self, training: bool) {
        self.dropout_state.set_training(training);
    }
    /// Sets the seed of the dropout masks and restarts their offsets.
    pub fn set_dropout_seed(&mut self, seed: u64) {
        self.dropout_state.reseed(seed);
    }
    /// Every parameter (W, a_src, a_dst, bias, W_e, a_edge), for an optimizer.
    pub fn params_mut(&mut self) -> Vec<&mut B::Param> {
        let mut p = self.lin.params_mut();
        p.push(&mut self.att_src);
        p.push(&mut self.att_dst);
        p.extend(self.bias.as_mut());
        if let Some((lin, att)) = &mut self.edge {
            p.extend(lin.params_mut());
            p.push(att);
        }
        p
    }

    /// Checks that edge features are given exactly when the layer takes them.
    fn check_edges(&self, given: bool) -> Result<()> {
        match (self.config.edge_dim, given) {
            (Some(_), true) | (None, false) => Ok(()),
            (Some(d), false) => Err(Error::InvalidConfig {
                what: "edge features",
                why: format!("the layer takes {d} per edge: call forward_with_edges"),
            }),
            (None, true) => Err(Error::InvalidConfig {
                what: "edge features",
                why: "given, but the layer has no edge_dim (GatConfig::with_edge_dim)".into(),
            }),
        }
    }
}

impl<F: Real> GatConv<Host<F>> {
    /// A Glorot-initialised layer (bias zero) over `graph`, drawn from `seed`.
    pub fn new(config: GatConfig, graph: &std::sync::Arc<HostGraph>, seed: u64) -> Result<Self> {
        config.validate()?;
        let mut rng = init_rng(seed);
        let (h, c) = (config.heads, config.out_dim);
        let lin = Linear::with_rng(config.in_dim, h * c, false, &mut rng);
        let att = |name, rng: &mut _| HostParam::glorot(name, Dims::new(h, c), (1, c), rng);
        let att_src = att("att_src", &mut rng);
        let att_dst = att("att_dst", &mut rng);
        let edge = config.edge_dim.map(|d| {
            let lin = Linear::with_rng(d, h * c, false, &mut rng);
            (lin, att("att_edge", &mut rng))
        });
        Ok(Self {
            lin,
            att_src,
            att_dst,
            edge,
            bias: config.bias.then(|| {
                HostParam::from_values(
                    "bias",
                    Dims::new(1, config.output_dim()),
                    vec![F::ZERO; config.output_dim()],
                )
            }),
            config,
            graph: graph.clone(),
            dropout_state: DropoutState::new(seed),
        })
    }

    /// The forward pass on `x` (`n × in_dim`, row-major): the output (`n × output_dim`) and
    /// the cache of the backward. In training mode with a dropout rate, a new dropout mask.
    pub fn forward(&self, x: &[F]) -> Result<(Vec<F>, GatCache<Host<F>>)> {
        let dropout = self.dropout_state.next(self.config.dropout)?;
        self.forward_with_dropout(x, dropout)
    }

    /// [`forward`](Self::forward) with edge features `edge_attr` (`nnz × edge_dim`, the
    /// graph's CSR order), for a layer made [`GatConfig::with_edge_dim`].
    pub fn forward_with_edges(
        &self,
        x: &[F],
        edge_attr: &[F],
    ) -> Result<(Vec<F>, GatCache<Host<F>>)> {
        let dropout = self.dropout_state.next(self.config.dropout)?;
        self.forward_inner(x, Some(edge_attr), dropout)
    }

    /// [`forward`](Self::forward) with the dropout given (`None`: none), whatever the mode.
    pub fn forward_with_dropout(
        &self,
        x: &[F],
        dropout: Option<Dropout>,
    ) -> Result<(Vec<F>, GatCache<Host<F>>)> {
        self.forward_inner(x, None, dropout)
    }

    fn forward_inner(
        &self,
        x: &[F],
        edge_attr: Option<&[F]>,
        dropout: Option<Dropout>,
    ) -> Result<(Vec<F>, GatCache<Host<F>>)> {
        self.check_edges(edge_attr.is_some())?;
        let g = &self.graph;
        let (n, h, c) = (g.n(), self.config.heads, self.config.out_dim);
        let shape_x = flat(n, self.config.in_dim)?;
        if x.len() != shape_x.len() {
            return Err(Error::LengthMismatch {
                what: "x",
                expected: shape_x.len(),
                actual: x.len(),
                shape: shape_x,
            });
        }
        let wh = self.lin.forward(x, n)?;
        let e_src = host::head_dot(&wh, &self.att_src.value, h, c);
        let e_dst = host::head_dot(&wh, &self.att_dst.value, h, c);
        let mut edge = None;
        let bias = match (&self.edge, edge_attr) {
            (Some((lin, att)), Some(f)) => {
                let nnz = g.a.nnz();
                let shape_f = flat(nnz, lin.in_dim)?;
                if f.len() != shape_f.len() {
                    return Err(Error::LengthMismatch {
                        what: "edge features (nnz × edge_dim)",
                        expected: shape_f.len(),
                        actual: f.len(),
                        shape: shape_f,
                    });
                }
                let e = lin.forward(f, nnz)?;
                let bias = host::head_dot(&e, &att.value, h, c);
                edge = Some((f.to_vec(), e));
                Some(bias)
            }
            _ => None,
        };
        let slope = F::from_f32(self.config.negative_slope);
        let shape = Shape::new(n, h, c)?;
        let mut agg = vec![F::ZERO; shape.len()];
        let (scores, p) = cpu::gat_attention(
            &g.a,
            h,
            slope,
            (&e_dst, &e_src, bias.as_deref()),
            dropout.as_ref(),
            &wh,
            shape,
            &mut agg,
        )?;
        let mut y = if self.config.concat {
            agg
        } else {
            let inv = F::from_f64(1.0 / h as f64);
            let mut y = vec![F::ZERO; n * c];
            for (yr, ar) in y.chunks_mut(c).zip(agg.chunks(h * c)) {
                for hr in ar.chunks(c) {
                    host::axpy(inv, hr, yr);
                }
            }
            y
        };
        if let Some(b) = &self.bias {
            for row in y.chunks_mut(b.value.len()) {
                host::axpy(F::ONE, &b.value, row);
            }
        }
        let cache = GatCache {
            x: x.to_vec(),
            wh,
            kept: GatKept::Host { scores, p },
            dropout,
            edge,
        };
        Ok((y, cache))
    }

    /// The backward pass: accumulates every parameter's gradient and returns `dx`.
    pub fn backward(&mut self, cache: &GatCache<Host<F>>, dy: &[F]) -> Result<Vec<F>> {
        Ok(self.backward_with_edges(cache, dy)?.0)
    }

    /// [`backward`](Self::backward), and the edge features' gradient (`nnz × edge_dim`, for
    /// edge features computed upstream) where the forward had them.
    pub fn backward_with_edges(
        &mut self,
        cache: &GatCache<Host<F>>,
        dy: &[F],
    ) -> Result<(Vec<F>, Option<Vec<F>>)> {
        let g = self.graph.clone();
        let (n, h, c) = (g.n(), self.config.heads, self.config.out_dim);
        let out = flat(n, self.config.output_dim())?;
        if dy.len() != out.len() {
            return Err(Error::LengthMismatch {
                what: "dy",
                expected: out.len(),
                actual: dy.len(),
                shape: out,
            });
        }
        if let Some(b) = &mut self.bias {
            for row in dy.chunks(b.grad.len()) {
                host::axpy(F::ONE, row, &mut b.grad);
            }
        }
        let shape = Shape::new(n, h, c)?;
        let d_agg = if self.config.concat {
            dy.to_vec()
        } else {
            let inv = F::from_f64(1.0 / h as f64);
            let mut d = vec![F::ZERO; shape.len()];
            for (dr, yr) in d.chunks_mut(h * c).zip(dy.chunks(c)) {
                for hr in dr.chunks_mut(c) {
                    host::axpy(inv, yr, hr);
                }
            }
            d
        };
        let slope = F::from_f32(self.config.negative_slope);
        let GatKept::Host { scores, p } = &cache.kept else {
            return Err(foreign_cache());
        };
        let mut dwh = vec![F::ZERO; shape.len()];
        let (mut de_dst, mut de_src) = (vec![F::ZERO; n * h], vec![F::ZERO; n * h]);
        let ds = cpu::gat_attention_backward(
            &g.a,
            (&g.at, &g.map),
            h,
            slope,
            cache.dropout.as_ref(),
            (scores, p),
            (&d_agg, &cache.wh, shape),
            (&mut dwh, &mut de_dst, &mut de_src),
        )?;
        let mut d_edges = None;
        if let (Some((lin, att)), Some((f, e))) = (&mut self.edge, &cache.edge) {
            let mut de = vec![F::ZERO; e.len()];
            host::head_dot_backward(e, &att.value, &ds, h, c, &mut de, &mut att.grad);
            let mut df = vec![F::ZERO; f.len()];
            lin.backward(f, g.a.nnz(), &de, Some((&mut df, false)))?;
            d_edges = Some(df);
        }
        for (att, de) in [(&mut self.att_src, &de_src), (&mut self.att_dst, &de_dst)] {
            host::head_dot_backward(&cache.wh, &att.value, de, h, c, &mut dwh, &mut att.grad);
        }
        let mut dx = vec![F::ZERO; n * self.config.in_dim];
        self.lin
            .backward(&cache.x, n, &dwh, Some((&mut dx, false)))?;
        Ok((dx, d_edges))
    }

    /// The same layer on the GPU in `T` (parameters rounded to `T`), bound to `graph` (the
    /// upload of this layer's graph).
    pub fn to_device<T: GemmElement>(&self, graph: &GpuGraph) -> Result<GatConv<Device<T>>> {
        let gpu = graph.gpu();
        Ok(GatConv {
            config: self.config,
            lin: self.lin.to_device(gpu)?,
            att_src: self.att_src.to_device(gpu)?,
            att_dst: self.att_dst.to_device(gpu)?,
            bias: self.bias.as_ref().map(|b| b.to_device(gpu)).transpose()?,
            edge: match &self.edge {
                Some((lin, att)) => Some((lin.to_device(gpu)?, att.to_device(gpu)?)),
                None => None,
            },
            graph: graph.clone(),
            dropout_state: self.dropout_state.copy(),
        })
    }
}

impl<T: GemmElement> GatConv<Device<T>> {
    /// The forward pass on `x` (`n` rows of `in_dim` features, any split into heads): the
    /// output (`n × 1 × output_dim`) and the cache of the backward. In training mode with a
    /// dropout rate, a new dropout mask (the same one the host layer draws for that seed and
    /// offset).
    pub fn forward(&self, x: &DeviceMatrix<T>) -> Result<(DeviceMatrix<T>, GatCache<Device<T>>)> {
        let dropout = self.dropout_state.next(self.config.dropout)?;
        self.forward_with_dropout(x, dropout)
    }

    /// [`forward`](Self::forward) with edge features `edge_attr` (`nnz` rows of `edge_dim`,
    /// the graph's CSR order), for a layer made [`GatConfig::with_edge_dim`].
    pub fn forward_with_edges(
        &self,
        x: &DeviceMatrix<T>,
        edge_attr: &DeviceMatrix<T>,
    ) -> Result<(DeviceMatrix<T>, GatCache<Device<T>>)> {
        let dropout = self.dropout_state.next(self.config.dropout)?;
        self.forward_inner(x, Some(edge_attr), dropout)
    }

    /// [`forward`](Self::forward) with the dropout given (`None`: none), whatever the mode.
    pub fn forward_with_dropout(
        &self,
        x: &DeviceMatrix<T>,
        dropout: Option<Dropout>,
    ) -> Result<(DeviceMatrix<T>, GatCache<Device<T>>)> {
        self.forward_inner(x, None, dropout)
    }

    fn forward_inner(
        &self,
        x: &DeviceMatrix<T>,
        edge_attr: Option<&DeviceMatrix<T>>,
        dropout: Option<Dropout>,
    ) -> Result<(DeviceMatrix<T>, GatCache<Device<T>>)> {
        self.check_edges(edge_attr.is_some())?;
        let g = &self.graph;
        let (ctx, gpu) = (g.ctx(), g.gpu());
        let (n, h, c) = (g.n(), self.config.heads, self.config.out_dim);
        check_input("x", x.shape(), n, self.config.in_dim)?;
        let mut wh = self.lin.forward(ctx, x)?;
        let shape = Shape::new(n, h, c)?;
        wh.reshape(shape)?;
        let per_node = Shape::new(n, h, 1)?;
        let mut e_src = DeviceMatrix::<f32>::unset(gpu, per_node)?;
        let mut e_dst = DeviceMatrix::<f32>::unset(gpu, per_node)?;
        // The score terms in f32, as every GAT kernel reads them (the vectors widened first).
        elementwise::head_dot_f32(gpu, &wh, &widened(&self.att_src.value)?, &mut e_src)?;
        elementwise::head_dot_f32(gpu, &wh, &widened(&self.att_dst.value)?, &mut e_dst)?;
        let a = g.a()?;
        let nnz = a.nnz();
        // The edge features' term, a per-head bias of the scores.
        let (edge, bias) = match (&self.edge, edge_attr) {
            (Some((lin, att)), Some(f)) => {
                check_input("edge features", f.shape(), nnz, lin.in_dim)?;
                let mut e = lin.forward(ctx, f)?;
                e.reshape(Shape::new(nnz, h, c)?)?;
                let mut alpha = DeviceMatrix::<f32>::zeros(gpu, Shape::new(nnz, h, 1)?)?;
                elementwise::head_dot_f32(gpu, &e, &widened(&att.value)?, &mut alpha)?;
                (Some((f.try_clone()?, e)), Some(alpha.into_vec()))
            }
            _ => (None, None),
        };
        let terms = GatScoreTerms {
            a_dst: &e_dst,
            a_src: &e_src,
            bias: bias.as_ref(),
            slope: self.config.negative_slope,
            dropout: dropout.as_ref(),
        };
        let mut agg = DeviceMatrix::zeros(gpu, shape)?;
        let lse = if GatKernels::auto::<T>(h, c, nnz, false, true) == GatKernels::Rows {
            let walk = g.device().unit_walk(Reorder::Auto)?;
            let mut lse = DeviceVec::zeros(gpu, per_node.len())?;
            let mut mask = match &dropout {
                Some(_) => Some(DeviceVec::zeros(gpu, dropout_mask_words(nnz, h)?)?),
                None => None,
            };
            let ws = GatForward::Rows {
                lse: &mut lse,
                mask: mask.as_mut(),
                walk: &walk,
            };
            gpu_backward::gat_forward(gpu, a, terms, &wh, ws, &mut agg)?;
            Some((lse, mask))
        } else {
            let mut p = DeviceVec::zeros(gpu, nnz * h)?;
            gpu_backward::gat_forward(gpu, a, terms, &wh, GatForward::Composed(&mut p), &mut agg)?;
            None
        };
        let out_dims = Dims::new(n, self.config.output_dim());
        let (mut y, agg) = if self.config.concat {
            // y is the output itself; the rows kernels' backward reads it too: a copy for it.
            let kept = match lse {
                Some(_) => Some(agg.try_clone()?),
                None => None,
            };
            agg.reshape(flat(n, h * c)?)?;
            (agg, kept)
        } else {
            let mut y = DeviceMatrix::zeros(gpu, flat(n, c)?)?;
            elementwise::head_mean(gpu, &agg, &mut y)?;
            (y, Some(agg))
        };
        let rows = match (lse, agg) {
            (Some((lse, mask)), Some(out)) => Some(RowsKept { lse, out, mask }),
            _ => None,
        };
        if let Some(b) = &self.bias {
            elementwise::bias_add(gpu, &mut y, out_dims, &b.value)?;
        }
        let cache = GatCache {
            x: x.try_clone()?,
            wh,
            kept: GatKept::Device {
                a_dst: e_dst,
                a_src: e_src,
                bias,
                rows,
            },
            dropout,
            edge,
        };
        Ok((y, cache))
    }

    /// The backward pass: accumulates every parameter's gradient (f32) and returns `dx`
    /// (shaped like the forward's `x`).
    pub fn backward(
        &mut self,
        cache: &GatCache<Device<T>>,
        dy: &DeviceMatrix<T>,
    ) -> Result<DeviceMatrix<T>> {
        Ok(self.backward_with_edges(cache, dy)?.0)
    }

    /// [`backward`](Self::backward), and the edge features' gradient (shaped like the
    /// forward's `edge_attr`) where the forward had them.
    pub fn backward_with_edges(
        &mut self,
        cache: &GatCache<Device<T>>,
        dy: &DeviceMatrix<T>,
    ) -> Result<(DeviceMatrix<T>, Option<DeviceMatrix<T>>)> {
        let g = self.graph.clone();
        let (ctx, gpu) = (g.ctx(), g.gpu());
        let (n, h, c) = (g.n(), self.config.heads, self.config.out_dim);
        check_input("dy", dy.shape(), n, self.config.output_dim())?;
        let out_dims = Dims::new(n, self.config.output_dim());
        if let Some(b) = &mut self.bias {
            elementwise::bias_grad(gpu, dy, out_dims, &mut b.grad)?;
        }
        let shape = Shape::new(n, h, c)?;
        let d_agg = if self.config.concat {
            let mut d = dy.try_clone()?;
            d.reshape(shape)?;
            d
        } else {
            let mut d = DeviceMatrix::zeros(gpu, shape)?;
            let mut dy1 = dy.try_clone()?;
            dy1.reshape(flat(n, c)?)?;
            elementwise::head_mean_backward(gpu, &dy1, &mut d)?;
            d
        };
        let (a, t) = (g.a()?, g.t()?);
        let GatKept::Device {
            a_dst,
            a_src,
            bias,
            rows,
        } = &cache.kept
        else {
            return Err(foreign_cache());
        };
        let (nnz, per_node) = (a.nnz(), Shape::new(n, h, 1)?);
        let edges = nnz * h;
        let terms = GatScoreTerms {
            a_dst,
            a_src,
            bias: bias.as_ref(),
            slope: self.config.negative_slope,
            dropout: cache.dropout.as_ref(),
        };
        let mut dwh = DeviceMatrix::zeros(gpu, shape)?;
        // f32: these per-node sums feed the attention vectors' gradients, sums over every node
        // whose terms largely cancel; rounding them to f16/bf16 first costs ~1e-2 relative.
        let mut de_dst = DeviceMatrix::<f32>::zeros(gpu, per_node)?;
        let mut de_src = DeviceMatrix::<f32>::zeros(gpu, per_node)?;
        // dS in A's order where the edge features need it (the bias's gradient).
        let mut ds = match bias {
            Some(_) => Some(DeviceVec::zeros(gpu, edges)?),
            None => None,
        };
        let grads = GatGrads {
            dx: &mut dwh,
            d_dst: &mut de_dst,
            d_src: &mut de_src,
            d_bias: ds.as_mut(),
        };
        let io = (&cache.wh, &d_agg);
        match (GatKernels::auto::<T>(h, c, nnz, true, rows.is_some()), rows) {
            (
                GatKernels::Rows,
                Some(RowsKept {
                    lse,
                    out,
                    mask: kept,
                }),
            ) => {
                let mut ds_t = DeviceVec::zeros(gpu, edges)?;
                let mut mask = match &cache.dropout {
                    Some(_) => Some(DeviceVec::zeros(
                        gpu,
                        KeepBits::draw_words(nnz, h, kept.is_some())?,
                    )?),
                    None => None,
                };
                let walk = g.device().unit_walk(Reorder::Auto)?;
                let ws = GatBackward::Rows {
                    out,
                    lse: RowStats::Kept(lse),
                    ds: &mut ds_t,
                    mask: KeepBits::of(kept.as_ref(), mask.as_mut()),
                    walk: &walk,
                };
                gpu_backward::gat_backward(gpu, (a, t), terms, io, ws, grads)?;
            }
            (GatKernels::Fused, _) => {
                gpu_backward::gat_backward(gpu, (a, t), terms, io, GatBackward::Fused, grads)?;
            }
            _ => {
                let mut w = [
                    DeviceVec::zeros(gpu, edges)?,
                    DeviceVec::zeros(gpu, edges)?,
                    DeviceVec::zeros(gpu, edges)?,
                ];
                let [w0, w1, w2] = &mut w;
                let ws = GatBackward::Composed([w0, w1, w2]);
                gpu_backward::gat_backward(gpu, (a, t), terms, io, ws, grads)?;
            }
        }
        let mut d_edges = None;
        if let (Some((lin, att)), Some((f, e)), Some(ds)) = (&mut self.edge, &cache.edge, ds) {
            let ds_m = DeviceMatrix::from_vec(ds, Shape::new(nnz, h, 1)?)?;
            let mut de = DeviceMatrix::zeros(gpu, e.shape())?;
            elementwise::head_outer_add(gpu, &ds_m, &att.value, &mut de)?;
            elementwise::head_weighted_sum(gpu, e, &ds_m, &mut att.grad)?;
            let mut df = DeviceMatrix::zeros(gpu, f.shape())?;
            lin.backward(ctx, f, &de, Some((&mut df, false)))?;
            d_edges = Some(df);
        }
        for (att, de) in [(&mut self.att_src, &de_src), (&mut self.att_dst, &de_dst)] {
            elementwise::head_outer_add(gpu, de, &att.value, &mut dwh)?;
            elementwise::head_weighted_sum(gpu, &cache.wh, de, &mut att.grad)?;
        }
        let mut dx = DeviceMatrix::zeros(gpu, cache.x.shape())?;
        self.lin
            .backward(ctx, &cache.x, &dwh, Some((&mut dx, false)))?;
        Ok((dx, d_edges))
    }
}

/// `v` in f32 (a layer's attention vector for the kernels that read f32 ones).
fn widened<T: DType>(v: &DeviceVec<T>) -> Result<DeviceVec<f32>> {
    let mut out = DeviceVec::unset(v.gpu(), v.len())?;
    edge_extras::widen(v.gpu(), v, &mut out)?;
    Ok(out)
}

/// Checks that a device input has `rows` rows of `cols` features (any split into heads).
pub(crate) fn check_input(what: &'static str, s: Shape, rows: usize, cols: usize) -> Result<()> {
    if s.rows != rows || s.row_len() != cols {
        return Err(Error::ShapeMismatch {
            what,
            expected: flat(rows, cols)?,
            actual: s,
        });
    }
    Ok(())
}
