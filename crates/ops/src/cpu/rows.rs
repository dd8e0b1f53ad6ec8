//! Row-parallel traversal of a CSR mask together with an output buffer laid out by row.

use std::ops::Range;

use rayon::join;

/// Work (edges + rows) below which a block of rows is processed sequentially.
const GRAIN: usize = 4096;

/// Runs `f(rows, block)` over disjoint blocks of consecutive rows, in parallel (rayon).
///
/// `data` is an output laid out by row: row `i`'s part starts at `start(i) - start(0)` and ends
/// where row `i + 1`'s begins (`start` is non-decreasing, `start(n_rows) - start(0) ==
/// data.len()`). Each call gets `block = data[start(rows.start) .. start(rows.end)]`, rebased.
///
/// Blocks are split recursively at the row that halves the work, counted as edges plus rows
/// (`offsets` are the CSR row offsets): rows are never split, so a hub row is one block, and a
/// long run of empty rows still splits in halves (no deep recursion).
pub(super) fn for_each_row_block<T, S, W>(offsets: &[u32], data: &mut [T], start: &S, f: &W)
where
    T: Send,
    S: Fn(usize) -> usize + Sync,
    W: Fn(Range<usize>, &mut [T]) + Sync,
{
    let n_rows = offsets.len().saturating_sub(1);
    if n_rows == 0 {
        return;
    }
    debug_assert_eq!(start(n_rows) - start(0), data.len());
    recurse(offsets, 0..n_rows, data, start, f);
}

fn recurse<T, S, W>(offsets: &[u32], rows: Range<usize>, data: &mut [T], start: &S, f: &W)
where
    T: Send,
    S: Fn(usize) -> usize + Sync,
    W: Fn(Range<usize>, &mut [T]) + Sync,
{
    let work = |m: usize| (offsets[m] - offsets[rows.start]) as usize + (m - rows.start);
    let total = work(rows.end);
    if rows.len() <= 1 || total <= GRAIN {
        f(rows, data);
        return;
    }
    // The last row boundary m in (start, end) with work(m) <= total / 2, or start + 1.
    let half = total / 2;
    let (mut lo, mut hi) = (rows.start + 1, rows.end - 1);
    while lo < hi {
        let m = lo + (hi - lo).div_ceil(2);
        if work(m) <= half {
            lo = m;
        } else {
            hi = m - 1;
        }
    }
    let mid = lo;
    let (left, right) = data.split_at_mut(start(mid) - start(rows.start));
    join(
        || recurse(offsets, rows.start..mid, left, start, f),
        || recurse(offsets, mid..rows.end, right, start, f),
    );
}
