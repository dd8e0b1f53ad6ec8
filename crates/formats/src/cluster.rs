//! Greedy window packing ([`Permutation::window_clusters`]): a row order built window by window
//! so that each window's rows share as many columns as the greedy can find — fewer distinct
//! columns per window, i.e. fewer K/V rows for a windowed kernel to gather.
//!
//! A locality order (reverse Cuthill–McKee) only keeps a row's neighbours *near* it; a 16-row
//! window then still holds rows from two or three breadth-first levels that share little. The
//! packing instead fills each window explicitly: it starts from the first row not yet placed
//! (in a seed order, usually the locality order) and adds, one at a time, the unplaced row with
//! the most columns already in the window per column it would add. It gathers fewer rows than
//! the locality order on the shared real graphs and more on R-MAT graphs, where
//! [`crate::Reorder::Auto`] keeps the locality order (docs/kernels/reordering.md, "Measured").

use crate::csr::Csr;
use crate::error::{Error, Result};
use crate::permutation::Permutation;

/// Columns held by more rows than this are not followed when the packing looks for rows to add
/// to a window (they would make every row a candidate and cost O(rows) per window); the rows
/// that share them are still found through their other columns. 512: fewer gathers than a lower
/// cap, about as few as none at a quarter of the time (docs/kernels/reordering.md, "Tried and
/// rejected").
pub const CLUSTER_COLUMN_CAP: usize = 512;

/// The work [`Permutation::window_clusters`] does on `a`, in candidate updates: every stored
/// entry `(r, c)` whose column `c` is held by at most [`CLUSTER_COLUMN_CAP`] rows counts the
/// rows holding `c`. Each entry is visited once (when its row joins a window), so this bounds
/// the packing's candidate updates (and its offers) exactly. O(nnz + n_cols).
pub fn cluster_work(a: &Csr) -> u64 {
    let mut holders = vec![0u32; a.n_cols()];
    for &c in a.col_indices() {
        holders[c as usize] += 1;
    }
    a.col_indices()
        .iter()
        .map(|&c| holders[c as usize] as usize)
        .filter(|&h| h <= CLUSTER_COLUMN_CAP)
        .map(|h| h as u64)
        .sum()
}

/// Priority of adding a row with `overlap` of its `degree` columns already in the window: the
/// overlap per column it would add, in fixed point (ties: the larger overlap, then the lower
/// row id — see the candidates' key).
fn score(overlap: u32, degree: usize) -> u64 {
    let added = (degree as u64).saturating_sub(overlap as u64);
    ((overlap as u64) << 20) / (added + 1)
}

/// The candidates of a window that can still be picked: the best `room` rows by key, `room`
/// being the picks left. A row outside them cannot become the best before the window closes
/// (`room` rows with larger keys, which only grow, stand before it, and each pick takes one)
/// unless its own key grows, and then it is offered again; so the best of these is the best of
/// all. Once full it stays full for the window (a pick removes one key and one pick of room; a
/// seed is taken only when there is no key), so a seed never displaces a candidate. Up to
/// `window_rows` keys, scanned on an accepted offer: no heap of every offer.
struct Best {
    keys: Vec<u128>,
    room: usize,
    /// The smallest key when `keys` holds `room` of them (an offer at or below it is refused
    /// at once), else 0.
    floor: u128,
}

impl Best {
    fn new(capacity: usize) -> Self {
        Self {
            keys: Vec::with_capacity(capacity),
            room: 0,
            floor: 0,
        }
    }

    fn reset(&mut self, room: usize) {
        self.keys.clear();
        self.room = room;
        self.floor = 0;
    }

    /// A row's key (its caller id in the low 32 bits, inverted), new or grown.
    fn offer(&mut self, k: u128) {
        // Full and not above the floor: the row is not among the keys either (its key there
        // would be at least the floor, and keys only grow).
        if self.room == 0 || (self.keys.len() == self.room && k <= self.floor) {
            return;
        }
        let row = k as u32;
        if let Some(e) = self.keys.iter_mut().find(|e| **e as u32 == row) {
            *e = k;
        } else if self.keys.len() < self.room {
            self.keys.push(k);
        } else if let Some(lowest) = self.keys.iter_mut().min() {
            *lowest = k;
        }
        self.refloor();
    }

    /// Takes the best row (its caller id, from the key), if any; in any case one pick of the
    /// window is used.
    fn take_max(&mut self) -> Option<usize> {
        let at = (0..self.keys.len()).max_by_key(|&i| self.keys[i]);
        let k = at.map(|i| self.keys.swap_remove(i));
        // With a key taken, at most room − 1 remain; without, a seed takes the pick.
        self.room = self.room.saturating_sub(1);
        self.refloor();
        k.map(|k| !(k as u32) as usize)
    }

    fn refloor(&mut self) {
        self.floor = if self.keys.len() == self.room {
            self.keys.iter().copied().min().unwrap_or(0)
        } else {
            0
        };
    }
}

impl Permutation {
    /// Greedy window packing: new rows `w·window_rows ..` (window `w`) are chosen one at a time.
    /// A window opens with the first row of `seeds` (the identity when `None`) not yet placed;
    /// then, until it holds `window_rows` rows, it takes the unplaced row with the highest
    /// `overlap / (added + 1)`, where `overlap` counts the row's columns already in the window
    /// (found through columns held by at most [`CLUSTER_COLUMN_CAP`] rows) and `added` the rest;
    /// when no unplaced row shares a column with the window it takes the next seed. Rows keep
    /// their columns; works for rectangular matrices too. Deterministic.
    ///
    /// Single-threaded, O([`cluster_work`] · `window_rows`) time at worst (each accepted offer
    /// scans the window's candidates; ~0.5 s on ogbn-arxiv, 2.5 M entries, 16-row windows), O(n +
    /// nnz) memory (it builds the transpose).
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] for `window_rows` of 0; [`Error::LengthMismatch`] if `seeds`
    /// does not have one entry per row.
    ///
    /// ```
    /// use spattn_formats::{Csr, Permutation};
    /// // Rows 0 and 2 share columns {0, 1}, rows 1 and 3 share {2, 3}: 2-row windows of the
    /// // graph's own order hold 4 distinct columns each, the packed ones 2.
    /// let a = Csr::from_edges(
    ///     4,
    ///     4,
    ///     &[(0, 0), (0, 1), (1, 2), (1, 3), (2, 0), (2, 1), (3, 2), (3, 3)],
    /// )?;
    /// let p = Permutation::window_clusters(&a, 2, None)?;
    /// assert_eq!(p.old_of_new(), &[0, 2, 1, 3]);
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn window_clusters(
        a: &Csr,
        window_rows: usize,
        seeds: Option<&Permutation>,
    ) -> Result<Self> {
        if window_rows == 0 {
            return Err(Error::InvalidParameter {
                what: "window_rows",
                why: "0 rows per window; it must be at least 1".to_string(),
            });
        }
        let n = a.n_rows();
        if let Some(s) = seeds {
            crate::offsets::check_len("seed order (matrix rows)", n, s.len())?;
        }
        // Rows are handled by their position in the seed order (row `x` here is the caller's
        // `old_of[x]`): rows that share columns sit near each other there, so the per-row state
        // each visit touches is more often in cache. Keys and ties use the caller's ids, so the
        // picks are those of the caller's numbering.
        let permuted;
        let (b, old_of): (&Csr, Option<&[u32]>) = match seeds {
            Some(s) => {
                permuted = s.permute_csr_rows(a)?;
                (&permuted, Some(s.old_of_new()))
            }
            None => (a, None),
        };
        let caller = |x: usize| old_of.map_or(x, |o| o[x] as usize);
        let position = |id: usize| seeds.map_or(id, |s| s.new_of_old()[id] as usize);
        // Row lists of each column: the rows that share it. Placed rows are dropped from a list
        // as its column is visited (`live_end`), so each entry is skipped at most once; the
        // picks do not depend on the lists' order (the keys are unique).
        let (_, _, starts, mut held, _) = b.transpose().into_parts();
        let mut live_end: Vec<u32> = starts[1..].to_vec();
        let mut placed = vec![false; n];
        let mut overlap = vec![0u32; n];
        let mut touched: Vec<usize> = Vec::new();
        // Rows whose overlap grew since the last pick: each is offered once per pick, with its
        // overlap then (one offer per row and pick instead of one per increment; the rows that
        // can win are the same).
        let mut dirty: Vec<u32> = Vec::new();
        let mut is_dirty = vec![false; n];
        // Keys: (score, overlap, lowest id first) packed into a u128 (r < n ≤ u32::MAX, so
        // !r in 32 bits orders ids low-first): unique, and a row's only grows in a window.
        let key = |x: usize, o: u32| -> u128 {
            (u128::from(score(o, b.degree(x))) << 64)
                | (u128::from(o) << 32)
                | u128::from(!(caller(x) as u32))
        };
        let mut best = Best::new(window_rows.min(n));
        // in_window[c] == w: column c is already in window w.
        let mut in_window = vec![usize::MAX; a.n_cols()];
        let mut old_of_new: Vec<u32> = Vec::with_capacity(n);
        let mut next_seed = 0usize;
        let mut window = 0usize;
        while old_of_new.len() < n {
            let end = (old_of_new.len() + window_rows).min(n);
            best.reset(end - old_of_new.len());
            while old_of_new.len() < end {
                for x in dirty.drain(..) {
                    let x = x as usize;
                    is_dirty[x] = false;
                    if !placed[x] {
                        best.offer(key(x, overlap[x]));
                    }
                }
                let r = match best.take_max() {
                    // The key holds the caller's id.
                    Some(id) => position(id),
                    None => {
                        // Fewer than n rows are placed, and every seed before `next_seed` is,
                        // so an unplaced seed lies at or after it: the loop stays in bounds.
                        while placed[next_seed] {
                            next_seed += 1;
                        }
                        next_seed
                    }
                };
                placed[r] = true;
                // caller(r) < n ≤ MAX_DIM < u32::MAX.
                old_of_new.push(caller(r) as u32);
                for &c in b.row(r) {
                    let c = c as usize;
                    if in_window[c] == window {
                        continue;
                    }
                    in_window[c] = window;
                    // The cap counts every holder, placed or not (as the work bound does).
                    let (s, e) = (starts[c] as usize, live_end[c] as usize);
                    if (starts[c + 1] - starts[c]) as usize > CLUSTER_COLUMN_CAP {
                        continue;
                    }
                    let mut w = s;
                    for i in s..e {
                        let x = held[i];
                        let xi = x as usize;
                        if placed[xi] {
                            continue;
                        }
                        held[w] = x;
                        w += 1;
                        if overlap[xi] == 0 {
                            touched.push(xi);
                        }
                        overlap[xi] += 1;
                        if !is_dirty[xi] {
                            is_dirty[xi] = true;
                            dirty.push(x);
                        }
                    }
                    // w ≤ e ≤ nnz, which fits u32 (a Csr's offsets are u32).
                    live_end[c] = w as u32;
                }
            }
            for x in touched.drain(..) {
                overlap[x] = 0;
            }
            for x in dirty.drain(..) {
                is_dirty[x as usize] = false;
            }
            window += 1;
        }
        Permutation::from_old_of_new(old_of_new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reorder::count_windows;

    /// The packing as its doc states it, without the candidate set: each pick scans every unplaced row
    /// and counts its distinct window columns held by at most the cap's rows.
    fn naive_clusters(a: &Csr, window_rows: usize, seeds: Option<&Permutation>) -> Vec<u32> {
        let n = a.n_rows();
        let holders = a.transpose();
        let followed = |c: u32| holders.row(c as usize).len() <= CLUSTER_COLUMN_CAP;
        let mut placed = vec![false; n];
        let mut order = Vec::new();
        let mut seed = 0;
        while order.len() < n {
            let mut window_cols = std::collections::HashSet::new();
            let end = (order.len() + window_rows).min(n);
            while order.len() < end {
                let best = (0..n)
                    .filter(|&x| !placed[x])
                    .filter_map(|x| {
                        let o = a
                            .row(x)
                            .iter()
                            .filter(|&&c| followed(c) && window_cols.contains(&c))
                            .count() as u32;
                        (o > 0).then(|| ((score(o, a.degree(x)), o, std::cmp::Reverse(x)), x))
                    })
                    .max()
                    .map(|(_, x)| x);
                let r = best.unwrap_or_else(|| {
                    let at = |i: usize| seeds.map_or(i, |s| s.old_of_new()[i] as usize);
                    while placed[at(seed)] {
                        seed += 1;
                    }
                    at(seed)
                });
                placed[r] = true;
                order.push(r as u32);
                window_cols.extend(a.row(r).iter().copied());
            }
        }
        order
    }

    #[test]
    fn the_packing_is_the_greedy_its_doc_states() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % m
        };
        for (n, avg, hub) in [
            (40usize, 3u64, false),
            (200, 6, false),
            (CLUSTER_COLUMN_CAP + 100, 4, true),
        ] {
            let mut edges = Vec::new();
            for r in 0..n as u32 {
                for _ in 0..next(2 * avg) {
                    edges.push((r, next(n as u64) as u32));
                }
            }
            if hub {
                // A column held by more rows than the cap: never followed.
                edges.extend((0..n as u32).map(|r| (r, 0)));
            }
            let a = Csr::from_edges(n, n, &edges).unwrap();
            let seeds = Permutation::by_degree_descending(&a);
            for (rows, s) in [(4, None), (16, Some(&seeds)), (7, Some(&seeds))] {
                let got = Permutation::window_clusters(&a, rows, s).unwrap();
                assert_eq!(
                    got.old_of_new(),
                    naive_clusters(&a, rows, s),
                    "n {n} rows {rows}"
                );
            }
        }
    }

    #[test]
    fn packs_rows_that_share_columns_and_is_a_permutation() {
        // Four cliques of 4 rows each, their rows interleaved (row i in clique i % 4): natural
        // 4-row windows see all 16 columns each, packed ones see 4.
        let mut edges = Vec::new();
        for i in 0..16u32 {
            for j in 0..16u32 {
                if i % 4 == j % 4 {
                    edges.push((i, j));
                }
            }
        }
        let a = Csr::from_edges(16, 16, &edges).unwrap();
        assert_eq!(count_windows(&a, None, 4, 1).unwrap().1, 64);
        let p = Permutation::window_clusters(&a, 4, None).unwrap();
        assert_eq!(p.len(), 16);
        assert_eq!(count_windows(&a, Some(&p), 4, 1).unwrap().1, 16);
        // Same with a seed order and a window height that does not divide n.
        let seeds = Permutation::by_degree_descending(&a);
        let q = Permutation::window_clusters(&a, 3, Some(&seeds)).unwrap();
        assert!(
            count_windows(&a, Some(&q), 3, 1).unwrap().1 < count_windows(&a, None, 3, 1).unwrap().1
        );
    }

    #[test]
    fn empty_rows_hubs_rectangular_and_errors() {
        // Column 0 is held by more rows than the cap, so it is not followed; rows without
        // entries (the last 8) are still placed, through the seeds.
        let n = CLUSTER_COLUMN_CAP + 40;
        let mut edges: Vec<(u32, u32)> = (0..n as u32 - 8).map(|r| (r, 0)).collect();
        edges.push((3, 5));
        edges.push((7, 5));
        let a = Csr::from_edges(n, 9, &edges).unwrap();
        let p = Permutation::window_clusters(&a, 16, None).unwrap();
        assert_eq!(p.len(), n);
        // Rows 3 and 7 share column 5 (the hub column 0 is not followed): same window.
        let new = p.new_of_old();
        assert_eq!(new[3] / 16, new[7] / 16);
        assert_eq!(cluster_work(&a), 2 * 2);
        assert!(Permutation::window_clusters(&a, 0, None).is_err());
        let short = Permutation::identity(3).unwrap();
        let e = Permutation::window_clusters(&a, 4, Some(&short)).unwrap_err();
        assert!(e.to_string().contains("seed order"), "{e}");
        let empty = Csr::empty(0, 4).unwrap();
        assert!(Permutation::window_clusters(&empty, 16, None)
            .unwrap()
            .is_empty());
    }
}
