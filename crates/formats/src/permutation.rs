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

use rayon::prelude::*;

use crate::alloc::try_with_capacity;
use crate::csr::{Csr, MAX_DIM};
use crate::error::{Error, Result};
use crate::offsets::split_rows_mut;

mod locality;
use locality::locality_order;

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
mod tests;
