//! ME-BCRS: FlashSparse's memory-efficient blocked CSR, the operand format of tensor-core SpMM and
//! SDDMM with the sparse matrix on the mma `n = 8` side (swap-and-transpose).
//!
//! # Layout
//!
//! Rows are grouped into **windows** of 8: window `w` holds rows `8w .. 8w + 8`; the last window
//! is partial when `n_rows % 8 != 0` (its missing rows simply never have a mask bit set). Every
//! distinct column of a window is one **vector**: an 8×1 column slice of the window. A window's
//! vectors are stored in ascending column order, with no padding. The 10 × 12 example below
//! (rows 2 and 5 empty, window 1 partial) is the one the tests check array by array:
//!
//! ```text
//!  A (10 × 12)                        window 0: 6 vectors               window 1: 3 vectors
//!          col 0 1 2 3 4 5 6 7 8 9 10 11    v0   v1   v2   v3   v4   v5      v6   v7   v8
//!  row 0       . x . . x . . . . . .  .    c0   c1   c2   c4   c7   c9      c3   c5   c11
//!  row 1       . . . . x . . . . . .  .  r0 .    x    .    x    .    .    r0 x    x    .
//!  row 2       . . . . . . . . . . .  .  r1 .    .    .    x    .    .    r1 .    x    x
//!  row 3       x . . . . . . . . x .  .  r2 .    .    .    .    .    .    r2..r7: rows 10..15
//!  row 4       . . . . x . . x . . .  .  r3 x    .    .    .    .    x        do not exist
//!  row 5       . . . . . . . . . . .  .  r4 .    .    .    x    x    .
//!  row 6       . . x . . . . . . . .  .  r5 .    .    .    .    .    .
//!  row 7       . . . . . . . x . . .  .  r6 .    .    x    .    .    .
//!  row 8       . . . x . x . . . . .  .  r7 .    .    .    .    x    .
//!  row 9       . . . . . x . . . . .  x
//!
//!  row_pointers   = [0, 6, 9]                 window w owns vectors row_pointers[w]..[w + 1]
//!  column_indices = [0, 1, 2, 4, 7, 9,  3, 5, 11]
//!  row_masks      = [0x08, 0x01, 0x40, 0x13, 0x90, 0x08,  0x01, 0x03, 0x02]
//!  block_width 4:   window 0 = block [v0 v1 v2 v3] + partial block [v4 v5]; window 1 = [v6 v7 v8]
//!  edge_to_slot   = [8, 24, 25, 3, 43, 28, 36, 22, 39, 48, 56, 57, 65]  (edge (3, 9): v5 · 8 + 3)
//! ```
//!
//! - `row_pointers` (`u32`, `n_windows + 1` entries): prefix sum of the vector counts.
//! - `column_indices` (`u32`, one per vector): the vector's column; strictly increasing within a
//!   window, every one `< n_cols`. There are no padding columns.
//! - `row_masks` (`u8`, one per vector): bit `r` is set iff row `8w + r` has an edge to the
//!   vector's column. Never 0 (a vector exists because some row has the column), and never a bit
//!   for a row `>= n_rows`. Kernels take edge-ness from the mask, never from a value: a slot
//!   whose bit is clear is masked (−∞ before softmax, 0 in SpMM) even if a score there is 0.
//!
//! # Tensor-core blocks
//!
//! Consecutive vectors of a window form one tensor-core **block** of `block_width` vectors:
//! 8 for f16/bf16 (`mma.m16n8k8`), 4 for tf32 (`mma.m16n8k4`). After swap-and-transpose the
//! window's 8 rows are the mma's `n = 8` side and the block's vectors its `k` side, so an 8×1
//! vector is exactly one `k` index of the sparse operand and one row of the dense one.
//! Block `j` of window `w` is vectors `row_pointers[w] + j·bw .. min(.., row_pointers[w+1])`.
//! The last block of a window is **partial and not padded in memory**: a kernel loads
//! `vectors_in_window(w) - j·bw` vectors and treats the rest of the block as zero.
//! [`MeBcrs::blocks_in_window`] is `ceil(vectors / block_width)`.
//!
//! # Slots and per-edge data
//!
//! A **slot** is one row of one vector: slot `vector · 8 + r` is row `8w + r` of the vector's
//! column. Slot-major arrays (the optional [`MeBcrs::values`], SDDMM scores that the SpMM then
//! reads) have `n_vectors · 8` entries; slots whose mask bit is clear hold 0 (or whatever fill the
//! caller chose). [`MeBcrs::edge_to_slot`] gives the slot of every CSR edge, in CSR order;
//! [`MeBcrs::gather_to_csr_order`] and [`MeBcrs::scatter_to_slots`] move data between the two
//! orders.

use std::ops::Range;

use rayon::prelude::*;

use crate::csr::{check_shape, Csr};
use crate::error::{Error, Result};
use crate::offsets::{check_len, check_pointers, for_each_bit, plan_chunks, split_by_lens};
use crate::stats::FillStats;
use crate::window::{edge_offsets_of_items, slot_windows, SlotWindows};

/// Rows per ME-BCRS window (and per vector).
const ROWS: usize = 8;

/// FlashSparse's ME-BCRS: 8-row windows of 8×1 vectors, grouped `block_width` at a time into
/// tensor-core blocks. See the [module documentation](self) for the exact layout.
///
/// Invariants (checked by [`MeBcrs::try_new`], guaranteed by [`MeBcrs::from_csr`]):
/// `row_pointers` has `n_windows + 1` entries, starts at 0, never decreases and ends at the
/// number of vectors; within each window the columns are strictly increasing and below `n_cols`;
/// every mask is nonzero and sets no bit for a row past `n_rows`; values, when present, hold
/// `n_vectors · 8` entries with 0 at every slot whose mask bit is clear.
#[derive(Clone, Debug, PartialEq)]
pub struct MeBcrs {
    n_rows: usize,
    n_cols: usize,
    block_width: usize,
    n_blocks: usize,
    max_blocks_per_window: usize,
    row_pointers: Vec<u32>,
    column_indices: Vec<u32>,
    row_masks: Vec<u8>,
    values: Option<Vec<f32>>,
    /// CSR row offsets of the same pattern: where each row's edges start in CSR order.
    edge_offsets: Vec<u32>,
}

impl MeBcrs {
    /// Rows per window: 8.
    pub const WINDOW_ROWS: usize = ROWS;
    /// Block width (vectors per tensor-core block) for f16 / bf16 operands.
    pub const BLOCK_WIDTH_F16: usize = 8;
    /// Block width (vectors per tensor-core block) for tf32 operands.
    pub const BLOCK_WIDTH_TF32: usize = 4;

    /// Converts a CSR matrix to ME-BCRS with `block_width` vectors per tensor-core block
    /// (8 for f16/bf16, 4 for tf32). Values, if the matrix has them, are stored per slot.
    ///
    /// Windows are built in parallel. Errors: [`Error::InvalidParameter`] if `block_width` is
    /// neither 4 nor 8.
    ///
    /// ```
    /// use spattn_formats::{Csr, MeBcrs};
    /// // Rows 0 and 3 share column 4, so they share one vector.
    /// let a = Csr::from_edges(9, 6, &[(0, 1), (0, 4), (3, 4), (8, 2)])?;
    /// let me = MeBcrs::from_csr(&a, 8)?;
    /// assert_eq!(me.n_windows(), 2); // rows 0..8 and the partial window of row 8
    /// assert_eq!(me.row_pointers(), &[0, 2, 3]);
    /// assert_eq!(me.column_indices(), &[1, 4, 2]);
    /// assert_eq!(me.row_masks(), &[0b0000_0001, 0b0000_1001, 0b0000_0001]);
    /// // The slot of every CSR edge: vector · 8 + row within the window.
    /// assert_eq!(me.edge_to_slot()?, vec![0, 8, 11, 16]);
    /// assert_eq!(me.to_csr()?, a);
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn from_csr(a: &Csr, block_width: usize) -> Result<Self> {
        check_block_width(block_width)?;
        let offsets = a.row_offsets();
        let cols = a.col_indices();
        let vals = a.values();
        let chunks = plan_chunks(offsets, ROWS);
        let parts: Vec<ChunkPart> = chunks
            .par_iter()
            .map_init(WindowMerger::default, |merger, windows| {
                build_chunk(windows.clone(), offsets, cols, vals, merger)
            })
            .collect();

        // Window pointers and block counts, in window order.
        let n_windows = a.n_rows().div_ceil(ROWS);
        let mut row_pointers = Vec::with_capacity(n_windows + 1);
        row_pointers.push(0u32);
        let mut n_vectors = 0usize;
        let (mut n_blocks, mut max_blocks) = (0usize, 0usize);
        for part in &parts {
            for &count in &part.vectors_per_window {
                n_vectors += count as usize;
                // At most one vector per edge, and at most u32::MAX edges: no overflow.
                row_pointers.push(n_vectors as u32);
                let blocks = (count as usize).div_ceil(block_width);
                n_blocks += blocks;
                max_blocks = max_blocks.max(blocks);
            }
        }

        // Concatenate the chunks into the final arrays, in parallel.
        let mut column_indices = vec![0u32; n_vectors];
        let mut row_masks = vec![0u8; n_vectors];
        let mut values = vals.map(|_| vec![0f32; n_vectors * ROWS]);
        let lens = || parts.iter().map(|p| p.columns.len());
        let col_slices = split_by_lens(&mut column_indices, lens());
        let mask_slices = split_by_lens(&mut row_masks, lens());
        parts
            .par_iter()
            .zip(col_slices)
            .zip(mask_slices)
            .for_each(|((part, c), m)| {
                c.copy_from_slice(&part.columns);
                m.copy_from_slice(&part.masks);
            });
        if let Some(values) = values.as_mut() {
            let val_slices = split_by_lens(values, parts.iter().map(|p| p.values.len()));
            parts
                .par_iter()
                .zip(val_slices)
                .for_each(|(part, v)| v.copy_from_slice(&part.values));
        }
        Ok(Self {
            n_rows: a.n_rows(),
            n_cols: a.n_cols(),
            block_width,
            n_blocks,
            max_blocks_per_window: max_blocks,
            row_pointers,
            column_indices,
            row_masks,
            values,
            edge_offsets: offsets.to_vec(),
        })
    }

    /// Builds an ME-BCRS matrix from its arrays (laid out as in the
    /// [module documentation](self)), checking every invariant.
    ///
    /// Errors: [`Error::InvalidParameter`] (block width), [`Error::DimensionTooLarge`]
    /// (`n_rows` or `n_cols` above [`MAX_DIM`](crate::MAX_DIM)), [`Error::LengthMismatch`]
    /// (`row_pointers` not `n_windows + 1` long, `row_masks` not one per column index, `values`
    /// not 8 per vector), [`Error::InvalidLayout`] naming the array and index that break an
    /// invariant (pointers not starting at 0, decreasing or not ending at the vector count; a
    /// column out of bounds or not strictly increasing within its window; a zero mask or a mask
    /// bit past the last row; a nonzero value at a slot whose mask bit is clear),
    /// [`Error::TooManyEntries`] if the masks hold more than `u32::MAX` edges.
    ///
    /// ```
    /// use spattn_formats::MeBcrs;
    /// // 3 × 5: row 0 -> {1, 4}, row 2 -> {4}.
    /// let me = MeBcrs::try_new(3, 5, 8, vec![0, 2], vec![1, 4], vec![0b001, 0b101], None)?;
    /// assert_eq!(me.to_csr()?.row(2), &[4]);
    /// assert!(MeBcrs::try_new(3, 5, 8, vec![0, 2], vec![4, 1], vec![1, 1], None).is_err());
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn try_new(
        n_rows: usize,
        n_cols: usize,
        block_width: usize,
        row_pointers: Vec<u32>,
        column_indices: Vec<u32>,
        row_masks: Vec<u8>,
        values: Option<Vec<f32>>,
    ) -> Result<Self> {
        check_block_width(block_width)?;
        check_shape(n_rows, n_cols)?;
        let n_windows = n_rows.div_ceil(ROWS);
        check_len("row_pointers", n_windows + 1, row_pointers.len())?;
        let n_vectors = column_indices.len();
        check_len("row_masks", n_vectors, row_masks.len())?;
        if let Some(v) = &values {
            check_len("values", n_vectors * ROWS, v.len())?;
        }
        check_pointers("ME-BCRS", "row_pointers", &row_pointers, n_vectors)?;

        // Per-window checks, in parallel; the first bad window is reported.
        let bad = (0..n_windows)
            .into_par_iter()
            .with_min_len(256)
            .find_map_first(|w| {
                check_window(
                    w,
                    n_rows,
                    n_cols,
                    &row_pointers,
                    &column_indices,
                    &row_masks,
                    values.as_deref(),
                )
                .err()
            });
        if let Some(err) = bad {
            return Err(err);
        }

        // Edges per row, then their prefix sum: the CSR row offsets.
        let edge_offsets = edge_offsets_of_items::<ROWS>(n_rows, &row_pointers, |v, counts| {
            for_each_bit(row_masks[v] as u32, |r| counts[r] += 1);
        })?;

        let (n_blocks, max_blocks) = Self::block_counts(&row_pointers, block_width);
        Ok(Self {
            n_rows,
            n_cols,
            block_width,
            n_blocks,
            max_blocks_per_window: max_blocks,
            row_pointers,
            column_indices,
            row_masks,
            values,
            edge_offsets,
        })
    }

    /// The same matrix with another block width (4 or 8). The layout does not depend on it, so
    /// this is free: one conversion serves both f16 and tf32 kernels.
    ///
    /// Errors: [`Error::InvalidParameter`] if `block_width` is neither 4 nor 8.
    pub fn with_block_width(mut self, block_width: usize) -> Result<Self> {
        check_block_width(block_width)?;
        self.block_width = block_width;
        (self.n_blocks, self.max_blocks_per_window) =
            Self::block_counts(&self.row_pointers, block_width);
        Ok(self)
    }

    /// The tensor-core blocks of the windows `row_pointers` delimit at `block_width` vectors a
    /// block (partial blocks counted whole), and the most in one window: `(blocks, largest)`.
    /// A decreasing pair of pointers counts as an empty window.
    ///
    /// ```
    /// use spattn_formats::MeBcrs;
    /// assert_eq!(MeBcrs::block_counts(&[0, 9, 9, 12], 8), (3, 2));
    /// ```
    pub fn block_counts(row_pointers: &[u32], block_width: usize) -> (usize, usize) {
        row_pointers.windows(2).fold((0, 0), |(n, most), p| {
            let blocks = (p[1].saturating_sub(p[0]) as usize).div_ceil(block_width.max(1));
            (n + blocks, most.max(blocks))
        })
    }

    /// Number of rows of the matrix.
    pub fn n_rows(&self) -> usize {
        self.n_rows
    }
    /// Number of columns of the matrix.
    pub fn n_cols(&self) -> usize {
        self.n_cols
    }
    /// Number of edges (stored entries of the CSR matrix).
    pub fn nnz(&self) -> usize {
        self.edge_offsets.last().map_or(0, |&e| e as usize)
    }
    /// Vectors per tensor-core block: 8 (f16/bf16) or 4 (tf32).
    pub fn block_width(&self) -> usize {
        self.block_width
    }
    /// Number of 8-row windows: `ceil(n_rows / 8)`.
    pub fn n_windows(&self) -> usize {
        self.row_pointers.len() - 1
    }
    /// Number of vectors (distinct columns summed over windows).
    pub fn n_vectors(&self) -> usize {
        self.column_indices.len()
    }
    /// Number of tensor-core blocks, partial ones included: the sum of
    /// [`MeBcrs::blocks_in_window`].
    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }
    /// Length of a slot-major array (values, scores): `n_vectors · 8`.
    pub fn n_slots(&self) -> usize {
        self.n_vectors() * ROWS
    }
    /// Window pointers (`n_windows + 1` entries): window `w` owns vectors
    /// `row_pointers[w]..row_pointers[w + 1]`.
    pub fn row_pointers(&self) -> &[u32] {
        &self.row_pointers
    }
    /// The column of every vector, ascending within each window.
    pub fn column_indices(&self) -> &[u32] {
        &self.column_indices
    }
    /// One mask per vector: bit `r` set iff row `8w + r` has an edge to the vector's column.
    pub fn row_masks(&self) -> &[u8] {
        &self.row_masks
    }
    /// Values per slot (`n_vectors · 8` entries, slot `vector · 8 + r`, 0 where the mask bit is
    /// clear), if the matrix has values.
    pub fn values(&self) -> Option<&[f32]> {
        self.values.as_deref()
    }
    /// CSR row offsets of the pattern (`n_rows + 1` entries): row `i`'s edges are CSR entries
    /// `edge_offsets[i]..edge_offsets[i + 1]`, so window `w`'s edges are
    /// `edge_offsets[8w]..edge_offsets[min(8w + 8, n_rows)]`.
    pub fn edge_offsets(&self) -> &[u32] {
        &self.edge_offsets
    }
    /// Vector range of window `w`.
    ///
    /// # Panics
    /// If `w >= n_windows`.
    pub fn window_vectors(&self, w: usize) -> Range<usize> {
        self.row_pointers[w] as usize..self.row_pointers[w + 1] as usize
    }
    /// Number of vectors of window `w`.
    ///
    /// # Panics
    /// If `w >= n_windows`.
    pub fn vectors_in_window(&self, w: usize) -> usize {
        (self.row_pointers[w + 1] - self.row_pointers[w]) as usize
    }
    /// Number of tensor-core blocks of window `w`: `ceil(vectors / block_width)`.
    ///
    /// # Panics
    /// If `w >= n_windows`.
    pub fn blocks_in_window(&self, w: usize) -> usize {
        self.vectors_in_window(w).div_ceil(self.block_width)
    }
    /// Columns of window `w`'s vectors, ascending.
    ///
    /// # Panics
    /// If `w >= n_windows`.
    pub fn window_columns(&self, w: usize) -> &[u32] {
        &self.column_indices[self.window_vectors(w)]
    }
    /// Masks of window `w`'s vectors.
    ///
    /// # Panics
    /// If `w >= n_windows`.
    pub fn window_masks(&self, w: usize) -> &[u8] {
        &self.row_masks[self.window_vectors(w)]
    }

    /// Converts back to CSR: exactly the matrix this was built from (same pattern, same values).
    pub fn to_csr(&self) -> Result<Csr> {
        let mut cols = vec![0u32; self.nnz()];
        // Slot `vector · 8 + r` holds the vector's column.
        self.for_each_edge(&mut cols, |out, slot| {
            *out = self.column_indices[slot / ROWS]
        });
        let values = self.values.as_deref().map(|src| self.gather_slots(src));
        Ok(Csr::from_parts_unchecked(
            self.n_rows,
            self.n_cols,
            self.edge_offsets.clone(),
            cols,
            values,
        ))
    }

    /// Fill of the whole matrix: blocks, edges, and `slots = blocks × 8 rows × block_width`
    /// (the partial last block of a window counted whole, as a tensor core computes it).
    pub fn fill_stats(&self) -> FillStats {
        FillStats {
            windows: self.n_windows(),
            blocks: self.n_blocks,
            edges: self.nnz(),
            slots: self.n_blocks * ROWS * self.block_width,
            max_blocks_per_window: self.max_blocks_per_window,
        }
    }

    /// Fill of window `w`: its edges over `blocks_in_window(w) × 8 × block_width`; 0 for a
    /// window with no edges.
    ///
    /// # Panics
    /// If `w >= n_windows`.
    pub fn window_fill(&self, w: usize) -> f64 {
        self.edges_over(w, self.blocks_in_window(w) * ROWS * self.block_width)
    }

    /// Calls `f(r, slot)` for every edge of window `w`: vectors in column order, each mask's
    /// bits by row, so each row's edges by ascending column.
    fn for_each_slot_in(&self, w: usize, mut f: impl FnMut(usize, usize)) {
        for v in self.window_vectors(w) {
            for_each_bit(self.row_masks[v] as u32, |r| f(r, v * ROWS + r));
        }
    }
}

slot_windows!(MeBcrs {
    rows: ROWS,
    items: row_pointers,
    slots_per_item: ROWS,
    index: "ME-BCRS slot index",
    slot: "`vector · 8 + row_in_window`",
    limit: "2^29 vectors",
});

/// What one chunk of windows produces in [`MeBcrs::from_csr`], concatenated afterwards.
struct ChunkPart {
    vectors_per_window: Vec<u32>,
    columns: Vec<u32>,
    masks: Vec<u8>,
    values: Vec<f32>,
}

/// Builds the vectors of `windows`. `merger` is per-thread scratch, reused across windows and
/// chunks so the hot loop does not allocate.
fn build_chunk(
    windows: Range<usize>,
    offsets: &[u32],
    cols: &[u32],
    vals: Option<&[f32]>,
    merger: &mut WindowMerger,
) -> ChunkPart {
    let n_rows = offsets.len() - 1;
    let row_lo = (windows.start * ROWS).min(n_rows);
    let row_hi = (windows.end * ROWS).min(n_rows);
    // At most one vector per edge.
    let max_vectors = (offsets[row_hi] - offsets[row_lo]) as usize;
    let mut part = ChunkPart {
        vectors_per_window: Vec::with_capacity(windows.len()),
        columns: Vec::with_capacity(max_vectors),
        masks: Vec::with_capacity(max_vectors),
        values: Vec::new(),
    };
    for w in windows {
        let rows = (w * ROWS).min(n_rows)..((w + 1) * ROWS).min(n_rows);
        // The window's (column, row-in-window) keys, ordered by column, then row.
        let keys = merger.merge(offsets, cols, rows.clone(), 3);
        let first = part.columns.len();
        match vals {
            None => {
                let mut last = u64::MAX;
                for &k in keys {
                    let col = k >> 3;
                    if col != last {
                        part.columns.push(col as u32);
                        part.masks.push(0);
                        last = col;
                    }
                    let m = part.masks.len() - 1;
                    part.masks[m] |= 1 << (k & 7);
                }
            }
            Some(src) => {
                // Each row's keys come in ascending column order, i.e. in CSR order: a cursor
                // per row finds the edge (and its value) of every key.
                let mut cursor = [0usize; ROWS];
                for (r, row) in rows.enumerate() {
                    cursor[r] = offsets[row] as usize;
                }
                let mut last = u64::MAX;
                for &k in keys {
                    let (col, r) = (k >> 3, (k & 7) as usize);
                    if col != last {
                        part.columns.push(col as u32);
                        part.masks.push(0);
                        part.values.extend_from_slice(&[0.0; ROWS]);
                        last = col;
                    }
                    let v = part.masks.len() - 1;
                    part.masks[v] |= 1 << r;
                    part.values[v * ROWS + r] = src[cursor[r]];
                    cursor[r] += 1;
                }
            }
        }
        part.vectors_per_window
            .push((part.columns.len() - first) as u32);
    }
    part
}

/// Per-thread scratch that merges a window's rows into one sorted list of
/// `(column << shift) | row_in_window` keys: ordered by column, then by row.
///
/// CSR rows are already sorted, so the window's keys are one ascending run per nonempty row;
/// merging the runs pairwise (⌈log2 rows⌉ linear passes) beats a comparison sort of the
/// gathered keys. The buffers are reused across windows, so the hot loop does not allocate.
#[derive(Default)]
pub(crate) struct WindowMerger {
    keys: Vec<u64>,
    scratch: Vec<u64>,
    run_ends: Vec<usize>,
}

impl WindowMerger {
    /// The sorted keys of rows `rows` of the CSR arrays `offsets`, `cols`; `shift` is the
    /// number of bits of the row within the window (3 for 8 rows, 4 for 16).
    pub(crate) fn merge(
        &mut self,
        offsets: &[u32],
        cols: &[u32],
        rows: Range<usize>,
        shift: u32,
    ) -> &[u64] {
        self.keys.clear();
        self.run_ends.clear();
        for (r, row) in rows.enumerate() {
            let (s, e) = (offsets[row] as usize, offsets[row + 1] as usize);
            if s < e {
                self.keys.extend(
                    cols[s..e]
                        .iter()
                        .map(|&c| (u64::from(c) << shift) | r as u64),
                );
                self.run_ends.push(self.keys.len());
            }
        }
        let n = self.keys.len();
        if self.scratch.len() < n {
            self.scratch.resize(n, 0);
        }
        let mut src = &mut self.keys[..];
        let mut dst = &mut self.scratch[..n];
        let ends = &mut self.run_ends;
        let mut runs = ends.len();
        while runs > 1 {
            let (mut start, mut k, mut merged) = (0, 0, 0);
            while k < runs {
                let mid = ends[k];
                let end = if k + 1 < runs { ends[k + 1] } else { mid };
                merge_into(&src[start..mid], &src[mid..end], &mut dst[start..end]);
                ends[merged] = end;
                merged += 1;
                start = end;
                k += 2;
            }
            runs = merged;
            std::mem::swap(&mut src, &mut dst);
        }
        src
    }
}

/// Merges the ascending slices `a` and `b` (no key in both) into `out` (`a.len() + b.len()`).
///
/// Bidirectional: each iteration places the smallest remaining key at the front and the largest
/// at the back. The two steps do not depend on each other, so the CPU overlaps them (a one-sided
/// merge is bound by the latency of compare → index update → next load). While both inputs have
/// an unplaced key at the start of an iteration, every index read is in bounds: the back step may
/// read a key the front step just placed, but only when the other input holds every remaining
/// key, all larger, so the back step then correctly takes from the other input.
#[inline]
fn merge_into(a: &[u64], b: &[u64], out: &mut [u64]) {
    let (mut i, mut j, mut k) = (0, 0, 0);
    let (mut ia, mut jb, mut kb) = (a.len(), b.len(), out.len());
    while i < ia && j < jb {
        let (x, y) = (a[i], b[j]);
        let front_a = x < y;
        out[k] = if front_a { x } else { y };
        i += usize::from(front_a);
        j += usize::from(!front_a);
        k += 1;
        let (x, y) = (a[ia - 1], b[jb - 1]);
        let back_a = x > y;
        kb -= 1;
        out[kb] = if back_a { x } else { y };
        ia -= usize::from(back_a);
        jb -= usize::from(!back_a);
    }
    if i < ia {
        out[k..kb].copy_from_slice(&a[i..ia]);
    } else {
        out[k..kb].copy_from_slice(&b[j..jb]);
    }
}

/// Checks the vectors of window `w` (columns, masks, values at unmasked slots).
fn check_window(
    w: usize,
    n_rows: usize,
    n_cols: usize,
    row_pointers: &[u32],
    column_indices: &[u32],
    row_masks: &[u8],
    values: Option<&[f32]>,
) -> Result<()> {
    let range = row_pointers[w] as usize..row_pointers[w + 1] as usize;
    let rows_here = (n_rows - w * ROWS).min(ROWS);
    // Bits for rows past the end of the matrix (only in a partial last window).
    let past_end: u8 = if rows_here == ROWS {
        0
    } else {
        !((1u8 << rows_here) - 1)
    };
    for v in range.clone() {
        let col = column_indices[v];
        let bad = |what: &'static str, index: usize, why: String| Error::InvalidLayout {
            format: "ME-BCRS",
            what,
            index,
            why,
        };
        if col as usize >= n_cols {
            return Err(bad(
                "column_indices",
                v,
                format!("column {col} of window {w} is out of bounds for {n_cols} columns"),
            ));
        }
        if v > range.start && column_indices[v - 1] >= col {
            return Err(bad(
                "column_indices",
                v,
                format!(
                    "column {col} of window {w} follows column {}: columns must be strictly \
                     increasing within a window",
                    column_indices[v - 1]
                ),
            ));
        }
        let mask = row_masks[v];
        if mask == 0 {
            return Err(bad(
                "row_masks",
                v,
                format!("the mask of column {col} in window {w} is 0 (a vector with no edge)"),
            ));
        }
        if mask & past_end != 0 {
            return Err(bad(
                "row_masks",
                v,
                format!(
                    "mask {mask:#04x} of window {w} marks a row past the last row {}",
                    n_rows - 1
                ),
            ));
        }
        if let Some(vals) = values {
            for r in 0..ROWS {
                let x = vals[v * ROWS + r];
                if mask & (1 << r) == 0 && x != 0.0 {
                    return Err(bad(
                        "values",
                        v * ROWS + r,
                        format!("value {x} at a slot whose mask bit is clear (must be 0)"),
                    ));
                }
            }
        }
    }
    Ok(())
}

fn check_block_width(block_width: usize) -> Result<()> {
    if block_width == MeBcrs::BLOCK_WIDTH_F16 || block_width == MeBcrs::BLOCK_WIDTH_TF32 {
        Ok(())
    } else {
        Err(Error::InvalidParameter {
            what: "block_width",
            why: format!("{block_width} vectors per block; use 8 (f16/bf16) or 4 (tf32)"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merger_sorts_runs() {
        // Rows: {1, 5, 9}, {}, {0, 5}, {2}, {9, 10, 11, 12}
        let offsets = [0u32, 3, 3, 5, 6, 10];
        let cols = [1u32, 5, 9, 0, 5, 2, 9, 10, 11, 12];
        let mut m = WindowMerger::default();
        for rows in [0..5, 0..1, 1..2, 2..5, 1..4] {
            let mut expected: Vec<u64> = Vec::new();
            for (r, row) in rows.clone().enumerate() {
                let range = offsets[row] as usize..offsets[row + 1] as usize;
                expected.extend(cols[range].iter().map(|&c| (u64::from(c) << 4) | r as u64));
            }
            expected.sort_unstable();
            assert_eq!(m.merge(&offsets, &cols, rows, 4), &expected[..]);
        }
    }
}
