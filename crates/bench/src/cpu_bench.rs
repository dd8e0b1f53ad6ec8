//! The CPU runner, where there is no GPU (or with `--cpu`): `cpu::attention` in f32, timed with
//! the wall clock.
//!
//! f16 and bf16 runs draw their inputs in that type and compute in f32 (as the GPU kernels
//! accumulate), rounding the output back to it; the time is the f32 computation's.

use std::time::Instant;

use spattn_formats::Csr;
use spattn_ops::{cpu, DType};

use crate::cases::{Case, Runner};
use crate::error::{Error, Result};
use crate::inputs::{to_f64, HostInputs};
use crate::measure::{Measured, RunSettings};
use crate::progress::{step, Counter};
use crate::record::DeviceRecord;
use crate::timing::Timings;

/// The device record of a CPU run.
pub fn device_record(reason: &str) -> DeviceRecord {
    DeviceRecord {
        kind: "cpu".into(),
        name: "CPU".into(),
        reason: reason.to_string(),
        driver_version: None,
        compute_capability: None,
        sm_count: None,
        memory_bytes: None,
        copy_bandwidth_gbs: None,
        copy_bytes: None,
        cpu_threads: rayon::current_num_threads(),
    }
}

/// Runs `cases` (CPU cases only) on one configuration, calling `done` after each.
pub fn run_config<T: DType>(
    csr: &Csr,
    host: &HostInputs<T>,
    cases: &[&Case],
    settings: RunSettings,
    done: &mut dyn FnMut(&Case, Measured),
) {
    for case in cases {
        let mut m = Measured::default();
        if let Err(e) = run_case(case, csr, host, settings, &mut m) {
            m.error = Some(e.to_string());
        }
        done(case, m);
    }
}

fn run_case<T: DType>(
    case: &Case,
    csr: &Csr,
    host: &HostInputs<T>,
    settings: RunSettings,
    m: &mut Measured,
) -> Result<()> {
    if case.runner != Runner::CpuUnfused {
        return Err(Error::new(format!("{} is not a CPU case", case.name)));
    }
    let widen = |x: &[T]| -> Vec<f32> { x.iter().map(|v| v.to_f32()).collect() };
    let (q, k, v) = (widen(&host.q), widen(&host.k), widen(&host.v));
    let (s_q, s_kv) = (host.shape_q, host.shape_kv);
    let inputs = cpu::AttentionInputs::new(&q, s_q, &k, s_kv, &v, s_kv);
    let mut out = vec![0.0f32; s_q.len()];
    let run = |out: &mut [f32]| cpu::attention(csr, &inputs, host.scale, out);
    if settings.check {
        let (checked, _) = step("computing the f64 reference", || -> Result<f64> {
            run(&mut out)?;
            let rounded: Vec<T> = out.iter().map(|&x| T::from_f32(x)).collect();
            let (q64, k64, v64) = (to_f64(&host.q), to_f64(&host.k), to_f64(&host.v));
            let up = cpu::AttentionInputs::new(&q64, s_q, &k64, s_kv, &v64, s_kv);
            let mut reference = vec![0.0f64; s_q.len()];
            cpu::attention(csr, &up, f64::from(host.scale), &mut reference)?;
            Ok(cpu::rel_l2_error(&to_f64(&rounded), &reference))
        });
        m.rel_error = Some(checked?);
    }
    let mut progress = Counter::new(
        format!("{}: warm-up and timed runs", case.name),
        u64::from(settings.warmup + settings.reps),
    );
    for _ in 0..settings.warmup {
        run(&mut out)?;
        progress.inc();
    }
    let mut times = Vec::with_capacity(settings.reps as usize);
    for _ in 0..settings.reps {
        let start = Instant::now();
        run(&mut out)?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        progress.inc();
    }
    m.timings = Timings::of(&times);
    Ok(())
}
