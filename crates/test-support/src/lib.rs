//! # spattn-test-support
//!
//! What the tests of every spattn crate share (a dev-dependency, never a dependency):
//!
//! - where the graphs are, in the repository, beside the repository, and in a GPU bundle copied
//!   anywhere ([`data_dirs`], [`graph_path`], [`cora_path`]), and the quick mode of the
//!   bundle's `run.sh --quick` ([`test_graphs`]);
//! - fresh random inputs whose seed is printed and can be replayed ([`fresh_rng`],
//!   [`Inputs`]), adversarial graphs ([`random_graph`], [`hub_graph`]);
//! - one test body per algorithm and op family: the GPU sweeps each runs its own check through
//!   ([`Sweep`], [`gpu_sweep_tests!`]: the shared graphs, R-MAT 16, random graphs over a grid
//!   of heads × head_dim, tiny graphs, a hub row), the forward check every algorithm runs
//!   ([`check_forward`], [`check_forward_twice`]), the extreme and equal scores every dtype
//!   runs ([`check_extreme_and_equal_scores`]), the softmax extremes the op families share
//!   ([`softmax_extreme_scores`], [`assert_rows_sum_to_one`]), and the graphs of the timing
//!   probes (spattn's `benches/probes.rs`, spattn-ops' `src/probes.rs`: [`timing_graphs`]).
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
use spattn_ops::{bf16, f16, DType, DTypeKind, DeviceMatrix, Gpu, Shape};

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

/// The graphs of a timing probe: the comma list in the environment variable `var` (or
/// `default` where it is unset) of shared graph names ([`shared_graph`]), `rmatN` (R-MAT
/// scale N, [`rmat_graph`]) and `uniformN` (2^N nodes, [`uniform_graph`]), each with its
/// name, read one at a time. In the quick mode the default is cora alone (the R-MAT plans
/// dominate a bundle run otherwise).
pub fn timing_graphs(var: &str, default: &str) -> impl Iterator<Item = (String, Csr)> {
    let list = std::env::var(var).unwrap_or_else(|_| {
        if quick() {
            eprintln!("{QUICK_ENV}=1: timings on cora only ({var} names others)");
            "cora".into()
        } else {
            default.into()
        }
    });
    let names: Vec<String> = list
        .split(',')
        .filter(|n| !n.is_empty())
        .map(String::from)
        .collect();
    names.into_iter().map(|n| {
        let a = if let Some(scale) = n.strip_prefix("rmat") {
            rmat_graph(scale.parse().expect("rmatN"))
        } else if let Some(scale) = n.strip_prefix("uniform") {
            uniform_graph(scale.parse().expect("uniformN"))
        } else {
            shared_graph(&n)
        };
        (n, a)
    })
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

/// `2^scale` nodes, each with 1–16 targets drawn uniformly (about 8.5 a row, no locality: the
/// columns of a 16-row window are nearly all distinct), from a fixed seed.
pub fn uniform_graph(scale: u32) -> Csr {
    random_graph(&mut Pcg64::seed_from_u64(42), 1 << scale, 8, 0)
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

/// `cliques` disjoint cliques of `size` nodes each (every edge within a clique, self loops
/// included): in the graph's order a 16-row window inside a clique fills whole 16 × 8 blocks,
/// the densest blocks a windowed kernel meets.
///
/// ```
/// let a = spattn_test_support::clique_graph(2, 3);
/// assert_eq!((a.n_rows(), a.nnz()), (6, 18));
/// assert_eq!(a.row(4), &[3, 4, 5]);
/// ```
pub fn clique_graph(cliques: usize, size: usize) -> Csr {
    let n = cliques * size;
    let edges: Vec<(u32, u32)> = (0..cliques)
        .flat_map(|c| {
            let first = (c * size) as u32;
            (0..size as u32)
                .flat_map(move |i| (0..size as u32).map(move |j| (first + i, first + j)))
        })
        .collect();
    Csr::from_edges(n, n, &edges).expect("valid edges")
}

/// The tolerance for an output of type `T` against the f64 reference (f32 1e-5, f16 5e-3,
/// bf16 2e-2).
pub fn tolerance<T: DType>() -> f64 {
    tolerance_of(T::NAME)
}

/// [`tolerance`] by the type's name (`DType::NAME`), for tests with another `DType` trait in
/// scope (spattn-ops' unit tests).
pub fn tolerance_of(name: &str) -> f64 {
    match name {
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

    /// [`Inputs::draw_half`] with Q = 0: every score equal, so every row is the mean of its
    /// neighbours' V.
    pub fn equal_scores(rng: &mut Pcg64, a: &Csr, heads: usize, head_dim: usize) -> Self {
        let mut x = Self::draw_half(rng, a, heads, head_dim);
        x.q.iter_mut().for_each(|q| *q = 0.0);
        x
    }

    /// The case as failures name it: `T`, the size of `a`, heads and head_dim.
    pub fn case<T: DType>(&self, a: &Csr) -> String {
        format!(
            "{} n={} nnz={} heads={} head_dim={}",
            T::NAME,
            a.n_rows(),
            a.nnz(),
            self.shape_q.heads,
            self.shape_q.head_dim
        )
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

/// [`check_forward`] of a tensor-core algorithm that merges partials in a fixed order
/// (fused-tc, the hybrid): within [`tol_tf32`], and the second run repeats the first bit for
/// bit. `what` names the algorithm and its settings; failures add the case
/// ([`Inputs::case`]).
pub fn check_forward_twice<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    inputs: &Inputs,
    want: &[f64],
    what: &str,
    forward: impl FnMut(&DeviceMatrix<T>, &DeviceMatrix<T>, &DeviceMatrix<T>, &mut DeviceMatrix<T>),
) {
    let what = format!("{what} {}", inputs.case::<T>(a));
    check_forward(gpu, a, inputs, want, tol_tf32::<T>(), &what, true, forward);
}

/// Uploads `inputs` as `T`, runs `forward(q, k, v, out)` twice with `out` poisoned with NaN
/// before each run, and checks each result against `want` (relative error ≤ `tol`) and that
/// the rows of `a` without edges are exactly zero; with `bit_for_bit`, also that the second run
/// repeats the first bit for bit (not for kernels that sum with f32 atomics). `what` names the
/// case in failures.
#[allow(clippy::too_many_arguments)]
pub fn check_forward<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    inputs: &Inputs,
    want: &[f64],
    tol: f64,
    what: &str,
    bit_for_bit: bool,
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
            Some(_) if !bit_for_bit => {}
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

/// The plan's default scale, 1/√head_dim rounded to f32, as the reference takes it.
pub fn default_scale(head_dim: usize) -> f64 {
    f64::from((1.0 / (head_dim as f64).sqrt()) as f32)
}

/// A forward check of the algorithm under test at any dtype, for the cases every algorithm
/// runs in f32, f16 and bf16 on the same inputs.
pub trait CheckDtype {
    /// Runs the algorithm on `inputs` rounded to `T` at `scale` (the plan's default where
    /// `None`) and checks its output against `want`.
    fn check<T: DType>(&mut self, a: &Csr, inputs: &Inputs, want: &[f64], scale: Option<f32>);
}

/// Scores near ±1e4 (Q scaled by 2.5e3 and by 1e4, K and V in ±1) in f32, f16 and bf16, each
/// on its own draw; then all scores equal ([`Inputs::equal_scores`]) in all three on one draw;
/// all at `scale`.
pub fn check_extreme_and_equal_scores(
    check: &mut impl CheckDtype,
    a: &Csr,
    heads: usize,
    head_dim: usize,
    scale: f32,
    rng: &mut Pcg64,
) {
    let s = Some(scale);
    for amp in [2.5e3, 1e4] {
        let x = Inputs::draw::<f32>(rng, a, heads, head_dim, amp);
        check.check::<f32>(a, &x, &x.reference(a, scale.into()), s);
        let x = Inputs::draw::<f16>(rng, a, heads, head_dim, amp);
        check.check::<f16>(a, &x, &x.reference(a, scale.into()), s);
        let x = Inputs::draw::<bf16>(rng, a, heads, head_dim, amp);
        check.check::<bf16>(a, &x, &x.reference(a, scale.into()), s);
    }
    let x = Inputs::equal_scores(rng, a, heads, head_dim);
    let want = x.reference(a, scale.into());
    check.check::<f32>(a, &x, &want, s);
    check.check::<f16>(a, &x, &want, s);
    check.check::<bf16>(a, &x, &want, s);
}

/// Rows 0..16 all attend to columns 0..64 (a window of 8 full blocks); rows 16..40 to 4
/// random columns of 70 each (windows of sparse blocks); 40 rows is not a multiple of 16.
pub fn dense_and_sparse_graph(rng: &mut Pcg64) -> Csr {
    let mut edges: Vec<(u32, u32)> = (0..16).flat_map(|r| (0..64).map(move |c| (r, c))).collect();
    for r in 16..40 {
        for _ in 0..4 {
            edges.push((r, rng.random_range(0..70)));
        }
    }
    Csr::from_edges(40, 70, &edges).unwrap()
}

/// A timing probe: prints times on the GPU it is given.
pub type Probe = fn(&Gpu);

/// The `main` of a timing probe (`benches/probes.rs`): runs each `(name, probe)` whose name
/// contains one of the command line's words (all of them without words; `cargo bench`'s own
/// `--` flags are ignored) on GPU 0, or says that there is no GPU and times nothing.
pub fn run_probes(probes: &[(&str, Probe)]) {
    let wanted: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let gpu = match Gpu::new(0) {
        Ok(gpu) => gpu,
        Err(e) => {
            println!("probes: no GPU ({e}); nothing timed");
            return;
        }
    };
    for (name, probe) in probes {
        if wanted.is_empty() || wanted.iter().any(|w| name.contains(w.as_str())) {
            probe(&gpu);
        }
    }
}

/// The GPU of the GPU tests (device 0); they are `#[ignore]`d where there is none.
pub fn gpu() -> Gpu {
    Gpu::new(0).expect("an NVIDIA GPU (this test is ignored elsewhere)")
}

/// Every `(heads, head_dim)` of `head_dims` × `heads`, head_dim-major.
pub fn grid(head_dims: &[usize], heads: &[usize]) -> Vec<(usize, usize)> {
    head_dims
        .iter()
        .flat_map(|&d| heads.iter().map(move |&h| (h, d)))
        .collect()
}

/// One check run over graphs and `(heads, head_dim)` shapes on the GPU with the test's fresh
/// random source: the GPU tests of every algorithm and op family run their own check through
/// these sweeps (mostly by [`gpu_sweep_tests!`]), so their test bodies are written once, with
/// each family's graphs and shapes as data.
///
/// `G` is the GPU handle the check takes: [`Gpu`], or spattn-ops' own in its unit tests (whose
/// crate is another copy of the one this crate links).
pub struct Sweep<F, G = Gpu> {
    /// The GPU the check runs on ([`gpu`]).
    pub gpu: G,
    /// The test's random source ([`fresh_rng`]), for graphs and inputs drawn between sweeps.
    pub rng: Pcg64,
    check: F,
}

impl<F: FnMut(&Gpu, &Csr, usize, usize, &mut Pcg64)> Sweep<F> {
    /// A sweep of test `test` (it names the printed seed) running `check(gpu, a, heads,
    /// head_dim, rng)` on [`gpu`].
    pub fn new(test: &str, check: F) -> Self {
        Self::with_gpu(test, gpu(), check)
    }
}

impl<G, F: FnMut(&G, &Csr, usize, usize, &mut Pcg64)> Sweep<F, G> {
    /// A sweep of test `test` running `check` on `gpu`.
    pub fn with_gpu(test: &str, gpu: G, check: F) -> Self {
        Self {
            gpu,
            rng: fresh_rng(test),
            check,
        }
    }

    /// `check` on `a` at each of `shapes`, in order.
    pub fn on(&mut self, a: &Csr, shapes: &[(usize, usize)]) -> &mut Self {
        for &(heads, head_dim) in shapes {
            (self.check)(&self.gpu, a, heads, head_dim, &mut self.rng);
        }
        self
    }

    /// On cora, pubmed and ogbn-arxiv, symmetrized with self loops (cora alone in the quick
    /// mode, [`test_graphs`]).
    pub fn shared_graphs(&mut self, shapes: &[(usize, usize)]) -> &mut Self {
        for name in test_graphs(&["cora", "pubmed", "ogbn-arxiv"]) {
            self.on(&shared_graph(name), shapes);
        }
        self
    }

    /// On R-MAT scale 16 ([`rmat_graph`]); scale 12 in the quick mode (said on stderr), whose
    /// skew exercises the same paths in a sixteenth of the time.
    pub fn rmat_16(&mut self, shapes: &[(usize, usize)]) -> &mut Self {
        let scale = if quick() {
            eprintln!("{QUICK_ENV}=1: R-MAT 12 instead of 16");
            12
        } else {
            16
        };
        self.on(&rmat_graph(scale), shapes)
    }

    /// On one [`random_graph`] of `n` nodes, about `avg` edges a row, every
    /// `empty_every`-th row empty.
    pub fn random(
        &mut self,
        n: usize,
        avg: usize,
        empty_every: usize,
        shapes: &[(usize, usize)],
    ) -> &mut Self {
        let a = random_graph(&mut self.rng, n, avg, empty_every);
        self.on(&a, shapes)
    }

    /// On a [`random_graph`] of each size in `ns` (tiny graphs: partial tiles and windows).
    pub fn tiny(
        &mut self,
        ns: impl IntoIterator<Item = usize>,
        avg: usize,
        empty_every: usize,
        shapes: &[(usize, usize)],
    ) -> &mut Self {
        for n in ns {
            self.random(n, avg, empty_every, shapes);
        }
        self
    }

    /// On a [`hub_graph`] of `n` nodes whose row `hub` attends to all `n` (checked).
    pub fn hub(&mut self, n: usize, hub: usize, shapes: &[(usize, usize)]) -> &mut Self {
        let a = hub_graph(&mut self.rng, n, hub);
        assert_eq!(a.degree(hub), n);
        self.on(&a, shapes)
    }
}

/// `#[ignore]`d GPU tests, each a [`Sweep`] of one check, named after the test (the name its
/// seed is printed with):
///
/// ```ignore
/// gpu_sweep_tests! {
///     check = check_case; // fn(&Gpu, &Csr, heads, head_dim, &mut Pcg64)
///     /// Doc comments and other attributes go on the test.
///     fn shared_graphs = shared_graphs(&[(1, 128), (8, 64)]); // one sweep
///     fn hub_row(sweep) {                                      // or a body with `sweep`
///         sweep.hub(100_000, 777, &[(1, 64)]);
///     }
/// }
/// ```
///
/// `gpu = EXPR;` before `check` runs the sweeps on `EXPR` ([`Sweep::with_gpu`]; spattn-ops'
/// unit tests pass their crate's own `Gpu`).
#[macro_export]
macro_rules! gpu_sweep_tests {
    (gpu = $gpu:expr; check = $check:expr; $($tests:tt)*) => {
        $crate::gpu_sweep_tests!(@tests [$gpu] $check; $($tests)*);
    };
    (check = $check:expr; $($tests:tt)*) => {
        $crate::gpu_sweep_tests!(@tests [$crate::gpu()] $check; $($tests)*);
    };
    (@tests [$gpu:expr] $check:expr;) => {};
    (@tests [$gpu:expr] $check:expr;
        $(#[$meta:meta])* fn $name:ident = $sweep:ident($($arg:expr),* $(,)?); $($rest:tt)*
    ) => {
        $crate::gpu_sweep_tests!(@tests [$gpu] $check; $(#[$meta])* fn $name(sweep) {
            sweep.$sweep($($arg),*);
        } $($rest)*);
    };
    (@tests [$gpu:expr] $check:expr;
        $(#[$meta:meta])* fn $name:ident($sweep:ident) $body:block $($rest:tt)*
    ) => {
        $(#[$meta])*
        #[test]
        #[ignore = "needs an NVIDIA GPU"]
        fn $name() {
            let $sweep = &mut $crate::Sweep::with_gpu(stringify!($name), $gpu, $check);
            $body
        }
        $crate::gpu_sweep_tests!(@tests [$gpu] $check; $($rest)*);
    };
}

/// Edge scores (`edges` values) that stress a softmax, each named: all equal, near +1e4, near
/// −1e4, spread over ±1e4.
pub fn softmax_extreme_scores(rng: &mut Pcg64, edges: usize) -> Vec<(&'static str, Vec<f32>)> {
    let mut near = |centre: f32| -> Vec<f32> {
        (0..edges)
            .map(|_| centre + rng.random_range(-5.0..5.0))
            .collect()
    };
    let (high, low) = (near(1e4), near(-1e4));
    vec![
        ("all equal", vec![3.5; edges]),
        ("near +1e4", high),
        ("near -1e4", low),
        (
            "spread ±1e4",
            (0..edges).map(|_| rng.random_range(-1e4..1e4)).collect(),
        ),
    ]
}

/// Scores (`nnz × heads`, CSR order) with masked edges (−∞): every edge of every third row
/// (a hub row's too where it falls there) and, elsewhere, one edge in four, head 1 of the
/// longest row entirely.
pub fn masked_scores(rng: &mut Pcg64, a: &Csr, heads: usize) -> Vec<f32> {
    let longest = (0..a.n_rows()).max_by_key(|&r| a.row_range(r).len());
    let mut s: Vec<f32> = (0..a.nnz() * heads)
        .map(|_| rng.random_range(-4.0..4.0))
        .collect();
    for r in 0..a.n_rows() {
        for e in a.row_range(r) {
            for h in 0..heads {
                let whole = r % 3 == 0 || (h == 1 && Some(r) == longest);
                if whole || (e + h) % 4 == 0 {
                    s[e * heads + h] = f32::NEG_INFINITY;
                }
            }
        }
    }
    s
}

/// `s` (as [`masked_scores`] makes them) with one NaN score in each of three (row, head)s: a
/// short row whose edges are all masked, the longest row's masked head (the long-row kernels;
/// `heads` ≥ 2) and a short row with live edges. A softmax makes each of these rows NaN.
///
/// # Panics
/// Where `a` lacks one of the three (a short masked row, a short live row, `heads` < 2).
pub fn with_nan_scores(a: &Csr, s: &[f32], heads: usize) -> Vec<f32> {
    let mut s = s.to_vec();
    let longest = (0..a.n_rows()).max_by_key(|&r| a.row_range(r).len());
    let masked = |s: &[f32], r: usize, h: usize| {
        a.row_range(r)
            .all(|e| s[e * heads + h] == f32::NEG_INFINITY)
    };
    let short = |r: usize| Some(r) != longest && a.row_range(r).len() >= 2;
    let picks = [
        (0..a.n_rows())
            .find(|&r| short(r) && masked(&s, r, 0))
            .map(|r| (r, 0)),
        longest.filter(|_| heads > 1).map(|r| (r, 1)),
        (0..a.n_rows())
            .find(|&r| short(r) && !masked(&s, r, 0))
            .map(|r| (r, 0)),
    ];
    for pick in picks {
        let (r, h) = pick.expect("a short masked row, a short live row and two heads");
        // The row's last edge: a NaN met after the row's other scores.
        let e = a.row_range(r).end - 1;
        s[e * heads + h] = f32::NAN;
    }
    s
}

/// Asserts that a softmax `p` of the scores `s` (both `nnz × heads`, CSR order) gives a row
/// whose scores are all −∞ exact zeros, a masked edge 0, a row holding a NaN score NaN
/// throughout and each other row a sum of one.
pub fn assert_masked_softmax(a: &Csr, s: &[f32], p: &[f32], heads: usize, what: &str) {
    for r in 0..a.n_rows() {
        for h in 0..heads {
            let at = |e: usize| e * heads + h;
            let range = a.row_range(r);
            if range.clone().any(|e| s[at(e)].is_nan()) {
                for e in range {
                    assert!(
                        p[at(e)].is_nan(),
                        "{what}: row {r} head {h} (a NaN score) edge {e}"
                    );
                }
                continue;
            }
            let live = range.clone().any(|e| s[at(e)] != f32::NEG_INFINITY);
            for e in range.filter(|&e| s[at(e)] == f32::NEG_INFINITY) {
                assert_eq!(p[at(e)], 0.0, "{what}: row {r} head {h} masked edge {e}");
            }
            let sum = row_sum(a, p, heads, r, h);
            let want = if live { 1.0 } else { 0.0 };
            assert!(
                (sum - want).abs() < 1e-4,
                "{what}: row {r} head {h} sums to {sum}, not {want}"
            );
        }
    }
}

/// Asserts that `got` is NaN exactly where `want` is and within `tol` of it (relative L2) over
/// the other elements.
pub fn assert_close_with_same_nans(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut kept = (Vec::new(), Vec::new());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.is_nan(),
            w.is_nan(),
            "{what}: element {i} is {g}, want {w}"
        );
        if !w.is_nan() {
            kept.0.push(g);
            kept.1.push(w);
        }
    }
    let err = rel_l2_error(&kept.0, &kept.1);
    assert!(err <= tol, "{what}: rel error {err:e}");
}

/// Row `r`'s probabilities of head `h` summed (`p`: `nnz × heads`, CSR order).
fn row_sum(a: &Csr, p: &[f32], heads: usize, r: usize, h: usize) -> f64 {
    a.row_range(r).map(|e| f64::from(p[e * heads + h])).sum()
}

/// Asserts that the probabilities `p` (CSR order, `nnz × heads`) of every non-empty row of `a`
/// sum to one per head, within 1e-4.
pub fn assert_rows_sum_to_one(a: &Csr, p: &[f32], heads: usize, what: &str) {
    for r in 0..a.n_rows() {
        let range = a.row_range(r);
        if range.is_empty() {
            continue;
        }
        for h in 0..heads {
            let sum = row_sum(a, p, heads, r, h);
            assert!(
                (sum - 1.0).abs() < 1e-4,
                "{what}: row {r} head {h} sums to {sum}"
            );
        }
    }
}
