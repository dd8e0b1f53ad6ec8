//! The run on the CPU path: tiny graphs, every output checked, the JSON readable.

mod common;

use common::{cpu_run, temp_dir};
use spattn_bench::record::RunRecord;

#[test]
fn tiny_cpu_run_writes_json() {
    let dir = temp_dir("cpu-run");
    let json = dir.join("out/run.json");
    let stdout = cpu_run(&["--rmat", "7", "--json", json.to_str().unwrap()], 3, 1);
    assert!(stdout.contains("CPU: --cpu given"), "{stdout}");
    assert!(stdout.contains("graph rmat-7"), "{stdout}");
    assert!(
        stdout.contains("ME-BCRS") && stdout.contains("BSB"),
        "{stdout}"
    );

    let text = std::fs::read_to_string(&json).unwrap();
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(value["device"]["kind"], "cpu");
    let run: RunRecord = serde_json::from_str(&text).unwrap();
    assert_eq!(run.graphs.len(), 1);
    assert_eq!(run.graphs[0].name, "rmat-7");
    assert_eq!(run.graphs[0].n, 128);
    assert_eq!(run.cases.len(), 1);
    let c = &run.cases[0];
    assert_eq!(
        (c.case.as_str(), c.dtype.as_str(), c.heads, c.head_dim),
        ("cpu-unfused", "f32", 1, 64)
    );
    assert_eq!(c.passed, Some(true));
    assert!(c.rel_error.unwrap() <= 1e-5);
    assert!(c.median_ms.unwrap() > 0.0 && c.effective_gbs.unwrap() > 0.0);
    assert!(c.pct_of_floor.is_none()); // no copy bandwidth on the CPU
    assert!(run.command.contains("--rmat 7"));
    assert_ne!(run.commit, "");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn shapes_dtypes_and_named_graphs() {
    let cora = spattn_test_support::cora_path();
    let data_dir = cora.parent().expect("cora's folder");
    let data = data_dir.to_str().expect("a UTF-8 path");
    let dir = temp_dir("cpu-shapes");
    let json = dir.join("run.json");
    let graph = ["--graph", "cora", "--data-dir", data];
    let configs = [
        "--heads",
        "1,3",
        "--head-dim",
        "5",
        "--dtype",
        "f16",
        "--dtype",
        "bf16",
    ];
    let json_arg = ["--json", json.to_str().unwrap()];
    cpu_run(&[&graph[..], &configs, &json_arg].concat(), 2, 0);
    let run: RunRecord = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(run.graphs[0].nnz, 13264); // symmetrized with self loops
    assert!(run.graphs[0].source.ends_with("cora.mtx.gz"));
    let configs: Vec<_> = run
        .cases
        .iter()
        .map(|c| (c.dtype.as_str(), c.heads))
        .collect();
    assert_eq!(configs, [("f16", 1), ("f16", 3), ("bf16", 1), ("bf16", 3)]);
    for c in &run.cases {
        assert_eq!(c.passed, Some(true), "{c:?}");
        assert_eq!(c.tolerance, if c.dtype == "f16" { 5e-3 } else { 2e-2 });
    }
    // Each configuration draws its own inputs, from a seed that depends on it alone.
    let seeds: Vec<u64> = run.cases.iter().map(|c| c.seed).collect();
    let expected: Vec<u64> = [("f16", 1), ("f16", 3), ("bf16", 1), ("bf16", 3)]
        .iter()
        .map(|&(dtype, heads)| {
            let dtype = dtype.parse().unwrap();
            spattn_bench::inputs::config_seed(1, "cora", heads, 5, dtype)
        })
        .collect();
    assert_eq!(seeds, expected);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn no_check_and_no_symmetrize() {
    let stdout = cpu_run(&["--rmat", "6", "--no-symmetrize", "--no-check"], 2, 0);
    assert!(
        stdout.contains("as stored") && stdout.contains("not checked"),
        "{stdout}"
    );
}
