//! The GPU layers (forward, and backward: the input's gradient and every parameter's) against
//! the f64 CPU layers with the same parameters (rounded to the GPU dtype), on cora and on a
//! random graph with an empty row and a hub row, f32 / f16 / bf16, heads 1 / 4 / 8.
//!
//! Tolerances (rel L2): the forward's are DESIGN.md's (f32 1e-5, f16 5e-3, bf16 2e-2) times a
//! small factor for the two chained GEMMs; the gradients' are looser — they chain a GEMM, the
//! attention backward and a second GEMM, with the intermediates Wh and dWh stored in the layer's
//! dtype (the per-node dS row sums stay f32), and GAT's attention-vector gradients are sums over
//! all nodes with cancellation — f32 1e-4, f16 5e-2, bf16 2e-1. A
//! gradient that is zero in exact arithmetic is compared against a floor (see `rel_floor`).
//! The measured errors are printed, and each test's seed (replay with SPATTN_SEED).

#[path = "../../ops/tests/common/mod.rs"]
mod common;

use std::sync::Arc;

use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn::layers::{
    AgnnConv, DeviceGraph, GatConfig, GatConv, GpuContext, GraphTransformerLayer, Host, HostGraph,
    HostParam, TransformerConfig,
};
use spattn::Algorithm;
use spattn_formats::{read_matrix_market, Csr};
use spattn_ops::dense::GemmElement;
use spattn_ops::{cpu, DType, DeviceMatrix, Gpu, Shape};

fn cora() -> Csr {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../formats/tests/data/cora.mtx.gz"
    );
    read_matrix_market(path)
        .unwrap()
        .symmetrize_with_self_loops()
        .unwrap()
}

/// 300 nodes: node 0 attends to all, node 1 to none, the rest to ~6 random nodes.
fn random_graph(rng: &mut Pcg64) -> Csr {
    let n = 300u32;
    let mut edges: Vec<(u32, u32)> = (0..n).map(|j| (0, j)).collect();
    for i in 2..n {
        for _ in 0..6 {
            edges.push((i, rng.random_range(0..n)));
        }
    }
    edges.sort_unstable();
    edges.dedup();
    Csr::from_edges(n as usize, n as usize, &edges).unwrap()
}

fn rel<T: DType>(got: &[T], want: &[f64]) -> f64 {
    let wide: Vec<f64> = got.iter().map(|x| x.to_f64()).collect();
    cpu::rel_l2_error(&wide, want)
}

fn tols<T: DType>() -> (f64, f64) {
    match T::NAME {
        "f32" => (2e-5, 1e-4),
        "f16" => (1e-2, 5e-2),
        _ => (4e-2, 2e-1),
    }
}

/// ‖got − want‖ / max(‖want‖, floor): a gradient that is zero in exact arithmetic (the K bias
/// of attention: softmax ignores a per-row constant) is compared in absolute terms against
/// `floor`, 1e-3 (bf16: 4e-3, its unit roundoff) of the largest reference gradient norm of the
/// layer.
fn rel_floor<T: DType>(got: &[T], want: &[f64], floor: f64) -> f64 {
    let norm = want.iter().map(|v| v * v).sum::<f64>().sqrt();
    rel(got, want) * norm.max(f64::MIN_POSITIVE) / norm.max(floor)
}

/// Values drawn in [-1, 1) and rounded to `T` (returned as f64 for the reference).
fn draw<T: DType>(len: usize, rng: &mut Pcg64) -> Vec<f64> {
    (0..len)
        .map(|_| T::from_f64(rng.random_range(-1.0..1.0)).to_f64())
        .collect()
}

fn to_t<T: DType>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::from_f64(v)).collect()
}

/// Perturbs the host parameters and rounds them to `T`, so CPU and GPU layers agree exactly.
fn round_params<T: DType>(params: Vec<&mut HostParam<f64>>, rng: &mut Pcg64) {
    for p in params {
        for v in &mut p.value {
            *v = T::from_f64(*v + rng.random_range(-0.2..0.2)).to_f64();
        }
    }
}

struct Ctx {
    ctx: GpuContext,
}

fn ctx() -> Ctx {
    let gpu = Gpu::new(0).expect("a GPU");
    Ctx {
        ctx: GpuContext::new(&gpu).expect("libcublas"),
    }
}

/// Compares forward output, dx and the parameter gradients; prints the errors.
#[allow(clippy::too_many_arguments)]
fn compare<T: DType>(
    what: &str,
    y: &DeviceMatrix<T>,
    y_ref: &[f64],
    dx: &DeviceMatrix<T>,
    dx_ref: &[f64],
    grads: Vec<(String, Vec<f32>)>,
    grads_ref: Vec<Vec<f64>>,
) {
    let (tf, tg) = tols::<T>();
    let ey = rel(&y.to_host().unwrap(), y_ref);
    let edx = rel(&dx.to_host().unwrap(), dx_ref);
    let mut worst = ("", 0.0f64);
    // bf16's unit roundoff is 2^-8 ≈ 3.9e-3: an exactly-zero gradient accumulated from bf16
    // operands carries absolute noise of that order relative to the layer's other gradients.
    let floor_factor = if T::NAME == "bf16" { 4e-3 } else { 1e-3 };
    let floor = floor_factor
        * grads_ref
            .iter()
            .map(|r| r.iter().map(|v| v * v).sum::<f64>().sqrt())
            .fold(0.0, f64::max);
    for ((name, g), r) in grads.iter().zip(&grads_ref) {
        let e = rel_floor(g, r, floor);
        assert!(
            e <= tg,
            "{what} {}: d{name} rel L2 {e:.2e} > {tg:.0e}",
            T::NAME
        );
        if e >= worst.1 {
            worst = (name.as_str(), e);
        }
    }
    println!(
        "{what} {}: y {ey:.2e}, dx {edx:.2e}, worst parameter gradient d{} {:.2e}",
        T::NAME,
        worst.0,
        worst.1
    );
    assert!(ey <= tf, "{what} {}: y rel L2 {ey:.2e} > {tf:.0e}", T::NAME);
    assert!(
        edx <= tg,
        "{what} {}: dx rel L2 {edx:.2e} > {tg:.0e}",
        T::NAME
    );
}

fn gat_case<T: GemmElement>(c: &Ctx, a: &Csr, heads: usize, concat: bool, rng: &mut Pcg64) {
    let host = HostGraph::new(a).unwrap();
    let dev = DeviceGraph::upload(&c.ctx, &host).unwrap();
    let (n, in_dim, out_dim) = (a.n_rows(), 24, 8);
    let cfg = GatConfig::new(in_dim, out_dim, heads).with_concat(concat);
    let mut cpu_layer = GatConv::<Host<f64>>::new(cfg, &host, rng.random()).unwrap();
    round_params::<T>(cpu_layer.params_mut(), rng);
    let mut gpu_layer = cpu_layer.to_device::<T>(&dev).unwrap();
    let x = draw::<T>(n * in_dim, rng);
    let dy = draw::<T>(n * cfg.output_dim(), rng);
    let (y_ref, cache) = cpu_layer.forward(&x).unwrap();
    let dx_ref = cpu_layer.backward(&cache, &dy).unwrap();
    let gx = DeviceMatrix::from_host(
        c.ctx.gpu(),
        Shape::new(n, 1, in_dim).unwrap(),
        &to_t::<T>(&x),
    )
    .unwrap();
    let (y, gcache) = gpu_layer.forward(&gx).unwrap();
    let gdy = DeviceMatrix::from_host(c.ctx.gpu(), y.shape(), &to_t::<T>(&dy)).unwrap();
    let dx = gpu_layer.backward(&gcache, &gdy).unwrap();
    let grads = gpu_layer
        .params_mut()
        .iter()
        .map(|p| (p.name.to_string(), p.grad.to_host().unwrap()))
        .collect();
    let grads_ref = cpu_layer
        .params_mut()
        .iter()
        .map(|p| p.grad.clone())
        .collect();
    compare(
        &format!("GAT n={n} heads={heads} concat={concat}"),
        &y,
        &y_ref,
        &dx,
        &dx_ref,
        grads,
        grads_ref,
    );
}

fn transformer_case<T: GemmElement>(
    c: &Ctx,
    a: &Csr,
    heads: usize,
    alg: Algorithm,
    rng: &mut Pcg64,
) {
    let host = HostGraph::new(a).unwrap();
    let dev = DeviceGraph::upload(&c.ctx, &host).unwrap();
    let (n, dim, head_dim) = (a.n_rows(), 32, 16);
    let cfg = TransformerConfig::new(dim, heads, head_dim, dim)
        .with_residual(true)
        .with_algorithm(alg);
    let mut cpu_layer = GraphTransformerLayer::<Host<f64>>::new(cfg, &host, rng.random()).unwrap();
    round_params::<T>(cpu_layer.params_mut(), rng);
    let mut gpu_layer = cpu_layer.to_device::<T>(&dev).unwrap();
    let x = draw::<T>(n * dim, rng);
    let dy = draw::<T>(n * dim, rng);
    let (y_ref, cache) = cpu_layer.forward(&x).unwrap();
    let dx_ref = cpu_layer.backward(&cache, &dy).unwrap();
    let gx = DeviceMatrix::from_host(c.ctx.gpu(), Shape::new(n, 1, dim).unwrap(), &to_t::<T>(&x))
        .unwrap();
    let (y, gcache) = gpu_layer.forward(&gx).unwrap();
    let gdy = DeviceMatrix::from_host(c.ctx.gpu(), y.shape(), &to_t::<T>(&dy)).unwrap();
    let dx = gpu_layer.backward(&gcache, &gdy).unwrap();
    let grads = gpu_layer
        .params_mut()
        .iter()
        .map(|p| (p.name.to_string(), p.grad.to_host().unwrap()))
        .collect();
    let grads_ref = cpu_layer
        .params_mut()
        .iter()
        .map(|p| p.grad.clone())
        .collect();
    compare(
        &format!(
            "transformer n={n} heads={heads} {}",
            gpu_layer.plan().algorithm()
        ),
        &y,
        &y_ref,
        &dx,
        &dx_ref,
        grads,
        grads_ref,
    );
}

fn agnn_case<T: GemmElement>(c: &Ctx, a: &Csr, dim: usize, rng: &mut Pcg64) {
    let host = HostGraph::new(a).unwrap();
    let dev = DeviceGraph::upload(&c.ctx, &host).unwrap();
    let n = a.n_rows();
    let mut cpu_layer = AgnnConv::<Host<f64>>::new(dim, &host, Algorithm::Auto).unwrap();
    cpu_layer.beta.value[0] = T::from_f64(rng.random_range(0.5..3.0)).to_f64();
    let mut gpu_layer = cpu_layer.to_device::<T>(&dev).unwrap();
    let x = draw::<T>(n * dim, rng);
    let dy = draw::<T>(n * dim, rng);
    let (y_ref, cache) = cpu_layer.forward(&x).unwrap();
    let dx_ref = cpu_layer.backward(&cache, &dy).unwrap();
    let gx = DeviceMatrix::from_host(c.ctx.gpu(), Shape::new(n, 1, dim).unwrap(), &to_t::<T>(&x))
        .unwrap();
    let (y, gcache) = gpu_layer.forward(&gx).unwrap();
    let gdy = DeviceMatrix::from_host(c.ctx.gpu(), y.shape(), &to_t::<T>(&dy)).unwrap();
    let dx = gpu_layer.backward(&gcache, &gdy).unwrap();
    let grads = vec![("beta".to_string(), gpu_layer.beta.grad.to_host().unwrap())];
    let grads_ref = vec![cpu_layer.beta.grad.clone()];
    compare(
        &format!("AGNN n={n} dim={dim} {}", gpu_layer.plan().algorithm()),
        &y,
        &y_ref,
        &dx,
        &dx_ref,
        grads,
        grads_ref,
    );
}

fn graphs(rng: &mut Pcg64) -> Vec<Arc<Csr>> {
    vec![Arc::new(cora()), Arc::new(random_graph(rng))]
}

fn all_gat<T: GemmElement>(c: &Ctx, rng: &mut Pcg64) {
    for a in graphs(rng) {
        for heads in [1, 4, 8] {
            for concat in [true, false] {
                gat_case::<T>(c, &a, heads, concat, rng);
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gat_matches_the_f64_cpu_layer() {
    let c = ctx();
    let mut rng = common::fresh_rng("gat_matches_the_f64_cpu_layer");
    all_gat::<f32>(&c, &mut rng);
    all_gat::<f16>(&c, &mut rng);
    all_gat::<bf16>(&c, &mut rng);
}

fn all_transformer<T: GemmElement>(c: &Ctx, rng: &mut Pcg64, algs: &[Algorithm]) {
    for a in graphs(rng) {
        for heads in [1, 4, 8] {
            for &alg in algs {
                transformer_case::<T>(c, &a, heads, alg, rng);
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn transformer_matches_the_f64_cpu_layer() {
    let c = ctx();
    let mut rng = common::fresh_rng("transformer_matches_the_f64_cpu_layer");
    let exact = [Algorithm::Auto, Algorithm::UnfusedCsr, Algorithm::FusedCsr];
    all_transformer::<f32>(&c, &mut rng, &exact);
    let half = [
        Algorithm::Auto,
        Algorithm::UnfusedCsr,
        Algorithm::FusedCsr,
        Algorithm::FusedTensorCore,
    ];
    all_transformer::<f16>(&c, &mut rng, &half);
    all_transformer::<bf16>(&c, &mut rng, &half);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn agnn_matches_the_f64_cpu_layer() {
    let c = ctx();
    let mut rng = common::fresh_rng("agnn_matches_the_f64_cpu_layer");
    for a in graphs(&mut rng) {
        for dim in [1, 17, 64] {
            agnn_case::<f32>(&c, &a, dim, &mut rng);
            agnn_case::<f16>(&c, &a, dim, &mut rng);
            agnn_case::<bf16>(&c, &a, dim, &mut rng);
        }
    }
}
