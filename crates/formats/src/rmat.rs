//! R-MAT (STUB: being written).
use crate::{Csr, Result};
/// R-MAT configuration.
#[derive(Clone, Debug)]
pub struct RmatConfig {}
/// Generates an R-MAT graph.
pub fn rmat(_c: &RmatConfig) -> Result<Csr> {
    todo!()
}
