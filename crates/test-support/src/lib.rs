//! # spattn-test-support
//!
//! What the tests of every spattn crate share (a dev-dependency, never a dependency):
//!
//! - where the graphs are, in the repository, beside the repository, and in a GPU bundle copied
//!   anywhere ([`data_dirs`], [`graph_path`], [`cora_path`]), and the quick mode of the
//!   bundle's `run.sh --quick` ([`test_graphs`]);
//! - fresh random inputs whose seed is printed and can be replayed ([`fresh_rng`],
//!   [`Inputs`]), adversarial graphs ([`random_graph`], [`hub_graph`]);
//! - the forward check every algorithm's GPU test runs ([`check_forward_twice`]).
//!
//! ```
//! let cora = spattn_test_support::shared_graph("cora"); // symmetrized with self loops
//! assert_eq!(cora.nnz(), 13264);
//! ```
#![allow(missing_docs)] // test support: the fields of `Inputs` say what they are by name

use std::path::PathBuf;

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use spattn_formats::{read_matrix_market, rmat, Csr, RmatConfig};
use spattn_ops::cpu::{attention_f64_from, rel_l2_error, AttentionInputs};
use spattn_ops::{DType, DTypeKind, DeviceMatrix, Shape};

/// The environment variable naming the folder of the graphs (the GPU bundle's run.sh sets it).
pub const DATA_DIR_ENV: &str = "SPATTN_DATA_DIR";

/// The environment variable of the quick mode (`run.sh --quick` sets it to 1): tests that
/// loop over the shared graphs run on cora alone.
pub const QUICK_ENV: &str = "SPATTN_QUICK";

/// The folders graphs are looked for in, in order: `$SPATTN_DATA_DIR`; `data/` beside the
/// test executable and beside its folder (a GPU bundle copied anywhere); the repository's
/// `crates/formats/tests/data` and `../shared/data/mtx`, as of the build.
pub fn data_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::var_os(DATA_DIR_ENV).filter(|d| !d.is_empty()) {
        dirs.push(PathBuf::from(dir));
    }
    if let Some(exe_dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(PathBuf::from))
    {
        dirs.push(exe_dir.join("data"));
        if let Some(up) = exe_dir.parent() {
            dirs.push(up.join("data"));
        }
    }
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    dirs.push(manifest.join("../formats/tests/data"));
    dirs.push(manifest.join("../../../shared/data/mtx"));
    dirs
}

/// `name.mtx.gz` in the first of [`data_dirs`] that has it.
pub fn find_graph(name: &str) -> Option<PathBuf> {
    data_dirs()
        .into_iter()
        .map(|d| d.join(format!("{name}.mtx.gz")))
        .find(|p| p.is_file())
}

/// The path of graph `name`; panics with the folders searched and how to point at others.
#[track_caller]
pub fn graph_path(name: &str) -> PathBuf {
    find_graph(name).unwrap_or_else(|| {
        let dirs: Vec<String> = data_dirs()
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        panic!(
            "{name}.mtx.gz not found in {}; set {DATA_DIR_ENV} to the folder that holds it",
            dirs.join(", ")
        )
    })
}

/// The bundled cora (`crates/formats/tests/data/cora.mtx.gz`, or `data/` of a GPU bundle).
pub fn cora_path() -> PathBuf {
    graph_path("cora")
}

/// The folder of the shared graphs (`graphs.json` and `mtx/`) beside the repository, where
/// it exists.
pub fn shared_data_root() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    root.join("graphs.json").is_file().then_some(root)
}

/// Whether the quick mode is on ([`QUICK_ENV`] = 1).
pub fn quick() -> bool {
    std::env::var(QUICK_ENV).is_ok_and(|v| v == "1")
}

/// The graphs a test loops over: `names`, or in the quick mode only those of them that are
/// cheap (cora), saying on stderr which were left out.
pub fn test_graphs<'a>(names: &[&'a str]) -> Vec<&'a str> {
    if !quick() {
        return names.to_vec();
    }
    let (kept, left): (Vec<&str>, Vec<&str>) = names.iter().partition(|n| **n == "cora");
    if !left.is_empty() {
        eprintln!("{QUICK_ENV}=1: {} left out", left.join(", "));
    }
    kept
}

/// A graph found by [`graph_path`], symmetrized with self loops (the benchmark convention).
#[track_caller]
pub fn shared_graph(name: &str) -> Csr {
    let path = graph_path(name);
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

/// The tolerance for an output of type `T` against the f64 reference (f32 1e-5, f16 5e-3,
/// bf16 2e-2).
pub fn tolerance<T: DType>() -> f64 {
    match T::NAME {
        "f32" => 1e-5,
        "f16" => 5e-3,
        _ => 2e-2,
    }
}

/// The tolerance of a tensor-core algorithm for `T`: f32 runs through tf32 (1e-3).
pub fn tol_tf32<T: DType>() -> f64 {
    match T::KIND {
        DTypeKind::F32 => 1e-3,
        _ => tolerance::<T>(),
    }
}

/// Inputs of one attention case, in f64, exactly representable in `T` (the reference reads
/// them as they are; the GPU side rounds them to `T`, losing nothing).
pub struct Inputs {
    pub q: Vec<f64>,
    pub k: Vec<f64>,
    pub v: Vec<f64>,
    pub shape_q: Shape,
    pub shape_kv: Shape,
}

impl Inputs {
    /// Q uniform in ±`amp`, K and V in ±1, rounded to `T`.
    pub fn draw<T: DType>(
        rng: &mut Pcg64,
        a: &Csr,
        heads: usize,
        head_dim: usize,
        amp: f64,
    ) -> Self {
        let shape_q = Shape::new(a.n_rows(), heads, head_dim).unwrap();
        let shape_kv = Shape::new(a.n_cols(), heads, head_dim).unwrap();
        Self {
            q: to_f64(&random_vec::<T>(rng, shape_q.len(), amp)),
            k: to_f64(&random_vec::<T>(rng, shape_kv.len(), 1.0)),
            v: to_f64(&random_vec::<T>(rng, shape_kv.len(), 1.0)),
            shape_q,
            shape_kv,
        }
    }

    /// Values on the grid k/256, |k| ≤ 256 (Q: times `amp`, a power of two): exact in f16
    /// and bf16 alike, so one f64 reference serves both.
    pub fn draw_half(rng: &mut Pcg64, a: &Csr, heads: usize, head_dim: usize) -> Self {
        let shape_q = Shape::new(a.n_rows(), heads, head_dim).unwrap();
        let shape_kv = Shape::new(a.n_cols(), heads, head_dim).unwrap();
        let mut grid = |len: usize| -> Vec<f64> {
            (0..len)
                .map(|_| f64::from(rng.random_range(-256i32..=256)) / 256.0)
                .collect()
        };
        Self {
            q: grid(shape_q.len()),
            k: grid(shape_kv.len()),
            v: grid(shape_kv.len()),
            shape_q,
            shape_kv,
        }
    }

    /// The f64 CPU reference of these inputs.
    pub fn reference(&self, a: &Csr, scale: f64) -> Vec<f64> {
        let inputs = AttentionInputs::new(
            &self.q,
            self.shape_q,
            &self.k,
            self.shape_kv,
            &self.v,
            self.shape_kv,
        );
        attention_f64_from(a, &inputs, scale).unwrap()
    }
}

/// Uploads `inputs` as `T`, runs `forward(q, k, v, out)` twice with `out` poisoned with NaN
/// before each run, and checks each result against `want` (relative error ≤ `tol`), that the
/// rows of `a` without edges are exactly zero, and that the second run repeats the first bit
/// for bit. `what` names the case in failures.
pub fn check_forward_twice<T: DType>(
    gpu: &spattn_ops::Gpu,
    a: &Csr,
    inputs: &Inputs,
    want: &[f64],
    tol: f64,
    what: &str,
    mut forward: impl FnMut(&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>, &mut DeviceMatrix<T>),
) {
    let cast = |x: &[f64]| x.iter().map(|&v| T::from_f64(v)).collect::<Vec<T>>();
    let dq = DeviceMatrix::from_host(gpu, inputs.shape_q, &cast(&inputs.q)).unwrap();
    let dk = DeviceMatrix::from_host(gpu, inputs.shape_kv, &cast(&inputs.k)).unwrap();
    let dv = DeviceMatrix::from_host(gpu, inputs.shape_kv, &cast(&inputs.v)).unwrap();
    let mut out = DeviceMatrix::<T>::zeros(gpu, inputs.shape_q).unwrap();
    let row_len = inputs.shape_q.row_len();
    let mut first: Option<Vec<T>> = None;
    for run in 0..2 {
        out.fill_nan().unwrap();
        forward(&dq, &dk, &dv, &mut out);
        let got = out.to_host().unwrap();
        let err = rel_l2_error(&to_f64(&got), want);
        assert!(err <= tol, "{what}: rel error {err:e} (run {run})");
        for r in (0..a.n_rows()).filter(|&r| a.degree(r) == 0) {
            let row = &got[r * row_len..(r + 1) * row_len];
            assert!(
                row.iter().all(|x| x.to_f64() == 0.0),
                "{what}: empty row {r} not zero"
            );
        }
        match &first {
            None => first = Some(got),
            Some(f) => {
                let same = f
                    .iter()
                    .zip(&got)
                    .all(|(x, y)| x.to_f64().to_bits() == y.to_f64().to_bits());
                assert!(same, "{what}: the second run differs from the first");
            }
        }
    }
}
