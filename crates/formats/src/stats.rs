//! Statistics that describe a graph's shape: degree distribution, and how well the blocked
//! tensor-core formats fill their blocks.

use crate::csr::Csr;

/// Degree statistics of a [`Csr`] (row lengths: in-degrees in attention terms).
#[derive(Clone, Debug, PartialEq)]
pub struct DegreeStats {
    /// Number of rows.
    pub n_rows: usize,
    /// Number of stored entries.
    pub nnz: usize,
    /// Shortest row.
    pub min: usize,
    /// Longest row.
    pub max: usize,
    /// Mean row length.
    pub mean: f64,
    /// Rows with no entries.
    pub empty_rows: usize,
    /// Histogram over power-of-two buckets: `histogram[0]` counts empty rows, `histogram[k]`
    /// for k ≥ 1 counts rows with length in `2^(k-1) ..= 2^k - 1`.
    pub histogram: Vec<usize>,
}

impl DegreeStats {
    /// The half-open length range `lo..hi` that bucket `k` of [`DegreeStats::histogram`] counts.
    pub fn bucket_range(k: usize) -> std::ops::Range<usize> {
        if k == 0 {
            0..1
        } else {
            (1usize << (k - 1))..(1usize << k)
        }
    }
}

impl Csr {
    /// Degree statistics: max row, empty rows, mean, histogram.
    ///
    /// ```
    /// use spattn_formats::Csr;
    /// let a = Csr::from_edges(4, 4, &[(0, 1), (0, 2), (0, 3), (2, 0)])?;
    /// let s = a.degree_stats();
    /// assert_eq!((s.max, s.empty_rows), (3, 2));
    /// assert_eq!(s.histogram, vec![2, 1, 1]); // two empty, one of length 1, one of 3 (in 2..=3)
    /// # Ok::<(), spattn_formats::Error>(())
    /// ```
    pub fn degree_stats(&self) -> DegreeStats {
        let n = self.n_rows();
        let mut histogram = vec![0usize; 1];
        let (mut min, mut max, mut empty) = (usize::MAX, 0usize, 0usize);
        for i in 0..n {
            let d = self.degree(i);
            min = min.min(d);
            max = max.max(d);
            let bucket = if d == 0 {
                0
            } else {
                (usize::BITS - d.leading_zeros()) as usize
            };
            if bucket >= histogram.len() {
                histogram.resize(bucket + 1, 0);
            }
            histogram[bucket] += 1;
            if d == 0 {
                empty += 1;
            }
        }
        DegreeStats {
            n_rows: n,
            nnz: self.nnz(),
            min: if n == 0 { 0 } else { min },
            max,
            mean: if n == 0 {
                0.0
            } else {
                self.nnz() as f64 / n as f64
            },
            empty_rows: empty,
            histogram,
        }
    }
}

/// How well a blocked tensor-core format fills its blocks.
///
/// `fill = edges / slots`: 1.0 means every slot of every block is a real edge; a low fill means
/// tensor cores would mostly multiply padding.
#[derive(Clone, Debug, PartialEq)]
pub struct FillStats {
    /// Number of row windows.
    pub windows: usize,
    /// Number of tensor-core blocks (partial blocks counted as whole).
    pub blocks: usize,
    /// Number of real edges.
    pub edges: usize,
    /// Slots the blocks span: `blocks × rows per window × columns per block`.
    pub slots: usize,
    /// Largest number of blocks in one window.
    pub max_blocks_per_window: usize,
}

impl FillStats {
    /// `edges / slots`, or 0 when there are no blocks.
    pub fn fill(&self) -> f64 {
        if self.slots == 0 {
            0.0
        } else {
            self.edges as f64 / self.slots as f64
        }
    }
}
