//! Shared support of the GPU tests: graphs, fresh random inputs, adversarial patterns.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use spattn_formats::{read_matrix_market, rmat, Csr, RmatConfig};
use spattn_ops::DType;

/// Where the shared graphs are: `SPATTN_DATA_DIR` (the GPU bundle sets it), else
/// `../shared/data/mtx` beside the repository.
pub fn data_dir() -> PathBuf {
    std::env::var_os("SPATTN_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/mtx")
        })
}

/// A graph of the shared set, symmetrized with self loops (the benchmark convention).
/// cora is bundled in the repository; the others are read from [`data_dir`].
pub fn shared_graph(name: &str) -> Csr {
    let bundled = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../formats/tests/data")
        .join(format!("{name}.mtx.gz"));
    let path = if bundled.exists() {
        bundled
    } else {
        data_dir().join(format!("{name}.mtx.gz"))
    };
    let a =
        read_matrix_market(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    a.symmetrize_with_self_loops().expect("square graph")
}

/// R-MAT at `scale`, symmetrized with self loops.
pub fn rmat_graph(scale: u32) -> Csr {
    rmat(
        &RmatConfig::new(scale)
            .with_symmetrize(true)
            .with_self_loops(true)
            .with_seed(42),
    )
    .expect("R-MAT")
}

/// A fresh seed per call (printed, so a failure can be replayed with SPATTN_SEED).
pub fn fresh_rng(test: &str) -> Pcg64 {
    let seed = std::env::var("SPATTN_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(7)
        });
    eprintln!("{test}: SPATTN_SEED={seed}");
    Pcg64::seed_from_u64(seed)
}

/// `len` values uniform in `[-amp, amp)`, rounded to `T`.
pub fn random_vec<T: DType>(rng: &mut Pcg64, len: usize, amp: f64) -> Vec<T> {
    (0..len)
        .map(|_| T::from_f64(rng.random_range(-amp..amp)))
        .collect()
}

/// Upcasts device-type host data to f64.
pub fn to_f64<T: DType>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

/// A random pattern: `n × n`, about `avg` edges per row, with some rows left empty.
pub fn random_graph(rng: &mut Pcg64, n: usize, avg: usize, empty_every: usize) -> Csr {
    let mut edges = Vec::new();
    for r in 0..n {
        if empty_every > 0 && r % empty_every == empty_every - 1 {
            continue;
        }
        for _ in 0..rng.random_range(1..=2 * avg.max(1)) {
            edges.push((r as u32, rng.random_range(0..n as u32)));
        }
    }
    Csr::from_edges(n, n, &edges).expect("valid edges")
}

/// `n` nodes whose row `hub` attends to all `n` nodes (n ≈ 10^5 makes the 10^5-edge hub),
/// other rows a few random neighbours, and one empty row.
pub fn hub_graph(rng: &mut Pcg64, n: usize, hub: usize) -> Csr {
    let mut edges: Vec<(u32, u32)> = (0..n as u32).map(|c| (hub as u32, c)).collect();
    for r in 0..n {
        if r == hub || r == n / 2 {
            continue;
        }
        for _ in 0..3 {
            edges.push((r as u32, rng.random_range(0..n as u32)));
        }
    }
    Csr::from_edges(n, n, &edges).expect("valid edges")
}

/// The tolerance of DESIGN.md for an output of type `T`.
pub fn tolerance<T: DType>() -> f64 {
    match T::NAME {
        "f32" => 1e-5,
        "f16" => 5e-3,
        _ => 2e-2,
    }
}
