//! How a graph's rows and K/V rows are split over ranks: contiguous [`Blocks`] of `0..n`, and
//! the [`Partition`] of a graph into row blocks balanced by edges.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::Csr;

/// Contiguous blocks of `0..n`: block `r` is `bounds[r]..bounds[r + 1]` (possibly empty).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocks {
    bounds: Vec<usize>,
}

impl Blocks {
    /// `n` items in `parts` blocks whose sizes differ by at most one.
    pub fn even(n: usize, parts: usize) -> Result<Self> {
        check_parts(parts)?;
        Ok(Self {
            bounds: (0..=parts).map(|r| r * n / parts).collect(),
        })
    }

    /// The blocks of the given boundaries: `bounds[0] == 0`, non-decreasing, `parts + 1` long.
    pub fn from_bounds(bounds: Vec<usize>) -> Result<Self> {
        if bounds.len() < 2 || bounds[0] != 0 {
            return Err(Error::InvalidConfig {
                what: "partition bounds",
                why: format!(
                    "expected 0 first and at least two entries, got {} entries starting at {:?}",
                    bounds.len(),
                    bounds.first()
                ),
            });
        }
        if let Some(i) = bounds.windows(2).position(|w| w[1] < w[0]) {
            return Err(Error::InvalidConfig {
                what: "partition bounds",
                why: format!(
                    "entry {} ({}) is below entry {i} ({})",
                    i + 1,
                    bounds[i + 1],
                    bounds[i]
                ),
            });
        }
        Ok(Self { bounds })
    }

    /// Number of blocks.
    pub fn parts(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Items covered (`0..len`).
    pub fn len(&self) -> usize {
        self.bounds[self.bounds.len() - 1]
    }

    /// Whether there are no items.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Block `r`.
    pub fn block(&self, r: usize) -> Result<Range<usize>> {
        if r >= self.parts() {
            return Err(Error::RankOutOfRange {
                rank: r,
                world: self.parts(),
            });
        }
        Ok(self.bounds[r]..self.bounds[r + 1])
    }

    /// The block holding item `i` (among empty blocks at the same boundary, the non-empty
    /// one); `None` for `i >= len`.
    pub fn owner(&self, i: usize) -> Option<usize> {
        (i < self.len()).then(|| self.bounds.partition_point(|&b| b <= i) - 1)
    }
}

/// How a graph's rows (Q, output, CSR rows) and K/V rows are split over ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// Row blocks, balanced by edges.
    pub rows: Blocks,
    /// K/V row blocks: the row blocks on a square graph (a node's Q and K/V live together),
    /// an even split of the columns otherwise.
    pub kv: Blocks,
}

impl Partition {
    /// `parts` blocks of rows with about `nnz / parts` edges each (row boundaries where the
    /// running edge count crosses each share; rows without edges count as one edge so that
    /// empty regions are spread too).
    ///
    /// Errors: [`Error::InvalidConfig`] for 0 parts.
    pub fn balanced(a: &Csr, parts: usize) -> Result<Self> {
        check_parts(parts)?;
        let n = a.n_rows();
        let offsets = a.row_offsets();
        // Weight of rows 0..i: edges plus one per empty row, a prefix sum.
        let mut prefix = Vec::with_capacity(n + 1);
        prefix.push(0u64);
        for i in 0..n {
            let len = u64::from(offsets[i + 1] - offsets[i]);
            prefix.push(prefix[i] + len.max(1));
        }
        let total = prefix[n];
        let mut bounds = Vec::with_capacity(parts + 1);
        bounds.push(0);
        for r in 1..parts {
            let share = total * r as u64 / parts as u64;
            let at = prefix.partition_point(|&w| w < share).min(n);
            bounds.push(at.max(bounds[r - 1]));
        }
        bounds.push(n);
        let rows = Blocks::from_bounds(bounds)?;
        let kv = if a.n_rows() == a.n_cols() {
            rows.clone()
        } else {
            Blocks::even(a.n_cols(), parts)?
        };
        Ok(Self { rows, kv })
    }

    /// Number of ranks.
    pub fn parts(&self) -> usize {
        self.rows.parts()
    }
}

pub(super) fn check_parts(parts: usize) -> Result<()> {
    if parts == 0 {
        return Err(Error::InvalidConfig {
            what: "partition",
            why: "0 parts: a partition needs at least one rank".into(),
        });
    }
    Ok(())
}
