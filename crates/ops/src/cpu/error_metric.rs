//! Comparing an output with a reference: the relative L2 error of every spattn test.

use rayon::prelude::*;

/// Converts host data (f32, f64, `half::f16`, `half::bf16`, …) to f64, in parallel.
pub(crate) fn upcast_f64<T>(x: &[T]) -> Vec<f64>
where
    T: Copy + Into<f64> + Sync,
{
    x.par_iter()
        .with_min_len(1 << 14)
        .map(|&v| v.into())
        .collect()
}

/// The relative L2 error `‖out − reference‖₂ / ‖reference‖₂`, in f64, as the tolerances of
/// docs/kernels/README.md ("What every kernel guarantees") are stated: f32 ≤ 1e-5, tf32 ≤ 1e-3,
/// f16 ≤ 5e-3, bf16 ≤ 2e-2.
///
/// Made so that a broken output can never pass a `rel_l2_error(..) <= tol` check:
/// - **+∞** when any element of `out` or of `reference` is NaN or ±∞ (NaN never passes), when
///   the lengths differ, or when the difference overflows f64;
/// - **‖out‖₂ (absolute)** when `‖reference‖₂ = 0` (an all-zero reference, e.g. a graph with no
///   edges: the error is then how far `out` is from zero);
/// - 0 for two empty slices.
///
/// The norms are scaled by their largest element first, so values near f64's range (1e200)
/// neither overflow nor underflow. Never returns NaN.
///
/// ```
/// use spattn_ops::cpu::rel_l2_error;
/// assert_eq!(rel_l2_error(&[1.0f32, 2.0], &[1.0, 2.0]), 0.0);
/// assert!((rel_l2_error(&[3.0f64, 4.0], &[3.0, 4.5]) - 0.5 / 4.5f64.hypot(3.0)).abs() < 1e-15);
/// assert_eq!(rel_l2_error(&[f32::NAN], &[1.0]), f64::INFINITY);
/// assert_eq!(rel_l2_error(&[3.0f64, 4.0], &[0.0, 0.0]), 5.0); // absolute when ‖ref‖ = 0
/// ```
pub fn rel_l2_error<T>(out: &[T], reference: &[f64]) -> f64
where
    T: Copy + Into<f64> + Sync,
{
    if out.len() != reference.len() {
        return f64::INFINITY;
    }
    let non_finite = out
        .par_iter()
        .zip(reference.par_iter())
        .with_min_len(1 << 14)
        .any(|(&o, &r)| !o.into().is_finite() || !r.is_finite());
    if non_finite {
        return f64::INFINITY;
    }
    let diff = scaled_norm(out.len(), |i| out[i].into() - reference[i]);
    let ref_norm = scaled_norm(reference.len(), |i| reference[i]);
    let err = if ref_norm == 0.0 {
        diff
    } else {
        diff / ref_norm
    };
    if err.is_nan() {
        f64::INFINITY
    } else {
        err
    }
}

/// ‖x‖₂ of `len` elements given by `x(i)`, computed as `m · sqrt(Σ (xᵢ/m)²)` with `m = max |xᵢ|`
/// (no overflow or underflow of the squares); +∞ when an element is not finite.
fn scaled_norm(len: usize, x: impl Fn(usize) -> f64 + Sync) -> f64 {
    let m = (0..len)
        .into_par_iter()
        .with_min_len(1 << 14)
        .map(|i| x(i).abs())
        .reduce(|| 0.0, f64::max);
    if !m.is_finite() {
        return f64::INFINITY;
    }
    if m == 0.0 {
        return 0.0;
    }
    let sum: f64 = (0..len)
        .into_par_iter()
        .with_min_len(1 << 14)
        .map(|i| {
            let y = x(i) / m;
            y * y
        })
        .sum();
    m * sum.sqrt()
}
