//! Permutation (STUB: being written).
/// A permutation.
#[derive(Clone, Debug)]
pub struct Permutation {}
