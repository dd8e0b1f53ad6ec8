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
    let out_md = dir.join("out.md");
    let out_md = out_md.to_str().unwrap();
    assert_one_line_error(
        &["report", "--json", "/no/such/run.json", "--out", out_md],
        "run.json",
    );
    assert_one_line_error(
        &[
            "report",
            "--json",
            not_peers.to_str().unwrap(),
            "--out",
            out_md,
        ],
        "p.json",
    );
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

/// Hostile sizes: each is a one-line error naming the bytes, with bounded memory, never an
/// allocation abort (which prints "memory allocation of N bytes failed" and kills the process).
#[test]
fn hostile_sizes_are_one_line_errors() {
    let dir = temp_dir("cli-hostile");
    // A size line of 4,294,967,294 rows with 2 entries: the row offsets alone are 16 GiB.
    let big = dir.join("big.mtx");
    std::fs::write(
        &big,
        "%%MatrixMarket matrix coordinate pattern general\n4294967294 4294967294 2\n1 2\n3 4\n",
    )
    .unwrap();
    assert_one_line_error(
        &["--cpu", "--graph", big.to_str().unwrap()],
        "cannot allocate",
    );
    // The 17-byte edge list whose largest index makes 4,294,967,294 nodes.
    let edges = dir.join("e.txt");
    std::fs::write(&edges, "0 1\n4294967293 1").unwrap();
    assert_one_line_error(
        &["--cpu", "--graph", edges.to_str().unwrap()],
        "cannot allocate",
    );
    // R-MAT scale 27: 2^31 drawn edges, more than this machine (or any CI machine) holds.
    assert_one_line_error(
        &["--cpu", "--rmat", "27", "--host-memory", "16G"],
        "at most --rmat ",
    );
    // --head-dim 65536 on the default graphs: refused before the inputs are drawn, naming the
    // largest head_dim that fits (the cap makes the test independent of the machine).
    assert_one_line_error(
        &["--cpu", "--head-dim", "65536", "--host-memory", "2G"],
        "at most --head-dim ",
    );
    // Many rows and few edges (the 10^8-row file of the report, scaled down with the cap):
    // the graph loads, its inputs do not fit.
    let tall = dir.join("tall.mtx");
    std::fs::write(
        &tall,
        "%%MatrixMarket matrix coordinate pattern general\n1000000 1000000 2\n1 2\n3 4\n",
    )
    .unwrap();
    assert_one_line_error(
        &[
            "--cpu",
            "--no-symmetrize",
            "--graph",
            tall.to_str().unwrap(),
            "--host-memory",
            "100M",
        ],
        "of host memory",
    );
    assert_one_line_error(&["--cpu", "--host-memory", "8X"], "--host-memory");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A byte-order mark before the banner and SNAP-style edge lists are read.
#[test]
fn snap_edge_lists_and_byte_order_marks_are_read() {
    let dir = temp_dir("cli-snap");
    let snap = dir.join("wiki-Vote.txt");
    std::fs::write(
        &snap,
        "# Directed graph: wiki-Vote\n# FromNodeId\tToNodeId\n0\t1\n1\t2\n2\t0\n",
    )
    .unwrap();
    let bom = dir.join("bom.mtx");
    std::fs::write(
        &bom,
        "\u{feff}%%MatrixMarket matrix coordinate pattern general\n3 3 2\n1 2\n2 3\n",
    )
    .unwrap();
    for (path, name) in [(&snap, "wiki-Vote"), (&bom, "bom")] {
        let out = bench(&[
            "--cpu",
            "--graph",
            path.to_str().unwrap(),
            "--reps",
            "1",
            "--warmup",
            "0",
        ]);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{name}: {stderr}");
        assert!(
            stdout.contains(name) && stdout.contains("1 passed"),
            "{stdout}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
