//! GPU tests of the CUDA-core CSR ops against the f64 CPU reference.
//!
//! Every test is `#[ignore]`d on machines without an NVIDIA GPU; run them with
//! `cargo test -- --include-ignored` or from the GPU bundle (`cargo xtask gpu-bundle`).
//! Inputs are drawn fresh per run (the seed is printed; replay with SPATTN_SEED), outputs are
//! poisoned with NaN before each launch, and errors are ‖out − ref‖ / ‖ref‖ in f64.

use half::{bf16, f16};
use rand_pcg::Pcg64;
use spattn_formats::Csr;
use spattn_ops::cpu::{self, rel_l2_error};
use spattn_ops::{csr_ops, DType, DeviceCsr, DeviceMatrix, DeviceVec, Gpu, Shape};
use spattn_test_support::*;

use crate::test_util::{gpu, random_vec, to_f64, tolerance};

/// Scores and probabilities are f32 whatever the feature type: f32-level accuracy.
const F32_TOL: f64 = 1e-5;

/// Runs SDDMM (dot and GAT), edge softmax (plain and LeakyReLU) and SpMM of `a` on the GPU
/// with fresh random inputs and compares each with the f64 CPU reference.
fn check_ops<T: DType>(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    let ctx = format!(
        "{} n={} nnz={} heads={heads} head_dim={head_dim}",
        T::NAME,
        a.n_rows(),
        a.nnz()
    );
    let dev_a = DeviceCsr::upload(gpu, a).unwrap();
    let sq = Shape::new(a.n_rows(), heads, head_dim).unwrap();
    let sk = Shape::new(a.n_cols(), heads, head_dim).unwrap();
    let edges = a.nnz() * heads;
    let scale = 1.0 / (head_dim as f64).sqrt();

    // SDDMM, dot form.
    let q: Vec<T> = random_vec(rng, sq.len(), 1.0);
    let k: Vec<T> = random_vec(rng, sk.len(), 1.0);
    let dq = DeviceMatrix::from_host(gpu, sq, &q).unwrap();
    let dk = DeviceMatrix::from_host(gpu, sk, &k).unwrap();
    let mut scores = DeviceVec::<f32>::zeros(gpu, edges).unwrap();
    scores.fill_nan().unwrap();
    csr_ops::sddmm(gpu, &dev_a, &dq, &dk, scale as f32, &mut scores).unwrap();
    let got = scores.to_host().unwrap();
    let mut want = vec![0.0f64; edges];
    cpu::sddmm(a, &to_f64(&q), &to_f64(&k), sq, sk, scale, &mut want).unwrap();
    let err = rel_l2_error(&got, &want);
    assert!(err <= F32_TOL, "sddmm {ctx}: rel error {err:e}");

    // SDDMM, GAT form.
    let ad: Vec<T> = random_vec(rng, a.n_rows() * heads, 2.0);
    let as_: Vec<T> = random_vec(rng, a.n_cols() * heads, 2.0);
    let dad = DeviceMatrix::from_host(gpu, Shape::new(a.n_rows(), heads, 1).unwrap(), &ad).unwrap();
    let das =
        DeviceMatrix::from_host(gpu, Shape::new(a.n_cols(), heads, 1).unwrap(), &as_).unwrap();
    let mut gat = DeviceVec::<f32>::zeros(gpu, edges).unwrap();
    gat.fill_nan().unwrap();
    csr_ops::sddmm_gat(gpu, &dev_a, &dad, &das, &mut gat).unwrap();
    let mut want_gat = vec![0.0f64; edges];
    cpu::sddmm_gat(a, &to_f64(&ad), &to_f64(&as_), heads, &mut want_gat).unwrap();
    let err = rel_l2_error(&gat.to_host().unwrap(), &want_gat);
    assert!(err <= F32_TOL, "sddmm_gat {ctx}: rel error {err:e}");

    // Edge softmax on the GAT scores, with LeakyReLU(0.2), out of place.
    let mut p = DeviceVec::<f32>::zeros(gpu, edges).unwrap();
    p.fill_nan().unwrap();
    csr_ops::edge_softmax(gpu, &dev_a, &gat, heads, Some(0.2), &mut p).unwrap();
    let gat_host: Vec<f64> = gat.to_host().unwrap().iter().map(|&x| x as f64).collect();
    let mut want_p = vec![0.0f64; edges];
    cpu::edge_softmax(a, &gat_host, heads, Some(0.2), &mut want_p).unwrap();
    let err = rel_l2_error(&p.to_host().unwrap(), &want_p);
    assert!(
        err <= F32_TOL,
        "edge_softmax(leaky) {ctx}: rel error {err:e}"
    );

    // Edge softmax in place on the dot scores.
    let dot_host: Vec<f64> = got.iter().map(|&x| x as f64).collect();
    csr_ops::edge_softmax_in_place(gpu, &dev_a, &mut scores, heads, None).unwrap();
    cpu::edge_softmax(a, &dot_host, heads, None, &mut want_p).unwrap();
    let probs = scores.to_host().unwrap();
    let err = rel_l2_error(&probs, &want_p);
    assert!(err <= F32_TOL, "edge_softmax {ctx}: rel error {err:e}");

    // SpMM with those probabilities.
    let v: Vec<T> = random_vec(rng, sk.len(), 1.0);
    let dv = DeviceMatrix::from_host(gpu, sk, &v).unwrap();
    let mut out = DeviceMatrix::<T>::zeros(gpu, sq).unwrap();
    out.fill_nan().unwrap();
    csr_ops::spmm(gpu, &dev_a, &scores, &dv, &mut out).unwrap();
    let probs64: Vec<f64> = probs.iter().map(|&x| x as f64).collect();
    let mut want_o = vec![0.0f64; sq.len()];
    cpu::spmm(a, &probs64, &to_f64(&v), sk, &mut want_o).unwrap();
    let first = out.to_host().unwrap();
    let err = rel_l2_error(&to_f64(&first), &want_o);
    assert!(err <= tolerance::<T>(), "spmm {ctx}: rel error {err:e}");

    // Again: bitwise the same output (split rows' partials are added in a fixed order, and the
    // split-row scratch leaves no state behind).
    out.fill_nan().unwrap();
    csr_ops::spmm(gpu, &dev_a, &scores, &dv, &mut out).unwrap();
    let differ = out
        .to_host()
        .unwrap()
        .iter()
        .zip(&first)
        .filter(|(x, y)| x.to_f32().to_bits() != y.to_f32().to_bits())
        .count();
    assert_eq!(
        differ, 0,
        "spmm (second run) {ctx}: {differ} elements differ"
    );
}

/// [`check_ops`] in every dtype at one case.
fn check_case(gpu: &Gpu, a: &Csr, heads: usize, head_dim: usize, rng: &mut Pcg64) {
    check_ops::<f32>(gpu, a, heads, head_dim, rng);
    check_ops::<f16>(gpu, a, heads, head_dim, rng);
    check_ops::<bf16>(gpu, a, heads, head_dim, rng);
}

gpu_sweep_tests! {
    gpu = gpu();
    check = check_case;
    fn ops_on_cora_pubmed_arxiv = shared_graphs(&[(1, 128), (8, 64), (2, 24)]);
    fn ops_on_rmat_16 = rmat_16(&[(1, 128), (8, 16), (1, 3)]);
    fn every_head_dim_and_head_count = random(300, 6, 7, &grid(&[1, 3, 24, 64, 96, 128, 256], &[1, 2, 8]));
    fn tiny_graphs_and_empty_rows(sweep) {
        sweep.tiny([1, 7, 17, 33], 3, 3, &[(1, 1), (2, 3), (8, 64)]);
        // A graph with no edges at all: SpMM writes zeros everywhere.
        sweep.on(&Csr::empty(9, 9).unwrap(), &[(2, 8)]);
    }
    fn hub_row_of_100k_edges = hub(100_000, 12_345, &[(1, 128), (2, 24)]);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn softmax_extremes() {
    let gpu = gpu();
    let mut rng = fresh_rng("softmax_extremes");
    let a = hub_graph(&mut rng, 5_000, 10);
    let dev_a = DeviceCsr::upload(&gpu, &a).unwrap();
    let heads = 2;
    let edges = a.nnz() * heads;
    let cases = softmax_extreme_scores(&mut rng, edges);
    for (what, s) in cases {
        let ds = DeviceVec::from_host(&gpu, &s).unwrap();
        let mut p = DeviceVec::<f32>::zeros(&gpu, edges).unwrap();
        p.fill_nan().unwrap();
        csr_ops::edge_softmax(&gpu, &dev_a, &ds, heads, None, &mut p).unwrap();
        let s64: Vec<f64> = s.iter().map(|&x| x as f64).collect();
        let mut want = vec![0.0; edges];
        cpu::edge_softmax(&a, &s64, heads, None, &mut want).unwrap();
        let got = p.to_host().unwrap();
        let err = rel_l2_error(&got, &want);
        assert!(err <= F32_TOL, "softmax {what}: rel error {err:e}");
        // Each non-empty row sums to one per head.
        assert_rows_sum_to_one(&a, &got, heads, &format!("softmax {what}"));
    }
    // Masked edges (-inf), whole rows of them (the hub's long row among them): zeros there,
    // as on the CPU, in the short-row and the long-row kernels alike; then a NaN score in
    // two of those rows and in a row with live edges makes each of them NaN, as on the CPU.
    let masked = masked_scores(&mut rng, &a, heads);
    let nan = with_nan_scores(&a, &masked, heads);
    for (what, s) in [("masked", masked), ("masked with NaN", nan)] {
        let ds = DeviceVec::from_host(&gpu, &s).unwrap();
        let mut p = DeviceVec::<f32>::zeros(&gpu, edges).unwrap();
        p.fill_nan().unwrap();
        csr_ops::edge_softmax(&gpu, &dev_a, &ds, heads, None, &mut p).unwrap();
        let got = p.to_host().unwrap();
        assert_masked_softmax(&a, &s, &got, heads, &format!("softmax {what}"));
        let mut want = vec![0.0; edges];
        let s64: Vec<f64> = s.iter().map(|&x| x as f64).collect();
        cpu::edge_softmax(&a, &s64, heads, None, &mut want).unwrap();
        assert_close_with_same_nans(&got, &want, F32_TOL, &format!("softmax {what}"));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn unfused_attention_matches_reference() {
    let gpu = gpu();
    let mut rng = fresh_rng("unfused_attention_matches_reference");
    let a = shared_graph("cora");
    let dev_a = DeviceCsr::upload(&gpu, &a).unwrap();
    let shape = Shape::new(a.n_rows(), 4, 32).unwrap();
    let q: Vec<f16> = random_vec(&mut rng, shape.len(), 1.0);
    let k: Vec<f16> = random_vec(&mut rng, shape.len(), 1.0);
    let v: Vec<f16> = random_vec(&mut rng, shape.len(), 1.0);
    let (dq, dk, dv) = (
        DeviceMatrix::from_host(&gpu, shape, &q).unwrap(),
        DeviceMatrix::from_host(&gpu, shape, &k).unwrap(),
        DeviceMatrix::from_host(&gpu, shape, &v).unwrap(),
    );
    let scale = 1.0 / 32f64.sqrt();
    let mut s = DeviceVec::<f32>::zeros(&gpu, a.nnz() * 4).unwrap();
    let mut out = DeviceMatrix::<f16>::zeros(&gpu, shape).unwrap();
    out.fill_nan().unwrap();
    csr_ops::sddmm(&gpu, &dev_a, &dq, &dk, scale as f32, &mut s).unwrap();
    csr_ops::edge_softmax_in_place(&gpu, &dev_a, &mut s, 4, None).unwrap();
    csr_ops::spmm(&gpu, &dev_a, &s, &dv, &mut out).unwrap();
    let inputs = cpu::AttentionInputs::new(&q, shape, &k, shape, &v, shape);
    let want = cpu::attention_f64_from(&a, &inputs, scale).unwrap();
    let err = rel_l2_error(&to_f64(&out.to_host().unwrap()), &want);
    assert!(err <= 5e-3, "unfused attention f16: rel error {err:e}");
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn shape_errors_are_typed() {
    let gpu = gpu();
    let a = Csr::from_edges(4, 4, &[(0, 1), (1, 2)]).unwrap();
    let dev_a = DeviceCsr::upload(&gpu, &a).unwrap();
    let q = DeviceMatrix::<f32>::zeros(&gpu, Shape::new(4, 1, 8).unwrap()).unwrap();
    let k_bad = DeviceMatrix::<f32>::zeros(&gpu, Shape::new(5, 1, 8).unwrap()).unwrap();
    let mut s = DeviceVec::<f32>::zeros(&gpu, 2).unwrap();
    let e = csr_ops::sddmm(&gpu, &dev_a, &q, &k_bad, 1.0, &mut s).unwrap_err();
    assert!(
        matches!(e, spattn_ops::Error::ShapeMismatch { what: "K", .. }),
        "{e}"
    );
    let mut s_bad = DeviceVec::<f32>::zeros(&gpu, 3).unwrap();
    let e = csr_ops::sddmm(&gpu, &dev_a, &q, &q, 1.0, &mut s_bad).unwrap_err();
    assert!(
        matches!(e, spattn_ops::Error::LengthMismatch { what: "scores", .. }),
        "{e}"
    );
    let mut out_bad = DeviceMatrix::<f32>::zeros(&gpu, Shape::new(3, 1, 8).unwrap()).unwrap();
    let e = csr_ops::spmm(&gpu, &dev_a, &s, &q, &mut out_bad).unwrap_err();
    assert!(
        matches!(e, spattn_ops::Error::ShapeMismatch { what: "out", .. }),
        "{e}"
    );
}

/// The layers' edge attribute rows (`edge_extras::edge_rows`): rows placed at their positions
/// and, with loops, each loop's row reduced from the rest of its row, against the same sums on
/// the host in the same order (bitwise). Input self loops (replaced), rows with no edge but
/// their loop, and a hub row of every node.
fn check_edge_rows<T: DType, O: DType>(gpu: &Gpu, rng: &mut Pcg64) {
    use rand::Rng;
    use spattn_ops::edge_extras::{edge_rows, LoopFill};
    let n = 300u32;
    let mut input: Vec<(u32, u32)> = (0..2000)
        .map(|_| (rng.random_range(0..n - 40), rng.random_range(0..n)))
        .collect();
    input.extend((0..n).map(|j| (0, j))); // row 0: every node (its own loop among them)
    input.sort_unstable();
    input.dedup();
    let width = 5;
    let x: Vec<T> = random_vec(rng, input.len() * width, 1.0);
    for loops in [
        None,
        Some(LoopFill::Mean),
        Some(LoopFill::Sum),
        Some(LoopFill::Value(0.5)),
    ] {
        let mut edges = input.clone();
        if loops.is_some() {
            edges.extend((0..n).map(|i| (i, i)));
            edges.sort_unstable();
            edges.dedup();
        }
        let a = Csr::from_edges(n as usize, n as usize, &edges).unwrap();
        let at = |(r, c): (u32, u32)| {
            let range = a.row_range(r as usize);
            (range.start + a.row(r as usize).binary_search(&c).unwrap()) as i64
        };
        let pos: Vec<i64> = input.iter().map(|&e| at(e)).collect();
        let pos_loop: Vec<i64> = match loops {
            Some(_) => (0..n).map(|i| at((i, i))).collect(),
            None => vec![0; n as usize],
        };
        let mut want = vec![O::from_f64(f64::NAN); a.nnz() * width];
        for (e, &p) in pos.iter().enumerate() {
            for k in 0..width {
                want[p as usize * width + k] = O::from_f64(x[e * width + k].to_f64());
            }
        }
        if let Some(fill) = loops {
            for (i, &p) in pos_loop.iter().enumerate() {
                let p = p as usize;
                for k in 0..width {
                    let mut s = 0.0f32;
                    for q in a.row_range(i) {
                        if q != p {
                            s += want[q * width + k].to_f64() as f32;
                        }
                    }
                    let v = match fill {
                        LoopFill::Mean => s / (a.degree(i) - 1).max(1) as f32,
                        LoopFill::Sum => s,
                        LoopFill::Value(v) => v,
                    };
                    want[p * width + k] = O::from_f64(T::from_f64(f64::from(v)).to_f64());
                }
            }
        }
        let dev_a = DeviceCsr::upload(gpu, &a).unwrap();
        let dx = DeviceVec::from_host(gpu, &x).unwrap();
        let dpos = DeviceVec::from_host(gpu, &pos).unwrap();
        let dloop = DeviceVec::from_host(gpu, &pos_loop).unwrap();
        let mut out = DeviceVec::<O>::zeros(gpu, a.nnz() * width).unwrap();
        out.fill_nan().unwrap();
        let l = loops.map(|f| (&dloop, f));
        edge_rows(gpu, &dev_a, (&dx, width), &dpos, l, &mut out).unwrap();
        let got = out.to_host().unwrap();
        let bits = |v: &[O]| v.iter().map(|x| x.to_f64().to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got),
            bits(&want),
            "edge_rows {} -> {} loops {loops:?}",
            T::NAME,
            O::NAME
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn edge_rows_place_and_fill_bitwise() {
    let gpu = gpu();
    let mut rng = fresh_rng("edge_rows_place_and_fill_bitwise");
    check_edge_rows::<f32, f32>(&gpu, &mut rng);
    check_edge_rows::<f16, f32>(&gpu, &mut rng);
    check_edge_rows::<bf16, f32>(&gpu, &mut rng);
    check_edge_rows::<f16, f16>(&gpu, &mut rng);
    check_edge_rows::<bf16, bf16>(&gpu, &mut rng);
    // Refused: another output type, a zero width, lengths that do not fit.
    use spattn_ops::edge_extras::edge_rows;
    let a = Csr::from_edges(3, 3, &[(0, 1), (1, 2), (2, 0)]).unwrap();
    let dev_a = DeviceCsr::upload(&gpu, &a).unwrap();
    let x = DeviceVec::<f16>::zeros(&gpu, 6).unwrap();
    let pos = DeviceVec::<i64>::zeros(&gpu, 3).unwrap();
    let mut bad = DeviceVec::<bf16>::zeros(&gpu, 6).unwrap();
    assert!(edge_rows(&gpu, &dev_a, (&x, 2), &pos, None, &mut bad).is_err());
    let mut out = DeviceVec::<f32>::zeros(&gpu, 6).unwrap();
    assert!(edge_rows(&gpu, &dev_a, (&x, 0), &pos, None, &mut out).is_err());
    let err = edge_rows(&gpu, &dev_a, (&x, 3), &pos, None, &mut out).unwrap_err();
    assert!(err.to_string().contains("edge attributes"), "{err}");
}
