//! Each case made ready to launch on one configuration ([`prepare`]): its plan built, its
//! buffers allocated; and per runner, its timed launch and its check against the reference.

use spattn::{AttentionConfig, AttentionPlan};
use spattn_ops::cpu;
use std::sync::Arc;

use spattn_ops::{csr_ops, DType, DeviceCsr, DeviceMatrix, DeviceVec, Gpu};
use spattn_ops::{DeviceGraph, EdgeLayout, EdgeValues, Engine};

use super::{GpuConfig, Launch, Prepared};
use crate::cases::{Case, Runner};
use crate::error::{Error, Result};
use crate::inputs::to_f64;
use crate::measure::PlanBuild;

/// Builds a plan on `graph`, timing it (a spinner labelled `label` on a terminal).
fn build_plan(
    graph: &Arc<DeviceGraph>,
    config: AttentionConfig,
    label: &str,
) -> Result<(AttentionPlan, PlanBuild)> {
    let ((built, secs), host_peak_bytes) = crate::memory::host_peak(|| {
        crate::progress::step(label, || AttentionPlan::on_graph(graph, config))
    });
    let plan = built?;
    let build = PlanBuild {
        ms: secs * 1e3,
        graph_device_bytes: graph.device_bytes() as u64,
        host_peak_bytes,
    };
    Ok((plan, build))
}

/// Prepares `case` on `cfg`: computes what it needs first (op inputs, the reference when
/// checking, the plan), then allocates its buffers.
///
/// # Errors
/// Allocation, upload, planning and reference failures; a case of another backend.
pub fn prepare<'a, T: DType>(case: &Case, cfg: &'a mut GpuConfig<'_, T>) -> Result<Prepared<'a>> {
    let check = cfg.check;
    let mut plan = None;
    match case.runner {
        Runner::SddmmCsr => {
            if check {
                cfg.ensure_sddmm_ref()?;
            }
        }
        Runner::SoftmaxCsr => {
            cfg.ensure_op_scores()?;
            if check {
                cfg.ensure_softmax_ref()?;
            }
        }
        Runner::SpmmCsr => {
            cfg.ensure_op_probs()?;
            if check {
                cfg.ensure_spmm_ref()?;
            }
        }
        Runner::UnfusedCsr => {
            if check {
                cfg.ensure_attention_ref()?;
            }
        }
        Runner::SddmmTc | Runner::SoftmaxTc | Runner::SpmmTc => {
            if cfg.gpu.compute_capability() < (8, 0) {
                return Ok(Prepared::Unsupported(
                    "tensor-core ops need compute capability 8.0".into(),
                ));
            }
            match case.runner {
                Runner::SddmmTc => cfg.ensure_tc_graph()?,
                Runner::SoftmaxTc => cfg.ensure_tc_input(false)?,
                _ => cfg.ensure_tc_input(true)?,
            }
            if check {
                match case.runner {
                    Runner::SddmmTc => cfg.ensure_sddmm_ref()?,
                    Runner::SoftmaxTc => cfg.ensure_softmax_ref()?,
                    _ => cfg.ensure_spmm_ref()?,
                }
            }
        }
        Runner::Plan(algorithm) => {
            let s = cfg.host.shape_q;
            let config = AttentionConfig::new(s.heads, s.head_dim, T::KIND)
                .with_algorithm(algorithm)
                .with_scale(cfg.host.scale)
                .with_reorder(cfg.reorder);
            if !AttentionPlan::supports(cfg.gpu, algorithm, &config) {
                return Ok(Prepared::Unsupported(format!(
                    "AttentionPlan does not support {algorithm} for H={} D={} {} on this GPU in this build",
                    s.heads,
                    s.head_dim,
                    T::KIND
                )));
            }
            if check {
                cfg.ensure_attention_ref()?;
            }
            plan = Some(build_plan(
                cfg.graph,
                config,
                &format!("planning {algorithm}"),
            )?);
        }
        Runner::TrainStep(..) => {
            let s = cfg.host.shape_q;
            let config = AttentionConfig::new(s.heads, s.head_dim, T::KIND)
                .with_scale(cfg.host.scale)
                .with_reorder(cfg.reorder);
            if check {
                cfg.ensure_backward_ref()?;
            }
            plan = Some(build_plan(cfg.graph, config, "planning the train step")?);
        }
        Runner::CpuUnfused => {
            return Err(Error::new(format!("{} is a CPU case", case.name)));
        }
    }
    let cfg: &'a GpuConfig<'_, T> = cfg;
    let (gpu, dev, heads) = (cfg.gpu, cfg.dev, cfg.heads());
    let edges = cfg.edges();
    let launch: Box<dyn Launch + 'a> = match (case.runner, plan) {
        (Runner::SddmmCsr, _) => Box::new(SddmmCase {
            gpu,
            dev,
            q: &cfg.q,
            k: &cfg.k,
            scale: cfg.host.scale,
            scores: DeviceVec::zeros(gpu, edges)?,
            reference: cfg.sddmm_ref.as_deref(),
        }),
        (Runner::SoftmaxCsr, _) => {
            let (scores, host) = cfg
                .op_scores
                .as_ref()
                .ok_or_else(|| Error::new("the softmax input was not computed"))?;
            Box::new(SoftmaxCase {
                gpu,
                dev,
                heads,
                input: host,
                work: scores.try_clone()?,
                reference: cfg.softmax_ref.as_deref(),
            })
        }
        (Runner::SpmmCsr, _) => Box::new(SpmmCase {
            gpu,
            dev,
            p: &cfg
                .op_probs
                .as_ref()
                .ok_or_else(|| Error::new("the SpMM input was not computed"))?
                .0,
            v: &cfg.v,
            out: DeviceMatrix::zeros(gpu, cfg.host.shape_q)?,
            reference: cfg.spmm_ref.as_deref(),
        }),
        (Runner::UnfusedCsr, _) => Box::new(UnfusedCase {
            gpu,
            dev,
            q: &cfg.q,
            k: &cfg.k,
            v: &cfg.v,
            scale: cfg.host.scale,
            heads,
            scores: DeviceVec::zeros(gpu, edges)?,
            out: DeviceMatrix::zeros(gpu, cfg.host.shape_q)?,
            reference: cfg.attention_ref.as_deref(),
        }),
        (Runner::SddmmTc | Runner::SoftmaxTc | Runner::SpmmTc, _) => {
            let graph: &DeviceGraph = cfg.graph;
            let (input, reference) = match case.runner {
                Runner::SddmmTc => (None, cfg.sddmm_ref.as_deref()),
                Runner::SoftmaxTc => (cfg.tc_scores.as_ref(), cfg.softmax_ref.as_deref()),
                _ => (cfg.tc_probs.as_ref(), cfg.spmm_ref.as_deref()),
            };
            let work = match input {
                Some(x) => EdgeValues::from_vec(graph, x.layout(), heads, x.values().try_clone()?)?,
                None => EdgeValues::zeros(gpu, graph, EdgeLayout::Slots, heads)?,
            };
            Box::new(TcOpCase {
                gpu,
                graph,
                runner: case.runner,
                q: &cfg.q,
                k: &cfg.k,
                v: &cfg.v,
                scale: cfg.host.scale,
                input,
                work,
                out: DeviceMatrix::zeros(gpu, cfg.host.shape_q)?,
                reference,
            })
        }
        (Runner::Plan(_), Some((plan, build))) => Box::new(PlanCase {
            plan,
            build,
            q: &cfg.q,
            k: &cfg.k,
            v: &cfg.v,
            out: DeviceMatrix::zeros(gpu, cfg.host.shape_q)?,
            reference: cfg.attention_ref.as_deref(),
        }),
        (Runner::TrainStep(kernels, keep), Some((plan, build))) => Box::new(TrainStepCase {
            stats: if keep { Some(plan.row_stats()?) } else { None },
            plan,
            build,
            kernels,
            q: &cfg.q,
            k: &cfg.k,
            v: &cfg.v,
            out: DeviceMatrix::zeros(gpu, cfg.host.shape_q)?,
            dq: DeviceMatrix::zeros(gpu, cfg.host.shape_q)?,
            dk: DeviceMatrix::zeros(gpu, cfg.host.shape_kv)?,
            dv: DeviceMatrix::zeros(gpu, cfg.host.shape_kv)?,
            reference: cfg.backward_ref.as_ref(),
        }),
        (Runner::Plan(_) | Runner::TrainStep(..), None) | (Runner::CpuUnfused, _) => {
            return Err(Error::new(format!("{} cannot run on the GPU", case.name)));
        }
    };
    Ok(Prepared::Ready(launch))
}

fn compare<X: Copy + Into<f64> + Sync>(out: &[X], reference: Option<&[f64]>) -> Result<f64> {
    let reference = reference.ok_or_else(|| Error::new("no reference was computed"))?;
    Ok(cpu::rel_l2_error(out, reference))
}

/// sddmm-tc, softmax-tc or spmm-tc: the tensor-core op on ME-BCRS slots. Checks convert the
/// slot-layout output back to CSR order (dropping padding slots) before comparing.
struct TcOpCase<'a, T: DType> {
    gpu: &'a Gpu,
    graph: &'a DeviceGraph,
    runner: Runner,
    q: &'a DeviceMatrix<T>,
    k: &'a DeviceMatrix<T>,
    v: &'a DeviceMatrix<T>,
    scale: f32,
    /// The slot-layout scores (softmax) or probabilities (SpMM) the op starts from.
    input: Option<&'a EdgeValues>,
    /// SDDMM's output, or softmax's in-place buffer.
    work: EdgeValues,
    /// SpMM's output.
    out: DeviceMatrix<T>,
    reference: Option<&'a [f64]>,
}

impl<T: DType> Launch for TcOpCase<'_, T> {
    fn launch(&mut self) -> Result<()> {
        let tc = Engine::TensorCore;
        match self.runner {
            Runner::SddmmTc => spattn_ops::sddmm(
                self.gpu,
                self.graph,
                tc,
                self.q,
                self.k,
                self.scale,
                &mut self.work,
            )?,
            Runner::SoftmaxTc => {
                spattn_ops::edge_softmax_in_place(self.gpu, self.graph, tc, &mut self.work, None)?
            }
            _ => {
                let p = self
                    .input
                    .ok_or_else(|| Error::new("spmm-tc has no probabilities"))?;
                spattn_ops::spmm(self.gpu, self.graph, tc, p, self.v, &mut self.out)?
            }
        }
        Ok(())
    }
    fn check(&mut self) -> Result<f64> {
        match self.runner {
            Runner::SpmmTc => {
                self.out.fill_nan()?;
                self.launch()?;
                compare(&to_f64(&self.out.to_host()?), self.reference)
            }
            _ => {
                match self.input {
                    Some(x) => self
                        .work
                        .values_mut()
                        .copy_from_host(&x.values().to_host()?)?,
                    None => self.work.values_mut().fill_nan()?,
                }
                self.launch()?;
                let csr = self.work.to_layout(self.gpu, self.graph, EdgeLayout::Csr)?;
                compare(&csr.values().to_host()?, self.reference)
            }
        }
    }
}

struct SddmmCase<'a, T: DType> {
    gpu: &'a Gpu,
    dev: &'a DeviceCsr,
    q: &'a DeviceMatrix<T>,
    k: &'a DeviceMatrix<T>,
    scale: f32,
    scores: DeviceVec<f32>,
    reference: Option<&'a [f64]>,
}

impl<T: DType> Launch for SddmmCase<'_, T> {
    fn launch(&mut self) -> Result<()> {
        Ok(csr_ops::sddmm(
            self.gpu,
            self.dev,
            self.q,
            self.k,
            self.scale,
            &mut self.scores,
        )?)
    }
    fn check(&mut self) -> Result<f64> {
        self.scores.fill_nan()?;
        self.launch()?;
        compare(&self.scores.to_host()?, self.reference)
    }
}

struct SoftmaxCase<'a> {
    gpu: &'a Gpu,
    dev: &'a DeviceCsr,
    heads: usize,
    /// The scores the check starts from (the work buffer is softmaxed again on every run).
    input: &'a [f32],
    work: DeviceVec<f32>,
    reference: Option<&'a [f64]>,
}

impl Launch for SoftmaxCase<'_> {
    fn launch(&mut self) -> Result<()> {
        // In place, as unfused-csr runs it: the timed runs softmax the previous run's
        // probabilities, the same work on the same bytes.
        Ok(csr_ops::edge_softmax_in_place(
            self.gpu,
            self.dev,
            &mut self.work,
            self.heads,
            None,
        )?)
    }
    fn check(&mut self) -> Result<f64> {
        self.work.copy_from_host(self.input)?;
        self.launch()?;
        compare(&self.work.to_host()?, self.reference)
    }
}

struct SpmmCase<'a, T: DType> {
    gpu: &'a Gpu,
    dev: &'a DeviceCsr,
    p: &'a DeviceVec<f32>,
    v: &'a DeviceMatrix<T>,
    out: DeviceMatrix<T>,
    reference: Option<&'a [f64]>,
}

impl<T: DType> Launch for SpmmCase<'_, T> {
    fn launch(&mut self) -> Result<()> {
        Ok(csr_ops::spmm(
            self.gpu,
            self.dev,
            self.p,
            self.v,
            &mut self.out,
        )?)
    }
    fn check(&mut self) -> Result<f64> {
        self.out.fill_nan()?;
        self.launch()?;
        compare(&to_f64(&self.out.to_host()?), self.reference)
    }
}

struct UnfusedCase<'a, T: DType> {
    gpu: &'a Gpu,
    dev: &'a DeviceCsr,
    q: &'a DeviceMatrix<T>,
    k: &'a DeviceMatrix<T>,
    v: &'a DeviceMatrix<T>,
    scale: f32,
    heads: usize,
    scores: DeviceVec<f32>,
    out: DeviceMatrix<T>,
    reference: Option<&'a [f64]>,
}

impl<T: DType> Launch for UnfusedCase<'_, T> {
    fn launch(&mut self) -> Result<()> {
        csr_ops::sddmm(
            self.gpu,
            self.dev,
            self.q,
            self.k,
            self.scale,
            &mut self.scores,
        )?;
        csr_ops::edge_softmax_in_place(self.gpu, self.dev, &mut self.scores, self.heads, None)?;
        csr_ops::spmm(self.gpu, self.dev, &self.scores, self.v, &mut self.out)?;
        Ok(())
    }
    fn check(&mut self) -> Result<f64> {
        self.scores.fill_nan()?;
        self.out.fill_nan()?;
        self.launch()?;
        compare(&to_f64(&self.out.to_host()?), self.reference)
    }
}

struct PlanCase<'a, T: DType> {
    plan: AttentionPlan,
    build: PlanBuild,
    q: &'a DeviceMatrix<T>,
    k: &'a DeviceMatrix<T>,
    v: &'a DeviceMatrix<T>,
    out: DeviceMatrix<T>,
    reference: Option<&'a [f64]>,
}

impl<T: DType> Launch for PlanCase<'_, T> {
    fn launch(&mut self) -> Result<()> {
        Ok(self.plan.forward(self.q, self.k, self.v, &mut self.out)?)
    }
    fn check(&mut self) -> Result<f64> {
        self.out.fill_nan()?;
        self.launch()?;
        compare(&to_f64(&self.out.to_host()?), self.reference)
    }
    fn choice(&self) -> Option<String> {
        Some(format!("{}: {}", self.plan.algorithm(), self.plan.choice()))
    }
    fn plan_build(&self) -> Option<PlanBuild> {
        Some(self.build)
    }
}

/// train-step, train-step-per-edge, train-step-unfused: `forward` then `backward_with` on the
/// plan, dOut = Q (with `stats`: `forward_keeping_stats` then `backward_with_stats`). The check
/// compares dQ, dK, dV with the f64 backward and reports the largest error.
struct TrainStepCase<'a, T: DType> {
    /// The forward's row statistics, where the case keeps them.
    stats: Option<spattn::RowStats>,
    plan: AttentionPlan,
    build: PlanBuild,
    kernels: spattn::BackwardKernels,
    q: &'a DeviceMatrix<T>,
    k: &'a DeviceMatrix<T>,
    v: &'a DeviceMatrix<T>,
    out: DeviceMatrix<T>,
    dq: DeviceMatrix<T>,
    dk: DeviceMatrix<T>,
    dv: DeviceMatrix<T>,
    reference: Option<&'a [Vec<f64>; 3]>,
}

impl<T: DType> Launch for TrainStepCase<'_, T> {
    fn launch(&mut self) -> Result<()> {
        if let Some(stats) = &mut self.stats {
            let (q, k, v) = (self.q, self.k, self.v);
            self.plan
                .forward_keeping_stats(q, k, v, &mut self.out, stats)?;
            let grads = (&mut self.dq, &mut self.dk, &mut self.dv);
            self.plan
                .backward_with_stats(self.kernels, q, k, v, &self.out, q, stats, grads)?;
            return Ok(());
        }
        self.plan.forward(self.q, self.k, self.v, &mut self.out)?;
        self.plan.backward_with(
            self.kernels,
            self.q,
            self.k,
            self.v,
            &self.out,
            self.q,
            &mut self.dq,
            &mut self.dk,
            &mut self.dv,
        )?;
        Ok(())
    }
    fn check(&mut self) -> Result<f64> {
        for m in [&mut self.out, &mut self.dq, &mut self.dk, &mut self.dv] {
            m.fill_nan()?;
        }
        self.launch()?;
        let reference = self
            .reference
            .ok_or_else(|| Error::new("no backward reference was computed"))?;
        let mut worst = 0.0f64;
        for (got, want) in [&self.dq, &self.dk, &self.dv].into_iter().zip(reference) {
            worst = worst.max(compare(&to_f64(&got.to_host()?), Some(want))?);
        }
        Ok(worst)
    }
    fn choice(&self) -> Option<String> {
        let kept = match &self.stats {
            Some(_) if self.plan.keeps_row_stats::<T>() => " from the forward's row statistics",
            Some(_) => " (row statistics not kept: not a fused-tc plan of these heads)",
            None => "",
        };
        Some(format!(
            "{}: {} + backward {:?}{kept}",
            self.plan.algorithm(),
            self.plan.choice(),
            self.kernels
        ))
    }
    fn plan_build(&self) -> Option<PlanBuild> {
        Some(self.build)
    }
}
