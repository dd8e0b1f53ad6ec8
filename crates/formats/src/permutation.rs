//! Node permutations: RT-GNN's degree reordering, and a locality order (reverse Cuthill–McKee).
//!
//! Sorting the nodes by in-degree (row length) before building the blocked tensor-core formats
//! puts the long rows together, so that the row windows of [`crate::MeBcrs`] and [`crate::Bsb`]
//! share more columns and fill their blocks better. The reordering is a [`Permutation`] applied
//! to the adjacency ([`Permutation::permute_csr`]) and to the feature rows
//! ([`Permutation::permute_rows`]); its inverse ([`Permutation::unpermute_rows`]) brings the
//! output back, so callers see the original node order.
//!
//! Convention: a permutation maps each **old** node label to a **new** one. It stores both
//! directions: [`Permutation::new_of_old`] (`new = new_of_old[old]`) and its inverse
//! [`Permutation::old_of_new`] (`old = old_of_new[new]`: the old node now at position `new`).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU32};

use rayon::prelude::*;

use crate::alloc::{try_filled, try_with_capacity};
use crate::csr::{Csr, MAX_DIM};
use crate::error::{Error, Result};

/// A bijection of `0..n`: node `old` is renamed `new_of_old[old]`.
///
/// Validated on construction ([`Permutation::try_new`]), so both directions are always exact
/// inverses of each other.
///
/// ```
/// use spattn_formats::{Csr, Permutation};
/// // Node 2 has the longest row, then node 0; node 1 has none.
/// let a = Csr::from_edges(3, 3, &[(0, 1), (2, 0), (2, 1)])?;
/// let p = Permutation::by_degree_descending(&a);
/// assert_eq!(p.old_of_new(), &[2, 0, 1]); // new position -> old node
/// assert_eq!(p.new_of_old(), &[1, 2, 0]); // old node -> new position
///
/// let b = p.permute_csr(&a)?;
/// assert_eq!(b.row(0), &[1, 2]); // old row 2 = {0, 1}, renamed {1, 2}
/// assert_eq!(p.inverse().permute_csr(&b)?, a);
///
/// // Feature rows follow the nodes (here 2 features per node), and come back unchanged.
/// let x = [0.0, 0.5, 1.0, 1.5, 2.0, 2.5];
/// let y = p.permute_rows(&x, 2)?;
/// assert_eq!(y, [2.0, 2.5, 0.0, 0.5, 1.0, 1.5]);
/// assert_eq!(p.unpermute_rows(&y, 2)?, x);
/// # Ok::<(), spattn_formats::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Permutation {
    new_of_old: Vec<u32>,
    old_of_new: Vec<u32>,
}

/// Whether the bipartite graph of `a`'s rows and columns
/// ([`Permutation::rows_by_bipartite_locality`]) fits u32 indices: rows + columns nodes and
/// 2 · nnz entries.
///
/// # Errors
/// [`Error::DimensionTooLarge`] or [`Error::TooManyEntries`] naming the count past its limit.
pub(crate) fn check_bipartite(a: &Csr) -> Result<()> {
    let nodes = a.n_rows() as u64 + a.n_cols() as u64;
    if nodes > MAX_DIM {
        return Err(Error::DimensionTooLarge {
            what: "bipartite graph nodes (rows + columns)",
            value: nodes,
            limit: MAX_DIM,
        });
    }
    let entries = 2 * a.nnz() as u64;
    if entries > crate::csr::MAX_NNZ {
        return Err(Error::TooManyEntries {
            nnz: entries,
            limit: crate::csr::MAX_NNZ,
        });
    }
    Ok(())
}

/// Marks an unfilled slot while inverting (never a valid value: n ≤ [`MAX_DIM`] < `u32::MAX`).
const UNSET: u32 = u32::MAX;

impl Permutation {
    /// Builds the permutation renaming node `old` to `new_of_old[old]`.
    ///
    /// # Errors
    /// [`Error::InvalidPermutation`] naming the first index whose value is out of range or
    /// repeats an earlier one; [`Error::DimensionTooLarge`] beyond [`MAX_DIM`] nodes.
    ///
    /// ```
    /// use spattn_formats::{Error, Permutation};
    /// let p = Permutation::try_new(vec![2, 0, 1])?;
    /// assert_eq!(p.old_of_new(), &[1, 2, 0]);
    /// let err = Permutation::try_new(vec![0, 2, 0]).unwrap_err();
    /// assert!(matches!(err, Error::InvalidPermutation { n: 3, .. }));
    /// assert_eq!(err.to_string(), "not a permutation of 0..3: value 0 at index 2 repeats index 0");
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn try_new(new_of_old: Vec<u32>) -> Result<Self> {
        let old_of_new = invert(&new_of_old)?;
        Ok(Self {
            new_of_old,
            old_of_new,
        })
    }

    /// Builds the permutation that puts old node `old_of_new[new]` at position `new` (a node
    /// order, such as a sort's output).
    ///
    /// # Errors
    /// As [`Permutation::try_new`].
    pub fn from_old_of_new(old_of_new: Vec<u32>) -> Result<Self> {
        let new_of_old = invert(&old_of_new)?;
        Ok(Self {
            new_of_old,
            old_of_new,
        })
    }

    /// The identity on `0..n`.
    ///
    /// # Errors
    /// [`Error::DimensionTooLarge`] beyond [`MAX_DIM`] nodes.
    pub fn identity(n: usize) -> Result<Self> {
        check_len(n)?;
        // n <= MAX_DIM < 2^32: every index fits u32.
        let id: Vec<u32> = (0..n as u64).map(|i| i as u32).collect();
        Ok(Self {
            new_of_old: id.clone(),
            old_of_new: id,
        })
    }

    /// RT-GNN's degree reordering: nodes sorted by row length (in-degree: row `i` lists what
    /// node `i` attends to), longest first; ties keep their original order (stable).
    ///
    /// The permutation has `a.n_rows()` nodes. Counting sort: O(n + max degree).
    pub fn by_degree_descending(a: &Csr) -> Self {
        let n = a.n_rows();
        let offsets = a.row_offsets();
        let degree = |i: usize| (offsets[i + 1] - offsets[i]) as usize;
        let max = (0..n).map(degree).max().unwrap_or(0);
        // start[max - d] = first position of degree d: buckets in descending degree order.
        let mut start = vec![0u32; max + 2];
        for i in 0..n {
            start[max - degree(i) + 1] += 1;
        }
        for k in 0..=max {
            start[k + 1] += start[k];
        }
        let mut old_of_new = vec![0u32; n];
        for i in 0..n {
            let slot = &mut start[max - degree(i)];
            // n = a.n_rows() <= MAX_DIM: i fits u32.
            old_of_new[*slot as usize] = i as u32;
            *slot += 1;
        }
        let mut new_of_old = vec![0u32; n];
        for (new, &old) in old_of_new.iter().enumerate() {
            new_of_old[old as usize] = new as u32;
        }
        Self {
            new_of_old,
            old_of_new,
        }
    }

    /// Reverse Cuthill–McKee: a **locality** order. Nodes are numbered in breadth-first order
    /// from a low-degree peripheral node of each connected component (George–Liu's
    /// pseudo-peripheral search), each node's unnumbered neighbours taken by ascending degree,
    /// and the whole order is reversed. Neighbours end up at nearby positions (a small
    /// bandwidth), so a 16-row window of the reordered graph shares many of its columns: fewer
    /// distinct K/V rows per window for the blocked tensor-core formats.
    ///
    /// The neighbours of node `i` are the columns of row `i` (self loops ignored): for a
    /// symmetric pattern (the benchmark convention) this is the classic RCM; otherwise it
    /// follows out-edges only. Components are started in order of their lowest-degree node
    /// (ties by id), so the result is deterministic. O(nnz · log(max degree)) time, O(n) extra
    /// memory besides the result.
    ///
    /// # Errors
    /// [`Error::NotSquare`] for a rectangular matrix.
    ///
    /// ```
    /// use spattn_formats::{Csr, Permutation};
    /// // A path 0 - 2 - 4 - 1 - 3 numbered badly: RCM makes it a band again.
    /// let a = Csr::from_edges(5, 5, &[(0, 2), (2, 4), (4, 1), (1, 3)])?.symmetrize()?;
    /// let p = Permutation::reverse_cuthill_mckee(&a)?;
    /// assert_eq!(Permutation::bandwidth(&a, None)?, 3);
    /// assert_eq!(Permutation::bandwidth(&a, Some(&p))?, 1);
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn reverse_cuthill_mckee(a: &Csr) -> Result<Self> {
        locality_order(a, None)
    }

    /// [`Permutation::reverse_cuthill_mckee`] after peeling the hubs: nodes whose degree exceeds
    /// `hub_factor` times the mean degree are put first (longest first, ties by id) and left
    /// out of the breadth-first search, which then runs over the rest. A hub is adjacent to
    /// much of the graph; in a plain RCM it pulls its whole neighbourhood into one level and
    /// spreads the levels wide. `hub_factor` of `f64::INFINITY` (or any value no degree
    /// exceeds) is plain RCM.
    ///
    /// # Errors
    /// [`Error::NotSquare`] for a rectangular matrix, [`Error::InvalidParameter`] for a
    /// `hub_factor` that is NaN or not positive.
    pub fn reverse_cuthill_mckee_peeling_hubs(a: &Csr, hub_factor: f64) -> Result<Self> {
        if hub_factor.is_nan() || hub_factor <= 0.0 {
            return Err(Error::InvalidParameter {
                what: "hub_factor",
                why: format!("{hub_factor} must be a positive number"),
            });
        }
        locality_order(a, Some(hub_factor))
    }

    /// A locality order of the rows of a matrix of any shape: [`reverse_cuthill_mckee_peeling_hubs`]
    /// of the bipartite graph whose nodes are `a`'s rows and columns (row `i` adjacent to column
    /// `j` where `a` has entry `(i, j)`), its rows kept in the order it numbers them. Two rows
    /// sharing a column are two steps apart there, so rows that gather the same K/V rows land
    /// near each other — what a square graph's order gives through its own edges. For the
    /// rectangular local graph of a rank of a partitioned plan (its rows × the K/V rows they
    /// touch).
    ///
    /// ```
    /// use spattn_formats::{Csr, Permutation};
    /// // Rows 0 and 2 share column 5, rows 1 and 3 column 0.
    /// let a = Csr::from_edges(4, 6, &[(0, 5), (1, 0), (2, 5), (3, 0)])?;
    /// let p = Permutation::rows_by_bipartite_locality(&a, f64::INFINITY)?;
    /// let o = p.old_of_new();
    /// let pos = |r: u32| o.iter().position(|&x| x == r).unwrap();
    /// assert_eq!(pos(0).abs_diff(pos(2)), 1);
    /// assert_eq!(pos(1).abs_diff(pos(3)), 1);
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::TooManyEntries`] where the bipartite graph's `2 · nnz` entries pass
    /// [`crate::csr::MAX_NNZ`], [`Error::DimensionTooLarge`] where its rows plus columns pass
    /// [`MAX_DIM`], [`Error::InvalidParameter`] for a `hub_factor` that is NaN or not positive.
    ///
    /// [`reverse_cuthill_mckee_peeling_hubs`]: Self::reverse_cuthill_mckee_peeling_hubs
    pub fn rows_by_bipartite_locality(a: &Csr, hub_factor: f64) -> Result<Self> {
        check_bipartite(a)?;
        let (rows, cols, nnz) = (a.n_rows(), a.n_cols(), a.nnz());
        let t = a.transpose();
        // Rows first (their columns shifted past the rows), then the columns (Aᵀ's rows).
        let mut offsets = try_with_capacity(rows + cols + 1, "bipartite row offsets")?;
        offsets.extend_from_slice(a.row_offsets());
        // entries ≤ MAX_NNZ: every offset fits u32.
        offsets.extend(t.row_offsets()[1..].iter().map(|&o| o + nnz as u32));
        let mut targets = try_with_capacity(2 * nnz, "bipartite adjacency")?;
        targets.extend(a.col_indices().iter().map(|&c| c + rows as u32));
        targets.extend_from_slice(t.col_indices());
        let b = Csr::try_new(rows + cols, rows + cols, offsets, targets, None)?;
        let both = Self::reverse_cuthill_mckee_peeling_hubs(&b, hub_factor)?;
        let mut order = try_with_capacity(rows, "row order")?;
        order.extend(
            both.old_of_new
                .iter()
                .copied()
                .filter(|&v| (v as usize) < rows),
        );
        Self::from_old_of_new(order)
    }

    /// The bandwidth of the square matrix `a` after renaming its nodes by `p` (the identity
    /// when `None`): the largest `|new(i) - new(j)|` over its entries `(i, j)`; 0 when it has
    /// none off the diagonal.
    ///
    /// # Errors
    /// [`Error::NotSquare`] for a rectangular matrix, [`Error::LengthMismatch`] if `p` does not
    /// have one entry per row.
    pub fn bandwidth(a: &Csr, p: Option<&Permutation>) -> Result<usize> {
        check_square(a, "bandwidth")?;
        if let Some(p) = p {
            if p.len() != a.n_rows() {
                return Err(Error::LengthMismatch {
                    what: "permutation (matrix rows)",
                    expected: a.n_rows(),
                    actual: p.len(),
                });
            }
        }
        let new = |i: usize| p.map_or(i, |p| p.new_of_old[i] as usize);
        Ok((0..a.n_rows())
            .into_par_iter()
            .with_min_len(1024)
            .map(|i| {
                let ni = new(i);
                a.row(i)
                    .iter()
                    .map(|&c| ni.abs_diff(new(c as usize)))
                    .max()
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0))
    }

    /// Moves the rows of `a` only: row `new` of the result is row `old_of_new[new]` of `a`;
    /// column ids (and values) are kept, so `a` may be rectangular. This is how the fused
    /// kernels use a reordering without copying features: rows (Q, out) are renumbered through
    /// the permutation, columns (K, V) keep the caller's ids.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] if `a` does not have [`Permutation::len`] rows.
    ///
    /// ```
    /// use spattn_formats::{Csr, Permutation};
    /// let a = Csr::from_edges(2, 3, &[(0, 2), (1, 0), (1, 1)])?;
    /// let p = Permutation::try_new(vec![1, 0])?;
    /// let b = p.permute_csr_rows(&a)?;
    /// assert_eq!((b.row(0), b.row(1)), (&[0, 1][..], &[2][..]));
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn permute_csr_rows(&self, a: &Csr) -> Result<Csr> {
        let n = self.len();
        if a.n_rows() != n {
            return Err(Error::LengthMismatch {
                what: "matrix rows (permutation length)",
                expected: n,
                actual: a.n_rows(),
            });
        }
        let mut offsets = Vec::with_capacity(n + 1);
        offsets.push(0u32);
        let mut total = 0u32;
        for &old in &self.old_of_new {
            // The degrees of a's rows sum to a.nnz() <= MAX_NNZ: no overflow.
            total += a.degree(old as usize) as u32;
            offsets.push(total);
        }
        let mut cols = vec![0u32; a.nnz()];
        split_rows_mut(&offsets, &mut cols)
            .into_par_iter()
            .zip(self.old_of_new.par_iter())
            .for_each(|(out, &old)| out.copy_from_slice(a.row(old as usize)));
        let vals = a.values().map(|src| {
            let mut v = vec![0f32; a.nnz()];
            split_rows_mut(&offsets, &mut v)
                .into_par_iter()
                .zip(self.old_of_new.par_iter())
                .for_each(|(out, &old)| out.copy_from_slice(&src[a.row_range(old as usize)]));
            v
        });
        // Invariants: offsets are a prefix sum of row lengths ending at nnz; each row is a row
        // of the valid matrix `a`, copied whole (sorted, distinct, in range).
        Ok(Csr::from_parts_unchecked(
            n,
            a.n_cols(),
            offsets,
            cols,
            vals,
        ))
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.new_of_old.len()
    }
    /// Whether it permutes no nodes.
    pub fn is_empty(&self) -> bool {
        self.new_of_old.is_empty()
    }
    /// `new_of_old()[old]` is the new label of node `old`.
    pub fn new_of_old(&self) -> &[u32] {
        &self.new_of_old
    }
    /// `old_of_new()[new]` is the old label of the node now at position `new`.
    pub fn old_of_new(&self) -> &[u32] {
        &self.old_of_new
    }
    /// Whether every node keeps its label.
    pub fn is_identity(&self) -> bool {
        self.new_of_old
            .iter()
            .enumerate()
            .all(|(i, &v)| v as usize == i)
    }

    /// The inverse permutation (renames new labels back to old ones).
    pub fn inverse(&self) -> Permutation {
        Self {
            new_of_old: self.old_of_new.clone(),
            old_of_new: self.new_of_old.clone(),
        }
    }

    /// `self` followed by `then`: node `old` is renamed `then.new_of_old[self.new_of_old[old]]`.
    /// So `p.compose(&q)?.permute_rows(x, k)` equals `q.permute_rows(&p.permute_rows(x, k)?, k)`.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] if the two have different lengths.
    ///
    /// ```
    /// use spattn_formats::Permutation;
    /// let p = Permutation::try_new(vec![1, 2, 0])?;
    /// let q = Permutation::try_new(vec![0, 2, 1])?;
    /// assert_eq!(p.compose(&q)?.new_of_old(), &[2, 1, 0]);
    /// assert!(p.compose(&p.inverse())?.is_identity());
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn compose(&self, then: &Permutation) -> Result<Permutation> {
        if then.len() != self.len() {
            return Err(Error::LengthMismatch {
                what: "permutation to compose",
                expected: self.len(),
                actual: then.len(),
            });
        }
        let new_of_old: Vec<u32> = self
            .new_of_old
            .iter()
            .map(|&mid| then.new_of_old[mid as usize])
            .collect();
        let old_of_new: Vec<u32> = then
            .old_of_new
            .iter()
            .map(|&mid| self.old_of_new[mid as usize])
            .collect();
        Ok(Self {
            new_of_old,
            old_of_new,
        })
    }

    /// Renames the rows and columns of a square matrix: entry `(i, j)` moves to
    /// `(new_of_old[i], new_of_old[j])`, values carried along; rows of the result are sorted.
    ///
    /// # Errors
    /// [`Error::NotSquare`] for a rectangular matrix, [`Error::LengthMismatch`] if the matrix
    /// does not have [`Permutation::len`] rows.
    pub fn permute_csr(&self, a: &Csr) -> Result<Csr> {
        renumber(a, &self.old_of_new, &self.new_of_old, "permute_csr")
    }

    /// The inverse of [`Permutation::permute_csr`]: entry `(i, j)` moves to
    /// `(old_of_new[i], old_of_new[j])`.
    ///
    /// # Errors
    /// As [`Permutation::permute_csr`].
    pub fn unpermute_csr(&self, a: &Csr) -> Result<Csr> {
        renumber(a, &self.new_of_old, &self.old_of_new, "unpermute_csr")
    }

    /// Moves the rows of a dense row-major matrix (`len()` rows of `row_len` elements, such as
    /// node features): row `old` of `data` becomes row `new_of_old[old]` of the result.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless `data.len() == len() · row_len`.
    pub fn permute_rows<T: Copy + Send + Sync>(
        &self,
        data: &[T],
        row_len: usize,
    ) -> Result<Vec<T>> {
        gather_rows(data, row_len, &self.old_of_new, "rows to permute")
    }

    /// The inverse of [`Permutation::permute_rows`]: row `new` of `data` goes back to row
    /// `old_of_new[new]`.
    ///
    /// # Errors
    /// [`Error::LengthMismatch`] unless `data.len() == len() · row_len`.
    pub fn unpermute_rows<T: Copy + Send + Sync>(
        &self,
        data: &[T],
        row_len: usize,
    ) -> Result<Vec<T>> {
        gather_rows(data, row_len, &self.new_of_old, "rows to unpermute")
    }
}

fn check_square(a: &Csr, op: &'static str) -> Result<()> {
    if a.n_rows() != a.n_cols() {
        return Err(Error::NotSquare {
            op,
            n_rows: a.n_rows(),
            n_cols: a.n_cols(),
        });
    }
    Ok(())
}

/// Frontiers below this many nodes are expanded on one thread (a level's fork and join cost
/// more than its few hundred edges).
const PAR_MIN_FRONTIER: usize = 2048;

/// Breadth-first search over the non-hub nodes not yet numbered, with reusable scratch. Each
/// level is expanded from the whole frontier at once; past `par_min_frontier` nodes on several
/// threads, with exactly the sequential search's result (see [`Bfs::expand`]).
struct Bfs<'a> {
    a: &'a Csr,
    /// Row lengths.
    degree: Vec<u32>,
    /// Hubs and nodes already numbered: never entered.
    done: Vec<AtomicBool>,
    /// Per node, its level in the current search ([`UNSET`] outside it).
    level: Vec<AtomicU32>,
    /// Per node, during a parallel expansion: the first frontier position that reached it
    /// ([`UNSET`] otherwise, and between expansions).
    claim: Vec<AtomicU32>,
    /// The nodes of the current search, in visiting order.
    queue: Vec<u32>,
    /// Frontiers of at least this many nodes are expanded in parallel.
    par_min_frontier: usize,
}

impl Bfs<'_> {
    /// Whether `c`, a neighbour of `v`, is new to the current search (not `v`, not numbered, no
    /// level yet). The numbering's levels change only between the phases of an expansion; the
    /// probes' by an atomic swap, which decides.
    fn is_new(&self, v: u32, c: u32) -> bool {
        c != v
            && !self.done[c as usize].load(Relaxed)
            && self.level[c as usize].load(Relaxed) == UNSET
    }

    /// Searches from `root`, leaving the visit order in `queue` and the levels in `level`;
    /// returns the start of the last level in `queue`. With `sorted`, each node's neighbours
    /// are queued by ascending degree, ties by id (the numbering); without, in row order (the
    /// pseudo-peripheral probes, which read only the levels: a node's level, and so the last
    /// level's set and the depth, do not depend on the order).
    fn run(&mut self, root: u32, sorted: bool) -> usize {
        self.queue.clear();
        self.queue.push(root);
        self.level[root as usize].store(0, Relaxed);
        let (mut start, mut lv) = (0, 0u32);
        loop {
            let end = self.queue.len();
            let next = self.expand(start..end, lv + 1, sorted);
            if next.is_empty() {
                return start;
            }
            self.queue.extend_from_slice(&next);
            (start, lv) = (end, lv + 1);
        }
    }

    /// The next level of the frontier `queue[frontier]`, in the order the sequential search
    /// queues it: each frontier node in turn appends its new neighbours (sorted by (degree, id)
    /// when `sorted`) that no earlier frontier node took. In parallel, each new node is first
    /// claimed by the lowest frontier position reaching it (an atomic minimum), then every
    /// frontier node collects the neighbours it claimed, and the lists are joined in frontier
    /// order: the same sequence. Sets the returned nodes' level to `lv`.
    fn expand(&self, frontier: std::ops::Range<usize>, lv: u32, sorted: bool) -> Vec<u32> {
        let nodes = &self.queue[frontier];
        let sort = |kids: &mut [u32]| {
            if sorted {
                let degree = &self.degree;
                kids.sort_unstable_by_key(|&c| (degree[c as usize], c));
            }
        };
        if nodes.len() < self.par_min_frontier {
            let mut next = Vec::new();
            for &v in nodes {
                let from = next.len();
                for &c in self.a.row(v as usize) {
                    if self.is_new(v, c) {
                        self.level[c as usize].store(lv, Relaxed);
                        next.push(c);
                    }
                }
                sort(&mut next[from..]);
            }
            return next;
        }
        if !sorted {
            // The probes read only the levels, so the next level's order is free: each new node
            // goes to the thread whose level swap takes it, in one pass.
            let parts: Vec<Vec<u32>> = nodes
                .par_iter()
                .fold(Vec::new, |mut kids, &v| {
                    for &c in self.a.row(v as usize) {
                        if self.is_new(v, c)
                            && self.level[c as usize]
                                .compare_exchange(UNSET, lv, Relaxed, Relaxed)
                                .is_ok()
                        {
                            kids.push(c);
                        }
                    }
                    kids
                })
                .collect();
            return parts.concat();
        }
        nodes.par_iter().enumerate().for_each(|(i, &v)| {
            // i < frontier length <= n <= MAX_DIM: fits u32.
            let i = i as u32;
            for &c in self.a.row(v as usize) {
                // Most new nodes are reached many times: a load first skips the atomic
                // read-modify-write where an earlier position already holds them.
                if self.is_new(v, c) && self.claim[c as usize].load(Relaxed) > i {
                    self.claim[c as usize].fetch_min(i, Relaxed);
                }
            }
        });
        // Chunks of frontier positions, a few per thread, each collecting its nodes' claims.
        let chunk = (nodes.len() / (8 * rayon::current_num_threads())).max(256);
        let parts: Vec<Vec<u32>> = nodes
            .par_chunks(chunk)
            .enumerate()
            .map(|(ci, part)| {
                let mut kids = Vec::new();
                for (j, &v) in part.iter().enumerate() {
                    let i = (ci * chunk + j) as u32;
                    let from = kids.len();
                    kids.extend(
                        self.a
                            .row(v as usize)
                            .iter()
                            .filter(|&&c| c != v && self.claim[c as usize].load(Relaxed) == i),
                    );
                    sort(&mut kids[from..]);
                }
                kids
            })
            .collect();
        let next = parts.concat();
        next.par_iter().for_each(|&c| {
            self.level[c as usize].store(lv, Relaxed);
            self.claim[c as usize].store(UNSET, Relaxed);
        });
        next
    }

    /// Calls `f` on every node of the last search, in parallel.
    fn each_queued(&self, f: impl Fn(usize) + Sync + Send) {
        self.queue
            .par_iter()
            .with_min_len(4096)
            .for_each(|&v| f(v as usize));
    }

    /// Forgets the levels of the last search.
    fn clear(&mut self) {
        self.each_queued(|v| self.level[v].store(UNSET, Relaxed));
    }

    /// Marks the last search's nodes numbered.
    fn mark_done(&mut self) {
        self.each_queued(|v| self.done[v].store(true, Relaxed));
    }

    /// The level of the last node queued (the search's depth).
    fn depth(&self) -> u32 {
        // The queue holds at least the root after a search.
        self.level[self.queue[self.queue.len() - 1] as usize].load(Relaxed)
    }
}

/// Most root changes of the pseudo-peripheral search (each costs one search of the component;
/// George–Liu usually settles in 2–3).
const PERIPHERAL_ROUNDS: usize = 4;

/// Reverse Cuthill–McKee, hubs (degree > `hub_factor` × mean) first when asked.
fn locality_order(a: &Csr, hub_factor: Option<f64>) -> Result<Permutation> {
    // On one thread the parallel expansion's extra pass is pure cost.
    let par_min_frontier = if rayon::current_num_threads() > 1 {
        PAR_MIN_FRONTIER
    } else {
        usize::MAX
    };
    locality_order_with(a, hub_factor, par_min_frontier)
}

/// [`locality_order`] expanding frontiers of at least `par_min_frontier` nodes in parallel (the
/// result does not depend on it).
fn locality_order_with(
    a: &Csr,
    hub_factor: Option<f64>,
    par_min_frontier: usize,
) -> Result<Permutation> {
    check_square(a, "reverse_cuthill_mckee")?;
    let n = a.n_rows();
    let mut degree = try_with_capacity(n, "node degrees")?;
    (0..n)
        .into_par_iter()
        .map(|i| a.degree(i) as u32)
        .collect_into_vec(&mut degree);
    let mean = if n == 0 {
        0.0
    } else {
        a.nnz() as f64 / n as f64
    };
    let is_hub = |d: u32| hub_factor.is_some_and(|f| d as f64 > f * mean);
    let mut hubs: Vec<u32> = (0..n as u32)
        .into_par_iter()
        .filter(|&i| is_hub(degree[i as usize]))
        .collect();
    hubs.sort_unstable_by_key(|&i| (std::cmp::Reverse(degree[i as usize]), i));
    let atomics = |what, value| -> Result<Vec<AtomicU32>> {
        let mut v = try_with_capacity(n, what)?;
        v.extend((0..n).map(|_| AtomicU32::new(value)));
        Ok(v)
    };
    let mut done = try_with_capacity(n, "numbered flags")?;
    done.extend((0..n).map(|_| AtomicBool::new(false)));
    for &h in &hubs {
        done[h as usize] = AtomicBool::new(true);
    }
    // Start candidates: every node by (degree, id).
    let mut starts: Vec<u32> = try_with_capacity(n, "search starts")?;
    starts.extend(0..n as u32);
    starts.par_sort_unstable_by_key(|&i| (degree[i as usize], i));
    let mut bfs = Bfs {
        a,
        degree,
        done,
        level: atomics("search levels", UNSET)?,
        // Only the parallel expansion claims.
        claim: if par_min_frontier == usize::MAX {
            Vec::new()
        } else {
            atomics("search claims", UNSET)?
        },
        queue: Vec::new(),
        par_min_frontier,
    };
    let mut order: Vec<u32> = try_with_capacity(n, "node order")?;
    for &s in &starts {
        // In a directed graph the kept root's search may not reach `s` (nothing need point
        // back to it): search again until `s` itself is numbered. Each pass numbers at least
        // its root, and once nothing unnumbered is reachable from `s`, `s` is its own root.
        while !bfs.done[s as usize].load(Relaxed) {
            // George–Liu: move the root to a lowest-degree node of the last level while that
            // deepens the search.
            let mut root = s;
            let mut last = bfs.run(root, false);
            let mut depth = bfs.depth();
            for _ in 0..PERIPHERAL_ROUNDS {
                let degree = &bfs.degree;
                let candidate = bfs.queue[last..]
                    .iter()
                    .copied()
                    .min_by_key(|&c| (degree[c as usize], c))
                    .unwrap_or(root);
                bfs.clear();
                let last_c = bfs.run(candidate, false);
                let depth_c = bfs.depth();
                if depth_c > depth {
                    root = candidate;
                    last = last_c;
                    depth = depth_c;
                } else {
                    break;
                }
            }
            // The numbering: the search from the root kept, neighbours sorted.
            bfs.clear();
            bfs.run(root, true);
            bfs.mark_done();
            order.extend_from_slice(&bfs.queue);
            bfs.clear();
        }
    }
    order.reverse();
    let mut old_of_new = hubs;
    old_of_new.extend_from_slice(&order);
    // Each node is numbered exactly once: hubs up front, every other node by the one search
    // that first reached it (marked done right after).
    debug_assert_eq!(old_of_new.len(), n);
    let mut new_of_old = try_filled(n, 0u32, "permutation")?;
    for (new, &old) in old_of_new.iter().enumerate() {
        // new < n <= MAX_DIM: fits u32.
        new_of_old[old as usize] = new as u32;
    }
    Ok(Permutation {
        new_of_old,
        old_of_new,
    })
}

fn check_len(n: usize) -> Result<()> {
    if n as u64 > MAX_DIM {
        return Err(Error::DimensionTooLarge {
            what: "permutation length",
            value: n as u64,
            limit: MAX_DIM,
        });
    }
    Ok(())
}

/// The inverse of a candidate permutation, or the first index that makes it invalid.
fn invert(forward: &[u32]) -> Result<Vec<u32>> {
    let n = forward.len();
    check_len(n)?;
    let mut inverse = vec![UNSET; n];
    for (i, &v) in forward.iter().enumerate() {
        let slot = inverse
            .get_mut(v as usize)
            .ok_or_else(|| Error::InvalidPermutation {
                n,
                why: format!("value {v} at index {i} is out of range"),
            })?;
        if *slot != UNSET {
            return Err(Error::InvalidPermutation {
                n,
                why: format!("value {v} at index {i} repeats index {}", *slot),
            });
        }
        // i < n <= MAX_DIM: fits u32.
        *slot = i as u32;
    }
    Ok(inverse)
}

/// Builds the matrix whose row `r` is row `src_of_dst[r]` of `a`, every column `c` renamed
/// `dst_of_src[c]`, each row sorted.
fn renumber(a: &Csr, src_of_dst: &[u32], dst_of_src: &[u32], op: &'static str) -> Result<Csr> {
    let n = src_of_dst.len();
    if a.n_rows() != a.n_cols() {
        return Err(Error::NotSquare {
            op,
            n_rows: a.n_rows(),
            n_cols: a.n_cols(),
        });
    }
    if a.n_rows() != n {
        return Err(Error::LengthMismatch {
            what: "matrix rows (permutation length)",
            expected: n,
            actual: a.n_rows(),
        });
    }
    let mut offsets = Vec::with_capacity(n + 1);
    offsets.push(0u32);
    let mut total = 0u32;
    for &old in src_of_dst {
        // The degrees of a's rows sum to a.nnz() <= MAX_NNZ: no overflow.
        total += a.degree(old as usize) as u32;
        offsets.push(total);
    }
    let mut cols = vec![0u32; a.nnz()];
    let mut vals = a.values().map(|_| vec![0f32; a.nnz()]);
    let col_rows = split_rows_mut(&offsets, &mut cols);
    match (vals.as_mut(), a.values()) {
        (Some(vals), Some(src_vals)) => {
            let val_rows = split_rows_mut(&offsets, vals);
            col_rows
                .into_par_iter()
                .zip(val_rows)
                .zip(src_of_dst.par_iter())
                .for_each_init(Vec::new, |pairs, ((out_c, out_v), &old)| {
                    let range = a.row_range(old as usize);
                    pairs.clear();
                    pairs.extend(
                        a.col_indices()[range.clone()]
                            .iter()
                            .zip(&src_vals[range])
                            .map(|(&c, &v)| (dst_of_src[c as usize], v)),
                    );
                    pairs.sort_unstable_by_key(|p| p.0);
                    for ((c, v), &(pc, pv)) in out_c.iter_mut().zip(out_v.iter_mut()).zip(&*pairs) {
                        *c = pc;
                        *v = pv;
                    }
                });
        }
        _ => {
            col_rows
                .into_par_iter()
                .zip(src_of_dst.par_iter())
                .for_each(|(out, &old)| {
                    for (o, &c) in out.iter_mut().zip(a.row(old as usize)) {
                        *o = dst_of_src[c as usize];
                    }
                    out.sort_unstable();
                });
        }
    }
    // Invariants: offsets are a prefix sum of the row lengths ending at nnz; each row holds the
    // images of distinct in-range columns under a bijection, sorted: distinct, in range.
    Ok(Csr::from_parts_unchecked(n, n, offsets, cols, vals))
}

/// Splits `data` into one mutable slice per row, following `offsets`.
fn split_rows_mut<'a, T>(offsets: &[u32], mut data: &'a mut [T]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(offsets.len().saturating_sub(1));
    for w in offsets.windows(2) {
        let (head, tail) = std::mem::take(&mut data).split_at_mut((w[1] - w[0]) as usize);
        out.push(head);
        data = tail;
    }
    out
}

/// Row `r` of the result is row `src_of_dst[r]` of `data`.
fn gather_rows<T: Copy + Send + Sync>(
    data: &[T],
    row_len: usize,
    src_of_dst: &[u32],
    what: &'static str,
) -> Result<Vec<T>> {
    let n = src_of_dst.len();
    let expected = n
        .checked_mul(row_len)
        .ok_or_else(|| Error::InvalidParameter {
            what: "row_len",
            why: format!("{n} rows of {row_len} elements overflow usize"),
        })?;
    if data.len() != expected {
        return Err(Error::LengthMismatch {
            what,
            expected,
            actual: data.len(),
        });
    }
    if row_len == 0 {
        return Ok(Vec::new());
    }
    // Start from a copy (T has no default value to fill with), then overwrite every row.
    let mut out = data.to_vec();
    out.par_chunks_mut(row_len)
        .zip(src_of_dst.par_iter())
        .with_min_len(64)
        .for_each(|(dst, &src)| {
            let s = src as usize * row_len;
            dst.copy_from_slice(&data[s..s + row_len]);
        });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{rmat, RmatConfig};

    /// Both expansions of the locality order on `a`, the parallel one on 4 threads for every
    /// frontier.
    fn both(a: &Csr, hub_factor: Option<f64>) -> (Permutation, Permutation) {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .build()
            .expect("a 4-thread pool");
        let par = pool
            .install(|| locality_order_with(a, hub_factor, 0))
            .expect("the parallel order");
        let seq = locality_order_with(a, hub_factor, usize::MAX).expect("the sequential order");
        (par, seq)
    }

    proptest! {
        #[test]
        fn the_parallel_expansion_is_the_sequential_search(
            n in 1usize..200,
            edges in proptest::collection::vec((0u32..200, 0u32..200), 0..1200),
            symmetric in any::<bool>(),
            hub_factor in proptest::option::of(0.5f64..8.0),
        ) {
            let edges: Vec<(u32, u32)> = edges
                .into_iter()
                .filter(|&(r, c)| (r as usize) < n && (c as usize) < n)
                .collect();
            let mut a = Csr::from_edges(n, n, &edges).expect("a valid graph");
            if symmetric {
                a = a.symmetrize().expect("symmetrized");
            }
            let (par, seq) = both(&a, hub_factor);
            prop_assert_eq!(par, seq);
        }
    }

    proptest! {
        #[test]
        fn the_bipartite_order_is_a_permutation_of_the_rows(
            rows in 0usize..120,
            cols in 0usize..120,
            edges in proptest::collection::vec((0u32..120, 0u32..120), 0..600),
            hub_factor in 0.5f64..8.0,
        ) {
            // Any shape, empty rows and columns, hubs on either side.
            let edges: Vec<(u32, u32)> = edges
                .into_iter()
                .filter(|&(r, c)| (r as usize) < rows && (c as usize) < cols)
                .collect();
            let a = Csr::from_edges(rows, cols, &edges).expect("a valid graph");
            let p = Permutation::rows_by_bipartite_locality(&a, hub_factor)
                .expect("an order");
            prop_assert_eq!(p.len(), rows);
            let mut seen = p.old_of_new().to_vec();
            seen.sort_unstable();
            prop_assert!(seen.iter().copied().eq(0..rows as u32));
        }
    }

    #[test]
    fn the_bipartite_order_rejects_a_bad_hub_factor() {
        let a = Csr::from_edges(2, 3, &[(0, 2), (1, 2)]).expect("a valid graph");
        for bad in [0.0, -1.0, f64::NAN] {
            let err = Permutation::rows_by_bipartite_locality(&a, bad).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidParameter {
                        what: "hub_factor",
                        ..
                    }
                ),
                "{err}"
            );
        }
    }

    #[test]
    fn the_parallel_expansion_is_the_sequential_search_on_r_mat() {
        // Frontiers of thousands of nodes: several chunks per level, on symmetric and directed
        // graphs, with and without hubs peeled.
        for symmetrize in [true, false] {
            let a = rmat(&RmatConfig::new(13).with_symmetrize(symmetrize).with_seed(7))
                .expect("an R-MAT graph");
            for hub_factor in [None, Some(32.0)] {
                let (par, seq) = both(&a, hub_factor);
                assert_eq!(par, seq, "symmetrize {symmetrize}, hubs {hub_factor:?}");
            }
        }
    }
}
