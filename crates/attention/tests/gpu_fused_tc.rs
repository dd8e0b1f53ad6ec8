//! GPU tests of the fused tensor-core algorithm (`fused-tc`, BSB + mma.sync) against the f64
//! CPU reference, and its timings beside fused-csr.
//!
//! `#[ignore]`d where there is no NVIDIA GPU; run with `cargo test -- --include-ignored` or
//! from the GPU bundle. Inputs are drawn fresh (seed printed; replay with SPATTN_SEED), outputs
//! poisoned with NaN before each forward, and every forward runs twice: the second run must
//! repeat the first bit for bit (no race, split-window counters reset). Every case runs with
//! the rows in the graph's order, degree-ordered and locality-ordered (the plan's internal,
//! zero-copy renumbering): all three must match the reference.
//!
//! Tolerances (DESIGN.md): f16 ≤ 5e-3, bf16 ≤ 2e-2, f32 through tf32 ≤ 1e-3.

use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn::{Algorithm, AttentionConfig, AttentionPlan, Reorder};
use spattn_formats::Csr;
use spattn_ops::{DType, DTypeKind, DeviceMatrix, Gpu, Shape};
use spattn_test_support::*;

const ALG: Algorithm = Algorithm::FusedTensorCore;

fn gpu() -> Gpu {
    Gpu::new(0).expect("an NVIDIA GPU (this test is ignored elsewhere)")
}

/// Runs fused-tc on `inputs` (converted to `T`), twice under each row order, and checks
/// against `want`.
fn check_with<T: DType>(gpu: &Gpu, a: &Csr, inputs: &Inputs, want: &[f64], scale: Option<f32>) {
    for reorder in [
        Reorder::None,
        Reorder::Degree,
        Reorder::Locality,
        Reorder::Cluster,
    ] {
        check_order::<T>(gpu, a, inputs, want, scale, reorder);
    }
}

fn check_order<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    inputs: &Inputs,
    want: &[f64],
    scale: Option<f32>,
    reorder: Reorder,
) {
    let (heads, head_dim) = (inputs.shape_q.heads, inputs.shape_q.head_dim);
    let mut config = AttentionConfig::new(heads, head_dim, T::KIND)
        .with_algorithm(ALG)
        .with_reorder(reorder);
    if let Some(s) = scale {
        config = config.with_scale(s);
    }
    assert!(AttentionPlan::supports(gpu, ALG, &config));
    let plan = AttentionPlan::new_gpu(gpu, a, config).unwrap();
    assert_eq!(plan.algorithm(), ALG);
    // f16/bf16 heads of exactly 64 or 128 features run the pipelined kernel.
    let pipelined = T::KIND != DTypeKind::F32 && [64, 128].contains(&head_dim);
    assert_eq!(
        plan.choice().contains("_pipe"),
        pipelined,
        "{}",
        plan.choice()
    );
    if reorder != Reorder::None && a.n_rows() == a.n_cols() {
        assert!(
            plan.choice().contains(&format!("rows {reorder}-ordered")),
            "{}",
            plan.choice()
        );
    }
    let what = format!(
        "fused-tc {} rows {reorder} n={} nnz={} heads={heads} head_dim={head_dim}",
        T::NAME,
        a.n_rows(),
        a.nnz()
    );
    check_forward_twice::<T>(
        gpu,
        a,
        inputs,
        want,
        tol_tf32::<T>(),
        &what,
        |q, k, v, out| plan.forward(q, k, v, out).unwrap(),
    );
}

/// Every dtype on fresh inputs: f16 and bf16 on one grid-valued draw (one reference), f32 on
/// its own full-precision draw.
fn check_all(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    let scale = 1.0 / (head_dim as f64).sqrt();
    // The plan's default scale is 1/√head_dim in f32; the reference uses the same value.
    let scale = f64::from(scale as f32);
    let half = Inputs::draw_half(rng, a, heads, head_dim);
    let want = half.reference(a, scale);
    check_with::<f16>(gpu, a, &half, &want, None);
    check_with::<bf16>(gpu, a, &half, &want, None);
    let full = Inputs::draw::<f32>(rng, a, heads, head_dim, 1.0);
    let want = full.reference(a, scale);
    check_with::<f32>(gpu, a, &full, &want, None);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn shared_graphs() {
    let gpu = gpu();
    let mut rng = fresh_rng("shared_graphs");
    for name in test_graphs(&["cora", "pubmed", "ogbn-arxiv"]) {
        let a = shared_graph(name);
        for (heads, head_dim) in [(1, 128), (8, 64), (4, 24)] {
            check_all(&gpu, &a, heads, head_dim, &mut rng);
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
        check_all(&gpu, &a, heads, head_dim, &mut rng);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn head_dims_and_heads() {
    let gpu = gpu();
    let mut rng = fresh_rng("head_dims_and_heads");
    let a = random_graph(&mut rng, 200, 5, 9);
    // 8 … 256 from the issue; 1, 3 and 100 take the element-wise (unaligned) path; 64 and 128
    // the pipelined kernel in f16/bf16, 48 the register kernel's 64-feature slice.
    for head_dim in [1, 3, 8, 24, 48, 64, 96, 100, 128, 256] {
        for heads in [1, 4, 8] {
            check_all(&gpu, &a, heads, head_dim, &mut rng);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tiny_graphs() {
    let gpu = gpu();
    let mut rng = fresh_rng("tiny_graphs");
    for n in 1..=33 {
        let a = random_graph(&mut rng, n, 3, 4);
        check_all(&gpu, &a, 2, 24, &mut rng);
        check_all(&gpu, &a, 1, 3, &mut rng);
        check_all(&gpu, &a, 1, 64, &mut rng);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn hub_row() {
    let gpu = gpu();
    let mut rng = fresh_rng("hub_row");
    // Row 777 attends to all 10^5 nodes: its window is split and merged in the kernel.
    let a = hub_graph(&mut rng, 100_000, 777);
    for (heads, head_dim) in [(1, 64), (4, 24)] {
        check_all(&gpu, &a, heads, head_dim, &mut rng);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn split_window_wide_heads() {
    let gpu = gpu();
    let mut rng = fresh_rng("split_window_wide_heads");
    // Row 5 attends to all 3000 nodes: its window (375+ blocks) is cut into parts merged in the
    // kernel; wide heads put several warps on each part (f16 256: 2 warps, f32 256: 4).
    let a = hub_graph(&mut rng, 3000, 5);
    for (heads, head_dim) in [(2, 256), (1, 100), (3, 8)] {
        check_all(&gpu, &a, heads, head_dim, &mut rng);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn dense_window() {
    let gpu = gpu();
    let mut rng = fresh_rng("dense_window");
    // Rows 0..16 all attend to columns 0..64 (8 full blocks); rows 16..40 a few random ones.
    let mut edges: Vec<(u32, u32)> = (0..16).flat_map(|r| (0..64).map(move |c| (r, c))).collect();
    for r in 16..40 {
        for _ in 0..4 {
            edges.push((r, rng.random_range(0..70)));
        }
    }
    let a = Csr::from_edges(40, 70, &edges).unwrap();
    for (heads, head_dim) in [(1, 64), (2, 128), (3, 24)] {
        check_all(&gpu, &a, heads, head_dim, &mut rng);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn extreme_and_equal_scores() {
    let gpu = gpu();
    let mut rng = fresh_rng("extreme_and_equal_scores");
    let a = random_graph(&mut rng, 500, 8, 5);
    for head_dim in [16, 64] {
        extreme_scores(&gpu, &a, head_dim, &mut rng);
    }
}

/// Scores near ±1e4 and all scores equal, for every dtype, at `head_dim` (2 heads).
fn extreme_scores(gpu: &Gpu, a: &Csr, head_dim: usize, rng: &mut Pcg64) {
    let heads = 2;
    let scale = 0.25f32;
    // Scores near ±1e4: Q scaled up (f32 through 3xTF32 scores; f16/bf16 with exact products).
    for amp in [2.5e3, 1e4] {
        let x = Inputs::draw::<f32>(rng, a, heads, head_dim, amp);
        check_with::<f32>(gpu, a, &x, &x.reference(a, 0.25), Some(scale));
        let x = Inputs::draw::<f16>(rng, a, heads, head_dim, amp);
        check_with::<f16>(gpu, a, &x, &x.reference(a, 0.25), Some(scale));
        let x = Inputs::draw::<bf16>(rng, a, heads, head_dim, amp);
        check_with::<bf16>(gpu, a, &x, &x.reference(a, 0.25), Some(scale));
    }
    // All scores equal: Q = 0, so every row is the mean of its neighbours' V.
    let mut x = Inputs::draw_half(rng, a, heads, head_dim);
    x.q.iter_mut().for_each(|q| *q = 0.0);
    let want = x.reference(a, 0.25);
    check_with::<f32>(gpu, a, &x, &want, Some(scale));
    check_with::<f16>(gpu, a, &x, &want, Some(scale));
    check_with::<bf16>(gpu, a, &x, &want, Some(scale));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn errors_are_typed() {
    let gpu = gpu();
    let a = Csr::from_edges(3, 3, &[(0, 1), (1, 2)]).unwrap();
    let config = AttentionConfig::new(2, 4, DTypeKind::F16).with_algorithm(ALG);
    let plan = AttentionPlan::new_gpu(&gpu, &a, config).unwrap();
    let good = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(3, 2, 4).unwrap()).unwrap();
    let bad = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(3, 2, 5).unwrap()).unwrap();
    let mut out = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(3, 2, 4).unwrap()).unwrap();
    let e = plan.forward(&good, &bad, &good, &mut out).unwrap_err();
    assert!(
        matches!(e, spattn::Error::ShapeMismatch { what: "K", .. }),
        "{e}"
    );
    // A head wider than the kernels cover is refused with the reason, not run.
    let wide = AttentionConfig::new(1, 4096, DTypeKind::F16).with_algorithm(ALG);
    assert!(!AttentionPlan::supports(&gpu, ALG, &wide));
    let e = AttentionPlan::new_gpu(&gpu, &a, wide).unwrap_err();
    assert!(matches!(e, spattn::Error::Unsupported { .. }), "{e}");
}

/// GPU time of `plan.forward` in milliseconds after warm-up: the median of `runs` single
/// launches (CUDA events around each), and the mean of `runs` launches back to back between
/// one pair of events (host launch gaps hidden).
fn time_plan<T: DType>(
    gpu: &Gpu,
    plan: &AttentionPlan,
    runs: usize,
    rng: &mut Pcg64,
) -> (f64, f64) {
    let sq = plan.shape_q();
    let skv = plan.shape_kv();
    let q = DeviceMatrix::from_host(gpu, sq, &random_vec::<T>(rng, sq.len(), 1.0)).unwrap();
    let k = DeviceMatrix::from_host(gpu, skv, &random_vec::<T>(rng, skv.len(), 1.0)).unwrap();
    let v = DeviceMatrix::from_host(gpu, skv, &random_vec::<T>(rng, skv.len(), 1.0)).unwrap();
    let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
    let mut time = |n: usize| {
        f64::from(
            gpu.time_ms(|| {
                for _ in 0..n {
                    plan.forward(&q, &k, &v, &mut out).map_err(|e| {
                        spattn_ops::Error::InvalidArgument {
                            what: "forward",
                            why: e.to_string(),
                        }
                    })?;
                }
                Ok(())
            })
            .unwrap(),
        )
    };
    time(5);
    let mut single: Vec<f64> = (0..runs).map(|_| time(1)).collect();
    single.sort_by(f64::total_cmp);
    let batched = time(runs) / runs as f64;
    (single[runs / 2], batched)
}

/// Prints fused-tc with the rows in the graph's order and as `Reorder::Auto` chooses (f16 and
/// f32, head_dim 64/128, heads 1/8), and fused-csr at f16 d=128 h=1: timings only, no
/// assertion. Graphs: cora, pubmed, ogbn-arxiv, R-MAT 16 and 18 by default.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn timings() {
    let gpu = gpu();
    let mut rng = fresh_rng("timings");
    println!("device: {}", gpu.name());
    // SPATTN_TIMING_GRAPHS: a comma list of shared graph names and rmatNN (default below);
    // SPATTN_TIMING_QUICK: only f16, 1 head, head_dim 128 (the issue-5 bars' shape).
    let list = std::env::var("SPATTN_TIMING_GRAPHS")
        .unwrap_or_else(|_| "cora,pubmed,ogbn-arxiv,rmat16,rmat18".into());
    let graphs: Vec<(String, Csr)> = list
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|n| match n.strip_prefix("rmat") {
            Some(scale) => (n.to_string(), rmat_graph(scale.parse().unwrap())),
            None => (n.to_string(), shared_graph(n)),
        })
        .collect();
    let quick = std::env::var("SPATTN_TIMING_QUICK").is_ok();
    let dtypes: &[DTypeKind] = if quick {
        &[DTypeKind::F16]
    } else {
        &[DTypeKind::F16, DTypeKind::F32]
    };
    let shapes: &[(usize, usize)] = if quick {
        &[(1, 128)]
    } else {
        &[(1, 64), (1, 128), (8, 64), (8, 128)]
    };
    for (name, a) in &graphs {
        for &dtype in dtypes {
            for &(heads, d) in shapes {
                let mut cell = Vec::new();
                let mut cases = vec![
                    (Algorithm::FusedTensorCore, Reorder::None),
                    (Algorithm::FusedTensorCore, Reorder::Auto),
                ];
                if dtype == DTypeKind::F16 && heads == 1 && d == 128 {
                    cases.push((Algorithm::FusedCsr, Reorder::None));
                }
                for (alg, reorder) in cases {
                    let config = AttentionConfig::new(heads, d, dtype)
                        .with_algorithm(alg)
                        .with_reorder(reorder);
                    let t0 = std::time::Instant::now();
                    let plan = AttentionPlan::new_gpu(&gpu, a, config).unwrap();
                    let plan_ms = t0.elapsed().as_secs_f64() * 1e3;
                    let (single, batched) = match dtype {
                        DTypeKind::F32 => time_plan::<f32>(&gpu, &plan, 30, &mut rng),
                        _ => time_plan::<f16>(&gpu, &plan, 30, &mut rng),
                    };
                    cell.push(format!("{alg}/{reorder} {single:.4} ({batched:.4})"));
                    if reorder == Reorder::Auto {
                        println!(
                            "plan {name} {dtype} h={heads} d={d}: {} [plan {plan_ms:.0} ms]",
                            plan.choice()
                        );
                    }
                }
                println!(
                    "timing {name:>10} n={:>7} nnz={:>8} {dtype} h={heads} d={d:>3}: {}",
                    a.n_rows(),
                    a.nnz(),
                    cell.join(" | ")
                );
            }
        }
    }
}
