//! The CPU ops' errors (every operand, by variant and name; nothing written on error), the
//! error metric's contract, the f64 reference from half-precision inputs, and the attention
//! output's convexity (proptest).

use super::*;

// ---------------------------------------------------------------------------------------------
// Error paths: every operand, by variant and name; nothing written on error.
// ---------------------------------------------------------------------------------------------

fn assert_len_err(r: spattn_ops::Result<()>, want: &str) {
    match r {
        Err(Error::LengthMismatch { what, .. }) if what == want => {}
        other => panic!("expected LengthMismatch {{ what: {want:?} }}, got {other:?}"),
    }
}

fn assert_shape_err(r: spattn_ops::Result<()>, want: &str) {
    match r {
        Err(Error::ShapeMismatch { what, .. }) if what == want => {}
        other => panic!("expected ShapeMismatch {{ what: {want:?} }}, got {other:?}"),
    }
}

fn assert_invalid(r: spattn_ops::Result<()>, want: &str) {
    match r {
        Err(Error::InvalidArgument { what, .. }) if what == want => {}
        other => panic!("expected InvalidArgument {{ what: {want:?} }}, got {other:?}"),
    }
}

#[test]
fn error_paths() {
    // 3 × 4 mask with 4 edges; heads 2, head_dim 3.
    let a = Csr::from_edges(3, 4, &[(0, 1), (0, 3), (2, 0), (2, 2)]).unwrap();
    let (h, d) = (2, 3);
    let (sq, sk) = (shape(3, h, d), shape(4, h, d));
    let q = vec![1.0f64; sq.len()];
    let k = vec![1.0f64; sk.len()];
    let nnz_h = a.nnz() * h;
    let sentinel = 42.0;
    let mut out = vec![sentinel; nnz_h];
    let short = |x: &[f64]| x[..x.len() - 1].to_vec();
    let long = |x: &[f64]| [x, &[0.0]].concat();

    // SDDMM.
    assert_len_err(cpu::sddmm(&a, &short(&q), &k, sq, sk, 1.0, &mut out), "q");
    assert_len_err(cpu::sddmm(&a, &long(&q), &k, sq, sk, 1.0, &mut out), "q");
    assert_len_err(cpu::sddmm(&a, &q, &short(&k), sq, sk, 1.0, &mut out), "k");
    assert_len_err(cpu::sddmm(&a, &q, &k, sq, sk, 1.0, &mut out[1..]), "out");
    assert_len_err(cpu::sddmm(&a, &q, &k, sq, sk, 1.0, &mut long(&out)), "out");
    assert_shape_err(cpu::sddmm(&a, &q, &k, sk, sk, 1.0, &mut out), "q");
    assert_shape_err(cpu::sddmm(&a, &q, &k, sq, sq, 1.0, &mut out), "k");
    assert_shape_err(
        cpu::sddmm(&a, &q, &k, sq, shape(4, 1, 6), 1.0, &mut out),
        "k",
    );
    assert_shape_err(
        cpu::sddmm(&a, &q, &k, sq, shape(4, h, 4), 1.0, &mut out),
        "k",
    );
    let zero_heads = Shape { heads: 0, ..sq };
    assert_invalid(
        cpu::sddmm(&a, &q, &k, zero_heads, sk, 1.0, &mut out),
        "heads",
    );
    let zero_dim = Shape { head_dim: 0, ..sq };
    assert_invalid(
        cpu::sddmm(&a, &q, &k, zero_dim, sk, 1.0, &mut out),
        "head_dim",
    );
    let huge = Shape {
        rows: 3,
        heads: usize::MAX / 2,
        head_dim: 3,
    };
    assert_invalid(cpu::sddmm(&a, &q, &k, huge, sk, 1.0, &mut out), "q");
    assert_invalid(cpu::sddmm(&a, &q, &k, sq, sk, f64::NAN, &mut out), "scale");
    assert_invalid(
        cpu::sddmm(&a, &q, &k, sq, sk, f64::INFINITY, &mut out),
        "scale",
    );
    assert!(out.iter().all(|&x| x == sentinel), "written on error");

    // SDDMM (GAT).
    let a_dst = vec![0.5f64; 3 * h];
    let a_src = vec![0.5f64; 4 * h];
    assert_len_err(
        cpu::sddmm_gat(&a, &short(&a_dst), &a_src, h, &mut out),
        "a_dst",
    );
    assert_len_err(
        cpu::sddmm_gat(&a, &a_dst, &long(&a_src), h, &mut out),
        "a_src",
    );
    assert_len_err(cpu::sddmm_gat(&a, &a_dst, &a_src, h, &mut out[2..]), "out");
    assert_len_err(cpu::sddmm_gat(&a, &a_dst, &a_src, 1, &mut out), "a_dst");
    assert_invalid(cpu::sddmm_gat(&a, &a_dst, &a_src, 0, &mut out), "heads");
    assert!(out.iter().all(|&x| x == sentinel), "written on error");

    // Edge softmax.
    let scores = vec![0.0f64; nnz_h];
    assert_len_err(
        cpu::edge_softmax(&a, &short(&scores), h, None, &mut out),
        "scores",
    );
    assert_len_err(
        cpu::edge_softmax(&a, &scores, h, None, &mut out[1..]),
        "out",
    );
    assert_len_err(cpu::edge_softmax(&a, &scores, 3, None, &mut out), "scores");
    assert_invalid(cpu::edge_softmax(&a, &scores, 0, None, &mut out), "heads");
    assert_invalid(
        cpu::edge_softmax(&a, &scores, h, Some(f64::NAN), &mut out),
        "leaky_relu_slope",
    );
    assert_len_err(
        cpu::edge_softmax_in_place(&a, &mut long(&scores), h, None),
        "scores",
    );
    assert_invalid(cpu::edge_softmax_in_place(&a, &mut out, 0, None), "heads");
    assert_invalid(
        cpu::edge_softmax_in_place(&a, &mut out, h, Some(f64::NEG_INFINITY)),
        "leaky_relu_slope",
    );
    assert!(out.iter().all(|&x| x == sentinel), "written on error");

    // SpMM.
    let sv = shape(4, h, 5);
    let v = vec![1.0f64; sv.len()];
    let p = vec![0.5f64; nnz_h];
    let mut o = vec![sentinel; 3 * h * 5];
    assert_len_err(cpu::spmm(&a, &short(&p), &v, sv, &mut o), "p");
    assert_len_err(cpu::spmm(&a, &p, &short(&v), sv, &mut o), "v");
    assert_len_err(cpu::spmm(&a, &p, &v, sv, &mut o[1..]), "out");
    assert_len_err(cpu::spmm(&a, &p, &v, sv, &mut long(&o)), "out");
    assert_shape_err(cpu::spmm(&a, &p, &v, shape(3, h, 5), &mut o), "v");
    assert_len_err(cpu::spmm(&a, &p, &v, shape(4, 1, 10), &mut o), "p");
    assert_invalid(
        cpu::spmm(&a, &p, &v, Shape { heads: 0, ..sv }, &mut o),
        "heads",
    );
    let zero_dim_v = Shape { head_dim: 0, ..sv };
    assert_invalid(cpu::spmm(&a, &p, &v, zero_dim_v, &mut o), "head_dim");

    assert!(o.iter().all(|&x| x == sentinel), "written on error");

    // Attention (and its f64 reference), every operand.
    let ok = AttentionInputs::new(&q, sq, &k, sk, &v, sv);
    let run = |inp: AttentionInputs<'_, f64>, o: &mut [f64]| cpu::attention(&a, &inp, 1.0, o);
    let (q_s, k_s, v_s) = (short(&q), short(&k), short(&v));
    assert_len_err(run(AttentionInputs { q: &q_s, ..ok }, &mut o), "q");
    assert_len_err(run(AttentionInputs { k: &k_s, ..ok }, &mut o), "k");
    assert_len_err(run(AttentionInputs { v: &v_s, ..ok }, &mut o), "v");
    assert_len_err(run(ok, &mut o[1..]), "out");
    assert_shape_err(run(AttentionInputs { shape_q: sk, ..ok }, &mut o), "q");
    assert_shape_err(run(AttentionInputs { shape_k: sq, ..ok }, &mut o), "k");
    assert_shape_err(run(AttentionInputs { shape_v: sq, ..ok }, &mut o), "v");
    let v_heads = shape(4, 1, 10);
    assert_shape_err(
        run(
            AttentionInputs {
                shape_v: v_heads,
                ..ok
            },
            &mut o,
        ),
        "v",
    );
    let zh = Shape { heads: 0, ..sq };
    assert_invalid(run(AttentionInputs { shape_q: zh, ..ok }, &mut o), "heads");
    let zv = Shape { head_dim: 0, ..sv };
    assert_invalid(
        run(AttentionInputs { shape_v: zv, ..ok }, &mut o),
        "head_dim",
    );
    assert_invalid(cpu::attention(&a, &ok, f64::NAN, &mut o), "scale");
    assert!(o.iter().all(|&x| x == sentinel), "written on error");
    let run64 = |inp: AttentionInputs<'_, f64>, scale: f64| {
        cpu::attention_f64_from(&a, &inp, scale).map(|_| ())
    };
    assert_len_err(run64(AttentionInputs { k: &k_s, ..ok }, 1.0), "k");
    assert_shape_err(run64(AttentionInputs { shape_v: sq, ..ok }, 1.0), "v");
    assert_invalid(run64(ok, f64::INFINITY), "scale");
    assert_eq!(
        cpu::attention_f64_from(&a, &ok, 1.0).unwrap().len(),
        o.len()
    );

    // The messages name the operand.
    let msg = cpu::spmm(&a, &short(&p), &v, sv, &mut o)
        .unwrap_err()
        .to_string();
    assert_eq!(msg, "p has length 7, expected 8");
}

// ---------------------------------------------------------------------------------------------
// rel_l2_error.
// ---------------------------------------------------------------------------------------------

#[test]
fn rel_l2_error_contract() {
    use half::{bf16, f16};
    let inf = f64::INFINITY;
    assert_eq!(cpu::rel_l2_error::<f64>(&[], &[]), 0.0);
    assert_eq!(cpu::rel_l2_error(&[1.0f64, 2.0], &[1.0, 2.0]), 0.0);
    let e = cpu::rel_l2_error(&[1.0f64, 2.0], &[1.0, 2.5]);
    assert!((e - 0.5 / 2.5f64.hypot(1.0)).abs() < 1e-15);
    // NaN / inf never pass, in out or in the reference; nor a length mismatch.
    assert_eq!(cpu::rel_l2_error(&[f32::NAN, 1.0], &[1.0, 1.0]), inf);
    assert_eq!(cpu::rel_l2_error(&[f32::INFINITY], &[1.0]), inf);
    assert_eq!(cpu::rel_l2_error(&[1.0f64], &[f64::NAN]), inf);
    assert_eq!(cpu::rel_l2_error(&[1.0f64], &[1.0, 2.0]), inf);
    // A zero reference: absolute error.
    assert_eq!(cpu::rel_l2_error(&[3.0f64, 4.0], &[0.0, 0.0]), 5.0);
    assert_eq!(cpu::rel_l2_error(&[0.0f64, 0.0], &[0.0, 0.0]), 0.0);
    // No overflow or underflow of the squares.
    let e = cpu::rel_l2_error(&[1e300f64, 1e300], &[1e300, 2e300]);
    assert!((e - 1.0 / 5f64.sqrt()).abs() < 1e-15, "{e}");
    let e = cpu::rel_l2_error(&[1e-300f64], &[2e-300]);
    assert!((e - 0.5).abs() < 1e-15, "{e}");
    // A difference beyond f64's range is an infinite error, not NaN.
    assert_eq!(cpu::rel_l2_error(&[1.5e308f64], &[-1.5e308]), inf);
    // Half-precision outputs.
    assert_eq!(cpu::rel_l2_error(&[f16::from_f32(0.5)], &[0.5]), 0.0);
    assert_eq!(cpu::rel_l2_error(&[bf16::NAN], &[0.5]), inf);
    assert_eq!(
        cpu::error_metric::upcast_f64(&[f16::from_f32(0.25), f16::ONE]),
        vec![0.25, 1.0]
    );
}

#[test]
fn attention_f64_from_half_inputs() {
    use half::{bf16, f16};
    let mut rng = Pcg64::seed_from_u64(5);
    let p = Problem::random(&mut rng, 17, 17, 0.3);
    let (heads, d) = (2, 8);
    let s = shape(17, heads, d);
    let q: Vec<f64> = random_vec(&mut rng, s.len(), -1.0, 1.0);
    let k: Vec<f64> = random_vec(&mut rng, s.len(), -1.0, 1.0);
    let v: Vec<f64> = random_vec(&mut rng, s.len(), -1.0, 1.0);
    let h16 = |x: &[f64]| x.iter().map(|&y| f16::from_f64(y)).collect::<Vec<_>>();
    let b16 = |x: &[f64]| x.iter().map(|&y| bf16::from_f64(y)).collect::<Vec<_>>();
    let (qh, kh, vh) = (h16(&q), h16(&k), h16(&v));
    let out = cpu::attention_f64_from(&p.csr, &AttentionInputs::new(&qh, s, &kh, s, &vh, s), 0.3)
        .unwrap();
    let (qu, ku, vu) = (
        cpu::error_metric::upcast_f64(&qh),
        cpu::error_metric::upcast_f64(&kh),
        cpu::error_metric::upcast_f64(&vh),
    );
    let reference = ref_attention(&p, &qu, &ku, &vu, heads, d, d, 0.3);
    assert_close("f16 inputs", &out, &reference, 1e-12);
    let (qb, kb, vb) = (b16(&q), b16(&k), b16(&v));
    let out = cpu::attention_f64_from(&p.csr, &AttentionInputs::new(&qb, s, &kb, s, &vb, s), 0.3)
        .unwrap();
    let (qu, ku, vu) = (
        cpu::error_metric::upcast_f64(&qb),
        cpu::error_metric::upcast_f64(&kb),
        cpu::error_metric::upcast_f64(&vb),
    );
    let reference = ref_attention(&p, &qu, &ku, &vu, heads, d, d, 0.3);
    assert_close("bf16 inputs", &out, &reference, 1e-12);
}

// ---------------------------------------------------------------------------------------------
// Property: attention outputs are convex combinations of the neighbours' V rows.
// ---------------------------------------------------------------------------------------------

type Case = (
    usize,
    usize,
    usize,
    usize,
    Vec<(u32, u32)>,
    Vec<f64>,
    Vec<f64>,
    Vec<f64>,
    f64,
);

fn attention_case() -> impl Strategy<Value = Case> {
    (1usize..12, 1usize..12, 1usize..4, 1usize..6).prop_flat_map(|(r, c, h, d)| {
        (
            Just(r),
            Just(c),
            Just(h),
            Just(d),
            prop::collection::vec((0..r as u32, 0..c as u32), 0..50),
            prop::collection::vec(-30.0f64..30.0, r * h * d),
            prop::collection::vec(-30.0f64..30.0, c * h * d),
            prop::collection::vec(-1e3f64..1e3, c * h * d),
            -4.0f64..4.0,
        )
    })
}

fn check_convex<F: Real>(case: &Case, rel_tol: f64) -> Result<(), TestCaseError> {
    let (n_rows, n_cols, heads, d, edges, q, k, v, scale) = case;
    let (n_rows, n_cols, heads, d) = (*n_rows, *n_cols, *heads, *d);
    let a = Csr::from_edges(n_rows, n_cols, edges).unwrap();
    let (sq, sk) = (shape(n_rows, heads, d), shape(n_cols, heads, d));
    let conv = |x: &[f64]| x.iter().map(|&y| F::from_f64(y)).collect::<Vec<F>>();
    let (qf, kf, vf) = (conv(q), conv(k), conv(v));
    let mut out = vec![F::from_f64(f64::NAN); sq.len()];
    let inputs = AttentionInputs::new(&qf, sq, &kf, sk, &vf, sk);
    cpu::attention(&a, &inputs, F::from_f64(*scale), &mut out).unwrap();
    for i in 0..n_rows {
        for h in 0..heads {
            for x in 0..d {
                let o = out[(i * heads + h) * d + x].to_f64();
                let nb: Vec<f64> = a
                    .row(i)
                    .iter()
                    .map(|&j| vf[(j as usize * heads + h) * d + x].to_f64())
                    .collect();
                if nb.is_empty() {
                    prop_assert_eq!(o, 0.0);
                    continue;
                }
                let lo = nb.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = nb.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let tol = rel_tol * lo.abs().max(hi.abs()).max(1.0);
                prop_assert!(
                    o >= lo - tol && o <= hi + tol,
                    "row {} head {} coord {}: {} not in [{}, {}]",
                    i,
                    h,
                    x,
                    o,
                    lo,
                    hi
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn attention_rows_are_convex_combinations(case in attention_case()) {
        check_convex::<f64>(&case, 1e-12)?;
        check_convex::<f32>(&case, 1e-5)?;
    }
}
