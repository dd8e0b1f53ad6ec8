//! BSB: Fused3S's binary sparse blocks, the format of fused tensor-core attention.
//!
//! # Layout
//!
//! Rows are grouped into **windows** of 16: window `w` holds rows `16w .. 16w + 16`; the last
//! window is partial when `n_rows % 16 != 0` (its missing rows never have a bit set). The
//! distinct columns of a window, sorted ascending, are grouped 8 at a time into 16×8 **blocks**;
//! the last block of a window is padded up to 8 column slots with [`Bsb::PADDING`]. Each block
//! has one `u128` **bitmap**: bit `r·8 + c` is set iff row `16w + r` has an edge to the column in
//! slot `c` of the block.
//!
//! ```text
//!  The 10 × 12 example of the ME-BCRS docs: one (partial) window, 9 distinct columns, 2 blocks.
//!
//!               block 0                             block 1
//!  slot c       0  1  2  3  4  5  6  7              0  1  2  3  4  5  6  7
//!  column       0  1  2  3  4  5  7  9              11 P  P  P  P  P  P  P    P = Bsb::PADDING
//!  row 0        .  x  .  .  x  .  .  .   bits 1, 4  .  .  .  .  .  .  .  .
//!  row 1        .  .  .  .  x  .  .  .   12         .  .  .  .  .  .  .  .
//!  row 2        .  .  .  .  .  .  .  .              .  .  .  .  .  .  .  .
//!  row 3        x  .  .  .  .  .  .  x   24, 31     .  .  .  .  .  .  .  .
//!  row 4        .  .  .  .  x  .  x  .   36, 38     .  .  .  .  .  .  .  .
//!  row 5        .  .  .  .  .  .  .  .              .  .  .  .  .  .  .  .
//!  row 6        .  .  x  .  .  .  .  .   50         .  .  .  .  .  .  .  .
//!  row 7        .  .  .  .  .  .  x  .   62         .  .  .  .  .  .  .  .
//!  row 8        .  .  .  x  .  x  .  .   67, 69     .  .  .  .  .  .  .  .
//!  row 9        .  .  .  .  .  x  .  .   77         x  .  .  .  .  .  .  .   bit 72
//!  rows 10..15  (past n_rows: never a bit)
//!
//!  window_offsets = [0, 2]            window w owns blocks window_offsets[w]..[w + 1]
//!  block_columns  = [0, 1, 2, 3, 4, 5, 7, 9,  11, P, P, P, P, P, P, P]
//!  bitmaps        = [bits {1, 4, 12, 24, 31, 36, 38, 50, 62, 67, 69, 77}, bits {72}]
//!  edge_to_slot   = [1, 4, 12, 24, 31, 36, 38, 50, 62, 67, 69, 77, 128 + 72]
//! ```
//!
//! - `window_offsets` (`u32`, `n_windows + 1` entries): prefix sum of the block counts.
//! - `block_columns` (`u32`, 8 per block): the column of every slot, strictly increasing across
//!   the blocks of a window. Padding slots hold [`Bsb::PADDING`] (`u32::MAX`, never a node: see
//!   [`crate::MAX_DIM`]); they occur only at the end of the last block of a window, and a kernel
//!   must not load a feature row for them.
//! - `bitmaps` (`u128`, one per block): every real slot's column has at least one bit (so no
//!   bitmap is 0), padding slots and rows past `n_rows` have none. For device upload,
//!   [`Bsb::bitmap_words`] gives each bitmap as two little-endian `u64` words (word 0 = rows 0–7,
//!   word 1 = rows 8–15) and [`Bsb::bitmap_words_u32`] as four `u32` words (word `k` = rows
//!   `2k`, `2k + 1`).
//! - `window_order`: window ids sorted by block count, largest first, ties by id, for
//!   scheduling the heaviest windows first.
//!
//! # Slots, values and per-edge data
//!
//! A **slot** is one position of one block: slot `block · 128 + r · 8 + c`. Slot-major data (SDDMM
//! scores in block layout) has `n_blocks · 128` entries; [`Bsb::edge_to_slot`] gives the slot of
//! every CSR edge, and [`Bsb::gather_to_csr_order`] / [`Bsb::scatter_to_slots`] move data
//! between the orders. Values, when the CSR matrix has them, are kept **per edge in CSR order**
//! (`nnz` entries, [`Bsb::values`]): a per-slot copy would take 128 floats per block, most of
//! them padding.

use std::cmp::Reverse;
use std::ops::Range;

use rayon::prelude::*;

use crate::csr::{check_shape, Csr};
use crate::error::{Error, Result};
use crate::mebcrs::WindowMerger;
use crate::offsets::{check_len, check_pointers, for_each_bit, plan_chunks, split_by_lens};
use crate::stats::FillStats;
use crate::window::{edge_offsets_of_items, slot_windows, SlotWindows};

/// Rows per BSB window.
const ROWS: usize = 16;
/// Column slots per block.
const COLS: usize = 8;
/// Slots per block.
const SLOTS: usize = ROWS * COLS;

/// Fused3S's binary sparse blocks: 16-row windows, 16×8 blocks with one `u128` bitmap each.
/// See the [module documentation](self) for the exact layout.
///
/// Invariants (checked by [`Bsb::try_new`], guaranteed by [`Bsb::from_csr`]): `window_offsets`
/// has `n_windows + 1` entries, starts at 0, never decreases and ends at the block count;
/// `block_columns` holds 8 entries per block, the real ones strictly increasing within a window
/// and below `n_cols`, padding only as a suffix of a window's last block; every real slot has
/// at least one bit, padding slots and rows past `n_rows` none; values, when present, hold one
/// entry per edge in CSR order.
#[derive(Clone, Debug, PartialEq)]
pub struct Bsb {
    n_rows: usize,
    n_cols: usize,
    max_blocks_per_window: usize,
    window_offsets: Vec<u32>,
    block_columns: Vec<u32>,
    bitmaps: Vec<u128>,
    window_order: Vec<u32>,
    values: Option<Vec<f32>>,
    /// CSR row offsets of the same pattern: where each row's edges start in CSR order.
    edge_offsets: Vec<u32>,
}

impl Bsb {
    /// Rows per window: 16.
    pub const WINDOW_ROWS: usize = ROWS;
    /// Column slots per block: 8.
    pub const BLOCK_COLS: usize = COLS;
    /// Slots (bits) per block: 16 × 8 = 128.
    pub const SLOTS_PER_BLOCK: usize = SLOTS;
    /// The column id of a padding slot in [`Bsb::block_columns`]: `u32::MAX`, which is never a
    /// node (dimensions are at most [`crate::MAX_DIM`]). A kernel must not load a row for it.
    pub const PADDING: u32 = u32::MAX;

    /// Converts a CSR matrix to BSB. Values, if the matrix has them, are kept per edge in CSR
    /// order. Windows are built in parallel. Never fails on a valid [`Csr`]; the `Result` is for
    /// symmetry with the other conversions.
    ///
    /// ```
    /// use spattn_formats::{Bsb, Csr};
    /// // Row 0 -> {2, 9}, row 1 -> {9}, row 17 -> {0}: two windows.
    /// let a = Csr::from_edges(18, 10, &[(0, 2), (0, 9), (1, 9), (17, 0)])?;
    /// let bsb = Bsb::from_csr(&a)?;
    /// assert_eq!(bsb.window_offsets(), &[0, 1, 2]);
    /// let p = Bsb::PADDING;
    /// assert_eq!(&bsb.block_columns()[..8], &[2, 9, p, p, p, p, p, p]);
    /// // Row r, slot c -> bit r·8 + c: (0, 2) is bit 0, (0, 9) bit 1, (1, 9) bit 9.
    /// assert_eq!(bsb.bitmaps()[0], 1 << 0 | 1 << 1 | 1 << 9);
    /// assert_eq!(bsb.bitmaps()[1], 1 << 8); // row 17 = row 1 of window 1, slot 0
    /// assert_eq!(bsb.edge_to_slot()?, vec![0, 1, 9, 128 + 8]);
    /// assert_eq!(bsb.to_csr()?, a);
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn from_csr(a: &Csr) -> Result<Self> {
        let offsets = a.row_offsets();
        let cols = a.col_indices();
        let chunks = plan_chunks(offsets, ROWS);
        let parts: Vec<ChunkPart> = chunks
            .par_iter()
            .map_init(WindowMerger::default, |merger, windows| {
                build_chunk(windows.clone(), offsets, cols, merger)
            })
            .collect();

        let n_windows = a.n_rows().div_ceil(ROWS);
        let mut window_offsets = Vec::with_capacity(n_windows + 1);
        window_offsets.push(0u32);
        let mut n_blocks = 0usize;
        for part in &parts {
            for &count in &part.blocks_per_window {
                n_blocks += count as usize;
                // At most one block per edge, and at most u32::MAX edges: no overflow.
                window_offsets.push(n_blocks as u32);
            }
        }
        let mut block_columns = vec![0u32; n_blocks * COLS];
        let mut bitmaps = vec![0u128; n_blocks];
        let col_slices = split_by_lens(&mut block_columns, parts.iter().map(|p| p.columns.len()));
        let map_slices = split_by_lens(&mut bitmaps, parts.iter().map(|p| p.bitmaps.len()));
        parts
            .par_iter()
            .zip(col_slices)
            .zip(map_slices)
            .for_each(|((part, c), m)| {
                c.copy_from_slice(&part.columns);
                m.copy_from_slice(&part.bitmaps);
            });
        let (window_order, max_blocks) = order_windows(&window_offsets);
        Ok(Self {
            n_rows: a.n_rows(),
            n_cols: a.n_cols(),
            max_blocks_per_window: max_blocks,
            window_offsets,
            block_columns,
            bitmaps,
            window_order,
            values: a.values().map(<[f32]>::to_vec),
            edge_offsets: offsets.to_vec(),
        })
    }

    /// Builds a BSB matrix from its arrays (laid out as in the [module documentation](self)),
    /// checking every invariant; `window_order` is computed. `values`, if given, are per edge in
    /// CSR order.
    ///
    /// Errors: [`Error::DimensionTooLarge`] (`n_rows` or `n_cols` above [`crate::MAX_DIM`]),
    /// [`Error::LengthMismatch`] (`window_offsets` not `n_windows + 1` long, `block_columns` not
    /// 8 per bitmap, `values` not one per edge), [`Error::InvalidLayout`] naming the array and
    /// index that break an invariant (offsets not starting at 0, decreasing or not ending at the
    /// block count; a column out of bounds or not strictly increasing within its window; padding
    /// before a real slot or outside a window's last block; a real slot with no bit, a bit on a
    /// padding slot or on a row past the last row), [`Error::TooManyEntries`] if the bitmaps hold
    /// more than `u32::MAX` edges.
    ///
    /// ```
    /// use spattn_formats::Bsb;
    /// let p = Bsb::PADDING;
    /// // 2 × 4: row 0 -> {3}, row 1 -> {1, 3}.
    /// let bsb = Bsb::try_new(2, 4, vec![0, 1], vec![1, 3, p, p, p, p, p, p], vec![0b11_0000_0010], None)?;
    /// assert_eq!(bsb.to_csr()?.row(1), &[1, 3]);
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn try_new(
        n_rows: usize,
        n_cols: usize,
        window_offsets: Vec<u32>,
        block_columns: Vec<u32>,
        bitmaps: Vec<u128>,
        values: Option<Vec<f32>>,
    ) -> Result<Self> {
        check_shape(n_rows, n_cols)?;
        let n_windows = n_rows.div_ceil(ROWS);
        check_len("window_offsets", n_windows + 1, window_offsets.len())?;
        let n_blocks = bitmaps.len();
        check_len("block_columns", n_blocks * COLS, block_columns.len())?;
        check_pointers("BSB", "window_offsets", &window_offsets, n_blocks)?;
        let bad = (0..n_windows)
            .into_par_iter()
            .with_min_len(64)
            .find_map_first(|w| {
                check_window(w, n_rows, n_cols, &window_offsets, &block_columns, &bitmaps).err()
            });
        if let Some(err) = bad {
            return Err(err);
        }

        // Edges per row (popcount of each row's byte of every bitmap), then the prefix sum.
        let edge_offsets = edge_offsets_of_items::<ROWS>(n_rows, &window_offsets, |b, counts| {
            for (r, count) in counts.iter_mut().enumerate() {
                *count += ((bitmaps[b] >> (r * COLS)) as u8).count_ones();
            }
        })?;
        if let Some(v) = &values {
            check_len("values", edge_offsets[n_rows] as usize, v.len())?;
        }
        let (window_order, max_blocks) = order_windows(&window_offsets);
        Ok(Self {
            n_rows,
            n_cols,
            max_blocks_per_window: max_blocks,
            window_offsets,
            block_columns,
            bitmaps,
            window_order,
            values,
            edge_offsets,
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
    /// Number of 16-row windows: `ceil(n_rows / 16)`.
    pub fn n_windows(&self) -> usize {
        self.window_offsets.len() - 1
    }
    /// Number of 16×8 blocks.
    pub fn n_blocks(&self) -> usize {
        self.bitmaps.len()
    }
    /// Length of a slot-major array (scores in block layout): `n_blocks · 128`.
    pub fn n_slots(&self) -> usize {
        self.n_blocks() * SLOTS
    }
    /// Window offsets (`n_windows + 1` entries): window `w` owns blocks
    /// `window_offsets[w]..window_offsets[w + 1]`.
    pub fn window_offsets(&self) -> &[u32] {
        &self.window_offsets
    }
    /// The column of every slot, 8 per block (block `b`'s at `8b..8b + 8`); padding slots hold
    /// [`Bsb::PADDING`].
    pub fn block_columns(&self) -> &[u32] {
        &self.block_columns
    }
    /// One bitmap per block: bit `r·8 + c` set iff row `16w + r` has an edge to slot `c`'s
    /// column.
    pub fn bitmaps(&self) -> &[u128] {
        &self.bitmaps
    }
    /// The bitmaps as little-endian `u64` words, 2 per block: word `2b` holds bits 0–63 (rows
    /// 0–7), word `2b + 1` bits 64–127 (rows 8–15). The byte image of a `u128` on a
    /// little-endian device.
    pub fn bitmap_words(&self) -> Vec<u64> {
        self.bitmaps
            .par_iter()
            .with_min_len(1 << 12)
            .flat_map_iter(|&b| [b as u64, (b >> 64) as u64])
            .collect()
    }
    /// The bitmaps as little-endian `u32` words, 4 per block: word `4b + k` holds bits
    /// `32k..32k + 32` (rows `4k` to `4k + 3`, 8 bits each).
    pub fn bitmap_words_u32(&self) -> Vec<u32> {
        self.bitmaps
            .par_iter()
            .with_min_len(1 << 12)
            .flat_map_iter(|&b| {
                [
                    b as u32,
                    (b >> 32) as u32,
                    (b >> 64) as u32,
                    (b >> 96) as u32,
                ]
            })
            .collect()
    }
    /// Window ids sorted by block count, largest first, ties by window id.
    pub fn window_order(&self) -> &[u32] {
        &self.window_order
    }
    /// Values per edge in CSR order (`nnz` entries), if the matrix has values.
    pub fn values(&self) -> Option<&[f32]> {
        self.values.as_deref()
    }
    /// CSR row offsets of the pattern (`n_rows + 1` entries): row `i`'s edges are CSR entries
    /// `edge_offsets[i]..edge_offsets[i + 1]`.
    pub fn edge_offsets(&self) -> &[u32] {
        &self.edge_offsets
    }
    /// Block range of window `w`.
    ///
    /// # Panics
    /// If `w >= n_windows`.
    pub fn window_blocks(&self, w: usize) -> Range<usize> {
        self.window_offsets[w] as usize..self.window_offsets[w + 1] as usize
    }
    /// Number of blocks of window `w`.
    ///
    /// # Panics
    /// If `w >= n_windows`.
    pub fn blocks_in_window(&self, w: usize) -> usize {
        (self.window_offsets[w + 1] - self.window_offsets[w]) as usize
    }

    /// Converts back to CSR: exactly the matrix this was built from (same pattern, same values).
    pub fn to_csr(&self) -> Result<Csr> {
        let mut cols = vec![0u32; self.nnz()];
        // Slot `b·128 + r·8 + c` holds the column of block `b`'s slot `c`.
        self.for_each_edge(&mut cols, |out, slot| {
            *out = self.block_columns[slot / SLOTS * COLS + slot % COLS];
        });
        Ok(Csr::from_parts_unchecked(
            self.n_rows,
            self.n_cols,
            self.edge_offsets.clone(),
            cols,
            self.values.clone(),
        ))
    }

    /// Fill of the whole matrix: blocks, edges, and `slots = blocks × 128`.
    pub fn fill_stats(&self) -> FillStats {
        FillStats {
            windows: self.n_windows(),
            blocks: self.n_blocks(),
            edges: self.nnz(),
            slots: self.n_slots(),
            max_blocks_per_window: self.max_blocks_per_window,
        }
    }

    /// Fill of window `w`: its edges over `blocks_in_window(w) × 128`; 0 for a window with no
    /// edges.
    ///
    /// # Panics
    /// If `w >= n_windows`.
    pub fn window_fill(&self, w: usize) -> f64 {
        self.edges_over(w, self.blocks_in_window(w) * SLOTS)
    }

    /// Calls `f(r, slot)` for every edge of window `w`: blocks in column order, bits in
    /// row-then-slot order, so each row's edges by ascending column.
    fn for_each_slot_in(&self, w: usize, mut f: impl FnMut(usize, usize)) {
        for b in self.window_blocks(w) {
            self.for_each_bit_of(b, |r, c| f(r, b * SLOTS + r * COLS + c));
        }
    }

    /// Calls `f(r, c)` for every set bit of block `b`'s bitmap, in bit order (row by row, and
    /// by slot within a row).
    #[inline]
    fn for_each_bit_of(&self, b: usize, mut f: impl FnMut(usize, usize)) {
        let bm = self.bitmaps[b];
        let mut word = |w: u64, first_row: usize| {
            let (lo, hi) = (w as u32, (w >> 32) as u32);
            for_each_bit(lo, |bit| f(first_row + bit / COLS, bit % COLS));
            for_each_bit(hi, |bit| f(first_row + 4 + bit / COLS, bit % COLS));
        };
        word(bm as u64, 0);
        word((bm >> 64) as u64, 8);
    }
}

slot_windows!(Bsb {
    rows: ROWS,
    items: window_offsets,
    slots_per_item: SLOTS,
    index: "BSB slot index",
    slot: "`block · 128 + r · 8 + c`",
    limit: "2^25 blocks",
});

/// What a BSB of a matrix would hold, counted without building it
/// ([`Bsb::count_with_row_order`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WindowCount {
    /// Number of 16-row windows.
    pub windows: usize,
    /// (window, distinct column) pairs: the K and V rows fused tensor-core attention gathers
    /// per head (each window loads each of its columns' rows once).
    pub columns: usize,
    /// 16×8 blocks: `ceil(columns of the window / 8)` summed over the windows.
    pub blocks: usize,
    /// Edges.
    pub edges: usize,
}

impl WindowCount {
    /// Block fill: `edges / (blocks × 128)`, 0 without blocks.
    pub fn fill(&self) -> f64 {
        if self.blocks == 0 {
            0.0
        } else {
            self.edges as f64 / (self.blocks * SLOTS) as f64
        }
    }
}

impl Bsb {
    /// Counts the windows, (window, column) pairs and blocks of the BSB of `a` with its rows
    /// taken in the order of `rows` (row `new` of the reordered matrix is row
    /// `rows.old_of_new()[new]` of `a`; the identity when `None`), column ids unchanged —
    /// what [`Bsb::from_csr`] of [`Permutation::permute_csr_rows`] would hold, without building
    /// it. Renaming the columns too (as [`Permutation::permute_csr`] does) changes none of the
    /// counts. Windows in parallel; cheap enough to compare node orders when a plan is built.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] if `rows` does not have one entry per row of `a`.
    ///
    /// [`Permutation::permute_csr_rows`]: crate::Permutation::permute_csr_rows
    /// [`Permutation::permute_csr`]: crate::Permutation::permute_csr
    ///
    /// ```
    /// use spattn_formats::{Bsb, Csr};
    /// let a = Csr::from_edges(18, 10, &[(0, 2), (0, 9), (1, 9), (17, 0)])?;
    /// let c = Bsb::count_with_row_order(&a, None)?;
    /// assert_eq!((c.windows, c.columns, c.blocks, c.edges), (2, 3, 2, 4));
    /// assert_eq!(c.blocks, Bsb::from_csr(&a)?.n_blocks());
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn count_with_row_order(a: &Csr, rows: Option<&crate::Permutation>) -> Result<WindowCount> {
        let (n_windows, columns, blocks) = crate::reorder::count_windows(a, rows, ROWS, COLS)?;
        Ok(WindowCount {
            windows: n_windows,
            columns,
            blocks,
            edges: a.nnz(),
        })
    }
}

/// What one chunk of windows produces in [`Bsb::from_csr`], concatenated afterwards.
struct ChunkPart {
    blocks_per_window: Vec<u32>,
    columns: Vec<u32>,
    bitmaps: Vec<u128>,
}

/// Builds the blocks of `windows`. `merger` is per-thread scratch reused across windows.
fn build_chunk(
    windows: Range<usize>,
    offsets: &[u32],
    cols: &[u32],
    merger: &mut WindowMerger,
) -> ChunkPart {
    let n_rows = offsets.len() - 1;
    let row_lo = (windows.start * ROWS).min(n_rows);
    let row_hi = (windows.end * ROWS).min(n_rows);
    // At most one block per edge; usually far fewer, so reserve for 2 edges per slot column.
    let nnz = (offsets[row_hi] - offsets[row_lo]) as usize;
    let mut part = ChunkPart {
        blocks_per_window: Vec::with_capacity(windows.len()),
        columns: Vec::with_capacity(nnz + COLS * windows.len()),
        bitmaps: Vec::with_capacity(nnz / COLS + windows.len()),
    };
    for w in windows {
        let rows = (w * ROWS).min(n_rows)..((w + 1) * ROWS).min(n_rows);
        // The window's (column, row-in-window) keys, ordered by column, then row.
        let keys = merger.merge(offsets, cols, rows, 4);
        let first_block = part.bitmaps.len();
        let mut last = u64::MAX;
        // Slot of the current column within its block; starts "full" so the first column opens
        // a block.
        let mut c = COLS - 1;
        for &k in keys {
            let col = k >> 4;
            if col != last {
                c += 1;
                if c == COLS {
                    c = 0;
                    part.bitmaps.push(0);
                }
                part.columns.push(col as u32);
                last = col;
            }
            let b = part.bitmaps.len() - 1;
            part.bitmaps[b] |= 1u128 << ((k & 15) as usize * COLS + c);
        }
        // Pad the last block of the window.
        part.columns.resize(part.bitmaps.len() * COLS, Bsb::PADDING);
        part.blocks_per_window
            .push((part.bitmaps.len() - first_block) as u32);
    }
    part
}

/// The window order of a BSB with these window offsets (`n_windows + 1` entries): window ids by
/// block count, largest first, ties by id ([`Bsb::window_order`]), and the largest count. For a
/// BSB whose offsets were made elsewhere (on a GPU).
///
/// ```
/// // Windows of 1, 3, 0 and 3 blocks.
/// let (order, max) = spattn_formats::bsb::order_windows(&[0, 1, 4, 4, 7]);
/// assert_eq!((order, max), (vec![1, 3, 0, 2], 3));
/// ```
pub fn order_windows(window_offsets: &[u32]) -> (Vec<u32>, usize) {
    let n_windows = window_offsets.len().saturating_sub(1);
    let count = |w: u32| window_offsets[w as usize + 1].saturating_sub(window_offsets[w as usize]);
    // n_windows <= ceil(MAX_DIM / 16) fits in u32.
    let mut order: Vec<u32> = (0..n_windows as u32).collect();
    order.par_sort_unstable_by_key(|&w| (Reverse(count(w)), w));
    let max = order.first().map_or(0, |&w| count(w) as usize);
    (order, max)
}

/// Checks the blocks of window `w` (columns, padding, bitmaps).
fn check_window(
    w: usize,
    n_rows: usize,
    n_cols: usize,
    window_offsets: &[u32],
    block_columns: &[u32],
    bitmaps: &[u128],
) -> Result<()> {
    let blocks = window_offsets[w] as usize..window_offsets[w + 1] as usize;
    let rows_here = (n_rows - w * ROWS).min(ROWS);
    let bad = |what: &'static str, index: usize, why: String| Error::InvalidLayout {
        format: "BSB",
        what,
        index,
        why,
    };
    let mut prev: Option<u32> = None;
    for b in blocks.clone() {
        let bm = bitmaps[b];
        if rows_here < ROWS && bm >> (rows_here * COLS) != 0 {
            return Err(bad(
                "bitmaps",
                b,
                format!(
                    "block {b} of window {w} has a bit on a row past the last row {}",
                    n_rows - 1
                ),
            ));
        }
        for c in 0..COLS {
            let slot = b * COLS + c;
            let col = block_columns[slot];
            // The bits of slot c, one per row.
            let column_bits = (0..ROWS).any(|r| bm >> (r * COLS + c) & 1 != 0);
            if col == Bsb::PADDING {
                if column_bits {
                    return Err(bad(
                        "bitmaps",
                        b,
                        format!("block {b} of window {w} has a bit on padding slot {c}"),
                    ));
                }
                if b + 1 != blocks.end {
                    return Err(bad(
                        "block_columns",
                        slot,
                        format!(
                            "padding in block {b} of window {w}, which is not the window's \
                             last block"
                        ),
                    ));
                }
                continue;
            }
            if c > 0 && block_columns[slot - 1] == Bsb::PADDING {
                return Err(bad(
                    "block_columns",
                    slot,
                    format!("column {col} follows a padding slot in block {b} of window {w}"),
                ));
            }
            if col as usize >= n_cols {
                return Err(bad(
                    "block_columns",
                    slot,
                    format!("column {col} of window {w} is out of bounds for {n_cols} columns"),
                ));
            }
            if let Some(p) = prev {
                if p >= col {
                    return Err(bad(
                        "block_columns",
                        slot,
                        format!(
                            "column {col} of window {w} follows column {p}: columns must be \
                             strictly increasing within a window"
                        ),
                    ));
                }
            }
            prev = Some(col);
            if !column_bits {
                return Err(bad(
                    "bitmaps",
                    b,
                    format!("slot {c} (column {col}) of block {b} in window {w} has no edge"),
                ));
            }
        }
        if block_columns[b * COLS] == Bsb::PADDING {
            return Err(bad(
                "block_columns",
                b * COLS,
                format!("block {b} of window {w} is all padding"),
            ));
        }
    }
    Ok(())
}
