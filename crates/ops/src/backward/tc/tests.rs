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
        let name = row_stats_name(dtype);
        assert!(kernel_named(&BACKWARD_TC, name.clone()).is_ok(), "{name}");
        launched.insert(name);
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
/// windows (both passes' merges), in the graph's row order and renumbered.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_passes_at_once_match_one_after_the_other() {
    use crate::fused::tc::tests::{draw_f16, hub_graph};
    use crate::fused::tc::{FusedTensorCore, Options};
    let gpu = Gpu::new(0).expect("an NVIDIA GPU");
    if gpu.compute_capability() < (8, 0) {
        return;
    }
    let (rows, cols) = (700usize, 900usize);
    // Row 5 and column 9 are hubs; row 7 has no edges.
    let graph = DeviceGraph::new(&gpu, hub_graph(rows, cols, 6, 4242, true));
    for reorder in [Reorder::None, Reorder::Degree] {
        for (heads, d) in [(2, 64), (3, 24)] {
            let sq = Shape::new(rows, heads, d).unwrap();
            let skv = Shape::new(cols, heads, d).unwrap();
            let (q, k, v, d_out) = (
                draw_f16(&gpu, sq, 1),
                draw_f16(&gpu, skv, 2),
                draw_f16(&gpu, skv, 3),
                draw_f16(&gpu, sq, 4),
            );
            let scale = 1.0 / (d as f32).sqrt();
            let mut fwd = FusedTensorCore::with_options::<half::f16>(
                &gpu,
                graph.bsb_in(reorder).unwrap(),
                heads,
                d,
                Options::default(),
            )
            .unwrap();
            let mut out = DeviceMatrix::zeros(&gpu, sq).unwrap();
            let mut lse = DeviceVec::<f32>::zeros(&gpu, rows * heads).unwrap();
            fwd.forward_with_lse(&gpu, &q, &k, &v, scale, &mut out, &mut lse)
                .unwrap();
            for saved in [None, Some((&out, &lse))] {
                let [seq, at_once] = [false, true].map(|on| {
                    let mut bwd =
                        TensorCoreBackward::new::<half::f16>(&graph, heads, d, reorder).unwrap();
                    bwd.overlap = Some(on);
                    let mut g = [sq, skv, skv].map(|s| {
                        let mut m = DeviceMatrix::<half::f16>::zeros(&gpu, s).unwrap();
                        m.fill_nan().unwrap();
                        m
                    });
                    let [dq, dk, dv] = &mut g;
                    bwd.run(&gpu, scale, [&q, &k, &v, &d_out], saved, [dq, dk, dv])
                        .unwrap();
                    let d_scale = bwd.d_scale().to_host().unwrap()[0];
                    (g.map(|m| m.to_host().unwrap()), d_scale)
                });
                let what = format!("{reorder:?} H{heads} D{d} saved={}", saved.is_some());
                for (name, grad) in ["dQ", "dK", "dV"].iter().zip(&seq.0) {
                    assert!(
                        grad.iter().all(|x| x.is_finite()),
                        "{what}: {name} not written"
                    );
                }
                assert_eq!(seq.0, at_once.0, "{what}: gradients");
                assert_eq!(seq.1.to_bits(), at_once.1.to_bits(), "{what}: ∂scale");
            }
        }
    }
}
