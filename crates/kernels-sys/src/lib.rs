//! spattn-kernels-sys (skeleton).
