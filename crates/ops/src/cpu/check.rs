//! Validation of the CPU ops' arguments: every length against the mask and the shapes, before
//! anything is read or written.

use spattn_formats::Csr;

use crate::error::{Error, Result};
use crate::shape::Shape;

/// `heads` is at least 1.
pub(super) fn heads(heads: usize) -> Result<()> {
    if heads == 0 {
        return Err(Error::InvalidArgument {
            what: "heads",
            why: "must be at least 1".into(),
        });
    }
    Ok(())
}

/// `shape` (of operand `what`) has heads and head_dim at least 1 and a length that fits usize;
/// returns that length. (`Shape`'s fields are public, so a shape built by hand is checked
/// again here.)
pub(super) fn shape(what: &'static str, shape: Shape) -> Result<usize> {
    heads(shape.heads)?;
    if shape.head_dim == 0 {
        return Err(Error::InvalidArgument {
            what: "head_dim",
            why: format!("{what} has head_dim 0; must be at least 1"),
        });
    }
    shape
        .rows
        .checked_mul(shape.heads)
        .and_then(|x| x.checked_mul(shape.head_dim))
        .ok_or_else(|| Error::InvalidArgument {
            what,
            why: format!("shape {shape} overflows usize"),
        })
}

/// `actual` (the shape given for operand `what`) equals `expected`.
pub(super) fn shape_eq(what: &'static str, expected: Shape, actual: Shape) -> Result<()> {
    if expected != actual {
        return Err(Error::ShapeMismatch {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// Buffer `what` holds exactly `expected` elements.
pub(super) fn len(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected != actual {
        return Err(Error::LengthMismatch {
            what,
            expected,
            actual,
        });
    }
    Ok(())
}

/// `rows × heads` (per-edge or per-node values), checked for overflow.
pub(super) fn per_head_len(what: &'static str, rows: usize, heads: usize) -> Result<usize> {
    rows.checked_mul(heads)
        .ok_or_else(|| Error::InvalidArgument {
            what,
            why: format!("{rows} x {heads} heads overflows usize"),
        })
}

/// Buffer `what` holds `rows × heads` elements (the product checked for overflow first).
pub(super) fn per_head(what: &'static str, rows: usize, heads: usize, actual: usize) -> Result<()> {
    len(what, per_head_len(what, rows, heads)?, actual)
}

/// The scalar `what` is finite.
pub(super) fn finite(what: &'static str, value: f64) -> Result<()> {
    if !value.is_finite() {
        return Err(Error::InvalidArgument {
            what,
            why: format!("must be finite, got {value}"),
        });
    }
    Ok(())
}

/// The dimensions of an SDDMM `S = scale · (Q Kᵀ) ∘ A`, checked.
#[derive(Clone, Copy, Debug)]
pub(super) struct SddmmDims {
    pub(super) heads: usize,
    pub(super) head_dim: usize,
}

/// Checks Q (`a.n_rows() × H × D`), K (`a.n_cols() × H × D`) and the per-edge output
/// (`nnz × H`).
pub(super) fn sddmm(
    a: &Csr,
    q_len: usize,
    k_len: usize,
    shape_q: Shape,
    shape_k: Shape,
    out_what: &'static str,
    out_len: Option<usize>,
) -> Result<SddmmDims> {
    shape("q", shape_q)?;
    let expected_q = Shape {
        rows: a.n_rows(),
        ..shape_q
    };
    shape_eq("q", expected_q, shape_q)?;
    let expected_k = Shape {
        rows: a.n_cols(),
        ..shape_q
    };
    shape_eq("k", expected_k, shape_k)?;
    len("q", shape("q", shape_q)?, q_len)?;
    len("k", shape("k", shape_k)?, k_len)?;
    if let Some(out_len) = out_len {
        len(
            out_what,
            per_head_len(out_what, a.nnz(), shape_q.heads)?,
            out_len,
        )?;
    }
    Ok(SddmmDims {
        heads: shape_q.heads,
        head_dim: shape_q.head_dim,
    })
}

/// Checks the per-edge weights (`nnz × H`, when given), V (`a.n_cols() × H × Dv`) and the
/// output (`a.n_rows() × H × Dv`, when given).
pub(super) fn spmm(
    a: &Csr,
    p_len: Option<usize>,
    v_len: usize,
    shape_v: Shape,
    out_len: Option<usize>,
) -> Result<()> {
    shape("v", shape_v)?;
    let expected_v = Shape {
        rows: a.n_cols(),
        ..shape_v
    };
    shape_eq("v", expected_v, shape_v)?;
    if let Some(p_len) = p_len {
        len("p", per_head_len("p", a.nnz(), shape_v.heads)?, p_len)?;
    }
    len("v", shape("v", shape_v)?, v_len)?;
    if let Some(out_len) = out_len {
        let out_shape = Shape {
            rows: a.n_rows(),
            ..shape_v
        };
        len("out", shape("out", out_shape)?, out_len)?;
    }
    Ok(())
}
