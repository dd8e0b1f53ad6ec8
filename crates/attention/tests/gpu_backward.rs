//! GPU tests of `AttentionPlan::backward` for every algorithm, dtype and head count, against
//! the f64 CPU backward.
//!
//! `#[ignore]`d where there is no NVIDIA GPU. Inputs are drawn fresh (seed printed; replay with
//! SPATTN_SEED), gradients poisoned with NaN before each backward.
//!
//! Tolerances: docs/kernels/README.md's on the relative L2 error of each gradient (f32 1e-5,
//! f16 5e-3, bf16 2e-2). The CUDA-core backwards run in f32 for every algorithm (the
//! tensor-core forwards included), so f32 is held to 1e-5 whatever the forward's algorithm;
//! f16 / bf16 gradients are the f32 result rounded once, or (`TensorCore`) dS and P rounded once
//! more as mma operands. dscale is a sum of `nnz × heads` signed terms:
//! its error is bounded relative to the sum of their magnitudes.

use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn::{Algorithm, AttentionConfig, AttentionPlan, BackwardKernels, Reorder};
use spattn_formats::Csr;
use spattn_ops::cpu::{attention_backward_f64_from, rel_l2_error, AttentionGrads, AttentionInputs};
use spattn_ops::{DType, DeviceMatrix, Gpu, Shape};
use spattn_test_support::*;

const GPU_ALGORITHMS: [Algorithm; 5] = [
    Algorithm::UnfusedCsr,
    Algorithm::FusedCsr,
    Algorithm::UnfusedTensorCore,
    Algorithm::FusedTensorCore,
    Algorithm::Auto,
];

/// Which gradients a case holds to the tolerance (near-one-hot softmaxes have dQ, dK ≈ 0).
#[derive(Clone, Copy, PartialEq)]
enum Grads {
    All,
    /// Only dV is compared relatively; dQ and dK must be finite and small.
    OneHot,
}

/// Runs the backward of each of `algs` on `a` (both kernel sets) with one set of fresh inputs
/// and compares every gradient with the f64 reference.
#[allow(clippy::too_many_arguments)]
fn check_backward<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    algs: &[Algorithm],
    heads: usize,
    head_dim: usize,
    rng: &mut Pcg64,
    amp: f64,
    grads: Grads,
) {
    let shape = (heads, head_dim);
    check_backward_in::<T>(gpu, a, algs, Reorder::Auto, shape, rng, amp, grads);
}

/// [`check_backward`] with the plans' rows in the order `reorder` gives.
#[allow(clippy::too_many_arguments)]
fn check_backward_in<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    algs: &[Algorithm],
    reorder: Reorder,
    (heads, head_dim): (usize, usize),
    rng: &mut Pcg64,
    amp: f64,
    grads: Grads,
) {
    let config = AttentionConfig::new(heads, head_dim, T::KIND).with_reorder(reorder);
    let sq = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let skv = Shape::new(a.n_cols(), heads, head_dim).unwrap();
    let q: Vec<T> = if amp == 0.0 {
        vec![T::from_f64(0.0); sq.len()]
    } else {
        random_vec(rng, sq.len(), amp)
    };
    let k: Vec<T> = random_vec(rng, skv.len(), 1.0);
    let v: Vec<T> = random_vec(rng, skv.len(), 1.0);
    let d_out: Vec<T> = random_vec(rng, sq.len(), 1.0);
    let (q64, k64, v64, d64) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&d_out));
    let inputs = AttentionInputs::new(&q64, sq, &k64, skv, &v64, skv);
    let want = attention_backward_f64_from(a, &inputs, f64::from(config.scale()), &d64).unwrap();
    let up = |s, x: &[T]| DeviceMatrix::from_host(gpu, s, x).unwrap();
    let (dq_in, dk_in, dv_in, dout) = (up(sq, &q), up(skv, &k), up(skv, &v), up(sq, &d_out));
    let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
    let mut dq = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
    let mut dk = DeviceMatrix::<T>::zeros(gpu, skv).unwrap();
    let mut dv = DeviceMatrix::<T>::zeros(gpu, skv).unwrap();
    let tol = tolerance::<T>();
    for &alg in algs {
        let config = config.clone().with_algorithm(alg);
        if !AttentionPlan::supports(gpu, alg, &config) {
            continue;
        }
        let plan = AttentionPlan::new_gpu(gpu, a, config).unwrap();
        plan.forward(&dq_in, &dk_in, &dv_in, &mut out).unwrap();
        for kernels in [
            BackwardKernels::Fused,
            BackwardKernels::PerEdge,
            BackwardKernels::Unfused,
            BackwardKernels::TensorCore,
            BackwardKernels::Fused,
        ] {
            for m in [&mut dq, &mut dk, &mut dv] {
                m.fill_nan().unwrap();
            }
            let d_scale = plan
                .backward_with(
                    kernels, &dq_in, &dk_in, &dv_in, &out, &dout, &mut dq, &mut dk, &mut dv,
                )
                .unwrap();
            let ctx = format!(
                "{alg} {kernels:?} {reorder:?} {} n={} nnz={} heads={heads} head_dim={head_dim} \
                 amp={amp}",
                T::NAME,
                a.n_rows(),
                a.nnz()
            );
            let (gq, gk, gv) = (
                to_f64(&dq.to_host().unwrap()),
                to_f64(&dk.to_host().unwrap()),
                to_f64(&dv.to_host().unwrap()),
            );
            let ev = rel_l2_error(&gv, &want.dv);
            assert!(ev <= tol, "{ctx}: dV rel error {ev:e}");
            match grads {
                Grads::All => {
                    for (g, w, name) in [(&gq, &want.dq, "dQ"), (&gk, &want.dk, "dK")] {
                        let e = rel_l2_error(g, w);
                        assert!(e <= tol, "{ctx}: {name} rel error {e:e}");
                    }
                    assert_d_scale(&ctx, d_scale, &want);
                }
                Grads::OneHot => {
                    // Errors of the scores (f32 at |s| ~ 1e4: ~1e-3 absolute) move the
                    // one-hot softmax's tiny gradients by as much: require them finite and
                    // as small as the reference's scale allows.
                    let norm = |x: &[f64]| x.iter().map(|v| v * v).sum::<f64>().sqrt();
                    let bound = 1e-2 * (norm(&want.dv) + norm(&want.dq) + norm(&want.dk));
                    for (g, w, name) in [(&gq, &want.dq, "dQ"), (&gk, &want.dk, "dK")] {
                        assert!(g.iter().all(|x| x.is_finite()), "{ctx}: {name} not finite");
                        let diff: Vec<f64> = g.iter().zip(w.iter()).map(|(a, b)| a - b).collect();
                        assert!(norm(&diff) <= bound, "{ctx}: {name} off by {}", norm(&diff));
                    }
                    assert!(d_scale.is_finite(), "{ctx}: dscale not finite");
                }
            }
            // Rows without edges have zero dQ; columns nobody attends to, zero dK and dV.
            for r in (0..a.n_rows()).filter(|&r| a.degree(r) == 0) {
                let row = &gq[r * sq.row_len()..(r + 1) * sq.row_len()];
                assert!(
                    row.iter().all(|&x| x == 0.0),
                    "{ctx}: empty row {r}: dQ not zero"
                );
            }
        }
    }
}

fn check_all_dtypes(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    check_backward::<f32>(
        gpu,
        a,
        &GPU_ALGORITHMS,
        heads,
        head_dim,
        rng,
        1.0,
        Grads::All,
    );
    check_backward::<f16>(
        gpu,
        a,
        &GPU_ALGORITHMS,
        heads,
        head_dim,
        rng,
        1.0,
        Grads::All,
    );
    check_backward::<bf16>(
        gpu,
        a,
        &GPU_ALGORITHMS,
        heads,
        head_dim,
        rng,
        1.0,
        Grads::All,
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn shared_graphs() {
    let gpu = gpu();
    let mut rng = fresh_rng("shared_graphs");
    // The backward is the same for every forward algorithm (tested on the other cases); here
    // one plan per configuration keeps the f64 references of the large graphs affordable.
    for name in test_graphs(&["cora", "pubmed", "ogbn-arxiv"]) {
        let a = shared_graph(name);
        for (heads, head_dim) in [(1, 128), (8, 64), (4, 24)] {
            let auto = [Algorithm::Auto];
            check_backward::<f32>(&gpu, &a, &auto, heads, head_dim, &mut rng, 1.0, Grads::All);
            check_backward::<f16>(&gpu, &a, &auto, heads, head_dim, &mut rng, 1.0, Grads::All);
            check_backward::<bf16>(&gpu, &a, &auto, heads, head_dim, &mut rng, 1.0, Grads::All);
            eprintln!("{name} heads={heads} head_dim={head_dim}: ok");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn head_dims_heads_and_tiny_graphs() {
    let gpu = gpu();
    let mut rng = fresh_rng("head_dims_heads_and_tiny_graphs");
    let a = random_graph(&mut rng, 200, 5, 9);
    // 200 and 256 (f32): two vectors a lane in the fused backward; 66 (even, not a multiple of
    // 4, past one vector a lane) and 520 (past 16 features a lane): `Fused` runs the per-edge
    // kernels.
    for head_dim in [1, 3, 24, 64, 66, 128, 200, 256, 520] {
        for heads in [1, 4, 8] {
            check_all_dtypes(&gpu, &a, heads, head_dim, &mut rng);
        }
    }
}

/// Small enough for compute-sanitizer.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tiny_graphs() {
    let gpu = gpu();
    let mut rng = fresh_rng("tiny_graphs");
    for n in [1, 7, 17, 33] {
        let a = random_graph(&mut rng, n, 3, 4);
        for heads in [1, 8] {
            check_all_dtypes(&gpu, &a, heads, 24, &mut rng);
        }
    }
}

/// Symmetric patterns, whose tensor-core dK/dV pass reads A's own BSB in the forward's row order
/// (window rows renumbered through row_ids where the order moves them; the directed graphs of
/// the other tests read Aᵀ's BSB), with a hub node whose row and column split their windows
/// into merged parts on both sides. Small enough for compute-sanitizer.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn symmetric_graphs_in_every_row_order() {
    let gpu = gpu();
    let mut rng = fresh_rng("symmetric_graphs_in_every_row_order");
    let tc = [Algorithm::FusedTensorCore];
    for n in [17, 33, 200, 3000] {
        // At 3000, node 5 is linked to every node: 3000 entries in its row and its column.
        let a = match n {
            3000 => hub_graph(&mut rng, n, 5),
            _ => random_graph(&mut rng, n, 3, 6),
        };
        let a = a.symmetrize().unwrap();
        assert!(a.is_pattern_symmetric());
        for reorder in [Reorder::None, Reorder::Degree, Reorder::Cluster] {
            for shape in [(1, 24), (8, 64)] {
                let (r, g) = (&mut rng, Grads::All);
                check_backward_in::<f16>(&gpu, &a, &tc, reorder, shape, r, 1.0, g);
                check_backward_in::<bf16>(&gpu, &a, &tc, reorder, shape, r, 1.0, g);
            }
        }
    }
}

/// fused-csr plans in every row order: the fused backward walks its units in the plan's order
/// (a hub row and column split across units, empty rows, a symmetric pattern and a directed
/// one). Small enough for compute-sanitizer.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fused_backward_in_every_row_order() {
    let gpu = gpu();
    let mut rng = fresh_rng("fused_backward_in_every_row_order");
    let hub = hub_graph(&mut rng, 3000, 5);
    let graphs = [
        random_graph(&mut rng, 200, 5, 9),
        hub.symmetrize().unwrap(),
        hub,
    ];
    let fc = [Algorithm::FusedCsr];
    for a in &graphs {
        for reorder in Reorder::ALL {
            for shape in [(1, 24), (8, 64)] {
                let (r, g) = (&mut rng, Grads::All);
                check_backward_in::<f32>(&gpu, a, &fc, reorder, shape, r, 1.0, g);
                check_backward_in::<f16>(&gpu, a, &fc, reorder, shape, r, 1.0, g);
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn hub_row_and_extreme_scores() {
    let gpu = gpu();
    let mut rng = fresh_rng("hub_row_and_extreme_scores");
    let a = hub_graph(&mut rng, 100_000, 777);
    for (heads, head_dim) in [(1, 64), (4, 24)] {
        check_all_dtypes(&gpu, &a, heads, head_dim, &mut rng);
    }
    // Scores near ±1e4: a near-one-hot softmax.
    let b = random_graph(&mut rng, 500, 8, 5);
    check_backward::<f32>(
        &gpu,
        &b,
        &GPU_ALGORITHMS,
        2,
        16,
        &mut rng,
        2.5e3,
        Grads::OneHot,
    );
    check_backward::<f16>(
        &gpu,
        &b,
        &GPU_ALGORITHMS,
        2,
        16,
        &mut rng,
        30.0,
        Grads::OneHot,
    );
    // All scores equal (Q = 0): uniform probabilities.
    check_backward::<f32>(&gpu, &b, &GPU_ALGORITHMS, 8, 8, &mut rng, 0.0, Grads::All);
}

/// Every backward (fused, tensor-core, per-edge, unfused), each twice on the same inputs:
/// bitwise-equal gradients and ∂scale, on a graph whose hub row and hub column are split into
/// many units (merged by whichever unit finishes last), and within tolerance of the f64
/// reference.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fused_backward_is_deterministic() {
    let gpu = gpu();
    let mut rng = fresh_rng("fused_backward_is_deterministic");
    let n = 20_000u32;
    let (hub_row, hub_col) = (777u32, 555u32);
    let mut edges: Vec<(u32, u32)> = (0..n).map(|c| (hub_row, c)).collect();
    edges.extend((0..n).map(|r| (r, hub_col)));
    for r in 0..n {
        edges.push((r, rng.random_range(0..n)));
    }
    let a = Csr::from_edges(n as usize, n as usize, &edges).unwrap();
    for (heads, head_dim) in [(8, 64), (1, 24)] {
        deterministic_case::<f32>(&gpu, &a, heads, head_dim, &mut rng);
        deterministic_case::<f16>(&gpu, &a, heads, head_dim, &mut rng);
        deterministic_case::<bf16>(&gpu, &a, heads, head_dim, &mut rng);
    }
}

fn deterministic_case<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    heads: usize,
    head_dim: usize,
    rng: &mut Pcg64,
) {
    let config = AttentionConfig::new(heads, head_dim, T::KIND).with_algorithm(Algorithm::FusedCsr);
    let plan = AttentionPlan::new_gpu(gpu, a, config.clone()).unwrap();
    let sq = plan.shape_q();
    let skv = plan.shape_kv();
    let (q, k, v, d): (Vec<T>, Vec<T>, Vec<T>, Vec<T>) = (
        random_vec(rng, sq.len(), 1.0),
        random_vec(rng, skv.len(), 1.0),
        random_vec(rng, skv.len(), 1.0),
        random_vec(rng, sq.len(), 1.0),
    );
    for kernels in [
        BackwardKernels::Fused,
        BackwardKernels::TensorCore,
        BackwardKernels::PerEdge,
        BackwardKernels::Unfused,
    ] {
        deterministic_runs(gpu, a, &plan, kernels, [&q, &k, &v, &d]);
    }
}

/// Two runs of `kernels` on the same inputs: bitwise equal, and within tolerance of the f64
/// reference.
fn deterministic_runs<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    plan: &AttentionPlan,
    kernels: BackwardKernels,
    [q, k, v, d]: [&[T]; 4],
) {
    let config = plan.config();
    let (heads, head_dim) = (config.heads, config.head_dim);
    let sq = plan.shape_q();
    let skv = plan.shape_kv();
    let up = |s, x: &[T]| DeviceMatrix::from_host(gpu, s, x).unwrap();
    let (qd, kd, vd, dd) = (up(sq, q), up(skv, k), up(skv, v), up(sq, d));
    let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
    plan.forward(&qd, &kd, &vd, &mut out).unwrap();
    let mut runs = Vec::new();
    for _ in 0..2 {
        let ([dq, dk, dv], d_scale) = fresh_grads(gpu, plan, kernels, [&qd, &kd, &vd, &out, &dd]);
        runs.push((
            f64_bits(&dq),
            f64_bits(&dk),
            f64_bits(&dv),
            d_scale.to_bits(),
        ));
    }
    let ctx = format!("{kernels:?} {} heads={heads} head_dim={head_dim}", T::NAME);
    assert!(runs[0] == runs[1], "{ctx}: two backward runs differ");
    let (q64, k64, v64, d64) = (to_f64(q), to_f64(k), to_f64(v), to_f64(d));
    let inputs = AttentionInputs::new(&q64, sq, &k64, skv, &v64, skv);
    let want = attention_backward_f64_from(a, &inputs, f64::from(config.scale()), &d64).unwrap();
    let (gq, gk, gv, _) = &runs[0];
    let tol = tolerance::<T>();
    for (got, w, name) in [
        (gq, &want.dq, "dQ"),
        (gk, &want.dk, "dK"),
        (gv, &want.dv, "dV"),
    ] {
        let got: Vec<f64> = got.iter().map(|&b| f64::from_bits(b)).collect();
        let e = rel_l2_error(&got, w);
        assert!(e <= tol, "{ctx}: {name} rel error {e:e}");
    }
    eprintln!("{ctx}: bitwise equal, within tolerance");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn backward_host_and_errors() {
    let gpu = gpu();
    let mut rng = fresh_rng("backward_host_and_errors");
    let a = random_graph(&mut rng, 40, 4, 6);
    let config = AttentionConfig::new(8, 8, spattn_ops::DTypeKind::F32);
    let plan = AttentionPlan::new_gpu(&gpu, &a, config.clone()).unwrap();
    let cpu_plan = AttentionPlan::new_cpu(&a, config).unwrap();
    let s = plan.shape_q();
    let x: Vec<f32> = random_vec(&mut rng, s.len(), 1.0);
    let y: Vec<f32> = random_vec(&mut rng, s.len(), 1.0);
    let z: Vec<f32> = random_vec(&mut rng, s.len(), 1.0);
    let d: Vec<f32> = random_vec(&mut rng, s.len(), 1.0);
    let out = plan.forward_host(&x, &y, &z).unwrap();
    let g = plan.backward_host(&x, &y, &z, &out, &d).unwrap();
    let c = cpu_plan.backward_host(&x, &y, &z, &out, &d).unwrap();
    let want = attention_backward_f64_from(
        &a,
        &AttentionInputs::new(&x, s, &y, s, &z, s),
        1.0 / 8f64.sqrt(),
        &d,
    )
    .unwrap();
    for (got, w) in [
        (&g.dq, &want.dq),
        (&g.dk, &want.dk),
        (&g.dv, &want.dv),
        (&c.dq, &want.dq),
        (&c.dk, &want.dk),
        (&c.dv, &want.dv),
    ] {
        assert!(rel_l2_error(got, w) <= 1e-5);
    }
    // Errors name the operand.
    let m = |shape| DeviceMatrix::<f32>::zeros(&gpu, shape).unwrap();
    let bad = m(Shape::new(40, 8, 7).unwrap());
    let (q, mut dq, mut dk, mut dv) = (m(s), m(s), m(s), m(s));
    let e = plan
        .backward(&q, &q, &q, &q, &bad, &mut dq, &mut dk, &mut dv)
        .unwrap_err();
    assert!(
        matches!(e, spattn::Error::ShapeMismatch { what: "d_out", .. }),
        "{e}"
    );
    let e = cpu_plan
        .backward(&q, &q, &q, &q, &q, &mut dq, &mut dk, &mut dv)
        .unwrap_err();
    assert!(matches!(e, spattn::Error::WrongPlanKind { .. }), "{e}");
}

/// The tensor-core backward from the forward's kept row statistics (fused-tc writes each row's
/// lse; the backward skips its statistics pass and takes `⟨dOut, out⟩`): every gradient and
/// ∂scale within the f64 reference's tolerance, bitwise equal across two runs, on directed and
/// symmetric graphs (a hub row splitting windows on both sides) in two row orders; a plan of
/// another algorithm keeps nothing and runs the plain backward.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn backward_from_kept_row_statistics() {
    let gpu = gpu();
    if gpu.compute_capability() < (8, 0) {
        return;
    }
    let mut rng = fresh_rng("backward_from_kept_row_statistics");
    let hub = hub_graph(&mut rng, 3000, 5);
    let graphs = [
        random_graph(&mut rng, 200, 5, 9),
        random_graph(&mut rng, 33, 3, 4).symmetrize().unwrap(),
        hub.symmetrize().unwrap(),
        hub,
    ];
    for a in &graphs {
        for reorder in [Reorder::None, Reorder::Degree] {
            for shape in [(1, 24), (8, 64)] {
                kept_stats_case::<f16>(&gpu, a, reorder, shape, &mut rng);
                kept_stats_case::<bf16>(&gpu, a, reorder, shape, &mut rng);
            }
        }
    }
}

fn kept_stats_case<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    reorder: Reorder,
    (heads, head_dim): (usize, usize),
    rng: &mut Pcg64,
) {
    let config = AttentionConfig::new(heads, head_dim, T::KIND).with_reorder(reorder);
    let (sq, skv) = (
        Shape::new(a.n_rows(), heads, head_dim).unwrap(),
        Shape::new(a.n_cols(), heads, head_dim).unwrap(),
    );
    let (q, k, v, d): (Vec<T>, Vec<T>, Vec<T>, Vec<T>) = (
        random_vec(rng, sq.len(), 1.0),
        random_vec(rng, skv.len(), 1.0),
        random_vec(rng, skv.len(), 1.0),
        random_vec(rng, sq.len(), 1.0),
    );
    let (q64, k64, v64) = (to_f64(&q), to_f64(&k), to_f64(&v));
    let inputs = AttentionInputs::new(&q64, sq, &k64, skv, &v64, skv);
    let want =
        attention_backward_f64_from(a, &inputs, f64::from(config.scale()), &to_f64(&d)).unwrap();
    let up = |s, x: &[T]| DeviceMatrix::from_host(gpu, s, x).unwrap();
    let (qd, kd, vd, dd) = (up(sq, &q), up(skv, &k), up(skv, &v), up(sq, &d));
    let tc = BackwardKernels::TensorCore;
    let ctx = format!(
        "{} {reorder:?} n={} heads={heads} d={head_dim}",
        T::NAME,
        a.n_rows()
    );
    let run = |plan: &AttentionPlan| {
        let mut stats = plan.row_stats().unwrap();
        let other = plan.row_stats().unwrap();
        assert!(!other.is_kept());
        let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
        plan.forward_keeping_stats(&qd, &kd, &vd, &mut out, &mut stats)
            .unwrap();
        let mut g = nan_grads(gpu, plan);
        let [dq, dk, dv] = &mut g;
        let d_scale = plan
            .backward_with_stats(tc, &qd, &kd, &vd, &out, &dd, &stats, (dq, dk, dv))
            .unwrap();
        let host = g.map(|m| m.to_host().unwrap());
        (stats.is_kept(), host, d_scale, stats.to_host().unwrap())
    };
    let plan = AttentionPlan::new_gpu(
        gpu,
        a,
        config.clone().with_algorithm(Algorithm::FusedTensorCore),
    )
    .unwrap();
    let (kept, grads, d_scale, lse) = run(&plan);
    assert!(kept, "{ctx}: fused-tc kept no statistics");
    // The kept statistic: each row's log2-domain log-sum-exp, 0 without edges.
    let scale_log2 = f64::from(config.scale()) * std::f64::consts::LOG2_E;
    for r in 0..a.n_rows() {
        for h in 0..heads {
            let x: Vec<f64> = a
                .row(r)
                .iter()
                .map(|&c| {
                    let (qi, kj) = (r * heads + h, c as usize * heads + h);
                    let dot: f64 = (0..head_dim)
                        .map(|f| q64[qi * head_dim + f] * k64[kj * head_dim + f])
                        .sum();
                    dot * scale_log2
                })
                .collect();
            let want = match x.iter().copied().reduce(f64::max) {
                Some(m) => m + x.iter().map(|v| (v - m).exp2()).sum::<f64>().log2(),
                None => 0.0,
            };
            let got = f64::from(lse[r * heads + h]);
            assert!(
                (got - want).abs() <= 1e-3 * (1.0 + want.abs()),
                "{ctx}: row {r} head {h}: lse {got} vs {want}"
            );
        }
    }
    let tol = tolerance::<T>();
    for (g, w, name) in [
        (&grads[0], &want.dq, "dQ"),
        (&grads[1], &want.dk, "dK"),
        (&grads[2], &want.dv, "dV"),
    ] {
        let e = rel_l2_error(&to_f64(g), w);
        assert!(e <= tol, "{ctx}: {name} rel error {e:e}");
    }
    assert_d_scale(&ctx, d_scale, &want);
    let again = run(&plan);
    assert!(
        again.1 == grads && again.2.to_bits() == d_scale.to_bits(),
        "{ctx}: two runs differ"
    );
    // The kept statistics were used: D = ⟨dOut, out⟩ moves dQ's rounding against the stats
    // pass's D (asserted where thousands of rows make a bitwise tie impossible in practice).
    if a.n_rows() >= 3000 {
        let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
        plan.forward(&qd, &kd, &vd, &mut out).unwrap();
        let mut g = [sq, skv, skv].map(|s| DeviceMatrix::<T>::zeros(gpu, s).unwrap());
        let [dq, dk, dv] = &mut g;
        plan.backward_with(tc, &qd, &kd, &vd, &out, &dd, dq, dk, dv)
            .unwrap();
        assert!(
            dq.to_host().unwrap() != grads[0],
            "{ctx}: dQ from the kept statistics equals the stats pass's bit for bit"
        );
    }
    // Statistics of another plan are refused.
    let foreign = AttentionPlan::new_gpu(gpu, a, config.clone()).unwrap();
    let stats = foreign.row_stats().unwrap();
    let mut g = [sq, skv, skv].map(|s| DeviceMatrix::<T>::zeros(gpu, s).unwrap());
    let [dq, dk, dv] = &mut g;
    let e = plan
        .backward_with_stats(tc, &qd, &kd, &vd, &qd, &dd, &stats, (dq, dk, dv))
        .unwrap_err();
    assert!(format!("{e}").contains("another plan"), "{ctx}: {e}");
    // Another algorithm keeps nothing: the plain tensor-core backward, bitwise.
    let csr = AttentionPlan::new_gpu(gpu, a, config.with_algorithm(Algorithm::FusedCsr)).unwrap();
    let (kept, grads, d_scale, _) = run(&csr);
    assert!(!kept, "{ctx}: fused-csr kept statistics");
    let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
    csr.forward(&qd, &kd, &vd, &mut out).unwrap();
    let mut g = [sq, skv, skv].map(|s| DeviceMatrix::<T>::zeros(gpu, s).unwrap());
    let [dq, dk, dv] = &mut g;
    let plain = csr
        .backward_with(tc, &qd, &kd, &vd, &out, &dd, dq, dk, dv)
        .unwrap();
    assert!(
        g.map(|m| m.to_host().unwrap()) == grads && plain.to_bits() == d_scale.to_bits(),
        "{ctx}: fused-csr's backward with empty statistics is not the plain one"
    );
}

/// Rows and columns without edges: odd rows attend to nothing and odd columns are attended by
/// nobody. Every algorithm's forward and every backward gives exact zeros there (out, dQ; dK,
/// dV). The CUDA-core kernels must also keep non-finite values of other nodes out (keys and
/// values +inf at nodes 2 and 10, queries and output gradients NaN at nodes 4 and 14; 10 is row
/// 0's last column and 14 column 14's last row, where an empty row 1 or column 15 next to them
/// would clamp its loads: a lane or group without edges must not weigh a neighbour's values, as
/// 0 · inf is NaN); a tensor-core product multiplies a tile's zeros by them, so there they reach
/// the other nodes of their tile (docs/kernels/README.md).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn empty_rows_and_columns_beside_non_finite_values() {
    let gpu = gpu();
    let mut rng = fresh_rng("empty_rows_and_columns_beside_non_finite_values");
    let n = 64u32;
    let mut edges = Vec::new();
    for r in (0..n).step_by(2) {
        for s in [0, 2, 4, 10] {
            edges.push((r, (r + s) % n));
        }
    }
    let a = Csr::from_edges(n as usize, n as usize, &edges).unwrap();
    let (mut failures, mut runs) = (Vec::new(), 0);
    for (heads, head_dim) in [(8, 64), (1, 64), (2, 16)] {
        for poisoned in [false, true] {
            let shape = (heads, head_dim);
            runs += empty_rows_case::<f32>(&gpu, &a, shape, poisoned, &mut rng, &mut failures);
            runs += empty_rows_case::<f16>(&gpu, &a, shape, poisoned, &mut rng, &mut failures);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // 6 shapes and dtypes x 2 CUDA-core forwards x 3 backwards at least.
    assert!(runs >= 36, "only {runs} forward + backward runs");
}

/// One dtype and shape of [`empty_rows_and_columns_beside_non_finite_values`]: with `poisoned`
/// inputs only the CUDA-core forwards and backwards; failures are added to `failures`. Returns
/// the forward + backward runs made.
fn empty_rows_case<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    (heads, head_dim): (usize, usize),
    poisoned: bool,
    rng: &mut Pcg64,
    failures: &mut Vec<String>,
) -> usize {
    let sq = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let skv = Shape::new(a.n_cols(), heads, head_dim).unwrap();
    let row = sq.row_len();
    let fill = |x: &mut [T], node: usize, v: f64| {
        x[node * row..(node + 1) * row].fill(T::from_f64(v));
    };
    let mut q: Vec<T> = random_vec(rng, sq.len(), 1.0);
    let mut k: Vec<T> = random_vec(rng, skv.len(), 1.0);
    let mut v: Vec<T> = random_vec(rng, skv.len(), 1.0);
    let mut d: Vec<T> = random_vec(rng, sq.len(), 1.0);
    if poisoned {
        for node in [2, 10] {
            fill(&mut k, node, f64::INFINITY);
            fill(&mut v, node, f64::INFINITY);
        }
        for node in [4, 14] {
            fill(&mut q, node, f64::NAN);
            fill(&mut d, node, f64::NAN);
        }
    }
    let up = |s, x: &[T]| DeviceMatrix::from_host(gpu, s, x).unwrap();
    let (qd, kd, vd, dd) = (up(sq, &q), up(skv, &k), up(skv, &v), up(sq, &d));
    // The odd nodes (those without edges) whose rows of `m` are not all zeros: a write missed
    // (the outputs start as NaN) or a value leaked.
    let nonzero = |m: &DeviceMatrix<T>| -> Vec<usize> {
        let h = m.to_host().unwrap();
        (1..h.len() / row)
            .step_by(2)
            .filter(|&node| {
                h[node * row..(node + 1) * row]
                    .iter()
                    .any(|x| x.to_f64() != 0.0)
            })
            .collect()
    };
    let (algs, sets): (&[Algorithm], &[BackwardKernels]) = if poisoned {
        (
            &[Algorithm::UnfusedCsr, Algorithm::FusedCsr],
            &[
                BackwardKernels::Fused,
                BackwardKernels::PerEdge,
                BackwardKernels::Unfused,
            ],
        )
    } else {
        (
            &GPU_ALGORITHMS,
            &[
                BackwardKernels::Fused,
                BackwardKernels::TensorCore,
                BackwardKernels::PerEdge,
                BackwardKernels::Unfused,
            ],
        )
    };
    let config = AttentionConfig::new(heads, head_dim, T::KIND);
    let mut runs = 0;
    for &alg in algs {
        let config = config.clone().with_algorithm(alg);
        if !AttentionPlan::supports(gpu, alg, &config) {
            continue;
        }
        let plan = AttentionPlan::new_gpu(gpu, a, config).unwrap();
        let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
        out.fill_nan().unwrap();
        plan.forward(&qd, &kd, &vd, &mut out).unwrap();
        for &kernels in sets {
            let ([dq, dk, dv], _) = fresh_grads(gpu, &plan, kernels, [&qd, &kd, &vd, &out, &dd]);
            runs += 1;
            let ctx = format!(
                "{alg} {kernels:?} {} heads={heads} head_dim={head_dim} poisoned={poisoned}",
                T::NAME
            );
            for (m, what) in [(&out, "out"), (&dq, "dQ"), (&dk, "dK"), (&dv, "dV")] {
                let bad = nonzero(m);
                if !bad.is_empty() {
                    failures.push(format!("{ctx}: {what} not zero at empty nodes {bad:?}"));
                }
            }
        }
    }
    runs
}

/// `backward_grads` (the layers' and the Python package's call, which never reads ∂L/∂scale and
/// so skips its sum) gives the bits of `backward`, before and after a `backward` that takes
/// ∂L/∂scale, and that one is still right: f16 and bf16 (the tensor-core passes) and f32 (the
/// fused passes), on a random graph and a hub graph.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn backward_grads_skip_d_scale_with_the_same_gradients() {
    let gpu = gpu();
    let mut rng = fresh_rng("backward_grads_skip_d_scale_with_the_same_gradients");
    for a in [
        random_graph(&mut rng, 500, 3, 9),
        hub_graph(&mut rng, 3000, 17),
    ] {
        skip_d_scale_case::<f16>(&gpu, &a, 4, 32, &mut rng);
        skip_d_scale_case::<bf16>(&gpu, &a, 2, 64, &mut rng);
        skip_d_scale_case::<f32>(&gpu, &a, 3, 20, &mut rng);
    }
}

fn skip_d_scale_case<T: DType>(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    let plan =
        AttentionPlan::new_gpu(gpu, a, AttentionConfig::new(heads, head_dim, T::KIND)).unwrap();
    let (sq, skv) = (plan.shape_q(), plan.shape_kv());
    let (q, k, v, d): (Vec<T>, Vec<T>, Vec<T>, Vec<T>) = (
        random_vec(rng, sq.len(), 1.0),
        random_vec(rng, skv.len(), 1.0),
        random_vec(rng, skv.len(), 1.0),
        random_vec(rng, sq.len(), 1.0),
    );
    let up = |s, x: &[T]| DeviceMatrix::from_host(gpu, s, x).unwrap();
    let (qd, kd, vd, dd) = (up(sq, &q), up(skv, &k), up(skv, &v), up(sq, &d));
    let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
    plan.forward(&qd, &kd, &vd, &mut out).unwrap();
    let bits = |g: &[DeviceMatrix<T>; 3]| -> Vec<Vec<u64>> { g.iter().map(f64_bits).collect() };
    let grads_only = || {
        let mut g = nan_grads(gpu, &plan);
        let [dq, dk, dv] = &mut g;
        plan.backward_grads(&qd, &kd, &vd, &out, &dd, dq, dk, dv)
            .unwrap();
        bits(&g)
    };
    let ops = [&qd, &kd, &vd, &out, &dd];
    let first = grads_only();
    let (g, d_scale) = fresh_grads(gpu, &plan, BackwardKernels::default(), ops);
    let ctx = format!("{} {heads} x {head_dim}, n {}", T::NAME, a.n_rows());
    assert!(
        bits(&g) == first,
        "{ctx}: backward_grads differs from backward"
    );
    assert!(
        grads_only() == first,
        "{ctx}: backward_grads differs after backward"
    );
    let (_, again) = fresh_grads(gpu, &plan, BackwardKernels::default(), ops);
    assert_eq!(again.to_bits(), d_scale.to_bits(), "{ctx}: ∂scale changed");
    let (q64, k64, v64, d64) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&d));
    let inputs = AttentionInputs::new(&q64, sq, &k64, skv, &v64, skv);
    let scale = f64::from(plan.config().scale());
    let want = attention_backward_f64_from(a, &inputs, scale, &d64).unwrap();
    assert_d_scale(&ctx, d_scale, &want);
}

/// `plan`'s gradients by `kernels` from `[Q, K, V, out, dOut]`, written into fresh buffers
/// poisoned with NaN (so every element must be written): `([dQ, dK, dV], ∂L/∂scale)`.
fn fresh_grads<T: DType>(
    gpu: &Gpu,
    plan: &AttentionPlan,
    kernels: BackwardKernels,
    [q, k, v, out, d]: [&DeviceMatrix<T>; 5],
) -> ([DeviceMatrix<T>; 3], f32) {
    let [mut dq, mut dk, mut dv] = nan_grads(gpu, plan);
    let d_scale = plan
        .backward_with(kernels, q, k, v, out, d, &mut dq, &mut dk, &mut dv)
        .unwrap();
    ([dq, dk, dv], d_scale)
}

/// Buffers for `plan`'s `[dQ, dK, dV]`, poisoned with NaN (so every element must be written).
fn nan_grads<T: DType>(gpu: &Gpu, plan: &AttentionPlan) -> [DeviceMatrix<T>; 3] {
    [plan.shape_q(), plan.shape_kv(), plan.shape_kv()].map(|s| {
        let mut m = DeviceMatrix::<T>::zeros(gpu, s).unwrap();
        m.fill_nan().unwrap();
        m
    })
}

/// The bits of `m`'s values widened to f64 (exact for every dtype).
fn f64_bits<T: DType>(m: &DeviceMatrix<T>) -> Vec<u64> {
    to_f64(&m.to_host().unwrap())
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// ∂L/∂scale within 1e-4 of the f64 reference's (relative, or absolute below 1), or within f32
/// rounding of the terms it sums (`terms`, Σ |dS · s|), which may cancel to far less than them.
fn assert_d_scale(ctx: &str, d_scale: f32, want: &AttentionGrads<f64>) {
    let err = (f64::from(d_scale) - want.d_scale).abs();
    let rounding = 4.0 * f64::from(f32::EPSILON) * want.d_scale_terms;
    assert!(
        err <= (1e-4 * want.d_scale.abs().max(1.0_f64)).max(rounding),
        "{ctx}: dscale {d_scale} vs {} (terms {})",
        want.d_scale,
        want.d_scale_terms
    );
}

/// A NaN query makes its row of the output and of dQ NaN on every algorithm and backward,
/// tensor cores included, and leaves the other rows of both finite. The NaN rows: the hub
/// (split across windows' parts, merged) and a short row.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_nan_query_makes_its_row_nan_on_every_algorithm() {
    let gpu = gpu();
    let mut rng = fresh_rng("a_nan_query_makes_its_row_nan_on_every_algorithm");
    let (n, hub, short) = (3000, 1, 777);
    let a = hub_graph(&mut rng, n, hub);
    nan_cases(&gpu, &a, Poison::Queries([hub, short]), &mut rng);
}

/// A NaN key makes every row with an edge to it NaN (a NaN score), and with it the softmax of
/// those rows: their out and dQ are NaN, every other row's out finite, and on every backward
/// the dV of each of their neighbours is NaN (the tensor-core backward once took such a row's
/// statistics as those of an empty row and gave its neighbours finite dV).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_nan_key_makes_the_rows_reaching_it_nan_on_every_algorithm() {
    let gpu = gpu();
    let mut rng = fresh_rng("a_nan_key_makes_the_rows_reaching_it_nan_on_every_algorithm");
    let a = random_graph(&mut rng, 3000, 6, 0);
    let key = a.col_indices()[a.nnz() / 2] as usize;
    nan_cases(&gpu, &a, Poison::Key(key), &mut rng);
}

/// The NaN input of [`nan_case`]: whole rows of Q, or one node's row of K.
#[derive(Clone, Copy)]
enum Poison {
    Queries([usize; 2]),
    Key(usize),
}

/// The NaN tests above on `a` with `poison`: f16 and f32 at 2 × 32 and 1 × 64, every
/// algorithm and backward; asserts that every check held and that the runs were made.
fn nan_cases(gpu: &Gpu, a: &Csr, poison: Poison, rng: &mut Pcg64) {
    let mut failures = Vec::new();
    let mut runs = 0;
    for shape in [(2, 32), (1, 64)] {
        runs += nan_case::<f16>(gpu, a, shape, poison, rng, &mut failures);
        runs += nan_case::<f32>(gpu, a, shape, poison, rng, &mut failures);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // 4 shapes and dtypes x 3 forwards at least (CUDA cores) x 4 backwards.
    assert!(runs >= 48, "only {runs} forward + backward runs");
}

/// One dtype and shape of [`nan_cases`]; failures are added to `failures`. Returns the
/// forward + backward runs made.
fn nan_case<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    (heads, head_dim): (usize, usize),
    poison: Poison,
    rng: &mut Pcg64,
    failures: &mut Vec<String>,
) -> usize {
    let sq = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let row = sq.row_len();
    let mut q: Vec<T> = random_vec(rng, sq.len(), 1.0);
    let mut k: Vec<T> = random_vec(rng, sq.len(), 1.0);
    let v: Vec<T> = random_vec(rng, sq.len(), 1.0);
    let d: Vec<T> = random_vec(rng, sq.len(), 1.0);
    let nan = T::from_f64(f64::NAN);
    // The NaN rows (of out and dQ) and, for a NaN key, their neighbours (whose dV is NaN).
    let (nan_rows, nan_dv): (Vec<usize>, Vec<usize>) = match poison {
        Poison::Queries(rows) => {
            for r in rows {
                q[r * row..(r + 1) * row].fill(nan);
            }
            (rows.to_vec(), Vec::new())
        }
        Poison::Key(j) => {
            k[j * row..(j + 1) * row].fill(nan);
            let reach: Vec<usize> = (0..a.n_rows())
                .filter(|&r| a.row(r).contains(&(j as u32)))
                .collect();
            let mut cols: Vec<usize> = reach
                .iter()
                .flat_map(|&r| a.row(r).iter().map(|&c| c as usize))
                .collect();
            cols.sort_unstable();
            cols.dedup();
            (reach, cols)
        }
    };
    assert!(!nan_rows.is_empty());
    let up = |x: &[T]| DeviceMatrix::from_host(gpu, sq, x).unwrap();
    let (qd, kd, vd, dd) = (up(&q), up(&k), up(&v), up(&d));
    let all = |m: &DeviceMatrix<T>, rows: &[usize], nan: bool| -> Vec<usize> {
        let h = m.to_host().unwrap();
        let ok = |x: &T| {
            if nan {
                x.to_f64().is_nan()
            } else {
                x.to_f64().is_finite()
            }
        };
        rows.iter()
            .copied()
            .filter(|&r| !h[r * row..(r + 1) * row].iter().all(ok))
            .collect()
    };
    let others: Vec<usize> = (0..a.n_rows()).filter(|r| !nan_rows.contains(r)).collect();
    let config = AttentionConfig::new(heads, head_dim, T::KIND);
    let mut runs = 0;
    for alg in GPU_ALGORITHMS.into_iter().chain([Algorithm::Hybrid]) {
        let config = config.clone().with_algorithm(alg);
        if !AttentionPlan::supports(gpu, alg, &config) {
            continue;
        }
        let plan = AttentionPlan::new_gpu(gpu, a, config).unwrap();
        let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
        plan.forward(&qd, &kd, &vd, &mut out).unwrap();
        let ctx = format!("{alg} {} heads={heads} head_dim={head_dim}", T::NAME);
        for (bad, what) in [
            (all(&out, &nan_rows, true), "out not NaN"),
            (all(&out, &others, false), "out not finite"),
        ] {
            if !bad.is_empty() {
                failures.push(format!("{ctx}: {what} at rows {bad:?}"));
            }
        }
        for kernels in [
            BackwardKernels::Fused,
            BackwardKernels::TensorCore,
            BackwardKernels::PerEdge,
            BackwardKernels::Unfused,
        ] {
            let ([dq, _, dv], _) = fresh_grads(gpu, &plan, kernels, [&qd, &kd, &vd, &out, &dd]);
            runs += 1;
            // dQ of the other rows is finite where only queries are NaN (a NaN key reaches
            // them through a tensor-core product's masked zeros).
            let mut checks = vec![
                (all(&dq, &nan_rows, true), "dQ not NaN"),
                (all(&dv, &nan_dv, true), "dV not NaN"),
            ];
            if matches!(poison, Poison::Queries(_)) {
                checks.push((all(&dq, &others, false), "dQ not finite"));
            }
            for (bad, what) in checks {
                if !bad.is_empty() {
                    failures.push(format!("{ctx} {kernels:?}: {what} at rows {bad:?}"));
                }
            }
        }
    }
    runs
}
