//! Every PTX module holds exactly the kernels the host launches from it: each name a launch path
//! can form (with the launch's own name-forming function) is a kernel of the module, and each
//! kernel of the module is one of those names. (`hybrid` and `backward_tc` have theirs beside
//! their launches.)

use std::collections::BTreeSet;

use spattn_kernels_sys::{self as sys, PtxModule};

use crate::dtype::DTypeKind;
use crate::launch::kernel_named;

/// Head dims past every layout's widest head (512 features), so each layout is reached.
const HEAD_DIMS: std::ops::RangeInclusive<usize> = 1..=1100;

/// The names launched from one module, checked as they are added.
struct Launched {
    module: PtxModule,
    names: BTreeSet<String>,
}

impl Launched {
    fn new(module: PtxModule) -> Self {
        Self {
            module,
            names: BTreeSet::new(),
        }
    }

    /// A name a launch path forms: it must be a kernel of the module (what `kernel_named`, or
    /// the driver for a constant's name, would refuse at run time).
    fn add(&mut self, name: impl Into<String>) {
        let name = name.into();
        assert!(
            kernel_named(&self.module, name.clone()).is_ok(),
            "{}: {name} is launched but not compiled",
            self.module.name
        );
        self.names.insert(name);
    }

    /// Every kernel of the module is launched, or listed in `kept` (name, why it stays); and
    /// every kept one is indeed never launched (else it belongs off the list).
    fn check(&self, kept: &[(&str, &str)]) {
        for (name, _why) in kept {
            assert!(
                !self.names.contains(*name),
                "{}: {name} is launched: off the kept list",
                self.module.name
            );
        }
        for kernel in self.module.kernels {
            assert!(
                self.names.contains(*kernel) || kept.iter().any(|(k, _)| k == kernel),
                "{}: {kernel} is never launched",
                self.module.name
            );
        }
    }
}

#[test]
fn backward_holds_exactly_the_launched_kernels() {
    use crate::backward::fused::{cols_pass_kernel, layout, rows_pass_kernel};
    use crate::backward::gat::{gat_cols_kernel, gat_rows_kernel};
    use crate::backward::{gatv2_grad_kernel, long_row_sum_kernel, row_sum_kernel};
    use crate::schedule::vector_width;
    let mut l = Launched::new(sys::BACKWARD);
    // Launched by fixed names (`kernel!`) (backward/mod.rs).
    for name in [
        sys::kernel!(BACKWARD, "transpose_edge_values_csr_f32"),
        sys::kernel!(BACKWARD, "edge_softmax_backward_csr_rows"),
        sys::kernel!(BACKWARD, "edge_softmax_backward_csr_long_rows"),
        sys::kernel!(BACKWARD, "attention_backward_csr_rows"),
        sys::kernel!(BACKWARD, "attention_backward_csr_long_rows"),
        sys::kernel!(BACKWARD, "edge_leaky_relu_backward_f32"),
        sys::kernel!(BACKWARD, "edge_scale_f32"),
        sys::kernel!(BACKWARD, "sum_in_order_f32"),
        sys::kernel!(BACKWARD, "invert_edge_map_u32"),
    ] {
        l.add(name);
    }
    for kind in DTypeKind::ALL {
        let (dt, bytes) = (kind.name(), kind.size_bytes());
        l.add(row_sum_kernel(dt));
        l.add(long_row_sum_kernel(dt));
        for hd in HEAD_DIMS {
            let vec = vector_width(hd, bytes);
            l.add(gatv2_grad_kernel(dt, vec));
            if let Some((vec, _, nv)) = layout(hd, bytes) {
                for ef in [false, true] {
                    for feat in [false, true] {
                        l.add(rows_pass_kernel(dt, vec, nv, ef, feat));
                        l.add(cols_pass_kernel(dt, vec, nv, ef, feat));
                    }
                }
                l.add(gat_rows_kernel(dt, vec, nv));
                l.add(gat_cols_kernel(dt, vec, nv));
            }
        }
    }
    l.check(&[]);
}

#[test]
fn csr_ops_holds_exactly_the_launched_kernels() {
    use crate::backward::gat_rows::{aggregate_kernel, feature_vector, grad_rows_kernel};
    use crate::csr_ops::{
        sddmm_gat_kernel, sddmm_gatv2_kernel, sddmm_kernel, spmm_finalize_kernel, spmm_kernel,
    };
    use crate::schedule::vector_width;
    let mut l = Launched::new(sys::CSR_OPS);
    // Launched by fixed names (`kernel!`) (the edge softmax).
    l.add(sys::kernel!(CSR_OPS, "edge_softmax_csr_rows"));
    l.add(sys::kernel!(CSR_OPS, "edge_softmax_csr_long_rows"));
    l.add(sys::kernel!(CSR_OPS, "gat_row_stats_csr"));
    l.add(sys::kernel!(CSR_OPS, "gat_row_stats_finalize"));
    l.add(sys::kernel!(CSR_OPS, "dropout_keep_bits"));
    for kind in DTypeKind::ALL {
        let dt = kind.name();
        l.add(sddmm_gat_kernel(dt));
        l.add(spmm_finalize_kernel(dt));
        for hd in HEAD_DIMS {
            let vec = vector_width(hd, kind.size_bytes());
            l.add(sddmm_kernel(dt, vec));
            l.add(sddmm_gatv2_kernel(dt, vec));
            l.add(spmm_kernel(dt, vec));
            if let Some(vec) = feature_vector(hd, kind.size_bytes()) {
                for drop in [false, true] {
                    l.add(aggregate_kernel(dt, vec, false, drop));
                    l.add(aggregate_kernel(dt, vec, true, drop));
                    l.add(grad_rows_kernel(dt, vec, drop));
                }
            }
        }
    }
    l.check(&[]);
}

#[test]
fn edge_extras_holds_exactly_the_launched_kernels() {
    use crate::edge_extras::{
        bias_add_kernel, cast_kernel, head_sum_kernel, pair_bias_grad_kernel, row_combine_kernel,
        rows_fill_kernel, rows_place_kernel, widen_kernel, ADD_KERNEL, DROPOUT_KERNEL,
    };
    let mut l = Launched::new(sys::EDGE_EXTRAS);
    l.add(DROPOUT_KERNEL);
    l.add(ADD_KERNEL);
    for kind in DTypeKind::ALL {
        let dt = kind.name();
        l.add(bias_add_kernel(dt));
        l.add(head_sum_kernel(dt));
        l.add(pair_bias_grad_kernel(dt));
        l.add(cast_kernel(dt));
        l.add(widen_kernel(dt));
        l.add(row_combine_kernel(dt));
        // Attribute rows placed (and the loops' filled) as f32, or in their own type.
        for out in ["f32", dt] {
            l.add(rows_place_kernel(dt, out));
            l.add(rows_fill_kernel(dt, out));
        }
    }
    l.check(&[]);
}

#[test]
fn fused_bsb_holds_exactly_the_launched_kernels() {
    use crate::device_bsb::{bias_gather_kernel, KEEP_GATHER_KERNEL};
    use crate::fused::tc::{
        check_feature_layout, extras_kernel, feature_kernel, kernel_name, layout_with, lse_kernel,
        Options, LSE_PIPE_SLICE,
    };
    let mut l = Launched::new(sys::FUSED_BSB);
    l.add(KEEP_GATHER_KERNEL);
    // The plans' layouts (FusedTensorCore::new runs the default options).
    let options = Options::default();
    for kind in DTypeKind::ALL {
        l.add(bias_gather_kernel(kind.name()));
        for hd in HEAD_DIMS {
            let Ok(layout) = layout_with(hd, kind, options.slice, options.pipelined) else {
                continue;
            };
            let base = kernel_name(kind.name(), layout).unwrap();
            l.add(base);
            if layout.pipelined && layout.slice == LSE_PIPE_SLICE {
                l.add(lse_kernel(base)); // forward_with_lse
            }
            // Every pair of extras taken (bias, dropout): the launch picks the twin from it.
            for takes in [(false, false), (true, false), (false, true), (true, true)] {
                l.add(extras_kernel(base, layout.pipelined, takes));
            }
            // Edge features (f16 / bf16 heads of 64 or 128): the pipelined kernels' `_xf` twins.
            if check_feature_layout(layout, kind, hd).is_ok() {
                l.add(feature_kernel(base));
            }
        }
    }
    l.check(&[]);
}

#[test]
fn fused_csr_holds_exactly_the_launched_kernels() {
    use crate::fused::csr::{choose_layout, kernel_name, layout, merge_kernel};
    let mut l = Launched::new(sys::FUSED_CSR);
    for kind in DTypeKind::ALL {
        let (dt, bytes) = (kind.name(), kind.size_bytes());
        l.add(merge_kernel(dt));
        for hd in HEAD_DIMS {
            let Ok(plain) = layout(hd, bytes) else {
                continue;
            };
            // A launch of few groups (split subgroups) and one of many (narrow groups), on one SM.
            for groups in [1, usize::MAX] {
                let chosen = choose_layout(plain, hd, bytes, groups, 1, true);
                for extras in [None, Some(false), Some(true)] {
                    l.add(kernel_name(dt, &chosen, extras));
                }
            }
        }
    }
    l.check(&[]);
}

#[test]
fn layers_holds_exactly_the_launched_kernels() {
    use crate::elementwise::dense_kernel;
    let mut l = Launched::new(sys::LAYERS);
    // The `op` each function of elementwise.rs passes.
    let ops = [
        "bias_add",
        "weighted_col_sum",
        "head_dot",
        "head_outer_add",
        "head_dot_f32",
        "head_outer_add_f32",
        "activation",
        "activation_backward",
        "row_normalize",
        "row_normalize_backward",
        "axpy",
        "head_mean",
        "head_broadcast",
        "adam",
        "sgd",
    ];
    for kind in DTypeKind::ALL {
        for op in ops {
            l.add(dense_kernel(op, kind.name()));
        }
    }
    // The fixed-order sum of the column sums' and dbeta's block parts.
    l.add(sys::kernel!(LAYERS, "sum_parts_f32").to_string());
    l.check(&[]);
}

#[test]
fn mebcrs_ops_holds_exactly_the_launched_kernels() {
    use crate::tc_ops::{sddmm_kernel, spmm_finalize_kernel, spmm_kernel, spmm_pipe_shape};
    let mut l = Launched::new(sys::MEBCRS_OPS);
    // Launched by fixed names (`kernel!`) (the softmax and the slot moves).
    for name in [
        sys::kernel!(MEBCRS_OPS, "edge_softmax_mebcrs_windows"),
        sys::kernel!(MEBCRS_OPS, "edge_softmax_mebcrs_long_windows"),
        sys::kernel!(MEBCRS_OPS, "csr_to_slots_mebcrs"),
        sys::kernel!(MEBCRS_OPS, "slots_to_csr_mebcrs"),
    ] {
        l.add(name);
    }
    for kind in DTypeKind::ALL {
        l.add(spmm_finalize_kernel(kind));
        for hd in HEAD_DIMS {
            l.add(sddmm_kernel(kind, hd));
            l.add(spmm_kernel(kind, hd, false));
            if spmm_pipe_shape(kind, hd) {
                l.add(spmm_kernel(kind, hd, true));
            }
        }
    }
    l.check(&[]);
}

#[test]
fn plan_holds_exactly_the_launched_kernels() {
    use crate::device_plan::{edge_keys_kernel, DeviceIndex};
    let mut l = Launched::new(sys::PLAN);
    for index in [
        <i32 as DeviceIndex>::NAME,
        <i64 as DeviceIndex>::NAME,
        <u32 as DeviceIndex>::NAME,
    ] {
        l.add(edge_keys_kernel(index));
    }
    // Launched by fixed names (`kernel!`) (device_plan/{mod,sort,csr,blocked}.rs, fused/tc.rs).
    for name in [
        sys::kernel!(PLAN, "plan_transpose_keys"),
        sys::kernel!(PLAN, "plan_scan_pass_u32"),
        sys::kernel!(PLAN, "plan_scan_sums_u32"),
        sys::kernel!(PLAN, "plan_scan_pass_u32x4"),
        sys::kernel!(PLAN, "plan_scan_sums_u32x4"),
        sys::kernel!(PLAN, "plan_radix_histogram"),
        sys::kernel!(PLAN, "plan_radix_onesweep"),
        sys::kernel!(PLAN, "plan_unique_flags"),
        sys::kernel!(PLAN, "plan_csr_build"),
        sys::kernel!(PLAN, "plan_row_counts"),
        sys::kernel!(PLAN, "plan_row_units"),
        sys::kernel!(PLAN, "plan_bsb_rank"),
        sys::kernel!(PLAN, "plan_bsb_flags"),
        sys::kernel!(PLAN, "plan_bsb_window_blocks"),
        sys::kernel!(PLAN, "plan_bsb_fill"),
        sys::kernel!(PLAN, "plan_bsb_block_edges"),
        sys::kernel!(PLAN, "plan_bsb_edge_ids"),
        sys::kernel!(PLAN, "plan_mebcrs_pointers"),
        sys::kernel!(PLAN, "plan_mebcrs_fill"),
        sys::kernel!(PLAN, "plan_tc_prologue"),
        sys::kernel!(PLAN, "plan_iota_u32"),
        sys::kernel!(PLAN, "plan_widen_u32_i64"),
    ] {
        l.add(name);
    }
    l.check(&[]);
}

#[test]
fn rows_holds_exactly_the_launched_kernels() {
    use crate::rows::{gather_kernel, resize_kernel, scatter_add_kernel};
    let mut l = Launched::new(sys::ROWS);
    for kind in DTypeKind::ALL {
        l.add(gather_kernel(kind.name()));
        l.add(scatter_add_kernel(kind.name()));
        l.add(resize_kernel(kind.name()));
    }
    l.check(&[]);
}
