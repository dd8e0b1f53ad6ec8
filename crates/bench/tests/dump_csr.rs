//! `--dump-csr` writes the binary CSR of peers/torch_peers.py; read back here with a reader of
//! its own, written from the format's description.

mod common;

use std::path::Path;

use common::{bench_ok, cpu_run, temp_dir};
use spattn_formats::{rmat, RmatConfig};

/// (n_rows, n_cols, row_offsets, col_indices) of a `SPCSR001` file.
fn read_spcsr(path: &Path) -> (u64, u64, Vec<u32>, Vec<u32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"SPCSR001");
    let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    let (n_rows, n_cols, nnz) = (u64_at(8), u64_at(16), u64_at(24));
    let u32s = |from: usize, count: u64| -> Vec<u32> {
        (0..count as usize)
            .map(|k| u32::from_le_bytes(b[from + 4 * k..from + 4 * k + 4].try_into().unwrap()))
            .collect()
    };
    let offsets = u32s(32, n_rows + 1);
    let cols = u32s(32 + 4 * (n_rows as usize + 1), nnz);
    assert_eq!(
        b.len(),
        32 + 4 * (n_rows as usize + 1 + nnz as usize),
        "trailing bytes"
    );
    (n_rows, n_cols, offsets, cols)
}

#[test]
fn one_graph_to_a_file() {
    let dir = temp_dir("dump-one");
    let file = dir.join("rmat-6.csr");
    bench_ok(&[
        "--rmat",
        "6",
        "--dump-csr",
        file.to_str().unwrap(),
        "--dump-only",
    ]);
    let expected = rmat(&RmatConfig::benchmark(6).with_seed(1)).unwrap();
    let (n_rows, n_cols, offsets, cols) = read_spcsr(&file);
    assert_eq!((n_rows, n_cols), (64, 64));
    assert_eq!(offsets, expected.row_offsets());
    assert_eq!(cols, expected.col_indices());
    // The crate's own reader agrees, so `--graph rmat-6.csr` loads the same graph.
    assert_eq!(spattn_bench::csr_file::read_csr(&file).unwrap(), expected);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn several_graphs_to_a_folder_while_benchmarking() {
    let dir = temp_dir("dump-many");
    let target = dir.join("graphs");
    let cora = spattn_test_support::cora_path();
    let data = cora.to_str().expect("a UTF-8 path");
    let dump = ["--dump-csr", target.to_str().unwrap()];
    let stdout = cpu_run(
        &[&["--graph", data, "--rmat", "5"][..], &dump].concat(),
        1,
        0,
    );
    assert!(stdout.contains("cpu-unfused"), "{stdout}");
    let (n, _, offsets, cols) = read_spcsr(&target.join("cora.csr"));
    assert_eq!((n, cols.len()), (2708, 13264));
    assert_eq!(*offsets.last().unwrap() as usize, cols.len());
    let (n, _, _, _) = read_spcsr(&target.join("rmat-5.csr"));
    assert_eq!(n, 32);
    // And it reads back as a graph of its own.
    let csr = target.join("cora.csr");
    let stdout = cpu_run(&["--graph", csr.to_str().unwrap()], 1, 0);
    assert!(stdout.contains("graph cora"));
    std::fs::remove_dir_all(&dir).unwrap();
}
