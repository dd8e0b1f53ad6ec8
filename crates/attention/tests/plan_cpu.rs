//! CPU tests of the plan logic and its errors (run in CI, no GPU needed).

use spattn::{Algorithm, AttentionConfig, AttentionPlan, Error};
use spattn_formats::Csr;
use spattn_ops::cpu::{attention_f64_from, rel_l2_error, AttentionInputs};
use spattn_ops::DTypeKind;

fn graph() -> Csr {
    Csr::from_edges(5, 5, &[(0, 1), (1, 2), (2, 3), (3, 4), (4, 0)])
        .unwrap()
        .symmetrize_with_self_loops()
        .unwrap()
}

#[test]
fn algorithm_names_round_trip() {
    for a in Algorithm::ALL {
        assert_eq!(a.name().parse::<Algorithm>().unwrap(), a);
    }
    let e = "flash".parse::<Algorithm>().unwrap_err();
    assert!(e.to_string().contains("unfused-csr"), "{e}");
}

#[test]
fn invalid_configs_are_rejected() {
    let a = graph();
    for (heads, d) in [(0, 8), (2, 0)] {
        let e =
            AttentionPlan::new_cpu(&a, AttentionConfig::new(heads, d, DTypeKind::F32)).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { .. }), "{e}");
    }
    let e = AttentionPlan::new_cpu(
        &a,
        AttentionConfig::new(1, 4, DTypeKind::F32).with_scale(f32::NAN),
    )
    .unwrap_err();
    assert!(
        matches!(e, Error::InvalidConfig { what: "scale", .. }),
        "{e}"
    );
}

#[test]
fn cpu_plan_matches_the_f64_reference() {
    let a = graph();
    let (heads, d) = (3, 5);
    let plan = AttentionPlan::new_cpu(&a, AttentionConfig::new(heads, d, DTypeKind::F32)).unwrap();
    assert!(!plan.is_gpu());
    let s = plan.shape_q();
    let x: Vec<f32> = (0..s.len())
        .map(|i| ((i * 7919) % 13) as f32 / 6.0 - 1.0)
        .collect();
    let y: Vec<f32> = (0..s.len())
        .map(|i| ((i * 104729) % 17) as f32 / 8.0 - 1.0)
        .collect();
    let out = plan.forward_host(&x, &y, &x).unwrap();
    let want = attention_f64_from(
        &a,
        &AttentionInputs::new(&x, s, &y, s, &x, s),
        1.0 / 5f64.sqrt(),
    )
    .unwrap();
    assert!(rel_l2_error(&out, &want) <= 1e-5);
    // f16 plans widen to f32 and round the output back.
    let p16 = AttentionPlan::new_cpu(&a, AttentionConfig::new(heads, d, DTypeKind::F16)).unwrap();
    let x16: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
    let y16: Vec<half::f16> = y.iter().map(|&v| half::f16::from_f32(v)).collect();
    let out16 = p16.forward_host(&x16, &y16, &x16).unwrap();
    let want16 = attention_f64_from(
        &a,
        &AttentionInputs::new(&x16, s, &y16, s, &x16, s),
        1.0 / 5f64.sqrt(),
    )
    .unwrap();
    assert!(rel_l2_error(&out16, &want16) <= 5e-3);
}

#[test]
fn host_operand_errors_name_the_operand() {
    let a = graph();
    let plan = AttentionPlan::new_cpu(&a, AttentionConfig::new(2, 4, DTypeKind::F32)).unwrap();
    let good = vec![0.0f32; 5 * 2 * 4];
    let short = vec![0.0f32; 5 * 2 * 4 - 1];
    let e = plan.forward_host(&good, &good, &short).unwrap_err();
    assert!(
        matches!(
            e,
            Error::LengthMismatch {
                what: "V",
                expected: 40,
                actual: 39,
                ..
            }
        ),
        "{e}"
    );
    let bf = vec![half::bf16::ZERO; 40];
    let e = plan.forward_host(&bf, &bf, &bf).unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
}

#[test]
fn rows_without_edges_give_zeros_on_the_cpu() {
    let a = Csr::from_edges(4, 4, &[(0, 1), (2, 2)]).unwrap();
    let plan = AttentionPlan::new_cpu(&a, AttentionConfig::new(1, 3, DTypeKind::F32)).unwrap();
    let x: Vec<f32> = (0..12).map(|i| i as f32 - 5.0).collect();
    let out = plan.forward_host(&x, &x, &x).unwrap();
    assert_eq!(&out[3..6], &[0.0; 3]);
    assert_eq!(&out[9..12], &[0.0; 3]);
    assert!(out.iter().all(|v| v.is_finite()));
}
