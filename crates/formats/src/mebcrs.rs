//! ME-BCRS (STUB: being written).
use crate::{Csr, FillStats, Result};
/// ME-BCRS.
#[derive(Clone, Debug)]
pub struct MeBcrs {}
impl MeBcrs {
    /// Builds.
    pub fn from_csr(_a: &Csr, _block_width: usize) -> Result<Self> {
        todo!()
    }
    /// Back.
    pub fn to_csr(&self) -> Result<Csr> {
        todo!()
    }
    /// Fill.
    pub fn fill_stats(&self) -> FillStats {
        todo!()
    }
}
