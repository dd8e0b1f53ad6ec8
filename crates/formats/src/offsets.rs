//! Offset arrays and the generic helpers the formats share (as sprs's `indptr`): row offsets
//! from counts, checks of pointer arrays and lengths, chunks of windows of similar work for
//! rayon, slices split along offsets or lengths, and the set bits of a mask.

use std::ops::Range;

use crate::csr::MAX_NNZ;
use crate::error::{Error, Result};

/// The CSR row offsets of rows with `counts` edges each; [`Error::TooManyEntries`] past
/// [`MAX_NNZ`] edges.
pub(crate) fn offsets_from_counts(counts: &[u32]) -> Result<Vec<u32>> {
    let mut offsets = Vec::with_capacity(counts.len() + 1);
    offsets.push(0u32);
    let mut total = 0u64;
    for &c in counts {
        total += c as u64;
        if total > MAX_NNZ {
            return Err(Error::TooManyEntries {
                nnz: counts.iter().map(|&c| c as u64).sum(),
                limit: MAX_NNZ,
            });
        }
        offsets.push(total as u32);
    }
    Ok(offsets)
}

/// Calls `f(bit)` for every set bit of `mask`, lowest first.
#[inline]
pub(crate) fn for_each_bit(mut mask: u32, mut f: impl FnMut(usize)) {
    while mask != 0 {
        f(mask.trailing_zeros() as usize);
        mask &= mask - 1;
    }
}

/// [`Error::LengthMismatch`] naming `what` unless `actual == expected`.
pub(crate) fn check_len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(Error::LengthMismatch {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// Every slot index of an `n_slots`-long slot array must fit in `u32`.
pub(crate) fn check_slot_index(what: &'static str, n_slots: usize) -> Result<()> {
    let last = (n_slots as u64).saturating_sub(1);
    if last > u32::MAX as u64 {
        return Err(Error::DimensionTooLarge {
            what,
            value: last,
            limit: u32::MAX as u64,
        });
    }
    Ok(())
}

/// Checks window pointers: start at 0, never decrease, end at `end`.
pub(crate) fn check_pointers(
    format: &'static str,
    what: &'static str,
    pointers: &[u32],
    end: usize,
) -> Result<()> {
    let bad = |index: usize, why: String| Error::InvalidLayout {
        format,
        what,
        index,
        why,
    };
    if let Some(&first) = pointers.first() {
        if first != 0 {
            return Err(bad(0, format!("the first pointer is {first}, expected 0")));
        }
    }
    if let Some(w) = pointers.windows(2).position(|p| p[0] > p[1]) {
        return Err(bad(
            w + 1,
            format!(
                "pointers decrease: {what}[{w}] = {} > {what}[{}] = {}",
                pointers[w],
                w + 1,
                pointers[w + 1]
            ),
        ));
    }
    if let Some(&last) = pointers.last() {
        if last as usize != end {
            return Err(bad(
                pointers.len() - 1,
                format!("the last pointer is {last}, expected {end} (the array it points into)"),
            ));
        }
    }
    Ok(())
}

/// Splits windows `0..ceil(n_rows / window_rows)` into contiguous chunks of similar work
/// (edges + rows), a few dozen per thread, so that rayon balances hub windows.
/// `edge_offsets` is the CSR row-offset array (`n_rows + 1` entries).
pub(crate) fn plan_chunks(edge_offsets: &[u32], window_rows: usize) -> Vec<Range<usize>> {
    let n_rows = edge_offsets.len().saturating_sub(1);
    let n_windows = n_rows.div_ceil(window_rows);
    let work = |w_end: usize| {
        let row = (w_end * window_rows).min(n_rows);
        edge_offsets[row] as usize + row
    };
    chunk_by_work(n_windows, work)
}

/// Greedy chunking of `0..n` by a non-decreasing cumulative work function `work(end)`.
pub(crate) fn chunk_by_work(n: usize, work: impl Fn(usize) -> usize) -> Vec<Range<usize>> {
    if n == 0 {
        return Vec::new();
    }
    let threads = rayon::current_num_threads().max(1);
    let target = (work(n) / (threads * 32)).max(1 << 14);
    let mut chunks = Vec::new();
    let mut start = 0;
    while start < n {
        let base = work(start);
        let mut end = start + 1;
        while end < n && work(end) - base < target {
            end += 1;
        }
        chunks.push(start..end);
        start = end;
    }
    chunks
}

/// Splits `data` into one mutable slice per row, following `offsets`.
pub(crate) fn split_rows_mut<'a, T>(offsets: &[u32], mut data: &'a mut [T]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(offsets.len().saturating_sub(1));
    for w in offsets.windows(2) {
        let (head, tail) = data.split_at_mut((w[1] - w[0]) as usize);
        out.push(head);
        data = tail;
    }
    out
}

/// Splits `data` into consecutive slices of the given lengths (which must not exceed it).
pub(crate) fn split_by_lens<T>(
    mut data: &mut [T],
    lens: impl IntoIterator<Item = usize>,
) -> Vec<&mut [T]> {
    let mut out = Vec::new();
    for len in lens {
        let (head, tail) = std::mem::take(&mut data).split_at_mut(len);
        out.push(head);
        data = tail;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_index_limit() {
        assert!(check_slot_index("x", 0).is_ok());
        assert!(check_slot_index("x", 1 << 32).is_ok());
        let err = check_slot_index("ME-BCRS slot index", (1 << 32) + 1).unwrap_err();
        assert!(matches!(
            err,
            Error::DimensionTooLarge { value, limit, .. } if value == 1 << 32 && limit == u32::MAX as u64
        ));
    }

    #[test]
    fn edge_count_limit() {
        assert_eq!(offsets_from_counts(&[]).unwrap(), vec![0]);
        assert_eq!(offsets_from_counts(&[2, 0, 3]).unwrap(), vec![0, 2, 2, 5]);
        let most = MAX_NNZ as u32;
        assert!(offsets_from_counts(&[most - 1, 0, 1]).is_ok());
        let err = offsets_from_counts(&[most, 0, 1]).unwrap_err();
        assert!(matches!(
            err,
            Error::TooManyEntries { nnz, limit } if nnz == MAX_NNZ + 1 && limit == MAX_NNZ
        ));
    }

    #[test]
    fn chunks_cover_windows() {
        for n in [0usize, 1, 7, 8, 9, 100_000] {
            let offsets: Vec<u32> = (0..=n as u32).map(|i| i * 3).collect();
            let chunks = plan_chunks(&offsets, 8);
            let mut next = 0;
            for c in &chunks {
                assert_eq!(c.start, next);
                assert!(c.end > c.start);
                next = c.end;
            }
            assert_eq!(next, n.div_ceil(8));
        }
    }

    #[test]
    fn bits_in_order() {
        let mut seen = Vec::new();
        for_each_bit(0b1010_0101, |b| seen.push(b));
        assert_eq!(seen, vec![0, 2, 5, 7]);
    }
}
