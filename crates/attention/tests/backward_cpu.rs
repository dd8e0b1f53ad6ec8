//! CPU tests of `AttentionPlan::backward_host` on a CPU plan (run in CI, no GPU needed).

use spattn::{AttentionConfig, AttentionPlan, Error};
use spattn_formats::Csr;
use spattn_ops::cpu::{attention_backward_f64_from, rel_l2_error, AttentionInputs};
use spattn_ops::DTypeKind;

fn graph() -> Csr {
    // A ring with self loops, and row 6 left without edges.
    Csr::from_edges(
        7,
        7,
        &[
            (0, 1),
            (1, 2),
            (2, 3),
            (3, 4),
            (4, 5),
            (5, 0),
            (0, 0),
            (2, 5),
        ],
    )
    .unwrap()
}

fn data(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i + seed) * 7919) % 23) as f32 / 11.0 - 1.0)
        .collect()
}

#[test]
fn cpu_plan_gradients_match_the_f64_reference() {
    let a = graph();
    for heads in [1, 4, 8] {
        let plan =
            AttentionPlan::new_cpu(&a, AttentionConfig::new(heads, 3, DTypeKind::F32)).unwrap();
        let s = plan.shape_q();
        let (q, k, v, d) = (
            data(s.len(), 1),
            data(s.len(), 2),
            data(s.len(), 3),
            data(s.len(), 4),
        );
        let out = plan.forward_host(&q, &k, &v).unwrap();
        let g = plan.backward_host(&q, &k, &v, &out, &d).unwrap();
        let want = attention_backward_f64_from(
            &a,
            &AttentionInputs::new(&q, s, &k, s, &v, s),
            1.0 / 3f64.sqrt(),
            &d,
        )
        .unwrap();
        for (got, w) in [(&g.dq, &want.dq), (&g.dk, &want.dk), (&g.dv, &want.dv)] {
            assert!(rel_l2_error(got, w) <= 1e-5);
        }
        assert!((f64::from(g.d_scale) - want.d_scale).abs() <= 1e-5 * want.d_scale.abs().max(1.0));
        // Row 6 has no edges: zero dQ; column 6 is attended by nobody: zero dK, dV.
        let r = s.row_len();
        assert!(g.dq[6 * r..].iter().all(|&x| x == 0.0));
        assert!(g.dk[6 * r..].iter().all(|&x| x == 0.0));
        assert!(g.dv[6 * r..].iter().all(|&x| x == 0.0));
    }
}

#[test]
fn cpu_plan_backward_errors_name_the_operand() {
    let a = graph();
    let plan = AttentionPlan::new_cpu(&a, AttentionConfig::new(2, 4, DTypeKind::F32)).unwrap();
    let good = vec![0.0f32; 7 * 2 * 4];
    let short = vec![0.0f32; 7 * 2 * 4 - 1];
    let e = plan
        .backward_host(&good, &good, &good, &good, &short)
        .unwrap_err();
    assert!(
        matches!(e, Error::LengthMismatch { what: "d_out", .. }),
        "{e}"
    );
    let bf = vec![half::bf16::ZERO; 56];
    let e = plan.backward_host(&bf, &bf, &bf, &bf, &bf).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
}
