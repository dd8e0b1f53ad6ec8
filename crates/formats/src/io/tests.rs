//! Chunking is invisible from the public API (1 MiB chunks): these tests parse with tiny
//! chunks, so that every line boundary is a chunk boundary somewhere, and check that the
//! matrix and the reported line numbers do not depend on the chunk size.
use super::*;

fn mm_with_chunks(text: &str, chunk: usize) -> Result<Csr> {
    parse_matrix_market(text.as_bytes(), None, chunk)
}

fn parse_line_of(r: Result<Csr>) -> (usize, String) {
    match r {
        Err(Error::Parse { line, msg, .. }) => (line, msg),
        other => panic!("expected a parse error, got {other:?}"),
    }
}

const GOOD: &str = "%%MatrixMarket matrix coordinate real symmetric\n\
                    % comment\n\
                    \n\
                    5 5 6\n\
                    1 1 1.0\n\
                    2 1 2.5\n\
                    % a comment inside the body\n\
                    \n\
                    3 2 -1e-3\n\
                    5 4 4\n\
                    5 5 7\r\n\
                    4 1 0.5";

#[test]
fn chunk_size_does_not_change_the_matrix() {
    let want = mm_with_chunks(GOOD, CHUNK_BYTES).unwrap();
    assert_eq!(want.nnz(), 10); // 2 diagonal + 4 mirrored pairs
    for chunk in 1..40 {
        assert_eq!(mm_with_chunks(GOOD, chunk).unwrap(), want, "chunk {chunk}");
    }
}

#[test]
fn chunk_size_does_not_change_error_lines() {
    // (text, expected line)
    let base: Vec<&str> = GOOD.lines().collect();
    for bad_line in [5usize, 6, 9, 10, 11, 12] {
        let mut lines = base.clone();
        lines[bad_line - 1] = "1 x 1.0";
        let text = lines.join("\n");
        for chunk in 1..40 {
            let (line, msg) = parse_line_of(mm_with_chunks(&text, chunk));
            assert_eq!(line, bad_line, "chunk {chunk}: {msg}");
            assert!(msg.contains("column index 'x'"), "{msg}");
        }
    }
}

#[test]
fn too_many_and_too_few_lines_with_any_chunking() {
    let too_many = GOOD.replace("5 5 6\n", "5 5 4\n");
    let too_few = GOOD.replace("5 5 6\n", "5 5 9\n");
    for chunk in 1..40 {
        let (line, msg) = parse_line_of(mm_with_chunks(&too_many, chunk));
        assert_eq!(line, 11, "chunk {chunk}: {msg}");
        assert!(msg.contains("too many entries"), "{msg}");
        let (line, msg) = parse_line_of(mm_with_chunks(&too_few, chunk));
        assert_eq!(line, 13, "chunk {chunk}: {msg}");
        assert!(msg.contains("after 6 of the 9 entries"), "{msg}");
    }
}

#[test]
fn edge_list_with_any_chunking() {
    let text = "# c\n0 1\n\n1,2\n% c\n2 0 9\n3\t3";
    let want = parse_edge_list(text.as_bytes(), None, EdgeListOptions::default(), 1 << 20).unwrap();
    assert_eq!((want.n_rows(), want.nnz()), (4, 4));
    let bad = text.replace("2 0 9", "2 -1");
    for chunk in 1..30 {
        let got =
            parse_edge_list(text.as_bytes(), None, EdgeListOptions::default(), chunk).unwrap();
        assert_eq!(got, want);
        let (line, msg) = parse_line_of(parse_edge_list(
            bad.as_bytes(),
            None,
            EdgeListOptions::default(),
            chunk,
        ));
        assert_eq!(line, 6, "{msg}");
    }
}

#[test]
fn split_chunks_covers_everything() {
    let text = b"ab\ncd\n\nefg\nh";
    for t in 0..20 {
        let chunks = split_chunks(text, t);
        assert_eq!(chunks.concat(), text.to_vec());
        for c in &chunks[..chunks.len() - 1] {
            assert_eq!(c.last(), Some(&b'\n'));
        }
    }
    assert!(split_chunks(b"", 4).is_empty());
}

#[test]
fn numbers() {
    assert_eq!(parse_u64(b"0"), Some(0));
    assert_eq!(parse_u64(b"18446744073709551615"), Some(u64::MAX));
    assert_eq!(parse_u64(b"18446744073709551616"), None);
    assert_eq!(parse_u64(b"-1"), None);
    assert_eq!(parse_u64(b"+1"), None);
    assert_eq!(parse_u64(b"1.0"), None);
    assert_eq!(parse_u64(b""), None);
    assert_eq!(parse_real(b"1e-3"), Ok(1e-3));
    assert!(parse_real(b"1e39").unwrap_err().contains("overflows"));
    assert_eq!(parse_real(b"-inf"), Ok(f32::NEG_INFINITY));
    assert!(parse_real(b"nan").unwrap().is_nan());
    assert!(parse_real(b"1,5").is_err());
    assert!(parse_real(b"\xff").is_err());
    assert_eq!(parse_integer_value(b"-12"), Ok(-12.0));
    assert!(parse_integer_value(b"1.5").is_err());
}
