//! The CPU reference of attention with a score bias, edge features, dropout and the weights
//! out: against plain attention, against finite differences of its own forward, masking with
//! −∞, the dropout mask's semantics, and the errors.

use rand::{Rng, SeedableRng};
use rand_pcg::Pcg64;
use spattn_formats::Csr;
use spattn_ops::cpu::{
    attention, attention_extras, attention_extras_backward, AttentionInputs, EdgeBias, Extras,
};
use spattn_ops::{Dropout, Error, Shape};

/// A small graph with an empty row, a hub row and a self loop, rectangular when `cols > rows`.
fn graph(rows: usize, cols: usize, rng: &mut Pcg64) -> Csr {
    let mut edges = vec![(0u32, 0u32)];
    for c in 0..cols as u32 {
        edges.push((1, c)); // the hub
    }
    for r in 2..rows as u32 - 1 {
        for _ in 0..3 {
            edges.push((r, rng.random_range(0..cols as u32)));
        }
    }
    // Row rows - 1 stays empty.
    Csr::from_edges(rows, cols, &edges).unwrap()
}

fn random(rng: &mut Pcg64, len: usize) -> Vec<f64> {
    (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
}

struct Case {
    a: Csr,
    heads: usize,
    head_dim: usize,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    bias: Vec<f64>,
    feats: Vec<f64>,
    g: Vec<f64>,
}

impl Case {
    fn new(seed: u64, heads: usize, head_dim: usize, shared_bias: bool) -> Self {
        let mut rng = Pcg64::seed_from_u64(seed);
        let a = graph(7, 9, &mut rng);
        let (sq, sk) = (
            Shape::new(a.n_rows(), heads, head_dim).unwrap(),
            Shape::new(a.n_cols(), heads, head_dim).unwrap(),
        );
        Self {
            q: random(&mut rng, sq.len()),
            k: random(&mut rng, sk.len()),
            v: random(&mut rng, sk.len()),
            bias: random(&mut rng, a.nnz() * if shared_bias { 1 } else { heads }),
            feats: random(&mut rng, a.nnz() * heads * head_dim),
            g: random(&mut rng, sq.len()),
            a,
            heads,
            head_dim,
        }
    }

    fn shapes(&self) -> (Shape, Shape) {
        (
            Shape::new(self.a.n_rows(), self.heads, self.head_dim).unwrap(),
            Shape::new(self.a.n_cols(), self.heads, self.head_dim).unwrap(),
        )
    }

    /// Σ out ⊙ G for the given operands.
    #[allow(clippy::too_many_arguments)]
    fn loss(
        &self,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        bias: Option<EdgeBias<'_, f64>>,
        feats: Option<&[f64]>,
        dropout: Option<Dropout>,
        scale: f64,
    ) -> f64 {
        let (sq, sk) = self.shapes();
        let inputs = AttentionInputs::new(q, sq, k, sk, v, sk);
        let ex = Extras {
            bias,
            edge_features: feats,
            dropout,
        };
        let mut out = vec![0.0; sq.len()];
        attention_extras(&self.a, &inputs, scale, &ex, &mut out, None).unwrap();
        out.iter().zip(&self.g).map(|(o, g)| o * g).sum()
    }
}

/// Central differences of `f` at `x`, every element.
fn numeric_grad(x: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let h = 1e-6;
    let mut y = x.to_vec();
    (0..x.len())
        .map(|i| {
            y[i] = x[i] + h;
            let up = f(&y);
            y[i] = x[i] - h;
            let down = f(&y);
            y[i] = x[i];
            (up - down) / (2.0 * h)
        })
        .collect()
}

#[track_caller]
fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    let norm = want.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
    let err = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt()
        / norm;
    assert!(err < 1e-6, "{what}: relative error {err:e}");
}

#[test]
fn without_extras_it_is_plain_attention() {
    let c = Case::new(1, 2, 3, false);
    let (sq, sk) = c.shapes();
    let inputs = AttentionInputs::new(&c.q, sq, &c.k, sk, &c.v, sk);
    let mut want = vec![0.0; sq.len()];
    attention(&c.a, &inputs, 0.7, &mut want).unwrap();
    let mut got = vec![f64::NAN; sq.len()];
    let mut w = vec![f64::NAN; c.a.nnz() * 2];
    attention_extras(
        &c.a,
        &inputs,
        0.7,
        &Extras::default(),
        &mut got,
        Some(&mut w),
    )
    .unwrap();
    assert_close("out", &got, &want);
    // The weights of each row (and head) sum to 1; the empty row has none.
    for i in 0..c.a.n_rows() {
        for h in 0..2 {
            let s: f64 = c.a.row_range(i).map(|e| w[e * 2 + h]).sum();
            let expected = if c.a.degree(i) == 0 { 0.0 } else { 1.0 };
            assert!((s - expected).abs() < 1e-12, "row {i} head {h}: {s}");
        }
    }
}

#[test]
fn gradients_match_finite_differences_with_every_extra() {
    for (heads, head_dim, shared, rate) in
        [(1, 1, false, 0.0), (2, 3, false, 0.3), (3, 2, true, 0.5)]
    {
        let c = Case::new(7 + heads as u64, heads, head_dim, shared);
        let dropout = (rate > 0.0).then(|| Dropout::new(rate, 99, 5).unwrap());
        fn bias(b: &[f64], shared: bool) -> EdgeBias<'_, f64> {
            if shared {
                EdgeBias::Shared(b)
            } else {
                EdgeBias::PerHead(b)
            }
        }
        let scale = 0.8;
        let (sq, sk) = c.shapes();
        let inputs = AttentionInputs::new(&c.q, sq, &c.k, sk, &c.v, sk);
        let ex = Extras {
            bias: Some(bias(&c.bias, shared)),
            edge_features: Some(&c.feats),
            dropout,
        };
        let grads = attention_extras_backward(&c.a, &inputs, scale, &ex, &c.g).unwrap();
        let what = format!("heads {heads} head_dim {head_dim} shared {shared} rate {rate}");
        let l = |q: &[f64], k: &[f64], v: &[f64], b: &[f64], f: &[f64], s: f64| {
            c.loss(q, k, v, Some(bias(b, shared)), Some(f), dropout, s)
        };
        let (q, k, v, b, f) = (&c.q, &c.k, &c.v, &c.bias, &c.feats);
        assert_close(
            &format!("dQ {what}"),
            &grads.dq,
            &numeric_grad(q, |x| l(x, k, v, b, f, scale)),
        );
        assert_close(
            &format!("dK {what}"),
            &grads.dk,
            &numeric_grad(k, |x| l(q, x, v, b, f, scale)),
        );
        assert_close(
            &format!("dV {what}"),
            &grads.dv,
            &numeric_grad(v, |x| l(q, k, x, b, f, scale)),
        );
        assert_close(
            &format!("dbias {what}"),
            grads.d_bias.as_deref().unwrap(),
            &numeric_grad(b, |x| l(q, k, v, x, f, scale)),
        );
        assert_close(
            &format!("dF {what}"),
            grads.d_edge_features.as_deref().unwrap(),
            &numeric_grad(f, |x| l(q, k, v, b, x, scale)),
        );
        let ds = numeric_grad(&[scale], |x| l(q, k, v, b, f, x[0]));
        assert!(
            (grads.d_scale - ds[0]).abs() < 1e-6 * ds[0].abs().max(1.0),
            "dscale {what}"
        );
    }
}

#[test]
fn an_infinite_negative_bias_masks_the_edge() {
    let c = Case::new(3, 2, 4, false);
    let (sq, sk) = c.shapes();
    // Mask every edge of row 2 but its first, and every edge of row 0 (its only one).
    let mut bias = vec![0.0; c.a.nnz() * 2];
    let kept_first = c.a.row_range(2).start;
    let mut kept = Vec::new();
    for i in 0..c.a.n_rows() {
        for e in c.a.row_range(i) {
            let masked = i == 0 || (i == 2 && e != kept_first);
            if masked {
                bias[e * 2] = f64::NEG_INFINITY;
                bias[e * 2 + 1] = f64::NEG_INFINITY;
            } else {
                kept.push((i as u32, c.a.col_indices()[e]));
            }
        }
    }
    let inputs = AttentionInputs::new(&c.q, sq, &c.k, sk, &c.v, sk);
    let ex = Extras {
        bias: Some(EdgeBias::PerHead(&bias)),
        ..Extras::default()
    };
    let mut got = vec![f64::NAN; sq.len()];
    attention_extras(&c.a, &inputs, 1.0, &ex, &mut got, None).unwrap();
    let without = Csr::from_edges(c.a.n_rows(), c.a.n_cols(), &kept).unwrap();
    let mut want = vec![0.0; sq.len()];
    attention(&without, &inputs, 1.0, &mut want).unwrap();
    assert_close("masked", &got, &want);
    assert!(
        got[..2 * 4].iter().all(|&x| x == 0.0),
        "a fully masked row outputs zeros"
    );
    // A NaN score in a fully masked row makes that row's head NaN, as on the GPU (it is not
    // masked into zeros), and reaches nothing else.
    let mut q = c.q.clone();
    q[0] = f64::NAN; // row 0, head 0
    let inputs = AttentionInputs::new(&q, sq, &c.k, sk, &c.v, sk);
    attention_extras(&c.a, &inputs, 1.0, &ex, &mut got, None).unwrap();
    assert!(got[..4].iter().all(|x| x.is_nan()), "{:?}", &got[..8]);
    assert!(got[4..8].iter().all(|&x| x == 0.0), "{:?}", &got[..8]);
    assert_close("other rows", &got[8..], &want[8..]);
}

#[test]
fn dropout_zeroes_and_rescales_the_weights_by_the_shared_mask() {
    let c = Case::new(5, 2, 3, false);
    let (sq, sk) = c.shapes();
    let inputs = AttentionInputs::new(&c.q, sq, &c.k, sk, &c.v, sk);
    let d = Dropout::new(0.4, 1234, 0).unwrap();
    let mut p = vec![0.0; c.a.nnz() * 2];
    let mut out = vec![0.0; sq.len()];
    attention_extras(
        &c.a,
        &inputs,
        1.0,
        &Extras::default(),
        &mut out,
        Some(&mut p),
    )
    .unwrap();
    let mut w = vec![0.0; c.a.nnz() * 2];
    let ex = Extras {
        dropout: Some(d),
        ..Extras::default()
    };
    attention_extras(&c.a, &inputs, 1.0, &ex, &mut out, Some(&mut w)).unwrap();
    for e in 0..c.a.nnz() {
        for h in 0..2 {
            let want = if d.keeps(e as u64, h as u64, 2) {
                p[e * 2 + h] / (1.0 - f64::from(d.rate()))
            } else {
                0.0
            };
            assert!((w[e * 2 + h] - want).abs() < 1e-12, "edge {e} head {h}");
        }
    }
}

#[test]
fn bad_extras_are_typed_errors_naming_the_operand() {
    let c = Case::new(9, 2, 3, false);
    let (sq, sk) = c.shapes();
    let inputs = AttentionInputs::new(&c.q, sq, &c.k, sk, &c.v, sk);
    let mut out = vec![0.0; sq.len()];
    let run = |ex: &Extras<'_, f64>, out: &mut [f64]| {
        attention_extras(&c.a, &inputs, 1.0, ex, out, None).unwrap_err()
    };
    let short = vec![0.0; 3];
    let e = run(
        &Extras {
            bias: Some(EdgeBias::PerHead(&short)),
            ..Extras::default()
        },
        &mut out,
    );
    assert!(
        matches!(
            e,
            Error::LengthMismatch {
                what: "bias (nnz × heads)",
                actual: 3,
                ..
            }
        ),
        "{e}"
    );
    let mut nan = vec![0.0; c.a.nnz()];
    nan[4] = f64::NAN;
    let e = run(
        &Extras {
            bias: Some(EdgeBias::Shared(&nan)),
            ..Extras::default()
        },
        &mut out,
    );
    assert!(e.to_string().contains("NaN at element 4 (edge 4)"), "{e}");
    let e = run(
        &Extras {
            edge_features: Some(&short),
            ..Extras::default()
        },
        &mut out,
    );
    assert!(e.to_string().contains("edge features"), "{e}");
    // Edge features need V's head_dim to be K's.
    let sv = Shape::new(c.a.n_cols(), 2, 5).unwrap();
    let v5 = vec![0.0; sv.len()];
    let wide = AttentionInputs::new(&c.q, sq, &c.k, sk, &v5, sv);
    let mut out5 = vec![0.0; Shape::new(c.a.n_rows(), 2, 5).unwrap().len()];
    let e = attention_extras(
        &c.a,
        &wide,
        1.0,
        &Extras {
            edge_features: Some(&c.feats),
            ..Extras::default()
        },
        &mut out5,
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("one head_dim"), "{e}");
    let mut w = vec![0.0; 1];
    let e = attention_extras(
        &c.a,
        &inputs,
        1.0,
        &Extras::default(),
        &mut out,
        Some(&mut w),
    )
    .unwrap_err();
    assert!(e.to_string().contains("weights"), "{e}");
}
