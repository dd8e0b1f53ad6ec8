//! Shapes of the dense operands: `rows × heads × head_dim`, row-major.

use crate::error::{Error, Result};

/// The shape of a dense feature matrix: `rows × heads × head_dim`, row-major, so that node `i`'s
/// features for head `h` start at `(i * heads + h) * head_dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    /// Number of rows (nodes).
    pub rows: usize,
    /// Number of attention heads.
    pub heads: usize,
    /// Features per head.
    pub head_dim: usize,
}

impl Shape {
    /// A shape; `heads` and `head_dim` must be at least 1.
    pub fn new(rows: usize, heads: usize, head_dim: usize) -> Result<Self> {
        if heads == 0 {
            return Err(Error::InvalidArgument {
                what: "heads",
                why: "must be at least 1".into(),
            });
        }
        if head_dim == 0 {
            return Err(Error::InvalidArgument {
                what: "head_dim",
                why: "must be at least 1".into(),
            });
        }
        // heads × head_dim on its own too: with rows = 0 the full product cannot overflow,
        // but row_len() must not either.
        heads
            .checked_mul(head_dim)
            .and_then(|row| row.checked_mul(rows))
            .ok_or_else(|| Error::InvalidArgument {
                what: "shape",
                why: format!("{rows} x {heads} x {head_dim} overflows usize"),
            })?;
        Ok(Self {
            rows,
            heads,
            head_dim,
        })
    }
    /// Elements per row: `heads * head_dim`.
    pub fn row_len(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Total number of elements.
    pub fn len(&self) -> usize {
        self.rows * self.heads * self.head_dim
    }
    /// Whether the matrix has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Checks that `actual` equals `self`, naming `what` in the error.
    pub fn expect_eq(&self, what: &'static str, actual: Shape) -> Result<()> {
        if *self != actual {
            return Err(Error::ShapeMismatch {
                what,
                expected: *self,
                actual,
            });
        }
        Ok(())
    }
    /// Checks that `actual` is `rows × self.heads × self.head_dim` (an operand with the same
    /// heads and head_dim as `self` but `rows` rows), naming `what` in the error.
    pub(crate) fn expect_rows_like(
        &self,
        what: &'static str,
        actual: Shape,
        rows: usize,
    ) -> Result<()> {
        Shape::new(rows, self.heads, self.head_dim)?.expect_eq(what, actual)
    }
    /// Checks that a host slice holds exactly `self.len()` elements.
    pub(crate) fn expect_len(&self, what: &'static str, len: usize) -> Result<()> {
        if len != self.len() {
            return Err(Error::LengthMismatch {
                what,
                expected: self.len(),
                actual: len,
            });
        }
        Ok(())
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} x {} x {}", self.rows, self.heads, self.head_dim)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflowing_shapes_are_errors_not_panics() {
        // heads × head_dim = 2^64 with no rows: the product with rows is 0, row_len is not.
        let big = 1usize << 32;
        let e = Shape::new(0, big, big).unwrap_err();
        assert!(e.to_string().contains("overflows"), "{e}");
        assert!(Shape::new(big, big, 1).is_err());
        let s = Shape::new(0, 3, 5).unwrap();
        assert_eq!((s.row_len(), s.len(), s.is_empty()), (15, 0, true));
    }
}
