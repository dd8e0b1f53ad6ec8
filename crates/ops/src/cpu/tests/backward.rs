//! CPU backward of sparse attention: gradients against central finite differences of the f64
//! forward, the f32 backward against the f64 one, and the building blocks on their own.

use rand::Rng;
use rand_pcg::Pcg64;
use spattn_formats::Csr;
use spattn_ops::cpu::{self, rel_l2_error, AttentionInputs};
use spattn_ops::{Error, Shape};
use spattn_test_support::*;

/// The loss `L = Σ out ⊙ w` of the f64 forward.
fn loss(a: &Csr, q: &[f64], k: &[f64], v: &[f64], s: (Shape, Shape), scale: f64, w: &[f64]) -> f64 {
    let inputs = AttentionInputs::new(q, s.0, k, s.1, v, s.1);
    let mut out = vec![0.0; inputs.out_shape().len()];
    cpu::attention(a, &inputs, scale, &mut out).unwrap();
    out.iter().zip(w).map(|(o, w)| o * w).sum()
}

/// Central differences of `loss` in every element of `x` (one of q, k, v, picked by `which`).
#[allow(clippy::too_many_arguments)]
fn finite_differences(
    a: &Csr,
    qkv: [&[f64]; 3],
    which: usize,
    s: (Shape, Shape),
    scale: f64,
    w: &[f64],
) -> Vec<f64> {
    let eps = 1e-5;
    let mut bufs = qkv.map(<[f64]>::to_vec);
    (0..bufs[which].len())
        .map(|i| {
            let x0 = bufs[which][i];
            bufs[which][i] = x0 + eps;
            let up = loss(a, &bufs[0], &bufs[1], &bufs[2], s, scale, w);
            bufs[which][i] = x0 - eps;
            let down = loss(a, &bufs[0], &bufs[1], &bufs[2], s, scale, w);
            bufs[which][i] = x0;
            (up - down) / (2.0 * eps)
        })
        .collect()
}

fn random_f64(rng: &mut Pcg64, len: usize) -> Vec<f64> {
    (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
}

#[test]
fn gradients_match_finite_differences() {
    let mut rng = fresh_rng("gradients_match_finite_differences");
    for (n, heads, head_dim) in [(7, 1, 3), (9, 4, 2), (6, 8, 3), (1, 2, 4), (12, 3, 1)] {
        // Some rows empty (every 4th), rectangular masks too.
        let a = random_graph(&mut rng, n, 2, 4);
        let sq = Shape::new(n, heads, head_dim).unwrap();
        let (q, k, v) = (
            random_f64(&mut rng, sq.len()),
            random_f64(&mut rng, sq.len()),
            random_f64(&mut rng, sq.len()),
        );
        let w = random_f64(&mut rng, sq.len());
        let scale = 0.7;
        let inputs = AttentionInputs::new(&q, sq, &k, sq, &v, sq);
        let g = cpu::attention_backward_f64_from(&a, &inputs, scale, &w).unwrap();
        let s = (sq, sq);
        for (which, got, name) in [(0, &g.dq, "dQ"), (1, &g.dk, "dK"), (2, &g.dv, "dV")] {
            let want = finite_differences(&a, [&q, &k, &v], which, s, scale, &w);
            let err = rel_l2_error(got, &want);
            assert!(
                err <= 1e-7,
                "{name} n={n} heads={heads} d={head_dim}: rel error {err:e}"
            );
        }
        let eps = 1e-6;
        let fd_scale = (loss(&a, &q, &k, &v, s, scale + eps, &w)
            - loss(&a, &q, &k, &v, s, scale - eps, &w))
            / (2.0 * eps);
        assert!(
            (g.d_scale - fd_scale).abs() <= 1e-7 * (1.0 + fd_scale.abs()),
            "d_scale {} vs {fd_scale}",
            g.d_scale
        );
        // Rows without edges have a zero dQ row.
        for r in (0..n).filter(|&r| a.degree(r) == 0) {
            assert!(g.dq[r * sq.row_len()..(r + 1) * sq.row_len()]
                .iter()
                .all(|&x| x == 0.0));
        }
    }
}

#[test]
fn heads_are_independent() {
    // DF-GNN's bug was a missing head offset: perturbing one head's dOut must change only that
    // head's gradients.
    let mut rng = fresh_rng("heads_are_independent");
    let (n, heads, d) = (20, 8, 4);
    let a = random_graph(&mut rng, n, 3, 5);
    let s = Shape::new(n, heads, d).unwrap();
    let (q, k, v, w) = (
        random_f64(&mut rng, s.len()),
        random_f64(&mut rng, s.len()),
        random_f64(&mut rng, s.len()),
        random_f64(&mut rng, s.len()),
    );
    let inputs = AttentionInputs::new(&q, s, &k, s, &v, s);
    let base = cpu::attention_backward_f64_from(&a, &inputs, 0.5, &w).unwrap();
    let mut w2 = w.clone();
    for i in 0..n {
        for x in &mut w2[(i * heads + 5) * d..(i * heads + 6) * d] {
            *x += 1.0;
        }
    }
    let other = cpu::attention_backward_f64_from(&a, &inputs, 0.5, &w2).unwrap();
    for (g0, g1) in [
        (&base.dq, &other.dq),
        (&base.dk, &other.dk),
        (&base.dv, &other.dv),
    ] {
        for i in 0..n {
            for h in 0..heads {
                let span = (i * heads + h) * d..(i * heads + h + 1) * d;
                if h != 5 {
                    assert_eq!(g0[span.clone()], g1[span], "head {h} changed");
                }
            }
        }
        assert_ne!(g0, g1);
    }
}

#[test]
fn f32_backward_matches_f64() {
    let mut rng = fresh_rng("f32_backward_matches_f64");
    let a = hub_graph(&mut rng, 3000, 17);
    for (heads, d) in [(1, 16), (4, 7), (8, 3)] {
        let s = Shape::new(a.n_rows(), heads, d).unwrap();
        let q: Vec<f32> = random_vec(&mut rng, s.len(), 1.0);
        let k: Vec<f32> = random_vec(&mut rng, s.len(), 1.0);
        let v: Vec<f32> = random_vec(&mut rng, s.len(), 1.0);
        let w: Vec<f32> = random_vec(&mut rng, s.len(), 1.0);
        let inputs = AttentionInputs::new(&q, s, &k, s, &v, s);
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = vec![0.0f32; s.len()];
        cpu::attention(&a, &inputs, scale, &mut out).unwrap();
        let g = cpu::attention_backward(&a, &inputs, scale, &out, &w).unwrap();
        let r = cpu::attention_backward_f64_from(&a, &inputs, f64::from(scale), &w).unwrap();
        for (got, want, name) in [
            (&g.dq, &r.dq, "dQ"),
            (&g.dk, &r.dk, "dK"),
            (&g.dv, &r.dv, "dV"),
        ] {
            let err = rel_l2_error(got, want);
            assert!(err <= 1e-5, "{name} heads={heads} d={d}: {err:e}");
        }
        // d_scale = Σ_i q_i · dQ_i / scale, a sum whose terms cancel (the flaky seed
        // 1795649195199921225 left it at 0.058 of terms summing to far more): its error is
        // measured against the magnitude of its terms, not against itself.
        let terms: f64 = q
            .iter()
            .zip(&r.dq)
            .map(|(&x, &y)| (f64::from(x) * y).abs())
            .sum::<f64>()
            / f64::from(scale);
        let identity = q
            .iter()
            .zip(&r.dq)
            .map(|(&x, &y)| f64::from(x) * y)
            .sum::<f64>()
            / f64::from(scale);
        assert!(
            (identity - r.d_scale).abs() <= 1e-9 * terms,
            "d_scale {} is not Σ q·dQ / scale = {identity}",
            r.d_scale
        );
        let err = (f64::from(g.d_scale) - r.d_scale).abs() / terms.max(r.d_scale.abs()).max(1e-30);
        assert!(
            err <= 1e-5,
            "d_scale {} vs {} (terms' magnitude {terms}): {err:e}",
            g.d_scale,
            r.d_scale
        );
    }
}

#[test]
fn building_blocks() {
    let a = Csr::from_edges(4, 3, &[(0, 0), (0, 2), (1, 1), (3, 0), (3, 1), (3, 2)]).unwrap();
    let heads = 2;
    let p = [0.25, 0.5, 0.75, 0.5, 1.0, 1.0, 0.2, 0.1, 0.3, 0.2, 0.5, 0.7];
    let dp = [1.0, 2.0, -1.0, 0.0, 3.0, 4.0, 1.0, 1.0, 2.0, 0.0, 3.0, -1.0];
    let mut ds = [f64::NAN; 12];
    cpu::edge_softmax_backward(&a, &p, &dp, heads, &mut ds).unwrap();
    // Row 0, head 0: D = 0.25·1 + 0.75·(−1) = −0.5.
    assert_eq!(ds[0], 0.25 * 1.5);
    assert_eq!(ds[2], 0.75 * -0.5);
    // Row 1 (one edge, probability 1): dS = 0.
    assert_eq!(ds[4], 0.0);
    let (at, from_a) = a.transpose_with_map();
    let mut t = [0.0; 12];
    cpu::transpose_edge_values(&from_a, &p, heads, &mut t).unwrap();
    // Aᵀ row 0 lists A's edges (0,0) then (3,0).
    assert_eq!(t[..4], [0.25, 0.5, 0.2, 0.1]);
    let mut sums = [f64::NAN; 6];
    cpu::edge_row_sum(&at, &t, heads, &mut sums).unwrap();
    let want = [0.45, 0.6, 1.3, 1.2, 1.25, 1.2];
    assert!(
        sums.iter().zip(want).all(|(s, w)| (s - w).abs() < 1e-12),
        "{sums:?}"
    );
    let mut rows = [f64::NAN; 8];
    cpu::edge_row_sum(&a, &p, heads, &mut rows).unwrap();
    assert_eq!(rows[4..6], [0.0, 0.0]); // row 2: no edges
                                        // Errors name the operand.
    let e = cpu::edge_softmax_backward(&a, &p, &dp[1..], heads, &mut ds).unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { what: "dp", .. }), "{e}");
    let e = cpu::transpose_edge_values(&[0, 9, 1], &p[..6], heads, &mut t[..6]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let e = cpu::edge_row_sum(&a, &p, heads, &mut rows[1..]).unwrap_err();
    assert!(
        matches!(e, Error::LengthMismatch { what: "out", .. }),
        "{e}"
    );
    let s = Shape::new(4, 1, 2).unwrap();
    let sk = Shape::new(3, 1, 2).unwrap();
    let x = [0.0f64; 8];
    let y = [0.0f64; 6];
    let inputs = AttentionInputs::new(&x, s, &y, sk, &y, sk);
    let e = cpu::attention_backward(&a, &inputs, 1.0, &x, &x[1..]).unwrap_err();
    assert!(
        matches!(e, Error::LengthMismatch { what: "d_out", .. }),
        "{e}"
    );
    let g = cpu::attention_backward(&a, &inputs, 1.0, &x, &x).unwrap();
    assert_eq!((g.dq.len(), g.dk.len(), g.dv.len()), (8, 6, 6));
}
