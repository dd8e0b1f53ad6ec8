//! Node permutations, and RT-GNN's degree reordering.
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
