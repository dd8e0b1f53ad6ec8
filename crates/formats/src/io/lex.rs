//! The text layer both readers share: lines, fields and numbers parsed by hand from bytes, and
//! the split of a body into chunks of whole lines that are parsed independently (in parallel)
//! and put back in file order.

use std::path::Path;

use crate::error::Error;

/// Longest token quoted back in an error message.
const MAX_QUOTED: usize = 40;

pub(super) fn parse_error(path: Option<&Path>, line: usize, msg: impl Into<String>) -> Error {
    Error::Parse {
        path: path.map(Path::to_path_buf),
        line,
        msg: msg.into(),
    }
}

/// A token quoted for an error message (lossy UTF-8, shortened).
pub(super) fn quote(tok: &[u8]) -> String {
    let s = String::from_utf8_lossy(tok);
    if s.chars().count() > MAX_QUOTED {
        let short: String = s.chars().take(MAX_QUOTED).collect();
        format!("'{short}...'")
    } else {
        format!("'{s}'")
    }
}

/// `buf` without a leading UTF-8 byte-order mark (editors on Windows write one; it is not
/// content).
pub(super) fn strip_bom(buf: &[u8]) -> &[u8] {
    buf.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(buf)
}

/// Splits off the first line of `buf`: returns it (without its `\n`) and the rest (after the
/// `\n`), or `None` when `buf` is empty.
pub(super) fn next_line(buf: &[u8]) -> Option<(&[u8], &[u8])> {
    if buf.is_empty() {
        return None;
    }
    match buf.iter().position(|&b| b == b'\n') {
        Some(i) => Some((&buf[..i], &buf[i + 1..])),
        None => Some((buf, &[])),
    }
}

/// The separator set of a file kind.
#[derive(Clone, Copy)]
pub(super) enum Separators {
    /// Spaces and tabs (MatrixMarket).
    Whitespace,
    /// Spaces, tabs and commas (edge lists, CSV).
    WhitespaceOrComma,
}

impl Separators {
    #[inline]
    fn contains(self, b: u8) -> bool {
        match self {
            Separators::Whitespace => matches!(b, b' ' | b'\t' | b'\r' | b'\x0b' | b'\x0c'),
            Separators::WhitespaceOrComma => {
                matches!(b, b' ' | b'\t' | b'\r' | b'\x0b' | b'\x0c' | b',')
            }
        }
    }
}

/// The fields of one line, split on runs of separators.
pub(super) struct Fields<'a> {
    line: &'a [u8],
    pos: usize,
    seps: Separators,
}

impl<'a> Fields<'a> {
    pub(super) fn new(line: &'a [u8], seps: Separators) -> Self {
        Self { line, pos: 0, seps }
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = &'a [u8];
    #[inline]
    fn next(&mut self) -> Option<&'a [u8]> {
        let line = self.line;
        let mut p = self.pos;
        while p < line.len() && self.seps.contains(line[p]) {
            p += 1;
        }
        if p == line.len() {
            self.pos = p;
            return None;
        }
        let start = p;
        while p < line.len() && !self.seps.contains(line[p]) {
            p += 1;
        }
        self.pos = p;
        Some(&line[start..p])
    }
}

/// What a line holds, once leading separators are skipped.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum LineKind {
    Blank,
    Comment,
    Content,
}

pub(super) fn classify(line: &[u8], seps: Separators, comments: &[u8]) -> LineKind {
    match line.iter().find(|&&b| !seps.contains(b)) {
        None => LineKind::Blank,
        Some(b) if comments.contains(b) => LineKind::Comment,
        Some(_) => LineKind::Content,
    }
}

/// Parses a non-negative decimal integer (ASCII digits only). `None` if the token holds anything
/// else or overflows u64.
#[inline]
pub(super) fn parse_u64(tok: &[u8]) -> Option<u64> {
    if tok.is_empty() {
        return None;
    }
    let mut v: u64 = 0;
    for &b in tok {
        let d = b.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(d as u64)?;
    }
    Some(v)
}

/// Parses a real value as f32. Rejects text that is not a number, and finite numbers too large
/// for f32 (which would otherwise silently become infinity).
pub(super) fn parse_real(tok: &[u8]) -> std::result::Result<f32, String> {
    let s =
        std::str::from_utf8(tok).map_err(|_| format!("value {} is not a number", quote(tok)))?;
    let v: f32 = s
        .parse()
        .map_err(|_| format!("value {} is not a number", quote(tok)))?;
    if v.is_infinite() {
        let digits = s.trim_start_matches(['+', '-']);
        if !digits.starts_with(['i', 'I']) {
            return Err(format!("value {} overflows f32", quote(tok)));
        }
    }
    Ok(v)
}

/// Parses an integer value (optionally signed) and converts it to f32.
pub(super) fn parse_integer_value(tok: &[u8]) -> std::result::Result<f32, String> {
    let s = std::str::from_utf8(tok).ok();
    match s.and_then(|s| s.parse::<i64>().ok()) {
        Some(v) => Ok(v as f32),
        None => Err(format!("value {} is not an integer", quote(tok))),
    }
}

/// Splits `body` into chunks of whole lines of about `target` bytes each (the last may be
/// shorter; every chunk but the last ends with `\n`).
pub(super) fn split_chunks(body: &[u8], target: usize) -> Vec<&[u8]> {
    let target = target.max(1);
    let mut chunks = Vec::with_capacity(body.len() / target + 1);
    let mut rest = body;
    while !rest.is_empty() {
        let end = if rest.len() <= target {
            rest.len()
        } else {
            match rest[target - 1..].iter().position(|&b| b == b'\n') {
                Some(i) => target + i,
                None => rest.len(),
            }
        };
        let (head, tail) = rest.split_at(end);
        chunks.push(head);
        rest = tail;
    }
    chunks
}

/// Number of lines in a chunk of whole lines (a last line without `\n` counts).
pub(super) fn count_lines(chunk: &[u8]) -> usize {
    let newlines = chunk.iter().filter(|&&b| b == b'\n').count();
    newlines + usize::from(chunk.last().is_some_and(|&b| b != b'\n'))
}

/// What one chunk's parse produced.
pub(super) struct ChunkResult<T> {
    /// The parsed entries (of the lines before the error, if any).
    pub(super) data: T,
    /// Content lines parsed successfully.
    pub(super) entries: usize,
    /// The first error: 0-based line within the chunk, and the message.
    pub(super) error: Option<(usize, String)>,
}

/// Runs `parse_line` on every content line of `chunk` until the first error.
pub(super) fn parse_chunk<T>(
    chunk: &[u8],
    seps: Separators,
    comments: &[u8],
    mut data: T,
    mut parse_line: impl FnMut(&mut T, &[u8]) -> std::result::Result<(), String>,
) -> ChunkResult<T> {
    let mut rest = chunk;
    let mut local_line = 0usize;
    let mut entries = 0usize;
    while let Some((line, tail)) = next_line(rest) {
        rest = tail;
        if classify(line, seps, comments) == LineKind::Content {
            if let Err(msg) = parse_line(&mut data, line) {
                return ChunkResult {
                    data,
                    entries,
                    error: Some((local_line, msg)),
                };
            }
            entries += 1;
        }
        local_line += 1;
    }
    ChunkResult {
        data,
        entries,
        error: None,
    }
}

/// The 0-based line within `chunk` of its `k`-th (0-based) content line.
pub(super) fn nth_content_line(
    chunk: &[u8],
    seps: Separators,
    comments: &[u8],
    k: usize,
) -> Option<usize> {
    let mut rest = chunk;
    let mut local_line = 0usize;
    let mut seen = 0usize;
    while let Some((line, tail)) = next_line(rest) {
        rest = tail;
        if classify(line, seps, comments) == LineKind::Content {
            if seen == k {
                return Some(local_line);
            }
            seen += 1;
        }
        local_line += 1;
    }
    None
}

/// Concatenates per-chunk vectors into one.
pub(super) fn concat<T: Copy>(parts: impl Iterator<Item = Vec<T>>) -> Vec<T> {
    let parts: Vec<Vec<T>> = parts.collect();
    if parts.len() == 1 {
        // The common small-file case: no copy.
        return parts.into_iter().next().unwrap_or_default();
    }
    let total = parts.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(total);
    for p in parts {
        out.extend_from_slice(&p);
    }
    out
}
