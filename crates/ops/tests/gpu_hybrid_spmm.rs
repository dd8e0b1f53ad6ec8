//! GPU tests of the hybrid SpMM (`hybrid_spmm::spmm`: dense blocks on tensor cores, the
//! remaining edges on CUDA cores, one kernel) against an f64 CPU reference, and its timings
//! beside the CSR and ME-BCRS SpMM.
//!
//! `#[ignore]`d where there is no NVIDIA GPU. Fresh inputs (seed printed), outputs poisoned
//! with NaN before each launch, every launch twice (bit-identical). Binary and weighted A;
//! thresholds 0 (all tensor cores), 2 (all CUDA cores) and in between; several warp splits.
//! Tolerances: f16 5e-3, bf16 2e-2, f32 1e-3 (tf32 on the tensor-core side).

mod common;

use common::*;
use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn_formats::{Csr, HybridBlocks};
use spattn_ops::hybrid_spmm::{spmm_with, WarpSplit};
use spattn_ops::{
    csr_ops, tc_ops, DType, DTypeKind, DeviceCsr, DeviceHybrid, DeviceMatrix, DeviceMeBcrs,
    DeviceVec, Gpu, Shape,
};

fn gpu() -> Gpu {
    Gpu::new(0).expect("an NVIDIA GPU (this test is ignored elsewhere)")
}

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

fn check<T: DType>(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    let shape_v = Shape::new(a.n_cols(), heads, head_dim).unwrap();
    let shape_o = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let v = random_vec::<T>(rng, shape_v.len(), 1.0);
    let want = reference(a, &to_f64(&v), shape_v);
    let dv = DeviceMatrix::from_host(gpu, shape_v, &v).unwrap();
    let mut out = DeviceMatrix::<T>::zeros(gpu, shape_o).unwrap();
    let blocks = HybridBlocks::from_csr(a).unwrap();
    for (threshold, tc, cd) in [(0.0, 2, 2), (2.0, 1, 3), (0.05, 3, 1), (0.02, 4, 4)] {
        let split = blocks.classify(threshold).unwrap();
        let d = DeviceHybrid::upload(gpu, &blocks, &split, heads).unwrap();
        let what = format!(
            "spmm-hybrid {} n={} nnz={} weighted={} heads={heads} d={head_dim} t={threshold} {tc}:{cd}",
            T::NAME,
            a.n_rows(),
            a.nnz(),
            a.values().is_some()
        );
        let mut first: Option<Vec<T>> = None;
        for _ in 0..2 {
            out.fill_nan().unwrap();
            spmm_with(gpu, &d, &dv, WarpSplit::new(tc, cd).unwrap(), &mut out).unwrap();
            let got = out.to_host().unwrap();
            let err = spattn_ops::cpu::rel_l2_error(&to_f64(&got), &want);
            assert!(
                err <= tol::<T>()
                    || (want.iter().all(|&x| x == 0.0) && got.iter().all(|x| x.to_f64() == 0.0)),
                "{what}: rel error {err:e}"
            );
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
        check::<f16>(gpu, g, heads, head_dim, rng);
        check::<bf16>(gpu, g, heads, head_dim, rng);
        if head_dim <= 64 {
            check::<f32>(gpu, g, heads, head_dim, rng);
        }
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
    for d in [1, 3, 8, 100, 128] {
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

/// Median of `runs` timed launches after warm-up, ms.
fn time(gpu: &Gpu, runs: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            f64::from(
                gpu.time_ms(|| {
                    f();
                    Ok(())
                })
                .unwrap(),
            )
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

/// spmm-hybrid (best of a threshold × split sweep, each printed) beside spmm-csr and spmm-tc
/// on the same binary A (all probabilities 1), f16: timings only, no assertion.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn timings() {
    let gpu = gpu();
    let mut rng = fresh_rng("spmm timings");
    println!("device: {}", gpu.name());
    let mut graphs: Vec<(String, Csr)> = ["cora", "citeseer", "pubmed", "ogbn-arxiv"]
        .iter()
        .map(|n| (n.to_string(), shared_graph(n)))
        .collect();
    for s in [16, 18] {
        graphs.push((format!("rmat{s}"), rmat_graph(s)));
    }
    for (name, a) in &graphs {
        let blocks = HybridBlocks::from_csr(a).unwrap();
        let csr = DeviceCsr::upload(&gpu, a).unwrap();
        let me = DeviceMeBcrs::from_csr(&gpu, a).unwrap();
        for (heads, d) in [(1usize, 64usize), (1, 128), (8, 64), (8, 128)] {
            let sv = Shape::new(a.n_cols(), heads, d).unwrap();
            let so = Shape::new(a.n_rows(), heads, d).unwrap();
            let v = DeviceMatrix::from_host(&gpu, sv, &random_vec::<f16>(&mut rng, sv.len(), 1.0))
                .unwrap();
            let mut out = DeviceMatrix::<f16>::zeros(&gpu, so).unwrap();
            let ones = DeviceVec::from_host(&gpu, &vec![1.0f32; a.nnz() * heads]).unwrap();
            let t_csr = time(&gpu, 20, || {
                csr_ops::spmm(&gpu, &csr, &ones, &v, &mut out).unwrap()
            });
            let mut slots = DeviceVec::<f32>::zeros(&gpu, me.n_slots() * heads).unwrap();
            tc_ops::csr_to_slots(&gpu, &me, &ones, heads, 0.0, &mut slots).unwrap();
            let t_tc = time(&gpu, 20, || {
                tc_ops::spmm(&gpu, &me, &slots, &v, &mut out).unwrap()
            });
            let mut best = (f64::INFINITY, 0.0, 0, 0, 0.0);
            for threshold in [0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 2.0] {
                let split = blocks.classify(threshold).unwrap();
                let dh = DeviceHybrid::upload(&gpu, &blocks, &split, heads).unwrap();
                for (tc, cd) in [(1, 3), (2, 2), (3, 1), (4, 4)] {
                    let w = WarpSplit::new(tc, cd).unwrap();
                    let t = time(&gpu, 10, || spmm_with(&gpu, &dh, &v, w, &mut out).unwrap());
                    if t < best.0 {
                        best = (t, threshold, tc, cd, split.tc_fraction());
                    }
                }
            }
            println!(
                "spmm-timing {name:>10} h={heads} d={d:>3}: csr {t_csr:.4} ms, tc {t_tc:.4} ms, \
                 hybrid {:.4} ms (threshold {} {}:{} tc-edges {:.3}) -> vs best pure {:.2}x",
                best.0,
                best.1,
                best.2,
                best.3,
                best.4,
                t_csr.min(t_tc) / best.0
            );
        }
    }
}
