//! GPU tests of the hybrid SpMM (`hybrid_spmm::spmm`: dense blocks on tensor cores, the
//! remaining edges on CUDA cores, one kernel) against an f64 CPU reference (its timings beside
//! the CSR and ME-BCRS SpMM: `benches/probes.rs`).
//!
//! `#[ignore]`d where there is no NVIDIA GPU. Fresh inputs (seed printed), outputs poisoned
//! with NaN before each launch, every launch twice (bit-identical). Binary and weighted A;
//! thresholds 0 (all tensor cores), 2 (all CUDA cores) and in between; several warp splits.
//! Tolerances: f16 5e-3, bf16 2e-2, f32 1e-3 (tf32 on the tensor-core side).

use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn_formats::{Csr, HybridBlocks, Reorder};
use spattn_ops::hybrid_spmm::{spmm_widths, spmm_with, DeviceHybrid, WarpSplit};
use spattn_ops::HybridSpmm;
use spattn_ops::{DType, DTypeKind, DeviceMatrix, Gpu, Shape};
use spattn_test_support::*;

use crate::test_util::{gpu, random_vec, to_f64, tolerance};

fn tol<T: DType>() -> f64 {
    match T::KIND {
        DTypeKind::F32 => 1e-3,
        _ => tolerance::<T>(),
    }
}

/// out[i, h, :] = Σ_j a_ij V[j, h, :] in f64.
fn reference(a: &Csr, v: &[f64], shape: Shape) -> Vec<f64> {
    let hd = shape.row_len();
    let mut out = vec![0.0; a.n_rows() * hd];
    for i in 0..a.n_rows() {
        for e in a.row_range(i) {
            let j = a.col_indices()[e] as usize;
            let w = a.values().map_or(1.0, |x| f64::from(x[e]));
            for f in 0..hd {
                out[i * hd + f] += w * v[j * hd + f];
            }
        }
    }
    out
}

/// Random V on the device, its f64 reference product, and an output buffer.
fn inputs<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    heads: usize,
    head_dim: usize,
    rng: &mut Pcg64,
) -> (DeviceMatrix<T>, Vec<f64>, DeviceMatrix<T>) {
    let shape_v = Shape::new(a.n_cols(), heads, head_dim).unwrap();
    let shape_o = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let v = random_vec::<T>(rng, shape_v.len(), 1.0);
    let want = reference(a, &to_f64(&v), shape_v);
    let dv = DeviceMatrix::from_host(gpu, shape_v, &v).unwrap();
    (dv, want, DeviceMatrix::<T>::zeros(gpu, shape_o).unwrap())
}

/// Asserts `got` is within the tolerance of `want` (or both are all zeros).
fn assert_close<T: DType>(got: &[T], want: &[f64], what: &str) {
    let err = spattn_ops::cpu::rel_l2_error(&to_f64(got), want);
    assert!(
        err <= tol::<T>()
            || (want.iter().all(|&x| x == 0.0) && got.iter().all(|x| x.to_f64() == 0.0)),
        "{what}: rel error {err:e}"
    );
}

/// Every feature width of [`spmm_widths`] with several thresholds and warp splits.
fn check<T: DType>(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    let (dv, want, mut out) = inputs::<T>(gpu, a, heads, head_dim, rng);
    let blocks = HybridBlocks::from_csr(a).unwrap();
    let widths = spmm_widths(T::KIND, heads, head_dim);
    assert!(!widths.is_empty(), "{heads} x {head_dim}: no width");
    for width in widths {
        check_width(
            gpu,
            a,
            &blocks,
            (heads, head_dim, width),
            &dv,
            &want,
            &mut out,
        );
    }
    for threshold in [0.0, 0.05] {
        let split = blocks.classify(threshold).unwrap();
        let d = DeviceHybrid::upload(gpu, &blocks, &split, heads).unwrap();
        // A width that does not tile the row's features is an error, not a launch (the width
        // is checked before the warps; these suit the general kernel).
        let w = WarpSplit { tc: 2, cd: 2 };
        for bad in [0, heads * head_dim + 1] {
            assert!(
                spmm_with(gpu, &d, &dv, w, bad, &mut out).is_err(),
                "width {bad}"
            );
        }
    }
}

/// [`check`] at one feature width: the pipelined kernel (f16/bf16 pieces of 64 or 128
/// features) takes 1..=3 tensor-core warps and at most one CUDA-core warp; the general kernel
/// up to 8 warps.
fn check_width<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    blocks: &HybridBlocks,
    (heads, head_dim, width): (usize, usize, usize),
    dv: &DeviceMatrix<T>,
    want: &[f64],
    out: &mut DeviceMatrix<T>,
) {
    let splits: &[(f64, usize, usize)] = if DeviceHybrid::pipelined(T::KIND, width) {
        &[
            (0.0, 2, 0),
            (0.0, 1, 1),
            (2.0, 1, 1),
            (0.05, 3, 1),
            (0.02, 2, 1),
        ]
    } else {
        &[(0.0, 2, 2), (2.0, 1, 3), (0.05, 3, 1), (0.02, 4, 4)]
    };
    for &(threshold, tc, cd) in splits {
        let split = blocks.classify(threshold).unwrap();
        let d = DeviceHybrid::upload(gpu, blocks, &split, heads * head_dim / width).unwrap();
        let what = format!(
            "spmm-hybrid {} n={} nnz={} weighted={} heads={heads} d={head_dim} width={width} \
             t={threshold} {tc}:{cd}",
            T::NAME,
            a.n_rows(),
            a.nnz(),
            a.values().is_some()
        );
        let mut first: Option<Vec<T>> = None;
        for _ in 0..2 {
            out.fill_nan().unwrap();
            spmm_with(gpu, &d, dv, WarpSplit::new(tc, cd).unwrap(), width, out).unwrap();
            let got = out.to_host().unwrap();
            assert_close(&got, want, &what);
            match &first {
                None => first = Some(got),
                Some(f) => assert!(
                    f.iter()
                        .zip(&got)
                        .all(|(x, y)| x.to_f64().to_bits() == y.to_f64().to_bits()),
                    "{what}: second run differs"
                ),
            }
        }
    }
}

/// [`HybridSpmm`]: the split its timing chose, in the locality / degree order it chose, against
/// the reference.
fn check_plan<T: DType>(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    let (dv, want, mut out) = inputs::<T>(gpu, a, heads, head_dim, rng);
    let plan = HybridSpmm::plan::<T>(gpu, a, heads, head_dim, Reorder::Auto).unwrap();
    out.fill_nan().unwrap();
    plan.run(gpu, &dv, &mut out).unwrap();
    let what = format!(
        "HybridSpmm {} n={} heads={heads} d={head_dim} ({})",
        T::NAME,
        a.n_rows(),
        plan.info()
    );
    assert_close(&out.to_host().unwrap(), &want, &what);
    // A V of the wrong shape is an error, not a launch.
    let bad = DeviceMatrix::<T>::zeros(gpu, Shape::new(a.n_cols() + 1, heads, head_dim).unwrap())
        .unwrap();
    assert!(plan.run(gpu, &bad, &mut out).is_err());
    // So is a V of another dtype than planned.
    let shape_o = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let other = DeviceMatrix::<f32>::zeros(gpu, dv.shape()).unwrap();
    let mut other_out = DeviceMatrix::<f32>::zeros(gpu, shape_o).unwrap();
    if T::KIND != DTypeKind::F32 {
        assert!(plan.run(gpu, &other, &mut other_out).is_err());
    }
}

fn check_all(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    let weighted = a
        .clone()
        .with_values(Some(
            (0..a.nnz())
                .map(|_| rng.random_range(-1.0f32..1.0))
                .collect(),
        ))
        .unwrap();
    for g in [a, &weighted] {
        check_plan::<f16>(gpu, g, heads, head_dim, rng);
        check::<f16>(gpu, g, heads, head_dim, rng);
        check::<bf16>(gpu, g, heads, head_dim, rng);
        check::<f32>(gpu, g, heads, head_dim, rng);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn graphs_and_shapes() {
    let gpu = gpu();
    let mut rng = fresh_rng("spmm graphs_and_shapes");
    let a = shared_graph("cora");
    for (h, d) in [(1, 128), (8, 64), (2, 24)] {
        check_all(&gpu, &a, h, d, &mut rng);
    }
    let a = random_graph(&mut rng, 300, 6, 7);
    // 2 × 100 and 2 × 131 features: pieces of 100 (f32: 50) and of 2 (262 has no other
    // divisor a warp holds); 2 × 128: pieces of 128 or 64, a head wider than a warp for f32.
    for d in [1, 3, 8, 100, 128, 131] {
        check_all(&gpu, &a, 2, d, &mut rng);
    }
    for n in [1, 7, 17, 33] {
        let a = random_graph(&mut rng, n, 3, 4);
        check_all(&gpu, &a, 8, 16, &mut rng);
    }
    let hub = hub_graph(&mut rng, 20_000, 77);
    check_all(&gpu, &hub, 1, 64, &mut rng);
    let mut edges: Vec<(u32, u32)> = (0..16).flat_map(|r| (0..64).map(move |c| (r, c))).collect();
    edges.extend((16..40).map(|r| (r, (r * 7) % 70)));
    let dense = Csr::from_edges(40, 70, &edges).unwrap();
    check_all(&gpu, &dense, 2, 64, &mut rng);
}

/// The pipelined kernels' splits and widths on one small graph (a dense window, sparse rows, a
/// tail window), f16: small enough for compute-sanitizer racecheck, which runs out of host
/// memory on [`graphs_and_shapes`].
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn pipelined_small() {
    let gpu = gpu();
    let mut rng = fresh_rng("spmm pipelined_small");
    let mut edges: Vec<(u32, u32)> = (0..16).flat_map(|r| (0..24).map(move |c| (r, c))).collect();
    edges.extend((16..45).flat_map(|r| [(r, (r * 7) % 50), (r, (r * 3 + 1) % 50)]));
    let a = Csr::from_edges(45, 50, &edges).unwrap();
    let blocks = HybridBlocks::from_csr(&a).unwrap();
    for (heads, d) in [(1, 64), (1, 128), (2, 64)] {
        let (dv, want, mut out) = inputs::<f16>(&gpu, &a, heads, d, &mut rng);
        for width in spmm_widths(DTypeKind::F16, heads, d) {
            assert!(DeviceHybrid::pipelined(DTypeKind::F16, width));
            check_width(&gpu, &a, &blocks, (heads, d, width), &dv, &want, &mut out);
        }
    }
}
