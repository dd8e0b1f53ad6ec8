//! The MatrixMarket and edge-list readers: every malformed-file case, gzip, values, symmetric
//! expansion, and the real graphs of `shared/data` against their published statistics.

use std::io::Write;
use std::path::{Path, PathBuf};

use flate2::write::GzEncoder;
use flate2::Compression;
use proptest::prelude::*;
use spattn_formats::{
    read_edge_list, read_edge_list_from, read_edge_list_with, read_matrix_market,
    read_matrix_market_from, Csr, EdgeListOptions, Error,
};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

const NAME: &str = "test.mtx";

fn mm(text: &str) -> Result<Csr, Error> {
    read_matrix_market_from(text.as_bytes(), Some(Path::new(NAME)))
}

fn edges(text: &str, opts: EdgeListOptions) -> Result<Csr, Error> {
    read_edge_list_from(text.as_bytes(), Some(Path::new(NAME)), opts)
}

/// Asserts a parse error at `line` whose message contains `needle`, naming the test path.
#[track_caller]
fn assert_parse_error(result: Result<Csr, Error>, line: usize, needle: &str) {
    match result {
        Err(Error::Parse {
            path,
            line: got,
            msg,
        }) => {
            assert_eq!(got, line, "wrong line for {msg:?}");
            assert!(
                msg.contains(needle),
                "message {msg:?} does not contain {needle:?}"
            );
            assert_eq!(path.as_deref(), Some(Path::new(NAME)));
            // The Display form names the file and line.
            let shown = Error::Parse { path, line, msg }.to_string();
            assert!(
                shown.starts_with(&format!("{NAME}: line {line}: ")),
                "{shown}"
            );
        }
        other => panic!("expected a parse error at line {line} ({needle:?}), got {other:?}"),
    }
}

/// A fresh temporary directory for one test.
/// [`assert_parse_error`] of the MatrixMarket text `prefix` + `text` for each case
/// `(text, line, needle)`.
#[track_caller]
fn assert_mm_errors(prefix: &str, cases: &[(&str, usize, &str)]) {
    for &(text, line, needle) in cases {
        assert_parse_error(mm(&format!("{prefix}{text}")), line, needle);
    }
}

fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("spattn-formats-io-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

const PATTERN_HEADER: &str = "%%MatrixMarket matrix coordinate pattern general\n";

// ---------------------------------------------------------------------------------------------
// MatrixMarket: what is accepted
// ---------------------------------------------------------------------------------------------

#[test]
fn pattern_general() {
    let a = mm("%%MatrixMarket matrix coordinate pattern general\n\
                % a comment\n\
                %\n\
                \n\
                3 4 4\n\
                1 2\n\
                3 4\n\
                1 1\n\
                3 1\n")
    .unwrap();
    assert_eq!((a.n_rows(), a.n_cols(), a.nnz()), (3, 4, 4));
    assert_eq!(a.row(0), &[0, 1]);
    assert!(a.row(1).is_empty());
    assert_eq!(a.row(2), &[0, 3]);
    assert_eq!(a.values(), None);
}

#[test]
fn keywords_are_case_insensitive_and_whitespace_is_flexible() {
    let a = mm("%%MatrixMarket MATRIX Coordinate PATTERN General\r\n\
                \t2   2  2 \r\n\
                1\t2\r\n\
                \x20 2 1  \r\n")
    .unwrap();
    assert_eq!(a, Csr::from_edges(2, 2, &[(0, 1), (1, 0)]).unwrap());
}

#[test]
fn last_line_without_newline() {
    let a = mm(&format!("{PATTERN_HEADER}2 2 2\n1 1\n2 2")).unwrap();
    assert_eq!(a, Csr::identity(2).unwrap());
}

#[test]
fn real_values_and_duplicates_summed() {
    let a = mm("%%MatrixMarket matrix coordinate real general\n\
                3 3 5\n\
                1 2 0.5\n\
                3 3 -2e-1\n\
                1 2 0.25\n\
                2 1 +7\n\
                1 1 1.5E+2\n")
    .unwrap();
    assert_eq!(a.row(0), &[0, 1]);
    assert_eq!(a.row(1), &[0]);
    assert_eq!(a.row(2), &[2]);
    assert_eq!(a.values(), Some(&[150.0, 0.75, 7.0, -0.2][..]));
}

#[test]
fn double_is_a_synonym_of_real() {
    let a = mm("%%MatrixMarket matrix coordinate double general\n1 1 1\n1 1 2.5\n").unwrap();
    assert_eq!(a.values(), Some(&[2.5][..]));
}

#[test]
fn integer_values() {
    let a = mm("%%MatrixMarket matrix coordinate integer general\n\
                2 2 3\n\
                1 1 3\n\
                2 1 -4\n\
                1 1 10\n")
    .unwrap();
    assert_eq!(a.row(0), &[0]);
    assert_eq!(a.row(1), &[0]);
    assert_eq!(a.values(), Some(&[13.0, -4.0][..]));
}

#[test]
fn symmetric_pattern_mirrors_off_diagonal_entries() {
    let a = mm("%%MatrixMarket matrix coordinate pattern symmetric\n\
                4 4 4\n\
                1 1\n\
                2 1\n\
                4 2\n\
                4 3\n")
    .unwrap();
    let want = Csr::from_edges(
        4,
        4,
        &[(0, 0), (1, 0), (0, 1), (3, 1), (1, 3), (3, 2), (2, 3)],
    )
    .unwrap();
    assert_eq!(a, want);
    assert_eq!(a.transpose(), a);
}

#[test]
fn symmetric_real_mirrors_values() {
    let a = mm("%%MatrixMarket matrix coordinate real symmetric\n\
                3 3 3\n\
                1 1 1.0\n\
                3 1 2.0\n\
                3 2 -3.0\n")
    .unwrap();
    assert_eq!(a.row(0), &[0, 2]);
    assert_eq!(a.row(1), &[2]);
    assert_eq!(a.row(2), &[0, 1]);
    assert_eq!(a.values(), Some(&[1.0, 2.0, -3.0, 2.0, -3.0][..]));
    assert_eq!(a.transpose(), a);
}

#[test]
fn empty_matrices() {
    let a = mm(&format!("{PATTERN_HEADER}0 0 0\n")).unwrap();
    assert_eq!((a.n_rows(), a.n_cols(), a.nnz()), (0, 0, 0));
    let a = mm(&format!("{PATTERN_HEADER}5 3 0\n% nothing\n\n")).unwrap();
    assert_eq!((a.n_rows(), a.n_cols(), a.nnz()), (5, 3, 0));
    let a = mm("%%MatrixMarket matrix coordinate real general\n2 2 0").unwrap();
    assert_eq!(a.values(), Some(&[][..]));
}

// ---------------------------------------------------------------------------------------------
// MatrixMarket: every malformed case, with its line
// ---------------------------------------------------------------------------------------------

#[test]
fn empty_file() {
    assert_parse_error(mm(""), 1, "missing banner");
}

#[test]
fn bad_banners() {
    let mm_banner = "%%MatrixMarket matrix coordinate";
    assert_mm_errors(
        "",
        &[
            (
                "%MatrixMarket matrix coordinate pattern general\n1 1 0\n",
                1,
                "bad banner",
            ),
            ("1 1 0\n", 1, "bad banner"),
            (
                "%%MatrixMarket matrix coordinate pattern\n1 1 0\n",
                1,
                "expected 5 words",
            ),
            (
                "%%MatrixMarket matrix coordinate pattern general extra\n1 1 0\n",
                1,
                "expected 5 words",
            ),
            (
                "%%MatrixMarket tensor coordinate pattern general\n",
                1,
                "unknown object 'tensor'",
            ),
            (
                "%%MatrixMarket matrix sparse pattern general\n",
                1,
                "unknown format 'sparse'",
            ),
        ],
    );
    assert_mm_errors(
        mm_banner,
        &[
            (" float general\n", 1, "unknown field 'float'"),
            (" real upper\n", 1, "unknown symmetry 'upper'"),
        ],
    );
}

#[test]
fn unsupported_formats() {
    for (banner, needle) in [
        ("matrix array real general", "unsupported format 'array'"),
        (
            "matrix coordinate complex general",
            "unsupported field 'complex'",
        ),
        (
            "matrix coordinate real hermitian",
            "unsupported symmetry 'hermitian'",
        ),
        (
            "matrix coordinate real skew-symmetric",
            "unsupported symmetry 'skew-symmetric'",
        ),
        (
            "vector coordinate real general",
            "unsupported object 'vector'",
        ),
    ] {
        assert_parse_error(mm(&format!("%%MatrixMarket {banner}\n2 2 0\n")), 1, needle);
    }
}

#[test]
fn bad_size_lines() {
    assert_mm_errors(
        PATTERN_HEADER,
        &[
            ("", 2, "file ends before the size line"),
            ("% only comments\n\n", 4, "file ends before the size line"),
            ("3 3\n", 2, "found 2 fields"),
            ("3 3 1 1\n", 2, "found 4 fields"),
            (
                "%c\n3 x 1\n1 1\n",
                3,
                "cols 'x' is not a non-negative integer",
            ),
            ("-3 3 1\n", 2, "rows '-3' is not a non-negative integer"),
            (
                "3 3 1.0\n",
                2,
                "entries '1.0' is not a non-negative integer",
            ),
            ("5000000000 3 0\n", 2, "rows = 5000000000 exceeds the limit"),
            ("3 3 5000000000\n", 2, "5000000000 entries exceed the limit"),
            (
                "3 3 99999999999999999999999\n",
                2,
                "not a non-negative integer",
            ),
        ],
    );
}

#[test]
fn symmetric_must_be_square() {
    assert_parse_error(
        mm("%%MatrixMarket matrix coordinate pattern symmetric\n% c\n3 4 1\n1 1\n"),
        3,
        "must be square, the size line gives 3 x 4",
    );
}

#[test]
fn bad_indices() {
    let h = format!("{PATTERN_HEADER}3 3 2\n1 1\n");
    assert_mm_errors(
        &h,
        &[
            ("1.5 2\n", 4, "row index '1.5'"),
            ("2 b\n", 4, "column index 'b'"),
            ("-1 2\n", 4, "row index '-1'"),
            ("0 2\n", 4, "row index 0 is out of range"),
            ("2 0\n", 4, "MatrixMarket indices are 1-based"),
            ("4 1\n", 4, "row index 4 is out of range 1..=3"),
            ("1 4\n", 4, "column index 4 is out of range 1..=3"),
            ("99999999999999999999999 1\n", 4, "not a positive integer"),
            ("2\n", 4, "missing column index"),
            ("\u{e9} 1\n", 4, "row index '\u{e9}'"),
        ],
    );
    // Bytes that are not UTF-8 at all.
    let mut bytes = h.clone().into_bytes();
    bytes.extend_from_slice(b"\xff\xfe 1\n");
    match read_matrix_market_from(&bytes[..], None) {
        Err(Error::Parse {
            line: 4,
            path: None,
            msg,
        }) => {
            assert!(msg.contains("row index"), "{msg}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_values() {
    let real = "%%MatrixMarket matrix coordinate real general\n2 2 2\n1 1 1.0\n";
    assert_mm_errors(
        real,
        &[
            ("2 2\n", 4, "missing value (field is real)"),
            ("2 2 abc\n", 4, "value 'abc' is not a number"),
            ("2 2 1,5\n", 4, "value '1,5' is not a number"),
            ("2 2 1e39\n", 4, "value '1e39' overflows f32"),
            ("2 2 1.0 2.0\n", 4, "unexpected extra field '2.0'"),
        ],
    );
    let int = "%%MatrixMarket matrix coordinate integer general\n2 2 2\n1 1 1\n";
    assert_mm_errors(
        int,
        &[
            ("2 2\n", 4, "missing value (field is integer)"),
            ("2 2 1.5\n", 4, "value '1.5' is not an integer"),
        ],
    );
    // A pattern entry has no value: a third field is an error, not silently dropped.
    assert_mm_errors(
        PATTERN_HEADER,
        &[(
            "2 2 2\n1 1\n2 2 1\n",
            4,
            "unexpected extra field '1' (an entry has 2 fields)",
        )],
    );
}

#[test]
fn too_few_entries() {
    assert_mm_errors(
        PATTERN_HEADER,
        &[
            // The file ends at line 5; the missing entry would be on line 6.
            (
                "3 3 3\n1 1\n% c\n2 2\n",
                6,
                "too few entries: the file ends after 2 of the 3 entries the size line (line 2) promises",
            ),
            ("3 3 3\n1 1\n2 2", 5, "after 2 of the 3"),
            ("3 3 1\n", 3, "after 0 of the 1"),
        ],
    );
}

#[test]
fn too_many_entries() {
    assert_mm_errors(
        PATTERN_HEADER,
        &[
            (
                "3 3 2\n1 1\n\n2 2\n% c\n3 3\n1 2\n",
                7,
                "too many entries: the size line (line 2) promises 2",
            ),
            ("3 3 0\n1 1\n", 3, "too many entries"),
        ],
    );
}

#[test]
fn first_error_in_file_order_wins() {
    // One entry too many (line 5) before a malformed line (line 6).
    assert_parse_error(
        mm(&format!("{PATTERN_HEADER}3 3 2\n1 1\n2 2\n3 3\nx y\n")),
        5,
        "too many entries",
    );
    // A malformed line before the count runs out.
    assert_parse_error(
        mm(&format!("{PATTERN_HEADER}3 3 2\nx y\n1 1\n2 2\n")),
        3,
        "row index 'x'",
    );
}

#[test]
fn errors_deep_in_a_large_file_have_the_right_line() {
    // Large enough to be parsed in several parallel chunks (1 MiB each).
    let n = 300_000usize;
    let bad_entry = 250_000usize;
    let mut text = format!("{PATTERN_HEADER}% comment\n{n} {n} {n}\n");
    for i in 1..=n {
        if i == bad_entry {
            text.push_str("1 oops\n");
        } else {
            text.push_str(&format!("{i} {}\n", (i * 7) % n + 1));
        }
    }
    assert!(text.len() > 3 << 20);
    // Banner, comment, size line: entry k is on line k + 3.
    assert_parse_error(mm(&text), bad_entry + 3, "column index 'oops'");
    let good = text.replace("1 oops\n", "1 1\n");
    let a = mm(&good).unwrap();
    assert_eq!(a.nnz(), n);
    let too_few = good.replace(&format!("{n} {n} {n}\n"), &format!("{n} {n} {}\n", n + 1));
    assert_parse_error(mm(&too_few), n + 4, "after 300000 of the 300001");
    let too_many = good.replace(&format!("{n} {n} {n}\n"), &format!("{n} {n} {}\n", n - 10));
    assert_parse_error(mm(&too_many), n - 10 + 4, "too many entries");
}

#[test]
fn missing_file_is_an_io_error_naming_the_path() {
    let path = temp_dir("missing").join("no-such-file.mtx");
    match read_matrix_market(&path) {
        Err(Error::Io { path: p, source }) => {
            assert_eq!(p, path);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("{other:?}"),
    }
    match read_edge_list(&path) {
        Err(Error::Io { path: p, .. }) => assert_eq!(p, path),
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Gzip
// ---------------------------------------------------------------------------------------------

const SAMPLE: &str = "%%MatrixMarket matrix coordinate real symmetric\n\
                      % sample\n\
                      5 5 6\n\
                      1 1 1\n\
                      2 1 2\n\
                      3 2 3\n\
                      5 3 4\n\
                      5 5 5\n\
                      4 1 6\n";

#[test]
fn gzip_and_plain_give_the_same_matrix() {
    let dir = temp_dir("gzip");
    let plain = dir.join("sample.mtx");
    let gz = dir.join("sample.mtx.gz");
    let gz_misnamed = dir.join("sample-gz.mtx");
    let plain_misnamed = dir.join("sample-plain.mtx.gz");
    std::fs::write(&plain, SAMPLE).unwrap();
    std::fs::write(&gz, gzip(SAMPLE.as_bytes())).unwrap();
    std::fs::write(&gz_misnamed, gzip(SAMPLE.as_bytes())).unwrap();
    std::fs::write(&plain_misnamed, SAMPLE).unwrap();
    let want = read_matrix_market(&plain).unwrap();
    assert_eq!(want.nnz(), 10);
    // Decided by the magic bytes, not the extension.
    for p in [&gz, &gz_misnamed, &plain_misnamed] {
        assert_eq!(read_matrix_market(p).unwrap(), want, "{}", p.display());
    }
    let from_reader = read_matrix_market_from(&gzip(SAMPLE.as_bytes())[..], None).unwrap();
    assert_eq!(from_reader, want);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn multi_member_gzip_is_read_whole() {
    let (head, tail) = SAMPLE.split_at(SAMPLE.find("3 2 3").unwrap());
    let mut two = gzip(head.as_bytes());
    two.extend_from_slice(&gzip(tail.as_bytes()));
    let a = read_matrix_market_from(&two[..], None).unwrap();
    assert_eq!(a, mm(SAMPLE).unwrap());
}

#[test]
fn parse_errors_in_gzip_files_have_lines_and_paths() {
    let dir = temp_dir("gzip-errors");
    let path = dir.join("bad.mtx.gz");
    std::fs::write(&path, gzip(SAMPLE.replace("3 2 3", "3 9 3").as_bytes())).unwrap();
    match read_matrix_market(&path) {
        Err(Error::Parse { path: p, line, msg }) => {
            assert_eq!(p.as_deref(), Some(path.as_path()));
            assert_eq!(line, 6);
            assert!(
                msg.contains("column index 9 is out of range 1..=5"),
                "{msg}"
            );
        }
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncated_or_corrupt_gzip_is_an_error_not_a_short_matrix() {
    let dir = temp_dir("gzip-truncated");
    let mut big = String::from(PATTERN_HEADER);
    big.push_str("1000 1000 1000\n");
    for i in 1..=1000 {
        big.push_str(&format!("{i} {}\n", 1001 - i));
    }
    let gz = gzip(big.as_bytes());
    for cut in [gz.len() - 1, gz.len() - 8, gz.len() / 2, 12] {
        let path = dir.join(format!("cut-{cut}.mtx.gz"));
        std::fs::write(&path, &gz[..cut]).unwrap();
        match read_matrix_market(&path) {
            Err(Error::Io { path: p, .. }) => assert_eq!(p, path),
            other => panic!("cut at {cut}: {other:?}"),
        }
        // Without a path, the stream error is Error::Read.
        match read_matrix_market_from(&gz[..cut], None) {
            Err(Error::Read(_)) => {}
            other => panic!("cut at {cut}: {other:?}"),
        }
        match read_edge_list_from(&gz[..cut], None, EdgeListOptions::default()) {
            Err(Error::Read(_)) => {}
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
    // The magic bytes followed by garbage.
    let mut garbage = vec![0x1f, 0x8b];
    garbage.extend_from_slice(b"not really gzip at all");
    let path = dir.join("garbage.mtx.gz");
    std::fs::write(&path, &garbage).unwrap();
    let err = read_matrix_market(&path).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("gzip"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Edge lists
// ---------------------------------------------------------------------------------------------

#[test]
fn edge_list_with_comments_and_separators() {
    let text = "# Directed graph: example.txt\n\
                # FromNodeId\tToNodeId\n\
                0\t1\n\
                \n\
                1 2\n\
                % another comment style\n\
                2,0\n\
                3 , 1\n\
                0 1\n\
                4\t4\t0.5\textra\r\n";
    let a = edges(text, EdgeListOptions::default()).unwrap();
    let want = Csr::from_edges(5, 5, &[(0, 1), (1, 2), (2, 0), (3, 1), (4, 4)]).unwrap();
    assert_eq!(a, want);
    assert_eq!(a.values(), None);
}

#[test]
fn edge_list_node_count() {
    let text = "0 1\n1 2\n";
    assert_eq!(edges(text, EdgeListOptions::default()).unwrap().n_rows(), 3);
    let a = edges(text, EdgeListOptions::default().with_n(10)).unwrap();
    assert_eq!((a.n_rows(), a.n_cols(), a.nnz()), (10, 10, 2));
    assert_parse_error(
        edges("0 1\n# c\n1 10\n", EdgeListOptions::default().with_n(10)),
        3,
        "destination node 10 is out of range for n = 10",
    );
    let empty = edges("# nothing\n\n", EdgeListOptions::default()).unwrap();
    assert_eq!((empty.n_rows(), empty.nnz()), (0, 0));
    let empty = edges("", EdgeListOptions::default().with_n(4)).unwrap();
    assert_eq!((empty.n_rows(), empty.nnz()), (4, 0));
}

#[test]
fn edge_list_options() {
    // A CSV with a header, 1-based.
    let csv = "% source: somewhere\nnode_1,node_2\n1,2\n2,3\n";
    let opts = EdgeListOptions::default()
        .with_header(true)
        .with_one_based(true);
    let a = edges(csv, opts).unwrap();
    assert_eq!(a, Csr::from_edges(3, 3, &[(0, 1), (1, 2)]).unwrap());
    // Transposed: line "u v" is entry (v, u).
    let t = edges(csv, opts.with_transpose(true)).unwrap();
    assert_eq!(t, a.transpose());
    // Without the header option the header is a bad line, with its line number.
    assert_parse_error(
        edges(csv, EdgeListOptions::default()),
        2,
        "source node 'node_1' is not a non-negative integer",
    );
    // 1-based files reject 0.
    assert_parse_error(
        edges(
            "1 2\n0 1\n",
            EdgeListOptions::default().with_one_based(true),
        ),
        2,
        "source node 0 is out of range: indices are 1-based",
    );
    // A header option on a file with only comments reads an empty graph.
    let e = edges("# c\n", opts).unwrap();
    assert_eq!(e.n_rows(), 0);
}

#[test]
fn edge_list_errors() {
    let opts = EdgeListOptions::default();
    for (text, line, needle) in [
        ("0 1\n7\n", 2, "missing destination node"),
        ("0 1\n\n-1 2\n", 3, "source node '-1'"),
        ("0 1\n2 x\n", 2, "destination node 'x'"),
        ("0 1.0\n", 1, "destination node '1.0'"),
        (
            "0 4294967295\n",
            1,
            "destination node 4294967295 exceeds the limit",
        ),
        (
            "0 99999999999999999999999\n",
            1,
            "is not a non-negative integer",
        ),
    ] {
        assert_parse_error(edges(text, opts), line, needle);
    }
    match edges("0 1\n", opts.with_n(usize::MAX)) {
        Err(Error::DimensionTooLarge { what: "n", .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn edge_list_files_plain_and_gzip() {
    let dir = temp_dir("edges");
    let text = "# c\n0 1\n1 0\n2 1\n";
    let plain = dir.join("e.txt");
    let gz = dir.join("e.txt.gz");
    std::fs::write(&plain, text).unwrap();
    std::fs::write(&gz, gzip(text.as_bytes())).unwrap();
    let a = read_edge_list(&plain).unwrap();
    assert_eq!(a, Csr::from_edges(3, 3, &[(0, 1), (1, 0), (2, 1)]).unwrap());
    assert_eq!(read_edge_list(&gz).unwrap(), a);
    let b = read_edge_list_with(&gz, EdgeListOptions::default().with_n(5)).unwrap();
    assert_eq!(b.n_rows(), 5);
    std::fs::write(&plain, "0 1\n1 -2\n").unwrap();
    match read_edge_list(&plain) {
        Err(Error::Parse { path, line: 2, .. }) => assert_eq!(path, Some(plain.clone())),
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Hostile sizes and encodings
// ---------------------------------------------------------------------------------------------

/// Asserts an out-of-memory error naming a buffer and a byte count, not an abort.
#[track_caller]
fn assert_out_of_memory(result: Result<Csr, Error>) {
    match result {
        Err(e @ Error::OutOfMemory { .. }) => {
            let msg = e.to_string();
            assert!(msg.starts_with("cannot allocate "), "{msg}");
            assert!(msg.contains(" bytes"), "{msg}");
            assert!(!msg.contains('\n'), "{msg}");
        }
        other => panic!("expected an out-of-memory error, got {other:?}"),
    }
}

#[test]
fn a_size_line_of_four_billion_rows_is_an_error_not_an_abort() {
    // Two entries, but a size line that makes the row offsets alone 16 GiB (the working set of
    // the CSR build is 8x that, more than any test machine has available).
    let text = format!("{PATTERN_HEADER}4294967294 4294967294 2\n1 2\n3 4\n");
    assert_out_of_memory(mm(&text));
}

#[test]
fn an_edge_list_with_a_four_billion_index_is_an_error_not_an_abort() {
    // The 17-byte input: the largest index makes n = 4294967294.
    assert_out_of_memory(edges("0 1\n4294967293 1", EdgeListOptions::default()));
    // One past the 32-bit limit is a parse error.
    assert!(edges("0 4294967295\n", EdgeListOptions::default()).is_err());
}

#[test]
fn a_utf8_byte_order_mark_is_skipped() {
    let text = format!("\u{feff}{PATTERN_HEADER}2 2 1\n1 2\n");
    let a = mm(&text).unwrap();
    assert_eq!((a.n_rows(), a.nnz(), a.row(0)), (2, 1, &[1u32][..]));
    let a = edges("\u{feff}# SNAP\n0 1\n", EdgeListOptions::default()).unwrap();
    assert_eq!((a.n_rows(), a.nnz()), (2, 1));
    // Gzip'd, too: the mark is inside the compressed text.
    let dir = temp_dir("bom");
    let path = dir.join("bom.mtx.gz");
    std::fs::write(&path, gzip(text.as_bytes())).unwrap();
    assert_eq!(read_matrix_market(&path).unwrap().nnz(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Real graphs
// ---------------------------------------------------------------------------------------------

#[test]
fn bundled_cora() {
    let path = spattn_test_support::cora_path();
    let a = read_matrix_market(&path).unwrap();
    assert_eq!((a.n_rows(), a.n_cols(), a.nnz()), (2708, 2708, 10556));
    assert_eq!(a.values(), None);
    let s = a.degree_stats();
    assert_eq!((s.max, s.min, s.empty_rows), (168, 1, 0));
    assert_eq!(a.transpose(), a, "cora is stored symmetric");
    assert!((0..a.n_rows()).all(|i| a.row(i).binary_search(&(i as u32)).is_err()));
    assert_eq!(a.symmetrize_with_self_loops().unwrap().nnz(), 13264);
}

/// The numbers of one graph in `graphs.json`.
#[derive(Debug)]
struct GraphStats {
    name: String,
    n: usize,
    nnz: usize,
    max_row_nnz: usize,
    empty_rows: usize,
    nnz_sym_plus_selfloops: usize,
}

/// Reads the few numbers needed from `graphs.json`: a flat object of flat objects.
fn parse_graphs_json(text: &str) -> Vec<GraphStats> {
    fn number(obj: &str, key: &str) -> usize {
        let pat = format!("\"{key}\":");
        let at = obj
            .find(&pat)
            .unwrap_or_else(|| panic!("no {key} in {obj}"));
        let rest = obj[at + pat.len()..].trim_start();
        let end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        rest[..end].parse().unwrap()
    }
    let mut out = Vec::new();
    let body = text.trim().trim_start_matches('{');
    let mut rest = body;
    while let Some(q) = rest.find('"') {
        let after = &rest[q + 1..];
        let name_end = after.find('"').unwrap();
        let name = &after[..name_end];
        let open = after.find('{').unwrap();
        let close = after[open..].find('}').unwrap() + open;
        let obj = &after[open..=close];
        out.push(GraphStats {
            name: name.to_string(),
            n: number(obj, "n"),
            nnz: number(obj, "nnz"),
            max_row_nnz: number(obj, "max_row_nnz"),
            empty_rows: number(obj, "empty_rows"),
            nnz_sym_plus_selfloops: number(obj, "nnz_sym_plus_selfloops"),
        });
        rest = &after[close + 1..];
    }
    out
}

#[test]
fn shared_graphs_match_graphs_json() {
    let Some(data) = spattn_test_support::shared_data_root() else {
        println!("note: ../shared/data/graphs.json not found; skipping the shared-graph check");
        return;
    };
    let json = data.join("graphs.json");
    let graphs = parse_graphs_json(&std::fs::read_to_string(&json).unwrap());
    assert_eq!(graphs.len(), 10, "{graphs:?}");
    for g in &graphs {
        let t = std::time::Instant::now();
        let path = data.join("mtx").join(format!("{}.mtx.gz", g.name));
        let a = read_matrix_market(&path).unwrap();
        assert_eq!(
            (a.n_rows(), a.n_cols(), a.nnz()),
            (g.n, g.n, g.nnz),
            "{}",
            g.name
        );
        let s = a.degree_stats();
        assert_eq!(s.max, g.max_row_nnz, "{}", g.name);
        assert_eq!(s.empty_rows, g.empty_rows, "{}", g.name);
        let sym = a.symmetrize_with_self_loops().unwrap();
        assert_eq!(sym.nnz(), g.nnz_sym_plus_selfloops, "{}", g.name);
        println!(
            "{:>20}: n {:>7} nnz {:>8} max row {:>5} sym+I {:>8}  ({:.0} ms)",
            g.name,
            g.n,
            g.nnz,
            s.max,
            sym.nnz(),
            t.elapsed().as_secs_f64() * 1e3
        );
    }
}

#[test]
fn graphs_json_parser() {
    let text = r#"{
 "a": {"n": 3, "nnz": 4, "max_row_nnz": 2, "empty_rows": 1, "x": "y",
       "nnz_sym_plus_selfloops": 9},
 "b-c": {"nnz_sym_plus_selfloops": 1, "n": 1, "nnz": 0, "max_row_nnz": 0, "empty_rows": 1}
}"#;
    let g = parse_graphs_json(text);
    assert_eq!(g.len(), 2);
    assert_eq!((g[0].name.as_str(), g[0].n, g[0].nnz), ("a", 3, 4));
    assert_eq!(g[0].nnz_sym_plus_selfloops, 9);
    assert_eq!((g[1].name.as_str(), g[1].n, g[1].empty_rows), ("b-c", 1, 1));
}

// ---------------------------------------------------------------------------------------------
// No input panics
// ---------------------------------------------------------------------------------------------

/// Text from the characters that matter to the parsers.
fn noisy_text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop::sample::select(
            &[
                '0', '1', '2', '3', '9', ' ', '\t', '\n', '\n', '%', '#', '-', '.', 'e', ',', '\r',
            ][..],
        ),
        0..200,
    )
    .prop_map(|v| v.into_iter().collect())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = read_matrix_market_from(&bytes[..], None);
        let _ = read_edge_list_from(&bytes[..], None, EdgeListOptions::default());
        let mut gz_magic = vec![0x1f, 0x8b];
        gz_magic.extend_from_slice(&bytes);
        prop_assert!(read_matrix_market_from(&gz_magic[..], None).is_err());
    }

    #[test]
    fn noisy_files_never_panic(body in noisy_text(), banner in 0usize..4) {
        let banner = [
            "%%MatrixMarket matrix coordinate pattern general\n",
            "%%MatrixMarket matrix coordinate real symmetric\n",
            "%%MatrixMarket matrix coordinate integer general\n3 3 2\n",
            "",
        ][banner];
        let text = format!("{banner}{body}");
        if let Ok(a) = mm(&text) {
            // Whatever parsed is a valid matrix.
            let (r, c, o, i, v) = a.into_parts();
            prop_assert!(Csr::try_new(r, c, o, i, v).is_ok());
        }
        let opts = EdgeListOptions::default();
        for o in [opts, opts.with_n(5), opts.with_header(true).with_one_based(true)] {
            if let Ok(a) = edges(&body, o) {
                let (r, c, off, i, v) = a.into_parts();
                prop_assert!(Csr::try_new(r, c, off, i, v).is_ok());
            }
        }
    }

    #[test]
    fn gzip_and_plain_agree_on_any_text(body in noisy_text()) {
        let text = format!("{PATTERN_HEADER}{body}");
        let plain = mm(&text).map_err(|e| e.to_string());
        let gz = read_matrix_market_from(&gzip(text.as_bytes())[..], Some(Path::new(NAME)))
            .map_err(|e| e.to_string());
        prop_assert_eq!(plain, gz);
        let plain = edges(&body, EdgeListOptions::default()).map_err(|e| e.to_string());
        let gz = read_edge_list_from(&gzip(body.as_bytes())[..], Some(Path::new(NAME)), EdgeListOptions::default())
            .map_err(|e| e.to_string());
        prop_assert_eq!(plain, gz);
    }
}

/// A random matrix (values or not) as its entries in a random order, duplicates allowed.
fn random_entries() -> impl Strategy<Value = (usize, usize, Vec<(u32, u32, f32)>, bool)> {
    (1usize..30, 1usize..30, any::<bool>()).prop_flat_map(|(n_rows, n_cols, with_values)| {
        let entry = (0..n_rows as u32, 0..n_cols as u32, -1000i32..1000)
            .prop_map(|(r, c, v)| (r, c, v as f32 / 8.0));
        prop::collection::vec(entry, 0..80).prop_map(move |e| (n_rows, n_cols, e, with_values))
    })
}

proptest! {
    #[test]
    fn written_matrix_market_reads_back((n_rows, n_cols, entries, with_values) in random_entries(), crlf in any::<bool>()) {
        let nl = if crlf { "\r\n" } else { "\n" };
        let field = if with_values { "real" } else { "pattern" };
        let mut text = format!("%%MatrixMarket matrix coordinate {field} general{nl}% random{nl}{n_rows} {n_cols} {}{nl}", entries.len());
        for (k, &(r, c, v)) in entries.iter().enumerate() {
            if with_values {
                text.push_str(&format!("{} {} {v}{nl}", r + 1, c + 1));
            } else {
                text.push_str(&format!("{}\t{}{nl}", r + 1, c + 1));
            }
            if k % 7 == 3 {
                text.push_str(&format!("% comment{nl}{nl}"));
            }
        }
        let rows: Vec<u32> = entries.iter().map(|e| e.0).collect();
        let cols: Vec<u32> = entries.iter().map(|e| e.1).collect();
        let vals: Vec<f32> = entries.iter().map(|e| e.2).collect();
        let want = Csr::from_unsorted(n_rows, n_cols, &rows, &cols, with_values.then_some(&vals[..])).unwrap();
        prop_assert_eq!(&mm(&text).unwrap(), &want);
        prop_assert_eq!(&read_matrix_market_from(&gzip(text.as_bytes())[..], None).unwrap(), &want);

        // The same entries as an edge list, with the node count fixed.
        let n = n_rows.max(n_cols);
        let mut list = String::from("# FromNodeId ToNodeId\n");
        for &(r, c, v) in &entries {
            list.push_str(&format!("{r},{c},{v}{nl}"));
        }
        let want = Csr::from_unsorted(n, n, &rows, &cols, None).unwrap();
        prop_assert_eq!(&edges(&list, EdgeListOptions::default().with_n(n)).unwrap(), &want);
    }
}
