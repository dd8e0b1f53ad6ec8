//! The argument parsing and validation of [`GraphCore`](super::GraphCore)'s calls: int64 index
//! bytes (both ways), CSR offsets, the scale, algorithm and LeakyReLU slope, address lists, an
//! edge list's build errors as `ValueError`s, and the CSR transforms a constructor asks for.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use spattn::{Algorithm, Csr};

use crate::errors::{formats_to_py, to_py, value_error};

/// Parses `bytes` of native-endian int64 (numpy / torch `int64`) into u32 indices below
/// `limit` (inclusive when `inclusive`), naming `what` and the entry in errors.
pub(super) fn indices(
    what: &str,
    bytes: &[u8],
    limit: usize,
    inclusive: bool,
) -> PyResult<Vec<u32>> {
    if bytes.len() % 8 != 0 {
        return Err(value_error(
            what,
            format!("{} bytes are not a whole number of int64", bytes.len()),
        ));
    }
    let mut out = Vec::with_capacity(bytes.len() / 8);
    for (k, chunk) in bytes.chunks_exact(8).enumerate() {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(chunk);
        let v = i64::from_ne_bytes(raw);
        let ok = v >= 0
            && (v as u64) <= u64::from(u32::MAX)
            && if inclusive {
                (v as u64) <= limit as u64
            } else {
                (v as u64) < limit as u64
            };
        if !ok {
            let bound = if inclusive { "]" } else { ")" };
            return Err(value_error(
                what,
                format!("entry {k} is {v}, out of range [0, {limit}{bound}"),
            ));
        }
        out.push(v as u32);
    }
    Ok(out)
}

/// Checks CSR offsets: `n_rows + 1` of them, from 0, non-decreasing, ending at `nnz`.
pub(super) fn check_offsets(crow: &[u32], n_rows: usize, nnz: usize) -> PyResult<()> {
    if n_rows.checked_add(1) != Some(crow.len()) {
        return Err(value_error(
            "crow",
            format!("has {} offsets; {n_rows} rows need one more", crow.len()),
        ));
    }
    if crow[0] != 0 {
        return Err(value_error("crow", format!("starts at {}, not 0", crow[0])));
    }
    if let Some(i) = crow.windows(2).position(|w| w[0] > w[1]) {
        return Err(value_error(
            "crow",
            format!("decreases at row {i} ({} > {})", crow[i], crow[i + 1]),
        ));
    }
    if crow[n_rows] as usize != nnz {
        return Err(value_error(
            "crow",
            format!("ends at {}, but col has {nnz} entries", crow[n_rows]),
        ));
    }
    Ok(())
}

/// A scale argument as the plans take it (f32, finite).
pub(super) fn plan_scale(scale: Option<f64>) -> PyResult<Option<u32>> {
    match scale {
        None => Ok(None),
        Some(s) if (s as f32).is_finite() => Ok(Some((s as f32).to_bits())),
        Some(s) => Err(value_error("scale", format!("{s} is not a finite float32"))),
    }
}

/// Parses an algorithm name (`Algorithm`'s `FromStr`); an unknown name is a Python error.
pub(super) fn parse_algorithm(algorithm: &str) -> PyResult<Algorithm> {
    algorithm.parse().map_err(to_py)
}

/// `values` as native-endian int64 bytes (the inverse of [`indices`]).
pub(super) fn int64_bytes<'py>(py: Python<'py>, values: &[u32]) -> Bound<'py, PyBytes> {
    let bytes: Vec<u8> = values
        .iter()
        .flat_map(|&v| i64::from(v).to_ne_bytes())
        .collect();
    PyBytes::new(py, &bytes)
}

/// The LeakyReLU slope: finite as an f32 (the GPU kernels take an f32; the CPU path computes
/// in its own type from the f64).
pub(super) fn check_slope(negative_slope: f64) -> PyResult<f64> {
    if (negative_slope as f32).is_finite() {
        Ok(negative_slope)
    } else {
        Err(value_error(
            "negative_slope",
            format!("{negative_slope} is not a finite float32"),
        ))
    }
}

/// A build's error, with an id out of range named as `edge_index`'s (a `ValueError`).
pub(super) fn edge_error(e: spattn::Error) -> PyErr {
    match e {
        spattn::Error::Ops(o @ spattn::ops::Error::EdgeOutOfRange { .. }) => {
            value_error("edge_index", o)
        }
        other => to_py(other),
    }
}

/// Refuses `ptrs` (naming the argument) unless it holds exactly `expected` addresses.
pub(super) fn check_addresses(ptrs: &[u64], expected: usize) -> PyResult<()> {
    if ptrs.len() != expected {
        return Err(value_error(
            "ptrs",
            format!("{} addresses, expected {expected}", ptrs.len()),
        ));
    }
    Ok(())
}

/// The first `N` addresses of `p` (checked by [`check_addresses`] to hold at least `N`).
pub(super) fn first<const N: usize>(p: &[u64]) -> [u64; N] {
    std::array::from_fn(|i| p[i])
}

/// `csr` with every reverse edge added and/or the missing self loops.
pub(super) fn transform(csr: Csr, symmetrize: bool, self_loops: bool) -> PyResult<Csr> {
    let csr = if symmetrize {
        csr.symmetrize()
            .map_err(|e| formats_to_py("symmetrize", e))?
    } else {
        csr
    };
    if self_loops {
        csr.with_self_loops()
            .map_err(|e| formats_to_py("self_loops", e))
    } else {
        Ok(csr)
    }
}
