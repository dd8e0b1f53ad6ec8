//! GPU tests of the hybrid algorithm (tensor-core and CUDA-core warps in one kernel, over the
//! degree-ordered tile structure) against the f64 CPU reference.
//!
//! `#[ignore]`d where there is no NVIDIA GPU. Inputs are drawn fresh (seed printed; replay with
//! SPATTN_SEED), outputs poisoned with NaN before each forward, and every forward runs twice:
//! the second run must repeat the first bit for bit (no race; the work queue and the split
//! counters reset). Each case runs with the plan-time calibration and with fixed thresholds and
//! warp splits: 0 (every block on tensor cores), 2 (every edge on CUDA cores) and in between;
//! all must match the reference.
//!
//! Tolerances (docs/kernels/README.md): f16 ≤ 5e-3, bf16 ≤ 2e-2, f32 through tf32 on the
//! tensor-core side ≤ 1e-3.

use half::{bf16, f16};
use rand_pcg::Pcg64;
use spattn::{Algorithm, AttentionConfig, AttentionPlan, HybridParams};
use spattn_formats::Csr;
use spattn_ops::{DType, DTypeKind, DeviceMatrix, Gpu, Shape};
use spattn_test_support::*;

const ALG: Algorithm = Algorithm::Hybrid;

/// The fixed configurations every case also runs on the general kernel: (threshold, TC warps,
/// CD warps).
const FIXED: [(f64, usize, usize); 5] = [
    (0.0, 2, 2),
    (2.0, 1, 3),
    (0.05, 1, 3),
    (0.02, 3, 1),
    (0.1, 4, 4),
];
/// The same on the pipelined kernel (f16/bf16 at 64 or 128 features): 1..=3 tensor-core warps,
/// at most one CUDA-core warp, none only when every edge is on tensor cores.
const FIXED_PIPE: [(f64, usize, usize); 7] = [
    (0.0, 2, 0),
    (0.0, 1, 1),
    (2.0, 1, 1),
    (0.05, 1, 1),
    (0.02, 2, 1),
    (0.1, 3, 1),
    (0.05, 4, 1),
];

/// Runs the hybrid plan on `inputs` (converted to `T`), twice, and checks against `want`.
fn check_with<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    inputs: &Inputs,
    want: &[f64],
    scale: Option<f32>,
    params: Option<HybridParams>,
) {
    let (heads, head_dim) = (inputs.shape_q.heads, inputs.shape_q.head_dim);
    let mut config = AttentionConfig::new(heads, head_dim, T::KIND).with_algorithm(ALG);
    if let Some(s) = scale {
        config = config.with_scale(s);
    }
    if let Some(p) = params {
        config = config.with_hybrid(p);
    }
    assert!(AttentionPlan::supports(gpu, ALG, &config));
    let plan = AttentionPlan::new_gpu(gpu, a, config).unwrap();
    assert_eq!(plan.algorithm(), ALG);
    let info = plan
        .hybrid_info()
        .expect("a hybrid plan reports its choice");
    assert!(plan.choice().contains("threshold"), "{}", plan.choice());
    assert!((info.tc_edge_fraction + info.cd_edge_fraction - 1.0).abs() < 1e-9 || a.nnz() == 0);
    if let Some(p) = params {
        assert_eq!(
            (info.threshold, info.tc_warps, info.cd_warps),
            (p.threshold, p.tc_warps, p.cd_warps)
        );
        if p.threshold == 0.0 && a.nnz() > 0 {
            assert_eq!(info.cd_edge_fraction, 0.0);
        }
        if p.threshold > 1.0 && a.nnz() > 0 {
            assert_eq!(info.tc_edge_fraction, 0.0);
        }
    }
    let what = format!("hybrid params={params:?} ({})", plan.choice());
    check_forward_twice::<T>(gpu, a, inputs, want, &what, |q, k, v, out| {
        plan.forward(q, k, v, out).unwrap()
    });
}

/// Every dtype, calibrated and at every fixed configuration, on fresh inputs: f16 and bf16 on
/// one grid-valued draw (one reference), f32 on its own full-precision draw (head_dim ≤ 64).
fn check_case(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    let scale = default_scale(head_dim);
    let half = Inputs::draw_half(rng, a, heads, head_dim);
    let want = half.reference(a, scale);
    let fixed = |set: &'static [(f64, usize, usize)]| {
        std::iter::once(None).chain(set.iter().map(|&(threshold, tc_warps, cd_warps)| {
            Some(HybridParams {
                threshold,
                tc_warps,
                cd_warps,
            })
        }))
    };
    let half_set: &'static [(f64, usize, usize)] =
        if spattn_ops::Hybrid::pipelined(DTypeKind::F16, head_dim) {
            &FIXED_PIPE
        } else {
            &FIXED
        };
    for p in fixed(half_set) {
        check_with::<f16>(gpu, a, &half, &want, None, p);
    }
    check_with::<bf16>(gpu, a, &half, &want, None, None);
    check_with::<bf16>(gpu, a, &half, &want, None, fixed(half_set).nth(4).flatten());
    if head_dim <= 64 {
        let full = Inputs::draw::<f32>(rng, a, heads, head_dim, 1.0);
        let want = full.reference(a, scale);
        check_with::<f32>(gpu, a, &full, &want, None, None);
        check_with::<f32>(gpu, a, &full, &want, None, fixed(&FIXED).nth(1).flatten());
    }
}

gpu_sweep_tests! {
    check = check_case;
    fn shared_graphs = shared_graphs(&[(1, 128), (8, 64), (2, 24)]);
    fn rmat_16 = rmat_16(&[(1, 128), (8, 16)]);
    fn head_dims_and_heads(sweep) {
        // 1, 3 and 100 run on heads padded to whole 16-byte vectors.
        let head_dims = [1, 3, 8, 24, 64, 96, 100, 128];
        sweep.random(200, 5, 9, &grid(&head_dims, &[1, 2, 8]));
    }
    fn tiny_graphs(sweep) {
        sweep
            .tiny([1, 2, 7, 15, 16, 17, 31, 33], 3, 4, &[(2, 24), (1, 3)])
            .on(&Csr::from_edges(5, 5, &[]).unwrap(), &[(2, 8)]);
    }
    fn hub_row(sweep) {
        // Row 777 attends to all 10^5 nodes: its window is split into parts merged in the
        // kernel.
        sweep.hub(100_000, 777, &[(1, 64), (8, 24)]);
    }
    fn dense_and_sparse_windows(sweep) {
        let a = dense_and_sparse_graph(&mut sweep.rng);
        sweep.on(&a, &[(1, 64), (2, 128), (3, 24)]);
    }
}

/// The pipelined kernel's hand-off alone, at every fixed split (no plan-time timing): the
/// sanitizers' target (`racecheck` on the calibrated cases takes minutes).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pipelined_hand_off() {
    let gpu = gpu();
    let mut rng = fresh_rng("pipelined_hand_off");
    let a = dense_and_sparse_graph(&mut rng);
    for (heads, head_dim) in [(1, 64), (2, 128)] {
        let half = Inputs::draw_half(&mut rng, &a, heads, head_dim);
        let want = half.reference(&a, default_scale(head_dim));
        for &(threshold, tc_warps, cd_warps) in &FIXED_PIPE {
            let p = Some(HybridParams {
                threshold,
                tc_warps,
                cd_warps,
            });
            eprintln!("hand-off: {heads} x {head_dim}, {p:?}");
            check_with::<f16>(&gpu, &a, &half, &want, None, p);
            check_with::<bf16>(&gpu, &a, &half, &want, None, p);
        }
    }
}

/// The hybrid plan at fixed parameters (`None`: calibrated at plan time).
struct Hybrid<'g>(&'g Gpu, Option<HybridParams>);

impl CheckDtype for Hybrid<'_> {
    fn check<T: DType>(&mut self, a: &Csr, inputs: &Inputs, want: &[f64], scale: Option<f32>) {
        check_with::<T>(self.0, a, inputs, want, scale, self.1);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn extreme_and_equal_scores() {
    let gpu = gpu();
    let mut rng = fresh_rng("extreme_and_equal_scores");
    let a = random_graph(&mut rng, 500, 8, 5);
    let (heads, head_dim) = (2, 16);
    let mixed = Some(HybridParams {
        threshold: 0.03,
        tc_warps: 2,
        cd_warps: 2,
    });
    let mut hybrid = Hybrid(&gpu, mixed);
    check_extreme_and_equal_scores(&mut hybrid, &a, heads, head_dim, 0.25, &mut rng);
    // Equal scores with the plan-time calibration too.
    let x = Inputs::equal_scores(&mut rng, &a, heads, head_dim);
    let want = x.reference(&a, 0.25);
    Hybrid(&gpu, None).check::<bf16>(&a, &x, &want, Some(0.25));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn errors_are_typed() {
    let gpu = gpu();
    let a = Csr::from_edges(3, 3, &[(0, 1), (1, 2)]).unwrap();
    let wide = AttentionConfig::new(1, 129, DTypeKind::F16).with_algorithm(ALG);
    assert!(!AttentionPlan::supports(&gpu, ALG, &wide));
    let e = AttentionPlan::new_gpu(&gpu, &a, wide).unwrap_err();
    assert!(matches!(e, spattn::Error::Unsupported { .. }), "{e}");
    let bad = AttentionConfig::new(1, 8, DTypeKind::F16)
        .with_algorithm(ALG)
        .with_hybrid(HybridParams {
            threshold: 0.1,
            tc_warps: 0,
            cd_warps: 4,
        });
    assert!(AttentionPlan::new_gpu(&gpu, &a, bad).is_err());
    // The pipelined kernel (f16, 64 features): one CUDA-core warp at most, and none only when
    // no edge is on CUDA cores.
    for (threshold, tc_warps, cd_warps, needle) in [
        (0.1, 2, 2, "at most 1 CUDA-core warp"),
        (0.1, 5, 1, "1..=4"),
        (0.5, 2, 0, "no CUDA-core warp, but 2 edges"),
    ] {
        let config = AttentionConfig::new(1, 64, DTypeKind::F16)
            .with_algorithm(ALG)
            .with_hybrid(HybridParams {
                threshold,
                tc_warps,
                cd_warps,
            });
        let e = AttentionPlan::new_gpu(&gpu, &a, config).unwrap_err();
        assert!(e.to_string().contains(needle), "{e}");
    }
    let config = AttentionConfig::new(2, 4, DTypeKind::F16).with_algorithm(ALG);
    let plan = AttentionPlan::new_gpu(&gpu, &a, config).unwrap();
    let good = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(3, 2, 4).unwrap()).unwrap();
    let badm = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(3, 2, 5).unwrap()).unwrap();
    let mut out = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(3, 2, 4).unwrap()).unwrap();
    let e = plan.forward(&good, &badm, &good, &mut out).unwrap_err();
    assert!(
        matches!(e, spattn::Error::ShapeMismatch { what: "K", .. }),
        "{e}"
    );
}
