//! What one case measured on one configuration, whatever the backend.

use crate::timing::Timings;

/// The outcome of one case on one configuration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Measured {
    /// The timed runs, `None` when the case failed before they finished.
    pub timings: Option<Timings>,
    /// The relative L2 error against the f64 reference; `None` when not checked.
    pub rel_error: Option<f64>,
    /// What the algorithm choice said, for cases that choose.
    pub choice: Option<String>,
    /// How long the case's plan took to build, for cases that plan.
    pub plan: Option<PlanBuild>,
    /// The error that stopped the case.
    pub error: Option<String>,
    /// Why the case did not run (not supported for this shape or dtype, on this GPU, or in
    /// this build); such a case has no record.
    pub skipped: Option<String>,
}

/// What building a case's plan cost.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PlanBuild {
    /// Wall time of `AttentionPlan::on_graph`, ms: formats built and uploaded on first use of
    /// the graph (later plans of the same graph reuse them), reordering, autotuning.
    pub ms: f64,
    /// Device bytes of the graph's uploads (CSR, transpose, blocked formats) once it was built.
    pub graph_device_bytes: u64,
    /// The process's resident memory at its peak during the build, above where it started,
    /// bytes (`None` where the system cannot tell: Linux's `/proc/self` VmHWM, reset first).
    pub host_peak_bytes: Option<u64>,
}

/// The configuration every case of a (graph, heads, head_dim, dtype) shares.
#[derive(Clone, Copy, Debug)]
pub struct RunSettings {
    /// Untimed runs first.
    pub warmup: u32,
    /// Timed runs.
    pub reps: u32,
    /// Whether to check against the f64 reference.
    pub check: bool,
    /// The row order attention plans are asked for (`--reorder`).
    pub reorder: spattn_formats::Reorder,
}
