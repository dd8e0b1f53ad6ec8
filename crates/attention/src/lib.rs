//! spattn (skeleton).
