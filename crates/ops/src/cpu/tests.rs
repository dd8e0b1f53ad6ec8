//! The CPU ops against naive dense references written here, independently of the library:
//! random graphs (empty rows, rectangular masks, hub rows), every error path, softmax
//! properties, and a property test of attention's convexity.

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use spattn_formats::Csr;
use spattn_ops::cpu::{self, AttentionInputs, Real};
use spattn_ops::{Error, Shape};

// ---------------------------------------------------------------------------------------------
// Problems: a random mask, kept both as a Csr and as a dense boolean matrix.
// ---------------------------------------------------------------------------------------------

/// A mask as the library sees it (`csr`) and as the references see it (`mask`, dense,
/// row-major), plus the edges in CSR order derived from the dense mask alone.
struct Problem {
    n_rows: usize,
    n_cols: usize,
    mask: Vec<bool>,
    csr: Csr,
    /// `(row, col)` of each edge in row-major order of the dense mask: by definition the CSR
    /// order (sorted columns, no duplicates).
    edges: Vec<(usize, usize)>,
}

impl Problem {
    fn from_edges(n_rows: usize, n_cols: usize, edges: &[(u32, u32)]) -> Self {
        let mut mask = vec![false; n_rows * n_cols];
        for &(r, c) in edges {
            mask[r as usize * n_cols + c as usize] = true;
        }
        let csr = Csr::from_edges(n_rows, n_cols, edges).unwrap();
        let mut ordered = Vec::new();
        for i in 0..n_rows {
            for j in 0..n_cols {
                if mask[i * n_cols + j] {
                    ordered.push((i, j));
                }
            }
        }
        assert_eq!(csr.nnz(), ordered.len());
        Self {
            n_rows,
            n_cols,
            mask,
            csr,
            edges: ordered,
        }
    }

    /// Each row empty with probability 1/4 (row 0 never, so no graph is trivially empty),
    /// otherwise each column present with probability `density`.
    fn random(rng: &mut Pcg64, n_rows: usize, n_cols: usize, density: f64) -> Self {
        let mut edges = Vec::new();
        for i in 0..n_rows {
            if i > 0 && rng.random_bool(0.25) {
                continue;
            }
            for j in 0..n_cols {
                if rng.random_bool(density) {
                    edges.push((i as u32, j as u32));
                }
            }
        }
        // Shuffle, with a few duplicates, to exercise Csr::from_edges.
        for _ in 0..edges.len() / 4 {
            let e = edges[rng.random_range(0..edges.len())];
            edges.push(e);
        }
        for x in (1..edges.len()).rev() {
            edges.swap(x, rng.random_range(0..=x));
        }
        Self::from_edges(n_rows, n_cols, &edges)
    }

    fn nnz(&self) -> usize {
        self.edges.len()
    }

    fn has(&self, i: usize, j: usize) -> bool {
        self.mask[i * self.n_cols + j]
    }

    /// Edge index of every mask entry (usize::MAX where there is none).
    fn edge_index(&self) -> Vec<usize> {
        let mut idx = vec![usize::MAX; self.n_rows * self.n_cols];
        for (e, &(i, j)) in self.edges.iter().enumerate() {
            idx[i * self.n_cols + j] = e;
        }
        idx
    }
}

fn random_vec<F: Real>(rng: &mut Pcg64, len: usize, lo: f64, hi: f64) -> Vec<F> {
    (0..len)
        .map(|_| F::from_f64(rng.random_range(lo..hi)))
        .collect()
}

fn to_f64<F: Real>(x: &[F]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

fn shape(rows: usize, heads: usize, head_dim: usize) -> Shape {
    Shape::new(rows, heads, head_dim).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Dense f64 references: plain loops over the dense mask, max-subtracted softmax.
// ---------------------------------------------------------------------------------------------

fn ref_sddmm(p: &Problem, q: &[f64], k: &[f64], heads: usize, d: usize, scale: f64) -> Vec<f64> {
    let mut s = vec![f64::NAN; p.n_rows * p.n_cols * heads];
    for i in 0..p.n_rows {
        for j in 0..p.n_cols {
            if !p.has(i, j) {
                continue;
            }
            for h in 0..heads {
                let mut acc = 0.0;
                for x in 0..d {
                    acc += q[(i * heads + h) * d + x] * k[(j * heads + h) * d + x];
                }
                s[(i * p.n_cols + j) * heads + h] = scale * acc;
            }
        }
    }
    gather_edges(p, &s, heads)
}

fn ref_sddmm_gat(p: &Problem, a_dst: &[f64], a_src: &[f64], heads: usize) -> Vec<f64> {
    let mut s = vec![f64::NAN; p.n_rows * p.n_cols * heads];
    for i in 0..p.n_rows {
        for j in 0..p.n_cols {
            if p.has(i, j) {
                for h in 0..heads {
                    s[(i * p.n_cols + j) * heads + h] = a_dst[i * heads + h] + a_src[j * heads + h];
                }
            }
        }
    }
    gather_edges(p, &s, heads)
}

/// Dense `n_rows × n_cols × heads` values → edge-major in mask order.
fn gather_edges(p: &Problem, dense: &[f64], heads: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(p.nnz() * heads);
    for i in 0..p.n_rows {
        for j in 0..p.n_cols {
            if p.has(i, j) {
                out.extend_from_slice(&dense[(i * p.n_cols + j) * heads..][..heads]);
            }
        }
    }
    out
}

/// Edge-major values → dense `n_rows × n_cols × heads` (0 where no edge).
fn scatter_edges(p: &Problem, edge_vals: &[f64], heads: usize) -> Vec<f64> {
    let idx = p.edge_index();
    let mut dense = vec![0.0; p.n_rows * p.n_cols * heads];
    for c in 0..p.n_rows * p.n_cols {
        if idx[c] != usize::MAX {
            dense[c * heads..(c + 1) * heads]
                .copy_from_slice(&edge_vals[idx[c] * heads..(idx[c] + 1) * heads]);
        }
    }
    dense
}

fn ref_softmax(p: &Problem, scores: &[f64], heads: usize, slope: Option<f64>) -> Vec<f64> {
    let s = scatter_edges(p, scores, heads);
    let mut out = vec![0.0; s.len()];
    for i in 0..p.n_rows {
        for h in 0..heads {
            let act = |j: usize| {
                let x = s[(i * p.n_cols + j) * heads + h];
                match slope {
                    Some(a) if x < 0.0 => a * x,
                    _ => x,
                }
            };
            let cols: Vec<usize> = (0..p.n_cols).filter(|&j| p.has(i, j)).collect();
            let m = cols
                .iter()
                .map(|&j| act(j))
                .fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = cols.iter().map(|&j| (act(j) - m).exp()).sum();
            for &j in &cols {
                out[(i * p.n_cols + j) * heads + h] = (act(j) - m).exp() / sum;
            }
        }
    }
    gather_edges(p, &out, heads)
}

fn ref_spmm(p: &Problem, w: &[f64], v: &[f64], heads: usize, d: usize) -> Vec<f64> {
    let w = scatter_edges(p, w, heads);
    let mut out = vec![0.0; p.n_rows * heads * d];
    for i in 0..p.n_rows {
        for j in 0..p.n_cols {
            if !p.has(i, j) {
                continue;
            }
            for h in 0..heads {
                let wij = w[(i * p.n_cols + j) * heads + h];
                for x in 0..d {
                    out[(i * heads + h) * d + x] += wij * v[(j * heads + h) * d + x];
                }
            }
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn ref_attention(
    p: &Problem,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    heads: usize,
    d: usize,
    dv: usize,
    scale: f64,
) -> Vec<f64> {
    let s = ref_sddmm(p, q, k, heads, d, scale);
    let pr = ref_softmax(p, &s, heads, None);
    ref_spmm(p, &pr, v, heads, dv)
}

// ---------------------------------------------------------------------------------------------
// Each op against its reference, over the whole grid of sizes.
// ---------------------------------------------------------------------------------------------

const NS: [usize; 4] = [1, 7, 17, 33];
const HEADS: [usize; 3] = [1, 2, 8];
const HEAD_DIMS: [usize; 4] = [1, 3, 24, 64];

/// Square and rectangular `(n_rows, n_cols)` for each n.
fn mask_dims(n: usize) -> [(usize, usize); 3] {
    [(n, n), (n, 2 * n + 1), (n + 4, n)]
}

fn assert_close(what: &str, out: &[f64], reference: &[f64], tol: f64) {
    let err = cpu::rel_l2_error(out, reference);
    assert!(err <= tol, "{what}: rel L2 error {err:e} > {tol:e}");
}

fn check_ops_on_grid<F: Real>(seed: u64, tol: f64) {
    let mut rng = Pcg64::seed_from_u64(seed);
    for n in NS {
        for (n_rows, n_cols) in mask_dims(n) {
            let p = Problem::random(&mut rng, n_rows, n_cols, 0.3);
            for heads in HEADS {
                // Per-edge ops do not depend on head_dim.
                check_edge_ops::<F>(&mut rng, &p, heads, tol);
                for d in HEAD_DIMS {
                    check_dense_ops::<F>(&mut rng, &p, heads, d, tol);
                }
            }
        }
    }
}

fn check_edge_ops<F: Real>(rng: &mut Pcg64, p: &Problem, heads: usize, tol: f64) {
    let ctx = format!(
        "{}x{} nnz {} heads {heads} {}",
        p.n_rows,
        p.n_cols,
        p.nnz(),
        F::NAME
    );
    let a = &p.csr;
    // GAT scores.
    let a_dst: Vec<F> = random_vec(rng, p.n_rows * heads, -2.0, 2.0);
    let a_src: Vec<F> = random_vec(rng, p.n_cols * heads, -2.0, 2.0);
    let mut s = vec![F::from_f64(f64::NAN); p.nnz() * heads];
    cpu::sddmm_gat(a, &a_dst, &a_src, heads, &mut s).unwrap();
    let s_ref = ref_sddmm_gat(p, &to_f64(&a_dst), &to_f64(&a_src), heads);
    assert_close(&format!("sddmm_gat {ctx}"), &to_f64(&s), &s_ref, tol);

    // Softmax, plain and with LeakyReLU, out of place and in place.
    let scores: Vec<F> = random_vec(rng, p.nnz() * heads, -6.0, 6.0);
    for slope in [None, Some(0.2), Some(0.0)] {
        let ref_p = ref_softmax(p, &to_f64(&scores), heads, slope);
        let slope_f = slope.map(F::from_f64);
        let mut out = vec![F::from_f64(f64::NAN); scores.len()];
        cpu::edge_softmax(a, &scores, heads, slope_f, &mut out).unwrap();
        assert_close(
            &format!("edge_softmax {slope:?} {ctx}"),
            &to_f64(&out),
            &ref_p,
            tol,
        );
        let mut inplace = scores.clone();
        cpu::edge_softmax_in_place(a, &mut inplace, heads, slope_f).unwrap();
        assert_eq!(to_f64(&inplace), to_f64(&out), "in place differs: {ctx}");
    }
}

fn check_dense_ops<F: Real>(rng: &mut Pcg64, p: &Problem, heads: usize, d: usize, tol: f64) {
    let ctx = format!(
        "{}x{} nnz {} heads {heads} head_dim {d} {}",
        p.n_rows,
        p.n_cols,
        p.nnz(),
        F::NAME
    );
    let a = &p.csr;
    let (sq, sk) = (shape(p.n_rows, heads, d), shape(p.n_cols, heads, d));
    let q: Vec<F> = random_vec(rng, sq.len(), -1.0, 1.0);
    let k: Vec<F> = random_vec(rng, sk.len(), -1.0, 1.0);
    let scale = F::from_f64(rng.random_range(0.5..2.0) / (d as f64).sqrt());
    let (q64, k64) = (to_f64(&q), to_f64(&k));

    // SDDMM.
    let mut s = vec![F::from_f64(f64::NAN); p.nnz() * heads];
    cpu::sddmm(a, &q, &k, sq, sk, scale, &mut s).unwrap();
    let s_ref = ref_sddmm(p, &q64, &k64, heads, d, scale.to_f64());
    assert_close(&format!("sddmm {ctx}"), &to_f64(&s), &s_ref, tol);

    // SpMM with per-edge-and-head weights; V with a different head_dim than Q/K.
    let dv = if d == 1 { 5 } else { d };
    let sv = shape(p.n_cols, heads, dv);
    let v: Vec<F> = random_vec(rng, sv.len(), -1.0, 1.0);
    let v64 = to_f64(&v);
    let w: Vec<F> = random_vec(rng, p.nnz() * heads, -1.0, 1.0);
    let mut out = vec![F::from_f64(f64::NAN); p.n_rows * heads * dv];
    cpu::spmm(a, &w, &v, sv, &mut out).unwrap();
    let o_ref = ref_spmm(p, &to_f64(&w), &v64, heads, dv);
    assert_close(&format!("spmm {ctx}"), &to_f64(&out), &o_ref, tol);

    // Attention, and its f64 reference from the same data.
    let inputs = AttentionInputs::new(&q, sq, &k, sk, &v, sv);
    assert_eq!(inputs.out_shape(), shape(p.n_rows, heads, dv));
    let mut att = vec![F::from_f64(f64::NAN); p.n_rows * heads * dv];
    cpu::attention(a, &inputs, scale, &mut att).unwrap();
    let att_ref = ref_attention(p, &q64, &k64, &v64, heads, d, dv, scale.to_f64());
    assert_close(&format!("attention {ctx}"), &to_f64(&att), &att_ref, tol);
    let att64 = cpu::attention_f64_from(a, &inputs, scale.to_f64()).unwrap();
    assert_close(
        &format!("attention_f64_from {ctx}"),
        &att64,
        &att_ref,
        1e-12,
    );

    // Rows without edges output exact zeros.
    for i in 0..p.n_rows {
        if a.degree(i) == 0 {
            let row = i * heads * dv..(i + 1) * heads * dv;
            assert!(
                att[row.clone()].iter().all(|&x| x == F::ZERO),
                "{ctx} row {i}"
            );
            assert!(out[row].iter().all(|&x| x == F::ZERO), "{ctx} row {i}");
        }
    }
}

#[test]
fn ops_match_dense_reference_f64() {
    check_ops_on_grid::<f64>(1, 1e-12);
}

#[test]
fn ops_match_dense_reference_f32() {
    check_ops_on_grid::<f32>(2, 1e-5);
}

#[test]
fn ops_on_many_rows_split_across_threads() {
    // Enough work (edges + rows ≫ the sequential grain) that rows are split into parallel
    // blocks: long runs of empty rows, a hub row in the middle, and a rectangular mask.
    let mut rng = Pcg64::seed_from_u64(3);
    let (n_rows, n_cols) = (6000, 150);
    let mut edges = Vec::new();
    for i in 0..n_rows as u32 {
        let empty_run = (1000..2500).contains(&i) || i % 7 == 3;
        if empty_run {
            continue;
        }
        let deg = if i == 3000 {
            n_cols
        } else {
            rng.random_range(0..8)
        };
        for _ in 0..deg {
            edges.push((i, rng.random_range(0..n_cols as u32)));
        }
    }
    for c in 0..n_cols as u32 {
        edges.push((3000, c));
    }
    let p = Problem::from_edges(n_rows, n_cols, &edges);
    for (heads, d) in [(1, 3), (2, 24)] {
        check_edge_ops::<f64>(&mut rng, &p, heads, 1e-12);
        check_dense_ops::<f64>(&mut rng, &p, heads, d, 1e-12);
        check_edge_ops::<f32>(&mut rng, &p, heads, 1e-5);
        check_dense_ops::<f32>(&mut rng, &p, heads, d, 1e-5);
    }
}

#[test]
fn empty_and_edgeless_masks() {
    // No rows at all, and rows with no edges: nothing to compute, no error, zeros out.
    for (n_rows, n_cols) in [(0, 0), (0, 3), (3, 0), (4, 4)] {
        let a = Csr::empty(n_rows, n_cols).unwrap();
        let (sq, sk) = (shape(n_rows, 2, 3), shape(n_cols, 2, 3));
        let q = vec![1.0f64; sq.len()];
        let k = vec![1.0f64; sk.len()];
        let mut s: Vec<f64> = Vec::new();
        cpu::sddmm(&a, &q, &k, sq, sk, 1.0, &mut s).unwrap();
        cpu::edge_softmax_in_place(&a, &mut s, 2, None).unwrap();
        let mut out = vec![f64::NAN; sq.len()];
        cpu::spmm(&a, &s, &k, sk, &mut out).unwrap();
        assert!(out.iter().all(|&x| x == 0.0));
        let inputs = AttentionInputs::new(&q, sq, &k, sk, &k, sk);
        let mut att = vec![f64::NAN; sq.len()];
        cpu::attention(&a, &inputs, 1.0, &mut att).unwrap();
        assert!(att.iter().all(|&x| x == 0.0));
        assert_eq!(cpu::attention_f64_from(&a, &inputs, 1.0).unwrap(), att);
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax properties.
// ---------------------------------------------------------------------------------------------

fn row_sums(a: &Csr, probs: &[f64], heads: usize) -> Vec<Vec<f64>> {
    (0..a.n_rows())
        .map(|i| {
            (0..heads)
                .map(|h| a.row_range(i).map(|e| probs[e * heads + h]).sum())
                .collect()
        })
        .collect()
}

fn softmax_props<F: Real>(seed: u64, tol: f64) {
    let mut rng = Pcg64::seed_from_u64(seed);
    for (n_rows, n_cols) in [(17, 17), (9, 40), (33, 5)] {
        let p = Problem::random(&mut rng, n_rows, n_cols, 0.4);
        let a = &p.csr;
        for heads in HEADS {
            let len = a.nnz() * heads;
            let scores: Vec<F> = random_vec(&mut rng, len, -10.0, 10.0);
            let mut probs = scores.clone();
            cpu::edge_softmax_in_place(a, &mut probs, heads, None).unwrap();
            let probs64 = to_f64(&probs);

            // Non-negative, and each non-empty row sums to 1 per head.
            assert!(probs64.iter().all(|&x| (0.0..=1.0).contains(&x)));
            for (i, sums) in row_sums(a, &probs64, heads).iter().enumerate() {
                for &s in sums {
                    let want = if a.degree(i) == 0 { 0.0 } else { 1.0 };
                    assert!((s - want).abs() <= tol, "row {i}: sum {s}");
                }
            }

            // Invariant to a constant added per row and head.
            let shifts: Vec<f64> = (0..n_rows * heads)
                .map(|_| rng.random_range(-100.0..100.0))
                .collect();
            let mut shifted = scores.clone();
            for i in 0..n_rows {
                for e in a.row_range(i) {
                    for h in 0..heads {
                        let x = &mut shifted[e * heads + h];
                        *x = F::from_f64(x.to_f64() + shifts[i * heads + h]);
                    }
                }
            }
            // The shifted scores are rounded to F: compare with the reference of the same
            // shifted (rounded) scores, and with the unshifted probabilities loosely (the
            // rounding of x + c moves each score by up to ulp(100)).
            let mut sp = shifted.clone();
            cpu::edge_softmax_in_place(a, &mut sp, heads, None).unwrap();
            let sp_ref = ref_softmax(&p, &to_f64(&shifted), heads, None);
            assert_close("shifted softmax", &to_f64(&sp), &sp_ref, tol);
            let shift_tol = if F::NAME == "f64" { 1e-12 } else { 2e-4 };
            assert_close("shift invariance", &to_f64(&sp), &probs64, shift_tol);

            // Scores near ±1e4: no NaN or inf, rows still sum to 1, match the reference.
            for centre in [1e4, -1e4] {
                let big: Vec<F> = scores
                    .iter()
                    .map(|x| F::from_f64(centre + x.to_f64()))
                    .collect();
                let mut bp = big.clone();
                cpu::edge_softmax_in_place(a, &mut bp, heads, None).unwrap();
                let bp64 = to_f64(&bp);
                assert!(bp64.iter().all(|x| x.is_finite()));
                let ref_big = ref_softmax(&p, &to_f64(&big), heads, None);
                assert_close("softmax near ±1e4", &bp64, &ref_big, tol);
            }
            // Extreme spread within a row: +1e4 wins everything, −1e4 gets exactly 0.
            let spread: Vec<F> = (0..len)
                .map(|x| F::from_f64(if x % 3 == 0 { 1e4 } else { -1e4 }))
                .collect();
            let mut sp2 = spread.clone();
            cpu::edge_softmax_in_place(a, &mut sp2, heads, None).unwrap();
            assert!(sp2.iter().all(|x| x.is_finite()));
            let sp2_ref = ref_softmax(&p, &to_f64(&spread), heads, None);
            assert_close("softmax spread ±1e4", &to_f64(&sp2), &sp2_ref, tol);

            // All-equal scores: uniform 1/degree.
            let equal = vec![F::from_f64(3.25); len];
            let mut up = equal.clone();
            cpu::edge_softmax_in_place(a, &mut up, heads, None).unwrap();
            for i in 0..n_rows {
                for e in a.row_range(i) {
                    for h in 0..heads {
                        let want = 1.0 / a.degree(i) as f64;
                        let got = up[e * heads + h].to_f64();
                        assert!((got - want).abs() <= tol * want, "uniform {got} vs {want}");
                    }
                }
            }

            // LeakyReLU is applied before the softmax: with slope 0 every negative score is
            // 0; with slope 0.2 results match the reference and differ from no slope.
            let mut l0 = scores.clone();
            cpu::edge_softmax_in_place(a, &mut l0, heads, Some(F::ZERO)).unwrap();
            let clamped: Vec<F> = scores
                .iter()
                .map(|&x| if x < F::ZERO { F::ZERO } else { x })
                .collect();
            let mut c0 = clamped.clone();
            cpu::edge_softmax_in_place(a, &mut c0, heads, None).unwrap();
            assert_eq!(to_f64(&l0), to_f64(&c0));
            let mut l2 = scores.clone();
            cpu::edge_softmax_in_place(a, &mut l2, heads, Some(F::from_f64(0.2))).unwrap();
            let l2_ref = ref_softmax(&p, &to_f64(&scores), heads, Some(0.2));
            assert_close("leaky relu", &to_f64(&l2), &l2_ref, tol);
        }
    }
}

#[test]
fn softmax_properties_f64() {
    softmax_props::<f64>(10, 1e-12);
}

#[test]
fn softmax_properties_f32() {
    softmax_props::<f32>(11, 1e-5);
}

#[test]
fn leaky_relu_by_hand() {
    // One row of two edges, two heads: scores (−1, 2) and (−2, −4).
    let a = Csr::from_edges(1, 2, &[(0, 0), (0, 1)]).unwrap();
    let s = [-1.0f64, -2.0, 2.0, -4.0];
    let mut p = [0.0; 4];
    cpu::edge_softmax(&a, &s, 2, Some(0.2), &mut p).unwrap();
    let sm = |x: f64, y: f64| (x.exp() / (x.exp() + y.exp()), y.exp() / (x.exp() + y.exp()));
    let (p00, p10) = sm(-0.2, 2.0);
    let (p01, p11) = sm(-0.4, -0.8);
    let want = [p00, p01, p10, p11];
    assert!(cpu::rel_l2_error(&p, &want) < 1e-15, "{p:?} vs {want:?}");
    let mut plain = [0.0; 4];
    cpu::edge_softmax(&a, &s, 2, None, &mut plain).unwrap();
    assert!(cpu::rel_l2_error(&plain, &want) > 1e-2);
}

#[test]
fn softmax_masked_and_nan_scores() {
    // Row 0: {0, 1, 2}; row 1: {1}; row 2: none; row 3: {0, 2}; row 4: {0, 1}.
    let edges = [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 1),
        (3, 0),
        (3, 2),
        (4, 0),
        (4, 1),
    ];
    let a = Csr::from_edges(5, 3, &edges).unwrap();
    let inf = f64::INFINITY;
    // One head. −∞ is a masked edge: probability 0, the rest renormalized; a row whose
    // scores are all −∞ gets zeros; a NaN score makes its row NaN, beside a finite score or
    // beside only masked ones (as the GPU kernels do).
    let mut s = vec![0.0, -inf, 0.0, -inf, f64::NAN, 1.0, -inf, f64::NAN];
    cpu::edge_softmax_in_place(&a, &mut s, 1, None).unwrap();
    assert_eq!(&s[..4], &[0.5, 0.0, 0.5, 0.0]);
    assert!(s[4..].iter().all(|x| x.is_nan()), "{s:?}");
    assert_eq!(
        cpu::rel_l2_error(&s[..6], &[0.5, 0.0, 0.5, 0.0, 0.5, 0.5]),
        inf
    );
    // The GPU tests' masked scores and their NaN twin on a hub graph, row by row.
    let mut rng = Pcg64::seed_from_u64(9);
    let hub = spattn_test_support::hub_graph(&mut rng, 500, 3);
    let masked = spattn_test_support::masked_scores(&mut rng, &hub, 2);
    let nan = spattn_test_support::with_nan_scores(&hub, &masked, 2);
    assert_eq!(nan.iter().filter(|x| x.is_nan()).count(), 3);
    for s in [masked, nan] {
        let mut p = vec![0.0f32; s.len()];
        cpu::edge_softmax(&hub, &s, 2, None, &mut p).unwrap();
        spattn_test_support::assert_masked_softmax(&hub, &s, &p, 2, "cpu");
    }
}

// ---------------------------------------------------------------------------------------------
// A hub row of 10^5 edges.
// ---------------------------------------------------------------------------------------------

#[test]
fn hub_row_of_1e5_edges() {
    let n_cols = 100_000;
    let mut edges: Vec<(u32, u32)> = (0..n_cols as u32).map(|c| (0, c)).collect();
    edges.extend([(2, 5), (2, 99_999), (3, 0)]); // row 1 empty
    let p = Problem::from_edges(4, n_cols, &edges);
    let a = &p.csr;
    let (heads, d) = (2, 16);
    let mut rng = Pcg64::seed_from_u64(4);
    let (sq, sk) = (shape(4, heads, d), shape(n_cols, heads, d));
    // Mean-shifted V, so the output is not a cancellation of tiny terms.
    let q: Vec<f32> = random_vec(&mut rng, sq.len(), -1.0, 1.0);
    let k: Vec<f32> = random_vec(&mut rng, sk.len(), -1.0, 1.0);
    let v: Vec<f32> = random_vec(&mut rng, sk.len(), -1.0, 1.5);
    let scale = 2.0 / (d as f32).sqrt();
    let inputs = AttentionInputs::new(&q, sq, &k, sk, &v, sk);

    let reference = ref_attention(
        &p,
        &to_f64(&q),
        &to_f64(&k),
        &to_f64(&v),
        heads,
        d,
        d,
        f64::from(scale),
    );
    let out64 = cpu::attention_f64_from(a, &inputs, f64::from(scale)).unwrap();
    assert_close("hub f64", &out64, &reference, 1e-12);
    let mut out32 = vec![f32::NAN; sq.len()];
    cpu::attention(a, &inputs, scale, &mut out32).unwrap();
    assert_close("hub f32 vs f64", &to_f64(&out32), &out64, 1e-5);

    // The steps too: probabilities of 1e-5 each, summed over 1e5 edges.
    let mut s32 = vec![0.0f32; a.nnz() * heads];
    cpu::sddmm(a, &q, &k, sq, sk, scale, &mut s32).unwrap();
    let mut s64 = vec![0.0f64; a.nnz() * heads];
    let (q64, k64) = (
        cpu::error_metric::upcast_f64(&q),
        cpu::error_metric::upcast_f64(&k),
    );
    cpu::sddmm(a, &q64, &k64, sq, sk, f64::from(scale), &mut s64).unwrap();
    assert_close("hub sddmm", &to_f64(&s32), &s64, 1e-6);
    // Softmax of the same (f32) scores in both types.
    let mut p32 = s32.clone();
    cpu::edge_softmax_in_place(a, &mut p32, heads, None).unwrap();
    let mut p64 = to_f64(&s32);
    cpu::edge_softmax_in_place(a, &mut p64, heads, None).unwrap();
    assert_close("hub softmax", &to_f64(&p32), &p64, 1e-5);
    let sums = row_sums(a, &to_f64(&p32), heads);
    assert!(sums[0].iter().all(|s| (s - 1.0).abs() < 1e-6), "{sums:?}");
    let v64 = cpu::error_metric::upcast_f64(&v);
    let mut o32 = vec![0.0f32; sq.len()];
    cpu::spmm(a, &p32, &v, sk, &mut o32).unwrap();
    let mut o64 = vec![0.0f64; sq.len()];
    cpu::spmm(a, &to_f64(&p32), &v64, sk, &mut o64).unwrap();
    assert_close("hub spmm", &to_f64(&o32), &o64, 1e-6);
}

mod backward;
mod errors;
