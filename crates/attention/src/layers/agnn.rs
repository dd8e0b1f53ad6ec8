//! AGNNConv (Thekumparampil et al.; PyG's `AGNNConv`): cosine attention with a learnable
//! temperature β,
//!
//! ```text
//! x̂ = x / max(‖x‖, 1e-12) per row,   P = softmax_row(β · x̂ x̂ᵀ masked by A),   out = P · x
//! ```
//!
//! computed as sparse attention with `q = β·x̂`, `k = x̂`, `v = x` and scale 1 (so the plan is
//! built once and β can change every step). Backward: the attention backward gives dq, dk, dv;
//! `dβ = Σ dq ⊙ x̂`, and `dx = dv + (g − x̂⟨x̂, g⟩)/‖x‖` with `g = β·dq + dk`.

use spattn_ops::cpu::{self, AttentionInputs, Real};
use spattn_ops::elementwise;
use spattn_ops::{DeviceMatrix, DeviceVec, Shape};
use spattn_ops::{Dims, GemmElement};

use super::gat::check_input;
use super::params::{
    attention_backward, attention_forward, Device, DeviceParam, GpuGraph, Host, HostGraph,
    HostParam, Placement,
};
use crate::config::{Algorithm, AttentionConfig};
use crate::error::{Error, Result};
use crate::AttentionPlan;

/// F.normalize's clamp of the norm.
const NORM_EPS: f64 = 1e-12;

/// An AGNN layer on backend `B`, bound to one graph: features in = features out (`dim`).
pub struct AgnnConv<B: Placement> {
    dim: usize,
    /// β (one element; 1 at initialisation, as in PyG).
    pub beta: B::Param,
    algorithm: Algorithm,
    graph: B::Graph,
    plan: B::Plan,
}

/// What [`AgnnConv`]'s forward keeps for its backward.
pub struct AgnnCache<B: Placement> {
    x: B::Dense,
    xhat: B::Dense,
    q: B::Dense,
    out: B::Dense,
    inv_norm: B::Edges,
    /// The attention's row statistics (a device forward on a plan that keeps them).
    stats: Option<B::Stats>,
}

impl<B: Placement> AgnnConv<B> {
    /// Features per node.
    pub fn dim(&self) -> usize {
        self.dim
    }
    /// The parameters (β), for an optimizer.
    pub fn params_mut(&mut self) -> Vec<&mut B::Param> {
        vec![&mut self.beta]
    }
}

impl<F: Real> AgnnConv<Host<F>> {
    /// A layer of `dim` features over `graph`, β = 1; `algorithm` is the one its GPU twin's
    /// plan uses.
    pub fn new(
        dim: usize,
        graph: &std::sync::Arc<HostGraph>,
        algorithm: Algorithm,
    ) -> Result<Self> {
        if dim == 0 {
            return Err(Error::InvalidConfig {
                what: "dim",
                why: "must be at least 1".into(),
            });
        }
        Ok(Self {
            dim,
            beta: HostParam::from_values("beta", Dims::new(1, 1), vec![F::ONE]),
            algorithm,
            graph: graph.clone(),
            plan: (),
        })
    }

    /// The forward pass on `x` (`n × dim`): the output (`n × dim`) and the cache.
    pub fn forward(&self, x: &[F]) -> Result<(Vec<F>, AgnnCache<Host<F>>)> {
        let (n, d) = (self.graph.n(), self.dim);
        let s = Shape::new(n, 1, d)?;
        if x.len() != s.len() {
            return Err(Error::LengthMismatch {
                what: "x",
                expected: s.len(),
                actual: x.len(),
                shape: s,
            });
        }
        let beta = self.beta.value[0];
        let mut xhat = vec![F::ZERO; s.len()];
        let mut inv_norm = vec![F::ZERO; n];
        for ((row, out), inv) in x.chunks(d).zip(xhat.chunks_mut(d)).zip(&mut inv_norm) {
            let norm = row
                .iter()
                .map(|v| v.to_f64() * v.to_f64())
                .sum::<f64>()
                .sqrt();
            // NaN norms count as clamped, as in the kernel.
            let clamped = norm.partial_cmp(&NORM_EPS) != Some(std::cmp::Ordering::Greater);
            let i = 1.0 / if clamped { NORM_EPS } else { norm };
            for (o, v) in out.iter_mut().zip(row) {
                *o = F::from_f64(v.to_f64() * i);
            }
            *inv = F::from_f64(if clamped { -i } else { i });
        }
        let q: Vec<F> = xhat.iter().map(|&v| beta * v).collect();
        let mut out = vec![F::ZERO; s.len()];
        cpu::attention(
            &self.graph.a,
            &AttentionInputs::new(&q, s, &xhat, s, x, s),
            F::ONE,
            &mut out,
        )?;
        let cache = AgnnCache {
            x: x.to_vec(),
            xhat,
            q,
            out: out.clone(),
            inv_norm,
            stats: None,
        };
        Ok((out, cache))
    }

    /// The backward pass: accumulates dβ and returns `dx`.
    pub fn backward(&mut self, cache: &AgnnCache<Host<F>>, dy: &[F]) -> Result<Vec<F>> {
        let (n, d) = (self.graph.n(), self.dim);
        let s = Shape::new(n, 1, d)?;
        if dy.len() != s.len() {
            return Err(Error::LengthMismatch {
                what: "dy",
                expected: s.len(),
                actual: dy.len(),
                shape: s,
            });
        }
        let grads = cpu::attention_backward(
            &self.graph.a,
            &AttentionInputs::new(&cache.q, s, &cache.xhat, s, &cache.x, s),
            F::ONE,
            &cache.out,
            dy,
        )?;
        let beta = self.beta.value[0];
        let mut dx = grads.dv;
        let mut dbeta = F::ZERO;
        for r in 0..n {
            let range = r * d..(r + 1) * d;
            let (xh, dq, dk) = (
                &cache.xhat[range.clone()],
                &grads.dq[range.clone()],
                &grads.dk[range.clone()],
            );
            let g: Vec<F> = dq.iter().zip(dk).map(|(&q, &k)| beta * q + k).collect();
            let dot = xh.iter().zip(&g).fold(F::ZERO, |a, (&u, &v)| a + u * v);
            dbeta = dq.iter().zip(xh).fold(dbeta, |a, (&u, &v)| a + u * v);
            let inv = cache.inv_norm[r];
            let (inv, proj) = if inv > F::ZERO {
                (inv, dot)
            } else {
                (F::ZERO - inv, F::ZERO)
            };
            for ((o, &gi), &xi) in dx[range].iter_mut().zip(&g).zip(xh) {
                *o = *o + (gi - xi * proj) * inv;
            }
        }
        self.beta.grad[0] = self.beta.grad[0] + dbeta;
        Ok(dx)
    }

    /// The same layer on the GPU in `T`, with its attention plan (1 head of `dim`, scale 1)
    /// built over `graph`.
    pub fn to_device<T: GemmElement>(&self, graph: &GpuGraph) -> Result<AgnnConv<Device<T>>> {
        let config = AttentionConfig::new(1, self.dim, T::KIND)
            .with_scale(1.0)
            .with_algorithm(self.algorithm);
        Ok(AgnnConv {
            dim: self.dim,
            beta: self.beta.to_device(graph.gpu())?,
            algorithm: self.algorithm,
            plan: AttentionPlan::on_graph(graph.device(), config)?,
            graph: graph.clone(),
        })
    }
}

impl<T: GemmElement> AgnnConv<Device<T>> {
    /// The attention plan.
    pub fn plan(&self) -> &AttentionPlan {
        &self.plan
    }

    /// The forward pass on `x` (`n` rows of `dim` features): the output (`n × 1 × dim`) and
    /// the cache.
    pub fn forward(&self, x: &DeviceMatrix<T>) -> Result<(DeviceMatrix<T>, AgnnCache<Device<T>>)> {
        let g = &self.graph;
        let gpu = g.gpu();
        check_input("x", x.shape(), g.n(), self.dim)?;
        let s = self.plan.shape_q();
        let mut xv = x.try_clone()?;
        xv.reshape(s)?;
        let mut xhat = DeviceMatrix::zeros(gpu, s)?;
        let mut q = DeviceMatrix::zeros(gpu, s)?;
        let mut inv_norm = DeviceVec::zeros(gpu, s.rows)?;
        elementwise::row_normalize(
            gpu,
            &xv,
            Some(&self.beta.value),
            &mut xhat,
            Some(&mut q),
            &mut inv_norm,
        )?;
        let mut out = DeviceMatrix::zeros(gpu, s)?;
        let stats = attention_forward(&self.plan, [&q, &xhat, &xv], &mut out)?;
        let cache = AgnnCache {
            x: xv,
            xhat,
            q,
            out: out.try_clone()?,
            inv_norm,
            stats,
        };
        Ok((out, cache))
    }

    /// The backward pass: accumulates dβ (f32) and returns `dx` (`n × 1 × dim`).
    pub fn backward(
        &mut self,
        cache: &AgnnCache<Device<T>>,
        dy: &DeviceMatrix<T>,
    ) -> Result<DeviceMatrix<T>> {
        let g = self.graph.clone();
        let gpu = g.gpu();
        check_input("dy", dy.shape(), g.n(), self.dim)?;
        let mut dy1 = dy.try_clone()?;
        dy1.reshape(self.plan.shape_q())?;
        let qkv = [&cache.q, &cache.xhat, &cache.x];
        let stats = cache.stats.as_ref();
        let [dq, dk, mut dx] = attention_backward(&self.plan, gpu, qkv, &cache.out, &dy1, stats)?;
        let DeviceParam { value, grad, .. } = &mut self.beta;
        elementwise::row_normalize_backward(
            gpu,
            &cache.xhat,
            &cache.inv_norm,
            &dq,
            Some(&dk),
            Some(value),
            &mut dx,
            Some(grad),
        )?;
        Ok(dx)
    }
}
