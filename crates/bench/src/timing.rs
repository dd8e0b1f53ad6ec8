//! Summaries of timed runs: median, min, max; and the geometric mean of ratios.

/// The summary of a case's timed runs, milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timings {
    /// Median (the mean of the two middle runs for an even count).
    pub median_ms: f64,
    /// Fastest run.
    pub min_ms: f64,
    /// Slowest run.
    pub max_ms: f64,
    /// Number of runs.
    pub reps: usize,
}

impl Timings {
    /// Summarizes `times_ms`; `None` when it is empty or holds a non-finite time.
    pub fn of(times_ms: &[f64]) -> Option<Timings> {
        if times_ms.is_empty() || times_ms.iter().any(|t| !t.is_finite()) {
            return None;
        }
        let mut t = times_ms.to_vec();
        t.sort_by(f64::total_cmp);
        let n = t.len();
        let median_ms = if n % 2 == 1 {
            t[n / 2]
        } else {
            0.5 * (t[n / 2 - 1] + t[n / 2])
        };
        Some(Timings {
            median_ms,
            min_ms: t[0],
            max_ms: t[n - 1],
            reps: n,
        })
    }
}

/// The geometric mean of positive finite values (others are skipped); `None` when none is
/// left.
pub fn geo_mean(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (sum, count) = values
        .into_iter()
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((0.0, 0usize), |(s, c), v| (s + v.ln(), c + 1));
    (count > 0).then(|| (sum / count as f64).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians() {
        let t = Timings::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!(
            (t.median_ms, t.min_ms, t.max_ms, t.reps),
            (2.0, 1.0, 3.0, 3)
        );
        assert_eq!(Timings::of(&[4.0, 1.0, 2.0, 3.0]).unwrap().median_ms, 2.5);
        assert!(Timings::of(&[]).is_none());
        assert!(Timings::of(&[1.0, f64::NAN]).is_none());
    }

    #[test]
    fn geo_means() {
        assert!((geo_mean([2.0, 8.0]).unwrap() - 4.0).abs() < 1e-12);
        assert_eq!(geo_mean([f64::NAN, 0.0]), None);
        assert!((geo_mean([1.0, f64::INFINITY, 9.0]).unwrap() - 3.0).abs() < 1e-12);
    }
}
