//! spattn-bench (skeleton).
fn main() {}
