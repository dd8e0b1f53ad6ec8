//! The run on a GPU: every case of the registry on small graphs and odd shapes, each output
//! checked against the f64 CPU reference. Ignored where there is no GPU; on a GPU machine run
//! `cargo test -p spattn-bench -- --include-ignored` (or the bundle's run.sh).

use spattn_bench::cases::{self, CaseKind, Target};
use spattn_bench::cli::RunArgs;
use spattn_bench::run::run;
use spattn_ops::DTypeKind;

fn args(rmat: u32, symmetrize: bool) -> RunArgs {
    RunArgs {
        graphs: vec!["cora".into()],
        rmat: vec![rmat],
        head_dim: vec![3, 64, 128],
        heads: vec![1, 2],
        dtype: vec![DTypeKind::F32, DTypeKind::F16, DTypeKind::Bf16],
        algorithms: "all".into(),
        warmup: 1,
        reps: 3,
        no_symmetrize: !symmetrize,
        seed: 1,
        rmat_seed: 1,
        ..RunArgs::default()
    }
}

fn check_run(args: &RunArgs) {
    let argv = vec!["spattn-bench (test)".to_string()];
    let outcome = run(args, &argv).expect("the run");
    let record = &outcome.record;
    assert_eq!(record.device.kind, "gpu", "{:?}", record.device);
    assert!(record.device.copy_bandwidth_gbs.unwrap() > 10.0);
    for c in &record.cases {
        assert!(
            c.error.is_none(),
            "{} {} H={} D={} {}: {:?}",
            c.graph,
            c.case,
            c.heads,
            c.head_dim,
            c.dtype,
            c.error
        );
        assert_eq!(c.passed, Some(true), "{c:?}");
        assert!(
            c.median_ms.unwrap() > 0.0 && c.pct_of_floor.unwrap() > 0.0,
            "{c:?}"
        );
    }
    // Every op and the baseline ran on every configuration (plans may skip a shape).
    let configs = 2 * 3 * 2 * 3;
    for case in cases::cases_for(Target::Gpu) {
        let n = record.cases.iter().filter(|c| c.case == case.name).count();
        if case.kind == CaseKind::Op || case.name == cases::BASELINE {
            assert_eq!(n, configs, "{}", case.name);
        }
    }
    assert!(outcome.success());
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn every_gpu_case_passes_its_check() {
    check_run(&args(9, true));
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn directed_graphs_with_empty_rows() {
    check_run(&args(8, false));
}
