//! The graph-transformer attention layer (Dwivedi & Bresson; PyG's `TransformerConv` without
//! edge features): `Q = X·W_q + b_q`, `K`, `V` likewise, sparse multi-head attention
//! `softmax(Q Kᵀ / √d masked by A) · V` through an [`AttentionPlan`], the output projection
//! `Y = Attn·W_o + b_o`, and an optional residual `Y += X`.
//!
//! Backward: `dAttn = dY·W_oᵀ`, the attention backward of the plan (dQ, dK, dV), then the three
//! projections' backwards summed into `dX` (plus `dY` with the residual).

use spattn_ops::cpu::{self, AttentionInputs, Real};
use spattn_ops::dense::GemmElement;
use spattn_ops::elementwise;
use spattn_ops::{DeviceMatrix, Shape};

use super::gat::check_input;
use super::params::{
    attention_backward, flat, host, init_rng, Device, GpuGraph, Host, HostGraph, Linear, Placement,
};
use crate::config::{Algorithm, AttentionConfig};
use crate::error::{Error, Result};
use crate::AttentionPlan;

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
        }
    }
    /// With or without the residual connection.
    pub fn with_residual(mut self, residual: bool) -> Self {
        self.residual = residual;
        self
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
}

/// What [`GraphTransformerLayer`]'s forward keeps for its backward.
pub struct TransformerCache<B: Placement> {
    x: B::Dense,
    q: B::Dense,
    k: B::Dense,
    v: B::Dense,
    attn: B::Dense,
}

impl<B: Placement> GraphTransformerLayer<B> {
    /// The configuration.
    pub fn config(&self) -> &TransformerConfig {
        &self.config
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
        cpu::attention(
            &self.graph.a,
            &inputs,
            F::from_f32(self.config.scale()),
            &mut attn,
        )?;
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
        };
        Ok((y, cache))
    }

    /// The backward pass: accumulates every parameter's gradient and returns `dx`.
    pub fn backward(&mut self, cache: &TransformerCache<Host<F>>, dy: &[F]) -> Result<Vec<F>> {
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
        let grads = cpu::attention_backward(
            &self.graph.a,
            &inputs,
            F::from_f32(self.config.scale()),
            &cache.attn,
            &d_attn,
        )?;
        let mut dx = vec![F::ZERO; n * self.config.in_dim];
        self.query
            .backward(&cache.x, n, &grads.dq, Some((&mut dx, false)))?;
        self.key
            .backward(&cache.x, n, &grads.dk, Some((&mut dx, true)))?;
        self.value
            .backward(&cache.x, n, &grads.dv, Some((&mut dx, true)))?;
        if self.config.residual {
            host::axpy(F::ONE, dy, &mut dx);
        }
        Ok(dx)
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
            .with_algorithm(c.algorithm);
        Ok(GraphTransformerLayer {
            config: self.config,
            query: self.query.to_device(gpu)?,
            key: self.key.to_device(gpu)?,
            value: self.value.to_device(gpu)?,
            output: self.output.to_device(gpu)?,
            plan: AttentionPlan::on_graph(graph.device(), plan_config)?,
            graph: graph.clone(),
        })
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
        self.plan.forward(&q, &k, &v, &mut attn)?;
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
        };
        Ok((y, cache))
    }

    /// The backward pass: accumulates every parameter's gradient (f32) and returns `dx`.
    pub fn backward(
        &mut self,
        cache: &TransformerCache<Device<T>>,
        dy: &DeviceMatrix<T>,
    ) -> Result<DeviceMatrix<T>> {
        let g = self.graph.clone();
        let (ctx, gpu) = (g.ctx(), g.gpu());
        check_input("dy", dy.shape(), g.n(), self.config.out_dim)?;
        let s = self.plan.shape_q();
        let mut d_attn = DeviceMatrix::zeros(gpu, s)?;
        self.output
            .backward(ctx, &cache.attn, dy, Some((&mut d_attn, false)))?;
        let qkv = [&cache.q, &cache.k, &cache.v];
        let [dq, dk, dv] = attention_backward(&self.plan, gpu, qkv, &cache.attn, &d_attn)?;
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
        Ok(dx)
    }
}
