//! GATConv (Veličković et al.; PyG's `GATConv`): `Wh = X·W`, per-node scores
//! `e_src[j, h] = ⟨Wh[j, h], a_src[h]⟩` and `e_dst[i, h] = ⟨Wh[i, h], a_dst[h]⟩`, edge scores
//! `LeakyReLU(e_dst[i] + e_src[j], 0.2)` (a `u_add_v` SDDMM), edge softmax over each row,
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
//! ```

use spattn_ops::backward as gpu_backward;
use spattn_ops::cpu::{self, Real};
use spattn_ops::dense::{Dims, GemmElement};
use spattn_ops::elementwise;
use spattn_ops::{csr_ops, DeviceMatrix, DeviceVec, Shape};

use super::params::{
    flat, host, init_rng, Device, GpuGraph, Host, HostGraph, HostParam, Linear, Placement,
};
use crate::error::{Error, Result};

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
        ] {
            if v == 0 {
                return Err(Error::InvalidConfig {
                    what,
                    why: "must be at least 1".into(),
                });
            }
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
    graph: B::Graph,
}

/// What [`GatConv`]'s forward keeps for its backward.
pub struct GatCache<B: Placement> {
    x: B::Dense,
    wh: B::Dense,
    scores: B::Edges,
    p: B::Edges,
}

impl<B: Placement> GatConv<B> {
    /// The configuration.
    pub fn config(&self) -> &GatConfig {
        &self.config
    }
    /// Every parameter (W, a_src, a_dst, bias), for an optimizer.
    pub fn params_mut(&mut self) -> Vec<&mut B::Param> {
        let mut p = self.lin.params_mut();
        p.push(&mut self.att_src);
        p.push(&mut self.att_dst);
        p.extend(self.bias.as_mut());
        p
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
        Ok(Self {
            lin,
            att_src: att("att_src", &mut rng),
            att_dst: att("att_dst", &mut rng),
            bias: config.bias.then(|| {
                HostParam::from_values(
                    "bias",
                    Dims::new(1, config.output_dim()),
                    vec![F::ZERO; config.output_dim()],
                )
            }),
            config,
            graph: graph.clone(),
        })
    }

    /// The forward pass on `x` (`n × in_dim`, row-major): the output (`n × output_dim`) and
    /// the cache of the backward.
    pub fn forward(&self, x: &[F]) -> Result<(Vec<F>, GatCache<Host<F>>)> {
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
        let mut scores = vec![F::ZERO; g.a.nnz() * h];
        cpu::sddmm_gat(&g.a, &e_dst, &e_src, h, &mut scores)?;
        let mut p = vec![F::ZERO; scores.len()];
        let slope = F::from_f32(self.config.negative_slope);
        cpu::edge_softmax(&g.a, &scores, h, Some(slope), &mut p)?;
        let shape = Shape::new(n, h, c)?;
        let mut agg = vec![F::ZERO; shape.len()];
        cpu::spmm(&g.a, &p, &wh, shape, &mut agg)?;
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
            scores,
            p,
        };
        Ok((y, cache))
    }

    /// The backward pass: accumulates every parameter's gradient and returns `dx`.
    pub fn backward(&mut self, cache: &GatCache<Host<F>>, dy: &[F]) -> Result<Vec<F>> {
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
        let edges = g.a.nnz() * h;
        let mut dp = vec![F::ZERO; edges];
        cpu::sddmm(&g.a, &d_agg, &cache.wh, shape, shape, F::ONE, &mut dp)?;
        let mut ds = vec![F::ZERO; edges];
        cpu::edge_softmax_backward(&g.a, &cache.p, &dp, h, &mut ds)?;
        let slope = F::from_f32(self.config.negative_slope);
        for (d, &s) in ds.iter_mut().zip(&cache.scores) {
            if s < F::ZERO {
                *d = *d * slope;
            }
        }
        let mut de_dst = vec![F::ZERO; n * h];
        cpu::edge_row_sum(&g.a, &ds, h, &mut de_dst)?;
        let mut ds_t = vec![F::ZERO; edges];
        cpu::transpose_edge_values(&g.map, &ds, h, &mut ds_t)?;
        let mut de_src = vec![F::ZERO; n * h];
        cpu::edge_row_sum(&g.at, &ds_t, h, &mut de_src)?;
        let mut p_t = vec![F::ZERO; edges];
        cpu::transpose_edge_values(&g.map, &cache.p, h, &mut p_t)?;
        let mut dwh = vec![F::ZERO; shape.len()];
        cpu::spmm(&g.at, &p_t, &d_agg, shape, &mut dwh)?;
        for (att, de) in [(&mut self.att_src, &de_src), (&mut self.att_dst, &de_dst)] {
            host::head_dot_backward(&cache.wh, &att.value, de, h, c, &mut dwh, &mut att.grad);
        }
        let mut dx = vec![F::ZERO; n * self.config.in_dim];
        self.lin
            .backward(&cache.x, n, &dwh, Some((&mut dx, false)))?;
        Ok(dx)
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
            graph: graph.clone(),
        })
    }
}

impl<T: GemmElement> GatConv<Device<T>> {
    /// The forward pass on `x` (`n` rows of `in_dim` features, any split into heads): the
    /// output (`n × 1 × output_dim`) and the cache of the backward.
    pub fn forward(&self, x: &DeviceMatrix<T>) -> Result<(DeviceMatrix<T>, GatCache<Device<T>>)> {
        let g = &self.graph;
        let (ctx, gpu) = (g.ctx(), g.gpu());
        let (n, h, c) = (g.n(), self.config.heads, self.config.out_dim);
        check_input("x", x.shape(), n, self.config.in_dim)?;
        let mut wh = self.lin.forward(ctx, x)?;
        let shape = Shape::new(n, h, c)?;
        wh.reshape(shape)?;
        let per_node = Shape::new(n, h, 1)?;
        let mut e_src = DeviceMatrix::zeros(gpu, per_node)?;
        let mut e_dst = DeviceMatrix::zeros(gpu, per_node)?;
        elementwise::head_dot(gpu, &wh, &self.att_src.value, &mut e_src)?;
        elementwise::head_dot(gpu, &wh, &self.att_dst.value, &mut e_dst)?;
        let edges = g.a()?.nnz() * h;
        let mut scores = DeviceVec::zeros(gpu, edges)?;
        csr_ops::sddmm_gat(gpu, g.a()?, &e_dst, &e_src, &mut scores)?;
        let mut p = DeviceVec::zeros(gpu, edges)?;
        let slope = Some(self.config.negative_slope);
        csr_ops::edge_softmax(gpu, g.a()?, &scores, h, slope, &mut p)?;
        let mut agg = DeviceMatrix::zeros(gpu, shape)?;
        csr_ops::spmm(gpu, g.a()?, &p, &wh, &mut agg)?;
        let out_dims = Dims::new(n, self.config.output_dim());
        let mut y = if self.config.concat {
            agg.reshape(flat(n, h * c)?)?;
            agg
        } else {
            let mut y = DeviceMatrix::zeros(gpu, flat(n, c)?)?;
            elementwise::head_mean(gpu, &agg, &mut y)?;
            y
        };
        if let Some(b) = &self.bias {
            elementwise::bias_add(gpu, &mut y, out_dims, &b.value)?;
        }
        let cache = GatCache {
            x: x.try_clone()?,
            wh,
            scores,
            p,
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
        let edges = a.nnz() * h;
        let mut dp = DeviceVec::zeros(gpu, edges)?;
        csr_ops::sddmm(gpu, a, &d_agg, &cache.wh, 1.0, &mut dp)?;
        let mut ds = DeviceVec::zeros(gpu, edges)?;
        gpu_backward::edge_softmax_backward(gpu, a, &cache.p, &dp, h, &mut ds)?;
        gpu_backward::edge_leaky_relu_backward(
            gpu,
            &cache.scores,
            self.config.negative_slope,
            &mut ds,
        )?;
        let per_node = Shape::new(n, h, 1)?;
        // f32: these per-node sums feed the attention vectors' gradients, sums over every node
        // whose terms largely cancel; rounding them to f16/bf16 first costs ~1e-2 relative.
        let mut de_dst = DeviceMatrix::<f32>::zeros(gpu, per_node)?;
        gpu_backward::edge_row_sum(gpu, a, &ds, h, &mut de_dst)?;
        // dp is free again: reuse it for the transposed values.
        gpu_backward::transpose_edge_values(gpu, t, &ds, h, &mut dp)?;
        let mut de_src = DeviceMatrix::<f32>::zeros(gpu, per_node)?;
        gpu_backward::edge_row_sum(gpu, t.csr(), &dp, h, &mut de_src)?;
        gpu_backward::transpose_edge_values(gpu, t, &cache.p, h, &mut ds)?;
        let mut dwh = DeviceMatrix::zeros(gpu, shape)?;
        csr_ops::spmm(gpu, t.csr(), &ds, &d_agg, &mut dwh)?;
        for (att, de) in [(&mut self.att_src, &de_src), (&mut self.att_dst, &de_dst)] {
            elementwise::head_outer_add(gpu, de, &att.value, &mut dwh)?;
            elementwise::head_weighted_sum(gpu, &cache.wh, de, &mut att.grad)?;
        }
        let mut dx = DeviceMatrix::zeros(gpu, cache.x.shape())?;
        self.lin
            .backward(ctx, &cache.x, &dwh, Some((&mut dx, false)))?;
        Ok(dx)
    }
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
