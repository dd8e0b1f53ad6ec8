//! Row orders for the windowed tensor-core formats ([`crate::Bsb`]'s 16-row windows,
//! [`crate::MeBcrs`]'s 8-row windows): [`Reorder`] names a policy, [`RowOrder::choose`] applies
//! it to a graph by counting the (window, distinct column) pairs each candidate order gives —
//! the K/V rows a windowed kernel gathers — without building the format.
//!
//! Only rows are renumbered; column ids stay the caller's, so a kernel gathers K and V from
//! the caller's arrays and loads Q / stores its output through the order's `old_of_new` array
//! (zero-copy).
//!
//! ```
//! use spattn_formats::{Csr, Reorder, RowOrder};
//! // Rows 0 and 2 share their columns, rows 1 and 3 theirs: with 2-row windows the natural
//! // order gives every window 4 distinct columns; pairing like rows would give each 2.
//! let a = Csr::from_edges(
//!     4,
//!     4,
//!     &[(0, 0), (0, 1), (1, 2), (1, 3), (2, 0), (2, 1), (3, 2), (3, 3)],
//! )?;
//! let natural = RowOrder::choose(&a, Reorder::None, 2)?;
//! assert_eq!((natural.gathers_natural, natural.gathers), (8, 8));
//! let auto = RowOrder::choose(&a, Reorder::Auto, 2)?;
//! assert!(auto.gathers <= natural.gathers);
//! assert_eq!(auto.row_ids().map(<[u32]>::len).unwrap_or(4), 4);
//! # Ok::<(), spattn_formats::Error>(())
//! ```

use rayon::prelude::*;

use crate::cluster::cluster_work;
use crate::csr::Csr;
use crate::error::{Error, Result};
use crate::permutation::Permutation;

/// [`Reorder::Locality`] peels rows above this many times the mean degree before its
/// breadth-first search: hubs would otherwise pull unrelated rows into the same levels
/// (docs/kernels/reordering.md, "Tried and kept").
pub const HUB_FACTOR: f64 = 32.0;

/// [`Reorder::Auto`] renumbers only when it saves at least this fraction of the gathers.
pub const AUTO_MIN_SAVING: f64 = 0.05;

/// [`Reorder::Auto`] tries [`Reorder::Cluster`] only when its work
/// ([`crate::cluster::cluster_work`]) is at most this, about 2.5 s on one core: ogbn-arxiv and
/// R-MAT 16 are in, R-MAT 18 and above are not (docs/kernels/reordering.md, "Host-side
/// choices"). Ask for [`Reorder::Cluster`] by name to pack a larger graph.
pub const AUTO_CLUSTER_MAX_WORK: u64 = 250_000_000;

/// How rows are renumbered before they are tiled into windows, so that a window's rows share
/// more columns and a windowed kernel gathers fewer K/V rows. The renumbering is internal and
/// zero-copy: kernels load Q and store the output through the order's row-id array, and K/V
/// are gathered at the caller's (original) column ids.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Reorder {
    /// The graph's own order.
    None,
    /// Longest rows first (RT-GNN's degree reordering).
    Degree,
    /// Reverse Cuthill–McKee after peeling the hubs (rows above [`HUB_FACTOR`]× the mean degree
    /// first): a breadth-first locality order. A rectangular graph's rows are ordered as they
    /// fall in the search over its rows and columns together
    /// ([`Permutation::rows_by_bipartite_locality`]).
    Locality,
    /// Greedy window packing ([`Permutation::window_clusters`]) seeded with the locality order
    /// (for a rectangular graph, the bipartite one): each window is filled with the rows that add
    /// the fewest new columns to it. Gathers fewer rows than [`Reorder::Locality`] on the
    /// shared real graphs, more on R-MAT graphs (docs/kernels/reordering.md, "Measured").
    Cluster,
    /// Counts the (window, distinct column) pairs — the K/V row gathers — under each order and
    /// keeps the order with the fewest (the graph's own unless another saves at least
    /// [`AUTO_MIN_SAVING`]). Costs a reverse Cuthill–McKee (O(nnz · log degree), wide
    /// frontiers on every thread; over rows and columns for a rectangular graph, which keeps
    /// its order where that bipartite graph passes u32 indices), the window packing when its
    /// work is at most
    /// [`AUTO_CLUSTER_MAX_WORK`], and four counts (times: docs/kernels/reordering.md,
    /// "Plan-time costs").
    #[default]
    Auto,
}

impl Reorder {
    /// Every choice, `Auto` last.
    pub const ALL: [Reorder; 5] = [
        Reorder::None,
        Reorder::Degree,
        Reorder::Locality,
        Reorder::Cluster,
        Reorder::Auto,
    ];

    /// The name used on command lines and in reports: `none`, `degree`, `locality`, `cluster`,
    /// `auto`.
    pub const fn name(self) -> &'static str {
        match self {
            Reorder::None => "none",
            Reorder::Degree => "degree",
            Reorder::Locality => "locality",
            Reorder::Cluster => "cluster",
            Reorder::Auto => "auto",
        }
    }
}

crate::named_choice!(Reorder, Error, "reordering", |why| {
    Error::InvalidParameter {
        what: "reorder",
        why,
    }
});

/// What the windows of `a` would hold with its rows taken in the order of `rows`
/// (`rows.old_of_new()[new]` is the old row of new row `new`; the identity when `None`) and
/// `window_rows` rows per window: (windows, (window, distinct column) pairs, blocks of
/// `block_cols` columns, i.e. `ceil(columns of the window / block_cols)` summed). Windows in
/// parallel.
pub(crate) fn count_windows(
    a: &Csr,
    rows: Option<&Permutation>,
    window_rows: usize,
    block_cols: usize,
) -> Result<(usize, usize, usize)> {
    let n = a.n_rows();
    if let Some(p) = rows {
        crate::offsets::check_len("row order (matrix rows)", n, p.len())?;
    }
    if window_rows == 0 || block_cols == 0 {
        return Err(Error::InvalidParameter {
            what: "window shape",
            why: format!("{window_rows} rows x {block_cols} columns; both must be at least 1"),
        });
    }
    let order = rows.map(Permutation::old_of_new);
    let n_windows = n.div_ceil(window_rows);
    let (columns, blocks) = (0..n_windows)
        .into_par_iter()
        .with_min_len(256)
        .fold(
            || (Vec::new(), 0usize, 0usize),
            |(mut scratch, columns, blocks), w| {
                scratch.clear();
                for r in w * window_rows..((w + 1) * window_rows).min(n) {
                    let old = order.map_or(r, |o| o[r] as usize);
                    scratch.extend_from_slice(a.row(old));
                }
                scratch.sort_unstable();
                scratch.dedup();
                let c = scratch.len();
                (scratch, columns + c, blocks + c.div_ceil(block_cols))
            },
        )
        .map(|(_, c, b)| (c, b))
        .reduce(|| (0, 0), |x, y| (x.0 + y.0, x.1 + y.1));
    Ok((n_windows, columns, blocks))
}

/// A row order for a windowed format, and what it was chosen from.
#[derive(Clone, Debug)]
pub struct RowOrder {
    /// The order used; `None` keeps the graph's own.
    pub permutation: Option<Permutation>,
    /// The policy that produced it ([`Reorder::None`], [`Reorder::Degree`],
    /// [`Reorder::Locality`] or [`Reorder::Cluster`]; never [`Reorder::Auto`], which resolves
    /// to one of them).
    pub used: Reorder,
    /// Rows per window the counts are for.
    pub window_rows: usize,
    /// (window, distinct column) pairs of the graph's own order.
    pub gathers_natural: usize,
    /// (window, distinct column) pairs of the order used.
    pub gathers: usize,
    /// What `Auto` did not try, and why (window packing past its work bound), for the report.
    pub skipped: Option<String>,
    /// Wall time of [`choose`](Self::choose): the orders tried and their counts, ms.
    pub choose_ms: f64,
}

impl RowOrder {
    /// The order `reorder` asks for on `a`, for windows of `window_rows` rows (16 for BSB, 8
    /// for ME-BCRS). A rectangular graph's locality order is that of its rows in the bipartite
    /// graph of its rows and columns ([`Permutation::rows_by_bipartite_locality`]).
    ///
    /// # Errors
    /// [`Error::InvalidParameter`] if `window_rows` is 0.
    pub fn choose(a: &Csr, reorder: Reorder, window_rows: usize) -> Result<Self> {
        let started = std::time::Instant::now();
        let count = |p: Option<&Permutation>| -> Result<usize> {
            Ok(count_windows(a, p, window_rows, 1)?.1)
        };
        let square = a.n_rows() == a.n_cols();
        // A rectangular graph (a partitioned plan's rank: its rows × its halo) takes the order
        // of its rows and columns as one bipartite graph, where that graph fits u32 indices;
        // past them it keeps its order (said in `skipped`).
        let too_large = if square {
            None
        } else {
            crate::permutation::check_bipartite(a).err()
        };
        let locality = || -> Result<Option<Permutation>> {
            if square {
                Permutation::reverse_cuthill_mckee_peeling_hubs(a, HUB_FACTOR).map(Some)
            } else if too_large.is_none() {
                Permutation::rows_by_bipartite_locality(a, HUB_FACTOR).map(Some)
            } else {
                Ok(None)
            }
        };
        let mut skipped = too_large
            .as_ref()
            .map(|e| format!("locality order skipped ({e})"));
        let (natural, (used, permutation, gathers)) = match reorder {
            Reorder::Auto => {
                let work = cluster_work(a);
                let pack = work <= AUTO_CLUSTER_MAX_WORK;
                if !pack && skipped.is_none() {
                    skipped = Some(format!(
                        "window packing skipped (its work {work} > bound {AUTO_CLUSTER_MAX_WORK})"
                    ));
                }
                // The locality order and the packing seeded by it (the long, sequential part)
                // beside the graph's and the degree order's counts.
                type Counted = Result<(Permutation, usize)>;
                let counted = |p: Permutation| -> Counted { count(Some(&p)).map(|g| (p, g)) };
                let ((natural, degree), (seeds, packed)) = rayon::join(
                    || {
                        rayon::join(
                            || count(None),
                            || counted(Permutation::by_degree_descending(a)),
                        )
                    },
                    || -> (Option<Counted>, Option<Counted>) {
                        let seeds = match locality() {
                            Ok(Some(s)) => s,
                            Ok(None) => return (None, None),
                            Err(e) => return (Some(Err(e)), None),
                        };
                        let packed = pack.then(|| {
                            counted(Permutation::window_clusters(a, window_rows, Some(&seeds))?)
                        });
                        (Some(counted(seeds)), packed)
                    },
                );
                let natural = natural?;
                // In this order on ties: degree, packing, locality.
                let mut best = (Reorder::None, None, natural);
                let candidates = [
                    Some((Reorder::Degree, degree)),
                    packed.map(|p| (Reorder::Cluster, p)),
                    seeds.map(|p| (Reorder::Locality, p)),
                ];
                for (r, c) in candidates.into_iter().flatten() {
                    let (p, g) = c?;
                    if (g as f64) < (1.0 - AUTO_MIN_SAVING) * natural as f64 && g < best.2 {
                        best = (r, Some(p), g);
                    }
                }
                (natural, best)
            }
            Reorder::None => {
                let natural = count(None)?;
                (natural, (Reorder::None, None, natural))
            }
            r => {
                let natural = count(None)?;
                let p = match r {
                    Reorder::Degree => Some(Permutation::by_degree_descending(a)),
                    Reorder::Cluster => Some(Permutation::window_clusters(
                        a,
                        window_rows,
                        locality()?.as_ref(),
                    )?),
                    _ => locality()?,
                };
                match p {
                    Some(p) => {
                        let g = count(Some(&p))?;
                        (natural, (r, Some(p), g))
                    }
                    None => (natural, (Reorder::None, None, natural)),
                }
            }
        };
        Ok(Self {
            permutation,
            used,
            window_rows,
            gathers_natural: natural,
            gathers,
            skipped,
            choose_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Per new row, its old row (`old_of_new`), or `None` for the graph's own order.
    pub fn row_ids(&self) -> Option<&[u32]> {
        self.permutation.as_ref().map(Permutation::old_of_new)
    }

    /// One line for a plan's report: the order and its gathers against the graph's own.
    pub fn info(&self) -> String {
        let mut line = format!(
            "rows {}-ordered: {} K/V row gathers per head ({:.2}x fewer than the graph's order; \
             chosen in {:.0} ms)",
            self.used,
            self.gathers,
            self.gathers_natural as f64 / self.gathers.max(1) as f64,
            self.choose_ms
        );
        if let Some(s) = &self.skipped {
            line += "; ";
            line += s;
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_says_when_its_work_bound_skips_window_packing() {
        let small = crate::rmat(
            &crate::RmatConfig::new(12)
                .with_symmetrize(true)
                .with_seed(1),
        )
        .unwrap();
        let o = RowOrder::choose(&small, Reorder::Auto, 16).unwrap();
        assert!(cluster_work(&small) <= AUTO_CLUSTER_MAX_WORK);
        assert!(
            o.skipped.is_none() && !o.info().contains("skipped"),
            "{}",
            o.info()
        );
        let big = crate::rmat(
            &crate::RmatConfig::new(18)
                .with_symmetrize(true)
                .with_seed(1),
        )
        .unwrap();
        assert!(cluster_work(&big) > AUTO_CLUSTER_MAX_WORK);
        let o = RowOrder::choose(&big, Reorder::Auto, 16).unwrap();
        assert_ne!(o.used, Reorder::Cluster);
        let info = o.info();
        assert!(
            info.contains("window packing skipped") && info.contains("bound"),
            "{info}"
        );
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_errors() {
        for r in Reorder::ALL {
            assert_eq!(r.name().parse::<Reorder>().unwrap(), r);
            assert_eq!(r.to_string(), r.name());
        }
        let e = "rcm".parse::<Reorder>().unwrap_err().to_string();
        assert!(e.contains("\"rcm\"") && e.contains("locality"), "{e}");
    }

    #[test]
    fn counts_match_a_brute_force_count() {
        let a = crate::rmat(&crate::RmatConfig::benchmark(8).with_seed(3)).unwrap();
        let p = Permutation::by_degree_descending(&a);
        for window_rows in [1usize, 8, 16, 100] {
            let (w, c, b) = count_windows(&a, Some(&p), window_rows, 8).unwrap();
            let old = p.old_of_new();
            let mut cols = 0;
            let mut blocks = 0;
            for win in 0..a.n_rows().div_ceil(window_rows) {
                let mut s = std::collections::BTreeSet::new();
                let rows = win * window_rows..((win + 1) * window_rows).min(a.n_rows());
                for &o in &old[rows] {
                    s.extend(a.row(o as usize).iter().copied());
                }
                cols += s.len();
                blocks += s.len().div_ceil(8);
            }
            assert_eq!((w, c, b), (a.n_rows().div_ceil(window_rows), cols, blocks));
        }
    }

    #[test]
    fn choices_never_count_more_than_asked_and_bad_shapes_are_errors() {
        let a = crate::rmat(&crate::RmatConfig::benchmark(9).with_seed(5)).unwrap();
        for window_rows in [8usize, 16] {
            let none = RowOrder::choose(&a, Reorder::None, window_rows).unwrap();
            assert!(none.permutation.is_none() && none.gathers == none.gathers_natural);
            let auto = RowOrder::choose(&a, Reorder::Auto, window_rows).unwrap();
            assert!(auto.gathers <= auto.gathers_natural);
            assert_ne!(auto.used, Reorder::Auto);
            for r in [Reorder::Degree, Reorder::Locality, Reorder::Cluster] {
                let o = RowOrder::choose(&a, r, window_rows).unwrap();
                assert_eq!(o.used, r);
                let ids = o.row_ids().unwrap();
                assert_eq!(ids.len(), a.n_rows());
                // A permuted count equals the count of the permuted matrix.
                let pa = o
                    .permutation
                    .as_ref()
                    .unwrap()
                    .permute_csr_rows(&a)
                    .unwrap();
                assert_eq!(
                    count_windows(&pa, None, window_rows, 1).unwrap().1,
                    o.gathers
                );
            }
        }
        assert!(RowOrder::choose(&a, Reorder::None, 0).is_err());
        let short = Permutation::identity(3).unwrap();
        assert!(count_windows(&a, Some(&short), 8, 8).is_err());
    }

    #[test]
    fn rectangular_graphs_take_their_rows_bipartite_locality_order() {
        // 256 rows × 1,024 columns: row i reads the 8 columns of group g(i) = (i · 37) mod 32,
        // so the graph's order puts 16 different groups in each 16-row window.
        let (rows, groups) = (256u32, 32u32);
        let edges: Vec<(u32, u32)> = (0..rows)
            .flat_map(|i| {
                let g = (i * 37) % groups;
                (0..8).map(move |c| (i, g * 32 + c))
            })
            .collect();
        let a = Csr::from_edges(rows as usize, 1024, &edges).unwrap();
        let natural = RowOrder::choose(&a, Reorder::None, 16).unwrap();
        assert!(natural.permutation.is_none());
        // Rows sharing a group are two steps apart in the bipartite graph: the 8 rows of a
        // group end up together, two groups a window.
        let loc = RowOrder::choose(&a, Reorder::Locality, 16).unwrap();
        assert_eq!(loc.used, Reorder::Locality);
        assert_eq!(loc.row_ids().unwrap().len(), rows as usize);
        assert_eq!(natural.gathers, 16 * 16 * 8);
        assert_eq!(loc.gathers, 16 * 2 * 8, "{loc:?}");
        let auto = RowOrder::choose(&a, Reorder::Auto, 16).unwrap();
        assert_ne!(auto.used, Reorder::None);
        assert!(auto.gathers <= loc.gathers, "{auto:?}");
        for r in [Reorder::Degree, Reorder::Cluster] {
            let o = RowOrder::choose(&a, r, 16).unwrap();
            assert_eq!(o.used, r);
            assert_eq!(o.row_ids().unwrap().len(), rows as usize);
        }
        // Nothing to gain on a tiny graph: Auto keeps its order.
        let tiny = Csr::from_edges(3, 5, &[(0, 4), (1, 0), (1, 1), (2, 3)]).unwrap();
        assert_eq!(
            RowOrder::choose(&tiny, Reorder::Auto, 8).unwrap().used,
            Reorder::None
        );
    }
}
