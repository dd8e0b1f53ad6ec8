//! Host-side load-balancing schedules for the CSR kernels, computed once per graph.
//!
//! Power-law graphs have hub rows of 10^4–10^5 edges next to rows of one or two. A kernel that
//! gives each row to one warp waits on the hub; these schedules split the work so that no row
//! serializes the grid:
//!
//! - [`RowUnits`] (SpMM): rows longer than a chunk are cut into units of at most `chunk` edges,
//!   each taken by its own group of lanes; the partial sums of a split row meet in an f32
//!   scratch row (atomics), and a finalize pass writes it.
//! - [`SoftmaxSchedule`] (edge softmax): rows of at least `long_threshold` edges get a whole
//!   thread block per (row, head); the others a group of lanes sized to the mean degree.
//! - [`HybridUnits`] (hybrid kernels): each 16-row window's tensor-core blocks and CUDA-core
//!   edges, heavy windows cut into parts merged in-kernel, largest first.
//!
//! The fused tensor-core kernel's window schedule (`fused::tc`) cuts windows the same way and
//! shares [`MAX_WINDOW_PARTS`].

use spattn_formats::{alloc, Csr, HybridBlocks, HybridSplit, Permutation};

use crate::error::{Error, Result};

/// Most units one window is cut into (a kernel's in-kernel merge reads every part).
pub(crate) const MAX_WINDOW_PARTS: usize = 64;
/// Marks a unit whose window is not split.
pub(crate) const NOT_SPLIT: u32 = u32::MAX;
/// Rows per hybrid window.
const HYBRID_ROWS: usize = HybridBlocks::WINDOW_ROWS;

/// Work units for a persistent hybrid kernel: unit `u` covers tensor-core blocks
/// `tc_begin..tc_end` and CUDA-core edges `cd_begin..cd_end` of one window.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct HybridUnits {
    /// 8 per unit: window, tc_begin, tc_end, part (or [`NOT_SPLIT`]), cd_begin, cd_end,
    /// split window index (or [`NOT_SPLIT`]), and `tc_value_first[w] - window_offsets[w]`
    /// (wrapping): block `b`'s values in [`HybridSplit::tc_values`] are block `b + that`.
    pub units: Vec<u32>,
    /// Per split window `s`, its parts are `split_part_first[s]..split_part_first[s + 1]`.
    pub split_part_first: Vec<u32>,
}

impl HybridUnits {
    /// Work units of `split` (a threshold's split of `blocks`), largest first: each window's
    /// cost is `tc blocks · block_cost + cd edges · edge_cost`; a window costing more than
    /// `max_cost` is cut into up to [`MAX_WINDOW_PARTS`] units, each with an even share of its
    /// tensor-core blocks and of its CUDA-core edges. Windows without edges keep one (empty)
    /// unit, so a kernel writes their zero rows.
    ///
    /// Errors: [`Error::InvalidArgument`] for costs that are not positive and finite.
    pub(crate) fn new(
        blocks: &HybridBlocks,
        split: &HybridSplit,
        block_cost: f64,
        edge_cost: f64,
        max_cost: f64,
    ) -> Result<Self> {
        for (what, x) in [
            ("hybrid block cost", block_cost),
            ("hybrid edge cost", edge_cost),
            ("hybrid unit cost", max_cost),
        ] {
            if !(x.is_finite() && x > 0.0) {
                return Err(Error::InvalidArgument {
                    what,
                    why: format!("{x}: must be positive and finite"),
                });
            }
        }
        let (offsets, dense_end) = (blocks.window_offsets(), split.dense_end());
        let (cd_rows, value_first) = (split.cd_row_offsets(), split.tc_value_first());
        let n_rows = blocks.n_rows();
        // (cost, [window, tc_begin, tc_end, part, cd_begin, cd_end, split, value base])
        let mut units: Vec<(f64, [u32; 8])> = Vec::with_capacity(blocks.n_windows());
        let mut split_part_first = vec![0u32];
        let mut n_parts = 0u32;
        for w in 0..blocks.n_windows() {
            let tc = offsets[w]..dense_end[w];
            let rows = (w * HYBRID_ROWS).min(n_rows)..((w + 1) * HYBRID_ROWS).min(n_rows);
            let cd = cd_rows[rows.start]..cd_rows[rows.end];
            let (nb, ne) = ((tc.end - tc.start) as usize, (cd.end - cd.start) as usize);
            let cost = nb as f64 * block_cost + ne as f64 * edge_cost;
            let parts = ((cost / max_cost).ceil() as usize).clamp(1, MAX_WINDOW_PARTS);
            // No more parts than there is work to share (a part of a pair of blocks or of one
            // edge at least).
            let parts = parts.min(nb.div_ceil(2) + ne).max(1);
            // Windows fit u32: the block offsets do (HybridBlocks' invariant).
            let w32 = w as u32;
            let wbase = value_first[w].wrapping_sub(offsets[w]);
            if parts == 1 {
                units.push((
                    cost,
                    [
                        w32, tc.start, tc.end, NOT_SPLIT, cd.start, cd.end, NOT_SPLIT, wbase,
                    ],
                ));
                continue;
            }
            let split_index = (split_part_first.len() - 1) as u32;
            let pairs = nb.div_ceil(2);
            for p in 0..parts {
                let b0 = (tc.start as usize + 2 * (pairs * p / parts)).min(tc.end as usize) as u32;
                let b1 =
                    (tc.start as usize + 2 * (pairs * (p + 1) / parts)).min(tc.end as usize) as u32;
                let e0 = cd.start + (ne * p / parts) as u32;
                let e1 = cd.start + (ne * (p + 1) / parts) as u32;
                let c = f64::from(b1 - b0) * block_cost + f64::from(e1 - e0) * edge_cost;
                units.push((
                    c,
                    [w32, b0, b1, n_parts + p as u32, e0, e1, split_index, wbase],
                ));
            }
            n_parts += parts as u32;
            split_part_first.push(n_parts);
        }
        // Largest first; stable, so equal costs keep the window order.
        units.sort_by(|a, b| b.0.total_cmp(&a.0));
        Ok(Self {
            units: units.iter().flat_map(|u| u.1).collect(),
            split_part_first,
        })
    }

    /// Number of units.
    pub(crate) fn n_units(&self) -> usize {
        self.units.len() / 8
    }
    /// Number of split windows.
    pub(crate) fn n_split(&self) -> usize {
        self.split_part_first.len().saturating_sub(1)
    }
    /// Number of partials (units of split windows).
    pub(crate) fn n_parts(&self) -> usize {
        self.split_part_first.last().map_or(0, |&p| p as usize)
    }
}

/// Marks a unit whose row is not split (it writes its output row directly).
pub(crate) const NO_SLOT: u32 = u32::MAX;

/// SpMM work units: unit `u` covers edges `starts[u]..starts[u + 1]` of row `rows[u]`.
///
/// Units are in row order and cover every edge once; every row, an empty one included, has at
/// least one unit, so the kernel writes every output row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RowUnits {
    /// Row of each unit.
    pub rows: Vec<u32>,
    /// First edge of each unit, plus one final entry: the number of edges (`len = units + 1`).
    pub starts: Vec<u32>,
    /// Scratch slot of each unit of a split row, or [`NO_SLOT`].
    pub slots: Vec<u32>,
    /// The rows that are split, indexed by slot.
    pub split_rows: Vec<u32>,
    /// Partial-result index of each unit of a split row (one per unit, consecutive within a
    /// row), or [`NO_SLOT`]: where a fused kernel leaves its (max, sum, accumulator) partial.
    pub parts: Vec<u32>,
    /// For each split row (slot `s`), its partials are `part_first[s]..part_first[s + 1]`
    /// (`len = split rows + 1`).
    pub part_first: Vec<u32>,
    /// The chunk size used.
    pub chunk: u32,
}

impl RowUnits {
    /// Cuts every row of `a` into units of at most `chunk` edges (`chunk` ≥ 1).
    pub(crate) fn new(a: &Csr, chunk: u32) -> Self {
        let chunk = chunk.max(1);
        let offsets = a.row_offsets();
        let n = a.n_rows();
        let mut rows = Vec::with_capacity(n);
        let mut starts = Vec::with_capacity(n + 1);
        let mut slots = Vec::with_capacity(n);
        let mut split_rows = Vec::new();
        let mut parts = Vec::with_capacity(n);
        let mut part_first = vec![0u32];
        for r in 0..n {
            let (s, e) = (offsets[r], offsets[r + 1]);
            let len = e - s;
            if len <= chunk {
                rows.push(r as u32);
                starts.push(s);
                slots.push(NO_SLOT);
                parts.push(NO_SLOT);
            } else {
                let slot = split_rows.len() as u32;
                split_rows.push(r as u32);
                let first_unit = rows.len() as u32;
                let mut p = s;
                while p < e {
                    rows.push(r as u32);
                    starts.push(p);
                    slots.push(slot);
                    parts.push(parts_so_far(&part_first) + (rows.len() as u32 - 1 - first_unit));
                    p = p.saturating_add(chunk).min(e);
                }
                let units_of_row = rows.len() as u32 - first_unit;
                part_first.push(parts_so_far(&part_first) + units_of_row);
            }
        }
        starts.push(offsets[n]);
        Self {
            rows,
            starts,
            slots,
            split_rows,
            parts,
            part_first,
            chunk,
        }
    }
}

/// The indices of the units [`RowUnits::new`] cuts rows of lengths `lens` into (chunks of
/// `chunk` edges, one unit for a row of at most `chunk`, an empty one included), listed row by
/// row in `order`'s new order (position `p` holds row `order.old_of_new()[p]`), a row's units
/// consecutive: the order a kernel walking `RowUnits` may take them in so that rows near in
/// `order` run at one time. A permutation of the units.
///
/// Errors: [`Error::LengthMismatch`] when `order` is not over `lens.len()` rows,
/// [`Error::InvalidArgument`] when the units overflow `u32`, out of host memory.
pub(crate) fn units_in_row_order(
    lens: &[u32],
    chunk: u32,
    order: &Permutation,
) -> Result<Vec<u32>> {
    if order.len() != lens.len() {
        return Err(Error::LengthMismatch {
            what: "row order",
            expected: lens.len(),
            actual: order.len(),
        });
    }
    let chunk = chunk.max(1);
    let units_of = |len: u32| len.div_ceil(chunk).max(1);
    // first[r]: the first unit of row r, in RowUnits::new's numbering (rows in order).
    let mut first = alloc::try_with_capacity::<u32>(lens.len(), "unit order")?;
    let mut n = 0u32;
    for &len in lens {
        first.push(n);
        n = n.checked_add(units_of(len)).ok_or(Error::InvalidArgument {
            what: "units",
            why: format!("more than {} units", u32::MAX),
        })?;
    }
    let mut units = alloc::try_with_capacity::<u32>(n as usize, "unit order")?;
    for &r in order.old_of_new() {
        // A permutation of 0..lens.len(): r indexes lens and first.
        let f = first[r as usize];
        units.extend(f..f + units_of(lens[r as usize]));
    }
    Ok(units)
}

/// Each row's and each column's edge count: the lengths [`RowUnits::new`] cuts A's rows and
/// Aᵀ's (A's columns) by.
///
/// Errors: out of host memory.
pub(crate) fn row_and_column_lens(a: &Csr) -> Result<(Vec<u32>, Vec<u32>)> {
    let mut lens = alloc::try_with_capacity::<u32>(a.n_rows(), "row lengths")?;
    lens.extend(a.row_offsets().windows(2).map(|w| w[1] - w[0]));
    let mut col_lens = alloc::try_filled::<u32>(a.n_cols(), 0, "column lengths")?;
    for &c in a.col_indices() {
        // A valid CSR's columns are < n_cols.
        col_lens[c as usize] += 1;
    }
    Ok((lens, col_lens))
}

/// `[partials, split rows]` of the units [`RowUnits::new`] cuts rows of lengths `lens` into:
/// the rows of more than `chunk` edges, and their units.
pub(crate) fn split_units(lens: &[u32], chunk: u32) -> [usize; 2] {
    let chunk = chunk.max(1);
    lens.iter()
        .filter(|&&len| len > chunk)
        .fold([0, 0], |[parts, split], &len| {
            [parts + len.div_ceil(chunk) as usize, split + 1]
        })
}

/// The number of partials assigned so far (the last prefix-sum entry).
fn parts_so_far(part_first: &[u32]) -> u32 {
    part_first.last().copied().unwrap_or(0)
}

/// Edge-softmax schedule: which rows get a whole block, and the group size for the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SoftmaxSchedule {
    /// Rows with at least `long_threshold` edges, each handled by a thread block per head.
    pub long_rows: Vec<u32>,
    /// Rows at or above this length go to the block kernel.
    pub long_threshold: u32,
    /// Lanes per (row, head) in the row kernel: a power of two in 4..=32.
    pub group: u32,
}

impl SoftmaxSchedule {
    /// The default threshold: a row this long keeps a 32-lane group busy for 8 dependent
    /// iterations per pass (64 with the narrowest group); longer rows are better spread over a
    /// block.
    pub(crate) const DEFAULT_LONG_THRESHOLD: u32 = 256;

    /// Builds the schedule for `a`.
    pub(crate) fn new(a: &Csr, long_threshold: u32) -> Self {
        let long_threshold = long_threshold.max(1);
        let long_rows = (0..a.n_rows())
            .filter(|&r| a.degree(r) as u64 >= long_threshold as u64)
            .map(|r| r as u32)
            .collect();
        let mean = if a.n_rows() == 0 {
            0.0
        } else {
            a.nnz() as f64 / a.n_rows() as f64
        };
        Self {
            long_rows,
            long_threshold,
            group: group_for(mean.ceil() as u64, 4),
        }
    }
}

/// The smallest power of two ≥ `items`, clamped to `min..=32`: the lane-group size for work
/// of `items` parallel pieces.
pub(crate) fn group_for(items: u64, min: u32) -> u32 {
    let g = items.clamp(1, 32).next_power_of_two() as u32;
    g.clamp(min.clamp(1, 32), 32)
}

/// The vector width for `head_dim` features of `elem_bytes` bytes: the largest of 8, 4, 2, 1
/// that divides `head_dim` with at most 16 bytes per access.
pub(crate) fn vector_width(head_dim: usize, elem_bytes: usize) -> u32 {
    for v in [8usize, 4, 2] {
        if v * elem_bytes <= 16 && head_dim % v == 0 {
            return v as u32;
        }
    }
    1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_hybrid_units(blocks: &HybridBlocks, s: &HybridSplit, u: &HybridUnits) {
        let mut tc_seen = vec![0u32; blocks.n_blocks()];
        let mut cd_seen = vec![0u32; s.cd_edges()];
        let mut windows = vec![false; blocks.n_windows()];
        for un in u.units.chunks(8) {
            windows[un[0] as usize] = true;
            for b in un[1]..un[2] {
                tc_seen[b as usize] += 1;
            }
            for e in un[4]..un[5] {
                cd_seen[e as usize] += 1;
            }
            assert_eq!(un[3] == NOT_SPLIT, un[6] == NOT_SPLIT);
            if un[6] != NOT_SPLIT {
                let sp = un[6] as usize;
                assert!(u.split_part_first[sp] <= un[3] && un[3] < u.split_part_first[sp + 1]);
            }
        }
        assert!(windows.iter().all(|&w| w));
        for w in 0..blocks.n_windows() {
            for b in blocks.window_blocks(w) {
                assert_eq!(tc_seen[b], u32::from((b as u32) < s.dense_end()[w]));
            }
        }
        assert!(cd_seen.iter().all(|&c| c == 1));
    }

    #[test]
    fn hybrid_units_cover_every_block_and_edge_once() {
        // Window 0 dense (16 rows × 400 columns) and split, window 1 one row; thresholds from
        // all tensor cores to all CUDA cores.
        let mut edges: Vec<(u32, u32)> = (0..16)
            .flat_map(|r| (0..400).map(move |c| (r, c)))
            .collect();
        edges.extend((16..40).map(|r| (r, r % 7)));
        let a = Csr::from_edges(40, 400, &edges).unwrap();
        let blocks = HybridBlocks::from_csr(&a).unwrap();
        for t in [0.0, 0.25, 0.5, 2.0] {
            let s = blocks.classify(t).unwrap();
            let u = HybridUnits::new(&blocks, &s, 1.0, 1.0, 5.0).unwrap();
            check_hybrid_units(&blocks, &s, &u);
            let coarse = HybridUnits::new(&blocks, &s, 3.0, 1.0, 40.0).unwrap();
            check_hybrid_units(&blocks, &s, &coarse);
        }
        // One heavy window and one empty row: only the heavy window is split.
        let heavy: Vec<(u32, u32)> = (0..16)
            .flat_map(|r| (0..400).map(move |c| (r, c)))
            .collect();
        let blocks = HybridBlocks::from_csr(&Csr::from_edges(17, 400, &heavy).unwrap()).unwrap();
        let s = blocks.classify(0.5).unwrap();
        let u = HybridUnits::new(&blocks, &s, 1.0, 1.0, 5.0).unwrap();
        check_hybrid_units(&blocks, &s, &u);
        assert_eq!(u.n_split(), 1);
        assert!(u.n_parts() > 1 && u.n_parts() <= MAX_WINDOW_PARTS);
        assert!(HybridUnits::new(&blocks, &s, 0.0, 1.0, 1.0).is_err());
    }

    #[test]
    fn row_units_example() -> std::result::Result<(), Box<dyn std::error::Error>> {
        use crate::schedule::{RowUnits, NO_SLOT};
        use spattn_formats::Csr;
        // Row 0 has 5 edges, row 1 none, row 2 one.
        let a = Csr::from_edges(3, 5, &[(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (2, 1)])?;
        let u = RowUnits::new(&a, 2);
        assert_eq!(u.rows, vec![0, 0, 0, 1, 2]);
        assert_eq!(u.starts, vec![0, 2, 4, 5, 5, 6]);
        assert_eq!(u.slots, vec![0, 0, 0, NO_SLOT, NO_SLOT]);
        assert_eq!(u.split_rows, vec![0]);
        assert_eq!(u.parts, vec![0, 1, 2, NO_SLOT, NO_SLOT]);
        assert_eq!(u.part_first, vec![0, 3]);
        Ok(())
    }

    #[test]
    fn units_in_row_order_walk_rows_in_the_order_given() {
        use crate::schedule::{row_and_column_lens, split_units, units_in_row_order, RowUnits};
        use spattn_formats::Permutation;
        let edges: Vec<(u32, u32)> = (0..700u32).map(|i| (i % 9 * (i % 4), i % 50)).collect();
        let a = Csr::from_edges(30, 50, &edges).unwrap();
        let (lens, col_lens) = row_and_column_lens(&a).unwrap();
        let degrees: Vec<u32> = (0..a.n_rows()).map(|r| a.degree(r) as u32).collect();
        assert_eq!(lens, degrees);
        // Aᵀ's rows are A's columns: the transpose's degrees.
        let t = a.transpose_with_map().0;
        let t_degrees: Vec<u32> = (0..t.n_rows()).map(|r| t.degree(r) as u32).collect();
        assert_eq!(col_lens, t_degrees);
        let old_of_new: Vec<u32> = (0..30u32).map(|i| (i * 7) % 30).collect();
        let p = Permutation::from_old_of_new(old_of_new.clone()).unwrap();
        for chunk in [1, 3, 64] {
            let u = RowUnits::new(&a, chunk);
            let order = units_in_row_order(&lens, chunk, &p).unwrap();
            // Every unit once, rows in the permutation's order, a row's units in order.
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..u.rows.len() as u32).collect::<Vec<_>>());
            let rows: Vec<u32> = order.iter().map(|&i| u.rows[i as usize]).collect();
            let mut expected = Vec::new();
            for &r in &old_of_new {
                let n = u.rows.iter().filter(|&&x| x == r).count();
                expected.extend(std::iter::repeat_n(r, n));
            }
            assert_eq!(rows, expected);
            assert!(order
                .windows(2)
                .all(|w| u.rows[w[0] as usize] != u.rows[w[1] as usize] || w[1] == w[0] + 1));
            let parts = *u.part_first.last().unwrap() as usize;
            assert_eq!(split_units(&lens, chunk), [parts, u.split_rows.len()]);
        }
        let short = Permutation::identity(3).unwrap();
        assert!(units_in_row_order(&lens, 4, &short).is_err());
    }

    #[test]
    fn units_cover_every_edge_once_and_every_row() {
        let edges: Vec<(u32, u32)> = (0..1000u32)
            .map(|i| (i % 7 * (i % 3), (i * 13) % 500))
            .collect();
        let a = Csr::from_edges(20, 500, &edges).unwrap();
        for chunk in [1, 3, 64, 10_000] {
            let u = RowUnits::new(&a, chunk);
            assert_eq!(u.starts.len(), u.rows.len() + 1);
            assert_eq!(*u.starts.last().unwrap() as usize, a.nnz());
            let mut seen_rows = vec![false; a.n_rows()];
            for i in 0..u.rows.len() {
                let r = u.rows[i] as usize;
                seen_rows[r] = true;
                let range = a.row_range(r);
                assert!(u.starts[i] as usize >= range.start);
                assert!(
                    u.starts[i + 1] as usize <= range.end || u.rows.get(i + 1) != Some(&(r as u32))
                );
                assert!(u.starts[i + 1] - u.starts[i] <= chunk);
                let split = u.slots[i] != NO_SLOT;
                assert_eq!(split, a.degree(r) > chunk as usize);
                if split {
                    let slot = u.slots[i] as usize;
                    assert_eq!(u.split_rows[slot] as usize, r);
                    let part = u.parts[i];
                    assert!(u.part_first[slot] <= part && part < u.part_first[slot + 1]);
                } else {
                    assert_eq!(u.parts[i], NO_SLOT);
                }
            }
            assert!(seen_rows.iter().all(|&s| s));
            // Partials are numbered 0.. in unit order, each used once.
            let used: Vec<u32> = u.parts.iter().copied().filter(|&p| p != NO_SLOT).collect();
            assert_eq!(used, (0..used.len() as u32).collect::<Vec<_>>());
            assert_eq!(*u.part_first.last().unwrap() as usize, used.len());
            assert!(u.starts.windows(2).all(|w| w[0] <= w[1]));
        }
    }

    #[test]
    fn group_and_vector_width() {
        assert_eq!(group_for(0, 4), 4);
        assert_eq!(group_for(5, 4), 8);
        assert_eq!(group_for(1000, 4), 32);
        assert_eq!(group_for(3, 1), 4);
        assert_eq!(vector_width(128, 2), 8);
        assert_eq!(vector_width(128, 4), 4);
        assert_eq!(vector_width(24, 2), 8);
        assert_eq!(vector_width(6, 4), 2);
        assert_eq!(vector_width(3, 2), 1);
    }

    #[test]
    fn softmax_schedule_picks_long_rows() {
        let mut edges: Vec<(u32, u32)> = (0..3000u32).map(|c| (1, c)).collect();
        edges.push((0, 0));
        let a = Csr::from_edges(3, 3000, &edges).unwrap();
        let s = SoftmaxSchedule::new(&a, 1024);
        assert_eq!(s.long_rows, vec![1]);
        assert_eq!(s.group, 32);
    }
}
