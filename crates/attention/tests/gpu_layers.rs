//! The GPU layers (forward, and backward: the input's gradient and every parameter's) against
//! the f64 CPU layers with the same parameters (rounded to the GPU dtype), on cora and on a
//! random graph with an empty row and a hub row, f32 / f16 / bf16, heads 1 / 4 / 8.
//!
//! Tolerances (rel L2): the forward's are docs/kernels/README.md's (f32 1e-5, f16 5e-3, bf16
//! 2e-2) times a small factor for the two chained GEMMs; the gradients' are looser — they chain
//! a GEMM, the attention backward and a second GEMM, with the intermediates Wh and dWh stored in
//! the layer's dtype (the per-node dS row sums stay f32) — f32 1e-4, f16 5e-2, bf16 2e-1. A
//! gradient that is zero in exact arithmetic is compared against a floor (see `rel_floor`).
//! GAT's attention-vector gradients have no fixed relative tolerance: they are checked against
//! the gradient of the values the GPU layer stored, within a bound on f32 arithmetic (see
//! `check_gat_attention`).
//! The measured errors are printed, and each test's seed (replay with SPATTN_SEED).

use std::sync::Arc;

use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn::layers::{
    AgnnConv, Device, DeviceParam, GatConfig, GatConv, GpuContext, GpuGraph, GraphTransformerLayer,
    Host, HostGraph, HostParam, TransformerConfig,
};
use spattn::Algorithm;
use spattn_formats::{read_matrix_market, Csr};
use spattn_ops::backward::GatKernels;
use spattn_ops::GemmElement;
use spattn_ops::{cpu, edge_extras, elementwise, DType, DeviceMatrix, DeviceVec, Gpu, Shape};

fn cora() -> Csr {
    read_matrix_market(spattn_test_support::cora_path())
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

/// 3,000 nodes attending to ~90 random nodes and themselves: past
/// `GatKernels::ROWS_SMALL_MAX_EDGES` (and `GatKernels::FUSED_MAX_EDGES`), so a one-head GAT layer
/// takes the composed steps.
fn larger_graph(rng: &mut Pcg64) -> Csr {
    let n = 3000u32;
    let per = GatKernels::ROWS_SMALL_MAX_EDGES / n as usize + 4;
    let mut edges: Vec<(u32, u32)> = (0..n).map(|i| (i, i)).collect();
    for i in 0..n {
        for _ in 0..per {
            edges.push((i, rng.random_range(0..n)));
        }
    }
    edges.sort_unstable();
    edges.dedup();
    let a = Csr::from_edges(n as usize, n as usize, &edges).unwrap();
    assert!(a.nnz() > GatKernels::ROWS_SMALL_MAX_EDGES && a.nnz() > GatKernels::FUSED_MAX_EDGES);
    a
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
/// `floor`, 1e-3 (f16: 2e-3, bf16: 4e-3, a few unit roundoffs) of the largest reference
/// gradient norm of the layer.
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

/// Runs the f64 CPU layer `$cpu` and the GPU layer `$gpu` forward on `$x` (`n × $in_dim`, the
/// GPU's input rounded to its dtype) and backward on `$dy`: `(gx, y, y_ref, dx, dx_ref)` with
/// `gx` the GPU's input. A macro: the three layer types share no trait.
macro_rules! forward_backward {
    ($c:expr, $cpu:expr, $gpu:expr, $x:expr, $dy:expr, $in_dim:expr) => {{
        let (y_ref, cache) = $cpu.forward(&$x).unwrap();
        let dx_ref = $cpu.backward(&cache, &$dy).unwrap();
        let rows = $x.len() / $in_dim;
        let shape = Shape::new(rows, 1, $in_dim).unwrap();
        let gx = DeviceMatrix::from_host($c.ctx.gpu(), shape, &to_t(&$x)).unwrap();
        let (y, gcache) = $gpu.forward(&gx).unwrap();
        let gdy = DeviceMatrix::from_host($c.ctx.gpu(), y.shape(), &to_t(&$dy)).unwrap();
        let dx = $gpu.backward(&gcache, &gdy).unwrap();
        (gx, y, y_ref, dx, dx_ref)
    }};
}

/// Each GPU parameter's name and gradient, in order.
fn device_grads<T: DType>(params: Vec<&mut DeviceParam<T>>) -> Vec<(String, Vec<f32>)> {
    params
        .iter()
        .map(|p| (p.name.to_string(), p.grad.to_host().unwrap()))
        .collect()
}

/// Each CPU parameter's gradient, in order.
fn host_grads(params: Vec<&mut HostParam<f64>>) -> Vec<Vec<f64>> {
    params.iter().map(|p| p.grad.clone()).collect()
}

/// Compares forward output, dx and the parameter gradients; prints the errors. The gradients
/// named in `checked_elsewhere` still count towards the floor but are not compared here.
#[allow(clippy::too_many_arguments)]
fn compare<T: DType>(
    what: &str,
    y: &DeviceMatrix<T>,
    y_ref: &[f64],
    dx: &DeviceMatrix<T>,
    dx_ref: &[f64],
    grads: &[(String, Vec<f32>)],
    grads_ref: &[Vec<f64>],
    checked_elsewhere: &[&str],
) {
    let (tf, tg) = tols::<T>();
    let ey = rel(&y.to_host().unwrap(), y_ref);
    let edx = rel(&dx.to_host().unwrap(), dx_ref);
    let mut worst = ("", 0.0f64);
    // An exactly-zero gradient (the K bias) summed from n rounded rows carries absolute noise of
    // a few unit roundoffs relative to the layer's other gradients: bf16's is 2^-8 ≈ 3.9e-3,
    // f16's 2^-11 ≈ 4.9e-4 (at 1e-3, about 2 of them, a 300-node graph reached 6.0e-2 of it).
    let floor_factor = match T::NAME {
        "bf16" => 4e-3,
        "f16" => 2e-3,
        _ => 1e-3,
    };
    let floor = floor_factor
        * grads_ref
            .iter()
            .map(|r| r.iter().map(|v| v * v).sum::<f64>().sqrt())
            .fold(0.0, f64::max);
    for ((name, g), r) in grads.iter().zip(grads_ref) {
        if checked_elsewhere.contains(&name.as_str()) {
            continue;
        }
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

/// GAT against the f64 layer: output, dx and the parameters; without dropout also every
/// gradient against the f64 recomputation from the GPU's stored values (`check_gat_attention`).
/// With `rate`, both layers draw the same masks (the device layer copies the host's dropout
/// state).
fn gat_case<T: GemmElement>(
    c: &Ctx,
    a: &Csr,
    (heads, concat, rate): (usize, bool, f32),
    rng: &mut Pcg64,
) {
    let host = HostGraph::new(a).unwrap();
    let dev = GpuGraph::upload(&c.ctx, &host).unwrap();
    let (n, in_dim, out_dim) = (a.n_rows(), 24, 8);
    let cfg = GatConfig::new(in_dim, out_dim, heads)
        .with_concat(concat)
        .with_dropout(rate);
    // Inputs whose scores keep clear of LeakyReLU's kink (drawn again otherwise; see
    // `near_kink`): there the derivative jumps, and f32 and f64 may take opposite sides.
    let (mut cpu_layer, x) = loop {
        let mut layer = GatConv::<Host<f64>>::new(cfg, &host, rng.random()).unwrap();
        round_params::<T>(layer.params_mut(), rng);
        let x = draw::<T>(n * in_dim, rng);
        if !near_kink::<T>(a, &layer, &x, None) {
            break (layer, x);
        }
    };
    let mut gpu_layer = cpu_layer.to_device::<T>(&dev).unwrap();
    let dy = draw::<T>(n * cfg.output_dim(), rng);
    let (gx, y, y_ref, dx, dx_ref) = forward_backward!(c, cpu_layer, gpu_layer, x, dy, in_dim);
    let (grads, grads_ref) = (
        device_grads(gpu_layer.params_mut()),
        host_grads(cpu_layer.params_mut()),
    );
    let what = format!("GAT n={n} heads={heads} concat={concat} dropout={rate}");
    compare(
        &what,
        &y,
        &y_ref,
        &dx,
        &dx_ref,
        &grads,
        &grads_ref,
        &["weight", "att_src", "att_dst"],
    );
    if rate > 0.0 {
        return; // the recomputation below has no dropout
    }
    let got = |name: &str| -> Vec<f64> {
        let (_, g) = grads
            .iter()
            .find(|(n, _)| n == name)
            .expect("a GAT parameter");
        g.iter().map(|&v| f64::from(v)).collect()
    };
    check_gat_attention(
        &what,
        c,
        a,
        &cpu_layer,
        &gpu_layer,
        &gx,
        &x,
        &dy,
        [got("att_src"), got("att_dst")],
        &got("weight"),
    );
}

/// GAT with edge features, f32: output, dx and the parameters against the f64 layer; the
/// attention vectors (sums that cancel) at 1e-4.
fn gat_edges_case(c: &Ctx, a: &Csr, heads: usize, rng: &mut Pcg64) {
    let host = HostGraph::new(a).unwrap();
    let dev = GpuGraph::upload(&c.ctx, &host).unwrap();
    let (n, in_dim, out_dim, edge_dim) = (a.n_rows(), 24, 8, 5);
    let cfg = GatConfig::new(in_dim, out_dim, heads).with_edge_dim(edge_dim);
    // Inputs clear of LeakyReLU's kink, the edge term included (see `near_kink`).
    let (mut cpu_layer, x, f) = loop {
        let mut layer = GatConv::<Host<f64>>::new(cfg, &host, rng.random()).unwrap();
        round_params::<f32>(layer.params_mut(), rng);
        let x = draw::<f32>(n * in_dim, rng);
        let f = draw::<f32>(a.nnz() * edge_dim, rng);
        let (lin, att) = layer.edge.as_ref().expect("a layer with edge features");
        let proj = lin.forward(&f, a.nnz()).unwrap();
        let bias = head_dot_with(&proj, &att.value, heads, out_dim, |v, w| v * w);
        if !near_kink::<f32>(a, &layer, &x, Some(&bias)) {
            break (layer, x, f);
        }
    };
    let mut gpu_layer = cpu_layer.to_device::<f32>(&dev).unwrap();
    let dy = draw::<f32>(n * cfg.output_dim(), rng);
    let (y_ref, cache) = cpu_layer.forward_with_edges(&x, &f).unwrap();
    let (dx_ref, df_ref) = cpu_layer.backward_with_edges(&cache, &dy).unwrap();
    let gpu = c.ctx.gpu();
    let gx =
        DeviceMatrix::from_host(gpu, Shape::new(n, 1, in_dim).unwrap(), &to_t::<f32>(&x)).unwrap();
    let gf = DeviceMatrix::from_host(
        gpu,
        Shape::new(a.nnz(), 1, edge_dim).unwrap(),
        &to_t::<f32>(&f),
    )
    .unwrap();
    let (y, gcache) = gpu_layer.forward_with_edges(&gx, &gf).unwrap();
    let gdy = DeviceMatrix::from_host(gpu, y.shape(), &to_t::<f32>(&dy)).unwrap();
    let (dx, df) = gpu_layer.backward_with_edges(&gcache, &gdy).unwrap();
    let (grads, grads_ref) = (
        device_grads(gpu_layer.params_mut()),
        host_grads(cpu_layer.params_mut()),
    );
    let what = format!("GAT with edge features n={n} heads={heads}");
    let e = rel(&df.unwrap().to_host().unwrap(), &df_ref.unwrap());
    assert!(e <= 1e-4, "{what}: d_edge_attr rel L2 {e:.2e}");
    let vectors = ["att_src", "att_dst", "att_edge"];
    compare(
        &what, &y, &y_ref, &dx, &dx_ref, &grads, &grads_ref, &vectors,
    );
    for ((name, g), r) in grads.iter().zip(&grads_ref) {
        if vectors.contains(&name.as_str()) {
            let e = rel(g, r);
            assert!(e <= 1e-4, "{what}: d{name} rel L2 {e:.2e}");
        }
    }
}

fn transformer_case<T: GemmElement>(
    c: &Ctx,
    a: &Csr,
    heads: usize,
    alg: Algorithm,
    rng: &mut Pcg64,
) {
    let host = HostGraph::new(a).unwrap();
    let dev = GpuGraph::upload(&c.ctx, &host).unwrap();
    let (n, dim, head_dim) = (a.n_rows(), 32, 16);
    let cfg = TransformerConfig::new(dim, heads, head_dim, dim)
        .with_residual(true)
        .with_algorithm(alg);
    let mut cpu_layer = GraphTransformerLayer::<Host<f64>>::new(cfg, &host, rng.random()).unwrap();
    round_params::<T>(cpu_layer.params_mut(), rng);
    let mut gpu_layer = cpu_layer.to_device::<T>(&dev).unwrap();
    let x = draw::<T>(n * dim, rng);
    let dy = draw::<T>(n * dim, rng);
    let (_, y, y_ref, dx, dx_ref) = forward_backward!(c, cpu_layer, gpu_layer, x, dy, dim);
    let (grads, grads_ref) = (
        device_grads(gpu_layer.params_mut()),
        host_grads(cpu_layer.params_mut()),
    );
    compare(
        &format!(
            "transformer n={n} heads={heads} {}",
            gpu_layer.plan().algorithm()
        ),
        &y,
        &y_ref,
        &dx,
        &dx_ref,
        &grads,
        &grads_ref,
        &[],
    );
}

/// The transformer with a per-edge bias (per head, or shared) and a fixed dropout mask: the
/// output, dx, every parameter's gradient and the bias's against the f64 CPU layer.
fn transformer_extras_case<T: GemmElement>(c: &Ctx, a: &Csr, shared: bool, rng: &mut Pcg64) {
    let host = HostGraph::new(a).unwrap();
    let dev = GpuGraph::upload(&c.ctx, &host).unwrap();
    let (n, dim, heads, head_dim) = (a.n_rows(), 32, 4, 16);
    let cfg = TransformerConfig::new(dim, heads, head_dim, dim)
        .with_residual(true)
        .with_dropout(0.25)
        .with_edge_bias(true);
    let mut cpu_layer = GraphTransformerLayer::<Host<f64>>::new(cfg, &host, rng.random()).unwrap();
    round_params::<T>(cpu_layer.params_mut(), rng);
    let mut gpu_layer = cpu_layer.to_device::<T>(&dev).unwrap();
    let x = draw::<T>(n * dim, rng);
    let dy = draw::<T>(n * dim, rng);
    let bias = draw::<T>(if shared { a.nnz() } else { a.nnz() * heads }, rng);
    let drop = spattn::Dropout::new(0.25, rng.random(), 3).unwrap();
    let (y_ref, cache) = cpu_layer
        .forward_full(&x, Some((&bias, shared)), Some(drop))
        .unwrap();
    let (dx_ref, db_ref) = cpu_layer
        .backward_with(&cache, &dy, Some((&bias, shared)))
        .unwrap();
    let gpu = c.ctx.gpu();
    let gx = DeviceMatrix::from_host(gpu, Shape::new(n, 1, dim).unwrap(), &to_t(&x)).unwrap();
    let gb = DeviceVec::from_host(gpu, &to_t::<T>(&bias)).unwrap();
    let db = || {
        if shared {
            spattn::DeviceBias::Shared(&gb)
        } else {
            spattn::DeviceBias::PerHead(&gb)
        }
    };
    let (y, gcache) = gpu_layer.forward_full(&gx, Some(db()), Some(drop)).unwrap();
    let gdy = DeviceMatrix::from_host(gpu, y.shape(), &to_t(&dy)).unwrap();
    let (dx, d_bias) = gpu_layer.backward_with(&gcache, &gdy, Some(db())).unwrap();
    let what = format!("transformer+bias(shared={shared})+dropout n={n}");
    compare(
        &what,
        &y,
        &y_ref,
        &dx,
        &dx_ref,
        &device_grads(gpu_layer.params_mut()),
        &host_grads(cpu_layer.params_mut()),
        &[],
    );
    let (_, tg) = tols::<T>();
    let e = rel(&d_bias.unwrap().to_host().unwrap(), &db_ref.unwrap());
    println!("{what} {}: d_bias {e:.2e}", T::NAME);
    assert!(
        e <= tg,
        "{what} {}: d_bias rel L2 {e:.2e} > {tg:.0e}",
        T::NAME
    );
}

fn agnn_case<T: GemmElement>(c: &Ctx, a: &Csr, dim: usize, rng: &mut Pcg64) {
    let host = HostGraph::new(a).unwrap();
    let dev = GpuGraph::upload(&c.ctx, &host).unwrap();
    let n = a.n_rows();
    let mut cpu_layer = AgnnConv::<Host<f64>>::new(dim, &host, Algorithm::Auto).unwrap();
    cpu_layer.beta.value[0] = T::from_f64(rng.random_range(0.5..3.0)).to_f64();
    let mut gpu_layer = cpu_layer.to_device::<T>(&dev).unwrap();
    let x = draw::<T>(n * dim, rng);
    let dy = draw::<T>(n * dim, rng);
    let (_, y, y_ref, dx, dx_ref) = forward_backward!(c, cpu_layer, gpu_layer, x, dy, dim);
    let grads = vec![("beta".to_string(), gpu_layer.beta.grad.to_host().unwrap())];
    let grads_ref = vec![cpu_layer.beta.grad.clone()];
    let what = format!("AGNN n={n} dim={dim} {}", gpu_layer.plan().algorithm());
    compare(
        &what,
        &y,
        &y_ref,
        &dx,
        &dx_ref,
        &grads,
        &grads_ref,
        &["beta"],
    );
    // ∂β = Σ_e dS_e · cos_e is a sum whose terms cancel: besides the dtype's tolerance, allow
    // the rounding a correct implementation in T can have, ROUNDINGS unit roundoffs of the
    // terms' L2 norm (as the Python layer tests bound ill-conditioned gradients).
    let (got, want) = (f64::from(grads[0].1[0]), grads_ref[0][0]);
    let terms = agnn_beta_terms(a, &x, &dy, dim, cpu_layer.beta.value[0]);
    let allowed = (tols::<T>().1 * want.abs()).max(ROUNDINGS * unit_roundoff::<T>() * terms);
    println!(
        "{what} {}: dbeta {got:.6e} vs {want:.6e} (terms' L2 {terms:.3e}), allowed ±{allowed:.1e}",
        T::NAME
    );
    assert!(
        (got - want).abs() <= allowed,
        "{what} {}: dbeta {got:.6e} vs {want:.6e}, allowed ±{allowed:.1e}",
        T::NAME
    );
}

/// Roundings allowed per term of a cancelling gradient (the Python GPU tests' `ROUNDINGS`).
const ROUNDINGS: f64 = 8.0;

/// `√(Σ_e (dS_e · cos_e)²)` of AGNN's `∂β` in f64 (`x̂` the rows normalised, `cos_e = ⟨x̂_i,
/// x̂_j⟩`, `P = softmax_row(β cos)`, `dP_e = ⟨dy_i, x_j⟩`, `dS = P (dP − Σ_row P dP)`): the
/// scale of the rounding error of a sum whose terms cancel.
fn agnn_beta_terms(a: &Csr, x: &[f64], dy: &[f64], dim: usize, beta: f64) -> f64 {
    let row = |m: &[f64], i: usize| -> Vec<f64> { m[i * dim..(i + 1) * dim].to_vec() };
    let dot = |u: &[f64], v: &[f64]| -> f64 { u.iter().zip(v).map(|(p, q)| p * q).sum() };
    let unit = |i: usize| -> Vec<f64> {
        let r = row(x, i);
        let norm = dot(&r, &r).sqrt().max(1e-12);
        r.iter().map(|v| v / norm).collect()
    };
    let mut total = 0.0;
    for i in 0..a.n_rows() {
        let cols = a.row(i);
        if cols.is_empty() {
            continue;
        }
        let xi = unit(i);
        let cos: Vec<f64> = cols.iter().map(|&j| dot(&xi, &unit(j as usize))).collect();
        let m = cos.iter().fold(f64::NEG_INFINITY, |m, &c| m.max(beta * c));
        let e: Vec<f64> = cos.iter().map(|&c| (beta * c - m).exp()).collect();
        let l: f64 = e.iter().sum();
        let dyi = row(dy, i);
        let dp: Vec<f64> = cols
            .iter()
            .map(|&j| dot(&dyi, &row(x, j as usize)))
            .collect();
        let d: f64 = e.iter().zip(&dp).map(|(p, q)| p / l * q).sum();
        total += e
            .iter()
            .zip(&dp)
            .zip(&cos)
            .map(|((p, q), c)| (p / l * (q - d) * c).powi(2))
            .sum::<f64>();
    }
    total.sqrt()
}

fn graphs(rng: &mut Pcg64) -> Vec<Arc<Csr>> {
    vec![Arc::new(cora()), Arc::new(random_graph(rng))]
}

fn all_gat<T: GemmElement>(c: &Ctx, rng: &mut Pcg64) {
    for a in graphs(rng) {
        for heads in [1, 4, 8] {
            for concat in [true, false] {
                gat_case::<T>(c, &a, (heads, concat, 0.0), rng);
            }
            // Dropout: the fused backward at 1 head (these graphs are small), the rows
            // kernels' masks at 4 and 8.
            gat_case::<T>(c, &a, (heads, true, 0.3), rng);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gat_matches_the_f64_cpu_layer() {
    let c = ctx();
    let mut rng = spattn_test_support::fresh_rng("gat_matches_the_f64_cpu_layer");
    all_gat::<f32>(&c, &mut rng);
    all_gat::<f16>(&c, &mut rng);
    all_gat::<bf16>(&c, &mut rng);
}

/// One head past the fused backward's edges: the composed steps, with and without dropout (a
/// test of its own, so that a sanitizer can run these launches alone).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gat_past_the_fused_backward_matches_the_f64_cpu_layer() {
    let c = ctx();
    let mut rng =
        spattn_test_support::fresh_rng("gat_past_the_fused_backward_matches_the_f64_cpu_layer");
    let a = larger_graph(&mut rng);
    for rate in [0.0, 0.3] {
        gat_case::<f32>(&c, &a, (1, rate == 0.0, rate), &mut rng);
        gat_case::<f16>(&c, &a, (1, rate == 0.0, rate), &mut rng);
        gat_case::<bf16>(&c, &a, (1, rate == 0.0, rate), &mut rng);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gat_with_edge_features_matches_the_f64_cpu_layer() {
    let c = ctx();
    let mut rng =
        spattn_test_support::fresh_rng("gat_with_edge_features_matches_the_f64_cpu_layer");
    for a in graphs(&mut rng) {
        for heads in [1, 4] {
            gat_edges_case(&c, &a, heads, &mut rng);
        }
    }
    // The composed backward's bias gradient (one head past the fused backward's edges).
    gat_edges_case(&c, &larger_graph(&mut rng), 1, &mut rng);
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
    let mut rng = spattn_test_support::fresh_rng("transformer_matches_the_f64_cpu_layer");
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
fn transformer_with_edge_bias_and_dropout_matches_the_f64_cpu_layer() {
    let c = ctx();
    let mut rng = spattn_test_support::fresh_rng(
        "transformer_with_edge_bias_and_dropout_matches_the_f64_cpu_layer",
    );
    for a in graphs(&mut rng) {
        for shared in [false, true] {
            transformer_extras_case::<f32>(&c, &a, shared, &mut rng);
            transformer_extras_case::<f16>(&c, &a, shared, &mut rng);
            transformer_extras_case::<bf16>(&c, &a, shared, &mut rng);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn agnn_matches_the_f64_cpu_layer() {
    let c = ctx();
    let mut rng = spattn_test_support::fresh_rng("agnn_matches_the_f64_cpu_layer");
    for a in graphs(&mut rng) {
        for dim in [1, 17, 64] {
            agnn_case::<f32>(&c, &a, dim, &mut rng);
            agnn_case::<f16>(&c, &a, dim, &mut rng);
            agnn_case::<bf16>(&c, &a, dim, &mut rng);
        }
    }
}

// ---- GAT's attention-vector and weight gradients ----------------------------------------------
//
// da_dst[h] = Σ_i de_dst[i,h]·Wh[i,h] with de_dst[i,h] = Σ_j dS_ij, dS_ij = λ_ij·P_ij·(dP_ij −
// Σ_k P_ik·dP_ik) and λ_ij = LeakyReLU'(S_ij) (1, or the slope where S_ij < 0); da_src the same
// over Aᵀ. Both are sums over every node whose terms cancel twice (within each softmax row and
// across nodes), so their error relative to their own norm has no fixed bound. Worse, λ jumps at
// S = 0: the GPU layer stores Wh and the logits e_dst, e_src (S_ij = e_dst[i] + e_src[j]) in the
// layer's dtype, and a score within that rounding of zero takes the other branch than in exact
// arithmetic, which changes dS_ij by (1 − slope)·|P_ij·(dP_ij − Σ_k P_ik·dP_ik)|. f16/bf16 runs
// have several such edges, each enough to move da_dst well past the unit roundoff
// (docs/kernels/layers.md, "Measured"), so no bound linear in it holds either. The check
// therefore splits the error:
//
//   got − exact = (stored − exact) + (got − stored)
//
// `stored` is the f64 gradient recomputed from the very values the GPU layer stored (its Wh and
// logits, recomputed with the layer's own public GEMM and head_dot on the same input), so it takes
// the GPU's branches; `stored − exact` is the storage format's error (printed, not a kernel's
// doing). The stored values are first checked componentwise to be correct roundings of the exact
// ones. What the backward kernels add, `got − stored`, is f32 arithmetic on the same branches,
// and is checked against its first-order componentwise bound (see `f32_error_bound`).
//
// dW = Xᵀ·dWh, dWh_j = Σ_i P_ij·dAgg_i + de_src[j]·a_src + de_dst[j]·a_dst, carries the same
// de terms, so the same split applies to it: its `got − stored` (f32 arithmetic, and dWh rounded
// to the dtype before the GEMM) is held to a few unit roundoffs of the dtype. (A flat bound on
// `got − exact` failed once: f16, n = 300 with a 300-edge hub row, 5.14e-2 > 5e-2, of which
// the storage 5.14e-2 and the rest 3.7e-4.)

/// Unit roundoff of f32.
const U32: f64 = 1.0 / (1u64 << 24) as f64;

/// The unit roundoff of `T`: f32 2^-24, f16 2^-11, bf16 2^-8.
fn unit_roundoff<T: DType>() -> f64 {
    match T::NAME {
        "f32" => U32,
        "f16" => 2f64.powi(-11),
        _ => 2f64.powi(-8),
    }
}

/// The absolute rounding error of `T` below its normal range (half the subnormal spacing).
fn underflow_error<T: DType>() -> f64 {
    match T::NAME {
        "f32" => 2f64.powi(-150),
        "f16" => 2f64.powi(-25),
        _ => 2f64.powi(-134),
    }
}

/// γ_m = m·u / (1 − m·u) for f32 (Higham, Accuracy and Stability of Numerical Algorithms, §3.1):
/// the relative bound of an f32 sum or dot product of `m` terms, in any order.
fn gamma32(m: usize) -> f64 {
    let mu = m as f64 * U32;
    mu / (1.0 - mu)
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

fn dist(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt()
}

/// Whether some edge's score (per head, from the f64 layer's `Wh`, attention vectors and, where
/// given, edge term `bias` in A's CSR order) lies within rounding of LeakyReLU's kink at 0: there
/// the derivative jumps from 1 to the slope, so a GPU in `T` and the f64 layer may take opposite
/// sides and disagree on that edge's dS by `1 − slope` of it. The margin scales with the
/// products the scores sum (`Σ_d |Wh · a|`). Half precision's tolerances cover one such edge;
/// f32's do not.
fn near_kink<T: DType>(
    a: &Csr,
    layer: &GatConv<Host<f64>>,
    x: &[f64],
    bias: Option<&[f64]>,
) -> bool {
    if T::NAME != "f32" {
        return false;
    }
    let cfg = *layer.config();
    let (heads, dim) = (cfg.heads, cfg.out_dim);
    let wh = layer.lin.forward(x, a.n_rows()).unwrap();
    let (att_dst, att_src) = (&layer.att_dst.value, &layer.att_src.value);
    let e_dst = head_dot_with(&wh, att_dst, heads, dim, |v, w| v * w);
    let e_src = head_dot_with(&wh, att_src, heads, dim, |v, w| v * w);
    let m_dst = head_dot_with(&wh, att_dst, heads, dim, |v, w| (v * w).abs());
    let m_src = head_dot_with(&wh, att_src, heads, dim, |v, w| (v * w).abs());
    let mut e = 0;
    for i in 0..a.n_rows() {
        for &j in a.row(i) {
            let j = j as usize;
            for h in 0..heads {
                let b = bias.map_or(0.0, |b| b[e * heads + h]);
                let s = e_dst[i * heads + h] + e_src[j * heads + h] + b;
                let scale = m_dst[i * heads + h] + m_src[j * heads + h] + b.abs();
                if s.abs() <= 1e-5 * scale {
                    return true;
                }
            }
            e += 1;
        }
    }
    false
}

/// `out[i, h] = Σ_d f(x[i, h, d], att[h, d])` for `x` of `n × heads × dim`.
fn head_dot_with(
    x: &[f64],
    att: &[f64],
    heads: usize,
    dim: usize,
    f: impl Fn(f64, f64) -> f64,
) -> Vec<f64> {
    x.chunks(dim)
        .enumerate()
        .map(|(ih, row)| {
            let a = &att[(ih % heads) * dim..][..dim];
            row.iter().zip(a).map(|(&v, &w)| f(v, w)).sum()
        })
        .collect()
}

/// GAT's backward as far as the attention vectors' gradients, in f64 with plain loops over the
/// CSR, from given Wh (`n × heads × dim`), logits e_dst / e_src (`n × heads`) and aggregation
/// gradient dAgg (`n × heads × dim`). Keeps what [`f32_error_bound`](Self::f32_error_bound)
/// reads. Edge values are `edge · heads + h`, as in the layer.
struct GatAttention {
    heads: usize,
    dim: usize,
    wh: Vec<f64>,
    d_agg: Vec<f64>,
    /// LeakyReLU(S) and LeakyReLU'(S) per edge and head.
    l: Vec<f64>,
    lambda: Vec<f64>,
    /// The row max of `l`, per node and head.
    m: Vec<f64>,
    p: Vec<f64>,
    dp: Vec<f64>,
    /// Σ_k P_ik·dP_ik, per node and head.
    r: Vec<f64>,
    de_dst: Vec<f64>,
    de_src: Vec<f64>,
    d_att_src: Vec<f64>,
    d_att_dst: Vec<f64>,
    /// dWh = Aᵀ-weighted dAgg plus the logits' share, `n × heads × dim`.
    d_wh: Vec<f64>,
}

impl GatAttention {
    #[allow(clippy::too_many_arguments)]
    fn new(
        a: &Csr,
        wh: Vec<f64>,
        (e_dst, e_src): (&[f64], &[f64]),
        (att_dst, att_src): (&[f64], &[f64]),
        d_agg: Vec<f64>,
        heads: usize,
        dim: usize,
        slope: f64,
    ) -> Self {
        let n = a.n_rows();
        let len = a.nnz() * heads;
        let cols = a.col_indices();
        let (mut l, mut lambda) = (vec![0.0; len], vec![0.0; len]);
        let (mut p, mut dp) = (vec![0.0; len], vec![0.0; len]);
        let (mut m, mut r) = (vec![0.0; n * heads], vec![0.0; n * heads]);
        let (mut de_dst, mut de_src) = (vec![0.0; n * heads], vec![0.0; n * heads]);
        let mut d_wh = vec![0.0; n * heads * dim];
        for i in 0..n {
            let edges = a.row_range(i);
            if edges.is_empty() {
                continue;
            }
            for h in 0..heads {
                let ih = i * heads + h;
                let mut max = f64::NEG_INFINITY;
                for e in edges.clone() {
                    let (k, j) = (e * heads + h, cols[e] as usize);
                    let s = e_dst[ih] + e_src[j * heads + h];
                    // The layer's convention (CPU and GPU): the slope where S < 0.
                    lambda[k] = if s < 0.0 { slope } else { 1.0 };
                    l[k] = lambda[k] * s;
                    max = max.max(l[k]);
                }
                m[ih] = max;
                let mut sum = 0.0;
                for e in edges.clone() {
                    let k = e * heads + h;
                    p[k] = (l[k] - max).exp();
                    sum += p[k];
                }
                let da = &d_agg[ih * dim..][..dim];
                let mut ri = 0.0;
                for e in edges.clone() {
                    let (k, j) = (e * heads + h, cols[e] as usize);
                    p[k] /= sum;
                    let whj = &wh[(j * heads + h) * dim..][..dim];
                    dp[k] = da.iter().zip(whj).map(|(x, y)| x * y).sum();
                    ri += p[k] * dp[k];
                }
                r[ih] = ri;
                for e in edges.clone() {
                    let (k, j) = (e * heads + h, cols[e] as usize);
                    let ds = lambda[k] * p[k] * (dp[k] - ri);
                    de_dst[ih] += ds;
                    de_src[j * heads + h] += ds;
                    let dwj = &mut d_wh[(j * heads + h) * dim..][..dim];
                    for (o, &g) in dwj.iter_mut().zip(da) {
                        *o += p[k] * g;
                    }
                }
            }
        }
        let weighted_sum = |de: &[f64]| {
            let mut out = vec![0.0; heads * dim];
            for (ih, row) in wh.chunks(dim).enumerate() {
                let o = &mut out[(ih % heads) * dim..][..dim];
                for (o, &w) in o.iter_mut().zip(row) {
                    *o += de[ih] * w;
                }
            }
            out
        };
        let d_att_src = weighted_sum(&de_src);
        let d_att_dst = weighted_sum(&de_dst);
        for (jh, row) in d_wh.chunks_mut(dim).enumerate() {
            let h = jh % heads;
            let (a_src, a_dst) = (&att_src[h * dim..][..dim], &att_dst[h * dim..][..dim]);
            for ((o, &s), &d) in row.iter_mut().zip(a_src).zip(a_dst) {
                *o += de_src[jh] * s + de_dst[jh] * d;
            }
        }
        Self {
            heads,
            dim,
            wh,
            d_agg,
            l,
            lambda,
            m,
            p,
            dp,
            r,
            de_dst,
            de_src,
            d_att_src,
            d_att_dst,
            d_wh,
        }
    }

    /// The gradient of W (`in_dim × heads·dim`, the layer's layout): Xᵀ·dWh.
    fn d_weight(&self, x: &[f64], in_dim: usize) -> Vec<f64> {
        let cols = self.heads * self.dim;
        let mut out = vec![0.0; in_dim * cols];
        for (xr, gr) in x.chunks(in_dim).zip(self.d_wh.chunks(cols)) {
            for (&xv, or) in xr.iter().zip(out.chunks_mut(cols)) {
                for (o, &g) in or.iter_mut().zip(gr) {
                    *o += xv * g;
                }
            }
        }
        out
    }

    /// Componentwise first-order bounds `[src, dst]` on the error of the GPU backward's f32
    /// arithmetic from these (stored) inputs on: every f32 operation's result carries a relative
    /// error of at most u = 2^-24, a sum or dot product of `m` terms γ_m·Σ|terms| (`gamma32`).
    /// With |·| of the exact intermediates and the row's max m_i:
    ///
    /// ```text
    /// S, L = λS, L − m_i and exp(L − m_i) (__expf): argument errors u·A_ij,
    ///     A_ij = |L_ij| + 2|L_ij − m_i| + 4
    /// δP_ij  = P_ij·(u·A_ij + Σ_k P_ik·u·A_ik + γ_deg + 2u)   (softmax's first-order perturbation,
    ///                                                          its row sum and division)
    /// δdP_ij = γ_dim·Σ_d |dAgg_id|·|Wh_jd|
    /// δR_i   = Σ_k (δP_ik·|dP_ik| + P_ik·δdP_ik) + γ_{deg+1}·Σ_k P_ik·|dP_ik|
    /// δT_ij  = δP_ij·(|dP_ij| + |R_i|) + P_ij·(δdP_ij + δR_i) + u·P_ij·(|dP_ij| + |R_i|) + u·|T_ij|
    /// δdS_ij = |λ_ij|·δT_ij + u·|dS_ij|                         (T = P·(dP − R), dS = λ·T)
    /// δde_i  = Σ_j δdS_ij + γ_deg·Σ_j |dS_ij|                    (over A's row i, or Aᵀ's)
    /// δda    = Σ_i (δde_i + γ_{n+9}·|de_i|)·|Wh_i|               (the weighted column sum: a
    ///                                                            product, then at most n + 8 adds)
    /// ```
    ///
    /// The row-statistics kernels take `R_i = ⟨dAgg_i, out_i⟩` from the forward's output, an
    /// f32 sum rounded to T (`out_unit` = T's unit roundoff where they ran, else 0): with
    /// `g_ik = Σ_d |dAgg_id|·|Wh_kd|`, δR_i grows by `Σ_k ((out_unit + γ_{deg+dim})·P_ik +
    /// δP_ik)·g_ik` (the output's rounding, its sums and its probabilities' errors).
    fn f32_error_bound(&self, a: &Csr, out_unit: f64) -> [Vec<f64>; 2] {
        let (heads, dim, u) = (self.heads, self.dim, U32);
        let n = a.n_rows();
        let cols = a.col_indices();
        let (mut dde_dst, mut dde_src) = (vec![0.0; n * heads], vec![0.0; n * heads]);
        // Σ |dS| over A's rows and over Aᵀ's rows (the in-edges), and Aᵀ's row lengths.
        let (mut abs_dst, mut abs_src) = (vec![0.0; n * heads], vec![0.0; n * heads]);
        let mut in_degree = vec![0usize; n];
        let (mut d_p, mut d_dp) = (Vec::new(), Vec::new());
        for i in 0..n {
            let edges = a.row_range(i);
            let deg = edges.len();
            for h in 0..heads {
                let ih = i * heads + h;
                let arg =
                    |k: usize| u * (self.l[k].abs() + 2.0 * (self.l[k] - self.m[ih]).abs() + 4.0);
                let mean_arg: f64 = edges
                    .clone()
                    .map(|e| self.p[e * heads + h] * arg(e * heads + h))
                    .sum();
                let da = &self.d_agg[ih * dim..][..dim];
                d_p.clear();
                d_dp.clear();
                let mut d_r = 0.0;
                let mut abs_pdp = 0.0;
                let (mut p_g, mut dp_g) = (0.0, 0.0);
                for e in edges.clone() {
                    let (k, j) = (e * heads + h, cols[e] as usize);
                    let whj = &self.wh[(j * heads + h) * dim..][..dim];
                    let g: f64 = da.iter().zip(whj).map(|(x, y)| (x * y).abs()).sum();
                    let dpk = self.p[k] * (arg(k) + mean_arg + gamma32(deg) + 2.0 * u);
                    let ddpk = gamma32(dim) * g;
                    d_r += dpk * self.dp[k].abs() + self.p[k] * ddpk;
                    abs_pdp += self.p[k] * self.dp[k].abs();
                    p_g += self.p[k] * g;
                    dp_g += dpk * g;
                    d_p.push(dpk);
                    d_dp.push(ddpk);
                }
                d_r += gamma32(deg + 1) * abs_pdp;
                if out_unit > 0.0 {
                    d_r += (out_unit + gamma32(deg + dim)) * p_g + dp_g;
                }
                let ri = self.r[ih];
                for (t, e) in edges.clone().enumerate() {
                    let (k, j) = (e * heads + h, cols[e] as usize);
                    let spread = self.dp[k].abs() + ri.abs();
                    let tk = self.p[k] * (self.dp[k] - ri);
                    let ds = self.lambda[k] * tk;
                    let d_t = d_p[t] * spread
                        + self.p[k] * (d_dp[t] + d_r)
                        + u * self.p[k] * spread
                        + u * tk.abs();
                    let d_ds = self.lambda[k].abs() * d_t + u * ds.abs();
                    let jh = j * heads + h;
                    dde_dst[ih] += d_ds;
                    dde_src[jh] += d_ds;
                    abs_dst[ih] += ds.abs();
                    abs_src[jh] += ds.abs();
                }
            }
            for &j in a.row(i) {
                in_degree[j as usize] += 1;
            }
        }
        for ih in 0..n * heads {
            dde_dst[ih] += gamma32(a.degree(ih / heads)) * abs_dst[ih];
            dde_src[ih] += gamma32(in_degree[ih / heads]) * abs_src[ih];
        }
        let bound = |de: &[f64], dde: &[f64]| {
            let mut out = vec![0.0; heads * dim];
            for (ih, row) in self.wh.chunks(dim).enumerate() {
                let w = dde[ih] + gamma32(n + 9) * de[ih].abs();
                let o = &mut out[(ih % heads) * dim..][..dim];
                for (o, &v) in o.iter_mut().zip(row) {
                    *o += w * v.abs();
                }
            }
            out
        };
        [bound(&self.de_src, &dde_src), bound(&self.de_dst, &dde_dst)]
    }
}

/// The factor on the first-order f32 bound: 2 covers the second-order terms (each δ above is
/// ≪ 1 relative) and the few roundings not itemised (the slope's product, the transposition's
/// copies are exact); the bound itself is a worst case over signs, so the measured errors sit
/// orders of magnitude below it.
const F32_BOUND_FACTOR: f64 = 2.0;

/// Checks the GPU layer's att_src / att_dst gradients (`got`, in that order) as described above:
/// the GPU's stored Wh and logits are correct roundings of the exact ones, and the gradients
/// differ from the f64 gradients recomputed from those stored values by no more than
/// `F32_BOUND_FACTOR` × the f32 bound (L2 over the `heads × dim` components). Prints the error
/// against the exact gradient, the part of it the storage explains, and the rest against its
/// bound.
#[allow(clippy::too_many_arguments)]
fn check_gat_attention<T: GemmElement>(
    what: &str,
    c: &Ctx,
    a: &Csr,
    cpu_layer: &GatConv<Host<f64>>,
    gpu_layer: &GatConv<Device<T>>,
    gx: &DeviceMatrix<T>,
    x: &[f64],
    dy: &[f64],
    got: [Vec<f64>; 2],
    got_weight: &[f64],
) {
    let cfg = *cpu_layer.config();
    let (n, heads, dim) = (a.n_rows(), cfg.heads, cfg.out_dim);
    let slope = f64::from(cfg.negative_slope);
    let (ut, eta) = (unit_roundoff::<T>(), underflow_error::<T>());
    // dAgg: dy, or dy / heads broadcast to every head (the GPU rounds that product to T).
    let (d_agg, d_agg_t): (Vec<f64>, Vec<f64>) = if cfg.concat {
        (dy.to_vec(), dy.to_vec())
    } else {
        let scale = 1.0f32 / heads as f32;
        dy.chunks(dim)
            .flat_map(|row| std::iter::repeat_n(row, heads).flatten())
            .map(|&v| {
                let stored = T::from_f32(scale * v as f32).to_f64();
                (v / heads as f64, stored)
            })
            .unzip()
    };
    let (att_src, att_dst) = (&cpu_layer.att_src.value, &cpu_layer.att_dst.value);

    // Exact: the f64 layer's own Wh; the recomputation must reproduce the layer's gradients.
    let wh = cpu_layer.lin.forward(x, n).unwrap();
    let e_dst = head_dot_with(&wh, att_dst, heads, dim, |v, w| v * w);
    let e_src = head_dot_with(&wh, att_src, heads, dim, |v, w| v * w);
    let atts = (att_dst.as_slice(), att_src.as_slice());
    let exact = GatAttention::new(
        a,
        wh.clone(),
        (&e_dst, &e_src),
        atts,
        d_agg,
        heads,
        dim,
        slope,
    );
    let exact_weight = exact.d_weight(x, cfg.in_dim);
    for (mine, layer) in [
        (&exact.d_att_src, &cpu_layer.att_src.grad),
        (&exact.d_att_dst, &cpu_layer.att_dst.grad),
        (&exact_weight, &cpu_layer.lin.weight.grad),
    ] {
        let e = cpu::rel_l2_error(mine, layer);
        assert!(
            e <= 1e-12,
            "{what}: the f64 recomputation is off by {e:.2e}"
        );
    }

    // Stored: Wh and the logits as the GPU layer computes them (its GEMM and head_dot on the
    // same input and parameters; both deterministic).
    let gpu = c.ctx.gpu();
    let mut wh_dev = gpu_layer.lin.forward(&c.ctx, gx).unwrap();
    wh_dev.reshape(Shape::new(n, heads, dim).unwrap()).unwrap();
    // The layer's logits: f32 dot products with the vectors widened to f32 (not rounded to T).
    let logits = |att: &DeviceVec<T>| -> Vec<f64> {
        let mut a32 = DeviceVec::<f32>::zeros(gpu, att.len()).unwrap();
        edge_extras::widen(gpu, att, &mut a32).unwrap();
        let mut e = DeviceMatrix::<f32>::zeros(gpu, Shape::new(n, heads, 1).unwrap()).unwrap();
        elementwise::head_dot_f32(gpu, &wh_dev, &a32, &mut e).unwrap();
        e.to_host().unwrap().iter().map(|&v| f64::from(v)).collect()
    };
    let e_dst_t = logits(&gpu_layer.att_dst.value);
    let e_src_t = logits(&gpu_layer.att_src.value);
    let wh_t: Vec<f64> = wh_dev
        .to_host()
        .unwrap()
        .iter()
        .map(|v| v.to_f64())
        .collect();
    // Each stored value is an f32 dot product rounded to T (the logits stay f32: the u_T term
    // is then margin): |stored − exact| ≤ u_T·|exact| +
    // (1 + u_T)·γ·Σ|terms| + the underflow error, γ = γ_m for m terms (Wh: m = in_dim terms of
    // x·W; the logits: m = dim terms of stored Wh · a). Parameters and x are exact in T already.
    // For the GEMM γ is doubled: tensor cores may truncate rather than round their f32 sums (Fasi,
    // Higham, Mikaitis, Pranesh, PeerJ CS 2021), up to 2u per addition.
    let abs_wh = {
        let w = &cpu_layer.lin.weight.value;
        let cols = heads * dim;
        let mut out = vec![0.0; n * cols];
        for (xr, or) in x.chunks(cfg.in_dim).zip(out.chunks_mut(cols)) {
            for (&xv, wr) in xr.iter().zip(w.chunks(cols)) {
                for (o, &wv) in or.iter_mut().zip(wr) {
                    *o += (xv * wv).abs();
                }
            }
        }
        out
    };
    let worst_ratio = |stored: &[f64], exact: &[f64], abs_terms: &[f64], gamma: f64| {
        stored
            .iter()
            .zip(exact)
            .zip(abs_terms)
            .map(|((&s, &e), &t)| {
                let allowed = ut * e.abs() + (1.0 + ut) * gamma * t + eta;
                (s - e).abs() / allowed
            })
            .fold(0.0, f64::max)
    };
    let mut storage = worst_ratio(&wh_t, &wh, &abs_wh, 2.0 * gamma32(cfg.in_dim));
    for (stored, att) in [(&e_dst_t, att_dst), (&e_src_t, att_src)] {
        let exact_of_stored = head_dot_with(&wh_t, att, heads, dim, |v, w| v * w);
        let abs_terms = head_dot_with(&wh_t, att, heads, dim, |v, w| (v * w).abs());
        storage = storage.max(worst_ratio(
            stored,
            &exact_of_stored,
            &abs_terms,
            gamma32(dim),
        ));
    }
    assert!(
        storage <= 1.0,
        "{what} {}: the stored Wh or logits are off by {storage:.2} × their rounding bound",
        T::NAME
    );
    let stored = GatAttention::new(
        a,
        wh_t,
        (&e_dst_t, &e_src_t),
        atts,
        d_agg_t,
        heads,
        dim,
        slope,
    );
    // The layer's backward on the row-statistics kernels reads the forward's output in T.
    let rows = GatKernels::auto::<T>(heads, dim, a.nnz(), false, true) == GatKernels::Rows;
    let bounds = stored.f32_error_bound(a, if rows { ut } else { 0.0 });

    // dW = Xᵀ·dWh inherits dWh's sensitivity to the stored logits (the de terms): measured
    // against the gradient of the stored values, what is left is dWh's rounding to T before the
    // GEMM (one unit roundoff) and f32 sums over up to thousands of terms, held to
    // 8·u_T + 1e-5 (H100: at most 0.75·u_T in f16 and bf16, 3.5e-7 in f32).
    let stored_weight = stored.d_weight(x, cfg.in_dim);
    let scale = norm(&exact_weight);
    let (err, from_storage, rest) = (
        dist(got_weight, &exact_weight) / scale,
        dist(&stored_weight, &exact_weight) / scale,
        dist(got_weight, &stored_weight) / scale,
    );
    let tg = 8.0 * unit_roundoff::<T>() + 1e-5;
    println!(
        "{what} {}: dweight rel L2 {err:.2e} (storage of Wh and logits {from_storage:.2e}), \
         the rest {rest:.2e} ≤ {tg:.1e}",
        T::NAME
    );
    assert!(
        rest <= tg,
        "{what} {}: dweight is {rest:.2e} (rel L2) from the gradient of the stored Wh and \
         logits, over {tg:.1e} (storage alone {from_storage:.2e}, total {err:.2e})",
        T::NAME
    );

    let sides = [
        ("att_src", &exact.d_att_src, &stored.d_att_src),
        ("att_dst", &exact.d_att_dst, &stored.d_att_dst),
    ];
    for (((name, want, want_stored), got), bound) in sides.into_iter().zip(&got).zip(&bounds) {
        let scale = norm(want);
        let (err, from_storage) = (dist(got, want) / scale, dist(want_stored, want) / scale);
        let (rest, allowed) = (dist(got, want_stored), F32_BOUND_FACTOR * norm(bound));
        println!(
            "{what} {}: d{name} rel L2 {err:.2e} (storage of Wh and logits {from_storage:.2e}, \
             stored values at {storage:.2} of their rounding bound), the rest {:.2e} ≤ {:.2e} \
             (f32 bound; {:.1e} of it)",
            T::NAME,
            rest / scale,
            allowed / scale,
            rest / allowed,
        );
        assert!(
            rest <= allowed,
            "{what} {}: d{name} is {:.2e} (rel L2) from the gradient of the stored Wh and logits, \
             over its f32 bound {:.2e}",
            T::NAME,
            rest / scale,
            allowed / scale
        );
    }
}
