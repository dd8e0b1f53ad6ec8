//! Readers for MatrixMarket coordinate files and SNAP-style edge lists, plain or gzip'd.
//!
//! Both readers load the whole (decompressed) file into one buffer, split it into chunks of
//! whole lines and parse the chunks in parallel by hand (no per-token `String`), then build the
//! [`Csr`] with [`Csr::from_unsorted`], which sorts rows and merges duplicates.
//!
//! Nothing here panics on any input, and nothing is dropped silently: every malformed line is an
//! [`Error::Parse`] naming its 1-based line number and what is wrong with it, a file that ends
//! before its promised entries (or has more) is an error, and a truncated gzip stream is an I/O
//! error. Whether a file is gzip'd is decided by its first two bytes (`1f 8b`), not its name.

use std::io::{BufRead, Read};
use std::path::Path;

use flate2::read::MultiGzDecoder;
use rayon::prelude::*;

use crate::csr::{Csr, MAX_DIM, MAX_NNZ};
use crate::error::{Error, Result};

mod lex;
use lex::{
    classify, concat, count_lines, next_line, nth_content_line, parse_chunk, parse_error,
    parse_integer_value, parse_real, parse_u64, quote, split_chunks, strip_bom, ChunkResult,
    Fields, LineKind, Separators,
};

/// The first two bytes of every gzip member.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Target size of the chunks parsed in parallel: large enough that per-chunk overhead vanishes,
/// small enough that a 2-core machine gets several chunks from a few-MB file.
const CHUNK_BYTES: usize = 1 << 20;

// ---------------------------------------------------------------------------------------------
// Loading bytes
// ---------------------------------------------------------------------------------------------

fn io_error(path: Option<&Path>, source: std::io::Error) -> Error {
    match path {
        Some(p) => Error::Io {
            path: p.to_path_buf(),
            source,
        },
        None => Error::Read(source),
    }
}

/// Reads a whole file, decompressing it if it starts with the gzip magic bytes.
fn load_path(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).map_err(|e| io_error(Some(path), e))?;
    decompress_if_gzip(raw, Some(path))
}

/// Reads a whole stream, decompressing it if it starts with the gzip magic bytes.
fn load_reader<R: Read>(mut reader: R, path: Option<&Path>) -> Result<Vec<u8>> {
    let mut raw = Vec::new();
    reader
        .read_to_end(&mut raw)
        .map_err(|e| io_error(path, e))?;
    decompress_if_gzip(raw, path)
}

fn decompress_if_gzip(raw: Vec<u8>, path: Option<&Path>) -> Result<Vec<u8>> {
    if !raw.starts_with(&GZIP_MAGIC) {
        return Ok(raw);
    }
    // The gzip trailer holds the uncompressed size of the last member modulo 2^32: a good
    // capacity hint for the usual single-member file. It is only a hint (it could lie), so it is
    // capped at a ratio deflate can reach on text.
    let hint = raw
        .len()
        .checked_sub(4)
        .and_then(|s| raw.get(s..))
        .and_then(|t| <[u8; 4]>::try_from(t).ok())
        .map_or(0, |t| u32::from_le_bytes(t) as usize)
        .min(raw.len().saturating_mul(64));
    let mut out = Vec::with_capacity(hint);
    MultiGzDecoder::new(raw.as_slice())
        .read_to_end(&mut out)
        .map_err(|e| {
            io_error(
                path,
                std::io::Error::new(e.kind(), format!("decompressing gzip data: {e}")),
            )
        })?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// MatrixMarket
// ---------------------------------------------------------------------------------------------

/// The value field of a MatrixMarket coordinate file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    Pattern,
    Real,
    Integer,
}

/// The symmetry of a MatrixMarket file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Symmetry {
    General,
    Symmetric,
}

/// Parses the banner `%%MatrixMarket matrix coordinate <field> <symmetry>`.
fn parse_banner(line: &[u8], path: Option<&Path>) -> Result<(Field, Symmetry)> {
    let bad = |msg: String| parse_error(path, 1, msg);
    let words: Vec<&[u8]> = Fields::new(line, Separators::Whitespace).collect();
    if words.first().map(|w| w.to_ascii_lowercase()) != Some(b"%%matrixmarket".to_vec()) {
        return Err(bad(format!(
            "bad banner: expected '%%MatrixMarket matrix coordinate <field> <symmetry>', found {}",
            quote(line)
        )));
    }
    if words.len() != 5 {
        return Err(bad(format!(
            "bad banner: expected 5 words '%%MatrixMarket matrix coordinate <field> <symmetry>', found {}",
            words.len()
        )));
    }
    let lower: Vec<Vec<u8>> = words.iter().map(|w| w.to_ascii_lowercase()).collect();
    match lower[1].as_slice() {
        b"matrix" => {}
        b"vector" => {
            return Err(bad(
                "unsupported object 'vector': only 'matrix' is read".into()
            ))
        }
        _ => {
            return Err(bad(format!(
                "bad banner: unknown object {}",
                quote(words[1])
            )))
        }
    }
    match lower[2].as_slice() {
        b"coordinate" => {}
        b"array" => {
            return Err(bad(
                "unsupported format 'array' (dense): only 'coordinate' is read".into(),
            ))
        }
        _ => {
            return Err(bad(format!(
                "bad banner: unknown format {}",
                quote(words[2])
            )))
        }
    }
    let field = match lower[3].as_slice() {
        b"pattern" => Field::Pattern,
        b"real" | b"double" => Field::Real,
        b"integer" => Field::Integer,
        b"complex" => {
            return Err(bad(
                "unsupported field 'complex': only pattern, real and integer are read".into(),
            ))
        }
        _ => {
            return Err(bad(format!(
                "bad banner: unknown field {}",
                quote(words[3])
            )))
        }
    };
    let symmetry = match lower[4].as_slice() {
        b"general" => Symmetry::General,
        b"symmetric" => Symmetry::Symmetric,
        b"skew-symmetric" | b"hermitian" => {
            return Err(bad(format!(
                "unsupported symmetry {}: only general and symmetric are read",
                quote(words[4])
            )))
        }
        _ => {
            return Err(bad(format!(
                "bad banner: unknown symmetry {}",
                quote(words[4])
            )))
        }
    };
    Ok((field, symmetry))
}

/// The size line `rows cols nnz`.
struct Size {
    n_rows: usize,
    n_cols: usize,
    nnz: usize,
}

fn parse_size_line(line: &[u8], lineno: usize, path: Option<&Path>) -> Result<Size> {
    let bad = |msg: String| parse_error(path, lineno, msg);
    let words: Vec<&[u8]> = Fields::new(line, Separators::Whitespace).collect();
    if words.len() != 3 {
        return Err(bad(format!(
            "bad size line: expected 'rows cols entries', found {} field{}",
            words.len(),
            if words.len() == 1 { "" } else { "s" }
        )));
    }
    let mut nums = [0u64; 3];
    for (k, (w, name)) in words.iter().zip(["rows", "cols", "entries"]).enumerate() {
        nums[k] = parse_u64(w).ok_or_else(|| {
            bad(format!(
                "bad size line: {name} {} is not a non-negative integer",
                quote(w)
            ))
        })?;
    }
    for (v, name) in nums[..2].iter().zip(["rows", "cols"]) {
        if *v > MAX_DIM {
            return Err(bad(format!(
                "bad size line: {name} = {v} exceeds the limit of {MAX_DIM} (32-bit indices)"
            )));
        }
    }
    if nums[2] > MAX_NNZ {
        return Err(bad(format!(
            "bad size line: {} entries exceed the limit of {MAX_NNZ} (32-bit row offsets)",
            nums[2]
        )));
    }
    // All three fit u32, hence usize on every supported target.
    Ok(Size {
        n_rows: nums[0] as usize,
        n_cols: nums[1] as usize,
        nnz: nums[2] as usize,
    })
}

/// Entries parsed from one chunk of a MatrixMarket body.
#[derive(Default)]
struct Triplets {
    rows: Vec<u32>,
    cols: Vec<u32>,
    vals: Vec<f32>,
}

/// Parses one entry line `row col [value]` (1-based indices).
#[inline]
fn parse_mm_entry(
    out: &mut Triplets,
    line: &[u8],
    size: &Size,
    field: Field,
    symmetry: Symmetry,
) -> std::result::Result<(), String> {
    let mut fields = Fields::new(line, Separators::Whitespace);
    let mut index = |name: &str, limit: usize| -> std::result::Result<u32, String> {
        let tok = fields
            .next()
            .ok_or_else(|| format!("missing {name} index"))?;
        let v = parse_u64(tok)
            .ok_or_else(|| format!("{name} index {} is not a positive integer", quote(tok)))?;
        if v == 0 {
            return Err(format!(
                "{name} index 0 is out of range: MatrixMarket indices are 1-based"
            ));
        }
        if v > limit as u64 {
            return Err(format!("{name} index {v} is out of range 1..={limit}"));
        }
        // v - 1 < limit <= MAX_DIM < 2^32.
        Ok((v - 1) as u32)
    };
    let r = index("row", size.n_rows)?;
    let c = index("column", size.n_cols)?;
    let value = match field {
        Field::Pattern => None,
        Field::Real | Field::Integer => {
            let tok = fields.next().ok_or_else(|| {
                format!(
                    "missing value (field is {})",
                    if field == Field::Real {
                        "real"
                    } else {
                        "integer"
                    }
                )
            })?;
            Some(if field == Field::Real {
                parse_real(tok)?
            } else {
                parse_integer_value(tok)?
            })
        }
    };
    if let Some(extra) = fields.next() {
        let expected = if field == Field::Pattern { 2 } else { 3 };
        return Err(format!(
            "unexpected extra field {} (an entry has {expected} fields)",
            quote(extra)
        ));
    }
    out.rows.push(r);
    out.cols.push(c);
    if let Some(v) = value {
        out.vals.push(v);
    }
    if symmetry == Symmetry::Symmetric && r != c {
        out.rows.push(c);
        out.cols.push(r);
        if let Some(v) = value {
            out.vals.push(v);
        }
    }
    Ok(())
}

/// Reads a MatrixMarket coordinate file (plain or gzip'd) into a [`Csr`].
///
/// Supported: object `matrix`, format `coordinate`, field `pattern`, `real` (or `double`) or
/// `integer`, symmetry `general` or `symmetric`. A symmetric file's off-diagonal entries are
/// mirrored (whichever triangle they are in, as scipy does: a file that lists both `(i, j)` and
/// `(j, i)` gets their values summed). Real and integer values become f32 values; a pattern file gives a [`Csr`] with no
/// values. Duplicate entries are merged, their values summed. `%` comment lines and blank lines
/// are skipped wherever they appear.
///
/// Gzip is detected from the file's first two bytes, whatever its name.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read or its gzip stream is corrupt or truncated;
/// [`Error::Parse`] with the 1-based line number for a bad banner, an unsupported format
/// (`array`, `complex`, `hermitian`, `skew-symmetric`), a bad size line, a non-square symmetric
/// matrix, an index that is not an integer or is outside `1..=n`, a missing or malformed value,
/// an extra field, and a file with fewer or more entries than its size line promises.
///
/// # Example
/// ```
/// let path = std::env::temp_dir().join(format!("spattn-doc-mm-{}.mtx", std::process::id()));
/// std::fs::write(
///     &path,
///     "%%MatrixMarket matrix coordinate pattern symmetric\n% a path 1-2-3\n3 3 2\n2 1\n3 2\n",
/// )?;
/// let a = spattn_formats::read_matrix_market(&path)?;
/// assert_eq!((a.n_rows(), a.nnz()), (3, 4)); // both directions of each edge
/// assert_eq!(a.row(1), &[0, 2]);
/// # std::fs::remove_file(&path)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn read_matrix_market(path: impl AsRef<Path>) -> Result<Csr> {
    let path = path.as_ref();
    let bytes = load_path(path)?;
    parse_matrix_market(&bytes, Some(path), CHUNK_BYTES)
}

/// Reads a MatrixMarket coordinate file from a stream (plain or gzip'd, detected from its first
/// two bytes); see [`read_matrix_market`] for what is accepted.
///
/// `path_for_messages` only names the source in errors: with `Some`, I/O failures are
/// [`Error::Io`] and parse errors carry the path; with `None`, I/O failures are
/// [`Error::Read`].
///
/// ```
/// use spattn_formats::io::read_matrix_market_from;
/// let text = "%%MatrixMarket matrix coordinate real general\n2 3 3\n1 3 0.5\n2 1 -1\n1 3 0.25\n";
/// let a = read_matrix_market_from(text.as_bytes(), None)?;
/// assert_eq!((a.n_rows(), a.n_cols(), a.nnz()), (2, 3, 2)); // the duplicate (1, 3) merged
/// assert_eq!(a.row(0), &[2]);
/// assert_eq!(a.values(), Some(&[0.75, -1.0][..])); // duplicates summed
///
/// let bad = "%%MatrixMarket matrix coordinate pattern general\n2 2 2\n1 1\n3 1\n";
/// match read_matrix_market_from(bad.as_bytes(), None) {
///     Err(spattn_formats::Error::Parse { line, msg, .. }) => {
///         assert_eq!(line, 4);
///         assert!(msg.contains("row index 3 is out of range 1..=2"), "{msg}");
///     }
///     other => panic!("expected a parse error, got {other:?}"),
/// }
/// # Ok::<(), spattn_formats::Error>(())
/// ```
pub fn read_matrix_market_from<R: BufRead>(
    reader: R,
    path_for_messages: Option<&Path>,
) -> Result<Csr> {
    let bytes = load_reader(reader, path_for_messages)?;
    parse_matrix_market(&bytes, path_for_messages, CHUNK_BYTES)
}

/// Parses a whole decompressed MatrixMarket file, in chunks of about `chunk_bytes`.
fn parse_matrix_market(bytes: &[u8], path: Option<&Path>, chunk_bytes: usize) -> Result<Csr> {
    let bytes = strip_bom(bytes);
    // Header: banner, comments, size line, read line by line.
    let (banner, mut rest) =
        next_line(bytes).ok_or_else(|| parse_error(path, 1, "empty file: missing banner"))?;
    let (field, symmetry) = parse_banner(banner, path)?;
    let mut lineno = 1usize;
    let size = loop {
        lineno += 1;
        let Some((line, tail)) = next_line(rest) else {
            return Err(parse_error(
                path,
                lineno,
                "file ends before the size line 'rows cols entries'",
            ));
        };
        rest = tail;
        if classify(line, Separators::Whitespace, b"%") == LineKind::Content {
            break parse_size_line(line, lineno, path)?;
        }
    };
    let size_line = lineno;
    if symmetry == Symmetry::Symmetric && size.n_rows != size.n_cols {
        return Err(parse_error(
            path,
            size_line,
            format!(
                "a symmetric matrix must be square, the size line gives {} x {}",
                size.n_rows, size.n_cols
            ),
        ));
    }

    // Body: entry lines, in parallel chunks.
    let body = rest;
    let chunks = split_chunks(body, chunk_bytes);
    let results: Vec<ChunkResult<Triplets>> = chunks
        .par_iter()
        .map(|chunk| {
            // Entry lines are rarely shorter than 4 bytes ("1 1\n").
            let cap = chunk.len() / 8;
            let mirror = if symmetry == Symmetry::Symmetric {
                2
            } else {
                1
            };
            let data = Triplets {
                rows: Vec::with_capacity(cap * mirror),
                cols: Vec::with_capacity(cap * mirror),
                vals: Vec::with_capacity(if field == Field::Pattern {
                    0
                } else {
                    cap * mirror
                }),
            };
            parse_chunk(chunk, Separators::Whitespace, b"%", data, |out, line| {
                parse_mm_entry(out, line, &size, field, symmetry)
            })
        })
        .collect();

    // In file order: the first problem wins, be it a bad line or one entry too many.
    let mut seen = 0usize;
    let mut first_line = size_line + 1; // 1-based line number of the chunk's first line
    for (chunk, res) in chunks.iter().zip(&results) {
        if seen + res.entries > size.nnz {
            let k = size.nnz - seen;
            let local = nth_content_line(chunk, Separators::Whitespace, b"%", k).unwrap_or(0);
            return Err(parse_error(
                path,
                first_line + local,
                format!(
                    "too many entries: the size line (line {size_line}) promises {}",
                    size.nnz
                ),
            ));
        }
        if let Some((local, msg)) = &res.error {
            return Err(parse_error(path, first_line + local, msg.clone()));
        }
        seen += res.entries;
        first_line += count_lines(chunk);
    }
    if seen < size.nnz {
        return Err(parse_error(
            path,
            first_line,
            format!(
                "too few entries: the file ends after {seen} of the {} entries the size line (line {size_line}) promises",
                size.nnz
            ),
        ));
    }

    let mut results = results;
    let rows = concat(results.iter_mut().map(|r| std::mem::take(&mut r.data.rows)));
    let cols = concat(results.iter_mut().map(|r| std::mem::take(&mut r.data.cols)));
    let vals = (field != Field::Pattern)
        .then(|| concat(results.iter_mut().map(|r| std::mem::take(&mut r.data.vals))));
    drop(results);
    Csr::from_unsorted(size.n_rows, size.n_cols, &rows, &cols, vals.as_deref())
}

// ---------------------------------------------------------------------------------------------
// Edge lists
// ---------------------------------------------------------------------------------------------

/// Options of [`read_edge_list_with`]. The default reads a SNAP-style list of 0-based
/// `src dst` pairs into a square matrix of `max index + 1` nodes, row `src` holding column
/// `dst`.
///
/// ```
/// use spattn_formats::EdgeListOptions;
/// let opts = EdgeListOptions::default().with_n(100).with_one_based(true);
/// assert_eq!(opts.n, Some(100));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EdgeListOptions {
    /// Number of nodes. `None`: the largest index + 1. `Some(n)`: an index `>= n` is an error,
    /// and nodes with no edges past the largest index are kept.
    pub n: Option<usize>,
    /// Indices start at 1 (index 0 is then an error). Default: 0-based, as SNAP writes them.
    pub one_based: bool,
    /// The first content line (not blank, not a comment) is a header such as `id_1,id_2` and is
    /// skipped.
    pub header: bool,
    /// Store line `u v` as entry `(v, u)` instead of `(u, v)`: row `v` then lists `u`, as when
    /// each line is a message edge `src → dst` and node `dst` attends to its in-neighbour `src`
    /// (PyG's `edge_index` convention). Default: row = first column, as in MatrixMarket.
    pub transpose: bool,
}

impl EdgeListOptions {
    /// Fixes the number of nodes.
    pub fn with_n(mut self, n: usize) -> Self {
        self.n = Some(n);
        self
    }
    /// Sets whether indices are 1-based.
    pub fn with_one_based(mut self, one_based: bool) -> Self {
        self.one_based = one_based;
        self
    }
    /// Sets whether the first content line is a header to skip.
    pub fn with_header(mut self, header: bool) -> Self {
        self.header = header;
        self
    }
    /// Sets whether line `u v` becomes entry `(v, u)`.
    pub fn with_transpose(mut self, transpose: bool) -> Self {
        self.transpose = transpose;
        self
    }
}

/// Edges parsed from one chunk of an edge list.
#[derive(Default)]
struct EdgeChunk {
    src: Vec<u32>,
    dst: Vec<u32>,
    /// Largest node index seen (after the 1-based shift), if any.
    max: Option<u32>,
}

#[inline]
fn parse_edge_line(
    out: &mut EdgeChunk,
    line: &[u8],
    opts: &EdgeListOptions,
) -> std::result::Result<(), String> {
    let mut fields = Fields::new(line, Separators::WhitespaceOrComma);
    let limit = opts.n.map_or(MAX_DIM, |n| n as u64);
    let mut node = |name: &str| -> std::result::Result<u32, String> {
        let tok = fields.next().ok_or_else(|| {
            format!("missing {name} node: expected 'src dst' (separated by whitespace or a comma)")
        })?;
        let base = u64::from(opts.one_based);
        let v = parse_u64(tok).ok_or_else(|| {
            format!(
                "{name} node {} is not a {} integer",
                quote(tok),
                if opts.one_based {
                    "positive"
                } else {
                    "non-negative"
                }
            )
        })?;
        if v < base {
            return Err(format!(
                "{name} node 0 is out of range: indices are 1-based"
            ));
        }
        let i = v - base;
        if i >= limit {
            return Err(match opts.n {
                Some(n) => format!(
                    "{name} node {v} is out of range for n = {n} ({}-based indices)",
                    base
                ),
                None => format!(
                    "{name} node {v} exceeds the limit of {} nodes (32-bit indices)",
                    MAX_DIM
                ),
            });
        }
        // i < limit <= MAX_DIM < 2^32.
        Ok(i as u32)
    };
    let u = node("source")?;
    let v = node("destination")?;
    // Further fields (weights, timestamps) are ignored.
    let (r, c) = if opts.transpose { (v, u) } else { (u, v) };
    out.src.push(r);
    out.dst.push(c);
    let m = u.max(v);
    out.max = Some(out.max.map_or(m, |x| x.max(m)));
    Ok(())
}

/// Reads a SNAP-style edge list (plain or gzip'd) into a square [`Csr`] with
/// `n = largest index + 1`: the defaults of [`read_edge_list_with`].
///
/// Each content line is `src dst`, 0-based, separated by whitespace or a comma; further fields
/// (weights, timestamps) are ignored. Lines starting with `#` or `%` and blank lines are
/// skipped. Line `u v` becomes entry `(u, v)` (row `u` lists `v`); duplicates are merged. The
/// result has no values.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; [`Error::Parse`] with the 1-based line number for
/// a line with fewer than two fields or an index that is not a non-negative integer (or too
/// large for 32-bit indices).
///
/// ```
/// let path = std::env::temp_dir().join(format!("spattn-doc-edges-{}.txt", std::process::id()));
/// std::fs::write(&path, "# FromNodeId ToNodeId\n0 1\n1\t2\n\n2,0\n")?;
/// let a = spattn_formats::read_edge_list(&path)?;
/// assert_eq!((a.n_rows(), a.nnz()), (3, 3));
/// assert_eq!(a.row(2), &[0]);
/// # std::fs::remove_file(&path)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn read_edge_list(path: impl AsRef<Path>) -> Result<Csr> {
    read_edge_list_with(path, EdgeListOptions::default())
}

/// Reads an edge list (plain or gzip'd) with [`EdgeListOptions`]: a fixed node count, 1-based
/// indices, a header line, transposed entries.
///
/// # Errors
/// As [`read_edge_list`], and an index `>= n` when `n` is given.
///
/// ```
/// use spattn_formats::{read_edge_list_with, EdgeListOptions, Error};
/// let path = std::env::temp_dir().join(format!("spattn-doc-edges-with-{}.csv", std::process::id()));
/// std::fs::write(&path, "node_1,node_2\n1,2\n2,3\n")?;
/// let opts = EdgeListOptions::default().with_header(true).with_one_based(true).with_n(5);
/// let a = read_edge_list_with(&path, opts)?;
/// assert_eq!((a.n_rows(), a.nnz()), (5, 2));
/// assert_eq!(a.row(1), &[2]);
///
/// // Without the header option, the header is a malformed line 1.
/// let err = read_edge_list_with(&path, EdgeListOptions::default()).unwrap_err();
/// assert!(matches!(err, Error::Parse { line: 1, .. }), "{err}");
/// # std::fs::remove_file(&path)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn read_edge_list_with(path: impl AsRef<Path>, options: EdgeListOptions) -> Result<Csr> {
    let path = path.as_ref();
    let bytes = load_path(path)?;
    parse_edge_list(&bytes, Some(path), options, CHUNK_BYTES)
}

/// Reads an edge list from a stream (plain or gzip'd, detected from its first two bytes); see
/// [`read_edge_list_with`]. `path_for_messages` only names the source in errors, as in
/// [`read_matrix_market_from`].
///
/// ```
/// use spattn_formats::{io::read_edge_list_from, EdgeListOptions};
/// let a = read_edge_list_from("% comment\n0 3 1.5\n3 0 1.5\n".as_bytes(), None, EdgeListOptions::default())?;
/// assert_eq!((a.n_rows(), a.nnz()), (4, 2)); // the weight column is ignored
/// # Ok::<(), spattn_formats::Error>(())
/// ```
pub fn read_edge_list_from<R: BufRead>(
    reader: R,
    path_for_messages: Option<&Path>,
    options: EdgeListOptions,
) -> Result<Csr> {
    let bytes = load_reader(reader, path_for_messages)?;
    parse_edge_list(&bytes, path_for_messages, options, CHUNK_BYTES)
}

fn parse_edge_list(
    bytes: &[u8],
    path: Option<&Path>,
    opts: EdgeListOptions,
    chunk_bytes: usize,
) -> Result<Csr> {
    const COMMENTS: &[u8] = b"#%";
    const SEPS: Separators = Separators::WhitespaceOrComma;
    let bytes = strip_bom(bytes);
    if let Some(n) = opts.n {
        if n as u64 > MAX_DIM {
            return Err(Error::DimensionTooLarge {
                what: "n",
                value: n as u64,
                limit: MAX_DIM,
            });
        }
    }
    // An optional header: skip everything up to and including the first content line.
    let mut body = bytes;
    let mut first_line = 1usize;
    if opts.header {
        let mut rest = bytes;
        let mut lineno = 0usize;
        while let Some((line, tail)) = next_line(rest) {
            rest = tail;
            lineno += 1;
            if classify(line, SEPS, COMMENTS) == LineKind::Content {
                body = rest;
                first_line = lineno + 1;
                break;
            }
        }
    }

    let chunks = split_chunks(body, chunk_bytes);
    let results: Vec<ChunkResult<EdgeChunk>> = chunks
        .par_iter()
        .map(|chunk| {
            let cap = chunk.len() / 8;
            let data = EdgeChunk {
                src: Vec::with_capacity(cap),
                dst: Vec::with_capacity(cap),
                max: None,
            };
            parse_chunk(chunk, SEPS, COMMENTS, data, |out, line| {
                parse_edge_line(out, line, &opts)
            })
        })
        .collect();
    for (chunk, res) in chunks.iter().zip(&results) {
        if let Some((local, msg)) = &res.error {
            return Err(parse_error(path, first_line + local, msg.clone()));
        }
        first_line += count_lines(chunk);
    }
    let max = results.iter().filter_map(|r| r.data.max).max();
    let n = match (opts.n, max) {
        (Some(n), _) => n,
        (None, Some(m)) => m as usize + 1,
        (None, None) => 0,
    };
    let mut results = results;
    let src = concat(results.iter_mut().map(|r| std::mem::take(&mut r.data.src)));
    let dst = concat(results.iter_mut().map(|r| std::mem::take(&mut r.data.dst)));
    drop(results);
    Csr::from_unsorted(n, n, &src, &dst, None)
}

#[cfg(test)]
mod tests;
