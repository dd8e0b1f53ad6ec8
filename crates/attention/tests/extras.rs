//! Plans with extras (a score bias, edge features, dropout, the weights out): the algorithm
//! choice, errors, the CPU plan against the f64 reference, and (on a GPU) the unfused-csr path's
//! and fused-csr's forward and backward against the f64 reference, with the dropout mask the
//! CPU draws.

use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn::ops::cpu::{
    self, attention_extras_backward_f64_from, attention_extras_f64_from, AttentionInputs, EdgeBias,
    Extras as CpuExtras,
};
use spattn::{
    Algorithm, AttentionConfig, AttentionPlan, BackwardKernels, Csr, DType, DTypeKind, DeviceBias,
    DeviceMatrix, DeviceVec, Dropout, Error, Extras, ExtrasGrads, Gpu, HostExtras, HybridParams,
    Reorder, Shape,
};

/// A GPU case: the algorithm, the row order, and a fixed hybrid split where given.
type Case = (Algorithm, Reorder, Option<HybridParams>);
use spattn_test_support::*;

fn ring(n: u32) -> Csr {
    let edges: Vec<(u32, u32)> = (0..n)
        .flat_map(|i| [(i, i), (i, (i + 1) % n), ((i + 1) % n, i)])
        .collect();
    Csr::from_edges(n as usize, n as usize, &edges).unwrap()
}

#[test]
fn auto_plans_for_extras_and_hybrid_takes_no_edge_features() {
    let a = ring(50);
    let config = AttentionConfig::new(2, 8, DTypeKind::F32).with_edge_extras(true);
    let plan = AttentionPlan::new_cpu(&a, config).unwrap();
    assert_eq!(plan.algorithm(), Algorithm::UnfusedCsr);
    // Every algorithm takes a bias and dropout; edge features all but hybrid (the GPU tests
    // below check the refusal and the results).
    for (alg, features) in [
        (Algorithm::UnfusedCsr, true),
        (Algorithm::FusedCsr, true),
        (Algorithm::UnfusedTensorCore, true),
        (Algorithm::FusedTensorCore, true),
        (Algorithm::Hybrid, false),
    ] {
        assert_eq!(alg.takes_edge_features(), features, "{alg}");
        let named = Algorithm::EXTRAS
            .split([',', ' '])
            .any(|word| word == alg.name());
        assert_eq!(named, features, "{alg}");
    }
}

/// The identity the GPU tests measure d_scale's error with: d_scale = Σ_i q_i · dQ_i / scale,
/// whatever the extras (a bias does not reach dQ; features enter k' = k + e on both sides;
/// dropout is in dS).
#[test]
fn the_references_d_scale_is_q_dot_dq_over_scale_with_every_extra() {
    let mut rng = fresh_rng("d_scale identity");
    let a = random_graph(&mut rng, 50, 4, 6);
    let (heads, d) = (2, 3);
    let s = Shape::new(a.n_rows(), heads, d).unwrap();
    let x = |rng: &mut Pcg64, n: usize| -> Vec<f64> {
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    };
    let (q, k, v, g) = (
        x(&mut rng, s.len()),
        x(&mut rng, s.len()),
        x(&mut rng, s.len()),
        x(&mut rng, s.len()),
    );
    let bias = x(&mut rng, a.nnz() * heads);
    let feats = x(&mut rng, a.nnz() * heads * d);
    let inputs = AttentionInputs::new(&q, s, &k, s, &v, s);
    for (with_bias, with_feats, rate) in
        [(false, false, 0.0), (true, true, 0.3), (true, false, 0.5)]
    {
        let extras = CpuExtras {
            bias: with_bias.then(|| EdgeBias::PerHead(&bias[..])),
            edge_features: with_feats.then_some(&feats[..]),
            dropout: (rate > 0.0).then(|| Dropout::new(rate, 7, 1).unwrap()),
        };
        let scale = 0.7;
        let want = attention_extras_backward_f64_from(&a, &inputs, scale, &extras, &g).unwrap();
        let identity = q.iter().zip(&want.dq).map(|(q, g)| q * g).sum::<f64>() / scale;
        let terms = q
            .iter()
            .zip(&want.dq)
            .map(|(q, g)| (q * g).abs())
            .sum::<f64>()
            / scale;
        assert!(
            (identity - want.d_scale).abs() <= 1e-12 * terms,
            "bias {with_bias} features {with_feats} rate {rate}: {} vs {identity}",
            want.d_scale
        );
    }
}

#[test]
fn the_cpu_plan_matches_the_f64_reference_and_checks_its_operands() {
    let mut rng = fresh_rng("cpu plan with extras");
    let a = random_graph(&mut rng, 60, 5, 7);
    let (heads, d) = (3, 4);
    let s = Shape::new(a.n_rows(), heads, d).unwrap();
    let x = |rng: &mut Pcg64, n: usize| -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0..1.0)).collect()
    };
    let (q, k, v) = (
        x(&mut rng, s.len()),
        x(&mut rng, s.len()),
        x(&mut rng, s.len()),
    );
    let bias = x(&mut rng, a.nnz() * heads);
    let feats = x(&mut rng, a.nnz() * heads * d);
    let dropout = Dropout::new(0.25, 11, 3).unwrap();
    let config = AttentionConfig::new(heads, d, DTypeKind::F32).with_edge_extras(true);
    let plan = AttentionPlan::new_cpu(&a, config).unwrap();
    let extras = HostExtras {
        bias: Some((&bias[..], false)),
        edge_features: Some(&feats[..]),
        dropout: Some(dropout),
    };
    let (out, w) = plan.forward_with_host(&q, &k, &v, &extras).unwrap();
    let inputs = AttentionInputs::new(&q, s, &k, s, &v, s);
    let want = attention_extras_f64_from(
        &a,
        &inputs,
        f64::from(plan.config().scale()),
        &CpuExtras {
            bias: Some(EdgeBias::PerHead(&bias)),
            edge_features: Some(&feats),
            dropout: Some(dropout),
        },
    )
    .unwrap();
    assert!(cpu::rel_l2_error(&out, &want.0) < 1e-5);
    assert!(cpu::rel_l2_error(&w, &want.1) < 1e-5);
    // Wrong lengths are errors naming the operand.
    let short = [0.0f32; 3];
    let bad = HostExtras {
        bias: Some((&short[..], false)),
        ..HostExtras::default()
    };
    let e = plan.forward_with_host(&q, &k, &v, &bad).unwrap_err();
    assert!(e.to_string().contains("bias (nnz × heads)"), "{e}");
    let mut nan = vec![0.0f32; a.nnz()];
    nan[2] = f32::NAN;
    let bad = HostExtras {
        bias: Some((&nan[..], true)),
        ..HostExtras::default()
    };
    let e = plan.forward_with_host(&q, &k, &v, &bad).unwrap_err();
    assert!(e.to_string().contains("NaN at element 2"), "{e}");
}

/// Runs `alg` (Auto: the plan's choice, fused-csr) with every extra on `a` in `T` and checks
/// the output with the weights out (the unfused composition) and without (fused-csr's kernel),
/// the weights, and every gradient against the f64 reference (the dropout mask is the CPU's by
/// construction).
fn check_gpu_extras<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    case: Case,
    heads: usize,
    d: usize,
    shared: bool,
    rate: f32,
) {
    check_gpu_extras_with::<T>(gpu, a, case, heads, d, Some(shared), rate);
}

/// [`check_gpu_extras`] with the bias optional: `bias` None for none, else whether it is shared
/// by the heads.
fn check_gpu_extras_with<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    case: Case,
    heads: usize,
    d: usize,
    bias_shared: Option<bool>,
    rate: f32,
) {
    // Edge features where the algorithm takes them (hybrid takes a bias and dropout only).
    let with_feats = case.0 == Algorithm::Auto || case.0.takes_edge_features();
    check_gpu_extras_feats::<T>(gpu, a, case, (heads, d), bias_shared, rate, with_feats);
}

/// [`check_gpu_extras_with`] with the edge features given or not (`with_feats`).
fn check_gpu_extras_feats<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    case: Case,
    hd: (usize, usize),
    bias_shared: Option<bool>,
    rate: f32,
    with_feats: bool,
) {
    let auto = (BackwardKernels::Auto, None);
    check_gpu_extras_on::<T>(gpu, a, case, hd, (bias_shared, rate, with_feats), auto);
}

/// [`check_gpu_extras_feats`] with the backward's kernels named (`backward_with_extras_using`)
/// and, where `expect` is given, the set that must run for them.
fn check_gpu_extras_on<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    (alg, reorder, hybrid): Case,
    (heads, d): (usize, usize),
    (bias_shared, rate, with_feats): (Option<bool>, f32, bool),
    (kernels, expect): (BackwardKernels, Option<BackwardKernels>),
) {
    let shared = bias_shared.unwrap_or(false);
    let with_bias = bias_shared.is_some();
    let what = format!(
        "{alg}/{reorder} {hybrid:?} {} H{heads} D{d} bias {bias_shared:?} rate {rate} feats \
         {with_feats} backward {kernels:?} n {}",
        T::NAME,
        a.n_rows()
    );
    // Progress on stderr (shown with --nocapture): where a slow or stuck GPU run is.
    let started = std::time::Instant::now();
    eprintln!("{what}: planning");
    let gpu = gpu.clone();
    let mut rng = fresh_rng("gpu extras");
    let s = Shape::new(a.n_rows(), heads, d).unwrap();
    let draw = |rng: &mut Pcg64, n: usize| -> Vec<T> { random_vec::<T>(rng, n, 1.0) };
    let (q, k, v, g) = (
        draw(&mut rng, s.len()),
        draw(&mut rng, s.len()),
        draw(&mut rng, s.len()),
        draw(&mut rng, s.len()),
    );
    let bias = draw(&mut rng, a.nnz() * if shared { 1 } else { heads });
    let feats = draw(&mut rng, a.nnz() * heads * d);
    let dropout = (rate > 0.0).then(|| Dropout::new(rate, 2024, 9).unwrap());
    let config = AttentionConfig::new(heads, d, T::KIND)
        .with_edge_extras(true)
        .with_algorithm(alg)
        .with_reorder(reorder);
    let config = match hybrid {
        Some(p) => config.with_hybrid(p),
        None => config,
    };
    let plan = AttentionPlan::new_gpu(&gpu, a, config).unwrap();
    eprintln!(
        "{what}: planned in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let expected = if alg == Algorithm::Auto {
        Algorithm::FusedCsr
    } else {
        alg
    };
    assert_eq!(plan.algorithm(), expected);
    let up = |x: &[T], s: Shape| DeviceMatrix::from_host(&gpu, s, x).unwrap();
    let sf = Shape::new(a.nnz(), heads, d).unwrap();
    let (dq, dk, dv, dg, df) = (up(&q, s), up(&k, s), up(&v, s), up(&g, s), up(&feats, sf));
    let db = DeviceVec::from_host(&gpu, &bias).unwrap();
    let extras = Extras {
        bias: with_bias.then_some(if shared {
            DeviceBias::Shared(&db)
        } else {
            DeviceBias::PerHead(&db)
        }),
        edge_features: with_feats.then_some(&df),
        dropout,
    };
    if let Some(expect) = expect {
        let runs = plan.backward_kernels_with_extras_using(kernels, &extras);
        assert_eq!(runs, expect, "{what}: the set that runs");
    }
    let mut out = DeviceMatrix::<T>::zeros(&gpu, s).unwrap();
    out.fill_nan().unwrap();
    let mut w = DeviceVec::<f32>::zeros(&gpu, a.nnz() * heads).unwrap();
    plan.forward_with(&dq, &dk, &dv, &extras, &mut out, Some(&mut w))
        .unwrap();
    let (q64, k64, v64, g64) = (to_f64(&q), to_f64(&k), to_f64(&v), to_f64(&g));
    let (bias64, feats64) = (to_f64(&bias), to_f64(&feats));
    let inputs = AttentionInputs::new(&q64, s, &k64, s, &v64, s);
    let cpu_extras = CpuExtras {
        bias: with_bias.then_some(if shared {
            EdgeBias::Shared(&bias64[..])
        } else {
            EdgeBias::PerHead(&bias64[..])
        }),
        edge_features: with_feats.then_some(&feats64[..]),
        dropout,
    };
    let scale = f64::from(plan.config().scale());
    let (want, want_w) = attention_extras_f64_from(a, &inputs, scale, &cpu_extras).unwrap();
    // The composition with the weights out keeps f32's bound; the fused tensor-core kernels
    // run f32 through tf32.
    let tol = tolerance::<T>();
    let fused_tol = if matches!(alg, Algorithm::FusedTensorCore | Algorithm::Hybrid) {
        tol_tf32::<T>()
    } else {
        tol
    };
    let err = cpu::rel_l2_error(&to_f64(&out.to_host().unwrap()), &want);
    assert!(err <= tol, "{what}: out error {err:e}");
    // Without the weights out: the fused kernel (the same composition for unfused-csr).
    out.fill_nan().unwrap();
    plan.forward_with(&dq, &dk, &dv, &extras, &mut out, None)
        .unwrap();
    let err = cpu::rel_l2_error(&to_f64(&out.to_host().unwrap()), &want);
    assert!(
        err <= fused_tol,
        "{what}: out error without weights {err:e}"
    );
    let w_host = w.to_host().unwrap();
    let err = cpu::rel_l2_error(&w_host, &want_w);
    assert!(err <= tol, "{what}: weights error {err:e}");
    // The same edges dropped on the GPU and the CPU.
    for (i, (&x, &y)) in w_host.iter().zip(&want_w).enumerate() {
        assert_eq!(
            x == 0.0,
            y == 0.0,
            "{what}: element {i} dropped on one side only"
        );
    }
    // Backward.
    let (mut gq, mut gk, mut gv) = (
        DeviceMatrix::<T>::zeros(&gpu, s).unwrap(),
        DeviceMatrix::<T>::zeros(&gpu, s).unwrap(),
        DeviceMatrix::<T>::zeros(&gpu, s).unwrap(),
    );
    let mut gb = DeviceVec::<T>::zeros(&gpu, bias.len()).unwrap();
    gb.fill_nan().unwrap();
    let mut gf = DeviceMatrix::<T>::zeros(&gpu, sf).unwrap();
    for m in [&mut gq, &mut gk, &mut gv, &mut gf] {
        m.fill_nan().unwrap();
    }
    let d_scale = plan
        .backward_with_extras_using(
            kernels,
            &dq,
            &dk,
            &dv,
            &extras,
            &dg,
            ExtrasGrads {
                dq: &mut gq,
                dk: &mut gk,
                dv: &mut gv,
                d_bias: with_bias.then_some(&mut gb),
                d_edge_features: with_feats.then_some(&mut gf),
            },
        )
        .unwrap();
    eprintln!(
        "{what}: backward ran at {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let want = attention_extras_backward_f64_from(a, &inputs, scale, &cpu_extras, &g64).unwrap();
    // Gradients sum more terms than the forward: f32's bound is the backward's (1e-4 for the
    // f32 path's cancellations in dS), half precision keeps its own.
    let gtol = tol.max(1e-4);
    for (name, got, want) in [
        ("dQ", to_f64(&gq.to_host().unwrap()), &want.dq),
        ("dK", to_f64(&gk.to_host().unwrap()), &want.dk),
        ("dV", to_f64(&gv.to_host().unwrap()), &want.dv),
        (
            "d_bias",
            to_f64(&gb.to_host().unwrap()),
            want.d_bias.as_ref().unwrap_or(&Vec::new()),
        ),
        (
            "d_edge_features",
            to_f64(&gf.to_host().unwrap()),
            want.d_edge_features.as_ref().unwrap_or(&Vec::new()),
        ),
    ] {
        if (name == "d_edge_features" && !with_feats) || (name == "d_bias" && !with_bias) {
            continue;
        }
        let err = cpu::rel_l2_error(&got, want);
        assert!(err <= gtol, "{what}: {name} error {err:e}");
    }
    // d_scale = Σ_e dS_e (q_i · k'_j) = Σ_i q_i · dQ_i / scale: a sum whose terms cancel, so its
    // error is measured against the terms' magnitude, not against d_scale itself.
    let terms: f64 = q64
        .iter()
        .zip(&want.dq)
        .map(|(q, g)| (q * g).abs())
        .sum::<f64>()
        / scale;
    let identity = q64.iter().zip(&want.dq).map(|(q, g)| q * g).sum::<f64>() / scale;
    assert!(
        (identity - want.d_scale).abs() <= 1e-9 * terms.max(1e-30),
        "{what}: the reference's d_scale {} is not Σ q·dQ / scale = {identity}",
        want.d_scale
    );
    let ds_err = (f64::from(d_scale) - want.d_scale).abs() / terms.max(1e-30);
    assert!(
        ds_err <= gtol.max(1e-3),
        "{what}: dscale {d_scale} vs {} (error {ds_err:e} of the terms' {terms:e})",
        want.d_scale
    );
    eprintln!(
        "{what}: checked in {:.2} s",
        started.elapsed().as_secs_f64()
    );
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_unfused_csr_with_every_extra_matches_the_f64_reference() {
    // One GPU handle for every case: its modules load once.
    let gpu = gpu();
    let mut rng = fresh_rng("gpu extras graphs");
    let graphs = [
        shared_graph("cora"),
        random_graph(&mut rng, 300, 6, 7),
        hub_graph(&mut rng, 20_000, 3),
        rmat_graph(10),
    ];
    for a in &graphs {
        let unfused = (Algorithm::UnfusedCsr, Reorder::Auto, None);
        for (heads, d, shared, rate) in
            [(1, 1, false, 0.0), (3, 24, true, 0.1), (8, 64, false, 0.5)]
        {
            check_gpu_extras::<f32>(&gpu, a, unfused, heads, d, shared, rate);
            check_gpu_extras::<f16>(&gpu, a, unfused, heads, d, shared, rate);
            check_gpu_extras::<bf16>(&gpu, a, unfused, heads, d, shared, rate);
        }
        check_gpu_extras::<f16>(&gpu, a, unfused, 1, 128, false, 0.6);
        // Auto plans fused-csr for extras (checked in check_gpu_extras).
        check_gpu_extras::<f16>(
            &gpu,
            a,
            (Algorithm::Auto, Reorder::Auto, None),
            8,
            64,
            false,
            0.5,
        );
    }
}

/// The fused backward's graphs (a shared graph, a random one, hub rows and columns split
/// across units), each checked against the f64 reference in every dtype at `cases` (heads,
/// head_dim, dropout rate) on `Auto`'s plan, with edge features where `feats` and a bias where
/// `bias` (whether shared by the heads); returned with the generator for the caller's further
/// checks.
fn check_fused_backward_cases(
    gpu: &Gpu,
    seed: &str,
    cases: &[(usize, usize, f32)],
    (feats, bias): (bool, Option<bool>),
) -> (Vec<Csr>, Pcg64) {
    let mut rng = fresh_rng(seed);
    let graphs = vec![
        shared_graph("cora"),
        random_graph(&mut rng, 300, 6, 7),
        hub_graph(&mut rng, 20_000, 3),
    ];
    let auto = (Algorithm::Auto, Reorder::Auto, None);
    for a in &graphs {
        for &(heads, d, rate) in cases {
            check_gpu_extras_feats::<f32>(gpu, a, auto, (heads, d), bias, rate, feats);
            check_gpu_extras_feats::<f16>(gpu, a, auto, (heads, d), bias, rate, feats);
            check_gpu_extras_feats::<bf16>(gpu, a, auto, (heads, d), bias, rate, feats);
        }
    }
    (graphs, rng)
}

/// Edge features without a bias, with or without dropout, take the fused backward's two passes
/// with the features (`FusedBackward::run_with_edge_terms`): every gradient against the f64
/// reference on hub rows and columns split across units, every dtype, heads of 1 to 520
/// features (520: the per-edge composition), and two runs bitwise equal.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_edge_features_take_the_fused_backward() {
    let gpu = gpu();
    let cases = [
        (1, 1, 0.0),
        (3, 24, 0.0),
        (8, 64, 0.0),
        (2, 128, 0.0),
        (1, 8, 0.3),
        (3, 24, 0.5),
        (8, 64, 0.1),
    ];
    let (graphs, _) = check_fused_backward_cases(
        &gpu,
        "gpu edge features fused backward",
        &cases,
        (true, None),
    );
    // 520 features: past fused-csr's heads (Auto plans unfused-csr) and the fused backward's.
    let unfused = (Algorithm::UnfusedCsr, Reorder::Auto, None);
    check_gpu_extras_with::<f32>(&gpu, &graphs[1], unfused, 1, 520, None, 0.0);
    for hd in [(8, 64), (1, 24)] {
        check_extras_deterministic::<f32>(&gpu, &graphs[2], hd, true, BackwardKernels::Fused);
        check_extras_deterministic::<f16>(&gpu, &graphs[2], hd, true, BackwardKernels::Fused);
    }
}

/// Dropout alone (no bias, no edge features) takes the fused backward's two passes with the
/// kept bits and no feature row (`FusedBackward::run_with_edge_terms` without features) where they hold the head:
/// every gradient against the f64 reference on hub rows and columns split across units, every
/// dtype, and two runs bitwise equal.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_dropout_alone_takes_the_fused_backward() {
    let gpu = gpu();
    let cases = [(1, 8, 0.3), (3, 24, 0.5), (8, 64, 0.1), (2, 128, 0.2)];
    let (graphs, mut rng) =
        check_fused_backward_cases(&gpu, "gpu dropout fused backward", &cases, (false, None));
    let a = &graphs[2];
    for (heads, d) in [(8, 64), (1, 24)] {
        let s = Shape::new(a.n_rows(), heads, d).unwrap();
        let sf = Shape::new(a.nnz(), heads, d).unwrap();
        let [q, k, v, g] = [0; 4].map(|_| {
            DeviceMatrix::from_host(&gpu, s, &random_vec::<f32>(&mut rng, s.len(), 1.0)).unwrap()
        });
        let config = AttentionConfig::new(heads, d, DTypeKind::F32).with_edge_extras(true);
        let plan = AttentionPlan::new_gpu(&gpu, a, config).unwrap();
        let extras = Extras {
            bias: None,
            edge_features: None,
            dropout: Some(Dropout::new(0.3, 11, 5).unwrap()),
        };
        let what = format!("f32 H{heads} D{d} dropout alone");
        let kernels = plan.backward_kernels_with_extras(&extras);
        assert_eq!(kernels, BackwardKernels::Fused, "{what}");
        check_runs_equal(&gpu, &plan, [&q, &k, &v, &g], &extras, (s, sf, 0), &what);
    }
}

/// A score bias, per head or shared, with edge features or dropout or alone, takes the fused
/// backward's two passes where the tensor-core backward does not run (f32, edge features, heads
/// it does not hold): every gradient (dBias included) against the f64 reference on hub rows and
/// columns split across units, every dtype; a −∞ bias masking whole rows and single edges; two
/// runs bitwise equal.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_bias_takes_the_fused_backward() {
    let gpu = gpu();
    let seed = "gpu bias fused backward";
    let cases = [(1, 8, 0.0), (3, 24, 0.5), (8, 64, 0.0), (2, 128, 0.2)];
    check_fused_backward_cases(&gpu, seed, &cases, (true, Some(false)));
    check_fused_backward_cases(&gpu, seed, &cases[..2], (true, Some(true)));
    let (graphs, _) = check_fused_backward_cases(&gpu, seed, &cases, (false, Some(true)));
    check_fused_backward_cases(&gpu, seed, &cases[2..], (false, Some(false)));
    let fused = BackwardKernels::Fused;
    for hd in [(8, 64), (1, 24)] {
        check_extras_deterministic::<f32>(&gpu, &graphs[2], hd, false, fused);
        check_extras_deterministic::<f16>(&gpu, &graphs[2], hd, true, fused);
    }
    for a in &graphs[..3] {
        for shared in [false, true] {
            check_masked_backward::<f32>(&gpu, a, shared, (2, 32), fused);
            check_masked_backward::<f16>(&gpu, a, shared, (2, 128), fused);
        }
    }
}

/// Every kernel set named to `backward_with_extras_using` computes the gradients of a bias (per
/// head and shared) with dropout or not: the tensor-core passes, the fused CUDA-core passes and
/// the composition, on fused-tc's and fused-csr's plans (the tensor-core passes build their
/// BSBs for the latter), half precision against the f64 reference, hub rows and columns split
/// across units; edge features (and f32) asked of the tensor-core passes take the fused ones,
/// and each answer of `backward_kernels_with_extras_using` is checked.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_each_extras_backward_set_matches_the_f64_reference() {
    let gpu = gpu();
    let mut rng = fresh_rng("gpu extras backward sets");
    let graphs = [
        random_graph(&mut rng, 300, 6, 7),
        hub_graph(&mut rng, 20_000, 3),
    ];
    use BackwardKernels::{Fused, PerEdge, TensorCore, Unfused};
    for a in &graphs {
        // Asked, and the set that runs: PerEdge's extras run the composition.
        for (kernels, runs) in [
            (TensorCore, TensorCore),
            (Fused, Fused),
            (Unfused, Unfused),
            (PerEdge, Unfused),
        ] {
            let sets = (kernels, Some(runs));
            for alg in [Algorithm::FusedTensorCore, Algorithm::FusedCsr] {
                let case = (alg, Reorder::Auto, None);
                let per_head = (Some(false), 0.1, false);
                check_gpu_extras_on::<f16>(&gpu, a, case, (8, 32), per_head, sets);
                let shared = (Some(true), 0.0, false);
                check_gpu_extras_on::<bf16>(&gpu, a, case, (2, 64), shared, sets);
            }
        }
        let case = (Algorithm::FusedCsr, Reorder::Auto, None);
        // Edge features asked of the tensor-core passes take the fused ones; f32 too.
        let feats = (Some(false), 0.2, true);
        check_gpu_extras_on::<f16>(&gpu, a, case, (4, 16), feats, (TensorCore, Some(Fused)));
        let bias = (Some(false), 0.0, false);
        check_gpu_extras_on::<f32>(&gpu, a, case, (2, 32), bias, (TensorCore, Some(Fused)));
    }
}

/// Two backward passes with extras give bitwise-equal gradients and ∂L/∂scale, on the kernels
/// `backward_kernels_with_extras` names: edge features alone, with dropout and with a bias
/// (`features`; the fused CUDA-core passes) or a bias with dropout, per head and shared (the
/// tensor-core passes on f16 / bf16 heads they hold, the fused CUDA-core ones on f32).
fn check_extras_deterministic<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    (heads, d): (usize, usize),
    features: bool,
    expect: BackwardKernels,
) {
    let mut rng = fresh_rng("extras determinism");
    let s = Shape::new(a.n_rows(), heads, d).unwrap();
    let sf = Shape::new(a.nnz(), heads, d).unwrap();
    let up = |rng: &mut Pcg64, s: Shape| {
        DeviceMatrix::from_host(gpu, s, &random_vec::<T>(rng, s.len(), 1.0)).unwrap()
    };
    let (q, k, v, g, f) = (
        up(&mut rng, s),
        up(&mut rng, s),
        up(&mut rng, s),
        up(&mut rng, s),
        up(&mut rng, sf),
    );
    let bias = DeviceVec::from_host(gpu, &random_vec::<T>(&mut rng, a.nnz() * heads, 1.0)).unwrap();
    let one_bias = DeviceVec::from_host(gpu, &random_vec::<T>(&mut rng, a.nnz(), 1.0)).unwrap();
    let config = AttentionConfig::new(heads, d, T::KIND).with_edge_extras(true);
    let plan = AttentionPlan::new_gpu(gpu, a, config).unwrap();
    let with = |shared: Option<bool>, drop: bool| Extras {
        bias: shared.map(|shared| {
            if shared {
                DeviceBias::Shared(&one_bias)
            } else {
                DeviceBias::PerHead(&bias)
            }
        }),
        edge_features: features.then_some(&f),
        dropout: drop.then(|| Dropout::new(0.3, 11, 5).unwrap()),
    };
    // (bias: shared or not, dropout): features without and with dropout and with a bias; a
    // bias with dropout.
    let cases: &[(Option<bool>, bool)] = if features {
        &[
            (None, false),
            (None, true),
            (Some(false), true),
            (Some(true), false),
        ]
    } else {
        &[(Some(false), true), (Some(true), true)]
    };
    for &(shared, drop) in cases {
        let extras = with(shared, drop);
        let what = format!(
            "{} H{heads} D{d} features {features} shared {shared:?} dropout {drop}",
            T::NAME
        );
        assert_eq!(plan.backward_kernels_with_extras(&extras), expect, "{what}");
        let bias_len = if shared == Some(true) {
            a.nnz()
        } else {
            bias.len()
        };
        check_runs_equal(
            gpu,
            &plan,
            [&q, &k, &v, &g],
            &extras,
            (s, sf, bias_len),
            &what,
        );
    }
}

/// Two runs of `plan`'s backward with `extras` give bitwise-equal gradients and ∂L/∂scale.
fn check_runs_equal<T: DType>(
    gpu: &Gpu,
    plan: &AttentionPlan,
    [q, k, v, g]: [&DeviceMatrix<T>; 4],
    extras: &Extras<'_, T>,
    (s, sf, bias_len): (Shape, Shape, usize),
    what: &str,
) {
    let features = extras.edge_features.is_some();
    let run = || {
        let mut out = [s, s, s, sf].map(|sh| DeviceMatrix::<T>::zeros(gpu, sh).unwrap());
        let mut gb = DeviceVec::<T>::zeros(gpu, bias_len).unwrap();
        let [gq, gk, gv, gf] = &mut out;
        let d_scale = plan
            .backward_with_extras(
                q,
                k,
                v,
                extras,
                g,
                ExtrasGrads {
                    dq: gq,
                    dk: gk,
                    dv: gv,
                    d_bias: extras.bias.is_some().then_some(&mut gb),
                    d_edge_features: features.then_some(gf),
                },
            )
            .unwrap();
        let mut host = out.map(|m| m.to_host().unwrap()).to_vec();
        host.push(gb.to_host().unwrap());
        (host, d_scale)
    };
    let (first, s1) = run();
    let (second, s2) = run();
    assert_eq!(s1.to_bits(), s2.to_bits(), "{what}: d_scale");
    for (name, (x, y)) in ["dQ", "dK", "dV", "dE", "dBias"]
        .iter()
        .zip(first.iter().zip(&second))
    {
        let differ = x
            .iter()
            .zip(y)
            .filter(|(a, b)| a.to_f32().to_bits() != b.to_f32().to_bits())
            .count();
        assert_eq!(differ, 0, "{what}: {name} differs in {differ} elements");
    }
}

/// The tensor-core backward with a bias (per head and shared) and dropout: two runs bitwise equal
/// on hub windows split across units, and a −∞ bias masking whole rows and single edges against
/// the f64 reference (the sanitizers' short case).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_tensor_core_extras_backward_is_deterministic_and_masks() {
    let gpu = gpu();
    let mut rng = fresh_rng("gpu tensor-core extras determinism");
    let graphs = [shared_graph("cora"), hub_graph(&mut rng, 20_000, 3)];
    let tc = BackwardKernels::TensorCore;
    for hd in [(8, 64), (1, 24)] {
        check_extras_deterministic::<f16>(&gpu, &graphs[1], hd, false, tc);
        check_extras_deterministic::<bf16>(&gpu, &graphs[1], hd, false, tc);
    }
    for a in &graphs {
        for shared in [false, true] {
            check_masked_backward::<f16>(&gpu, a, shared, (2, 32), tc);
            check_masked_backward::<bf16>(&gpu, a, shared, (2, 32), tc);
        }
    }
}

/// A −∞ bias (per head, or `shared` by the heads) masks every edge of rows 0–4, every third
/// edge elsewhere, and 200 edges in a row past the first 70 of the longest row when it has more
/// than 300 (whole units of a split row among live ones), with dropout, at `heads × d`: the
/// gradients of the backward `expect` names are finite and match the f64 reference (masked
/// rows have no probabilities: zero gradients, and dBias 0 on masked edges).
fn check_masked_backward<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    shared: bool,
    (heads, d): (usize, usize),
    expect: BackwardKernels,
) {
    let mut rng = fresh_rng("tensor-core masked backward");
    let per_edge = if shared { 1 } else { heads };
    let mut bias = random_vec::<T>(&mut rng, a.nnz() * per_edge, 1.0);
    let offsets = a.row_offsets();
    let first_unmasked = offsets[5.min(a.n_rows())] as usize;
    let longest = (0..a.n_rows())
        .max_by_key(|&r| offsets[r + 1] - offsets[r])
        .filter(|&r| offsets[r + 1] - offsets[r] > 300)
        .map_or(0..0, |r| {
            offsets[r] as usize + 70..offsets[r] as usize + 270
        });
    for (e, b) in bias.chunks_mut(per_edge).enumerate() {
        if e < first_unmasked || e % 3 == 0 || longest.contains(&e) {
            b.fill(T::from_f32(f32::NEG_INFINITY));
        }
    }
    let s = Shape::new(a.n_rows(), heads, d).unwrap();
    let config = AttentionConfig::new(heads, d, T::KIND).with_edge_extras(true);
    let plan = AttentionPlan::new_gpu(gpu, a, config).unwrap();
    let [q, k, v, g] = [0; 4].map(|_| {
        DeviceMatrix::from_host(gpu, s, &random_vec::<T>(&mut rng, s.len(), 1.0)).unwrap()
    });
    let db = DeviceVec::from_host(gpu, &bias).unwrap();
    let dropout = Dropout::new(0.2, 3, 1).unwrap();
    let extras = Extras {
        bias: Some(if shared {
            DeviceBias::Shared(&db)
        } else {
            DeviceBias::PerHead(&db)
        }),
        edge_features: None,
        dropout: Some(dropout),
    };
    assert_eq!(
        plan.backward_kernels_with_extras(&extras),
        expect,
        "shared {shared}"
    );
    let mut grads = [s, s, s].map(|sh| DeviceMatrix::<T>::zeros(gpu, sh).unwrap());
    let mut gb = DeviceVec::<T>::zeros(gpu, bias.len()).unwrap();
    let [gq, gk, gv] = &mut grads;
    plan.backward_with_extras(
        &q,
        &k,
        &v,
        &extras,
        &g,
        ExtrasGrads {
            dq: gq,
            dk: gk,
            dv: gv,
            d_bias: Some(&mut gb),
            d_edge_features: None,
        },
    )
    .unwrap();
    let host = |m: &DeviceMatrix<T>| to_f64(&m.to_host().unwrap());
    let (q64, k64, v64, g64) = (host(&q), host(&k), host(&v), host(&g));
    let bias64 = to_f64(&bias);
    let inputs = AttentionInputs::new(&q64, s, &k64, s, &v64, s);
    let cpu_extras = CpuExtras {
        bias: Some(if shared {
            EdgeBias::Shared(&bias64[..])
        } else {
            EdgeBias::PerHead(&bias64[..])
        }),
        edge_features: None,
        dropout: Some(dropout),
    };
    let scale = f64::from(plan.config().scale());
    let want = attention_extras_backward_f64_from(a, &inputs, scale, &cpu_extras, &g64).unwrap();
    // f32's backward bound, as in check_gpu_extras_feats.
    let tol = tolerance::<T>().max(1e-4);
    for (name, got, want) in [
        ("dQ", host(&grads[0]), &want.dq),
        ("dK", host(&grads[1]), &want.dk),
        ("dV", host(&grads[2]), &want.dv),
        (
            "dBias",
            to_f64(&gb.to_host().unwrap()),
            want.d_bias.as_ref().unwrap(),
        ),
    ] {
        let what = format!(
            "masked {} n {} shared {shared}: {name}",
            T::NAME,
            a.n_rows()
        );
        assert!(got.iter().all(|x| x.is_finite()), "{what} not finite");
        let err = cpu::rel_l2_error(&got, want);
        assert!(err <= tol, "{what} error {err:e}");
    }
}

/// fused-csr with every extra, with the rows in the graph's order and renumbered (the kernel
/// maps each unit's edges back to the caller's order), on hub rows split across units, in every
/// dtype and in its plain, short-tile and split layouts (head_dim 1 to 128).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_fused_csr_with_every_extra_matches_the_f64_reference() {
    // One GPU handle for every case: its modules load once.
    let gpu = gpu();
    let mut rng = fresh_rng("gpu fused extras graphs");
    let graphs = [
        shared_graph("cora"),
        random_graph(&mut rng, 300, 6, 7),
        hub_graph(&mut rng, 20_000, 3),
        rmat_graph(10),
    ];
    for a in &graphs {
        for reorder in [Reorder::None, Reorder::Degree] {
            let fused = (Algorithm::FusedCsr, reorder, None);
            for (heads, d, shared, rate) in [
                (1, 1, false, 0.0),
                (3, 24, true, 0.1),
                (8, 64, false, 0.5),
                (2, 128, true, 0.3),
            ] {
                check_gpu_extras::<f32>(&gpu, a, fused, heads, d, shared, rate);
                check_gpu_extras::<f16>(&gpu, a, fused, heads, d, shared, rate);
                check_gpu_extras::<bf16>(&gpu, a, fused, heads, d, shared, rate);
            }
        }
    }
}

/// fused-tc with a bias, dropout and edge features: with the rows in the graph's order and
/// renumbered (the kernel maps each block's bits to the caller's edges), hub windows split
/// across units, every dtype (f32 through tf32; its edge features through the composition) and
/// its register and pipelined kernels (head_dim 20 to 256; with edge features the pipelined
/// kernels' `_xf` twins at 64 and 128, whose overflow chunks the clique's full steps take, the
/// composition elsewhere), and for f16 / bf16 heads up to 64 the tensor-core
/// backward with a bias and dropout (the cases without features); two forwards with features
/// bitwise equal.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_fused_tc_with_every_extra_matches_the_f64_reference() {
    // One GPU handle for every case: its modules load once.
    let gpu = gpu();
    let mut rng = fresh_rng("gpu fused-tc extras graphs");
    let graphs = [
        shared_graph("cora"),
        random_graph(&mut rng, 300, 6, 7),
        hub_graph(&mut rng, 20_000, 3),
        rmat_graph(10),
        // Full blocks: a step of two blocks holds 256 edges (the most a step's extras span).
        clique_graph(12, 40),
    ];
    for a in &graphs {
        for reorder in [Reorder::None, Reorder::Degree] {
            let tc = (Algorithm::FusedTensorCore, reorder, None);
            // The kernels each shape runs (fused::tc::layout_with): d 24 and 32 the 32-feature
            // register kernel (f32 too), f32 d 64 the 64-feature one, f16/bf16 d 64 and 128
            // the pipelined one, d 96 the 128-feature register kernel with prefetch, d 256 two
            // warps of 128 features per (unit, head) (f32 d 128: two of 64), d 20 the
            // 32-feature kernel on heads padded to 24 (f32: 20, whole vectors already), d 48
            // the 64-feature register kernel (f32 too).
            for (heads, d, shared, rate) in [
                (1, 32, false, 0.0),
                (2, 48, false, 0.3),
                (3, 24, true, 0.1),
                (8, 64, false, 0.5),
                (2, 128, true, 0.3),
                (1, 96, false, 0.2),
                (1, 256, true, 0.1),
                (2, 20, false, 0.4),
            ] {
                check_gpu_extras::<f16>(&gpu, a, tc, heads, d, shared, rate);
                check_gpu_extras::<bf16>(&gpu, a, tc, heads, d, shared, rate);
                if d <= 128 {
                    check_gpu_extras::<f32>(&gpu, a, tc, heads, d, shared, rate);
                }
            }
            // Dropout alone: with the per-head bias alone (1 × 32) and both (8 × 64) above, each
            // of the tensor-core backward's extras twins at both slices. Edge features alone:
            // the `_xf` forward at 64 features (the composition at the others).
            for hd in [(3, 24), (8, 64), (1, 40)] {
                check_gpu_extras_feats::<f16>(&gpu, a, tc, hd, None, 0.3, false);
                check_gpu_extras_feats::<bf16>(&gpu, a, tc, hd, None, 0.3, false);
                check_gpu_extras_feats::<f16>(&gpu, a, tc, hd, None, 0.0, true);
                check_gpu_extras_feats::<bf16>(&gpu, a, tc, hd, None, 0.0, true);
            }
        }
    }
    // Split windows merge in a fixed order: two forwards with features are bitwise equal.
    for (heads, d) in [(8, 64), (2, 128)] {
        check_forward_runs_equal::<f16>(&gpu, &graphs[2], Algorithm::FusedTensorCore, heads, d);
        check_forward_runs_equal::<bf16>(&gpu, &graphs[2], Algorithm::FusedTensorCore, heads, d);
    }
}

/// Two forwards of `alg` with edge features, a bias and dropout (its fused kernel) give
/// bitwise-equal outputs, written over NaN.
fn check_forward_runs_equal<T: DType>(gpu: &Gpu, a: &Csr, alg: Algorithm, heads: usize, d: usize) {
    let mut rng = fresh_rng("forward determinism");
    let s = Shape::new(a.n_rows(), heads, d).unwrap();
    let sf = Shape::new(a.nnz(), heads, d).unwrap();
    let up = |rng: &mut Pcg64, s: Shape| {
        DeviceMatrix::from_host(gpu, s, &random_vec::<T>(rng, s.len(), 1.0)).unwrap()
    };
    let (q, k, v, f) = (
        up(&mut rng, s),
        up(&mut rng, s),
        up(&mut rng, s),
        up(&mut rng, sf),
    );
    let bias = DeviceVec::from_host(gpu, &random_vec::<T>(&mut rng, a.nnz() * heads, 1.0)).unwrap();
    let config = AttentionConfig::new(heads, d, T::KIND)
        .with_edge_extras(true)
        .with_algorithm(alg);
    let plan = AttentionPlan::new_gpu(gpu, a, config).unwrap();
    let extras = Extras {
        bias: Some(DeviceBias::PerHead(&bias)),
        edge_features: Some(&f),
        dropout: Some(Dropout::new(0.2, 3, 1).unwrap()),
    };
    let run = || {
        let mut out = DeviceMatrix::<T>::zeros(gpu, s).unwrap();
        out.fill_nan().unwrap();
        plan.forward_with(&q, &k, &v, &extras, &mut out, None)
            .unwrap();
        out.to_host().unwrap()
    };
    let (x, y) = (run(), run());
    let differ = x
        .iter()
        .zip(&y)
        .filter(|(a, b)| a.to_f32().to_bits() != b.to_f32().to_bits())
        .count();
    assert_eq!(
        differ,
        0,
        "{alg} {} H{heads} D{d}: out differs in {differ} elements",
        T::NAME
    );
    assert!(x.iter().all(|e| !e.to_f32().is_nan()), "{alg}: NaN in out");
}

/// hybrid with a bias and dropout (its tensor-core warps through the bitmap ranks, its CUDA-core
/// warps through per-edge caller ids, in the log2 domain), with the plan's split and with fixed
/// splits that put every block on tensor cores, every edge on CUDA cores, and rows on both
/// sides, on its general kernel (every slice: d 24/32, 48, 96, f32) and its pipelined one
/// (f16/bf16 at 64 and 128, with and without a CUDA-core warp); and unfused-tc, whose extras
/// run the CUDA-core composition.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_hybrid_and_unfused_tc_with_extras_match_the_f64_reference() {
    // One GPU handle for every case: its modules load once.
    let gpu = gpu();
    let mut rng = fresh_rng("gpu hybrid extras graphs");
    let graphs = [
        shared_graph("cora"),
        random_graph(&mut rng, 300, 6, 7),
        hub_graph(&mut rng, 20_000, 3),
        rmat_graph(10),
    ];
    let fixed = |threshold, tc_warps, cd_warps| {
        Some(HybridParams {
            threshold,
            tc_warps,
            cd_warps,
        })
    };
    for a in &graphs {
        for alg in [Algorithm::Hybrid, Algorithm::UnfusedTensorCore] {
            let case = (alg, Reorder::Auto, None);
            for (heads, d, shared, rate) in [
                (1, 32, false, 0.0),
                (3, 24, true, 0.1),
                (8, 64, false, 0.5),
                (2, 128, true, 0.3),
                (2, 20, false, 0.4),
            ] {
                check_gpu_extras::<f16>(&gpu, a, case, heads, d, shared, rate);
                check_gpu_extras::<bf16>(&gpu, a, case, heads, d, shared, rate);
                if d <= 64 {
                    check_gpu_extras::<f32>(&gpu, a, case, heads, d, shared, rate);
                }
            }
        }
        // Fixed splits (threshold, tensor-core warps, CUDA-core warps): all blocks on tensor
        // cores, all edges on CUDA cores, and in between.
        let h = Algorithm::Hybrid;
        for p in [fixed(0.0, 2, 2), fixed(2.0, 1, 3), fixed(0.05, 1, 3)] {
            for (heads, d) in [(3, 24), (2, 48), (1, 96)] {
                check_gpu_extras::<f16>(&gpu, a, (h, Reorder::Auto, p), heads, d, true, 0.2);
            }
            check_gpu_extras::<f32>(&gpu, a, (h, Reorder::Auto, p), 2, 32, false, 0.2);
        }
        for p in [
            fixed(0.0, 2, 0),
            fixed(2.0, 1, 1),
            fixed(0.05, 1, 1),
            fixed(0.02, 3, 1),
        ] {
            check_gpu_extras::<f16>(&gpu, a, (h, Reorder::Auto, p), 8, 64, false, 0.3);
            check_gpu_extras::<bf16>(&gpu, a, (h, Reorder::Auto, p), 2, 128, true, 0.3);
        }
    }
}

/// fused-csr's, fused-tc's and hybrid's kernels with each extra alone (the absent ones are null
/// pointers and a zero dropout threshold in the kernel; hybrid takes no features) and with a bias of
/// −∞ masking edges: every edge of some rows
/// (which then output zeros, as the CPU reference does), a whole 64-edge unit of the busiest
/// row and, in head 1, that row entirely (the merges of split rows and of split groups then
/// see partials with a −∞ max and a zero sum). head_dim 32 runs fused-csr's plain layout, 64
/// its split one on cora; fused-tc splits the hub windows across units.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_fused_kernels_take_each_extra_alone_and_masked_rows() {
    // One GPU handle for every case: its modules load once.
    let gpu = gpu();
    let mut rng = fresh_rng("gpu fused extras alone");
    let hub = hub_graph(&mut rng, 5_000, 3);
    for alg in [
        Algorithm::FusedCsr,
        Algorithm::FusedTensorCore,
        Algorithm::Hybrid,
    ] {
        for (a, d) in [(&hub, 32), (&shared_graph("cora"), 64)] {
            check_fused_masks(&gpu, alg, a, d, &mut rng);
        }
    }
    // fused-tc's pipelined kernels have a twin per pair of extras at each head_dim.
    check_fused_masks(
        &gpu,
        Algorithm::FusedTensorCore,
        &shared_graph("cora"),
        128,
        &mut rng,
    );
}

fn check_fused_masks(gpu: &Gpu, alg: Algorithm, a: &Csr, d: usize, rng: &mut Pcg64) {
    let gpu = gpu.clone();
    let heads = 2;
    let s = Shape::new(a.n_rows(), heads, d).unwrap();
    let sf = Shape::new(a.nnz(), heads, d).unwrap();
    let draw = |rng: &mut Pcg64, n: usize| -> Vec<f16> { random_vec::<f16>(rng, n, 1.0) };
    let (q, k, v) = (draw(rng, s.len()), draw(rng, s.len()), draw(rng, s.len()));
    let mut bias = draw(rng, a.nnz() * heads);
    let offsets = a.row_offsets();
    let busiest = (0..a.n_rows())
        .max_by_key(|&r| offsets[r + 1] - offsets[r])
        .unwrap();
    for (row, w) in offsets.windows(2).enumerate() {
        for (i, e) in (w[0] as usize..w[1] as usize).enumerate() {
            // Head 0: every edge of every 7th row, one edge in 5 elsewhere, and edges 64..128
            // (one whole unit) of the busiest row. Head 1: every edge of the busiest row.
            if row % 7 == 0 || e % 5 == 0 || (row == busiest && (64..128).contains(&i)) {
                bias[e * heads] = f16::NEG_INFINITY;
            }
            if row == busiest {
                bias[e * heads + 1] = f16::NEG_INFINITY;
            }
        }
    }
    let feats = draw(rng, sf.len());
    let up = |x: &[f16], s: Shape| DeviceMatrix::from_host(&gpu, s, x).unwrap();
    let (dq, dk, dv, df) = (up(&q, s), up(&k, s), up(&v, s), up(&feats, sf));
    let db = DeviceVec::from_host(&gpu, &bias).unwrap();
    let (q64, k64, v64) = (to_f64(&q), to_f64(&k), to_f64(&v));
    let (bias64, feats64) = (to_f64(&bias), to_f64(&feats));
    let inputs = AttentionInputs::new(&q64, s, &k64, s, &v64, s);
    let dropout = Dropout::new(0.25, 77, 1 << 33).unwrap();
    // Rate 0 keeps every element: the extras change nothing (fused-tc runs its plain kernel).
    let no_drop = Dropout::new(0.0, 77, 1 << 33).unwrap();
    for reorder in [Reorder::None, Reorder::Degree] {
        let config = AttentionConfig::new(heads, d, DTypeKind::F16)
            .with_edge_extras(true)
            .with_algorithm(alg)
            .with_reorder(reorder);
        // hybrid: a fixed split with rows on both sides (the pipelined kernel at d 64 takes at
        // most one CUDA-core warp).
        let config = if alg == Algorithm::Hybrid {
            config.with_hybrid(HybridParams {
                threshold: 0.05,
                tc_warps: 1,
                cd_warps: if d == 64 { 1 } else { 3 },
            })
        } else {
            config
        };
        let plan = AttentionPlan::new_gpu(&gpu, a, config).unwrap();
        let scale = f64::from(plan.config().scale());
        for (name, use_bias, use_feats, use_dropout, dropout) in [
            ("masking bias", true, false, false, dropout),
            ("edge features", false, true, false, dropout),
            ("dropout", false, false, true, dropout),
            ("dropout at rate 0", false, false, true, no_drop),
        ] {
            if use_feats && !alg.takes_edge_features() {
                continue;
            }
            let extras = Extras {
                bias: use_bias.then_some(DeviceBias::PerHead(&db)),
                edge_features: use_feats.then_some(&df),
                dropout: use_dropout.then_some(dropout),
            };
            let cpu_extras = CpuExtras {
                bias: use_bias.then_some(EdgeBias::PerHead(&bias64[..])),
                edge_features: use_feats.then_some(&feats64[..]),
                dropout: use_dropout.then_some(dropout),
            };
            let mut out = DeviceMatrix::<f16>::zeros(&gpu, s).unwrap();
            out.fill_nan().unwrap();
            plan.forward_with(&dq, &dk, &dv, &extras, &mut out, None)
                .unwrap();
            let got = to_f64(&out.to_host().unwrap());
            let (want, _) = attention_extras_f64_from(a, &inputs, scale, &cpu_extras).unwrap();
            let err = cpu::rel_l2_error(&got, &want);
            assert!(
                err <= tolerance::<f16>(),
                "{alg} D{d} {reorder} {name}: out error {err:e}"
            );
            if use_bias {
                // Fully masked (row, head)s: zeros, not NaN.
                let masked = (0..a.n_rows())
                    .step_by(7)
                    .map(|r| (r, 0))
                    .chain([(busiest, 1)]);
                for (row, h) in masked {
                    let at = (row * heads + h) * d;
                    assert!(
                        got[at..at + d].iter().all(|&x| x == 0.0),
                        "{alg} D{d} {reorder}: masked row {row} head {h} is not zero"
                    );
                }
            }
        }
    }
}

/// An autotuned Auto plan made for extras may settle on any algorithm, and one declared without
/// edge features settles on fused-tc: each runs every extra, edge features included (in
/// fused-tc's kernel, or through the composition where its kernel takes none), and matches the
/// CPU plan.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_autotuned_plans_for_extras_run_every_extra() {
    let gpu = gpu();
    let mut rng = fresh_rng("autotuned extras");
    let a = shared_graph("cora");
    let (heads, d) = (2, 64);
    let s = Shape::new(a.n_rows(), heads, d).unwrap();
    let draw = |rng: &mut Pcg64, n: usize| -> Vec<f16> { random_vec::<f16>(rng, n, 1.0) };
    let (q, k, v) = (
        draw(&mut rng, s.len()),
        draw(&mut rng, s.len()),
        draw(&mut rng, s.len()),
    );
    let bias = draw(&mut rng, a.nnz() * heads);
    let feats = draw(&mut rng, a.nnz() * heads * d);
    let extras = HostExtras {
        bias: Some((&bias[..], false)),
        edge_features: Some(&feats[..]),
        dropout: Some(Dropout::new(0.2, 5, 0).unwrap()),
    };
    let config = AttentionConfig::new(heads, d, DTypeKind::F16).with_edge_extras(true);
    let cpu = AttentionPlan::new_cpu(&a, config.clone()).unwrap();
    let (want, _) = cpu.forward_with_host(&q, &k, &v, &extras).unwrap();
    let up = |x: &[f16], s: Shape| DeviceMatrix::from_host(&gpu, s, x).unwrap();
    let sf = Shape::new(a.nnz(), heads, d).unwrap();
    let (dq, dk, dv, df) = (up(&q, s), up(&k, s), up(&v, s), up(&feats, sf));
    let db = DeviceVec::from_host(&gpu, &bias).unwrap();
    let no_feats = HostExtras {
        edge_features: None,
        ..extras
    };
    let (want_nf, _) = cpu.forward_with_host(&q, &k, &v, &no_feats).unwrap();
    // Autotuned; and planned for extras without edge features (fused-tc), called with them
    // anyway (its pipelined `_xf` kernel runs them at 64 features).
    let plans = [
        ("autotuned", config.clone().with_autotune(true)),
        (
            "no edge features declared",
            config.clone().with_edge_features(false),
        ),
    ];
    for (how, config) in plans {
        let plan = AttentionPlan::new_gpu(&gpu, &a, config).unwrap();
        let what = format!("{how}: {} ({})", plan.algorithm(), plan.choice());
        if how.starts_with("no edge") && gpu.compute_capability() >= (8, 0) {
            assert_eq!(plan.algorithm(), Algorithm::FusedTensorCore, "{what}");
        }
        // With the weights out: the composition.
        let (got, _) = plan.forward_with_host(&q, &k, &v, &extras).unwrap();
        let err = cpu::rel_l2_error(&to_f64(&got), &to_f64(&want));
        assert!(err <= tolerance::<f16>(), "{what}: error {err:e}");
        // Without: the chosen algorithm's fused kernel where it has one (features through the
        // composition where it takes none: hybrid), and with the bias and dropout alone.
        for (with_feats, want) in [(true, &want), (false, &want_nf)] {
            let ex = Extras {
                bias: Some(DeviceBias::PerHead(&db)),
                edge_features: with_feats.then_some(&df),
                dropout: extras.dropout,
            };
            let mut out = DeviceMatrix::<f16>::zeros(&gpu, s).unwrap();
            out.fill_nan().unwrap();
            plan.forward_with(&dq, &dk, &dv, &ex, &mut out, None)
                .unwrap();
            let err = cpu::rel_l2_error(&to_f64(&out.to_host().unwrap()), &to_f64(want));
            assert!(
                err <= tolerance::<f16>(),
                "{what}, features {with_feats}: error {err:e}"
            );
        }
    }
}

/// hybrid asked for by name refuses edge features, naming the algorithms that take them;
/// fused-tc (on a 16-feature head) and unfused-tc run them through the composition.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_hybrid_refuses_edge_features_by_name() {
    let gpu = gpu();
    let a = ring(40);
    let s = Shape::new(a.n_rows(), 1, 16).unwrap();
    let x = DeviceMatrix::<f16>::zeros(&gpu, s).unwrap();
    let f = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(a.nnz(), 1, 16).unwrap()).unwrap();
    let extras = Extras {
        edge_features: Some(&f),
        ..Extras::default()
    };
    for alg in [
        Algorithm::FusedTensorCore,
        Algorithm::Hybrid,
        Algorithm::UnfusedTensorCore,
    ] {
        let config = AttentionConfig::new(1, 16, DTypeKind::F16)
            .with_edge_extras(true)
            .with_algorithm(alg);
        let plan = AttentionPlan::new_gpu(&gpu, &a, config).unwrap();
        let mut out = DeviceMatrix::<f16>::zeros(&gpu, s).unwrap();
        let r = plan.forward_with(&x, &x, &x, &extras, &mut out, None);
        if alg.takes_edge_features() {
            r.unwrap();
        } else {
            let e = r.unwrap_err();
            assert!(
                matches!(e, Error::Unsupported { .. }) && e.to_string().contains("fused-csr"),
                "{alg}: {e}"
            );
        }
    }
}
