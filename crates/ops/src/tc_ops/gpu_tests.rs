//! GPU tests of the tensor-core ops on ME-BCRS against the f64 CPU reference, of the per-call
//! backend switch and of the layout conversions.
//!
//! Every test is `#[ignore]`d on machines without an NVIDIA GPU; run them with
//! `cargo test -- --include-ignored` or from the GPU bundle. Inputs are drawn fresh per run (the
//! seed is printed; replay with SPATTN_SEED), outputs are poisoned with NaN before each launch,
//! and errors are ‖out − ref‖ / ‖ref‖ in f64. Per-slot values are head-major
//! (`h · n_slots + slot`); the host helpers below move them to CSR order for the reference.

use half::{bf16, f16};
use rand::Rng;
use rand_pcg::Pcg64;
use spattn_formats::{Csr, MeBcrs, Reorder};
use spattn_ops::cpu::{self, rel_l2_error};
use spattn_ops::graph::{self, DeviceGraph, EdgeLayout, EdgeValues, Engine};
use spattn_ops::{tc_ops, DType, DTypeKind, DeviceMatrix, DeviceMeBcrs, DeviceVec, Gpu, Shape};
use spattn_test_support::*;

use crate::test_util::{gpu, random_vec, to_f64, tolerance};

/// Scores and probabilities from exact inputs are f32 arithmetic: f32-level accuracy.
const F32_TOL: f64 = 1e-5;

/// The tolerance (docs/kernels/README.md) for a tensor-core op with operands of type `T` (f32 runs as tf32).
fn tc_tolerance<T: DType>() -> f64 {
    match T::KIND {
        DTypeKind::F32 => 1e-3,
        DTypeKind::F16 => 5e-3,
        DTypeKind::Bf16 => 2e-2,
    }
}

/// The slot layout of a device matrix, downloaded: the edge → slot map (in the graph's CSR edge
/// order, whatever the row order of the matrix) and the per-vector row masks.
struct Slots {
    e2s: Vec<u32>,
    masks: Vec<u8>,
    n_slots: usize,
}

impl Slots {
    fn of(dev: &DeviceMeBcrs) -> Self {
        Slots {
            e2s: dev.edge_to_slot().to_host().unwrap(),
            masks: dev.row_masks().to_host().unwrap(),
            n_slots: dev.n_slots(),
        }
    }

    /// Head-major slot values (`heads × n_slots`) in CSR order (`nnz × heads`).
    fn gather(&self, slots: &[f32], heads: usize) -> Vec<f32> {
        let n = self.n_slots;
        assert_eq!(slots.len(), n * heads);
        let mut out = vec![0.0f32; self.e2s.len() * heads];
        for (e, &slot) in self.e2s.iter().enumerate() {
            for h in 0..heads {
                out[e * heads + h] = slots[h * n + slot as usize];
            }
        }
        out
    }

    /// CSR-order values (`nnz × heads`) in head-major slots, padding slots set to `fill`.
    fn scatter(&self, values: &[f32], heads: usize, fill: f32) -> Vec<f32> {
        let n = self.n_slots;
        let mut out = vec![fill; n * heads];
        for (e, &slot) in self.e2s.iter().enumerate() {
            for h in 0..heads {
                out[h * n + slot as usize] = values[e * heads + h];
            }
        }
        out
    }

    /// Checks that every padding slot of every head holds exactly `expected` (by bits), and
    /// that the edge slots are exactly the mask bits.
    fn check_padding(&self, slots: &[f32], heads: usize, expected: f32, what: &str) {
        let n = self.n_slots;
        let bits: usize = self.masks.iter().map(|m| m.count_ones() as usize).sum();
        assert_eq!(bits, self.e2s.len(), "{what}: one mask bit per edge");
        for h in 0..heads {
            for (v, &mask) in self.masks.iter().enumerate() {
                for r in 0..8 {
                    if mask & (1 << r) == 0 {
                        let x = slots[h * n + v * 8 + r];
                        assert_eq!(
                            x.to_bits(),
                            expected.to_bits(),
                            "{what}: padding slot {} of head {h} holds {x}",
                            v * 8 + r
                        );
                    }
                }
            }
        }
    }
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// Runs SDDMM, edge softmax (plain in place, LeakyReLU out of place) and SpMM of `a` on tensor
/// cores, with the rows ordered as `reorder` says, with fresh random inputs and compares each
/// with the f64 CPU reference (in the graph's own order).
fn check_ops<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    reorder: Reorder,
    heads: usize,
    head_dim: usize,
    rng: &mut Pcg64,
) {
    let dev = DeviceMeBcrs::from_csr_reordered(gpu, a, reorder).unwrap();
    let ctx = format!(
        "{} n={}x{} nnz={} heads={heads} head_dim={head_dim} rows {:?}-ordered",
        T::NAME,
        a.n_rows(),
        a.n_cols(),
        a.nnz(),
        dev.row_order().used,
    );
    let me = Slots::of(&dev);
    if dev.row_order().used == Reorder::None {
        // The host format's map, unchanged on upload.
        let host = MeBcrs::from_csr(a, MeBcrs::BLOCK_WIDTH_F16).unwrap();
        assert_eq!(me.e2s, host.edge_to_slot().unwrap(), "{ctx}: edge -> slot");
        assert!(dev.row_ids().is_none());
    } else {
        assert_eq!(dev.row_ids().map(|r| r.len()), Some(a.n_rows()));
        assert_eq!(dev.row_order().vectors, dev.n_vectors());
    }
    let sq = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let sk = Shape::new(a.n_cols(), heads, head_dim).unwrap();
    let n_slot_values = me.n_slots * heads;
    let edges = a.nnz() * heads;
    let scale = 1.0 / (head_dim as f64).sqrt();
    // Scores of exact f16/bf16 inputs are f32 sums of exact products; tf32 rounds the operands.
    let sddmm_tol = if T::KIND == DTypeKind::F32 {
        1e-3
    } else {
        F32_TOL
    };

    // SDDMM.
    let q: Vec<T> = random_vec(rng, sq.len(), 1.0);
    let k: Vec<T> = random_vec(rng, sk.len(), 1.0);
    let dq = DeviceMatrix::from_host(gpu, sq, &q).unwrap();
    let dk = DeviceMatrix::from_host(gpu, sk, &k).unwrap();
    let mut scores = DeviceVec::<f32>::zeros(gpu, n_slot_values).unwrap();
    scores.fill_nan().unwrap();
    tc_ops::sddmm(gpu, &dev, &dq, &dk, scale as f32, &mut scores).unwrap();
    let got_slots = scores.to_host().unwrap();
    me.check_padding(&got_slots, heads, f32::NEG_INFINITY, "sddmm");
    let got = me.gather(&got_slots, heads);
    let mut want = vec![0.0f64; edges];
    cpu::sddmm(a, &to_f64(&q), &to_f64(&k), sq, sk, scale, &mut want).unwrap();
    // A score's rounding error scales with scale · Σ|q_i k_i| (f32 sums of the products; tf32
    // also rounds each operand, relative 2^-11), not with the score, which can cancel to near 0:
    // a one-edge graph is a single such score (it failed the plain relative error at 1.8e-3 in
    // tf32 with 3 features, and at 5.8e-5 in f16 with 128). Measured against that magnitude.
    let abs = |x: &[T]| -> Vec<f64> { to_f64(x).iter().map(|v| v.abs()).collect() };
    let mut magnitude = vec![0.0f64; edges];
    cpu::sddmm(a, &abs(&q), &abs(&k), sq, sk, scale, &mut magnitude).unwrap();
    let diff: f64 = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (*g as f64 - w).powi(2))
        .sum();
    let norm: f64 = magnitude.iter().map(|m| m * m).sum();
    let err = if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    };
    assert!(err <= sddmm_tol, "tc sddmm {ctx}: rel error {err:e}");

    // Edge softmax with LeakyReLU(0.2) on a copy of the slot scores (padding = -inf).
    let mut p = DeviceVec::<f32>::zeros(gpu, n_slot_values).unwrap();
    p.copy_from(&scores).unwrap();
    tc_ops::edge_softmax_in_place(gpu, &dev, &mut p, heads, Some(0.2)).unwrap();
    let p_slots = p.to_host().unwrap();
    me.check_padding(&p_slots, heads, 0.0, "edge_softmax(leaky)");
    let mut want_p = vec![0.0f64; edges];
    cpu::edge_softmax(a, &f64s(&got), heads, Some(0.2), &mut want_p).unwrap();
    let err = rel_l2_error(&me.gather(&p_slots, heads), &want_p);
    assert!(
        err <= F32_TOL,
        "tc edge_softmax(leaky) {ctx}: rel error {err:e}"
    );

    // Edge softmax in place on the dot scores.
    tc_ops::edge_softmax_in_place(gpu, &dev, &mut scores, heads, None).unwrap();
    let probs_slots = scores.to_host().unwrap();
    me.check_padding(&probs_slots, heads, 0.0, "edge_softmax");
    let probs = me.gather(&probs_slots, heads);
    cpu::edge_softmax(a, &f64s(&got), heads, None, &mut want_p).unwrap();
    let err = rel_l2_error(&probs, &want_p);
    assert!(err <= F32_TOL, "tc edge_softmax {ctx}: rel error {err:e}");

    // SpMM with those probabilities, straight from the softmax.
    let v: Vec<T> = random_vec(rng, sk.len(), 1.0);
    let dv = DeviceMatrix::from_host(gpu, sk, &v).unwrap();
    let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
    out.fill_nan().unwrap();
    tc_ops::spmm(gpu, &dev, &scores, &dv, &mut out).unwrap();
    let first = out.to_host().unwrap();
    let mut want_o = vec![0.0f64; sq.len()];
    cpu::spmm(a, &f64s(&probs), &to_f64(&v), sk, &mut want_o).unwrap();
    let err = rel_l2_error(&to_f64(&first), &want_o);
    assert!(
        err <= tc_tolerance::<T>(),
        "tc spmm {ctx}: rel error {err:e}"
    );

    // Again, with NaN in every padding slot of P: ignored, and the same bits as before (split
    // windows are summed in a fixed order; no state left in the scratch).
    let poisoned = me.scatter(&probs, heads, f32::NAN);
    let dp = DeviceVec::from_host(gpu, &poisoned).unwrap();
    out.fill_nan().unwrap();
    tc_ops::spmm(gpu, &dev, &dp, &dv, &mut out).unwrap();
    let second = out.to_host().unwrap();
    let same = first
        .iter()
        .zip(&second)
        .all(|(x, y)| bytemuck::bytes_of(x) == bytemuck::bytes_of(y));
    assert!(
        same,
        "tc spmm {ctx}: second run (NaN padding) differs from the first"
    );
}

/// [`check_ops`] in every dtype at one case, in the graph's own order and renumbered (degree,
/// locality and cluster orders for f16 and f32, locality and cluster for bf16; a rectangular
/// graph's locality order is that of its rows and columns as one bipartite graph).
fn check_case(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    for r in [
        Reorder::None,
        Reorder::Degree,
        Reorder::Locality,
        Reorder::Cluster,
    ] {
        check_ops::<f16>(gpu, a, r, heads, head_dim, rng);
        check_ops::<f32>(gpu, a, r, heads, head_dim, rng);
    }
    for r in [Reorder::None, Reorder::Locality, Reorder::Cluster] {
        check_ops::<bf16>(gpu, a, r, heads, head_dim, rng);
    }
}

/// A random `n_rows × n_cols` pattern, about `avg` edges per row, every third row empty.
fn rect_graph(rng: &mut Pcg64, n_rows: usize, n_cols: usize, avg: usize) -> Csr {
    let mut edges = Vec::new();
    for r in 0..n_rows {
        if r % 3 == 2 {
            continue;
        }
        for _ in 0..rng.random_range(1..=2 * avg) {
            edges.push((r as u32, rng.random_range(0..n_cols as u32)));
        }
    }
    Csr::from_edges(n_rows, n_cols, &edges).unwrap()
}

/// Whether the tensor-core SpMM of `a` (natural order) takes the pipelined kernel for f16 at
/// `head_dim` features.
fn f16_spmm_pipelined(gpu: &Gpu, a: &Csr, head_dim: usize) -> bool {
    tc_ops::spmm_pipelined::<f16>(&DeviceMeBcrs::from_csr(gpu, a).unwrap(), head_dim)
}

gpu_sweep_tests! {
    gpu = gpu();
    check = check_case;
    fn tc_ops_on_cora_pubmed_arxiv = shared_graphs(&[(1, 128), (8, 64), (2, 24)]);
    fn tc_ops_on_rmat_16 = rmat_16(&[(1, 128), (8, 16), (1, 3)]);
    fn tc_every_head_dim_and_head_count(sweep) {
        let a = random_graph(&mut sweep.rng, 300, 6, 7);
        // More than a k-step per window: SpMM takes the pipelined kernel for f16/bf16 at 128
        // and 256 features, the register kernel otherwise; both are checked below.
        let dev = DeviceMeBcrs::from_csr(&sweep.gpu, &a).unwrap();
        assert!(tc_ops::spmm_pipelined::<f16>(&dev, 128) && tc_ops::spmm_pipelined::<bf16>(&dev, 256));
        assert!(!tc_ops::spmm_pipelined::<f32>(&dev, 128) && !tc_ops::spmm_pipelined::<f16>(&dev, 64));
        sweep.on(&a, &grid(&[1, 3, 24, 64, 96, 128, 256], &[1, 2, 8]));
        // Tails of every kind: odd, even but not a multiple of 8, a multiple of 8 but not of
        // 16, past one 128-feature slab.
        sweep.on(&a, &grid(&[2, 6, 12, 40, 200], &[2]));
    }
    fn tc_tiny_graphs_empty_rows_rectangular(sweep) {
        sweep.tiny([1, 7, 17, 33], 3, 3, &[(1, 1), (2, 3), (8, 64), (1, 128)]);
        // A partial last window (45 = 5 x 8 + 5 rows) and empty rows through the pipelined
        // SpMM (about 20 edges per row: more than a k-step per window), and through the
        // register kernel on one row (a single vector).
        let a = random_graph(&mut sweep.rng, 45, 10, 4);
        assert!(f16_spmm_pipelined(&sweep.gpu, &a, 128));
        sweep.on(&a, &[(2, 128)]);
        let one = random_graph(&mut sweep.rng, 1, 3, 0);
        assert!(!f16_spmm_pipelined(&sweep.gpu, &one, 128));
        // n_cols != n_rows, both ways, partial last windows.
        for (rows, cols) in [(37, 50), (50, 13), (9, 1)] {
            let a = rect_graph(&mut sweep.rng, rows, cols, 4);
            sweep.on(&a, &[(1, 16), (2, 24), (3, 5)]);
        }
        // No edges at all (empty windows only): SpMM writes zeros everywhere.
        sweep.on(&Csr::empty(9, 9).unwrap(), &[(2, 8)]);
        // No rows.
        sweep.on(&Csr::empty(0, 4).unwrap(), &[(1, 16)]);
    }
    fn tc_hub_row_of_100k_edges = hub(100_000, 12_345, &[(1, 128), (2, 24)]);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tc_softmax_extremes() {
    let gpu = gpu();
    let mut rng = fresh_rng("tc_softmax_extremes");
    let a = hub_graph(&mut rng, 5_000, 10);
    let dev = DeviceMeBcrs::from_csr(&gpu, &a).unwrap();
    let me = Slots::of(&dev);
    let heads = 2;
    let edges = a.nnz() * heads;
    // The softmax of per-edge scores s through the slots, whose padding holds NaN (the
    // softmax must not read it) and comes back 0.
    let softmax = |s: &[f32], what: &str| {
        let mut p = DeviceVec::from_host(&gpu, &me.scatter(s, heads, f32::NAN)).unwrap();
        tc_ops::edge_softmax_in_place(&gpu, &dev, &mut p, heads, None).unwrap();
        let p_slots = p.to_host().unwrap();
        me.check_padding(&p_slots, heads, 0.0, what);
        me.gather(&p_slots, heads)
    };
    let cases = softmax_extreme_scores(&mut rng, edges);
    for (what, s) in cases {
        let got = softmax(&s, what);
        let mut want = vec![0.0; edges];
        cpu::edge_softmax(&a, &f64s(&s), heads, None, &mut want).unwrap();
        let err = rel_l2_error(&got, &want);
        assert!(err <= F32_TOL, "tc softmax {what}: rel error {err:e}");
        assert_rows_sum_to_one(&a, &got, heads, &format!("tc softmax {what}"));
    }
    // Masked edges (-inf), whole rows of them (the hub's long window among them): zeros there,
    // as on the CPU; then a NaN score in two of those rows and in a row with live edges makes
    // each of them NaN, as on the CPU.
    let masked = masked_scores(&mut rng, &a, heads);
    let nan = with_nan_scores(&a, &masked, heads);
    for (what, s) in [("masked", masked), ("masked with NaN", nan)] {
        let got = softmax(&s, what);
        assert_masked_softmax(&a, &s, &got, heads, &format!("tc softmax {what}"));
        let mut want = vec![0.0; edges];
        cpu::edge_softmax(&a, &f64s(&s), heads, None, &mut want).unwrap();
        assert_close_with_same_nans(&got, &want, F32_TOL, &format!("tc softmax {what}"));
    }
}

/// CSR → slots → CSR through the kernels of `dev` (the device's own edge → slot map; the
/// map itself is checked against the CPU reference by `check_ops`).
fn check_conversions(gpu: &Gpu, dev: &DeviceMeBcrs, a: &Csr, rng: &mut Pcg64) {
    let me = Slots::of(dev);
    for heads in [1, 3] {
        let vals: Vec<f32> = (0..a.nnz() * heads)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let dvals = DeviceVec::from_host(gpu, &vals).unwrap();
        let mut slots = DeviceVec::<f32>::zeros(gpu, me.n_slots * heads).unwrap();
        slots.fill_nan().unwrap();
        tc_ops::csr_to_slots(gpu, dev, &dvals, heads, -7.0, &mut slots).unwrap();
        let got_slots = slots.to_host().unwrap();
        assert_eq!(got_slots, me.scatter(&vals, heads, -7.0));
        let mut back = DeviceVec::<f32>::zeros(gpu, vals.len()).unwrap();
        back.fill_nan().unwrap();
        tc_ops::slots_to_csr(gpu, dev, &slots, heads, &mut back).unwrap();
        assert_eq!(back.to_host().unwrap(), vals, "CSR -> slots -> CSR");
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn layout_conversions_round_trip() {
    let gpu = gpu();
    let mut rng = fresh_rng("layout_conversions_round_trip");
    for a in [
        random_graph(&mut rng, 1000, 5, 4),
        rect_graph(&mut rng, 33, 70, 6),
        hub_graph(&mut rng, 20_000, 7),
    ] {
        let natural = DeviceMeBcrs::from_csr(&gpu, &a).unwrap();
        // The device map is the host format's.
        let host = MeBcrs::from_csr(&a, 8).unwrap();
        assert_eq!(Slots::of(&natural).e2s, host.edge_to_slot().unwrap());
        check_conversions(&gpu, &natural, &a, &mut rng);
        let degree = DeviceMeBcrs::from_csr_reordered(&gpu, &a, Reorder::Degree).unwrap();
        check_conversions(&gpu, &degree, &a, &mut rng);
        // Through the tagged values of the backend switch.
        let g = DeviceGraph::new(&gpu, a.clone());
        let vals: Vec<f32> = (0..a.nnz() * 2)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let ev = EdgeValues::from_vec(
            &g,
            EdgeLayout::Csr,
            2,
            DeviceVec::from_host(&gpu, &vals).unwrap(),
        )
        .unwrap();
        let s = ev.to_layout(&gpu, &g, EdgeLayout::Slots).unwrap();
        assert_eq!(s.layout(), EdgeLayout::Slots);
        assert_eq!(s.values().len(), host.n_slots() * 2);
        let back = s.into_layout(&gpu, &g, EdgeLayout::Csr).unwrap();
        assert_eq!(back.values().to_host().unwrap(), vals);
    }
}

/// SDDMM → softmax → SpMM through `graph::` on one backend, or with the layouts crossing.
fn run_chain<T: DType>(
    gpu: &Gpu,
    g: &DeviceGraph,
    backends: [Engine; 3],
    q: &DeviceMatrix<T>,
    k: &DeviceMatrix<T>,
    v: &DeviceMatrix<T>,
    scale: f32,
) -> (Vec<f32>, Vec<T>) {
    let heads = q.shape().heads;
    let mut s = EdgeValues::zeros(gpu, g, EdgeLayout::Csr, heads).unwrap();
    s.values_mut().fill_nan().unwrap();
    graph::sddmm(gpu, g, backends[0], q, k, scale, &mut s).unwrap();
    assert_eq!(s.layout(), backends[0].layout());
    graph::edge_softmax_in_place(gpu, g, backends[1], &mut s, None).unwrap();
    assert_eq!(s.layout(), backends[1].layout());
    let probs = s.to_layout(gpu, g, EdgeLayout::Csr).unwrap();
    let mut out = DeviceMatrix::<T>::zeros(gpu, q.shape()).unwrap();
    out.fill_nan().unwrap();
    graph::spmm(gpu, g, backends[2], &s, v, &mut out).unwrap();
    (probs.values().to_host().unwrap(), out.to_host().unwrap())
}

fn check_backends_agree<T: DType>(
    gpu: &Gpu,
    a: &Csr,
    heads: usize,
    head_dim: usize,
    rng: &mut Pcg64,
) {
    let g = DeviceGraph::new(gpu, a.clone());
    assert!(g.supports(Engine::TensorCore));
    let shape = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let x = |rng: &mut Pcg64| {
        let h: Vec<T> = random_vec(rng, shape.len(), 1.0);
        (DeviceMatrix::from_host(gpu, shape, &h).unwrap(), h)
    };
    let ((q, qh), (k, kh), (v, vh)) = (x(rng), x(rng), x(rng));
    let scale = 1.0 / (head_dim as f64).sqrt();
    let (q64, k64, v64) = (to_f64(&qh), to_f64(&kh), to_f64(&vh));
    let inputs = cpu::AttentionInputs::new(&q64, shape, &k64, shape, &v64, shape);
    let want = cpu::attention_f64_from(a, &inputs, scale).unwrap();
    let (cc_p, cc_out) = run_chain(gpu, &g, [Engine::CudaCore; 3], &q, &k, &v, scale as f32);
    let (tc_p, tc_out) = run_chain(gpu, &g, [Engine::TensorCore; 3], &q, &k, &v, scale as f32);
    use Engine::{CudaCore as C, TensorCore as T_};
    let (mx_p, mx_out) = run_chain(gpu, &g, [C, T_, C], &q, &k, &v, scale as f32);
    let (mx2_p, mx2_out) = run_chain(gpu, &g, [T_, C, T_], &q, &k, &v, scale as f32);
    let cc_p64 = f64s(&cc_p);
    let p_tol = if T::KIND == DTypeKind::F32 {
        1e-3
    } else {
        F32_TOL
    };
    for (what, p) in [("tc", &tc_p), ("cc-tc-cc", &mx_p), ("tc-cc-tc", &mx2_p)] {
        let err = rel_l2_error(p, &cc_p64);
        assert!(
            err <= p_tol,
            "{} probabilities {what} vs cuda-core: {err:e}",
            T::NAME
        );
    }
    let tol = tc_tolerance::<T>().max(tolerance::<T>());
    for (what, out) in [
        ("cuda-core", &cc_out),
        ("tensor-core", &tc_out),
        ("cc-tc-cc", &mx_out),
        ("tc-cc-tc", &mx2_out),
    ] {
        let err = rel_l2_error(&to_f64(out), &want);
        assert!(
            err <= tol,
            "{} attention {what}: rel error {err:e}",
            T::NAME
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn backend_switch_gives_the_same_answer() {
    let gpu = gpu();
    let mut rng = fresh_rng("backend_switch_gives_the_same_answer");
    let cora = shared_graph("cora");
    let hub = hub_graph(&mut rng, 30_000, 99);
    for a in [&cora, &hub] {
        check_backends_agree::<f16>(&gpu, a, 4, 32, &mut rng);
        check_backends_agree::<bf16>(&gpu, a, 1, 64, &mut rng);
        check_backends_agree::<f32>(&gpu, a, 2, 24, &mut rng);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tc_shape_errors_are_typed() {
    let gpu = gpu();
    let a = Csr::from_edges(4, 4, &[(0, 1), (1, 2)]).unwrap();
    let dev = DeviceMeBcrs::from_csr(&gpu, &a).unwrap();
    let q = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(4, 1, 8).unwrap()).unwrap();
    let k_bad = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(5, 1, 8).unwrap()).unwrap();
    let mut s = DeviceVec::<f32>::zeros(&gpu, dev.n_slots()).unwrap();
    let e = tc_ops::sddmm(&gpu, &dev, &q, &k_bad, 1.0, &mut s).unwrap_err();
    assert!(
        matches!(e, spattn_ops::Error::ShapeMismatch { what: "K", .. }),
        "{e}"
    );
    // CSR-order length where slots are expected.
    let mut s_bad = DeviceVec::<f32>::zeros(&gpu, a.nnz()).unwrap();
    let e = tc_ops::sddmm(&gpu, &dev, &q, &q, 1.0, &mut s_bad).unwrap_err();
    assert!(
        matches!(e, spattn_ops::Error::LengthMismatch { what: "scores", .. }),
        "{e}"
    );
    let e = tc_ops::edge_softmax_in_place(&gpu, &dev, &mut s_bad, 1, None).unwrap_err();
    assert!(matches!(e, spattn_ops::Error::LengthMismatch { .. }), "{e}");
    let mut out_bad = DeviceMatrix::<f16>::zeros(&gpu, Shape::new(3, 1, 8).unwrap()).unwrap();
    let e = tc_ops::spmm(&gpu, &dev, &s, &q, &mut out_bad).unwrap_err();
    assert!(
        matches!(e, spattn_ops::Error::ShapeMismatch { what: "out", .. }),
        "{e}"
    );
    let e = tc_ops::edge_softmax_in_place(&gpu, &dev, &mut s, 0, None).unwrap_err();
    assert!(
        matches!(e, spattn_ops::Error::InvalidArgument { .. }),
        "{e}"
    );
    // The shared graph uploads each format on first use, once.
    let g = DeviceGraph::new(&gpu, a.clone());
    assert_eq!(g.device_bytes(), 0);
    let mut ev = EdgeValues::zeros(&gpu, &g, EdgeLayout::Csr, 1).unwrap();
    graph::sddmm(&gpu, &g, Engine::TensorCore, &q, &q, 1.0, &mut ev).unwrap();
    let held = g.device_bytes();
    assert!(held > 0);
    assert!(std::sync::Arc::ptr_eq(
        &g.mebcrs().unwrap(),
        &g.mebcrs().unwrap()
    ));
    graph::sddmm(&gpu, &g, Engine::TensorCore, &q, &q, 1.0, &mut ev).unwrap();
    assert_eq!(g.device_bytes(), held);
    // Another handle's buffers are refused.
    let other = Gpu::new(0).unwrap();
    let e = tc_ops::sddmm(&other, &dev, &q, &q, 1.0, &mut s).unwrap_err();
    assert!(matches!(e, spattn_ops::Error::ForeignGpu { .. }), "{e}");
}
