//! Readers (STUB: being written).
use crate::{Csr, Result};
use std::path::Path;
/// Reads a MatrixMarket file.
pub fn read_matrix_market(_path: impl AsRef<Path>) -> Result<Csr> {
    todo!()
}
/// Reads an edge list.
pub fn read_edge_list(_path: impl AsRef<Path>) -> Result<Csr> {
    todo!()
}
