//! The tile structure of RT-GNN-style hybrid kernels: tensor-core tiles for the dense blocks of
//! each window, CUDA-core edges for the rest.
//!
//! # Layout
//!
//! Rows are **renumbered by degree**, longest first ([`Permutation::by_degree_descending`]),
//! and grouped into windows of 16 renumbered rows, as in [`crate::Bsb`]. Columns keep their
//! **original** ids (a kernel gathers the caller's K/V rows directly; only Q and the output go
//! through [`HybridBlocks::row_ids`]). Within a window, the distinct columns are ordered by how
//! many of the window's rows they hit (most first, ties by column id) and packed 8 at a time
//! into 16×8 blocks with one `u128` bitmap each (bit `r·8 + c`: window row `r` has the column of
//! slot `c`; padding slots hold [`HybridBlocks::PADDING`]). Because the columns are sorted by
//! hits, the blocks of a window have non-increasing fill: the dense ones are a prefix.
//!
//! [`HybridBlocks::classify`] splits each window at a fill threshold (popcount / 128):
//! blocks at or above it are **tensor-core tiles** (the window's prefix of blocks), the edges of
//! the others are **CUDA-core edges**, listed per renumbered row (`cd_row_offsets`,
//! `cd_columns`, original column ids in increasing order). Every edge of the graph lands in
//! exactly one of the two ([`HybridSplit::to_csr`] rebuilds the matrix exactly).
//!
//! The kernels' work units (windows cut to a bounded cost, largest first) are made from a split
//! by spattn-ops (`HybridUnits`).
//!
//! ```
//! use spattn_formats::{Csr, HybridBlocks};
//! // Rows 0..4 all attend to columns 0..8 (a dense block); row 4 also to column 9.
//! let mut edges: Vec<(u32, u32)> = (0..4).flat_map(|r| (0..8).map(move |c| (r, c))).collect();
//! edges.push((4, 9));
//! let a = Csr::from_edges(5, 10, &edges)?;
//! let blocks = HybridBlocks::from_csr(&a)?;
//! assert_eq!(blocks.n_blocks(), 2);
//! let split = blocks.classify(0.2)?; // block 0: 32/128 = 0.25 dense; block 1: 1/128 sparse
//! assert_eq!((split.tc_edges(), split.cd_edges()), (32, 1));
//! assert_eq!(split.to_csr(&blocks)?, a);
//! # Ok::<(), spattn_formats::Error>(())
//! ```

use std::cmp::Reverse;
use std::ops::Range;

use rayon::prelude::*;

use crate::csr::Csr;
use crate::error::{Error, Result};
use crate::mebcrs::WindowMerger;
use crate::offsets::{check_len, offsets_from_counts, plan_chunks};
use crate::permutation::Permutation;
use crate::reorder::RowOrder;

/// Rows per window.
const ROWS: usize = 16;
/// Column slots per block.
const COLS: usize = 8;
/// Slots per block.
const SLOTS: usize = ROWS * COLS;

/// The 16×8 blocks of every window of the degree-ordered graph, dense and sparse alike,
/// before any threshold is applied. See the [module documentation](self).
#[derive(Clone, Debug, PartialEq)]
pub struct HybridBlocks {
    n_rows: usize,
    n_cols: usize,
    nnz: usize,
    permutation: Permutation,
    window_offsets: Vec<u32>,
    block_columns: Vec<u32>,
    bitmaps: Vec<u128>,
    /// Prefix sum of the blocks' popcounts (`n_blocks + 1`).
    block_edge_offsets: Vec<u32>,
    /// Values of each block's edges in bit order (`nnz`), when the matrix has values.
    block_values: Option<Vec<f32>>,
}

/// One threshold's split of [`HybridBlocks`]: which blocks go to tensor cores, and the
/// CUDA-core edge lists of the rest. See the [module documentation](self).
#[derive(Clone, Debug, PartialEq)]
pub struct HybridSplit {
    threshold: f64,
    /// Per window, the end of its tensor-core prefix of blocks (absolute block index).
    dense_end: Vec<u32>,
    tc_edges: usize,
    /// Per tensor-core block (in block order, windows concatenated), 128 values by slot
    /// `r·8 + c` (0 where no edge), when the matrix has values.
    tc_values: Option<Vec<f32>>,
    /// Index of each window's first tensor-core block in `tc_values` order.
    tc_value_first: Vec<u32>,
    cd_row_offsets: Vec<u32>,
    cd_columns: Vec<u32>,
    cd_values: Option<Vec<f32>>,
}

/// What one chunk of windows produces in [`HybridBlocks::from_csr`].
#[derive(Default)]
struct ChunkPart {
    blocks_per_window: Vec<u32>,
    columns: Vec<u32>,
    bitmaps: Vec<u128>,
    values: Vec<f32>,
}

impl HybridBlocks {
    /// Rows per window: 16.
    pub const WINDOW_ROWS: usize = ROWS;
    /// Column slots per block: 8.
    pub const BLOCK_COLS: usize = COLS;
    /// The column id of a padding slot (`u32::MAX`, never a node).
    pub const PADDING: u32 = u32::MAX;

    /// Renumbers the rows of `a` by degree (longest first) and builds the blocks of every
    /// window, columns ordered by hits within the window. Never fails on a valid [`Csr`].
    pub fn from_csr(a: &Csr) -> Result<Self> {
        Self::from_csr_with_order(a, Permutation::by_degree_descending(a))
    }

    /// As [`HybridBlocks::from_csr_with_order`] with the rows in `order` (the graph's own
    /// order when it renumbers nothing), as [`RowOrder::choose`] picked it.
    ///
    /// ```
    /// use spattn_formats::{Csr, HybridBlocks, Reorder, RowOrder};
    /// let a = Csr::from_edges(3, 3, &[(0, 1), (1, 2), (2, 0)])?;
    /// let order = RowOrder::choose(&a, Reorder::None, 16)?;
    /// let blocks = HybridBlocks::from_csr_in_row_order(&a, &order)?;
    /// assert_eq!(blocks.nnz(), 3);
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`HybridBlocks::from_csr_with_order`].
    pub fn from_csr_in_row_order(a: &Csr, order: &RowOrder) -> Result<Self> {
        let permutation = match &order.permutation {
            Some(p) => p.clone(),
            None => Permutation::identity(a.n_rows())?,
        };
        Self::from_csr_with_order(a, permutation)
    }

    /// As [`HybridBlocks::from_csr`] with the rows in the order `permutation` gives (row
    /// `new` is row `permutation.old_of_new()[new]` of `a`; for instance
    /// [`Permutation::reverse_cuthill_mckee`], whose windows share more columns). Column ids
    /// stay the original ones.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] if `permutation` does not have one entry per row of `a`.
    pub fn from_csr_with_order(a: &Csr, permutation: Permutation) -> Result<Self> {
        // Rows in the new order, columns (and values) unchanged.
        let permuted = permutation.permute_csr_rows(a)?;
        let offsets = permuted.row_offsets().to_vec();
        let cols = permuted.col_indices();
        let vals = permuted.values().map(<[f32]>::to_vec);
        let chunks = plan_chunks(&offsets, ROWS);
        let parts: Vec<ChunkPart> = chunks
            .par_iter()
            .map_init(WindowMerger::default, |merger, windows| {
                build_chunk(windows.clone(), &offsets, cols, vals.as_deref(), merger)
            })
            .collect();
        let n_windows = a.n_rows().div_ceil(ROWS);
        let mut window_offsets = Vec::with_capacity(n_windows + 1);
        window_offsets.push(0u32);
        let mut n_blocks = 0usize;
        for part in &parts {
            for &c in &part.blocks_per_window {
                n_blocks += c as usize;
                // At most one block per edge, and at most u32::MAX edges.
                window_offsets.push(n_blocks as u32);
            }
        }
        let block_columns: Vec<u32> = parts
            .iter()
            .flat_map(|p| p.columns.iter().copied())
            .collect();
        let bitmaps: Vec<u128> = parts
            .iter()
            .flat_map(|p| p.bitmaps.iter().copied())
            .collect();
        let block_values = a.values().map(|_| {
            parts
                .iter()
                .flat_map(|p| p.values.iter().copied())
                .collect()
        });
        let pop: Vec<u32> = bitmaps.iter().map(|b| b.count_ones()).collect();
        let block_edge_offsets = offsets_from_counts(&pop)?;
        Ok(Self {
            n_rows: a.n_rows(),
            n_cols: a.n_cols(),
            nnz: a.nnz(),
            permutation,
            window_offsets,
            block_columns,
            bitmaps,
            block_edge_offsets,
            block_values,
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
    /// Number of edges.
    pub fn nnz(&self) -> usize {
        self.nnz
    }
    /// Number of 16-row windows.
    pub fn n_windows(&self) -> usize {
        self.window_offsets.len() - 1
    }
    /// Number of blocks (dense and sparse).
    pub fn n_blocks(&self) -> usize {
        self.bitmaps.len()
    }
    /// The row renumbering (new row `i` is the caller's row `old_of_new()[i]`).
    pub fn permutation(&self) -> &Permutation {
        &self.permutation
    }
    /// The caller's row id of every renumbered row (`n_rows` entries): where a kernel loads Q
    /// and stores the output of window row `16w + r`.
    pub fn row_ids(&self) -> &[u32] {
        self.permutation.old_of_new()
    }
    /// Window `w` owns blocks `window_offsets[w]..window_offsets[w + 1]` (`n_windows + 1`).
    pub fn window_offsets(&self) -> &[u32] {
        &self.window_offsets
    }
    /// The original column id of every slot, 8 per block; padding slots hold
    /// [`HybridBlocks::PADDING`].
    pub fn block_columns(&self) -> &[u32] {
        &self.block_columns
    }
    /// One bitmap per block: bit `r·8 + c` set iff window row `r` has slot `c`'s column.
    pub fn bitmaps(&self) -> &[u128] {
        &self.bitmaps
    }
    /// The bitmaps as little-endian `u32` words, 4 per block (word `4b + k`: rows `2k`,
    /// `2k + 1`), the layout the tensor-core kernels read.
    pub fn bitmap_words_u32(&self) -> Vec<u32> {
        self.bitmaps
            .iter()
            .flat_map(|&b| {
                [
                    b as u32,
                    (b >> 32) as u32,
                    (b >> 64) as u32,
                    (b >> 96) as u32,
                ]
            })
            .collect()
    }
    /// Blocks of window `w`.
    ///
    /// # Panics
    /// If `w >= n_windows`.
    pub fn window_blocks(&self, w: usize) -> Range<usize> {
        self.window_offsets[w] as usize..self.window_offsets[w + 1] as usize
    }

    /// Splits every window at `threshold` (fill = popcount / 128): blocks with fill ≥
    /// `threshold` go to tensor cores (0 sends every block there, anything above 1 none), the
    /// edges of the others to CUDA cores.
    ///
    /// Errors: [`Error::InvalidParameter`] for a threshold that is NaN or negative.
    pub fn classify(&self, threshold: f64) -> Result<HybridSplit> {
        if threshold.is_nan() || threshold < 0.0 {
            return Err(Error::InvalidParameter {
                what: "hybrid fill threshold",
                why: format!("{threshold}: must be a number ≥ 0 (0: all tensor cores, > 1: none)"),
            });
        }
        let is_dense =
            |b: usize| f64::from(self.bitmaps[b].count_ones()) / SLOTS as f64 >= threshold;
        let n_windows = self.n_windows();
        let dense_end: Vec<u32> = (0..n_windows)
            .into_par_iter()
            .map(|w| {
                let blocks = self.window_blocks(w);
                // Fill is non-increasing within a window: the dense blocks are a prefix.
                let k = blocks.clone().take_while(|&b| is_dense(b)).count();
                (blocks.start + k) as u32
            })
            .collect();
        let tc_edges: usize = (0..n_windows)
            .map(|w| {
                (self.block_edge_offsets[dense_end[w] as usize]
                    - self.block_edge_offsets[self.window_offsets[w] as usize])
                    as usize
            })
            .sum();
        let mut tc_value_first = Vec::with_capacity(n_windows + 1);
        let mut acc = 0u32;
        for (&end, &start) in dense_end.iter().zip(&self.window_offsets) {
            tc_value_first.push(acc);
            acc += end - start;
        }
        tc_value_first.push(acc);
        let tc_values = self.block_values.as_ref().map(|vals| {
            let mut out = vec![0.0f32; acc as usize * SLOTS];
            let mut k = 0usize;
            for (&end, &start) in dense_end.iter().zip(&self.window_offsets) {
                for b in start as usize..end as usize {
                    let mut e = self.block_edge_offsets[b] as usize;
                    for_each_bit128(self.bitmaps[b], |bit| {
                        out[k * SLOTS + bit] = vals[e];
                        e += 1;
                    });
                    k += 1;
                }
            }
            out
        });

        // CUDA-core edges: the sparse blocks' bits, per renumbered row, columns ascending.
        let mut per_row: Vec<Vec<(u32, f32)>> = vec![Vec::new(); self.n_rows];
        for w in 0..n_windows {
            for b in dense_end[w] as usize..self.window_offsets[w + 1] as usize {
                let mut e = self.block_edge_offsets[b] as usize;
                for_each_bit128(self.bitmaps[b], |bit| {
                    let (r, c) = (bit / COLS, bit % COLS);
                    let v = self.block_values.as_ref().map_or(1.0, |vals| vals[e]);
                    per_row[w * ROWS + r].push((self.block_columns[b * COLS + c], v));
                    e += 1;
                });
            }
        }
        let counts: Vec<u32> = per_row.iter().map(|r| r.len() as u32).collect();
        let cd_row_offsets = offsets_from_counts(&counts)?;
        let mut cd_columns = Vec::with_capacity(cd_row_offsets[self.n_rows] as usize);
        let mut cd_values = self
            .block_values
            .as_ref()
            .map(|_| Vec::with_capacity(cd_columns.capacity()));
        for row in &mut per_row {
            row.sort_unstable_by_key(|e| e.0);
            cd_columns.extend(row.iter().map(|e| e.0));
            if let Some(v) = cd_values.as_mut() {
                v.extend(row.iter().map(|e| e.1));
            }
        }
        Ok(HybridSplit {
            threshold,
            dense_end,
            tc_edges,
            tc_values,
            tc_value_first,
            cd_row_offsets,
            cd_columns,
            cd_values,
        })
    }
}

impl HybridSplit {
    /// The fill threshold this split was made at.
    pub fn threshold(&self) -> f64 {
        self.threshold
    }
    /// Per window, the end of its tensor-core prefix: window `w`'s tensor-core blocks are
    /// `blocks.window_offsets()[w]..dense_end()[w]`.
    pub fn dense_end(&self) -> &[u32] {
        &self.dense_end
    }
    /// Number of tensor-core blocks.
    pub fn tc_blocks(&self) -> usize {
        self.tc_value_first.last().map_or(0, |&n| n as usize)
    }
    /// Edges covered by tensor-core blocks.
    pub fn tc_edges(&self) -> usize {
        self.tc_edges
    }
    /// Edges left to CUDA cores.
    pub fn cd_edges(&self) -> usize {
        self.cd_columns.len()
    }
    /// Fraction of the edges on tensor cores (0 for a graph without edges).
    pub fn tc_fraction(&self) -> f64 {
        let all = self.tc_edges + self.cd_edges();
        if all == 0 {
            0.0
        } else {
            self.tc_edges as f64 / all as f64
        }
    }
    /// CUDA-core edges of renumbered row `i` are `cd_row_offsets[i]..cd_row_offsets[i + 1]`
    /// (`n_rows + 1` entries).
    pub fn cd_row_offsets(&self) -> &[u32] {
        &self.cd_row_offsets
    }
    /// Original column id of every CUDA-core edge, ascending within each row.
    pub fn cd_columns(&self) -> &[u32] {
        &self.cd_columns
    }
    /// Values of the CUDA-core edges, when the matrix has values.
    pub fn cd_values(&self) -> Option<&[f32]> {
        self.cd_values.as_deref()
    }
    /// Values of the tensor-core blocks, 128 per block by slot `r·8 + c` (0 where there is no
    /// edge), blocks in order, when the matrix has values. Window `w`'s blocks start at block
    /// [`HybridSplit::tc_value_first`]`[w]` of this array.
    pub fn tc_values(&self) -> Option<&[f32]> {
        self.tc_values.as_deref()
    }
    /// Per window (`n_windows + 1` entries), the index of its first tensor-core block in
    /// [`HybridSplit::tc_values`].
    pub fn tc_value_first(&self) -> &[u32] {
        &self.tc_value_first
    }

    /// Rebuilds the matrix in the caller's row order from the tensor-core blocks and the
    /// CUDA-core edges: exactly the matrix `blocks` was built from.
    ///
    /// Errors: [`Error::LengthMismatch`] if `blocks` is not the one this split came from;
    /// any error of [`Csr::try_new`] (a duplicated edge, which the construction rules out).
    pub fn to_csr(&self, blocks: &HybridBlocks) -> Result<Csr> {
        check_len("hybrid dense_end", blocks.n_windows(), self.dense_end.len())?;
        check_len(
            "hybrid cd_row_offsets",
            blocks.n_rows + 1,
            self.cd_row_offsets.len(),
        )?;
        let mut rows: Vec<Vec<(u32, f32)>> = vec![Vec::new(); blocks.n_rows];
        let old = blocks.row_ids();
        for w in 0..blocks.n_windows() {
            for (k, b) in
                (blocks.window_offsets[w] as usize..self.dense_end[w] as usize).enumerate()
            {
                let vb = self.tc_value_first[w] as usize + k;
                for_each_bit128(blocks.bitmaps[b], |bit| {
                    let (r, c) = (bit / COLS, bit % COLS);
                    let v = self.tc_values.as_ref().map_or(1.0, |t| t[vb * SLOTS + bit]);
                    rows[old[w * ROWS + r] as usize].push((blocks.block_columns[b * COLS + c], v));
                });
            }
        }
        for i in 0..blocks.n_rows {
            for e in self.cd_row_offsets[i] as usize..self.cd_row_offsets[i + 1] as usize {
                let v = self.cd_values.as_ref().map_or(1.0, |x| x[e]);
                rows[old[i] as usize].push((self.cd_columns[e], v));
            }
        }
        let mut offsets = Vec::with_capacity(blocks.n_rows + 1);
        offsets.push(0u32);
        let mut cols = Vec::with_capacity(blocks.nnz);
        let mut vals = Vec::with_capacity(blocks.nnz);
        for row in &mut rows {
            row.sort_unstable_by_key(|e| e.0);
            cols.extend(row.iter().map(|e| e.0));
            vals.extend(row.iter().map(|e| e.1));
            offsets.push(
                u32::try_from(cols.len()).map_err(|_| Error::TooManyEntries {
                    nnz: cols.len() as u64,
                    limit: u64::from(u32::MAX),
                })?,
            );
        }
        let values = blocks.block_values.as_ref().map(|_| vals);
        Csr::try_new(blocks.n_rows, blocks.n_cols, offsets, cols, values)
    }
}

/// Calls `f(bit)` for every set bit of `bm`, in increasing order.
#[inline]
fn for_each_bit128(mut bm: u128, mut f: impl FnMut(usize)) {
    while bm != 0 {
        f(bm.trailing_zeros() as usize);
        bm &= bm - 1;
    }
}

/// Builds the blocks of `windows` of the row-renumbered matrix (`offsets`, `cols`, `vals`).
fn build_chunk(
    windows: Range<usize>,
    offsets: &[u32],
    cols: &[u32],
    vals: Option<&[f32]>,
    merger: &mut WindowMerger,
) -> ChunkPart {
    let n_rows = offsets.len() - 1;
    let mut part = ChunkPart::default();
    // Per distinct column of a window: (hits, column, row mask, first key index).
    let mut columns: Vec<(u32, u32, u16, usize)> = Vec::new();
    for w in windows {
        let rows = (w * ROWS).min(n_rows)..((w + 1) * ROWS).min(n_rows);
        let base_row = rows.start;
        // The window's (column, row) keys, by column then row.
        let keys = merger.merge(offsets, cols, rows.clone(), 4);
        // Values in key order: each row's cursor advances as its keys appear (ascending
        // columns, i.e. CSR order).
        let mut key_values = Vec::new();
        if let Some(v) = vals {
            let mut cursor = [0usize; ROWS];
            for r in rows.clone() {
                cursor[r - base_row] = offsets[r] as usize;
            }
            key_values.reserve(keys.len());
            for &k in keys {
                let r = (k & 15) as usize;
                key_values.push(v[cursor[r]]);
                cursor[r] += 1;
            }
        }
        columns.clear();
        for (i, &k) in keys.iter().enumerate() {
            let (col, r) = ((k >> 4) as u32, (k & 15) as u16);
            match columns.last_mut() {
                Some(last) if last.1 == col => {
                    last.0 += 1;
                    last.2 |= 1 << r;
                }
                _ => columns.push((1, col, 1 << r, i)),
            }
        }
        columns.sort_unstable_by_key(|c| (Reverse(c.0), c.1));
        let n_blocks = columns.len().div_ceil(COLS);
        for blk in columns.chunks(COLS) {
            let mut bm = 0u128;
            for (c, &(_, col, mask, _)) in blk.iter().enumerate() {
                part.columns.push(col);
                for r in 0..ROWS {
                    if mask >> r & 1 != 0 {
                        bm |= 1u128 << (r * COLS + c);
                    }
                }
            }
            part.columns
                .extend(std::iter::repeat_n(HybridBlocks::PADDING, COLS - blk.len()));
            part.bitmaps.push(bm);
            if vals.is_some() {
                // Values in bit order: row by row, slot by slot.
                for_each_bit128(bm, |bit| {
                    let (r, c) = (bit / COLS, bit % COLS);
                    let (_, _, mask, first) = blk[c];
                    let below = (mask & ((1u16 << r) - 1)).count_ones() as usize;
                    part.values.push(key_values[first + below]);
                });
            }
        }
        part.blocks_per_window.push(n_blocks as u32);
    }
    part
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn graph(n_rows: usize, n_cols: usize, edges: &[(u32, u32)], values: bool) -> Csr {
        let a = Csr::from_edges(n_rows, n_cols, edges).unwrap();
        if values {
            let v = (0..a.nnz()).map(|i| i as f32 * 0.5 + 1.0).collect();
            a.with_values(Some(v)).unwrap()
        } else {
            a
        }
    }

    /// Every edge in exactly one of {a tensor-core slot, a CUDA-core edge}, at every threshold.
    fn check_round_trip(a: &Csr) {
        let blocks = HybridBlocks::from_csr(a).unwrap();
        assert_eq!(blocks.n_windows(), a.n_rows().div_ceil(16));
        assert_eq!(
            blocks
                .bitmaps()
                .iter()
                .map(|b| b.count_ones() as usize)
                .sum::<usize>(),
            a.nnz()
        );
        for t in [0.0, 1.0 / 128.0, 0.05, 0.2, 0.5, 1.0, 1.5] {
            let s = blocks.classify(t).unwrap();
            assert_eq!(s.tc_edges() + s.cd_edges(), a.nnz(), "threshold {t}");
            assert_eq!(s.to_csr(&blocks).unwrap(), *a, "threshold {t}");
            if t == 0.0 {
                assert_eq!(s.cd_edges(), 0);
            }
            if t > 1.0 {
                assert_eq!(s.tc_edges(), 0);
            }
            for w in 0..blocks.n_windows() {
                let bl = blocks.window_blocks(w);
                let fills: Vec<u32> = bl
                    .clone()
                    .map(|b| blocks.bitmaps()[b].count_ones())
                    .collect();
                assert!(
                    fills.windows(2).all(|f| f[0] >= f[1]),
                    "window {w}: {fills:?}"
                );
                for b in bl {
                    let dense = (b as u32) < s.dense_end()[w];
                    assert_eq!(
                        dense,
                        f64::from(fills[b - blocks.window_offsets()[w] as usize]) / 128.0 >= t
                    );
                }
            }
        }
    }

    #[test]
    fn dense_and_sparse_windows() {
        // Window 0: rows 0..16 all to columns 0..16 (two full blocks); window 1: a diagonal.
        let mut edges: Vec<(u32, u32)> =
            (0..16).flat_map(|r| (0..16).map(move |c| (r, c))).collect();
        edges.extend((16..40).map(|r| (r, r)));
        for values in [false, true] {
            let a = graph(40, 40, &edges, values);
            check_round_trip(&a);
            let blocks = HybridBlocks::from_csr(&a).unwrap();
            let s = blocks.classify(0.5).unwrap();
            assert_eq!(s.tc_blocks(), 2);
            assert_eq!(s.tc_edges(), 256);
            assert_eq!(s.cd_edges(), 24);
            assert!((s.tc_fraction() - 256.0 / 280.0).abs() < 1e-12);
        }
        assert!(HybridBlocks::from_csr(&graph(3, 3, &[], false))
            .unwrap()
            .classify(f64::NAN)
            .is_err());
    }

    #[test]
    fn hub_rows_come_first_and_columns_by_hits() {
        // Row 5 has 20 edges, row 2 has 3, the rest one.
        let mut edges: Vec<(u32, u32)> = (0..20).map(|c| (5, c)).collect();
        edges.extend([(2, 0), (2, 1), (2, 7)]);
        edges.extend([(0, 7), (1, 7), (3, 7), (4, 19)]);
        let a = graph(6, 20, &edges, false);
        let blocks = HybridBlocks::from_csr(&a).unwrap();
        assert_eq!(&blocks.row_ids()[..2], &[5, 2]);
        // Column 7 is hit by 5 rows: first slot.
        assert_eq!(blocks.block_columns()[0], 7);
        check_round_trip(&a);
    }

    proptest! {
        #[test]
        fn round_trip_random(
            n_rows in 1usize..70,
            n_cols in 1usize..70,
            raw in proptest::collection::vec((0u32..70, 0u32..70), 0..600),
            values in any::<bool>(),
        ) {
            let edges: Vec<(u32, u32)> = raw
                .into_iter()
                .map(|(r, c)| (r % n_rows as u32, c % n_cols as u32))
                .collect();
            let a = graph(n_rows, n_cols, &edges, values);
            check_round_trip(&a);
        }
    }
}
