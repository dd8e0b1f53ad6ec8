//! GPU tests of the fused tensor-core algorithm (`fused-tc`, BSB + mma.sync) against the f64
//! CPU reference (its timings beside fused-csr: `benches/probes.rs`).
//!
//! `#[ignore]`d where there is no NVIDIA GPU; run with `cargo test -- --include-ignored` or
//! from the GPU bundle. Inputs are drawn fresh (seed printed; replay with SPATTN_SEED), outputs
//! poisoned with NaN before each forward, and every forward runs twice: the second run must
//! repeat the first bit for bit (no race, split-window counters reset). Every case runs with
//! the rows in the graph's order, degree-ordered and locality-ordered (the plan's internal,
//! zero-copy renumbering): all three must match the reference.
//!
//! Tolerances (docs/kernels/README.md): f16 ≤ 5e-3, bf16 ≤ 2e-2, f32 through tf32 ≤ 1e-3.

use half::{bf16, f16};
use rand_pcg::Pcg64;
use spattn::{Algorithm, AttentionConfig, AttentionPlan, Reorder};
use spattn_formats::Csr;
use spattn_ops::{DType, DTypeKind, DeviceMatrix, Gpu, Shape};
use spattn_test_support::*;

const ALG: Algorithm = Algorithm::FusedTensorCore;

/// fused-tc on this GPU: runs on `inputs` (converted to `T`), twice under each row order, and
/// checks against `want`.
struct FusedTc<'g>(&'g Gpu);

impl CheckDtype for FusedTc<'_> {
    fn check<T: DType>(&mut self, a: &Csr, inputs: &Inputs, want: &[f64], scale: Option<f32>) {
        for reorder in [
            Reorder::None,
            Reorder::Degree,
            Reorder::Locality,
            Reorder::Cluster,
        ] {
            check_order::<T>(self.0, a, inputs, want, scale, reorder);
        }
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
    let what = format!("fused-tc rows {reorder}");
    check_forward_twice::<T>(gpu, a, inputs, want, &what, |q, k, v, out| {
        plan.forward(q, k, v, out).unwrap()
    });
}

/// Every dtype on fresh inputs: f16 and bf16 on one grid-valued draw (one reference), f32 on
/// its own full-precision draw; the plan's default scale.
fn check_case(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    let scale = default_scale(head_dim);
    let half = Inputs::draw_half(rng, a, heads, head_dim);
    let want = half.reference(a, scale);
    FusedTc(gpu).check::<f16>(a, &half, &want, None);
    FusedTc(gpu).check::<bf16>(a, &half, &want, None);
    let full = Inputs::draw::<f32>(rng, a, heads, head_dim, 1.0);
    let want = full.reference(a, scale);
    FusedTc(gpu).check::<f32>(a, &full, &want, None);
}

gpu_sweep_tests! {
    check = check_case;
    fn shared_graphs = shared_graphs(&[(1, 128), (8, 64), (4, 24)]);
    fn rmat_16 = rmat_16(&[(1, 128), (8, 16)]);
    fn head_dims_and_heads(sweep) {
        // 8 … 256 from the issue; 1, 3 and 100 run on heads padded to whole 16-byte vectors; 64 and
        // 128 the pipelined kernel in f16/bf16, 48 the register kernel's 64-feature slice.
        let head_dims = [1, 3, 8, 24, 48, 64, 96, 100, 128, 256];
        sweep.random(200, 5, 9, &grid(&head_dims, &[1, 4, 8]));
    }
    fn tiny_graphs = tiny(1..=33, 3, 4, &[(2, 24), (1, 3), (1, 64)]);
    fn hub_row(sweep) {
        // Row 777 attends to all 10^5 nodes: its window is split and merged in the kernel.
        sweep.hub(100_000, 777, &[(1, 64), (4, 24)]);
    }
    fn split_window_wide_heads(sweep) {
        // Row 5 attends to all 3000 nodes: its window (375+ blocks) is cut into parts merged
        // in the kernel; wide heads put several warps on each part (f16 256: 2 warps, f32
        // 256: 4).
        sweep.hub(3000, 5, &[(2, 256), (1, 100), (3, 8)]);
    }
    fn dense_window(sweep) {
        // Rows 0..16 all attend to columns 0..64 (8 full blocks); rows 16..40 a few random ones.
        let a = dense_and_sparse_graph(&mut sweep.rng);
        sweep.on(&a, &[(1, 64), (2, 128), (3, 24)]);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn extreme_and_equal_scores() {
    let gpu = gpu();
    let mut rng = fresh_rng("extreme_and_equal_scores");
    let a = random_graph(&mut rng, 500, 8, 5);
    // f32 keeps scores near ±1e4 through 3xTF32; f16/bf16 have exact products.
    for head_dim in [16, 64] {
        check_extreme_and_equal_scores(&mut FusedTc(&gpu), &a, 2, head_dim, 0.25, &mut rng);
    }
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
