//! The tensor-core backward's tests: the launched kernels and grids on the CPU, and (ignored
//! without a GPU) the passes at once against one after the other.

use super::*;

#[test]
fn supports_sixteen_bit_heads_in_multiples_of_eight() {
    assert!(TensorCoreBackward::supports(DTypeKind::F16, 64));
    assert!(TensorCoreBackward::supports(DTypeKind::Bf16, 8));
    assert!(TensorCoreBackward::supports(DTypeKind::F16, 64));
    assert!(!TensorCoreBackward::supports(DTypeKind::F16, 72));
    assert!(!TensorCoreBackward::supports(DTypeKind::F16, 12));
    assert!(!TensorCoreBackward::supports(DTypeKind::F32, 64));
    assert!(!TensorCoreBackward::supports(DTypeKind::F16, 0));
}

/// Every kernel of backward_tc.cu is one `run` or `run_with_extras` launches, and every
/// name they form exists.
#[test]
fn every_compiled_kernel_is_launched() {
    const TAKES: [(bool, bool); 4] = [(false, false), (true, false), (false, true), (true, true)];
    let mut launched = std::collections::HashSet::new();
    for dtype in ["f16", "bf16"] {
        for name in [row_stats_name(dtype), bias_grad_name(dtype)] {
            assert!(kernel_named(&BACKWARD_TC, name.clone()).is_ok(), "{name}");
            launched.insert(name);
        }
        for slice in SLICES {
            for pass in PASSES {
                for takes in TAKES {
                    let name = pass_name(pass, dtype, slice, takes);
                    assert!(kernel_named(&BACKWARD_TC, name.clone()).is_ok(), "{name}");
                    launched.insert(name);
                }
            }
        }
    }
    for kernel in BACKWARD_TC.kernels {
        assert!(launched.contains(*kernel), "{kernel} is never launched");
    }
    // Every head `supports` admits pads to one of the slices.
    for d in (8..=MAX_HEAD_DIM).step_by(8) {
        assert!(
            SLICES.contains(&d.next_power_of_two().max(SLICES[0])),
            "{d}"
        );
    }
}

#[test]
fn grid_is_a_warp_per_item() {
    let plain = (false, false);
    let (cfg, n) = grid(10, 3, "dq", plain).unwrap().unwrap();
    assert_eq!(n, 30);
    assert_eq!(cfg.grid_dim.0, 8);
    assert_eq!(cfg.shared_mem_bytes, 4 * 3 * 4128);
    let (cfg, _) = grid(10, 3, "dkv", plain).unwrap().unwrap();
    assert_eq!(cfg.shared_mem_bytes, 4 * 3 * 4256);
    // The staged extras: a bias span of 256 floats, then 32 bytes of keep words.
    let (cfg, _) = grid(10, 3, "dkv", (true, true)).unwrap().unwrap();
    assert_eq!(cfg.shared_mem_bytes, 4 * 3 * (4256 + 1024 + 32));
    let (cfg, _) = grid(10, 3, "stats", (false, true)).unwrap().unwrap();
    assert_eq!(cfg.shared_mem_bytes, 4 * 3 * (4128 + 32));
    assert!(grid(0, 8, "stats", plain).unwrap().is_none());
}

/// The dq and dK/dV passes at once on two streams give the gradients and ∂scale of the
/// passes one after the other, bit for bit, and write every element: after the stats pass
/// and from a forward's statistics (the row kernel), on a hub row's and a hub column's split
/// windows (both passes' merges; a directed graph, so Aᵀ's own BSB) and on its symmetrized
/// square (A's BSB serving as Aᵀ's), in the graph's row order and renumbered, f16 and bf16.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_passes_at_once_match_one_after_the_other() {
    use crate::fused::tc::tests::hub_graph;
    let gpu = Gpu::new(0).expect("an NVIDIA GPU");
    if gpu.compute_capability() < (8, 0) {
        return;
    }
    // Row 5 and column 9 are hubs; row 7 has no edges (but in the symmetrized graph).
    let directed = DeviceGraph::new(&gpu, hub_graph(700, 900, 6, 4242, true));
    let square = hub_graph(600, 600, 5, 77, true).symmetrize().unwrap();
    let symmetric = DeviceGraph::new(&gpu, square);
    for graph in [&directed, &symmetric] {
        for reorder in [Reorder::None, Reorder::Degree] {
            for (heads, d) in [(2, 64), (3, 24)] {
                passes_at_once_case::<half::f16>(&gpu, graph, reorder, heads, d);
                passes_at_once_case::<half::bf16>(&gpu, graph, reorder, heads, d);
            }
        }
    }
}

/// One case of [`gpu_passes_at_once_match_one_after_the_other`].
fn passes_at_once_case<T: DType>(
    gpu: &Gpu,
    graph: &DeviceGraph,
    reorder: Reorder,
    heads: usize,
    d: usize,
) {
    use crate::fused::tc::{FusedTensorCore, Options};
    let (rows, cols) = (graph.n_rows(), graph.n_cols());
    let sq = Shape::new(rows, heads, d).unwrap();
    let skv = Shape::new(cols, heads, d).unwrap();
    // Deterministic operands in [-1, 1), one pattern per seed.
    let draw = |shape: Shape, seed: usize| {
        let host: Vec<T> = (0..shape.len())
            .map(|i| T::from_f32(((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0 - 1.0))
            .collect();
        DeviceMatrix::from_host(gpu, shape, &host).unwrap()
    };
    let (q, k, v, d_out) = (draw(sq, 1), draw(skv, 2), draw(skv, 3), draw(sq, 4));
    let scale = 1.0 / (d as f32).sqrt();
    let ordered = graph.bsb_in(reorder).unwrap();
    let mut fwd =
        FusedTensorCore::with_options::<T>(gpu, ordered, heads, d, Options::default()).unwrap();
    let mut out = DeviceMatrix::zeros(gpu, sq).unwrap();
    let mut lse = DeviceVec::<f32>::zeros(gpu, rows * heads).unwrap();
    fwd.forward_with_lse(gpu, &q, &k, &v, scale, &mut out, &mut lse)
        .unwrap();
    for saved in [None, Some((&out, &lse))] {
        let [seq, at_once] = [false, true].map(|on| {
            let mut bwd = TensorCoreBackward::new::<T>(graph, heads, d, reorder).unwrap();
            bwd.overlap = Some(on);
            let mut g = [sq, skv, skv].map(|s| {
                let mut m = DeviceMatrix::<T>::zeros(gpu, s).unwrap();
                m.fill_nan().unwrap();
                m
            });
            let [dq, dk, dv] = &mut g;
            bwd.run(gpu, scale, [&q, &k, &v, &d_out], saved, [dq, dk, dv])
                .unwrap();
            let d_scale = bwd.d_scale().to_host().unwrap()[0];
            (g.map(|m| m.to_host().unwrap()), d_scale)
        });
        let what = format!(
            "{} n={rows} {reorder:?} H{heads} D{d} saved={}",
            T::NAME,
            saved.is_some()
        );
        for (i, name) in ["dQ", "dK", "dV"].iter().enumerate() {
            assert!(
                seq.0[i].iter().all(|x| x.to_f32().is_finite()),
                "{what}: {name} not written"
            );
            // Bits, so that a zero's sign counts too.
            let bits = |x: &[T]| x.iter().map(|e| e.to_f32().to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&seq.0[i]), bits(&at_once.0[i]), "{what}: {name}");
        }
        assert_eq!(seq.1.to_bits(), at_once.1.to_bits(), "{what}: ∂scale");
    }
}
