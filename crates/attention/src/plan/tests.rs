//! The `Auto` rule (`choose`) on small graphs of known statistics.

use super::*;

/// A ring of `n` nodes with self loops: mean degree 3.
fn ring(n: u32) -> Csr {
    let edges: Vec<(u32, u32)> = (0..n)
        .flat_map(|i| [(i, i), (i, (i + 1) % n), ((i + 1) % n, i)])
        .collect();
    Csr::from_edges(n as usize, n as usize, &edges).expect("a valid ring")
}

fn auto(graph: &Csr, heads: usize, head_dim: usize, dtype: DTypeKind) -> Algorithm {
    let config = AttentionConfig::new(heads, head_dim, dtype);
    choose(&graph.degree_stats(), &config, (9, 0), PlanPolicy::Reuse)
        .expect("auto always chooses")
        .0
}

#[test]
fn auto_takes_fused_csr_for_a_graph_seen_once() {
    let small = ring(1000);
    for dtype in [DTypeKind::F16, DTypeKind::Bf16, DTypeKind::F32] {
        let config = AttentionConfig::new(8, 64, dtype);
        let (alg, why) = choose(&small.degree_stats(), &config, (9, 0), PlanPolicy::Once).unwrap();
        assert_eq!(alg, Algorithm::FusedCsr, "{dtype:?}: {why}");
        if dtype != DTypeKind::F32 {
            assert!(why.contains("policy once"), "{why}");
        }
    }
    // Past the size fused-tc's plan repays, a graph seen once keeps the tensor cores.
    let mut large = small.degree_stats();
    large.nnz = ONCE_FUSED_CSR_MAX_EDGES + 1;
    let config = AttentionConfig::new(8, 64, DTypeKind::F16);
    let alg = choose(&large, &config, (9, 0), PlanPolicy::Once).unwrap().0;
    assert_eq!(alg, Algorithm::FusedTensorCore);
    // A head fused-csr cannot hold gets what a reused graph's plan gets.
    let d = (8..=8192)
        .step_by(8)
        .find(|&d| FusedCsr::supports(d, 2).is_err())
        .expect("a head too wide for fused-csr");
    let wide = AttentionConfig::new(1, d, DTypeKind::F16);
    let pick = |p| choose(&small.degree_stats(), &wide, (9, 0), p).unwrap().0;
    assert_eq!(
        pick(PlanPolicy::Once),
        pick(PlanPolicy::Reuse),
        "head_dim {d}"
    );
}

#[test]
fn auto_picks_tensor_cores_for_half_precision_and_exact_kernels_for_f32() {
    let small = ring(1000);
    assert_eq!(
        auto(&small, 1, 64, DTypeKind::F16),
        Algorithm::FusedTensorCore
    );
    assert_eq!(
        auto(&small, 8, 64, DTypeKind::Bf16),
        Algorithm::FusedTensorCore
    );
    assert_eq!(auto(&small, 1, 64, DTypeKind::F32), Algorithm::FusedCsr);
    assert_eq!(auto(&small, 8, 64, DTypeKind::F32), Algorithm::FusedCsr);
    // Without tensor cores, half precision goes to the exact CUDA-core kernel.
    let config = AttentionConfig::new(1, 64, DTypeKind::F16);
    assert_eq!(
        choose(&small.degree_stats(), &config, (7, 5), PlanPolicy::Reuse)
            .unwrap()
            .0,
        Algorithm::FusedCsr
    );
}

#[test]
fn auto_runs_fused_csr_for_f32_and_fused_tc_for_f16() {
    // f32 goes to fused-csr at every shape, also many narrow heads on a large low-degree
    // graph (unfused-csr won there until fused-csr's narrow groups:
    // docs/kernels/README.md, "Which kernel runs").
    let large = ring(20_000);
    for (heads, head_dim) in [(8, 64), (16, 32), (8, 128), (1, 64)] {
        assert_eq!(
            auto(&large, heads, head_dim, DTypeKind::F32),
            Algorithm::FusedCsr
        );
    }
    assert_eq!(
        auto(&large, 8, 64, DTypeKind::F16),
        Algorithm::FusedTensorCore
    );
    let config = AttentionConfig::new(8, 64, DTypeKind::F32);
    assert!(
        choose(&large.degree_stats(), &config, (9, 0), PlanPolicy::Reuse)
            .unwrap()
            .1
            .starts_with("auto: fused-csr")
    );
}

#[test]
fn auto_plans_fused_csr_for_extras_and_unfused_csr_past_its_head_dims() {
    let g = ring(1000);
    for dtype in [DTypeKind::F32, DTypeKind::F16, DTypeKind::Bf16] {
        for cc in [(9, 0), (7, 5)] {
            let config = AttentionConfig::new(8, 64, dtype).with_edge_extras(true);
            let (alg, why) = choose(&g.degree_stats(), &config, cc, PlanPolicy::Reuse).unwrap();
            assert_eq!(alg, Algorithm::FusedCsr, "{dtype} on {cc:?}: {why}");
            assert!(alg.takes_edge_features());
        }
    }
    // A head too wide for fused-csr's registers: the composition, with the reason.
    let wide = 8192;
    assert!(FusedCsr::supports(wide, 4).is_err());
    let config = AttentionConfig::new(1, wide, DTypeKind::F32).with_edge_extras(true);
    let (alg, why) = choose(&g.degree_stats(), &config, (9, 0), PlanPolicy::Reuse).unwrap();
    assert_eq!(alg, Algorithm::UnfusedCsr);
    assert!(why.contains("fused-csr unavailable"), "{why}");
    // Without edge features, f16 and bf16 extras go to fused-tc's kernel where tensor
    // cores are; f32 stays on fused-csr (fused-tc rounds to tf32).
    for (dtype, cc, want) in [
        (DTypeKind::F16, (9, 0), Algorithm::FusedTensorCore),
        (DTypeKind::Bf16, (8, 0), Algorithm::FusedTensorCore),
        (DTypeKind::F16, (7, 5), Algorithm::FusedCsr),
        (DTypeKind::F32, (9, 0), Algorithm::FusedCsr),
    ] {
        let config = AttentionConfig::new(8, 64, dtype)
            .with_edge_extras(true)
            .with_edge_features(false);
        let (alg, why) = choose(&g.degree_stats(), &config, cc, PlanPolicy::Reuse).unwrap();
        assert_eq!(alg, want, "{dtype} on {cc:?}: {why}");
        assert!(why.contains("planned for"), "{why}");
    }
    // Named algorithms are kept (refusals of edge features happen at the call).
    let config = config.with_algorithm(Algorithm::UnfusedTensorCore);
    assert_eq!(
        choose(&g.degree_stats(), &config, (9, 0), PlanPolicy::Reuse)
            .unwrap()
            .0,
        Algorithm::UnfusedTensorCore
    );
}
