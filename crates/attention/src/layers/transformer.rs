//! The graph-transformer attention layer (Dwivedi & Bresson; PyG's `TransformerConv` without
//! edge features): `Q = X·W_q + b_q`, `K`, `V` likewise, sparse multi-head attention
//! `softmax(Q Kᵀ / √d + B masked by A) · V` through an [`AttentionPlan`] (with an optional
//! per-edge score bias `B`, e.g. Graphormer's spatial or edge encodings, and attention dropout in
//! training), the output projection `Y = Attn·W_o + b_o`, and an optional residual `Y += X`.
//!
//! Backward: `dAttn = dY·W_oᵀ`, the attention backward of the plan (dQ, dK, dV, and dB where
//! a bias was given), then the three projections' backwards summed into `dX` (plus `dY` with
//! the residual).

use spattn_ops::cpu::{self, AttentionInputs, EdgeBias, Extras as CpuExtras, Real};
use spattn_ops::edge_extras::DeviceBias;
use spattn_ops::elementwise;
use spattn_ops::Dropout;
use spattn_ops::GemmElement;
use spattn_ops::{DeviceMatrix, Shape};

use super::gat::check_input;
use super::params::{
    attention_backward, attention_forward, flat, host, init_rng, Device, DropoutState, GpuGraph,
    Host, HostGraph, Linear, Placement,
};
use crate::config::{Algorithm, AttentionConfig};
use crate::error::{Error, Result};
use crate::{AttentionPlan, Extras, ExtrasGrads};
use spattn_ops::DeviceVec;

/// The shape of a [`GraphTransformerLayer`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TransformerConfig {
    /// Input features per node.
    pub in_dim: usize,
    /// Number of heads.
    pub heads: usize,
    /// Features per head of Q, K, V.
    pub head_dim: usize,
    /// Output features per node.
    pub out_dim: usize,
    /// Add the input to the output (needs `in_dim == out_dim`).
    pub residual: bool,
    /// Biases on the four projections.
    pub bias: bool,
    /// The attention algorithm of the GPU plan ([`Algorithm::Auto`] by default).
    pub algorithm: Algorithm,
    /// Dropout on the attention weights in training, in `[0, 1)`; 0 by default.
    pub dropout: f32,
    /// Whether forwards take a per-edge score bias ([`GraphTransformerLayer::forward_with`]):
    /// the GPU plan is then planned for extras.
    pub edge_bias: bool,
}

impl TransformerConfig {
    /// `in_dim → heads × head_dim → out_dim`, biases on, no residual, automatic algorithm.
    pub fn new(in_dim: usize, heads: usize, head_dim: usize, out_dim: usize) -> Self {
        Self {
            in_dim,
            heads,
            head_dim,
            out_dim,
            residual: false,
            bias: true,
            algorithm: Algorithm::Auto,
            dropout: 0.0,
            edge_bias: false,
        }
    }
    /// With or without the residual connection.
    pub fn with_residual(mut self, residual: bool) -> Self {
        self.residual = residual;
        self
    }
    /// Dropout on the attention weights in training.
    pub fn with_dropout(mut self, rate: f32) -> Self {
        self.dropout = rate;
        self
    }
    /// Forwards take a per-edge score bias.
    pub fn with_edge_bias(mut self, edge_bias: bool) -> Self {
        self.edge_bias = edge_bias;
        self
    }
    /// Whether the attention runs with extras (a bias or dropout).
    fn extras(&self) -> bool {
        self.edge_bias || self.dropout > 0.0
    }
    /// The GPU plan's algorithm.
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }
    /// 1/√head_dim.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
    fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("in_dim", self.in_dim),
            ("heads", self.heads),
            ("head_dim", self.head_dim),
            ("out_dim", self.out_dim),
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
        if self.residual && self.in_dim != self.out_dim {
            return Err(Error::InvalidConfig {
                what: "residual",
                why: format!(
                    "needs in_dim == out_dim; they are {} and {}",
                    self.in_dim, self.out_dim
                ),
            });
        }
        Ok(())
    }
}

/// A graph-transformer attention layer on backend `B`, bound to one graph.
pub struct GraphTransformerLayer<B: Placement> {
    config: TransformerConfig,
    /// Q projection.
    pub query: Linear<B>,
    /// K projection.
    pub key: Linear<B>,
    /// V projection.
    pub value: Linear<B>,
    /// Output projection.
    pub output: Linear<B>,
    graph: B::Graph,
    plan: B::Plan,
    dropout_state: DropoutState,
}

/// What [`GraphTransformerLayer`]'s forward keeps for its backward.
pub struct TransformerCache<B: Placement> {
    x: B::Dense,
    q: B::Dense,
    k: B::Dense,
    v: B::Dense,
    attn: B::Dense,
    /// The dropout the forward applied (regenerated by the backward).
    dropout: Option<Dropout>,
    /// The attention's row statistics (a device forward without extras, on a plan that keeps
    /// them).
    stats: Option<B::Stats>,
}

impl<B: Placement> GraphTransformerLayer<B> {
    /// The configuration.
    pub fn config(&self) -> &TransformerConfig {
        &self.config
    }
    /// Training mode (attention dropout on, a new mask each forward) or evaluation.
    pub fn set_training(&mut self, training: bool) {
        self.dropout_state.set_training(training);
    }
    /// Sets the seed of the dropout masks and restarts their offsets.
    pub fn set_dropout_seed(&mut self, seed: u64) {
        self.dropout_state.reseed(seed);
    }
    /// Every parameter (Q, K, V, O weights and biases), for an optimizer.
    pub fn params_mut(&mut self) -> Vec<&mut B::Param> {
        let mut p = self.query.params_mut();
        p.extend(self.key.params_mut());
        p.extend(self.value.params_mut());
        p.extend(self.output.params_mut());
        p
    }
}

impl<F: Real> GraphTransformerLayer<Host<F>> {
    /// A Glorot-initialised layer (biases zero) over `graph`, drawn from `seed`.
    pub fn new(
        config: TransformerConfig,
        graph: &std::sync::Arc<HostGraph>,
        seed: u64,
    ) -> Result<Self> {
        config.validate()?;
        let mut rng = init_rng(seed);
        let hd = config.heads * config.head_dim;
        let mut lin = |i, o| Linear::with_rng(i, o, config.bias, &mut rng);
        Ok(Self {
            query: lin(config.in_dim, hd),
            key: lin(config.in_dim, hd),
            value: lin(config.in_dim, hd),
            output: lin(hd, config.out_dim),
            config,
            graph: graph.clone(),
            plan: (),
            dropout_state: DropoutState::new(seed),
        })
    }

    fn attn_shape(&self) -> Result<Shape> {
        Ok(Shape::new(
            self.graph.n(),
            self.config.heads,
            self.config.head_dim,
        )?)
    }

    /// The forward pass on `x` (`n × in_dim`): the output (`n × out_dim`) and the cache.
    pub fn forward(&self, x: &[F]) -> Result<(Vec<F>, TransformerCache<Host<F>>)> {
        self.forward_with(x, None)
    }

    /// [`forward`](Self::forward) with a per-edge score bias: `nnz × heads` values in the
    /// graph's CSR order, or `nnz` shared by the heads (`true`). Pass the same bias to
    /// [`backward_with`](Self::backward_with).
    pub fn forward_with(
        &self,
        x: &[F],
        bias: Option<(&[F], bool)>,
    ) -> Result<(Vec<F>, TransformerCache<Host<F>>)> {
        let dropout = self.dropout_state.next(self.config.dropout)?;
        self.forward_full(x, bias, dropout)
    }

    /// [`forward_with`](Self::forward_with) with the dropout given (`None`: none), whatever
    /// the mode.
    pub fn forward_full(
        &self,
        x: &[F],
        bias: Option<(&[F], bool)>,
        dropout: Option<Dropout>,
    ) -> Result<(Vec<F>, TransformerCache<Host<F>>)> {
        let n = self.graph.n();
        let shape_x = flat(n, self.config.in_dim)?;
        if x.len() != shape_x.len() {
            return Err(Error::LengthMismatch {
                what: "x",
                expected: shape_x.len(),
                actual: x.len(),
                shape: shape_x,
            });
        }
        let q = self.query.forward(x, n)?;
        let k = self.key.forward(x, n)?;
        let v = self.value.forward(x, n)?;
        let s = self.attn_shape()?;
        let mut attn = vec![F::ZERO; s.len()];
        let inputs = AttentionInputs::new(&q, s, &k, s, &v, s);
        let scale = F::from_f32(self.config.scale());
        if bias.is_none() && dropout.is_none() {
            cpu::attention(&self.graph.a, &inputs, scale, &mut attn)?;
        } else {
            let extras = host_extras(bias, dropout);
            cpu::attention_extras(&self.graph.a, &inputs, scale, &extras, &mut attn, None)?;
        }
        let mut y = self.output.forward(&attn, n)?;
        if self.config.residual {
            host::axpy(F::ONE, x, &mut y);
        }
        let cache = TransformerCache {
            x: x.to_vec(),
            q,
            k,
            v,
            attn,
            dropout,
            stats: None,
        };
        Ok((y, cache))
    }

    /// The backward pass: accumulates every parameter's gradient and returns `dx`.
    pub fn backward(&mut self, cache: &TransformerCache<Host<F>>, dy: &[F]) -> Result<Vec<F>> {
        Ok(self.backward_with(cache, dy, None)?.0)
    }

    /// The backward of [`forward_with`](Self::forward_with) (pass its bias): `dx`, and the
    /// bias's gradient where there was one.
    pub fn backward_with(
        &mut self,
        cache: &TransformerCache<Host<F>>,
        dy: &[F],
        bias: Option<(&[F], bool)>,
    ) -> Result<(Vec<F>, Option<Vec<F>>)> {
        let n = self.graph.n();
        let out = flat(n, self.config.out_dim)?;
        if dy.len() != out.len() {
            return Err(Error::LengthMismatch {
                what: "dy",
                expected: out.len(),
                actual: dy.len(),
                shape: out,
            });
        }
        let s = self.attn_shape()?;
        let mut d_attn = vec![F::ZERO; s.len()];
        self.output
            .backward(&cache.attn, n, dy, Some((&mut d_attn, false)))?;
        let inputs = AttentionInputs::new(&cache.q, s, &cache.k, s, &cache.v, s);
        let scale = F::from_f32(self.config.scale());
        let (grads, d_bias) = if bias.is_none() && cache.dropout.is_none() {
            let g = cpu::attention_backward(&self.graph.a, &inputs, scale, &cache.attn, &d_attn)?;
            ((g.dq, g.dk, g.dv), None)
        } else {
            let extras = host_extras(bias, cache.dropout);
            let g =
                cpu::attention_extras_backward(&self.graph.a, &inputs, scale, &extras, &d_attn)?;
            ((g.dq, g.dk, g.dv), g.d_bias)
        };
        let (dq, dk, dv) = grads;
        let mut dx = vec![F::ZERO; n * self.config.in_dim];
        self.query
            .backward(&cache.x, n, &dq, Some((&mut dx, false)))?;
        self.key.backward(&cache.x, n, &dk, Some((&mut dx, true)))?;
        self.value
            .backward(&cache.x, n, &dv, Some((&mut dx, true)))?;
        if self.config.residual {
            host::axpy(F::ONE, dy, &mut dx);
        }
        Ok((dx, d_bias))
    }

    /// The same layer on the GPU in `T` (parameters rounded to `T`), with its attention plan
    /// built over `graph`.
    pub fn to_device<T: GemmElement>(
        &self,
        graph: &GpuGraph,
    ) -> Result<GraphTransformerLayer<Device<T>>> {
        let gpu = graph.gpu();
        let c = &self.config;
        let plan_config = AttentionConfig::new(c.heads, c.head_dim, T::KIND)
            .with_scale(c.scale())
            .with_algorithm(c.algorithm)
            .with_edge_extras(c.extras())
            .with_edge_features(false);
        Ok(GraphTransformerLayer {
            config: self.config,
            query: self.query.to_device(gpu)?,
            key: self.key.to_device(gpu)?,
            value: self.value.to_device(gpu)?,
            output: self.output.to_device(gpu)?,
            plan: AttentionPlan::on_graph(graph.device(), plan_config)?,
            graph: graph.clone(),
            dropout_state: self.dropout_state.copy(),
        })
    }
}

/// The CPU extras of a bias (shared or per head) and a dropout.
fn host_extras<F: Real>(bias: Option<(&[F], bool)>, dropout: Option<Dropout>) -> CpuExtras<'_, F> {
    CpuExtras {
        bias: bias.map(|(b, shared)| {
            if shared {
                EdgeBias::Shared(b)
            } else {
                EdgeBias::PerHead(b)
            }
        }),
        edge_features: None,
        dropout,
    }
}

impl<T: GemmElement> GraphTransformerLayer<Device<T>> {
    /// The attention plan (its algorithm and why it was chosen).
    pub fn plan(&self) -> &AttentionPlan {
        &self.plan
    }

    /// The forward pass on `x` (`n` rows of `in_dim` features): the output
    /// (`n × 1 × out_dim`) and the cache.
    pub fn forward(
        &self,
        x: &DeviceMatrix<T>,
    ) -> Result<(DeviceMatrix<T>, TransformerCache<Device<T>>)> {
        self.forward_with(x, None)
    }

    /// [`forward`](Self::forward) with a per-edge score bias (pass the same to
    /// [`backward_with`](Self::backward_with)); needs a layer configured
    /// [`TransformerConfig::with_edge_bias`].
    pub fn forward_with(
        &self,
        x: &DeviceMatrix<T>,
        bias: Option<DeviceBias<'_, T>>,
    ) -> Result<(DeviceMatrix<T>, TransformerCache<Device<T>>)> {
        let dropout = self.dropout_state.next(self.config.dropout)?;
        self.forward_full(x, bias, dropout)
    }

    /// [`forward_with`](Self::forward_with) with the dropout given (`None`: none), whatever
    /// the mode.
    pub fn forward_full(
        &self,
        x: &DeviceMatrix<T>,
        bias: Option<DeviceBias<'_, T>>,
        dropout: Option<Dropout>,
    ) -> Result<(DeviceMatrix<T>, TransformerCache<Device<T>>)> {
        let g = &self.graph;
        let (ctx, gpu) = (g.ctx(), g.gpu());
        let n = g.n();
        check_input("x", x.shape(), n, self.config.in_dim)?;
        let s = self.plan.shape_q();
        let project = |lin: &Linear<Device<T>>| -> Result<DeviceMatrix<T>> {
            let mut m = lin.forward(ctx, x)?;
            m.reshape(s)?;
            Ok(m)
        };
        let (q, k, v) = (
            project(&self.query)?,
            project(&self.key)?,
            project(&self.value)?,
        );
        let mut attn = DeviceMatrix::zeros(gpu, s)?;
        let mut stats = None;
        if bias.is_none() && dropout.is_none() {
            stats = attention_forward(&self.plan, [&q, &k, &v], &mut attn)?;
        } else {
            let extras = Extras {
                bias,
                edge_features: None,
                dropout,
            };
            self.plan
                .forward_with(&q, &k, &v, &extras, &mut attn, None)?;
        }
        let mut y = self.output.forward(ctx, &attn)?;
        if self.config.residual {
            elementwise::axpy(gpu, 1.0, x, &mut y)?;
        }
        let cache = TransformerCache {
            x: x.try_clone()?,
            q,
            k,
            v,
            attn,
            dropout,
            stats,
        };
        Ok((y, cache))
    }

    /// The backward pass: accumulates every parameter's gradient (f32) and returns `dx`.
    pub fn backward(
        &mut self,
        cache: &TransformerCache<Device<T>>,
        dy: &DeviceMatrix<T>,
    ) -> Result<DeviceMatrix<T>> {
        Ok(self.backward_with(cache, dy, None)?.0)
    }

    /// The backward of [`forward_with`](Self::forward_with) (pass its bias): `dx`, and the
    /// bias's gradient (in `T`, shaped like the bias) where there was one.
    pub fn backward_with(
        &mut self,
        cache: &TransformerCache<Device<T>>,
        dy: &DeviceMatrix<T>,
        bias: Option<DeviceBias<'_, T>>,
    ) -> Result<(DeviceMatrix<T>, Option<DeviceVec<T>>)> {
        let g = self.graph.clone();
        let (ctx, gpu) = (g.ctx(), g.gpu());
        check_input("dy", dy.shape(), g.n(), self.config.out_dim)?;
        let s = self.plan.shape_q();
        let mut d_attn = DeviceMatrix::zeros(gpu, s)?;
        self.output
            .backward(ctx, &cache.attn, dy, Some((&mut d_attn, false)))?;
        let qkv = [&cache.q, &cache.k, &cache.v];
        let (dq, dk, dv, d_bias) = if bias.is_none() && cache.dropout.is_none() {
            let stats = cache.stats.as_ref();
            let [dq, dk, dv] =
                attention_backward(&self.plan, gpu, qkv, &cache.attn, &d_attn, stats)?;
            (dq, dk, dv, None)
        } else {
            let extras = Extras {
                bias,
                edge_features: None,
                dropout: cache.dropout,
            };
            let (mut dq, mut dk, mut dv) = (
                DeviceMatrix::zeros(gpu, s)?,
                DeviceMatrix::zeros(gpu, s)?,
                DeviceMatrix::zeros(gpu, s)?,
            );
            let mut d_bias = match bias {
                Some(b) => Some(DeviceVec::<T>::zeros(gpu, b.values().len())?),
                None => None,
            };
            // The layer does not train the scale: nothing waits for the GPU.
            self.plan.backward_with_extras_grads(
                &cache.q,
                &cache.k,
                &cache.v,
                &extras,
                &d_attn,
                ExtrasGrads {
                    dq: &mut dq,
                    dk: &mut dk,
                    dv: &mut dv,
                    d_bias: d_bias.as_mut(),
                    d_edge_features: None,
                },
            )?;
            (dq, dk, dv, d_bias)
        };
        let mut dx = DeviceMatrix::zeros(gpu, cache.x.shape())?;
        self.query
            .backward(ctx, &cache.x, &dq, Some((&mut dx, false)))?;
        self.key
            .backward(ctx, &cache.x, &dk, Some((&mut dx, true)))?;
        self.value
            .backward(ctx, &cache.x, &dv, Some((&mut dx, true)))?;
        if self.config.residual {
            elementwise::axpy(gpu, 1.0, dy, &mut dx)?;
        }
        Ok((dx, d_bias))
    }
}
