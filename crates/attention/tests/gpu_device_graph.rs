//! GPU tests of plans over graphs built on the GPU (`DeviceGraph::from_device_edges`): every
//! algorithm's forward equals the same plan's over the host-built graph in the same row order
//! (bit for bit where both run one kernel over the same format), both match the f64 reference,
//! and the backward (which reads the device-built transpose) matches it too; fused-tc's extras,
//! whose edge maps are made on the device for such graphs, match the f64 reference.
//!
//! `#[ignore]`d where there is no NVIDIA GPU. Inputs are drawn fresh (seed printed; replay with
//! SPATTN_SEED), outputs poisoned with NaN before each forward.

use std::sync::Arc;

use rand::seq::SliceRandom;
use rand_pcg::Pcg64;
use spattn::ops::{DeviceEdges, DeviceIds, GraphSpec};
use spattn::{
    Algorithm, AttentionConfig, AttentionPlan, BackwardKernels, DTypeKind, DeviceBias, DeviceGraph,
    Dropout, Extras, ExtrasGrads, PlanPolicy, Reorder,
};
use spattn_formats::Csr;
use spattn_ops::cpu::{
    attention_backward_f64_from, attention_extras_backward_f64_from, attention_extras_f64_from,
    attention_f64_from, rel_l2_error, AttentionInputs, EdgeBias, Extras as CpuExtras,
};
use spattn_ops::{bf16, f16, DType, DeviceMatrix, DeviceVec, Gpu, Shape};
use spattn_test_support::*;

const ALGORITHMS: [Algorithm; 6] = [
    Algorithm::UnfusedCsr,
    Algorithm::FusedCsr,
    Algorithm::UnfusedTensorCore,
    Algorithm::FusedTensorCore,
    Algorithm::Hybrid,
    Algorithm::Auto,
];

/// `a` rebuilt on the device from its edges, shuffled, as PyG's int64 `edge_index` rows; with
/// the reverse edges asked for where `symmetrize` (then `a` must be symmetric: the graph is
/// `a`, known symmetric).
fn device_graph(gpu: &Gpu, rng: &mut Pcg64, a: &Csr, symmetrize: bool) -> Arc<DeviceGraph> {
    let mut e: Vec<(i64, i64)> = a
        .row_indices()
        .into_iter()
        .zip(a.col_indices().iter().copied())
        .map(|(r, c)| (i64::from(c), i64::from(r)))
        .collect();
    e.shuffle(rng);
    // One buffer holding both rows, as a contiguous 2 x E tensor.
    let flat: Vec<i64> = e.iter().map(|x| x.0).chain(e.iter().map(|x| x.1)).collect();
    let d = DeviceVec::from_host(gpu, &flat).unwrap();
    let ids = DeviceVec::from_host(gpu, &flat[e.len()..]).unwrap();
    let edges = DeviceEdges {
        sources: DeviceIds::contiguous(&d),
        targets: DeviceIds::contiguous(&ids),
        len: e.len(),
    };
    let spec = GraphSpec {
        n_rows: a.n_rows(),
        n_cols: a.n_cols(),
        transpose: true,
        symmetrize,
        ..GraphSpec::square(a.n_rows())
    };
    let (g, report) = DeviceGraph::from_device_edges(gpu, &edges, &spec, None).unwrap();
    assert_eq!(report.duplicates, 0);
    assert!(g.built_on_device());
    assert_eq!(g.csr().unwrap().to_host().unwrap(), *a);
    Arc::new(g)
}

/// The tolerance of `T` on `alg` (f32 on tensor cores: tf32's).
fn tol<T: DType>(alg: Algorithm) -> f64 {
    match alg {
        Algorithm::UnfusedTensorCore | Algorithm::FusedTensorCore | Algorithm::Hybrid => {
            tol_tf32::<T>()
        }
        _ => tolerance::<T>(),
    }
}

fn check<T: DType>(
    gpu: &Gpu,
    rng: &mut Pcg64,
    a: &Csr,
    dg: &Arc<DeviceGraph>,
    heads: usize,
    d: usize,
) {
    let sq = Shape::new(a.n_rows(), heads, d).unwrap();
    let skv = Shape::new(a.n_cols(), heads, d).unwrap();
    let q: Vec<T> = random_vec(rng, sq.len(), 1.0);
    let k: Vec<T> = random_vec(rng, skv.len(), 1.0);
    let v: Vec<T> = random_vec(rng, skv.len(), 1.0);
    let d_out: Vec<T> = random_vec(rng, sq.len(), 1.0);
    let (q64, k64, v64, o64) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&d_out));
    let inputs = AttentionInputs::new(&q64, sq, &k64, skv, &v64, skv);
    let scale = AttentionConfig::new(heads, d, T::KIND).scale();
    let want = attention_backward_f64_from(a, &inputs, f64::from(scale), &o64).unwrap();
    let want_out = attention_f64_from(a, &inputs, f64::from(scale)).unwrap();
    let up = |s, x: &[T]| DeviceMatrix::from_host(gpu, s, x).unwrap();
    let (dq_in, dk_in, dv_in, dout) = (up(sq, &q), up(skv, &k), up(skv, &v), up(sq, &d_out));
    // The device graph's policy, so that `Auto` resolves the same on both.
    let host_graph = Arc::new(DeviceGraph::new(gpu, a.clone()));
    host_graph.set_policy(dg.policy());
    for alg in ALGORITHMS {
        let config = AttentionConfig::new(heads, d, T::KIND)
            .with_algorithm(alg)
            .with_reorder(Reorder::None);
        if !AttentionPlan::supports(gpu, alg, &config) {
            continue;
        }
        let what = format!(
            "{alg} {} n={} nnz={} {heads}x{d}",
            T::NAME,
            a.n_rows(),
            a.nnz()
        );
        let on_device = AttentionPlan::on_graph(dg, config.clone()).unwrap();
        let on_host = AttentionPlan::on_graph(&host_graph, config).unwrap();
        assert_eq!(on_device.algorithm(), on_host.algorithm(), "{what}");
        let mut outs = Vec::new();
        for plan in [&on_device, &on_host] {
            let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
            out.fill_nan().unwrap();
            plan.forward(&dq_in, &dk_in, &dv_in, &mut out).unwrap();
            outs.push(out.to_host().unwrap());
        }
        let err = rel_l2_error(&to_f64(&outs[0]), &want_out);
        assert!(err <= tol::<T>(alg), "{what}: forward rel error {err:e}");
        // One kernel over the same format, with no floating-point atomics (unfused-csr's SpMM
        // sums split rows atomically).
        let same_format = matches!(
            on_device.algorithm(),
            Algorithm::FusedCsr | Algorithm::FusedTensorCore
        );
        if same_format {
            let differ = (0..outs[0].len())
                .find(|&i| outs[0][i].to_f64().to_bits() != outs[1][i].to_f64().to_bits());
            if let Some(i) = differ {
                panic!(
                    "{what}: device graph's output differs from the host graph's at {i}: {} vs \
                     {} (ran {}: {})",
                    outs[0][i].to_f64(),
                    outs[1][i].to_f64(),
                    on_device.algorithm(),
                    on_device.choice()
                );
            }
        }
        let mut out = up(sq, &outs[0]);
        on_device.forward(&dq_in, &dk_in, &dv_in, &mut out).unwrap();
        let mut g = [
            DeviceMatrix::<T>::zeros(gpu, sq).unwrap(),
            DeviceMatrix::<T>::zeros(gpu, skv).unwrap(),
            DeviceMatrix::<T>::zeros(gpu, skv).unwrap(),
        ];
        for m in &mut g {
            m.fill_nan().unwrap();
        }
        let [dq, dk, dv] = &mut g;
        on_device
            .backward(&dq_in, &dk_in, &dv_in, &out, &dout, dq, dk, dv)
            .unwrap();
        for (m, w, name) in [
            (&*dq, &want.dq, "dQ"),
            (&*dk, &want.dk, "dK"),
            (&*dv, &want.dv, "dV"),
        ] {
            let e = rel_l2_error(&to_f64(&m.to_host().unwrap()), w);
            assert!(e <= tolerance::<T>(), "{what}: {name} rel error {e:e}");
        }
    }
}

fn check_all(gpu: &Gpu, rng: &mut Pcg64, a: &Csr, shapes: &[(usize, usize)]) {
    let dg = device_graph(gpu, rng, a, false);
    for &(heads, d) in shapes {
        check::<f32>(gpu, rng, a, &dg, heads, d);
        check::<f16>(gpu, rng, a, &dg, heads, d);
        check::<bf16>(gpu, rng, a, &dg, heads, d);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_plans_on_device_built_graphs_match_the_host_built_ones() {
    let gpu = gpu();
    let mut rng = fresh_rng("gpu_plans_on_device_built_graphs_match_the_host_built_ones");
    let shapes = [(1, 64), (8, 64), (2, 128), (3, 24)];
    let a = random_graph(&mut rng, 300, 6, 7);
    check_all(&gpu, &mut rng, &a, &shapes);
    for n in [1, 7, 17, 33] {
        let a = random_graph(&mut rng, n, 3, 4);
        check_all(&gpu, &mut rng, &a, &[(2, 64), (1, 3)]);
    }
    let a = hub_graph(&mut rng, 5000, 3);
    check_all(&gpu, &mut rng, &a, &[(2, 64)]);
    for name in test_graphs(&["cora", "pubmed"]) {
        check_all(&gpu, &mut rng, &shared_graph(name), &[(8, 64), (1, 128)]);
    }
}

/// `alg` with a per-head bias and dropout on `dg` (`a` built on the device, seen once) runs the
/// backward `expect` names, and both passes match the f64 reference. fused-tc: the forward's
/// `_x` kernel and the tensor-core backward read the extras through edge maps made on the
/// device (A's BSB, and Aᵀ's or A's standing for it). `Auto` (fused-csr on a graph seen once):
/// the fused CUDA-core backward, as the plain backward's `Auto` (no BSB built for one step).
fn check_extras_on<T: DType>(
    gpu: &Gpu,
    rng: &mut Pcg64,
    (a, dg): (&Csr, &Arc<DeviceGraph>),
    (heads, d): (usize, usize),
    (alg, expect): (Algorithm, BackwardKernels),
) {
    let s = Shape::new(a.n_rows(), heads, d).unwrap();
    let config = AttentionConfig::new(heads, d, T::KIND)
        .with_algorithm(alg)
        .with_edge_features(false);
    let plan = AttentionPlan::on_graph(dg, config).unwrap();
    let host: [Vec<T>; 4] = [0; 4].map(|_| random_vec(rng, s.len(), 1.0));
    let [q, k, v, g] = host
        .each_ref()
        .map(|x| DeviceMatrix::from_host(gpu, s, x).unwrap());
    let bias: Vec<T> = random_vec(rng, a.nnz() * heads, 1.0);
    let db = DeviceVec::from_host(gpu, &bias).unwrap();
    let dropout = Dropout::new(0.25, 11, 2).unwrap();
    let extras = Extras {
        bias: Some(DeviceBias::PerHead(&db)),
        edge_features: None,
        dropout: Some(dropout),
    };
    assert_eq!(
        plan.backward_kernels_with_extras(&extras),
        expect,
        "{} {alg}",
        T::NAME
    );
    let mut out = DeviceMatrix::<T>::zeros(gpu, s).unwrap();
    out.fill_nan().unwrap();
    plan.forward_with(&q, &k, &v, &extras, &mut out, None)
        .unwrap();
    let mut grads = [s, s, s].map(|sh| DeviceMatrix::<T>::zeros(gpu, sh).unwrap());
    let mut gb = DeviceVec::<T>::zeros(gpu, bias.len()).unwrap();
    let [gq, gk, gv] = &mut grads;
    let grads_out = ExtrasGrads {
        dq: gq,
        dk: gk,
        dv: gv,
        d_bias: Some(&mut gb),
        d_edge_features: None,
    };
    plan.backward_with_extras(&q, &k, &v, &extras, &g, grads_out)
        .unwrap();
    let [q64, k64, v64, g64] = host.each_ref().map(|x| to_f64(x));
    let bias64 = to_f64(&bias);
    let inputs = AttentionInputs::new(&q64, s, &k64, s, &v64, s);
    let cpu_extras = CpuExtras {
        bias: Some(EdgeBias::PerHead(&bias64[..])),
        edge_features: None,
        dropout: Some(dropout),
    };
    let scale = f64::from(plan.config().scale());
    let (want_out, _) = attention_extras_f64_from(a, &inputs, scale, &cpu_extras).unwrap();
    let want = attention_extras_backward_f64_from(a, &inputs, scale, &cpu_extras, &g64).unwrap();
    let got = |m: &DeviceMatrix<T>| to_f64(&m.to_host().unwrap());
    for (name, got, want) in [
        ("out", got(&out), &want_out),
        ("dQ", got(&grads[0]), &want.dq),
        ("dK", got(&grads[1]), &want.dk),
        ("dV", got(&grads[2]), &want.dv),
        (
            "dBias",
            to_f64(&gb.to_host().unwrap()),
            want.d_bias.as_ref().unwrap(),
        ),
    ] {
        let what = format!("{} n={} {heads}x{d}: {name}", T::NAME, a.n_rows());
        let err = rel_l2_error(&got, want);
        assert!(err <= tolerance::<T>(), "{what}: rel error {err:e}");
    }
}

/// Graphs built on the device with a bias and dropout on fused-tc: directed ones (Aᵀ's own
/// BSB in the backward) and symmetrized ones (A's BSB stands for Aᵀ's); and on `Auto`'s
/// fused-csr, whose backward keeps off the tensor-core passes on these graphs seen once.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_extras_on_device_built_graphs_match_the_f64_reference() {
    let gpu = gpu();
    let mut rng = fresh_rng("gpu_extras_on_device_built_graphs_match_the_f64_reference");
    let graphs = [
        random_graph(&mut rng, 300, 6, 7),
        hub_graph(&mut rng, 5000, 3),
        shared_graph("cora"),
    ];
    for a in &graphs {
        for symmetrize in [false, true] {
            let a = if symmetrize {
                a.symmetrize().unwrap()
            } else {
                a.clone()
            };
            let dg = device_graph(&gpu, &mut rng, &a, symmetrize);
            let tc = (Algorithm::FusedTensorCore, BackwardKernels::TensorCore);
            check_extras_on::<f16>(&gpu, &mut rng, (&a, &dg), (2, 32), tc);
            check_extras_on::<bf16>(&gpu, &mut rng, (&a, &dg), (8, 64), tc);
            let auto = (Algorithm::Auto, BackwardKernels::Fused);
            check_extras_on::<f16>(&gpu, &mut rng, (&a, &dg), (2, 32), auto);
            check_extras_on::<bf16>(&gpu, &mut rng, (&a, &dg), (8, 64), auto);
        }
    }
}

/// Heads of up to 32 features on a graph of more than 2²⁰ edges seen once (`Auto` plans
/// fused-tc, its rows in the graph's order) take the fused CUDA-core backward with a bias, and
/// without one up to 128 features in all, faster there than the tensor-core passes (with Aᵀ's
/// BSB built for the step); wider heads, an explicit row order and a reused graph keep the
/// tensor-core backward. All match the f64 reference.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_large_graphs_seen_once_take_the_fused_backward_on_narrow_heads() {
    let gpu = gpu();
    let mut rng = fresh_rng("gpu_large_graphs_seen_once_take_the_fused_backward_on_narrow_heads");
    let a = random_graph(&mut rng, 1 << 17, 8, 0);
    assert!(a.nnz() > 1 << 20, "{} edges", a.nnz());
    let dg = device_graph(&gpu, &mut rng, &a, false);
    let fused = (Algorithm::Auto, BackwardKernels::Fused);
    check_extras_on::<f16>(&gpu, &mut rng, (&a, &dg), (2, 32), fused);
    let tc = (Algorithm::Auto, BackwardKernels::TensorCore);
    check_extras_on::<bf16>(&gpu, &mut rng, (&a, &dg), (1, 64), tc);
    // The plain backward of every algorithm, on the fused passes (asserted below).
    check::<f16>(&gpu, &mut rng, &a, &dg, 2, 32);
    let bias: Vec<f16> = random_vec(&mut rng, a.nnz() * 2, 1.0);
    let db = DeviceVec::from_host(&gpu, &bias).unwrap();
    let with = |b: bool| Extras {
        bias: b.then_some(DeviceBias::PerHead(&db)),
        edge_features: None,
        dropout: Some(Dropout::new(0.1, 1, 0).unwrap()),
    };
    let plan_with = |reorder: Reorder, heads: usize, head_dim: usize| {
        let config = AttentionConfig::new(heads, head_dim, DTypeKind::F16)
            .with_edge_features(false)
            .with_reorder(reorder);
        AttentionPlan::on_graph(&dg, config).unwrap()
    };
    let plan = plan_with(Reorder::Auto, 2, 32);
    assert_eq!(plan.algorithm(), Algorithm::FusedTensorCore);
    let fused = BackwardKernels::Fused;
    assert_eq!(plan.backward_kernels_with_extras(&with(true)), fused);
    assert_eq!(plan.backward_kernels_with_extras(&with(false)), fused);
    assert!(!plan.keeps_row_stats::<f16>());
    let tc = BackwardKernels::TensorCore;
    let eight = plan_with(Reorder::Auto, 8, 32);
    assert_eq!(eight.backward_kernels_with_extras(&with(true)), fused);
    assert_eq!(eight.backward_kernels_with_extras(&with(false)), tc);
    assert!(eight.keeps_row_stats::<f16>());
    let wide = plan_with(Reorder::Auto, 2, 64);
    assert_eq!(wide.backward_kernels_with_extras(&with(true)), tc);
    assert!(wide.keeps_row_stats::<f16>());
    let degree = plan_with(Reorder::Degree, 2, 32);
    assert_eq!(degree.backward_kernels_with_extras(&with(true)), tc);
    assert!(degree.keeps_row_stats::<f16>());
    dg.set_policy(PlanPolicy::Reuse);
    let reused = plan_with(Reorder::Auto, 2, 32);
    assert_eq!(reused.backward_kernels_with_extras(&with(false)), tc);
    assert!(reused.keeps_row_stats::<f16>());
}
