//! The hybrid module's CPU tests: the SpMM widths and the kernels the host launches.

use super::*;

#[test]
fn every_shape_has_widths_that_tile_its_features() {
    for dtype in [DTypeKind::F32, DTypeKind::F16, DTypeKind::Bf16] {
        let max = *slices(dtype).last().unwrap();
        for heads in 1..=9 {
            for head_dim in 1..=300 {
                let f = heads * head_dim;
                let w = spmm_widths(dtype, heads, head_dim);
                assert!(!w.is_empty(), "{dtype} {heads}x{head_dim}");
                for (i, &x) in w.iter().enumerate() {
                    assert!(f % x == 0 && x <= max, "{dtype} {heads}x{head_dim}: {x}");
                    assert!(!w[..i].contains(&x), "{dtype} {heads}x{head_dim}: repeat");
                }
                // The largest width a warp holds that divides f is always tried.
                let largest = (1..=max.min(f)).rev().find(|x| f % x == 0).unwrap();
                assert!(w.contains(&largest), "{dtype} {heads}x{head_dim}");
                // The pipelined widths come first when they divide f.
                if dtype != DTypeKind::F32 && f % 64 == 0 {
                    assert!(DeviceHybrid::pipelined(dtype, w[0]));
                }
            }
        }
    }
    assert!(spmm_widths(DTypeKind::F16, 0, 64).is_empty());
}

/// The module compiles exactly the kernels `run` can launch: every (op, dtype, width, warp
/// split, and for attention with or without extras) names a kernel of the module, and every
/// kernel of the module is named by one.
#[test]
fn the_module_holds_exactly_the_kernels_the_host_launches() {
    let mut launched = std::collections::BTreeSet::new();
    for dtype in DTypeKind::ALL {
        // Past the widest slice (128), which slice_for refuses.
        for width in 1..=256 {
            let Ok(slice) = slice_for(width, dtype) else {
                continue;
            };
            let pipelined = DeviceHybrid::pipelined(dtype, width);
            for op in ["fused", "spmm"] {
                for cd in [0, 1, 2] {
                    let name = kernel_name(op, dtype, width, slice, pipelined, cd);
                    assert!(kernel_named(&HYBRID, name.clone()).is_ok(), "{name}");
                    // Attention's twin with extras (attention_with_extras).
                    if op == "fused" {
                        let x = name.clone() + "_x";
                        assert!(kernel_named(&HYBRID, x.clone()).is_ok(), "{x}");
                        launched.insert(x);
                    }
                    launched.insert(name);
                }
            }
        }
    }
    for kernel in HYBRID.kernels {
        assert!(launched.contains(*kernel), "{kernel} is never launched");
    }
}

/// The widths of [`spmm_widths`]' doc, in its order.
#[test]
fn spmm_widths_in_order() {
    assert_eq!(spmm_widths(DTypeKind::F16, 8, 64), vec![128, 64]);
    assert_eq!(spmm_widths(DTypeKind::F16, 1, 256), vec![128, 64]);
    assert_eq!(spmm_widths(DTypeKind::F16, 2, 24), vec![48, 24]);
    assert_eq!(spmm_widths(DTypeKind::F32, 1, 128), vec![64, 32]);
    assert_eq!(spmm_widths(DTypeKind::F16, 1, 200), vec![100]);
    assert_eq!(spmm_widths(DTypeKind::F16, 3, 64), vec![64, 96]);
}

/// At least one tensor-core warp, at most 8 in all.
#[test]
fn warp_splits() {
    assert!(WarpSplit::new(2, 2).is_ok());
    assert!(WarpSplit::new(3, 0).is_ok());
    assert!(WarpSplit::new(0, 2).is_err());
    assert!(WarpSplit::new(4, 5).is_err());
}
