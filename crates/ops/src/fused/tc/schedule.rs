//! The fused tensor-core kernel's work schedule: each BSB window cut into units of at most a
//! chunk of blocks, largest first, with the split windows' partials numbered for the in-kernel
//! merge ([`Schedule`]), and the default chunk ([`default_chunk`]).

use crate::device_bsb::BsbLayout;
use crate::error::Result;
use crate::launch::to_u32;
use spattn_formats::Bsb;

// Only the host reference of the prologue records (a test oracle) reads them.
#[cfg(test)]
use super::{PRE_WORDS, WINDOW_ROWS};

/// Fewest blocks a unit of a split window gets by default (shared with the hybrid schedule).
const DEFAULT_MIN_CHUNK: usize = crate::device_bsb::BSB_MIN_UNIT_BLOCKS;
/// Fewest blocks a unit of a split window can get.
pub(super) const MIN_CHUNK: usize = 4;
/// Most units one window is cut into (the in-kernel merge reads every part).
pub(super) const MAX_PARTS: usize = crate::schedule::MAX_WINDOW_PARTS;
/// Marks a unit whose window is not split (`SPATTN_NONE` in the kernel).
pub(super) const NONE: u32 = u32::MAX;

/// The units of work, largest first, and how split windows are merged.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Schedule {
    /// 4 per unit: window, first block, end block, part (or [`NONE`]).
    pub units: Vec<u32>,
    /// Per unit: its split window's index, or [`NONE`].
    pub unit_split: Vec<u32>,
    /// Per split window `s`, its parts are `split_part_first[s]..split_part_first[s + 1]`.
    pub split_part_first: Vec<u32>,
}

impl Schedule {
    /// Cuts every window of `bsb` into units of at most `chunk` blocks (an even number, at
    /// least [`MIN_CHUNK`], and at most [`MAX_PARTS`] units per window); windows without
    /// blocks get one unit (which writes zeros). Units are sorted by size, largest first.
    pub(crate) fn new(bsb: &BsbLayout, chunk: usize) -> Result<Self> {
        let chunk = chunk.max(MIN_CHUNK).next_multiple_of(2);
        // (blocks, window, first, end, split-or-NONE, part-or-NONE)
        let mut units: Vec<(usize, u32, u32, u32, u32, u32)> = Vec::with_capacity(bsb.n_windows());
        let mut split_part_first = vec![0u32];
        let mut n_parts = 0usize;
        for &w in bsb.window_order() {
            let blocks = bsb.window_blocks(w as usize);
            let nb = blocks.len();
            let (start, end) = (
                to_u32("BSB blocks", blocks.start)?,
                to_u32("BSB blocks", blocks.end)?,
            );
            if nb <= chunk {
                units.push((nb, w, start, end, NONE, NONE));
                continue;
            }
            let parts = nb.div_ceil(chunk).min(MAX_PARTS);
            let per = nb.div_ceil(parts).next_multiple_of(2);
            let parts = nb.div_ceil(per);
            let split = to_u32("split windows", split_part_first.len() - 1)?;
            for i in 0..parts {
                let first = blocks.start + i * per;
                let last = (first + per).min(blocks.end);
                units.push((
                    last - first,
                    w,
                    to_u32("BSB blocks", first)?,
                    to_u32("BSB blocks", last)?,
                    split,
                    to_u32("partials", n_parts + i)?,
                ));
            }
            n_parts += parts;
            split_part_first.push(to_u32("partials", n_parts)?);
        }
        // Largest first; stable, so equal sizes keep the window order.
        units.sort_by_key(|u| std::cmp::Reverse(u.0));
        Ok(Self::flatten(&units, split_part_first))
    }

    /// The schedule of `units` (blocks, window, first, end, split, part) in their order.
    fn flatten(units: &[(usize, u32, u32, u32, u32, u32)], split_part_first: Vec<u32>) -> Self {
        let mut flat = Vec::with_capacity(units.len() * 4);
        let mut unit_split = Vec::with_capacity(units.len());
        for &(_, w, first, end, split, part) in units {
            flat.extend_from_slice(&[w, first, end, part]);
            unit_split.push(split);
        }
        Self {
            units: flat,
            unit_split,
            split_part_first,
        }
    }

    /// A schedule in two phases for overlapping a partitioned plan's halo exchange: the blocks
    /// whose columns all lie in `own` (a rank's own K/V rows, one range of its halo) form the
    /// units of phase 0, which can run before the other rows arrive; the rest (blocks with a
    /// remote column) phase 1. Columns increase across a window's blocks, so a window holds at
    /// most a remote range, an own range and a remote range; each is cut into parts of at
    /// most `chunk` blocks (more where a window would pass [`MAX_PARTS`]), and a window of
    /// more than one part is a split window whose parts, in either phase, merge in-kernel
    /// (the last to finish merges, so phase 1 after phase 0 finishes every window). Windows
    /// without blocks are phase 0. Returns the schedule, phase 0's units first (each phase
    /// largest first), and phase 0's unit count.
    pub(crate) fn phased(
        bsb: &Bsb,
        chunk: usize,
        own: std::ops::Range<u32>,
    ) -> Result<(Self, usize)> {
        let chunk = chunk.max(MIN_CHUNK).next_multiple_of(2);
        let columns = bsb.block_columns();
        let first_col = |b: usize| columns[b * 8];
        // The last real column (padding only ends a window's last block).
        let last_col = |b: usize| {
            columns[b * 8..b * 8 + 8]
                .iter()
                .rev()
                .copied()
                .find(|&c| c != Bsb::PADDING)
                .unwrap_or(Bsb::PADDING)
        };
        // (phase, blocks, window, first, end, split, part)
        let mut units: Vec<(u8, usize, u32, u32, u32, u32, u32)> = Vec::new();
        let mut split_part_first = vec![0u32];
        let mut n_parts = 0usize;
        for &w in bsb.window_order() {
            let blocks = bsb.window_blocks(w as usize);
            let (s, e) = (blocks.start, blocks.end);
            // Own blocks: from the first starting at or past own.start, to the first ending at
            // or past own.end (both monotone in the block index).
            let a = partition_index(s, e, |b| first_col(b) < own.start);
            let b = partition_index(a, e, |b| last_col(b) < own.end);
            let ranges = [(1u8, s, a), (0u8, a, b), (1u8, b, e)];
            let nb = e - s;
            let per = chunk
                .max(nb.div_ceil(MAX_PARTS.saturating_sub(ranges.len()).max(1)))
                .next_multiple_of(2);
            let pieces: usize = ranges.iter().map(|&(_, x, y)| (y - x).div_ceil(per)).sum();
            let u32_of = |x: usize| to_u32("BSB blocks", x);
            if pieces <= 1 {
                // One unit (or an empty window): its phase is that of its blocks.
                let phase = ranges
                    .iter()
                    .find(|&&(_, x, y)| y > x)
                    .map_or(0, |&(p, _, _)| p);
                units.push((phase, nb, w, u32_of(s)?, u32_of(e)?, NONE, NONE));
                continue;
            }
            let split = to_u32("split windows", split_part_first.len() - 1)?;
            let mut i = 0usize;
            for &(phase, x, y) in &ranges {
                let mut f = x;
                while f < y {
                    let l = (f + per).min(y);
                    let part = to_u32("partials", n_parts + i)?;
                    units.push((phase, l - f, w, u32_of(f)?, u32_of(l)?, split, part));
                    i += 1;
                    f = l;
                }
            }
            n_parts += i;
            split_part_first.push(to_u32("partials", n_parts)?);
        }
        // Phase 0 first, then largest first (stable: equal sizes keep the window order).
        units.sort_by_key(|u| (u.0, std::cmp::Reverse(u.1)));
        let first_phase = units.iter().take_while(|u| u.0 == 0).count();
        let plain: Vec<_> = units
            .iter()
            .map(|&(_, n, w, f, l, sp, p)| (n, w, f, l, sp, p))
            .collect();
        Ok((Self::flatten(&plain, split_part_first), first_phase))
    }

    /// Number of units.
    pub(crate) fn n_units(&self) -> usize {
        self.unit_split.len()
    }

    /// Number of split windows.
    pub(crate) fn n_split(&self) -> usize {
        self.split_part_first.len() - 1
    }

    /// Number of partials (units of split windows).
    pub(crate) fn n_parts(&self) -> usize {
        self.split_part_first.last().map_or(0, |&p| p as usize)
    }

    /// The 128-feature pipelined kernel's prologue records, [`PRE_WORDS`] per unit, so that a
    /// warp's first copies and Q loads wait for one load indexed by the unit alone (the host
    /// reference of `plan_tc_prologue`, which builds them on the device:
    /// [`device_prologue`](super::device_prologue)):
    /// words `16 s + l` hold
    /// slot `l` of step `s` < 2 (block `first + 2 s + l / 8`, column `l % 8`; [`NONE`] past the
    /// unit), words 32 + r the caller row of window row r (`row_ids[16 w + r]`, or the row
    /// itself without renumbering; [`NONE`] past the matrix).
    #[cfg(test)]
    pub(crate) fn prologue(&self, bsb: &Bsb, row_ids: Option<&[u32]>) -> Vec<u32> {
        let columns = bsb.block_columns();
        let mut pre = Vec::with_capacity(self.n_units() * PRE_WORDS);
        for u in self.units.chunks_exact(4) {
            let (w, first, end) = (u[0] as usize, u[1] as usize, u[2] as usize);
            for j in 0..32 {
                let blk = first + 2 * (j / 16) + (j % 16) / 8;
                pre.push(if blk < end {
                    columns[blk * 8 + j % 8]
                } else {
                    NONE
                });
            }
            for r in 0..WINDOW_ROWS {
                let row = w * WINDOW_ROWS + r;
                pre.push(match (row < bsb.n_rows(), row_ids) {
                    (false, _) => NONE,
                    (true, Some(ids)) => ids[row],
                    // Rows fit u32: `with_options` checks n_rows before building the records.
                    (true, None) => row as u32,
                });
            }
        }
        pre
    }
}

/// The first index of `lo..hi` where `pred` (true, then false along the range) is false.
fn partition_index(mut lo: usize, mut hi: usize, pred: impl Fn(usize) -> bool) -> usize {
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The chunk for a BSB of `n_blocks` blocks with `heads` heads on `sm_count` SMs: no unit holds
/// more than about 1/(8 · SMs) of all the work, so the largest-first grid ends evenly.
pub(crate) fn default_chunk(n_blocks: usize, heads: usize, group: usize, sm_count: u32) -> usize {
    let work = n_blocks * heads * group;
    let lanes = (sm_count.max(1) as usize) * 8;
    work.div_ceil(lanes).max(DEFAULT_MIN_CHUNK)
}
