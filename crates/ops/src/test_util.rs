//! Helpers of the unit tests that test-support cannot give: its `Gpu`, `DType` and generic
//! helpers belong to the copy of this crate it links, another crate to the compiler than the
//! one under test. Tests glob-import `spattn_test_support::*` and these by name, which
//! shadows the glob's.

use rand::Rng;
use rand_pcg::Pcg64;

use crate::{DType, Gpu};

/// The GPU of the GPU tests (device 0); they are `#[ignore]`d where there is none.
pub(crate) fn gpu() -> Gpu {
    Gpu::new(0).expect("an NVIDIA GPU (this test is ignored elsewhere)")
}

/// `len` values drawn uniformly from `(-amp, amp)`, rounded to `T`.
pub(crate) fn random_vec<T: DType>(rng: &mut Pcg64, len: usize, amp: f64) -> Vec<T> {
    (0..len)
        .map(|_| T::from_f64(rng.random_range(-amp..amp)))
        .collect()
}

/// `x` widened to f64.
pub(crate) fn to_f64<T: DType>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

/// The tolerance for an output of type `T` against the f64 reference (test-support's).
pub(crate) fn tolerance<T: DType>() -> f64 {
    spattn_test_support::tolerance_of(T::NAME)
}
