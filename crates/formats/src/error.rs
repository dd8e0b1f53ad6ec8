//! The one error type of spattn-formats.

use std::path::PathBuf;

/// Everything that can go wrong building, converting or reading a sparse format.
///
/// Every variant names the offending index, length or line, so that a message alone says what
/// to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A length does not match the shape it belongs to.
    #[error("{what} has length {actual}, expected {expected}")]
    LengthMismatch {
        /// Which array.
        what: &'static str,
        /// The length it should have.
        expected: usize,
        /// The length it has.
        actual: usize,
    },
    /// Row offsets must start at 0 and never decrease.
    #[error("row offsets are not monotone: offset {row} is {prev} but offset {next_row} is {next}", next_row = row + 1)]
    NonMonotoneOffsets {
        /// The row whose start is past its end.
        row: usize,
        /// `offset[row]`.
        prev: u64,
        /// `offset[row + 1]`.
        next: u64,
    },
    /// The first row offset must be 0.
    #[error("row offsets must start at 0, found {first}")]
    OffsetsDoNotStartAtZero {
        /// `offset[0]`.
        first: u64,
    },
    /// The last row offset must equal the number of stored entries.
    #[error("last row offset is {last} but there are {nnz} column indices")]
    OffsetsDoNotEndAtNnz {
        /// `offset[n_rows]`.
        last: u64,
        /// Length of the column-index array.
        nnz: usize,
    },
    /// A column index is not below the number of columns.
    #[error(
        "column index {col} at entry {entry} (row {row}) is out of bounds for {n_cols} columns"
    )]
    ColumnOutOfBounds {
        /// The row holding it.
        row: usize,
        /// Position in the column-index array.
        entry: usize,
        /// The column index.
        col: u64,
        /// Number of columns.
        n_cols: usize,
    },
    /// A row index is not below the number of rows.
    #[error("row index {row} at entry {entry} is out of bounds for {n_rows} rows")]
    RowOutOfBounds {
        /// Position in the entry list.
        entry: usize,
        /// The row index.
        row: u64,
        /// Number of rows.
        n_rows: usize,
    },
    /// Column indices within a row must be strictly increasing.
    #[error("row {row} is not sorted: column {next} at entry {entry} follows column {prev}")]
    UnsortedRow {
        /// The row.
        row: usize,
        /// Position in the column-index array of the offending entry.
        entry: usize,
        /// The column before it.
        prev: u32,
        /// The offending column.
        next: u32,
    },
    /// A column appears twice in one row.
    #[error("row {row} holds column {col} twice (entry {entry})")]
    DuplicateEntry {
        /// The row.
        row: usize,
        /// Position of the second occurrence.
        entry: usize,
        /// The repeated column.
        col: u32,
    },
    /// More entries than 32-bit offsets can address.
    #[error("{nnz} entries exceed the limit of {limit} (32-bit row offsets)")]
    TooManyEntries {
        /// Entries requested.
        nnz: u64,
        /// The largest count supported.
        limit: u64,
    },
    /// A dimension is larger than 32-bit indices can address.
    #[error("{what} = {value} exceeds the limit of {limit} (32-bit indices)")]
    DimensionTooLarge {
        /// Which dimension.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The largest value supported.
        limit: u64,
    },
    /// The operation needs a square matrix.
    #[error("{op} needs a square matrix, got {n_rows} x {n_cols}")]
    NotSquare {
        /// The operation.
        op: &'static str,
        /// Rows.
        n_rows: usize,
        /// Columns.
        n_cols: usize,
    },
    /// An invalid parameter (block width, R-MAT probabilities, ...).
    #[error("invalid {what}: {why}")]
    InvalidParameter {
        /// The parameter.
        what: &'static str,
        /// Why it is rejected.
        why: String,
    },
    /// A permutation is not a bijection of 0..n.
    #[error("not a permutation of 0..{n}: {why}")]
    InvalidPermutation {
        /// Its length.
        n: usize,
        /// What is wrong (a value out of range, a repeated value).
        why: String,
    },
    /// A malformed line in a text file.
    #[error("{}line {line}: {msg}", path.as_ref().map(|p| format!("{}: ", p.display())).unwrap_or_default())]
    Parse {
        /// The file, where known.
        path: Option<PathBuf>,
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        msg: String,
    },
    /// An I/O failure reading a file.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The arrays of a blocked format (ME-BCRS, BSB) break one of its invariants.
    #[error("invalid {format} layout at {what} index {index}: {why}")]
    InvalidLayout {
        /// The format ("ME-BCRS", "BSB").
        format: &'static str,
        /// The offending array.
        what: &'static str,
        /// Position in that array.
        index: usize,
        /// Which invariant fails.
        why: String,
    },
    /// A buffer sized from the input needs more host memory than is available (or than 64-bit
    /// sizes can count).
    #[error("cannot allocate {} for {what}{}", crate::alloc::describe_bytes(*bytes), available.map(|a| format!(": {} of host memory available", crate::alloc::describe_bytes(a))).unwrap_or_default())]
    OutOfMemory {
        /// The buffer.
        what: &'static str,
        /// Bytes it needs (`u64::MAX` where the count overflows).
        bytes: u64,
        /// Bytes available, where the system says.
        available: Option<u64>,
    },
    /// An I/O failure on a stream with no path.
    #[error("read error: {0}")]
    Read(#[from] std::io::Error),
}

/// Result with the formats [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
