//! The element types of the CPU ops, and the compensated sum they accumulate with.

use std::fmt::{Debug, Display};
use std::ops::{Add, Div, Mul, Neg, Sub};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// A floating-point element type of the CPU ops: `f32` or `f64` (sealed: no other type can
/// implement it).
///
/// Each op computes in the type it is given: `f64` is the reference of every GPU test, `f32` the
/// fallback where there is no GPU. Half-precision host data is compared by upcasting it to `f64`
/// first ([`attention_f64_from`](super::attention_f64_from)).
pub trait Real:
    sealed::Sealed
    + Copy
    + Send
    + Sync
    + Default
    + Debug
    + Display
    + PartialEq
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + Into<f64>
    + 'static
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// −∞: the start of every running max, and the score of a masked slot.
    const NEG_INFINITY: Self;
    /// The type's name, for messages.
    const NAME: &'static str;
    /// eˣ.
    fn exp(self) -> Self;
    /// |x|.
    fn abs(self) -> Self;
    /// Neither infinite nor NaN.
    fn is_finite(self) -> bool;
    /// Converts from `f32` (exact for both types).
    fn from_f32(x: f32) -> Self;
    /// Converts from `f64`, rounding to nearest for `f32`.
    fn from_f64(x: f64) -> Self;
    /// Converts to `f64` (exact for both types).
    fn to_f64(self) -> f64;
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            const NAME: &'static str = stringify!($t);
            #[inline]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline]
            fn is_finite(self) -> bool {
                <$t>::is_finite(self)
            }
            #[inline]
            fn from_f32(x: f32) -> Self {
                x as $t
            }
            #[inline]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

/// One step of Kahan's compensated sum on a (sum, compensation) pair: `sum + comp` carries the
/// exact running total to about one ulp, whatever the number of terms.
///
/// Sums over a row's edges have no bounded length (hub rows hold 10^5 edges and more); a plain
/// f32 sum of 10^5 softmax terms is off by ~1e-5 relative, the whole f32 tolerance. The
/// compensated sum keeps the f32 ops within a few ulps of the f64 reference on any degree.
/// The pair lives in separate scalars (or arrays), so a loop over feature coordinates stays
/// vectorizable.
#[inline]
pub(super) fn kahan_add<F: Real>(sum: &mut F, comp: &mut F, x: F) {
    let y = x - *comp;
    let t = *sum + y;
    *comp = (t - *sum) - y;
    *sum = t;
}

/// ⟨x, y⟩ over equal-length slices, with eight independent partial sums (vectorizable, and a
/// rounding error that grows with `len / 8` rather than `len`).
#[inline]
pub(super) fn dot<F: Real>(x: &[F], y: &[F]) -> F {
    const LANES: usize = 8;
    let mut acc = [F::ZERO; LANES];
    let xc = x.chunks_exact(LANES);
    let yc = y.chunks_exact(LANES);
    let (xt, yt) = (xc.remainder(), yc.remainder());
    for (a, b) in xc.zip(yc) {
        for l in 0..LANES {
            acc[l] = acc[l] + a[l] * b[l];
        }
    }
    for (l, (&a, &b)) in xt.iter().zip(yt).enumerate() {
        acc[l] = acc[l] + a * b;
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
}
