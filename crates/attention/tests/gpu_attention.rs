//! GPU tests of every implemented attention algorithm against the f64 CPU reference.
//!
//! `#[ignore]`d where there is no NVIDIA GPU; run with `cargo test -- --include-ignored` or
//! from the GPU bundle. Inputs are drawn fresh (seed printed; replay with SPATTN_SEED), outputs
//! poisoned with NaN before each forward.

use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn::{Algorithm, AttentionConfig, AttentionPlan};
use spattn_formats::{Csr, Reorder};
use spattn_ops::cpu::{attention_f64_from, rel_l2_error, AttentionInputs};
use spattn_ops::{DType, DTypeKind, DeviceMatrix, Gpu, Shape};
use spattn_test_support::*;

const GPU_ALGORITHMS: [Algorithm; 5] = [
    Algorithm::UnfusedCsr,
    Algorithm::FusedCsr,
    Algorithm::UnfusedTensorCore,
    Algorithm::FusedTensorCore,
    Algorithm::Auto,
];

/// DESIGN.md's tolerance for `T`, with f32 on tensor cores held to tf32's (1e-3).
fn tol<T: DType>(ran: Algorithm) -> f64 {
    let tensor_cores = matches!(
        ran,
        Algorithm::UnfusedTensorCore | Algorithm::FusedTensorCore | Algorithm::Hybrid
    );
    if T::NAME == "f32" && tensor_cores {
        1e-3
    } else {
        tolerance::<T>()
    }
}

fn gpu() -> Gpu {
    Gpu::new(0).expect("an NVIDIA GPU (this test is ignored elsewhere)")
}

/// Runs each of `algs` on `a` with one set of fresh random inputs (Q scaled by `amp`) and
/// compares each with the same f64 reference, twice (the second run catches state left behind).
#[allow(clippy::too_many_arguments)]
fn check_algs<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    algs: &[Algorithm],
    heads: usize,
    head_dim: usize,
    rng: &mut Pcg64,
    amp: f64,
    autotune: bool,
) {
    let config = AttentionConfig::new(heads, head_dim, T::KIND).with_autotune(autotune);
    check_config::<T>(gpu, a, algs, config, rng, amp);
}

/// [`check_algs`] with the rest of the configuration given (heads, head_dim, dtype `T`).
fn check_config<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    algs: &[Algorithm],
    config: AttentionConfig,
    rng: &mut Pcg64,
    amp: f64,
) {
    let (heads, head_dim, autotune) = (config.heads, config.head_dim, config.autotune);
    let sq = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let skv = Shape::new(a.n_cols(), heads, head_dim).unwrap();
    let q: Vec<T> = random_vec(rng, sq.len(), amp);
    let k: Vec<T> = random_vec(rng, skv.len(), 1.0);
    let v: Vec<T> = random_vec(rng, skv.len(), 1.0);
    let dq = DeviceMatrix::from_host(gpu, sq, &q).unwrap();
    let dk = DeviceMatrix::from_host(gpu, skv, &k).unwrap();
    let dv = DeviceMatrix::from_host(gpu, skv, &v).unwrap();
    let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
    let (q64, k64, v64) = (to_f64(&q), to_f64(&k), to_f64(&v));
    let inputs = AttentionInputs::new(&q64, sq, &k64, skv, &v64, skv);
    let want = attention_f64_from(a, &inputs, config.scale() as f64).unwrap();
    for &alg in algs {
        let config = config.clone().with_algorithm(alg);
        if !AttentionPlan::supports(gpu, alg, &config) {
            continue;
        }
        let plan = AttentionPlan::new_gpu(gpu, a, config).unwrap();
        if autotune && alg == Algorithm::Auto {
            // The plan runs the candidate it reports as the fastest.
            let head = format!("autotuned: {} (", plan.algorithm());
            assert!(plan.choice().starts_with(&head), "{}", plan.choice());
        }
        for run in 0..2 {
            out.fill_nan().unwrap();
            plan.forward(&dq, &dk, &dv, &mut out).unwrap();
            let got = out.to_host().unwrap();
            let err = rel_l2_error(&to_f64(&got), &want);
            assert!(
                err <= tol::<T>(plan.algorithm()),
                "{alg} (ran {}) {} n={} nnz={} heads={heads} head_dim={head_dim} amp={amp}: rel error {err:e} (run {run})",
                plan.algorithm(),
                T::NAME,
                a.n_rows(),
                a.nnz()
            );
            // Rows without edges are exactly zero.
            for r in (0..a.n_rows()).filter(|&r| a.degree(r) == 0) {
                let row = &got[r * sq.row_len()..(r + 1) * sq.row_len()];
                assert!(
                    row.iter().all(|x| x.to_f64() == 0.0),
                    "{alg}: empty row {r} not zero"
                );
            }
        }
    }
}

fn check_all<T: DType>(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    check_algs::<T>(gpu, a, &GPU_ALGORITHMS, heads, head_dim, rng, 1.0, false);
}

fn check_all_dtypes(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    check_all::<f32>(gpu, a, heads, head_dim, rng);
    check_all::<f16>(gpu, a, heads, head_dim, rng);
    check_all::<bf16>(gpu, a, heads, head_dim, rng);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn shared_graphs() {
    let gpu = gpu();
    let mut rng = fresh_rng("shared_graphs");
    for name in test_graphs(&["cora", "pubmed", "ogbn-arxiv"]) {
        let a = shared_graph(name);
        for (heads, head_dim) in [(1, 128), (8, 64), (4, 24)] {
            check_all_dtypes(&gpu, &a, heads, head_dim, &mut rng);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rmat_16() {
    let gpu = gpu();
    let mut rng = fresh_rng("rmat_16");
    let a = rmat_graph(16);
    for (heads, head_dim) in [(1, 128), (8, 16)] {
        check_all_dtypes(&gpu, &a, heads, head_dim, &mut rng);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn head_dims_heads_and_tiny_graphs() {
    let gpu = gpu();
    let mut rng = fresh_rng("head_dims_heads_and_tiny_graphs");
    let a = random_graph(&mut rng, 200, 5, 9);
    for head_dim in [1, 3, 8, 24, 64, 96, 128, 256] {
        for heads in [1, 4, 8] {
            check_all_dtypes(&gpu, &a, heads, head_dim, &mut rng);
        }
    }
    for n in 1..=33 {
        let a = random_graph(&mut rng, n, 3, 4);
        check_all_dtypes(&gpu, &a, 2, 24, &mut rng);
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
    // Scores near ±1e4: Q scaled up so that scale·q·k reaches 1e4 (f32: no overflow, no NaN).
    let b = random_graph(&mut rng, 500, 8, 5);
    // unfused-tc is left out for f32 here: its SDDMM rounds Q and K to tf32 (10-bit mantissa),
    // so a score of 1e4 carries an absolute error of ~5 and the softmax is not within 1e-3 —
    // the documented limit of tf32. fused-tc computes f32 scores with 3xTF32 and keeps them.
    let exact_f32: Vec<Algorithm> = GPU_ALGORITHMS
        .into_iter()
        .filter(|&a| a != Algorithm::UnfusedTensorCore)
        .collect();
    check_algs::<f32>(&gpu, &b, &exact_f32, 2, 16, &mut rng, 2.5e3, false);
    check_algs::<f16>(&gpu, &b, &GPU_ALGORITHMS, 2, 16, &mut rng, 30.0, false);
    // All scores equal: Q = 0.
    let plan = AttentionPlan::new_gpu(
        &gpu,
        &b,
        AttentionConfig::new(1, 8, spattn_ops::DTypeKind::F32),
    )
    .unwrap();
    let s = plan.shape_q();
    let zeros = vec![0.0f32; s.len()];
    let v: Vec<f32> = (0..s.len()).map(|_| rng.random_range(-1.0..1.0)).collect();
    let got = plan.forward_host(&zeros, &zeros, &v).unwrap();
    let want = attention_f64_from(
        &b,
        &AttentionInputs::new(&zeros, s, &zeros, s, &v, s),
        1.0 / 8f64.sqrt(),
    )
    .unwrap();
    assert!(rel_l2_error(&got, &want) <= 1e-5);
}

/// fused-csr runs its units in a row order of its own (units cut from the row-renumbered mask,
/// naming the caller's rows for Q, the output and the merge of split rows): every order, on a
/// graph with a hub row split across units, empty rows, and cora.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fused_csr_row_orders() {
    let gpu = gpu();
    let mut rng = fresh_rng("fused_csr_row_orders");
    let hub = hub_graph(&mut rng, 5_000, 300);
    let sparse = random_graph(&mut rng, 333, 2, 4);
    for a in [hub, sparse, shared_graph("cora")] {
        assert!(a.n_rows() > 0);
        for r in Reorder::ALL {
            let c = |dtype| {
                AttentionConfig::new(2, 64, dtype)
                    .with_algorithm(Algorithm::FusedCsr)
                    .with_reorder(r)
            };
            let plan = AttentionPlan::new_gpu(&gpu, &a, c(DTypeKind::F16)).unwrap();
            assert!(plan.choice().contains(" row order ("), "{}", plan.choice());
            let fc = [Algorithm::FusedCsr];
            check_config::<f32>(&gpu, &a, &fc, c(DTypeKind::F32), &mut rng, 1.0);
            check_config::<f16>(&gpu, &a, &fc, c(DTypeKind::F16), &mut rng, 1.0);
            check_config::<bf16>(&gpu, &a, &fc, c(DTypeKind::Bf16), &mut rng, 1.0);
        }
    }
}

/// `Auto` with autotuning: the plan keeps (and runs) the candidate it reports as fastest, in
/// every dtype, on the shared graphs' smallest and a mid-size one.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn autotune_runs_the_fastest_candidate() {
    let gpu = gpu();
    let mut rng = fresh_rng("autotune");
    for name in test_graphs(&["cora", "pubmed"]) {
        let a = shared_graph(name);
        check_algs::<f32>(&gpu, &a, &[Algorithm::Auto], 2, 64, &mut rng, 1.0, true);
        check_algs::<f16>(&gpu, &a, &[Algorithm::Auto], 1, 128, &mut rng, 1.0, true);
        check_algs::<bf16>(&gpu, &a, &[Algorithm::Auto], 4, 24, &mut rng, 1.0, true);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn errors_are_typed() {
    let gpu = gpu();
    let a = Csr::from_edges(3, 3, &[(0, 1), (1, 2)]).unwrap();
    let plan = AttentionPlan::new_gpu(
        &gpu,
        &a,
        AttentionConfig::new(2, 4, spattn_ops::DTypeKind::F16),
    )
    .unwrap();
    let good = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(3, 2, 4).unwrap()).unwrap();
    let bad = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(3, 2, 5).unwrap()).unwrap();
    let mut out = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(3, 2, 4).unwrap()).unwrap();
    let e = plan.forward(&good, &bad, &good, &mut out).unwrap_err();
    assert!(
        matches!(e, spattn::Error::ShapeMismatch { what: "K", .. }),
        "{e}"
    );
    let f32_in = DeviceMatrix::<f32>::zeros(&gpu, Shape::new(3, 2, 4).unwrap()).unwrap();
    let mut f32_out = DeviceMatrix::<f32>::zeros(&gpu, Shape::new(3, 2, 4).unwrap()).unwrap();
    let e = plan
        .forward(&f32_in, &f32_in, &f32_in, &mut f32_out)
        .unwrap_err();
    assert!(matches!(e, spattn::Error::DTypeMismatch { .. }), "{e}");
}
