//! Compressed sparse row storage of the attention mask, and its coordinate (COO) twin.
//!
//! Both hold an `n_rows × n_cols` pattern with optional f32 values. Column indices are `u32`;
//! row offsets are `u32` too, so a matrix holds at most [`MAX_NNZ`] (`u32::MAX − 255`) entries
//! and a larger one is refused with [`Error::TooManyEntries`] rather than wrapped around.

use std::sync::atomic::{AtomicU32, Ordering};

use rayon::prelude::*;

use crate::alloc;
use crate::error::{Error, Result};
use crate::offsets::{check_len, split_rows_mut};

/// The largest number of stored entries: 32-bit row offsets, less 255 so that kernels stepping
/// through edges a few at a time in `u32` (`e += 4`) never wrap past `u32::MAX`.
pub const MAX_NNZ: u64 = u32::MAX as u64 - 255;
/// The largest number of rows or columns (32-bit indices; `u32::MAX` itself is kept free as a
/// marker for padding slots in the blocked formats).
pub const MAX_DIM: u64 = u32::MAX as u64 - 1;

/// Both dimensions of an `n_rows × n_cols` matrix fit the 32-bit indices.
pub(crate) fn check_shape(n_rows: usize, n_cols: usize) -> Result<()> {
    check_dim("n_rows", n_rows)?;
    check_dim("n_cols", n_cols)
}

pub(crate) fn check_dim(what: &'static str, value: usize) -> Result<()> {
    if value as u64 > MAX_DIM {
        return Err(Error::DimensionTooLarge {
            what,
            value: value as u64,
            limit: MAX_DIM,
        });
    }
    Ok(())
}

/// Entries below which a pass over the matrix runs on one thread (the threads' start-up costs
/// more).
const PARALLEL_FROM_NNZ: usize = 1 << 20;

/// Tasks of a transpose of `nnz` entries over `n_rows` rows: one below [`PARALLEL_FROM_NNZ`],
/// else one per rayon thread, but no more than the mean degree
/// (each task walks every row once, so their walks stay within the entries' count).
fn transpose_parts(nnz: usize, n_rows: usize) -> usize {
    if nnz < PARALLEL_FROM_NNZ {
        1
    } else {
        let by_degree = nnz / n_rows.max(1 << 18);
        rayon::current_num_threads().min(by_degree).max(1)
    }
}

fn check_nnz(nnz: usize) -> Result<()> {
    if nnz as u64 > MAX_NNZ {
        return Err(Error::TooManyEntries {
            nnz: nnz as u64,
            limit: MAX_NNZ,
        });
    }
    Ok(())
}

fn check_values(values: Option<&[f32]>, nnz: usize) -> Result<()> {
    values.map_or(Ok(()), |v| check_len("values", nnz, v.len()))
}

/// The dimensions and lengths of parallel row / column (/ value) arrays.
fn check_triplets(
    n_rows: usize,
    n_cols: usize,
    rows: &[u32],
    cols: &[u32],
    values: Option<&[f32]>,
) -> Result<()> {
    check_shape(n_rows, n_cols)?;
    check_len("column indices", rows.len(), cols.len())?;
    check_values(values, rows.len())
}

/// Every entry of parallel row / column arrays lies in `n_rows × n_cols`; otherwise the first
/// entry that does not, as [`Error::RowOutOfBounds`] or [`Error::ColumnOutOfBounds`].
fn check_in_bounds(n_rows: usize, n_cols: usize, rows: &[u32], cols: &[u32]) -> Result<()> {
    let bad = rows
        .par_iter()
        .zip(cols.par_iter())
        .with_min_len(1 << 14)
        .position_first(|(&r, &c)| r as usize >= n_rows || c as usize >= n_cols);
    let Some(entry) = bad else {
        return Ok(());
    };
    let (r, c) = (rows[entry], cols[entry]);
    if r as usize >= n_rows {
        return Err(Error::RowOutOfBounds {
            entry,
            row: r as u64,
            n_rows,
        });
    }
    Err(Error::ColumnOutOfBounds {
        row: r as usize,
        entry,
        col: c as u64,
        n_cols,
    })
}

/// A sparse pattern as a list of `(row, col)` entries in any order, duplicates allowed.
///
/// ```
/// use spattn_formats::Coo;
/// let coo = Coo::try_new(2, 3, vec![1, 0, 1], vec![2, 1, 2], None)?;
/// let csr = coo.to_csr()?; // sorted, the duplicate (1, 2) merged
/// assert_eq!(csr.nnz(), 2);
/// assert_eq!(csr.row(1), &[2]);
/// # Ok::<(), spattn_formats::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Coo {
    n_rows: usize,
    n_cols: usize,
    rows: Vec<u32>,
    cols: Vec<u32>,
    values: Option<Vec<f32>>,
}

impl Coo {
    /// Builds a COO matrix, checking lengths and that every index is in bounds.
    pub fn try_new(
        n_rows: usize,
        n_cols: usize,
        rows: Vec<u32>,
        cols: Vec<u32>,
        values: Option<Vec<f32>>,
    ) -> Result<Self> {
        check_triplets(n_rows, n_cols, &rows, &cols, values.as_deref())?;
        check_in_bounds(n_rows, n_cols, &rows, &cols)?;
        Ok(Self {
            n_rows,
            n_cols,
            rows,
            cols,
            values,
        })
    }

    /// Number of rows.
    pub fn n_rows(&self) -> usize {
        self.n_rows
    }
    /// Number of columns.
    pub fn n_cols(&self) -> usize {
        self.n_cols
    }
    /// Number of stored entries (duplicates counted).
    pub fn nnz(&self) -> usize {
        self.rows.len()
    }
    /// Row index of each entry.
    pub fn rows(&self) -> &[u32] {
        &self.rows
    }
    /// Column index of each entry.
    pub fn cols(&self) -> &[u32] {
        &self.cols
    }
    /// Values, if any.
    pub fn values(&self) -> Option<&[f32]> {
        self.values.as_deref()
    }

    /// Converts to CSR: entries sorted by row then column, duplicates merged (values summed).
    pub fn to_csr(&self) -> Result<Csr> {
        Csr::from_unsorted(
            self.n_rows,
            self.n_cols,
            &self.rows,
            &self.cols,
            self.values.as_deref(),
        )
    }
}

/// Compressed sparse row pattern (the attention mask), optionally with f32 values.
///
/// Invariants (checked by [`Csr::try_new`]): `row_offsets` has `n_rows + 1` entries, starts at 0,
/// never decreases and ends at `nnz`; the columns of each row are strictly increasing (sorted,
/// no duplicates) and below `n_cols`.
///
/// ```
/// use spattn_formats::Csr;
/// // 0 -> {1, 2}, 1 -> {}, 2 -> {0}
/// let a = Csr::try_new(3, 3, vec![0, 2, 2, 3], vec![1, 2, 0], None)?;
/// assert_eq!(a.row(0), &[1, 2]);
/// let t = a.transpose();
/// assert_eq!(t.row(0), &[2]);
/// let a_sym = a.symmetrize()?.with_self_loops()?;
/// assert_eq!(a_sym.row(1), &[0, 1]);
/// # Ok::<(), spattn_formats::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Csr {
    n_rows: usize,
    n_cols: usize,
    row_offsets: Vec<u32>,
    col_indices: Vec<u32>,
    values: Option<Vec<f32>>,
}

impl Csr {
    /// Builds a CSR matrix from its arrays, checking every invariant.
    ///
    /// Errors name the offending row or entry: [`Error::LengthMismatch`],
    /// [`Error::OffsetsDoNotStartAtZero`], [`Error::NonMonotoneOffsets`],
    /// [`Error::OffsetsDoNotEndAtNnz`], [`Error::ColumnOutOfBounds`], [`Error::UnsortedRow`],
    /// [`Error::DuplicateEntry`].
    pub fn try_new(
        n_rows: usize,
        n_cols: usize,
        row_offsets: Vec<u32>,
        col_indices: Vec<u32>,
        values: Option<Vec<f32>>,
    ) -> Result<Self> {
        check_shape(n_rows, n_cols)?;
        check_nnz(col_indices.len())?;
        check_len("row offsets", n_rows + 1, row_offsets.len())?;
        check_values(values.as_deref(), col_indices.len())?;
        if row_offsets[0] != 0 {
            return Err(Error::OffsetsDoNotStartAtZero {
                first: row_offsets[0] as u64,
            });
        }
        for (row, w) in row_offsets.windows(2).enumerate() {
            if w[0] > w[1] {
                return Err(Error::NonMonotoneOffsets {
                    row,
                    prev: w[0] as u64,
                    next: w[1] as u64,
                });
            }
        }
        let last = row_offsets[n_rows] as u64;
        if last != col_indices.len() as u64 {
            return Err(Error::OffsetsDoNotEndAtNnz {
                last,
                nnz: col_indices.len(),
            });
        }
        // Rows are independent: check them in parallel and report the first bad row.
        let first_bad = (0..n_rows)
            .into_par_iter()
            .with_min_len(1024)
            .find_first(|&row| {
                let (s, e) = (row_offsets[row] as usize, row_offsets[row + 1] as usize);
                Self::check_row(row, s, &col_indices[s..e], n_cols).is_err()
            });
        if let Some(row) = first_bad {
            let (s, e) = (row_offsets[row] as usize, row_offsets[row + 1] as usize);
            Self::check_row(row, s, &col_indices[s..e], n_cols)?;
        }
        Ok(Self {
            n_rows,
            n_cols,
            row_offsets,
            col_indices,
            values,
        })
    }

    fn check_row(row: usize, start: usize, cols: &[u32], n_cols: usize) -> Result<()> {
        for (i, &c) in cols.iter().enumerate() {
            if c as usize >= n_cols {
                return Err(Error::ColumnOutOfBounds {
                    row,
                    entry: start + i,
                    col: c as u64,
                    n_cols,
                });
            }
            if i > 0 {
                let prev = cols[i - 1];
                if prev == c {
                    return Err(Error::DuplicateEntry {
                        row,
                        entry: start + i,
                        col: c,
                    });
                }
                if prev > c {
                    return Err(Error::UnsortedRow {
                        row,
                        entry: start + i,
                        prev,
                        next: c,
                    });
                }
            }
        }
        Ok(())
    }

    /// Builds a CSR matrix from arrays already known to satisfy every invariant of
    /// [`Csr::try_new`], without checking them (debug builds still check).
    ///
    /// Used inside this crate where a construction guarantees the invariants.
    pub(crate) fn from_parts_unchecked(
        n_rows: usize,
        n_cols: usize,
        row_offsets: Vec<u32>,
        col_indices: Vec<u32>,
        values: Option<Vec<f32>>,
    ) -> Self {
        debug_assert!(Self::try_new(
            n_rows,
            n_cols,
            row_offsets.clone(),
            col_indices.clone(),
            values.clone()
        )
        .is_ok());
        Self {
            n_rows,
            n_cols,
            row_offsets,
            col_indices,
            values,
        }
    }

    /// An `n_rows × n_cols` matrix with no entries.
    pub fn empty(n_rows: usize, n_cols: usize) -> Result<Self> {
        check_shape(n_rows, n_cols)?;
        Ok(Self::from_parts_unchecked(
            n_rows,
            n_cols,
            alloc::try_filled(n_rows + 1, 0, "row offsets")?,
            Vec::new(),
            None,
        ))
    }

    /// The `n × n` identity pattern (every node attends to itself only).
    pub fn identity(n: usize) -> Result<Self> {
        check_dim("n", n)?;
        let mut offsets = alloc::try_with_capacity(n + 1, "row offsets")?;
        offsets.extend(0..=n as u32);
        let mut cols = alloc::try_with_capacity(n, "column indices")?;
        cols.extend(0..n as u32);
        Ok(Self::from_parts_unchecked(n, n, offsets, cols, None))
    }

    /// Builds a CSR matrix from `(row, col)` edges in any order; sorts them and drops
    /// duplicates.
    pub fn from_edges(n_rows: usize, n_cols: usize, edges: &[(u32, u32)]) -> Result<Self> {
        let (rows, cols): (Vec<u32>, Vec<u32>) = edges.iter().copied().unzip();
        Self::from_unsorted(n_rows, n_cols, &rows, &cols, None)
    }

    /// Builds a CSR matrix from parallel row / column (/ value) arrays in any order.
    ///
    /// Entries are sorted by row, then column; duplicates are merged, their values summed (the
    /// MatrixMarket and scipy convention). Indices out of bounds are errors.
    pub fn from_unsorted(
        n_rows: usize,
        n_cols: usize,
        rows: &[u32],
        cols: &[u32],
        values: Option<&[f32]>,
    ) -> Result<Self> {
        check_triplets(n_rows, n_cols, rows, cols, values)?;
        check_nnz(rows.len())?;
        // Bounds first, so that the counting sort below can index freely.
        check_in_bounds(n_rows, n_cols, rows, cols)?;

        // The whole working set (offsets, cursors, per-row slices and lengths, the sorted
        // entries) is checked first, so a size line that promises 2^32 rows fails here.
        let nnz = rows.len();
        let entry_bytes = 4 + if values.is_some() { 4 } else { 0 };
        let working = (n_rows as u64 + 1)
            .checked_mul(4 * 4 + std::mem::size_of::<&mut [u32]>() as u64)
            .and_then(|b| b.checked_add((nnz as u64).checked_mul(entry_bytes)?));
        alloc::check_host_bytes("the CSR's rows and entries", working)?;

        // Counting sort by row.
        let mut offsets = alloc::try_filled(n_rows + 1, 0u32, "row offsets")?;
        for &r in rows {
            offsets[r as usize + 1] += 1;
        }
        for i in 0..n_rows {
            offsets[i + 1] += offsets[i];
        }
        let mut next = alloc::try_with_capacity(n_rows + 1, "row cursors")?;
        next.extend_from_slice(&offsets);
        let mut sorted_cols = alloc::try_filled(nnz, 0u32, "column indices")?;
        let mut sorted_vals = match values {
            Some(_) => Some(alloc::try_filled(nnz, 0f32, "values")?),
            None => None,
        };
        for (i, (&r, &c)) in rows.iter().zip(cols).enumerate() {
            let slot = &mut next[r as usize];
            sorted_cols[*slot as usize] = c;
            if let (Some(sv), Some(v)) = (sorted_vals.as_mut(), values) {
                sv[*slot as usize] = v[i];
            }
            *slot += 1;
        }

        // Sort and deduplicate each row in parallel, recording its new length.
        let new_lens: Vec<u32> = {
            let segments = split_rows_mut(&offsets, &mut sorted_cols);
            match sorted_vals.as_mut() {
                None => segments
                    .into_par_iter()
                    .map(|seg| {
                        seg.sort_unstable();
                        dedup_sorted(seg) as u32
                    })
                    .collect(),
                Some(sv) => {
                    let vsegs = split_rows_mut(&offsets, sv);
                    segments
                        .into_par_iter()
                        .zip(vsegs.into_par_iter())
                        .map(|(seg, vseg)| sort_dedup_with_values(seg, vseg) as u32)
                        .collect()
                }
            }
        };

        // Compact the rows that shrank.
        let mut new_offsets = alloc::try_filled(n_rows + 1, 0u32, "row offsets")?;
        for i in 0..n_rows {
            new_offsets[i + 1] = new_offsets[i] + new_lens[i];
        }
        let new_nnz = new_offsets[n_rows] as usize;
        if new_nnz != nnz {
            for i in 0..n_rows {
                let (src, dst, len) = (
                    offsets[i] as usize,
                    new_offsets[i] as usize,
                    new_lens[i] as usize,
                );
                sorted_cols.copy_within(src..src + len, dst);
                if let Some(sv) = sorted_vals.as_mut() {
                    sv.copy_within(src..src + len, dst);
                }
            }
            sorted_cols.truncate(new_nnz);
            if let Some(sv) = sorted_vals.as_mut() {
                sv.truncate(new_nnz);
            }
        }
        Ok(Self::from_parts_unchecked(
            n_rows,
            n_cols,
            new_offsets,
            sorted_cols,
            sorted_vals,
        ))
    }

    /// Number of rows.
    pub fn n_rows(&self) -> usize {
        self.n_rows
    }
    /// Number of columns.
    pub fn n_cols(&self) -> usize {
        self.n_cols
    }
    /// Number of stored entries (edges).
    pub fn nnz(&self) -> usize {
        self.col_indices.len()
    }
    /// Row offsets (`n_rows + 1` entries): row `i` holds entries `row_offsets[i]..row_offsets[i+1]`.
    pub fn row_offsets(&self) -> &[u32] {
        &self.row_offsets
    }
    /// Column index of every entry, sorted within each row.
    pub fn col_indices(&self) -> &[u32] {
        &self.col_indices
    }
    /// Values, if the matrix has them.
    pub fn values(&self) -> Option<&[f32]> {
        self.values.as_deref()
    }
    /// Entry range of row `i`.
    ///
    /// # Panics
    /// If `i >= n_rows`.
    pub fn row_range(&self, i: usize) -> std::ops::Range<usize> {
        self.row_offsets[i] as usize..self.row_offsets[i + 1] as usize
    }
    /// Column indices of row `i`.
    ///
    /// # Panics
    /// If `i >= n_rows`.
    pub fn row(&self, i: usize) -> &[u32] {
        &self.col_indices[self.row_range(i)]
    }
    /// Number of entries of row `i` (the in-degree of node `i` in attention terms).
    ///
    /// # Panics
    /// If `i >= n_rows`.
    pub fn degree(&self, i: usize) -> usize {
        (self.row_offsets[i + 1] - self.row_offsets[i]) as usize
    }
    /// Whether the pattern equals its transpose: square, and every entry `(i, j)` has its
    /// mirror `(j, i)` (values are not compared). Each entry is checked by a binary search of
    /// its mirror's row, rows in parallel from `PARALLEL_FROM_NNZ` (2^20) entries.
    ///
    /// ```
    /// use spattn_formats::Csr;
    /// let sym = Csr::from_edges(3, 3, &[(0, 1), (1, 0), (2, 2)])?;
    /// assert!(sym.is_pattern_symmetric());
    /// let directed = Csr::from_edges(3, 3, &[(0, 1), (2, 2)])?;
    /// assert!(!directed.is_pattern_symmetric());
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn is_pattern_symmetric(&self) -> bool {
        let mirrored = |i: usize| {
            self.row(i)
                .iter()
                .all(|&j| self.row(j as usize).binary_search(&(i as u32)).is_ok())
        };
        self.n_rows == self.n_cols
            && if self.nnz() < PARALLEL_FROM_NNZ {
                (0..self.n_rows).all(mirrored)
            } else {
                (0..self.n_rows).into_par_iter().all(mirrored)
            }
    }
    /// Replaces the values (or removes them with `None`).
    pub fn with_values(mut self, values: Option<Vec<f32>>) -> Result<Self> {
        check_values(values.as_deref(), self.nnz())?;
        self.values = values;
        Ok(self)
    }
    /// Drops the values, keeping the pattern.
    pub fn into_pattern(mut self) -> Self {
        self.values = None;
        self
    }
    /// Decomposes into `(n_rows, n_cols, row_offsets, col_indices, values)`.
    pub fn into_parts(self) -> (usize, usize, Vec<u32>, Vec<u32>, Option<Vec<f32>>) {
        (
            self.n_rows,
            self.n_cols,
            self.row_offsets,
            self.col_indices,
            self.values,
        )
    }

    /// The columns the rows `rows` touch, as a bitmap: bit `c % 64` of word `c / 64` is set
    /// where a row of the block has column `c` (`ceil(n_cols / 64)` words), marked on every
    /// core.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] where `rows` is not a range of this matrix's rows;
    /// [`Error::OutOfMemory`] where the bitmap does not fit.
    ///
    /// ```
    /// use spattn_formats::Csr;
    /// let a = Csr::from_edges(3, 70, &[(0, 1), (0, 65), (1, 4), (2, 0)])?;
    /// assert_eq!(a.row_block_columns(0..2)?, [(1 << 1) | (1 << 4), 1 << 1]);
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn row_block_columns(&self, rows: std::ops::Range<usize>) -> Result<Vec<u64>> {
        use std::sync::atomic::AtomicU64;
        if rows.start > rows.end || rows.end > self.n_rows {
            return Err(Error::InvalidParameter {
                what: "row block",
                why: format!("rows {rows:?} of a matrix of {} rows", self.n_rows),
            });
        }
        let (e0, e1) = (
            self.row_offsets[rows.start] as usize,
            self.row_offsets[rows.end] as usize,
        );
        let words = self.n_cols.div_ceil(64);
        let mut marks: Vec<AtomicU64> = alloc::try_with_capacity(words, "row block column bitmap")?;
        marks.extend((0..words).map(|_| AtomicU64::new(0)));
        self.col_indices[e0..e1]
            .par_iter()
            .with_min_len(1 << 14)
            .for_each(|&c| {
                let (word, bit) = (&marks[c as usize / 64], 1u64 << (c % 64));
                // Reading first keeps a hub column's word shared instead of bouncing between cores.
                if word.load(Ordering::Relaxed) & bit == 0 {
                    word.fetch_or(bit, Ordering::Relaxed);
                }
            });
        Ok(marks.into_iter().map(AtomicU64::into_inner).collect())
    }

    /// The rows `rows` of this matrix with their columns renumbered to the sorted set of
    /// distinct columns they touch, and that set: column `j` of the returned matrix is column
    /// `touched[j]` of this one (values carried along). A partitioned plan's rank builds its
    /// local matrix and its halo this way.
    ///
    /// Linear in the block's entries plus `n_cols / 64`, in parallel: the columns are marked in
    /// a bitmap, and a column's new number is the count of marked columns before it.
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] where `rows` is not a range of this matrix's rows;
    /// [`Error::OutOfMemory`] where the bitmap or the new arrays do not fit.
    ///
    /// ```
    /// use spattn_formats::Csr;
    /// let a = Csr::from_edges(3, 6, &[(0, 1), (0, 4), (1, 4), (2, 0), (2, 5)])?;
    /// let (block, touched) = a.row_block_compacted(0..2)?;
    /// assert_eq!(touched, [1, 4]);
    /// assert_eq!(block.col_indices(), [0, 1, 1]);
    /// assert_eq!((block.n_rows(), block.n_cols()), (2, 2));
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn row_block_compacted(&self, rows: std::ops::Range<usize>) -> Result<(Csr, Vec<u32>)> {
        let bits = self.row_block_columns(rows.clone())?;
        let words = bits.len();
        let (e0, e1) = (
            self.row_offsets[rows.start] as usize,
            self.row_offsets[rows.end] as usize,
        );
        let cols = &self.col_indices[e0..e1];
        // before[w]: marked columns in words 0..w (at most n_cols, which fits u32).
        let mut before: Vec<u32> = alloc::try_with_capacity(words, "row block column ranks")?;
        let mut touched_count = 0u32;
        for &w in &bits {
            before.push(touched_count);
            touched_count += w.count_ones();
        }
        let mut touched: Vec<u32> =
            alloc::try_with_capacity(touched_count as usize, "row block columns")?;
        for (w, &word) in bits.iter().enumerate() {
            let mut rest = word;
            while rest != 0 {
                touched.push((w * 64) as u32 + rest.trailing_zeros());
                rest &= rest - 1;
            }
        }
        let mut local: Vec<u32> = alloc::try_with_capacity(cols.len(), "row block column indices")?;
        cols.par_iter()
            .with_min_len(1 << 14)
            .map(|&c| {
                let w = c as usize / 64;
                before[w] + (bits[w] & ((1u64 << (c % 64)) - 1)).count_ones()
            })
            .collect_into_vec(&mut local);
        let base = self.row_offsets[rows.start];
        let mut offsets: Vec<u32> = alloc::try_with_capacity(rows.len() + 1, "row block offsets")?;
        offsets.extend(
            self.row_offsets[rows.start..=rows.end]
                .iter()
                .map(|&o| o - base),
        );
        let values = match &self.values {
            Some(v) => {
                let mut out = alloc::try_with_capacity(e1 - e0, "row block values")?;
                out.extend_from_slice(&v[e0..e1]);
                Some(out)
            }
            None => None,
        };
        // The renumbering is increasing, so sorted rows stay sorted and distinct columns
        // distinct; every new column is below the count of touched columns.
        Ok((
            Csr::from_parts_unchecked(rows.len(), touched.len(), offsets, local, values),
            touched,
        ))
    }

    /// The row index of every entry (the COO row array), in CSR order.
    pub fn row_indices(&self) -> Vec<u32> {
        let mut rows = vec![0u32; self.nnz()];
        rows.par_chunks_mut(1 << 16)
            .enumerate()
            .for_each(|(chunk, out)| {
                let start = chunk << 16;
                // First row whose range contains `start`.
                let mut r = self.row_offsets.partition_point(|&o| o as usize <= start) - 1;
                for (k, slot) in out.iter_mut().enumerate() {
                    let e = start + k;
                    while self.row_offsets[r + 1] as usize <= e {
                        r += 1;
                    }
                    *slot = r as u32;
                }
            });
        rows
    }

    /// Converts to COO, in CSR order.
    pub fn to_coo(&self) -> Coo {
        Coo {
            n_rows: self.n_rows,
            n_cols: self.n_cols,
            rows: self.row_indices(),
            cols: self.col_indices.clone(),
            values: self.values.clone(),
        }
    }

    /// The transpose Aᵀ, values carried along.
    pub fn transpose(&self) -> Csr {
        self.transpose_with_map().0
    }

    /// The transpose Aᵀ and, for each of its entries, the index of the same entry in `self`
    /// (so per-edge data in A's order, such as attention scores, can be read in Aᵀ's order).
    pub fn transpose_with_map(&self) -> (Csr, Vec<u32>) {
        let nnz = self.nnz();
        let mut offsets = vec![0u32; self.n_cols + 1];
        let parts = transpose_parts(nnz, self.n_rows);
        if parts == 1 {
            for &c in &self.col_indices {
                offsets[c as usize + 1] += 1;
            }
        } else {
            let counts: Vec<AtomicU32> = (0..self.n_cols).map(|_| AtomicU32::new(0)).collect();
            self.col_indices.par_iter().for_each(|&c| {
                counts[c as usize].fetch_add(1, Ordering::Relaxed);
            });
            for (o, c) in offsets[1..].iter_mut().zip(counts) {
                *o = c.into_inner();
            }
        }
        for i in 0..self.n_cols {
            offsets[i + 1] += offsets[i];
        }
        let mut cols = vec![0u32; nnz];
        let mut map = vec![0u32; nnz];
        // Column ranges of about nnz / parts entries, each filled by one task that walks every
        // row in order: its columns come out sorted by row, as the sequential scatter's.
        let mut bounds = vec![0usize];
        for k in 1..parts {
            let target = (nnz as u64 * k as u64 / parts as u64) as u32;
            let c = offsets.partition_point(|&o| o < target).min(self.n_cols);
            if c > *bounds.last().unwrap_or(&0) {
                bounds.push(c);
            }
        }
        // The last range ends at n_cols (one range at least, even an empty one).
        if bounds.len() == 1 || *bounds.last().unwrap_or(&0) < self.n_cols {
            bounds.push(self.n_cols);
        }
        let mut tasks = Vec::with_capacity(bounds.len() - 1);
        let (mut rest_cols, mut rest_map) = (&mut cols[..], &mut map[..]);
        for w in bounds.windows(2) {
            let len = (offsets[w[1]] - offsets[w[0]]) as usize;
            let (c_part, c_rest) = rest_cols.split_at_mut(len);
            let (m_part, m_rest) = rest_map.split_at_mut(len);
            tasks.push((w[0]..w[1], c_part, m_part));
            (rest_cols, rest_map) = (c_rest, m_rest);
        }
        tasks
            .into_par_iter()
            .for_each(|(range, out_cols, out_map)| {
                let base = offsets[range.start];
                let mut next: Vec<u32> = offsets[range.clone()].iter().map(|&o| o - base).collect();
                for r in 0..self.n_rows {
                    let row = self.row_range(r);
                    let here = &self.col_indices[row.clone()];
                    let lo = here.partition_point(|&c| (c as usize) < range.start);
                    let hi = lo + here[lo..].partition_point(|&c| (c as usize) < range.end);
                    for (e, &c) in (row.start + lo..).zip(&here[lo..hi]) {
                        let slot = &mut next[c as usize - range.start];
                        out_cols[*slot as usize] = r as u32;
                        out_map[*slot as usize] = e as u32;
                        *slot += 1;
                    }
                }
            });
        let values = self
            .values
            .as_ref()
            .map(|v| map.par_iter().map(|&e| v[e as usize]).collect());
        (
            Csr::from_parts_unchecked(self.n_cols, self.n_rows, offsets, cols, values),
            map,
        )
    }

    /// Adds the missing diagonal entries `(i, i)` (value 1.0 where the matrix has values).
    /// Needs a square matrix.
    pub fn with_self_loops(&self) -> Result<Csr> {
        if self.n_rows != self.n_cols {
            return Err(Error::NotSquare {
                op: "with_self_loops",
                n_rows: self.n_rows,
                n_cols: self.n_cols,
            });
        }
        let n = self.n_rows;
        let missing: Vec<u32> = (0..n)
            .into_par_iter()
            .map(|i| u32::from(self.row(i).binary_search(&(i as u32)).is_err()))
            .collect();
        let added: u64 = missing.iter().map(|&m| m as u64).sum();
        let new_nnz = self.nnz() + added as usize;
        check_nnz(new_nnz)?;
        let mut offsets = alloc::try_with_capacity(n + 1, "row offsets")?;
        offsets.push(0u32);
        let mut cols = alloc::try_with_capacity(new_nnz, "column indices")?;
        let mut vals = match self.values {
            Some(_) => Some(alloc::try_with_capacity(new_nnz, "values")?),
            None => None,
        };
        for (i, &is_missing) in missing.iter().enumerate() {
            let range = self.row_range(i);
            let row = &self.col_indices[range.clone()];
            let pos = row.partition_point(|&c| c < i as u32);
            cols.extend_from_slice(&row[..pos]);
            if let (Some(vs), Some(src)) = (vals.as_mut(), self.values.as_ref()) {
                vs.extend_from_slice(&src[range.start..range.start + pos]);
            }
            if is_missing == 1 {
                cols.push(i as u32);
                if let Some(vs) = vals.as_mut() {
                    vs.push(1.0);
                }
            }
            cols.extend_from_slice(&row[pos..]);
            if let (Some(vs), Some(src)) = (vals.as_mut(), self.values.as_ref()) {
                vs.extend_from_slice(&src[range.start + pos..range.end]);
            }
            offsets.push(cols.len() as u32);
        }
        Ok(Csr::from_parts_unchecked(n, n, offsets, cols, vals))
    }

    /// The pattern of A + Aᵀ (values summed where the matrix has them). Needs a square matrix.
    pub fn symmetrize(&self) -> Result<Csr> {
        if self.n_rows != self.n_cols {
            return Err(Error::NotSquare {
                op: "symmetrize",
                n_rows: self.n_rows,
                n_cols: self.n_cols,
            });
        }
        let nnz = self.nnz();
        check_nnz(2 * nnz)?;
        let row_idx = self.row_indices();
        let mut rows = alloc::try_with_capacity(2 * nnz, "row indices")?;
        rows.extend_from_slice(&row_idx);
        rows.extend_from_slice(&self.col_indices);
        let mut cols = alloc::try_with_capacity(2 * nnz, "column indices")?;
        cols.extend_from_slice(&self.col_indices);
        cols.extend_from_slice(&row_idx);
        let vals = match self.values.as_ref() {
            Some(v) => {
                let mut out = alloc::try_with_capacity(2 * nnz, "values")?;
                out.extend_from_slice(v);
                out.extend_from_slice(v);
                Some(out)
            }
            None => None,
        };
        Csr::from_unsorted(self.n_rows, self.n_cols, &rows, &cols, vals.as_deref())
    }

    /// A + Aᵀ + I as a pattern: the convention of every GAT / graph-transformer benchmark.
    pub fn symmetrize_with_self_loops(&self) -> Result<Csr> {
        self.symmetrize()?.into_pattern().with_self_loops()
    }
}

/// Removes consecutive duplicates in place; returns the new length.
fn dedup_sorted(seg: &mut [u32]) -> usize {
    if seg.is_empty() {
        return 0;
    }
    let mut w = 1;
    for r in 1..seg.len() {
        if seg[r] != seg[w - 1] {
            seg[w] = seg[r];
            w += 1;
        }
    }
    w
}

/// Sorts a row's columns with their values and merges duplicates by summing; returns the new
/// length.
fn sort_dedup_with_values(cols: &mut [u32], vals: &mut [f32]) -> usize {
    let mut pairs: Vec<(u32, f32)> = cols.iter().copied().zip(vals.iter().copied()).collect();
    // Stable, so duplicates are summed in input order (deterministic).
    pairs.sort_by_key(|p| p.0);
    let mut w = 0;
    for (i, &(c, v)) in pairs.iter().enumerate() {
        if i > 0 && c == cols[w - 1] {
            vals[w - 1] += v;
        } else {
            cols[w] = c;
            vals[w] = v;
            w += 1;
        }
    }
    w
}
