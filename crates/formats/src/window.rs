//! What the two windowed slot formats share: rows grouped into windows of `ROWS`, each window's
//! edges stored in slots, and the conversions between CSR edge order and slot order that follow
//! from those two facts alone ([`crate::MeBcrs`]: 8-row windows of column vectors;
//! [`crate::Bsb`]: 16-row windows of 16×8 bitmap blocks).

use std::ops::Range;

use rayon::prelude::*;

use crate::error::Result;
use crate::offsets::{chunk_by_work, offsets_from_counts, plan_chunks, split_by_lens};

/// A format of `ROWS`-row windows over a CSR pattern whose edges each own a slot; each row's
/// edges are visited by ascending column, i.e. in CSR order.
/// Implemented by [`slot_windows!`].
pub(crate) trait SlotWindows<const ROWS: usize>: Sync {
    /// CSR row offsets of the pattern (`n_rows + 1` entries).
    fn edge_offsets(&self) -> &[u32];

    /// The first slot of window `w` (`w ≤ n_windows`: the slot count at `n_windows`).
    fn first_slot(&self, w: usize) -> usize;

    /// Calls `f(row_in_window, slot)` for every edge of window `w`, each row's edges by
    /// ascending column.
    fn for_each_slot(&self, w: usize, f: impl FnMut(usize, usize));

    /// Rows of the matrix.
    fn n_rows(&self) -> usize {
        self.edge_offsets().len() - 1
    }

    /// Edges of the matrix.
    fn nnz(&self) -> usize {
        self.edge_offsets()[self.n_rows()] as usize
    }

    /// Rows of window `w`, clipped to `n_rows`.
    fn window_rows(&self, w: usize) -> Range<usize> {
        let n_rows = self.n_rows();
        (w * ROWS).min(n_rows)..((w + 1) * ROWS).min(n_rows)
    }

    /// For each row of window `w`, the CSR index of its first edge minus `base`.
    fn row_cursors(&self, w: usize, base: usize) -> [usize; ROWS] {
        let mut cursor = [0usize; ROWS];
        for (r, row) in self.window_rows(w).enumerate() {
            cursor[r] = self.edge_offsets()[row] as usize - base;
        }
        cursor
    }

    /// Window `w`'s edges over `slots`; 0 where `slots` is 0.
    fn edges_over(&self, w: usize, slots: usize) -> f64 {
        if slots == 0 {
            return 0.0;
        }
        let rows = self.window_rows(w);
        let edges = self.edge_offsets()[rows.end] - self.edge_offsets()[rows.start];
        edges as f64 / slots as f64
    }

    /// Visits every edge with `f(&mut out[edge], slot)`, where `out` is indexed in CSR order;
    /// windows in parallel.
    fn for_each_edge<T: Send>(&self, out: &mut [T], f: impl Fn(&mut T, usize) + Sync) {
        let offsets = self.edge_offsets();
        let chunks = plan_chunks(offsets, ROWS);
        let n = self.n_rows();
        let edge_at = |w: usize| offsets[(w * ROWS).min(n)] as usize;
        let slices = split_by_lens(
            out,
            chunks.iter().map(|c| edge_at(c.end) - edge_at(c.start)),
        );
        chunks.par_iter().zip(slices).for_each(|(windows, edges)| {
            let base = edge_at(windows.start);
            for w in windows.clone() {
                let mut cursor = self.row_cursors(w, base);
                self.for_each_slot(w, |r, slot| {
                    f(&mut edges[cursor[r]], slot);
                    cursor[r] += 1;
                });
            }
        });
    }

    /// The slot of every CSR edge, in CSR order (the caller checks that slots fit in `u32`).
    fn slot_of_each_edge(&self) -> Vec<u32> {
        let mut map = vec![0u32; self.nnz()];
        self.for_each_edge(&mut map, |out, slot| *out = slot as u32);
        map
    }

    /// Slot-major data (one entry a slot, length checked by the caller) in CSR edge order.
    fn gather_slots<T: Copy + Send + Sync>(&self, slot_data: &[T]) -> Vec<T> {
        let Some(&first) = slot_data.first() else {
            return Vec::new();
        };
        let mut out = vec![first; self.nnz()];
        self.for_each_edge(&mut out, |o, slot| *o = slot_data[slot]);
        out
    }

    /// Per-edge data in CSR order (one entry an edge, length checked by the caller) in the slot
    /// layout of `n_slots` entries; slots with no edge get `fill`.
    fn scatter_edges<T: Copy + Send + Sync>(
        &self,
        edge_data: &[T],
        fill: T,
        n_slots: usize,
    ) -> Vec<T> {
        let chunks = plan_chunks(self.edge_offsets(), ROWS);
        let mut out = vec![fill; n_slots];
        let slices = split_by_lens(
            &mut out,
            chunks
                .iter()
                .map(|c| self.first_slot(c.end) - self.first_slot(c.start)),
        );
        chunks.par_iter().zip(slices).for_each(|(windows, slots)| {
            let base = self.first_slot(windows.start);
            for w in windows.clone() {
                let mut cursor = self.row_cursors(w, 0);
                self.for_each_slot(w, |r, slot| {
                    slots[slot - base] = edge_data[cursor[r]];
                    cursor[r] += 1;
                });
            }
        });
        out
    }
}

/// The CSR row offsets (`n_rows + 1` entries) of a format of `ROWS`-row windows whose window
/// `w` owns items (blocks, vectors) `pointers[w]..pointers[w + 1]`: `add_item(item, counts)`
/// adds an item's edges to the counts of its window's rows (`counts[r]`: row `r` of the window,
/// clipped to `n_rows`). Windows in parallel, chunked by items + windows.
pub(crate) fn edge_offsets_of_items<const ROWS: usize>(
    n_rows: usize,
    pointers: &[u32],
    add_item: impl Fn(usize, &mut [u32]) + Sync,
) -> Result<Vec<u32>> {
    let mut row_counts = vec![0u32; n_rows];
    let n_windows = pointers.len().saturating_sub(1);
    let chunks = chunk_by_work(n_windows, |w| pointers[w] as usize + w);
    let count_slices = split_by_lens(
        &mut row_counts,
        chunks
            .iter()
            .map(|c| (c.end * ROWS).min(n_rows) - (c.start * ROWS).min(n_rows)),
    );
    chunks
        .par_iter()
        .zip(count_slices)
        .for_each(|(windows, counts)| {
            for w in windows.clone() {
                let base = (w - windows.start) * ROWS;
                let end = (base + ROWS).min(counts.len());
                let rows = &mut counts[base..end];
                for item in pointers[w] as usize..pointers[w + 1] as usize {
                    add_item(item, rows);
                }
            }
        });
    offsets_from_counts(&row_counts)
}

/// Makes `$ty` a [`SlotWindows`] format of `$rows`-row windows whose window `w` owns items
/// (blocks, vectors) `self.$items[w]..self.$items[w + 1]` of `$per_item` slots each, visited by
/// the inherent `for_each_slot_in(w, f)`; and gives it the public, inherent slot conversions:
/// `edge_to_slot` (slot indices checked against `u32` under the name `$index`; `$slot` and
/// `$limit` document the slot formula and the size past which it overflows),
/// `gather_to_csr_order`, `scatter_to_slots` and `window_fills`.
macro_rules! slot_windows {
    ($ty:ident {
        rows: $rows:expr,
        items: $items:ident,
        slots_per_item: $per_item:expr,
        index: $index:literal,
        slot: $slot:literal,
        limit: $limit:literal $(,)?
    }) => {
        impl $crate::window::SlotWindows<$rows> for $ty {
            fn edge_offsets(&self) -> &[u32] {
                &self.edge_offsets
            }

            fn first_slot(&self, w: usize) -> usize {
                self.$items[w] as usize * $per_item
            }

            fn for_each_slot(&self, w: usize, f: impl FnMut(usize, usize)) {
                self.for_each_slot_in(w, f)
            }
        }

        impl $ty {
            #[doc = concat!("The slot (", $slot, ") of every CSR edge, in CSR order.")]
            ///
            /// Errors: [`Error::DimensionTooLarge`] if a slot index does not fit in `u32`
            #[doc = concat!("(more than ", $limit, ").")]
            pub fn edge_to_slot(&self) -> Result<Vec<u32>> {
                $crate::offsets::check_slot_index($index, self.n_slots())?;
                Ok(self.slot_of_each_edge())
            }

            /// Reads slot-major data (`n_slots` entries, e.g. SDDMM scores written in the slot
            /// layout) back into CSR edge order.
            ///
            /// Errors: [`Error::LengthMismatch`] if `slot_data.len() != n_slots()`.
            pub fn gather_to_csr_order<T: Copy + Send + Sync>(
                &self,
                slot_data: &[T],
            ) -> Result<Vec<T>> {
                $crate::offsets::check_len("slot data", self.n_slots(), slot_data.len())?;
                Ok(self.gather_slots(slot_data))
            }

            /// Writes per-edge data in CSR order (`nnz` entries) into the slot layout
            /// (`n_slots` entries); slots with no edge (padding included) get `fill`.
            ///
            /// Errors: [`Error::LengthMismatch`] if `edge_data.len() != nnz()`.
            pub fn scatter_to_slots<T: Copy + Send + Sync>(
                &self,
                edge_data: &[T],
                fill: T,
            ) -> Result<Vec<T>> {
                $crate::offsets::check_len("edge data", self.nnz(), edge_data.len())?;
                Ok(self.scatter_edges(edge_data, fill, self.n_slots()))
            }

            #[doc = concat!("[`", stringify!($ty), "::window_fill`] of every window.")]
            pub fn window_fills(&self) -> Vec<f64> {
                (0..self.n_windows())
                    .into_par_iter()
                    .map(|w| self.window_fill(w))
                    .collect()
            }
        }
    };
}
pub(crate) use slot_windows;
