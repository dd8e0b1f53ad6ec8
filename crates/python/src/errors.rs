//! spattn's errors as Python exceptions: a bad argument is a `ValueError` (a wrong dtype a
//! `TypeError`), a configuration an algorithm cannot run a `NotImplementedError`, device memory
//! exhaustion a `MemoryError`, and driver failures `spattn.SpattnError` (a `RuntimeError`).
//! The message is the Rust error's, which names the operand.

use pyo3::create_exception;
use pyo3::exceptions::{
    PyMemoryError, PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::PyErr;

create_exception!(
    spattn,
    SpattnError,
    PyRuntimeError,
    "A CUDA driver or runtime failure inside spattn (no driver, no device, a failed launch)."
);

/// A spattn error as the Python exception of its kind.
pub(crate) fn to_py(e: spattn::Error) -> PyErr {
    use spattn::Error as E;
    let msg = e.to_string();
    match e {
        E::ShapeMismatch { .. } | E::LengthMismatch { .. } | E::InvalidConfig { .. } => {
            PyValueError::new_err(msg)
        }
        E::DTypeMismatch { .. } => PyTypeError::new_err(msg),
        E::Unsupported { .. } => PyNotImplementedError::new_err(msg),
        E::Format(_) => PyValueError::new_err(msg),
        E::Ops(o) => ops_to_py(o),
        _ => SpattnError::new_err(msg),
    }
}

/// A spattn-ops error as the Python exception of its kind.
pub(crate) fn ops_to_py(e: spattn::ops::Error) -> PyErr {
    use spattn::ops::Error as E;
    let msg = e.to_string();
    match e {
        E::OutOfMemory { .. } => PyMemoryError::new_err(msg),
        E::ShapeMismatch { .. }
        | E::LengthMismatch { .. }
        | E::InvalidArgument { .. }
        | E::ForeignGpu { .. }
        | E::TooLarge { .. }
        | E::DimsMismatch { .. }
        | E::Format(_) => PyValueError::new_err(msg),
        E::Unsupported { .. } | E::UnsupportedComputeCapability { .. } => {
            PyNotImplementedError::new_err(msg)
        }
        _ => SpattnError::new_err(msg),
    }
}

/// A formats error (building or reading a graph) as a `ValueError` naming `what` (or an
/// `OSError` for a file that cannot be read, a `MemoryError` for a graph too large).
pub(crate) fn formats_to_py(what: &str, e: spattn::formats::Error) -> PyErr {
    use spattn::formats::Error as E;
    let msg = format!("{what}: {e}");
    match e {
        E::Io { .. } | E::Read(_) => pyo3::exceptions::PyOSError::new_err(msg),
        E::OutOfMemory { .. } => PyMemoryError::new_err(msg),
        _ => PyValueError::new_err(msg),
    }
}

/// A `ValueError` naming the argument.
pub(crate) fn value_error(what: &str, why: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{what}: {why}"))
}
