//! Timing probes of the sparse ops on a GPU, printed for the per-kernel notes (docs/kernels):
//! `probe_hybrid_spmm`, the hybrid SpMM beside the CSR and ME-BCRS SpMMs; `probe_tc_ops_arxiv`,
//! CUDA-core against tensor-core SDDMM, softmax and SpMM on ogbn-arxiv; `probe_tc_spmm_orders`,
//! the tensor-core SpMM in the graph's row order and in `Reorder::Auto`'s. They print and
//! assert nothing: the published speed claims come from spattn-bench's runs (BENCHMARKS.md),
//! and correctness from the GPU tests. They read what the crate does not export (the slot
//! layout's conversion, the hybrid plan's choice), so they are unit tests: ignored, and idle
//! unless `SPATTN_PROBES` is set.
//!
//! `SPATTN_PROBES=1 cargo test --release -p spattn-ops --lib probe_ -- --ignored --nocapture`;
//! SPATTN_SPMM_GRAPHS and SPATTN_TC_GRAPHS (comma lists of shared graph names and rmatNN) pick
//! the graphs.

use half::{bf16, f16};
use rand_pcg::Pcg64;
use spattn_formats::{Csr, Reorder};
use spattn_test_support::*;

use crate::test_util::{gpu, random_vec};
use crate::{
    csr_ops, tc_ops, DType, DeviceCsr, DeviceMatrix, DeviceMeBcrs, DeviceVec, Gpu, HybridSpmm,
    Shape,
};

/// Whether the timing probes run (`SPATTN_PROBES` set); says how to run them otherwise, so
/// that a run of every ignored test (`--include-ignored`) spends no time on them.
pub(crate) fn enabled() -> bool {
    let on = std::env::var_os("SPATTN_PROBES").is_some();
    if !on {
        eprintln!("a timing probe: set SPATTN_PROBES=1 to run it");
    }
    on
}

/// Runs `probe` on GPU 0 where the probes are [`enabled`].
fn run(probe: fn(&Gpu)) {
    if enabled() {
        probe(&gpu());
    }
}

#[test]
#[ignore = "a timing probe: needs an NVIDIA GPU"]
fn probe_hybrid_spmm() {
    run(hybrid_spmm);
}

#[test]
#[ignore = "a timing probe: needs an NVIDIA GPU"]
fn probe_tc_ops_arxiv() {
    run(tc_ops_arxiv);
}

#[test]
#[ignore = "a timing probe: needs an NVIDIA GPU"]
fn probe_tc_spmm_orders() {
    run(tc_spmm_orders);
}

/// Median GPU time of `f` over `runs` runs after 3 warm-up runs, in ms.
fn median_ms(gpu: &Gpu, runs: usize, mut f: impl FnMut() -> crate::Result<()>) -> f32 {
    for _ in 0..3 {
        f().unwrap();
    }
    // The first timed run starts on an idle GPU, as the later ones do (each waits for its end).
    gpu.synchronize().unwrap();
    // The times are f32 events widened to f64: narrowing the median back is exact.
    crate::tune::median_of_runs(gpu, runs, f).unwrap() as f32
}

fn time_case<T: DType>(gpu: &Gpu, name: &str, a: &Csr, heads: usize, head_dim: usize) {
    let mut rng = fresh_rng("timing");
    let csr = DeviceCsr::upload(gpu, a).unwrap();
    let me = DeviceMeBcrs::from_csr(gpu, a).unwrap();
    let shape = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let x = |rng: &mut Pcg64| {
        let h: Vec<T> = random_vec(rng, shape.len(), 1.0);
        DeviceMatrix::from_host(gpu, shape, &h).unwrap()
    };
    let (q, k, v) = (x(&mut rng), x(&mut rng), x(&mut rng));
    let mut out = DeviceMatrix::<T>::zeros(gpu, shape).unwrap();
    let mut s_csr = DeviceVec::<f32>::zeros(gpu, a.nnz() * heads).unwrap();
    let mut s_tc = DeviceVec::<f32>::zeros(gpu, me.n_slots() * heads).unwrap();
    let scale = 1.0 / (head_dim as f32).sqrt();
    let runs = 21;
    let sddmm_cc = median_ms(gpu, runs, || {
        csr_ops::sddmm(gpu, &csr, &q, &k, scale, &mut s_csr)
    });
    let sddmm_tc = median_ms(gpu, runs, || {
        tc_ops::sddmm(gpu, &me, &q, &k, scale, &mut s_tc)
    });
    let sm_cc = median_ms(gpu, runs, || {
        csr_ops::edge_softmax_in_place(gpu, &csr, &mut s_csr, heads, None)
    });
    let sm_tc = median_ms(gpu, runs, || {
        tc_ops::edge_softmax_in_place(gpu, &me, &mut s_tc, heads, None)
    });
    let spmm_cc = median_ms(gpu, runs, || csr_ops::spmm(gpu, &csr, &s_csr, &v, &mut out));
    // The tensor-core SpMM in the graph's order and Auto's (the same CSR-order probabilities
    // moved into each layout).
    let mut spmm_tc = Vec::new();
    let mut orders = Vec::new();
    for reorder in [Reorder::None, Reorder::Auto] {
        let m = DeviceMeBcrs::from_csr_reordered(gpu, a, reorder).unwrap();
        let mut p = DeviceVec::<f32>::zeros(gpu, m.n_slots() * heads).unwrap();
        tc_ops::csr_to_slots(gpu, &m, &s_csr, heads, 0.0, &mut p).unwrap();
        spmm_tc.push(median_ms(gpu, runs, || {
            tc_ops::spmm(gpu, &m, &p, &v, &mut out)
        }));
        orders.push(format!("{} {} vectors", m.row_order().used, m.n_vectors()));
    }
    let fill = me.fill_stats().fill();
    println!(
        "TIMING {name} {} heads={heads} head_dim={head_dim} nnz={} vectors={} fill={fill:.3} | \
         sddmm csr {sddmm_cc:.4} ms tc {sddmm_tc:.4} ms ({:.2}x) | softmax csr {sm_cc:.4} tc \
         {sm_tc:.4} | spmm csr {spmm_cc:.4} ms | tc natural {:.4} | tc auto ({}) {:.4} | \
         natural: {}",
        T::NAME,
        a.nnz(),
        me.n_vectors(),
        sddmm_cc / sddmm_tc,
        spmm_tc[0],
        orders[1],
        spmm_tc[1],
        orders[0],
    );
}

/// Prints CUDA-core vs tensor-core times on ogbn-arxiv (no assertion: speed lives in benches).
fn tc_ops_arxiv(gpu: &Gpu) {
    let gpu = gpu.clone();
    println!("TIMING device {}", gpu.name());
    let a = shared_graph("ogbn-arxiv");
    time_case::<f16>(&gpu, "ogbn-arxiv", &a, 1, 128);
    time_case::<f16>(&gpu, "ogbn-arxiv", &a, 8, 64);
    time_case::<bf16>(&gpu, "ogbn-arxiv", &a, 1, 128);
    time_case::<f32>(&gpu, "ogbn-arxiv", &a, 1, 128);
    let r = rmat_graph(16);
    time_case::<f16>(&gpu, "rmat16", &r, 1, 128);
}

/// The SpMM row orders (prints only) on the graphs of `SPATTN_TC_GRAPHS`
/// (comma-separated shared-graph names, or `rmatN` for R-MAT scale N; cora and pubmed when
/// unset).
fn tc_spmm_orders(gpu: &Gpu) {
    let gpu = gpu.clone();
    println!("TIMING device {}", gpu.name());
    for (name, a) in timing_graphs("SPATTN_TC_GRAPHS", "cora,pubmed") {
        time_case::<f16>(&gpu, &name, &a, 1, 128);
        time_case::<f16>(&gpu, &name, &a, 8, 64);
    }
}

/// The SpMM three-way table (the hybrid SpMM against its parts): spmm-hybrid ([`HybridSpmm`],
/// rows in the order `Reorder::Auto` picks, threshold and split chosen by timing at plan time)
/// beside spmm-csr (the graph's order) and spmm-tc (ME-BCRS in its own `Reorder::Auto` order)
/// on the same binary A (all probabilities 1), f16: timings only, no assertion. `SPATTN_SPMM_GRAPHS` (comma list of
/// shared graph names and rmatN) picks the graphs.
fn hybrid_spmm(gpu: &Gpu) {
    let gpu = gpu.clone();
    let mut rng = fresh_rng("spmm timings");
    println!("device: {}", gpu.name());
    let graphs = timing_graphs(
        "SPATTN_SPMM_GRAPHS",
        "cora,citeseer,pubmed,ogbn-arxiv,rmat16,rmat18",
    );
    println!(
        "| graph | heads | D | spmm-csr ms | spmm-tc ms | hybrid ms | hybrid vs best pure | \
         width | hybrid all-TC ms | threshold | TC:CD | CD edges |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|");
    for (name, a) in graphs {
        let csr = DeviceCsr::upload(&gpu, &a).unwrap();
        let me = DeviceMeBcrs::from_csr_reordered(&gpu, &a, Reorder::Auto).unwrap();
        for (heads, d) in [(1usize, 64usize), (1, 128), (8, 64), (8, 128)] {
            let sv = Shape::new(a.n_cols(), heads, d).unwrap();
            let so = Shape::new(a.n_rows(), heads, d).unwrap();
            let v = DeviceMatrix::from_host(&gpu, sv, &random_vec::<f16>(&mut rng, sv.len(), 1.0))
                .unwrap();
            let mut out = DeviceMatrix::<f16>::zeros(&gpu, so).unwrap();
            let ones = DeviceVec::from_host(&gpu, &vec![1.0f32; a.nnz() * heads]).unwrap();
            let t_csr = median_ms(&gpu, 21, || csr_ops::spmm(&gpu, &csr, &ones, &v, &mut out));
            let mut slots = DeviceVec::<f32>::zeros(&gpu, me.n_slots() * heads).unwrap();
            tc_ops::csr_to_slots(&gpu, &me, &ones, heads, 0.0, &mut slots).unwrap();
            let t_tc = median_ms(&gpu, 21, || tc_ops::spmm(&gpu, &me, &slots, &v, &mut out));
            let plan = HybridSpmm::plan::<f16>(&gpu, &a, heads, d, Reorder::Auto).unwrap();
            let t_h = median_ms(&gpu, 21, || plan.run(&gpu, &v, &mut out));
            let c = plan.choice();
            let s = c.device.stats();
            println!(
                "| {name} | {heads} | {d} | {t_csr:.4} | {t_tc:.4} | {t_h:.4} | {:.2}x | {} | \
                 {:.4} | {:.4} | {}:{} | {:.1}% |",
                t_csr.min(t_tc) / t_h,
                plan.width(),
                c.all_tc_ms,
                c.threshold,
                c.warps.tc,
                c.warps.cd,
                100.0 * s.cd_edges as f64 / (s.tc_edges + s.cd_edges).max(1) as f64
            );
            println!("spmm-plan {name} h={heads} d={d}: {}", plan.info());
        }
    }
}
