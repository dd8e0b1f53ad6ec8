//! Criterion benchmarks of spattn-formats preprocessing: CSR → ME-BCRS / BSB (and back),
//! symmetrize + self loops, transpose, and reading a real MatrixMarket graph.
//!
//! Graphs: Graph500 R-MAT (A, B, C, D = 0.57, 0.19, 0.19, 0.05, 16 edges per node, labels
//! permuted) at scale 16 and 20, symmetrized with self loops (scale 20: n = 2^20, ≈ 32.5M
//! entries, hub rows of ~65k), and ogbn-arxiv from `../shared/data/mtx` when present.
//!
//! `cargo bench -p spattn-formats`; pick scales with `SPATTN_BENCH_SCALES=16,20` (the default).

use std::path::Path;
use std::time::Duration;

use criterion::{black_box, BenchmarkId, Criterion, Throughput};
use spattn_formats::{read_matrix_market, rmat, Bsb, MeBcrs, RmatConfig};

fn scales() -> Vec<u32> {
    std::env::var("SPATTN_BENCH_SCALES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![16, 20])
}

fn conversions(c: &mut Criterion) {
    for scale in scales() {
        let directed = rmat(&RmatConfig::new(scale).with_seed(1)).expect("R-MAT");
        let a = directed.symmetrize_with_self_loops().expect("symmetrize");
        eprintln!(
            "R-MAT scale {scale}: n = {}, directed nnz = {}, sym+I nnz = {}, max row = {}",
            a.n_rows(),
            directed.nnz(),
            a.nnz(),
            a.degree_stats().max
        );
        let id = |name: &str| BenchmarkId::new(name, format!("rmat{scale}"));

        let mut g = c.benchmark_group("formats");
        g.sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(8))
            .throughput(Throughput::Elements(a.nnz() as u64));

        g.bench_function(id("csr_to_mebcrs"), |b| {
            b.iter(|| MeBcrs::from_csr(black_box(&a), 8).expect("ME-BCRS"))
        });
        g.bench_function(id("csr_to_bsb"), |b| {
            b.iter(|| Bsb::from_csr(black_box(&a)).expect("BSB"))
        });

        let me = MeBcrs::from_csr(&a, 8).expect("ME-BCRS");
        let bsb = Bsb::from_csr(&a).expect("BSB");
        let (mf, bf) = (me.fill_stats(), bsb.fill_stats());
        eprintln!(
            "  ME-BCRS: {} vectors, {} blocks, fill {:.3}; BSB: {} blocks, fill {:.3}",
            me.n_vectors(),
            mf.blocks,
            mf.fill(),
            bf.blocks,
            bf.fill()
        );
        g.bench_function(id("mebcrs_to_csr"), |b| {
            b.iter(|| black_box(&me).to_csr().expect("CSR"))
        });
        g.bench_function(id("bsb_to_csr"), |b| {
            b.iter(|| black_box(&bsb).to_csr().expect("CSR"))
        });
        g.bench_function(id("mebcrs_edge_to_slot"), |b| {
            b.iter(|| black_box(&me).edge_to_slot().expect("map"))
        });
        g.bench_function(id("bsb_edge_to_slot"), |b| {
            b.iter(|| black_box(&bsb).edge_to_slot().expect("map"))
        });
        drop((me, bsb));

        g.throughput(Throughput::Elements(directed.nnz() as u64));
        g.bench_function(id("symmetrize_with_self_loops"), |b| {
            b.iter(|| {
                black_box(&directed)
                    .symmetrize_with_self_loops()
                    .expect("symmetrize")
            })
        });
        g.throughput(Throughput::Elements(a.nnz() as u64));
        g.bench_function(id("transpose"), |b| b.iter(|| black_box(&a).transpose()));
        g.finish();
    }
}

fn reading(c: &mut Criterion) {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/mtx/ogbn-arxiv.mtx.gz");
    if !path.exists() {
        eprintln!(
            "note: {} not found, skipping the reader benchmark",
            path.display()
        );
        return;
    }
    let mut g = c.benchmark_group("read");
    g.sample_size(10).warm_up_time(Duration::from_secs(1));
    g.bench_function("read_matrix_market/ogbn-arxiv", |b| {
        b.iter(|| read_matrix_market(black_box(&path)).expect("read"))
    });
    g.finish();
}

// A plain `main` rather than `criterion_group!`, whose generated `pub fn` has no doc comment.
fn main() {
    let mut c = Criterion::default().configure_from_args();
    conversions(&mut c);
    reading(&mut c);
    c.final_summary();
}
