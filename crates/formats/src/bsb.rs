//! BSB (STUB: being written).
use crate::{Csr, FillStats, Result};
/// BSB.
#[derive(Clone, Debug)]
pub struct Bsb {}
impl Bsb {
    /// Builds.
    pub fn from_csr(_a: &Csr) -> Result<Self> {
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
