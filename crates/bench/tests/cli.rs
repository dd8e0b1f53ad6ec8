//! Bad arguments and unreadable files: one line on stderr, a non-zero exit, no panic.

mod common;

use common::{bench, temp_dir, text};

fn assert_one_line_error(args: &[&str], expect: &str) {
    let out = bench(args);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{args:?} succeeded: {stdout}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines.len(),
        1,
        "{args:?}: stderr is not one line:\n{stderr}"
    );
    assert!(lines[0].starts_with("spattn-bench"), "{args:?}: {stderr}");
    assert!(
        lines[0].contains(expect),
        "{args:?}: {stderr} lacks {expect:?}"
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "{stderr}"
    );
}

#[test]
fn bad_arguments_are_one_line() {
    assert_one_line_error(&["--dtype", "f64"], "f64");
    assert_one_line_error(&["--frobnicate"], "--frobnicate");
    assert_one_line_error(&["--reps", "0"], "--reps");
    assert_one_line_error(&["--rmat", "99"], "99");
    assert_one_line_error(&["--heads", "two"], "two");
    assert_one_line_error(&["--head-dim", "0"], "--head-dim");
    assert_one_line_error(&["--dump-only"], "--dump-csr");
    assert_one_line_error(&["report"], "--json");
}

#[test]
fn unknown_cases_list_the_valid_ones() {
    assert_one_line_error(&["--cpu", "--algorithms", "fused-magic"], "unfused-csr");
    assert_one_line_error(
        &["--cpu", "--algorithms", "unfused-csr", "--rmat", "4"],
        "cpu-unfused",
    );
}

#[test]
fn unreadable_files_are_one_line() {
    let dir = temp_dir("cli");
    assert_one_line_error(
        &["--cpu", "--graph", "/no/such/graph.mtx"],
        "/no/such/graph.mtx",
    );
    assert_one_line_error(
        &["--cpu", "--graph", "no-such-graph-name"],
        "no-such-graph-name",
    );
    let bad = dir.join("bad.mtx");
    std::fs::write(
        &bad,
        "%%MatrixMarket matrix coordinate pattern general\n2 2 1\n3 1\n",
    )
    .unwrap();
    assert_one_line_error(&["--cpu", "--graph", bad.to_str().unwrap()], "line 3");
    let junk = dir.join("junk.mtx.gz");
    std::fs::write(&junk, [0x1f, 0x8b, 0, 1, 2]).unwrap();
    assert_one_line_error(&["--cpu", "--graph", junk.to_str().unwrap()], "junk.mtx.gz");
    assert_one_line_error(
        &["--cpu", "--rmat", "4", "--peers", "/no/such/peers.json"],
        "peers.json",
    );
    let not_peers = dir.join("p.json");
    std::fs::write(&not_peers, "{\"a\": 1}").unwrap();
    assert_one_line_error(
        &[
            "--cpu",
            "--rmat",
            "4",
            "--peers",
            not_peers.to_str().unwrap(),
        ],
        "p.json",
    );
    assert_one_line_error(&["report", "--json", "/no/such/run.json"], "run.json");
    assert_one_line_error(&["report", "--json", not_peers.to_str().unwrap()], "p.json");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn help_and_version_succeed() {
    let out = bench(&["--help"]);
    assert!(out.status.success());
    let (stdout, _) = text(&out);
    assert!(
        stdout.contains("--algorithms") && stdout.contains("--dump-csr"),
        "{stdout}"
    );
    let out = bench(&["--version"]);
    assert!(out.status.success());
    assert!(text(&out).0.contains(env!("CARGO_PKG_VERSION")));
}
