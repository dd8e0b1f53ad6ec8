//! The one timing tuner (cuDNN-benchmark style) of every plan that chooses by measurement:
//! `spattn`'s `AttentionPlan` with autotuning, the hybrid attention's and the hybrid SpMM's
//! threshold and warp split ([`crate::hybrid_spmm::HybridSpmm`]).
//!
//! [`median_ms`] times a candidate (the median of three launches after one warm-up, on the
//! GPU's stream; [`median_of_runs`] is its timed part, which the timing probes share);
//! [`Fastest`] keeps the fastest candidate, where a candidate must beat the best so far by a
//! margin when it is one the caller trusts less (a mixed hybrid split against the pure runs,
//! whose single-launch times move ±5% between calls on small graphs).
//!
//! ```
//! use spattn_ops::Fastest;
//! let mut f = Fastest::new();
//! assert!(f.offer("a", 'a', 2.0, 0.0));
//! assert!(!f.offer("b", 'b', 1.95, 0.05)); // faster, but not by 5%
//! assert!(f.offer("c", 'c', 1.0, 0.05));
//! assert_eq!(f.best(), Some((&'c', 1.0)));
//! assert_eq!(f.report(), "a 2.0000 ms, b 1.9500 ms, c 1.0000 ms");
//! ```

use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// Timed runs per candidate (after one warm-up); the median is kept.
pub(crate) const RUNS: usize = 3;

/// Median of three timed calls of `f` after one warm-up, in ms (CUDA events on `gpu`'s
/// stream around each call).
///
/// # Errors
/// Those of `f` and of the events.
pub fn median_ms(gpu: &Gpu, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    median_of_runs(gpu, RUNS, f)
}

/// Median of `runs` calls of `f`, each timed alone (CUDA events on `gpu`'s stream), in ms;
/// for an even `runs` the upper of the two middle times. No warm-up: callers warm up as they
/// need (the tuner once; the timing probes more, and they wait for the GPU first).
///
/// # Errors
/// Those of `f` and of the events, at the first that fails; [`Error::InvalidArgument`] when
/// `runs` is 0 (no median).
pub fn median_of_runs(gpu: &Gpu, runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut t = Vec::with_capacity(runs);
    for _ in 0..runs {
        t.push(f64::from(gpu.time_ms(&mut f)?));
    }
    t.sort_by(f64::total_cmp);
    t.get(runs / 2)
        .copied()
        .ok_or_else(|| Error::InvalidArgument {
            what: "runs",
            why: "a median needs at least one timed run".into(),
        })
}

/// The fastest of the candidates offered so far, and every candidate's time for the report.
#[derive(Debug)]
pub struct Fastest<C> {
    best: Option<(C, f64)>,
    timings: Vec<(String, f64)>,
}

impl<C> Default for Fastest<C> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C> Fastest<C> {
    /// No candidate yet.
    pub fn new() -> Self {
        Self {
            best: None,
            timings: Vec::new(),
        }
    }

    /// Records `label` at `ms`, and keeps `candidate` when it is the first, or faster than the
    /// best so far by the fraction `margin` (0: any faster). Returns whether it was kept.
    pub fn offer(&mut self, label: impl Into<String>, candidate: C, ms: f64, margin: f64) -> bool {
        self.timings.push((label.into(), ms));
        let kept = match &self.best {
            None => true,
            Some((_, best)) => ms < best * (1.0 - margin),
        };
        if kept {
            self.best = Some((candidate, ms));
        }
        kept
    }

    /// The fastest candidate and its time.
    pub fn best(&self) -> Option<(&C, f64)> {
        self.best.as_ref().map(|(c, ms)| (c, *ms))
    }

    /// The fastest candidate and its time, consuming the tuner.
    pub(crate) fn into_best(self) -> Option<(C, f64)> {
        self.best
    }

    /// Candidates timed so far.
    pub fn count(&self) -> usize {
        self.timings.len()
    }

    /// Every candidate's time, in the order offered: `label ms, label ms, …`.
    pub fn report(&self) -> String {
        self.timings
            .iter()
            .map(|(label, ms)| format!("{label} {ms:.4} ms"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}
