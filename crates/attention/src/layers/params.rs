//! What every layer shares: the two placements (host, device), parameters with their gradients, the graph a layer
//! is bound to, the dense projection [`Linear`], and the optimizers.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use spattn_formats::Csr;
use spattn_ops::backward::DeviceTranspose;
use spattn_ops::cpu::Real;
use spattn_ops::elementwise::{self, AdamHyper};
use spattn_ops::DeviceGraph;
use spattn_ops::{Blas, Dims, GemmElement};
use spattn_ops::{DType, DeviceCsr, DeviceMatrix, DeviceVec, Gpu, Shape};

use crate::error::Result;
use crate::{AttentionPlan, RowStats};
use spattn_ops::Dropout;

/// A layer's attention forward on `plan` into `out`, and the row statistics the backward
/// takes from it where the plan keeps them (a fused-tc plan whose backward takes the tensor-core
/// passes; elsewhere None, and the backward computes its own).
pub(crate) fn attention_forward<T: DType>(
    plan: &AttentionPlan,
    [q, k, v]: [&DeviceMatrix<T>; 3],
    out: &mut DeviceMatrix<T>,
) -> Result<Option<RowStats>> {
    if !plan.keeps_row_stats::<T>() {
        plan.forward(q, k, v, out)?;
        return Ok(None);
    }
    let mut stats = plan.row_stats()?;
    plan.forward_keeping_stats(q, k, v, out, &mut stats)?;
    Ok(Some(stats))
}

/// The backward of a layer's attention `plan` on `gpu` into fresh zeroed dQ, dK and dV of the
/// plan's shape: `[dq, dk, dv]`, from the forward's `stats` where it kept them. The layers do
/// not train the scale, so nothing waits for the GPU.
pub(crate) fn attention_backward<T: DType>(
    plan: &AttentionPlan,
    gpu: &Gpu,
    [q, k, v]: [&DeviceMatrix<T>; 3],
    out: &DeviceMatrix<T>,
    d_out: &DeviceMatrix<T>,
    stats: Option<&RowStats>,
) -> Result<[DeviceMatrix<T>; 3]> {
    let s = plan.shape_q();
    let mut dq = DeviceMatrix::zeros(gpu, s)?;
    let mut dk = DeviceMatrix::zeros(gpu, s)?;
    let mut dv = DeviceMatrix::zeros(gpu, s)?;
    match stats {
        Some(s) => {
            plan.backward_grads_with_stats(q, k, v, out, d_out, s, (&mut dq, &mut dk, &mut dv))?
        }
        None => plan.backward_grads(q, k, v, out, d_out, &mut dq, &mut dk, &mut dv)?,
    }
    Ok([dq, dk, dv])
}

/// Where a layer runs and in which element type: [`Host`] (CPU, `f32` or `f64`) or [`Device`]
/// (GPU, `f32`, `f16` or `bf16`). The layers are generic over it so that one struct holds
/// either kind of parameters; each placement has its own `forward` / `backward`.
pub trait Placement {
    /// A parameter with its gradient.
    type Param;
    /// A dense `rows × features` activation.
    type Dense;
    /// Per-edge values (`nnz × heads`).
    type Edges;
    /// The graph the layer is bound to.
    type Graph: Clone;
    /// The attention plan a layer keeps (none on the host).
    type Plan;
    /// The row statistics an attention forward keeps for its backward (none on the host).
    type Stats;
    /// Per-node terms of a layer's scores (GAT's `a_dst`, `a_src`, which the device layer keeps
    /// for its backward): `Vec<F>` on the host (unused there), an f32 matrix on the device.
    type Terms;
    /// The dropout mask's bits a forward keeps for its backward (GAT's rows kernels, in A's
    /// order): none on the host, u32 words on the device.
    type Mask;
}

/// The CPU placement in `F` (`f64`: the reference of the tests; `f32`: the fallback).
#[derive(Debug)]
pub struct Host<F>(PhantomData<F>);

/// The GPU placement in `T` (parameters and activations in `T`, gradients of parameters in f32).
#[derive(Debug)]
pub struct Device<T>(PhantomData<T>);

impl<F: Real> Placement for Host<F> {
    type Param = HostParam<F>;
    type Dense = Vec<F>;
    type Edges = Vec<F>;
    type Graph = Arc<HostGraph>;
    type Plan = ();
    type Stats = ();
    type Terms = Vec<F>;
    type Mask = ();
}

impl<T: DType> Placement for Device<T> {
    type Param = DeviceParam<T>;
    type Dense = DeviceMatrix<T>;
    type Edges = DeviceVec<f32>;
    type Graph = GpuGraph;
    type Plan = AttentionPlan;
    type Stats = RowStats;
    type Terms = DeviceMatrix<f32>;
    type Mask = DeviceVec<u32>;
}

/// A parameter (`dims.rows × dims.cols`, row-major) and the gradient its layer's `backward`
/// accumulates into.
#[derive(Debug)]
pub struct Param<V, G> {
    /// What it is (`"weight"`, `"att_src"`, `"beta"`, …).
    pub name: &'static str,
    /// Its dimensions.
    pub dims: Dims,
    /// Its value.
    pub value: V,
    /// Its gradient (same length), accumulated by `backward`, cleared by the optimizers.
    pub grad: G,
}

/// A host parameter in `F`.
pub type HostParam<F> = Param<Vec<F>, Vec<F>>;
/// A device parameter: value in `T`, gradient in f32.
pub type DeviceParam<T> = Param<DeviceVec<T>, DeviceVec<f32>>;

impl<F: Real> HostParam<F> {
    /// A parameter of `dims` holding `value` (row-major), with a zero gradient.
    pub fn from_values(name: &'static str, dims: Dims, value: Vec<F>) -> Self {
        let grad = vec![F::ZERO; value.len()];
        Self {
            name,
            dims,
            value,
            grad,
        }
    }

    /// Glorot-uniform values (`±√(6 / (fan_in + fan_out))`) from `rng`.
    pub(crate) fn glorot(
        name: &'static str,
        dims: Dims,
        fans: (usize, usize),
        rng: &mut Pcg64,
    ) -> Self {
        let bound = (6.0 / (fans.0 + fans.1).max(1) as f64).sqrt();
        let value = (0..dims.rows * dims.cols)
            .map(|_| F::from_f64(rng.random_range(-bound..=bound)))
            .collect();
        Self::from_values(name, dims, value)
    }

    /// Sets the gradient to zero.
    pub fn zero_grad(&mut self) {
        self.grad.iter_mut().for_each(|g| *g = F::ZERO);
    }

    /// The same parameter in another host type.
    pub fn cast<G: Real>(&self) -> HostParam<G> {
        HostParam {
            name: self.name,
            dims: self.dims,
            value: self.value.iter().map(|x| G::from_f64(x.to_f64())).collect(),
            grad: self.grad.iter().map(|x| G::from_f64(x.to_f64())).collect(),
        }
    }

    /// Uploads the value (rounded to `T`) with a zero f32 gradient.
    pub fn to_device<T: DType>(&self, gpu: &Gpu) -> Result<DeviceParam<T>> {
        let host: Vec<T> = self.value.iter().map(|x| T::from_f64(x.to_f64())).collect();
        Ok(DeviceParam {
            name: self.name,
            dims: self.dims,
            value: DeviceVec::from_host(gpu, &host)?,
            grad: DeviceVec::zeros(gpu, host.len())?,
        })
    }
}

impl<T: DType> DeviceParam<T> {
    /// Sets the gradient to zero (a memset on the stream).
    pub fn zero_grad(&mut self) -> Result<()> {
        Ok(self.grad.fill(0.0)?)
    }

    /// Downloads value and gradient into a host parameter in `F`.
    pub fn to_host<F: Real>(&self) -> Result<HostParam<F>> {
        Ok(HostParam {
            name: self.name,
            dims: self.dims,
            value: self
                .value
                .to_host()?
                .into_iter()
                .map(|x| F::from_f64(x.to_f64()))
                .collect(),
            grad: self
                .grad
                .to_host()?
                .into_iter()
                .map(|x| F::from_f64(f64::from(x)))
                .collect(),
        })
    }
}

/// What the GPU layers run with: the [`Gpu`] and a cuBLAS handle on its stream. Cheap to
/// clone.
#[derive(Clone, Debug)]
pub struct GpuContext {
    gpu: Gpu,
    blas: Arc<Blas>,
}

impl GpuContext {
    /// Creates the cuBLAS handle for `gpu` (errors: [`spattn_ops::Error::NoCublas`] where
    /// libcublas cannot be loaded).
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Self {
            gpu: gpu.clone(),
            blas: Arc::new(Blas::new(gpu)?),
        })
    }
    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
    /// The cuBLAS handle.
    pub fn blas(&self) -> &Blas {
        &self.blas
    }
}

/// A graph for the CPU layers: A, Aᵀ and the map from Aᵀ's entries to A's.
#[derive(Debug)]
pub struct HostGraph {
    /// A (row `i` lists the nodes node `i` attends to), shared with the GPU graph made from it.
    pub a: Arc<Csr>,
    /// Aᵀ.
    pub at: Csr,
    /// For each entry of Aᵀ, the index of the same entry in A.
    pub map: Vec<u32>,
}

impl HostGraph {
    /// Builds the transpose of a square `a`.
    pub fn new(a: &Csr) -> Result<Arc<Self>> {
        if a.n_rows() != a.n_cols() {
            return Err(crate::Error::InvalidConfig {
                what: "graph",
                why: format!(
                    "a layer's graph must be square (node features in, node features out); it is {} x {}",
                    a.n_rows(),
                    a.n_cols()
                ),
            });
        }
        let (at, map) = a.transpose_with_map();
        Ok(Arc::new(Self {
            a: Arc::new(a.clone()),
            at,
            map,
        }))
    }
    /// Number of nodes.
    pub fn n(&self) -> usize {
        self.a.n_rows()
    }
}

/// The graph the GPU layers are bound to: the shared [`DeviceGraph`] (A and Aᵀ with the edge
/// map on the device, and whatever format the layers' attention plans read, shared by every
/// layer over the graph), the host graph it came from where it came from one, and the context
/// the layers run on. Cheap to clone (shared).
///
/// A graph seen once (a mini-batch's) is best built on the device
/// ([`DeviceGraph::from_device_edges`], policy [`PlanPolicy::Once`](crate::PlanPolicy::Once)) and bound
/// with [`on_device`](Self::on_device): nothing of it then goes through the host.
#[derive(Clone, Debug)]
pub struct GpuGraph {
    ctx: GpuContext,
    host: Option<Arc<HostGraph>>,
    device: Arc<DeviceGraph>,
}

impl GpuGraph {
    /// Binds `graph` to the context's GPU and uploads A and Aᵀ (the layers read both).
    pub fn upload(ctx: &GpuContext, graph: &Arc<HostGraph>) -> Result<Self> {
        let device = Arc::new(DeviceGraph::new(ctx.gpu(), graph.a.clone()));
        device.csr()?;
        device.transpose()?;
        Ok(Self {
            ctx: ctx.clone(),
            host: Some(graph.clone()),
            device,
        })
    }

    /// Binds a graph already on the context's GPU (built there from an edge list, or
    /// shared with plans): A and Aᵀ are made where they are not yet (on the device for a
    /// graph built there).
    ///
    /// Errors: [`crate::Error::InvalidConfig`] for a graph that is not square or of another
    /// GPU handle than the context's; the device's.
    pub fn on_device(ctx: &GpuContext, device: Arc<DeviceGraph>) -> Result<Self> {
        if device.n_rows() != device.n_cols() {
            return Err(crate::Error::InvalidConfig {
                what: "graph",
                why: format!(
                    "a layer's graph must be square (node features in, node features out); it is {} x {}",
                    device.n_rows(),
                    device.n_cols()
                ),
            });
        }
        if !ctx.gpu().same_as(device.gpu()) {
            return Err(crate::Error::InvalidConfig {
                what: "graph",
                why: "is on another GPU handle than the layers' context (build it with the \
                      context's Gpu)"
                    .into(),
            });
        }
        device.csr()?;
        device.transpose()?;
        Ok(Self {
            ctx: ctx.clone(),
            host: None,
            device,
        })
    }
    /// The context.
    pub fn ctx(&self) -> &GpuContext {
        &self.ctx
    }
    /// The GPU.
    pub fn gpu(&self) -> &Gpu {
        self.ctx.gpu()
    }
    /// The host graph it came from; `None` for a graph bound with
    /// [`on_device`](Self::on_device).
    pub fn host(&self) -> Option<&Arc<HostGraph>> {
        self.host.as_ref()
    }
    /// The shared device graph (for attention plans over the same uploads).
    pub fn device(&self) -> &Arc<DeviceGraph> {
        &self.device
    }
    /// A on the device.
    pub fn a(&self) -> Result<&DeviceCsr> {
        Ok(self.device.csr()?)
    }
    /// Aᵀ and the edge map on the device.
    pub fn t(&self) -> Result<&DeviceTranspose> {
        Ok(self.device.transpose()?)
    }
    /// Number of nodes.
    pub fn n(&self) -> usize {
        self.device.n_rows()
    }
}

/// A layer's dropout: whether it is training, the masks' seed, and the offset of the next
/// mask (each training forward draws a new one, as torch's generator advances).
#[derive(Debug)]
pub(crate) struct DropoutState {
    training: bool,
    seed: u64,
    next_offset: AtomicU64,
}

impl DropoutState {
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            training: true,
            seed,
            next_offset: AtomicU64::new(0),
        }
    }
    /// A new seed; the offsets start again.
    pub(crate) fn reseed(&mut self, seed: u64) {
        self.seed = seed;
        self.next_offset = AtomicU64::new(0);
    }
    /// Training mode on or off.
    pub(crate) fn set_training(&mut self, training: bool) {
        self.training = training;
    }
    pub(crate) fn copy(&self) -> Self {
        Self {
            training: self.training,
            seed: self.seed,
            next_offset: AtomicU64::new(self.next_offset.load(Ordering::Relaxed)),
        }
    }
    /// The dropout of the next training forward at `rate`, or none (evaluation, rate 0).
    pub(crate) fn next(&self, rate: f32) -> Result<Option<Dropout>> {
        if !self.training || rate == 0.0 {
            return Ok(None);
        }
        let offset = self.next_offset.fetch_add(1, Ordering::Relaxed);
        Ok(Some(Dropout::new(rate, self.seed, offset)?))
    }
}

/// The seeded generator of parameter initialisation.
pub(crate) fn init_rng(seed: u64) -> Pcg64 {
    Pcg64::seed_from_u64(seed)
}

/// `rows × 1 × cols`: a flat activation as a [`DeviceMatrix`] shape.
pub(crate) fn flat(rows: usize, cols: usize) -> Result<Shape> {
    Ok(Shape::new(rows, 1, cols)?)
}

/// A dense projection `y = x·W (+ b)` with `W` of `in_dim × out_dim`: the Q/K/V/O projections
/// of the graph transformer, GAT's `W`, and the layers of the MLP baseline.
pub struct Linear<B: Placement> {
    /// Input features.
    pub in_dim: usize,
    /// Output features.
    pub out_dim: usize,
    /// `W`, `in_dim × out_dim`.
    pub weight: B::Param,
    /// `b`, `1 × out_dim`, where the layer has one.
    pub bias: Option<B::Param>,
}

impl<B: Placement> Linear<B> {
    /// The parameters (weight, then bias), for an optimizer.
    pub fn params_mut(&mut self) -> Vec<&mut B::Param> {
        let mut p = vec![&mut self.weight];
        p.extend(self.bias.as_mut());
        p
    }
}

impl<F: Real> Linear<Host<F>> {
    /// A Glorot-initialised projection (bias zero) drawn from `seed`.
    pub fn new(in_dim: usize, out_dim: usize, bias: bool, seed: u64) -> Self {
        let mut rng = init_rng(seed);
        Self::with_rng(in_dim, out_dim, bias, &mut rng)
    }

    pub(crate) fn with_rng(in_dim: usize, out_dim: usize, bias: bool, rng: &mut Pcg64) -> Self {
        Self {
            in_dim,
            out_dim,
            weight: HostParam::glorot("weight", Dims::new(in_dim, out_dim), (in_dim, out_dim), rng),
            bias: bias.then(|| {
                HostParam::from_values("bias", Dims::new(1, out_dim), vec![F::ZERO; out_dim])
            }),
        }
    }

    /// `y = x·W + b` for `x` of `rows × in_dim`.
    pub fn forward(&self, x: &[F], rows: usize) -> Result<Vec<F>> {
        let mut y = vec![F::ZERO; rows * self.out_dim];
        spattn_ops::host_gemm(
            F::ONE,
            (x, Dims::new(rows, self.in_dim), false),
            (&self.weight.value, self.weight.dims, false),
            F::ZERO,
            (&mut y, Dims::new(rows, self.out_dim)),
        )?;
        if let Some(b) = &self.bias {
            for row in y.chunks_mut(self.out_dim) {
                for (v, &bv) in row.iter_mut().zip(&b.value) {
                    *v = *v + bv;
                }
            }
        }
        Ok(y)
    }

    /// Accumulates `dW += xᵀ·dy` and `db += Σ_rows dy`; where `dx` is given, sets it to
    /// `dy·Wᵀ` (`accumulate = false`) or adds that to it (`true`).
    pub fn backward(
        &mut self,
        x: &[F],
        rows: usize,
        dy: &[F],
        dx: Option<(&mut [F], bool)>,
    ) -> Result<()> {
        let (din, dout) = (Dims::new(rows, self.in_dim), Dims::new(rows, self.out_dim));
        spattn_ops::host_gemm(
            F::ONE,
            (x, din, true),
            (dy, dout, false),
            F::ONE,
            (&mut self.weight.grad, self.weight.dims),
        )?;
        if let Some(b) = &mut self.bias {
            for row in dy.chunks(self.out_dim) {
                for (g, &d) in b.grad.iter_mut().zip(row) {
                    *g = *g + d;
                }
            }
        }
        if let Some((dx, accumulate)) = dx {
            let beta = if accumulate { F::ONE } else { F::ZERO };
            spattn_ops::host_gemm(
                F::ONE,
                (dy, dout, false),
                (&self.weight.value, self.weight.dims, true),
                beta,
                (dx, din),
            )?;
        }
        Ok(())
    }

    /// The same projection on the GPU in `T` (values rounded to `T`).
    pub fn to_device<T: DType>(&self, gpu: &Gpu) -> Result<Linear<Device<T>>> {
        Ok(Linear {
            in_dim: self.in_dim,
            out_dim: self.out_dim,
            weight: self.weight.to_device(gpu)?,
            bias: self.bias.as_ref().map(|b| b.to_device(gpu)).transpose()?,
        })
    }
}

impl<T: GemmElement> Linear<Device<T>> {
    /// `y = x·W + b` for `x` with `rows` rows of `in_dim` features (any `heads × head_dim`
    /// split); `y` is `rows × 1 × out_dim`.
    pub fn forward(&self, ctx: &GpuContext, x: &DeviceMatrix<T>) -> Result<DeviceMatrix<T>> {
        let rows = x.shape().rows;
        let mut y = DeviceMatrix::zeros(ctx.gpu(), flat(rows, self.out_dim)?)?;
        self.forward_into(ctx, x, &mut y)?;
        Ok(y)
    }

    /// [`forward`](Self::forward) into an existing `y` of `rows × out_dim` elements (any
    /// split into heads).
    pub fn forward_into(
        &self,
        ctx: &GpuContext,
        x: &DeviceMatrix<T>,
        y: &mut DeviceMatrix<T>,
    ) -> Result<()> {
        let rows = x.shape().rows;
        let dy = Dims::new(rows, self.out_dim);
        spattn_ops::gemm(
            ctx.blas(),
            1.0,
            (x, Dims::new(rows, self.in_dim), false),
            (&self.weight.value, self.weight.dims, false),
            0.0,
            (y, dy),
        )?;
        if let Some(b) = &self.bias {
            elementwise::bias_add(ctx.gpu(), y, dy, &b.value)?;
        }
        Ok(())
    }

    /// Accumulates `dW += xᵀ·dy` (f32) and `db += Σ_rows dy`; where `dx` is given, sets it to
    /// `dy·Wᵀ` (`accumulate = false`) or adds that to it (`true`).
    pub fn backward(
        &mut self,
        ctx: &GpuContext,
        x: &DeviceMatrix<T>,
        dy: &DeviceMatrix<T>,
        dx: Option<(&mut DeviceMatrix<T>, bool)>,
    ) -> Result<()> {
        let rows = x.shape().rows;
        let (din, dout) = (Dims::new(rows, self.in_dim), Dims::new(rows, self.out_dim));
        spattn_ops::gemm(
            ctx.blas(),
            1.0,
            (x, din, true),
            (dy, dout, false),
            1.0,
            (&mut self.weight.grad, self.weight.dims),
        )?;
        if let Some(b) = &mut self.bias {
            elementwise::bias_grad(ctx.gpu(), dy, dout, &mut b.grad)?;
        }
        if let Some((dx, accumulate)) = dx {
            spattn_ops::gemm(
                ctx.blas(),
                1.0,
                (dy, dout, false),
                (&self.weight.value, self.weight.dims, true),
                if accumulate { 1.0 } else { 0.0 },
                (dx, din),
            )?;
        }
        Ok(())
    }
}

/// A parameter an optimizer can update: host ([`HostParam`]) or device ([`DeviceParam`]).
pub trait Optimizable {
    /// Adam's per-parameter state (first and second moments).
    type AdamState;
    /// Fresh (zero) moments for this parameter.
    fn adam_state(&self) -> Result<Self::AdamState>;
    /// One Adam step at step count `t ≥ 1`, then the gradient is zeroed.
    fn adam_step(&mut self, state: &mut Self::AdamState, hyper: AdamHyper, t: u32) -> Result<()>;
    /// One SGD step, then the gradient is zeroed.
    fn sgd_step(&mut self, lr: f32, weight_decay: f32) -> Result<()>;
}

impl<F: Real> Optimizable for HostParam<F> {
    type AdamState = (Vec<f64>, Vec<f64>);

    fn adam_state(&self) -> Result<Self::AdamState> {
        Ok((vec![0.0; self.value.len()], vec![0.0; self.value.len()]))
    }

    fn adam_step(&mut self, state: &mut Self::AdamState, h: AdamHyper, t: u32) -> Result<()> {
        let (b1, b2) = (f64::from(h.beta1), f64::from(h.beta2));
        let (lr, eps, wd) = (f64::from(h.lr), f64::from(h.eps), f64::from(h.weight_decay));
        let bc1 = 1.0 - b1.powi(t as i32);
        let bc2 = 1.0 - b2.powi(t as i32);
        for (((p, g), m), v) in self
            .value
            .iter_mut()
            .zip(self.grad.iter_mut())
            .zip(state.0.iter_mut())
            .zip(state.1.iter_mut())
        {
            let gi = g.to_f64();
            *m = b1 * *m + (1.0 - b1) * gi;
            *v = b2 * *v + (1.0 - b2) * gi * gi;
            let mut pi = p.to_f64();
            pi -= lr * wd * pi;
            pi -= lr * (*m / bc1) / ((*v / bc2).sqrt() + eps);
            *p = F::from_f64(pi);
            *g = F::ZERO;
        }
        Ok(())
    }

    fn sgd_step(&mut self, lr: f32, weight_decay: f32) -> Result<()> {
        let (lr, wd) = (F::from_f32(lr), F::from_f32(weight_decay));
        for (p, g) in self.value.iter_mut().zip(self.grad.iter_mut()) {
            *p = *p - lr * (*g + wd * *p);
            *g = F::ZERO;
        }
        Ok(())
    }
}

impl<T: DType> Optimizable for DeviceParam<T> {
    type AdamState = (DeviceVec<f32>, DeviceVec<f32>);

    fn adam_state(&self) -> Result<Self::AdamState> {
        let gpu = self.value.gpu();
        Ok((
            DeviceVec::zeros(gpu, self.value.len())?,
            DeviceVec::zeros(gpu, self.value.len())?,
        ))
    }

    fn adam_step(&mut self, state: &mut Self::AdamState, h: AdamHyper, t: u32) -> Result<()> {
        let gpu = self.value.gpu().clone();
        elementwise::adam_step(
            &gpu,
            h,
            t,
            &mut self.value,
            &self.grad,
            &mut state.0,
            &mut state.1,
        )?;
        self.zero_grad()
    }

    fn sgd_step(&mut self, lr: f32, weight_decay: f32) -> Result<()> {
        let gpu = self.value.gpu().clone();
        elementwise::sgd_step(&gpu, lr, weight_decay, &mut self.value, &self.grad)?;
        self.zero_grad()
    }
}

/// Adam (AdamW with a weight decay) over a fixed list of parameters: pass the same parameters
/// in the same order at every [`step`](Self::step). Each step also zeroes the gradients, so a
/// training loop is forward → loss → backward → step.
pub struct Adam<P: Optimizable> {
    /// Hyper-parameters (change `lr` between steps for a schedule).
    pub hyper: AdamHyper,
    t: u32,
    state: Vec<P::AdamState>,
}

impl<P: Optimizable> Adam<P> {
    /// Adam with learning rate `lr` and the usual betas (0.9, 0.999), eps 1e-8.
    pub fn new(lr: f32) -> Self {
        Self::with_hyper(AdamHyper::new(lr))
    }

    /// Adam with explicit hyper-parameters.
    pub fn with_hyper(hyper: AdamHyper) -> Self {
        Self {
            hyper,
            t: 0,
            state: Vec::new(),
        }
    }

    /// Updates every parameter from its gradient and zeroes the gradients.
    ///
    /// Errors: [`crate::Error::InvalidConfig`] when the number of parameters changed since the
    /// first step.
    pub fn step(&mut self, params: Vec<&mut P>) -> Result<()> {
        if self.state.is_empty() {
            self.state = params
                .iter()
                .map(|p| p.adam_state())
                .collect::<Result<_>>()?;
        }
        if self.state.len() != params.len() {
            return Err(crate::Error::InvalidConfig {
                what: "optimizer parameters",
                why: format!(
                    "{} parameters given, {} at the first step",
                    params.len(),
                    self.state.len()
                ),
            });
        }
        self.t = self.t.saturating_add(1);
        for (p, s) in params.into_iter().zip(self.state.iter_mut()) {
            p.adam_step(s, self.hyper, self.t)?;
        }
        Ok(())
    }
}

/// Plain SGD with optional weight decay; each step also zeroes the gradients.
#[derive(Clone, Copy, Debug)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f32,
    /// Weight decay (L2).
    pub weight_decay: f32,
}

impl Sgd {
    /// Updates every parameter from its gradient and zeroes the gradients.
    pub fn step<P: Optimizable>(&self, params: Vec<&mut P>) -> Result<()> {
        params
            .into_iter()
            .try_for_each(|p| p.sgd_step(self.lr, self.weight_decay))
    }
}

/// Host helpers shared by the CPU layers.
pub(crate) mod host {
    use spattn_ops::cpu::Real;

    /// `out[i, h] = ⟨x[i, h, :], att[h, :]⟩`.
    pub fn head_dot<F: Real>(x: &[F], att: &[F], heads: usize, dim: usize) -> Vec<F> {
        x.chunks(dim)
            .enumerate()
            .map(|(p, row)| {
                let a = &att[(p % heads) * dim..][..dim];
                row.iter().zip(a).fold(F::ZERO, |s, (&u, &v)| s + u * v)
            })
            .collect()
    }

    /// `dx[i, h, d] += de[i, h] · att[h, d]` and `datt[h, d] += de[i, h] · x[i, h, d]`.
    pub fn head_dot_backward<F: Real>(
        x: &[F],
        att: &[F],
        de: &[F],
        heads: usize,
        dim: usize,
        dx: &mut [F],
        datt: &mut [F],
    ) {
        for (p, (row, drow)) in x.chunks(dim).zip(dx.chunks_mut(dim)).enumerate() {
            let h = p % heads;
            for d in 0..dim {
                drow[d] = drow[d] + de[p] * att[h * dim + d];
                datt[h * dim + d] = datt[h * dim + d] + de[p] * row[d];
            }
        }
    }

    /// `y += alpha · x`.
    pub fn axpy<F: Real>(alpha: F, x: &[F], y: &mut [F]) {
        for (v, &u) in y.iter_mut().zip(x) {
            *v = *v + alpha * u;
        }
    }
}
