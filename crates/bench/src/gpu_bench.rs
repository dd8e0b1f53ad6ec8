//! The GPU runner: device information, the copy bandwidth that sets the HBM floor, and each
//! case's launches timed with CUDA events.
//!
//! Per configuration (graph, heads, head_dim, dtype) the inputs are drawn once and uploaded
//! once; every case then gets a check run (outputs poisoned with NaN first, result compared
//! with the f64 CPU reference), `warmup` untimed runs and `reps` runs each between a pair of
//! CUDA events on the stream. The ops' own inputs come from the GPU: `softmax-csr` gets the
//! scores of the SDDMM kernel, `spmm-csr` their softmax; each op's reference is computed from
//! exactly the inputs it was given (downloaded), so it checks that op alone.

mod launch;

use spattn_formats::Csr;
use spattn_ops::cpu;
use std::sync::Arc;

use spattn_ops::{csr_ops, DType, DeviceCsr, DeviceMatrix, DeviceVec, Gpu, GpuTimer};
use spattn_ops::{DeviceGraph, EdgeLayout, EdgeValues};

use crate::cases::Case;
use crate::error::{Error, Result};
use crate::inputs::{to_f64, HostInputs};
use crate::measure::{Measured, PlanBuild, RunSettings};
use crate::record::DeviceRecord;
use crate::timing::Timings;

pub use launch::prepare;

/// Bytes of each buffer of the copy-bandwidth measurement (source and destination).
pub const COPY_BYTES: usize = 1 << 30;

/// Why the run is on the CPU, from the error of `Gpu::new`.
pub fn cpu_reason(e: &spattn_ops::Error) -> String {
    match e {
        spattn_ops::Error::NoCudaDriver => "no CUDA driver (libcuda not found)".to_string(),
        spattn_ops::Error::NoDevice { ordinal, count } => {
            format!("no CUDA device {ordinal} (the driver reports {count})")
        }
        other => format!("the GPU could not be opened: {other}"),
    }
}

/// Measures the device-to-device copy bandwidth: a copy of `bytes` (1 GiB, less where memory is
/// short) timed with CUDA events, one warm-up and the median of five, counting the bytes read
/// plus the bytes written. Returns (GB/s, bytes copied).
///
/// # Errors
/// Driver errors.
pub fn copy_bandwidth(gpu: &Gpu) -> Result<(f64, u64)> {
    let free = gpu.available_memory()?;
    let mut bytes = COPY_BYTES;
    while bytes > (1 << 24) && 2 * bytes + (256 << 20) > free {
        bytes /= 2;
    }
    let words = bytes / 4;
    let src = DeviceVec::<u32>::zeros(gpu, words)?;
    let mut dst = DeviceVec::<u32>::zeros(gpu, words)?;
    let stream = gpu.stream().clone();
    let mut copy = || -> Result<()> {
        stream
            .memcpy_dtod(src.slice(), dst.slice_mut())
            .map_err(|e| Error::new(format!("device-to-device copy: {e}")))
    };
    copy()?;
    gpu.synchronize()?;
    let mut timer = gpu.timer()?;
    let mut times = Vec::new();
    for _ in 0..5 {
        timer.start()?;
        copy()?;
        timer.stop()?;
        times.push(f64::from(timer.elapsed_ms()?));
    }
    let t = Timings::of(&times).ok_or_else(|| Error::new("copy bandwidth: no valid timing"))?;
    let moved = 2.0 * (words * 4) as f64;
    Ok((moved / (t.median_ms * 1e6), (words * 4) as u64))
}

/// The device record of `gpu`, with its measured copy bandwidth.
///
/// # Errors
/// Driver errors.
pub fn device_record(gpu: &Gpu, reason: &str) -> Result<DeviceRecord> {
    let (major, minor) = gpu.compute_capability();
    let driver = gpu.driver_version().map(|(a, b)| format!("{a}.{b}")).ok();
    let memory = gpu.memory_info().map(|(_, total)| total as u64).ok();
    let (gbs, bytes) =
        crate::progress::step("measuring the copy bandwidth", || copy_bandwidth(gpu)).0?;
    Ok(DeviceRecord {
        kind: "gpu".into(),
        name: gpu.name().to_string(),
        reason: reason.to_string(),
        driver_version: driver,
        compute_capability: Some(format!("{major}.{minor}")),
        sm_count: Some(gpu.sm_count()),
        memory_bytes: memory,
        copy_bandwidth_gbs: Some(gbs),
        copy_bytes: Some(bytes),
        cpu_threads: rayon::current_num_threads(),
    })
}

/// A case ready to launch: its buffers allocated, its reference computed.
pub trait Launch {
    /// Enqueues one run on the stream (no synchronization).
    fn launch(&mut self) -> Result<()>;
    /// Runs once on fresh inputs, outputs poisoned with NaN first, and returns the relative L2
    /// error against the f64 reference.
    fn check(&mut self) -> Result<f64>;
    /// What the algorithm choice said (plans), if anything.
    fn choice(&self) -> Option<String> {
        None
    }
    /// What building the case's plan cost (plans), if anything.
    fn plan_build(&self) -> Option<PlanBuild> {
        None
    }
}

/// A case ready to launch, or why it does not run.
pub enum Prepared<'a> {
    /// Ready.
    Ready(Box<dyn Launch + 'a>),
    /// Not supported for this configuration (the reason).
    Unsupported(String),
}

/// One configuration's inputs on the GPU, and the references and op inputs its cases need,
/// computed once on first use.
pub struct GpuConfig<'a, T: DType> {
    gpu: &'a Gpu,
    csr: &'a Csr,
    /// The graph on the GPU, shared by every case's plan (its uploads made once).
    graph: &'a Arc<DeviceGraph>,
    dev: &'a DeviceCsr,
    host: HostInputs<T>,
    q: DeviceMatrix<T>,
    k: DeviceMatrix<T>,
    v: DeviceMatrix<T>,
    check: bool,
    /// The row order the attention plans are asked for.
    reorder: spattn_formats::Reorder,
    host_f64: Option<[Vec<f64>; 3]>,
    attention_ref: Option<Vec<f64>>,
    sddmm_ref: Option<Vec<f64>>,
    /// SDDMM scores on the GPU, and their host copy when checking.
    op_scores: Option<(DeviceVec<f32>, Vec<f32>)>,
    softmax_ref: Option<Vec<f64>>,
    /// Softmax of `op_scores` on the GPU, and its host copy when checking.
    op_probs: Option<(DeviceVec<f32>, Vec<f32>)>,
    spmm_ref: Option<Vec<f64>>,
    /// `op_scores` in ME-BCRS slots (softmax-tc's input).
    tc_scores: Option<EdgeValues>,
    /// `op_probs` in ME-BCRS slots (spmm-tc's input).
    tc_probs: Option<EdgeValues>,
    /// dQ, dK, dV of the f64 backward with dOut = Q (the train-step cases' reference).
    backward_ref: Option<[Vec<f64>; 3]>,
}

impl<'a, T: DType> GpuConfig<'a, T> {
    /// Uploads `host` for `graph` (whose host CSR is `csr`).
    ///
    /// # Errors
    /// Allocation or copy failures.
    pub fn new(
        gpu: &'a Gpu,
        csr: &'a Csr,
        graph: &'a Arc<DeviceGraph>,
        host: HostInputs<T>,
        check: bool,
    ) -> Result<Self> {
        let dev = graph.csr()?;
        let q = DeviceMatrix::from_host(gpu, host.shape_q, &host.q)?;
        let k = DeviceMatrix::from_host(gpu, host.shape_kv, &host.k)?;
        let v = DeviceMatrix::from_host(gpu, host.shape_kv, &host.v)?;
        Ok(GpuConfig {
            gpu,
            csr,
            graph,
            dev,
            host,
            q,
            k,
            v,
            check,
            reorder: spattn_formats::Reorder::Auto,
            host_f64: None,
            attention_ref: None,
            sddmm_ref: None,
            op_scores: None,
            softmax_ref: None,
            op_probs: None,
            spmm_ref: None,
            tc_scores: None,
            tc_probs: None,
            backward_ref: None,
        })
    }

    /// Sets the row order the attention plans are asked for (`--reorder`; `Auto` by default).
    pub fn with_reorder(mut self, reorder: spattn_formats::Reorder) -> Self {
        self.reorder = reorder;
        self
    }

    /// The ME-BCRS of the tensor-core op cases, uploaded once (in the graph's op order, see
    /// [`shared_graph`]).
    fn ensure_tc_graph(&mut self) -> Result<()> {
        self.graph.mebcrs()?;
        Ok(())
    }

    /// `op_scores` (or, with `probs`, `op_probs`) copied into ME-BCRS slots.
    fn ensure_tc_input(&mut self, probs: bool) -> Result<()> {
        self.ensure_tc_graph()?;
        if probs {
            self.ensure_op_probs()?;
        } else {
            self.ensure_op_scores()?;
        }
        let slot = if probs {
            &self.tc_probs
        } else {
            &self.tc_scores
        };
        if slot.is_some() {
            return Ok(());
        }
        let graph = self.graph;
        let src = if probs {
            &self.op_probs
        } else {
            &self.op_scores
        };
        let (values, _) = src.as_ref().expect("set just above");
        let csr = EdgeValues::from_vec(graph, EdgeLayout::Csr, self.heads(), values.try_clone()?)?;
        let slots = csr.into_layout(self.gpu, graph, EdgeLayout::Slots)?;
        if probs {
            self.tc_probs = Some(slots);
        } else {
            self.tc_scores = Some(slots);
        }
        Ok(())
    }

    fn heads(&self) -> usize {
        self.host.shape_q.heads
    }

    fn edges(&self) -> usize {
        self.csr.nnz() * self.heads()
    }

    fn ensure_host_f64(&mut self) {
        if self.host_f64.is_none() {
            let h = &self.host;
            self.host_f64 = Some([to_f64(&h.q), to_f64(&h.k), to_f64(&h.v)]);
        }
    }

    fn ensure_attention_ref(&mut self) -> Result<()> {
        if self.attention_ref.is_some() {
            return Ok(());
        }
        self.ensure_host_f64();
        let [q, k, v] = self.host_f64.as_ref().expect("set just above");
        let (s_q, s_kv) = (self.host.shape_q, self.host.shape_kv);
        let inputs = cpu::AttentionInputs::new(q, s_q, k, s_kv, v, s_kv);
        let mut out = vec![0.0f64; s_q.len()];
        let scale = f64::from(self.host.scale);
        let (r, _) = crate::progress::step("computing the f64 reference", || {
            cpu::attention(self.csr, &inputs, scale, &mut out)
        });
        r?;
        self.attention_ref = Some(out);
        Ok(())
    }

    fn ensure_sddmm_ref(&mut self) -> Result<()> {
        if self.sddmm_ref.is_some() {
            return Ok(());
        }
        self.ensure_host_f64();
        let [q, k, _] = self.host_f64.as_ref().expect("set just above");
        let mut out = vec![0.0f64; self.edges()];
        let scale = f64::from(self.host.scale);
        cpu::sddmm(
            self.csr,
            q,
            k,
            self.host.shape_q,
            self.host.shape_kv,
            scale,
            &mut out,
        )?;
        self.sddmm_ref = Some(out);
        Ok(())
    }

    fn ensure_op_scores(&mut self) -> Result<()> {
        if self.op_scores.is_some() {
            return Ok(());
        }
        let mut scores = DeviceVec::<f32>::zeros(self.gpu, self.edges())?;
        csr_ops::sddmm(
            self.gpu,
            self.dev,
            &self.q,
            &self.k,
            self.host.scale,
            &mut scores,
        )?;
        let host = if self.check {
            scores.to_host()?
        } else {
            Vec::new()
        };
        self.op_scores = Some((scores, host));
        Ok(())
    }

    fn ensure_softmax_ref(&mut self) -> Result<()> {
        if self.softmax_ref.is_some() {
            return Ok(());
        }
        self.ensure_op_scores()?;
        let (_, scores) = self.op_scores.as_ref().expect("set just above");
        let scores = crate::inputs::to_f64(scores);
        let mut out = vec![0.0f64; scores.len()];
        cpu::edge_softmax(self.csr, &scores, self.heads(), None, &mut out)?;
        self.softmax_ref = Some(out);
        Ok(())
    }

    fn ensure_op_probs(&mut self) -> Result<()> {
        if self.op_probs.is_some() {
            return Ok(());
        }
        self.ensure_op_scores()?;
        let (scores, _) = self.op_scores.as_ref().expect("set just above");
        let mut probs = scores.try_clone()?;
        csr_ops::edge_softmax_in_place(self.gpu, self.dev, &mut probs, self.heads(), None)?;
        let host = if self.check {
            probs.to_host()?
        } else {
            Vec::new()
        };
        self.op_probs = Some((probs, host));
        Ok(())
    }

    fn ensure_backward_ref(&mut self) -> Result<()> {
        if self.backward_ref.is_some() {
            return Ok(());
        }
        self.ensure_host_f64();
        let [q, k, v] = self.host_f64.as_ref().expect("set just above");
        let (s_q, s_kv) = (self.host.shape_q, self.host.shape_kv);
        let inputs = cpu::AttentionInputs::new(q, s_q, k, s_kv, v, s_kv);
        let scale = f64::from(self.host.scale);
        let (r, _) = crate::progress::step("computing the f64 backward reference", || {
            cpu::attention_backward_f64_from(self.csr, &inputs, scale, q)
        });
        let g = r?;
        self.backward_ref = Some([g.dq, g.dk, g.dv]);
        Ok(())
    }

    fn ensure_spmm_ref(&mut self) -> Result<()> {
        if self.spmm_ref.is_some() {
            return Ok(());
        }
        self.ensure_op_probs()?;
        self.ensure_host_f64();
        let (_, p) = self.op_probs.as_ref().expect("set just above");
        let p = crate::inputs::to_f64(p);
        let [_, _, v] = self.host_f64.as_ref().expect("set just above");
        let mut out = vec![0.0f64; self.host.shape_q.len()];
        cpu::spmm(self.csr, &p, v, self.host.shape_kv, &mut out)?;
        self.spmm_ref = Some(out);
        Ok(())
    }
}

/// Checks, warms up and times `case`: the check run (when asked), `warmup` runs, then `reps`
/// runs each between two CUDA events. Errors end up in [`Measured::error`].
pub fn measure(
    gpu: &Gpu,
    timer: &mut GpuTimer,
    case: &mut dyn Launch,
    settings: RunSettings,
) -> Measured {
    let mut m = Measured {
        choice: case.choice(),
        plan: case.plan_build(),
        ..Measured::default()
    };
    if let Err(e) = measure_into(gpu, timer, case, settings, &mut m) {
        m.error = Some(e.to_string());
    }
    m
}

fn measure_into(
    gpu: &Gpu,
    timer: &mut GpuTimer,
    case: &mut dyn Launch,
    settings: RunSettings,
    m: &mut Measured,
) -> Result<()> {
    if settings.check {
        m.rel_error = Some(case.check()?);
    }
    let mut progress = crate::progress::Counter::new(
        "warm-up and timed runs",
        u64::from(settings.warmup + settings.reps),
    );
    for _ in 0..settings.warmup {
        case.launch()?;
        progress.inc();
    }
    gpu.synchronize()?;
    let mut times = Vec::with_capacity(settings.reps as usize);
    for _ in 0..settings.reps {
        timer.start()?;
        case.launch()?;
        timer.stop()?;
        times.push(f64::from(timer.elapsed_ms()?));
        progress.inc();
    }
    m.timings = Timings::of(&times);
    if m.timings.is_none() {
        return Err(Error::new("the CUDA events gave no valid time"));
    }
    Ok(())
}

/// `csr` on `gpu` as the benchmark cases share it: uploads made lazily and once, the per-call
/// tensor-core ops on the ME-BCRS in the row order with the fewest vectors (as the attention
/// plans'; the ops take and return the graph's own order either way).
pub fn shared_graph(gpu: &Gpu, csr: &Csr) -> Arc<DeviceGraph> {
    Arc::new(DeviceGraph::new(gpu, csr.clone()).with_op_reorder(spattn_formats::Reorder::Auto))
}

/// The GPU, the graph uploaded on it, and the settings of a run's configurations.
pub struct GpuRun<'a> {
    /// The GPU.
    pub gpu: &'a Gpu,
    /// The timer every case reuses.
    pub timer: &'a mut GpuTimer,
    /// The graph on the host (for the references).
    pub csr: &'a Csr,
    /// The graph on the GPU (shared by the cases' plans).
    pub graph: &'a Arc<DeviceGraph>,
    /// Warm-up, reps, check.
    pub settings: RunSettings,
}

/// Runs `cases` on one configuration of one graph: uploads `host` once and measures each case
/// in turn, calling `done` after each.
///
/// # Errors
/// Only failures to upload the inputs; a case's own failure is in its [`Measured`].
pub fn run_config<T: DType>(
    run: &mut GpuRun<'_>,
    host: HostInputs<T>,
    cases: &[&Case],
    done: &mut dyn FnMut(&Case, Measured),
) -> Result<()> {
    let mut cfg = GpuConfig::new(run.gpu, run.csr, run.graph, host, run.settings.check)?
        .with_reorder(run.settings.reorder);
    for case in cases {
        let measured = match prepare(case, &mut cfg) {
            Ok(Prepared::Ready(mut launch)) => {
                measure(run.gpu, run.timer, launch.as_mut(), run.settings)
            }
            Ok(Prepared::Unsupported(why)) => Measured {
                skipped: Some(why),
                ..Measured::default()
            },
            Err(e) => Measured {
                error: Some(e.to_string()),
                ..Measured::default()
            },
        };
        done(case, measured);
    }
    Ok(())
}
