//! spattn-ops (skeleton).
